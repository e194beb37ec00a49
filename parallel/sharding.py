"""`shard(model, mesh)`: Megatron-style tensor + sequence parallelism on an unmodified model,
applied with PyTorch's distributed engine (DeviceMesh, DTensor, tensor-parallel styles).

What it does, in place, in this order:

1. checks the mesh: 1-D (tensor parallel) or 2-D with dims named "dp" and "tp" (data parallel
   over the other dim, with FSDP2 `fully_shard`), covering the whole world;
2. derives the plan from the recognized blocks (`plan.py`; with `vocab_parallel`, the embedding
   and LM head too), merged with the user's `plan`, and checks it before changing anything
   (no attention-like module, nor weight matrix in a recognized block, nor parameter inside an
   attention core other than the norms and per-head vectors it shards, left unsharded unless
   `plan` names it; heads, K/V heads and widths divide; under sequence parallelism every
   parameter in a block is owned by a style; tied parameters are sharded alike or not at all);
3. makes every rank start from the same weights (broadcast from the first rank of each mesh dim),
   so that applying a style needs no scatter;
4. applies each style with `parallelize_module` (parameters become DTensors; forward hooks move
   activations between layouts with DTensor's collectives) and re-ties tied parameters;
5. sets the attention modules' head counts and widths to the local shard's (Hugging Face
   modules read them from attributes, Phi-3's from its config: it gets a view of the config;
   nn.MultiheadAttention gets a forward on its local heads, multihead.py);
6. runs dropout on per-rank tensors under a per-rank random stream (`random.py`);
7. makes replicated parameters' gradients whole (one all-reduce per tensor, after accumulation;
   sequence-parallel norms produce partial sums);
8. on a 2-D mesh, `fully_shard`s each block and then the root over "dp";
9. lets torch.optim's for-each path (CUDA's default) step over DTensors and plain tensors
   together (`optim.py`).

Parameters outside the plan (embeddings, final norm, head) stay plain tensors, replicated.
State dicts are DTensors in the unsharded layout: `torch.distributed.checkpoint` saves them
piecewise and loads them into any sharding, or none. Under sequence parallelism the hidden
states *between* blocks are sequence shards: outputs that expose them (HF's
`output_hidden_states=True`) show each rank's slice; the final output is whole.
"""

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel as _TorchColwise
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    parallelize_module,
)
from torch.distributed.tensor.parallel import RowwiseParallel as _TorchRowwise

from . import optim as _optim
from . import random as _random
from .experts import MoEBlockParallel, ReplicatedModule
from .plan import Plan, check_unrecognized, derive_plan, merge, recognize, vocab_plan
from .styles import (
    FUSED_LAYOUT_ATTR,
    ColwiseParallel,
    HeadRowsArguments,
    PrepareFirstInput,
    PrepareFirstOutput,
    RowwiseParallel,
    from_rank_major,
    linear_kind,
)

_STATE_ATTR = "_trifuse_parallel"


class LocalHeadsConfig:
    """A view of a model's shared config with this rank's head counts, for an attention module
    that reads them from `self.config` (Phi-3). Everything else reads (and writes) through to the
    shared config, so a later change there (`set_attn_implementation`) still reaches the module."""

    def __init__(self, config: object, **local: int):
        self.__dict__["_shared"] = config
        self.__dict__["_local"] = local

    def __getattr__(self, name: str):
        local = self.__dict__["_local"]
        return local[name] if name in local else getattr(self.__dict__["_shared"], name)

    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__["_local"]:
            self.__dict__["_local"][name] = value
        else:
            setattr(self.__dict__["_shared"], name, value)

    def __repr__(self) -> str:
        return f"LocalHeadsConfig({self.__dict__['_local']} over {type(self.__dict__['_shared']).__name__})"


def _root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources  # torch < 2.10

    return _mesh_resources.get_root_mesh(mesh)


