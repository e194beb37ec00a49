"""Attention, in the spellings models use, becoming `trifuse.ops.attention` (FlashAttention-2
style: the score matrix never exists).

- `F.scaled_dot_product_attention` with all its arguments (mask, dropout, causal, scale, GQA;
  K and V of one head broadcast over the query heads, Falcon's multi-query attention, as GQA),
  and with K and V repeated per query group first (`repeat_interleave`, or Llama's
  `expand` + `reshape`, torchtune's and gpt-fast's `unsqueeze(2)` + `expand` + `flatten(1, 2)`;
  or torchtitan's `unsqueeze` + `expand` + `reshape` on (B, S, H, D) before the heads move), which
  becomes `enable_gqa=True` on the un-repeated K and V. SDPA's other ranks too: unbatched (H, S,
  D) tensors (the op's batch of one), and extra batch dims (timm's Hiera: (B, heads, windows, S,
  D)), flattened into the op's batch with the mask.
- The explicit chain `softmax(q @ k^T * scale [+ mask]) [-> dropout] @ v`: scale as a multiply
  or a divide, the mask added, or applied with `masked_fill(mask, fill)` (nanoGPT's causal
  buffer: True = drop) or `torch.where(mask, scores, fill)` (True = keep), the softmax optionally
  computed in fp32 and cast back (Hugging Face's eager code) or followed by a plain cast to the
  value's dtype (`.type(value.dtype)`, transformers' GPT-2 eager code; or after the dropout,
  BigBird-Pegasus's decoder; a no-op, as the filter requires). Each combination is one pattern
  built from `attention_chain` below. Gemma 2's logit soft cap between the scaling and the mask
  (`tanh(s / cap) * cap`) becomes the op's `softcap`. A key laid out as k^T already, multiplied
  without a transpose (SqueezeBERT's (B, H, D, S) view of its key convolution), is the op's key
  transposed back, a view; with it, v and the output channels first, `v @ P^T` on (B, C, N) maps
  (timm's iFormer written out), the op's v and output transposed, views. MViT's relative
  positions, written into a slice of the scores in place (timm's and torchvision's), reach these
  patterns as a mask added (fusion/normalize.py); so do SAM's and ViTDet's decomposed ones, added
  over a view of the scores (transformers' SegGPT and VitDet).
  transformers' eager_attention_forward (fp32 softmax, dropout) on K and V repeated per query
  group by `repeat_kv` becomes the op with `enable_gqa=True` on the un-repeated K and V.
  Hand-written decoders that keep a causal mask and take a padding mask apply the first by
  `masked_fill` or `where` with a constant fill and add the second after (nanoGPT's attention with
  padding): the op's mask is the padding where a key is kept, fill + padding where not
  (`attention_chain_fill_add`, as GPT-Neo's below).
- gpt-oss's eager attention with attention sinks: the scaled scores (+ the additive mask, a
  sliding window's too), one learned logit per head concatenated as a last column
  (`sinks.reshape(1, -1, 1, 1).expand(B, -1, Sq, -1)`), the row max subtracted (a no-op for the
  softmax: the sink keeps every row's max finite), the softmax, the sink's column dropped
  (`probs[..., :-1]`), dropout, the cast to v's dtype, `@ v`; over repeat_kv or not. It becomes the
  op's `sinks`. A row the mask covers whole gives 0 there as unfused (the sink takes its weight).
  MiMo-V2-Flash's layers without sinks write the same chain without the column (the row max still
  subtracted: softmax and its gradient are shift-invariant): the op without sinks. Flint writes
  the sinks' chain on q and k cast to fp32 (with autocast off), without the row max, the cast to
  v's dtype before the dropout: the op on q and k uncast.
- Granite's sliding-window attention sinks (granite_swa, granitemoe_swa): the softmax without the
  sink (fp32, cast back), dropout, `@ v` (over repeat_kv or not), the output then scaled per row by
  `sigmoid(logsumexp(scores, -1) - sinks.view(1, -1, 1))` (cast to fp32, then to the output's
  dtype). sigmoid(L - s_h) = sum_j exp(S_ij) / (exp(s_h) + sum_j exp(S_ij)), so the scaled row is
  the op's P with the sink in its denominator, and dropout commutes with the row scale: the op's
  `sinks`. (16-bit models compute that log-sum-exp in the scores' dtype; the op in fp32.)
- BART's older eager attention on (B*H, S, D) tensors (TrOCR, MVP, LED's decoder): `bmm(q, k^T)`
  with q already scaled (the op's scale is 1), the scores viewed as (B, H, Sq, Sk) with a constant
  H for the additive mask and back (only with a mask), softmax, dropout, `bmm` with v; self- or
  cross-attention. The op runs on (B, H, S, D) views (without a mask, H = 1: the heads do not
  matter). These blocks return the probabilities only with output_attentions (None otherwise).
  XGLM's writes the same chain with the masked scores clamped from below,
  `torch.max(scores + mask, torch.full((), finfo(dtype).min))`: the op takes the mask clamped
  instead (the same scores; a row masked whole, -inf or finfo.min, uniform as unfused), except with
  fp16 scores, whose sum overflows to -inf before the clamp where the op's fp32 sum does not.
- DeBERTa-v2's (and v3's) disentangled attention, on (B*H, S, D) tensors: `bmm(q, k^T / scale)`
  with the scale a 0-d tensor, its relative-position scores (c2p + p2c, computed before from q,
  k and the position embeddings) added, viewed as (B, H, S, S), `masked_fill(~mask, finfo.min)`,
  softmax, dropout, `bmm` with v. The position scores become the op's float mask (their gradient
  is its dMask), -inf where the bool mask drops a key; k is divided by the scale as written.
  Without relative attention the same chain without the add. A query row masked whole (DeBERTa
  masks padding queries too) is uniform before dropout in the unfused code: the replacement gives
  it a zero query and an open mask, so the op computes the same, dropout included.
- DeBERTa's (v1) on (B, H, S, D) tensors: q divided by the scale before `matmul(q, k^T)` (the op
  takes the divided q, scale 1), the relative-position scores added (`+ 0` without relative
  attention), then as DeBERTa-v2 from the masked_fill on. Its relative positions slice the
  position embeddings by a 0-d tensor (`.item()`): Dynamo captures keep it in the graph
  (fusion/capture.py), where a graph break would split the chain in two.
- The older Hugging Face spellings: BLOOM's ALiBi added by `alibi.baddbmm(q, k^T, beta, alpha)`
  on (B*H, S, D) tensors (the bias and the additive mask become the op's float mask, alpha its
  scale); CodeGen's additive mask before the scaling, `(q k^T + mask) / scale` (the op's mask is
  mask / scale); MPT's ALiBi added to the scaled scores before `masked_fill(mask, finfo.min)` and a
  softmax of an fp32 copy (`.float()`); MPNet's relative position bias and additive mask added one
  after the other to the divided scores (the op's mask is their sum; under autocast the fp32 bias
  and mask beside 16-bit q too, the in-place `+=` rounding its sum to 16 bits, which the op's fp32
  scores never are; Switch Transformers' and LongT5's the same with `* scale`); GPT-Neo's
  unscaled scores (scale 1) under `torch.where(causal, scores, torch.tensor(finfo.min))` with the
  additive mask added after (the op's mask is the mask where causal keeps a key, fill + mask where
  not: the same scores, the huge fill absorbing q k^T; a row the where() drops whole, which GPT-Neo's causal masks never do, has the
  op's finite-mask gradients). GPT-J, CodeGen and GPT-Neo cast q and k to fp32 before the
  product: in 16-bit models the op takes them uncast (its scores are fp32 whatever their dtype),
  where q, k and v share a dtype. Their blocks return the probabilities too: fusion/capture.py drops them from
  the graph's outputs when the block is called with output_attentions=False.
- `F.multi_head_attention_forward`, self- and cross-attention, as `nn.MultiheadAttention` (and so
  nn.TransformerEncoder / Decoder) calls it and as WavLM calls it itself, and on a query, key and
  value of their own (DETR's and Mask2Former's decoders add positions to the query and key only):
  projection weights packed or separate (q, k, v), an attn_mask (2-D, or per batch and head:
  WavLM's gated relative position bias, which gets its gradient; Mask2Former's boolean mask per
  query) and a key padding mask, each boolean or additive; with need_weights
  (nn.MultiheadAttention's default) when the weights go unused. The in-projections, heads and
  out-projection stay as matmuls around the fused attention.

Dropout keeps its p and is off when the model's training flag is off, as in the model.

The fill of `masked_fill` / `where` is -inf or the scores' `torch.finfo(dtype).min` (transformers'
value). With either, a row the mask leaves partly open is exactly the bool-masked softmax
(exp(min - max) underflows to 0). A row masked whole differs: with -inf the unfused softmax gives
NaN and the op gives 0 (SDPA's rule; as for every -inf mask trifuse fuses), while with finfo.min
every score of the row is the same number, so the unfused softmax is uniform and the output the
mean of V over the keys: the replacement puts exactly that into those rows (its gradient goes to V
only, as in the unfused code). Under active dropout that uniform row would be dropped out too,
which the replacement does not draw, so a finfo.min fill with dropout on is left; so is any other
finite fill (-1e4, -1e9: whether a partly open row underflows depends on the scores), and a scale
given as a tensor (the op takes a number).
"""
import functools
import itertools

import torch
import torch.nn.functional as F

from ._base import Filter, Match, Pattern, is_number, needs_bool, needs_number, ops


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


def sdpa_fused(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dims=4, mask_dims=None,
               mask_expand=False):
    if dims == 4:
        return ops.attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if dims == 3:  # (heads, seq, dim): SDPA's unbatched call, the op's batch of one
        mask = attn_mask[(None,) * (4 - mask_dims)] if mask_dims is not None else None
        return ops.attention(q[None], k[None], v[None], mask, dropout_p, is_causal, scale, enable_gqa)[0]
    # (..., heads, seq, dim), SDPA's extra batch dims (timm's Hiera: (batch, heads, windows, seq,
    # dim)): flattened into the op's batch, the mask with them
    flat = [t.flatten(0, dims - 4) for t in (q, k, v)]
    mask = _flat_mask(attn_mask, q, dims - 3, mask_dims, mask_expand) if mask_dims is not None else None
    o = ops.attention(*flat, mask, dropout_p, is_causal, scale, enable_gqa)
    return o.reshape(q.shape[:-1] + (v.shape[-1],))


def _sdpa_dims(m: Match) -> str | None:
    """q, k and v of one rank, 3 (SDPA's unbatched (heads, seq, dim)) or more; other than 4, one
    shape before their heads, and a mask, if any, that broadcasts to the scores without widening
    them."""
    q, k, v = m.value("q"), m.value("k"), m.value("v")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "no shapes for q, k or v"
    if not q.dim() == k.dim() == v.dim() or q.dim() < 3:
        return f"q, k and v have {q.dim()}, {k.dim()} and {v.dim()} dims, not all alike and at least 3"
    if q.dim() == 4:
        return None
    if not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        return f"q, k and v differ before their heads: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    mask = m.value("attn_mask")
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        return "no shape for the mask"
    return _broadcast_to_scores("the mask", mask.shape, tuple(q.shape[:-1]) + (k.shape[-2],))


def _mask_layout(mask, dims: int) -> dict:
    """For a mask over scores of `dims` other than 4, the constants the replacement reshapes it by:
    its rank, and whether it varies along the dims flattened into the op's batch (then expanded
    there: _flat_mask)."""
    if dims == 4 or not isinstance(mask, torch.Tensor):
        return {}
    padded = (1,) * (dims - mask.dim()) + tuple(mask.shape)
    lead = padded[:max(dims - 3, 0)]  # its sizes over q's dims before (H, S, D)
    return {"mask_dims": mask.dim(), "mask_expand": any(n != 1 for n in lead)}


def _sdpa_layout(m: Match) -> dict:
    """The replacement's constants: q's rank and its mask's layout (_sdpa_dims has checked them);
    and, as SDPA broadcasts K and V of one head over the query heads (Falcon's multi-query
    attention passes them so, without enable_gqa), grouped-query attention with one group."""
    q, k, v = m.value("q"), m.value("k"), m.value("v")
    dims = q.dim() if isinstance(q, torch.Tensor) else 4
    out = {"dims": dims, **_mask_layout(m.value("attn_mask"), dims)}
    if m["enable_gqa"] is False and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)) \
            and k.shape[1] == 1 and v.shape[1] == 1 and q.shape[1] != 1:
        out["enable_gqa"] = True
    return out


def sdpa_repeat_interleave_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep, attn_mask, dropout_p,
                              is_causal, scale):
    k = torch.repeat_interleave(k, n_rep, 1)
    v = torch.repeat_interleave(v, n_rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)


def _repeat_kv(x: torch.Tensor, shape, heads) -> torch.Tensor:
    """transformers' repeat_kv as it writes it: (B, Hkv, S, D) -> (B, Hkv, n_rep, S, D) -> (B, Hkv *
    n_rep, S, D), `shape` and `heads` the pattern's parameters (checked by _kv_repeated_over_heads)."""
    return x[:, :, None, :, :].expand(shape).reshape(heads)


def sdpa_expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_shape, v_shape, k_heads, v_heads,
                   attn_mask, dropout_p, is_causal, scale):
    """Llama's repeat_kv: (B, Hkv, S, D) -> (B, Hkv, n_rep, S, D) -> (B, Hkv * n_rep, S, D)."""
    k, v = _repeat_kv(k, k_shape, k_heads), _repeat_kv(v, v_shape, v_heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)


def _repeat_kv_flatten(x: torch.Tensor, shape) -> torch.Tensor:
    """torchtune's and gpt-fast's repeat: (B, Hkv, S, D) -> (B, Hkv, n_rep, S, D) -> (B, Hkv * n_rep,
    S, D) by `flatten(1, 2)`."""
    return torch.unsqueeze(x, 2).expand(shape).flatten(1, 2)


def sdpa_expand_flatten_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_shape, v_shape, attn_mask, dropout_p,
                           is_causal, scale):
    k, v = _repeat_kv_flatten(k, k_shape), _repeat_kv_flatten(v, v_shape)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)


