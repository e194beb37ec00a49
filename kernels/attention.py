"""Scaled dot-product attention, FlashAttention-2 style, forward and backward.

Maths, per batch b and query head h (kv head hk = h // (Hq // Hkv) under GQA/MQA):

    S = scale * Q K^T + mask          (Sq, Sk); mask: 0 / -inf from a bool mask, the values of a
                                      float one, -inf above the diagonal j > i when is_causal
                                      (with a logit soft cap c, Gemma 2's: S = c * tanh(scale *
                                      Q K^T / c) + mask)
    P = softmax(S) row by row         a row whose every score is -inf gives P = 0 (SDPA's rule)
    O = (P * Z / (1 - p)) V           Z: the dropout keep mask, Bernoulli(1 - p)
    L = logsumexp(S) row by row       saved for the backward (-inf for rows that see no key)

With attention sinks (gpt-oss: one learned logit s_h per query head, `sinks` (Hq,)), the sink is
one more score in every row of head h that has no value and is not masked, scaled or capped:

    L = log(exp(s_h) + sum_j exp(S_ij))    P_ij = exp(S_ij - L)    P_sink = exp(s_h - L)

so the rows of P sum to 1 - P_sink, and dropout acts on P as without a sink (after the sink's
column is dropped, as transformers' eager code does). The forward starts its online softmax from
the sink (m = s_h, l = 1, in base 2) instead of (-inf, 0). A row whose every key is masked still
has the sink in its denominator: P = 0 over the keys, O = 0 and L = s_h (transformers' eager code
gives the same; a sink of -inf is no sink at all, and such a row is then SDPA's empty row).

Backward, with dP~ = dO V^T and delta = rowsum(dO * O) (= rowsum(P * dP~ * Z / (1 - p))):

    dV = (P * Z / (1 - p))^T dO       summed over the query heads of a kv group
    dP = dP~ * Z / (1 - p)
    dS = P * (dP - delta)
    dQ = scale * dS~ K;  dK = scale * dS~^T Q (dK summed over the group like dV); dS~ = dS, or
                                              dS * (1 - tanh^2) under a soft cap
    dMask = dS                                (a float mask that requires grad; the mask is added
                                              after the scale; summed over its broadcast dims)
    dsinks_h = -sum_{b,i} P_sink,bhi * delta_bhi    (the sink's dP is 0: it has no value; dQ, dK,
                                              dV are the formulas above with the sink inside L)

Causal alignment is SDPA's `is_causal`: top-left, query i sees keys j <= i, also when Sq != Sk
(rows i >= Sk see every key; keys j >= Sq are seen by nobody and get zero gradients).
A row that a float mask covers whole with a finite value (transformers' finfo(dtype).min) is a
uniform average, as in SDPA's math backend, forward and backward: L ~ -3e38 cannot hold log(Sk)
in one float, so L is kept as hi + lo (`_row_stats`) and the backward's P = exp2((S - hi) - lo)
is 1/Sk there (from one float it came back as 1). Rows masked with bools or -inf are exact.

Shapes: q and k (B, Hq|Hkv, Sq|Sk, D), v (B, Hkv, Sk, Dv), O (B, Hq, Sq, Dv), with Hkv = Hq, or Hkv
dividing Hq when enable_gqa; D, Dv <= 256, any values (each padded to a power of two >= 16 inside
the kernels, masked). Dv defaults to D; DeepSeek-V2/V3's multi-head latent attention has D = 192
(128 + 64 rotary features) and Dv = 128, which SDPA takes and flash-attn 2 does not.
attn_mask broadcasts to (B, Hq, Sq, Sk) (typically (B|1, H|1, Sq|1, Sk)); broadcast dims are read
with stride 0, never expanded in memory. Any strides for q, k, v, dO and the mask (views of a
fused QKV projection, (B, S, H, D) transposes, expanded tensors): no copies.
Dtypes: fp16 / bf16 / fp32 / fp64, one dtype for q, k, v. Dots take the input dtype as operands
and accumulate in fp32 (fp64 for fp64 inputs, used by gradcheck); fp32 dots are IEEE fp32
(no TF32). P is rounded to the input dtype before P V, as FlashAttention does.

Memory plan: the score matrix never exists. The forward saves O and the row log-sum-exp L
(base 2 as hi + lo, two fp32 a row; fp64 for fp64), plus the Philox seed when dropout is on; the
backward recomputes P block by block from Q, K and L, and regenerates the dropout mask from
(seed, row, column) (`_random.dropout_keep_quads`, four keys a Philox draw): the column is the
key index, the row (b * Hq + h) * Sq + query index. Extra memory is O(B H Sq) (plus the
O(B H Sq Sk) dS buffer when the mask requires grad, below).

Kernels (one program per block of rows, looping over the other sequence):
    _attn_fwd_kernel              per (query block, b, h): online softmax over key blocks
    _attn_bwd_preprocess_kernel   delta = rowsum(dO * O); dsinks is then a torch reduction of
                                  exp(s_h - L) * delta over batch and rows (B Hq Sq elements)
    _attn_bwd_dkdv_kernel         per (key block, b, hk): loops over the group's query heads and
                                  their query blocks; dK, dV stay in registers
    _attn_bwd_dq_kernel           per (query block, b, h): loops over key blocks; dQ in registers;
                                  with MASK_GRAD it also stores every dS tile it forms
Every output element is written by exactly one program and no atomics are used, so the backward
is deterministic by construction (bitwise repeatable), GQA's group sums included.

The mask gradient (only when a float attn_mask requires grad: T5's learned position bias) is the
one place the score matrix exists: the dQ kernel writes dS to a dense (B, Hq, Sq, Sk) buffer (fp32;
fp64 for fp64), and torch sums it over the dims the mask broadcasts along. Atomics straight into
the mask's broadcast shape would save that memory but race across batches / heads (T5's
(1, H, Sq, Sk) bias is summed over the batch): non-deterministic fp32 sums, contention on one row
per batch, and nothing the interpreter can test. The buffer is what SDPA's math backend holds too.
All four launch through CachedKernel with a launch plan per exact shape (_FWD_PLANS, _BWD_PLANS):
after the first call of a shape, a call costs a dict lookup and four direct launches.

Eager calls of `attention` go through the `attention` dialect (bottom of this file): trifuse's
kernels, SDPA with one backend forced, flash-attn or xformers, whichever measured fastest among
the candidates that pass the check for the shape bucket. Before it, a batch of one under a bool
mask that is exactly block-diagonal causal (packed sequences as transformers masks them for SDPA)
goes to `attention_varlen.py` over the blocks (`_packed`): the same answer without scoring every
other sequence's keys; the mask is checked once (one pass, two syncs) and the verdict cached.
Key blocks that need no causal or bounds mask run a loop without the masking code; the diagonal
and the ragged last block run a masked loop (a constexpr flag selects the variant).

Under a mask, the kernels visit only the blocks some of their rows can see (HAS_BOUNDS): per mask,
torch computes each query row's first and one-past-last unmasked key and each key's span of query
rows (`_mask_bounds`, a few device ops, cached with the mask so a model's layers share it), and
each program narrows its loop to the span of its block's rows (keys, in dK/dV). Padding past
whole blocks, the other documents of rows packed with several (B > 1, where `_packed` does not
apply), and what a sliding window leaves behind are skipped exactly (the skipped scores are
masked for every row there), with no host sync, so CUDA-graph capture keeps working.

On Hopper, with TRIFUSE_ATTENTION_TMA=1, the kernels may move their tiles through tensor
descriptors built in the kernel (the copy engine, UTMALDG/UTMASTG in SASS; bounds and head-dim
padding by the hardware, fewer registers: 140 against 182 at head dim 128 in the forward,
compiled for sm_90): the forward loads Q, K, V and stores O, the dK/dV pass streams Q and dO,
the dQ pass K and V. The tuner then times those configs beside the pointer ones and keeps the
faster. Opt-in until a GPU session has measured it (bench/bench_attention.py --tma); _tma_ok
says what it takes. Warp specialization (tl.range(warp_specialize=True)) is not used: Triton 3.6
and 3.9 fail on the causal forward for sm_90 (NVGPUWarpSpecialization pass) and emit no
register reallocation (setmaxnreg) for the others.
"""
import functools
import logging
import math
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..autotune import dialects, pow2_bucket
from ..autotune.env import INTERPRET, attention_tma_requested
from ..autotune.tuner import Tuner, device_limits
from ._common import (
    acc_dtype,
    apply_function,
    check_float,
    check_probability,
    check_same_device,
    check_tensor,
    ctx_as,
    eager_fast_path,
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

OP = "attention"
log = logging.getLogger("trifuse")
MAX_HEAD_DIM = 256
MAX_BATCH_HEADS = 65535  # batch * heads is the second grid axis
LOG2E = 1.4426950408889634  # the kernels work in base 2: exp(x) = exp2(x * log2(e))

# MASK_KIND values
_NO_MASK, _BOOL_MASK, _FLOAT_MASK = 0, 1, 2


# =============================================================================================
# Reference: the spec. Tests run it in float64 as the oracle and in the input dtype to measure
# PyTorch's own error.
# =============================================================================================


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    dropout_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with an explicit (Sq, Sk) softmax, as SDPA's math backend computes it.

    `dropout_mask` (bool, broadcastable to (B, Hq, Sq, Sk), True = keep) stands in for the
    kernel's random mask; without it no dropout is applied whatever dropout_p says. `softcap`
    c caps the scaled scores as c * tanh(s / c) before the mask is added (Gemma 2). `sinks` (Hq,)
    joins each row's softmax as one more column, dropped before dropout and P V (gpt-oss).
    """
    sq, sk = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    s = (q @ k.transpose(-2, -1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if is_causal:
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    # Rows that see no key give 0 (SDPA's rule); softmax them over zeros so no NaN reaches autograd.
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)
    probs = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    if dropout_mask is not None:
        probs = probs * dropout_mask / (1.0 - dropout_p) if dropout_p < 1.0 else torch.zeros_like(probs)
    return probs @ v


# =============================================================================================
# Kernels
# =============================================================================================


@triton.jit
def _tile(X, rows, offs_d, stride_r, stride_d):
    """Pointers to a (rows, head_dim) tile of one (b, h) slice that X already points at."""
    return X + rows[:, None] * stride_r + offs_d[None, :] * stride_d


@triton.jit
def _scaled(qk, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw dot products to scores in base 2, and tanh of the capped ones (the backward's chain
    factor 1 - tanh^2; qk itself without a cap). Without a cap qk_scale = scale * log2(e); with a
    cap c, qk_scale = scale / c and softcap = c * log2(e): c * tanh(scale * qk / c) * log2(e).
    tanh(x) = 1 - 2 / (exp(2x) + 1) reaches +-1 exactly at both ends, never NaN (the exponent is
    clamped at 2^64, where 2 / (2^64 + 1) is below the resolution of 1 in fp32 and fp64)."""
    if SOFTCAP:
        x = qk * (qk_scale * 2.8853900817779268)
        # the clamp keeps a NaN score NaN (tl.minimum would return 64): NaN in, NaN out, as unfused
        t = 1.0 - 2.0 / (tl.exp2(tl.where(x != x, x, tl.minimum(x, 64.0))) + 1.0)
        return t * softcap, t
    return qk * qk_scale, qk


@triton.jit
def _scores(qk, rows, cols, MASK, stride_mm, stride_mn, N_Q, N_K,
            MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, ACC: tl.constexpr,
            window=0, HAS_WINDOW: tl.constexpr = False):
    """Applies the attention mask, the causal mask and the key bounds to a block of scores.

    qk is already in base 2 (scale * log2(e) applied); rows and cols broadcast to qk's shape
    (a column vector and a row vector, or the reverse for the transposed dK/dV block). MASK
    points at this (b, h)'s mask. Masked scores become -inf. With HAS_WINDOW (varlen's sliding
    window, in masked blocks only) key j is seen by row i only if j > i - window."""
    if MASK_KIND != 0:
        in_bounds = (rows < N_Q) & (cols < N_K)
        ptrs = MASK + rows * stride_mm + cols * stride_mn
        if MASK_KIND == 1:
            keep = tl.load(ptrs, mask=in_bounds, other=0) != 0
            qk = tl.where(keep, qk, float("-inf"))
        else:
            bias = tl.load(ptrs, mask=in_bounds, other=0.0).to(ACC)
            # finfo(fp32).min * log2(e) would overflow to -inf and empty a row that a finite mask
            # (transformers' finfo.min) covers whole; SDPA averages such a row uniformly. -inf and
            # NaN pass unclamped (tl.maximum would turn a NaN into -2.3e38, a masked key: SDPA's
            # row is NaN).
            qk += tl.where((bias == float("-inf")) | (bias != bias), bias, tl.maximum(bias, -2.3e38)) \
                * 1.4426950408889634
    if MASKED:
        valid = cols < N_K
        if IS_CAUSAL:
            valid = valid & (cols <= rows)
        if HAS_WINDOW:
            valid = valid & (cols > rows - window)
        qk = tl.where(valid, qk, float("-inf"))
    return qk


@triton.jit
def _softmax_start(SINKS, h, BLOCK_M: tl.constexpr, ACC: tl.constexpr, HAS_SINKS: tl.constexpr):
    """(m, l) the online softmax of a block of rows of head h starts from. The sink is a score
    every row sees, with no value: the softmax starts from it (l = exp2(m - m) = 1), so L includes
    it and a row with every key masked keeps l >= 1. A sink of -inf starts as (-inf, 0), no sink
    at all, as without sinks."""
    if HAS_SINKS:
        m_i = tl.full([BLOCK_M], 1.4426950408889634, dtype=ACC) * tl.load(SINKS + h).to(ACC)
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0).to(ACC)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
        l_i = tl.zeros([BLOCK_M], dtype=ACC)
    return m_i, l_i


