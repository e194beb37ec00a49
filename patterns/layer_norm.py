"""LayerNorm and RMSNorm, in the spellings models use, each becoming one trifuse norm.

`nn.LayerNorm`, `nn.RMSNorm` and `torch.layer_norm` reach the rewriter as `F.layer_norm` /
`F.rms_norm` (fusion/normalize.py), so the functional spelling covers them. RMSNorm written out,
as Hugging Face models do (`x * rsqrt(mean(x^2) + eps) * w`, with or without computing in fp32;
Gemma 4's `pow(mean(x^2) + eps, -0.5)`, with a weight or none), becomes `rms_norm` too; eps stays
the model's eps.

LayerNorm without a bias written out (Cohere's `(x - mean) * rsqrt(var + eps)` times the weight,
the centred value computed twice or once) becomes `layer_norm`; so does DeBERTa's LayerNorm with
its bias (`(x - mean) / sqrt(var + eps)` on an fp32 copy, cast back, `weight * h + bias`). Hugging Face's T5LayerNorm
(variance from an fp32 copy, x scaled as it is, weight first) is an
RMSNorm too. A trifuse norm of an fp32 copy of x cast back to x's dtype (Gemma's RMSNorm,
`(norm(x.float()) * (1 + w.float())).type_as(x)`; OLMo's and Cohere's `norm(x.float()).to(dtype)`)
becomes the norm of x itself: the kernels compute in fp32 whatever x's dtype and round once to
it, so the copy is work for nothing, and an add feeding the norm can then fuse with it.

Written out over one other dim of x (the channels of a conv net's channels-first map: timm's
RmsNorm2d, ViTDet's LayerNorm, `mean(1, keepdim=True)`), a norm without parameters runs over x
with that dim moved last and its result moved back (`_over_dim`), then its weight and bias laid
along the channels (`weight[:, None, None]`) fold in (`*_channels_*_folded`). Last of all, on a
map whose channels are not innermost (a contiguous one), the norm with all that folded into it
becomes `channel_norm`, which reads the channels where they lie (`*_over_channels`): neither the
copy of x with its channels moved last nor the copy of y back is made.

LayerNorm written out in x's dtype without a weight or bias (`layer_norm_bare`: the biased
variance as `pow(2).mean` of the centred value, `var(unbiased=False)` or `var_mean`; the centred
value `* rsqrt` or `/ sqrt` of variance + eps) and RMSNorm as `x / sqrt(mean(x^2) + eps)` become
the norm without parameters; a weight multiplying such a norm, then a bias added to it, fold in
after (`*_weight_folded`, `layer_norm_bias_folded`) when each is 1-D over the normalized width
and in x's dtype, so BERT's `weight * (x - u) / sqrt(s + eps) + bias` of old is one op.

An L2 norm, x over its 2-norm with eps under the root (`x * rsqrt(sum(x^2) + eps)`: the
l2norm of linear attention's q and k in Qwen3-Next and OLMo-Hybrid, FLA's `x / sqrt(...)`, Dory's
norms on an fp32 copy) or none (`x / x.norm(dim=-1, keepdim=True)`), is an RMSNorm:
rms_norm(x, eps / width) / sqrt(width), the 1 / sqrt(width) a constant fp32 weight made in the
graph (the rewriter makes it at the graph's start, from no value a later pattern takes in); a
weight after it joins that constant (`l2_norm_weight_folded`). `F.normalize` and its spelling
written out, `x / x.norm(dim=-1, keepdim=True).clamp(min=eps)` (eps a floor under the norm, not
added: Swin V2's cosine attention, XCiT's, many embedding heads), are the same RMSNorm with its eps
a floor under the rms, `rms_norm(..., clamp_eps=True)`: that eps is eps / sqrt(width), eps rounded
first to the dtype the model's clamp runs in (1e-12 is 0 in fp16, and a zero row NaN as the
model's); a weight after it folds in as well. So does the tail diffusers' video VAEs write after
their channel norm (`F.normalize(x, dim=1).to(x.dtype) * sqrt(C) * gamma + 0.0`): a cast to y's
own dtype, a number, a weight laid along the channels, an added 0 (`l2_*_cast_dropped`, ...).

When the weight's dtype differs from the activation's (fp32 master weights, bf16 activations),
the written-out forms multiply by the weight in the promoted dtype after rounding the normalized
value to the activation dtype; the replacement then keeps that multiplication apart, so the
result and its dtype are the model's own.
"""
import functools
import operator

import torch
import torch.nn.functional as F

from ..kernels._common import default_rms_eps
from ._base import (
    Match,
    Pattern,
    example_value,
    is_runtime_number,
    known_equal,
    needs_number,
    ops,
    params_fp32_or_like_input,
)


def layer_norm(x: torch.Tensor, normalized_shape, weight, bias, eps):
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


def layer_norm_fused(x, normalized_shape, weight, bias, eps):
    return ops.layer_norm(x, normalized_shape, weight, bias, eps)


def rms_norm(x: torch.Tensor, normalized_shape, weight, eps):
    return F.rms_norm(x, normalized_shape, weight, eps)


def rms_norm_fused(x, normalized_shape, weight, eps):
    return ops.rms_norm(x, normalized_shape, weight, eps)


def rms_norm_upcast(x: torch.Tensor, weight: torch.Tensor, eps, dtype):
    """Hugging Face's LlamaRMSNorm (and Mistral, Qwen2, Gemma-free kin): computed in fp32."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def rms_norm_written_out(x: torch.Tensor, weight: torch.Tensor, eps):
    """RMSNorm in the activation dtype, as hand-written models spell it."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# normalized_shape is the weight's shape (filters check it is 1-D): it depends on nothing the
# norm computes, so a later pattern (the residual stream) can read it before the norm's input.


def rms_norm_written_out_fused(x, weight, eps):
    return ops.rms_norm(x, weight.shape, weight, eps)


def rms_norm_written_out_weight_apart(x, weight, eps):
    return ops.rms_norm(x, weight.shape, None, eps) * weight


def rms_norm_upcast_fused(x, weight, eps, dtype):
    return ops.rms_norm(x, weight.shape, weight, eps)


def rms_norm_upcast_weight_apart(x, weight, eps, dtype):
    return weight * ops.rms_norm(x, weight.shape, None, eps)


def rms_norm_written_out_no_weight(x: torch.Tensor, eps, dim):
    """RMSNorm without a scale (nanochat's, on an fp32 copy; QK-norms without parameters), or over
    the channels of a channels-first map (timm's RmsNorm2d: `dim=1`, its weight folded after)."""
    return x * torch.rsqrt(x.pow(2).mean(dim, keepdim=True) + eps)


def rms_norm_variance_upcast_no_weight(x: torch.Tensor, eps, dtype, dim):
    """diffusers' RMSNorm (LTX-Video's, Lumina's, the attention processors' qk norms): the mean
    square of an fp32 copy, x itself times its rsqrt (promoted to fp32), cast back; a 16-bit
    weight, when there is one, multiplies after the cast (folded by `rms_norm_weight_folded`)."""
    variance = x.to(torch.float32).pow(2).mean(dim, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(dtype)


def rms_norm_variance_upcast_no_weight_fused(x, eps, dtype, dim, width, moved, restore):
    return _over_dim(ops.rms_norm, x, width, moved, restore, None, eps)


def rms_norm_written_out_pow(x: torch.Tensor, weight: torch.Tensor, eps):
    """RMSNorm with `pow(ms, -0.5)` for rsqrt, as Gemma 4 writes it (to agree with JAX); its fp32
    copy and cast back go with `rms_norm_in_fp32`."""
    return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5) * weight