def _split_mesh(mesh: object) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(tensor-parallel mesh, data-parallel mesh or None), after checking `mesh`."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"trifuse.parallel.shard: mesh must be a torch.distributed.DeviceMesh, got {type(mesh).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(
            "trifuse.parallel.shard: torch.distributed is not initialized "
            "(use torchrun and init_process_group)"
        )
    world = dist.get_world_size()
    covered = _root_mesh(mesh).mesh.numel()
    if covered != world:
        raise ValueError(
            f"trifuse.parallel.shard: the mesh covers {covered} rank(s) but the world has {world}; "
            f"build it with init_device_mesh(device, shape) where the shape's product is the world size"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"trifuse.parallel.shard: rank {dist.get_rank()} is not in the mesh {mesh}")
    if mesh.ndim == 1:
        return mesh, None
    names = mesh.mesh_dim_names or ()
    if mesh.ndim != 2 or set(names) != {"dp", "tp"}:
        raise ValueError(
            "trifuse.parallel.shard: mesh must be 1-D (tensor parallel) or 2-D with "
            f"mesh_dim_names ('dp', 'tp'), got {mesh.ndim}-D with names {names}"
        )
    return mesh["tp"], mesh["dp"]


@torch.no_grad()
def _broadcast_replicas(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every rank gets the weights of the mesh's first rank: broadcast along each mesh dim in
    turn (dim 0 makes each column equal its first row, dim 1 then spreads rank 0 along rows)."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if not isinstance(t, DTensor)]
    for d in range(mesh.ndim):
        group = mesh.get_group(d)
        src = dist.get_global_rank(group, 0)
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)


def _plain_style(style: object, module: nn.Module) -> object:
    """torch's ColwiseParallel / RowwiseParallel as trifuse's for modules only trifuse's handle."""
    if linear_kind(module) != "conv1d" or isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return style
    if isinstance(style, _TorchColwise):
        cls = ColwiseParallel
    elif isinstance(style, _TorchRowwise):
        cls = RowwiseParallel
    else:
        return style
    return cls(
        input_layouts=style.input_layouts[0],
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )


_PREPARE_ONLY = (
    MoEBlockParallel,
    HeadRowsArguments,
    PrepareFirstInput,
    PrepareFirstOutput,
    PrepareModuleInput,
    PrepareModuleOutput,
    PrepareModuleInputOutput,
)


def _owned(plan: Plan) -> set[str]:
    """The modules whose parameters the plan's styles replace."""
    return {name for name, style in plan.styles if not isinstance(style, _PREPARE_ONLY)}


def _check_sp_coverage(model: nn.Module, plan: Plan, summed: set[str] = frozenset()) -> None:
    """Under sequence parallelism every parameter in a block sees sequence shards, so a style
    must own it: left plain, its gradient would be this rank's partial sum only. `summed`: the
    parameters whose gradients `shard` sums over the group itself (an activation's inside an MLP,
    which sees the whole sequence on its columns)."""
    owned = _owned(plan)
    # A replicated module (an MoE router) runs whole with whatever it holds.
    whole = [name + "." for name, style in plan.styles if isinstance(style, ReplicatedModule)]
    for block in plan.sp_blocks:
        for name, module in model.get_submodule(block).named_modules(prefix=block):
            if name in owned or name.startswith(tuple(whole)):
                continue
            for pname, _ in module.named_parameters(recurse=False):
                if f"{name}.{pname}" in summed:
                    continue
                raise ValueError(
                    f"trifuse.parallel.shard: with sequence parallelism, parameter {name}.{pname} sees "
                    "sequence shards but no style covers it (its gradient would be a per-rank partial "
                    "sum); add it to plan= or pass sequence_parallel=False"
                )


def _sum_over(group: dist.ProcessGroup, grad: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient summed over the tensor-parallel group (each rank computed its
    columns' part)."""
    grad = grad.clone()  # autograd may hand the same tensor to other readers
    dist.all_reduce(grad, group=group)
    return grad


def _replicate_grad(param: torch.Tensor) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """(module name, parameter name) of every parameter held under more than one name."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            if (mod_name, pname) not in owners.setdefault(id(param), []):
                owners[id(param)].append((mod_name, pname))
    return [group for group in owners.values() if len(group) > 1]


def _check_ties(groups: list[list[tuple[str, str]]], plan: Plan) -> None:
    owned = _owned(plan)
    for group in groups:
        if len({m in owned for m, _ in group}) > 1:
            names = ", ".join(f"{m}.{p}" for m, p in group)
            raise ValueError(
                f"trifuse.parallel.shard: the tied parameters {names} would be sharded in one place "
                "and not in another; shard all of them alike or none"
            )


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """Styles replace each module's parameters with new DTensor parameters, which unties weights
    shared between modules (GPT-2's embedding and LM head). Ties survive when every holder was
    sharded alike: they then hold equal pieces, and all get the first holder's parameter."""
    for group in groups:
        params = [getattr(model.get_submodule(m), p) for m, p in group]
        if all(q is params[0] for q in params):
            continue
        layouts = {(type(q).__name__, getattr(q, "placements", None)) for q in params}
        if len(layouts) > 1:
            names = ", ".join(f"{m}.{p}" for m, p in group)
            raise ValueError(
                f"trifuse.parallel.shard: the tied parameters {names} were sharded differently "
                f"({sorted(map(str, layouts))}); shard all of them alike or none"
            )
        for m, p in group[1:]:
            setattr(model.get_submodule(m), p, params[0])


def shard(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    plan: dict | None = None,
    vocab_parallel: bool = False,
) -> nn.Module:
    """Shards `model` in place over `mesh` with tensor parallelism (and sequence parallelism
    unless `sequence_parallel=False`); returns the same model.

    mesh: a DeviceMesh over the whole world: 1-D for tensor parallelism alone, or 2-D with
        mesh_dim_names ("dp", "tp") to add FSDP2 data parallelism over "dp".
    plan: {module-name glob: ParallelStyle or None}, taking precedence over the derived plan for
        the modules it matches (None leaves a module alone). torch's ColwiseParallel /
        RowwiseParallel work on HF Conv1D too. With a plan, a model without recognized blocks is
        fine; head counts of unrecognized attention modules are then the plan's business.
    vocab_parallel: also split the input embedding and the LM head over the vocabulary (Hugging
        Face models). The logits are then a DTensor sharded on the vocabulary: compute the loss
        and call backward() inside `torch.distributed.tensor.parallel.loss_parallel()`, which
        computes the cross-entropy from the shards without ever gathering the logits.

    Call it on every rank, on identical models (the first rank's weights win) already on their
    device (NCCL moves CUDA tensors only), before building the optimizer. Inputs: every rank
    of a tensor-parallel group gets the same batch; with sequence parallelism the sequence
    length must divide by the tensor-parallel degree.
    A one-value parameter of an activation between an MLP's column- and row-parallel projections
    (Apertus's xIELU) stays whole on every rank, and its gradient, each rank's columns' part, is
    summed over the tensor-parallel group (1-D meshes: under FSDP2 it raises).
    Raises ValueError for a mesh that does not cover the world, heads or MLP widths that do not
    divide, a model with no recognized blocks and no plan, or an attention-like module (or a
    weight inside a recognized block) that the derived plan would leave unsharded and `plan`
    does not name (nn.MultiheadAttention with separate Q/K/V weights, for one).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trifuse.parallel.shard: model must be an nn.Module, got {type(model).__name__}")
    if getattr(model, _STATE_ATTR, None) is not None:
        raise ValueError("trifuse.parallel.shard: model is already sharded")
    tp_mesh, dp_mesh = _split_mesh(mesh)
    tp = tp_mesh.size()
    if plan is not None and not isinstance(plan, dict):
        raise TypeError(f"trifuse.parallel.shard: plan must be a dict or None, got {type(plan).__name__}")
    found = recognize(model)
    check_unrecognized(model, found, plan)
    derived = (
        derive_plan(model, found, tp, sequence_parallel=sequence_parallel) if (found or not plan) else Plan()
    )
    if vocab_parallel:
        derived.styles += vocab_plan(model, tp)
    full = merge(derived, plan, model)

    partial = list(dict.fromkeys(found.partial_gradients))
    if partial and dp_mesh is not None:
        raise ValueError(
            f"trifuse.parallel.shard: {partial[0]} is a parameter of an activation between an MLP's "
            "column- and row-parallel projections, whose gradient is summed over the tensor-parallel "
            "group by a hook on the parameter; FSDP2 over a 2-D mesh replaces the parameters and the "
            "sum would be lost. Use a 1-D mesh, or keep that MLP whole by naming its projections in "
            "plan= with None"
        )
    _check_sp_coverage(model, full, set(partial))
    tied = _tied_groups(model)
    _check_ties(tied, full)

    _broadcast_replicas(model, mesh)
    for name, style in full.styles:
        module = model.get_submodule(name)
        # Every rank already holds the first rank's weights: each keeps its own piece, no scatter.
        parallelize_module(module, tp_mesh, _plain_style(style, module), src_data_rank=None)
    _retie(model, tied)
    for name, attr, value in full.attributes:
        setattr(model.get_submodule(name), attr, value)
    for name, counts in full.config_views:
        module = model.get_submodule(name)
        module.config = LocalHeadsConfig(module.config, **counts)
    for module in model.modules():
        # nn.TransformerEncoder's inference fast path packs a padded batch into a nested tensor
        # before its layers run; sharded layers take plain tensors only.
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False
    _random.install(model, full.rank_regions, tp_mesh.get_local_rank())
    for p in model.parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Replicate) for pl in p.placements):
            p.register_post_accumulate_grad_hook(_replicate_grad)
    for name in partial:
        if tp > 1:
            # Before accumulation (a tensor hook, not a post-accumulate one): each backward's own
            # part is summed once, also when gradients accumulate over several backwards.
            model.get_parameter(name).register_hook(functools.partial(_sum_over, tp_mesh.get_group()))
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for stack in found.stacks:
            for block in stack:
                fully_shard(model.get_submodule(block), mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    _optim.register(model.parameters())
    object.__setattr__(model, _STATE_ATTR, full)
    return model


def gather_full(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or, with grads=True, its gradient where it has one), whole and in the
    unsharded model's layout, keyed like `state_dict()`. Collective: call it on every rank.
    Works on unsharded models too (returns detached parameters), so a test can compare the two."""
    out: dict[str, torch.Tensor] = {}
    for mod_name, module in model.named_modules():
        layout = getattr(module, FUSED_LAYOUT_ATTR, None)
        for pname, param in module.named_parameters(recurse=False):
            t = param.grad if grads else param
            if t is None:
                continue
            t = t.full_tensor() if isinstance(t, DTensor) else t
            if layout is not None and pname in layout[1]:
                parts, dims, tp = layout
                t = from_rank_major(t, dims[pname], parts, tp)
            out[f"{mod_name}.{pname}" if mod_name else pname] = t.detach()
    return out
