"""Kernel configuration spaces and the one wrapper over `triton.autotune`.

Under the Triton interpreter, or with TRIFUSE_AUTOTUNE=0, only the first configuration is
passed on: the interpreter cannot benchmark, and the first entry of every list is the
documented default.
"""
from collections.abc import Callable, Sequence

import triton

from .env import autotune_enabled


def autotune(configs: Sequence[triton.Config], key: Sequence[str], **kwargs) -> Callable:
    """`triton.autotune(configs, key, **kwargs)`, reduced to `configs[0]` when tuning is off."""
    configs = list(configs)
    if not configs:
        raise ValueError("trifuse.autotune: configs must not be empty")
    if not autotune_enabled():
        configs = configs[:1]
    return triton.autotune(configs=configs, key=list(key), **kwargs)
