"""The fused residual stream with dropout: s = residual + dropout(x + x_bias), y = LN(s) or
RMSNorm(s), returning (y, s) (`trifuse.ops.dropout_add_layer_norm`).

The kernel's mask is recovered from s (inputs are built so that every kept element moves s
away from the residual by at least 0.5) and handed to `layer_norm_ref(..., dropout_mask=)`, so
outputs and all five gradients are compared with the float64 oracle as for a deterministic op.
On CPU these run the real Triton kernels in the interpreter; on a GPU the same tests add bf16.
"""
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close

from _device import DEVICE
import trifuse
from trifuse.kernels import layer_norm as ln_mod
from trifuse.kernels.layer_norm import layer_norm_ref

# widths: 1, odd, past a power of two, 0 rows, 3-D; the wide (chunked) paths have their own test
SHAPES = [(1, 1), (3, 7), (4, 100), (2, 129), (5, 1000), (0, 32), (2, 3, 50)]
NORMS = ["layer_norm", "rms_norm"]
P = 0.3
EPS = 1e-5


def _ids(shape):
    return "x".join(map(str, shape))


def make(shape, dtype, norm="layer_norm", residual=True, x_bias=True, least=0.5):
    """x, residual, weight, bias, x_bias with |x + x_bias| >= 0.8 * least everywhere (the mask
    readable from s while the residual's ulp is under that)."""
    n = shape[-1]
    xb = torch.randn(n, device=DEVICE, dtype=dtype) if x_bias else None
    z = torch.randn(shape, device=DEVICE, dtype=torch.float64)
    z = torch.sign(z) * (least + z.abs())
    x = (z - (xb.double() if x_bias else 0.0)).to(dtype)
    if x_bias:  # rounding x may pull x + x_bias under `least` by an ulp: keep a margin
        x = torch.where((x.double() + xb.double()).abs() < 0.8 * least, torch.full_like(x, 2 * least), x)
    r = torch.randn(shape, device=DEVICE, dtype=dtype) if residual else None
    w = torch.randn(n, device=DEVICE, dtype=dtype)
    b = torch.randn(n, device=DEVICE, dtype=dtype) if norm == "layer_norm" else None
    return [None if t is None else t.requires_grad_() for t in (x, r, w, b, xb)]


def run(x, r, w, b, xb, norm="layer_norm", p=P, training=True):
    return trifuse.ops.dropout_add_layer_norm(x, r, x.shape[-1:], w, b, EPS, p, training, xb,
                                              is_rms_norm=norm == "rms_norm")


def recover_mask(s, r):
    return s != (torch.zeros_like(s) if r is None else r.to(s.dtype))


def run_ref(x, r, w, b, xb, norm, mask, p=P):
    return layer_norm_ref(x, x.shape[-1:], w, b, EPS, r, is_rms_norm=norm == "rms_norm",
                          dropout_mask=mask, p=p, x_bias=xb)


def upcast(ts):
    return [None if t is None else t.detach().double().requires_grad_() for t in ts]