def _kv_expanded_per_group(m: Match) -> str | None:
    """The expand only repeats (B, Hkv, 1, S, D) along its new dim: every other entry is -1 or
    k's (v's) own size."""
    for name in ("k", "v"):
        t, shape = m.value(name), m[f"{name}_shape"]
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"no 4-D shape for {name}"
        if not isinstance(shape, (list, tuple)) or len(shape) != 5:
            return f"{name} is expanded to {shape!r}, not (batch, kv_heads, n_rep, seq, head_dim)"
        for got, want in zip((shape[0], shape[1], shape[3], shape[4]), t.shape):
            if is_number(got) and got not in (-1, want):
                return f"{name} {tuple(t.shape)} is expanded to {tuple(shape)}: not a repeat per kv head"
    return None


def _repeat_kv_before_transpose(x: torch.Tensor, shape, heads) -> torch.Tensor:
    """repeat_kv as PyTorch-native code writes it (torchtitan, Meta's reference Llama): on (B, S,
    Hkv, D) before the heads move, (B, S, Hkv, n_rep, D) -> (B, S, Hkv * n_rep, D), then (B, H, S, D)."""
    return torch.unsqueeze(x, 3).expand(shape).reshape(heads).transpose(1, 2)


def sdpa_expand_kv_before_transpose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_shape, v_shape, k_heads,
                                    v_heads, attn_mask, dropout_p, is_causal, scale):
    k, v = _repeat_kv_before_transpose(k, k_shape, k_heads), _repeat_kv_before_transpose(v, v_shape, v_heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)


def sdpa_gqa_before_transpose_fused(q, k, v, attn_mask, dropout_p, is_causal, scale, k_shape=None, v_shape=None,
                                    k_heads=None, v_heads=None):
    return ops.attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask, dropout_p, is_causal, scale, True)


def _kv_repeat_check(heads_dim: int) -> Filter:
    """The expand + reshape is a repeat over the heads, for k and v (where the sizes are constants;
    symbolic ones are what the expand implies): (B, Hkv, S, D) -> (B, Hkv * n, S, D) with the
    heads at dim 1; at dim 2, (B, S, Hkv, D) -> (B, S, Hkv * n, D) before the transpose (its expand
    to 5-D checked too). The heads may be -1 (reshape infers them): with the other sizes k's own,
    that is Hkv * n."""
    layout = "(batch, heads, seq, head_dim)" if heads_dim == 1 else "(batch, seq, heads, head_dim)"

    def check(m: Match) -> str | None:
        for name in ("k", "v"):
            t, target = m.value(name), m[f"{name}_heads"]
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                return f"no 4-D shape for {name}"
            if not isinstance(target, (list, tuple)) or len(target) != 4:
                return f"{name} is reshaped to {target!r}, not {layout}"
            if heads_dim == 2:
                expanded = m[f"{name}_shape"]
                if not isinstance(expanded, (list, tuple)) or len(expanded) != 5:
                    return f"{name} is expanded to {expanded!r}, not (batch, seq, heads, n_rep, head_dim)"
            for i in (0, 3 - heads_dim, 3):  # the sizes other than the heads
                if is_number(target[i]) and target[i] != t.shape[i]:
                    return f"{name} is reshaped to {tuple(target)} from {tuple(t.shape)}: not a repeat over its heads"
            h = target[heads_dim]
            if is_number(h) and h != -1 and h % t.shape[heads_dim] != 0:
                return f"{name} is reshaped to {h} heads from {t.shape[heads_dim]}: not a repeat over its heads"
        return None

    check.__name__ = "kv_repeated_over_heads"
    return check


_kv_repeated_over_heads = _kv_repeat_check(1)
_kv_repeated_over_heads_before_transpose = _kv_repeat_check(2)


def sdpa_gqa_fused(q, k, v, attn_mask, dropout_p, is_causal, scale, n_rep=None, k_shape=None, v_shape=None,
                   k_heads=None, v_heads=None):
    return ops.attention(q, k, v, attn_mask, dropout_p, is_causal, scale, True)


def attention_chain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale, mask: torch.Tensor,
                    fill, p, training, dtype, cap=None, k_shape=None, v_shape=None, k_heads=None, v_heads=None,
                    fill_dtype=None, device=None, d2=None, d3=None, *,
                    scaling: str, masking: str, dropout: bool, softmax: str, softcap: bool = False,
                    repeat_kv: bool = False, upcast_qk: bool = False, k_transposed: bool = False,
                    v_transposed: bool = False):
    """softmax(q @ k^T scaled [capped] [masked]) [cast] [dropped out] @ v, in the spelling the
    keywords choose.

    scaling: "mul", "div", or "none" (q scaled before the product, as timm's and Hiera's
    `(q * scale) @ k^T` write it: the op takes the scaled q, its scale 1).
    masking: "add", "masked_fill", "where", "where_tensor" (the fill a 0-d tensor,
    `torch.tensor(finfo.min, dtype=..., device=...)`: ImageGPT's), or "" (none).
    softmax: "plain", "upcast" (computed in fp32, cast to `dtype`), "cast" (computed in the
    scores' dtype, then cast to `dtype`: GPT-2's `.type(value.dtype)`), or "cast_after" (as "cast",
    the cast after the dropout: BigBird-Pegasus's `attn_weights.to(value.dtype)` at the product).
    softcap: Gemma 2's `tanh(s / cap) * cap` after the scaling. repeat_kv: k and v repeated per query group first,
    as transformers' repeat_kv writes it (see sdpa_expand_kv). upcast_qk: q and k cast to fp32
    before the product (GPT-J's `query.to(torch.float32)`); the op takes them as they were, its
    scores being fp32 whatever q's dtype. k_transposed: the key comes already laid out as k^T,
    (..., head_dim, keys), with no transpose before the product (SqueezeBERT's view of its key
    convolution, or a permute straight to that layout); the op takes its transpose, a view.
    v_transposed: v and the output laid out channels first, (..., head_dim, keys) and (..., head_dim,
    queries), the output `v @ P^T` (timm's iFormer written out, q^T @ k on (B, C, N) maps); the op
    takes v's transpose and its output is transposed back, views."""
    if upcast_qk:
        q, k = q.to(torch.float32), k.to(torch.float32)
    if repeat_kv:
        k, v = _repeat_kv(k, k_shape, k_heads), _repeat_kv(v, v_shape, v_heads)
    s = torch.matmul(q, k if k_transposed else k.transpose(d0, d1))
    if scaling == "mul":
        s = s * scale
    elif scaling == "div":
        s = s / scale
    if softcap:
        s = torch.tanh(s / cap) * cap
    if masking == "add":
        s = s + mask
    elif masking == "masked_fill":
        s = s.masked_fill(mask, fill)
    elif masking == "where":
        s = torch.where(mask, s, fill)
    elif masking == "where_tensor":
        s = torch.where(mask, s, torch.tensor(fill, dtype=fill_dtype, device=device))
    if softmax == "upcast":
        a = torch.softmax(s, -1, torch.float32).to(dtype)
    elif softmax == "cast":
        a = torch.softmax(s, -1).to(dtype)
    else:
        a = torch.softmax(s, -1)
    if dropout:
        a = F.dropout(a, p, training, False)
    if softmax == "cast_after":
        a = a.to(dtype)
    return torch.matmul(v, a.transpose(d2, d3)) if v_transposed else torch.matmul(a, v)


def attention_chain_fused(q, k, v, d0=None, d1=None, scale=None, mask=None, fill=None, p=0.0, training=False,
                          dtype=None, cap=None, k_shape=None, v_shape=None, k_heads=None, v_heads=None,
                          fill_dtype=None, device=None, d2=None, d3=None, dims=4, shared_kv=False,
                          mask_dims=None, mask_expand=False, integer_mask=False, *, scaling: str,
                          masking: str, dropout: bool, softmax: str, softcap: bool = False,
                          repeat_kv: bool = False, upcast_qk: bool = False, k_transposed: bool = False,
                          v_transposed: bool = False):
    if k_transposed:
        k = k.transpose(-2, -1)  # (..., keys, head_dim) as the op takes it; the model multiplied by k^T
    if v_transposed:
        v = v.transpose(-2, -1)  # channels first: (..., keys, head_dim); the output transposed back below
    if masking == "add" and integer_mask:
        # scores + a bool (or integer) tensor adds its values, 1 where True: an additive mask in
        # the scores' dtype, not the op's keep-mask (BERT's eager attention adds the bool mask
        # Grounding DINO hands its text encoder)
        mask = mask.to(torch.float32 if upcast_qk else q.dtype)
    if masking in ("masked_fill", "where", "where_tensor"):
        # masked_fill marks what to drop, an attention mask what to keep; a finfo.min fill (the
        # filter allows no other finite one) makes a row masked whole a uniform softmax, dropped
        # out like the others: the op's, with that row's query zeroed and its keys all open
        keep = torch.logical_not(mask) if masking == "masked_fill" else mask
        q, mask = _keep_as_op_mask(q, keep, None, fill)
    scale = scale if scaling == "mul" else 1.0 / scale if scaling == "div" else 1.0
    p = p if training else 0.0
    if dims == 3:
        # (N, S, D) tensors (batch and heads flattened, as ldm's CrossAttention and BART's older
        # code hold them): one head each, the op's (N, 1, S, D); a 3-D mask gets the head dim
        mask4 = mask.unsqueeze(-3) if masking else None
        o = ops.attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), mask4, p, False, scale,
                          softcap=cap if softcap else None).squeeze(1)
    elif dims > 4:
        # (..., H, S, D) tensors (Hiera's (batch, heads, windows), MaxViT's (batch, grid, heads)):
        # every dim before the last of them flattened into the op's batch (a copy where they are no
        # view), the mask too, expanded first only where it varies over some of those dims
        flat = [t.flatten(0, dims - 4) for t in (q, k, v)]
        mask = _flat_mask(mask, q, dims - 3, mask_dims, mask_expand) if masking else None
        o = ops.attention(*flat, mask, p, False, scale, softcap=cap if softcap else None)
        o = o.reshape(q.shape[:-1] + (v.shape[-1],))
    else:
        o = ops.attention(q, k, v, mask, p, False, scale, repeat_kv or shared_kv,
                          softcap=cap if softcap else None)
    return o.transpose(-2, -1) if v_transposed else o


def _flat_mask(mask: torch.Tensor, q: torch.Tensor, lead: int, mask_dims: int, expand: bool) -> torch.Tensor:
    """A mask over scores (*q.shape[:lead], H, Sq, Sk) as the op's 4-D mask over (prod of those
    lead dims, H, Sq, Sk): a view where it is 1 along all of them (MaxViT's (1, H, Sq, Sk) position
    bias); otherwise (`expand`) expanded to q's sizes there first (a key-padding mask per image over
    its windows: a copy, the mask's size times what it broadcasts over). Traced into the graph, so
    the mask's rank comes as a number (_mask_layout's)."""
    mask = mask[(None,) * (lead + 3 - mask_dims)]
    if expand:
        mask = mask.expand(q.shape[:lead] + (-1, -1, -1))
    return mask.flatten(0, lead - 1)


def attention_chain_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale, mask: torch.Tensor,
                          sinks: torch.Tensor, sink_shape, sink_expand, softmax_dtype, p, training, dtype,
                          k_shape=None, v_shape=None, k_heads=None, v_heads=None, *, masked: bool, repeat_kv: bool,
                          with_sinks: bool = True):
    """gpt-oss's eager_attention_forward (transformers' modeling_gpt_oss.py), as written; without
    the sinks' column (with_sinks=False) MiMo-V2-Flash's layers that have none: the row max still
    subtracted before the softmax."""
    if repeat_kv:
        k, v = _repeat_kv(k, k_shape, k_heads), _repeat_kv(v, v_shape, v_heads)
    s = torch.matmul(q, k.transpose(d0, d1)) * scale
    if masked:
        s = s + mask
    if with_sinks:
        s = torch.cat([s, sinks.reshape(sink_shape).expand(sink_expand)], -1)
    s = s - s.max(dim=-1, keepdim=True)[0]
    probs = torch.softmax(s, -1, softmax_dtype)
    a = F.dropout(probs[..., :-1] if with_sinks else probs, p, training, False).to(dtype)
    return torch.matmul(a, v)


def attention_chain_sinks_fused(q, k, v, d0, d1, scale, mask=None, sinks=None, sink_shape=None, sink_expand=None,
                                softmax_dtype=None, p=0.0, training=False, dtype=None, k_shape=None, v_shape=None,
                                k_heads=None, v_heads=None, *, masked: bool, repeat_kv: bool, with_sinks: bool = True):
    # The max subtraction only guards the unfused softmax against overflow (softmax and its
    # gradient are shift-invariant); the op's online softmax does the same by construction.
    return ops.attention(q, k, v, mask if masked else None, p if training else 0.0, False, scale, repeat_kv,
                         sinks=sinks if with_sinks else None)


def attention_chain_sinks_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale,
                               mask: torch.Tensor, sinks: torch.Tensor, sink_shape, sink_expand, dtype, p,
                               training, k_shape=None, v_shape=None, k_heads=None, v_heads=None, *,
                               masked: bool, repeat_kv: bool):
    """Flint's eager_attention_forward (transformers' modeling_flint.py), as written: q and the
    repeated k cast to fp32 for the scores (autocast off around them), the sinks' column, no row
    max subtracted, the softmax, the column dropped, the cast to v's dtype before the dropout."""
    if repeat_kv:
        k, v = _repeat_kv(k, k_shape, k_heads), _repeat_kv(v, v_shape, v_heads)
    s = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(d0, d1)) * scale
    if masked:
        s = s + mask
    s = torch.cat([s, sinks.reshape(sink_shape).expand(sink_expand)], -1)
    a = F.dropout(torch.softmax(s, -1)[..., :-1].to(dtype), p, training, False)
    return torch.matmul(a, v)


