"""bias + GeLU (erf, tanh and quick forms), bias + ReLU, and LinearGELU against the float64 oracle.

On CPU these run the real Triton kernels in the interpreter (tests/_device.py); on a GPU the
same tests run natively and add bf16.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close

from _device import DEVICE
from _dropout_masks import keep_of, seeded
import trifuse
from trifuse.kernels import bias_gelu as bg_mod
from trifuse.kernels.bias_gelu import bias_gelu_ref

# widths: 1, odd, just past a power of two, past one column tile; 0 rows; 3-D and 4-D; and one
# (300 x 130) whose backward walks several row tiles per program in several programs (with the
# interpreter's 4 "SMs").
SHAPES = [(1, 1), (3, 7), (4, 100), (2, 129), (5, 1000), (3, 2500), (0, 32), (2, 3, 50), (2, 2, 3, 17), (300, 130)]
FORMS = ["none", "tanh", "quick", "relu", "relu2"]


def _ids(shape):
    return "x".join(map(str, shape))


def make(shape, dtype, bias=True, scale=2.0):
    x = (torch.randn(shape, device=DEVICE, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], device=DEVICE, dtype=dtype, requires_grad=True) if bias else None
    return x, b


def upcast(*ts):
    return [None if t is None else t.detach().double().requires_grad_() for t in ts]


def lowp(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def check_fwd_bwd(x, b, approximate, dy=None):
    """y, dx and dbias against float64, bounded by PyTorch's own error in x's dtype."""
    y = trifuse.ops.bias_gelu(x, b, approximate)
    x64, b64 = upcast(x, b)
    xl, bl = lowp(x, b)
    y64, ylp = bias_gelu_ref(x64, b64, approximate), bias_gelu_ref(xl, bl, approximate)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    assert_close(f"{approximate} y", y, y64, ylp)
    if x.numel() == 0:
        return
    dy = torch.randn_like(y) if dy is None else dy
    inputs = [t for t in (x, b) if t is not None]
    grads = torch.autograd.grad(y, inputs, dy)
    g64 = torch.autograd.grad(y64, [t for t in (x64, b64) if t is not None], dy.double())
    glp = torch.autograd.grad(ylp, [t for t in (xl, bl) if t is not None], dy)
    for name, a, a64, alp, t in zip(("dx", "dbias"), grads, g64, glp, inputs):
        assert a.dtype == t.dtype and a.shape == t.shape
        assert_close(f"{approximate} {name}", a, a64, alp)


@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, shape, approximate):
    check_fwd_bwd(*make(shape, dtype), approximate)


@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("shape", [(5, 1000), (300, 130)], ids=_ids)
def test_float64_matches_float64_oracle(shape, approximate):
    """fp64 inputs compute in fp64: the kernels' formulas against PyTorch's to the fp64 floor."""
    check_fwd_bwd(*make(shape, torch.float64), approximate)


@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_bias(dtype, approximate):
    check_fwd_bwd(*make((5, 300), dtype, bias=False), approximate)
    check_fwd_bwd(*make((300, 130), dtype, bias=False), approximate)


def test_scalar_input_without_bias():
    x = torch.tensor(0.7, device=DEVICE, requires_grad=True)
    check_fwd_bwd(x, None, "none")


@pytest.mark.parametrize("approximate", FORMS)
def test_strided_inputs_and_gradients(approximate):
    """Sliced rows are read in place, permuted tensors copied; a strided bias, and a
    non-contiguous and an expanded incoming gradient work too."""
    big = torch.randn(6, 150, device=DEVICE, requires_grad=True)
    x = big[:, 10:110]  # (6, 100), row stride 150
    _, b = make((6, 100), torch.float32)
    check_fwd_bwd(x, b, approximate, dy=torch.randn(100, 6, device=DEVICE).t())
    xt = torch.randn(40, 5, 3, device=DEVICE).permute(2, 1, 0).requires_grad_()  # (3, 5, 40)
    b = torch.randn(80, device=DEVICE)[::2].requires_grad_()  # a bias with stride 2
    check_fwd_bwd(xt, b, approximate, dy=torch.randn(40, device=DEVICE).expand(3, 5, 40))


@pytest.mark.parametrize("approximate", FORMS)
def test_nan_and_inf_propagate_like_pytorch(approximate):
    x = torch.randn(4, 33, device=DEVICE)
    x[1, 3], x[2, 5], x[3, 7] = float("nan"), float("inf"), float("-inf")
    b = torch.randn(33, device=DEVICE)
    y = trifuse.ops.bias_gelu(x, b, approximate)
    ref = bias_gelu_ref(x.double(), b.double(), approximate)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isinf(y), torch.isinf(ref))
    assert_close("finite rows", y[[0]], ref[[0]], None)


def test_extreme_values_stay_finite():
    """|z| large: the tanh and quick forms' exp overflows to inf and must give z or -0, not NaN."""
    x = torch.tensor([[-1e4, -100.0, -20.0, 20.0, 100.0, 1e4]], device=DEVICE, requires_grad=True)
    for approximate in FORMS:
        check_fwd_bwd(x, None, approximate)


