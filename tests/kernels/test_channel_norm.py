"""LayerNorm and RMSNorm over a channels-first map's channels, against the float64 oracle.

On CPU these run the real Triton kernels in the interpreter (tests/_device.py), where a tile holds
at most 128 values: up to 32 channels fit one tile (4 positions a tile at least), more are walked
in blocks by runs of 8 positions, so CASES take both paths; on a GPU the same tests run natively.
"""
import pytest
import torch
import trifuse
from _device import DEVICE, INTERPRETED
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close
from trifuse.kernels import channel_norm as cn_mod
from trifuse.kernels.channel_norm import CHANNEL_NORM, channel_norm_ref

# (shape, dim): channels in one tile (24, 7) and walked in blocks (100, 40, 33); one channel; no
# positions after the channels (2-D, and dim the last); 5-D; dim 2 of a 4-D tensor; many tiles of
# positions; empty batch and empty positions.
CASES = [((2, 24, 5, 3), 1), ((3, 100, 7), 1), ((1, 1, 9), 1), ((2, 40, 1, 1, 3), 1), ((4, 7), 1),
         ((2, 3, 20, 4), 2), ((1, 33, 70), 1), ((5, 9), -1), ((0, 6, 5), 1), ((2, 6, 0), 1)]
KINDS = ["layer", "layer_bare", "rms", "rms_bare", "l2_floored"]


def _ids(case):
    shape, dim = case
    return "x".join(map(str, shape)) + f"-d{dim}"


def make(shape, dim, dtype, kind, scale=2.0, shift=0.5, param_dtype=None):
    """x and the kind's (weight, bias, eps, rms, clamp_eps); l2_floored: F.normalize's RMSNorm, its
    weight the fp32 constant 1 / sqrt(C) (`patterns/layer_norm.py`) times a learnt one, eps a floor."""
    x = (torch.randn(shape, device=DEVICE, dtype=torch.float64) * scale + shift).to(dtype).requires_grad_()
    c = shape[dim]
    param_dtype = param_dtype or dtype
    weight = bias = None
    if kind in ("layer", "rms", "l2_floored"):
        weight = 1 + 0.5 * torch.randn(c, device=DEVICE, dtype=torch.float64)
        weight = weight * (c ** -0.5 if kind == "l2_floored" else 1.0)
        weight = weight.to(torch.float32 if kind == "l2_floored" and dtype != torch.float64 else param_dtype)
        weight.requires_grad_()
    if kind == "layer":
        bias = (0.5 * torch.randn(c, device=DEVICE, dtype=torch.float64)).to(param_dtype).requires_grad_()
    rms = kind != "layer" and kind != "layer_bare"
    eps = 1e-12 * c ** -0.5 if kind == "l2_floored" else 1e-5
    return x, weight, bias, {"eps": eps, "dim": dim, "rms": rms, "clamp_eps": kind == "l2_floored"}


def _detached(ts, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in ts]


def _ref(x, weight, bias, opts):
    return channel_norm_ref(x, opts["dim"], weight, bias, opts["eps"], opts["rms"], opts["clamp_eps"])


def check_fwd_bwd(x, weight, bias, opts, dy=None):
    """y, dx, dweight and dbias against float64, bounded by PyTorch's own error in the inputs'
    dtypes (the row norms of x with its channels moved last, moved back); y and dx contiguous."""
    y = trifuse.ops.channel_norm(x, weight, bias, **opts)
    inputs = (x, weight, bias)
    ins64, ins_lp = _detached(inputs, torch.float64), _detached(inputs)
    y64, ylp = _ref(*ins64, opts), _ref(*ins_lp, opts)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    assert_close("channel_norm y", y, y64, ylp)
    wanted = [i for i, t in enumerate(inputs) if t is not None and t.requires_grad]
    if x.numel() == 0:
        grads = torch.autograd.grad(y, [inputs[i] for i in wanted], torch.ones_like(y))
        assert grads[0].shape == x.shape and all(torch.equal(g, torch.zeros_like(g)) for g in grads[1:])
        return
    dy = torch.randn_like(y) if dy is None else dy
    grads = torch.autograd.grad(y, [inputs[i] for i in wanted], dy)
    grads64 = torch.autograd.grad(y64, [ins64[i] for i in wanted], dy.double())
    grads_lp = torch.autograd.grad(ylp, [ins_lp[i] for i in wanted], dy.to(ylp.dtype))
    for i, a, a64, alp in zip(wanted, grads, grads64, grads_lp):
        name = ("dx", "dweight", "dbias")[i]
        assert a.dtype == inputs[i].dtype and a.shape == inputs[i].shape, name
        assert_close(f"channel_norm {name}", a, a64, alp.to(a.dtype))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, case, kind):
    shape, dim = case
    x, weight, bias, opts = make(shape, dim, dtype, kind)
    check_fwd_bwd(x, weight, bias, opts)


