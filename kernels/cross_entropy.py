"""Cross-entropy over a vocabulary, and the LM head fused with it (linear + cross-entropy).

Maths, per row i of C logits x, target t_i, label smoothing e; fp32 math (fp64 for fp64 inputs):

    lse_i  = log sum_j exp(x_ij) = m_i + log l_i        online over blocks of the row (m_i the max)
    loss_i = lse_i - (1 - e) x_it - (e / C) sum_j x_ij  = (1-e) nll_i + (e/C) sum_j -log p_ij
                                                        (m_i taken out before log l_i is added)
    loss_i = 0                                          where t_i == ignore_index
    "mean" = sum_i loss_i / #{i : t_i != ignore_index}  (0/0 = nan when every row is ignored)
    "sum"  = sum_i loss_i;  "none" = loss_i
    dx_ij  = s_i (p_ij - (1 - e) [j == t_i] - e / C),   p_ij = exp((x_ij - m_i) - log l_i)

with s_i the incoming gradient of row i (divided by the count for "mean"); ignored rows get an
exact zero gradient. This is F.cross_entropy's definition, label smoothing and ignore_index
included (PyTorch also leaves ignored rows out of the smoothing term and of the mean).

cross_entropy(logits (N, C), target (N,)):
    forward   one pass over each row: online log-sum-exp (blocks of the row, so any vocabulary
              size runs in registers), the target logit and the row sum; writes loss_i and lse_i
              (as m_i and log l_i).
              A one-program kernel sums the rows in a fixed order (no atomics: bitwise repeatable).
    backward  one pass: reads x and the saved (m_i, log l_i), writes dx. The logits are read as
              they come (bf16 / fp16 / fp32), upcast in registers: no fp32 copy of them exists.
    memory    saves lse as its two parts (N x 2 fp32) beside the logits the caller holds: at
              logits far from 0 (m ~ 1e4, an fp32 ulp of 1e-3) m + log l rounded to one float
              would put its rounding into every p_ij of the backward.
    Why not dlogits in the forward (Liger's way): the forward would read each row twice and hold
    a logits-sized gradient until the backward, and the backward would still rescale it by the
    incoming gradient; the split moves 3 N C e bytes in all (read, read, write), the least
    possible with a separate backward, and keeps nothing logits-sized alive.

linear_cross_entropy(hidden (T, H), weight (V, H), target (T,), bias (V,)):
    loss of F.cross_entropy(F.linear(hidden, weight, bias), target) without the (T, V) logits.
    Tokens are walked in chunks of R rows; per chunk, on one (R, Vp) buffer:
        logits  = hidden_c @ weight.T (+ bias)           cuBLAS (torch.mm)
        the cross-entropy kernel turns the logits into loss_i and, in place, into dlogits
        dhidden_c = dlogits @ weight;  dweight += dlogits.T @ hidden_c;  dbias += sum_rows(dlogits)
    so the gradients are computed in the forward when autograd will want them (reductions "mean"
    and "sum": their incoming gradient is one scalar, applied in the backward by one scaling pass).
    With "none" every row has its own incoming gradient and dweight cannot be rescaled afterwards:
    the forward keeps lse only and the backward recomputes each chunk's logits (one matmul more).
    Without gradients (torch.no_grad, or no input requiring one) the kernel writes the loss alone:
    no dlogits, no gradient matmuls, no lse, no autograd node.
    Vocabulary padding: cuBLAS falls back to slow kernels when a dimension of a 16-bit matmul is
    not a multiple of 8 (50257). The weight is then copied once per call into a (Vp, H) buffer,
    Vp the next multiple of 64, with zero rows below; the kernel treats columns >= V as absent
    (-inf for the log-sum-exp, zero gradient). The copy costs one read and one write of the weight
    (206 MB of traffic for GPT-2's 50257 x 1024 in bf16: about 0.07 ms at 3 TB/s); under
    autocast it replaces the cast F.linear makes anyway. V a multiple of 8 is used as it is.
    Chunk size R: the chunk's logits may take 8 V H bytes (twice the fp32 weight gradient the
    caller holds anyway: 4096 rows for GPT-2 medium in bf16) and at most a quarter of the free
    device memory (CPU: CPU_CHUNK_BYTES); chunks are balanced. The keyword `chunk_size` overrides.
    memory    O(R Vp) for the logits buffer, plus dweight (Vp, H) and dhidden (T, H) in the compute
              dtype. dweight sums the chunks' products in the compute dtype (cuBLAS beta=1, fp32
              inside each product), except when an fp32 weight takes 16-bit matmuls (autocast):
              then dweight is fp32 and each chunk accumulates into it directly (cuBLAS with an
              fp32 C, out_dtype), so the sum is never rounded to 16 bits between chunks.
    dtypes    the matmuls run in the compute dtype: the autocast dtype under autocast, else the
              inputs' (which must then agree, as for F.linear). The loss is fp32 under autocast,
              else the compute dtype (F.cross_entropy(F.linear(...)) semantics); `out_dtype`
              overrides (HF's loss path upcasts: out_dtype=torch.float32).

Targets outside [0, C) other than ignore_index: on CPU a ValueError (the check is free there).
On CUDA checking would cost a host sync per call, so the kernels check on the device instead: such
a row's loss and gradient are NaN (never an out-of-bounds read, never a silently wrong value), and
so is a "mean" or "sum" over it.
"""
import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..autotune import dialects, pow2_bucket
from ._common import (
    acc_dtype,
    apply_function,
    check_float,
    check_same_device,
    check_tensor,
    ctx_as,
    eager_fast_path,
    empty_like,
    next_power_of_2,
    no_autocast,
    outside_device_modes,
    profiled,
    reference_grads,
    rows_2d,
    single_backward,
    use_triton,
)
from ._launch import CachedKernel

REDUCTIONS = ("mean", "sum", "none")
# Widest block of a row held in registers at once; longer rows are walked in blocks of this size.
MAX_BLOCK = 4096
# The vocabulary of the LM head is padded to a multiple of this when it is not a multiple of 8.
VOCAB_ALIGN = 64
# On CPU (no free-memory query) the logits chunk of linear_cross_entropy may take this much.
CPU_CHUNK_BYTES = 256 * 2**20


# =============================================================================================
# References: the spec. Tests run them in float64 as the oracle and in the input dtype to
# measure PyTorch's own error.
# =============================================================================================


