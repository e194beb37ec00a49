"""Cross-entropy and the fused LM head (linear + cross-entropy) against the float64 oracle.

On CPU these run the real Triton kernels in the interpreter (tests/_device.py), with the
matmuls of linear_cross_entropy on PyTorch's CPU kernels; on a GPU the same tests run natively
and add bf16.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close

from _device import DEVICE, INTERPRETED, ON_GPU
import trifuse
from trifuse.kernels import cross_entropy as ce_mod
from trifuse.kernels.cross_entropy import cross_entropy_ref, linear_cross_entropy_ref

REDUCTIONS = ("mean", "sum", "none")
# (rows, classes): one class, odd, a block and a half, just past one block, no rows
CE_SHAPES = [(1, 1), (3, 7), (4, 6000), (2, 4097), (0, 5)]
# (tokens, hidden, vocab): one class, odd (padded to 64), a multiple of 8 (not padded), GPT-2's vocabulary
LCE_SHAPES = [(11, 16, 1), (11, 16, 7), (9, 12, 24), (2, 8, 50257)]


def _ids(shape):
    return "x".join(map(str, shape))


def make_target(shape, n_classes, ignore="some", ignore_index=-100):
    """Class indices; "some" ignores every third one, "all" and "none" as they say."""
    t = torch.randint(0, max(n_classes, 1), shape, device=DEVICE)
    if ignore == "all":
        t.fill_(ignore_index)
    elif ignore == "some":
        t.view(-1)[::3] = ignore_index
    return t


def leaf(t, dtype=None):
    return t.detach().to(dtype or t.dtype).clone().requires_grad_()


def grads_of(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout.to(out.dtype))


# ---------------------------------------------------------------------------------------------
# cross_entropy
# ---------------------------------------------------------------------------------------------


def check_ce(logits, target, reduction="mean", label_smoothing=0.0, ignore_index=-100, **kwargs):
    """Loss and dlogits against float64, bounded by PyTorch's own error in the logits' dtype."""
    x = leaf(logits)
    out = trifuse.ops.cross_entropy(x, target, ignore_index, reduction, label_smoothing, **kwargs)
    x64, xl = leaf(logits, torch.float64), leaf(logits)
    # PyTorch takes int64 (or uint8) targets only; the op takes any integer dtype.
    ref = cross_entropy_ref(x64, target.long(), ignore_index, reduction, label_smoothing)
    ref_lp = cross_entropy_ref(xl, target.long(), ignore_index, reduction, label_smoothing)
    assert out.shape == ref.shape
    assert_close(f"loss {reduction}", out, ref, ref_lp)
    if x.numel() == 0:
        return out
    dout = torch.randn(ref.shape, device=DEVICE, dtype=torch.float64)
    (g,) = grads_of(out, x, dout)
    (g64,) = grads_of(ref, x64, dout)
    (glp,) = grads_of(ref_lp, xl, dout)
    assert g.dtype == logits.dtype and g.shape == logits.shape
    assert_close(f"dlogits {reduction}", g, g64, glp)
    return out


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["plain", "smoothed"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", CE_SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_matches_float64_oracle(dtype, shape, reduction, label_smoothing):
    logits = (torch.randn(shape, device=DEVICE, dtype=torch.float64) * 3).to(dtype)
    out = check_ce(logits, make_target(shape[:1], shape[1]), reduction, label_smoothing)
    assert out.dtype == dtype


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["plain", "smoothed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_gpt2_vocabulary(dtype, label_smoothing):
    """50257 classes: thirteen blocks per row, two rows (one ignored in "mean")."""
    logits = (torch.randn(2, 50257, device=DEVICE, dtype=torch.float64) * 3).to(dtype)
    check_ce(logits, make_target((2,), 50257), "mean", label_smoothing)
    check_ce(logits, make_target((2,), 50257, "none"), "none", label_smoothing)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2], ids=["plain", "smoothed"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignore", ["all", "none"])
def test_cross_entropy_ignored_everywhere_and_nowhere(ignore, reduction, label_smoothing):
    """All ignored: "mean" is nan (0/0) with zero gradients, "sum" and "none" are 0, as PyTorch."""
    logits = torch.randn(5, 33, device=DEVICE)
    out = check_ce(logits, make_target((5,), 33, ignore), reduction, label_smoothing)
    if ignore == "all" and reduction == "mean":
        assert torch.isnan(out)


@pytest.mark.parametrize("ignore_index", [0, 5, 1000])
def test_cross_entropy_ignore_index_inside_and_outside_the_classes(ignore_index):
    logits = torch.randn(9, 7, device=DEVICE)
    target = make_target((9,), 7, "none")
    target[::2] = ignore_index
    for reduction in REDUCTIONS:
        check_ce(logits, target, reduction, 0.1, ignore_index)


def test_cross_entropy_accepts_pytorch_shapes():
    """(C,) with a 0-dim target, and (N, C, d1, d2) with (N, d1, d2) as F.cross_entropy takes them."""
    check_ce(torch.randn(11, device=DEVICE), torch.tensor(4, device=DEVICE))
    logits = torch.randn(2, 6, 3, 4, device=DEVICE)
    target = make_target((2, 3, 4), 6)
    for reduction in REDUCTIONS:
        check_ce(logits, target, reduction, 0.1)


def test_cross_entropy_strided_inputs_and_int32_targets():
    big = torch.randn(6, 300, device=DEVICE)
    logits = big[:, 20:270]  # (6, 250) with row stride 300: read in place
    target = make_target((12,), 250)[::2]  # non-contiguous
    check_ce(logits, target, "mean", 0.1)
    check_ce(logits.t().contiguous().t(), target.to(torch.int32), "sum")  # column-major: copied


def test_cross_entropy_nan_and_inf_like_pytorch():
    """+inf or NaN in a row make that row NaN; -inf logits are allowed (masked vocabulary) and
    give an infinite loss only where PyTorch's does (at the target, or with smoothing)."""
    logits = torch.randn(6, 40, device=DEVICE)
    target = torch.tensor([1, 2, 3, 4, 5, 6], device=DEVICE)
    logits[0, 7] = float("nan")
    logits[1, 9] = float("inf")
    logits[2, 10] = float("-inf")  # not the target
    logits[3, 4] = float("-inf")  # the target
    logits[4] = float("-inf")  # every class
    for reduction in ("none", "sum"):
        for eps in (0.0, 0.1):
            check_ce(logits, target, reduction, eps)


