"""RMSNorm with a clamped eps (`rms_norm(..., clamp_eps=True)`: y = x / max(rms(x), eps) * w),
the op the rewriter makes of `F.normalize` and of `x / x.norm(dim=-1).clamp_min(eps)`, against
float64 `F.normalize` (the 2-norm is sqrt(width) times the rms).

A floored row (its rms under eps) is x / eps * w, with no gradient through its norm: its dx is
dy * w / eps, no projection term. The forward stores that row's rstd negated to tell the
backward; the tests below cover floored rows in both kernel paths, zero rows, and rows at the
floor, where an added eps would be wrong (the negative control).
"""
import pytest
import torch
import torch.nn.functional as F
import trifuse
from _device import DEVICE
from tolerances import DTYPES, assert_close, check_close
from trifuse.kernels import layer_norm as ln_mod
from trifuse.kernels.layer_norm import rms_norm_ref

SHAPES = [(1, 1), (3, 7), (4, 100), (2, 129), (6, 1000), (0, 32), (2, 3, 50)]


def _ids(shape):
    return "x".join(map(str, shape))


def make(shape, dtype, floored_scale):
    """x with a zero row and a row scaled by floored_scale (floored by the eps the test uses), and
    an fp32 weight, as the rewriter's constant 1 / sqrt(width) times a model's weight is."""
    n = shape[-1]
    x = torch.randn(shape, device=DEVICE, dtype=torch.float64)
    rows = x.view(-1, n)
    if rows.shape[0] > 1:
        rows[0] = 0.0
        rows[1] *= floored_scale
    return x.to(dtype).requires_grad_(), torch.randn(n, device=DEVICE, requires_grad=True)


def clamped(x, w, eps):
    """F.normalize(x, dim=-1, eps=eps) * w through trifuse's op."""
    n = x.shape[-1]
    return trifuse.ops.rms_norm(x, (n,), w * n ** -0.5, eps / n ** 0.5, clamp_eps=True)


def normalize(x, w, eps):
    return F.normalize(x, dim=-1, eps=eps) * w


def check_against_normalize(x, w, eps, run=clamped):
    y = run(x, w, eps)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    xl, wl = (t.detach().clone().requires_grad_() for t in (x, w))
    # PyTorch's own in fp32, rounded (as the kernel computes): F.normalize in fp16 rounds an eps
    # of 1e-12 to 0, and gives NaN for a zero row (the rewriter passes that rounded eps on)
    ref, ref_lp = normalize(x64, w64, eps), normalize(xl.float(), wl, eps).to(x.dtype)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close("y", y, ref, ref_lp)
    if x.numel() == 0:
        return
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), dy)
    want = torch.autograd.grad(ref, (x64, w64), dy.double())
    lowp = torch.autograd.grad(ref_lp, (xl, wl), dy)
    for name, a, a64, alp in zip(("dx", "dweight"), got, want, lowp):
        assert_close(name, a, a64, alp)


@pytest.mark.parametrize("eps", [1e-12, 1e-3])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_f_normalize(dtype, shape, eps):
    # (1e-4: under 1e-3 for every width here, and an fp16 number.) A floored row's dx is dy w / eps:
    # 1e12 overflows fp16 (as PyTorch's would), so fp16 floors rows at eps 1e-3 only.
    floors = 1 / eps < torch.finfo(dtype).max / 1e3
    x, w = make(shape, dtype, 1e-4)
    if not floors:
        x = (x.detach() + (x.detach() == 0)).requires_grad_()  # no zero row
    check_against_normalize(x, w, eps)


def test_wide_rows_use_the_chunked_path():
    shape = (3, 20000)
    assert shape[-1] > ln_mod.MAX_SINGLE_BLOCK_BWD
    check_against_normalize(*make(shape, torch.float32, 1e-5), 1e-3)


