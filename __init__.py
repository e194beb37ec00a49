"""trifuse: hand-written Triton kernels for transformer training, swapped into unmodified models.

Public surface: `trifuse.ops` (functional API), `trifuse.nn` (modules). Importing trifuse
registers its `trifuse::` ops with torch.library and changes nothing else in torch.
"""
from . import nn, ops
from .fusion import fuse, report

__version__ = "0.1.0"

__all__ = ["nn", "ops", "__version__"]
__all__ += ["fuse", "report"]
