"""Mixture-of-experts blocks under tensor parallelism: every expert's MLP split as a dense MLP is
(Mixtral, Qwen3-MoE, OLMoE, gpt-oss; Hugging Face's experts modules, weights stacked over the
experts).

Hugging Face keeps an MoE block's experts as two stacked parameters, `gate_up_proj`
(experts, 2 x inner, hidden) = [gate | up] per expert and `down_proj` (experts, hidden, inner),
beside a router (`gate`, a (experts, hidden) weight) that picks each token's top-k experts.
`ExpertsParallel` shards every expert alike, Megatron's MLP split inside each one:

- `gate_up_proj` along its inner dim, rank-major ([gate_r | up_r] on rank r, as a fused
  projection; the state dict keeps the unsharded layout), `down_proj` along its inner dim;
- the experts module runs as a subclass whose forward is Hugging Face's own (its grouped or batched
  matmuls, or its eager loop, as the config says) on the local pieces: each rank computes every
  routed token's partial sum over its slice of the inner dim;
- its inputs, the tokens and their routing weights, are whole on every rank, with gradients that
  are this rank's partial sums, reduced on the way back (so the router, replicated, gets its
  whole gradient on every rank).

gpt-oss's experts are laid out otherwise: `gate_up_proj` (experts, hidden, 2 x inner) transposed,
its features interleaved [g_0 u_0 g_1 u_1 ...], with a bias `gate_up_proj_bias` (experts,
2 x inner), `down_proj` (experts, inner, hidden) with a bias `down_proj_bias` (experts, hidden),
and a gating of its own (clamped, elementwise per (gate, up) pair). A contiguous t-th of the
interleaved features holds whole pairs, so `gate_up_proj` and its bias are split as they are
(Shard along the features, no permutation), `down_proj` along its inner dim 1. The down bias is
added inside each expert, before its routing weight, to the row-parallel product, a partial sum:
it stays replicated and each rank adds 1/t of it (as DTensor adds a row-parallel linear's bias),
its gradient reduced once after accumulation.

The block around it (`MoEBlockParallel`) gathers its input whole (all-gather under sequence
parallelism) and reduces its output, a partial sum, to the residual stream's layout (all-reduce,
or reduce-scatter along the sequence). The router runs replicated on the whole tokens. A shared
expert beside the routed ones (Qwen2-MoE, DeepSeek, GLM-4-MoE) is a dense MLP split as one, its
down projection's output left a partial sum that joins the routed experts' before the block's one
reduction; Qwen2-MoE's gate of it, a sigmoid scale, runs replicated (`ReplicatedModule`).

Backward mirrors it: the block's input is a replicated DTensor, whose gradient adds up the
experts' and the shared expert's partial sums and the router's and the shared expert gate's whole
ones (handed back as 1/t shares of the sum, `_local_share`) and is reduced once, as a dense MLP's
is (one reduce-scatter under SP, counted in test_comm_volume.py), not once per consumer.
"""

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from .styles import (
    PrepareFirstInput,
    PrepareFirstOutput,
    _distribute_param,
    mark_fused,
    swap_class,
    to_rank_major,
    whole_with_partial_grad,
)


# The layouts ExpertsParallel shards, as Hugging Face's experts decorator
# (`use_experts_implementation`) declares them.
_CONCATENATED = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False}
_INTERLEAVED = {"has_gate": True, "is_concatenated": False, "is_transposed": True, "has_bias": True}
# Gatings of an interleaved layout known to be elementwise per (gate_i, up_i) pair, so that they
# run as they are on a contiguous slice of the pairs: gpt-oss's clamped `(up + 1) * gate *
# sigmoid(alpha * gate)`.
_PAIRWISE_GATES = ("GptOssExperts._apply_gate",)


def interleaved(experts: nn.Module) -> bool:
    """Whether `experts` (a module `unsupported` accepts) has gpt-oss's layout rather than [gate | up]."""
    return getattr(experts, "is_concatenated", True) is False


