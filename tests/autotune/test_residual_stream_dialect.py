"""The residual stream's dialects (`dropout_add_layer_norm`, `dropout_add_rms_norm`) wired into
trifuse.ops.dropout_add_layer_norm and the residual forms of trifuse.ops.layer_norm / rms_norm:
trifuse's one kernel each way, or PyTorch's add and norm, chosen with a fake timer here (on the
GPU: measured). Without dropout both take the call, and whichever runs gives that
implementation's y, s and gradients bitwise; with dropout only trifuse's kernels do and nothing
is timed; several readers of y stay with trifuse's kernels. Traced calls always see the
registered ops; the check rejects a wrong candidate."""
import pytest
import torch
import trifuse
from _device import DEVICE
from torch._subclasses.fake_tensor import FakeTensorMode
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import layer_norm as ln

N = 48
# name -> (is_rms_norm, has x_bias, has residual)
FORMS = {"layer_norm": (False, False, True), "layer_norm_x_bias": (False, True, True),
         "rms_norm": (True, False, True), "layer_norm_x_bias_only": (False, True, False)}


@pytest.fixture
def stream_dialects(fresh_dialects):
    """The real dialects with their memory cleared before and after the test."""
    return fresh_dialects(ln.DROPOUT_ADD_LAYER_NORM, ln.DROPOUT_ADD_RMS_NORM)


def dialect_of(form):
    return ln.DROPOUT_ADD_RMS_NORM if FORMS[form][0] else ln.DROPOUT_ADD_LAYER_NORM


def inputs(form="layer_norm", dtype=torch.float32, rows=5, residual_dtype=None):
    """The dialects' positional arguments: (x, residual, normalized_shape, weight, bias, eps, p,
    x_bias, out_dtype), every tensor wanting a gradient."""
    is_rms, has_x_bias, has_residual = FORMS[form]

    def leaf(*shape, dt=dtype):
        return torch.randn(*shape, device=DEVICE, dtype=dt, requires_grad=True)

    x = leaf(2, rows, N)
    residual = leaf(2, rows, N, dt=residual_dtype or dtype) if has_residual else None
    weight = torch.nn.Parameter(torch.randn(N, device=DEVICE, dtype=dtype) + 1)
    bias = None if is_rms else torch.nn.Parameter(torch.randn(N, device=DEVICE, dtype=dtype))
    x_bias = leaf(N) if has_x_bias else None
    return x, residual, (N,), weight, bias, 1e-5, 0.0, x_bias, None


def public(x, residual, normalized_shape, weight, bias, eps, p, x_bias, out_dtype):
    return trifuse.ops.dropout_add_layer_norm(x, residual, normalized_shape, weight, bias, eps, p, True, x_bias,
                                              is_rms_norm=bias is None, out_dtype=out_dtype)


def kernels_of(form):
    return dialect_of(form).candidate("trifuse").fn


def eager(x, residual, normalized_shape, weight, bias, eps, p, x_bias, out_dtype):
    s = x if x_bias is None else x + x_bias
    s = s if residual is None else residual + s
    s = s.to(x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)).contiguous()
    if bias is None:
        y = torch.nn.functional.rms_norm(s, normalized_shape, weight, eps)
    else:
        y = torch.nn.functional.layer_norm(s, normalized_shape, weight, bias, eps)
    return (y if out_dtype is None else y.to(out_dtype)), s


def fwd_bwd(fn, *args):
    y, s = fn(*args)
    gen = torch.Generator(device=y.device).manual_seed(1)
    dy = torch.randn(y.shape, generator=gen, device=y.device, dtype=y.dtype)
    ds = torch.randn(s.shape, generator=gen, device=s.device, dtype=s.dtype)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return (y, s, *torch.autograd.grad((y, s), leaves, (dy, ds)))


def assert_bitwise(got, want):
    assert len(got) == len(want)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and torch.equal(a, e)


# ---------------------------------------------------------------------------------------------
# The key: cheap, a plain tuple, None where trifuse decides
# ---------------------------------------------------------------------------------------------