def test_cross_entropy_under_autocast_returns_fp32_like_pytorch():
    logits = torch.randn(4, 30, device=DEVICE, dtype=torch.float16)
    target = make_target((4,), 30)
    with torch.autocast(DEVICE, dtype=torch.float16):
        out = trifuse.ops.cross_entropy(logits, target)
        ref = F.cross_entropy(logits, target)
    assert out.dtype == ref.dtype == torch.float32
    assert_close("autocast", out, cross_entropy_ref(logits.double(), target), ref)
    up = trifuse.ops.cross_entropy(logits, target, out_dtype=torch.float32)
    assert up.dtype == torch.float32
    assert_close("out_dtype fp32", up, cross_entropy_ref(logits.double(), target),
                 F.cross_entropy(logits.float(), target))


def test_cross_entropy_gradcheck_float64():
    logits = torch.randn(4, 5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    target = make_target((4,), 5)
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(
            lambda x, r=reduction: trifuse.ops.cross_entropy(x, target, reduction=r, label_smoothing=0.15), (logits,),
            fast_mode=True)


def test_cross_entropy_is_deterministic():
    logits = torch.randn(37, 5000, device=DEVICE, requires_grad=True)
    target = make_target((37,), 5000)
    runs = []
    for _ in range(2):
        loss = trifuse.ops.cross_entropy(logits, target, label_smoothing=0.1)
        runs.append((loss, *torch.autograd.grad(loss, logits)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_eager_path_and_registered_op_are_bitwise_equal(reduction):
    logits = torch.randn(13, 300, device=DEVICE, requires_grad=True)
    target = make_target((13,), 300)
    eager = trifuse.ops.cross_entropy(logits, target, reduction=reduction, label_smoothing=0.1)
    op = torch.ops.trifuse.cross_entropy(logits, target, -100, reduction, 0.1, torch.float32)[0]
    assert torch.equal(eager, op)
    dout = torch.randn_like(eager)
    assert torch.equal(torch.autograd.grad(eager, logits, dout)[0], torch.autograd.grad(op, logits, dout)[0])


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_compiles_fullgraph_without_graph_breaks(reduction):
    logits = torch.randn(6, 50, device=DEVICE, requires_grad=True)
    target = make_target((6,), 50)

    def fn(x, t):
        return trifuse.ops.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)

    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(logits, target)
    ref = fn(logits, target)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), logits)[0], torch.autograd.grad(ref.sum(), logits)[0])


def test_cross_entropy_opcheck():
    logits = torch.randn(5, 9, device=DEVICE, requires_grad=True)
    target = make_target((5,), 9)
    for reduction in REDUCTIONS:
        torch.library.opcheck(torch.ops.trifuse.cross_entropy.default,
                              (logits, target, -100, reduction, 0.1, torch.float32))
    _, lse, count = torch.ops.trifuse.cross_entropy(logits.detach(), target, -100, "mean", 0.1, torch.float32)
    torch.library.opcheck(torch.ops.trifuse.cross_entropy_backward.default,
                          (torch.ones((), device=DEVICE), logits.detach(), target, lse, count, -100, "mean", 0.1))


# ---------------------------------------------------------------------------------------------
# linear_cross_entropy
# ---------------------------------------------------------------------------------------------


def make_head(tokens, hidden, vocab, dtype, with_bias=False, batch=None):
    lead = (tokens,) if batch is None else (batch, tokens)
    h = (torch.randn(*lead, hidden, device=DEVICE, dtype=torch.float64)).to(dtype)
    w = (torch.randn(vocab, hidden, device=DEVICE, dtype=torch.float64) / hidden**0.5).to(dtype)
    b = (torch.randn(vocab, device=DEVICE, dtype=torch.float64) * 0.1).to(dtype) if with_bias else None
    return h, w, b


def check_lce(h, w, target, b=None, reduction="mean", label_smoothing=0.0, ignore_index=-100,
              chunk_size=None, **kwargs):
    """Loss and every gradient against float64, bounded by PyTorch's own error in the inputs'
    dtype (F.linear + F.cross_entropy, no upcast: the semantics the op keeps)."""
    inputs = [leaf(t) for t in (h, w, b) if t is not None]
    out = trifuse.ops.linear_cross_entropy(*inputs[:2], target, inputs[2] if b is not None else None,
                                           ignore_index, reduction, label_smoothing, chunk_size=chunk_size, **kwargs)
    in64 = [leaf(t, torch.float64) for t in inputs]
    inlp = [leaf(t) for t in inputs]
    args = (ignore_index, reduction, label_smoothing)
    ref = linear_cross_entropy_ref(*in64[:2], target.long(), in64[2] if b is not None else None, *args)
    ref_lp = linear_cross_entropy_ref(*inlp[:2], target.long(), inlp[2] if b is not None else None, *args)
    assert out.shape == ref.shape
    assert_close(f"loss {reduction}", out, ref, ref_lp)
    dout = torch.randn(ref.shape, device=DEVICE, dtype=torch.float64)
    g = grads_of(out, inputs, dout)
    g64 = grads_of(ref, in64, dout)
    glp = grads_of(ref_lp, inlp, dout)
    for name, a, a64, alp, t in zip(("dhidden", "dweight", "dbias"), g, g64, glp, inputs):
        assert a.dtype == t.dtype and a.shape == t.shape
        assert_close(f"{name} {reduction}", a, a64, alp)
    return out


@pytest.mark.parametrize("label_smoothing, with_bias", [(0.0, False), (0.1, True)], ids=["plain", "smoothed-bias"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", LCE_SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_cross_entropy_matches_float64_oracle(dtype, shape, reduction, label_smoothing, with_bias):
    tokens, hidden, vocab = shape
    h, w, b = make_head(tokens, hidden, vocab, dtype, with_bias)
    out = check_lce(h, w, make_target((tokens,), vocab), b, reduction, label_smoothing)
    assert out.dtype == dtype


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 10, 11, 64])
def test_linear_cross_entropy_chunk_boundaries(chunk_size, reduction):
    """Chunks that do not divide the 11 tokens, one per token, and one covering them all."""
    h, w, b = make_head(11, 16, 7, torch.float32, with_bias=True)
    check_lce(h, w, make_target((11,), 7), b, reduction, 0.1, chunk_size=chunk_size)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignore", ["all", "none"])
def test_linear_cross_entropy_ignored_everywhere_and_nowhere(ignore, reduction):
    h, w, b = make_head(7, 8, 13, torch.float32, with_bias=True)
    out = check_lce(h, w, make_target((7,), 13, ignore), b, reduction, 0.1, chunk_size=3)
    if ignore == "all" and reduction == "mean":
        assert torch.isnan(out)


def test_linear_cross_entropy_batched_and_strided_inputs():
    """(B, S, H) hidden with (B, S) targets; a sliced hidden, a column-sliced weight and a shifted
    label view (HF's labels[:, 1:]) are read as they are."""
    h, w, b = make_head(6, 10, 9, torch.float32, with_bias=True, batch=3)
    check_lce(h, w, make_target((3, 6), 9), b, "none", 0.1, chunk_size=4)
    big_h = torch.randn(3, 7, 24, device=DEVICE)
    big_w = torch.randn(9, 30, device=DEVICE) / 5
    labels = make_target((3, 8), 9)
    check_lce(big_h[:, 1:, 4:14], big_w[:, 3:13], labels[:, 1:7], None, "mean", chunk_size=5)


def test_linear_cross_entropy_tied_weights_accumulate_both_gradients():
    """The same Parameter as embedding and head: its gradient is the sum of both uses."""
    vocab, hidden, tokens = 11, 8, 9
    weight = torch.nn.Parameter(torch.randn(vocab, hidden, device=DEVICE) / 3)
    proj = torch.randn(hidden, hidden, device=DEVICE) / 3
    ids = torch.randint(0, vocab, (tokens,), device=DEVICE)
    labels = make_target((tokens,), vocab)

    def model(w, head, embedding_grad=True):
        emb = F.embedding(ids, w if embedding_grad else w.detach())
        return head(torch.tanh(emb @ proj.to(w.dtype)), w, labels)

    loss = model(weight, lambda h, w, t: trifuse.ops.linear_cross_entropy(h, w, t, chunk_size=4))
    loss.backward()
    w64 = leaf(weight, torch.float64)
    ref = model(w64, linear_cross_entropy_ref)
    (tied64,) = torch.autograd.grad(ref, w64)
    (head_only64,) = torch.autograd.grad(model(w64, linear_cross_entropy_ref, embedding_grad=False), w64)
    assert_close("tied loss", loss, ref, None)
    assert_close("tied dweight", weight.grad, tied64, None)
    ok, msg = check_close("head-only dweight", weight.grad, head_only64, None)
    assert not ok, msg


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=str)
def test_linear_cross_entropy_under_autocast(dtype):
    """fp32 master weights and hidden under autocast: matmuls in the autocast dtype, fp32 loss,
    gradients in fp32; PyTorch's own error is the HF path's (F.linear -> logits.float() -> CE)."""
    h, w, b = make_head(10, 16, 21, torch.float32, with_bias=True)
    target = make_target((10,), 21)
    inputs, in_lp, in64 = [leaf(t) for t in (h, w, b)], [leaf(t) for t in (h, w, b)], [leaf(t, torch.float64) for t in (h, w, b)]
    with torch.autocast(DEVICE, dtype=dtype):
        out = trifuse.ops.linear_cross_entropy(inputs[0], inputs[1], target, inputs[2], chunk_size=4)
        ref_lp = linear_cross_entropy_ref(in_lp[0], in_lp[1], target, in_lp[2], upcast=True)
    ref = linear_cross_entropy_ref(in64[0], in64[1], target, in64[2])
    assert out.dtype == torch.float32
    assert_close("autocast loss", out, ref, ref_lp)
    grads = zip(("dh", "dw", "db"), torch.autograd.grad(out, inputs), torch.autograd.grad(ref, in64),
                torch.autograd.grad(ref_lp, in_lp))
    for name, a, a64, alp in grads:
        assert a.dtype == torch.float32
        assert_close(f"autocast {name}", a, a64, alp)


def test_linear_cross_entropy_gradcheck_float64():
    h, w, b = make_head(5, 3, 7, torch.float64, with_bias=True)
    target = make_target((5,), 7)
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(
            lambda *a, r=reduction: trifuse.ops.linear_cross_entropy(a[0], a[1], target, a[2], reduction=r,
                                                        label_smoothing=0.1, chunk_size=2),
            tuple(leaf(t) for t in (h, w, b)), fast_mode=True)


