"""The gated residual add before a per-token modulated norm, in one pass each way
(`trifuse.ops.gated_add_layer_norm_modulate` with a gate, mul or add varying along a sample's rows:
the row kernels of kernels/adaptive_norm.py with HAS_RESIDUAL):

    s = residual + gate * x;   y = norm(s) * (mul + mul_offset) + add;   returns (y, s)

as Qwen-Image 2.1's image stream writes `h = h + gate1 * attn_out` and then
`norm2(h) * (1 + scale) + shift`, gate, scale and shift (B, S, N).

y, s and the gradients of x, residual, gate, mul, add, weight and bias against the float64
oracle (the formula as models write it, each step rounded in the inputs' dtype) by the rule of
tests/tolerances.py, with gradients arriving at y, at s, or at both. On CPU these run the real
Triton kernels in the interpreter; on a GPU the same tests add bf16.
"""
import pytest
import torch
import torch.nn.functional as F
import trifuse
from _device import DEVICE
from _fusing import call_of, dtype_casts, traced_graphs
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close
from trifuse.kernels import adaptive_norm as an

EPS = 1e-6
NORMS = ["layer_norm", "rms_norm"]
NAMES = ("dx", "dresidual", "dgate", "dmul", "dadd", "dweight", "dbias")


def formula(x, residual, gate, mul, add, w, b, norm, mul_offset=1.0):
    """The oracle: the gated sum, the norm, then `(mul + mul_offset) * y + add`, as models write it."""
    s = residual + (x if gate is None else gate * x)
    if norm == "rms_norm":
        y = F.rms_norm(s, [s.shape[-1]], w, EPS)
    else:
        y = F.layer_norm(s, [s.shape[-1]], w, b, EPS)
    if mul is not None:
        y = (mul + mul_offset if mul_offset else mul) * y
    return (y if add is None else y + add), s


# (x shape, gate shape, mul shape, add shape): everything per token; 4-D video tokens; a per-row
# scalar gate; a per-sample gate beside a per-token modulation and the other way round; no gate; a
# gate with no modulation; odd widths from 1 to past a power of two.
CASES = [
    ((2, 7, 33), (2, 7, 33), (2, 7, 33), (2, 7, 33)),
    ((2, 3, 5, 16), (2, 3, 5, 16), (2, 3, 5, 16), (2, 3, 5, 16)),
    ((13, 129), (13, 129), (13, 129), (13, 129)),
    ((3, 6, 24), (3, 6, 1), (3, 6, 24), (3, 6, 24)),
    ((3, 5, 40), (3, 1, 40), (3, 5, 40), (3, 5, 40)),
    ((3, 5, 40), (3, 5, 40), (3, 1, 40), (3, 1, 40)),
    ((2, 9, 48), None, (2, 9, 48), (2, 9, 48)),
    ((2, 8, 1000), (2, 8, 1000), None, None),
    ((3, 4, 1), (3, 4, 1), (3, 4, 1), None),
]


def _id(case):
    return "-".join("none" if s is None else "x".join(map(str, s)) for s in case)


def make(case, dtype, norm, affine=True):
    """[x, residual, gate, mul, add, weight, bias], each requiring grad (or None)."""
    x_shape, gate_shape, mul_shape, add_shape = case
    n = x_shape[-1]

    def t(shape, scale=1.0, offset=0.0):
        return None if shape is None else (torch.randn(shape, device=DEVICE) * scale + offset).to(dtype)

    x, residual = t(x_shape, 2.0, 0.5), t(x_shape)
    gate, mul, add = t(gate_shape, 0.7), t(mul_shape, 0.5), t(add_shape)
    w = t((n,), 0.3, 1.0) if affine else None
    b = t((n,)) if affine and norm == "layer_norm" else None
    return [None if v is None else v.requires_grad_() for v in (x, residual, gate, mul, add, w, b)]


def run(inputs, norm, mul_offset=1.0, **kwargs):
    x, residual, gate, mul, add, w, b = inputs
    return trifuse.ops.gated_add_layer_norm_modulate(
        x, residual, gate, [x.shape[-1]], mul, add, w, b, EPS, is_rms_norm=norm == "rms_norm",
        mul_offset=mul_offset if mul is not None else 0.0, **kwargs)