def rms_norm_written_out_pow_no_weight(x: torch.Tensor, eps, dim):
    """The same without a scale (Gemma 4's `with_scale=False` norms, its value norm)."""
    return x * torch.pow(x.pow(2).mean(dim, keepdim=True) + eps, -0.5)


def rms_norm_no_weight_fused(x, eps, dim, width, moved, restore):
    return _over_dim(ops.rms_norm, x, width, moved, restore, None, eps)


def _over_dim(norm, x, width, moved, restore, *args):
    """`norm(x, (width,), *args)` over x's last dim, or over dim `moved` (a channels-first map's
    channels): x with that dim moved last, made contiguous (the kernels would copy it anyway, and
    again in the backward from the x the op saves: this copy is the one they save, in place of x;
    none for a map whose channels are innermost already), the result moved back (`_moved_back`).
    A symbolic width (`torch.compile(dynamic=True)`) is read off x in the graph, not written into
    it as the number it was when matched."""
    if moved is not None:
        x = x.movedim(moved, -1).contiguous()
    y = norm(x, (width,) if isinstance(width, int) else x.shape[-1:], *args)
    return y if moved is None else _moved_back(y, moved, restore)


def _moved_back(y, dim, restore):
    """A norm's y over x's dim `dim` moved last, moved back. It lies as the model's own result
    would when x had that dim innermost (a channels-last map's channels); else (`restore`) it is
    made contiguous, as the model's elementwise ops would leave it for a contiguous x: a
    `view(batch, -1)` after the norm must still work. (That copy, and the copy the kernels make of
    the moved x, are what a kernel reading and writing channels-first maps would save.)"""
    y = y.movedim(-1, dim)
    return y.contiguous() if restore else y


def layer_norm_written_out(x: torch.Tensor, weight: torch.Tensor, eps):
    """LayerNorm without a bias written out, as Hugging Face's CohereLayerNorm spells it (the
    centred value computed twice; Cohere computes on an fp32 copy, which `layer_norm_in_fp32`
    then takes away)."""
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    return weight * ((x - mean) * torch.rsqrt(variance + eps))


def layer_norm_written_out_centred_once(x: torch.Tensor, weight: torch.Tensor, eps):
    """The same with the centred value computed once, as hand-written models often do."""
    centred = x - x.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight


def layer_norm_written_out_fused(x, weight, eps):
    return ops.layer_norm(x, weight.shape, weight, None, eps)


def _over_root(centred, variance, eps, root):
    """centred / sqrt(variance + eps), as `root` spells it."""
    if root == "rsqrt":
        return centred * torch.rsqrt(variance + eps)
    return centred / torch.sqrt(variance + eps)


def layer_norm_bare(x: torch.Tensor, eps, dim, *, variance="centred_twice", root="rsqrt"):
    """LayerNorm without weight or bias written out in x's dtype: the mean, the biased variance
    (of the centred value computed twice or once, `x.var(unbiased=False)` or `torch.var_mean`),
    and the centred value over the root (`* rsqrt` or `/ sqrt`), as pre-`nn.LayerNorm` BERT ports
    and hand-written models spell it; their weight and bias fold in after
    (`layer_norm_weight_folded`, `layer_norm_bias_folded`). Over `dim`: the last, or the channels
    of a channels-first map (ViTDet's and timm's LayerNorm2d written out, `mean(1)`; their
    `weight[:, None, None]` and bias fold in after, `*_channels_*_folded`)."""
    if variance == "var_mean":
        var_mean = torch.var_mean(x, dim, correction=0, keepdim=True)
        return _over_root(x - var_mean[1], var_mean[0], eps, root)
    mean = x.mean(dim, keepdim=True)
    if variance == "var":
        return _over_root(x - mean, x.var(dim, correction=0, keepdim=True), eps, root)
    if variance == "centred_once":
        centred = x - mean
        return _over_root(centred, centred.pow(2).mean(dim, keepdim=True), eps, root)
    return _over_root(x - mean, (x - mean).pow(2).mean(dim, keepdim=True), eps, root)


def layer_norm_bare_fused(x, eps, dim, width, moved, restore, *, variance="centred_twice", root="rsqrt"):
    return _over_dim(ops.layer_norm, x, width, moved, restore, None, None, eps)


def rms_norm_div_sqrt_no_weight(x: torch.Tensor, eps, dim):
    """RMSNorm as x over the root mean square (`x / sqrt(mean(x^2) + eps)`); a weight after it
    folds in (`rms_norm_weight_folded`)."""
    return x / torch.sqrt(x.pow(2).mean(dim, keepdim=True) + eps)


def l2_norm(x: torch.Tensor, eps, dim, *, root="rsqrt"):
    """x over its 2-norm with eps under the root, `x * rsqrt(sum(x^2) + eps)` (the l2norm of
    Qwen3-Next's and OLMo-Hybrid's linear attention, VideoPrism's) or `x / sqrt(sum(x^2) + eps)`
    (FLA's)."""
    return _over_root(x, x.pow(2).sum(dim, keepdim=True), eps, root)


def l2_norm_in_fp32(x: torch.Tensor, eps, dim, dtype, *, root="rsqrt"):
    """The same on an fp32 copy, cast back (Dory's, nGPT's every norm)."""
    return l2_norm(x.to(torch.float32), eps, dim, root=root).to(dtype)


def l2_norm_no_eps(x: torch.Tensor, dim, *, root="vector_norm"):
    """x over its 2-norm, `x / x.norm(dim=-1, keepdim=True)` (BLIP's, ALIGN's, CLAP's embeddings),
    or the norm written out, `pow(sum(x^2), 0.5)` (CLIP's `_get_vector_norm`, its kin's) or `sqrt`."""
    if root == "vector_norm":
        return x / torch.linalg.vector_norm(x, 2, dim, True)
    squares = x.pow(2).sum(dim, keepdim=True)
    return x / (torch.pow(squares, 0.5) if root == "pow_half" else torch.sqrt(squares))


def l2_normalize(x: torch.Tensor, eps, dim, *, spelling="F.normalize"):
    """x over its 2-norm floored at eps, `F.normalize(x, dim=d, eps=e)`, or written out,
    `x / x.norm(dim=d, keepdim=True).clamp(min=e)` (`clamp_min(e)`, `torch.clamp(..., e)`)."""
    if spelling == "F.normalize":
        return F.normalize(x, 2.0, dim, eps, None)
    return x / torch.clamp_min(torch.linalg.vector_norm(x, 2, dim, True), eps)


def l2_normalize_in_fp32(x: torch.Tensor, eps, dim, dtype):
    """The same on an fp32 copy, cast back (`F.normalize(v.float(), dim=-1).to(dtype)`)."""
    return F.normalize(x.to(torch.float32), 2.0, dim, eps, None).to(dtype)


def l2_normalize_fused(x, eps, dim, width, moved, restore, scale_dtype, dtype=None, *, spelling=None):
    return _over_dim(functools.partial(_l2_normalize_as_rms_norm, like=x), x, width, moved, restore, eps,
                     scale_dtype)


