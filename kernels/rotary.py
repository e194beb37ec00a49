"""Rotary position embedding (RoPE), rotate-half convention (GPT-NeoX, Llama and the models after
them) or interleaved convention (GPT-J, Cohere, GLM, Helium; `interleaved=True`), applied to the
queries and the keys of an attention block in one pass each way.

Maths, per vector x of head_dim D (D even, h = D / 2), in fp32 (fp64 for fp64 inputs):

    rotate_half(x) = cat(-x[h:], x[:h])
    y = x * cos + rotate_half(x) * sin           y[:h] = x[:h] cos[:h] - x[h:] sin[:h]
                                                 y[h:] = x[h:] cos[h:] + x[:h] sin[h:]

exactly Hugging Face's `apply_rotary_pos_emb` for q and for k with the same cos and sin. The
backward is the transpose of that linear map:

    dx = dy * cos + rotate_half^T(dy * sin),  rotate_half^T(z) = cat(z[h:], -z[:h])
                                                 dx[:h] = dy[:h] cos[:h] + dy[h:] sin[h:]
                                                 dx[h:] = dy[h:] cos[h:] - dy[:h] sin[:h]

The interleaved convention pairs (x[2i], x[2i+1]) instead of (x[i], x[i+h]), with cos and sin
in the same interleaved layout (Hugging Face repeats each frequency twice in a row there):

    rotate_half(x) = stack((-x[1::2], x[0::2]), -1).flatten(-2)
    y[2i] = x[2i] cos[2i] - x[2i+1] sin[2i]      y[2i+1] = x[2i+1] cos[2i+1] + x[2i] sin[2i+1]

the same formulas on pairs addressed differently (first of a pair at 2 i, its partner at + 1),
backward likewise. cos and sin may also hold one entry per pair (D / 2 wide): the rotation as a
complex product, (x[2i] + i x[2i+1]) (cos[i] + i sin[i]), which is how Meta's Llama reference,
torchtitan, Llama 4 and DeepSeek-V2 write it (`view_as_complex`, a table from `torch.polar`).

DeepSeek-V2/V3 (`apply_rotary_pos_emb_interleave`) reads the pairs interleaved and writes them
rotate-half (`halves_out=True`): the rotate-half formulas on `pairs_to_halves(x)` = cat(x[0::2],
x[1::2]), cos and sin in the rotate-half layout, D wide or one entry per pair (D / 2: DeepSeek
passes `cos[..., :D/2]`). Its backward reads dy rotate-half and writes dx interleaved.

It needs cos and sin, not x: the op saves nothing else. Should
cos or sin require grad, their gradients are computed in PyTorch from the saved q and k (then
saved too): dcos = sum(dq * q + dk * k), dsin = sum(dq * rotate_half(q) + dk * rotate_half(k)),
each summed over what cos and sin broadcast across.

Shapes: q (B, Hq, S, D), k (B, Hkv, S, D) or None (grouped-query attention: Hq != Hkv); cos and
sin (B or 1, 1, S or 1, D), what `cos.unsqueeze(1)` gives Hugging Face's (B, S, D) embeddings
(per-batch positions) or (1, S, D) ones; a head dim of Hq == Hkv is taken too. q and k may have
any strides with a unit stride along D (the usual `proj(x).view(B, S, H, D).transpose(1, 2)`, a
slice `q[..., :rot]` of a partial-rotary model) and are read in place; cos and sin likewise, and
broadcast by stride 0. Outputs are new, contiguous (B, H, S, D) tensors (the layout SDPA and
trifuse's attention read without a copy). dq and dk take the layout of q and k when those are
transposed (B, S, H, D) tensors, the usual projection view: autograd then hands the projection a
contiguous gradient through the transpose and the view, where the view's backward would copy a
(B, H, S, D) one; otherwise they are contiguous (B, H, S, D).
Dtypes: q and k of one float dtype, cos and sin of one (possibly another: fp32 tables beside
16-bit q and k under autocast, as Hugging Face computes them there); outputs in the promoted
dtype, as PyTorch's `q * cos` gives (q's when the tables are in it); dq and dk in q's dtype.

Kernel: one launch each way for q and k together, the convention constexprs (X_PAIRS, Y_PAIRS:
the forward input's and output's layouts; TABLE_HALF). A
1-D grid enumerates (batch, block of positions, head) with the head fastest, so the programs that
read one tile of cos and sin run next to each other (the later ones should find it in L2; not yet
measured). A program rotates a BLOCK_S x D tile of one head as its two halves (BLOCK_S x
BLOCK_HALF each, BLOCK_HALF the power of two >= D / 2, masked; interleaved, the even and the odd
features, stride-2 loads): D = 80 or 96 pads to 64-wide halves; BLOCK_S and the warps are tuned
per shape bucket (autotune/configs.py: rotary). int64 offsets (tensors past 2^31 elements).
"""
import torch
import triton
import triton.language as tl

from ..autotune import Tuner, configs, dialects, pow2_bucket
from ._common import (
    acc_dtype,
    apply_function,
    check_float,
    check_same_device,
    check_same_dtype,
    check_tensor,
    eager_fast_path,
    next_power_of_2,
    outside_device_modes,
    profiled,
    single_backward,
    use_triton,
)
from ._launch import CachedKernel, store_plan
from ._tiles import cdiv

# =============================================================================================
# Reference: the spec. Tests run it in float64 as the oracle and in the input dtype to measure
# PyTorch's own error.
# =============================================================================================


def rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """cat(-x[..., D/2:], x[..., :D/2]), as Hugging Face writes it; interleaved, the pairs
    (x[2i], x[2i+1]) become (-x[2i+1], x[2i]): stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """The features (x[2i], x[2i+1]) moved to (i, i + D/2): cat(x[..., 0::2], x[..., 1::2])."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _halves_to_pairs(z: torch.Tensor) -> torch.Tensor:
    """pairs_to_halves' inverse (and transpose): stack((z[..., :D/2], z[..., D/2:]), -1).flatten(-2)."""
    half = z.shape[-1] // 2
    return torch.stack((z[..., :half], z[..., half:]), dim=-1).flatten(-2)


def _full_table(t: torch.Tensor, d: int, interleaved: bool = False) -> torch.Tensor:
    """cos or sin as D entries: a table of one entry per pair repeated, in the rotate-half layout
    (i and i + D/2) or the interleaved one (2i and 2i + 1)."""
    if t.shape[-1] == d:
        return t
    return t.repeat_interleave(2, dim=-1) if interleaved else torch.cat((t, t), dim=-1)


