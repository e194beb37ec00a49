"""Configuration spaces, one function per kernel family, with their pruning rules beside them.

Each space is a function of the shape (the Tuner passes the key's named entries it declares) and
returns a list of `triton.Config`; entry 0 is the default: what runs with TRIFUSE_AUTOTUNE=0, under
the interpreter, and where no shipped per-GPU default applies. Meta-parameters a kernel does not
take as constexprs (PROGRAMS_PER_SM) are read by its launcher from `config.kwargs`.

A pruning rule `prune(config, limits, **shape) -> str | None` returns why a config cannot run
well on a device (`tuner.DeviceLimits`), before anything is compiled or timed. The estimates:

    shared memory   the tiles a stage keeps in flight: Triton's pipeliner buffers each loaded tile
                    once per stage, so K/V-like operands cost stages x tile bytes
    registers       fp32 values live per thread: accumulator + score tile over 32·num_warps
                    threads; past REGISTER_VALUES_PER_THREAD the kernel spills
    threads         a block with more threads than elements leaves warps idle
"""
import triton

# fp32 values a thread may keep live without spilling: 255 registers, minus addresses, offsets
# and loop state (about a third, as observed in Triton's attention kernels).
REGISTER_VALUES_PER_THREAD = 168


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1  # plain Python: see kernels/_common.py


