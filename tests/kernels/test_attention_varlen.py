"""Varlen attention (sequences packed along the token axis) against the float64 oracle.

The oracle is `attention_ref` over all the packed tokens at once with a block-diagonal mask (each
query sees its own sequence's keys, and with causal only those j <= i): the definition of packed
attention, independent of the kernels' per-sequence programs. On CPU the real kernels run in
Triton's interpreter with small unequal blocks (32 x 16, 16 x 32 in dK/dV), so sequences of
up to ~40 tokens cross block boundaries, the diagonal and ragged last blocks.
"""
import math
from dataclasses import dataclass

import pytest
import torch
import trifuse
from _device import DEVICE, ON_GPU
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close
from trifuse.kernels import attention as attn_mod
from trifuse.kernels import attention_varlen as varlen_mod
from trifuse.kernels.attention import attention_ref

varlen = trifuse.ops.attention_varlen


@dataclass(frozen=True)
class Case:
    lens_q: tuple[int, ...] = (5, 0, 37, 1, 20)
    lens_k: tuple[int, ...] | None = None  # None: the query lengths (packed self-attention)
    h: int = 2
    h_kv: int | None = None
    d: int = 16
    dv: int | None = None
    causal: bool = False
    scale: float | None = None
    softcap: float = 0.0
    sinks: bool = False  # gpt-oss's attention sinks, one logit per query head
    window: int | None = None  # a causal sliding window (transformers' sliding_window)

    @property
    def keys(self) -> tuple[int, ...]:
        return self.lens_q if self.lens_k is None else self.lens_k

    @property
    def id(self) -> str:
        kv = f"/{self.h_kv}" if self.h_kv is not None else ""
        lens = "-".join(map(str, self.lens_q))
        if self.lens_k is not None:
            lens += "_k" + "-".join(map(str, self.lens_k))
        parts = [f"{lens}x{self.h}{kv}x{self.d}" + (f"v{self.dv}" if self.dv else ""),
                 "causal" if self.causal else "full"]
        parts += [f"scale{self.scale}"] * (self.scale is not None)
        parts += [f"cap{self.softcap}"] * bool(self.softcap) + ["sinks"] * self.sinks
        parts += [f"window{self.window}"] * (self.window is not None)
        return "-".join(parts)


CASES = [
    Case(lens_q=(37,)),  # one sequence: plain attention
    Case(),
    Case(causal=True, h=4, h_kv=2),
    Case(lens_q=(1,) * 9 + (33,), causal=True),  # many one-token sequences beside a long one
    Case(lens_q=(3, 20, 0, 9), lens_k=(17, 5, 8, 0)),  # cross-attention; queries with no keys give 0
    Case(lens_q=(12, 30), h=4, h_kv=1, d=80, dv=24),  # MQA, head dims that are not powers of two
    Case(lens_q=(9, 21), h=1, d=192, dv=128, causal=True),  # DeepSeek's MLA head dims
    Case(lens_q=(25, 14), scale=0.3, softcap=5.0, causal=True),
    Case(lens_q=(13, 0, 30, 2), h=4, h_kv=2, causal=True, sinks=True),
    Case(lens_q=(3, 20, 0, 9), lens_k=(17, 5, 8, 0), sinks=True),  # a sink alone for the queries without keys
    # sliding windows: narrower than a block, between the two kinds of blocks, wider than most sequences
    Case(lens_q=(40, 3, 29), causal=True, window=5),
    Case(lens_q=(40, 17), h=4, h_kv=2, causal=True, window=20, sinks=True, softcap=4.0),
    Case(lens_q=(45, 12, 1), causal=True, window=33),
    # heads narrower than the dots' 16-wide tile, padded on the host (a value head of 8 beside a
    # query head of 24 read V wrong on the H200 unpadded)
    Case(lens_q=(40, 23), d=24, dv=8, causal=True),
    Case(lens_q=(19, 7), lens_k=(21, 30), d=8),
]
if ON_GPU:
    CASES += [Case(lens_q=(300, 1, 517, 64), h=4, h_kv=2, d=d, causal=c)
              for d in (64, 128) for c in (False, True)]


