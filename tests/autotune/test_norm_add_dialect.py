"""The post-norm residual add's dialects (`layer_norm_add`, `rms_norm_add`) wired into
trifuse.ops.layer_norm_add: trifuse's one kernel each way, or PyTorch's norm then the add, chosen
with a fake timer here (on the GPU: measured). Whichever runs gives that implementation's y and
gradients bitwise, in x's dtype promoted with residual's; traced calls always see the registered
ops; the check rejects a wrong candidate."""
import pytest
import torch
import trifuse
from _device import DEVICE
from torch._subclasses.fake_tensor import FakeTensorMode
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import layer_norm as ln

N = 48
NORMS = ["layer_norm", "rms_norm"]


@pytest.fixture
def add_dialects(fresh_dialects):
    """The real dialects with their memory cleared before and after the test."""
    return fresh_dialects(ln.LAYER_NORM_ADD, ln.RMS_NORM_ADD)


def dialect_of(norm):
    return ln.RMS_NORM_ADD if norm == "rms_norm" else ln.LAYER_NORM_ADD


def inputs(norm="layer_norm", dtype=torch.float32, rows=5, residual_dtype=None):
    """The dialects' positional arguments: (x, residual, normalized_shape, weight, bias, eps)."""
    x = torch.randn(2, rows, N, device=DEVICE, dtype=dtype, requires_grad=True)
    residual = torch.randn(2, rows, N, device=DEVICE, dtype=residual_dtype or dtype, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(N, device=DEVICE, dtype=dtype) + 1)
    bias = None if norm == "rms_norm" else torch.nn.Parameter(torch.randn(N, device=DEVICE, dtype=dtype))
    return x, residual, [N], weight, bias, 1e-5


def public(x, residual, normalized_shape, weight, bias, eps):
    return trifuse.ops.layer_norm_add(x, residual, normalized_shape, weight, bias, eps, is_rms_norm=bias is None)


def eager(x, residual, normalized_shape, weight, bias, eps):
    if bias is None:
        y = torch.nn.functional.rms_norm(x, normalized_shape, weight, eps)
    else:
        y = torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)
    return (residual + y).to(torch.promote_types(x.dtype, residual.dtype))


def fwd_bwd(fn, *args):
    y = fn(*args)
    gen = torch.Generator(device=y.device).manual_seed(1)
    dy = torch.randn(y.shape, generator=gen, device=y.device, dtype=y.dtype)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return (y, *torch.autograd.grad(y, leaves, dy))


def assert_bitwise(got, want):
    assert len(got) == len(want)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and torch.equal(a, e)


def test_key_is_a_small_tuple_of_plain_values(count_calls):
    device = -1 if DEVICE == "cpu" else 0
    f32 = torch.float32
    args = inputs(rows=7, residual_dtype=torch.float64)
    assert ln._norm_add_key(*args) == (device, f32, torch.float64, 16, N, f32, f32, True)
    assert len(ln._norm_add_key(*args)) == len(ln.LAYER_NORM_ADD.key_names)
    assert count_calls(ln._norm_add_key, *args) <= 30  # it runs on every eager call: counted, not timed
    x, residual, ns, w, _, eps = inputs("rms_norm")
    with torch.no_grad():
        assert ln._norm_add_key(x, residual, ns, w, None, eps) == (device, f32, f32, 16, N, f32, None, False)
    with FakeTensorMode():
        t = torch.empty(5, N)
        assert ln._norm_add_key(t, t, ns, None, None, eps) is None
    assert ln._norm_add_key(x[:, :0], residual[:, :0], ns, w, None, eps) is None
    assert ln._norm_add_key(x, residual, [N + 1], w, None, eps) is None


@pytest.mark.parametrize("norm", NORMS)
def test_untimed_default_is_trifuse_and_bitwise_equal_to_the_registered_op(add_dialects, monkeypatch, norm):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    args = inputs(norm)
    x, residual, ns, w, b, eps = args
    if b is None:
        def registered(*_):
            return torch.ops.trifuse.rms_norm_add(x, residual, ns, w, eps)[0]
    else:
        def registered(*_):
            return torch.ops.trifuse.layer_norm_add(x, residual, ns, w, b, eps)[0]
    assert_bitwise(fwd_bwd(public, *args), fwd_bwd(registered, *args))
    assert dialect_of(norm).explain(*args).chosen == "trifuse"


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_the_measured_winner_runs_bitwise(add_dialects, timer, monkeypatch, winner, norm):
    dialect = dialect_of(norm)
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(dialect, "timer", fake)
    args = inputs(norm)
    assert_bitwise(fwd_bwd(public, *args), fwd_bwd(dialect.candidate(winner).fn if winner == "trifuse" else eager,
                                                   *args))
    rec = dialect.explain(*args)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    assert rec.bucket.startswith("dtype=float32,residual=float32,rows=16,n=48,")
    public(*inputs(norm, rows=6))  # same buckets: replayed
    assert len(fake.calls) == 2


def test_a_second_process_replays_the_choice_from_disk(add_dialects, timer, monkeypatch, new_process):
    monkeypatch.setattr(ln.LAYER_NORM_ADD, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    args = inputs()
    public(*args)
    new_process()
    ln.LAYER_NORM_ADD.clear()
    second = timer({"trifuse": 1.0, "torch": 2.0})  # would choose trifuse if it timed anything
    monkeypatch.setattr(ln.LAYER_NORM_ADD, "timer", second)
    assert_bitwise(fwd_bwd(public, *args), fwd_bwd(eager, *args))
    rec = ln.LAYER_NORM_ADD.explain(*args)
    assert (rec.chosen, rec.source, second.calls) == ("torch", "disk cache", [])


def test_compiled_graphs_keep_the_registered_op(add_dialects, timer, monkeypatch):
    monkeypatch.setattr(ln.RMS_NORM_ADD, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    args = inputs("rms_norm")
    public(*args)
    assert ln.RMS_NORM_ADD.explain(*args).chosen == "torch"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    y = torch.compile(public, backend=backend, fullgraph=True)(*args)
    assert "trifuse.rms_norm_add" in str(graphs[0].graph)
    torch.testing.assert_close(y, eager(*args))


def test_torch_candidate_gives_the_ops_dtype_under_autocast():
    # fp16 x, an fp32 residual stream and fp32 parameters: y in fp32
    x, residual, ns, w, b, eps = inputs(dtype=torch.float16, residual_dtype=torch.float32)
    w32, b32 = w.float(), b.float()
    want = ln.LAYER_NORM_ADD.candidate("trifuse").fn(x, residual, ns, w32, b32, eps)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = ln.LAYER_NORM_ADD.candidate("torch").fn(x, residual, ns, w32, b32, eps)
    assert got.dtype == want.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", ["residual broadcasts", "eps", "weight shape", "integer input", "integer residual"])
def test_torch_candidate_raises_trifuse_errors(case):
    x, residual, ns, w, b, eps = inputs()
    args = {"residual broadcasts": (x, residual[:1], ns, w, b, eps),  # `+` would take it
            "integer input": (x.detach().long(), residual, ns, w, b, eps),
            "integer residual": (x, residual.detach().long(), ns, w, b, eps),
            "eps": (x, residual, ns, w, b, -1.0),
            "weight shape": (x, residual, ns, w[:3], b, eps)}[case]
    with pytest.raises((TypeError, ValueError)) as want:
        ln.LAYER_NORM_ADD.candidate("trifuse").fn(*args)
    with pytest.raises(want.type) as got:
        ln.LAYER_NORM_ADD.candidate("torch").fn(*args)
    assert str(got.value) == str(want.value) and "trifuse.layer_norm_add" in str(got.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_check_passes_both_and_rejects_a_wrong_one(cache_dir, timer, dtype):
    """Negative control on the real op: a candidate that adds the residual before the norm fails."""
    d = Dialect("norm_add_check", ln._norm_add_key, ln._NORM_ADD_KEY_NAMES, ln._norm_add_ref(False))
    for c in ln.LAYER_NORM_ADD.candidates:
        d.register(c)
    d.register(Candidate("pre-norm", lambda x, r, ns, w, b, eps: torch.nn.functional.layer_norm(x + r, ns, w, b,
                                                                                               eps)))
    d.timer = timer({})
    args = inputs(dtype=dtype, rows=33)
    d(*args)
    rec = d.explain(*args)
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected
    assert rec.rejected["pre-norm"].startswith("wrong result: output 0")


def test_explain_is_reachable_by_op_name(add_dialects, timer, monkeypatch):
    monkeypatch.setattr(ln.LAYER_NORM_ADD, "timer", timer({"trifuse": 1.0, "torch": 2.0}))
    args = inputs()
    public(*args)
    assert dialects.explain("layer_norm_add", *args).chosen == "trifuse"
    assert [d.chosen for d in dialects.explain("layer_norm_add")] == ["trifuse"]


@pytest.mark.gpu
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dialect_measures_and_replays(add_dialects, dtype, norm):
    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)

    args = (leaf(8, 1024, 1024), leaf(8, 1024, 1024), [1024], leaf(1024), None if norm == "rms_norm" else leaf(1024),
            1e-5)
    public(*args).sum().backward()
    rec = dialect_of(norm).explain(*args)
    assert rec.source.startswith(("measured", "disk cache")) and rec.chosen in rec.times_ms
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected
