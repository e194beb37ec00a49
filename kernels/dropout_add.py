"""Bias + dropout + residual add: y = residual + dropout(x + bias, p), the end of a sublayer.

Maths, per element of the (M, N) view (rows = all leading dims), in fp32 (fp64 for fp64):

    keep = dropout_keep_quads(seed, row, col, p)      Philox; P(keep) = 1 - p
    y    = residual + (keep ? (x + bias) / (1 - p) : 0)

Backward: dx = keep ? dy / (1 - p) : 0;  dbias = sum over rows of dx;  dresidual = dy.

p = 0 or training=False is a plain add: no random numbers are drawn. p = 1 drops everything
and gives y = residual exactly (no 0 * inf = NaN from the dropped branch).

Shapes: x, residual, y (..., N); bias (N,) or None. Dtypes: fp16 / bf16 / fp32 / fp64
activations, y in their promoted dtype; bias any float dtype (fp32 master weights under
autocast); each gradient in its input's dtype.

Memory plan: nothing per element is saved. The forward draws one int64 seed from PyTorch's
generator on x's device (`philox_seed`: torch.manual_seed controls it, CUDA-graph safe) and the
backward regenerates the mask from (seed, row, column). dresidual is dy itself (no copy). dbias
is reduced deterministically: fp32 partial rows, one per backward program, summed afterwards in
a fixed order.

Gated (`gate=`): y = residual + gate * dropout(x + bias), the end of a diffusion transformer's
block (`h = h + gate_mlp[:, None] * ff_out`, Wan's `(h.float() + ff_out * gate).type_as(h)`) and
a LayerScale (`x + gamma * f(x)`). The gate is one vector per sample, broadcast like adaLN's
modulation (kernels/adaptive_norm.py): (B, 1, N), (B, N)[:, None] or (N,); it reaches the kernels
as (G, N) rows in fp32, row r of x reading gate row r // (M / G). Backward: dz = keep ? dy / (1 -
p) : 0;  dx = dz * gate;  dgate_g = sum over g's rows of dz * (x + bias);  dbias = sum of dx. The
backward's programs each walk rows of one sample (G x splits x column tiles), so each partial row
of dgate belongs to one sample: summed per sample afterwards, in a fixed order. A bias that wants
no gradient still shifts dgate's x + bias.

Per token (a gate varying along a sample's rows: FLUX.3's and Qwen-Image 2.1's block ends, `h +
gate * out` with gate a (B, S, N) chunk of a per-token projection): the forward reads a gate row
beside each row of x, in place at its own row stride and dtype (one per position repeated over the
batch, MiniMax H3's (S, N), read in place too, row r reading gate row r % S; one broadcast
otherwise, (B, S, 1), copied to full size first); the backward writes dgate = dz * (x + bias) per element, in the gate's dtype (summed
down in PyTorch where the gate broadcasts), beside dx = dz * gate; only dbias sums over rows.
Bytes per element: forward 4 (x, residual, gate, y) against eager PyTorch's 6 (product 3, sum 3);
backward 5 (dy, gate, x, dx, dgate) against 6 (two products; dresidual is dy itself).

Kernels: 2-D tiles of several rows x up to 1024 columns (kernels/_tiles.py), int64 row
offsets, the launch configuration tuned per shape bucket (autotune/configs.py: rowwise_fwd,
rowwise_bwd, with the backward's prefetch of the next row tile). The mask draws four decisions
per Philox call (`dropout_keep_quads`): one call per element would make these bandwidth-bound
kernels compute-bound on H100.
"""
import torch
import triton
import triton.language as tl

from ..autotune import dialects, pow2_bucket
from ._common import (
    DROPOUT_NOT_EXCHANGED,
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
    device_sms,
    eager_fast_path,
    empty_like,
    outside_device_modes,
    philox_seed,
    profiled,
    single_backward,
    use_triton,
)
from ._launch import CachedKernel
from ._random import dropout_keep_quads
from ._tiles import (
    RowwiseTuning,
    cdiv,
    rowwise_launch,
    run_one_tile,
    run_summing,
    time_one_tile,
    time_summing,
)
from .adaptive_norm import _as_groups, _check_per_token, _rows_of, _sample_dims

# =============================================================================================
# Reference: the spec. It takes the kernel's mask as an argument so tests can compare exactly.
# =============================================================================================


def dropout_add_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
    bias: torch.Tensor | None = None,
    *,
    dropout_mask: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + gate * dropout(x + bias) in plain PyTorch (no gate: 1), `dropout_mask` (bool,
    True = keep) standing in for the kernel's random mask; no mask means no dropout."""
    z = x if bias is None else x + bias
    if training and dropout_mask is not None and p > 0.0:
        z = z * dropout_mask / (1.0 - p) if p < 1.0 else torch.zeros_like(z)
    return residual + (z if gate is None else gate * z)


# =============================================================================================
# Kernels
# =============================================================================================


