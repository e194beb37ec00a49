"""Second derivatives through every op (create_graph=True: gradient penalties, Hessian-vector
products, MAML): gradgradcheck in float64 on small awkward shapes, and the first-order
gradients taken with create_graph equal to the kernels' own, dropout included (its mask
regenerated from the forward's seed, never redrawn)."""
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import trifuse
from _device import DEVICE
from _fusing import PassThroughMode

ops = trifuse.ops


def _t(*shape):
    return torch.randn(*shape, dtype=torch.float64, device=DEVICE, requires_grad=True)


def _seeded(f):
    """f with the generator reset before each call: a dropout op draws the same mask every time,
    as gradgradcheck's repeated calls need."""
    def call(*args):
        torch.manual_seed(7)
        return f(*args)
    return call


def _on(path, f):
    """f as the eager path or the registered ops run it (only the forward under the mode: the
    backward runs outside it, as after a compiled forward)."""
    if path == "eager":
        return f

    def registered(*args):
        with PassThroughMode():
            return f(*args)
    return registered


PATHS = ["eager", "registered"]


def _cases():
    torch.manual_seed(0)
    x, r, w, b, xb = _t(4, 6), _t(4, 6), _t(6), _t(6), _t(6)
    q, k, v = _t(1, 2, 5, 4), _t(1, 2, 6, 4), _t(1, 2, 6, 3)
    k1, v1 = _t(1, 1, 6, 4), _t(1, 1, 6, 4)
    fmask, sinks = _t(1, 1, 5, 6), _t(2)
    keep = torch.rand(1, 1, 5, 6, device=DEVICE) > 0.3
    keep[..., 0] = True
    cos, sin = _t(1, 1, 5, 4), _t(1, 1, 5, 4)
    h, hw, hb = _t(5, 4), _t(7, 4), _t(7)
    logits, target = _t(5, 7), torch.tensor([0, 3, -100, 6, 2], device=DEVICE)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=DEVICE)
    pq, pk, pv = _t(8, 2, 4), _t(8, 1, 4), _t(8, 1, 3)
    beta, eps = torch.tensor(0.5, dtype=torch.float64, device=DEVICE), torch.tensor(-1e-6, dtype=torch.float64,
                                                                                   device=DEVICE)
    return {
        "bias_gelu-erf": (lambda x, b: ops.bias_gelu(x, b), (x, b)),
        "bias_gelu-tanh": (lambda x, b: ops.bias_gelu(x, b, "tanh"), (x, b)),
        "bias_gelu-quick": (lambda x: ops.bias_gelu(x, None, "quick"), (x,)),
        "bias_gelu-relu": (lambda x, b: ops.bias_gelu(x, b, "relu"), (x, b)),
        "bias_gelu-relu2": (lambda x: ops.bias_gelu(x, None, "relu2"), (x,)),
        "gated_activation-silu": (lambda g, u: ops.gated_activation(g, u, "silu"), (x, r)),
        "gated_activation-gelu_tanh": (lambda g, u: ops.gated_activation(g, u, "gelu_tanh"), (x, r)),
        "gated_activation-relu": (lambda g, u: ops.gated_activation(g, u, "relu"), (x, r)),
        "xielu": (lambda x, ap, an: ops.xielu(x, ap.abs(), an.abs(), beta, eps), (x, b[:1], xb[:1])),
        "group_norm-silu": (lambda x, w, b: ops.group_norm(x.view(2, 6, 2), 3, w, b, 1e-5, "silu"),
                            (x, w, b)),
        "group_norm-bare": (lambda x: ops.group_norm(x.view(1, 6, 4), 2), (x,)),
        "channel_norm": (lambda x, w, b: ops.channel_norm(x.view(4, 6, 1), w, b), (x, w, b)),
        "channel_norm-rms": (lambda x, w: ops.channel_norm(x.view(2, 6, 2), w, dim=1, rms=True), (x, w)),
        "layer_norm": (lambda x, w, b: ops.layer_norm(x, 6, w, b), (x, w, b)),
        "layer_norm-2d-shape": (lambda x, w, b: ops.layer_norm(x.view(4, 2, 3), (2, 3), w.view(2, 3), b.view(2, 3)),
                                (x, w, b)),
        "rms_norm": (lambda x, w: ops.rms_norm(x, 6, w, 1e-5), (x, w)),
        "layer_norm-residual": (lambda x, r, w, b: ops.layer_norm(x, 6, w, b, residual=r), (x, r, w, b)),
        "layer_norm_add": (lambda x, r, w, b: ops.layer_norm_add(x, r, 6, w, b), (x, r, w, b)),
        "residual_stream": (_seeded(lambda x, r, w, b, xb: ops.dropout_add_layer_norm(
            x, r, 6, w, b, 1e-5, 0.3, True, xb)), (x, r, w, b, xb)),
        "residual_stream-rms-2d": (_seeded(lambda x, r, w, xb: ops.dropout_add_layer_norm(
            x.view(4, 2, 3), r.view(4, 2, 3), (2, 3), w.view(2, 3), None, 1e-5, 0.3, True, xb.view(2, 3),
            is_rms_norm=True)), (x, r, w, xb)),
        "dropout_add": (_seeded(lambda x, r, b: ops.dropout_add(x, r, 0.4, True, b)), (x, r, b)),
        "rotary": (lambda q, c, s: ops.rotary_embedding(q, None, c, s)[0], (q, cos, sin)),
        "rotary-interleaved-half-table": (
            lambda q, k, c, s: ops.rotary_embedding(q, k, c[..., :2], s[..., :2], interleaved=True),
            (q[..., :4], k[:, :, :5], cos, sin)),
        "cross_entropy-mean-smoothed": (lambda x: ops.cross_entropy(x, target, label_smoothing=0.1), (logits,)),
        "cross_entropy-none": (lambda x: ops.cross_entropy(x, target, reduction="none"), (logits,)),
        "linear_cross_entropy-mean": (lambda h, w, b: ops.linear_cross_entropy(h, w, target, b), (h, hw, hb)),
        "linear_cross_entropy-none": (lambda h, w: ops.linear_cross_entropy(h, w, target, reduction="none"),
                                      (h, hw)),
        "attention": (lambda q, k, v: ops.attention(q, k, v), (q, k, v)),
        "attention-causal-gqa": (lambda q, k, v: ops.attention(q, k, v, is_causal=True, enable_gqa=True),
                                 (q, k1, v1)),
        "attention-float-mask-grad": (lambda q, k, v, m: ops.attention(q, k, v, attn_mask=m), (q, k, v, fmask)),
        "attention-bool-mask-softcap": (lambda q, k, v: ops.attention(q, k, v, attn_mask=keep, softcap=2.0),
                                        (q, k, v)),
        "attention-sinks": (lambda q, k, v, s: ops.attention(q, k, v, sinks=s), (q, k, v, sinks)),
        "attention-dropout": (_seeded(lambda q, k, v: ops.attention(q, k, v, dropout_p=0.3)), (q, k, v)),
        "attention_varlen-causal-window-sinks": (
            lambda q, k, v, s: ops.attention_varlen(q, k, v, cu, cu, 5, 5, causal=True, sinks=s, sliding_window=2),
            (pq, pk, pv, sinks)),
        "attention_varlen-dropout": (_seeded(lambda q, k, v: ops.attention_varlen(q, k, v, cu, cu, 5, 5,
                                                                                  dropout_p=0.3)), (pq, pk, pv)),
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(_cases()))
def test_second_derivatives_by_gradgradcheck(name, path):
    f, args = _cases()[name]
    f = _on(path, f)
    assert gradcheck(f, args, fast_mode=True)
    assert gradgradcheck(f, args, fast_mode=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(_cases()))
