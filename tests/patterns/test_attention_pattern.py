"""Attention spellings become trifuse.attention: SDPA with each of its arguments, GQA by repeated
K/V, the explicit softmax chains, nn.MultiheadAttention's self-attention."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from _fusing import check_against_unfused, fuse_via, needs_ops, trifuse_ops_run
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


def sdpa_repeat_interleave(m, q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1))


def sdpa_repeat_kv(m, q, k, v):  # transformers' repeat_kv
    def repeat_kv(hidden, n_rep):
        b, h, s, d = hidden.shape
        return hidden[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)

    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)


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


CAUSAL = torch.tril(torch.ones(S, S)).view(1, 1, S, S)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("fn, buffers, h_kv, pattern", [
    (sdpa_plain, {}, H, "sdpa"),
    (sdpa_causal_scaled, {}, H, "sdpa"),
    (sdpa_bool_mask, {"mask": PAD}, H, "sdpa"),
    (sdpa_float_mask, {"mask": ADDITIVE}, H, "sdpa"),
    (sdpa_gqa_flag, {}, 2, "sdpa"),
    (sdpa_repeat_interleave, {}, 2, "sdpa_repeat_interleave_kv"),
    (sdpa_repeat_kv, {}, 2, "sdpa_expand_kv"),
    (chain_mul_additive, {"mask": ADDITIVE}, H, "attention_chain_mul_add_dropout"),
    (chain_div_no_mask, {}, H, "attention_chain_div_no_mask_no_dropout"),
    (chain_masked_fill, {"causal": CAUSAL}, H, "attention_chain_mul_masked_fill_no_dropout"),
    (chain_upcast, {"mask": ADDITIVE}, H, "attention_chain_mul_add_dropout_upcast"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_spelling_fuses_and_matches(fn, buffers, h_kv, pattern, capture):
    make = functools.partial(Fn, fn, **buffers)
    report = check_against_unfused(make, qkv(h_kv), capture)
    assert report.by_pattern() == {pattern: 1}


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


@pytest.mark.parametrize("fn, buffers", [
    (chain_finite_fill, {"causal": CAUSAL}),
    (chain_tensor_scale, {}),
    (chain_softmax_other_dim, {}),
    (chain_returns_probs, {}),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_near_misses_are_left(fn, buffers):
    report = check_against_unfused(functools.partial(Fn, fn, **buffers), qkv(), "dynamo")
    assert report.by_pattern() == {}


def test_rejections_say_why():
    report = check_against_unfused(functools.partial(Fn, chain_returns_probs), qkv(), "dynamo")
    assert any("outside the pattern" in reason for *_, reason in report.rejected())
    report = check_against_unfused(functools.partial(Fn, chain_tensor_scale), qkv(), "dynamo")
    assert any("tensor" in reason for *_, reason in report.rejected())
