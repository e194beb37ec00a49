"""The adaptive norm of diffusion transformers: a norm whose output is modulated per sample or per token.

    y = norm(x) * mul + add              the norm already a trifuse norm (stage 0); mul and add
                                         one vector per sample, e.g. (1 + scale[:, None]), shift[:, None]
  ->  y = layer_norm_modulate(x, normalized_shape, mul, add, weight, bias, eps)

DiT's, SD3's and Flux's AdaLayerNormZero, PixArt's `norm(x) * (1 + scale_msa) + shift_msa`,
AdaLayerNormContinuous's `norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]` and the
blocks' `norm2(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]` all write it so: the product
and the sum each a pass over the activation (and more in the backward), folded into the norm's
one pass. mul and add are whatever tensors the model computes (the `1 + scale` stays PyTorch's,
on a (B, N) vector), as long as each is one vector per sample: shaped like x over a leading prefix
of its dims and 1 over the rest (`per_sample`), or, for the forms with both a product and a sum,
per token (`per_sample_or_token`: FLUX.3's, Helios' and MiniMax H3's scale and shift (B, S, N), the
op's row kernels read them a row at a time; `norm(x) * (1 + scale) + shift` per token is the
`*_offset` forms, whose op adds the 1 as it reads scale, and Qwen-Image 2.1's `norm(x) * (1 +
scale)` the scale-only one). A product alone or a sum alone that varies along the rows (a gate, a
residual) is no modulation: left to the other patterns (a gated or plain residual add before the
norm folds in at stage 2, per sample or per token) (quietly: most norms followed by a product
are none, and the report does not list them). Nor is a product wider than the norm's output
(`in_the_norms_dtype`): under autocast DiT's residual stream is fp32 and its modulation bf16,
fused; fp16 activations beside an fp32 affine written out keep the model's rounding.

Under CUDA's autocast a 16-bit x (diffusers' DiT, PixArt, SD3 keep their residual stream in the
autocast dtype) is normalized in fp32 and the norm returns fp32, which the stage-0 norm pattern
keeps with a cast back (`ops.layer_norm(x).to(torch.float32)`); the modulation then runs in fp32
(`*_upcast`): the op computes it as ever and writes y in fp32 (`out_dtype`), or, where only
autocast's matmuls read y (q, k and v; the MLP's first linear), in the autocast dtype directly
(fusion/narrow.py).

Tried before the residual stream's (stage 1, earlier in the registry): when an add feeds a
modulated norm (a DiT block's second and third norms), folding the modulation saves more passes
than folding the add; the add then folds in as well, at stage 2 (`gated_add_layer_norm_modulate`,
below).
"""
import functools

import torch

from ._base import Match, Pattern, known_equal, needs_number, ops, same_shape


def layer_norm_modulate(x: torch.Tensor, mul: torch.Tensor, add: torch.Tensor, normalized_shape, weight, bias,
                        eps):
    return ops.layer_norm(x, normalized_shape, weight, bias, eps) * mul + add


def layer_norm_modulate_fused(x, mul, add, normalized_shape, weight, bias, eps):
    return ops.layer_norm_modulate(x, normalized_shape, mul, add, weight, bias, eps)


def layer_norm_modulate_upcast(x: torch.Tensor, mul: torch.Tensor, add: torch.Tensor, normalized_shape,
                               weight, bias, eps, dtype):
    """CUDA autocast's LayerNorm of a 16-bit x: fp32 out (the stage-0 norm's cast back), modulated in fp32."""
    return ops.layer_norm(x, normalized_shape, weight, bias, eps).to(dtype) * mul + add


def layer_norm_modulate_upcast_fused(x, mul, add, normalized_shape, weight, bias, eps, dtype):
    return ops.layer_norm_modulate(x, normalized_shape, mul, add, weight, bias, eps, out_dtype=dtype)


def rms_norm_modulate(x: torch.Tensor, mul: torch.Tensor, add: torch.Tensor, normalized_shape, weight, eps):
    return ops.rms_norm(x, normalized_shape, weight, eps) * mul + add


def rms_norm_modulate_fused(x, mul, add, normalized_shape, weight, eps):
    return ops.layer_norm_modulate(x, normalized_shape, mul, add, weight, None, eps, is_rms_norm=True)


def layer_norm_scale(x: torch.Tensor, mul: torch.Tensor, normalized_shape, weight, bias, eps):
    """A norm scaled per sample, no shift (Lumina 2's and Z-Image's `norm(x) * scale_msa`)."""
    return ops.layer_norm(x, normalized_shape, weight, bias, eps) * mul


def layer_norm_scale_fused(x, mul, normalized_shape, weight, bias, eps):
    return ops.layer_norm_modulate(x, normalized_shape, mul, None, weight, bias, eps)


def rms_norm_scale(x: torch.Tensor, mul: torch.Tensor, normalized_shape, weight, eps):
    return ops.rms_norm(x, normalized_shape, weight, eps) * mul


