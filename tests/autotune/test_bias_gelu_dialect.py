"""The bias_gelu dialect wired into trifuse.ops.bias_gelu: trifuse's kernels or
F.gelu(x + bias, approximate=...) (QuickGELU written out for the quick form), chosen with a fake
timer here (on the GPU: measured). Whichever runs, the result is bitwise that implementation's, in
the form asked (erf, tanh or quick, never another); traced calls always see trifuse::bias_gelu;
the check rejects a wrong one."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import trifuse
from _device import DEVICE
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import bias_gelu as bg

N = 40
FORMS = ["none", "tanh", "quick", "relu", "relu2"]


@pytest.fixture
def gelu_dialect(cache_dir, monkeypatch):
    """The real bias_gelu dialect with its memory cleared before and after the test."""
    bg.BIAS_GELU.clear()
    monkeypatch.setattr(bg.BIAS_GELU, "timer", None)
    yield bg.BIAS_GELU
    bg.BIAS_GELU.clear()


def inputs(dtype=torch.float32, rows=5, bias_dtype=None):
    x = torch.randn(rows, N, device=DEVICE, dtype=dtype, requires_grad=True)
    b = torch.nn.Parameter(torch.randn(N, device=DEVICE, dtype=bias_dtype or dtype))
    return x, b


def fwd_bwd(fn, x, b, approximate):
    y = fn(x, b, approximate)
    gen = torch.Generator(device=y.device).manual_seed(1)
    dy = torch.randn(y.shape, generator=gen, device=y.device, dtype=y.dtype)
    return (y, *torch.autograd.grad(y, (x, b), dy))


def registered(x, b, approximate):
    return torch.ops.trifuse.bias_gelu(x, b, approximate)


def eager(x, b, approximate):
    """What PyTorch eager computes: F.gelu, transformers' QuickGELUActivation, torch.relu, or
    transformers' ReLUSquaredActivation."""
    z = x + b
    if approximate == "relu":
        return torch.relu(z)
    if approximate == "relu2":
        return torch.square(torch.relu(z))
    return z * torch.sigmoid(1.702 * z) if approximate == "quick" else F.gelu(z, approximate=approximate)


# ---------------------------------------------------------------------------------------------
# The key: cheap, a plain tuple, None where trifuse decides
# ---------------------------------------------------------------------------------------------


