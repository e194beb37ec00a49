"""GroupNorm, alone and followed by SiLU, against the float64 oracle.

On CPU these run the real Triton kernels in the interpreter (tests/_device.py), where blocks are
64 values and chunks 2 blocks, so rows of a few hundred values cross blocks and are cut in
chunks, and a row takes the one-program path only up to 256 padded values: CASES take both;
on a GPU the same tests run natively and add bf16.
"""
import pytest
import torch
import torch.nn.functional as F
import trifuse
from _device import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close
from trifuse.kernels import group_norm as gn_mod
from trifuse.kernels.group_norm import group_norm_ref

# (shape, groups): spatial dims 0 to 3; one channel per group and one group; rows of 185, 2000
# and 4100 values (several blocks, several chunks); one row; an empty batch and empty spatial dims.
CASES = [((2, 6, 5, 7), 3), ((1, 4), 2), ((3, 8, 1000), 4), ((2, 12, 9, 9), 12), ((2, 5, 37), 1),
         ((1, 3, 2, 3, 5), 3), ((1, 2, 4100), 1), ((0, 4, 5), 2), ((2, 4, 0), 2)]
ACTIVATIONS = [None, "silu"]


def _ids(case):
    shape, groups = case
    return "x".join(map(str, shape)) + f"-g{groups}"


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """t laid out (N, *spatial, C): channels_last for 4-D, channels_last_3d for 5-D, (N, L, C)
    transposed for 3-D."""
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def make(shape, dtype, affine=True, scale=2.0, shift=0.5, param_dtype=None, layout="contiguous"):
    x = torch.randn(shape, device=DEVICE, dtype=torch.float64) * scale + shift
    x = (channels_last(x) if layout == "channels_last" else x).to(dtype).requires_grad_()
    c = shape[1]
    param_dtype = param_dtype or dtype
    weight = bias = None
    if affine:
        weight = 1 + 0.5 * torch.randn(c, device=DEVICE, dtype=torch.float64)
        bias = 0.5 * torch.randn(c, device=DEVICE, dtype=torch.float64)
        weight, bias = (t.to(param_dtype).requires_grad_() for t in (weight, bias))
    return x, weight, bias


def _detached(ts, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in ts]


def check_fwd_bwd(x, groups, weight, bias, activation, eps=1e-5, dy=None, out_dtype=None):
    """y, dx, dweight and dbias against float64, bounded by PyTorch's own error in the inputs'
    dtypes (F.group_norm, then F.silu). y and dx come out channels-last where x is, contiguous
    otherwise."""
    y = trifuse.ops.group_norm(x, groups, weight, bias, eps, activation, out_dtype)
    inputs = (x, weight, bias)
    ins64 = _detached(inputs, torch.float64)
    ins_lp = _detached(inputs, torch.float32 if out_dtype == torch.float32 else None)
    y64 = group_norm_ref(ins64[0], groups, ins64[1], ins64[2], eps, activation)
    ylp = group_norm_ref(ins_lp[0], groups, ins_lp[1], ins_lp[2], eps, activation)
    assert y.dtype == (out_dtype or x.dtype) and y.shape == x.shape
    in_layout = channels_last(x).stride() if gn_mod.channels_last(x) else x.contiguous().stride()
    assert y.stride() == in_layout
    assert_close(f"group_norm {activation} y", y, y64, ylp)
    if x.numel() == 0:
        dx, *dp = torch.autograd.grad(y, [t for t in inputs if t is not None], torch.ones_like(y))
        assert dx.shape == x.shape and all(torch.equal(d, torch.zeros_like(d)) for d in dp)
        return
    dy = torch.randn_like(y) if dy is None else dy
    wanted = [i for i, t in enumerate(inputs) if t is not None]
    grads = torch.autograd.grad(y, [inputs[i] for i in wanted], dy)
    grads64 = torch.autograd.grad(y64, [ins64[i] for i in wanted], dy.double())
    grads_lp = torch.autograd.grad(ylp, [ins_lp[i] for i in wanted], dy.to(ylp.dtype))
    for i, a, a64, alp in zip(wanted, grads, grads64, grads_lp):
        name = ("dx", "dweight", "dbias")[i]
        assert a.dtype == inputs[i].dtype and a.shape == inputs[i].shape, name
        assert i > 0 or a.stride() == in_layout
        assert_close(f"group_norm {activation} {name}", a, a64, alp.to(a.dtype))


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, case, activation):
    shape, groups = case
    check_fwd_bwd(*make(shape, dtype)[:1], groups, *make(shape, dtype)[1:], activation)