def rms_norm_scale_fused(x, mul, normalized_shape, weight, eps):
    return ops.layer_norm_modulate(x, normalized_shape, mul, None, weight, None, eps, is_rms_norm=True)


def layer_norm_shift(x: torch.Tensor, add: torch.Tensor, normalized_shape, weight, bias, eps):
    """A norm shifted per sample, no scale (HunyuanDiT's AdaLayerNormShift: `norm(x) + shift[:, None]`)."""
    return ops.layer_norm(x, normalized_shape, weight, bias, eps) + add


def layer_norm_shift_fused(x, add, normalized_shape, weight, bias, eps):
    return ops.layer_norm_modulate(x, normalized_shape, None, add, weight, bias, eps)


def rms_norm_shift(x: torch.Tensor, add: torch.Tensor, normalized_shape, weight, eps):
    return ops.rms_norm(x, normalized_shape, weight, eps) + add


def rms_norm_shift_fused(x, add, normalized_shape, weight, eps):
    return ops.layer_norm_modulate(x, normalized_shape, None, add, weight, None, eps, is_rms_norm=True)


def rms_norm_modulate_upcast(x: torch.Tensor, mul: torch.Tensor, add: torch.Tensor, normalized_shape, weight,
                             eps, dtype):
    return ops.rms_norm(x, normalized_shape, weight, eps).to(dtype) * mul + add


def rms_norm_modulate_upcast_fused(x, mul, add, normalized_shape, weight, eps, dtype):
    return ops.layer_norm_modulate(x, normalized_shape, mul, add, weight, None, eps, is_rms_norm=True,
                                   out_dtype=dtype)


def layer_norm_modulate_offset(x: torch.Tensor, mul: torch.Tensor, add: torch.Tensor, offset, normalized_shape,
                               weight, bias, eps):
    """Per token, `norm(x) * (1 + scale) + shift` (FLUX.3): the op adds the offset as it reads scale, no pass
    writes 1 + scale (per sample that vector is small, and the plain form takes it)."""
    return ops.layer_norm(x, normalized_shape, weight, bias, eps) * (offset + mul) + add


def layer_norm_modulate_offset_fused(x, mul, add, offset, normalized_shape, weight, bias, eps):
    return ops.layer_norm_modulate(x, normalized_shape, mul, add, weight, bias, eps, mul_offset=offset)


def rms_norm_modulate_offset(x: torch.Tensor, mul: torch.Tensor, add: torch.Tensor, offset, normalized_shape,
                             weight, eps):
    return ops.rms_norm(x, normalized_shape, weight, eps) * (offset + mul) + add


def rms_norm_modulate_offset_fused(x, mul, add, offset, normalized_shape, weight, eps):
    return ops.layer_norm_modulate(x, normalized_shape, mul, add, weight, None, eps, is_rms_norm=True,
                                   mul_offset=offset)


def layer_norm_modulate_offset_upcast(x: torch.Tensor, mul: torch.Tensor, add: torch.Tensor, offset,
                                      normalized_shape, weight, bias, eps, dtype):
    return ops.layer_norm(x, normalized_shape, weight, bias, eps).to(dtype) * (offset + mul) + add


def layer_norm_modulate_offset_upcast_fused(x, mul, add, offset, normalized_shape, weight, bias, eps, dtype):
    return ops.layer_norm_modulate(x, normalized_shape, mul, add, weight, bias, eps, out_dtype=dtype,
                                   mul_offset=offset)


def rms_norm_modulate_offset_upcast(x: torch.Tensor, mul: torch.Tensor, add: torch.Tensor, offset,
                                    normalized_shape, weight, eps, dtype):
    return ops.rms_norm(x, normalized_shape, weight, eps).to(dtype) * (offset + mul) + add


def rms_norm_modulate_offset_upcast_fused(x, mul, add, offset, normalized_shape, weight, eps, dtype):
    return ops.layer_norm_modulate(x, normalized_shape, mul, add, weight, None, eps, is_rms_norm=True,
                                   out_dtype=dtype, mul_offset=offset)


def layer_norm_scale_offset(x: torch.Tensor, mul: torch.Tensor, offset, normalized_shape, weight, bias, eps):
    """Per token, `norm(x) * (1 + scale)` alone (Qwen-Image 2.1, its scale chosen per token by
    `torch.where`): the offset says it is a modulation, not a gate."""
    return ops.layer_norm(x, normalized_shape, weight, bias, eps) * (offset + mul)


def layer_norm_scale_offset_fused(x, mul, offset, normalized_shape, weight, bias, eps):
    return ops.layer_norm_modulate(x, normalized_shape, mul, None, weight, bias, eps, mul_offset=offset)


def rms_norm_scale_offset(x: torch.Tensor, mul: torch.Tensor, offset, normalized_shape, weight, eps):
    return ops.rms_norm(x, normalized_shape, weight, eps) * (offset + mul)


def rms_norm_scale_offset_fused(x, mul, offset, normalized_shape, weight, eps):
    return ops.layer_norm_modulate(x, normalized_shape, mul, None, weight, None, eps, is_rms_norm=True,
                                   mul_offset=offset)


