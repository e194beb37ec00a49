"""The rms_norm dialect wired into trifuse.ops.rms_norm: trifuse's kernels or F.rms_norm, chosen
with a fake timer here (on the GPU: measured). Whichever runs, the result is bitwise that
implementation's; traced calls always see trifuse::rms_norm; the check rejects a wrong one."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import trifuse
from _device import DEVICE
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import layer_norm as ln

N = 48
EPS = 1e-6


@pytest.fixture
def rms_dialect(cache_dir, monkeypatch):
    """The real rms_norm dialect with its memory cleared before and after the test."""
    ln.RMS_NORM.clear()
    monkeypatch.setattr(ln.RMS_NORM, "timer", None)
    yield ln.RMS_NORM
    ln.RMS_NORM.clear()


def inputs(dtype=torch.float32, rows=5):
    x = torch.randn(rows, N, device=DEVICE, dtype=dtype, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(N, device=DEVICE, dtype=dtype))
    return x, w


def fwd_bwd(fn, x, w):
    y = fn(x, (N,), w, EPS)
    gen = torch.Generator(device=y.device).manual_seed(1)
    dy = torch.randn(y.shape, generator=gen, device=y.device, dtype=y.dtype)
    return (y, *torch.autograd.grad(y, (x, w), dy))


def registered(x, ns, w, eps):
    return torch.ops.trifuse.rms_norm(x, list(ns), w, eps)[0]


# ---------------------------------------------------------------------------------------------
# The key: cheap, a plain tuple, None where trifuse decides
# ---------------------------------------------------------------------------------------------


def test_key_is_a_small_tuple_of_plain_values():
    x, w = inputs(rows=7)
    assert ln._rms_norm_key(x, (N,), w, EPS) == (-1 if DEVICE == "cpu" else 0, torch.float32, 8, N, torch.float32, True)
    # The last name ("out") is a narrowed call's alone: plain calls keep their buckets.
    assert len(ln._rms_norm_key(x, (N,), w, EPS)) == len(ln.RMS_NORM.key_names) - 1
    assert ln._rms_norm_key(x, (N,), w, EPS, torch.bfloat16, 3)[-1] == "bfloat16x3"
    with torch.no_grad():
        assert ln._rms_norm_key(x, (N,), None, EPS)[-2:] == (None, False)
    assert ln._rms_norm_key(x.detach().view(7, 6, 8), (6, 8), w.view(6, 8), EPS)[3] == N


@pytest.mark.parametrize("case", ["traced", "empty", "shape", "weight", "not a tensor"])
def test_key_is_none_where_trifuse_decides(case):
    x, w = inputs()
    if case == "traced":
        with FakeTensorMode():
            assert ln._rms_norm_key(torch.empty(5, N), (N,), None, EPS) is None
        return
    args = {"empty": (x[:0], (N,), w, EPS), "shape": (x, (N + 1,), None, EPS),
            "weight": (x, (N,), w[:-1], EPS), "not a tensor": (None, (N,), None, EPS)}[case]
    assert ln._rms_norm_key(*args) is None


KEY_CALLS = 24  # 16 today: a budget with room, that a string format or a loop would overrun


def test_key_is_a_few_dozen_calls(count_calls):
    # The key runs on every eager call (~1-2 µs when measured); counted, not timed.
    x, w = inputs()
    args = (x, (N,), w, EPS)
    assert count_calls(ln._rms_norm_key, *args) <= KEY_CALLS


# ---------------------------------------------------------------------------------------------
# The choice, its replay, and what every call sees
# ---------------------------------------------------------------------------------------------


def test_untimed_default_is_trifuse_and_bitwise_equal_to_the_registered_op(rms_dialect, monkeypatch):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    x, w = inputs()
    got, want = fwd_bwd(trifuse.ops.rms_norm, x, w), fwd_bwd(registered, x, w)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    assert rms_dialect.explain(x, (N,), w, EPS).chosen == "trifuse"


@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_the_measured_winner_runs_bitwise(rms_dialect, timer, monkeypatch, winner):
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(rms_dialect, "timer", fake)
    x, w = inputs()
    got = fwd_bwd(trifuse.ops.rms_norm, x, w)
    want = fwd_bwd(registered if winner == "trifuse" else F.rms_norm, x, w)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = rms_dialect.explain(x, (N,), w, EPS)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    assert rec.bucket == "dtype=float32,rows=8,n=48,weight=float32,grad=True"
    fwd_bwd(trifuse.ops.rms_norm, *inputs(rows=7))  # same rows bucket: replayed
    assert len(fake.calls) == 2


def test_a_second_process_replays_the_choice_from_disk(rms_dialect, timer, monkeypatch, new_process):
    first = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(rms_dialect, "timer", first)
    x, w = inputs()
    trifuse.ops.rms_norm(x, (N,), w, EPS)
    new_process()
    rms_dialect.clear()
    second = timer({"trifuse": 1.0, "torch": 2.0})  # would choose trifuse if it timed anything
    monkeypatch.setattr(rms_dialect, "timer", second)
    got = fwd_bwd(trifuse.ops.rms_norm, x, w)
    for a, e in zip(got, fwd_bwd(F.rms_norm, x, w)):
        assert torch.equal(a, e)
    rec = rms_dialect.explain(x, (N,), w, EPS)
    assert (rec.chosen, rec.source, second.calls) == ("torch", "disk cache", [])
    assert rec.times_ms == {"trifuse": 2.0, "torch": 1.0}


def test_compiled_graphs_keep_the_registered_op(rms_dialect, timer, monkeypatch):
    monkeypatch.setattr(rms_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, w = inputs()
    trifuse.ops.rms_norm(x, (N,), w, EPS)
    assert rms_dialect.explain(x, (N,), w, EPS).chosen == "torch"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda *a: trifuse.ops.rms_norm(*a), backend=backend, fullgraph=True)(x, (N,), w, EPS)
    assert "trifuse.rms_norm" in str(graphs[0].graph)
    torch.testing.assert_close(out, F.rms_norm(x, (N,), w, EPS))


def test_the_residual_form_does_not_go_through_the_dialect(rms_dialect, timer, monkeypatch):
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(rms_dialect, "timer", fake)
    x, w = inputs()
    y, s = trifuse.ops.rms_norm(x, (N,), w, EPS, residual=torch.ones_like(x))
    assert fake.calls == [] and dialects.explain("rms_norm") == ()
    torch.testing.assert_close(s, x + 1)


def test_deterministic_mode_still_tunes(rms_dialect, timer, monkeypatch):
    monkeypatch.setattr(rms_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    torch.use_deterministic_algorithms(True)
    try:
        x, w = inputs()
        trifuse.ops.rms_norm(x, (N,), w, EPS)
        rec = rms_dialect.explain(x, (N,), w, EPS)
    finally:
        torch.use_deterministic_algorithms(False)
    assert rec.chosen == "torch" and rec.source == "measured" and rec.bucket.endswith(",deterministic")


# ---------------------------------------------------------------------------------------------
# The torch candidate: what it takes, its errors, its dtype
# ---------------------------------------------------------------------------------------------


def test_torch_rejects_mixed_weight_dtypes_it_cannot_take(rms_dialect):
    x = torch.randn(3, N, device=DEVICE)
    w = torch.randn(N, device=DEVICE, dtype=torch.float16)
    rec = rms_dialect.explain(x, (N,), w, EPS)
    assert rec.rejected == {"torch": "F.rms_norm takes weight in torch.float32, got torch.float16"}


def test_torch_says_why_without_f_rms_norm(rms_dialect, monkeypatch):
    """torch < 2.4 has no F.rms_norm: the candidate is skipped with a reason, trifuse runs."""
    monkeypatch.delattr(F, "rms_norm")
    x, w = inputs()
    rec = rms_dialect.explain(x, (N,), w, EPS)
    assert rec.chosen == "trifuse" and rec.rejected["torch"].startswith("F.rms_norm needs torch >= 2.4")


@pytest.mark.parametrize("case", ["weight shape", "negative eps", "integer input"])
def test_torch_candidate_raises_trifuse_errors(case):
    x = torch.randn(3, 8, device=DEVICE)
    args = {"weight shape": (x, (8,), torch.ones(5, device=DEVICE), EPS),
            "negative eps": (x, (8,), None, -1.0),
            "integer input": (x.long(), (8,), None, EPS)}[case]
    with pytest.raises((TypeError, ValueError)) as want:
        ln.RMS_NORM.candidate("trifuse").fn(*args)
    with pytest.raises(want.type) as got:
        ln.RMS_NORM.candidate("torch").fn(*args)
    assert str(got.value) == str(want.value) and "trifuse.rms_norm" in str(got.value)


def test_bad_input_still_raises_trifuse_errors(rms_dialect, timer, monkeypatch):
    monkeypatch.setattr(rms_dialect, "timer", timer({}))
    with pytest.raises(ValueError, match="rms_norm: weight must have shape"):
        trifuse.ops.rms_norm(torch.ones(3, 8, device=DEVICE), (8,), torch.ones(5, device=DEVICE))
    with pytest.raises(TypeError, match="rms_norm: input must be a torch.Tensor"):
        trifuse.ops.rms_norm(None, (8,))


def test_torch_candidate_keeps_the_input_dtype_under_autocast(rms_dialect):
    x = torch.randn(3, N, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(N, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert ln.RMS_NORM.candidate("torch").fn(x, (N,), w, EPS).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_check_passes_both_and_rejects_a_wrong_rms_norm(cache_dir, timer, dtype):
    """Negative control for the check on the real op: RMSNorm with eps 1e-1 instead of 1e-6."""
    d = Dialect("rms_norm_check", ln._rms_norm_key, ln.RMS_NORM.key_names, ln.rms_norm_ref)
    for c in ln.RMS_NORM.candidates:
        d.register(c)
    d.register(Candidate("wrong-eps", lambda x, ns, w, eps: F.rms_norm(x, ns, w, 1e-1)))
    d.timer = timer({})
    x, w = inputs(dtype, rows=33)
    d(x, (N,), w, EPS)
    rec = d.explain(x, (N,), w, EPS)
    assert set(rec.times_ms) == {"trifuse", "torch"}
    assert rec.rejected["wrong-eps"].startswith("wrong result: output 0")


def test_reference_resolves_eps_as_the_op():
    """eps None is PyTorch's default: the epsilon of the dtype it computes in (fp32 for fp16 x)."""
    x = torch.randn(4, N, dtype=torch.float16) * 0.01
    assert torch.equal(ln.rms_norm_ref(x, (N,)), F.rms_norm(x, (N,), None, None))
    assert torch.equal(ln.rms_norm_ref(x, (N,)), F.rms_norm(x, (N,), None, torch.finfo(torch.float32).eps))


