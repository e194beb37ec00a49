"""Rotary position embedding, as Hugging Face's `apply_rotary_pos_emb` writes it (Llama, Mistral,
Qwen2, Gemma, OLMo, Falcon, Phi, GPT-NeoX, StableLM, ...; interleaved: Cohere, GLM, Helium),
becoming `trifuse.ops.rotary_embedding`:

    cos = cos.unsqueeze(1); sin = sin.unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    rotate_half(x) = torch.cat((-x[..., D/2:], x[..., :D/2]), dim=-1)

q and k rotated with the same cos and sin become one call (one kernel each way for both); a
tensor rotated alone becomes a call with k=None. Partial-rotary models (Phi, GPT-NeoX, StableLM)
apply the same formula to slices `q[..., :rot]` and `cat` the rest back: the formula on the
slices is what matches, the slices are read in place and the `cat` stays.

rotate_half through `chunk` (`x1, x2 = x.chunk(2, dim=-1)`: Megatron, diffusers' ERNIE-Image) is
`rotary_chunk[_q_k]`, the same op. Filters: rotate_half splits the last dim exactly in half (the same half in both slices, the cat
along the last dim); cos and sin are 4-D. That they broadcast to q and k (batch or 1, 1,
positions, head_dim), q and k share a dtype and cos and sin share one (fp32 tables beside 16-bit
q and k, as under autocast, are fine) the op checks when the replacement is tried. cos and sin
may require grad (learned tables): the op gives their gradients.

The interleaved convention (Cohere, GLM, Helium) becomes the op with `interleaved=True`:

    rotate_half(x) = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

(`x[..., ::2]` or `x[..., 0::2]` for the even features), q and k together or a tensor alone, and
on GLM's partial-rotary slices as above. Cohere's `q.float()` before it and `.to(dtype)` after it
(and ModernBERT's around the rotate-half formula) are taken in: the op reads q and k as they were
and writes their dtype, rounded once (`dtype=`); a float64 model's `.float()`, which rounds, stays. Filters: the pairing is exactly (0::2, 1::2) of
the last dim (the stack along the new last dim, the flatten of the last two); cos and sin 4-D.
GPT-J's and CodeGen's own `rotate_every_two` (`x[:, :, :, ::2]` on (B, S, H, D) tensors, their
(B, S, D/2) tables repeated per pair for each use) becomes the op on the same tensors transposed
to (B, H, S, D) (views), q and k in one call. Not matched: swapped or sign-flipped pairs.

DeepSeek-V2/V3's `apply_rotary_pos_emb_interleave` (also GLM-4-MoE-Lite, Mistral Large 4,
LongCat-Flash and the others transformers builds on it) rotates the interleaved pairs and writes
the results as halves, with tables of one entry per pair (`cos[..., :D/2]`):

    x1, x2 = x[..., 0::2], x[..., 1::2]
    x_embed = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

which becomes the op with `interleaved=True, halves_out=True`, q and k in one call or a tensor
alone. Filters: the pairs are exactly (0::2, 1::2) of the last dim, the cat along the last dim;
cos and sin 4-D (their width, D / 2 or D, the op checks).

Meta's Llama reference, torchtitan, Llama 4 and DeepSeek-V2 rotate the interleaved pairs as
complex numbers, with a complex table (`torch.polar`) of one entry per pair:

    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    x_out = torch.view_as_real(x_ * freqs_cis).flatten(3)

which becomes the op with `interleaved=True` and the table's real and imaginary parts as cos
and sin (views; the op copies the two small tables to unit stride), q and k in one call when
they are multiplied by one table (the same node, or the same slice of one written twice, as
Llama 4 does) or a tensor alone. Both layouts: (B, H, S, D) with a (B or 1, 1, S, D/2) table
(DeepSeek-V2) and (B, S, H, D) with (B or 1, S, 1, D/2) (Llama 4, torchtitan), the latter through
transposed views as for GPT-J below. torchtune and gpt-fast write the same product in real
arithmetic, with a (.., S, .., D/2, 2) cache of (cos, sin) pairs:

    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    torch.stack([xs[..., 0] * cache[..., 0] - xs[..., 1] * cache[..., 1],
                 xs[..., 1] * cache[..., 0] + xs[..., 0] * cache[..., 1]], -1).flatten(3)

which becomes the same op with `cache[..., 0]` and `cache[..., 1]` as cos and sin. The
`.float()` before and the `.type_as(x)` after stay as written, as for Cohere. Filters: the reshape splits only the last dim into pairs, the flatten
merges exactly the pair dims back, the table is complex, 4-D, D/2 wide and broadcasts over the
heads.

diffusers' `apply_rotary_emb(x, (cos, sin), use_real=True)` (Flux, Chroma, HunyuanVideo,
CogView4, Cosmos) splits x with `reshape(...).unbind(...)` into pairs or halves, rotates them with
`stack` or `cat`, and computes `(x.float() * cos + x_rotated.float() * sin).to(x.dtype)` with D-wide
tables: the op with `interleaved` as the split says and `dtype=x.dtype`, q and k in one call when
both are rotated by views of one table (`rotary_unbind_*`, below). A float64 model's `.float()`
rounds: left as written. Allegro's rotate-half with each product's operand cast the same way,
`(x.float() * cos + rotate_half(x).float() * sin).to(x.dtype)`, is `rotary_cast_each`.

BFL's Flux reference and diffusers' HiDream multiply each pair by a 2x2 matrix from a (.., D/2, 2, 2)
table (`freqs_cis[..., 0] * x_[..., 0] + freqs_cis[..., 1] * x_[..., 1]`): `rotary_matrix*`, the
interleaved op with D-wide tables that carry any 2x2 matrix (below, before PATTERNS). Mochi's
even and odd slices, each upcast and each half of the result cast back (a table per head and
position, D/2 wide): `rotary_slices_cast*`, the interleaved op with its table as it is.
"""
import operator

import torch

from ._base import Match, Pattern, example_value, known_equal, ops

# The two bounds of rotate_half's slices are separate parameters: an fx capture computes
# `x.shape[-1] // 2` once per slice (two graph nodes of one value); the filter checks each.


def rotary_q_k(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_start, q_end, k_start,
               k_end, dim):
    """Hugging Face's apply_rotary_pos_emb after its unsqueeze."""
    q_embed = q * cos + torch.cat((-q[..., q_start:], q[..., :q_end]), dim=dim) * sin
    k_embed = k * cos + torch.cat((-k[..., k_start:], k[..., :k_end]), dim=dim) * sin
    return q_embed, k_embed


def _seq_heads_as_op_layout(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """(seq, heads, head_dim) q and k and their (seq, 1, head_dim) tables as the op's (1, heads, seq,
    head_dim) and (1, 1, seq, head_dim): views, no copy (the op reads any strides)."""
    return [None if t is None else t.unsqueeze(0).transpose(1, 2) for t in tensors]


def _seq_heads_from_op_layout(y: torch.Tensor) -> torch.Tensor:
    # the op writes a transposed input's layout: (1, heads, seq, D) views of (seq, heads, D) storage
    return y.squeeze(0).transpose(0, 1).contiguous()


def _rotate_half_op(q, k, cos, sin, dtype=None, seq_heads=False):
    """The op on 4-D (batch, heads, seq, head_dim) q and k, or (`seq_heads`) on the 3-D (seq, heads,
    head_dim) ones of Qwen-VL's vision towers (the patches of every image in one sequence, no batch)."""
    if not seq_heads:
        return ops.rotary_embedding(q, k, cos, sin, dtype=dtype)
    out = ops.rotary_embedding(*_seq_heads_as_op_layout(q, k, cos, sin), dtype=dtype)
    return _seq_heads_from_op_layout(out[0]), None if k is None else _seq_heads_from_op_layout(out[1])


def rotary_q_k_fused(q, k, cos, sin, q_start=None, q_end=None, k_start=None, k_end=None, dim=None,
                     seq_heads=False):
    out = _rotate_half_op(q, k, cos, sin, seq_heads=seq_heads)
    return out[0], out[1]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_start, x_end, dim):
    """One tensor rotated alone."""
    return x * cos + torch.cat((-x[..., x_start:], x[..., :x_end]), dim=dim) * sin


def rotary_fused(x, cos, sin, x_start=None, x_end=None, dim=None, seq_heads=False):
    return _rotate_half_op(x, None, cos, sin, seq_heads=seq_heads)[0]


def _rotate_half_by_chunk(x, dim, cat_dim):
    halves = x.chunk(2, dim=dim)
    return torch.cat((-halves[1], halves[0]), dim=cat_dim)


def rotary_chunk_q_k(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_dim, k_dim, q_cat,
                     k_cat):
    """rotate_half as `x1, x2 = x.chunk(2, dim=-1); cat((-x2, x1), dim=-1)` (diffusers' ERNIE-Image,
    Megatron's `_rotate_half`), on q and on k."""
    return (q * cos + _rotate_half_by_chunk(q, q_dim, q_cat) * sin,
            k * cos + _rotate_half_by_chunk(k, k_dim, k_cat) * sin)


def rotary_chunk_q_k_fused(q, k, cos, sin, q_dim=None, k_dim=None, q_cat=None, k_cat=None, seq_heads=False):
    out = _rotate_half_op(q, k, cos, sin, seq_heads=seq_heads)
    return out[0], out[1]


def rotary_chunk(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_dim, x_cat):
    return x * cos + _rotate_half_by_chunk(x, x_dim, x_cat) * sin


def rotary_chunk_fused(x, cos, sin, x_dim=None, x_cat=None, seq_heads=False):
    return _rotate_half_op(x, None, cos, sin, seq_heads=seq_heads)[0]


def _chunks_last_dim_in_half(names: tuple[str, ...]):
    """Each tensor chunked in two along its last dim (halves: the chunk of an odd width is not) and
    the halves concatenated back along it."""

    def check(m: Match) -> str | None:
        for name in names:
            x = m.value(name)
            if not isinstance(x, torch.Tensor):
                return f"no shape for {name}"
            for what in ("dim", "cat"):
                dim = m.value(f"{name}_{what}")
                if not isinstance(dim, int) or isinstance(dim, bool) or dim not in (-1, x.dim() - 1):
                    verb = "chunks" if what == "dim" else "concatenates"
                    return f"rotate_half {verb} {name} along dim {dim!r}, not the last"
            if x.shape[-1] % 2:
                return f"rotate_half chunks {name}'s odd last dim ({x.shape[-1]}) in two unequal parts"
        return None

    check.__name__ = "chunks_last_dim_in_half"
    return check


def rotary_cast_q_k(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_start, q_end, k_start,
                    k_end, dim, q_up, k_up, q_back, k_back):
    """ModernBERT's: q and k upcast (the cast it writes twice is one after normalize.py), rotated,
    cast back."""
    q_embed, k_embed = rotary_q_k(q.to(q_up), k.to(k_up), cos, sin, q_start, q_end, k_start, k_end, dim)
    return q_embed.to(q_back), k_embed.to(k_back)


def rotary_cast_q_k_fused(q, k, cos, sin, q_start=None, q_end=None, k_start=None, k_end=None, dim=None, q_up=None,
                          k_up=None, q_back=None, k_back=None, dtype=None, seq_heads=False):
    out = _rotate_half_op(q, k, cos, sin, dtype=dtype, seq_heads=seq_heads)
    return out[0], out[1]


_FP32_OR_NARROWER = (torch.float16, torch.bfloat16, torch.float32)


def rotary_cast_each(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_start, x_end, dim, x_back):
    """A tensor rotated with each product's operand upcast, then cast back (diffusers' Allegro:
    `(x.float() * cos + rotate_half(x).float() * sin).to(x.dtype)`)."""
    rotated = torch.cat((-x[..., x_start:], x[..., :x_end]), dim=dim)
    return (x.to(torch.float32) * cos + rotated.to(torch.float32) * sin).to(x_back)


def rotary_cast_each_fused(x, cos, sin, x_start=None, x_end=None, dim=None, x_back=None, seq_heads=False):
    return _rotate_half_op(x, None, cos, sin, dtype=x_back, seq_heads=seq_heads)[0]


def _cast_back_to_its_dtype(names: tuple[str, ...]):
    """Each tensor 16-bit or fp32 (a float64 model's `.float()` rounds), rotated in fp32 and cast
    back to its own dtype."""

    def check(m: Match) -> str | None:
        for name in names:
            x, back = m.value(name), m[f"{name}_back"]
            if not isinstance(x, torch.Tensor) or x.dtype not in _FP32_OR_NARROWER:
                return f"{name} is not a 16-bit or fp32 tensor"
            if back is not x.dtype:
                return f"{name} ({x.dtype}) is rotated in fp32 and cast to {back!r}, not back to its dtype"
        return None

    check.__name__ = "cast_back_to_its_dtype"
    return check


def _rotates_half_of_last_dim(names: tuple[str, ...]):
    def check(m: Match) -> str | None:
        dim = m.value("dim")
        if not isinstance(dim, int) or isinstance(dim, bool):
            return f"rotate_half's cat dim {dim!r} is not a known int"
        for name in names:
            x = m.value(name)
            if not isinstance(x, torch.Tensor):
                return f"no shape for {name}"
            if dim not in (-1, x.dim() - 1):
                return f"rotate_half concatenates {name} along dim {dim}, not the last"
            # fx captures compute the bounds from the shape (`x.shape[-1] // 2`): their values.
            for bound in (m.value(f"{name}_start"), m.value(f"{name}_end")):
                if not isinstance(bound, int) or isinstance(bound, bool):
                    return f"rotate_half's split {bound!r} of {name} is not a known int"
                if 2 * bound != x.shape[-1]:
                    return f"rotate_half splits {name}'s last dim ({x.shape[-1]}) at {bound}, not in half"
        return None

    check.__name__ = "rotates_half_of_last_dim"
    return check


# The interleaved rotate_half: the even features' slice start is a parameter (transformers
# writes `x[..., ::2]` in Cohere, `x[..., 0::2]` in GLM and Helium), the filter checks it.


def rotary_interleaved_q_k(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_start, k_start,
                           dim, flat):
    """Cohere's, GLM's and Helium's apply_rotary_pos_emb after its unsqueeze."""
    q_embed = q * cos + torch.stack((-q[..., 1::2], q[..., q_start::2]), dim=dim).flatten(flat) * sin
    k_embed = k * cos + torch.stack((-k[..., 1::2], k[..., k_start::2]), dim=dim).flatten(flat) * sin
    return q_embed, k_embed


def rotary_interleaved_q_k_fused(q, k, cos, sin, q_start=None, k_start=None, dim=None, flat=None):
    out = ops.rotary_embedding(q, k, cos, sin, interleaved=True)
    return out[0], out[1]


def rotary_interleaved_cast_q_k(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_start,
                                k_start, dim, flat, q_up, k_up, q_back, k_back):
    """Cohere's: q and k upcast, rotated, cast back."""
    q_embed, k_embed = rotary_interleaved_q_k(q.to(q_up), k.to(k_up), cos, sin, q_start, k_start, dim, flat)
    return q_embed.to(q_back), k_embed.to(k_back)


def rotary_interleaved_cast_q_k_fused(q, k, cos, sin, q_start=None, k_start=None, dim=None, flat=None, q_up=None,
                                      k_up=None, q_back=None, k_back=None, dtype=None):
    out = ops.rotary_embedding(q, k, cos, sin, interleaved=True, dtype=dtype)
    return out[0], out[1]


def rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_start, dim, flat):
    """One tensor rotated alone, interleaved."""
    return x * cos + torch.stack((-x[..., 1::2], x[..., x_start::2]), dim=dim).flatten(flat) * sin


def rotary_interleaved_fused(x, cos, sin, x_start=None, dim=None, flat=None):
    return ops.rotary_embedding(x, None, cos, sin, interleaved=True)[0]


# GPT-J's and CodeGen's rotate_every_two on (B, S, H, D) tensors (the first rotary_dim of each
# head), before the heads move to dim 1, with (B, S, D/2) tables each repeated per pair and per use
# (`repeat_interleave(t[:, :, None, :], 2, 3)`, once for q and once for k). The op takes (B, H, S, D)
# in any strides: the replacement hands it the same tensors transposed (views; the maths is
# elementwise, so relabelling two dims changes nothing) and transposes its result back.


def _every_two(x):
    return torch.stack((-x[:, :, :, 1::2], x[:, :, :, ::2]), dim=-1).flatten(-2)


def _per_pair(t):
    return torch.repeat_interleave(t[:, :, None, :], 2, 3)