def _not_broadcast(t: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why t does not broadcast against x as a modulation (each dim x's or 1, the last x's or 1:
    never wider than x), or None."""
    if t.dim() > x.dim():
        return f"it has more dims than the input {list(x.shape)}"
    shape = (1,) * (x.dim() - t.dim()) + tuple(t.shape)
    if not (known_equal(shape[-1], x.shape[-1]) or known_equal(shape[-1], 1)):
        return f"its last dim is neither the input's ({x.shape[-1]}) nor 1"
    if not all(known_equal(a, b) or known_equal(a, 1) for a, b in zip(shape[:-1], x.shape[:-1])):
        return "it does not broadcast against the input"
    return None


def _not_per_sample(t: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why t does not broadcast against x as one vector per sample, or None: over a leading
    prefix of x's dims it must equal x, over the others but the last be 1 (at least one such dim:
    a vector per row is an elementwise product, and the backward's per-group sums would have one
    row a group), and its last dim x's or 1."""
    if t.dim() > x.dim():
        return f"it has more dims than the input {list(x.shape)}"
    shape = (1,) * (x.dim() - t.dim()) + tuple(t.shape)
    if not (known_equal(shape[-1], x.shape[-1]) or known_equal(shape[-1], 1)):
        return f"its last dim is neither the input's ({x.shape[-1]}) nor 1"
    k = x.dim() - 1
    while k > 0 and known_equal(shape[k - 1], 1):
        k -= 1
    if k == x.dim() - 1 or not all(known_equal(a, b) for a, b in zip(shape[:k], x.shape[:k])):
        return "it varies along a sample's rows"
    return None


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def _modulation(m: Match) -> tuple[str, ...]:
    """The modulation's tensors the pattern binds: mul and add, or one alone (the scale-only and
    shift-only forms)."""
    return tuple(name for name in ("mul", "add") if name in m.cp.params)


def per_sample(m: Match, per_token: bool = False) -> str | None:
    """mul and add one vector per sample (not full-size tensors), the norm over x's last dim; with
    per_token, or varying along a sample's rows as well (`per_sample_or_token`)."""
    x = m.value("x")
    shape = m.value("normalized_shape")
    if not isinstance(x, torch.Tensor):
        return "the input's shape is unknown"
    if any(_is_dtensor(m.value(name)) for name in ("x", *_modulation(m))):
        return "a DTensor (the op has no sharding rule: tensor or sequence parallelism keeps it as written)"
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or x.dim() == 0 \
            or not known_equal(shape[0], x.shape[-1]):
        return f"normalized_shape {shape!r} is not the input's last dim alone"
    for name in _modulation(m):
        t = m.value(name)
        if t is None:  # (a stage-2 form's call of the op without it)
            continue
        if not isinstance(t, torch.Tensor):
            return f"{name}'s shape is unknown"
        if per_token:
            why = _not_broadcast(t, x)
            if why is not None:
                return f"{name} {list(t.shape)} is no modulation of the input {list(x.shape)}: {why}"
            continue
        why = _not_per_sample(t, x)
        if why is not None:
            return f"{name} {list(t.shape)} is not one vector per sample of the input {list(x.shape)}: {why}"
    return None


def per_sample_or_token(m: Match) -> str | None:
    """mul and add one vector per sample (folded into the norm's affine) or varying along a sample's
    rows (per token: FLUX.3's scale and shift (B, S, N), read a row at a time), broadcasting against
    x and no wider along its last dim. The scale-only and shift-only forms stay per sample: a
    full-size product or sum after a norm is more often a gate or a residual (the residual-stream
    patterns' post-norm add) than a modulation."""
    why = per_sample(m, per_token=True)
    if why is None and "mul" in m.cp.params and "add" in m.cp.params and per_sample(m) is not None:
        x, mul, add = m.value("x"), m.value("mul"), m.value("add")
        if _not_per_sample(mul, x) is None:
            return (f"mul {list(mul.shape)} is one vector per sample and add {list(add.shape)} varies along the rows: "
                    "a gated residual add after a norm, which the residual-stream patterns fold into the next norm")
    return why


def per_token(m: Match) -> str | None:
    """The modulation varies along a sample's rows (`per_sample_or_token`, not `per_sample`): the
    offset forms fold `1 + scale` into the row kernels' loads; per sample the plain forms take the
    small `1 + scale` vector as written."""
    why = per_sample_or_token(m)
    if why is not None:
        return why
    if per_sample(m) is None:
        return "the modulation is one vector per sample (the plain form takes it, 1 + scale as written)"
    return None


def in_the_norms_dtype(m: Match) -> str | None:
    """The product and the sum in the norm's own dtype (mul and add no wider than x): the op rounds
    once, where the model rounds after each step in that dtype. A wider mul or add (fp32
    parameters beside fp16 activations, kept apart by the norm patterns' `*_weight_apart` forms)
    means the model rounds the norm to x's dtype before a wider product: left as written."""
    x = m.value("x")
    wider = x.dtype
    for name in _modulation(m):
        wider = torch.promote_types(wider, m.value(name).dtype)
    if wider != x.dtype:
        return (f"the norm is rounded to {x.dtype} before a {wider} product or sum (the model's rounding, "
                "kept as written)")
    return None


def upcast_holds_the_product(m: Match) -> str | None:
    """The norm's output widened (x's dtype to a wider float: CUDA autocast runs LayerNorm in
    fp32 and returns fp32 for a 16-bit x), or cast to x's own dtype (a no-op: CogView4's and
    HiDream's `norm(x).to(dtype=x.dtype)`), and the product and sum in that dtype: the op computes
    it all in fp32 and writes y in it, where the model rounds in it after each step."""
    x, mul, add, dtype = (m.value(name) for name in ("x", "mul", "add", "dtype"))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return f"the cast is to {dtype!r}, not a float dtype"
    if torch.promote_types(x.dtype, dtype) != dtype:
        return f"the cast from {x.dtype} to {dtype} narrows"
    wider = torch.promote_types(torch.promote_types(dtype, mul.dtype), add.dtype)
    if wider != dtype:
        return f"the product or sum is wider ({wider}) than the norm's {dtype} output"
    return None


# The residual add before a modulated norm (stage 2, once stage 1 made the norm one op):
#
#     s = residual + gate * x             (gate a vector per sample or per token; or residual + x)
#     y = layer_norm_modulate(s, ...)     any stage-1 form: LayerNorm or RMSNorm, upcast or not,
#                                         per sample or per token, with mul_offset or not
#  -> y, s = gated_add_layer_norm_modulate(x, residual, gate, ...)
#
# DiT's, PixArt's, SD3's and Flux's blocks: `h = h + gate_msa[:, None] * attn_out` and then
# `norm2(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]`; PixArt's cross-attention adds its
# output ungated before that norm; Qwen-Image 2.1's image stream does it all per token (gate,
# scale and shift (B, S, N): the op's row kernels read the residual and the gate beside x). The product and the sum fold into the norm's loads: two passes
# over the activation fewer each way, and dgate summed in the norm's backward. (RMSNorm's forms
# bind `bias` to the None the stage-1 replacement passes.)


def gated_add_layer_norm_modulate(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor, mul, add,
                                  normalized_shape, weight, bias, eps, *, rms: bool = False):
    s = residual + gate * x
    kwargs = {"is_rms_norm": True} if rms else {}
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps, **kwargs), s