def cross_entropy_ref(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """F.cross_entropy with class-index targets."""
    return torch.nn.functional.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    upcast: bool = False,
) -> torch.Tensor:
    """F.cross_entropy(F.linear(hidden, weight, bias)) over the flattened tokens; "none" gives
    target's shape. upcast=True runs the loss on `logits.float()`, as HF's loss path does."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.reshape(-1, logits.shape[-1])
    if upcast:
        logits = logits.float()
    loss = cross_entropy_ref(logits, target.reshape(-1), ignore_index, reduction, label_smoothing)
    return loss.reshape(target.shape) if reduction == "none" else loss


# =============================================================================================
# Kernels
# =============================================================================================


@triton.jit
def _row_lse(X, C, BLOCK_N: tl.constexpr, HAS_SMOOTHING: tl.constexpr, ACC: tl.constexpr):
    """(m, log l, m - mean x) of one row of C logits: its log-sum-exp is m + log l, m the row's
    max (0 for a row of -inf) and l = sum_j exp(x_j - m); m - mean x (what label smoothing
    needs) is 0 unless HAS_SMOOTHING. Kept apart, not added: at logits far from 0 (m ~ 1e4)
    m + log l rounds at m's scale, where PyTorch's log_softmax subtracts m first; the loss and
    the gradients do the same (the backward reads both, saved by the forward). The mean is
    summed as x - x_0 (x_0 the row's first logit, 0 if not finite) for the same reason: a sum
    of logits at 1e4 rounds at 1e-3 per 2 classes.

    Online and per lane: each lane keeps its running max m and sum s of exp(x - m); the lanes
    are merged once at the end. A lane that has seen only -inf keeps m = -inf, s = 0 (the
    subtraction uses 0 in place of an infinite max, so no inf - inf appears); +inf or NaN in
    the row make the result NaN, as PyTorch's log_softmax does."""
    offs = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_N], float("-inf"), ACC)
    s = tl.zeros([BLOCK_N], ACC)
    row_sum = tl.zeros([BLOCK_N], ACC)
    pivot = 0.0
    if HAS_SMOOTHING:
        pivot = tl.load(X, mask=C > 0, other=0.0).to(ACC)
        pivot = tl.where(tl.abs(pivot) < float("inf"), pivot, 0.0)
    for start in range(0, C, BLOCK_N):
        cols = start + offs
        mask = cols < C
        x = tl.load(X + cols, mask=mask, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
        if HAS_SMOOTHING:
            row_sum += tl.where(mask, x - pivot, 0.0)
    m_row = tl.max(m, axis=0)
    m_row = tl.where(m_row == float("-inf"), 0.0, m_row)
    gap = 0.0
    if HAS_SMOOTHING:
        gap = (m_row - pivot) - tl.sum(row_sum, axis=0) / C
    return m_row, tl.log(tl.sum(s * tl.exp(m - m_row), axis=0)), gap


@triton.jit
def _store_row_grad(X, DX, shift, log_norm, tgt, scale, C, C_STORE, eps,
                    BLOCK_N: tl.constexpr, HAS_SMOOTHING: tl.constexpr, ACC: tl.constexpr):
    """dx_j = scale (exp((x_j - shift) - log_norm) - (1 - eps) [j == tgt] - eps / C) for j < C,
    0 for C <= j < C_STORE (padding columns); shift + log_norm is the row's log-sum-exp (its m
    and log l, kept apart). DX may be X itself: each element is read before it is written, by
    the same program."""
    offs = tl.arange(0, BLOCK_N)
    for start in range(0, C_STORE, BLOCK_N):
        cols = start + offs
        mask = cols < C
        x = tl.load(X + cols, mask=mask, other=0.0).to(ACC)
        g = tl.exp((x - shift) - log_norm) - tl.where(cols == tgt, 1.0 - eps, 0.0)
        if HAS_SMOOTHING:
            g -= eps / C
        g = tl.where(mask, g * scale, 0.0)
        tl.store(DX + cols, g.to(DX.dtype.element_ty), mask=cols < C_STORE)


@triton.jit
def _store_zero_row(DX, C_STORE, BLOCK_N: tl.constexpr):
    offs = tl.arange(0, BLOCK_N)
    for start in range(0, C_STORE, BLOCK_N):
        cols = start + offs
        tl.store(DX + cols, tl.zeros([BLOCK_N], DX.dtype.element_ty), mask=cols < C_STORE)


@triton.jit
def _cross_entropy_fwd_kernel(
    X,  # in (M, >= C) logits, unit column stride
    TARGET,  # in (row0 + M,) integer class indices
    COUNT,  # in (1,) fp32 number of non-ignored rows; unused unless STORE_GRAD and IS_MEAN
    LOSS,  # out (row0 + M,) per-row loss (fp32, or the output dtype for "none")
    LSE,  # out (row0 + M, 2) fp32 each row's log-sum-exp as (m, log l); unused unless STORE_LSE
    DX,  # out (M, C_STORE) d loss / d x, may alias X; unused unless STORE_GRAD
    row0,  # the first row of X is row row0 of TARGET, LOSS and LSE (a chunk of the tokens)
    stride_xm, stride_dxm,
    C, C_STORE, ignore_index, eps,
    BLOCK_N: tl.constexpr, HAS_SMOOTHING: tl.constexpr, STORE_GRAD: tl.constexpr,
    STORE_LSE: tl.constexpr, IS_MEAN: tl.constexpr, ACC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31 at LM sizes
    X += row * stride_xm
    DX += row * stride_dxm
    out_row = row0 + row
    tgt = tl.load(TARGET + out_row).to(tl.int64)
    if tgt == ignore_index:
        # Ignored rows cost no read of the logits.
        tl.store(LOSS + out_row, 0.0)
        if STORE_LSE:
            tl.store(LSE + 2 * out_row + tl.arange(0, 2), tl.zeros([2], LSE.dtype.element_ty))
        if STORE_GRAD:
            _store_zero_row(DX, C_STORE, BLOCK_N)
    else:
        m, log_l, mean_gap = _row_lse(X, C, BLOCK_N, HAS_SMOOTHING, ACC)
        valid = (tgt >= 0) & (tgt < C)
        x_t = tl.load(X + tgt, mask=valid, other=0.0).to(ACC)
        # lse - x_t with m taken out first: exact where lse itself would round (_row_lse)
        if HAS_SMOOTHING:
            loss = log_l + (1.0 - eps) * (m - x_t) + eps * mean_gap
        else:
            loss = (m - x_t) + log_l
        # A target out of range (and not ignored) gives NaN: loud, and no out-of-bounds read.
        loss = tl.where(valid, loss, float("nan"))
        tl.store(LOSS + out_row, loss.to(LOSS.dtype.element_ty))
        if STORE_LSE:
            tl.store(LSE + 2 * out_row, m.to(LSE.dtype.element_ty))
            tl.store(LSE + 2 * out_row + 1, log_l.to(LSE.dtype.element_ty))
        if STORE_GRAD:
            scale = tl.where(valid, 1.0, float("nan")).to(ACC)
            if IS_MEAN:
                scale = scale / tl.maximum(tl.load(COUNT).to(ACC), 1.0)
            _store_row_grad(X, DX, m, log_l, tgt, scale, C, C_STORE, eps, BLOCK_N, HAS_SMOOTHING, ACC)


@triton.jit
def _cross_entropy_bwd_kernel(
    X,  # in (M, >= C) logits
    TARGET,  # in (row0 + M,)
    LSE,  # in (row0 + M, 2) fp32 (m, log l) saved by the forward
    DLOSS,  # in (row0 + M,) or (1,) incoming gradient (stride_dl 0 for a scalar)
    COUNT,  # in (1,) fp32 number of non-ignored rows; unused unless IS_MEAN
    DX,  # out (M, C_STORE), may alias X
    row0,  # the first row of X is row row0 of TARGET, LSE and DLOSS
    stride_xm, stride_dxm, stride_dl,
    C, C_STORE, ignore_index, eps,
    BLOCK_N: tl.constexpr, HAS_SMOOTHING: tl.constexpr, IS_MEAN: tl.constexpr, ACC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_xm
    DX += row * stride_dxm
    out_row = row0 + row
    tgt = tl.load(TARGET + out_row).to(tl.int64)
    if tgt == ignore_index:
        _store_zero_row(DX, C_STORE, BLOCK_N)
    else:
        valid = (tgt >= 0) & (tgt < C)
        scale = tl.load(DLOSS + out_row * stride_dl).to(ACC)
        if IS_MEAN:
            scale = scale / tl.maximum(tl.load(COUNT).to(ACC), 1.0)
        scale = tl.where(valid, scale, float("nan"))
        m = tl.load(LSE + 2 * out_row).to(ACC)
        log_l = tl.load(LSE + 2 * out_row + 1).to(ACC)
        _store_row_grad(X, DX, m, log_l, tgt, scale, C, C_STORE, eps, BLOCK_N, HAS_SMOOTHING, ACC)


@triton.jit
def _cross_entropy_reduce_kernel(
    LOSSES,  # in (M,) fp32 per-row losses; unused if COUNT_ONLY
    TARGET,  # in (M,)
    OUT,  # out (1,) the mean or the sum, in the output dtype; unused if COUNT_ONLY
    COUNT,  # out (1,) fp32 number of non-ignored rows
    M, ignore_index,
    BLOCK: tl.constexpr, IS_MEAN: tl.constexpr, COUNT_ONLY: tl.constexpr,
):
    """One program sums the rows in a fixed order: the same bits on every run. COUNT_ONLY
    counts the non-ignored rows alone (what the gradient of "mean" needs before the losses)."""
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], COUNT.dtype.element_ty)
    count = tl.zeros([BLOCK], COUNT.dtype.element_ty)
    for start in range(0, M, BLOCK):
        rows = start + offs
        mask = rows < M
        if not COUNT_ONLY:
            total += tl.load(LOSSES + rows, mask=mask, other=0.0)
        tgt = tl.load(TARGET + rows, mask=mask, other=0).to(tl.int64)
        count += tl.where(mask & (tgt != ignore_index), 1.0, 0.0)
    n = tl.sum(count, axis=0)
    if not COUNT_ONLY:
        loss = tl.sum(total, axis=0)
        if IS_MEAN:
            loss = loss / n
        tl.store(OUT, loss.to(OUT.dtype.element_ty))
    tl.store(COUNT, n)


@triton.jit
def _scale_cast_slot(X, G, Y, n, block, BLOCK: tl.constexpr, HAS_G: tl.constexpr, ACC: tl.constexpr):
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
    if HAS_G:
        y = y * tl.load(G).to(ACC)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _scale_cast_kernel(
    X0, Y0,  # in (n0,) contiguous; out (n0,) contiguous, any float dtype
    X1, Y1,  # in (n1,), out (n1,); unused when blocks1 == 0
    X2, Y2,  # in (n2,), out (n2,); unused when the grid has no blocks past blocks0 + blocks1
    G,  # in (1,) scalar factor; unused unless HAS_G
    n0, n1, n2, blocks0, blocks1,
    BLOCK: tl.constexpr, HAS_G: tl.constexpr, ACC: tl.constexpr,
):
    """y_k = x_k * g in ACC, rounded once to y_k's dtype, for up to three tensors in one launch:
    the first blocks0 programs take slot 0, the next blocks1 slot 1, the rest slot 2. One pass
    where (x * g).to(dtype) makes two, and one launch where three tensors would make three."""
    pid = tl.program_id(0)
    if pid < blocks0:
        _scale_cast_slot(X0, G, Y0, n0, pid, BLOCK, HAS_G, ACC)
    elif pid < blocks0 + blocks1:
        _scale_cast_slot(X1, G, Y1, n1, pid - blocks0, BLOCK, HAS_G, ACC)
    else:
        _scale_cast_slot(X2, G, Y2, n2, pid - blocks0 - blocks1, BLOCK, HAS_G, ACC)


# =============================================================================================
# Launchers: check nothing (except the free CPU target-range check), allocate the outputs,
# launch. Tensors in, tensors out.
# =============================================================================================


def _block_and_warps(n: int) -> tuple[int, int]:
    """A row kernel's block and warps: a fixed plan, not a tuned one (the other bandwidth-bound
    kernels' are, autotune/configs.py). The forward may write the gradient into the logits
    chunk in place, so a tuner's repeated launches would need a second chunk-sized buffer."""
    block = min(next_power_of_2(n), MAX_BLOCK)
    return block, min(max(block // 256, 1), 8)


def _acc_torch_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_target_range(op: str, target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """On CPU a bad target raises here (no sync to pay); on CUDA the kernels give NaN instead."""
    if target.is_cuda or target.numel() == 0:
        return
    t = target.to(torch.int64)
    bad = (t != ignore_index) & ((t < 0) | (t >= n_classes))
    if bool(bad.any()):
        value = int(t[bad][0])
        raise ValueError(
            f"trifuse.{op}: target must hold class indices in [0, {n_classes}) or "
            f"ignore_index={ignore_index}, got {value}"
        )


# Thin launch path: Triton's own costs ~60 µs of host time per launch (_launch.py). Every launch
# below goes through these; the launchers also keep their own torch ops few (each costs a few µs
# of host time on a GPU): no views where a kernel argument does (row0), no zero-fills a first
# matmul can replace.
_cross_entropy_fwd = CachedKernel(_cross_entropy_fwd_kernel)
_cross_entropy_bwd = CachedKernel(_cross_entropy_bwd_kernel)
_cross_entropy_reduce = CachedKernel(_cross_entropy_reduce_kernel)
_scale_cast = CachedKernel(_scale_cast_kernel)
SCALE_CAST_BLOCK = 4096


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous 1-D tensor; t itself (no view op) when it already is one."""
    return t if t.dim() == 1 and t.is_contiguous() else t.reshape(-1).contiguous()


def _logit_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (N, n) with unit column stride: x itself when it has one (no view op), else rows_2d."""
    return x if x.dim() == 2 and (n <= 1 or x.stride(1) == 1) else rows_2d(x, n)


def _rows_fwd(x2, target, n_cols, ignore_index, label_smoothing, loss, lse=None, count=None, dx=None,
              is_mean=False, row0=0):
    """Per-row loss of x2 (M, >= n_cols) into loss[row0 : row0 + M], the targets being
    target[row0 : row0 + M]; and lse's (m, log l) there too unless lse is None. With `dx`
    (M, >= n_cols) also d(loss_i)/dx (divided by max(count, 1) when is_mean), which may be x2 itself."""
    m = x2.shape[0]
    if m == 0:
        return
    if not use_triton(x2):
        rows = slice(row0, row0 + m)
        _rows_fwd_torch(x2, target[rows], n_cols, ignore_index, label_smoothing, loss[rows],
                        None if lse is None else lse[rows], count, dx, is_mean)
        return
    store_grad = dx is not None
    c_store = dx.shape[1] if store_grad else n_cols
    block, num_warps = _block_and_warps(c_store)
    # Unused pointers get a tensor of the right kind: the kernel never reads or writes them.
    _cross_entropy_fwd[(m,)](
        x2, target, count if store_grad and is_mean else loss, loss, loss if lse is None else lse,
        dx if store_grad else x2, row0, x2.stride(0), dx.stride(0) if store_grad else 0,
        n_cols, c_store, ignore_index, label_smoothing,
        BLOCK_N=block, HAS_SMOOTHING=label_smoothing > 0.0, STORE_GRAD=store_grad,
        STORE_LSE=lse is not None, IS_MEAN=is_mean, ACC=acc_dtype(x2.dtype), num_warps=num_warps,
    )


def _rows_bwd(x2, target, lse, dloss, count, n_cols, ignore_index, label_smoothing, dx, is_mean, row0=0):
    """dx (M, >= n_cols) = dloss_i (/ max(count, 1)) * d(loss_i)/dx for the rows row0 .. row0 + M
    of target, lse and dloss (1-D, or one element for a scalar); dx may be x2 itself."""
    m = x2.shape[0]
    if m == 0:
        return
    scalar = dloss.numel() == 1
    if not use_triton(x2):
        rows = slice(row0, row0 + m)
        _rows_bwd_torch(x2, target[rows], lse[rows], dloss if scalar else dloss[rows], count, n_cols,
                        ignore_index, label_smoothing, dx, is_mean)
        return
    block, num_warps = _block_and_warps(dx.shape[1])
    _cross_entropy_bwd[(m,)](
        x2, target, lse, dloss, count if is_mean else lse, dx,
        row0, x2.stride(0), dx.stride(0), 0 if scalar else dloss.stride(0),
        n_cols, dx.shape[1], ignore_index, label_smoothing,
        BLOCK_N=block, HAS_SMOOTHING=label_smoothing > 0.0, IS_MEAN=is_mean,
        ACC=acc_dtype(x2.dtype), num_warps=num_warps,
    )


def _reduce_block(m: int) -> int:
    return min(next_power_of_2(m), 4096)


def count_rows(target: torch.Tensor, ignore_index: int, acc: torch.dtype) -> torch.Tensor:
    """The number of non-ignored rows of target (1-D), a 0-dim tensor in `acc`: one launch."""
    count = torch.empty((), dtype=acc, device=target.device)
    if not use_triton(target):
        count.copy_((target != ignore_index).sum())
        return count
    _cross_entropy_reduce[(1,)](
        target, target, count, count, target.shape[0], ignore_index,
        BLOCK=_reduce_block(target.shape[0]), IS_MEAN=False, COUNT_ONLY=True, num_warps=4,
    )
    return count


def _reduce(losses, target, ignore_index, reduction, out_dtype, count=None):
    """(loss, count): the mean or sum of the per-row losses in out_dtype, and the number of
    non-ignored rows (0-dim, fp32 or fp64), written into `count` when given."""
    acc = losses.dtype
    out = torch.empty((), dtype=out_dtype, device=losses.device)
    if count is None:
        count = torch.empty((), dtype=acc, device=losses.device)
    if not use_triton(losses):
        count.copy_((target != ignore_index).sum())
        total = losses.sum()
        out.copy_(total / count if reduction == "mean" else total)
        return out, count
    _cross_entropy_reduce[(1,)](
        losses, target, out, count, losses.shape[0], ignore_index,
        BLOCK=_reduce_block(losses.shape[0]), IS_MEAN=reduction == "mean", COUNT_ONLY=False, num_warps=4,
    )
    return out, count


def scale_cast(pairs: list[tuple[torch.Tensor, torch.Tensor]], g: torch.Tensor | None) -> None:
    """y = x * g for each (x, y) of at most three pairs, in one launch: x contiguous, of which the
    first y.numel() elements are read in y's (contiguous) order; g a 0-dim tensor, or None for 1.
    Computed in fp32 (fp64 when an fp64 tensor takes part) and rounded once to y's dtype."""
    pairs = [(x, y) for x, y in pairs if y.numel() > 0]
    if not pairs:
        return
    wide = any(t.dtype == torch.float64 for pair in pairs for t in pair)
    if not use_triton(pairs[0][0]):
        acc = torch.float64 if wide else torch.float32
        for x, y in pairs:
            x = x.reshape(-1)[: y.numel()].view(y.shape)
            y.copy_(x.to(acc) * g.to(acc) if g is not None else x)
        return
    blocks = [-(-y.numel() // SCALE_CAST_BLOCK) for _, y in pairs]
    slots = pairs + [pairs[0]] * (3 - len(pairs))  # unused slots: no program reaches them
    (x0, y0), (x1, y1), (x2, y2) = slots
    _scale_cast[(sum(blocks),)](
        x0, y0, x1, y1, x2, y2, g if g is not None else x0, y0.numel(), y1.numel(), y2.numel(),
        blocks[0], blocks[1] if len(blocks) > 1 else 0,
        BLOCK=SCALE_CAST_BLOCK, HAS_G=g is not None, ACC=tl.float64 if wide else tl.float32, num_warps=8,
    )


def cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    out_dtype: torch.dtype,
    store_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits (N, C), target (N,). Returns (loss, lse, count): loss () or (N,) in out_dtype,
    lse (N, 2) (each row's max m and log l, lse = m + log l) and count () in fp32 (fp64 for
    fp64 logits); count is the number of non-ignored
    rows for "mean" and "sum" (the backward of "mean" divides by it), None for "none" (nothing
    needs it); lse is None unless store_lse (the backward needs it, the loss alone does not)."""
    n, c = logits.shape
    _check_target_range("cross_entropy", target, c, ignore_index)
    acc = _acc_torch_dtype(logits.dtype)
    x2 = _logit_rows(logits, c) if c > 0 else logits
    target = _flat(target)
    lse = torch.empty((n, 2), dtype=acc, device=logits.device) if store_lse else None
    if reduction == "none":
        loss = torch.empty(n, dtype=out_dtype, device=logits.device)
        _rows_fwd(x2, target, c, ignore_index, label_smoothing, loss, lse)
        return loss, lse, None
    losses = torch.empty(n, dtype=acc, device=logits.device)
    _rows_fwd(x2, target, c, ignore_index, label_smoothing, losses, lse)
    loss, count = _reduce(losses, target, ignore_index, reduction, out_dtype)
    return loss, lse, count


def cross_entropy_bwd(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    count: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
) -> torch.Tensor:
    """d loss / d logits, (N, C) in the logits' dtype. count is needed for "mean" only."""
    n, c = logits.shape
    dx = torch.empty((n, c), dtype=logits.dtype, device=logits.device)
    if c == 0:
        return dx
    _rows_bwd(_logit_rows(logits, c), _flat(target), lse, dloss if dloss.dim() <= 1 else dloss.reshape(-1),
              count, c, ignore_index, label_smoothing, dx, reduction == "mean")
    return dx


# ---------------------------------------------------------------------------------------------
# The LM head: linear + cross-entropy, chunked over tokens
# ---------------------------------------------------------------------------------------------


def padded_vocab(v: int) -> int:
    """Rows of the weight buffer the matmuls see: V itself when it is a multiple of 8 (cuBLAS's
    fast 16-bit kernels need that), else the next multiple of VOCAB_ALIGN."""
    return v if v % 8 == 0 else -(-v // VOCAB_ALIGN) * VOCAB_ALIGN


def chunk_budget(vocab_padded: int, hidden: int, device: torch.device) -> int:
    """The bytes one chunk's logits may take: 8 V H, twice the fp32 weight gradient the caller
    holds anyway, and at most a quarter of the free device memory (CPU: CPU_CHUNK_BYTES)."""
    budget = 8 * vocab_padded * hidden
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(budget, free // 4)
    return min(budget, CPU_CHUNK_BYTES)


# Cached per problem: a training loop asks the same question every step, and the free-memory
# query behind the answer costs a driver call (and reflects the first step's free memory,
# which is the one that matters: later steps reuse the allocator's blocks).
@functools.lru_cache(maxsize=256)
def chunk_rows(tokens: int, vocab_padded: int, hidden: int, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens per chunk. The chunk's logits (rows x vocab_padded in `dtype`) may take 8 V H
    bytes, twice the fp32 weight gradient the caller holds anyway, and at most a quarter of the
    free device memory (CPU: CPU_CHUNK_BYTES). Chunks are then balanced, in multiples of 128 rows
    (a tensor-core tile) when they are that large."""
    row_bytes = max(vocab_padded * torch.finfo(dtype).bits // 8, 1)
    rows = max(chunk_budget(vocab_padded, hidden, device) // row_bytes, 1)
    if rows >= tokens:
        return max(tokens, 1)
    chunks = -(-tokens // rows)
    rows = -(-tokens // chunks)
    return -(-rows // 128) * 128 if rows >= 128 else rows


def _pad_rows(t: torch.Tensor | None, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
    """t with its first dim padded by zeros to `rows`, in `dtype`; t itself when nothing changes."""
    if t is None or (t.shape[0] == rows and t.dtype == dtype):
        return t
    if t.dtype == dtype:
        # Two ops where empty + copy + zero-fill of two slices take five; the same traffic.
        return torch.cat((t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))))
    out = torch.empty((rows, *t.shape[1:]), dtype=dtype, device=t.device)
    out[: t.shape[0]].copy_(t)
    out[t.shape[0]:].zero_()
    return out


def _head_operands(hidden, weight, bias, compute_dtype):
    h = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
    if h.dtype != compute_dtype:
        h = h.to(compute_dtype)
    vp = padded_vocab(weight.shape[0])
    return h, _pad_rows(weight, vp, compute_dtype), _pad_rows(bias, vp, compute_dtype), vp


def _dweight_dtype(weight_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """dweight's accumulator: fp32 when 16-bit matmuls feed an fp32 weight (autocast with fp32
    master weights), so the chunks' sum is not rounded to 16 bits once per chunk; else the
    compute dtype."""
    if compute_dtype in (torch.float16, torch.bfloat16) and weight_dtype in (torch.float32, torch.float64):
        return torch.float32
    return compute_dtype


def _accumulate(dw: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dw + a @ b in `dtype` (a fresh a @ b when dw is None), accumulated in place. For 16-bit a, b
    and an fp32 dw: on CUDA one cuBLAS call with an fp32 C (beta=1), nothing rounded to 16 bits;
    elsewhere the product is rounded once, then added in fp32."""
    if dtype == a.dtype:
        return torch.mm(a, b) if dw is None else dw.addmm_(a, b)
    if a.is_cuda:
        try:
            if dw is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            return torch.addmm(dw, a, b, out_dtype=torch.float32, out=dw)
        except (TypeError, RuntimeError):  # a torch or GPU without the out_dtype matmuls
            pass
    prod = torch.mm(a, b)
    return prod.to(dtype) if dw is None else dw.add_(prod)


def _head_pass(h, w, b, rows, grads, dw_dtype, acc, chunk_kernel):
    """The chunk loop both directions share, over h (T, H) and the padded w (Vp, H), b (Vp,).
    Per chunk of `rows` tokens: its logits (R, Vp) into one reused buffer; chunk_kernel(logits,
    row0) turns them into the loss or, in place, into dlogits; then, for each gradient `grads`
    asks for: dhidden_c = dlogits @ W, dW (+)= dlogits.T @ h_c, db (+)= sum_rows(dlogits).
    Returns (dh (T, H), dw (Vp, H) in dw_dtype, db (Vp,) in acc), None where not asked for.
    The first chunk's products are fresh tensors (no zero-fill); one chunk slices nothing."""
    tokens = h.shape[0]
    wt = w.t()
    dh = dw = db = None
    if grads[0] and rows < tokens:
        dh = empty_like(h)
    buf = torch.empty((min(rows, tokens), w.shape[0]), dtype=h.dtype, device=h.device)
    for start in range(0, tokens, rows):
        end = min(start + rows, tokens)
        logits = buf if end - start == buf.shape[0] else buf[: end - start]
        h_c = h if end - start == tokens else h[start:end]
        if b is None:
            torch.mm(h_c, wt, out=logits)
        else:
            torch.addmm(b, h_c, wt, out=logits)
        chunk_kernel(logits, start)
        if grads[0]:
            if dh is None:
                dh = torch.mm(logits, w)
            else:
                torch.mm(logits, w, out=dh[start:end])
        if grads[1]:
            dw = _accumulate(dw, logits.t(), h_c, dw_dtype)
        if grads[2]:
            part = logits.sum(dim=0, dtype=acc)
            db = part if db is None else db.add_(part)
    return dh, dw, db


def _empty_head_grads(h, vp, grads, dw_dtype, acc):
    """What _head_pass gives for no tokens: an empty dhidden, zero dweight and dbias."""
    return (h.new_empty(h.shape) if grads[0] else None,
            h.new_zeros((vp, h.shape[1]), dtype=dw_dtype) if grads[1] else None,
            h.new_zeros(vp, dtype=acc) if grads[2] else None)


def linear_cross_entropy_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    chunk_size: int | None,
    grads: tuple[bool, bool, bool],
    store_lse: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """hidden (..., H), weight (V, H), target (...), bias (V,). Returns (loss, lse, count,
    dhidden, dweight, dbias); lse and count as cross_entropy_fwd's, over the tokens (lse None
    unless store_lse, count None for "none"). The three gradients are d loss / d input for an
    incoming gradient of 1, computed here when `grads` asks for them and reduction is "mean" or
    "sum" (else None): dhidden (..., H), dweight (Vp, H) and dbias (Vp,) with Vp =
    padded_vocab(V), dhidden in the compute dtype, dweight in _dweight_dtype, dbias fp32. With no
    gradient asked for, the kernel computes the loss alone (no dlogits written)."""
    v, hidden_size = weight.shape
    _check_target_range("linear_cross_entropy", target, v, ignore_index)
    device = hidden.device
    acc = _acc_torch_dtype(compute_dtype)
    t = _flat(target)
    tokens = t.shape[0]
    precompute = reduction != "none" and any(grads)
    grads = grads if precompute else (False, False, False)
    is_mean = reduction == "mean"
    with no_autocast(device):
        h, w, b, vp = _head_operands(hidden, weight, bias, compute_dtype)
        dw_dtype = _dweight_dtype(weight.dtype, compute_dtype)
        losses = torch.empty(tokens, dtype=acc if reduction != "none" else out_dtype, device=device)
        lse = torch.empty((tokens, 2), dtype=acc, device=device) if store_lse else None
        # "mean" scales dlogits by 1 / count inside the kernel, so the count comes first.
        count = count_rows(t, ignore_index, acc) if precompute and is_mean else None

        def chunk_kernel(logits, row0):
            _rows_fwd(logits, t, v, ignore_index, label_smoothing, losses, lse, count,
                      logits if precompute else None, is_mean, row0)

        if tokens > 0:
            rows = chunk_size or chunk_rows(tokens, vp, hidden_size, compute_dtype, device)
            dh, dw, db = _head_pass(h, w, b, rows, grads, dw_dtype, acc, chunk_kernel)
        else:
            dh, dw, db = _empty_head_grads(h, vp, grads, dw_dtype, acc)
        if reduction == "none":
            loss = losses if target.dim() == 1 else losses.view(target.shape)
        else:
            loss, count = _reduce(losses, t, ignore_index, reduction, out_dtype, count)
    if dh is not None and hidden.dim() != 2:
        dh = dh.view(hidden.shape)
    return loss, lse, count, dh, dw, db


def precomputed_grads_usable(reduction, hidden_shape, dhidden, dweight, dbias, grads) -> bool:
    """Whether the forward computed every gradient asked for now (reduction "mean" / "sum")."""
    return (reduction != "none"
            and (not grads[0] or tuple(dhidden.shape) == tuple(hidden_shape))
            and (not grads[1] or dweight.dim() == 2)
            and (not grads[2] or dbias.numel() > 0))


def _head_grads_out(
    dloss: torch.Tensor | None,
    dhidden: torch.Tensor | None,
    dweight: torch.Tensor | None,
    dbias: torch.Tensor | None,
    vocab: int,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype | None],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dhidden, dweight[:vocab] and dbias[:vocab] times dloss (None: times 1), in `dtypes`: one
    launch for all three. Without dloss, a gradient already in its dtype and shape is returned
    as it is (no copy)."""
    outs, pairs = [], []
    for x, dtype in zip((dhidden, dweight, dbias), dtypes):
        if x is None:
            outs.append(None)
            continue
        shape = x.shape if x is dhidden else (vocab, *x.shape[1:])
        if dloss is None and x.dtype == dtype and x.shape[0] == shape[0]:
            outs.append(x)
            continue
        y = torch.empty(shape, dtype=dtype, device=x.device)
        outs.append(y)
        pairs.append((x, y))
    scale_cast(pairs, dloss)
    return tuple(outs)


def scale_head_grads(
    dloss: torch.Tensor,
    dhidden: torch.Tensor,
    dweight: torch.Tensor,
    dbias: torch.Tensor,
    vocab: int,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype | None],
    grads: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The forward's gradients times the incoming scalar gradient, one pass over each and one
    launch for all, in the inputs' dtypes (hidden, weight, bias); None where not asked for."""
    return _head_grads_out(dloss if dloss.dim() == 0 else dloss.reshape(()),
                           dhidden if grads[0] else None, dweight if grads[1] else None,
                           dbias if grads[2] else None, vocab, dtypes)


def recompute_head_grads(
    dloss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    count: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    compute_dtype: torch.dtype,
    chunk_size: int | None,
    grads: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The backward for any reduction ("none" needs it): per chunk, the logits again, turned into
    dlogits in place with the saved lse and each row's incoming gradient, then the two matmuls.
    count is needed for "mean" only. Returns gradients in the inputs' dtypes; None where not
    asked for."""
    v = weight.shape[0]
    device = hidden.device
    acc = _acc_torch_dtype(compute_dtype)
    t = _flat(target)
    tokens = t.shape[0]
    is_mean = reduction == "mean"
    dl = dloss if dloss.dim() <= 1 else dloss.reshape(-1)
    with no_autocast(device):
        h, w, b, vp = _head_operands(hidden, weight, bias, compute_dtype)
        dw_dtype = _dweight_dtype(weight.dtype, compute_dtype)

        def chunk_kernel(logits, row0):
            _rows_bwd(logits, t, lse, dl, count, v, ignore_index, label_smoothing, logits, is_mean, row0)

        if tokens > 0:
            rows = chunk_size or chunk_rows(tokens, vp, h.shape[1], compute_dtype, device)
            dh, dw, db = _head_pass(h, w, b, rows, grads, dw_dtype, acc, chunk_kernel)
        else:
            dh, dw, db = _empty_head_grads(h, vp, grads, dw_dtype, acc)
    if dh is not None and hidden.dim() != 2:
        dh = dh.view(hidden.shape)
    return _head_grads_out(None, dh, dw, db, v, (hidden.dtype, weight.dtype, None if bias is None else bias.dtype))


# ---------------------------------------------------------------------------------------------
# PyTorch path for CPU tensors without the interpreter: the kernels' maths, same outputs.
# ---------------------------------------------------------------------------------------------


def _rows_fwd_torch(x2, target, n_cols, ignore_index, label_smoothing, loss, lse, count, dx, is_mean):
    acc = _acc_torch_dtype(x2.dtype)
    x = x2[:, :n_cols].to(acc)
    t = target.to(torch.int64)
    ignored = t == ignore_index
    valid = (t >= 0) & (t < n_cols)
    # -log p from log_softmax (the max taken out first), as the kernel computes lse - x_t
    logp = torch.log_softmax(x, dim=1)
    row = -(1.0 - label_smoothing) * logp.gather(1, t.clamp(0, max(n_cols - 1, 0))[:, None])[:, 0]
    if label_smoothing > 0.0:
        row = row - label_smoothing / n_cols * logp.sum(dim=1)
    row = torch.where(valid, row, float("nan"))
    loss.copy_(torch.where(ignored, 0.0, row))
    if lse is not None:  # (m, log l) as the kernel keeps them: 0 for a row of -inf, or ignored
        m = x.amax(dim=1) if n_cols > 0 else x.new_zeros(x.shape[0])
        m = torch.where(ignored | (m == float("-inf")), 0.0, m)
        log_l = torch.exp(x - m[:, None]).sum(dim=1).log()
        lse.copy_(torch.stack((m, torch.where(ignored, 0.0, log_l)), dim=1))
    if dx is not None:
        ones = torch.ones((), dtype=acc, device=x2.device)
        _grad_torch(logp.exp(), t, ones, count, n_cols, ignore_index, label_smoothing, dx, is_mean)


def _rows_bwd_torch(x2, target, lse, dloss, count, n_cols, ignore_index, label_smoothing, dx, is_mean):
    p = torch.exp((x2[:, :n_cols].to(lse.dtype) - lse[:, :1]) - lse[:, 1:])
    _grad_torch(p, target.to(torch.int64), dloss, count, n_cols, ignore_index, label_smoothing, dx, is_mean)


def _grad_torch(p, t, dloss, count, n_cols, ignore_index, label_smoothing, dx, is_mean):
    """dx from the probabilities p (the forward's softmax, or the backward's from lse): a
    fresh tensor of the callers', turned into dx in place."""
    scale = dloss.reshape(-1).to(p.dtype).expand(t.shape[0])
    if is_mean:
        scale = scale / count.clamp_min(1)
    valid = (t >= 0) & (t < n_cols)
    scale = torch.where(valid, scale, float("nan"))
    g = p
    g[torch.arange(t.shape[0], device=p.device)[valid], t[valid]] -= 1.0 - label_smoothing
    g = (g - label_smoothing / n_cols) * scale[:, None]
    g = torch.where((t == ignore_index)[:, None], 0.0, g)
    dx[:, :n_cols].copy_(g)
    dx[:, n_cols:].zero_()


# =============================================================================================
# Checks, shared by the registered ops (real and fake) and the eager paths
# =============================================================================================


def _check_options(op, ignore_index, reduction, label_smoothing):
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"trifuse.{op}: ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"trifuse.{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"trifuse.{op}: label_smoothing must be in [0, 1], got {label_smoothing!r}")


def _check_target(op, target, expected_shape):
    check_tensor(op, "target", target)
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"trifuse.{op}: target must hold integer class indices (int64, int32, ...), got "
            f"{target.dtype}; class-probability targets are not supported"
        )
    if tuple(target.shape) != tuple(expected_shape):
        raise ValueError(f"trifuse.{op}: target must have shape {tuple(expected_shape)}, got {tuple(target.shape)}")


def _check_ce_inputs(logits, target, ignore_index, reduction, label_smoothing):
    """The registered op's contract: logits (N, C), target (N,)."""
    op = "cross_entropy"
    check_tensor(op, "input", logits)
    check_float(op, "input", logits)
    if logits.dim() != 2:
        raise ValueError(f"trifuse.{op}: input must be (N, C), got shape {tuple(logits.shape)}")
    _check_target(op, target, logits.shape[:1])
    if logits.shape[1] == 0 and logits.shape[0] > 0:
        raise ValueError(f"trifuse.{op}: input has no classes (shape {tuple(logits.shape)})")
    check_same_device(op, "input", logits, target=target)
    _check_options(op, ignore_index, reduction, label_smoothing)


def _check_lce_inputs(hidden, weight, target, bias, ignore_index, reduction, label_smoothing,
                      compute_dtype, chunk_size):
    op = "linear_cross_entropy"
    for name, t in (("hidden", hidden), ("weight", weight)):
        check_tensor(op, name, t)
        check_float(op, name, t)
    if hidden.dim() < 1:
        raise ValueError(f"trifuse.{op}: hidden must be (..., H), got a 0-dim tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"trifuse.{op}: weight must have shape (V, {hidden.shape[-1]}) for hidden of shape "
            f"{tuple(hidden.shape)}, got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"trifuse.{op}: weight has no rows (vocabulary of size 0)")
    _check_target(op, target, hidden.shape[:-1])
    if bias is not None:
        check_tensor(op, "bias", bias)
        check_float(op, "bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"trifuse.{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_same_device(op, "hidden", hidden, weight=weight, target=target, bias=bias)
    _check_options(op, ignore_index, reduction, label_smoothing)
    if compute_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"trifuse.{op}: compute dtype must be a float dtype, got {compute_dtype}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"trifuse.{op}: chunk_size must be a positive int or None, got {chunk_size!r}")


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    if device.type in ("cuda", "cpu") and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _ce_out_dtype(logits: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """F.cross_entropy's: the logits' dtype, fp32 under autocast (log_softmax autocasts to fp32)."""
    if out_dtype is not None:
        return out_dtype
    if logits.dtype != torch.float64 and _autocast_dtype(logits.device) is not None:
        return torch.float32
    return logits.dtype


def _lce_dtypes(hidden, weight, bias, out_dtype):
    """(compute dtype, loss dtype) as F.cross_entropy(F.linear(hidden, weight, bias)) has them."""
    autocast = _autocast_dtype(hidden.device)
    eligible = all(t is None or t.dtype in (torch.float16, torch.bfloat16, torch.float32)
                   for t in (hidden, weight, bias))
    if autocast is not None and eligible:
        return autocast, out_dtype or torch.float32
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(
                f"trifuse.linear_cross_entropy: {name} has dtype {t.dtype} but hidden has "
                f"{hidden.dtype}; outside autocast they must agree (as for F.linear)"
            )
    return hidden.dtype, out_dtype or hidden.dtype


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see. Each forward op returns its
# outputs plus what its backward needs; the backward op is registered beside it.
# =============================================================================================

Tensor = torch.Tensor
OptTensor = torch.Tensor | None


@torch.library.custom_op("trifuse::cross_entropy", mutates_args=())
def _cross_entropy_op(logits: Tensor, target: Tensor, ignore_index: int, reduction: str,
                      label_smoothing: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, lse, count) for logits (N, C) and target (N,)."""
    _check_ce_inputs(logits, target, ignore_index, reduction, label_smoothing)
    loss, lse, count = cross_entropy_fwd(logits, target, ignore_index, reduction, label_smoothing, out_dtype)
    if count is None:  # "none": the row count, as the op's signature promises
        count = torch.full((), logits.shape[0], dtype=lse.dtype, device=logits.device)
    return loss, lse, count


@torch.library.custom_op("trifuse::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward_op(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Tensor,
                               ignore_index: int, reduction: str, label_smoothing: float) -> Tensor:
    return cross_entropy_bwd(dloss, logits, target, lse, count, ignore_index, reduction, label_smoothing)


@torch.library.custom_op("trifuse::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: OptTensor, ignore_index: int, reduction: str,
    label_smoothing: float, compute_dtype: torch.dtype, out_dtype: torch.dtype, chunk_size: int | None,
    grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, count, dhidden, dweight, dbias); see linear_cross_entropy_fwd."""
    _check_lce_inputs(hidden, weight, target, bias, ignore_index, reduction, label_smoothing,
                      compute_dtype, chunk_size)
    loss, lse, count, dh, dw, db = linear_cross_entropy_fwd(
        hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype, out_dtype,
        chunk_size, (grad_hidden, grad_weight, grad_bias))
    # Outputs the launcher leaves out: empty tensors, each its own (outputs may not alias).
    acc = lse.dtype
    if count is None:
        count = torch.full((), lse.shape[0], dtype=acc, device=hidden.device)
    return (loss, lse, count, dh if dh is not None else hidden.new_empty(0, dtype=compute_dtype),
            dw if dw is not None else hidden.new_empty(0, dtype=_dweight_dtype(weight.dtype, compute_dtype)),
            db if db is not None else hidden.new_empty(0, dtype=acc))


@torch.library.custom_op("trifuse::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward_op(
    dloss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: OptTensor, lse: Tensor,
    count: Tensor, dhidden: Tensor, dweight: Tensor, dbias: Tensor, ignore_index: int, reduction: str,
    label_smoothing: float, compute_dtype: torch.dtype, chunk_size: int | None,
    grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dhidden, dweight, dbias), each empty unless asked for: the forward's gradients scaled
    when it computed them all, else recomputed chunk by chunk."""
    grads = (grad_hidden, grad_weight, grad_bias and bias is not None)
    if precomputed_grads_usable(reduction, hidden.shape, dhidden, dweight, dbias, grads):
        out = scale_head_grads(dloss, dhidden, dweight, dbias, weight.shape[0],
                               (hidden.dtype, weight.dtype, None if bias is None else bias.dtype), grads)
    else:
        out = recompute_head_grads(dloss, hidden, weight, target, bias, lse, count, ignore_index, reduction,
                                   label_smoothing, compute_dtype, chunk_size, grads)
    like = (hidden, weight, weight if bias is None else bias)
    return tuple(o if o is not None else t.new_empty(0) for o, t in zip(out, like))


@_cross_entropy_op.register_fake
def _(logits, target, ignore_index, reduction, label_smoothing, out_dtype):
    _check_ce_inputs(logits, target, ignore_index, reduction, label_smoothing)
    n = logits.shape[0]
    acc = _acc_torch_dtype(logits.dtype)
    loss = logits.new_empty((n,) if reduction == "none" else (), dtype=out_dtype)
    return loss, logits.new_empty((n, 2), dtype=acc), logits.new_empty((), dtype=acc)


@_cross_entropy_backward_op.register_fake
def _(dloss, logits, target, lse, count, ignore_index, reduction, label_smoothing):
    return logits.new_empty(logits.shape)


@_linear_cross_entropy_op.register_fake
def _(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype, out_dtype,
      chunk_size, grad_hidden, grad_weight, grad_bias):
    _check_lce_inputs(hidden, weight, target, bias, ignore_index, reduction, label_smoothing,
                      compute_dtype, chunk_size)
    acc = _acc_torch_dtype(compute_dtype)
    tokens = math.prod(target.shape)
    precompute = reduction != "none" and (grad_hidden or grad_weight or grad_bias)
    vp = padded_vocab(weight.shape[0])
    loss = hidden.new_empty(target.shape if reduction == "none" else (), dtype=out_dtype)
    dh = hidden.new_empty(hidden.shape if precompute and grad_hidden else (0,), dtype=compute_dtype)
    dw = hidden.new_empty((vp, weight.shape[1]) if precompute and grad_weight else (0,),
                          dtype=_dweight_dtype(weight.dtype, compute_dtype))
    with_bias = precompute and grad_bias and bias is not None
    db = hidden.new_empty((vp,) if with_bias else (0,), dtype=acc)
    return loss, hidden.new_empty((tokens, 2), dtype=acc), hidden.new_empty((), dtype=acc), dh, dw, db


@_linear_cross_entropy_backward_op.register_fake
def _(dloss, hidden, weight, target, bias, lse, count, dhidden, dweight, dbias, ignore_index, reduction,
      label_smoothing, compute_dtype, chunk_size, grad_hidden, grad_weight, grad_bias):
    # contiguous whatever the inputs' strides, as the chunk loop's products are
    dh = hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0)
    dw = weight.new_empty(weight.shape) if grad_weight else weight.new_empty(0)
    if bias is None:
        db = weight.new_empty(0)
    else:
        db = bias.new_empty(bias.shape) if grad_bias else bias.new_empty(0)
    return dh, dw, db


# Autograd for the registered ops.


def _setup_cross_entropy(ctx, inputs, output):
    # Unused outputs (lse, count) and an unused loss get no zero-filled gradient.
    ctx.set_materialize_grads(False)
    logits, target, ignore_index, reduction, label_smoothing, _ = inputs
    _, lse, count = output
    ctx.save_for_backward(logits, target, lse, count)
    ctx.options = (ignore_index, reduction, label_smoothing)


# Differentiable again under create_graph=True by the eager path's formula (defined below with it).
@single_backward(twice=lambda ctx, dloss, *_: _cross_entropy_twice(ctx, dloss), op="cross_entropy")
def _backward_cross_entropy(ctx, dloss, *_):
    if dloss is None:
        return None, None, None, None, None, None
    logits, target, lse, count = ctx.saved_tensors
    dx = torch.ops.trifuse.cross_entropy_backward(dloss, logits, target, lse, count, *ctx.options)
    return dx, None, None, None, None, None


def _setup_linear_cross_entropy(ctx, inputs, output):
    # Five outputs are never differentiated (lse, count and the gradients, as large as the
    # weight): materialized, each would get a zero-filled gradient in every backward.
    ctx.set_materialize_grads(False)
    hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype, _, chunk_size = inputs[:10]
    _, lse, count, dh, dw, db = output
    ctx.save_for_backward(hidden, weight, target, bias, lse, count, dh, dw, db)
    ctx.options = (ignore_index, reduction, label_smoothing, compute_dtype, chunk_size)


def _registered_linear_twice(ctx, dloss, *_):
    """_linear_cross_entropy_twice for the registered op: three more inputs (which gradients the
    forward computes), no `grads` among the options."""
    view = ctx_as(ctx, ctx.needs_input_grad, options=(*ctx.options, None))
    grads = _linear_cross_entropy_twice(view, dloss)
    return None if grads is None else (*grads, None, None, None)


@single_backward(twice=_registered_linear_twice, op="linear_cross_entropy")
def _backward_linear_cross_entropy(ctx, dloss, *_):
    if dloss is None:
        return (None,) * 13
    hidden, weight, target, bias, lse, count, dh, dw, db = ctx.saved_tensors
    needs = ctx.needs_input_grad
    ignore_index, reduction, label_smoothing, compute_dtype, chunk_size = ctx.options
    gh, gw, gb = torch.ops.trifuse.linear_cross_entropy_backward(
        dloss, hidden, weight, target, bias, lse, count, dh, dw, db, ignore_index, reduction,
        label_smoothing, compute_dtype, chunk_size, needs[0], needs[1], needs[3] and bias is not None)
    return (gh if needs[0] else None, gw if needs[1] else None, None,
            gb if needs[3] and bias is not None else None, *([None] * 9))


torch.library.register_autograd("trifuse::cross_entropy", _backward_cross_entropy,
                                setup_context=_setup_cross_entropy)
torch.library.register_autograd("trifuse::linear_cross_entropy", _backward_linear_cross_entropy,
                                setup_context=_setup_linear_cross_entropy)


# =============================================================================================
# Eager fast path: thin autograd.Functions straight over the launchers (a registered op costs
# ~60-150 us of host time per call; see DESIGN.md "Host overhead"). Same launchers, same bits.
# =============================================================================================


def _cross_entropy_twice(ctx, dloss):
    """The backward in PyTorch ops, differentiable again (create_graph=True): F.cross_entropy of
    the logits upcast, whose loss the op's is."""
    if dloss is None:
        return None
    logits, target, lse, count = ctx.saved_tensors
    ignore_index, reduction, label_smoothing = ctx.options
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    def loss(x):
        return F.cross_entropy(x.to(acc), target, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)

    (dx,) = reference_grads(loss, (logits,), ctx.needs_input_grad[:1], (dloss,))
    return dx, None, None, None, None, None


def _linear_cross_entropy_twice(ctx, dloss):
    """The backward in PyTorch ops, differentiable again (create_graph=True): the head's product
    in the compute dtype, its cross-entropy upcast, as the op computes them (the logits exist
    here, as in PyTorch's own double backward)."""
    if dloss is None:
        return None
    hidden, weight, target, bias = ctx.saved_tensors[:4]
    ignore_index, reduction, label_smoothing, compute_dtype, _, _ = ctx.options
    acc = torch.float64 if compute_dtype == torch.float64 else torch.float32

    def loss(h, w, b):
        logits = F.linear(h.to(compute_dtype), w.to(compute_dtype), None if b is None else b.to(compute_dtype))
        out = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(acc), target.reshape(-1),
                              ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
        return out.reshape(target.shape) if reduction == "none" else out

    needs = ctx.needs_input_grad
    gh, gw, gb = reference_grads(loss, (hidden, weight, bias), (needs[0], needs[1], needs[3]), (dloss,))
    return gh, gw, None, gb, None, None, None, None, None, None


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, label_smoothing, out_dtype):
        ctx.set_materialize_grads(False)
        loss, lse, count = cross_entropy_fwd(logits, target, ignore_index, reduction, label_smoothing, out_dtype)
        ctx.save_for_backward(logits, target, lse, count)
        ctx.options = (ignore_index, reduction, label_smoothing)
        return loss

    @staticmethod
    @single_backward(twice=_cross_entropy_twice)
    def backward(ctx, dloss):
        if dloss is None:  # the loss took no part in what was differentiated
            return None, None, None, None, None, None
        logits, target, lse, count = ctx.saved_tensors
        with profiled("trifuse::cross_entropy_backward"):
            dx = cross_entropy_bwd(dloss, logits, target, lse, count, *ctx.options)
        return dx, None, None, None, None, None


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, reduction, label_smoothing,
                compute_dtype, out_dtype, chunk_size):
        ctx.set_materialize_grads(False)
        needs = ctx.needs_input_grad
        grads = (needs[0], needs[1], needs[3] and bias is not None)
        recompute = reduction == "none"
        loss, lse, _, dh, dw, db = linear_cross_entropy_fwd(
            hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype,
            out_dtype, chunk_size, grads, store_lse=recompute)
        if recompute:
            # ("none" needs no row count: only "mean" divides by it.)
            ctx.save_for_backward(hidden, weight, target, bias, lse)
        else:
            # The gradients are in hand: the backward needs neither the inputs nor lse. The
            # inputs are saved for a double backward only (as the unfused head saves hidden and
            # the weight for its own backward: no copies).
            ctx.save_for_backward(hidden, weight, target, bias, dh, dw, db)
        ctx.options = (ignore_index, reduction, label_smoothing, compute_dtype, chunk_size, grads)
        ctx.vocab = weight.shape[0]
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    @single_backward(twice=_linear_cross_entropy_twice)
    def backward(ctx, dloss):
        if dloss is None:  # the loss took no part in what was differentiated
            return (None,) * 10
        ignore_index, reduction, label_smoothing, compute_dtype, chunk_size, grads = ctx.options
        with profiled("trifuse::linear_cross_entropy_backward"):
            if reduction == "none":
                hidden, weight, target, bias, lse = ctx.saved_tensors
                gh, gw, gb = recompute_head_grads(dloss, hidden, weight, target, bias, lse, None, ignore_index,
                                                  reduction, label_smoothing, compute_dtype, chunk_size, grads)
            else:
                gh, gw, gb = scale_head_grads(dloss, *ctx.saved_tensors[4:], ctx.vocab, ctx.dtypes, grads)
        return gh, gw, None, gb, None, None, None, None, None, None


def _wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will differentiate through an op on these tensors now."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# =============================================================================================
# Dialect: trifuse's kernels or PyTorch's F.cross_entropy, whichever is faster for the shape,
# chosen once per (device, dtype, rows bucket, classes, reduction, smoothing on/off, loss dtype,
# grad) on the GPU and cached on disk (autotune/dialects.py). The dialect sees the op's own form,
# logits (N, C) and target (N,), with the loss dtype resolved; traced calls (torch.compile,
# export) always see trifuse::cross_entropy.
# =============================================================================================


def _cross_entropy_key(logits, target, ignore_index, reduction, label_smoothing, out_dtype):
    """The dialect key of an eager call; None (the trifuse op decides, and raises on bad input)
    when traced, empty, or when the shapes or options do not fit. About 2 µs: it runs on every call."""
    if logits is None or target is None or not eager_fast_path(logits, target):
        return None
    if logits.dim() != 2 or target.dim() != 1 or not logits.is_floating_point() or target.is_floating_point():
        return None
    rows, c = logits.shape
    if rows == 0 or c == 0 or target.shape[0] != rows or reduction not in REDUCTIONS:
        return None
    if type(label_smoothing) not in (float, int) or type(out_dtype) is not torch.dtype:
        return None
    grad = torch.is_grad_enabled() and logits.requires_grad
    return (logits.get_device() if logits.is_cuda else -1, logits.dtype, pow2_bucket(rows), c, reduction,
            label_smoothing > 0, out_dtype, grad)


def _cross_entropy_reference(logits, target, ignore_index, reduction, label_smoothing, out_dtype):
    """The dialect's oracle: cross_entropy_ref in the logits' dtype (float64 for the check). The
    loss dtype, out_dtype, is not a numerical question: tests pin it for both candidates."""
    return cross_entropy_ref(logits, target, ignore_index, reduction, label_smoothing)


# The check's float64 reference holds several logits-sized fp64 tensors (input, log-probabilities,
# gradient): 13 GB for 8192 x 50257. It runs on the first rows of the call, at most this many
# elements of logits (128 MiB each in fp64), with the real vocabulary, dtypes and options.
CHECK_ELEMENTS = 2**24


def _check_rows(args: tuple) -> tuple:
    """The call's first CHECK_ELEMENTS logits' worth of rows (all of them when they fit)."""
    logits, target, *options = args
    rows = max(1, min(logits.shape[0], CHECK_ELEMENTS // max(1, logits.shape[1])))
    if rows < logits.shape[0]:
        logits = logits.detach()[:rows].requires_grad_(logits.requires_grad)
        target = target[:rows]
    return (logits, target, *options)


def _cross_entropy_check(fn, args) -> str | None:
    # one sample of rows, so one reference, for all the candidates
    sample = dialects.shared_by_checks("cross_entropy check", args, lambda: _check_rows(args))
    return dialects.compare_with_reference(_cross_entropy_reference, fn, sample)


def _cross_entropy_output_like(logits, target, ignore_index, reduction, label_smoothing, out_dtype):
    loss = logits.new_empty(target.shape if reduction == "none" else (), dtype=out_dtype)
    return loss.requires_grad_(torch.is_grad_enabled() and logits.requires_grad)


def _cross_entropy_trifuse(logits, target, ignore_index, reduction, label_smoothing, out_dtype):
    if eager_fast_path(logits, target):
        _check_ce_inputs(logits, target, ignore_index, reduction, label_smoothing)
        with profiled("trifuse::cross_entropy"):
            if _wants_grad(logits):
                return apply_function(_CrossEntropyFunction, logits, target, ignore_index, reduction,
                                      label_smoothing, out_dtype)
            # inference: the loss alone, no autograd node, no lse kept
            return cross_entropy_fwd(logits, target, ignore_index, reduction, label_smoothing, out_dtype,
                                     store_lse=False)[0]
    return torch.ops.trifuse.cross_entropy(logits, target, ignore_index, reduction, label_smoothing, out_dtype)[0]


def _f_cross_entropy(x, target, ignore_index, reduction, label_smoothing, guard):
    """F.cross_entropy; with `guard`, a target outside [0, C) other than ignore_index gives NaN
    (as trifuse's kernels do on CUDA) instead of F.cross_entropy's device-side assert, which
    would end the process's use of the GPU. Without a host sync: such rows are computed as class
    0 and their loss multiplied by NaN, so the loss is NaN, and so is the gradient (of those rows
    for "none"; of every row not ignored for "mean" and "sum", whose NaN is the one scalar's)."""
    if not guard:
        return F.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    bad = (target != ignore_index) & ((target < 0) | (target >= x.shape[1]))
    loss = F.cross_entropy(x, target.masked_fill(bad, 0), ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if reduction != "none":
        bad = bad.any()
    return loss * torch.where(bad, math.nan, 1.0).to(loss.dtype)


def _cross_entropy_torch(logits, target, ignore_index, reduction, label_smoothing, out_dtype):
    # trifuse's checks first: the same clear errors whichever candidate runs (on CPU, a target
    # out of range raises trifuse's ValueError, as the kernels' launcher does).
    _check_ce_inputs(logits, target, ignore_index, reduction, label_smoothing)
    _check_target_range("cross_entropy", target, logits.shape[1], ignore_index)
    with profiled("trifuse::cross_entropy"):
        x = logits
        # A loss wider than the logits (out_dtype=float32 for 16-bit logits: HF's upcast) is
        # computed in its own precision, as trifuse's fp32 arithmetic gives it: PyTorch needs
        # the upcast copy trifuse avoids. Under autocast log_softmax upcasts anyway.
        if torch.promote_types(x.dtype, out_dtype) != x.dtype:
            x = x.to(out_dtype)
        t = target if target.dtype == torch.int64 else target.long()  # nll_loss takes int64 only
        loss = _f_cross_entropy(x, t, ignore_index, reduction, label_smoothing, guard=x.is_cuda)
        return loss if loss.dtype == out_dtype else loss.to(out_dtype)


def _cross_entropy_torch_supports(logits, target, ignore_index, reduction, label_smoothing, out_dtype):
    if not out_dtype.is_floating_point:
        return f"the loss dtype must be a float dtype for F.cross_entropy, got {out_dtype}"
    return None


CROSS_ENTROPY = dialects.define(
    "cross_entropy", _cross_entropy_key,
    ("device", "dtype", "rows", "classes", "reduction", "smoothing", "loss", "grad"),
    reference=_cross_entropy_reference, check=_cross_entropy_check, output_like=_cross_entropy_output_like)
CROSS_ENTROPY.register(dialects.Candidate("trifuse", _cross_entropy_trifuse))
CROSS_ENTROPY.register(dialects.Candidate("torch", _cross_entropy_torch, supports=_cross_entropy_torch_supports))


# =============================================================================================
# Dialect of the LM head: trifuse's chunked kernels or PyTorch's F.linear + F.cross_entropy on the
# whole logits. The op exists for memory, so PyTorch's path is a candidate only where memory does
# not decide: where all it holds for the logits (with their gradient and the fp32 upcast) fits in
# the budget trifuse allows itself for one chunk (chunk_budget), the choice is one of speed.
# Elsewhere trifuse's kernels take the call, with that reason. An explicit chunk_size asks for
# trifuse's chunking: no dialect.
# =============================================================================================


def _lce_key(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype, dtype):
    """The dialect key of an eager call (after the op's checks); None when traced or empty."""
    if not eager_fast_path(hidden, weight, target, bias) or hidden.dim() < 1 or weight.dim() != 2:
        return None
    tokens = target.numel()
    if tokens == 0:
        return None
    grad = _wants_grad(hidden, weight, bias)
    return (hidden.get_device() if hidden.is_cuda else -1, compute_dtype, pow2_bucket(tokens), weight.shape[0],
            weight.shape[1], hidden.dtype, weight.dtype, None if bias is None else bias.dtype, reduction,
            label_smoothing > 0, dtype, grad)


def _lce_trifuse(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype, dtype,
                 chunk_size=None):
    """trifuse's kernels (the arguments checked by linear_cross_entropy)."""
    with profiled("trifuse::linear_cross_entropy"):
        if _wants_grad(hidden, weight, bias):
            return apply_function(_LinearCrossEntropyFunction, hidden, weight, target, bias, ignore_index,
                                  reduction, label_smoothing, compute_dtype, dtype, chunk_size)
        # Inference: the loss alone (no dlogits, no gradient matmuls, no lse), no autograd node.
        return linear_cross_entropy_fwd(hidden, weight, target, bias, ignore_index, reduction, label_smoothing,
                                        compute_dtype, dtype, chunk_size, (False, False, False), store_lse=False)[0]


def _lce_torch(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype, dtype):
    """F.linear in the compute dtype, the loss in fp32 or wider (as trifuse's kernels compute it:
    16-bit logits upcast, as HF's loss path does), in the op's loss dtype and shape."""
    _check_target_range("linear_cross_entropy", target, weight.shape[0], ignore_index)
    with profiled("trifuse::linear_cross_entropy"), no_autocast(hidden.device):
        logits = F.linear(hidden.to(compute_dtype), weight.to(compute_dtype),
                          None if bias is None else bias.to(compute_dtype))
        x = logits.reshape(-1, logits.shape[-1])
        if torch.promote_types(x.dtype, torch.float32) != x.dtype:
            x = x.float()
        t = target.reshape(-1)
        t = t if t.dtype == torch.int64 else t.long()  # nll_loss takes int64 only
        loss = _f_cross_entropy(x, t, ignore_index, reduction, label_smoothing, guard=x.is_cuda)
        loss = loss.reshape(target.shape) if reduction == "none" else loss
        return loss if loss.dtype == dtype else loss.to(dtype)


def _lce_torch_supports(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype,
                        dtype) -> str | None:
    if not dtype.is_floating_point:
        return f"the loss dtype must be a float dtype for F.cross_entropy, got {dtype}"
    tokens, vocab = target.numel(), weight.shape[0]
    held = tokens * vocab * _TORCH_BYTES_PER_LOGIT
    budget = chunk_budget(padded_vocab(vocab), weight.shape[1], hidden.device)
    if held > budget:
        return (f"PyTorch's path holds all {tokens} x {vocab} logits ({held / 2**20:.0f} MiB with their gradient "
                f"and upcast), over the {budget / 2**20:.0f} MiB trifuse allows one chunk: memory, not exchanged "
                "for speed")
    return None


# What PyTorch's path holds per logit at most: the logits and their gradient in a 16-bit compute
# dtype (2 + 2 bytes) and the fp32 upcast and its gradient (4 + 4); in fp32, 4 + 4.
_TORCH_BYTES_PER_LOGIT = 12


def _lce_reference(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype, dtype):
    """The spec (the loss on upcast logits, as HF computes it); the loss dtype is pinned by tests."""
    return linear_cross_entropy_ref(hidden, weight, target, bias, ignore_index, reduction, label_smoothing,
                                    upcast=hidden.dtype != torch.float64)


LINEAR_CROSS_ENTROPY = dialects.define(
    "linear_cross_entropy", _lce_key,
    ("device", "dtype", "tokens", "vocab", "hidden", "hidden_dtype", "weight", "bias", "reduction", "smoothing",
     "loss", "grad"),
    reference=_lce_reference)
LINEAR_CROSS_ENTROPY.register(dialects.Candidate("trifuse", _lce_trifuse))
LINEAR_CROSS_ENTROPY.register(dialects.Candidate("torch", _lce_torch, supports=_lce_torch_supports))


# =============================================================================================
# Public API
# =============================================================================================


@outside_device_modes
def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """F.cross_entropy with class-index targets: one pass over the logits each way.

    Args:
        logits: (N, C), (C,) or (N, C, d1, ...) as F.cross_entropy takes them; fp16 / bf16 /
            fp32 / fp64, read as they are (no upcast copy). The (N, C, d1, ...) form is moved
            to (N*d1*..., C) first, which copies.
        target: integer class indices, (N,), () or (N, d1, ...). Values in [0, C) or ignore_index.
        reduction: "mean" (over non-ignored rows; nan when all are ignored), "sum" or "none".
        label_smoothing: in [0, 1], as PyTorch defines it.
        out_dtype: the loss's dtype; None gives F.cross_entropy's (the logits' dtype, fp32 under
            autocast). HF's loss path upcasts the logits: out_dtype=torch.float32 does that
            without the copy.

    Returns:
        The loss: () for "mean" / "sum", target's shape for "none". The gradient has the logits'
        dtype and shape.

    Eager calls run trifuse's kernels or F.cross_entropy (same semantics and loss dtype),
    whichever the `cross_entropy` dialect measured faster for this shape on this GPU
    (`trifuse.autotune.dialects.explain("cross_entropy", logits2d, target1d, ignore_index,
    reduction, label_smoothing, loss_dtype)` says which and why); elsewhere, and under
    torch.compile, trifuse's.

    Raises:
        TypeError for float or bool targets and non-float logits; ValueError for shapes,
        options, and (on CPU) targets out of range. On CUDA an out-of-range target gives NaN.
    """
    op = "cross_entropy"
    check_tensor(op, "input", logits)
    check_tensor(op, "target", target)
    x, t = logits, target
    if logits.dim() == 1:
        _check_target(op, target, ())
        x, t = logits.unsqueeze(0), target.reshape(1)
    elif logits.dim() > 2:
        _check_target(op, target, (logits.shape[0], *logits.shape[2:]))
        x, t = logits.movedim(1, -1).reshape(-1, logits.shape[1]), target.reshape(-1)
    elif logits.dim() < 1:
        raise ValueError(f"trifuse.{op}: input must have a class dimension, got a 0-dim tensor")
    dtype = _ce_out_dtype(logits, out_dtype) if logits.is_floating_point() else logits.dtype
    loss = CROSS_ENTROPY(x, t, ignore_index, reduction, label_smoothing, dtype)
    return loss.reshape(target.shape) if reduction == "none" and target.dim() != 1 else loss


@outside_device_modes
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    chunk_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """F.cross_entropy(F.linear(hidden, weight, bias), target) without materializing the logits.

    Args:
        hidden: (..., H) fp16 / bf16 / fp32 / fp64, any strides.
        weight: (V, H), the LM head (may be tied to the embedding: its gradient then adds up).
        target: hidden.shape[:-1] integer class indices in [0, V) or ignore_index.
        bias: (V,), optional.
        reduction, label_smoothing, ignore_index: as F.cross_entropy.
        chunk_size: tokens per chunk; None chooses it from the problem and free memory
            (see chunk_rows). Results are bitwise repeatable for a given chunk size.
        out_dtype: the loss's dtype; None gives fp32 under autocast, else the inputs' dtype.

    Returns:
        The loss: () for "mean" / "sum", target's shape for "none". Gradients reach hidden,
        weight and bias in their own dtypes.

    Memory: O(chunk_size x V) for the logits, plus the weight's gradient; the (tokens x V)
    logits never exist. Where PyTorch's whole logits (with their gradient and upcast, 12 bytes
    each) fit in the budget one chunk may take (chunk_budget), eager calls run trifuse's kernels or
    PyTorch's F.linear + F.cross_entropy, whichever the `linear_cross_entropy` dialect measured
    faster on this GPU; elsewhere (and with chunk_size, and under torch.compile) trifuse's kernels.
    With "mean" / "sum" the gradients are computed during the forward (when autograd will ask for
    them), so the backward only scales them.

    Raises:
        TypeError / ValueError as `cross_entropy`, and for weight, bias or dtypes that do not fit.
    """
    op = "linear_cross_entropy"
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target), ("bias", bias)):
        if t is not None or name != "bias":
            check_tensor(op, name, t)
            if name != "target":
                check_float(op, name, t)
    compute_dtype, dtype = _lce_dtypes(hidden, weight, bias, out_dtype)
    if eager_fast_path(hidden, weight, target, bias):
        _check_lce_inputs(hidden, weight, target, bias, ignore_index, reduction, label_smoothing,
                          compute_dtype, chunk_size)
        args = (hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype, dtype)
        if chunk_size is not None:  # trifuse's chunking asked for
            return _lce_trifuse(*args, chunk_size)
        return LINEAR_CROSS_ENTROPY(*args)
    grad = torch.is_grad_enabled()
    return torch.ops.trifuse.linear_cross_entropy(
        hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute_dtype, dtype,
        chunk_size, grad and hidden.requires_grad, grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )[0]
