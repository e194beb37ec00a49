"""Variable-length ("varlen") attention: sequences packed end to end along one token axis,
forward and backward, without padding and without a mask.

This is flash-attn's `flash_attn_varlen_func` layout, the one padding-free training uses
(transformers' DataCollatorWithFlattening, TRL's padding_free): q (total_q, Hq, D), k (total_k,
Hkv, D), v (total_k, Hkv, Dv), and offsets cu_seqlens_q (B + 1,) with sequence b's queries in
rows cu_seqlens_q[b] : cu_seqlens_q[b + 1] (the same for keys). Each sequence attends only to its
own keys. With a dense (1, 1, S, S) block-diagonal mask, which is what SDPA gets from
transformers for packed sequences, the kernels would read S^2 mask bytes and score every tile of
every other sequence only to mask it away; here a program covers one block of one sequence and
loops over that sequence's keys alone: the work is sum_b Sq_b * Sk_b, not (sum_b Sq_b)^2.

The maths is `attention.py`'s, per sequence (softmax over its keys, dropout on the probabilities
regenerated in the backward, a logit soft cap, gpt-oss's sinks, GQA without repeating K/V, and a
causal sliding window w: query i sees keys i - w < j <= i, transformers' sliding_window and
flash-attn's window_size=(w - 1, 0)); the kernels below are that file's entry kernels with the
(batch, head) slice replaced by (sequence, head): they call the same inner loops, and with a
window loop over the window's blocks only, all masked. Statistics are laid out (Hq, total_q):
row r of head h is token r. Dropout draws from (seed, h * total_q + token, key index within the
sequence).

`trifuse.ops.attention` sends here the packed masks it recognizes (`packed_mask_offsets`, bottom
of this file): a batch of one under an exactly block-diagonal causal bool mask.

Causal: query i of a sequence sees its keys j <= i (top-left, as trifuse.ops.attention and SDPA).
flash-attn >= 2.1 aligns bottom-right when a sequence's query and key lengths differ; the two
agree when they are equal (packed self-attention), and a causal call whose offsets differ is
refused rather than answered in one convention for a caller who expects the other.

cu_seqlens are checked on the host (start at 0, non-decreasing, within the tokens, no sequence
longer than max_seqlen): one device sync per distinct offsets tensor, remembered for later calls
with the same tensor (a model's layers share it), skipped while a CUDA graph is captured. The
kernels also clamp every offset into range, so a malformed one can never address memory outside
the tensors.
"""
import functools
import math
import weakref

import torch
import triton
import triton.language as tl

from ..autotune import dialects, pow2_bucket
from ..autotune.tuner import Tuner
from . import attention as attn
from ._common import (
    acc_dtype,
    apply_function,
    check_float,
    check_probability,
    check_same_device,
    check_tensor,
    ctx_as,
    eager_fast_path,
    no_autocast,
    outside_device_modes,
    philox_seed,
    profiled,
    reference_grads,
    single_backward,
)
from ._launch import CachedKernel
from ._tiles import cdiv

OP = "attention_varlen"
MAX_SEQUENCES = 65535  # the second grid axis; heads are the third
MAX_HEADS = 65535


# =============================================================================================
# Kernels: attention.py's entry kernels per (block, sequence, head); the loops are shared.
# =============================================================================================


@triton.jit
def _span(CU, b, total):
    """(start, length) of sequence b from its offsets, clamped into [0, total]: a malformed
    offset (caught on the host where it can be) never makes an address outside the tensor."""
    start = tl.minimum(tl.maximum(tl.load(CU + b).to(tl.int64), 0), total)
    end = tl.minimum(tl.maximum(tl.load(CU + b + 1).to(tl.int64), start), total)
    return start, (end - start).to(tl.int32)


