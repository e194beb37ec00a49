"""Norms as Hugging Face models write them, verbatim apart from the constructor, for the pattern
tests (transformers 5.x: LlamaRMSNorm, GemmaRMSNorm, OlmoLayerNorm, T5LayerNorm, CohereLayerNorm)."""
import torch
import torch.nn.functional as F
from torch import nn

N = 24


class HFRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, verbatim."""

    def __init__(self, dim=N, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """transformers' GemmaRMSNorm, verbatim: an fp32 copy normalized, times (1 + w), cast back."""

    def __init__(self, dim=N, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(0.1 * torch.randn(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class OlmoLayerNorm(nn.Module):
    """transformers' OlmoLayerNorm, verbatim: no parameters, computed on an fp32 copy."""

    def __init__(self, dim=N):
        super().__init__()
        self.normalized_shape = (dim,)

    def forward(self, hidden_states):
        orig_dtype = hidden_states.dtype
        return F.layer_norm(hidden_states.to(dtype=torch.float32), self.normalized_shape, None, None,
                            eps=1e-5).to(orig_dtype)


class MochiRMSNorm(nn.Module):
    """diffusers' MochiRMSNorm: T5's fp32 variance, the weight in the fp32 product, one cast back."""

    def __init__(self, dim=N, eps=1e-6, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter((torch.ones(dim) + 0.1 * torch.randn(dim)).to(dtype))
        self.eps = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return (hidden_states * self.weight).to(input_dtype)


class T5LayerNorm(nn.Module):
    """transformers' T5LayerNorm, verbatim: x scaled as it is by an fp32 variance, weight first."""

    def __init__(self, dim=N, eps=1e-6, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter((torch.ones(dim) + 0.1 * torch.randn(dim)).to(dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class CohereLayerNorm(HFRMSNorm):
    """transformers' CohereLayerNorm, verbatim (its parameters as LlamaRMSNorm's): a LayerNorm
    without bias, written out on an fp32 copy."""

    def __init__(self, dim=N, eps=1e-5):
        super().__init__(dim, eps)

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight.to(torch.float32) * hidden_states
        return hidden_states.to(input_dtype)


class CentredOnceLayerNorm(nn.Module):
    """A hand-written LayerNorm without bias, the centred value computed once."""

    def __init__(self, dim=N):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        xc = x - x.mean(dim=-1, keepdim=True)
        return xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + 1e-5) * self.weight
