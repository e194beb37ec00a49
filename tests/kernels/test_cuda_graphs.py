"""The eager paths under CUDA-graph capture, forward and backward: what torch.compile's
mode="reduce-overhead" does with them, and what the benchmarks' "graph ms" replays. A replay on new
input values gives what an eager call on those values gives, bitwise (same kernels, same plans),
and dropout draws a fresh mask on every replay that its backward then regenerates.
"""
import pytest
import torch

import trifuse
from trifuse.kernels import bias_gelu as bg
from trifuse.kernels import layer_norm as ln

pytestmark = pytest.mark.gpu

ROWS, N = 300, 1000  # neither a power of two


def _leaves(*shapes, dtype=torch.bfloat16):
    return [torch.randn(*s, device="cuda", dtype=dtype, requires_grad=True) for s in shapes]


def _fwd_bwd(fn, inputs, dys):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, inputs, dys)
    return (*outs, *grads)


def _captured(fn, inputs, dys):
    """(graph, its output tensors) of one fwd+bwd of fn, warmed up on a side stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _fwd_bwd(fn, inputs, dys)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _fwd_bwd(fn, inputs, dys)
    return graph, outs


def _refill(*tensors):
    with torch.no_grad():
        for t in tensors:
            t.copy_(torch.randn_like(t))


CASES = {
    "layer_norm kernels": (lambda x, w, b: ln._layer_norm_trifuse(x, (N,), w, b, 1e-5), [(ROWS, N), (N,), (N,)]),
    "layer_norm dialect": (lambda x, w, b: trifuse.ops.layer_norm(x, (N,), w, b), [(ROWS, N), (N,), (N,)]),
    "rms_norm": (lambda x, w: trifuse.ops.rms_norm(x, (N,), w), [(ROWS, N), (N,)]),
    "residual stream, p=0": (lambda x, r, w, b: trifuse.ops.layer_norm(x, (N,), w, b, residual=r),
                             [(ROWS, N), (ROWS, N), (N,), (N,)]),
    "bias_gelu kernels": (lambda x, b: bg._bias_gelu_trifuse(x, b, "none"), [(ROWS, N), (N,)]),
    "dropout_add, p=0": (lambda x, r, b: trifuse.ops.dropout_add(x, r, 0.0, bias=b), [(ROWS, N), (ROWS, N), (N,)]),
}


@pytest.mark.parametrize("case", CASES)
def test_replay_equals_an_eager_call(case):
    fn, shapes = CASES[case]
    inputs = _leaves(*shapes)
    with torch.no_grad():
        outs = fn(*inputs)
        dys = tuple(torch.randn_like(o) for o in (outs if isinstance(outs, tuple) else (outs,)))
    graph, outs = _captured(fn, inputs, dys)
    _refill(*inputs, *dys)
    graph.replay()
    torch.cuda.synchronize()
    want = _fwd_bwd(fn, inputs, dys)
    for got, expected in zip(outs, want):
        assert torch.equal(got, expected), case


def test_dropout_replays_draw_fresh_masks_their_backward_regenerates():
    """fp32, so that kept elements are exactly (x + b) / (1 - p) above r and dx is exactly dy / (1 - p)."""
    p = 0.25
    x, r, b = _leaves((ROWS, N), (ROWS, N), (N,), dtype=torch.float32)
    with torch.no_grad():
        x.copy_(x.abs() + 1.0)  # x + b well away from 0: a kept element never looks dropped
        b.copy_(b.abs())
    dy = (torch.randn(ROWS, N, device="cuda"),)
    graph, (y, dx, dr, db) = _captured(lambda x, r, b: trifuse.ops.dropout_add(x, r, p, bias=b), (x, r, b), dy)
    masks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        kept = y != r
        masks.append(kept.clone())
        fraction, sigma = kept.double().mean().item(), (p * (1 - p) / kept.numel()) ** 0.5
        assert abs(fraction - (1 - p)) < 6 * sigma
        torch.testing.assert_close(dx, torch.where(kept, dy[0] / (1 - p), 0.0), rtol=1e-6, atol=0)
        assert torch.equal(dr, dy[0])
        torch.testing.assert_close(db, dx.sum(0), rtol=1e-5, atol=1e-5)
    assert not torch.equal(masks[0], masks[1]), "two replays drew the same mask"