def attention_chain_sinks_fp32_fused(q, k, v, d0, d1, scale, mask=None, sinks=None, sink_shape=None,
                                     sink_expand=None, dtype=None, p=0.0, training=False, k_shape=None,
                                     v_shape=None, k_heads=None, v_heads=None, *, masked: bool,
                                     repeat_kv: bool):
    # q and k uncast: the op's scores are fp32 whatever their dtype (products of 16-bit numbers are
    # exact in fp32), its probabilities rounded to v's dtype for the product as the cast does.
    return ops.attention(q, k, v, mask if masked else None, p if training else 0.0, False, scale, repeat_kv,
                         sinks=sinks)


def _sinks_fp32_pattern(masked: bool, repeat_kv: bool) -> Pattern:
    opts = {"masked": masked, "repeat_kv": repeat_kv}
    name = "_".join(["attention_chain_sinks_fp32", "add" if masked else "no_mask",
                     *(["repeat_kv"] if repeat_kv else [])])
    filters = (_transposes_last_two, _scale_is_number, _sinks_per_head, needs_number("p"),
               needs_bool("training"), _cast_is_a_no_op, *([_float_mask("mask")] if masked else []),
               *([_kv_repeated_over_heads] if repeat_kv else []))
    return Pattern(name, "attention", functools.partial(attention_chain_sinks_fp32, **opts),
                   functools.partial(attention_chain_sinks_fp32_fused, **opts), ("attention",), filters)


def _sinks_per_head(m: Match) -> str | None:
    """The concatenated column is one logit per query head, the same for every batch and query
    row: a 1-D float tensor of Hq entries reshaped to (1, Hq, 1, 1) and expanded to (B, Hq, Sq, 1)
    (-1 kept where transformers writes it)."""
    q, sinks = m.value("q"), m.value("sinks")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return "no 4-D shape for q"
    heads = q.shape[1]
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.dim() != 1 \
            or sinks.shape[0] != heads:
        return f"the concatenated column is not a float tensor of one logit per query head ({heads})"
    shape, expand = m["sink_shape"], m["sink_expand"]
    if not isinstance(shape, (list, tuple)) or len(shape) != 4 or [shape[0], shape[2], shape[3]] != [1, 1, 1] \
            or shape[1] not in (-1, heads):
        return f"the sinks are reshaped to {shape!r}, not (1, heads, 1, 1)"
    if not isinstance(expand, (list, tuple)) or len(expand) != 4 or expand[1] not in (-1, heads) \
            or expand[3] not in (-1, 1):
        return f"the sinks are expanded to {expand!r}, not (batch, heads, queries, 1)"
    return None


def _softmax_in_q_dtype_or_fp32(m: Match) -> str | None:
    """The softmax computes in q's dtype or fp32: its dtype argument one of those, or none (the
    canonical form of gpt-oss's `dtype=combined.dtype`): the scores' own dtype, q's promoted with
    the mask's and the sinks'."""
    q = m.value("q")
    if not isinstance(q, torch.Tensor):
        return "no dtype for q"
    if m["softmax_dtype"] is None:
        scores = q.dtype
        for name in ("mask", "sinks"):
            try:
                t = m.value(name)
            except KeyError:  # not in this spelling
                continue
            scores = torch.promote_types(scores, t.dtype) if isinstance(t, torch.Tensor) else scores
        if scores in (q.dtype, torch.float32):
            return None
        return f"the softmax runs in the scores' {scores}, neither q's {q.dtype} nor float32"
    if m["softmax_dtype"] not in (q.dtype, torch.float32):
        return f"the softmax runs in {m['softmax_dtype']}, neither q's {q.dtype} nor float32"
    return None


def _sinks_pattern(masked: bool, repeat_kv: bool, with_sinks: bool = True) -> Pattern:
    opts = {"masked": masked, "repeat_kv": repeat_kv, "with_sinks": with_sinks}
    name = "_".join(["attention_chain_sinks" if with_sinks else "attention_chain_max_sub",
                     "add" if masked else "no_mask", *(["repeat_kv"] if repeat_kv else [])])
    filters = (_transposes_last_two, _scale_is_number, *([_sinks_per_head] if with_sinks else []),
               _softmax_in_q_dtype_or_fp32, needs_number("p"), needs_bool("training"), _cast_is_a_no_op,
               *([_float_mask("mask")] if masked else []), *([_kv_repeated_over_heads] if repeat_kv else []))
    return Pattern(name, "attention", functools.partial(attention_chain_sinks, **opts),
                   functools.partial(attention_chain_sinks_fused, **opts), ("attention",), filters)


def attention_chain_sink_scale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale, mask: torch.Tensor,
                               sinks: torch.Tensor, sink_shape, lse_dtype, softmax_dtype, dtype, p, training,
                               out_dtype, k_shape=None, v_shape=None, k_heads=None, v_heads=None, *, masked: bool,
                               repeat_kv: bool):
    """Granite's sliding-window attention (transformers' modeling_granite_swa.py), as written: the
    softmax without the sink, the output scaled per row by sigmoid(logsumexp(scores) - sink)."""
    if repeat_kv:
        k, v = _repeat_kv(k, k_shape, k_heads), _repeat_kv(v, v_shape, v_heads)
    s = torch.matmul(q, k.transpose(d0, d1)) * scale
    if masked:
        s = s + mask
    sink_scale = torch.sigmoid((torch.logsumexp(s, dim=-1) - sinks.view(sink_shape)).to(lse_dtype))
    a = F.dropout(torch.softmax(s, -1, softmax_dtype).to(dtype), p, training, False)
    o = torch.matmul(a, v)
    return o * sink_scale.unsqueeze(-1).to(out_dtype)


def attention_chain_sink_scale_fused(q, k, v, d0, d1, scale, mask=None, sinks=None, sink_shape=None, lse_dtype=None,
                                     softmax_dtype=None, dtype=None, p=0.0, training=False, out_dtype=None,
                                     k_shape=None, v_shape=None, k_heads=None, v_heads=None, *, masked: bool,
                                     repeat_kv: bool):
    # sigmoid(L - s_h) = sum_j exp(S_ij) / (sum_j exp(S_ij) + exp(s_h)): the row scale turns
    # softmax(S)_ij into exp(S_ij) / (exp(s_h) + sum_j exp(S_ij)), the op's P with a sink. Dropout
    # commutes with the row scale (Z * P / (1 - p) * c = Z * (c P) / (1 - p)), so dropping out P
    # with the sink inside its denominator is the model's dropout, then the scale.
    return ops.attention(q, k, v, mask if masked else None, p if training else 0.0, False, scale, repeat_kv,
                         sinks=sinks)


