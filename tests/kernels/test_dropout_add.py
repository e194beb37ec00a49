"""bias + dropout + residual add against the float64 oracle, its mask and its statistics.

The kernel's mask is recovered from its output (inputs are built so that every kept element
moves y away from the residual by at least 0.5) and handed to `dropout_add_ref`, so outputs and
gradients are compared exactly as for a deterministic op. On CPU these run the real Triton
kernels in the interpreter; on a GPU the same tests run natively and add bf16.
"""
import math

import numpy as np
import pytest
import torch
import trifuse
import triton
import triton.language as tl
from _device import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close
from trifuse.kernels import dropout_add as da_mod
from trifuse.kernels._random import dropout_keep_quads
from trifuse.kernels.dropout_add import dropout_add_ref

SHAPES = [(1, 1), (3, 7), (4, 100), (2, 129), (5, 1000), (3, 2500), (0, 32), (2, 3, 50), (2, 2, 3, 17), (300, 130)]
P = 0.3


def _ids(shape):
    return "x".join(map(str, shape))


def make(shape, dtype, bias=True, residual_dtype=None):
    """x, residual, bias with |x + bias| >= 0.5 everywhere, so the mask reads off the output."""
    n = shape[-1]
    b = torch.randn(n, device=DEVICE, dtype=dtype, requires_grad=True) if bias else None
    z = torch.randn(shape, device=DEVICE, dtype=torch.float64)
    z = torch.sign(z) * (0.5 + z.abs())
    x = (z - (b.detach().double() if bias else 0.0)).to(dtype)
    if bias:  # rounding x may pull x + b under 0.5 by an ulp: keep a margin
        x = torch.where((x.double() + b.detach().double()).abs() < 0.4, torch.ones_like(x), x)
    r = torch.randn(shape, device=DEVICE, dtype=residual_dtype or dtype, requires_grad=True)
    return x.requires_grad_(), r, b


def recover_mask(y, r):
    return y != r.to(y.dtype)


def upcast(*ts):
    return [None if t is None else t.detach().double().requires_grad_() for t in ts]


def lowp(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def check_fwd_bwd(x, r, b, p=P, dy=None):
    """y and every gradient against float64 given the kernel's mask; returns the mask."""
    y = trifuse.ops.dropout_add(x, r, p, bias=b)
    assert y.shape == x.shape and y.dtype == torch.promote_types(x.dtype, r.dtype)
    mask = recover_mask(y, r)
    x64, r64, b64 = upcast(x, r, b)
    xl, rl, bl = lowp(x, r, b)
    y64 = dropout_add_ref(x64, r64, p, bias=b64, dropout_mask=mask)
    ylp = dropout_add_ref(xl, rl, p, bias=bl, dropout_mask=mask)
    assert_close("y", y, y64, ylp)
    if x.numel() == 0:
        return mask
    dy = torch.randn_like(y) if dy is None else dy
    inputs = [t for t in (x, r, b) if t is not None]
    g = torch.autograd.grad(y, inputs, dy)
    g64 = torch.autograd.grad(y64, [t for t in (x64, r64, b64) if t is not None], dy.double())
    glp = torch.autograd.grad(ylp, [t for t in (xl, rl, bl) if t is not None], dy.to(ylp.dtype))
    for name, a, a64, alp, t in zip(("dx", "dresidual", "dbias"), g, g64, glp, inputs):
        assert a.dtype == t.dtype and a.shape == t.shape
        assert_close(name, a, a64, alp)
    # The backward regenerated the forward's mask: dx is zero exactly where the forward dropped.
    assert torch.equal(g[0] != 0, mask & (dy != 0))
    return mask


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, shape, bias):
    check_fwd_bwd(*make(shape, dtype, bias))


def test_mixed_dtypes_promote_like_pytorch():
    x, r, b = make((6, 40), torch.float16, residual_dtype=torch.float32)
    check_fwd_bwd(x, r, b)


def test_half_x_gradient_comes_from_the_kernel_in_its_dtype(monkeypatch):
    """x in fp16 beside an fp32 residual (autocast's residual stream): the kernel writes dx in
    fp16 itself, no cast pass after it."""
    dtypes = []
    bwd = da_mod.dropout_add_bwd

    def spy(*args, **kwargs):
        out = bwd(*args, **kwargs)
        dtypes.append(out[0].dtype)
        return out

    monkeypatch.setattr(da_mod, "dropout_add_bwd", spy)
    x, r, b = make((6, 40), torch.float16, residual_dtype=torch.float32)
    check_fwd_bwd(x, r, b)
    assert dtypes == [torch.float16]


def test_strided_inputs_and_gradients():
    x, _, b = make((6, 150), torch.float32)
    xs = x.detach()[:, 10:110].requires_grad_()  # row stride 150, read in place
    rs = torch.randn(100, 6, device=DEVICE).t().requires_grad_()  # transposed: copied
    bs = b.detach()[10:110].repeat_interleave(2)[::2].requires_grad_()  # the same bias, stride 2
    assert bs.stride(0) == 2
    check_fwd_bwd(xs, rs, bs, dy=torch.randn(100, 6, device=DEVICE).t())


# ---------------------------------------------------------------------------------------------
# The mask: statistics, seeds, the documented Philox stream
# ---------------------------------------------------------------------------------------------