def test_key_is_a_small_tuple_of_plain_values():
    x, b = inputs(rows=7)
    device = -1 if DEVICE == "cpu" else 0
    assert bg._bias_gelu_key(x, b, "none") == (device, torch.float32, 8, N, torch.float32, "none", False, True)
    assert bg._bias_gelu_key(x, b, "none", 0.1)[6:] == (True, True)  # dropout: its own decision
    assert len(bg._bias_gelu_key(x, b, "none")) == len(bg.BIAS_GELU.key_names)
    # erf, tanh, quick and relu never share a decision
    assert [bg._bias_gelu_key(x, b, form)[5] for form in FORMS] == FORMS
    with torch.no_grad():
        assert bg._bias_gelu_key(x.view(7, 2, N // 2).transpose(0, 1), None, "none") == (
            device, torch.float32, 16, N // 2, None, "none", False, False)


@pytest.mark.parametrize("case", ["traced", "empty", "integer", "scalar", "bias shape", "approximate",
                                  "not a tensor"])
def test_key_is_none_where_trifuse_decides(case):
    x, b = inputs()
    if case == "traced":
        with FakeTensorMode():
            assert bg._bias_gelu_key(torch.empty(5, N), None, "none") is None
        return
    args = {"empty": (x[:0], b, "none"), "integer": (x.long(), None, "none"),
            "scalar": (x[0, 0], None, "none"), "bias shape": (x, b[:-1], "none"),
            "approximate": (x, b, "erf"), "not a tensor": (None, b, "none")}[case]
    assert bg._bias_gelu_key(*args) is None


KEY_CALLS = 25  # 17 today: a budget with room, that a string format or a loop would overrun


def test_key_is_a_few_dozen_calls(count_calls):
    # The key runs on every eager call (~1-2 µs when measured); counted, not timed.
    x, b = inputs()
    assert count_calls(bg._bias_gelu_key, x, b, "tanh") <= KEY_CALLS


# ---------------------------------------------------------------------------------------------
# The choice, its replay, and what every call sees
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("approximate", FORMS)
def test_untimed_default_is_trifuse_and_bitwise_equal_to_the_registered_op(gelu_dialect, monkeypatch, approximate):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    x, b = inputs()
    got, want = fwd_bwd(trifuse.ops.bias_gelu, x, b, approximate), fwd_bwd(registered, x, b, approximate)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    assert gelu_dialect.explain(x, b, approximate).chosen == "trifuse"


@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_the_measured_winner_runs_bitwise(gelu_dialect, timer, monkeypatch, winner, approximate):
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(gelu_dialect, "timer", fake)
    x, b = inputs()
    got = fwd_bwd(trifuse.ops.bias_gelu, x, b, approximate)
    want = fwd_bwd(registered if winner == "trifuse" else eager, x, b, approximate)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = gelu_dialect.explain(x, b, approximate)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    assert rec.bucket == f"dtype=float32,rows=8,n={N},bias=float32,form={approximate},dropout=False,grad=True"
    fwd_bwd(trifuse.ops.bias_gelu, *inputs(rows=7), approximate)  # same rows bucket: replayed
    assert len(fake.calls) == 2


def test_each_form_is_chosen_apart(gelu_dialect, timer, monkeypatch):
    monkeypatch.setattr(gelu_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, b = inputs()
    trifuse.ops.bias_gelu(x, b, "none")
    monkeypatch.setattr(gelu_dialect, "timer", timer({"trifuse": 1.0, "torch": 2.0}))
    trifuse.ops.bias_gelu(x, b, "tanh")
    monkeypatch.setattr(gelu_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    trifuse.ops.bias_gelu(x, b, "quick")
    assert gelu_dialect.explain(x, b, "none").chosen == "torch"
    assert gelu_dialect.explain(x, b, "tanh").chosen == "trifuse"
    assert gelu_dialect.explain(x, b, "quick").chosen == "torch"


@pytest.mark.parametrize("approximate", FORMS)
def test_with_dropout_only_trifuse_takes_the_call_and_nothing_is_timed(gelu_dialect, timer, monkeypatch,
                                                                       approximate):
    """PyTorch's dropout draws another mask and stores it: not the same op, never exchanged."""
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(gelu_dialect, "timer", fake)
    x, b = inputs()
    torch.manual_seed(3)
    got = fwd_bwd(lambda x, b, a: trifuse.ops.bias_gelu(x, b, a, p=0.3), x, b, approximate)
    torch.manual_seed(3)
    want = fwd_bwd(lambda x, b, a: torch.ops.trifuse.bias_gelu_dropout(x, b, a, 0.3)[0], x, b, approximate)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = gelu_dialect.explain(x, b, approximate, 0.3)
    assert (rec.chosen, rec.source, fake.calls) == ("trifuse", "only eligible candidate", [])
    assert "dropout" in rec.rejected["torch"] and rec.bucket.endswith("dropout=True,grad=True")
    y = trifuse.ops.bias_gelu(x, b, approximate, p=0.3, training=False)  # eval: no dropout, timed
    assert torch.equal(y, eager(x, b, approximate)) and set(fake.calls) == {"trifuse", "torch"}


def test_a_second_process_replays_the_choice_from_disk(gelu_dialect, timer, monkeypatch, new_process):
    monkeypatch.setattr(gelu_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, b = inputs()
    trifuse.ops.bias_gelu(x, b, "tanh")
    new_process()
    gelu_dialect.clear()
    second = timer({"trifuse": 1.0, "torch": 2.0})  # would choose trifuse if it timed anything
    monkeypatch.setattr(gelu_dialect, "timer", second)
    got = fwd_bwd(trifuse.ops.bias_gelu, x, b, "tanh")
    for a, e in zip(got, fwd_bwd(eager, x, b, "tanh")):
        assert torch.equal(a, e)
    rec = gelu_dialect.explain(x, b, "tanh")
    assert (rec.chosen, rec.source, second.calls) == ("torch", "disk cache", [])
    assert rec.times_ms == {"trifuse": 2.0, "torch": 1.0}


def test_compiled_graphs_keep_the_registered_op(gelu_dialect, timer, monkeypatch):
    monkeypatch.setattr(gelu_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, b = inputs()
    trifuse.ops.bias_gelu(x, b, "none")
    assert gelu_dialect.explain(x, b, "none").chosen == "torch"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda *a: trifuse.ops.bias_gelu(*a), backend=backend, fullgraph=True)(x, b, "none")
    assert "trifuse.bias_gelu" in str(graphs[0].graph)
    torch.testing.assert_close(out, eager(x, b, "none"))


def test_deterministic_mode_still_tunes(gelu_dialect, timer, monkeypatch):
    monkeypatch.setattr(gelu_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    torch.use_deterministic_algorithms(True)
    try:
        x, b = inputs()
        trifuse.ops.bias_gelu(x, b, "none")
        rec = gelu_dialect.explain(x, b, "none")
    finally:
        torch.use_deterministic_algorithms(False)
    assert rec.chosen == "torch" and rec.source == "measured" and rec.bucket.endswith(",deterministic")


# ---------------------------------------------------------------------------------------------
# The torch candidate: its form, its errors, its dtype
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("approximate", FORMS)
def test_torch_candidate_computes_the_form_asked(approximate):
    x, b = inputs()
    got = bg.BIAS_GELU.candidate("torch").fn(x, b, approximate)
    assert torch.equal(got, eager(x, b, approximate))
    for other in FORMS:
        if other != approximate:
            assert not torch.equal(got, eager(x, b, other))


@pytest.mark.parametrize("case", ["bias shape", "broadcastable bias", "approximate", "integer input",
                                  "bias not a tensor"])
def test_torch_candidate_raises_trifuse_errors(case):
    x = torch.randn(3, 8, device=DEVICE)
    args = {"bias shape": (x, torch.ones(5, device=DEVICE), "none"),
            "broadcastable bias": (x, torch.ones(1, device=DEVICE), "none"),  # F.gelu(x + b) would take it
            "approximate": (x, None, "erf"),
            "integer input": (x.long(), None, "none"),
            "bias not a tensor": (x, 1.0, "none")}[case]
    with pytest.raises((TypeError, ValueError)) as want:
        bg.BIAS_GELU.candidate("trifuse").fn(*args)
    with pytest.raises(want.type) as got:
        bg.BIAS_GELU.candidate("torch").fn(*args)
    assert str(got.value) == str(want.value) and "trifuse.bias_gelu" in str(got.value)


def test_bad_input_still_raises_trifuse_errors(gelu_dialect, timer, monkeypatch):
    monkeypatch.setattr(gelu_dialect, "timer", timer({}))
    with pytest.raises(ValueError, match="bias_gelu: bias must have shape"):
        trifuse.ops.bias_gelu(torch.ones(3, 8, device=DEVICE), torch.ones(5, device=DEVICE))
    with pytest.raises(ValueError, match="approximate must be 'none', 'tanh', 'quick', 'relu' or 'relu2'"):
        trifuse.ops.bias_gelu(torch.ones(3, 8, device=DEVICE), None, "erf")


@pytest.mark.parametrize("autocast", [False, True])
def test_torch_candidate_keeps_the_input_dtype_and_layout(autocast):
    """A 16-bit x with an fp32 bias (master weights) promotes x + bias; trifuse returns x's dtype,
    contiguous, and the choice between them must change neither, under autocast or not."""
    x = torch.randn(N, 3, device=DEVICE, dtype=torch.bfloat16).t()
    b = torch.randn(N, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        y = bg.BIAS_GELU.candidate("torch").fn(x, b, "tanh")
    assert y.dtype == torch.bfloat16 and y.is_contiguous()
    assert torch.equal(y, F.gelu(x.float() + b, approximate="tanh").bfloat16())


def test_torch_candidate_gradients_reach_an_fp32_bias_in_fp32():
    x, b = inputs(torch.float16, bias_dtype=torch.float32)
    y, dx, db = fwd_bwd(bg.BIAS_GELU.candidate("torch").fn, x, b, "none")
    assert (y.dtype, dx.dtype, db.dtype) == (torch.float16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", FORMS)
def test_check_passes_both_and_rejects_a_wrong_gelu(cache_dir, timer, dtype, approximate):
    """Negative control on the real op: a candidate without the bias must fail the check."""
    d = Dialect("bias_gelu_check", bg._bias_gelu_key, bg.BIAS_GELU.key_names, bg.bias_gelu_ref)
    for c in bg.BIAS_GELU.candidates:
        d.register(c)
    d.register(Candidate("no-bias", lambda x, b, approximate: bg.bias_gelu_ref(x, None, approximate)))
    d.timer = timer({})
    x, b = inputs(dtype, rows=33)
    d(x, b, approximate)
    rec = d.explain(x, b, approximate)
    assert set(rec.times_ms) == {"trifuse", "torch"}
    assert rec.rejected["no-bias"].startswith("wrong result: output 0")


@pytest.mark.parametrize("approximate, other", [("none", "tanh"), ("tanh", "none"), ("quick", "none"),
                                               ("none", "quick"), ("relu", "none"), ("relu2", "relu")])
def test_check_rejects_the_other_form(cache_dir, timer, approximate, other):
    """Negative control: one form for another (erf for tanh, erf for quick, ...) is a wrong
    result, not a faster one."""
    d = Dialect("bias_gelu_form_check", bg._bias_gelu_key, bg.BIAS_GELU.key_names, bg.bias_gelu_ref)
    d.register(bg.BIAS_GELU.candidate("trifuse"))
    d.register(Candidate("swapped", lambda x, b, approximate: eager(x, b, other)))
    d.timer = timer({"swapped": 0.1})
    x = torch.randn(64, N, device=DEVICE, requires_grad=True)
    b = torch.nn.Parameter(torch.randn(N, device=DEVICE))
    d(x, b, approximate)
    rec = d.explain(x, b, approximate)
    assert rec.chosen == "trifuse" and rec.rejected["swapped"].startswith("wrong result")


def test_explain_is_reachable_by_op_name(gelu_dialect, timer, monkeypatch):
    monkeypatch.setattr(gelu_dialect, "timer", timer({"trifuse": 1.0, "torch": 2.0}))
    x, b = inputs()
    trifuse.ops.bias_gelu(x, b, "tanh")
    assert dialects.explain("bias_gelu", x, b, "tanh").chosen == "trifuse"
    assert [d.chosen for d in dialects.explain("bias_gelu")] == ["trifuse"]


# ---------------------------------------------------------------------------------------------
# GPU: the real timer
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dialect_measures_and_replays(gelu_dialect, dtype, approximate):
    x = torch.randn(4096, 4096, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.nn.Parameter(torch.randn(4096, device="cuda", dtype=dtype))
    trifuse.ops.bias_gelu(x, b, approximate).sum().backward()
    rec = gelu_dialect.explain(x, b, approximate)
    assert rec.source.startswith(("measured", "disk cache")) and rec.chosen in rec.times_ms
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected


@pytest.mark.gpu
def test_gpu_torch_candidate_keeps_bf16_under_autocast_with_fp32_bias():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = bg.BIAS_GELU.candidate("torch").fn(x, b, "none")
        want = bg.BIAS_GELU.candidate("trifuse").fn(x, b, "none")
    assert y.dtype == want.dtype == torch.bfloat16


@pytest.mark.parametrize("candidate", ["trifuse", "torch"])
def test_check_passes_both_candidates_with_a_wider_bias_over_many_rows(candidate):
    """16-bit activations beside an fp32 bias (autocast's Linear/Conv1D bias): the bias gradient
    sums thousands of rows. Before the reference returned x's dtype, its output gradients were
    drawn in fp32 and the candidates saw them rounded to x's, so every candidate failed the check
    at GPT-2's rows on the H200."""
    x, b = inputs(torch.bfloat16, rows=3000, bias_dtype=torch.float32)
    trial = dialects._Trial(bg.BIAS_GELU.reference, (x, b, "tanh"), None)
    assert trial.problem(bg.BIAS_GELU.candidate(candidate).fn) is None
