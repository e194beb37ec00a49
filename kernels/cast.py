"""One cast for several readers: a value in fp32 that several autocast matmuls read.

Under autocast every matmul casts its fp32 input to the autocast dtype itself. Where one fp32
tensor feeds several of them (a post-norm block's input: BERT's query, key and value projections
all read the residual stream), that is one cast kernel per matmul forward, and backward one cast
of each matmul's 16-bit input gradient back to fp32 plus fp32 adds summing them: on BERT-large's
8192 x 1024 activations, ~370 MB a layer more memory traffic than one cast and one sum.

`cast_for_readers(x, dtype, readers)` casts once and returns one view of the result per reader
(so that their gradients reach the backward apart, not summed by autograd in 16 bits); the
backward sums the readers' gradients in fp32 (fp64 for a float64 x) in one kernel, in reader
order, and writes x's gradient in x's dtype. Each reader sees the same bits its own cast gave;
the gradient is the same fp32 sum, associated in reader order where autograd used its own
(fp32 rounding apart, the same). fusion/narrow.py puts it into fused blocks (`share_input_casts`).

Eager only: fused blocks run their graphs eagerly. Traced calls (torch.compile, fake tensors) get
one plain cast per reader, the model's own computation.
"""
import torch
import triton
import triton.language as tl

from ._common import (apply_function, check_float, check_tensor, eager_fast_path, outside_device_modes,
                      use_triton)
from ._launch import CachedKernel

# The most readers the summing kernel takes at once; more are summed by PyTorch, in the same order.
MAX_SUMMED = 4
BLOCK = 4096


@triton.jit
def _sum_grads_kernel(
    G0, G1, G2, G3,  # in (numel,) the readers' gradients, contiguous; G1.. unused past NUM
    OUT,  # out (numel,) their sum, in x's dtype
    numel,
    NUM: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(G0 + offs, mask=mask, other=0.0).to(tl.float32)
    if NUM >= 2:
        acc += tl.load(G1 + offs, mask=mask, other=0.0).to(tl.float32)
    if NUM >= 3:
        acc += tl.load(G2 + offs, mask=mask, other=0.0).to(tl.float32)
    if NUM >= 4:
        acc += tl.load(G3 + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=mask)


_sum_grads = CachedKernel(_sum_grads_kernel)


def sum_grads(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """grads[0] + grads[1] + ..., left to right in fp32 (fp64 for a float64 `dtype`), as a tensor
    of `dtype` shaped like them: one kernel for up to MAX_SUMMED contiguous gradients, else
    PyTorch, the same sums (also under create_graph=True, where grad mode is on in the backward:
    the kernel's sum would be a constant there, PyTorch's is differentiable again)."""
    first = grads[0]
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if acc_dtype == torch.float32 and use_triton(first) and not torch.is_grad_enabled() \
            and len(grads) <= MAX_SUMMED and all(
            g.is_contiguous() and g.shape == first.shape for g in grads):
        out = torch.empty(first.shape, dtype=dtype, device=first.device)
        numel = first.numel()
        if numel:
            padded = (*grads, *(first,) * (MAX_SUMMED - len(grads)))
            _sum_grads[(triton.cdiv(numel, BLOCK),)](*padded, out, numel, NUM=len(grads), BLOCK=BLOCK,
                                                     num_warps=8)
        return out
    acc = first.to(acc_dtype)
    for g in grads[1:]:
        acc = acc + g.to(acc_dtype)
    return acc.to(dtype)


class _CastForReaders(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, readers: int):
        ctx.set_materialize_grads(False)  # a reader whose output gets no gradient adds nothing
        ctx.x_dtype = x.dtype
        y = x.to(dtype)
        return (y, *(y.view_as(y) for _ in range(readers - 1)))

    @staticmethod
    def backward(ctx, *grads):
        given = [g for g in grads if g is not None]
        if not given:
            return None, None, None
        return sum_grads(given, ctx.x_dtype), None, None


@outside_device_modes
def cast_for_readers(x: torch.Tensor, dtype: torch.dtype, readers: int) -> tuple[torch.Tensor, ...]:
    """`readers` views of one `x.to(dtype)`, one per reader; x's gradient is the fp32 sum of
    theirs, in x's dtype.

    Args:
        x: a floating-point tensor (fp32 under autocast).
        dtype: the readers' dtype (autocast's: float16 or bfloat16).
        readers: how many views, at least 1.
    """
    check_tensor("cast_for_readers", "x", x)
    check_float("cast_for_readers", "x", x)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError("trifuse.cast_for_readers: dtype must be a floating-point torch.dtype, "
                        f"got {dtype!r}")
    if type(readers) is not int or readers < 1:
        raise ValueError(f"trifuse.cast_for_readers: readers must be an int of at least 1, got {readers!r}")
    if not eager_fast_path(x):  # traced: the model's own casts, one per reader
        return tuple(x.to(dtype) for _ in range(readers))
    return apply_function(_CastForReaders, x, dtype, readers)
