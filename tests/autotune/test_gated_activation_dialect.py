"""The gated_activation dialect wired into trifuse.ops.gated_activation: trifuse's kernels or
PyTorch's act(gate) * up, chosen with a fake timer here (on the GPU: measured). Whichever runs, the
result is bitwise that implementation's, with the activation asked (never another); traced calls
always see trifuse::gated_activation; the check rejects a wrong one."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import trifuse
from _device import DEVICE
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import gated_activation as ga

N = 40
ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "relu", "relu2"]


@pytest.fixture
def gated_dialect(cache_dir, monkeypatch):
    """The real gated_activation dialect with its memory cleared before and after the test."""
    ga.GATED_ACTIVATION.clear()
    monkeypatch.setattr(ga.GATED_ACTIVATION, "timer", None)
    yield ga.GATED_ACTIVATION
    ga.GATED_ACTIVATION.clear()


def inputs(dtype=torch.float32, rows=5):
    gate = torch.randn(rows, N, device=DEVICE, dtype=dtype, requires_grad=True)
    up = torch.randn(rows, N, device=DEVICE, dtype=dtype, requires_grad=True)
    return gate, up


def fwd_bwd(fn, gate, up, activation):
    y = fn(gate, up, activation)
    gen = torch.Generator(device=y.device).manual_seed(1)
    dy = torch.randn(y.shape, generator=gen, device=y.device, dtype=y.dtype)
    return (y, *torch.autograd.grad(y, (gate, up), dy))


def registered(gate, up, activation):
    return torch.ops.trifuse.gated_activation(gate, up, activation)


def eager(gate, up, activation):
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "relu": torch.relu,
           "relu2": lambda g: torch.square(torch.relu(g))}[activation]
    return act(gate) * up


# ---------------------------------------------------------------------------------------------
# The key: cheap, a plain tuple, None where trifuse decides
# ---------------------------------------------------------------------------------------------


def test_key_is_a_small_tuple_of_plain_values():
    gate, up = inputs(rows=7)
    device = -1 if DEVICE == "cpu" else 0
    assert ga._gated_activation_key(gate, up, "silu") == (device, torch.float32, 8, N, "silu", False, True)
    assert ga._gated_activation_key(gate, up, "silu", 0.1)[5:] == (True, True)  # dropout: its own decision
    assert len(ga._gated_activation_key(gate, up, "silu")) == len(ga.GATED_ACTIVATION.key_names)
    assert ga._gated_activation_key(gate, up, "gelu")[4] == "gelu"  # activations never share a decision
    with torch.no_grad():
        halves = torch.randn(7, 2 * N, device=DEVICE).chunk(2, dim=-1)
        assert ga._gated_activation_key(*halves, "gelu_tanh") == (device, torch.float32, 8, N, "gelu_tanh", False, False)


@pytest.mark.parametrize("case", ["traced", "empty", "integer", "scalar", "up shape", "up dtype", "activation",
                                  "not a tensor"])
def test_key_is_none_where_trifuse_decides(case):
    gate, up = inputs()
    if case == "traced":
        with FakeTensorMode():
            assert ga._gated_activation_key(torch.empty(5, N), torch.empty(5, N), "silu") is None
        return
    args = {"empty": (gate[:0], up[:0], "silu"), "integer": (gate.long(), up.long(), "silu"),
            "scalar": (gate[0, 0], up[0, 0], "silu"), "up shape": (gate, up[:, :1], "silu"),
            "up dtype": (gate, up.double(), "silu"), "activation": (gate, up, "swish"),
            "not a tensor": (None, up, "silu")}[case]
    assert ga._gated_activation_key(*args) is None


KEY_CALLS = 25  # a budget with room, that a string format or a loop would overrun


def test_key_is_a_few_dozen_calls(count_calls):
    # The key runs on every eager call; counted, not timed.
    gate, up = inputs()
    assert count_calls(ga._gated_activation_key, gate, up, "gelu_tanh") <= KEY_CALLS


# ---------------------------------------------------------------------------------------------
# The choice, its replay, and what every call sees
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_untimed_default_is_trifuse_and_bitwise_equal_to_the_registered_op(gated_dialect, monkeypatch, activation):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    gate, up = inputs()
    got = fwd_bwd(trifuse.ops.gated_activation, gate, up, activation)
    for a, e in zip(got, fwd_bwd(registered, gate, up, activation)):
        assert torch.equal(a, e)
    assert gated_dialect.explain(gate, up, activation).chosen == "trifuse"


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_the_measured_winner_runs_bitwise(gated_dialect, timer, monkeypatch, winner, activation):
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(gated_dialect, "timer", fake)
    gate, up = inputs()
    got = fwd_bwd(trifuse.ops.gated_activation, gate, up, activation)
    want = fwd_bwd(registered if winner == "trifuse" else eager, gate, up, activation)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = gated_dialect.explain(gate, up, activation)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    assert rec.bucket == f"dtype=float32,rows=8,n={N},activation={activation},dropout=False,grad=True"
    fwd_bwd(trifuse.ops.gated_activation, *inputs(rows=7), activation)  # same rows bucket: replayed
    assert len(fake.calls) == 2


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_with_dropout_only_trifuse_takes_the_call_and_nothing_is_timed(gated_dialect, timer, monkeypatch,
                                                                       activation):
    """PyTorch's dropout draws another mask and stores it: not the same op, never exchanged."""
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(gated_dialect, "timer", fake)
    gate, up = inputs()
    torch.manual_seed(3)
    got = fwd_bwd(lambda g, u, a: trifuse.ops.gated_activation(g, u, a, p=0.3), gate, up, activation)
    torch.manual_seed(3)
    want = fwd_bwd(lambda g, u, a: torch.ops.trifuse.gated_activation_dropout(g, u, a, 0.3)[0], gate, up, activation)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = gated_dialect.explain(gate, up, activation, 0.3)
    assert (rec.chosen, rec.source, fake.calls) == ("trifuse", "only eligible candidate", [])
    assert "dropout" in rec.rejected["torch"] and rec.bucket.endswith("dropout=True,grad=True")
    y = trifuse.ops.gated_activation(gate, up, activation, p=0.3, training=False)  # eval: no dropout, timed
    assert torch.equal(y, eager(gate, up, activation)) and set(fake.calls) == {"trifuse", "torch"}


