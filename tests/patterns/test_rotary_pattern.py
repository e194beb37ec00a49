"""Rotary position embedding as Hugging Face writes it (apply_rotary_pos_emb, rotate_half), full and
partial rotary, q and k together or a tensor alone, rotate-half and interleaved (Cohere, GLM,
Helium) conventions, the complex product (Llama 4, DeepSeek-V2, torchtitan); what must not
fuse; SDPA after it still fuses."""
import copy

import pytest
import torch
import torch.nn.functional as F
import trifuse
from _fusing import check_against_unfused, fuse_via, needs_ops, trifuse_ops_run
from torch import nn

pytestmark = needs_ops("rotary_embedding")
B, S, HQ, HKV, D = 2, 6, 4, 2, 8
X = (torch.randn(B, S, HQ * D),)
CAPTURES = ["fx", "dynamo"]


def rotate_half(x):
    """transformers' rotate_half, verbatim."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb (Llama, 5.x), verbatim."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def rotate_half_concat_positional(x):
    half = x.shape[-1] // 2
    return torch.concat([-x[..., half:], x[..., :half]], 3)


def rotate_half_chunk(x):
    """rotate_half through `chunk` (Megatron's `_rotate_half`, diffusers' ERNIE-Image)."""
    halves = x.chunk(2, dim=-1)
    return torch.cat((-halves[1], halves[0]), dim=-1)


def rotate_half_chunk_sign_flipped(x):
    halves = x.chunk(2, dim=-1)
    return torch.cat((halves[1], -halves[0]), dim=-1)


def rotate_half_sign_flipped(x):
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


def rotate_half_off_centre(x):
    return torch.cat((-x[..., 3:], x[..., :3]), dim=-1)


def rotate_interleaved(x):
    """transformers' rotate_half of GLM and Helium, verbatim: the interleaved convention."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_interleaved_cohere(x):
    """transformers' rotate_half of Cohere, verbatim."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    rot_x = torch.stack([-x2, x1], dim=-1).flatten(-2)
    return rot_x


def rotate_interleaved_swapped(x):
    """Near miss: the odd features taken as the first of each pair (1::2 then 0::2)."""
    x1 = x[..., 1::2]
    x2 = x[..., 0::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_interleaved_sign_flipped(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x2, -x1), dim=-1).flatten(-2)


def rotate_interleaved_odd_only(x):
    """Near miss: both slices 1::2 (the even features never read)."""
    return torch.stack((-x[..., 1::2], x[..., 1::2]), dim=-1).flatten(-2)


def rotate_interleaved_stacked_before_last(x):
    """Near miss: stacked along dim -2, so flatten(-2) concatenates the halves instead."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-2).flatten(-2)


def rope_tables(s, d, per_batch, interleaved=False):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    pos = torch.arange(s).float()[None] + (torch.arange(B).float()[:, None] if per_batch else 0)
    freqs = pos[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()  # (B or 1, S, D), before the unsqueeze


class Rotary(nn.Module):
    """q and k projected and split into heads as Llama does, rotated, returned (or fed to SDPA)."""

    def __init__(self, rot=D, rotate=rotate_half, which="q_k", per_batch=False, learned=False, sdpa=False,
                 table_2d=False, half_q_k=False):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(HQ * D, HQ * D, bias=False), nn.Linear(HQ * D, HKV * D, bias=False)
        self.v_proj = nn.Linear(HQ * D, HKV * D, bias=False)
        cos, sin = rope_tables(S, rot, per_batch, interleaved=rotate is not rotate_half and "interleaved" in
                               getattr(rotate, "__name__", ""))
        if learned:
            self.cos, self.sin = nn.Parameter(cos), nn.Parameter(sin)
        else:
            self.register_buffer("cos", cos)
            self.register_buffer("sin", sin)
        self.rot, self.rotate, self.which, self.sdpa, self.table_2d = rot, rotate, which, sdpa, table_2d
        self.half_q_k = half_q_k

    def embed(self, x, cos, sin):
        return (x * cos) + (self.rotate(x) * sin)

    def forward(self, x):
        q = self.q_proj(x).view(B, S, -1, D).transpose(1, 2)
        k = self.k_proj(x).view(B, S, -1, D).transpose(1, 2)
        if self.half_q_k:  # 16-bit q and k beside fp32 tables, as under autocast
            q, k = q.half(), k.half()
        if self.table_2d:  # (S, D) tables broadcast by PyTorch, no unsqueeze
            cos, sin = self.cos[0], self.sin[0]
        else:
            cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        rot = self.rot
        q_rot, q_pass = q[..., :rot], q[..., rot:]
        k_rot, k_pass = k[..., :rot], k[..., rot:]
        if self.which == "q_k":
            q_rot, k_rot = self.embed(q_rot, cos, sin), self.embed(k_rot, cos, sin)
        else:  # q alone (k used as projected)
            q_rot = self.embed(q_rot, cos, sin)
        if rot < D:  # partial rotary (Phi, GPT-NeoX, StableLM): the rest passes through
            q_rot, k_rot = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)
        if self.sdpa:
            v = self.v_proj(x).view(B, S, -1, D).transpose(1, 2)
            return F.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True, enable_gqa=True)
        return q_rot, k_rot


class HFRotary(Rotary):
    """transformers' own function, called as Llama's attention calls it."""

    def forward(self, x):
        q = self.q_proj(x).view(B, S, -1, D).transpose(1, 2)
        k = self.k_proj(x).view(B, S, -1, D).transpose(1, 2)
        return apply_rotary_pos_emb(q, k, self.cos, self.sin)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [
    (HFRotary, "rotary_q_k"),
    (lambda: HFRotary(per_batch=True), "rotary_q_k"),
    (lambda: Rotary(rotate=rotate_half_concat_positional), "rotary_q_k"),
    (lambda: Rotary(rot=4), "rotary_q_k"),
    (lambda: Rotary(which="q"), "rotary"),
    (lambda: Rotary(learned=True), "rotary_q_k"),
    (lambda: Rotary(rotate=rotate_half_chunk), "rotary_chunk_q_k"),
    (lambda: Rotary(rot=4, rotate=rotate_half_chunk, learned=True), "rotary_chunk_q_k"),
    (lambda: Rotary(rotate=rotate_half_chunk, which="q"), "rotary_chunk"),
], ids=["hf-llama", "per-batch-positions", "concat-positional-dim", "partial-rotary", "q-alone", "learned-cos-sin",
        "chunk", "chunk-partial-learned", "chunk-q-alone"])
def test_spelling_fuses_and_matches(make, pattern, capture):
    """Outputs and every gradient (learned cos and sin included) equal the unfused module's."""
    assert check_against_unfused(make, X, capture).by_pattern() == {pattern: 1}


def apply_rotary_pos_emb_vision(q, k, cos, sin):
    """Qwen2-VL's (and Qwen2.5-VL's, GLM-4V's) rotary in its vision tower: q and k (patches,
    heads, head_dim) with no batch, the (patches, head_dim) tables unsqueezed over the heads, fp32
    around the rotation."""
    q_dtype, k_dtype = q.dtype, k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return ((q * cos) + (rotate_half(q) * sin)).to(q_dtype), ((k * cos) + (rotate_half(k) * sin)).to(k_dtype)


class VisionRotary(nn.Module):
    """A vision tower's attention: q and k projected to (patches, heads, head_dim), the patches of
    every image in one sequence, rotated by learned (patches, head_dim) tables (fp32 around the
    rotation, or not; or q alone)."""

    def __init__(self, cast=True, which="q_k"):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(HQ * D, HQ * D), nn.Linear(HQ * D, HQ * D)
        cos, sin = rope_tables(B * S, D, per_batch=False)
        self.cos, self.sin = nn.Parameter(cos[0]), nn.Parameter(sin[0])
        self.cast, self.which = cast, which

    def forward(self, x):
        q = self.q_proj(x).reshape(B * S, HQ, D)
        k = self.k_proj(x).reshape(B * S, HQ, D)
        if self.cast:
            return apply_rotary_pos_emb_vision(q, k, self.cos, self.sin)
        cos, sin = self.cos.unsqueeze(-2), self.sin.unsqueeze(-2)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        return q_embed if self.which == "q" else (q_embed, (k * cos) + (rotate_half(k) * sin))


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [(VisionRotary, "rotary_cast_q_k"),
                                           (lambda: VisionRotary(cast=False), "rotary_q_k"),
                                           (lambda: VisionRotary(cast=False, which="q"), "rotary")],
                         ids=["qwen2-vl", "uncast", "q-alone"])
