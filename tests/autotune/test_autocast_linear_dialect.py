"""The autocast_linear dialect (kernels/linear.py): autocast's own F.linear or the linear whose
fp32 weight gets its gradient from the GEMM, chosen with a fake timer here (on the GPU: measured).
Whichever runs, the result is bitwise that candidate's; the check rejects a wrong one."""
import pytest
import torch
import torch.nn.functional as F
from _device import DEVICE

from trifuse.autotune import dialects
from trifuse.kernels import linear as lin
from trifuse.kernels.linear import AUTOCAST_LINEAR, autocast_linear


@pytest.fixture
def fresh_dialect(cache_dir, monkeypatch):
    AUTOCAST_LINEAR.clear()
    monkeypatch.setattr(AUTOCAST_LINEAR, "timer", None)
    yield AUTOCAST_LINEAR
    AUTOCAST_LINEAR.clear()


def _inputs(shape, n_out, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(shape, generator=gen, device=DEVICE).requires_grad_()
    w = (torch.randn(n_out, shape[-1], generator=gen, device=DEVICE) / shape[-1] ** 0.5).requires_grad_()
    b = torch.randn(n_out, generator=gen, device=DEVICE).requires_grad_()
    dy = torch.randn((*shape[:-1], n_out), generator=gen, device=DEVICE)
    return x, w, b, dy


def _fwd_bwd(fn, x, w, b, dy, dtype):
    with torch.autocast(DEVICE, dtype=dtype):
        y = fn()
    return (y, *torch.autograd.grad(y, (x, w, b), dy.to(y.dtype)))


@pytest.mark.parametrize("winner", ["fp32-grads", "autocast"])
def test_the_dialect_runs_its_choice_bitwise(fresh_dialect, timer, monkeypatch, winner):
    monkeypatch.setattr(fresh_dialect, "timer", timer({winner: 1.0}, default=2.0))
    x, w, b, dy = _inputs((9, 24), 40)
    got = _fwd_bwd(lambda: autocast_linear(x, w, b, torch.float16), x, w, b, dy, torch.float16)
    rec = dialects.explain("autocast_linear", x, w, b, torch.float16, False)
    assert rec.chosen == winner and rec.source == "measured" and not rec.rejected
    assert rec.bucket == "dtype=float16,rows=16,in=24,out=40,x=float32,bias=float32,grad=True,layout=out-in"
    fn = fresh_dialect.candidate(winner).fn
    want = _fwd_bwd(lambda: fn(x, w, b, torch.float16, False), x, w, b, dy, torch.float16)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and torch.equal(a, e)
    if winner == "autocast":  # autocast's own: its dW rounded to fp16 and converted
        plain = _fwd_bwd(lambda: F.linear(x, w, b), x, w, b, dy, torch.float16)
        assert all(torch.equal(a, e) for a, e in zip(got, plain))


def test_the_check_rejects_a_wrong_linear(cache_dir, timer):
    d = dialects.Dialect("autocast_linear_check", lin._linear_key, AUTOCAST_LINEAR.key_names, lin._linear_ref)
    for c in AUTOCAST_LINEAR.candidates:
        d.register(c)
    d.register(dialects.Candidate("transposed-bias", lambda x, w, b, dt, t: F.linear(x, w, b.flip(0))))
    d.timer = timer({})
    x, w, b, _ = _inputs((9, 24), 40)
    with torch.autocast(DEVICE, dtype=torch.float16):
        d(x, w, b, torch.float16, False)
        rec = d.explain(x, w, b, torch.float16, False)
    assert set(rec.times_ms) == {"fp32-grads", "autocast"}
    assert rec.rejected["transposed-bias"].startswith("wrong result: output 0")