def test_a_second_process_replays_the_choice_from_disk(gated_dialect, timer, monkeypatch, new_process):
    monkeypatch.setattr(gated_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    gate, up = inputs()
    trifuse.ops.gated_activation(gate, up, "gelu")
    new_process()
    gated_dialect.clear()
    second = timer({"trifuse": 1.0, "torch": 2.0})  # would choose trifuse if it timed anything
    monkeypatch.setattr(gated_dialect, "timer", second)
    for a, e in zip(fwd_bwd(trifuse.ops.gated_activation, gate, up, "gelu"), fwd_bwd(eager, gate, up, "gelu")):
        assert torch.equal(a, e)
    rec = gated_dialect.explain(gate, up, "gelu")
    assert (rec.chosen, rec.source, second.calls) == ("torch", "disk cache", [])


def test_compiled_graphs_keep_the_registered_op(gated_dialect, timer, monkeypatch):
    monkeypatch.setattr(gated_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    gate, up = inputs()
    trifuse.ops.gated_activation(gate, up, "silu")
    assert gated_dialect.explain(gate, up, "silu").chosen == "torch"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda *a: trifuse.ops.gated_activation(*a), backend=backend, fullgraph=True)(gate, up, "silu")
    assert "trifuse.gated_activation" in str(graphs[0].graph)
    torch.testing.assert_close(out, eager(gate, up, "silu"))


# ---------------------------------------------------------------------------------------------
# The torch candidate: its activation, its errors, its layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_torch_candidate_computes_the_activation_asked(activation):
    gate, up = inputs()
    got = ga.GATED_ACTIVATION.candidate("torch").fn(gate, up, activation)
    assert torch.equal(got, eager(gate, up, activation))
    for other in ACTIVATIONS:
        if other != activation:
            assert not torch.equal(got, eager(gate, up, other))


@pytest.mark.parametrize("case", ["broadcastable up", "up dtype", "activation", "integer gate", "up not a tensor"])
def test_torch_candidate_raises_trifuse_errors(case):
    gate = torch.randn(3, 8, device=DEVICE)
    args = {"broadcastable up": (gate, torch.ones(8, device=DEVICE), "silu"),  # `*` would take it
            "up dtype": (gate, gate.double(), "silu"),  # `*` would promote
            "activation": (gate, gate, "swish"),
            "integer gate": (gate.long(), gate.long(), "silu"),
            "up not a tensor": (gate, 1.0, "silu")}[case]
    with pytest.raises((TypeError, ValueError)) as want:
        ga.GATED_ACTIVATION.candidate("trifuse").fn(*args)
    with pytest.raises(want.type) as got:
        ga.GATED_ACTIVATION.candidate("torch").fn(*args)
    assert str(got.value) == str(want.value) and "trifuse.gated_activation" in str(got.value)


def test_torch_candidate_output_is_contiguous_for_chunked_halves():
    gate, up = torch.randn(N, 2 * N, device=DEVICE).t().contiguous().t().chunk(2, dim=-1)
    y = ga.GATED_ACTIVATION.candidate("torch").fn(gate, up, "silu")
    assert y.is_contiguous() and torch.equal(y, eager(gate, up, "silu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_check_passes_both_and_rejects_a_wrong_one(cache_dir, timer, dtype, activation):
    """Negative control on the real op: a candidate that forgets the gate's activation fails."""
    d = Dialect("gated_activation_check", ga._gated_activation_key, ga.GATED_ACTIVATION.key_names,
                ga.gated_activation_ref)
    for c in ga.GATED_ACTIVATION.candidates:
        d.register(c)
    d.register(Candidate("no-activation", lambda gate, up, activation: gate * up))
    d.timer = timer({})
    gate, up = inputs(dtype, rows=33)
    d(gate, up, activation)
    rec = d.explain(gate, up, activation)
    assert set(rec.times_ms) == {"trifuse", "torch"}
    assert rec.rejected["no-activation"].startswith("wrong result: output 0")


@pytest.mark.parametrize("activation, other", [("gelu", "gelu_tanh"), ("gelu_tanh", "gelu")])
def test_check_rejects_the_other_gelu_form(cache_dir, timer, activation, other):
    """Negative control: erf for tanh (or tanh for erf) is a wrong result, not a faster one."""
    d = Dialect("gated_activation_form_check", ga._gated_activation_key, ga.GATED_ACTIVATION.key_names,
                ga.gated_activation_ref)
    d.register(ga.GATED_ACTIVATION.candidate("trifuse"))
    d.register(Candidate("swapped", lambda gate, up, activation: eager(gate, up, other)))
    d.timer = timer({"swapped": 0.1})
    gate, up = inputs(rows=64)
    d(gate, up, activation)
    rec = d.explain(gate, up, activation)
    assert rec.chosen == "trifuse" and rec.rejected["swapped"].startswith("wrong result")


def test_explain_is_reachable_by_op_name(gated_dialect, timer, monkeypatch):
    monkeypatch.setattr(gated_dialect, "timer", timer({"trifuse": 1.0, "torch": 2.0}))
    gate, up = inputs()
    trifuse.ops.gated_activation(gate, up, "silu")
    assert dialects.explain("gated_activation", gate, up, "silu").chosen == "trifuse"
    assert [d.chosen for d in dialects.explain("gated_activation")] == ["trifuse"]


# ---------------------------------------------------------------------------------------------
# GPU: the real timer
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dialect_measures_and_replays(gated_dialect, dtype, activation):
    gate = torch.randn(4096, 11008, device="cuda", dtype=dtype, requires_grad=True)
    up = torch.randn(4096, 11008, device="cuda", dtype=dtype, requires_grad=True)
    trifuse.ops.gated_activation(gate, up, activation).sum().backward()
    rec = gated_dialect.explain(gate, up, activation)
    assert rec.source.startswith(("measured", "disk cache")) and rec.chosen in rec.times_ms
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected
