"""Optimizers over a sharded model: every torch.optim optimizer steps as it does unsharded.

A sharded model holds DTensor parameters (the plan's) beside plain tensors (the replicated ones
outside it: embeddings, the final norm, the head); on a 2-D mesh, DTensors on two meshes (there
too `implicit_replication` is what PyTorch offers for for-each calls; not run yet on a 2-D mesh).
On CUDA, torch.optim's default for-each path hands all of them to one `torch._foreach_*` call,
which DTensor refuses ("got mixed torch.Tensor and DTensor"): AdamW's first step failed on the
H200 (2026-11-27; on CPU the default is the per-tensor loop, so CPU runs never saw it).
DTensor's `implicit_replication` treats the plain tensors as replicated for those calls, which
is what they are, and the for-each math is per tensor, so the step is the unsharded one.

`shard` registers the model's parameters here and installs, once per process, a global
optimizer step pre-hook and post-hook that run the step of an optimizer holding any of them
under `implicit_replication`; other optimizers are untouched.
"""

import weakref

import torch
from torch.distributed.tensor.experimental import implicit_replication
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

# id -> weak reference (a WeakSet would compare tensors with ==, elementwise)
_SHARDED_PARAMS: dict[int, weakref.ref] = {}
_CONTEXT_ATTR = "_trifuse_implicit_replication"
_installed = False


def register(params) -> None:
    """Marks `params` (a sharded model's parameters) and installs the hooks on first use."""
    global _installed
    for p in params:
        key = id(p)
        _SHARDED_PARAMS[key] = weakref.ref(p, _forget(key))
    if not _installed:
        register_optimizer_step_pre_hook(_enter)
        register_optimizer_step_post_hook(_leave)
        _installed = True


def _forget(key: int):
    return lambda _: _SHARDED_PARAMS.pop(key, None)


def _holds_sharded(opt: torch.optim.Optimizer) -> bool:
    for group in opt.param_groups:
        for p in group["params"]:
            ref = _SHARDED_PARAMS.get(id(p))
            if ref is not None and ref() is p:
                return True
    return False


def _enter(opt: torch.optim.Optimizer, args, kwargs) -> None:
    _leave(opt, args, kwargs)  # a step that raised never reached its post-hook
    if _holds_sharded(opt):
        ctx = implicit_replication()
        ctx.__enter__()
        opt.__dict__[_CONTEXT_ATTR] = ctx


def _leave(opt: torch.optim.Optimizer, args, kwargs) -> None:
    ctx = opt.__dict__.pop(_CONTEXT_ATTR, None)
    if ctx is not None:
        ctx.__exit__(None, None, None)
