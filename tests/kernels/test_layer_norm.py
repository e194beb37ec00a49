"""LayerNorm / RMSNorm, the pre-norm residual form (add, then norm) and the post-norm one
(norm, then add: `-post` variants, trifuse.ops.layer_norm_add) against the float64 oracle.

On CPU these run the real Triton kernels in the interpreter (tests/_device.py); on a GPU the
same tests run natively and add bf16.
"""
import mmap
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close

from _device import DEVICE, INTERPRETED
from _fusing import assert_readers_sum_in_fp32_when_traced
import trifuse
from trifuse.autotune import configs
from trifuse.kernels import layer_norm as ln_mod
from trifuse.kernels._common import next_power_of_2
from trifuse.kernels.layer_norm import layer_norm_ref

# widths: 1, odd, just past a power of two, past one block, and the wide (chunked) path
SHAPES = [(1, 1), (3, 7), (4, 100), (2, 129), (5, 1000), (2, 4097), (0, 32), (2, 3, 50), (2, 2, 3, 17)]
WIDE_SHAPES = [(2, 20000), (1, 65536)]
VARIANTS = ["layer_norm", "layer_norm-no-affine", "rms_norm", "layer_norm-residual", "rms_norm-residual",
            "layer_norm-post", "rms_norm-post"]


def _ids(shape):
    return "x".join(map(str, shape))


def make(shape, dtype, variant, scale=1.0, offset=0.0):
    n = shape[-1]
    x = (torch.randn(shape, device=DEVICE, dtype=torch.float64) * scale + offset).to(dtype).requires_grad_()
    affine = "no-affine" not in variant
    w = torch.randn(n, device=DEVICE, dtype=dtype, requires_grad=True) if affine else None
    b = torch.randn(n, device=DEVICE, dtype=dtype, requires_grad=True) if affine and "layer" in variant else None
    with_r = "residual" in variant or "post" in variant
    r = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True) if with_r else None
    return x, w, b, r


@pytest.fixture(autouse=True)
def trifuse_kernels_only(monkeypatch):
    """These tests are of trifuse's kernels: on a GPU the layer_norm dialect may pick F.layer_norm."""
    monkeypatch.setattr(ln_mod.LAYER_NORM, "key", lambda *args: None)


def run_trifuse(variant, x, w, b, r, eps=1e-5):
    n = x.shape[-1]
    if variant.endswith("-post"):
        return trifuse.ops.layer_norm_add(x, r, (n,), w, b, eps, is_rms_norm=variant.startswith("rms"))
    if variant.startswith("rms"):
        return trifuse.ops.rms_norm(x, (n,), w, eps, residual=r)
    return trifuse.ops.layer_norm(x, (n,), w, b, eps, residual=r)


def run_ref(variant, x, w, b, r, eps=1e-5):
    """The spec; for `-post` the model's spelling, r + norm(x) (in a low dtype the norm's output is
    rounded before the add, as in the model)."""
    if variant.endswith("-post"):
        return r + layer_norm_ref(x, (x.shape[-1],), w, b, eps, is_rms_norm=variant.startswith("rms"))
    return layer_norm_ref(x, (x.shape[-1],), w, b, eps, r, is_rms_norm=variant.startswith("rms"))


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def upcast(*ts):
    return [None if t is None else t.detach().double().requires_grad_() for t in ts]


def lowp(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def check_fwd_bwd(variant, dtype, x, w, b, r):
    """Forward outputs and every gradient against float64, bounded by PyTorch's own error."""
    inputs = [t for t in (x, w, b, r) if t is not None]
    out = as_tuple(run_trifuse(variant, x, w, b, r))
    x64, w64, b64, r64 = upcast(x, w, b, r)
    ref = as_tuple(run_ref(variant, x64, w64, b64, r64))
    xl, wl, bl, rl = lowp(x, w, b, r)
    ref_lp = as_tuple(run_ref(variant, xl, wl, bl, rl))
    for i, (o, o64, olp) in enumerate(zip(out, ref, ref_lp)):
        assert o.dtype == dtype and o.shape == x.shape
        assert_close(f"{variant} out{i}", o, o64, olp)
    if x.numel() == 0:
        return
    grads_out = [torch.randn_like(o) for o in out]
    g = torch.autograd.grad(out, inputs, grads_out)
    g64 = torch.autograd.grad(ref, [t for t in (x64, w64, b64, r64) if t is not None], [d.double() for d in grads_out])
    glp = torch.autograd.grad(ref_lp, [t for t in (xl, wl, bl, rl) if t is not None], grads_out)
    for name, a, a64, alp in zip(("dx", "dweight", "dbias", "dresidual"), g, g64, glp):
        assert a.dtype == dtype
        assert_close(f"{variant} {name}", a, a64, alp)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, shape, variant):
    check_fwd_bwd(variant, dtype, *make(shape, dtype, variant))


@pytest.mark.parametrize("variant", ["layer_norm", "rms_norm-residual", "layer_norm-post"])
@pytest.mark.parametrize("shape", WIDE_SHAPES, ids=_ids)
def test_wide_rows_use_the_chunked_path(shape, variant):
    assert shape[-1] > ln_mod.MAX_SINGLE_BLOCK_BWD
    check_fwd_bwd(variant, torch.float32, *make(shape, torch.float32, variant))


@pytest.mark.parametrize("frozen", ["weight", "bias", "both"])
@pytest.mark.parametrize("shape", [(5, 1000), WIDE_SHAPES[0]], ids=_ids)  # one block; the chunked path
def test_frozen_parameters_get_no_share_and_the_other_gradients_hold(shape, frozen):
    """A frozen weight or bias (requires_grad False): the backward accumulates and sums no share
    for it, and the gradients still asked for match float64."""
    n = shape[-1]
    x, w, b, _ = make(shape, torch.float32, "layer_norm")
    w.requires_grad_(frozen == "bias")
    b.requires_grad_(frozen == "weight")
    wanted = [i for i, t in enumerate((x, w, b)) if t.requires_grad]
    dy = torch.randn(shape, device=DEVICE)
    out = trifuse.ops.layer_norm(x, (n,), w, b)
    got = torch.autograd.grad(out, [(x, w, b)[i] for i in wanted], dy)
    x64, w64, b64 = upcast(x, w, b)
    want64 = torch.autograd.grad(layer_norm_ref(x64, (n,), w64, b64, 1e-5), [(x64, w64, b64)[i] for i in wanted],
                                 dy.double())
    xl, wl, bl = lowp(x, w, b)
    want_lp = torch.autograd.grad(layer_norm_ref(xl, (n,), wl, bl, 1e-5), [(xl, wl, bl)[i] for i in wanted], dy)
    for i, a, a64, alp in zip(wanted, got, want64, want_lp):
        assert_close(f"frozen {frozen}: {('dx', 'dweight', 'dbias')[i]}", a, a64, alp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_offset_and_scale(dtype):
    """Mean 1e3 and spread 1e2 (fp16 still represents them): no cancellation in the variance."""
    check_fwd_bwd("layer_norm", dtype, *make((4, 300), dtype, "layer_norm", scale=100.0, offset=1000.0))


@pytest.mark.parametrize("variant", ["layer_norm", "layer_norm-residual", "layer_norm-post"])
@pytest.mark.parametrize("shape", [(4, 768), WIDE_SHAPES[0]], ids=_ids)  # one block; the chunked path
def test_large_mean_small_spread_normalizes_at_the_rounding_floor(shape, variant):
    """Rows of 1e4 +- 1 in fp32: a mean summed in fp32 is ~1e-3 off there (fp32's ulp at 1e4),
    and y = (s - mean) * rstd with it (PyTorch's CPU kernel 2.6e-3 off); the mean saved for the
    backward, rounded to fp32, is 5e-4 off (PyTorch's dweight 5.7e-3 off). The forward corrects
    its mean with the mean of s - mean (the corrected two-pass algorithm), the backward its
    saved one the same way: y and every gradient within twice their own rounding of float64's,
    plus the fp32 floor. With a residual the norm is of s as stored (x + r rounded to fp32, as
    PyTorch's add rounds it), the reference's too, and dresidual is dx."""
    x, w, b, r = make(shape, torch.float32, variant, offset=1e4)
    out = as_tuple(run_trifuse(variant, x, w, b, r))
    leaves = [x, w, b] + ([r] if variant.endswith("-post") else [])
    x_ref = x
    if variant.endswith("-residual"):
        assert torch.equal(out[1], x + r)
        x_ref = out[1]
    x64, w64, b64, r64 = upcast(x_ref, w, b, r if variant.endswith("-post") else None)
    ref = as_tuple(run_ref(variant.removesuffix("-residual"), x64, w64, b64, r64))[0]
    assert_close(f"{variant} y", out[0], ref, None)
    dy = torch.randn_like(out[0])
    grads = torch.autograd.grad(out[0], leaves + ([r] if variant.endswith("-residual") else []), dy)
    want = torch.autograd.grad(ref, [t for t in (x64, w64, b64, r64) if t is not None], dy.double())
    for name, got, exact in zip(("dx", "dweight", "dbias", "dresidual"), grads, want):
        assert_close(f"{variant} {name}", got, exact, None)
    if variant.endswith("-residual"):
        assert torch.equal(grads[3], grads[0])


@pytest.mark.parametrize("variant", ["layer_norm", "rms_norm-residual", "rms_norm-post"])
def test_strided_inputs(variant):
    """Sliced rows (a view with a row stride) and permuted tensors (a copy) both stay right."""
    big = torch.randn(6, 150, device=DEVICE, requires_grad=True)
    x = big[:, 10:110]  # (6, 100), row stride 150
    _, w, b, r = make((6, 100), torch.float32, variant)
    check_fwd_bwd(variant, torch.float32, x, w, b, r)
    xt = torch.randn(40, 5, 3, device=DEVICE).permute(2, 1, 0).requires_grad_()  # (3, 5, 40)
    _, w, b, r = make((3, 5, 40), torch.float32, variant)
    if r is not None:
        r = torch.randn(40, 5, 3, device=DEVICE).permute(2, 1, 0).requires_grad_()
    check_fwd_bwd(variant, torch.float32, xt, w, b, r)


def test_strided_weight_and_multi_dim_normalized_shape():
    x = torch.randn(3, 4, 5, device=DEVICE, requires_grad=True)
    w = torch.randn(4, 10, device=DEVICE)[:, ::2].requires_grad_()  # (4, 5), not contiguous
    b = torch.randn(4, 5, device=DEVICE, requires_grad=True)
    y = trifuse.ops.layer_norm(x, (4, 5), w, b)
    ref = F.layer_norm(x.double(), (4, 5), w.double(), b.double())
    assert_close("y", y, ref, F.layer_norm(x, (4, 5), w, b))
    g = torch.randn_like(y)
    for a, a64 in zip(torch.autograd.grad(y, (x, w, b), g), torch.autograd.grad(ref, (x, w, b), g.double())):
        assert_close("grad", a, a64, None)


def test_nan_and_inf_propagate_like_pytorch():
    x = torch.randn(4, 33, device=DEVICE)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    y = trifuse.ops.layer_norm(x, (33,))
    ref = F.layer_norm(x, (33,))
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert_close("finite rows", y[[0, 3]], ref[[0, 3]].double(), None)


def test_gradcheck_float64():
    x = torch.randn(3, 9, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, device=DEVICE, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 9, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: trifuse.ops.layer_norm(a[0], (9,), a[1], a[2]), (x, w, b))
    assert torch.autograd.gradcheck(lambda *a: trifuse.ops.rms_norm(a[0], (9,), a[1], 1e-6, residual=a[2]), (x, w, r))
    assert torch.autograd.gradcheck(
        lambda *a: torch.ops.trifuse.dropout_add_layer_norm(a[0], a[1], [9], a[2], a[3], 1e-5, 0.0, None)[:2],
        (x, r, w, b))
    assert torch.autograd.gradcheck(lambda *a: trifuse.ops.layer_norm_add(a[0], a[1], (9,), a[2], a[3]), (x, r, w, b))
    assert torch.autograd.gradcheck(lambda *a: torch.ops.trifuse.rms_norm_add(a[0], a[1], [9], a[2], 1e-6)[0],
                                    (x, r, w))


def test_weight_grads_are_deterministic():
    """dweight/dbias come from fixed-order partial sums: bitwise equal run to run."""
    x, w, b, r = make((37, 130), torch.float32, "layer_norm-residual")
    results = []
    for _ in range(2):
        y, s = run_trifuse("layer_norm-residual", x, w, b, r)
        results.append(torch.autograd.grad((y.sum() + s.square().sum()), (x, w, b, r)))
    for a, b_ in zip(*results):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("variant", VARIANTS)
def test_eager_path_and_registered_op_are_bitwise_equal(variant):
    x, w, b, r = make((5, 70), torch.float32, variant)
    n, eps = 70, 1e-5
    eager = as_tuple(run_trifuse(variant, x, w, b, r))
    if variant == "layer_norm" or variant == "layer_norm-no-affine":
        op = torch.ops.trifuse.layer_norm(x, [n], w, b, eps)[:1]
    elif variant == "rms_norm":
        op = torch.ops.trifuse.rms_norm(x, [n], w, eps)[:1]
    elif variant == "layer_norm-residual":
        op = torch.ops.trifuse.dropout_add_layer_norm(x, r, [n], w, b, eps, 0.0, None)[:2]
    elif variant == "layer_norm-post":
        op = torch.ops.trifuse.layer_norm_add(x, r, [n], w, b, eps)[:1]
    elif variant == "rms_norm-post":
        op = torch.ops.trifuse.rms_norm_add(x, r, [n], w, eps)[:1]
    else:
        op = torch.ops.trifuse.dropout_add_rms_norm(x, r, [n], w, eps, 0.0, None)[:2]
    inputs = [t for t in (x, w, b, r) if t is not None]
    dys = [torch.randn_like(o) for o in eager]
    for a, b_ in zip(eager, op):
        assert torch.equal(a, b_)
    for a, b_ in zip(torch.autograd.grad(eager, inputs, dys), torch.autograd.grad(op, inputs, dys)):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compiles_fullgraph_without_graph_breaks(variant):
    x, w, b, r = make((4, 48), torch.float32, variant)
    fn = torch.compile(lambda *a: run_trifuse(variant, *a), fullgraph=True, backend="aot_eager")
    out, ref = as_tuple(fn(x, w, b, r)), as_tuple(run_trifuse(variant, x, w, b, r))
    inputs = [t for t in (x, w, b, r) if t is not None]
    for a, b_ in zip(out, ref):
        torch.testing.assert_close(a, b_)
    for a, b_ in zip(torch.autograd.grad(out, inputs, [torch.ones_like(o) for o in out]),
                     torch.autograd.grad(ref, inputs, [torch.ones_like(o) for o in ref])):
        torch.testing.assert_close(a, b_)


def test_opcheck_every_op():
    x = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    r = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    b = torch.randn(16, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.trifuse.layer_norm.default, (x, [16], w, b, 1e-5))
    torch.library.opcheck(torch.ops.trifuse.rms_norm.default, (x, [16], w, 1e-6))
    torch.library.opcheck(torch.ops.trifuse.dropout_add_layer_norm.default, (x, r, [16], w, b, 1e-5, 0.0, None))
    torch.library.opcheck(torch.ops.trifuse.dropout_add_rms_norm.default, (x, r, [16], w, 1e-6, 0.0, b))
    torch.library.opcheck(torch.ops.trifuse.layer_norm_add.default, (x, r, [16], w, b, 1e-5))
    torch.library.opcheck(torch.ops.trifuse.rms_norm_add.default, (x, r, [16], None, 1e-6))


def test_autocast_keeps_activation_dtype_and_accuracy():
    x = torch.randn(4, 64, device=DEVICE, dtype=torch.float16, requires_grad=True)
    ln = torch.nn.LayerNorm(64, device=DEVICE)  # fp32 master weights
    with torch.autocast(DEVICE, dtype=torch.float16):
        y = trifuse.ops.layer_norm(x, (64,), ln.weight, ln.bias)
    assert y.dtype == torch.float16
    ref = F.layer_norm(x.double(), (64,), ln.weight.double(), ln.bias.double())
    assert_close("autocast", y, ref, None)
    y.sum().backward()
    assert ln.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float16
    # the fp32 weight grads, cast once from the fp32 partial sums (never through fp16)
    assert_close("dweight", ln.weight.grad, ((x.double() - x.double().mean(1, keepdim=True))
                                             * (x.double().var(1, unbiased=False, keepdim=True) + 1e-5).rsqrt()).sum(0), None)
    assert_close("dbias", ln.bias.grad, torch.full((64,), 4.0, dtype=torch.float64, device=DEVICE), None)


@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
def test_norm_add_with_a_wider_residual(is_rms_norm):
    """Autocast's mix in a post-norm block: the fp16 sublayer output normed and added to the fp32
    residual stream (fp32 weights). y is fp32 as `residual + norm(x)` is; dresidual is dy in
    fp32, dx fp16."""
    x = torch.randn(6, 96, device=DEVICE, dtype=torch.float16, requires_grad=True)
    r = torch.randn(6, 96, device=DEVICE, requires_grad=True)
    w = torch.randn(96, device=DEVICE, requires_grad=True)
    b = None if is_rms_norm else torch.randn(96, device=DEVICE, requires_grad=True)
    y = trifuse.ops.layer_norm_add(x, r, 96, w, b, 1e-6, is_rms_norm=is_rms_norm)
    assert y.dtype == torch.float32
    params = [t for t in (x, r, w, b) if t is not None]
    x64, r64, w64, b64 = upcast(x, r, w, b)
    ref = r64 + layer_norm_ref(x64, (96,), w64, b64, 1e-6, is_rms_norm=is_rms_norm)
    # PyTorch's own: the model's norm output in fp16 (its input dtype), then the fp32 add
    lp = r.detach() + layer_norm_ref(x.detach().float(), (96,), w.detach(), None if b is None else b.detach(),
                                     1e-6, is_rms_norm=is_rms_norm).half()
    assert_close("y", y, ref, lp)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, params, dy)
    want = torch.autograd.grad(ref, [t for t in (x64, r64, w64, b64) if t is not None], dy.double())
    for name, a, a64, t in zip(("dx", "dresidual", "dweight", "dbias"), got, want, params):
        assert a.dtype == t.dtype
        assert_close(name, a, a64, None)
    assert torch.equal(got[1], dy)