@pytest.mark.parametrize("approximate", [f for f in FORMS if f != "relu2"])  # relu2 squares: next test
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
def test_extreme_values_stay_finite_in_every_dtype(dtype, approximate):
    """The same in each dtype, with a bias: y is z or -0 and the gradient 1 or 0, never NaN."""
    x = torch.tensor([[-1e4, -100.0, -20.0, 20.0, 100.0, 1e4]], device=DEVICE, dtype=dtype)
    x.requires_grad_()
    b = torch.zeros(6, device=DEVICE, dtype=dtype, requires_grad=True)
    y = trifuse.ops.bias_gelu(x, b, approximate)
    dx, db = torch.autograd.grad(y, (x, b), torch.ones_like(y))
    for t in (y, dx, db):
        assert torch.isfinite(t).all(), t
    assert torch.equal(y[0, 4:], x[0, 4:].detach()) and y[0, 0] == 0  # z = 100, 1e4 and z = -1e4
    check_fwd_bwd(x, b, approximate)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
def test_relu2_overflows_where_pytorchs_square_does(dtype):
    """relu(z)^2 is inf where the square passes the dtype's range (z = 1e4 in fp16), as PyTorch's
    `torch.square(torch.relu(z))` in that dtype, and 0 (never NaN) for large negative z."""
    x = torch.tensor([[-1e4, -100.0, -20.0, 20.0, 100.0, 1e4]], device=DEVICE, dtype=dtype)
    y = trifuse.ops.bias_gelu(x, torch.zeros(6, device=DEVICE, dtype=dtype), "relu2")
    assert torch.equal(y, torch.square(torch.relu(x))), y


def test_gradcheck_float64():
    x = torch.randn(4, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    for form in FORMS:
        assert torch.autograd.gradcheck(lambda x, b, form=form: trifuse.ops.bias_gelu(x, b, form), (x, b))
        assert torch.autograd.gradcheck(lambda x, form=form: torch.ops.trifuse.bias_gelu(x, None, form), (x,))


def test_bias_grad_is_deterministic():
    """dbias comes from fixed-order partial sums: bitwise equal run to run."""
    x, b = make((300, 130), torch.float32)
    dy = torch.randn(300, 130, device=DEVICE)
    runs = [torch.autograd.grad(trifuse.ops.bias_gelu(x, b), (x, b), dy) for _ in range(2)]
    for a, a_ in zip(*runs):
        assert torch.equal(a, a_)


def test_backward_saves_only_x_and_bias():
    """Recompute, do not store: the graph holds the two inputs and nothing else."""
    x, b = make((4, 16), torch.float32)
    y = trifuse.ops.bias_gelu(x, b)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0] is x and saved[1] is b


@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_eager_path_and_registered_op_are_bitwise_equal(approximate, bias):
    x, b = make((37, 70), torch.float32, bias)
    eager = trifuse.ops.bias_gelu(x, b, approximate)
    op = torch.ops.trifuse.bias_gelu(x, b, approximate)
    assert torch.equal(eager, op)
    inputs = [t for t in (x, b) if t is not None]
    dy = torch.randn_like(eager)
    for a, a_ in zip(torch.autograd.grad(eager, inputs, dy), torch.autograd.grad(op, inputs, dy)):
        assert torch.equal(a, a_)


