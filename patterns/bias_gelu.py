"""Bias + GeLU: the activation after a linear, with the linear's bias moved into one fused
pass (the matmul stays with cuBLAS, without its bias epilogue).

Spellings: `F.gelu` / `nn.GELU` in both forms (approximate 'none' and 'tanh', kept as written);
the tanh formula written out (Hugging Face's NewGELUActivation and FastGELUActivation, GPT-2's
original code) and the erf formula written out, which first become one `bias_gelu` without bias
(stage 0), then take the bias of the linear before them (stage 2). The linear is `F.linear` /
`nn.Linear`, or Hugging Face's Conv1D (`addmm(bias, x2d, w).view(...)`). A GeLU without a
biased linear before it stays `F.gelu`: one kernel already.
"""
import math

import torch
import torch.nn.functional as F

from ._base import Match, Pattern, ops


def gelu_tanh_written_out(x: torch.Tensor):
    """Hugging Face's NewGELUActivation, GPT-2's and BERT's original code."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh_fast_written_out(x: torch.Tensor):
    """Hugging Face's FastGELUActivation, Megatron's bias_gelu: the same function, factored."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def gelu_erf_written_out(x: torch.Tensor):
    """The exact GeLU, x * Phi(x), as older code and Megatron write it."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh_fused(x):
    return ops.bias_gelu(x, None, "tanh")


def gelu_erf_fused(x):
    return ops.bias_gelu(x, None, "none")


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate):
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def linear_gelu_fused(x, weight, bias, approximate):
    return ops.bias_gelu(F.linear(x, weight), bias, approximate)


def conv1d_gelu(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, shape, approximate):
    return F.gelu(torch.addmm(bias, x2d, weight).view(shape), approximate=approximate)


def conv1d_gelu_fused(x2d, weight, bias, shape, approximate):
    return ops.bias_gelu(torch.mm(x2d, weight).view(shape), bias, approximate)


def addmm_gelu(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate):
    return F.gelu(torch.addmm(bias, x2d, weight), approximate=approximate)


def addmm_gelu_fused(x2d, weight, bias, approximate):
    return ops.bias_gelu(torch.mm(x2d, weight), bias, approximate)


def bias_is_a_row_vector(m: Match) -> str | None:
    """addmm's bias broadcasts; the op's bias is one vector over the output columns."""
    b, w = m.value("bias"), m.value("weight")
    if not isinstance(b, torch.Tensor) or not isinstance(w, torch.Tensor):
        return "no shape for the bias or the weight"
    if b.dim() != 1 or b.shape[0] != w.shape[-1]:
        return f"addmm's bias has shape {tuple(b.shape)}, not ({w.shape[-1]},)"
    return None


# Stage 2: a written-out GeLU became bias_gelu(x, None); the linear before it gives its bias.


def addmm_bias_gelu(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate):
    return ops.bias_gelu(torch.addmm(bias, x2d, weight), None, approximate)



def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate):
    return ops.bias_gelu(F.linear(x, weight, bias), None, approximate)


def conv1d_bias_gelu(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, shape, approximate):
    return ops.bias_gelu(torch.addmm(bias, x2d, weight).view(shape), None, approximate)


_OPS = ("bias_gelu",)

PATTERNS = (
    Pattern("gelu_tanh_written_out", "bias_gelu", gelu_tanh_written_out, gelu_tanh_fused, _OPS),
    Pattern("gelu_tanh_fast_written_out", "bias_gelu", gelu_tanh_fast_written_out, gelu_tanh_fused, _OPS),
    Pattern("gelu_erf_written_out", "bias_gelu", gelu_erf_written_out, gelu_erf_fused, _OPS),
    Pattern("linear_gelu", "bias_gelu", linear_gelu, linear_gelu_fused, _OPS, stage=1),
    Pattern("conv1d_gelu", "bias_gelu", conv1d_gelu, conv1d_gelu_fused, _OPS, stage=1),
    Pattern("addmm_gelu", "bias_gelu", addmm_gelu, addmm_gelu_fused, _OPS, (bias_is_a_row_vector,), stage=1),
    Pattern("linear_bias_gelu", "bias_gelu", linear_bias_gelu, linear_gelu_fused, _OPS, stage=2),
    Pattern("conv1d_bias_gelu", "bias_gelu", conv1d_bias_gelu, conv1d_gelu_fused, _OPS, stage=2),
    Pattern("addmm_bias_gelu", "bias_gelu", addmm_bias_gelu, addmm_gelu_fused, _OPS, (bias_is_a_row_vector,),
            stage=2),
)
