"""Dropout + residual add, `residual + F.dropout(x, p, training)` either way round, in one pass
each way; then (stage 2) the bias of the linear producing x folded in:
`residual + dropout(linear(h, w, b))` -> `dropout_add(linear(h, w), residual, p, training, bias=b)`;
the linear also as HF's Conv1D (`addmm(...).view(...)`) or a plain `addmm(b, h2d, w)` (a 2-D
residual; a bias of one vector over the output columns).

An add that feeds a norm is the residual stream's (residual_stream.py, matched first). p and the
training flag are the model's; an inactive dropout (p = 0 or eval) makes the op a plain add that
still takes the bias. A parallel block's `dropout(attn) + dropout(mlp) + residual` (GPT-J,
GPT-NeoX, Phi) is summed the other way round, `dropout_add(attn, dropout_add(mlp, residual))`, so
that both dropouts are the op's: one rounding of the sum moves, as in any fused add.

Stage 3: the gated add at a diffusion transformer block's end, where no norm follows in the block
(the next block's norm is in another graph): `residual + gate * x`, the gate one vector per sample
(Flux's, SD3's and DiT's `h + gate_mlp.unsqueeze(1) * ff_out`, a LayerScale's `x + gamma * f(x)`),
and Wan's and ACE-Step's fp32 forms cast back to the stream, `(h.float() + ff_out.float() *
gate).type_as(h)`, become `dropout_add(x, residual, 0.0, gate=gate)`: one pass each way instead of
the product's and the sum's, dgate summed per sample in the backward. A gated add before a norm is
the gated norm's (adaptive_norm.py, stage 2). Stage 4 folds the bias of the linear producing x in
(Flux's single blocks: `residual + gate * proj_out(h)`). A gate per token of x's full size (FLUX.3's
and Qwen-Image 2.1's `h + gate * (attn + ff)`, gate a (B, S, N) chunk of a per-token projection;
Helios' fp32 one) takes the op's per-token kernels, read in place; a gate broadcast per token
((S, N), (B, S, 1)) stays PyTorch's product. These are found in the graphs fuse
captures for a block's other ops (its norms, its attention): a module whose only candidate is a
sum of a product is not captured for it (most such sums are no gated add; their capture would
cost every model with one).
"""
import functools

import torch
import torch.nn.functional as F

from ._base import Match, Pattern, known_equal, needs_bool, needs_number, ops
from .adaptive_norm import (
    gate_per_sample,
    gate_per_sample_or_token,
    gate_per_sample_or_token_up_to_fp32,
    gate_per_sample_up_to_fp32,
    sum_operands,
)
from .bias_gelu import bias_is_a_row_vector


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p, training):
    return residual + F.dropout(x, p, training, False)


def dropout_add_fused(x, residual, p, training):
    return ops.dropout_add(x, residual, p, training)


def parallel_dropouts_add(x: torch.Tensor, y: torch.Tensor, residual: torch.Tensor, p, training, q, training_y):
    """A parallel block's end (GPT-J's, GPT-NeoX's, Phi's): `dropout(attn) + dropout(mlp) + residual`,
    after stage 1 made the first sum `dropout_add(attn, dropout(mlp))`."""
    return ops.dropout_add(x, F.dropout(y, q, training_y, False), p, training) + residual


def parallel_dropouts_add_fused(x, y, residual, p, training, q, training_y):
    return ops.dropout_add(x, ops.dropout_add(y, residual, q, training_y), p, training)


def parallel_dropouts_add_norm(x: torch.Tensor, y: torch.Tensor, residual: torch.Tensor, p, training, q,
                               training_y, normalized_shape, weight, bias, eps, is_rms_norm, *, swapped: bool):
    """The same sum where the next block's norm reads it in the same graph (torch.compile of a whole
    model): stage 1 made it `dropout_add_layer_norm(dropout_add(attn, dropout(mlp)), residual)`, the
    two dropouts' sum as the norm op's x or (`swapped`) as its residual."""
    branches = ops.dropout_add(x, F.dropout(y, q, training_y, False), p, training)
    first, second = (residual, branches) if swapped else (branches, residual)
    return ops.dropout_add_layer_norm(first, second, normalized_shape, weight, bias, eps, 0.0, True, None,
                                      is_rms_norm)


def parallel_dropouts_add_norm_fused(x, y, residual, p, training, q, training_y, normalized_shape, weight, bias,
                                     eps, is_rms_norm, *, swapped: bool):
    return ops.dropout_add_layer_norm(x, ops.dropout_add(y, residual, q, training_y), normalized_shape, weight,
                                      bias, eps, p, training, None, is_rms_norm)


def linear_dropout_add(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, residual: torch.Tensor, p, training):
    return ops.dropout_add(F.linear(h, w, b), residual, p, training, None)


def linear_dropout_add_fused(h, w, b, residual, p, training):
    return ops.dropout_add(F.linear(h, w), residual, p, training, b)


def conv1d_dropout_add(h2d: torch.Tensor, w: torch.Tensor, b: torch.Tensor, shape, residual: torch.Tensor, p,
                       training):
    return ops.dropout_add(torch.addmm(b, h2d, w).view(shape), residual, p, training, None)


def conv1d_dropout_add_fused(h2d, w, b, shape, residual, p, training):
    return ops.dropout_add(torch.mm(h2d, w).view(shape), residual, p, training, b)


def addmm_dropout_add(h2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, p,
                      training):
    return ops.dropout_add(torch.addmm(bias, h2d, weight), residual, p, training, None)


def addmm_dropout_add_fused(h2d, weight, bias, residual, p, training):
    return ops.dropout_add(torch.mm(h2d, weight), residual, p, training, bias)


def gated_add(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor):
    return residual + gate * x


def gated_add_fused(x, residual, gate):
    return ops.dropout_add(x, residual, 0.0, True, None, gate)


def gated_add_in_fp32(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor, dtype):
    """Wan's feed-forward: `(h.float() + ff_output.float() * c_gate_msa).type_as(h)`."""
    return (residual.to(torch.float32) + x.to(torch.float32) * gate).to(dtype)


def gated_add_in_fp32_of_x(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor, dtype):
    """Wan's self-attention output where no norm follows: `(h.float() + attn_out * gate).type_as(h)`."""
    return (residual.to(torch.float32) + x * gate).to(dtype)


def gated_add_promoted(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor, dtype):
    """ACE-Step's: `(h + attn_out * gate).type_as(h)`, the fp32 gate promoting the sum."""
    return (residual + x * gate).to(dtype)


def gated_add_cast_back_fused(x, residual, gate, dtype):
    return ops.dropout_add(x, residual, 0.0, True, None, gate)


def _gate_per_sample_or_full_size(m: Match, per_sample, per_token) -> str | None:
    """`per_sample(m)`'s answer where the gate is one vector per sample; else, for a gate shaped
    like x's trailing dims (FLUX.3's and Qwen-Image 2.1's full-size per-token chunks, MiniMax H3's
    (S, N) per position repeated over the batch), `per_token(m)`'s: the op reads those in place.
    A gate broadcast otherwise ((B, S, 1), a scalar per token) stays PyTorch's product: the op
    would copy it to full size first, a pass the product does not make."""
    why = per_sample(m)
    if why is None:
        return None
    x, gate = m.value("x"), m.value("gate")
    if isinstance(x, torch.Tensor) and isinstance(gate, torch.Tensor) and _trailing_dims_of(gate, x):
        if x.dim() < 3:
            # a recurrent scan's step ((B, N) products in a loop over time: RWKV's, RecurrentGemma's):
            # small tensors, many calls, where the op's host path would cost more than it saves
            return f"{why}; a per-token gate needs tokens: x is {x.dim()}-D, not (batch, tokens, features)"
        return per_token(m) or _not_in_rows(m)
    return why


def _trailing_dims_of(gate: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether gate, 1s aside on the left, is x's trailing dims (the last one included)."""
    if gate.dim() > x.dim() or gate.dim() == 0:
        return False
    dims = list(gate.shape)
    while len(dims) > 1 and known_equal(dims[0], 1):
        dims.pop(0)
    return all(known_equal(a, b) for a, b in zip(dims, x.shape[x.dim() - len(dims):]))


def _not_in_rows(m: Match) -> str | None:
    """x, the residual and the gate each with a unit stride along the last dim (rows the kernels
    read in place); a channels-last activation's product and sum stay PyTorch's, which keep its
    layout without a copy."""
    for name in ("x", "residual", "gate"):
        t = m.value(name)
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} is not laid out in rows (last-dim stride {t.stride(-1)}, channels-last): the op would copy it"
    return None


def gate_per_sample_or_full_size(m: Match) -> str | None:
    """The gate one vector per sample, or per token of x's full size; no wider than x."""
    return _gate_per_sample_or_full_size(m, gate_per_sample, gate_per_sample_or_token)


def cast_back_to_the_stream(m: Match) -> str | None:
    """The fp32 sum cast back to x's and the residual's dtype (the op's y), the gate a vector per
    sample or per token of x's full size, no wider than fp32 (Helios' per-token fp32 gate): the
    op's fp32 product and sum are the model's."""
    x, dtype = m.value("x"), m["dtype"]
    if isinstance(x, torch.Tensor) and dtype != x.dtype:
        return f"the sum is cast to {dtype}, not to x's dtype {x.dtype}"
    return sum_operands(m) or _gate_per_sample_or_full_size(m, gate_per_sample_up_to_fp32,
                                                            gate_per_sample_or_token_up_to_fp32)


def linear_gated_add(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor):
    return ops.dropout_add(F.linear(h, w, b), residual, 0.0, True, None, gate)


def linear_gated_add_fused(h, w, b, residual, gate):
    return ops.dropout_add(F.linear(h, w), residual, 0.0, True, b, gate)


_GATED_CAST_BACK = (gated_add_in_fp32, gated_add_in_fp32_of_x, gated_add_promoted)

PATTERNS = (
    Pattern("dropout_add", "dropout_add", dropout_add, dropout_add_fused, ("dropout_add",),
            (needs_number("p"), needs_bool("training")), stage=1),
    # after dropout_add, in the same stage: before stage 2 folds each branch's bias
    Pattern("parallel_dropouts_add", "dropout_add", parallel_dropouts_add, parallel_dropouts_add_fused,
            ("dropout_add",), (needs_number("q"), needs_bool("training_y")), stage=1,
            call_families=("dropout_add", "dropout_add")),
    *(Pattern("parallel_dropouts_add_norm", "dropout_add",
              functools.partial(parallel_dropouts_add_norm, swapped=swapped),
              functools.partial(parallel_dropouts_add_norm_fused, swapped=swapped),
              ("dropout_add", "dropout_add_layer_norm"), (needs_number("q"), needs_bool("training_y")), stage=1,
              call_families=("dropout_add", "residual_stream"))
      for swapped in (False, True)),
    Pattern("linear_dropout_add", "dropout_add", linear_dropout_add, linear_dropout_add_fused, ("dropout_add",),
            stage=2),
    Pattern("conv1d_dropout_add", "dropout_add", conv1d_dropout_add, conv1d_dropout_add_fused, ("dropout_add",),
            stage=2),
    Pattern("addmm_dropout_add", "dropout_add", addmm_dropout_add, addmm_dropout_add_fused, ("dropout_add",),
            (bias_is_a_row_vector,), stage=2),
    # quiet: most sums of a product are no gated add
    *(Pattern(search.__name__, "dropout_add", search, gated_add_cast_back_fused, ("dropout_add",),
              (cast_back_to_the_stream,), stage=3, quiet=True) for search in _GATED_CAST_BACK),
    Pattern("gated_add", "dropout_add", gated_add, gated_add_fused, ("dropout_add",),
            (sum_operands, gate_per_sample_or_full_size), stage=3, quiet=True),
    Pattern("linear_gated_add", "dropout_add", linear_gated_add, linear_gated_add_fused, ("dropout_add",),
            stage=4),
)