@pytest.mark.parametrize("approximate", FORMS)
def test_compiles_fullgraph_without_graph_breaks(approximate):
    x, b = make((4, 48), torch.float32)
    fn = torch.compile(lambda x, b: trifuse.ops.bias_gelu(x, b, approximate), fullgraph=True, backend="aot_eager")
    out, ref = fn(x, b), trifuse.ops.bias_gelu(x, b, approximate)
    assert torch.equal(out, ref)
    for a, a_ in zip(torch.autograd.grad(out, (x, b), torch.ones_like(out)),
                     torch.autograd.grad(ref, (x, b), torch.ones_like(ref))):
        assert torch.equal(a, a_)


def test_opcheck_every_op():
    x = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    b = torch.randn(16, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.trifuse.bias_gelu.default, (x, b, "none"))
    torch.library.opcheck(torch.ops.trifuse.bias_gelu.default, (x, None, "tanh"))
    dy = torch.randn(3, 16, device=DEVICE)
    torch.library.opcheck(torch.ops.trifuse.bias_gelu_backward.default, (dy, x.detach(), b.detach(), "tanh"))
    torch.library.opcheck(torch.ops.trifuse.bias_gelu.default, (x, b, "quick"))
    torch.library.opcheck(torch.ops.trifuse.bias_gelu_backward.default, (dy, x.detach(), None, "quick"))


def test_half_input_with_fp32_bias_keeps_each_dtype():
    """Under autocast the linear's output is half and its bias an fp32 master weight."""
    x = torch.randn(8, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
    b = torch.randn(64, device=DEVICE, requires_grad=True)
    y = trifuse.ops.bias_gelu(x, b)
    assert y.dtype == torch.float16
    assert_close("y", y, bias_gelu_ref(x.double(), b.double()), None)
    dx, db = torch.autograd.grad(y, (x, b), torch.ones_like(y))
    assert dx.dtype == torch.float16 and db.dtype == torch.float32


@settings(max_examples=15, deadline=None)
@given(m=st.integers(0, 40), n=st.integers(1, 300), approximate=st.sampled_from(FORMS), bias=st.booleans())
def test_hypothesis_shapes(m, n, approximate, bias):
    torch.manual_seed(m * 1000 + n)
    check_fwd_bwd(*make((m, n), torch.float32, bias), approximate)


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_to_the_31_elements():
    """Row offsets in int64: the last rows of a tensor past 2^31 elements are right."""
    m, n = 2**31 // 4096 + 8, 4096
    x = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    y = trifuse.ops.bias_gelu(x, b)
    tail = slice(m - 16, m)
    assert_close("tail", y[tail], bias_gelu_ref(x[tail].double(), b.double()), bias_gelu_ref(x[tail], b))
    del y
    dx, _ = bg_mod.bias_gelu_bwd(torch.ones_like(x), x, b, "none")
    z = x[tail].double() + b.double()
    dz64 = torch.ops.aten.gelu_backward(torch.ones_like(z), z)
    assert_close("dx tail", dx[tail], dz64, None)


# ---------------------------------------------------------------------------------------------
# LinearGELU
# ---------------------------------------------------------------------------------------------


def test_linear_gelu_is_an_nn_linear_plus_gelu():
    torch.manual_seed(3)
    ref = torch.nn.Linear(24, 40, device=DEVICE)
    torch.manual_seed(3)
    ours = trifuse.nn.LinearGELU(24, 40, device=DEVICE)
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)  # same initialization, same random numbers
    x = torch.randn(5, 7, 24, device=DEVICE, requires_grad=True)
    for approximate in FORMS:
        ours.approximate = approximate
        y = ours(x)
        y64 = bias_gelu_ref(F.linear(x.double(), ref.weight.double(), ref.bias.double()), None, approximate)
        ylp = bias_gelu_ref(ref(x), None, approximate)
        assert_close("LinearGELU", y, y64, ylp)
        dy = torch.randn_like(y)
        g = torch.autograd.grad(y, (x, ours.weight, ours.bias), dy)
        g64 = torch.autograd.grad(y64, (x, ref.weight, ref.bias), dy.double())
        glp = torch.autograd.grad(ylp, (x, ref.weight, ref.bias), dy)
        for name, a, a64, alp in zip(("dx", "dweight", "dbias"), g, g64, glp):
            assert_close(name, a, a64, alp)


