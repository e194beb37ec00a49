"""LayerNorm and RMSNorm over the channels of a channels-first map, read and written where it lies.

Conv nets and their VAEs normalize each position's channels: timm's and ViTDet's LayerNorm2d
written out (`x.mean(1)`), timm's RmsNorm2d, and diffusers' video VAEs' `F.normalize(x, dim=1)`
(Wan's, Qwen-Image's, HunyuanVideo 1.5's), which the rewriter makes a floored RMSNorm. Over the
last dim these are the row kernels of kernels/layer_norm.py; over dim 1 of a contiguous
(N, C, *spatial) map the C values of a position lie S = prod(spatial) apart, and the row kernels
need x copied channels-last first and y copied back: two more passes over the map each way (and
the copy of x is what the backward keeps). Here a program reads a tile of BLOCK_S neighbouring
positions by BLOCK_C channels, contiguous along the positions, and the statistics reduce across
the channels: x is read once (channels that fit one tile) and y written once.

Maths, per position (n, s) over the C channels (`dim`), in fp32 (fp64 for fp64 inputs), the same
as kernels/layer_norm.py's rows (its helpers are shared):

    mean = sum(x) / C (0 for RMSNorm);  rstd = 1 / sqrt(sum((x - mean)^2) / C + eps)
        (corrected two-pass; RMSNorm with clamp_eps: 1 / max(rms, eps), stored negated where floored)
    y    = (x - mean) * rstd * weight[c] + bias[c]
    dx   = rstd * (g - xhat * mean_c(g * xhat) - mean_c(g)),  g = dy * weight[c]  (RMSNorm: no
           mean_c(g) term; a floored position no projection term either)
    dweight[c] = sum over n and s of dy * xhat;  dbias[c] = sum of dy

Shapes: x (*outer, C, *inner), normalized over dim `dim` (C = x.shape[dim]); weight, bias (C,).
Dtypes: fp16 / bf16 / fp32 / fp64 x; weight and bias any float dtype (fp32 master weights, an
L2 norm's fp32 constant scale); y in x's dtype; mean and rstd fp32 (fp64 for fp64), shaped like x
without `dim`. Layouts: x contiguous or with `dim` innermost (channels_last; a transposed (B, L, C))
is read where it lies, another layout copied once; y contiguous or, with `y_channels_last`, with
`dim` innermost: what `F.layer_norm(x.movedim(dim, -1))` returns, moved back, so that a norm of a
permuted view (ConvNeXt's `dwconv(x).permute(0, 2, 3, 1)` then LayerNorm) reads the contiguous
map itself and returns the same tensor; dy is read in its layout (either), dx written in x's.

Kernels (1-D grids, int64 offsets):
  forward   a program per (n, block of BLOCK_S positions): channels that fit one tile are held
            whole (x read once); more channels are walked in blocks of BLOCK_C, three passes
            (mean, the corrected variance, y) re-reading x from L2.
  backward  PROGRAMS_PER_SM x SMs programs, each walking a contiguous range of tiles: each
            position's sums over its channels, then dx; its shares of dweight and dbias kept in one
            row of an fp32 partial buffer, which kernels/layer_norm.py's `_sum_partials` adds up
            in a fixed order (bitwise repeatable, no atomics).
Memory plan: the forward saves x, mean and rstd ((N, S) each); nothing of y's size. Each tensor's
layout is a constexpr of the kernels (X_CL, Y_CL, DY_CL): a tile's offsets, and the order its loads
coalesce in, follow it.
Launch configuration: tuned per shape bucket (autotune/configs.py: channel_norm_fwd, _bwd; not
yet timed on a GPU). Eager calls go through the `channel_norm` dialect, which measures these
kernels against the row kernels on a channels-last copy and PyTorch's norms on one.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..autotune import Tuner, configs, dialects, pow2_bucket
from ..autotune.env import INTERPRET
from ._common import (
    acc_dtype,
    apply_function,
    check_float,
    check_same_device,
    check_shape,
    check_tensor,
    device_sms,
    eager_fast_path,
    next_power_of_2,
    outside_device_modes,
    profiled,
    reference_grads,
    single_backward,
    use_triton,
)
from ._launch import CachedKernel, store_plan
from ._tiles import cdiv
from .layer_norm import (
    _div,
    _norm_bwd_torch,
    _norm_fwd_torch,
    _norm_kernels,
    _row_constants,
    _statistics_of_sums,
    _sum_partials,
    _sum_plan,
    _tile_input_grads,
    _tile_statistics,
    _xhat_and_ds,
    layer_norm_ref,
    rms_norm_ref,
)

# dweight and dbias, the bits of the backward op's `vectors` (as layer_norm_backward's)
DWEIGHT, DBIAS = 1, 2

# =============================================================================================
# Reference: the spec. Tests run it in float64 as the oracle and in the input dtype to measure
# PyTorch's own error.
# =============================================================================================


def channel_norm_ref(x: torch.Tensor, dim: int = 1, weight: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, eps: float = 1e-5, is_rms_norm: bool = False,
                     clamp_eps: bool = False) -> torch.Tensor:
    """The row norms of kernels/layer_norm.py over x's dim `dim` moved last, moved back."""
    moved = x.movedim(dim, -1)
    c = moved.shape[-1:]
    if is_rms_norm:
        y = rms_norm_ref(moved, c, weight, eps, clamp_eps=clamp_eps)
    else:
        y = layer_norm_ref(moved, c, weight, bias, eps)
    return y.movedim(-1, dim)