def check_fwd_bwd(inputs, norm, mul_offset=1.0, grads_at=("y", "s")):
    """y, s and every gradient against float64 by the oracle rule, PyTorch in the inputs' dtypes
    the yardstick; the gradients arrive at the outputs `grads_at` names."""
    offset = mul_offset if inputs[3] is not None else 0.0
    i64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ilp = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y, s = run(inputs, norm, offset)
    (y64, s64), (ylp, slp) = formula(*i64, norm, offset), formula(*ilp, norm, offset)
    assert y.shape == ylp.shape and y.dtype == ylp.dtype and s.dtype == slp.dtype and s.shape == slp.shape
    assert_close("y", y, y64, ylp)
    assert_close("s", s, s64, slp)
    gy, gs = torch.randn_like(y64), torch.randn_like(s64)
    for outs in ((y, s), (y64, s64), (ylp, slp)):
        pairs = [(o, g.to(o.dtype)) for o, g, name in zip(outs, (gy, gs), ("y", "s")) if name in grads_at]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    for name, a, a64, alp in zip(NAMES, inputs, i64, ilp):
        if a is not None:
            if a64.grad is None:  # (add's gradient with none arriving at y)
                assert a.grad is None or torch.count_nonzero(a.grad) == 0, name
                continue
            assert a.grad is not None and a.grad.dtype == a.dtype and a.grad.shape == a.shape, name
            assert_close(name, a.grad, a64.grad, alp.grad)


@pytest.fixture
def rows_spy(monkeypatch):
    """The row kernels' launches with a residual (the forward's host function), failing the per-sample
    path (the gate and modulation folded into group vectors)."""
    calls = []
    real = an._rows_fwd

    def spy(*args):
        calls.append(args[9] is not None if len(args) > 9 else False)
        return real(*args)

    def no_fold(*args):
        raise AssertionError("a per-token gated add took the per-sample (folded) path")

    monkeypatch.setattr(an, "_rows_fwd", spy)
    monkeypatch.setattr(an, "_gated_fwd", no_fold)
    return calls


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_oracle(dtype, norm, case, rows_spy):
    check_fwd_bwd(make(case, dtype, norm), norm)
    assert rows_spy == [True], "the row kernels did not run once with the residual"


@pytest.mark.parametrize("grads_at", [("y",), ("s",)], ids=["y only", "s only"])
@pytest.mark.parametrize("norm", NORMS)
def test_gradient_at_one_output_only(norm, grads_at):
    """s unread after the norm (the block's end is elsewhere), or y unread: the other's gradient
    None, the op's backward still right."""
    check_fwd_bwd(make(((3, 5, 40), (3, 5, 40), (3, 5, 40), (3, 5, 40)), torch.float32, norm), norm,
                  grads_at=grads_at)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("mul_offset", [0.0, 1.0, -0.5])
def test_without_the_norms_own_affine(norm, mul_offset):
    check_fwd_bwd(make(((3, 5, 40), (3, 5, 40), (3, 5, 40), (3, 5, 40)), torch.float32, norm, affine=False), norm,
                  mul_offset)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("affine", [False, True])
def test_wide_rows(norm, affine):
    """Rows past the single-block width: s stored by the chunked forward's first pass and
    recomputed by the others; the chunked backward."""
    shape = (1, 2, 17000)
    check_fwd_bwd(make((shape, shape, shape, shape), torch.float32, norm, affine), norm)


def test_chunks_of_one_projection_are_read_in_place():
    """shift, scale and gate chunks of one (B, S, 3N) tensor (rows 3N apart): the projection's
    gradient against float64."""
    emb = torch.randn(2, 6, 3 * 40, device=DEVICE, requires_grad=True)
    x, residual = (torch.randn(2, 6, 40, device=DEVICE, requires_grad=True) for _ in range(2))
    shift, scale, gate = emb.chunk(3, dim=-1)
    assert not gate.is_contiguous() and an.as_rows(gate, 40)[1] == 120
    y, s = trifuse.ops.gated_add_layer_norm_modulate(x, residual, gate, [40], scale, shift, eps=EPS, mul_offset=1.0)
    x64, r64, emb64 = (t.detach().double().requires_grad_() for t in (x, residual, emb))
    shift64, scale64, gate64 = emb64.chunk(3, dim=-1)
    s64 = r64 + gate64 * x64
    y64 = (1 + scale64) * F.layer_norm(s64, [40], eps=EPS) + shift64
    assert_close("y", y, y64, None)
    assert_close("s", s, s64, None)
    g, gs = torch.randn_like(y64), torch.randn_like(s64)
    torch.autograd.backward((y, s), (g.float(), gs.float()))
    torch.autograd.backward((y64, s64), (g, gs))
    for name, a, a64 in (("demb", emb, emb64), ("dx", x, x64), ("dresidual", residual, r64)):
        assert_close(name, a.grad, a64.grad, None)


