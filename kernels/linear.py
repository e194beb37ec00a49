"""A linear layer under autocast whose fp32 weight gets its gradient in fp32 from the GEMM itself.

Under autocast with fp32 master weights (the usual mixed-precision training), `F.linear(x, w, b)`
casts w and b to bf16/fp16, and autograd records those casts: backward, the weight-gradient GEMM
writes dW in 16 bits and a cast kernel converts it to fp32 for `.grad` (likewise db). On the lent
H200 those conversions were the largest elementwise kernels of the fused, CUDA-graphed steps:
8 a GPT-2 medium block (6.5 ms of a 69.3 ms step) and 12 a BERT-large layer (4.2 of 67.3 ms;
bench/results/h200-2026-11-27-d), one per weight and bias gradient.

`autocast_linear(x, weight, bias, dtype)` computes the same forward (x, w and b cast to `dtype`,
one 16-bit GEMM) and backward dx as autocast does, bit for bit, but dW comes from cuBLAS with an
fp32 output (`torch.mm(..., out_dtype=torch.float32)`, the fp32 accumulator written once instead
of rounded to 16 bits and converted) and db from a sum with an fp32 result: no conversion
kernels, and weight gradients rounded once, in fp32 (what Megatron's gradient-accumulation
fusion does). `in_by_out` takes the weight as (in, out), Hugging Face's Conv1D and `torch.mm` /
`torch.addmm` layout, instead of nn.Linear's (out, in).

It is a dialect (`trifuse.autotune.dialects`): on a GPU the first call per shape times it against
autocast's own `F.linear` and keeps the faster (a CUDA build without `mm`'s out_dtype, or a GEMM
that runs slower with an fp32 output, keeps autocast's). fusion/narrow.py puts it into fused
blocks (`fp32_weight_grads`), those replayed from CUDA graphs only: its host path (an
autograd.Function, ~150 µs more per forward and backward than autocast's linear on the CPU proxy)
would cost a host-bound ungraphed step more than the conversions it saves. Outside autocast, or
for a weight that is not fp32, it is the plain op.
"""
import warnings

import torch
import torch.nn.functional as F

from ..autotune import dialects
from ..autotune.decisions import pow2_bucket
from ._common import eager_fast_path, outside_device_modes, reference_grads, single_backward

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _has_mm_out_dtype() -> bool:
    """Whether this torch has `torch.mm(a, b, out_dtype=)` (aten::mm.dtype, CUDA; torch >= 2.8)."""
    return "dtype" in torch.ops.aten.mm.overloads()


HAS_MM_OUT_DTYPE = _has_mm_out_dtype()


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 16-bit a and b, accumulated and returned in fp32 (never rounded to 16 bits): on
    CUDA in one cuBLAS call with an fp32 output; elsewhere (CPU has no such kernel) as an fp32
    GEMM of the same 16-bit values, the same products summed in another order. Should this CUDA
    build refuse the call (a layout or dtype its kernel does not take), autocast's way from then
    on: the 16-bit GEMM and a conversion, said once."""
    global HAS_MM_OUT_DTYPE
    if a.is_cuda and HAS_MM_OUT_DTYPE:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except RuntimeError as e:
            HAS_MM_OUT_DTYPE = False
            warnings.warn(f"trifuse.autocast_linear: torch.mm(out_dtype=float32) failed ({e}); weight "
                          "gradients are converted from 16 bits from now on", RuntimeWarning, stacklevel=2)
    if a.is_cuda:
        return torch.mm(a, b).float()
    return torch.mm(a.float(), b.float())


def _autocast_linear_twice(ctx, dy):
    """The backward in PyTorch ops, differentiable again (create_graph=True): autocast's casts and
    GEMM by autograd from the inputs themselves. Only where x came in `dtype` (its 16-bit copy is
    x itself, so nothing is kept alive for this) and no input changed in place since the forward;
    else None: the saved 16-bit copies lead back to nothing."""
    x, weight, bias, versions = ctx.originals
    if x is None or versions != tuple(None if t is None else t._version for t in (x, weight, bias)):
        return None
    dtype = ctx.dtype

    def forward(x, w, b):
        w16 = w.to(dtype)
        return F.linear(x.to(dtype), w16.t() if ctx.in_by_out else w16, None if b is None else b.to(dtype))

    gx, gw, gb = reference_grads(forward, (x, weight, bias), ctx.needs_input_grad[:3], (dy,))
    return gx, gw, gb, None, None


class _AutocastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype, in_by_out):
        x16, w16 = x.to(dtype), weight.to(dtype)
        w_out_in = w16.t() if in_by_out else w16
        y = F.linear(x16, w_out_in, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(x16, w16)
        ctx.x_dtype, ctx.w_dtype, ctx.in_by_out, ctx.dtype = x.dtype, weight.dtype, in_by_out, dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        # references (no copies, no version checks on the first-order path) for a double backward
        kept = (x if x16 is x else None, weight, bias)
        ctx.originals = (*kept, tuple(None if t is None else t._version for t in kept))
        return y

    @staticmethod
    @single_backward(twice=_autocast_linear_twice)
    def backward(ctx, dy):
        x16, w16 = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        dy = dy.to(x16.dtype)  # (autograd hands y's dtype back; a hook could change it)
        if need_x:
            # dy @ W (W as (out, in)): autocast's dx, the same GEMM, then its cast back to x's dtype
            dx = torch.matmul(dy, w16 if not ctx.in_by_out else w16.t())
            dx = dx if dx.dtype == ctx.x_dtype else dx.to(ctx.x_dtype)
        if need_w or need_b:
            dy2 = dy.reshape(-1, dy.shape[-1])
        if need_w:
            x2 = x16.reshape(-1, x16.shape[-1])
            dw = _mm_fp32(x2.t(), dy2) if ctx.in_by_out else _mm_fp32(dy2.t(), x2)
            dw = dw if dw.dtype == ctx.w_dtype else dw.to(ctx.w_dtype)
        if need_b:
            db = dy2.sum(0, dtype=torch.float32)
            db = db if db.dtype == ctx.b_dtype else db.to(ctx.b_dtype)
        return dx, dw, db, None, None


def _eligible(x, weight, bias, dtype) -> str | None:
    """None when the fp32-gradient path computes what autocast would for this call, else why not."""
    if dtype not in LOW_PRECISION:
        return f"dtype must be float16 or bfloat16, got {dtype}"
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
        return "the weight is not fp32: autocast casts nothing to save"
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, *LOW_PRECISION):
        return "x must be fp32, fp16 or bf16 (autocast casts those alone)"
    if bias is not None and (not isinstance(bias, torch.Tensor)
                             or bias.dtype not in (torch.float32, *LOW_PRECISION)):
        return "the bias must be fp32, fp16 or bf16"
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type) or torch.get_autocast_dtype(device_type) != dtype:
        return f"autocast is not on with {dtype} here"
    if x.is_cuda and not HAS_MM_OUT_DTYPE:
        return (f"torch.mm's out_dtype (an fp32 output of a 16-bit GEMM) is not available in torch "
                f"{torch.__version__} here")
    return None


def _linear_fp32_grads(x, weight, bias, dtype, in_by_out):
    if not eager_fast_path(x, weight, bias) or _eligible(x, weight, bias, dtype) is not None:
        return _linear_autocast(x, weight, bias, dtype, in_by_out)  # traced, or nothing to gain
    return _AutocastLinear.apply(x, weight, bias, dtype, in_by_out)


def _linear_fp32_grads_supports(x, weight, bias, dtype, in_by_out) -> str | None:
    return _eligible(x, weight, bias, dtype)


def _linear_autocast(x, weight, bias, dtype, in_by_out):
    """What the model wrote, as autocast runs it. For an (in, out) weight F.linear of its transpose
    is the model's `torch.mm(x, w)` / `torch.addmm(b, x, w)`: F.linear makes that very call."""
    return F.linear(x, weight.t() if in_by_out else weight, bias)


def _linear_ref(x, weight, bias, dtype, in_by_out):
    """The reference: x, w and b rounded to `dtype` as autocast rounds them, then the GEMM in the
    inputs' precision (float64 for the dialect check's oracle run, which rounds nothing)."""
    if x.dtype != torch.float64:
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x, weight.t() if in_by_out else weight, bias)


def _linear_key(x, weight, bias, dtype, in_by_out):
    """The dialect key of an eager call, or None (the fp32-gradient path, or the plain op where
    it does not apply) when traced or degenerate. About 2 µs: it runs on every call."""
    if not eager_fast_path(x, weight, bias) or not isinstance(x, torch.Tensor) or x.dim() == 0 \
            or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or weight.numel() == 0:
        return None
    grad = torch.is_grad_enabled() and weight.requires_grad
    out_features = weight.shape[1] if in_by_out else weight.shape[0]
    # layout: the weight as (out, in) or (in, out), two different GEMM layouts for cuBLAS
    return (x.get_device() if x.is_cuda else -1, dtype, pow2_bucket(rows), x.shape[-1], out_features,
            x.dtype, None if bias is None else bias.dtype, grad, "in-out" if in_by_out else "out-in")


AUTOCAST_LINEAR = dialects.define(
    "autocast_linear", _linear_key, ("device", "dtype", "rows", "in", "out", "x", "bias", "grad", "layout"),
    reference=_linear_ref)
AUTOCAST_LINEAR.register(dialects.Candidate("fp32-grads", _linear_fp32_grads,
                                            supports=_linear_fp32_grads_supports))
AUTOCAST_LINEAR.register(dialects.Candidate("autocast", _linear_autocast))


@outside_device_modes
def autocast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                    in_by_out: bool = False) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as autocast with `dtype` runs it (or, with in_by_out, x @ weight
    + bias for a weight stored (in, out)), with the fp32 weight's and bias's gradients computed in
    fp32 by the GEMM and the sum themselves instead of in `dtype` and then converted.

    Args:
        x: (..., in), fp32 or 16-bit (cast to `dtype` as autocast casts it; its gradient comes
            back in x's dtype).
        weight: (out, in), or (in, out) with in_by_out; fp32 for the fp32 gradients.
        bias: (out,) or None.
        dtype: the autocast dtype the call runs under, float16 or bfloat16.
        in_by_out: the weight's layout is (in, out).

    Returns:
        (..., out) in `dtype`, as autocast returns it.

    Eager calls run this or autocast's own F.linear, whichever the `autocast_linear` dialect
    measured faster for the shape on this GPU; outside autocast with `dtype`, with a weight
    that is not fp32, or traced, the plain op runs (what the model wrote).
    """
    return AUTOCAST_LINEAR(x, weight, bias, dtype, in_by_out)
