"""Attention spellings become trifuse.attention: SDPA with each of its arguments, GQA by repeated
K/V, the explicit softmax chains, nn.MultiheadAttention's self-attention."""
import copy
import functools
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
import trifuse
from _device import DEVICE
from _fusing import available_counts, check_against_unfused, fuse_via, needs_ops, trifuse_ops_run
from tolerances import assert_close
from torch import nn

pytestmark = needs_ops("attention")
B, H, S, D = 2, 4, 6, 8
CAPTURES = ["fx", "dynamo"]


def qkv(h_kv=H):
    return torch.randn(B, H, S, D), torch.randn(B, h_kv, S, D), torch.randn(B, h_kv, S, D)


class Fn(nn.Module):
    """Wraps a plain function of (q, k, v) so it can be fused as a module."""

    def __init__(self, fn, **buffers):
        super().__init__()
        self.fn = fn
        for name, t in buffers.items():
            self.register_buffer(name, t)

    def forward(self, q, k, v):
        return self.fn(self, q, k, v)


PAD = torch.ones(B, 1, 1, S, dtype=torch.bool)
PAD[0, ..., -2:] = False
ADDITIVE = torch.randn(B, 1, S, S)


def sdpa_plain(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_causal_scaled(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)


def sdpa_bool_mask(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m.mask)


def sdpa_float_mask(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, m.mask, 0.0, False)


def sdpa_gqa_flag(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def sdpa_one_kv_head_broadcast(m, q, k, v):  # Falcon's multi-query attention: no enable_gqa
    return F.scaled_dot_product_attention(q, k, v, None, 0.0, is_causal=True)


def sdpa_repeat_interleave(m, q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1))


def repeat_kv(hidden, n_rep):  # transformers' repeat_kv
    b, h, s, d = hidden.shape
    return hidden[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def sdpa_repeat_kv(m, q, k, v):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)


def repeat_kv_before_transpose(x, n_rep, dim=3):  # torchtitan's repeat_kv, on (B, S, Hkv, D)
    b, s, h, d = x.shape
    shape = (b, s, h, n_rep, d) if dim == 3 else (b, s, n_rep, h, d)
    return torch.unsqueeze(x, dim=dim).expand(*shape).reshape(b, s, h * n_rep, d)


def sdpa_repeat_kv_before_transpose(m, q, k, v):
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, S, Hkv, D), as projected, before the heads move
    k, v = repeat_kv_before_transpose(k, 2).transpose(1, 2), repeat_kv_before_transpose(v, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_expand_flatten(m, q, k, v):  # torchtune's and gpt-fast's GQA repeat
    expand_shape = (B, k.shape[1], 2, -1, D)
    k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
    v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_expand_getitem_reshape_method(m, q, k, v):  # repeat_kv with .unsqueeze(2) for [:, :, None]
    k = k.unsqueeze(2).expand(B, k.shape[1], 2, S, D).reshape(B, -1, S, D)
    v = v.unsqueeze(2).expand(B, v.shape[1], 2, S, D).reshape(B, -1, S, D)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_repeat_kv_groups_outer(m, q, k, v):
    """Repeated with the groups outermost (query head i reads key head i % Hkv): no GQA."""
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    k, v = (repeat_kv_before_transpose(k, 2, dim=2).transpose(1, 2),
            repeat_kv_before_transpose(v, 2, dim=2).transpose(1, 2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def chain_repeat_kv(m, q, k, v):  # transformers' eager_attention_forward (Llama, Mistral, Qwen2, ...)
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35
    w = w + m.mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=m.training)
    return torch.matmul(w, v)


def chain_softcap_repeat_kv(m, q, k, v):  # Gemma 2's, with its cap
    k, v = repeat_kv(k, 2), repeat_kv(v, 2)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35
    w = torch.tanh(w / 1.5) * 1.5
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=m.training)
    return torch.matmul(w, v)


def chain_mul_additive(m, q, k, v):  # BERT's and GPT-2's old eager code
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
    probs = F.softmax(scores + m.mask, dim=-1)
    return torch.matmul(F.dropout(probs, 0.0, m.training), v)


def chain_div_no_mask(m, q, k, v):
    return torch.softmax(q @ k.transpose(2, 3) / math.sqrt(D), dim=-1) @ v


def chain_masked_fill(m, q, k, v):  # nanoGPT without flash
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
    att = att.masked_fill(m.causal[:, :, :S, :S] == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def chain_upcast(m, q, k, v):  # transformers' eager_attention_forward
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35
    w = w + m.mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=m.training)
    return torch.matmul(w, v)


def chain_where_neg_inf(m, q, k, v):  # the mask says what to keep
    att = (q @ k.transpose(-2, -1)) * 0.3
    att = torch.where(m.keep, att, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def chain_where_finfo_min(m, q, k, v):  # transformers' older eager code: finfo.min, rows masked whole
    att = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    att = torch.where(m.keep_some_rows_none, att, torch.finfo(torch.float32).min)
    att = F.dropout(F.softmax(att, dim=-1), 0.1, m.training)
    return torch.matmul(att, v)


def chain_masked_fill_finfo_min(m, q, k, v):
    att = (q @ k.transpose(-2, -1)) * 0.3
    att = att.masked_fill(~m.keep_some_rows_none, torch.finfo(torch.float32).min)
    return F.softmax(att, dim=-1) @ v


def chain_cast_to_v(m, q, k, v):  # transformers 5's GPT-2 eager_attention_forward
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.35
    w = w + m.mask
    w = F.softmax(w, dim=-1)
    w = w.type(v.dtype)
    w = F.dropout(w, p=0.0, training=m.training)
    return torch.matmul(w, v)


def chain_cast_after_dropout(m, q, k, v):  # BigBird-Pegasus's decoder: the cast at the product, after the dropout
    w = F.dropout(F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.35 + m.mask, dim=-1), p=0.0, training=m.training)
    return torch.matmul(w.to(v.dtype), v)


def chain_softcap(m, q, k, v):  # Gemma 2's eager_attention_forward: the logit soft cap
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35
    w = w / 1.5
    w = torch.tanh(w)
    w = w * 1.5
    w = w + m.mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=m.training)
    return torch.matmul(w, v)


def chain_softcap_no_mask(m, q, k, v):
    w = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * 0.35 / 30.0) * 30.0
    return torch.matmul(F.softmax(w, dim=-1), v)


