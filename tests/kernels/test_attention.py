"""Attention (FlashAttention-2 style kernels) against the float64 oracle, forward and backward.

On CPU these run the real Triton kernels in the interpreter (tests/_device.py) with small,
unequal blocks (32 queries x 16 keys, 16 x 32 in the dK/dV kernel), so sequence lengths up to
~64 already cross block boundaries, the causal diagonal and ragged last blocks. On a GPU the
same tests run natively with the tuned blocks, add bf16, every head dim and longer sequences.
"""
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import trifuse
from _device import DEVICE, ON_GPU
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close
from trifuse.kernels import attention as attn_mod
from trifuse.kernels.attention import attention_ref


@dataclass(frozen=True)
class Case:
    b: int = 1
    h: int = 2
    sq: int = 37
    sk: int = 37
    d: int = 16
    h_kv: int | None = None  # None: same as h
    causal: bool = False
    mask: str = ""  # "", "keypad", "bool", "float", "hf", "2d", "dead-rows", "packed", "window", "per-head"
    scale: float | None = None
    dv: int | None = None  # the value's head dim; None: d (DeepSeek's MLA: 192 for q and k, 128 for v)

    @property
    def id(self) -> str:
        kv = f"/{self.h_kv}" if self.h_kv is not None else ""
        dv = f"v{self.dv}" if self.dv is not None else ""
        parts = [f"{self.b}x{self.h}{kv}x{self.sq}x{self.sk}x{self.d}{dv}", "causal" if self.causal else "full"]
        parts += [p for p in (self.mask, f"scale{self.scale}" if self.scale is not None else "") if p]
        return "-".join(parts)


CASES = [
    Case(b=1, h=1, sq=1, sk=1),
    Case(b=2, h=2, sq=37, sk=37),
    Case(sq=1, sk=33),
    Case(sq=45, sk=45, d=32, causal=True),
    Case(sq=20, sk=50, causal=True),  # Sq < Sk: top-left aligned, keys >= Sq seen by nobody
    Case(sq=50, sk=20, causal=True),  # Sq > Sk: rows >= Sk see every key
    Case(h=4, h_kv=2, sq=33, sk=40, d=24, causal=True),  # GQA
    Case(h=4, h_kv=1, sq=33, sk=40, d=24),  # MQA
    Case(b=2, sq=33, sk=40, mask="keypad"),  # HF key padding (B, 1, 1, Sk), bool
    Case(b=2, sq=33, sk=40, mask="hf"),  # HF causal + padding (B, 1, Sq, Sk), float finfo.min
    Case(b=2, sq=33, sk=40, mask="bool"),  # (B, 1, Sq, Sk) random bool
    Case(h=4, h_kv=2, sq=33, sk=40, mask="float"),  # (1, H, Sq, Sk) additive, with GQA
    Case(sq=33, sk=40, mask="2d"),  # (Sq, Sk) bool
    Case(b=2, sq=33, sk=40, mask="dead-rows"),  # fully masked rows, bool and -inf
    # left padding under transformers' causal float mask: batch 1's first rows see no key, each
    # key at finfo.min, which swamps the scores; SDPA averages such a row uniformly
    Case(b=2, sq=40, sk=40, mask="hf"),
    # masks whose bounds let the kernels skip blocks (_mask_bounds): packed documents per row,
    # a sliding window, a span per head, keys padded past whole blocks
    Case(b=2, sq=70, sk=70, mask="packed"),
    Case(b=2, h=4, h_kv=2, sq=70, sk=70, mask="packed"),
    Case(sq=70, sk=70, mask="window"),
    Case(b=2, sq=50, sk=70, mask="per-head"),
    Case(b=2, sq=40, sk=90, mask="keypad-short"),
    Case(sq=30, sk=30, scale=0.3, causal=True),
    Case(sq=19, sk=21, d=8),  # head dim below the 16-wide dot tile
    Case(sq=20, sk=24, d=80),
    Case(h=1, sq=17, sk=17, d=160, causal=True),
    # the wide head dims (on CPU too), short sequences that are not multiples of the blocks
    Case(h=1, sq=13, sk=13, d=96, causal=True),
    Case(h=1, sq=7, sk=19, d=96),
    Case(h=1, sq=19, sk=19, d=192),
    Case(h=1, sq=5, sk=18, d=192, causal=True),
    Case(h=1, sq=11, sk=11, d=256, causal=True),
    Case(h=1, sq=20, sk=9, d=256),
    # a value head dim other than the query's, narrower and wider, with GQA and a mask
    Case(sq=37, sk=37, d=24, dv=16),
    Case(h=4, h_kv=2, sq=33, sk=40, d=48, dv=24, causal=True),
    Case(b=2, sq=33, sk=40, d=16, dv=40, mask="hf"),
    Case(h=1, sq=13, sk=19, d=192, dv=128, causal=True),  # DeepSeek-V2/V3's MLA head dims
]
if ON_GPU:
    CASES += [Case(b=2, h=3, sq=300, sk=300, d=d, causal=c)
              for d in (16, 32, 64, 96, 128, 192, 256) for c in (False, True)]
    CASES += [Case(b=2, h=4, sq=300, sk=300, d=192, dv=128, causal=True), Case(b=2, h=2, sq=300, sk=257, d=64,
                                                                                dv=128)]
    CASES += [Case(b=2, h=4, h_kv=2, sq=1000, sk=777, d=64, causal=True),
              Case(b=1, h=2, sq=513, sk=1025, d=128, mask="hf")]
EMPTY_CASES = [Case(sq=0, sk=5), Case(b=0), Case(sq=5, sk=0)]


def make_mask(case: Case, dtype: torch.dtype) -> torch.Tensor | None:
    b, sq, sk = case.b, case.sq, case.sk
    if case.mask in ("keypad", "keypad-short"):
        lengths = torch.tensor([sk, sk - 11 if case.mask == "keypad" else 17][:b])
        return (torch.arange(sk)[None, :] < lengths[:, None]).view(b, 1, 1, sk).to(DEVICE)
    if case.mask == "packed":  # documents packed into each row, cut differently per row (Sq == Sk)
        keep = torch.zeros(b, sq, sk, dtype=torch.bool)
        for row, cuts in enumerate(([0, 23, 41, sq], [0, 50, sq])[:b]):
            for start, end in zip(cuts, cuts[1:]):
                keep[row, start:end, start:end] = True
        return (keep & torch.ones(sq, sk, dtype=torch.bool).tril())[:, None].to(DEVICE)
    if case.mask == "window":  # causal sliding window of 9 keys, float at finfo.min (Mistral's)
        keep = torch.ones(sq, sk, dtype=torch.bool).tril() & ~torch.ones(sq, sk, dtype=torch.bool).tril(-9)
        return torch.zeros(1, 1, sq, sk, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min).to(DEVICE)
    if case.mask == "per-head":  # (B, H, Sq, Sk): head 0 the first 20 keys, head 1 keys 30 on
        keep = torch.rand(b, case.h, sq, sk) > 0.3
        keep[:, 0, :, 20:] = False
        keep[:, 1, :, :30] = False
        return keep.to(DEVICE)
    if case.mask == "hf":
        # transformers' 4-D float mask: 0 to attend, finfo.min elsewhere; causal + left padding
        keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)[None].repeat(b, 1, 1)
        keep[1:, :, :6] = False
        mask = torch.zeros(b, 1, sq, sk, dtype=dtype)
        return mask.masked_fill(~keep[:, None], torch.finfo(dtype).min).to(DEVICE)
    if case.mask == "bool":
        return (torch.rand(b, 1, sq, sk) > 0.3).to(DEVICE)
    if case.mask == "float":
        return torch.randn(1, case.h, sq, sk, dtype=dtype).to(DEVICE)
    if case.mask == "2d":
        return (torch.rand(sq, sk) > 0.3).to(DEVICE)
    if case.mask == "dead-rows":
        keep = torch.rand(b, 1, sq, sk) > 0.3
        keep[0, :, [0, 7, sq - 1]] = False
        if b > 1:
            keep[1, :, 3:9] = False
        return keep.to(DEVICE)
    return None


def make(case: Case, dtype: torch.dtype):
    h_kv = case.h if case.h_kv is None else case.h_kv
    q = torch.randn(case.b, case.h, case.sq, case.d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(case.b, h_kv, case.sk, case.d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(case.b, h_kv, case.sk, case.dv or case.d, device=DEVICE, dtype=dtype, requires_grad=True)
    return q, k, v, make_mask(case, dtype)


def kwargs_of(case: Case) -> dict:
    return {"is_causal": case.causal, "scale": case.scale, "enable_gqa": case.h_kv is not None}


def as_ref(t, dtype):
    if t is None:
        return None
    if t.dtype == torch.bool:
        return t
    return t.detach().to(dtype).requires_grad_(t.requires_grad)


def check_fwd_bwd(q, k, v, mask, kw, *, dropout_p=0.0, dropout_mask=None, seed=None, sinks=None, name=""):
    """Output and the three gradients (and the sinks' with `sinks`, a leaf (Hq,)) against float64,
    bounded by PyTorch's own error."""
    if seed is not None:
        torch.manual_seed(seed)
    extra = {} if sinks is None else {"sinks": sinks}
    out = trifuse.ops.attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, **kw, **extra)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[3])
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    lowp = [t.detach().clone().requires_grad_() for t in inputs]
    ref = attention_ref(*leaves[:3], as_ref(mask, torch.float64), dropout_p, dropout_mask=dropout_mask, **kw,
                        **({} if sinks is None else {"sinks": leaves[3]}))
    ref_lp = attention_ref(*lowp[:3], as_ref(mask, q.dtype), dropout_p, dropout_mask=dropout_mask, **kw,
                           **({} if sinks is None else {"sinks": lowp[3]}))
    assert_close(f"{name} out", out, ref, ref_lp)
    if out.numel() == 0:
        return
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    g64 = torch.autograd.grad(ref, leaves, dout.double())
    glp = torch.autograd.grad(ref_lp, lowp, dout)
    for gname, x, a, a64, alp in zip(("dq", "dk", "dv", "dsinks"), inputs, grads, g64, glp):
        assert a.dtype == x.dtype and a.shape == a64.shape
        assert_close(f"{name} {gname}", a, a64, alp)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, case):
    q, k, v, mask = make(case, dtype)
    check_fwd_bwd(q, k, v, mask, kwargs_of(case), name=case.id)


