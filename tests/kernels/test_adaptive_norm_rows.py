"""Per-token modulation: y = norm(x) * (mul + mul_offset) + add with mul and add varying along a
sample's rows (`trifuse.ops.layer_norm_modulate`, the row kernels of kernels/adaptive_norm.py):
FLUX.3's and Qwen-Image 2.1's `(1 + scale) * norm(x) + shift`, scale and shift (B, S, N) chunks of
one (B, S, 3N) projection.

Outputs and the gradients of x, mul, add, weight and bias against the float64 oracle (the formula
as models write it, `1 + scale` rounded in the modulation's dtype) by the rule of
tests/tolerances.py. On CPU these run the real Triton kernels in the interpreter; on a GPU the
same tests add bf16.
"""
import pytest
import torch
import torch.nn.functional as F
import trifuse
from _device import DEVICE
from _fusing import call_of, dtype_casts, traced_graphs
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close
from trifuse.kernels import adaptive_norm as an

EPS = 1e-6
NORMS = ["layer_norm", "rms_norm"]


def formula(x, mul, add, w, b, norm, mul_offset=0.0):
    """The oracle: the norm, then `(mul + mul_offset) * y + add` as the models write it."""
    if norm == "rms_norm":
        y = F.rms_norm(x, [x.shape[-1]], w, EPS)
    else:
        y = F.layer_norm(x, [x.shape[-1]], w, b, EPS)
    if mul is not None:
        y = (mul + mul_offset if mul_offset else mul) * y
    return y if add is None else y + add


# (x shape, mul shape, add shape): full-size, 4-D video tokens, 2-D rows, a per-row scalar, one
# table shared by the batch, per-token mul beside a per-sample add, mul or add alone, odd widths
# from 1 to past a power of two.
CASES = [
    ((2, 7, 33), (2, 7, 33), (2, 7, 33)),
    ((2, 3, 5, 16), (2, 3, 5, 16), (2, 3, 5, 16)),
    ((13, 129), (13, 129), (13, 129)),
    ((3, 6, 24), (3, 6, 1), (3, 6, 24)),
    ((3, 5, 40), (1, 5, 40), (5, 40)),
    ((2, 9, 48), (2, 9, 48), (2, 1, 48)),
    ((2, 8, 1000), (2, 8, 1000), None),
    ((3, 4, 1), None, (3, 4, 1)),
    ((4, 3, 7), (4, 3, 7), (4, 3, 7)),
]


def _id(case):
    return "-".join("none" if s is None else "x".join(map(str, s)) for s in case)


def make(case, dtype, norm, affine=True):
    x_shape, mul_shape, add_shape = case
    n = x_shape[-1]

    def t(shape, scale=1.0, offset=0.0):
        return None if shape is None else (torch.randn(shape, device=DEVICE) * scale + offset).to(dtype)

    x = t(x_shape, 2.0, 0.5)
    mul, add = t(mul_shape, 0.5), t(add_shape)
    w = t((n,), 0.3, 1.0) if affine else None
    b = t((n,)) if affine and norm == "layer_norm" else None
    return [None if v is None else v.requires_grad_() for v in (x, mul, add, w, b)]


def run(inputs, norm, mul_offset=1.0, **kwargs):
    x, mul, add, w, b = inputs
    return trifuse.ops.layer_norm_modulate(x, [x.shape[-1]], mul, add, w, b, EPS, is_rms_norm=norm == "rms_norm",
                                           mul_offset=mul_offset if mul is not None else 0.0, **kwargs)


def check_fwd_bwd(inputs, norm, mul_offset=1.0):
    """y and every gradient against float64 by the oracle rule, PyTorch in the inputs' dtypes the
    yardstick."""
    offset = mul_offset if inputs[1] is not None else 0.0
    i64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ilp = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y = run(inputs, norm, offset)
    y64, ylp = formula(*i64, norm, offset), formula(*ilp, norm, offset)
    assert y.shape == ylp.shape and y.dtype == ylp.dtype
    assert_close("y", y, y64, ylp)
    g = torch.randn_like(y64)
    for out, gy in ((y, g.to(y.dtype)), (y64, g), (ylp, g.to(ylp.dtype))):
        out.backward(gy)
    for name, a, a64, alp in zip(("dx", "dmul", "dadd", "dweight", "dbias"), inputs, i64, ilp):
        if a is not None:
            assert a.grad is not None and a.grad.dtype == a.dtype and a.grad.shape == a.shape, name
            assert_close(name, a.grad, a64.grad, alp.grad)