def test_modules_load_torch_state_dicts():
    ref = torch.nn.LayerNorm(24, device=DEVICE)
    torch.nn.init.normal_(ref.weight)
    ours = trifuse.nn.LayerNorm(24, device=DEVICE)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 24, device=DEVICE)
    assert_close("LayerNorm", ours(x), ref(x.double().to(torch.float32)).double(), ref(x))
    rms_ref = torch.nn.RMSNorm(24, eps=1e-6, device=DEVICE)
    torch.nn.init.normal_(rms_ref.weight)
    rms = trifuse.nn.RMSNorm(24, eps=1e-6, device=DEVICE)
    rms.load_state_dict(rms_ref.state_dict())
    assert_close("RMSNorm", rms(x), rms_ref(x).double(), None)
    assert set(rms.state_dict()) == set(rms_ref.state_dict())


@settings(max_examples=15, deadline=None)
@given(m=st.integers(0, 9), n=st.integers(1, 300), variant=st.sampled_from(VARIANTS))
def test_hypothesis_shapes(m, n, variant):
    torch.manual_seed(m * 1000 + n)
    check_fwd_bwd(variant, torch.float32, *make((m, n), torch.float32, variant))


# ---------------------------------------------------------------------------------------------
# The backward's partial sums at GPU sizes: what the interpreter's 4 SMs and small tensors hide.
# ---------------------------------------------------------------------------------------------