def test_linear_cross_entropy_is_deterministic():
    h, w, b = make_head(21, 16, 50, torch.float32, with_bias=True)
    target = make_target((21,), 50)
    runs = []
    for _ in range(2):
        inputs = [leaf(t) for t in (h, w, b)]
        loss = trifuse.ops.linear_cross_entropy(*inputs[:2], target, inputs[2], chunk_size=6)
        runs.append((loss, *torch.autograd.grad(loss, inputs)))
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_eager_path_and_registered_op_are_bitwise_equal(reduction):
    h, w, b = make_head(10, 16, 21, torch.float32, with_bias=True)
    target = make_target((10,), 21)
    inputs = [leaf(t) for t in (h, w, b)]
    eager = trifuse.ops.linear_cross_entropy(*inputs[:2], target, inputs[2], reduction=reduction,
                                             label_smoothing=0.1, chunk_size=4)
    op = torch.ops.trifuse.linear_cross_entropy(*inputs[:2], target, inputs[2], -100, reduction, 0.1,
                                                torch.float32, torch.float32, 4, True, True, True)[0]
    assert torch.equal(eager, op)
    dout = torch.randn_like(eager)
    for a, b_ in zip(torch.autograd.grad(eager, inputs, dout), torch.autograd.grad(op, inputs, dout)):
        assert torch.equal(a, b_)


def test_linear_cross_entropy_recomputed_backward_matches_forward_gradients():
    """The backward op's two ways (scale the forward's gradients / recompute per chunk) agree."""
    h, w, b = make_head(10, 16, 21, torch.float32, with_bias=True)
    target = make_target((10,), 21)
    out = torch.ops.trifuse.linear_cross_entropy(h, w, target, b, -100, "mean", 0.1, torch.float32,
                                                 torch.float32, 4, True, True, True)
    _, lse, count, dh, dw, db = out
    dloss = torch.tensor(1.7, device=DEVICE)
    args = (-100, "mean", 0.1, torch.float32, 4, True, True, True)
    scaled = torch.ops.trifuse.linear_cross_entropy_backward(dloss, h, w, target, b, lse, count, dh, dw, db, *args)
    none = h.new_empty(0)
    recomputed = torch.ops.trifuse.linear_cross_entropy_backward(dloss, h, w, target, b, lse, count,
                                                                 none, none, none, *args)
    for a, r in zip(scaled, recomputed):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("variant", ["mean", "none", "mean-autocast"])
def test_linear_cross_entropy_compiles_fullgraph_without_graph_breaks(variant):
    reduction, autocast = variant.split("-")[0], variant.endswith("autocast")
    h, w, b = make_head(9, 8, 13, torch.float32, with_bias=True)
    target = make_target((9,), 13)

    def fn(h, w, b):
        with torch.autocast(DEVICE, dtype=torch.float16, enabled=autocast):
            return trifuse.ops.linear_cross_entropy(h, w, target, b, reduction=reduction, chunk_size=4)

    inputs = [leaf(t) for t in (h, w, b)]
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(*inputs)
    ref = fn(*inputs)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    for a, r in zip(torch.autograd.grad(out.sum(), inputs), torch.autograd.grad(ref.sum(), inputs)):
        torch.testing.assert_close(a, r)


def test_linear_cross_entropy_opcheck():
    h, w, b = make_head(6, 8, 13, torch.float32, with_bias=True)
    target = make_target((6,), 13)
    inputs = [leaf(t) for t in (h, w, b)]
    for reduction in REDUCTIONS:
        torch.library.opcheck(torch.ops.trifuse.linear_cross_entropy.default,
                              (*inputs[:2], target, inputs[2], -100, reduction, 0.1, torch.float32, torch.float32,
                               4, True, True, True))
    _, lse, count, *_ = torch.ops.trifuse.linear_cross_entropy(h, w, target, b, -100, "none", 0.1, torch.float32,
                                                               torch.float32, 4, False, False, False)
    none = h.new_empty(0)
    torch.library.opcheck(torch.ops.trifuse.linear_cross_entropy_backward.default,
                          (torch.ones(6, device=DEVICE), h, w, target, b, lse, count, none, none, none,
                           -100, "none", 0.1, torch.float32, 4, True, True, True))


def test_linear_cross_entropy_without_grad_computes_only_the_loss():
    h, w, _ = make_head(5, 8, 13, torch.float32)
    target = make_target((5,), 13)
    with torch.no_grad():
        out = torch.ops.trifuse.linear_cross_entropy(leaf(h), leaf(w), target, None, -100, "mean", 0.0,
                                                     torch.float32, torch.float32, None, False, False, False)
    assert all(t.numel() == 0 for t in out[3:])
    assert_close("no-grad loss", out[0], linear_cross_entropy_ref(h.double(), w.double(), target), None)


def test_padded_vocab_and_chunk_rows():
    assert [ce_mod.padded_vocab(v) for v in (1, 7, 8, 64, 50257, 50304)] == [64, 64, 8, 64, 50304, 50304]
    cpu = torch.device("cpu")
    # GPT-2 medium in bf16 on CPU: the CPU budget (256 MiB of logits) gives four balanced chunks.
    rows = ce_mod.chunk_rows(8192, 50304, 1024, torch.bfloat16, cpu)
    assert rows == 2048 and rows * 50304 * 2 <= ce_mod.CPU_CHUNK_BYTES
    # Small problems take one chunk; tiny hidden sizes keep the logits near the weight's size.
    assert ce_mod.chunk_rows(11, 64, 16, torch.float32, cpu) == 11
    rows = ce_mod.chunk_rows(10000, 64, 16, torch.float32, cpu)
    assert rows < 10000 and rows * 64 * 4 <= 8 * 64 * 16 + 128 * 64 * 4
    assert ce_mod.chunk_rows(0, 64, 16, torch.float32, cpu) == 1