LAUNCH_ARGS = {"_fwd": 0, "_bwd": 1}  # where x sits in each launch's arguments


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("case", [((2, 24, 5, 3), 1), ((3, 100, 7), 1), ((2, 6, 40, 3), 1)], ids=_ids)
def test_reads_the_map_where_it_lies(case, kind, monkeypatch):
    """One forward launch and one backward launch (then the partial sums'), both reading x itself:
    no copy with the channels moved last, whichever tile path the width takes."""
    shape, dim = case
    x, weight, bias, opts = make(shape, dim, torch.float32, kind)
    launched, read = [], set()
    for name, at in LAUNCH_ARGS.items():
        kernel = getattr(cn_mod, name)

        def spy(grid, args, kw, _run=kernel.run, _n=name, _at=at):
            launched.append((_n, kw["SINGLE_BLOCK"]))
            read.add(args[_at].data_ptr())
            return _run(grid, args, kw)
        monkeypatch.setattr(kernel, "run", spy)
    check_fwd_bwd(x, weight, bias, opts)
    single = shape[dim] <= 32 if INTERPRETED else True
    assert launched == [("_fwd", single), ("_bwd", single)]
    assert read == {x.data_ptr()}


def _channels_innermost(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """t laid out with its dim `dim` innermost (channels_last for a 4-D map), same values."""
    return t.detach().movedim(dim, -1).contiguous().movedim(-1, dim).requires_grad_(t.requires_grad)


@pytest.mark.parametrize("y_cl", [False, True], ids=["y-contiguous", "y-channels-last"])
@pytest.mark.parametrize("x_cl", [False, True], ids=["x-contiguous", "x-channels-last"])
@pytest.mark.parametrize("case", [((2, 24, 5, 3), 1), ((3, 100, 7), 1), ((2, 3, 20, 4), 2)], ids=_ids)
def test_layouts_read_and_written_where_they_lie(case, x_cl, y_cl, monkeypatch):
    """x contiguous or with its channels innermost (channels_last; the (B, L, C) a conv's output
    transposed makes) is read where it lies, y written in either layout, dy read in y's and dx
    written in x's: no copy of any (each launch reads x itself, and dy as autograd hands it over)."""
    shape, dim = case
    x, weight, bias, opts = make(shape, dim, torch.float32, "layer")
    x = _channels_innermost(x, dim) if x_cl else x
    launched = []
    for name in LAUNCH_ARGS:
        kernel = getattr(cn_mod, name)

        def spy(grid, args, kw, _run=kernel.run, _n=name):
            layout = kw.get("Y_CL", kw.get("DY_CL"))  # (y's in the forward, dy's in the backward)
            launched.append((_n, args[LAUNCH_ARGS[_n]].data_ptr(), kw["X_CL"], layout))
            return _run(grid, args, kw)
        monkeypatch.setattr(kernel, "run", spy)
    y = trifuse.ops.channel_norm(x, weight, bias, opts["eps"], dim=dim, y_channels_last=y_cl)
    assert y.is_contiguous() == (not y_cl or y.shape[dim] == 1) and cn_mod.channels_last(y, dim) == y_cl
    ins64 = _detached((x, weight, bias), torch.float64)
    y64, ylp = _ref(*ins64, opts), _ref(*_detached((x, weight, bias)), opts)
    assert_close("y", y, y64, ylp)
    dy = torch.randn_like(y)  # in y's layout, as autograd hands a permuted view's gradient over
    dx, dw, db = torch.autograd.grad(y, (x, weight, bias), dy)
    assert dx.stride() == x.stride()
    for name, a, a64 in zip(("dx", "dw", "db"), (dx, dw, db), torch.autograd.grad(y64, ins64, dy.double())):
        assert_close(name, a, a64, None)
    assert launched == [("_fwd", x.data_ptr(), x_cl, y_cl), ("_bwd", x.data_ptr(), x_cl, y_cl)]


def test_y_channels_last_is_what_layer_norm_of_the_permuted_map_returns():
    """`F.layer_norm(x.permute(0, 2, 3, 1), ...)` returns a contiguous (N, H, W, C) tensor: the op's
    channels-last y, permuted the same way, is that tensor, strides and all (ConvNeXt's blocks)."""
    x, weight, bias, opts = make((2, 12, 5, 6), 1, torch.float32, "layer")
    y = trifuse.ops.channel_norm(x, weight, bias, opts["eps"], y_channels_last=True).permute(0, 2, 3, 1)
    ref = torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (12,), weight, bias, opts["eps"])
    assert y.is_contiguous() and y.stride() == ref.stride()
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("layout", ["channels_last", "sliced", "expanded_weight"])
def test_other_layouts(layout):
    """A channels-last map, a slice of a wider one (copied once) and parameters that are views:
    the same answer, y contiguous."""
    x, weight, bias, opts = make((2, 12, 5, 6), 1, torch.float32, "layer")
    if layout == "channels_last":
        x = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    elif layout == "sliced":
        x = make((2, 12, 5, 9), 1, torch.float32, "layer")[0][..., ::2][..., :4]
        x = x.detach().requires_grad_()
    else:
        weight = weight.detach().view(1, 12)[0].requires_grad_()
        bias = bias.detach().expand(3, 12)[1].requires_grad_()
    check_fwd_bwd(x, weight, bias, opts)