def test_linear_gelu_loads_linear_state_dict_and_back():
    ref = torch.nn.Linear(8, 12, bias=False, device=DEVICE)
    ours = trifuse.nn.LinearGELU(8, 12, bias=False, approximate="tanh", device=DEVICE)
    ours.load_state_dict(ref.state_dict())
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(3, 8, device=DEVICE)
    assert_close("no bias", ours(x), F.gelu(ref(x.double().float()).double(), approximate="tanh"), None)
    assert "approximate='tanh'" in repr(ours)
    for other in ("sigmoid", "relu"):  # ReLU is the op's, not a LinearGELU's
        with pytest.raises(ValueError, match="LinearGELU: approximate must be 'none', 'tanh' or 'quick'"):
            trifuse.nn.LinearGELU(8, 12, approximate=other)


# ---------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations must fail the same tolerance.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("asked, computed", [("none", "tanh"), ("tanh", "none"), ("none", "quick"),
                                             ("quick", "none"), ("tanh", "quick"), ("quick", "tanh")])
def test_negative_control_other_gelu_form_fails(asked, computed):
    """One form passed off as another must not pass, forward or backward. The erf and tanh forms
    differ by at most 4.7e-4 (at z = -2.7) and their derivatives by 9e-4: far above fp32's
    tolerance, below fp16's and bf16's resolution, so the control is fp32. The quick form is
    farther from both (~2e-2)."""
    x, b = make((64, 256), torch.float32, scale=2.0)
    wrong = trifuse.ops.bias_gelu(x, b, computed)
    x64, b64 = upcast(x, b)
    ref = bias_gelu_ref(x64, b64, asked)
    ok, msg = check_close(f"{computed} as {asked}", wrong, ref, bias_gelu_ref(x, b, asked))
    assert not ok, msg
    dy = torch.randn_like(wrong)
    (wrong_dx,) = torch.autograd.grad(wrong, x, dy)
    (dx64,) = torch.autograd.grad(ref, x64, dy.double())
    ok, msg = check_close(f"dx of {computed} as {asked}", wrong_dx, dx64, None)
    assert not ok, msg


@pytest.mark.parametrize("form", ["relu", "relu2"])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
def test_relu_backward_selects_as_pytorch_does(dtype, form):
    """ReLU's backward is a select, not dy * (z > 0): an infinite dy where z < 0 gives 0, not NaN;
    dx is 0 at z = 0 exactly (PyTorch's convention), and NaN passes where z is NaN. The squared
    ReLU the same around dy * 2z, bitwise PyTorch's (one rounding of an exact product)."""
    x = torch.tensor([[-3.0, -1.0, 0.0, 2.0, float("nan"), 5.0]], device=DEVICE, dtype=dtype,
                     requires_grad=True)
    b = torch.zeros(6, device=DEVICE, dtype=dtype, requires_grad=True)
    dy = torch.tensor([[float("inf"), 1.0, 7.0, 3.0, 4.0, float("-inf")]], device=DEVICE, dtype=dtype)
    y = trifuse.ops.bias_gelu(x, b, form)
    xr = x.detach().clone().requires_grad_()
    ref = torch.relu(xr) if form == "relu" else torch.square(torch.relu(xr))
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.nan_to_num(), ref.nan_to_num())
    (dx,) = torch.autograd.grad(y, x, dy)
    (dx_ref,) = torch.autograd.grad(ref, xr, dy)
    assert torch.equal(dx.isnan(), dx_ref.isnan()) and torch.equal(dx.nan_to_num(), dx_ref.nan_to_num()), \
        (dx, dx_ref)


def test_negative_control_relu_passed_off_as_a_gelu_fails():
    """ReLU and the erf GeLU differ by up to 0.17 (at |z| = 0.75): a form swapped in the dispatch
    must fail even fp16's tolerance; so must the squared ReLU passed off as the ReLU, or back."""
    x, b = make((64, 256), torch.float16)
    for asked, computed in (("relu", "none"), ("none", "relu"), ("relu2", "relu"), ("relu", "relu2")):
        wrong = trifuse.ops.bias_gelu(x, b, computed)
        x64, b64 = upcast(x, b)
        ok, msg = check_close(f"{computed} as {asked}", wrong, bias_gelu_ref(x64, b64, asked),
                              bias_gelu_ref(x, b, asked))
        assert not ok, msg