# ---------------------------------------------------------------------------------------------
# The host path: inference computes the loss alone; the chunk size is decided once per problem;
# unused gradients are None; chunks are addressed by row0; one launch scales all gradients.
# ---------------------------------------------------------------------------------------------


class _Launches:
    """Records the constexprs of every launch of the cross-entropy kernels, launching them too."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("_cross_entropy_fwd", "_cross_entropy_bwd", "_cross_entropy_reduce", "_scale_cast"):
            kernel = getattr(ce_mod, name)
            monkeypatch.setattr(kernel, "run", self._spy(name, kernel.run))

    def _spy(self, name, run):
        def spy(grid, args, kwargs):
            self.calls.append((name, kwargs))
            return run(grid, args, kwargs)
        return spy

    def of(self, name):
        return [kw for n, kw in self.calls if n == name]


@pytest.fixture
def launches(monkeypatch):
    if not (ON_GPU or INTERPRETED):
        pytest.skip("the launch counts are those of the Triton kernels")
    return _Launches(monkeypatch)


def _forbid(monkeypatch, *names):
    def boom(*args, **kwargs):
        raise AssertionError("gradient work in a loss-only call")
    for name in names:
        monkeypatch.setattr(ce_mod, name, boom)


@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_inference_computes_the_loss_alone(launches, monkeypatch, mode, reduction):
    """Same bits as the training call's loss, but no dlogits, no gradient matmul, no lse, no
    gradient buffer and no autograd node."""
    h, w, b = make_head(10, 16, 21, torch.float32, with_bias=True)
    target = make_target((10,), 21)
    inputs = [leaf(t) for t in (h, w, b)]
    trained = trifuse.ops.linear_cross_entropy(*inputs[:2], target, inputs[2], reduction=reduction,
                                               label_smoothing=0.1, chunk_size=4)
    launches.calls.clear()
    _forbid(monkeypatch, "_accumulate", "_head_grads_out", "scale_cast", "count_rows", "_rows_bwd")
    with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
        args = (h, w, target, b) if mode == "inputs_without_grad" else (*inputs[:2], target, inputs[2])
        loss = trifuse.ops.linear_cross_entropy(*args, reduction=reduction, label_smoothing=0.1, chunk_size=4)
    assert loss.grad_fn is None and not loss.requires_grad
    assert torch.equal(loss, trained.detach())
    fwd = launches.of("_cross_entropy_fwd")
    assert len(fwd) == 3  # one per chunk of 4 of the 10 tokens
    assert not any(kw["STORE_GRAD"] or kw["STORE_LSE"] for kw in fwd)
    assert not launches.of("_scale_cast") and not launches.of("_cross_entropy_bwd")


def test_cross_entropy_inference_computes_the_loss_alone(launches):
    logits = torch.randn(7, 30, device=DEVICE, requires_grad=True)
    target = make_target((7,), 30)
    trained = trifuse.ops.cross_entropy(logits, target, label_smoothing=0.1)
    launches.calls.clear()
    with torch.no_grad():
        loss = trifuse.ops.cross_entropy(logits, target, label_smoothing=0.1)
    assert loss.grad_fn is None and torch.equal(loss, trained.detach())
    assert [kw["STORE_LSE"] for kw in launches.of("_cross_entropy_fwd")] == [False]


def test_linear_cross_entropy_training_call_stores_what_its_backward_needs(launches):
    """The counterpart of the inference test: "mean" computes the count first and dlogits in the
    forward (no lse); "none" keeps lse and recomputes; the backward scales in one launch."""
    h, w, b = make_head(10, 16, 21, torch.float32, with_bias=True)
    target = make_target((10,), 21)
    for reduction, store_grad, store_lse in (("mean", True, False), ("none", False, True)):
        inputs = [leaf(t) for t in (h, w, b)]
        launches.calls.clear()
        loss = trifuse.ops.linear_cross_entropy(*inputs[:2], target, inputs[2], reduction=reduction, chunk_size=4)
        fwd = launches.of("_cross_entropy_fwd")
        assert [(kw["STORE_GRAD"], kw["STORE_LSE"]) for kw in fwd] == [(store_grad, store_lse)] * 3
        counts = [kw["COUNT_ONLY"] for kw in launches.of("_cross_entropy_reduce")]
        assert counts == ([True, False] if reduction == "mean" else [])
        launches.calls.clear()
        torch.autograd.grad(loss, inputs, torch.ones_like(loss))
        if reduction == "mean":
            assert [n for n, _ in launches.calls] == ["_scale_cast"]
        else:
            assert [n for n, _ in launches.calls].count("_cross_entropy_bwd") == 3


def test_chunk_rows_queries_free_memory_once_per_problem(monkeypatch):
    calls = []

    def mem_get_info(device=None):
        calls.append(device)
        return 2**30, 2**31

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    ce_mod.chunk_rows.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        rows = [ce_mod.chunk_rows(8192, 50304, 1024, torch.bfloat16, cuda) for _ in range(3)]
        assert len(calls) == 1 and rows[0] == rows[1] == rows[2]
        # a quarter of 1 GiB free over 50304 bf16 columns: 2668 rows, balanced to 4 chunks of 2048
        assert rows[0] == 2048
        ce_mod.chunk_rows(4096, 50304, 1024, torch.bfloat16, cuda)
        ce_mod.chunk_rows(8192, 50304, 1024, torch.float32, cuda)
        assert len(calls) == 3
    finally:
        ce_mod.chunk_rows.cache_clear()


def test_linear_cross_entropy_decides_the_chunk_size_once_per_shape():
    h, w, _ = make_head(9, 8, 13, torch.float32)
    target = make_target((9,), 13)
    ce_mod.chunk_rows.cache_clear()
    for _ in range(3):
        inputs = [leaf(t) for t in (h, w)]
        torch.autograd.grad(trifuse.ops.linear_cross_entropy(*inputs, target, reduction="none").sum(), inputs)
    info = ce_mod.chunk_rows.cache_info()
    assert info.misses == 1 and info.hits == 5  # 3 forwards and 3 recomputing backwards


class _DropGrad(torch.autograd.Function):
    """Passes its input on, but gives it no gradient: the loss's backward gets None."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return None


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_backward_with_no_incoming_gradient_does_nothing(monkeypatch, path, reduction):
    h, w, _ = make_head(6, 8, 13, torch.float32)
    target = make_target((6,), 13)
    hl, wl = leaf(h), leaf(w)
    if path == "eager":
        loss = trifuse.ops.linear_cross_entropy(hl, wl, target, reduction=reduction)
    else:
        loss = torch.ops.trifuse.linear_cross_entropy(hl, wl, target, None, -100, reduction, 0.0, torch.float32,
                                                      torch.float32, None, True, True, False)[0]
    _forbid(monkeypatch, "_head_grads_out", "scale_cast", "recompute_head_grads", "scale_head_grads")
    out = _DropGrad.apply(loss).sum() + (hl * 0).sum()
    gh, gw = torch.autograd.grad(out, (hl, wl), allow_unused=True)
    assert torch.equal(gh, torch.zeros_like(h)) and gw is None


