"""The subgraphs trifuse finds, written as plain PyTorch functions, each with its replacement.

PATTERNS is the registry, in priority order within each stage (see _base.py): the residual
stream is tried before a lone dropout + add, so an add feeding a norm becomes the larger op;
a GeLU times another tensor becomes gated_activation in stage 0, before bias_gelu's stage 1 could
take the GeLU alone; a norm modulated per sample (adaptive_norm) before the residual stream, so a
DiT block's modulated norm keeps its product and sum rather than the add before it.
"""
from . import (
    adaptive_norm,
    attention,
    bias_gelu,
    cross_entropy,
    dropout_add,
    gated_activation,
    group_norm,
    layer_norm,
    residual_stream,
    rotary,
    xielu,
)
from ._base import Pattern

PATTERNS: tuple[Pattern, ...] = (
    *layer_norm.PATTERNS,
    *group_norm.PATTERNS,
    *adaptive_norm.PATTERNS,
    *rotary.PATTERNS,
    *attention.PATTERNS,
    *gated_activation.PATTERNS,
    *xielu.PATTERNS,  # before dropout_add's gated add, which its `alpha_p * x * x + beta * x` is
    *bias_gelu.PATTERNS,
    *residual_stream.PATTERNS,
    *dropout_add.PATTERNS,
    *cross_entropy.PATTERNS,
)

__all__ = ["PATTERNS", "Pattern"]