# widths around the sum's column blocks and the wide path; rows: one, a few, 528 (4 x 132 SMs)
PLAN_WIDTHS = [1, 7, 1000, 1025, 2049, 8193, 16384, 16385, 20000, 1 << 22]
PLAN_ROWS = [1, 3, 528, 4097]


@pytest.mark.parametrize("n", PLAN_WIDTHS)
def test_sum_plan_covers_every_column_once(n):
    """Power-of-two blocks, a grid that covers n with no program past it, a tile of at most
    SUM_TILE fp32 (registers), for the partial-row counts a GPU runs (up to 4 x 132 SMs)."""
    for programs in PLAN_ROWS:
        (grid,), meta = ln_mod._sum_plan(n, programs, {})
        block_n, block_p = meta["BLOCK_N"], meta["BLOCK_P"]
        assert next_power_of_2(block_n) == block_n and next_power_of_2(block_p) == block_p
        assert (grid - 1) * block_n < n <= grid * block_n < 2**31
        assert 1 <= block_p <= next_power_of_2(programs) and block_n * block_p <= max(ln_mod.SUM_TILE, block_n)


@pytest.mark.parametrize("n", PLAN_WIDTHS)
def test_bwd_plan_writes_every_partial_row(n):
    """At every config and a GPU's SM count: one program per partial row, each owning at least
    one row (single-block programs store their row into torch.empty), rows in whole BLOCK_M
    tiles; the wide path, which adds into its row, gets a zeroed buffer."""
    for sms in (4, 132):
        for cfg in configs.norm_bwd(n):
            for m in PLAN_ROWS:
                grid, meta, programs, rows_per_program, zero, sum_grid, sum_meta = ln_mod._bwd_plan(
                    cfg, m, n, sms, {}, {})
                assert grid == (programs,) and 1 <= programs <= cfg.kwargs["PROGRAMS_PER_SM"] * sms
                assert (programs - 1) * rows_per_program < m <= programs * rows_per_program
                assert rows_per_program % meta["BLOCK_M"] == 0
                assert zero == (n > ln_mod.MAX_SINGLE_BLOCK_BWD) == (not meta["SINGLE_BLOCK"])
                assert (sum_grid, sum_meta) == ln_mod._sum_plan(n, programs, {})


@pytest.mark.parametrize("programs, n", [(528, 7), (528, 1025), (3, 20000), (4097, 1)],
                         ids=["528x7", "528x1025", "3x20000", "4097x1"])
def test_partial_sums_at_gpu_program_counts(programs, n):
    """The reduction alone, at the partial-row counts a GPU step makes (4 x 132 SMs; the
    interpreter's 4 SMs make at most 8): ragged row tiles and column blocks, summed in fp32."""
    rows = torch.randn(3, programs, n, device=DEVICE) * 100 + 1000  # fp16 sums would be off by ~10
    vecs = [torch.full((n,), float("nan"), device=DEVICE) for _ in range(3)]
    grid, meta = ln_mod._sum_plan(n, programs, {"STORE_DW": True, "STORE_DB": True, "STORE_DXB": True})
    ln_mod._sum_partials.run(grid, (rows, *vecs, programs, n, programs * n), meta)
    for k, name in enumerate(("dweight", "dbias", "dx_bias")):
        assert_close(name, vecs[k], rows[k].double().sum(0), rows[k].sum(0))