def offsets(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


def make(case: Case, dtype: torch.dtype):
    h_kv = case.h if case.h_kv is None else case.h_kv
    tq, tk = sum(case.lens_q), sum(case.keys)
    q = torch.randn(tq, case.h, case.d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(tk, h_kv, case.d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(tk, h_kv, case.dv or case.d, device=DEVICE, dtype=dtype, requires_grad=True)
    cu_q = offsets(case.lens_q)
    return q, k, v, cu_q, (cu_q if case.lens_k is None else offsets(case.lens_k))


def make_sinks(case: Case, dtype: torch.dtype) -> torch.Tensor | None:
    if not case.sinks:
        return None
    sinks = torch.randn(case.h, device=DEVICE, dtype=dtype) * 2
    sinks[0] = float("-inf") if case.h > 2 else sinks[0]  # a head without a sink
    return sinks.requires_grad_()


def block_mask(lens_q, lens_k, causal: bool, window: int | None = None) -> torch.Tensor:
    """(Tq, Tk) bool: True where query i and key j are in one sequence (and j <= i with causal,
    j > i - window with a window, positions counted within the sequence)."""
    seq_q = torch.repeat_interleave(torch.arange(len(lens_q)), torch.tensor(lens_q, dtype=torch.int64))
    seq_k = torch.repeat_interleave(torch.arange(len(lens_k)), torch.tensor(lens_k, dtype=torch.int64))
    pos_q = torch.cat([torch.arange(n) for n in lens_q]) if sum(lens_q) else torch.zeros(0, dtype=torch.int64)
    pos_k = torch.cat([torch.arange(n) for n in lens_k]) if sum(lens_k) else torch.zeros(0, dtype=torch.int64)
    keep = seq_q[:, None] == seq_k[None, :]
    if causal:
        keep &= pos_k[None, :] <= pos_q[:, None]
    if window is not None:
        keep &= pos_k[None, :] > pos_q[:, None] - window
    return keep.to(DEVICE)


def packed_ref(q, k, v, case: Case, dropout_p=0.0, dropout_mask=None, sinks=None):
    """attention_ref on (1, H, T, D) with the block-diagonal mask, back to (T, H, Dv)."""
    mask = block_mask(case.lens_q, case.keys, case.causal, case.window)
    heads = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    out = attention_ref(*heads, mask, dropout_p, scale=case.scale, enable_gqa=True, dropout_mask=dropout_mask,
                        softcap=case.softcap or None, sinks=sinks)
    return out[0].transpose(0, 1)


def call(q, k, v, cu_q, cu_k, case: Case, **kw):
    return varlen(q, k, v, cu_q, cu_k, max(case.lens_q, default=0), max(case.keys, default=0),
                  softmax_scale=case.scale, causal=case.causal, softcap=case.softcap,
                  sliding_window=case.window, **kw)


def check_fwd_bwd(case: Case, dtype: torch.dtype, *, dropout_p=0.0, dropout_mask=None, seed=None,
                  inputs=None):
    q, k, v, cu_q, cu_k = make(case, dtype) if inputs is None else inputs
    sinks = make_sinks(case, dtype)
    if seed is not None:
        torch.manual_seed(seed)
    out = call(q, k, v, cu_q, cu_k, case, dropout_p=dropout_p, sinks=sinks)
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.is_contiguous()
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    lowp = [t.detach().clone().requires_grad_() for t in inputs]
    ref = packed_ref(*leaves[:3], case, dropout_p, dropout_mask, *leaves[3:])
    ref_lp = packed_ref(*lowp[:3], case, dropout_p, dropout_mask, *lowp[3:])
    assert_close(f"{case.id} out", out, ref, ref_lp)
    if out.numel() == 0:
        return
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    g64 = torch.autograd.grad(ref, leaves, dout.double())
    glp = torch.autograd.grad(ref_lp, lowp, dout)
    for name, x, a, a64, alp in zip(("dq", "dk", "dv", "dsinks"), inputs, grads, g64, glp):
        assert a.dtype == x.dtype and a.shape == x.shape
        assert_close(f"{case.id} {name}", a, a64, alp)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, case):
    check_fwd_bwd(case, dtype)


@settings(max_examples=8, deadline=None)
@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=5), causal=st.booleans(),
       group=st.sampled_from([1, 2]))
