"""GroupNorm, optionally followed by SiLU: y = act(GroupNorm(x)), one op each way.

diffusers' UNets and VAEs (Stable Diffusion 1.x/2.x, SDXL, their VAEs, AnimateDiff) open every
ResNet block with `conv(silu(group_norm(x)))`, twice; their attention blocks and up/down samplers
GroupNorm without the SiLU. Eager PyTorch runs the norm and the SiLU apart and keeps both of their
inputs for the backward; here the SiLU is applied before the single write, and the backward
recomputes it, so the norm's output (a full activation per call) is neither written to be read
back nor kept.

Maths, x of shape (N, C, *spatial), S = prod(spatial), G groups of Cg = C / G channels: row
r = (n, g) holds the L = Cg * S values of its channels. In fp32 (fp64 for fp64 inputs):

    mean_r, var_r = the row's mean and biased variance;  rstd_r = 1 / sqrt(var_r + eps)
    xhat = (x - mean_r) * rstd_r;  z = xhat * w[c] + b[c];  y = silu(z) = z * sigmoid(z)  (or z)

    backward:  dz = dy * silu'(z) = dy * s * (1 + z * (1 - s)), s = sigmoid(z)   (or dy)
               g = dz * w[c]
               dx = rstd_r * (g - mean_r(g) - xhat * mean_r(g * xhat))
               dw[c] = sum over n and spatial of dz * xhat;  db[c] = sum of dz

The row statistics are Welford's, of x - x0 (x0 the row's first value, so the running means stay
near zero and round finely): each lane of a chunk keeps a running mean and the sum of squared
deviations from it, the lanes and then the chunks combined by Chan's formula (mean of means, plus
the deviations of the means). Neither a mean far from zero (large values) nor a variance small
beside the mean's square cancels: within 2x PyTorch's own fp32 error (E[d^2] - E[d]^2 about x0,
the first version, measured 2-5x it where x0 fell a few deviations from the mean).

Shapes: x (N, C, *spatial) with at least 2 dims (N, C); weight and bias (C,) or None. Dtypes:
fp16 / bf16 / fp32 / fp64; the weight and bias in x's dtype or, for a 16-bit x, fp32 (master
weights); y in x's dtype or, for a 16-bit x, `out_dtype=torch.float32` (CUDA autocast runs
GroupNorm in fp32: its 16-bit input, fp32 output). Layout: x contiguous or channels-last
(channels_last, channels_last_3d, an (N, L, C) tensor transposed to (N, C, L)) is read where it
lies, and y and dx come out in that layout: a channels_last UNet pays no copy either way (PyTorch's
CUDA GroupNorm copies x to contiguous and returns y contiguous, for the next conv to copy back).
Any other layout (a slice) is copied once to contiguous.

Kernels (1-D grids; int64 offsets, tensors past 2^31 elements):
  rows that fit one program (their channels x positions tile, padded to powers of two, at most
  _ROW_MAX = 4096 values: 8x8 positions at up to 64 channels a group, as SD's UNet's last level)
  forward   `_row_fwd`: a program per row holds it whole: statistics two-pass in registers, y
            written. One launch, x read once.
  backward  `_row_bwd`: a program per row: its channels' sums of dz * xhat and dz (stored for dw
            and db), then dx from them. One launch, x and dy read once.
  wider rows
  forward   `_stats`: each program takes the mean and squared deviations of one chunk of one
            row (a row is cut in up to 64 chunks so that a few wide rows, a VAE's at 512x512,
            still fill the GPU; a row's values are walked in memory order, so channels-last
            reads runs of C / G channels, C apart); `_fwd`: each program combines its row's chunks into mean and
            rstd (the first chunk's program stores them, for the backward) and normalizes its
            chunk. Two launches.
  backward  `_bwd_sums`: per (n, c) and chunk of spatial positions, sum(dz * xhat) and sum(dz)
            (`_bwd_sums_cl` for channels-last: a program per 64 neighbouring channels and chunk
            of positions, reading (channels, positions) tiles whose columns are contiguous);
            `_bwd_dx`: each program combines its row's channel sums weighted by w into the two
            row means and writes its chunk of dx.
  `_dparams`: dw and db, the per-(n, c) sums added over n (and the chunks) in a fixed order:
  bitwise the same on every run.
Memory plan: the forward saves x, mean and rstd ((N, G) each), nothing of the size of y.
Launch configuration: the chunked kernels' tuned per shape bucket (autotune/configs.py:
group_norm; not yet timed on a GPU); the row kernels' fixed (warps for 16 values a thread).
"""
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

ACTIVATIONS = (None, "silu")
_HALF = (torch.float16, torch.bfloat16)

# =============================================================================================
# Reference: the spec. Tests run it in float64 as the oracle and in the input dtype to measure
# PyTorch's own error.
# =============================================================================================


def group_norm_ref(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5, activation: str | None = None
                   ) -> torch.Tensor:
    """act(F.group_norm(x, num_groups, weight, bias, eps)) in plain PyTorch."""
    if weight is None and bias is not None:  # ones (exact): PyTorch's backward of a bias alone fails
        weight = torch.ones_like(bias)
    if x.numel() == 0:
        # torch 2.14's F.group_norm refuses an empty spatial size ("Expected HxW to be greater than
        # 0"); earlier ones gave the empty output, with zero gradients for the affine parameters.
        y = x * 0
        for p in (weight, bias):
            if p is not None:
                y = y + p.reshape((1, -1) + (1,) * (x.dim() - 2)) * 0
        y = y.to(x.dtype)
    else:
        y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if activation == "silu" else y


# =============================================================================================
# Kernels
# =============================================================================================


@triton.jit
def _silu_and_grad(z):
    s = 1.0 / (1.0 + tl.exp(-z))
    return z * s, s * (1.0 + z * (1.0 - s))


