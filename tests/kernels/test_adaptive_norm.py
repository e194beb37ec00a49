"""The adaptive norm of diffusion transformers: y = norm(x) * mul + add with per-sample mul and
add (`trifuse.ops.layer_norm_modulate`, kernels/adaptive_norm.py), LayerNorm and RMSNorm.

Outputs and the gradients of x, mul, add, weight and bias against the float64 oracle (the formula
as models write it) by the rule of tests/tolerances.py, with PyTorch's own low-precision error as
the yardstick. On CPU these run the real Triton kernels in the interpreter (the norm with its
affine parameters read per group of rows, and the per-group sums of the backward); on a GPU the
same tests add bf16.
"""
import pytest
import torch
import torch.nn.functional as F
import trifuse
from _device import DEVICE
from _fusing import assert_readers_sum_in_fp32_when_traced, call_of, dtype_casts, traced_graphs
from tolerances import DTYPES, assert_close, check_close
from trifuse.kernels import adaptive_norm as an
from trifuse.kernels.adaptive_norm import layer_norm_modulate_ref

EPS = 1e-6
NORMS = ["layer_norm", "rms_norm"]

# (x shape, mul shape, add shape): DiT's (B, N)[:, None], PixArt's (B, 1, N), one vector for all
# (N,), a scalar per sample, a video's (B, T, 1, N) per frame, one sample, one row per sample, odd
# widths, and mul or add alone.
CASES = [
    ((3, 5, 40), (3, 1, 40), (3, 1, 40)),
    ((2, 7, 33), (2, 1, 33), (33,)),
    ((2, 9, 129), (1, 1, 129), (2, 1, 129)),
    ((4, 6, 24), (4, 1, 1), (4, 1, 24)),
    ((2, 3, 4, 16), (2, 3, 1, 16), (2, 1, 1, 16)),
    ((1, 11, 100), (1, 1, 100), (1, 1, 100)),
    ((5, 1, 7), (5, 1, 7), (5, 1, 7)),
    ((2, 8, 1000), (2, 1, 1000), None),
    ((3, 4, 1), None, (3, 1, 1)),
]


def _id(case):
    return "-".join("none" if s is None else "x".join(map(str, s)) for s in case)


def make(case, dtype, norm, affine=True):
    x_shape, mul_shape, add_shape = case
    n = x_shape[-1]

    def t(shape, scale=1.0, offset=0.0):
        return None if shape is None else (torch.randn(shape, device=DEVICE) * scale + offset).to(dtype)

    x = t(x_shape, 2.0, 0.5)
    mul, add = t(mul_shape, 0.5, 1.0), t(add_shape)
    w = t((n,), 0.3, 1.0) if affine else None
    b = t((n,)) if affine and norm == "layer_norm" else None
    return [None if v is None else v.requires_grad_() for v in (x, mul, add, w, b)]


def run(inputs, norm):
    x, mul, add, w, b = inputs
    return trifuse.ops.layer_norm_modulate(x, [x.shape[-1]], mul, add, w, b, EPS,
                                           is_rms_norm=norm == "rms_norm")


def run_ref(inputs, norm):
    x, mul, add, w, b = inputs
    return layer_norm_modulate_ref(x, [x.shape[-1]], mul, add, w, b, EPS, norm == "rms_norm")


def check_fwd_bwd(inputs, norm):
    """y and every gradient against float64 by the oracle rule."""
    i64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ilp = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y, y64, ylp = run(inputs, norm), run_ref(i64, norm), run_ref(ilp, norm)
    assert y.shape == ylp.shape and y.dtype == ylp.dtype
    assert_close("y", y, y64, ylp)
    g = torch.randn_like(y64)
    for ins, out, gy in ((inputs, y, g.to(y.dtype)), (i64, y64, g), (ilp, ylp, g.to(ylp.dtype))):
        out.backward(gy)
    for name, a, a64, alp in zip(("dx", "dmul", "dadd", "dweight", "dbias"), inputs, i64, ilp):
        if a is not None:
            assert a.grad is not None and a.grad.dtype == a.dtype and a.grad.shape == a.shape, name
            assert_close(name, a.grad, a64.grad, alp.grad)


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_oracle(dtype, norm, case):
    check_fwd_bwd(make(case, dtype, norm), norm)


@pytest.mark.parametrize("norm", NORMS)
def test_without_the_norms_own_affine(norm):
    check_fwd_bwd(make(((3, 5, 40), (3, 1, 40), (3, 1, 40)), torch.float32, norm, affine=False), norm)