def test_vision_tower_layout_without_batch_fuses_and_matches(make, pattern, capture):
    """(patches, heads, head_dim) q and k beside (patches, 1, head_dim) tables: the op on views of
    them as (1, heads, patches, head_dim), the output as the model's layout again; outputs and
    every gradient (the learned tables' too) as unfused. The casts around the rotation go into
    the op under Dynamo (under fx they stay, as ModernBERT's below)."""
    if pattern == "rotary_cast_q_k" and capture == "fx":
        pattern = "rotary_q_k"
    x = (torch.randn(B, S, HQ * D),)
    assert check_against_unfused(make, x, capture).by_pattern() == {pattern: 1}


def apply_rotary_pos_emb_cohere(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb of Cohere (5.x), verbatim: fp32 around the rotation."""
    dtype = q.dtype
    q = q.float()
    k = k.float()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_interleaved_cohere(q) * sin)
    k_embed = (k * cos) + (rotate_interleaved_cohere(k) * sin)
    return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)


def apply_rotary_pos_emb_glm(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb of GLM (5.x), verbatim: tables of the full head dim
    halved and repeated per pair, partial rotary."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_interleaved(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_interleaved(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


def apply_rotary_pos_emb_modernbert(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb of ModernBERT (5.x), verbatim: `q.float()` written twice,
    once for `q * cos` and once for rotate_half's input (normalize.py makes the two casts one)."""
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q.float() * cos) + (rotate_half(q.float()) * sin)
    k_embed = (k.float() * cos) + (rotate_half(k.float()) * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)


class InterleavedHFRotary(Rotary):
    """Cohere's or GLM's function, called as their attention calls it."""

    def __init__(self, apply, half_q_k=False):
        super().__init__(rotate=rotate_interleaved, half_q_k=half_q_k)
        self.apply_fn = apply

    def forward(self, x):
        q = self.q_proj(x).view(B, S, -1, D).transpose(1, 2)
        k = self.k_proj(x).view(B, S, -1, D).transpose(1, 2)
        if self.half_q_k:
            q, k = q.half(), k.half()
        return self.apply_fn(q, k, self.cos, self.sin)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [
    (lambda: InterleavedHFRotary(apply_rotary_pos_emb_cohere), "cohere-casts"),
    (lambda: InterleavedHFRotary(apply_rotary_pos_emb_glm), "rotary_interleaved_q_k"),
    (lambda: Rotary(rotate=rotate_interleaved), "rotary_interleaved_q_k"),
    (lambda: Rotary(rotate=rotate_interleaved_cohere, per_batch=True), "rotary_interleaved_q_k"),
    (lambda: Rotary(rotate=rotate_interleaved, rot=4), "rotary_interleaved_q_k"),
    (lambda: Rotary(rotate=rotate_interleaved, which="q"), "rotary_interleaved"),
    (lambda: Rotary(rotate=rotate_interleaved, learned=True), "rotary_interleaved_q_k"),
], ids=["hf-cohere", "hf-glm", "hf-helium", "cohere-per-batch", "partial-rotary", "q-alone", "learned-cos-sin"])
def test_interleaved_spelling_fuses_and_matches(make, pattern, capture):
    """The interleaved convention becomes the op with interleaved=True; outputs and every
    gradient equal the unfused module's. Cohere's casts around it are taken in under Dynamo (fx
    reads the fp32 copy's shape for rotate_half, outside the pattern: the casts stay there)."""
    if pattern == "cohere-casts":
        pattern = "rotary_interleaved_cast_q_k" if capture == "dynamo" else "rotary_interleaved_q_k"
    assert check_against_unfused(make, X, capture).by_pattern() == {pattern: 1}


def apply_rotary_pos_emb_deepseek(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' DeepSeek-V3 apply_rotary_pos_emb_interleave (5.x), verbatim: interleaved
    pairs in, rotate-half halves out, tables sliced to one entry per pair."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed


def apply_rotary_pos_emb_deepseek_swapped(q, k, cos, sin):
    """The halves in the other order: not DeepSeek's rotation."""
    cos, sin = cos[..., : cos.shape[-1] // 2].unsqueeze(1), sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    return (torch.cat([q2 * cos + q1 * sin, q1 * cos - q2 * sin], dim=-1),
            torch.cat([k2 * cos + k1 * sin, k1 * cos - k2 * sin], dim=-1))


class DeepSeekRotary(Rotary):
    """DeepSeek-V3's rotary part of q and k (the first `rot` features here), the rest passed through."""

    def __init__(self, apply=apply_rotary_pos_emb_deepseek, rot=D, which="q_k"):
        super().__init__(rot=rot)
        self.apply_fn, self.rot, self.which = apply, rot, which

    def forward(self, x):
        q = self.q_proj(x).view(B, S, -1, D).transpose(1, 2)
        k = self.k_proj(x).view(B, S, -1, D).transpose(1, 2)
        q_rot, q_pass = q[..., : self.rot], q[..., self.rot:]
        if self.which == "q":
            cos, sin = self.cos[..., : self.rot // 2].unsqueeze(1), self.sin[..., : self.rot // 2].unsqueeze(1)
            q1, q2 = q_rot[..., ::2], q_rot[..., 1::2]
            return torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1), k
        q_rot, k_rot = self.apply_fn(q_rot, k[..., : self.rot], self.cos, self.sin)
        return torch.cat([q_pass, q_rot], dim=-1), k_rot


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, counts", [
    (DeepSeekRotary, {"rotary_pairs_to_halves_q_k": 1}),
    (lambda: DeepSeekRotary(rot=4), {"rotary_pairs_to_halves_q_k": 1}),
    (lambda: DeepSeekRotary(which="q"), {"rotary_pairs_to_halves": 1}),
    (lambda: DeepSeekRotary(apply_rotary_pos_emb_deepseek_swapped), {}),
], ids=["hf-deepseek-v3", "partial-rotary", "q-alone-even-slice-from-start", "halves-swapped-left"])
def test_deepseek_pairs_to_halves_fuses_and_matches(make, counts, capture):
    """Interleaved pairs in, halves out becomes the op with halves_out=True (tables of one entry
    per pair); the halves in the other order are another rotation and stay as written."""
    assert check_against_unfused(make, X, capture).by_pattern() == counts


def rotate_every_two(x):
    """transformers' rotate_every_two of GPT-J and CodeGen (5.x), verbatim."""
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def apply_rotary_pos_emb_gptj(tensor, sin, cos):
    """transformers' apply_rotary_pos_emb of GPT-J and CodeGen (5.x), verbatim: (B, S, H, D)."""
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