@pytest.fixture
def rows_spy(monkeypatch):
    """Counts the row kernels' launches (the forward's host function), and fails a fold of the
    modulation into per-row affine parameters (the per-sample path)."""
    calls = []
    real = an._rows_fwd

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    def no_fold(*args):
        raise AssertionError("a per-token modulation took the per-sample (folded) path")

    monkeypatch.setattr(an, "_rows_fwd", spy)
    monkeypatch.setattr(an, "_folded_affine", no_fold)
    return calls


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_oracle(dtype, norm, case, rows_spy):
    check_fwd_bwd(make(case, dtype, norm), norm)
    assert rows_spy, "the row kernels did not run"


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("mul_offset", [0.0, 1.0, -0.5])
def test_without_the_norms_own_affine(norm, mul_offset, rows_spy):
    """DiT's norms have no affine of their own (the common case: no partial sums at all)."""
    check_fwd_bwd(make(((3, 5, 40), (3, 5, 40), (3, 5, 40)), torch.float32, norm, affine=False), norm, mul_offset)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("affine", [False, True])
def test_wide_rows(norm, affine, rows_spy):
    """Rows past the single-block width: the chunked forward and backward."""
    check_fwd_bwd(make(((1, 2, 17000), (1, 2, 17000), (1, 2, 17000)), torch.float32, norm, affine), norm)


def test_chunks_of_one_projection_are_read_in_place():
    """FLUX.3's block: shift, scale and gate chunks of one (B, S, 3N) tensor (rows 3N apart), with
    `(1 + scale) * norm(x) + shift`: no copy of the chunks, and the projection's gradient (the
    gate's third empty) against float64."""
    emb = torch.randn(2, 6, 3 * 40, device=DEVICE, requires_grad=True)
    x = torch.randn(2, 6, 40, device=DEVICE, requires_grad=True)
    shift, scale, _ = emb.chunk(3, dim=-1)
    assert not scale.is_contiguous() and an.as_rows(scale, 40)[1] == 120
    y = trifuse.ops.layer_norm_modulate(x, [40], scale, shift, eps=EPS, mul_offset=1.0)
    x64, emb64 = (t.detach().double().requires_grad_() for t in (x, emb))
    shift64, scale64, _ = emb64.chunk(3, dim=-1)
    y64 = (1 + scale64) * F.layer_norm(x64, [40], eps=EPS) + shift64
    assert_close("y", y, y64, None)
    g = torch.randn_like(y64)
    y.backward(g.float())
    y64.backward(g)
    assert_close("demb", emb.grad, emb64.grad, None)
    assert_close("dx", x.grad, x64.grad, None)
    assert torch.count_nonzero(emb.grad[..., 80:]) == 0


def test_many_rows_split_over_several_programs():
    """Rows spread over several backward programs: the affine's partial sums add every row once."""
    check_fwd_bwd(make(((3, 300, 48), (3, 300, 48), (3, 300, 48)), torch.float32, "layer_norm"), "layer_norm")


def test_mixed_dtypes_promote_like_the_formula():
    """x in fp16, the modulation in fp32: y in fp32 as the formula gives, each gradient in its
    input's dtype."""
    x, mul, add, w, b = make(((2, 5, 32), (2, 5, 32), (2, 5, 32)), torch.float16, "layer_norm")
    mul, add = (t.detach().float().requires_grad_() for t in (mul, add))
    check_fwd_bwd([x, mul, add, w, b], "layer_norm")


def test_strided_input():
    """x and mul transposed views (rows not evenly strided): right without the caller's copy."""
    x = torch.randn(6, 2, 40, device=DEVICE).transpose(0, 1).requires_grad_()
    mul = torch.randn(6, 2, 40, device=DEVICE).transpose(0, 1).requires_grad_()
    _, _, add, w, b = make(((2, 6, 40), None, (2, 6, 40)), torch.float32, "layer_norm")
    assert not x.is_contiguous() and not mul.is_contiguous()
    check_fwd_bwd([x, mul, add, w, b], "layer_norm")


