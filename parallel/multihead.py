"""nn.MultiheadAttention under tensor parallelism (nn.TransformerEncoder / Decoder, nn.Transformer,
SigLIP's pooling head, most hand-written PyTorch transformers).

nn.MultiheadAttention keeps Q, K and V in one packed `in_proj_weight` (3E, E) = [Q | K | V] and
calls `F.multi_head_attention_forward`, which checks every width against the input's E and
cannot run on a slice of the heads. `MultiheadAttentionParallel` therefore:

- splits `in_proj_weight` / `in_proj_bias` per head, rank-major ([Q_r | K_r | V_r] on rank r,
  as a fused projection; the state dict keeps the unsharded layout);
- gathers query, key and value whole before the module runs (query from `input_layouts`, the
  residual stream's layout; key and value from the same, when they are the query itself, else
  whole already: a cross-attention's memory); their gradients are this rank's heads' partial
  sums, reduced on the way back (all-reduce, or reduce-scatter under sequence parallelism);
- runs the module as `ShardedMultiheadAttention`, the same module (parameters, attributes,
  state dict) whose forward is nn.MultiheadAttention's on this rank's H/t heads: the same
  masks (boolean or additive, 2-D or per head 3-D, key padding), `is_causal`, `add_zero_attn`,
  dropout, batch-first or sequence-first and unbatched inputs, and the attention weights when
  asked for (averaged over all heads, or per head), whole on every rank.

Its `out_proj` is row-parallel (`RowwiseParallel`, a plan entry of its own): the attention's
output reaches it as this rank's features. Separate Q/K/V weights (kdim or vdim other than
embed_dim), `add_bias_kv` and subclasses are refused with a ValueError.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from .styles import _distribute_param, mark_fused, to_rank_major, whole_with_partial_grad

_ARG_NAMES = ("query", "key", "value")


def unsupported(module: nn.MultiheadAttention) -> str | None:
    """Why `module` cannot be sharded by MultiheadAttentionParallel, or None."""
    if type(module) is not nn.MultiheadAttention:
        return f"{type(module).__name__}, a subclass (its forward may differ), is not supported"
    if not module._qkv_same_embed_dim:
        return (
            f"separate Q/K/V weights (kdim={module.kdim}, vdim={module.vdim} differ from "
            f"embed_dim={module.embed_dim}) are not supported"
        )
    if module.bias_k is not None or module.bias_v is not None:
        return "add_bias_kv=True is not supported"
    return None


class MultiheadAttentionParallel(ParallelStyle):
    """Tensor parallelism for nn.MultiheadAttention: this rank's H/t heads (see the module
    docstring). Pair it with `RowwiseParallel(output_layouts=input_layouts)` on its `out_proj`.

    input_layouts: the layout the query arrives in (Replicate(), or Shard(1) under sequence
        parallelism: dim 1 of the caller's tensors, the batch for sequence-first inputs).
    """

    def __init__(self, *, input_layouts: Placement | None = None):
        super().__init__()
        self.input_layout = input_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(
                f"trifuse.parallel.MultiheadAttentionParallel: needs an nn.MultiheadAttention, "
                f"got {type(module).__name__}"
            )
        why = unsupported(module)
        tp = device_mesh.size()
        if why is None and module.num_heads % tp:
            why = f"its {module.num_heads} heads do not divide across {tp} ranks"
        if why is not None:
            raise ValueError(f"trifuse.parallel.MultiheadAttentionParallel: {why}")
        for pname in ("in_proj_weight", "in_proj_bias"):
            if getattr(module, pname) is not None:
                data = to_rank_major(getattr(module, pname).detach(), 0, 3, tp)
                _distribute_param(module, pname, data, device_mesh, Shard(0), self.src_data_rank)
        mark_fused(module, 3, {"in_proj_weight": 0, "in_proj_bias": 0}, tp)
        module.register_forward_pre_hook(partial(self._gather, device_mesh), with_kwargs=True)
        module.__class__ = ShardedMultiheadAttention
        module.total_heads, module.tp_rank = module.num_heads, device_mesh.get_local_rank()
        module.tp_mesh = device_mesh
        module.num_heads //= tp
        return module

    def _gather(self, mesh, module, args, kwargs):
        """query, key and value whole, as local tensors whose gradient is a partial sum (this
        rank's heads only), reduced on the way back."""
        given = dict(zip(_ARG_NAMES, args))
        given.update((n, kwargs[n]) for n in _ARG_NAMES if n in kwargs)
        # (given, whole) pairs, matched by identity: self-attention passes one tensor three times.
        # No id(): Dynamo before torch 2.13 breaks the graph on id() of a tensor made inside it.
        done: list[tuple[torch.Tensor, torch.Tensor]] = []

        def whole(x, default=None):
            for given_x, whole_x in done:
                if x is given_x:
                    return whole_x
            return default

        query = given.get("query")
        for name in _ARG_NAMES:
            x = given.get(name)
            if not isinstance(x, torch.Tensor) or whole(x) is not None:
                continue
            layout = self.input_layout if x is query else Replicate()
            done.append((x, whole_with_partial_grad(x, mesh, layout)))
        n_args = len(args)
        args = tuple(whole(a, a) for a in args)
        kwargs = {k: whole(v, v) if k in _ARG_NAMES else v for k, v in kwargs.items()}
        return args[:n_args], kwargs

    def __repr__(self) -> str:
        return f"MultiheadAttentionParallel(input_layouts={self.input_layout})"


def _per_head_mask(mask: torch.Tensor, batch: int, module: "ShardedMultiheadAttention") -> torch.Tensor:
    """A (batch * H, L, S) mask as (batch, H/t, L, S), this rank's heads."""
    heads, local = module.total_heads, module.num_heads
    if mask.shape[0] != batch * heads:
        raise ValueError(
            f"trifuse.parallel: nn.MultiheadAttention's 3-D attn_mask must have batch x num_heads = "
            f"{batch * heads} rows, got shape {tuple(mask.shape)}"
        )
    start = module.tp_rank * local
    return mask.view(batch, heads, *mask.shape[1:])[:, start : start + local]


class ShardedMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention on this rank's heads: `num_heads` is the local count (H/t),
    `total_heads` the model's, `in_proj_weight` a DTensor whose local piece is [Q_r | K_r | V_r].
    Made by `MultiheadAttentionParallel`, never constructed directly."""

    total_heads: int
    tp_rank: int
    tp_mesh: DeviceMesh

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        self_attention, kv_same = query is key and key is value, key is value
        # To (batch, sequence, features), as nn.MultiheadAttention's own layout conversion.
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "trifuse.parallel: nn.MultiheadAttention needs attn_mask with the is_causal hint "
                "(nn.Transformer.generate_square_subsequent_mask makes one)"
            )
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # the hint stands for the mask: SDPA's causal path
        else:
            attn_mask = F._canonical_mask(
                mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                target_type=query.dtype, check_other=False,
            )
            is_causal = False

        # This rank's heads: one projection for self-attention, Q apart from K/V otherwise.
        b, q_len, heads, d = query.shape[0], query.shape[1], self.num_heads, self.head_dim
        width = heads * d
        weight = self.in_proj_weight.to_local()
        bias = None if self.in_proj_bias is None else self.in_proj_bias.to_local()
        if self_attention:
            q, k, v = F.linear(query, weight, bias).chunk(3, dim=-1)
        else:
            w_q, w_k, w_v = weight.split(width)
            b_q, b_k, b_v = (None,) * 3 if bias is None else bias.split(width)
            q = F.linear(query, w_q, b_q)
            if kv_same:
                b_kv = None if bias is None else torch.cat([b_k, b_v])
                k, v = F.linear(key, torch.cat([w_k, w_v]), b_kv).chunk(2, dim=-1)
            else:
                k, v = F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
        q, k, v = (t.unflatten(-1, (heads, d)).transpose(1, 2) for t in (q, k, v))

        mask = None
        if attn_mask is not None:
            if attn_mask.dim() == 3:
                mask = _per_head_mask(attn_mask, b, self)
            else:
                mask = attn_mask.view(1, 1, *attn_mask.shape)
        if key_padding_mask is not None:
            pad = key_padding_mask.view(b, 1, 1, -1)
            mask = pad if mask is None else mask + pad
        if self.add_zero_attn:  # one more key and value, all zeros, that every query may attend
            zeros = q.new_zeros(b, heads, 1, d)
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
            if mask is not None:
                mask = F.pad(mask, (0, 1))
        dropout_p = self.dropout if self.training else 0.0

        weights = None
        if not need_weights:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
            )
        else:
            scores = (q * d**-0.5) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            weights = scores.softmax(dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = weights @ v
            weights = self._whole_weights(weights, average_attn_weights)
            if not batched:
                weights = weights.squeeze(0)

        out = out.transpose(1, 2).reshape(b, q_len, width)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return self.out_proj(out), weights

    def _whole_weights(self, weights: torch.Tensor, average: bool) -> torch.Tensor:
        """This rank's heads' attention weights (batch, H/t, L, S) made whole on every rank:
        averaged over all H heads (a sum over ranks) or all H of them (gathered)."""
        if average:
            mean = weights.sum(dim=1) / self.total_heads
            part = DTensor.from_local(mean, self.tp_mesh, (Partial(),), run_check=False)
        else:
            part = DTensor.from_local(weights, self.tp_mesh, (Shard(1),), run_check=False)
        return part.redistribute(self.tp_mesh, (Replicate(),), async_op=False).to_local()