@triton.jit
def _varlen_fwd_kernel(
    Q,  # in (TOTAL_Q, H, HEAD_DIM)
    K,  # in (TOTAL_K, H_KV, HEAD_DIM)
    V,  # in (TOTAL_K, H_KV, HEAD_DIM_V)
    CU_Q, CU_K,  # in (B + 1,) int32 or int64 offsets
    SEED,  # in (1,) int64 Philox seed; unused unless HAS_DROPOUT
    SINKS,  # in (H,) fp32 (fp64 for fp64) sink logits; unused unless HAS_SINKS
    O,  # out (TOTAL_Q, H, HEAD_DIM_V)
    LSE,  # out (H, TOTAL_Q) fp32 (fp64 for fp64), log2 of each row's sum of exp2 (attention.py's hi)
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    TOTAL_Q, TOTAL_K, GROUP, qk_scale, softcap, p_drop, dropout_scale,
    window,  # the sliding window (key j seen by query i if i - window < j <= i); unused unless HAS_WINDOW
    Q_BUCKET, K_BUCKET,  # unused in the kernel: the tuner keys on these buckets on the host
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    q_start, n_q = _span(CU_Q, b, TOTAL_Q)
    if start_m >= n_q:  # the grid covers the longest sequence; this one is shorter
        return
    k_start, n_k = _span(CU_K, b, TOTAL_K)
    hk = h // GROUP
    Q += q_start * stride_qt + h * stride_qh
    K += k_start * stride_kt + hk * stride_kh
    V += k_start * stride_vt + hk * stride_vh
    O += q_start * stride_ot + h * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < n_q
    q = tl.load(attn._tile(Q, offs_m, offs_d, stride_qt, stride_qd),
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    rng_rows = h * TOTAL_Q + q_start + offs_m

    m_i, l_i = attn._softmax_start(SINKS, h, BLOCK_M, ACC, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC)
    n_full, hi = attn._key_blocks(start_m, n_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    if HAS_WINDOW:  # causal (host-checked): keys from the window's first block, every block masked
        n_full = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        # No mask tensor (MASK_KIND 0): Q stands in for its pointer and strides, never read.
        acc, l_i, m_i = attn._attn_fwd_loop(acc, l_i, m_i, q, K, V, Q, seed, rng_rows, offs_m, offs_n, offs_d,
                                            offs_dv, stride_kt, stride_kd, stride_vt, stride_vd, 0, 0,
                                            n_q, n_k, qk_scale, softcap, p_drop, 0, n_full,
                                            HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, IS_CAUSAL, 0, HAS_DROPOUT,
                                            SOFTCAP, DOT_PRECISION, ACC, False)
    acc, l_i, m_i = attn._attn_fwd_loop(acc, l_i, m_i, q, K, V, Q, seed, rng_rows, offs_m, offs_n, offs_d,
                                        offs_dv, stride_kt, stride_kd, stride_vt, stride_vd, 0, 0,
                                        n_q, n_k, qk_scale, softcap, p_drop, n_full, hi,
                                        HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, IS_CAUSAL, 0, HAS_DROPOUT,
                                        SOFTCAP, DOT_PRECISION, ACC, False, window, HAS_WINDOW)

    seen = l_i > 0.0  # False for rows that see no key (an empty key sequence) and no sink: O = 0, L = -inf
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc * (dropout_scale / l_safe)[:, None]
    # hi alone: without a float mask no score is large enough to lose log2(l) (attention._row_stats)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(attn._tile(O, offs_m, offs_dv, stride_ot, stride_od), o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(LSE + h * TOTAL_Q + q_start + offs_m, lse, mask=row_ok)


@triton.jit
def _varlen_bwd_dkdv_kernel(
    Q, K, V,  # in, as the forward
    CU_Q, CU_K,  # in, as the forward
    SEED,  # in (1,) int64; unused unless HAS_DROPOUT
    DO,  # in (TOTAL_Q, H, HEAD_DIM_V)
    LSE,  # in (H, TOTAL_Q) from the forward
    DELTA,  # in (H, TOTAL_Q) rowsum(dO * O)
    DK, DV,  # out (TOTAL_K, H_KV, HEAD_DIM) and (TOTAL_K, H_KV, HEAD_DIM_V)
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_dot, stride_doh, stride_dod,
    stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    TOTAL_Q, TOTAL_K, GROUP, sm_scale, qk_scale, softcap, p_drop, dropout_scale, window,
    Q_BUCKET, K_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    b = tl.program_id(1)
    hk = tl.program_id(2).to(tl.int64)
    k_start, n_k = _span(CU_K, b, TOTAL_K)
    if start_n >= n_k:
        return
    q_start, n_q = _span(CU_Q, b, TOTAL_Q)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_mask = (offs_n[:, None] < n_k) & (offs_d[None, :] < HEAD_DIM)
    v_mask = (offs_n[:, None] < n_k) & (offs_dv[None, :] < HEAD_DIM_V)
    k = tl.load(attn._tile(K + k_start * stride_kt + hk * stride_kh, offs_n, offs_d, stride_kt, stride_kd),
                mask=k_mask, other=0.0)
    v = tl.load(attn._tile(V + k_start * stride_vt + hk * stride_vh, offs_n, offs_dv, stride_vt, stride_vd),
                mask=v_mask, other=0.0)
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)
    if IS_CAUSAL:  # as attention.py: [lo, mid) straddle the diagonal, [mid, n_q) see the whole block
        lo = start_n // BLOCK_M * BLOCK_M
        mid = tl.minimum(lo + tl.cdiv(start_n + BLOCK_N - 1 - lo, BLOCK_M) * BLOCK_M, n_q)
    else:
        mid = 0
    if HAS_WINDOW:  # every query that sees a key of this block is below start_n + BLOCK_N - 1 + window
        mid = tl.minimum(start_n + BLOCK_N - 1 + window, n_q)
    for g in range(GROUP):  # the group's query heads in order: a deterministic sum in registers
        h = hk * GROUP + g
        Qh = Q + q_start * stride_qt + h * stride_qh
        DOh = DO + q_start * stride_dot + h * stride_doh
        row0 = h * TOTAL_Q + q_start
        if IS_CAUSAL:  # with a window, [lo, mid) is every query block that sees this key block
            dk, dv = attn._attn_bwd_dkdv_loop(
                dk, dv, k, v, Qh, DOh, LSE + row0, DELTA + row0, Q, seed, row0, offs_m, offs_n, offs_d,
                offs_dv, stride_qt, stride_qd, stride_dot, stride_dod, 0, 0, n_q, n_k, qk_scale, softcap,
                p_drop, dropout_scale, lo, mid, h, HEAD_DIM, HEAD_DIM_V, BLOCK_M, True, IS_CAUSAL, 0,
                HAS_DROPOUT, SOFTCAP, DOT_PRECISION, ACC, False, window, HAS_WINDOW)
        if not HAS_WINDOW:
            dk, dv = attn._attn_bwd_dkdv_loop(
                dk, dv, k, v, Qh, DOh, LSE + row0, DELTA + row0, Q, seed, row0, offs_m, offs_n, offs_d,
                offs_dv, stride_qt, stride_qd, stride_dot, stride_dod, 0, 0, n_q, n_k, qk_scale, softcap,
                p_drop, dropout_scale, mid, n_q, h, HEAD_DIM, HEAD_DIM_V, BLOCK_M, False, IS_CAUSAL, 0,
                HAS_DROPOUT, SOFTCAP, DOT_PRECISION, ACC, False)
    dk *= sm_scale
    tl.store(attn._tile(DK + k_start * stride_dkt + hk * stride_dkh, offs_n, offs_d, stride_dkt, stride_dkd),
             dk.to(DK.dtype.element_ty), mask=k_mask)
    tl.store(attn._tile(DV + k_start * stride_dvt + hk * stride_dvh, offs_n, offs_dv, stride_dvt, stride_dvd),
             dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _varlen_bwd_dq_kernel(
    Q, K, V,  # in, as the forward
    CU_Q, CU_K,  # in, as the forward
    SEED,  # in (1,) int64; unused unless HAS_DROPOUT
    DO,  # in (TOTAL_Q, H, HEAD_DIM_V)
    LSE,  # in (H, TOTAL_Q)
    DELTA,  # in (H, TOTAL_Q)
    DQ,  # out (TOTAL_Q, H, HEAD_DIM)
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd,
    TOTAL_Q, TOTAL_K, GROUP, sm_scale, qk_scale, softcap, p_drop, dropout_scale, window,
    Q_BUCKET, K_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    q_start, n_q = _span(CU_Q, b, TOTAL_Q)
    if start_m >= n_q:
        return
    k_start, n_k = _span(CU_K, b, TOTAL_K)
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(attn._tile(Q + q_start * stride_qt + h * stride_qh, offs_m, offs_d, stride_qt, stride_qd),
                mask=q_mask, other=0.0)
    do = tl.load(attn._tile(DO + q_start * stride_dot + h * stride_doh, offs_m, offs_dv, stride_dot,
                            stride_dod),
                 mask=(offs_m[:, None] < n_q) & (offs_dv[None, :] < HEAD_DIM_V), other=0.0).to(q.dtype)
    row0 = h * TOTAL_Q + q_start
    lse, lse_lo, delta = attn._load_row_stats(LSE + row0, DELTA + row0, offs_m, n_q, False)
    seed = tl.load(SEED) if HAS_DROPOUT else 0
    rng_rows = row0 + offs_m
    K += k_start * stride_kt + hk * stride_kh
    V += k_start * stride_vt + hk * stride_vh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    n_full, hi = attn._key_blocks(start_m, n_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    if HAS_WINDOW:
        n_full = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        dq = attn._attn_bwd_dq_loop(dq, q, do, lse, lse_lo, delta, K, V, Q, Q, seed, rng_rows, offs_m, offs_n,
                                    offs_d, offs_dv, stride_kt, stride_kd, stride_vt, stride_vd, 0, 0,
                                    n_q, n_k, qk_scale, softcap, p_drop, dropout_scale, 0, n_full,
                                    HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, IS_CAUSAL, 0, HAS_DROPOUT, False,
                                    SOFTCAP, DOT_PRECISION, ACC, False)
    dq = attn._attn_bwd_dq_loop(dq, q, do, lse, lse_lo, delta, K, V, Q, Q, seed, rng_rows, offs_m, offs_n,
                                offs_d, offs_dv, stride_kt, stride_kd, stride_vt, stride_vd, 0, 0,
                                n_q, n_k, qk_scale, softcap, p_drop, dropout_scale, n_full, hi,
                                HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, IS_CAUSAL, 0, HAS_DROPOUT, False,
                                SOFTCAP, DOT_PRECISION, ACC, False, window, HAS_WINDOW)
    dq *= sm_scale
    tl.store(attn._tile(DQ + q_start * stride_dqt + h * stride_dqh, offs_m, offs_d, stride_dqt, stride_dqd),
             dq.to(DQ.dtype.element_ty), mask=q_mask)


# =============================================================================================
# Launchers. Block sizes: attention.py's lists and pruning (same loops, same registers), tuned
# under their own names, keyed on the longest sequence's bucket.
# =============================================================================================

_KERNELS = {"fwd": _varlen_fwd_kernel, "dkdv": _varlen_bwd_dkdv_kernel, "dq": _varlen_bwd_dq_kernel}
_CACHED = {kind: CachedKernel(fn) for kind, fn in _KERNELS.items()}
# attention.py's lists, whose defaults with dropout avoid spills (_DROPOUT_16BIT_DEFAULT). This
# dK/dV pass at head dim 64 spills at that list's default (32 x 128: 64 bytes of stack compiled by
# Triton 3.6 for sm_90, the lent GPU's; 8 bytes by 3.9 with dropout; `bench/compile_sm90.py`),
# where 16 x 128 of the same list does not: first here, with or without dropout.
_VARLEN_16BIT_DEFAULT = {("dkdv", 64): (16, 128, 8, 3)}


def _configs(kind: str, block_d: int, itemsize: int, smem: int, mask: int = 0, dropout: bool = False,
             tma: bool = False, block_dv: int | None = None) -> list[triton.Config]:
    configs = attn._configs(kind, block_d, itemsize, smem, mask, dropout, tma, block_dv)
    widest = max(block_d, block_dv or block_d)
    first = _VARLEN_16BIT_DEFAULT.get((kind, widest)) if itemsize < 4 else None
    if first is not None and len(configs) > 1:
        preferred = [c for c in configs if (c.kwargs.get("BLOCK_M"), c.kwargs.get("BLOCK_N"), c.num_warps,
                                            c.num_stages) == first]
        configs = preferred + [c for c in configs if c not in preferred]
    return configs


_TUNERS = {kind: Tuner(f"attention_varlen_{kind}", functools.partial(_configs, kind), attn._KEY_NAMES)
           for kind in _KERNELS}


def _launch_config(cfg: triton.Config, kind: str, grid_fn, args: tuple, constexprs: dict) -> None:
    meta = {**constexprs, **attn._config_meta(cfg)}
    _CACHED[kind][grid_fn(meta)](*args, **meta)


def _tuned_launch(kind: str, tuning_key: tuple, grid_fn, args: tuple, constexprs: dict) -> None:
    cfg = _TUNERS[kind].config(tuning_key, _launch_config, kind, grid_fn, args, constexprs)
    _launch_config(cfg, kind, grid_fn, args, constexprs)


def _constexprs(q: torch.Tensor, v: torch.Tensor, causal: bool, has_dropout: bool, softcap: float,
                window: int) -> dict:
    d, dv = q.shape[2], v.shape[2]
    return dict(HEAD_DIM=d, BLOCK_D=attn._block_d(d), HEAD_DIM_V=dv, BLOCK_DV=attn._block_d(dv),
                IS_CAUSAL=causal, HAS_DROPOUT=has_dropout, SOFTCAP=softcap > 0.0,
                DOT_PRECISION=attn._dot_precision(q.dtype), ACC=acc_dtype(q.dtype), HAS_WINDOW=window > 0)


def _tuning_key(q: torch.Tensor, v: torch.Tensor, max_q: int, max_k: int, causal: bool,
                has_dropout: bool) -> tuple:
    d, dv = q.shape[2], v.shape[2]
    return attn._tuning_key(q, max_q, max_k, d, attn._block_d(d), causal, 0, has_dropout, False,
                            attn._block_d(dv))


def attention_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    max_k: int, dropout_p: float, causal: bool, scale: float, seed: torch.Tensor | None, softcap: float = 0.0,
    sinks: torch.Tensor | None = None, window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o (total_q, Hq, Dv) contiguous, lse (Hq, total_q) fp32 (fp64 for fp64) in base 2,
    the sinks (Hq,) included when given. `window` > 0: causal sliding window (0: none)."""
    total_q, h, _ = q.shape
    total_k, h_kv, dv = k.shape[0], k.shape[1], v.shape[2]
    nseq = cu_q.shape[0] - 1
    o = q.new_empty((total_q, h, dv))
    lse = torch.empty((h, total_q), dtype=attn._stat_dtype(q.dtype), device=q.device)
    if o.numel() == 0:
        return o, lse
    if not attn._use_kernels(q):
        with no_autocast(q.device):
            return _varlen_torch(q, k, v, cu_q, cu_k, dropout_p, causal, scale, seed, softcap, sinks, window,
                                 o, lse)
    has_dropout = dropout_p > 0.0
    if nseq == 0 or max_q == 0:  # no query belongs to a sequence: rows outside every sequence are 0
        return o.zero_(), lse.fill_(float("-inf"))
    if min(q.shape[2], dv) < attn._MIN_HEAD_DIM:  # zero columns up to the dots' tile (attention.py)
        o_wide, lse = attention_varlen_fwd(attn.pad_head_dim(q), attn.pad_head_dim(k), attn.pad_head_dim(v),
                                           cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, seed, softcap,
                                           sinks, window)
        return o.copy_(o_wide[..., :dv]), lse
    sinks_arg = q if sinks is None else attn._sinks_arg(sinks, q.dtype)
    args = (q, k, v, cu_q, cu_k, seed if has_dropout else q, sinks_arg, o, lse, *q.stride(), *k.stride(),
            *v.stride(), *o.stride(), total_q, total_k, h // h_kv, *attn._score_scales(scale, softcap),
            dropout_p, attn._dropout_scale(dropout_p), window, attn._bucket(max_q),
            attn._bucket(max(max_k, 1)))
    _tuned_launch("fwd", _tuning_key(q, v, max_q, max(max_k, 1), causal, has_dropout),
                  lambda meta: (cdiv(max_q, meta["BLOCK_M"]), nseq, h), args,
                  {**_constexprs(q, v, causal, has_dropout, softcap, window), "HAS_SINKS": sinks is not None})
    return o, lse


def attention_varlen_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, dropout_p: float, causal: bool,
    scale: float, seed: torch.Tensor | None, softcap: float = 0.0, sinks: torch.Tensor | None = None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dsinks): contiguous, shaped like q, k, v; dsinks (Hq,) in the sinks' dtype
    with `sinks` (whose logits `lse` includes), else None."""
    total_q, h, d = q.shape
    total_k, h_kv, dv = k.shape[0], k.shape[1], v.shape[2]
    nseq = cu_q.shape[0] - 1
    dq, dk, dv_ = (t.new_empty(t.shape) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0 or nseq == 0 or max_q == 0 or max_k == 0:
        # no sequence has both queries and keys: O = 0, so delta = 0, and every gradient is 0
        return dq.zero_(), dk.zero_(), dv_.zero_(), None if sinks is None else torch.zeros_like(sinks)
    if not attn._use_kernels(q):
        with no_autocast(q.device):
            delta = _varlen_torch_bwd(do, q, k, v, o, cu_q, cu_k, dropout_p, causal, scale, seed,
                                      softcap, sinks, window, dq, dk, dv_)
        return dq, dk, dv_, None if sinks is None else attn._sinks_grad(sinks, lse[None], delta[None])
    if min(d, dv) < attn._MIN_HEAD_DIM:  # zero columns up to the dots' tile (attention.py)
        pad = attn.pad_head_dim
        dq_wide, dk_wide, dv_wide, dsinks = attention_varlen_bwd(
            pad(do), pad(q), pad(k), pad(v), pad(o), lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale,
            seed, softcap, sinks, window)
        return dq.copy_(dq_wide[..., :d]), dk.copy_(dk_wide[..., :d]), dv_.copy_(dv_wide[..., :dv]), dsinks
    has_dropout = dropout_p > 0.0
    delta = torch.empty_like(lse)
    pre_block = 32 if attn.INTERPRET else 64
    # delta = rowsum(dO * O): attention.py's kernel over o and dO seen as (1, Hq, total_q, Dv)
    attn._BWD_PREPROCESS.run((cdiv(total_q, pre_block), h),
                             (o, do, delta, 0, o.stride(1), o.stride(0), o.stride(2),
                              0, do.stride(1), do.stride(0), do.stride(2), h, total_q),
                             dict(HEAD_DIM=dv, BLOCK_D=attn._block_d(dv), BLOCK_M=pre_block,
                                  ACC=acc_dtype(q.dtype)))
    seed_arg = seed if has_dropout else q
    tail = (total_q, total_k, h // h_kv, scale, *attn._score_scales(scale, softcap), dropout_p,
            attn._dropout_scale(dropout_p), window, attn._bucket(max_q), attn._bucket(max_k))
    constexprs = _constexprs(q, v, causal, has_dropout, softcap, window)
    key = _tuning_key(q, v, max_q, max_k, causal, has_dropout)
    _tuned_launch("dkdv", key, lambda meta: (cdiv(max_k, meta["BLOCK_N"]), nseq, h_kv),
                  (q, k, v, cu_q, cu_k, seed_arg, do, lse, delta, dk, dv_, *q.stride(), *k.stride(),
                   *v.stride(), *do.stride(), *dk.stride(), *dv_.stride(), *tail), constexprs)
    _tuned_launch("dq", key, lambda meta: (cdiv(max_q, meta["BLOCK_M"]), nseq, h),
                  (q, k, v, cu_q, cu_k, seed_arg, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(),
                   *do.stride(), *dq.stride(), *tail), constexprs)
    return dq, dk, dv_, None if sinks is None else attn._sinks_grad(sinks, lse[None], delta[None])


# ---------------------------------------------------------------------------------------------
# PyTorch path (CPU tensors without the interpreter, fp64 on a GPU): attention.py's, sequence by
# sequence. Dropout there draws from its own generator per sequence (seed + b), repeatable and
# regenerated in the backward like the kernels', not bit-equal to them.
# ---------------------------------------------------------------------------------------------


def _spans(cu_q: torch.Tensor, cu_k: torch.Tensor):
    q_off, k_off = cu_q.tolist(), cu_k.tolist()
    return [(b, slice(q_off[b], q_off[b + 1]), slice(k_off[b], k_off[b + 1])) for b in range(len(q_off) - 1)]


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).unsqueeze(0)  # (s, H, D) -> (1, H, s, D)


def _band(sq: slice, sk: slice, window: int, device) -> torch.Tensor | None:
    """The sliding window as a bool (Sq, Sk) mask (key j seen by query i if j > i - window), or None."""
    if not window:
        return None
    i = torch.arange(sq.stop - sq.start, device=device)[:, None]
    j = torch.arange(sk.stop - sk.start, device=device)[None, :]
    return j > i - window


def _varlen_torch(q, k, v, cu_q, cu_k, dropout_p, causal, scale, seed, softcap, sinks, window, o, lse):
    o.zero_()
    lse.fill_(float("-inf"))
    for b, sq, sk in _spans(cu_q, cu_k):
        if sq.stop == sq.start:
            continue
        seed_b = None if seed is None else seed + b
        o_b, lse_b = attn._attention_fwd_torch(_heads_first(q[sq]), _heads_first(k[sk]), _heads_first(v[sk]),
                                               _band(sq, sk, window, q.device), dropout_p, causal, scale,
                                               seed_b, softcap, sinks)
        o[sq] = o_b[0].transpose(0, 1).to(o.dtype)
        lse[:, sq] = lse_b[0] * attn.LOG2E
    return o, lse


def _varlen_torch_bwd(do, q, k, v, o, cu_q, cu_k, dropout_p, causal, scale, seed, softcap, sinks, window,
                      dq, dk, dv):
    """Fills dq, dk, dv; returns delta (Hq, total_q)."""
    dq.zero_(), dk.zero_(), dv.zero_()
    delta = q.new_zeros((q.shape[1], q.shape[0]), dtype=attn._stat_dtype(q.dtype))
    for b, sq, sk in _spans(cu_q, cu_k):
        if sq.stop == sq.start or sk.stop == sk.start:
            continue
        seed_b = None if seed is None else seed + b
        grads = attn._attention_bwd_torch(_heads_first(do[sq]), _heads_first(q[sq]), _heads_first(k[sk]),
                                          _heads_first(v[sk]), _heads_first(o[sq]), seed_b,
                                          _band(sq, sk, window, q.device), dropout_p, causal, scale, False,
                                          softcap, sinks)
        for out, g, rows in ((dq, grads[0], sq), (dk, grads[1], sk), (dv, grads[2], sk)):
            out[rows] = g[0].transpose(0, 1).to(out.dtype)
        delta[:, sq] = grads[4][0]
    return delta


# =============================================================================================
# Checks
# =============================================================================================

# Offsets tensors already checked, with what they were checked against: a model's layers share
# one, so a step pays one sync, not one per layer.
_CHECKED_OFFSETS = torch.utils.weak.WeakTensorKeyDictionary()
_EQUAL_OFFSETS = torch.utils.weak.WeakTensorKeyDictionary()  # cu_q -> (weakref(cu_k), versions): equal


def _check_inputs(q, k, v, cu_q, cu_k, dropout_p, causal, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(OP, name, t)
        check_float(OP, name, t)
        if t.dim() != 3:
            raise ValueError(f"trifuse.{OP}: {name} must be 3-D (total_tokens, heads, head_dim), "
                             f"got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"trifuse.{OP}: q, k and v must share one dtype, got {q.dtype}, {k.dtype} and "
                        f"{v.dtype}")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        check_tensor(OP, name, cu)
        if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 1 or cu.stride(0) != 1:
            raise ValueError(f"trifuse.{OP}: {name} must be a contiguous 1-D int32 or int64 tensor of "
                             f"(sequences + 1) offsets, got {cu.dtype} of shape {tuple(cu.shape)}")
    check_same_device(OP, "q", q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"trifuse.{OP}: cu_seqlens_q and cu_seqlens_k must count the same sequences, got "
                         f"{cu_q.shape[0] - 1} and {cu_k.shape[0] - 1}")
    if cu_q.shape[0] - 1 > MAX_SEQUENCES:
        raise ValueError(f"trifuse.{OP}: at most {MAX_SEQUENCES} sequences (a CUDA grid limit), "
                         f"got {cu_q.shape[0] - 1}")
    h, d = q.shape[1], q.shape[2]
    if k.shape[2] != d:
        raise ValueError(f"trifuse.{OP}: q and k must have the same head_dim, got {d} and {k.shape[2]}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"trifuse.{OP}: k and v must have the same tokens and heads, got shapes "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if h > MAX_HEADS:
        raise ValueError(f"trifuse.{OP}: at most {MAX_HEADS} heads (a CUDA grid limit), got {h}")
    if not 1 <= d <= attn.MAX_HEAD_DIM or not 1 <= v.shape[2] <= attn.MAX_HEAD_DIM:
        raise ValueError(f"trifuse.{OP}: head dims must be between 1 and {attn.MAX_HEAD_DIM}, got {d} "
                         f"(q, k) and {v.shape[2]} (v)")
    h_kv = k.shape[1]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"trifuse.{OP}: the key/value heads must divide the query heads, got {h} query "
                         f"heads and {h_kv} key/value heads")
    check_probability(OP, "dropout_p", dropout_p)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"trifuse.{OP}: softmax_scale must be a number or None, got {type(scale).__name__}")


def _offset_stats(cu: torch.Tensor) -> list[int]:
    """[first, last, shortest, longest]: the offsets' ends and the extreme lengths, in one sync."""
    lengths = cu.diff()
    zero = cu[0] * 0
    return torch.stack([cu[0], cu[-1], *(lengths.aminmax() if lengths.numel() else (zero, zero))]).tolist()


def _check_offsets(q, k, cu_q, cu_k, max_q: int, max_k: int, causal: bool) -> None:
    """The offsets' values against the tokens and the max lengths (see the module docstring):
    a sync on a GPU, once per offsets tensor; nothing while a CUDA graph is captured."""
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"trifuse.{OP}: {name} must be an int >= 0, got {value!r}")
    if cu_q.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    for name, cu, total, longest in (("cu_seqlens_q", cu_q, q.shape[0], max_q),
                                     ("cu_seqlens_k", cu_k, k.shape[0], max_k)):
        stamp = (cu._version, total, longest)
        if _CHECKED_OFFSETS.get(cu) == stamp:
            continue
        stats = _offset_stats(cu)
        ends, (shortest, most) = stats[:2], stats[2:]
        if ends != [0, total]:
            raise ValueError(f"trifuse.{OP}: {name} must run from 0 to the number of tokens ({total}), "
                             f"got {ends[0]} ... {ends[1]}")
        if shortest < 0:
            raise ValueError(f"trifuse.{OP}: {name} must not decrease (a sequence of length {shortest})")
        if most > longest:
            raise ValueError(f"trifuse.{OP}: a sequence of {most} tokens is longer than "
                             f"{name.replace('cu_seqlens', 'max_seqlen')}={longest}")
        _CHECKED_OFFSETS[cu] = stamp
    if causal and cu_k is not cu_q:
        stamp = (weakref.ref(cu_k), cu_q._version, cu_k._version)
        seen = _EQUAL_OFFSETS.get(cu_q)
        if seen is None or seen[0]() is not cu_k or seen[1:] != stamp[1:]:
            if not torch.equal(cu_q, cu_k):
                raise ValueError(f"trifuse.{OP}: causal=True needs each sequence's query and key lengths "
                                 "equal (cu_seqlens_q == cu_seqlens_k): with unequal ones flash-attn aligns "
                                 "the diagonal bottom-right and SDPA top-left, and a caller may expect "
                                 "either")
            _EQUAL_OFFSETS[cu_q] = stamp


def _check_window(window: object, causal: bool) -> None:
    """window: an int >= 0 (0: none); a window needs causal (transformers' sliding windows are)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise TypeError(f"trifuse.{OP}: sliding_window must be a positive int or None, got {window!r}")
    if window and not causal:
        raise ValueError(f"trifuse.{OP}: sliding_window needs causal=True (a window to the left of the "
                         "diagonal, as transformers' sliding-window layers)")


def _max_seqlen(cu: torch.Tensor) -> int:
    return int(cu.diff().max()) if cu.numel() > 1 else 0


# =============================================================================================
# Packed masks: a dense bool mask that is exactly block-diagonal causal (optionally within a
# sliding window) is varlen attention over its blocks. transformers builds such a (1, 1, T, T)
# mask for SDPA from packed position ids (DataCollatorWithFlattening, TRL's padding_free), and
# chunked attention (Llama 4) is one too; `trifuse.ops.attention` recognizes them on eager calls
# and runs varlen: the same answer, without scoring every other sequence's keys.
# =============================================================================================

# mask (its base tensor) -> (version, shape, strides, offset, result): checked once per mask; a
# model's layers share one (in fused graphs, views of one).
_PACKED_MASKS = torch.utils.weak.WeakTensorKeyDictionary()
_CHECK_ELEMENTS = 1 << 24  # mask entries compared per step of the check (16 MiB of bools)


def packed_mask_offsets(mask: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int] | None:
    """(cu_seqlens int32, longest block, window or 0) when `mask`, broadcast to (1, 1, n, n),
    keeps exactly: query i sees key j iff both lie in one block, j <= i, and (with a window w)
    j > i - w. Bool masks, or additive ones holding only 0 and masked entries (<= -65504, -inf).
    None otherwise (padding, a bias, bidirectional spans, per-head masks, any other pattern). The
    first time a mask is seen it costs one pass over it and two syncs; the verdict is cached with
    the mask. Batches of one only: the flattening collators' layout, and no check (nor its sync)
    for the padded batches of ordinary training."""
    if mask.dim() < 2 or mask.shape[-2:] != (n, n) or n == 0 or mask.requires_grad:
        return None
    if any(d != 1 for d in mask.shape[:-2]):
        return None
    base = mask if mask._base is None else mask._base
    if base.is_inference():  # no version counter to cache the verdict by, and a check a call costs
        return None          # two syncs: the dense kernels, which skip what the mask hides anyway
    view = (tuple(mask.shape), mask.stride(), mask.storage_offset())
    seen = _PACKED_MASKS.get(base)
    if seen is None or seen[0] != base._version or seen[1] != view:
        seen = (base._version, view, _packed_offsets(mask.reshape(1, n, n)))
        _PACKED_MASKS[base] = seen
    return seen[2]


def _packed_offsets(mask: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
    """packed_mask_offsets' check of (rows, n, n) masks: the blocks read off the sub-diagonal (a
    block starts where a query does not see the token before it), the window off the row counts,
    then every entry compared with the pattern they imply, in chunks of rows."""
    rows, n = mask.shape[0], mask.shape[1]
    if mask.dtype == torch.bool:
        keep, valid = mask, torch.ones((), dtype=torch.bool, device=mask.device)
    elif mask.is_floating_point():
        keep = mask == 0
        valid = (keep | (mask <= attn._MASKED_AT_OR_BELOW)).all()
    else:
        return None
    idx = torch.arange(n, device=mask.device)
    start = torch.ones(rows, n, dtype=torch.bool, device=mask.device)
    start[:, 1:] = ~keep.diagonal(-1, dim1=1, dim2=2)
    flat = torch.arange(rows * n, device=mask.device)
    start = start.flatten()
    block = start.cumsum(0).view(rows, n)  # block ids across the batch's rows
    pos = (flat - torch.where(start, flat, 0).cummax(0).values).view(rows, n)  # position within the block
    seen = keep.sum(-1)
    # a window: some query sees fewer keys than its position allows; w is the most any query sees
    window = torch.where((seen == pos + 1).all(), 0, seen.max())
    counts = torch.where(window > 0, torch.minimum(pos + 1, window), pos + 1)
    ok = valid & keep.diagonal(dim1=1, dim2=2).all() & (seen == counts).all()
    step = max(1, _CHECK_ELEMENTS // n)
    for r in range(rows):
        for q0 in range(0, n, step):
            i = idx[q0:q0 + step, None]
            expected = (block[r, q0:q0 + step, None] == block[r][None, :]) & (idx[None, :] <= i)
            expected &= (window == 0) | (idx[None, :] > i - window)
            ok &= (keep[r, q0:q0 + step] == expected).all()
    ok, window = torch.stack([ok.to(torch.long), window.to(torch.long)]).tolist()
    if not ok:
        return None
    cu = torch.cat([start.nonzero().flatten(), flat.new_tensor([rows * n])]).to(torch.int32)
    longest = int(cu.diff().max())
    _CHECKED_OFFSETS[cu] = (cu._version, rows * n, longest)  # valid by construction
    return cu, longest, 0 if window >= longest else window


# =============================================================================================
# Registered ops (torch.compile, fx, export) and the eager autograd.Function
# =============================================================================================

Tensor = torch.Tensor


def _resolve_scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


@torch.library.custom_op("trifuse::attention_varlen", mutates_args=())
def _attention_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, causal: bool,
                         scale: float | None, softcap: float, sinks: Tensor | None = None,
                         window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, causal, scale)
    attn._check_softcap(softcap, OP)
    attn._check_sinks(q, sinks, OP)
    _check_window(window, causal)
    _check_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
    seed = philox_seed(q.device) if dropout_p > 0.0 else q.new_empty(0, dtype=torch.int64)
    o, lse = attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  causal, _resolve_scale(scale, q.shape[-1]), seed, softcap, sinks, window)
    return o, lse, seed


@_attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal, scale, softcap,
      sinks=None, window=0):
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, causal, scale)
    attn._check_softcap(softcap, OP)
    attn._check_sinks(q, sinks, OP)
    _check_window(window, causal)
    o = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=attn._stat_dtype(q.dtype))
    return o, lse, q.new_empty(1 if dropout_p > 0.0 else 0, dtype=torch.int64)


@torch.library.custom_op("trifuse::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward_op(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, seed: Tensor, cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, causal: bool,
    scale: float | None, softcap: float, sinks: Tensor | None = None, window: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks); dsinks is an empty tensor without sinks."""
    dq, dk, dv, dsinks = attention_varlen_bwd(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, dropout_p, causal,
                                              _resolve_scale(scale, q.shape[-1]), seed, softcap, sinks,
                                              window)
    return dq, dk, dv, q.new_empty(0) if dsinks is None else dsinks


@_attention_varlen_backward_op.register_fake
def _(do, q, k, v, o, lse, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
      scale, softcap, sinks=None, window=0):
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, softcap, *rest = inputs
    sinks, window = (*rest, *(None, 0)[len(rest):])  # trailing defaults may be left out
    o, lse, seed = output
    ctx.save_for_backward(q, k, v, o, lse, seed, cu_q, cu_k, sinks)
    ctx.args = (max_q, max_k, dropout_p, causal, scale, softcap)
    ctx.window = window


def _registered_twice(ctx, do, *_):
    """_varlen_twice for the registered op: its inputs as the eager Function's, scale unresolved
    and the soft cap among ctx.args."""
    max_q, max_k, dropout_p, causal, scale, softcap = ctx.args
    scale = _resolve_scale(scale, ctx.saved_tensors[0].shape[-1])
    needs = (*ctx.needs_input_grad, False, False)  # trailing defaults left out of a call have no entry
    view = ctx_as(ctx, needs, args=(max_q, max_k, dropout_p, causal, scale), softcap=softcap,
                  window=ctx.window)
    return _varlen_twice(view, do)


@single_backward(twice=_registered_twice, op="attention_varlen")
def _backward_varlen(ctx, do, *_):
    q, k, v, o, lse, seed, cu_q, cu_k, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.trifuse.attention_varlen_backward(do, q, k, v, o, lse, seed, cu_q, cu_k,
                                                                     *ctx.args, sinks, ctx.window)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None if sinks is None else dsinks, None


torch.library.register_autograd("trifuse::attention_varlen", _backward_varlen, setup_context=_setup_varlen)


def _varlen_twice(ctx, do):
    """The backward in PyTorch ops, differentiable again (create_graph=True): SDPA's math on each
    packed sequence of the saved q, k, v, the dropout mask materialized from the forward's seed
    (attention.dropout_keep over (head, token) rows). O(Sq Sk) memory a sequence, one host sync."""
    q, k, v, o, lse, seed, cu_q, cu_k, sinks = ctx.saved_tensors
    max_q, max_k, dropout_p, causal, scale = ctx.args
    group = q.shape[1] // k.shape[1]
    spans = _spans(cu_q, cu_k)
    keep = None
    if dropout_p > 0.0 and attn._use_kernels(q):
        keep = attn.dropout_keep(seed, (1, q.shape[1], q.shape[0], max_k), dropout_p, q)[0]

    def forward(q, k, v, sinks):
        outs = []  # one a sequence, in token order (the offsets run from 0 to every token, checked)
        for b, sq, sk in spans:
            n_q, n_k = sq.stop - sq.start, sk.stop - sk.start
            if n_q == 0:
                continue
            if n_k == 0:
                outs.append(o.new_zeros(n_q, *o.shape[1:]))
                continue
            p, _, _ = attn._torch_probs(_heads_first(q[sq]), attn._repeat_kv(_heads_first(k[sk]), group),
                                        _band(sq, sk, ctx.window, q.device), causal, scale, ctx.softcap, sinks)
            if dropout_p > 0.0:
                kept = (keep[:, sq, :n_k] if keep is not None
                        else attn._torch_keep_mask(seed + b, p.shape, dropout_p).to(p.device))
                p = torch.where(kept, p * attn._dropout_scale(dropout_p), 0.0)
            o_b = p @ attn._repeat_kv(_heads_first(v[sk]), group).to(p.dtype)
            outs.append(o_b[0].transpose(0, 1).to(o.dtype))
        return torch.cat(outs) if outs else o.new_zeros(o.shape)

    needs = ctx.needs_input_grad
    dq, dk, dv, dsinks = reference_grads(forward, (q, k, v, sinks), (*needs[:3], needs[11]), (do,))
    return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks, None


class _VarlenFunction(torch.autograd.Function):
    """The eager path: straight over the launchers (a registered op's dispatch costs host time)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, softcap, sinks, window):
        seed = philox_seed(q.device) if dropout_p > 0.0 else None
        o, lse = attention_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, seed,
                                      softcap, sinks, window)
        ctx.save_for_backward(q, k, v, o, lse, seed, cu_q, cu_k, sinks)
        ctx.args = (max_q, max_k, dropout_p, causal, scale)
        ctx.softcap, ctx.window = softcap, window
        return o

    @staticmethod
    @single_backward(twice=_varlen_twice)
    def backward(ctx, do):
        q, k, v, o, lse, seed, cu_q, cu_k, sinks = ctx.saved_tensors
        max_q, max_k, dropout_p, causal, scale = ctx.args
        with profiled("trifuse::attention_varlen_backward"):
            dq, dk, dv, dsinks = attention_varlen_bwd(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k,
                                                      dropout_p, causal, scale, seed, ctx.softcap,
                                                      sinks if ctx.needs_input_grad[11] else None, ctx.window)
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks, None


# =============================================================================================
# Dialect: trifuse's kernels, PyTorch's own varlen attention (torch.nn.attention.varlen, flash
# backend) and flash-attn's flash_attn_varlen_func when importable; the fastest correct one chosen
# once per (device, dtype, buckets of sequences, tokens and lengths, heads, head dims, flags) on the
# GPU and cached on disk (autotune/dialects.py). Calls with a soft cap or sinks, and traced calls,
# go to trifuse's kernels directly. The arguments reach the candidates checked (attention_varlen
# runs the checks first) and normalized: (q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale,
# causal, window), window 0 for none, causal only with equal offsets (where top-left and
# bottom-right alignment agree).
# =============================================================================================

_DIALECT_KEY_NAMES = ("device", "dtype", "seqs", "tokens", "max_q", "max_k", "heads", "h_kv", "d", "dv", "causal",
                      "window", "dropout", "grad")


def _varlen_key(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window):
    """The dialect key of an eager call; None (trifuse's kernels) when traced or empty. Ints,
    dtypes and flags: it runs on every call."""
    if not eager_fast_path(q, k, v, cu_q, cu_k) or q.dim() != 3 or k.dim() != 3 or cu_q.dim() != 1:
        return None
    if not q.numel() or not k.numel():
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    heads, h_kv = q.shape[1], k.shape[1]
    return (q.get_device() if q.is_cuda else -1, q.dtype, pow2_bucket(cu_q.shape[0] - 1), pow2_bucket(q.shape[0]),
            pow2_bucket(max_q), pow2_bucket(max_k), heads, h_kv if h_kv != heads else 0, q.shape[2], v.shape[2],
            causal, pow2_bucket(window), dropout_p > 0.0, grad)


def _varlen_trifuse(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window, softcap=0.0, sinks=None):
    """trifuse's kernels (the arguments checked by attention_varlen)."""
    if eager_fast_path(q, k, v, cu_q, cu_k, sinks):
        with profiled(f"trifuse::{OP}"):
            return apply_function(_VarlenFunction, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal,
                                  _resolve_scale(scale, q.shape[-1]), softcap, sinks, window)
    return torch.ops.trifuse.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal,
                                              None if scale is None else float(scale), softcap, sinks, window)[0]


def _window_size(causal: bool, window: int) -> tuple[int, int]:
    """flash-attn's (and PyTorch's varlen) window_size for trifuse's causal flag and window."""
    if window:
        return (window - 1, 0)
    return (-1, 0) if causal else (-1, -1)


@functools.cache
def _torch_varlen_takes_gqa() -> bool:
    import inspect

    from torch.nn.attention.varlen import varlen_attn
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _torch_varlen_supports(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window) -> str | None:
    problem = attn.flash_layout_problem("PyTorch's varlen_attn", q, k, v)
    if problem is not None:
        return problem
    if dropout_p > 0.0:
        return "PyTorch's varlen_attn takes no dropout"
    if k.shape[1] != q.shape[1] and not _torch_varlen_takes_gqa():
        return f"PyTorch's varlen_attn takes no GQA in torch {torch.__version__} (no enable_gqa)"
    return None


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window):
    from torch.nn.attention.varlen import varlen_attn  # requires= checked it imports

    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    with profiled(f"trifuse::{OP}"):
        return varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, scale=scale,
                           window_size=_window_size(causal, window), **gqa)


def _flash_attn_varlen_supports(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window) -> str | None:
    return attn.flash_layout_problem("flash-attn", q, k, v)


def _flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window):
    from flash_attn import flash_attn_varlen_func  # requires= checked it imports

    # Fewer kv heads (GQA / MQA) natively; causal only with equal offsets here, where its
    # bottom-right alignment is trifuse's top-left.
    return flash_attn_varlen_func(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                                  dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                                  window_size=_window_size(causal, window) if window else (-1, -1))


# The check: each sequence against attention_ref in float64, a block of query rows at a time
# (attention.py's `_reference_blocks`), outputs and gradients, with the reference in the inputs'
# dtype as PyTorch's own error; with dropout, attention's: the call at p = 0 against the
# reference, then at p > 0 a changed and repeatable output.


def _varlen_reference(args: tuple, dtype: torch.dtype, dy: torch.Tensor | None, train: bool) -> list:
    """[o, dq, dk, dv] (gradients only when train) of the packed call in `dtype`, sequence by sequence."""
    q, k, v, cu_q, cu_k, _, _, _, scale, causal, window = args
    o = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v))
    gqa = k.shape[1] != q.shape[1]
    for _, sq, sk in _spans(cu_q, cu_k):
        if sq.stop == sq.start or sk.stop == sk.start:
            continue  # no queries, or no keys: zeros, as the kernels give
        mask, is_causal = None, causal
        if window:  # the causal band as one bool mask
            n_q, n_k = sq.stop - sq.start, sk.stop - sk.start
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril() & _band(sq, sk, window, q.device)
            is_causal = False
        blocks = attn._reference_blocks((_heads_first(q[sq]), _heads_first(k[sk]), _heads_first(v[sk]), mask, 0.0,
                                         is_causal, scale, gqa), dtype,
                                        None if dy is None else _heads_first(dy[sq]), train)
        o[sq] = blocks[0][0].transpose(0, 1)
        if train:
            dq[sq] = blocks[1][0].transpose(0, 1)
            dk[sk] += blocks[2][0].transpose(0, 1)
            dv[sk] += blocks[3][0].transpose(0, 1)
    return [o, dq, dk, dv] if train else [o]


