"""The group_norm dialect wired into trifuse.ops.group_norm: trifuse's kernels or PyTorch's
F.group_norm (then F.silu), chosen with a fake timer here (on the GPU: measured). Whichever runs,
the result is bitwise that implementation's; traced calls always see trifuse::group_norm; the
check rejects a wrong one; each layout (contiguous, channels-last, other) is its own key."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import trifuse
from _device import DEVICE
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import group_norm as gn

C, G, EPS = 12, 4, 1e-6


@pytest.fixture
def gn_dialect(cache_dir, monkeypatch):
    """The real group_norm dialect with its memory cleared before and after the test."""
    gn.GROUP_NORM.clear()
    monkeypatch.setattr(gn.GROUP_NORM, "timer", None)
    yield gn.GROUP_NORM
    gn.GROUP_NORM.clear()


def inputs(dtype=torch.float32, n=3, spatial=(5, 7)):
    x = torch.randn(n, C, *spatial, device=DEVICE, dtype=dtype, requires_grad=True)
    w = torch.nn.Parameter(1 + 0.3 * torch.randn(C, device=DEVICE, dtype=dtype))
    b = torch.nn.Parameter(0.3 * torch.randn(C, device=DEVICE, dtype=dtype))
    return x, w, b


def fwd_bwd(fn, x, w, b, activation="silu"):
    y = fn(x, G, w, b, EPS, activation)
    gen = torch.Generator(device=y.device).manual_seed(1)
    dy = torch.randn(y.shape, generator=gen, device=y.device, dtype=y.dtype)
    return (y, *torch.autograd.grad(y, (x, w, b), dy))


def registered(x, groups, w, b, eps, activation):
    return torch.ops.trifuse.group_norm(x, groups, w, b, eps, activation, None)[0]


def pytorch(x, groups, w, b, eps, activation):
    y = F.group_norm(x, groups, w, b, eps)
    return F.silu(y) if activation == "silu" else y


# ---------------------------------------------------------------------------------------------
# The key: cheap, a plain tuple, None where trifuse decides
# ---------------------------------------------------------------------------------------------


def test_key_is_a_small_tuple_of_plain_values():
    x, w, b = inputs(n=3)
    device = -1 if DEVICE == "cpu" else 0
    assert gn._group_norm_key(x, G, w, b, EPS, "silu", None) == \
        (device, torch.float32, 16, 128, "silu", None, True, "contiguous")
    assert len(gn._group_norm_key(x, G, w, b, EPS, None, None)) == len(gn.GROUP_NORM.key_names)
    with torch.no_grad():
        assert gn._group_norm_key(x, G, None, None, EPS, None, None)[-2] is False


def test_each_layout_is_its_own_key():
    """trifuse's kernels read channels-last where it lies and copy another layout, PyTorch's CUDA
    GroupNorm copies all but contiguous: measured apart."""
    x, w, b = inputs()
    last = x.detach().to(memory_format=torch.channels_last)
    sliced = torch.cat([x.detach(), x.detach()], -1)[..., ::2]
    assert [gn._group_norm_key(t, G, w, b, EPS, None, None)[-1] for t in (x, last, sliced)] == \
        ["contiguous", "channels_last", "other"]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "other"])
def test_both_candidates_lay_y_out_alike(layout):
    """Whichever candidate runs, y has the registered op's layout (x's if channels-last,
    contiguous otherwise): a replayed choice never changes what the next op reads."""
    x, w, b = inputs()
    x = x.detach()
    x = {"contiguous": x, "channels_last": x.to(memory_format=torch.channels_last),
         "other": torch.cat([x, x], -1)[..., ::2]}[layout]
    op = torch.ops.trifuse.group_norm(x, G, w, b, EPS, "silu", None)[0]
    for candidate in (gn._group_norm_trifuse, gn._group_norm_torch_candidate):
        y = candidate(x, G, w, b, EPS, "silu", None)
        assert y.stride() == op.stride() == (x.stride() if layout == "channels_last" else x.contiguous().stride())
        torch.testing.assert_close(y, op)


@pytest.mark.parametrize("case", ["traced", "empty", "groups", "activation", "one dim", "not a tensor"])
def test_key_is_none_where_trifuse_decides(case):
    x, w, b = inputs()
    if case == "traced":
        with FakeTensorMode():
            assert gn._group_norm_key(torch.empty(2, C, 3), G, None, None, EPS, None, None) is None
        return
    args = {"empty": (x[:0], G, w, b), "groups": (x, 5, w, b), "activation": (x, G, w, b),
            "one dim": (x.detach().flatten(), G, None, None), "not a tensor": (None, G, None, None)}[case]
    activation = "gelu" if case == "activation" else None
    assert gn._group_norm_key(*args, EPS, activation, None) is None


KEY_CALLS = 24  # a budget with room, that a string format or a loop would overrun


def test_key_is_a_few_dozen_calls(count_calls):
    x, w, b = inputs()
    assert count_calls(gn._group_norm_key, x, G, w, b, EPS, "silu", None) <= KEY_CALLS


# ---------------------------------------------------------------------------------------------
# The choice, its replay, and what every call sees
# ---------------------------------------------------------------------------------------------


def test_untimed_default_is_trifuse_and_bitwise_equal_to_the_registered_op(gn_dialect, monkeypatch):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    x, w, b = inputs()
    for a, e in zip(fwd_bwd(trifuse.ops.group_norm, x, w, b), fwd_bwd(registered, x, w, b)):
        assert torch.equal(a, e)
    assert gn_dialect.explain(x, G, w, b, EPS, "silu", None).chosen == "trifuse"


@pytest.mark.parametrize("winner", ["trifuse", "torch"])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_the_measured_winner_runs_bitwise(gn_dialect, timer, monkeypatch, winner, activation):
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(gn_dialect, "timer", fake)
    x, w, b = inputs()
    got = fwd_bwd(trifuse.ops.group_norm, x, w, b, activation)
    want = fwd_bwd(registered if winner == "trifuse" else pytorch, x, w, b, activation)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = gn_dialect.explain(x, G, w, b, EPS, activation, None)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    assert rec.bucket == (f"dtype=float32,rows=16,width=128,activation={activation},out_dtype=None,"
                          "grad=True,layout=contiguous")
    fwd_bwd(trifuse.ops.group_norm, *inputs(n=4), activation)  # the same rows bucket: replayed
    assert len(fake.calls) == 2


def test_a_second_process_replays_the_choice_from_disk(gn_dialect, timer, monkeypatch, new_process):
    monkeypatch.setattr(gn_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, w, b = inputs()
    trifuse.ops.group_norm(x, G, w, b, EPS, "silu")
    new_process()
    gn_dialect.clear()
    second = timer({"trifuse": 1.0, "torch": 2.0})  # would choose trifuse if it timed anything
    monkeypatch.setattr(gn_dialect, "timer", second)
    for a, e in zip(fwd_bwd(trifuse.ops.group_norm, x, w, b), fwd_bwd(pytorch, x, w, b)):
        assert torch.equal(a, e)
    rec = gn_dialect.explain(x, G, w, b, EPS, "silu", None)
    assert (rec.chosen, rec.source, second.calls) == ("torch", "disk cache", [])


def test_compiled_graphs_keep_the_registered_op(gn_dialect, timer, monkeypatch):
    monkeypatch.setattr(gn_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, w, b = inputs()
    trifuse.ops.group_norm(x, G, w, b, EPS, "silu")
    assert gn_dialect.explain(x, G, w, b, EPS, "silu", None).chosen == "torch"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda *a: trifuse.ops.group_norm(*a), backend=backend, fullgraph=True)(
        x, G, w, b, EPS, "silu")
    assert "trifuse.group_norm" in str(graphs[0].graph)
    torch.testing.assert_close(out, pytorch(x, G, w, b, EPS, "silu"))


# ---------------------------------------------------------------------------------------------
# The torch candidate: its errors, its dtypes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["groups", "weight shape", "negative eps", "integer input", "activation"])
def test_torch_candidate_raises_trifuse_errors(case):
    x = torch.randn(2, 6, 4, device=DEVICE)
    args = {"groups": (x, 4, None, None, EPS, None, None),
            "weight shape": (x, 2, torch.ones(5, device=DEVICE), None, EPS, None, None),
            "negative eps": (x, 2, None, None, -1.0, None, None),
            "integer input": (x.long(), 2, None, None, EPS, None, None),
            "activation": (x, 2, None, None, EPS, "gelu", None)}[case]
    with pytest.raises((TypeError, ValueError)) as want:
        gn.GROUP_NORM.candidate("trifuse").fn(*args)
    with pytest.raises(want.type) as got:
        gn.GROUP_NORM.candidate("torch").fn(*args)
    assert str(got.value) == str(want.value) and "group_norm" in str(got.value)


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_torch_candidate_takes_autocasts_form(out_dtype):
    """A 16-bit x with fp32 parameters (and autocast's fp32 output): the norm in fp32 from x
    upcast, as the kernels compute it; the dtype out as asked."""
    x = torch.randn(2, C, 3, 4, device=DEVICE, dtype=torch.float16)
    w, b = torch.randn(C, device=DEVICE), torch.randn(C, device=DEVICE)
    y = gn.GROUP_NORM.candidate("torch").fn(x, G, w, b, EPS, "silu", out_dtype)
    want = F.silu(F.group_norm(x.float(), G, w, b, EPS)).to(out_dtype or torch.float16)
    assert y.dtype == want.dtype and torch.equal(y, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_check_passes_both_and_rejects_a_wrong_group_norm(cache_dir, timer, dtype):
    """Negative control for the check on the real op: GroupNorm with eps 1e-1 instead of 1e-6."""
    d = Dialect("group_norm_check", gn._group_norm_key, gn.GROUP_NORM.key_names, gn._reference)
    for c in gn.GROUP_NORM.candidates:
        d.register(c)
    d.register(Candidate("wrong-eps", lambda x, g, w, b, eps, act, out: pytorch(x, g, w, b, 1e-1, act)))
    d.timer = timer({})
    x, w, b = inputs(dtype)
    d(x, G, w, b, EPS, "silu", None)
    rec = d.explain(x, G, w, b, EPS, "silu", None)
    assert set(rec.times_ms) == {"trifuse", "torch"}
    assert rec.rejected["wrong-eps"].startswith("wrong result: output 0")


def test_nn_group_norm_calls_are_captured():
    (module_type, to_args), = gn.GROUP_NORM.captures
    m = torch.nn.GroupNorm(G, C, eps=1e-3)
    x = torch.randn(2, C, 3)
    assert module_type is torch.nn.GroupNorm
    assert to_args(m, x) == (x, G, m.weight, m.bias, 1e-3, None, None)


def test_explain_is_reachable_by_op_name(gn_dialect, timer, monkeypatch):
    monkeypatch.setattr(gn_dialect, "timer", timer({"trifuse": 1.0, "torch": 2.0}))
    x, w, b = inputs()
    trifuse.ops.group_norm(x, G, w, b, EPS, "silu")
    assert dialects.explain("group_norm", x, G, w, b, EPS, "silu", None).chosen == "trifuse"
    assert [d.chosen for d in dialects.explain("group_norm")] == ["trifuse"]


# ---------------------------------------------------------------------------------------------
# GPU: the real timer
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gpu_dialect_measures_and_replays(gn_dialect, dtype, layout):
    """SD's UNet's first level at 512 px, batch 2: both candidates measured per layout."""
    x = torch.randn(2, 320, 64, 64, device="cuda", dtype=dtype)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    w = torch.nn.Parameter(torch.randn(320, device="cuda", dtype=dtype))
    b = torch.nn.Parameter(torch.randn(320, device="cuda", dtype=dtype))
    trifuse.ops.group_norm(x, 32, w, b, 1e-5, "silu").sum().backward()
    rec = gn_dialect.explain(x, 32, w, b, 1e-5, "silu", None)
    assert rec.source.startswith(("measured", "disk cache")) and rec.chosen in rec.times_ms
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected
