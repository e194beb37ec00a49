"""A diffusion transformer's residual add and the adaptive norm after it in one op:
s = residual + gate * x, y = norm(s) * mul + add, returning (y, s)
(`trifuse.ops.gated_add_layer_norm_modulate`, kernels/adaptive_norm.py), LayerNorm and RMSNorm.

y, s and the gradients of x, residual, gate, mul, add, weight and bias (y's and s's gradients
both arriving) against the float64 oracle, the formula as DiT writes it, by the rule of
tests/tolerances.py. On CPU these run the real Triton kernels in the interpreter (the gate read per
group of rows as the affine is, dgate summed in the backward's partial buffers).
"""
import pytest
import torch
import trifuse
from _device import DEVICE
from _fusing import call_of, dtype_casts, traced_graphs
from tolerances import DTYPES, assert_close
from trifuse.kernels.adaptive_norm import layer_norm_modulate_ref

EPS = 1e-6
NORMS = ["layer_norm", "rms_norm"]
NAMES = ("x", "residual", "gate", "mul", "add", "weight", "bias")

# (x shape, gate shape, mul shape, add shape): DiT's (B, 1, N) gate and modulation, no gate (PixArt's
# cross-attention add), one gate for all samples, a scalar gate per sample, a video's gate per
# frame beside a modulation per sample, one row per sample, odd widths, mul alone, no modulation.
CASES = [
    ((3, 5, 40), (3, 1, 40), (3, 1, 40), (3, 1, 40)),
    ((2, 7, 33), None, (2, 1, 33), (2, 1, 33)),
    ((2, 9, 129), (129,), (2, 1, 129), (2, 1, 129)),
    ((4, 6, 24), (4, 1, 1), (4, 1, 24), (4, 1, 24)),
    ((2, 3, 4, 16), (2, 3, 1, 16), (2, 1, 1, 16), (2, 1, 1, 16)),
    ((5, 1, 7), (5, 1, 7), (5, 1, 7), (5, 1, 7)),
    ((2, 8, 1000), (2, 1, 1000), (2, 1, 1000), None),
    ((3, 5, 40), (40,), None, None),  # a LayerScale before a plain norm: one group, the gate (N,)
]


def _id(case):
    return "-".join("none" if s is None else "x".join(map(str, s)) for s in case)


def make(case, dtype, norm, affine=True):
    x_shape, gate_shape, mul_shape, add_shape = case
    n = x_shape[-1]

    def t(shape, scale=1.0, offset=0.0):
        return None if shape is None else (torch.randn(shape, device=DEVICE) * scale + offset).to(dtype)

    x, residual = t(x_shape), t(x_shape, 2.0, 0.5)
    gate, mul, add = t(gate_shape, 0.5), t(mul_shape, 0.5, 1.0), t(add_shape)
    w = t((n,), 0.3, 1.0) if affine else None
    b = t((n,)) if affine and norm == "layer_norm" else None
    return [None if v is None else v.requires_grad_() for v in (x, residual, gate, mul, add, w, b)]


def run(inputs, norm, **kwargs):
    x, residual, gate, mul, add, w, b = inputs
    return trifuse.ops.gated_add_layer_norm_modulate(x, residual, gate, [x.shape[-1]], mul, add, w, b, EPS,
                                                     is_rms_norm=norm == "rms_norm", **kwargs)


def run_ref(inputs, norm):
    """The formula as a DiT block writes it: the product, the sum, the norm, the modulation."""
    x, residual, gate, mul, add, w, b = inputs
    s = residual + (x if gate is None else gate * x)
    return layer_norm_modulate_ref(s, [x.shape[-1]], mul, add, w, b, EPS, norm == "rms_norm"), s


def run_wan_ref(inputs, norm):
    """Wan's spelling of the sum with a gate wider than the stream: `(h.float() + attn_out *
    gate).type_as(h)` (the gate's dtype, float64 for the oracle), then the norm."""
    x, residual, gate, mul, add, w, b = inputs
    s = (residual.to(gate.dtype) + x * gate).to(x.dtype)
    return layer_norm_modulate_ref(s, [x.shape[-1]], mul, add, w, b, EPS, norm == "rms_norm"), s


def check_fwd_bwd(inputs, norm, ref=run_ref):
    """y, s and every gradient against float64 by the oracle rule, the formula as `ref` writes it
    in the inputs' dtypes the yardstick; y's and s's gradients both given."""
    i64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ilp = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    (y, s), (y64, s64), (ylp, slp) = run(inputs, norm), ref(i64, norm), ref(ilp, norm)
    assert y.shape == ylp.shape and y.dtype == ylp.dtype and s.dtype == slp.dtype
    assert_close("y", y, y64, ylp)
    assert_close("s", s, s64, slp)
    gy, gs = torch.randn_like(y64), torch.randn_like(s64)
    for out_y, out_s, dtype in ((y, s, y.dtype), (y64, s64, torch.float64), (ylp, slp, ylp.dtype)):
        torch.autograd.backward([out_y, out_s], [gy.to(dtype), gs.to(dtype)])
    for name, a, a64, alp in zip(NAMES, inputs, i64, ilp):
        if a is not None:
            assert a.grad is not None and a.grad.dtype == a.dtype and a.grad.shape == a.shape, name
            assert_close(f"d{name}", a.grad, a64.grad, alp.grad)


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_oracle(dtype, norm, case):
    check_fwd_bwd(make(case, dtype, norm), norm)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[-1]], ids=_id)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=str)
def test_a_gate_wider_than_the_stream(dtype, norm, case):
    """Wan's fp32 gate beside a 16-bit residual stream (its sum written in fp32 and cast back): the
    op computes the product and the sum in fp32 as the model does, s in the stream's dtype, the
    gate's gradient in fp32."""
    inputs = make(case, dtype, norm)
    inputs[2] = inputs[2].detach().float().requires_grad_()
    check_fwd_bwd(inputs, norm, ref=run_wan_ref)


@pytest.mark.parametrize("norm", NORMS)
def test_without_the_norms_own_affine(norm):
    check_fwd_bwd(make(CASES[0], torch.float32, norm, affine=False), norm)


@pytest.mark.parametrize("norm", NORMS)
def test_wide_rows(norm):
    """Rows past the single-block width: the chunked forward and backward read the gate per chunk."""
    wide = ((2, 2, 17000), (2, 1, 17000), (2, 1, 17000), (2, 1, 17000))
    check_fwd_bwd(make(wide, torch.float32, norm), norm)


def test_many_rows_per_sample_split_over_several_programs():
    """A sample's rows over several backward programs: dgate adds every row of its sample once."""
    check_fwd_bwd(make(((3, 300, 48), (3, 1, 48), (3, 1, 48), (3, 1, 48)), torch.float32, "layer_norm"),
                  "layer_norm")


def test_strided_x_and_residual():
    """x and the residual transposed views (rows not contiguous): right without a copy."""
    _, _, gate, mul, add, w, b = make(CASES[0], torch.float32, "layer_norm")
    x = torch.randn(5, 3, 40, device=DEVICE).transpose(0, 1).requires_grad_()
    residual = torch.randn(5, 3, 40, device=DEVICE).transpose(0, 1).requires_grad_()
    assert not x.is_contiguous() and not residual.is_contiguous()
    check_fwd_bwd([x, residual, gate, mul, add, w, b], "layer_norm")


def test_large_values_and_offsets():
    """A residual stream around 1e3 with a small spread (the norm's corrected two-pass mean), a
    large gate."""
    x, residual, gate, mul, add, w, b = make(CASES[0], torch.float32, "layer_norm")
    residual = (residual.detach() * 1e-2 + 1e3).requires_grad_()
    gate = (gate.detach() * 1e2).requires_grad_()
    check_fwd_bwd([x, residual, gate, mul, add, w, b], "layer_norm")


def test_empty_input():
    x, residual, gate, mul, add, w, b = make(((0, 5, 16), (0, 1, 16), (0, 1, 16), (0, 1, 16)), torch.float32,
                                             "layer_norm")
    y, s = run([x, residual, gate, mul, add, w, b], "layer_norm")
    assert y.shape == s.shape == x.shape
    (y.sum() + s.sum()).backward()
    assert x.grad.shape == x.shape and residual.grad.shape == x.shape and w.grad.shape == w.shape


def test_only_s_read_or_only_y_read():
    """A gradient for one of the two results alone (the other unread) is still right."""
    for read in ("y", "s"):
        inputs = make(CASES[0], torch.float64, "layer_norm")
        i64 = [t.detach().clone().requires_grad_() for t in inputs]
        out, ref = run(inputs, "layer_norm"), run_ref(i64, "layer_norm")
        k = 0 if read == "y" else 1
        out[k].backward(torch.ones_like(out[k]))
        ref[k].backward(torch.ones_like(ref[k]))
        for name, a, a64 in zip(NAMES, inputs, i64):
            if a64.grad is not None:
                torch.testing.assert_close(a.grad, a64.grad, msg=f"d{name}, only {read} read")


def test_deterministic():
    """Bitwise the same results and gradients on every run (dgate summed in a fixed order)."""
    inputs = make(((3, 300, 48), (3, 1, 48), (3, 1, 48), (3, 1, 48)), torch.float32, "layer_norm")
    results = []
    for _ in range(2):
        for t in inputs:
            t.grad = None
        y, s = run(inputs, "layer_norm")
        torch.autograd.backward([y, s], [torch.ones_like(y), torch.ones_like(s)])
        results.append([y.detach().clone(), s.detach().clone()] + [t.grad.clone() for t in inputs])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("norm", NORMS)
def test_gradcheck_and_gradgradcheck_float64(norm):
    inputs = [t for t in make(((2, 3, 5), (2, 1, 5), (2, 1, 5), (2, 1, 5)), torch.float64, norm)]
    rms = norm == "rms_norm"

    def fn(x, residual, gate, mul, add, w, *b):
        bias = b[0] if b else None
        return trifuse.ops.gated_add_layer_norm_modulate(x, residual, gate, [5], mul, add, w, bias, EPS,
                                                         is_rms_norm=rms)

    args = tuple(t for t in inputs if t is not None)
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args, fast_mode=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_runs_the_registered_ops(backend):
    """Under torch.compile(fullgraph=True) the registered op and its backward op run, equal to eager."""
    inputs = make(CASES[0], torch.float32, "layer_norm")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: run(a, "layer_norm"), fullgraph=True, backend=backend)
    i2 = [t.detach().clone().requires_grad_() for t in inputs]
    (y, s), (ye, se) = compiled(*inputs), run(i2, "layer_norm")
    torch.testing.assert_close(y, ye)
    torch.testing.assert_close(s, se)
    (y.sum() + 2 * s.sum()).backward()
    (ye.sum() + 2 * se.sum()).backward()
    for name, a, b in zip(NAMES, inputs, i2):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_registered_ops_pass_opcheck():
    x, residual = torch.randn(2, 5, 16, device=DEVICE), torch.randn(2, 5, 16, device=DEVICE)
    gate, w, b = (torch.randn(2, 16, device=DEVICE) for _ in range(3))
    checks = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.trifuse.gated_grouped_norm.default,
                          (x, residual, gate, w, b, EPS, False, 2, torch.float32), test_utils=checks)
    y, s, mean, rstd = torch.ops.trifuse.gated_grouped_norm(x, residual, gate, w, b, EPS, False, 2,
                                                            torch.float32)
    grads = (torch.randn_like(y), torch.randn_like(s))
    args = (*grads, x, s, gate, w, mean, rstd, EPS, False, 2, True, True, True, torch.float32)
    torch.library.opcheck(torch.ops.trifuse.gated_grouped_norm_backward.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("readers", [1, 3])
def test_narrowed_y_for_autocasts_matmuls(readers):
    """out_dtype and readers as `layer_norm_modulate` takes them (set by fuse under autocast): y in
    fp16 (a view per reader), s as ever; eager and traced alike."""
    inputs = make(CASES[0], torch.float32, "layer_norm")
    (y_ref, s_ref) = run_ref(inputs, "layer_norm")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: run(a, "layer_norm", out_dtype=torch.float16, readers=readers),
                             fullgraph=True, backend="aot_eager")
    for fn in (lambda *a: run(a, "layer_norm", out_dtype=torch.float16, readers=readers), compiled):
        ys, s = fn(*inputs)
        ys = ys if readers > 1 else (ys,)
        assert len(ys) == readers and all(y.dtype == torch.float16 for y in ys)
        for y in ys:
            torch.testing.assert_close(y, y_ref.to(torch.float16), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(s, s_ref)
    # traced with one reader, the registered op writes y in fp16 itself: no cast after it forward
    # or before its backward (an opaque op: each would be one more pass); several cast after it
    forward, backward = traced_graphs(lambda *a: run(a, "layer_norm", out_dtype=torch.float16,
                                                     readers=readers),
                                      *(t.detach().clone().requires_grad_() for t in inputs))
    op = call_of(forward, "gated_grouped_norm")
    assert op.args[-1] == (torch.float16 if readers == 1 else torch.float32)
    assert (not [c for c in dtype_casts(forward) if c[0].startswith("getitem")]) == (readers == 1)
    bop = call_of(backward, "gated_grouped_norm_backward")
    assert (bop.args[0].op == "placeholder") == (readers == 1)


@pytest.mark.parametrize("bad, message", [
    ({"residual": (3, 4, 40)}, "residual must have the input's shape"),
    ({"gate": (3, 2, 40)}, "gate must broadcast against input"),
    ({"gate": (2, 1, 40)}, "gate must broadcast against input"),
    # the sum is computed in fp32 for fp32 x: an fp64 gate would lose digits
    ({"gate_dtype": torch.float64}, r"gate \(torch.float64\) must be no wider than torch.float32"),
    ({"mul": (3, 1, 39)}, "mul must broadcast"),
])
def test_bad_input_names_the_op_and_argument(bad, message):
    x = torch.randn(3, 5, 40, device=DEVICE)
    residual = torch.randn(bad.get("residual", (3, 5, 40)), device=DEVICE)
    gate = torch.randn(bad.get("gate", (3, 1, 40)), device=DEVICE, dtype=bad.get("gate_dtype", torch.float32))
    mul = torch.randn(bad.get("mul", (3, 1, 40)), device=DEVICE)
    with pytest.raises(ValueError, match=message) as err:
        trifuse.ops.gated_add_layer_norm_modulate(x, residual, gate, [40], mul)
    assert "trifuse.gated_add_layer_norm_modulate" in str(err.value)


def test_integer_residual_is_a_type_error():
    x = torch.randn(2, 3, 4, device=DEVICE)
    with pytest.raises(TypeError, match="trifuse.gated_add_layer_norm_modulate: residual"):
        residual = torch.ones(2, 3, 4, dtype=torch.int64, device=DEVICE)
        trifuse.ops.gated_add_layer_norm_modulate(x, residual, None, [4])