def test_many_rows_split_over_several_programs():
    shape = (3, 300, 48)
    check_fwd_bwd(make((shape, shape, shape, shape), torch.float32, "layer_norm"), "layer_norm")


def test_mixed_dtypes_promote_like_the_formula():
    """x and the gate fp16, the residual fp32 (s fp32, and the norm's affine), the modulation fp32:
    y and s in fp32, each gradient in its input's dtype."""
    x, residual, gate, mul, add, w, b = make(((2, 5, 32),) * 4, torch.float16, "layer_norm")
    residual, mul, add, w, b = (t.detach().float().requires_grad_() for t in (residual, mul, add, w, b))
    check_fwd_bwd([x, residual, gate, mul, add, w, b], "layer_norm")


def test_ungated_with_mixed_dtypes():
    """No gate, x fp16 beside an fp32 residual: dx and dresidual each in its own dtype."""
    x, residual, _, mul, add, w, b = make(((2, 5, 32), None, (2, 5, 32), (2, 5, 32)), torch.float16, "rms_norm")
    residual, w = (t.detach().float().requires_grad_() for t in (residual, w))
    check_fwd_bwd([x, residual, None, mul, add, w, b], "rms_norm")


def test_strided_inputs():
    """x, the residual and the gate transposed views (rows not evenly strided)."""
    x, residual, gate = (torch.randn(6, 2, 40, device=DEVICE).transpose(0, 1).requires_grad_() for _ in range(3))
    _, _, _, mul, add, w, b = make(((2, 6, 40), None, (2, 6, 40), (2, 6, 40)), torch.float32, "layer_norm")
    check_fwd_bwd([x, residual, gate, mul, add, w, b], "layer_norm")


def test_empty_input():
    inputs = make(((0, 5, 16),) * 4, torch.float32, "layer_norm")
    y, s = run(inputs, "layer_norm")
    assert y.shape == s.shape == (0, 5, 16)
    (y.sum() + s.sum()).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in inputs)


def test_large_values():
    """A residual around 1e3 with a small spread (the corrected two-pass mean) and a large modulation."""
    x, residual, gate, mul, add, w, b = make(((2, 6, 64),) * 4, torch.float32, "layer_norm")
    residual = (residual.detach() * 1e-2 + 1e3).requires_grad_()
    mul = (mul.detach() * 1e2).requires_grad_()
    check_fwd_bwd([x, residual, gate, mul, add, w, b], "layer_norm")


def test_deterministic():
    inputs = make(((3, 300, 48),) * 4, torch.float32, "layer_norm")
    results = []
    for _ in range(2):
        for t in inputs:
            t.grad = None
        y, s = run(inputs, "layer_norm")
        torch.autograd.backward((y, s), (torch.ones_like(y), torch.full_like(s, 0.5)))
        results.append([y.detach().clone(), s.detach().clone()] + [t.grad.clone() for t in inputs])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_gradcheck_float64():
    def t(*shape):
        return torch.randn(shape, device=DEVICE, dtype=torch.float64, requires_grad=True)

    x, r, g, mul = t(2, 3, 5), t(2, 3, 5), t(2, 3, 5), t(2, 3, 5)
    add, w, b = t(2, 3, 1), t(5), t(5)
    assert torch.autograd.gradcheck(lambda *a: trifuse.ops.gated_add_layer_norm_modulate(
        a[0], a[1], a[2], [5], *a[3:], eps=EPS, mul_offset=1.0), (x, r, g, mul, add, w, b))
    assert torch.autograd.gradcheck(lambda *a: trifuse.ops.gated_add_layer_norm_modulate(
        a[0], a[1], a[2], [5], *a[3:], eps=EPS, is_rms_norm=True), (x, r, g, mul, add, w))