@pytest.mark.parametrize("norm", NORMS)
def test_wide_rows(norm):
    """Rows past the single-block width: the chunked forward and backward with grouped affine."""
    check_fwd_bwd(make(((2, 2, 17000), (2, 1, 17000), (2, 1, 17000)), torch.float32, norm), norm)


def test_many_rows_per_sample_split_over_several_programs():
    """A sample's rows spread over several backward programs (each group its own partial sums):
    the per-sample sums dmul and dadd must still add every row once."""
    check_fwd_bwd(make(((3, 300, 48), (3, 1, 48), (3, 1, 48)), torch.float32, "layer_norm"), "layer_norm")


def test_mixed_dtypes_promote_like_the_formula():
    """x in fp16, the modulation in fp32 (a conditioning MLP's output): y in fp32, as the
    written formula gives, each gradient in its input's dtype."""
    x, mul, add, w, b = make(((2, 5, 32), (2, 1, 32), (2, 1, 32)), torch.float16, "layer_norm")
    mul, add = (t.detach().float().requires_grad_() for t in (mul, add))
    check_fwd_bwd([x, mul, add, w, b], "layer_norm")


def test_strided_input():
    """x a transposed view (non-contiguous rows): no copy needed to be right."""
    base = torch.randn(6, 2, 40, device=DEVICE)
    x = base.transpose(0, 1).requires_grad_()  # (2, 6, 40), rows not contiguous
    _, mul, add, w, b = make(((2, 6, 40), (2, 1, 40), (2, 1, 40)), torch.float32, "layer_norm")
    assert not x.is_contiguous()
    check_fwd_bwd([x, mul, add, w, b], "layer_norm")


def test_empty_input():
    x, mul, add, w, b = make(((0, 5, 16), (0, 1, 16), (0, 1, 16)), torch.float32, "layer_norm")
    y = run([x, mul, add, w, b], "layer_norm")
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_large_values_and_offsets():
    """Rows around 1e3 with a small spread (the norm's corrected two-pass mean) and a large
    modulation."""
    x, mul, add, w, b = make(((2, 6, 64), (2, 1, 64), (2, 1, 64)), torch.float32, "layer_norm")
    x = (x.detach() * 1e-2 + 1e3).requires_grad_()
    mul = (mul.detach() * 1e2).requires_grad_()
    check_fwd_bwd([x, mul, add, w, b], "layer_norm")


def test_deterministic():
    """Bitwise the same outputs and gradients on every run (the per-sample sums in a fixed order)."""
    inputs = make(((3, 300, 48), (3, 1, 48), (3, 1, 48)), torch.float32, "layer_norm")
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
    mul = torch.randn(2, 1, 5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    add = torch.randn(2, 1, 5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: trifuse.ops.layer_norm_modulate(a[0], [5], *a[1:], eps=EPS), (x, mul, add, w, b))
    assert torch.autograd.gradcheck(
        lambda *a: trifuse.ops.layer_norm_modulate(a[0], [5], *a[1:], eps=EPS, is_rms_norm=True),
        (x, mul, add, w))


def test_twice_differentiable():
    """create_graph=True: the gradients differentiate again (a gradient penalty), in PyTorch ops."""
    inputs = make(((2, 4, 8), (2, 1, 8), (2, 1, 8)), torch.float64, "layer_norm")
    assert torch.autograd.gradgradcheck(
        lambda *a: trifuse.ops.layer_norm_modulate(a[0], [8], *a[1:], eps=EPS), tuple(inputs), fast_mode=True)


def test_compiles_without_graph_breaks():
    """Under torch.compile(fullgraph=True) the registered op (and its backward op) run."""
    inputs = make(((2, 5, 32), (2, 1, 32), (2, 1, 32)), torch.float32, "layer_norm")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: run(a, "layer_norm"), fullgraph=True, backend="aot_eager")
    i2 = [t.detach().clone().requires_grad_() for t in inputs]
    y, y_eager = compiled(*inputs), run(i2, "layer_norm")
    assert torch.allclose(y, y_eager, atol=1e-6)
    y.sum().backward()
    y_eager.sum().backward()
    for a, b in zip(inputs, i2):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)


