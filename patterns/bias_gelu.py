"""Bias + GeLU: the activation after a linear, with the linear's bias moved into one fused
pass (the matmul stays with cuBLAS, without its bias epilogue).

Spellings: `F.gelu` / `nn.GELU` in both forms (approximate 'none' and 'tanh', kept as written);
the tanh formula written out (Hugging Face's NewGELUActivation and FastGELUActivation, GPT-2's
original code), the erf formula written out, and CLIP's QuickGELU `x * sigmoid(1.702 x)` (Hugging
Face's QuickGELUActivation: CLIP, OWL-ViT, X-CLIP, GroupViT, CLIPSeg, AltCLIP, Chinese-CLIP; the
op's approximate='quick', its own maths, no GeLU form), which first become one `bias_gelu`
without bias (stage 0), then take the bias of the linear before them (stage 2). The linear is `F.linear` /
`nn.Linear`, or Hugging Face's Conv1D (`addmm(bias, x2d, w).view(...)`). A GeLU without a
biased linear before it stays `F.gelu`: one kernel already.

Stage 3, after the bias moved in: a dropout on the op's output (BART's and Pegasus' activation
dropout, `fc2(dropout(gelu(fc1(x))))`) moves into the op, its mask regenerated from a seed in the
backward rather than stored; p and the training flag are the model's.

ReLU MLPs (OPT, T5, DETR, M2M100 and NLLB, FSMT, Speech2Text, and `nn.TransformerEncoderLayer` /
`DecoderLayer` by default) take the op's "relu" form (`torch.relu`, `F.relu`, `nn.ReLU`, `x.relu()`;
the in-place `F.relu(x, inplace=True)` is left as written). A ReLU alone is one kernel already and
stays torch.relu: it becomes the op where a linear's bias moves in (`linear_relu`) or where a
dropout in training follows it (`relu_dropout`: T5's `wo(dropout(relu(wi(x))))`, whose `wi` has no
bias), both stage 1, `linear_relu` tried first so that a biased linear's ReLU takes its bias, its
dropout folding in at stage 3 as the GeLUs' does.

The squared ReLU (Primer's relu(x)^2; transformers' ReLUSquaredActivation, `hidden_act="relu2"`:
Nemotron, Nemotron-H, Persimmon, Fuyu, Arcee, Jais2, nanochat; modded-nanoGPT's
`F.relu(x).square()`) is two kernels each way in PyTorch, and its backward keeps both relu(x) and
x: it becomes the op's "relu2" form with or without a bias, in stage 0 as a written-out GeLU does
(`relu_squared`, the square in any spelling the normalizer makes `torch.pow(x, 2)`: `torch.square`,
`x ** 2`, `x * x`), the bias of the linear before it moving in at stage 2.

Under tensor parallelism (trifuse.parallel) a column-parallel linear runs on DTensors and its
output reaches the GeLU as the local shard of its columns, `linear(...).redistribute(mesh,
placements).to_local()`; the `*_on_shards` spellings move the bias out of the linear into the
op as the local shard of the bias (`bias.to_local()`), which covers the same columns when the
weight and bias are sharded over the output features and the output over its last dim
(`bias_sharded_like_columns`).
"""
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._base import Filter, Match, Pattern, needs_bool, needs_float_tensors, needs_number, ops

# QuickGELU's sigmoid slope, as transformers writes it (kernels/bias_gelu.py's QUICK_ALPHA).
QUICK_GELU_SLOPE = 1.702


def gelu_tanh_written_out(x: torch.Tensor):
    """Hugging Face's NewGELUActivation, GPT-2's and BERT's original code."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh_fast_written_out(x: torch.Tensor):
    """Hugging Face's FastGELUActivation, Megatron's bias_gelu: the same function, factored."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def gelu_tanh_cubed_written_out(x: torch.Tensor, *, scaled_first: bool):
    """The tanh form with the cube written as a product: `0.044715 * (x * x * x)` (canonical form:
    `x^2 * x`) or, scaled_first, `0.044715 * x * x * x`, which multiplies from the left."""
    cubic = 0.044715 * x * x * x if scaled_first else 0.044715 * (torch.pow(x, 2) * x)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + cubic)))


def gelu_erf_written_out(x: torch.Tensor):
    """The exact GeLU, x * Phi(x), as older code and Megatron write it."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_erf_times_root_half_written_out(x: torch.Tensor):
    """The same with x times 1/sqrt(2) (`x * 0.7071067811865476`) where others divide by sqrt(2).
    A constant off by more than 1e-6 relative (Megatron's `x / 1.41421`) is another function."""
    return x * 0.5 * (1.0 + torch.erf(x * math.sqrt(0.5)))


def gelu_quick_written_out(x: torch.Tensor, slope):
    """CLIP's QuickGELU, Hugging Face's QuickGELUActivation: x * sigmoid(1.702 x). `slope` is
    matched as any constant, and `slope_is_quick_gelus` keeps only 1.702: x * sigmoid(c x) for
    another c is another function (SiLU at c = 1), left as written."""
    return x * torch.sigmoid(slope * x)


def slope_is_quick_gelus(m: Match) -> str | None:
    """The sigmoid's slope is QuickGELU's own constant, 1.702, and nothing else."""
    slope = m["slope"]
    if isinstance(slope, torch.fx.Node):
        return f"the sigmoid's slope is computed in the graph, not QuickGELU's constant {QUICK_GELU_SLOPE!r}"
    if not isinstance(slope, float) or slope != QUICK_GELU_SLOPE:
        return f"x * sigmoid({slope!r} x) is not QuickGELU's x * sigmoid({QUICK_GELU_SLOPE!r} x)"
    return None


def relu_squared(x: torch.Tensor):
    """Primer's squared ReLU, transformers' ReLUSquaredActivation: `torch.square(F.relu(x))`."""
    return torch.pow(torch.relu(x), 2)


def relu_squared_fused(x):
    return ops.bias_gelu(x, None, "relu2")


def gelu_tanh_fused(x):
    return ops.bias_gelu(x, None, "tanh")


def gelu_erf_fused(x):
    return ops.bias_gelu(x, None, "none")


def gelu_quick_fused(x):
    return ops.bias_gelu(x, None, "quick")


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


# Column-parallel (trifuse.parallel): the linear on DTensors, the GeLU on the local columns.


def linear_gelu_on_shards(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mesh, placements,
                          approximate):
    local = F.linear(x, weight, bias).redistribute(mesh, placements, async_op=False).to_local()
    return F.gelu(local, approximate=approximate)


def linear_gelu_on_shards_fused(x, weight, bias, mesh, placements, approximate):
    local = F.linear(x, weight).redistribute(mesh, placements, async_op=False).to_local()
    return ops.bias_gelu(local, bias.to_local(), approximate)


def linear_bias_gelu_on_shards(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mesh, placements,
                               approximate):
    local = F.linear(x, weight, bias).redistribute(mesh, placements, async_op=False).to_local()
    return ops.bias_gelu(local, None, approximate)


def conv1d_bias_gelu_on_shards(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, shape, mesh,
                               placements, approximate):
    local = torch.addmm(bias, x2d, weight).view(shape).redistribute(mesh, placements, async_op=False).to_local()
    return ops.bias_gelu(local, None, approximate)


def conv1d_gelu_on_shards_fused(x2d, weight, bias, shape, mesh, placements, approximate):
    local = torch.mm(x2d, weight).view(shape).redistribute(mesh, placements, async_op=False).to_local()
    return ops.bias_gelu(local, bias.to_local(), approximate)


def bias_sharded_like_columns(weight_out_dim: int, out_ndim: Callable[[Match], int]) -> Filter:
    """The bias is sharded over its features as the weight over its output features
    (`weight_out_dim`: 0 for Linear's (out, in), 1 for Conv1D's (in, out)) and the output over its
    last dim, one mesh dim each: the local bias then covers the local columns."""

    def check(m: Match) -> str | None:
        from torch.distributed.tensor import DTensor, Shard

        bias, weight = m.value("bias"), m.value("weight")
        if not isinstance(bias, DTensor) or not isinstance(weight, DTensor):
            return "the bias or the weight is not a DTensor"
        last = out_ndim(m) - 1
        placements = tuple(m["placements"])
        if len(placements) != len(bias.placements):
            return f"output placements {placements} on another mesh than the bias's {bias.placements}"
        for pb, pw, po in zip(bias.placements, weight.placements, placements):
            if not (pb == Shard(0) and pw == Shard(weight_out_dim) and isinstance(po, Shard) and po.dim in (-1, last)):
                return (f"bias {bias.placements}, weight {weight.placements}, output {placements}: not sharded "
                        "over the output features alike")
        return None

    check.__name__ = "bias_sharded_like_columns"
    return check


def linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    return torch.relu(F.linear(x, weight, bias))


def linear_relu_fused(x, weight, bias):
    return ops.bias_gelu(F.linear(x, weight), bias, "relu")


def linear_relu_on_shards(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mesh, placements):
    return torch.relu(F.linear(x, weight, bias).redistribute(mesh, placements, async_op=False).to_local())


def linear_relu_on_shards_fused(x, weight, bias, mesh, placements):
    local = F.linear(x, weight).redistribute(mesh, placements, async_op=False).to_local()
    return ops.bias_gelu(local, bias.to_local(), "relu")


def linear_has_a_bias(m: Match) -> str | None:
    """A linear without a bias gives the op nothing to take in: its ReLU stays torch.relu."""
    return None if isinstance(m["bias"], torch.fx.Node) else "the linear has no bias to move into the op"


def relu_dropout(x: torch.Tensor, p, training):
    return F.dropout(torch.relu(x), p, training, False)


def relu_dropout_fused(x, p, training):
    return ops.bias_gelu(x, None, "relu", p, training)


def dropout_in_training(m: Match) -> str | None:
    """The dropout drops something: in eval (or at p = 0) it is the identity and the ReLU alone
    stays torch.relu, one kernel already."""
    if m["training"] is not True:
        return "the dropout is off (training=False): the ReLU alone is one kernel already"
    if isinstance(m["p"], (int, float)) and m["p"] == 0:
        return "the dropout's p is 0: the ReLU alone is one kernel already"
    return None


def bias_gelu_dropout(x: torch.Tensor, bias, approximate, p, training):
    return F.dropout(ops.bias_gelu(x, bias, approximate, 0.0, True), p, training, False)


def bias_gelu_dropout_fused(x, bias, approximate, p, training):
    return ops.bias_gelu(x, bias, approximate, p, training)


_OPS = ("bias_gelu",)

PATTERNS = (
    Pattern("gelu_tanh_written_out", "bias_gelu", gelu_tanh_written_out, gelu_tanh_fused, _OPS),
    Pattern("gelu_tanh_fast_written_out", "bias_gelu", gelu_tanh_fast_written_out, gelu_tanh_fused, _OPS),
    *(Pattern("gelu_tanh_cubed_written_out" + ("_scaled_first" if first else ""), "bias_gelu",
              functools.partial(gelu_tanh_cubed_written_out, scaled_first=first), gelu_tanh_fused, _OPS)
      for first in (False, True)),
    Pattern("gelu_erf_written_out", "bias_gelu", gelu_erf_written_out, gelu_erf_fused, _OPS),
    Pattern("gelu_erf_times_root_half_written_out", "bias_gelu", gelu_erf_times_root_half_written_out,
            gelu_erf_fused, _OPS),
    Pattern("gelu_quick_written_out", "bias_gelu", gelu_quick_written_out, gelu_quick_fused, _OPS,
            (slope_is_quick_gelus,)),
    Pattern("relu_squared", "bias_gelu", relu_squared, relu_squared_fused, _OPS, (needs_float_tensors("x"),)),
    Pattern("linear_gelu", "bias_gelu", linear_gelu, linear_gelu_fused, _OPS, stage=1),
    Pattern("conv1d_gelu", "bias_gelu", conv1d_gelu, conv1d_gelu_fused, _OPS, stage=1),
    Pattern("addmm_gelu", "bias_gelu", addmm_gelu, addmm_gelu_fused, _OPS, (bias_is_a_row_vector,), stage=1),
    Pattern("linear_gelu_on_shards", "bias_gelu", linear_gelu_on_shards, linear_gelu_on_shards_fused, _OPS,
            (bias_sharded_like_columns(0, lambda m: m.value("x").dim()),), stage=1),
    Pattern("linear_bias_gelu", "bias_gelu", linear_bias_gelu, linear_gelu_fused, _OPS, stage=2),
    Pattern("conv1d_bias_gelu", "bias_gelu", conv1d_bias_gelu, conv1d_gelu_fused, _OPS, stage=2),
    Pattern("addmm_bias_gelu", "bias_gelu", addmm_bias_gelu, addmm_gelu_fused, _OPS, (bias_is_a_row_vector,),
            stage=2),
    Pattern("linear_bias_gelu_on_shards", "bias_gelu", linear_bias_gelu_on_shards,
            linear_gelu_on_shards_fused, _OPS, (bias_sharded_like_columns(0, lambda m: m.value("x").dim()),),
            stage=2),
    Pattern("conv1d_bias_gelu_on_shards", "bias_gelu", conv1d_bias_gelu_on_shards, conv1d_gelu_on_shards_fused,
            _OPS, (bias_sharded_like_columns(1, lambda m: len(m.value("shape"))),), stage=2),
    Pattern("linear_relu", "bias_gelu", linear_relu, linear_relu_fused, _OPS, (linear_has_a_bias,), stage=1),
    Pattern("linear_relu_on_shards", "bias_gelu", linear_relu_on_shards, linear_relu_on_shards_fused, _OPS,
            (linear_has_a_bias, bias_sharded_like_columns(0, lambda m: m.value("x").dim())), stage=1),
    Pattern("relu_dropout", "bias_gelu", relu_dropout, relu_dropout_fused, _OPS,
            (needs_number("p"), needs_bool("training"), dropout_in_training), stage=1),
    Pattern("bias_gelu_dropout", "bias_gelu", bias_gelu_dropout, bias_gelu_dropout_fused, _OPS,
            (needs_number("p"), needs_bool("training")), stage=3),
)
