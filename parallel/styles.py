"""Parallel styles: PyTorch's tensor-parallel styles, extended to the layers real models use.

`torch.distributed.tensor.parallel.ColwiseParallel` / `RowwiseParallel` shard `nn.Linear` and
`nn.Embedding`. The subclasses here keep their constructor and meaning and add:

- HF `Conv1D` (GPT-2's projection: y = x @ W + b with W stored (in, out), the transpose of
  nn.Linear's (out, in)). Column-parallel shards the output features (W dim 1, b dim 0);
  row-parallel shards the input features (W dim 0) and replicates b.
- Fused projections (GPT-2's `c_attn`, whose output features are [Q | K | V], each heads-major).
  Cutting those columns into t equal pieces would give rank 0 all of Q and half of K. With
  `fused_parts=3` the weight is first permuted so that rank r's piece is [Q_r | K_r | V_r], the
  q, k and v columns of its own heads H/t (`to_rank_major`). Parts of unequal sizes are given
  as their sizes: Phi-3's [Q | K | V] with fewer K/V heads, `fused_parts=(H·d, K·d, K·d)`.
  The parameter then holds the permuted layout; state_dict hooks on the module translate to and from the unsharded layout,
  so checkpoints and `gather_full` never show the permutation.

`HeadCoreNorm` shards the norms inside an attention core (Q/K norms per head or over all
heads' features), whose parameters plain tensor parallelism would leave with a per-rank
partial gradient. `HeadParameters` splits an attention's per-head vectors (gpt-oss's sinks) by
heads, as Q is.

Two small styles cover what `PrepareModuleInput/Output` cannot for Hugging Face blocks (they
need one layout per positional argument, and blocks are called with a varying number of them):
`PrepareFirstInput` and `PrepareFirstOutput` redistribute only the first positional input or
the (first) output, the hidden states (batch, sequence, features).

Layouts follow DTensor: Replicate() whole on every rank, Shard(d) split along dim d (sequence
parallel: d = 1), Partial() a sum still to be reduced (a row-parallel output before its
all-reduce / reduce-scatter).
"""

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel as _TorchColwise
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.parallel import RowwiseParallel as _TorchRowwise
from torch.distributed.tensor.parallel import SequenceParallel as _TorchSequenceParallel
from torch.distributed.tensor.placement_types import Placement


def linear_kind(module: nn.Module) -> str | None:
    """'linear' for nn.Linear (weight (out, in)), 'conv1d' for HF's Conv1D (weight (in, out),
    recognized by its `nf` attribute and shape, so transformers need not be imported), else None."""
    if isinstance(module, nn.Linear):
        return "linear"
    weight = getattr(module, "weight", None)
    nf = getattr(module, "nf", None)
    if (
        type(module).__name__ == "Conv1D"
        and weight is not None
        and weight.dim() == 2
        and weight.shape[1] == nf
    ):
        return "conv1d"
    return None


# The attribute a module holding fused parameters carries after sharding: (parts, {parameter
# name: its fused dim}, tp degree). A projection's weight and bias; nn.MultiheadAttention's
# in_proj_weight and in_proj_bias (multihead.py).
FUSED_LAYOUT_ATTR = "_trifuse_fused_layout"


Parts = int | tuple[int, ...]  # how many equal parts a fused dim holds, or their sizes