def lowp(ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


NAMES = ("dx", "dresidual", "dweight", "dbias", "dx_bias")


def check_fwd_bwd(inputs, norm="layer_norm", p=P, grads_out=None):
    """y, s and every gradient against float64 given the kernel's mask; returns the mask."""
    x, r = inputs[0], inputs[1]
    y, s = run(*inputs, norm=norm, p=p)
    dtype = x.dtype if r is None else torch.promote_types(x.dtype, r.dtype)
    assert y.shape == s.shape == x.shape and y.dtype == s.dtype == dtype
    mask = recover_mask(s, r) if p > 0 else torch.ones_like(s, dtype=torch.bool)
    i64, ilp = upcast(inputs), lowp(inputs)
    y64, s64 = run_ref(*i64, norm, mask, p)
    ylp, slp = run_ref(*ilp, norm, mask, p)
    assert_close(f"{norm} y", y, y64, ylp)
    assert_close(f"{norm} s", s, s64, slp)
    if x.numel() == 0:
        return mask
    dy, ds = grads_out if grads_out is not None else (torch.randn_like(y), torch.randn_like(s))
    live = [(name, i) for i, (name, t) in enumerate(zip(NAMES, inputs)) if t is not None]
    g = torch.autograd.grad((y, s), [inputs[i] for _, i in live], (dy, ds))
    g64 = torch.autograd.grad((y64, s64), [i64[i] for _, i in live], (dy.double(), ds.double()))
    glp = torch.autograd.grad((ylp, slp), [ilp[i] for _, i in live], (dy, ds))
    for (name, i), a, a64, alp in zip(live, g, g64, glp):
        assert a.dtype == inputs[i].dtype and a.shape == inputs[i].shape
        # an fp32 weight's gradient sums products with the stored 16-bit s: its floor is s's dtype's
        assert_close(f"{norm} {name}", a, a64, alp, compute_dtype=dtype)
    # The backward regenerated the forward's mask: dx is zero where the forward dropped (a kept
    # element's gradient may round to zero in 16 bits).
    assert (g[0][~mask] == 0).all()
    return mask


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, shape, norm):
    check_fwd_bwd(make(shape, dtype, norm), norm)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("residual, x_bias", [(False, True), (True, False), (False, False)],
                         ids=["no-residual", "no-x-bias", "neither"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_residual_or_x_bias(dtype, norm, residual, x_bias):
    check_fwd_bwd(make((6, 96), dtype, norm, residual, x_bias), norm)


@pytest.mark.parametrize("norm", NORMS)
def test_wide_rows_use_the_chunked_paths(norm):
    shape = (2, 17000)
    assert shape[-1] > max(ln_mod.MAX_SINGLE_BLOCK_FWD, ln_mod.MAX_SINGLE_BLOCK_BWD)
    check_fwd_bwd(make(shape, torch.float32, norm), norm)


def test_strided_inputs():
    """A sliced x (row stride, read in place), a transposed residual (copied), and
    non-contiguous incoming gradients."""
    x, _, w, b, xb = make((6, 150), torch.float32)
    xs = x.detach()[:, 10:110].requires_grad_()
    rt = torch.randn(100, 6, device=DEVICE).t().requires_grad_()
    vec = [t.detach()[:100].clone().requires_grad_() for t in (w, b, xb)]
    grads = (torch.randn(100, 6, device=DEVICE).t(), torch.randn(100, 6, device=DEVICE).t())
    check_fwd_bwd([xs, rt, *vec], grads_out=grads)


def test_half_input_with_fp32_residual_promotes():
    x, _, _, _, _ = make((6, 64), torch.float16, x_bias=False)
    r, w, b = (torch.randn(*shape, device=DEVICE, requires_grad=True) for shape in ((6, 64), (64,), (64,)))
    check_fwd_bwd([x, r, w, b, None])


@pytest.mark.parametrize("p", [0.0, P])
def test_half_x_beside_fp32_residual_gets_its_gradients_from_the_kernel(monkeypatch, p):
    """Autocast's residual stream: x in fp16 (a matmul's output), the residual in fp32. dx and
    dresidual are written by the kernel in their inputs' dtypes (no cast pass after it), both
    with and without dropout, and match float64."""
    calls = []
    bwd = ln_mod.layer_norm_bwd

    def spy(*args, **kwargs):
        out = bwd(*args, **kwargs)
        calls.append((kwargs["store_dresidual"], out[0].dtype, out[1].dtype))
        return out

    monkeypatch.setattr(ln_mod, "layer_norm_bwd", spy)
    x, _, _, _, xb = make((6, 64), torch.float16)
    r, w, b = (torch.randn(*shape, device=DEVICE, requires_grad=True) for shape in ((6, 64), (64,), (64,)))
    check_fwd_bwd([x, r, w, b, xb.float().detach().requires_grad_()], p=p)
    assert calls == [(True, torch.float16, torch.float32)]


def test_backward_without_residual_writes_no_residual_gradient(monkeypatch):
    """With dropout, dresidual differs from dx and is written apart, but only when a residual
    wants a gradient: otherwise that is one wasted (M, N) write."""
    calls = []
    bwd = ln_mod.layer_norm_bwd

    def spy(*args, **kwargs):
        calls.append(kwargs["store_dresidual"])
        return bwd(*args, **kwargs)

    monkeypatch.setattr(ln_mod, "layer_norm_bwd", spy)
    x, r, w, b, xb = make((4, 32), torch.float32)
    for residual in (None, r.detach(), r):  # none, one without a gradient, one with
        torch.autograd.grad(run(x, residual, w, b, xb)[0].sum(), x)
    assert calls == [False, False, True]


def test_fp32_weights_with_half_activations():
    """Autocast's layout: fp16 activations, fp32 weight, bias and x_bias."""
    x, r, _, _, _ = make((8, 64), torch.float16)
    w, b, xb = (torch.randn(64, device=DEVICE, requires_grad=True) for _ in range(3))
    y, s = run(x, r, w, b, xb)
    assert y.dtype == s.dtype == torch.float16
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y, s), (x, r, w, b, xb), (dy, torch.zeros_like(s)))
    assert [g.dtype for g in grads] == [torch.float16] * 2 + [torch.float32] * 3
    mask = recover_mask(s, r)
    assert_close("y", y, run_ref(*upcast([x, r, w, b, xb]), "layer_norm", mask)[0], None)