@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
def test_registered_op_passes_opcheck(is_rms_norm):
    x = torch.randn(2, 5, 16, device=DEVICE)
    w, b = torch.randn(2, 16, device=DEVICE), torch.randn(2, 16, device=DEVICE)
    args = (x, w, b, EPS, is_rms_norm, 2, torch.float32)
    torch.library.opcheck(torch.ops.trifuse.grouped_norm.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("norm", NORMS)
def test_compiled_with_inductor_around_the_op(norm):
    """torch.compile's default backend: the registered op opaque inside an Inductor graph,
    forward and backward, equal to the eager path."""
    inputs = make(((2, 5, 32), (2, 1, 32), (2, 1, 32)), torch.float32, norm)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: run(a, norm), fullgraph=True)
    i2 = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y, y_eager = compiled(*inputs), run(i2, norm)
    assert torch.allclose(y, y_eager, atol=1e-5)
    y.sum().backward()
    y_eager.sum().backward()
    for a, b in zip(inputs, i2):
        if a is not None:
            assert torch.allclose(a.grad, b.grad, atol=1e-4)


def test_matches_the_written_form_dit_uses():
    """DiT's AdaLayerNormZero as diffusers writes it: norm without affine, then
    `* (1 + scale[:, None]) + shift[:, None]` with scale and shift chunks of one (B, 6N) vector."""
    emb = torch.randn(3, 6 * 32, device=DEVICE, requires_grad=True)
    x = torch.randn(3, 10, 32, device=DEVICE, requires_grad=True)
    shift, scale = emb.chunk(6, dim=1)[:2]
    y = trifuse.ops.layer_norm_modulate(x, [32], 1 + scale[:, None], shift[:, None], eps=EPS)
    x64, emb64 = (t.detach().double().requires_grad_() for t in (x, emb))
    shift64, scale64 = emb64.chunk(6, dim=1)[:2]
    y64 = F.layer_norm(x64, [32], eps=EPS) * (1 + scale64[:, None]) + shift64[:, None]
    assert_close("y", y, y64, None)
    y.backward(torch.ones_like(y))
    y64.backward(torch.ones_like(y64))
    assert_close("demb", emb.grad, emb64.grad, None)
    assert_close("dx", x.grad, x64.grad, None)


@pytest.mark.parametrize("bad, message", [
    ({"mul_shape": (3, 2, 40)}, "one vector per sample"),   # varies along the rows of a sample
    ({"mul_shape": (2, 1, 40)}, "one vector per sample"),   # another batch size
    ({"mul_shape": (3, 1, 39)}, "last dim 40 or 1"),
    ({"normalized_shape": [5, 40]}, "normalized_shape"),
    ({"weight_shape": (39,)}, "weight must have shape"),
    ({"eps": -1.0}, "eps"),
])
def test_bad_input_names_the_op_and_argument(bad, message):
    x = torch.randn(3, 5, 40, device=DEVICE)
    mul = torch.randn(bad.get("mul_shape", (3, 1, 40)), device=DEVICE)
    w = torch.randn(bad.get("weight_shape", (40,)), device=DEVICE)
    with pytest.raises(ValueError, match=message) as err:
        trifuse.ops.layer_norm_modulate(x, bad.get("normalized_shape", [40]), mul, None, w, None,
                                        bad.get("eps", EPS))
    assert "trifuse.layer_norm_modulate" in str(err.value)


def test_integer_input_is_a_type_error():
    with pytest.raises(TypeError, match="trifuse.layer_norm_modulate: input"):
        trifuse.ops.layer_norm_modulate(torch.ones(2, 3, 4, dtype=torch.int64, device=DEVICE), [4])


def test_rms_norm_refuses_a_bias():
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        trifuse.ops.layer_norm_modulate(torch.randn(2, 3, 4, device=DEVICE), [4],
                                        bias=torch.randn(4, device=DEVICE), is_rms_norm=True)


# ---------------------------------------------------------------------------------------------
# out_dtype, readers, full_y: y narrowed for autocast's matmuls, or widened as CUDA autocast's
# norm returns it (fuse sets them: fusion/narrow.py, patterns/adaptive_norm.py), through either
# candidate of the dialect
# ---------------------------------------------------------------------------------------------

CANDIDATES = {"trifuse": an._modulate_trifuse, "torch": an._modulate_torch}


def _modulated(norm, dtype=torch.float32, affine_dtype=torch.float32):
    """(x, mul, add, weight, bias) for a (3, 7, 37) x, DiT's per-sample vectors, all requiring grad."""
    torch.manual_seed(0)
    x = (torch.randn(3, 7, 37, device=DEVICE) * 2 + 0.5).to(dtype)
    mul = (torch.randn(3, 1, 37, device=DEVICE) * 0.5 + 1).to(dtype)
    add = torch.randn(3, 1, 37, device=DEVICE).to(dtype)
    w = (torch.randn(37, device=DEVICE) * 0.3 + 1).to(affine_dtype)
    b = torch.randn(37, device=DEVICE).to(affine_dtype) if norm == "layer_norm" else None
    return [None if t is None else t.requires_grad_() for t in (x, mul, add, w, b)]


