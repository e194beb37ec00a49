"""Helpers for the tests of ops that drop elements from a seed (bias_gelu, gated_activation,
dropout_add): the mask a seed draws, and an op call made deterministic for gradcheck."""
from collections.abc import Callable

import torch

from _device import DEVICE


def keep_of(seed: torch.Tensor, shape: tuple, p: float) -> torch.Tensor:
    """The 0/1 mask (float64) that `seed` draws for an output of `shape`: dropout_add's Philox
    stream, the one every trifuse kernel that drops shares."""
    from trifuse.kernels.dropout_add import dropout_add_bwd

    return (dropout_add_bwd(torch.ones(shape, device=DEVICE), seed, p, False)[0] != 0).double()


def seeded(fn: Callable, seed: int = 0) -> Callable:
    """fn with torch.manual_seed(seed) before each call: the same mask every call, so gradcheck
    sees a deterministic function."""

    def call(*args):
        torch.manual_seed(seed)
        return fn(*args)

    return call