LAUNCHERS = ("_row_fwd", "_stats", "_row_bwd", "_bwd_sums", "_bwd_sums_cl")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("path", ["row", "chunks"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("case", [((2, 12, 5, 7), 4), ((3, 8, 2, 9), 8), ((2, 4, 16, 16), 2),
                                  ((2, 40, 3, 5), 8), ((2, 6, 3, 4, 5), 2)], ids=_ids)
def test_both_paths_match_float64_oracle(case, activation, path, layout, monkeypatch):
    """The same rows through the one-program path and through the chunked kernels, contiguous and
    channels-last (read where they lie: the kernels get x itself): 3 channels x 35 positions
    (tile 4 x 64), one channel a group, 2 x 256 at _ROW_MAX 512 (a full tile), 40 channels (the
    channels-last sums' blocks of 16, the last part-filled), 5-D."""
    monkeypatch.setattr(gn_mod, "_ROW_MAX", 512 if path == "row" else 0)
    monkeypatch.setattr(gn_mod, "_LAUNCHES", {})
    shape, groups = case
    x, weight, bias = make(shape, torch.float32, layout=layout)
    launched, read = [], set()

    def spy(grid, args, kw, _run, _n):
        launched.append(_n)
        read.add(args[1 if _n in ("_row_bwd", "_bwd_sums", "_bwd_sums_cl") else 0].data_ptr())
        return _run(grid, args, kw)
    for name in LAUNCHERS:
        kernel = getattr(gn_mod, name)
        monkeypatch.setattr(kernel, "run", lambda grid, args, kw, _run=kernel.run, _n=name: spy(grid, args, kw,
                                                                                                 _run, _n))
    check_fwd_bwd(x, groups, weight, bias, activation)
    sums = "_bwd_sums_cl" if layout == "channels_last" else "_bwd_sums"
    assert launched == (["_row_fwd", "_row_bwd"] if path == "row" else ["_stats", sums])
    assert read == {x.data_ptr()}


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("params", ["none", "weight", "bias"])
def test_without_weight_or_bias(params, activation):
    x, weight, bias = make((2, 6, 40), torch.float32)
    weight = weight if params == "weight" else None
    bias = bias if params == "bias" else None
    check_fwd_bwd(x, 3, weight, bias, activation)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["out-x-dtype", "out-fp32"])
def test_16_bit_x_with_fp32_parameters(out_dtype, activation, layout):
    """Master weights beside 16-bit activations, and CUDA autocast's form (fp32 out of a 16-bit x)."""
    x, weight, bias = make((2, 8, 150), torch.float16, param_dtype=torch.float32, layout=layout)
    check_fwd_bwd(x, 4, weight, bias, activation, out_dtype=out_dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_other_layouts_and_gradients(activation):
    """channels_last with an incoming gradient in yet another layout (copied to x's), a contiguous
    one into a channels-last x, and a sliced input (copied once) with an expanded gradient."""
    x = torch.randn(2, 6, 7, 9, device=DEVICE).to(memory_format=torch.channels_last).requires_grad_()
    _, weight, bias = make((2, 6), torch.float32)
    dy = torch.randn(2, 9, 7, 6, device=DEVICE).permute(0, 3, 2, 1)
    check_fwd_bwd(x, 2, weight, bias, activation, dy=dy)
    check_fwd_bwd(x, 2, weight, bias, activation, dy=torch.randn(2, 6, 7, 9, device=DEVICE))
    big = torch.randn(3, 8, 50, device=DEVICE)
    x = big[:, :, 5:45].requires_grad_()
    _, weight, bias = make((3, 8), torch.float32)
    check_fwd_bwd(x, 4, weight, bias, activation, dy=torch.randn(40, device=DEVICE).expand(3, 8, 40))


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if len(c[0]) > 2], ids=_ids)
def test_channels_last_matches_float64_oracle(case, dtype, activation):
    """Every CASE with spatial dims (without, channels-last is contiguous) with x laid out
    (N, *spatial, C)."""
    shape, groups = case
    check_fwd_bwd(*make(shape, dtype, layout="channels_last")[:1], groups, *make(shape, dtype)[1:], activation)