def _unreserved_f32(elements: int) -> torch.Tensor:
    """A float32 CPU tensor over an anonymous mapping that reserves no memory: pages never
    written read as zero and cost nothing, so a test can address past 2^31 elements."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    try:
        buf = mmap.mmap(-1, elements * 4, flags=flags)
    except (OSError, OverflowError) as e:
        pytest.skip(f"no {elements * 4 / 2**30:.0f} GiB unreserved mapping here: {e}")
    return torch.frombuffer(buf, dtype=torch.float32)


@pytest.mark.skipif(not INTERPRETED or not sys.platform.startswith("linux"),
                    reason="CPU tensors in the interpreter, over a Linux MAP_NORESERVE mapping")
def test_partial_sums_address_vectors_past_2_31_elements():
    """The partial buffer's third vector starts 2 x programs x N elements in, past 2^31 once
    programs x N >= 2^30 (528 programs, N of about 2M), while programs x N itself still comes as
    an int32 argument: 2 * stride_pk in int32 wrapped to a negative offset. The stride is given
    directly, so only a few rows are summed; a wrapped offset lands 8 GiB below the buffer, in
    pages never written (zeros)."""
    stride_pk, below, programs, n = 2**30 + 64, 2**31, 3, 40
    partial = _unreserved_f32(below + 3 * stride_pk)[below:]
    rows = torch.randn(3, programs, n)
    for k in range(3):
        partial[k * stride_pk:k * stride_pk + programs * n] = rows[k].reshape(-1)
    vecs = [torch.full((n,), float("nan")) for _ in range(3)]
    grid, meta = ln_mod._sum_plan(n, programs, {"STORE_DW": True, "STORE_DB": True, "STORE_DXB": True})
    ln_mod._sum_partials.run(grid, (partial, *vecs, programs, n, stride_pk), meta)
    for k, name in enumerate(("dweight", "dbias", "dx_bias")):
        assert_close(name, vecs[k], rows[k].double().sum(0), rows[k].sum(0))


@pytest.mark.parametrize("variant", ["layer_norm", "rms_norm-residual"])
@pytest.mark.parametrize("shape", [(37, 130), (3, 16385)], ids=_ids)
def test_backward_reads_no_uninitialized_memory(monkeypatch, shape, variant):
    """Under torch.use_deterministic_algorithms, torch.empty fills floats with NaN: any partial
    row or output column the kernels leave unwritten, or the wide path adding into a buffer not
    zeroed, shows as NaN (the GPU's caching allocator hands back old bytes; the CPU's fresh pages
    are zeros)."""
    monkeypatch.setattr(ln_mod, "_BWD_PLANS", {})
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        check_fwd_bwd(variant, torch.float32, *make(shape, torch.float32, variant))
    finally:
        torch.use_deterministic_algorithms(previous)


# ---------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations must fail the same tolerance.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_wrong_eps_fails(dtype):
    x, w, b, _ = make((8, 64), dtype, "layer_norm", scale=0.01)
    wrong = trifuse.ops.layer_norm(x, (64,), w, b, eps=1e-3)
    ref = layer_norm_ref(*upcast(x, w, b)[:1], (64,), *upcast(w, b), 1e-5)
    ok, msg = check_close("wrong eps", wrong, ref, F.layer_norm(x, (64,), w, b, 1e-5))
    assert not ok, msg


def test_negative_control_residual_added_before_the_norm_fails():
    """The pre-norm form where the post-norm one is meant (norm(x + r) for r + norm(x))."""
    x, w, b, r = make((6, 80), torch.float32, "layer_norm-post")
    wrong = trifuse.ops.layer_norm(x, (80,), w, b, residual=r)[0]
    ok, msg = check_close("norm before the add", wrong, run_ref("layer_norm-post", *upcast(x, w, b, r)),
                          run_ref("layer_norm-post", x, w, b, r))
    assert not ok, msg


def test_negative_control_missing_mean_term_in_dx_fails():
    """The RMSNorm backward formula applied to a LayerNorm (drops mean(g)): must not pass."""
    x, w, b, _ = make((6, 50), torch.float32, "layer_norm")
    y, _, mean, rstd = ln_mod.layer_norm_fwd(x.detach(), 50, w.detach(), b.detach(), 1e-5)
    dy = torch.randn_like(y)
    xhat = (x.detach() - mean[:, None]) * rstd[:, None]
    g = dy * w.detach()
    wrong_dx = (g - xhat * (xhat * g).mean(1, keepdim=True)) * rstd[:, None]
    x64, w64, b64 = upcast(x, w, b)
    (dx64,) = torch.autograd.grad(F.layer_norm(x64, (50,), w64, b64), x64, dy.double())
    ok, msg = check_close("dx without mean(g)", wrong_dx, dx64, None)
    assert not ok, msg


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the op and the argument, in eager and under compile.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"weight": torch.ones(5)}, ValueError, "layer_norm: weight must have shape"),
        ({"normalized_shape": (9,)}, ValueError, "normalized_shape"),
        ({"x": torch.ones(3, 8, dtype=torch.int64)}, TypeError, "layer_norm: input must be float"),
        ({"weight": torch.ones(8, dtype=torch.int32)}, TypeError, "layer_norm: weight must be float"),
        ({"residual": torch.ones(3, 7)}, ValueError, "residual must have shape"),
        ({"eps": -1.0}, ValueError, "eps must be a non-negative"),
        ({"x": "not a tensor"}, TypeError, "input must be a torch.Tensor"),
        # the weight passed where normalized_shape goes (F.layer_norm's order is the same)
        ({"normalized_shape": torch.ones(8)}, TypeError,
         "layer_norm: normalized_shape must be an int or a sequence of ints, got Tensor"),
        ({"normalized_shape": (8.0,)}, TypeError, "normalized_shape must be an int or a sequence of ints, got tuple of float"),
        ({"weight": 1.0}, TypeError, "layer_norm: weight must be a torch.Tensor, got float"),
    ],
    ids=["weight-shape", "normalized-shape", "int-input", "int-weight", "residual-shape", "eps", "not-tensor",
         "tensor-shape", "float-shape", "float-weight"],
)
def test_bad_input_raises_clear_error(kwargs, exc, match):
    args = {"x": torch.ones(3, 8, device=DEVICE), "normalized_shape": (8,), "weight": None, "residual": None, "eps": 1e-5}
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    with pytest.raises(exc, match=match):
        trifuse.ops.layer_norm(args["x"], args["normalized_shape"], args["weight"], None, args["eps"], args["residual"])


def test_bad_input_raises_under_compile():
    fn = torch.compile(lambda x, w: trifuse.ops.layer_norm(x, (8,), w), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="weight must have shape"):
        fn(torch.ones(3, 8, device=DEVICE), torch.ones(5, device=DEVICE))


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"residual": None}, ValueError, "layer_norm_add: residual must be a tensor shaped like input"),
    ({"residual": torch.ones(3, 7)}, ValueError, "layer_norm_add: residual must have shape"),
    ({"residual": torch.ones(3, 8, dtype=torch.int64)}, TypeError, "layer_norm_add: residual must be float"),
    ({"bias": torch.ones(8), "is_rms_norm": True}, ValueError, "rms_norm_add: RMSNorm takes no bias"),
    ({"eps": -1.0, "is_rms_norm": True}, ValueError, "rms_norm_add: eps must be a non-negative"),
], ids=["no-residual", "residual-shape", "int-residual", "rms-bias", "eps"])
def test_norm_add_bad_input_raises_clear_error(kwargs, exc, match):
    args = {"residual": torch.ones(3, 8), "bias": None, "eps": 1e-5, "is_rms_norm": False, **kwargs}
    residual = args["residual"].to(DEVICE) if args["residual"] is not None else None
    bias = args["bias"].to(DEVICE) if args["bias"] is not None else None
    with pytest.raises(exc, match=match):
        trifuse.ops.layer_norm_add(torch.ones(3, 8, device=DEVICE), residual, 8, None, bias, args["eps"],
                                   is_rms_norm=args["is_rms_norm"])
    if args["bias"] is None:  # the registered ops raise the same under compile
        fn = torch.compile(lambda x, r: trifuse.ops.layer_norm_add(x, r, 8, None, None, args["eps"],
                                                                   is_rms_norm=args["is_rms_norm"]),
                           fullgraph=True, backend="aot_eager")
        with pytest.raises(Exception, match=match.split(": ", 1)[1]):
            fn(torch.ones(3, 8, device=DEVICE), residual)


def test_mismatched_devices_raise():
    with pytest.raises(ValueError, match="weight is on meta"):
        trifuse.ops.layer_norm(torch.ones(3, 8, device=DEVICE), (8,), torch.ones(8, device="meta"))


def test_reference_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: same maths, same API."""
    monkeypatch.setattr(ln_mod, "use_triton", lambda t: False)
    for variant in VARIANTS:
        check_fwd_bwd(variant, torch.float32, *make((4, 37), torch.float32, variant))


# ---------------------------------------------------------------------------------------------
# out_dtype: y written in another dtype (fuse sets it under autocast, fusion/narrow.py)
# ---------------------------------------------------------------------------------------------


def _norm_call(op, x, w, b, out_dtype, residual=None, readers=1, full_y=False):
    kw = {"out_dtype": out_dtype, "readers": readers, "full_y": full_y}
    if op == "layer_norm":
        return trifuse.ops.layer_norm(x, x.shape[-1:], w, b, 1e-5, residual=residual, **kw)
    if op == "rms_norm":
        return trifuse.ops.rms_norm(x, x.shape[-1:], w, 1e-5, residual=residual, **kw)
    return trifuse.ops.dropout_add_layer_norm(x, residual, x.shape[-1:], w, b, 1e-5, p=0.3, x_bias=b, **kw)


@pytest.mark.parametrize("op, with_residual, candidate", [
    ("layer_norm", False, "trifuse"), ("layer_norm", False, "torch"), ("rms_norm", False, "trifuse"),
    ("rms_norm", False, "torch"),  # the residual forms have no dialect: trifuse's kernels
    ("layer_norm", True, "trifuse"), ("rms_norm", True, "trifuse"),
    ("dropout_add_layer_norm", True, "trifuse")])
def test_out_dtype_is_the_cast_of_y_without_a_cast_pass(op, with_residual, candidate, monkeypatch):
    """y in out_dtype is bitwise y.to(out_dtype), s keeps its dtype, and the gradients (y's
    arriving in out_dtype) are bitwise those of the cast's backward; with the dialect choosing
    either candidate (PyTorch's y is cast)."""
    torch.manual_seed(0)
    x = torch.randn(6, 37, device=DEVICE, requires_grad=True)
    r = torch.randn(6, 37, device=DEVICE, requires_grad=True) if with_residual else None
    w, b = (torch.randn(37, device=DEVICE, requires_grad=True) for _ in range(2))
    dialect = ln_mod.RMS_NORM if op == "rms_norm" else ln_mod.LAYER_NORM
    monkeypatch.setattr(dialect, "key", ln_mod._rms_norm_key if op == "rms_norm" else ln_mod._layer_norm_key)
    args = (x, (37,), w, 1e-5) if op == "rms_norm" else (x, (37,), w, b, 1e-5)
    # the plain call and the narrowed one (a choice of its own, timed with the casts it needs)
    for key in (dialect.key(*args), dialect.key(*args, torch.float16, 1, False)):
        monkeypatch.setitem(dialect._memo, key, dialect.candidate(candidate).fn)
    inputs = [t for t in (x, r, w, b if op != "rms_norm" else None) if t is not None]
    outs = []
    for out_dtype in (None, torch.float16):
        torch.manual_seed(1)  # the same dropout mask
        out = _norm_call(op, x, w, b, out_dtype, r)
        y, s = out if isinstance(out, tuple) else (out, None)
        dy = torch.randn(y.shape, device=DEVICE).to(torch.float16)
        grads = torch.autograd.grad([t for t in (y, s) if t is not None], inputs,
                                    [dy.to(y.dtype)] + ([torch.ones_like(s)] if s is not None else []))
        outs.append((y, s, grads))
    if not with_residual:
        assert dialect.implementation(*args, torch.float16, 1, False) is dialect.candidate(candidate).fn
    (y32, s32, g32), (y16, s16, g16) = outs
    assert y16.dtype == torch.float16 and torch.equal(y16, y32.to(torch.float16))
    assert s16 is None or (s16.dtype == torch.float32 and torch.equal(s16, s32))
    for a, c in zip(g32, g16):
        assert a.dtype == c.dtype and torch.equal(a, c)


@pytest.mark.parametrize("readers, full_y", [(1, False), (2, False), (1, True)])
def test_out_dtype_through_the_registered_op(readers, full_y):
    """Traced calls (torch.compile) run the registered op and cast y after it, once per reader
    (after y itself with full_y)."""
    x = torch.randn(4, 24, device=DEVICE)
    w = torch.randn(24, device=DEVICE)
    fn = torch.compile(lambda x, w: trifuse.ops.layer_norm(x, (24,), w, None, 1e-5, out_dtype=torch.float16,
                                                           readers=readers, full_y=full_y),
                       fullgraph=True, backend="aot_eager")
    ys = fn(x, w)
    ys = ys if readers + full_y > 1 else (ys,)
    assert len(ys) == readers + full_y
    expected = F.layer_norm(x, (24,), w, None, 1e-5)
    for i, y in enumerate(ys):
        assert y.dtype == (torch.float32 if full_y and i == 0 else torch.float16)
        torch.testing.assert_close(y, expected.to(y.dtype))