@pytest.mark.parametrize("param_dtype", [torch.float32], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_x_with_fp32_parameters(dtype, param_dtype):
    """fp32 master weights on 16-bit maps: y rounded once to x's dtype, the gradients in each
    input's dtype."""
    for kind in ("layer", "rms"):
        x, weight, bias, opts = make((2, 40, 6), 1, dtype, kind, param_dtype=param_dtype)
        check_fwd_bwd(x, weight, bias, opts)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_large_values_far_from_zero(kind):
    """A mean of 1e4 and a spread of 1: the corrected two-pass statistics, as the row norms'."""
    x, weight, bias, opts = make((2, 50, 9), 1, torch.float32, kind, scale=1.0, shift=1e4)
    check_fwd_bwd(x, weight, bias, opts)


def test_floored_positions_have_no_gradient_through_their_rms():
    """F.normalize's floor: a zero position and a tiny one are x / eps, their rms not differentiated
    (the rstd stored negated), as the model's clamp gives; both tile paths."""
    for c in (12, 70):
        x, weight, bias, opts = make((2, c, 7), 1, torch.float32, "l2_floored")
        opts["eps"] = 1e-3
        with torch.no_grad():
            x[0, :, 2] = 0.0
            x[1, :, 4] *= 1e-6
        check_fwd_bwd(x, weight, bias, opts)


def test_partial_sums_only_for_the_parameters_that_want_a_gradient(monkeypatch):
    """A frozen weight (an L2 norm's constant scale) or bias: the backward neither stores its
    partial rows nor sums them; the gradients that are asked for are unchanged."""
    seen = []
    run = cn_mod._bwd.run
    monkeypatch.setattr(cn_mod._bwd, "run", lambda grid, args, kw: seen.append(
        (kw["STORE_DX"], kw["STORE_DW"], kw["STORE_DB"])) or run(grid, args, kw))
    monkeypatch.setattr(cn_mod, "_PLANS", {})
    for frozen, expected in (((), (True, True, True)), (("weight",), (True, False, True)),
                             (("weight", "bias"), (True, False, False)), (("x",), (False, True, True))):
        x, weight, bias, opts = make((2, 10, 6), 1, torch.float32, "layer")
        named = {"x": x, "weight": weight, "bias": bias}
        for name in frozen:
            named[name].requires_grad_(False)
        check_fwd_bwd(*named.values(), opts)
        assert seen.pop() == expected, frozen


def test_backward_saves_no_activation():
    """x, the parameters and one fp32 value a position for each statistic (RMSNorm: rstd alone)."""
    for kind, stats in (("layer", [(2, 4, 5), (2, 4, 5)]), ("rms", [(0,), (2, 4, 5)])):
        x, weight, bias, opts = make((2, 30, 4, 5), 1, torch.float32, kind)
        y = trifuse.ops.channel_norm(x, weight, bias, **opts)
        saved = y.grad_fn.saved_tensors
        assert saved[0] is x and saved[1] is weight and saved[2] is bias
        assert [tuple(t.shape) for t in saved[3:]] == stats


@pytest.mark.parametrize("kind", ["layer", "l2_floored"])
def test_eager_path_and_registered_op_are_bitwise_equal_and_repeatable(kind):
    x, weight, bias, opts = make((3, 40, 70), 1, torch.float32, kind)
    eager = trifuse.ops.channel_norm(x, weight, bias, **opts)
    op = torch.ops.trifuse.channel_norm(x, 1, weight, bias, opts["eps"], opts["rms"], opts["clamp_eps"])[0]
    assert torch.equal(eager, op)
    inputs = [t for t in (x, weight, bias) if t is not None]
    dy = torch.randn_like(eager)
    first = torch.autograd.grad(eager, inputs, dy, retain_graph=True)
    again = torch.autograd.grad(eager, inputs, dy)
    registered = torch.autograd.grad(op, inputs, dy)
    for a, b, c in zip(first, again, registered):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("kind", ["layer", "rms_bare", "l2_floored"])
def test_compiles_fullgraph_without_graph_breaks(kind):
    x, weight, bias, opts = make((2, 20, 5, 5), 1, torch.float32, kind)
    fn = torch.compile(lambda x, w, b: trifuse.ops.channel_norm(x, w, b, **opts), fullgraph=True,
                       backend="aot_eager")
    out, ref = fn(x, weight, bias), trifuse.ops.channel_norm(x, weight, bias, **opts)
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    inputs = [t for t in (x, weight, bias) if t is not None]
    for a, b in zip(torch.autograd.grad(out, inputs, torch.ones_like(out)),
                    torch.autograd.grad(ref, inputs, torch.ones_like(ref))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("x_cl", [False, True], ids=["x-contiguous", "x-channels-last"])
def test_opcheck_every_op(x_cl):
    """opcheck compares the fake's outputs (strides included) with the real ones: y in either
    layout, dx in x's."""
    for kind in KINDS:
        x, weight, bias, opts = make((2, 9, 10), 1, torch.float32, kind)
        x = _channels_innermost(x) if x_cl else x
        for y_cl in (False, True):
            args = (x, -2, weight, bias, opts["eps"], opts["rms"], opts["clamp_eps"], y_cl)
            torch.library.opcheck(torch.ops.trifuse.channel_norm.default, args)
        _, mean, rstd = (t.detach() for t in torch.ops.trifuse.channel_norm(*args))
        w = None if weight is None else weight.detach()
        grad = torch.randn(2, 9, 10, device=DEVICE)
        for dy in (grad, _channels_innermost(grad)):
            for need_dx, vectors in ((True, 3), (False, 1), (True, 0), (True, 2)):
                torch.library.opcheck(torch.ops.trifuse.channel_norm_backward.default,
                                      (dy, x.detach(), 1, w, mean, rstd, opts["rms"], need_dx, vectors))


def test_gradcheck_float64():
    for kind in ("layer", "rms", "l2_floored"):
        for shape in ((2, 5, 3), (1, 40, 2)):  # one tile; channels in blocks (interpreter)
            x, weight, bias, opts = make(shape, 1, torch.float64, kind)
            inputs = tuple(t for t in (x, weight, bias) if t is not None)

            def fn(*ts, _opts=opts):
                return trifuse.ops.channel_norm(ts[0], *ts[1:], *(None,) * (3 - len(ts)), **_opts)
            assert torch.autograd.gradcheck(fn, inputs)


def test_double_backward_float64():
    """create_graph=True: the second derivatives through PyTorch's maths (`_channel_norm_twice`)."""
    x, weight, bias, opts = make((2, 5, 3), 1, torch.float64, "layer")
    assert torch.autograd.gradgradcheck(lambda x, w, b: trifuse.ops.channel_norm(x, w, b, **opts),
                                        (x, weight, bias))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 80), spatial=st.integers(1, 40), kind=st.sampled_from(KINDS))