def test_hypothesis_sequence_lengths(lens, causal, group):
    torch.manual_seed(sum(lens) * 7 + len(lens))
    check_fwd_bwd(Case(lens_q=tuple(lens), h=2, h_kv=2 // group, causal=causal), torch.float32)


def test_strided_views_of_a_fused_projection():
    """q, k, v as slices of one (T, 3, H, D) projection (HF's flash path hands such views over)."""
    case = Case(causal=True)
    t = sum(case.lens_q)
    qkv = torch.randn(t, 3, case.h, case.d, device=DEVICE, requires_grad=True)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    cu = offsets(case.lens_q)
    out = call(q, k, v, cu, cu, case)
    dense = call(*(x.detach().contiguous().requires_grad_() for x in (q, k, v)), cu, cu, case)
    torch.testing.assert_close(out, dense, rtol=0, atol=0)
    check_fwd_bwd(case, torch.float32, inputs=(q, k, v, cu, cu))


def test_empty_inputs():
    for lens in ((0,), (0, 0, 0)):
        case = Case(lens_q=lens)
        q, k, v, cu, _ = make(case, torch.float32)
        out = call(q, k, v, cu, cu, case)
        assert out.shape == (0, case.h, case.d)
        out.sum().backward()
        assert q.grad.shape == q.shape
    q = torch.randn(0, 2, 16, device=DEVICE)
    assert varlen(q, q, q, offsets(()), offsets(())).shape == (0, 2, 16)  # no sequence at all


def test_one_long_sequence_equals_dense_attention():
    q, k, v, cu, _ = make(Case(lens_q=(45,), h=4, h_kv=2), torch.float32)
    out = varlen(q, k, v, cu, cu, causal=True)
    dense = trifuse.ops.attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True,
                                  enable_gqa=True)
    torch.testing.assert_close(out, dense[0].transpose(0, 1), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------------


def kernel_keep_mask(lens: tuple[int, ...], h: int, p: float, seed: int) -> torch.Tensor:
    """The kernels' keep mask as a dense (1, H, T, T) bool (False outside the sequences): with
    q = k = 0 every probability in sequence b is 1 / n_b, and v = I reads each one out."""
    t = sum(lens)
    torch.manual_seed(seed)
    cu = offsets(lens)
    zeros = torch.zeros(t, h, 16, device=DEVICE)
    eye = torch.eye(t, device=DEVICE)[:, None, :].expand(t, h, t)
    with torch.no_grad():
        o = varlen(zeros, zeros, eye, cu, cu, dropout_p=p)
    n = torch.repeat_interleave(torch.tensor(lens, dtype=torch.float32), torch.tensor(lens)).to(DEVICE)
    return ((o * (n[:, None, None] * (1.0 - p))) > 0.5).transpose(0, 1)[None] & block_mask(lens, lens, False)


@pytest.mark.parametrize("case", [Case(lens_q=(13, 0, 30, 2), h=4, h_kv=2, causal=True),
                                  Case(lens_q=(37, 6), causal=True, window=9)], ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_matches_oracle_with_the_kernels_mask(dtype, case):
    p = 0.3
    keep = kernel_keep_mask(case.lens_q, case.h, p, seed=123)
    check_fwd_bwd(case, dtype, dropout_p=p, dropout_mask=keep, seed=123)


def test_dropout_keeps_the_right_fraction_and_is_repeatable():
    p, lens = 0.25, (40, 33, 27)
    keep = kernel_keep_mask(lens, 3, p, seed=7)
    inside = block_mask(lens, lens, False).expand_as(keep)
    n = int(inside.sum())
    assert abs(keep[inside].float().mean().item() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(keep, kernel_keep_mask(lens, 3, p, seed=7))
    assert not torch.equal(keep, kernel_keep_mask(lens, 3, p, seed=8))
    assert not torch.equal(keep[0, 0], keep[0, 1])  # per-head streams


def test_dropout_one_gives_zeros():
    case = Case()
    q, k, v, cu, _ = make(case, torch.float32)
    out = call(q, k, v, cu, cu, case, dropout_p=1.0)
    assert out.eq(0).all()
    assert all(g.eq(0).all() for g in torch.autograd.grad(out.sum(), (q, k, v)))


# ---------------------------------------------------------------------------------------------
# gradcheck, determinism, the two dispatch paths, compile, opcheck, the torch path
# ---------------------------------------------------------------------------------------------


def test_gradcheck_float64():
    def leaf(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.float64, requires_grad=True)

    cu = offsets((3, 0, 5))
    q, k, v = leaf(8, 2, 4), leaf(8, 1, 4), leaf(8, 1, 3)
    assert torch.autograd.gradcheck(lambda *a: varlen(*a, cu, cu, 5, 5, causal=True), (q, k, v))

    def dropped(*a):
        torch.manual_seed(3)
        return varlen(*a, cu, cu, 5, 5, dropout_p=0.3, softmax_scale=0.7, softcap=2.0)

    assert torch.autograd.gradcheck(dropped, (q, k, v), fast_mode=True)
    sinks = leaf(2)
    # fast mode (a random projection of the Jacobian): the full check above already covers q, k, v
    assert torch.autograd.gradcheck(lambda *a: varlen(*a[:3], cu, cu, 5, 5, causal=True, sinks=a[3],
                                                      sliding_window=2), (q, k, v, sinks), fast_mode=True)


def test_backward_is_deterministic():
    case = Case(h=4, h_kv=1, d=32, causal=True)
    q, k, v, cu, _ = make(case, torch.float32)
    results = []
    for _ in range(2):
        torch.manual_seed(5)
        out = call(q, k, v, cu, cu, case, dropout_p=0.1)
        results.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_eager_path_and_registered_op_are_bitwise_equal(dropout_p):
    case = Case(h=4, h_kv=2, causal=True)
    q, k, v, cu, _ = make(case, torch.float32)
    torch.manual_seed(11)
    eager = call(q, k, v, cu, cu, case, dropout_p=dropout_p)
    torch.manual_seed(11)
    op = torch.ops.trifuse.attention_varlen(q, k, v, cu, cu, 37, 37, dropout_p, True, None, 0.0)[0]
    assert torch.equal(eager, op)
    dout = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(eager, (q, k, v), dout), torch.autograd.grad(op, (q, k, v), dout)):
        assert torch.equal(a, b)


def test_compiles_fullgraph_without_graph_breaks():
    case = Case(h=4, h_kv=2, causal=True)
    q, k, v, cu, _ = make(case, torch.float32)

    def fn(q, k, v, cu):
        return varlen(q, k, v, cu, cu, 37, 37, dropout_p=0.2, causal=True)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.manual_seed(2)
    out = compiled(q, k, v, cu)
    torch.manual_seed(2)
    ref = fn(q, k, v, cu)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_opcheck():
    q, k, v, cu, _ = make(Case(lens_q=(4, 0, 9), h=4, h_kv=2), torch.float32)
    args = (q, k, v, cu, cu, 9, 9, 0.0, True, 0.5, 0.0)
    torch.library.opcheck(torch.ops.trifuse.attention_varlen.default, args)
    q, k, v = q.detach(), k.detach(), v.detach()
    o, lse, seed = torch.ops.trifuse.attention_varlen(q, k, v, cu, cu, 9, 9, 0.0, False, None, 3.0)
    assert lse.shape == (4, 13)
    torch.library.opcheck(torch.ops.trifuse.attention_varlen_backward.default,
                          (torch.randn_like(o), q, k, v, o, lse, seed, cu, cu, 9, 9, 0.0, False, None, 3.0))
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.trifuse.attention_varlen.default,
                          (q, k, v, cu, cu, 9, 9, 0.0, True, None, 0.0, sinks))
    o, lse, seed = torch.ops.trifuse.attention_varlen(q, k, v, cu, cu, 9, 9, 0.0, True, None, 0.0,
                                                      sinks.detach())
    torch.library.opcheck(torch.ops.trifuse.attention_varlen_backward.default,
                          (torch.randn_like(o), q, k, v, o, lse, seed, cu, cu, 9, 9, 0.0, True, None, 0.0,
                           sinks.detach()))
    torch.library.opcheck(torch.ops.trifuse.attention_varlen.default,
                          (q, k, v, cu, cu, 9, 9, 0.0, True, None, 0.0, sinks, 3))


def test_torch_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run attention.py's PyTorch path sequence by sequence."""
    monkeypatch.setattr(attn_mod, "use_triton", lambda t: False)
    for case in (Case(h=4, h_kv=2, causal=True, dv=8), Case(lens_q=(3, 20, 0, 9), lens_k=(17, 5, 8, 0)),
                 Case(lens_q=(25, 14), softcap=5.0, causal=True), Case(h=4, causal=True, sinks=True),
                 Case(lens_q=(40, 3, 29), causal=True, window=5)):
        check_fwd_bwd(case, torch.float32)
    case = Case(h=2, causal=True)
    q, k, v, cu, _ = make(case, torch.float32)
    torch.manual_seed(4)
    first = call(q, k, v, cu, cu, case, dropout_p=0.3)
    torch.manual_seed(4)
    assert torch.equal(first, call(q, k, v, cu, cu, case, dropout_p=0.3))


def test_autocast_casts_like_sdpa():
    case = Case(lens_q=(7, 12))
    q, k, v, cu, _ = make(case, torch.float32)
    with torch.autocast(DEVICE, dtype=torch.float16):
        out = call(q, k, v, cu, cu, case)
    assert out.dtype == torch.float16
    check_close("autocast", out, packed_ref(*(t.double() for t in (q, k, v)), case), None)


# ---------------------------------------------------------------------------------------------
# packed masks: trifuse.ops.attention recognizes a block-diagonal causal mask and runs varlen
# ---------------------------------------------------------------------------------------------


def as_additive(keep: torch.Tensor, low: float = float("-inf")) -> torch.Tensor:
    return torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, low)


def test_packed_masks_are_recognized_and_nothing_else():
    lens = (5, 1, 12, 7)
    t = sum(lens)
    keep = block_mask(lens, lens, True)[None, None]
    cu = offsets(lens)

    def found(mask):
        got = varlen_mod.packed_mask_offsets(mask, t)
        return None if got is None else (got[0].tolist(), got[1], got[2])

    assert found(keep) == (cu.tolist(), 12, 0)
    assert found(keep[0, 0]) == (cu.tolist(), 12, 0)  # (T, T)
    assert found(block_mask(lens, lens, True, window=3)[None, None]) == (cu.tolist(), 12, 3)
    wide = block_mask(lens, lens, True, window=40)[None, None]  # a window wider than any block: none
    assert found(wide) == (cu.tolist(), 12, 0)
    assert found(as_additive(keep)) == (cu.tolist(), 12, 0)
    assert found(as_additive(keep, torch.finfo(torch.float32).min)) == (cu.tolist(), 12, 0)
    padded = keep.clone()
    padded[..., 3] = False  # a padding key
    bidirectional = keep.clone()
    bidirectional[..., 6, 7] = True
    biased = as_additive(keep)
    biased[..., 8, 6] = -1.0  # a bias, not a mask
    per_head = torch.cat([keep, keep], 1)
    for mask in (padded, bidirectional, biased, per_head, block_mask(lens, lens, False)[None, None],
                 as_additive(keep).requires_grad_()):
        assert found(mask) is None
    # checked once per mask, again after an in-place change
    mask = keep.clone()
    assert found(mask) is not None
    mask[..., 3] = False
    assert found(mask) is None


@pytest.mark.parametrize("kind", ["bool", "additive", "window"])
def test_attention_on_a_packed_mask_runs_varlen(kind, monkeypatch):
    lens = (13, 1, 30, 6)
    window = 7 if kind == "window" else None
    case = Case(lens_q=lens, h=4, h_kv=2, causal=True, window=window)
    keep = block_mask(lens, lens, True, window)[None, None]
    mask = as_additive(keep) if kind == "additive" else keep
    q, k, v, _, _ = make(case, torch.float32)
    calls = []
    launcher = varlen_mod.attention_varlen_fwd
    monkeypatch.setattr(varlen_mod, "attention_varlen_fwd",
                        lambda *a, **kw: calls.append(1) or launcher(*a, **kw))
    heads = [t.transpose(0, 1)[None] for t in (q, k, v)]
    out = trifuse.ops.attention(*heads, attn_mask=mask, enable_gqa=True)
    assert calls and out.shape == (1, 4, sum(lens), 16)
    dense = attention_ref(*(t.detach().double() for t in heads), keep, enable_gqa=True)
    assert_close("packed", out, dense, attention_ref(*(t.detach() for t in heads), keep, enable_gqa=True))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected = torch.autograd.grad(packed_ref(q, k, v, case).sum(), (q, k, v))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# negative controls and bad input
# ---------------------------------------------------------------------------------------------


def test_negative_control_attention_across_sequences_fails():
    """The oracle tells packed attention from attention over the whole packed row."""
    case = Case(causal=True)
    q, k, v, cu, _ = make(case, torch.float32)
    whole = trifuse.ops.attention(*(t.transpose(0, 1)[None] for t in (q, k, v)),
                                  is_causal=True)[0].transpose(0, 1)
    leaves = [t.detach().double() for t in (q, k, v)]
    ok, _ = check_close("across", whole, packed_ref(*leaves, case), packed_ref(q, k, v, case))
    assert not ok


def test_negative_control_wrong_offsets_fail():
    """Offsets shifted by one token (an off-by-one a kernel could make) fail the same check."""
    case = Case(lens_q=(10, 17, 9))
    q, k, v, cu, _ = make(case, torch.float32)
    shifted = cu.clone()
    shifted[1:-1] += 1
    out = varlen(q, k, v, shifted, shifted, 18, 18)
    ok, _ = check_close("shifted", out, packed_ref(*(t.detach().double() for t in (q, k, v)), case),
                        packed_ref(q, k, v, case))
    assert not ok


def _inputs(t=10, h=2, d=8, h_kv=None, dtype=torch.float32):
    return (torch.randn(t, h, d, device=DEVICE, dtype=dtype),
            torch.randn(t, h_kv or h, d, device=DEVICE, dtype=dtype),
            torch.randn(t, h_kv or h, d, device=DEVICE, dtype=dtype))


def _cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


BAD_INPUTS = {
    "rank": (lambda: (torch.randn(1, 10, 2, 8), *_inputs()[1:], _cu(0, 10), _cu(0, 10)), {}, ValueError,
             "3-D"),
    "dtypes": (lambda: (*_inputs()[:2], _inputs(dtype=torch.float16)[2], _cu(0, 10), _cu(0, 10)), {},
               TypeError,
               "one dtype"),
    "offsets dtype": (lambda: (*_inputs(), _cu(0, 10, dtype=torch.float32), _cu(0, 10)), {}, ValueError,
                      "cu_seqlens_q must be a contiguous 1-D int32 or int64"),
    "offsets count": (lambda: (*_inputs(), _cu(0, 4, 10), _cu(0, 10)), {}, ValueError, "the same sequences"),
    "offsets start": (lambda: (*_inputs(), _cu(1, 10), _cu(1, 10)), {}, ValueError,
                      "from 0 to the number of tokens"),
    "offsets end": (lambda: (*_inputs(), _cu(0, 4, 8), _cu(0, 4, 8)), {}, ValueError,
                    "from 0 to the number of tokens (10)"),
    "offsets decrease": (lambda: (*_inputs(), _cu(0, 6, 3, 10), _cu(0, 6, 3, 10)), {}, ValueError,
                         "must not decrease"),
    "max_seqlen short": (lambda: (*_inputs(), _cu(0, 4, 10), _cu(0, 4, 10), 5, 6), {}, ValueError,
                         "longer than max_seqlen_q=5"),
    "causal unequal": (lambda: (*_inputs(), _cu(0, 4, 10), _cu(0, 5, 10)), {"causal": True}, ValueError,
                       "causal=True needs"),
    "gqa heads": (lambda: (*_inputs(h=3, h_kv=2), _cu(0, 10), _cu(0, 10)), {}, ValueError, "must divide"),
    "head dims": (lambda: (_inputs(d=8)[0], *_inputs(d=16)[1:], _cu(0, 10), _cu(0, 10)), {}, ValueError,
                  "same head_dim"),
    "dropout": (lambda: (*_inputs(), _cu(0, 10), _cu(0, 10)), {"dropout_p": 1.5}, ValueError, "dropout_p"),
    "softcap": (lambda: (*_inputs(), _cu(0, 10), _cu(0, 10)), {"softcap": -1.0}, ValueError, "softcap"),
    "window without causal": (lambda: (*_inputs(), _cu(0, 10), _cu(0, 10)), {"sliding_window": 4}, ValueError,
                              "sliding_window needs causal"),
    "window type": (lambda: (*_inputs(), _cu(0, 10), _cu(0, 10)), {"sliding_window": 2.5, "causal": True},
                    TypeError, "sliding_window must be"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_clear_error(name):
    make_args, kw, error, text = BAD_INPUTS[name]
    pattern = f"trifuse.attention_varlen: .*{text}".replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(error, match=pattern):
        varlen(*make_args(), **kw)


def test_offsets_are_checked_once_per_tensor(monkeypatch):
    """A model's layers share one offsets tensor: its values are read (a device sync) once, not
    per call, and read again after an in-place change."""
    q, k, v = _inputs()
    cu = _cu(0, 4, 10)
    reads = []
    stats = varlen_mod._offset_stats
    monkeypatch.setattr(varlen_mod, "_offset_stats", lambda t: reads.append(t) or stats(t))
    for _ in range(3):
        varlen(q, k, v, cu, cu, 6, 6)
    assert len(reads) == 1
    cu[1] = 11
    with pytest.raises(ValueError, match="must not decrease"):
        varlen(q, k, v, cu, cu, 10, 10)
