"""Counter-based dropout masks shared by every kernel that drops elements.

An element's keep/drop decision is a pure function of (seed, row, column): Philox-4x32 with the
column (over four) and the row as two 32-bit counters, so any tensor up to 2^32 x 2^32 gets
independent numbers without 64-bit arithmetic, and the backward regenerates the forward's mask
exactly. Every kernel that uses it therefore agrees on the mask for the same seed and element.
"""
import triton
import triton.language as tl


@triton.jit
def dropout_keep_quads(seed, row, cols, p):
    """Boolean block: True where the element at (row, col) is kept, with probability 1 - p,
    drawing four decisions from each Philox call.

    Element (row, col) is kept when output number col % 4 of Philox-4x32-10 (key seed, counter
    (col // 4, row, 0, 0)), shifted right by one, is at least p * 2^31: probability 1 - p, exact
    to 2^-31, and never kept for p = 1.

    Why four a call: a Philox call is about 100 integer instructions. One call per element makes
    a bandwidth-bound kernel compute-bound on H100 (dropout + add forward and backward would top
    out near 1.6 TB/s), and made attention's forward with dropout 4.5x slower than without it on
    an H200 (GPT-2 medium's 8x16x1024x64: 0.32 against 0.07 ms), its backward drawing twice more.

    `row` and `cols` broadcast against each other; along the block's last axis `cols` must run
    contiguously from a multiple of 4 (every block of tl.arange offsets at a block-aligned start
    does), so that each aligned group of four columns shares one call. A last axis whose length
    is not a multiple of 4 takes one call per element, with the same result.
    """
    thr = tl.cast(p * 2147483648.0, tl.uint32)
    c1 = (row + cols * 0).to(tl.uint32)  # broadcast both counters to the block's shape
    c0 = (cols + row * 0).to(tl.uint32)
    if c0.shape[-1] % 4 == 0:
        quads: tl.constexpr = c0.numel // 4
        # The first element of each aligned group of four carries the group's counters.
        g, _ = tl.split(tl.reshape(c0 >> 2, [quads, 2, 2]))
        g, _ = tl.split(g)
        r, _ = tl.split(tl.reshape(c1, [quads, 2, 2]))
        r, _ = tl.split(r)
        zero = g * 0
        u0, u1, u2, u3 = tl.random.philox(seed, g, r, zero, zero)
        # join(join(u0, u2), join(u1, u3)) holds u[2i + j] at [i, j]: column 4q + k gets u_k.
        u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), c0.shape)
    else:
        zero = c0 * 0
        u0, u1, u2, u3 = tl.random.philox(seed, c0 >> 2, c1, zero, zero)
        k = c0 & 3
        u = tl.where(k == 0, u0, tl.where(k == 1, u1, tl.where(k == 2, u2, u3)))
    return (u >> 1) >= thr
