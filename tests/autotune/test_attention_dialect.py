"""The attention dialect wired into trifuse.ops.attention: trifuse's kernels, SDPA with one
backend forced (flash, efficient, cuDNN), flash-attn and xformers when importable.

On the CPU only trifuse's kernels can run: these tests pin the rejection reasons, the check
(blockwise float64 reference, the dropout check and their negative controls), the decision
plumbing with fake timings on candidates that stand in for the GPU ones, the per-call fallback
and the cost of the dispatch key. The GPU tests check every real candidate in fp16 / bf16."""

import pytest
import torch
import triton

import trifuse
from _device import DEVICE, ON_GPU
from trifuse.autotune import dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import attention as A

SDPA_NAMES = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn")
ALL_NAMES = ("trifuse", *SDPA_NAMES, "flash-attn", "xformers")
HALF = (torch.float16, torch.bfloat16)


@pytest.fixture
def attn_dialect(cache_dir, monkeypatch):
    """The real attention dialect with its memory cleared before and after the test."""
    A.ATTENTION.clear()
    monkeypatch.setattr(A.ATTENTION, "timer", None)
    monkeypatch.setattr(A, "FALLBACKS", {})
    yield A.ATTENTION
    A.ATTENTION.clear()


def qkv(b=1, h=2, s=24, d=16, dtype=torch.float32, grad=True, h_kv=None, sk=None, device=DEVICE):
    q = torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=grad)
    k = torch.randn(b, h_kv or h, sk or s, d, device=device, dtype=dtype, requires_grad=grad)
    v = torch.randn(b, h_kv or h, sk or s, d, device=device, dtype=dtype, requires_grad=grad)
    return q, k, v


def call(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return (q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def fwd_bwd(fn, args):
    q, k, v = args[:3]
    o = fn(*args)
    dy = torch.randn(o.shape, generator=torch.Generator(device=o.device).manual_seed(1), device=o.device,
                     dtype=o.dtype)
    return (o, *torch.autograd.grad(o, (q, k, v), dy))


def registered(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return torch.ops.trifuse.attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)[0]


def math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """A correct stand-in for a GPU candidate on the CPU (no dropout): the reference in q's dtype."""
    return A.attention_ref(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


class LooksCuda:
    """A CPU tensor that says it is on CUDA, for the static part of `supports`."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.is_cuda = True

    def __getattr__(self, name):
        return getattr(self._t, name)


def plumbing(*extra: Candidate) -> Dialect:
    """A dialect with attention's key, check and output shapes, trifuse's candidate and `extra`."""
    d = Dialect("attention_test", A._attention_key, A._DIALECT_KEY_NAMES, A.attention_ref,
                check=A._attention_check, output_like=A._attention_output_like)
    d.register(A.ATTENTION.candidate("trifuse"))
    for c in extra:
        d.register(c)
    return d


# ---------------------------------------------------------------------------------------------
# The candidates and their reasons
# ---------------------------------------------------------------------------------------------


def test_candidates_in_order():
    assert tuple(c.name for c in A.ATTENTION.candidates) == ALL_NAMES
    assert A.ATTENTION.candidate("trifuse").deterministic
    assert not any(A.ATTENTION.candidate(n).deterministic for n in ALL_NAMES[1:])


@pytest.mark.skipif(ON_GPU, reason="the CPU's reasons")
def test_on_cpu_only_trifuse_is_eligible_and_every_other_says_why(attn_dialect):
    rec = attn_dialect.explain(*call(*qkv(), is_causal=True))
    assert rec.chosen == "trifuse" and rec.source == "not decided yet"
    for name in SDPA_NAMES:
        assert rec.rejected[name].endswith("runs on CUDA, got cpu tensors")
    for name, module in (("flash-attn", "flash_attn"), ("xformers", "xformers.ops")):
        if dialects.import_problem(module) is not None:
            assert rec.rejected[name].startswith(f"{module} is not installed")


@pytest.mark.parametrize("name,dtype,d,reason", [
    ("sdpa-flash", torch.float32, 64, "SDPA's flash backend takes float16 / bfloat16, got float32"),
    ("sdpa-cudnn", torch.float32, 64, "SDPA's cuDNN backend takes float16 / bfloat16, got float32"),
    ("sdpa-efficient", torch.float64, 64, "SDPA's efficient backend takes float16 / bfloat16 / float32, got float64"),
    ("sdpa-flash", torch.float16, 80 + 4, "SDPA's flash backend takes head dims that are multiples of 8 up to 256, got 84"),
    ("sdpa-efficient", torch.float16, 264, "SDPA's efficient backend takes head dims that are multiples of 8 up to 256, got 264"),
    ("sdpa-cudnn", torch.float16, 20, "SDPA's cuDNN backend takes head dims that are multiples of 8 up to 256, got 20"),
])
def test_sdpa_static_reasons(name, dtype, d, reason, monkeypatch):
    monkeypatch.setattr(A, "_sdpa_call_problem", lambda *a: None)
    q, k, v = (LooksCuda(t) for t in qkv(d=d, dtype=dtype, s=4, grad=False, device="cpu"))
    assert A.ATTENTION.candidate(name).supports(*call(q, k, v)) == reason


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_sdpa_flash_takes_no_mask_and_the_others_ask_torch(mask_dtype, monkeypatch):
    asked = []
    monkeypatch.setattr(A, "_sdpa_call_problem", lambda name, *a: asked.append(name))
    q, k, v = (LooksCuda(t) for t in qkv(d=64, dtype=torch.float16, s=4, grad=False, device="cpu"))
    mask = torch.ones(4, 4, dtype=mask_dtype)
    assert A.ATTENTION.candidate("sdpa-flash").supports(*call(q, k, v, mask)) == "SDPA's flash backend takes no attn_mask"
    for name in ("sdpa-efficient", "sdpa-cudnn"):
        assert A.ATTENTION.candidate(name).supports(*call(q, k, v, mask)) is None
    assert asked == ["sdpa-efficient", "sdpa-cudnn"], "the per-call rules are torch's (can_use_*_attention)"


def test_sdpa_candidates_that_give_no_mask_gradient_are_not_eligible(monkeypatch):
    """A float mask that requires grad (T5's position bias): flash takes no mask, cuDNN gives it no
    gradient; the efficient backend does (and the check compares it), so torch is asked."""
    asked = []
    monkeypatch.setattr(A, "_sdpa_call_problem", lambda name, *a: asked.append(name))
    q, k, v = (LooksCuda(t) for t in qkv(d=64, dtype=torch.float16, s=4, grad=False, device="cpu"))
    bias = torch.zeros(4, 4, requires_grad=True)
    assert A.ATTENTION.candidate("sdpa-flash").supports(*call(q, k, v, bias)) == "SDPA's flash backend takes no attn_mask"
    assert (A.ATTENTION.candidate("sdpa-cudnn").supports(*call(q, k, v, bias))
            == "SDPA's cuDNN backend gives no gradient for attn_mask")
    assert A.ATTENTION.candidate("sdpa-efficient").supports(*call(q, k, v, bias)) is None
    with torch.no_grad():
        assert A.ATTENTION.candidate("sdpa-cudnn").supports(*call(q, k, v, bias)) is None
    assert asked == ["sdpa-efficient", "sdpa-cudnn"]


@pytest.mark.parametrize("case,reason", [
    ("cpu", "flash-attn runs on CUDA, got cpu tensors"),
    ("fp32", "flash-attn takes float16 / bfloat16, got float32"),
    ("d=36", "flash-attn takes head dims that are multiples of 8 up to 256, got 36"),
    ("mask", "flash-attn takes no attn_mask"),
    ("causal sq!=sk", ("flash-attn aligns the causal mask bottom-right; SDPA's is_causal is top-left "
                       "(query len != key len)")),
    ("strided", "flash-attn needs a unit stride on the head dim"),
    ("ok", None),
    ("gqa", None),
])
def test_flash_attn_reasons(case, reason):
    dtype = torch.float32 if case == "fp32" else torch.float16
    q, k, v = qkv(d=36 if case == "d=36" else 64, dtype=dtype, s=8, grad=False, device="cpu",
                  sk=12 if case == "causal sq!=sk" else None, h=4, h_kv=2 if case == "gqa" else None)
    if case == "strided":
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    if case != "cpu":
        q, k, v = LooksCuda(q), LooksCuda(k), LooksCuda(v)
    mask = torch.ones(8, 8, dtype=torch.bool) if case == "mask" else None
    args = call(q, k, v, mask, is_causal=case == "causal sq!=sk", enable_gqa=case == "gqa")
    assert A._flash_attn_supports(*args) == reason


@pytest.mark.parametrize("case,reason", [
    ("cpu", "xformers runs on CUDA, got cpu tensors"),
    ("fp64", "xformers takes float16 / bfloat16 / float32, got float64"),
    ("mask", "attn_mask is not adapted to xformers' attn_bias here"),
    ("gqa", "xformers takes GQA only in its 5-D (B, S, G, H, D) layout, not adapted here"),
    ("ok", None),
])
def test_xformers_reasons(case, reason):
    dtype = torch.float64 if case == "fp64" else torch.float16
    q, k, v = qkv(d=64, dtype=dtype, s=8, grad=False, device="cpu", h=4, h_kv=2 if case == "gqa" else None)
    if case != "cpu":
        q, k, v = LooksCuda(q), LooksCuda(k), LooksCuda(v)
    mask = torch.zeros(8, 8) if case == "mask" else None
    assert A._xformers_supports(*call(q, k, v, mask, enable_gqa=case == "gqa")) == reason


@pytest.mark.skipif(torch.version.cuda is not None and not ON_GPU,
                    reason="a CUDA build of torch with no driver raises from its SDPA checks instead of answering "
                           "(the dialect asks them for CUDA tensors only)")
def test_sdpa_call_problem_says_what_torch_says():
    """On this build torch answers for itself: no CUDA, no backend (the reason names the check)."""
    q, k, v = qkv(d=64, dtype=torch.float16, s=8, grad=False, device="cpu")
    for name in SDPA_NAMES:
        problem = A._sdpa_call_problem(name, q, k, v, None, 0.0, False, False)
        if not ON_GPU:
            assert problem.startswith(f"torch.backends.cuda.{A._SDPA[name][2]} is False")


# ---------------------------------------------------------------------------------------------
# The key: cheap, a plain tuple, None when trifuse must decide
# ---------------------------------------------------------------------------------------------


def test_key_is_a_small_tuple_of_plain_values():
    q, k, v = qkv(b=2, h=8, s=40, d=16, h_kv=2, sk=70)
    mask = torch.ones(40, 70, dtype=torch.bool)
    key = A._attention_key(*call(q, k, v, mask, 0.1, False, None, True))
    assert key == (-1 if DEVICE == "cpu" else 0, torch.float32, 16, 2, 64, 128, 16, 0, A._BOOL_MASK, True, True, 16)
    assert len(key) == len(A._DIALECT_KEY_NAMES)
    assert not any(isinstance(x, str) for x in key)
    with torch.no_grad():
        assert A._attention_key(*call(q, k, v))[-2] is False
    assert A._attention_key(*call(q, k, v, torch.zeros(40, 70)))[8] == A._FLOAT_MASK
    assert A._attention_key(*call(q, k, v))[8] == A._NO_MASK
    assert A._attention_key(*call(q, k, v, is_causal=True))[7] == 2  # Sq != Sk
    assert A._attention_key(*call(q, q, q, is_causal=True))[7] == 1
    # a value head dim other than the query's (DeepSeek's MLA) is its own key: SDPA's flash refuses it
    assert A._attention_key(*call(q, k, v[..., :8]))[-1] == 8


def test_key_separates_a_mask_that_needs_its_gradient():
    q, k, v = qkv(s=40, grad=False)
    bias = torch.zeros(40, 40, requires_grad=True)
    key = A._attention_key(*call(q, k, v, bias))
    assert key[8] == A._FLOAT_MASK_GRAD and key[-2] is True, "the call trains through the mask alone"
    with torch.no_grad():
        assert A._attention_key(*call(q, k, v, bias))[8] == A._FLOAT_MASK
    assert A._attention_key(*call(q, k, v, bias.detach()))[8] == A._FLOAT_MASK


@pytest.mark.parametrize("case", ["3-D", "mixed dtypes", "empty", "kv shapes differ"])
def test_key_is_none_where_trifuse_decides(case):
    q, k, v = qkv(s=8)
    if case == "3-D":
        q = q[0]
    elif case == "mixed dtypes":
        k = k.detach().double()
    elif case == "empty":
        q = q[:, :, :0]
    else:
        v = v[:, :, :4]
    assert A._attention_key(*call(q, k, v)) is None


KEY_CALLS = 36  # 24 today: a budget with room, that a string format or a loop would overrun


def test_key_is_a_few_dozen_calls(count_calls):
    # The key runs on every eager call (~1-2 µs when measured); counted, not timed.
    args = call(*qkv(b=2, h=4, s=64, d=32), is_causal=True)
    assert count_calls(A._attention_key, *args) <= KEY_CALLS


# ---------------------------------------------------------------------------------------------
# The check: blockwise float64 reference, dropout, negative controls
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["causal", "bool mask", "float mask", "float mask with grad", "gqa", "sq != sk"])
def test_blockwise_reference_equals_the_whole_one(case, monkeypatch):
    monkeypatch.setattr(A, "REFERENCE_BLOCK_ELEMENTS", 2 * 2 * 30 * 5)  # blocks of 5 query rows, ragged last
    gqa = case == "gqa"
    q, k, v = qkv(h=4, h_kv=2 if gqa else None, s=23, sk=30 if case != "causal" else 23, dtype=torch.float64)
    mask = None
    if case == "bool mask":
        mask = torch.rand(1, 1, 23, 30) > 0.3
    elif case == "float mask":
        mask = torch.randn(4, 23, 30, dtype=torch.float64)
    elif case == "float mask with grad":
        mask = torch.randn(1, 4, 23, 30, dtype=torch.float64, requires_grad=True)
    args = call(q, k, v, mask, 0.0, case == "causal", 0.3, gqa)
    dy = torch.randn(q.shape, dtype=torch.float64)
    got = A._reference_blocks(args, torch.float64, dy, True)
    o = A.attention_ref(*args)
    leaves = (q, k, v) + ((mask,) if case == "float mask with grad" else ())
    want = [o, *torch.autograd.grad(o, leaves, dy)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", [dict(is_causal=True), dict(mask=True), dict(gqa=True)])
def test_check_passes_trifuse(dtype, variant):
    q, k, v = qkv(h=4, h_kv=2 if variant.get("gqa") else None, s=20, dtype=dtype)
    mask = (torch.rand(1, 1, 20, 20, device=DEVICE) > 0.2) if variant.get("mask") else None
    args = call(q, k, v, mask, 0.0, variant.get("is_causal", False), None, variant.get("gqa", False))
    assert A._attention_check(A._attention_trifuse, args) is None


@pytest.mark.parametrize("wrong,label", [
    (lambda q, k, v, *a: A._attention_trifuse(q, k, v, *a) * 1.01, "output"),
    # A softmax without the scale: a plausible bug whose output error is large.
    (lambda q, k, v, m, p, c, s, g: A._attention_trifuse(q, k, v, m, p, c, 1.0, g), "output"),
    # Right forward, wrong dK: the check covers gradients too.
    (lambda q, k, v, *a: A._attention_trifuse(q, _ScaleGrad.apply(k), v, *a), "dk"),
])
def test_check_rejects_wrong_attention(wrong, label):
    args = call(*qkv(s=20), is_causal=True)
    problem = A._attention_check(wrong, args)
    assert problem is not None and problem.startswith(label)


def test_check_takes_a_value_head_dim_other_than_the_query_and_rejects_a_wrong_one():
    """DeepSeek's MLA shape (v narrower than q and k): the check's dO has the output's shape;
    trifuse passes, a candidate that drops the scale fails."""
    q, k, _ = qkv(h=4, h_kv=2, s=20, sk=23)
    v = torch.randn(1, 2, 23, 8, device=DEVICE, requires_grad=True)
    args = call(q, k, v, None, 0.0, True, None, True)
    assert A._attention_check(A._attention_trifuse, args) is None
    wrong = A._attention_check(lambda q, k, v, m, p, c, s, g: A._attention_trifuse(q, k, v, m, p, c, 1.0, g), args)
    assert wrong is not None and wrong.startswith("output")
    assert A._attention_output_like(*args).shape == (1, 4, 20, 8)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1.05


def _detached_mask(q, k, v, m, *a):
    return A._attention_trifuse(q, k, v, m.detach(), *a)


def _scaled_mask_grad(q, k, v, m, *a):
    return A._attention_trifuse(q, k, v, _ScaleGrad.apply(m), *a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_check_with_a_mask_that_needs_its_gradient(dtype):
    """The check compares dMask too: trifuse passes; no mask gradient, or a wrong one, does not."""
    q, k, v = qkv(b=2, h=4, h_kv=2, s=20, sk=27, dtype=dtype)
    bias = torch.randn(1, 4, 20, 27, device=DEVICE, dtype=dtype, requires_grad=True)
    args = call(q, k, v, bias, 0.0, False, None, True)
    assert A._attention_check(A._attention_trifuse, args) is None
    assert A._attention_check(_detached_mask, args) == "dmask is missing"
    assert A._attention_check(_scaled_mask_grad, args).startswith("dmask max error")
    assert A._attention_check(_detached_mask, call(q, k, v, bias.detach(), 0.0, False, None, True)) is None


def test_a_candidate_without_the_mask_gradient_is_rejected(cache_dir, timer):
    d = plumbing(Candidate("no-mask-grad", _detached_mask, deterministic=False))
    d.timer = timer({"trifuse": 2.0, "no-mask-grad": 1.0})
    q, k, v = qkv(s=20)
    bias = torch.randn(1, 2, 20, 20, device=DEVICE, requires_grad=True)
    d(*call(q, k, v, bias))
    rec = d.explain(*call(q, k, v, bias))
    assert rec.chosen == "trifuse" and rec.rejected["no-mask-grad"] == "wrong result: dmask is missing"
    assert ",mask=3," in rec.bucket


def test_check_with_dropout_passes_trifuse():
    assert A._attention_check(A._attention_trifuse, call(*qkv(s=20), dropout_p=0.3, is_causal=True)) is None


def test_check_with_dropout_rejects_a_candidate_that_ignores_it():
    def no_dropout(q, k, v, m, p, c, s, g):
        return A._attention_trifuse(q, k, v, m, 0.0, c, s, g)
    problem = A._attention_check(no_dropout, call(*qkv(s=20), dropout_p=0.3))
    assert problem == "dropout check: the output at dropout_p=0.3 equals the one at 0"


def test_check_with_dropout_rejects_a_candidate_that_is_not_repeatable():
    draws = iter(range(1, 100))

    def own_rng(q, k, v, m, p, c, s, g):
        torch.manual_seed(next(draws))  # ignores the RNG state it was given
        return A._attention_trifuse(q, k, v, m, p, c, s, g)
    problem = A._attention_check(own_rng, call(*qkv(s=20), dropout_p=0.3))
    assert problem == "dropout check: output is not repeatable from the same RNG state"


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _dq_scaled_per_run(factors):
    """A candidate computing trifuse's attention whose dq is scaled by the next factor each call
    (the check's three calls: at p = 0, then twice from one RNG state)."""
    it = iter(factors)

    def fn(q, k, v, m, p, c, s, g):
        return A._attention_trifuse(_ScaledGradient.apply(q, next(it)), k, v, m, p, c, s, g)
    return fn


def test_check_with_dropout_takes_gradients_that_differ_by_rounding():
    """A backward that sums dQ with atomics (SDPA's, flash-attn's) gives gradients that differ
    in the last bits between two runs from one RNG state: still repeatable."""
    ulp = torch.finfo(torch.float32).eps
    args = call(*qkv(s=20), dropout_p=0.3, is_causal=True)
    assert A._attention_check(_dq_scaled_per_run([1.0, 1.0, 1.0 + 2 * ulp]), args) is None


def test_check_with_dropout_rejects_gradients_that_differ_beyond_rounding():
    """A backward whose gradient changes between two runs from one RNG state (a mask drawn
    anew in the backward does) is not repeatable."""
    args = call(*qkv(s=20), dropout_p=0.3, is_causal=True)
    problem = A._attention_check(_dq_scaled_per_run([1.0, 1.0, 1.001]), args)
    assert problem.startswith("dropout check: dq is not repeatable from the same RNG state (max difference")


def test_check_with_dropout_still_checks_p0_first():
    def wrong_at_0(q, k, v, m, p, c, s, g):
        return A._attention_trifuse(q, k, v, m, p, c, s, g) * 1.01
    problem = A._attention_check(wrong_at_0, call(*qkv(s=20), dropout_p=0.3))
    assert problem.startswith("output at dropout_p=0 max error")


def test_check_without_grad_compares_outputs_only():
    q, k, v = qkv(s=20, grad=False)
    assert A._attention_check(A._attention_trifuse, call(q, k, v, is_causal=True)) is None


# ---------------------------------------------------------------------------------------------
# Decisions: plumbing with fake timings, replay, rejection, determinism, fallback
# ---------------------------------------------------------------------------------------------


def test_untimed_default_is_trifuse_and_bitwise_equal_to_the_registered_op(attn_dialect, monkeypatch):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    args = call(*qkv(s=20), is_causal=True)
    got = fwd_bwd(lambda *a: trifuse.ops.attention(*a), args)
    want = fwd_bwd(registered, args)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = attn_dialect.explain(*args)
    assert rec.chosen == "trifuse" and rec.source.startswith("default")


@pytest.mark.skipif(ON_GPU, reason="on the GPU several are eligible")
def test_only_trifuse_eligible_on_cpu_is_kept_without_timing(attn_dialect, timer, monkeypatch):
    fake = timer({})
    monkeypatch.setattr(attn_dialect, "timer", fake)
    args = call(*qkv(s=20), is_causal=True)
    trifuse.ops.attention(*args[:3], is_causal=True)
    rec = attn_dialect.explain(*args)
    assert rec.chosen == "trifuse" and rec.source == "only eligible candidate" and fake.calls == []
    assert set(rec.rejected) == set(ALL_NAMES[1:])


@pytest.mark.parametrize("winner", ["trifuse", "stand-in"])
def test_the_measured_winner_runs_and_is_replayed(cache_dir, timer, winner):
    d = plumbing(Candidate("stand-in", math_attention, deterministic=False))
    fake = timer({"trifuse": 1.0, "stand-in": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "stand-in": 1.0})
    d.timer = fake
    args = call(*qkv(s=20), is_causal=True)
    got = fwd_bwd(d, args)
    want = fwd_bwd(A._attention_trifuse if winner == "trifuse" else math_attention, args)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = d.explain(*args)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "stand-in"}
    assert rec.bucket == "dtype=float32,batch_heads=2,h_kv=0,sq=32,sk=32,d=16,causal=1,mask=0,dropout=False,grad=True,dv=16"
    fwd_bwd(d, call(*qkv(s=30), is_causal=True))  # same buckets: replayed, nothing timed
    assert len(fake.calls) == 2


def test_the_check_computes_its_references_once_per_measured_call(cache_dir, timer, monkeypatch):
    """Three candidates checked on one call: the float64 reference and the one in the inputs'
    dtype are computed once for all of them (dialects.shared_by_checks), not once per candidate; a
    second call in a new bucket computes them again; the check called outside a measurement
    computes them each time."""
    computed = []
    blocks = A._reference_blocks

    def counting(args, dtype, dy, train):
        computed.append(dtype)
        return blocks(args, dtype, dy, train)
    monkeypatch.setattr(A, "_reference_blocks", counting)
    d = plumbing(Candidate("stand-in", math_attention, deterministic=False),
                 Candidate("stand-in-2", math_attention, deterministic=False))
    d.timer = timer({"trifuse": 2.0, "stand-in": 1.0, "stand-in-2": 3.0})
    fwd_bwd(d, call(*qkv(s=20), is_causal=True))
    assert d.explain(*call(*qkv(s=20), is_causal=True)).chosen == "stand-in"
    assert computed == [torch.float64, torch.float32]
    fwd_bwd(d, call(*qkv(s=40), is_causal=True))  # another bucket: measured, referenced anew
    assert computed == [torch.float64, torch.float32] * 2
    args = call(*qkv(s=12))
    assert A._attention_check(math_attention, args) is None
    assert A._attention_check(math_attention, args) is None
    assert len(computed) == 8


def test_trifuse_far_behind_at_default_configs_leaves_its_kernels_untuned(cache_dir, timer, monkeypatch):
    """Screening with the real kernels: forward, dK/dV and dQ run at their default configs while
    trifuse is checked and timed; at 3x the stand-in's time it is not tuned, and no attention
    tuner has timed a config or decided anything, nor any launch plan been kept."""
    kernel_timer = timer({})
    for kind, tuner in A._TUNERS.items():
        space = tuner.configs
        # two configs (the interpreter's one, and it at other warps), as a GPU's space has several
        monkeypatch.setattr(tuner, "configs", lambda space=space, **kw: [
            *space(**kw), *(triton.Config(c.kwargs, num_warps=2 * c.num_warps) for c in space(**kw))])
        monkeypatch.setattr(tuner, "timer", kernel_timer)
        monkeypatch.setattr(tuner, "_memo", {})
        monkeypatch.setattr(tuner, "_untuned", {})
    monkeypatch.setattr(A, "_FWD_PLANS", {})
    monkeypatch.setattr(A, "_BWD_PLANS", {})
    d = plumbing(Candidate("stand-in", math_attention, deterministic=False))
    d.timer = timer({"trifuse": 3.0, "stand-in": 1.0})
    args = call(*qkv(s=20), is_causal=True)
    fwd_bwd(d, args)
    rec = d.explain(*args)
    assert rec.chosen == "stand-in" and rec.times_ms == {"trifuse": 3.0, "stand-in": 1.0}
    assert rec.source.endswith("not tuned, over 2x the fastest at default configs: trifuse")
    assert kernel_timer.calls == [] and not A._FWD_PLANS and not A._BWD_PLANS
    assert {kind for kind, t in A._TUNERS.items() if t._untuned} >= {"fwd", "dkdv", "dq"}
    assert not any(t._memo for t in A._TUNERS.values())


def test_rejections_name_their_reason(cache_dir, timer):
    def raises(*args):
        raise RuntimeError("no kernel image for this GPU")

    d = plumbing(
        Candidate("wrong", lambda *a: A._attention_trifuse(*a) * 1.01, deterministic=False),
        Candidate("raises", raises, deterministic=False),
        Candidate("unsupported", math_attention, supports=lambda *a: "takes no causal mask"),
        Candidate("missing", math_attention, requires=("trifuse_no_such_attention_lib",)),
        Candidate("stand-in", math_attention, deterministic=False),
    )
    d.timer = timer({"trifuse": 2.0, "stand-in": 1.0})
    args = call(*qkv(s=20), is_causal=True)
    d(*args)
    rec = d.explain(*args)
    assert rec.chosen == "stand-in" and set(rec.times_ms) == {"trifuse", "stand-in"}
    assert rec.rejected["wrong"].startswith("wrong result: output max error")
    assert "no kernel image for this GPU" in rec.rejected["raises"]
    assert rec.rejected["unsupported"] == "takes no causal mask"
    assert rec.rejected["missing"].startswith("trifuse_no_such_attention_lib is not installed")
    assert "stand-in" in str(rec) and "wrong rejected" in str(rec)


def test_dropout_candidates_that_cannot_be_checked_are_rejected(cache_dir, timer):
    def no_dropout(q, k, v, m, p, c, s, g):
        return A._attention_trifuse(q, k, v, m, 0.0, c, s, g)

    d = plumbing(Candidate("ignores-dropout", no_dropout, deterministic=False))
    d.timer = timer({"trifuse": 2.0, "ignores-dropout": 1.0})
    args = call(*qkv(s=20), dropout_p=0.25, is_causal=True)
    d(*args)
    rec = d.explain(*args)
    assert rec.chosen == "trifuse" and rec.bucket.endswith("dropout=True,grad=True,dv=16")
    assert rec.rejected["ignores-dropout"] == "wrong result: dropout check: the output at dropout_p=0.25 equals the one at 0"


def test_tuning_leaves_a_seeded_dropout_run_unchanged(cache_dir, timer):
    d = plumbing(Candidate("stand-in", math_attention, deterministic=False))
    d.timer = timer({"trifuse": 1.0, "stand-in": 2.0})
    q, k, v = qkv(s=20)
    torch.manual_seed(5)
    tuned = d(q, k, v, None, 0.2, False, None, False)
    torch.manual_seed(5)
    replayed = d(q, k, v, None, 0.2, False, None, False)
    assert torch.equal(tuned, replayed)


def test_deterministic_mode_keeps_only_deterministic_candidates(cache_dir, timer):
    d = plumbing(Candidate("stand-in", math_attention, deterministic=False))
    d.timer = timer({"trifuse": 2.0, "stand-in": 1.0})
    args = call(*qkv(s=20), is_causal=True)
    torch.use_deterministic_algorithms(True)
    try:
        d(*args)
        rec = d.explain(*args)
    finally:
        torch.use_deterministic_algorithms(False)
    assert rec.chosen == "trifuse" and rec.bucket.endswith(",deterministic")
    assert rec.rejected["stand-in"].startswith("not deterministic")


def test_a_chosen_sdpa_backend_falls_back_per_call_with_a_reason(attn_dialect, monkeypatch):
    """A call whose key chose an SDPA backend but that breaks the backend's per-call rules (here:
    torch says no, as it does on a CPU) runs trifuse's kernels, bitwise, and the reason is kept."""
    args = call(*qkv(d=64, dtype=torch.float16, s=16), is_causal=True)
    key = A._attention_key(*args)
    sdpa = A.ATTENTION.candidate("sdpa-flash")
    monkeypatch.setattr(A, "_sdpa_call_problem", lambda *a: "the last dim is not contiguous")
    attn_dialect._memo[key] = sdpa.fn  # as if measured fastest for this key
    got = fwd_bwd(lambda *a: trifuse.ops.attention(*a), args)
    want = fwd_bwd(A._attention_trifuse, args)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    assert A.FALLBACKS == {("sdpa-flash", "the last dim is not contiguous"): 1}


def test_sdpa_backend_flags_are_restored(monkeypatch):
    """The forced backend is set for the call and the flags come back as they were, also when
    SDPA raises."""
    monkeypatch.setattr(A, "_sdpa_call_problem", lambda *a: None)
    before = tuple(getattr(torch.backends.cuda, f"{f}_sdp_enabled")() for f in A._SDPA_FLAGS)
    seen = []

    def fake_sdpa(*a, **kw):
        seen.append(tuple(getattr(torch.backends.cuda, f"{f}_sdp_enabled")() for f in A._SDPA_FLAGS))
        raise RuntimeError("boom")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake_sdpa)
    for name, only in (("sdpa-flash", 0), ("sdpa-efficient", 1), ("sdpa-cudnn", 3)):
        with pytest.raises(RuntimeError, match="boom"):
            A._sdpa_fn(name)(*call(*qkv(s=4, grad=False)))
        assert seen[-1] == tuple(i == only for i in range(4))
        assert tuple(getattr(torch.backends.cuda, f"{f}_sdp_enabled")() for f in A._SDPA_FLAGS) == before


def test_traced_calls_keep_the_registered_op(attn_dialect):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q, k, v = qkv(s=8)
    fn = torch.compile(lambda q, k, v: trifuse.ops.attention(q, k, v, is_causal=True), backend=backend,
                       fullgraph=True)
    out = fn(q, k, v)
    assert "trifuse.attention" in str(graphs[0].graph)
    assert torch.equal(out, registered(*call(q, k, v, is_causal=True)))


def test_bad_input_still_raises_trifuse_errors(attn_dialect):
    q, k, v = qkv(s=8)
    with pytest.raises(ValueError, match="attention: query must be 4-D"):
        trifuse.ops.attention(q[0], k, v)
    with pytest.raises(TypeError, match="attention: query, key and value must share one dtype"):
        trifuse.ops.attention(q, k.double(), v)


def test_explain_is_reachable_by_op_name(attn_dialect, timer, monkeypatch):
    monkeypatch.setattr(attn_dialect, "timer", timer({}))
    args = call(*qkv(s=20), is_causal=True)
    trifuse.ops.attention(*args[:3], is_causal=True)
    assert dialects.explain("attention", *args).chosen in ALL_NAMES
    assert [d.chosen for d in dialects.explain("attention")]


# ---------------------------------------------------------------------------------------------
# GPU: every real candidate, checked and run
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    dict(shape=(2, 4, 128, 64), is_causal=True),
    dict(shape=(2, 4, 100, 128), is_causal=False),
    dict(shape=(1, 8, 257, 64), is_causal=True, h_kv=2),
    dict(shape=(2, 4, 64, 64), mask="bool"),
    dict(shape=(2, 4, 64, 80), mask="float"),
    dict(shape=(2, 4, 64, 64), mask="float-grad"),  # T5's position bias: the check compares dMask
]


def _gpu_args(case, dtype, dropout_p=0.0):
    b, h, s, d = case["shape"]
    q, k, v = qkv(b, h, s, d, dtype=dtype, h_kv=case.get("h_kv"))
    mask = None
    if case.get("mask") == "bool":
        mask = torch.rand(b, 1, 1, s, device=DEVICE) > 0.2
    elif case.get("mask") == "float":
        mask = torch.randn(b, 1, s, s, device=DEVICE, dtype=dtype)
    elif case.get("mask") == "float-grad":
        mask = torch.randn(1, h, s, s, device=DEVICE, dtype=dtype, requires_grad=True)
    return call(q, k, v, mask, dropout_p, case.get("is_causal", False), None, "h_kv" in case)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_gpu_every_candidate_that_takes_a_call_passes_the_check(name, dtype, case):
    _check_unless_rejected(name, _gpu_args(GPU_CASES[case], dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL_NAMES)
def test_gpu_dropout_check_of_every_candidate(name):
    _check_unless_rejected(name, _gpu_args(GPU_CASES[0], torch.bfloat16, dropout_p=0.2))


def _check_unless_rejected(name: str, args: tuple) -> None:
    """The candidate passes the dialect's check on `args`, or the test skips with its reason."""
    cand = A.ATTENTION.candidate(name)
    reason = cand.rejection(args, False)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    assert A._attention_check(cand.fn, args) is None


@pytest.mark.gpu
def test_gpu_sdpa_flash_falls_back_on_a_call_torch_refuses(attn_dialect):
    """A head-dim stride that is not 1: can_use_flash_attention says no (with its warning's
    reason), and trifuse runs the call."""
    q, k, v = qkv(2, 4, 64, 64, dtype=torch.bfloat16)
    qs = q.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
    problem = A._sdpa_call_problem("sdpa-flash", qs, k, v, None, 0.0, True, False)
    assert problem is not None and problem.startswith("torch.backends.cuda.can_use_flash_attention is False")
    out = A.ATTENTION.candidate("sdpa-flash").fn(*call(qs, k, v, is_causal=True))
    assert torch.equal(out, A._attention_trifuse(*call(qs, k, v, is_causal=True)))
    assert any(name == "sdpa-flash" for name, _ in A.FALLBACKS)


@pytest.mark.gpu
def test_gpu_dialect_measures_and_replays(attn_dialect):
    args = _gpu_args(GPU_CASES[0], torch.bfloat16)
    trifuse.ops.attention(*args)
    rec = attn_dialect.explain(*args)
    assert rec.source.startswith(("measured", "disk cache")) and rec.chosen in rec.times_ms
    assert "trifuse" in rec.times_ms


COLD_CHOICE = """
import json, threading, torch, triton
compile_one = triton.compiler.compile
threads = []

def compile_spy(*args, **kwargs):  # which thread compiles (a JITFunction binds it at first use)
    threads.append(threading.current_thread().name)
    return compile_one(*args, **kwargs)

triton.compiler.compile = compile_spy
import trifuse
from trifuse.kernels import attention as A

q, k, v = (torch.randn(2, 4, 320, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
trifuse.ops.attention(q, k, v, dropout_p=0.1, is_causal=True).sum().backward()
rec = A.ATTENTION.explain(q, k, v, None, 0.1, True, None, False)
print(json.dumps({"threads": threads, "source": rec.source, "phases": rec.phases, "times": rec.times_ms}))
"""


@pytest.mark.gpu
def test_gpu_a_cold_choice_compiles_its_candidates_kernels_together(tmp_path):
    """A fresh process with empty Triton and trifuse caches (a user's first step): every Triton
    compile of the attention choice (trifuse's forward and backward, with and without dropout, and
    any tuning) happens in the compile pool ahead of the checks, none one after another on the
    calling thread (`dialects._compile_first`)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRIFUSE_AUTOTUNE")}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), TRIFUSE_CACHE_DIR=str(tmp_path / "trifuse"))
    run = subprocess.run([sys.executable, "-c", COLD_CHOICE], env=env, capture_output=True, text=True, check=False,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["source"].startswith("measured") and "trifuse" in out["times"], out
    assert out["threads"], "nothing compiled: the caches were not empty"
    serial = [t for t in out["threads"] if not t.startswith("trifuse-compile")]
    assert not serial, f"{len(serial)} of {len(out['threads'])} compiles on the calling thread; {out}"


@pytest.mark.gpu
def test_gpu_sdpa_keeps_fp32_under_autocast():
    args = _gpu_args(GPU_CASES[0], torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = A.ATTENTION.candidate("sdpa-efficient").fn(*args)
    assert out.dtype == torch.float32


def test_sinks_and_softcap_calls_bypass_the_dialect(attn_dialect, monkeypatch):
    """SDPA's backends, flash-attn (2) and xformers take neither attention sinks nor a soft cap:
    such calls run trifuse's kernels without consulting the dialect (no decision is made)."""
    def consulted(*args):
        raise AssertionError("the attention dialect was consulted")

    monkeypatch.setattr(Dialect, "__call__", consulted)
    before = dialects.records("attention", kind="dialect")
    q, k, v = qkv()
    sinks = torch.randn(2, device=DEVICE, requires_grad=True)
    out = trifuse.ops.attention(q, k, v, is_causal=True, sinks=sinks)
    torch.testing.assert_close(out, A.attention_ref(q, k, v, is_causal=True, sinks=sinks))
    out.sum().backward()
    assert sinks.grad is not None
    trifuse.ops.attention(q, k, v, softcap=2.0)
    assert dialects.records("attention", kind="dialect") == before
