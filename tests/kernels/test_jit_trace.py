"""Under `torch.jit.trace` the ops take their registered `trifuse::` ops, which the tracer records
as nodes of the traced graph: the thin eager path launches Triton kernels, which the tracer cannot
see (and whose launch arguments it hands over as traced values: the interpreter failed on them,
and a trace that ran would have recorded none of the kernels' work). The traced function, called
on new inputs, computes what the op computes, forward and backward."""
import pytest
import torch

import trifuse
from _device import DEVICE

ops = trifuse.ops


def _t(*shape, grad=True):
    return torch.randn(*shape, device=DEVICE, requires_grad=grad)


def _cases():
    """name: (the op as a function of its tensor inputs, factory of those inputs)."""
    w, b, xb = _t(40, grad=False), _t(40, grad=False), _t(40, grad=False)  # constants of the trace
    cos, sin = _t(1, 1, 9, 16, grad=False), _t(1, 1, 9, 16, grad=False)
    target = torch.tensor([0, 3, -100, 6, 2], device=DEVICE)
    rows = lambda: (_t(3, 40), _t(3, 40))  # noqa: E731
    heads = lambda: (_t(1, 2, 9, 16), _t(1, 2, 9, 16), _t(1, 2, 9, 16))  # noqa: E731
    return {
        "layer_norm": (lambda x: ops.layer_norm(x, (40,), w, b), lambda: rows()[:1]),
        "rms_norm": (lambda x: ops.rms_norm(x, (40,), w, 1e-6), lambda: rows()[:1]),
        "residual_stream": (lambda x, r: ops.dropout_add_layer_norm(x, r, 40, w, b, p=0.25, x_bias=xb), rows),
        "layer_norm_add": (lambda x, r: ops.layer_norm_add(x, r, 40, w, b), rows),
        "bias_gelu": (lambda x: ops.bias_gelu(x, b, "tanh"), lambda: rows()[:1]),
        "dropout_add": (lambda x, r: ops.dropout_add(x, r, 0.25, bias=b), rows),
        "gated_activation": (lambda x, r: ops.gated_activation(x, r, "silu"), rows),
        "group_norm": (lambda x: ops.group_norm(x.view(3, 8, 5), 4, w[:8], b[:8], 1e-5, "silu"),
                       lambda: rows()[:1]),
        "channel_norm": (lambda x: ops.channel_norm(x.view(3, 8, 5), w[:8], b[:8]), lambda: rows()[:1]),
        "attention": (lambda q, k, v: ops.attention(q, k, v, dropout_p=0.25, is_causal=True), heads),
        "rotary": (lambda q, k: ops.rotary_embedding(q, k, cos, sin), lambda: heads()[:2]),
        "cross_entropy": (lambda logits: ops.cross_entropy(logits, target, label_smoothing=0.1), lambda: (_t(5, 7),)),
        "linear_cross_entropy": (lambda h, hw: ops.linear_cross_entropy(h, hw, target), lambda: (_t(5, 16), _t(7, 16))),
    }


def _flat(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", list(_cases()))
def test_a_traced_op_is_the_registered_op_and_replays_forward_and_backward(name):
    torch.manual_seed(0)
    fn, inputs = _cases()[name]
    traced = torch.jit.trace(fn, inputs(), check_trace=False)
    nodes = [n.kind() for n in traced.graph.nodes()]
    assert any(kind.startswith("trifuse::") for kind in nodes), nodes
    fresh = inputs()
    results = []
    for call in (fn, traced):
        torch.manual_seed(1)  # the same dropout masks in both calls
        outs = _flat(call(*fresh))
        print("DBG", call, [(o.requires_grad, o.grad_fn, o.is_leaf) for o in outs])
        seeds = [torch.ones_like(o) for o in outs if o.requires_grad]
        grads = torch.autograd.grad([o for o in outs if o.requires_grad], fresh, seeds)
        results.append((outs, grads))
    (outs, grads), (outs_t, grads_t) = results
    assert len(outs_t) == len(outs)
    for a, b in zip((*outs, *grads), (*outs_t, *grads_t)):
        torch.testing.assert_close(b, a)