def gated_add_layer_norm_modulate_fused(x, residual, gate, mul, add, normalized_shape, weight, bias, eps, *,
                                        rms: bool = False):
    y, s = ops.gated_add_layer_norm_modulate(x, residual, gate, normalized_shape, mul, add, weight, bias, eps,
                                             is_rms_norm=rms)
    return y, s


def gated_add_layer_norm_modulate_upcast(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor, mul,
                                         add, normalized_shape, weight, bias, eps, dtype, *,
                                         rms: bool = False):
    s = residual + gate * x
    kwargs = {"is_rms_norm": True} if rms else {}
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps, out_dtype=dtype,
                                   **kwargs), s


def gated_add_layer_norm_modulate_upcast_fused(x, residual, gate, mul, add, normalized_shape, weight, bias,
                                               eps, dtype, *, rms: bool = False):
    y, s = ops.gated_add_layer_norm_modulate(x, residual, gate, normalized_shape, mul, add, weight, bias, eps,
                                             is_rms_norm=rms, out_dtype=dtype)
    return y, s


def add_layer_norm_modulate(x: torch.Tensor, residual: torch.Tensor, mul, add, normalized_shape, weight, bias,
                            eps, *, rms: bool = False):
    s = residual + x
    kwargs = {"is_rms_norm": True} if rms else {}
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps, **kwargs), s


def add_layer_norm_modulate_fused(x, residual, mul, add, normalized_shape, weight, bias, eps, *,
                                  rms: bool = False):
    y, s = ops.gated_add_layer_norm_modulate(x, residual, None, normalized_shape, mul, add, weight, bias, eps,
                                             is_rms_norm=rms)
    return y, s


def add_layer_norm_modulate_upcast(x: torch.Tensor, residual: torch.Tensor, mul, add, normalized_shape,
                                   weight, bias, eps, dtype, *, rms: bool = False):
    s = residual + x
    kwargs = {"is_rms_norm": True} if rms else {}
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps, out_dtype=dtype,
                                   **kwargs), s


def add_layer_norm_modulate_upcast_fused(x, residual, mul, add, normalized_shape, weight, bias, eps, dtype, *,
                                         rms: bool = False):
    y, s = ops.gated_add_layer_norm_modulate(x, residual, None, normalized_shape, mul, add, weight, bias, eps,
                                             is_rms_norm=rms, out_dtype=dtype)
    return y, s