def _call(candidate, inputs, norm, **narrowing):
    x, mul, add, w, b = inputs
    args = (x, [37], mul, add, w, b, EPS, norm == "rms_norm")
    defaults = (("out_dtype", None), ("readers", 1), ("full_y", False))
    return CANDIDATES[candidate](*args, *(narrowing.get(k, d) for k, d in defaults))


@pytest.mark.parametrize("candidate", CANDIDATES)
@pytest.mark.parametrize("norm", NORMS)
def test_out_dtype_is_the_cast_of_y_without_a_cast_pass(candidate, norm):
    """y in a narrower out_dtype is bitwise y.to(out_dtype), and the gradients (y's arriving in
    it) bitwise those of the cast's backward."""
    inputs = _modulated(norm)
    leaves = [t for t in inputs if t is not None]
    y = _call(candidate, inputs, norm)
    dy = torch.randn(y.shape, device=DEVICE).half()
    grads = torch.autograd.grad(y.half(), leaves, dy)
    y16 = _call(candidate, inputs, norm, out_dtype=torch.float16)
    grads16 = torch.autograd.grad(y16, leaves, dy)
    assert y16.dtype == torch.float16 and torch.equal(y16, y.half())
    for a, c in zip(grads, grads16):
        assert a.dtype == c.dtype and torch.equal(a, c)


@pytest.mark.parametrize("readers", [2, 3])
@pytest.mark.parametrize("candidate", CANDIDATES)
def test_readers_get_views_whose_gradients_sum_in_fp32(candidate, readers):
    """y as `readers` fp16 tensors (views of one buffer from the kernels), each read by its own
    matmul (a DiT block's q, k and v): every gradient bitwise that of one cast of the fp32 y per
    matmul, whose gradients autograd sums in fp32 (as the backward kernel sums the views')."""
    inputs = _modulated("layer_norm")
    leaves = [t for t in inputs if t is not None]
    mats = [torch.randn(37, 5, device=DEVICE).half() for _ in range(readers)]

    def grads(k):
        out = _call(candidate, inputs, "layer_norm", out_dtype=torch.float16 if k > 1 else None, readers=k)
        ys = out if k > 1 else [out.half() for _ in mats]
        assert k == 1 or (len(ys) == k and all(t.dtype == torch.float16 for t in ys))
        # the kernels' views share one buffer (PyTorch's y is cast once per reader)
        assert k == 1 or candidate == "torch" or all(t.data_ptr() == ys[0].data_ptr() for t in ys)
        loss = sum((t @ m).float().square().sum() for t, m in zip(ys, mats))
        return torch.autograd.grad(loss, leaves)

    for a, c in zip(grads(1), grads(readers)):
        assert torch.equal(a, c)


@pytest.mark.parametrize("candidate", CANDIDATES)
def test_full_y_returns_y_and_its_narrow_copy_whose_gradients_add(candidate):
    """full_y: (y, y in fp16), y read by another op and the copy by a matmul; loss and gradients
    bitwise those of y and its cast."""
    inputs = _modulated("layer_norm")
    leaves = [t for t in inputs if t is not None]
    mat, c = torch.randn(37, 5, device=DEVICE).half(), torch.randn(3, 7, 37, device=DEVICE)

    def loss_and_grads(narrow):
        out = _call(candidate, inputs, "layer_norm", out_dtype=torch.float16 if narrow else None,
                    full_y=narrow)
        y, y16 = out if narrow else (out, out.half())
        assert y.dtype == torch.float32 and y16.dtype == torch.float16
        loss = (y16 @ mat).float().square().sum() + (y * c).sum()
        return loss, torch.autograd.grad(loss, leaves)

    (loss, grads), (loss_narrow, grads_narrow) = loss_and_grads(False), loss_and_grads(True)
    assert torch.equal(loss, loss_narrow)
    for a, c2 in zip(grads, grads_narrow):
        assert torch.equal(a, c2)


