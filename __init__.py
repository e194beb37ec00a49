"""trifuse: hand-written Triton kernels for transformer training, swapped into unmodified models.

Public surface: `trifuse.fuse(model)` and `trifuse.report(model)`, `trifuse.ops` (functional
API), `trifuse.nn` (modules), `trifuse.parallel.shard` (tensor + sequence parallelism), and the
torch.compile backends "trifuse" and "trifuse_inductor". Importing trifuse registers its `trifuse::` ops with torch.library and changes nothing else in torch
(it does take a source checkout's root off sys.path: `_unshadow_top_level_names`).
"""
import os as _os
import sys as _sys


def _unshadow_top_level_names() -> None:
    """Takes this package's own directory off sys.path. It is there when Python runs from a source
    checkout's root (`python -m pytest`, `python -m trifuse.autotune`, `python -c`: the current
    directory comes first), and then trifuse's subpackages shadow top-level ones of the same name:
    transformers 5.25 imports the Hub's `kernels` package and got `trifuse/kernels` instead. Nothing
    is lost: those directories are importable as `trifuse.*`, as they are meant to be."""
    here = _os.path.realpath(_os.path.dirname(__file__))
    _sys.path[:] = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != here]


_unshadow_top_level_names()

from . import nn, ops, parallel  # parallel: trifuse.parallel.shard, tensor + sequence parallelism
from .fusion import fuse, report

__version__ = "0.1.0"

__all__ = ["nn", "ops", "parallel", "fuse", "report", "__version__"]