@triton.jit
def _row_start(row, G, CG, L, CL: tl.constexpr):
    """Offset of row (n, g)'s first value. Contiguous: rows are L apart. Channels-last: a sample's
    G rows share its positions, the row's CG channels at g * CG in each."""
    if CL:
        return (row // G).to(tl.int64) * G * L + (row % G) * CG
    return row.to(tl.int64) * L


@triton.jit
def _row_element(j, S, CG, CL: tl.constexpr):
    """(offset from the row's start, channel within the group) of the row's j-th values, the
    row walked in memory order: channel by channel (contiguous), position by position
    (channels-last, C = G * CG values apart; passed as S)."""
    if CL:
        s = j // CG
        c = j - s * CG
        at = s.to(tl.int64) * S + c
    else:
        at = j
        c = j // S
    return at, c  # one return: Triton wants every return statement's types alike


@triton.jit
def _group_norm_stats_kernel(
    X,  # in (N, C, S) contiguous or channels-last
    PART,  # out (R * SPLIT, 2) fp32/fp64: per chunk, its mean of x - x0 and sum((x - its mean)^2)
    L, STEP, CG, G, CHUNK, SPLIT,
    BLOCK: tl.constexpr, CL: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // SPLIT
    start = (pid % SPLIT) * CHUNK
    end = tl.minimum(start + CHUNK, L)
    base = X + _row_start(row, G, CG, L, CL)
    shift = tl.load(base).to(ACC)  # x0, the row's first value: the means are of x - x0, near 0
    # Welford per lane: each lane's running mean and sum of squared deviations from it, so that no
    # sum of squares of a large mean cancels; the k-th block's values are each lane's (k+1)-th.
    count = tl.zeros((BLOCK,), ACC)
    mean = tl.zeros((BLOCK,), ACC)
    m2 = tl.zeros((BLOCK,), ACC)
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < end
        at, _ = _row_element(cols, STEP, CG, CL)
        v = tl.load(base + at, mask=mask, other=0.0).to(ACC) - shift
        inv = 1.0 / ((off - start) // BLOCK + 1).to(ACC)
        delta = v - mean
        mean += tl.where(mask, delta * inv, 0.0)
        m2 += tl.where(mask, delta * (v - mean), 0.0)
        count += mask.to(ACC)
    # the lanes combined (Chan et al.): the chunk's mean, and its deviations from it
    chunk_mean = tl.sum(count * mean, 0) / (end - start).to(ACC)
    d = mean - chunk_mean
    tl.store(PART + pid * 2, chunk_mean)
    tl.store(PART + pid * 2 + 1, tl.sum(m2 + count * d * d, 0))


@triton.jit
def _row_stats(X, PART, row, L, CG, G, CHUNK, SPLIT, eps, SPLIT_P2: tl.constexpr, CL: tl.constexpr,
               ACC: tl.constexpr):
    """(mean, rstd) of `row` from its chunks' means and squared deviations (combined as the
    stats kernel combines its lanes)."""
    parts = tl.arange(0, SPLIT_P2)
    found = parts < SPLIT
    n = tl.where(found, tl.minimum(CHUNK, L - parts * CHUNK), 0).to(ACC)
    means = tl.load(PART + (row * SPLIT + parts) * 2, mask=found, other=0.0)
    m2 = tl.load(PART + (row * SPLIT + parts) * 2 + 1, mask=found, other=0.0)
    mean = tl.sum(n * means, 0) / L
    d = means - mean
    var = tl.sum(m2 + n * d * d, 0) / L
    return tl.load(X + _row_start(row, G, CG, L, CL)).to(ACC) + mean, 1.0 / tl.sqrt(var + eps)


@triton.jit
def _group_norm_fwd_kernel(
    X,  # in (N, C, S) contiguous or channels-last
    W, B,  # in (C,) each, or unused
    Y,  # out, X's layout, Y's dtype
    PART,  # in (R * SPLIT, 2), from _stats
    MEAN, RSTD,  # out (R,) fp32/fp64
    L, STEP, CG, G, CHUNK, SPLIT, eps,
    SPLIT_P2: tl.constexpr, BLOCK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    SILU: tl.constexpr, CL: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // SPLIT
    part = pid % SPLIT
    mean, rstd = _row_stats(X, PART, row, L, CG, G, CHUNK, SPLIT, eps, SPLIT_P2, CL, ACC)
    if part == 0:
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)
    first_channel = (row % G) * CG
    base = _row_start(row, G, CG, L, CL)
    start = part * CHUNK
    end = tl.minimum(start + CHUNK, L)
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < end
        at, ci = _row_element(cols, STEP, CG, CL)
        channel = first_channel + ci
        scale = rstd * tl.load(W + channel, mask=mask, other=0.0).to(ACC) if HAS_W else rstd
        z = (tl.load(X + base + at, mask=mask, other=0.0).to(ACC) - mean) * scale  # w applied with rstd
        if HAS_B:
            z = z + tl.load(B + channel, mask=mask, other=0.0).to(ACC)
        if SILU:
            z = z / (1.0 + tl.exp(-z))
        tl.store(Y + base + at, z.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dz_and_xhat(DY, X, W, B, offs, mask, mean, rstd, w, b, SILU: tl.constexpr, ACC: tl.constexpr):
    """(dz, xhat) at `offs`: the gradient reaching the norm's affine output, and x normalized."""
    xhat = (tl.load(X + offs, mask=mask, other=0.0).to(ACC) - mean) * rstd
    dz = tl.load(DY + offs, mask=mask, other=0.0).to(ACC)
    if SILU:
        _, ds = _silu_and_grad(xhat * w + b)  # z recomputed: the forward kept no activation
        dz = dz * ds
    return tl.where(mask, dz, 0.0), xhat


@triton.jit
def _group_norm_bwd_sums_kernel(
    DY,  # in (N * C, S), dy
    X,  # in (N * C, S)
    W, B,  # in (C,) each, or unused
    MEAN, RSTD,  # in (N * G,)
    PART,  # out (N * C * SPLIT, 2): per (n, c) and chunk, sum(dz * xhat) and sum(dz)
    S, C, CG, CHUNK, SPLIT,
    BLOCK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr,
    ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    plane = pid // SPLIT  # n * C + c
    start = (pid % SPLIT) * CHUNK
    end = tl.minimum(start + CHUNK, S)
    c = plane % C
    row = (plane // C) * (C // CG) + c // CG
    mean = tl.load(MEAN + row)
    rstd = tl.load(RSTD + row)
    w = tl.load(W + c).to(ACC) if HAS_W else 1.0
    b = tl.load(B + c).to(ACC) if HAS_B else 0.0
    base = plane.to(tl.int64) * S
    acc_dzx = tl.zeros((BLOCK,), ACC)
    acc_dz = tl.zeros((BLOCK,), ACC)
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        dz, xhat = _dz_and_xhat(DY, X, W, B, base + cols, cols < end, mean, rstd, w, b, SILU, ACC)
        acc_dzx += dz * xhat
        acc_dz += dz
    tl.store(PART + pid * 2, tl.sum(acc_dzx, 0))
    tl.store(PART + pid * 2 + 1, tl.sum(acc_dz, 0))


@triton.jit
def _group_norm_bwd_sums_cl_kernel(
    DY, X,  # in (N, S, C): channels-last
    W, B,  # in (C,) each, or unused
    MEAN, RSTD,  # in (N * G,)
    PART,  # out (N * C * SPLIT, 2): per (n, c) and chunk of positions, sum(dz * xhat) and sum(dz)
    S, C, CG, G, CHUNK, SPLIT, CBLOCKS,
    BS: tl.constexpr, CB: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr,
    ACC: tl.constexpr,
):
    """Channels-last's per-channel sums: a program takes CB neighbouring channels (whatever their
    groups) of one sample over a chunk of positions, in (CB channels, BS positions) tiles whose
    columns are contiguous (Triton lays the tile out along them). Summed along the positions."""
    pid = tl.program_id(0)
    part = pid % SPLIT
    n = pid // (SPLIT * CBLOCKS)
    cs = ((pid // SPLIT) % CBLOCKS) * CB + tl.arange(0, CB)
    real = cs < C
    row = n * G + cs // CG
    mean = tl.load(MEAN + row, mask=real, other=0.0)[:, None]
    rstd = tl.load(RSTD + row, mask=real, other=0.0)[:, None]
    w = tl.load(W + cs, mask=real, other=0.0).to(ACC)[:, None] if HAS_W else 1.0
    b = tl.load(B + cs, mask=real, other=0.0).to(ACC)[:, None] if HAS_B else 0.0
    base = n.to(tl.int64) * S * C
    start = part * CHUNK
    end = tl.minimum(start + CHUNK, S)
    acc_dzx = tl.zeros((CB, BS), ACC)
    acc_dz = tl.zeros((CB, BS), ACC)
    for off in range(start, end, BS):
        si = off + tl.arange(0, BS)
        mask = real[:, None] & (si < end)[None, :]
        offs = base + cs[:, None] + si.to(tl.int64)[None, :] * C
        dz, xhat = _dz_and_xhat(DY, X, W, B, offs, mask, mean, rstd, w, b, SILU, ACC)
        acc_dzx += dz * xhat
        acc_dz += dz
    at = ((n * C + cs).to(tl.int64) * SPLIT + part) * 2
    tl.store(PART + at, tl.sum(acc_dzx, 1), mask=real)
    tl.store(PART + at + 1, tl.sum(acc_dz, 1), mask=real)


@triton.jit
def _group_norm_bwd_dx_kernel(
    DY, X,  # in (N, C, S) contiguous or channels-last, both the same
    W, B,  # in (C,) each, or unused
    MEAN, RSTD,  # in (R,)
    PART,  # in (N * C * SPLIT_S, 2), from _bwd_sums
    DX,  # out, X's layout
    L, STEP, C, CG, G, CHUNK, SPLIT, SPLIT_S,
    SPLIT_S_P2: tl.constexpr, CB: tl.constexpr, BLOCK: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, SILU: tl.constexpr, CL: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // SPLIT
    part = pid % SPLIT
    first_channel = (row % G) * CG
    first_plane = (row // G) * C + first_channel
    mean = tl.load(MEAN + row)
    rstd = tl.load(RSTD + row)
    # The row's sums of g * xhat and g (g = dz * w): its channels' sums, each weighted by w[c].
    sum_gx = tl.zeros((CB,), ACC)
    sum_g = tl.zeros((CB,), ACC)
    chunks = tl.arange(0, SPLIT_S_P2)
    for c0 in range(0, CG, CB):
        ci = c0 + tl.arange(0, CB)
        found = (ci < CG)[:, None] & (chunks < SPLIT_S)[None, :]
        at = ((first_plane + ci)[:, None] * SPLIT_S + chunks[None, :]) * 2
        dzx = tl.sum(tl.load(PART + at, mask=found, other=0.0), 1)
        dz = tl.sum(tl.load(PART + at + 1, mask=found, other=0.0), 1)
        if HAS_W:
            w = tl.load(W + first_channel + ci, mask=ci < CG, other=0.0).to(ACC)
            dzx = dzx * w
            dz = dz * w
        sum_gx += dzx
        sum_g += dz
    mean_gx = tl.sum(sum_gx, 0) / L
    mean_g = tl.sum(sum_g, 0) / L
    base = _row_start(row, G, CG, L, CL)
    start = part * CHUNK
    end = tl.minimum(start + CHUNK, L)
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < end
        at, ci = _row_element(cols, STEP, CG, CL)
        channel = first_channel + ci
        w = tl.load(W + channel, mask=mask, other=0.0).to(ACC) if HAS_W else 1.0
        b = tl.load(B + channel, mask=mask, other=0.0).to(ACC) if HAS_B else 0.0
        dz, xhat = _dz_and_xhat(DY, X, W, B, base + at, mask, mean, rstd, w, b, SILU, ACC)
        dx = rstd * (dz * w - mean_g - xhat * mean_gx)
        tl.store(DX + base + at, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _row_tile(row, S, CG, G, L, CB: tl.constexpr, SB: tl.constexpr, CL: tl.constexpr):
    """A row (n, g) held whole as a (channel, position) tile: (offsets from X, mask, channels of
    the tile's rows, which of them are real)."""
    ci = tl.arange(0, CB)
    si = tl.arange(0, SB)
    real = ci < CG
    mask = real[:, None] & (si < S)[None, :]
    if CL:  # channels contiguous, positions C = G * CG apart
        offs = _row_start(row, G, CG, L, CL) + ci[:, None] + si.to(tl.int64)[None, :] * (G * CG)
    else:
        offs = row.to(tl.int64) * L + ci[:, None] * S + si[None, :]
    return offs, mask, (row % G) * CG + ci, real


@triton.jit
def _group_norm_row_fwd_kernel(
    X, W, B,  # in (N, C, S) contiguous or channels-last; (C,) each, or unused
    Y,  # out, X's layout
    MEAN, RSTD,  # out (R,)
    S, CG, G, L, eps,
    CB: tl.constexpr, SB: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr,
    CL: tl.constexpr, ACC: tl.constexpr,
):
    """One row per program, read once: the statistics two-pass in registers, about x0."""
    row = tl.program_id(0)
    offs, mask, channel, real = _row_tile(row, S, CG, G, L, CB, SB, CL)
    shift = tl.load(X + _row_start(row, G, CG, L, CL)).to(ACC)  # x0: the sums are of values near 0
    x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
    d = tl.where(mask, x - shift, 0.0)
    d_mean = tl.sum(tl.sum(d, 1), 0) / L
    d = tl.where(mask, d - d_mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(d * d, 1), 0) / L + eps)
    mean = shift + d_mean
    # y from x - mean (two roundings, not d's three), w applied with rstd: PyTorch's own error
    if HAS_W:
        scale = rstd * tl.load(W + channel, mask=real, other=0.0).to(ACC)
    else:
        scale = tl.full((CB,), 1.0, ACC) * rstd
    z = (x - mean) * scale[:, None]
    if HAS_B:
        z = z + tl.load(B + channel, mask=real, other=0.0).to(ACC)[:, None]
    if SILU:
        z = z / (1.0 + tl.exp(-z))
    tl.store(Y + offs, z.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _group_norm_row_bwd_kernel(
    DY, X, W, B,  # in (N, C, S) each, both contiguous or both channels-last; (C,) each, or unused
    MEAN, RSTD,  # in (R,)
    PART,  # out (N * C, 2): per (n, c), sum(dz * xhat) and sum(dz)
    DX,  # out, X's layout, or unused
    S, C, CG, G, L,
    CB: tl.constexpr, SB: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr,
    NEED_DX: tl.constexpr, CL: tl.constexpr, ACC: tl.constexpr,
):
    """One row per program, x and dy read once: its channels' sums, then dx from them."""
    row = tl.program_id(0)
    offs, mask, channel, real = _row_tile(row, S, CG, G, L, CB, SB, CL)
    mean = tl.load(MEAN + row)
    rstd = tl.load(RSTD + row)
    w = tl.load(W + channel, mask=real, other=0.0).to(ACC) if HAS_W else tl.full((CB,), 1.0, ACC)
    b = tl.load(B + channel, mask=real, other=0.0).to(ACC) if HAS_B else tl.full((CB,), 0.0, ACC)
    xhat = tl.where(mask, (tl.load(X + offs, mask=mask, other=0.0).to(ACC) - mean) * rstd, 0.0)
    dz = tl.load(DY + offs, mask=mask, other=0.0).to(ACC)
    if SILU:
        _, ds = _silu_and_grad(xhat * w[:, None] + b[:, None])  # z recomputed
        dz = tl.where(mask, dz * ds, 0.0)
    sum_dzx = tl.sum(dz * xhat, 1)
    sum_dz = tl.sum(dz, 1)
    plane = (row // G) * C + channel
    tl.store(PART + plane * 2, sum_dzx, mask=real)
    tl.store(PART + plane * 2 + 1, sum_dz, mask=real)
    if NEED_DX:
        mean_gx = tl.sum(sum_dzx * w, 0) / L
        mean_g = tl.sum(sum_dz * w, 0) / L
        dx = rstd * (dz * w[:, None] - mean_g - xhat * mean_gx)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _group_norm_dparams_kernel(
    PART,  # in (N, C, SPLIT, 2): per (n, c) and chunk, sum(dz * xhat) and sum(dz)
    DW, DB,  # out (C,) each in the parameter's dtype, or unused
    N, C, SPLIT,
    BLOCK_C: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr,
):
    """dw and db: the sums over n and the chunks, added in one fixed order (deterministic)."""
    cs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    real = cs < C
    dw = tl.zeros((BLOCK_C,), ACC)
    db = tl.zeros((BLOCK_C,), ACC)
    for n in range(N):
        for k in range(SPLIT):
            at = ((n * C + cs).to(tl.int64) * SPLIT + k) * 2
            dw += tl.load(PART + at, mask=real, other=0.0)
            db += tl.load(PART + at + 1, mask=real, other=0.0)
    if HAS_W:
        tl.store(DW + cs, dw.to(DW.dtype.element_ty), mask=real)
    if HAS_B:
        tl.store(DB + cs, db.to(DB.dtype.element_ty), mask=real)


# =============================================================================================
# Launchers: check nothing, allocate the outputs, launch. Tensors in, tensors out.
# =============================================================================================

_stats = CachedKernel(_group_norm_stats_kernel)
_fwd = CachedKernel(_group_norm_fwd_kernel)
_bwd_sums = CachedKernel(_group_norm_bwd_sums_kernel)
_bwd_sums_cl = CachedKernel(_group_norm_bwd_sums_cl_kernel)
_bwd_dx = CachedKernel(_group_norm_bwd_dx_kernel)
_row_fwd = CachedKernel(_group_norm_row_fwd_kernel)
_row_bwd = CachedKernel(_group_norm_row_bwd_kernel)
_dparams = CachedKernel(_group_norm_dparams_kernel)
_DPARAMS_BLOCK = 128  # channels a program
_DPARAMS_META: dict[tuple, dict] = {}  # launch keywords per (dweight wanted, dbias wanted, sums' dtype)

# A row whose (channels x positions) tile, each side padded to a power of two, holds at most this
# many values is normalized by one program holding it whole (one launch each way, x read once
# in the forward, x and dy once in the backward); wider rows take the chunked kernels above. At
# 4096 (8 warps, 16 values a thread a tile) the backward keeps about five tiles live. Under the
# interpreter 256, so that the tests take both paths. Rows this narrow never split into chunks
# (a chunk is at least 4 blocks of up to 1024 values), so the one-pass path costs no parallelism.
_ROW_MAX = 256 if INTERPRET else 4096

# Launch configurations (autotune/configs.py: group_norm): a block of BLOCK values a loop step
# with num_warps warps, rows cut into chunks of at least MIN_BLOCKS blocks so that about WAVES
# programs an SM run. Tuned per (device, dtype, rows bucket, row-width bucket, activation, layout)
# for the forward's two launches together, and per (device, dtype, rows, width, plane-size buckets,
# activation, dx wanted, layout) for the backward's (channels-last reads in another order); a plan
# per exact call shape once decided (_LAUNCHES).
_FWD_KEY_NAMES = ("device", "dtype", "out_dtype", "rows", "width", "silu", "channels_last")
_BWD_KEY_NAMES = ("device", "dtype", "rows", "width", "plane", "silu", "dx", "channels_last")
_FWD_TUNER = Tuner("group_norm_fwd", configs.group_norm, _FWD_KEY_NAMES)
_BWD_TUNER = Tuner("group_norm_bwd", configs.group_norm, _BWD_KEY_NAMES)
_LAUNCHES: dict[tuple, tuple] = {}

# Under the interpreter, blocks of at most 64 values and chunks of 2 blocks at least, whatever the
# config: tests of a few hundred values then cross blocks and chunks. None: the config's own.
_INTERPRET_CAPS = (64, 2) if INTERPRET else None
_MAX_SPLIT = 64  # chunks per row at most (the combining programs load them all)
# Channels a program of channels-last's backward sums (128 bytes of a position's fp16 values);
# under the interpreter 16, so that tests of a few dozen channels cross channel blocks.
_CL_CHANNELS = 16 if INTERPRET else 64


def channels_last(x: torch.Tensor) -> bool:
    """Whether x (N, C, *spatial) is laid out channels-last (N, *spatial, C), and not also
    contiguous: channels_last / channels_last_3d, or (N, L, C) transposed to (N, C, L)."""
    return x.dim() >= 3 and not x.is_contiguous() and x.movedim(1, -1).is_contiguous()


def _empty_in_layout(x: torch.Tensor, dtype: torch.dtype, cl: bool) -> torch.Tensor:
    """An empty tensor shaped like x: channels-last where `cl`, contiguous otherwise. Not a view
    (an autograd.Function's output that is a view may not be modified in place: an in-place SiLU)."""
    if not cl:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    c, spatial = x.shape[1], x.shape[2:]
    strides, step = [], c
    for size in reversed(spatial):  # (N, *spatial, C) in memory
        strides.append(step)
        step *= size
    return torch.empty_strided(x.shape, (step, 1, *reversed(strides)), dtype=dtype, device=x.device)


def _in_layout(t: torch.Tensor, cl: bool) -> torch.Tensor:
    """t channels-last where `cl`, contiguous otherwise (a copy only when it is not already)."""
    if not cl:
        return t.contiguous()
    if t.movedim(1, -1).is_contiguous():
        return t
    return _empty_in_layout(t, t.dtype, True).copy_(t)


def _chunking(cfg: triton.Config, rows: int, width: int, sms: int) -> tuple[int, int, int, int]:
    """(block, chunk, chunks per row, warps) of `cfg` for `rows` rows of `width` values: enough
    programs for the GPU where rows are few and wide, chunks of whole blocks, and at least 4
    values a thread of a block (fewer warps for narrow rows)."""
    block, min_blocks = cfg.kwargs["BLOCK"], cfg.kwargs["MIN_BLOCKS"]
    if _INTERPRET_CAPS is not None:
        block, min_blocks = min(block, _INTERPRET_CAPS[0]), min(min_blocks, _INTERPRET_CAPS[1])
    block = min(block, next_power_of_2(max(width, 1)))
    want = max(1, min(_MAX_SPLIT, -(-cfg.kwargs["WAVES"] * sms // max(rows, 1))))
    chunk = max(-(-width // want), min_blocks * block, -(-width // _MAX_SPLIT))
    chunk = -(-chunk // block) * block
    return block, chunk, max(1, -(-width // chunk)), min(cfg.num_warps, max(1, block // 128))


def _dims(x: torch.Tensor, num_groups: int) -> tuple[int, int, int, int]:
    """(N, C, S, L): batch, channels, spatial size, values per row."""
    n, c = x.shape[0], x.shape[1]
    s = x.numel() // (n * c) if n * c else 0
    return n, c, s, (c // num_groups) * s


def _row_plan(c: int, s: int, groups: int) -> tuple | None:
    """(tile channels, tile positions, warps) of the one-program-a-row path, None where a row's
    tile exceeds _ROW_MAX."""
    cb, sb = next_power_of_2(c // groups), next_power_of_2(s)
    if cb * sb > _ROW_MAX:
        return None
    return cb, sb, min(8, max(1, cb * sb // 512))


def _fwd_plan(cfg: triton.Config, n: int, c: int, s: int, groups: int, sms: int, flags: dict) -> tuple:
    """(grid, runtime sizes, _stats's and _fwd's launch keywords) of `cfg`."""
    rows, width = n * groups, (c // groups) * s
    block, chunk, split, warps = _chunking(cfg, rows, width, sms)
    stats_meta = {"BLOCK": block, "CL": flags["CL"], "ACC": flags["ACC"], "num_warps": warps}
    fwd_meta = {**flags, "SPLIT_P2": next_power_of_2(split), "BLOCK": block, "num_warps": warps}
    step = c if flags["CL"] else s  # from one value of a row to the next channel's / position's
    return (rows * split,), (width, step, c // groups, groups, chunk, split), stats_meta, fwd_meta


def _fwd_run(plan: tuple, x, w_arg, b_arg, y, mean, rstd, eps: float) -> None:
    if plan[0] == "row":
        _, grid, sizes, meta = plan
        _row_fwd.run(grid, (x, w_arg, b_arg, y, mean, rstd, *sizes, eps), meta)
        return
    grid, (width, step, cg, groups, chunk, split), stats_meta, fwd_meta = plan
    part = torch.empty((grid[0], 2), dtype=mean.dtype, device=x.device)  # per chunk: two sums
    _stats.run(grid, (x, part, width, step, cg, groups, chunk, split), stats_meta)
    _fwd.run(grid, (x, w_arg, b_arg, y, part, mean, rstd, width, step, cg, groups, chunk, split, eps),
             fwd_meta)


def _fwd_timed(cfg: triton.Config, x, w_arg, b_arg, y, mean, rstd, eps, *shape) -> None:
    """The forward's two launches with `cfg` (what the tuner times; they rewrite the outputs)."""
    _fwd_run(_fwd_plan(cfg, *shape), x, w_arg, b_arg, y, mean, rstd, eps)


def _bwd_plan(cfg: triton.Config, n: int, c: int, s: int, groups: int, sms: int, flags: dict,
              need_dx: bool) -> tuple:
    """(the sums' kernel, grid, sizes, keywords and chunks a plane; dx's grid, sizes and keywords or
    None) of `cfg`."""
    sums_flags = {k: v for k, v in flags.items() if k != "CL"}  # each sums kernel serves one layout
    if flags["CL"]:
        sums = _cl_sums_plan(cfg, n, c, s, groups, sms, sums_flags)
    else:
        block_s, chunk_s, split_s, warps_s = _chunking(cfg, n * c, s, sms)
        sums = (_bwd_sums, (n * c * split_s,), (s, c, c // groups, chunk_s, split_s),
                {**sums_flags, "BLOCK": block_s, "num_warps": warps_s}, split_s)
    split_s = sums[-1]
    if not need_dx:
        return sums, None
    rows, width, cg = n * groups, (c // groups) * s, c // groups
    block, chunk, split, warps = _chunking(cfg, rows, width, sms)
    dx_meta = {**flags, "SPLIT_S_P2": next_power_of_2(split_s), "BLOCK": block, "num_warps": warps,
               "CB": min(next_power_of_2(cg), max(1, 256 // next_power_of_2(split_s)))}  # <= 256 sums a step
    step = c if flags["CL"] else s
    return sums, ((rows * split,), (width, step, c, cg, groups, chunk, split, split_s), dx_meta)


def _cl_sums_plan(cfg: triton.Config, n: int, c: int, s: int, groups: int, sms: int, flags: dict) -> tuple:
    """Channels-last's sums launch: programs of CB channels by a chunk of positions, in tiles of
    (CB channels, BS positions) as large as `cfg`'s block, enough of them for the GPU."""
    cb = min(next_power_of_2(c), _CL_CHANNELS)
    cblocks = -(-c // cb)
    block, chunk, _, warps = _chunking(cfg, n * cblocks, s * cb, sms)
    bs = max(1, block // cb)
    chunk_s = max(chunk // cb, -(-s // _MAX_SPLIT))
    chunk_s = -(-chunk_s // bs) * bs  # whole tiles
    split = -(-s // chunk_s)
    return (_bwd_sums_cl, (n * cblocks * split,), (s, c, c // groups, groups, chunk_s, split, cblocks),
            {**flags, "BS": bs, "CB": cb, "num_warps": min(warps, max(1, bs * cb // 128))}, split)


def _bwd_run(plan: tuple, dy, x, w_arg, b_arg, mean, rstd, dx) -> torch.Tensor:
    """Launches the backward; returns the per-(n, c) and chunk sums of dz * xhat and dz."""
    if plan[0] == "row":
        _, grid, (n, c, s, cg, groups, width), meta = plan
        part = torch.empty((n * c, 2), dtype=mean.dtype, device=x.device)
        _row_bwd.run(grid, (dy, x, w_arg, b_arg, mean, rstd, part, x if dx is None else dx,
                            s, c, cg, groups, width), meta)
        return part
    (sums_kernel, grid_s, sizes_s, meta_s, split_s), dx_launch = plan
    part = torch.empty((x.shape[0] * x.shape[1] * split_s, 2), dtype=mean.dtype, device=x.device)
    sums_kernel.run(grid_s, (dy, x, w_arg, b_arg, mean, rstd, part, *sizes_s), meta_s)
    if dx_launch is not None:
        grid, sizes, meta = dx_launch
        _bwd_dx.run(grid, (dy, x, w_arg, b_arg, mean, rstd, part, dx, *sizes), meta)
    return part


def _bwd_timed(cfg: triton.Config, dy, x, w_arg, b_arg, mean, rstd, dx, *shape) -> None:
    """The backward's launches with `cfg` (what the tuner times; they rewrite dx and scratch)."""
    _bwd_run(_bwd_plan(cfg, *shape), dy, x, w_arg, b_arg, mean, rstd, dx)


def _flags(x: torch.Tensor, weight, bias, activation, cl: bool) -> dict:
    return {"HAS_W": weight is not None, "HAS_B": bias is not None, "SILU": activation == "silu",
            "CL": cl, "ACC": acc_dtype(x.dtype)}


def group_norm_fwd(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, activation: str | None, out_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): y shaped like x, in out_dtype, channels-last where x is (see
    `channels_last`) and contiguous otherwise; mean and rstd (N, G) in the accumulation dtype (fp32,
    fp64 for fp64 x)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if x.numel() and not use_triton(x):
        return _group_norm_torch(x, num_groups, weight, bias, eps, activation, out_dtype)
    n, c, s, width = _dims(x, num_groups)
    cl = channels_last(x)
    y = _empty_in_layout(x, out_dtype, cl)
    mean = torch.empty((n, num_groups), dtype=acc, device=x.device)
    rstd = torch.empty((n, num_groups), dtype=acc, device=x.device)
    if x.numel() == 0:
        return y, mean.fill_(float("nan")), rstd.fill_(float("nan"))
    x = _in_layout(x, cl)  # another layout (a slice, say) copied once
    w_arg = weight if weight is not None else x
    b_arg = bias if bias is not None else x
    device = x.get_device() if x.is_cuda else -1
    key = (device, x.dtype, out_dtype, n, c, s, num_groups, weight is not None, bias is not None, activation,
           cl)
    plan = _LAUNCHES.get(key)
    if plan is None and (row := _row_plan(c, s, num_groups)) is not None:
        cb, sb, warps = row
        plan = ("row", (n * num_groups,), (s, c // num_groups, num_groups, width),
                {**_flags(x, weight, bias, activation, cl), "CB": cb, "SB": sb, "num_warps": warps})
        store_plan(_LAUNCHES, key, plan)
    if plan is None:
        shape = (n, c, s, num_groups, device_sms(x), _flags(x, weight, bias, activation, cl))
        tuning_key = (device, x.dtype, out_dtype, pow2_bucket(n * num_groups), pow2_bucket(width),
                      activation == "silu", cl)
        cfg = _FWD_TUNER.config(tuning_key, _fwd_timed, x, w_arg, b_arg, y, mean, rstd, eps, *shape)
        plan = _fwd_plan(cfg, *shape)
        if _FWD_TUNER.is_decided(tuning_key):
            store_plan(_LAUNCHES, key, plan)
    _fwd_run(plan, x, w_arg, b_arg, y, mean, rstd, eps)
    return y, mean, rstd


def group_norm_bwd(dy: torch.Tensor, x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, activation: str | None,
                   need_dx: bool = True
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias): dx in x's dtype and group_norm_fwd's layout for x (None when not
    needed), dweight and dbias (C,) in the weight's and bias's dtypes (None for an absent one)."""
    if x.numel() and not use_triton(x):
        return _group_norm_bwd_torch(dy, x, num_groups, weight, bias, mean, rstd, activation, need_dx)
    n, c, s, width = _dims(x, num_groups)
    if x.numel() == 0:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
        dw = torch.zeros_like(weight) if weight is not None else None
        db = torch.zeros_like(bias) if bias is not None else None
        return dx, dw, db
    cl = channels_last(x)
    x, dy = _in_layout(x, cl), _in_layout(dy, cl)  # dy in x's layout: the kernels index both alike
    w_arg = weight if weight is not None else x
    b_arg = bias if bias is not None else x
    dx = _empty_in_layout(x, x.dtype, cl) if need_dx else None
    device = x.get_device() if x.is_cuda else -1
    key = ("bwd", device, x.dtype, n, c, s, num_groups, weight is not None, bias is not None, activation,
           need_dx, cl)
    plan = _LAUNCHES.get(key)
    if plan is None and (row := _row_plan(c, s, num_groups)) is not None:
        cb, sb, warps = row
        plan = ("row", (n * num_groups,), (n, c, s, c // num_groups, num_groups, width),
                {**_flags(x, weight, bias, activation, cl), "CB": cb, "SB": sb, "NEED_DX": need_dx,
                 "num_warps": warps})
        store_plan(_LAUNCHES, key, plan)
    if plan is None:
        shape = (n, c, s, num_groups, device_sms(x), _flags(x, weight, bias, activation, cl), need_dx)
        tuning_key = (device, x.dtype, pow2_bucket(n * num_groups), pow2_bucket(width), pow2_bucket(s),
                      activation == "silu", need_dx, cl)
        cfg = _BWD_TUNER.config(tuning_key, _bwd_timed, dy, x, w_arg, b_arg, mean, rstd, dx, *shape)
        plan = _bwd_plan(cfg, *shape)
        if _BWD_TUNER.is_decided(tuning_key):
            store_plan(_LAUNCHES, key, plan)
    part = _bwd_run(plan, dy, x, w_arg, b_arg, mean, rstd, dx)
    dw = torch.empty_like(weight) if weight is not None else None
    db = torch.empty_like(bias) if bias is not None else None
    if dw is not None or db is not None:
        dw_arg, db_arg = (dw if dw is not None else db), (db if db is not None else dw)
        meta_key = (dw is not None, db is not None, part.dtype)
        meta = _DPARAMS_META.get(meta_key)
        if meta is None:  # built once per kind: this runs on every backward
            meta = _DPARAMS_META[meta_key] = {"BLOCK_C": _DPARAMS_BLOCK, "HAS_W": meta_key[0],
                                              "HAS_B": meta_key[1], "ACC": acc_dtype(part.dtype)}
        _dparams.run((-(-c // _DPARAMS_BLOCK),), (part, dw_arg, db_arg, n, c, part.shape[0] // (n * c)), meta)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# PyTorch path for CPU tensors without the interpreter: the kernels' maths, same outputs.
# ---------------------------------------------------------------------------------------------


def _upcast(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _group_norm_torch(x, num_groups, weight, bias, eps, activation, out_dtype):
    n = x.shape[0]
    xf = _upcast(x)
    rows = xf.reshape(n, num_groups, -1)
    var, mean = torch.var_mean(rows, dim=-1, unbiased=False)
    y = group_norm_ref(xf, num_groups, _upcast(weight), _upcast(bias), eps, activation)
    return _in_layout(y.to(out_dtype), channels_last(x)), mean, torch.rsqrt(var + eps)


def _group_norm_bwd_torch(dy, x, num_groups, weight, bias, mean, rstd, activation, need_dx):
    # The formulas, not autograd: inside the registered backward op autograd records nothing.
    n, c = x.shape[0], x.shape[1]
    xf, w, b = _upcast(x), _upcast(weight), _upcast(bias)
    mean, rstd = mean.to(xf.dtype).view(n, num_groups, 1), rstd.to(xf.dtype).view(n, num_groups, 1)
    xhat = ((xf.reshape(n, num_groups, -1) - mean) * rstd).reshape(n, c, -1)
    dz = dy.to(xf.dtype).reshape(n, c, -1)
    w3 = w.view(1, c, 1) if w is not None else None
    if activation == "silu":
        z = xhat * w3 if w3 is not None else xhat
        z = z + b.view(1, c, 1) if b is not None else z
        s = torch.sigmoid(z)
        dz = dz * s * (1 + z * (1 - s))
    dw = (dz * xhat).sum(dim=(0, 2)).to(weight.dtype) if weight is not None else None
    db = dz.sum(dim=(0, 2)).to(bias.dtype) if bias is not None else None
    dx = None
    if need_dx:
        g = (dz * w3 if w3 is not None else dz).reshape(n, num_groups, -1)
        xh = xhat.reshape(n, num_groups, -1)
        dx = rstd * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))
        dx = _in_layout(dx.reshape(x.shape).to(x.dtype), channels_last(x))
    return dx, dw, db


# =============================================================================================
# Checks, shared by the registered ops (real and fake) and the eager path
# =============================================================================================


def _check_inputs(x: object, num_groups: object, weight: object, bias: object, eps: object,
                  activation: object, out_dtype: object) -> torch.dtype:
    """The output dtype, once every argument is checked."""
    op = "group_norm"
    check_tensor(op, "x", x)
    check_float(op, "x", x)
    if x.dim() < 2:
        raise ValueError(f"trifuse.{op}: x must have at least 2 dimensions (N, C, ...), "
                         f"got shape {tuple(x.shape)}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"trifuse.{op}: num_groups must be a positive int, got {num_groups!r}")
    channels = x.shape[1]
    if channels % num_groups:
        raise ValueError(f"trifuse.{op}: the channels of x (dim 1, {channels}) must divide into num_groups "
                         f"({num_groups}) groups")
    params = {"weight": weight, "bias": bias}
    for name, p in params.items():
        if p is None:
            continue
        check_tensor(op, name, p)
        check_float(op, name, p)
        check_shape(op, name, p, (channels,))
        if p.dtype != x.dtype and not (p.dtype == torch.float32 and x.dtype in _HALF):
            raise TypeError(f"trifuse.{op}: {name} has dtype {p.dtype}; it must be x's ({x.dtype}) or, for a "
                            "16-bit x, float32")
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(f"trifuse.{op}: bias has dtype {bias.dtype} but weight has {weight.dtype}")
    check_same_device(op, "x", x, weight=weight, bias=bias)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"trifuse.{op}: eps must be a number >= 0, got {eps!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"trifuse.{op}: activation must be None or 'silu', got {activation!r}")
    if out_dtype is None or out_dtype == x.dtype:
        return x.dtype
    if out_dtype == torch.float32 and x.dtype in _HALF:
        return out_dtype
    raise TypeError(f"trifuse.{op}: out_dtype must be None, x's dtype ({x.dtype}) or, for a 16-bit x, "
                    f"torch.float32; got {out_dtype}")


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see. The forward returns the
# statistics its backward needs; the backward returns empty tensors for gradients not asked for.
# =============================================================================================

Tensor = torch.Tensor
OptTensor = torch.Tensor | None


@torch.library.custom_op("trifuse::group_norm", mutates_args=())
def _group_norm_op(x: Tensor, num_groups: int, weight: OptTensor, bias: OptTensor, eps: float,
                   activation: str | None, out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd)."""
    dtype = _check_inputs(x, num_groups, weight, bias, eps, activation, out_dtype)
    return group_norm_fwd(x, num_groups, weight, bias, eps, activation, dtype)


@torch.library.custom_op("trifuse::group_norm_backward", mutates_args=())
def _group_norm_backward_op(dy: Tensor, x: Tensor, num_groups: int, weight: OptTensor, bias: OptTensor,
                            mean: Tensor, rstd: Tensor, activation: str | None,
                            need_dx: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias), each empty where not needed or absent."""
    dx, dw, db = group_norm_bwd(dy, x, num_groups, weight, bias, mean, rstd, activation, need_dx)
    return tuple(t if t is not None else x.new_empty(0) for t in (dx, dw, db))  # one empty each: no aliases


@_group_norm_op.register_fake
def _(x, num_groups, weight, bias, eps, activation, out_dtype):
    dtype = _check_inputs(x, num_groups, weight, bias, eps, activation, out_dtype)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    stats = (x.shape[0], num_groups)
    y = _empty_in_layout(x, dtype, channels_last(x))
    return y, x.new_empty(stats, dtype=acc), x.new_empty(stats, dtype=acc)


@_group_norm_backward_op.register_fake
def _(dy, x, num_groups, weight, bias, mean, rstd, activation, need_dx):
    return (_empty_in_layout(x, x.dtype, channels_last(x)) if need_dx else x.new_empty(0), weight.new_empty(weight.shape) if weight is not None
            else x.new_empty(0), bias.new_empty(bias.shape) if bias is not None else x.new_empty(0))


def _setup(ctx, inputs, output):
    x, num_groups, weight, bias, eps, activation, _ = inputs
    y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.num_groups, ctx.eps, ctx.activation, ctx.out_dtype = num_groups, eps, activation, y.dtype
    ctx.set_materialize_grads(False)


def _op_twice(ctx, dy, *_):
    dx, dw, db = _group_norm_twice(ctx, dy)
    return dx, None, dw, db, None, None, None


@single_backward(twice=_op_twice, op="group_norm")
def _backward(ctx, dy, *_):
    if dy is None:
        return (None,) * 7
    x, weight, bias, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dx, dw, db = torch.ops.trifuse.group_norm_backward(dy, x, ctx.num_groups, weight, bias, mean, rstd,
                                                       ctx.activation, needs[0])
    return (dx if needs[0] else None, None, dw if weight is not None and needs[2] else None,
            db if bias is not None and needs[3] else None, None, None, None)


torch.library.register_autograd("trifuse::group_norm", _backward, setup_context=_setup)


# =============================================================================================
# Eager fast path: a thin autograd.Function straight over the launchers (see DESIGN.md "Host
# overhead"). Same launchers, same bits as the registered op.
# =============================================================================================


def _group_norm_twice(ctx, dy):
    """(dx, dweight, dbias) in PyTorch ops, differentiable again (create_graph=True)."""
    x, weight, bias, _, _ = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dx, dw, db = reference_grads(
        lambda x, w, b: _group_norm_torch(x, ctx.num_groups, w, b, ctx.eps, ctx.activation, ctx.out_dtype)[0],
        (x, weight, bias), (needs[0], needs[2], needs[3]), (dy,))
    return dx, dw, db


class _GroupNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps, activation, out_dtype):
        y, mean, rstd = group_norm_fwd(x, num_groups, weight, bias, eps, activation, out_dtype)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.num_groups, ctx.eps, ctx.activation, ctx.out_dtype = num_groups, eps, activation, out_dtype
        return y

    @staticmethod
    @single_backward(twice=lambda ctx, dy: _op_twice(ctx, dy))
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        with profiled("trifuse::group_norm_backward"):
            dx, dw, db = group_norm_bwd(dy, x, ctx.num_groups, weight, bias, mean, rstd, ctx.activation,
                                        needs[0])
        return (dx, None, dw if needs[2] else None, db if needs[3] else None, None, None, None)


# =============================================================================================
# Dialect: trifuse's kernels or PyTorch's `F.group_norm` (then `F.silu`), whichever is faster for
# the shape, chosen once per (device, dtype, rows bucket, width, activation, grad, layout) on the GPU and
# cached on disk (autotune/dialects.py). Traced calls always see trifuse::group_norm.
# =============================================================================================


def _group_norm_key(x, num_groups, weight, bias, eps, activation, out_dtype):
    """The dialect key of an eager call; None (the trifuse op decides, and raises on bad input)
    when traced, empty or not fitting. It runs on every call."""
    if not isinstance(x, torch.Tensor) or not eager_fast_path(x, weight, bias) or x.dim() < 2:
        return None
    c = x.shape[1]
    if type(num_groups) is not int or num_groups < 1 or c % num_groups or activation not in ACTIVATIONS:
        return None
    rows = x.shape[0] * num_groups
    numel = x.numel()
    if numel == 0 or not x.is_floating_point():
        return None
    grad = torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                        or (bias is not None and bias.requires_grad))
    # the layout: trifuse's kernels read channels-last as it is and copy any other; PyTorch's CUDA
    # GroupNorm copies all but contiguous (and the torch candidate copies its y back)
    layout = "contiguous" if x.is_contiguous() else "channels_last" if channels_last(x) else "other"
    return (x.get_device() if x.is_cuda else -1, x.dtype, pow2_bucket(rows), pow2_bucket(numel // rows),
            activation, out_dtype, grad, layout)


def _group_norm_trifuse(x, num_groups, weight, bias, eps, activation, out_dtype):
    dtype = _check_inputs(x, num_groups, weight, bias, eps, activation, out_dtype)
    if eager_fast_path(x, weight, bias):
        with profiled("trifuse::group_norm"):
            return apply_function(_GroupNormFunction, x, num_groups, weight, bias, eps, activation, dtype)
    return torch.ops.trifuse.group_norm(x, num_groups, weight, bias, eps, activation, out_dtype)[0]


def _group_norm_torch_candidate(x, num_groups, weight, bias, eps, activation, out_dtype):
    # trifuse's checks first: the same clear errors whichever candidate runs.
    dtype = _check_inputs(x, num_groups, weight, bias, eps, activation, out_dtype)
    layout = channels_last(x)  # y laid out as trifuse's kernels lay it out
    with profiled("trifuse::group_norm"):
        if dtype != x.dtype or (weight is not None and weight.dtype != x.dtype):
            # CUDA autocast's form: the norm (and the SiLU) in fp32, from x upcast
            x, weight, bias = _upcast(x), _upcast(weight), _upcast(bias)
        return _in_layout(group_norm_ref(x, num_groups, weight, bias, eps, activation).to(dtype), layout)


def _reference(x, num_groups, weight=None, bias=None, eps=1e-5, activation=None, out_dtype=None):
    return group_norm_ref(x, num_groups, weight, bias, eps, activation)


GROUP_NORM = dialects.define(
    "group_norm", _group_norm_key,
    ("device", "dtype", "rows", "width", "activation", "out_dtype", "grad", "layout"),
    reference=_reference,
    captures=((torch.nn.GroupNorm,  # trifuse.nn.GroupNorm too, with its activation
               lambda m, x: (x, m.num_groups, m.weight, m.bias, m.eps, getattr(m, "activation", None), None)),))
GROUP_NORM.register(dialects.Candidate("trifuse", _group_norm_trifuse))
GROUP_NORM.register(dialects.Candidate("torch", _group_norm_torch_candidate))


# =============================================================================================
# Public API
# =============================================================================================


@outside_device_modes
def group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, activation: str | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`F.group_norm(x, num_groups, weight, bias, eps)`, then SiLU if asked, in one pass each way.

    Args:
        x: (N, C, *spatial), fp16 / bf16 / fp32 / fp64, C divisible by num_groups; contiguous or
            channels-last read where it lies, any other layout copied once.
        num_groups: G; each of the N * G rows normalizes C / G channels over every spatial position.
        weight, bias: (C,) or None, in x's dtype or, for a 16-bit x, fp32.
        eps: added to the variance.
        activation: None, or "silu" (`F.silu` of the norm's output, as a ResNet block's
            `nonlinearity(norm(x))`).
        out_dtype: None (x's dtype) or, for a 16-bit x, torch.float32: CUDA autocast's GroupNorm,
            which computes in fp32 and returns fp32.

    Returns:
        y, shaped like x, channels-last where x is, contiguous otherwise. Gradients reach x, weight and bias; the backward recomputes
        the norm's output from x and the saved (N, G) statistics (no activation is kept).

    Eager calls run trifuse's kernels or PyTorch's GroupNorm (and SiLU), whichever the `group_norm`
    dialect measured faster for this shape on this GPU; elsewhere, and under torch.compile, trifuse's.

    Raises:
        TypeError for non-float tensors or parameters of another dtype; ValueError for fewer than
        2 dims, channels that do not divide into the groups, parameters not (C,), tensors on
        different devices, a negative eps or an unknown activation.
    """
    return GROUP_NORM(x, num_groups, weight, bias, eps, activation, out_dtype)
