"""Capture, normalization, matching and rewriting: `fuse()`, the torch.compile backends, the report."""
from .fuse import fuse
from .report import FusionReport, report
from .rewriter import FAMILIES, RewriteLog, rewrite

__all__ = ["FAMILIES", "FusionReport", "RewriteLog", "fuse", "report", "rewrite"]
