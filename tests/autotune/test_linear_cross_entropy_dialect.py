"""The linear_cross_entropy dialect wired into trifuse.ops.linear_cross_entropy: trifuse's chunked
kernels or PyTorch's F.linear + F.cross_entropy, chosen with a fake timer here (on the GPU:
measured). PyTorch's path is a candidate only where all it holds for the logits fits in the
budget trifuse allows one chunk (the memory rule: the op exists so that the whole logits never do); whichever runs gives
that implementation's loss and gradients bitwise, in the op's loss dtype and shape. An explicit
chunk_size and traced calls keep trifuse's kernels; the check rejects a wrong candidate."""
import pytest
import torch
import torch.nn.functional as F
import trifuse
from _device import DEVICE
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import cross_entropy as ce

V, H = 37, 24  # a vocabulary that is no multiple of 8


@pytest.fixture
def lce_dialect(fresh_dialects):
    """The real dialect with its memory cleared before and after the test."""
    return fresh_dialects(ce.LINEAR_CROSS_ENTROPY)


def head(tokens=(2, 7), dtype=torch.float32, bias=True):
    hidden = torch.randn(*tokens, H, device=DEVICE, dtype=dtype, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(V, H, device=DEVICE, dtype=dtype) * 0.3)
    b = torch.nn.Parameter(torch.randn(V, device=DEVICE, dtype=dtype)) if bias else None
    target = torch.randint(0, V, tokens, device=DEVICE)
    target.view(-1)[1] = -100
    return hidden, weight, target, b


def dialect_args(hidden, weight, target, bias, reduction="mean", label_smoothing=0.0):
    compute, dtype = ce._lce_dtypes(hidden, weight, bias, None)
    return (hidden, weight, target, bias, -100, reduction, label_smoothing, compute, dtype)


def public(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute, dtype):
    return trifuse.ops.linear_cross_entropy(hidden, weight, target, bias, ignore_index, reduction, label_smoothing)


def eager(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, compute, dtype):
    logits = F.linear(hidden, weight, bias)
    loss = F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    return (loss.reshape(target.shape) if reduction == "none" else loss).to(dtype)


def fwd_bwd(fn, *args):
    loss = fn(*args)
    gen = torch.Generator(device=loss.device).manual_seed(1)
    dloss = torch.randn(loss.shape, generator=gen, device=loss.device, dtype=loss.dtype)
    leaves = [t for t in (args[0], args[1], args[3]) if t is not None]
    return (loss, *torch.autograd.grad(loss, leaves, dloss))


def test_key_is_a_small_tuple_of_plain_values(count_calls):
    device = -1 if DEVICE == "cpu" else 0
    f32 = torch.float32
    args = dialect_args(*head(), reduction="none", label_smoothing=0.1)
    assert ce._lce_key(*args) == (device, f32, 16, V, H, f32, f32, f32, "none", True, f32, True)
    assert len(ce._lce_key(*args)) == len(ce.LINEAR_CROSS_ENTROPY.key_names)
    assert count_calls(ce._lce_key, *args) <= 30  # it runs on every eager call: counted, not timed
    hidden, weight, target, bias = head()
    assert ce._lce_key(*dialect_args(hidden[:0], weight, target[:0], bias)) is None


def test_the_memory_rule_gives_pytorch_only_one_chunk_problems(monkeypatch):
    args = dialect_args(*head())
    assert ce._lce_torch_supports(*args) is None
    # 14 x 37 logits at 12 bytes: 6216 bytes; one byte less of budget and PyTorch's path is out
    monkeypatch.setattr(ce, "CPU_CHUNK_BYTES", 14 * 37 * 12)
    assert ce._lce_torch_supports(*args) is None
    monkeypatch.setattr(ce, "CPU_CHUNK_BYTES", 14 * 37 * 12 - 1)
    reason = ce._lce_torch_supports(*args)
    assert reason.startswith("PyTorch's path holds all 14 x 37 logits") and "memory" in reason


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_untimed_default_is_trifuse_and_bitwise_equal_to_its_kernels(lce_dialect, monkeypatch, reduction):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    args = dialect_args(*head(), reduction=reduction)
    for a, e in zip(fwd_bwd(public, *args), fwd_bwd(ce._lce_trifuse, *args)):
        assert a.dtype == e.dtype and torch.equal(a, e)
    assert lce_dialect.explain(*args).chosen == "trifuse"


