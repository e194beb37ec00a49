"""Gated activation act(gate) * up (SiLU, erf GeLU, tanh GeLU) against the float64 oracle.

On CPU these run the real Triton kernels in the interpreter (tests/_device.py); on a GPU the
same tests run natively and add bf16.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close

from _device import DEVICE
from _dropout_masks import keep_of, seeded
import trifuse
from trifuse.kernels import gated_activation as ga_mod
from trifuse.kernels.gated_activation import gated_activation_ref

# widths: 1, odd, just past a power of two, past one column tile (1024) and a Llama-like 5504
# (not a power of two); one row; 0 rows; 3-D and 4-D.
SHAPES = [(1, 1), (3, 7), (1, 100), (2, 129), (5, 1000), (2, 5504), (0, 32), (2, 3, 50), (2, 2, 3, 17)]
ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "relu", "relu2"]


def _ids(shape):
    return "x".join(map(str, shape))


def make(shape, dtype, scale=2.0):
    gate = (torch.randn(shape, device=DEVICE, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    up = torch.randn(shape, device=DEVICE, dtype=torch.float64).to(dtype).requires_grad_()
    return gate, up


def upcast(*ts):
    return [t.detach().double().requires_grad_() for t in ts]


def lowp(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def check_fwd_bwd(gate, up, activation, dy=None):
    """y, dgate and dup against float64, bounded by PyTorch's own error in the inputs' dtype."""
    y = trifuse.ops.gated_activation(gate, up, activation)
    g64, u64 = upcast(gate, up)
    gl, ul = lowp(gate, up)
    y64, ylp = gated_activation_ref(g64, u64, activation), gated_activation_ref(gl, ul, activation)
    assert y.dtype == gate.dtype and y.shape == gate.shape and y.is_contiguous()
    assert_close(f"{activation} y", y, y64, ylp)
    if gate.numel() == 0:
        return
    dy = torch.randn_like(y) if dy is None else dy
    grads = torch.autograd.grad(y, (gate, up), dy)
    grads64 = torch.autograd.grad(y64, (g64, u64), dy.double())
    grads_lp = torch.autograd.grad(ylp, (gl, ul), dy)
    for name, a, a64, alp, t in zip(("dgate", "dup"), grads, grads64, grads_lp, (gate, up)):
        assert a.dtype == t.dtype and a.shape == t.shape
        assert_close(f"{activation} {name}", a, a64, alp)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, shape, activation):
    check_fwd_bwd(*make(shape, dtype), activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_halves_are_read_in_place(dtype, activation):
    """Phi-3's `gate, up = gate_up_proj(x).chunk(2, dim=-1)`: each half has row stride 2N and is
    read where it is (no copy); the gradient reaches the fused projection's output whole."""
    fused = torch.randn(2, 3, 2 * 300, device=DEVICE, dtype=dtype, requires_grad=True)
    gate, up = fused.chunk(2, dim=-1)
    for half in (gate, up):
        rows = ga_mod.rows_2d(half, 300)  # what the launchers hand the kernels
        assert rows.data_ptr() == half.data_ptr() and rows.stride() == (600, 1)
    check_fwd_bwd(gate, up, activation)
    (dfused,) = torch.autograd.grad(trifuse.ops.gated_activation(gate, up, activation), fused,
                                    torch.ones(2, 3, 300, device=DEVICE, dtype=dtype))
    assert dfused.shape == fused.shape


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_other_layouts_and_gradients(activation):
    """Sliced rows in place; transposed inputs are copied; a non-contiguous and an expanded
    incoming gradient work too."""
    big = torch.randn(6, 150, device=DEVICE)
    gate = big[:, 10:110].requires_grad_()  # (6, 100), row stride 150
    up = torch.randn(100, 6, device=DEVICE).t().requires_grad_()  # transposed: copied
    check_fwd_bwd(gate, up, activation, dy=torch.randn(100, 6, device=DEVICE).t())
    gate = torch.randn(40, 5, 3, device=DEVICE).permute(2, 1, 0).requires_grad_()  # (3, 5, 40)
    up = torch.randn(3, 5, 40, device=DEVICE, requires_grad=True)
    check_fwd_bwd(gate, up, activation, dy=torch.randn(40, device=DEVICE).expand(3, 5, 40))


@pytest.mark.parametrize("activation", [a for a in ACTIVATIONS if a != "relu2"])  # relu2 squares: below
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_values_saturate_without_nan(dtype, activation):
    """|gate| ~ 1e4: exp overflows and sigmoid saturates; act and act' must stay finite (no 0 * inf)."""
    gate = torch.tensor([[-1e4, -3000.0, -100.0, -20.0, 20.0, 100.0, 3000.0, 1e4]], device=DEVICE, dtype=dtype)
    gate.requires_grad_()
    up = torch.full_like(gate, 0.5).requires_grad_()
    y = trifuse.ops.gated_activation(gate, up, activation)
    dgate, dup = torch.autograd.grad(y, (gate, up), torch.ones_like(y))
    assert all(torch.isfinite(t).all() for t in (y, dgate, dup))
    check_fwd_bwd(gate, up, activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_nan_and_inf_propagate_like_pytorch(activation):
    gate = torch.randn(4, 33, device=DEVICE)
    gate[1, 3], gate[2, 5] = float("nan"), float("inf")
    up = torch.randn(4, 33, device=DEVICE)
    up[3, 7] = float("-inf")
    y = trifuse.ops.gated_activation(gate, up, activation)
    ref = gated_activation_ref(gate.double(), up.double(), activation)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isinf(y), torch.isinf(ref))
    assert_close("finite rows", y[[0]], ref[[0]], None)


@pytest.mark.parametrize("activation", ["relu", "relu2"])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
def test_relus_are_pytorchs_bitwise(dtype, activation):
    """relu(g) * up and relu(g)^2 * up as PyTorch computes them in the dtype, forward and backward:
    NaN where g is NaN, 0 (not inf * 0 = NaN) where g <= 0 under an infinite dy, inf where the
    product passes fp16's range (200^2 * 2), and dgate = dy * up (* 2g) rounded once as PyTorch's.
    (Where the square alone passes the range, PyTorch's rounded intermediate is inf and dup =
    dy * relu(g)^2 with it; the kernels keep it in fp32 and stay finite.)"""
    g = torch.tensor([[-3.0, -1.0, 0.0, 2.0, float("nan"), 5.0, 200.0, 0.5]], device=DEVICE, dtype=dtype)
    u = torch.tensor([[1.0, 2.0, 3.0, -1.0, 1.0, 0.25, 2.0, 3.0]], device=DEVICE, dtype=dtype)
    dy = torch.tensor([[float("inf"), 1.0, 7.0, 3.0, 4.0, float("-inf"), 1e-3, 0.1]], device=DEVICE, dtype=dtype)
    got = _forward_and_grads(lambda g, u: trifuse.ops.gated_activation(g, u, activation), g, u, dy)
    want = _forward_and_grads(lambda g, u: gated_activation_ref(g, u, activation), g, u, dy)
    for name, a, b in zip(("y", "dgate", "dup"), got, want):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), (name, a, b)


def _forward_and_grads(fn, g, u, dy):
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    y = fn(g, u)
    return (y.detach(), *torch.autograd.grad(y, (g, u), dy))


