"""Modules over the fused ops, state_dict-compatible with their torch.nn counterparts."""
from collections.abc import Sequence

import torch

from . import ops


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