def _sink_scale_per_head(m: Match) -> str | None:
    """The subtracted sink is one logit per query head: a 1-D float tensor of Hq entries viewed as
    (1, Hq, 1) against the (B, Hq, Sq) log-sum-exp; the sigmoid in fp32 or q's dtype, its result
    cast to v's dtype (the output's: no promotion of it)."""
    q, v, sinks = m.value("q"), m.value("v"), m.value("sinks")
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not isinstance(v, torch.Tensor):
        return "no 4-D shape for q, or none for v"
    heads = q.shape[1]
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.dim() != 1 \
            or sinks.shape[0] != heads:
        return f"the subtracted sink is not a float tensor of one logit per query head ({heads})"
    shape = m["sink_shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) != 3 or shape[0] != 1 or shape[2] != 1 \
            or shape[1] not in (-1, heads):
        return f"the sinks are viewed as {shape!r}, not (1, heads, 1)"
    if m["lse_dtype"] not in (q.dtype, torch.float32):
        return f"the sink's scale is computed in {m['lse_dtype']!r}, neither q's {q.dtype} nor float32"
    if m["out_dtype"] != v.dtype:
        return f"the sink's scale is cast to {m['out_dtype']}, not to the output's {v.dtype}"
    return None


def _sink_scale_pattern(masked: bool, repeat_kv: bool) -> Pattern:
    opts = {"masked": masked, "repeat_kv": repeat_kv}
    name = "_".join(["attention_chain_sink_scale", "add" if masked else "no_mask",
                     *(["repeat_kv"] if repeat_kv else [])])
    filters = (_transposes_last_two, _scale_is_number, _sink_scale_per_head, _softmax_in_q_dtype_or_fp32,
               needs_number("p"), needs_bool("training"), _cast_is_a_no_op, *([_float_mask("mask")] if masked else []),
               *([_kv_repeated_over_heads] if repeat_kv else []))
    return Pattern(name, "attention", functools.partial(attention_chain_sink_scale, **opts),
                   functools.partial(attention_chain_sink_scale_fused, **opts), ("attention",), filters)


def _transposes_last_two(m: Match) -> str | None:
    k = m.value("k")
    if not isinstance(k, torch.Tensor):
        return "no shape for k"
    dims = sorted(d % k.dim() for d in (m["d0"], m["d1"]))
    return None if dims == [k.dim() - 2, k.dim() - 1] else f"transposes dims {m['d0']}, {m['d1']} of k, not the last two"


def _probabilities_transposed(m: Match) -> str | None:
    """`v @ P^T`: the product transposes P's last two dims (d2, d3)."""
    v = m.value("v")
    if not isinstance(v, torch.Tensor):
        return "no shape for v"
    dims = sorted(d % v.dim() for d in (m["d2"], m["d3"]) if isinstance(d, int))
    return None if dims == [v.dim() - 2, v.dim() - 1] else "P is transposed in other dims than its last two"


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


def _cast_is_a_no_op(m: Match) -> str | None:
    """softmax(s).to(dtype) with s in q's dtype: fused where the cast changes nothing (q, v and
    `dtype` agree), or under autocast where each of q, k, v and `dtype` is fp32 or autocast's
    dtype: the products cast their operands to autocast's dtype themselves, as the op casts q, k
    and v (Hugging Face's rotary tables are fp32, so its q and k arrive fp32 beside a 16-bit v and
    `.to(query.dtype)` casts the probabilities to fp32). Otherwise the unfused code mixes dtypes
    the op does not take."""
    q, k, v = m.value("q"), m.value("k"), m.value("v")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "no dtype for q, k or v"
    if m["dtype"] == q.dtype == v.dtype:
        return None
    device = q.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        low = torch.get_autocast_dtype(device)
        dtypes = {m["dtype"], q.dtype, k.dtype, v.dtype}
        if low in (torch.float16, torch.bfloat16) and dtypes <= {low, torch.float32}:
            return None
    return f"casts the probabilities ({q.dtype}) to {m['dtype']}, with v in {v.dtype}: not a no-op"


def _q_k_v_share_a_dtype(m: Match) -> str | None:
    """q and k cast to fp32 before the product: fused where q, k and v had one dtype."""
    q, k, v = m.value("q"), m.value("k"), m.value("v")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "no dtype for q, k or v"
    if not q.dtype == k.dtype == v.dtype:
        return f"q, k and v have dtypes {q.dtype}, {k.dtype}, {v.dtype} before the fp32 cast of q and k"
    return None


def _fill_masks(m: Match, tensor: bool = False) -> str | None:
    """The masked_fill / where value is -inf, or the scores' finfo.min (a row masked whole is then
    uniform, dropped out like the others: `_keep_as_op_mask`). tensor: the fill a 0-d tensor of
    `fill_dtype`, the scores' own (ImageGPT's)."""
    fill, q = m["fill"], m.value("q")
    if not is_number(fill):
        return f"the fill is {fill!r}, not a constant number"
    if fill == float("-inf"):
        return None
    if not isinstance(q, torch.Tensor):
        return "no dtype for q"
    dtype = m["fill_dtype"] if tensor else q.dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return f"the fill tensor's dtype is {dtype!r}, not a float dtype"
    if tensor and dtype != _scores_dtype(q):
        return f"the fill tensor is {dtype}, not the scores' {_scores_dtype(q)}"
    if fill != torch.finfo(dtype).min:
        return (f"a finite fill {fill} that is not finfo({dtype}).min: whether a partly masked row "
                f"underflows to exactly 0 depends on the scores")
    return None


def _scores_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype of q @ k^T: q's, or autocast's 16-bit dtype where autocast casts the product."""
    device = q.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device) and q.dtype == torch.float32:
        return torch.get_autocast_dtype(device)
    return q.dtype


def _dims_of_q(m: Match) -> dict:
    """The replacement's layout: q's dims (3: one head each, 4: as the op takes them, more: all
    but the last before (Sq, D) flattened into the op's batch); _attention_dims has checked them.
    With one key/value head beside several query heads (Falcon's multi-query attention, broadcast
    by the products), the op's GQA. A mask over scores of more than 4 dims: its rank, and whether
    it varies along the dims flattened into the batch (then expanded there: _flat_mask)."""
    q, k = m.value("q"), m.value("k")
    dims = q.dim() if isinstance(q, torch.Tensor) else 4
    # decided on sizes as Python ints: a dynamic capture's symbolic sizes are never 0 or 1 (Dynamo
    # specializes those), and a SymBool handed to the op would be a graph constant Inductor warns of
    shared_kv = dims == 4 and isinstance(k, torch.Tensor) and k.dim() == 4 and type(k.shape[1]) is int \
        and k.shape[1] == 1 and not (type(q.shape[1]) is int and q.shape[1] <= 1)
    mask = m.value("mask") if dims > 4 and "mask" in m.bindings() else None
    return {"dims": dims, "shared_kv": shared_kv, **_mask_layout(mask, dims), **_integer_mask(m)}


def _integer_mask(m: Match) -> dict:
    """Whether the mask is a bool or integer tensor (for a mask added to the scores: its values
    added, 1 where True, never the op's keep-mask)."""
    mask = m.value("mask") if "mask" in m.bindings() else None
    return {"integer_mask": True} if isinstance(mask, torch.Tensor) and not mask.is_floating_point() else {}


def _attention_dims(m: Match, masked: bool, kv_repeated: bool = False) -> str | None:
    """q, k and v all 4-D (batch, heads, seq, head_dim), k and v with q's heads or one head that
    the products broadcast (unless repeated to q's heads before); or all 3-D (one head each) with
    a mask, if any, of 2 or 3 dims (its broadcast over the 3-D scores); or all 5-D or more with one
    shape before the last two (Hiera's (batch, heads, windows, seq, dim)) and a mask, if any, that
    broadcasts to the scores without widening them (MaxViT's position bias)."""
    q, k, v = m.value("q"), m.value("k"), m.value("v")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "no shapes for q, k or v"
    dims = {q.dim(), k.dim(), v.dim()}
    if len(dims) != 1 or q.dim() < 3:
        return f"q, k and v have {q.dim()}, {k.dim()} and {v.dim()} dims, not all 3, 4 or more alike"
    mask = m.value("mask") if masked else None
    if q.dim() == 3 and isinstance(mask, torch.Tensor) and mask.dim() not in (2, 3):
        return f"a {mask.dim()}-D mask over 3-D scores"
    if q.dim() == 4 and not kv_repeated:  # the products broadcast k and v over q's heads, or not at all
        heads_ok = k.shape[1] == v.shape[1] and k.shape[1] in (1, q.shape[1])
        if not heads_ok or not q.shape[0] == k.shape[0] == v.shape[0]:
            return (f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: not one batch, or k and v "
                    "with neither q's heads nor one head for all")
    if q.dim() > 4:
        if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
            return f"q, k and v differ before their last two dims: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        if masked:
            if not isinstance(mask, torch.Tensor):
                return "no shape for the mask"
            return _broadcast_to_scores("the mask", mask.shape, tuple(q.shape[:-1]) + (k.shape[-2],))
    return None


def _cap_is_a_positive_number(m: Match) -> str | None:
    cap = m["cap"]
    if not is_number(cap) or not cap > 0 or cap == float("inf"):
        return f"the soft cap is {cap!r}, not a finite positive constant"
    return None


def _chain_pattern(scaling: str, masking: str, dropout: bool, softmax: str, softcap: bool = False,
                   repeat_kv: bool = False, upcast_qk: bool = False, k_transposed: bool = False,
                   v_transposed: bool = False) -> Pattern:
    opts = {"scaling": scaling, "masking": masking, "dropout": dropout, "softmax": softmax, "softcap": softcap,
            "repeat_kv": repeat_kv, "upcast_qk": upcast_qk, "k_transposed": k_transposed,
            "v_transposed": v_transposed}
    name = "_".join(["attention_chain", "unscaled" if scaling == "none" else scaling,
                     *(["softcap"] if softcap else []), masking or "no_mask",
                     "dropout" if dropout else "no_dropout", *([softmax] if softmax != "plain" else []),
                     *(["repeat_kv"] if repeat_kv else []), *(["upcast_q_k"] if upcast_qk else []),
                     *(["k_transposed"] if k_transposed else []),
                     *(["v_transposed"] if v_transposed else [])])
    filters = [functools.partial(_attention_dims, masked=bool(masking), kv_repeated=repeat_kv),
               *([] if k_transposed else [_transposes_last_two]),
               *([_scale_is_number] if scaling != "none" else []), *([_cap_is_a_positive_number] if softcap else []),
               *([_kv_repeated_over_heads] if repeat_kv else []),
               *([_q_k_v_share_a_dtype] if upcast_qk else []),
               *([_probabilities_transposed] if v_transposed else [])]
    if dropout:
        filters += [needs_number("p"), needs_bool("training")]
    if masking in ("masked_fill", "where", "where_tensor"):
        filters.append(functools.partial(_fill_masks, tensor=masking == "where_tensor"))
    if softmax == "upcast":
        filters.append(_casts_back_to_q)
    elif softmax in ("cast", "cast_after"):
        filters.append(_cast_is_a_no_op)
    return Pattern(name, "attention", functools.partial(attention_chain, **opts),
                   functools.partial(attention_chain_fused, **opts), ("attention",), tuple(filters),
                   derive=_integer_mask if repeat_kv else _dims_of_q)


def attention_bmm_scaled_k(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale, bias: torch.Tensor,
                           heads_shape, flat_shape, mask: torch.Tensor, fill, p, training, *, add_bias: bool):
    """DeBERTa-v2's DisentangledSelfAttention: q, k, v (B*H, S, D); the scores viewed per head
    (B, H, S, S) for the mask (B, 1, S, S), flattened back for the second bmm."""
    s = torch.bmm(q, k.transpose(d0, d1) / scale)
    if add_bias:
        s = s + bias
    s = s.view(heads_shape).masked_fill(mask, fill)
    a = F.dropout(torch.softmax(s, -1), p, training, False)
    return torch.bmm(a.view(flat_shape), v)


def attention_bmm_scaled_k_fused(q, k, v, d0, d1, scale, bias=None, heads_shape=None, flat_shape=None, mask=None,
                                 fill=None, p=0.0, training=False, *, add_bias: bool):
    # Only the head count is read from the model's per-head view: its other dims are computed in
    # the graph when the sequence length is dynamic (nodes, not numbers), and q and k have them.
    heads, seq_q, seq_k, dim = heads_shape[1], q.shape[1], k.shape[1], q.shape[2]
    q4, v4 = q.view(-1, heads, seq_q, dim), v.view(-1, heads, seq_k, v.shape[2])
    k4 = (k / scale).view(-1, heads, seq_k, dim)  # the division as the model writes it, on k
    per_head = bias.view(-1, heads, seq_q, seq_k) if add_bias else None
    q4, attn_mask = _masked_fill_as_op_mask(q4, mask, per_head, fill)
    o = ops.attention(q4, k4, v4, attn_mask, p if training else 0.0, False, 1.0)
    return o.reshape(-1, seq_q, v.shape[2])


def _masked_fill_as_op_mask(q: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None, fill):
    """`(scores + bias).masked_fill(mask, fill)` as the op's inputs: (q, attn_mask), q per head.

    masked_fill marks what to drop, an attention mask what to keep; the bias (or None) becomes the
    op's float mask, -inf where a key is dropped (its gradient reaches the bias only where a key is
    kept, as through masked_fill). With fill finfo.min (the filters allow no other finite fill) the
    unfused softmax of a row masked whole is uniform, dropped out like any other: the op computes
    exactly that when the row's query is zero and its mask open (all scores 0); the where()s pass
    no gradient to q or the bias there, as masked_fill passes none to the scores."""
    return _keep_as_op_mask(q, torch.logical_not(mask), bias, fill)


def _keep_as_op_mask(q: torch.Tensor, keep: torch.Tensor, bias: torch.Tensor | None, fill):
    """_masked_fill_as_op_mask for a mask of the keys to keep (`torch.where(keep, scores, fill)`)."""
    if fill != float("-inf"):
        open_row = keep.any(-1, keepdim=True)
        q = torch.where(open_row, q, 0.0)
        keep = torch.logical_or(keep, torch.logical_not(open_row))
    if bias is None:
        return q, keep
    attn_mask = torch.where(keep, bias, float("-inf"))
    if fill != float("-inf"):
        attn_mask = torch.where(open_row, attn_mask, 0.0)
    return q, attn_mask


def _bmm_scaled_k_shapes(m: Match) -> str | None:
    """q, k, v are (B*H, S, D); the scores are viewed as (B, H, Sq, Sk) with a known H, then back
    to (B*H, Sq, Sk); the mask is 4-D; the scale is a number or a single-element tensor."""
    q, k, v, mask = m.value("q"), m.value("k"), m.value("v"), m.value("mask")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return "q, k and v are not all 3-D (batch * heads, seq, head_dim)"
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.dtype != torch.bool:
        return "the mask is not a 4-D bool tensor"
    heads_shape, flat_shape = m["heads_shape"], m["flat_shape"]
    why = _per_head_view(heads_shape, q, k)
    if why:
        return why
    if not isinstance(flat_shape, (tuple, list)) or len(flat_shape) != 3:
        return f"the probabilities are viewed as {flat_shape!r}, not (batch * heads, seq, seq)"
    scale = m.value("scale")
    if isinstance(scale, torch.Tensor) and scale.numel() != 1:
        return f"the scale has shape {tuple(scale.shape)}, not a single element"
    if not isinstance(scale, torch.Tensor) and not is_number(scale):
        return f"the scale is {scale!r}, not a number or a tensor"
    return None


def _per_head_view(heads_shape, q: torch.Tensor, k: torch.Tensor) -> str | None:
    """(B*H, Sq, Sk) scores viewed as (B, H, Sq, Sk): a constant H dividing q's rows, per head."""
    if not isinstance(heads_shape, (tuple, list)) or len(heads_shape) != 4 or not is_number(heads_shape[1]) \
            or heads_shape[1] < 1:
        return f"the scores are viewed as {heads_shape!r}, not (batch, heads, seq, seq) with a constant heads"
    heads = heads_shape[1]
    for got, want in zip(heads_shape[2:], (q.shape[1], k.shape[1])):
        if is_number(got) and got != want:
            return f"the scores are viewed as {tuple(heads_shape)}, not per head"
    if is_number(q.shape[0]) and q.shape[0] % heads:
        return f"{q.shape[0]} rows of q are not a multiple of {heads} heads"
    return None


def attention_bmm_of_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_flat, k_flat, d0, d1, scale,
                           heads_shape, mask: torch.Tensor, p, training, dtype, *, masked: bool):
    """GPT-NeoX-Japanese's attention: q and k (B, H, S, D) viewed as (B*H, S, D) for the product
    (its `baddbmm` over zeros, in canonical form `bmm * alpha`), the scores viewed back per head
    for the additive mask; softmax, dropout, the cast to v's dtype, `@ v` on the 4-D value."""
    s = torch.bmm(q.view(q_flat), k.view(k_flat).transpose(d0, d1)) * scale
    s = s.view(heads_shape)
    if masked:
        s = s + mask
    a = F.dropout(torch.softmax(s, -1), p, training, False).to(dtype)
    return torch.matmul(a, v)


def attention_bmm_of_heads_fused(q, k, v, q_flat, k_flat, d0, d1, scale, heads_shape, mask=None, p=0.0,
                                 training=False, dtype=None, *, masked: bool):
    return ops.attention(q, k, v, mask if masked else None, p if training else 0.0, False, scale)


def _heads_flattened_and_back(m: Match, masked: bool) -> str | None:
    """q, k, v (B, H, S, D) alike in batch and heads; q and k viewed as (B*H, S, D), the key's
    transpose its last two dims, the scores viewed back as (B, H, Sq, Sk); a float mask, if any,
    broadcasting to them."""
    q, k, v = m.value("q"), m.value("k"), m.value("v")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q, k and v are not all 4-D (batch, heads, seq, head_dim)"
    if not q.shape[:2] == k.shape[:2] == v.shape[:2]:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} differ in batch or heads"
    for name, t in (("q", q), ("k", k)):
        flat = m[f"{name}_flat"]
        want = (t.shape[0] * t.shape[1], *t.shape[2:])
        if not isinstance(flat, (tuple, list)) or len(flat) != 3 \
                or any(is_number(g) and g != -1 and g != w for g, w in zip(flat, want)):
            return f"{name} is viewed as {flat!r}, not (batch * heads, seq, head_dim)"
    if sorted(d % 3 for d in (m["d0"], m["d1"])) != [1, 2]:
        return f"transposes dims {m['d0']}, {m['d1']} of the flat key, not the last two"
    shape = m["heads_shape"]
    want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if not isinstance(shape, (tuple, list)) or len(shape) != 4 \
            or any(is_number(g) and g != -1 and g != w for g, w in zip(shape, want)):
        return f"the scores are viewed as {shape!r}, not (batch, heads, seq, seq)"
    if masked:
        mask = m.value("mask")
        if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
            return "the mask is not a float (additive) mask"
        return _broadcast_to_scores("the mask", mask.shape, want)
    return None


def _bmm_scaled_k_pattern(add_bias: bool) -> Pattern:
    name = "attention_bmm_scaled_k_" + ("add_" if add_bias else "") + "masked_fill_dropout"
    return Pattern(name, "attention", functools.partial(attention_bmm_scaled_k, add_bias=add_bias),
                   functools.partial(attention_bmm_scaled_k_fused, add_bias=add_bias), ("attention",),
                   (_transposes_last_two, _bmm_scaled_k_shapes, needs_number("p"), needs_bool("training"),
                    _fill_masks))


def attention_chain_add_masked_fill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, bias,
                                    mask: torch.Tensor, fill, p, training, *, add_bias: bool):
    """DeBERTa's (v1) DisentangledSelfAttention on (B, H, S, D) tensors: q divided by the scale
    before the product (so the scores are unscaled here: the op's scale is 1), the relative-position
    scores added (`+ rel_att`; `+ 0` without relative attention), `masked_fill(~mask, finfo.min)`,
    softmax, dropout."""
    s = torch.matmul(q, k.transpose(d0, d1))
    if add_bias:
        s = s + bias
    s = s.masked_fill(mask, fill)
    a = F.dropout(torch.softmax(s, -1), p, training, False)
    return torch.matmul(a, v)


def attention_chain_add_masked_fill_fused(q, k, v, d0, d1, bias=None, mask=None, fill=None, p=0.0, training=False, *,
                                          add_bias: bool):
    # DeBERTa masks padding queries whole too; `+ 0` adds nothing to the op's mask
    q, attn_mask = _masked_fill_as_op_mask(q, mask, bias if add_bias and not is_number(bias) else None, fill)
    return ops.attention(q, k, v, attn_mask, p if training else 0.0, False, 1.0)


def _broadcast_to_scores(what: str, shape: torch.Size, scores: tuple) -> str | None:
    """None when a mask (or bias) of `shape` broadcasts to exactly the scores' shape; else why not."""
    try:
        if torch.broadcast_shapes(shape, scores) != torch.Size(scores):
            return f"{what} {tuple(shape)}: broadcast with the scores {scores}, wider than them"
    except RuntimeError:
        return f"{what} {tuple(shape)}: no broadcast to the scores {scores}"
    return None