def _varlen_dialect_ref(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window):
    """The spec of a dialect call without dropout: attention_ref per sequence."""
    return _varlen_reference((q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, causal, window), q.dtype, None,
                             False)[0]


def _varlen_output_like(q, k, v, *rest):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])).requires_grad_(
        q.requires_grad or k.requires_grad or v.requires_grad)


def _run_varlen(fn, args: tuple, dy: torch.Tensor, train: bool) -> list:
    q, k, v = (t.detach().requires_grad_(train) for t in args[:3])
    o = fn(q, k, v, *args[3:])
    if not train:
        return [o.detach()]
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), dy, allow_unused=True)]


def _varlen_check(fn, args: tuple) -> str | None:
    q, k, v = args[:3]
    dropout_p = args[7]
    train = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    no_drop = (*args[:7], 0.0, *args[8:])

    def references():
        gen = torch.Generator(device=q.device).manual_seed(0)
        dy = torch.randn((q.shape[0], q.shape[1], v.shape[2]), generator=gen, device=q.device, dtype=q.dtype)
        return dy, _varlen_reference(no_drop, torch.float64, dy, train), _varlen_reference(no_drop, q.dtype, dy, train)

    with torch.autocast(q.device.type, enabled=False):
        dy, ref64, ref_lowp = dialects.shared_by_checks("attention_varlen check", args, references)
        got = _run_varlen(fn, no_drop, dy, train)
    labels = ("output", "dq", "dk", "dv")
    for label, g, e64, elp in zip(labels, got, ref64, ref_lowp):
        problem = dialects.gate(label + (" at dropout_p=0" if dropout_p > 0.0 else ""), g, e64, elp)
        if problem is not None:
            return problem
    if dropout_p <= 0.0:
        return None
    return attn.dropout_problem(lambda: _run_varlen(fn, args, dy, train), got, dropout_p, q.device, labels)