def add_after_inactive_dropout_layer_norm_modulate(x: torch.Tensor, residual: torch.Tensor, p, training, mul,
                                                   add, normalized_shape, weight, bias, eps, *,
                                                   rms: bool = False):
    """The sum as stage 1 left it: `residual + F.dropout(x, p, training)` made dropout_add."""
    s = ops.dropout_add(x, residual, p, training, None)
    kwargs = {"is_rms_norm": True} if rms else {}
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps, **kwargs), s


def add_after_inactive_dropout_layer_norm_modulate_fused(x, residual, p, training, mul, add, normalized_shape,
                                                         weight, bias, eps, *, rms: bool = False):
    return add_layer_norm_modulate_fused(x, residual, mul, add, normalized_shape, weight, bias, eps, rms=rms)


def add_after_inactive_dropout_layer_norm_modulate_upcast(x: torch.Tensor, residual: torch.Tensor, p,
                                                          training, mul, add, normalized_shape, weight, bias,
                                                          eps, dtype, *, rms: bool = False):
    s = ops.dropout_add(x, residual, p, training, None)
    kwargs = {"is_rms_norm": True} if rms else {}
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps, out_dtype=dtype,
                                   **kwargs), s


def add_after_inactive_dropout_layer_norm_modulate_upcast_fused(x, residual, p, training, mul, add,
                                                                normalized_shape, weight, bias, eps, dtype, *,
                                                                rms: bool = False):
    return add_layer_norm_modulate_upcast_fused(x, residual, mul, add, normalized_shape, weight, bias, eps,
                                                dtype, rms=rms)


# Per token with `1 + scale` in the op's loads: the same sums before the stage-1 `*_offset` forms'
# call (Qwen-Image 2.1's image stream: `h + gate1 * attn_out`, then `norm2(h) * (1 + scale) + shift`,
# gate, scale and shift (B, S, N)).


def _norm_kwargs(rms: bool, **kwargs) -> dict:
    return {"is_rms_norm": True, **kwargs} if rms else kwargs


def gated_add_layer_norm_modulate_offset(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor, mul, add,
                                         offset, normalized_shape, weight, bias, eps, *, rms: bool = False):
    s = residual + gate * x
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps,
                                   **_norm_kwargs(rms, mul_offset=offset)), s


def gated_add_layer_norm_modulate_offset_fused(x, residual, gate, mul, add, offset, normalized_shape, weight, bias,
                                               eps, *, rms: bool = False):
    y, s = ops.gated_add_layer_norm_modulate(x, residual, gate, normalized_shape, mul, add, weight, bias, eps,
                                             is_rms_norm=rms, mul_offset=offset)
    return y, s


def gated_add_layer_norm_modulate_offset_upcast(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor, mul,
                                                add, offset, normalized_shape, weight, bias, eps, dtype, *,
                                                rms: bool = False):
    s = residual + gate * x
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps,
                                   **_norm_kwargs(rms, out_dtype=dtype, mul_offset=offset)), s


def gated_add_layer_norm_modulate_offset_upcast_fused(x, residual, gate, mul, add, offset, normalized_shape, weight,
                                                      bias, eps, dtype, *, rms: bool = False):
    y, s = ops.gated_add_layer_norm_modulate(x, residual, gate, normalized_shape, mul, add, weight, bias, eps,
                                             is_rms_norm=rms, out_dtype=dtype, mul_offset=offset)
    return y, s


def add_layer_norm_modulate_offset(x: torch.Tensor, residual: torch.Tensor, mul, add, offset, normalized_shape,
                                   weight, bias, eps, *, rms: bool = False):
    s = residual + x
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps,
                                   **_norm_kwargs(rms, mul_offset=offset)), s


def add_layer_norm_modulate_offset_fused(x, residual, mul, add, offset, normalized_shape, weight, bias, eps, *,
                                         rms: bool = False):
    y, s = ops.gated_add_layer_norm_modulate(x, residual, None, normalized_shape, mul, add, weight, bias, eps,
                                             is_rms_norm=rms, mul_offset=offset)
    return y, s


def add_layer_norm_modulate_offset_upcast(x: torch.Tensor, residual: torch.Tensor, mul, add, offset,
                                          normalized_shape, weight, bias, eps, dtype, *, rms: bool = False):
    s = residual + x
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps,
                                   **_norm_kwargs(rms, out_dtype=dtype, mul_offset=offset)), s


def add_layer_norm_modulate_offset_upcast_fused(x, residual, mul, add, offset, normalized_shape, weight, bias, eps,
                                                dtype, *, rms: bool = False):
    y, s = ops.gated_add_layer_norm_modulate(x, residual, None, normalized_shape, mul, add, weight, bias, eps,
                                             is_rms_norm=rms, out_dtype=dtype, mul_offset=offset)
    return y, s


def add_after_inactive_dropout_layer_norm_modulate_offset(x: torch.Tensor, residual: torch.Tensor, p, training,
                                                          mul, add, offset, normalized_shape, weight, bias, eps, *,
                                                          rms: bool = False):
    s = ops.dropout_add(x, residual, p, training, None)
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps,
                                   **_norm_kwargs(rms, mul_offset=offset)), s


