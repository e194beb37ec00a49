"""Dropout randomness under tensor and sequence parallelism.

Two kinds of activation meet dropout in a sharded model:

- replicated ones (the residual stream without sequence parallelism, the embeddings): every
  rank holds the same tensor and must drop the same elements, or the replicas drift apart.
  torch's default generators give that for free: every rank seeds them alike and draws the
  same numbers in the same order.
- per-rank ones (a rank's attention heads, its sequence slice): the ranks hold different parts
  of one logical tensor and must drop independently, or every rank repeats one mask pattern.

`RankStream` runs a region of the forward (a module call) under a per-rank stream and leaves
the default stream as if a single number had been drawn from it: on entry it draws a 62-bit
seed from the default CPU generator (the same draw on every rank), seeds the generators of the
activation's device with seed + rank * (odd constant) (distinct on every rank), and on exit
restores the default generators to the state right after the draw. The masks are therefore
reproducible under `torch.manual_seed`, differ across ranks, and nothing is stored per call.
This is Megatron-LM's model-parallel RNG tracker without its global state.

Hooks are forward hooks with `always_call=True`, so an exception inside the region still leaves
the default generators restored. Outside training nothing happens.
"""

import torch
from torch import nn

_GOLDEN = 0x9E3779B97F4A7C15  # odd: seed + rank * _GOLDEN differs for every rank modulo 2**63


class RankStream:
    """Enter with `enter(module, args)` (a forward pre-hook), leave with `leave(...)` (a forward
    hook). Nested entries are no-ops; the first `leave` ends the region."""

    def __init__(self, rank: int):
        self.rank = rank
        self._saved: tuple | None = None

    def enter(self, module: nn.Module, args) -> None:
        if self._saved is not None or not module.training:
            return
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        seed = int(torch.randint(0, 2**62, ()))  # advances the shared CPU stream alike on every rank
        saved_cpu = torch.get_rng_state()
        saved_dev = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self._saved = (device, saved_cpu, saved_dev)
        local = (seed + self.rank * _GOLDEN) % 2**63
        torch.default_generator.manual_seed(local)
        if device.type == "cuda":
            torch.cuda.default_generators[device.index if device.index is not None else 0].manual_seed(local)

    def leave(self, module: nn.Module, args, output) -> None:
        if self._saved is None:
            return
        device, saved_cpu, saved_dev = self._saved
        self._saved = None
        torch.set_rng_state(saved_cpu)
        if saved_dev is not None:
            torch.cuda.set_rng_state(saved_dev, device)


def has_dropout(module: nn.Module) -> bool:
    """Whether `module` holds a dropout module with p > 0 (attention cores keep their
    probability on an nn.Dropout even when the functional attention applies it), or an
    nn.MultiheadAttention with dropout > 0 (a float attribute, no module)."""
    return any(
        (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0)
        or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0)
        for m in module.modules()
    )


def install(model: nn.Module, regions: list[tuple[str, tuple[str, ...]]], rank: int) -> RankStream | None:
    """Runs each region (enter at the first module, leave after any of the others) under a
    per-rank stream, where the region holds dropout. Returns the stream, or None if no region
    needed one."""
    stream = RankStream(rank)
    used = False
    for start, ends in regions:
        module = model.get_submodule(start)
        if not has_dropout(module):
            continue
        used = True
        module.register_forward_pre_hook(stream.enter)
        for end in ends:
            model.get_submodule(end).register_forward_hook(stream.leave, always_call=True)
    return stream if used else None