@pytest.mark.parametrize("case", [c for c in CASES if c.mask], ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masks_without_their_bounds_match_the_oracle(monkeypatch, dtype, case):
    """A GPU computes mask bounds only from 256 keys on (_BOUNDS_MIN_KEYS), the interpreter always:
    the masked cases again with the bounds off, the path every short masked sequence takes on a
    GPU (every key block visited, the mask alone hiding keys)."""
    monkeypatch.setattr(attn_mod, "_BOUNDS_MIN_KEYS", 1 << 30)
    q, k, v, mask = make(case, dtype)
    check_fwd_bwd(q, k, v, mask, kwargs_of(case), name=case.id + " without bounds")


@pytest.mark.parametrize("case", EMPTY_CASES, ids=lambda c: c.id)
def test_empty_sizes(case):
    """Zero queries, batch or keys: SDPA gives an empty output, or zeros when there are no keys."""
    q, k, v, _ = make(case, torch.float32)
    out = trifuse.ops.attention(q, k, v)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    assert all(g is None or not g.any() for g in grads)


def _padded_with_nans(pad_from: int, causal: bool):
    """(q, k, v, mask, kw) with batch 1's keys from `pad_from` on masked (a bool key padding)
    and holding NaN: a kernel that reads them spreads NaN (0 * NaN) into what it computes."""
    torch.manual_seed(0)
    q, k, v, _ = make(Case(b=2, h=2, sq=150, sk=160, d=16), torch.float32)
    with torch.no_grad():
        k[1, :, pad_from:] = float("nan")
        v[1, :, pad_from:] = float("nan")
    lengths = torch.tensor([160, pad_from])
    mask = (torch.arange(160)[None, :] < lengths[:, None]).view(2, 1, 1, 160).to(DEVICE)
    return q, k, v, mask, {"is_causal": causal}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mask_bounds_skip_the_key_blocks_no_row_sees(causal):
    """Keys that the mask hides from every row of a block are never read (_mask_bounds): NaNs
    planted in the padded keys' whole blocks (from 64, a multiple of every block size) stay out
    of the output and gradients, which equal the float64 oracle on the unpadded keys; the
    padded keys' dK and dV are 0. Causal with the mask is the kernels' own combination (the
    public op takes one or the other, as SDPA), called through their launchers."""
    q, k, v, mask, kw = _padded_with_nans(64, causal)
    if causal:
        scale = 16 ** -0.5
        out, lse = attn_mod.attention_fwd(q.detach(), k.detach(), v.detach(), mask, 0.0, True, scale, None)
        dout = torch.randn_like(out)
        dq, dk, dv, *_ = attn_mod.attention_bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, None,
                                                mask, 0.0, True, scale)
    else:
        out = trifuse.ops.attention(q, k, v, attn_mask=mask, **kw)
        dout = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert not dk[1, :, 64:].any() and not dv[1, :, 64:].any()
    for b, n in ((0, 160), (1, 64)):
        leaves = [t[b:b + 1, :, :n].detach().double().requires_grad_() for t in (k, v)]
        q64 = q[b:b + 1].detach().double().requires_grad_()
        parts = (q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        lowp = [t.detach().clone().requires_grad_() for t in parts]
        # causal is top-left aligned (Sq 150 against Sk 160), as on the padded keys
        ref = attention_ref(q64, *leaves, None, 0.0, **kw)
        ref_lp = attention_ref(*lowp, None, 0.0, **kw)
        assert_close(f"out {b}", out[b:b + 1], ref, ref_lp)
        g64 = torch.autograd.grad(ref, (q64, *leaves), dout[b:b + 1].double())
        glp = torch.autograd.grad(ref_lp, lowp, dout[b:b + 1])
        for name, got, a64, alp in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, glp):
            assert_close(f"{name} {b}", got[b:b + 1, :, :a64.shape[2]], a64, alp)


def test_negative_control_without_mask_bounds_the_padded_keys_are_read(monkeypatch):
    """The same call with the bounds off (as for short sequences on a GPU): every key block is
    visited and the planted NaNs reach the output, so the test above sees skipping."""
    monkeypatch.setattr(attn_mod, "_BOUNDS_MIN_KEYS", 1 << 30)
    q, k, v, mask, kw = _padded_with_nans(64, False)
    out = trifuse.ops.attention(q, k, v, attn_mask=mask, **kw)
    assert torch.isnan(out[1]).any() and torch.isfinite(out[0]).all()


@pytest.mark.parametrize("shape, sq, sk", [((2, 1, 13, 17), 13, 17), ((2, 3, 1, 17), 9, 17),
                                          ((13, 17), 13, 17), ((1, 2, 5, 7), 5, 7), ((3, 4, 6), 4, 6)])
@pytest.mark.parametrize("kind", ["bool", "float", "none visible"])
def test_mask_bounds_are_each_lines_first_and_last_visible_position(shape, sq, sk, kind):
    """_compute_mask_bounds (argmax over one byte an entry) against the spans written out: the
    first and one-past-last visible key of each row (every key for a row masked whole), and of
    each key the rows that see it (none: first past the end, last 0)."""
    torch.manual_seed(sq * sk)
    keep = torch.rand(shape) > 0.6 if kind != "none visible" else torch.zeros(shape, dtype=torch.bool)
    keep[..., 2] = False  # a key no row sees
    if shape[-2] > 1:
        keep[..., 1, :] = False  # a row that sees none
    mask = keep if kind != "float" else torch.zeros(shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    rows, _, cols, _ = attn_mod._compute_mask_bounds(mask.to(DEVICE), sq, sk)
    k4 = keep.reshape((1,) * (4 - keep.dim()) + keep.shape).expand(-1, -1, sq, sk)
    sees = k4 | ~k4.any(-1, keepdim=True)

    def spans(sees, n):
        idx = torch.arange(n)
        return torch.stack((torch.where(sees, idx, n).amin(-1), torch.where(sees, idx + 1, 0).amax(-1)), -2)

    assert torch.equal(rows.cpu().long(), spans(sees, sk))
    assert torch.equal(cols.cpu().long(), spans(sees.transpose(-1, -2), sq))


def test_mask_bounds_are_computed_once_per_mask_and_again_when_it_changes(monkeypatch):
    """A model's layers share one mask: its bounds are computed on its first call and reused
    (forward and backward) until the mask is written in place."""
    computed = []
    compute = attn_mod._compute_mask_bounds
    monkeypatch.setattr(attn_mod, "_compute_mask_bounds", lambda *a: computed.append(1) or compute(*a))
    q, k, v, mask = make(Case(b=2, sq=33, sk=40, mask="keypad-short"), torch.float32)
    for _ in range(3):  # three layers
        trifuse.ops.attention(q, k, v, attn_mask=mask).sum().backward()
    assert len(computed) == 1
    reference = trifuse.ops.attention(q, k, v, attn_mask=mask & (torch.arange(40, device=DEVICE) < 30))
    before = len(computed)
    mask[:, :, :, 30:] = False  # written in place: new bounds, and what they imply
    assert torch.equal(trifuse.ops.attention(q, k, v, attn_mask=mask), reference)
    assert len(computed) == before + 1


@pytest.mark.parametrize("mask_kind", ["bool", "packed"])
def test_masks_made_under_inference_mode(mask_kind):
    """Inference tensors keep no version counter, which the mask caches (bounds, packed check) key
    on: a mask made under torch.inference_mode (generation) is used without caching, with the
    same result."""
    case = Case(b=2 if mask_kind == "bool" else 1, sq=70, sk=70, mask=mask_kind)
    q, k, v, mask = make(case, torch.float32)
    want = trifuse.ops.attention(q, k, v, attn_mask=mask)
    with torch.inference_mode():
        got = trifuse.ops.attention(q, k, v, attn_mask=mask.clone())
    torch.testing.assert_close(got, want)


def test_fully_masked_rows_give_what_sdpa_gives():
    """SDPA (math backend) returns 0 for a row that sees no key, and zero gradients for it; the
    same for a bool mask and a float mask of -inf, and for a dropped-out forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, mask = make(Case(b=2, sq=20, sk=24, mask="dead-rows"), torch.float32)
    fmask = torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, float("-inf"))
    for m in (mask, fmask):
        out = trifuse.ops.attention(q, k, v, attn_mask=m)
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        dead = ~mask.any(-1)  # (B, 1, Sq)
        dead_rows = dead.expand(out.shape[:3])
        assert ref[dead_rows].eq(0).all() and out[dead_rows].eq(0).all()
        assert_close("dead rows out", out, ref.double(), None)
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
        dq_ref, dk_ref, dv_ref = torch.autograd.grad(ref.sum(), (q, k, v))
        assert dq[dead_rows].eq(0).all() and dq_ref[dead_rows].eq(0).all()
        for a, r in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
            assert_close("dead rows grad", a, r.double(), None)
    out = trifuse.ops.attention(q, k, v, attn_mask=mask, dropout_p=0.5)
    assert torch.isfinite(out).all() and out[dead.expand(out.shape[:3])].eq(0).all()


def test_rows_masked_whole_by_finfo_min_average_uniformly_like_sdpa():
    """transformers' float masks use finfo(dtype).min, not -inf: a query row masked whole (left
    padding) is then a uniform average in SDPA's math backend, and in ours (the forward; the
    gradients of such rows carry the fp32 log-sum-exp cancellation SDPA's fused backends share)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, _ = make(Case(b=2, sq=20, sk=24), torch.float32)
    mask = torch.zeros(2, 1, 20, 24, device=DEVICE)
    mask[1, :, :5] = torch.finfo(torch.float32).min  # rows 0-4 of batch 1 see nothing
    mask[0, :, :, 20:] = torch.finfo(torch.float32).min  # key padding for batch 0
    with torch.no_grad():
        out = trifuse.ops.attention(q, k, v, attn_mask=mask)
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close("finfo.min rows", out, ref.double(), None)
    torch.testing.assert_close(out[1, :, :5], v[1].mean(1, keepdim=True).expand(2, 5, 16).detach())


@pytest.mark.parametrize("where", ["mask", "q", "k", "v", "q-softcap", "mask-softcap"])
def test_a_nan_in_an_input_reaches_the_output_as_unfused(where):
    """A NaN in a float mask's entry, or in q, k or v, makes NaN of what it makes NaN in the
    float64 reference (SDPA's maths), with or without a soft cap; the other rows stay as they were.
    The mask's finfo.min clamp and the cap's exponent clamp once turned such a NaN into a masked
    key or a capped score: a finite answer for bad input."""
    q, k, v, _ = make(Case(b=1, h=2, sq=6, sk=7), torch.float32)
    q, k, v = (t.detach().clone() for t in (q, k, v))
    mask = torch.zeros(1, 1, 6, 7, device=DEVICE)
    {"mask": mask, "q": q, "k": k, "v": v}[where.split("-")[0]][0, 0, 2, 3] = float("nan")
    softcap = 5.0 if where.endswith("softcap") else None
    with torch.no_grad():
        out = trifuse.ops.attention(q, k, v, attn_mask=mask, softcap=softcap)
        ref = attention_ref(q.double(), k.double(), v.double(), mask.double(), softcap=softcap)
    assert ref.isnan().any() and torch.equal(out.isnan(), ref.isnan()), where
    keep = ~ref.isnan()
    assert_close("rows without NaN", out[keep], ref[keep], None)


# ---------------------------------------------------------------------------------------------
# Strided inputs: views of a fused QKV projection, (B, S, H, D) transposes, expanded tensors.
# ---------------------------------------------------------------------------------------------


