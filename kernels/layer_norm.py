"""LayerNorm and RMSNorm, plain and fused with the residual stream.

Maths, per row of N features, accumulated in fp32 (fp64 for fp64 inputs):

    s    = residual + dropout(x + x_bias, p)      residual-stream form; s = x otherwise
           (or residual + gate * x)               a DiT block's gated add, a LayerScale's gamma
                                                  (kernels/adaptive_norm.py); no dropout then
    mean = sum(s) / N                             LayerNorm only (0 for RMSNorm)
    rstd = 1 / sqrt(sum((s - mean)^2) / N + eps)
                                                  two passes, the mean corrected by the second's
                                                  sum(s - mean) / N (_corrected_moments): exact
                                                  to fp32's rounding at a mean of 1e4 +- 1
    y    = (s - mean) * rstd * weight + bias
    y   += post                                   norm-then-add form (post-norm blocks: OLMo 2,
                                                  Gemma 2's sandwich norms); s = x there

Backward, with xhat = (s - mean) * rstd and g = dy * weight (the saved mean, rounded to fp32,
corrected again by the row's mean of s - mean: _tile_grads):

    ds        = rstd * (g - xhat * mean(g * xhat) - mean(g))   (RMSNorm drops the mean(g) term)
                + ds_out                     gradient arriving at the returned s
    dresidual = ds;  dx = ds * keep / (1 - p);  dx_bias = sum_rows(dx)
    (gated)          dx = ds * gate;  dgate = sum_rows(ds * x), in dx_bias's partial sums
    dweight   = sum_rows(dy * xhat);  dbias = sum_rows(dy)
    dpost     = dy                           (the norm-then-add form: no kernel for it)

Shapes: x, residual, y, s (..., *normalized_shape); weight, bias, x_bias normalized_shape.
Dtypes: fp16 / bf16 / fp32 / fp64 activations; weights may differ (fp32 master weights under
autocast). y and s take the activation dtype; mean and rstd are fp32 (fp64 for fp64).

Memory plan: the forward saves s (x for the plain forms), mean and rstd. The dropout mask is
regenerated from (seed, row, column) in the backward; nothing per element is stored for it.
dweight, dbias and dx_bias are reduced deterministically: each backward program owns a row of
an fp32 partial buffer, summed afterwards in a fixed order (bitwise repeatable, no atomics).

Kernels: one row per program in the forward; in the backward each program walks a contiguous
range of rows. Rows up to MAX_SINGLE_BLOCK_* stay in registers in one block; wider rows are
walked in chunks (re-reading the row, which stays in L2) of configs.NORM_WIDE_CHUNK elements, so
any width runs. Compiled for sm_90 (bench/compile_sm90.py), no default spills registers but the
backward of a 16384-wide row in one block (24 bytes with Triton 3.9, 56 with 3.6).
"""
import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..autotune import Tuner, configs, dialects, pow2_bucket
from ._common import (
    DROPOUT_NOT_EXCHANGED,
    FLOAT_DTYPES,
    acc_dtype,
    apply_function,
    as_rows,
    cast,
    check_float,
    check_probability,
    check_same_device,
    check_shape,
    check_tensor,
    ctx_as,
    default_rms_eps,
    device_sms,
    eager_fast_path,
    empty_like,
    next_power_of_2,
    no_autocast,
    outside_device_modes,
    philox_seed,
    profiled,
    reference_grads,
    single_backward,
    unscoped,
    use_triton,
)
from ._launch import CachedKernel, store_plan
from ._random import dropout_keep_quads
from ._tiles import cdiv

# Widest row (elements) kept whole in registers; wider rows are walked in chunks
# (configs.NORM_WIDE_CHUNK).
MAX_SINGLE_BLOCK_FWD = 16384
# The most readers of one narrowed y (fusion/narrow.py) whose gradients the backward sums: q, k, v.
MAX_READERS = 3
MAX_SINGLE_BLOCK_BWD = 16384
# Launch configurations (tile size, warps, backward programs per SM) are tuned per shape bucket
# (autotune/configs.py: norm_fwd, norm_bwd; entry 0 of each is the default, from a sweep on the
# H100 with bench/tune_layer_norm.py, 2026-11-22, bf16): forward tiles of 8192 elements with 8
# warps, backward tiles of 4096 elements and 2 programs per SM for rows up to 2048 wide, one per
# SM past that (each program owns a contiguous range of rows and one row of the fp32 partials).


# =============================================================================================
# Reference: the spec. Tests run it in float64 as the oracle and in the input dtype to measure
# PyTorch's own error.
# =============================================================================================