def add_after_inactive_dropout_layer_norm_modulate_offset_fused(x, residual, p, training, mul, add, offset,
                                                                normalized_shape, weight, bias, eps, *,
                                                                rms: bool = False):
    return add_layer_norm_modulate_offset_fused(x, residual, mul, add, offset, normalized_shape, weight, bias, eps,
                                                rms=rms)


def add_after_inactive_dropout_layer_norm_modulate_offset_upcast(x: torch.Tensor, residual: torch.Tensor, p,
                                                                 training, mul, add, offset, normalized_shape,
                                                                 weight, bias, eps, dtype, *, rms: bool = False):
    s = ops.dropout_add(x, residual, p, training, None)
    return ops.layer_norm_modulate(s, normalized_shape, mul, add, weight, bias, eps,
                                   **_norm_kwargs(rms, out_dtype=dtype, mul_offset=offset)), s


def add_after_inactive_dropout_layer_norm_modulate_offset_upcast_fused(x, residual, p, training, mul, add, offset,
                                                                       normalized_shape, weight, bias, eps, dtype, *,
                                                                       rms: bool = False):
    return add_layer_norm_modulate_offset_upcast_fused(x, residual, mul, add, offset, normalized_shape, weight, bias,
                                                       eps, dtype, rms=rms)


def dropout_inactive(m: Match) -> str | None:
    """The dropout before the add an identity (p = 0, as diffusers' attention output's
    `Dropout(0.0)`, or not training): the add alone folds into the norm. An active one keeps
    dropout_add, whose pass draws its mask."""
    p, training = m["p"], m["training"]
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return f"the dropout's p ({p!r}) or training flag ({training!r}) is not a constant"
    if p != 0 and training:
        return f"the dropout before the add is active (p = {p}, training): dropout_add keeps it"
    return None


def sum_operands(m: Match) -> str | None:
    """x and the residual tensors of one shape and one dtype (the model rounds the product, then
    the sum, in it; the op rounds once), neither a DTensor."""
    x, residual = m.value("x"), m.value("residual")
    if not isinstance(x, torch.Tensor) or not isinstance(residual, torch.Tensor):
        return "x or residual: no tensor metadata"
    if _is_dtensor(x) or _is_dtensor(residual):
        return "a DTensor (the op has no sharding rule: tensor or sequence parallelism keeps it as written)"
    if not same_shape(x, residual):
        return f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape (a broadcast add)"
    if x.dtype != residual.dtype:
        return (f"x ({x.dtype}) and the residual ({residual.dtype}) differ in dtype (the model's rounding, "
                "kept)")
    return None


def _gate_problem(m: Match, widest: torch.dtype | None, per_token: bool = False) -> str | None:
    """Why the gate is not one vector per sample (as mul and add; a (N,) vector too), or with
    per_token one varying along a sample's rows as well (a (B, S, N) gate, which the op's row
    kernels read a row at a time), no wider than `widest` (x's dtype when None); or None."""
    x, gate = m.value("x"), m.value("gate")
    if not isinstance(gate, torch.Tensor):
        return "the gate's shape is unknown"
    if _is_dtensor(gate):
        return "a DTensor gate (the op has no sharding rule)"
    why = _not_broadcast(gate, x) if per_token else _not_per_sample(gate, x)
    if why is not None:
        kind = "a gate" if per_token else "one vector per sample"
        return f"gate {list(gate.shape)} is not {kind} of x {list(x.shape)}: {why}"
    widest = widest or x.dtype
    if torch.promote_types(widest, gate.dtype) != widest:
        return f"the gate ({gate.dtype}) is wider than {'x' if widest == x.dtype else widest} ({widest})"
    return None


def gate_per_sample(m: Match) -> str | None:
    """The gate one vector per sample, no wider than x (a wider one widens the model's sum)."""
    return _gate_problem(m, None)


def gate_per_sample_up_to_fp32(m: Match) -> str | None:
    """The gate one vector per sample, no wider than fp32: where the model computes the sum in fp32
    and casts it back, the op's fp32 product and sum are the model's."""
    return _gate_problem(m, torch.float64 if m.value("x").dtype == torch.float64 else torch.float32)


def gate_per_sample_or_token(m: Match) -> str | None:
    """The gate one vector per sample or per token, no wider than x: `gated_add_layer_norm_modulate`
    takes either (its row kernels the per-token one)."""
    return _gate_problem(m, None, per_token=True)


def gate_per_sample_or_token_up_to_fp32(m: Match) -> str | None:
    """The gate per sample or per token, no wider than fp32 (Helios' per-token fp32 gate beside its
    16-bit stream, the sum written in fp32 and cast back)."""
    return _gate_problem(m, torch.float64 if m.value("x").dtype == torch.float64 else torch.float32, per_token=True)


def modulation_per_sample_or_token(m: Match) -> str | None:
    """The modulation the stage-1 form fused: one vector per sample or per token (`per_sample`'s
    broadcast rule with per_token; the op picks its kernels)."""
    return per_sample(m, per_token=True)