# ---------------------------------------------------------------------------------------------
# The mask: statistics and seeds; p = 1; training = False
# ---------------------------------------------------------------------------------------------


def _within(observed, expected, sigma, k=5.0):
    assert abs(observed - expected) <= k * sigma, f"{observed} vs {expected} +- {k} x {sigma}"


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction_and_mean_within_binomial_bounds(p):
    """On 2^18 elements (64 rows of 4096): the kept fraction of s = dropout(1) is within 5 sigma
    of 1 - p and its mean within 5 sigma of 1; kept values are exactly 1 / (1 - p)."""
    m, n = 64, 4096
    ones = torch.ones(m, n, device=DEVICE)
    _, s = trifuse.ops.dropout_add_layer_norm(ones, None, (n,), p=p)
    keep, q, count = s != 0, 1.0 - p, m * n
    _within(keep.double().mean().item(), q, math.sqrt(p * q / count))
    _within(s.double().mean().item(), 1.0, math.sqrt(p / q / count))
    assert torch.all((s == 0) | (s == torch.tensor(1.0 / q, dtype=s.dtype)))
    assert not torch.equal(keep[0], keep[1])  # rows get their own numbers


def test_seed_controls_the_mask():
    inputs = make((16, 64), torch.float32)
    torch.manual_seed(1)
    a = run(*inputs)
    a2 = run(*inputs)
    torch.manual_seed(1)
    c = run(*inputs)
    torch.manual_seed(2)
    d = run(*inputs)
    assert all(torch.equal(u, v) for u, v in zip(a, c))  # same seed, bitwise equal
    assert not torch.equal(a[1], a2[1])  # successive calls differ
    assert not torch.equal(a[1], d[1])  # another seed, another mask


@pytest.mark.parametrize("norm", NORMS)
def test_p_one_gives_the_normalized_residual_not_nan(norm):
    x, r, w, b, xb = make((5, 40), torch.float32, norm)
    x = x.detach().clone()
    x[0, 0], x[1, 1], x[2, 2] = float("inf"), float("nan"), float("-inf")
    x.requires_grad_()
    y, s = run(x, r, w, b, xb, norm, p=1.0)
    assert torch.equal(s, r)
    ref = layer_norm_ref(r.double(), (40,), w.double(), None if b is None else b.double(), EPS,
                         is_rms_norm=norm == "rms_norm")
    assert_close("y", y, ref, None)
    inputs = [t for t in (x, r, w, b, xb) if t is not None]
    grads = torch.autograd.grad((y, s), inputs, (torch.randn_like(y), torch.randn_like(s)))
    assert torch.equal(grads[0], torch.zeros_like(x)) and torch.equal(grads[-1], torch.zeros_like(xb))
    assert torch.isfinite(torch.stack([g.sum() for g in grads])).all()


def _rng_state():
    return torch.cuda.get_rng_state() if DEVICE == "cuda" else torch.get_rng_state()


