"""kernels/cast.py: one cast for several readers. Each view is bitwise the cast each reader made
(x.to(dtype)); x's gradient is the fp32 sum of the readers' gradients in reader order: bitwise
what autograd computes for separate casts summed in that order, and within the oracle rule of
the float64 sum. Awkward sizes, several programs, gradients that are missing or not contiguous,
more readers than the kernel sums at once, traced calls, bad input."""
import pytest
import torch
from _device import DEVICE
from tolerances import assert_close, check_close

from trifuse.kernels import cast as cast_mod
from trifuse.kernels.cast import MAX_SUMMED, cast_for_readers

LOW = (torch.float16, torch.bfloat16)  # the readers' dtypes autocast uses
SHAPES = [(0,), (1,), (3, 5), (2, 7, 33), (3, 4099)]  # 3 x 4099: four programs of 4096 and a tail


def _separate_casts(x: torch.Tensor, dtype: torch.dtype, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """x's gradient as the model computes it: a cast per reader, autograd summing fp32 gradients."""
    leaf = x.detach().requires_grad_()
    outs = [leaf.to(dtype) for _ in grads]
    used = [(o, g) for o, g in zip(outs, grads) if g is not None]
    torch.autograd.backward([o for o, _ in used], [g for _, g in used])
    return leaf.grad


def _grads(shape, dtype, n, scale=1.0, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return [(torch.randn(shape, generator=gen, device=DEVICE) * scale).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("readers", [1, 2, 3, MAX_SUMMED])
def test_views_are_the_cast_and_the_gradient_is_the_fp32_sum(shape, dtype, readers):
    torch.manual_seed(0)
    x = (torch.randn(shape, device=DEVICE) * 3).requires_grad_()
    ys = cast_for_readers(x, dtype, readers)
    assert len(ys) == readers
    for y in ys:
        assert y.dtype == dtype and torch.equal(y, x.detach().to(dtype))
        assert y.data_ptr() == ys[0].data_ptr(), "one buffer, a view per reader"
    grads = _grads(shape, dtype, readers, scale=100.0)
    torch.autograd.backward(ys, grads)
    assert x.grad.dtype == torch.float32 and x.grad.shape == x.shape
    ref64 = sum(g.double() for g in grads)
    assert_close("dx", x.grad, ref64, None)
    assert torch.equal(x.grad, _separate_casts(x, dtype, grads)), "the sums the separate casts made"


def test_negative_control_a_sum_in_16_bits_fails_the_rule():
    """What one shared 16-bit tensor would give (autograd summing its readers' gradients in 16
    bits): the check above must catch it."""
    grads = _grads((64, 257), torch.float16, 3, scale=100.0, seed=1)
    summed16 = (grads[0] + grads[1] + grads[2]).float()
    ok, msg = check_close("dx", summed16, sum(g.double() for g in grads), None)
    assert not ok, msg


def test_missing_gradients_add_nothing_and_none_gives_none():
    x = torch.randn(5, 9, device=DEVICE, requires_grad=True)
    a, _b, c = cast_for_readers(x, torch.float16, 3)
    g = _grads((5, 9), torch.float16, 2)
    torch.autograd.backward([a, c], [g[0], g[1]])
    assert torch.equal(x.grad, _separate_casts(x, torch.float16, [g[0], None, g[1]]))
    x2 = torch.randn(4, device=DEVICE, requires_grad=True)
    y0, _y1 = cast_for_readers(x2, torch.float16, 2)
    (y0.sum() * 0).backward()
    assert torch.equal(x2.grad, torch.zeros(4, device=DEVICE))


def test_gradients_that_are_not_contiguous_and_more_readers_than_the_kernel_sums():
    """Both take PyTorch's sums, in the same order: the same bits."""
    x = torch.randn(6, 10, device=DEVICE, requires_grad=True)
    ys = cast_for_readers(x, torch.float16, 2)
    grads = [g.t().contiguous().t() for g in _grads((6, 10), torch.float16, 2)]  # column-major
    assert not grads[0].is_contiguous()
    torch.autograd.backward(ys, grads)
    assert torch.equal(x.grad, _separate_casts(x, torch.float16, grads))
    many = MAX_SUMMED + 2
    x = torch.randn(6, 10, device=DEVICE, requires_grad=True)
    grads = _grads((6, 10), torch.float16, many)
    torch.autograd.backward(cast_for_readers(x, torch.float16, many), grads)
    assert torch.equal(x.grad, _separate_casts(x, torch.float16, grads))


def test_the_kernel_runs_for_contiguous_gradients(monkeypatch):
    """A test of the sums above could pass on PyTorch's fallback alone: count the launches."""
    launches = []
    real = cast_mod._sum_grads.run
    monkeypatch.setattr(cast_mod._sum_grads, "run", lambda *a: (launches.append(a[0]), real(*a))[1])
    x = torch.randn(3, 4099, device=DEVICE, requires_grad=True)
    torch.autograd.backward(cast_for_readers(x, torch.float16, 3), _grads((3, 4099), torch.float16, 3))
    assert launches == [(4,)]


def test_float64_input_sums_in_float64():
    x = torch.randn(8, device=DEVICE, dtype=torch.float64, requires_grad=True)
    grads = _grads((8,), torch.float32, 3)
    torch.autograd.backward(cast_for_readers(x, torch.float32, 3), grads)
    assert x.grad.dtype == torch.float64 and torch.equal(x.grad, _separate_casts(x, torch.float32, grads))


def test_traced_calls_cast_once_per_reader():
    def f(x):
        a, b = cast_for_readers(x, torch.float16, 2)
        return a.float() * 2 + b.float()

    x = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    out = torch.compile(f, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(out, f(x.detach()))
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


@pytest.mark.parametrize("args, error, match", [
    (([1.0], torch.float16, 2), TypeError, "x must be a torch.Tensor"),
    ((torch.ones(2, dtype=torch.int32), torch.float16, 2), TypeError, "x must be float16, bfloat16, float32"),
    ((torch.ones(2), torch.int8, 2), TypeError, "dtype must be a floating-point torch.dtype"),
    ((torch.ones(2), torch.float16, 0), ValueError, "readers must be an int of at least 1"),
    ((torch.ones(2), torch.float16, 2.0), ValueError, "readers must be an int of at least 1"),
])
def test_bad_input_names_the_op_and_the_argument(args, error, match):
    with pytest.raises(error, match=f"trifuse.cast_for_readers: {match}"):
        cast_for_readers(*args)