def _within(observed, expected, sigma, k=5.0):
    assert abs(observed - expected) <= k * sigma, f"{observed} vs {expected} +- {k} x {sigma}"


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_and_mean_within_binomial_bounds(p):
    """On 2^18 elements: the kept fraction overall, in each column class mod 4 (the four
    outputs of one Philox call), and of adjacent pairs (independence) are within 5 sigma; the
    mean is preserved (each kept one is scaled by 1 / (1 - p))."""
    m, n = 256, 1024
    ones = torch.ones(m, n, device=DEVICE)
    y = trifuse.ops.dropout_add(ones, torch.zeros_like(ones), p)
    keep = y != 0
    q, count = 1.0 - p, m * n
    _within(keep.double().mean().item(), q, math.sqrt(p * q / count))
    for k in range(4):
        _within(keep[:, k::4].double().mean().item(), q, math.sqrt(p * q / (count / 4)))
    pairs = keep[:, 0::2] & keep[:, 1::2]
    _within(pairs.double().mean().item(), q * q, math.sqrt(q * q * (1 - q * q) / (count / 2)))
    _within(y.double().mean().item(), 1.0, math.sqrt(p / q / count))
    assert torch.all((y == 0) | (y == torch.tensor(1.0 / q, dtype=y.dtype)))
    assert not torch.equal(keep[0], keep[1])  # rows get their own numbers


def test_seed_controls_the_mask():
    x, r, b = make((32, 64), torch.float32)
    torch.manual_seed(1)
    a = trifuse.ops.dropout_add(x, r, P, bias=b)
    a2 = trifuse.ops.dropout_add(x, r, P, bias=b)
    torch.manual_seed(1)
    c = trifuse.ops.dropout_add(x, r, P, bias=b)
    torch.manual_seed(2)
    d = trifuse.ops.dropout_add(x, r, P, bias=b)
    assert torch.equal(a, c)  # same seed, bitwise equal
    assert not torch.equal(a, a2)  # successive calls differ
    assert not torch.equal(a, d)  # other seed, other mask


def _philox4x32_10(seed: int, c0, c1):
    """Philox-4x32-10 (Salmon et al. 2011) in NumPy: counters (c0, c1, 0, 0), key = seed."""
    mask32 = np.uint64(0xFFFFFFFF)
    c0, c1 = c0.astype(np.uint64), c1.astype(np.uint64)
    c2, c3 = np.zeros_like(c0), np.zeros_like(c0)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        p0, p2 = b * c2, a * c0
        c0, c2 = ((p0 >> np.uint64(32)) ^ c1 ^ k0) & mask32, ((p2 >> np.uint64(32)) ^ c3 ^ k1) & mask32
        c1, c3 = p0 & mask32, p2 & mask32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask32, (k1 + np.uint64(0xBB67AE85)) & mask32
    return c0, c1, c2, c3


@triton.jit
def _keep_kernel(OUT, SEED, p, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep_quads(tl.load(SEED), rows[:, None], cols[None, :], p)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(OUT + rows[:, None] * N + cols[None, :], keep.to(tl.int8), mask=mask)


@pytest.mark.parametrize("block", [(4, 16), (1, 64), (8, 2), (2, 1)], ids=_ids)
def test_mask_is_the_documented_philox_stream_whatever_the_tiling(block):
    """Element (row, col) is kept when output col % 4 of Philox-4x32-10(seed; col // 4, row),
    shifted right by one, is >= p * 2^31: the same bits for every tile shape (blocks of 1 or 2
    columns take the one-call-per-element path)."""
    m, n, seed, p = 13, 37, 0x1234_5678_9ABC, 0.3
    out = torch.empty(m, n, dtype=torch.int8, device=DEVICE)
    seed_t = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
    _keep_kernel[(triton.cdiv(m, block[0]), triton.cdiv(n, block[1]))](out, seed_t, p, m, n, BLOCK_M=block[0], BLOCK_N=block[1])
    rows, cols = np.meshgrid(np.arange(m), np.arange(n), indexing="ij")
    u = np.stack(_philox4x32_10(seed, cols // 4, rows))  # (4, m, n)
    u = np.take_along_axis(u, (cols % 4)[None], axis=0)[0]
    expected = (u >> np.uint64(1)) >= np.uint64(np.float32(p) * np.float32(2**31))
    assert np.array_equal(out.cpu().numpy().astype(bool), expected)


# ---------------------------------------------------------------------------------------------
# p = 0, training = False, p = 1, bad p
# ---------------------------------------------------------------------------------------------


def _rng_state():
    return torch.cuda.get_rng_state() if DEVICE == "cuda" else torch.get_rng_state()


@pytest.mark.parametrize("kwargs", [{"p": 0.0}, {"p": 0.5, "training": False}], ids=["p0", "eval"])
def test_plain_add_draws_no_random_numbers(kwargs):
    x, r, b = make((7, 33), torch.float32)
    before = _rng_state()
    y = trifuse.ops.dropout_add(x, r, bias=b, **kwargs)
    assert torch.equal(_rng_state(), before)
    assert torch.equal(y, r + (x + b))  # fp32 maths in the same order: bitwise
    dy = torch.randn_like(y)
    dx, dr, db = torch.autograd.grad(y, (x, r, b), dy)
    assert torch.equal(dx, dy) and torch.equal(dr, dy)
    assert_close("dbias", db, dy.double().sum(0), dy.sum(0))


def test_p_one_gives_the_residual_not_nan():
    x, r, b = make((5, 40), torch.float32)
    x = x.detach().clone()
    x[0, 0], x[1, 1], x[2, 2] = float("inf"), float("nan"), float("-inf")
    x.requires_grad_()
    y = trifuse.ops.dropout_add(x, r, 1.0, bias=b)
    assert torch.equal(y, r)
    dy = torch.randn_like(y)
    dx, dr, db = torch.autograd.grad(y, (x, r, b), dy)
    assert torch.equal(dx, torch.zeros_like(dx)) and torch.equal(dr, dy) and torch.equal(db, torch.zeros_like(db))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), "0.5", None])