def part_sizes(n: int, parts: Parts) -> tuple[int, ...]:
    return (n // parts,) * parts if isinstance(parts, int) else tuple(parts)


def to_rank_major(t: torch.Tensor, dim: int, parts: Parts, tp: int) -> torch.Tensor:
    """Reorders dim `dim` of a fused [part_0 | part_1 | ...] tensor so that its t equal chunks are
    [part_0 of rank r | part_1 of rank r | ...]: the r-th t-th of each part, for r in order."""
    pieces = [p.chunk(tp, dim) for p in t.split(part_sizes(t.shape[dim], parts), dim)]
    return torch.cat([piece[r] for r in range(tp) for piece in pieces], dim)


def from_rank_major(t: torch.Tensor, dim: int, parts: Parts, tp: int) -> torch.Tensor:
    """The inverse of `to_rank_major`."""
    sizes = part_sizes(t.shape[dim], parts)
    ranks = [r.split([s // tp for s in sizes], dim) for r in t.chunk(tp, dim)]
    return torch.cat([rank[p] for p in range(len(sizes)) for rank in ranks], dim)


def _as_dtensor(x: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> DTensor:
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (layout,), run_check=False)


_SEQUENCE, _ROWS = Shard(1), Shard(0)


def _on_rows(layout: Placement, x: torch.Tensor) -> Placement:
    """Sequence-parallel layouts are written for (batch, sequence, features): Shard(1). A block
    that flattens its tokens to (tokens, features) (OPT's MLP) holds the same rows split along
    dim 0, so on a 2-D tensor Shard(1) reads Shard(0). The row order of the whole tensor is then
    rank-major, not the model's, which row-wise layers and a reduce-scatter back along dim 0 do
    not mind."""
    return _ROWS if x.dim() == 2 and layout == _SEQUENCE else layout


def whole_with_partial_grad(x: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> torch.Tensor:
    """`x` (in `layout`) whole on every rank, as a local tensor whose gradient is taken for this
    rank's partial sum (its heads' or its experts' share) and reduced back to `layout` on the way
    back: an all-reduce, or a reduce-scatter for a shard. Megatron's identity-forward,
    all-reduce-backward region entry, on DTensor."""
    whole = _redistribute_input(layout, Replicate(), None, (x,), mesh)[0]
    return whole.to_local(grad_placements=(Partial(),))


# Redistributions wait for their collective (async_op=False): a local tensor handed on while its
# collective is in flight is a lazy-waiting subclass, and a kernel launcher that reads its
# data_ptr() (trifuse's fused kernels on the local shards) would read memory not yet written.


def _redistribute_input(layout, desired, mod, inputs, device_mesh):
    x = _as_dtensor(inputs[0], device_mesh, _on_rows(layout, inputs[0]))
    desired = _on_rows(desired, x)
    if x.placements != (desired,):
        x = x.redistribute(device_mesh, (desired,), async_op=False)
    return (x, *inputs[1:])


def _redistribute_output(layout, use_local_output, mod, outputs, device_mesh):
    layout = _on_rows(layout, outputs)
    if outputs.placements != (layout,):
        outputs = outputs.redistribute(device_mesh, (layout,), async_op=False)
    if not use_local_output:
        return outputs
    if layout.is_partial():
        # A partial sum handed on as a local tensor (a shared expert's output, summed with the
        # routed experts' before one reduction) gets the whole gradient back: d(sum)/d(own part).
        return outputs.to_local(grad_placements=(Replicate(),))
    return outputs.to_local()  # as written, the graph trifuse's on-shards patterns look for


def _distribute_param(module: nn.Module, name: str, data: torch.Tensor, mesh, placement, src_data_rank):
    param = getattr(module, name)
    dist = distribute_tensor(data, mesh, (placement,), src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class ColwiseParallel(_TorchColwise):
    """Column-parallel: output features split across the mesh; input replicated (all-gathered
    along the sequence first when `input_layouts=Shard(1)`), output Shard(-1).

    As torch's, plus HF Conv1D, plus `fused_parts`: the number of equal blocks the output
    features consist of ([Q | K | V] = 3), or their sizes when unequal, each split per rank as
    described in the module docstring. The parameter's full tensor is then in rank-major order,
    and the module carries hooks so that `state_dict()` / `load_state_dict()` speak the unsharded layout."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        fused_parts: Parts = 1,
    ):
        super().__init__(
            input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output
        )
        given = fused_parts if isinstance(fused_parts, tuple) else (fused_parts,)
        if not given or not all(isinstance(n, int) and n >= 1 for n in given):
            raise ValueError(
                "trifuse.parallel.ColwiseParallel: fused_parts must be an int >= 1 or a tuple of part sizes "
                f"(ints >= 1), got {fused_parts!r}"
            )
        self.fused_parts = fused_parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kind = linear_kind(module)
        if kind is None:
            if self.fused_parts == 1:
                return super()._apply(module, device_mesh)
            raise TypeError(
                "trifuse.parallel.ColwiseParallel: fused_parts needs an nn.Linear or HF Conv1D, "
                f"got {type(module).__name__}"
            )
        out_dim = 0 if kind == "linear" else 1
        tp = device_mesh.size()
        parts = self.fused_parts
        n_out = module.weight.shape[out_dim]
        sizes = part_sizes(n_out, parts)
        if sum(sizes) != n_out or any(n % tp for n in sizes):
            raise ValueError(
                f"trifuse.parallel.ColwiseParallel: {type(module).__name__} has {n_out} output features, "
                f"which do not split into parts {parts} x {tp} ranks"
            )

        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                dim = out_dim if pname == "weight" else 0
                data = param.detach()
                if parts != 1:
                    data = to_rank_major(data, dim, parts, tp)
                _distribute_param(mod, pname, data, mesh, Shard(dim), self.src_data_rank)

        distribute_module(
            module,
            device_mesh,
            partition,
            partial(_redistribute_input, self.input_layouts[0], Replicate()),
            partial(_redistribute_output, self.output_layouts[0], self.use_local_output),
        )
        if parts != 1:
            mark_fused(module, parts, {"weight": out_dim, "bias": 0}, tp)
        return module

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", fused_parts={self.fused_parts})"


class RowwiseParallel(_TorchRowwise):
    """Row-parallel: input features split across the mesh (the input arrives Shard(-1), a
    column-parallel output), the product is Partial and is all-reduced (`output_layouts`
    Replicate) or reduce-scattered along the sequence (Shard(1)). The bias is replicated and
    added once. As torch's, plus HF Conv1D."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kind = linear_kind(module)
        if kind is None:
            return super()._apply(module, device_mesh)
        in_dim = 1 if kind == "linear" else 0

        def partition(name, mod, mesh):
            _distribute_param(mod, "weight", mod.weight.detach(), mesh, Shard(in_dim), self.src_data_rank)
            if getattr(mod, "bias", None) is not None:
                _distribute_param(mod, "bias", mod.bias.detach(), mesh, Replicate(), self.src_data_rank)

        return distribute_module(
            module,
            device_mesh,
            partition,
            partial(_redistribute_input, self.input_layouts[0], Shard(-1)),
            partial(_redistribute_output, self.output_layouts[0], self.use_local_output),
        )


class SequenceParallel(_TorchSequenceParallel):
    """torch's SequenceParallel (a row-wise module, a norm, run on sequence shards with its
    parameters replicated), plus tokens flattened to (tokens, features): OPT's final norm sees
    its rows split along dim 0 (see `_on_rows`)."""

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        x = inputs[0]
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            sequence_sharding = (_on_rows(sequence_sharding[0], x),)
        return _TorchSequenceParallel._prepare_input_fn(sequence_sharding, mod, inputs, device_mesh)


class PrepareFirstInput(ParallelStyle):
    """Redistributes the module's first positional input from `input_layout` to `desired_layout`
    and leaves every other argument alone. With `use_local_output=False` the module receives a
    DTensor: all its column-parallel projections then share one all-gather forward and one
    reduction of their summed input gradients backward (three separate Q, K, V inputs would
    each all-reduce)."""

    def __init__(
        self,
        *,
        input_layout: Placement,
        desired_layout: Placement,
        use_local_output: bool,
        keyword: str | None = None,
    ):
        self.input_layout = input_layout
        self.desired_layout = desired_layout
        self.use_local_output = use_local_output
        # The keyword the hidden states come by when the module is called without positional
        # arguments (Llama's attention: hidden_states=). Only then is the hook a with_kwargs one:
        # Dynamo traces the plain one into trifuse.fuse's graphs as it always has.
        self.keyword = keyword

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.keyword is None:
            module.register_forward_pre_hook(partial(self._hook, device_mesh))
        else:
            module.register_forward_pre_hook(partial(self._kwargs_hook, device_mesh), with_kwargs=True)
        return module

    def _kwargs_hook(self, mesh, module, args, kwargs):
        if args or self.keyword not in kwargs:
            return self._hook(mesh, module, args), kwargs
        return args, {**kwargs, self.keyword: self._hook(mesh, module, (kwargs[self.keyword],))[0]}

    def _hook(self, mesh, module, args):
        if not args or not isinstance(args[0], torch.Tensor):
            raise ValueError(
                f"trifuse.parallel: {type(module).__name__} must get its hidden states as the first "
                f"positional argument{'' if self.keyword is None else f' (or {self.keyword}=)'} to be "
                f"sharded, got {type(args[0]).__name__ if args else 'no positional argument'}"
            )
        x = args[0]
        if isinstance(self.desired_layout, Shard) and not isinstance(x, DTensor):
            dim, t = self.desired_layout.dim, mesh.size()
            if x.shape[dim] % t:
                raise ValueError(
                    f"trifuse.parallel: sequence parallelism splits dim {dim} of the hidden states over {t} "
                    f"ranks; it must be divisible by {t}, got shape {tuple(x.shape)}"
                )
        x = _redistribute_input(self.input_layout, self.desired_layout, module, (x,), mesh)[0]
        return (x.to_local() if self.use_local_output else x, *args[1:])

    def __repr__(self) -> str:
        return f"PrepareFirstInput({self.input_layout} -> {self.desired_layout})"


class HeadRowsArguments(ParallelStyle):
    """Slices keyword arguments holding one row per (batch, head), (batch * H, ...) in batch-major
    order, to this rank's H/t heads: BLOOM's ALiBi bias, built for every head outside the
    attention, which tensor parallelism hands this rank's heads only."""

    def __init__(self, *, names: tuple[str, ...], heads: int):
        super().__init__()
        self.names, self.heads = names, heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        local = self.heads // device_mesh.size()
        start = device_mesh.get_local_rank() * local

        def hook(mod, args, kwargs):
            for name in self.names:
                x = kwargs.get(name)
                if not isinstance(x, torch.Tensor):
                    continue
                if x.shape[0] % self.heads:
                    raise ValueError(
                        f"trifuse.parallel: {type(mod).__name__}'s {name} must have batch x {self.heads} heads "
                        f"rows, got shape {tuple(x.shape)}"
                    )
                rows = x.view(x.shape[0] // self.heads, self.heads, *x.shape[1:])[:, start : start + local]
                kwargs = {**kwargs, name: rows.reshape(-1, *x.shape[1:])}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"HeadRowsArguments({', '.join(self.names)} of {self.heads} heads)"


class PrepareFirstOutput(ParallelStyle):
    """Redistributes the module's output (or the first element of a tuple output) from
    `output_layout` to `desired_layout`, returned as a local tensor."""

    def __init__(self, *, output_layout: Placement, desired_layout: Placement):
        self.output_layout = output_layout
        self.desired_layout = desired_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(partial(self._hook, device_mesh))
        return module

    def _hook(self, mesh, module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        y = _redistribute_output(
            self.desired_layout, True, module, _as_dtensor(first, mesh, self.output_layout), mesh
        )
        return (y, *output[1:]) if isinstance(output, tuple) else y

    def __repr__(self) -> str:
        return f"PrepareFirstOutput({self.output_layout} -> {self.desired_layout})"


class HeadCoreNorm(ParallelStyle):
    """A norm inside the attention core (a Q or K norm), which tensor parallelism hands this
    rank's heads only: left plain, its weight's gradient would be a sum over this rank's heads
    alone. Its parameters become replicated DTensors and it runs on a DTensor whose rows are
    split across ranks; the weight's gradient is then a partial sum that `shard` all-reduces.

    per_head=True: a norm over head_dim (Gemma 3's, Qwen 3's q_norm / k_norm on (batch, seq,
        heads, head_dim)). The local tensor holds whole rows already: it is declared sharded on
        dim -2 (the heads; any row dim would do, the norm is row-wise) and handed back as it is.
        No communication.
    per_head=False: a norm over all heads' features (OLMo 2's on (batch, seq, heads x head_dim)).
        A row needs every rank's features: an all-to-all turns the feature shards into row
        shards (the sequence, else the batch, whichever divides by the ranks), the norm runs on
        whole rows, and a second all-to-all turns them back; backward likewise. When no row dim
        divides, the features are all-gathered and every rank normalizes every row.
    """

    def __init__(self, *, per_head: bool):
        super().__init__()
        self.per_head = per_head

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                _distribute_param(mod, pname, param.detach(), mesh, Replicate(), self.src_data_rank)

        return distribute_module(module, device_mesh, replicate, self._input, self._output)

    def _input(self, mod, inputs, mesh):
        x = inputs[0] if inputs else None
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.dim() < 2:
            raise ValueError(
                f"trifuse.parallel: {type(mod).__name__} inside the attention core must get this rank's "
                f"heads as a local tensor of 2 dims or more, got {type(x).__name__}"
                + (f" of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else "")
            )
        if self.per_head:
            return (_as_dtensor(x, mesh, Shard(x.dim() - 2)), *inputs[1:])
        x = _as_dtensor(x, mesh, Shard(x.dim() - 1))
        t = mesh.size()
        rows = next((d for d in (x.dim() - 2, *range(x.dim() - 2)) if x.shape[d] % t == 0), None)
        target = Shard(rows) if rows is not None else Replicate()
        return (x.redistribute(mesh, (target,), async_op=False), *inputs[1:])

    def _output(self, mod, output, mesh):
        if self.per_head:
            return output.to_local()
        return output.redistribute(mesh, (Shard(output.dim() - 1),), async_op=False).to_local()

    def __repr__(self) -> str:
        return f"HeadCoreNorm(per_head={self.per_head})"


class HeadParameters(ParallelStyle):
    """Parameters of an attention module with one value per head, 1-D over its H heads, which the
    core reads per head (gpt-oss's attention sinks, a logit per head joined to each head's scores
    before the softmax). Tensor parallelism hands each rank its own H/t heads, q_proj's contiguous
    slice of them: each parameter is split alike, Shard(0) (the state dict keeps the unsharded
    layout). Inside the module's forward it reads its rank's piece as a local tensor under the
    same name, as do the attention functions it passes itself to (`module.sinks`, or `s_aux=`);
    outside it the name is the parameter. A head's gradient is then whole on its rank: no
    communication either way."""

    def __init__(self, *, names: tuple[str, ...], heads: int):
        super().__init__()
        self.names, self.heads = tuple(names), heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        for name in self.names:
            param = getattr(module, name, None)
            if not isinstance(param, torch.Tensor) or param.shape != (self.heads,) or self.heads % tp:
                raise ValueError(
                    f"trifuse.parallel.HeadParameters: {type(module).__name__}.{name} must be a parameter of "
                    f"shape ({self.heads},), one value per head, split over {tp} ranks; got "
                    + (f"shape {tuple(param.shape)}" if isinstance(param, torch.Tensor) else "no tensor")
                )
            _distribute_param(module, name, param.detach(), device_mesh, Shard(0), self.src_data_rank)
        # A property on a subclass wins over nn.Module's lookup of its parameters (__getattr__,
        # reached only when normal lookup fails): inside the module's forward `module.sinks` is
        # the local piece, whose gradient flows back to the DTensor parameter as this rank's
        # Shard(0) piece; outside it, the parameter (what FSDP2's lazy init and get_parameter read).
        local = {name: property(partial(_head_param, name)) for name in self.names}
        swap_class(module, (), local, key=self.names)
        module._on_local_heads = False
        module.register_forward_pre_hook(_enter_local_heads)
        # not always_call=True: Dynamo guards on such a hook's id, which would recompile every layer
        module.register_forward_hook(_leave_local_heads)
        return module

    def __repr__(self) -> str:
        return f"HeadParameters({', '.join(self.names)} of {self.heads} heads)"


def _head_param(name: str, module: nn.Module) -> torch.Tensor:
    param = module._parameters[name]
    return param.to_local() if module._on_local_heads else param


def _enter_local_heads(module: nn.Module, args: tuple) -> None:
    module._on_local_heads = True


def _leave_local_heads(module: nn.Module, args: tuple, output) -> None:
    module._on_local_heads = False


# The subclasses styles swap modules into, one per (class, mixins, key): shared by every layer,
# never one per module, since Dynamo guards on a module's type. A class per layer made `fuse`
# recompile every layer of a sharded model and, past Dynamo's recompile limit (8), run the
# later layers unfused.
_SWAPPED_CLASSES: dict[tuple, type] = {}


def swap_class(module: nn.Module, mixins: tuple[type, ...], namespace: dict, *, key: tuple = ()) -> None:
    """Makes `module` an instance of `Sharded<its class>`, a subclass of `mixins` and its class
    with `namespace` added; made once per (class, mixins, key), where `key` says everything
    `namespace` depends on besides the class."""
    cls = type(module)
    entry = (cls, mixins, key)
    if entry not in _SWAPPED_CLASSES:
        _SWAPPED_CLASSES[entry] = type(f"Sharded{cls.__name__}", (*mixins, cls), namespace)
    module.__class__ = _SWAPPED_CLASSES[entry]


# ---------------------------------------------------------------------------------------------
# State-dict hooks of a fused projection: the parameter holds the rank-major permutation, the
# state_dict shows the unsharded layout (same DTensor mesh and placements, so DCP saves each
# rank's piece of the *unsharded* tensor and loads into any other sharding or none).
# ---------------------------------------------------------------------------------------------


def _relayout(t: DTensor, fn) -> DTensor:
    """`fn` applied to the full tensor of `t`, returned with t's mesh and placements. Gathers the
    whole tensor once (checkpointing only); each rank then keeps its own piece, no scatter."""
    full = fn(t.full_tensor())
    return distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)


def mark_fused(module: nn.Module, parts: Parts, dims: dict[str, int], tp: int) -> None:
    """Records that `module`'s parameters named in `dims` hold the rank-major permutation of
    `parts` along their dim there, and installs the state-dict hooks that hide it."""
    setattr(module, FUSED_LAYOUT_ATTR, (parts, dims, tp))
    module.register_state_dict_post_hook(_fused_state_dict_hook)
    module.register_load_state_dict_pre_hook(_fused_load_hook)


def _fused_state_dict_hook(module, state_dict, prefix, local_metadata):
    parts, dims, tp = getattr(module, FUSED_LAYOUT_ATTR)
    for pname, dim in dims.items():
        key = prefix + pname
        if key in state_dict and isinstance(state_dict[key], DTensor):
            state_dict[key] = _relayout(
                state_dict[key], partial(from_rank_major, dim=dim, parts=parts, tp=tp)
            )


def _fused_load_hook(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
):
    parts, dims, tp = getattr(module, FUSED_LAYOUT_ATTR)
    for pname, dim in dims.items():
        key, param = prefix + pname, getattr(module, pname, None)
        if key not in state_dict or param is None:
            continue
        value = state_dict[key]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        full = to_rank_major(full.to(param.device), dim, parts, tp)
        state_dict[key] = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