def _l2_normalize_as_rms_norm(x, shape, eps, scale_dtype, like):
    """x / max(|x|, eps) over shape = (width,) is rms_norm(x, eps / sqrt(width), clamp_eps=True) /
    sqrt(width): the floor in rms units, the constant weight of `_l2_norm_as_rms_norm`."""
    width = shape[0]
    return ops.rms_norm(x, shape, _l2_constant(like, shape, scale_dtype), eps * width ** -0.5, clamp_eps=True)


def _l2_constant(like, shape, scale_dtype):
    """The L2 norm's constant weight 1 / sqrt(width), made from the model's x (`like`), not from
    the copy with its channels moved last: only the norm reads that copy, and the norm over the
    channels in place (`_CHANNELS_IN_PLACE`) can then drop it."""
    return like.new_full(shape, shape[0] ** -0.5, dtype=scale_dtype)


def _clamp_dtype(m: Match, in_fp32: bool) -> torch.dtype | None:
    """The dtype the model's clamp runs in: the result's (the norm's dtype sets it, fp32 under
    autocast), fp32 for a norm of an fp32 copy."""
    out = example_value(m.outputs[0])
    return torch.float32 if in_fp32 else out.dtype if isinstance(out, torch.Tensor) else None


def _l2_normalize_dim(m: Match, in_fp32: bool = False) -> dict | None:
    """`_l2_norm_dim`, and eps rounded to the dtype the model's clamp runs in (a constant; a
    number the graph computes runs in fp32 or fp64, `_eps_floors`, where the rounding is the
    tie's alone)."""
    dims, dtype = _l2_norm_dim(m), _clamp_dtype(m, in_fp32)
    if dims is None or dtype is None:
        return None
    eps = m["eps"]
    return {**dims, "eps": torch.tensor(eps, dtype=dtype).item()} if type(eps) in (int, float) else dims


def _eps_floors(in_fp32: bool = False):
    """eps is a number, at least 0 where written in the graph; one the graph computes (Dynamo's
    under `dynamic=True`) only where the clamp runs in fp32 or fp64: a 16-bit clamp rounds it
    (1e-12 to 0), which a floor computed at run time would not."""
    def check(m: Match) -> str | None:
        eps = m["eps"]
        if type(eps) in (int, float):
            return None if eps >= 0 else f"eps is {eps!r}, below 0"
        if not is_runtime_number(eps):
            return f"eps is {eps!r}, not a number"
        dtype = _clamp_dtype(m, in_fp32)
        if dtype not in (torch.float32, torch.float64):
            return f"eps is computed at run time and the clamp runs in {dtype} (which rounds it)"
        return None

    check.__name__ = "eps_floors"
    return check


def l2_normalize_then_weight(x: torch.Tensor, normalized_shape, scale: torch.Tensor, weight: torch.Tensor,
                             eps):
    """A weight multiplying `F.normalize` made an RMSNorm (`_l2_normalize_as_rms_norm`)."""
    return ops.rms_norm(x, normalized_shape, scale, eps, clamp_eps=True) * weight


def l2_normalize_weight_folded(x, normalized_shape, scale, weight, eps):
    return ops.rms_norm(x, normalized_shape, scale * weight, eps, clamp_eps=True)


def l2_norm_fused(x, dim, width, moved, restore, scale_dtype, eps=0.0, dtype=None, *, root=None):
    return _over_dim(functools.partial(_l2_norm_as_rms_norm, like=x), x, width, moved, restore, eps,
                     scale_dtype)


def _l2_norm_as_rms_norm(x, shape, eps, scale_dtype, like):
    """x / sqrt(sum(x^2) + eps) over shape = (width,) is the RMSNorm rms_norm(x, eps / width) /
    sqrt(width): the 1 / sqrt(width) a constant weight in fp32 (fp64 for an fp64 x) that the kernel
    multiplies in before its one rounding to x's dtype."""
    return ops.rms_norm(x, shape, _l2_constant(like, shape, scale_dtype), eps / shape[0])


def l2_norm_then_weight(x: torch.Tensor, normalized_shape, scale: torch.Tensor, weight: torch.Tensor, eps):
    """A weight multiplying an L2 norm made an RMSNorm (`_l2_norm_as_rms_norm`, its constant scale
    the norm's weight)."""
    return ops.rms_norm(x, normalized_shape, scale, eps) * weight


def l2_norm_weight_folded(x, normalized_shape, scale, weight, eps):
    return ops.rms_norm(x, normalized_shape, scale * weight, eps)


def _l2_scale(m: Match, name: str = "scale") -> str | None:
    """The norm's weight (`name`) is an L2 norm's constant scale (a tensor made in the graph, fp32
    or fp64: the weight after it joins it exactly, and the product is rounded once, by the
    kernel), or that scale times what the folds below multiplied into it."""
    scale, seen = m[name], 0
    while getattr(scale, "op", None) == "call_function" and scale.target is operator.mul and seen < 8:
        scale, seen = next((a for a in scale.args if _made_from_l2_scale(a)), None), seen + 1
    if not (getattr(scale, "op", None) == "call_method" and scale.target == "new_full"):
        return "the norm's weight is no L2 norm's scale"
    return None


def _made_from_l2_scale(node) -> bool:
    return getattr(node, "op", None) == "call_method" and node.target == "new_full" or \
        getattr(node, "op", None) == "call_function" and node.target is operator.mul


# What diffusers' video VAEs (Wan's, Qwen-Image's, HunyuanVideo 1.5's, Kandinsky 6's) write after
# their channel norm, `F.normalize(x, dim=1).to(x.dtype) * dim ** 0.5 * gamma + 0.0`, folds into
# the RMSNorm that the F.normalize became: the cast to the dtype y has already goes, the number
# and the weight laid along the channels join the constant scale, and adding a constant 0 goes
# (y is the norm's fresh tensor, so nothing aliases; -0.0 becomes 0.0, which no reader can tell).
# `clamp` picks F.normalize's RMSNorm (eps a floor) or the L2 norm's (eps added).


def _l2_rms_norm(x, normalized_shape, scale, eps, clamp):
    if clamp:
        return ops.rms_norm(x, normalized_shape, scale, eps, clamp_eps=True)
    return ops.rms_norm(x, normalized_shape, scale, eps)


def l2_rms_norm_cast(x: torch.Tensor, normalized_shape, scale: torch.Tensor, eps, dtype, *, clamp=False):
    return _l2_rms_norm(x, normalized_shape, scale, eps, clamp).to(dtype)


def l2_rms_norm_channels_cast(x: torch.Tensor, normalized_shape, scale: torch.Tensor, eps, dim, dtype, *,
                              clamp=False, restore=False):
    return _moved_back(_l2_rms_norm(x, normalized_shape, scale, eps, clamp), dim, restore).to(dtype)


def l2_rms_norm_cast_dropped(x, normalized_shape, scale, eps, dtype, *, clamp=False):
    return _l2_rms_norm(x, normalized_shape, scale, eps, clamp)


def l2_rms_norm_channels_cast_dropped(x, normalized_shape, scale, eps, dim, dtype, *, clamp=False,
                                      restore=False):
    return _moved_back(_l2_rms_norm(x, normalized_shape, scale, eps, clamp), dim, restore)