class GPTJRotary(nn.Module):
    """GPT-J's attention up to the rotary: heads split without moving them, the first `rot` features
    of each head rotated with (1, S, rot / 2) tables, the rest passed, then the heads moved to dim 1."""

    def __init__(self, rot=D // 2, which="q_k"):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(HQ * D, HQ * D, bias=False), nn.Linear(HQ * D, HQ * D, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
        freqs = torch.arange(S).float()[:, None] * inv_freq
        self.register_buffer("sincos", torch.cat((freqs.sin(), freqs.cos()), dim=1)[None])
        self.rot, self.which = rot, which

    def forward(self, x):
        q, k = self.q_proj(x).view(B, S, HQ, D), self.k_proj(x).view(B, S, HQ, D)
        sin, cos = torch.split(self.sincos, self.sincos.shape[-1] // 2, dim=-1)
        k_rot, k_pass = k[:, :, :, : self.rot], k[:, :, :, self.rot:]
        q_rot, q_pass = q[:, :, :, : self.rot], q[:, :, :, self.rot:]
        if self.which == "q_k":
            k_rot = apply_rotary_pos_emb_gptj(k_rot, sin, cos)
        q_rot = apply_rotary_pos_emb_gptj(q_rot, sin, cos)
        k, q = torch.cat([k_rot, k_pass], dim=-1), torch.cat([q_rot, q_pass], dim=-1)
        return q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, rotated", [(GPTJRotary, 2), (lambda: GPTJRotary(rot=D), 2),
                                           (lambda: GPTJRotary(which="q"), 1)],
                         ids=["hf-gptj-partial", "whole-head", "q-alone"])
def test_gptj_rotate_every_two_fuses_and_matches(make, rotated, capture):
    """GPT-J's rotary on (B, S, H, D) tensors becomes the interleaved op on their transposes: q and
    k in one call where the graph computes the per-pair tables (Dynamo), one call each where fx
    has folded the tables of the buffer into two constants."""
    want = ({"rotary_every_two_q_k": 1} if rotated == 2 and capture == "dynamo" else {"rotary_every_two": rotated})
    assert check_against_unfused(make, X, capture).by_pattern() == want


def complex_table(s, d, per_batch):
    """A complex (B or 1, S, D/2) table from torch.polar, as Meta's Llama reference builds it."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    pos = torch.arange(s).float()[None] + (torch.arange(B).float()[:, None] if per_batch else 0)
    freqs = pos[..., None] * inv_freq
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb_llama4(xq, xk, freqs_cis):
    """transformers' Llama 4 apply_rotary_emb (5.x), verbatim: (B, S, H, D), the table sliced
    once for each of q and k."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def apply_rotary_emb_titan(xq, xk, freqs_cis):
    """torchtitan's and Meta's reference Llama spelling: the table viewed once to (1, S, 1, D/2)
    to broadcast over (B, S, H, D/2) complex pairs."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    shape = [d if i in (1, xq_.ndim - 1) else 1 for i, d in enumerate(xq_.shape)]
    freqs_cis = freqs_cis[0, : xq_.shape[1]].view(*shape)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def apply_rotary_emb_deepseek_v2(xq, xk, freqs_cis):
    """transformers' DeepSeek-V2 apply_rotary_emb (5.x), verbatim: (B, H, S, D)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(1).to(xq_.device)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)
    return xq_out, xk_out


def apply_rotary_emb_explicit_shapes(xq, xk, freqs_cis):
    """The same with the shapes written out (fx traces it; the `*x.shape` above it cannot)."""
    xq_ = torch.view_as_complex(xq.float().reshape(B, S, HQ, D // 2, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(B, S, HKV, D // 2, 2))
    freqs_cis = freqs_cis[:, :, None, :]
    return (torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk))


def apply_rotary_emb_inverse(xq, xk, freqs_cis):
    """The inverse rotation (the conjugate table): still the op, with sin negated."""
    return apply_rotary_emb_llama4(xq, xk, freqs_cis.conj())


def rotate_complex_alone(x, freqs_cis):
    """One (B, S, H, D) tensor rotated as complex pairs, Llama 4's way."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis[:, :, None, :]).flatten(3).type_as(x)


def rotate_qwen_image(x, freqs_cis):
    """diffusers' Qwen-Image apply_rotary_emb_qwen (use_real=False): its (S, D/2) table unsqueezed
    to (S, 1, D/2), a 3-D table against the (B, S, H, D/2) pairs."""
    x_rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_rotated * freqs_cis[0].unsqueeze(1)).flatten(3).type_as(x)


def apply_rotary_emb_qwen_image(xq, xk, freqs_cis):
    return rotate_qwen_image(xq, freqs_cis), rotate_qwen_image(xk, freqs_cis)


def rotate_complex_per_head_table(x, freqs_cis):
    """A table with a phase per head as well as per position: (B, S, H, D/2), not a rotary table
    of positions; left as written, with a reason."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    phase = torch.polar(torch.ones(x_.shape[2]), torch.arange(x_.shape[2]).float())
    return torch.view_as_real(x_ * (freqs_cis[:, :, None, :] * phase[None, None, :, None])).flatten(3).type_as(x)


class ComplexRotary(nn.Module):
    """q and k as (B, S, H, D) projections (Llama 4, torchtitan) or (B, H, S, D) (DeepSeek-V2),
    rotated as complex numbers, returned as (B, H, S, D) (or fed to SDPA)."""

    def __init__(self, apply=apply_rotary_emb_llama4, heads_first=False, per_batch=False, which="q_k",
                 sdpa=False, separate_k_table=False, half_q_k=False):
        super().__init__()
        self.half_q_k = half_q_k
        self.q_proj, self.k_proj = nn.Linear(HQ * D, HQ * D, bias=False), nn.Linear(HQ * D, HKV * D, bias=False)
        self.v_proj = nn.Linear(HQ * D, HKV * D, bias=False)
        self.register_buffer("freqs", complex_table(S, D, per_batch))
        self.register_buffer("k_freqs", complex_table(S, D, per_batch) * (1j if separate_k_table else 1))
        self.apply_fn, self.heads_first, self.which, self.sdpa = apply, heads_first, which, sdpa
        self.separate_k_table = separate_k_table

    def forward(self, x):
        q, k = self.q_proj(x).view(B, S, -1, D), self.k_proj(x).view(B, S, -1, D)
        if self.half_q_k:  # 16-bit q and k, as a bf16 model has them
            q, k = q.half(), k.half()
        if self.heads_first:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.which == "q":  # apply_fn rotates one tensor here
            q = self.apply_fn(q, self.freqs)
        elif self.separate_k_table:
            q, k = rotate_complex_alone(q, self.freqs), rotate_complex_alone(k, self.k_freqs)
        else:
            q, k = self.apply_fn(q, k, self.freqs)
        if not self.heads_first:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.sdpa:
            v = self.v_proj(x).view(B, S, -1, D).transpose(1, 2)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return q, k


@pytest.mark.parametrize("make, counts, captures", [
    (ComplexRotary, {"rotary_complex_cast_q_k": 1}, ["dynamo"]),
    (lambda: ComplexRotary(per_batch=True), {"rotary_complex_cast_q_k": 1}, ["dynamo"]),
    (lambda: ComplexRotary(apply_rotary_emb_titan), {"rotary_complex_cast_q_k": 1}, ["dynamo"]),
    (lambda: ComplexRotary(apply_rotary_emb_deepseek_v2, heads_first=True, per_batch=True),
     {"rotary_complex_cast_q_k": 1}, ["dynamo"]),
    (lambda: ComplexRotary(apply_rotary_emb_explicit_shapes), {"rotary_complex_cast_q_k": 1}, CAPTURES),
    (lambda: ComplexRotary(rotate_complex_alone, which="q"), {"rotary_complex_cast": 1}, ["dynamo"]),
    (lambda: ComplexRotary(separate_k_table=True), {"rotary_complex_cast": 2}, ["dynamo"]),
    (lambda: ComplexRotary(apply_rotary_emb_inverse), {"rotary_complex_cast_q_k": 1}, ["dynamo"]),
    (lambda: ComplexRotary(apply_rotary_emb_qwen_image), {"rotary_complex_cast_q_k": 1}, ["dynamo"]),
    (lambda: ComplexRotary(rotate_qwen_image, which="q"), {"rotary_complex_cast": 1}, ["dynamo"]),
], ids=["hf-llama4", "per-batch-positions", "torchtitan", "hf-deepseek-v2", "explicit-shapes", "q-alone",
        "other-table-for-k", "conjugate-table", "qwen-image-3d-table", "qwen-image-q-alone"])
def test_complex_product_fuses_and_matches(make, counts, captures):
    """The interleaved pairs times a complex table become the interleaved op with the table's
    real and imaginary parts: outputs and gradients equal the unfused module's, in both layouts;
    q and k with different tables are two calls."""
    for capture in captures:
        torch._dynamo.reset()
        assert check_against_unfused(make, X, capture).by_pattern() == counts


class RealPairsRope(nn.Module):
    """torchtune's RotaryPositionalEmbeddings as it computes: a (max_seq, D/2, 2) cache of (cos,
    sin), the pairs of a (B, S, H, D) tensor rotated in real arithmetic; `swapped` writes the
    rotation the other way round (a negative control: not this op's maths)."""

    def __init__(self, d=D, max_seq=2 * S, swapped=False):
        super().__init__()
        theta = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
        angles = torch.outer(torch.arange(max_seq).float(), theta)
        self.register_buffer("cache", torch.stack([angles.cos(), angles.sin()], dim=-1))
        self.swapped = swapped

    def forward(self, x):
        xs = x.float().reshape(*x.shape[:-1], -1, 2)
        cache = self.cache[: x.size(1)].view(-1, xs.size(1), 1, xs.size(3), 2)
        if self.swapped:  # the inverse rotation
            out = torch.stack([xs[..., 0] * cache[..., 0] + xs[..., 1] * cache[..., 1],
                               xs[..., 1] * cache[..., 0] - xs[..., 0] * cache[..., 1]], -1)
        else:
            out = torch.stack([xs[..., 0] * cache[..., 0] - xs[..., 1] * cache[..., 1],
                               xs[..., 1] * cache[..., 0] + xs[..., 0] * cache[..., 1]], -1)
        return out.flatten(3).type_as(x)


class RealPairsRotary(nn.Module):
    """torchtune's attention up to the rotary: one RoPE module applied to q and then to k, (B, S, H, D)."""

    def __init__(self, which="q_k", swapped=False):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(HQ * D, HQ * D, bias=False), nn.Linear(HQ * D, HKV * D, bias=False)
        self.pos_embeddings = RealPairsRope(swapped=swapped)
        self.which = which

    def forward(self, x):
        q, k = self.q_proj(x).view(B, S, -1, D), self.k_proj(x).view(B, S, -1, D)
        q = self.pos_embeddings(q)
        if self.which == "q_k":
            k = self.pos_embeddings(k)
        return q.transpose(1, 2), k.transpose(1, 2)


@pytest.mark.parametrize("make, counts", [
    (RealPairsRotary, {"rotary_real_pairs_cast_q_k": 1}),
    (lambda: RealPairsRotary(which="q"), {"rotary_real_pairs_cast": 1}),
    (lambda: RealPairsRotary(swapped=True), {}),
], ids=["torchtune-q-k", "q-alone", "rotation-swapped-left"])
def test_real_pairs_cache_fuses_and_matches(make, counts):
    """torchtune's (and gpt-fast's) rotary, the complex product in real arithmetic with a cache of
    (cos, sin) pairs viewed once per call: q and k in one call of the interleaved op; the rotation
    the other way round is another map and stays as written."""
    assert check_against_unfused(make, X, "dynamo").by_pattern() == counts


class ComplexRotaryOfInputs(nn.Module):
    def forward(self, q, k, freqs):
        return apply_rotary_emb_llama4(q, k, freqs)


def test_complex_product_recaptured_with_symbolic_sizes_still_fuses():
    """Called again with another batch and length, Dynamo recaptures with symbolic sizes (the
    reshape's target then holds graph nodes): the filters read their values and it still fuses."""
    model = fuse_via(ComplexRotaryOfInputs(), "dynamo")
    for b, s in ((2, 6), (3, 5)):
        q, k = torch.randn(b, s, HQ, D), torch.randn(b, s, HKV, D)
        freqs = complex_table(s, D, per_batch=False)
        for out, ref in zip(model(q, k, freqs), apply_rotary_emb_llama4(q, k, freqs)):
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        assert trifuse.report(model).by_pattern() == {"rotary_complex_cast_q_k": 1}


def apply_rotary_emb_no_casts(xq, xk, freqs_cis):
    """The complex product without the upcast and the cast back (q and k already fp32)."""
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    return (torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3),
            torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3))


