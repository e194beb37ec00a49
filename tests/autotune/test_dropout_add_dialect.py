"""The dropout_add dialect wired into trifuse.ops.dropout_add: trifuse's kernels or PyTorch's
adds, chosen with a fake timer here (on the GPU: measured). Without dropout both take the call,
plain, with a bias, with a gate per sample or per token, and whichever runs gives that
implementation's result bitwise; with dropout only trifuse's kernels do (PyTorch's mask is
another one, stored for the backward), and nothing is timed. Traced calls always see the
registered ops; the check rejects a wrong candidate."""

import pytest
import torch
import trifuse
from _device import DEVICE
from torch._subclasses.fake_tensor import FakeTensorMode
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import dropout_add as da

N = 40
FORMS = ["plain", "bias", "gate_per_sample", "gate_per_token"]


@pytest.fixture
def add_dialect(fresh_dialects):
    """The real dialect with its memory cleared before and after the test."""
    return fresh_dialects(da.DROPOUT_ADD)


def inputs(form="bias", dtype=torch.float32, rows=5, batch=2):
    def leaf(*shape, dt=dtype):
        return torch.randn(*shape, device=DEVICE, dtype=dt, requires_grad=True)

    x, residual = leaf(batch, rows, N), leaf(batch, rows, N)
    bias = leaf(N) if form != "plain" else None
    gate = {"gate_per_sample": lambda: leaf(batch, 1, N, dt=torch.float32),
            "gate_per_token": lambda: leaf(batch, rows, N)}.get(form, lambda: None)()
    return x, residual, bias, gate


def fwd_bwd(fn, x, residual, p, bias, gate):
    y = fn(x, residual, p, bias, gate)
    gen = torch.Generator(device=y.device).manual_seed(1)
    dy = torch.randn(y.shape, generator=gen, device=y.device, dtype=y.dtype)
    leaves = [t for t in (x, residual, bias, gate) if t is not None]
    return (y, *torch.autograd.grad(y, leaves, dy))


def public(x, residual, p, bias, gate):
    return trifuse.ops.dropout_add(x, residual, p, True, bias, gate)


def eager(x, residual, p, bias, gate):
    z = x if bias is None else x + bias
    return (residual + (z if gate is None else gate * z)).to(torch.promote_types(x.dtype, residual.dtype))


def trifuse_kernels(x, residual, p, bias, gate):
    return da.DROPOUT_ADD.candidate("trifuse").fn(x, residual, p, bias, gate)


# ---------------------------------------------------------------------------------------------
# The key: cheap, a plain tuple, None where trifuse decides
# ---------------------------------------------------------------------------------------------


def test_key_is_a_small_tuple_of_plain_values():
    device = -1 if DEVICE == "cpu" else 0
    x, residual, bias, gate = inputs("gate_per_sample", rows=7)
    f32 = torch.float32
    key = da._dropout_add_key(x, residual, 0.0, bias, gate)
    assert key == (device, f32, f32, 16, N, f32, f32, 2, False, True)
    assert len(key) == len(da.DROPOUT_ADD.key_names)
    x, residual, bias, gate = inputs("gate_per_token", rows=7)
    assert da._dropout_add_key(x, residual, 0.1, bias, gate)[6:] == (f32, 16, True, True)  # per token; dropout
    with torch.no_grad():
        x, residual, _, _ = inputs("plain", rows=3)
        assert da._dropout_add_key(x, residual.half(), 0.0, None, None) == (device, f32, torch.float16, 8, N, None,
                                                                             None, 0, False, False)


@pytest.mark.parametrize("case", ["traced", "empty", "scalar"])
def test_key_is_none_where_trifuse_decides(case):
    x, residual, bias, _ = inputs()
    if case == "traced":
        with FakeTensorMode():
            assert da._dropout_add_key(torch.empty(5, N), torch.empty(5, N), 0.0, None, None) is None
        return
    args = {"empty": (x[:0], residual[:0], 0.0, bias, None),
            "scalar": (x[0, 0, 0], residual[0, 0, 0], 0.0, None, None)}[case]
    assert da._dropout_add_key(*args) is None


KEY_CALLS = 25  # a budget with room, that a string format or a loop would overrun


def test_key_is_a_few_dozen_calls(count_calls):
    # The key runs on every eager call; counted, not timed.
    x, residual, bias, gate = inputs("gate_per_token")
    assert count_calls(da._dropout_add_key, x, residual, 0.0, bias, gate) <= KEY_CALLS