@triton.jit
def _key_blocks(start_m, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """(n_full, hi) for the block of query rows from start_m: key blocks [0, n_full) need neither
    the causal nor the bounds mask, [n_full, hi) do; keys from hi on are past the diagonal."""
    if IS_CAUSAL:
        hi = tl.minimum(N_K, start_m + BLOCK_M)
        n_full = tl.minimum(start_m + 1, N_K) // BLOCK_N * BLOCK_N
    else:
        hi = N_K
        n_full = N_K // BLOCK_N * BLOCK_N
    return n_full, hi


@triton.jit
def _mask_span(BOUNDS, lines, N_LINES, N_OTHER, BLOCK: tl.constexpr):
    """(first, last) of the other sequence that some of `lines` (query rows, or key columns) may
    attend under the mask: BOUNDS holds each line's first and one-past-last unmasked position
    (BOUNDS[i], BOUNDS[N_LINES + i]; _mask_bounds). `first` is rounded down to a block start;
    everything outside [first, last) is masked for every line here, and skipped."""
    ok = lines < N_LINES
    first = tl.min(tl.load(BOUNDS + lines, mask=ok, other=N_OTHER), 0)
    last = tl.max(tl.load(BOUNDS + N_LINES + lines, mask=ok, other=0), 0)
    return first // BLOCK * BLOCK, last


@triton.jit
def _attn_fwd_loop(acc, l_i, m_i, q, K, V, MASK, seed, rng_rows, offs_m, offs_n, offs_d, offs_dv,
                   stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                   N_Q, N_K, qk_scale, softcap, p_drop, lo, hi,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                   SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr,
                   USE_TMA: tl.constexpr, window=0, HAS_WINDOW: tl.constexpr = False):
    """Online softmax over the key blocks [lo, hi) for one block of query rows. With USE_TMA, K
    and V are tensor descriptors (the copy engine zero-fills rows and columns past the ends)."""
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k_mask = mask_d[None, :]
        v_mask = mask_dv[None, :]
        if MASKED:
            k_mask = k_mask & (cols[:, None] < N_K)
            v_mask = v_mask & (cols[:, None] < N_K)
        if USE_TMA:
            k = K.load([start_n, 0])
        else:
            k = tl.load(_tile(K, cols, offs_d, stride_kn, stride_kd), mask=k_mask, other=0.0)
        qk, _ = _scaled(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC), qk_scale, softcap,
                        SOFTCAP)
        qk = _scores(qk, offs_m[:, None], cols[None, :], MASK, stride_mm, stride_mn, N_Q, N_K,
                     MASKED, IS_CAUSAL, MASK_KIND, ACC, window, HAS_WINDOW)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen only -inf so far keeps m = -inf; subtract 0 instead (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            # The normalizer l sums the undropped P; dropout acts on the normalized probabilities.
            keep = dropout_keep_quads(seed, rng_rows[:, None], cols[None, :], p_drop)
            p = tl.where(keep, p, 0.0)
        if USE_TMA:
            v = V.load([start_n, 0])
        else:
            v = tl.load(_tile(V, cols, offs_dv, stride_vn, stride_vd), mask=v_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION, out_dtype=ACC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q,  # in (B, H, N_Q, HEAD_DIM)
    K,  # in (B, H_KV, N_K, HEAD_DIM)
    V,  # in (B, H_KV, N_K, HEAD_DIM_V)
    MASK,  # in, broadcast to (B, H, N_Q, N_K): uint8 (bool) or float; unused unless MASK_KIND
    SEED,  # in (1,) int64 Philox seed; unused unless HAS_DROPOUT
    SINKS,  # in (H,) fp32 (fp64 for fp64) sink logits; unused unless HAS_SINKS
    O,  # out (B, H, N_Q, HEAD_DIM_V)
    LSE,  # out (B, H, 2, N_Q) fp32 (fp64 for fp64): log2 of the row sum as hi + lo (_row_stats)
    ROW_BOUNDS,  # in (B, H, 2, N_Q) int32, broadcast like the mask: _mask_bounds; unused unless HAS_BOUNDS
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_rb, stride_rh,
    H, N_Q, N_K, GROUP, qk_scale, softcap, p_drop, dropout_scale,
    Q_BUCKET, K_BUCKET,  # unused in the kernel: the tuner keys on these buckets on the host
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr,
    USE_TMA: tl.constexpr,  # Q, K, V, O through tensor descriptors (sm_90+; see _tma_ok)
    HAS_SINKS: tl.constexpr,
    HAS_BOUNDS: tl.constexpr = False,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # int64: b * stride may pass 2^31
    b = bh // H
    h = bh % H
    hk = h // GROUP
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    MASK += b * stride_mb + h * stride_mh
    O += b * stride_ob + h * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N_Q
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    if USE_TMA:
        # One (rows, head_dim) descriptor per (b, h) slice: any batch and head strides, unit
        # stride along head_dim; the copy engine bounds every tile by the slice's shape.
        q = tl.make_tensor_descriptor(Q, [N_Q, HEAD_DIM], [stride_qm, 1], [BLOCK_M, BLOCK_D]).load([start_m, 0])
        K = tl.make_tensor_descriptor(K, [N_K, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, [N_K, HEAD_DIM_V], [stride_vn, 1], [BLOCK_N, BLOCK_DV])
    else:
        q = tl.load(_tile(Q, offs_m, offs_d, stride_qm, stride_qd), mask=q_mask, other=0.0)
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    rng_rows = bh * N_Q + offs_m

    m_i, l_i = _softmax_start(SINKS, h, BLOCK_M, ACC, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC)
    n_full, hi = _key_blocks(start_m, N_K, BLOCK_M, BLOCK_N, IS_CAUSAL)
    lo, full_end, masked_start = 0, n_full, n_full
    if HAS_BOUNDS:  # only the keys some row of this block sees under the mask
        lo, last = _mask_span(ROW_BOUNDS + b * stride_rb + h * stride_rh, offs_m, N_Q, N_K, BLOCK_N)
        full_end, masked_start, hi = tl.minimum(n_full, last), tl.maximum(n_full, lo), tl.minimum(hi, last)
    acc, l_i, m_i = _attn_fwd_loop(acc, l_i, m_i, q, K, V, MASK, seed, rng_rows, offs_m, offs_n, offs_d, offs_dv,
                                   stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                                   N_Q, N_K, qk_scale, softcap, p_drop, lo, full_end,
                                   HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, IS_CAUSAL, MASK_KIND, HAS_DROPOUT,
                                   SOFTCAP, DOT_PRECISION, ACC, USE_TMA)
    acc, l_i, m_i = _attn_fwd_loop(acc, l_i, m_i, q, K, V, MASK, seed, rng_rows, offs_m, offs_n, offs_d, offs_dv,
                                   stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                                   N_Q, N_K, qk_scale, softcap, p_drop, masked_start, hi,
                                   HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, IS_CAUSAL, MASK_KIND, HAS_DROPOUT,
                                   SOFTCAP, DOT_PRECISION, ACC, USE_TMA)

    seen = l_i > 0.0  # False only for rows whose every score (the sink's too) is -inf: O = 0, L = -inf
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc * (dropout_scale / l_safe)[:, None]
    lse_hi, lse_lo = _row_stats(m_i, l_safe, seen)
    if USE_TMA:
        o_desc = tl.make_tensor_descriptor(O, [N_Q, HEAD_DIM_V], [stride_om, 1], [BLOCK_M, BLOCK_DV])
        o_desc.store([start_m, 0], o.to(O.dtype.element_ty))
    else:
        tl.store(_tile(O, offs_m, offs_dv, stride_om, stride_od), o.to(O.dtype.element_ty), mask=o_mask)
    tl.store(LSE + bh * 2 * N_Q + offs_m, lse_hi, mask=row_ok)
    tl.store(LSE + bh * 2 * N_Q + N_Q + offs_m, lse_lo, mask=row_ok)


@triton.jit
def _attn_bwd_preprocess_kernel(
    O,  # in (B, H, N_Q, HEAD_DIM), HEAD_DIM the value's head dim here
    DO,  # in (B, H, N_Q, HEAD_DIM)
    DELTA,  # out (B, H, N_Q) fp32 (fp64 for fp64)
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    H, N_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ACC: tl.constexpr,
):
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(_tile(O + b * stride_ob + h * stride_oh, offs_m, offs_d, stride_om, stride_od),
                mask=mask, other=0.0).to(ACC)
    do = tl.load(_tile(DO + b * stride_dob + h * stride_doh, offs_m, offs_d, stride_dom, stride_dod),
                 mask=mask, other=0.0).to(ACC)
    tl.store(DELTA + bh * N_Q + offs_m, tl.sum(o * do, axis=1), mask=offs_m < N_Q)


@triton.jit
def _row_stats(m, l, seen):
    """The softmax's normalizer L = m + log2(l) (base 2) as an unevaluated sum hi + lo: hi
    rounded, lo its rounding error (Knuth's TwoSum, exact). Under a float mask of finfo.min
    (transformers' left padding: a row that sees no key) every score is ~-2^128, where hi's
    resolution is 2^104 and log2(l) vanishes from hi: the backward's P = exp2((S - hi) - lo) is
    1 / l there, as the forward averaged, where exp2(S - hi) would be 1. Rows not seen: -inf, 0."""
    log_l = tl.log2(l)
    m = tl.where(seen, m, 0.0)  # -inf - -inf would be NaN below
    hi = m + log_l
    m_part = hi - log_l
    lo = (m - m_part) + (log_l - (hi - m_part))
    return tl.where(seen, hi, float("-inf")), tl.where(seen, lo, 0.0)


@triton.jit
def _load_row_stats(LSE, DELTA, rows, N_Q, HAS_LO: tl.constexpr):
    """(hi, lo, delta) for a block of rows: L in base 2 (_row_stats; lo N_Q past hi, read only
    with HAS_LO, else 0) and delta. Rows past N_Q, and rows that saw no key (L = -inf), get
    hi = +inf, so their recomputed probabilities are exactly 0."""
    row_ok = rows < N_Q
    hi = tl.load(LSE + rows, mask=row_ok, other=float("inf"))
    hi = tl.where(hi == float("-inf"), float("inf"), hi)
    if HAS_LO:
        lo = tl.load(LSE + N_Q + rows, mask=row_ok, other=0.0)
    else:
        lo = tl.zeros_like(hi)
    delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    return hi, lo, delta


@triton.jit
def _attn_bwd_dkdv_loop(dk, dv, k, v, Q, DO, LSE, DELTA, MASK, seed, rng_base, offs_m, offs_n, offs_d, offs_dv,
                        stride_qm, stride_qd, stride_dom, stride_dod, stride_mm, stride_mn,
                        N_Q, N_K, qk_scale, softcap, p_drop, dropout_scale, lo, hi, h,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                        MASKED: tl.constexpr,
                        IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                        SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr,
                        USE_TMA: tl.constexpr, window=0, HAS_WINDOW: tl.constexpr = False):
    """Accumulates dK, dV of one key block over the query blocks [lo, hi) of one query head.
    Works on transposed (keys x queries) blocks so dK and dV come out of plain dots.
    Keys past N_K (the ragged last block) need no mask: their rows are never stored.
    With USE_TMA, Q and DO are (heads, rows, head_dim) descriptors of this batch and h the head."""
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows[:, None] < N_Q
        if USE_TMA:
            q = Q.load([h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, offs_d.shape[0])
            do = DO.load([h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, offs_dv.shape[0])
        else:
            q = tl.load(_tile(Q, rows, offs_d, stride_qm, stride_qd), mask=row_ok & mask_d[None, :], other=0.0)
            do = tl.load(_tile(DO, rows, offs_dv, stride_dom, stride_dod), mask=row_ok & mask_dv[None, :],
                         other=0.0)
        do = do.to(q.dtype)
        lse, lse_lo, delta = _load_row_stats(LSE, DELTA, rows, N_Q, MASK_KIND == 2)
        qk_t, tanh_t = _scaled(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION, out_dtype=ACC), qk_scale,
                               softcap, SOFTCAP)
        qk_t = _scores(qk_t, rows[None, :], offs_n[:, None], MASK, stride_mm, stride_mn, N_Q, N_K,
                       MASKED, IS_CAUSAL, MASK_KIND, ACC, window, HAS_WINDOW)
        if MASK_KIND == 2:  # a float mask: L's rounding error counts (_row_stats)
            p_t = tl.exp2((qk_t - lse[None, :]) - lse_lo[None, :])
        else:
            p_t = tl.exp2(qk_t - lse[None, :])
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=ACC)
        if HAS_DROPOUT:
            # drawn as the other kernels draw it, (query, key), and transposed: four keys a draw
            keep_t = tl.trans(dropout_keep_quads(seed, rng_base + rows[:, None], offs_n[None, :], p_drop))
            pd_t = tl.where(keep_t, p_t * dropout_scale, 0.0)
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        else:
            pd_t = p_t
        dv = tl.dot(pd_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=ACC)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=ACC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V,  # in, as the forward
    MASK,  # in, as the forward
    SEED,  # in (1,) int64; unused unless HAS_DROPOUT
    DO,  # in (B, H, N_Q, HEAD_DIM_V)
    LSE,  # in (B, H, 2, N_Q) from the forward
    DELTA,  # in (B, H, N_Q) rowsum(dO * O)
    DK, DV,  # out (B, H_KV, N_K, HEAD_DIM) and (B, H_KV, N_K, HEAD_DIM_V)
    COL_BOUNDS,  # in (B, H, 2, N_K) int32, broadcast like the mask: _mask_bounds; unused unless HAS_BOUNDS
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_cb, stride_ch,
    H, H_KV, N_Q, N_K, GROUP, sm_scale, qk_scale, softcap, p_drop, dropout_scale,
    Q_BUCKET, K_BUCKET,  # unused in the kernel: the tuner keys on these buckets on the host
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr,
    USE_TMA: tl.constexpr,  # Q and DO streamed through tensor descriptors (see _tma_ok)
    HAS_BOUNDS: tl.constexpr = False,
):
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1).to(tl.int64)
    b = bhk // H_KV
    hk = bhk % H_KV
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_mask = (offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM)
    v_mask = (offs_n[:, None] < N_K) & (offs_dv[None, :] < HEAD_DIM_V)
    k = tl.load(_tile(K + b * stride_kb + hk * stride_kh, offs_n, offs_d, stride_kn, stride_kd),
                mask=k_mask, other=0.0)
    v = tl.load(_tile(V + b * stride_vb + hk * stride_vh, offs_n, offs_dv, stride_vn, stride_vd),
                mask=v_mask, other=0.0)
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)

    # Causal: query blocks [lo, mid) straddle the diagonal (causal mask), [mid, N_Q) see the
    # whole key block, and queries before start_n see none of these keys and are skipped.
    if IS_CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
        mid = tl.minimum(lo + tl.cdiv(start_n + BLOCK_N - 1 - lo, BLOCK_M) * BLOCK_M, N_Q)
    else:
        lo = 0
        mid = 0
    if USE_TMA:
        # One (heads, rows, head_dim) descriptor per tensor for this batch, made once: the loop
        # over the group's heads indexes it instead of building a descriptor per head.
        Qd = tl.make_tensor_descriptor(Q + b * stride_qb, [H, N_Q, HEAD_DIM], [stride_qh, stride_qm, 1],
                                       [1, BLOCK_M, BLOCK_D])
        DOd = tl.make_tensor_descriptor(DO + b * stride_dob, [H, N_Q, HEAD_DIM_V], [stride_doh, stride_dom, 1],
                                        [1, BLOCK_M, BLOCK_DV])
    # The group's query heads in order: dK and dV sum over them in registers, deterministically.
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        if USE_TMA:
            Qh = Qd
            DOh = DOd
        else:
            Qh = Q + b * stride_qb + h * stride_qh
            DOh = DO + b * stride_dob + h * stride_doh
        MASKh = MASK + b * stride_mb + h * stride_mh
        LSEh = LSE + bh * 2 * N_Q
        DELTAh = DELTA + bh * N_Q
        rng_base = bh * N_Q
        causal_lo, causal_end, full_start, full_end = lo, mid, mid, N_Q
        if HAS_BOUNDS:  # only the query rows that see some key of this block under the mask
            first, last = _mask_span(COL_BOUNDS + b * stride_cb + h * stride_ch, offs_n, N_K, N_Q, BLOCK_M)
            causal_lo, causal_end = tl.maximum(lo, first), tl.minimum(mid, last)
            full_start, full_end = tl.maximum(mid, first), tl.minimum(N_Q, last)
        if IS_CAUSAL:
            dk, dv = _attn_bwd_dkdv_loop(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, MASKh, seed, rng_base,
                                         offs_m, offs_n, offs_d, offs_dv, stride_qm, stride_qd, stride_dom,
                                         stride_dod, stride_mm, stride_mn, N_Q, N_K, qk_scale, softcap, p_drop,
                                         dropout_scale, causal_lo, causal_end, h, HEAD_DIM, HEAD_DIM_V,
                                         BLOCK_M, True, IS_CAUSAL, MASK_KIND, HAS_DROPOUT, SOFTCAP,
                                         DOT_PRECISION, ACC, USE_TMA)
        dk, dv = _attn_bwd_dkdv_loop(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, MASKh, seed, rng_base,
                                     offs_m, offs_n, offs_d, offs_dv, stride_qm, stride_qd, stride_dom, stride_dod,
                                     stride_mm, stride_mn, N_Q, N_K, qk_scale, softcap, p_drop, dropout_scale,
                                     full_start, full_end, h,
                                     HEAD_DIM, HEAD_DIM_V, BLOCK_M, False, IS_CAUSAL, MASK_KIND, HAS_DROPOUT,
                                     SOFTCAP, DOT_PRECISION, ACC, USE_TMA)

    dk *= sm_scale
    tl.store(_tile(DK + b * stride_dkb + hk * stride_dkh, offs_n, offs_d, stride_dkn, stride_dkd),
             dk.to(DK.dtype.element_ty), mask=k_mask)
    tl.store(_tile(DV + b * stride_dvb + hk * stride_dvh, offs_n, offs_dv, stride_dvn, stride_dvd),
             dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _attn_bwd_dq_loop(dq, q, do, lse, lse_lo, delta, K, V, MASK, DMASK, seed, rng_rows, offs_m, offs_n,
                      offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                      N_Q, N_K, qk_scale, softcap, p_drop, dropout_scale, lo, hi,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                      IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                      MASK_GRAD: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      ACC: tl.constexpr, USE_TMA: tl.constexpr, window=0, HAS_WINDOW: tl.constexpr = False):
    """Accumulates dQ of one query block over the key blocks [lo, hi); with MASK_GRAD, also
    stores each dS tile (= d(mask), the mask being added to the scores) into this (b, h)'s
    dense (N_Q, N_K) slice of DMASK. With USE_TMA, K and V are tensor descriptors."""
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k_mask = mask_d[None, :]
        v_mask = mask_dv[None, :]
        if MASKED:
            k_mask = k_mask & (cols[:, None] < N_K)
            v_mask = v_mask & (cols[:, None] < N_K)
        if USE_TMA:
            k = K.load([start_n, 0])
            v = V.load([start_n, 0])
        else:
            k = tl.load(_tile(K, cols, offs_d, stride_kn, stride_kd), mask=k_mask, other=0.0)
            v = tl.load(_tile(V, cols, offs_dv, stride_vn, stride_vd), mask=v_mask, other=0.0)
        qk, tanh_qk = _scaled(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC), qk_scale,
                              softcap, SOFTCAP)
        qk = _scores(qk, offs_m[:, None], cols[None, :], MASK, stride_mm, stride_mn, N_Q, N_K,
                     MASKED, IS_CAUSAL, MASK_KIND, ACC, window, HAS_WINDOW)
        if MASK_KIND == 2:  # a float mask: L's rounding error counts (_row_stats)
            p = tl.exp2((qk - lse[:, None]) - lse_lo[:, None])
        else:
            p = tl.exp2(qk - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC)
        if HAS_DROPOUT:
            keep = dropout_keep_quads(seed, rng_rows[:, None], cols[None, :], p_drop)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if MASK_GRAD:
            tl.store(DMASK + offs_m[:, None].to(tl.int64) * N_K + cols[None, :], ds.to(DMASK.dtype.element_ty),
                     mask=(offs_m[:, None] < N_Q) & (cols[None, :] < N_K))
        if SOFTCAP:  # the mask is added after the cap: its gradient is dS before the tanh's factor
            ds = ds * (1.0 - tanh_qk * tanh_qk)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=ACC)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V,  # in, as the forward
    MASK,  # in, as the forward
    SEED,  # in (1,) int64; unused unless HAS_DROPOUT
    DO,  # in (B, H, N_Q, HEAD_DIM_V)
    LSE,  # in (B, H, 2, N_Q) from the forward
    DELTA,  # in (B, H, N_Q) rowsum(dO * O)
    DQ,  # out (B, H, N_Q, HEAD_DIM)
    DMASK,  # out (B, H, N_Q, N_K) contiguous, fp32 (fp64 for fp64): dS; unused unless MASK_GRAD
    ROW_BOUNDS,  # in, as the forward's; unused unless HAS_BOUNDS (never with MASK_GRAD: dS is dense)
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_rb, stride_rh,
    H, N_Q, N_K, GROUP, sm_scale, qk_scale, softcap, p_drop, dropout_scale,
    Q_BUCKET, K_BUCKET,  # unused in the kernel: the tuner keys on these buckets on the host
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    MASK_GRAD: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr,
    USE_TMA: tl.constexpr,  # K and V streamed through tensor descriptors (see _tma_ok)
    HAS_BOUNDS: tl.constexpr = False,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_mask = (offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(_tile(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qm, stride_qd),
                mask=q_mask, other=0.0)
    do = tl.load(_tile(DO + b * stride_dob + h * stride_doh, offs_m, offs_dv, stride_dom, stride_dod),
                 mask=(offs_m[:, None] < N_Q) & (offs_dv[None, :] < HEAD_DIM_V), other=0.0).to(q.dtype)
    lse, lse_lo, delta = _load_row_stats(LSE + bh * 2 * N_Q, DELTA + bh * N_Q, offs_m, N_Q, MASK_KIND == 2)
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    rng_rows = bh * N_Q + offs_m
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    if USE_TMA:
        K = tl.make_tensor_descriptor(K, [N_K, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, [N_K, HEAD_DIM_V], [stride_vn, 1], [BLOCK_N, BLOCK_DV])
    MASK += b * stride_mb + h * stride_mh
    if MASK_GRAD:
        DMASK += bh * N_Q * N_K

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    n_full, hi = _key_blocks(start_m, N_K, BLOCK_M, BLOCK_N, IS_CAUSAL)
    lo, full_end, masked_start = 0, n_full, n_full
    if HAS_BOUNDS:  # as the forward
        lo, last = _mask_span(ROW_BOUNDS + b * stride_rb + h * stride_rh, offs_m, N_Q, N_K, BLOCK_N)
        full_end, masked_start, hi = tl.minimum(n_full, last), tl.maximum(n_full, lo), tl.minimum(hi, last)
    dq = _attn_bwd_dq_loop(dq, q, do, lse, lse_lo, delta, K, V, MASK, DMASK, seed, rng_rows, offs_m, offs_n,
                           offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                           N_Q, N_K, qk_scale, softcap, p_drop, dropout_scale, lo, full_end,
                           HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, IS_CAUSAL, MASK_KIND, HAS_DROPOUT, MASK_GRAD, SOFTCAP,
                           DOT_PRECISION, ACC, USE_TMA)
    dq = _attn_bwd_dq_loop(dq, q, do, lse, lse_lo, delta, K, V, MASK, DMASK, seed, rng_rows, offs_m, offs_n,
                           offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
                           N_Q, N_K, qk_scale, softcap, p_drop, dropout_scale, masked_start, hi,
                           HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, IS_CAUSAL, MASK_KIND, HAS_DROPOUT, MASK_GRAD, SOFTCAP,
                           DOT_PRECISION, ACC, USE_TMA)
    dq *= sm_scale
    tl.store(_tile(DQ + b * stride_dqb + h * stride_dqh, offs_m, offs_d, stride_dqm, stride_dqd),
             dq.to(DQ.dtype.element_ty), mask=q_mask)


# =============================================================================================
# Block sizes. Each kernel is autotuned over a short list per (padded head dim, element size);
# the first entry is the default (used under the interpreter and with TRIFUSE_AUTOTUNE=0) and
# always fits. Entries whose tiles cannot fit the device's shared memory are dropped up front.
# Tuning is keyed on the sequence-length buckets and the constexpr features, not on exact
# lengths, so variable-length training does not retune at every new length.
# =============================================================================================

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and padded head dim. Forward and dQ walk
# tall query blocks, dK/dV tall key blocks. Compiled for sm_90 by Triton 3.6 and 3.9
# (bench/compile_sm90.py --spaces; bench/results/sm90_compile.md), every default runs without
# register spills but dK/dV at head dim 128 with dropout on 3.9 (16 bytes) and, with
# TRIFUSE_ATTENTION_TMA=1, the forward at 128 with dropout on 3.6 (40 bytes); a mask or dropout
# costs registers, and the lighter entries are there for the tuner.
_SHAPES_16BIT = {
    "fwd": {
        64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4),
             (64, 32, 4, 3)],
        128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3),
              (64, 128, 8, 3)],
        256: [(128, 32, 8, 2), (64, 32, 8, 2), (128, 64, 8, 1), (64, 16, 4, 2), (128, 16, 8, 2)],
    },
    "dq": {
        64: [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
        128: [(128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3)],
        256: [(128, 16, 8, 2), (64, 32, 8, 2), (64, 16, 4, 2), (128, 32, 8, 1)],
    },
    "dkdv": {
        64: [(32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 8, 3), (32, 64, 4, 2)],
        128: [(16, 128, 8, 2), (32, 64, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2), (32, 32, 8, 2)],
        256: [(32, 32, 8, 2), (16, 32, 4, 2), (16, 64, 8, 2)],
    },
}
# 4- and 8-byte elements: IEEE fp32 (fp64) dots run on CUDA cores, with both operands in
# registers; they are for accuracy, not speed, and need small tiles to avoid spilling.
_SHAPES_WIDE = {
    "fwd": {64: [(64, 32, 8, 2), (32, 32, 4, 2)], 128: [(32, 16, 8, 2), (16, 32, 8, 2)],
            256: [(32, 16, 8, 1), (16, 16, 4, 1)]},
    "dq": {64: [(32, 32, 4, 2), (64, 32, 8, 2)], 128: [(32, 16, 8, 2), (16, 16, 4, 2)],
           256: [(16, 16, 4, 1)]},
    "dkdv": {64: [(32, 32, 8, 2), (16, 32, 4, 2)], 128: [(16, 16, 4, 2), (16, 32, 4, 2)],
             256: [(16, 16, 8, 1)]},
}
# Under the interpreter blocks are small and unequal, so that tests at sequence lengths <= 64
# cross block boundaries, the diagonal and ragged last blocks.
_INTERPRET_SHAPES = {"fwd": (32, 16, 4, 1), "dq": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1)}