@pytest.mark.parametrize("norm", NORMS)
def test_eval_is_the_plain_residual_stream_and_draws_no_random_numbers(norm):
    inputs = make((7, 33), torch.float32, norm)
    before = _rng_state()
    y, s = run(*inputs, norm=norm, training=False)
    assert torch.equal(_rng_state(), before)
    y0, s0 = run(*inputs, norm=norm, p=0.0)
    assert torch.equal(y, y0) and torch.equal(s, s0)
    x, r, _, _, xb = inputs
    assert torch.equal(s, r + (x + xb))  # fp32 maths in the same order: bitwise
    assert torch.equal(_rng_state(), before)
    check_fwd_bwd(inputs, norm, p=0.0)


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), "0.1"])
def test_p_outside_0_1_raises(p):
    x = torch.ones(3, 8, device=DEVICE)
    for training in (True, False):
        with pytest.raises(ValueError, match="dropout_add_layer_norm: p must be a probability in"):
            trifuse.ops.dropout_add_layer_norm(x, x, (8,), p=p, training=training)


def test_rms_norm_with_a_bias_raises():
    x = torch.ones(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="RMSNorm takes no bias"):
        trifuse.ops.dropout_add_layer_norm(x, x, (8,), None, torch.ones(8, device=DEVICE), p=P, is_rms_norm=True)


def test_bad_x_bias_raises():
    x = torch.ones(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="dropout_add_layer_norm: x_bias must have shape"):
        trifuse.ops.dropout_add_layer_norm(x, x, (8,), p=P, x_bias=torch.ones(5, device=DEVICE))
    with pytest.raises(TypeError, match="x_bias must be float"):
        trifuse.ops.dropout_add_layer_norm(x, x, (8,), p=P, x_bias=torch.ones(8, dtype=torch.int32, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# Determinism, the two paths, compile, opcheck, gradcheck
# ---------------------------------------------------------------------------------------------


def test_vector_grads_are_deterministic():
    """dweight, dbias and dx_bias come from fixed-order partial sums: bitwise equal run to run."""
    inputs = make((37, 130), torch.float32)
    dy, ds = torch.randn(37, 130, device=DEVICE), torch.randn(37, 130, device=DEVICE)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(torch.autograd.grad(run(*inputs), inputs, (dy, ds)))
    for a, a_ in zip(*runs):
        assert torch.equal(a, a_)


def test_partial_sums_cross_row_tiles_and_column_blocks(monkeypatch):
    """dweight, dbias and dx_bias when the partial sums' reduction walks several row tiles (the
    last one ragged) in several column blocks (the last one ragged), as at GPU sizes."""
    monkeypatch.setattr(ln_mod, "SUM_TILE", 128)  # BLOCK_P 4 at 32 columns a program
    monkeypatch.setattr(ln_mod, "_BWD_PLANS", {})
    check_fwd_bwd(make((150, 100), torch.float32))
    (plan,) = ln_mod._BWD_PLANS.values()
    programs, sum_grid, sum_meta = plan[2], plan[5], plan[6]
    assert (sum_meta["BLOCK_N"], sum_meta["BLOCK_P"], sum_grid) == (32, 4, (4,))
    assert programs > sum_meta["BLOCK_P"] and programs % sum_meta["BLOCK_P"] != 0


def _registered(x, r, w, b, xb, norm, p=P):
    if norm == "rms_norm":
        return torch.ops.trifuse.dropout_add_rms_norm(x, r, [x.shape[-1]], w, EPS, p, xb)[:2]
    return torch.ops.trifuse.dropout_add_layer_norm(x, r, [x.shape[-1]], w, b, EPS, p, xb)[:2]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "no-residual"])
def test_eager_path_and_registered_op_are_bitwise_equal(norm, residual):
    inputs = make((5, 70), torch.float32, norm, residual)
    torch.manual_seed(11)
    eager = run(*inputs, norm=norm)
    torch.manual_seed(11)
    op = _registered(*inputs, norm)
    live = [t for t in inputs if t is not None]
    grads_out = [torch.randn_like(o) for o in eager]
    for a, a_ in zip(eager, op):
        assert torch.equal(a, a_)
    for a, a_ in zip(torch.autograd.grad(eager, live, grads_out), torch.autograd.grad(op, live, grads_out)):
        assert torch.equal(a, a_)


@pytest.mark.parametrize("path", ["eager", "registered"])
@pytest.mark.parametrize("norm", NORMS)
def test_only_s_read_leaves_the_norms_parameters_without_gradient(norm, path):
    """The sum read and the normalized y not (a model's last block before a norm nobody uses,
    fused across the boundary): the weight and bias reach the loss through nothing, so their
    gradients are None, as unfused, not zeros an optimizer would decay and step. x, the residual
    and x's bias get s's gradient through the mask; and the other way round, only y read."""
    x, r, w, b, xb = make((5, 70), torch.float32, norm)
    live = [t for t in (x, r, w, b, xb) if t is not None]
    torch.manual_seed(3)
    y, s = run(x, r, w, b, xb, norm) if path == "eager" else _registered(x, r, w, b, xb, norm)
    ds = torch.randn_like(s)
    grads = torch.autograd.grad(s, live, ds, allow_unused=True)
    mask = recover_mask(s.detach(), r)
    ref = run_ref(x, r, w, b, xb, norm, mask)[1]
    expected = torch.autograd.grad(ref, live, ds, allow_unused=True)
    for name, g, e in zip(("x", "residual", "weight", "bias", "x_bias"), grads, expected):
        assert (g is None) == (e is None), name
        if e is not None:
            torch.testing.assert_close(g, e, msg=name)
    assert grads[2] is None
    torch.manual_seed(3)
    y, s = run(x, r, w, b, xb, norm) if path == "eager" else _registered(x, r, w, b, xb, norm)
    assert all(g is not None for g in torch.autograd.grad(y.sum(), live))