def test_gradcheck_float64():
    gate = torch.randn(4, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    up = torch.randn(4, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    for act in ACTIVATIONS:
        assert torch.autograd.gradcheck(lambda g, u, act=act: trifuse.ops.gated_activation(g, u, act), (gate, up))
        assert torch.autograd.gradcheck(lambda g, u, act=act: torch.ops.trifuse.gated_activation(g, u, act),
                                        (gate, up))


def test_backward_saves_only_gate_and_up():
    """Recompute, do not store: the graph holds the two inputs and nothing else (PyTorch eager
    also keeps act(gate))."""
    gate, up = make((4, 16), torch.float32)
    y = trifuse.ops.gated_activation(gate, up)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0] is gate and saved[1] is up


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_eager_path_and_registered_op_are_bitwise_equal(activation):
    gate, up = make((37, 70), torch.float32)
    eager = trifuse.ops.gated_activation(gate, up, activation)
    op = torch.ops.trifuse.gated_activation(gate, up, activation)
    assert torch.equal(eager, op)
    dy = torch.randn_like(eager)
    for a, a_ in zip(torch.autograd.grad(eager, (gate, up), dy), torch.autograd.grad(op, (gate, up), dy)):
        assert torch.equal(a, a_)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_compiles_fullgraph_without_graph_breaks(activation):
    gate, up = make((4, 48), torch.float32)
    fn = torch.compile(lambda g, u: trifuse.ops.gated_activation(g, u, activation), fullgraph=True,
                       backend="aot_eager")
    out, ref = fn(gate, up), trifuse.ops.gated_activation(gate, up, activation)
    assert torch.equal(out, ref)
    for a, a_ in zip(torch.autograd.grad(out, (gate, up), torch.ones_like(out)),
                     torch.autograd.grad(ref, (gate, up), torch.ones_like(ref))):
        assert torch.equal(a, a_)


def test_compiles_the_chunked_halves():
    fused = torch.randn(3, 64, device=DEVICE, requires_grad=True)

    def mlp(t):
        gate, up = t.chunk(2, dim=-1)
        return trifuse.ops.gated_activation(gate, up)

    out = torch.compile(mlp, fullgraph=True, backend="aot_eager")(fused)
    assert torch.equal(out, mlp(fused))


def test_opcheck_every_op():
    gate = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    up = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    for act in ACTIVATIONS:
        torch.library.opcheck(torch.ops.trifuse.gated_activation.default, (gate, up, act))
    halves = torch.randn(3, 32, device=DEVICE, requires_grad=True).chunk(2, dim=-1)
    torch.library.opcheck(torch.ops.trifuse.gated_activation.default, (*halves, "gelu"))
    dy = torch.randn(3, 16, device=DEVICE)
    for act in ACTIVATIONS:
        torch.library.opcheck(torch.ops.trifuse.gated_activation_backward.default,
                              (dy, gate.detach(), up.detach(), act))


@settings(max_examples=15, deadline=None)
@given(m=st.integers(0, 40), n=st.integers(1, 1100), activation=st.sampled_from(ACTIVATIONS))
def test_hypothesis_shapes(m, n, activation):
    torch.manual_seed(m * 10000 + n)
    check_fwd_bwd(*make((m, n), torch.float32), activation)


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_to_the_31_elements():
    """Row offsets in int64: the last rows of a tensor past 2^31 elements are right."""
    m, n = 2**31 // 4096 + 8, 4096
    gate = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    up = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    y = trifuse.ops.gated_activation(gate, up)
    tail = slice(m - 16, m)
    assert_close("tail", y[tail], gated_activation_ref(gate[tail].double(), up[tail].double()),
                 gated_activation_ref(gate[tail], up[tail]))
    del y
    dgate, dup = ga_mod.gated_activation_bwd(torch.ones_like(gate), gate, up, "silu")
    g64 = gate[tail].double().requires_grad_()
    y64 = gated_activation_ref(g64, up[tail].double())
    (dg64,) = torch.autograd.grad(y64, g64, torch.ones_like(y64))
    assert_close("dgate tail", dgate[tail], dg64, None)
    assert_close("dup tail", dup[tail], torch.nn.functional.silu(g64.detach()), None)


# ---------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations must fail the same tolerance.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("asked, computed", [("gelu", "gelu_tanh"), ("gelu_tanh", "gelu"), ("silu", "gelu"),
                                             ("relu", "silu"), ("relu2", "relu"), ("relu", "relu2")])