def test_twice_differentiable():
    inputs = tuple(make(((2, 4, 8),) * 4, torch.float64, "layer_norm"))
    assert torch.autograd.gradgradcheck(lambda *a: trifuse.ops.gated_add_layer_norm_modulate(
        a[0], a[1], a[2], [8], *a[3:], eps=EPS, mul_offset=1.0), inputs, fast_mode=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("norm", NORMS)
def test_compiles_without_graph_breaks(norm, backend):
    """Under torch.compile(fullgraph=True) the registered op and its backward op run, equal to the
    eager path; with a per-sample add broadcast, summed down outside the op."""
    inputs = make(((2, 5, 32), (2, 5, 32), (2, 5, 32), (2, 1, 32)), torch.float32, norm)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: run(a, norm), fullgraph=True, backend=backend)
    i2 = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    (y, s), (y_eager, s_eager) = compiled(*inputs), run(i2, norm)
    torch.testing.assert_close(y, y_eager)
    torch.testing.assert_close(s, s_eager)
    (y.sum() + 0.5 * s.sum()).backward()
    (y_eager.sum() + 0.5 * s_eager.sum()).backward()
    for a, b in zip(inputs, i2):
        if a is not None:
            torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
def test_registered_ops_pass_opcheck(is_rms_norm, affine):
    """Schema, fake tensors, autograd registration, no output aliasing another (dx beside
    dresidual without a gate)."""
    x, r, g, mul = (torch.randn(2, 5, 16, device=DEVICE) for _ in range(4))
    add = torch.randn(2, 1, 16, device=DEVICE)
    w = torch.randn(16, device=DEVICE) if affine else None
    b = torch.randn(16, device=DEVICE) if affine and not is_rms_norm else None
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    for gate in (g, None):
        args = (x, r, gate, mul, add, w, b, EPS, is_rms_norm, 1.0, torch.float32)
        torch.library.opcheck(torch.ops.trifuse.gated_norm_modulate_rows.default, args, test_utils=utils)
        _, s, mean, rstd = torch.ops.trifuse.gated_norm_modulate_rows(*args)
        for need in ((True,) * 6, (False,) * 6):
            torch.library.opcheck(torch.ops.trifuse.gated_norm_modulate_rows_backward.default,
                                  (torch.randn_like(x), torch.randn_like(x), x, r, gate, s, mul, w, b, mean, rstd,
                                   EPS, is_rms_norm, 1.0, *need), test_utils=utils)


@pytest.mark.parametrize("bad, error, message", [
    ({"gate_shape": (3, 2, 40)}, ValueError, "gate must broadcast against input"),
    ({"gate_shape": (3, 5, 39)}, ValueError, "last dim 40 or 1"),
    ({"gate_dtype": torch.float64}, ValueError, "gate .* must be no wider than"),
    ({"residual_shape": (3, 1, 40)}, ValueError, "residual must have the input's shape"),
    ({"mul_offset": 1.0, "no_mul": True}, ValueError, "needs a mul"),
    ({"mul_offset": float("inf")}, TypeError, "mul_offset must be a finite number"),
])
def test_bad_input_names_the_op_and_argument(bad, error, message):
    x = torch.randn(3, 5, 40, device=DEVICE)
    residual = torch.randn(bad.get("residual_shape", (3, 5, 40)), device=DEVICE)
    gate = torch.randn(bad.get("gate_shape", (3, 5, 40)), device=DEVICE, dtype=bad.get("gate_dtype", torch.float32))
    mul = None if bad.get("no_mul") else torch.randn(3, 5, 40, device=DEVICE)
    with pytest.raises(error, match=message) as err:
        trifuse.ops.gated_add_layer_norm_modulate(x, residual, gate, [40], mul, torch.randn(3, 5, 40, device=DEVICE),
                                                  eps=EPS, mul_offset=bad.get("mul_offset", 0.0))
    assert "trifuse.gated_add_layer_norm_modulate" in str(err.value)


def test_per_sample_call_takes_the_offset_into_its_vector():
    """Gate, mul and add all per sample with mul_offset: the folded path (`1 + scale` on the small
    vector), against the same oracle."""
    check_fwd_bwd(make(((3, 5, 40), (3, 1, 40), (3, 1, 40), (3, 1, 40)), torch.float32, "layer_norm"),
                  "layer_norm", mul_offset=1.0)