def rotary_every_two_q_k(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """GPT-J's apply_rotary_pos_emb on k, then on q, with the (B, S, D/2) tables."""
    k_embed = k * _per_pair(cos) + _every_two(k) * _per_pair(sin)
    q_embed = q * _per_pair(cos) + _every_two(q) * _per_pair(sin)
    return q_embed, k_embed


def rotary_every_two_q_k_fused(q, k, cos, sin):
    cos, sin = _per_pair(cos).transpose(1, 2), _per_pair(sin).transpose(1, 2)
    out = ops.rotary_embedding(q.transpose(1, 2), k.transpose(1, 2), cos, sin, interleaved=True)
    return out[0].transpose(1, 2), out[1].transpose(1, 2)


def rotary_every_two(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """One (B, S, H, D) tensor rotated alone, with (B, S, 1, D) tables."""
    return x * cos + _every_two(x) * sin


def rotary_every_two_fused(x, cos, sin):
    return ops.rotary_embedding(x.transpose(1, 2), None, cos.transpose(1, 2), sin.transpose(1, 2),
                                interleaved=True)[0].transpose(1, 2)


def _positions_on_dim_1(names: tuple[str, ...], unsqueezed: bool):
    """x (B, S, H, D) with tables of its positions: (B or 1, S, D/2) before the per-pair repeat,
    (B or 1, S, 1, D) after it."""

    def check(m: Match) -> str | None:
        for name in names:
            x = m.value(name)
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                return f"{name} is not 4-D (batch, seq, heads, head_dim)"
            for table in ("cos", "sin"):
                t = m.value(table)
                if not isinstance(t, torch.Tensor) or t.dim() != (4 if unsqueezed else 3):
                    return f"{table} is not {'(batch, seq, 1, D)' if unsqueezed else '(batch, seq, D/2)'}"
                if t.shape[1] != x.shape[1] or (unsqueezed and t.shape[2] != 1):
                    return f"{table} {tuple(t.shape)} does not give {name} {tuple(x.shape)} one row per position"
        return None

    check.__name__ = "positions_on_dim_1"
    return check


def _pairs_last_dim(names: tuple[str, ...]):
    def check(m: Match) -> str | None:
        dim, flat = m.value("dim"), m.value("flat")
        for name in names:
            x = m.value(name)
            if not isinstance(x, torch.Tensor):
                return f"no shape for {name}"
            start = m.value(f"{name}_start")
            if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start != 0):
                return f"the interleaved rotate_half pairs {name}[..., {start!r}::2] with {name}[..., 1::2], not 0::2"
            # stack adds a last dim (index x.dim()), flatten merges it with the one before.
            if not isinstance(dim, int) or isinstance(dim, bool) or dim not in (-1, x.dim()):
                return f"the interleaved rotate_half stacks {name} along dim {dim!r}, not a new last dim"
            if not isinstance(flat, int) or isinstance(flat, bool) or flat not in (-2, x.dim() - 1):
                return f"the interleaved rotate_half flattens {name} from dim {flat!r}, not the last two dims"
        return None

    check.__name__ = "pairs_last_dim"
    return check


def _rotated(m: Match) -> list[torch.Tensor | None]:
    """The example values of what a match rotates: q and k, or x alone."""
    values = []
    for name in ("q", "k", "x"):
        try:
            values.append(m.value(name))
        except KeyError:
            pass
    return values


def _cos_sin_are_4d(m: Match) -> str | None:
    """The op takes cos and sin after Hugging Face's unsqueeze; a 2-D (S, D) table broadcast by
    PyTorch is left as written (the op would need a view of it)."""
    for name in ("cos", "sin"):
        v = m.value(name)
        if not isinstance(v, torch.Tensor):
            return f"no shape for {name}"
        if v.dim() != 4:
            return f"{name} is {v.dim()}-D, not (batch or 1, 1, seq, head_dim)"
    return None


def _cos_sin_layout(m: Match) -> str | None:
    """As _cos_sin_are_4d, or, beside 3-D (seq, heads, head_dim) q and k (Qwen-VL's vision towers,
    which rotate the patches of all images as one sequence), tables unsqueezed to (seq or 1, 1,
    head_dim), which the rotate-half replacements view as the op's layout."""
    rotated = _rotated(m)
    if not all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in rotated):
        return _cos_sin_are_4d(m)
    for name in ("cos", "sin"):
        v = m.value(name)
        if not isinstance(v, torch.Tensor):
            return f"no shape for {name}"
        if v.dim() != 3 or v.shape[1] != 1 or v.shape[0] not in (1, rotated[0].shape[0]):
            return f"{name} {tuple(v.shape)} beside (seq, heads, head_dim) q: not (seq or 1, 1, head_dim)"
    return None


# DeepSeek's: interleaved pairs in, rotate-half halves out. The even slice's start is a parameter
# (`0::2` or `::2`), as for the interleaved rotate_half above.


def rotary_pairs_to_halves_q_k(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_start,
                               k_start, q_dim, k_dim):
    """DeepSeek-V3's apply_rotary_pos_emb_interleave after its slice and unsqueeze of the tables."""
    q1, q2 = q[..., q_start::2], q[..., 1::2]
    k1, k2 = k[..., k_start::2], k[..., 1::2]
    q_embed = torch.cat((q1 * cos - q2 * sin, q2 * cos + q1 * sin), dim=q_dim)
    k_embed = torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin), dim=k_dim)
    return q_embed, k_embed


def rotary_pairs_to_halves_q_k_fused(q, k, cos, sin, q_start=None, k_start=None, q_dim=None, k_dim=None):
    out = ops.rotary_embedding(q, k, cos, sin, interleaved=True, halves_out=True)
    return out[0], out[1]


def rotary_pairs_to_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_start, x_dim):
    """One tensor rotated alone, DeepSeek's way."""
    x1, x2 = x[..., x_start::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=x_dim)


def rotary_pairs_to_halves_fused(x, cos, sin, x_start=None, x_dim=None):
    return ops.rotary_embedding(x, None, cos, sin, interleaved=True, halves_out=True)[0]


def _pairs_to_halves_last_dim(names: tuple[str, ...]):
    def check(m: Match) -> str | None:
        for name in names:
            x, start, dim = m.value(name), m.value(f"{name}_start"), m.value(f"{name}_dim")
            if not isinstance(x, torch.Tensor):
                return f"no shape for {name}"
            if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start != 0):
                return f"the pairs are {name}[..., {start!r}::2] with {name}[..., 1::2], not 0::2"
            if not isinstance(dim, int) or isinstance(dim, bool) or dim not in (-1, x.dim() - 1):
                return f"the halves of {name} are concatenated along dim {dim!r}, not the last"
        return None

    check.__name__ = "pairs_to_halves_last_dim"
    return check


# The complex product: the reshape's target and the flatten's start are parameters (an fx capture
# computes the shape from x's, Dynamo writes it out); the filter checks them. The `_cast`
# spellings take the upcast before (`x.float()`) and the cast back after (`.type_as(x)`) too: the
# op then reads x as it was and writes its dtype, one pass over q and k instead of three.


def _complex_product(x, freqs, shape, flat):
    return torch.view_as_real(torch.view_as_complex(x.reshape(shape)) * freqs).flatten(flat)


def _pairs_times_cache(x, cache, shape, flat):
    xs = x.reshape(shape)
    return torch.stack([xs[..., 0] * cache[..., 0] - xs[..., 1] * cache[..., 1],
                        xs[..., 1] * cache[..., 0] + xs[..., 0] * cache[..., 1]], -1).flatten(flat)


def rotary_complex_q_k(q: torch.Tensor, k: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, q_shape,
                       k_shape, q_flat, k_flat):
    """Llama 4's, torchtitan's and DeepSeek-V2's apply_rotary_emb after the upcast of q and k."""
    return _complex_product(q, q_freqs, q_shape, q_flat), _complex_product(k, k_freqs, k_shape, k_flat)


def rotary_complex_cast_q_k(q: torch.Tensor, k: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, q_shape,
                            k_shape, q_flat, k_flat, q_up, k_up, q_back, k_back):
    """The same with the upcast of q and k and the cast back."""
    return (_complex_product(q.to(q_up), q_freqs, q_shape, q_flat).to(q_back),
            _complex_product(k.to(k_up), k_freqs, k_shape, k_flat).to(k_back))


def rotary_complex(x: torch.Tensor, freqs: torch.Tensor, x_shape, x_flat):
    """One tensor rotated alone as a complex product."""
    return _complex_product(x, freqs, x_shape, x_flat)


def rotary_complex_cast(x: torch.Tensor, freqs: torch.Tensor, x_shape, x_flat, x_up, x_back):
    return _complex_product(x.to(x_up), freqs, x_shape, x_flat).to(x_back)


def rotary_real_pairs_q_k(q: torch.Tensor, k: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, q_shape,
                          k_shape, q_flat, k_flat):
    """torchtune's and gpt-fast's: the product in real arithmetic with a cache of (cos, sin) pairs,
    q and k rotated with one cache (gpt-fast's apply_rotary_emb on each)."""
    return _pairs_times_cache(q, q_freqs, q_shape, q_flat), _pairs_times_cache(k, k_freqs, k_shape, k_flat)


def rotary_real_pairs_cast_q_k(q: torch.Tensor, k: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                               q_shape, k_shape, q_flat, k_flat, q_up, k_up, q_back, k_back):
    return (_pairs_times_cache(q.to(q_up), q_freqs, q_shape, q_flat).to(q_back),
            _pairs_times_cache(k.to(k_up), k_freqs, k_shape, k_flat).to(k_back))


def rotary_real_pairs(x: torch.Tensor, freqs: torch.Tensor, x_shape, x_flat):
    """One tensor rotated alone (torchtune's RotaryPositionalEmbeddings)."""
    return _pairs_times_cache(x, freqs, x_shape, x_flat)


def rotary_real_pairs_cast(x: torch.Tensor, freqs: torch.Tensor, x_shape, x_flat, x_up, x_back):
    return _pairs_times_cache(x.to(x_up), freqs, x_shape, x_flat).to(x_back)


def _rotate_pairs(q, k, cos, sin, positions_dim, dtype=None, interleaved=True):
    # (B, S, H, D) tensors go to the op as (B, H, S, D) views and come back the same way.
    if positions_dim == 1:
        q, cos, sin = q.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2)
        k = None if k is None else k.transpose(1, 2)
    q_out, k_out = ops.rotary_embedding(q, k, cos, sin, interleaved=interleaved, dtype=dtype)
    if positions_dim == 1:
        q_out = q_out.transpose(1, 2)
        k_out = None if k is None else k_out.transpose(1, 2)
    return q_out, k_out


def _cos_sin_of(table, complex_table, pad=0):
    if complex_table:  # the real and imaginary parts; a conjugate table (the inverse rotation) as its values
        table = torch.view_as_real(table.resolve_conj())
    for _ in range(pad):  # a 3-D table (Qwen-Image's (S, 1, D/2)) as the 4-D one it broadcasts as
        table = table.unsqueeze(0)
    return table[..., 0], table[..., 1]