def test_empty_input():
    x, mul, add, w, b = make(((0, 5, 16), (0, 5, 16), (0, 5, 16)), torch.float32, "layer_norm")
    y = run([x, mul, add, w, b], "layer_norm")
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and mul.grad.shape == mul.shape and w.grad.shape == w.shape


def test_large_values_and_offsets():
    """Rows around 1e3 with a small spread (the corrected two-pass mean) and a large modulation."""
    x, mul, add, w, b = make(((2, 6, 64), (2, 6, 64), (2, 6, 64)), torch.float32, "layer_norm")
    x = (x.detach() * 1e-2 + 1e3).requires_grad_()
    mul = (mul.detach() * 1e2).requires_grad_()
    check_fwd_bwd([x, mul, add, w, b], "layer_norm")


def test_deterministic():
    """Bitwise the same outputs and gradients on every run (the affine's sums in a fixed order)."""
    inputs = make(((3, 300, 48), (3, 300, 48), (3, 300, 48)), torch.float32, "layer_norm")
    results = []
    for _ in range(2):
        for t in inputs:
            t.grad = None
        y = run(inputs, "layer_norm")
        y.backward(torch.ones_like(y))
        results.append([y.detach().clone()] + [t.grad.clone() for t in inputs])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_gradcheck_float64():
    x = torch.randn(2, 3, 5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    mul = torch.randn(2, 3, 5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    add = torch.randn(2, 3, 1, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: trifuse.ops.layer_norm_modulate(a[0], [5], *a[1:], eps=EPS, mul_offset=1.0), (x, mul, add, w, b))
    assert torch.autograd.gradcheck(
        lambda *a: trifuse.ops.layer_norm_modulate(a[0], [5], *a[1:], eps=EPS, is_rms_norm=True), (x, mul, add, w))


def test_twice_differentiable():
    """create_graph=True: the gradients differentiate again, in PyTorch ops."""
    inputs = make(((2, 4, 8), (2, 4, 8), (2, 4, 8)), torch.float64, "layer_norm")
    assert torch.autograd.gradgradcheck(
        lambda *a: trifuse.ops.layer_norm_modulate(a[0], [8], *a[1:], eps=EPS, mul_offset=1.0), tuple(inputs),
        fast_mode=True)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("norm", NORMS)
def test_compiles_without_graph_breaks(norm, backend, affine):
    """Under torch.compile(fullgraph=True) the registered op and its backward op run, equal to
    the eager path; with a broadcast add, summed down outside the op."""
    inputs = make(((2, 5, 32), (2, 5, 32), (2, 1, 32)), torch.float32, norm, affine)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: run(a, norm), fullgraph=True, backend=backend)
    i2 = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y, y_eager = compiled(*inputs), run(i2, norm)
    torch.testing.assert_close(y, y_eager)
    y.sum().backward()
    y_eager.sum().backward()
    for a, b in zip(inputs, i2):
        if a is not None:
            torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
def test_registered_ops_pass_opcheck(is_rms_norm, affine):
    """The forward op and the backward op: schema, fake tensors, autograd registration (and no
    output aliasing another: the backward's unneeded gradients are empty tensors of their own)."""
    x = torch.randn(2, 5, 16, device=DEVICE)
    mul, add = torch.randn(2, 5, 16, device=DEVICE), torch.randn(2, 1, 16, device=DEVICE)
    w = torch.randn(16, device=DEVICE) if affine else None
    b = torch.randn(16, device=DEVICE) if affine and not is_rms_norm else None
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.trifuse.norm_modulate_rows.default,
                          (x, mul, add, w, b, EPS, is_rms_norm, 1.0, torch.float32), test_utils=utils)
    _, mean, rstd = torch.ops.trifuse.norm_modulate_rows(x, mul, add, w, b, EPS, is_rms_norm, 1.0, torch.float32)
    for need in ((True, True, True), (False, False, False)):
        torch.library.opcheck(torch.ops.trifuse.norm_modulate_rows_backward.default,
                              (torch.randn_like(x), x, mul, w, b, mean, rstd, EPS, is_rms_norm, 1.0, *need),
                              test_utils=utils)


