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
from tolerances import DTYPES, assert_close

from _device import DEVICE
import trifuse
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
        lambda *a: trifuse.ops.layer_norm_modulate(a[0], [8], *a[1:], eps=EPS), tuple(inputs))


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
