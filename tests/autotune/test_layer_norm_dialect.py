"""The layer_norm dialect wired into trifuse.ops.layer_norm: trifuse's kernels or F.layer_norm,
chosen with a fake timer here (on the GPU: measured). Whichever runs, the result is bitwise that
implementation's; traced calls always see trifuse::layer_norm; the check rejects a wrong one."""
import pytest
import torch
import torch.nn.functional as F

import trifuse
from _device import DEVICE
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import layer_norm as ln

N = 48


@pytest.fixture
def ln_dialect(cache_dir, monkeypatch):
    """The real layer_norm dialect with its memory cleared before and after the test."""
    ln.LAYER_NORM.clear()
    monkeypatch.setattr(ln.LAYER_NORM, "timer", None)
    yield ln.LAYER_NORM
    ln.LAYER_NORM.clear()


def inputs(dtype=torch.float32, rows=5):
    x = torch.randn(rows, N, device=DEVICE, dtype=dtype, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(N, device=DEVICE, dtype=dtype))
    b = torch.nn.Parameter(torch.randn(N, device=DEVICE, dtype=dtype))
    return x, w, b


def fwd_bwd(fn, x, w, b):
    y = fn(x, (N,), w, b, 1e-5)
    gen = torch.Generator(device=y.device).manual_seed(1)
    dy = torch.randn(y.shape, generator=gen, device=y.device, dtype=y.dtype)
    return (y, *torch.autograd.grad(y, (x, w, b), dy))


def registered(x, ns, w, b, eps):
    return torch.ops.trifuse.layer_norm(x, list(ns), w, b, eps)[0]


def test_untimed_default_is_trifuse_and_bitwise_equal_to_the_registered_op(ln_dialect, monkeypatch):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    x, w, b = inputs()  # module weights (nn.Parameter) take the eager fast path too
    got, want = fwd_bwd(trifuse.ops.layer_norm, x, w, b), fwd_bwd(registered, x, w, b)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    assert ln_dialect.explain(x, (N,), w, b, 1e-5).chosen == "trifuse"


@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_the_measured_winner_runs_bitwise(ln_dialect, timer, monkeypatch, winner):
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(ln_dialect, "timer", fake)
    x, w, b = inputs()
    got = fwd_bwd(trifuse.ops.layer_norm, x, w, b)
    want = fwd_bwd(registered if winner == "trifuse" else F.layer_norm, x, w, b)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = ln_dialect.explain(x, (N,), w, b, 1e-5)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    assert rec.bucket == "dtype=float32,rows=8,n=48,weight=float32,bias=float32,grad=True"
    fwd_bwd(trifuse.ops.layer_norm, *inputs(rows=7))  # same rows bucket: replayed
    assert len(fake.calls) == 2


def test_compiled_graphs_keep_the_registered_op(ln_dialect, timer, monkeypatch):
    monkeypatch.setattr(ln_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, w, b = inputs()
    trifuse.ops.layer_norm(x, (N,), w, b)
    assert ln_dialect.explain(x, (N,), w, b, 1e-5).chosen == "torch"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda *a: trifuse.ops.layer_norm(*a), backend=backend, fullgraph=True)(x, (N,), w, b)
    assert "trifuse.layer_norm" in str(graphs[0].graph)
    torch.testing.assert_close(out, F.layer_norm(x, (N,), w, b))


class CastCountingTimer:
    """A fake timer that also counts, per candidate, the dtype casts (aten::_to_copy) of x's shape
    that one timed fwd+bwd step makes."""

    def __init__(self, ms: dict[str, float], shape: tuple[int, ...]):
        self.ms, self.shape, self.casts = ms, list(shape), {}

    def __call__(self, label, step):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        self.casts[label] = sum(e.name == "aten::_to_copy" and list(e.input_shapes[0]) == self.shape
                                for e in prof.events())
        return self.ms[label]


@pytest.mark.parametrize("readers, full_y, suffix", [(1, False, ""), (2, False, "x2"), (1, True, "+y")])
@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_a_narrowed_call_is_timed_with_the_casts_it_needs_and_chosen_apart(ln_dialect, monkeypatch, winner,
                                                                            readers, full_y, suffix):
    """y in fp16 for an fp32 x (what fuse asks under autocast): PyTorch's candidate casts y, once
    per reader, then (backward) each gradient back; the timed step must hold those casts, or the
    choice compares trifuse's whole work with a part of PyTorch's (the H200 chose F.layer_norm for
    GPT-2's ln_1 so). The choice is kept apart from the plain call's, and the winner runs."""
    x, w, b = inputs()
    fake = CastCountingTimer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else
                             {"trifuse": 2.0, "torch": 1.0}, tuple(x.shape))
    monkeypatch.setattr(ln_dialect, "timer", fake)
    out = trifuse.ops.layer_norm(x, (N,), w, b, out_dtype=torch.float16, readers=readers, full_y=full_y)
    outs = out if isinstance(out, tuple) else (out,)
    assert [o.dtype for o in outs] == [torch.float32] * full_y + [torch.float16] * readers
    assert fake.casts == {"trifuse": 0, "torch": 2 * readers}
    rec = ln_dialect.explain(x, (N,), w, b, 1e-5, torch.float16, readers, full_y)
    assert rec.chosen == winner and rec.source == "measured"
    assert rec.bucket == f"dtype=float32,rows=8,n=48,weight=float32,bias=float32,grad=True,out=float16{suffix}"
    assert ln_dialect.explain(x, (N,), w, b, 1e-5).source == "not decided yet"
    want = ln_dialect.candidate(winner).fn(x, (N,), w, b, 1e-5, torch.float16, readers, full_y)
    for got, expected in zip(outs, want if isinstance(want, tuple) else (want,)):
        assert torch.equal(got, expected)


