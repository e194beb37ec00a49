"""trifuse: hand-written Triton kernels for transformer training, swapped into unmodified models.

Public surface: `trifuse.fuse(model)` and `trifuse.report(model)`, `trifuse.ops` (functional
API), `trifuse.nn` (modules), `trifuse.parallel.shard` (tensor + sequence parallelism), and the
torch.compile backends "trifuse" and "trifuse_inductor". Importing trifuse registers its `trifuse::` ops with torch.library and changes nothing else in torch.
"""
from . import nn, ops
from . import parallel  # trifuse.parallel.shard: tensor + sequence parallelism
from .fusion import fuse, report

__version__ = "0.1.0"

__all__ = ["nn", "ops", "parallel", "fuse", "report", "__version__"]