def test_complex_product_without_casts_fuses():
    assert check_against_unfused(lambda: ComplexRotary(apply_rotary_emb_no_casts), X, "dynamo").by_pattern() == \
        {"rotary_complex_q_k": 1}


def test_complex_product_of_fp16_q_and_k_takes_the_casts_in():
    """q and k in fp16, upcast, rotated, cast back: one op call reading and writing fp16, its
    results rounded once as the model's are (outputs only, as for Cohere's fp16 test below)."""
    report = check_against_unfused(lambda: ComplexRotary(half_q_k=True), X, "dynamo", grads=False)
    assert report.by_pattern() == {"rotary_complex_cast_q_k": 1}
    model = fuse_via(ComplexRotary(half_q_k=True), "dynamo")
    ran = trifuse_ops_run(lambda: model(X[0]))
    assert "trifuse::rotary_embedding" in ran and all(o.dtype == torch.float16 for o in model(X[0]))


def test_complex_product_of_float64_q_keeps_its_fp32_rounding():
    """A float64 model's `.float()` rounds q and k to fp32: the casts stay outside the op, which
    then rotates the fp32 copies as the model does."""
    inner = ComplexRotary().double()
    ref = copy.deepcopy(inner)
    model = fuse_via(inner, "dynamo")
    x = X[0].double()
    for out, want in zip(model(x), ref(x)):
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # both rotate fp32 copies
    report = trifuse.report(model)
    assert report.by_pattern() == {"rotary_complex_q_k": 1}
    assert any("is not a 16-bit or fp32 tensor" in why for *_, why in report.rejected())


def test_complex_product_then_sdpa_fuses_both():
    report = check_against_unfused(lambda: ComplexRotary(sdpa=True), X, "dynamo")
    assert report.counts() == {"rotary": 1, "attention": 1}


def test_complex_product_runs_the_op_forward_and_backward():
    model = fuse_via(ComplexRotary(), "dynamo")
    x = X[0].clone().requires_grad_()
    ran = trifuse_ops_run(lambda: sum(o.sum() for o in model(x)).backward())
    assert {"trifuse::rotary_embedding", "trifuse::rotary_embedding_backward"} <= ran


def test_complex_product_with_a_table_per_head_is_left_with_a_reason():
    report = check_against_unfused(lambda: ComplexRotary(rotate_complex_per_head_table, which="q"), X, "dynamo")
    assert report.counts() == {}
    reasons = [why for _, _, pattern, why in report.rejected() if pattern == "rotary_complex"]
    assert any("is not one row per position" in why for why in reasons), reasons


@pytest.mark.parametrize("capture", CAPTURES)
def test_cohere_upcast_of_fp16_q_and_k_fuses(capture):
    """Cohere's `.float()` before the rotation and `.to(dtype)` after it: under Dynamo the op takes
    the fp16 q and k and writes fp16 (one pass); under fx the casts stay and the op takes the fp32
    copies (outputs only, as for the autocast mix above)."""
    report = check_against_unfused(lambda: InterleavedHFRotary(apply_rotary_pos_emb_cohere, half_q_k=True), X,
                                   capture, grads=False)
    want = "rotary_interleaved_cast_q_k" if capture == "dynamo" else "rotary_interleaved_q_k"
    assert report.by_pattern() == {want: 1}


class ModernBertRotary(Rotary):
    def forward(self, x):
        q = self.q_proj(x).view(B, S, -1, D).transpose(1, 2)
        k = self.k_proj(x).view(B, S, -1, D).transpose(1, 2)
        if self.half_q_k:
            q, k = q.half(), k.half()
        return apply_rotary_pos_emb_modernbert(q, k, self.cos, self.sin)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("half_q_k", [False, True], ids=["fp32", "fp16-q-k"])