def l2_rms_norm_times_number(x: torch.Tensor, normalized_shape, scale: torch.Tensor, eps, number, *,
                             clamp=False):
    return _l2_rms_norm(x, normalized_shape, scale, eps, clamp) * number


def l2_rms_norm_channels_times_number(x: torch.Tensor, normalized_shape, scale: torch.Tensor, eps, dim,
                                      number, *, clamp=False, restore=False):
    return _moved_back(_l2_rms_norm(x, normalized_shape, scale, eps, clamp), dim, restore) * number


def l2_rms_norm_number_folded(x, normalized_shape, scale, eps, number, *, clamp=False):
    return _l2_rms_norm(x, normalized_shape, scale * number, eps, clamp)


def l2_rms_norm_channels_number_folded(x, normalized_shape, scale, eps, dim, number, *, clamp=False,
                                       restore=False):
    return _moved_back(_l2_rms_norm(x, normalized_shape, scale * number, eps, clamp), dim, restore)


def l2_rms_norm_channels_then_weight(x: torch.Tensor, normalized_shape, scale: torch.Tensor, eps, dim,
                                     weight: torch.Tensor, *, clamp=False, restore=False):
    return _moved_back(_l2_rms_norm(x, normalized_shape, scale, eps, clamp), dim, restore) * weight


def l2_rms_norm_channels_weight_folded(x, normalized_shape, scale, eps, dim, weight, *, clamp=False,
                                       restore=False):
    folded = scale * weight.reshape(normalized_shape)
    return _moved_back(_l2_rms_norm(x, normalized_shape, folded, eps, clamp), dim, restore)


def l2_rms_norm_plus_number(x: torch.Tensor, normalized_shape, scale: torch.Tensor, eps, number, *,
                            clamp=False):
    return _l2_rms_norm(x, normalized_shape, scale, eps, clamp) + number


def l2_rms_norm_channels_plus_number(x: torch.Tensor, normalized_shape, scale: torch.Tensor, eps, dim, number,
                                     *, clamp=False, restore=False):
    return _moved_back(_l2_rms_norm(x, normalized_shape, scale, eps, clamp), dim, restore) + number


def l2_rms_norm_zero_dropped(x, normalized_shape, scale, eps, number, *, clamp=False):
    return _l2_rms_norm(x, normalized_shape, scale, eps, clamp)


def l2_rms_norm_channels_zero_dropped(x, normalized_shape, scale, eps, dim, number, *, clamp=False,
                                      restore=False):
    return _moved_back(_l2_rms_norm(x, normalized_shape, scale, eps, clamp), dim, restore)


def _cast_is_no_op(m: Match) -> str | None:
    """The cast is to the dtype the norm's y has already (`.to` returns y itself)."""
    y = example_value(m.anchor.args[0]) if m.anchor.args else None
    if not isinstance(y, torch.Tensor):
        return "no dtype for the norm's result"
    return None if m["dtype"] == y.dtype else f"casts y from {y.dtype} to {m['dtype']}"


def _adds_zero(m: Match) -> str | None:
    number = m["number"]
    return None if type(number) in (int, float) and number == 0 else f"adds {number!r}, not the number 0"


def _static_width(m: Match) -> str | None:
    """The L2 norm's width is a number: its eps and scale are computed from it (a symbolic width,
    under `dynamic=True`, would be specialized)."""
    x, dim = m.value("x"), _single_dim(m["dim"])
    if isinstance(x, torch.Tensor) and dim is not None and -x.dim() <= dim < x.dim() \
            and not isinstance(x.shape[dim], int):
        return f"width {x.shape[dim]} is symbolic"
    return None


def _l2_norm_dim(m: Match) -> dict | None:
    """`_norm_dim`, and the dtype of the constant scale (`_l2_norm_as_rms_norm`)."""
    dims = _norm_dim(m)
    if dims is None:
        return None
    x = m.value("x")
    return {**dims, "scale_dtype": torch.float64 if x.dtype == torch.float64 else torch.float32}


def layer_norm_then_weight(x: torch.Tensor, normalized_shape, weight: torch.Tensor, eps):
    """A weight multiplying a fused LayerNorm that has none (what `layer_norm_bare` leaves)."""
    return ops.layer_norm(x, normalized_shape, None, None, eps) * weight


def layer_norm_weight_folded(x, normalized_shape, weight, eps):
    return ops.layer_norm(x, normalized_shape, weight, None, eps)


def layer_norm_then_bias(x: torch.Tensor, normalized_shape, weight, bias: torch.Tensor, eps):
    """A bias added to a fused LayerNorm that has none, with a weight or without."""
    return ops.layer_norm(x, normalized_shape, weight, None, eps) + bias


def layer_norm_bias_folded(x, normalized_shape, weight, bias, eps):
    return ops.layer_norm(x, normalized_shape, weight, bias, eps)


def rms_norm_then_weight(x: torch.Tensor, normalized_shape, weight: torch.Tensor, eps):
    return ops.rms_norm(x, normalized_shape, None, eps) * weight


def rms_norm_weight_folded(x, normalized_shape, weight, eps):
    return ops.rms_norm(x, normalized_shape, weight, eps)


# The same folds after a norm over a channels-first map's channels (`_over_dim`): its weight and bias
# broadcast over the map, `weight[:, None, None]` or `weight.reshape(1, -1, 1, 1)`; y moved back
# made contiguous (`restore`) or not, as the norm left it.


def layer_norm_channels_then_weight(x: torch.Tensor, normalized_shape, weight: torch.Tensor, eps, dim, *,
                                    restore=False):
    return _moved_back(ops.layer_norm(x, normalized_shape, None, None, eps), dim, restore) * weight


def layer_norm_channels_weight_folded(x, normalized_shape, weight, eps, dim, *, restore=False):
    y = ops.layer_norm(x, normalized_shape, weight.reshape(normalized_shape), None, eps)
    return _moved_back(y, dim, restore)


def layer_norm_channels_then_bias(x: torch.Tensor, normalized_shape, weight, bias: torch.Tensor, eps, dim, *,
                                  restore=False):
    return _moved_back(ops.layer_norm(x, normalized_shape, weight, None, eps), dim, restore) + bias


def layer_norm_channels_bias_folded(x, normalized_shape, weight, bias, eps, dim, *, restore=False):
    y = ops.layer_norm(x, normalized_shape, weight, bias.reshape(normalized_shape), eps)
    return _moved_back(y, dim, restore)


def rms_norm_channels_then_weight(x: torch.Tensor, normalized_shape, weight: torch.Tensor, eps, dim, *,
                                  restore=False):
    return _moved_back(ops.rms_norm(x, normalized_shape, None, eps), dim, restore) * weight


def rms_norm_channels_weight_folded(x, normalized_shape, weight, eps, dim, *, restore=False):
    return _moved_back(ops.rms_norm(x, normalized_shape, weight.reshape(normalized_shape), eps), dim, restore)


# Last of all: a norm over a channels-first map's channels, as `_over_dim` left it after the folds
# (x copied with its channels last, the row norm, y moved back and made contiguous), becomes the
# norm over the channels where they lie (kernels/channel_norm.py): neither copy is made. A
# channels-last map's (no copy either way, `restore` False) stays on the row kernels.


def layer_norm_moved(x: torch.Tensor, normalized_shape, weight, bias, eps, dim):
    y = ops.layer_norm(x.movedim(dim, -1).contiguous(), normalized_shape, weight, bias, eps)
    return y.movedim(-1, dim).contiguous()