def _pairs_fused(complex_table: bool, with_k: bool):
    """The replacement of the complex or real-pairs spellings, q and k or a tensor alone, with or
    without the casts (`dtype`: derived, the cast back's)."""

    def fused_q_k(q, k, q_freqs, k_freqs=None, q_shape=None, k_shape=None, q_flat=None, k_flat=None, q_up=None,
                  k_up=None, q_back=None, k_back=None, positions_dim=2, dtype=None, pad=0):
        return _rotate_pairs(q, k, *_cos_sin_of(q_freqs, complex_table, pad), positions_dim, dtype)

    def fused(x, freqs, x_shape=None, x_flat=None, x_up=None, x_back=None, positions_dim=2, dtype=None,
              pad=0):
        return _rotate_pairs(x, None, *_cos_sin_of(freqs, complex_table, pad), positions_dim, dtype)[0]

    return fused_q_k if with_k else fused


def _positions_dim(m: Match, name: str) -> int | None:
    """Where the positions of `name` are: dim 2 (B, H, S, D), the table (B or 1, 1, S, D/2[, 2]);
    dim 1 (B, S, H, D), the table (B or 1, S, 1, D/2[, 2]); None when the table is neither."""
    shape = _as_4d(m.value(f"{name}_freqs" if name in ("q", "k") else "freqs").shape)
    if known_equal(shape[1], 1):
        return 2
    if known_equal(shape[2], 1):
        return 1
    return None


def _as_4d(shape) -> tuple:
    """A complex table's shape padded on the left to 4 dims, as it broadcasts against (B, ., ., D/2)
    pairs (a 5-D cache of real pairs as it is)."""
    return (1,) * max(0, 4 - len(shape)) + tuple(shape)


def _five_sizes(shape, n: int = 5) -> list | str:
    """A reshape's target as n sizes (a capture with symbolic sizes writes them as graph nodes:
    their values, SymInts), or its repr when it is not n known sizes."""
    sizes = [example_value(v) for v in shape] if isinstance(shape, (tuple, list)) else shape
    if not isinstance(sizes, list) or len(sizes) != n or any(
            not isinstance(v, (int, torch.SymInt)) or isinstance(v, bool) for v in sizes):
        return repr(sizes)
    return sizes


def _complex_pairs(names: tuple[str, ...], real_cache: bool = False):
    """The pairs of each tensor times a table of one entry per pair: complex and 4-D (or 3-D, as it
    broadcasts: Qwen-Image's (S, 1, D/2)), or with `real_cache` a float (.., D/2, 2) cache of (cos,
    sin) pairs."""

    def check(m: Match) -> str | None:
        for name in names:
            x = m.value(name)
            freqs = m.value(f"{name}_freqs" if len(names) > 1 else "freqs")
            shape, flat = m.value(f"{name}_shape"), m.value(f"{name}_flat")
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
                return f"{name} is not a 4-D float tensor"
            d = x.shape[-1]
            shape = _five_sizes(shape)
            if isinstance(shape, str):
                return f"{name} is reshaped to {shape}, not a known 5-D shape"
            if not (all(known_equal(a, b) for a, b in zip(shape[:3], x.shape[:3]))
                    and (known_equal(shape[3], -1) or known_equal(shape[3], d // 2)) and known_equal(shape[4], 2)
                    and known_equal(d % 2, 0)):
                return f"{name} {tuple(x.shape)} is reshaped to {tuple(shape)}: not its last dim split into pairs"
            if not isinstance(flat, int) or isinstance(flat, bool) or flat not in (3, -2):
                return f"the rotated pairs of {name} are flattened from dim {flat!r}, not the pair dims (3)"
            if real_cache:
                if not isinstance(freqs, torch.Tensor) or not freqs.is_floating_point() or freqs.dim() != 5 \
                        or not known_equal(freqs.shape[4], 2):
                    return f"the cache is not a 5-D float tensor of (cos, sin) pairs (got " \
                           f"{getattr(freqs, 'shape', freqs)!r})"
            elif not isinstance(freqs, torch.Tensor) or not freqs.is_complex() or freqs.dim() not in (3, 4):
                got = getattr(freqs, "shape", freqs)
                return f"the table is not a 3-D or 4-D complex tensor (got {got!r})"
            table = _as_4d(freqs.shape)
            if not known_equal(table[3], d // 2) or not (known_equal(table[0], 1)
                                                         or known_equal(table[0], x.shape[0])):
                return f"the table {tuple(freqs.shape)} does not broadcast to {name}'s pairs {tuple(shape)}"
            positions = _positions_dim(m, name)
            if positions is None or not (known_equal(table[positions], 1)
                                         or known_equal(table[positions], x.shape[positions])):
                return f"the table {tuple(freqs.shape)} is not one row per position of {name} {tuple(x.shape)}"
        return None

    check.__name__ = "real_pairs" if real_cache else "complex_pairs"
    return check


# Views and slices a table goes through on its way to the product (pure: the same op on the same
# input gives the same table).
_TABLE_VIEWS = {operator.getitem, torch.unsqueeze, torch.view_as_real, torch.view_as_complex, "view", "reshape",
                "expand", "to", "contiguous", "transpose", "unsqueeze"}


def _same_table(a, b, depth: int = 6) -> bool:
    """a and b compute one value: the same node, or the same view or slice of the same table."""
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_table(x, y, depth) for x, y in zip(a, b))
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return not isinstance(a, torch.fx.Node) and not isinstance(b, torch.fx.Node) and a == b
    if depth == 0 or a.op != b.op or a.target != b.target or a.kwargs != b.kwargs:
        return False
    if a.op == "get_attr":  # fx folds a slice of a buffer into a constant per use
        return True
    return a.op in ("call_function", "call_method") and a.target in _TABLE_VIEWS \
        and _same_table(a.args, b.args, depth - 1)


def _one_table(m: Match) -> str | None:
    """q and k multiplied by one table: the same node, or the same slice or view of it written
    twice (Llama 4 slices it for each; gpt-fast and torchtune view it inside the function they
    call on q and on k)."""
    if not _same_table(m["q_freqs"], m["k_freqs"]) or _positions_dim(m, "q") != _positions_dim(m, "k"):
        return "q and k are multiplied by different tables"
    return None


def _complex_layout(name: str, cast: bool = False):
    def derive(m: Match) -> dict:
        freqs = m.value(f"{name}_freqs" if name in ("q", "k") else "freqs")
        out = {"positions_dim": _positions_dim(m, name), "pad": len(_as_4d(freqs.shape)) - freqs.dim()}
        if cast:
            out["dtype"] = m.value(name).dtype
        return out

    return derive


def _upcast_and_back(names: tuple[str, ...]):
    """Each tensor cast to fp32 before and back to its own dtype after: 16-bit or fp32 ones (the
    upcast exact; a float64 model's `.float()` rounds, which the spelling without casts keeps)."""

    def check(m: Match) -> str | None:
        for name in names:
            x, up, back = m.value(name), m.value(f"{name}_up"), m.value(f"{name}_back")
            if not isinstance(x, torch.Tensor) or x.dtype not in _FP32_OR_NARROWER:
                return f"{name} is not a 16-bit or fp32 tensor"
            if up is not torch.float32 or back is not x.dtype:
                return f"{name} ({x.dtype}) is cast to {up!r} and back to {back!r}, not to fp32 and back"
        return None

    check.__name__ = "upcast_and_back"
    return check


# diffusers' `apply_rotary_emb(x, (cos, sin), use_real=True)` (Flux, Chroma, HunyuanVideo, CogVideoX,
# HunyuanDiT: `use_real_unbind_dim=-1`, the interleaved pairs; CogView4, Cosmos, Stable Audio,
# OmniGen: -2, the halves), cos and sin D wide and unsqueezed to (1, S, 1, D) or (1, 1, S, D):
#
#     x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
#     x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
#     (or x.reshape(*x.shape[:-1], 2, -1).unbind(-2) and torch.cat([-x_imag, x_real], dim=-1))
#     out = (x.float() * cos + x_rotated.float() * sin).to(x.dtype)
#
# the op with `interleaved` as the pairs say and `dtype=x.dtype`: the rotation in fp32, rounded
# once, as the model's. Called once for q and once for k, each with its own unsqueezed view of one
# table: one call of the op when those are the same view of the same table (`_one_table`'s test).


def _unbind_pairs_rotated(x, shape, flat):
    pairs = x.reshape(shape).unbind(-1)
    return torch.stack([-pairs[1], pairs[0]], dim=-1).flatten(flat)


def _unbind_halves_rotated(x, shape):
    halves = x.reshape(shape).unbind(-2)
    return torch.cat([-halves[1], halves[0]], dim=-1)


def _diffusers_formula(x, rotated, cos, sin, back):
    return (x.to(torch.float32) * cos + rotated.to(torch.float32) * sin).to(back)


def rotary_unbind_pairs_q_k(q: torch.Tensor, k: torch.Tensor, q_cos: torch.Tensor, q_sin: torch.Tensor,
                            k_cos: torch.Tensor, k_sin: torch.Tensor, q_shape, k_shape, q_flat, k_flat,
                            q_back, k_back):
    """diffusers' apply_rotary_emb with `use_real_unbind_dim=-1` on q and on k (Flux's)."""
    return (_diffusers_formula(q, _unbind_pairs_rotated(q, q_shape, q_flat), q_cos, q_sin, q_back),
            _diffusers_formula(k, _unbind_pairs_rotated(k, k_shape, k_flat), k_cos, k_sin, k_back))


def rotary_unbind_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_shape, x_flat, x_back):
    return _diffusers_formula(x, _unbind_pairs_rotated(x, x_shape, x_flat), cos, sin, x_back)