def test_channels_last_output_takes_an_in_place_op():
    """y channels-last is a tensor of its own, not a view (autograd forbids modifying a custom
    Function's view output in place: a ResNet's `SiLU(inplace=True)` after the norm), through the
    eager path and the registered op; the gradient is the out-of-place one's."""
    x = make((2, 8, 3, 5), torch.float32, layout="channels_last")[0]
    for fn in (lambda: trifuse.ops.group_norm(x, 2),
               lambda: torch.ops.trifuse.group_norm(x, 2, None, None, 1e-5, None, None)[0]):
        y = fn()
        assert y._base is None and y.stride() == x.stride()
        dx, = torch.autograd.grad(F.silu(y, inplace=True).sum(), x)
        want, = torch.autograd.grad(F.silu(fn()).sum(), x)
        torch.testing.assert_close(dx, want)


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_values_far_from_zero(dtype, activation):
    """A mean of 1000 standard deviations: the statistics of x - x0 keep the variance (E[x^2] -
    E[x]^2 of x itself would lose it in fp32: the negative control below)."""
    scale, shift = (1.0, 1000.0) if dtype == torch.float32 else (0.25, 200.0)
    x, weight, bias = make((2, 4, 300), dtype, scale=scale, shift=shift)
    check_fwd_bwd(x, 2, weight, bias, activation)


@pytest.mark.parametrize("path", ["row", "chunks"])
def test_statistics_where_the_first_value_is_far_from_the_mean(path, monkeypatch):
    """The saved mean and rstd in fp32 within a few ulps of float64's, each row's first value 8
    deviations from its mean: E[d^2] - E[d]^2 about that value (the first version) cancelled
    (8^2 + 1) / 1 of the variance's bits, rstd off by ~30 ulps (the negative control below)."""
    monkeypatch.setattr(gn_mod, "_ROW_MAX", 4096 if path == "row" else 0)
    monkeypatch.setattr(gn_mod, "_LAUNCHES", {})
    x = torch.randn(3, 8, 700, device=DEVICE)
    x[:, ::2, 0] = 8.0  # the first value of each of the 4 groups' rows
    _, mean, rstd = torch.ops.trifuse.group_norm(x, 4, None, None, 1e-5, None, None)
    rows = x.double().view(3, 4, -1)
    mean64, var64 = rows.mean(-1), rows.var(-1, unbiased=False)
    rstd64 = (var64 + 1e-5).rsqrt()
    ulp = torch.finfo(torch.float32).eps
    assert ((rstd.double() - rstd64).abs() / rstd64).max() < 4 * ulp
    assert ((mean.double() - mean64).abs()).max() < 4 * ulp * rows.abs().amax(-1).max()
    shift = rows[..., :1]
    d = rows - shift
    about_x0 = (d**2).float().mean(-1).double() - d.float().mean(-1).double() ** 2
    wrong = (about_x0.float() + 1e-5).rsqrt().double()  # as the first version: fp32 sums about x0
    assert ((wrong - rstd64).abs() / rstd64).max() > 4 * ulp, "the control no longer shows the cancellation"


def test_nan_stays_in_its_row():
    x = torch.randn(2, 4, 30, device=DEVICE)
    x[1, 2, 3] = float("nan")
    y = trifuse.ops.group_norm(x, 2, activation="silu")
    ref = group_norm_ref(x.double(), 2, activation="silu")
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.isnan(y[1, 2:]).all() and not torch.isnan(y[:, :2]).any() and not torch.isnan(y[0]).any()


@pytest.mark.parametrize("path", ["row", "chunks"])
def test_gradcheck_float64(path, monkeypatch):
    monkeypatch.setattr(gn_mod, "_ROW_MAX", 256 if path == "row" else 0)
    monkeypatch.setattr(gn_mod, "_LAUNCHES", {})
    x, weight, bias = make((2, 4, 3), torch.float64)
    x_cl = make((1, 4, 3, 2), torch.float64, layout="channels_last")[0]
    for act in ACTIVATIONS:
        eager = lambda x, w, b, act=act: trifuse.ops.group_norm(x, 2, w, b, 1e-5, act)
        registered = lambda x, w, b, act=act: torch.ops.trifuse.group_norm(
            x, 2, w, b, 1e-5, act, None)[0]
        # the channels-last indexing does not depend on the activation: checked once, with SiLU
        for inputs in ((x, weight, bias), (x_cl, weight, bias))[:2 if act else 1]:
            assert torch.autograd.gradcheck(eager, inputs)
            # the same kernels through the registered op's autograd: a random projection suffices
            assert torch.autograd.gradcheck(registered, inputs, fast_mode=True)