def test_modernbert_upcast_written_twice_fuses(half_q_k, capture):
    """ModernBERT casts q (and k) to fp32 twice: both casts become one, and under Dynamo the op
    takes it and the `.to(original_dtype)` after in (fx: they stay, as for Cohere above). fp16 q
    and k: outputs only."""
    report = check_against_unfused(lambda: ModernBertRotary(half_q_k=half_q_k), X, capture, grads=not half_q_k)
    assert report.by_pattern() == {"rotary_cast_q_k" if capture == "dynamo" else "rotary_q_k": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_fp16_q_and_k_with_fp32_tables_fuse(capture):
    """Autocast's mix: the op returns fp32 as `q * cos` does (no cast added). Outputs only: the
    module's own `.half()` rounds the float64 oracle's gradients as much as the model's, so they
    are no oracle here; tests/kernels/test_rotary.py checks these gradients against float64."""
    report = check_against_unfused(lambda: Rotary(half_q_k=True), X, capture, grads=False)
    assert report.by_pattern() == {"rotary_q_k": 1}
    assert not any("cast back" in note for note in str(report).splitlines() if "rotary" in note)


@pytest.mark.parametrize("capture", CAPTURES)
def test_sdpa_after_the_rotary_still_fuses(capture):
    report = check_against_unfused(lambda: Rotary(sdpa=True), X, capture)
    assert report.counts() == {"rotary": 1, "attention": 1}


def test_trifuse_op_runs_forward_and_backward():
    model = fuse_via(HFRotary(), "dynamo")
    x = X[0].clone().requires_grad_()
    ran = trifuse_ops_run(lambda: sum(o.sum() for o in model(x)).backward())
    assert {"trifuse::rotary_embedding", "trifuse::rotary_embedding_backward"} <= ran


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make", [
    lambda: Rotary(rotate=rotate_half_sign_flipped),
    lambda: Rotary(rotate=rotate_interleaved_swapped),
    lambda: Rotary(rotate=rotate_interleaved_sign_flipped),
    lambda: Rotary(rotate=rotate_half_chunk_sign_flipped),
], ids=["sign-flipped", "interleaved-swapped", "interleaved-sign-flipped", "chunk-sign-flipped"])
def test_other_rotations_are_left_as_written(make, capture):
    """Neither convention: no rotary matches, and the module computes what it did. (The rotary
    family alone: with every family the last sum of products may go to the gated add's op.)"""
    report = check_against_unfused(make, X, capture, ops=["rotary"])
    assert report.counts() == {}


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, reason", [
    (lambda: Rotary(rotate=rotate_half_off_centre), "splits q's last dim (8) at 3, not in half"),
    (lambda: Rotary(table_2d=True), "cos is 2-D, not (batch or 1, 1, seq, head_dim)"),
    (lambda: Rotary(rotate=rotate_interleaved_odd_only), "pairs q[..., 1::2] with q[..., 1::2], not 0::2"),
    (lambda: Rotary(rotate=rotate_interleaved_stacked_before_last), "stacks q along dim -2, not a new last dim"),
    (lambda: Rotary(rotate=rotate_interleaved, table_2d=True), "cos is 2-D, not (batch or 1, 1, seq, head_dim)"),
], ids=["split-off-centre", "2d-table", "interleaved-odd-only", "interleaved-stack-dim", "interleaved-2d-table"])
def test_rejected_with_reason(make, reason, capture):
    report = check_against_unfused(make, X, capture, ops=["rotary"])
    assert report.counts() == {}
    reasons = [why for _, _, pattern, why in report.rejected() if pattern in ("rotary_q_k", "rotary_interleaved_q_k")]
    assert any(reason in why for why in reasons), reasons


# ---------------------------------------------------------------------------------------------
# diffusers' apply_rotary_emb (use_real=True): Flux, Chroma, HunyuanVideo (pairs), CogView4, Cosmos (halves)
# ---------------------------------------------------------------------------------------------


def diffusers_apply_rotary_emb(x, freqs_cis, use_real_unbind_dim=-1, sequence_dim=2):
    """diffusers' apply_rotary_emb with use_real=True, verbatim but for the branch on use_real."""
    cos, sin = freqs_cis  # [S, D]
    if sequence_dim == 2:
        cos = cos[None, None, :, :]
        sin = sin[None, None, :, :]
    elif sequence_dim == 1:
        cos = cos[None, :, None, :]
        sin = sin[None, :, None, :]
    cos, sin = cos.to(x.device), sin.to(x.device)
    if use_real_unbind_dim == -1:
        x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)  # [B, H, S, D//2]
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    else:
        x_real, x_imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)  # [B, H, S, D//2]
        x_rotated = torch.cat([-x_imag, x_real], dim=-1)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


class DiffusersRotary(nn.Module):
    """q and k projected, laid out (B, S, H, D) as Flux's attention (or (B, H, S, D)), rotated by
    apply_rotary_emb each with one (S, D) table pair given as inputs (k too unless `which` is "q";
    `k_table` "other": k rotated by another table)."""

    def __init__(self, unbind: int = -1, sequence_dim: int = 1, which: str = "q_k", k_table: str = "same"):
        super().__init__()
        self.unbind, self.sequence_dim, self.which, self.k_table = unbind, sequence_dim, which, k_table
        self.proj = nn.Linear(HQ * D, 2 * HQ * D)

    def forward(self, x, cos, sin):
        q, k = (t.unflatten(-1, (HQ, D)) for t in self.proj(x).chunk(2, dim=-1))
        if self.sequence_dim == 2:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = diffusers_apply_rotary_emb(q, (cos, sin), self.unbind, self.sequence_dim)
        if self.which == "q_k":
            k_freqs = (cos, sin) if self.k_table == "same" else (cos.flip(0), sin.flip(0))
            k = diffusers_apply_rotary_emb(k, k_freqs, self.unbind, self.sequence_dim)
        return q, k


def diffusers_tables(dtype=torch.float32):
    angles = torch.randn(S, D // 2).repeat_interleave(2, dim=-1)  # Flux's: each angle for a pair
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("which", ["q_k", "q"])
@pytest.mark.parametrize("sequence_dim", [1, 2])
@pytest.mark.parametrize("unbind, spelling", [(-1, "pairs"), (-2, "halves")])
def test_diffusers_apply_rotary_emb_fuses_and_matches(unbind, spelling, sequence_dim, which):
    """Either unbind, positions on dim 1 (Flux's (B, S, H, D)) or 2, q and k in one call (their
    tables the same views of one (S, D) pair) or a tensor alone; outputs and every gradient."""
    report = check_against_unfused(lambda: DiffusersRotary(unbind, sequence_dim, which),
                                   (X[0], *diffusers_tables()), "dynamo")
    name = f"rotary_unbind_{spelling}" + ("_q_k" if which == "q_k" else "")
    assert report.by_pattern() == {name: 1}, report.table()


@pytest.mark.parametrize("unbind", [-1, -2])
def test_diffusers_rotary_of_16_bit_q_and_k_with_fp32_tables(unbind):
    """Flux in bf16 (fp16 here): 16-bit q and k, fp32 tables, the rotation in fp32 cast back: the
    op reads and writes the 16-bit tensors, rounding once as the model does."""
    report = check_against_unfused(lambda: DiffusersRotary(unbind).half(), (X[0].half(), *diffusers_tables()),
                                   "dynamo")
    assert report.counts() == {"rotary": 1}, report.table()
    model = fuse_via(DiffusersRotary(unbind).half(), "dynamo")
    out = model(X[0].half(), *diffusers_tables())
    assert all(o.dtype == torch.float16 for o in out)


def test_diffusers_rotary_of_float64_q_and_k_is_left_with_a_reason():
    """A float64 model's `.float()` rounds q and k to fp32, which the op would not: left."""
    model = fuse_via(DiffusersRotary().double(), "dynamo")
    model(X[0].double(), *diffusers_tables(torch.float64))
    report = trifuse.report(model)
    assert report.counts() == {}, report.table()
    assert any("not a 4-D 16-bit or fp32 tensor" in why for *_, why in report.rejected()), report.table()


def test_diffusers_rotary_of_q_and_k_by_different_tables_is_two_calls():
    report = check_against_unfused(lambda: DiffusersRotary(k_table="other"), (X[0], *diffusers_tables()),
                                   "dynamo")
    assert report.by_pattern() == {"rotary_unbind_pairs": 2}, report.table()


def test_diffusers_rotary_runs_the_op_forward_and_backward():
    model = fuse_via(DiffusersRotary(), "dynamo")
    x = X[0].clone().requires_grad_()
    ran = trifuse_ops_run(lambda: sum(o.sum() for o in model(x, *diffusers_tables())).backward())
    assert {"trifuse::rotary_embedding", "trifuse::rotary_embedding_backward"} <= ran


def ltx_apply_rotary_emb(x, freqs):
    """diffusers' LTX-Video apply_rotary_emb (LTX-2's apply_interleaved_rotary_emb), verbatim: 3-D
    (B, S, C) x, the heads not yet split, (B, S, C) tables."""
    cos, sin = freqs
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)  # [B, S, C // 2]
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


