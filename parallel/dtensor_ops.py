"""DTensor sharding strategies for trifuse's registered ops, so that a fused model can be sharded.

Under sequence parallelism (`shard(model, mesh)`'s default) the residual stream between the
attention and MLP cores is a DTensor sharded on the sequence dim, and the norms' weights are
replicated DTensors: a fused block then calls `trifuse::layer_norm`, `trifuse::dropout_add_layer_norm`,
`trifuse::layer_norm_add` (a post-norm residual add), ... on DTensors. DTensor runs an op on the
local shards once it knows, for some placement of the inputs, the placement of the outputs;
`register_sharding` (torch.distributed.tensor.experimental, the same in torch 2.11 to 2.13)
tells it. Per mesh dim, the strategies offered are:

    norms (x normalized over its last k dims; weights per feature)
        x, residual, s, dy, ds  Shard(d), d any leading dim   Replicate   (residual: also the
                                                              post-norm add's, layer_norm_add)
        weight, bias, x_bias    Replicate                     Replicate
        y, s, dx, dresidual     Shard(d)                      Replicate
        mean, rstd              Shard(d) (shaped like x's leading dims, see kernels/layer_norm.py)
        dweight, dbias, dx_bias Partial() (each rank summed its rows; DTensor adds them up)
    dropout_add, bias_gelu (elementwise, bias over the last dim; bias_gelu's dropout seed as dropout_add's)
        x, residual, dy         Shard(d), d a leading dim     Shard(last)          Replicate
        bias                    Replicate                     Shard(0)             Replicate
        dbias                   Partial()                     Shard(0)             Replicate
    gated_activation (elementwise; gate, up, y, dy, dgate, dup alike; with dropout its seed as
    dropout_add's, below)
        every tensor            Shard(d), d any dim                                Replicate
    group_norm (a row (n, g) spans its channels and every position: only the batch splits;
                num_groups is the whole tensor's, so channel shards cannot take it)
        x, y, dy, dx            Shard(0)                                           Replicate
        mean, rstd              Shard(0) ((N, G))                                  Replicate
        weight, bias            Replicate                                          Replicate
        dweight, dbias          Partial()                                          Replicate
    channel_norm (a position's channels, dim `dim`, are one row: only the dims before it split;
                  mean and rstd are shaped like x without that dim)
        x, y, dy, dx            Shard(d), d < dim                                  Replicate
        mean, rstd              Shard(d)                                           Replicate
        weight, bias            Replicate                                          Replicate
        dweight, dbias          Partial()                                          Replicate
    xielu (elementwise; its four one-value coefficients replicated everywhere)
        x, y, dy, dx            Shard(d), d any dim                                Replicate
        dalpha_p, dalpha_n      Partial() (each rank summed its elements)          Replicate

`trifuse::rotary_embedding` has no strategy: like attention it runs inside the attention core,
on the local head shards the column-parallel q/k projections hand it (tests/parallel: Llama fuses
its rotary embeddings under TP and TP+SP, in either order with fuse).

Empty tensors (the mean an RMSNorm does not have, a dresidual or dbias not asked for) are
Replicate. The dropout seed an op returns is Replicate: it is drawn on every rank from that
rank's generator, which `random.py` makes differ across ranks wherever the activations do
(sequence shards drop independently) and agree elsewhere, and it only flows back into the same
op's backward, where it is again Replicate: DTensor never moves it.

DTensor caches a strategy per input layout and, by default, ignores non-tensor arguments
(register_sharding's schema info hashes none of `list[int]`, float or bool arguments); the
backward ops' output shapes depend on flags (dresidual, dbias empty or not), so the schema info
is set to hash every argument from the first non-tensor one on.

`register()` runs on `import trifuse` (from trifuse.parallel) and does nothing when
torch.distributed or DTensor is unavailable.
"""

from __future__ import annotations

import torch

_REGISTERED = False


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial, Replicate, Shard


def _empty(t) -> bool:
    return t is not None and t.shape.numel() == 0