def test_negative_control_gradient_without_bias_fails():
    """A backward that forgets the bias (gelu'(x) instead of gelu'(x + b)) must not pass."""
    x, b = make((32, 64), torch.float32)
    dy = torch.randn(32, 64, device=DEVICE)
    wrong_dx, _ = bg_mod.bias_gelu_bwd(dy, x.detach(), None, "none")
    x64, b64 = upcast(x, b)
    (dx64,) = torch.autograd.grad(bias_gelu_ref(x64, b64), x64, dy.double())
    ok, msg = check_close("dx without bias", wrong_dx, dx64, None)
    assert not ok, msg


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the op and the argument, in eager and under compile.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, b, approximate, exc, match",
    [
        (torch.ones(3, 8), torch.ones(5), "none", ValueError, r"bias_gelu: bias must have shape \(8,\)"),
        (torch.ones(3, 8), torch.ones(3, 8), "none", ValueError, "bias must have shape"),
        (torch.ones(3, 8, dtype=torch.int64), None, "none", TypeError, "bias_gelu: input must be float"),
        (torch.ones(3, 8), torch.ones(8, dtype=torch.int32), "none", TypeError, "bias_gelu: bias must be float"),
        (torch.ones(3, 8), None, "exact", ValueError,
         "approximate must be 'none', 'tanh', 'quick', 'relu' or 'relu2', got 'exact'"),
        ("not a tensor", None, "none", TypeError, "bias_gelu: input must be a torch.Tensor"),
        (torch.ones(3, 8), [1.0] * 8, "none", TypeError, "bias must be a torch.Tensor"),
    ],
    ids=["bias-shape", "bias-2d", "int-input", "int-bias", "approximate", "not-tensor", "list-bias"],
)
def test_bad_input_raises_clear_error(x, b, approximate, exc, match):
    x = x.to(DEVICE) if isinstance(x, torch.Tensor) else x
    b = b.to(DEVICE) if isinstance(b, torch.Tensor) else b
    with pytest.raises(exc, match=match):
        trifuse.ops.bias_gelu(x, b, approximate)


def test_bad_input_raises_under_compile():
    fn = torch.compile(lambda x, b: trifuse.ops.bias_gelu(x, b), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="bias must have shape"):
        fn(torch.ones(3, 8, device=DEVICE), torch.ones(5, device=DEVICE))


def test_mismatched_devices_raise():
    with pytest.raises(ValueError, match="bias is on meta"):
        trifuse.ops.bias_gelu(torch.ones(3, 8, device=DEVICE), torch.ones(8, device="meta"))