_DEFAULT_SMEM = 100 * 1024


@functools.cache
def _smem_limit(device_index: int) -> int:
    """Shared memory one program may use (bytes)."""
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props.get("max_shared_mem", _DEFAULT_SMEM))


def _smem_bytes(kind: str, bm: int, bn: int, stages: int, block_d: int, itemsize: int,
                block_dv: int | None = None) -> int:
    """Rough shared-memory need: the tiles held whole, the pipelined ones times the stages, and
    one (BLOCK_M, BLOCK_N) layout-conversion buffer. block_dv: the value head dim's block
    (default block_d)."""
    both = block_d + (block_d if block_dv is None else block_dv)  # a K-and-V or a Q-and-dO pair
    if kind == "dkdv":
        held, streamed = bn * both, bm * both
    elif kind == "dq":
        held, streamed = bm * both, bn * both
    else:
        held, streamed = bm * block_d, bn * both
    return itemsize * (held + max(stages, 1) * streamed + bm * bn)


# A mask tile costs registers: the 16-bit head-dim-64 forward default spills with a boolean or
# float mask (24 and 8 bytes, sm_90), where 8 warps of the same tile do not.
_MASKED_16BIT_DEFAULT = {("fwd", 64): (128, 64, 8, 3)}
# So do dropout's Philox draws (sm_90, Triton 3.9; bench/compile_sm90.py --spaces --only
# attention_dropout): at head dim 64 the forward and dQ defaults spill (72-88 and 48 bytes of
# stack: GPT-2's and BERT's attention in training). At 128 every dK/dV entry spills (72 bytes at
# the default, up to 368) but 32 x 32, which loses the warpgroup MMA (no HGMMA): left to the tuner.
_DROPOUT_16BIT_DEFAULT = {("fwd", 64): (128, 64, 8, 3), ("dq", 64): (128, 64, 8, 3)}


def _configs(kind: str, block_d: int, itemsize: int, smem: int, mask: int = 0, dropout: bool = False,
             tma: bool = False, block_dv: int | None = None) -> list[triton.Config]:
    """The autotuning list for one kernel, head-dim class and element size (first = default; with
    a mask or dropout, an entry that does not spill). With `tma` (_tma_ok) the list is each block
    shape with USE_TMA first, then without. A value head dim other than the query's (block_dv)
    takes the class of the wider of the two."""
    if INTERPRET:
        shapes = [_INTERPRET_SHAPES[kind]]
    else:
        widest = max(block_d, block_d if block_dv is None else block_dv)
        d_class = 64 if widest <= 64 else 128 if widest <= 128 else 256
        shapes = (_SHAPES_WIDE if itemsize >= 4 else _SHAPES_16BIT)[kind][d_class]
        masked = _MASKED_16BIT_DEFAULT.get((kind, d_class)) if mask and itemsize < 4 else None
        if dropout and itemsize < 4:
            masked = _DROPOUT_16BIT_DEFAULT.get((kind, d_class), masked)
        if masked is not None:
            shapes = [masked] + [s for s in shapes if s != masked]
        fits = [s for s in shapes if _smem_bytes(kind, s[0], s[1], s[3], block_d, itemsize, block_dv) <= smem]
        shapes = [shapes[0]] + [s for s in fits if s != shapes[0]]
    uses = (True, False) if tma else (None,)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, **({} if use is None else {"USE_TMA": use})},
                          num_warps=w, num_stages=s)
            for use in uses for bm, bn, w, s in shapes]


_KERNELS = {"fwd": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel, "dq": _attn_bwd_dq_kernel}


_KEY_NAMES = ("device", "block_d", "itemsize", "smem", "q_bucket", "k_bucket", "head_dim", "causal", "mask",
              "dropout", "dtype", "tma", "block_dv")


def _config_meta(cfg: triton.Config) -> dict:
    """A config as launch keywords: its block sizes and launch options."""
    meta = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if getattr(cfg, "num_ctas", 1) != 1:
        meta["num_ctas"] = cfg.num_ctas
    if getattr(cfg, "maxnreg", None) is not None:
        meta["maxnreg"] = cfg.maxnreg
    return meta


_TUNERS = {kind: Tuner(f"attention_{kind}", functools.partial(_configs, kind), _KEY_NAMES) for kind in _KERNELS}
_FWD = CachedKernel(_attn_fwd_kernel)
_BWD_PREPROCESS = CachedKernel(_attn_bwd_preprocess_kernel)
_BWD_DKDV = CachedKernel(_attn_bwd_dkdv_kernel)
_BWD_DQ = CachedKernel(_attn_bwd_dq_kernel)
_CACHED = {"fwd": _FWD, "dkdv": _BWD_DKDV, "dq": _BWD_DQ}

# Launch plans per exact call shape (_plan_key): the grid and every launch keyword (constexprs,
# block sizes, num_warps, num_stages) of each kernel, so that a repeated shape costs one dict
# lookup and one direct launch per kernel: no tuner key, no grid arithmetic, no dict merging.
# Stored only once the tuner has decided (not while a CUDA graph is captured). Bounded like
# CachedKernel: a process that sees endlessly many shapes starts over.
# _FWD_PLANS[key] = (grid, meta); _BWD_PLANS[key] = (pre_grid, pre_meta, dkdv_grid, dkdv_meta, dq_grid, dq_meta)
_FWD_PLANS: dict[tuple, tuple] = {}
_BWD_PLANS: dict[tuple, tuple] = {}


def _plan_key(q: torch.Tensor, bsz: int, h: int, h_kv: int, sq: int, sk: int, d: int, dv: int, is_causal: bool,
              mask_kind: int, has_dropout: bool, mask_grad: bool = False, softcap: bool = False,
              tma: bool = False, sinks: bool = False, bounds: bool = False) -> tuple:
    return (q.get_device() if q.is_cuda else -1, q.dtype, bsz, h, h_kv, sq, sk, d, dv, is_causal, mask_kind,
            has_dropout, mask_grad, softcap, tma, sinks, bounds)



def _launch_config(cfg: triton.Config, kind: str, grid_fn, args: tuple, constexprs: dict) -> None:
    """One launch of kernel `kind` with config `cfg` (what the tuner times, and the first launch)."""
    meta = {**constexprs, **_config_meta(cfg)}
    _CACHED[kind][grid_fn(meta)](*args, **meta)


def _tuned_launch(kind: str, tuning_key: tuple, grid_fn, args: tuple, constexprs: dict):
    """Launches kernel `kind` with the tuner's config for `tuning_key` (timing the configs first
    when this key is new). Returns (grid, meta) of that launch, or None while the tuner has not
    decided for good (inside CUDA-graph capture): then nothing may be planned."""
    tuner = _TUNERS[kind]
    cfg = tuner.config(tuning_key, _launch_config, kind, grid_fn, args, constexprs)
    meta = {**constexprs, **_config_meta(cfg)}
    grid = grid_fn(meta)
    _CACHED[kind][grid](*args, **meta)
    return (grid, meta) if tuner.is_decided(tuning_key) else None


def _tuning_key(q: torch.Tensor, sq: int, sk: int, d: int, block_d: int, is_causal: bool, mask_kind: int,
                has_dropout: bool, tma: bool = False, block_dv: int | None = None) -> tuple:
    """The tuner's key (_KEY_NAMES): block sizes depend on these, not on exact lengths."""
    device = q.get_device() if q.is_cuda else -1
    smem = _smem_limit(device) if q.is_cuda else _DEFAULT_SMEM
    return (device, block_d, q.element_size(), smem, _bucket(sq), _bucket(sk), d, is_causal, mask_kind,
            has_dropout, q.dtype, tma, block_d if block_dv is None else block_dv)


# ---------------------------------------------------------------------------------------------
# Tensor descriptors (TMA), opt-in with TRIFUSE_ATTENTION_TMA=1 until measured on
# a GPU: the copy engine needs 16-bit here (the configs are the 16-bit lists), unit stride along
# head_dim, and every address and other stride on a 16-byte grid. The descriptors are built in
# the kernel, in a global scratch buffer per program that Triton's launcher takes from
# `triton.set_allocator`.
# ---------------------------------------------------------------------------------------------


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether the kernels may load these tensors through descriptors (USE_TMA): the forward's
    q, k, v, o, the backward's q, k, v, dO."""
    if not attention_tma_requested() or not hasattr(tl, "make_tensor_descriptor"):
        return False
    first = tensors[0]
    if first.element_size() != 2 or not _use_kernels(first):
        return False
    if first.is_cuda:
        # The descriptors' scratch comes from the current device (the launch's): a tensor on
        # another one takes the pointer path.
        if (first.get_device() != torch.cuda.current_device() or device_limits(first.get_device()).capability[0] < 9
                or not hasattr(triton, "set_allocator")):
            return False
        _ensure_scratch_allocator()
    for t in tensors:
        # Every tensor 16-bit (the stride test below counts 2-byte elements): a dO in another
        # dtype than q (the registered backward op does not check it) takes the pointer path.
        if t.dtype != first.dtype or t.stride(-1) != 1 or t.data_ptr() % 16 or any(
                st <= 0 or st * 2 % 16 for st in t.stride()[:-1]):
            return False
    return True


# Triton 3.6 (the H100's) places each program's descriptors in the global scratch at
# (linear program id * scratch bytes per program) computed in 32-bit and sign-extended (the
# sm_90 PTX: `mad.lo.s32; shl.b32 9; cvt.s64.s32`; 3.9 computes it in 64-bit): from 2^31 bytes
# of offset on, programs would write their descriptors before the buffer, over other memory,
# and load through them. Each descriptor takes 128 bytes (global_scratch_size, both Tritons: 512
# for the forward's Q, K, V, O, 256 for the dK/dV pass's Q, dO and for the dQ pass's K, V). The
# bound is taken over the smallest block of any config of the kernel, so that whichever config
# the tuner picks stays under it; it refuses only grids of millions of programs (B*H*Sq >= 2^28
# rows in the forward), which then take the pointer path.
_TMA_SCRATCH_BYTES = {"fwd": 4 * 128, "dkdv": 2 * 128, "dq": 2 * 128}
_TMA_SCRATCH_LIMIT = 2**31


@functools.cache
def _min_block(kind: str) -> int:
    """The fewest rows (queries for fwd and dq, keys for dkdv) one program of `kind` covers in
    any 16-bit config (TMA is 16-bit only; the interpreter's one config there)."""
    axis = 1 if kind == "dkdv" else 0
    shapes = [_INTERPRET_SHAPES[kind]] if INTERPRET else [
        *(s for cls in _SHAPES_16BIT[kind].values() for s in cls),
        *(s for (k, _), s in (*_MASKED_16BIT_DEFAULT.items(), *_DROPOUT_16BIT_DEFAULT.items()) if k == kind)]
    return min(s[axis] for s in shapes)


def _tma_scratch_fits(*launches: tuple[str, int, int]) -> bool:
    """Whether every launch (kind, rows along grid axis 0, programs along axis 1) keeps each
    program's scratch offset under 2^31 bytes with any of its configs."""
    return all(cdiv(rows, _min_block(kind)) * programs * _TMA_SCRATCH_BYTES[kind] < _TMA_SCRATCH_LIMIT
               for kind, rows, programs in launches)


def _aligned_scratch(buf: torch.Tensor, size: int, alignment: int) -> torch.Tensor:
    """`size` bytes of `buf` (allocated with `alignment` bytes to spare) from its first address
    on an `alignment` boundary."""
    start = -buf.data_ptr() % alignment
    return buf[start:start + size]


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # Torch's caching allocator hands out 512-byte aligned blocks, past the 128 bytes the
    # descriptors need (TMA_ALIGN); another allocator behind torch (a pluggable one) need not.
    return _aligned_scratch(torch.empty(size + alignment, dtype=torch.int8, device="cuda"), size, alignment)


def _ensure_scratch_allocator() -> None:
    """Installs a torch-backed allocator for the descriptors' scratch where none is set (Triton's
    default raises). Checked on each call: autograd's backward thread (a recomputed forward under
    checkpointing) starts with Triton's default."""
    from triton.runtime import _allocation

    current = _allocation._allocator.get() if hasattr(_allocation, "_allocator") else None
    if current is None or type(current).__name__ == "NullAllocator":
        triton.set_allocator(_scratch)


# =============================================================================================
# Launchers: check nothing, allocate the outputs, launch. Tensors in, tensors out.
# =============================================================================================


# Head dims below the dots' 16-wide tile are padded with zero columns on the host, so that every
# tile the kernels load is at least 16 columns of real data. On the H200 (Triton 3.6, 2026-12-04;
# bench/bisect_attention_configs.py) the forward with a value head dim of 8 beside a query head dim
# of 24 read V's key rows from 16 on wrong in key blocks of 64 and 128 (errors up to 4e4, then an
# illegal address), where 16 value columns, or key blocks of 32, were right; the interpreter never
# showed it. A zero column adds nothing to q.k and its output column is cut off; only toy heads
# are this narrow, so the copies cost no real model anything.
_MIN_HEAD_DIM = 16


def pad_head_dim(t: torch.Tensor) -> torch.Tensor:
    """`t` with zero columns appended along its last (head) dim up to _MIN_HEAD_DIM; `t` itself
    when it is that wide already."""
    width = t.shape[-1]
    return t if width >= _MIN_HEAD_DIM else torch.nn.functional.pad(t, (0, _MIN_HEAD_DIM - width))


def _block_d(d: int) -> int:
    return max(16, next_power_of_2(d))  # tl.dot needs every dimension >= 16


def _bucket(n: int) -> int:
    return min(next_power_of_2(n), 16384)


def _use_kernels(q: torch.Tensor) -> bool:
    """Triton on CUDA and in the interpreter, except fp64 on a real GPU: Triton's fp64 MMA
    has no large-K form ("fp64 don't support largeK MMA" on Hopper), and fp64 is a gradcheck
    dtype, not a training one; the fp64 kernel path is exercised in the interpreter."""
    return use_triton(q) and not (q.dtype == torch.float64 and q.is_cuda)


def _dot_precision(dtype: torch.dtype) -> str | None:
    """IEEE for fp32/fp64 (fp32 really is fp32, no TF32); the default for 16-bit operands."""
    return "ieee" if dtype in (torch.float32, torch.float64) else None


def _dropout_scale(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def _score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, softcap) as the kernels take them (_scaled): base 2, the cap folded in."""
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _output_like(q: torch.Tensor, dv: int) -> torch.Tensor:
    """The output (B, Hq, Sq, dv): like q when dv is q's head dim (empty_like keeps a dense q's
    layout), else contiguous, or a (B, S, H, dv) transpose when q is one (the projection view),
    so that the output's transpose back is contiguous there too. (Under fake tensors with
    dynamic shapes the head dims may be two symbols: v's is the output's unless they are
    provably one, never a guess from their example sizes.)"""
    if statically_known_true(dv == q.shape[3]):
        return torch.empty_like(q)
    bsz, h, sq, _ = q.shape
    if q.stride(1) < q.stride(2) and q.transpose(1, 2).is_contiguous():
        return q.new_empty((bsz, sq, h, dv)).transpose(1, 2)
    return q.new_empty((bsz, h, sq, dv))


def _sinks_arg(sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sinks (Hq,) as the kernels read them: contiguous, in the statistics' dtype."""
    return sinks.to(_stat_dtype(dtype)).contiguous()