def test_key_is_a_small_tuple_of_plain_values():
    device = -1 if DEVICE == "cpu" else 0
    f32 = torch.float32
    args = inputs("layer_norm_x_bias", rows=7, residual_dtype=torch.float64)
    key = ln._residual_stream_key(*args)
    assert key == (device, f32, torch.float64, 16, N, f32, f32, f32, False, True)
    assert len(key) == len(ln.DROPOUT_ADD_LAYER_NORM.key_names) - 1  # "out" only when narrowed
    x, residual, ns, w, _, eps, _, _, _ = inputs("rms_norm")
    with torch.no_grad():
        assert ln._residual_stream_key(x, residual, ns, w, None, eps, 0.1, None, torch.bfloat16) == (
            device, f32, f32, 16, N, f32, None, None, True, False, "bfloat16")


@pytest.mark.parametrize("case", ["traced", "empty", "shape", "float64 narrowed"])
def test_key_is_none_where_trifuse_decides(case):
    x, residual, ns, w, b, eps, p, xb, _ = inputs()
    if case == "traced":
        with FakeTensorMode():
            t = torch.empty(5, N)
            assert ln._residual_stream_key(t, t, ns, None, None, eps, p, None, None) is None
        return
    args = {"empty": (x[:, :0], residual[:, :0], ns, w, b, eps, p, xb, None),
            "shape": (x, residual, (N + 1,), w, b, eps, p, xb, None),
            "float64 narrowed": (x.double(), residual.double(), ns, w, b, eps, p, xb, torch.float16)}[case]
    assert ln._residual_stream_key(*args) is None


def test_key_is_a_few_dozen_calls(count_calls):
    # The key runs on every eager call of the residual stream; counted, not timed.
    assert count_calls(ln._residual_stream_key, *inputs("layer_norm_x_bias")) <= 30


# ---------------------------------------------------------------------------------------------
# The choice, its replay, and what every call sees
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", list(FORMS))
def test_untimed_default_is_trifuse_and_bitwise_equal_to_the_registered_op(stream_dialects, monkeypatch, form):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    args = inputs(form)
    x, residual, ns, w, b, eps, p, xb, _ = args
    if b is None:
        def registered(*_):
            return torch.ops.trifuse.dropout_add_rms_norm(x, residual, list(ns), w, eps, p, xb)[:2]
    else:
        def registered(*_):
            return torch.ops.trifuse.dropout_add_layer_norm(x, residual, list(ns), w, b, eps, p, xb)[:2]
    assert_bitwise(fwd_bwd(public, *args), fwd_bwd(registered, *args))
    assert dialect_of(form).explain(*args).chosen == "trifuse"


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_the_measured_winner_runs_bitwise(stream_dialects, timer, monkeypatch, winner, form):
    dialect = dialect_of(form)
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(dialect, "timer", fake)
    args = inputs(form)
    assert_bitwise(fwd_bwd(public, *args), fwd_bwd(kernels_of(form) if winner == "trifuse" else eager, *args))
    rec = dialect.explain(*args)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    assert rec.bucket.startswith("dtype=float32,") and rec.bucket.endswith(",dropout=False,grad=True")
    public(*inputs(form, rows=6))  # same buckets: replayed
    assert len(fake.calls) == 2


