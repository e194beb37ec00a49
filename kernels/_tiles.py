"""Launch plans for the row-wise elementwise kernels (bias + GeLU, dropout + add).

Those kernels see their input as M rows of N contiguous features (any row stride) and work on
2-D tiles of BLOCK_M rows x BLOCK_N columns: a few thousand elements per program, so each thread
moves 16-byte vectors and has several in flight, whatever the width. Their backward passes also
reduce over rows (dbias); there each program walks a contiguous range of row tiles for one
column tile and writes one fp32 partial row, and the partial rows are summed afterwards in a
fixed order (deterministic, no atomics).

Plans are cached per shape: the launchers pay a dictionary lookup, not this arithmetic.
"""
import functools
import math

from ._common import next_power_of_2

# Elements per tile, 16 per thread (two 16-byte vectors of bf16 per tensor): fewer starve H100's
# memory system of requests in flight; more add registers without adding bandwidth.
TILE_ELEMENTS = 4096  # 8 warps; one tile per program, as many programs as tiles
# Backward passes that reduce over rows loop over row tiles in a fixed number of programs. They
# take smaller programs (4 warps) and PROGRAMS_PER_SM of them per SM, so that every program is
# resident at once (one wave, no tail) at up to 128 registers a thread, while 16 warps per SM
# keep enough loads in flight; the fp32 partial rows stay under 1% of the traffic.
REDUCE_TILE_ELEMENTS = 2048
PROGRAMS_PER_SM = 4
MAX_BLOCK_N = 1024
MIN_BLOCK_N = 128


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python: from the host, Triton 3.9's `triton.cdiv` (a
    ConstexprFunction) costs about 2 us a call, a sizeable share of a launcher's budget."""
    return -(-a // b)


@functools.lru_cache(maxsize=1024)
def tile_2d(m: int, n: int, tile_elements: int = TILE_ELEMENTS) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for an (m, n) elementwise pass.

    BLOCK_N is the widest power of two up to MAX_BLOCK_N whose padding of n is within 2% of the
    least padding any candidate gives (n = 768 takes 256, not 1024 with a quarter masked off);
    BLOCK_M fills the tile up to `tile_elements` without passing the number of rows.
    """
    top = min(MAX_BLOCK_N, next_power_of_2(n))
    candidates = []
    b = top
    while b >= min(MIN_BLOCK_N, top):
        candidates.append(b)
        b //= 2
    least = min(math.ceil(n / b) * b for b in candidates)
    block_n = next(b for b in candidates if math.ceil(n / b) * b <= least * 1.02)
    block_m = min(max(tile_elements // block_n, 1), next_power_of_2(m))
    num_warps = min(max(block_m * block_n // 512, 1), 8)
    return block_m, block_n, num_warps


@functools.lru_cache(maxsize=1024)
def row_groups(m: int, block_m: int, col_tiles: int, sms: int) -> tuple[int, int]:
    """(groups, rows_per_group) for a backward that reduces over rows: each of groups x
    col_tiles programs walks rows_per_group rows (a multiple of block_m) of one column tile."""
    row_tiles = max(math.ceil(m / block_m), 1)
    groups = min(max(math.ceil(PROGRAMS_PER_SM * sms / col_tiles), 1), row_tiles)
    tiles_per_group = math.ceil(row_tiles / groups)
    return math.ceil(row_tiles / tiles_per_group), tiles_per_group * block_m