def _sinks_grad(sinks: torch.Tensor, lse2: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dsinks (Hq,) in the sinks' dtype: -sum over batch and rows of P_sink * delta, where
    P_sink = exp2(s_h log2(e) - L) (L (B, Hq, Sq), base 2, includes the sink, so P_sink <= 1; a
    sink of -inf has P_sink = 0, also in the rows where L = -inf)."""
    s = sinks.to(lse2.dtype)[None, :, None] * LOG2E
    p_sink = torch.where(torch.isneginf(s), 0.0, torch.exp2(s - lse2))
    return (-(p_sink * delta).sum((0, 2))).to(sinks.dtype)


def _row_lse2(stats: torch.Tensor) -> torch.Tensor:
    """L in base 2, (B, Hq, Sq), from the dense kernels' (B, Hq, 2, Sq) hi and lo (_row_stats)."""
    return stats[:, :, 0] + stats[:, :, 1]


def _mask_arg(attn_mask: torch.Tensor | None, shape: tuple[int, int, int, int], fallback: torch.Tensor):
    """(tensor, strides, kind) for the kernels: the mask expanded to (B, H, Sq, Sk) as a view
    (stride 0 on broadcast dims, nothing copied), bools reinterpreted as uint8."""
    if attn_mask is None:
        return fallback, (0, 0, 0, 0), _NO_MASK
    m = attn_mask.expand(shape)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), m.stride(), _BOOL_MASK
    return m, m.stride(), _FLOAT_MASK


# An additive mask entry at or below this masks its key (transformers' masks use the dtype's
# minimum; fp16's is -65504): exp underflows to exactly 0 for it whenever the row has any key
# that is not masked (scaled scores within ~6e4 of each other). Between it and 0: a bias, not a
# mask (also attention_varlen.py's packed-mask check).
_MASKED_AT_OR_BELOW = -65504.0
# Keys below which the mask's bounds are not worth their host time (a few torch ops per mask).
_BOUNDS_MIN_KEYS = 0 if INTERPRET else 256
# mask (its base tensor) -> (version, view and lengths, bounds): one computation per mask, which a
# model's layers share (transformers builds one per forward); never kept across CUDA-graph
# capture, whose replays may rewrite the mask's memory without a version change, nor for
# inference tensors (no version counter).
_MASK_BOUNDS = torch.utils.weak.WeakTensorKeyDictionary()