def layer_norm_over_channels(x, normalized_shape, weight, bias, eps, dim):
    return ops.channel_norm(x, weight, bias, eps, dim=dim)


def rms_norm_moved(x: torch.Tensor, normalized_shape, weight, eps, dim, *, clamp=False):
    y = _l2_rms_norm(x.movedim(dim, -1).contiguous(), normalized_shape, weight, eps, clamp)
    return y.movedim(-1, dim).contiguous()


def rms_norm_over_channels(x, normalized_shape, weight, eps, dim, *, clamp=False):
    return ops.channel_norm(x, weight, None, eps, dim=dim, rms=True, clamp_eps=clamp)


# And a norm over the last dim of a permuted view whose last dim lies innermost in nothing (the
# row kernels would copy it first): ConvNeXt's blocks (`dwconv(x).permute(0, 2, 3, 1)` then
# LayerNorm), its and timm's LayerNorm2d (permute, F.layer_norm, permute back), wav2vec2's conv
# feature encoder (`x.transpose(-2, -1)` then LayerNorm). The view moved back is a contiguous map
# whose channels `channel_norm` reads where they lie; it writes y with them innermost, which moved
# last again is the contiguous tensor the row norm returned.


def layer_norm_of(x: torch.Tensor, normalized_shape, weight, bias, eps):
    return ops.layer_norm(x, normalized_shape, weight, bias, eps)


def layer_norm_over_permuted_channels(x, normalized_shape, weight, bias, eps, dim):
    y = ops.channel_norm(x.movedim(-1, dim), weight, bias, eps, dim=dim, y_channels_last=True)
    return y.movedim(dim, -1)


def rms_norm_of(x: torch.Tensor, normalized_shape, weight, eps, *, clamp=False):
    return _l2_rms_norm(x, normalized_shape, weight, eps, clamp)


def rms_norm_over_permuted_channels(x, normalized_shape, weight, eps, dim, *, clamp=False):
    y = ops.channel_norm(x.movedim(-1, dim), weight, None, eps, dim=dim, rms=True, clamp_eps=clamp,
                         y_channels_last=True)
    return y.movedim(dim, -1)


def layer_norm_upcast_div_sqrt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps, dtype):
    """Hugging Face's DebertaLayerNorm (DeBERTa v1): computed on an fp32 copy, the centred
    value (twice) divided by sqrt(variance + eps), cast back, then weight * h + bias."""
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) / torch.sqrt(variance + eps)
    return weight * h.to(dtype) + bias


def layer_norm_upcast_div_sqrt_fused(x, weight, bias, eps, dtype):
    return ops.layer_norm(x, weight.shape, weight, bias, eps)


def layer_norm_upcast_div_sqrt_weight_apart(x, weight, bias, eps, dtype):
    return weight * ops.layer_norm(x, weight.shape, None, None, eps) + bias


def rms_norm_t5(x: torch.Tensor, weight: torch.Tensor, eps):
    """Hugging Face's T5LayerNorm with an fp32 weight (no cast before the weight)."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rms_norm_t5_fused(x, weight, eps, upcast):
    # The model's result is fp32 whatever x's dtype: a 16-bit x is normalized as an exact fp32 copy.
    return ops.rms_norm(x.to(torch.float32) if upcast else x, weight.shape, weight, eps)


def rms_norm_t5_cast_back(x: torch.Tensor, weight: torch.Tensor, eps, dtype):
    """T5's form with the cast back after the weight (diffusers' MochiRMSNorm): a 16-bit weight
    joins the fp32 product exactly, so the model rounds once, as the op does."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (weight * (x * torch.rsqrt(variance + eps))).to(dtype)


def rms_norm_t5_half(x: torch.Tensor, weight: torch.Tensor, eps, dtype):
    """T5LayerNorm with a 16-bit weight (diffusers' RMSNorm too: Flux's, SD3's, Lumina's): the
    normalized value rounds to the weight's dtype first. With x in that dtype the weight joins the
    norm (rounded once, as Llama's); an fp32 x keeps the model's two steps (`_weight_apart`)."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps)).to(dtype)


def rms_norm_t5_half_fused(x, weight, eps, dtype):
    return ops.rms_norm(x, weight.shape, weight, eps)


def rms_norm_t5_half_weight_apart(x, weight, eps, dtype):
    return weight * ops.rms_norm(x, weight.shape, None, eps).to(dtype)


def rms_norm_in_fp32(x: torch.Tensor, normalized_shape, weight, eps, dtype):
    return ops.rms_norm(x.to(torch.float32), normalized_shape, weight, eps).to(dtype)


def rms_norm_in_fp32_fused(x, normalized_shape, weight, eps, dtype):
    return ops.rms_norm(x, normalized_shape, weight, eps)


def layer_norm_in_fp32(x: torch.Tensor, normalized_shape, weight, bias, eps, dtype):
    return ops.layer_norm(x.to(torch.float32), normalized_shape, weight, bias, eps).to(dtype)


def layer_norm_in_fp32_fused(x, normalized_shape, weight, bias, eps, dtype):
    return ops.layer_norm(x, normalized_shape, weight, bias, eps)


def _fp32_weight(m: Match) -> str | None:
    w = m.value("weight")
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return "weight: no 1-D tensor"
    return None if w.dtype == torch.float32 else f"weight dtype {w.dtype}, not float32 (the cast-first form)"


def _upcast_if_16_bit(m: Match) -> dict | None:
    x = m.value("x")
    return {"upcast": x.dtype != torch.float32} if isinstance(x, torch.Tensor) else None


def _rounds_to_half_weight(m: Match) -> str | None:
    w = m.value("weight")
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return "weight: no 1-D tensor"
    if m["dtype"] != w.dtype or w.dtype not in (torch.float16, torch.bfloat16):
        return f"casts to {m['dtype']}, not to the 16-bit weight's dtype {w.dtype}"
    return None


def _casts_back_to_input(m: Match) -> str | None:
    x = m.value("x")
    if not isinstance(x, torch.Tensor):
        return "no dtype for x"
    if m["dtype"] != x.dtype:
        return f"casts the result to {m['dtype']}, not to the input's {x.dtype}"
    return None


def _weight_dtype(same: bool):
    def check(m: Match) -> str | None:
        x, w = m.value("x"), m.value("weight")
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
            return "no dtype for x or weight"
        if w.dim() != 1:
            return f"weight has {w.dim()} dimensions, not 1"
        if (w.dtype == x.dtype) != same:
            return f"weight dtype {w.dtype} {'differs from' if same else 'equals'} input dtype {x.dtype}"
        return None

    check.__name__ = "weight_dtype_same" if same else "weight_dtype_differs"
    return check


def _bias_like_weight(m: Match) -> str | None:
    """The bias added after the weight: a tensor of the weight's shape and dtype."""
    w, b = m.value("weight"), m.value("bias")
    if not isinstance(b, torch.Tensor) or not isinstance(w, torch.Tensor):
        return "no tensor for the weight or the bias"
    if b.shape != w.shape or b.dtype != w.dtype:
        return f"bias {tuple(b.shape)} {b.dtype} is not shaped and typed like the weight {tuple(w.shape)} {w.dtype}"
    return None


