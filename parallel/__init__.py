"""Tensor and sequence parallelism over torch.distributed: `trifuse.parallel.shard(model, mesh)`.

See shard.py for what sharding does, plan.py for how the plan is derived from recognized blocks,
styles.py for the parallel styles (PyTorch's, extended to HF Conv1D and fused QKV projections)
and random.py for dropout under tensor and sequence parallelism.
"""
from .shard import gather_full, shard
from .styles import ColwiseParallel, RowwiseParallel

__all__ = ["shard", "gather_full", "ColwiseParallel", "RowwiseParallel"]