@pytest.mark.parametrize("norm", NORMS)
def test_compiles_fullgraph_without_graph_breaks(norm):
    inputs = make((4, 48), torch.float32, norm)
    fn = torch.compile(lambda *a: run(*a, norm=norm), fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    out = fn(*inputs)
    torch.manual_seed(5)
    ref = run(*inputs, norm=norm)
    live = [t for t in inputs if t is not None]
    for a, a_ in zip(out, ref):
        assert torch.equal(a, a_)  # one seed drawn either way: the same mask
    ones = [torch.ones_like(o) for o in out]
    for a, a_ in zip(torch.autograd.grad(out, live, ones), torch.autograd.grad(ref, live, ones)):
        torch.testing.assert_close(a, a_)


def test_opcheck_with_dropout_and_x_bias():
    x, r, w, b, xb = make((3, 16), torch.float32)
    torch.library.opcheck(torch.ops.trifuse.dropout_add_layer_norm.default, (x, r, [16], w, b, EPS, P, xb))
    torch.library.opcheck(torch.ops.trifuse.dropout_add_layer_norm.default, (x, None, [16], w, b, EPS, P, None))
    torch.library.opcheck(torch.ops.trifuse.dropout_add_rms_norm.default, (x, r, [16], w, EPS, P, xb))
    with torch.no_grad():
        y, s, mean, rstd, seed, _ = torch.ops.trifuse.dropout_add_layer_norm(x, r, [16], w, b, EPS, P, xb)
    torch.library.opcheck(torch.ops.trifuse.layer_norm_backward.default,
                          (torch.randn_like(y), torch.randn_like(s), s, [16], w.detach(), mean, rstd, seed, P,
                           False, True))


def test_gradcheck_float64_with_dropout():
    """With the seed fixed before each call the op is a deterministic function: gradcheck it."""
    x, r, w, b, xb = (t.detach().double().requires_grad_() for t in make((3, 9), torch.float64))

    def seeded(*a, norm):
        torch.manual_seed(0)
        return run(*a, norm=norm)

    # fast_mode: a few random directions instead of the full Jacobian (each call is interpreted)
    assert torch.autograd.gradcheck(lambda *a: seeded(*a, norm="layer_norm"), (x, r, w, b, xb), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, r, w, xb: seeded(x, r, w, None, xb, norm="rms_norm"), (x, r, w, xb),
                                    fast_mode=True)


@settings(max_examples=16, deadline=None)
# CI's draw: bf16 activations, fp32 weights; dweight's floor is bf16's, not its own fp32's
@example(m=9, n=9, norm="layer_norm", p=0.0, residual=True, x_bias=True, dtype=torch.bfloat16,
         fp32_weights=True, offset=0.0, strided=False)
# seed 1's: bf16 s = 1e3 + x, where x is under the residual's ulp and dropout is off
@example(m=1, n=46, norm="layer_norm", p=0.0, residual=True, x_bias=False, dtype=torch.bfloat16,
         fp32_weights=False, offset=1e3, strided=False)
@example(m=3, n=46, norm="rms_norm", p=0.2, residual=True, x_bias=True, dtype=torch.bfloat16,
         fp32_weights=False, offset=1e3, strided=False)
@given(m=st.integers(0, 9), n=st.integers(1, 1100), norm=st.sampled_from(NORMS),
       p=st.sampled_from([0.0, 0.2, 0.8]), residual=st.booleans(), x_bias=st.booleans(),
       dtype=st.sampled_from(DTYPES), fp32_weights=st.booleans(), offset=st.sampled_from([0.0, 1e3]),
       strided=st.booleans())
def test_hypothesis_feature_combinations(m, n, norm, p, residual, x_bias, dtype, fp32_weights, offset,
                                         strided):
    """Shapes, dtypes, autocast's fp32 weights, a residual stream far from 0 and a row-strided x,
    drawn together. A random search over these (800 draws) found LayerNorm's mean at 1e3 +- 1
    (_corrected_moments), and this test then its backward's saved mean (_tile_grads)."""
    torch.manual_seed(m * 1000 + n)
    # s = 1e3 + x in bf16 keeps x to 4 (its ulp there): x must move it by more for the mask to be read
    least = 16.0 if offset and dtype == torch.bfloat16 else 0.5
    x, r, w, b, xb = make((m, n), dtype, norm, residual, x_bias, least)
    if r is not None and offset:
        r = (r.detach().double() + offset).to(dtype).requires_grad_()
    if strided:
        wide = torch.zeros(m, n + 5, device=DEVICE, dtype=dtype)
        wide[:, 2:n + 2] = x.detach()
        x = wide[:, 2:n + 2].requires_grad_()
    if fp32_weights:  # x_bias stays in x's dtype: s is in x's (the reference would promote it)
        w, b = (None if t is None else t.detach().float().requires_grad_() for t in (w, b))
    check_fwd_bwd([x, r, w, b, xb], norm, p)


# ---------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations must fail the same tolerance.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_mask_off_by_one_column_fails(dtype):
    inputs = make((16, 64), dtype)
    y, s = run(*inputs)
    shifted = torch.roll(recover_mask(s, inputs[1]), 1, dims=1)
    y64, s64 = run_ref(*upcast(inputs), "layer_norm", shifted)
    for name, out, ref in (("y", y, y64), ("s", s, s64)):
        ok, msg = check_close(f"{name} with the mask off by one", out, ref, None)
        assert not ok, msg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_dropout_after_the_residual_add_fails(dtype):
    """s = dropout(residual + x + x_bias) (the residual dropped too) must not pass."""
    x, r, _, _, xb = inputs = make((16, 64), dtype)
    _, s = run(*inputs)
    mask = recover_mask(s, r)
    wrong = torch.where(mask, (r.double() + x.double() + xb.double()) / (1 - P), 0.0).to(dtype)
    _, s64 = run_ref(*upcast(inputs), "layer_norm", mask)
    ok, msg = check_close("dropout after the add", wrong, s64, None)
    assert not ok, msg


def test_reference_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: same maths and API, its own
    random stream, regenerated in the backward."""
    monkeypatch.setattr(ln_mod, "use_triton", lambda t: False)
    for norm in NORMS:
        check_fwd_bwd(make((6, 37), torch.float32, norm), norm)
        check_fwd_bwd(make((6, 37), torch.float32, norm, residual=False), norm)
