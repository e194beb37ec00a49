"""Capture, normalization, matching and rewriting: `fuse()`, the torch.compile backends, the report."""
from . import backend
from .backend import trifuse_backend, trifuse_inductor_backend
from .fuse import fuse
from .report import FusionReport, report
from .rewriter import FAMILIES, RewriteLog, rewrite

__all__ = ["FAMILIES", "FusionReport", "RewriteLog", "fuse", "report", "rewrite", "trifuse_backend",
           "trifuse_inductor_backend"]

backend.register()
