"""Modules over the fused ops, state_dict-compatible with their torch.nn counterparts."""
from collections.abc import Sequence

import torch

from . import ops
from .kernels.bias_gelu import APPROXIMATE


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
        if approximate not in APPROXIMATE:
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
