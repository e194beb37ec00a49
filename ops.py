"""The functional API: one function per fused op, named and shaped like torch.nn.functional.

Each dispatches to a thin autograd.Function in eager mode and to the registered `trifuse::`
op under torch.compile, fx and export.
"""
from .kernels.adaptive_norm import gated_add_layer_norm_modulate, layer_norm_modulate
from .kernels.attention import attention
from .kernels.attention_varlen import attention_varlen
from .kernels.bias_gelu import bias_gelu
from .kernels.channel_norm import channel_norm
from .kernels.cross_entropy import cross_entropy, linear_cross_entropy
from .kernels.dropout_add import dropout_add
from .kernels.gated_activation import gated_activation
from .kernels.group_norm import group_norm
from .kernels.layer_norm import dropout_add_layer_norm, layer_norm, layer_norm_add, rms_norm
from .kernels.rotary import rotary_embedding
from .kernels.xielu import xielu

__all__ = ["layer_norm", "rms_norm", "dropout_add_layer_norm", "layer_norm_add", "attention", "attention_varlen"]
__all__ += ["cross_entropy", "linear_cross_entropy"]
__all__ += ["bias_gelu", "dropout_add", "gated_activation", "rotary_embedding", "layer_norm_modulate"]
__all__ += ["gated_add_layer_norm_modulate", "group_norm", "xielu", "channel_norm"]