def _bias_is_scores_like_or_zero(m: Match) -> str | None:
    """The added term is the number 0 (DeBERTa without relative attention) or a float tensor in q's
    dtype that broadcasts to the scores (B, H, Sq, Sk)."""
    bias, q, k = m["bias"], m.value("q"), m.value("k")
    if is_number(bias):
        return None if bias == 0 else f"adds the constant {bias!r} to the scores, not 0 or a tensor"
    bias = m.value("bias")
    if not all(isinstance(t, torch.Tensor) for t in (bias, q, k)):
        return "no shapes for q, k or the added scores"
    if bias.dtype != q.dtype:
        return f"the added scores ({bias.dtype}) are not in q's dtype ({q.dtype})"
    return _broadcast_to_scores("the added scores", bias.shape, (*q.shape[:-1], k.shape[-2]))


def _bool_mask_over_scores(m: Match) -> str | None:
    """A bool mask that broadcasts to the scores (B, H, Sq, Sk) of 4-D q and k."""
    mask, q, k = m.value("mask"), m.value("q"), m.value("k")
    if not all(isinstance(t, torch.Tensor) for t in (mask, q, k)) or q.dim() != 4 or k.dim() != 4:
        return "q and k are not 4-D (batch, heads, seq, head_dim) or the mask has no shape"
    if mask.dtype != torch.bool:
        return "the mask is not a bool tensor"
    return _broadcast_to_scores("the mask", mask.shape, (*q.shape[:-1], k.shape[-2]))


def _add_masked_fill_pattern(add_bias: bool) -> Pattern:
    name = "attention_chain_" + ("add_" if add_bias else "") + "masked_fill_unscaled_dropout"
    filters = [_transposes_last_two, _bool_mask_over_scores, needs_number("p"), needs_bool("training"),
               _fill_masks, *([_bias_is_scores_like_or_zero] if add_bias else [])]
    return Pattern(name, "attention", functools.partial(attention_chain_add_masked_fill, add_bias=add_bias),
                   functools.partial(attention_chain_add_masked_fill_fused, add_bias=add_bias), ("attention",),
                   tuple(filters))


def attention_bmm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, heads_shape, mask: torch.Tensor,
                  flat_shape, p, training, *, masked: bool):
    """BART's older eager attention (TrOCR, MVP, LED's decoder, ...): q (already scaled), k, v
    (B*H, S, D); the scores viewed per head (B, H, Sq, Sk) for the additive mask and back to
    (B*H, Sq, Sk) when there is a mask; softmax, dropout, the second bmm."""
    s = torch.bmm(q, k.transpose(d0, d1))
    if masked:
        s = (s.view(heads_shape) + mask).view(flat_shape)
    a = F.dropout(torch.softmax(s, -1), p, training, False)
    return torch.bmm(a, v)


def attention_bmm_fused(q, k, v, d0, d1, heads_shape=None, mask=None, flat_shape=None, p=0.0, training=False, *,
                        masked: bool):
    # Without a mask the heads do not matter: each (batch * head) row block is one head of one batch.
    heads = heads_shape[1] if masked else 1
    seq_q, seq_k = q.shape[1], k.shape[1]
    # reshape: a view wherever the (B*H, S, D) tensors allow one (BART's are contiguous), never an error
    o = ops.attention(q.reshape(-1, heads, seq_q, q.shape[2]), k.reshape(-1, heads, seq_k, k.shape[2]),
                      v.reshape(-1, heads, seq_k, v.shape[2]), mask if masked else None, p if training else 0.0, False,
                      1.0)
    return o.reshape(-1, seq_q, v.shape[2])


def _bmm_heads(m: Match, masked: bool) -> str | None:
    """q, k, v are (B*H, S, D); with a mask the scores are viewed as (B, H, Sq, Sk) with a constant
    H and back, the mask a float one that broadcasts to them."""
    q, k, v = m.value("q"), m.value("k"), m.value("v")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return "q, k and v are not all 3-D (batch * heads, seq, head_dim)"
    if not masked:
        return None
    heads_shape, mask = m["heads_shape"], m.value("mask")
    why = _per_head_view(heads_shape, q, k)
    if why:
        return why
    if not isinstance(m["flat_shape"], (tuple, list)) or len(m["flat_shape"]) != 3:
        return f"the scores are viewed back as {m['flat_shape']!r}, not (batch * heads, seq, seq)"
    # (a mask wider than q's dtype runs only under autocast, whose softmax is fp32 anyway: the op's sum)
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or mask.dim() > 4:
        return "the mask is not a float (additive) mask of at most 4 dims"
    heads = heads_shape[1]
    return _broadcast_to_scores("the mask", mask.shape, (q.shape[0] // heads, heads, q.shape[1], k.shape[1]))


def attention_bmm_flat_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, mask: torch.Tensor, p,
                            training):
    """The same on (B*H, S, D) tensors with a float mask added to the flat scores (B*H, Sq, Sk), no
    per-head view: SpeechT5's encoder adds its relative position scores, q's products with a
    table per query (`matmul(q.transpose(0, 1), pos.transpose(-2, -1)).transpose(0, 1)`), so."""
    s = torch.bmm(q, k.transpose(d0, d1)) + mask
    a = F.dropout(torch.softmax(s, -1), p, training, False)
    return torch.bmm(a, v)


def attention_bmm_flat_mask_fused(q, k, v, d0, d1, mask, p, training):
    # each (batch * head) row block a batch of one head; the mask's leading dim, if any, that batch's
    o = ops.attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), mask.unsqueeze(-3),
                      p if training else 0.0, False, 1.0)
    return o.squeeze(1)


def _bmm_flat_mask(m: Match) -> str | None:
    """q, k, v are (B*H, S, D); the mask a float one that broadcasts to the flat scores."""
    q, k, v, mask = m.value("q"), m.value("k"), m.value("v"), m.value("mask")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return "q, k and v are not all 3-D (batch * heads, seq, head_dim)"
    # (a mask wider than q's dtype runs only under autocast, whose softmax is fp32 anyway: the op's sum)
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or mask.dim() not in (2, 3):
        return "the mask is not a float (additive) mask of 2 or 3 dims"
    return _broadcast_to_scores("the mask", mask.shape, (q.shape[0], q.shape[1], k.shape[1]))


def attention_bmm_clamped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, heads_shape, mask: torch.Tensor,
                          fill, device, flat_shape, p, training):
    """XGLM's eager attention: BART's older chain with the masked scores clamped from below,
    `torch.max(scores + mask, torch.full((), finfo(dtype).min))` (so that 16-bit sums that overflow
    to -inf stay finite)."""
    s = torch.bmm(q, k.transpose(d0, d1))
    s = torch.max(s.view(heads_shape) + mask, torch.full((), fill, device=device)).view(flat_shape)
    a = F.dropout(torch.softmax(s, -1), p, training, False)
    return torch.bmm(a, v)


def attention_bmm_clamped_fused(q, k, v, d0, d1, heads_shape, mask, fill, device, flat_shape, p, training):
    # max(s + m, f) = s + max(m, f) for the floor f = finfo(dtype).min of the scores and the mask
    # (the filter's): a kept key's s + m is far above f; a dropped key's (m = f, or m = -inf) is f
    # either way, s being absorbed by f's rounding (|s| < ulp(f) / 2 in fp32 and bf16 alike, the op's
    # fp32 sum included). The floor is rounded as torch.full rounds it (to the default dtype).
    floor = _clamp_floor(fill)
    if floor != float("-inf"):
        mask = torch.clamp_min(mask, floor)
    return attention_bmm_fused(q, k, v, d0, d1, heads_shape, mask, flat_shape, p, training, masked=True)


def _clamp_floor(fill) -> float:
    return float(torch.tensor(fill, dtype=torch.get_default_dtype()))


def _clamp_is_finfo_min(m: Match) -> str | None:
    """The floor is -inf (no clamp) or finfo(dtype).min of the scores, which the mask has too, and
    not fp16: a 16-bit sum overflows to -inf before the clamp (XGLM's reason for it), which the
    op's fp32 sum does not, and a row masked whole would then differ."""
    fill, q, mask = m["fill"], m.value("q"), m.value("mask")
    if not is_number(fill) or not isinstance(q, torch.Tensor) or not isinstance(mask, torch.Tensor):
        return f"the clamp's floor is {fill!r}, not a constant number"
    floor = _clamp_floor(fill)
    if floor == float("-inf"):
        return None
    if torch.promote_types(q.dtype, mask.dtype) != mask.dtype:
        return f"the scores ({q.dtype}) are wider than the mask ({mask.dtype})"
    if mask.dtype == torch.float16:
        return "fp16 scores: their sum with the mask overflows to -inf before the clamp, the op's does not"
    if not mask.is_floating_point() or floor != torch.finfo(mask.dtype).min:
        return f"a floor {floor} that is not finfo({mask.dtype}).min: the clamp may change kept scores"
    return None


def _bmm_pattern(masked: bool) -> Pattern:
    return Pattern("attention_bmm_" + ("add_" if masked else "no_mask_") + "dropout", "attention",
                   functools.partial(attention_bmm, masked=masked),
                   functools.partial(attention_bmm_fused, masked=masked), ("attention",),
                   (_transposes_last_two, functools.partial(_bmm_heads, masked=masked), needs_number("p"),
                    needs_bool("training")))


def attention_alibi_baddbmm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi: torch.Tensor, d0, d1, beta,
                            alpha, heads_shape, mask: torch.Tensor, dtype, p, training, flat_shape):
    """BLOOM's attention: q, k, v (B*H, S, D); ALiBi (B*H, 1, Sk) added by `baddbmm` with the
    scaling as its alpha; the scores viewed per head (B, H, Sq, Sk) for the additive mask, the
    softmax in fp32 cast back, dropout, flattened back for the `bmm` with v."""
    s = alibi.baddbmm(batch1=q, batch2=k.transpose(d0, d1), beta=beta, alpha=alpha)
    s = s.view(heads_shape) + mask
    a = F.dropout(torch.softmax(s, -1, torch.float32).to(dtype), p, training, False)
    return torch.bmm(a.view(flat_shape), v)


def attention_alibi_baddbmm_fused(q, k, v, alibi, d0, d1, beta, alpha, heads_shape, mask, dtype, p, training,
                                  flat_shape):
    heads, seq_q, seq_k = heads_shape[1], q.shape[1], k.shape[1]
    bias = alibi.view(-1, heads, 1, alibi.shape[2])
    if beta != 1:
        bias = bias * beta
    o = ops.attention(q.view(-1, heads, seq_q, q.shape[2]), k.view(-1, heads, seq_k, k.shape[2]),
                      v.view(-1, heads, seq_k, v.shape[2]), bias + mask, p if training else 0.0, False, alpha)
    return o.reshape(-1, seq_q, v.shape[2])


def _alibi_baddbmm_shapes(m: Match) -> str | None:
    """q, k, v (B*H, S, D); ALiBi one row per (batch, head), broadcast over the queries; the scores
    viewed as (B, H, Sq, Sk) with a constant H and back; alpha and beta numbers."""
    q, k, v, alibi, mask = (m.value(n) for n in ("q", "k", "v", "alibi", "mask"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v, alibi)):
        return "q, k, v and the ALiBi bias are not all 3-D (batch * heads, seq, ...)"
    if alibi.shape[1] != 1 or alibi.shape[0] != q.shape[0]:
        return f"the ALiBi bias has shape {tuple(alibi.shape)}, not (batch * heads, 1, keys)"
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or not mask.is_floating_point():
        return "the mask is not a 4-D float (additive) mask"
    heads_shape = m["heads_shape"]
    if not isinstance(heads_shape, (tuple, list)) or len(heads_shape) != 4 or not is_number(heads_shape[1]) \
            or (is_number(q.shape[0]) and q.shape[0] % heads_shape[1]):
        return f"the scores are viewed as {heads_shape!r}, not (batch, heads, seq, seq) with a constant heads"
    flat_shape = m["flat_shape"]
    if not isinstance(flat_shape, (tuple, list)) or len(flat_shape) != 3:
        return f"the probabilities are viewed as {flat_shape!r}, not (batch * heads, seq, seq)"
    if not is_number(m["alpha"]) or not is_number(m["beta"]):
        return "baddbmm's alpha or beta is not a constant number"
    return None


def attention_chain_add_div(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, mask: torch.Tensor, scale,
                            dtype, p, training, *, upcast_qk: bool = False):
    """CodeGen's attention: the additive mask before the scaling, `(q k^T + mask) / scale`, the
    softmax cast to v's dtype, dropout; q and k cast to fp32 first (upcast_qk, as CodeGen writes it)."""
    if upcast_qk:
        q, k = q.to(torch.float32), k.to(torch.float32)
    s = (torch.matmul(q, k.transpose(d0, d1)) + mask) / scale
    a = F.dropout(torch.softmax(s, -1).to(dtype), p, training, False)
    return torch.matmul(a, v)


def attention_chain_add_div_fused(q, k, v, d0, d1, mask, scale, dtype, p, training, *, upcast_qk: bool = False):
    # (s + m) / c = s / c + m / c: the mask scaled as the scores are
    return ops.attention(q, k, v, mask / scale, p if training else 0.0, False, 1.0 / scale)


def attention_chain_mul_add_masked_fill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale,
                                        bias: torch.Tensor, mask: torch.Tensor, fill, dtype, p, training):
    """MPT's attention: scaled scores, ALiBi added, `masked_fill(mask, finfo.min)`, the softmax of
    an fp32 copy (`.float()`) cast to v's dtype, dropout."""
    s = torch.matmul(q, k.transpose(d0, d1)) * scale + bias
    s = s.masked_fill(mask, fill)
    a = F.dropout(torch.softmax(s.to(torch.float32), -1).to(dtype), p, training, False)
    return torch.matmul(a, v)


def attention_chain_mul_add_masked_fill_fused(q, k, v, d0, d1, scale, bias, mask, fill, dtype, p, training):
    # where the mask drops a key the unfused score is `fill`, whatever the bias: -inf for the op. The
    # bias keeps its dtype (MPT's fp32 ALiBi beside 16-bit scores promotes them, as the op's fp32 sum does)
    q, attn_mask = _masked_fill_as_op_mask(q, mask, bias, fill)
    return ops.attention(q, k, v, attn_mask, p if training else 0.0, False, scale)