# The modulated norm of an fp32 copy, cast back (stage 2, once stage 1 made it one op): Wan's
# `(norm1(h.float()) * (1 + scale) + shift).type_as(h)` with its fp32 modulation, h in 16 bits:
#
#  -> y = layer_norm_modulate(h, ..., out_dtype=h's dtype)
#
# The op normalizes h in fp32 (its exact upcast), modulates in fp32 and rounds y once to the
# dtype the model casts to: the copy's pass (write and read of 4 bytes an element) and the cast's
# go. The copy stays where the model reads it elsewhere too (Wan's gated add before the
# cross-attention's norm, when that is not fused; its feed-forward's gated add at the block's end).
# With h in fp32 both casts are no-ops: dropped, so that an add before the norm folds as well.


def layer_norm_modulate_of_fp32_copy(x: torch.Tensor, normalized_shape, mul, add, weight, bias, eps, dtype, *,
                                     rms: bool = False):
    kwargs = {"is_rms_norm": True} if rms else {}
    return ops.layer_norm_modulate(x.to(torch.float32), normalized_shape, mul, add, weight, bias, eps,
                                   **kwargs).to(dtype)


def layer_norm_modulate_of_fp32_copy_fused(x, normalized_shape, mul, add, weight, bias, eps, dtype, *,
                                           rms: bool = False):
    return ops.layer_norm_modulate(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm=rms,
                                   out_dtype=dtype)


def copied_to_fp32(m: Match) -> str | None:
    """x no wider than fp32 (an fp32 x's copy and cast back are no-ops, dropped as well: an ungated
    add before the norm then folds in fp32 too; an fp64 x's copy would round), the modulation no
    wider than fp32 (the op's), the cast back to a float dtype."""
    x, mul, add, dtype = m.value("x"), m.value("mul"), m.value("add"), m["dtype"]
    if not isinstance(x, torch.Tensor) or torch.promote_types(x.dtype, torch.float32) != torch.float32:
        return "x is wider than fp32: its fp32 copy rounds"
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return f"the cast back is to {dtype!r}, not a float dtype"
    for name, t in (("mul", mul), ("add", add)):
        if isinstance(t, torch.Tensor) and torch.promote_types(t.dtype, torch.float32) != torch.float32:
            return f"{name} ({t.dtype}) is wider than the op's fp32 modulation"
    return None


OPS_CALLED = ("gated_add_layer_norm_modulate", "layer_norm_modulate")
# (sum, upcast, offset) -> (search, replacement); RMSNorm's forms are the same functions with
# rms=True. The sum: gated, plain, or plain after an inactive dropout (which stage 1 made
# dropout_add: Wan's and LTX-Video's cross-attention output, `h + to_out[1](to_out[0](o))` with
# `Dropout(0.0)`); the offset: the stage-1 `*_offset` forms' `mul_offset`.
_SUM_FORMS = {
    ("gated", False, False): (gated_add_layer_norm_modulate, gated_add_layer_norm_modulate_fused),
    ("gated", True, False): (gated_add_layer_norm_modulate_upcast, gated_add_layer_norm_modulate_upcast_fused),
    ("plain", False, False): (add_layer_norm_modulate, add_layer_norm_modulate_fused),
    ("plain", True, False): (add_layer_norm_modulate_upcast, add_layer_norm_modulate_upcast_fused),
    ("dropout", False, False): (add_after_inactive_dropout_layer_norm_modulate,
                                add_after_inactive_dropout_layer_norm_modulate_fused),
    ("dropout", True, False): (add_after_inactive_dropout_layer_norm_modulate_upcast,
                               add_after_inactive_dropout_layer_norm_modulate_upcast_fused),
    ("gated", False, True): (gated_add_layer_norm_modulate_offset, gated_add_layer_norm_modulate_offset_fused),
    ("gated", True, True): (gated_add_layer_norm_modulate_offset_upcast,
                            gated_add_layer_norm_modulate_offset_upcast_fused),
    ("plain", False, True): (add_layer_norm_modulate_offset, add_layer_norm_modulate_offset_fused),
    ("plain", True, True): (add_layer_norm_modulate_offset_upcast, add_layer_norm_modulate_offset_upcast_fused),
    ("dropout", False, True): (add_after_inactive_dropout_layer_norm_modulate_offset,
                               add_after_inactive_dropout_layer_norm_modulate_offset_fused),
    ("dropout", True, True): (add_after_inactive_dropout_layer_norm_modulate_offset_upcast,
                              add_after_inactive_dropout_layer_norm_modulate_offset_upcast_fused),
}
# (the op takes the modulation and the gate per sample, folded into its affine, or per token, read
# by its row kernels)
_SUM_FILTERS = {"gated": (modulation_per_sample_or_token, sum_operands, gate_per_sample_or_token),
                "plain": (modulation_per_sample_or_token, sum_operands),
                "dropout": (dropout_inactive, modulation_per_sample_or_token, sum_operands)}