def test_p_outside_0_1_raises(p):
    x = torch.ones(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="dropout_add: p must be a probability in \\[0, 1\\]"):
        trifuse.ops.dropout_add(x, x, p)
    with pytest.raises(ValueError, match="p must be a probability"):
        trifuse.ops.dropout_add(x, x, p, training=False)


# ---------------------------------------------------------------------------------------------
# Determinism, the two paths, compile, opcheck, gradcheck
# ---------------------------------------------------------------------------------------------


def test_bias_grad_is_deterministic():
    x, r, b = make((300, 130), torch.float32)
    dy = torch.randn(300, 130, device=DEVICE)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(torch.autograd.grad(trifuse.ops.dropout_add(x, r, P, bias=b), (x, r, b), dy))
    for a, a_ in zip(*runs):
        assert torch.equal(a, a_)


def test_backward_saves_nothing_per_element():
    x, r, b = make((64, 64), torch.float32)
    y = trifuse.ops.dropout_add(x, r, P, bias=b)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 1 and saved[0].numel() == 1 and saved[0].dtype == torch.int64


@pytest.mark.parametrize("p", [0.0, P])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_eager_path_and_registered_op_are_bitwise_equal(p, bias):
    x, r, b = make((37, 70), torch.float32, bias)
    torch.manual_seed(11)
    eager = trifuse.ops.dropout_add(x, r, p, bias=b)
    torch.manual_seed(11)
    op = torch.ops.trifuse.dropout_add(x, r, p, b)[0]
    assert torch.equal(eager, op)
    inputs = [t for t in (x, r, b) if t is not None]
    dy = torch.randn_like(eager)
    for a, a_ in zip(torch.autograd.grad(eager, inputs, dy), torch.autograd.grad(op, inputs, dy)):
        assert torch.equal(a, a_)


@pytest.mark.parametrize("p", [0.0, P])
def test_compiles_fullgraph_without_graph_breaks(p):
    x, r, b = make((4, 48), torch.float32)
    fn = torch.compile(lambda x, r, b: trifuse.ops.dropout_add(x, r, p, bias=b), fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    out = fn(x, r, b)
    torch.manual_seed(5)
    ref = trifuse.ops.dropout_add(x, r, p, bias=b)
    assert torch.equal(out, ref)  # one seed drawn either way: the same mask
    for a, a_ in zip(torch.autograd.grad(out, (x, r, b), torch.ones_like(out)),
                     torch.autograd.grad(ref, (x, r, b), torch.ones_like(ref))):
        assert torch.equal(a, a_)


def test_opcheck_every_op():
    x = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    r = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    b = torch.randn(16, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.trifuse.dropout_add.default, (x, r, 0.0, b))
    torch.library.opcheck(torch.ops.trifuse.dropout_add.default, (x, r, P, None))
    seed = torch.tensor([123], dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(torch.ops.trifuse.dropout_add_backward.default, (x.detach(), seed, P, True))


def test_gradcheck_float64():
    """With the seed fixed before each call the op is a deterministic function: gradcheck it."""
    x = torch.randn(3, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, device=DEVICE, dtype=torch.float64, requires_grad=True)

    def seeded(x, r, b):
        torch.manual_seed(0)
        return trifuse.ops.dropout_add(x, r, P, bias=b)

    assert torch.autograd.gradcheck(seeded, (x, r, b))
    assert torch.autograd.gradcheck(lambda x, r, b: torch.ops.trifuse.dropout_add(x, r, 0.0, b)[0], (x, r, b))


@settings(max_examples=15, deadline=None)
@given(m=st.integers(0, 40), n=st.integers(1, 300), p=st.sampled_from([0.0, 0.2, 0.7]), bias=st.booleans())
def test_hypothesis_shapes(m, n, p, bias):
    torch.manual_seed(m * 1000 + n)
    check_fwd_bwd(*make((m, n), torch.float32, bias), p=p)


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_to_the_31_elements():
    """Row offsets in int64: the last rows of a tensor past 2^31 elements are right, and the
    backward's mask still matches the forward's there."""
    m, n = 2**31 // 4096 + 8, 4096
    x = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16).abs() + 1.0  # never 0: the mask reads off y
    r = torch.zeros(m, n, device=DEVICE, dtype=torch.bfloat16)
    seed = torch.tensor([99], dtype=torch.int64, device=DEVICE)
    y = da_mod.dropout_add_fwd(x, r, None, P, seed)
    tail = slice(m - 16, m)
    mask = y[tail] != 0
    assert_close("tail", y[tail], dropout_add_ref(x[tail].double(), r[tail].double(), P, dropout_mask=mask), None)
    del y, r
    dx, _ = da_mod.dropout_add_bwd(torch.ones_like(x), seed, P, False)
    assert torch.equal(dx[tail] != 0, mask)


# ---------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations must fail the same tolerance.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_mask_off_by_one_column_fails(dtype):
    x, r, b = make((16, 64), dtype)
    y = trifuse.ops.dropout_add(x, r, P, bias=b)
    shifted = torch.roll(recover_mask(y, r), 1, dims=1)
    ref = dropout_add_ref(*upcast(x, r), P, bias=upcast(b)[0], dropout_mask=shifted)
    ok, msg = check_close("mask off by one", y, ref, None)
    assert not ok, msg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_unscaled_dropout_fails(dtype):
    """Dropout without the 1 / (1 - p) scale: the kept values are right up to that factor only."""
    x, r, b = make((16, 64), dtype)
    y = trifuse.ops.dropout_add(x, r, P, bias=b)
    mask = recover_mask(y, r)
    wrong = (r.double() + torch.where(mask, x.double() + b.double(), 0.0)).to(y.dtype)
    ref = dropout_add_ref(*upcast(x, r), P, bias=upcast(b)[0], dropout_mask=mask)
    ok, msg = check_close("unscaled", wrong, ref, None)
    assert not ok, msg


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, r, b, exc, match",
    [
        (torch.ones(3, 8), torch.ones(3, 7), None, ValueError, r"dropout_add: residual must have shape \(3, 8\)"),
        (torch.ones(3, 8), torch.ones(8), None, ValueError, "residual must have shape"),
        (torch.ones(3, 8), torch.ones(3, 8), torch.ones(5), ValueError, r"dropout_add: bias must have shape \(8,\)"),
        (torch.ones(3, 8, dtype=torch.int64), torch.ones(3, 8), None, TypeError, "dropout_add: input must be float"),
        (torch.ones(3, 8), torch.ones(3, 8, dtype=torch.bool), None, TypeError, "residual must be float"),
        (torch.ones(3, 8), None, None, TypeError, "dropout_add: residual must be a torch.Tensor"),
        ("x", torch.ones(3, 8), None, TypeError, "dropout_add: input must be a torch.Tensor"),
    ],
    ids=["residual-shape", "residual-broadcast", "bias-shape", "int-input", "bool-residual", "no-residual", "not-tensor"],
)
def test_bad_input_raises_clear_error(x, r, b, exc, match):
    x, r, b = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in (x, r, b))
    with pytest.raises(exc, match=match):
        trifuse.ops.dropout_add(x, r, P, bias=b)