def attention_chain_add_add(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale,
                            bias: torch.Tensor, mask: torch.Tensor, p, training, dtype=None, k_shape=None,
                            v_shape=None, k_heads=None, v_heads=None, *, scaling: str, upcast: bool = False,
                            repeat_kv: bool = False):
    """Scores scaled (scaling "div": MPNet's; "mul": Switch Transformers' and LongT5's eager
    attention, `* scaling`; "per_head": times a learned tensor per head, torchvision's Swin V2 in
    shifted windows; "none": q scaled before the product, timm's Swin with fused_attn off), a
    relative position bias added (`scores += position_bias`), then the additive mask (Swin's shifted
    windows' mask, tiled over the batch by the normalizer), softmax, dropout. upcast: the softmax in
    fp32 cast back to `dtype`, over k and v repeated per query group (repeat_kv): Inkling's eager
    attention."""
    if repeat_kv:
        k, v = _repeat_kv(k, k_shape, k_heads), _repeat_kv(v, v_shape, v_heads)
    s = torch.matmul(q, k.transpose(d0, d1))
    if scaling == "div":
        s = s / scale
    elif scaling in ("mul", "per_head"):
        s = s * scale
    s = s + bias
    a = torch.softmax(s + mask, -1, torch.float32).to(dtype) if upcast else torch.softmax(s + mask, -1)
    return torch.matmul(F.dropout(a, p, training, False), v)


def attention_chain_add_add_fused(q, k, v, d0, d1, scale=None, bias=None, mask=None, p=0.0, training=False,
                                  dtype=None, k_shape=None, v_shape=None, k_heads=None, v_heads=None, *,
                                  scaling: str, upcast: bool = False, repeat_kv: bool = False):
    if scaling == "per_head":
        # torchvision's Swin V2 in shifted windows: the learned scale per head (a tensor) moves onto
        # q, as for transformers' (attention_chain_per_head_scale_fused), the op's scale 1
        q, scale = (q * scale).to(q.dtype), 1.0
    # one float mask: the sum the unfused code adds in two steps (the op's dMask reaches both addends)
    return ops.attention(q, k, v, bias + mask, p if training else 0.0, False,
                         1.0 / scale if scaling == "div" else 1.0 if scaling == "none" else scale, repeat_kv)


def attention_chain_add_rounded_add(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale,
                                    bias: torch.Tensor, dtype, mask: torch.Tensor, p, training, *,
                                    scaling: str):
    """MPNet's `scores += position_bias` under autocast: the in-place update adds the fp32 bias to
    16-bit scores and stores the sum rounded to their dtype (canonical form: `(s + bias).to(dtype)`),
    then the fp32 mask and an fp32 softmax."""
    s = torch.matmul(q, k.transpose(d0, d1))
    s = ((s / scale if scaling == "div" else s * scale) + bias).to(dtype)
    a = F.dropout(torch.softmax(s + mask, -1), p, training, False)
    return torch.matmul(a, v)


def attention_chain_add_rounded_add_fused(q, k, v, d0, d1, scale, bias, dtype, mask, p, training, *,
                                          scaling: str):
    # The op's scores are fp32 throughout: neither the product nor its sum with the bias is
    # rounded to 16 bits, as the unfused code rounds both (the softmax's input is fp32 in both).
    return attention_chain_add_add_fused(q, k, v, d0, d1, scale, bias, mask, p, training, scaling=scaling)


def attention_chain_add_rounded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale,
                                bias: torch.Tensor, dtype, p, training, *, scaling: str, in_softmax: bool):
    """MPNet's `scores += position_bias` under autocast with no padding mask: the sum rounded to
    the 16-bit scores' dtype goes straight to the softmax. CUDA's autocast computes that softmax
    in fp32 (the cast stays); where it computes in the cast's dtype (CPU's), fusion/normalize.py
    has made the cast the softmax's dtype (in_softmax)."""
    s = torch.matmul(q, k.transpose(d0, d1))
    s = (s / scale if scaling == "div" else s * scale) + bias
    a = torch.softmax(s, -1, dtype) if in_softmax else torch.softmax(s.to(dtype), -1)
    return torch.matmul(F.dropout(a, p, training, False), v)


def attention_chain_add_rounded_fused(q, k, v, d0, d1, scale, bias, dtype, p, training, *, scaling: str,
                                      in_softmax: bool):
    # the op's scores and their sum with the bias stay fp32, unrounded (as for the masked form)
    scale = 1.0 / scale if scaling == "div" else scale
    return ops.attention(q, k, v, bias, p if training else 0.0, False, scale)


def _bias_over_the_scores(m: Match) -> str | None:
    """q, k, v 4-D and the added bias a float tensor that broadcasts to their (B, H, Sq, Sk) scores."""
    q, k, v, bias = m.value("q"), m.value("k"), m.value("v"), m.value("bias")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q, k and v are not all 4-D (batch, heads, seq, head_dim)"
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        return "the added bias is not a float tensor"
    return _broadcast_to_scores("the bias", bias.shape, (*q.shape[:-1], k.shape[-2]))


def _rounded_to_the_scores_dtype(m: Match) -> str | None:
    q = m.value("q")
    if not isinstance(q, torch.Tensor) or m["dtype"] != q.dtype:
        return f"the scores plus the bias are cast to {m['dtype']}, not to q's dtype"
    return None


def _two_masks_broadcast_to_the_scores(m: Match) -> str | None:
    """bias + mask must have the scores' shape up to broadcasting, and be formed at least as wide as
    the scores: the unfused code adds both to scores of q's dtype, so the op's mask, their sum, is
    the one it forms when q is no wider than the sum. A wider sum is autocast's (T5's fp32
    position bias beside bf16 q and k: scores, softmax and the op's mask all fp32)."""
    q, k, bias, mask = m.value("q"), m.value("k"), m.value("bias"), m.value("mask")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, bias, mask)):
        return "no shapes for q, k or the masks"
    try:
        both = torch.broadcast_shapes(bias.shape, mask.shape)
        scores = (*q.shape[:-1], k.shape[-2])
        if torch.broadcast_shapes(both, scores) != torch.Size(scores):
            return f"bias {tuple(bias.shape)} + mask {tuple(mask.shape)} broadcast beyond the scores {scores}"
    except RuntimeError:
        return f"bias {tuple(bias.shape)} and mask {tuple(mask.shape)} do not broadcast together"
    both = torch.promote_types(bias.dtype, mask.dtype)
    if torch.promote_types(both, q.dtype) != both:
        return (f"q ({q.dtype}) is wider than bias ({bias.dtype}) + mask ({mask.dtype}): "
                f"the op's mask would be their sum rounded to {both}")
    return None


def attention_chain_where_add(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, keep: torch.Tensor, fill,
                              fill_dtype, device, mask: torch.Tensor, dtype, p, training, scale=None, *,
                              upcast_qk: bool = False, scaling: str = "none"):
    """GPT-Neo's attention: unscaled scores (scale 1), `torch.where(causal, scores, tensor(finfo.min))`,
    the additive mask added after, the softmax cast to v's dtype, dropout; q and k cast to fp32
    first (upcast_qk, as GPT-Neo writes it). scaling "div": ImageGPT's, the scores divided by
    sqrt(head_dim) before the where ("mul": multiplied)."""
    if upcast_qk:
        q, k = q.to(torch.float32), k.to(torch.float32)
    s = torch.matmul(q, k.transpose(d0, d1))
    if scaling == "div":
        s = s / scale
    elif scaling == "mul":
        s = s * scale
    s = torch.where(keep, s, torch.tensor(fill, dtype=fill_dtype, device=device))
    a = F.dropout(torch.softmax(s + mask, -1).to(dtype), p, training, False)
    return torch.matmul(a, v)


def attention_chain_where_add_fused(q, k, v, d0, d1, keep, fill, fill_dtype, device, mask, dtype, p, training,
                                    scale=None, *, upcast_qk: bool = False, scaling: str = "none"):
    # The unfused score of a dropped key is fill + mask, whatever q k^T is; the op adds q k^T to it,
    # which the huge fill absorbs (|q k^T| < ulp(finfo.min) / 2): the same scores, so the same softmax.
    mask = mask.to(fill_dtype)  # the unfused sum is in the scores' dtype (fp32 beside a 16-bit mask)
    scale = 1.0 / scale if scaling == "div" else scale if scaling == "mul" else 1.0
    q, attn_mask = _fill_then_mask_as_op_mask(q, keep, mask, fill)
    return ops.attention(q, k, v, attn_mask, p if training else 0.0, False, scale)


def _fill_then_mask_as_op_mask(q: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, fill):
    """`where(keep, scores, fill) + mask` as the op's inputs (q, attn_mask): the mask where a key is
    kept, fill + mask where not (the huge fill absorbs q k^T). A row dropped whole (GPT-Neo's and
    ImageGPT's causal masks keep the diagonal; a custom one may not) by a finite fill gets its query
    zeroed: the op's scores there are fill + mask exactly, and neither q nor k gets a gradient from
    it, as through the where()."""
    if fill != float("-inf"):
        q = torch.where(keep.any(-1, keepdim=True), q, 0.0)
    return q, torch.where(keep, mask, mask + fill)


def attention_chain_fill_add(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, scale, mask: torch.Tensor,
                             fill, padding: torch.Tensor, p, training, *, scaling: str, fill_with: str,
                             dropout: bool):
    """Hand-written decoders that keep a causal mask and take a padding mask (nanoGPT's attention
    with padding): the scaled scores masked by `masked_fill(mask, fill)` (mask: what to drop) or
    `torch.where(mask, scores, fill)` (what to keep) with a constant fill, the additive padding mask
    added after, softmax, [dropout], @ v. Scaling "none": q scaled before the product (a key
    padding filled, then Swin's window mask added: fusion/normalize.py tiles it over the batch)."""
    s = torch.matmul(q, k.transpose(d0, d1))
    if scaling == "mul":
        s = s * scale
    elif scaling == "div":
        s = s / scale
    s = s.masked_fill(mask, fill) if fill_with == "masked_fill" else torch.where(mask, s, fill)
    a = torch.softmax(s + padding, -1)
    if dropout:
        a = F.dropout(a, p, training, False)
    return torch.matmul(a, v)


def attention_chain_fill_add_fused(q, k, v, d0, d1, scale=None, mask=None, fill=None, padding=None, p=0.0,
                                   training=False, *, scaling: str, fill_with: str, dropout: bool):
    # As GPT-Neo's (_fill_add_shapes has checked that the unfused sum is in the padding's dtype).
    keep = torch.logical_not(mask) if fill_with == "masked_fill" else mask
    q, attn_mask = _fill_then_mask_as_op_mask(q, keep, padding, fill)
    scale = scale if scaling == "mul" else 1.0 / scale if scaling == "div" else 1.0
    return ops.attention(q, k, v, attn_mask, p if dropout and training else 0.0, False, scale)


def _fill_add_shapes(m: Match) -> str | None:
    """q, k, v 4-D; the padding mask a float tensor that broadcasts to the scores (B, H, Sq, Sk), at
    least as wide as the scores (the unfused sum is then in its dtype, fill + padding too)."""
    q, k, v, padding = m.value("q"), m.value("k"), m.value("v"), m.value("padding")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q, k and v are not all 4-D (batch, heads, seq, head_dim)"
    if not isinstance(padding, torch.Tensor) or not padding.is_floating_point():
        return "the added mask is not a float tensor"
    scores = _scores_dtype(q)
    if torch.promote_types(scores, padding.dtype) != padding.dtype:
        return f"the added mask ({padding.dtype}) is narrower than the scores ({scores})"
    return _broadcast_to_scores("the added mask", padding.shape, (*q.shape[:-1], k.shape[-2]))


def _fill_add_pattern(scaling: str, fill_with: str, dropout: bool) -> Pattern:
    name = f"attention_chain_{'unscaled' if scaling == 'none' else scaling}_{fill_with}_add" \
        + ("_dropout" if dropout else "")
    opts = {"scaling": scaling, "fill_with": fill_with, "dropout": dropout}
    scaled = [_scale_is_number, needs_number("scale")] if scaling != "none" else []
    filters = [_transposes_last_two, *scaled, _bool_mask_over_scores, _fill_masks, _fill_add_shapes,
               *([needs_number("p"), needs_bool("training")] if dropout else [])]
    return Pattern(name, "attention", functools.partial(attention_chain_fill_add, **opts),
                   functools.partial(attention_chain_fill_add_fused, **opts), ("attention",), tuple(filters))


def _float_mask(name: str) -> Filter:
    def check(m: Match) -> str | None:
        mask = m.value(name)
        if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or mask.dim() > 4:
            return f"{name} is not a float (additive) mask of at most 4 dims"
        return None

    check.__name__ = f"_float_mask({name})"
    return check


def _bool_mask(name: str) -> Filter:
    def check(m: Match) -> str | None:
        mask = m.value(name)
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            return f"{name} is not a bool mask"
        return None

    check.__name__ = f"_bool_mask({name})"
    return check


def _fill_is_huge(m: Match) -> str | None:
    """GPT-Neo's fill is -inf or finfo(dtype).min, so that it absorbs the scores it replaces."""
    fill, dtype = m["fill"], m["fill_dtype"]
    if not is_number(fill) or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return f"the fill is {fill!r} in {dtype!r}, not a constant number in a float dtype"
    if fill != float("-inf") and fill != torch.finfo(dtype).min:
        return f"a finite fill {fill} that is not finfo({dtype}).min: it does not absorb the scores"
    return None


def attention_chain_per_head_scale(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d0, d1, logit_scale: torch.Tensor,
                                   bias: torch.Tensor, windows_shape, mask: torch.Tensor, heads_shape, p, training, *,
                                   windowed: bool):
    """Swin V2's cosine attention (transformers' Swinv2SelfAttention), q and k normalized before:
    the scores times a learned scale per head (`logit_scale`, the exp of a clamp, (H, 1, 1)), plus
    the relative position bias ((1, H, S, S)); in shifted windows (windowed) the window mask
    (nW, S, S) then added over a (batch, windows, heads, S, S) view, twice, as written there, and
    viewed back; softmax, dropout, @ v."""
    s = torch.matmul(q, k.transpose(d0, d1)) * logit_scale + bias
    if windowed:
        s = s.view(windows_shape) + mask.unsqueeze(1).unsqueeze(0)
        s = (s + mask.unsqueeze(1).unsqueeze(0)).view(heads_shape)
    a = F.dropout(torch.softmax(s, -1), p, training, False)
    return torch.matmul(a, v)