def widths(experts: nn.Module) -> tuple[int, int]:
    """(hidden, inner) of a module `unsupported` accepts."""
    _, a, b = experts.gate_up_proj.shape
    return (a, b // 2) if interleaved(experts) else (b, a // 2)


def unsupported(experts: nn.Module) -> str | None:
    """Why a Hugging Face experts module cannot be sharded by ExpertsParallel, or None."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "no stacked gate_up_proj and down_proj parameters"
    layout = {a: getattr(experts, a, None) for a in _CONCATENATED}
    if layout not in (_CONCATENATED, _INTERLEAVED):
        return (
            f"an experts layout other than [gate | up], untransposed, without biases, or gpt-oss's "
            f"(gate and up interleaved, transposed, with biases): {layout}"
        )
    if getattr(experts, "has_post_expert_norm", False):
        return "a norm after each expert"
    gate = type(experts)._apply_gate
    if layout == _CONCATENATED and getattr(gate, "__name__", "") != "_default_apply_gate":
        return "a gating of its own (_apply_gate)"
    if layout == _INTERLEAVED and getattr(gate, "__qualname__", "") not in _PAIRWISE_GATES:
        known = ", ".join(_PAIRWISE_GATES)
        return f"a gating of its own (_apply_gate) on interleaved gate and up features, none of {known}"
    if gate_up.dim() != 3:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not agree"
    n = gate_up.shape[0]
    hidden, inner = widths(experts)
    want = {"down_proj": (n, hidden, inner)}
    if layout == _INTERLEAVED:
        want = {
            "down_proj": (n, inner, hidden),
            "gate_up_proj_bias": (n, 2 * inner),
            "down_proj_bias": (n, hidden),
        }
    got = {name: tuple(getattr(getattr(experts, name, None), "shape", ())) for name in want}
    if gate_up.shape[1 if layout == _CONCATENATED else 2] % 2 or got != want:
        shapes = ", ".join(f"{name} {got[name]}" for name in want)
        return f"gate_up_proj {tuple(gate_up.shape)} and {shapes} do not agree"
    return None


class ExpertsParallel(ParallelStyle):
    """Tensor parallelism inside every expert of a Hugging Face experts module (see the module
    docstring). Its output is this rank's partial sum: put it in a `MoEBlockParallel` block."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        why = unsupported(module)
        tp = device_mesh.size()
        inner = widths(module)[1] if why is None else 0
        if why is None and inner % tp:
            why = f"its experts' inner width {inner} does not divide across {tp} ranks"
        if why is not None:
            raise ValueError(f"trifuse.parallel.ExpertsParallel: {type(module).__name__}: {why}")
        src = self.src_data_rank
        if interleaved(module):
            # [g_0 u_0 g_1 u_1 ...]: a contiguous t-th of the features holds whole (gate, up) pairs,
            # so rank r's piece is plain Shard (no permutation, the state dict needs no hooks).
            gate_up, bias = module.gate_up_proj.detach(), module.gate_up_proj_bias.detach()
            _distribute_param(module, "gate_up_proj", gate_up, device_mesh, Shard(2), src)
            _distribute_param(module, "gate_up_proj_bias", bias, device_mesh, Shard(1), src)
            _distribute_param(module, "down_proj", module.down_proj.detach(), device_mesh, Shard(1), src)
            # Added after the row-parallel product, inside the partial sum: each rank adds 1/t of
            # it (see _LocalView), its gradient reduced as a row-parallel linear's bias is.
            bias = module.down_proj_bias.detach()
            _distribute_param(module, "down_proj_bias", bias, device_mesh, Replicate(), src)
        else:
            gate_up = to_rank_major(module.gate_up_proj.detach(), 1, 2, tp)
            _distribute_param(module, "gate_up_proj", gate_up, device_mesh, Shard(1), src)
            _distribute_param(module, "down_proj", module.down_proj.detach(), device_mesh, Shard(2), src)
            mark_fused(module, 2, {"gate_up_proj": 1}, tp)
        module.register_forward_pre_hook(partial(self._whole_inputs, device_mesh))
        # Hugging Face's forward dispatches on the config, as the class does
        swap_class(module, (_LocalExperts,), {"_hf_forward": staticmethod(type(module).forward)})
        return module

    @staticmethod
    def _whole_inputs(mesh, module, args):
        hidden, index, weights = args
        # The routing weights in the dtype their product with the experts' output has anyway
        # (Mixtral's stay float32 in any model): their gradient is then summed over ranks at
        # that precision, as one process sums it, and cast back once.
        weights = weights.to(torch.promote_types(hidden.dtype, weights.dtype))
        # The hidden states as a MoEBlockParallel block hands them on (a replicated DTensor):
        # their gradient joins the block's input gradient as this rank's share, reduced there.
        hidden = (
            hidden.to_local(grad_placements=(Partial(),))
            if isinstance(hidden, DTensor)
            else whole_with_partial_grad(hidden, mesh, Replicate())
        )
        return hidden, index, whole_with_partial_grad(weights, mesh, Replicate())

    def __repr__(self) -> str:
        return "ExpertsParallel()"


class _LocalView:
    """An experts module as its forward sees it, with this rank's pieces of the weights: Hugging
    Face's implementations (its eager loop, `batched_mm`, `grouped_mm`) read `self.gate_up_proj`
    and `self.down_proj` (and with biases `self.gate_up_proj_bias`, `self.down_proj_bias`) and find
    everything else (the expert count, `_apply_gate`, the config) on the module.

    The down projection's bias is added to each expert's row-parallel product, a partial sum over
    ranks: each rank adds 1/t of it, as DTensor adds a row-parallel linear's replicated bias, so it
    counts once in the sum. Its gradient, this rank's 1/t share, is taken for a partial sum that
    `shard` all-reduces once after accumulation, the same on every rank and one process's."""

    def __init__(self, module: nn.Module):
        self._module = module
        self.gate_up_proj = module.gate_up_proj.to_local()
        self.down_proj = module.down_proj.to_local()
        if getattr(module, "has_bias", False):
            self.gate_up_proj_bias = module.gate_up_proj_bias.to_local()
            bias = module.down_proj_bias
            self.down_proj_bias = bias.to_local(grad_placements=(Partial(),)) / bias.device_mesh.size()

    def __getattr__(self, name: str):
        return getattr(self._module, name)


class _LocalExperts(nn.Module):
    """The experts' forward the model's config chose (Hugging Face's `experts_implementation`:
    its grouped or batched matmuls, or its eager loop), run on this rank's pieces of every expert.
    Each piece is [gate_r | up_r] rank-major, so the gating's chunk in two stays right (gpt-oss's
    interleaved pieces hold whole (gate, up) pairs, which its gating takes by [::2] and [1::2])."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self._hf_forward(_LocalView(self), hidden_states, top_k_index, top_k_weights)


class MoEBlockParallel(ParallelStyle):
    """An MoE block (router + ExpertsParallel experts): its input gathered whole from
    `input_layouts`, its output, a partial sum over ranks, reduced to the same layout."""

    def __init__(self, *, input_layouts: Placement | None = None):
        super().__init__()
        self.layout = input_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # The block gets its input as a replicated DTensor: the experts and a shared expert take
        # it with their input gradients left partial sums, which add up as one DTensor gradient
        # reduced once, back to `layout` (one reduce-scatter under SP), not once per consumer.
        PrepareFirstInput(input_layout=self.layout, desired_layout=Replicate(), use_local_output=False)._apply(
            module, device_mesh
        )
        return PrepareFirstOutput(output_layout=Partial(), desired_layout=self.layout)._apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"MoEBlockParallel(input_layouts={self.layout})"


class ReplicatedModule(ParallelStyle):
    """A module left whole on every rank whose gradients come out whole on every rank too. It
    marks the module as covered under sequence parallelism.

    partial_output_grad=False: an MoE router, whose routing weights' gradients ExpertsParallel
        reduces. Changes nothing.
    partial_output_grad=True: a module whose output multiplies a partial sum (Qwen2-MoE's
        shared_expert_gate, the sigmoid scale of the shared expert's output): its output's
        gradient is this rank's partial sum, reduced on the way back (`whole_with_partial_grad`).
    partial_grad_last=n: the same for the last n features of its output only (the rotary key
        every head of a latent attention shares, at the end of DeepSeek's kv_a_proj_with_mqa)."""

    def __init__(self, *, partial_output_grad: bool = False, partial_grad_last: int = 0):
        super().__init__()
        if partial_output_grad and partial_grad_last:
            raise ValueError(
                "trifuse.parallel.ReplicatedModule: pass partial_output_grad=True or partial_grad_last=n, not both"
            )
        self.partial_output_grad = partial_output_grad
        self.partial_grad_last = partial_grad_last

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Inside a MoEBlockParallel block the inputs are replicated DTensors: the module gets
        # their local tensors, whose gradients, whole on every rank, join the other consumers'
        # partial sums as 1/t shares, so that the block reduces the sum once (`_local_inputs`).
        module.register_forward_pre_hook(_local_inputs)
        if self.partial_output_grad:
            module.register_forward_hook(partial(_partial_grad, device_mesh))
        elif self.partial_grad_last:
            module.register_forward_hook(partial(_partial_grad_last, device_mesh, self.partial_grad_last))
        return module

    def __repr__(self) -> str:
        return (
            f"ReplicatedModule(partial_output_grad={self.partial_output_grad}, "
            f"partial_grad_last={self.partial_grad_last})"
        )


def _local_inputs(module: nn.Module, args):
    return tuple(_local_share(a) if isinstance(a, DTensor) else a for a in args)


def _local_share(x: DTensor) -> torch.Tensor:
    """A replicated DTensor's local tensor for a module run whole on every rank: its gradient, the
    same on every rank, is handed back as this rank's 1/t share of a partial sum. The experts' and
    a shared expert's gradients are partial sums too, and the block's input reduces them all once.
    DTensor from torch 2.12 on converts a replicated gradient so when it meets a partial one;
    2.11's reduces the partial one first (Qwen2-MoE: two more all-reduces of the hidden states per
    block, issued inside DTensor's dispatch of the gradient's sum)."""
    if any(not p.is_replicate() for p in x.placements):
        return x.to_local()
    return _GradShare.apply(x.to_local(grad_placements=(Partial(),)), x.device_mesh.size())


class _GradShare(torch.autograd.Function):
    """The identity forward; backward hands on 1/ranks of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ranks: int) -> torch.Tensor:
        ctx.ranks = ranks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.ranks, None


def _partial_grad(mesh: DeviceMesh, module: nn.Module, args, out):
    # An output without a gradient (a sparse-attention indexer's key indices) is left as it is.
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return out
    return whole_with_partial_grad(out, mesh, Replicate())


def _partial_grad_last(mesh: DeviceMesh, n: int, module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    if out.shape[-1] < n:
        raise ValueError(
            f"trifuse.parallel.ReplicatedModule: {type(module).__name__}'s output has {out.shape[-1]} features, "
            f"fewer than the {n} whose gradient is partial"
        )
    whole, shared = out.split([out.shape[-1] - n, n], dim=-1)
    return torch.cat([whole, whole_with_partial_grad(shared, mesh, Replicate())], dim=-1)