def test_double_backward_float64():
    """A gradient penalty through the op: second derivatives by gradgradcheck, both paths."""
    x, weight, bias = make((2, 4, 3), torch.float64)
    assert torch.autograd.gradgradcheck(lambda x, w, b: trifuse.ops.group_norm(x, 2, w, b, 1e-5, "silu"),
                                        (x, weight, bias), fast_mode=True)
    assert torch.autograd.gradgradcheck(
        lambda x, w, b: torch.ops.trifuse.group_norm(x, 2, w, b, 1e-5, "silu", None)[0], (x, weight, bias),
        fast_mode=True)


def test_double_backward_of_the_autocast_form():
    """create_graph=True through a 16-bit x with an fp32 output (CUDA autocast's form), both paths:
    the second derivatives are PyTorch's GroupNorm's on x upcast (the reference formula runs in
    the op's output dtype)."""
    x, weight, bias = make((2, 4, 5), torch.float16, param_dtype=torch.float32)
    xf, wf, bf = _detached((x, weight, bias), torch.float32)
    ref_y = group_norm_ref(xf, 2, wf, bf, 1e-5, "silu")
    ref_gw, = torch.autograd.grad(ref_y.square().sum(), wf, create_graph=True)
    ref_dx, = torch.autograd.grad(ref_gw.sum(), xf)
    for fn in (lambda: trifuse.ops.group_norm(x, 2, weight, bias, 1e-5, "silu", torch.float32),
               lambda: torch.ops.trifuse.group_norm(x, 2, weight, bias, 1e-5, "silu", torch.float32)[0]):
        y = fn()
        assert y.dtype == torch.float32
        gw, = torch.autograd.grad(y.square().sum(), weight, create_graph=True)
        dx, = torch.autograd.grad(gw.sum(), x)
        assert dx.dtype == torch.float16
        torch.testing.assert_close(dx.float(), ref_dx, rtol=2e-3, atol=2e-3)


def test_backward_saves_no_activation():
    """x, the parameters and the (N, G) statistics: nothing of y's size besides x (eager keeps the
    norm's output for the SiLU as well)."""
    x, weight, bias = make((2, 6, 50), torch.float32)
    y = trifuse.ops.group_norm(x, 3, weight, bias, 1e-5, "silu")
    saved = y.grad_fn.saved_tensors
    assert saved[0] is x and saved[1] is weight and saved[2] is bias
    assert [tuple(t.shape) for t in saved[3:]] == [(2, 3), (2, 3)]


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_eager_path_and_registered_op_are_bitwise_equal_and_repeatable(activation):
    x, weight, bias = make((3, 8, 700), torch.float32)
    eager = trifuse.ops.group_norm(x, 4, weight, bias, 1e-5, activation)
    op = torch.ops.trifuse.group_norm(x, 4, weight, bias, 1e-5, activation, None)[0]
    assert torch.equal(eager, op)
    dy = torch.randn_like(eager)
    first = torch.autograd.grad(eager, (x, weight, bias), dy, retain_graph=True)
    again = torch.autograd.grad(eager, (x, weight, bias), dy)
    registered = torch.autograd.grad(op, (x, weight, bias), dy)
    for a, b, c in zip(first, again, registered):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_compiles_fullgraph_without_graph_breaks(activation, layout):
    """Same bits compiled as eager, and y laid out as eager lays it out (the fake's strides are
    the kernels')."""
    x, weight, bias = make((2, 6, 5, 5), torch.float32, layout=layout)
    fn = torch.compile(lambda x, w, b: trifuse.ops.group_norm(x, 3, w, b, 1e-5, activation), fullgraph=True,
                       backend="aot_eager")
    out, ref = fn(x, weight, bias), trifuse.ops.group_norm(x, 3, weight, bias, 1e-5, activation)
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    for a, b in zip(torch.autograd.grad(out, (x, weight, bias), torch.ones_like(out)),
                    torch.autograd.grad(ref, (x, weight, bias), torch.ones_like(ref))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_opcheck_every_op(layout):
    """opcheck compares the fake's outputs (strides included) with the real ones."""
    x, weight, bias = make((2, 4, 10), torch.float32, layout=layout)
    for act in ACTIVATIONS:
        torch.library.opcheck(torch.ops.trifuse.group_norm.default, (x, 2, weight, bias, 1e-5, act, None))
    torch.library.opcheck(torch.ops.trifuse.group_norm.default, (x, 4, None, None, 1e-6, "silu", None))
    _, mean, rstd = (t.detach() for t in torch.ops.trifuse.group_norm(x, 2, weight, bias, 1e-5, "silu", None))
    dy = torch.randn(2, 4, 10, device=DEVICE)
    for need_dx in (True, False):
        torch.library.opcheck(torch.ops.trifuse.group_norm_backward.default,
                              (dy, x.detach(), 2, weight.detach(), bias.detach(), mean, rstd, "silu",
                               need_dx))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 3), groups=st.integers(1, 4), per_group=st.integers(1, 3),
       spatial=st.integers(2, 300), activation=st.sampled_from(ACTIVATIONS))