def attention_chain_per_head_scale_fused(q, k, v, d0, d1, logit_scale, bias, windows_shape=None, mask=None,
                                         heads_shape=None, p=0.0, training=False, *, windowed: bool):
    # The scale per head moves onto q (the op's scale is 1; logit_scale's gradient comes through
    # this product), back in q's dtype (logit_scale is an fp32 parameter beside 16-bit q).
    q_scaled = (q * logit_scale).to(q.dtype)
    attn_mask = bias
    if windowed:
        # the bias and the window mask as one (B, H, S, S) float mask: the window mask repeats every
        # nW entries of the batch, which no stride can express; its gradient reaches the bias
        # (shapes from q, k and the mask: the views' sizes may be symbolic in a dynamic capture)
        scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        window_mask = mask.unsqueeze(1).unsqueeze(0)
        per_window = bias.expand(scores).reshape(-1, mask.shape[0], *scores[1:])
        attn_mask = (per_window + window_mask + window_mask).reshape(scores)
    return ops.attention(q_scaled, k, v, attn_mask, p if training else 0.0, False, 1.0)


def _scale_moves_onto_q(q, k, v, scale) -> str | None:
    """Why a tensor scale of the scores cannot scale q instead: q, k, v must be 4-D and the scale a
    float tensor constant along the queries and keys (per head, or one number) that broadcasts to
    q without widening it."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q, k and v are not all 4-D (batch, heads, seq, head_dim)"
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        return "the scale is not a float tensor"
    if scale.dim() > 4 or any(n != 1 for n in scale.shape[-2:]):
        return f"the scale has shape {tuple(scale.shape)}: not constant along the queries and keys"
    try:
        if torch.broadcast_shapes(scale.shape, q.shape) != q.shape:
            return f"the scale {tuple(scale.shape)} broadcasts beyond q {tuple(q.shape)}"
    except RuntimeError:
        return f"the scale {tuple(scale.shape)} does not broadcast to q {tuple(q.shape)}"
    return None


def _scale_per_head(m: Match) -> str | None:
    return _scale_moves_onto_q(m.value("q"), m.value("k"), m.value("v"), m.value("scale"))


def _per_head_scale_and_bias(m: Match, windowed: bool) -> str | None:
    """4-D q, k, v; a float tensor scale constant along the queries and keys (per head, or one
    number), so it can scale q instead; a float bias over the scores; windowed: a 3-D float
    window mask (nW, Sq, Sk), the scores viewed as (B / nW, nW, H, Sq, Sk) and back to 4-D."""
    q, k, v, scale, bias = (m.value(n) for n in ("q", "k", "v", "logit_scale", "bias"))
    why = _scale_moves_onto_q(q, k, v, scale)
    if why:
        return why
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        return "the added bias is not a float tensor"
    scores = (*q.shape[:-1], k.shape[-2])
    why = _broadcast_to_scores("the bias", bias.shape, scores)
    if why or not windowed:
        return why
    mask, windows_shape, heads_shape = m.value("mask"), m["windows_shape"], m["heads_shape"]
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or mask.dim() != 3:
        return "the window mask is not a 3-D float (windows, seq, seq) tensor"
    windows = mask.shape[0]
    want = (q.shape[0] // windows, windows, *scores[1:])
    if q.shape[0] % windows or not isinstance(windows_shape, (tuple, list)) or len(windows_shape) != 5 \
            or any(is_number(got) and got not in (w, -1) for got, w in zip(windows_shape, want)):
        return f"the scores are viewed as {windows_shape!r}, not (batch / windows, windows, heads, seq, seq) = {want}"
    if not isinstance(heads_shape, (tuple, list)) or len(heads_shape) != 4 \
            or any(is_number(got) and got not in (w, -1) for got, w in zip(heads_shape, scores)):
        return f"the scores are viewed back as {heads_shape!r}, not {scores}"
    return _broadcast_to_scores("the window mask", mask.shape, (windows, *scores[2:]))


def _per_head_scale_pattern(windowed: bool) -> Pattern:
    name = "attention_chain_per_head_scale_add_" + ("window_mask_" if windowed else "") + "dropout"
    return Pattern(name, "attention", functools.partial(attention_chain_per_head_scale, windowed=windowed),
                   functools.partial(attention_chain_per_head_scale_fused, windowed=windowed), ("attention",),
                   (_transposes_last_two, functools.partial(_per_head_scale_and_bias, windowed=windowed),
                    needs_number("p"), needs_bool("training")))


def self_attention_mha(x: torch.Tensor, embed_dim, num_heads, in_w, in_b, dropout_p, out_w, out_b, training,
                       key_padding_mask, need_weights, attn_mask, separate, q_w, k_w, v_w,
                       average_attn_weights, is_causal):
    """nn.MultiheadAttention's functional core on one sequence, its projection weights packed or
    separate; the attention weights, computed when need_weights, unused (a use refuses the match)."""
    return F.multi_head_attention_forward(
        x, x, x, embed_dim, num_heads, in_w, in_b, None, None, False, dropout_p, out_w, out_b, training,
        key_padding_mask, need_weights, attn_mask, separate, q_w, k_w, v_w, None, None, average_attn_weights,
        is_causal)[0]


def self_attention_mha_fused(x, embed_dim, num_heads, in_w, in_b, dropout_p, out_w, out_b, training,
                             key_padding_mask, need_weights, attn_mask, separate, q_w, k_w, v_w,
                             average_attn_weights, is_causal, kinds):
    if separate:
        return _mha_fused(x, x, embed_dim, num_heads, (q_w, k_w, v_w), in_b, dropout_p, out_w, out_b,
                          training, key_padding_mask, need_weights, attn_mask, is_causal, kinds)
    seq, batch, _ = x.shape
    head_dim = embed_dim // num_heads
    qkv = F.linear(x, in_w, in_b).view(seq, batch, 3, num_heads, head_dim)  # one GEMM for q, k and v
    q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # each (batch, heads, seq, head_dim)
    return _mha_attend(q, k, v, embed_dim, dropout_p, out_w, out_b, training, key_padding_mask, need_weights,
                       attn_mask, is_causal, kinds)


def cross_attention_mha(x: torch.Tensor, memory: torch.Tensor, embed_dim, num_heads, in_w, in_b, dropout_p,
                        out_w, out_b, training, key_padding_mask, need_weights, attn_mask, separate, q_w, k_w,
                        v_w, average_attn_weights, is_causal):
    """nn.MultiheadAttention's functional core attending to another sequence (key is value: a
    decoder's memory, a pooling probe's tokens); weights as in self_attention_mha."""
    return F.multi_head_attention_forward(
        x, memory, memory, embed_dim, num_heads, in_w, in_b, None, None, False, dropout_p, out_w, out_b, training,
        key_padding_mask, need_weights, attn_mask, separate, q_w, k_w, v_w, None, None, average_attn_weights,
        is_causal)[0]


def cross_attention_mha_fused(x, memory, embed_dim, num_heads, in_w, in_b, dropout_p, out_w, out_b, training,
                              key_padding_mask, need_weights, attn_mask, separate, q_w, k_w, v_w,
                              average_attn_weights, is_causal, kinds):
    if separate:
        return _mha_fused(x, memory, embed_dim, num_heads, (q_w, k_w, v_w), in_b, dropout_p, out_w, out_b,
                          training, key_padding_mask, need_weights, attn_mask, is_causal, kinds)
    w_q, w_kv = in_w.split([embed_dim, 2 * embed_dim])
    return _mha_fused(x, memory, embed_dim, num_heads, (w_q, w_kv), in_b, dropout_p, out_w, out_b, training,
                      key_padding_mask, need_weights, attn_mask, is_causal, kinds)


def attention_mha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim, num_heads, in_w,
                  in_b, dropout_p, out_w, out_b, training, key_padding_mask, need_weights, attn_mask,
                  separate, q_w, k_w, v_w, average_attn_weights, is_causal):
    """nn.MultiheadAttention's functional core on a query, key and value of their own: DETR's
    decoder (its self-attention's query and key the tokens plus their positions, the value the
    tokens; its cross-attention's key the memory plus its positions, the value the memory),
    Mask2Former's masked cross-attention; weights as in self_attention_mha."""
    return F.multi_head_attention_forward(
        query, key, value, embed_dim, num_heads, in_w, in_b, None, None, False, dropout_p, out_w, out_b,
        training, key_padding_mask, need_weights, attn_mask, separate, q_w, k_w, v_w, None, None,
        average_attn_weights, is_causal)[0]


def attention_mha_fused(query, key, value, embed_dim, num_heads, in_w, in_b, dropout_p, out_w, out_b,
                        training, key_padding_mask, need_weights, attn_mask, separate, q_w, k_w, v_w,
                        average_attn_weights, is_causal, kinds):
    if not separate:
        q_w, k_w, v_w = in_w.split([embed_dim, embed_dim, embed_dim])  # unpacked: fx traces no tuple() of it
    return _mha_fused(query, key, embed_dim, num_heads, (q_w, k_w, v_w), in_b, dropout_p, out_w, out_b,
                      training, key_padding_mask, need_weights, attn_mask, is_causal, kinds, value=value)


def _mha_fused(x, memory, embed_dim, num_heads, weights, in_b, dropout_p, out_w, out_b, training,
               key_padding_mask, need_weights, attn_mask, is_causal, kinds, value=None):
    """The query from x, key and value from memory (the value from `value` where given), with
    three projection weights or a query one and a packed key-value one (2 x embed_dim rows); in_b
    packs the three biases."""
    (seq_q, batch, _), seq_k = x.shape, memory.shape[0]
    head_dim = embed_dim // num_heads
    if len(weights) == 3:  # a tuple of the pattern's own: its length is known while tracing
        w_q, w_k, w_v = weights
        b_q, b_k, b_v = (None, None, None) if in_b is None else in_b.split([embed_dim, embed_dim, embed_dim])
        k, v = (F.linear(t, w, b).view(seq_k, batch, num_heads, head_dim).permute(1, 2, 0, 3)
                for t, w, b in ((memory, w_k, b_k), (memory if value is None else value, w_v, b_v)))
    else:
        w_q, w_kv = weights
        b_q, b_kv = (None, None) if in_b is None else in_b.split([embed_dim, 2 * embed_dim])
        kv = F.linear(memory, w_kv, b_kv).view(seq_k, batch, 2, num_heads, head_dim)
        k, v = kv.permute(2, 1, 3, 0, 4).unbind(0)  # each (batch, heads, seq_k, head_dim)
    q = F.linear(x, w_q, b_q).view(seq_q, batch, num_heads, head_dim).permute(1, 2, 0, 3)
    return _mha_attend(q, k, v, embed_dim, dropout_p, out_w, out_b, training, key_padding_mask, need_weights,
                       attn_mask, is_causal, kinds)


def _mha_attend(q, k, v, embed_dim, dropout_p, out_w, out_b, training, key_padding_mask, need_weights,
                attn_mask, is_causal, kinds):
    """The op on (batch, heads, seq, head_dim) q, k, v with F.multi_head_attention_forward's masks,
    then the out-projection, back in (seq_q, batch, embed_dim)."""
    (batch, heads, seq_q, _), seq_k = q.shape, k.shape[2]
    if is_causal and key_padding_mask is None and not need_weights:
        # as F.multi_head_attention_forward does there: attn_mask is only the hint's causal mask
        mask, causal = None, True
    else:
        mask, causal = _mha_mask(batch, heads, seq_q, seq_k, key_padding_mask, attn_mask, *kinds), False
    o = ops.attention(q, k, v, mask, dropout_p if training else 0.0, causal)
    return F.linear(o.permute(2, 0, 1, 3).reshape(seq_q, batch, embed_dim), out_w, out_b)


def _mha_mask(batch, heads, seq_q, seq_k, key_padding_mask, attn_mask, mask_bool: bool, mask_per_head: bool,
              padding_bool: bool):
    """The op's mask from F.multi_head_attention_forward's: attn_mask (seq_q, seq_k) or (batch *
    heads, seq_q, seq_k), key_padding_mask (batch, seq_k), each boolean (True: masked out, the
    reverse of the op's) or additive (the flags, from _mha_kinds, say which: the replacement is
    traced with them as constants). Two masks become one, as multi_head_attention_forward merges
    them: boolean AND, else -inf where a boolean one masks, or the additive ones added."""
    a = p = None
    if attn_mask is not None:
        shape = (batch, heads, seq_q, seq_k) if mask_per_head else (1, 1, seq_q, seq_k)
        a = attn_mask.view(shape)
        a = ~a if mask_bool else a  # boolean: True keeps a key, as the op reads it
    if key_padding_mask is not None:
        p = key_padding_mask.view(batch, 1, 1, seq_k)
        p = ~p if padding_bool else p
    if a is None or p is None:
        return p if a is None else a
    if mask_bool and padding_bool:
        return a & p
    if mask_bool or padding_bool:
        keep, additive = (a, p) if mask_bool else (p, a)
        return torch.where(keep, additive, float("-inf"))
    return a + p


def _mha_kinds(m: Match) -> dict:
    """The masks' kinds for the replacement: (attn_mask boolean, attn_mask per batch and head,
    key padding mask boolean)."""
    mask, kpm = m.value("attn_mask"), m.value("key_padding_mask")
    return {"kinds": (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool,
                      isinstance(mask, torch.Tensor) and mask.dim() == 3,
                      isinstance(kpm, torch.Tensor) and kpm.dtype == torch.bool)}


def _mha_masks(m: Match, cross: bool, general: bool = False) -> str | None:
    """Constant flags and sizes, a batched query, and masks of the shapes
    F.multi_head_attention_forward takes. `cross`: the key and value one tensor, `memory`;
    `general`: the query, key and value (a key and a value of one batch and length)."""
    for name in ("is_causal", "need_weights", "separate"):
        if not isinstance(m[name], bool):
            return f"{name} is not a constant bool"
    if not is_number(m["embed_dim"]) or not is_number(m["num_heads"]):
        return "embed_dim / num_heads are not constants"
    x = m.value("query" if general else "x")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "the query is not batched (seq, batch, embed_dim)"
    batch, seq_q = x.shape[1], x.shape[0]
    memory = m.value("key") if general else m.value("memory") if cross else x
    seq_k = memory.shape[0] if isinstance(memory, torch.Tensor) else None
    if general:
        value = m.value("value")
        if not isinstance(memory, torch.Tensor) or not isinstance(value, torch.Tensor) or memory.dim() != 3 \
                or value.dim() != 3 or tuple(memory.shape[:2]) != (seq_k, batch) \
                or tuple(value.shape[:2]) != (seq_k, batch):
            return "a key and a value that are not (seq_k, batch, features) of the query's batch"
    weights = ("q_w", "k_w", "v_w") if m["separate"] else ("in_w",)
    if not all(isinstance(m.value(w), torch.Tensor) for w in weights):
        return "projection weights that are not tensors"
    mask, kpm = m.value("attn_mask"), m.value("key_padding_mask")
    if m["attn_mask"] is None and m["is_causal"]:
        return "is_causal without a mask (nn.MultiheadAttention raises on it)"
    if m["attn_mask"] is not None:
        if not isinstance(mask, torch.Tensor):
            return "no metadata for attn_mask"
        heads = int(m["num_heads"])
        if tuple(mask.shape) not in ((seq_q, seq_k), (batch * heads, seq_q, seq_k)):
            return (f"attn_mask of shape {tuple(mask.shape)}, not (seq_q, seq_k) or "
                    "(batch * heads, seq_q, seq_k)")
    if m["key_padding_mask"] is not None:
        if not isinstance(kpm, torch.Tensor) or tuple(kpm.shape) != (batch, seq_k):
            return "a key padding mask that is not (batch, seq_k)"
    return None


# The grouped-KV spellings come before plain SDPA, which would otherwise take the repeated K and V.
PATTERNS = (
    Pattern("sdpa_repeat_interleave_kv", "attention", sdpa_repeat_interleave_kv, sdpa_gqa_fused, ("attention",),
            (needs_number("dropout_p", "n_rep"), needs_bool("is_causal"))),
    Pattern("sdpa_expand_kv", "attention", sdpa_expand_kv, sdpa_gqa_fused, ("attention",),
            (needs_number("dropout_p"), needs_bool("is_causal"), _kv_repeated_over_heads)),
    Pattern("sdpa_expand_flatten_kv", "attention", sdpa_expand_flatten_kv, sdpa_gqa_fused, ("attention",),
            (needs_number("dropout_p"), needs_bool("is_causal"), _kv_expanded_per_group)),
    Pattern("sdpa_expand_kv_before_transpose", "attention", sdpa_expand_kv_before_transpose,
            sdpa_gqa_before_transpose_fused, ("attention",),
            (needs_number("dropout_p"), needs_bool("is_causal"), _kv_repeated_over_heads_before_transpose)),
    Pattern("sdpa", "attention", sdpa, sdpa_fused, ("attention",),
            (needs_number("dropout_p"), needs_bool("is_causal", "enable_gqa"), _sdpa_dims),
            derive=_sdpa_layout),
    # gpt-oss's eager attention with sinks, over repeat_kv or not, with or without a mask
    *(_sinks_pattern(masked, repeat_kv) for masked, repeat_kv in itertools.product((True, False), (True, False))),
    # Flint's: scores and softmax in fp32 from upcast q and k, no row max, the cast before the dropout
    *(_sinks_fp32_pattern(masked, repeat_kv)
      for masked, repeat_kv in itertools.product((True, False), (True, False))),
    # Granite's sinks as a sigmoid(logsumexp - sink) scale of the output; MiMo-V2-Flash's layers
    # without sinks (the row max subtracted all the same)
    *(pattern(masked, repeat_kv)
      for pattern in (_sink_scale_pattern, functools.partial(_sinks_pattern, with_sinks=False))
      for masked, repeat_kv in ((True, True), (False, True), (True, False))),
    # transformers' eager_attention_forward over repeat_kv (with or without a mask, Gemma 2's cap);
    # before the chains below, which would otherwise take the repeated K and V
    *(_chain_pattern("mul", masking, True, "upcast", softcap=softcap, repeat_kv=True) for masking, softcap in
      itertools.product(("add", ""), (False, True))),
    *(_chain_pattern("mul", masking, dropout, softmax, softcap=True) for masking, dropout, softmax in
      itertools.product(("add", ""), (True, False), ("upcast", "plain"))),
    # GPT-J's eager chain on q and k cast to fp32 (16-bit models); before the plain chains
    _chain_pattern("div", "add", True, "cast", upcast_qk=True),
    # BigBird-Pegasus's decoder: the cast to v's dtype after the dropout
    *(_chain_pattern("mul", masking, True, "cast_after") for masking in ("add", "")),
    *(_chain_pattern(*opts) for opts in itertools.product(
        ("mul", "div"), ("add", "masked_fill", "where", ""), (True, False), ("plain", "upcast", "cast"))),
    # the fill a 0-d tensor of the scores' finfo.min (ImageGPT's causal where; GPT-Neo's with no padding mask)
    *(_chain_pattern(scaling, "where_tensor", dropout, softmax) for scaling, dropout, softmax
      in itertools.product(("mul", "div", "none"), (True, False), ("plain", "cast"))),
    # q scaled before the product, `(q * scale) @ k^T` (timm's explicit attention, Hiera's; XLM's
    # `q / sqrt(d)`, then `masked_fill_` and `softmax(scores.float())`), or never scaled (T5's)
    *(_chain_pattern("none", masking, dropout, softmax) for masking, dropout, softmax in
      itertools.product(("add", "masked_fill", "where", ""), (True, False), ("plain", "upcast"))),
    # the key already laid out as k^T, no transpose before the product (SqueezeBERT's); after the
    # chains above, which take a written transpose themselves
    *(_chain_pattern(*opts, k_transposed=True) for opts in itertools.product(
        ("mul", "div"), ("add", ""), (True, False), ("plain", "upcast"))),
    *(_chain_pattern("none", masking, dropout, "plain", k_transposed=True) for masking, dropout in
      itertools.product(("add", ""), (True, False))),
    # and channels first, q^T @ k on (B, C, N) maps, the output v @ P^T (timm's iFormer written out)
    *(_chain_pattern(scaling, "", dropout, "plain", k_transposed=True, v_transposed=True)
      for scaling, dropout in itertools.product(("none", "mul", "div"), (True, False))),
    # ALiBi and the older Hugging Face spellings (BLOOM, CodeGen, MPT, GPT-Neo)
    Pattern("attention_alibi_baddbmm", "attention", attention_alibi_baddbmm, attention_alibi_baddbmm_fused,
            ("attention",), (_transposes_last_two, _alibi_baddbmm_shapes, needs_number("p"), needs_bool("training"),
                             _casts_back_to_q)),
    *(Pattern("attention_chain_add_div" + ("_upcast_q_k" if upcast else ""), "attention",
              functools.partial(attention_chain_add_div, upcast_qk=upcast),
              functools.partial(attention_chain_add_div_fused, upcast_qk=upcast), ("attention",),
              (_transposes_last_two, _scale_is_number, needs_number("scale", "p"), needs_bool("training"),
               _float_mask("mask"), _cast_is_a_no_op, *([_q_k_v_share_a_dtype] if upcast else [])))
      for upcast in (True, False)),
    Pattern("attention_chain_mul_add_masked_fill", "attention", attention_chain_mul_add_masked_fill,
            attention_chain_mul_add_masked_fill_fused, ("attention",),
            (_transposes_last_two, _scale_is_number, needs_number("scale", "p"), needs_bool("training"),
             _float_mask("bias"), _bool_mask("mask"), _fill_masks, _cast_is_a_no_op)),
    *(Pattern(f"attention_chain_{'unscaled' if scaling == 'none' else scaling}_add_add", "attention",
              functools.partial(attention_chain_add_add, scaling=scaling),
              functools.partial(attention_chain_add_add_fused, scaling=scaling), ("attention",),
              (_transposes_last_two,
               *([_scale_is_number, needs_number("scale")] if scaling in ("div", "mul") else []),
               *([_scale_per_head] if scaling == "per_head" else []),
               needs_number("p"), needs_bool("training"), _float_mask("bias"), _float_mask("mask"),
               _two_masks_broadcast_to_the_scores))
      for scaling in ("div", "mul", "per_head", "none")),
    *(Pattern("attention_chain_mul_add_add_upcast" + ("_repeat_kv" if repeat_kv else ""), "attention",
              functools.partial(attention_chain_add_add, scaling="mul", upcast=True, repeat_kv=repeat_kv),
              functools.partial(attention_chain_add_add_fused, scaling="mul", upcast=True,
                                repeat_kv=repeat_kv),
              ("attention",), (_transposes_last_two, _scale_is_number, needs_number("scale", "p"),
                               needs_bool("training"), _float_mask("bias"), _float_mask("mask"),
                               _two_masks_broadcast_to_the_scores, _casts_back_to_q,
                               *([_kv_repeated_over_heads] if repeat_kv else [])))
      for repeat_kv in (True, False)),
    *(Pattern(f"attention_chain_{scaling}_add_rounded_add", "attention",
              functools.partial(attention_chain_add_rounded_add, scaling=scaling),
              functools.partial(attention_chain_add_rounded_add_fused, scaling=scaling), ("attention",),
              (_transposes_last_two, _scale_is_number, needs_number("scale", "p"), needs_bool("training"),
               _float_mask("bias"), _float_mask("mask"), _rounded_to_the_scores_dtype,
               _two_masks_broadcast_to_the_scores))
      for scaling in ("div", "mul")),
    *(Pattern(f"attention_chain_{scaling}_add_rounded" + ("_in_softmax" if in_softmax else ""), "attention",
              functools.partial(attention_chain_add_rounded, scaling=scaling, in_softmax=in_softmax),
              functools.partial(attention_chain_add_rounded_fused, scaling=scaling, in_softmax=in_softmax),
              ("attention",), (_transposes_last_two, _scale_is_number, needs_number("scale", "p"),
                               needs_bool("training"), _bias_over_the_scores, _rounded_to_the_scores_dtype))
      for scaling in ("div", "mul") for in_softmax in (False, True)),
    *(Pattern("_".join(["attention_chain", *([scaling] if scaling != "none" else []), "where_add",
                        *(["upcast_q_k"] if upcast else [])]), "attention",
              functools.partial(attention_chain_where_add, upcast_qk=upcast, scaling=scaling),
              functools.partial(attention_chain_where_add_fused, upcast_qk=upcast, scaling=scaling),
              ("attention",),
              (_transposes_last_two, needs_number("p"), needs_bool("training"), _bool_mask("keep"), _float_mask("mask"),
               _fill_is_huge, _cast_is_a_no_op, *([_q_k_v_share_a_dtype] if upcast else []),
               *([_scale_is_number] if scaling != "none" else [])))
      for upcast in (True, False) for scaling in ("none", "div", "mul")),
    # a causal mask by masked_fill or where with a constant fill, then a padding mask added
    *(_fill_add_pattern(*opts) for opts in itertools.product(("mul", "div", "none"), ("masked_fill", "where"),
                                                              (True, False))),
    *(Pattern("attention_bmm_of_heads_" + ("add" if masked else "no_mask"), "attention",
              functools.partial(attention_bmm_of_heads, masked=masked),
              functools.partial(attention_bmm_of_heads_fused, masked=masked), ("attention",),
              (functools.partial(_heads_flattened_and_back, masked=masked), _scale_is_number,
               needs_number("scale", "p"), needs_bool("training"), _cast_is_a_no_op))
      for masked in (True, False)),
    _bmm_scaled_k_pattern(add_bias=True),
    _bmm_scaled_k_pattern(add_bias=False),
    # DeBERTa's (v1) attention: q scaled before the product, relative-position scores (or 0) added
    _add_masked_fill_pattern(add_bias=True),
    _add_masked_fill_pattern(add_bias=False),
    # Swin V2's cosine attention: a learned scale per head, the relative position bias, shifted windows' mask
    _per_head_scale_pattern(windowed=True),
    _per_head_scale_pattern(windowed=False),
    # BART's older eager attention on (B*H, S, D) tensors (TrOCR, MVP, LED's decoder)
    _bmm_pattern(masked=True),
    # ... with the mask added to the flat scores (SpeechT5's encoder: its relative position scores)
    Pattern("attention_bmm_flat_add_dropout", "attention", attention_bmm_flat_mask,
            attention_bmm_flat_mask_fused, ("attention",),
            (_transposes_last_two, _bmm_flat_mask, needs_number("p"), needs_bool("training"))),
    _bmm_pattern(masked=False),
    # XGLM's: the same with the masked scores clamped at finfo.min
    Pattern("attention_bmm_add_clamp_dropout", "attention", attention_bmm_clamped, attention_bmm_clamped_fused,
            ("attention",), (_transposes_last_two, functools.partial(_bmm_heads, masked=True), _clamp_is_finfo_min,
                             needs_number("p"), needs_bool("training"))),
    Pattern("self_attention_mha", "attention", self_attention_mha, self_attention_mha_fused, ("attention",),
            (needs_number("dropout_p"), needs_bool("training"), functools.partial(_mha_masks, cross=False)),
            derive=_mha_kinds),
    Pattern("cross_attention_mha", "attention", cross_attention_mha, cross_attention_mha_fused, ("attention",),
            (needs_number("dropout_p"), needs_bool("training"), functools.partial(_mha_masks, cross=True)),
            derive=_mha_kinds),
    # the query, key and value each its own (DETR's positions added to the query and key only);
    # after the two above, which take a shared one with one projection GEMM where they can
    Pattern("attention_mha", "attention", attention_mha, attention_mha_fused, ("attention",),
            (needs_number("dropout_p"), needs_bool("training"),
             functools.partial(_mha_masks, cross=True, general=True)),
            derive=_mha_kinds),
)