def test_hypothesis_shapes(n, c, spatial, kind):
    torch.manual_seed(n * 100000 + c * 100 + spatial)
    x, weight, bias, opts = make((n, c, spatial), 1, torch.float32, kind)
    check_fwd_bwd(x, weight, bias, opts)


def test_every_candidate_of_the_dialect_agrees():
    """The row kernels on a channels-last copy and PyTorch's norms on one (what the dialect may
    choose on a GPU) by the same rule, y in the layout asked for; PyTorch has no floored RMSNorm,
    and says so."""
    for kind in KINDS:
        x, weight, bias, opts = make((2, 30, 7), 1, torch.float32, kind)
        for y_cl in (False, True):
            args = (x, opts["dim"], weight, bias, opts["eps"], opts["rms"], opts["clamp_eps"], y_cl)
            for candidate in CHANNEL_NORM.candidates:
                reason = candidate.rejection(args, False)
                if reason is not None:
                    assert candidate.name == "torch" and kind == "l2_floored" and "floored" in reason
                    continue
                y = candidate.fn(*args)
                assert cn_mod.channels_last(y, 1) == y_cl and y.is_contiguous() == (not y_cl)
                ref64 = _ref(*_detached((x, weight, bias), torch.float64), opts)
                assert_close(f"{candidate.name} {kind}", y, ref64, _ref(x, weight, bias, opts))


