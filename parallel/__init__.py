"""Tensor and sequence parallelism over torch.distributed: `trifuse.parallel.shard(model, mesh)`.

See sharding.py for what sharding does, plan.py for how the plan is derived from recognized
blocks, styles.py for the parallel styles (PyTorch's, extended to HF Conv1D and fused QKV
projections), multihead.py for nn.MultiheadAttention, experts.py for mixture-of-experts blocks,
and random.py for dropout under tensor and sequence parallelism.

The names load on first use: importing torch.distributed.tensor costs about half a second, which
`import trifuse` should not charge to programs that never shard.
"""

import importlib

_EXPORTS = {
    "shard": ".sharding",
    "gather_full": ".sharding",
    "ColwiseParallel": ".styles",
    "RowwiseParallel": ".styles",
    "MultiheadAttentionParallel": ".multihead",
    "ExpertsParallel": ".experts",
    "MoEBlockParallel": ".experts",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


def _register_dtensor_strategies() -> None:
    # DTensor sharding strategies for the trifuse:: ops (dtensor_ops.py), so that fused models
    # run under sequence parallelism. torch._dynamo, which trifuse.fusion imports, has already
    # imported torch.distributed.tensor, so this costs little; without torch.distributed it is
    # a no-op.
    from .dtensor_ops import register

    register()


_register_dtensor_strategies()