def test_reference_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: same maths, same API."""
    monkeypatch.setattr(bg_mod, "use_triton", lambda t: False)
    for approximate in FORMS:
        check_fwd_bwd(*make((4, 37), torch.float32), approximate)
        check_fwd_bwd(*make((4, 37), torch.float32, bias=False), approximate)


# ---------------------------------------------------------------------------------------------
# Dropout on the output (BART's and Pegasus' activation dropout before fc2): y = dropout(gelu(x +
# b), p), the mask drawn from a seed (Philox, as dropout_add's) and regenerated in the backward.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("shape", [(3, 7), (4, 100), (2, 129), (5, 1000), (300, 130), (2, 3, 50)], ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_matches_float64_oracle_through_its_mask(dtype, shape, approximate):
    """The launchers with a seed against float64 through the mask the seed draws: y, dx, dbias
    (the summing backward's rows of programs each drawing their own tiles' mask)."""
    p = 0.3
    x, b = make(shape, dtype)
    seed = torch.tensor([4321], device=DEVICE)
    y = bg_mod.bias_gelu_fwd(x.detach(), b.detach(), approximate, p, seed)
    keep = keep_of(seed, shape, p)
    assert 0.5 < keep.mean() < 0.9
    x64, b64 = upcast(x, b)
    xl, bl = lowp(x, b)
    y64 = bias_gelu_ref(x64, b64, approximate) * keep / (1 - p)
    ylp = bias_gelu_ref(xl, bl, approximate) * keep.to(dtype) / (1 - p)
    assert_close(f"{approximate} dropout y", y, y64, ylp)
    dy = torch.randn_like(y)
    dx, dbias = bg_mod.bias_gelu_bwd(dy, x.detach(), b.detach(), approximate, p, seed)
    g64 = torch.autograd.grad(y64, (x64, b64), dy.double())
    glp = torch.autograd.grad(ylp, (xl, bl), dy)
    assert_close(f"{approximate} dropout dx", dx, g64[0], glp[0])
    assert_close(f"{approximate} dropout dbias", dbias.to(dtype), g64[1], glp[1])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_dropout_forward_and_backward_share_one_mask(bias):
    """Through the public op, strided x too: every kept output is gelu(x + b) / (1 - p), every
    dropped one 0, and the gradients flow through exactly the kept elements."""
    p = 0.4
    x, b = make((37, 4), torch.float32, bias=bias)
    xt = x.transpose(0, 1)  # (4, 37) with a column stride
    bt = None if b is None else torch.randn(37, device=DEVICE, requires_grad=True)
    y = trifuse.ops.bias_gelu(xt, bt, "none", p=p)
    x64, b64 = upcast(xt, bt)
    full = bias_gelu_ref(x64, b64, "none") / (1 - p)
    kept = y.detach() != 0
    assert 0.4 < kept.double().mean() < 0.8
    torch.testing.assert_close(y.detach().double()[kept], full.detach()[kept], rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    wanted = [t for t in (x, bt) if t is not None]
    grads = torch.autograd.grad(y, wanted, dy)
    ref = full * kept
    ref_grads = torch.autograd.grad(ref, [t for t in (x64, b64) if t is not None], dy.double())
    torch.testing.assert_close(grads[0].double(), ref_grads[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(grads[1].double(), ref_grads[1], rtol=1e-5, atol=1e-5)


def test_dropout_mask_is_dropout_adds_for_the_same_seed():
    x, b = make((9, 130), torch.float32)
    seed = torch.tensor([77], device=DEVICE)
    y = bg_mod.bias_gelu_fwd(x.detach() + 10.0, b.detach(), "tanh", 0.5, seed)  # gelu > 0 everywhere
    assert torch.equal((y != 0).double(), keep_of(seed, y.shape, 0.5))


def test_dropout_statistics_seeds_and_edge_probabilities():
    x, b = make((64, 257), torch.float32)
    x, b = x.detach() + 10.0, b.detach()
    torch.manual_seed(1)
    a = trifuse.ops.bias_gelu(x, b, "tanh", p=0.25)
    torch.manual_seed(1)
    c = trifuse.ops.bias_gelu(x, b, "tanh", p=0.25)
    d = trifuse.ops.bias_gelu(x, b, "tanh", p=0.25)
    assert torch.equal(a, c) and not torch.equal(a, d)  # torch.manual_seed controls the mask
    assert abs((a != 0).double().mean().item() - 0.75) < 0.02
    plain = trifuse.ops.bias_gelu(x, b, "tanh")
    assert torch.equal(trifuse.ops.bias_gelu(x, b, "tanh", p=0.0), plain)
    assert torch.equal(trifuse.ops.bias_gelu(x, b, "tanh", p=0.5, training=False), plain)
    huge = torch.full((4, 16), float("inf"), device=DEVICE)
    assert torch.equal(trifuse.ops.bias_gelu(huge, None, "none", p=1.0), torch.zeros(4, 16, device=DEVICE))


def test_dropout_saves_x_bias_and_a_seed_not_a_mask():
    x, b = make((4, 16), torch.float32)
    y = trifuse.ops.bias_gelu(x, b, p=0.2)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 3 and saved[0] is x and saved[1] is b and saved[2].shape == (1,)


def test_dropout_bias_grad_is_deterministic():
    x, b = make((300, 130), torch.float32)
    seed = torch.tensor([5], device=DEVICE)
    dy = torch.randn(300, 130, device=DEVICE)
    first = bg_mod.bias_gelu_bwd(dy, x.detach(), b.detach(), "none", 0.2, seed)[1]
    assert torch.equal(first, bg_mod.bias_gelu_bwd(dy, x.detach(), b.detach(), "none", 0.2, seed)[1])


def test_dropout_gradcheck_and_gradgradcheck_float64():
    x = torch.randn(4, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    for form in FORMS:
        eager = seeded(lambda x, b, form=form: trifuse.ops.bias_gelu(x, b, form, p=0.3))
        op = seeded(lambda x, b, form=form: torch.ops.trifuse.bias_gelu_dropout(x, b, form, 0.3)[0])
        for fn in (eager, op):  # the op: the same kernels, checked by a random projection
            assert torch.autograd.gradcheck(fn, (x, b), fast_mode=fn is op)
            assert torch.autograd.gradgradcheck(fn, (x, b), fast_mode=True)


def test_dropout_eager_path_and_registered_op_are_bitwise_equal():
    x, b = make((37, 70), torch.float32)
    torch.manual_seed(3)
    eager = trifuse.ops.bias_gelu(x, b, "tanh", p=0.3)
    torch.manual_seed(3)
    op = torch.ops.trifuse.bias_gelu_dropout(x, b, "tanh", 0.3)[0]
    assert torch.equal(eager, op)
    dy = torch.randn_like(eager)
    for a, a_ in zip(torch.autograd.grad(eager, (x, b), dy), torch.autograd.grad(op, (x, b), dy)):
        assert torch.equal(a, a_)


def test_dropout_compiles_fullgraph_and_opchecks():
    x, b = make((4, 48), torch.float32)
    fn = torch.compile(lambda x, b: trifuse.ops.bias_gelu(x, b, "none", p=0.3), fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    out = fn(x, b)
    torch.manual_seed(5)
    assert torch.equal(out, trifuse.ops.bias_gelu(x, b, "none", p=0.3))
    torch.library.opcheck(torch.ops.trifuse.bias_gelu_dropout.default, (x, b, "tanh", 0.3),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    seed = torch.tensor([9], device=DEVICE)
    torch.library.opcheck(torch.ops.trifuse.bias_gelu_dropout_backward.default,
                          (torch.randn(4, 48, device=DEVICE), x.detach(), b.detach(), "none", 0.3, seed))


@pytest.mark.parametrize("p, training", [(1.5, True), (-0.1, True), (2.0, False), ("0.1", True)])
def test_dropout_bad_probability_raises_clear_error(p, training):
    x, b = make((3, 8), torch.float32)
    with pytest.raises(ValueError, match=r"trifuse.bias_gelu: p must be a probability in \[0, 1\]"):
        trifuse.ops.bias_gelu(x, b, "none", p=p, training=training)


def test_dropout_negative_control_a_mask_other_than_the_forwards_fails():
    x, b = make((8, 64), torch.float32)
    seed, other = torch.tensor([1], device=DEVICE), torch.tensor([2], device=DEVICE)
    dy = torch.randn(8, 64, device=DEVICE)
    wrong = bg_mod.bias_gelu_bwd(dy, x.detach(), b.detach(), "none", 0.3, other)[0]
    x64, b64 = upcast(x, b)
    y64 = bias_gelu_ref(x64, b64, "none") * keep_of(seed, (8, 64), 0.3) / 0.7
    right = torch.autograd.grad(y64, x64, dy.double())[0]
    assert not check_close("dx", wrong, right, right.float())[0]


def test_dropout_reference_path_without_interpreter(monkeypatch):
    monkeypatch.setattr(bg_mod, "use_triton", lambda t: False)
    x, b = make((6, 33), torch.float32)
    y = trifuse.ops.bias_gelu(x.detach() + 10.0, b, "none", p=0.5)
    kept = y.detach() != 0
    assert 0.25 < kept.double().mean() < 0.75
    full = bias_gelu_ref(x.detach().double() + 10.0, b.detach().double(), "none") * 2
    torch.testing.assert_close(y.detach().double()[kept], full[kept], rtol=1e-5, atol=1e-5)
    (db,) = torch.autograd.grad(y, (b,), torch.ones_like(y))
    b64 = b.detach().double().requires_grad_()
    ref = bias_gelu_ref(x.detach().double() + 10.0, b64, "none") * kept * 2  # through the same mask
    torch.testing.assert_close(db.double(), torch.autograd.grad(ref.sum(), b64)[0], rtol=1e-5, atol=1e-5)