@pytest.mark.parametrize("entry", ["layer_norm", "rms_norm"])
def test_the_residual_forms_of_the_norms_take_the_dialect(stream_dialects, timer, monkeypatch, entry):
    form = "rms_norm" if entry == "rms_norm" else "layer_norm"
    monkeypatch.setattr(dialect_of(form), "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, residual, ns, w, b, eps, *_ = args = inputs(form)
    if entry == "rms_norm":
        got = fwd_bwd(lambda *_: trifuse.ops.rms_norm(x, ns, w, eps, residual=residual), *args)
    else:
        got = fwd_bwd(lambda *_: trifuse.ops.layer_norm(x, ns, w, b, eps, residual=residual), *args)
    assert_bitwise(got, fwd_bwd(eager, *args))
    assert dialect_of(form).explain(*args).chosen == "torch"


def test_a_narrowed_call_is_chosen_apart(stream_dialects, timer, monkeypatch):
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(ln.DROPOUT_ADD_LAYER_NORM, "timer", fake)
    args = inputs()
    narrowed = (*args[:-1], torch.float16)
    got = fwd_bwd(public, *narrowed)
    assert got[0].dtype == torch.float16 and got[1].dtype == torch.float32
    assert_bitwise(got, fwd_bwd(eager, *narrowed))
    public(*args)
    assert len(fake.calls) == 4  # two choices: the narrowed call's and the plain one's
    assert ln.DROPOUT_ADD_LAYER_NORM.explain(*narrowed).bucket.endswith(",out=float16")


def test_with_dropout_only_trifuse_takes_the_call_and_nothing_is_timed(stream_dialects, timer, monkeypatch):
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(ln.DROPOUT_ADD_LAYER_NORM, "timer", fake)
    args = (*inputs("layer_norm_x_bias")[:6], 0.25, *inputs("layer_norm_x_bias")[7:])
    torch.manual_seed(3)
    got = fwd_bwd(public, *args)
    torch.manual_seed(3)
    assert_bitwise(got, fwd_bwd(kernels_of("layer_norm_x_bias"), *args))
    rec = ln.DROPOUT_ADD_LAYER_NORM.explain(*args)
    assert (rec.chosen, rec.source, fake.calls) == ("trifuse", "only eligible candidate", [])
    assert "dropout" in rec.rejected["torch"]


def test_several_readers_of_y_stay_with_trifuse_kernels(stream_dialects, timer, monkeypatch):
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(ln.DROPOUT_ADD_LAYER_NORM, "timer", fake)
    x, residual, ns, w, b, eps, _, _, _ = inputs()
    ys, _ = trifuse.ops.layer_norm(x, ns, w, b, eps, residual=residual, out_dtype=torch.float16, readers=2)
    assert len(ys) == 2 and fake.calls == [] and dialects.explain("dropout_add_layer_norm") == ()


def test_a_second_process_replays_the_choice_from_disk(stream_dialects, timer, monkeypatch, new_process):
    monkeypatch.setattr(ln.DROPOUT_ADD_RMS_NORM, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    args = inputs("rms_norm")
    public(*args)
    new_process()
    ln.DROPOUT_ADD_RMS_NORM.clear()
    second = timer({"trifuse": 1.0, "torch": 2.0})  # would choose trifuse if it timed anything
    monkeypatch.setattr(ln.DROPOUT_ADD_RMS_NORM, "timer", second)
    assert_bitwise(fwd_bwd(public, *args), fwd_bwd(eager, *args))
    rec = ln.DROPOUT_ADD_RMS_NORM.explain(*args)
    assert (rec.chosen, rec.source, second.calls) == ("torch", "disk cache", [])


def test_compiled_graphs_keep_the_registered_op(stream_dialects, timer, monkeypatch):
    monkeypatch.setattr(ln.DROPOUT_ADD_LAYER_NORM, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    args = inputs()
    public(*args)
    assert ln.DROPOUT_ADD_LAYER_NORM.explain(*args).chosen == "torch"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    y, s = torch.compile(public, backend=backend, fullgraph=True)(*args)
    assert "trifuse.dropout_add_layer_norm" in str(graphs[0].graph)
    want = eager(*args)
    torch.testing.assert_close(y, want[0])
    torch.testing.assert_close(s, want[1])


# ---------------------------------------------------------------------------------------------
# The torch candidate: dtypes, errors; the check
# ---------------------------------------------------------------------------------------------


def test_torch_candidate_gives_the_ops_dtypes_and_keeps_them_under_autocast():
    # fp16 activations, an fp32 residual stream and parameters (master weights): s and y in fp32
    x, residual, ns, w, b, eps, p, xb, _ = inputs("layer_norm_x_bias", dtype=torch.float16,
                                                  residual_dtype=torch.float32)
    w32, b32 = w.float(), b.float()
    want = kernels_of("layer_norm")(x, residual, ns, w32, b32, eps, p, xb, None)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = ln.DROPOUT_ADD_LAYER_NORM.candidate("torch").fn(x, residual, ns, w32, b32, eps, p, xb, None)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype == torch.float32 and a.is_contiguous()
        torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", ["residual broadcasts", "x_bias shape", "eps", "out_dtype", "integer input",
                                  "integer residual", "weight shape"])
def test_torch_candidate_raises_trifuse_errors(case):
    x, residual, ns, w, b, eps, p, xb, out = inputs("layer_norm_x_bias")
    args = {"residual broadcasts": (x, residual[:1], ns, w, b, eps, p, xb, out),  # `+` would take it
            "x_bias shape": (x, residual, ns, w, b, eps, p, xb[:1], out),  # so would this
            "integer input": (x.detach().long(), residual, ns, w, b, eps, p, xb, out),  # s would be float
            "integer residual": (x, residual.detach().long(), ns, w, b, eps, p, xb, out),
            "weight shape": (x, residual, ns, w[:3], b, eps, p, xb, out),
            "eps": (x, residual, ns, w, b, -1.0, p, xb, out),
            "out_dtype": (x, residual, ns, w, b, eps, p, xb, torch.int32)}[case]
    with pytest.raises((TypeError, ValueError)) as want:
        kernels_of("layer_norm")(*args)
    with pytest.raises(want.type) as got:
        ln.DROPOUT_ADD_LAYER_NORM.candidate("torch").fn(*args)
    assert str(got.value) == str(want.value) and "trifuse.dropout_add_layer_norm" in str(got.value)


def test_torch_rejects_weight_dtypes_its_norm_cannot_take():
    x, residual, ns, w, b, eps, p, xb, out = inputs()
    reason = ln._residual_stream_torch_supports(x, residual, ns, w.double(), b, eps, p, xb, out)
    assert "weight" in reason and "float64" in reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("wrong", ["no x_bias", "no residual in s"])
def test_check_passes_both_and_rejects_a_wrong_one(cache_dir, timer, dtype, wrong):
    """Negative control on the real op: a candidate that forgets x_bias, or returns s without the
    residual, fails."""
    d = Dialect("residual_stream_check", ln._residual_stream_key, ln._RESIDUAL_STREAM_KEY_NAMES,
                ln._residual_stream_ref(False))
    for c in ln.DROPOUT_ADD_LAYER_NORM.candidates:
        d.register(c)

    def forgetful(x, residual, ns, w, b, eps, p, xb, out):
        if wrong == "no x_bias":
            return eager(x, residual, ns, w, b, eps, p, None, out)
        y, _ = eager(x, residual, ns, w, b, eps, p, xb, out)
        return y, x + xb

    d.register(Candidate("forgetful", forgetful))
    d.timer = timer({})
    args = inputs("layer_norm_x_bias", dtype=dtype, rows=33)
    d(*args)
    rec = d.explain(*args)
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected
    assert rec.rejected["forgetful"].startswith("wrong result: output " + ("0" if wrong == "no x_bias" else "1"))


def test_explain_is_reachable_by_op_name(stream_dialects, timer, monkeypatch):
    monkeypatch.setattr(ln.DROPOUT_ADD_RMS_NORM, "timer", timer({"trifuse": 1.0, "torch": 2.0}))
    args = inputs("rms_norm")
    public(*args)
    assert dialects.explain("dropout_add_rms_norm", *args).chosen == "trifuse"
    assert [d.chosen for d in dialects.explain("dropout_add_rms_norm")] == ["trifuse"]


# ---------------------------------------------------------------------------------------------
# GPU: the real timer
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dialect_measures_and_replays(stream_dialects, dtype, form):
    is_rms, has_x_bias, has_residual = FORMS[form]

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)

    x = leaf(8, 1024, 1024)
    args = (x, leaf(8, 1024, 1024) if has_residual else None, (1024,), leaf(1024), None if is_rms else leaf(1024),
            1e-5, 0.0, leaf(1024) if has_x_bias else None, None)
    y, s = public(*args)
    (y.sum() + s.sum()).backward()
    rec = dialect_of(form).explain(*args)
    assert rec.source.startswith(("measured", "disk cache")) and rec.chosen in rec.times_ms
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected
