"""The residual stream: an add (with dropout) feeding a norm becomes one pass each way.

    s = residual + dropout(x, p)        (dropout optional)
    y = norm(s)                          LayerNorm or RMSNorm, already a trifuse norm (stage 0)
  ->  y, s = dropout_add_layer_norm(x, residual, ...)

Post-norm blocks (BERT, nn.TransformerEncoder's default) use only y; pre-norm blocks (GPT-2,
ViT, Llama) also carry s on as the next residual. The dropout's p and training flag are the
model's. Then (stage 2) the bias of the linear producing x moves into the op as `x_bias`, so the
matmul runs without its bias epilogue and the bias gradient comes out of the fused backward.

The post-norm residual add, the other way round (OLMo 2 and 3, Gemma 2 and 3's sandwich norms,
Swin V2, EXAONE 4, T5Gemma):

    y = residual + norm(x)               the norm already a trifuse norm (stage 0)
  ->  y = layer_norm_add(x, residual, ...)

one pass reading x and the residual and writing y, where the norm and the add each made one. It
is tried before the add-then-norm patterns: in Gemma 2's `pre_ff_norm(residual +
post_attn_norm(h))` either grouping is one op and one norm, and taking the first norm into the
add moves less (the norm's output is never written; the add's sum is written once either way).

Under sequence parallelism (trifuse.parallel) the add runs on local sequence shards and the norm
on a DTensor made of them, `norm(from_local(s, placements))`; the `*_on_shards` spellings fuse
that into one op on DTensors, `dropout_add_layer_norm(from_local(x, ...), from_local(residual,
...))`, and hand s on as the local tensor it was. Only when the shards split rows (a batch or
sequence dim, never a normalized one: a norm needs its whole row) and x and the residual have
one shape, so that both are shards alike (`rows_sharded`). The linear's bias stays there: the
row-parallel linear's output reaches the add through a reduce-scatter. The post-norm add is
written `residual + norm(from_local(x, placements)).to_local()` there, and fuses the same way
(`layer_norm_add_on_shards`). The normalized shape may be computed in the graph (`weight.shape`
of the replicated DTensor weight): its value is read from the graph, the node passed on.
"""
import functools

import torch
import torch.nn.functional as F

from ._base import Match, Pattern, from_local, known_equal, needs_bool, needs_number, ops, same_shape
from .adaptive_norm import gate_per_sample_or_token, gate_per_sample_or_token_up_to_fp32, sum_operands
from .bias_gelu import bias_is_a_row_vector


def dropout_add_layer_norm(x: torch.Tensor, residual: torch.Tensor, p, training, normalized_shape,
                           weight, bias, eps):
    s = residual + F.dropout(x, p, training, False)
    return ops.layer_norm(s, normalized_shape, weight, bias, eps), s


def dropout_add_layer_norm_fused(x, residual, p, training, normalized_shape, weight, bias, eps):
    y, s = ops.dropout_add_layer_norm(x, residual, normalized_shape, weight, bias, eps, p, training)
    return y, s


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, normalized_shape, weight, bias, eps):
    s = residual + x
    return ops.layer_norm(s, normalized_shape, weight, bias, eps), s


def add_layer_norm_fused(x, residual, normalized_shape, weight, bias, eps):
    y, s = ops.dropout_add_layer_norm(x, residual, normalized_shape, weight, bias, eps)
    return y, s


def dropout_add_reshape_layer_norm(x: torch.Tensor, residual: torch.Tensor, p, training, shape, normalized_shape,
                                   weight, bias, eps):
    """OPT's MLP half: the sum flattened to rows (`reshape(-1, hidden)`) before the norm."""
    s = (residual + F.dropout(x, p, training, False)).reshape(shape)
    return ops.layer_norm(s, normalized_shape, weight, bias, eps), s


def dropout_add_reshape_layer_norm_fused(x, residual, p, training, shape, normalized_shape, weight, bias, eps):
    # A reshape that keeps the normalized dims commutes with the norm: the op takes x as the
    # linear made it (its bias can still move in, stage 2) and both results are reshaped.
    y, s = ops.dropout_add_layer_norm(x, residual, normalized_shape, weight, bias, eps, p, training)
    return y.reshape(shape), s.reshape(shape)


def _operands_of_one_shape(m: Match) -> str | None:
    """None when x and the residual are tensors of one shape, else why not (a broadcast add)."""
    x, residual = m.value("x"), m.value("residual")
    if not isinstance(x, torch.Tensor) or not isinstance(residual, torch.Tensor):
        return "x or residual: no tensor metadata"
    if not same_shape(x, residual):
        return f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape (a broadcast add)"
    return None


def _same_shape_sum(m: Match) -> tuple[torch.Tensor, tuple[int, ...]] | str:
    """(x's value, the normalized shape as a tuple) when x and the residual are tensors of one
    shape and normalized_shape's value is known (a constant, or a shape computed in the graph),
    else why not: a filter rejects what it cannot read rather than failing the whole rewrite."""
    why = _operands_of_one_shape(m)
    if why is not None:
        return why
    x = m.value("x")
    # A constant, or a shape computed in the graph (`weight.shape` of a DTensor weight under
    # sequence parallelism) whose value is known: the replacement passes the node on as it is.
    normalized = m.value("normalized_shape")
    normalized = (normalized,) if isinstance(normalized, int) else normalized
    if not isinstance(normalized, (tuple, list)) or not all(isinstance(n, int) for n in normalized):
        return f"normalized_shape {m['normalized_shape']}: not a constant, nor a shape of known value"
    return x, tuple(normalized)


def layer_norm_add(x: torch.Tensor, residual: torch.Tensor, normalized_shape, weight, bias, eps):
    return residual + ops.layer_norm(x, normalized_shape, weight, bias, eps)


def layer_norm_add_fused(x, residual, normalized_shape, weight, bias, eps):
    return ops.layer_norm_add(x, residual, normalized_shape, weight, bias, eps)


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor, normalized_shape, weight, eps):
    return residual + ops.rms_norm(x, normalized_shape, weight, eps)


def rms_norm_add_fused(x, residual, normalized_shape, weight, eps):
    return ops.layer_norm_add(x, residual, normalized_shape, weight, None, eps, is_rms_norm=True)


def rms_norm_weight_apart_add(x: torch.Tensor, residual: torch.Tensor, normalized_shape, weight: torch.Tensor,
                              eps):
    """Llama's RMSNorm in 16 bits under autocast (`weight * x.to(input_dtype)`, an fp32 weight):
    stage 0 leaves the weight apart, the norm's output rounded to x's dtype before it."""
    return residual + weight * ops.rms_norm(x, normalized_shape, None, eps)


def layer_norm_add_on_shards(x: torch.Tensor, residual: torch.Tensor, placements, normalized_shape, weight,
                             bias, eps):
    """Under sequence parallelism: the norm on a DTensor made of the local shards, its output
    made local again before the add (the post-attention norm of Gemma 2 or OLMo 2)."""
    return residual + ops.layer_norm(from_local(x, placements), normalized_shape, weight, bias, eps).to_local()


def layer_norm_add_on_shards_fused(x, residual, placements, normalized_shape, weight, bias, eps):
    return ops.layer_norm_add(from_local(x, placements), from_local(residual, placements), normalized_shape,
                              weight, bias, eps).to_local()


def rms_norm_add_on_shards(x: torch.Tensor, residual: torch.Tensor, placements, normalized_shape, weight, eps):
    return residual + ops.rms_norm(from_local(x, placements), normalized_shape, weight, eps).to_local()


def rms_norm_add_on_shards_fused(x, residual, placements, normalized_shape, weight, eps):
    return ops.layer_norm_add(from_local(x, placements), from_local(residual, placements), normalized_shape,
                              weight, None, eps, is_rms_norm=True).to_local()


def _plain_same_shape(m: Match) -> str | None:
    """The norm-then-add's filter: x and the residual of one shape (no broadcast add), and no
    DTensor (see below; sequence parallelism's local-shard spelling is `*_add_on_shards`).
    normalized_shape may be computed in the graph (`weight.shape`, as HF's norms pass it): the
    op takes it as the norm did."""
    why = _operands_of_one_shape(m)
    if why is not None:
        return why
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    if any(isinstance(m.value(name), DTensor) for name in ("x", "residual")):
        # A DTensor sum is not written this way under trifuse.parallel (the add runs on local
        # shards: the *_on_shards spellings); the op's strategy would take it, but a model's own
        # DTensor arithmetic may mix layouts the op's strategies do not cover.
        return "x or residual is a DTensor (only the local-shard spelling, *_add_on_shards, is fused)"
    return None


def _weight_apart_fits(m: Match) -> str | None:
    """The weight a per-feature vector (what the norm would take), and the model's result dtype
    the op's: promote(x, residual) must not be narrower than with the weight in the product."""
    found = _plain_same_shape(m)
    if found is not None:
        return found
    x, residual, weight = m.value("x"), m.value("residual"), m.value("weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not known_equal(weight.shape[0], x.shape[-1]):
        return f"weight {tuple(getattr(weight, 'shape', ()))}: not a vector over x's last dim {x.shape[-1]}"
    if torch.promote_types(x.dtype, residual.dtype) != torch.promote_types(
            torch.promote_types(x.dtype, weight.dtype), residual.dtype):
        return f"the model's sum is {weight.dtype} (the weight's), the op's would be {residual.dtype}"
    return None


def _reshape_keeps_normalized_dims(m: Match) -> str | None:
    found = _same_shape_sum(m)
    if isinstance(found, str):
        return found
    x, normalized = found
    k = len(normalized)
    if x.dim() < k or not all(known_equal(a, b) for a, b in zip(x.shape[x.dim() - k:], normalized)):
        return f"the sum's last dims {tuple(x.shape)[-k:]} are not the normalized {normalized}"
    return None


def dropout_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, p, training, normalized_shape, weight, eps):
    s = residual + F.dropout(x, p, training, False)
    return ops.rms_norm(s, normalized_shape, weight, eps), s


def dropout_add_rms_norm_fused(x, residual, p, training, normalized_shape, weight, eps):
    y, s = ops.dropout_add_layer_norm(x, residual, normalized_shape, weight, None, eps, p, training,
                                      is_rms_norm=True)
    return y, s


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, normalized_shape, weight, eps):
    s = residual + x
    return ops.rms_norm(s, normalized_shape, weight, eps), s


def add_rms_norm_fused(x, residual, normalized_shape, weight, eps):
    y, s = ops.dropout_add_layer_norm(x, residual, normalized_shape, weight, None, eps, is_rms_norm=True)
    return y, s


def dropout_add_layer_norm_on_shards(x: torch.Tensor, residual: torch.Tensor, p, training, placements,
                                     normalized_shape, weight, bias, eps):
    s = residual + F.dropout(x, p, training, False)
    return ops.layer_norm(from_local(s, placements), normalized_shape, weight, bias, eps), s


def dropout_add_layer_norm_on_shards_fused(x, residual, p, training, placements, normalized_shape, weight,
                                           bias, eps):
    y, s = ops.dropout_add_layer_norm(from_local(x, placements), from_local(residual, placements),
                                      normalized_shape, weight, bias, eps, p, training)
    return y, s.to_local()


def dropout_add_reshape_layer_norm_on_shards(x: torch.Tensor, residual: torch.Tensor, p, training, shape,
                                             placements, normalized_shape, weight, bias, eps):
    """OPT's MLP half under sequence parallelism: this rank's rows, flattened, then normed."""
    s = (residual + F.dropout(x, p, training, False)).reshape(shape)
    return ops.layer_norm(from_local(s, placements), normalized_shape, weight, bias, eps), s


def dropout_add_reshape_layer_norm_on_shards_fused(x, residual, p, training, shape, placements, normalized_shape,
                                                   weight, bias, eps):
    # The placements are the flattened sum's: the local operands are flattened first.
    y, s = ops.dropout_add_layer_norm(from_local(x.reshape(shape), placements),
                                      from_local(residual.reshape(shape), placements), normalized_shape, weight,
                                      bias, eps, p, training)
    return y, s.to_local()


def add_layer_norm_on_shards(x: torch.Tensor, residual: torch.Tensor, placements, normalized_shape, weight,
                             bias, eps):
    s = residual + x
    return ops.layer_norm(from_local(s, placements), normalized_shape, weight, bias, eps), s


def add_layer_norm_on_shards_fused(x, residual, placements, normalized_shape, weight, bias, eps):
    y, s = ops.dropout_add_layer_norm(from_local(x, placements), from_local(residual, placements),
                                      normalized_shape, weight, bias, eps)
    return y, s.to_local()


def dropout_add_rms_norm_on_shards(x: torch.Tensor, residual: torch.Tensor, p, training, placements,
                                   normalized_shape, weight, eps):
    s = residual + F.dropout(x, p, training, False)
    return ops.rms_norm(from_local(s, placements), normalized_shape, weight, eps), s


def dropout_add_rms_norm_on_shards_fused(x, residual, p, training, placements, normalized_shape, weight, eps):
    y, s = ops.dropout_add_layer_norm(from_local(x, placements), from_local(residual, placements),
                                      normalized_shape, weight, None, eps, p, training, is_rms_norm=True)
    return y, s.to_local()


def add_rms_norm_on_shards(x: torch.Tensor, residual: torch.Tensor, placements, normalized_shape, weight,
                           eps):
    s = residual + x
    return ops.rms_norm(from_local(s, placements), normalized_shape, weight, eps), s


def add_rms_norm_on_shards_fused(x, residual, placements, normalized_shape, weight, eps):
    y, s = ops.dropout_add_layer_norm(from_local(x, placements), from_local(residual, placements),
                                      normalized_shape, weight, None, eps, is_rms_norm=True)
    return y, s.to_local()


def _rows_of(placements: tuple, ndim: int, normalized: tuple[int, ...]) -> str | None:
    """None when every mesh dim shards a row dim of an `ndim`-dim tensor normalized over its last
    len(normalized) dims (or replicates it) and one at least shards, else why not."""
    from torch.distributed.tensor import Replicate, Shard

    rows = ndim - len(normalized)
    for pl in placements:
        if isinstance(pl, Shard):
            dim = pl.dim + ndim if pl.dim < 0 else pl.dim
            if not 0 <= dim < rows:
                return f"placements {placements}: dim {pl.dim} is a normalized dim, not a row dim"
        elif not isinstance(pl, Replicate):
            return f"placements {placements}: {pl} is neither a shard of rows nor a replica"
    if not any(isinstance(pl, Shard) for pl in placements):
        return f"placements {placements}: no mesh dim shards the rows"
    return None


def rows_sharded(m: Match) -> str | None:
    """Every mesh dim shards a row dim of the sum (or replicates it), one at least shards: no
    shard splits a normalized dim, no partial sum is pending, and x and the residual are shards
    of the same shape."""
    found = _same_shape_sum(m)
    if isinstance(found, str):
        return found
    x, normalized = found
    return _rows_of(tuple(m["placements"]), x.dim(), normalized)


def reshaped_rows_sharded(m: Match) -> str | None:
    """`rows_sharded` for a sum reshaped before the norm (OPT's flattened tokens): the reshape
    keeps the normalized dims, and the placements shard a row dim of the reshaped sum."""
    why = _reshape_keeps_normalized_dims(m)
    if why is not None:
        return why
    shape = m.value("shape")
    if not isinstance(shape, (tuple, list)):
        return f"shape {m['shape']}: not a constant, nor a shape of known value"
    return _rows_of(tuple(m["placements"]), len(shape), _same_shape_sum(m)[1])


# Stage 2: the bias of the linear (nn.Linear, HF's Conv1D: addmm + view, or a plain addmm) producing x.


def linear_residual_norm(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, residual: torch.Tensor,
                         normalized_shape, weight, bias, eps, p, training, is_rms_norm):
    return ops.dropout_add_layer_norm(F.linear(h, w, b), residual, normalized_shape, weight, bias, eps, p,
                                      training, None, is_rms_norm)


def linear_residual_norm_fused(h, w, b, residual, normalized_shape, weight, bias, eps, p, training, is_rms_norm):
    return ops.dropout_add_layer_norm(F.linear(h, w), residual, normalized_shape, weight, bias, eps, p,
                                      training, b, is_rms_norm)


def conv1d_residual_norm(h2d: torch.Tensor, w: torch.Tensor, b: torch.Tensor, shape, residual: torch.Tensor,
                         normalized_shape, weight, bias, eps, p, training, is_rms_norm):
    return ops.dropout_add_layer_norm(torch.addmm(b, h2d, w).view(shape), residual, normalized_shape, weight,
                                      bias, eps, p, training, None, is_rms_norm)


def conv1d_residual_norm_fused(h2d, w, b, shape, residual, normalized_shape, weight, bias, eps, p, training,
                               is_rms_norm):
    return ops.dropout_add_layer_norm(torch.mm(h2d, w).view(shape), residual, normalized_shape, weight, bias,
                                      eps, p, training, b, is_rms_norm)


def addmm_residual_norm(h2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                        normalized_shape, norm_weight, norm_bias, eps, p, training, is_rms_norm):
    return ops.dropout_add_layer_norm(torch.addmm(bias, h2d, weight), residual, normalized_shape, norm_weight,
                                      norm_bias, eps, p, training, None, is_rms_norm)


def addmm_residual_norm_fused(h2d, weight, bias, residual, normalized_shape, norm_weight, norm_bias, eps, p, training,
                              is_rms_norm):
    return ops.dropout_add_layer_norm(torch.mm(h2d, weight), residual, normalized_shape, norm_weight, norm_bias,
                                      eps, p, training, bias, is_rms_norm)


# Stage 2: a LayerScale before the add (DINOv2, DeiT III, CaiT, EVA: `residual + gamma * x`, gamma
# a learned (N,) vector) folds into the norm's load of x, as a DiT block's gate does: the product
# is one pass fewer each way, and dgamma is summed in the norm's backward. A gate that varies along
# the tokens (Helios' per-token gate, any full-size product before the add) folds the same way:
# the op's row kernels read it a row at a time and write dgate per element.


def layer_scale_residual_norm(x: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor, normalized_shape,
                              weight, bias, eps, p, training, is_rms_norm, *, swapped: bool = False):
    # gate: the LayerScale's gamma, named as gated_add_layer_norm_modulate and its filters name it.
    # swapped: the stage-1 add took the product as its residual (`gamma * x + h` matches either
    # way round; without dropout the two arguments are a plain sum).
    scaled = gate * x
    if swapped:
        return ops.dropout_add_layer_norm(residual, scaled, normalized_shape, weight, bias, eps, p, training,
                                          None, is_rms_norm)
    return ops.dropout_add_layer_norm(scaled, residual, normalized_shape, weight, bias, eps, p, training,
                                      None, is_rms_norm)


def layer_scale_residual_norm_fused(x, gate, residual, normalized_shape, weight, bias, eps, p, training,
                                    is_rms_norm, *, swapped: bool = False):
    return ops.gated_add_layer_norm_modulate(x, residual, gate, normalized_shape, None, None, weight, bias,
                                             eps, is_rms_norm=is_rms_norm)


def no_dropout_on_the_sum(m: Match) -> str | None:
    """The add's dropout inactive (p 0, or not training: the op has no dropout with a gate), the
    norm over x's last dim alone (the op's normalized shape), x and the residual of one shape and
    dtype, the gate (gamma) a vector, or a gate per token, no wider than x."""
    p, training = m["p"], m["training"]
    if not (isinstance(p, (int, float)) and p == 0 or training is False):
        return f"dropout p={p!r} in training on the sum (the fused op has no dropout with a gate)"
    x, shape = m.value("x"), m.value("normalized_shape")
    shape = (shape,) if isinstance(shape, int) else shape
    if (not isinstance(x, torch.Tensor) or x.dim() == 0 or not isinstance(shape, (tuple, list))
            or len(shape) != 1 or not known_equal(shape[0], x.shape[-1])):
        return f"normalized_shape {shape!r} is not x's last dim alone"
    return sum_operands(m) or gate_per_sample_or_token(m)


# Stage 2: Wan's gated add, written in fp32 and cast back to the stream's dtype, before a plain
# norm (its cross-attention's FP32LayerNorm, the stage-0 norm of the cast-back sum):
#
#     s = (h.float() + attn_out * gate_msa).type_as(h);  y = norm2(s.float()).type_as(s)
#  -> y, s = gated_add_layer_norm_modulate(attn_out, h, gate_msa, ..., weight, bias)
#
# The op's product and sum are in fp32 as the model's (its gate fp32 beside a bf16 stream), s
# rounded once to the stream's dtype and normalized as stored. The fp32 copy of h stays only
# where something else still reads it (Wan's first norm does not: fp32_copy_*_modulate). ACE-Step
# writes the same sum without the copy, its fp32 gate promoting it (`gated_add_promoted_*`).


def gated_add_in_fp32_layer_norm(x: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor,
                                 normalized_shape, weight, bias, eps, dtype):
    s = (residual.to(torch.float32) + x * gate).to(dtype)
    return ops.layer_norm(s, normalized_shape, weight, bias, eps), s


def gated_add_in_fp32_layer_norm_fused(x, gate, residual, normalized_shape, weight, bias, eps, dtype):
    y, s = ops.gated_add_layer_norm_modulate(x, residual, gate, normalized_shape, None, None, weight, bias,
                                             eps)
    return y, s


def gated_add_in_fp32_rms_norm(x: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor, normalized_shape,
                               weight, eps, dtype):
    s = (residual.to(torch.float32) + x * gate).to(dtype)
    return ops.rms_norm(s, normalized_shape, weight, eps), s


def gated_add_in_fp32_rms_norm_fused(x, gate, residual, normalized_shape, weight, eps, dtype):
    y, s = ops.gated_add_layer_norm_modulate(x, residual, gate, normalized_shape, None, None, weight, None,
                                             eps, is_rms_norm=True)
    return y, s


def gated_add_promoted_layer_norm(x: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor,
                                  normalized_shape, weight, bias, eps, dtype):
    """ACE-Step's spelling: `(h + attn_out * gate).type_as(h)`, the fp32 gate promoting the sum."""
    s = (residual + x * gate).to(dtype)
    return ops.layer_norm(s, normalized_shape, weight, bias, eps), s


def gated_add_promoted_rms_norm(x: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor, normalized_shape,
                                weight, eps, dtype):
    s = (residual + x * gate).to(dtype)
    return ops.rms_norm(s, normalized_shape, weight, eps), s


def sum_cast_back_to_the_stream(m: Match) -> str | None:
    """x and the residual of one shape and dtype, the fp32 sum cast back to it (s in the op's
    dtype), the norm over x's last dim alone, the gate a vector per sample or per token (Helios')
    no wider than fp32."""
    x, shape, dtype = m.value("x"), m.value("normalized_shape"), m["dtype"]
    if isinstance(x, torch.Tensor) and dtype != x.dtype:
        return f"the sum is cast to {dtype}, not to x's dtype {x.dtype}"
    shape = (shape,) if isinstance(shape, int) else shape
    if (not isinstance(x, torch.Tensor) or x.dim() == 0 or not isinstance(shape, (tuple, list))
            or len(shape) != 1 or not known_equal(shape[0], x.shape[-1])):
        return f"normalized_shape {shape!r} is not x's last dim alone"
    return sum_operands(m) or gate_per_sample_or_token_up_to_fp32(m)


_DROPOUT = (needs_number("p"), needs_bool("training"))
_OPS = ("dropout_add_layer_norm", "layer_norm")
_RMS_OPS = ("dropout_add_layer_norm", "rms_norm")

PATTERNS = (
    Pattern("layer_norm_add", "residual_stream", layer_norm_add, layer_norm_add_fused, ("layer_norm_add", "layer_norm"),
            (_plain_same_shape,), stage=1),
    Pattern("rms_norm_add", "residual_stream", rms_norm_add, rms_norm_add_fused, ("layer_norm_add", "rms_norm"),
            (_plain_same_shape, needs_number("eps")), stage=1),
    Pattern("rms_norm_weight_apart_add", "residual_stream", rms_norm_weight_apart_add, rms_norm_add_fused,
            ("layer_norm_add", "rms_norm"), (_weight_apart_fits, needs_number("eps")), stage=1),
    Pattern("layer_norm_add_on_shards", "residual_stream", layer_norm_add_on_shards, layer_norm_add_on_shards_fused,
            ("layer_norm_add", "layer_norm"), (rows_sharded,), stage=1),
    Pattern("rms_norm_add_on_shards", "residual_stream", rms_norm_add_on_shards, rms_norm_add_on_shards_fused,
            ("layer_norm_add", "rms_norm"), (needs_number("eps"), rows_sharded), stage=1),
    Pattern("dropout_add_layer_norm", "residual_stream", dropout_add_layer_norm, dropout_add_layer_norm_fused,
            _OPS, _DROPOUT, stage=1),
    Pattern("add_layer_norm", "residual_stream", add_layer_norm, add_layer_norm_fused, _OPS, stage=1),
    Pattern("dropout_add_reshape_layer_norm", "residual_stream", dropout_add_reshape_layer_norm,
            dropout_add_reshape_layer_norm_fused, _OPS, (*_DROPOUT, _reshape_keeps_normalized_dims), stage=1),
    Pattern("dropout_add_rms_norm", "residual_stream", dropout_add_rms_norm, dropout_add_rms_norm_fused,
            _RMS_OPS, (*_DROPOUT, needs_number("eps")), stage=1),
    Pattern("add_rms_norm", "residual_stream", add_rms_norm, add_rms_norm_fused, _RMS_OPS,
            (needs_number("eps"),), stage=1),
    Pattern("dropout_add_layer_norm_on_shards", "residual_stream", dropout_add_layer_norm_on_shards,
            dropout_add_layer_norm_on_shards_fused, _OPS, (*_DROPOUT, rows_sharded), stage=1),
    Pattern("dropout_add_reshape_layer_norm_on_shards", "residual_stream", dropout_add_reshape_layer_norm_on_shards,
            dropout_add_reshape_layer_norm_on_shards_fused, _OPS, (*_DROPOUT, reshaped_rows_sharded), stage=1),
    Pattern("add_layer_norm_on_shards", "residual_stream", add_layer_norm_on_shards,
            add_layer_norm_on_shards_fused, _OPS, (rows_sharded,), stage=1),
    Pattern("dropout_add_rms_norm_on_shards", "residual_stream", dropout_add_rms_norm_on_shards,
            dropout_add_rms_norm_on_shards_fused, _RMS_OPS, (*_DROPOUT, needs_number("eps"), rows_sharded),
            stage=1),
    Pattern("add_rms_norm_on_shards", "residual_stream", add_rms_norm_on_shards, add_rms_norm_on_shards_fused,
            _RMS_OPS, (needs_number("eps"), rows_sharded), stage=1),
    *(Pattern("layer_scale_residual_norm", "residual_stream", functools.partial(layer_scale_residual_norm,
                                                                               swapped=swapped),
              functools.partial(layer_scale_residual_norm_fused, swapped=swapped),
              ("gated_add_layer_norm_modulate", "dropout_add_layer_norm"), (no_dropout_on_the_sum,), stage=2)
      for swapped in (False, True)),
    Pattern("gated_add_in_fp32_layer_norm", "residual_stream", gated_add_in_fp32_layer_norm,
            gated_add_in_fp32_layer_norm_fused, ("gated_add_layer_norm_modulate", "layer_norm"),
            (sum_cast_back_to_the_stream, needs_number("eps")), stage=2),
    Pattern("gated_add_in_fp32_rms_norm", "residual_stream", gated_add_in_fp32_rms_norm,
            gated_add_in_fp32_rms_norm_fused, ("gated_add_layer_norm_modulate", "rms_norm"),
            (sum_cast_back_to_the_stream, needs_number("eps")), stage=2),
    Pattern("gated_add_promoted_layer_norm", "residual_stream", gated_add_promoted_layer_norm,
            gated_add_in_fp32_layer_norm_fused, ("gated_add_layer_norm_modulate", "layer_norm"),
            (sum_cast_back_to_the_stream, needs_number("eps")), stage=2),
    Pattern("gated_add_promoted_rms_norm", "residual_stream", gated_add_promoted_rms_norm,
            gated_add_in_fp32_rms_norm_fused, ("gated_add_layer_norm_modulate", "rms_norm"),
            (sum_cast_back_to_the_stream, needs_number("eps")), stage=2),
    Pattern("linear_residual_norm", "residual_stream", linear_residual_norm, linear_residual_norm_fused,
            ("dropout_add_layer_norm",), stage=2),
    Pattern("conv1d_residual_norm", "residual_stream", conv1d_residual_norm, conv1d_residual_norm_fused,
            ("dropout_add_layer_norm",), stage=2),
    Pattern("addmm_residual_norm", "residual_stream", addmm_residual_norm, addmm_residual_norm_fused,
            ("dropout_add_layer_norm",), (bias_is_a_row_vector,), stage=2),
)
