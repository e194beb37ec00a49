"""The configuration spaces of trifuse's bandwidth-bound kernels, with their pruning rules beside
them: LayerNorm / RMSNorm, the row-wise elementwise kernels (bias + GeLU, dropout + add, gated
activations), rotary embeddings and GroupNorm (attention declares its block-size lists beside its kernels,
in kernels/attention.py; cross-entropy's row kernels keep a fixed plan, kernels/cross_entropy.py
says why).

Each space is a function of the shape (the Tuner passes the key's named entries it declares) and
returns a list of `triton.Config`; entry 0 is the default: what runs with TRIFUSE_AUTOTUNE=0, under
the interpreter, and where no shipped per-GPU default applies. Meta-parameters a kernel does not
take as constexprs (PROGRAMS_PER_SM) are read by its launcher from `config.kwargs`.

A pruning rule `prune(config, limits, **shape) -> str | None` returns why a config cannot run
well on a device (`tuner.DeviceLimits`), before anything is compiled or timed. The estimates:

    registers       fp32 tiles live per thread over 32·num_warps threads; past
                    REGISTER_VALUES_PER_THREAD (fewer at 16 warps, where a thread gets 128
                    registers) the kernel spills
    threads         a block with more threads than elements leaves warps idle
"""
import triton

# fp32 values a thread may keep live without spilling: 255 registers, minus addresses, offsets
# and loop state (about a third, as observed in Triton's attention kernels).
REGISTER_VALUES_PER_THREAD = 168


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1  # plain Python: see kernels/_common.py


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
    1 for wider ones (what kernels/layer_norm.py launched before it was tuned). Rows narrower
    than the smallest tile add one-row tiles. Rows that fit one block add, per tile size, its
    one-warp-per-512 config with PREFETCH: the next tile's s and dy loaded before this tile's row
    sums (the backward moved 1.8 TB/s at 16384 x 1024 on the H200, 2026-11-27, 42% of a copy;
    BERT-large's 48 calls a step took 2.8 ms)."""
    tiles = _tiles(n, (4096, 2048, 8192))
    programs = 2 if _norm_block(n) <= 2048 else 1
    default = (tiles[0], min(16, max(4, tiles[0] // 512)), programs)
    space = [default] + [(t, w, k) for t in tiles for w in (4, 8, 16) for k in (2, 1, 4)
                         if (t, w, k) != default]
    if _norm_block(n) < min(tiles):
        # Rows of up to 1024 also one row a tile, at a fraction of the registers. Compiled for
        # sm_90, BERT-large's residual stream (dropout, an incoming ds, fp32 dresidual) took 236
        # registers a thread at the default's 4 rows of 1024 and 8 warps (one program an SM fits
        # where the plan asks for two), 56 at one row and 4 warps: 8 such programs an SM fit.
        tiles = [*tiles, _norm_block(n)]
        space += [(tiles[-1], w, k) for w, k in ((4, 4), (4, 8), (4, 2), (8, 2), (8, 4))]
    configs = [triton.Config({"TILE": t, "PROGRAMS_PER_SM": k}, num_warps=w) for t, w, k in space]
    if n <= NORM_MAX_BLOCK:
        configs += [triton.Config({"TILE": t, "PROGRAMS_PER_SM": programs, "PREFETCH": True},
                                  num_warps=min(16, max(4, t // 512))) for t in tiles]
    return configs


def prune_rows(config: triton.Config, limits, n: int) -> str | None:
    """Rejects blocks of more threads than the tile has elements (warps would idle)."""
    tile = max(config.kwargs["TILE"], _norm_block(n))
    threads = 32 * config.num_warps
    if threads > tile:
        return f"{threads} threads for {tile} elements"
    return None


# fp32 tiles live at once in the norm kernels' single-block loops: the forward holds s and
# s - mean (y reuses one); the backward xhat, dy and g plus its three tile-shaped accumulators
# (dW, dB, dx_bias), less one the compiler overlaps. A backward program of several rows needs
# more (per-row statistics broadcast over the tile, the row sums): compiled for sm_90, a tile of
# 8 x 1024 spilled at 8 and at 16 warps and 4 x 2048 at 16, while one row of 8192 did not
# (bench/compile_sm90.py --spaces; bench/results/sm90_compile.md). The wide-row loops hold fewer.
NORM_FWD_LIVE_TILES = 2
NORM_BWD_LIVE_TILES = 5
NORM_BWD_MULTI_ROW_LIVE_TILES = 8
NORM_PREFETCH_LIVE_TILES = 2  # the next tile's s and dy, held across this tile's work


def register_values_per_thread(limits, num_warps: int) -> int:
    """fp32 values a thread may keep live: REGISTER_VALUES_PER_THREAD of 255 registers, scaled
    down where the block's threads share the register file more thinly (16 warps get 128)."""
    registers = min(limits.registers_per_thread, limits.registers_per_sm // (32 * num_warps))
    return REGISTER_VALUES_PER_THREAD * registers // 255


# Rows wider than NORM_MAX_BLOCK are walked in chunks of this many elements, in both passes:
# chunks of 16384 spilled compiled for sm_90 (the backward at 16 warps, 8 bytes; the forward at 8
# warps with Triton 3.6, 8 bytes), 8192 do not. The chunk does not change the bytes moved.
NORM_WIDE_CHUNK = 8192


def _prune_norm(config: triton.Config, limits, n: int, live_tiles: int) -> str | None:
    reason = prune_rows(config, limits, n)
    if reason is not None:
        return reason
    tile = NORM_WIDE_CHUNK if n > NORM_MAX_BLOCK else max(config.kwargs["TILE"], _norm_block(n))
    per_thread = live_tiles * tile // (32 * config.num_warps)
    budget = register_values_per_thread(limits, config.num_warps)
    if per_thread > budget:
        return f"~{per_thread} fp32 values per thread would spill registers (~{budget} fit at {config.num_warps} warps)"
    return None


def prune_norm_fwd(config: triton.Config, limits, n: int) -> str | None:
    """prune_rows, and the forward's register estimate (module docstring)."""
    return _prune_norm(config, limits, n, NORM_FWD_LIVE_TILES)


def prune_norm_bwd(config: triton.Config, limits, n: int) -> str | None:
    """prune_rows, and the backward's register estimate (module docstring; a prefetch holds
    the next tile's s and dy besides)."""
    rows = config.kwargs["TILE"] // _norm_block(n) if n <= NORM_MAX_BLOCK else 1
    live = NORM_BWD_MULTI_ROW_LIVE_TILES if rows > 1 else NORM_BWD_LIVE_TILES
    if config.kwargs.get("PREFETCH"):
        live += NORM_PREFETCH_LIVE_TILES
    return _prune_norm(config, limits, n, live)


# ---------------------------------------------------------------------------------------------
# Row-wise elementwise kernels (bias + GeLU, dropout + add, gated activations; kernels/_tiles.py):
# a program takes a tile of about TILE elements, BLOCK_M rows x BLOCK_N columns. Passes without a
# reduction take one tile per program; the backward passes that also sum over rows (dbias) run
# PROGRAMS_PER_SM x SMs programs, each walking its range of rows tile by tile, and with PREFETCH
# load the next tile before working on this one. Why that is worth a knob: on the H200
# (2026-11-27) those backward passes moved 2.0-2.6 TB/s of the 4.26 TB/s a copy reaches (BERT-
# large's bias + GeLU backward: 92 us a call), the one-tile forward passes 3.3-3.9 TB/s. At the
# default, 16 warps an SM each have one tile's loads in flight (32 bytes a thread per input), near
# what Little's law asks of the memory latency, and the loop's arithmetic leaves gaps between
# them; a prefetch doubles the bytes in flight, as do more programs an SM where their registers
# let them all be resident. Not yet timed on a GPU (bench/tune_rowwise.py will say).
# Entry 0 of each space is the plan the launchers ran before they were tuned.
# ---------------------------------------------------------------------------------------------

# fp32 tiles live a thread in the walking backward passes: the accumulator, the two inputs and
# the gradient; a prefetch holds the next tile's two inputs as well. Registers beside them
# (addresses, offsets, loop state): about ROWWISE_BASE_REGISTERS. An upper estimate: compiled for
# sm_90 at the e2e widths (bench/compile_sm90.py --spaces), bias + GeLU's backward took 72
# registers at the default where it says 88, 96 with a prefetch where it says 120; none spilled.
ROWWISE_BWD_LIVE_TILES = 4
ROWWISE_PREFETCH_LIVE_TILES = 2
ROWWISE_BASE_REGISTERS = 24


def rowwise_fwd() -> list[triton.Config]:
    """One tile per program: (TILE, warps). Default 4096 elements with 8 warps, 16 a thread."""
    space = ((4096, 8), (8192, 8), (2048, 4), (4096, 4), (8192, 16))
    return [triton.Config({"TILE": t}, num_warps=w) for t, w in space]


def rowwise_bwd(bias: bool) -> list[triton.Config]:
    """The backward passes that sum dbias over rows (`bias`): (TILE, warps, PROGRAMS_PER_SM,
    PREFETCH). Default 2048-element tiles, 4 warps, 4 programs an SM, no prefetch. Without a
    bias nothing is summed and each program takes one tile: the one-tile space, from 2048 x 4."""
    if not bias:
        space = ((2048, 4), (4096, 8), (8192, 8), (4096, 4), (8192, 16))
        return [triton.Config({"TILE": t, "PROGRAMS_PER_SM": 4, "PREFETCH": False}, num_warps=w)
                for t, w in space]
    space = ((2048, 4, 4, False), (2048, 4, 4, True), (2048, 8, 2, True), (4096, 8, 2, True),
             (2048, 8, 4, False), (1024, 4, 8, False))
    return [triton.Config({"TILE": t, "PROGRAMS_PER_SM": k, "PREFETCH": f}, num_warps=w)
            for t, w, k, f in space]


def prune_rowwise_bwd(config: triton.Config, limits, bias: bool) -> str | None:
    """Rejects a summing backward's config whose programs would not all be resident at once
    (the one wave of PROGRAMS_PER_SM per SM its plan assumes), by the register estimate above."""
    if not bias:
        return None
    warps, programs = config.num_warps, config.kwargs["PROGRAMS_PER_SM"]
    live = ROWWISE_BWD_LIVE_TILES + (ROWWISE_PREFETCH_LIVE_TILES if config.kwargs["PREFETCH"] else 0)
    registers = ROWWISE_BASE_REGISTERS + live * config.kwargs["TILE"] // (32 * warps)
    if programs * 32 * warps * registers > limits.registers_per_sm:
        return (f"{programs} programs of {warps} warps at ~{registers} registers a thread would not all be "
                f"resident on an SM ({limits.registers_per_sm} registers)")
    return None


# ---------------------------------------------------------------------------------------------
# Rotary embedding (kernels/rotary.py): a program rotates BLOCK_S positions x both halves of one
# head, TILE_HALF elements a half (BLOCK_S = TILE_HALF / the half's power-of-two width), with
# warps that keep the full tile's elements a thread. Entry 0 is the plan it ran before it was
# tuned: 2048 with 8 warps, 16 elements of each half a thread. No pruning rule: no config of the
# space gives a thread more than 16 elements a half (4 x 16 values: the two halves, cos, sin).
# ---------------------------------------------------------------------------------------------


def rotary() -> list[triton.Config]:
    """(TILE_HALF, warps)."""
    space = ((2048, 8), (4096, 8), (1024, 4), (2048, 4), (4096, 16))
    return [triton.Config({"TILE_HALF": t}, num_warps=w) for t, w in space]


# ---------------------------------------------------------------------------------------------
# GroupNorm (kernels/group_norm.py): a program walks one chunk of a row (or, in the backward's
# sums, of one channel's plane) BLOCK values a step; the rows are cut into chunks so that about
# WAVES programs an SM run where rows are few and wide (a VAE's 1M-value rows), each of at least
# MIN_BLOCKS blocks. Entry 0 is the plan it ran before it was tuned: blocks of 1024 values, 4
# warps (8 values a thread), 4 programs an SM wanted. No pruning rule: at most 16 fp32 values a
# thread a tile, and the kernels hold at most five tiles (the forward's statistics: a count, a
# mean and squared deviations per lane, the value and its deviation); compiled for sm_90, every
# config took 31-74 registers a thread, none spilled (bench/compile_sm90.py --spaces).
# Not yet timed on a GPU (bench/tune_rowwise.py will say).
# ---------------------------------------------------------------------------------------------


def group_norm() -> list[triton.Config]:
    """(BLOCK, warps, WAVES), MIN_BLOCKS 4: the forward's two launches and the backward's two
    take one config each (tuned apart)."""
    space = ((1024, 4, 4), (2048, 8, 4), (4096, 8, 2), (1024, 4, 8), (2048, 4, 8), (512, 4, 8))
    return [triton.Config({"BLOCK": b, "WAVES": w, "MIN_BLOCKS": 4}, num_warps=nw) for b, nw, w in space]


# ---------------------------------------------------------------------------------------------
# LayerNorm / RMSNorm over a channels-first map's channels (kernels/channel_norm.py): a tile of
# TILE values, positions by channels (all of them when they fit with 16 positions, else blocks of
# channels by 64 positions); the backward runs PROGRAMS_PER_SM x SMs programs, each with a row of
# fp32 partial sums for dW / dB. Entry 0 as the row norms' (forward tiles of 8192 values with 8
# warps, backward tiles of 4096 and 2 programs an SM). No pruning rule: at 32 values a thread a
# tile, the forward holds three tiles, the backward seven (its two accumulators) at 16. Not yet
# timed on a GPU.
# ---------------------------------------------------------------------------------------------


def channel_norm_fwd() -> list[triton.Config]:
    """(TILE, warps)."""
    space = ((8192, 8), (4096, 8), (4096, 4), (2048, 4), (16384, 16))
    return [triton.Config({"TILE": t}, num_warps=w) for t, w in space]


def channel_norm_bwd() -> list[triton.Config]:
    """(TILE, warps, PROGRAMS_PER_SM)."""
    space = ((4096, 8, 2), (2048, 4, 4), (4096, 8, 1), (2048, 8, 2), (8192, 16, 1), (1024, 4, 8))
    return [triton.Config({"TILE": t, "PROGRAMS_PER_SM": p}, num_warps=w) for t, w, p in space]