@pytest.mark.parametrize("bad, error, message", [
    ({"mul_shape": (3, 2, 40)}, ValueError, "one vector per sample or per token"),
    ({"mul_shape": (2, 5, 40)}, ValueError, "one vector per sample or per token"),
    ({"mul_shape": (3, 5, 39)}, ValueError, "last dim 40 or 1"),
    ({"mul_offset": 1.0, "no_mul": True}, ValueError, "needs a mul"),
    ({"mul_offset": "1"}, TypeError, "mul_offset must be a finite number"),
    ({"mul_offset": float("nan")}, TypeError, "mul_offset must be a finite number"),
])
def test_bad_input_names_the_op_and_argument(bad, error, message):
    x = torch.randn(3, 5, 40, device=DEVICE)
    mul = None if bad.get("no_mul") else torch.randn(bad.get("mul_shape", (3, 5, 40)), device=DEVICE)
    with pytest.raises(error, match=message) as err:
        trifuse.ops.layer_norm_modulate(x, [40], mul, torch.randn(3, 5, 40, device=DEVICE), eps=EPS,
                                        mul_offset=bad.get("mul_offset", 0.0))
    assert "trifuse.layer_norm_modulate" in str(err.value)


def test_per_sample_modulation_takes_the_offset_into_its_vector():
    """A per-sample mul with mul_offset: the folded path, `1 + scale` on the small vector."""
    x, mul, add, w, b = make(((3, 5, 40), (3, 1, 40), (3, 1, 40)), torch.float32, "layer_norm")
    check_fwd_bwd([x, mul, add, w, b], "layer_norm", mul_offset=1.0)


# ---------------------------------------------------------------------------------------------
# out_dtype, readers, full_y (fusion/narrow.py sets them) through either candidate
# ---------------------------------------------------------------------------------------------

CANDIDATES = {"trifuse": an._rows_trifuse, "torch": an._rows_torch_candidate}


def _modulated(norm, dtype=torch.float32, vectors=(3, 7, 37)):
    torch.manual_seed(0)
    return make(((3, 7, 37), vectors, vectors), dtype, norm)


def _call(candidate, inputs, norm, **narrowing):
    x, mul, add, w, b = inputs
    defaults = (("out_dtype", None), ("readers", 1), ("full_y", False))
    return CANDIDATES[candidate](x, [37], mul, add, w, b, EPS, norm == "rms_norm", 1.0,
                                 *(narrowing.get(k, d) for k, d in defaults))


@pytest.mark.parametrize("vectors", [(3, 7, 37), (1, 7, 37), (3, 7, 1)], ids=["full", "per-token", "per-row"])
@pytest.mark.parametrize("candidate", CANDIDATES)
@pytest.mark.parametrize("norm", NORMS)
def test_out_dtype_is_the_cast_of_y(candidate, norm, vectors):
    """y in a narrower out_dtype is bitwise y.to(out_dtype), its gradients those of the cast's: a
    broadcast mul's and add's summed in fp32, as the cast's fp32 gradient is (the order of the sum
    may differ: full-size ones bitwise, summed ones to fp32's rounding; fp16 sums miss by 1e-3)."""
    inputs = _modulated(norm, vectors=vectors)
    leaves = [t for t in inputs if t is not None]
    y = _call(candidate, inputs, norm)
    dy = torch.randn(y.shape, device=DEVICE).half()
    grads = torch.autograd.grad(y.half(), leaves, dy)
    y16 = _call(candidate, inputs, norm, out_dtype=torch.float16)
    grads16 = torch.autograd.grad(y16, leaves, dy)
    assert y16.dtype == torch.float16 and torch.equal(y16, y.half())
    for a, c in zip(grads, grads16):
        assert a.dtype == c.dtype
        if a.shape == y.shape or vectors == (3, 7, 37):
            assert torch.equal(a, c)
        else:
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("readers", [2, 3])
@pytest.mark.parametrize("candidate", CANDIDATES)
def test_readers_get_views_whose_gradients_sum_in_fp32(candidate, readers):
    """y as `readers` fp16 tensors each read by its own matmul: every gradient as close to one cast
    of the fp32 y per matmul as the order of a three-term fp32 sum allows (the kernels' views share
    one buffer)."""
    inputs = _modulated("layer_norm")
    leaves = [t for t in inputs if t is not None]
    mats = [torch.randn(37, 5, device=DEVICE).half() for _ in range(readers)]

    def grads(k):
        out = _call(candidate, inputs, "layer_norm", out_dtype=torch.float16 if k > 1 else None, readers=k)
        ys = out if k > 1 else [out.half() for _ in mats]
        assert k == 1 or (len(ys) == k and all(t.dtype == torch.float16 for t in ys))
        assert k == 1 or candidate == "torch" or all(t.data_ptr() == ys[0].data_ptr() for t in ys)
        loss = sum((t @ m).float().square().sum() for t, m in zip(ys, mats))
        return torch.autograd.grad(loss, leaves)

    for a, c in zip(grads(1), grads(readers)):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("candidate", CANDIDATES)