def test_bad_input_raises_under_compile():
    fn = torch.compile(lambda x, r: trifuse.ops.dropout_add(x, r, P), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="residual must have shape"):
        fn(torch.ones(3, 8, device=DEVICE), torch.ones(3, 5, device=DEVICE))


def test_mismatched_devices_raise():
    with pytest.raises(ValueError, match="residual is on meta"):
        trifuse.ops.dropout_add(torch.ones(3, 8, device=DEVICE), torch.ones(3, 8, device="meta"), P)


def test_reference_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: same maths and API, its own
    random stream, still regenerated in the backward."""
    monkeypatch.setattr(da_mod, "use_triton", lambda t: False)
    for bias in (True, False):
        check_fwd_bwd(*make((40, 37), torch.float32, bias))


# ---------------------------------------------------------------------------------------------
# The gated form: y = residual + gate * dropout(x + bias), gate one vector per sample
# ---------------------------------------------------------------------------------------------

# (x's shape, the gate's): DiT's (B, 1, N); a chunk of a modulation, (B, N)[:, None] with a row
# stride of 6N; a scalar per sample; a LayerScale's (N,); one vector shared by every sample; 4-D
# video latents with the gate per (B, T); samples of one row each
GATE_CASES = [
    ((3, 5, 37), (3, 1, 37)),
    ((2, 7, 40), "chunk"),
    ((3, 4, 17), (3, 1, 1)),
    ((6, 129), (129,)),
    ((2, 3, 50), (1, 1, 50)),
    ((2, 3, 4, 24), (2, 3, 1, 24)),
    ((5, 1, 33), (5, 1, 33)),
    ((0, 4, 16), (0, 1, 16)),
]


def _gate_id(case):
    return f"{_ids(case[0])}-{case[1] if isinstance(case[1], str) else _ids(case[1])}"


def make_gate(x_shape, gate_shape, dtype):
    """A gate with |gate| >= 0.5 (so a kept element still moves y off the residual)."""
    if gate_shape == "chunk":
        table = torch.randn(x_shape[0], 6 * x_shape[-1], device=DEVICE, dtype=dtype)
        g = table.chunk(6, dim=1)[2][:, None]
        assert not g.is_contiguous()
    else:
        g = torch.randn(gate_shape, device=DEVICE, dtype=dtype)
    g = torch.where(g.abs() < 0.5, torch.sign(g) * 0.5 + (g == 0), g)
    return g.detach().requires_grad_()


def check_gated(x, r, b, gate, p=P, dy=None):
    """y and every gradient, dgate's per-sample sums included, against float64 given the kernel's
    mask; returns (y, grads)."""
    y = trifuse.ops.dropout_add(x, r, p, bias=b, gate=gate)
    assert y.shape == x.shape and y.dtype == torch.promote_types(x.dtype, r.dtype)
    mask = recover_mask(y, r) if p > 0 else None
    x64, r64, b64, g64 = upcast(x, r, b, gate)
    xl, rl, bl, gl = lowp(x, r, b, gate)
    y64 = dropout_add_ref(x64, r64, p, bias=b64, dropout_mask=mask, gate=g64)
    ylp = dropout_add_ref(xl, rl, p, bias=bl, dropout_mask=mask, gate=gl).to(y.dtype)
    assert_close("y", y, y64, ylp)
    if x.numel() == 0:
        return y, None
    dy = torch.randn_like(y) if dy is None else dy
    inputs = [t for t in (x, r, b, gate) if t is not None]
    g = torch.autograd.grad(y, inputs, dy)
    g64 = torch.autograd.grad(y64, [t for t in (x64, r64, b64, g64) if t is not None], dy.double())
    glp = torch.autograd.grad(ylp, [t for t in (xl, rl, bl, gl) if t is not None], dy)
    names = [n for n, t in zip(("dx", "dresidual", "dbias", "dgate"), (x, r, b, gate)) if t is not None]
    for name, a, a64, alp, t in zip(names, g, g64, glp, inputs):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        assert_close(name, a, a64, alp, compute_dtype=x.dtype)
    if mask is not None:  # the backward regenerated the forward's mask
        assert torch.equal(g[0] != 0, mask & (dy != 0))
    return y, g


@pytest.mark.parametrize("p", [0.0, P])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", GATE_CASES, ids=_gate_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_matches_float64_oracle(dtype, case, bias, p):
    x, r, b = make(case[0], dtype, bias)
    check_gated(x, r, b, make_gate(case[0], case[1], dtype), p)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gated_fp32_gate_beside_a_16_bit_stream(dtype):
    """Wan's `(h.float() + ff_out * gate).type_as(h)`: the fp32 gate's product and the sum in fp32,
    y rounded once to the stream's dtype; dgate in fp32."""
    x, r, _ = make((2, 9, 48), dtype, False)
    gate = make_gate((2, 9, 48), (2, 1, 48), torch.float32)
    y, _ = check_gated(x, r, None, gate, 0.0)
    want = (r.detach().float() + x.detach().float() * gate.detach()).to(dtype)
    assert torch.equal(y, want)


