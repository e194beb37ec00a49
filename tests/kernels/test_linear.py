"""kernels/linear.py: a linear layer under autocast with its fp32 weight's gradient from the GEMM.

The forward and dx are bitwise what autocast computes (F.linear, or torch.mm / torch.addmm for a
weight stored (in, out)); dW and db are fp32 results of the 16-bit values, rounded once in fp32:
within fp32 rounding of the float64 GEMM of the same rounded operands, which autocast's (rounded
to 16 bits first) fails, its negative control. Outside autocast, for a weight that is not fp32 and
when traced, the plain op runs. (Its dialect: tests/autotune/test_autocast_linear_dialect.py.)"""
import pytest
import torch
import torch.nn.functional as F
from _device import DEVICE, ON_GPU
from tolerances import check_close

from trifuse.kernels import linear as lin
from trifuse.kernels.linear import autocast_linear

LOW = (torch.float16, torch.bfloat16)


def _inputs(x_shape, n_out, in_by_out, bias, x_dtype=torch.float32, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n_in = x_shape[-1]
    x = torch.randn(x_shape, generator=gen, device=DEVICE).to(x_dtype).requires_grad_()
    w_shape = (n_in, n_out) if in_by_out else (n_out, n_in)
    w = (torch.randn(w_shape, generator=gen, device=DEVICE) / n_in ** 0.5).requires_grad_()
    b = torch.randn(n_out, generator=gen, device=DEVICE).requires_grad_() if bias else None
    dy = torch.randn((*x_shape[:-1], n_out), generator=gen, device=DEVICE)
    return x, w, b, dy


def _model_call(x, w, b, in_by_out):
    """What the model wrote."""
    if not in_by_out:
        return F.linear(x, w, b)
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


def _fwd_bwd(fn, x, w, b, dy, dtype):
    with torch.autocast(DEVICE, dtype=dtype):
        y = fn()
    leaves = [t for t in (x, w, b) if t is not None]
    return (y, *torch.autograd.grad(y, leaves, dy.to(y.dtype)))


CASES = [  # (x shape, out features, weight stored (in, out), bias)
    ((7, 24), 40, False, True),
    ((2, 5, 24), 40, False, False),
    ((1, 24), 1, False, True),
    ((33, 17), 129, True, True),  # Conv1D / addmm: awkward sizes
    ((33, 17), 129, True, False),  # torch.mm
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("x_dtype", ["fp32", "low"])
def test_forward_and_dx_are_autocasts_and_dw_db_are_fp32_results(case, dtype, x_dtype):
    x_shape, n_out, in_by_out, bias = case
    x, w, b, dy = _inputs(x_shape, n_out, in_by_out, bias, torch.float32 if x_dtype == "fp32" else dtype)
    ours = _fwd_bwd(lambda: autocast_linear(x, w, b, dtype, in_by_out), x, w, b, dy, dtype)
    model = _fwd_bwd(lambda: _model_call(x, w, b, in_by_out), x, w, b, dy, dtype)
    assert ours[0].dtype == model[0].dtype == dtype and torch.equal(ours[0], model[0])
    assert ours[1].dtype == x.dtype and torch.equal(ours[1], model[1])  # dx
    # dW (and db): the float64 GEMM (sum) of the operands the 16-bit GEMM read, rounded once to fp32
    x16, w16, dy16 = x.detach().to(dtype).double(), w.detach(), dy.to(dtype).double()
    x2, dy2 = x16.reshape(-1, x16.shape[-1]), dy16.reshape(-1, dy16.shape[-1])
    dw64 = x2.t() @ dy2 if in_by_out else dy2.t() @ x2
    truths = [("dW", dw64)] + ([("db", dy2.sum(0))] if bias else [])
    for (name, ref64), got, autocasts in zip(truths, ours[2:], model[2:]):
        assert got.dtype == torch.float32 == w16.dtype
        ok, msg = check_close(name, got, ref64, None)  # fp32's own rounding is the bound
        assert ok, msg
        if name == "db" and x2.shape[0] == 1:
            continue  # a sum of one term: exact in 16 bits too, nothing for the control to show
        ok, msg = check_close(name, autocasts, ref64, None)  # negative control: rounded to 16 bits first
        assert not ok, f"autocast's own {name} passed the fp32 check: {msg}"


@pytest.mark.parametrize("how", ["no autocast", "fp16 weight", "other autocast dtype", "no grad"])
def test_the_plain_op_runs_where_there_is_nothing_to_gain(how):
    x, w, b, dy = _inputs((6, 24), 40, False, True)
    dtype, run_dtype = torch.float16, torch.float16
    if how == "fp16 weight":
        w = w.detach().half().requires_grad_()
    if how == "other autocast dtype":
        dtype = torch.bfloat16  # the capture's dtype differs from the autocast this call runs under

    def call(fn):
        with torch.autocast(DEVICE, dtype=run_dtype, enabled=how != "no autocast"), \
                torch.set_grad_enabled(how != "no grad"):
            return fn()
    got = call(lambda: autocast_linear(x, w, b, dtype))
    want = call(lambda: F.linear(x, w, b))
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert got.grad_fn is None or "AutocastLinear" not in type(got.grad_fn).__name__


def test_traced_calls_run_the_plain_op_without_a_graph_break():
    x, w, b, _ = _inputs((6, 24), 40, True, True)

    def f(x, w, b):
        return autocast_linear(x, w, b, torch.float16, True)
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    with torch.autocast(DEVICE, dtype=torch.float16):
        assert torch.equal(compiled(x, w, b), torch.addmm(b, x, w))


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_weight_gradient_comes_from_one_fp32_output_gemm():
    """On CUDA, dW is torch.mm's fp32 output (when this torch has it): no 16-bit GEMM output is
    converted, and the result is within fp32 rounding of the fp32 GEMM of the same values."""
    assert lin.HAS_MM_OUT_DTYPE, f"torch {torch.__version__} has no torch.mm out_dtype"
    a = torch.randn(257, 1000, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1000, 129, device="cuda", dtype=torch.bfloat16)
    got = lin._mm_fp32(a, b)
    assert got.dtype == torch.float32
    ok, msg = check_close("a @ b", got, a.double() @ b.double(), None)
    assert ok, msg