def test_hypothesis_shapes(n, groups, per_group, spatial, activation):
    torch.manual_seed(n * 100000 + groups * 1000 + spatial)
    x, weight, bias = make((n, groups * per_group, spatial), torch.float32)
    check_fwd_bwd(x, groups, weight, bias, activation)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_more_than_2_to_the_31_elements(layout):
    """Row offsets in int64: the last rows of a tensor past 2^31 elements are right, in either
    layout (channels-last's positions are C apart: a sample's offsets pass 2^31 too)."""
    n, c, s = 2**31 // (64 * 4096) + 2, 64, 4096
    x = torch.randn(n, c, s, device=DEVICE, dtype=torch.bfloat16)
    if layout == "channels_last":
        x = channels_last(x)
    y = trifuse.ops.group_norm(x, 32, activation="silu")
    tail = slice(n - 2, n)
    assert_close("tail", y[tail], group_norm_ref(x[tail].double(), 32, activation="silu"),
                 group_norm_ref(x[tail], 32, activation="silu"))


# ---------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations must fail the same tolerance.
# ---------------------------------------------------------------------------------------------


def test_negative_control_other_groups_fail():
    """Statistics over the wrong groups (one group for all channels, or one per channel) must not pass."""
    x, weight, bias = make((2, 8, 60), torch.float32, shift=0.0)
    for d in (x.detach(),):
        d[:, 4:] = d[:, 4:] * 3 + 2  # the groups differ in mean and spread
    ref = group_norm_ref(x.detach().double(), 4, weight.detach().double(), bias.detach().double())
    for groups in (1, 8):
        wrong = trifuse.ops.group_norm(x, groups, weight, bias)
        ok, msg = check_close(f"{groups} groups for 4", wrong, ref, None)
        assert not ok, msg


def test_negative_control_dx_without_the_silu_derivative_fails():
    x, weight, bias = make((2, 6, 80), torch.float32)
    dy = torch.randn(2, 6, 80, device=DEVICE)
    x64, w64, b64 = _detached((x, weight, bias), torch.float64)
    (dx64,) = torch.autograd.grad(group_norm_ref(x64, 3, w64, b64, 1e-5, "silu"), x64, dy.double())
    (wrong,) = torch.autograd.grad(trifuse.ops.group_norm(x, 3, weight, bias), x, dy)  # as if no SiLU
    ok, msg = check_close("dx without silu'", wrong, dx64, None)
    assert not ok, msg


