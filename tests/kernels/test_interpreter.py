"""bf16 in Triton's interpreter (kernels/_interpreter.py): computed on values, as a GPU computes
it, not on the raw bits Triton's own interpreter computes on; and where it cannot be corrected,
bf16 CPU tensors take the PyTorch path, never a wrong answer."""
import warnings

import pytest
import torch
import trifuse
import triton
import triton.language as tl
from _device import INTERPRETED
from tolerances import assert_close
from trifuse.kernels import _common
from trifuse.kernels._common import INTERPRETER_BF16, use_triton
from trifuse.kernels._interpreter import correct_bf16
from trifuse.kernels.layer_norm import layer_norm_ref

INTERPRETER_ONLY = pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter (TRITON_INTERPRET=1)")


@triton.jit
def _bf16_kernel(X, Y, ELEMENTWISE, ROUNDED, MATHS, REDUCED, INDEX, CASTS, COMPARED, DOT, n,
                 BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(X + offs, mask=inside, other=1.0)  # bf16 blocks, as bf16 kernels compute on them
    y = tl.load(Y + offs, mask=inside, other=1.0)
    ew = ((x * y + x) - y / (x + 3.0)) * 0.5
    tl.store(ELEMENTWISE + offs, ew, mask=inside)
    wide = x.to(tl.float32) * 1.00390625  # the fp32 -> bf16 casts: to nearest even, toward zero
    tl.store(ROUNDED + offs, wide.to(tl.bfloat16), mask=inside)
    tl.store(ROUNDED + BLOCK + offs, wide.to(tl.bfloat16, fp_downcast_rounding="rtz"), mask=inside)
    tl.store(MATHS + offs, tl.exp(x.to(tl.float32) * 0.25), mask=inside)  # exp, sqrt: fp32 only
    tl.store(MATHS + BLOCK + offs, tl.sqrt(tl.abs(y).to(tl.float32)), mask=inside)
    tl.store(MATHS + 2 * BLOCK + offs, tl.maximum(x, y), mask=inside)
    tl.store(MATHS + 3 * BLOCK + offs, -x, mask=inside)
    lowest = tl.where(inside, x, float("inf")).to(tl.bfloat16)
    highest = tl.where(inside, x, float("-inf")).to(tl.bfloat16)
    tl.store(REDUCED, tl.min(lowest, 0))
    tl.store(REDUCED + 1, tl.max(highest, 0))
    tl.store(REDUCED + 2, tl.sum(tl.where(inside, x, 0.0).to(tl.bfloat16), 0))
    tl.store(INDEX, tl.argmax(highest, 0))
    tl.store(CASTS + offs, (x * 8.0).to(tl.int32) + (x < y).to(tl.int32) * 1000, mask=inside)
    tl.store(CASTS + BLOCK + offs, offs.to(tl.bfloat16).to(tl.float16).to(tl.int32), mask=inside)
    tl.store(COMPARED + offs, (x == y) | (x >= 0.0), mask=inside)
    a = tl.load(X + offs[:, None] * 0 + offs[None, :], mask=inside[None, :], other=0.0)
    b = tl.load(Y + offs[:, None] * 0 + offs[None, :], mask=inside[None, :], other=0.0)
    tl.store(DOT + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, tl.trans(b)))


def _bf16_launch(x, y):
    n, block = x.numel(), 16
    bf16, int32 = torch.bfloat16, torch.int32
    out = {"elementwise": torch.empty(n, dtype=bf16), "rounded": torch.empty(2, block, dtype=bf16),
           "maths": torch.empty(4, block, dtype=bf16), "reduced": torch.empty(3, dtype=bf16),
           "index": torch.empty(1, dtype=int32), "casts": torch.empty(2, block, dtype=int32),
           "compared": torch.empty(n, dtype=torch.bool), "dot": torch.empty(block, block)}
    _bf16_kernel[(1,)](x, y, *out.values(), n, BLOCK=block)
    for name in ("rounded", "maths", "casts"):
        out[name] = out[name][:, :n]
    return out


