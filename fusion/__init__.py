"""Capture, normalization, matching and rewriting: `fuse()`, the torch.compile backends, the report."""