def test_reference_path_without_interpreter_matches(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: the same floor, the same signs."""
    monkeypatch.setattr(ln_mod, "use_triton", lambda t: False)
    check_against_normalize(*make((5, 37), torch.float32, 1e-5), 1e-3)


def test_floored_rows_store_their_rstd_negated():
    x, _ = make((3, 40), torch.float32, 1e-5)
    _, _, _, rstd = ln_mod.layer_norm_fwd(x.detach(), 40, None, None, 1e-3, is_rms_norm=True, clamp_eps=True)
    torch.testing.assert_close(rstd[:2], torch.full((2,), -1e3, device=DEVICE))  # (1 / fp32(1e-3))
    assert rstd[2] > 0


def test_negative_control_an_added_eps_fails():
    """Rows whose rms is near eps: 1 / sqrt(ms + eps^2) is up to sqrt(2) off 1 / max(rms, eps)."""
    n, eps = 64, 1e-3
    x = (torch.randn(8, n, device=DEVICE, dtype=torch.float64) * eps * torch.linspace(0.5, 2, 8)[:, None])
    x = x.float().requires_grad_()
    w = torch.randn(n, device=DEVICE)
    wrong = trifuse.ops.rms_norm(x, (n,), w * n ** -0.5, (eps / n ** 0.5) ** 2)
    ok, msg = check_close("added eps", wrong, normalize(x.double(), w.double(), eps), normalize(x, w, eps))
    assert not ok, msg


def test_negative_control_a_projection_term_in_floored_rows_fails():
    """The unclamped backward on a floored row (its rstd stored positive) must not pass."""
    n, eps = 30, 1e-3
    x = torch.randn(4, n, device=DEVICE) * 1e-5
    w = torch.randn(n, device=DEVICE)
    dy = torch.randn(4, n, device=DEVICE)
    _, _, mean, rstd = ln_mod.layer_norm_fwd(x, n, w, None, eps / n ** 0.5, is_rms_norm=True, clamp_eps=True)
    wrong, *_ = ln_mod.layer_norm_bwd(dy, x, n, w, mean, rstd.abs(), is_rms_norm=True)
    x64 = x.double().requires_grad_()
    want, = torch.autograd.grad(normalize(x64, w.double() * n ** 0.5, eps), x64, dy.double())
    right, *_ = ln_mod.layer_norm_bwd(dy, x, n, w, mean, rstd, is_rms_norm=True)
    assert_close("dx", right, want, None)
    ok, msg = check_close("dx with a projection term", wrong, want, None)
    assert not ok, msg


def test_registered_op_and_compiled_calls_are_bitwise_the_eager_ones():
    x, w = make((5, 70), torch.float32, 1e-5)
    eps = 1e-3 / 70 ** 0.5
    eager = trifuse.ops.rms_norm(x, 70, w, eps, clamp_eps=True)
    op = torch.ops.trifuse.rms_norm(x, [70], w, eps, None, False, True)[0]
    compiled = torch.compile(lambda x, w: trifuse.ops.rms_norm(x, 70, w, eps, clamp_eps=True),
                             fullgraph=True, backend="aot_eager")(x, w)
    dy = torch.randn_like(eager)
    grads = [torch.autograd.grad(y, (x, w), dy) for y in (eager, op, compiled)]
    for y, g in zip((op, compiled), grads[1:]):
        assert torch.equal(y, eager)
        assert all(torch.equal(a, b) for a, b in zip(g, grads[0]))


def test_narrowed_y_is_the_cast_of_y():
    x, w = make((4, 48), torch.float32, 1e-5)
    y = trifuse.ops.rms_norm(x, 48, w, 1e-4, clamp_eps=True)
    narrowed = trifuse.ops.rms_norm(x, 48, w, 1e-4, out_dtype=torch.float16, clamp_eps=True)
    traced = torch.compile(
        lambda x, w: trifuse.ops.rms_norm(x, 48, w, 1e-4, out_dtype=torch.float16, clamp_eps=True),
        fullgraph=True, backend="aot_eager")
    assert narrowed.dtype == torch.float16 and torch.equal(narrowed, y.half())
    assert torch.equal(traced(x, w), narrowed)


def test_gradcheck_and_gradgradcheck_float64():
    x = torch.randn(4, 7, device=DEVICE, dtype=torch.float64)
    x[1] *= 1e-9  # floored
    x.requires_grad_()
    w = torch.randn(7, device=DEVICE, dtype=torch.float64, requires_grad=True)

    def fn(x, w):
        return trifuse.ops.rms_norm(x, 7, w, 1e-6, clamp_eps=True)

    assert torch.autograd.gradcheck(fn, (x, w))
    assert torch.autograd.gradgradcheck(fn, (x, w))
    assert torch.autograd.gradcheck(lambda x, w: rms_norm_ref(x, (7,), w, 1e-6, clamp_eps=True), (x, w))


def test_opcheck():
    x = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.trifuse.rms_norm.default, (x, [16], w, 1e-3, None, False, True))


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"residual": "x"}, ValueError, "clamp_eps takes no residual"),
    ({"clamp_eps": 1}, TypeError, "clamp_eps must be a bool"),
])
def test_bad_input_raises_clear_error(kwargs, exc, match):
    x = torch.randn(2, 8, device=DEVICE)
    kwargs = {"clamp_eps": True, **{k: x if v == "x" else v for k, v in kwargs.items()}}
    with pytest.raises(exc, match=match):
        trifuse.ops.rms_norm(x, 8, None, 1e-3, **kwargs)


def test_layer_norm_has_no_clamped_eps():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="clamp_eps is RMSNorm's alone"):
        ln_mod.layer_norm_fwd(x, 8, None, None, 1e-3, clamp_eps=True)