@triton.jit
def _dropout_add_fwd_kernel(
    X,  # in (M, N)
    R,  # in (M, N) residual
    B,  # in (N,) bias; unused unless HAS_BIAS
    G,  # in (gate_rows, N) gate rows, row stride stride_gm; unused unless HAS_GATE
    SEED,  # in (1,) int64 Philox seed; unused unless HAS_DROPOUT
    Y,  # out (M, N)
    M, N, stride_xm, stride_rm, stride_ym, stride_gm, p, scale, rows_per_gate, gate_rows, col_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, ACC: tl.constexpr, HAS_GATE: tl.constexpr = False,
):
    # A 1-D grid over (row tile, column tile): no 65535 limit on a second grid axis.
    pid = tl.program_id(0)
    rows = (pid // col_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows * stride
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    z = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(ACC)
    if HAS_BIAS:
        z += tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    if HAS_DROPOUT:
        keep = dropout_keep_quads(tl.load(SEED), rows[:, None], cols[None, :], p)
        z = tl.where(keep, z * scale, 0.0)
    if HAS_GATE:
        # row r reads gate row (r // rows_per_gate) % gate_rows: one per sample (r // R), one per
        # token (r), or one per position repeated over the leading dims ((S, N) against (B, S, N))
        g_rows = (tl.minimum(rows, M - 1) // rows_per_gate) % gate_rows  # rows past M read a real one
        z *= tl.load(G + g_rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0).to(ACC)
    y = tl.load(R + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(ACC) + z
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dropout_add_bwd_kernel(
    DY,  # in (M, N)
    SEED,  # in (1,) int64 Philox seed
    DX,  # out (M, N)
    DB_PARTIAL,  # out (groups, N) fp32: this program's rows' share of dbias; unused unless HAS_BIAS
    M, N, stride_dym, stride_dxm, p, scale, rows_per_program, col_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
    PREFETCH: tl.constexpr = False,
):
    pid = tl.program_id(0)
    group = pid // col_tiles
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    seed = tl.load(SEED)
    row_start = group.to(tl.int64) * rows_per_program  # int64: rows * stride may pass 2^31
    row_end = tl.minimum(row_start + rows_per_program, M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    if PREFETCH:  # the first tile's load, issued before the loop (see the loop's head)
        rows = row_start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        dy_next = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        if PREFETCH:
            # This tile was loaded one step ago; the next one's load goes out before this tile's
            # Philox rounds, so a thread keeps two tiles' loads in flight, not one.
            dy_tile = dy_next
            ahead = rows + BLOCK_M
            mask_ahead = (ahead < row_end)[:, None] & col_mask[None, :]
            dy_next = tl.load(DY + ahead[:, None] * stride_dym + cols[None, :], mask=mask_ahead, other=0.0)
        else:
            dy_tile = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0)
        dx = tl.where(dropout_keep_quads(seed, rows[:, None], cols[None, :], p), dy_tile.to(ACC) * scale, 0.0)
        tl.store(DX + rows[:, None] * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc += dx  # 0 where masked: dy loads as 0 there
    if HAS_BIAS:
        tl.store(DB_PARTIAL + group.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def _gated_dropout_add_bwd_kernel(
    DY,  # in (M, N)
    X,  # in (M, N); unused unless NEED_DGATE
    B,  # in (N,) bias; unused unless NEED_DGATE and HAS_BIAS
    G,  # in (M / R, N) gate rows, contiguous
    SEED,  # in (1,) int64 Philox seed; unused unless HAS_DROPOUT
    DX,  # out (M, N); unused unless NEED_DX
    DG_PARTIAL,  # out (M / R * splits, N) fp32: a program's share of its sample's dgate; unused unless NEED_DGATE
    DB_PARTIAL,  # out (M / R * splits, N) fp32: a program's share of dbias; unused unless NEED_DBIAS
    R, N, stride_dym, stride_xm, stride_dxm, p, scale, rows_per_program, splits, col_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DGATE: tl.constexpr, ACC: tl.constexpr, NEED_DBIAS: tl.constexpr,
    PREFETCH: tl.constexpr = False,  # a knob of the tuned space (rowwise_bwd); this loop does not prefetch
):
    # HAS_BIAS: x's bias is given, and dgate's z = x + bias reads it whether or not the bias wants a
    # gradient (a frozen bias still shifts z); NEED_DBIAS: its partial sums are asked for.
    # program -> (sample, split of its R rows, column tile): no program's rows cross a sample
    pid = tl.program_id(0)
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    part = (pid // col_tiles).to(tl.int64)  # sample * splits + split: the partial row written
    sample = part // splits
    g = tl.load(G + sample * N + cols, mask=col_mask, other=0.0).to(ACC)
    if NEED_DGATE and HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)
    row_start = sample * R + (part % splits) * rows_per_program  # int64: rows * stride may pass 2^31
    row_end = tl.minimum(row_start + rows_per_program, sample * R + R)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        dz = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(ACC)
        if HAS_DROPOUT:
            dz = tl.where(dropout_keep_quads(tl.load(SEED), rows[:, None], cols[None, :], p), dz * scale, 0.0)
        dx = dz * g[None, :]
        if NEED_DX:
            tl.store(DX + rows[:, None] * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if NEED_DBIAS:
            acc_b += dx
        if NEED_DGATE:
            z = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(ACC)
            if HAS_BIAS:
                z += b[None, :]
            acc_g += dz * z  # dz is 0 on masked-off elements: the bias added there counts nothing
    if NEED_DBIAS:
        tl.store(DB_PARTIAL + part * N + cols, tl.sum(acc_b, axis=0), mask=col_mask)
    if NEED_DGATE:
        tl.store(DG_PARTIAL + part * N + cols, tl.sum(acc_g, axis=0), mask=col_mask)


@triton.jit
def _gated_rows_dropout_add_bwd_kernel(
    DY,  # in (M, N)
    X,  # in (M, N); unused unless NEED_DGATE
    B,  # in (N,) bias; unused unless NEED_DGATE and HAS_BIAS
    G,  # in (gate_rows, N) gate, row r of x reading row r % gate_rows, row stride stride_gm
    SEED,  # in (1,) int64 Philox seed; unused unless HAS_DROPOUT
    DG,  # out (M, N) dgate, one per element; unused unless NEED_DGATE
    DX,  # out (M, N); unused unless NEED_DX
    DB_PARTIAL,  # out (groups, N) fp32: this program's rows' share of dbias; unused unless NEED_DBIAS
    M, N, stride_dym, stride_xm, stride_gm, stride_dgm, stride_dxm, gate_rows, p, scale, rows_per_program,
    col_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_DBIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, NEED_DX: tl.constexpr, NEED_DGATE: tl.constexpr, ACC: tl.constexpr,
    PREFETCH: tl.constexpr = False,  # a knob of the tuned space (rowwise_bwd); this loop does not prefetch
):
    # The per-token gate: dgate = dz * (x + bias) per element, no sum over rows; only dbias sums
    # (fixed-order partial rows, as _dropout_add_bwd_kernel's). Without dbias every program takes
    # one row tile.
    pid = tl.program_id(0)
    group = pid // col_tiles
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if NEED_DGATE and HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)
    row_start = group.to(tl.int64) * rows_per_program  # int64: rows * stride may pass 2^31
    row_end = tl.minimum(row_start + rows_per_program, M)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        dz = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(ACC)
        if HAS_DROPOUT:
            dz = tl.where(dropout_keep_quads(tl.load(SEED), rows[:, None], cols[None, :], p), dz * scale, 0.0)
        if NEED_DX or NEED_DBIAS:
            g_rows = rows % gate_rows
            dx = dz * tl.load(G + g_rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0).to(ACC)
            if NEED_DX:
                tl.store(DX + rows[:, None] * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if NEED_DBIAS:
                acc_b += dx  # 0 past the rows: dy loads as 0 there
        if NEED_DGATE:
            z = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(ACC)
            if HAS_BIAS:
                z += b[None, :]
            tl.store(DG + rows[:, None] * stride_dgm + cols[None, :], (dz * z).to(DG.dtype.element_ty), mask=mask)
    if NEED_DBIAS:
        tl.store(DB_PARTIAL + group.to(tl.int64) * N + cols, tl.sum(acc_b, axis=0), mask=col_mask)


# =============================================================================================
# Launchers: check nothing, allocate the outputs, launch. Tensors in, tensors out.
# =============================================================================================


def _width(x: torch.Tensor) -> int:
    return x.shape[-1] if x.dim() else 1


def _dropout_scale(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# Thin launch path: Triton's own costs ~60 µs of host time per launch (_launch.py).
_dropout_add_fwd = CachedKernel(_dropout_add_fwd_kernel)
_dropout_add_bwd = CachedKernel(_dropout_add_bwd_kernel)
_gated_dropout_add_bwd = CachedKernel(_gated_dropout_add_bwd_kernel)
_gated_rows_dropout_add_bwd = CachedKernel(_gated_rows_dropout_add_bwd_kernel)


# Launch configurations: tuned per (device, dtype, width, rows bucket, variant) by trifuse's
# tuner over autotune/configs.py's row-wise spaces (kernels/_tiles.py). The dtype is y's (dy's
# in the backward); "x" ("dx") is x's (dx's), which may be narrower.
_FWD_TUNING = RowwiseTuning("dropout_add_fwd", ("x", "bias", "dropout", "gate", "token_gate"), summing=False)
_BWD_TUNING = RowwiseTuning("dropout_add_bwd", ("dx", "bias"), summing=True)
_GATED_BWD_TUNING = RowwiseTuning("gated_dropout_add_bwd", ("dx", "dbias", "dropout", "dgate", "bias"),
                                  summing=True)
_GATED_ROWS_BWD_TUNING = RowwiseTuning("gated_rows_dropout_add_bwd", ("dx", "dbias", "dropout", "dgate", "bias"),
                                       summing=True)


def dropout_add_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    bias: torch.Tensor | None,
    p: float,
    seed: torch.Tensor | None,
    gate: torch.Tensor | None = None,
    per_token: bool = False,
) -> torch.Tensor:
    """y = residual + gate * dropout(x + bias), contiguous, shaped like x, in the promoted dtype
    of x and residual. `seed` (an int64 (1,) tensor) is read only when p > 0. `gate`: None, or
    (G, N) contiguous in fp32 (fp64 for fp64), G dividing x's rows: row r reads gate row
    r // (rows / G); or with `per_token`, any tensor broadcasting against x, in any float dtype no
    wider than the sum's (a full-size one, a chunk of a wider projection, read in place)."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    if x.numel() and not use_triton(x):
        return _dropout_add_torch(x, residual, bias, p, seed, dtype, gate, per_token)
    n = _width(x)
    y = empty_like(x, dtype)
    if y.numel() == 0:
        return y
    # Row bases and strides, not (rows, n) views: a view op costs host time on every call.
    (x2, stride_x), (r2, stride_r) = as_rows(x, n), as_rows(residual, n)
    bias = None if bias is None else bias.contiguous()  # the kernel indexes it as a vector
    m = x.numel() // n
    if gate is None:
        gate2, stride_g, rows_per_gate, gate_rows = x2, n, 1, 1
    elif per_token:
        (gate2, stride_g, gate_rows), rows_per_gate = _token_gate_rows(gate, x, n), 1
    else:
        gate2, stride_g, rows_per_gate, gate_rows = gate, n, m // gate.shape[0], gate.shape[0]
    args = (x2, r2, bias if bias is not None else x2, gate2, seed if p > 0.0 else x2, y, m, n, stride_x,
            stride_r, n, stride_g, p, _dropout_scale(p), rows_per_gate, gate_rows)
    constexprs = dict(HAS_BIAS=bias is not None, HAS_DROPOUT=p > 0.0, ACC=acc_dtype(y.dtype),
                      HAS_GATE=gate is not None)
    device = x.get_device() if x.is_cuda else -1
    variant = (x.dtype, bias is not None, p > 0.0, gate is not None, gate.dtype if per_token else None)
    launch = _FWD_TUNING.launch(device, dtype, m, n, 0, False, variant, constexprs,
                                time_one_tile, _dropout_add_fwd, m, n, constexprs, args)
    run_one_tile(_dropout_add_fwd, launch, args)
    return y


def _run_gated_bwd(launch, samples: int, head: tuple, tail: tuple, n: int, acc: torch.dtype,
                   need_dgate: bool, need_dbias: bool, device: torch.device):
    """Launches the gated backward with `launch` (planned over one sample's rows) for every
    sample; returns its (dgate, dbias) partial rows, (samples x splits, n) in `acc`, or None."""
    plan = launch.plan
    rows = samples * plan.groups
    dg = torch.empty((rows, n), dtype=acc, device=device) if need_dgate else None
    db = torch.empty((rows, n), dtype=acc, device=device) if need_dbias else None
    unused = head[0]
    _gated_dropout_add_bwd.run((samples * plan.programs,),
                               (*head, unused if dg is None else dg, unused if db is None else db, *tail,
                                plan.rows_per_group, plan.groups, plan.col_tiles), launch.meta)
    return dg, db


def _time_gated_bwd(cfg, r: int, n: int, sms: int, constexprs: dict, samples: int, head: tuple, tail: tuple,
                    acc: torch.dtype, need_dgate: bool, need_dbias: bool, device: torch.device) -> None:
    """One launch with `cfg` (what the tuner times)."""
    launch = rowwise_launch(cfg, r, n, sms, True, constexprs)
    _run_gated_bwd(launch, samples, head, tail, n, acc, need_dgate, need_dbias, device)


def gated_dropout_add_bwd(
    dy: torch.Tensor, x: torch.Tensor | None, bias: torch.Tensor | None, gate: torch.Tensor, seed: torch.Tensor,
    p: float, needs: tuple[bool, bool, bool], dx_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx in dx_dtype, dbias (N,), dgate (G, N)) of the gated forward, as `needs` (dx, dbias,
    dgate) asks, None where not; the sums in fp32 (fp64 for fp64), each per-sample one over that
    sample's rows in a fixed order. `seed` is read only when p > 0, x only for dgate."""
    if dy.numel() and not use_triton(dy):
        return _gated_dropout_add_bwd_torch(dy, x, bias, gate, seed, p, needs, dx_dtype)
    n, samples = _width(dy), gate.shape[0]
    acc = _acc(dy.dtype)
    need_dx, need_dbias, need_dgate = needs[0], needs[1] and bias is not None, needs[2]
    read_bias = need_dgate and bias is not None  # dgate's z = x + bias, the bias frozen or not
    dx = empty_like(dy, dx_dtype) if need_dx else None
    if dy.numel() == 0:  # no rows (or no samples): sums of nothing
        return (dx, torch.zeros(n, dtype=acc, device=dy.device) if need_dbias else None,
                torch.zeros((samples, n), dtype=acc, device=dy.device) if need_dgate else None)
    (dy2, stride_dy), (x2, stride_x) = as_rows(dy, n), as_rows(x, n) if need_dgate else (dy, n)
    m = dy.numel() // n
    r = m // samples
    head = (dy2, x2, bias.contiguous() if read_bias else dy2, gate,
            seed if p > 0.0 else dy2, dy2 if dx is None else dx)
    tail = (r, n, stride_dy, stride_x, n, p, _dropout_scale(p))
    constexprs = dict(HAS_BIAS=read_bias, HAS_DROPOUT=p > 0.0, NEED_DX=need_dx, NEED_DGATE=need_dgate,
                      ACC=acc_dtype(dy.dtype), NEED_DBIAS=need_dbias)
    # planned as one sample's rows on its share of the SMs: samples x splits programs fill them once
    sms = max(cdiv(device_sms(dy), samples), 1)
    device = dy.get_device() if dy.is_cuda else -1
    variant = (dx_dtype if need_dx else None, need_dbias, p > 0.0, need_dgate, read_bias)
    launch = _GATED_BWD_TUNING.launch(device, dy.dtype, r, n, sms, True, variant, constexprs, _time_gated_bwd,
                                      r, n, sms, constexprs, samples, head, tail, acc, need_dgate, need_dbias,
                                      dy.device)
    dg, db = _run_gated_bwd(launch, samples, head, tail, n, acc, need_dgate, need_dbias, dy.device)
    return (dx, None if db is None else db.sum(dim=0),
            None if dg is None else dg.view(samples, -1, n).sum(dim=1))


def gated_rows_dropout_add_bwd(
    dy: torch.Tensor, x: torch.Tensor | None, bias: torch.Tensor | None, gate: torch.Tensor, seed: torch.Tensor,
    p: float, needs: tuple[bool, bool, bool], dx_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx in dx_dtype, dbias (N,) in fp32 (fp64 for fp64), dgate in gate's shape and dtype) of the
    per-token gated forward, as `needs` (dx, dbias, dgate) asks, None where not. dgate is written
    per element (in gate's dtype where the gate is full-size, else in fp32 and summed down over what
    it broadcasts); dbias from fixed-order partial rows. `seed` is read only when p > 0, x only for
    dgate."""
    if dy.numel() and not use_triton(dy):
        return _gated_rows_dropout_add_bwd_torch(dy, x, bias, gate, seed, p, needs, dx_dtype)
    n = _width(dy)
    acc = _acc(dy.dtype)
    need_dx, need_dbias, need_dgate = needs[0], needs[1] and bias is not None, needs[2]
    read_bias = need_dgate and bias is not None  # dgate's z = x + bias, the bias frozen or not
    full_gate = gate.shape == dy.shape
    dx = empty_like(dy, dx_dtype) if need_dx else None
    dgate = empty_like(dy, gate.dtype if full_gate else acc) if need_dgate else None
    if dy.numel() == 0 or not (need_dx or need_dbias or need_dgate):
        return (dx, torch.zeros(n, dtype=acc, device=dy.device) if need_dbias else None,
                None if dgate is None else _sum_gate_down(dgate, gate))
    m = dy.numel() // n
    (dy2, stride_dy) = as_rows(dy, n)
    x2, stride_x = as_rows(x, n) if need_dgate else (dy2, n)
    gate2, stride_g, gate_rows = _token_gate_rows(gate, dy, n) if need_dx or need_dbias else (dy2, n, 1)
    head = (dy2, x2, bias.contiguous() if read_bias else dy2, gate2, seed if p > 0.0 else dy2,
            dy2 if dgate is None else dgate, dy2 if dx is None else dx)
    tail = (m, n, stride_dy, stride_x, stride_g, n, n, gate_rows, p, _dropout_scale(p))
    constexprs = dict(HAS_BIAS=read_bias, NEED_DBIAS=need_dbias, HAS_DROPOUT=p > 0.0, NEED_DX=need_dx,
                      NEED_DGATE=need_dgate, ACC=acc_dtype(dy.dtype))
    sms = device_sms(dy)
    device = dy.get_device() if dy.is_cuda else -1
    variant = (dx_dtype if need_dx else None, need_dbias, p > 0.0, dgate.dtype if need_dgate else None, read_bias)
    launch = _GATED_ROWS_BWD_TUNING.launch(device, dy.dtype, m, n, sms, need_dbias, variant, constexprs,
                                           time_summing, _gated_rows_dropout_add_bwd, m, n, sms, constexprs, head,
                                           tail, acc, need_dbias, dy.device)
    partial = run_summing(_gated_rows_dropout_add_bwd, launch, head, tail, n, acc, need_dbias, dy.device)
    return (dx, None if partial is None else partial.sum(dim=0),
            None if dgate is None else _sum_gate_down(dgate, gate))


def _token_gate_rows(gate: torch.Tensor, x: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int]:
    """(base, row stride, rows) of a per-token gate as rows that x's rows read in turn, row r the
    gate's row r % rows: in place where the gate is x's trailing dims (full-size, or (S, N) repeated
    over the batch; a chunk of a wider projection at its own row stride); copied to x's full size
    where it broadcasts otherwise ((B, S, 1))."""
    shape = (1,) * (x.dim() - gate.dim()) + tuple(gate.shape)
    k = 0
    while k < x.dim() - 1 and shape[k] == 1:
        k += 1
    if tuple(shape[k:]) == tuple(x.shape[k:]):
        base, stride = as_rows(gate, n)
        return base, stride, max(gate.numel() // n, 1)
    base, stride = _rows_of(gate, x, n)
    return base, stride, max(x.numel() // n, 1)


def _sum_gate_down(dgate: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """dgate, full-size, in gate's shape and dtype: summed over what the gate broadcasts."""
    if dgate.shape != gate.shape:
        dgate = dgate.sum_to_size(gate.shape)
    return cast(dgate, gate.dtype)


def dropout_add_bwd(
    dy: torch.Tensor, seed: torch.Tensor, p: float, has_bias: bool, dx_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias) for p > 0: dx contiguous like dy in dx_dtype (dy's by default: x's, where x is
    bf16 beside an fp32 residual, saves a cast's pass); dbias (N,) fp32 (fp64 for fp64), empty
    unless has_bias. (For p = 0, dx is dy and dbias its column sum: no kernel.)"""
    if dy.numel() and not use_triton(dy):
        dx, dbias = _dropout_add_bwd_torch(dy, seed, p, has_bias)
        return (dx if dx_dtype is None else dx.to(dx_dtype)), dbias
    n = _width(dy)
    acc = _acc(dy.dtype)
    dx = empty_like(dy, dx_dtype)
    if dy.numel() == 0:
        return dx, torch.zeros(n if has_bias else 0, dtype=acc, device=dy.device)
    dy2, stride_dy = as_rows(dy, n)
    m = dy.numel() // n
    head = (dy2, seed, dx)
    tail = (m, n, stride_dy, n, p, _dropout_scale(p))
    constexprs = dict(HAS_BIAS=has_bias, ACC=acc_dtype(dy.dtype))
    sms = device_sms(dy)
    device = dy.get_device() if dy.is_cuda else -1
    launch = _BWD_TUNING.launch(device, dy.dtype, m, n, sms, has_bias, (dx.dtype, has_bias), constexprs,
                                time_summing, _dropout_add_bwd, m, n, sms, constexprs, head, tail, acc,
                                has_bias, dy.device)
    partial = run_summing(_dropout_add_bwd, launch, head, tail, n, acc, has_bias, dy.device)
    return dx, partial.sum(dim=0) if has_bias else dx.new_empty(0, dtype=acc)


def _column_sum(dy: torch.Tensor) -> torch.Tensor:
    """dbias for p = 0: the sum of dy over rows in fp32 (fp64 for fp64), a fixed-order
    PyTorch reduction. Over the leading dims rather than over a reshape to (rows, N): under
    sequence parallelism dy is a DTensor sharded on dim 1, which torch 2.11 refuses to flatten
    into rows (2.13 allows it)."""
    if dy.dim() < 2:
        return dy.to(_acc(dy.dtype)).reshape(_width(dy))
    return torch.sum(dy, dim=tuple(range(dy.dim() - 1)), dtype=_acc(dy.dtype))


# ---------------------------------------------------------------------------------------------
# PyTorch path for CPU tensors without the interpreter: same maths, its own random stream.
# ---------------------------------------------------------------------------------------------


def _torch_keep_mask(seed: torch.Tensor, shape: torch.Size, p: float) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(int(seed.item()))
    return torch.rand(shape, generator=gen, device=gen.device) >= p


def _dropped(t: torch.Tensor, p: float, seed: torch.Tensor | None) -> torch.Tensor:
    """t through the mask `seed` draws on this path (bias_gelu's and gated_activation's PyTorch
    paths take their dropout from here too)."""
    if p == 0.0:
        return t
    return torch.where(_torch_keep_mask(seed, t.shape, p).to(t.device), t * _dropout_scale(p), 0.0)


def _dropout_add_torch(x, residual, bias, p, seed, dtype, gate=None, per_token=False):
    acc = _acc(dtype)
    z = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    if p > 0.0:
        z = torch.where(_torch_keep_mask(seed, z.shape, p).to(z.device), z * _dropout_scale(p), 0.0)
    if gate is not None and per_token:
        z = z * gate.to(acc)
    elif gate is not None:
        n = _width(x)
        z = (z.reshape(gate.shape[0], -1, n) * gate.to(acc)[:, None]).reshape(z.shape)
    return (residual.to(acc) + z).to(dtype).contiguous()


def _gated_dropout_add_bwd_torch(dy, x, bias, gate, seed, p, needs, dx_dtype):
    n, samples = _width(dy), gate.shape[0]
    acc = _acc(dy.dtype)
    dz = dy.to(acc)
    if p > 0.0:
        dz = torch.where(_torch_keep_mask(seed, dy.shape, p).to(dy.device), dz * _dropout_scale(p), 0.0)
    dz = dz.reshape(samples, -1, n)
    dx = dz * gate.to(acc)[:, None]
    dgate = None
    if needs[2]:
        z = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
        dgate = (dz * z.reshape(samples, -1, n)).sum(dim=1)
    dbias = dx.sum(dim=(0, 1)) if needs[1] and bias is not None else None
    return (dx.reshape(dy.shape).to(dx_dtype) if needs[0] else None), dbias, dgate


def _gated_rows_dropout_add_bwd_torch(dy, x, bias, gate, seed, p, needs, dx_dtype):
    acc = _acc(dy.dtype)
    dz = dy.to(acc)
    if p > 0.0:
        dz = torch.where(_torch_keep_mask(seed, dy.shape, p).to(dy.device), dz * _dropout_scale(p), 0.0)
    dx = dz * gate.to(acc)
    dgate = None
    if needs[2]:
        z = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
        dgate = _sum_gate_down(dz * z, gate)
    dbias = dx.reshape(-1, _width(dy)).sum(dim=0) if needs[1] and bias is not None else None
    return (dx.to(dx_dtype) if needs[0] else None), dbias, dgate


def _dropout_add_bwd_torch(dy, seed, p, has_bias):
    g = dy.to(_acc(dy.dtype))
    dx = torch.where(_torch_keep_mask(seed, dy.shape, p).to(dy.device), g * _dropout_scale(p), 0.0)
    dbias = dx.reshape(-1, _width(dy)).sum(dim=0) if has_bias else dx.new_empty(0)
    return dx.to(dy.dtype).contiguous(), dbias


# =============================================================================================
# Checks, shared by the registered ops (real and fake) and the eager path
# =============================================================================================


def _check_inputs(x: object, residual: object, p: object, bias: object) -> None:
    op = "dropout_add"
    check_tensor(op, "input", x)
    check_float(op, "input", x)
    check_tensor(op, "residual", residual)
    check_float(op, "residual", residual)
    check_shape(op, "residual", residual, x.shape)
    if bias is not None:
        check_tensor(op, "bias", bias)
        check_float(op, "bias", bias)
        check_shape(op, "bias", bias, (_width(x),))
    check_same_device(op, "input", x, residual=residual, bias=bias)
    check_probability(op, "p", p)


def _check_gate(x: torch.Tensor, residual: torch.Tensor, gate: object) -> bool:
    """The gate broadcasting against x (each dim x's or 1, the last N or 1), no wider than the fp32
    (fp64) the product and the sum are computed in. Returns whether it is per token (varies along
    a sample's rows), not one vector per sample as adaLN's modulation."""
    op = "dropout_add"
    check_tensor(op, "gate", gate)
    check_float(op, "gate", gate)
    if x.dim() == 0:
        raise ValueError(f"trifuse.{op}: a gate needs an input with a last dim of features; got a 0-dim input")
    per_token = _check_per_token(op, "gate", gate, x, _width(x))
    acc = _acc(torch.promote_types(x.dtype, residual.dtype))
    if torch.promote_types(acc, gate.dtype) != acc:
        raise ValueError(f"trifuse.{op}: gate ({gate.dtype}) must be no wider than {acc}, the dtype the product "
                         "and the sum are computed in")
    check_same_device(op, "input", x, gate=gate)
    return per_token


def _gate_rows(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The (checked) gate as (G, N) rows in fp32 (fp64 for fp64), contiguous, G the samples it
    follows: differentiable PyTorch ops on the small vector (a view where it already is one)."""
    n, k = _width(x), _sample_dims(gate, x)
    return _as_groups(gate, x, n, k, _acc(torch.promote_types(x.dtype, gate.dtype))).contiguous()


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see. The forward returns the seed
# it drew (zeros when p = 0: nothing drawn) for its backward.
# =============================================================================================

Tensor = torch.Tensor
OptTensor = torch.Tensor | None


@torch.library.custom_op("trifuse::dropout_add", mutates_args=())
def _dropout_add_op(x: Tensor, residual: Tensor, p: float, bias: OptTensor) -> tuple[Tensor, Tensor]:
    _check_inputs(x, residual, p, bias)
    seed = philox_seed(x.device) if p > 0.0 else torch.zeros(1, dtype=torch.int64, device=x.device)
    return dropout_add_fwd(x, residual, bias, p, seed), seed


@torch.library.custom_op("trifuse::dropout_add_backward", mutates_args=())
def _dropout_add_backward_op(dy: Tensor, seed: Tensor, p: float, has_bias: bool) -> tuple[Tensor, Tensor]:
    """(dx, dbias) for p > 0; dbias is (N,) fp32 (fp64 for fp64), empty unless has_bias."""
    return dropout_add_bwd(dy, seed, p, has_bias)


@_dropout_add_op.register_fake
def _(x, residual, p, bias):
    _check_inputs(x, residual, p, bias)
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    return y, x.new_empty(1, dtype=torch.int64)


@_dropout_add_backward_op.register_fake
def _(dy, seed, p, has_bias):
    return dy.new_empty(dy.shape), dy.new_empty(_width(dy) if has_bias else 0, dtype=_acc(dy.dtype))


def _input_grads(ctx, dx: torch.Tensor, dbias: torch.Tensor | None, dy: torch.Tensor):
    """(dx, dresidual, dbias) in their inputs' dtypes; dresidual is dy itself."""
    dbias = None if dbias is None else cast(dbias, ctx.bias_dtype)
    return cast(dx, ctx.x_dtype), cast(dy, ctx.residual_dtype), dbias


def _save_dtypes(ctx, x, residual, bias) -> None:
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _setup(ctx, inputs, output):
    x, residual, p, bias = inputs
    ctx.save_for_backward(output[1])
    ctx.p = p
    _save_dtypes(ctx, x, residual, bias)


def _registered_twice(ctx, dy, _):
    """_dropout_add_twice for the registered op, whose inputs are (x, residual, p, bias)."""
    needs = ctx.needs_input_grad
    view = ctx_as(ctx, (needs[0], needs[1], needs[3]), p=ctx.p, x_dtype=ctx.x_dtype,
                  residual_dtype=ctx.residual_dtype, bias_dtype=ctx.bias_dtype)
    dx, dres, dbias, _ = _dropout_add_twice(view, dy)
    return dx, dres, None, dbias


@single_backward(twice=_registered_twice, op="dropout_add")
def _backward(ctx, dy, _):
    (seed,) = ctx.saved_tensors
    has_bias = ctx.bias_dtype is not None
    if ctx.p == 0.0:
        dx, dbias = dy, _column_sum(dy) if has_bias else None
    else:
        dx, dbias = torch.ops.trifuse.dropout_add_backward(dy, seed, ctx.p, has_bias)
    dx, dres, dbias = _input_grads(ctx, dx, dbias if has_bias else None, dy)
    return dx, dres, None, dbias


torch.library.register_autograd("trifuse::dropout_add", _backward, setup_context=_setup)


# =============================================================================================
# Eager fast path: a thin autograd.Function straight over the launchers (see DESIGN.md "Host
# overhead"). Same launchers, same bits as the registered op.
# =============================================================================================


class _DropoutMask(torch.autograd.Function):
    """g -> keep * g / (1 - p), the forward's mask regenerated from its seed: a diagonal map,
    its own transpose, so its backward is itself and it is differentiable any number of times."""

    @staticmethod
    def forward(ctx, g, seed, p, dtype):
        ctx.seed, ctx.p = seed, p
        return dropout_add_bwd(g, seed, p, False, dtype)[0]

    @staticmethod
    def backward(ctx, gg):
        return _DropoutMask.apply(gg, ctx.seed, ctx.p, gg.dtype), None, None, None


def _dropout_add_twice(ctx, dy):
    """The backward, differentiable again (create_graph=True): the mask as _DropoutMask, the
    sums in PyTorch ops."""
    (seed,) = ctx.saved_tensors
    need_dbias = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    dx = dy if ctx.p == 0.0 else _DropoutMask.apply(dy, seed, ctx.p, ctx.x_dtype)
    dbias = _column_sum(dx) if need_dbias else None
    return (*_input_grads(ctx, dx, dbias, dy), None)


class _DropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, bias, p):
        seed = philox_seed(x.device) if p > 0.0 else None
        ctx.save_for_backward(seed)
        ctx.p = p
        _save_dtypes(ctx, x, residual, bias)
        return dropout_add_fwd(x, residual, bias, p, seed)

    @staticmethod
    @single_backward(twice=_dropout_add_twice)
    def backward(ctx, dy):
        (seed,) = ctx.saved_tensors
        need_dbias = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        if ctx.p == 0.0:
            dx, dbias = dy, _column_sum(dy) if need_dbias else None
        else:
            with profiled("trifuse::dropout_add_backward"):
                dx, dbias = dropout_add_bwd(dy, seed, ctx.p, need_dbias, ctx.x_dtype)
        dx, dres, dbias = _input_grads(ctx, dx, dbias if need_dbias else None, dy)
        return dx, dres, dbias, None


# ---------------------------------------------------------------------------------------------
# The gated form: y = residual + gate * dropout(x + bias), gate as (G, N) rows (`_gate_rows`)
# ---------------------------------------------------------------------------------------------


def _check_gate_rows(x: torch.Tensor, gate: torch.Tensor) -> None:
    """What the gated ops take (made by `_gate_rows`): (G, N) rows, G dividing x's rows."""
    n = _width(x)
    rows = x.numel() // n if n else 0
    if gate.dim() != 2 or gate.shape[1] != n or (rows and (gate.shape[0] < 1 or rows % gate.shape[0])):
        raise ValueError(f"trifuse.dropout_add: gate rows must be (G, {n}) with G dividing the input's {rows} "
                         f"rows; got {list(gate.shape)}")


@torch.library.custom_op("trifuse::gated_dropout_add", mutates_args=())
def _gated_dropout_add_op(x: Tensor, residual: Tensor, gate: Tensor, p: float,
                          bias: OptTensor) -> tuple[Tensor, Tensor]:
    _check_inputs(x, residual, p, bias)
    _check_gate_rows(x, gate)
    seed = philox_seed(x.device) if p > 0.0 else torch.zeros(1, dtype=torch.int64, device=x.device)
    return dropout_add_fwd(x, residual, bias, p, seed, gate), seed


@torch.library.custom_op("trifuse::gated_dropout_add_backward", mutates_args=())
def _gated_dropout_add_backward_op(dy: Tensor, x: OptTensor, bias: OptTensor, gate: Tensor, seed: Tensor, p: float,
                                   need_dx: bool, need_dbias: bool, need_dgate: bool,
                                   dx_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dbias, dgate); each one not asked for (or dbias without a bias) is empty."""
    dx, dbias, dgate = gated_dropout_add_bwd(dy, x, bias, gate, seed, p, (need_dx, need_dbias, need_dgate),
                                             dx_dtype)
    acc = _acc(dy.dtype)
    return (dy.new_empty(0, dtype=dx_dtype) if dx is None else dx,
            dy.new_empty(0, dtype=acc) if dbias is None else dbias,
            dy.new_empty(0, dtype=acc) if dgate is None else dgate)


@_gated_dropout_add_op.register_fake
def _(x, residual, gate, p, bias):
    _check_inputs(x, residual, p, bias)
    _check_gate_rows(x, gate)
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    return y, x.new_empty(1, dtype=torch.int64)


@_gated_dropout_add_backward_op.register_fake
def _(dy, x, bias, gate, seed, p, need_dx, need_dbias, need_dgate, dx_dtype):
    acc = _acc(dy.dtype)
    return (dy.new_empty(dy.shape if need_dx else (0,), dtype=dx_dtype),
            dy.new_empty((_width(dy),) if need_dbias and bias is not None else (0,), dtype=acc),
            dy.new_empty(tuple(gate.shape) if need_dgate else (0,), dtype=acc))


def _gated_grads(ctx, dx, dbias, dgate, dy):
    """(dx, dresidual, dgate rows, dbias) in their inputs' dtypes; dresidual is dy itself."""
    return (None if dx is None else cast(dx, ctx.x_dtype), cast(dy, ctx.residual_dtype), dgate,
            None if dbias is None else cast(dbias, ctx.bias_dtype))


def _gated_twice(ctx, dy):
    """The gated backward in PyTorch ops, differentiable again (create_graph=True); the mask as
    _DropoutMask. Returns (dx, dresidual, dgate rows, dbias)."""
    x, bias, gate, seed = ctx.saved_tensors
    needs = ctx.needs_input_grad  # (x, residual, gate, bias)
    samples, n = gate.shape
    dz = dy.to(gate.dtype) if ctx.p == 0.0 else _DropoutMask.apply(dy, seed, ctx.p, gate.dtype)
    dz = dz.reshape(samples, -1, n)
    dx = dz * gate[:, None]
    dgate = None
    if needs[2]:
        z = x.to(gate.dtype) if bias is None else x.to(gate.dtype) + bias.to(gate.dtype)
        dgate = (dz * z.reshape(samples, -1, n)).sum(dim=1)
    dbias = dx.sum(dim=(0, 1)) if bias is not None and needs[3] else None
    return _gated_grads(ctx, dx.reshape(dy.shape) if needs[0] else None, dbias, dgate, dy)


def _gated_save(ctx, x, residual, gate, bias, seed, p) -> None:
    """x is kept only for dgate (as PyTorch's product keeps it): without a gate that wants a
    gradient the backward reads dy alone."""
    ctx.save_for_backward(x if ctx.needs_input_grad[2] else None, bias, gate, seed)
    ctx.p = p
    _save_dtypes(ctx, x, residual, bias)


def _gated_kernel_grads(ctx, dy, needs, launcher=None):
    """The backward kernels' (dx, dresidual, dgate, dbias), needs as (x, residual, gate, bias);
    `launcher` the per-sample backward's (by default) or the per-token one's."""
    x, bias, gate, seed = ctx.saved_tensors
    launcher = launcher or gated_dropout_add_bwd
    dx, dbias, dgate = launcher(dy, x, bias, gate, seed, ctx.p, (needs[0], needs[3] and bias is not None, needs[2]),
                                ctx.x_dtype)
    return _gated_grads(ctx, dx, dbias, dgate, dy)


def _gated_setup(ctx, inputs, output):
    x, residual, gate, p, bias = inputs
    _gated_save(ctx, x, residual, gate, bias, output[1], p)


def _registered_twice(twice):
    """`twice` (the eager Function's, inputs (x, residual, gate, bias)) for a registered gated op,
    whose inputs are (x, residual, gate, p, bias)."""
    def registered_twice(ctx, dy, _):
        needs = ctx.needs_input_grad
        view = ctx_as(ctx, (needs[0], needs[1], needs[2], needs[4]), p=ctx.p, x_dtype=ctx.x_dtype,
                      residual_dtype=ctx.residual_dtype, bias_dtype=ctx.bias_dtype)
        dx, dres, dgate, dbias = twice(view, dy)
        return dx, dres, dgate, None, dbias

    return registered_twice


_gated_registered_twice = _registered_twice(_gated_twice)


@single_backward(twice=_gated_registered_twice, op="dropout_add")
def _gated_backward(ctx, dy, _):
    x, bias, gate, seed = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dx, dbias, dgate = torch.ops.trifuse.gated_dropout_add_backward(
        dy, x, bias, gate, seed, ctx.p, needs[0], needs[4] and bias is not None, needs[2], ctx.x_dtype)
    dx, dres, dgate, dbias = _gated_grads(ctx, dx if needs[0] else None, dbias if needs[4] and bias is not None
                                          else None, dgate if needs[2] else None, dy)
    return dx, dres, dgate, None, dbias


torch.library.register_autograd("trifuse::gated_dropout_add", _gated_backward, setup_context=_gated_setup)


class _GatedDropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, gate, bias, p):
        seed = philox_seed(x.device) if p > 0.0 else None
        _gated_save(ctx, x, residual, gate, bias, seed, p)
        return dropout_add_fwd(x, residual, bias, p, seed, gate)

    @staticmethod
    @single_backward(twice=lambda ctx, dy: (*_gated_twice(ctx, dy), None))
    def backward(ctx, dy):
        with profiled("trifuse::gated_dropout_add_backward"):
            return (*_gated_kernel_grads(ctx, dy, ctx.needs_input_grad), None)


# ---------------------------------------------------------------------------------------------
# The per-token gate: y = residual + gate * dropout(x + bias), gate varying along a sample's rows
# (FLUX.3's and Qwen-Image 2.1's `h + gate * out` with gate (B, S, N), a chunk of a per-token
# projection), read a row at a time in place; dgate written per element.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("trifuse::gated_dropout_add_rows", mutates_args=())
def _gated_rows_dropout_add_op(x: Tensor, residual: Tensor, gate: Tensor, p: float,
                               bias: OptTensor) -> tuple[Tensor, Tensor]:
    _check_inputs(x, residual, p, bias)
    _check_gate(x, residual, gate)
    seed = philox_seed(x.device) if p > 0.0 else torch.zeros(1, dtype=torch.int64, device=x.device)
    return dropout_add_fwd(x, residual, bias, p, seed, gate, per_token=True), seed


@torch.library.custom_op("trifuse::gated_dropout_add_rows_backward", mutates_args=())
def _gated_rows_dropout_add_backward_op(dy: Tensor, x: OptTensor, bias: OptTensor, gate: Tensor, seed: Tensor,
                                        p: float, need_dx: bool, need_dbias: bool, need_dgate: bool,
                                        dx_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dbias, dgate in gate's shape and dtype); each one not asked for (or dbias without a
    bias) is empty, an empty tensor of its own."""
    dx, dbias, dgate = gated_rows_dropout_add_bwd(dy, x, bias, gate, seed, p, (need_dx, need_dbias, need_dgate),
                                                  dx_dtype)
    acc = _acc(dy.dtype)
    return (dy.new_empty(0, dtype=dx_dtype) if dx is None else dx,
            dy.new_empty(0, dtype=acc) if dbias is None else dbias,
            dy.new_empty(0, dtype=gate.dtype) if dgate is None else dgate)


@_gated_rows_dropout_add_op.register_fake
def _(x, residual, gate, p, bias):
    _check_inputs(x, residual, p, bias)
    _check_gate(x, residual, gate)
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    return y, x.new_empty(1, dtype=torch.int64)


@_gated_rows_dropout_add_backward_op.register_fake
def _(dy, x, bias, gate, seed, p, need_dx, need_dbias, need_dgate, dx_dtype):
    return (dy.new_empty(dy.shape if need_dx else (0,), dtype=dx_dtype),
            dy.new_empty((_width(dy),) if need_dbias and bias is not None else (0,), dtype=_acc(dy.dtype)),
            dy.new_empty(tuple(gate.shape) if need_dgate else (0,), dtype=gate.dtype))


def _gated_rows_twice(ctx, dy):
    """The per-token gated backward in PyTorch ops, differentiable again (create_graph=True); the
    mask as _DropoutMask. Returns (dx, dresidual, dgate, dbias) in their inputs' dtypes."""
    x, bias, gate, seed = ctx.saved_tensors
    needs = ctx.needs_input_grad  # (x, residual, gate, bias)
    acc = _acc(dy.dtype)
    dz = dy.to(acc) if ctx.p == 0.0 else _DropoutMask.apply(dy, seed, ctx.p, acc)
    dx = dz * gate.to(acc)
    dgate = None
    if needs[2]:
        z = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
        dgate = _sum_gate_down(dz * z, gate)
    dbias = _column_sum(dx) if bias is not None and needs[3] else None
    return _gated_grads(ctx, dx if needs[0] else None, dbias, dgate, dy)


@single_backward(twice=_registered_twice(_gated_rows_twice), op="dropout_add")
def _gated_rows_backward(ctx, dy, _):
    x, bias, gate, seed = ctx.saved_tensors
    needs = ctx.needs_input_grad
    need_dbias = needs[4] and bias is not None
    dx, dbias, dgate = torch.ops.trifuse.gated_dropout_add_rows_backward(
        dy, x, bias, gate, seed, ctx.p, needs[0], need_dbias, needs[2], ctx.x_dtype)
    dx, dres, dgate, dbias = _gated_grads(ctx, dx if needs[0] else None, dbias if need_dbias else None,
                                          dgate if needs[2] else None, dy)
    return dx, dres, dgate, None, dbias


torch.library.register_autograd("trifuse::gated_dropout_add_rows", _gated_rows_backward,
                                setup_context=_gated_setup)


class _GatedRowsDropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, gate, bias, p):
        seed = philox_seed(x.device) if p > 0.0 else None
        _gated_save(ctx, x, residual, gate, bias, seed, p)
        return dropout_add_fwd(x, residual, bias, p, seed, gate, per_token=True)

    @staticmethod
    @single_backward(twice=lambda ctx, dy: (*_gated_rows_twice(ctx, dy), None))
    def backward(ctx, dy):
        with profiled("trifuse::gated_dropout_add_rows_backward"):
            return (*_gated_kernel_grads(ctx, dy, ctx.needs_input_grad, gated_rows_dropout_add_bwd), None)


# =============================================================================================
# Dialect: trifuse's kernels or PyTorch's `residual + gate * (x + bias)`, whichever is faster for
# the shape, chosen once per key on the GPU and cached on disk (autotune/dialects.py). Without
# dropout it is an add or two, where a small call's host path decides; with dropout only
# trifuse's kernels take the call (PyTorch's dropout draws another mask and stores it for the
# backward: not the same op). Traced calls always see the registered ops.
# =============================================================================================


def _dropout_add_key(x, residual, p, bias, gate):
    """The dialect key of an eager call (after the public function's checks); None (trifuse's
    kernels decide, and raise on a bad gate) when traced, empty or 0-dim. It runs on every call."""
    if not eager_fast_path(x, residual, bias, gate) or x.dim() == 0:
        return None
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if rows == 0:
        return None
    grad = torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad
                                        or (bias is not None and bias.requires_grad)
                                        or (gate is not None and gate.requires_grad))
    # the gate by dtype and by how many rows it holds (one per sample, per token, per position)
    gate_dtype, gate_rows = (None, 0) if gate is None else (gate.dtype, pow2_bucket(gate.numel() // max(n, 1)))
    return (x.get_device() if x.is_cuda else -1, x.dtype, residual.dtype, pow2_bucket(rows), n,
            None if bias is None else bias.dtype, gate_dtype, gate_rows, p > 0.0, grad)


def _dropout_add_trifuse(x, residual, p, bias, gate):
    if gate is not None and _check_gate(x, residual, gate):  # per token: read in place, a row at a time
        if eager_fast_path(x, residual, gate, bias):
            with profiled("trifuse::gated_dropout_add_rows"):
                return apply_function(_GatedRowsDropoutAddFunction, x, residual, gate, bias, p)
        return torch.ops.trifuse.gated_dropout_add_rows(x, residual, gate, p, bias)[0]
    if gate is not None:
        rows = _gate_rows(gate, x)
        if eager_fast_path(x, residual, rows, bias):
            with profiled("trifuse::gated_dropout_add"):
                return apply_function(_GatedDropoutAddFunction, x, residual, rows, bias, p)
        return torch.ops.trifuse.gated_dropout_add(x, residual, rows, p, bias)[0]
    if eager_fast_path(x, residual, bias):
        with profiled("trifuse::dropout_add"):
            return apply_function(_DropoutAddFunction, x, residual, bias, p)
    return torch.ops.trifuse.dropout_add(x, residual, p, bias)[0]


def _dropout_add_torch_candidate(x, residual, p, bias, gate):
    """PyTorch's ops for a call without dropout (supports rejects the others), in the op's output
    dtype (x's promoted with residual's: a wider bias or gate is rounded away once at the end, as
    the kernel does) and contiguous as trifuse's output."""
    if gate is not None:
        _check_gate(x, residual, gate)  # trifuse's errors: `*` would broadcast a gate the op refuses
    with profiled("trifuse::dropout_add"):
        z = x if bias is None else x + bias
        y = residual + (z if gate is None else gate * z)
        return y.to(torch.promote_types(x.dtype, residual.dtype)).contiguous()


def _dropout_add_torch_supports(x, residual, p, bias, gate) -> str | None:
    if p > 0.0:
        return DROPOUT_NOT_EXCHANGED
    return None


def _dropout_add_dialect_ref(x, residual, p, bias, gate):
    """The dialect's reference, for the calls it measures (no dropout)."""
    return dropout_add_ref(x, residual, p, True, bias, gate=gate)


DROPOUT_ADD = dialects.define(
    "dropout_add", _dropout_add_key,
    ("device", "dtype", "residual", "rows", "n", "bias", "gate", "gate_rows", "dropout", "grad"),
    reference=_dropout_add_dialect_ref)
DROPOUT_ADD.register(dialects.Candidate("trifuse", _dropout_add_trifuse))
DROPOUT_ADD.register(dialects.Candidate("torch", _dropout_add_torch_candidate, supports=_dropout_add_torch_supports))


# =============================================================================================
# Public API
# =============================================================================================


@outside_device_modes
def dropout_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
    bias: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + dropout(x + bias, p) in one pass each way, like
    `residual + F.dropout(x + bias, p, training)`; with a gate, residual + gate * dropout(x +
    bias), as a diffusion transformer's block ends (`h + gate_mlp[:, None] * ff_out`).

    Args:
        x: (..., N), fp16 / bf16 / fp32 / fp64; any strides.
        residual: shaped like x; any float dtype.
        p: drop probability in [0, 1]; kept values are scaled by 1 / (1 - p).
        training: False (or p = 0) makes it a plain add, drawing no random numbers.
        bias: (N,) or None, added to x before dropout (the bias of the linear producing x).
        gate: None, or a tensor broadcasting against x (each dim x's or 1, the last N or 1), no
            wider than fp32 (fp64 for fp64): the product and the sum are computed in fp32 and
            rounded once to y's dtype, as Wan writes `(h.float() + ff_out * gate).type_as(h)`.
            One vector per sample ((B, 1, N) or (B, N)[:, None] against (B, S, N); (N,) for a
            LayerScale) has its gradient summed per sample in a fixed order; one that varies
            along a sample's rows (per token: FLUX.3's (B, S, N) chunk of a projection) is read
            in place a row at a time and gets its gradient per element, summed down in PyTorch
            over whatever it broadcasts.

    Returns:
        y, contiguous, shaped like x, in the promoted dtype of x and residual. The mask comes
        from Philox seeded by PyTorch's generator on x's device (torch.manual_seed makes it
        repeatable; successive calls differ) and is regenerated in the backward: nothing per
        element is saved. p = 1 returns residual's values.

    Eager calls without dropout run trifuse's kernels or PyTorch's adds, whichever the
    `dropout_add` dialect measured faster for this shape on this GPU
    (`trifuse.autotune.dialects.explain("dropout_add", x, residual, p, bias, gate)` says which);
    with dropout, elsewhere, and under torch.compile, trifuse's.

    Raises:
        ValueError for p outside [0, 1], shapes that do not match, or tensors on different
        devices; TypeError for non-float tensors.
    """
    _check_inputs(x, residual, p, bias)
    return DROPOUT_ADD(x, residual, float(p) if training else 0.0, bias, gate)