def rotary_unbind_halves_q_k(q: torch.Tensor, k: torch.Tensor, q_cos: torch.Tensor, q_sin: torch.Tensor,
                             k_cos: torch.Tensor, k_sin: torch.Tensor, q_shape, k_shape, q_back, k_back):
    """diffusers' apply_rotary_emb with `use_real_unbind_dim=-2` on q and on k (CogView4's, Cosmos')."""
    return (_diffusers_formula(q, _unbind_halves_rotated(q, q_shape), q_cos, q_sin, q_back),
            _diffusers_formula(k, _unbind_halves_rotated(k, k_shape), k_cos, k_sin, k_back))


def rotary_unbind_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_shape, x_back):
    return _diffusers_formula(x, _unbind_halves_rotated(x, x_shape), cos, sin, x_back)


def _unbind_fused(interleaved: bool, with_k: bool):
    def fused_q_k(q, k, q_cos, q_sin, k_cos, k_sin, q_shape=None, k_shape=None, q_flat=None, k_flat=None,
                  q_back=None, k_back=None, positions_dim=2):
        return _rotate_pairs(q, k, q_cos, q_sin, positions_dim, q_back, interleaved)

    def fused(x, cos, sin, x_shape=None, x_flat=None, x_back=None, positions_dim=2):
        return _rotate_pairs(x, None, cos, sin, positions_dim, x_back, interleaved)[0]

    return fused_q_k if with_k else fused