def _norm_strategies(x, k: int, tensors: dict, outputs: list[str]):
    """Strategies for a norm op. `tensors` gives each op argument, in order, as (role, value):
    "row" (shaped like x), "stat" (x's leading dims), "feat" (per feature, replicated), "seed",
    or None (not a tensor, or absent). `outputs` likewise, with "part" for per-feature partial
    sums (the weight gradients). Empty values are Replicate."""
    Partial, Replicate, Shard = _placements()
    lead = x.ndim - k

    def place(role, value, shard):
        if role is None or value is None:
            return None
        if _empty(value) and role != "row":  # an RMSNorm's mean, an unused dresidual
            return Replicate()
        if shard is None:
            return Replicate()
        if role in ("row", "stat"):
            return Shard(shard)
        if role == "part":
            return Partial()
        return Replicate()  # "feat", "seed"

    strategies = []
    for shard in (None, *range(lead)):
        outs = [place(role, value, shard) for role, value in outputs]
        ins = [place(role, value, shard) for role, value in tensors]
        strategies.append((outs, ins))
    return strategies


def _elementwise_strategies(x, args: list, outputs: list):
    """Strategies for an elementwise op with a per-feature bias over the last dim. `args` and
    `outputs` are (role, value) pairs: "row" (shaped like x), "bias" (per feature), "part" (an
    output per-feature reduction: dbias), "seed", "scalar" (one value every rank holds: xIELU's
    coefficients), "sum" (an output reduced over every element: their gradients), or None (not a
    tensor or absent)."""
    Partial, Replicate, Shard = _placements()

    def place(role, value, shard):
        if role is None or value is None:
            return None
        if role == "scalar":
            return Replicate()
        if role == "sum":
            return Replicate() if shard is None else Partial()
        if shard is None or (_empty(value) and role != "row") or role == "seed":
            return Replicate()
        if role == "row":
            return Shard(shard)
        if shard == x.ndim - 1:  # sharded over features: bias and dbias too
            return Shard(0)
        return Replicate() if role == "bias" else Partial()

    strategies = []
    for shard in (None, *range(x.ndim)):
        strategies.append(([place(r, v, shard) for r, v in outputs], [place(r, v, shard) for r, v in args]))
    return strategies