@pytest.mark.parametrize("candidate", CANDIDATES)
@pytest.mark.parametrize("norm", NORMS)
def test_fp32_modulation_of_a_16_bit_x_written_in_16_bits(candidate, norm):
    """Wan's `(norm1(h.float()) * (1 + scale) + shift).type_as(h)`: fp16 x, fp32 mul, add and
    affine, y in x's dtype (out_dtype), the norm and the modulation in fp32 and y rounded once,
    as the model's fp32 copy and cast back (fuse's `fp32_copy_*_modulate`). y and every gradient
    against float64 by the oracle rule, that spelling the yardstick."""
    inputs = _modulated(norm, affine_dtype=torch.float32)
    inputs[0] = inputs[0].detach().half().requires_grad_()
    leaves = [t for t in inputs if t is not None]
    y = _call(candidate, inputs, norm, out_dtype=torch.float16)
    assert y.dtype == torch.float16
    i64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ilp = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y64 = layer_norm_modulate_ref(i64[0], [37], *i64[1:], EPS, norm == "rms_norm")
    ylp = layer_norm_modulate_ref(ilp[0].float(), [37], *ilp[1:], EPS, norm == "rms_norm").half()
    assert_close("y", y, y64, ylp)
    g = torch.randn_like(y64)
    grads = torch.autograd.grad(y, leaves, g.half())
    grads64 = torch.autograd.grad(y64, [t for t in i64 if t is not None], g)
    gradslp = torch.autograd.grad(ylp, [t for t in ilp if t is not None], g.half())
    for name, a, a64, alp in zip(("dx", "dmul", "dadd", "dweight", "dbias"), grads, grads64, gradslp):
        assert a.dtype == alp.dtype, name
        assert_close(name, a, a64, alp)


@pytest.mark.parametrize("candidate", CANDIDATES)
@pytest.mark.parametrize("norm", NORMS)
def test_a_16_bit_x_narrowed_back_is_modulated_in_fp32_as_the_widened_model(candidate, norm):
    """DiT under CUDA's autocast: an fp16 x's norm returns fp32, modulated by fp16 vectors in fp32;
    fuse widens the op (out_dtype fp32), then narrows it for the matmul after it (out_dtype fp16,
    x's own dtype). Either candidate still computes in fp32 and rounds once: y is the model's
    fp32 y rounded (all but a rare element, where the two fp32 computations round across a
    boundary; computed in fp16, 31% of them differ)."""
    inputs = _modulated(norm, torch.float16)
    inputs[3:] = [None, None]  # DiT's norms: no affine of their own
    y = _call(candidate, inputs, norm, out_dtype=torch.float16)
    x, mul, add = (t.detach() for t in inputs[:3])
    model = layer_norm_modulate_ref(x.float(), [37], mul, add, None, None, EPS, norm == "rms_norm")
    assert model.dtype == torch.float32 and y.dtype == torch.float16
    assert (y != model.half()).float().mean().item() < 0.01


