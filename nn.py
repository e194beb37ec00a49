"""Modules over the fused ops, state_dict-compatible with their torch.nn counterparts."""
from collections.abc import Sequence

import torch

from . import ops
from .kernels.bias_gelu import GELU_FORMS
from .kernels.group_norm import ACTIVATIONS as GROUP_NORM_ACTIVATIONS


class LayerNorm(torch.nn.LayerNorm):
    """`torch.nn.LayerNorm` computed by trifuse's kernel; loads an nn.LayerNorm state_dict as is.

    `forward(x, residual=None)`: with a residual, returns (LN(x + residual), x + residual).
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, residual)


class RMSNorm(torch.nn.Module):
    """RMSNorm with the parameters and state_dict of `torch.nn.RMSNorm` (key `weight`).

    eps=None means `torch.finfo(x.dtype).eps`, as in torch.nn.RMSNorm.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.normalized_shape, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class GroupNorm(torch.nn.GroupNorm):
    """`torch.nn.GroupNorm` computed by trifuse's kernels, optionally followed by SiLU in the same
    pass (`activation="silu"`: a UNet's or VAE's `nonlinearity(norm(x))`, whose norm output is
    then neither written nor kept for the backward). Same parameters, initialization and
    state_dict keys as nn.GroupNorm, so either loads the other's.
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        activation: str | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if activation not in GROUP_NORM_ACTIVATIONS:
            raise ValueError(f"trifuse.nn.GroupNorm: activation must be None or 'silu', got {activation!r}")
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation else "")


class LinearGELU(torch.nn.Module):
    """gelu(x @ weight.T + bias): an nn.Linear followed by GELU, with nn.Linear's parameters,
    initialization and state_dict keys (`weight`, `bias`), so either loads the other's.

    The matmul runs in cuBLAS (`F.linear` without bias); the bias is added inside trifuse's
    bias + GeLU kernel, whose backward recomputes from the matmul's output and reduces dbias
    deterministically. `approximate` is "none" (erf) or "tanh", as in nn.GELU, or "quick" for
    CLIP's QuickGELU, x * sigmoid(1.702 x).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        approximate: str = "none",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if approximate not in GELU_FORMS:
            raise ValueError("trifuse.nn.LinearGELU: approximate must be 'none', 'tanh' or 'quick', "
                             f"got {approximate!r}")
        self.in_features, self.out_features, self.approximate = in_features, out_features, approximate
        self.weight = torch.nn.Parameter(torch.empty((out_features, in_features), device=device, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization, drawing the same random numbers."""
        torch.nn.Linear.reset_parameters(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.bias_gelu(torch.nn.functional.linear(x, self.weight), self.bias, self.approximate)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, approximate={self.approximate!r}")