def _warps_for_width(block: int) -> int:
    """One warp per 256 elements of a row block, 1 to 16: the norm kernels' heuristic."""
    return min(max(block // 256, 1), 16)


# ---------------------------------------------------------------------------------------------
# Row-wise reductions: LayerNorm / RMSNorm. A program owns a tile of TILE elements: TILE // BLOCK_N
# rows when a row fits one block (BLOCK_N = next power of two of the width, at most 16384), one
# row otherwise. The backward runs PROGRAMS_PER_SM x SMs programs, each with a row of fp32
# partial sums for dW / dB. Spaces and defaults from the H100 sweep (bench/tune_layer_norm.py).
# ---------------------------------------------------------------------------------------------

NORM_MAX_BLOCK = 16384


def _norm_block(n: int) -> int:
    return min(_pow2(n), NORM_MAX_BLOCK)


def _tiles(n: int, tiles: tuple[int, ...]) -> list[int]:
    """The distinct effective tiles: a tile below one row block runs one row, like the row's own."""
    out = []
    for t in tiles:
        t = max(t, _norm_block(n))
        if t not in out:
            out.append(t)
    return out


def norm_fwd(n: int) -> list[triton.Config]:
    """Tile size and warps. Default: 8192-element tiles with 8 warps (kernels/layer_norm.py)."""
    tiles = _tiles(n, (8192, 16384, 4096, 2048))
    space = [(tiles[0], 8)] + [(t, w) for t in tiles for w in (8, 16, 4) if (t, w) != (tiles[0], 8)]
    return [triton.Config({"TILE": t}, num_warps=w) for t, w in space]


def norm_bwd(n: int) -> list[triton.Config]:
    """Tile size, warps and programs per SM. Default: 4096-element tiles, one warp per 512
    elements of the tile (4 to 16), 2 programs per SM for row blocks up to 2048 elements and
    1 for wider ones (what kernels/layer_norm.py launched before it was tuned)."""
    tiles = _tiles(n, (4096, 2048, 8192))
    default = (tiles[0], min(16, max(4, tiles[0] // 512)), 2 if _norm_block(n) <= 2048 else 1)
    space = [default] + [(t, w, k) for t in tiles for w in (4, 8, 16) for k in (2, 1, 4)
                         if (t, w, k) != default]
    return [triton.Config({"TILE": t, "PROGRAMS_PER_SM": k}, num_warps=w) for t, w, k in space]


def prune_rows(config: triton.Config, limits, n: int) -> str | None:
    """Rejects blocks of more threads than the tile has elements (warps would idle)."""
    tile = max(config.kwargs["TILE"], _norm_block(n))
    threads = 32 * config.num_warps
    if threads > tile:
        return f"{threads} threads for {tile} elements"
    return None


# fp32 tiles live at once in the norm kernels' single-block loops: the forward holds s and
# s - mean (y reuses one); the backward xhat, dy and g plus its three tile-shaped accumulators
# (dW, dB, dx_bias), less one the compiler overlaps. The wide-row loops hold fewer.
NORM_FWD_LIVE_TILES = 2
NORM_BWD_LIVE_TILES = 5


def _prune_norm(config: triton.Config, limits, n: int, live_tiles: int) -> str | None:
    reason = prune_rows(config, limits, n)
    if reason is not None:
        return reason
    tile = max(config.kwargs["TILE"], _norm_block(n))
    per_thread = live_tiles * tile // (32 * config.num_warps)
    if per_thread > REGISTER_VALUES_PER_THREAD:
        return f"~{per_thread} fp32 values per thread would spill registers"
    return None


def prune_norm_fwd(config: triton.Config, limits, n: int) -> str | None:
    """prune_rows, and the forward's register estimate (module docstring)."""
    return _prune_norm(config, limits, n, NORM_FWD_LIVE_TILES)


def prune_norm_bwd(config: triton.Config, limits, n: int) -> str | None:
    """prune_rows, and the backward's register estimate (module docstring)."""
    return _prune_norm(config, limits, n, NORM_BWD_LIVE_TILES)


# ---------------------------------------------------------------------------------------------
# Elementwise (bias + GeLU, dropout + add): one BLOCK_SIZE chunk per program.
# ---------------------------------------------------------------------------------------------


def elementwise(numel: int) -> list[triton.Config]:
    sizes = [b for b in (1024, 2048, 4096, 8192) if b <= max(_pow2(numel), 1024)]
    out = [triton.Config({"BLOCK_SIZE": 1024}, num_warps=4)]
    out += [triton.Config({"BLOCK_SIZE": b}, num_warps=w) for b in sizes for w in (4, 8)
            if (b, w) != (1024, 4)]
    return out


def prune_elementwise(config: triton.Config, limits) -> str | None:
    per_thread = config.kwargs["BLOCK_SIZE"] // (32 * config.num_warps)
    if per_thread > 64:
        return f"{per_thread} elements per thread"
    return None


# ---------------------------------------------------------------------------------------------
# Attention (FlashAttention-2 style): BLOCK_M query rows per program, BLOCK_N keys per step.
# ---------------------------------------------------------------------------------------------


def attention_fwd(head_dim: int) -> list[triton.Config]:
    """Default 128x64 with 8 warps from (padded) head dim 128 up, 4 below, 3 stages: Triton's
    tutorial choice on Hopper. The rest of the space is the tutorial's, ordered by likelihood."""
    default_warps = 8 if _pow2(head_dim) >= 128 else 4
    space = [(128, 64, default_warps, 3)]
    for bm in (128, 64):
        for bn in (64, 128, 32):
            for warps in (4, 8):
                for stages in (3, 4, 2):
                    if (bm, bn, warps, stages) != space[0]:
                        space.append((bm, bn, warps, stages))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in space]


def attention_bwd(head_dim: int) -> list[triton.Config]:
    """BLOCK_M x BLOCK_N tiles of the dK/dV pass (BLOCK_N keys held, BLOCK_M queries streamed);
    the dQ pass uses the transpose. Default: Triton's tutorial (32 x 128, 4 warps, 5 stages), with
    fewer stages past head dim 64 where its buffers no longer fit."""
    default = (32, 128, 4, 5 if head_dim <= 64 else 3)
    space = [default]
    for bm, bn in ((32, 128), (64, 128), (64, 64), (32, 64), (16, 64)):
        for warps in (4, 8):
            for stages in (2, 3, 4, 5):
                if (bm, bn, warps, stages) != default:
                    space.append((bm, bn, warps, stages))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in space]


def attention_smem_bytes(config: triton.Config, head_dim: int, dtype_bytes: int) -> int:
    """The resident BLOCK_M x D tile plus K and V tiles (BLOCK_N x D) once per stage."""
    d = _pow2(head_dim)
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    return (bm * d + max(config.num_stages - 1, 1) * 2 * bn * d) * dtype_bytes


def prune_attention(config: triton.Config, limits, head_dim: int, dtype) -> str | None:
    """Shared memory and register estimates (module docstring) for both attention passes."""
    dtype_bytes = dtype.itemsize if hasattr(dtype, "itemsize") else 2
    smem = attention_smem_bytes(config, head_dim, dtype_bytes)
    if smem > limits.shared_memory:
        return f"needs ~{smem // 1024} KiB shared memory, the device has {limits.shared_memory // 1024} KiB"
    d = _pow2(head_dim)
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    per_thread = (bm * d + bm * bn) // (32 * config.num_warps)
    if per_thread > REGISTER_VALUES_PER_THREAD:
        return f"~{per_thread} fp32 values per thread would spill registers"
    return None


# ---------------------------------------------------------------------------------------------
# Cross-entropy (and the chunked linear + cross-entropy): a row of V logits per program, walked
# in BLOCK_V chunks (online logsumexp).
# ---------------------------------------------------------------------------------------------


def cross_entropy(vocab: int) -> list[triton.Config]:
    top = _pow2(vocab)
    blocks = [b for b in (4096, 8192, 16384, 2048) if b <= max(top, 2048)]
    default = blocks[0] if top >= 4096 else top
    out = [triton.Config({"BLOCK_V": default}, num_warps=8)]
    out += [triton.Config({"BLOCK_V": b}, num_warps=w) for b in blocks for w in (8, 16, 4)
            if (b, w) != (default, 8)]
    return out


def prune_cross_entropy(config: triton.Config, limits) -> str | None:
    per_thread = config.kwargs["BLOCK_V"] // (32 * config.num_warps)
    if per_thread > 128:
        return f"{per_thread} fp32 values per thread would spill registers"
    return None


def _ordered(default: int, others) -> list[int]:
    """`default` first, then the other values once each, in order."""
    out = [default]
    for v in others:
        if v not in out:
            out.append(v)
    return out