# ---------------------------------------------------------------------------------------------
# Negative controls: plausible wrong answers fail the same rule.
# ---------------------------------------------------------------------------------------------


def test_negative_control_the_wrong_dim_fails():
    """Statistics over the positions (the last dim, as many as the channels) must not pass."""
    x, weight, bias, opts = make((2, 8, 8), 1, torch.float32, "layer")
    ref = _ref(*_detached((x, weight, bias), torch.float64), opts)
    wrong = trifuse.ops.channel_norm(x, weight, bias, opts["eps"], dim=-1)
    ok, msg = check_close("statistics over the positions", wrong, ref, None)
    assert not ok, msg


def test_negative_control_dx_without_the_projection_term_fails():
    x, weight, _, opts = make((2, 12, 9), 1, torch.float32, "rms")
    dy = torch.randn(2, 12, 9, device=DEVICE)
    x64, w64 = _detached((x, weight), torch.float64)
    (dx64,) = torch.autograd.grad(_ref(x64, w64, None, opts), x64, dy.double())
    ms = x.detach().pow(2).mean(1, keepdim=True)
    wrong = dy * weight.detach()[:, None] * torch.rsqrt(ms + opts["eps"])  # g * rstd alone
    ok, msg = check_close("dx without the projection", wrong, dx64, None)
    assert not ok, msg


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the op and the argument, in eager and under compile.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, weight, bias, kwargs, exc, match",
    [
        (torch.ones(2, 6, 4), torch.ones(4), None, {}, ValueError,
         r"channel_norm: weight must have shape \(6,\)"),
        (torch.ones(2, 6, 4), None, None, {"dim": 3}, ValueError,
         "channel_norm: dim must be an int naming a dim"),
        (torch.ones(2, 6, 4), None, torch.ones(6), {"rms": True}, ValueError, "an RMSNorm .* takes no bias"),
        (torch.ones(2, 6, 4), None, None, {"clamp_eps": True}, ValueError, "clamp_eps .* needs rms=True"),
        (torch.ones(2, 6, 4), None, None, {"eps": -1.0}, ValueError,
         "channel_norm: eps must be a number >= 0"),
        (torch.ones(2, 6, 4, dtype=torch.int64), None, None, {}, TypeError,
         "channel_norm: x must be float16, bfloat16, float32 or float64, got torch.int64"),
        ("not a tensor", None, None, {}, TypeError, "channel_norm: x must be a torch.Tensor, got str"),
    ],
    ids=["weight-shape", "dim", "rms-bias", "clamp-without-rms", "eps", "int-x", "not-tensor"],
)
def test_bad_input_raises_clear_error(x, weight, bias, kwargs, exc, match):
    x = x.to(DEVICE) if isinstance(x, torch.Tensor) else x
    with pytest.raises(exc, match=match):
        trifuse.ops.channel_norm(x, weight, bias, **kwargs)
    if isinstance(x, torch.Tensor):
        with pytest.raises(exc, match=match):
            torch.ops.trifuse.channel_norm(x, kwargs.get("dim", 1), weight, bias, kwargs.get("eps", 1e-5),
                                           kwargs.get("rms", False), kwargs.get("clamp_eps", False))


def test_bad_input_raises_under_compile():
    fn = torch.compile(lambda x: trifuse.ops.channel_norm(x, torch.ones(4)), fullgraph=True,
                       backend="aot_eager")
    with pytest.raises(Exception, match=r"channel_norm: weight must have shape \(6,\)"):
        fn(torch.ones(2, 6, 3, device=DEVICE))


def test_mismatched_devices_raise():
    with pytest.raises(ValueError, match="weight is on meta"):
        trifuse.ops.channel_norm(torch.ones(2, 4, 3, device=DEVICE), torch.ones(4, device="meta"))


def test_reference_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: same maths, same API."""
    monkeypatch.setattr(cn_mod, "use_triton", lambda t: False)
    for kind in KINDS:
        for dtype in (torch.float32, torch.float16):
            x, weight, bias, opts = make((2, 6, 37), 1, dtype, kind)
            check_fwd_bwd(x, weight, bias, opts)