def test_fused_qkv_views_and_transposes():
    b, s, h, d = 2, 29, 3, 16
    x = torch.randn(b, s, 3 * h * d, device=DEVICE, requires_grad=True)

    def split(t):
        q, k, v = t.view(b, s, 3, h, d).unbind(2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D), strided

    q, k, v = split(x)
    assert not q.is_contiguous() and q.stride(-1) == 1
    out = trifuse.ops.attention(q, k, v, is_causal=True)
    x64 = x.detach().double().requires_grad_()
    ref = attention_ref(*split(x64), is_causal=True)
    x32 = x.detach().clone().requires_grad_()
    ref_lp = attention_ref(*split(x32), is_causal=True)
    assert_close("fused qkv out", out, ref, ref_lp)
    dout = torch.randn(b, s, h, d, device=DEVICE).transpose(1, 2)  # dO strided too
    (gx,) = torch.autograd.grad(out, x, dout)
    assert_close("fused qkv dx", gx, torch.autograd.grad(ref, x64, dout.double())[0],
                 torch.autograd.grad(ref_lp, x32, dout)[0])


def test_bshd_transposes_keep_their_layout():
    """(B, S, H, D) tensors transposed to (B, H, S, D): the output and grads come back in the same
    layout, so transposing back to (B, S, H * D) is free."""
    q, k, v = (torch.randn(2, 23, 3, 16, device=DEVICE).transpose(1, 2).requires_grad_() for _ in range(3))
    out = trifuse.ops.attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()
    check_fwd_bwd(q, k, v, None, {}, name="bshd")
    dq = torch.autograd.grad(trifuse.ops.attention(q, k, v).sum(), q)[0]
    assert dq.transpose(1, 2).is_contiguous()


def test_value_head_dim_other_than_the_query_keeps_the_layout_and_compiles():
    """v with its own head dim (DeepSeek's MLA): the output takes it, in q's (B, S, H, *) layout when
    q is that transpose; the registered op's fake output agrees under compile; gradcheck."""
    q, k = (torch.randn(2, 23, 3, 24, device=DEVICE).transpose(1, 2).requires_grad_() for _ in range(2))
    v = torch.randn(2, 23, 3, 8, device=DEVICE).transpose(1, 2).requires_grad_()
    out = trifuse.ops.attention(q, k, v, is_causal=True)
    assert out.shape == (2, 3, 23, 8) and out.transpose(1, 2).is_contiguous()
    check_fwd_bwd(q, k, v, None, {"is_causal": True}, name="bshd dv")
    compiled = torch.compile(lambda *a: trifuse.ops.attention(*a, is_causal=True), fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), out)
    torch.library.opcheck(torch.ops.trifuse.attention.default, (q, k, v, None, 0.0, True, None, False))

    def leaf(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.float64, requires_grad=True)

    args = (leaf(1, 2, 5, 4), leaf(1, 1, 6, 4), leaf(1, 1, 6, 3))
    assert torch.autograd.gradcheck(lambda *a: trifuse.ops.attention(*a, is_causal=True, enable_gqa=True), args)


def test_other_strides():
    """Non-unit head-dim stride, stride-0 (expanded) batch and heads, a sliced sequence."""
    q = torch.randn(2, 2, 16, 30, device=DEVICE).transpose(-1, -2).requires_grad_()  # stride_d = 30
    k = torch.randn(1, 1, 40, 16, device=DEVICE).expand(2, 2, 40, 16)[:, :, 5:35].detach().requires_grad_()
    v = torch.randn(2, 2, 30, 16, device=DEVICE, requires_grad=True)
    assert q.stride(-1) != 1 and k.stride(0) == 0
    check_fwd_bwd(q, k, v, None, {}, name="strided")


# ---------------------------------------------------------------------------------------------
# Dropout: the kernel's mask is read back through the kernel itself (q = k = 0 makes P uniform,
# v = I makes O = keep / ((1 - p) Sk)), then the oracle applies that mask.
# ---------------------------------------------------------------------------------------------


def kernel_keep_mask(b, h, sq, sk, p, seed):
    torch.manual_seed(seed)
    q = torch.zeros(b, h, sq, sk, device=DEVICE)
    k = torch.zeros(b, h, sk, sk, device=DEVICE)
    v = torch.eye(sk, device=DEVICE).expand(b, h, sk, sk)
    with torch.no_grad():
        o = trifuse.ops.attention(q, k, v, dropout_p=p)
    return o * (sk * (1.0 - p)) > 0.5


DROPOUT_CASES = [Case(h=4, h_kv=2, sq=33, sk=40, causal=True), Case(b=2, sq=20, sk=24, mask="dead-rows"),
                 Case(sq=40, sk=17, mask="float"), Case(sq=35, sk=26, d=24, dv=40, causal=True),
                 Case(b=2, sq=70, sk=70, mask="packed"),  # blocks skipped: the draws stay put
                 Case(b=2, sq=40, sk=40, d=24, dv=8, mask="hf")]  # rows at finfo.min


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_matches_oracle_with_the_kernels_mask(dtype, case):
    p = 0.3
    keep = kernel_keep_mask(case.b, case.h, case.sq, case.sk, p, seed=123)
    q, k, v, mask = make(case, dtype)
    check_fwd_bwd(q, k, v, mask, kwargs_of(case), dropout_p=p, dropout_mask=keep, seed=123, name="dropout")


@pytest.mark.parametrize("d, dv", [(24, 8), (8, 8), (8, 24)], ids=["d24v8", "d8v8", "d8v24"])
def test_heads_narrower_than_the_dot_tile_reach_the_kernels_padded(monkeypatch, d, dv):
    """A head dim below 16 is padded with zero columns before the kernels (attention.py,
    _MIN_HEAD_DIM): on the H200 the forward of a value head of 8 beside a query head of 24 read V
    wrong without it. The kernels see 16 columns or more, and the result, forward and backward, is
    the narrow heads' own."""
    launched = []
    real = attn_mod._tuned_launch

    def spy(kind, key, grid_fn, args, constexprs):
        launched.append((kind, constexprs["HEAD_DIM"], constexprs["HEAD_DIM_V"]))
        return real(kind, key, grid_fn, args, constexprs)

    monkeypatch.setattr(attn_mod, "_tuned_launch", spy)
    monkeypatch.setattr(attn_mod, "_FWD_PLANS", {})
    monkeypatch.setattr(attn_mod, "_BWD_PLANS", {})
    case = Case(b=2, sq=40, sk=33, d=d, dv=dv, mask="hf")
    q, k, v, mask = make(case, torch.float32)
    check_fwd_bwd(q, k, v, mask, kwargs_of(case), dropout_p=0.25,
                  dropout_mask=kernel_keep_mask(case.b, case.h, case.sq, case.sk, 0.25, seed=5), seed=5,
                  name="narrow heads")
    assert {kind for kind, _, _ in launched} == {"fwd", "dkdv", "dq"}
    assert all(head >= 16 and head_v >= 16 for _, head, head_v in launched), launched


def test_dropout_keeps_the_right_fraction_and_is_repeatable():
    p = 0.25
    keep = kernel_keep_mask(2, 3, 40, 48, p, seed=7)
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(keep, kernel_keep_mask(2, 3, 40, 48, p, seed=7))
    assert not torch.equal(keep, kernel_keep_mask(2, 3, 40, 48, p, seed=8))
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0], keep[1])  # per (b, h) streams


def test_dropout_is_unbiased():
    """The mean of the output over many independent draws converges to the no-dropout output:
    every (b, h) has its own random stream, so 256 heads of the same q, k, v are 512 draws."""
    n, s, d, p = 256, 16, 16, 0.4
    q, k, v = (torch.randn(1, 1, s, d, device=DEVICE).expand(1, n, s, d) for _ in range(3))
    with torch.no_grad():
        drops = trifuse.ops.attention(q, k, v, dropout_p=p)[0]
        clean = trifuse.ops.attention(q[:, :1], k[:, :1], v[:, :1])[0, 0]
    stderr = drops.std(0) / math.sqrt(n)
    z = ((drops.mean(0) - clean) / stderr).abs().max().item()
    assert z < 5.0, f"mean over {n} draws is {z:.1f} standard errors from the no-dropout output"
    # negative control: forgetting the 1 / (1 - p) rescaling is caught by the same statistic
    z_biased = ((drops.mean(0) * (1 - p) - clean) / stderr).abs().max().item()
    assert z_biased > 5.0


def test_dropout_one_gives_zeros():
    q, k, v, _ = make(Case(sq=9, sk=11), torch.float32)
    out = trifuse.ops.attention(q, k, v, dropout_p=1.0)
    assert out.eq(0).all()
    assert all(g.eq(0).all() for g in torch.autograd.grad(out.sum(), (q, k, v)))


# ---------------------------------------------------------------------------------------------
# gradcheck, determinism, the two dispatch paths, compile, opcheck
# ---------------------------------------------------------------------------------------------


def test_gradcheck_float64():
    def leaf(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.float64, requires_grad=True)

    q, k, v = leaf(1, 2, 5, 4), leaf(1, 1, 6, 4), leaf(1, 1, 6, 4)
    assert torch.autograd.gradcheck(
        lambda *a: trifuse.ops.attention(*a, is_causal=True, enable_gqa=True), (q, k, v))
    q, k, v = leaf(2, 1, 5, 3), leaf(2, 1, 7, 3), leaf(2, 1, 7, 3)
    keep = torch.rand(2, 1, 5, 7, device=DEVICE) > 0.3
    keep[0, :, 2] = False

    def dropped(*a):
        torch.manual_seed(3)  # the same mask on every call
        return trifuse.ops.attention(*a, attn_mask=keep, dropout_p=0.3, scale=0.7)

    assert torch.autograd.gradcheck(dropped, (q, k, v), fast_mode=True)


def test_backward_is_deterministic():
    """No atomics: every output is written by one program, GQA's group sums in a fixed order."""
    q, k, v, _ = make(Case(b=2, h=4, h_kv=1, sq=50, sk=45, d=32, causal=True), torch.float32)
    results = []
    for _ in range(2):
        torch.manual_seed(5)
        out = trifuse.ops.attention(q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_eager_path_and_registered_op_are_bitwise_equal(dropout_p):
    case = Case(h=4, h_kv=2, sq=33, sk=40, mask="float")
    q, k, v, mask = make(case, torch.float32)
    torch.manual_seed(11)
    eager = trifuse.ops.attention(q, k, v, mask, dropout_p, enable_gqa=True)
    torch.manual_seed(11)
    op = torch.ops.trifuse.attention(q, k, v, mask, dropout_p, False, None, True)[0]
    assert torch.equal(eager, op)
    dout = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(eager, (q, k, v), dout), torch.autograd.grad(op, (q, k, v), dout)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case,dropout_p", [(Case(sq=20, sk=24, causal=True), 0.0),
                                            (Case(b=2, sq=20, sk=24, mask="keypad", h=4, h_kv=2), 0.2)],
                         ids=["causal", "mask-gqa-dropout"])