def test_gated_mixed_residual_promotes_like_pytorch():
    x, r, b = make((2, 6, 40), torch.float16, residual_dtype=torch.float32)
    check_gated(x, r, b, make_gate((2, 6, 40), (2, 1, 40), torch.float16))


def test_gated_many_rows_per_sample_split_over_several_programs(monkeypatch):
    """A sample's rows over several backward programs, each with its own partial rows: dgate and
    dbias add every row once (the splits follow the SMs: 64 here)."""
    monkeypatch.setattr(da_mod, "device_sms", lambda t: 64)
    monkeypatch.setattr(da_mod._GATED_BWD_TUNING, "launches", {})
    x, r, b = make((3, 300, 48), torch.float32)
    check_gated(x, r, b, make_gate((3, 300, 48), (3, 1, 48), torch.float32))
    launch = next(iter(da_mod._GATED_BWD_TUNING.launches.values()))
    assert launch.plan.groups > 1  # splits per sample


def assert_gated_gradients_repeat(x, r, b, gate):
    """Two seeded calls give bitwise the same gradients (dgate's and dbias' sums in a fixed order)."""
    dy = torch.randn(x.shape, device=DEVICE)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(torch.autograd.grad(trifuse.ops.dropout_add(x, r, P, bias=b, gate=gate), (x, r, b, gate), dy))
    for a, a_ in zip(*runs):
        assert torch.equal(a, a_)


def test_gated_gradients_are_deterministic():
    x, r, b = make((4, 150, 130), torch.float32)
    assert_gated_gradients_repeat(x, r, b, make_gate((4, 150, 130), (4, 1, 130), torch.float32))


def _gate_and_registered_op(shape, kind):
    """A per-sample gate (B, 1, N) and the registered op called on its rows, or a per-token chunk
    (B, S, N) and the per-token registered op."""
    if kind == "per-sample":
        gate = make_gate(shape, (shape[0], 1, shape[-1]), torch.float32)
        return gate, lambda x, r, g, p, b: torch.ops.trifuse.gated_dropout_add(x, r, da_mod._gate_rows(g, x), p, b)
    return make_token_gate(shape, "token-chunk", torch.float32), torch.ops.trifuse.gated_dropout_add_rows


@pytest.mark.parametrize("kind", ["per-sample", "per-token"])
@pytest.mark.parametrize("p", [0.0, P])
def test_gated_eager_path_and_registered_op_are_bitwise_equal(p, kind):
    x, r, b = make((3, 13, 70), torch.float32)
    gate, registered = _gate_and_registered_op((3, 13, 70), kind)
    torch.manual_seed(11)
    eager = trifuse.ops.dropout_add(x, r, p, bias=b, gate=gate)
    torch.manual_seed(11)
    op = registered(x, r, gate, p, b)[0]
    assert torch.equal(eager, op)
    dy = torch.randn_like(eager)
    for a, a_ in zip(torch.autograd.grad(eager, (x, r, b, gate), dy), torch.autograd.grad(op, (x, r, b, gate), dy)):
        assert torch.equal(a, a_)


@pytest.mark.parametrize("kind", ["per-sample", "per-token"])
@pytest.mark.parametrize("p", [0.0, P])
def test_gated_compiles_fullgraph_without_graph_breaks(p, kind):
    x, r, b = make((2, 4, 48), torch.float32)
    gate = _gate_and_registered_op((2, 4, 48), kind)[0]
    fn = torch.compile(lambda x, r, b, g: trifuse.ops.dropout_add(x, r, p, bias=b, gate=g), fullgraph=True,
                       backend="aot_eager")
    torch.manual_seed(5)
    out = fn(x, r, b, gate)
    torch.manual_seed(5)
    ref = trifuse.ops.dropout_add(x, r, p, bias=b, gate=gate)
    assert torch.equal(out, ref)
    for a, a_ in zip(torch.autograd.grad(out, (x, r, b, gate), torch.ones_like(out)),
                     torch.autograd.grad(ref, (x, r, b, gate), torch.ones_like(ref))):
        assert torch.equal(a, a_)