def _unbind_split(names: tuple[str, ...], interleaved: bool):
    """Each tensor 4-D and float (16-bit or fp32: a float64 model's `.float()` rounds), its last
    dim split in two (into pairs, or into halves), the pairs flattened back from dim 3, cast back
    to its own dtype; its tables 4-D, D wide, in one float dtype, one row per position on dim 1
    or 2 and 1 on the other (the heads); with q and k, the same table for both."""

    def check(m: Match) -> str | None:
        one = len(names) == 1
        for name in names:
            x, back = m.value(name), m[f"{name}_back"]
            shape = m.value(f"{name}_shape")
            if not isinstance(x, torch.Tensor) or x.dim() != 4 \
                    or x.dtype not in _FP32_OR_NARROWER:
                return f"{name} is not a 4-D 16-bit or fp32 tensor"
            if back is not x.dtype:
                return f"{name} ({x.dtype}) is rotated in fp32 and cast to {back!r}, not back to its dtype"
            d = x.shape[-1]
            shape = _five_sizes(shape)
            if isinstance(shape, str):
                return f"{name} is reshaped to {shape}, not a known 5-D shape"
            width, two = (shape[3], shape[4]) if interleaved else (shape[4], shape[3])
            if not (all(known_equal(a, b) for a, b in zip(shape[:3], x.shape[:3]))
                    and (known_equal(width, -1) or known_equal(width, d // 2)) and known_equal(two, 2)
                    and known_equal(d % 2, 0)):
                what = "pairs" if interleaved else "halves"
                return f"{name} {tuple(x.shape)} is reshaped to {tuple(shape)}: not its last dim in {what}"
            if interleaved:
                flat = m[f"{name}_flat"]
                if not isinstance(flat, int) or isinstance(flat, bool) or flat not in (3, -2):
                    return f"the rotated pairs of {name} are flattened from dim {flat!r}, not from 3"
            reason = _d_wide_tables(m, name, one)
            if reason is not None:
                return reason
        return None if one else _q_k_one_table(m)

    check.__name__ = "unbind_pairs" if interleaved else "unbind_halves"
    return check


def _tables_differ(cos: torch.Tensor, sin: torch.Tensor, name: str) -> str | None:
    """Why cos and sin are not one table's two halves (another shape or dtype), or None."""
    if cos.dtype == sin.dtype and tuple(cos.shape) == tuple(sin.shape):
        return None
    return f"{name}'s cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} {sin.dtype} differ"


def _d_wide_tables(m: Match, name: str, one: bool) -> str | None:
    """x's cos and sin: 4-D float tables of one dtype and shape, D wide, one row per sample (or
    one for all) and per position on dim 1 or 2, 1 on the other (the heads); or why not."""
    x = m.value(name)
    cos, sin = (m.value(t if one else f"{name}_{t}") for t in ("cos", "sin"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() for t in (cos, sin)):
        return f"{name}'s cos and sin are not 4-D float tensors"
    if (reason := _tables_differ(cos, sin, name)) is not None:
        return reason
    if not known_equal(cos.shape[3], x.shape[-1]) or not (known_equal(cos.shape[0], 1)
                                                         or known_equal(cos.shape[0], x.shape[0])):
        return f"the table {tuple(cos.shape)} does not broadcast to {name} {tuple(x.shape)} (D wide)"
    if _table_positions_dim(cos, x) is None:
        return f"the table {tuple(cos.shape)} is not one row per position of {name} {tuple(x.shape)}"
    return None


def _q_k_one_table(m: Match) -> str | None:
    """q and k rotated by views of one table, their positions on the same dim; or why not."""
    if not (_same_table(m["q_cos"], m["k_cos"]) and _same_table(m["q_sin"], m["k_sin"])):
        return "q and k are rotated by different tables"
    q_dim, k_dim = (_table_positions_dim(m.value(f"{t}_cos"), m.value(t)) for t in ("q", "k"))
    if q_dim != k_dim:
        return "q and k have their positions on different dims"
    return None


def _table_positions_dim(table: torch.Tensor, x: torch.Tensor) -> int | None:
    """2 for a (B or 1, 1, S or 1, D) table, 1 for (B or 1, S or 1, 1, D); None when neither fits x."""
    for positions, heads in ((2, 1), (1, 2)):
        rows = table.shape[positions]
        one_per_position = known_equal(rows, 1) or known_equal(rows, x.shape[positions])
        if known_equal(table.shape[heads], 1) and one_per_position:
            return positions
    return None


def _unbind_layout(name: str):
    def derive(m: Match) -> dict:
        table = m.value("cos" if name == "x" else f"{name}_cos")
        return {"positions_dim": _table_positions_dim(table, m.value(name))}

    return derive


def _unbind_pattern(search, interleaved: bool, with_k: bool) -> Pattern:
    names = ("q", "k") if with_k else ("x",)
    return Pattern(search.__name__, "rotary", search, _unbind_fused(interleaved, with_k), _OPS,
                   (_unbind_split(names, interleaved),), derive=_unbind_layout(names[0]))


# LTX-Video's `apply_rotary_emb` (LTX-2's `apply_interleaved_rotary_emb`): the same formula on
# 3-D (B, S, C) q and k, before the heads are split, with (B, S, C) tables:
#
#     x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)
#     x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
#     out = (x.float() * cos + x_rotated.float() * sin).to(x.dtype)
#
# The pairs never cross a head (a head's width is even), so this is the op over C, one "head".


def _unflatten_pairs_rotated(x, sizes, flat):
    pairs = x.unflatten(2, sizes).unbind(-1)
    return torch.stack([-pairs[1], pairs[0]], dim=-1).flatten(flat)


def rotary_unflatten_pairs_q_k(q: torch.Tensor, k: torch.Tensor, q_cos: torch.Tensor, q_sin: torch.Tensor,
                               k_cos: torch.Tensor, k_sin: torch.Tensor, q_sizes, k_sizes, q_flat, k_flat,
                               q_back, k_back):
    """LTX-Video's apply_rotary_emb on q and on k, one table."""
    return (_diffusers_formula(q, _unflatten_pairs_rotated(q, q_sizes, q_flat), q_cos, q_sin, q_back),
            _diffusers_formula(k, _unflatten_pairs_rotated(k, k_sizes, k_flat), k_cos, k_sin, k_back))


def rotary_unflatten_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_sizes, x_flat, x_back):
    """The same on one tensor (LTX-2's cross-attention: q and k rotated by tables of their own)."""
    return _diffusers_formula(x, _unflatten_pairs_rotated(x, x_sizes, x_flat), cos, sin, x_back)


def _one_head(x):
    return x.unsqueeze(2)  # (B, S, C) as (B, S, 1, C): positions on dim 1, one head of width C


def rotary_unflatten_pairs_q_k_fused(q, k, q_cos, q_sin, k_cos, k_sin, q_sizes=None, k_sizes=None,
                                     q_flat=None, k_flat=None, q_back=None, k_back=None):
    q_out, k_out = _rotate_pairs(_one_head(q), _one_head(k), _one_head(q_cos), _one_head(q_sin), 1, q_back)
    return q_out.squeeze(2), k_out.squeeze(2)


def rotary_unflatten_pairs_fused(x, cos, sin, x_sizes=None, x_flat=None, x_back=None):
    return _rotate_pairs(_one_head(x), None, _one_head(cos), _one_head(sin), 1, x_back)[0].squeeze(2)


def _unflatten_split(names: tuple[str, ...]):
    """Each tensor 3-D and float (16-bit or fp32: a float64 model's `.float()` rounds), its last
    dim split into pairs and flattened back, cast back to its own dtype; its tables 3-D, as wide,
    one dtype, one row per sample (or one for all) and per position (or one for all); with q and
    k, the same table for both."""

    def check(m: Match) -> str | None:
        one = len(names) == 1
        for name in names:
            x, back, sizes, flat = m.value(name), m[f"{name}_back"], m[f"{name}_sizes"], m[f"{name}_flat"]
            if not isinstance(x, torch.Tensor) or x.dim() != 3 \
                    or x.dtype not in _FP32_OR_NARROWER:
                return f"{name} is not a 3-D 16-bit or fp32 tensor"
            if back is not x.dtype:
                return f"{name} ({x.dtype}) is rotated in fp32 and cast to {back!r}, not back to its dtype"
            c = x.shape[-1]
            pairs = isinstance(sizes, (tuple, list)) and len(sizes) == 2 and known_equal(sizes[1], 2) \
                and (known_equal(sizes[0], -1) or known_equal(sizes[0], c // 2))
            if not (pairs and known_equal(c % 2, 0)):
                return f"{name} {tuple(x.shape)} is unflattened to {sizes!r}: not its last dim in pairs"
            if isinstance(flat, bool) or flat not in (2, -2):
                return f"the rotated pairs of {name} are flattened from dim {flat!r}, not from 2"
            cos, sin = (m.value(t if one else f"{name}_{t}") for t in ("cos", "sin"))
            if not all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.is_floating_point()
                       for t in (cos, sin)):
                return f"{name}'s cos and sin are not 3-D float tensors"
            if (reason := _tables_differ(cos, sin, name)) is not None:
                return reason
            rows = all(known_equal(cos.shape[i], 1) or known_equal(cos.shape[i], x.shape[i]) for i in (0, 1))
            if not (known_equal(cos.shape[2], c) and rows):
                return f"the table {tuple(cos.shape)} is not one row per sample and position of {name} " \
                    f"{tuple(x.shape)}, as wide"
        if not one and not (_same_table(m["q_cos"], m["k_cos"]) and _same_table(m["q_sin"], m["k_sin"])):
            return "q and k are rotated by different tables"
        return None

    check.__name__ = "unflatten_pairs"
    return check


# Wan's rotary (Sana-Video's too), once its two strided writes into `torch.empty_like(x)` are
# the stack they compute (fusion/normalize.py's `_interleaved_writes`):
#
#     x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
#     cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
#     out = torch.empty_like(x)
#     out[..., 0::2] = x1 * cos - x2 * sin
#     out[..., 1::2] = x1 * sin + x2 * cos
#
# each half cast to x's dtype by its write where the tables' dtype is another (float64 tables, as
# Wan registers them, under a 16-bit or fp32 x): the op with one table entry per pair, in x's dtype.


def _written_pairs(x, cos, sin, sizes, back=None):
    pairs = x.unflatten(-1, sizes).unbind(-1)
    x1, x2 = pairs[0], pairs[1]
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    even, odd = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    if back is not None:
        even, odd = even.to(back), odd.to(back)
    return torch.stack([even, odd], -1).flatten(-2)


def rotary_written_pairs_cast_q_k(q: torch.Tensor, k: torch.Tensor, q_cos: torch.Tensor, q_sin: torch.Tensor,
                                  k_cos: torch.Tensor, k_sin: torch.Tensor, q_sizes, k_sizes, q_back, k_back):
    """Wan's rotary of q and of k, float64 tables."""
    return (_written_pairs(q, q_cos, q_sin, q_sizes, q_back),
            _written_pairs(k, k_cos, k_sin, k_sizes, k_back))


def rotary_written_pairs_cast(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_sizes, x_back):
    return _written_pairs(x, cos, sin, x_sizes, x_back)


def rotary_written_pairs_q_k(q: torch.Tensor, k: torch.Tensor, q_cos: torch.Tensor, q_sin: torch.Tensor,
                             k_cos: torch.Tensor, k_sin: torch.Tensor, q_sizes, k_sizes):
    """Wan's rotary of q and of k, tables in x's dtype (a model cast whole to bf16)."""
    return _written_pairs(q, q_cos, q_sin, q_sizes), _written_pairs(k, k_cos, k_sin, k_sizes)


def rotary_written_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_sizes):
    return _written_pairs(x, cos, sin, x_sizes)


def _written_pairs_fused(with_k: bool):
    def fused_q_k(q, k, q_cos, q_sin, k_cos, k_sin, q_sizes=None, k_sizes=None, q_back=None, k_back=None,
                  positions_dim=2, dtype=None):
        return _rotate_pairs(q, k, q_cos[..., 0::2], q_sin[..., 1::2], positions_dim, dtype)

    def fused(x, cos, sin, x_sizes=None, x_back=None, positions_dim=2, dtype=None):
        return _rotate_pairs(x, None, cos[..., 0::2], sin[..., 1::2], positions_dim, dtype)[0]

    return fused_q_k if with_k else fused


def _written_pairs_split(names: tuple[str, ...], cast: bool):
    """Each tensor 4-D and float, its last dim (even) split into pairs; with `cast`, both halves
    cast back to its dtype; without, computed in it (the tables no wider). Its tables 4-D, D wide
    (every other entry read), one dtype, one row per position on dim 1 or 2 and 1 on the other
    (the heads); with q and k, the same table for both."""

    def check(m: Match) -> str | None:
        one = len(names) == 1
        for name in names:
            x, sizes = m.value(name), m[f"{name}_sizes"]
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
                return f"{name} is not a 4-D float tensor"
            d = x.shape[-1]
            pairs = isinstance(sizes, (tuple, list)) and len(sizes) == 2 and known_equal(sizes[1], 2) \
                and (known_equal(sizes[0], -1) or known_equal(sizes[0], d // 2))
            if not (pairs and known_equal(d % 2, 0)):
                return f"{name} {tuple(x.shape)} is unflattened to {sizes!r}: not its last dim in pairs"
            reason = _d_wide_tables(m, name, one)
            if reason is not None:
                return reason
            cos = m.value("cos" if one else f"{name}_cos")
            if cast:
                back = m[f"{name}_back"]
                if back is not x.dtype:
                    return f"{name} ({x.dtype}) is rotated and cast to {back!r}, not back to its dtype"
            elif torch.promote_types(x.dtype, cos.dtype) != x.dtype:
                return f"{name} ({x.dtype}) is rotated in {cos.dtype}, its tables' dtype, and not cast back"
        return None if one else _q_k_one_table(m)

    check.__name__ = "written_pairs"
    return check


def _written_pairs_layout(name: str):
    layout = _unbind_layout(name)

    def derive(m: Match) -> dict:
        return {**layout(m), "dtype": m.value(name).dtype}

    return derive


def _written_pairs_pattern(search, cast: bool, with_k: bool) -> Pattern:
    names = ("q", "k") if with_k else ("x",)
    return Pattern(search.__name__, "rotary", search, _written_pairs_fused(with_k), _OPS,
                   (_written_pairs_split(names, cast),), derive=_written_pairs_layout(names[0]))


# Mochi's rotary (diffusers' MochiAttnProcessor2_0): the even and the odd features sliced and
# upcast apart, each half of the result cast back, stacked into pairs, with (S, H, D/2) tables (a
# frequency per head, learned: Mochi's `pos_frequencies` is a Parameter):
#
#     x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
#     cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
#     sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)
#     return torch.stack([cos, sin], dim=-1).flatten(-2)
#
# the interleaved op with one table entry per pair, in x's dtype (rounded once, as each half is).


def _slices_rotated(x, cos, sin, start, dim, flat, even_up, odd_up, even_back, odd_back):
    even, odd = x[..., start::2].to(even_up), x[..., 1::2].to(odd_up)
    return torch.stack([(even * cos - odd * sin).to(even_back), (even * sin + odd * cos).to(odd_back)],
                       dim=dim).flatten(flat)


def rotary_slices_cast_q_k(q: torch.Tensor, k: torch.Tensor, q_cos: torch.Tensor, q_sin: torch.Tensor,
                           k_cos: torch.Tensor, k_sin: torch.Tensor, q_start, k_start, q_dim, k_dim, q_flat,
                           k_flat, q_even_up, q_odd_up, k_even_up, k_odd_up, q_even_back, q_odd_back,
                           k_even_back, k_odd_back):
    """Mochi's apply_rotary_emb on q and on k."""
    return (_slices_rotated(q, q_cos, q_sin, q_start, q_dim, q_flat, q_even_up, q_odd_up, q_even_back,
                            q_odd_back),
            _slices_rotated(k, k_cos, k_sin, k_start, k_dim, k_flat, k_even_up, k_odd_up, k_even_back,
                            k_odd_back))


def rotary_slices_cast(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_start, x_dim, x_flat,
                       x_even_up, x_odd_up, x_even_back, x_odd_back):
    return _slices_rotated(x, cos, sin, x_start, x_dim, x_flat, x_even_up, x_odd_up, x_even_back, x_odd_back)


def _as_op_table(t: torch.Tensor, pad: int) -> torch.Tensor:
    for _ in range(pad):  # views: Mochi's (S, H, D/2) as (1, S, H, D/2)
        t = t.unsqueeze(0)
    return t


def _slices_fused(with_k: bool):
    def fused_q_k(q, k, q_cos, q_sin, k_cos=None, k_sin=None, q_start=None, k_start=None, q_dim=None,
                  k_dim=None, q_flat=None, k_flat=None, q_even_up=None, q_odd_up=None, k_even_up=None,
                  k_odd_up=None, q_even_back=None, q_odd_back=None, k_even_back=None, k_odd_back=None,
                  positions_dim=2, dtype=None, pad=0):
        return _rotate_pairs(q, k, _as_op_table(q_cos, pad), _as_op_table(q_sin, pad), positions_dim, dtype)

    def fused(x, cos, sin, x_start=None, x_dim=None, x_flat=None, x_even_up=None, x_odd_up=None,
              x_even_back=None, x_odd_back=None, positions_dim=2, dtype=None, pad=0):
        return _rotate_pairs(x, None, _as_op_table(cos, pad), _as_op_table(sin, pad), positions_dim, dtype)[0]

    return fused_q_k if with_k else fused


def _half_table_positions_dim(table: torch.Tensor, x: torch.Tensor) -> int | None:
    """Where x's positions are for a table of one entry per pair padded to (B or 1, ., ., D/2): dim 1
    when the table is 1 on dim 2 (B, S, H, D with (.., S, 1, D/2)), else dim 2; None when the table
    does not broadcast to x's pairs without growing them."""
    shape = (1,) * (4 - table.dim()) + tuple(table.shape)
    if not (known_equal(shape[3], x.shape[-1] // 2) and all(
            known_equal(shape[i], 1) or known_equal(shape[i], x.shape[i]) for i in range(3))):
        return None
    return 1 if known_equal(shape[2], 1) and not known_equal(shape[1], 1) else 2


def _slices_split(names: tuple[str, ...]):
    """Each tensor 4-D, 16-bit or fp32 (a float64 model's `.float()` rounds), its even (0::2) and
    odd (1::2) features upcast to fp32, each half of the result cast back to its dtype, the halves
    stacked along a new last dim and flattened into it; its tables float, one shape and dtype, at
    most 4-D, D/2 wide, broadcasting to its pairs; with q and k, the same tables for both."""

    def check(m: Match) -> str | None:
        one = len(names) == 1
        for name in names:
            x = m.value(name)
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in _FP32_OR_NARROWER:
                return f"{name} is not a 4-D 16-bit or fp32 tensor"
            start, dim, flat = m.value(f"{name}_start"), m.value(f"{name}_dim"), m.value(f"{name}_flat")
            if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start != 0):
                return f"the pairs are {name}[..., {start!r}::2] with {name}[..., 1::2], not 0::2"
            if isinstance(dim, bool) or dim not in (-1, x.dim()) or isinstance(flat, bool) \
                    or flat not in (-2, x.dim() - 1):
                return f"the halves of {name} are stacked along {dim!r} and flattened from {flat!r}, " \
                    "not into pairs"
            for half in ("even", "odd"):
                up, back = m[f"{name}_{half}_up"], m[f"{name}_{half}_back"]
                if up is not torch.float32 or back is not x.dtype:
                    return f"{name}'s {half} features ({x.dtype}) are cast to {up!r} and back to {back!r}, " \
                        "not to fp32 and back"
            cos, sin = (m.value(t if one else f"{name}_{t}") for t in ("cos", "sin"))
            if not all(isinstance(t, torch.Tensor) and t.is_floating_point() and 1 <= t.dim() <= 4
                       for t in (cos, sin)):
                return f"{name}'s cos and sin are not float tables of at most 4 dims"
            if (reason := _tables_differ(cos, sin, name)) is not None:
                return reason
            if _half_table_positions_dim(cos, x) is None:
                return f"the table {tuple(cos.shape)} does not broadcast to the pairs of {name} " \
                    f"{tuple(x.shape)}"
        if one:
            return None
        if not (_same_table(m["q_cos"], m["k_cos"]) and _same_table(m["q_sin"], m["k_sin"])):
            return "q and k are rotated by different tables"
        return None

    check.__name__ = "slices_cast"
    return check


def _slices_layout(name: str):
    def derive(m: Match) -> dict:
        x, cos = m.value(name), m.value("cos" if name == "x" else f"{name}_cos")
        return {"positions_dim": _half_table_positions_dim(cos, x), "dtype": x.dtype, "pad": 4 - cos.dim()}

    return derive


def _slices_pattern(search, with_k: bool) -> Pattern:
    names = ("q", "k") if with_k else ("x",)
    return Pattern(search.__name__, "rotary", search, _slices_fused(with_k), _OPS, (_slices_split(names),),
                   derive=_slices_layout(names[0]))


# BFL's Flux reference (`flux.math.apply_rope`, and the fine-tuning code built on it) and diffusers'
# HiDream multiply each pair by a 2x2 matrix, from a (.., D/2, 2, 2) table that their `rope()` fills
# with [[cos, -sin], [sin, cos]]:
#
#     xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
#     xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
#     return xq_out.reshape(*xq.shape).type_as(xq)
#
# that is y[2i + r] = M[i, r, 0] x[2i] + M[i, r, 1] x[2i + 1]. The table is data made outside the
# block, so no pattern can know that it is a rotation. The replacement gives the op D-wide
# interleaved tables that carry any 2x2 matrix: cos = (M[0, 0], M[1, 1]) and sin = (-M[0, 1], M[1, 0])
# per pair. The op's y[2i] = x[2i] cos[2i] - x[2i+1] sin[2i] and y[2i+1] = x[2i+1] cos[2i+1] +
# x[2i] sin[2i+1] are then the matrix product term for term (the negation is exact). The tables are
# (B, 1, S, D): the heads' share of the activation's traffic, once per call for q and k together.


def _matrix_product(x, freqs, shape, out_shape):
    pairs = x.reshape(shape)
    return (freqs[..., 0] * pairs[..., 0] + freqs[..., 1] * pairs[..., 1]).reshape(out_shape)


def rotary_matrix_cast_q_k(q: torch.Tensor, k: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                           q_shape, k_shape, q_out_shape, k_out_shape, q_up, k_up, q_back, k_back):
    """BFL's and HiDream's apply_rope: q and k upcast, each pair times its 2x2 matrix, cast back."""
    return (_matrix_product(q.to(q_up), q_freqs, q_shape, q_out_shape).to(q_back),
            _matrix_product(k.to(k_up), k_freqs, k_shape, k_out_shape).to(k_back))


def rotary_matrix_cast(x: torch.Tensor, freqs: torch.Tensor, x_shape, x_out_shape, x_up, x_back):
    return _matrix_product(x.to(x_up), freqs, x_shape, x_out_shape).to(x_back)


def rotary_matrix_q_k(q: torch.Tensor, k: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, q_shape,
                      k_shape, q_out_shape, k_out_shape):
    """The same without the casts (an fp32 model's `.float()` and `.type_as` are no-ops, dropped)."""
    return (_matrix_product(q, q_freqs, q_shape, q_out_shape),
            _matrix_product(k, k_freqs, k_shape, k_out_shape))


def rotary_matrix(x: torch.Tensor, freqs: torch.Tensor, x_shape, x_out_shape):
    return _matrix_product(x, freqs, x_shape, x_out_shape)


def _matrix_as_cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(.., D/2, 2, 2) matrices as the op's D-wide interleaved cos and sin (above)."""
    cos = torch.stack((freqs[..., 0, 0], freqs[..., 1, 1]), dim=-1).flatten(-2)
    sin = torch.stack((-freqs[..., 0, 1], freqs[..., 1, 0]), dim=-1).flatten(-2)
    return cos, sin


def _matrix_fused(with_k: bool):
    def fused_q_k(q, k, q_freqs, k_freqs=None, q_shape=None, k_shape=None, q_out_shape=None, k_out_shape=None,
                  q_up=None, k_up=None, q_back=None, k_back=None, positions_dim=2, dtype=None):
        return _rotate_pairs(q, k, *_matrix_as_cos_sin(q_freqs), positions_dim, dtype)

    def fused(x, freqs, x_shape=None, x_out_shape=None, x_up=None, x_back=None, positions_dim=2, dtype=None):
        return _rotate_pairs(x, None, *_matrix_as_cos_sin(freqs), positions_dim, dtype)[0]

    return fused_q_k if with_k else fused


def _matrix_positions_dim(freqs: torch.Tensor, x: torch.Tensor) -> int | None:
    """2 for a (B or 1, 1, S or 1, D/2, 2, 2) table, 1 for (B or 1, S or 1, 1, D/2, 2, 2)."""
    return _table_positions_dim(freqs[..., 0, 0], x)


def _matrix_pairs(names: tuple[str, ...]):
    """Each tensor 4-D and float, its last dim (even) reshaped to (D/2, 1, 2) pairs and the product
    reshaped back to its shape; its table a 6-D float (B or 1, ., ., D/2, 2, 2) of matrices, one row
    per position on dim 1 or 2 and 1 on the other (the heads); with q and k, one table for both."""

    def check(m: Match) -> str | None:
        one = len(names) == 1
        for name in names:
            x, freqs = m.value(name), m.value("freqs" if one else f"{name}_freqs")
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
                return f"{name} is not a 4-D float tensor"
            d = x.shape[-1]
            shape = _five_sizes(m.value(f"{name}_shape"), 6)
            if isinstance(shape, str):
                return f"{name} is reshaped to {shape}, not a known 6-D shape"
            if not (all(known_equal(a, b) for a, b in zip(shape[:3], x.shape[:3]))
                    and (known_equal(shape[3], -1) or known_equal(shape[3], d // 2))
                    and known_equal(shape[4], 1) and known_equal(shape[5], 2) and known_equal(d % 2, 0)):
                return f"{name} {tuple(x.shape)} is reshaped to {tuple(shape)}: not its last dim as " \
                    "(D/2, 1, 2) pairs"
            out_shape = _five_sizes(m.value(f"{name}_out_shape"), 4)
            if isinstance(out_shape, str) or not all(known_equal(a, b) for a, b in zip(out_shape, x.shape)):
                return f"the product of {name} {tuple(x.shape)} is reshaped to {out_shape}, not to its shape"
            if not isinstance(freqs, torch.Tensor) or freqs.dim() != 6 or not freqs.is_floating_point():
                got = getattr(freqs, "shape", freqs)
                return f"the table is not a 6-D float tensor of 2x2 matrices (got {got!r})"
            if not (known_equal(freqs.shape[4], 2) and known_equal(freqs.shape[5], 2)
                    and known_equal(freqs.shape[3], d // 2)
                    and (known_equal(freqs.shape[0], 1) or known_equal(freqs.shape[0], x.shape[0]))):
                return f"the table {tuple(freqs.shape)} is not (batch, ., ., D/2, 2, 2) matrices for " \
                    f"{name} {tuple(x.shape)}"
            if _matrix_positions_dim(freqs, x) is None:
                return f"the table {tuple(freqs.shape)} is not one row per position of {name} " \
                    f"{tuple(x.shape)}"
        if one:
            return None
        if not _same_table(m["q_freqs"], m["k_freqs"]):
            return "q and k are multiplied by different tables"
        if _matrix_positions_dim(m.value("q_freqs"), m.value("q")) != \
                _matrix_positions_dim(m.value("k_freqs"), m.value("k")):
            return "q and k have their positions on different dims"
        return None

    check.__name__ = "matrix_pairs"
    return check


def _matrix_layout(name: str, cast: bool):
    def derive(m: Match) -> dict:
        freqs = m.value("freqs" if name == "x" else f"{name}_freqs")
        out = {"positions_dim": _matrix_positions_dim(freqs, m.value(name))}
        if cast:
            out["dtype"] = m.value(name).dtype
        return out

    return derive


def _matrix_pattern(search, cast: bool, with_k: bool) -> Pattern:
    names = ("q", "k") if with_k else ("x",)
    filters = (_matrix_pairs(names), *((_upcast_and_back(names),) if cast else ()))
    return Pattern(search.__name__, "rotary", search, _matrix_fused(with_k), _OPS, filters,
                   derive=_matrix_layout(names[0], cast))


_OPS = ("rotary_embedding",)


def _pairs_pattern(search, complex_table: bool, cast: bool, with_k: bool) -> Pattern:
    names = ("q", "k") if with_k else ("x",)
    filters = (_complex_pairs(names, real_cache=not complex_table), *((_one_table,) if with_k else ()),
               *((_upcast_and_back(names),) if cast else ()))
    return Pattern(search.__name__, "rotary", search, _pairs_fused(complex_table, with_k), _OPS, filters,
                   derive=_complex_layout(names[0], cast))


def _seq_heads(m: Match) -> dict:
    """The replacement's layout: 3-D (seq, heads, head_dim) tensors (_cos_sin_layout checked them)."""
    return {"seq_heads": all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in _rotated(m))}


def _q_dtype(m: Match) -> dict:
    return {"dtype": m.value("q").dtype}


def _q_dtype_and_layout(m: Match) -> dict:
    return {**_q_dtype(m), **_seq_heads(m)}


PATTERNS = (
    # with the model's upcast of q and k and its cast back first (ModernBERT; Cohere below)
    Pattern("rotary_cast_q_k", "rotary", rotary_cast_q_k, rotary_cast_q_k_fused, _OPS,
            (_rotates_half_of_last_dim(("q", "k")), _cos_sin_layout, _upcast_and_back(("q", "k"))),
            derive=_q_dtype_and_layout),
    Pattern("rotary_q_k", "rotary", rotary_q_k, rotary_q_k_fused, _OPS,
            (_rotates_half_of_last_dim(("q", "k")), _cos_sin_layout), derive=_seq_heads),
    Pattern("rotary", "rotary", rotary, rotary_fused, _OPS,
            (_rotates_half_of_last_dim(("x",)), _cos_sin_layout), derive=_seq_heads),
    Pattern("rotary_chunk_q_k", "rotary", rotary_chunk_q_k, rotary_chunk_q_k_fused, _OPS,
            (_chunks_last_dim_in_half(("q", "k")), _cos_sin_layout), derive=_seq_heads),
    Pattern("rotary_chunk", "rotary", rotary_chunk, rotary_chunk_fused, _OPS,
            (_chunks_last_dim_in_half(("x",)), _cos_sin_layout), derive=_seq_heads),
    Pattern("rotary_cast_each", "rotary", rotary_cast_each, rotary_cast_each_fused, _OPS,
            (_rotates_half_of_last_dim(("x",)), _cos_sin_layout, _cast_back_to_its_dtype(("x",))),
            derive=_seq_heads),
    Pattern("rotary_interleaved_cast_q_k", "rotary", rotary_interleaved_cast_q_k, rotary_interleaved_cast_q_k_fused,
            _OPS, (_pairs_last_dim(("q", "k")), _cos_sin_are_4d, _upcast_and_back(("q", "k"))), derive=_q_dtype),
    Pattern("rotary_interleaved_q_k", "rotary", rotary_interleaved_q_k, rotary_interleaved_q_k_fused, _OPS,
            (_pairs_last_dim(("q", "k")), _cos_sin_are_4d)),
    Pattern("rotary_interleaved", "rotary", rotary_interleaved, rotary_interleaved_fused, _OPS,
            (_pairs_last_dim(("x",)), _cos_sin_are_4d)),
    Pattern("rotary_pairs_to_halves_q_k", "rotary", rotary_pairs_to_halves_q_k, rotary_pairs_to_halves_q_k_fused,
            _OPS, (_pairs_to_halves_last_dim(("q", "k")), _cos_sin_are_4d)),
    Pattern("rotary_pairs_to_halves", "rotary", rotary_pairs_to_halves, rotary_pairs_to_halves_fused, _OPS,
            (_pairs_to_halves_last_dim(("x",)), _cos_sin_are_4d)),
    # the complex product and torchtune's real pairs, with the casts around them first
    _pairs_pattern(rotary_complex_cast_q_k, complex_table=True, cast=True, with_k=True),
    _pairs_pattern(rotary_complex_cast, complex_table=True, cast=True, with_k=False),
    _pairs_pattern(rotary_real_pairs_cast_q_k, complex_table=False, cast=True, with_k=True),
    _pairs_pattern(rotary_real_pairs_cast, complex_table=False, cast=True, with_k=False),
    _pairs_pattern(rotary_complex_q_k, complex_table=True, cast=False, with_k=True),
    _pairs_pattern(rotary_complex, complex_table=True, cast=False, with_k=False),
    _pairs_pattern(rotary_real_pairs_q_k, complex_table=False, cast=False, with_k=True),
    _pairs_pattern(rotary_real_pairs, complex_table=False, cast=False, with_k=False),
    _slices_pattern(rotary_slices_cast_q_k, with_k=True),
    _slices_pattern(rotary_slices_cast, with_k=False),
    _matrix_pattern(rotary_matrix_cast_q_k, cast=True, with_k=True),
    _matrix_pattern(rotary_matrix_cast, cast=True, with_k=False),
    _matrix_pattern(rotary_matrix_q_k, cast=False, with_k=True),
    _matrix_pattern(rotary_matrix, cast=False, with_k=False),
    _unbind_pattern(rotary_unbind_pairs_q_k, interleaved=True, with_k=True),
    _unbind_pattern(rotary_unbind_pairs, interleaved=True, with_k=False),
    _unbind_pattern(rotary_unbind_halves_q_k, interleaved=False, with_k=True),
    _unbind_pattern(rotary_unbind_halves, interleaved=False, with_k=False),
    Pattern("rotary_unflatten_pairs_q_k", "rotary", rotary_unflatten_pairs_q_k,
            rotary_unflatten_pairs_q_k_fused, _OPS, (_unflatten_split(("q", "k")),)),
    Pattern("rotary_unflatten_pairs", "rotary", rotary_unflatten_pairs, rotary_unflatten_pairs_fused, _OPS,
            (_unflatten_split(("x",)),)),
    _written_pairs_pattern(rotary_written_pairs_cast_q_k, cast=True, with_k=True),
    _written_pairs_pattern(rotary_written_pairs_cast, cast=True, with_k=False),
    _written_pairs_pattern(rotary_written_pairs_q_k, cast=False, with_k=True),
    _written_pairs_pattern(rotary_written_pairs, cast=False, with_k=False),
    Pattern("rotary_every_two_q_k", "rotary", rotary_every_two_q_k, rotary_every_two_q_k_fused, _OPS,
            (_positions_on_dim_1(("q", "k"), unsqueezed=False),)),
    Pattern("rotary_every_two", "rotary", rotary_every_two, rotary_every_two_fused, _OPS,
            (_positions_on_dim_1(("x",), unsqueezed=True),)),
)