@INTERPRETER_ONLY
def test_interpreter_bf16_is_pytorchs_bf16(monkeypatch):
    """kernels/_interpreter.py makes the interpreter compute on bf16 values, not on their bits: each
    operation takes its bf16 operands to fp32, computes, and rounds once to nearest even, as
    PyTorch's bf16 and a GPU do. Arithmetic, negation, maximum, casts (to nearest even, toward
    zero, to and from integers and fp16), min / max / argmax / sum, comparisons and a bf16 dot
    agree with PyTorch bitwise (fp32 exp and sqrt stored as bf16 within a bf16 ulp: numpy's and
    PyTorch's fp32 may differ in the last bit); with Triton's own bf16 they do not."""
    from triton.runtime import interpreter

    assert correct_bf16() and INTERPRETER_BF16, "this Triton's interpreter was left uncorrected"
    torch.manual_seed(0)
    x = (torch.randn(13) * 3).bfloat16()
    y = (torch.randn(13) * 3).bfloat16()
    x[0], y[0] = 1.0, 1.0  # an equal pair, and a tie of the rounding below: 1 + 2^-8 goes to 1
    x[1] = -0.0
    out = _bf16_launch(x, y)
    sum_of_bf16 = x * y + x  # bf16 op bf16 (or a number) stays bf16; a division is fp32 in Triton
    expected = ((sum_of_bf16.float() - y.float() / (x + 3.0).float()) * 0.5).bfloat16()
    assert torch.equal(out["elementwise"], expected)
    wide = x.float() * 1.00390625
    truncated = (wide.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
    assert torch.equal(out["rounded"], torch.stack([wide.bfloat16(), truncated]))
    assert out["rounded"][0, 0] == 1.0 and out["rounded"][1, 0] == 1.0
    expected_maths = torch.stack([torch.exp(x.float() * 0.25).bfloat16(), y.abs().float().sqrt().bfloat16(),
                                  torch.maximum(x, y), -x])
    torch.testing.assert_close(out["maths"], expected_maths, rtol=2**-7, atol=0)
    assert torch.equal(out["reduced"][:2], torch.stack([x.min(), x.max()]))
    assert out["reduced"][2] == x.float().sum().bfloat16()  # one rounding of the fp32 sum
    assert out["index"].item() == x.argmax().item()
    casts = torch.stack([(x * 8.0).int() + (x < y).int() * 1000, torch.arange(13).int()])
    assert torch.equal(out["casts"], casts)
    assert torch.equal(out["compared"], (x == y) | (x >= 0))
    products = x.float()[None, :].expand(16, -1) @ y.float()[None, :].expand(16, -1).T  # exact in fp32
    assert torch.equal(out["dot"], products)

    for owner in (interpreter.InterpreterBuilder, interpreter.ReduceOps):
        for name, patched in list(vars(owner).items()):
            if hasattr(patched, "__wrapped__"):
                monkeypatch.setattr(owner, name, patched.__wrapped__)
    with warnings.catch_warnings():  # Triton's own: the bits as integers, overflowing numpy
        warnings.simplefilter("ignore", RuntimeWarning)
        raw = _bf16_launch(x, y)
    assert not torch.equal(raw["elementwise"], out["elementwise"])
    assert not torch.equal(raw["dot"], out["dot"])
    assert not torch.equal(raw["casts"], out["casts"])


@INTERPRETER_ONLY
def test_bf16_takes_the_pytorch_path_where_the_interpreter_is_left_uncorrected(monkeypatch):
    """A Triton whose interpreter lacks what the correction needs is left as it is: then bf16 CPU
    tensors run the ops' PyTorch path, fp16 and fp32 the kernels."""
    from triton.runtime import interpreter

    bf16 = torch.randn(3, 40, dtype=torch.bfloat16)
    assert use_triton(bf16) and use_triton(bf16.half()) and use_triton(bf16.float())
    monkeypatch.setattr(_common, "INTERPRETER_BF16", False)
    assert not use_triton(bf16) and use_triton(bf16.half()) and use_triton(bf16.float())

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran on bf16 in an uncorrected interpreter")

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", no_kernel)
    x = bf16.requires_grad_()
    w = torch.randn(40, dtype=torch.bfloat16, requires_grad=True)
    y = trifuse.ops.layer_norm(x, (40,), w, None)
    y.sum().backward()
    with pytest.raises(AssertionError, match="a kernel ran"):
        trifuse.ops.layer_norm(x.detach().float(), (40,), w.detach().float(), None)
    assert_close("layer_norm y (PyTorch path)", y, layer_norm_ref(x.double(), (40,), w.double(), None),
                 layer_norm_ref(x, (40,), w, None))
