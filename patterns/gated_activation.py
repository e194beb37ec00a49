"""Gated activation: act(gate) * up, the middle of a gated MLP (SwiGLU, GeGLU), in one pass each
way that saves only gate and up.

Spellings (stage 0): `F.silu(gate) * up` (`nn.SiLU`, Hugging Face's SiLUActivation: Llama,
Mistral, Qwen2, OLMo, Cohere, Phi-3), the SiLU written out as `gate * torch.sigmoid(gate) * up`,
the SiLU of gate's fp32 copy cast back (diffusers' FP32SiLU: Lumina 2's feed-forward), and
`F.gelu(gate, approximate=...) * up` in both forms (`nn.GELU`, Hugging Face's GELUActivation
and GELUTanh: Gemma's gelu_pytorch_tanh), kept as written: the exact erf form stays "gelu", the
tanh form "gelu_tanh". Multiplications match either way round (fusion/match.py). Phi-3's
`gate, up = gate_up_proj(x).chunk(2, dim=-1)` needs no spelling of its own: the two halves are the
two inputs, read in place by the kernels.

These run in stage 0, before bias_gelu's stage 1 turns `F.gelu(F.linear(x, w, b))` into
bias_gelu: a GeGLU whose gate projection has a bias becomes one gated_activation (the bias stays
in the linear), while a lone GeLU after a biased linear still becomes bias_gelu. A GeLU written
out as its formula becomes `bias_gelu(gate, None)` in stage 0 (bias_gelu.py); times `up` it
becomes gated_activation in stage 1 (`bias_gelu_mul`), before stage 2 could give it a bias.
QuickGELU (bias_gelu's "quick" form, gpt-oss's `gate * sigmoid(1.702 gate)`) times up stays two
ops: gated_activation has no quick form, and `known_gelu_form` says so in the report.

ReGLU, `torch.relu(gate) * up` (`F.relu`, `nn.ReLU`: T5's feed_forward_proj="gated-relu"), is
stage 0's `relu_mul`. The squared ReLU (BitNet's `relu2(gate_proj(x)) * up_proj(x)`) became
bias_gelu's "relu2" form in stage 0; times up it is `bias_gelu_mul` in stage 1, as a GeLU
written out.

Stage 1, after all of those: a dropout on the product (T5 v1.1's, mT5's and Flan-T5's
`dropout(act(wi_0(x)) * wi_1(x))` before `wo`) moves into the op, its mask regenerated from a seed
in the backward rather than stored; p and the training flag are the model's.

Filters: gate and up have the same shape (the op does not broadcast) and the same floating-point
dtype (the product would promote); anything else is left as written, with the reason in the report.
"""
import torch
import torch.nn.functional as F

from ._base import Match, Pattern, needs_bool, needs_number, ops, same_shape

# bias_gelu's forms that gated_activation has, by its names.
_GELU = {"none": "gelu", "tanh": "gelu_tanh", "relu": "relu", "relu2": "relu2"}


def silu_mul(gate: torch.Tensor, up: torch.Tensor):
    """Llama's MLP: `act_fn(gate_proj(x)) * up_proj(x)` with act_fn SiLU."""
    return F.silu(gate, False) * up


def silu_written_out_mul(gate: torch.Tensor, up: torch.Tensor):
    return gate * torch.sigmoid(gate) * up


def silu_of_fp32_copy_mul(gate: torch.Tensor, up: torch.Tensor, dtype):
    """diffusers' FP32SiLU (Lumina 2's feed-forward): `F.silu(gate.float()).to(gate.dtype) * up`."""
    return F.silu(gate.to(torch.float32), False).to(dtype) * up


def silu_mul_fused(gate, up):
    return ops.gated_activation(gate, up, "silu")


def gelu_mul(gate: torch.Tensor, up: torch.Tensor, approximate):
    """GeGLU: Gemma's gelu_pytorch_tanh (approximate='tanh'), or the exact erf form."""
    return F.gelu(gate, approximate=approximate) * up


def bias_gelu_mul(gate: torch.Tensor, up: torch.Tensor, approximate):
    """A GeLU written out (stage 0 made it bias_gelu without bias) times up."""
    return ops.bias_gelu(gate, None, approximate) * up


def relu_mul(gate: torch.Tensor, up: torch.Tensor):
    """ReGLU: `act_fn(gate_proj(x)) * up_proj(x)` with act_fn ReLU (T5's "gated-relu")."""
    return torch.relu(gate) * up


def relu_mul_fused(gate, up):
    return ops.gated_activation(gate, up, "relu")


def gelu_mul_fused(gate, up, approximate):
    return ops.gated_activation(gate, up, _GELU[approximate])


def gate_and_up_alike(m: Match) -> str | None:
    """The op multiplies element by element: gate and up must have one shape (no broadcasting)
    and one floating-point dtype (no promotion)."""
    gate, up = m.value("gate"), m.value("up")
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        return "no tensor metadata for gate or up"
    if not gate.is_floating_point() or not up.is_floating_point():
        return f"gate has dtype {gate.dtype} and up {up.dtype}, not floating point"
    if gate.dtype != up.dtype:
        return f"gate has dtype {gate.dtype} but up {up.dtype} (the product would promote)"
    if not same_shape(gate, up):
        return f"gate has shape {tuple(gate.shape)} but up {tuple(up.shape)} (broadcasting)"
    return None


def cast_back_to_the_gate(m: Match) -> str | None:
    """The SiLU of gate's fp32 copy cast back to gate's dtype: the op's SiLU, computed in fp32 as
    the kernels compute it, its product rounded once (the model rounds the SiLU too). A gate wider
    than fp32 would lose digits in the copy."""
    gate, dtype = m.value("gate"), m["dtype"]
    if not isinstance(gate, torch.Tensor):
        return "no tensor metadata for gate"
    if torch.promote_types(gate.dtype, torch.float32) != torch.float32:
        return f"gate ({gate.dtype}) is wider than its fp32 copy"
    if dtype != gate.dtype:
        return f"the SiLU of gate's fp32 copy is cast to {dtype}, not back to gate's {gate.dtype}"
    return None


def known_gelu_form(m: Match) -> str | None:
    if m["approximate"] not in _GELU:
        return f"approximate is {m['approximate']!r}: gated_activation has the forms {tuple(_GELU)} only"
    return None


def gated_activation_dropout(gate: torch.Tensor, up: torch.Tensor, activation, p, training):
    return F.dropout(ops.gated_activation(gate, up, activation, 0.0, True), p, training, False)


def gated_activation_dropout_fused(gate, up, activation, p, training):
    return ops.gated_activation(gate, up, activation, p, training)


_OPS = ("gated_activation",)
_FILTERS = (gate_and_up_alike,)

PATTERNS = (
    Pattern("silu_mul", "gated_activation", silu_mul, silu_mul_fused, _OPS, _FILTERS),
    Pattern("silu_of_fp32_copy_mul", "gated_activation", silu_of_fp32_copy_mul, silu_mul_fused, _OPS,
            (cast_back_to_the_gate, *_FILTERS)),
    Pattern("silu_written_out_mul", "gated_activation", silu_written_out_mul, silu_mul_fused, _OPS, _FILTERS),
    Pattern("gelu_mul", "gated_activation", gelu_mul, gelu_mul_fused, _OPS, (known_gelu_form, *_FILTERS)),
    Pattern("relu_mul", "gated_activation", relu_mul, relu_mul_fused, _OPS, _FILTERS),
    Pattern("bias_gelu_mul", "gated_activation", bias_gelu_mul, gelu_mul_fused, ("bias_gelu", *_OPS),
            (known_gelu_form, *_FILTERS), stage=1),
    Pattern("gated_activation_dropout", "gated_activation", gated_activation_dropout, gated_activation_dropout_fused,
            _OPS, (needs_number("p"), needs_bool("training")), stage=1),
)