# ---------------------------------------------------------------------------------------------
# out_dtype, readers, full_y (fusion/narrow.py sets them) through either candidate
# ---------------------------------------------------------------------------------------------

CANDIDATES = {"trifuse": an._gated_rows_trifuse, "torch": an._gated_rows_torch_candidate}


def _call(candidate, inputs, norm, **narrowing):
    x, r, g, mul, add, w, b = inputs
    defaults = (("out_dtype", None), ("readers", 1), ("full_y", False))
    return CANDIDATES[candidate](x, r, g, [x.shape[-1]], mul, add, w, b, EPS, norm == "rms_norm", 1.0,
                                 *(narrowing.get(k, d) for k, d in defaults))


@pytest.mark.parametrize("vectors", [(3, 7, 37), (1, 7, 37), (3, 7, 1)], ids=["full", "per-token", "per-row"])
@pytest.mark.parametrize("candidate", CANDIDATES)
@pytest.mark.parametrize("norm", NORMS)
def test_out_dtype_is_the_cast_of_y(candidate, norm, vectors):
    """y in a narrower out_dtype is bitwise y.to(out_dtype), s unchanged, the gradients those of
    the cast's: a broadcast gate's, mul's and add's summed in fp32, as the cast's fp32 gradient
    is (full-size ones bitwise, summed ones to fp32's rounding; fp16 sums miss by 1e-3)."""
    torch.manual_seed(0)
    inputs = make(((3, 7, 37),) + (vectors,) * 3, torch.float32, norm)
    leaves = [t for t in inputs if t is not None]
    y, s = _call(candidate, inputs, norm)
    dy, ds = torch.randn(y.shape, device=DEVICE).half(), torch.randn(y.shape, device=DEVICE)
    grads = torch.autograd.grad((y.half(), s), leaves, (dy, ds))
    y16, s16 = _call(candidate, inputs, norm, out_dtype=torch.float16)
    grads16 = torch.autograd.grad((y16, s16), leaves, (dy, ds))
    assert y16.dtype == torch.float16 and torch.equal(y16, y.half()) and torch.equal(s16, s)
    for a, c in zip(grads, grads16):
        assert a.dtype == c.dtype
        if a.shape == y.shape or vectors == (3, 7, 37):
            assert torch.equal(a, c)
        else:
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("candidate", CANDIDATES)
def test_readers_and_full_y(candidate):
    """Three readers' views (one buffer for the kernels), or y and its narrow copy: the outputs'
    count, dtypes and values."""
    torch.manual_seed(0)
    inputs = make(((3, 7, 37),) * 4, torch.float32, "layer_norm")
    y, s = _call(candidate, inputs, "layer_norm")
    *ys, s3 = _call(candidate, inputs, "layer_norm", out_dtype=torch.float16, readers=3)
    assert len(ys) == 3 and all(torch.equal(t, y.half()) for t in ys) and torch.equal(s3, s)
    assert candidate == "torch" or all(t.data_ptr() == ys[0].data_ptr() for t in ys)
    y_full, y16, s_full = _call(candidate, inputs, "layer_norm", out_dtype=torch.float16, full_y=True)
    assert torch.equal(y_full, y) and torch.equal(y16, y.half()) and torch.equal(s_full, s)


@pytest.mark.parametrize("readers", [1, 2])
def test_narrowed_through_the_registered_op(readers):
    """Traced with one reader, the registered op writes y in out_dtype itself: no cast after it
    forward or before its backward (an opaque op: each would be one more pass); with several, y in
    its own dtype, cast once per reader."""
    x, r, g, mul, add, w, b = (t.detach() for t in make(((3, 7, 37),) * 4, torch.float32, "layer_norm"))

    def fn(*a):
        return trifuse.ops.gated_add_layer_norm_modulate(
            a[0], a[1], a[2], [37], *a[3:], eps=EPS, out_dtype=torch.float16, readers=readers, mul_offset=1.0)

    torch._dynamo.reset()
    ys, s = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, r, g, mul, add, w, b)
    ys = ys if readers > 1 else (ys,)
    y_ref, s_ref = formula(x, r, g, mul, add, w, b, "layer_norm")
    torch.testing.assert_close(s, s_ref)
    assert len(ys) == readers and all(t.dtype == torch.float16 for t in ys)
    for y in ys:
        torch.testing.assert_close(y, y_ref.half())
    forward, backward = traced_graphs(fn, *(t.clone().requires_grad_() for t in (x, r, g, mul, add, w, b)))
    op = call_of(forward, "gated_norm_modulate_rows")
    assert op.args[-1] == (torch.float16 if readers == 1 else torch.float32)
    assert (dtype_casts(forward) == []) == (readers == 1)
    # its backward reads y's gradient as it comes (fp16), not cast to fp32 first
    bop = call_of(backward, "gated_norm_modulate_rows_backward")
    assert (bop.args[0].op == "placeholder") == (readers == 1)