def test_full_y_returns_y_and_its_narrow_copy_whose_gradients_add(candidate):
    inputs = _modulated("layer_norm")
    leaves = [t for t in inputs if t is not None]
    mat, c = torch.randn(37, 5, device=DEVICE).half(), torch.randn(3, 7, 37, device=DEVICE)

    def loss_and_grads(narrow):
        out = _call(candidate, inputs, "layer_norm", out_dtype=torch.float16 if narrow else None, full_y=narrow)
        y, y16 = out if narrow else (out, out.half())
        assert y.dtype == torch.float32 and y16.dtype == torch.float16
        loss = (y16 @ mat).float().square().sum() + (y * c).sum()
        return loss, torch.autograd.grad(loss, leaves)

    (loss, grads), (loss_narrow, grads_narrow) = loss_and_grads(False), loss_and_grads(True)
    assert torch.equal(loss, loss_narrow)
    for a, c2 in zip(grads, grads_narrow):
        torch.testing.assert_close(a, c2, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("candidate", CANDIDATES)
def test_a_wider_out_dtype_is_never_rounded_to_the_inputs_dtype(candidate):
    """fp16 x, mul and add with out_dtype fp32 (CUDA autocast's LayerNorm returns fp32): y and the
    gradients against float64, the yardstick that computation in fp32; y rounded to fp16 on the
    way (the negative control) fails the same check."""
    inputs = _modulated("layer_norm", torch.float16)
    leaves = [t for t in inputs if t is not None]
    y = _call(candidate, inputs, "layer_norm", out_dtype=torch.float32)
    assert y.dtype == torch.float32
    i64 = [t.detach().double().requires_grad_() for t in inputs]
    i32 = [t.detach().float().requires_grad_() for t in inputs]
    y64, y32 = formula(*i64, "layer_norm", 1.0), formula(*i32, "layer_norm", 1.0)
    assert_close("y", y, y64, y32)
    assert not check_close("y rounded to fp16", _call(candidate, inputs, "layer_norm").float(), y64, y32)[0]
    g = torch.randn_like(y64)
    grads = torch.autograd.grad(y, leaves, g.float())
    grads64 = torch.autograd.grad(y64, i64, g)
    grads32 = torch.autograd.grad(y32, i32, g.float())
    for name, a, a64, a32 in zip(("dx", "dmul", "dadd", "dweight", "dbias"), grads, grads64, grads32):
        assert a.dtype == torch.float16
        assert_close(name, a, a64, a32)


@pytest.mark.parametrize("readers, full_y", [(1, False), (3, False), (1, True)])
def test_narrowed_through_the_registered_op(readers, full_y):
    """Traced calls run the registered op with y in out_dtype for one reader, no cast after it
    forward or before its backward (an opaque op: each would be one more pass); with several
    readers, or y in full too, with y in its own dtype, then cast once per reader."""
    x, mul, add, w, b = (t.detach() for t in _modulated("layer_norm", vectors=(1, 7, 37)))
    forward, backward = traced_graphs(lambda *a: trifuse.ops.layer_norm_modulate(
        a[0], [37], *a[1:], eps=EPS, out_dtype=torch.float16, readers=readers, full_y=full_y, mul_offset=1.0),
        *(t.clone().requires_grad_() for t in (x, mul, add, w, b)))
    op = call_of(forward, "norm_modulate_rows")
    narrow_in_op = readers == 1 and not full_y
    assert op.args[-1] == (torch.float16 if narrow_in_op else torch.float32)
    assert (dtype_casts(forward) == []) == narrow_in_op
    # its backward reads y's gradient as it comes (fp16), not cast to fp32 first
    bop = call_of(backward, "norm_modulate_rows_backward")
    assert (bop.args[0].op == "placeholder") == narrow_in_op
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: trifuse.ops.layer_norm_modulate(
        a[0], [37], *a[1:], eps=EPS, out_dtype=torch.float16, readers=readers, full_y=full_y, mul_offset=1.0),
        fullgraph=True, backend="aot_eager")
    ys = fn(x, mul, add, w, b)
    ys = ys if readers + full_y > 1 else (ys,)
    assert len(ys) == readers + full_y
    expected = formula(x, mul, add, w, b, "layer_norm", 1.0)
    for i, y in enumerate(ys):
        assert y.dtype == (torch.float32 if full_y and i == 0 else torch.float16)
        torch.testing.assert_close(y, expected.to(y.dtype))