ATTENTION_VARLEN = dialects.define(
    OP, _varlen_key, _DIALECT_KEY_NAMES, reference=_varlen_dialect_ref, check=_varlen_check,
    output_like=_varlen_output_like)
ATTENTION_VARLEN.register(dialects.Candidate("trifuse", _varlen_trifuse))
ATTENTION_VARLEN.register(dialects.Candidate("torch-varlen", _torch_varlen, supports=_torch_varlen_supports,
                                             deterministic=False, requires=("torch.nn.attention.varlen",)))
ATTENTION_VARLEN.register(dialects.Candidate("flash-attn", _flash_attn_varlen, supports=_flash_attn_varlen_supports,
                                             deterministic=False, requires=("flash_attn",)))


@outside_device_modes
def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention over sequences packed along the token axis: flash-attn's `flash_attn_varlen_func`
    arguments and semantics, on trifuse's kernels, forward and backward.

    Args:
        q: (total_q, Hq, D); k: (total_k, Hkv, D); v: (total_k, Hkv, Dv). fp16 / bf16 / fp32 /
            fp64, one dtype; D, Dv <= 256; any strides (views of a fused QKV projection). Hkv
            divides Hq (GQA / MQA; K and V are never repeated).
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 or int64 offsets on q's device, from 0 to
            total_q (total_k), non-decreasing: sequence b is rows cu[b]:cu[b + 1]. A sequence may
            be empty; one with queries but no keys gives 0 (as SDPA's fully masked rows).
        max_seqlen_q, max_seqlen_k: the longest sequence (sizes the launch grid). None: computed
            from the offsets, a device sync; pass them (transformers and flash-attn callers do)
            to keep the call asynchronous and traceable.
        dropout_p: dropout on the attention probabilities, Philox seeded from PyTorch's
            generator, regenerated in the backward. Pass 0.0 in eval.
        softmax_scale: multiplies Q K^T; None means 1 / sqrt(D).
        causal: query i of a sequence sees its keys j <= i. Requires cu_seqlens_q ==
            cu_seqlens_k (packed self-attention, where top-left and flash-attn's bottom-right
            alignment agree); other offsets are refused.
        softcap: a logit soft cap c > 0 (flash-attn's softcap): scores become c * tanh(s / c).
        sinks: attention sinks (gpt-oss), (Hq,) logits, as in `trifuse.ops.attention`: one more
            score in each row's softmax that has no value; may require grad.
        sliding_window: with causal, query i sees only keys j > i - sliding_window (transformers'
            sliding_window; flash-attn's window_size=(sliding_window - 1, 0)). None: no window.

    Under autocast, q, k and v are cast to the autocast dtype first, as SDPA's inputs are.

    Eager calls without a soft cap or sinks run trifuse's kernels, PyTorch's varlen_attn or
    flash-attn's flash_attn_varlen_func (when installed), whichever the `attention_varlen` dialect
    found fastest and correct for this shape on this GPU (`trifuse.autotune.dialects.explain(
    "attention_varlen")` lists the choices); elsewhere, and under torch.compile, trifuse's.

    Returns:
        (total_q, Hq, Dv), contiguous, in q's dtype.

    Raises:
        TypeError / ValueError naming the argument: ranks, dtypes, head counts, offsets that are
        not int32/int64 1-D, do not run from 0 to the token count, decrease, or hold a sequence
        longer than max_seqlen.
    """
    named = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    for name, t in named:
        check_tensor(OP, name, t)
    check_probability(OP, "dropout_p", dropout_p)
    attn._check_softcap(softcap, OP)
    attn._check_sinks(q, sinks, OP)
    window = 0 if sliding_window is None else sliding_window
    _check_window(window, causal)
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
    if max_seqlen_q is None:
        max_seqlen_q = _max_seqlen(cu_seqlens_q)
    if max_seqlen_k is None:
        max_seqlen_k = max_seqlen_q if cu_seqlens_k is cu_seqlens_q else _max_seqlen(cu_seqlens_k)
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    softcap = float(softcap or 0.0)
    window = 0 if window >= max_k else int(window)  # a window no sequence outgrows changes nothing
    if eager_fast_path(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks):
        _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, causal, softmax_scale)
        _check_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_q, max_k, bool(causal))
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, float(dropout_p), softmax_scale, bool(causal),
                window)
        if softcap or sinks is not None:  # no other candidate takes both: trifuse's kernels
            return _varlen_trifuse(*args, softcap, sinks)
        return ATTENTION_VARLEN(*args)
    scale = None if softmax_scale is None else float(softmax_scale)
    return torch.ops.trifuse.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                                              float(dropout_p), bool(causal), scale, softcap, sinks,
                                              window)[0]