# ---------------------------------------------------------------------------------------------
# Random feature combinations, and negative controls: plausible wrong kernels fail the oracle
# ---------------------------------------------------------------------------------------------

CPU_DTYPES = [d for d in DTYPES if DEVICE == "cuda" or d != torch.bfloat16]


@settings(max_examples=24, deadline=None, derandomize=True)
@given(b=st.integers(1, 3), s=st.integers(2, 7), n=st.integers(1, 1100), norm=st.sampled_from(NORMS),
       affine=st.booleans(), gate_kind=st.sampled_from(["full", "chunk", "row_scalar", "per_sample", "none"]),
       mod_kind=st.sampled_from(["full", "per_sample", "none"]), offset=st.sampled_from([0.0, 1.0]),
       dtype=st.sampled_from(CPU_DTYPES), far=st.booleans())
def test_hypothesis_feature_combinations(b, s, n, norm, affine, gate_kind, mod_kind, offset, dtype, far):
    """Widths, the gate's and the modulation's broadcasts, the affine, the offset and a residual far
    from 0, drawn together; something per token (else the per-sample path runs)."""
    assume(gate_kind in ("full", "chunk", "row_scalar") or mod_kind == "full")
    torch.manual_seed(b * 10000 + s * 1000 + n)
    x, residual, _, _, _, w, bias = make(((b, s, n), None, None, None), dtype, norm, affine)
    if far:
        residual = (residual.detach().double() * 0.1 + 100.0).to(dtype).requires_grad_()
    shapes = {"full": (b, s, n), "row_scalar": (b, s, 1), "per_sample": (b, 1, n)}

    def draw(kind, scale):
        if kind == "none":
            return None
        if kind == "chunk":
            return (torch.randn(b, s, 3 * n, device=DEVICE) * scale).to(dtype)[..., n:2 * n].requires_grad_()
        return (torch.randn(shapes[kind], device=DEVICE) * scale).to(dtype).requires_grad_()

    gate, mul, add = draw(gate_kind, 0.7), draw(mod_kind, 0.5), draw(mod_kind, 1.0)
    check_fwd_bwd([x, residual, gate, mul, add, w, bias], norm, offset)


def test_negative_control_gate_read_from_the_next_row_fails():
    """The oracle notices a gate row read one row off (a wrong row stride), in s and in y."""
    inputs = make(((2, 6, 40),) * 4, torch.float32, "layer_norm")
    y, s = run(inputs, "layer_norm")
    i64 = [t.detach().double() for t in inputs]
    wrong_y, wrong_s = formula(i64[0], i64[1], torch.roll(i64[2], 1, dims=1), *i64[3:], "layer_norm")
    assert not check_close("s, gate one row off", s, wrong_s, None)[0]
    assert not check_close("y, gate one row off", y, wrong_y, None)[0]
    right_y, right_s = formula(*i64, "layer_norm")
    assert check_close("y", y, right_y, None)[0] and check_close("s", s, right_s, None)[0]


def test_negative_control_gradient_at_s_dropped_fails():
    """...and a backward that ignored the gradient arriving at s (dx, dresidual, dgate all miss it)."""
    inputs = make(((2, 6, 40),) * 4, torch.float32, "rms_norm", affine=False)
    y, s = run(inputs, "rms_norm")
    i64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    y64, s64 = formula(*i64, "rms_norm")
    gy, gs = torch.randn_like(y64), torch.randn_like(s64)
    torch.autograd.backward((y, s), (gy.float(), gs.float()))
    y64.backward(gy)  # the wrong backward: the gradient at s dropped
    for name, a, a64 in zip(NAMES[:3], inputs, i64):
        assert not check_close(f"{name}, gradient at s dropped", a.grad, a64.grad, None)[0]