def rotary_embedding_ref(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
    halves_out: bool = False, dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q * cos + rotate_half(q) * sin, the same for k) in plain PyTorch; k None gives None.
    halves_out: q and k's pairs (x[2i], x[2i+1]) moved to (i, i + D/2) first, then rotate-half
    (DeepSeek-V2/V3's `apply_rotary_pos_emb_interleave`). cos and sin D wide, or D / 2 with
    interleaved (one entry per pair). dtype: the results cast to it (computed as `q * cos` is)."""
    if dtype is not None:
        q_embed, k_embed = rotary_embedding_ref(q, k, cos, sin, interleaved, halves_out)
        return q_embed.to(dtype), None if k_embed is None else k_embed.to(dtype)
    if halves_out:
        q, k, interleaved = pairs_to_halves(q), None if k is None else pairs_to_halves(k), False
    cos, sin = _full_table(cos, q.shape[-1], interleaved), _full_table(sin, q.shape[-1], interleaved)
    q_embed = q * cos + rotate_half(q, interleaved) * sin
    k_embed = None if k is None else k * cos + rotate_half(k, interleaved) * sin
    return q_embed, k_embed


# =============================================================================================
# Kernels
# =============================================================================================


@triton.jit
def _pair_offsets(offs_d, HALF, PAIRS: tl.constexpr):
    """(first, partner offset) of pair i: (2 i, + 1) interleaved, (i, + HALF) rotate-half."""
    if PAIRS:
        return offs_d[None, :] * 2, 1
    return offs_d[None, :], HALF


@triton.jit
def _rotate_tile(
    X,  # in (B, H, S, D) any strides, unit stride along D
    Y,  # out (B, H, S, D)
    COS,  # in broadcast to (B, H, S, D) by stride 0 (D / 2 wide when TABLE_HALF)
    SIN,  # in likewise
    b, h, offs_s, offs_d, mask, HALF,
    stride_xb, stride_xh, stride_xs, stride_yb, stride_yh, stride_ys,
    stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_ss,
    BACKWARD: tl.constexpr, ACC: tl.constexpr, X_PAIRS: tl.constexpr, Y_PAIRS: tl.constexpr,
    TABLE_HALF: tl.constexpr,
):
    # The forward reads x in X's layout and writes y in Y's; the backward reads dy in Y's and
    # writes dx in X's. cos and sin are addressed like the forward's output, or per pair (TABLE_HALF).
    rows = offs_s[:, None]
    in_cols, in_partner = _pair_offsets(offs_d, HALF, Y_PAIRS if BACKWARD else X_PAIRS)
    out_cols, out_partner = _pair_offsets(offs_d, HALF, X_PAIRS if BACKWARD else Y_PAIRS)
    if TABLE_HALF:
        t_cols, t_partner = offs_d[None, :], 0
    else:
        t_cols, t_partner = _pair_offsets(offs_d, HALF, Y_PAIRS)
    x_ptr = X + b * stride_xb + h * stride_xh + rows * stride_xs + in_cols
    c_ptr = COS + b * stride_cb + h * stride_ch + rows * stride_cs + t_cols
    s_ptr = SIN + b * stride_sb + h * stride_sh + rows * stride_ss + t_cols
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(ACC)
    x2 = tl.load(x_ptr + in_partner, mask=mask, other=0.0).to(ACC)
    c1 = tl.load(c_ptr, mask=mask, other=0.0).to(ACC)
    c2 = tl.load(c_ptr + t_partner, mask=mask, other=0.0).to(ACC)
    s1 = tl.load(s_ptr, mask=mask, other=0.0).to(ACC)
    s2 = tl.load(s_ptr + t_partner, mask=mask, other=0.0).to(ACC)
    if BACKWARD:  # the transpose rotation
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_ptr = Y + b * stride_yb + h * stride_yh + rows * stride_ys + out_cols
    tl.store(y_ptr, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + out_partner, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    Q,  # in (B, HQ, S, D): q forward, dq_embed backward
    K,  # in (B, HKV, S, D): k / dk_embed; unused when HKV == 0
    COS,  # in (B or 1, 1 or H, S or 1, D or D / 2)
    SIN,  # in like COS
    QO,  # out (B, HQ, S, D)
    KO,  # out (B, HKV, S, D); unused when HKV == 0
    HQ, HKV, S, HALF, s_blocks,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_qob, stride_qoh, stride_qos, stride_kob, stride_koh, stride_kos,
    stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_ss,
    BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr, ACC: tl.constexpr,
    X_PAIRS: tl.constexpr,  # the forward's input pairs (2 i, 2 i + 1); else (i, i + HALF)
    Y_PAIRS: tl.constexpr,  # the forward's output (and cos / sin) likewise
    TABLE_HALF: tl.constexpr,  # cos and sin hold one entry per pair (D / 2)
):
    # Heads fastest: neighbouring programs share the tile of cos and sin (L2 hits).
    pid = tl.program_id(0)
    heads = HQ + HKV
    h = (pid % heads).to(tl.int64)  # int64: index * stride may pass 2^31
    rest = pid // heads
    b = (rest // s_blocks).to(tl.int64)
    offs_s = ((rest % s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_s < S)[:, None] & (offs_d < HALF)[None, :]
    if h < HQ:
        _rotate_tile(Q, QO, COS, SIN, b, h, offs_s, offs_d, mask, HALF,
                     stride_qb, stride_qh, stride_qs, stride_qob, stride_qoh, stride_qos,
                     stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_ss, BACKWARD, ACC,
                     X_PAIRS, Y_PAIRS, TABLE_HALF)
    else:
        _rotate_tile(K, KO, COS, SIN, b, h - HQ, offs_s, offs_d, mask, HALF,
                     stride_kb, stride_kh, stride_ks, stride_kob, stride_koh, stride_kos,
                     stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_ss, BACKWARD, ACC,
                     X_PAIRS, Y_PAIRS, TABLE_HALF)


# =============================================================================================
# Launchers: check nothing, allocate the outputs, launch. Tensors in, tensors out.
# =============================================================================================

# Launch configurations (autotune/configs.py: rotary): TILE_HALF elements of one half-tile per
# program, and warps; the default moves 2 x 2048 elements of x and of y a program (16 per thread
# at 8 warps, 16-byte vectors of bf16) and reads as many of cos and sin, mostly from L2. Tuned
# per (device, dtype, head dim, positions bucket, heads x batch bucket, direction, layout); a
# launch per exact call shape once decided (_LAUNCHES), as the other kernels keep theirs.
_KEY_NAMES = ("device", "dtype", "d", "s", "rows", "backward", "pairs")
_TUNER = Tuner("rotary_embedding", configs.rotary, _KEY_NAMES)
_LAUNCHES: dict[tuple, tuple[tuple[int], int, dict]] = {}

_rotary_embedding = CachedKernel(_rotary_embedding_kernel)


def _plan(cfg: triton.Config, s: int, d: int) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_HALF, num_warps) of a config for S positions of head dim D: every
    convention tiles alike (the layout constexprs, in CachedKernel's key, pick the kernel). Warps
    keep the full tile's elements a thread, at most the config's."""
    tile_half, warps = cfg.kwargs["TILE_HALF"], cfg.num_warps
    block_half = max(next_power_of_2(d // 2), 2)
    block_s = min(max(tile_half // block_half, 1), next_power_of_2(s))
    per_thread = max(tile_half // (32 * warps), 1)
    return block_s, block_half, min(max(block_s * block_half // (32 * per_thread), 1), warps)


def _rotary_launch(cfg: triton.Config, b: int, heads: int, s: int, d: int,
                   constexprs: dict) -> tuple[tuple[int], int, dict]:
    """(grid, blocks of positions, launch keywords) of `cfg`."""
    block_s, block_half, num_warps = _plan(cfg, s, d)
    s_blocks = cdiv(s, block_s)
    return ((b * s_blocks * heads,), s_blocks,
            {**constexprs, "BLOCK_S": block_s, "BLOCK_HALF": block_half, "num_warps": num_warps})


def _run(launch: tuple[tuple[int], int, dict], head: tuple, tail: tuple) -> None:
    grid, s_blocks, meta = launch
    _rotary_embedding.run(grid, (*head, s_blocks, *tail), meta)


def _timed(cfg: triton.Config, b: int, heads: int, s: int, d: int, constexprs: dict, head: tuple,
           tail: tuple) -> None:
    """One launch with `cfg` (what the tuner times; it rewrites the outputs only)."""
    _run(_rotary_launch(cfg, b, heads, s, d, constexprs), head, tail)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its last dim has unit stride (any other strides are read in place)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _bcast_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, position) strides of a 4-D cos or sin, 0 along its broadcast (size-1) dims."""
    return tuple(0 if t.shape[i] == 1 else t.stride(i) for i in range(3))


def is_bshd(t: torch.Tensor | None) -> bool:
    """Whether `t` (B, H, S, D) is a transposed contiguous (B, S, H, D) tensor (and not also a
    contiguous one): `proj(x).view(B, S, H, D).transpose(1, 2)`."""
    return t is not None and not t.is_contiguous() and t.transpose(1, 2).is_contiguous()


def _empty(t: torch.Tensor, bshd: bool, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor shaped like `t` (B, H, S, D): contiguous, or transposed (B, S, H, D) storage."""
    b, h, s, d = t.shape
    if bshd:
        return torch.empty((b, s, h, d), dtype=dtype, device=t.device).transpose(1, 2)
    return torch.empty((b, h, s, d), dtype=dtype, device=t.device)


def out_dtype(q: torch.Tensor, cos: torch.Tensor) -> torch.dtype:
    """The outputs' dtype: what PyTorch's `q * cos` gives."""
    return q.dtype if q.dtype == cos.dtype else torch.promote_types(q.dtype, cos.dtype)


def _launch(x: torch.Tensor, y: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, backward: bool,
            dtype: torch.dtype, x_bshd: bool = False, y_bshd: bool = False, interleaved: bool = False,
            halves_out: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    b, hq, s, d = x.shape
    xo = _empty(x, x_bshd, dtype)
    yo = None if y is None else _empty(y, y_bshd, dtype)
    hkv = 0 if y is None else y.shape[1]
    if b * s == 0 or hq + hkv == 0:
        return xo, yo
    x, cos, sin = _unit_last(x), _unit_last(cos), _unit_last(sin)
    y = x if y is None else _unit_last(y)
    y_out = xo if yo is None else yo
    head = (x, y, cos, sin, xo, y_out, hq, hkv, s, d // 2)
    tail = (x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
            xo.stride(0), xo.stride(1), xo.stride(2), y_out.stride(0), y_out.stride(1), y_out.stride(2),
            *_bcast_strides(cos), *_bcast_strides(sin))
    device = x.get_device() if x.is_cuda else -1
    key = (device, x.dtype, dtype, cos.dtype, b, hq + hkv, s, d, backward, interleaved, halves_out,
           cos.shape[-1])
    launch = _LAUNCHES.get(key)
    if launch is None:
        constexprs = dict(BACKWARD=backward, ACC=acc_dtype(out_dtype(x, cos)), X_PAIRS=interleaved,
                          Y_PAIRS=interleaved and not halves_out, TABLE_HALF=cos.shape[-1] != d)
        # "pairs": the layouts in and out (interleaved reads stride-2, halves contiguous halves).
        pairs = "interleaved" if interleaved and not halves_out else "to-halves" if interleaved else "halves"
        tuning_key = (device, x.dtype, d, pow2_bucket(s), pow2_bucket(b * (hq + hkv)), backward, pairs)
        cfg = _TUNER.config(tuning_key, _timed, b, hq + hkv, s, d, constexprs, head, tail)
        launch = _rotary_launch(cfg, b, hq + hkv, s, d, constexprs)
        if _TUNER.is_decided(tuning_key):
            store_plan(_LAUNCHES, key, launch)
    _run(launch, head, tail)
    return xo, yo


def rotary_embedding_fwd(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                         interleaved: bool = False, halves_out: bool = False, dtype: torch.dtype | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q_embed, k_embed): contiguous (B, H, S, D) in `dtype`, by default `out_dtype(q, cos)` (the
    maths is in that dtype's accumulator either way); k_embed None when k is None."""
    dtype = dtype or out_dtype(q, cos)
    if not use_triton(q):
        return _rotary_torch(q, k, cos, sin, False, dtype, interleaved=interleaved, halves_out=halves_out)
    return _launch(q, k, cos, sin, False, dtype, interleaved=interleaved, halves_out=halves_out)


def rotary_embedding_bwd(dq: torch.Tensor, dk: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                         dtype: torch.dtype, q_bshd: bool = False, k_bshd: bool = False, interleaved: bool = False,
                         halves_out: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dq, dk) in `dtype` (q's) from the gradients of q_embed and k_embed: the transpose rotation;
    each in transposed (B, S, H, D) storage when its flag says (q's layout), else contiguous."""
    if not use_triton(dq):
        return _rotary_torch(dq, dk, cos, sin, True, dtype, q_bshd, k_bshd, interleaved, halves_out)
    return _launch(dq, dk, cos, sin, True, dtype, q_bshd, k_bshd, interleaved, halves_out)


# ---------------------------------------------------------------------------------------------
# PyTorch path for CPU tensors without the interpreter: same outputs, no Triton.
# ---------------------------------------------------------------------------------------------


def _rotate_half_t(z: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """rotate_half's transpose: cat(z[..., D/2:], -z[..., :D/2]); interleaved, the pairs
    (z[2i], z[2i+1]) become (z[2i+1], -z[2i])."""
    if interleaved:
        return torch.stack((z[..., 1::2], -z[..., 0::2]), dim=-1).flatten(-2)
    half = z.shape[-1] // 2
    return torch.cat((z[..., half:], -z[..., :half]), dim=-1)


def _rotary_torch(x, y, cos, sin, backward, dtype, x_bshd=False, y_bshd=False, interleaved=False,
                  halves_out=False):
    acc = torch.float64 if torch.float64 in (x.dtype, cos.dtype) else torch.float32
    d = x.shape[-1]
    # halves_out: rotate-half after pairs_to_halves, so the backward ends with its transpose
    rot_interleaved = interleaved and not halves_out
    c, s = _full_table(cos, d, rot_interleaved).to(acc), _full_table(sin, d, rot_interleaved).to(acc)

    def one(t, bshd):
        if t is None:
            return None
        t32 = t.to(acc)
        if backward:
            out = t32 * c + _rotate_half_t(t32 * s, rot_interleaved)
            out = _halves_to_pairs(out) if halves_out else out
        else:
            t32 = pairs_to_halves(t32) if halves_out else t32
            out = t32 * c + rotate_half(t32, rot_interleaved) * s
        return _empty(t, bshd, dtype).copy_(out)

    return one(x, x_bshd), one(y, y_bshd)


def _cos_sin_grads(dq, dk, q, k, cos, sin, interleaved=False, halves_out=False):
    """(dcos, dsin) in cos's dtype, shaped like cos: the products summed over the broadcast dims
    (and over the two features of a pair for a table of D / 2)."""
    acc = torch.float64 if torch.float64 in (q.dtype, cos.dtype) else torch.float32
    dcos = dsin = None
    for dy, x in ((dq, q), (dk, k)):
        if x is None or dy is None:
            continue
        dy, x = dy.to(acc), x.to(acc)
        if halves_out:
            x, rot_interleaved = pairs_to_halves(x), False
        else:
            rot_interleaved = interleaved
        c, s = dy * x, dy * rotate_half(x, rot_interleaved)
        if cos.shape[-1] != x.shape[-1]:  # one entry per pair: both features of the pair
            if rot_interleaved:
                c, s = c[..., 0::2] + c[..., 1::2], s[..., 0::2] + s[..., 1::2]
            else:
                half = x.shape[-1] // 2
                c, s = c[..., :half] + c[..., half:], s[..., :half] + s[..., half:]
        c, s = c.sum_to_size(cos.shape), s.sum_to_size(sin.shape)
        dcos, dsin = (c, s) if dcos is None else (dcos + c, dsin + s)
    return dcos.to(cos.dtype), dsin.to(sin.dtype)


# =============================================================================================
# Checks, shared by the registered ops (real and fake) and the eager path
# =============================================================================================

OP = "rotary_embedding"


def _check_inputs(q: object, k: object, cos: object, sin: object, interleaved: bool = False,
                  dtype: object = None) -> None:
    check_tensor(OP, "q", q)
    check_float(OP, "q", q)
    if q.dim() != 4:
        raise ValueError(f"trifuse.{OP}: q must be 4-D (batch, heads, seq, head_dim), got shape {tuple(q.shape)}")
    b, _, s, d = q.shape
    if d % 2:
        raise ValueError(f"trifuse.{OP}: head_dim must be even (the rotation pairs its features), got {d}")
    if k is not None:
        check_tensor(OP, "k", k)
        check_float(OP, "k", k)
        if k.dim() != 4 or k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
            raise ValueError(f"trifuse.{OP}: k must have shape ({b}, heads, {s}, {d}) like q "
                             f"{tuple(q.shape)}, got {tuple(k.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(OP, name, t)
        check_float(OP, name, t)
        # One head, or one per head when q and k have as many (no sets: shapes may be SymInts).
        ok_heads = t.dim() == 4 and (t.shape[1] == 1 or (
            t.shape[1] == q.shape[1] and (k is None or t.shape[1] == k.shape[1])))
        # the interleaved conventions take one entry per pair too (DeepSeek's `cos[..., : D // 2]`,
        # a complex table's real and imaginary parts)
        ok_width = t.dim() == 4 and (t.shape[3] == d or (interleaved and t.shape[3] == d // 2))
        if not (ok_heads and ok_width and t.shape[0] in (1, b) and t.shape[2] in (1, s)):
            width = f"{d} or {d // 2}" if interleaved else f"{d}"
            raise ValueError(
                f"trifuse.{OP}: {name} must be 4-D and broadcast to q {tuple(q.shape)}"
                + ("" if k is None else f" and k {tuple(k.shape)}")
                + f" as ({b} or 1, 1, {s}, {width}), got shape {tuple(t.shape)}")
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"trifuse.{OP}: sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    check_same_dtype(OP, "q", q, k=k)
    check_same_dtype(OP, "cos", cos, sin=sin)
    check_same_device(OP, "q", q, k=k, cos=cos, sin=sin)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"trifuse.{OP}: dtype must be None or a float torch.dtype, got {dtype!r}")


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see.
# =============================================================================================

Tensor = torch.Tensor
OptTensor = torch.Tensor | None


@torch.library.custom_op("trifuse::rotary_embedding", mutates_args=())
def _rotary_embedding_op(q: Tensor, k: OptTensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                         halves_out: bool = False, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(q_embed, k_embed); k_embed is empty (0,) when k is None."""
    _check_inputs(q, k, cos, sin, interleaved or halves_out, dtype)
    q_embed, k_embed = rotary_embedding_fwd(q, k, cos, sin, interleaved, halves_out, dtype)
    return q_embed, q.new_empty(0) if k_embed is None else k_embed


@torch.library.custom_op("trifuse::rotary_embedding_backward", mutates_args=())
def _rotary_embedding_backward_op(dq: Tensor, dk: OptTensor, cos: Tensor, sin: Tensor, dtype: torch.dtype,
                                  q_bshd: bool, k_bshd: bool, interleaved: bool = False, halves_out: bool = False
                                  ) -> tuple[Tensor, Tensor]:
    """(dq, dk) in `dtype` from the gradients of q_embed and k_embed, in transposed (B, S, H, D)
    storage where the flags say; dk is empty (0,) when dk is None."""
    dq, dk_out = rotary_embedding_bwd(dq, dk, cos, sin, dtype, q_bshd, k_bshd, interleaved, halves_out)
    return dq, dq.new_empty(0, dtype=dtype) if dk_out is None else dk_out


@_rotary_embedding_op.register_fake
def _(q, k, cos, sin, interleaved=False, halves_out=False, dtype=None):
    _check_inputs(q, k, cos, sin, interleaved or halves_out, dtype)
    dtype = dtype or out_dtype(q, cos)
    return _empty(q, False, dtype), q.new_empty(0) if k is None else _empty(k, False, dtype)


@_rotary_embedding_backward_op.register_fake
def _(dq, dk, cos, sin, dtype, q_bshd, k_bshd, interleaved=False, halves_out=False):
    return _empty(dq, q_bshd, dtype), dq.new_empty(0, dtype=dtype) if dk is None else _empty(dk, k_bshd, dtype)


def _cos_sin_need_grad(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return cos.requires_grad or sin.requires_grad


def _setup(ctx, inputs, output):
    q, k, cos, sin, *rest = inputs
    ctx.interleaved = bool(rest[0]) if rest else False
    ctx.halves_out = bool(rest[1]) if len(rest) > 1 else False
    ctx.has_k = k is not None
    ctx.bshd = (is_bshd(q), is_bshd(k))
    ctx.dtype = q.dtype
    # q and k only when cos or sin train: the rotation's own backward needs just cos and sin.
    ctx.save_for_backward(cos, sin, *((q, k) if _cos_sin_need_grad(cos, sin) else ()))


# Differentiable again under create_graph=True by the eager path's formula (defined below with it;
# the registered op's k_embed without a k is an empty stand-in, whose gradient is no gradient).
@single_backward(twice=lambda ctx, dq, dk: _rotary_twice(ctx, dq, dk if ctx.has_k else None),
                 op="rotary_embedding")
def _backward(ctx, dq_embed, dk_embed):
    cos, sin, *qk = ctx.saved_tensors
    dk_in = dk_embed if ctx.has_k else None
    dq, dk = torch.ops.trifuse.rotary_embedding_backward(dq_embed, dk_in, cos, sin, ctx.dtype, *ctx.bshd,
                                                         ctx.interleaved, ctx.halves_out)
    dcos = dsin = None
    if qk:
        dcos, dsin = _cos_sin_grads(dq_embed, dk_in, *qk, cos, sin, ctx.interleaved, ctx.halves_out)
    return dq, dk if ctx.has_k else None, dcos, dsin, None, None, None


torch.library.register_autograd("trifuse::rotary_embedding", _backward, setup_context=_setup)


# =============================================================================================
# Eager fast path: a thin autograd.Function straight over the launchers (see DESIGN.md "Host
# overhead"). Same launchers, same bits as the registered op.
# =============================================================================================


def _rotary_twice(ctx, dq_embed, dk_embed):
    """The backward in PyTorch ops, differentiable again (create_graph=True): the rotation's
    transpose of the incoming gradients, and cos's and sin's gradients from the saved q and k."""
    cos, sin, *qk = ctx.saved_tensors
    dq, dk = _rotary_torch(dq_embed, dk_embed, cos, sin, True, ctx.dtype, *ctx.bshd, ctx.interleaved,
                           ctx.halves_out)
    dcos = dsin = None
    if qk:
        dcos, dsin = _cos_sin_grads(dq_embed, dk_embed, *qk, cos, sin, ctx.interleaved, ctx.halves_out)
    return dq, dk, dcos, dsin, None, None, None


class _RotaryEmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, interleaved, halves_out, dtype):
        ctx.save_for_backward(cos, sin, *((q, k) if _cos_sin_need_grad(cos, sin) else ()))
        ctx.bshd = (is_bshd(q), is_bshd(k))
        ctx.dtype = q.dtype
        ctx.interleaved, ctx.halves_out = interleaved, halves_out
        return rotary_embedding_fwd(q, k, cos, sin, interleaved, halves_out, dtype)

    @staticmethod
    @single_backward(twice=_rotary_twice)
    def backward(ctx, dq_embed, dk_embed):
        cos, sin, *qk = ctx.saved_tensors
        with profiled("trifuse::rotary_embedding_backward"):
            dq, dk = rotary_embedding_bwd(dq_embed, dk_embed, cos, sin, ctx.dtype, *ctx.bshd, ctx.interleaved,
                                          ctx.halves_out)
        dcos = dsin = None
        if qk:
            dcos, dsin = _cos_sin_grads(dq_embed, dk_embed, *qk, cos, sin, ctx.interleaved, ctx.halves_out)
        return dq, dk, dcos, dsin, None, None, None


# =============================================================================================
# Dialect: trifuse's kernel or Hugging Face's formula in PyTorch, whichever is faster for the
# shape, chosen once per (device, dtypes, positions bucket, heads, head_dim, cos batch, grad) on the
# GPU and cached on disk (autotune/dialects.py). Traced calls always see trifuse::rotary_embedding.
# =============================================================================================


def _rotary_key(q, k, cos, sin, interleaved=False, halves_out=False, dtype=None):
    """The dialect key of an eager call; None (the trifuse op decides, and raises on bad input)
    when traced, empty, when the shapes do not fit, or when the outputs are asked in another dtype
    than `q * cos`'s (a cast PyTorch's formula would add a pass for). It runs on every call."""
    if not isinstance(q, torch.Tensor) or not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
        return None
    if dtype is not None and dtype != out_dtype(q, cos):
        return None
    if (k is not None and not isinstance(k, torch.Tensor)) or not isinstance(interleaved, bool) \
            or not isinstance(halves_out, bool):
        return None
    if not eager_fast_path(q, k, cos, sin) or not q.is_floating_point() or q.dim() != 4 or cos.dim() != 4:
        return None
    b, hq, s, d = q.shape
    if b * s * d == 0 or d % 2 or (k is not None and (k.dim() != 4 or k.shape[2] != s)):
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)
                                        or cos.requires_grad or sin.requires_grad)
    # The table's width apart from head_dim: D entries or one per pair (D / 2), which PyTorch's
    # formula widens with an extra pass and trifuse's kernel reads as is.
    return (q.get_device() if q.is_cuda else -1, q.dtype, cos.dtype, pow2_bucket(b * s), hq,
            0 if k is None else k.shape[1], d, cos.shape[-1], cos.shape[0] == 1, grad, interleaved, halves_out)


def _rotary_trifuse(q, k, cos, sin, interleaved=False, halves_out=False, dtype=None):
    _check_inputs(q, k, cos, sin, interleaved or halves_out, dtype)
    interleaved, halves_out = bool(interleaved), bool(halves_out)
    if eager_fast_path(q, k, cos, sin):
        with profiled("trifuse::rotary_embedding"):
            return apply_function(_RotaryEmbeddingFunction, q, k, cos, sin, interleaved, halves_out, dtype)
    q_embed, k_embed = torch.ops.trifuse.rotary_embedding(q, k, cos, sin, interleaved, halves_out, dtype)
    return q_embed, None if k is None else k_embed


def _rotary_hf_formula(q, k, cos, sin, interleaved=False, halves_out=False, dtype=None):
    # trifuse's checks first: the same clear errors whichever candidate runs.
    _check_inputs(q, k, cos, sin, interleaved or halves_out, dtype)
    with profiled("trifuse::rotary_embedding"):
        q_embed, k_embed = rotary_embedding_ref(q, k, cos, sin, interleaved, halves_out, dtype)
        # trifuse returns contiguous (B, H, S, D); the choice must not change the layout.
        return q_embed.contiguous(), None if k_embed is None else k_embed.contiguous()


ROTARY_EMBEDDING = dialects.define(
    "rotary_embedding", _rotary_key, ("device", "dtype", "cos_dtype", "positions", "q_heads", "k_heads",
                                      "head_dim", "table_width", "cos_batch_broadcast", "grad", "interleaved",
                                      "halves_out"),
    reference=rotary_embedding_ref)
ROTARY_EMBEDDING.register(dialects.Candidate("trifuse", _rotary_trifuse))
ROTARY_EMBEDDING.register(dialects.Candidate("torch", _rotary_hf_formula))


# =============================================================================================
# Public API
# =============================================================================================


@outside_device_modes
def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False,
    halves_out: bool = False, dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary position embedding of q and k in one kernel each way:
    `(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`, Hugging Face's
    `apply_rotary_pos_emb` after its `unsqueeze`. rotate_half is the rotate-half convention's
    (GPT-NeoX, Llama: `cat(-x[..., D/2:], x[..., :D/2])`), or with `interleaved=True` the
    interleaved one's (GPT-J, Cohere, GLM, Helium: `stack((-x[..., 1::2], x[..., 0::2]),
    -1).flatten(-2)`, cos and sin then in the interleaved layout).

    Args:
        q: (B, Hq, S, D), D even; any strides with a unit stride along D (read in place).
        k: (B, Hkv, S, D), Hkv may differ from Hq (grouped-query attention); or None to rotate q
            alone.
        cos, sin: (B or 1, 1, S or 1, D) (or a head dim equal to Hq == Hkv), of one float dtype:
            q's, or another (fp32 tables beside 16-bit q and k under autocast).
        interleaved: rotate the pairs (x[2i], x[2i+1]) instead of (x[i], x[i + D/2]); cos and sin
            then D wide in the interleaved layout, or D / 2 wide, one entry per pair (the real
            and imaginary parts of a complex table: `x` times `cos + i sin` as complex numbers).
        halves_out: with interleaved, write the pair i's results to (i, i + D/2): the rotate-half
            convention applied to `pairs_to_halves(x)` (DeepSeek-V2/V3's
            `apply_rotary_pos_emb_interleave`); cos and sin then in the rotate-half layout, D or
            D / 2 (one entry per pair) wide.
        dtype: the outputs' dtype, when not `q * cos`'s: the rotation is computed as `q * cos`
            would be (in fp32 for 16-bit q and k, or fp32 tables) and rounded once to it. A model
            that upcasts q and k, rotates and casts back (`x.float()`, `.type_as(x)`: Cohere, Llama
            4, torchtitan, torchtune) is one pass over q and k this way, not three.

    Returns:
        (q_embed, k_embed), new contiguous (B, H, S, D) tensors in `dtype`, by default the dtype
        PyTorch's `q * cos` has (q's when cos is in it); k_embed is None when k is None. Gradients reach q and k (the backward reads only cos and sin; dq and dk in
        q's and k's layout when those are transposed (B, S, H, D) tensors), and cos and sin
        when they require grad.

    Eager calls run trifuse's kernel or the PyTorch formula, whichever the `rotary_embedding`
    dialect measured faster for this shape on this GPU; elsewhere, and under torch.compile,
    trifuse's.

    Raises:
        TypeError for non-float tensors, k not in q's dtype or sin not in cos's, a dtype that is not
        a float dtype; ValueError for ranks, an odd head_dim,
        k not matching q's batch, positions or head_dim, cos or sin that do not broadcast, or
        tensors on different devices.
    """
    if not isinstance(interleaved, bool):
        raise TypeError(f"trifuse.{OP}: interleaved must be a bool, got {type(interleaved).__name__}")
    if not isinstance(halves_out, bool):
        raise TypeError(f"trifuse.{OP}: halves_out must be a bool, got {type(halves_out).__name__}")
    if halves_out and not interleaved:
        raise ValueError(f"trifuse.{OP}: halves_out=True moves interleaved pairs to halves; it needs interleaved=True")
    return ROTARY_EMBEDDING(q, k, cos, sin, interleaved, halves_out, dtype)