# =============================================================================================
# Kernels. A tile is BLOCK_S positions (axis 0, contiguous in memory) by BLOCK_C channels (axis
# 1, S apart): the row kernels' helpers apply with a position as a row.
# =============================================================================================


@triton.jit
def _channel_tile(pos, pos_mask, ch, C, S):
    """(offsets from the sample's first value in a channels-first sample, in a channels-last one,
    mask) of a (positions, channels) tile."""
    first = pos[:, None] + ch.to(tl.int64)[None, :] * S
    last = pos.to(tl.int64)[:, None] * C + ch[None, :]
    return first, last, pos_mask[:, None] & (ch < C)[None, :]


@triton.jit
def _in(first, last, CL: tl.constexpr):
    """A tensor's offsets: its channels innermost (CL) or its positions."""
    if CL:
        return last
    else:
        return first


@triton.jit
def _channel_norm_fwd_kernel(
    X,  # in (N, C, S): contiguous, or with X_CL channels-last (N, S, C)
    W, B,  # in (C,) each; unused unless HAS_W, HAS_B
    Y,  # out (N, C, S): contiguous, or with Y_CL channels-last
    MEAN,  # out (N, S); unused for RMSNorm
    RSTD,  # out (N, S)
    C, S, s_tiles, eps,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    IS_RMS_NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, CLAMP_EPS: tl.constexpr,
    ACC: tl.constexpr, X_CL: tl.constexpr = False, Y_CL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    n = pid // s_tiles
    pos = (pid % s_tiles) * BLOCK_S + tl.arange(0, BLOCK_S)
    pos_mask = pos < S
    sample = n.to(tl.int64) * C * S
    X += sample
    Y += sample
    ch0 = tl.arange(0, BLOCK_C)
    if SINGLE_BLOCK:
        first, last, mask = _channel_tile(pos, pos_mask, ch0, C, S)
        x = tl.load(X + _in(first, last, X_CL), mask=mask, other=0.0).to(ACC)
        mean, d, rstd, rstd_stored = _tile_statistics(x, mask, C, eps, IS_RMS_NORM, CLAMP_EPS, ACC)
        y = d * rstd[:, None]
        if HAS_W:
            y *= tl.load(W + ch0, mask=ch0 < C, other=0.0).to(ACC)[None, :]
        if HAS_B:
            y += tl.load(B + ch0, mask=ch0 < C, other=0.0).to(ACC)[None, :]
        tl.store(Y + _in(first, last, Y_CL), y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Pass 1: the mean (RMSNorm: none).
        acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
        if not IS_RMS_NORM:
            for start in range(0, C, BLOCK_C):
                first, last, mask = _channel_tile(pos, pos_mask, start + ch0, C, S)
                acc += tl.load(X + _in(first, last, X_CL), mask=mask, other=0.0).to(ACC)
        mean = _div(tl.sum(acc, axis=1), C, ACC)
        # Pass 2: the squares about it, and the mean's correction (_corrected_moments).
        acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
        acc_d = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
        for start in range(0, C, BLOCK_C):
            first, last, mask = _channel_tile(pos, pos_mask, start + ch0, C, S)
            x = tl.load(X + _in(first, last, X_CL), mask=mask, other=0.0).to(ACC)
            d = tl.where(mask, x - mean[:, None], 0.0)
            acc += d * d
            if not IS_RMS_NORM:
                acc_d += d
        shift, rstd, rstd_stored = _statistics_of_sums(acc_d, acc, C, eps, IS_RMS_NORM, CLAMP_EPS, ACC)
        # Pass 3: y.
        for start in range(0, C, BLOCK_C):
            ch = start + ch0
            first, last, mask = _channel_tile(pos, pos_mask, ch, C, S)
            x = tl.load(X + _in(first, last, X_CL), mask=mask, other=0.0).to(ACC)
            y = ((x - mean[:, None]) - shift[:, None]) * rstd[:, None]
            if HAS_W:
                y *= tl.load(W + ch, mask=ch < C, other=0.0).to(ACC)[None, :]
            if HAS_B:
                y += tl.load(B + ch, mask=ch < C, other=0.0).to(ACC)[None, :]
            tl.store(Y + _in(first, last, Y_CL), y.to(Y.dtype.element_ty), mask=mask)
        mean += shift
    stats = n.to(tl.int64) * S + pos
    if not IS_RMS_NORM:
        tl.store(MEAN + stats, mean, mask=pos_mask)
    tl.store(RSTD + stats, rstd_stored, mask=pos_mask)


@triton.jit
def _channel_tile_grads(X, DY, W, first, last, mask, ch, C, mean, HAS_W: tl.constexpr, X_CL: tl.constexpr,
                        DY_CL: tl.constexpr):
    """d = x - mean, dy and g = dy * weight on a tile, in the accumulation dtype (0 where masked)."""
    x = tl.load(X + _in(first, last, X_CL), mask=mask, other=0.0).to(mean.dtype)
    d = tl.where(mask, x - mean[:, None], 0.0)
    dy = tl.load(DY + _in(first, last, DY_CL), mask=mask, other=0.0).to(mean.dtype)
    if HAS_W:
        g = dy * tl.load(W + ch, mask=ch < C, other=0.0).to(mean.dtype)[None, :]
    else:
        g = dy
    return d, dy, g


@triton.jit
def _channel_norm_bwd_kernel(
    DY,  # in (N, C, S): contiguous, or with DY_CL channels-last
    X,  # in (N, C, S) the saved x: contiguous, or with X_CL channels-last (dx in x's layout)
    W,  # in (C,); unused unless HAS_W
    MEAN,  # in (N, S); unused for RMSNorm
    RSTD,  # in (N, S)
    DX,  # out (N, C, S); unused unless STORE_DX
    PARTIAL,  # out (2, programs, C) fp32: this program's shares of dweight, dbias
    C, S, s_tiles, tiles, tiles_per_program, stride_pk,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    IS_RMS_NORM: tl.constexpr, HAS_W: tl.constexpr, STORE_DX: tl.constexpr, STORE_DW: tl.constexpr,
    STORE_DB: tl.constexpr, ACC: tl.constexpr, X_CL: tl.constexpr = False, DY_CL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    first_tile = pid * tiles_per_program
    last_tile = tl.minimum(first_tile + tiles_per_program, tiles)
    DW_PARTIAL = PARTIAL + pid.to(tl.int64) * C
    DB_PARTIAL = DW_PARTIAL + stride_pk
    ch0 = tl.arange(0, BLOCK_C)
    if SINGLE_BLOCK:
        # tile-shaped accumulators, summed over the positions once at the end
        dw = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
        db = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
    for t in range(first_tile, last_tile):
        n = t // s_tiles
        pos = (t % s_tiles) * BLOCK_S + tl.arange(0, BLOCK_S)
        pos_mask = pos < S
        sample = n.to(tl.int64) * C * S
        stats = n.to(tl.int64) * S + pos
        if IS_RMS_NORM:
            mean = tl.zeros([BLOCK_S], dtype=ACC)
        else:
            mean = tl.load(MEAN + stats, mask=pos_mask, other=0.0)
        rstd = tl.load(RSTD + stats, mask=pos_mask, other=0.0)
        if SINGLE_BLOCK:
            first, last, mask = _channel_tile(pos, pos_mask, ch0, C, S)
            d, dy, g = _channel_tile_grads(X + sample, DY + sample, W, first, last, mask, ch0, C, mean, HAS_W,
                                           X_CL, DY_CL)
            xhat, ds = _tile_input_grads(d, g, rstd, mask, C, IS_RMS_NORM, ACC)
            if STORE_DX:
                tl.store(DX + sample + _in(first, last, X_CL), ds.to(DX.dtype.element_ty), mask=mask)
            if STORE_DW:
                dw += dy * xhat
            if STORE_DB:
                db += dy
        else:
            # The position's three channel sums, then dx; the partial rows are this program's
            # alone (zeroed by the launcher): read-add-write is safe and deterministic.
            acc_dg = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
            acc_g = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
            acc_d = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
            for start in range(0, C, BLOCK_C):
                ch = start + ch0
                first, last, mask = _channel_tile(pos, pos_mask, ch, C, S)
                d, dy, g = _channel_tile_grads(X + sample, DY + sample, W, first, last, mask, ch, C, mean,
                                               HAS_W, X_CL, DY_CL)
                acc_dg += d * g
                if not IS_RMS_NORM:
                    acc_g += g
                    acc_d += d
            shift, c1, c2 = _row_constants(tl.sum(acc_d, axis=1), tl.sum(acc_dg, axis=1),
                                           tl.sum(acc_g, axis=1), rstd, C, IS_RMS_NORM, ACC)
            for start in range(0, C, BLOCK_C):
                ch = start + ch0
                first, last, mask = _channel_tile(pos, pos_mask, ch, C, S)
                d, dy, g = _channel_tile_grads(X + sample, DY + sample, W, first, last, mask, ch, C, mean,
                                               HAS_W, X_CL, DY_CL)
                xhat, ds = _xhat_and_ds(d, g, shift, c1, c2, rstd, mask, IS_RMS_NORM)
                if STORE_DX:
                    tl.store(DX + sample + _in(first, last, X_CL), ds.to(DX.dtype.element_ty), mask=mask)
                ch_mask = ch < C
                if STORE_DW:
                    share = tl.sum(dy * xhat, axis=0)
                    tl.store(DW_PARTIAL + ch, tl.load(DW_PARTIAL + ch, mask=ch_mask) + share, mask=ch_mask)
                if STORE_DB:
                    share = tl.sum(dy, axis=0)
                    tl.store(DB_PARTIAL + ch, tl.load(DB_PARTIAL + ch, mask=ch_mask) + share, mask=ch_mask)
    if SINGLE_BLOCK:
        if STORE_DW:
            tl.store(DW_PARTIAL + ch0, tl.sum(dw, axis=0), mask=ch0 < C)
        if STORE_DB:
            tl.store(DB_PARTIAL + ch0, tl.sum(db, axis=0), mask=ch0 < C)


_fwd = CachedKernel(_channel_norm_fwd_kernel)
_bwd = CachedKernel(_channel_norm_bwd_kernel)


# =============================================================================================
# Launchers: check nothing, allocate the outputs, launch. Tensors in, tensors out.
# =============================================================================================

# A tile holds all the channels when, at that many, it still spans MIN_RUN positions (16: a
# 32-byte sector of a 16-bit map per channel); otherwise blocks of BLOCK_C channels by RUN
# positions (128 bytes of a 16-bit map) are walked. Under the interpreter tiles of at most 128
# values, runs of 4 and 8: tests of a few dozen channels take both paths.
_INTERPRET_TILE = 128 if INTERPRET else None
MIN_RUN, RUN = (4, 8) if INTERPRET else (16, 64)

_FWD_KEY_NAMES = ("device", "dtype", "channels", "positions", "rms", "channels_last")
_BWD_KEY_NAMES = ("device", "dtype", "channels", "positions", "rms", "grads", "channels_last")
_FWD_TUNER = Tuner("channel_norm_fwd", configs.channel_norm_fwd, _FWD_KEY_NAMES)
_BWD_TUNER = Tuner("channel_norm_bwd", configs.channel_norm_bwd, _BWD_KEY_NAMES)
_PLANS: dict[tuple, tuple] = {}


def _tile(cfg: triton.Config, c: int, s: int) -> tuple[int, int, bool, int]:
    """(BLOCK_S, BLOCK_C, all channels in one tile?, warps) of `cfg` for c channels, s positions."""
    tile = cfg.kwargs["TILE"] if _INTERPRET_TILE is None else min(cfg.kwargs["TILE"], _INTERPRET_TILE)
    positions = next_power_of_2(s)
    block_c = next_power_of_2(c)
    single = block_c * min(MIN_RUN, positions) <= tile
    if single:
        block_s = min(max(tile // block_c, 1), positions)
    else:
        block_s = min(RUN, positions)
        block_c = max(tile // block_s, 1)
    return block_s, block_c, single, min(cfg.num_warps, max(1, block_s * block_c // 128))


def _fwd_plan(cfg: triton.Config, n: int, c: int, s: int, flags: dict) -> tuple:
    block_s, block_c, single, warps = _tile(cfg, c, s)
    s_tiles = cdiv(s, block_s)
    meta = {**flags, "BLOCK_S": block_s, "BLOCK_C": block_c, "SINGLE_BLOCK": single, "num_warps": warps}
    return (n * s_tiles,), s_tiles, meta


def _fwd_run(plan: tuple, x, w, b, y, mean, rstd, c: int, s: int, eps: float) -> None:
    grid, s_tiles, meta = plan
    _fwd.run(grid, (x, w, b, y, mean, rstd, c, s, s_tiles, eps), meta)


def _fwd_timed(cfg: triton.Config, x, w, b, y, mean, rstd, eps, n, c, s, flags) -> None:
    """The forward with `cfg` (what the tuner times: it only rewrites the outputs)."""
    _fwd_run(_fwd_plan(cfg, n, c, s, flags), x, w, b, y, mean, rstd, c, s, eps)


def _bwd_plan(cfg: triton.Config, n: int, c: int, s: int, sms: int, flags: dict) -> tuple:
    """PROGRAMS_PER_SM x SMs programs at most, each owning a contiguous range of tiles and one row
    of the partial sums; then the fixed-order sum of those rows (kernels/layer_norm.py's)."""
    block_s, block_c, single, warps = _tile(cfg, c, s)
    s_tiles = cdiv(s, block_s)
    tiles = n * s_tiles
    per_program = cdiv(tiles, max(1, min(tiles, cfg.kwargs["PROGRAMS_PER_SM"] * sms)))
    programs = cdiv(tiles, per_program)
    meta = {**flags, "BLOCK_S": block_s, "BLOCK_C": block_c, "SINGLE_BLOCK": single, "num_warps": warps}
    sum_flags = {"STORE_DW": flags["STORE_DW"], "STORE_DB": flags["STORE_DB"], "STORE_DXB": False}
    sums = _sum_plan(c, programs, sum_flags)
    return (programs,), meta, s_tiles, tiles, per_program, programs, not single, *sums


def _bwd_run(plan: tuple, dy, x, w, mean, rstd, dx, c: int, s: int, acc: torch.dtype) -> tuple:
    """The backward kernel and the partial sums' reduction; returns (dweight, dbias) in `acc`, None
    where not wanted."""
    grid, meta, s_tiles, tiles, per_program, programs, zero, sum_grid, sum_meta = plan
    summed = meta["STORE_DW"] or meta["STORE_DB"]
    partials = (torch.zeros if zero else torch.empty)((2, programs, c) if summed else (1,), dtype=acc,
                                                      device=x.device)
    _bwd.run(grid, (dy, x, w, mean, rstd, dx, partials, c, s, s_tiles, tiles, per_program, programs * c),
             meta)
    vecs = tuple(torch.empty(c, dtype=acc, device=x.device) if meta[k] else None
                 for k in ("STORE_DW", "STORE_DB"))
    if summed:
        outs = (partials if v is None else v for v in (*vecs, None))
        _sum_partials.run(sum_grid, (partials, *outs, programs, c, programs * c), sum_meta)
    return vecs


def _bwd_timed(cfg: triton.Config, dy, x, w, mean, rstd, dx, n, c, s, sms, flags, acc) -> None:
    """The backward with `cfg` (what the tuner times: it rewrites dx and its own partial sums)."""
    _bwd_run(_bwd_plan(cfg, n, c, s, sms, flags), dy, x, w, mean, rstd, dx, c, s, acc)


def _dims(x: torch.Tensor, dim: int) -> tuple[int, int, int]:
    """(N, C, S): the values before dim `dim`, along it, and after it."""
    return math.prod(x.shape[:dim]), x.shape[dim], math.prod(x.shape[dim + 1:])


def _stats_shape(x: torch.Tensor, dim: int) -> tuple[int, ...]:
    return (*x.shape[:dim], *x.shape[dim + 1:])


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def channels_last(t: torch.Tensor, dim: int) -> bool:
    """Whether t lies with its dim `dim` innermost (`t.movedim(dim, -1)` contiguous) and is not
    also contiguous: channels_last, channels_last_3d, a transposed (N, L, C), a permuted view."""
    return not t.is_contiguous() and t.movedim(dim, -1).is_contiguous()


def in_layout(t: torch.Tensor, dim: int, cl: bool) -> torch.Tensor:
    """t with its dim `dim` innermost where `cl`, contiguous otherwise (a copy only where it does
    not lie so already)."""
    if not cl:
        return t.contiguous()
    return t if t.movedim(dim, -1).is_contiguous() else t.movedim(dim, -1).contiguous().movedim(-1, dim)


def empty_in_layout(t: torch.Tensor, dim: int, cl: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor shaped like t: its dim `dim` innermost where `cl`, contiguous otherwise.
    Not a view (an autograd.Function's output that is a view may not be modified in place)."""
    if not cl:
        return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)
    moved = torch.empty(t.movedim(dim, -1).shape, dtype=dtype or t.dtype, device=t.device)
    return torch.empty_strided(t.shape, moved.movedim(-1, dim).stride(), dtype=dtype or t.dtype,
                               device=t.device)


def channel_norm_fwd(x: torch.Tensor, dim: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     eps: float, is_rms_norm: bool, clamp_eps: bool, y_channels_last: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): y in x's dtype, contiguous or with its channels innermost (y_channels_last);
    mean and rstd shaped like x without `dim`, in the accumulation dtype (mean empty for RMSNorm).
    x is read where it lies, contiguous or channels-last; another layout is copied once."""
    acc = _stat_dtype(x)
    x_cl = channels_last(x, dim)
    x = in_layout(x, dim, x_cl)
    n, c, s = _dims(x, dim)
    stats = _stats_shape(x, dim)
    if x.numel() and not use_triton(x):
        return _channel_norm_torch(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last)
    y = empty_in_layout(x, dim, y_channels_last)
    mean = x.new_empty((0,) if is_rms_norm else stats, dtype=acc)
    rstd = x.new_empty(stats, dtype=acc)
    if x.numel() == 0:
        return y, mean, rstd
    # stand-ins for what the kernel does not read (HAS_W, HAS_B; an RMSNorm's mean)
    w_arg, b_arg = (weight if weight is not None else x), (bias if bias is not None else x)
    mean_arg = mean if not is_rms_norm else rstd
    device = x.get_device() if x.is_cuda else -1
    flags = {"IS_RMS_NORM": is_rms_norm, "HAS_W": weight is not None, "HAS_B": bias is not None,
             "CLAMP_EPS": clamp_eps, "ACC": acc_dtype(x.dtype), "X_CL": x_cl, "Y_CL": y_channels_last}
    key = ("fwd", device, x.dtype, n, c, s, *flags.values())
    plan = _PLANS.get(key)
    if plan is None:
        tuning_key = (device, x.dtype, c, pow2_bucket(n * s), is_rms_norm, (x_cl, y_channels_last))
        cfg = _FWD_TUNER.config(tuning_key, _fwd_timed, x, w_arg, b_arg, y, mean_arg, rstd, eps, n, c, s,
                                flags)
        plan = _fwd_plan(cfg, n, c, s, flags)
        if _FWD_TUNER.is_decided(tuning_key):
            store_plan(_PLANS, key, plan)
    _fwd_run(plan, x, w_arg, b_arg, y, mean_arg, rstd, c, s, eps)
    return y, mean, rstd


def channel_norm_bwd(dy: torch.Tensor, x: torch.Tensor, dim: int, weight: torch.Tensor | None,
                     mean: torch.Tensor, rstd: torch.Tensor, is_rms_norm: bool, need_dx: bool = True,
                     vectors: int = DWEIGHT | DBIAS
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias): dx in x's dtype and layout, as channel_norm_fwd read x (None when not
    needed); dweight and dbias (C,) in the accumulation dtype, each None unless asked for in
    `vectors` (dweight only with a weight). dy is read where it lies, contiguous or channels-last."""
    acc = _stat_dtype(x)
    want_dw = bool(vectors & DWEIGHT) and weight is not None
    want_db = bool(vectors & DBIAS)
    x_cl, dy_cl = channels_last(x, dim), channels_last(dy, dim)
    x, dy = in_layout(x, dim, x_cl), in_layout(dy, dim, dy_cl)
    n, c, s = _dims(x, dim)
    if x.numel() and not use_triton(x):
        return _channel_norm_bwd_torch(dy, x, dim, weight, mean, rstd, is_rms_norm, need_dx, want_dw, want_db)
    dx = empty_in_layout(x, dim, x_cl) if need_dx else None
    if x.numel() == 0:
        zeros = (torch.zeros(c, dtype=acc, device=x.device) if want else None for want in (want_dw, want_db))
        return dx, *zeros
    device = x.get_device() if x.is_cuda else -1
    flags = {"IS_RMS_NORM": is_rms_norm, "HAS_W": weight is not None, "STORE_DX": need_dx,
             "STORE_DW": want_dw, "STORE_DB": want_db, "ACC": acc_dtype(x.dtype), "X_CL": x_cl,
             "DY_CL": dy_cl}
    sms = device_sms(x)
    key = ("bwd", device, x.dtype, n, c, s, *flags.values())
    plan = _PLANS.get(key)
    args = (dy, x, weight if weight is not None else x, mean if not is_rms_norm else rstd, rstd,
            dx if need_dx else x)
    if plan is None:
        tuning_key = (device, x.dtype, c, pow2_bucket(n * s), is_rms_norm, (need_dx, want_dw, want_db),
                      (x_cl, dy_cl))
        cfg = _BWD_TUNER.config(tuning_key, _bwd_timed, *args, n, c, s, sms, flags, acc)
        plan = _bwd_plan(cfg, n, c, s, sms, flags)
        if _BWD_TUNER.is_decided(tuning_key):
            store_plan(_PLANS, key, plan)
    dw, db = _bwd_run(plan, *args, c, s, acc)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# PyTorch path for CPU tensors without the interpreter: the row norms' PyTorch maths on the
# channels moved last, the same outputs.
# ---------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, -1).reshape(-1, t.shape[dim])


def _from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int, cl: bool) -> torch.Tensor:
    """Rows (positions, channels) back in like's shape: channels innermost where `cl`, else
    contiguous."""
    y = rows.reshape(like.movedim(dim, -1).shape).movedim(-1, dim)
    return y if cl else y.contiguous()


def _channel_norm_torch(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last=False):
    c = x.shape[dim]
    y, _, mean, rstd = _norm_fwd_torch(_rows(x, dim), c, weight, bias, eps, is_rms_norm, None, None, 0.0,
                                       None, False, clamp_eps=clamp_eps)
    stats = _stats_shape(x, dim)
    y = _from_rows(y, x, dim, y_channels_last)
    return y, mean if is_rms_norm else mean.reshape(stats), rstd.reshape(stats)


def _channel_norm_bwd_torch(dy, x, dim, weight, mean, rstd, is_rms_norm, need_dx, want_dw, want_db):
    c = x.shape[dim]
    dx, _, dw, db, _ = _norm_bwd_torch(_rows(dy, dim), _rows(x, dim), c, weight, mean.reshape(-1),
                                       rstd.reshape(-1), is_rms_norm, None, 0.0, None, False)
    dx = _from_rows(dx, x, dim, channels_last(x, dim)) if need_dx else None
    return dx, dw if want_dw else None, db if want_db else None


# =============================================================================================
# Checks, shared by the registered ops (real and fake) and the eager path
# =============================================================================================


def _check_inputs(x: object, dim: object, weight: object, bias: object, eps: object, is_rms_norm: object,
                  clamp_eps: object) -> int:
    """dim as a non-negative int, once every argument is checked."""
    op = "channel_norm"
    check_tensor(op, "x", x)
    check_float(op, "x", x)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"trifuse.{op}: dim must be an int naming a dim of x (shape {tuple(x.shape)}), "
                         f"got {dim!r}")
    dim %= x.dim()
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        check_tensor(op, name, p)
        check_float(op, name, p)
        check_shape(op, name, p, (x.shape[dim],))
    check_same_device(op, "x", x, weight=weight, bias=bias)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"trifuse.{op}: eps must be a number >= 0, got {eps!r}")
    if is_rms_norm and bias is not None:
        raise ValueError(f"trifuse.{op}: an RMSNorm (rms=True) takes no bias")
    if clamp_eps and not is_rms_norm:
        raise ValueError(f"trifuse.{op}: clamp_eps floors an RMSNorm's rms; it needs rms=True")
    return dim


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see. The forward returns the
# statistics its backward needs; the backward returns empty tensors for gradients not asked for.
# =============================================================================================

Tensor = torch.Tensor
OptTensor = torch.Tensor | None


@torch.library.custom_op("trifuse::channel_norm", mutates_args=())
def _channel_norm_op(x: Tensor, dim: int, weight: OptTensor, bias: OptTensor, eps: float, is_rms_norm: bool,
                     clamp_eps: bool, y_channels_last: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd); mean empty for RMSNorm; y with its dim `dim` innermost where y_channels_last."""
    dim = _check_inputs(x, dim, weight, bias, eps, is_rms_norm, clamp_eps)
    return channel_norm_fwd(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last)


@torch.library.custom_op("trifuse::channel_norm_backward", mutates_args=())
def _channel_norm_backward_op(dy: Tensor, x: Tensor, dim: int, weight: OptTensor, mean: Tensor, rstd: Tensor,
                              is_rms_norm: bool, need_dx: bool,
                              vectors: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias), each empty where not needed; the vectors in the accumulation dtype."""
    dx, dw, db = channel_norm_bwd(dy, x, dim % x.dim(), weight, mean, rstd, is_rms_norm, need_dx, vectors)
    acc = _stat_dtype(x)
    return (dx if dx is not None else x.new_empty(0),
            *(v if v is not None else x.new_empty(0, dtype=acc) for v in (dw, db)))


@_channel_norm_op.register_fake
def _(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last=False):
    dim = _check_inputs(x, dim, weight, bias, eps, is_rms_norm, clamp_eps)
    acc, stats = _stat_dtype(x), _stats_shape(x, dim)
    return (empty_in_layout(x, dim, y_channels_last), x.new_empty((0,) if is_rms_norm else stats, dtype=acc),
            x.new_empty(stats, dtype=acc))


@_channel_norm_backward_op.register_fake
def _(dy, x, dim, weight, mean, rstd, is_rms_norm, need_dx, vectors):
    acc, c = _stat_dtype(x), x.shape[dim]
    return (empty_in_layout(x, dim % x.dim(), channels_last(x, dim % x.dim())) if need_dx else x.new_empty(0),
            x.new_empty(c if vectors & DWEIGHT and weight is not None else 0, dtype=acc),
            x.new_empty(c if vectors & DBIAS else 0, dtype=acc))


def _grad_as(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None or like is None else g.to(like.dtype)


def _setup(ctx, inputs, output):
    x, dim, weight, bias, eps, is_rms_norm, clamp_eps = inputs[:7]
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.dim, ctx.eps, ctx.is_rms_norm, ctx.clamp_eps = dim % x.dim(), eps, is_rms_norm, clamp_eps
    ctx.set_materialize_grads(False)


def _vectors(needs: tuple, weight, bias) -> int:
    """The backward op's `vectors`: the parameters (inputs 2 and 3) that ask for a gradient."""
    return (DWEIGHT if weight is not None and needs[2] else 0) | \
        (DBIAS if bias is not None and needs[3] else 0)


def _op_twice(ctx, dy, *_):
    dx, dw, db = _channel_norm_twice(ctx, dy)
    return dx, None, dw, db, None, None, None, None


@single_backward(twice=_op_twice, op="channel_norm")
def _backward(ctx, dy, *_):
    if dy is None:
        return (None,) * 8
    x, weight, bias, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    vectors = _vectors(needs, weight, bias)
    dx, dw, db = torch.ops.trifuse.channel_norm_backward(dy, x, ctx.dim, weight, mean, rstd, ctx.is_rms_norm,
                                                         needs[0], vectors)
    return (dx if needs[0] else None, None, _grad_as(dw, weight) if vectors & DWEIGHT else None,
            _grad_as(db, bias) if vectors & DBIAS else None, None, None, None, None)


torch.library.register_autograd("trifuse::channel_norm", _backward, setup_context=_setup)


# =============================================================================================
# Eager fast path: a thin autograd.Function straight over the launchers (see DESIGN.md "Host
# overhead"). Same launchers, same bits as the registered op.
# =============================================================================================


def _channel_norm_twice(ctx, dy):
    """(dx, dweight, dbias) in PyTorch ops, differentiable again (create_graph=True)."""
    x, weight, bias, _, _ = ctx.saved_tensors
    needs = ctx.needs_input_grad
    return reference_grads(
        lambda x, w, b: _channel_norm_torch(x, ctx.dim, w, b, ctx.eps, ctx.is_rms_norm, ctx.clamp_eps)[0],
        (x, weight, bias), (needs[0], needs[2], needs[3]), (dy,))


class _ChannelNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last):
        y, mean, rstd = channel_norm_fwd(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.dim, ctx.eps, ctx.is_rms_norm, ctx.clamp_eps = dim, eps, is_rms_norm, clamp_eps
        return y

    @staticmethod
    @single_backward(twice=lambda ctx, dy: _op_twice(ctx, dy))
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        vectors = _vectors(needs, weight, bias)
        with profiled("trifuse::channel_norm_backward"):
            dx, dw, db = channel_norm_bwd(dy, x, ctx.dim, weight, mean, rstd, ctx.is_rms_norm, needs[0],
                                          vectors)
        return (dx, None, _grad_as(dw, weight), _grad_as(db, bias), None, None, None, None)


# =============================================================================================
# Dialect: these kernels, the row kernels on a channels-last copy (moved back), or PyTorch's
# norms on one, whichever is faster for the shape, chosen once per (device, dtype, channels,
# positions bucket, kind, grad) on the GPU and cached on disk (autotune/dialects.py). Traced calls
# always see trifuse::channel_norm.
# =============================================================================================


def _layout(x: torch.Tensor, dim: int) -> str:
    return "contiguous" if x.is_contiguous() else "channels_last" if channels_last(x, dim) else "other"


def _channel_norm_key(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last=False):
    """The dialect key of an eager call; None (the trifuse op decides, and raises on bad input)
    when traced, empty or not fitting. It runs on every call."""
    if not isinstance(x, torch.Tensor) or not eager_fast_path(x, weight, bias) or type(dim) is not int:
        return None
    if not -x.dim() <= dim < x.dim() or x.numel() == 0 or not x.is_floating_point():
        return None
    c = x.shape[dim]
    grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                        or (bias is not None and bias.requires_grad))
    kind = ("rms_floored" if clamp_eps else "rms") if is_rms_norm else "layer"
    return (x.get_device() if x.is_cuda else -1, x.dtype, c, pow2_bucket(x.numel() // c), kind,
            None if weight is None else weight.dtype, bias is not None, grad,
            f"{_layout(x, dim)} -> {'channels_last' if y_channels_last else 'contiguous'}")


def _channel_norm_trifuse(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last=False):
    dim = _check_inputs(x, dim, weight, bias, eps, is_rms_norm, clamp_eps)
    if eager_fast_path(x, weight, bias):
        with profiled("trifuse::channel_norm"):
            return apply_function(_ChannelNormFunction, x, dim, weight, bias, eps, is_rms_norm, clamp_eps,
                                  y_channels_last)
    extra = (True,) if y_channels_last else ()  # (a traced call carries no trailing default)
    return torch.ops.trifuse.channel_norm(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, *extra)[0]


def _moved_back(y: torch.Tensor, dim: int, y_channels_last: bool) -> torch.Tensor:
    """A row norm's y (channels last) as the candidates return it: that dim moved back, contiguous
    unless y_channels_last."""
    y = y.movedim(-1, dim)
    return y if y_channels_last else y.contiguous()


def _channel_norm_rows(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last=False):
    """trifuse's row kernels on x with its channels moved last (a copy unless x lies so), y moved
    back (another unless asked for channels-last): what the rewriter made of these norms before
    this op existed."""
    dim = _check_inputs(x, dim, weight, bias, eps, is_rms_norm, clamp_eps)
    moved = x.movedim(dim, -1).contiguous()
    y = _norm_kernels("rms_norm" if is_rms_norm else "layer_norm", moved, [x.shape[dim]], weight, bias, eps,
                      None, is_rms_norm, clamp_eps=clamp_eps)
    return _moved_back(y, dim, y_channels_last)


def _channel_norm_torch_candidate(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last=False):
    dim = _check_inputs(x, dim, weight, bias, eps, is_rms_norm, clamp_eps)
    moved = x.movedim(dim, -1)
    c = moved.shape[-1:]
    if weight is not None and weight.dtype != x.dtype or bias is not None and bias.dtype != x.dtype:
        # PyTorch's norms take parameters of x's dtype only: in the wider dtype, cast back once
        wide = torch.promote_types(x.dtype, torch.float32)
        moved = moved.to(wide)
        weight = None if weight is None else weight.to(wide)
        bias = None if bias is None else bias.to(wide)
    y = F.rms_norm(moved, c, weight, eps) if is_rms_norm else F.layer_norm(moved, c, weight, bias, eps)
    return _moved_back(y.to(x.dtype), dim, y_channels_last)


def _torch_supports(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, y_channels_last=False) -> str | None:
    return "PyTorch has no RMSNorm floored at eps (F.normalize's)" if clamp_eps else None


def _reference(x, dim=1, weight=None, bias=None, eps=1e-5, is_rms_norm=False, clamp_eps=False,
               y_channels_last=False):
    return channel_norm_ref(x, dim, weight, bias, eps, is_rms_norm, clamp_eps)


CHANNEL_NORM = dialects.define(
    "channel_norm", _channel_norm_key,
    ("device", "dtype", "channels", "positions", "kind", "weight", "bias", "grad", "layout"),
    reference=_reference)
CHANNEL_NORM.register(dialects.Candidate("trifuse", _channel_norm_trifuse))
CHANNEL_NORM.register(dialects.Candidate("rows", _channel_norm_rows))
CHANNEL_NORM.register(dialects.Candidate("torch", _channel_norm_torch_candidate, supports=_torch_supports))


# =============================================================================================
# Public API
# =============================================================================================


@outside_device_modes
def channel_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 eps: float = 1e-5, *, dim: int = 1, rms: bool = False, clamp_eps: bool = False,
                 y_channels_last: bool = False) -> torch.Tensor:
    """LayerNorm (or RMSNorm) over one dim of x, the channels of a channels-first map by default:
    timm's LayerNorm2d / RmsNorm2d, `F.layer_norm` of x with `dim` moved last, moved back.

    Args:
        x: (*outer, C, *inner), fp16 / bf16 / fp32 / fp64; read where it lies when contiguous or
            with its dim `dim` innermost (channels_last, a transposed or permuted view of a
            contiguous tensor), copied once otherwise.
        weight, bias: (C,) or None, any float dtype (y is rounded to x's dtype once).
        eps: added to the variance (the mean square for RMSNorm).
        dim: the dim normalized over (C = x.shape[dim]).
        rms: RMSNorm, y = x * rsqrt(mean(x^2) + eps) * weight (no bias).
        clamp_eps: with rms, y = x / max(rms(x), eps) * weight, no gradient through a floored
            rms: `F.normalize(x, dim=dim, eps=e)` is `channel_norm(x, C ** -0.5 * ones, None,
            e / C ** 0.5, dim=dim, rms=True, clamp_eps=True)`.
        y_channels_last: y with its dim `dim` innermost (what `F.layer_norm` of `x.movedim(dim, -1)`
            returns, moved back); contiguous otherwise.

    Returns:
        y shaped like x, in x's dtype, laid out as y_channels_last says. Gradients reach x, weight
        and bias; the backward recomputes from x and the saved statistics (one fp32 value per
        position each).

    Eager calls run these kernels, the row kernels on a channels-last copy, or PyTorch's norms on
    one, whichever the `channel_norm` dialect measured faster for this shape on this GPU;
    elsewhere, and under torch.compile, these kernels.

    Raises:
        TypeError for non-float tensors; ValueError for a dim x does not have, parameters not (C,),
        tensors on different devices, a negative eps, a bias with rms or clamp_eps without it.
    """
    if y_channels_last:
        return CHANNEL_NORM(x, dim, weight, bias, eps, rms, clamp_eps, True)
    return CHANNEL_NORM(x, dim, weight, bias, eps, rms, clamp_eps)