def layer_norm_ref(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    *,
    is_rms_norm: bool = False,
    dropout_mask: torch.Tensor | None = None,
    p: float = 0.0,
    x_bias: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The residual stream in plain PyTorch: y = norm(residual + dropout(x + x_bias)).

    `dropout_mask` (bool, True = keep) stands in for the kernel's random mask. Returns y, or
    (y, s) when any of residual / dropout_mask / x_bias is given.
    """
    fused = residual is not None or dropout_mask is not None or x_bias is not None
    s = x if x_bias is None else x + x_bias
    if dropout_mask is not None:
        s = s * dropout_mask / (1.0 - p) if p < 1.0 else torch.zeros_like(s)
    if residual is not None:
        s = s + residual
    y = _norm_mixed(s, normalized_shape, weight, bias, eps, is_rms_norm)
    return (y, s) if fused else y


def rms_norm_ref(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    residual: torch.Tensor | None = None,
    clamp_eps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in plain PyTorch, as `rms_norm` (eps None: PyTorch's default, `default_rms_eps`);
    with clamp_eps (no residual), x / max(rms(x), eps) * weight, in fp32 at least."""
    if eps is None:
        eps = default_rms_eps(x.dtype)
    if clamp_eps:
        n = math.prod(normalized_shape)
        acc = torch.promote_types(x.dtype, torch.float32)
        w = None if weight is None else weight.to(acc).reshape(n)
        return _rms_norm_clamped(x.to(acc).reshape(-1, n), w, eps).reshape(x.shape).to(x.dtype)
    return layer_norm_ref(x, normalized_shape, weight, None, eps, residual, is_rms_norm=True)


def _rms_norm_clamped(rows: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """rows / max(rms, eps) * weight: F.normalize's arithmetic (the 2-norm, whose gradient is 0 at
    0, then a clamp) in rms units, differentiable twice."""
    rms = torch.linalg.vector_norm(rows, 2, -1, True) * rows.shape[-1] ** -0.5
    y = rows / rms.clamp_min(eps)
    return y if weight is None else y * weight


def _norm_mixed(s, normalized_shape, weight, bias, eps, is_rms_norm):
    """F.layer_norm / F.rms_norm, also for 16-bit s with fp32 parameters (which CUDA's native
    kernels refuse outside autocast): computed in fp32, returned in s's dtype."""
    if (weight is not None and weight.dtype != s.dtype) or (bias is not None and bias.dtype != s.dtype):
        params = [t for t in (weight, bias) if t is not None]
        wide = functools.reduce(torch.promote_types, [t.dtype for t in params], s.dtype)
        weight = weight.to(wide) if weight is not None else None
        bias = bias.to(wide) if bias is not None else None
        return _norm_mixed(s.to(wide), normalized_shape, weight, bias, eps, is_rms_norm).to(s.dtype)
    if is_rms_norm:
        return F.rms_norm(s, normalized_shape, weight, eps)
    return F.layer_norm(s, normalized_shape, weight, bias, eps)


# =============================================================================================
# Kernels. Both work on tiles of BLOCK_M rows x BLOCK_N features: several narrow rows per
# program keep enough bytes in flight; rows wider than one block use BLOCK_M = 1 and walk the
# row in chunks.
# =============================================================================================


@triton.jit
def _div(total, N, ACC: tl.constexpr):
    """total / N, correctly rounded: Triton's fp32 `/` is approximate, and a 2-ulp error in a
    mean is amplified by rstd (up to 1/sqrt(eps)) in the backward."""
    if ACC == tl.float64:
        return total / N
    else:
        return tl.math.div_rn(total, N * 1.0)


@triton.jit
def _rms_rstd(mean_square, eps, CLAMP_EPS: tl.constexpr):
    """(rstd, the rstd to store) of an RMSNorm row: 1 / sqrt(mean_square + eps), or with CLAMP_EPS
    1 / max(rms, eps) (`F.normalize`'s floor on the norm, in rms units). A floored row's rstd is
    stored negated: the backward's sign that its rms had no gradient (no projection term)."""
    if CLAMP_EPS:
        rms = tl.sqrt(mean_square)
        floored = rms < eps
        rstd = 1.0 / tl.where(floored, eps, rms)
        return rstd, tl.where(floored, -rstd, rstd)
    else:
        rstd = 1.0 / tl.sqrt(mean_square + eps)
        return rstd, rstd


@triton.jit
def _corrected_moments(sum_d, sum_d2, N, ACC: tl.constexpr):
    """(shift, var) from the row sums of d = s - mean0 and of d^2, mean0 a first estimate of s's
    mean: the corrected two-pass algorithm (mean = mean0 + shift, var = mean(d^2) - shift^2).
    mean0's rounding comes back as shift: at a large mean and a small spread (1e3 +- 1) a mean
    summed in fp32 is 1e-4 off, and y = (s - mean) * rstd was as far off (PyTorch's CPU kernel
    1.6e-4 there; with the shift 1e-6, y's own rounding)."""
    shift = _div(sum_d, N, ACC)
    return shift, tl.maximum(_div(sum_d2, N, ACC) - shift * shift, 0.0)


@triton.jit
def _tile_statistics(s, mask, N, eps, IS_RMS_NORM: tl.constexpr, CLAMP_EPS: tl.constexpr, ACC: tl.constexpr):
    """(mean, d, rstd, the rstd to store) of a tile of whole rows (reduced over axis 1; 0 where
    masked): d = s - mean, centred again by the second pass (_corrected_moments), the mean with it;
    RMSNorm: mean 0, d = s (also kernels/channel_norm.py's, a position's channels a row)."""
    if IS_RMS_NORM:
        d = s
        rstd, rstd_stored = _rms_rstd(_div(tl.sum(d * d, axis=1), N, ACC), eps, CLAMP_EPS)
        mean = tl.zeros_like(rstd)
    else:
        mean = _div(tl.sum(s, axis=1), N, ACC)
        d = tl.where(mask, s - mean[:, None], 0.0)
        shift, var = _corrected_moments(tl.sum(d, axis=1), tl.sum(d * d, axis=1), N, ACC)
        mean += shift
        rstd = 1.0 / tl.sqrt(var + eps)
        rstd_stored = rstd
        d -= shift[:, None]
    return mean, d, rstd, rstd_stored


@triton.jit
def _statistics_of_sums(acc_d, acc_d2, N, eps, IS_RMS_NORM: tl.constexpr, CLAMP_EPS: tl.constexpr,
                        ACC: tl.constexpr):
    """(shift, rstd, the rstd to store) of rows walked in chunks, from the tile sums of d = s - mean0
    and d^2 (_corrected_moments; RMSNorm: d = s, no shift)."""
    if IS_RMS_NORM:
        rstd, rstd_stored = _rms_rstd(_div(tl.sum(acc_d2, axis=1), N, ACC), eps, CLAMP_EPS)
        shift = tl.zeros_like(rstd)
    else:
        shift, var = _corrected_moments(tl.sum(acc_d, axis=1), tl.sum(acc_d2, axis=1), N, ACC)
        rstd = 1.0 / tl.sqrt(var + eps)
        rstd_stored = rstd
    return shift, rstd, rstd_stored


@triton.jit
def _load_stream(X, R, XB, GATE, seed, rows, cols, mask, p, scale, N, rows_per_group,
                 HAS_RESIDUAL: tl.constexpr, HAS_X_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 HAS_GATE: tl.constexpr, GROUPED: tl.constexpr, ACC: tl.constexpr):
    """s = residual + gate * dropout(x + x_bias) on a (rows, cols) tile, in ACC; 0 where masked.
    X and R point at the tile's rows already (a (BLOCK_M, 1) block of pointers); the gate is a
    per-feature vector like the affine's (_affine_tile)."""
    s = tl.load(X + cols, mask=mask, other=0.0).to(ACC)
    if HAS_X_BIAS:
        s += tl.load(XB + cols, mask=mask, other=0.0).to(ACC)
    if HAS_DROPOUT:
        s = tl.where(dropout_keep_quads(seed, rows, cols, p), s * scale, 0.0)
    if HAS_GATE:
        s *= _affine_tile(GATE, rows, cols, mask, N, rows_per_group, GROUPED).to(ACC)
    if HAS_RESIDUAL:
        s += tl.load(R + cols, mask=mask, other=0.0).to(ACC)
    return s


@triton.jit
def _affine_tile(V, rows, cols, mask, N, rows_per_group, GROUPED: tl.constexpr):
    """A per-feature vector on a (rows, cols) tile: V (N,) broadcast over the rows, or with
    GROUPED V (G, N) contiguous, row r reading V[r // rows_per_group] (an adaptive norm's
    per-sample modulation folded into the affine: `layer_norm_modulate`)."""
    if GROUPED:
        return tl.load(V + (rows // rows_per_group) * N + cols, mask=mask, other=0.0)
    else:
        return tl.load(V + cols, mask=cols < N)


@triton.jit
def _layer_norm_fwd_kernel(
    X,  # in (M, N)
    R,  # in (M, N) residual; unused unless HAS_RESIDUAL
    P,  # in (M, N) added to y after the norm; unused unless HAS_POST
    XB,  # in (N,) bias added to x before dropout; unused unless HAS_X_BIAS
    W,  # in (N,) weight, or (G, N) with GROUPED; unused unless HAS_W
    B,  # in (N,) bias, or (G, N) with GROUPED; unused unless HAS_B
    SEED,  # in (1,) int64 Philox seed; unused unless HAS_DROPOUT
    Y,  # out (M, N)
    S,  # out (M, N) the residual stream s; Y when not STORE_S (same dtype)
    MEAN,  # out (M,) fp32; unused for RMSNorm
    RSTD,  # out (M,) fp32
    stride_xm, stride_rm, stride_pm, stride_ym, stride_sm,
    M, N, eps, p, scale,
    Y2,  # out (M, N) y once more in another dtype (fusion/narrow.py); unused unless STORE_Y2
    rows_per_group,  # with GROUPED, rows r..r+rows_per_group-1 read row r // rows_per_group of W, B
    GATE,  # in (N,) or with GROUPED (G, N), multiplying x before the residual; unused unless HAS_GATE
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    IS_RMS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_X_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_S: tl.constexpr,
    HAS_POST: tl.constexpr, ACC: tl.constexpr, STORE_Y2: tl.constexpr, GROUPED: tl.constexpr = False,
    HAS_GATE: tl.constexpr = False,
    CLAMP_EPS: tl.constexpr = False,  # RMSNorm's rstd = 1 / max(rms, eps) (_rms_rstd)
):
    # int64 rows: row * stride may pass 2^31
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows2 = rows[:, None]
    X += rows2 * stride_xm
    R += rows2 * stride_rm
    P += rows2 * stride_pm
    Y += rows2 * stride_ym
    Y2 += rows2 * stride_ym
    S += rows2 * stride_sm
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    offs = tl.arange(0, BLOCK_N)[None, :]

    if SINGLE_BLOCK:
        mask = row_mask[:, None] & (offs < N)
        s = _load_stream(X, R, XB, GATE, seed, rows2, offs, mask, p, scale, N, rows_per_group,
                         HAS_RESIDUAL, HAS_X_BIAS, HAS_DROPOUT, HAS_GATE, GROUPED, ACC)
        # Normalize s as stored (rounded to its dtype): the backward reads the stored s.
        s = s.to(S.dtype.element_ty).to(ACC)
        if STORE_S:
            tl.store(S + offs, s.to(S.dtype.element_ty), mask=mask)
        mean, d, rstd, rstd_stored = _tile_statistics(s, mask, N, eps, IS_RMS_NORM, CLAMP_EPS, ACC)
        y = d * rstd[:, None]
        if HAS_W:
            y *= _affine_tile(W, rows2, offs, mask, N, rows_per_group, GROUPED).to(ACC)
        if HAS_B:
            y += _affine_tile(B, rows2, offs, mask, N, rows_per_group, GROUPED).to(ACC)
        if HAS_POST:
            y += tl.load(P + offs, mask=mask, other=0.0).to(ACC)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
        if STORE_Y2:
            tl.store(Y2 + offs, y.to(Y2.dtype.element_ty), mask=mask)
    else:
        # Pass 1: s (stored once), and its mean.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for start in range(0, N, BLOCK_N):
            cols = start + offs
            mask = row_mask[:, None] & (cols < N)
            s = _load_stream(X, R, XB, GATE, seed, rows2, cols, mask, p, scale, N, rows_per_group,
                             HAS_RESIDUAL, HAS_X_BIAS, HAS_DROPOUT, HAS_GATE, GROUPED, ACC)
            s = s.to(S.dtype.element_ty).to(ACC)
            if STORE_S:
                tl.store(S + cols, s.to(S.dtype.element_ty), mask=mask)
            acc += s
        if IS_RMS_NORM:
            mean = tl.zeros([BLOCK_M], dtype=ACC)
        else:
            mean = _div(tl.sum(acc, axis=1), N, ACC)
        # Pass 2: the variance around that mean (two passes: no cancellation for large means),
        # and the mean's correction (_corrected_moments).
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        acc_d = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for start in range(0, N, BLOCK_N):
            cols = start + offs
            mask = row_mask[:, None] & (cols < N)
            s = _load_stream(X, R, XB, GATE, seed, rows2, cols, mask, p, scale, N, rows_per_group,
                             HAS_RESIDUAL, HAS_X_BIAS, HAS_DROPOUT, HAS_GATE, GROUPED, ACC)
            s = s.to(S.dtype.element_ty).to(ACC)
            d = tl.where(mask, s - mean[:, None], 0.0)
            acc += d * d
            if not IS_RMS_NORM:
                acc_d += d
        shift, rstd, rstd_stored = _statistics_of_sums(acc_d, acc, N, eps, IS_RMS_NORM, CLAMP_EPS, ACC)
        # Pass 3: normalize.
        for start in range(0, N, BLOCK_N):
            cols = start + offs
            mask = row_mask[:, None] & (cols < N)
            s = _load_stream(X, R, XB, GATE, seed, rows2, cols, mask, p, scale, N, rows_per_group,
                             HAS_RESIDUAL, HAS_X_BIAS, HAS_DROPOUT, HAS_GATE, GROUPED, ACC)
            s = s.to(S.dtype.element_ty).to(ACC)
            y = ((s - mean[:, None]) - shift[:, None]) * rstd[:, None]
            if HAS_W:
                y *= _affine_tile(W, rows2, cols, mask, N, rows_per_group, GROUPED).to(ACC)
            if HAS_B:
                y += _affine_tile(B, rows2, cols, mask, N, rows_per_group, GROUPED).to(ACC)
            if HAS_POST:
                y += tl.load(P + cols, mask=mask, other=0.0).to(ACC)
            tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=mask)
            if STORE_Y2:
                tl.store(Y2 + cols, y.to(Y2.dtype.element_ty), mask=mask)
        mean += shift

    if not IS_RMS_NORM:
        tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd_stored, mask=row_mask)


@triton.jit
def _tile_grads(S, DY, DY2, DY3, W, cols, mask, N, mean, rstd,
                HAS_W: tl.constexpr, NUM_DY: tl.constexpr, ACC: tl.constexpr):
    """d = s - mean, dy and g = dy * weight on a tile (0 where masked); mean, rstd are (BLOCK_M,).
    xhat = (d - shift) * rstd, shift = mean(d) (_xhat_and_ds): the saved mean is rounded to fp32, 3e-5
    off at 1e3, and d's own mean takes that back. With NUM_DY 2 or 3, dy is the fp32 sum of DY,
    DY2 (and DY3): y's gradients from as many readers of one 16-bit y (fusion/narrow.py), summed
    as autograd sums fp32 ones."""
    s = tl.load(S + cols, mask=mask, other=0.0)
    dy = tl.load(DY + cols, mask=mask, other=0.0)
    return _loaded_tile_grads(s, dy, DY2, DY3, W, cols, mask, N, mean, rstd, HAS_W, NUM_DY, ACC)


@triton.jit
def _loaded_tile_grads(s, dy, DY2, DY3, W, cols, mask, N, mean, rstd,
                       HAS_W: tl.constexpr, NUM_DY: tl.constexpr, ACC: tl.constexpr):
    """_tile_grads on a tile whose s and dy were loaded already (as stored; 0 where masked)."""
    d = tl.where(mask, s.to(ACC) - mean[:, None], 0.0)
    dy = dy.to(ACC)
    if NUM_DY >= 2:
        dy += tl.load(DY2 + cols, mask=mask, other=0.0).to(ACC)
    if NUM_DY >= 3:
        dy += tl.load(DY3 + cols, mask=mask, other=0.0).to(ACC)
    if HAS_W:
        g = dy * tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
    else:
        g = dy
    return d, dy, g


@triton.jit
def _xhat_and_ds(d, g, shift, c1, c2, rstd, mask, IS_RMS_NORM: tl.constexpr):
    """xhat = (d - shift) rstd (0 where masked) and ds = rstd (g - xhat c1 - c2), shift and c2
    absent for RMSNorm."""
    if IS_RMS_NORM:
        rstd = tl.abs(rstd)  # (negated where floored: _rms_rstd)
        xhat = tl.where(mask, d * rstd[:, None], 0.0)
        return xhat, (g - xhat * c1[:, None]) * rstd[:, None]
    else:
        xhat = tl.where(mask, (d - shift[:, None]) * rstd[:, None], 0.0)
        return xhat, (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]


@triton.jit
def _row_constants(sum_d, sum_dg, sum_g, rstd, N, IS_RMS_NORM: tl.constexpr, ACC: tl.constexpr):
    """(shift, c1, c2) from a row's sums of d, d g and g: shift = mean(d), c1 = mean(xhat g) =
    rstd (mean(d g) - shift mean(g)), c2 = mean(g); for RMSNorm c1 = rstd mean(d g) alone (the
    other two are its unused sums, passed through), 0 where rstd is stored negated (floored)."""
    if IS_RMS_NORM:
        # rstd < 0: a floored row (_rms_rstd), whose rms had no gradient
        return sum_d, tl.where(rstd < 0, 0.0, _div(sum_dg, N, ACC) * rstd), sum_g
    else:
        shift = _div(sum_d, N, ACC)
        c2 = _div(sum_g, N, ACC)
        return shift, (_div(sum_dg, N, ACC) - shift * c2) * rstd, c2


@triton.jit
def _tile_input_grads(d, g, rstd, mask, N, IS_RMS_NORM: tl.constexpr, ACC: tl.constexpr):
    """(xhat, ds) of a tile of whole rows from d and g: their row sums (_row_constants), then
    _xhat_and_ds (also kernels/adaptive_norm.py's and kernels/channel_norm.py's)."""
    if IS_RMS_NORM:
        sum_d = tl.zeros_like(rstd)
        sum_g = sum_d
    else:
        sum_d, sum_g = tl.sum(d, axis=1), tl.sum(g, axis=1)
    shift, c1, c2 = _row_constants(sum_d, tl.sum(d * g, axis=1), sum_g, rstd, N, IS_RMS_NORM, ACC)
    return _xhat_and_ds(d, g, shift, c1, c2, rstd, mask, IS_RMS_NORM)


@triton.jit
def _store_input_grads(ds, DS, DX, DR, X, GATE, seed, rows, cols, mask, p, scale, N,
                       HAS_DS: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_DR: tl.constexpr,
                       HAS_GATE: tl.constexpr):
    """Adds the gradient arriving at s, stores dresidual and dx. Returns the row-summed share of
    the third vector (0 where masked): dx (for dx_bias), or with a gate ds * x (for dgate; GATE
    this group's (N,) row, X the tile's rows; no dropout with it)."""
    if HAS_DS:
        ds += tl.load(DS + cols, mask=mask, other=0.0).to(ds.dtype)
    if STORE_DR:
        tl.store(DR + cols, ds.to(DR.dtype.element_ty), mask=mask)
    dx = ds
    if HAS_DROPOUT:
        dx = tl.where(dropout_keep_quads(seed, rows, cols, p), ds * scale, 0.0)
    if HAS_GATE:
        dx = ds * tl.load(GATE + cols, mask=cols < N, other=0.0).to(ds.dtype)
    tl.store(DX + cols, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_GATE:
        return tl.where(mask, ds * tl.load(X + cols, mask=mask, other=0.0).to(ds.dtype), 0.0)
    return tl.where(mask, dx, 0.0)


@triton.jit
def _layer_norm_bwd_kernel(
    DY,  # in (M, N)
    DS,  # in (M, N) gradient arriving at the returned s; unused unless HAS_DS
    S,  # in (M, N) the saved s (x for the plain forms)
    W,  # in (N,) weight, or with GROUPED (G, N), group g's row at W + g * N; unused unless HAS_W
    SEED,  # in (1,) int64 Philox seed; unused unless HAS_DROPOUT
    MEAN,  # in (M,) fp32; unused for RMSNorm
    RSTD,  # in (M,) fp32
    DX,  # out (M, N) gradient for x
    DR,  # out (M, N) gradient for the residual; unused unless STORE_DR
    PARTIAL,  # out (3, G x programs, N) fp32: this program's shares of dweight, dbias, dx_bias (dgate)
    stride_dym, stride_dsm, stride_sm, stride_dxm, stride_drm,
    M, N, rows_per_program, stride_pk, p, scale,
    DY2, DY3,  # in (M, N) further gradients for y, added to DY; unused unless NUM_DY > 1, > 2
    stride_dy2m, stride_dy3m,
    # With GROUPED, rows come in groups of rows_per_group, each with its own weight row and its
    # own partial sums (the grid's second axis); a program's rows never leave its group.
    rows_per_group,
    X,  # in (M, N) the x that GATE multiplied in the forward; unused unless HAS_GATE
    GATE,  # in (N,) or with GROUPED (G, N); unused unless HAS_GATE (then the third share is dgate)
    stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    IS_RMS_NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_DS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_DR: tl.constexpr, ACC: tl.constexpr,
    # which of the three shares are wanted: an accumulator nobody sums is registers and stores
    # for nothing (a plain LayerNorm has no dx_bias; an RMSNorm no dbias)
    STORE_DW: tl.constexpr, STORE_DB: tl.constexpr, STORE_DXB: tl.constexpr, NUM_DY: tl.constexpr,
    # rows in one block: load the next tile's s and dy before this tile's row sums (whose
    # cross-warp reductions wait for every warp), so that loads stay in flight across them
    PREFETCH: tl.constexpr = False,
    GROUPED: tl.constexpr = False,
    HAS_GATE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    # int64 rows: row * stride may pass 2^31. The group arithmetic only where grouped: in every
    # launch it made the plain 16384-wide one-row tile spill.
    if GROUPED:
        group = tl.program_id(1)
        group_end = tl.minimum((group + 1) * rows_per_group, M)
        row_start = (group * rows_per_group + pid * rows_per_program).to(tl.int64)
        row_end = tl.minimum(row_start + rows_per_program, group_end)
        W += group * N
        GATE += group * N
        DW_PARTIAL = PARTIAL + (group * tl.num_programs(0) + pid).to(tl.int64) * N
    else:
        row_start = pid.to(tl.int64) * rows_per_program
        row_end = tl.minimum(row_start + rows_per_program, M)
        DW_PARTIAL = PARTIAL + pid.to(tl.int64) * N
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    offs = tl.arange(0, BLOCK_N)[None, :]
    DB_PARTIAL = DW_PARTIAL + stride_pk
    DXB_PARTIAL = DB_PARTIAL + stride_pk

    if SINGLE_BLOCK:
        col_mask = offs < N
        # Tile-shaped accumulators: summing over rows once at the end, not on every step,
        # keeps cross-warp reductions out of the loop.
        dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        db = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        dxb = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        if PREFETCH:  # the first tile's s and dy, before the loop
            rows2 = (row_start + tl.arange(0, BLOCK_M))[:, None]
            mask = (rows2 < row_end) & col_mask
            s_next = tl.load(S + rows2 * stride_sm + offs, mask=mask, other=0.0)
            dy_next = tl.load(DY + rows2 * stride_dym + offs, mask=mask, other=0.0)
        for row0 in range(row_start, row_end, BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows2 = rows[:, None]
            mask = row_mask[:, None] & col_mask
            if PREFETCH:
                s_tile, dy_tile = s_next, dy_next
                ahead = rows2 + BLOCK_M
                mask_ahead = (ahead < row_end) & col_mask
                s_next = tl.load(S + ahead * stride_sm + offs, mask=mask_ahead, other=0.0)
                dy_next = tl.load(DY + ahead * stride_dym + offs, mask=mask_ahead, other=0.0)
            else:
                s_tile = tl.load(S + rows2 * stride_sm + offs, mask=mask, other=0.0)
                dy_tile = tl.load(DY + rows2 * stride_dym + offs, mask=mask, other=0.0)
            mean = tl.zeros([BLOCK_M], dtype=ACC) if IS_RMS_NORM else tl.load(MEAN + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            d, dy, g = _loaded_tile_grads(s_tile, dy_tile, DY2 + rows2 * stride_dy2m,
                                          DY3 + rows2 * stride_dy3m, W, offs, mask, N, mean, rstd,
                                          HAS_W, NUM_DY, ACC)
            xhat, ds = _tile_input_grads(d, g, rstd, mask, N, IS_RMS_NORM, ACC)
            share = _store_input_grads(ds, DS + rows2 * stride_dsm, DX + rows2 * stride_dxm,
                                       DR + rows2 * stride_drm, X + rows2 * stride_xm, GATE, seed, rows2,
                                       offs, mask, p, scale, N, HAS_DS, HAS_DROPOUT, STORE_DR, HAS_GATE)
            if STORE_DXB:
                dxb += share
            if STORE_DW:
                dw += dy * xhat
            if STORE_DB:
                db += dy
        cols1 = tl.arange(0, BLOCK_N)
        if STORE_DW:
            tl.store(DW_PARTIAL + cols1, tl.sum(dw, axis=0), mask=cols1 < N)
        if STORE_DB:
            tl.store(DB_PARTIAL + cols1, tl.sum(db, axis=0), mask=cols1 < N)
        if STORE_DXB:
            tl.store(DXB_PARTIAL + cols1, tl.sum(dxb, axis=0), mask=cols1 < N)
    else:
        # Wide rows, one at a time (BLOCK_M = 1): one pass for the two row sums, one to write the
        # grads. The partial rows are this program's alone (zeroed by the launcher), so
        # read-add-write is safe and deterministic.
        for row in range(row_start, row_end):
            rows = row + tl.arange(0, 1)
            rows2 = rows[:, None]
            mean = tl.zeros([1], dtype=ACC) if IS_RMS_NORM else tl.load(MEAN + rows)
            rstd = tl.load(RSTD + rows)
            acc_dg = tl.zeros([1, BLOCK_N], dtype=ACC)
            acc_g = tl.zeros([1, BLOCK_N], dtype=ACC)
            acc_d = tl.zeros([1, BLOCK_N], dtype=ACC)
            for start in range(0, N, BLOCK_N):
                cols = start + offs
                mask = cols < N
                d, dy, g = _tile_grads(S + rows2 * stride_sm, DY + rows2 * stride_dym,
                                       DY2 + rows2 * stride_dy2m, DY3 + rows2 * stride_dy3m, W, cols,
                                       mask, N, mean, rstd, HAS_W, NUM_DY, ACC)
                acc_dg += d * g
                if not IS_RMS_NORM:
                    acc_g += g
                    acc_d += d
            shift, c1, c2 = _row_constants(tl.sum(acc_d, axis=1), tl.sum(acc_dg, axis=1),
                                           tl.sum(acc_g, axis=1), rstd, N, IS_RMS_NORM, ACC)
            for start in range(0, N, BLOCK_N):
                cols = start + offs
                mask = cols < N
                d, dy, g = _tile_grads(S + rows2 * stride_sm, DY + rows2 * stride_dym,
                                       DY2 + rows2 * stride_dy2m, DY3 + rows2 * stride_dy3m, W, cols,
                                       mask, N, mean, rstd, HAS_W, NUM_DY, ACC)
                xhat, ds = _xhat_and_ds(d, g, shift, c1, c2, rstd, mask, IS_RMS_NORM)
                share = _store_input_grads(ds, DS + rows2 * stride_dsm, DX + rows2 * stride_dxm,
                                           DR + rows2 * stride_drm, X + rows2 * stride_xm, GATE, seed,
                                           rows2, cols, mask, p, scale, N, HAS_DS, HAS_DROPOUT, STORE_DR,
                                           HAS_GATE)
                if STORE_DW:
                    tl.store(DW_PARTIAL + cols, tl.load(DW_PARTIAL + cols, mask=mask) + dy * xhat, mask=mask)
                if STORE_DB:
                    tl.store(DB_PARTIAL + cols, tl.load(DB_PARTIAL + cols, mask=mask) + dy, mask=mask)
                if STORE_DXB:
                    tl.store(DXB_PARTIAL + cols, tl.load(DXB_PARTIAL + cols, mask=mask) + share,
                             mask=mask)


@triton.jit
def _sum_partials_kernel(
    PARTIAL,  # in (3, G x programs, N) fp32
    DW,  # out (G, N) dweight in the weight's dtype; unused unless STORE_DW
    DB,  # out (G, N) dbias; unused unless STORE_DB
    DXB,  # out (G, N) dx_bias; unused unless STORE_DXB
    programs, N, stride_pk,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    STORE_DW: tl.constexpr, STORE_DB: tl.constexpr, STORE_DXB: tl.constexpr,
):
    """Sums the backward's partial rows in a fixed order (deterministic) and casts once.

    A program owns BLOCK_N columns and walks the partial rows BLOCK_P at a time, adding whole
    tiles (no cross-warp reduction per step); the rows are summed once at the end."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    group = tl.program_id(1)  # the row group whose `programs` partial rows this sums (G = 1: all)
    PARTIAL += group.to(tl.int64) * programs * N
    DW += group * N
    DB += group * N
    DXB += group * N
    # One pointer step of stride_pk at a time: stride_pk is int32 below 2^31, and 2 * stride_pk
    # in int32 would wrap (from programs x N >= 2^30: 528 programs, N of about 2M).
    DB_PARTIAL = PARTIAL + stride_pk
    DXB_PARTIAL = DB_PARTIAL + stride_pk
    acc_w = tl.zeros([BLOCK_P, BLOCK_N], dtype=PARTIAL.dtype.element_ty)
    acc_b = tl.zeros([BLOCK_P, BLOCK_N], dtype=PARTIAL.dtype.element_ty)
    acc_xb = tl.zeros([BLOCK_P, BLOCK_N], dtype=PARTIAL.dtype.element_ty)
    for start in range(0, programs, BLOCK_P):
        prog = start + tl.arange(0, BLOCK_P)
        offs = prog[:, None].to(tl.int64) * N + cols[None, :]
        mask = (prog[:, None] < programs) & col_mask[None, :]
        if STORE_DW:
            acc_w += tl.load(PARTIAL + offs, mask=mask, other=0.0)
        if STORE_DB:
            acc_b += tl.load(DB_PARTIAL + offs, mask=mask, other=0.0)
        if STORE_DXB:
            acc_xb += tl.load(DXB_PARTIAL + offs, mask=mask, other=0.0)
    if STORE_DW:
        tl.store(DW + cols, tl.sum(acc_w, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if STORE_DB:
        tl.store(DB + cols, tl.sum(acc_b, axis=0).to(DB.dtype.element_ty), mask=col_mask)
    if STORE_DXB:
        tl.store(DXB + cols, tl.sum(acc_xb, axis=0).to(DXB.dtype.element_ty), mask=col_mask)


_layer_norm_fwd = CachedKernel(_layer_norm_fwd_kernel)
_layer_norm_bwd = CachedKernel(_layer_norm_bwd_kernel)
_sum_partials = CachedKernel(_sum_partials_kernel)


# =============================================================================================
# Launchers: check nothing, allocate the outputs, launch. Tensors in, tensors out.
# =============================================================================================


# Tuning (autotune/tuner.py): one Tuner per kernel, keyed by what changes the best launch: the
# device, the dtype, the width, the rows (pow2 bucket) and the variant flags that change the
# bytes moved. A launch plan per exact call (_FWD_PLANS, _BWD_PLANS) holds the grid and every
# launch keyword, so a repeated call costs one dict lookup and a direct launch; plans are stored
# only once the tuner has decided (not while a CUDA graph is captured), bounded like
# CachedKernel's entries.

_FWD_KEY_NAMES = ("device", "dtype", "n", "rows", "rms", "residual", "dropout", "store_s")
_BWD_KEY_NAMES = ("device", "dtype", "n", "rows", "rms", "ds", "dropout", "store_dr", "grads")
_FWD_TUNER = Tuner("layer_norm_fwd", configs.norm_fwd, _FWD_KEY_NAMES, prune=configs.prune_norm_fwd)
_BWD_TUNER = Tuner("layer_norm_bwd", configs.norm_bwd, _BWD_KEY_NAMES, prune=configs.prune_norm_bwd)
# _FWD_PLANS[key] = (grid, meta); _BWD_PLANS[key] = (grid, meta, programs, rows_per_program,
# zero the partials?, sum grid, sum meta)
_FWD_PLANS: dict[tuple, tuple] = {}
_BWD_PLANS: dict[tuple, tuple] = {}


def _row_block(cfg: triton.Config, n: int, max_single: int, wide_chunk: int) -> tuple[int, int, bool]:
    """(BLOCK_M, BLOCK_N, single block?) of a config: TILE // BLOCK_N rows when a row fits one
    block, else one row walked in chunks of `wide_chunk` elements."""
    single = n <= max_single
    block_n = min(next_power_of_2(n), max_single) if single else wide_chunk
    return (max(1, cfg.kwargs["TILE"] // block_n) if single else 1), block_n, single


def _fwd_plan(cfg: triton.Config, m: int, n: int, constexprs: dict) -> tuple[tuple[int], dict]:
    block_m, block_n, single = _row_block(cfg, n, MAX_SINGLE_BLOCK_FWD, configs.NORM_WIDE_CHUNK)
    meta = {**constexprs, "BLOCK_M": block_m, "BLOCK_N": block_n, "SINGLE_BLOCK": single,
            "num_warps": cfg.num_warps}
    return (cdiv(m, block_m),), meta


def _fwd_launch(cfg: triton.Config, m: int, n: int, constexprs: dict, args: tuple) -> None:
    """One forward launch with `cfg` (what the tuner times: it only rewrites the outputs)."""
    grid, meta = _fwd_plan(cfg, m, n, constexprs)
    _layer_norm_fwd.run(grid, args, meta)


# The partial sums' reduction reads programs x N fp32 per vector (up to ~4 MiB at GPT-2's
# widths): spread it over ~SUM_PROGRAMS programs of narrow column blocks (32 fp32 columns are one
# 128-byte line per partial row), each adding SUM_TILE elements per step. One program per 1024
# columns, as before, left a single SM to read it all at width 1024.
SUM_PROGRAMS, SUM_TILE = 128, 2048


def _sum_tile(n: int, programs: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_P) of the partial sums' reduction for width n and `programs` partial rows."""
    block_n = min(max(next_power_of_2(cdiv(n, SUM_PROGRAMS)), 32), 1024)
    return block_n, min(max(SUM_TILE // block_n, 1), next_power_of_2(programs))


def _sum_plan(n: int, programs: int, sum_flags: dict, groups: int = 1) -> tuple[tuple[int, ...], dict]:
    """(grid, launch keywords) of the partial sums' reduction: `programs` partial rows per group."""
    block_n, block_p = _sum_tile(n, programs)
    grid = (cdiv(n, block_n),) if groups == 1 else (cdiv(n, block_n), groups)
    return grid, {"BLOCK_N": block_n, "BLOCK_P": block_p, **sum_flags, "num_warps": 4}


def _bwd_plan(cfg: triton.Config, m: int, n: int, sms: int, constexprs: dict, sum_flags: dict,
              groups: int = 1) -> tuple:
    """The backward's plan for `cfg`: PROGRAMS_PER_SM x SMs programs at most, each owning a
    contiguous range of rows (a multiple of BLOCK_M) and one row of the fp32 partial sums,
    then the fixed-order sum of those rows. With `groups` (m of them, of m / groups rows each:
    an adaptive norm's per-sample weights), every group gets as many programs, none crossing
    into the next group, and its own sum; the programs count is per group."""
    block_m, block_n, single = _row_block(cfg, n, MAX_SINGLE_BLOCK_BWD, configs.NORM_WIDE_CHUNK)
    rows = m // groups
    most = max(1, min(cdiv(rows, block_m) * groups, cfg.kwargs["PROGRAMS_PER_SM"] * sms) // groups)
    rows_per_program = cdiv(cdiv(rows, most), block_m) * block_m
    programs = cdiv(rows, rows_per_program)
    meta = {**constexprs, "BLOCK_M": block_m, "BLOCK_N": block_n, "SINGLE_BLOCK": single,
            "num_warps": cfg.num_warps}
    if single and cfg.kwargs.get("PREFETCH"):
        meta["PREFETCH"] = True
    grid = (programs,) if groups == 1 else (programs, groups)
    return grid, meta, programs, rows_per_program, not single, *_sum_plan(n, programs, sum_flags, groups)


def _bwd_run(plan: tuple, head: tuple, tail: tuple, m: int, n: int, acc: torch.dtype,
             grad_dtypes: tuple, device: torch.device, groups: int = 1) -> tuple:
    """The backward kernel and the partial sums' reduction with `plan`; returns the (n,) vectors,
    (groups, n) with groups (None where grad_dtypes is None). head and tail: the kernel's
    arguments before PARTIAL and after the row geometry."""
    grid, meta, programs, rows_per_program, zero, sum_grid, sum_meta = plan
    total = programs * groups
    summed = any(d is not None for d in grad_dtypes)
    # (without a vector to sum the kernel stores no partial row: a one-element stand-in buffer)
    partials = (torch.zeros if zero else torch.empty)((3, total, n) if summed else (1,), dtype=acc,
                                                      device=device)
    args = (*head, partials, *tail[:5], m, n, rows_per_program, total * n, *tail[5:11], m // groups,
            *tail[11:])
    _layer_norm_bwd.run(grid, args, meta)
    shape = (n,) if groups == 1 else (groups, n)
    vecs = tuple(None if d is None else torch.empty(shape, dtype=d, device=device) for d in grad_dtypes)
    if summed:
        outs = (partials if v is None else v for v in vecs)
        _sum_partials.run(sum_grid, (partials, *outs, programs, n, total * n), sum_meta)
    return vecs


def _bwd_launch(cfg: triton.Config, m: int, n: int, sms: int, constexprs: dict, sum_flags: dict,
                head: tuple, tail: tuple, acc: torch.dtype, grad_dtypes: tuple, device: torch.device,
                groups: int = 1) -> None:
    """One backward with `cfg` (what the tuner times): its own partial-sum buffer, sized by the
    config's program count, and the reduction of it, as a real call runs them."""
    plan = _bwd_plan(cfg, m, n, sms, constexprs, sum_flags, groups)
    _bwd_run(plan, head, tail, m, n, acc, grad_dtypes, device, groups)


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """Per-feature vectors as contiguous (N,) (no copy when they already are)."""
    if t is None or (t.dim() == 1 and t.is_contiguous()):
        return t
    return t.contiguous().view(-1)


def _dropout_scale(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def layer_norm_fwd(
    x: torch.Tensor,
    n: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    is_rms_norm: bool = False,
    residual: torch.Tensor | None = None,
    x_bias: torch.Tensor | None = None,
    p: float = 0.0,
    seed: torch.Tensor | None = None,
    store_s: bool = False,
    stats_shape: tuple[int, ...] | None = None,
    post: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    y2_dtype: torch.dtype | None = None,
    rows_per_group: int | None = None,
    gate: torch.Tensor | None = None,
    clamp_eps: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Normalizes the last `n` features of `x`. Returns (y, s, mean, rstd): y and s shaped like
    x (s is x itself unless store_s), mean and rstd (rows,) in fp32 (mean empty for RMSNorm),
    or shaped `stats_shape` (x's leading dims; same memory), as the registered ops return them.
    `post` (like x; not with residual) is added to y after the norm, y in the promoted dtype, or
    in out_dtype when given (rounded once by the kernel). With y2_dtype, the kernel stores y a
    second time in that dtype, returned fifth. With rows_per_group (Triton only), weight and bias
    are (G, n), contiguous, each group of rows_per_group consecutive rows reading its own row.
    A gate (Triton only; no dropout, no x_bias; (n,), or (G, n) with rows_per_group, contiguous)
    multiplies x before the residual is added: s = residual + gate * x. With clamp_eps (RMSNorm
    only), rstd = 1 / max(rms, eps), F.normalize's floor in rms units, and a floored row's rstd is
    returned negated (the backward drops its projection term; `_rms_rstd`)."""
    if clamp_eps and not is_rms_norm:
        raise ValueError("trifuse.layer_norm_fwd: clamp_eps is RMSNorm's alone")
    other = residual if residual is not None else post
    dtype = x.dtype if other is None else torch.promote_types(x.dtype, other.dtype)
    weight, bias, x_bias, gate = _flat(weight), _flat(bias), _flat(x_bias), _flat(gate)
    m = x.numel() // n if n else 0
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    y = empty_like(x, out_dtype if out_dtype is not None else dtype)
    y2 = empty_like(x, y2_dtype) if y2_dtype is not None else None
    s = empty_like(x, dtype) if store_s else x
    shape = (m,) if stats_shape is None else stats_shape
    rstd = torch.empty(shape, dtype=stat_dtype, device=x.device)
    mean = torch.empty(0 if is_rms_norm else shape, dtype=stat_dtype, device=x.device)
    if m == 0:
        return (y, s, mean, rstd) if y2 is None else (y, s, mean, rstd, y2)
    if gate is not None and (not use_triton(x) or p > 0.0 or x_bias is not None):
        raise ValueError("trifuse.layer_norm_fwd: a gate runs on Triton only, without dropout or x_bias")
    if not use_triton(x):
        y, s, mean_t, rstd_t = _norm_fwd_torch(x, n, weight, bias, eps, is_rms_norm, residual, x_bias, p, seed,
                                               store_s, post, clamp_eps)
        rstd.view(-1).copy_(rstd_t)
        if not is_rms_norm:
            mean.view(-1).copy_(mean_t)
        y_out = y if out_dtype is None else cast(y, out_dtype)
        return (y_out, s, mean, rstd) if y2_dtype is None else (y_out, s, mean, rstd, y.to(y2_dtype))
    x2, stride_x = as_rows(x, n)
    r2, stride_r = as_rows(residual, n) if residual is not None else (x2, 0)
    p2, stride_p = as_rows(post, n) if post is not None else (x2, 0)
    has_dropout = p > 0.0
    # Without store_s the kernel reads only S's dtype (s is rounded to it before the norm): y
    # stands in, or a tensor of s's dtype where y has another (fp32 or fp64: rstd's; else x's or
    # the other input's, one of which has the promoted 16-bit dtype).
    s_arg = s if store_s else y if y.dtype == dtype else next(t for t in (rstd, x, other) if t.dtype == dtype)
    args = (x2, r2, p2, x2 if x_bias is None else x_bias, x2 if weight is None else weight,
            x2 if bias is None else bias, seed if has_dropout else x2,
            y, s_arg, rstd if is_rms_norm else mean, rstd,
            stride_x, stride_r, stride_p, n, n,
            m, n, eps, p, _dropout_scale(p), y if y2 is None else y2, rows_per_group or 1,
            x2 if gate is None else gate)
    device = x.get_device() if x.is_cuda else -1
    # The tuning key's "residual": False, True (added before the norm) or "post" (after it); the
    # bytes moved are the same either way, but a post add keeps y live longer.
    residual_kind = "post" if post is not None else residual is not None
    key = (device, dtype, m, n, is_rms_norm, residual_kind, x_bias is not None, has_dropout,
           weight is not None, bias is not None, store_s, y2 is not None, rows_per_group is not None,
           gate is not None, clamp_eps)
    out = (y, s, mean, rstd) if y2 is None else (y, s, mean, rstd, y2)
    plan = _FWD_PLANS.get(key)
    if plan is not None:
        _layer_norm_fwd.run(plan[0], args, plan[1])
        return out
    constexprs = dict(IS_RMS_NORM=is_rms_norm, HAS_RESIDUAL=residual is not None, HAS_X_BIAS=x_bias is not None,
                      HAS_DROPOUT=has_dropout, HAS_W=weight is not None, HAS_B=bias is not None,
                      STORE_S=store_s, HAS_POST=post is not None, ACC=acc_dtype(dtype),
                      STORE_Y2=y2 is not None, GROUPED=rows_per_group is not None, HAS_GATE=gate is not None,
                      CLAMP_EPS=clamp_eps)
    tuning_key = (device, dtype, n, pow2_bucket(m), is_rms_norm, residual_kind, has_dropout, store_s)
    cfg = _FWD_TUNER.config(tuning_key, _fwd_launch, m, n, constexprs, args)
    plan = _fwd_plan(cfg, m, n, constexprs)
    _layer_norm_fwd.run(plan[0], args, plan[1])
    if _FWD_TUNER.is_decided(tuning_key):
        store_plan(_FWD_PLANS, key, plan)
    return out


def layer_norm_bwd(
    dy: torch.Tensor,
    s: torch.Tensor,
    n: int,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    *,
    is_rms_norm: bool = False,
    ds: torch.Tensor | None = None,
    p: float = 0.0,
    seed: torch.Tensor | None = None,
    store_dresidual: bool = False,
    grad_dtypes: tuple[torch.dtype | None, torch.dtype | None, torch.dtype | None] | None = None,
    dx_dtype: torch.dtype | None = None,
    dr_dtype: torch.dtype | None = None,
    more_dy: tuple[torch.Tensor, ...] = (),
    groups: int = 1,
    x: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of the norm. Returns (dx, dresidual, dweight, dbias, dx_bias); dresidual is dx
    itself unless store_dresidual. y's gradient is dy, plus (in fp32, inside the kernel) up to two
    more_dy: those of the other views of a y several readers share. dx comes in dx_dtype and a
    stored dresidual in dr_dtype (s's dtype by default): the kernel rounds each once to its input's
    dtype, where a cast after it would be one more pass over the rows (x in bf16 beside an fp32
    residual stream under autocast). The three vectors are (n,): in fp32 (fp64 for fp64) when
    grad_dtypes is None, else each in its dtype from grad_dtypes, or None where that is None.
    With `groups` (Triton only; it divides the rows), the weight is (groups, n), each group of
    consecutive rows reading its own row (layer_norm_fwd's rows_per_group), and the vectors are
    (groups, n): each group's sums. With a gate (Triton only; as layer_norm_fwd's, x the tensor it
    multiplied, no dropout): dx = ds * gate, and the third vector is dgate = sum_rows(ds * x)."""
    weight, gate = _flat(weight), _flat(gate)
    m = s.numel() // n if n else 0
    acc = torch.float64 if s.dtype == torch.float64 else torch.float32
    if grad_dtypes is None:
        grad_dtypes = (acc, acc, acc)
    dx = empty_like(s, dx_dtype)
    dr = empty_like(s, dr_dtype) if store_dresidual else dx
    if m == 0:
        return dx, dr, *(None if d is None else torch.zeros(n, dtype=d, device=s.device) for d in grad_dtypes)
    if len(more_dy) > 2:
        raise ValueError(f"trifuse.layer_norm_bwd: at most two more_dy, got {len(more_dy)}")
    if gate is not None and (not use_triton(s) or p > 0.0 or x is None):
        raise ValueError("trifuse.layer_norm_bwd: a gate runs on Triton only, with x and without dropout")
    if not use_triton(s):
        for extra in more_dy:
            dy = dy.to(acc) + extra
        dx, dr, *vecs = _norm_bwd_torch(dy, s, n, weight, mean, rstd, is_rms_norm, ds, p, seed, store_dresidual)
        dx = dx if dx_dtype is None else cast(dx, dx_dtype)
        if not store_dresidual:
            dr = dx
        elif dr_dtype is not None:
            dr = cast(dr, dr_dtype)
        return dx, dr, *(None if d is None else v.to(d) for v, d in zip(vecs, grad_dtypes))
    s2, stride_s = as_rows(s, n)
    dy2, stride_dy = as_rows(dy, n)
    ds2, stride_ds = as_rows(ds, n) if ds is not None else (dy2, 0)
    has_dropout = p > 0.0
    head = (dy2, ds2, s2, s2 if weight is None else weight, seed if has_dropout else s2,
            rstd if is_rms_norm else mean, rstd, dx, dr)
    if more_dy:
        extra = [as_rows(t, n) for t in more_dy] + [(dy2, 0)] * (2 - len(more_dy))
        tail = (stride_dy, stride_ds, stride_s, n, n, p, _dropout_scale(p),
                extra[0][0], extra[1][0], extra[0][1], extra[1][1])
    else:
        tail = (stride_dy, stride_ds, stride_s, n, n, p, _dropout_scale(p), dy2, dy2, 0, 0)
    if gate is not None:
        x2, stride_x = as_rows(x, n)
        tail += (x2, gate, stride_x)
    else:
        tail += (s2, s2, 0)
    device = s.get_device() if s.is_cuda else -1
    # The tuned backward config sets how the rows are split into fp32 partial sums, so two
    # processes tuning apart could sum dweight in different orders. Under
    # torch.use_deterministic_algorithms every process takes the space's default: the same bits
    # everywhere, tuned cache or not.
    deterministic = torch.are_deterministic_algorithms_enabled()
    key = (device, s.dtype, m, n, is_rms_norm, weight is not None, ds is not None, has_dropout,
           store_dresidual, grad_dtypes, deterministic, len(more_dy), groups, gate is not None)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        sum_flags = dict(STORE_DW=grad_dtypes[0] is not None, STORE_DB=grad_dtypes[1] is not None,
                         STORE_DXB=grad_dtypes[2] is not None)
        constexprs = dict(IS_RMS_NORM=is_rms_norm, HAS_W=weight is not None, HAS_DS=ds is not None,
                          HAS_DROPOUT=has_dropout, STORE_DR=store_dresidual, ACC=acc_dtype(s.dtype),
                          NUM_DY=1 + len(more_dy), GROUPED=groups > 1, HAS_GATE=gate is not None, **sum_flags)
        # (a gate reads x as well: its dgate tunes apart from dx_bias)
        third = "g" if gate is not None else "x"
        grads = "".join(c for c, d in zip("wb" + third, grad_dtypes) if d is not None)
        tuning_key = (device, s.dtype, n, pow2_bucket(m), is_rms_norm, ds is not None, has_dropout,
                      store_dresidual, grads)
        sms = device_sms(s)
        if deterministic:
            cfg = configs.norm_bwd(n)[0]
        else:
            cfg = _BWD_TUNER.config(tuning_key, _bwd_launch, m, n, sms, constexprs, sum_flags, head, tail, acc,
                                    grad_dtypes, s.device, groups)
        plan = _bwd_plan(cfg, m, n, sms, constexprs, sum_flags, groups)
        if deterministic or _BWD_TUNER.is_decided(tuning_key):
            store_plan(_BWD_PLANS, key, plan)
    vecs = _bwd_run(plan, head, tail, m, n, acc, grad_dtypes, s.device, groups)
    return dx, dr, *vecs


# ---------------------------------------------------------------------------------------------
# PyTorch path for CPU tensors without the interpreter: same outputs, no Triton.
# ---------------------------------------------------------------------------------------------


def _torch_keep_mask(seed: torch.Tensor, shape: torch.Size, p: float) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(int(seed.item()))
    return torch.rand(shape, generator=gen, device=gen.device) >= p


def _norm_fwd_torch(x, n, weight, bias, eps, is_rms_norm, residual, x_bias, p, seed, store_s, post=None,
                    clamp_eps=False):
    other = residual if residual is not None else post
    dtype = x.dtype if other is None else torch.promote_types(x.dtype, other.dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    # in rows of the normalized width: x_bias comes flat, whatever normalized_shape's rank
    s2 = x.reshape(-1, n).to(acc)
    if x_bias is not None:
        s2 = s2 + x_bias.reshape(-1).to(acc)
    if p > 0.0:
        s2 = torch.where(_torch_keep_mask(seed, s2.shape, p).to(s2.device), s2 * _dropout_scale(p), 0.0)
    if residual is not None:
        s2 = s2 + residual.reshape(-1, n).to(acc)
    s2 = s2.to(dtype).to(acc)  # normalize s as stored, as the kernel does
    if is_rms_norm:
        mean = torch.zeros(s2.shape[0], dtype=acc, device=x.device)
        d = s2
    else:  # corrected two-pass, as the kernels: rows far from 0 (1e4 +- 1) keep what the mean's
        mean = s2.mean(dim=1)  # rounding loses, as a correction of the centred values
        d = s2 - mean[:, None]
        d = d - d.mean(dim=1, keepdim=True)
    if clamp_eps:  # as _rms_rstd: 1 / max(rms, eps), negated where floored
        rms = d.square().mean(dim=1).sqrt()
        floored = rms < eps
        rstd = 1.0 / torch.where(floored, eps, rms)
    else:
        rstd = torch.rsqrt(d.square().mean(dim=1) + eps)
    y = d * rstd[:, None]
    if clamp_eps:
        rstd = torch.where(floored, -rstd, rstd)
    if weight is not None:
        y = y * weight.reshape(-1).to(acc)
    if bias is not None:
        y = y + bias.reshape(-1).to(acc)
    if post is not None:
        y = y + post.reshape(-1, n).to(acc)
    s_out = s2.reshape(x.shape).to(dtype) if store_s else x
    return y.reshape(x.shape).to(dtype), s_out, mean[:0] if is_rms_norm else mean, rstd


def _norm_bwd_torch(dy, s, n, weight, mean, rstd, is_rms_norm, ds, p, seed, store_dresidual):
    acc = mean.dtype if mean.numel() else rstd.dtype
    s2 = s.reshape(-1, n).to(acc)
    dy2 = dy.reshape(-1, n).to(acc)
    floored = None
    if is_rms_norm:
        floored = rstd[:, None] < 0  # negated where floored (_rms_rstd): no projection term
        rstd = rstd.abs()
        xhat = s2 * rstd[:, None]
    else:  # the saved mean corrected as the forward's
        d = s2 - mean[:, None].to(acc)
        xhat = (d - d.mean(dim=1, keepdim=True)) * rstd[:, None]
    g = dy2 * weight.reshape(-1).to(acc) if weight is not None else dy2
    c1 = (xhat * g).mean(dim=1, keepdim=True)
    if floored is not None:
        c1 = torch.where(floored, 0.0, c1)
    c2 = 0.0 if is_rms_norm else g.mean(dim=1, keepdim=True)
    grad_s = (g - xhat * c1 - c2) * rstd[:, None]
    if ds is not None:
        grad_s = grad_s + ds.reshape(-1, n).to(acc)
    dx = grad_s
    if p > 0.0:
        dx = torch.where(_torch_keep_mask(seed, grad_s.shape, p).to(s.device), grad_s * _dropout_scale(p), 0.0)
    # a buffer of its own, as the kernel's: without dropout dx is grad_s, and the registered
    # backward op may not return two outputs that alias
    dr = grad_s.reshape(s.shape).to(s.dtype, copy=True) if store_dresidual else None
    dx_out = dx.reshape(s.shape).to(s.dtype)
    return dx_out, dr if dr is not None else dx_out, (dy2 * xhat).sum(0), dy2.sum(0), dx.sum(0)


# =============================================================================================
# Checks, shared by the registered ops (real and fake) and the eager path
# =============================================================================================


def _check_norm_inputs(op, x, normalized_shape, weight, bias, eps, residual=None, x_bias=None, p=0.0):
    check_tensor(op, "input", x)
    check_float(op, "input", x)
    normalized_shape = tuple(normalized_shape)
    k = len(normalized_shape)
    if k == 0 or x.dim() < k or tuple(x.shape[-k:]) != normalized_shape:
        raise ValueError(
            f"trifuse.{op}: normalized_shape {list(normalized_shape)} must be the trailing "
            f"dimensions of input, whose shape is {list(x.shape)}"
        )
    for name, t in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if t is not None:
            check_tensor(op, name, t)
            check_float(op, name, t)
            check_shape(op, name, t, normalized_shape)
    if residual is not None:
        check_tensor(op, "residual", residual)
        check_float(op, "residual", residual)
        check_shape(op, "residual", residual, x.shape)
    check_same_device(op, "input", x, weight=weight, bias=bias, residual=residual, x_bias=x_bias)
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"trifuse.{op}: eps must be a non-negative number, got {eps!r}")
    check_probability(op, "p", p)
    return math.prod(normalized_shape)


def _check_norm_add_inputs(op, x, residual, normalized_shape, weight, bias, eps):
    if residual is None:
        raise ValueError(f"trifuse.{op}: residual must be a tensor shaped like input, got None")
    return _check_norm_inputs(op, x, normalized_shape, weight, bias, eps, residual)


def _stats_shape(x: torch.Tensor, k: int) -> tuple[int, ...]:
    """The registered ops' per-row statistics are shaped like x's leading (not normalized) dims,
    so that a DTensor sharded on any leading dim has statistics sharded on the same dim
    (parallel/dtensor_ops.py); the launchers work on them flattened, (rows,)."""
    return tuple(x.shape[: x.dim() - k])


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see. Each forward op returns its
# outputs plus what its backward needs (statistics, and the seed for dropout); the backward op
# is registered beside it.
# =============================================================================================

Tensor = torch.Tensor
OptTensor = torch.Tensor | None


# The norms' `out_dtype`: y in that dtype, rounded once by the kernel (a traced narrowed call,
# fusion/narrow.py: a cast after an opaque op would be one more pass over y, and one more over
# its gradient, in a compiled graph). Their backward op's `dx_dtype` the same for dx. With
# `full_y` (a post-norm block's y, read in full by the residual add and narrowed by one matmul)
# y stays in full and the last output, `y_narrow`, is y in out_dtype, stored by the same kernel
# (empty without full_y); the backward op adds its gradient `dy_narrow` to dy in fp32.


def _narrowing(op: str, out_dtype: torch.dtype | None, full_y: bool) -> dict:
    """layer_norm_fwd's dtype arguments for a forward op's (out_dtype, full_y)."""
    if not full_y:
        return {"out_dtype": out_dtype}
    if out_dtype is None:
        raise ValueError(f"trifuse.{op}: full_y needs an out_dtype for y_narrow")
    return {"y2_dtype": out_dtype}


def _check_dy_narrow(dy_narrow: OptTensor, s: Tensor) -> None:
    if dy_narrow is not None and dy_narrow.shape != s.shape:
        raise ValueError(f"trifuse.layer_norm_backward: dy_narrow must be shaped like the normed input "
                         f"{tuple(s.shape)}, got {tuple(dy_narrow.shape)}")


def _y_narrow(x: Tensor, out: tuple) -> Tensor:
    """The y_narrow output: layer_norm_fwd's fifth output, else an empty tensor."""
    return out[4] if len(out) > 4 else x.new_empty(0)


@torch.library.custom_op("trifuse::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, normalized_shape: list[int], weight: OptTensor, bias: OptTensor,
                   eps: float, out_dtype: torch.dtype | None = None,
                   full_y: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n = _check_norm_inputs("layer_norm", x, normalized_shape, weight, bias, eps)
    out = layer_norm_fwd(x, n, weight, bias, eps, **_narrowing("layer_norm", out_dtype, full_y),
                         stats_shape=_stats_shape(x, len(normalized_shape)))
    return out[0], out[2], out[3], _y_narrow(x, out)


@torch.library.custom_op("trifuse::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, normalized_shape: list[int], weight: OptTensor, eps: float,
                 out_dtype: torch.dtype | None = None, full_y: bool = False,
                 clamp_eps: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    n = _check_norm_inputs("rms_norm", x, normalized_shape, weight, None, eps)
    narrowing = _narrowing("rms_norm", out_dtype, full_y)
    out = layer_norm_fwd(x, n, weight, None, eps, is_rms_norm=True, clamp_eps=clamp_eps,
                         stats_shape=_stats_shape(x, len(normalized_shape)), **narrowing)
    return out[0], out[3], _y_narrow(x, out)


@torch.library.custom_op("trifuse::dropout_add_layer_norm", mutates_args=())
def _dropout_add_layer_norm_op(
    x: Tensor, residual: OptTensor, normalized_shape: list[int], weight: OptTensor, bias: OptTensor,
    eps: float, p: float, x_bias: OptTensor, out_dtype: torch.dtype | None = None, full_y: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _dropout_add_norm(x, residual, normalized_shape, weight, bias, eps, p, x_bias, False, out_dtype,
                             full_y)


@torch.library.custom_op("trifuse::dropout_add_rms_norm", mutates_args=())
def _dropout_add_rms_norm_op(
    x: Tensor, residual: OptTensor, normalized_shape: list[int], weight: OptTensor,
    eps: float, p: float, x_bias: OptTensor, out_dtype: torch.dtype | None = None, full_y: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _dropout_add_norm(x, residual, normalized_shape, weight, None, eps, p, x_bias, True, out_dtype,
                             full_y)


def _dropout_add_norm(x, residual, normalized_shape, weight, bias, eps, p, x_bias, is_rms_norm,
                      out_dtype=None, full_y=False):
    op = "dropout_add_rms_norm" if is_rms_norm else "dropout_add_layer_norm"
    n = _check_norm_inputs(op, x, normalized_shape, weight, bias, eps, residual, x_bias, p)
    narrowing = _narrowing(op, out_dtype, full_y)
    seed = philox_seed(x.device) if p > 0.0 else torch.zeros(1, dtype=torch.int64, device=x.device)
    out = layer_norm_fwd(x, n, weight, bias, eps, is_rms_norm=is_rms_norm, residual=residual, x_bias=x_bias,
                         p=p, seed=seed, store_s=True, stats_shape=_stats_shape(x, len(normalized_shape)),
                         **narrowing)
    return (*out[:4], seed, _y_narrow(x, out))


@torch.library.custom_op("trifuse::layer_norm_add", mutates_args=())
def _layer_norm_add_op(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: OptTensor,
                       bias: OptTensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _norm_add(x, residual, normalized_shape, weight, bias, eps, False)


@torch.library.custom_op("trifuse::rms_norm_add", mutates_args=())
def _rms_norm_add_op(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: OptTensor,
                     eps: float) -> tuple[Tensor, Tensor]:
    y, _, rstd = _norm_add(x, residual, normalized_shape, weight, None, eps, True)
    return y, rstd


def _norm_add(x, residual, normalized_shape, weight, bias, eps, is_rms_norm):
    op = "rms_norm_add" if is_rms_norm else "layer_norm_add"
    n = _check_norm_add_inputs(op, x, residual, normalized_shape, weight, bias, eps)
    y, _, mean, rstd = layer_norm_fwd(x, n, weight, bias, eps, is_rms_norm=is_rms_norm, post=residual,
                                      stats_shape=_stats_shape(x, len(normalized_shape)))
    return y, mean, rstd


# Which of the backward's three per-feature vectors a caller needs, as bits (the op's `vectors`).
DWEIGHT, DBIAS, DX_BIAS = 1, 2, 4
ALL_VECTORS = DWEIGHT | DBIAS | DX_BIAS


def _vectors_needed(needs: tuple[bool, ...], weight: int | None, bias: int | None = None,
                    x_bias: int | None = None) -> int:
    """The op's `vectors` for an autograd backward: each bit whose input (at that index of
    `ctx.needs_input_grad`; None where the op has no such input) asks for a gradient."""
    return sum(bit for bit, at in ((DWEIGHT, weight), (DBIAS, bias), (DX_BIAS, x_bias))
               if at is not None and needs[at])


@torch.library.custom_op("trifuse::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(
    dy: Tensor, ds: OptTensor, s: Tensor, normalized_shape: list[int], weight: OptTensor,
    mean: Tensor, rstd: Tensor, seed: OptTensor, p: float, is_rms_norm: bool, store_dresidual: bool,
    dx_dtype: torch.dtype | None = None, dy_narrow: OptTensor = None, vectors: int = ALL_VECTORS,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dresidual, dweight, dbias, dx_bias) for every LayerNorm / RMSNorm forward op. mean
    and rstd as the forward op returned them (RMSNorm ignores mean); dy in any float dtype (a
    narrowed y's), dy_narrow (y_narrow's gradient, full_y) added to it in fp32 by the kernel;
    dx in dx_dtype (s's by default). `vectors` (`_vectors_needed`: 1 dweight, 2 dbias, 4 dx_bias)
    says which of the three the caller reads: the kernel sums only those (an RMSNorm has no bias,
    a constant weight needs no gradient), the others come back empty."""
    _check_dy_narrow(dy_narrow, s)
    acc = _stat_dtype(s)
    dx, dr, dw, db, dxb = layer_norm_bwd(
        dy, s, math.prod(normalized_shape), weight, mean.reshape(-1), rstd.reshape(-1),
        is_rms_norm=is_rms_norm, ds=ds, p=p, seed=seed, store_dresidual=store_dresidual, dx_dtype=dx_dtype,
        more_dy=() if dy_narrow is None else (dy_narrow,),
        grad_dtypes=tuple(acc if vectors >> i & 1 else None for i in range(3)),
    )
    # A custom op's outputs may not alias: dresidual is empty unless stored apart (else it is dx).
    # The three vectors are buffers of their own on both paths, empty where not asked for.
    return dx, (dr if store_dresidual else dx.new_empty(0)), \
        *(v if v is not None else s.new_empty(0, dtype=acc) for v in (dw, db, dxb))


# The fakes allocate as the kernels do (`empty_like`: contiguous whatever x's strides): a fake
# that kept a permuted x's strides fails Inductor's stride assertion on the real output.


def _fake_ys(op: str, x: Tensor, dtype: torch.dtype, out_dtype, full_y: bool) -> tuple[Tensor, Tensor]:
    """(y, y_narrow) of a forward op's fake, y in `dtype` unless narrowed itself."""
    narrowing = _narrowing(op, out_dtype, full_y)
    y2_dtype = narrowing.get("y2_dtype")
    return (empty_like(x, narrowing.get("out_dtype") or dtype),
            x.new_empty(0) if y2_dtype is None else empty_like(x, y2_dtype))


@_layer_norm_op.register_fake
def _(x, normalized_shape, weight, bias, eps, out_dtype=None, full_y=False):
    _check_norm_inputs("layer_norm", x, normalized_shape, weight, bias, eps)
    m = _stats_shape(x, len(normalized_shape))
    y, y_narrow = _fake_ys("layer_norm", x, x.dtype, out_dtype, full_y)
    return y, x.new_empty(m, dtype=_stat_dtype(x)), x.new_empty(m, dtype=_stat_dtype(x)), y_narrow


@_rms_norm_op.register_fake
def _(x, normalized_shape, weight, eps, out_dtype=None, full_y=False, clamp_eps=False):
    _check_norm_inputs("rms_norm", x, normalized_shape, weight, None, eps)
    y, y_narrow = _fake_ys("rms_norm", x, x.dtype, out_dtype, full_y)
    return y, x.new_empty(_stats_shape(x, len(normalized_shape)), dtype=_stat_dtype(x)), y_narrow


def _dropout_add_norm_fake(x, residual, normalized_shape, weight, bias, eps, p, x_bias, is_rms_norm,
                           out_dtype=None, full_y=False):
    op = "dropout_add_rms_norm" if is_rms_norm else "dropout_add_layer_norm"
    _check_norm_inputs(op, x, normalized_shape, weight, bias, eps, residual, x_bias, p)
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    m = _stats_shape(x, len(normalized_shape))
    s = x.new_empty(x.shape, dtype=dtype)
    stat = _stat_dtype(s)
    y, y_narrow = _fake_ys(op, x, dtype, out_dtype, full_y)
    return (y, s, s.new_empty(0 if is_rms_norm else m, dtype=stat), s.new_empty(m, dtype=stat),
            s.new_empty(1, dtype=torch.int64), y_narrow)


@_dropout_add_layer_norm_op.register_fake
def _(x, residual, normalized_shape, weight, bias, eps, p, x_bias, out_dtype=None, full_y=False):
    return _dropout_add_norm_fake(x, residual, normalized_shape, weight, bias, eps, p, x_bias, False,
                                  out_dtype, full_y)


@_dropout_add_rms_norm_op.register_fake
def _(x, residual, normalized_shape, weight, eps, p, x_bias, out_dtype=None, full_y=False):
    return _dropout_add_norm_fake(x, residual, normalized_shape, weight, None, eps, p, x_bias, True,
                                  out_dtype, full_y)


def _norm_add_fake(x, residual, normalized_shape, weight, bias, eps, is_rms_norm):
    op = "rms_norm_add" if is_rms_norm else "layer_norm_add"
    _check_norm_add_inputs(op, x, residual, normalized_shape, weight, bias, eps)
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    m = _stats_shape(x, len(normalized_shape))
    return y, y.new_empty(0 if is_rms_norm else m, dtype=_stat_dtype(y)), y.new_empty(m, dtype=_stat_dtype(y))


@_layer_norm_add_op.register_fake
def _(x, residual, normalized_shape, weight, bias, eps):
    return _norm_add_fake(x, residual, normalized_shape, weight, bias, eps, False)


@_rms_norm_add_op.register_fake
def _(x, residual, normalized_shape, weight, eps):
    y, _, rstd = _norm_add_fake(x, residual, normalized_shape, weight, None, eps, True)
    return y, rstd


@_layer_norm_backward_op.register_fake
def _(dy, ds, s, normalized_shape, weight, mean, rstd, seed, p, is_rms_norm, store_dresidual, dx_dtype=None,
      dy_narrow=None, vectors=ALL_VECTORS):
    _check_dy_narrow(dy_narrow, s)
    n = math.prod(normalized_shape)
    dr = empty_like(s) if store_dresidual else s.new_empty(0)
    return empty_like(s, dx_dtype), dr, \
        *(s.new_empty(n if vectors >> i & 1 else 0, dtype=_stat_dtype(s)) for i in range(3))


def _stat_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# Autograd for the registered ops. Each forward saves what the one backward op needs.


def _grad_as(g: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor | None:
    """g in like's dtype and shape (a per-feature gradient for a possibly multi-dim weight)."""
    if like is None:
        return None
    g = cast(g, like.dtype)
    return g if g.dim() == like.dim() else g.reshape(like.shape)


def _setup_plain(ctx, inputs, output, is_rms_norm):
    x, normalized_shape, weight = inputs[0], inputs[1], inputs[2]
    bias = None if is_rms_norm else inputs[3]
    stats = output[1:-1]  # (after y; y_narrow last)
    # RMSNorm has no mean; its backward ignores the argument, and rstd stands in for it (a slice
    # would do too, but not as simply for a DTensor).
    mean, rstd = (stats[0], stats[0]) if is_rms_norm else stats
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.normalized_shape, ctx.is_rms_norm = normalized_shape, is_rms_norm
    ctx.eps = inputs[3 if is_rms_norm else 4]
    ctx.full_y = _full_y(inputs, 5 if is_rms_norm else 6)
    ctx.clamp_eps = is_rms_norm and len(inputs) > 6 and bool(inputs[6])  # (rms_norm's, after full_y)
    ctx.needs = ctx.needs_input_grad
    # Unused outputs' gradients arrive as None, not as zeros autograd would make as plain
    # tensors (which a DTensor op refuses beside DTensors, and which cost a pass to read).
    ctx.set_materialize_grads(False)


def _full_y(inputs: tuple, at: int) -> bool:
    """The forward op's full_y, at index `at` of its inputs (absent where the call left it out)."""
    return len(inputs) > at and bool(inputs[at])


def _dy_narrow(ctx, grads: tuple) -> Tensor | None:
    """y_narrow's gradient, the last of a forward op's output gradients: None without full_y (the
    empty y_narrow's, when a caller differentiates every output)."""
    return grads[-1] if ctx.full_y else None


def _backward_tail(dx_dtype: torch.dtype | None, dy_narrow: Tensor | None,
                   vectors: int = ALL_VECTORS) -> tuple:
    """layer_norm_backward's trailing (dx_dtype, dy_narrow, vectors) as far as any differs from
    its default (a traced call carries no trailing defaults)."""
    if vectors != ALL_VECTORS:
        return dx_dtype, dy_narrow, vectors
    return (dx_dtype, dy_narrow) if dy_narrow is not None else () if dx_dtype is None else (dx_dtype,)


def _norm_grads(ctx, dy, dy_narrow=None, first_param=2):
    """(dx, dweight, dbias) of a norm of the saved (x, weight, bias, mean, rstd); dy_narrow: the
    gradient of y_narrow (full_y), added to dy's. The weight is input `first_param` of the
    forward op, the bias the next: their gradients are summed only where asked for (else None)."""
    x, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:
        dy, dy_narrow = dy_narrow, None
    vectors = _vectors_needed(ctx.needs_input_grad, first_param if weight is not None else None,
                              first_param + 1 if bias is not None else None)
    dx, _, dw, db, _ = torch.ops.trifuse.layer_norm_backward(
        dy, None, x, ctx.normalized_shape, weight, mean, rstd, None, 0.0, ctx.is_rms_norm, False,
        *_backward_tail(None, dy_narrow, vectors))
    return (dx, _grad_as(dw, weight) if vectors & DWEIGHT else None,
            _grad_as(db, bias) if vectors & DBIAS else None)


# The registered norms' formulas are differentiable again under create_graph=True by the eager
# path's (_norm_twice, _norm_add_twice, defined below with it), their inputs and ctx mapped.


def _width_of(ctx) -> int:
    return math.prod(ctx.normalized_shape)


def _plain_twice(ctx, dy, *rest):
    """For layer_norm (x, normalized_shape, weight, bias, eps, out_dtype, full_y) and rms_norm (no
    bias, clamp_eps after full_y); rest: the statistics' gradients, then y_narrow's."""
    x, weight, bias, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    view = ctx_as(ctx, (needs[0], False, False, needs[2], not ctx.is_rms_norm and needs[3]),
                  saved_tensors=(x, weight, bias, None, mean, rstd, None), fused=False, residual_dtype=None,
                  p=0.0, outputs=2, n=_width_of(ctx), eps=ctx.eps, is_rms_norm=ctx.is_rms_norm,
                  x_dtype=x.dtype, clamp_eps=ctx.clamp_eps)
    dx, _, _, dw, db, *_ = _norm_twice(view, dy, _dy_narrow(ctx, rest))
    return (dx, None, dw, None, None, None, None) if ctx.is_rms_norm else (dx, None, dw, db, None, None, None)


@single_backward(twice=_plain_twice, op="layer_norm (or rms_norm)")
def _backward_plain(ctx, dy, *rest):
    dy_narrow = _dy_narrow(ctx, rest)  # after the statistics' gradients
    if dy is None and dy_narrow is None:
        return (None,) * 7
    dx, dw, db = _norm_grads(ctx, dy, dy_narrow)  # (out_dtype's, full_y's, clamp_eps's gradients: None)
    if ctx.is_rms_norm:
        return dx, None, dw, None, None, None, None
    return dx, None, dw, db, None, None, None


def _setup_fused(ctx, inputs, output, is_rms_norm):
    x, residual, normalized_shape, weight = inputs[:4]
    bias = None if is_rms_norm else inputs[4]
    eps_p_xb = inputs[4:] if is_rms_norm else inputs[5:]
    p, x_bias = eps_p_xb[1], eps_p_xb[2]
    _, s, mean, rstd, seed, _ = output
    ctx.save_for_backward(s, weight, bias, x_bias, mean, rstd, seed)
    ctx.normalized_shape, ctx.is_rms_norm, ctx.p, ctx.eps = normalized_shape, is_rms_norm, p, eps_p_xb[0]
    ctx.x_dtype, ctx.has_residual = x.dtype, residual is not None
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.full_y = _full_y(inputs, 8 if is_rms_norm else 9)
    ctx.set_materialize_grads(False)  # as _setup_plain


def _fused_twice(ctx, dy, ds, *rest):
    """For dropout_add_layer_norm (x, residual, normalized_shape, weight, bias, eps, p, x_bias,
    out_dtype, full_y) and dropout_add_rms_norm (no bias); rest: the statistics' and the seed's
    gradients, then y_narrow's."""
    needs = ctx.needs_input_grad
    # needs: one per argument the call passed (trailing Nones and out_dtype may be left out)
    x_bias = 6 if ctx.is_rms_norm else 7
    needs_x_bias = len(needs) > x_bias and needs[x_bias]
    view = ctx_as(ctx, (needs[0], needs[1], needs_x_bias, needs[3], not ctx.is_rms_norm and needs[4]),
                  fused=True, outputs=2, n=_width_of(ctx), eps=ctx.eps, p=ctx.p, is_rms_norm=ctx.is_rms_norm,
                  x_dtype=ctx.x_dtype, residual_dtype=ctx.residual_dtype)
    dx, dres, dxb, dw, db, *_ = _norm_twice(view, dy, _dy_narrow(ctx, rest), ds)
    grads = (dx, dres, None, dw) if ctx.is_rms_norm else (dx, dres, None, dw, db)
    return (*grads, None, None, dxb, None, None)


@single_backward(twice=_fused_twice, op="dropout_add_layer_norm")
def _backward_fused(ctx, dy, ds, *rest):
    dy_narrow = _dy_narrow(ctx, rest)  # after the statistics' and the seed's gradients
    if dy is None:
        dy, dy_narrow = dy_narrow, None
    if dy is None and ds is None:
        return (None,) * (9 if ctx.is_rms_norm else 10)
    s, weight, bias, x_bias, mean, rstd, seed = ctx.saved_tensors
    y_used = dy is not None
    if not y_used:  # only s was used: y's gradient is zero (ds alone is read as is)
        dy = torch.zeros_like(s)
    p = ctx.p
    # With a residual, the kernel writes dresidual apart from dx (they differ under dropout, and
    # a custom op may not return one tensor twice); dx comes in x's dtype (bf16 beside an fp32
    # residual stream under autocast: a cast after the op would be one more pass over it).
    args = (dy, ds, s, ctx.normalized_shape, weight, mean, rstd, seed, p, ctx.is_rms_norm, ctx.has_residual)
    dx_dtype = None if ctx.x_dtype == s.dtype else ctx.x_dtype
    # (x, residual, normalized_shape, weight, [bias,] eps, p, x_bias, ...); y unread: the norm's
    # weight and bias reach the loss through nothing, so their gradients are None as unfused (not
    # zeros: an optimizer would decay and step them, DDP count them as used)
    rms = ctx.is_rms_norm
    vectors = _vectors_needed(ctx.needs_input_grad, 3 if y_used and weight is not None else None,
                              4 if y_used and not rms and bias is not None else None,
                              (6 if rms else 7) if x_bias is not None else None)
    dx, dr, dw, db, dxb = torch.ops.trifuse.layer_norm_backward(*args, *_backward_tail(dx_dtype, dy_narrow,
                                                                                      vectors))
    dres = dr.to(ctx.residual_dtype) if ctx.has_residual else None
    grads = [dx.to(ctx.x_dtype), dres, None, _grad_as(dw, weight) if vectors & DWEIGHT else None]
    if not rms:
        grads.append(_grad_as(db, bias) if vectors & DBIAS else None)
    return (*grads, None, None, _grad_as(dxb, x_bias) if vectors & DX_BIAS else None, None, None)


def _setup_norm_add(ctx, inputs, output, is_rms_norm):
    x, residual, normalized_shape, weight = inputs[:4]
    bias = None if is_rms_norm else inputs[4]
    mean, rstd = (output[1], output[1]) if is_rms_norm else output[1:]  # as _setup_plain
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.normalized_shape, ctx.is_rms_norm, ctx.eps = normalized_shape, is_rms_norm, inputs[-1]
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
    ctx.set_materialize_grads(False)


def _norm_add_registered_twice(ctx, dy, *_):
    """For layer_norm_add (x, residual, normalized_shape, weight, bias, eps) and rms_norm_add."""
    if dy is None:
        return None
    needs = ctx.needs_input_grad
    view = ctx_as(ctx, (needs[0], needs[1], needs[3], not ctx.is_rms_norm and needs[4]), n=_width_of(ctx),
                  eps=ctx.eps, is_rms_norm=ctx.is_rms_norm, residual_dtype=ctx.residual_dtype)
    dx, dres, dw, db, *_ = _norm_add_twice(view, dy)
    grads = (dx, dres, None, dw) if ctx.is_rms_norm else (dx, dres, None, dw, db)
    return (*grads, None)


@single_backward(twice=_norm_add_registered_twice, op="layer_norm_add")
def _backward_norm_add(ctx, dy, *_):
    # y = residual + norm(x): the residual's gradient is dy itself, x's the norm's backward of dy.
    if dy is None:
        return (None,) * (5 if ctx.is_rms_norm else 6)
    dx, dw, db = _norm_grads(ctx, dy, first_param=3)  # (x, residual, normalized_shape, weight, bias, eps)
    grads = [cast(dx, ctx.x_dtype), cast(dy, ctx.residual_dtype), None, dw]
    if not ctx.is_rms_norm:
        grads.append(db)
    return (*grads, None)


for _name, _backward, _setup, _is_rms in (
    ("trifuse::layer_norm", _backward_plain, _setup_plain, False),
    ("trifuse::rms_norm", _backward_plain, _setup_plain, True),
    ("trifuse::layer_norm_add", _backward_norm_add, _setup_norm_add, False),
    ("trifuse::rms_norm_add", _backward_norm_add, _setup_norm_add, True),
    ("trifuse::dropout_add_layer_norm", _backward_fused, _setup_fused, False),
    ("trifuse::dropout_add_rms_norm", _backward_fused, _setup_fused, True),
):
    torch.library.register_autograd(_name, _backward, setup_context=functools.partial(_setup, is_rms_norm=_is_rms))


# =============================================================================================
# Eager fast path: a thin autograd.Function straight over the launchers (a registered op costs
# ~60-150 us of host time per call; see DESIGN.md "Host overhead"). Same launchers, same bits.
# =============================================================================================


def _norm_rows(s, weight, bias, n, eps, is_rms_norm, clamp_eps=False):
    """The norm over s's rows of width n in PyTorch ops, fp32 (fp64 for fp64), shaped like s."""
    acc = torch.float64 if s.dtype == torch.float64 else torch.float32
    rows = s.to(acc).reshape(-1, n)
    w = None if weight is None else weight.to(acc).reshape(n)
    if clamp_eps:
        y = _rms_norm_clamped(rows, w, eps)
    elif is_rms_norm:
        y = F.rms_norm(rows, (n,), w, eps)
    else:
        y = F.layer_norm(rows, (n,), w, None if bias is None else bias.to(acc).reshape(n), eps)
    return y.reshape(s.shape)


def _norm_twice(ctx, *grads):
    """_NormFunction's backward in PyTorch ops, differentiable again (create_graph=True): the
    norm's gradients by autograd from s (x itself, or the stored sum, an output of this op whose
    own backward takes what reaches it), then s's gradient to the residual, and to x and x's bias
    through the forward's dropout mask (dropout_add's _DropoutMask: the same Philox draws over
    rows of width n). None where the sum was not stored."""
    s, weight, bias, x_bias, mean, rstd, seed = ctx.saved_tensors
    if not (ctx.fused or (ctx.residual_dtype is None and x_bias is None and ctx.p == 0.0)):
        return None
    needs = ctx.needs_input_grad
    dys = [g for g in grads[:ctx.outputs] if g is not None]
    ds = grads[ctx.outputs] if len(grads) > ctx.outputs else None
    ds_norm = dw = db = None
    if dys:
        acc = torch.float64 if s.dtype == torch.float64 else torch.float32
        dy = functools.reduce(torch.add, (g.to(acc) for g in dys))
        ds_norm, dw, db = reference_grads(
            lambda s, w, b: _norm_rows(s, w, b, ctx.n, ctx.eps, ctx.is_rms_norm,
                                       getattr(ctx, "clamp_eps", False)),
            (s, weight, bias),
            (needs[0] or needs[1] or needs[2], needs[3], needs[4]), (dy,))
    ds = ds_norm if ds is None else ds if ds_norm is None else ds_norm + ds
    if ds is None:
        return (None,) * 13
    dz = ds  # the gradient of dropout(x + x_bias)'s input
    if ctx.p > 0.0 and (needs[0] or needs[2]):
        from .dropout_add import _DropoutMask

        dz = _DropoutMask.apply(ds.reshape(-1, ctx.n), seed, ctx.p, ds.dtype).reshape(ds.shape)
    dxb = None
    if needs[2] and x_bias is not None:
        dxb = dz.reshape(-1, ctx.n).sum(0).reshape(x_bias.shape).to(x_bias.dtype)
    return (cast(dz, ctx.x_dtype) if needs[0] else None,
            cast(ds, ctx.residual_dtype) if needs[1] else None,
            dxb, dw, db, *(None,) * 8)


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, x_bias, weight, bias, n, eps, p, is_rms_norm, fused, op_name, narrowing,
                clamp_eps=False):
        # narrowing: None, or (out_dtype, readers, full_y) (one argument: each costs apply ~0.25 µs)
        out_dtype, readers, full_y = narrowing or (None, 1, False)
        seed = philox_seed(x.device) if p > 0.0 else None
        out = layer_norm_fwd(x, n, weight, bias, eps, is_rms_norm=is_rms_norm, residual=residual,
                             x_bias=x_bias, p=p, seed=seed, store_s=fused, clamp_eps=clamp_eps,
                             out_dtype=None if full_y else out_dtype, y2_dtype=out_dtype if full_y else None)
        y, s, mean, rstd = out[0], out[1], out[2], out[3]
        ctx.save_for_backward(s, weight, bias, x_bias, mean, rstd, seed)
        ctx.n, ctx.p, ctx.is_rms_norm, ctx.op_name = n, p, is_rms_norm, f"trifuse::{op_name}"
        ctx.eps, ctx.fused, ctx.clamp_eps = eps, fused, clamp_eps
        ctx.x_dtype = x.dtype
        ctx.residual_dtype = residual.dtype if residual is not None else None
        if readers == 1 and not full_y:
            ctx.outputs = 1
            if fused:  # an unread y or s gets None, not zeros: see backward
                ctx.set_materialize_grads(False)
                ctx.y_dtypes = (y.dtype,)
            return (y, s) if fused else y
        # y (in full as well, with full_y) and a view of the narrowed y for each reader beyond the
        # first: one buffer, each view's gradient reaching the backward apart.
        narrow = out[4] if full_y else y
        ys = ((y,) if full_y else ()) + (narrow, *(narrow.view_as(narrow) for _ in range(readers - 1)))
        ctx.outputs = len(ys)
        if fused:
            ctx.set_materialize_grads(False)
            ctx.y_dtypes = tuple(t.dtype for t in ys)
        return (*ys, s) if fused else ys

    @staticmethod
    @single_backward(twice=_norm_twice)
    def backward(ctx, *grads):
        dy, more_dy = grads[0], grads[1:ctx.outputs]
        ds = grads[ctx.outputs] if len(grads) > ctx.outputs else None
        s, weight, bias, x_bias, mean, rstd, seed = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if dy is None or any(g is None for g in more_dy):  # the fused form: unread outputs come as None
            if dy is None and all(g is None for g in more_dy):
                if ds is None:
                    return (None,) * 13
                # y unread: weight and bias reach the loss through nothing, so their gradients
                # are None as unfused (zeros would be decayed and stepped by an optimizer)
                needs = needs[:3] + (False, False) + needs[5:]
            dy, *more_dy = (torch.zeros(s.shape, dtype=t, device=s.device) if g is None else g
                            for g, t in zip((dy, *more_dy), ctx.y_dtypes))
            more_dy = tuple(more_dy)
        # dweight, dbias and dx_bias come out of the reduction kernel in their final dtypes.
        grad_dtypes = tuple(t.dtype if t is not None and need else None
                            for t, need in zip((weight, bias, x_bias), (needs[3], needs[4], needs[2])))
        x_dtype, residual_dtype = ctx.x_dtype, ctx.residual_dtype
        # dx and dresidual straight in their inputs' dtypes: written apart when they differ in
        # value (dropout) or in dtype (x in bf16, the residual stream in fp32 under autocast);
        # else one tensor serves both.
        store_dr = needs[1] and (ctx.p > 0.0 or (needs[0] and residual_dtype != x_dtype))
        dx_dtype = x_dtype if needs[0] or store_dr or not needs[1] else residual_dtype
        with profiled(ctx.op_name + "_backward"):
            dx, dr, dw, db, dxb = layer_norm_bwd(
                dy, s, ctx.n, weight, mean, rstd, is_rms_norm=ctx.is_rms_norm, ds=ds, p=ctx.p,
                seed=seed, store_dresidual=store_dr, grad_dtypes=grad_dtypes,
                dx_dtype=dx_dtype, dr_dtype=residual_dtype, more_dy=more_dy)
        return (
            cast(dx, x_dtype) if needs[0] else None,
            cast(dr, residual_dtype) if needs[1] else None,
            _grad_as(dxb, x_bias) if needs[2] else None,
            _grad_as(dw, weight) if needs[3] else None,
            _grad_as(db, bias) if needs[4] else None,
            None, None, None, None, None, None, None, None,
        )


def _norm_add_twice(ctx, dy):
    """_NormAddFunction's backward in PyTorch ops, differentiable again (create_graph=True)."""
    x, weight, bias, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dx, dw, db = reference_grads(lambda x, w, b: _norm_rows(x, w, b, ctx.n, ctx.eps, ctx.is_rms_norm),
                                 (x, weight, bias), (needs[0], needs[2], needs[3]), (dy,))
    return dx, cast(dy, ctx.residual_dtype) if needs[1] else None, dw, db, None, None, None, None


class _NormAddFunction(torch.autograd.Function):
    """y = residual + norm(x), eager: the launchers straight, as _NormFunction."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, n, eps, is_rms_norm, op_name):
        y, _, mean, rstd = layer_norm_fwd(x, n, weight, bias, eps, is_rms_norm=is_rms_norm, post=residual)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.n, ctx.is_rms_norm, ctx.op_name, ctx.eps = n, is_rms_norm, f"trifuse::{op_name}", eps
        ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
        return y

    @staticmethod
    @single_backward(twice=_norm_add_twice)
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx = dw = db = None
        if needs[0] or needs[2] or needs[3]:
            grad_dtypes = tuple(t.dtype if t is not None and need else None
                                for t, need in zip((weight, bias), (needs[2], needs[3])))
            with profiled(ctx.op_name + "_backward"):
                dx, _, dw, db, _ = layer_norm_bwd(dy, x, ctx.n, weight, mean, rstd, is_rms_norm=ctx.is_rms_norm,
                                                  grad_dtypes=(*grad_dtypes, None))
        return (
            cast(dx, ctx.x_dtype) if needs[0] else None,
            cast(dy, ctx.residual_dtype) if needs[1] else None,
            _grad_as(dw, weight) if needs[2] else None,
            _grad_as(db, bias) if needs[3] else None,
            None, None, None, None,
        )


# =============================================================================================
# Dialect: trifuse's kernels or PyTorch's F.layer_norm, whichever is faster for the shape, chosen
# once per (device, dtype, rows bucket, width, weight dtypes, grad) on the GPU and cached on disk
# (autotune/dialects.py). Traced calls (torch.compile, export) always see trifuse::layer_norm.
# =============================================================================================


def _key_width(shape: torch.Size, normalized_shape) -> int | None:
    """The normalized width of a call for the dialect keys, or None when x's trailing dims are
    not `normalized_shape` (the trifuse op then raises its error)."""
    k = len(normalized_shape)
    if k == 1:
        n = normalized_shape[0]
        return n if shape and shape[-1] == n else None
    if k > len(shape) or tuple(shape[len(shape) - k:]) != tuple(normalized_shape):
        return None
    return math.prod(normalized_shape)


def _layer_norm_key(x, normalized_shape, weight, bias, eps, out_dtype=None, readers=1, full_y=False):
    """The dialect key of an eager call; None (the trifuse op decides, and raises on bad input)
    when traced, empty, or when the shapes do not fit. About 1.5 µs: it runs on every call.
    A narrowed call (y in out_dtype, see `layer_norm`) gets one more entry, so that its choice
    is timed with the casts the other candidates need and kept apart from the plain call's."""
    if x is None or not eager_fast_path(x, weight, bias):
        return None
    n = _key_width(x.shape, normalized_shape)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return None
    grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                        or (bias is not None and bias.requires_grad))
    key = (x.get_device() if x.is_cuda else -1, x.dtype, pow2_bucket(rows), n,
           None if weight is None else weight.dtype, None if bias is None else bias.dtype, grad)
    return key if out_dtype is None and readers == 1 and not full_y else _narrowed_key(key, x, out_dtype, readers,
                                                                                       full_y)


def _narrowed_key(key: tuple, x: torch.Tensor, out_dtype, readers: int, full_y: bool) -> tuple | None:
    """`key` with the narrowing as its last entry ("bfloat16", "bfloat16x3", "bfloat16+y"), or
    None (trifuse's kernels) for a float64 x: the dialects' float64 oracle runs the reference on
    float64 inputs and must not narrow there."""
    if x.dtype == torch.float64:
        return None
    text = str(out_dtype).removeprefix("torch.")
    return (*key, text + ("+y" if full_y else f"x{readers}" if readers != 1 else ""))


# The candidates take the narrowing arguments of `layer_norm` (out_dtype, readers, full_y) after
# the plain ones: trifuse's kernels write y in out_dtype, PyTorch's y is cast once per reader.


def _layer_norm_trifuse(x, normalized_shape, weight, bias, eps, out_dtype=None, readers=1, full_y=False):
    return _norm("layer_norm", x, normalized_shape, weight, bias, eps, None, is_rms_norm=False,
                 out_dtype=out_dtype, readers=readers, full_y=full_y)


def _layer_norm_torch(x, normalized_shape, weight, bias, eps, out_dtype=None, readers=1, full_y=False):
    y = _torch_norm("layer_norm", x, normalized_shape, weight, bias, eps, False)
    return y if out_dtype is None else _cast_for_readers(y, out_dtype, readers, full_y)


def _layer_norm_dialect_ref(x, normalized_shape, weight, bias, eps, out_dtype=None, readers=1, full_y=False):
    """The layer_norm dialect's reference: `layer_norm_ref`, y cast as the narrowing says (not
    for float64 x: the oracle's run, which narrowed calls never make for real)."""
    y = layer_norm_ref(x, normalized_shape, weight, bias, eps)
    return _narrowed_ref(y, x, out_dtype, readers, full_y)


def _narrowed_ref(y: torch.Tensor, x: torch.Tensor, out_dtype, readers: int, full_y: bool):
    if out_dtype is None:
        return y
    if x.dtype == torch.float64:
        return ((y,) if full_y else ()) + (y,) * readers if readers + full_y > 1 else y
    return _cast_for_readers(y, out_dtype, readers, full_y)


def _torch_norm(op, x, normalized_shape, weight, bias, eps, is_rms_norm):
    """F.layer_norm / F.rms_norm for the dialects' torch candidates, in x's dtype (autocast would
    run them in fp32 and return fp32: the choice of implementation must not change the output
    dtype), with trifuse's errors. PyTorch raises on the bad inputs trifuse rejects but an eps below
    0 or NaN and integer tensors (mixed with float ones, _norm_mixed would compute in float and
    return integers), so trifuse's checks (a third of this path's host time) run only for those,
    or after PyTorch raised, to say what was wrong in trifuse's words (or re-raise PyTorch's)."""
    if not (isinstance(eps, (int, float)) and eps >= 0.0 and getattr(x, "dtype", None) in FLOAT_DTYPES
            and (weight is None or getattr(weight, "dtype", None) in FLOAT_DTYPES)
            and (bias is None or getattr(bias, "dtype", None) in FLOAT_DTYPES)):
        _check_norm_inputs(op, x, list(normalized_shape), weight, bias, eps)
    try:
        if unscoped(x.device):
            return _norm_mixed(x, normalized_shape, weight, bias, eps, is_rms_norm)
        with profiled(f"trifuse::{op}"), no_autocast(x.device):
            return _norm_mixed(x, normalized_shape, weight, bias, eps, is_rms_norm)
    except Exception:
        _check_norm_inputs(op, x, list(normalized_shape), weight, bias, eps)
        raise


def _layer_norm_torch_supports(x, normalized_shape, weight, bias, eps, *narrowing) -> str | None:
    allowed = (x.dtype, torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else (x.dtype,)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in allowed:
            return f"F.layer_norm takes {name} in {' or '.join(map(str, allowed))}, got {t.dtype}"
    return None


LAYER_NORM = dialects.define(
    "layer_norm", _layer_norm_key, ("device", "dtype", "rows", "n", "weight", "bias", "grad", "out"),
    reference=_layer_norm_dialect_ref,
    captures=((torch.nn.LayerNorm, lambda m, x: (x, tuple(m.normalized_shape), m.weight, m.bias, m.eps)),))
LAYER_NORM.register(dialects.Candidate("trifuse", _layer_norm_trifuse))
LAYER_NORM.register(dialects.Candidate("torch", _layer_norm_torch, supports=_layer_norm_torch_supports))


# RMSNorm the same way: trifuse's kernels or PyTorch's F.rms_norm (torch >= 2.4), per shape.


def _rms_norm_key(x, normalized_shape, weight, eps, out_dtype=None, readers=1, full_y=False):
    """The dialect key of an eager call, as `_layer_norm_key` without the bias; also None when the
    weight's shape does not fit (trifuse raises). About 1.5 µs: it runs on every call."""
    if x is None or not eager_fast_path(x, weight):
        return None
    n = _key_width(x.shape, normalized_shape)
    if n is None or (weight is not None and weight.numel() != n):
        return None
    rows = x.numel() // n if n else 0
    if rows == 0:
        return None
    grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))
    key = (x.get_device() if x.is_cuda else -1, x.dtype, pow2_bucket(rows), n,
           None if weight is None else weight.dtype, grad)
    return key if out_dtype is None and readers == 1 and not full_y else _narrowed_key(key, x, out_dtype, readers,
                                                                                       full_y)


def _rms_norm_trifuse(x, normalized_shape, weight, eps, out_dtype=None, readers=1, full_y=False):
    return _norm("rms_norm", x, normalized_shape, weight, None, eps, None, is_rms_norm=True,
                 out_dtype=out_dtype, readers=readers, full_y=full_y)


def _rms_norm_torch(x, normalized_shape, weight, eps, out_dtype=None, readers=1, full_y=False):
    y = _torch_norm("rms_norm", x, normalized_shape, weight, None, eps, True)
    return y if out_dtype is None else _cast_for_readers(y, out_dtype, readers, full_y)


def _rms_norm_dialect_ref(x, normalized_shape, weight, eps, out_dtype=None, readers=1, full_y=False):
    """The rms_norm dialect's reference, narrowed as `_layer_norm_dialect_ref`."""
    return _narrowed_ref(rms_norm_ref(x, normalized_shape, weight, eps), x, out_dtype, readers, full_y)


def _rms_norm_torch_supports(x, normalized_shape, weight, eps, *narrowing) -> str | None:
    if not hasattr(F, "rms_norm"):
        return f"F.rms_norm needs torch >= 2.4, this is {torch.__version__}"
    allowed = (x.dtype, torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else (x.dtype,)
    if weight is not None and weight.dtype not in allowed:
        return f"F.rms_norm takes weight in {' or '.join(map(str, allowed))}, got {weight.dtype}"
    return None


def _rms_norm_module_args(m, x):
    # nn.RMSNorm's eps None: PyTorch's default, resolved here as trifuse.ops.rms_norm does.
    eps = m.eps if m.eps is not None else default_rms_eps(x.dtype)
    return x, tuple(m.normalized_shape), m.weight, eps


RMS_NORM = dialects.define(
    "rms_norm", _rms_norm_key, ("device", "dtype", "rows", "n", "weight", "grad", "out"),
    reference=_rms_norm_dialect_ref,
    # torch.nn.RMSNorm exists from torch 2.4, as F.rms_norm.
    captures=((torch.nn.RMSNorm, _rms_norm_module_args),) if hasattr(torch.nn, "RMSNorm") else ())
RMS_NORM.register(dialects.Candidate("trifuse", _rms_norm_trifuse))
RMS_NORM.register(dialects.Candidate("torch", _rms_norm_torch, supports=_rms_norm_torch_supports))


# The residual stream (s = residual + dropout(x + x_bias), y = norm(s)) the same way: trifuse's
# one kernel each way, or PyTorch's add(s) and F.layer_norm / F.rms_norm. Without dropout only:
# PyTorch's dropout draws another mask and stores it, so with dropout trifuse's kernels take the
# call alone (nothing timed). Calls with several readers of y (or full_y) stay with trifuse's
# kernels: their outputs nest.


def _residual_stream_key(x, residual, normalized_shape, weight, bias, eps, p, x_bias, out_dtype):
    """The dialect key of an eager residual-stream call; None (trifuse's kernels decide, and raise
    on bad input) when traced, empty, or when the shapes do not fit. It runs on every call."""
    if x is None or not eager_fast_path(x, residual, weight, bias, x_bias):
        return None
    n = _key_width(x.shape, normalized_shape)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return None
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (x, residual, weight, bias, x_bias))
    key = (x.get_device() if x.is_cuda else -1, x.dtype, None if residual is None else residual.dtype,
           pow2_bucket(rows), n, None if weight is None else weight.dtype, None if bias is None else bias.dtype,
           None if x_bias is None else x_bias.dtype, p > 0.0, grad)
    return key if out_dtype is None else _narrowed_key(key, x, out_dtype, 1, False)


_RESIDUAL_STREAM_KEY_NAMES = ("device", "dtype", "residual", "rows", "n", "weight", "bias", "x_bias", "dropout",
                              "grad", "out")


def _residual_stream_trifuse(op, is_rms_norm):
    def run(x, residual, normalized_shape, weight, bias, eps, p, x_bias, out_dtype):
        return _norm_kernels(op, x, normalized_shape, weight, bias, eps, residual, is_rms_norm, p, x_bias,
                             out_dtype)
    return run


def _residual_stream_torch(op, is_rms_norm):
    def run(x, residual, normalized_shape, weight, bias, eps, p, x_bias, out_dtype):
        """PyTorch's add and norm for a call without dropout (supports rejects the others), with
        trifuse's errors (`+` would broadcast a residual or x_bias the op refuses); s in x's
        dtype promoted with residual's and contiguous, y in s's (or out_dtype), as trifuse's
        kernels. trifuse's full checks (half this path's host time) run only where a cheap look
        finds something off, or after PyTorch raised, to say what was wrong in trifuse's words;
        the norm's own inputs are `_torch_norm`'s to check."""
        if not (x.dtype in FLOAT_DTYPES and (residual is None or (residual.shape == x.shape
                                                                  and residual.dtype in FLOAT_DTYPES))
                and (x_bias is None or (tuple(x_bias.shape) == tuple(normalized_shape)
                                        and x_bias.dtype in FLOAT_DTYPES))):
            _check_norm_inputs(op, x, normalized_shape, weight, bias, eps, residual, x_bias, p)
        if out_dtype is not None:
            _check_narrowing(op, out_dtype)
        try:
            with profiled(f"trifuse::{op}"):
                s = x if x_bias is None else x + x_bias
                if residual is not None:
                    s = residual + s
                s = s.to(x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)).contiguous()
        except Exception:
            _check_norm_inputs(op, x, normalized_shape, weight, bias, eps, residual, x_bias, p)
            raise
        y = _torch_norm(op, s, normalized_shape, weight, bias, eps, is_rms_norm)
        return (y if out_dtype is None else y.to(out_dtype)), s
    return run


def _residual_stream_torch_supports(x, residual, normalized_shape, weight, bias, eps, p, x_bias, out_dtype):
    if p > 0.0:
        return DROPOUT_NOT_EXCHANGED
    s_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    allowed = (s_dtype, torch.float32) if s_dtype in (torch.float16, torch.bfloat16) else (s_dtype,)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in allowed:
            return f"PyTorch's norm takes {name} in {' or '.join(map(str, allowed))}, got {t.dtype}"
    return None


def _residual_stream_ref(is_rms_norm):
    def ref(x, residual, normalized_shape, weight, bias, eps, p, x_bias, out_dtype):
        """The dialect's reference for the calls it measures (no dropout): (y, s), y narrowed as
        `_layer_norm_dialect_ref` narrows it."""
        out = layer_norm_ref(x, normalized_shape, weight, bias, eps, residual, is_rms_norm=is_rms_norm,
                             x_bias=x_bias)
        y, s = out if isinstance(out, tuple) else (out, x)  # (dropout alone: never measured)
        return _narrowed_ref(y, x, out_dtype, 1, False), s
    return ref


DROPOUT_ADD_LAYER_NORM = dialects.define("dropout_add_layer_norm", _residual_stream_key, _RESIDUAL_STREAM_KEY_NAMES,
                                         reference=_residual_stream_ref(False))
DROPOUT_ADD_LAYER_NORM.register(dialects.Candidate(
    "trifuse", _residual_stream_trifuse("dropout_add_layer_norm", False)))
DROPOUT_ADD_LAYER_NORM.register(dialects.Candidate(
    "torch", _residual_stream_torch("dropout_add_layer_norm", False), supports=_residual_stream_torch_supports))
DROPOUT_ADD_RMS_NORM = dialects.define("dropout_add_rms_norm", _residual_stream_key, _RESIDUAL_STREAM_KEY_NAMES,
                                       reference=_residual_stream_ref(True))
DROPOUT_ADD_RMS_NORM.register(dialects.Candidate("trifuse", _residual_stream_trifuse("dropout_add_rms_norm", True)))
DROPOUT_ADD_RMS_NORM.register(dialects.Candidate(
    "torch", _residual_stream_torch("dropout_add_rms_norm", True), supports=_residual_stream_torch_supports))


# The post-norm residual add (y = residual + norm(x), `layer_norm_add`) the same way: trifuse's
# one kernel each way, or PyTorch's norm then the add.


def _norm_add_key(x, residual, normalized_shape, weight, bias, eps):
    """The dialect key of an eager `layer_norm_add` call; None (trifuse's kernels decide, and
    raise on bad input) when traced, empty, or when the shapes do not fit."""
    if x is None or residual is None or not eager_fast_path(x, residual, weight, bias):
        return None
    n = _key_width(x.shape, normalized_shape)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return None
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight, bias))
    return (x.get_device() if x.is_cuda else -1, x.dtype, residual.dtype, pow2_bucket(rows), n,
            None if weight is None else weight.dtype, None if bias is None else bias.dtype, grad)


def _norm_add_trifuse(op, is_rms_norm):
    def run(x, residual, normalized_shape, weight, bias, eps):
        if eager_fast_path(x, weight, bias, residual):
            n = _check_norm_add_inputs(op, x, residual, normalized_shape, weight, bias, eps)
            with profiled(f"trifuse::{op}"):
                return apply_function(_NormAddFunction, x, residual, weight, bias, n, eps, is_rms_norm, op)
        if is_rms_norm:
            return torch.ops.trifuse.rms_norm_add(x, residual, normalized_shape, weight, eps)[0]
        return torch.ops.trifuse.layer_norm_add(x, residual, normalized_shape, weight, bias, eps)[0]
    return run


def _norm_add_torch(op, is_rms_norm):
    def run(x, residual, normalized_shape, weight, bias, eps):
        """PyTorch's norm and add, with trifuse's errors first (`+` would broadcast a residual the
        op refuses); the norm in x's dtype, y in x's promoted with residual's, contiguous."""
        if residual is None or residual.shape != x.shape or residual.dtype not in FLOAT_DTYPES:
            _check_norm_add_inputs(op, x, residual, normalized_shape, weight, bias, eps)  # raises
        y = _torch_norm(op, x, normalized_shape, weight, bias, eps, is_rms_norm)  # (its inputs: its checks)
        try:
            with profiled(f"trifuse::{op}"):
                return (residual + y).to(torch.promote_types(x.dtype, residual.dtype)).contiguous()
        except Exception:
            _check_norm_add_inputs(op, x, residual, normalized_shape, weight, bias, eps)
            raise
    return run


def _norm_add_torch_supports(x, residual, normalized_shape, weight, bias, eps):
    return _layer_norm_torch_supports(x, normalized_shape, weight, bias, eps)


def _norm_add_ref(is_rms_norm):
    def ref(x, residual, normalized_shape, weight, bias, eps):
        """residual + norm(x), the norm in float64 for the oracle as for the tests."""
        return residual + _norm_mixed(x, normalized_shape, weight, bias, eps, is_rms_norm)
    return ref


_NORM_ADD_KEY_NAMES = ("device", "dtype", "residual", "rows", "n", "weight", "bias", "grad")
LAYER_NORM_ADD = dialects.define("layer_norm_add", _norm_add_key, _NORM_ADD_KEY_NAMES, reference=_norm_add_ref(False))
LAYER_NORM_ADD.register(dialects.Candidate("trifuse", _norm_add_trifuse("layer_norm_add", False)))
LAYER_NORM_ADD.register(dialects.Candidate("torch", _norm_add_torch("layer_norm_add", False),
                                           supports=_norm_add_torch_supports))
RMS_NORM_ADD = dialects.define("rms_norm_add", _norm_add_key, _NORM_ADD_KEY_NAMES, reference=_norm_add_ref(True))
RMS_NORM_ADD.register(dialects.Candidate("trifuse", _norm_add_trifuse("rms_norm_add", True)))
RMS_NORM_ADD.register(dialects.Candidate("torch", _norm_add_torch("rms_norm_add", True),
                                         supports=_norm_add_torch_supports))


# =============================================================================================
# Public API
# =============================================================================================


def _norm(op_name, x, normalized_shape, weight, bias, eps, residual, is_rms_norm, p=0.0, x_bias=None,
          out_dtype=None, readers=1, full_y=False):
    if (residual is not None or p > 0.0 or x_bias is not None) and readers == 1 and not full_y:
        # the residual stream with one y: its dialect (eager calls; traced ones get trifuse's)
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        dialect = DROPOUT_ADD_RMS_NORM if is_rms_norm else DROPOUT_ADD_LAYER_NORM
        return dialect(x, residual, normalized_shape, weight, bias, eps, p, x_bias, out_dtype)
    return _norm_kernels(op_name, x, normalized_shape, weight, bias, eps, residual, is_rms_norm, p, x_bias,
                         out_dtype, readers, full_y)


def _norm_kernels(op_name, x, normalized_shape, weight, bias, eps, residual, is_rms_norm, p=0.0, x_bias=None,
                  out_dtype=None, readers=1, full_y=False, clamp_eps=False):
    normalized_shape = _shape_list(op_name, normalized_shape)
    fused = residual is not None or p > 0.0 or x_bias is not None
    check_tensor(op_name, "input", x)
    narrowing = None
    if out_dtype is not None or readers != 1 or full_y:
        _check_narrowing(op_name, out_dtype, readers, full_y)
        narrowing = (out_dtype, readers, full_y)
    if eager_fast_path(x, weight, bias, residual, x_bias):
        n = _check_norm_inputs(op_name, x, normalized_shape, weight, bias, eps, residual, x_bias, p)
        with profiled(f"trifuse::{op_name}"):
            out = apply_function(_NormFunction, x, residual, x_bias, weight, bias, n, eps, p, is_rms_norm,
                                 fused, op_name, narrowing, *((True,) if clamp_eps else ()))
        outputs = readers + full_y
        return ((out[:outputs], out[outputs]) if fused else out) if outputs > 1 else out
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual), ("x_bias", x_bias)):
        if t is not None:  # (the fast path above takes tensors only: no cost there)
            check_tensor(op_name, name, t)
    # Traced, or tensor subclasses: the registered ops. One narrowed y, or y in full and one
    # narrowed (full_y), they write themselves (a compiler cannot fuse a cast into an opaque op:
    # one more pass over y and one over its gradient); several readers as casts after them, of y
    # in fp32 at least: each cast's gradient comes back in fp32 and autograd sums them there (a
    # 16-bit y's `.to` would be y itself, its readers' gradients summed in 16 bits).
    if out_dtype is None:
        narrow = ()
    elif readers == 1:
        narrow = (out_dtype, True) if full_y else (out_dtype,)
    else:
        narrow = (torch.promote_types(x.dtype, torch.float32),)
    if fused:
        if is_rms_norm:
            out = torch.ops.trifuse.dropout_add_rms_norm(
                x, residual, normalized_shape, weight, eps, p, x_bias, *narrow)
        else:
            out = torch.ops.trifuse.dropout_add_layer_norm(
                x, residual, normalized_shape, weight, bias, eps, p, x_bias, *narrow)
        return _traced_ys(out, narrow, out_dtype, readers, full_y), out[1]
    if is_rms_norm:
        # clamp_eps after (out_dtype, full_y), positional: DTensor's rule takes them so
        clamped = (*narrow, *(None, False)[len(narrow):], True) if clamp_eps else narrow
        out = torch.ops.trifuse.rms_norm(x, normalized_shape, weight, eps, *clamped)
    else:
        out = torch.ops.trifuse.layer_norm(x, normalized_shape, weight, bias, eps, *narrow)
    return _traced_ys(out, narrow, out_dtype, readers, full_y)


def _traced_ys(out: tuple, narrow: tuple, out_dtype, readers: int, full_y: bool):
    """What `layer_norm`'s y is from a registered forward op's outputs: y as the op wrote it
    (narrowed, or with y_narrow under full_y), else cast after it for the readers."""
    if not narrow or readers > 1:
        return _cast_for_readers(out[0], out_dtype, readers, full_y)
    return (out[0], out[-1]) if full_y else out[0]


def _cast_for_readers(y: torch.Tensor, out_dtype: torch.dtype | None, readers: int, full_y: bool):
    """y in out_dtype, one cast per reader when several (each cast's gradient comes back in fp32
    and autograd sums them there, as the model's own casts of its fp32 y did: a 16-bit y is
    upcast first, else its readers' gradients would sum in 16 bits), after y itself with full_y."""
    if out_dtype is None:
        return y
    if readers > 1 and y.dtype.itemsize < 4:
        y = y.float()
    ys = ((y,) if full_y else ()) + tuple(y.to(out_dtype) for _ in range(readers))
    return ys if len(ys) > 1 else ys[0]


def _check_narrowing(op: str, out_dtype, readers: int = 1, full_y: bool = False) -> None:
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"trifuse.{op}: out_dtype must be a floating-point torch.dtype"
                        f"{'' if readers != 1 or full_y else ' or None'}, got {out_dtype!r}")
    if not isinstance(full_y, bool):
        raise TypeError(f"trifuse.{op}: full_y must be a bool, got {full_y!r}")
    most = 1 if full_y else MAX_READERS  # with full_y: two gradients to add, in either order the same bits
    if type(readers) is not int or not 1 <= readers <= most:
        raise ValueError(f"trifuse.{op}: readers must be an int from 1 to {most}"
                         f"{' with full_y' if full_y else ''}, got {readers!r}")


def _shape_list(op: str, normalized_shape) -> list[int]:
    """normalized_shape as a list of ints (an int is one dim; symbolic ints where traced with dynamic
    shapes), or a TypeError naming the op."""
    def is_size(n) -> bool:
        return isinstance(n, (int, torch.SymInt)) and not isinstance(n, bool)

    if is_size(normalized_shape):
        return [normalized_shape]
    if isinstance(normalized_shape, (list, tuple, torch.Size)) and all(is_size(n) for n in normalized_shape):
        return list(normalized_shape)
    got = type(normalized_shape).__name__
    if isinstance(normalized_shape, (list, tuple)):
        got += " of " + ", ".join(sorted({type(n).__name__ for n in normalized_shape}))
    raise TypeError(f"trifuse.{op}: normalized_shape must be an int or a sequence of ints, got {got}")


@outside_device_modes
def layer_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    readers: int = 1,
    full_y: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """LayerNorm over the trailing `normalized_shape` dims, like `F.layer_norm`.

    Args:
        x: (..., *normalized_shape), fp16 / bf16 / fp32 / fp64; any strides.
        weight, bias: normalized_shape, optional; any float dtype.
        residual: like x, optional. When given, computes s = x + residual and y = LN(s) in one
            pass and returns (y, s): the pre-norm residual stream (`dropout_add_layer_norm`, its
            dialect included). Gradients reach x and residual.
        out_dtype: y's dtype, when not x's (s keeps its own): the kernel rounds y to it once, as
            `y.to(out_dtype)` would, without that cast's pass over y, and the gradient arriving at
            y may be in it. `fuse` sets it under autocast where y feeds only matmuls that would
            cast it to the autocast dtype anyway.
        readers: with out_dtype, y comes as a tuple of this many views of one buffer (at most 3),
            one for each matmul reading it: their gradients reach the backward apart and are
            summed there in fp32, as autograd sums the gradients of one cast per matmul (on one
            16-bit y it would sum them in 16 bits).
        full_y: with out_dtype and one reader, returns (y in its own dtype, y in out_dtype), for
            a y that other ops read in full too (a post-norm block's residual): the kernel stores
            both, and the backward adds their gradients (one reader only: an fp32 sum of three
            gradients would depend on their order).

    Returns:
        y shaped like x (or (y, s)), in x's dtype (promoted with residual's).

    Without a residual, eager calls run trifuse's kernels or F.layer_norm, whichever the
    `layer_norm` dialect measured faster for this shape on this GPU
    (`trifuse.autotune.dialects.explain("layer_norm", x, ...)` says which and why); elsewhere,
    and under torch.compile, trifuse's.

    Raises:
        TypeError for non-float tensors; ValueError for shapes, devices or eps that do not fit.
    """
    if residual is not None:
        return _norm("dropout_add_layer_norm", x, normalized_shape, weight, bias, eps, residual,
                     is_rms_norm=False, out_dtype=out_dtype, readers=readers, full_y=full_y)
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if out_dtype is None and readers == 1 and not full_y:
        return LAYER_NORM(x, normalized_shape, weight, bias, eps)
    # Narrowed: the dialect times each candidate with what it needs to narrow (PyTorch's y is cast,
    # once per reader; trifuse's kernels write it so), apart from the plain call's choice.
    _check_narrowing("layer_norm", out_dtype, readers, full_y)
    return LAYER_NORM(x, normalized_shape, weight, bias, eps, out_dtype, readers, full_y)


@outside_device_modes
def rms_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    readers: int = 1,
    full_y: bool = False,
    clamp_eps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """RMSNorm, like `F.rms_norm` (eps None: the epsilon of the dtype PyTorch computes in, fp32's
    for 16-bit x, as `torch.rms_norm` does; `default_rms_eps`).

    y = s * rsqrt(mean(s^2) + eps) * weight over the trailing dims, with s = x (+ residual).
    Shapes, dtypes, the residual form, out_dtype, readers, full_y and errors as `layer_norm`;
    without a residual, eager calls run trifuse's kernels or F.rms_norm, whichever the `rms_norm`
    dialect measured faster (`trifuse.autotune.dialects.explain("rms_norm", x, ...)` says which
    and why).

    With `clamp_eps` (no residual), eps floors the root mean square instead:
    y = x / max(rms(x), eps) * weight, with no gradient through a floored rms. That is
    `F.normalize(x, dim=-1, eps=e)` over a width n as `rms_norm(x, n, n ** -0.5 * ones, e / n ** 0.5,
    clamp_eps=True)`. Always trifuse's kernels (PyTorch has no such RMSNorm).
    """
    if eps is None:
        eps = default_rms_eps(x.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else 1e-6
    if not isinstance(clamp_eps, bool):
        raise TypeError(f"trifuse.rms_norm: clamp_eps must be a bool, got {clamp_eps!r}")
    if clamp_eps:
        if residual is not None:
            raise ValueError("trifuse.rms_norm: clamp_eps takes no residual (the residual stream adds eps)")
        return _norm_kernels("rms_norm", x, normalized_shape, weight, None, eps, None, True,
                             out_dtype=out_dtype, readers=readers, full_y=full_y, clamp_eps=True)
    if residual is not None:
        return _norm("dropout_add_rms_norm", x, normalized_shape, weight, None, eps, residual,
                     is_rms_norm=True, out_dtype=out_dtype, readers=readers, full_y=full_y)
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if out_dtype is None and readers == 1 and not full_y:
        return RMS_NORM(x, normalized_shape, weight, eps)
    _check_narrowing("rms_norm", out_dtype, readers, full_y)  # narrowed: as in layer_norm
    return RMS_NORM(x, normalized_shape, weight, eps, out_dtype, readers, full_y)


@outside_device_modes
def dropout_add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    p: float = 0.0,
    training: bool = True,
    x_bias: torch.Tensor | None = None,
    is_rms_norm: bool = False,
    out_dtype: torch.dtype | None = None,
    readers: int = 1,
    full_y: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream of a transformer block in one kernel each way:

        s = residual + dropout(x + x_bias, p);  y = LayerNorm(s) (or RMSNorm);  returns (y, s)

    x_bias is the bias of the linear that produced x, folded in here. With training=False or
    p=0 no random numbers are drawn. The mask comes from Philox seeded by PyTorch's generator on
    x's device (torch.manual_seed controls it) and is regenerated in the backward; p=1 gives
    s = residual. Shapes, dtypes, out_dtype, readers and full_y (y's alone) as `layer_norm`; with
    is_rms_norm=True, bias must be None.

    Eager calls without dropout and with one y run trifuse's kernel or PyTorch's add and norm,
    whichever the `dropout_add_layer_norm` (`dropout_add_rms_norm`) dialect measured faster for
    this shape on this GPU (`trifuse.autotune.dialects.explain("dropout_add_layer_norm", x,
    residual, normalized_shape, weight, bias, eps, p, x_bias, out_dtype)` says which); so do
    `layer_norm` and `rms_norm` with a residual. Elsewhere, and under torch.compile, trifuse's.

    Raises:
        ValueError for p outside [0, 1] and everything `layer_norm` rejects.
    """
    check_probability("dropout_add_layer_norm", "p", p)
    if is_rms_norm and bias is not None:
        raise ValueError("trifuse.dropout_add_rms_norm: RMSNorm takes no bias, got one")
    p = float(p) if training else 0.0
    op = "dropout_add_rms_norm" if is_rms_norm else "dropout_add_layer_norm"
    if residual is None and p == 0.0 and x_bias is None:
        # Nothing to add: still return (y, s) with s = x, as the signature promises.
        y = _norm(op, x, normalized_shape, weight, bias, eps, None, is_rms_norm, out_dtype=out_dtype,
                  readers=readers, full_y=full_y)
        return y, x
    return _norm(op, x, normalized_shape, weight, bias, eps, residual, is_rms_norm, p, x_bias,
                 out_dtype, readers, full_y)


@outside_device_modes
def layer_norm_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    is_rms_norm: bool = False,
) -> torch.Tensor:
    """The post-norm residual add in one kernel each way:

        y = residual + LayerNorm(x)   (or RMSNorm with is_rms_norm=True, bias None)

    as OLMo 2's blocks (`residual + post_attention_layernorm(attn_out)`), Gemma 2's sandwich norms
    and Swin V2 write it. The norm's output is added in fp32 and rounded once (the model rounds it
    to x's dtype first). Gradients reach x, residual (dy itself), weight and bias.

    Args:
        x: (..., *normalized_shape), fp16 / bf16 / fp32 / fp64; any strides.
        residual: shaped like x, any float dtype; y takes the dtype x and residual promote to.
        weight, bias, eps: as `layer_norm` (`rms_norm`: eps None as `rms_norm` resolves it).

    Raises:
        TypeError for non-float tensors; ValueError for shapes, devices or eps that do not fit,
        and for a bias with is_rms_norm=True.

    Eager calls run trifuse's kernel or PyTorch's norm and add, whichever the `layer_norm_add`
    (`rms_norm_add`) dialect measured faster for this shape on this GPU; elsewhere, and under
    torch.compile, trifuse's.
    """
    op = "rms_norm_add" if is_rms_norm else "layer_norm_add"
    if is_rms_norm and bias is not None:
        raise ValueError("trifuse.rms_norm_add: RMSNorm takes no bias, got one")
    if eps is None:
        eps = default_rms_eps(x.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else 1e-6
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = list(normalized_shape)
    check_tensor(op, "input", x)
    return (RMS_NORM_ADD if is_rms_norm else LAYER_NORM_ADD)(x, residual, normalized_shape, weight, bias, eps)
