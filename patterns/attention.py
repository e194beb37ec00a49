"""Attention, in the spellings models use, becoming `trifuse.ops.attention` (FlashAttention-2
style: the score matrix never exists).

- `F.scaled_dot_product_attention` with all its arguments (mask, dropout, causal, scale, GQA),
  and with K and V repeated per query group first (`repeat_interleave`, or Llama's
  `expand` + `reshape`), which becomes `enable_gqa=True` on the un-repeated K and V.
- The explicit chain `softmax(q @ k^T * scale [+ mask]) [-> dropout] @ v`: scale as a multiply
  or a divide, the mask added, or applied with `masked_fill(mask, -inf)` (nanoGPT's causal
  buffer), the softmax optionally computed in fp32 and cast back (Hugging Face's eager code).
  Each combination is one pattern built from `attention_chain` below.
- `F.multi_head_attention_forward` as `nn.MultiheadAttention` (and so nn.TransformerEncoder)
  calls it for self-attention without returned weights: its in-projection, heads and
  out-projection stay as matmuls around the fused attention.

Dropout keeps its p and is off when the model's training flag is off, as in the model. A
`masked_fill` with a value other than -inf is not a mask (a fully masked row would differ) and is
left alone, and so is a scale given as a tensor (the op takes a number).
"""
import functools
import itertools

import torch
import torch.nn.functional as F

from ._base import Match, Pattern, is_number, needs_bool, needs_number, ops


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


def sdpa_fused(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return ops.attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def sdpa_repeat_interleave_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep, attn_mask, dropout_p,
                              is_causal, scale):
    k = torch.repeat_interleave(k, n_rep, 1)
    v = torch.repeat_interleave(v, n_rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)


def sdpa_expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_shape, v_shape, k_heads, v_heads,
                   attn_mask, dropout_p, is_causal, scale):
    """Llama's repeat_kv: (B, Hkv, S, D) -> (B, Hkv, n_rep, S, D) -> (B, Hkv * n_rep, S, D)."""
    k = k[:, :, None, :, :].expand(k_shape).reshape(k_heads)
    v = v[:, :, None, :, :].expand(v_shape).reshape(v_heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)


def sdpa_gqa_fused(q, k, v, attn_mask, dropout_p, is_causal, scale, n_rep=None, k_shape=None, v_shape=None,
                   k_heads=None, v_heads=None):
    return ops.attention(q, k, v, attn_mask, dropout_p, is_causal, scale, True)


def attention_chain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale, mask: torch.Tensor,
                    p, training, dtype, *, scaling: str, masking: str, dropout: bool, upcast: bool):
    """softmax(q @ k^T scaled [masked]) [dropped out] @ v, in the spelling the keywords choose."""
    s = torch.matmul(q, k.transpose(d0, d1))
    s = s * scale if scaling == "mul" else s / scale
    if masking == "add":
        s = s + mask
    elif masking == "masked_fill":
        s = s.masked_fill(mask, float("-inf"))
    a = torch.softmax(s, -1, torch.float32).to(dtype) if upcast else torch.softmax(s, -1)
    if dropout:
        a = F.dropout(a, p, training, False)
    return torch.matmul(a, v)


def attention_chain_fused(q, k, v, d0, d1, scale, mask=None, p=0.0, training=False, dtype=None, *,
                          scaling: str, masking: str, dropout: bool, upcast: bool):
    if masking == "masked_fill":
        mask = torch.logical_not(mask)  # masked_fill marks what to drop, an attention mask what to keep
    return ops.attention(q, k, v, mask, p if training else 0.0, False, scale if scaling == "mul" else 1.0 / scale)


def _transposes_last_two(m: Match) -> str | None:
    k = m.value("k")
    if not isinstance(k, torch.Tensor):
        return "no shape for k"
    dims = sorted(d % k.dim() for d in (m["d0"], m["d1"]))
    return None if dims == [k.dim() - 2, k.dim() - 1] else f"transposes dims {m['d0']}, {m['d1']} of k, not the last two"


def _scale_is_number(m: Match) -> str | None:
    s = m["scale"]
    if isinstance(s, torch.fx.Node) and isinstance(m.value("scale"), torch.Tensor):
        return "the scale is a tensor"
    return None