def register() -> bool:
    """Registers the strategies once; False when DTensor is not available here."""
    global _REGISTERED
    if _REGISTERED:
        return True
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:
        return False
    import trifuse.kernels  # noqa: F401  (the ops must be defined first)

    ops = torch.ops.trifuse

    # (out_dtype, full_y, dx_dtype, dy_narrow: where the call passes them; rms_norm's clamp_eps after
    # its full_y, a bool like it)
    def _y_narrow(x, narrowing):
        """The forward ops' last output: like x with full_y, else empty (Replicate)."""
        return x if len(narrowing) > 1 and narrowing[1] else _EMPTY

    @register_sharding(ops.layer_norm.default)
    def _layer_norm(x, normalized_shape, weight, bias, eps, *narrowing):
        return _norm_strategies(
            x, len(normalized_shape),
            [("row", x), (None, None), ("feat", weight), ("feat", bias), (None, None),
             *[(None, None)] * len(narrowing)],
            [("row", x), ("stat", x), ("stat", x), ("stat", _y_narrow(x, narrowing))],
        )

    @register_sharding(ops.rms_norm.default)
    def _rms_norm(x, normalized_shape, weight, eps, *narrowing):
        return _norm_strategies(
            x, len(normalized_shape),
            [("row", x), (None, None), ("feat", weight), (None, None), *[(None, None)] * len(narrowing)],
            [("row", x), ("stat", x), ("stat", _y_narrow(x, narrowing))],
        )

    @register_sharding(ops.layer_norm_add.default)
    def _layer_norm_add(x, residual, normalized_shape, weight, bias, eps):
        return _norm_strategies(
            x, len(normalized_shape),
            [("row", x), ("row", residual), (None, None), ("feat", weight), ("feat", bias), (None, None)],
            [("row", x), ("stat", x), ("stat", x)],
        )

    @register_sharding(ops.rms_norm_add.default)
    def _rms_norm_add(x, residual, normalized_shape, weight, eps):
        return _norm_strategies(
            x, len(normalized_shape), [("row", x), ("row", residual), (None, None), ("feat", weight), (None, None)],
            [("row", x), ("stat", x)],
        )

    def _dropout_add_norm(x, residual, normalized_shape, weight, bias, eps, p, x_bias, is_rms_norm,
                          narrowing):
        args = [("row", x), ("row", residual), (None, None), ("feat", weight)]
        if not is_rms_norm:
            args.append(("feat", bias))
        args += [(None, None), (None, None), ("feat", x_bias), *[(None, None)] * len(narrowing)]
        # The RMSNorm's mean output is empty: any non-empty stand-in marks it "stat" only when
        # the op returns one (see place(): empty tensors are Replicate).
        mean = _EMPTY if is_rms_norm else x
        return _norm_strategies(
            x, len(normalized_shape), args,
            [("row", x), ("row", x), ("stat", mean), ("stat", x), ("seed", x),
             ("stat", _y_narrow(x, narrowing))],
        )

    @register_sharding(ops.dropout_add_layer_norm.default)
    def _dropout_add_layer_norm(x, residual, normalized_shape, weight, bias, eps, p, x_bias, *narrowing):
        return _dropout_add_norm(x, residual, normalized_shape, weight, bias, eps, p, x_bias, False,
                                 narrowing)

    @register_sharding(ops.dropout_add_rms_norm.default)
    def _dropout_add_rms_norm(x, residual, normalized_shape, weight, eps, p, x_bias, *narrowing):
        return _dropout_add_norm(x, residual, normalized_shape, weight, None, eps, p, x_bias, True, narrowing)

    @register_sharding(ops.layer_norm_backward.default)
    def _layer_norm_backward(dy, ds, s, normalized_shape, weight, mean, rstd, seed, p, is_rms_norm,
                             store_dresidual, *tail):
        # tail: (dx_dtype, dy_narrow, vectors) as far as the call gives them; a vector not asked
        # for comes back empty
        vectors = tail[2] if len(tail) > 2 else 7  # all three (kernels/layer_norm.py's ALL_VECTORS)
        args = [("row", dy), ("row", ds), ("row", s), (None, None), ("feat", weight), ("stat", mean),
                ("stat", rstd), ("seed", seed), (None, None), (None, None), (None, None),
                *[(None, None)] * len(tail[:1]), *[("row", t) for t in tail[1:2]],
                *[(None, None)] * len(tail[2:])]
        return _norm_strategies(
            s, len(normalized_shape), args,
            [("row", s), ("row" if store_dresidual else "stat", s if store_dresidual else _EMPTY),
             *[("part", s if vectors >> i & 1 else _EMPTY) for i in range(3)]],
        )

    @register_sharding(ops.dropout_add.default)
    def _dropout_add(x, residual, p, bias):
        return _elementwise_strategies(
            x, [("row", x), ("row", residual), (None, None), ("bias", bias)], [("row", x), ("seed", x)]
        )

    @register_sharding(ops.dropout_add_backward.default)
    def _dropout_add_backward(dy, seed, p, has_bias):
        return _elementwise_strategies(
            dy, [("row", dy), ("seed", seed), (None, None), (None, None)],
            [("row", dy), ("part", dy if has_bias else _EMPTY)],
        )

    @register_sharding(ops.bias_gelu.default)
    def _bias_gelu(x, bias, approximate):
        return _elementwise_strategies(x, [("row", x), ("bias", bias), (None, None)], [("row", x)])

    @register_sharding(ops.bias_gelu_backward.default)
    def _bias_gelu_backward(dy, x, bias, approximate):
        return _elementwise_strategies(
            x, [("row", dy), ("row", x), ("bias", bias), (None, None)],
            [("row", x), ("part", x if bias is not None else _EMPTY)],
        )

    @register_sharding(ops.bias_gelu_dropout.default)
    def _bias_gelu_dropout(x, bias, approximate, p):
        return _elementwise_strategies(
            x, [("row", x), ("bias", bias), (None, None), (None, None)], [("row", x), ("seed", x)]
        )

    @register_sharding(ops.bias_gelu_dropout_backward.default)
    def _bias_gelu_dropout_backward(dy, x, bias, approximate, p, seed):
        return _elementwise_strategies(
            x, [("row", dy), ("row", x), ("bias", bias), (None, None), (None, None), ("seed", seed)],
            [("row", x), ("part", x if bias is not None else _EMPTY)],
        )

    @register_sharding(ops.gated_activation.default)
    def _gated_activation(gate, up, activation):
        return _elementwise_strategies(gate, [("row", gate), ("row", up), (None, None)], [("row", gate)])

    @register_sharding(ops.gated_activation_backward.default)
    def _gated_activation_backward(dy, gate, up, activation):
        return _elementwise_strategies(
            gate, [("row", dy), ("row", gate), ("row", up), (None, None)], [("row", gate), ("row", gate)]
        )

    @register_sharding(ops.gated_activation_dropout.default)
    def _gated_activation_dropout(gate, up, activation, p):
        return _elementwise_strategies(
            gate, [("row", gate), ("row", up), (None, None), (None, None)], [("row", gate), ("seed", gate)]
        )

    @register_sharding(ops.gated_activation_dropout_backward.default)
    def _gated_activation_dropout_backward(dy, gate, up, activation, p, seed):
        return _elementwise_strategies(
            gate, [("row", dy), ("row", gate), ("row", up), (None, None), (None, None), ("seed", seed)],
            [("row", gate), ("row", gate)],
        )

    @register_sharding(ops.xielu.default)
    def _xielu(x, alpha_p, alpha_n, beta, eps, *out_dtype):  # out_dtype where the call passes it
        scalars = [("scalar", t) for t in (alpha_p, alpha_n, beta, eps)]
        args = [("row", x), *scalars, *[(None, None)] * len(out_dtype)]
        return _elementwise_strategies(x, args, [("row", x)])

    @register_sharding(ops.xielu_backward.default)
    def _xielu_backward(dy, x, alpha_p, alpha_n, beta, eps):
        scalars = [("scalar", t) for t in (alpha_p, alpha_n, beta, eps)]
        return _elementwise_strategies(x, [("row", dy), ("row", x), *scalars], [("row", x), ("sum", x), ("sum", x)])

    @register_sharding(ops.group_norm.default)
    def _group_norm(x, num_groups, weight, bias, eps, activation, out_dtype):
        args = [("row", x), (None, None), ("feat", weight), ("feat", bias), (None, None), (None, None),
                (None, None)]
        return _norm_strategies(x, x.ndim - 1, args, [("row", x), ("stat", x), ("stat", x)])

    @register_sharding(ops.group_norm_backward.default)
    def _group_norm_backward(dy, x, num_groups, weight, bias, mean, rstd, activation, need_dx):
        args = [("row", dy), ("row", x), (None, None), ("feat", weight), ("feat", bias), ("stat", mean),
                ("stat", rstd), (None, None), (None, None)]
        return _norm_strategies(
            x, x.ndim - 1, args,
            [("row", x) if need_dx else ("stat", _EMPTY), ("part", x if weight is not None else _EMPTY),
             ("part", x if bias is not None else _EMPTY)],
        )

    @register_sharding(ops.channel_norm.default)
    def _channel_norm(x, dim, weight, bias, eps, is_rms_norm, clamp_eps, *y_channels_last):
        args = [("row", x), (None, None), ("feat", weight), ("feat", bias), (None, None), (None, None),
                (None, None), *[(None, None)] * len(y_channels_last)]
        return _norm_strategies(x, x.ndim - dim % x.ndim, args,
                                [("row", x), ("stat", _EMPTY if is_rms_norm else x), ("stat", x)])

    @register_sharding(ops.channel_norm_backward.default)
    def _channel_norm_backward(dy, x, dim, weight, mean, rstd, is_rms_norm, need_dx, vectors):
        args = [("row", dy), ("row", x), (None, None), ("feat", weight), ("stat", mean), ("stat", rstd),
                (None, None), (None, None), (None, None)]
        return _norm_strategies(
            x, x.ndim - dim % x.ndim, args,
            [("row", x) if need_dx else ("stat", _EMPTY),
             ("part", x if weight is not None and vectors & 1 else _EMPTY),
             ("part", x if vectors & 2 else _EMPTY)],
        )

    # Hash every argument from the first non-tensor one on (see the module docstring).
    propagator = DTensor._op_dispatcher.sharding_propagator
    infos = getattr(propagator, "op_to_schema_info", None)
    for packet in (ops.layer_norm, ops.rms_norm, ops.layer_norm_add, ops.rms_norm_add,
                   ops.dropout_add_layer_norm, ops.dropout_add_rms_norm,
                   ops.layer_norm_backward, ops.dropout_add, ops.dropout_add_backward, ops.bias_gelu,
                   ops.bias_gelu_backward, ops.bias_gelu_dropout, ops.bias_gelu_dropout_backward,
                   ops.gated_activation, ops.gated_activation_backward,
                   ops.gated_activation_dropout, ops.gated_activation_dropout_backward,
                   ops.group_norm, ops.group_norm_backward, ops.channel_norm, ops.channel_norm_backward,
                   ops.xielu):
        op = packet.default
        if infos is not None and op in infos:
            first = next(
                (i for i, a in enumerate(op._schema.arguments) if not _is_tensor_type(a.type)),
                len(op._schema.arguments),
            )
            infos[op] = RuntimeSchemaInfo(static_argnum=first, needs_pytree=True)
    _REGISTERED = True
    return True


def _is_tensor_type(t) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


class _Empty:
    """Stands in for an output that is empty (its placement is Replicate)."""

    class shape:
        @staticmethod
        def numel() -> int:
            return 0

    ndim = 1


_EMPTY = _Empty()