def test_negative_control_other_activation_fails(asked, computed):
    """The tanh form passed off as the erf form (or the reverse, GeLU as SiLU, SiLU as ReLU, one
    ReLU as the other) must not pass, forward or backward. The gelu forms differ by at most 4.7e-4: fp32 shows it."""
    gate, up = make((64, 256), torch.float32)
    wrong = trifuse.ops.gated_activation(gate, up, computed)
    g64, u64 = upcast(gate, up)
    ref = gated_activation_ref(g64, u64, asked)
    ok, msg = check_close(f"{computed} as {asked}", wrong, ref, gated_activation_ref(gate, up, asked))
    assert not ok, msg
    dy = torch.randn_like(wrong)
    (wrong_dgate,) = torch.autograd.grad(wrong, gate, dy)
    (dgate64,) = torch.autograd.grad(ref, g64, dy.double())
    ok, msg = check_close(f"dgate of {computed} as {asked}", wrong_dgate, dgate64, None)
    assert not ok, msg


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_dgate_without_the_activation_derivative_fails(dtype, activation):
    """dgate = dy * up (act' forgotten), or dy * up * act(gate) (the value for the derivative),
    must not pass."""
    gate, up = make((32, 64), dtype)
    dy = torch.randn(32, 64, device=DEVICE, dtype=dtype)
    g64, u64 = upcast(gate, up)
    (dgate64,) = torch.autograd.grad(gated_activation_ref(g64, u64, activation), g64, dy.double())
    gl, ul = lowp(gate, up)
    (dgate_lp,) = torch.autograd.grad(gated_activation_ref(gl, ul, activation), gl, dy)
    _, dup = ga_mod.gated_activation_bwd(dy, gate.detach(), up.detach(), activation)  # dy * act(gate)
    for name, wrong in (("dy * up", dy * up.detach()), ("dy * up * act(gate)", dup * up.detach())):
        ok, msg = check_close(f"dgate as {name}", wrong, dgate64, dgate_lp)
        assert not ok, msg


def test_negative_control_unsaturated_sigmoid_fails():
    """A SiLU whose sigmoid is computed as exp(g) / (1 + exp(g)) gives NaN past g ~ 89 in fp32
    (inf / inf): the check must catch it."""
    gate = torch.tensor([[1e4, 100.0, 1.0]], device=DEVICE)
    up = torch.ones_like(gate)
    e = torch.exp(gate)
    wrong = gate * (e / (1 + e)) * up
    ok, msg = check_close("naive silu", wrong, gated_activation_ref(gate.double(), up.double()), None)
    assert not ok, msg


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the op and the argument, in eager and under compile.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gate, up, activation, exc, match",
    [
        (torch.ones(3, 8), torch.ones(3, 5), "silu", ValueError,
         r"gated_activation: up must have shape \(3, 8\), got \(3, 5\)"),
        (torch.ones(3, 8), torch.ones(8), "silu", ValueError, r"up must have shape \(3, 8\), got \(8,\)"),
        (torch.ones(3, 8), torch.ones(3, 8, dtype=torch.float16), "silu", TypeError,
         "gated_activation: up has dtype torch.float16 but gate has torch.float32"),
        (torch.ones(3, 8, dtype=torch.int64), torch.ones(3, 8), "silu", TypeError,
         "gated_activation: gate must be float16, bfloat16, float32 or float64, got torch.int64"),
        (torch.ones(3, 8), torch.ones(3, 8, dtype=torch.int32), "silu", TypeError, "gated_activation: up must be float"),
        (torch.ones(3, 8), torch.ones(3, 8), "swish", ValueError,
         "gated_activation: activation must be 'silu', 'gelu', 'gelu_tanh', 'relu' or 'relu2', got 'swish'"),
        (torch.ones(3, 8), torch.ones(3, 8), "tanh", ValueError, "activation must be .* got 'tanh'"),
        ("not a tensor", torch.ones(3, 8), "silu", TypeError, "gated_activation: gate must be a torch.Tensor, got str"),
        (torch.ones(3, 8), [1.0] * 8, "silu", TypeError, "gated_activation: up must be a torch.Tensor, got list"),
    ],
    ids=["shape", "broadcast", "dtype-mismatch", "int-gate", "int-up", "activation", "activation-tanh",
         "not-tensor", "list-up"],
)
def test_bad_input_raises_clear_error(gate, up, activation, exc, match):
    gate = gate.to(DEVICE) if isinstance(gate, torch.Tensor) else gate
    up = up.to(DEVICE) if isinstance(up, torch.Tensor) else up
    with pytest.raises(exc, match=match):
        trifuse.ops.gated_activation(gate, up, activation)
    if isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor):
        with pytest.raises(exc, match=match):
            torch.ops.trifuse.gated_activation(gate, up, activation)


