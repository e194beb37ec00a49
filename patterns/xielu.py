"""xIELU (Apertus): transformers' XIELUActivation in PyTorch (`_xielu_python`, used wherever its
optional CUDA package is not installed) becomes one trifuse.xielu.

Spelling, as the model writes it: `torch.where(x > 0, alpha_p * x * x + beta * x,
(torch.expm1(torch.min(x, eps)) - x) * alpha_n + beta * x)`, with alpha_p = softplus(its
parameter) and alpha_n = beta + softplus(its other one) computed before (they stay as written: two
one-element ops, and their gradients reach the parameters through them). beta and eps are the
activation's buffers, read on the device by the kernels.

Filters: one value for each of alpha_p, alpha_n, beta and eps (a per-feature coefficient would be
another function); beta and eps without grad (buffers; the op computes no gradient for them); x
floating point with at least one dim; the result shaped like x. A coefficient of a wider dtype
than x (fp32 parameters beside bf16 activations under autocast) promotes the model's result: the
op writes that dtype (`out_dtype`, derived from PyTorch's own promotion), as the model does.
"""
import functools

import torch

from ..kernels.xielu import xielu_ref
from ._base import Match, Pattern, ops


def xielu_written_out(x: torch.Tensor, alpha_p, alpha_n, beta, eps):
    """transformers' XIELUActivation._xielu_python, its coefficients computed before."""
    return torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.min(x, eps)) - x) * alpha_n + beta * x)


def xielu_fused(x, alpha_p, alpha_n, beta, eps, out_dtype):
    return ops.xielu(x, alpha_p, alpha_n, beta, eps, out_dtype)


def one_value_coefficients(m: Match) -> str | None:
    x = m.value("x")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        return "x is not a floating-point tensor with a dim"
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        v = m.value(name)
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            return f"{name} is not a floating-point tensor"
        if v.numel() != 1:
            return f"{name} has shape {tuple(v.shape)}, not one value"
        if name in ("beta", "eps") and _requires_grad(m[name], v):
            return f"{name} requires grad (the op computes none for it)"
    return None


def _requires_grad(node, value: torch.Tensor) -> bool:
    """Whether the tensor requires grad: a module attribute's own flag (fx's fake values of
    parameters may not carry it), else the example value's."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr" and node.graph.owning_module is not None:
        owner = node.graph.owning_module
        try:
            return bool(functools.reduce(getattr, node.target.split("."), owner).requires_grad)
        except AttributeError:
            pass
    return bool(value.requires_grad)


def _result(m: Match) -> torch.Tensor:
    """The model's result on meta tensors of the inputs' dtypes and shapes: PyTorch's own
    promotion and broadcasting (x's sizes do not matter here; the coefficients are one value)."""
    x = m.value("x")
    meta = [torch.empty((2,) * x.dim(), dtype=x.dtype, device="meta")]
    meta += [torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
             for v in (m.value(n) for n in ("alpha_p", "alpha_n", "beta", "eps"))]
    return xielu_ref(*meta)


def result_shaped_like_x(m: Match) -> str | None:
    out, x = _result(m), m.value("x")
    if out.dim() != x.dim():
        return f"the result has {out.dim()} dims, broadcast from x's {x.dim()}"
    return None


def out_dtype(m: Match) -> dict:
    """The model's result dtype: x's, or wider where a coefficient promotes it."""
    return {"out_dtype": _result(m).dtype}


PATTERNS = (
    Pattern("xielu_written_out", "xielu", xielu_written_out, xielu_fused, ("xielu",),
            (one_value_coefficients, result_shaped_like_x), derive=out_dtype),
)