def _sum_patterns() -> tuple[Pattern, ...]:
    """The twenty-four forms: a gated, plain or dropout's sum, LayerNorm or RMSNorm, upcast or not,
    `1 + scale` in the loads or not."""
    forms = []
    for (kind, _, _), (search, replacement) in _SUM_FORMS.items():
        for rms in (False, True):
            name = search.__name__.replace("layer_norm", "rms_norm") if rms else search.__name__
            forms.append(Pattern(name, "residual_stream", functools.partial(search, rms=rms),
                                 functools.partial(replacement, rms=rms), OPS_CALLED, _SUM_FILTERS[kind],
                                 stage=2))
    return tuple(forms)


def _own_dtype_form(name: str, family: str, search, replacement, shape=per_sample) -> Pattern:
    """A stage-1 modulation in the norm's own dtype: one vector per sample (or as `shape` says), no
    wider than x. Quiet: most products and sums after a norm are no modulation."""
    return Pattern(name, family, search, replacement, ("layer_norm_modulate", family),
                   (shape, in_the_norms_dtype, needs_number("eps")), stage=1, quiet=True)


def _offset_form(name: str, family: str, search, replacement, upcast: bool) -> Pattern:
    """A stage-1 per-token modulation `norm(x) * (offset + scale) + shift`, offset a number."""
    dtype_filter = upcast_holds_the_product if upcast else in_the_norms_dtype
    return Pattern(name, family, search, replacement, ("layer_norm_modulate", family),
                   (per_token, needs_number("offset"), dtype_filter, needs_number("eps")), stage=1, quiet=True)


PATTERNS = (
    # per token, `1 + scale` folded into the op's loads (before the plain forms, which take it as
    # written where its `1 + scale` is read elsewhere too)
    _offset_form("layer_norm_modulate_offset", "layer_norm", layer_norm_modulate_offset,
                 layer_norm_modulate_offset_fused, upcast=False),
    _offset_form("rms_norm_modulate_offset", "rms_norm", rms_norm_modulate_offset, rms_norm_modulate_offset_fused,
                 upcast=False),
    _offset_form("layer_norm_modulate_offset_upcast", "layer_norm", layer_norm_modulate_offset_upcast,
                 layer_norm_modulate_offset_upcast_fused, upcast=True),
    _offset_form("rms_norm_modulate_offset_upcast", "rms_norm", rms_norm_modulate_offset_upcast,
                 rms_norm_modulate_offset_upcast_fused, upcast=True),
    # (after those with a shift, which the scale alone would match the front of)
    _offset_form("layer_norm_modulate_scale_offset", "layer_norm", layer_norm_scale_offset,
                 layer_norm_scale_offset_fused, upcast=False),
    _offset_form("rms_norm_modulate_scale_offset", "rms_norm", rms_norm_scale_offset, rms_norm_scale_offset_fused,
                 upcast=False),
    _own_dtype_form("layer_norm_modulate", "layer_norm", layer_norm_modulate, layer_norm_modulate_fused,
                    per_sample_or_token),
    _own_dtype_form("rms_norm_modulate", "rms_norm", rms_norm_modulate, rms_norm_modulate_fused,
                    per_sample_or_token),
    # after the forms with a shift: a scale alone (Lumina 2, Z-Image, Ideogram 4, Bria FIBO 2)
    _own_dtype_form("layer_norm_modulate_scale", "layer_norm", layer_norm_scale, layer_norm_scale_fused),
    _own_dtype_form("rms_norm_modulate_scale", "rms_norm", rms_norm_scale, rms_norm_scale_fused),
    # a shift alone (HunyuanDiT's norm1); a full-size summand (a residual) is no shift: quietly left
    _own_dtype_form("layer_norm_modulate_shift", "layer_norm", layer_norm_shift, layer_norm_shift_fused),
    _own_dtype_form("rms_norm_modulate_shift", "rms_norm", rms_norm_shift, rms_norm_shift_fused),
    Pattern("layer_norm_modulate_upcast", "layer_norm", layer_norm_modulate_upcast,
            layer_norm_modulate_upcast_fused, ("layer_norm_modulate", "layer_norm"),
            (per_sample_or_token, upcast_holds_the_product, needs_number("eps")), stage=1, quiet=True),
    Pattern("rms_norm_modulate_upcast", "rms_norm", rms_norm_modulate_upcast, rms_norm_modulate_upcast_fused,
            ("layer_norm_modulate", "rms_norm"),
            (per_sample_or_token, upcast_holds_the_product, needs_number("eps")), stage=1, quiet=True),
    # before the sum's forms: a modulated norm of the sum's fp32 copy then reads the sum itself
    *(Pattern(f"fp32_copy_{norm}_modulate", norm,
              functools.partial(layer_norm_modulate_of_fp32_copy, rms=rms),
              functools.partial(layer_norm_modulate_of_fp32_copy_fused, rms=rms), ("layer_norm_modulate",),
              (copied_to_fp32,), stage=2, quiet=True)
      for norm, rms in (("layer_norm", False), ("rms_norm", True))),
    *_sum_patterns(),
)