@pytest.mark.parametrize("path", ["eager", "op"])
def test_cross_entropy_backward_with_no_incoming_gradient_does_nothing(monkeypatch, path):
    logits = torch.randn(5, 9, device=DEVICE, requires_grad=True)
    target = make_target((5,), 9)
    if path == "eager":
        loss = trifuse.ops.cross_entropy(logits, target)
    else:
        loss = torch.ops.trifuse.cross_entropy(logits, target, -100, "mean", 0.0, torch.float32)[0]
    _forbid(monkeypatch, "cross_entropy_bwd")
    out = _DropGrad.apply(loss) + logits.sum() * 0
    (g,) = torch.autograd.grad(out, logits)
    assert torch.equal(g, torch.zeros_like(logits))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_chunks_agree_with_one_chunk(reduction):
    """row0 addressing: every chunk size gives the single chunk's loss and gradients (to the
    rounding of the matmuls, which block differently per size), ignored rows included."""
    h, w, b = make_head(13, 8, 21, torch.float32, with_bias=True)
    target = make_target((13,), 21)
    target[-1] = -100
    results = []
    for chunk in (13, 5, 1):
        inputs = [leaf(t) for t in (h, w, b)]
        loss = trifuse.ops.linear_cross_entropy(*inputs[:2], target, inputs[2], reduction=reduction,
                                                label_smoothing=0.1, chunk_size=chunk)
        results.append((loss, *torch.autograd.grad(loss, inputs, torch.ones_like(loss))))
    for other in results[1:]:
        for a, r in zip(other, results[0]):
            torch.testing.assert_close(a, r)


def test_scale_cast_three_slots_in_one_launch(launches):
    """Slots of different sizes (more than one block each, and a tiny one) and dtypes."""
    xs = [torch.randn(5000, device=DEVICE), torch.randn(3, device=DEVICE), torch.randn(9000, device=DEVICE)]
    ys = [torch.empty(4999, device=DEVICE, dtype=torch.float16), torch.empty(3, device=DEVICE),
          torch.empty(30, 300, device=DEVICE, dtype=torch.float16)]
    g = torch.tensor(0.37, device=DEVICE)
    ce_mod.scale_cast(list(zip(xs, ys)), g)
    assert len(launches.of("_scale_cast")) == 1
    for x, y in zip(xs, ys):
        assert torch.equal(y, (x[: y.numel()].view(y.shape) * g).to(y.dtype))
    ce_mod.scale_cast([(xs[1], ys[1])], None)
    assert torch.equal(ys[1], xs[1])


def test_count_rows_counts_the_non_ignored_targets():
    target = make_target((5000,), 10)
    count = ce_mod.count_rows(target, -100, torch.float32)
    assert count.shape == () and count.item() == (target != -100).sum().item()


# ---------------------------------------------------------------------------------------------
# Out-of-range targets: a ValueError on CPU, NaN (never a wrong number, never a bad read) on CUDA
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [7, -1], ids=["C", "negative"])
def test_out_of_range_target(bad):
    logits = torch.randn(4, 7, device=DEVICE)
    target = torch.tensor([1, bad, 2, -100], device=DEVICE)
    h, w, _ = make_head(4, 8, 7, torch.float32)
    if ON_GPU:
        assert torch.isnan(trifuse.ops.cross_entropy(logits, target))
        assert torch.isnan(trifuse.ops.linear_cross_entropy(h, w, target))
    else:
        with pytest.raises(ValueError, match=f"cross_entropy: target must hold class indices in \\[0, 7\\).*got {bad}"):
            trifuse.ops.cross_entropy(logits, target)
        with pytest.raises(ValueError, match="linear_cross_entropy: target must hold class indices"):
            trifuse.ops.linear_cross_entropy(h, w, target)


@pytest.mark.skipif(not (ON_GPU or INTERPRETED), reason="the device-side check lives in the Triton kernels")
def test_kernels_turn_out_of_range_targets_into_nan():
    """What CUDA tensors get (the CPU check is skipped there): NaN loss and NaN gradient for that
    row only, with the padded columns still zero."""
    x = torch.randn(3, 64, device=DEVICE)
    target = torch.tensor([1, 9, -3], device=DEVICE)
    loss, lse = torch.empty(3, device=DEVICE), torch.empty(3, 2, device=DEVICE)
    dx = torch.empty(3, 64, device=DEVICE)
    ce_mod._rows_fwd(x, target, 9, -100, 0.1, loss, lse, dx=dx)
    assert not torch.isnan(loss[0]) and torch.isnan(loss[1:]).all()
    assert not torch.isnan(dx[0]).any() and torch.isnan(dx[1:, :9]).all() and (dx[:, 9:] == 0).all()
    ce_mod._rows_bwd(x, target, lse, torch.ones((), device=DEVICE), None, 9, -100, 0.1, dx, False)
    assert not torch.isnan(dx[0]).any() and torch.isnan(dx[1:, :9]).all()


# ---------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations must fail the same tolerance.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_smoothing_over_the_other_classes_fails(dtype):
    """Label smoothing that spreads e over the C - 1 wrong classes (another common definition)."""
    logits = torch.randn(8, 10, device=DEVICE, dtype=dtype)
    target = make_target((8,), 10, "none")
    logp = torch.log_softmax(logits.float(), dim=1)
    nll = -logp.gather(1, target[:, None])[:, 0]
    others = -(logp.sum(dim=1) + nll * -1)  # sum over j != t of -log p_j
    wrong = ((1 - 0.1) * nll + 0.1 / 9 * others).mean().to(dtype)
    ok, msg = check_close("smoothing over C-1", wrong, cross_entropy_ref(logits.double(), target, label_smoothing=0.1),
                          cross_entropy_ref(logits, target, label_smoothing=0.1))
    assert not ok, msg


def test_negative_control_mean_over_all_rows_fails():
    """Dividing by every row instead of the non-ignored ones."""
    logits = torch.randn(9, 10, device=DEVICE)
    target = make_target((9,), 10, "some")
    wrong = trifuse.ops.cross_entropy(logits, target, reduction="sum") / 9
    ok, msg = check_close("mean over all rows", wrong, cross_entropy_ref(logits.double(), target), None)
    assert not ok, msg


def test_negative_control_unmasked_vocabulary_padding_fails():
    """The padded head's extra columns (logit 0) counted as classes."""
    h, w, _ = make_head(6, 8, 7, torch.float32)
    target = make_target((6,), 7, "none")
    vp = ce_mod.padded_vocab(7)
    logits = h @ ce_mod._pad_rows(w, vp, torch.float32).t()
    loss, lse = torch.empty(6, device=DEVICE), torch.empty(6, 2, device=DEVICE)
    ce_mod._rows_fwd(logits, target, vp, -100, 0.0, loss, lse)
    ok, msg = check_close("unmasked padding", loss.mean(), linear_cross_entropy_ref(h.double(), w.double(), target), None)
    assert not ok, msg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_softmax_without_max_subtraction_fails(dtype):
    """A naive log(sum(exp(x))) overflows for large logits (here 100 + noise, fine in fp16)."""
    logits = (torch.randn(4, 50, device=DEVICE) + 100).to(dtype)
    target = make_target((4,), 50, "none")
    x = logits.float()
    wrong = (torch.log(torch.exp(x).sum(dim=1)) - x.gather(1, target[:, None])[:, 0]).mean().to(dtype)
    ok, msg = check_close("no max subtraction", wrong, cross_entropy_ref(logits.double(), target),
                          cross_entropy_ref(logits, target))
    assert not ok, msg


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the op and the argument, in eager and under compile.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, exc, match",
    [
        ({"target": torch.zeros(4)}, TypeError, "cross_entropy: target must hold integer class indices"),
        ({"target": torch.zeros(4, dtype=torch.bool)}, TypeError, "target must hold integer"),
        ({"target": torch.zeros(5, dtype=torch.int64)}, ValueError, r"target must have shape \(4,\)"),
        ({"logits": torch.zeros(4, 6, dtype=torch.int64)}, TypeError, "cross_entropy: input must be float"),
        ({"logits": torch.tensor(1.0)}, ValueError, "input must have a class dimension"),
        ({"reduction": "avg"}, ValueError, "reduction must be one of"),
        ({"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\]"),
        ({"ignore_index": -100.0}, TypeError, "ignore_index must be an int"),
        ({"target": "labels"}, TypeError, "target must be a torch.Tensor"),
    ],
    ids=["float-target", "bool-target", "target-shape", "int-logits", "0-dim", "reduction", "smoothing",
         "ignore-index", "not-tensor"],
)
def test_cross_entropy_bad_input_raises_clear_error(change, exc, match):
    args = {"logits": torch.zeros(4, 6), "target": torch.zeros(4, dtype=torch.int64), "ignore_index": -100,
            "reduction": "mean", "label_smoothing": 0.0}
    args.update(change)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(exc, match=match):
        trifuse.ops.cross_entropy(*args.values())