def test_negative_control_unshifted_fp32_variance_fails():
    """The variance as E[x^2] - E[x]^2 of x itself, in fp32, at a mean of 1000: must not pass."""
    x = torch.randn(1, 2, 2000, device=DEVICE) + 1000.0
    rows = x.view(1, 1, -1)
    var = (rows * rows).mean(-1, keepdim=True) - rows.mean(-1, keepdim=True) ** 2
    wrong = ((rows - rows.mean(-1, keepdim=True)) * torch.rsqrt(var.clamp_min(0) + 1e-5)).view_as(x)
    ok, msg = check_close("unshifted variance", wrong, group_norm_ref(x.double(), 1), F.group_norm(x, 1))
    assert not ok, msg


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the op and the argument, in eager and under compile.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, groups, weight, bias, kwargs, exc, match",
    [
        (torch.ones(2, 6, 4), 4, None, None, {}, ValueError,
         r"group_norm: the channels of x \(dim 1, 6\) must divide into num_groups \(4\) groups"),
        (torch.ones(6), 2, None, None, {}, ValueError, r"group_norm: x must have at least 2 dimensions"),
        (torch.ones(2, 6, 4), 0, None, None, {}, ValueError,
         "group_norm: num_groups must be a positive int, got 0"),
        (torch.ones(2, 6, 4), 2, torch.ones(4), None, {}, ValueError,
         r"group_norm: weight must have shape \(6,\), got \(4,\)"),
        (torch.ones(2, 6, 4), 2, torch.ones(6, dtype=torch.float16), None, {}, TypeError,
         "group_norm: weight has dtype torch.float16; it must be x's"),
        (torch.ones(2, 6, 4), 2, torch.ones(6), torch.ones(6, dtype=torch.float64), {}, TypeError,
         "group_norm: bias has dtype torch.float64; it must be x's"),
        (torch.ones(2, 6, 4, dtype=torch.int64), 2, None, None, {}, TypeError,
         "group_norm: x must be float16, bfloat16, float32 or float64, got torch.int64"),
        (torch.ones(2, 6, 4), 2, None, None, {"activation": "gelu"}, ValueError,
         "group_norm: activation must be None or 'silu', got 'gelu'"),
        (torch.ones(2, 6, 4), 2, None, None, {"eps": -1.0}, ValueError,
         "group_norm: eps must be a number >= 0"),
        (torch.ones(2, 6, 4), 2, None, None, {"out_dtype": torch.float16}, TypeError,
         "group_norm: out_dtype must be None, x's dtype"),
        ("not a tensor", 2, None, None, {}, TypeError, "group_norm: x must be a torch.Tensor, got str"),
    ],
    ids=["groups-do-not-divide", "1-d", "zero-groups", "weight-shape", "weight-dtype", "bias-dtype", "int-x",
         "activation", "eps", "out-dtype", "not-tensor"],
)
def test_bad_input_raises_clear_error(x, groups, weight, bias, kwargs, exc, match):
    x = x.to(DEVICE) if isinstance(x, torch.Tensor) else x
    with pytest.raises(exc, match=match):
        trifuse.ops.group_norm(x, groups, weight, bias, **kwargs)
    if isinstance(x, torch.Tensor):
        with pytest.raises(exc, match=match):
            torch.ops.trifuse.group_norm(x, groups, weight, bias, kwargs.get("eps", 1e-5),
                                         kwargs.get("activation"), kwargs.get("out_dtype"))


def test_bad_input_raises_under_compile():
    fn = torch.compile(lambda x: trifuse.ops.group_norm(x, 4), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"group_norm: the channels of x \(dim 1, 6\)"):
        fn(torch.ones(2, 6, 3, device=DEVICE))


def test_mismatched_devices_raise():
    with pytest.raises(ValueError, match="weight is on meta"):
        trifuse.ops.group_norm(torch.ones(2, 4, 3, device=DEVICE), 2, torch.ones(4, device="meta"))


def test_reference_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: same maths, same API."""
    monkeypatch.setattr(gn_mod, "use_triton", lambda t: False)
    for activation in ACTIVATIONS:
        for dtype in (torch.float32, torch.float16):
            for layout in ("contiguous", "channels_last"):
                x, weight, bias = make((2, 6, 37), dtype, layout=layout)
                check_fwd_bwd(x, 3, weight, bias, activation)


# ---------------------------------------------------------------------------------------------
# trifuse.nn.GroupNorm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_nn_group_norm_matches_and_shares_nn_group_norms_state_dict(activation):
    """The module computes act(nn.GroupNorm(x)) by the oracle rule, forward and backward, and
    loads an nn.GroupNorm's state_dict (and the reverse) with the same keys."""
    torch.manual_seed(0)
    ref = torch.nn.GroupNorm(3, 6, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        ref.weight.add_(0.3 * torch.randn(6, device=DEVICE))
        ref.bias.add_(0.3 * torch.randn(6, device=DEVICE))
    ours = trifuse.nn.GroupNorm(3, 6, eps=1e-6, activation=activation, device=DEVICE)
    assert ours.load_state_dict(ref.state_dict()) is not None
    assert set(ours.state_dict()) == set(ref.state_dict())
    x = torch.randn(2, 6, 5, 4, device=DEVICE, requires_grad=True)
    check_fwd_bwd(x, 3, ours.weight, ours.bias, activation, eps=1e-6)
    y = ours(x)
    assert torch.equal(y, trifuse.ops.group_norm(x, 3, ours.weight, ours.bias, 1e-6, activation))
    assert ("activation='silu'" in repr(ours)) == (activation == "silu")
    torch.nn.GroupNorm(3, 6).load_state_dict(ours.state_dict())


def test_nn_group_norm_rejects_an_unknown_activation():
    with pytest.raises(ValueError, match=r"trifuse.nn.GroupNorm: activation must be None or 'silu', got 'gelu'"):
        trifuse.nn.GroupNorm(2, 4, activation="gelu")