# ---------------------------------------------------------------------------------------------
# Random feature combinations, and negative controls: plausible wrong kernels fail the oracle
# ---------------------------------------------------------------------------------------------

CPU_DTYPES = [d for d in DTYPES if DEVICE == "cuda" or d != torch.bfloat16]


@settings(max_examples=32, deadline=None, derandomize=True)
@given(b=st.integers(1, 3), s=st.integers(2, 7), n=st.integers(1, 1100), norm=st.sampled_from(NORMS),
       affine=st.booleans(), mul_kind=st.sampled_from(["full", "chunk", "row_scalar", "shared", "none"]),
       add_kind=st.sampled_from(["full", "per_sample", "none"]), offset=st.sampled_from([0.0, 1.0]),
       dtype=st.sampled_from(CPU_DTYPES), far=st.booleans())
def test_hypothesis_feature_combinations(b, s, n, norm, affine, mul_kind, add_kind, offset, dtype, far):
    """Widths, broadcasts, the affine, the offset and rows far from 0, drawn together; at least
    one of mul and add per token (else the per-sample path runs)."""
    assume(mul_kind in ("full", "chunk", "row_scalar", "shared") or add_kind == "full")
    torch.manual_seed(b * 10000 + s * 1000 + n)
    x, _, _, w, bias = make(((b, s, n), None, None), dtype, norm, affine)
    if far:
        x = (x.detach().double() * 0.1 + 100.0).to(dtype).requires_grad_()
    shapes = {"full": (b, s, n), "row_scalar": (b, s, 1), "shared": (1, s, n), "per_sample": (b, 1, n)}
    if mul_kind == "chunk":
        mul = (torch.randn(b, s, 3 * n, device=DEVICE) * 0.5).to(dtype)[..., n:2 * n].requires_grad_()
    else:
        mul = None if mul_kind == "none" else (torch.randn(shapes[mul_kind], device=DEVICE) * 0.5).to(
            dtype).requires_grad_()
    add = None if add_kind == "none" else torch.randn(shapes[add_kind], device=DEVICE).to(dtype).requires_grad_()
    check_fwd_bwd([x, mul, add, w, bias], norm, offset)


def test_negative_control_mul_read_from_the_next_row_fails():
    """The oracle notices a mul row read one row off (a wrong row stride)."""
    x, mul, add, w, b = make(((2, 6, 40), (2, 6, 40), (2, 6, 40)), torch.float32, "layer_norm")
    y = run([x, mul, add, w, b], "layer_norm")
    i64 = [t.detach().double() for t in (x, mul, add, w, b)]
    wrong = formula(i64[0], torch.roll(i64[1], 1, dims=1), *i64[2:], "layer_norm", 1.0)
    assert not check_close("y, mul one row off", y, wrong, None)[0]
    right = formula(*i64, "layer_norm", 1.0)
    assert check_close("y", y, right, None)[0]


def test_negative_control_offset_dropped_fails():
    """...and a `1 + scale` computed as scale alone (mul_offset not applied), in y and dx."""
    x, mul, add, w, b = make(((2, 6, 40), (2, 6, 40), (2, 6, 40)), torch.float32, "rms_norm", affine=False)
    y = run([x, mul, add, w, b], "rms_norm", 1.0)
    i64 = [None if t is None else t.detach().double().requires_grad_() for t in (x, mul, add, w, b)]
    wrong = formula(*i64, "rms_norm", 0.0)
    assert not check_close("y, offset dropped", y, wrong, None)[0]
    g = torch.randn_like(wrong)
    y.backward(g.float())
    wrong.backward(g)
    assert not check_close("dx, offset dropped", x.grad, i64[0].grad, None)[0]