# ---------------------------------------------------------------------------------------------
# The choice, its replay, and what every call sees
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_untimed_default_is_trifuse_and_bitwise_equal_to_its_kernels(add_dialect, monkeypatch, form):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    args = inputs(form)
    for a, e in zip(fwd_bwd(public, *args[:2], 0.0, *args[2:]), fwd_bwd(trifuse_kernels, *args[:2], 0.0, *args[2:])):
        assert torch.equal(a, e)
    assert add_dialect.explain(*args[:2], 0.0, *args[2:]).chosen == "trifuse"


def test_plain_form_is_the_registered_op_bitwise(add_dialect, monkeypatch):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    x, residual, bias, _ = inputs("bias")
    got = fwd_bwd(public, x, residual, 0.0, bias, None)
    want = fwd_bwd(lambda x, r, p, b, g: torch.ops.trifuse.dropout_add(x, r, p, b)[0], x, residual, 0.0, bias, None)
    for a, e in zip(got, want):
        assert torch.equal(a, e)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_the_measured_winner_runs_bitwise(add_dialect, timer, monkeypatch, winner, form):
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(add_dialect, "timer", fake)
    x, residual, bias, gate = inputs(form)
    got = fwd_bwd(public, x, residual, 0.0, bias, gate)
    want = fwd_bwd(trifuse_kernels if winner == "trifuse" else eager, x, residual, 0.0, bias, gate)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = add_dialect.explain(x, residual, 0.0, bias, gate)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    assert rec.bucket.startswith("dtype=float32,residual=float32,rows=16,n=40,")
    public(*inputs(form, rows=6)[:2], 0.0, *inputs(form, rows=6)[2:])  # same buckets: replayed
    assert len(fake.calls) == 2


def test_eval_mode_is_a_call_without_dropout(add_dialect, timer, monkeypatch):
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(add_dialect, "timer", fake)
    x, residual, bias, _ = inputs()
    y = trifuse.ops.dropout_add(x, residual, 0.5, False, bias)
    assert torch.equal(y, eager(x, residual, 0.0, bias, None))
    assert add_dialect.explain(x, residual, 0.0, bias, None).chosen == "torch"


@pytest.mark.parametrize("form", FORMS)
def test_with_dropout_only_trifuse_takes_the_call_and_nothing_is_timed(add_dialect, timer, monkeypatch, form):
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(add_dialect, "timer", fake)
    args = inputs(form)
    torch.manual_seed(3)
    got = fwd_bwd(public, *args[:2], 0.3, *args[2:])
    torch.manual_seed(3)
    for a, e in zip(got, fwd_bwd(trifuse_kernels, *args[:2], 0.3, *args[2:])):
        assert torch.equal(a, e)
    rec = add_dialect.explain(*args[:2], 0.3, *args[2:])
    assert (rec.chosen, rec.source, fake.calls) == ("trifuse", "only eligible candidate", [])
    assert "dropout" in rec.rejected["torch"] and rec.bucket.endswith("dropout=True,grad=True")


def test_a_second_process_replays_the_choice_from_disk(add_dialect, timer, monkeypatch, new_process):
    monkeypatch.setattr(add_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, residual, bias, gate = inputs("gate_per_sample")
    public(x, residual, 0.0, bias, gate)
    new_process()
    add_dialect.clear()
    second = timer({"trifuse": 1.0, "torch": 2.0})  # would choose trifuse if it timed anything
    monkeypatch.setattr(add_dialect, "timer", second)
    for a, e in zip(fwd_bwd(public, x, residual, 0.0, bias, gate), fwd_bwd(eager, x, residual, 0.0, bias, gate)):
        assert torch.equal(a, e)
    rec = add_dialect.explain(x, residual, 0.0, bias, gate)
    assert (rec.chosen, rec.source, second.calls) == ("torch", "disk cache", [])


def test_compiled_graphs_keep_the_registered_op(add_dialect, timer, monkeypatch):
    monkeypatch.setattr(add_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, residual, bias, _ = inputs()
    public(x, residual, 0.0, bias, None)
    assert add_dialect.explain(x, residual, 0.0, bias, None).chosen == "torch"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda *a: trifuse.ops.dropout_add(*a), backend=backend, fullgraph=True)(x, residual, 0.0,
                                                                                                True, bias)
    assert "trifuse.dropout_add" in str(graphs[0].graph)
    torch.testing.assert_close(out, eager(x, residual, 0.0, bias, None))


# ---------------------------------------------------------------------------------------------
# The torch candidate: dtypes, layout, errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_torch_candidate_gives_the_ops_dtype_and_layout(form):
    x, residual, bias, gate = inputs(form, dtype=torch.float16)
    # an fp32 bias (master weights) and an fp32 residual stream: y in fp32, x's promoted with residual's
    for r in (residual, residual.float()):
        b = None if bias is None else bias.float()
        got = da.DROPOUT_ADD.candidate("torch").fn(x.transpose(0, 1), r.transpose(0, 1), 0.0, b,
                                                   None if gate is None else gate.transpose(0, 1))
        want = trifuse_kernels(x.transpose(0, 1), r.transpose(0, 1), 0.0, b,
                               None if gate is None else gate.transpose(0, 1))
        assert got.dtype == want.dtype == r.dtype and got.is_contiguous() and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", ["gate shape", "gate dtype", "gate not a tensor"])
def test_torch_candidate_raises_trifuse_errors(case):
    x, residual, bias, _ = inputs("bias", dtype=torch.float16)
    gate = {"gate shape": torch.ones(3, 1, N, device=DEVICE),  # `*` would not take it either, but say so
            "gate dtype": torch.ones(2, 1, N, device=DEVICE, dtype=torch.float64),  # wider than the fp32 sum
            "gate not a tensor": 2.0}[case]
    with pytest.raises((TypeError, ValueError)) as want:
        da.DROPOUT_ADD.candidate("trifuse").fn(x, residual, 0.0, bias, gate)
    with pytest.raises(want.type) as got:
        da.DROPOUT_ADD.candidate("torch").fn(x, residual, 0.0, bias, gate)
    assert str(got.value) == str(want.value) and "trifuse.dropout_add" in str(got.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("wrong", ["no bias", "no gate"])
def test_check_passes_both_and_rejects_a_wrong_one(cache_dir, timer, dtype, wrong):
    """Negative control on the real op: a candidate that forgets the bias or the gate fails."""
    d = Dialect("dropout_add_check", da._dropout_add_key, da.DROPOUT_ADD.key_names, da._dropout_add_dialect_ref)
    for c in da.DROPOUT_ADD.candidates:
        d.register(c)
    forgets = {"no bias": lambda x, r, p, b, g: eager(x, r, p, None, g),
               "no gate": lambda x, r, p, b, g: eager(x, r, p, b, None)}[wrong]
    d.register(Candidate("forgetful", forgets))
    d.timer = timer({})
    x, residual, bias, gate = inputs("gate_per_token", dtype=dtype, rows=33)
    d(x, residual, 0.0, bias, gate)
    rec = d.explain(x, residual, 0.0, bias, gate)
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected
    assert rec.rejected["forgetful"].startswith("wrong result: output 0")


def test_explain_is_reachable_by_op_name(add_dialect, timer, monkeypatch):
    monkeypatch.setattr(add_dialect, "timer", timer({"trifuse": 1.0, "torch": 2.0}))
    x, residual, bias, _ = inputs()
    public(x, residual, 0.0, bias, None)
    assert dialects.explain("dropout_add", x, residual, 0.0, bias, None).chosen == "trifuse"
    assert [d.chosen for d in dialects.explain("dropout_add")] == ["trifuse"]


# ---------------------------------------------------------------------------------------------
# GPU: the real timer
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dialect_measures_and_replays(add_dialect, dtype, form):
    def leaf(*shape, dt=dtype):
        return torch.randn(*shape, device="cuda", dtype=dt, requires_grad=True)

    x, residual = leaf(4, 2048, 1024), leaf(4, 2048, 1024)
    bias = leaf(1024) if form != "plain" else None
    gate = {"gate_per_sample": lambda: leaf(4, 1, 1024, dt=torch.float32),
            "gate_per_token": lambda: leaf(4, 2048, 1024)}.get(form, lambda: None)()
    public(x, residual, 0.0, bias, gate).sum().backward()
    rec = add_dialect.explain(x, residual, 0.0, bias, gate)
    assert rec.source.startswith(("measured", "disk cache")) and rec.chosen in rec.times_ms
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected
