"""Dropout + residual add, `residual + F.dropout(x, p, training)` either way round, in one pass
each way; then (stage 2) the bias of the linear producing x folded in:
`residual + dropout(linear(h, w, b))` -> `dropout_add(linear(h, w), residual, p, training, bias=b)`;
the linear also as HF's Conv1D (`addmm(...).view(...)`) or a plain `addmm(b, h2d, w)` (a 2-D
residual; a bias of one vector over the output columns).

An add that feeds a norm is the residual stream's (residual_stream.py, matched first). p and the
training flag are the model's; an inactive dropout (p = 0 or eval) makes the op a plain add that
still takes the bias.
"""
import torch
import torch.nn.functional as F

from ._base import Pattern, needs_bool, needs_number, ops
from .bias_gelu import bias_is_a_row_vector


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p, training):
    return residual + F.dropout(x, p, training, False)


def dropout_add_fused(x, residual, p, training):
    return ops.dropout_add(x, residual, p, training)


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


PATTERNS = (
    Pattern("dropout_add", "dropout_add", dropout_add, dropout_add_fused, ("dropout_add",),
            (needs_number("p"), needs_bool("training")), stage=1),
    Pattern("linear_dropout_add", "dropout_add", linear_dropout_add, linear_dropout_add_fused, ("dropout_add",),
            stage=2),
    Pattern("conv1d_dropout_add", "dropout_add", conv1d_dropout_add, conv1d_dropout_add_fused, ("dropout_add",),
            stage=2),
    Pattern("addmm_dropout_add", "dropout_add", addmm_dropout_add, addmm_dropout_add_fused, ("dropout_add",),
            (bias_is_a_row_vector,), stage=2),
)