def test_gradients_with_create_graph_are_the_kernels_own(name, path):
    """gradgradcheck differentiates the create_graph path against itself: a wrong formula there
    (a dropout mask drawn anew) would pass it. The first-order gradients of both paths agree to
    rounding (the kernels take label smoothing as an fp32 scalar: ~1e-8 in fp64), and gradcheck
    holds the kernels' to the forward."""
    f, args = _cases()[name]
    f = _on(path, f)
    out = f(*args)
    outs = out if isinstance(out, tuple) else (out,)
    seeds = [torch.randn_like(o) for o in outs]
    plain = torch.autograd.grad(outs, args, seeds, retain_graph=True)
    graphed = torch.autograd.grad(outs, args, seeds, create_graph=True)
    for a, b in zip(plain, graphed):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_the_gpu_the_materialized_masks_are_the_kernels(dtype):
    """The masks a double backward materializes (attention.dropout_keep, dropout_add's
    _DropoutMask, the residual stream's) against the compiled kernels' own: the create_graph
    path's first-order gradients agree with the kernels' to 16-bit rounding (a mask drawn apart
    would differ in a third of the entries, by their whole size)."""
    torch.manual_seed(0)
    t = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v = t(2, 4, 200, 64), t(2, 4, 200, 64), t(2, 4, 200, 64)
    x, r, w, b = t(300, 256), t(300, 256), t(256), t(256)
    cases = [
        (_seeded(lambda q, k, v: ops.attention(q, k, v, dropout_p=0.3, is_causal=True)), (q, k, v)),
        (_seeded(lambda x, r, b: ops.dropout_add(x, r, 0.3, True, b)), (x, r, b)),
        (_seeded(lambda x, r, w, b: ops.dropout_add_layer_norm(x, r, 256, w, b, 1e-5, 0.3, True)[0]), (x, r, w, b)),
    ]
    for f, args in cases:
        out = f(*args)
        seed = torch.randn_like(out)
        plain = torch.autograd.grad(out, args, seed, retain_graph=True)
        graphed = torch.autograd.grad(out, args, seed, create_graph=True)
        for a, g in zip(plain, graphed):
            err = (g.float() - a.float()).abs().max() / a.float().abs().max()
            assert err < 2e-2, f"{f}: {err}"