@pytest.mark.parametrize("candidate", CANDIDATES)
@pytest.mark.parametrize("norm", NORMS)
def test_a_wider_out_dtype_is_never_rounded_to_the_inputs_dtype(candidate, norm):
    """fp16 x, mul and add with out_dtype fp32: CUDA autocast's LayerNorm of a 16-bit x returns
    fp32, modulated in fp32. y and the gradients against float64 by the oracle rule, PyTorch's
    yardstick that computation in fp32 (y an fp32 result, not an fp16 one cast up: the negative
    control, y rounded to fp16 on the way, fails the same check)."""
    inputs = _modulated(norm, torch.float16)
    leaves = [t for t in inputs if t is not None]
    y = _call(candidate, inputs, norm, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    i64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    i32 = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y64 = layer_norm_modulate_ref(i64[0], [37], *i64[1:], EPS, norm == "rms_norm")
    y32 = layer_norm_modulate_ref(i32[0].float(), [37], *(None if t is None else t.float() for t in i32[1:]),
                                  EPS, norm == "rms_norm")
    assert_close("y", y, y64, y32)
    rounded = _call(candidate, inputs, norm).float()
    assert not check_close("y rounded to fp16", rounded, y64, y32)[0]
    g = torch.randn_like(y64)
    grads = torch.autograd.grad(y, leaves, g.float())
    grads64 = torch.autograd.grad(y64, [t for t in i64 if t is not None], g)
    grads32 = torch.autograd.grad(y32, [t for t in i32 if t is not None], g.float())
    for name, a, a64, a32 in zip(("dx", "dmul", "dadd", "dweight", "dbias"), grads, grads64, grads32):
        assert a.dtype == a32.dtype
        assert_close(name, a, a64, a32)


@pytest.mark.parametrize("readers, full_y, wide", [(1, False, False), (3, False, False), (1, True, False),
                                                    (1, False, True)])
def test_narrowed_and_widened_through_the_registered_op(readers, full_y, wide):
    """Traced calls (torch.compile) run the registered op with y in out_dtype for one reader, no
    cast after it forward or before its backward (an opaque op: each would be one more pass); with
    several readers, or y in full too, with y in the wider of its dtype and out_dtype, then cast
    once per reader (after y itself with full_y)."""
    dtype, out = (torch.float16, torch.float32) if wide else (torch.float32, torch.float16)
    x, mul, add, w, b = (None if t is None else t.detach() for t in _modulated("layer_norm", dtype))
    forward, backward = traced_graphs(lambda *a: trifuse.ops.layer_norm_modulate(
        a[0], [37], *a[1:], eps=EPS, out_dtype=out, readers=readers, full_y=full_y),
        *(t.clone().requires_grad_() for t in (x, mul, add, w, b)))
    op = call_of(forward, "grouped_norm")
    in_op = readers == 1 and not full_y
    assert op.args[-1] == (out if in_op or wide else dtype)
    y_casts = [c for c in dtype_casts(forward) if c[0].startswith("getitem")]  # of the op's outputs
    assert (y_casts == []) == in_op
    # its backward reads y's gradient as it comes, not cast first
    bop = call_of(backward, "grouped_norm_backward")
    assert (bop.args[0].op == "placeholder") == in_op
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: trifuse.ops.layer_norm_modulate(a[0], [37], *a[1:], eps=EPS, out_dtype=out,
                                                                  readers=readers, full_y=full_y),
                       fullgraph=True, backend="aot_eager")
    ys = fn(x, mul, add, w, b)
    ys = ys if readers + full_y > 1 else (ys,)
    assert len(ys) == readers + full_y
    wide_inputs = [t.to(out) if wide else t for t in (x, mul, add, w, b)]
    expected = layer_norm_modulate_ref(wide_inputs[0], [37], *wide_inputs[1:], EPS)
    for i, y in enumerate(ys):
        assert y.dtype == (torch.float32 if full_y and i == 0 else out)
        torch.testing.assert_close(y, expected.to(y.dtype))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_a_16_bit_ys_readers_sum_their_gradients_in_fp32_when_traced(per_token, gated):
    """A 16-bit x's modulated y narrowed for three matmuls (DiT under CUDA's autocast: its LayerNorm
    returns fp32, modulated in fp32, read by q, k and v). Traced, the registered op writes y in
    fp32 and each reader casts it, so their gradients sum in fp32 as the eager kernels' views' do:
    gradients bitwise the eager ones (a 16-bit y's `.to` is y itself: the sum was in 16 bits)."""
    torch.manual_seed(0)
    x0 = (torch.randn(4, 16, 64, device=DEVICE) * 3).half()
    mul = torch.randn(4, 16 if per_token else 1, 64, device=DEVICE).half()
    r, gate = torch.randn(4, 16, 64, device=DEVICE).half(), torch.randn(4, 1, 64, device=DEVICE).half()
    mats = [torch.randn(64, 32, device=DEVICE).half() for _ in range(3)]
    op = ("gated_" if gated else "") + ("norm_modulate_rows" if per_token else "grouped_norm")

    def fn(x):
        if gated:
            return trifuse.ops.gated_add_layer_norm_modulate(x, r, gate, [64], mul, eps=EPS, mul_offset=1.0,
                                                             out_dtype=torch.float16, readers=3)[0]
        return trifuse.ops.layer_norm_modulate(x, [64], mul, eps=EPS, mul_offset=1.0, out_dtype=torch.float16,
                                               readers=3)

    assert_readers_sum_in_fp32_when_traced(fn, x0, mats, op)


@pytest.mark.parametrize("out_dtype, readers, error", [
    (torch.float16, 4, ValueError), (torch.int32, 1, TypeError), (None, 2, TypeError)])
def test_narrowing_arguments_are_checked(out_dtype, readers, error):
    x = torch.randn(2, 3, 8, device=DEVICE)
    match = r"trifuse\.layer_norm_modulate: (readers must be an int from 1 to 3|out_dtype)"
    with pytest.raises(error, match=match):
        trifuse.ops.layer_norm_modulate(x, [8], torch.randn(2, 1, 8, device=DEVICE), out_dtype=out_dtype,
                                        readers=readers)