def test_gated_opcheck_every_op():
    x = torch.randn(2, 3, 16, device=DEVICE, requires_grad=True)
    r = torch.randn(2, 3, 16, device=DEVICE, requires_grad=True)
    b = torch.randn(16, device=DEVICE, requires_grad=True)
    rows = torch.randn(2, 16, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.trifuse.gated_dropout_add.default, (x, r, rows, 0.0, b))
    torch.library.opcheck(torch.ops.trifuse.gated_dropout_add.default, (x, r, rows, P, None))
    seed = torch.tensor([123], dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(torch.ops.trifuse.gated_dropout_add_backward.default,
                          (x.detach(), x.detach(), b.detach(), rows.detach(), seed, P, True, True, True, x.dtype))
    torch.library.opcheck(torch.ops.trifuse.gated_dropout_add_backward.default,
                          (x.detach(), x.detach(), None, rows.detach(), seed, 0.0, False, False, True, x.dtype))


def test_gated_gradcheck_float64_twice_differentiable():
    """Seeded, the op is a deterministic function: gradcheck it, and gradgradcheck (a gradient
    penalty's create_graph=True runs the backward in PyTorch ops)."""
    x, r, b = (torch.randn(s, device=DEVICE, dtype=torch.float64, requires_grad=True)
               for s in ((2, 3, 6), (2, 3, 6), (6,)))
    gate = torch.randn(2, 1, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)

    def seeded(x, r, b, gate):
        torch.manual_seed(0)
        return trifuse.ops.dropout_add(x, r, P, bias=b, gate=gate)

    assert torch.autograd.gradcheck(seeded, (x, r, b, gate))
    assert torch.autograd.gradgradcheck(seeded, (x, r, b, gate), fast_mode=True)
    rows = gate.detach().reshape(2, 6).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, r, g, b: torch.ops.trifuse.gated_dropout_add(x, r, g, 0.0, b)[0],
                                    (x, r, rows, b))