@pytest.mark.parametrize(
    "change, exc, match",
    [
        ({"weight": torch.zeros(7, 5)}, ValueError, r"linear_cross_entropy: weight must have shape \(V, 8\)"),
        ({"bias": torch.zeros(6)}, ValueError, r"bias must have shape \(7,\)"),
        ({"target": torch.zeros(3, dtype=torch.int64)}, ValueError, r"target must have shape \(4,\)"),
        ({"target": torch.zeros(4)}, TypeError, "target must hold integer class indices"),
        ({"weight": torch.zeros(7, 8, dtype=torch.float16)}, TypeError, "outside autocast they must agree"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
        ({"reduction": "mean "}, ValueError, "reduction must be one of"),
        ({"hidden": torch.zeros(4, 8, dtype=torch.int32)}, TypeError, "hidden must be float"),
        ({"weight": torch.zeros(0, 8)}, ValueError, "weight has no rows"),
    ],
    ids=["weight-shape", "bias-shape", "target-shape", "float-target", "dtype-mismatch", "chunk", "reduction",
         "int-hidden", "empty-vocab"],
)
def test_linear_cross_entropy_bad_input_raises_clear_error(change, exc, match):
    args = {"hidden": torch.zeros(4, 8), "weight": torch.zeros(7, 8), "target": torch.zeros(4, dtype=torch.int64),
            "bias": None, "reduction": "mean", "chunk_size": None}
    args.update(change)
    a = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(exc, match=match):
        trifuse.ops.linear_cross_entropy(a["hidden"], a["weight"], a["target"], a["bias"],
                                         reduction=a["reduction"], chunk_size=a["chunk_size"])


def test_bad_input_raises_under_compile():
    ce = torch.compile(lambda x, t: trifuse.ops.cross_entropy(x, t), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="target must have shape"):
        ce(torch.zeros(4, 6, device=DEVICE), torch.zeros(5, dtype=torch.int64, device=DEVICE))
    lce = torch.compile(lambda h, w, t: trifuse.ops.linear_cross_entropy(h, w, t), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="weight must have shape"):
        lce(torch.zeros(4, 8, device=DEVICE), torch.zeros(7, 5, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE))


def test_mismatched_devices_raise():
    with pytest.raises(ValueError, match="target is on meta"):
        trifuse.ops.cross_entropy(torch.zeros(3, 5, device=DEVICE), torch.zeros(3, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="weight is on meta"):
        trifuse.ops.linear_cross_entropy(torch.zeros(3, 5, device=DEVICE), torch.zeros(4, 5, device="meta"),
                                         torch.zeros(3, dtype=torch.int64, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# Random shapes and the CPU path without the interpreter
# ---------------------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(n=st.integers(0, 8), c=st.integers(1, 300), reduction=st.sampled_from(REDUCTIONS),
       eps=st.sampled_from([0.0, 0.3]), ignore=st.sampled_from(["some", "none", "all"]))
def test_cross_entropy_hypothesis(n, c, reduction, eps, ignore):
    torch.manual_seed(n * 1000 + c)
    check_ce(torch.randn(n, c, device=DEVICE) * 2, make_target((n,), c, ignore), reduction, eps)


@settings(max_examples=10, deadline=None)
@given(t=st.integers(1, 9), h=st.integers(1, 12), v=st.integers(1, 70), chunk=st.integers(1, 10),
       reduction=st.sampled_from(REDUCTIONS), with_bias=st.booleans())
def test_linear_cross_entropy_hypothesis(t, h, v, chunk, reduction, with_bias):
    torch.manual_seed(t * 10000 + h * 100 + v)
    hid, w, b = make_head(t, h, v, torch.float32, with_bias)
    check_lce(hid, w, make_target((t,), v), b, reduction, 0.1, chunk_size=chunk)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["plain", "smoothed"])
@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_loss_at_logits_far_from_zero_is_as_exact_as_pytorchs(monkeypatch, path, label_smoothing):
    """Logits near 1e5: lse = m + log l rounds at m's scale (4e-3 there), so lse - x_t lost as
    much, and so would every p = exp(x - lse) of a backward reading one saved float (2e-3 off
    for the spread-out rows here, against PyTorch's 1e-6). The loss and the gradients take m out
    first, as log_softmax does: the forward keeps m and log l apart and saves both. The fused
    head's "mean" computes its gradients in the forward, its "none" recomputes them from both.
    Label smoothing's mean logit is summed as differences from the row's first logit."""
    if path == "torch":
        monkeypatch.setattr(ce_mod, "use_triton", lambda t: False)
    logits = torch.randn(6, 300, device=DEVICE, dtype=torch.float64) * 30 + 1e5
    target = make_target((6,), 300)
    for reduction in ("none", "mean"):
        check_ce(logits.float(), target, reduction, label_smoothing)
    # Smoothing's mean logit, over two classes near 1e4: a plain fp32 sum of them is 1e-3 off.
    two = torch.randn(6, 2, device=DEVICE, dtype=torch.float64) - 1e4
    check_ce(two.float(), make_target((6,), 2, "none"), "none", label_smoothing * 7)
    h, w, b = make_head(9, 16, 40, torch.float32, with_bias=True)
    for reduction in ("none", "mean"):
        check_lce(h, w * 8, make_target((9,), 40), b + 1e5, reduction, label_smoothing)


def test_reference_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: same maths, same API."""
    monkeypatch.setattr(ce_mod, "use_triton", lambda t: False)
    for reduction in REDUCTIONS:
        check_ce(torch.randn(6, 40, device=DEVICE), make_target((6,), 40), reduction, 0.1)
        h, w, b = make_head(7, 8, 13, torch.float32, with_bias=True)
        check_lce(h, w, make_target((7,), 13), b, reduction, 0.1, chunk_size=3)


# ---------------------------------------------------------------------------------------------
# GPU only: memory stays O(chunk x vocab)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_linear_cross_entropy_never_holds_the_full_logits():
    tokens, hidden, vocab = 4096, 256, 50257
    h, w, _ = make_head(tokens, hidden, vocab, torch.bfloat16)
    h.requires_grad_()
    w.requires_grad_()
    target = make_target((tokens,), vocab)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = trifuse.ops.linear_cross_entropy(h, w, target)
    torch.autograd.grad(loss, (h, w))
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < tokens * vocab * 2 / 2, f"peak {peak / 2**20:.0f} MiB against {tokens * vocab * 2 / 2**20:.0f} MiB of logits"