@pytest.mark.parametrize("winner", ["trifuse", "torch"])
@pytest.mark.parametrize("reduction, smoothing", [("mean", 0.0), ("none", 0.0), ("sum", 0.2)])
def test_the_measured_winner_runs_bitwise(lce_dialect, timer, monkeypatch, winner, reduction, smoothing):
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(lce_dialect, "timer", fake)
    args = dialect_args(*head(), reduction=reduction, label_smoothing=smoothing)
    want = fwd_bwd(ce._lce_trifuse if winner == "trifuse" else eager, *args)
    for a, e in zip(fwd_bwd(public, *args), want):
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e)
    rec = lce_dialect.explain(*args)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    public(*dialect_args(*head(tokens=(3, 5)), reduction=reduction, label_smoothing=smoothing))  # same buckets
    assert len(fake.calls) == 2


def test_a_chunk_size_asks_for_trifuse_kernels(lce_dialect, timer, monkeypatch):
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(lce_dialect, "timer", fake)
    hidden, weight, target, bias = head()
    trifuse.ops.linear_cross_entropy(hidden, weight, target, bias, chunk_size=4)
    assert fake.calls == [] and dialects.explain("linear_cross_entropy") == ()


def test_under_autocast_pytorch_gives_the_ops_dtypes(lce_dialect, timer, monkeypatch):
    monkeypatch.setattr(lce_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    hidden, weight, target, bias = head()
    with torch.autocast(DEVICE, dtype=torch.bfloat16 if DEVICE == "cpu" else torch.float16):
        args = dialect_args(hidden, weight, target, bias)
        loss = public(*args)
        want = ce._lce_trifuse(*args)
    assert loss.dtype == want.dtype == torch.float32
    assert lce_dialect.explain(*args).chosen == "torch"
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    assert dh.dtype == dw.dtype == torch.float32


def test_a_second_process_replays_the_choice_from_disk(lce_dialect, timer, monkeypatch, new_process):
    monkeypatch.setattr(lce_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    args = dialect_args(*head())
    public(*args)
    new_process()
    lce_dialect.clear()
    second = timer({"trifuse": 1.0, "torch": 2.0})
    monkeypatch.setattr(lce_dialect, "timer", second)
    for a, e in zip(fwd_bwd(public, *args), fwd_bwd(eager, *args)):
        assert torch.equal(a, e)
    rec = lce_dialect.explain(*args)
    assert (rec.chosen, rec.source, second.calls) == ("torch", "disk cache", [])


def test_compiled_graphs_keep_the_registered_op(lce_dialect, timer, monkeypatch):
    monkeypatch.setattr(lce_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    args = dialect_args(*head())
    public(*args)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    loss = torch.compile(public, backend=backend, fullgraph=True)(*args)
    assert "trifuse.linear_cross_entropy" in str(graphs[0].graph)
    torch.testing.assert_close(loss, eager(*args))


@pytest.mark.parametrize("wrong", ["no bias", "no smoothing", "no ignore_index"])
def test_check_rejects_a_wrong_candidate(cache_dir, timer, wrong):
    d = Dialect("lce_check", ce._lce_key, ce.LINEAR_CROSS_ENTROPY.key_names, ce._lce_reference)
    for c in ce.LINEAR_CROSS_ENTROPY.candidates:
        d.register(c)
    fn = {"no bias": lambda h, w, t, b, *rest: eager(h, w, t, None, *rest),
          "no smoothing": lambda *a: eager(*a[:6], 0.0, *a[7:]),
          "no ignore_index": lambda h, w, t, b, ii, *rest: eager(h, w, t.clamp(min=0), b, ii, *rest)}[wrong]
    d.register(Candidate("wrong", fn))
    d.timer = timer({})
    args = dialect_args(*head(), label_smoothing=0.1)
    d(*args)
    rec = d.explain(*args)
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected
    assert rec.rejected["wrong"].startswith("wrong result"), rec.rejected["wrong"]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, vocab, hidden, torch_eligible", [(512, 32000, 1024, True),
                                                                   (8192, 50257, 1024, False)])
def test_gpu_dialect_measures_or_keeps_trifuse_for_memory(lce_dialect, tokens, vocab, hidden, torch_eligible):
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    trifuse.ops.linear_cross_entropy(h, w, t).backward()
    rec = dialects.explain("linear_cross_entropy", *dialect_args(h, w, t, None))
    if torch_eligible:
        assert rec.source.startswith(("measured", "disk cache")) and set(rec.times_ms) == {"trifuse", "torch"}
    else:
        assert rec.chosen == "trifuse" and "memory" in rec.rejected["torch"]