def test_compiles_fullgraph_without_graph_breaks(case, dropout_p):
    q, k, v, mask = make(case, torch.float32)
    kw = kwargs_of(case)

    def fn(q, k, v, mask):
        return trifuse.ops.attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, **kw)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.manual_seed(2)
    out = compiled(q, k, v, mask)
    torch.manual_seed(2)
    ref = fn(q, k, v, mask)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_opcheck():
    q, k, v, mask = make(Case(h=4, h_kv=2, sq=9, sk=12, mask="float"), torch.float32)
    args = (q, k, v, mask, 0.0, False, 0.5, True)
    torch.library.opcheck(torch.ops.trifuse.attention.default, args)
    torch.library.opcheck(torch.ops.trifuse.attention.default, (q, k, v, None, 0.0, True, None, True))
    q, k, v = q.detach(), k.detach(), v.detach()
    o, lse, seed = torch.ops.trifuse.attention(q, k, v, mask, 0.0, False, 0.5, True)
    for mask_grad in (False, True):
        bwd_args = (torch.randn_like(o), q, k, v, o, lse, seed, mask, 0.0, False, 0.5, True, mask_grad)
        torch.library.opcheck(torch.ops.trifuse.attention_backward.default, bwd_args)
    # the autograd registration with a mask that requires grad
    torch.library.opcheck(torch.ops.trifuse.attention.default, (q, k, v, mask.requires_grad_(), 0.0, False, 0.5, True))


@settings(max_examples=10, deadline=None)
@given(sq=st.integers(1, 48), sk=st.integers(1, 48), d=st.sampled_from([8, 16, 24, 40]),
       causal=st.booleans(), group=st.sampled_from([1, 2]))
def test_hypothesis_shapes(sq, sk, d, causal, group):
    torch.manual_seed(sq * 1000 + sk)
    case = Case(h=2, h_kv=2 // group if group > 1 else None, sq=sq, sk=sk, d=d, causal=causal)
    q, k, v, mask = make(case, torch.float32)
    check_fwd_bwd(q, k, v, mask, kwargs_of(case), name=case.id)


def test_reference_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: same maths, same API."""
    monkeypatch.setattr(attn_mod, "use_triton", lambda t: False)
    for case in (Case(h=4, h_kv=2, sq=20, sk=24, causal=True, dv=8), Case(b=2, sq=20, sk=24, mask="dead-rows"),
                 Case(b=2, sq=33, sk=40, mask="hf"), Case(b=2, sq=30, sk=30, mask="hf")):
        check_fwd_bwd(*make(case, torch.float32), kwargs_of(case), name="torch path")
    case = Case(h=4, h_kv=2, sq=20, sk=24, mask="float")
    keep = kernel_keep_mask(case.b, case.h, case.sq, case.sk, 0.3, seed=9)
    check_fwd_bwd(*make(case, torch.float32), kwargs_of(case), dropout_p=0.3, dropout_mask=keep, seed=9,
                  name="torch path dropout")


# ---------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations must fail the same tolerance.
# ---------------------------------------------------------------------------------------------


def oracle(case: Case, dtype: torch.dtype, **kw):
    q, k, v, mask = make(case, dtype)
    kw = {**kwargs_of(case), **kw}
    ref64 = attention_ref(*(t.detach().double() for t in (q, k, v)), as_ref(mask, torch.float64), **kw)
    ref_lp = attention_ref(q.detach(), k.detach(), v.detach(), mask, **kw)
    return q.detach(), k.detach(), v.detach(), ref64, ref_lp


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sq,sk", [(30, 30), (20, 40)], ids=["square", "Sq<Sk"])
def test_negative_control_misaligned_causal_mask_fails(dtype, sq, sk):
    """A diagonal off by one (square) or bottom-right aligned (Sq < Sk) must not pass."""
    q, k, v, ref64, ref_lp = oracle(Case(sq=sq, sk=sk, causal=True), dtype)
    diagonal = 1 if sq == sk else sk - sq
    wrong_mask = torch.ones(sq, sk, dtype=torch.bool, device=DEVICE).tril(diagonal)
    wrong = attention_ref(q, k, v, wrong_mask)
    ok, msg = check_close("misaligned causal", wrong, ref64, ref_lp)
    assert not ok, msg
    ok, msg = check_close("kernel", trifuse.ops.attention(q, k, v, is_causal=True), ref64, ref_lp)
    assert ok, msg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_missing_scale_fails(dtype):
    q, k, v, ref64, ref_lp = oracle(Case(sq=30, sk=30, d=32), dtype)
    ok, msg = check_close("scale 1", trifuse.ops.attention(q, k, v, scale=1.0), ref64, ref_lp)
    assert not ok, msg


def test_negative_control_wrong_gqa_head_mapping_fails():
    """Interleaved kv heads (h % Hkv instead of h // group) must not pass."""
    q, k, v, ref64, ref_lp = oracle(Case(h=4, h_kv=2, sq=20, sk=20, causal=True), torch.float32)
    wrong = attention_ref(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), is_causal=True)
    ok, msg = check_close("gqa h % Hkv", wrong, ref64, ref_lp)
    assert not ok, msg


# ---------------------------------------------------------------------------------------------
# Gradient of a float attn_mask (T5's learned position bias): dMask = dS, summed over every dim
# the mask broadcasts along, in the mask's dtype and shape.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MaskGradCase:
    case: Case
    layout: str  # how the mask is built from its leaf: see mask_leaf_and_view
    magnitude: float = 1.0

    @property
    def id(self) -> str:
        return f"{self.case.id}-{self.layout}" + (f"-x{self.magnitude:g}" if self.magnitude != 1.0 else "")


def mask_leaf_and_view(mc: MaskGradCase, dtype: torch.dtype):
    """(leaf, view): the tensor that requires grad and the function giving the attn_mask from it."""
    c = mc.case
    b, h, sq, sk = c.b, c.h, c.sq, c.sk
    shapes = {"sq-sk": (sq, sk), "1-h": (1, h, sq, sk), "b-1": (b, 1, sq, sk), "b-h": (b, h, sq, sk),
              "b-1-1-sk": (b, 1, 1, sk), "expand": (1, h, sq, sk), "transpose": (b, h, sk, sq)}
    views = {"expand": lambda t: t.expand(b, h, sq, sk), "transpose": lambda t: t.transpose(-1, -2)}
    leaf = torch.randn(shapes[mc.layout], dtype=torch.float64) * mc.magnitude
    if mc.magnitude > 1.0:
        leaf[..., 1::7] = -1e4  # large negative entries, as padding masks have (finite in fp16)
    leaf = leaf.to(device=DEVICE, dtype=dtype).requires_grad_()
    return leaf, views.get(mc.layout, lambda t: t)


def check_mask_grad(q, k, v, leaf, view, kw, *, dropout_p=0.0, dropout_mask=None, seed=None, name=""):
    """dMask and dq, dk, dv (the mask requiring grad) against float64, bounded by PyTorch's own error."""
    if seed is not None:
        torch.manual_seed(seed)
    out = trifuse.ops.attention(q, k, v, attn_mask=view(leaf), dropout_p=dropout_p, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, leaf), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, leaf)]
    lowp = [t.detach().clone().requires_grad_() for t in (q, k, v, leaf)]
    ref = attention_ref(*leaves[:3], view(leaves[3]), dropout_p, dropout_mask=dropout_mask, **kw)
    ref_lp = attention_ref(*lowp[:3], view(lowp[3]), dropout_p, dropout_mask=dropout_mask, **kw)
    assert_close(f"{name} out", out, ref, ref_lp)
    g64 = torch.autograd.grad(ref, leaves, dout.double())
    glp = torch.autograd.grad(ref_lp, lowp, dout)
    for gname, a, a64, alp in zip(("dq", "dk", "dv", "dmask"), grads, g64, glp):
        assert a.dtype == a64.dtype == torch.float64 or a.dtype == q.dtype
        assert a.shape == a64.shape, f"{name} {gname}: shape {tuple(a.shape)} != {tuple(a64.shape)}"
        assert_close(f"{name} {gname}", a, a64, alp)


MASK_GRAD_CASES = [
    MaskGradCase(Case(b=2, h=3, sq=37, sk=45, d=24), "sq-sk"),
    MaskGradCase(Case(b=3, h=2, sq=37, sk=45), "1-h"),  # T5's position bias, summed over the batch
    MaskGradCase(Case(b=2, h=3, sq=33, sk=20), "b-1"),
    MaskGradCase(Case(b=2, h=2, sq=20, sk=33), "b-h"),
    MaskGradCase(Case(b=2, h=2, sq=1, sk=33), "b-h"),  # one query row
    MaskGradCase(Case(b=2, h=3, sq=37, sk=45), "b-1-1-sk"),  # summed over heads and query rows
    MaskGradCase(Case(b=2, h=2, sq=30, sk=41), "expand"),  # stride-0 dims of full size
    MaskGradCase(Case(b=2, h=2, sq=30, sk=41), "transpose"),  # non-contiguous
    MaskGradCase(Case(h=4, h_kv=2, sq=33, sk=40, d=24), "1-h"),  # GQA: a mask per query head
    MaskGradCase(Case(b=2, h=4, h_kv=1, sq=17, sk=29), "b-h"),  # MQA
    MaskGradCase(Case(sq=20, sk=24, d=80), "sq-sk"),  # head dim not a power of two
    MaskGradCase(Case(b=2, h=2, sq=26, sk=35), "1-h", magnitude=30.0),  # large-magnitude values
]


@pytest.mark.parametrize("mc", MASK_GRAD_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_grad_matches_float64_oracle(dtype, mc):
    q, k, v, _ = make(mc.case, dtype)
    leaf, view = mask_leaf_and_view(mc, dtype)
    check_mask_grad(q, k, v, leaf, view, kwargs_of(mc.case), name=mc.id)


MASK_GRAD_DROPOUT_CASES = [MaskGradCase(Case(sq=40, sk=17), "1-h"),
                           MaskGradCase(Case(b=2, h=4, h_kv=2, sq=33, sk=40), "b-1")]


@pytest.mark.parametrize("mc", MASK_GRAD_DROPOUT_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_grad_with_dropout_matches_oracle_with_the_kernels_mask(dtype, mc):
    p, c = 0.3, mc.case
    keep = kernel_keep_mask(c.b, c.h, c.sq, c.sk, p, seed=321)
    q, k, v, _ = make(c, dtype)
    leaf, view = mask_leaf_and_view(mc, dtype)
    check_mask_grad(q, k, v, leaf, view, kwargs_of(c), dropout_p=p, dropout_mask=keep, seed=321, name=mc.id)


@pytest.mark.parametrize("sq,sk", [(50, 20), (20, 50), (33, 33)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_grad_with_causal_in_the_launchers(dtype, sq, sk):
    """The API takes a mask or is_causal, as SDPA; the kernels take both. dS of the key blocks the
    dQ kernel skips past the diagonal must come out as zeros."""
    c = Case(b=2, h=2, sq=sq, sk=sk)
    q, k, v, _ = make(c, dtype)
    q, k, v = q.detach(), k.detach(), v.detach()
    mask = torch.randn(1, c.h, sq, sk, device=DEVICE, dtype=dtype)
    o, lse = attn_mod.attention_fwd(q, k, v, mask, 0.0, True, 0.25, None)
    dout = torch.randn_like(o)
    dq, dk, dv, dmask, _ = attn_mod.attention_bwd(dout, q, k, v, o, lse, None, mask, 0.0, True, 0.25, True)
    leaves = [t.double().requires_grad_() for t in (q, k, v, mask)]
    lowp = [t.clone().requires_grad_() for t in (q, k, v, mask)]
    ref = attention_ref(*leaves[:3], leaves[3], scale=0.25, is_causal=True)
    ref_lp = attention_ref(*lowp[:3], lowp[3], scale=0.25, is_causal=True)
    assert_close("causal out", o, ref, ref_lp)
    g64 = torch.autograd.grad(ref, leaves, dout.double())
    glp = torch.autograd.grad(ref_lp, lowp, dout)
    for gname, a, a64, alp in zip(("dq", "dk", "dv", "dmask"), (dq, dk, dv, dmask), g64, glp):
        assert_close(f"causal {gname}", a, a64, alp)
    above = ~torch.ones(sq, sk, dtype=torch.bool, device=DEVICE).tril()
    assert not dmask[..., above].any()


def test_mask_grad_gradcheck_float64():
    def leaf(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.float64, requires_grad=True)

    q, k, v, bias = leaf(2, 2, 3, 4), leaf(2, 1, 5, 4), leaf(2, 1, 5, 4), leaf(1, 2, 3, 5)
    # Fast mode (a random projection of the Jacobian, which a wrong element would still show):
    # full mode takes 10-30 s in the interpreter; the oracle tests check dMask element by element.
    assert torch.autograd.gradcheck(lambda *a: trifuse.ops.attention(*a[:3], attn_mask=a[3], enable_gqa=True),
                                    (q, k, v, bias), fast_mode=True)
    bias = leaf(3, 5)

    def dropped(*a):
        torch.manual_seed(3)  # the same mask on every call
        return trifuse.ops.attention(*a[:3], attn_mask=a[3], dropout_p=0.3, scale=0.7, enable_gqa=True)

    assert torch.autograd.gradcheck(dropped, (q, k, v, bias), fast_mode=True)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_mask_grad_eager_path_and_registered_op_are_bitwise_equal_and_repeatable(dropout_p):
    case = Case(b=2, h=4, h_kv=2, sq=33, sk=40)
    q, k, v, _ = make(case, torch.float32)
    bias = torch.randn(1, 4, 33, 40, device=DEVICE, requires_grad=True)
    dout = torch.randn(2, 4, 33, 16, device=DEVICE)
    results = []
    for run in (lambda: trifuse.ops.attention(q, k, v, bias, dropout_p, enable_gqa=True),
                lambda: trifuse.ops.attention(q, k, v, bias, dropout_p, enable_gqa=True),
                lambda: torch.ops.trifuse.attention(q, k, v, bias, dropout_p, False, None, True)[0]):
        torch.manual_seed(11)
        out = run()
        results.append((out, *torch.autograd.grad(out, (q, k, v, bias), dout)))
    for got in results[1:]:
        for a, b in zip(results[0], got):
            assert torch.equal(a, b)


def test_mask_grad_compiles_fullgraph():
    q, k, v, _ = make(Case(b=2, sq=20, sk=24), torch.float32)
    bias = torch.randn(1, 2, 20, 24, device=DEVICE, requires_grad=True)

    def fn(q, k, v, bias):
        return trifuse.ops.attention(q, k, v, attn_mask=bias)

    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, bias)
    ref = fn(q, k, v, bias)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v, bias)), torch.autograd.grad(ref.sum(), (q, k, v, bias))):
        torch.testing.assert_close(a, b)


def test_mask_grad_only_when_asked(monkeypatch):
    """A float mask that does not require grad costs no dS buffer, on either path."""
    def no_mask_grad(*_):
        raise AssertionError("the mask gradient was computed for a mask that does not require grad")

    monkeypatch.setattr(attn_mod, "_reduce_mask_grad", no_mask_grad)
    q, k, v, _ = make(Case(b=2, sq=20, sk=24), torch.float32)
    bias = torch.randn(1, 2, 20, 24, device=DEVICE)
    for out in (trifuse.ops.attention(q, k, v, attn_mask=bias),
                torch.ops.trifuse.attention(q, k, v, bias, 0.0, False, None, False)[0]):
        assert len(torch.autograd.grad(out.sum(), (q, k, v))) == 3
    with torch.no_grad():
        out = trifuse.ops.attention(q, k, v, attn_mask=bias.requires_grad_())
    assert not out.requires_grad


def test_mask_grad_reference_path_without_interpreter_matches(monkeypatch):
    monkeypatch.setattr(attn_mod, "use_triton", lambda t: False)
    for mc in (MaskGradCase(Case(b=3, h=2, sq=20, sk=24), "1-h"),
               MaskGradCase(Case(b=2, h=4, h_kv=2, sq=20, sk=24), "transpose")):
        q, k, v, _ = make(mc.case, torch.float32)
        check_mask_grad(q, k, v, *mask_leaf_and_view(mc, torch.float32), kwargs_of(mc.case), name="torch path")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_mask_grad_without_the_broadcast_sum_or_with_the_scale_fails(dtype):
    """dMask of a (1, H, Sq, Sk) mask taken from the first batch only (no sum over the batch), or
    multiplied by the scale like dQ, must not pass; the kernel's must."""
    c = Case(b=3, h=2, sq=30, sk=37, d=32)
    q, k, v, _ = make(c, dtype)
    bias = torch.randn(1, 2, 30, 37, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn(3, 2, 30, 32, device=DEVICE, dtype=dtype)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    g64 = torch.autograd.grad(attention_ref(*leaves[:3], leaves[3]), leaves[3], dout.double())[0]
    lowp = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    glp = torch.autograd.grad(attention_ref(*lowp[:3], lowp[3]), lowp[3], dout)[0]
    full = bias.detach().expand(3, 2, 30, 37).clone().requires_grad_()  # a mask per batch: dS itself
    ds = torch.autograd.grad(trifuse.ops.attention(q, k, v, attn_mask=full), full, dout)[0]
    for wrong_name, wrong in (("first batch only", ds[:1]), ("times the scale", ds.sum(0, keepdim=True) / 32**0.5)):
        ok, msg = check_close(wrong_name, wrong, g64, glp)
        assert not ok, msg
    got = torch.autograd.grad(trifuse.ops.attention(q, k, v, attn_mask=bias), bias, dout)[0]
    ok, msg = check_close("kernel", got, g64, glp)
    assert ok, msg


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the op and the argument, in eager and under compile.
# ---------------------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_(grad)


def _expanded(*shape):
    return _t(1, *shape[1:]).expand(*shape)


BAD_INPUTS = {
    "rank": ({"q": _t(2, 5, 16)}, ValueError, "attention: query must be 4-D"),
    "int-dtype": ({"q": torch.ones(1, 2, 5, 16, dtype=torch.int64)}, TypeError, "query must be float"),
    "mixed-dtype": ({"k": _t(1, 2, 6, 16, dtype=torch.float16)}, TypeError, "share one dtype"),
    "head-dim": ({"k": _t(1, 2, 6, 8)}, ValueError, "query and key must have the same head_dim"),
    "value-head-dim-too-big": ({"v": _t(1, 2, 6, 300)}, ValueError, "value's head_dim must be between"),
    "head-dim-too-big": ({"q": _t(1, 2, 5, 300), "k": _t(1, 2, 6, 300), "v": _t(1, 2, 6, 300)}, ValueError,
                         "head_dim must be between"),
    "gqa-not-dividing": ({"q": _t(1, 3, 5, 16), "enable_gqa": True}, ValueError, "must divide"),
    "heads-without-gqa": ({"q": _t(1, 4, 5, 16)}, ValueError, "enable_gqa=True"),
    "batch-heads": ({"q": _expanded(32768, 2, 5, 16), "k": _expanded(32768, 2, 6, 16),
                     "v": _expanded(32768, 2, 6, 16)}, ValueError, "batch \\* heads must be at most"),
    "kv-seq": ({"v": _t(1, 2, 7, 16)}, ValueError, "key and value must have the same"),
    "batch": ({"k": _t(2, 2, 6, 16), "v": _t(2, 2, 6, 16)}, ValueError, "same batch size"),
    "mask-shape": ({"attn_mask": torch.ones(1, 1, 5, 7, dtype=torch.bool)}, ValueError, "does not broadcast"),
    "mask-dtype": ({"attn_mask": torch.ones(5, 6, dtype=torch.int32)}, TypeError, "attn_mask must be bool"),
    "mask-and-causal": ({"attn_mask": torch.ones(5, 6, dtype=torch.bool), "is_causal": True}, ValueError,
                        "not both"),
    "dropout": ({"dropout_p": 1.5}, ValueError, "dropout_p must be a probability"),
    "softcap-negative": ({"softcap": -1.0}, ValueError, "softcap must be a finite number > 0"),
    "softcap-inf": ({"softcap": float("inf")}, ValueError, "softcap must be a finite number > 0"),
    "softcap-type": ({"softcap": "50"}, TypeError, "softcap must be a number or None"),
    "sinks-length": ({"sinks": _t(3)}, ValueError, "attention: sinks must be 1-D with one logit per query head \\(2\\)"),
    "sinks-rank": ({"sinks": _t(1, 2)}, ValueError, "sinks must be 1-D"),
    "sinks-dtype": ({"sinks": torch.zeros(2, dtype=torch.int64)}, TypeError, "attention: sinks must be float16"),
    "sinks-type": ({"sinks": [0.0, 0.0]}, TypeError, "attention: sinks must be a torch.Tensor"),
    "not-tensor": ({"k": [1.0]}, TypeError, "key must be a torch.Tensor"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_clear_error(name):
    kwargs, exc, match = BAD_INPUTS[name]
    args = {"q": _t(1, 2, 5, 16), "k": _t(1, 2, 6, 16), "v": _t(1, 2, 6, 16)}
    args.update({key: val.to(DEVICE) if isinstance(val, torch.Tensor) else val
                 for key, val in kwargs.items()})
    with pytest.raises(exc, match=match):
        trifuse.ops.attention(**args)


def test_bad_input_raises_under_compile_and_on_the_registered_op():
    fn = torch.compile(lambda q, k, v, m: trifuse.ops.attention(q, k, v, attn_mask=m), fullgraph=True,
                       backend="aot_eager")
    q, k, v = _t(1, 2, 5, 16), _t(1, 2, 6, 16), _t(1, 2, 6, 16)
    with pytest.raises(Exception, match="does not broadcast"):
        fn(q, k, v, torch.ones(1, 1, 5, 7, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="must divide"):
        torch.ops.trifuse.attention(_t(1, 3, 5, 16), k, v, None, 0.0, False, None, True)
    o, lse, seed = torch.ops.trifuse.attention(q, k, v, None, 0.0, False, None, False)
    keep = torch.ones(5, 6, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="attention: mask_grad=True needs a floating-point attn_mask, got a torch.bool"):
        torch.ops.trifuse.attention_backward(o, q, k, v, o, lse, seed, keep, 0.0, False, None, False, True)


# ---------------------------------------------------------------------------------------------
# Logit soft cap (Gemma 2's attn_logit_softcapping): S = c * tanh(scale * Q K^T / c) + mask. The
# cap is small next to the scores here (c = 1.5; scores of unit scale, and 8x larger in the
# "large" cases), so the tanh is far from linear and its saturated tails are crossed.
# ---------------------------------------------------------------------------------------------

SOFTCAP_CASES = [
    (Case(b=2, h=2, sq=37, sk=37), 1.0),
    (Case(sq=45, sk=45, d=32, causal=True), 1.0),
    (Case(sq=20, sk=50, causal=True), 8.0),  # saturated: tanh = +-1 in fp32 over most scores
    (Case(h=4, h_kv=2, sq=33, sk=40, d=24, causal=True), 1.0),  # GQA
    (Case(b=2, sq=33, sk=40, mask="hf"), 1.0),  # transformers' finfo.min mask, added after the cap
    (Case(b=2, sq=33, sk=40, mask="dead-rows"), 1.0),
    (Case(sq=20, sk=24, d=80, scale=0.3), 8.0),
]


def _softcap_id(c):
    return f"{c[0].id}-x{c[1]:g}"


@pytest.mark.parametrize("case,magnitude", SOFTCAP_CASES, ids=[_softcap_id(c) for c in SOFTCAP_CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_matches_float64_oracle(dtype, case, magnitude):
    q, k, v, mask = make(case, dtype)
    q = (q.detach() * magnitude).requires_grad_()
    check_fwd_bwd(q, k, v, mask, {**kwargs_of(case), "softcap": 1.5}, name=case.id)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_with_dropout_and_mask_grad(dtype):
    """A float mask requiring grad under the cap gets dS itself (the mask is added after the cap),
    while dq, dk take the tanh's factor; dropout regenerated as without the cap."""
    mc = MaskGradCase(Case(b=2, h=4, h_kv=2, sq=33, sk=40), "1-h")
    c, p = mc.case, 0.2
    keep = kernel_keep_mask(c.b, c.h, c.sq, c.sk, p, seed=77)
    q, k, v, _ = make(c, dtype)
    leaf, view = mask_leaf_and_view(mc, dtype)
    check_mask_grad(q, k, v, leaf, view, {**kwargs_of(c), "softcap": 1.5}, dropout_p=p, dropout_mask=keep, seed=77,
                    name=mc.id)


def test_softcap_eager_path_registered_op_and_torch_path_agree(monkeypatch):
    case = Case(h=4, h_kv=2, sq=33, sk=40, mask="float")
    q, k, v, mask = make(case, torch.float32)
    mask.requires_grad_()
    torch.manual_seed(4)
    eager = trifuse.ops.attention(q, k, v, mask, 0.1, enable_gqa=True, softcap=2.0)
    torch.manual_seed(4)
    op = torch.ops.trifuse.attention(q, k, v, mask, 0.1, False, None, True, 2.0)[0]
    assert torch.equal(eager, op)
    dout = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(eager, (q, k, v, mask), dout), torch.autograd.grad(op, (q, k, v, mask), dout)):
        assert torch.equal(a, b)
    monkeypatch.setattr(attn_mod, "use_triton", lambda t: False)
    check_fwd_bwd(*make(Case(h=4, h_kv=2, sq=20, sk=24, causal=True), torch.float32),
                  {"is_causal": True, "enable_gqa": True, "softcap": 1.5}, name="torch path")


def test_softcap_gradcheck_opcheck_and_compile():
    def leaf(*shape):
        return (torch.randn(*shape, device=DEVICE, dtype=torch.float64) * 3).requires_grad_()

    q, k, v = leaf(1, 2, 5, 4), leaf(1, 1, 6, 4), leaf(1, 1, 6, 4)
    bias = leaf(1, 2, 5, 6)
    assert torch.autograd.gradcheck(  # fast mode: each evaluation runs the interpreted kernels
        lambda *a: trifuse.ops.attention(*a, enable_gqa=True, softcap=2.0), (q, k, v, bias), fast_mode=True)
    q, k, v, mask = make(Case(h=4, h_kv=2, sq=9, sk=12, mask="float"), torch.float32)
    torch.library.opcheck(torch.ops.trifuse.attention.default, (q, k, v, mask, 0.0, False, 0.5, True, 3.0))
    fn = torch.compile(lambda q, k, v: trifuse.ops.attention(q, k, v, is_causal=True, enable_gqa=True, softcap=3.0),
                       fullgraph=True, backend="aot_eager")
    out, ref = fn(q, k, v), trifuse.ops.attention(q, k, v, is_causal=True, enable_gqa=True, softcap=3.0)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_softcap_zero_or_none_is_no_cap():
    q, k, v, _ = make(Case(sq=20, sk=20, causal=True), torch.float32)
    plain = trifuse.ops.attention(q, k, v, is_causal=True)
    assert torch.equal(trifuse.ops.attention(q, k, v, is_causal=True, softcap=0.0), plain)
    assert torch.equal(trifuse.ops.attention(q, k, v, is_causal=True, softcap=None), plain)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_softcap_missing_or_without_its_chain_factor_fails(dtype):
    """Attention without the cap, and a cap whose backward forgets the tanh's factor (identity
    gradient through the cap), must both fail the tolerance the kernels pass."""
    case, cap = Case(b=2, h=2, sq=37, sk=37, causal=True), 1.5
    q, k, v, _ = make(case, dtype)
    kw = {"is_causal": True, "softcap": cap}
    ref64_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    lp_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref64, ref_lp = attention_ref(*ref64_in, **kw), attention_ref(*lp_in, **kw)
    ok, msg = check_close("no cap", trifuse.ops.attention(q, k, v, is_causal=True), ref64, ref_lp)
    assert not ok, msg

    def cap_without_factor(q, k, v):
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = s + (cap * torch.tanh(s / cap) - s).detach()  # forward capped, backward as if uncapped
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
        return torch.softmax(s, -1) @ v

    dout = torch.randn(q.shape, device=DEVICE, dtype=dtype)
    wrong_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    wrong_dq = torch.autograd.grad(cap_without_factor(*wrong_in), wrong_in[0], dout)[0]
    dq64 = torch.autograd.grad(ref64, ref64_in[0], dout.double())[0]
    dq_lp = torch.autograd.grad(ref_lp, lp_in[0], dout)[0]
    ok, msg = check_close("dq without the tanh factor", wrong_dq, dq64, dq_lp)
    assert not ok, msg
    got = trifuse.ops.attention(q, k, v, **kw)
    ok, msg = check_close("kernel dq", torch.autograd.grad(got, q, dout)[0], dq64, dq_lp)
    assert ok, msg


# ---------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss): one logit per query head in every row's softmax denominator, with no
# value. Sinks of about the scores' size (2 randn), so the sink takes a real share of each row.
# ---------------------------------------------------------------------------------------------

SINKS_CASES = [
    Case(b=1, h=1, sq=1, sk=1),  # one row, one key
    Case(b=2, h=2, sq=37, sk=37),
    Case(h=4, h_kv=2, sq=33, sk=40, d=24, causal=True),  # GQA, causal
    Case(sq=20, sk=50, causal=True),
    Case(b=2, sq=33, sk=40, mask="hf"),  # transformers' finfo.min mask: left-padded rows masked whole
    Case(b=2, sq=33, sk=40, mask="dead-rows"),  # rows masked whole with bools
]


def make_sinks(h: int, dtype: torch.dtype) -> torch.Tensor:
    return (2 * torch.randn(h, device=DEVICE)).to(dtype).requires_grad_()


@pytest.mark.parametrize("case", SINKS_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sinks_match_float64_oracle(dtype, case):
    q, k, v, mask = make(case, dtype)
    check_fwd_bwd(q, k, v, mask, kwargs_of(case), sinks=make_sinks(case.h, dtype), name=case.id)


def test_sinks_in_fp32_beside_fp16_and_with_dropout_and_softcap():
    """Sinks in their own dtype (an fp32 parameter beside 16-bit activations: dsinks in fp32),
    dropout regenerated in the backward, a soft cap that does not touch the sink."""
    case, p = Case(h=4, h_kv=2, sq=33, sk=40, causal=True), 0.2
    keep = kernel_keep_mask(case.b, case.h, case.sq, case.sk, p, seed=21)
    q, k, v, _ = make(case, torch.float16)
    check_fwd_bwd(q, k, v, None, {**kwargs_of(case), "softcap": 1.5}, dropout_p=p, dropout_mask=keep, seed=21,
                  sinks=make_sinks(case.h, torch.float32), name="fp32 sinks, dropout, softcap")


def test_sinks_are_what_transformers_gpt_oss_eager_attention_computes():
    """The oracle against transformers' spelling (concatenated column, max subtracted, softmax,
    column dropped), and the kernel's rows masked whole: P = 0 over the keys, so O = 0, with
    L = the sink (the sink takes the row's whole weight) and zero gradients for q there."""
    case = Case(h=4, h_kv=2, sq=20, sk=24, mask="dead-rows")
    q, k, v, keep = make(case, torch.float64)
    sinks = make_sinks(case.h, torch.float64)
    mask = torch.zeros(keep.shape, dtype=torch.float64, device=DEVICE).masked_fill(~keep, torch.finfo(torch.float64).min)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    w = q @ kr.transpose(2, 3) * case.d**-0.5 + mask
    combined = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    hf = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1] @ vr
    torch.testing.assert_close(attention_ref(q, k, v, keep, enable_gqa=True, sinks=sinks), hf)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o, lse = attn_mod.attention_fwd(q32, k32, v32, keep, 0.0, False, case.d**-0.5, None, 0.0, sinks.detach())
    dead = ~keep.any(-1).expand(o.shape[:3])
    assert dead.any() and o[dead].eq(0).all()
    lse = attn_mod._row_lse2(lse) / attn_mod.LOG2E  # natural log, (B, H, Sq)
    torch.testing.assert_close(lse[dead], sinks.detach().float()[None, :, None].expand(lse.shape)[dead])
    out = trifuse.ops.attention(q32, k32, v32, keep, enable_gqa=True, sinks=sinks.detach().float())
    assert out[dead].eq(0).all() and torch.autograd.grad(out.sum(), q32)[0][dead].eq(0).all()


def test_sinks_without_keys_and_of_minus_inf():
    """No keys: every row sees the sink alone (O = 0, all gradients 0). A sink of -inf is no sink:
    the same bits as without, and dsinks = 0 (also in the rows that see no key)."""
    q, k, v, _ = make(Case(sq=5, sk=0), torch.float32)
    sinks = make_sinks(2, torch.float32)
    out = trifuse.ops.attention(q, k, v, sinks=sinks)
    assert out.eq(0).all()
    assert all(g is None or not g.any() for g in torch.autograd.grad(out.sum(), (q, k, v, sinks), allow_unused=True))
    q, k, v, mask = make(Case(b=2, sq=20, sk=24, mask="dead-rows"), torch.float32)
    none = torch.full((2,), float("-inf"), device=DEVICE, requires_grad=True)
    out, plain = trifuse.ops.attention(q, k, v, mask, sinks=none), trifuse.ops.attention(q, k, v, mask)
    assert torch.equal(out, plain)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, none), dout)
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(plain, (q, k, v), dout)))
    assert torch.equal(grads[3], torch.zeros(2, device=DEVICE))


def test_sinks_eager_path_registered_op_and_torch_path_agree(monkeypatch):
    case = Case(h=4, h_kv=2, sq=33, sk=40, mask="float")
    q, k, v, mask = make(case, torch.float32)
    sinks = make_sinks(case.h, torch.float32)
    torch.manual_seed(4)
    eager = trifuse.ops.attention(q, k, v, mask, 0.1, enable_gqa=True, sinks=sinks)
    torch.manual_seed(4)
    op = torch.ops.trifuse.attention(q, k, v, mask, 0.1, False, None, True, 0.0, sinks)[0]
    assert torch.equal(eager, op)
    dout = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(eager, (q, k, v, sinks), dout), torch.autograd.grad(op, (q, k, v, sinks), dout)):
        assert torch.equal(a, b)
    monkeypatch.setattr(attn_mod, "use_triton", lambda t: False)
    for c in (Case(h=4, h_kv=2, sq=20, sk=24, causal=True), Case(b=2, sq=20, sk=24, mask="dead-rows")):
        check_fwd_bwd(*make(c, torch.float32), kwargs_of(c), sinks=make_sinks(c.h, torch.float32), name="torch path")


def test_sinks_gradcheck_opcheck_and_compile():
    def leaf(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.float64).requires_grad_()

    q, k, v, sinks = leaf(1, 2, 5, 4), leaf(1, 1, 6, 4), leaf(1, 1, 6, 4), leaf(2)
    keep = torch.rand(1, 1, 5, 6, device=DEVICE) > 0.3
    keep[0, :, 2] = False  # a row masked whole: its only weight is the sink's
    assert torch.autograd.gradcheck(  # fast mode: each evaluation runs the interpreted kernels
        lambda *a: trifuse.ops.attention(*a[:3], keep, enable_gqa=True, sinks=a[3]), (q, k, v, sinks), fast_mode=True)
    q, k, v, mask = make(Case(h=4, h_kv=2, sq=9, sk=12, mask="float"), torch.float32)
    sinks = make_sinks(4, torch.float32)
    torch.library.opcheck(torch.ops.trifuse.attention.default, (q, k, v, mask, 0.0, False, 0.5, True, 0.0, sinks))
    q_, k_, v_, sinks_ = (t.detach() for t in (q, k, v, sinks))
    o, lse, seed = torch.ops.trifuse.attention(q_, k_, v_, mask, 0.0, False, 0.5, True, 0.0, sinks_)
    torch.library.opcheck(torch.ops.trifuse.attention_backward.default,
                          (torch.randn_like(o), q_, k_, v_, o, lse, seed, mask, 0.0, False, 0.5, True, False, 0.0,
                           sinks_))
    fn = torch.compile(lambda q, k, v, s: trifuse.ops.attention(q, k, v, is_causal=True, enable_gqa=True, sinks=s),
                       fullgraph=True, backend="aot_eager")
    out, ref = fn(q, k, v, sinks), trifuse.ops.attention(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v, sinks)), torch.autograd.grad(ref.sum(), (q, k, v, sinks))):
        torch.testing.assert_close(a, b)
    with pytest.raises(Exception, match="sinks must be 1-D with one logit per query head"):
        fn(q, k, v, sinks[:3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_sinks_missing_or_dsinks_with_the_wrong_sign_fails(dtype):
    """Attention without the sinks, and a dsinks of the wrong sign (+ sum P_sink * delta), must fail
    the tolerance the kernels pass."""
    case = Case(b=2, h=2, sq=37, sk=37, causal=True)
    q, k, v, _ = make(case, dtype)
    sinks = make_sinks(case.h, dtype)
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ins_lp = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    ref64 = attention_ref(*ins64[:3], is_causal=True, sinks=ins64[3])
    ref_lp = attention_ref(*ins_lp[:3], is_causal=True, sinks=ins_lp[3])
    ok, msg = check_close("no sinks", trifuse.ops.attention(q, k, v, is_causal=True), ref64, ref_lp)
    assert not ok, msg
    dout = torch.randn(q.shape, device=DEVICE, dtype=dtype)
    ds64 = torch.autograd.grad(ref64, ins64[3], dout.double())[0]
    ds_lp = torch.autograd.grad(ref_lp, ins_lp[3], dout)[0]
    ds = torch.autograd.grad(trifuse.ops.attention(q, k, v, is_causal=True, sinks=sinks), sinks, dout)[0]
    ok, msg = check_close("dsinks", ds, ds64, ds_lp)
    assert ok, msg
    ok, msg = check_close("dsinks of the wrong sign", -ds, ds64, ds_lp)
    assert not ok, msg


def test_autocast_casts_the_inputs_as_sdpa_does():
    """Under autocast SDPA runs in the autocast dtype whatever its inputs' dtypes (fp32 q and k from
    fp32 rotary tables beside a 16-bit v); so does trifuse.ops.attention, float mask included."""
    q, k = (torch.randn(2, 2, 9, 16, device=DEVICE) for _ in range(2))
    v = torch.randn(2, 2, 9, 16, device=DEVICE, dtype=torch.float16)
    mask = torch.randn(2, 1, 9, 9, device=DEVICE)
    with torch.autocast(q.device.type, dtype=torch.float16):
        out = trifuse.ops.attention(q, k, v, attn_mask=mask)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == ref.dtype == torch.float16
    ref64 = attention_ref(q.double(), k.double(), v.double(), mask.double())
    lowp = attention_ref(q.half(), k.half(), v, mask.half())
    assert_close("autocast out", out, ref64, lowp)
    with pytest.raises(TypeError, match="share one dtype"):  # outside autocast, one dtype as before
        trifuse.ops.attention(q, k, v)


def test_masked_head_dim_64_forward_starts_from_a_default_that_does_not_spill(monkeypatch):
    """The GPU's 16-bit lists (not the interpreter's): with a mask the head-dim-64 forward's
    default is 8 warps (4 spilled compiled for sm_90), the same configs otherwise, and the tuner
    passes the key's mask kind on to the list."""
    monkeypatch.setattr(attn_mod, "INTERPRET", False)

    def shapes(cfgs):
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in cfgs]

    plain = shapes(attn_mod._configs("fwd", 64, 2, 232448))
    masked = shapes(attn_mod._configs("fwd", 64, 2, 232448, mask=1))
    assert plain[0] == (128, 64, 4, 3) and masked[0] == (128, 64, 8, 3) and sorted(plain) == sorted(masked)
    assert shapes(attn_mod._configs("fwd", 128, 2, 232448, mask=2)) == shapes(attn_mod._configs("fwd", 128, 2, 232448))
    assert shapes(attn_mod._configs("fwd", 64, 4, 232448, mask=1)) == shapes(attn_mod._configs("fwd", 64, 4, 232448))
    named = dict(zip(attn_mod._KEY_NAMES[1:], (64, 2, 232448, 128, 128, 64, False, 1, False, torch.bfloat16)))
    assert attn_mod._TUNERS["fwd"]._configs_kwargs(named)["mask"] == 1


def test_dropout_defaults_are_the_entries_that_do_not_spill(monkeypatch):
    """With dropout (compiled for sm_90: bench/compile_sm90.py --spaces --only attention_dropout)
    the head-dim-64 forward and dQ defaults spill; the lists put an entry of the same list that
    does not first, and the tuner passes the key's dropout flag."""
    monkeypatch.setattr(attn_mod, "INTERPRET", False)

    def shapes(kind, d, **kw):
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                for c in attn_mod._configs(kind, d, 2, 232448, **kw)]

    for (kind, d), first in attn_mod._DROPOUT_16BIT_DEFAULT.items():
        with_dropout = shapes(kind, d, dropout=True)
        plain = shapes(kind, d)
        assert with_dropout[0] == first != plain[0] and sorted(with_dropout) == sorted(plain)
    assert shapes("dkdv", 64, dropout=True) == shapes("dkdv", 64)  # no spill there: unchanged
    named = dict(zip(attn_mod._KEY_NAMES[1:], (64, 2, 232448, 128, 128, 64, False, 0, True, torch.bfloat16)))
    assert attn_mod._TUNERS["dq"]._configs_kwargs(named)["dropout"] is True


# ---------------------------------------------------------------------------------------------
# The forward through tensor descriptors (TMA), TRIFUSE_ATTENTION_TMA=1: 16-bit only (fp16 and
# bf16), unit stride along head_dim and 16-byte aligned addresses and strides.
# ---------------------------------------------------------------------------------------------

TMA_CASES = [
    Case(b=2, h=2, sq=37, sk=37),  # ragged last query and key blocks
    Case(sq=20, sk=50, causal=True), Case(sq=50, sk=20, causal=True),
    Case(h=4, h_kv=2, sq=33, sk=40, d=24, causal=True),  # GQA, head dim padded 24 -> 32 by the copy engine
    Case(sq=20, sk=24, d=80),
    Case(b=2, sq=33, sk=40, mask="hf"),
    Case(h=1, sq=11, sk=11, d=256, causal=True),
    # BLOCK_D 256 with the head dim short of it: Triton 3.6 splits the box into 64-element TMA
    # messages (the 128-byte swizzle), the last ones wholly past the head dim (zero-filled on
    # load, dropped on store): what a GPU session should see first.
    Case(h=2, h_kv=1, sq=19, sk=21, d=160, causal=True),
    Case(sq=13, sk=17, d=192),
    Case(h=4, h_kv=2, sq=21, sk=30, d=48, dv=24, causal=True),  # the value's own head dim (MLA)
]


@pytest.fixture
def tma(monkeypatch):
    """TMA allowed, and on a GPU no timing: the forward's default config, the TMA one, runs."""
    monkeypatch.setenv("TRIFUSE_ATTENTION_TMA", "1")
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(attn_mod, "_FWD_PLANS", {})
    monkeypatch.setattr(attn_mod, "_BWD_PLANS", {})
    for tuner in attn_mod._TUNERS.values():
        monkeypatch.setattr(tuner, "_memo", {})


def _launched_tma(dtype: torch.dtype = torch.float16) -> list[bool]:
    """USE_TMA of each `dtype` forward launched since the fixture (the oracle's helpers run fp32)."""
    return [meta["USE_TMA"] for key, (_, meta) in attn_mod._FWD_PLANS.items() if key[1] == dtype]


def _launched_tma_bwd(dtype: torch.dtype = torch.float16) -> list[tuple[bool, bool]]:
    """(dK/dV pass, dQ pass) USE_TMA of each `dtype` backward launched since the fixture."""
    return [(plan[3]["USE_TMA"], plan[5]["USE_TMA"]) for key, plan in attn_mod._BWD_PLANS.items() if key[1] == dtype]