def _single_dim(dim):
    """A reduction's dim as one int (`1`, `(1,)`, `[1]`), else None."""
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return dim if type(dim) is int else None


def _one_dim(m: Match) -> str | None:
    """The norm's statistics reduce over one dim of x (any: the last, or a map's channels)."""
    x, dim = m.value("x"), _single_dim(m["dim"])
    if dim is None:
        return f"reduces over dims {m['dim']!r}, not one dim"
    if not isinstance(x, torch.Tensor) or not -x.dim() <= dim < x.dim():
        return f"dim {dim} is no dim of x"
    return None


def _norm_dim(m: Match) -> dict | None:
    """The normalized width of a norm without a weight, x's size at the dim its statistics reduce;
    `moved`: None for the last dim, else that dim counted from the end (x's channels); `restore`:
    whether the result moved back must be made contiguous to lie as the model's (`_moved_back`)."""
    x, dim = m.value("x"), _single_dim(m["dim"])
    if not isinstance(x, torch.Tensor) or dim is None:
        return None
    d = dim % x.dim()
    moved = None if d == x.dim() - 1 else d - x.dim()
    restore = moved is not None and not x.movedim(moved, -1).is_contiguous()
    return {"dim": dim, "width": x.shape[d], "moved": moved, "restore": restore}


def _folds_as_affine(name: str):
    """The weight or bias after a fused norm joins it when it is what the norm's own would be: a
    1-D tensor over the normalized width (one dim), in x's dtype, so the product or sum neither
    broadcasts differently (a per-token scale, adaLN's) nor promotes."""
    def check(m: Match) -> str | None:
        x, p, shape = m.value("x"), m.value(name), m.value("normalized_shape")
        if not isinstance(x, torch.Tensor) or not isinstance(p, torch.Tensor):
            return f"no tensor for x or the {name}"
        if not isinstance(shape, (tuple, list)) or not all(isinstance(n, (int, torch.SymInt)) for n in shape):
            return "normalized_shape unknown"
        # compared without guards: a symbolic width (dynamic=True) must not be specialized here
        if len(shape) != 1 or p.dim() != 1 or not known_equal(p.shape[0], shape[0]):
            return f"{name} shaped {tuple(p.shape)}, not the normalized width {tuple(shape)} alone"
        return _affine_dtype_problem(m, name, x, p)

    check.__name__ = f"{name}_folds_as_affine"
    return check


def _affine_dtype_problem(m: Match, name: str, x: torch.Tensor, p: torch.Tensor) -> str | None:
    """Why a weight or bias `p` cannot join the norm for its dtype (it must be x's, and a bias the
    weight's), or None."""
    if p.dtype != x.dtype:
        return f"{name} dtype {p.dtype} differs from the input's {x.dtype} (the product promotes)"
    w = m.value("weight") if name == "bias" else None
    if isinstance(w, torch.Tensor) and w.dtype != p.dtype:
        return f"bias dtype {p.dtype} differs from the weight's {w.dtype}"
    return None


def _channels_of_x(m: Match) -> str | None:
    """The norm's width is x's size at `dim`, and x a map with more than that one dim (the
    channel norm's own checks, on the example values, see the rest)."""
    x, dim, shape = m.value("x"), m["dim"], m.value("normalized_shape")
    if not isinstance(x, torch.Tensor) or type(dim) is not int or x.dim() < 2:
        return "no map for x"
    if not -x.dim() <= dim < x.dim():
        return f"dim {dim} is no dim of x"
    if not isinstance(shape, (tuple, list)) or len(shape) != 1 or not known_equal(shape[0], x.shape[dim]):
        return f"normalized_shape {shape!r} is not x's size at dim {dim}"
    return None


def _permuted_channels(m: Match) -> dict | None:
    """{"dim": d}: x (the norm's input, normalized over its last dim) is a view of a contiguous
    tensor whose dim d that last dim was (`x.movedim(-1, d)` contiguous), its last dim not
    innermost; None otherwise (`_strided_last_dim` says why)."""
    x = m.value("x")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    if not all(type(v) is int for v in (*x.shape, *x.stride())):
        return None  # symbolic (dynamic=True): asking would guard on its sizes
    if x.stride(-1) == 1 or x.shape[-1] == 1:
        return None
    dim = next((d for d in range(x.dim() - 1) if x.movedim(-1, d).is_contiguous()), None)
    return None if dim is None else {"dim": dim}


def _strided_last_dim(m: Match) -> str | None:
    """The norm reads a permuted view of a contiguous map (`_permuted_channels`) over one dim, and
    its output is not cast (under autocast, to fp32 for the matmuls after it, a cast the row norm
    then drops by writing their dtype itself: fusion/narrow.py)."""
    shape = m.value("normalized_shape")
    if not isinstance(shape, (tuple, list)) or len(shape) != 1:
        return "normalized over more than one dim"
    if _permuted_channels(m) is None:
        return "x's last dim lies innermost (rows read in place), x is no permuted contiguous map or its " \
            "sizes are symbolic"
    norm = m.outputs[0]
    if any(u.op == "call_method" and u.target in ("to", "float", "type", "half", "bfloat16")
           or u.op == "call_function" and u.target is torch.Tensor.to for u in norm.users):
        return "its output is cast (the row norm narrows it for the matmuls after it)"
    return None


def _folds_over_channels(name: str):
    """`_folds_as_affine` after a norm over a channels-first map's channels: the weight or bias is
    the width's vector laid along the channel dim (C, 1, ..., 1), in x's dtype."""
    def check(m: Match) -> str | None:
        x, p, dim = m.value("x"), m.value(name), m["dim"]
        if not isinstance(x, torch.Tensor) or not isinstance(p, torch.Tensor) or type(dim) is not int:
            return f"no tensor for x or the {name}"
        rank = x.dim()
        along = [1] * rank
        along[dim % rank] = x.shape[-1]
        laid = [1] * (rank - p.dim()) + list(p.shape)
        if p.dim() > rank or not all(known_equal(a, b) for a, b in zip(laid, along)):
            return f"{name} shaped {tuple(p.shape)}, not the channels' vector {tuple(along)}"
        return _affine_dtype_problem(m, name, x, p)

    check.__name__ = f"{name}_folds_over_channels"
    return check


def _resolve_eps(m: Match) -> dict | None:
    """F.rms_norm's eps=None means the epsilon of the dtype PyTorch computes in (fp32's for 16-bit x):
    make it that number, so the residual stream (which takes a number) can absorb this norm later."""
    if m["eps"] is not None:
        return {}
    x = m.value("x")
    return {"eps": default_rms_eps(x.dtype)} if isinstance(x, torch.Tensor) else None


def _l2_tail_patterns(name: str, filters: tuple, folds: str, variants: tuple) -> tuple[Pattern, ...]:
    """One fold of an L2 norm's tail, `l2_normalize_<name>` (F.normalize's RMSNorm, `clamp`) and
    `l2_norm_<name>`, for each (search, replacement, options) over the last dim or the channels."""
    return tuple(Pattern(f"l2_{kind}_{name}", "rms_norm", functools.partial(search, **where, clamp=clamp),
                         functools.partial(replacement, **where, clamp=clamp), ("rms_norm",),
                         (_l2_scale, *filters), quiet=True, folds=folds)
                 for search, replacement, where in variants
                 for kind, clamp in (("normalize", True), ("norm", False)))


_L2_CASTS_DROPPED = _l2_tail_patterns("cast_dropped", (_cast_is_no_op,), "a cast to y's own dtype dropped", (
    (l2_rms_norm_cast, l2_rms_norm_cast_dropped, {}),
    (l2_rms_norm_channels_cast, l2_rms_norm_channels_cast_dropped, {"restore": False}),
    (l2_rms_norm_channels_cast, l2_rms_norm_channels_cast_dropped, {"restore": True})))
_L2_NUMBERS_FOLDED = _l2_tail_patterns("number_folded", (needs_number("number"),), "a number folded in", (
    (l2_rms_norm_times_number, l2_rms_norm_number_folded, {}),
    (l2_rms_norm_channels_times_number, l2_rms_norm_channels_number_folded, {"restore": False}),
    (l2_rms_norm_channels_times_number, l2_rms_norm_channels_number_folded, {"restore": True})))


_RMS_FILTERS = (needs_number("eps"),)

# (`Pattern.folds`: the report's note keeps the spellings and folds before it)
_IN_PLACE = "read over the channels where they lie"


def _weight_is_l2_scale(m: Match) -> str | None:
    return _l2_scale(m, "weight")


# Stage 3: after the residual stream, the adaptive norms and the biases (stages 1 and 2), which
# take a trifuse norm with what surrounds it into a larger op.
_CHANNELS_IN_PLACE = (
    Pattern("layer_norm_over_channels", "layer_norm", layer_norm_moved, layer_norm_over_channels,
            ("layer_norm", "channel_norm"), (_channels_of_x,), stage=3, quiet=True, folds=_IN_PLACE),
    Pattern("l2_norm_over_channels", "rms_norm", rms_norm_moved, rms_norm_over_channels,
            ("rms_norm", "channel_norm"), (_channels_of_x, _weight_is_l2_scale), stage=3, quiet=True,
            folds=_IN_PLACE),
    Pattern("rms_norm_over_channels", "rms_norm", rms_norm_moved, rms_norm_over_channels,
            ("rms_norm", "channel_norm"), (_channels_of_x,), stage=3, quiet=True, folds=_IN_PLACE),
    Pattern("l2_normalize_over_channels", "rms_norm", functools.partial(rms_norm_moved, clamp=True),
            functools.partial(rms_norm_over_channels, clamp=True), ("rms_norm", "channel_norm"),
            (_channels_of_x,), stage=3, quiet=True, folds=_IN_PLACE),
    Pattern("layer_norm_over_permuted_channels", "layer_norm", layer_norm_of,
            layer_norm_over_permuted_channels, ("layer_norm", "channel_norm"), (_strided_last_dim,), stage=3,
            derive=_permuted_channels, quiet=True, folds=_IN_PLACE),
    Pattern("l2_normalize_over_permuted_channels", "rms_norm", functools.partial(rms_norm_of, clamp=True),
            functools.partial(rms_norm_over_permuted_channels, clamp=True), ("rms_norm", "channel_norm"),
            (_strided_last_dim,), stage=3, derive=_permuted_channels, quiet=True, folds=_IN_PLACE),
    Pattern("rms_norm_over_permuted_channels", "rms_norm", rms_norm_of, rms_norm_over_permuted_channels,
            ("rms_norm", "channel_norm"), (_strided_last_dim,), stage=3, derive=_permuted_channels,
            quiet=True, folds=_IN_PLACE),
)


PATTERNS = (
    Pattern("layer_norm", "layer_norm", layer_norm, layer_norm_fused, ("layer_norm",),
            (needs_number("eps"),)),
    Pattern("rms_norm", "rms_norm", rms_norm, rms_norm_fused, ("rms_norm",), derive=_resolve_eps),
    Pattern("rms_norm_upcast", "rms_norm", rms_norm_upcast, rms_norm_upcast_fused, ("rms_norm",),
            (*_RMS_FILTERS, _casts_back_to_input, _weight_dtype(True))),
    Pattern("rms_norm_upcast_weight_apart", "rms_norm", rms_norm_upcast, rms_norm_upcast_weight_apart,
            ("rms_norm",), (*_RMS_FILTERS, _casts_back_to_input, _weight_dtype(False))),
    # Before RMSNorm written out, which would take the centred value for its x (right, but a pass more).
    Pattern("layer_norm_written_out", "layer_norm", layer_norm_written_out, layer_norm_written_out_fused,
            ("layer_norm",), (*_RMS_FILTERS, _weight_dtype(True))),
    Pattern("layer_norm_written_out_centred_once", "layer_norm", layer_norm_written_out_centred_once,
            layer_norm_written_out_fused, ("layer_norm",), (*_RMS_FILTERS, _weight_dtype(True))),
    # DeBERTa's LayerNorm (before the bare spellings, which would take its fp32 copy): the weight
    # and bias join the norm when they are in x's dtype
    Pattern("layer_norm_upcast_div_sqrt", "layer_norm", layer_norm_upcast_div_sqrt,
            layer_norm_upcast_div_sqrt_fused, ("layer_norm",),
            (*_RMS_FILTERS, _casts_back_to_input, _weight_dtype(True), _bias_like_weight)),
    Pattern("layer_norm_upcast_div_sqrt_weight_apart", "layer_norm", layer_norm_upcast_div_sqrt,
            layer_norm_upcast_div_sqrt_weight_apart, ("layer_norm",),
            (*_RMS_FILTERS, _casts_back_to_input, _weight_dtype(False), _bias_like_weight)),
    Pattern("rms_norm_written_out", "rms_norm", rms_norm_written_out, rms_norm_written_out_fused,
            ("rms_norm",), (*_RMS_FILTERS, _weight_dtype(True))),
    Pattern("rms_norm_written_out_weight_apart", "rms_norm", rms_norm_written_out,
            rms_norm_written_out_weight_apart, ("rms_norm",), (*_RMS_FILTERS, _weight_dtype(False))),
    Pattern("rms_norm_written_out_pow", "rms_norm", rms_norm_written_out_pow, rms_norm_written_out_fused,
            ("rms_norm",), (*_RMS_FILTERS, _weight_dtype(True))),
    Pattern("rms_norm_written_out_pow_weight_apart", "rms_norm", rms_norm_written_out_pow,
            rms_norm_written_out_weight_apart, ("rms_norm",), (*_RMS_FILTERS, _weight_dtype(False))),
    # After the spellings with a weight, which hold it; LayerNorm before RMSNorm, which would take
    # the centred value for its x.
    *(Pattern(f"layer_norm_bare_{variance}_{root}", "layer_norm",
              functools.partial(layer_norm_bare, variance=variance, root=root),
              functools.partial(layer_norm_bare_fused, variance=variance, root=root), ("layer_norm",),
              (*_RMS_FILTERS, _one_dim), derive=_norm_dim)
      for variance in ("centred_twice", "centred_once", "var", "var_mean") for root in ("rsqrt", "div_sqrt")),
    Pattern("rms_norm_written_out_no_weight", "rms_norm", rms_norm_written_out_no_weight,
            rms_norm_no_weight_fused, ("rms_norm",), (*_RMS_FILTERS, _one_dim), derive=_norm_dim),
    Pattern("rms_norm_written_out_pow_no_weight", "rms_norm", rms_norm_written_out_pow_no_weight,
            rms_norm_no_weight_fused, ("rms_norm",), (*_RMS_FILTERS, _one_dim), derive=_norm_dim),
    Pattern("rms_norm_div_sqrt_no_weight", "rms_norm", rms_norm_div_sqrt_no_weight, rms_norm_no_weight_fused,
            ("rms_norm",), (*_RMS_FILTERS, _one_dim), derive=_norm_dim),
    # L2 norms: the fp32 copy's first (the other would take the copy for x, a pass more)
    *(Pattern(f"l2_norm_{root}{'_in_fp32' if in_fp32 else ''}", "rms_norm",
              functools.partial(l2_norm_in_fp32 if in_fp32 else l2_norm, root=root),
              functools.partial(l2_norm_fused, root=root), ("rms_norm",),
              (*_RMS_FILTERS, _one_dim, _static_width, *((_casts_back_to_input,) if in_fp32 else ())),
              derive=_l2_norm_dim)
      for in_fp32 in (True, False) for root in ("rsqrt", "div_sqrt")),
    *(Pattern("l2_norm_no_eps" if root == "vector_norm" else f"l2_norm_no_eps_{root}", "rms_norm",
              functools.partial(l2_norm_no_eps, root=root), l2_norm_fused, ("rms_norm",),
              (_one_dim, _static_width), derive=_l2_norm_dim)
      for root in ("vector_norm", "pow_half", "sqrt")),
    # F.normalize (the fp32 copy's first, as above), and its arithmetic written out
    Pattern("l2_normalize_in_fp32", "rms_norm", l2_normalize_in_fp32, l2_normalize_fused, ("rms_norm",),
            (_one_dim, _static_width, _eps_floors(in_fp32=True), _casts_back_to_input),
            derive=functools.partial(_l2_normalize_dim, in_fp32=True)),
    *(Pattern("l2_normalize" if spelling == "F.normalize" else "l2_normalize_written_out", "rms_norm",
              functools.partial(l2_normalize, spelling=spelling),
              functools.partial(l2_normalize_fused, spelling=spelling), ("rms_norm",),
              (_one_dim, _static_width, _eps_floors()), derive=_l2_normalize_dim)
      for spelling in ("F.normalize", "clamp")),
    # Before T5's, whose match would leave the cast back apart
    Pattern("rms_norm_t5_cast_back", "rms_norm", rms_norm_t5_cast_back, rms_norm_t5_half_fused, ("rms_norm",),
            (*_RMS_FILTERS, _casts_back_to_input, params_fp32_or_like_input)),
    Pattern("rms_norm_t5", "rms_norm", rms_norm_t5, rms_norm_t5_fused, ("rms_norm",),
            (*_RMS_FILTERS, _fp32_weight), derive=_upcast_if_16_bit),
    Pattern("rms_norm_t5_half", "rms_norm", rms_norm_t5_half, rms_norm_t5_half_fused, ("rms_norm",),
            (*_RMS_FILTERS, _rounds_to_half_weight, _casts_back_to_input)),
    Pattern("rms_norm_t5_half_weight_apart", "rms_norm", rms_norm_t5_half, rms_norm_t5_half_weight_apart,
            ("rms_norm",), (*_RMS_FILTERS, _rounds_to_half_weight)),
    # After T5's (the same mean square of an fp32 copy, its weight in the pattern)
    Pattern("rms_norm_variance_upcast_no_weight", "rms_norm", rms_norm_variance_upcast_no_weight,
            rms_norm_variance_upcast_no_weight_fused, ("rms_norm",),
            (*_RMS_FILTERS, _casts_back_to_input, _one_dim), derive=_norm_dim),
    # After the spellings above: the norm of an fp32 copy, cast back, is the norm of x.
    Pattern("rms_norm_in_fp32", "rms_norm", rms_norm_in_fp32, rms_norm_in_fp32_fused, ("rms_norm",),
            (*_RMS_FILTERS, _casts_back_to_input, params_fp32_or_like_input)),
    Pattern("layer_norm_in_fp32", "layer_norm", layer_norm_in_fp32, layer_norm_in_fp32_fused, ("layer_norm",),
            (needs_number("eps"), _casts_back_to_input, params_fp32_or_like_input)),
    # Last: a weight, then a bias, after a fused norm without them (what the spellings above leave
    # of `w * norm(x) + b` written out). Quiet: most products and sums are no norm's affine.
    Pattern("layer_norm_weight_folded", "layer_norm", layer_norm_then_weight, layer_norm_weight_folded,
            ("layer_norm",), (_folds_as_affine("weight"),), quiet=True, folds="weight"),
    Pattern("layer_norm_bias_folded", "layer_norm", layer_norm_then_bias, layer_norm_bias_folded,
            ("layer_norm",), (_folds_as_affine("bias"),), quiet=True, folds="bias"),
    Pattern("rms_norm_weight_folded", "rms_norm", rms_norm_then_weight, rms_norm_weight_folded,
            ("rms_norm",), (_folds_as_affine("weight"),), quiet=True, folds="weight"),
    # The tails of L2 norms (`_l2_rms_norm`): first a cast to y's dtype, then a number and the
    # weight (over the last dim or a map's channels) in either order, then adding 0.
    *_L2_CASTS_DROPPED,
    *_L2_NUMBERS_FOLDED,
    *_l2_tail_patterns("channels_weight_folded", (_folds_over_channels("weight"),), "weight", (
        (l2_rms_norm_channels_then_weight, l2_rms_norm_channels_weight_folded, {"restore": False}),
        (l2_rms_norm_channels_then_weight, l2_rms_norm_channels_weight_folded, {"restore": True}))),
    Pattern("l2_norm_weight_folded", "rms_norm", l2_norm_then_weight, l2_norm_weight_folded, ("rms_norm",),
            (_l2_scale, _folds_as_affine("weight")), quiet=True, folds="weight"),
    Pattern("l2_normalize_weight_folded", "rms_norm", l2_normalize_then_weight, l2_normalize_weight_folded,
            ("rms_norm",), (_l2_scale, _folds_as_affine("weight")), quiet=True, folds="weight"),
    *_L2_NUMBERS_FOLDED,  # after the weight (lucidrains' `F.normalize(x, dim=-1) * self.g * self.scale`)
    *(Pattern(name, family, functools.partial(search, restore=restore),
              functools.partial(replacement, restore=restore), (family,), (_folds_over_channels(folds),),
              quiet=True, folds=folds)
      for restore in (False, True)
      for name, family, search, replacement, folds in (
          ("layer_norm_channels_weight_folded", "layer_norm", layer_norm_channels_then_weight,
           layer_norm_channels_weight_folded, "weight"),
          ("layer_norm_channels_bias_folded", "layer_norm", layer_norm_channels_then_bias,
           layer_norm_channels_bias_folded, "bias"),
          ("rms_norm_channels_weight_folded", "rms_norm", rms_norm_channels_then_weight,
           rms_norm_channels_weight_folded, "weight"))),
    *_l2_tail_patterns("zero_dropped", (_adds_zero,), "an added 0 dropped", (
        (l2_rms_norm_plus_number, l2_rms_norm_zero_dropped, {}),
        (l2_rms_norm_channels_plus_number, l2_rms_norm_channels_zero_dropped, {"restore": False}),
        (l2_rms_norm_channels_plus_number, l2_rms_norm_channels_zero_dropped, {"restore": True}))),
    *_CHANNELS_IN_PLACE,
)