CAUSAL = torch.tril(torch.ones(S, S)).view(1, 1, S, S)
KEEP = torch.tril(torch.ones(S, S, dtype=torch.bool)).view(1, 1, S, S) & PAD  # every row keeps key 0
KEEP_SOME_ROWS_NONE = KEEP.clone().expand(B, 1, S, S).clone()
KEEP_SOME_ROWS_NONE[1, 0, 2] = False  # one query row of batch 1 sees no key
# A bool mask added to the scores adds 1 where True (no key is dropped): BERT's eager attention
# handed a bool mask (Grounding DINO's text encoder)
ADDED_BOOL = KEEP.expand(B, 1, S, S).clone()


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("fn, buffers, h_kv, pattern", [
    (sdpa_plain, {}, H, "sdpa"),
    (sdpa_causal_scaled, {}, H, "sdpa"),
    (sdpa_bool_mask, {"mask": PAD}, H, "sdpa"),
    (sdpa_float_mask, {"mask": ADDITIVE}, H, "sdpa"),
    (sdpa_gqa_flag, {}, 2, "sdpa"),
    (sdpa_one_kv_head_broadcast, {}, 1, "sdpa"),
    (sdpa_repeat_interleave, {}, 2, "sdpa_repeat_interleave_kv"),
    (sdpa_repeat_kv, {}, 2, "sdpa_expand_kv"),
    (sdpa_repeat_kv_before_transpose, {}, 2, "sdpa_expand_kv_before_transpose"),
    (sdpa_expand_flatten, {}, 2, "sdpa_expand_flatten_kv"),
    (sdpa_expand_getitem_reshape_method, {}, 2, "sdpa_expand_kv"),
    (chain_mul_additive, {"mask": ADDITIVE}, H, "attention_chain_mul_add_dropout"),
    (chain_mul_additive, {"mask": ADDED_BOOL}, H, "attention_chain_mul_add_dropout"),
    (chain_div_no_mask, {}, H, "attention_chain_div_no_mask_no_dropout"),
    (chain_masked_fill, {"causal": CAUSAL}, H, "attention_chain_mul_masked_fill_no_dropout"),
    (chain_upcast, {"mask": ADDITIVE}, H, "attention_chain_mul_add_dropout_upcast"),
    (chain_where_neg_inf, {"keep": KEEP}, H, "attention_chain_mul_where_no_dropout"),
    (chain_where_finfo_min, {"keep_some_rows_none": KEEP_SOME_ROWS_NONE}, H, "attention_chain_div_where_dropout"),
    (chain_masked_fill_finfo_min, {"keep_some_rows_none": KEEP_SOME_ROWS_NONE}, H,
     "attention_chain_mul_masked_fill_no_dropout"),
    (chain_cast_to_v, {"mask": ADDITIVE}, H, "attention_chain_mul_add_dropout_cast"),
    (chain_cast_after_dropout, {"mask": ADDITIVE}, H, "attention_chain_mul_add_dropout_cast_after"),
    (chain_softcap, {"mask": ADDITIVE}, H, "attention_chain_mul_softcap_add_dropout_upcast"),
    (chain_softcap_no_mask, {}, H, "attention_chain_mul_softcap_no_mask_no_dropout"),
    (chain_repeat_kv, {"mask": ADDITIVE}, 2, "attention_chain_mul_add_dropout_upcast_repeat_kv"),
    (chain_softcap_repeat_kv, {}, 2, "attention_chain_mul_softcap_no_mask_dropout_upcast_repeat_kv"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_spelling_fuses_and_matches(fn, buffers, h_kv, pattern, capture):
    make = functools.partial(Fn, fn, **buffers)
    report = check_against_unfused(make, qkv(h_kv), capture)
    assert report.by_pattern() == {pattern: 1}


def test_finfo_min_rows_masked_whole_are_the_mean_of_v():
    """The unfused softmax of a row filled whole with finfo.min is uniform: the output there is
    V's mean over the keys (not 0, SDPA's rule for bool masks), and so is the fused one."""
    model = fuse_via(Fn(chain_masked_fill_finfo_min, keep_some_rows_none=KEEP_SOME_ROWS_NONE), "dynamo")
    q, k, v = qkv()
    torch.testing.assert_close(model(q, k, v)[1, :, 2], v[1].mean(-2))
    assert trifuse.report(model).by_pattern() == {"attention_chain_mul_masked_fill_no_dropout": 1}


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_transformers_attention_block(arch, attn_implementation):
    """transformers 5's eager attention (GPT-2's ends in `.type(value.dtype)` after the softmax),
    one block: fused into trifuse.attention, outputs and gradients as unfused."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_embd=H * D, n_head=H, n_positions=S, attn_pdrop=0.0, resid_pdrop=0.0,
                            attn_implementation=attn_implementation)
        make = functools.partial(tf.models.gpt2.modeling_gpt2.GPT2Attention, cfg, layer_idx=0)
    else:
        cfg = tf.BertConfig(hidden_size=H * D, num_attention_heads=H, attention_probs_dropout_prob=0.0,
                            attn_implementation=attn_implementation)
        make = functools.partial(tf.models.bert.modeling_bert.BertSelfAttention, cfg)
    mask = ADDITIVE.clone()
    mask[0, ..., -2:] = torch.finfo(torch.float32).min  # padding, as transformers builds it
    report = check_against_unfused(lambda: _FirstOutput(make(), mask), (torch.randn(B, S, H * D),), "dynamo")
    expected = ("sdpa" if attn_implementation == "sdpa" else
                "attention_chain_mul_add_dropout_cast" if arch == "gpt2" else "attention_chain_mul_add_dropout")
    assert report.by_pattern() == {expected: 1}


class _FirstOutput(nn.Module):
    """The attention module's output for a fixed mask (a buffer: the op takes no mask gradient)."""

    def __init__(self, inner, mask):
        super().__init__()
        self.inner = inner
        self.register_buffer("mask", mask)

    def forward(self, x):
        return self.inner(x, attention_mask=self.mask)[0]


def test_trifuse_op_runs():
    model = fuse_via(Fn(sdpa_causal_scaled), "dynamo")
    q, k, v = (t.requires_grad_() for t in qkv())
    names = trifuse_ops_run(lambda: model(q, k, v).sum().backward())
    assert "trifuse::attention" in names


def test_dropout_p_is_carried_and_off_in_eval():
    def sdpa_dropout(m, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if m.training else 0.0)

    model = fuse_via(Fn(sdpa_dropout), "dynamo")
    q, k, v = qkv()
    assert not torch.equal(model(q, k, v), model(q, k, v))  # dropout draws fresh masks
    model.eval()
    torch.testing.assert_close(model(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_multihead_attention_self_attention():
    class MHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    report = check_against_unfused(MHA, (torch.randn(B, S, H * D),), "dynamo")
    assert report.by_pattern() == {"self_attention_mha": 1}


@pytest.mark.parametrize("batch_first, bias, padded, need_weights", [
    (True, True, True, False),
    (False, False, False, False),
    (True, True, True, True),  # nn.MultiheadAttention's default: weights computed, then dropped
])
def test_multihead_attention_cross_attention(batch_first, bias, padded, need_weights):
    """A decoder's cross-attention (nn.TransformerDecoderLayer's multihead_attn): the query from
    one sequence, key and value one tensor from another of a different length. Weights computed
    (need_weights, the module's default) but unused do not keep it unfused."""
    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(H * D, H, bias=bias, batch_first=batch_first)

        def forward(self, x, memory):
            pad = None
            if padded:  # (batch, memory length); the first sequence's last two keys masked
                batch, seq_k = memory.shape[:2] if batch_first else memory.shape[1::-1]
                pad = torch.zeros(batch, seq_k, dtype=torch.bool, device=memory.device)
                pad[0, -2:] = True
            return self.mha(x, memory, memory, key_padding_mask=pad, need_weights=need_weights)[0]

    x, memory = torch.randn(B, S, H * D), torch.randn(B, S + 3, H * D)
    if not batch_first:
        x, memory = x.transpose(0, 1), memory.transpose(0, 1)
    report = check_against_unfused(Cross, (x, memory), "dynamo")
    assert report.by_pattern() == {"cross_attention_mha": 1}


class _DetrDecoderAttention(nn.Module):
    """DETR's decoder layer as its repository writes it (and Deformable DETR's and Mask2Former's
    decoders): self-attention on the tokens with their query positions added to the query and
    key but not the value, then cross-attention whose key is the memory plus its positions and
    whose value is the memory; `masked`: Mask2Former's per-head boolean mask on the cross-attention
    (True drops a key), a row masked whole opened again, as Mask2Former does before each layer."""

    def __init__(self, batch_first: bool, masked: bool, separate: bool):
        super().__init__()
        kdim = H * D + 4 if separate else None  # other key and value widths: separate projection weights
        self.self_attn = nn.MultiheadAttention(H * D, H, batch_first=batch_first)
        self.cross_attn = nn.MultiheadAttention(H * D, H, batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.masked, self.batch_first = masked, batch_first

    def forward(self, tgt, query_pos, memory, pos, drop):
        q = k = tgt + query_pos
        tgt = tgt + self.self_attn(q, k, tgt, need_weights=False)[0]
        mask, pad = None, None
        if self.masked:
            mask = drop & (drop.sum(-1, keepdim=True) != drop.shape[-1])  # a row dropped whole: all open
        else:
            pad = drop[::H, 0]  # (batch, memory length): the first query's row per image
        out = self.cross_attn(tgt + query_pos, memory + pos, memory, attn_mask=mask, key_padding_mask=pad)
        return tgt + out[0]


@pytest.mark.parametrize("batch_first, masked, separate", [
    (False, False, False),  # DETR's: (seq, batch, width), a key padding mask
    (True, True, False),  # Mask2Former's masked attention
    (False, True, True),  # key and value wider than the query: separate projection weights
])
def test_multihead_attention_with_a_query_key_and_value_of_their_own(batch_first, masked, separate):
    """Positions added to the query and key but not the value (DETR's self-attention: query and
    key one tensor, the value another; its cross-attention: all three different) once stayed
    unfused, the two patterns above needing key and value to be one tensor."""
    torch.manual_seed(0)
    seq_q, seq_k, width = S, S + 3, H * D + (4 if separate else 0)
    tgt, query_pos = torch.randn(seq_q, B, H * D), torch.randn(seq_q, B, H * D)
    memory, pos = torch.randn(seq_k, B, width), torch.randn(seq_k, B, width)
    drop = torch.rand(B * H, seq_q, seq_k) < 0.4
    drop[1, 2] = True  # a row dropped whole
    if batch_first:
        tgt, query_pos, memory, pos = (t.transpose(0, 1) for t in (tgt, query_pos, memory, pos))
    report = check_against_unfused(lambda: _DetrDecoderAttention(batch_first, masked, separate),
                                   (tgt, query_pos, memory, pos, drop), "dynamo")
    assert report.by_pattern() == {"attention_mha": 2}, report.table()


def test_multihead_attention_whose_weights_are_used_is_left_and_reported():
    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(H * D, H, batch_first=True)

        def forward(self, x):
            out, weights = self.mha(x, x, x)
            return out, weights

    report = check_against_unfused(Weighted, (torch.randn(B, S, H * D),), "dynamo")
    assert report.by_pattern() == {}
    assert any(pattern == "self_attention_mha" and "outside the pattern" in reason
               for _, _, pattern, reason in report.rejected())


# F.multi_head_attention_forward's masks, as code that calls it itself passes them (WavLM: separate
# q/k/v weights, a per-head float attn_mask that is learned, a boolean key padding mask). Boolean
# masks there are True where a key is masked out.
def _mha_masks(attn, padding):
    """(attn_mask, key_padding_mask) of each kind for a (S, S) self-attention of batch B."""
    if attn == "bool":
        attn_mask = torch.ones(S, S, dtype=torch.bool).triu(1)  # causal, written as a mask
        attn_mask[-1, 0] = True
    elif attn == "float":
        attn_mask = torch.randn(S, S)
    elif attn == "per-head":
        attn_mask = torch.randn(B * H, S, S)
    else:
        attn_mask = None
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, -2:] = True
    if padding == "bool":
        return attn_mask, pad
    if padding == "float":
        return attn_mask, torch.zeros(B, S).masked_fill(pad, -1e4)
    return attn_mask, None


class CallsMHA(nn.Module):
    """F.multi_head_attention_forward called directly on (S, B, E), as WavLM does; a float
    attn_mask is a parameter here (WavLM's gated position bias is computed from its own)."""

    def __init__(self, separate, attn, padding, need_weights, is_causal=False):
        super().__init__()
        e = H * D
        count = 3 if separate else 1
        self.w = nn.ParameterList([nn.Parameter(torch.randn(e, e) / e**0.5) for _ in range(count)])
        if not separate:
            self.w[0] = nn.Parameter(torch.randn(3 * e, e) / e**0.5)
        self.in_b = nn.Parameter(torch.randn(3 * e))
        self.out = nn.Linear(e, e)
        attn_mask, pad = _mha_masks(attn, padding)
        if attn_mask is not None and attn_mask.is_floating_point():
            self.attn_mask = nn.Parameter(attn_mask)
        else:
            self.register_buffer("attn_mask", attn_mask)
        self.register_buffer("pad", pad)
        self.separate, self.need_weights, self.is_causal = separate, need_weights, is_causal

    def forward(self, x):
        x = x.transpose(0, 1)
        separate = self.separate
        out, _ = F.multi_head_attention_forward(
            x, x, x, H * D, H, torch.empty([0]) if separate else self.w[0], self.in_b, None, None, False, 0.0,
            self.out.weight, self.out.bias, self.training, self.pad, need_weights=self.need_weights,
            attn_mask=self.attn_mask, use_separate_proj_weight=separate,
            q_proj_weight=self.w[0] if separate else None, k_proj_weight=self.w[1] if separate else None,
            v_proj_weight=self.w[2] if separate else None, is_causal=self.is_causal)
        return out.transpose(0, 1)


@pytest.mark.parametrize("separate, attn, padding, need_weights", [
    (True, "per-head", "bool", True),  # WavLM's call
    (True, "per-head", "float", False),
    (False, "float", "bool", True),
    (False, "bool", "bool", False),
    (False, "bool", "float", True),
    (True, "float", None, False),
    (False, None, "bool", False),
    (False, "per-head", None, True),
])
def test_multi_head_attention_forward_called_directly(separate, attn, padding, need_weights):
    """Every mask kind and pairing, packed or separate projection weights: one fused attention,
    outputs and every gradient (a float attn_mask's too, through the op's mask gradient) by the
    oracle rule; the two masks merged as F.multi_head_attention_forward merges them."""
    report = check_against_unfused(lambda: CallsMHA(separate, attn, padding, need_weights),
                                   (torch.randn(B, S, H * D),), "dynamo")
    assert report.by_pattern() == {"self_attention_mha": 1}


def test_multi_head_attention_forward_causal_hint_with_need_weights_uses_the_mask():
    """With need_weights, F.multi_head_attention_forward applies attn_mask and ignores the is_causal
    hint; so does the fused op (a mask that is not causal tells the two apart)."""
    report = check_against_unfused(lambda: CallsMHA(False, "float", None, True, is_causal=True),
                                   (torch.randn(B, S, H * D),), "dynamo")
    assert report.by_pattern() == {"self_attention_mha": 1}


def test_multihead_attention_pooling_head_fuses_through_dynamo():
    """SigLIP's pooling head: fx could trace it, with the nn.MultiheadAttention a module call no
    pattern looks into, so fuse captures it with Dynamo instead. The LayerNorm fuses, and the
    attention (a learned probe attending to the tokens, its weights computed by default and
    dropped) fuses as cross-attention."""
    class PoolingHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.probe = nn.Parameter(torch.randn(1, 1, H * D))
            self.attention = nn.MultiheadAttention(H * D, H, batch_first=True)
            self.layernorm = nn.LayerNorm(H * D)

        def forward(self, x):
            h = self.attention(self.probe.repeat(x.shape[0], 1, 1), x, x)[0]
            return self.layernorm(h)

    report = check_against_unfused(PoolingHead, (torch.randn(B, S, H * D),), "fx")
    assert report.counts() == available_counts({"layer_norm": 1, "attention": 1})
    assert report.by_pattern()["cross_attention_mha"] == 1
    assert "PoolingHead, dynamo" in report.table()


# The older Hugging Face spellings (BLOOM, CodeGen, MPT, GPT-Neo), Dynamo only (as their blocks are captured)
ALIBI = torch.randn(B * H, 1, S)


def alibi_baddbmm(m, q, k, v):  # BLOOM
    q3, k3, v3 = q.reshape(B * H, S, D), k.reshape(B * H, S, D), v.reshape(B * H, S, D)
    w = m.alibi.baddbmm(batch1=q3, batch2=k3.transpose(-1, -2), beta=1.0, alpha=0.3).view(B, H, S, -1) + m.mask
    w = F.dropout(F.softmax(w, dim=-1, dtype=torch.float32).to(q3.dtype), p=0.0, training=m.training)
    return torch.bmm(w.view(B * H, S, -1), v3)


def chain_add_div(m, q, k, v):  # CodeGen: the mask before the scaling
    w = (torch.matmul(q, k.transpose(-1, -2)) + m.mask) / 2.5
    return torch.matmul(F.dropout(F.softmax(w, dim=-1).to(v.dtype), p=0.0, training=m.training), v)


def chain_alibi_masked_fill(m, q, k, v):  # MPT: ALiBi, then masked_fill with finfo.min (one row dropped whole)
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3 + m.alibi.view(B, H, 1, S)[0]
    # fp32's min also in the float64 reference, whose `.float()` would make fp64's min -inf
    w = w.masked_fill(~m.keep_some_rows_none, torch.finfo(torch.float32).min)
    return torch.matmul(F.dropout(F.softmax(w.float(), dim=-1).to(v.dtype), p=0.0, training=m.training), v)


def chain_unscaled_where_add(m, q, k, v):  # GPT-Neo: no scale, a tensor fill, then the additive mask
    w = torch.matmul(q, k.transpose(-1, -2))
    w = torch.where(m.keep, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device))
    return torch.matmul(F.dropout(F.softmax(w + m.mask, dim=-1).to(v.dtype), p=0.0, training=m.training), v)


def chain_imagegpt(m, q, k, v):  # ImageGPT: the scaled scores' causal where, the fill a 0-d tensor
    w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    w = torch.where(m.keep, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device))
    w = torch.nn.Softmax(dim=-1)(w).type(v.dtype)
    return torch.matmul(F.dropout(w, p=0.0, training=m.training), v)


def chain_imagegpt_padded(m, q, k, v):  # ImageGPT with a padding mask, added after the causal where
    w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    w = torch.where(m.keep, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device))
    w = torch.nn.Softmax(dim=-1)(w + m.mask).type(v.dtype)
    return torch.matmul(F.dropout(w, p=0.0, training=m.training), v)


def chain_position_bias_in_place(m, q, k, v):  # MPNet: `scores += position_bias`, then the padding mask
    w = torch.matmul(q, k.transpose(-1, -2)) / 2.5
    w += m.bias
    w = w + m.mask
    return torch.matmul(F.dropout(F.softmax(w, dim=-1), p=0.0, training=m.training), v)


def chain_position_bias_alone_in_place(m, q, k, v):  # the same without a mask: the plain chain
    w = torch.matmul(q, k.transpose(-1, -2)) / 2.5
    w += m.bias
    return torch.matmul(F.dropout(F.softmax(w, dim=-1), p=0.0, training=m.training), v)


def chain_t5_eager(m, q, k, v):  # Switch Transformers' / LongT5's eager attention: `* scaling`, bias, mask
    w = torch.matmul(q, k.transpose(2, 3)) * 0.4
    w = w + m.bias
    w = w + m.mask
    return torch.matmul(F.dropout(F.softmax(w, dim=-1), p=0.0, training=m.training), v)


POSITION_BIAS = torch.randn(1, H, S, S)


@pytest.mark.parametrize("fn, buffers, pattern", [
    (alibi_baddbmm, {"alibi": ALIBI, "mask": ADDITIVE}, "attention_alibi_baddbmm"),
    (chain_position_bias_in_place, {"bias": POSITION_BIAS, "mask": ADDITIVE}, "attention_chain_div_add_add"),
    (chain_t5_eager, {"bias": POSITION_BIAS, "mask": ADDITIVE}, "attention_chain_mul_add_add"),
    (chain_position_bias_alone_in_place, {"bias": POSITION_BIAS}, "attention_chain_div_add_dropout"),
    (chain_add_div, {"mask": ADDITIVE}, "attention_chain_add_div"),
    (chain_alibi_masked_fill, {"alibi": ALIBI, "keep_some_rows_none": KEEP_SOME_ROWS_NONE},
     "attention_chain_mul_add_masked_fill"),
    (chain_unscaled_where_add, {"keep": KEEP, "mask": ADDITIVE},
     "attention_chain_where_add"),
    (chain_imagegpt, {"keep": KEEP_SOME_ROWS_NONE}, "attention_chain_div_where_tensor_dropout_cast"),
    (chain_imagegpt_padded, {"keep": KEEP, "mask": ADDITIVE}, "attention_chain_div_where_add"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_older_hf_spelling_fuses_and_matches(fn, buffers, pattern):
    report = check_against_unfused(functools.partial(Fn, fn, **buffers), qkv(), "dynamo")
    assert report.by_pattern() == {pattern: 1}


# Hand-written decoders that keep a causal mask and take a padding mask: the causal one applied by
# masked_fill or where with a constant fill, the additive padding added after.
HF_PADDING = torch.zeros(B, 1, 1, S)
HF_PADDING[0, ..., -2:] = torch.finfo(torch.float32).min  # as transformers builds additive masks
HF_PADDING[1, ..., -1] = torch.finfo(torch.float32).min  # also under batch 1's row dropped whole


def hand_masked_fill_then_padding(m, q, k, v):  # nanoGPT's attention, given a padding mask
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
    att = att.masked_fill(m.causal[:, :, :S, :S] == 0, float("-inf"))
    att = att + m.mask
    return F.softmax(att, dim=-1) @ v


def hand_where_then_padding_dropout(m, q, k, v):
    att = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    att = torch.where(m.keep, att, float("-inf"))
    att = F.dropout(F.softmax(att + m.mask, dim=-1), 0.1, m.training)
    return torch.matmul(att, v)


def hand_finfo_min_fill_then_finfo_min_padding(m, q, k, v):
    """A query row dropped whole (batch 1, query 2): every unfused score there is finfo.min +
    padding, finfo.min or -inf where the padding is finfo.min too: the softmax uniform over the
    keys the padding keeps. The op's row (its query zeroed, its mask fill + padding) is the same."""
    att = (q @ k.transpose(-2, -1)) * 0.3
    att = att.masked_fill(~m.keep_some_rows_none, torch.finfo(torch.float32).min)
    return F.softmax(att + m.mask, dim=-1) @ v


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("fn, buffers, pattern", [
    (hand_masked_fill_then_padding, {"causal": CAUSAL, "mask": ADDITIVE}, "attention_chain_mul_masked_fill_add"),
    (hand_masked_fill_then_padding, {"causal": CAUSAL, "mask": HF_PADDING}, "attention_chain_mul_masked_fill_add"),
    (hand_where_then_padding_dropout, {"keep": KEEP, "mask": ADDITIVE}, "attention_chain_div_where_add_dropout"),
    (hand_finfo_min_fill_then_finfo_min_padding, {"keep_some_rows_none": KEEP_SOME_ROWS_NONE, "mask": HF_PADDING},
     "attention_chain_mul_masked_fill_add"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_causal_fill_then_padding_fuses_and_matches(fn, buffers, pattern, capture):
    report = check_against_unfused(functools.partial(Fn, fn, **buffers), qkv(), capture)
    assert report.by_pattern() == {pattern: 1}


def hand_fill_then_padding_fp16(m, q, k, v, dtype=torch.float16):  # a 16-bit model: finfo(fp16).min, fp16 padding
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    att = torch.where(m.keep, (q @ k.transpose(-2, -1)) * 0.3, torch.finfo(q.dtype).min)
    return F.softmax(att + m.mask.to(dtype), dim=-1) @ v


def test_causal_fill_then_padding_fuses_in_16_bits():
    check_16_bit_chain(Fn, hand_fill_then_padding_fp16, {"keep": KEEP, "mask": ADDITIVE},
                       "attention_chain_mul_where_add")


def hand_finite_fill_then_padding(m, q, k, v):  # -1e4: whether a partly open row underflows depends on the scores
    att = (q @ k.transpose(-2, -1)) * 0.3
    return F.softmax(att.masked_fill(m.causal == 0, -1e4) + m.mask, dim=-1) @ v


def hand_fill_then_half_padding(m, q, k, v):  # fp16 padding beside fp32 scores: the sum is fp32, fill + padding not
    att = torch.where(m.keep, (q @ k.transpose(-2, -1)) * 0.3, torch.finfo(torch.float32).min)
    return F.softmax(att + m.mask.half(), dim=-1) @ v


@pytest.mark.parametrize("fn, buffers, reason", [
    (hand_finite_fill_then_padding, {"causal": CAUSAL, "mask": ADDITIVE}, "a finite fill"),
    (hand_fill_then_half_padding, {"keep": KEEP, "mask": ADDITIVE}, "narrower than the scores"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_causal_fill_then_padding_near_misses_are_left_saying_why(fn, buffers, reason):
    report = check_against_unfused(functools.partial(Fn, fn, **buffers), qkv(), "dynamo")
    assert report.by_pattern() == {}
    assert reason in str(report), str(report)


def chain_inkling(m, q, k, v, n_rep=2):  # Inkling's eager attention: scale, position bias, mask, fp32 softmax
    if n_rep > 1:  # transformers' repeat_kv returns k and v as they are for one kv head per query head
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35
    w = w + m.bias
    w = w + m.mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(w, p=0.0, training=m.training), v)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("h_kv, pattern", [(2, "attention_chain_mul_add_add_upcast_repeat_kv"),
                                           (H, "attention_chain_mul_add_add_upcast")])
def test_position_bias_with_upcast_softmax_over_repeated_kv_fuses(h_kv, pattern, capture):
    chain = functools.partial(chain_inkling, n_rep=H // h_kv)
    make = functools.partial(Fn, chain, bias=POSITION_BIAS, mask=ADDITIVE)
    report = check_against_unfused(make, qkv(h_kv), capture)
    assert report.by_pattern() == {pattern: 1}


class PositionBiasAttention(nn.Module):
    """A chain of (q, k, v) with a learned position bias (a parameter: its gradient is checked)
    and an additive mask."""

    def __init__(self, chain):
        super().__init__()
        self.chain = chain
        self.bias = nn.Parameter(POSITION_BIAS.clone())
        self.register_buffer("mask", ADDITIVE)

    def forward(self, q, k, v):
        return self.chain(self, q, k, v)


@pytest.mark.parametrize("chain, pattern", [
    (chain_t5_eager, "attention_chain_mul_add_add"),
    (chain_position_bias_in_place, "attention_chain_div_add_rounded_add"),
    # CUDA's autocast computes the softmax of the rounded sum in fp32 (the cast stays), CPU's in fp16
    (chain_position_bias_alone_in_place,
     "attention_chain_div_add_rounded" + ("_in_softmax" if DEVICE == "cpu" else "")),
], ids=["t5_eager", "mpnet_in_place", "mpnet_no_mask"])
def test_position_bias_attention_under_autocast_fuses(chain, pattern):
    """Switch Transformers' / LongT5's and MPNet's eager attention under fp16 autocast: fp16 q, k, v
    (the autocast projections'), the fp32 position bias and mask promote the scores to fp32 (MPNet's
    in-place `scores += position_bias` rounds that sum to fp16 first: `(s + bias).to(fp16)`), the
    softmax is fp32, and autocast casts it down for the product with v. The op takes the fp32 sum
    of bias and mask, its scores never rounded; output and gradients (q, k, v, the bias) by the
    oracle rule against the module in float64 without autocast, PyTorch's own error the unfused
    module's under autocast. The bias's fp32 gradient is an fp16 computation's (it comes from the
    fp16 product with v) and is judged as one, rounded to fp16: the op's backward forms the
    softmax's row term from its fp16 output, as FlashAttention's does, where the unfused fp32
    softmax sums fp32 probabilities (up to 3x the unfused error on 8 seeds, ~2e-3 of the largest
    entry, within fp16's floor)."""
    check_under_fp16_autocast(functools.partial(PositionBiasAttention, chain), H, pattern)


def check_under_fp16_autocast(make, h_kv: int, pattern: str) -> None:
    """Fuses `make()` through Dynamo and runs it and the unfused module under fp16 autocast on fp16
    q, k, v: the pattern replaced, the output fp16 as the unfused one's, and the output and every
    input and parameter gradient (judged at fp16's precision) by the oracle rule against the module
    in float64 without autocast, PyTorch's own error the unfused module's under autocast."""
    torch.manual_seed(0)
    unfused = make().to(DEVICE)
    exact = copy.deepcopy(unfused).double()
    model = fuse_via(copy.deepcopy(unfused), "dynamo")
    q, k, v = (t.to(DEVICE).half() for t in qkv(h_kv))
    dy = torch.randn(B, H, S, D, device=DEVICE).half()
    params = [f"grad {n}" for n, _ in unfused.named_parameters()]  # the fused host's names differ
    runs = {}
    for name, m, dtype in (("fused", model, torch.float16), ("unfused", unfused, torch.float16),
                           ("exact", exact, torch.float64)):
        xs = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast(DEVICE, dtype=torch.float16, enabled=dtype == torch.float16):
            out = m(*xs)
        out.backward(dy.to(dtype))
        runs[name] = {"output": out, **{f"grad {n}": x.grad for n, x in zip("qkv", xs)},
                      **{n: p.grad for n, p in zip(params, m.parameters(), strict=True)}}
    assert trifuse.report(model).by_pattern() == {pattern: 1}
    assert runs["fused"]["output"].dtype == runs["unfused"]["output"].dtype == torch.float16
    for what, exact_value in runs["exact"].items():
        assert_close(what, runs["fused"][what].half(), exact_value, runs["unfused"][what].half())


# 16-bit models spelled with their casts inside the module. The float64 copy of such a module
# rounds to fp16 exactly as the fp32 one does (PyTorch's own error would read 0 and the oracle's
# bound fall to its floor), so `dtype` is an argument: float64 runs the same maths unrounded, the
# oracle, and the fp16 module is PyTorch's own.
def chain_gptj_fp16(m, q, k, v, dtype=torch.float16):  # GPT-J in a 16-bit model: q and k cast to fp32 before the product
    up = torch.promote_types(dtype, torch.float32)
    q, k, v = q.to(dtype).to(up), k.to(dtype).to(up), v.to(dtype)
    w = torch.matmul(q, k.transpose(-1, -2)) / 2.5 + m.mask.to(dtype)
    return torch.matmul(F.dropout(F.softmax(w, dim=-1).to(v.dtype), p=0.0, training=m.training), v)


def chain_codegen_fp16(m, q, k, v, dtype=torch.float16):
    up = torch.promote_types(dtype, torch.float32)
    q, k, v = q.to(dtype).to(up), k.to(dtype).to(up), v.to(dtype)
    w = (torch.matmul(q, k.transpose(-1, -2)) + m.mask.to(dtype)) / 2.5
    return torch.matmul(F.dropout(F.softmax(w, dim=-1).to(v.dtype), p=0.0, training=m.training), v)


def chain_gpt_neo_fp16(m, q, k, v, dtype=torch.float16):
    up = torch.promote_types(dtype, torch.float32)
    q, k, v = q.to(dtype).to(up), k.to(dtype).to(up), v.to(dtype)
    w = torch.matmul(q, k.transpose(-1, -2))
    w = torch.where(m.keep, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device))
    return torch.matmul(F.dropout(F.softmax(w + m.mask.to(dtype), dim=-1).to(v.dtype), p=0.0, training=m.training), v)


def check_16_bit_chain(make, fn, buffers: dict, pattern: str) -> None:
    """Fuses `make(fn, **buffers)` (fn casting to fp16 inside) through Dynamo and checks its fp16
    output against `fn` in float64 by the oracle rule, PyTorch's own error the fp16 module's."""
    torch.manual_seed(0)
    unfused = make(fn, **buffers).eval()
    exact = copy.deepcopy(unfused).double()
    exact.fn = functools.partial(fn, dtype=torch.float64)
    model = fuse_via(copy.deepcopy(unfused), "dynamo")
    q, k, v = qkv()
    out = model(q, k, v)
    assert trifuse.report(model).by_pattern() == {pattern: 1}
    assert out.dtype == torch.float16
    assert_close("output", out, exact(q.double(), k.double(), v.double()), unfused(q, k, v))


@pytest.mark.parametrize("fn, buffers, pattern", [
    (chain_gptj_fp16, {"mask": ADDITIVE}, "attention_chain_div_add_dropout_cast_upcast_q_k"),
    (chain_codegen_fp16, {"mask": ADDITIVE}, "attention_chain_add_div_upcast_q_k"),
    (chain_gpt_neo_fp16, {"keep": KEEP, "mask": ADDITIVE}, "attention_chain_where_add_upcast_q_k"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_fp32_upcast_of_16_bit_q_and_k_fuses(fn, buffers, pattern):
    """GPT-J's, CodeGen's and GPT-Neo's `query.to(torch.float32)` in a 16-bit model: the op takes the
    fp16 q and k (its scores are fp32) and fp16 v (outputs only, as for the rotary's upcast)."""
    check_16_bit_chain(Fn, fn, buffers, pattern)


# ---------------------------------------------------------------------------------------------
# Negatives
# ---------------------------------------------------------------------------------------------


def chain_finite_fill(m, q, k, v):
    att = (q @ k.transpose(-2, -1)) * 0.3
    att = att.masked_fill(m.causal == 0, -1e4)  # a finite fill: a fully masked row would differ
    return F.softmax(att, dim=-1) @ v


def chain_tensor_scale(m, q, k, v):  # transformers' GPT-2 eager: the scale is a tensor
    w = torch.matmul(q, k.transpose(-1, -2))
    w = w / torch.full([], D ** 0.5, dtype=w.dtype, device=w.device)
    return torch.matmul(torch.softmax(w, dim=-1), v)


def chain_softmax_other_dim(m, q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-2) @ v


def chain_returns_probs(m, q, k, v):  # output_attentions=True: the probabilities are needed
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1)
    return p @ v, p


def chain_where_finite_fill(m, q, k, v):  # -1e4 is not finfo.min: a partly open row might not underflow
    att = torch.where(m.keep, (q @ k.transpose(-2, -1)) * 0.3, -1e4)
    return F.softmax(att, dim=-1) @ v


def chain_where_fill_first(m, q, k, v):  # where(drop, -inf, s): True drops, the other polarity
    att = torch.where(m.keep, float("-inf"), (q @ k.transpose(-2, -1)) * 0.3)
    return F.softmax(att, dim=-1) @ v


def chain_unscaled_where_finite_fill(m, q, k, v):  # GPT-Neo's spelling with a fill that q k^T is not lost in
    w = torch.where(m.keep, torch.matmul(q, k.transpose(-1, -2)), torch.tensor(-1e4, dtype=q.dtype, device=q.device))
    return torch.matmul(F.softmax(w + m.mask, dim=-1).to(v.dtype), v)


def chain_where_tensor_fill_in_other_dtype(m, q, k, v):  # fp16's finfo.min beside fp32 scores
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    w = torch.where(m.keep, w, torch.tensor(torch.finfo(torch.float16).min, dtype=torch.float16, device=w.device))
    return torch.matmul(F.softmax(w, dim=-1), v)


def chain_where_tensor_finite_fill(m, q, k, v):  # a 0-d tensor fill that is not finfo.min
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    w = torch.where(m.keep, w, torch.tensor(-1e4, dtype=w.dtype, device=w.device))
    return torch.matmul(F.softmax(w, dim=-1), v)


def chain_softcap_mismatched(m, q, k, v):  # tanh(s / 2) * 3 is no soft cap
    w = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * 0.35 / 2.0) * 3.0
    return torch.matmul(F.softmax(w, dim=-1), v)


def chain_expand_over_seq(m, q, k, v):  # expand + reshape that repeats along the sequence, not the heads
    b, h, s, d = k.shape
    k = k[:, :, None, :, :].expand(b, h, 2, s, d).reshape(b, h, 2 * s, d)
    v = v[:, :, None, :, :].expand(b, h, 2, s, d).reshape(b, h, 2 * s, d)
    w = F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.35, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(w, p=0.0, training=m.training), v)


def chain_cast_to_other_dtype(m, q, k, v):  # the cast is not a no-op: probabilities and v in fp64
    w = torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1)
    return torch.matmul(w.type(torch.float64), v.double())


def chain_cast_after_dropout_to_other_dtype(m, q, k, v):  # probabilities and v in fp64: not a no-op
    w = F.dropout(F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.35, dim=-1), p=0.0, training=m.training)
    return torch.matmul(w.to(torch.float64), v.double())


def chain_in_place_add_also_read_elsewhere(m, q, k, v):  # `w += bias` changes a tensor returned too
    w = torch.matmul(q, k.transpose(-1, -2)) / 2.5
    scores = w
    w += m.bias
    return torch.matmul(F.softmax(w, dim=-1), v), scores


@pytest.mark.parametrize("fn, buffers", [
    (chain_finite_fill, {"causal": CAUSAL}),
    (chain_in_place_add_also_read_elsewhere, {"bias": POSITION_BIAS}),
    (chain_where_finite_fill, {"keep": KEEP}),
    (chain_where_fill_first, {"keep": ~KEEP | torch.eye(S, dtype=torch.bool)}),
    (chain_cast_to_other_dtype, {}),
    (chain_cast_after_dropout_to_other_dtype, {}),
    (chain_tensor_scale, {}),
    (chain_softmax_other_dim, {}),
    (chain_returns_probs, {}),
    (chain_softcap_mismatched, {}),
    (chain_unscaled_where_finite_fill, {"keep": KEEP, "mask": ADDITIVE}),
    (chain_where_tensor_fill_in_other_dtype, {"keep": KEEP}),
    (chain_where_tensor_finite_fill, {"keep": KEEP}),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_near_misses_are_left(fn, buffers):
    report = check_against_unfused(functools.partial(Fn, fn, **buffers), qkv(), "dynamo")
    assert report.by_pattern() == {}


def chain_falcon(m, q, k, v):  # Falcon's eager attention: one k/v head the products broadcast (multi-query)
    w = q @ k.transpose(-1, -2)
    w /= 2.5
    return F.softmax(w + m.mask, dim=-1, dtype=m.mask.dtype) @ v  # dtype=hidden_states.dtype: the scores'


@pytest.mark.parametrize("capture", CAPTURES)
def test_falcon_multi_query_by_broadcast_fuses_as_gqa(capture):
    """Falcon's single k/v head broadcast over q's heads by the matmuls: the op's GQA with one
    group; its softmax's dtype, the scores' own, is the plain softmax."""
    report = check_against_unfused(functools.partial(Fn, chain_falcon, mask=ADDITIVE), qkv(1), capture)
    assert report.by_pattern() == {"attention_chain_div_add_no_dropout": 1}


def chain_k_broadcast_over_batch(m, q, k, v):
    return torch.matmul(F.softmax(torch.matmul(q, k[:1].transpose(-1, -2)) * 0.35, dim=-1), v[:1])


def test_keys_broadcast_over_the_batch_are_left_saying_why():
    report = check_against_unfused(functools.partial(Fn, chain_k_broadcast_over_batch), qkv(), "dynamo")
    assert report.by_pattern() == {}
    assert any("not one batch" in reason for *_, reason in report.rejected()), report.table()


def chain_gpt_neox_japanese(m, q, k, v, start=torch.zeros, masked=True):  # transformers' _attn, as written
    b, h, sq, d = q.size()
    sk = k.size(-2)
    scores = start(b * h, sq, sk, dtype=q.dtype, device=k.device)
    scores = torch.baddbmm(scores, q.view(b * h, sq, d), k.view(b * h, sk, d).transpose(1, 2), beta=1.0,
                           alpha=1.0 / 2.5)
    scores = scores.view(b, h, sq, -1)
    if masked:
        scores = scores + m.mask
    w = F.dropout(F.softmax(scores, dim=-1), p=0.0, training=m.training).to(v.dtype)
    return torch.matmul(w, v)


@pytest.mark.parametrize("masked, pattern", [(True, "attention_bmm_of_heads_add"),
                                             (False, "attention_bmm_of_heads_no_mask")])
def test_baddbmm_over_zeros_fuses(masked, pattern):
    """GPT-NeoX-Japanese's scores: `baddbmm` over a zeros tensor of q and k flattened to (B*H, S, D),
    viewed back per head for the mask (Dynamo: fx cannot unpack `q.size()`)."""
    chain = functools.partial(chain_gpt_neox_japanese, masked=masked)
    report = check_against_unfused(functools.partial(Fn, chain, mask=ADDITIVE), qkv(), "dynamo")
    assert report.by_pattern() == {pattern: 1}


def test_baddbmm_over_ones_is_left():
    chain = functools.partial(chain_gpt_neox_japanese, start=torch.ones)
    report = check_against_unfused(functools.partial(Fn, chain, mask=ADDITIVE), qkv(), "dynamo")
    assert report.by_pattern() == {}


def test_repeat_over_the_sequence_is_no_gqa():
    """expand + reshape along the sequence is not repeat_kv: the plain chain takes the repeated
    K and V as they are (the same maths), never enable_gqa over the un-repeated ones."""
    report = check_against_unfused(functools.partial(Fn, chain_expand_over_seq), qkv(), "dynamo")
    assert report.by_pattern() == {"attention_chain_mul_no_mask_dropout_upcast": 1}


def test_groups_outermost_is_no_gqa():
    """Heads repeated with the groups outermost read key head i % Hkv, not i // n_rep: SDPA takes
    the repeated K and V as they are (the same maths), never enable_gqa over the un-repeated ones."""
    report = check_against_unfused(functools.partial(Fn, sdpa_repeat_kv_groups_outer), qkv(2), "dynamo")
    assert report.by_pattern() == {"sdpa": 1}


def test_rejections_say_why():
    report = check_against_unfused(functools.partial(Fn, chain_returns_probs), qkv(), "dynamo")
    assert any("outside the pattern" in reason for *_, reason in report.rejected())
    report = check_against_unfused(functools.partial(Fn, chain_tensor_scale), qkv(), "dynamo")
    assert any("tensor" in reason for *_, reason in report.rejected())
    report = check_against_unfused(functools.partial(Fn, chain_where_finite_fill, keep=KEEP), qkv(), "dynamo")
    assert any("finite fill" in reason for *_, reason in report.rejected())
    report = check_against_unfused(functools.partial(Fn, chain_cast_to_other_dtype), qkv(), "dynamo")
    assert any("not a no-op" in reason for *_, reason in report.rejected())
    # fp16 bias and mask beside fp32 scores: the op's mask, their sum, would be rounded to fp16
    narrow = functools.partial(Fn, chain_t5_eager, bias=POSITION_BIAS.half(), mask=ADDITIVE.half())
    report = check_against_unfused(narrow, qkv(), "dynamo")
    assert any("wider than bias" in reason for *_, reason in report.rejected())


class Disentangled(nn.Module):
    """DeBERTa-v2's DisentangledSelfAttention core as transformers writes it, on (B*H, S, D)
    tensors: k^T divided by a 0-d tensor scale inside the bmm, relative-position scores added
    (here a learned (B*H, S, S) parameter, so its gradient is checked), the finfo.min fill of a
    (B, 1, S, S) mask with a query row masked whole, dropout, the second bmm."""

    def __init__(self, relative=True, p=0.0, fx_traceable=False):
        super().__init__()
        self.rel = nn.Parameter(torch.randn(B * H, S, S)) if relative else None
        self.fx_traceable = fx_traceable
        self.register_buffer("keep", KEEP_SOME_ROWS_NONE.clone())
        self.dropout = nn.Dropout(p)

    def forward(self, q, k, v):
        q, k, v = (t.reshape(-1, S, D) for t in (q, k, v))
        # transformers' scaled_size_sqrt, finfo of q's dtype and views by the scores' sizes; fx has no
        # values for these (Dynamo has), so its variant writes the numbers
        if self.fx_traceable:
            scale, dtype, seq = math.sqrt(D * 3), torch.float32, (S, S)
        else:
            scale = torch.sqrt(torch.tensor(q.size(-1), dtype=torch.float) * 3).to(dtype=q.dtype)
            dtype, seq = q.dtype, None
        scores = torch.bmm(q, k.transpose(-1, -2) / scale)
        if self.rel is not None:
            scores = scores + self.rel
        scores = scores.view(-1, H, *(seq or (scores.size(-2), scores.size(-1))))
        scores = scores.masked_fill(~self.keep, torch.finfo(dtype).min)
        probs = self.dropout(nn.functional.softmax(scores, dim=-1))
        out = torch.bmm(probs.view(-1, *(seq or (probs.size(-2), probs.size(-1)))), v)
        return out.view(-1, H, S, D)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("relative, pattern", [
    (True, "attention_bmm_scaled_k_add_masked_fill_dropout"),
    (False, "attention_bmm_scaled_k_masked_fill_dropout"),
], ids=["relative", "plain"])
def test_deberta_disentangled_attention_fuses(relative, pattern, capture):
    """Outputs and gradients (the relative scores' through the op's dMask, V's from the row
    masked whole) equal the unfused module's."""
    report = check_against_unfused(functools.partial(Disentangled, relative, fx_traceable=capture == "fx"), qkv(),
                                   capture)
    assert report.by_pattern() == {pattern: 1}


class DisentangledV1(nn.Module):
    """DeBERTa's (v1) DisentangledSelfAttention core as transformers writes it, on (B, H, S, D)
    tensors: q divided by a 0-d tensor scale before the product, relative-position scores added
    (a learned (B, H, S, S) parameter, so its gradient is checked) or `+ 0` without relative
    attention, `masked_fill(~mask, finfo.min)` with a query row masked whole, dropout."""

    def __init__(self, relative=True, p=0.0, fx_traceable=False, bias=None):
        super().__init__()
        self.rel = nn.Parameter(torch.randn(B, H, S, S)) if relative else None
        self.bias = bias  # another constant in place of the relative scores (a negative control)
        self.fx_traceable = fx_traceable
        self.register_buffer("keep", KEEP_SOME_ROWS_NONE.clone())
        self.dropout = nn.Dropout(p)

    def forward(self, q, k, v):
        if self.fx_traceable:  # fx has no values for the tensor scale and finfo of q's dtype
            scale, dtype = math.sqrt(D * 3), torch.float32
        else:
            scale, dtype = torch.sqrt(torch.tensor(q.size(-1), dtype=torch.float) * 3), q.dtype
        q = q / (scale.to(dtype=q.dtype) if isinstance(scale, torch.Tensor) else scale)
        scores = torch.matmul(q, k.transpose(-1, -2))
        rel = self.rel if self.rel is not None else (0 if self.bias is None else self.bias)
        scores = scores + rel
        scores = scores.masked_fill(~self.keep.bool(), torch.finfo(dtype).min)
        probs = self.dropout(nn.functional.softmax(scores, dim=-1))
        return torch.matmul(probs, v)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("relative", [True, False], ids=["relative", "plus_zero"])
def test_deberta_v1_attention_fuses(relative, capture):
    """Outputs and gradients (the relative scores' through the op's dMask, only where a key is
    kept; V's from the row masked whole; none to q there) equal the unfused module's."""
    report = check_against_unfused(functools.partial(DisentangledV1, relative, fx_traceable=capture == "fx"), qkv(),
                                   capture)
    assert report.by_pattern() == {"attention_chain_add_masked_fill_unscaled_dropout": 1}


@pytest.mark.parametrize("make, pattern", [
    (Disentangled, "attention_bmm_scaled_k_add_masked_fill_dropout"),
    (DisentangledV1, "attention_chain_add_masked_fill_unscaled_dropout"),
], ids=["v2", "v1"])
def test_deberta_attention_under_active_dropout_fuses(make, pattern):
    """DeBERTa masks padding queries whole: the unfused row is dropout(uniform) @ V, V's rows over a
    random subset of the keys / (S (1 - p)); so is the fused one (a zero query, an open mask, the
    op's own dropout). A fixed seed repeats the draw."""
    p = 0.5
    model = fuse_via(make(p=p).train(), "dynamo")
    q, k, v = qkv()
    torch.manual_seed(1)
    out = model(q, k, v)
    torch.manual_seed(1)
    torch.testing.assert_close(model(q, k, v), out, rtol=0, atol=0)
    assert trifuse.report(model).by_pattern() == {pattern: 1}
    subsets = torch.tensor(list(itertools.product((0.0, 1.0), repeat=S)))  # (2^S, S)
    sums = torch.einsum("ns,hsd->hnd", subsets, v[1]) / (S * (1 - p))  # (H, 2^S, D)
    row = out[1, :, 2]  # batch 1, query 2: masked whole
    for h in range(H):
        assert (sums[h] - row[h]).abs().amax(-1).min() < 1e-5, f"head {h}: not a dropout of V's mean"
    assert not torch.allclose(row, v[1].mean(-2) / (1 - p)), "no key was dropped in any head"


def test_deberta_v1_spelling_with_another_constant_is_left():
    """`+ 0.5` instead of `+ 0`: the filter names the constant and the chain stays as written."""
    report = check_against_unfused(functools.partial(DisentangledV1, False, bias=0.5), qkv(), "dynamo")
    assert report.by_pattern() == {}
    assert any("constant 0.5" in reason for *_, reason in report.rejected())


def chain_where_finfo_min_dropout(m, q, k, v):
    att = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    att = torch.where(m.keep_some_rows_none, att, torch.finfo(torch.float32).min)
    return torch.matmul(F.dropout(F.softmax(att, dim=-1), 0.5, m.training), v)


def chain_masked_fill_finfo_min_dropout(m, q, k, v):
    att = (q @ k.transpose(-2, -1)) * 0.3
    att = att.masked_fill(~m.keep_some_rows_none, torch.finfo(torch.float32).min)
    return F.dropout(F.softmax(att, dim=-1), 0.5, m.training) @ v


def chain_imagegpt_dropout(m, q, k, v):
    w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    fill = torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
    w = torch.where(m.keep_some_rows_none, w, fill)
    return torch.matmul(F.dropout(F.softmax(w, dim=-1).type(v.dtype), p=0.5, training=m.training), v)


def chain_imagegpt_padded_dropout(m, q, k, v):  # an all-zero padding mask: the closed row uniform over all keys
    w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    fill = torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
    w = torch.where(m.keep_some_rows_none, w, fill)
    w = F.softmax(w + m.mask, dim=-1).type(v.dtype)
    return torch.matmul(F.dropout(w, p=0.5, training=m.training), v)


def chain_alibi_masked_fill_dropout(m, q, k, v):  # MPT's, dropout on
    w = torch.matmul(q, k.transpose(-1, -2)) * 0.3 + m.alibi.view(B, H, 1, S)[0]
    w = w.masked_fill(~m.keep_some_rows_none, torch.finfo(torch.float32).min)
    return torch.matmul(F.dropout(F.softmax(w.float(), dim=-1).to(v.dtype), p=0.5, training=m.training), v)


@pytest.mark.parametrize("fn, buffers, pattern", [
    (chain_where_finfo_min_dropout, {}, "attention_chain_div_where_dropout"),
    (chain_masked_fill_finfo_min_dropout, {}, "attention_chain_mul_masked_fill_dropout"),
    (chain_imagegpt_dropout, {}, "attention_chain_div_where_tensor_dropout_cast"),
    (chain_imagegpt_padded_dropout, {"mask": torch.zeros(B, 1, 1, S)}, "attention_chain_div_where_add"),
    (chain_alibi_masked_fill_dropout, {"alibi": ALIBI}, "attention_chain_mul_add_masked_fill"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_finfo_min_fill_under_active_dropout_fuses(fn, buffers, pattern):
    """A query row masked whole at finfo.min is uniform in the unfused softmax, then dropped out
    like any other: dropout(uniform) @ V, V's rows over a random subset of the keys / (S (1 - p)).
    So is the fused row (its query zeroed, its keys opened, the op's own dropout), and neither q
    nor k gets a gradient from it, as through the where() or masked_fill."""
    p = 0.5
    model = fuse_via(Fn(fn, keep_some_rows_none=KEEP_SOME_ROWS_NONE, **buffers).train(), "dynamo")
    q, k, v = (t.requires_grad_() for t in qkv())
    torch.manual_seed(1)
    out = model(q, k, v)
    assert trifuse.report(model).by_pattern() == {pattern: 1}
    subsets = torch.tensor(list(itertools.product((0.0, 1.0), repeat=S)))  # (2^S, S)
    sums = torch.einsum("ns,hsd->hnd", subsets, v[1].detach()) / (S * (1 - p))  # (H, 2^S, D)
    row = out[1, :, 2].detach()  # batch 1, query 2: masked whole
    for h in range(H):
        assert (sums[h] - row[h]).abs().amax(-1).min() < 1e-5, f"head {h}: not a dropout of V's mean"
    assert not torch.allclose(row, v[1].detach().mean(-2) / (1 - p)), "no key was dropped in any head"
    only_that_row = torch.zeros_like(out)
    only_that_row[1, :, 2] = 1.0
    dq, dk, dv = torch.autograd.grad((out * only_that_row).sum(), (q, k, v))
    assert not dq.any() and not dk.any(), "the row masked whole sends a gradient to q or k"
    assert dv[1].abs().sum(-1).gt(0).any(), "nor to v"


# ---------------------------------------------------------------------------------------------
# gpt-oss's attention sinks: a learned logit per head concatenated to the scores, softmaxed with
# them and dropped. The sinks are a parameter (their gradient is checked too).
# ---------------------------------------------------------------------------------------------


class WithSinks(Fn):
    def __init__(self, fn, **buffers):
        super().__init__(fn, **buffers)
        self.sinks = nn.Parameter(torch.randn(H))


def _sink_column(m, q):
    return m.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)


def chain_sinks(m, q, k, v, mask=None, p=0.0):  # transformers' gpt-oss eager_attention_forward, spelled as there
    k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35
    if mask is not None:
        w = w + mask
    combined = torch.cat([w, _sink_column(m, q)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
    w = F.dropout(probs[..., :-1], p=p, training=m.training).to(v.dtype)
    return torch.matmul(w, v)


def chain_sinks_mask(m, q, k, v):
    return chain_sinks(m, q, k, v, m.mask)


def chain_sinks_no_repeat(m, q, k, v):  # one kv head per query head: repeat_kv returns k and v as they are
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35 + m.mask
    combined = torch.cat([w, _sink_column(m, q)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
    return torch.matmul(F.dropout(probs[..., :-1], p=0.0, training=m.training).to(v.dtype), v)


def chain_sinks_fp32(m, q, k, v, mask=None, p=0.0):  # transformers' Flint eager_attention_forward, as there
    k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])
    with torch.autocast(q.device.type, enabled=False):
        w = torch.matmul(q.float(), k.float().transpose(2, 3)) * 0.35
    if mask is not None:
        w = w + mask
    sinks = m.sinks.reshape(1, -1, 1, 1).expand(*w.shape[:-1], 1)
    w = F.softmax(torch.cat([w, sinks], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    return torch.matmul(F.dropout(w, p=p, training=m.training), v)


def chain_sinks_fp32_mask(m, q, k, v):
    return chain_sinks_fp32(m, q, k, v, m.mask)


def chain_sinks_fp32_no_repeat(m, q, k, v):  # one kv head per query head
    w = torch.matmul(q.float(), k.float().transpose(2, 3)) * 0.35 + m.mask
    w = F.softmax(torch.cat([w, _sink_column(m, q)], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    return torch.matmul(F.dropout(w, p=0.0, training=m.training), v)


# a causal sliding window of 3 keys as transformers builds it (finfo.min), with one query row of
# batch 1 masked whole: there the sink takes all the weight and the output is 0
WINDOW = torch.zeros(B, 1, S, S).masked_fill(
    ~(torch.ones(S, S, dtype=torch.bool).tril().triu(-2)), torch.finfo(torch.float32).min)
WINDOW[1, 0, 4] = torch.finfo(torch.float32).min


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("fn, buffers, h_kv, pattern", [
    (chain_sinks_mask, {"mask": WINDOW}, 2, "attention_chain_sinks_add_repeat_kv"),
    (chain_sinks, {}, 1, "attention_chain_sinks_no_mask_repeat_kv"),
    (chain_sinks_no_repeat, {"mask": ADDITIVE}, H, "attention_chain_sinks_add"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_sinks_spelling_fuses_and_matches(fn, buffers, h_kv, pattern, capture):
    report = check_against_unfused(functools.partial(WithSinks, fn, **buffers), qkv(h_kv), capture)
    assert report.by_pattern() == {pattern: 1}


@pytest.mark.parametrize("fn, buffers, h_kv, pattern", [
    (chain_sinks_fp32_mask, {"mask": WINDOW}, 2, "attention_chain_sinks_fp32_add_repeat_kv"),
    (chain_sinks_fp32, {}, 1, "attention_chain_sinks_fp32_no_mask_repeat_kv"),
    (chain_sinks_fp32_no_repeat, {"mask": ADDITIVE}, H, "attention_chain_sinks_fp32_add"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_flint_sinks_spelling_fuses_and_matches(fn, buffers, h_kv, pattern):
    """Flint's spelling (the autocast block and `*w.shape[:-1]` are Dynamo's to capture, not fx's)."""
    report = check_against_unfused(functools.partial(WithSinks, fn, **buffers), qkv(h_kv), "dynamo")
    assert report.by_pattern() == {pattern: 1}


def test_sinks_row_masked_whole_is_zero_and_dropout_is_carried():
    model = fuse_via(WithSinks(chain_sinks_mask, mask=WINDOW), "dynamo")
    q, k, v = qkv(2)
    out = model(q, k, v)
    assert out[1, :, 4].eq(0).all()
    assert trifuse.report(model).by_pattern() == {"attention_chain_sinks_add_repeat_kv": 1}
    model = fuse_via(WithSinks(functools.partial(chain_sinks, p=0.5)).train(), "dynamo")
    torch.manual_seed(3)
    first = model(q, k, v)
    torch.manual_seed(3)
    assert torch.equal(model(q, k, v), first) and not torch.equal(model(q, k, v), first)
    assert trifuse.report(model).by_pattern() == {"attention_chain_sinks_no_mask_repeat_kv": 1}


def chain_sinks_column_kept(m, q, k, v):  # the sink's column is not dropped: V gets a zero row
    combined = torch.cat([torch.matmul(q, k.transpose(2, 3)) * 0.35, _sink_column(m, q)], dim=-1)
    probs = F.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1, dtype=combined.dtype)
    return torch.matmul(probs, torch.cat([v, torch.zeros_like(v[:, :, :1])], dim=2))


def chain_sinks_first_column_dropped(m, q, k, v):  # drops the first key's column, not the sink's
    combined = torch.cat([torch.matmul(q, k.transpose(2, 3)) * 0.35, _sink_column(m, q)], dim=-1)
    probs = F.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1, dtype=combined.dtype)
    return torch.matmul(probs[..., 1:], v)


def _sinks_tail(m, combined, v):  # gpt-oss's steps after the concatenation, as written there
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
    return torch.matmul(F.dropout(probs[..., :-1], p=0.0, training=m.training).to(v.dtype), v)


def chain_sinks_per_query(m, q, k, v):  # one logit per query position, not per head
    column = m.per_query.reshape(1, 1, -1, 1).expand(q.shape[0], q.shape[1], -1, 1)
    return _sinks_tail(m, torch.cat([torch.matmul(q, k.transpose(2, 3)) * 0.35, column], dim=-1), v)


def chain_sinks_three_columns(m, q, k, v):  # the sink expanded to 3 columns, only one of them dropped
    columns = m.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], 3)
    v = torch.cat([v, torch.zeros_like(v[:, :, :2])], dim=2)
    return _sinks_tail(m, torch.cat([torch.matmul(q, k.transpose(2, 3)) * 0.35, columns], dim=-1), v)


@pytest.mark.parametrize("fn", [chain_sinks_column_kept, chain_sinks_first_column_dropped, chain_sinks_per_query,
                                chain_sinks_three_columns], ids=lambda f: f.__name__)
def test_sinks_near_misses_are_left(fn):
    report = check_against_unfused(functools.partial(WithSinks, fn, per_query=torch.randn(S)), qkv(), "dynamo")
    assert report.by_pattern() == {}


def test_sinks_rejections_say_why():
    report = check_against_unfused(functools.partial(WithSinks, chain_sinks_per_query, per_query=torch.randn(S)),
                                   qkv(), "dynamo")
    assert any("one logit per query head" in reason for *_, reason in report.rejected()), report.table()
    report = check_against_unfused(functools.partial(WithSinks, chain_sinks_three_columns), qkv(), "dynamo")
    assert any("(batch, heads, queries, 1)" in reason for *_, reason in report.rejected()), report.table()


# ---------------------------------------------------------------------------------------------
# MiMo-V2-Flash's layers without sinks (the row max subtracted all the same) and Granite's sinks
# as a sigmoid(logsumexp - sink) scale of the output: transformers' eager code, spelled as there.
# ---------------------------------------------------------------------------------------------


def chain_max_sub(m, q, k, v, p=0.0, repeat=True):  # transformers' mimo_v2_flash eager_attention_forward, sinks None
    if repeat:  # transformers' repeat_kv returns k and v as they are for one kv head per query head
        k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35
    if hasattr(m, "mask"):
        w = w + m.mask
    w = w - w.max(dim=-1, keepdim=True).values
    probs = F.softmax(w, dim=-1, dtype=w.dtype)
    return torch.matmul(F.dropout(probs, p=p, training=m.training).to(v.dtype), v)


def chain_sink_scale(m, q, k, v, p=0.0, repeat=True):  # transformers' granite_swa eager_attention_forward
    if repeat:  # transformers' repeat_kv returns k and v as they are for one kv head per query head
        k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35
    if hasattr(m, "mask"):
        w = w + m.mask
    sink_scale = (torch.logsumexp(w, dim=-1) - m.sinks.view(1, -1, 1)).to(torch.float32).sigmoid()
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=p, training=m.training)
    out = torch.matmul(w, v)
    return out * sink_scale.unsqueeze(-1).to(out.dtype)


def chain_sink_scale_no_repeat(m, q, k, v):
    return chain_sink_scale(m, q, k, v, repeat=False)



def chain_sink_scale_fp16(m, q, k, v, dtype=torch.float16):  # Granite in a 16-bit model: the log-sum-exp in fp16, the sigmoid in fp32
    up = torch.promote_types(dtype, torch.float32)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35 + m.mask.to(dtype)
    sink_scale = (torch.logsumexp(w, dim=-1) - m.sinks.to(dtype).view(1, -1, 1)).to(up).sigmoid()
    w = F.dropout(F.softmax(w, dim=-1, dtype=up).to(q.dtype), p=0.0, training=m.training)
    out = torch.matmul(w, v)
    return out * sink_scale.unsqueeze(-1).to(out.dtype)


# the sliding window of 3 keys with every row open: without a sink, a row a finite mask covers whole
# is uniform, with the op's documented fp32 gradient cancellation there (kernels/attention.py)
OPEN_WINDOW = torch.zeros(1, 1, S, S).masked_fill(
    ~(torch.ones(S, S, dtype=torch.bool).tril().triu(-2)), torch.finfo(torch.float32).min)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("fn, buffers, h_kv, pattern", [
    (chain_max_sub, {"mask": OPEN_WINDOW}, 2, "attention_chain_max_sub_add_repeat_kv"),
    (chain_max_sub, {}, 1, "attention_chain_max_sub_no_mask_repeat_kv"),
    (chain_sink_scale, {"mask": WINDOW}, 2, "attention_chain_sink_scale_add_repeat_kv"),
    (chain_sink_scale, {}, 1, "attention_chain_sink_scale_no_mask_repeat_kv"),
    (chain_sink_scale_no_repeat, {"mask": ADDITIVE}, H, "attention_chain_sink_scale_add"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_max_sub_and_sink_scale_fuse_and_match(fn, buffers, h_kv, pattern, capture):
    report = check_against_unfused(functools.partial(WithSinks, fn, **buffers), qkv(h_kv), capture)
    assert report.by_pattern() == {pattern: 1}


# ---------------------------------------------------------------------------------------------
# BART's older eager attention on (B*H, S, D) tensors (TrOCR, MVP, LED's decoder): q scaled before
# the product, the scores viewed per head for the additive mask and back.
# ---------------------------------------------------------------------------------------------


class BartAttention(nn.Module):
    """transformers' TrOCRAttention core as written there, from q (B, Sq, H*D) and k, v (B, Sk, H*D)
    projections: self-attention when Sq = Sk, cross-attention otherwise. The mask (B, 1, Sq, Sk)
    is a buffer, or none."""

    def __init__(self, mask=None, p=0.0):
        super().__init__()
        self.register_buffer("mask", mask)
        self.p = p

    def forward(self, q, k, v):
        bsz, tgt_len, _ = q.shape
        q = q * D ** -0.5
        proj_shape = (bsz * H, -1, D)
        q = q.view(bsz, tgt_len, H, D).transpose(1, 2).reshape(*proj_shape)
        k = k.view(bsz, -1, H, D).transpose(1, 2).reshape(*proj_shape)
        v = v.view(bsz, -1, H, D).transpose(1, 2).reshape(*proj_shape)
        src_len = k.size(1)
        w = torch.bmm(q, k.transpose(1, 2))
        if self.mask is not None:
            w = w.view(bsz, H, tgt_len, src_len) + self.mask
            w = w.view(bsz * H, tgt_len, src_len)
        w = F.softmax(w, dim=-1)
        probs = F.dropout(w, p=self.p, training=self.training)
        out = torch.bmm(probs, v)
        return out.view(bsz, H, tgt_len, D).transpose(1, 2).reshape(bsz, tgt_len, H * D)


SRC = S + 3  # cross-attention: more keys than queries
CROSS_MASK = torch.zeros(B, 1, S, SRC)
CROSS_MASK[0, ..., -2:] = torch.finfo(torch.float32).min  # the encoder's padding


def bart_inputs(src=S):
    return torch.randn(B, S, H * D), torch.randn(B, src, H * D), torch.randn(B, src, H * D)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("mask, src, pattern", [
    # self-attention under a causal mask (-inf above the diagonal)
    (CAUSAL.log().expand(B, 1, S, S).clone(), S, "attention_bmm_add_dropout"),
    (CROSS_MASK, SRC, "attention_bmm_add_dropout"),
    (None, SRC, "attention_bmm_no_mask_dropout"),
], ids=["self_causal", "cross_padding", "cross_no_mask"])
def test_bart_bmm_attention_fuses(mask, src, pattern, capture):
    report = check_against_unfused(functools.partial(BartAttention, mask), bart_inputs(src), capture)
    assert report.by_pattern() == {pattern: 1}


def test_bart_bmm_attention_carries_dropout():
    model = fuse_via(BartAttention(CROSS_MASK, p=0.5).train(), "dynamo")
    inputs = bart_inputs(SRC)
    torch.manual_seed(3)
    first = model(*inputs)
    torch.manual_seed(3)
    assert torch.equal(model(*inputs), first) and not torch.equal(model(*inputs), first)
    assert trifuse.report(model).by_pattern() == {"attention_bmm_add_dropout": 1}
    model.eval()
    torch.testing.assert_close(model(*inputs), BartAttention(CROSS_MASK).eval()(*inputs))


class SpeechT5Attention(nn.Module):
    """transformers' SpeechT5Attention core in its encoder: BartAttention's (B*H, S, D) chain with
    relative position scores added to the flat scores in place, q's products with a (Sq, Sk, D)
    table per query (`matmul(q.transpose(0, 1), pos.transpose(-2, -1)).transpose(0, 1)`), no
    per-head view; the table a parameter (its gradient, and q's through the scores')."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(S, S, D) * 0.3)

    def forward(self, q, k, v):
        bsz, tgt_len, _ = q.shape
        q, k, v = (t.view(bsz, -1, H, D).transpose(1, 2).reshape(bsz * H, -1, D)
                   for t in (q * D ** -0.5, k, v))
        w = torch.bmm(q, k.transpose(1, 2))
        rel = torch.matmul(q.contiguous().view(bsz * H, -1, D).transpose(0, 1), self.pos.transpose(-2, -1))
        rel = rel.transpose(0, 1).view(bsz * H, tgt_len, -1)
        w += rel
        out = torch.bmm(F.dropout(F.softmax(w, dim=-1), p=0.0, training=self.training), v)
        return out.view(bsz, H, tgt_len, D).transpose(1, 2).reshape(bsz, tgt_len, H * D)


@pytest.mark.parametrize("capture", CAPTURES)
def test_relative_scores_added_to_flat_bmm_scores_fuse(capture):
    """The relative position scores reach the op as a float mask of the flat scores' shape, each
    (batch * head) block a batch of one head: their gradient reaches q (through the scores and
    through them) and the table."""
    report = check_against_unfused(SpeechT5Attention, bart_inputs(), capture)
    assert report.by_pattern() == {"attention_bmm_flat_add_dropout": 1}


class XglmAttention(BartAttention):
    """transformers' XGLMAttention core: BartAttention's chain with the masked scores clamped from
    below by a 0-d `torch.full` of the scores' finfo.min (float64 copies: float32's, as torch.full in
    the default dtype cannot hold finfo(float64).min), and its view there and back after the softmax.
    `floor` replaces the floor."""

    def __init__(self, mask, p=0.0, floor=None):
        super().__init__(mask, p)
        self.floor = floor

    def forward(self, q, k, v):
        bsz, tgt_len, _ = q.shape
        q, k, v = (t.view(bsz, -1, H, D).transpose(1, 2).reshape(bsz * H, -1, D) for t in (q * D ** -0.5, k, v))
        src_len = k.size(1)
        w = torch.bmm(q, k.transpose(1, 2)).view(bsz, H, tgt_len, src_len) + self.mask
        floor = self.floor if self.floor is not None else \
            torch.finfo(w.dtype if w.dtype != torch.float64 else torch.float32).min
        w = torch.max(w, torch.full((), floor, device=w.device)).view(bsz * H, tgt_len, src_len)
        w = F.softmax(w, dim=-1)
        w = w.view(bsz, H, tgt_len, src_len).view(bsz * H, tgt_len, src_len)
        out = torch.bmm(F.dropout(w, p=self.p, training=self.training), v)
        return out.view(bsz, H, tgt_len, D).transpose(1, 2).reshape(bsz, tgt_len, H * D)


CROSS_MASK_INF = torch.where(CROSS_MASK < 0, float("-inf"), 0.0)


@pytest.mark.parametrize("mask, src", [
    (CAUSAL.log().expand(B, 1, S, S).clone(), S),  # -inf above the diagonal: clamped to finfo.min
    (torch.where(CAUSAL.bool(), 0.0, torch.finfo(torch.float32).min).expand(B, 1, S, S).clone(), S),
    (CROSS_MASK, SRC),
    (CROSS_MASK_INF, SRC),
], ids=["causal_inf", "causal_finfo_min", "cross_padding", "cross_padding_inf"])
def test_xglm_clamped_bmm_attention_fuses(mask, src):
    report = check_against_unfused(functools.partial(XglmAttention, mask), bart_inputs(src), "dynamo")
    assert report.by_pattern() == {"attention_bmm_add_clamp_dropout": 1}


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, float("-inf")], ids=["finfo_min", "inf"])
def test_xglm_row_masked_whole_is_the_mean_of_v(fill):
    """A query whose keys are all masked: the clamp makes every score of its row finfo.min, a uniform
    softmax, with a finite or an infinite mask alike; so does the op on the clamped mask (forward:
    the op documents the fp32 cancellation of such rows' gradients)."""
    mask = CROSS_MASK.clone()
    mask[1, 0, 2] = fill
    report = check_against_unfused(functools.partial(XglmAttention, mask), bart_inputs(SRC), "dynamo", grads=False)
    assert report.by_pattern() == {"attention_bmm_add_clamp_dropout": 1}


def test_xglm_clamp_rejections_say_why():
    report = check_against_unfused(functools.partial(XglmAttention, CROSS_MASK, floor=-1e4), bart_inputs(SRC),
                                   "dynamo")
    assert report.by_pattern() == {}
    assert any("not finfo(torch.float32).min" in reason for *_, reason in report.rejected()), report.table()
    # fp16 scores: their sum with a finfo.min mask overflows to -inf before the clamp (unfused)
    model = fuse_via(XglmAttention(CROSS_MASK.half()).half(), "dynamo")
    model(*(x.half() for x in bart_inputs(SRC)))
    report = trifuse.report(model)
    assert report.by_pattern() == {}
    assert any("fp16 scores" in reason for *_, reason in report.rejected()), report.table()


def chain_max_sub_over_queries(m, q, k, v):  # the max over the queries: a shift per column, not a no-op
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35 + m.mask
    probs = F.softmax(w - w.max(dim=-2, keepdim=True).values, dim=-1, dtype=w.dtype)
    return torch.matmul(F.dropout(probs, p=0.0, training=m.training).to(v.dtype), v)


def chain_sink_scale_per_query(m, q, k, v):  # one logit per query position, not per head
    w = torch.matmul(q, k.transpose(2, 3)) * 0.35 + m.mask
    sink_scale = (torch.logsumexp(w, dim=-1) - m.per_query.view(1, 1, -1)).to(torch.float32).sigmoid()
    out = torch.matmul(F.dropout(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), p=0.0, training=m.training), v)
    return out * sink_scale.unsqueeze(-1).to(out.dtype)


class BartAttentionViewedAcross(BartAttention):
    """Cross-attention whose scores are viewed (B, H, Sk, Sq) for the mask: the same numbers, but the
    mask's rows fall on other queries than per head."""

    def forward(self, q, k, v):
        q, k, v = (t.view(B, -1, H, D).transpose(1, 2).reshape(B * H, -1, D) for t in (q, k, v))
        w = torch.bmm(q * D ** -0.5, k.transpose(1, 2))
        w = (w.view(B, H, SRC, S) + self.mask).view(B * H, S, SRC)
        return torch.bmm(F.dropout(F.softmax(w, dim=-1), p=0.0, training=self.training), v)


@pytest.mark.parametrize("make, inputs", [
    (functools.partial(WithSinks, chain_max_sub_over_queries, mask=ADDITIVE), qkv()),
    (functools.partial(WithSinks, chain_sink_scale_per_query, per_query=torch.randn(S), mask=ADDITIVE), qkv()),
    (functools.partial(BartAttentionViewedAcross, torch.randn(B, 1, SRC, S)), bart_inputs(SRC)),
], ids=["max_over_queries", "sink_per_query", "bmm_viewed_across"])
def test_max_sub_sink_scale_and_bmm_near_misses_are_left(make, inputs):
    report = check_against_unfused(make, inputs, "dynamo")
    assert report.by_pattern() == {}


def test_sink_scale_and_bmm_rejections_say_why():
    make = functools.partial(WithSinks, chain_sink_scale_per_query, per_query=torch.randn(S), mask=ADDITIVE)
    report = check_against_unfused(make, qkv(), "dynamo")
    assert any("one logit per query head" in reason for *_, reason in report.rejected()), report.table()
    report = check_against_unfused(functools.partial(BartAttentionViewedAcross, torch.randn(B, 1, SRC, S)),
                                   bart_inputs(SRC), "dynamo")
    assert any("not per head" in reason for *_, reason in report.rejected()), report.table()


def test_sink_scale_in_16_bit_fuses():
    """Granite in fp16 under transformers' fp16 finfo.min padding: the op's fp32 log-sum-exp stands
    for the model's fp16 one (the oracle as for the upcasts above)."""
    window = ADDITIVE.clone()
    window[0, ..., -2:] = torch.finfo(torch.float16).min
    check_16_bit_chain(WithSinks, chain_sink_scale_fp16, {"mask": window}, "attention_chain_sink_scale_add")


def test_mpnet_without_a_mask_under_cuda_autocast_keeps_its_cast_and_fuses():
    """Under CUDA's autocast the softmax of MPNet's rounded sum computes in fp32 (its example value
    says so), so fusion/normalize.py leaves the cast before it: the spelling with the cast matches.
    The graph is traced and propagated under CPU autocast, the softmax's value made fp32 as CUDA's
    autocast makes it."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from trifuse.fusion import rewrite
    from trifuse.fusion.normalize import canonicalize
    from trifuse.patterns import attention

    def mpnet(q, k, v, bias):  # `w += bias` in its canonical form (fx's tracer makes it out of place)
        w = torch.matmul(q, k.transpose(-1, -2)) / 2.5
        w = (w + bias).to(w.dtype)
        return torch.matmul(F.dropout(F.softmax(w, dim=-1), p=0.1, training=True), v)

    gm = torch.fx.symbolic_trace(mpnet)
    q, k, v = (t.half() for t in qkv())
    with torch.autocast("cpu", dtype=torch.float16):
        FakeTensorProp(gm).propagate(q, k, v, POSITION_BIAS)
        softmax = next(n for n in gm.graph.nodes if n.target in (torch.softmax, F.softmax))
        softmax.meta["val"] = softmax.meta["val"].float()
        gm = canonicalize(gm)
        assert [n.args[2] for n in gm.graph.nodes if n.target is torch.softmax] == [None]  # the cast kept
        log = rewrite(gm, attention.PATTERNS)
    assert log.by_pattern == {"attention_chain_div_add_rounded": 1}, log


class RotaryFp32(nn.Module):
    """q and k times an fp32 table before the chain, as Hugging Face's rotary embedding leaves them
    under autocast: fp32 beside the 16-bit v of the autocast projection."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("table", torch.rand(S, D) + 0.5)

    def forward(self, q, k, v):
        return self.inner(q * self.table, k * self.table, v)


@pytest.mark.parametrize("fn, h_kv, buffers, pattern", [
    (chain_repeat_kv, 2, {"mask": ADDITIVE}, "attention_chain_mul_add_dropout_upcast_repeat_kv"),
    (chain_sink_scale, 2, {"mask": ADDITIVE}, "attention_chain_sink_scale_add_repeat_kv"),
    (chain_sinks_mask, 2, {"mask": WINDOW}, "attention_chain_sinks_add_repeat_kv"),
    (chain_falcon, 1, {"mask": ADDITIVE}, "attention_chain_div_add_no_dropout"),
], ids=["llama", "granite_swa", "gpt_oss", "falcon"])
def test_eager_attention_of_fp32_q_under_autocast_fuses(fn, h_kv, buffers, pattern):
    """transformers' eager attention under fp16 autocast (the models that have no SDPA path: sinks,
    Granite's sink scale): q and k fp32 from the rotary tables, v fp16, the mask fp32. Autocast
    casts the product's operands to fp16 whatever the probabilities were cast to (`.to(q.dtype)`:
    fp32), as the op casts q, k and v. Output and gradients by the oracle rule against the module
    in float64 without autocast, PyTorch's own error the unfused module's under autocast (the
    sinks' gradients too)."""
    check_under_fp16_autocast(lambda: RotaryFp32((WithSinks if "sink" in fn.__name__ else Fn)(fn, **buffers)),
                              h_kv, pattern)


def test_fp32_q_beside_fp16_v_outside_autocast_is_left():
    """The same chain outside autocast (q and k fp32, v and the probabilities' cast fp16): the op
    takes one dtype and no autocast casts for it, so the chain stays, saying why."""
    unfused = WithSinks(chain_sinks_mask, mask=WINDOW)
    model = fuse_via(copy.deepcopy(unfused), "dynamo")
    q, k, v = qkv(2)
    torch.testing.assert_close(model(q, k, v.half()), unfused(q, k, v.half()), rtol=0, atol=0)
    report = trifuse.report(model)
    assert report.by_pattern() == {}
    assert any("not a no-op" in reason for *_, reason in report.rejected()), report.table()


@pytest.mark.parametrize("fn, pattern", [
    (chain_max_sub, "attention_chain_max_sub_add_repeat_kv"),
    (chain_sink_scale, "attention_chain_sink_scale_add_repeat_kv"),
], ids=["max_sub", "sink_scale"])
def test_max_sub_and_sink_scale_carry_dropout(fn, pattern):
    """p is carried (a seed repeats the draw, another call draws afresh) and off in eval, where the
    fused module is the unfused one. Granite's row scale commutes with the dropout of the softmax:
    each weight the op keeps is the model's weight (sink-scaled) / (1 - p)."""
    unfused = WithSinks(functools.partial(fn, p=0.5), mask=OPEN_WINDOW)
    model = fuse_via(copy.deepcopy(unfused).train(), "dynamo")
    q, k, v = qkv(2)
    torch.manual_seed(3)
    first = model(q, k, v)
    torch.manual_seed(3)
    assert torch.equal(model(q, k, v), first) and not torch.equal(model(q, k, v), first)
    assert trifuse.report(model).by_pattern() == {pattern: 1}
    # V = one row per key, one-hot: the output is the dropped-out weights themselves, each the
    # unfused (dropout-free) weight / (1 - p) or 0
    eye = torch.eye(S).expand(B, 2, S, S)
    dropped, weights = model(q, k, eye), unfused.eval()(q, k, eye)
    kept = dropped != 0
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(dropped[kept], weights[kept] / 0.5)
    model.eval()
    torch.testing.assert_close(model(q, k, v), unfused(q, k, v))


WINDOWS = 2  # windows per image in the Swin V2 tests: a batch of 4 windows is 2 images


def _window_mask() -> torch.Tensor:
    """Swin's shifted-window mask (windows, S, S): 0 within a region, -100 across regions (the
    first window one region, the second split in two), so no row is masked whole."""
    region = torch.tensor([[0] * S, [0] * (S // 2) + [1] * (S - S // 2)])
    return torch.where(region[:, :, None] == region[:, None, :], 0.0, -100.0)


class CosineWindowAttention(nn.Module):
    """Swin V2's attention core as transformers writes it (Swinv2SelfAttention) on (windows, H, S, D):
    cosine scores of q and k normalized, times a learned scale per head (exp of a clamp), plus a
    learned relative position bias (16 sigmoid of a table); in shifted windows (a window mask
    given, as Swin V2's layers pass it) the mask added twice over a (images, windows, H, S, S)
    view and viewed back; softmax, dropout, @ v. scale_shape other than (H, 1, 1) is a negative
    control (a scale varying along the keys)."""

    def __init__(self, p=0.0, scale_shape=(H, 1, 1)):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(scale_shape) + 1))
        self.bias_table = nn.Parameter(torch.randn(H, S, S))
        self.dropout = nn.Dropout(p)

    def forward(self, q, k, v, window_mask=None):
        scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        scores = scores * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        scores = scores + (16 * torch.sigmoid(self.bias_table)).unsqueeze(0)
        if window_mask is not None:
            n = window_mask.shape[0]
            scores = scores.view(q.shape[0] // n, n, H, S, S) + window_mask.unsqueeze(1).unsqueeze(0)
            scores = scores + window_mask.unsqueeze(1).unsqueeze(0)
            scores = scores.view(-1, H, S, S)
        probs = self.dropout(F.softmax(scores, dim=-1))
        return torch.matmul(probs, v)


def windows_qkv():
    return tuple(torch.randn(2 * WINDOWS, H, S, D) for _ in range(3))


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("windowed, pattern", [
    (True, "attention_chain_per_head_scale_add_window_mask_dropout"),
    (False, "attention_chain_per_head_scale_add_dropout"),
], ids=["shifted_windows", "windows"])
def test_swin_v2_cosine_attention_fuses(windowed, pattern, capture):
    """Outputs and gradients (the per-head scale's through q, the bias table's and the window
    mask's through the op's dMask summed over the batch, q's and k's through the normalize) equal
    the unfused module's; q's and k's F.normalize fuse as well (floored RMSNorms)."""
    inputs = windows_qkv() + ((_window_mask(),) if windowed else ())
    report = check_against_unfused(CosineWindowAttention, inputs, capture)
    assert report.by_pattern() == {pattern: 1, "l2_normalize": 2}


def test_swin_v2_cosine_attention_carries_dropout():
    """p is carried: in training the fused output is a dropout (a fixed seed repeats it, another
    seed differs), in eval it is the unfused output."""
    model = fuse_via(CosineWindowAttention(p=0.4), "dynamo")
    q, k, v, mask = *windows_qkv(), _window_mask()
    model.train()
    outs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        outs.append(model(q, k, v, mask))
    assert trifuse.report(model).by_pattern() == {"attention_chain_per_head_scale_add_window_mask_dropout": 1,
                                                  "l2_normalize": 2}
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert not torch.allclose(outs[0], outs[2])
    model.eval()
    unfused = CosineWindowAttention(p=0.4).eval()
    unfused.load_state_dict({name.removeprefix("blocks.0.inner."): t for name, t in model.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(model(q, k, v, mask), unfused(q, k, v, mask))


def test_swin_v2_scale_along_the_keys_is_left():
    """A scale that varies along the keys cannot move onto q: left as written, with the reason."""
    report = check_against_unfused(functools.partial(CosineWindowAttention, scale_shape=(H, 1, S)), windows_qkv(),
                                   "dynamo")
    assert report.by_pattern() == {"l2_normalize": 2}  # q's and k's norms alone
    assert any("not constant along the queries and keys" in reason for *_, reason in report.rejected())


def einsum_heads(m, q, k, v):  # lucidrains-style code: einsum on (B, H, S, D), the scale a multiply
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * D ** -0.5
    return torch.einsum("b h i j, b h j d -> b h i d", sim.softmax(dim=-1), v)


def chain_one_head_add(m, q, k, v):  # (batch * heads, S, D) tensors, an additive (batch * heads, S, S) mask
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D) + m.mask
    return torch.matmul(F.dropout(torch.softmax(scores, dim=-1), 0.0, m.training), v)


class LdmCrossAttention(nn.Module):
    """ldm's (Stable Diffusion's) CrossAttention core as written there, on (batch * heads, S, D):
    einsum scores times the scale, the key padding mask filled in place with -finfo.max (one
    entry's keys all masked: its rows are uniform, the mean of v), softmax, einsum with v."""

    def __init__(self):
        super().__init__()
        keep = torch.ones(2 * H, 1, S, dtype=torch.bool)
        keep[0, :, -2:] = False
        keep[1] = False
        self.register_buffer("keep", keep)
        self.scale = D ** -0.5

    def forward(self, q, k, v):
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        max_neg_value = -torch.finfo(sim.dtype).max
        sim.masked_fill_(~self.keep, max_neg_value)
        attn = sim.softmax(dim=-1)
        return torch.einsum("b i j, b j d -> b i d", attn, v)


def one_head_qkv():
    return tuple(torch.randn(2 * H, S, D) for _ in range(3))


@pytest.mark.parametrize("capture", CAPTURES)
def test_einsum_attention_fuses(capture):
    """einsum("bhid,bhjd->bhij") and einsum("bhij,bhjd->bhid") are canonicalized to matmul
    (fusion/normalize.py): the plain chain's pattern takes them."""
    report = check_against_unfused(functools.partial(Fn, einsum_heads), qkv(), capture)
    assert report.by_pattern() == {"attention_chain_mul_no_mask_no_dropout": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_one_head_chain_on_3d_tensors_fuses(capture):
    """(batch * heads, S, D) tensors run as one head each: the op's (N, 1, S, D), the 3-D mask
    given its head dim; outputs and gradients equal the unfused chain's."""
    mask = torch.randn(2 * H, S, S)
    report = check_against_unfused(functools.partial(Fn, chain_one_head_add, mask=mask), one_head_qkv(), capture)
    assert report.by_pattern() == {"attention_chain_div_add_dropout": 1}


def test_ldm_cross_attention_fuses():
    """The in-place masked_fill_ of a fresh product becomes masked_fill (normalize.py); the row of
    an entry whose keys are all masked is the mean of v, as unfused (fx cannot trace the finfo of a
    proxy's dtype: Dynamo captures it)."""
    report = check_against_unfused(LdmCrossAttention, one_head_qkv(), "dynamo")
    assert report.by_pattern() == {"attention_chain_mul_masked_fill_no_dropout": 1}


class XlmAttentionCore(nn.Module):
    """XLM's (and FlauBERT's) attention core as transformers writes it: q divided by sqrt(d) before
    the product, the key padding mask expanded to the scores (`expand_as`) and filled in place with
    finfo.min, the softmax of the scores upcast (`.float()`, then `type_as`), dropout, @ v. (No
    entry has all its keys masked: the float64 oracle's `.float()` turns finfo(float64).min into
    -inf there, NaN rows; ldm's test covers such rows.)"""

    def __init__(self):
        super().__init__()
        keep = torch.ones(B, S)
        keep[0, -2:] = 0
        keep[1, 0] = 0
        self.register_buffer("keep", keep)

    def forward(self, q, k, v):
        q = q / math.sqrt(D)
        scores = torch.matmul(q, k.transpose(2, 3))
        mask = (self.keep == 0).view(B, 1, 1, -1).expand_as(scores)
        scores.masked_fill_(mask, torch.finfo(scores.dtype).min)
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        weights = F.dropout(weights, p=0.0, training=self.training)
        return torch.matmul(weights, v)


def test_xlm_attention_fuses():
    """Three canonical forms meet here (normalize.py): the mask's `expand_as(scores)` becomes an
    expand to the scores' static shape (else the scores feed the mask and no pattern can take them
    whole), the in-place fill of the fresh scores becomes masked_fill, and `softmax(s.float())`
    softmax's dtype form; the q-scaled chain then fuses, equal to the unfused core."""
    report = check_against_unfused(XlmAttentionCore, qkv(), "dynamo")
    assert report.by_pattern() == {"attention_chain_unscaled_masked_fill_dropout_upcast": 1}


def test_a_masked_fill_read_before_it_is_written_stays_in_place():
    """A reader of the scores before the in-place fill reads them unfilled: that fill is left."""
    def read_before(m, q, k, v):
        sim = torch.matmul(q, k.transpose(-1, -2)) * 0.5
        before = sim.sum()
        sim.masked_fill_(~m.keep, -1e4)
        return torch.matmul(sim.softmax(dim=-1), v) + before

    report = check_against_unfused(functools.partial(Fn, read_before, keep=PAD), qkv(), "dynamo")
    assert report.by_pattern() == {}


def test_a_recapture_with_symbolic_sizes_still_fuses():
    """Called again with other sizes, Dynamo recaptures with symbolic ones; q's and v's head dims
    are then two symbols, and the op's output takes v's (not a guess from their example sizes
    being equal), so the replacement's shapes check and the chain fuses in both captures."""
    model = fuse_via(Fn(einsum_heads), "dynamo")
    for b, s, d in ((2, 6, 8), (3, 5, 16)):
        q, k, v = (torch.randn(b, H, s, d) for _ in range(3))
        out = model(q, k, v)
        torch.testing.assert_close(out, einsum_heads(None, q, k, v), rtol=1e-5, atol=1e-5)
        assert trifuse.report(model).by_pattern() == {"attention_chain_mul_no_mask_no_dropout": 1}


def timm_attention(m, q, k, v):  # timm's explicit attention (fused_attn=False): q scaled first
    q = q * D ** -0.5
    attn = q @ k.transpose(-2, -1)
    attn = attn.softmax(dim=-1)
    attn = F.dropout(attn, 0.0, m.training)
    return attn @ v


class HieraWindows(nn.Module):
    """Hiera's attention core as transformers writes it: q, k, v of (B, heads, windows, tokens,
    dim) permuted out of one projection, q scaled before the product, softmax, @ v; `mask_shape`
    adds a random mask of that shape over the 5-D scores (B, H, 2, S, S)."""

    def __init__(self, mask_shape=None):
        super().__init__()
        self.mask = None if mask_shape is None else torch.randn(mask_shape)

    def forward(self, qkv):
        q, k, v = qkv.reshape(B, S, 2, 3, H, D).permute(3, 0, 4, 2, 1, 5).unbind(0)
        attn = (q * D ** -0.5) @ k.transpose(-1, -2)
        if self.mask is not None:
            attn = attn + self.mask
        return attn.softmax(dim=-1) @ v


@pytest.mark.parametrize("capture", CAPTURES)
def test_q_scaled_before_the_product_fuses(capture):
    """`(q * scale) @ k^T` then softmax (timm's explicit attention): the op takes the scaled q
    with scale 1."""
    report = check_against_unfused(functools.partial(Fn, timm_attention), qkv(), capture)
    assert report.by_pattern() == {"attention_chain_unscaled_no_mask_dropout": 1}


@pytest.mark.parametrize("mask_shape", [None, (2, S, S), (H, 1, 1, S)],
                         ids=["unmasked", "per-window", "per-head"])
@pytest.mark.parametrize("capture", CAPTURES)
def test_hiera_5d_attention_fuses(capture, mask_shape):
    """(batch, heads, windows, tokens, dim) tensors, permuted out of one projection: all dims
    before the windows flattened into the op's batch (a copy: no view of the permutation), the
    output viewed back; a mask over the 5-D scores flattened with them (expanded over the batch
    first where it varies along the heads); outputs and gradients equal the unfused chain's."""
    report = check_against_unfused(functools.partial(HieraWindows, mask_shape),
                                   (torch.randn(B, 2 * S, 3 * H * D),), capture)
    name = "no_mask" if mask_shape is None else "add"
    assert report.by_pattern() == {f"attention_chain_unscaled_{name}_no_dropout": 1}


def test_a_mask_wider_than_the_5d_scores_is_left():
    """A mask with a dim the scores broadcast along (the output grows with it): no op's call."""
    report = check_against_unfused(functools.partial(HieraWindows, (3, 1, 1, 1, S, S)),
                                   (torch.randn(B, 2 * S, 3 * H * D),), "dynamo")
    assert report.by_pattern() == {}
    assert any("wider than them" in reason for *_, reason in report.rejected())


G = 3  # windows of a grid


class GridAttention(nn.Module):
    """torchvision's MaxViT attention core (RelativePositionalMultiHeadAttention): q, k, v of
    (batch, grid, heads, tokens, dim), k scaled, the products as einsums with spaced letters, a
    mask over the 5-D scores: MaxViT's learned (1, H, S, S) relative position bias ("bias", its
    gradient checked), a per-window float mask ("windows"), or a boolean key-padding mask per
    image filled with -inf ("padding"). `extra` puts one more dim before the grid (6-D)."""

    def __init__(self, kind: str, extra: bool = False):
        super().__init__()
        self.kind = kind
        lead = (2,) if extra else ()
        if kind == "bias":
            self.bias = nn.Parameter(torch.randn(1, H, S, S))
        elif kind == "windows":
            self.register_buffer("mask", torch.randn(G, 1, S, S))
        else:
            keep = torch.rand((B, *lead, 1, 1, 1, S), generator=torch.Generator().manual_seed(3)) > 0.4
            keep[..., 0] = True
            self.register_buffer("mask", ~keep)

    def forward(self, q, k, v):
        s = torch.einsum("... G H I D, ... G H J D -> ... G H I J", q, k * D ** -0.5)
        if self.kind == "padding":
            s = s.masked_fill(self.mask, float("-inf"))
        else:
            s = s + (self.bias if self.kind == "bias" else self.mask)
        return torch.einsum("... G H I J, ... G H J D -> ... G H I D", F.softmax(s, dim=-1), v)


@pytest.mark.parametrize("extra", [False, True], ids=["5d", "6d"])
@pytest.mark.parametrize("kind", ["bias", "windows", "padding"])
@pytest.mark.parametrize("capture", CAPTURES)
def test_maxvit_grid_attention_with_a_mask_over_its_scores_fuses(capture, kind, extra):
    lead = (B, 2) if extra else (B,)
    inputs = tuple(torch.randn(*lead, G, H, S, D, requires_grad=True) for _ in range(3))
    report = check_against_unfused(functools.partial(GridAttention, kind, extra), inputs, capture)
    masking = "masked_fill" if kind == "padding" else "add"
    assert report.by_pattern() == {f"attention_chain_unscaled_{masking}_no_dropout": 1}


class SdpaOfRank(nn.Module):
    """F.scaled_dot_product_attention on q, k, v of (*lead, heads, S, D): SDPA's unbatched call
    (lead ()), timm's Hiera ((B, heads, windows, ...): lead (B, H), windows as SDPA's heads), or
    two batch dims; `mask` a buffer or (a float one) a parameter, whose gradient is checked."""

    def __init__(self, mask=None, causal=False, learned=False, h_kv=None):
        super().__init__()
        self.causal, self.gqa = causal, h_kv is not None
        if learned:
            self.mask = nn.Parameter(mask)
        else:
            self.register_buffer("mask", mask)

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, self.mask, is_causal=self.causal, enable_gqa=self.gqa)


_BOOL_5D = torch.rand(B, 1, 1, 1, S, generator=torch.Generator().manual_seed(5)) > 0.3
_BOOL_5D[..., 0] = True  # every row keeps a key


@pytest.mark.parametrize("lead, mask, causal, learned", [
    ((), None, True, False),
    ((), torch.randn(S, S), False, True),
    ((), torch.randn(H, 1, S), False, False),
    ((B, 2), None, False, False),
    ((B, 2), torch.randn(1, 1, H, S, S), False, True),
    ((B, 2), torch.randn(2, 1, S, S), False, False),
    ((B, 2), _BOOL_5D, False, False),
    ((B, 2, 3), None, True, False),
    ((B, 2, 3), torch.randn(3, 1, S, S), False, False),
], ids=["unbatched-causal", "unbatched-learned-2d", "unbatched-per-head", "5d", "5d-learned-bias",
        "5d-per-window", "5d-key-padding", "6d-causal", "6d-per-window"])
@pytest.mark.parametrize("capture", CAPTURES)
def test_sdpa_of_another_rank_fuses(capture, lead, mask, causal, learned):
    """SDPA takes q, k, v of 3 dims or more than 4: the op's batch is then one, or every dim
    before the last ahead of (S, D); a mask (bool, float, or learned, with its gradient) reshaped
    with them; outputs and gradients equal SDPA's."""
    inputs = tuple(torch.randn(*lead, H, S, D, requires_grad=True) for _ in range(3))
    report = check_against_unfused(functools.partial(SdpaOfRank, mask, causal, learned), inputs, capture)
    assert report.by_pattern() == {"sdpa": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_unbatched_sdpa_with_grouped_heads_fuses(capture):
    """SDPA's unbatched (heads, S, D) call with enable_gqa: k and v of fewer heads, the op's GQA."""
    inputs = (torch.randn(H, S, D), torch.randn(2, S, D), torch.randn(2, S, D))
    report = check_against_unfused(functools.partial(SdpaOfRank, h_kv=2), inputs, capture)
    assert report.by_pattern() == {"sdpa": 1}


@pytest.mark.parametrize("shapes, words", [
    (((B, 2, H, S, D), (1, 2, H, S, D), (1, 2, H, S, D)), "differ before their heads"),
    (((H, S, D), (B, H, S, D), (B, H, S, D)), "not all alike"),
])
def test_sdpa_of_another_rank_it_cannot_take_is_left(shapes, words):
    """5-D k and v broadcast over q's batch, or a 3-D q beside 4-D k and v (SDPA broadcasts both):
    left as SDPA, with the reason."""
    report = check_against_unfused(SdpaOfRank, tuple(torch.randn(s) for s in shapes), "dynamo")
    assert report.by_pattern() == {}
    assert any(words in reason for *_, reason in report.rejected())


class InPlaceDropoutAttention(nn.Module):
    """timm's TNT attention core: the probabilities dropped out in place (`nn.Dropout(p,
    inplace=True)`); `reread` multiplies the softmax's own tensor after the dropout (what the
    in-place write leaves in it) instead of the dropout's result."""

    def __init__(self, p: float, reread: bool = False):
        super().__init__()
        self.attn_drop, self.reread = nn.Dropout(p, inplace=True), reread

    def forward(self, q, k, v):
        attn = (q @ k.transpose(-2, -1)) * D ** -0.5
        attn = attn.softmax(dim=-1)
        dropped = self.attn_drop(attn)
        return (attn if self.reread else dropped) @ v


@pytest.mark.parametrize("p, train, reread", [(0.0, True, False), (0.1, False, False), (0.0, True, True)],
                         ids=["training-p0", "eval", "reread"])
@pytest.mark.parametrize("capture", CAPTURES)
def test_in_place_dropout_of_the_probabilities_fuses(capture, p, train, reread):
    """An in-place dropout of the fresh softmax is the chain's out-of-place one (its later readers
    read the dropped tensor either way): fused, with the dropout's p and flag carried."""
    report = check_against_unfused(functools.partial(InPlaceDropoutAttention, p, reread), qkv(), capture,
                                   train=train)
    assert report.by_pattern() == {"attention_chain_mul_no_mask_dropout": 1}


class SqueezeBertSelfAttention(nn.Module):
    """transformers' SqueezeBertSelfAttention core: q, k, v out of 1x1 convolutions laid out (B, C,
    S); q and v viewed per head and permuted to (B, H, S, D), k viewed per head only, (B, H, D, S):
    k^T already, multiplied without a transpose; divided by sqrt(D), the additive mask, softmax,
    dropout, @ v, back to (B, C, S). `permuted_key`: the key permuted from (B, S, C) straight to
    (B, H, D, S) instead (another spelling of a key laid out transposed)."""

    def __init__(self, mask=None, p=0.0, permuted_key=False):
        super().__init__()
        self.mask, self.p, self.permuted_key = mask, p, permuted_key

    def forward(self, q, k, v):  # (B, H*D, S) each
        b, _, s = q.shape
        q = q.view(b, H, D, s).permute(0, 1, 3, 2)
        if self.permuted_key:
            k = k.permute(0, 2, 1).reshape(b, s, H, D).permute(0, 2, 3, 1)
        else:
            k = k.view(b, H, D, s)
        v = v.view(b, H, D, s).permute(0, 1, 3, 2)
        scores = torch.matmul(q, k) / math.sqrt(D)
        if self.mask is not None:
            scores = scores + self.mask
        probs = F.dropout(torch.softmax(scores, dim=-1), self.p, self.training)
        return torch.matmul(probs, v).permute(0, 1, 3, 2).contiguous().view(b, H * D, s)


def squeezebert_inputs():
    return tuple(torch.randn(B, H * D, S) for _ in range(3))


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("mask, permuted_key, pattern", [
    (None, False, "attention_chain_div_no_mask_dropout_k_transposed"),
    (ADDITIVE, False, "attention_chain_div_add_dropout_k_transposed"),
    (PAD.logical_not() * torch.finfo(torch.float32).min, True,
     "attention_chain_div_add_dropout_k_transposed"),
], ids=["no_mask", "additive", "padding_permuted_key"])
def test_key_laid_out_transposed_fuses(mask, permuted_key, pattern, capture):
    """A key already (B, H, D, S), multiplied without a transpose: the op takes its transpose (a
    view); outputs and gradients equal the unfused chain's, padded keys included."""
    report = check_against_unfused(functools.partial(SqueezeBertSelfAttention, mask, 0.0, permuted_key),
                                   squeezebert_inputs(), capture)
    assert report.by_pattern() == {pattern: 1}


def test_key_laid_out_transposed_carries_dropout():
    """The dropout probability reaches the op (repeatable under a seed, fresh masks otherwise);
    in eval it is off, as in the model."""
    model = fuse_via(SqueezeBertSelfAttention(ADDITIVE, p=0.5).train(), "dynamo")
    inputs = squeezebert_inputs()
    torch.manual_seed(3)
    first = model(*inputs)
    torch.manual_seed(3)
    assert torch.equal(model(*inputs), first) and not torch.equal(model(*inputs), first)
    assert trifuse.report(model).by_pattern() == {"attention_chain_div_add_dropout_k_transposed": 1}
    model.eval()
    torch.testing.assert_close(model(*inputs), SqueezeBertSelfAttention(ADDITIVE).eval()(*inputs))


def test_a_written_transpose_still_takes_the_usual_chain():
    """`q @ k.transpose(-2, -1)` keeps matching the chain with the transpose in it: the key laid out
    transposed is tried after it."""
    report = check_against_unfused(functools.partial(Fn, chain_div_no_mask), qkv(), "dynamo")
    assert report.by_pattern() == {"attention_chain_div_no_mask_no_dropout": 1}


class _SamStyleAttention(nn.Module):
    """transformers' SAM-style vision attention (GOT-OCR2's, DeepSeek-OCR's; SAM's own eager path):
    q, k, v as (batch * heads, patches, head_dim), `(q * scale) @ k^T` plus the decomposed
    relative-position bias computed from q and reshaped to the scores (`reshape_as`), the softmax
    in fp32 cast back, dropout, `@ v`; the block's output alone (its probabilities unread)."""

    def __init__(self):
        super().__init__()
        tf = pytest.importorskip("transformers")
        tf.logging.set_verbosity_error()
        cfg = tf.models.got_ocr2.configuration_got_ocr2.GotOcr2VisionConfig(
            hidden_size=H * D, num_attention_heads=H, image_size=16, patch_size=4, use_rel_pos=True)
        self.inner = tf.models.got_ocr2.modeling_got_ocr2.GotOcr2VisionAttention(cfg, window_size=0)
        with torch.no_grad():  # a bias that is not zero (SAM initializes the tables to zeros)
            self.inner.rel_pos_h.normal_()
            self.inner.rel_pos_w.normal_()

    def forward(self, x):
        return self.inner(x)[0]


def test_sam_style_attention_with_its_relative_position_bias_fuses():
    """The bias reads the scores only for their shape (`rel_pos.reshape_as(scores)`); Dynamo's
    static example shape makes it `reshape(<shape>)`, and the chain fuses with the bias as the op's
    mask, its gradient (to q and the position tables) through the op's. Dynamo only: an fx
    capture serves every size, so its graph keeps `reshape_as`."""
    report = check_against_unfused(_SamStyleAttention, (torch.randn(B, 4, 4, H * D),), "dynamo")
    assert report.by_pattern() == {"attention_chain_unscaled_add_dropout_upcast": 1}


QH, KH = 3, 2  # a 3 x 3 grid of queries, keys pooled to 2 x 2 (MViT's pooled k and v)


class MViTV2Attention(nn.Module):
    """timm's MViT V2 attention core (`cal_rel_pos_type`): `(q * scale) @ k^T`, decomposed
    relative positions from q (one table per axis, as einsums), added over a 6-D view of a slice
    of the scores written back in place: `s[:, :, t:, t:] = (s[:, :, t:, t:].view(...) + rel_h +
    rel_w).view(...)`, t = 1 past a class token, 0 without. `terms`: "both" (timm's), "h" (a sum
    that is not the view's shape: left), "read" (the scores also returned before the write: left)."""

    def __init__(self, cls_token: bool, terms: str = "both"):
        super().__init__()
        self.t, self.terms = int(cls_token), terms
        self.rel_h = nn.Parameter(torch.randn(QH, KH, D))
        self.rel_w = nn.Parameter(torch.randn(QH, KH, D))

    def forward(self, q, k, v):
        t, b = self.t, q.shape[0]
        s = (q * D ** -0.5) @ k.transpose(-2, -1)
        before = s.clone() if self.terms == "read" else None
        r_q = q[:, :, t:].reshape(b, H, QH, QH, D)
        rel_h = torch.einsum("byhwc,hkc->byhwk", r_q, self.rel_h).unsqueeze(-1)
        rel_w = torch.einsum("byhwc,wkc->byhwk", r_q, self.rel_w).unsqueeze(-2)
        grid = s[:, :, t:, t:].view(b, -1, QH, QH, KH, KH)
        s[:, :, t:, t:] = (grid + rel_h + (rel_w if self.terms != "h" else 0)).view(b, -1, QH * QH, KH * KH)
        out = s.softmax(dim=-1) @ v
        return out if before is None else (out, before)


def _mvit_inputs(cls_token: bool) -> tuple:
    t = int(cls_token)
    return tuple(torch.randn(B, H, t + n, D, requires_grad=True) for n in (QH * QH, KH * KH, KH * KH))


@pytest.mark.parametrize("cls_token", [False, True], ids=["no_cls", "cls"])
@pytest.mark.parametrize("capture", CAPTURES)
def test_mvitv2_relative_positions_written_into_a_slice_of_the_scores_fuse(capture, cls_token):
    """The slice update becomes `s + pad(rel_h + rel_w)` (zeros on the class token's row and
    column), the op's mask; its gradient reaches q and both tables through the op's."""
    report = check_against_unfused(functools.partial(MViTV2Attention, cls_token), _mvit_inputs(cls_token),
                                   capture)
    assert report.by_pattern() == {"attention_chain_unscaled_add_no_dropout": 1}


@pytest.mark.parametrize("terms", ["h", "read"])
def test_mvitv2_slice_update_that_is_not_a_mask_over_the_scores_is_left(terms):
    report = check_against_unfused(functools.partial(MViTV2Attention, True, terms), _mvit_inputs(True),
                                   "dynamo")
    assert report.by_pattern() == {}


def _add_rel_pos_untraceable(attn: torch.Tensor, q: torch.Tensor, rel_h: torch.Tensor) -> torch.Tensor:
    """torchvision's MViT `_add_rel_pos`, cut down: sizes read as Python numbers (`int(max(...))`),
    which fx cannot trace, the relative positions added to the scores past the class token in
    place (`attn[:, :, 1:, 1:] += rel_pos`)."""
    b, heads, n, dim = q.shape
    q_h = int(max(math.isqrt(n - 1), 1))
    r_q = q[:, :, 1:].reshape(b, heads, q_h, q_h, dim)
    rel = torch.einsum("byhwc,hkc->byhwk", r_q, rel_h)
    rel_pos = (rel[:, :, :, :, :, None] + rel[:, :, :, :, None, :]).reshape(b, heads, n - 1, -1)
    attn[:, :, 1:, 1:] += rel_pos
    return attn


torch.fx.wrap("_add_rel_pos_untraceable")


class TorchvisionMViTAttention(nn.Module):
    """torchvision's video MViT attention core: `matmul(scale * q, k^T)`, then `_add_rel_pos` (fx.wrap'd
    by torchvision, and untraceable by fx), softmax, `matmul` with v. Its keys are not pooled here."""

    def __init__(self):
        super().__init__()
        self.rel_h = nn.Parameter(torch.randn(QH, QH, D))

    def forward(self, q, k, v):
        attn = torch.matmul(D ** -0.5 * q, k.transpose(2, 3))
        attn = _add_rel_pos_untraceable(attn, q, self.rel_h)
        return torch.matmul(attn.softmax(dim=-1), v)


@pytest.mark.parametrize("capture", CAPTURES)
def test_torchvision_mvit_relative_positions_added_in_place_past_the_class_token_fuse(capture):
    """fx keeps the wrapped call whole; its result going to the softmax sends the block to Dynamo,
    where `attn[:, :, 1:, 1:] += rel_pos` becomes the scores plus the padded positions."""
    inputs = tuple(torch.randn(B, H, 1 + QH * QH, D, requires_grad=True) for _ in range(3))
    report = check_against_unfused(TorchvisionMViTAttention, inputs, capture)
    assert report.by_pattern() == {"attention_chain_unscaled_add_no_dropout": 1}


NW = 2  # windows of an image


class ShiftedWindowAttention(nn.Module):
    """timm's Swin WindowAttention with fused_attn off (swin_s3's blocks): q scaled, `q @ k^T`, the
    relative position bias added, then the shifted windows' (nW, N, N) mask added over a view of
    the scores that leaves the images to -1, `view(-1, nW, H, N, N)`, and viewed back; softmax,
    dropout. The block's norm after it (a LayerNorm fx finds without example values: with it,
    fuse installs the fx capture, which sees the window views once a call brings values)."""

    def __init__(self, padded: bool = False):
        super().__init__()
        self.padded = padded
        self.bias = nn.Parameter(torch.randn(1, H, S, S))
        self.register_buffer("mask", torch.randn(NW, S, S).masked_fill(torch.rand(NW, S, S) > 0.7, -100.0))
        self.register_buffer("pad", torch.arange(S) == S - 1)
        self.drop = nn.Dropout(0.0)
        self.norm = nn.LayerNorm(D)

    def forward(self, q, k, v):
        attn = (q * D ** -0.5) @ k.transpose(-2, -1)
        if self.padded:  # a key padding filled first (the last key of every window), not the bias
            attn = attn.masked_fill(self.pad, float("-inf"))
        else:
            attn = attn + self.bias
        nw = self.mask.shape[0]
        attn = attn.view(-1, nw, H, S, S) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, H, S, S).softmax(dim=-1)
        return self.norm(self.drop(attn) @ v)


@pytest.mark.parametrize("padded", [False, True], ids=["bias", "padding"])
@pytest.mark.parametrize("capture", CAPTURES)
def test_shifted_window_mask_over_a_view_of_minus_one_images_fuses_for_every_batch(capture, padded):
    """The tiled mask takes the images from q's size, not from the example batch: a second call
    with more images reuses fx's capture (it serves every size) and must still match, fused.
    Dynamo recaptures with dynamic sizes there, whose example value of the -1 view holds the
    batch as a symbolic quotient: that capture leaves the chain as written (and must match too)."""
    def windows(images):
        return tuple(torch.randn(images * NW, H, S, D, requires_grad=True) for _ in range(3))

    make = functools.partial(ShiftedWindowAttention, padded)
    report = check_against_unfused(make, windows(1), capture)
    name = "attention_chain_unscaled_" + ("masked_fill_add_dropout" if padded else "add_add")
    assert report.by_pattern() == {name: 1, "layer_norm": 1}
    torch.manual_seed(0)
    model = make().eval()
    model64 = copy.deepcopy(model).double()
    fused = fuse_via(copy.deepcopy(model), capture)
    for images in (1, 3):
        inputs = windows(images)
        assert_close(f"output of {images} images", fused(*inputs), model64(*(t.double() for t in inputs)),
                     model(*inputs))
    if capture == "fx":
        assert "trifuse::attention" in trifuse_ops_run(lambda: fused(*inputs))


class ChannelsFirstAttention(nn.Module):
    """timm's iFormer attention written out (fused_attn off): q, k, v as (B, C, N) maps, q scaled,
    `(q^T @ k).softmax(-1)`, dropout, the output channels first, `v @ attn^T`. `scale_after`: the
    scale on the scores instead (`* scale`)."""

    def __init__(self, scale_after: bool = False):
        super().__init__()
        self.scale_after = scale_after
        self.drop = nn.Dropout(0.0)

    def forward(self, q, k, v):
        if self.scale_after:
            attn = (q.transpose(-2, -1) @ k * D ** -0.5).softmax(dim=-1)
        else:
            attn = ((q * D ** -0.5).transpose(-2, -1) @ k).softmax(dim=-1)
        return v @ self.drop(attn).transpose(-2, -1)


@pytest.mark.parametrize("scale_after", [False, True], ids=["q_scaled", "scores_scaled"])
@pytest.mark.parametrize("capture", CAPTURES)
def test_channels_first_attention_fuses(capture, scale_after):
    inputs = tuple(torch.randn(B, D, S + 3, requires_grad=True) for _ in range(3))
    report = check_against_unfused(functools.partial(ChannelsFirstAttention, scale_after), inputs, capture)
    scaling = "mul" if scale_after else "unscaled"
    assert report.by_pattern() == {f"attention_chain_{scaling}_no_mask_dropout_k_transposed_v_transposed": 1}