def test_narrowing_arguments_are_checked_before_the_dialect(ln_dialect, timer, monkeypatch):
    monkeypatch.setattr(ln_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, w, b = inputs()
    with pytest.raises(TypeError, match="layer_norm: out_dtype must be a floating-point torch.dtype"):
        trifuse.ops.layer_norm(x, (N,), w, b, out_dtype=torch.int32, readers=2)
    with pytest.raises(ValueError, match="rms_norm: readers must be an int from 1 to 3"):
        trifuse.ops.rms_norm(x, (N,), w, out_dtype=torch.float16, readers=4)
    assert ln._layer_norm_key(x.double(), (N,), None, None, 1e-5, torch.float16) is None  # the oracle's dtype


def test_deterministic_mode_still_tunes(ln_dialect, timer, monkeypatch):
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(ln_dialect, "timer", fake)
    torch.use_deterministic_algorithms(True)
    try:
        x, w, b = inputs()
        trifuse.ops.layer_norm(x, (N,), w, b)
        rec = ln_dialect.explain(x, (N,), w, b, 1e-5)
    finally:
        torch.use_deterministic_algorithms(False)
    assert rec.chosen == "torch" and rec.source == "measured" and rec.bucket.endswith(",deterministic")


def test_torch_rejects_mixed_weight_dtypes_it_cannot_take(ln_dialect):
    x = torch.randn(3, N, device=DEVICE)
    w = torch.randn(N, device=DEVICE, dtype=torch.float16)
    rec = ln_dialect.explain(x, (N,), w, None, 1e-5)
    assert rec.rejected == {"torch": "F.layer_norm takes weight in torch.float32, got torch.float16"}


def test_torch_candidate_keeps_the_input_dtype_under_autocast(ln_dialect):
    """CUDA autocast runs F.layer_norm in fp32 and returns fp32; trifuse returns x's dtype, and
    the choice between them must not change the dtype."""
    x = torch.randn(3, N, device=DEVICE, dtype=torch.bfloat16)
    w, b = torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert ln_dialect.candidate("torch").fn(x, (N,), w, b, 1e-5).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_check_passes_both_and_rejects_a_wrong_layer_norm(cache_dir, timer, dtype):
    """Negative control for the check on the real op: LayerNorm with eps 1e-1 instead of 1e-5."""
    d = Dialect("layer_norm_check", ln._layer_norm_key, ln.LAYER_NORM.key_names, ln.layer_norm_ref)
    for c in ln.LAYER_NORM.candidates:
        d.register(c)
    d.register(Candidate("wrong-eps", lambda x, ns, w, b, eps: F.layer_norm(x, ns, w, b, 1e-1)))
    d.timer = timer({})
    x, w, b = inputs(dtype, rows=33)
    d(x, (N,), w, b, 1e-5)
    rec = d.explain(x, (N,), w, b, 1e-5)
    assert set(rec.times_ms) == {"trifuse", "torch"}
    assert rec.rejected["wrong-eps"].startswith("wrong result: output 0")


def test_bad_input_still_raises_trifuse_errors(ln_dialect, timer, monkeypatch):
    monkeypatch.setattr(ln_dialect, "timer", timer({}))
    with pytest.raises(ValueError, match="layer_norm: weight must have shape"):
        trifuse.ops.layer_norm(torch.ones(3, 8, device=DEVICE), (8,), torch.ones(5, device=DEVICE))


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("bad, exc, match", [
    (dict(weight=torch.ones(5)), ValueError, "weight must have shape"),
    (dict(weight=[1.0] * N), TypeError, "weight must be a torch.Tensor"),
    (dict(x=torch.ones(3, N, dtype=torch.int64)), TypeError, "input must be float16"),
    (dict(weight=torch.ones(N, dtype=torch.int64)), TypeError, "weight must be float16"),
    (dict(eps=-1e-5), ValueError, "eps must be a non-negative number"),
    (dict(eps=float("nan")), ValueError, "eps must be a non-negative number"),
])
def test_the_torch_candidate_raises_trifuse_errors(op, bad, exc, match):
    """The torch candidates run PyTorch first and trifuse's checks only when eps is off or PyTorch
    raised: the errors are still trifuse's (PyTorch would take a negative or NaN eps)."""
    fn = ln._layer_norm_torch if op == "layer_norm" else ln._rms_norm_torch
    args = {"x": torch.randn(3, N, device=DEVICE), "weight": torch.ones(N, device=DEVICE), "eps": 1e-5, **bad}
    if isinstance(args["weight"], torch.Tensor):
        args["weight"] = args["weight"].to(DEVICE)
    call = (args["x"].to(DEVICE), (N,), args["weight"], None, args["eps"])
    with pytest.raises(exc, match=f"trifuse.{op}: {match}"):
        fn(*call) if op == "layer_norm" else fn(call[0], call[1], call[2], call[4])


def test_explain_is_reachable_by_op_name(ln_dialect, timer, monkeypatch):
    monkeypatch.setattr(ln_dialect, "timer", timer({"trifuse": 1.0, "torch": 2.0}))
    x, w, b = inputs()
    trifuse.ops.layer_norm(x, (N,), w, b)
    assert dialects.explain("layer_norm", x, (N,), w, b, 1e-5).chosen == "trifuse"
    assert [d.chosen for d in dialects.explain("layer_norm")] == ["trifuse"]


def test_a_none_input_raises_trifuse_type_error(ln_dialect):
    """The key leaves a None input to trifuse's check (it used to fail on None.shape)."""
    assert ln._layer_norm_key(None, (8,), None, None, 1e-5) is None
    with pytest.raises(TypeError, match="layer_norm: input must be a torch.Tensor"):
        trifuse.ops.layer_norm(None, (8,))


KEY_CALLS = 24  # 16 or so today: a budget with room, that a string format or a loop would overrun


def test_key_is_a_few_dozen_calls(count_calls):
    # The key runs on every eager call (~1.5 µs when measured); counted, not timed.
    x = torch.randn(16, 32)
    w, b = torch.randn(32, requires_grad=True), torch.randn(32)
    assert count_calls(ln._layer_norm_key, x, (32,), w, b, 1e-5) <= KEY_CALLS