def test_bad_input_raises_under_compile():
    fn = torch.compile(lambda g, u: trifuse.ops.gated_activation(g, u), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"gated_activation: up must have shape \(3, 8\)"):
        fn(torch.ones(3, 8, device=DEVICE), torch.ones(3, 1, device=DEVICE))


def test_fake_impl_checks_too():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(TypeError, match="up has dtype torch.float16 but gate has torch.float32"):
        torch.ops.trifuse.gated_activation(torch.empty(3, 8), torch.empty(3, 8, dtype=torch.float16), "silu")


def test_mismatched_devices_raise():
    with pytest.raises(ValueError, match="up is on meta"):
        trifuse.ops.gated_activation(torch.ones(3, 8, device=DEVICE), torch.ones(3, 8, device="meta"))


def test_reference_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: same maths, same API."""
    monkeypatch.setattr(ga_mod, "use_triton", lambda t: False)
    for activation in ACTIVATIONS:
        check_fwd_bwd(*make((4, 37), torch.float32), activation)
        check_fwd_bwd(*make((4, 37), torch.float16), activation)


# ---------------------------------------------------------------------------------------------
# Dropout on the product (T5 v1.1's, mT5's): y = dropout(act(gate) * up, p), the mask drawn from a
# seed (Philox, as dropout_add's) and regenerated in the backward, never stored.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(3, 7), (1, 100), (2, 129), (5, 1000), (2, 3, 50)], ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_matches_float64_oracle_through_its_mask(dtype, shape, activation):
    """The launchers with a seed against float64 through the mask the seed draws: y, dgate, dup."""
    p = 0.3
    gate, up = make(shape, dtype)
    seed = torch.tensor([1234], device=DEVICE)
    y = ga_mod.gated_activation_fwd(gate.detach(), up.detach(), activation, p, seed)
    keep = keep_of(seed, shape, p)
    assert 0.5 < keep.mean() < 0.9
    g64, u64 = upcast(gate, up)
    gl, ul = lowp(gate, up)
    y64 = gated_activation_ref(g64, u64, activation) * keep / (1 - p)
    ylp = gated_activation_ref(gl, ul, activation) * keep.to(dtype) / (1 - p)
    assert_close(f"{activation} dropout y", y, y64, ylp)
    dy = torch.randn_like(y)
    grads = ga_mod.gated_activation_bwd(dy, gate.detach(), up.detach(), activation, p, seed)
    grads64 = torch.autograd.grad(y64, (g64, u64), dy.double())
    grads_lp = torch.autograd.grad(ylp, (gl, ul), dy)
    for name, a, a64, alp in zip(("dgate", "dup"), grads, grads64, grads_lp):
        assert_close(f"{activation} dropout {name}", a, a64, alp)


@pytest.mark.parametrize("make_inputs", [
    lambda: make((4, 37), torch.float32),
    lambda: torch.randn(6, 74, device=DEVICE, requires_grad=True).chunk(2, dim=-1),
    lambda: [t.transpose(0, 1) for t in make((37, 4), torch.float32)],
], ids=["rows", "chunked-halves", "transposed"])
def test_dropout_forward_and_backward_share_one_mask(make_inputs):
    """Through the public op: every kept output is act(gate) * up / (1 - p), every dropped one 0,
    and the gradients flow through exactly the kept elements (the backward regenerates the mask)."""
    p = 0.4
    gate, up = make_inputs()
    y = trifuse.ops.gated_activation(gate, up, "silu", p=p)
    full = gated_activation_ref(gate.detach().double(), up.detach().double(), "silu") / (1 - p)
    kept = y.detach() != 0
    assert 0.4 < kept.double().mean() < 0.8
    torch.testing.assert_close(y.detach().double()[kept], full[kept], rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    dgate, dup = torch.autograd.grad(y, (gate, up), dy)
    g64, u64 = upcast(gate, up)
    ref = gated_activation_ref(g64, u64, "silu") * kept / (1 - p)
    rg, ru = torch.autograd.grad(ref, (g64, u64), dy.double())
    torch.testing.assert_close(dgate.double(), rg, rtol=1e-5, atol=1e-5)  # fp32 against float64
    torch.testing.assert_close(dup.double(), ru, rtol=1e-5, atol=1e-5)


def test_dropout_mask_is_dropout_adds_for_the_same_seed():
    """One Philox stream for every kernel that drops: the same seed drops the same elements."""
    gate, up = make((9, 130), torch.float32)
    seed = torch.tensor([77], device=DEVICE)
    y = ga_mod.gated_activation_fwd(gate.detach(), up.detach(), "gelu", 0.5, seed)
    assert torch.equal((y != 0).double(), keep_of(seed, y.shape, 0.5))


def test_dropout_statistics_seeds_and_edge_probabilities():
    gate, up = make((64, 257), torch.float32)
    gate, up = gate.detach(), up.detach()
    torch.manual_seed(1)
    a = trifuse.ops.gated_activation(gate, up, "gelu_tanh", p=0.25)
    torch.manual_seed(1)
    b = trifuse.ops.gated_activation(gate, up, "gelu_tanh", p=0.25)
    c = trifuse.ops.gated_activation(gate, up, "gelu_tanh", p=0.25)
    assert torch.equal(a, b) and not torch.equal(a, c)  # torch.manual_seed controls the mask
    assert abs((a != 0).double().mean().item() - 0.75) < 0.02
    plain = trifuse.ops.gated_activation(gate, up, "gelu_tanh")
    assert torch.equal(trifuse.ops.gated_activation(gate, up, "gelu_tanh", p=0.0), plain)
    assert torch.equal(trifuse.ops.gated_activation(gate, up, "gelu_tanh", p=0.5, training=False), plain)
    huge = torch.full((4, 16), 1e30, device=DEVICE)  # act * up overflows to inf: p = 1 still gives 0
    assert torch.equal(trifuse.ops.gated_activation(huge, huge, "silu", p=1.0), torch.zeros(4, 16, device=DEVICE))


def test_dropout_saves_gate_up_and_a_seed_not_a_mask():
    gate, up = make((4, 16), torch.float32)
    y = trifuse.ops.gated_activation(gate, up, p=0.2)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 3 and saved[0] is gate and saved[1] is up and saved[2].shape == (1,)


def test_dropout_gradcheck_and_gradgradcheck_float64():
    gate = torch.randn(4, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    up = torch.randn(4, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    for act in ACTIVATIONS:
        eager = seeded(lambda g, u, act=act: trifuse.ops.gated_activation(g, u, act, p=0.3))
        op = seeded(lambda g, u, act=act: torch.ops.trifuse.gated_activation_dropout(g, u, act, 0.3)[0])
        for fn in (eager, op):  # the op: the same kernels, checked by a random projection
            assert torch.autograd.gradcheck(fn, (gate, up), fast_mode=fn is op)
            assert torch.autograd.gradgradcheck(fn, (gate, up), fast_mode=True)


def test_dropout_eager_path_and_registered_op_are_bitwise_equal():
    gate, up = make((37, 70), torch.float32)
    torch.manual_seed(3)
    eager = trifuse.ops.gated_activation(gate, up, "gelu", p=0.3)
    torch.manual_seed(3)
    op = torch.ops.trifuse.gated_activation_dropout(gate, up, "gelu", 0.3)[0]
    assert torch.equal(eager, op)
    dy = torch.randn_like(eager)
    for a, a_ in zip(torch.autograd.grad(eager, (gate, up), dy), torch.autograd.grad(op, (gate, up), dy)):
        assert torch.equal(a, a_)


def test_dropout_compiles_fullgraph_and_opchecks():
    gate, up = make((4, 48), torch.float32)
    fn = torch.compile(lambda g, u: trifuse.ops.gated_activation(g, u, "silu", p=0.3), fullgraph=True,
                       backend="aot_eager")
    torch.manual_seed(5)
    out = fn(gate, up)
    torch.manual_seed(5)
    ref = trifuse.ops.gated_activation(gate, up, "silu", p=0.3)
    assert torch.equal(out, ref)
    torch.library.opcheck(torch.ops.trifuse.gated_activation_dropout.default, (gate, up, "gelu_tanh", 0.3),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    seed = torch.tensor([9], device=DEVICE)
    torch.library.opcheck(torch.ops.trifuse.gated_activation_dropout_backward.default,
                          (torch.randn(4, 48, device=DEVICE), gate.detach(), up.detach(), "silu", 0.3, seed))


@pytest.mark.parametrize("p, training", [(1.5, True), (-0.1, True), (2.0, False), ("0.1", True)])
def test_dropout_bad_probability_raises_clear_error(p, training):
    gate, up = make((3, 8), torch.float32)
    with pytest.raises(ValueError, match=r"trifuse.gated_activation: p must be a probability in \[0, 1\]"):
        trifuse.ops.gated_activation(gate, up, "silu", p=p, training=training)


def test_dropout_negative_control_a_mask_other_than_the_forwards_fails():
    """The oracle check catches a backward through another seed's mask."""
    gate, up = make((8, 64), torch.float32)
    seed, other = torch.tensor([1], device=DEVICE), torch.tensor([2], device=DEVICE)
    dy = torch.randn(8, 64, device=DEVICE)
    wrong = ga_mod.gated_activation_bwd(dy, gate.detach(), up.detach(), "silu", 0.3, other)[1]
    g64, u64 = upcast(gate, up)
    y64 = gated_activation_ref(g64, u64, "silu") * keep_of(seed, (8, 64), 0.3) / 0.7
    right = torch.autograd.grad(y64, u64, dy.double())[0]
    assert not check_close("dup", wrong, right, right.float())[0]


def test_dropout_reference_path_without_interpreter(monkeypatch):
    """CPU tensors without TRITON_INTERPRET: PyTorch's path, its own mask, the same API."""
    monkeypatch.setattr(ga_mod, "use_triton", lambda t: False)
    gate, up = make((6, 33), torch.float32)
    y = trifuse.ops.gated_activation(gate, up, "gelu", p=0.5)
    kept = y.detach() != 0
    assert 0.25 < kept.double().mean() < 0.75
    full = gated_activation_ref(gate.detach().double(), up.detach().double(), "gelu") * 2
    torch.testing.assert_close(y.detach().double()[kept], full[kept], rtol=1e-5, atol=1e-5)
    _, dup = torch.autograd.grad(y, (gate, up), torch.ones_like(y))
    assert torch.equal(dup != 0, kept & (gate.detach() != 0))
