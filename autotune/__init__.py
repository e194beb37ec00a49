"""Tuning: kernel launch configurations and operator dialects, chosen once and remembered on disk.

- `Tuner` (tuner.py): one kernel's launch configuration per shape bucket, from a config space in
  configs.py, pruned by shared-memory / register estimates, timed with triton.testing.do_bench,
  then a dict lookup per call.
- `dialects` (dialects.py): per op, the fastest correct implementation among trifuse's kernel,
  PyTorch's own and third-party libraries, per shape bucket, dtype, device and determinism,
  checked against the op's reference, timed forward + backward by wall time per call (by GPU
  time replayed from a CUDA graph for the ops of blocks that `fuse(cuda_graphs=True)` graphs).
- `cache` (cache.py): the JSON cache both write (TRIFUSE_CACHE_DIR), atomic across processes,
  and the per-GPU-family defaults shipped in autotune/defaults/.
- `records()` / `format_table()`: every choice this process made and why, for trifuse.report and
  `python -m trifuse.autotune`.
- `autotune`: a thin wrapper over `triton.autotune` for kernels that keep using it.

Under the Triton interpreter, or with TRIFUSE_AUTOTUNE=0, nothing is timed: the first entry of
every config space (and the first eligible dialect candidate) is the documented default.
"""
from collections.abc import Callable, Sequence

import triton

from . import configs, dialects
from .dialects import Candidate, Dialect
from .env import autotune_enabled
from .decisions import Decision, format_table, pow2_bucket, records
from .tuner import DeviceLimits, Tuner

__all__ = ["autotune", "Tuner", "DeviceLimits", "Candidate", "Dialect", "Decision", "configs", "dialects",
           "records", "format_table", "pow2_bucket"]


def autotune(configs: Sequence[triton.Config], key: Sequence[str], **kwargs) -> Callable:
    """`triton.autotune(configs, key, **kwargs)`, reduced to `configs[0]` when tuning is off."""
    configs = list(configs)
    if not configs:
        raise ValueError("trifuse.autotune: configs must not be empty")
    if not autotune_enabled():
        configs = configs[:1]
    return triton.autotune(configs=configs, key=list(key), **kwargs)
