"""LayerNorm and RMSNorm, in the spellings models use, each becoming one trifuse norm.

`nn.LayerNorm`, `nn.RMSNorm` and `torch.layer_norm` reach the rewriter as `F.layer_norm` /
`F.rms_norm` (fusion/normalize.py), so the functional spelling covers them. RMSNorm written out,
as Hugging Face models do (`x * rsqrt(mean(x^2) + eps) * w`, with or without computing in fp32),
becomes `rms_norm` too; eps stays the model's eps.

When the weight's dtype differs from the activation's (fp32 master weights, bf16 activations),
the written-out forms multiply by the weight in the promoted dtype after rounding the normalized
value to the activation dtype; the replacement then keeps that multiplication apart, so the
result and its dtype are the model's own.
"""
import torch
import torch.nn.functional as F

from ._base import Match, Pattern, needs_number, ops


def layer_norm(x: torch.Tensor, normalized_shape, weight, bias, eps):
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


def layer_norm_fused(x, normalized_shape, weight, bias, eps):
    return ops.layer_norm(x, normalized_shape, weight, bias, eps)


def rms_norm(x: torch.Tensor, normalized_shape, weight, eps):
    return F.rms_norm(x, normalized_shape, weight, eps)


def rms_norm_fused(x, normalized_shape, weight, eps):
    return ops.rms_norm(x, normalized_shape, weight, eps)


def rms_norm_upcast(x: torch.Tensor, weight: torch.Tensor, eps, dtype):
    """Hugging Face's LlamaRMSNorm (and Mistral, Qwen2, Gemma-free kin): computed in fp32."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def rms_norm_written_out(x: torch.Tensor, weight: torch.Tensor, eps):
    """RMSNorm in the activation dtype, as hand-written models spell it."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# normalized_shape is the weight's shape (filters check it is 1-D): it depends on nothing the
# norm computes, so a later pattern (the residual stream) can read it before the norm's input.


def rms_norm_written_out_fused(x, weight, eps):
    return ops.rms_norm(x, weight.shape, weight, eps)


def rms_norm_written_out_weight_apart(x, weight, eps):
    return ops.rms_norm(x, weight.shape, None, eps) * weight


def rms_norm_upcast_fused(x, weight, eps, dtype):
    return ops.rms_norm(x, weight.shape, weight, eps)


def rms_norm_upcast_weight_apart(x, weight, eps, dtype):
    return weight * ops.rms_norm(x, weight.shape, None, eps)


def _casts_back_to_input(m: Match) -> str | None:
    x = m.value("x")
    if not isinstance(x, torch.Tensor):
        return "no dtype for x"
    if m["dtype"] != x.dtype:
        return f"casts the result to {m['dtype']}, not to the input's {x.dtype}"
    return None


def _weight_dtype(same: bool):
    def check(m: Match) -> str | None:
        x, w = m.value("x"), m.value("weight")
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
            return "no dtype for x or weight"
        if w.dim() != 1:
            return f"weight has {w.dim()} dimensions, not 1"
        if (w.dtype == x.dtype) != same:
            return f"weight dtype {w.dtype} {'differs from' if same else 'equals'} input dtype {x.dtype}"
        return None

    check.__name__ = "weight_dtype_same" if same else "weight_dtype_differs"
    return check


def _resolve_eps(m: Match) -> dict | None:
    """F.rms_norm's eps=None means the input dtype's epsilon: make it a number, so the residual
    stream (which takes a number) can absorb this norm later."""
    if m["eps"] is not None:
        return {}
    x = m.value("x")
    return {"eps": torch.finfo(x.dtype).eps} if isinstance(x, torch.Tensor) else None


_RMS_FILTERS = (needs_number("eps"),)

PATTERNS = (
    Pattern("layer_norm", "layer_norm", layer_norm, layer_norm_fused, ("layer_norm",),
            (needs_number("eps"),)),
    Pattern("rms_norm", "rms_norm", rms_norm, rms_norm_fused, ("rms_norm",), derive=_resolve_eps),
    Pattern("rms_norm_upcast", "rms_norm", rms_norm_upcast, rms_norm_upcast_fused, ("rms_norm",),
            (*_RMS_FILTERS, _casts_back_to_input, _weight_dtype(True))),
    Pattern("rms_norm_upcast_weight_apart", "rms_norm", rms_norm_upcast, rms_norm_upcast_weight_apart,
            ("rms_norm",), (*_RMS_FILTERS, _casts_back_to_input, _weight_dtype(False))),
    Pattern("rms_norm_written_out", "rms_norm", rms_norm_written_out, rms_norm_written_out_fused,
            ("rms_norm",), (*_RMS_FILTERS, _weight_dtype(True))),
    Pattern("rms_norm_written_out_weight_apart", "rms_norm", rms_norm_written_out,
            rms_norm_written_out_weight_apart, ("rms_norm",), (*_RMS_FILTERS, _weight_dtype(False))),
)