def _mask_bounds(attn_mask: torch.Tensor | None, sq: int, sk: int, mask_grad: bool = False):
    """(row_bounds, row_strides, col_bounds, col_strides) for the kernels' HAS_BOUNDS, or None.

    row_bounds (b, h, 2, sq) int32 holds, for each query row of the mask (b and h as the mask
    has them, 1 where it broadcasts), the first and one-past-last key it does not mask (all keys
    for a row it masks whole); col_bounds (b, h, 2, sk) the same for each key over the query
    rows (none for a key that no row sees: its dK and dV are 0). The kernels then visit only
    the key blocks (query blocks, in dK/dV) within the span of their lines: padding, the other
    sequences of a packed batch, what a sliding window leaves, all skipped with no host sync.
    None without a mask, with a mask gradient (dS is stored dense), or below _BOUNDS_MIN_KEYS
    keys."""
    if attn_mask is None or mask_grad or attn_mask.requires_grad or sk < _BOUNDS_MIN_KEYS or sq * sk == 0:
        return None  # a learned bias (T5's) masks nothing
    base = attn_mask if attn_mask._base is None else attn_mask._base
    # Inference tensors keep no version counter: nothing to validate a cached entry by.
    if base.is_inference() or (attn_mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _compute_mask_bounds(attn_mask, sq, sk)
    view = (tuple(attn_mask.shape), attn_mask.stride(), attn_mask.storage_offset(), sq, sk)
    seen = _MASK_BOUNDS.get(base)
    if seen is None or seen[0] != base._version or seen[1] != view:
        seen = (base._version, view, _compute_mask_bounds(attn_mask, sq, sk))
        _MASK_BOUNDS[base] = seen
    return seen[2]


def _compute_mask_bounds(attn_mask: torch.Tensor, sq: int, sk: int):
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    keep = m if m.dtype == torch.bool else m > _MASKED_AT_OR_BELOW
    b, h = keep.shape[0], keep.shape[1]
    keep = keep.expand(b, h, sq, sk)
    # A row the mask masks whole sees every key, as the kernels compute it without bounds (zeros
    # under a bool mask, the average of V under a float one at the dtype's minimum). One byte an
    # entry: argmax finds the first visible key (the first maximum), of the flipped the last.
    sees = (keep | ~keep.any(-1, keepdim=True)).view(torch.uint8)

    def spans(dim: int, n: int) -> torch.Tensor:  # (first, one past last) along `dim`
        first = sees.argmax(dim)
        last = n - sees.flip(dim).argmax(dim)
        if dim == -2:  # a key no row sees: none visited
            seen = sees.amax(dim).bool()
            first, last = first.masked_fill(~seen, n), last.masked_fill(~seen, 0)
        return torch.stack((first, last), dim=-2).to(torch.int32).contiguous()

    rows, cols = spans(-1, sk), spans(-2, sq)

    def strides(t: torch.Tensor) -> tuple[int, int]:  # 0 along the dims the mask broadcasts
        return (t.stride(0) if b > 1 else 0, t.stride(1) if h > 1 else 0)

    return rows, strides(rows), cols, strides(cols)


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    seed: torch.Tensor | None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o, lse): o (B, Hq, Sq, Dv) laid out like q (_output_like); lse (B, Hq, 2, Sq) in
    fp32 (fp64 for fp64), each row's log-sum-exp in base 2 as hi + lo (`_row_stats`; `_row_lse2`
    sums them), the sinks included. `seed` is the Philox seed (1,) int64 when dropout_p > 0;
    `softcap` > 0 caps the scaled scores (0: no cap); `sinks` (Hq,), any float dtype, or None."""
    bsz, h, sq, d = q.shape
    h_kv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    o = _output_like(q, dv)
    lse = torch.empty((bsz, h, 2, sq), dtype=_stat_dtype(q.dtype), device=q.device)
    if o.numel() == 0:
        return o, lse
    if not _use_kernels(q):
        o_t, lse_t = _attention_fwd_torch(q, k, v, attn_mask, dropout_p, is_causal, scale, seed, softcap, sinks)
        lse[:, :, 0], lse[:, :, 1] = lse_t * LOG2E, 0.0
        return o.copy_(o_t), lse
    if sk == 0:  # every row sees the sink alone: L = s_h
        lse[:, :, 0] = float("-inf") if sinks is None else sinks.to(lse.dtype)[None, :, None] * LOG2E
        lse[:, :, 1] = 0.0
        return o.zero_(), lse
    if min(d, dv) < _MIN_HEAD_DIM:
        o_wide, lse = attention_fwd(pad_head_dim(q), pad_head_dim(k), pad_head_dim(v), attn_mask, dropout_p,
                                    is_causal, scale, seed, softcap, sinks)
        return o.copy_(o_wide[..., :dv]), lse
    mask, sm, mask_kind = _mask_arg(attn_mask, (bsz, h, sq, sk), q)
    has_dropout = dropout_p > 0.0
    has_sinks = sinks is not None
    bounds = _mask_bounds(attn_mask, sq, sk)
    row_bounds, row_strides = (q, (0, 0)) if bounds is None else bounds[:2]
    args = (q, k, v, mask, seed if has_dropout else q, _sinks_arg(sinks, q.dtype) if has_sinks else q, o, lse,
            row_bounds, *q.stride(), *k.stride(), *v.stride(), *sm, *o.stride(), *row_strides,
            h, sq, sk, h // h_kv, *_score_scales(scale, softcap), dropout_p, _dropout_scale(dropout_p),
            _bucket(sq), _bucket(sk))
    tma = _tma_ok(q, k, v, o) and _tma_scratch_fits(("fwd", sq, bsz * h))
    key = _plan_key(q, bsz, h, h_kv, sq, sk, d, dv, is_causal, mask_kind, has_dropout, False, softcap > 0.0, tma,
                    has_sinks, bounds is not None)
    plan = _FWD_PLANS.get(key)
    if plan is not None:
        _FWD.run(plan[0], args, plan[1])
        return o, lse
    block_d, block_dv = _block_d(d), _block_d(dv)
    # Block sizes are tuned without the soft cap or the sinks in the key (one tuner key per shape
    # bucket): the cap adds elementwise work, the sinks one load per program, neither tiles.
    constexprs = dict(HEAD_DIM=d, BLOCK_D=block_d, HEAD_DIM_V=dv, BLOCK_DV=block_dv, IS_CAUSAL=is_causal,
                      MASK_KIND=mask_kind, HAS_DROPOUT=has_dropout, SOFTCAP=softcap > 0.0,
                      DOT_PRECISION=_dot_precision(q.dtype), ACC=acc_dtype(q.dtype), USE_TMA=False,
                      HAS_SINKS=has_sinks, HAS_BOUNDS=bounds is not None)
    planned = _tuned_launch("fwd", _tuning_key(q, sq, sk, d, block_d, is_causal, mask_kind, has_dropout, tma,
                                               block_dv),
                            lambda meta: (cdiv(sq, meta["BLOCK_M"]), bsz * h), args, constexprs)
    if planned is not None:
        store_plan(_FWD_PLANS, key, planned)
    return o, lse


def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    mask_grad: bool = False,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Returns (dq, dk, dv, dmask, dsinks): dq, dk, dv shaped and laid out like q, k, v (contiguous
    when those are not dense); dmask, with `mask_grad` (a float attn_mask), in the mask's shape and
    dtype (summed over the dims it broadcasts along), else None; dsinks (Hq,) in the sinks' dtype
    with `sinks`, else None. `lse` is the forward's (B, Hq, 2, Sq), which includes the sinks.

    dmask is dS, which the dQ kernel writes into a dense (B, Hq, Sq, Sk) buffer (fp32; fp64 for
    fp64) before the host sums the broadcast dims: O(B Hq Sq Sk) extra memory for this call, as
    SDPA's math and efficient backends need for the same gradient."""
    bsz, h, sq, d = q.shape
    h_kv, sk, d_v = k.shape[1], k.shape[2], v.shape[3]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:  # O = 0, so delta = 0 and dsinks = 0
        dmask = torch.zeros_like(attn_mask, memory_format=torch.contiguous_format) if mask_grad else None
        return dq.zero_(), dk.zero_(), dv.zero_(), dmask, None if sinks is None else torch.zeros_like(sinks)
    if not _use_kernels(q):
        grads = _attention_bwd_torch(do, q, k, v, o, seed, attn_mask, dropout_p, is_causal, scale, mask_grad,
                                     softcap, sinks)
        dmask = _reduce_mask_grad(grads[3], attn_mask) if mask_grad else None
        dsinks = None if sinks is None else _sinks_grad(sinks, _row_lse2(lse), grads[4])
        return dq.copy_(grads[0]), dk.copy_(grads[1]), dv.copy_(grads[2]), dmask, dsinks
    if min(d, d_v) < _MIN_HEAD_DIM:
        dq_wide, dk_wide, dv_wide, dmask, dsinks = attention_bwd(
            pad_head_dim(do), pad_head_dim(q), pad_head_dim(k), pad_head_dim(v), pad_head_dim(o), lse, seed,
            attn_mask, dropout_p, is_causal, scale, mask_grad, softcap, sinks)
        return dq.copy_(dq_wide[..., :d]), dk.copy_(dk_wide[..., :d]), dv.copy_(dv_wide[..., :d_v]), dmask, dsinks
    mask, sm, mask_kind = _mask_arg(attn_mask, (bsz, h, sq, sk), q)
    has_dropout = dropout_p > 0.0
    delta = lse.new_empty((bsz, h, sq))
    seed_arg = seed if has_dropout else q
    ds = None
    if mask_grad:
        # Causal: key blocks past the diagonal are never visited, and their dS is 0.
        ds = (torch.zeros if is_causal else torch.empty)((bsz, h, sq, sk), dtype=lse.dtype, device=q.device)
    tail = (scale, *_score_scales(scale, softcap), dropout_p, _dropout_scale(dropout_p), _bucket(sq), _bucket(sk))
    bounds = _mask_bounds(attn_mask, sq, sk, mask_grad)
    row_bounds, row_strides, col_bounds, col_strides = (q, (0, 0), q, (0, 0)) if bounds is None else bounds
    pre_args = (o, do, delta, *o.stride(), *do.stride(), h, sq)
    dkdv_args = (q, k, v, mask, seed_arg, do, lse, delta, dk, dv, col_bounds,
                 *q.stride(), *k.stride(), *v.stride(), *sm, *do.stride(), *dk.stride(), *dv.stride(),
                 *col_strides,
                 h, h_kv, sq, sk, h // h_kv, *tail)
    dq_args = (q, k, v, mask, seed_arg, do, lse, delta, dq, q if ds is None else ds, row_bounds,
               *q.stride(), *k.stride(), *v.stride(), *sm, *do.stride(), *dq.stride(), *row_strides,
               h, sq, sk, h // h_kv, *tail)
    # dQ, dK, dV are stored through pointers
    tma = _tma_ok(q, k, v, do) and _tma_scratch_fits(("dkdv", sk, bsz * h_kv), ("dq", sq, bsz * h))
    key = _plan_key(q, bsz, h, h_kv, sq, sk, d, d_v, is_causal, mask_kind, has_dropout, mask_grad, softcap > 0.0,
                    tma, False, bounds is not None)
    plan = _BWD_PLANS.get(key)
    if plan is not None:
        _BWD_PREPROCESS.run(plan[0], pre_args, plan[1])
        _BWD_DKDV.run(plan[2], dkdv_args, plan[3])
        _BWD_DQ.run(plan[4], dq_args, plan[5])
        return (dq, dk, dv, None if ds is None else _reduce_mask_grad(ds, attn_mask),
                None if sinks is None else _sinks_grad(sinks, _row_lse2(lse), delta))
    block_d, block_dv = _block_d(d), _block_d(d_v)
    acc = acc_dtype(q.dtype)
    pre_block = 32 if INTERPRET else 64  # small under the interpreter: tests cross its blocks too
    pre_grid = (cdiv(sq, pre_block), bsz * h)
    pre_meta = dict(HEAD_DIM=d_v, BLOCK_D=block_dv, BLOCK_M=pre_block, ACC=acc)  # O and dO: the value's head dim
    _BWD_PREPROCESS.run(pre_grid, pre_args, pre_meta)
    constexprs = dict(HEAD_DIM=d, BLOCK_D=block_d, HEAD_DIM_V=d_v, BLOCK_DV=block_dv, IS_CAUSAL=is_causal,
                      MASK_KIND=mask_kind, HAS_DROPOUT=has_dropout, SOFTCAP=softcap > 0.0,
                      DOT_PRECISION=_dot_precision(q.dtype), ACC=acc, USE_TMA=False,
                      HAS_BOUNDS=bounds is not None)
    tuning_key = _tuning_key(q, sq, sk, d, block_d, is_causal, mask_kind, has_dropout, tma, block_dv)
    planned_dkdv = _tuned_launch("dkdv", tuning_key, lambda meta: (cdiv(sk, meta["BLOCK_N"]), bsz * h_kv),
                                 dkdv_args, constexprs)
    # The dQ kernel's block sizes are tuned without MASK_GRAD: the extra store does not change
    # which tiles fit, and one tuner key per shape bucket keeps tuning off the training loop.
    planned_dq = _tuned_launch("dq", tuning_key, lambda meta: (cdiv(sq, meta["BLOCK_M"]), bsz * h),
                               dq_args, {**constexprs, "MASK_GRAD": mask_grad})
    if planned_dkdv is not None and planned_dq is not None:
        store_plan(_BWD_PLANS, key, (pre_grid, pre_meta, *planned_dkdv, *planned_dq))
    return (dq, dk, dv, None if ds is None else _reduce_mask_grad(ds, attn_mask),
            None if sinks is None else _sinks_grad(sinks, _row_lse2(lse), delta))


def _reduce_mask_grad(ds: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
    """dS (B, Hq, Sq, Sk) summed over the dims along which `attn_mask` broadcasts, in its shape
    and dtype. A dim of the mask with stride 0 but full size is not summed: autograd's expand
    backward sums it into the tensor the mask was expanded from."""
    lead = ds.dim() - attn_mask.dim()
    dims = [i for i in range(ds.dim()) if i < lead or attn_mask.shape[i - lead] == 1 < ds.shape[i]]
    if dims:
        ds = ds.sum(dims, keepdim=True)
    return ds.view(attn_mask.shape).to(attn_mask.dtype)


# ---------------------------------------------------------------------------------------------
# PyTorch path for CPU tensors without the interpreter: same outputs, no Triton. It builds the
# (Sq, Sk) matrices: it exists so models run on CPU, not for speed.
# ---------------------------------------------------------------------------------------------


def _torch_keep_mask(seed: torch.Tensor, shape: tuple[int, ...], p: float) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(int(seed.item()))
    return torch.rand(shape, generator=gen, device=gen.device) >= p


def _torch_probs(q, k, attn_mask, is_causal, scale, softcap=0.0, sinks=None):
    """(P, lse, tanh of the capped scores or None) in the accumulation dtype, lse natural; k
    already repeated over the group. `sinks` join the softmax as one more column, then dropped.
    The backward calls it again: a softmax of the scores stays exact in rows that a float mask
    covers whole at finfo.min, where exp(S - lse) would not (_row_stats)."""
    acc = _stat_dtype(q.dtype)
    s = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    tanh = None
    if softcap:
        tanh = torch.tanh(s / softcap)
        s = softcap * tanh
    sq, sk = s.shape[-2:]
    if is_causal:
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(acc)
    if sinks is not None:
        s = torch.cat([s, sinks.to(acc)[None, :, None, None].expand(*s.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    dead = torch.isneginf(lse)[..., None]
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return p if sinks is None else p[..., :-1], lse, tanh


def _repeat_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _attention_fwd_torch(q, k, v, attn_mask, dropout_p, is_causal, scale, seed, softcap=0.0, sinks=None):
    group = q.shape[1] // k.shape[1]
    p, lse, _ = _torch_probs(q, _repeat_kv(k, group), attn_mask, is_causal, scale, softcap=softcap, sinks=sinks)
    if dropout_p > 0.0:
        keep = _torch_keep_mask(seed, p.shape, dropout_p).to(p.device)
        p = torch.where(keep, p * _dropout_scale(dropout_p), 0.0)
    return p @ _repeat_kv(v, group).to(p.dtype), lse


def _attention_bwd_torch(do, q, k, v, o, seed, attn_mask, dropout_p, is_causal, scale, mask_grad=False,
                         softcap=0.0, sinks=None):
    bsz, h, sq, d = q.shape
    h_kv, sk = k.shape[1], k.shape[2]
    group = h // h_kv
    acc = _stat_dtype(q.dtype)
    kr, vr = _repeat_kv(k, group).to(acc), _repeat_kv(v, group).to(acc)
    p, _, tanh = _torch_probs(q, kr, attn_mask, is_causal, scale, softcap, sinks)
    do_, o_ = do.to(acc), o.to(acc)
    dp = do_ @ vr.transpose(-2, -1)
    pd = p
    if dropout_p > 0.0:
        keep = _torch_keep_mask(seed, p.shape, dropout_p).to(p.device)
        pd = torch.where(keep, p * _dropout_scale(dropout_p), 0.0)
        dp = torch.where(keep, dp * _dropout_scale(dropout_p), 0.0)
    delta = (do_ * o_).sum(-1)
    ds = p * (dp - delta[..., None])
    ds_raw = ds if tanh is None else ds * (1.0 - tanh * tanh)  # the mask's gradient is ds itself
    dq = (ds_raw @ kr) * scale
    dk = (ds_raw.transpose(-2, -1) @ q.to(acc)) * scale
    dv = pd.transpose(-2, -1) @ do_
    dk = dk.view(bsz, h_kv, group, sk, d).sum(2)
    dv = dv.view(bsz, h_kv, group, sk, v.shape[3]).sum(2)
    return dq, dk, dv, ds if mask_grad else None, delta


# =============================================================================================
# Checks, shared by the registered ops (real and fake) and the eager path
# =============================================================================================


def _check_attention_inputs(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        check_tensor(OP, name, t)
        check_float(OP, name, t)
        if t.dim() != 4:
            raise ValueError(
                f"trifuse.{OP}: {name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"trifuse.{OP}: query, key and value must share one dtype, got "
                        f"{q.dtype}, {k.dtype} and {v.dtype}")
    check_same_device(OP, "query", q, key=k, value=v, attn_mask=attn_mask)
    bsz, h, _, d = q.shape
    if k.shape[0] != bsz or v.shape[0] != bsz:
        raise ValueError(f"trifuse.{OP}: query, key and value must have the same batch size, got "
                         f"{bsz}, {k.shape[0]} and {v.shape[0]}")
    if k.shape[3] != d:
        raise ValueError(f"trifuse.{OP}: query and key must have the same head_dim, got {d} and {k.shape[3]}")
    if bsz * h > MAX_BATCH_HEADS:
        raise ValueError(f"trifuse.{OP}: batch * heads must be at most {MAX_BATCH_HEADS} (a CUDA grid "
                         f"limit), got {bsz} * {h}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"trifuse.{OP}: head_dim must be between 1 and {MAX_HEAD_DIM}, got {d}")
    if not 1 <= v.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"trifuse.{OP}: value's head_dim must be between 1 and {MAX_HEAD_DIM}, got {v.shape[3]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"trifuse.{OP}: key and value must have the same heads and seq length, got "
                         f"shapes {tuple(k.shape)} and {tuple(v.shape)}")
    h_kv = k.shape[1]
    if enable_gqa:
        if h_kv == 0 or h % h_kv != 0:
            raise ValueError(f"trifuse.{OP}: with enable_gqa the key/value heads must divide the query "
                             f"heads, got {h} query heads and {h_kv} key/value heads")
    elif h_kv != h:
        raise ValueError(f"trifuse.{OP}: key/value heads ({h_kv}) differ from query heads ({h}); "
                         "pass enable_gqa=True for grouped-query attention")
    if attn_mask is not None:
        check_tensor(OP, "attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"trifuse.{OP}: attn_mask must be bool or floating point, got {attn_mask.dtype}")
        target = (bsz, h, q.shape[2], k.shape[2])
        if attn_mask.dim() > 4 or any(m not in (1, t) for m, t in zip(attn_mask.shape[::-1], target[::-1])):
            raise ValueError(f"trifuse.{OP}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast "
                             f"to (batch, heads, query_len, key_len) = {target}")
        if is_causal:
            raise ValueError(f"trifuse.{OP}: pass either attn_mask or is_causal=True, not both (as SDPA)")
    check_probability(OP, "dropout_p", dropout_p)
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"trifuse.{OP}: scale must be a number or None, got {type(scale).__name__}")


def _check_softcap(softcap: object, op: str = OP) -> None:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"trifuse.{op}: softcap must be a number or None, got {type(softcap).__name__}")
    if not (0.0 <= softcap < float("inf")):
        raise ValueError(f"trifuse.{op}: softcap must be a finite number > 0 (or None / 0 for no cap), got {softcap}")


def _check_sinks(q: torch.Tensor, sinks: object, op: str = OP) -> None:
    """sinks: None, or a float tensor (Hq,) on q's device (any float dtype: read in fp32); q's
    heads are its dim 1, in (B, H, S, D) and in varlen's (T, H, D)."""
    if sinks is None:
        return
    check_tensor(op, "sinks", sinks)
    check_float(op, "sinks", sinks)
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        raise ValueError(f"trifuse.{op}: sinks must be 1-D with one logit per query head ({q.shape[1]}), "
                         f"got shape {tuple(sinks.shape)}")
    check_same_device(op, "query", q, sinks=sinks)


def _check_mask_grad(attn_mask: torch.Tensor | None, mask_grad: bool) -> None:
    if mask_grad and (attn_mask is None or not attn_mask.is_floating_point()):
        got = "no attn_mask" if attn_mask is None else f"a {attn_mask.dtype} attn_mask"
        raise ValueError(f"trifuse.{OP}: mask_grad=True needs a floating-point attn_mask, got {got}")


def _resolve_scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see. The forward returns the output
# plus what the backward needs (the log-sum-exp and the seed; the seed is empty without dropout).
# =============================================================================================

Tensor = torch.Tensor
OptTensor = torch.Tensor | None


def _seed_for(q: torch.Tensor, dropout_p: float) -> torch.Tensor:
    return philox_seed(q.device) if dropout_p > 0.0 else q.new_empty(0, dtype=torch.int64)


@torch.library.custom_op("trifuse::attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: OptTensor, dropout_p: float, is_causal: bool,
                  scale: float | None, enable_gqa: bool, softcap: float = 0.0,
                  sinks: OptTensor = None) -> tuple[Tensor, Tensor, Tensor]:
    _check_attention_inputs(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    _check_softcap(softcap)
    _check_sinks(q, sinks)
    seed = _seed_for(q, dropout_p)
    o, lse = attention_fwd(q, k, v, attn_mask, dropout_p, is_causal, _resolve_scale(scale, q.shape[-1]), seed,
                           softcap, sinks)
    return o, lse, seed


@torch.library.custom_op("trifuse::attention_backward", mutates_args=())
def _attention_backward_op(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, seed: Tensor, attn_mask: OptTensor,
    dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool, mask_grad: bool,
    softcap: float = 0.0, sinks: OptTensor = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dmask, dsinks) for trifuse::attention; dmask is the gradient of a float
    attn_mask, in its shape and dtype, when mask_grad, else an empty tensor; dsinks that of the
    sinks (Hq,) in their dtype, else an empty tensor."""
    _check_attention_inputs(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    _check_mask_grad(attn_mask, mask_grad)
    _check_softcap(softcap)
    _check_sinks(q, sinks)
    dq, dk, dv, dmask, dsinks = attention_bwd(do, q, k, v, o, lse, seed, attn_mask, dropout_p, is_causal,
                                              _resolve_scale(scale, q.shape[-1]), mask_grad, softcap, sinks)
    return (dq, dk, dv, q.new_empty(0) if dmask is None else dmask,
            q.new_empty(0) if dsinks is None else dsinks)


@_attention_op.register_fake
def _(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap=0.0, sinks=None):
    _check_attention_inputs(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    _check_softcap(softcap)
    _check_sinks(q, sinks)
    lse = q.new_empty((*q.shape[:2], 2, q.shape[2]), dtype=_stat_dtype(q.dtype))
    return _output_like(q, v.shape[3]), lse, q.new_empty(1 if dropout_p > 0.0 else 0, dtype=torch.int64)


@_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, seed, attn_mask, dropout_p, is_causal, scale, enable_gqa, mask_grad, softcap=0.0,
      sinks=None):
    _check_attention_inputs(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    _check_mask_grad(attn_mask, mask_grad)
    _check_softcap(softcap)
    _check_sinks(q, sinks)
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad else q.new_empty(0)
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask, dsinks


def _setup_attention(ctx, inputs, output):
    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, *rest = inputs
    softcap, sinks = (*rest, *(0.0, None)[len(rest):])  # trailing defaults may be left out
    o, lse, seed = output
    ctx.save_for_backward(q, k, v, o, lse, seed, attn_mask, sinks)
    ctx.args = (dropout_p, is_causal, scale, enable_gqa)
    ctx.softcap = softcap


def _registered_twice(ctx, do, *_):
    """_attention_twice for the registered op: inputs (q, k, v, attn_mask, dropout_p, is_causal,
    scale, enable_gqa, softcap, sinks), scale unresolved."""
    dropout_p, is_causal, scale, _ = ctx.args
    needs = (*ctx.needs_input_grad, False, False)  # trailing defaults left out of a call have no entry
    view = ctx_as(ctx, (*needs[:4], False, False, False, False, needs[9]), softcap=ctx.softcap,
                  args=(dropout_p, is_causal, _resolve_scale(scale, ctx.saved_tensors[0].shape[-1])))
    dq, dk, dv, dmask, *_, dsinks = _attention_twice(view, do)
    return dq, dk, dv, dmask, None, None, None, None, None, dsinks


@single_backward(twice=_registered_twice, op="attention")
def _backward_attention(ctx, do, *_):
    q, k, v, o, lse, seed, attn_mask, sinks = ctx.saved_tensors
    mask_grad = ctx.needs_input_grad[3]
    dq, dk, dv, dmask, dsinks = torch.ops.trifuse.attention_backward(do, q, k, v, o, lse, seed, attn_mask, *ctx.args,
                                                                     mask_grad, ctx.softcap, sinks)
    return (dq, dk, dv, dmask if mask_grad else None, None, None, None, None, None,
            dsinks if sinks is not None else None)


torch.library.register_autograd("trifuse::attention", _backward_attention, setup_context=_setup_attention)


# =============================================================================================
# Eager fast path: a thin autograd.Function straight over the launchers (a registered op costs
# ~60-150 us of host time per call; see DESIGN.md "Host overhead"). Same launchers, same bits.
# =============================================================================================


@triton.jit
def _dropout_keep_kernel(SEED, KEEP, n_rows, n_cols, p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """KEEP (n_rows, n_cols) int8: the kernels' dropout decisions, row (b * Hq + h) * Sq + i,
    column the key (dropout_keep_quads: the same draws whatever the block)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep_quads(tl.load(SEED), rows[:, None], cols[None, :], p)
    inside = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    tl.store(KEEP + rows[:, None] * n_cols + cols[None, :], keep.to(tl.int8), mask=inside)


_dropout_keep = CachedKernel(_dropout_keep_kernel)


def dropout_keep(seed: torch.Tensor, shape: tuple[int, int, int, int], p: float,
                 q: torch.Tensor) -> torch.Tensor:
    """The (B, Hq, Sq, Sk) bool mask the attention kernels keep under dropout p with `seed` (the
    torch path's, where q's call took it): O(Sq Sk) memory, for a double backward only."""
    device = q.device
    if not _use_kernels(q):
        return _torch_keep_mask(seed, shape, p).to(device)
    n_cols = shape[-1]
    n_rows = math.prod(shape) // n_cols if n_cols else 0
    keep = torch.empty(shape, dtype=torch.int8, device=device)
    if keep.numel():
        grid = (cdiv(n_rows, 32), cdiv(n_cols, 64))
        _dropout_keep[grid](seed, keep, n_rows, n_cols, p, BLOCK_M=32, BLOCK_N=64)
    return keep.bool()


def _attention_twice(ctx, do):
    """The backward in PyTorch ops, differentiable again (create_graph=True): SDPA's math on the
    saved q, k, v (and mask, sinks), the dropout mask materialized from the forward's seed.
    O(Sq Sk) memory, as PyTorch's own double backward through SDPA's math backend."""
    q, k, v, o, lse, seed, attn_mask, sinks = ctx.saved_tensors
    dropout_p, is_causal, scale = ctx.args
    group = q.shape[1] // k.shape[1]
    keep = None
    if dropout_p > 0.0:
        keep = dropout_keep(seed, (*q.shape[:3], k.shape[2]), dropout_p, q)

    def forward(q, k, v, attn_mask, sinks):
        p, _, _ = _torch_probs(q, _repeat_kv(k, group), attn_mask, is_causal, scale, ctx.softcap, sinks)
        if keep is not None:
            p = torch.where(keep, p * _dropout_scale(dropout_p), 0.0)
        return (p @ _repeat_kv(v, group).to(p.dtype)).to(o.dtype)

    needs = ctx.needs_input_grad
    dq, dk, dv, dmask, dsinks = reference_grads(forward, (q, k, v, attn_mask, sinks),
                                                (*needs[:4], needs[8]), (do,))
    return dq, dk, dv, dmask, None, None, None, None, dsinks


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, softcap, sinks):
        seed = philox_seed(q.device) if dropout_p > 0.0 else None
        o, lse = attention_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale, seed, softcap, sinks)
        ctx.save_for_backward(q, k, v, o, lse, seed, attn_mask, sinks)
        ctx.args = (dropout_p, is_causal, scale)
        ctx.softcap = softcap
        return o

    @staticmethod
    @single_backward(twice=_attention_twice)
    def backward(ctx, do):
        q, k, v, o, lse, seed, attn_mask, sinks = ctx.saved_tensors
        dropout_p, is_causal, scale = ctx.args
        with profiled("trifuse::attention_backward"):
            dq, dk, dv, dmask, dsinks = attention_bwd(do, q, k, v, o, lse, seed, attn_mask, dropout_p, is_causal,
                                                      scale, ctx.needs_input_grad[3], ctx.softcap,
                                                      sinks if ctx.needs_input_grad[8] else None)
        return dq, dk, dv, dmask, None, None, None, None, dsinks


# =============================================================================================
# Dialect: trifuse's kernels, PyTorch's SDPA with one backend forced (flash, efficient, cuDNN),
# and flash-attn or xformers when importable; the fastest correct one chosen once per (device,
# dtype, shape buckets, flags) on the GPU and cached on disk (autotune/dialects.py). Traced
# calls (torch.compile, export) always see trifuse::attention.
#
# Every candidate's `supports` gives the reason it cannot take a call (device, dtype, head dim,
# mask kind, dropout, GQA, causal alignment; "not installed" comes from `requires`). Calls with a
# soft cap or attention sinks never reach the dialect: SDPA, flash-attn (2) and xformers take
# neither, so `attention` sends them to trifuse's kernels (or its torch path) directly. A call that
# shares a decided key with others but breaks one of SDPA's per-call rules (strides, alignment:
# what torch.backends.cuda.can_use_*_attention checks) runs trifuse's kernels instead, and the
# reason is kept in FALLBACKS.
# =============================================================================================

_DIALECT_KEY_NAMES = ("device", "dtype", "batch_heads", "h_kv", "sq", "sk", "d", "causal", "mask", "dropout",
                      "grad", "dv")
_MASK_KINDS = {None: _NO_MASK, torch.bool: _BOOL_MASK}
_FLOAT_MASK_GRAD = 3  # the key's "mask" only: a float mask whose gradient the call needs


def _needs_mask_grad(attn_mask) -> bool:
    return attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()


def _attention_key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The dialect key of an eager call; None (trifuse's op decides, and raises on bad input)
    when traced, empty or malformed. A tuple of ints, dtypes and flags, no text: it runs on every
    call (about 1-2 µs)."""
    if not eager_fast_path(q, k, v, attn_mask):
        return None
    qs, ks = q.shape, k.shape
    vs = v.shape
    if len(qs) != 4 or len(ks) != 4 or k.dtype is not q.dtype or v.dtype is not q.dtype or vs[:3] != ks[:3]:
        return None
    if not q.numel() or not k.numel():
        return None
    mask = _MASK_KINDS.get(None if attn_mask is None else attn_mask.dtype, _FLOAT_MASK)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if mask == _FLOAT_MASK and _needs_mask_grad(attn_mask):
        # Only candidates that give the mask's gradient are eligible for this key.
        mask, grad = _FLOAT_MASK_GRAD, True
    # h_kv: 0 without GQA. causal: 0 no, 1 with Sq == Sk, 2 with Sq != Sk (where backends that
    # align the diagonal differently, or refuse, part ways: one bucket must not hold both).
    causal = (1 if qs[2] == ks[2] else 2) if is_causal else 0
    return (q.get_device() if q.is_cuda else -1, q.dtype, pow2_bucket(qs[0] * qs[1]), ks[1] if ks[1] != qs[1] else 0,
            pow2_bucket(qs[2]), pow2_bucket(ks[2]), qs[3], causal, mask, dropout_p > 0.0, grad, vs[3])


def _attention_trifuse(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap=0.0, sinks=None):
    if eager_fast_path(q, k, v, attn_mask, sinks):
        _check_attention_inputs(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        _check_sinks(q, sinks)
        with profiled(f"trifuse::{OP}"):
            return apply_function(_AttentionFunction, q, k, v, attn_mask, float(dropout_p), bool(is_causal),
                                  _resolve_scale(scale, q.shape[-1]), softcap, sinks)
    if softcap or sinks is not None:
        return torch.ops.trifuse.attention(q, k, v, attn_mask, float(dropout_p), bool(is_causal),
                                           None if scale is None else float(scale), bool(enable_gqa), softcap,
                                           sinks)[0]
    return torch.ops.trifuse.attention(q, k, v, attn_mask, float(dropout_p), bool(is_causal),
                                       None if scale is None else float(scale), bool(enable_gqa))[0]


def _attention_output_like(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    grad = q.requires_grad or k.requires_grad or v.requires_grad or _needs_mask_grad(attn_mask)
    return _output_like(q, v.shape[3]).requires_grad_(grad)


# Why calls fell back to trifuse's kernels from the candidate chosen for their key:
# {(candidate, reason): count}. Bounded by the few distinct reasons SDPA gives.
FALLBACKS: dict[tuple[str, str], int] = {}


def _fall_back(name: str, reason: str, args: tuple):
    seen = FALLBACKS.get((name, reason), 0)
    if not seen:
        log.info("trifuse attention: %s cannot take a call of its shape bucket (%s); trifuse's kernels run it",
                 name, reason)
    FALLBACKS[(name, reason)] = seen + 1
    return _attention_trifuse(*args)


# SDPA's backends: candidate name -> (label in reasons, dtypes it takes, its torch.backends.cuda.can_use_*).
_SDPA = {
    "sdpa-flash": ("flash", (torch.float16, torch.bfloat16), "can_use_flash_attention"),
    "sdpa-efficient": ("efficient", (torch.float16, torch.bfloat16, torch.float32), "can_use_efficient_attention"),
    "sdpa-cudnn": ("cuDNN", (torch.float16, torch.bfloat16), "can_use_cudnn_attention"),
}
_SDPA_FLAGS = ("flash", "mem_efficient", "math", "cudnn")
_SDPA_ONLY = {"sdpa-flash": "flash", "sdpa-efficient": "mem_efficient", "sdpa-cudnn": "cudnn"}


def _sdpa_call_problem(name: str, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa) -> str | None:
    """None when SDPA's backend `name` takes this very call (its own per-call rules), else why not."""
    can_use = getattr(torch.backends.cuda, _SDPA[name][2], None)
    params_type = getattr(torch.backends.cuda, "SDPAParams", None)
    if can_use is None or params_type is None:
        return f"this torch has no torch.backends.cuda.{_SDPA[name][2]}"
    params = params_type(q, k, v, attn_mask, float(dropout_p), bool(is_causal), bool(enable_gqa))
    if can_use(params, False):
        return None
    # Only on the way out: ask again with debug on, which warns the reasons.
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        can_use(params, True)
    said = "; ".join(str(w.message).strip() for w in caught)
    return f"torch.backends.cuda.{_SDPA[name][2]} is False" + (f": {said}" if said else "")


def _sdpa_supports(name: str):
    label, dtypes, _ = _SDPA[name]

    def supports(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> str | None:
        if not q.is_cuda:
            return f"SDPA's {label} backend runs on CUDA, got {q.device.type} tensors"
        if q.dtype not in dtypes:
            return f"SDPA's {label} backend takes {' / '.join(str(t)[6:] for t in dtypes)}, got {str(q.dtype)[6:]}"
        d = q.shape[-1]
        if d % 8 != 0 or d > 256:
            return f"SDPA's {label} backend takes head dims that are multiples of 8 up to 256, got {d}"
        if name == "sdpa-flash" and attn_mask is not None:
            return "SDPA's flash backend takes no attn_mask"
        # _scaled_dot_product_cudnn_attention_backward returns (dq, dk, dv) only; the efficient
        # backend's backward returns the bias gradient too (and the check compares it).
        if name == "sdpa-cudnn" and _needs_mask_grad(attn_mask):
            return "SDPA's cuDNN backend gives no gradient for attn_mask"
        return _sdpa_call_problem(name, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
    return supports


def _sdpa_fn(name: str):
    """SDPA with only backend `name` enabled (the global flags flipped and restored: what
    torch.nn.attention.sdpa_kernel does, minus its context-manager cost)."""
    only = _SDPA_ONLY[name]
    getters = tuple(getattr(torch.backends.cuda, f"{f}_sdp_enabled") for f in _SDPA_FLAGS)
    setters = tuple(getattr(torch.backends.cuda, f"enable_{f}_sdp") for f in _SDPA_FLAGS)
    wanted = tuple(f == only for f in _SDPA_FLAGS)

    def run(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        problem = _sdpa_call_problem(name, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
        if problem is not None:
            return _fall_back(name, problem, (q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa))
        before = tuple(g() for g in getters)
        try:
            for set_flag, on in zip(setters, wanted):
                set_flag(on)
            # Autocast would cast fp32 inputs down; trifuse keeps q's dtype, and the choice of
            # implementation must not change the output dtype.
            if unscoped(q.device):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
            with profiled(f"trifuse::{OP}"), no_autocast(q.device):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
        finally:
            for set_flag, on in zip(setters, before):
                set_flag(on)
    return run


def flash_layout_problem(library: str, q, k, v, strides: bool = True) -> str | None:
    """Why a flash-style kernel (flash-attn's, PyTorch's varlen) cannot take these q, k, v, or None;
    the head dim's stride only with `strides`."""
    if not q.is_cuda:
        return f"{library} runs on CUDA, got {q.device.type} tensors"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{library} takes float16 / bfloat16, got {str(q.dtype)[6:]}"
    if q.shape[-1] % 8 != 0 or q.shape[-1] > 256:
        return f"{library} takes head dims that are multiples of 8 up to 256, got {q.shape[-1]}"
    if v.shape[-1] != q.shape[-1]:
        return f"{library} takes one head dim for q, k and v, got {q.shape[-1]} and {v.shape[-1]} for v"
    if strides and (q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1):
        return f"{library} needs a unit stride on the head dim"
    return None


def _flash_attn_supports(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> str | None:
    problem = flash_layout_problem("flash-attn", q, k, v, strides=False)
    if problem is not None:
        return problem
    if attn_mask is not None:
        return "flash-attn takes no attn_mask"
    if is_causal and q.shape[2] != k.shape[2]:
        return "flash-attn aligns the causal mask bottom-right; SDPA's is_causal is top-left (query len != key len)"
    return flash_layout_problem("flash-attn", q, k, v)  # the strides last, as before


def _flash_attn(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    from flash_attn import flash_attn_func  # requires= checked it imports

    # (B, S, H, D) views: flash-attn takes fewer kv heads (GQA/MQA) natively.
    o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                        softmax_scale=scale, causal=is_causal)
    return o.transpose(1, 2)


def _xformers_supports(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> str | None:
    if not q.is_cuda:
        return f"xformers runs on CUDA, got {q.device.type} tensors"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"xformers takes float16 / bfloat16 / float32, got {str(q.dtype)[6:]}"
    if attn_mask is not None:
        return "attn_mask is not adapted to xformers' attn_bias here"
    if k.shape[1] != q.shape[1]:
        return "xformers takes GQA only in its 5-D (B, S, G, H, D) layout, not adapted here"
    if v.shape[-1] != q.shape[-1]:
        return f"a value head dim ({v.shape[-1]}) other than the query's ({q.shape[-1]}) is not adapted to xformers here"
    return None


def _xformers(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    import xformers.ops as xops  # requires= checked it imports

    bias = xops.LowerTriangularMask() if is_causal else None  # top-left aligned, as SDPA
    o = xops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                        attn_bias=bias, p=dropout_p, scale=scale)
    return o.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# The check of a candidate: against attention_ref in float64 computed a block of query rows at a
# time (the (Sq, Sk) matrix never exists whole in float64), outputs and gradients, with the
# reference in the inputs' dtype as PyTorch's own error (dialects.gate). With dropout, which no
# reference can reproduce: first the same call at p = 0 against the reference, then at p > 0
# the output must change and be bitwise repeatable from the same RNG state.
# ---------------------------------------------------------------------------------------------

REFERENCE_BLOCK_ELEMENTS = 1 << 24  # score entries per block of the reference (128 MiB in fp64)


def _reference_blocks(args: tuple, dtype: torch.dtype, dy: torch.Tensor, train: bool) -> list:
    """[o, dq, dk, dv, dmask] (gradients only when train, dmask only when the mask requires grad)
    of attention_ref in `dtype`, by query blocks."""
    q, k, v, attn_mask, _, is_causal, scale, enable_gqa = args
    bsz, h, sq, d = q.shape
    sk = k.shape[2]
    q_, k_, v_ = (t.detach().to(dtype).requires_grad_(train) for t in (q, k, v))
    mask = mask_leaf = None
    if attn_mask is not None:
        mask = attn_mask.detach()
        if mask.is_floating_point():
            # before expanding: the cast of the expanded view would be S x S
            mask = mask_leaf = mask.to(dtype).requires_grad_(train and attn_mask.requires_grad)
        mask = mask.expand(bsz, h, sq, sk)
    mask_grad = mask_leaf is not None and mask_leaf.requires_grad
    dmask = torch.zeros_like(mask_leaf) if mask_grad else None
    rows = max(1, REFERENCE_BLOCK_ELEMENTS // max(1, bsz * h * sk))
    outs, dq = [], []
    dk = torch.zeros_like(k_) if train else None
    dv = torch.zeros_like(v_) if train else None
    causal = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril() if is_causal else None
    for lo in range(0, sq, rows):
        hi = min(sq, lo + rows)
        qb = q_[:, :, lo:hi].detach().requires_grad_(train)
        mb = None if mask is None else mask[:, :, lo:hi]
        if causal is not None:
            mb = causal[lo:hi]
        with torch.enable_grad() if train else torch.no_grad():
            ob = attention_ref(qb, k_, v_, mb, 0.0, False, scale, enable_gqa)
        if train:
            g = torch.autograd.grad(ob, (qb, k_, v_, *([mask_leaf] if mask_grad else [])), dy[:, :, lo:hi].to(dtype))
            dq.append(g[0])
            dk += g[1]
            dv += g[2]
            if mask_grad:
                dmask += g[3]
        outs.append(ob.detach())
    result = [torch.cat(outs, dim=2)]
    if train:
        result += [torch.cat(dq, dim=2), dk, dv, *([dmask] if mask_grad else [])]
    return result


def _run_candidate(fn, args: tuple, dy: torch.Tensor, train: bool) -> list:
    q, k, v = (t.detach().requires_grad_(train) for t in args[:3])
    mask = args[3]
    mask_grad = train and _needs_mask_grad(mask)
    if mask_grad:
        mask = mask.detach().requires_grad_()
    o = fn(q, k, v, mask, *args[4:])
    if not train:
        return [o.detach()]
    return [o.detach(), *torch.autograd.grad(o, (q, k, v, *([mask] if mask_grad else [])), dy, allow_unused=True)]


def _rng_state(device: torch.device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _attention_check(fn, args: tuple) -> str | None:
    from ..autotune.dialects import gate

    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = args
    train = torch.is_grad_enabled() and (any(t.requires_grad for t in (q, k, v)) or _needs_mask_grad(attn_mask))
    no_drop = (q, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa)

    def references():
        gen = torch.Generator(device=q.device).manual_seed(0)
        dy = torch.randn((*q.shape[:3], v.shape[3]), generator=gen, device=q.device, dtype=q.dtype)
        wide = _reference_blocks(no_drop, torch.float64, dy, train)
        return dy, wide, _reference_blocks(no_drop, q.dtype, dy, train)

    with torch.autocast(q.device.type, enabled=False):
        # the references once for all the candidates of this call
        dy, ref64, ref_lowp = dialects.shared_by_checks("attention check", args, references)
        got = _run_candidate(fn, no_drop, dy, train)
    labels = ("output", "dq", "dk", "dv", "dmask")
    for label, g, e64, elp in zip(labels, got, ref64, ref_lowp):
        problem = gate(label + (" at dropout_p=0" if dropout_p > 0.0 else ""), g, e64, elp)
        if problem is not None:
            return problem
    if dropout_p <= 0.0:
        return None
    return dropout_problem(lambda: _run_candidate(fn, args, dy, train), got, dropout_p, q.device, labels)


def dropout_problem(run: Callable[[], list], at_zero: list, dropout_p: float, device: torch.device,
                    labels: Sequence[str]) -> str | None:
    """The dropout half of a candidate's check (attention's and varlen's): `run()` gives [output,
    gradients...] at dropout_p; run twice from one RNG state, the output must differ from
    `at_zero`'s (the same call at p = 0) and be bitwise repeatable, the gradients repeatable up
    to rounding. None when it is, else what is wrong."""
    state = _rng_state(device)
    first = run()
    _set_rng_state(device, state)
    again = run()
    if dropout_p < 1.0 and torch.equal(first[0], at_zero[0]):
        return f"dropout check: the output at dropout_p={dropout_p} equals the one at 0"
    if not torch.equal(first[0], again[0]):
        return "dropout check: output is not repeatable from the same RNG state"
    for label, a, b in zip(labels[1:], first[1:], again[1:]):
        # The gradients only up to rounding: SDPA's backwards (cuDNN, flash, efficient) and
        # flash-attn's add dQ's partial sums with atomics, in an order that changes from run to
        # run at real sizes; a mask drawn anew in the backward changes them by far more.
        problem = _differs_beyond_rounding(a, b)
        if problem is not None:
            return f"dropout check: {label} is not repeatable from the same RNG state ({problem})"
    return None


def _differs_beyond_rounding(a: torch.Tensor | None, b: torch.Tensor | None) -> str | None:
    """None when a and b (one gradient, two runs) agree to within 4 units of the dtype's last
    place of a's largest magnitude: what summing the same terms in another order can change."""
    if a is None or b is None:
        return None if a is None and b is None else "missing in one run"
    scale = a.abs().max().item() if a.numel() else 0.0
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    allowed = 4 * torch.finfo(a.dtype).eps * scale
    if diff <= allowed:
        return None
    return f"max difference {diff:.3g}, allowed {allowed:.3g}"


ATTENTION = dialects.define(
    "attention", _attention_key, _DIALECT_KEY_NAMES, reference=attention_ref, check=_attention_check,
    output_like=_attention_output_like)
ATTENTION.register(dialects.Candidate("trifuse", _attention_trifuse))
for _name in _SDPA:
    # Deterministic backwards are not promised by any of them (flash and efficient accumulate dQ
    # or dK/dV with atomics); under torch.use_deterministic_algorithms they are not eligible.
    ATTENTION.register(dialects.Candidate(_name, _sdpa_fn(_name), supports=_sdpa_supports(_name),
                                          deterministic=False))
ATTENTION.register(dialects.Candidate("flash-attn", _flash_attn, supports=_flash_attn_supports,
                                      deterministic=False, requires=("flash_attn",)))
ATTENTION.register(dialects.Candidate("xformers", _xformers, supports=_xformers_supports,
                                      deterministic=False, requires=("xformers.ops",)))
del _name


# =============================================================================================
# Public API
# =============================================================================================


def _autocast_like_sdpa(q, k, v, attn_mask):
    """What autocast does to SDPA (a lower-precision op): every floating input, the float mask
    too, in the autocast dtype. Hugging Face's rotary tables are fp32, so under autocast its q
    and k arrive fp32 beside a 16-bit v, which SDPA takes and one-dtype kernels would refuse."""
    dtype = torch.get_autocast_dtype(q.device.type)
    q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(dtype)
    return q, k, v, attn_mask


@outside_device_modes
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with the signature and semantics of
    `F.scaled_dot_product_attention`, never materializing the (Sq, Sk) score matrix.

    Args:
        q: (B, Hq, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv), Dv usually D (DeepSeek's
            multi-head latent attention: D = 192, Dv = 128). fp16 / bf16 / fp32 / fp64, one
            dtype; D, Dv <= 256; any strides (views of a fused QKV projection, (B, S, H, D)
            transposes).
        attn_mask: bool (True = attend) or float (added to the scores), broadcastable to
            (B, Hq, Sq, Sk), e.g. HF key-padding masks (B, 1, 1, Sk) or (B, 1, Sq, Sk). A float mask
            may require grad (T5's learned position bias): its gradient is dS, the gradient of the
            scores, summed over the dims it broadcasts along.
        dropout_p: dropout on the attention probabilities, drawn in the kernel from a seed taken
            from PyTorch's generator (torch.manual_seed makes it repeatable) and regenerated in
            the backward. Pass 0.0 in eval, as with SDPA.
        is_causal: query i attends to keys j <= i (top-left aligned, as SDPA); not with attn_mask.
        scale: multiplies Q K^T; None means 1 / sqrt(D).
        enable_gqa: k and v may have fewer heads, dividing Hq; query head h reads kv head
            h // (Hq // Hkv). K and V are never repeated in memory.
        softcap: a logit soft cap c > 0 (Gemma 2's attn_logit_softcapping, flash-attn's
            softcap): the scaled scores become c * tanh(scores / c) before the mask is added.
            None or 0: no cap. SDPA has no such argument: capped calls run trifuse's kernels.
        sinks: attention sinks (gpt-oss), a float tensor (Hq,) of logits, one per query head, any
            float dtype (read in fp32; fp64 for fp64 inputs), on q's device; it may require grad.
            Each row's softmax gets one more score s_h that has no value (transformers' eager
            gpt-oss attention: concatenated to the masked scores, softmaxed, dropped before
            dropout and P V), so a row's probabilities sum to 1 - exp(s_h - L). A row with every
            key masked gives 0 (the sink takes all its weight). SDPA takes no sinks: such calls
            run trifuse's kernels.

    Under autocast, as SDPA: q, k, v and a float mask are cast to the autocast dtype first.

    Packed sequences: an eager call with batch 1 whose mask (bool, or additive 0 / -inf) keeps
    exactly a block-diagonal causal pattern (optionally within a sliding window) - what
    transformers builds for SDPA from packed position ids - runs `trifuse.ops.attention_varlen`
    over the blocks; the mask's check runs once per mask (a model's layers share it), not inside
    CUDA graph capture.

    Returns:
        (B, Hq, Sq, Dv) in q's dtype (the autocast dtype under autocast), laid out like q when q is dense (so a (B, S, H, D)
        transpose gives an output whose transpose back is contiguous). Rows that see no key
        (fully masked) are 0, with zero gradients, as SDPA gives.

    Eager calls run trifuse's kernels, or SDPA with one backend forced, or flash-attn / xformers
    when installed, whichever the `attention` dialect measured fastest among those that passed
    its check for this shape bucket on this GPU (`trifuse.autotune.dialects.explain("attention",
    q, k, v, ...)` says which and why the others were rejected); elsewhere, and under
    torch.compile, trifuse's.

    Raises:
        TypeError for non-float or mixed dtypes; ValueError for ranks, shapes, head counts, masks
        that do not broadcast, dropout_p outside [0, 1], a negative or infinite softcap, or sinks
        that are not floating point or not shaped (Hq,).
    """
    for name, t in (("query", q), ("key", k), ("value", v)):
        check_tensor(OP, name, t)
    if sinks is not None:
        check_tensor(OP, "sinks", sinks)
    check_probability(OP, "dropout_p", dropout_p)
    if torch.is_autocast_enabled(q.device.type):
        q, k, v, attn_mask = _autocast_like_sdpa(q, k, v, attn_mask)
    if softcap is not None:
        _check_softcap(softcap)
    if attn_mask is not None and q.shape[0] == 1 and q.shape[-2] > 1:
        packed = _packed(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks)
        if packed is not None:
            return packed
    if softcap or sinks is not None:  # neither is an SDPA argument: trifuse's kernels, not the dialect
        return _attention_trifuse(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, float(softcap or 0.0),
                                  sinks)
    return ATTENTION(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _packed(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap,
            sinks) -> torch.Tensor | None:
    """Packed sequences: a batch of one under a mask that keeps exactly a block-diagonal causal
    pattern (transformers' SDPA mask for packed position ids) runs varlen attention over the
    blocks: the same answer without scoring every other sequence's keys. Eager calls only (the
    mask is checked on the host, once per mask), not while a CUDA graph is captured; None when the
    call is anything else."""
    from .attention_varlen import attention_varlen, packed_mask_offsets

    n = q.shape[2]
    if (is_causal or q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[2] != n or k.shape[0] != 1
            or (k.shape[1] != q.shape[1] and not enable_gqa)
            or not eager_fast_path(q, k, v, attn_mask, sinks)):
        return None
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    offsets = packed_mask_offsets(attn_mask, n)
    if offsets is None:
        return None
    cu, longest, window = offsets
    tokens = [t[0].transpose(0, 1) for t in (q, k, v)]  # (T, H, D) views
    out = attention_varlen(*tokens, cu, cu, longest, longest, dropout_p, scale, True, softcap or 0.0, sinks,
                           window or None)
    return out.transpose(0, 1).unsqueeze(0)  # (1, H, T, Dv), as the (B, S, H, D) transpose SDPA returns