@pytest.mark.parametrize("gate_shape", [(3, 1, 37), (3, 20, 1)], ids=["per-sample", "per-token"])
def test_gated_reference_path_without_interpreter_matches(monkeypatch, gate_shape):
    monkeypatch.setattr(da_mod, "use_triton", lambda t: False)
    x, r, b = make((3, 20, 37), torch.float32)
    make_one = make_gate if gate_shape[1] == 1 else make_token_gate
    check_gated(x, r, b, make_one((3, 20, 37), gate_shape, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_gate_of_the_wrong_sample_fails(dtype):
    """A kernel that read gate row r % G instead of r // G (or the samples in another order) must
    fail the same tolerance."""
    x, r, _ = make((3, 6, 40), dtype, False)
    gate = make_gate((3, 6, 40), (3, 1, 40), dtype)
    y = trifuse.ops.dropout_add(x, r, 0.0, gate=gate)
    wrong = dropout_add_ref(*upcast(x, r), 0.0, gate=gate.detach().double().roll(1, dims=0))
    assert not check_close("y", y, wrong, None)[0]


@pytest.mark.parametrize(
    "gate, exc, match",
    [
        (torch.ones(3, 5, 8), ValueError, "dropout_add: gate must broadcast against input"),
        (torch.ones(4, 1, 8), ValueError, "gate must broadcast against input"),
        (torch.ones(7), ValueError, "gate must broadcast against input"),
        (torch.ones(2, 1, 8, dtype=torch.int32), TypeError, "dropout_add: gate must be float"),
        (torch.ones(2, 1, 8, dtype=torch.float64), ValueError, r"gate \(torch.float64\) must be no wider than"),
        ("g", TypeError, "dropout_add: gate must be a torch.Tensor"),
    ],
    ids=["more-samples", "other-batch", "other-width", "int", "fp64-beside-fp32", "not-tensor"],
)
def test_gated_bad_gate_raises_clear_error(gate, exc, match):
    gate = gate.to(DEVICE) if isinstance(gate, torch.Tensor) else gate
    with pytest.raises(exc, match=match):
        trifuse.ops.dropout_add(torch.ones(2, 5, 8, device=DEVICE), torch.ones(2, 5, 8, device=DEVICE), P, gate=gate)


def test_gated_0_dim_input_raises_clear_error():
    with pytest.raises(ValueError, match="dropout_add: a gate needs an input with a last dim"):
        trifuse.ops.dropout_add(torch.tensor(1.0, device=DEVICE), torch.tensor(2.0, device=DEVICE), 0.0,
                                gate=torch.tensor(3.0, device=DEVICE))


def test_gated_backward_keeps_x_only_for_dgate():
    """x is saved for dgate alone, as PyTorch's product keeps it: a frozen gate (a LayerScale not
    trained) leaves the backward reading dy only."""
    x, r, b = make((2, 4, 32), torch.float32)
    for gate_grad in (True, False):
        gate = make_gate((2, 4, 32), (2, 1, 32), torch.float32).requires_grad_(gate_grad)
        y = trifuse.ops.dropout_add(x, r, P, bias=b, gate=gate)
        saved = [t for t in y.grad_fn.saved_tensors if t is not None and t.shape == x.shape]
        assert len(saved) == (1 if gate_grad else 0)
        grads = torch.autograd.grad(y, (x, r, b), torch.ones_like(y))
        assert all(g is not None for g in grads)


@pytest.mark.parametrize("shape, gate_shape", [((0, 4, 16), (0, 1, 16)), ((3, 0, 16), (3, 1, 16))],
                         ids=["no-samples", "no-tokens"])
def test_gated_empty_input_has_zero_gradients(shape, gate_shape):
    """No rows: y is empty, and dbias and dgate are sums of nothing, zeros shaped like their inputs,
    eagerly and through the registered op."""
    x, r, b = make(shape, torch.float32)
    gate = make_gate(shape, gate_shape, torch.float32) if gate_shape[0] else torch.zeros(
        gate_shape, device=DEVICE, requires_grad=True)
    for run in (lambda: trifuse.ops.dropout_add(x, r, P, bias=b, gate=gate),
                lambda: torch.ops.trifuse.gated_dropout_add(x, r, da_mod._gate_rows(gate, x), P, b)[0]):
        y = run()
        assert y.shape == x.shape
        grads = torch.autograd.grad(y, (x, r, b, gate), torch.ones_like(y))
        assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in (x, r, b, gate)]
        assert not any(g.any() for g in grads)


# ---------------------------------------------------------------------------------------------
# A gate per token: FLUX.3's and Qwen-Image 2.1's block ends, `h + gate * out`, gate (B, S, N)
# ---------------------------------------------------------------------------------------------

# (x's shape, the gate's): full-size; a chunk of a (B, S, 3N) per-token projection (row stride 3N,
# read in place); a scalar per token (copied to full size); one per position shared by the batch,
# (S, N) and MiniMax H3's (S, 3N) chunk (row r reads gate row r % S, in place); 4-D video latents,
# per (T, H, W) position or per W; a vector per row of a 2-D input; no samples; no tokens
TOKEN_GATE_CASES = [
    ((3, 5, 37), (3, 5, 37)),
    ((2, 7, 40), "token-chunk"),
    ((2, 7, 40), (2, 7, 1)),
    ((2, 7, 40), (7, 40)),
    ((2, 7, 40), "position-chunk"),
    ((2, 3, 4, 24), (1, 3, 4, 24)),
    ((2, 3, 4, 24), (4, 24)),
    ((2, 3, 4, 24), (2, 3, 4, 24)),
    ((6, 129), (6, 129)),
    ((300, 130), (300, 130)),
    ((0, 4, 16), (0, 4, 16)),
    ((3, 0, 16), (3, 0, 16)),
]


def make_token_gate(x_shape, gate_shape, dtype):
    """A per-token gate with |gate| >= 0.5 (so a kept element still moves y off the residual)."""
    chunk = gate_shape in ("token-chunk", "position-chunk")
    rows = x_shape[:-1] if gate_shape == "token-chunk" else x_shape[1:-1]
    g = torch.randn((*rows, 3 * x_shape[-1]) if chunk else gate_shape, device=DEVICE, dtype=dtype)
    g = torch.where(g.abs() < 0.5, torch.sign(g) * 0.5 + (g == 0), g)
    if chunk:  # the third of the projection's chunks, row stride 3N: read in place
        g = g.chunk(3, dim=-1)[2]
        assert not g.is_contiguous()
    return g.detach().requires_grad_()


@pytest.mark.parametrize("p", [0.0, P])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", TOKEN_GATE_CASES, ids=_gate_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_token_gated_matches_float64_oracle(dtype, case, bias, p):
    """y, dx, dresidual, dbias and dgate (per element, summed down where the gate broadcasts)
    against float64 given the kernel's mask."""
    x, r, b = make(case[0], dtype, bias)
    gate = make_token_gate(case[0], case[1], dtype)
    _, grads = check_gated(x, r, b, gate, p)
    if grads is not None:
        assert grads[-1].dtype == gate.dtype and grads[-1].shape == gate.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_per_token_fp32_gate_beside_a_16_bit_stream(dtype):
    """Helios' per-token fp32 gate beside a 16-bit stream, the sum in fp32 and cast back: y is
    `(r.float() + x.float() * gate).to(dtype)` exactly, dgate fp32."""
    x, r, _ = make((2, 9, 48), dtype, False)
    gate = make_token_gate((2, 9, 48), (2, 9, 48), torch.float32)
    y, grads = check_gated(x, r, None, gate, 0.0)
    assert torch.equal(y, (r.detach().float() + x.detach().float() * gate.detach()).to(dtype))
    assert grads[-1].dtype == torch.float32


@pytest.mark.parametrize("gate_shape", ["token-chunk", "position-chunk"])
def test_per_token_gate_is_read_in_place(monkeypatch, gate_shape):
    """A chunk of the per-token projection (or of a per-position one, repeated over the batch)
    reaches the forward kernel as itself (its row stride, no copy), and the backward's too."""
    x, r, b = make((2, 7, 40), torch.float32)
    gate = make_token_gate((2, 7, 40), gate_shape, torch.float32)
    seen = []
    for name in ("_dropout_add_fwd", "_gated_rows_dropout_add_bwd"):
        kernel = getattr(da_mod, name)
        monkeypatch.setattr(kernel, "run", lambda grid, args, meta, run=kernel.run: (seen.append(args), run(grid, args,
                                                                                                      meta))[1])
    y = trifuse.ops.dropout_add(x, r, 0.0, bias=b, gate=gate)
    torch.autograd.grad(y, (x, gate), torch.ones_like(y))
    assert len(seen) == 2
    assert all(any(isinstance(a, torch.Tensor) and a.data_ptr() == gate.data_ptr() for a in args) for args in seen)


def test_per_token_dbias_is_summed_over_several_programs_deterministically(monkeypatch):
    """With a bias the backward's programs each sum a range of rows into a partial row of dbias;
    every row counts once, in the same order on every run."""
    monkeypatch.setattr(da_mod, "device_sms", lambda t: 64)
    monkeypatch.setattr(da_mod._GATED_ROWS_BWD_TUNING, "launches", {})
    x, r, b = make((3, 300, 48), torch.float32)
    gate = make_token_gate((3, 300, 48), (3, 300, 48), torch.float32)
    check_gated(x, r, b, gate)
    launch = next(iter(da_mod._GATED_ROWS_BWD_TUNING.launches.values()))
    assert launch.plan.groups > 1
    assert_gated_gradients_repeat(x, r, b, gate)


def test_per_token_opcheck_every_op():
    x = torch.randn(2, 3, 16, device=DEVICE, requires_grad=True)
    r = torch.randn(2, 3, 16, device=DEVICE, requires_grad=True)
    b = torch.randn(16, device=DEVICE, requires_grad=True)
    gate = torch.randn(2, 3, 16, device=DEVICE, requires_grad=True)
    scalar_gate = torch.randn(2, 3, 1, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.trifuse.gated_dropout_add_rows.default, (x, r, gate, 0.0, b))
    torch.library.opcheck(torch.ops.trifuse.gated_dropout_add_rows.default, (x, r, scalar_gate, P, None))
    seed = torch.tensor([123], dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(torch.ops.trifuse.gated_dropout_add_rows_backward.default,
                          (x.detach(), x.detach(), b.detach(), gate.detach(), seed, P, True, True, True, x.dtype))
    torch.library.opcheck(torch.ops.trifuse.gated_dropout_add_rows_backward.default,
                          (x.detach(), x.detach(), None, scalar_gate.detach(), seed, 0.0, False, False, True,
                           x.dtype))
    torch.library.opcheck(torch.ops.trifuse.gated_dropout_add_rows_backward.default,
                          (x.detach(), None, b.detach(), gate.detach(), seed, 0.0, False, False, False, x.dtype))


def test_per_token_gradcheck_float64_twice_differentiable():
    x, r, b = (torch.randn(s, device=DEVICE, dtype=torch.float64, requires_grad=True)
               for s in ((2, 3, 6), (2, 3, 6), (6,)))
    for gate_shape in ((2, 3, 6), (2, 3, 1)):
        gate = torch.randn(gate_shape, device=DEVICE, dtype=torch.float64, requires_grad=True)

        def seeded(x, r, b, gate):
            torch.manual_seed(0)
            return trifuse.ops.dropout_add(x, r, P, bias=b, gate=gate)

        assert torch.autograd.gradcheck(seeded, (x, r, b, gate))
        assert torch.autograd.gradgradcheck(seeded, (x, r, b, gate), fast_mode=True)
        assert torch.autograd.gradcheck(
            lambda x, r, g, b: torch.ops.trifuse.gated_dropout_add_rows(x, r, g, 0.0, b)[0], (x, r, gate, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_gate_of_the_next_token_fails(dtype):
    """A kernel that read the gate row of the next token (or of a sample's first) must fail the
    same tolerance."""
    x, r, _ = make((3, 6, 40), dtype, False)
    gate = make_token_gate((3, 6, 40), (3, 6, 40), dtype)
    y = trifuse.ops.dropout_add(x, r, 0.0, gate=gate)
    for wrong_gate in (gate.detach().roll(1, dims=1), gate.detach()[:, :1].expand_as(gate)):
        wrong = dropout_add_ref(*upcast(x, r), 0.0, gate=wrong_gate.double())
        assert not check_close("y", y, wrong, None)[0]


@pytest.mark.parametrize("gate_shape", [(2, 1, 32), (2, 4, 32)], ids=["per-sample", "per-token"])
def test_a_frozen_bias_still_shifts_dgate(gate_shape):
    """The bias of the linear folded in, frozen (LoRA): dgate = sum of dz * (x + bias) still reads
    it, against float64."""
    x, r, b = make((2, 4, 32), torch.float32)
    b = (b.detach() * 4).requires_grad_(False)
    gate = make_token_gate((2, 4, 32), gate_shape, torch.float32)
    for run in (lambda: trifuse.ops.dropout_add(x, r, P, bias=b, gate=gate),
                lambda: torch.ops.trifuse.gated_dropout_add_rows(x, r, gate, P, b)[0] if gate_shape[1] > 1 else
                torch.ops.trifuse.gated_dropout_add(x, r, da_mod._gate_rows(gate, x), P, b)[0]):
        torch.manual_seed(3)
        y = run()
        mask = recover_mask(y, r)
        x64, r64, g64 = upcast(x, r, gate)
        y64 = dropout_add_ref(x64, r64, P, bias=b.double(), dropout_mask=mask, gate=g64)
        dy = torch.randn_like(y)
        dgate, = torch.autograd.grad(y, (gate,), dy)
        dgate64, = torch.autograd.grad(y64, (g64,), dy.double())
        assert_close("dgate", dgate, dgate64, None)


def test_per_token_backward_keeps_x_only_for_dgate():
    x, r, b = make((2, 4, 32), torch.float32)
    for gate_grad in (True, False):
        gate = make_token_gate((2, 4, 32), (2, 4, 32), torch.float32).requires_grad_(gate_grad)
        y = trifuse.ops.dropout_add(x, r, P, bias=b, gate=gate)
        saved = [t for t in y.grad_fn.saved_tensors if t is not None and t.shape == x.shape]
        assert len(saved) == (2 if gate_grad else 1)  # the gate itself, and x for dgate
        grads = torch.autograd.grad(y, (x, r, b), torch.ones_like(y))
        assert all(g is not None for g in grads)
