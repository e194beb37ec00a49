"""Counter-based dropout masks shared by every kernel that drops elements.

An element's keep/drop decision is a pure function of (seed, row, column): Philox-4x32 with the
column and the row as two 32-bit counters, so any tensor up to 2^32 x 2^32 gets independent
numbers without 64-bit arithmetic, and the backward regenerates the forward's mask exactly.
Every kernel that uses it therefore agrees on the mask for the same seed and element.
"""
import triton
import triton.language as tl


@triton.jit
def dropout_keep(seed, row, cols, p):
    """Boolean block: True where the element at (row, cols) is kept with probability 1 - p.
    `row` and `cols` broadcast against each other (a (BLOCK_M, 1) and a (1, BLOCK_N) block)."""
    c0 = (cols + row * 0).to(tl.uint32)  # broadcast both counters to the tile's shape
    c1 = (row + cols * 0).to(tl.uint32)
    zero = c0 * 0
    r0, _, _, _ = tl.random.philox(seed, c0, c1, zero, zero)
    return tl.random.uint_to_uniform_float(r0) >= p