@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_tma_forward_matches_float64_oracle(tma, dtype, case):
    q, k, v, mask = make(case, dtype)
    check_fwd_bwd(q, k, v, mask, kwargs_of(case), name="tma")
    assert _launched_tma(dtype) == [True] and _launched_tma_bwd(dtype) == [(True, True)]


def test_tma_forward_with_dropout_and_softcap(tma):
    case = Case(h=4, h_kv=2, sq=33, sk=40, causal=True)
    keep = kernel_keep_mask(case.b, case.h, case.sq, case.sk, 0.3, seed=5)
    q, k, v, mask = make(case, torch.float16)
    check_fwd_bwd(q, k, v, mask, kwargs_of(case), dropout_p=0.3, dropout_mask=keep, seed=5, name="tma dropout")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 29, 32, dtype=torch.float16, device=DEVICE) * 4 for _ in range(3))
    with_tma = trifuse.ops.attention(q, k, v, is_causal=True, softcap=5.0)
    ref = attention_ref(q.double(), k.double(), v.double(), is_causal=True, softcap=5.0)
    assert_close("tma softcap", with_tma, ref, attention_ref(q, k, v, is_causal=True, softcap=5.0))
    assert _launched_tma() == [True, True]


def test_tma_forward_with_sinks(tma):
    case = Case(h=4, h_kv=2, sq=33, sk=40, mask="hf")
    q, k, v, mask = make(case, torch.float16)
    check_fwd_bwd(q, k, v, mask, kwargs_of(case), sinks=make_sinks(case.h, torch.float16), name="tma sinks")
    assert _launched_tma() == [True]


def test_tma_forward_takes_fused_qkv_views(tma):
    b, s, h, d = 2, 29, 3, 16
    x = torch.randn(b, s, 3 * h * d, device=DEVICE, dtype=torch.float16)
    x.requires_grad_()
    q, k, v = (t.transpose(1, 2) for t in x.view(b, s, 3, h, d).unbind(2))
    out = trifuse.ops.attention(q, k, v, is_causal=True)
    x64, xlp = x.detach().double().requires_grad_(), x.detach().clone().requires_grad_()
    ref, ref_lp = (attention_ref(*(t.transpose(1, 2) for t in y.view(b, s, 3, h, d).unbind(2)), is_causal=True)
                   for y in (x64, xlp))
    assert_close("tma fused qkv", out, ref, ref_lp)
    dout = torch.randn(b, s, h, d, device=DEVICE, dtype=torch.float16).transpose(1, 2)  # dO strided too
    (gx,) = torch.autograd.grad(out, x, dout)
    assert_close("tma fused qkv dx", gx, torch.autograd.grad(ref, x64, dout.double())[0],
                 torch.autograd.grad(ref_lp, xlp, dout)[0])
    assert _launched_tma() == [True] and _launched_tma_bwd() == [(True, True)]


def test_tma_is_refused_where_the_copy_engine_cannot_go_and_plans_keep_them_apart(tma):
    """fp32, a head dim whose row stride is off the 16-byte grid, a misaligned base address, a
    strided head dim: the pointer path. The same shapes aligned and misaligned get separate
    launch plans, so a plan made with TMA is never replayed on tensors it cannot take."""
    q = torch.randn(1, 2, 24, 32, device=DEVICE, dtype=torch.float16)
    assert attn_mod._tma_ok(q, q, q, q)
    assert not attn_mod._tma_ok(q.float(), q.float(), q.float(), q.float())
    odd = torch.randn(1, 2, 24, 20, device=DEVICE, dtype=torch.float16)  # rows of 40 bytes
    assert not attn_mod._tma_ok(odd, odd, odd, odd)
    shifted = torch.randn(1 * 2 * 24 * 32 + 1, device=DEVICE, dtype=torch.float16)[1:].view(1, 2, 24, 32)
    assert not attn_mod._tma_ok(shifted, q, q, q)
    strided_d = torch.randn(1, 2, 24, 64, device=DEVICE, dtype=torch.float16)[..., ::2]
    assert not attn_mod._tma_ok(strided_d, q, q, q)
    expanded = torch.randn(1, 2, 1, 32, device=DEVICE, dtype=torch.float16).expand(1, 2, 24, 32)  # a dO of sum()
    assert not attn_mod._tma_ok(q, q, q, expanded)
    for t in (q, shifted):
        out = trifuse.ops.attention(t, q, q)
        ref = attention_ref(t.double(), q.double(), q.double())
        assert_close("tma refusal", out, ref, attention_ref(t, q, q))
    assert sorted(_launched_tma()) == [False, True]


def test_tma_is_refused_for_a_do_of_another_dtype(tma):
    """The stride test counts 2-byte elements, and the registered backward op does not check
    dO's dtype: an fp32 dO (strides multiples of 8 elements, aligned) is refused, not taken as
    16-bit."""
    q = torch.randn(1, 2, 24, 32, device=DEVICE, dtype=torch.float16)
    assert attn_mod._tma_ok(q, q, q, q)
    assert not attn_mod._tma_ok(q, q, q, q.float())
    assert not attn_mod._tma_ok(q, q, q, q.bfloat16())


def test_tma_is_refused_where_descriptor_scratch_offsets_pass_2_31(tma, monkeypatch):
    """Triton 3.6 computes each program's descriptor slot in the global scratch as program id *
    bytes per program in 32-bit: from 2^31 bytes on it lands before the buffer. TMA is refused
    from there, for the forward (4 descriptors) and each backward pass (2)."""
    m = attn_mod._min_block("fwd")
    assert attn_mod._tma_scratch_fits(("fwd", m * 4096 - m, 1024))  # 2^22 - 1024 programs * 512 B
    assert not attn_mod._tma_scratch_fits(("fwd", m * 4096, 1024))  # 2^22 programs * 512 B = 2^31
    m = attn_mod._min_block("dkdv")
    assert attn_mod._tma_scratch_fits(("dkdv", m * 8192 - m, 1024), ("dq", 16, 1))
    assert not attn_mod._tma_scratch_fits(("dkdv", m * 8192, 1024), ("dq", 16, 1))
    # A call whose grid would pass the limit (lowered here to a few programs) takes the pointer
    # path, forward and backward, under its own plans.
    q = torch.randn(2, 2, 40, 32, device=DEVICE, dtype=torch.float16, requires_grad=True)
    monkeypatch.setattr(attn_mod, "_TMA_SCRATCH_LIMIT", 4 * 512)
    out = trifuse.ops.attention(q, q, q)
    out.backward(torch.ones_like(out))
    assert _launched_tma() == [False] and _launched_tma_bwd() == [(False, False)]
    ref = attention_ref(q.detach().double(), q.detach().double(), q.detach().double())
    assert_close("tma scratch refusal", out, ref, attention_ref(q.detach(), q.detach(), q.detach()))


def test_tma_scratch_is_aligned_as_asked():
    """The descriptors' scratch starts on the launcher's alignment (128 bytes) whatever address
    the allocator behind torch returns."""
    buf = torch.empty(1000 + 128, dtype=torch.int8)
    for skip in (0, 1, 16, 127):
        part = attn_mod._aligned_scratch(buf[skip:skip + 1000], 872, 128)
        assert part.data_ptr() % 128 == 0 and part.numel() == 872


def test_tma_stays_off_unless_asked(monkeypatch):
    monkeypatch.delenv("TRIFUSE_ATTENTION_TMA", raising=False)
    q = torch.randn(1, 2, 24, 32, device=DEVICE, dtype=torch.float16)
    assert not attn_mod._tma_ok(q, q, q, q)


# ---------------------------------------------------------------------------------------------
# The features together: the cases above vary one or two at a time.
# ---------------------------------------------------------------------------------------------

MASK_KINDS = ["", "keypad", "bool", "float", "hf", "2d", "dead-rows", "packed", "window", "per-head"]


def _as_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t as the same values in another layout: (B, S, H, D) transposed, as models hand it over,
    or the middle third of a fused (B, S, H, 3D) projection."""
    t = t.detach()
    if layout == "bshd":
        return t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    if layout == "fused":
        b, h, s, d = t.shape
        qkv = torch.zeros(b, s, h, 3 * d, dtype=t.dtype, device=t.device)
        qkv[..., d:2 * d] = t.transpose(1, 2)
        return qkv[..., d:2 * d].transpose(1, 2).requires_grad_()
    return t.requires_grad_()


@settings(max_examples=12, deadline=None)
@given(data=st.data(), mask=st.sampled_from(MASK_KINDS), h_kv=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 3]), d=st.sampled_from([8, 24, 40]), dv=st.sampled_from([None, 16]),
       dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["contiguous", "bshd", "fused"]))
def test_hypothesis_feature_combinations(data, mask, h_kv, group, d, dv, dtype, layout):
    """A mask kind (HF's float mask with rows masked whole among them), GQA, a value head dim of
    its own, a scale, a soft cap, sinks, dropout and strided layouts, drawn together. A random
    search over these (1400 draws) found the float mask's rows at finfo.min (_row_stats); the
    one kind of draw left out is a single key (sk = 1: the exact dq is 0 and PyTorch's own error
    0, so the FA2 backward's delta from the rounded O exceeds the floor)."""
    b = data.draw(st.integers(1, 3)) if mask in ("", "bool", "float", "2d", "dead-rows") else 2
    h = h_kv * group
    sq, sk = data.draw(st.integers(1, 70)), data.draw(st.integers(2, 70))
    if mask in ("packed", "window", "hf"):
        sq = sk = data.draw(st.integers(51, 70))  # "hf": batch 1's first 6 rows see no key
    elif mask == "keypad":
        sk = max(sk, 12)
    elif mask == "dead-rows":
        sq = max(sq, 9)
    elif mask == "per-head":
        h, sk = 2, max(sk, 31)
    case = Case(b=b, h=h, sq=sq, sk=sk, d=d, h_kv=None if mask == "per-head" or group == 1 else h_kv,
                causal=not mask and data.draw(st.booleans()), mask=mask, dv=dv,
                scale=data.draw(st.sampled_from([None, 0.3, 1.7])))
    seed = data.draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    q, k, v, attn_mask = make(case, dtype)
    q, k, v = (_as_layout(t, layout) for t in (q, k, v))
    kw = {**kwargs_of(case), "enable_gqa": case.h_kv is not None}
    softcap = data.draw(st.sampled_from([None, 5.0, 30.0]))
    if softcap is not None:
        kw["softcap"] = softcap
    sinks = make_sinks(case.h, dtype) if data.draw(st.booleans()) else None
    dropout = {}
    if data.draw(st.booleans()):
        dropout = dict(dropout_p=0.3, dropout_mask=kernel_keep_mask(b, case.h, sq, sk, 0.3, seed), seed=seed)
    check_fwd_bwd(q, k, v, attn_mask, kw, sinks=sinks, name=f"{case.id} {layout}", **dropout)