def test_nn_rms_norm_calls_are_captured_with_eps_resolved():
    (module_type, to_args), = ln.RMS_NORM.captures
    m = torch.nn.RMSNorm(N)
    x = torch.randn(2, N, dtype=torch.float16)
    assert module_type is torch.nn.RMSNorm
    assert to_args(m, x) == (x, (N,), m.weight, torch.finfo(torch.float32).eps)


def test_explain_is_reachable_by_op_name(rms_dialect, timer, monkeypatch):
    monkeypatch.setattr(rms_dialect, "timer", timer({"trifuse": 1.0, "torch": 2.0}))
    x, w = inputs()
    trifuse.ops.rms_norm(x, (N,), w, EPS)
    assert dialects.explain("rms_norm", x, (N,), w, EPS).chosen == "trifuse"
    assert [d.chosen for d in dialects.explain("rms_norm")] == ["trifuse"]


# ---------------------------------------------------------------------------------------------
# GPU: the real timer
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dialect_measures_and_replays(rms_dialect, dtype):
    x = torch.randn(4096, 1024, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(1024, device="cuda", dtype=dtype))
    trifuse.ops.rms_norm(x, (1024,), w, EPS).sum().backward()
    rec = rms_dialect.explain(x, (1024,), w, EPS)
    assert rec.source.startswith(("measured", "disk cache")) and rec.chosen in rec.times_ms
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected


@pytest.mark.gpu
def test_gpu_torch_candidate_keeps_bf16_under_autocast_with_fp32_weight():
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = ln.RMS_NORM.candidate("torch").fn(x, (1024,), w, EPS)
        want = ln.RMS_NORM.candidate("trifuse").fn(x, (1024,), w, EPS)
    assert y.dtype == want.dtype == torch.bfloat16