@pytest.mark.parametrize("bad", [torch.int32, "float16", 16])
def test_out_dtype_must_be_a_float_dtype(bad):
    x = torch.randn(2, 8, device=DEVICE)
    for call in (lambda: trifuse.ops.layer_norm(x, (8,), out_dtype=bad),
                 lambda: trifuse.ops.rms_norm(x, (8,), out_dtype=bad),
                 lambda: trifuse.ops.layer_norm(x, (8,), residual=x, out_dtype=bad)):
        with pytest.raises(TypeError, match=r"trifuse\.\w+: out_dtype must be a floating-point"):
            call()


@pytest.mark.parametrize("readers", [2, 3])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "dropout_add_layer_norm"])
def test_readers_get_views_whose_gradients_sum_in_fp32(op, readers):
    """y as `readers` views of one fp16 buffer, each read by its own matmul: every gradient is
    bitwise that of the model's own spelling, one cast of the fp32 y per matmul (autograd sums
    those casts' gradients in fp32; the backward kernel sums the views' the same way)."""
    torch.manual_seed(0)
    x = torch.randn(6, 37, device=DEVICE, requires_grad=True)
    r = torch.randn(6, 37, device=DEVICE, requires_grad=True) if op == "dropout_add_layer_norm" else None
    w, b = (torch.randn(37, device=DEVICE, requires_grad=True) for _ in range(2))
    mats = [torch.randn(37, 5, device=DEVICE).half() for _ in range(readers)]
    inputs = [t for t in (x, r, w, b if op != "rms_norm" else None) if t is not None]

    def grads(k):
        torch.manual_seed(1)  # the same dropout mask
        out = _norm_call(op, x, w, b, torch.float16 if k > 1 else None, r, readers=k)
        y, s = out if op == "dropout_add_layer_norm" else (out, None)
        ys = y if k > 1 else [y.half() for _ in mats]  # the model's spelling: a cast per matmul
        assert k == 1 or (len(ys) == k and all(t.dtype == torch.float16 and t.data_ptr() == ys[0].data_ptr()
                                               for t in ys))
        loss = sum((t @ m).float().square().sum() for t, m in zip(ys, mats)) + (0 if s is None else s.sum())
        return torch.autograd.grad(loss, inputs)

    for a, c in zip(grads(1), grads(readers)):
        assert torch.equal(a, c)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "dropout_add_layer_norm"])
def test_a_16_bit_ys_readers_sum_their_gradients_in_fp32_when_traced(op):
    """A 16-bit x's y narrowed for three matmuls (CUDA's autocast returns fp32 from the model's
    norm: SD's UNet blocks, a ViT kept in fp16). Traced, the registered op writes y in fp32 and each
    reader casts it, so their gradients sum in fp32 as the eager kernels' views' do: gradients
    bitwise the eager ones. (A 16-bit y's `.to` is y itself: the sum was in 16 bits, 0.5 off.)"""
    torch.manual_seed(0)
    x0 = (torch.randn(4, 16, 64, device=DEVICE) * 3).half()
    r = torch.randn(4, 16, 64, device=DEVICE).half() if op == "dropout_add_layer_norm" else None
    w, b = torch.randn(64, device=DEVICE).half(), torch.randn(64, device=DEVICE).half()
    mats = [torch.randn(64, 32, device=DEVICE).half() for _ in range(3)]

    def fn(x):
        out = _norm_call(op, x, w, b, torch.float16, r, readers=3)
        return out[0] if op == "dropout_add_layer_norm" else out

    assert_readers_sum_in_fp32_when_traced(fn, x0, mats, op)


@pytest.mark.parametrize("out_dtype, readers, error", [
    (torch.float16, 0, ValueError), (torch.float16, 4, ValueError), (torch.float16, 2.0, ValueError),
    (None, 2, TypeError)])
def test_readers_must_be_1_to_3_with_an_out_dtype(out_dtype, readers, error):
    x = torch.randn(2, 8, device=DEVICE)
    match = r"trifuse\.layer_norm: (readers must be an int from 1 to 3|out_dtype must)"
    with pytest.raises(error, match=match):
        trifuse.ops.layer_norm(x, (8,), out_dtype=out_dtype, readers=readers)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "dropout_add_layer_norm"])
def test_full_y_returns_y_and_its_narrow_copy_whose_gradients_add(op):
    """full_y: (y, y in fp16) from one kernel, y read by another op and the copy by a matmul; loss
    and gradients bitwise those of the model's spelling (y, and its cast for the matmul)."""
    torch.manual_seed(0)
    x = torch.randn(6, 37, device=DEVICE, requires_grad=True)
    r = torch.randn(6, 37, device=DEVICE, requires_grad=True) if op == "dropout_add_layer_norm" else None
    w, b = (torch.randn(37, device=DEVICE, requires_grad=True) for _ in range(2))
    mat, c = torch.randn(37, 5, device=DEVICE).half(), torch.randn(6, 37, device=DEVICE)
    inputs = [t for t in (x, r, w, b if op != "rms_norm" else None) if t is not None]

    def loss_and_grads(narrow):
        torch.manual_seed(1)  # the same dropout mask
        out = _norm_call(op, x, w, b, torch.float16 if narrow else None, r, full_y=narrow)
        y, s = out if op == "dropout_add_layer_norm" else (out, None)
        y, y16 = y if narrow else (y, y.half())
        assert y.dtype == torch.float32 and y16.dtype == torch.float16
        loss = (y16 @ mat).float().square().sum() + (y * c).sum() + (0 if s is None else s.sum())
        return loss, torch.autograd.grad(loss, inputs)

    (loss, grads), (loss_narrow, grads_narrow) = loss_and_grads(False), loss_and_grads(True)
    assert torch.equal(loss, loss_narrow)
    for a, c2 in zip(grads, grads_narrow):
        assert torch.equal(a, c2)


def test_full_y_takes_one_reader():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"trifuse\.layer_norm: readers must be an int from 1 to 1 with"):
        trifuse.ops.layer_norm(x, (8,), out_dtype=torch.float16, readers=2, full_y=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_without_eps_takes_pytorchs_default(dtype):
    """eps None is PyTorch's default as `torch.rms_norm` computes it: the epsilon of the dtype it
    computes in, fp32's for 16-bit x (its docs say x's own: fp16's is 8192 times larger). Rows of
    small values, where eps weighs: the input dtype's epsilon moved fp16 outputs by up to 1.3."""
    torch.manual_seed(0)
    x = (torch.randn(6, 48, device=DEVICE) * 0.01).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(48, device=DEVICE)).to(dtype).requires_grad_()
    dy = torch.randn(6, 48, device=DEVICE).to(dtype)
    y = trifuse.ops.rms_norm(x, (48,), w)
    module = trifuse.nn.RMSNorm(48).to(device=DEVICE, dtype=dtype)
    module.load_state_dict({"weight": w.detach()})
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    eps = torch.finfo(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype).eps
    y64 = torch.rms_norm(x64, (48,), w64, eps)
    y_lowp = torch.rms_norm(x, (48,), w, None)
    assert_close("y", y, y64, y_lowp)
    assert_close("module y", module(x), y64, y_lowp)
    grads = torch.autograd.grad(y, (x, w), dy)
    grads64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    grads_lowp = torch.autograd.grad(y_lowp, (x, w), dy)
    for name, g, g64, g_lowp in zip(("dx", "dw"), grads, grads64, grads_lowp):
        assert_close(name, g, g64, g_lowp, compute_dtype=dtype)


# ---------------------------------------------------------------------------------------------
# The backward sums only the per-feature vectors asked for (the op's `vectors`)
# ---------------------------------------------------------------------------------------------


def _vectors_summed(monkeypatch) -> list[tuple[bool, bool, bool]]:
    """Records, per backward launch, which of (dweight, dbias, dx_bias) the kernel summed."""
    seen: list[tuple[bool, bool, bool]] = []
    real = ln_mod._bwd_run

    def spy(plan, head, tail, m, n, acc, grad_dtypes, *rest):
        seen.append(tuple(d is not None for d in grad_dtypes))
        return real(plan, head, tail, m, n, acc, grad_dtypes, *rest)

    monkeypatch.setattr(ln_mod, "_bwd_run", spy)
    return seen


@pytest.mark.parametrize("case, summed", [
    ("rms_weight", (True, False, False)),  # an RMSNorm has no bias, a plain one no x_bias
    ("rms_constant_weight", (False, False, False)),  # nothing summed, no reduction launched
    ("ln_weight_bias", (True, True, False)),
    ("ln_frozen_weight", (False, True, False)),
    ("dropout_add_ln_x_bias", (True, True, True)),
    ("dropout_add_rms_frozen", (False, False, True)),
])
def test_the_backward_sums_only_the_vectors_asked_for(case, summed, monkeypatch):
    """Each norm's backward asks the kernel for the gradients autograd needs of its weight, bias
    and x_bias, no more; the gradients it returns are the float64 reference's, and None (not zeros)
    for what needs none."""
    torch.manual_seed(0)
    x, r = (torch.randn(5, 24, dtype=torch.float64, device=DEVICE, requires_grad=True) for _ in range(2))
    w = 1 + 0.1 * torch.randn(24, dtype=torch.float64, device=DEVICE)
    w.requires_grad_("frozen" not in case and "constant" not in case)
    b, xb = ((0.1 * torch.randn(24, dtype=torch.float64, device=DEVICE)).requires_grad_() for _ in range(2))
    ops = trifuse.ops
    run, ref = {  # (trifuse's, PyTorch's)
        "rms": (lambda: ops.rms_norm(x, (24,), w, 1e-5), lambda: F.rms_norm(x, (24,), w, 1e-5)),
        "ln_": (lambda: ops.layer_norm(x, (24,), w, b, 1e-5), lambda: F.layer_norm(x, (24,), w, b, 1e-5)),
        "dropout_add_ln": (lambda: ops.dropout_add_layer_norm(x, r, (24,), w, b, 1e-5, 0.0, x_bias=xb)[0],
                           lambda: F.layer_norm(x + xb + r, (24,), w, b, 1e-5)),
        "dropout_add_rms": (lambda: ops.dropout_add_layer_norm(x, r, (24,), w, None, 1e-5, 0.0, x_bias=xb,
                                                               is_rms_norm=True)[0],
                            lambda: F.rms_norm(x + xb + r, (24,), w, 1e-5)),
    }[next(k for k in ("rms", "ln_", "dropout_add_ln", "dropout_add_rms") if case.startswith(k))]
    for dialect in (ln_mod.RMS_NORM, ln_mod.DROPOUT_ADD_LAYER_NORM, ln_mod.DROPOUT_ADD_RMS_NORM):
        monkeypatch.setattr(dialect, "key", lambda *args: None)  # trifuse's kernels, on a GPU too
    seen = _vectors_summed(monkeypatch)
    dy = torch.randn(5, 24, dtype=torch.float64, device=DEVICE)
    live = [t for t in (x, w, b, r, xb) if t.requires_grad]
    got = torch.autograd.grad(run(), live, dy, allow_unused=True)
    want = torch.autograd.grad(ref(), live, dy, allow_unused=True)
    assert seen == ([summed] if INTERPRETED or DEVICE == "cuda" else [])  # (none on PyTorch's CPU path)
    for g, g_ in zip(got, want):
        assert (g is None) == (g_ is None)
        if g is not None:
            torch.testing.assert_close(g, g_)


def test_opcheck_of_the_backward_asking_for_some_vectors():
    x = torch.randn(3, 16, device=DEVICE)
    w = torch.randn(16, device=DEVICE)
    with torch.no_grad():
        y, mean, rstd, _ = torch.ops.trifuse.layer_norm(x, [16], w, None, 1e-5)
    for vectors in (0, 1, 2, 5):
        torch.library.opcheck(torch.ops.trifuse.layer_norm_backward.default,
                              (torch.randn_like(y), None, x, [16], w, mean, rstd, None, 0.0, False, False,
                               None, None, vectors))
        out = torch.ops.trifuse.layer_norm_backward(torch.randn_like(y), None, x, [16], w, mean, rstd, None,
                                                    0.0, False, False, None, None, vectors)
        assert [v.numel() for v in out[2:]] == [16 if vectors >> i & 1 else 0 for i in range(3)]