def _casts_back_to_q(m: Match) -> str | None:
    q = m.value("q")
    if isinstance(q, torch.Tensor) and m["dtype"] != q.dtype:
        return f"casts the probabilities to {m['dtype']}, not to q's {q.dtype}"
    return None


def _chain_pattern(scaling: str, masking: str, dropout: bool, upcast: bool) -> Pattern:
    opts = {"scaling": scaling, "masking": masking, "dropout": dropout, "upcast": upcast}
    name = "_".join(["attention_chain", scaling, masking or "no_mask", "dropout" if dropout else "no_dropout",
                     *(["upcast"] if upcast else [])])
    filters = [_transposes_last_two, _scale_is_number]
    if dropout:
        filters += [needs_number("p"), needs_bool("training")]
    if upcast:
        filters.append(_casts_back_to_q)
    return Pattern(name, "attention", functools.partial(attention_chain, **opts),
                   functools.partial(attention_chain_fused, **opts), ("attention",), tuple(filters))


def self_attention_mha(x: torch.Tensor, embed_dim, num_heads, in_w: torch.Tensor, in_b, dropout_p,
                       out_w: torch.Tensor, out_b, training, average_attn_weights, key_padding_mask, attn_mask,
                       is_causal):
    """nn.MultiheadAttention's functional core, self-attention, no returned weights."""
    return F.multi_head_attention_forward(
        x, x, x, embed_dim, num_heads, in_w, in_b, None, None, False, dropout_p, out_w, out_b, training,
        key_padding_mask, False, attn_mask, False, None, None, None, None, None, average_attn_weights, is_causal)[0]


def self_attention_mha_fused(x, embed_dim, num_heads, in_w, in_b, dropout_p, out_w, out_b, training,
                             average_attn_weights, key_padding_mask, attn_mask, is_causal):
    seq, batch, _ = x.shape
    head_dim = embed_dim // num_heads
    qkv = F.linear(x, in_w, in_b).view(seq, batch, 3, num_heads, head_dim)
    q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # each (batch, heads, seq, head_dim)
    mask = None if key_padding_mask is None else key_padding_mask.view(batch, 1, 1, seq)
    o = ops.attention(q, k, v, mask, dropout_p if training else 0.0, is_causal)
    o = o.permute(2, 0, 1, 3).reshape(seq, batch, embed_dim)
    return F.linear(o, out_w, out_b)


def _mha_masks(m: Match) -> str | None:
    kpm, mask, causal = m["key_padding_mask"], m["attn_mask"], m["is_causal"]
    if not isinstance(causal, bool):
        return "is_causal is not a constant"
    if mask is not None and not causal:
        return "an explicit attn_mask (only the causal hint or none is fused)"
    if mask is None and causal:
        return "is_causal without a mask (nn.MultiheadAttention raises on it)"
    if mask is not None and kpm is not None:
        return "a causal mask together with a key padding mask"
    if kpm is not None:
        v = m.value("key_padding_mask")
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            return "the key padding mask is not a float (additive) mask"
    if not is_number(m["embed_dim"]) or not is_number(m["num_heads"]):
        return "embed_dim / num_heads are not constants"
    return None


# The grouped-KV spellings come before plain SDPA, which would otherwise take the repeated K and V.
PATTERNS = (
    Pattern("sdpa_repeat_interleave_kv", "attention", sdpa_repeat_interleave_kv, sdpa_gqa_fused, ("attention",),
            (needs_number("dropout_p", "n_rep"), needs_bool("is_causal"))),
    Pattern("sdpa_expand_kv", "attention", sdpa_expand_kv, sdpa_gqa_fused, ("attention",),
            (needs_number("dropout_p"), needs_bool("is_causal"))),
    Pattern("sdpa", "attention", sdpa, sdpa_fused, ("attention",),
            (needs_number("dropout_p"), needs_bool("is_causal", "enable_gqa"))),
    *(_chain_pattern(*opts) for opts in itertools.product(
        ("mul", "div"), ("add", "masked_fill", ""), (True, False), (False, True))),
    Pattern("self_attention_mha", "attention", self_attention_mha, self_attention_mha_fused, ("attention",),
            (needs_number("dropout_p"), needs_bool("training"), _mha_masks)),
)