class LtxRotary(nn.Module):
    """q and k projected to (B, S, C), rotated before their heads are split (k by a table of its
    own with `k_table` "other"; q the other way round with `q_inverse`, a near miss), then the
    attention over the heads."""

    def __init__(self, k_table: str = "same", q_inverse: bool = False) -> None:
        super().__init__()
        self.k_table, self.q_inverse = k_table, q_inverse
        self.proj = nn.Linear(HQ * D, 2 * HQ * D)

    def forward(self, x, cos, sin):
        q, k = self.proj(x).chunk(2, dim=-1)
        if self.q_inverse:  # (imag, -real): the rotation by minus the angle, which the op is not
            real, imag = q.unflatten(2, (-1, 2)).unbind(-1)
            q = (q.float() * cos + torch.stack([imag, -real], dim=-1).flatten(2).float() * sin).to(q.dtype)
        else:
            q = ltx_apply_rotary_emb(q, (cos, sin))
        k = ltx_apply_rotary_emb(k, (cos, sin) if self.k_table == "same" else (cos.flip(1), sin.flip(1)))
        b, s, _ = q.shape
        q, k = (t.view(b, s, HQ, D).transpose(1, 2) for t in (q, k))
        return F.scaled_dot_product_attention(q, k, k)


def ltx_tables(batch: int = B, dtype=torch.float32):
    # one table per sample, as LTX builds from its video coordinates
    angles = torch.randn(batch, S, HQ * D // 2).repeat_interleave(2, dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("batch", [1, B])
@pytest.mark.parametrize("k_table, patterns", [("same", {"rotary_unflatten_pairs_q_k": 1}),
                                               ("other", {"rotary_unflatten_pairs": 2})])
def test_ltx_rotary_before_the_head_split_fuses_and_matches(k_table, patterns, batch, capture):
    """LTX-Video's rotary of (B, S, C) q and k by one (B or 1, S, C) table: one call over C as a
    single head (pairs never cross a head); by tables of their own, a call each (LTX-2's
    cross-attention). Outputs and every gradient; the sdpa fuses beside them."""
    report = check_against_unfused(lambda: LtxRotary(k_table), (X[0], *ltx_tables(batch)), capture)
    assert report.by_pattern() == {**patterns, "sdpa": 1}, report.table()


def test_ltx_rotary_of_16_bit_q_and_k_with_fp32_tables():
    report = check_against_unfused(lambda: LtxRotary().half(), (X[0].half(), *ltx_tables()), "dynamo")
    assert report.by_pattern()["rotary_unflatten_pairs_q_k"] == 1, report.table()
    model = fuse_via(LtxRotary().half(), "dynamo")
    x = X[0].half().clone().requires_grad_()
    ran = trifuse_ops_run(lambda: model(x, *ltx_tables()).sum().backward())
    assert {"trifuse::rotary_embedding", "trifuse::rotary_embedding_backward"} <= ran


def test_ltx_rotary_the_other_way_round_is_left():
    """q's rotation the other way round is no rotary the op computes: k's alone fuses; q's sum of
    full-size products, cast back, is left to the gated add's op (one pass for the product and the
    sum, the model's fp32 maths)."""
    report = check_against_unfused(lambda: LtxRotary(q_inverse=True), (X[0], *ltx_tables()), "dynamo")
    assert report.by_pattern() == {"rotary_unflatten_pairs": 1, "sdpa": 1, "gated_add_promoted": 1}, report.table()


def test_ltx_rotary_of_a_float64_model_is_left_with_a_reason():
    """A float64 model's `.float()` rounds q and k to fp32, which the op would not: the rotary is
    left (its sums of full-size products, on the fp32 copies the model rounds to, go to the gated
    add's op); the answer is the unfused model's."""
    report = check_against_unfused(lambda: LtxRotary().double(), (X[0].double(), *ltx_tables(dtype=torch.float64)),
                                   "dynamo")
    assert "rotary" not in report.counts(), report.table()
    assert report.by_pattern().get("gated_add_promoted") == 2, report.table()


def wan_apply_rotary_emb(hidden_states, freqs_cos, freqs_sin, cos_offset=0):
    """diffusers' Wan attention processor's apply_rotary_emb, verbatim (`cos_offset` 1 reads
    the cosines of the odd entries, a near miss where the table is no pairwise repeat)."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., cos_offset::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


class WanRotary(nn.Module):
    """q and k projected and split into (B, S, H, D) heads as Wan's attention does, each rotated
    by (1, S, 1, D) tables held as buffers (float64, as Wan registers them, unless the model was
    cast whole), then the attention."""

    def __init__(self, dtype=torch.float32, table_dtype=torch.float64, cos_offset: int = 0) -> None:
        super().__init__()
        self.cos_offset = cos_offset
        self.proj = nn.Linear(HQ * D, 2 * HQ * D, dtype=dtype)
        angles = torch.randn(1, S, 1, D // 2).repeat_interleave(2, dim=-1)  # a pairwise repeat
        self.register_buffer("cos", angles.cos().to(table_dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(table_dtype), persistent=False)

    def forward(self, x):
        q, k = (t.unflatten(2, (HQ, -1)) for t in self.proj(x).chunk(2, dim=-1))
        q = wan_apply_rotary_emb(q, self.cos, self.sin, self.cos_offset)
        k = wan_apply_rotary_emb(k, self.cos, self.sin)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("x_dtype, table_dtype, pattern", [
    (torch.float32, torch.float64, "rotary_written_pairs_cast_q_k"),  # the halves cast back by their writes
    (torch.float16, torch.float64, "rotary_written_pairs_cast_q_k"),
    (torch.float32, torch.float32, "rotary_written_pairs_q_k"),  # a model cast whole, tables and all
    (torch.float16, torch.float16, "rotary_written_pairs_q_k"),
], ids=["fp32-fp64", "fp16-fp64", "fp32-fp32", "fp16-fp16"])
def test_wan_rotary_written_into_an_empty_like_fuses_and_matches(x_dtype, table_dtype, pattern, capture):
    """Wan's rotary: its two strided writes into `empty_like(x)` are the stack they compute, and
    q and k go in one call; outputs and every gradient by the oracle rule."""
    report = check_against_unfused(lambda: WanRotary(x_dtype, table_dtype), (X[0].to(x_dtype),), capture)
    assert report.by_pattern() == {pattern: 1, "sdpa": 1}, report.table()


def test_wan_rotary_runs_the_op_forward_and_backward():
    model = fuse_via(WanRotary(), "dynamo")
    x = X[0].clone().requires_grad_()
    ran = trifuse_ops_run(lambda: model(x).sum().backward())
    assert {"trifuse::rotary_embedding", "trifuse::rotary_embedding_backward"} <= ran


def test_wan_rotary_reading_the_cosines_of_the_odd_entries_is_left():
    """Of a table that is no pairwise repeat, the odd entries' cosines are another rotation: q is
    left (k, rotated as Wan does, fuses alone)."""
    report = check_against_unfused(lambda: WanRotary(cos_offset=1), X, "dynamo")
    assert report.by_pattern() == {"rotary_written_pairs_cast": 1, "sdpa": 1}, report.table()


def allegro_apply_rotary_emb(x, freqs_cis, positions):
    """diffusers' apply_rotary_emb_allegro: rotate-half on each third of the head, its tables
    gathered per position, each product's operand upcast and the sum cast back."""
    def apply_1d_rope(tokens, pos, cos, sin):
        cos = F.embedding(pos, cos)[:, None, :, :]
        sin = F.embedding(pos, sin)[:, None, :, :]
        x1, x2 = tokens[..., : tokens.shape[-1] // 2], tokens[..., tokens.shape[-1] // 2 :]
        tokens_rotated = torch.cat((-x2, x1), dim=-1)
        return (tokens.float() * cos + tokens_rotated.float() * sin).to(tokens.dtype)

    (t_cos, t_sin), (h_cos, h_sin), (w_cos, w_sin) = freqs_cis
    t, h, w = x.chunk(3, dim=-1)
    t = apply_1d_rope(t, positions[0], t_cos, t_sin)
    h = apply_1d_rope(h, positions[1], h_cos, h_sin)
    w = apply_1d_rope(w, positions[2], w_cos, w_sin)
    return torch.cat([t, h, w], dim=-1)


class AllegroRotary(nn.Module):
    """q and k (B, H, S, 24) rotated by Allegro's three 1-D rotaries (one table pair for all three)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2 * 24, 4 * 24)

    def forward(self, x, cos, sin, positions):
        q, k = (t.unflatten(-1, (2, 24)).transpose(1, 2) for t in self.proj(x).chunk(2, dim=-1))
        freqs, pos = ((cos, sin),) * 3, (positions,) * 3
        return allegro_apply_rotary_emb(q, freqs, pos), allegro_apply_rotary_emb(k, freqs, pos)


def allegro_inputs(dtype=torch.float32):
    angles = torch.randn(S, 4).repeat(1, 2)  # rotate-half tables for an 8-wide third of the head
    return (torch.randn(B, S, 2 * 24).to(dtype), angles.cos(), angles.sin(), torch.arange(S).repeat(B, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_allegros_rotary_with_each_product_cast_fuses(dtype):
    """Six rotations (three thirds of q and of k), each the op reading and writing x's dtype."""
    report = check_against_unfused(lambda: AllegroRotary().to(dtype), allegro_inputs(dtype), "dynamo")
    assert report.by_pattern() == {"rotary_cast_each": 6}, report.table()


def test_allegros_rotary_of_float64_q_and_k_is_left_with_a_reason():
    model = fuse_via(AllegroRotary().double(), "dynamo")
    x, cos, sin, positions = allegro_inputs(torch.float64)
    model(x, cos.double(), sin.double(), positions)
    report = trifuse.report(model)
    assert report.counts() == {}, report.table()
    assert any("is not a 16-bit or fp32 tensor" in why for *_, why in report.rejected()), report.table()


# ---------------------------------------------------------------------------------------------
# BFL's Flux reference and diffusers' HiDream: each pair times a 2x2 matrix from a (.., D/2, 2, 2) table
# ---------------------------------------------------------------------------------------------


def apply_rope_bfl(xq, xk, freqs_cis):
    """BFL's `flux.math.apply_rope` (and diffusers' HiDream `apply_rope`), verbatim."""
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


def apply_rope_bfl_alone(x, freqs_cis):
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    return (freqs_cis[..., 0] * x_[..., 0] + freqs_cis[..., 1] * x_[..., 1]).reshape(*x.shape).type_as(x)


def apply_rope_columns_swapped(xq, xk, freqs_cis):
    """Each pair's features times the other column: another linear map (a negative control)."""
    out = []
    for x in (xq, xk):
        x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
        swapped = freqs_cis[..., 1] * x_[..., 0] + freqs_cis[..., 0] * x_[..., 1]
        out.append(swapped.reshape(*x.shape).type_as(x))
    return tuple(out)


def rope_matrices(positions: torch.Tensor, d: int = D, theta: float = 10000.0) -> torch.Tensor:
    """BFL's `flux.math.rope`: (B, S, D/2, 2, 2) matrices [[cos, -sin], [sin, cos]] per pair."""
    omega = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.einsum("...n,d->...nd", positions.double(), omega)
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([cos, -sin, sin, cos], dim=-1).view(*angles.shape, 2, 2).float()


class MatrixRotary(nn.Module):
    """q and k projected and rotated by 2x2 matrices: BFL's layout, (B, H, S, D) with a (B, 1, S, D/2,
    2, 2) table (`heads_first`), or HiDream's, (B, S, H, D) with (B, S, 1, D/2, 2, 2). `table`:
    "rope" (rotations, per-sample positions), "any" (random matrices: no rotation at all),
    "learned" (a Parameter), "per_head" (a matrix per head too: not a table of positions)."""

    def __init__(self, apply=apply_rope_bfl, heads_first=True, which="q_k", table="rope", half_q_k=False):
        super().__init__()
        self.q_proj = nn.Linear(HQ * D, HQ * D, bias=False)
        self.k_proj = nn.Linear(HQ * D, HKV * D, bias=False)
        positions = torch.arange(S).float() + torch.tensor([[0.0], [3.0]])
        matrices = rope_matrices(positions) if table == "rope" else torch.randn(B, S, D // 2, 2, 2)
        matrices = matrices.unsqueeze(1 if heads_first else 2)
        if table == "per_head":
            matrices = matrices.expand(-1, HQ, -1, -1, -1, -1) if heads_first else \
                matrices.expand(-1, -1, HQ, -1, -1, -1)
        if table == "learned":
            self.freqs = nn.Parameter(matrices)
        else:
            self.register_buffer("freqs", matrices.contiguous())
        self.apply_fn, self.heads_first, self.which, self.half_q_k = apply, heads_first, which, half_q_k

    def forward(self, x):
        q, k = self.q_proj(x).view(B, S, -1, D), self.k_proj(x).view(B, S, -1, D)
        if self.half_q_k:
            q, k = q.half(), k.half()
        if self.heads_first:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.which == "q":
            q = self.apply_fn(q, self.freqs)
        else:
            q, k = self.apply_fn(q, k, self.freqs)
        if not self.heads_first:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        return q, k


@pytest.mark.parametrize("make, counts", [
    (MatrixRotary, {"rotary_matrix_cast_q_k": 1}),
    (lambda: MatrixRotary(heads_first=False), {"rotary_matrix_cast_q_k": 1}),
    (lambda: MatrixRotary(apply_rope_bfl_alone, which="q"), {"rotary_matrix_cast": 1}),
    (lambda: MatrixRotary(table="any"), {"rotary_matrix_cast_q_k": 1}),
    (lambda: MatrixRotary(heads_first=False, table="learned"), {"rotary_matrix_cast_q_k": 1}),
    (lambda: MatrixRotary(apply_rope_columns_swapped), {}),
], ids=["bfl-flux", "hidream-layout", "q-alone", "any-matrices", "learned-table", "columns-swapped-left"])
def test_matrix_rotary_fuses_and_matches(make, counts):
    """Each pair times a 2x2 matrix becomes the interleaved op with D-wide tables that carry the
    matrix: outputs and every gradient (the learned table's too) equal the unfused module's, for
    rotations and for matrices that are none; the columns the other way round stay as written."""
    assert check_against_unfused(make, X, "dynamo").by_pattern() == counts


def test_matrix_rotary_of_fp16_q_and_k_takes_the_casts_in():
    report = check_against_unfused(lambda: MatrixRotary(half_q_k=True), X, "dynamo", grads=False)
    assert report.by_pattern() == {"rotary_matrix_cast_q_k": 1}
    model = fuse_via(MatrixRotary(half_q_k=True), "dynamo")
    ran = trifuse_ops_run(lambda: model(X[0]))
    assert "trifuse::rotary_embedding" in ran and all(o.dtype == torch.float16 for o in model(X[0]))


def test_matrix_rotary_of_float64_q_keeps_its_fp32_rounding():
    """A float64 model's `.float()` rounds: the casts stay, the op rotates the fp32 copies."""
    inner = MatrixRotary().double()
    ref = copy.deepcopy(inner)
    model = fuse_via(inner, "dynamo")
    x = X[0].double()
    for out, want in zip(model(x), ref(x)):
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    report = trifuse.report(model)
    assert report.by_pattern() == {"rotary_matrix_q_k": 1}
    assert any("is not a 16-bit or fp32 tensor" in why for *_, why in report.rejected())


def test_matrix_rotary_runs_the_op_forward_and_backward():
    inner = MatrixRotary(table="learned")
    model = fuse_via(inner, "dynamo")
    x = X[0].clone().requires_grad_()
    ran = trifuse_ops_run(lambda: sum(o.sum() for o in model(x)).backward())
    assert {"trifuse::rotary_embedding", "trifuse::rotary_embedding_backward"} <= ran
    assert inner.freqs.grad is not None and inner.freqs.grad.abs().sum() > 0


def test_matrix_rotary_with_a_table_per_head_is_left_with_a_reason():
    report = check_against_unfused(lambda: MatrixRotary(apply_rope_bfl_alone, which="q", table="per_head"), X,
                                   "dynamo")
    assert report.counts() == {}
    reasons = [why for _, _, pattern, why in report.rejected() if pattern.startswith("rotary_matrix")]
    assert any("is not one row per position" in why for why in reasons), reasons


# ---------------------------------------------------------------------------------------------
# Mochi's: even and odd slices upcast apart, each half of the result cast back, a table per head
# ---------------------------------------------------------------------------------------------


def apply_rotary_emb_mochi(x, freqs_cos, freqs_sin):
    """diffusers' MochiAttnProcessor2_0 apply_rotary_emb, verbatim."""
    x_even = x[..., 0::2].float()
    x_odd = x[..., 1::2].float()

    cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
    sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)

    return torch.stack([cos, sin], dim=-1).flatten(-2)


def apply_rotary_emb_mochi_inverse(x, freqs_cos, freqs_sin):
    """The rotation the other way round (a negative control: not this op's maths)."""
    x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
    cos = (x_even * freqs_cos + x_odd * freqs_sin).to(x.dtype)
    sin = (x_odd * freqs_cos - x_even * freqs_sin).to(x.dtype)
    return torch.stack([cos, sin], dim=-1).flatten(-2)


class MochiRotary(nn.Module):
    """Mochi's attention up to the rotary: (B, S, H, D) q and k (`unflatten(2, (heads, -1))`) rotated
    by cos and sin of learned frequencies, (S, H, D/2) (`table="per_head"`, Mochi's) or (S, 1, D/2)
    (`"per_position"`); `heads_first` rotates (B, H, S, D) tensors with (H, S, D/2) tables instead."""

    def __init__(self, apply=apply_rotary_emb_mochi, table="per_head", which="q_k", heads_first=False,
                 half_q_k=False):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(HQ * D, HQ * D), nn.Linear(HQ * D, HQ * D)
        heads = HQ if table == "per_head" else 1
        self.freqs = nn.Parameter(torch.randn((heads, S, D // 2) if heads_first else (S, heads, D // 2)))
        self.apply_fn, self.which, self.heads_first, self.half_q_k = apply, which, heads_first, half_q_k

    def forward(self, x):
        q, k = self.q_proj(x).unflatten(2, (HQ, -1)), self.k_proj(x).unflatten(2, (HQ, -1))
        if self.half_q_k:
            q, k = q.half(), k.half()
        if self.heads_first:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        rope = (self.freqs.cos(), self.freqs.sin())
        q = self.apply_fn(q, *rope)
        if self.which == "q_k":
            k = self.apply_fn(k, *rope)
        return (q, k) if self.heads_first else (q.transpose(1, 2), k.transpose(1, 2))


@pytest.mark.parametrize("make, counts", [
    (MochiRotary, {"rotary_slices_cast_q_k": 1}),
    (lambda: MochiRotary(table="per_position"), {"rotary_slices_cast_q_k": 1}),
    (lambda: MochiRotary(heads_first=True), {"rotary_slices_cast_q_k": 1}),
    (lambda: MochiRotary(which="q"), {"rotary_slices_cast": 1}),
    (lambda: MochiRotary(apply_rotary_emb_mochi_inverse), {}),
], ids=["mochi", "table-per-position", "heads-first", "q-alone", "inverse-rotation-left"])
def test_mochi_rotary_fuses_and_matches(make, counts):
    """Mochi's slices, each upcast and each half cast back, become the interleaved op with the
    table as it is (one entry per pair, per head or not): outputs and every gradient, the learned
    frequencies' too, equal the unfused module's; the inverse rotation stays as written."""
    assert check_against_unfused(make, X, "dynamo").by_pattern() == counts


def test_mochi_rotary_of_fp16_q_and_k_reads_and_writes_fp16():
    report = check_against_unfused(lambda: MochiRotary(half_q_k=True), X, "dynamo", grads=False)
    assert report.by_pattern() == {"rotary_slices_cast_q_k": 1}
    inner = MochiRotary(half_q_k=True)
    model = fuse_via(inner, "dynamo")
    x = X[0].clone().requires_grad_()
    ran = trifuse_ops_run(lambda: sum(o.float().sum() for o in model(x)).backward())
    assert {"trifuse::rotary_embedding", "trifuse::rotary_embedding_backward"} <= ran
    assert all(o.dtype == torch.float16 for o in model(X[0])) and inner.freqs.grad is not None


def test_mochi_rotary_of_a_float64_model_is_left_with_a_reason():
    model = fuse_via(MochiRotary().double(), "dynamo")
    model(X[0].double())
    report = trifuse.report(model)
    assert report.counts() == {}, report.table()
    assert any("is not a 4-D 16-bit or fp32 tensor" in why for *_, why in report.rejected()), report.table()


def apply_rotary_emb_ernie_image(x_in, freqs_cis):
    """diffusers' ERNIE-Image apply_rotary_emb, verbatim: (B, S, H, D) x, a (B, S, 1, D) angle
    table whose cos and sin it takes per call, rotate_half through `chunk`."""
    rot_dim = freqs_cis.shape[-1]
    x, x_pass = x_in[..., :rot_dim], x_in[..., rot_dim:]
    cos_ = torch.cos(freqs_cis).to(x.dtype)
    sin_ = torch.sin(freqs_cis).to(x.dtype)
    # Non-interleaved rotate_half: [-x2, x1]
    x1, x2 = x.chunk(2, dim=-1)
    x_rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x * cos_ + x_rotated * sin_, x_pass), dim=-1)


class ErnieImageRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(HQ * D, HQ * D), nn.Linear(HQ * D, HQ * D)

    def forward(self, x, angles):
        q, k = self.q_proj(x).unflatten(-1, (HQ, -1)), self.k_proj(x).unflatten(-1, (HQ, -1))
        return apply_rotary_emb_ernie_image(q, angles), apply_rotary_emb_ernie_image(k, angles)


def test_ernie_image_rotary_through_chunk_fuses_and_matches():
    """Each of q and k (its cos and sin computed for it) becomes the op: the (B, S, 1, D) table on
    (B, S, H, D) tensors, the positions read as the op's heads (an elementwise map either way)."""
    angles = torch.randn(B, S, 1, D)
    assert check_against_unfused(ErnieImageRotary, (X[0], angles), "dynamo").by_pattern() == {"rotary_chunk": 2}
