"""Without grad mode, the eager ops call their autograd.Function's forward directly
(`_common.apply_function`): the same outputs bit for bit as the recorded call, no autograd node,
and Function.apply not called at all (it costs host time for nothing there). Inside a torch.func
transform, a clear error naming the op. A second backward through an op (create_graph=True)
differentiates its gradients (autocast_linear's raises, naming it)."""

import pytest
import torch
import torch.nn.functional as F

from _device import DEVICE
from trifuse.kernels import _common
from trifuse.kernels import attention as A
from trifuse.kernels import bias_gelu as BG
from trifuse.kernels import cast as C
from trifuse.kernels import channel_norm as CN
from trifuse.kernels import dropout_add as DA
from trifuse.kernels import gated_activation as GA
from trifuse.kernels import group_norm as GN
from trifuse.kernels import layer_norm as LN
from trifuse.kernels import rotary as RO


def _t(*shape):
    return torch.randn(*shape, device=DEVICE, requires_grad=True)


def _cases():
    x, r, w, b, xb = _t(3, 40), _t(3, 40), _t(40), _t(40), _t(40)
    q, k, v = _t(1, 2, 9, 16), _t(1, 2, 9, 16), _t(1, 2, 9, 16)
    cos, sin = torch.randn(1, 1, 9, 16, device=DEVICE), torch.randn(1, 1, 9, 16, device=DEVICE)
    return {
        "layer_norm": (LN._NormFunction, lambda: LN._layer_norm_trifuse(x, (40,), w, b, 1e-5)),
        "residual_stream": (LN._NormFunction,
                            lambda: LN.dropout_add_layer_norm(x, r, 40, w, b, p=0.25, x_bias=xb)),
        "layer_norm_add": (LN._NormAddFunction, lambda: LN.layer_norm_add(x, r, 40, w, b)),
        "bias_gelu": (BG._BiasGeluFunction, lambda: BG._bias_gelu_trifuse(x, b, "tanh")),
        "dropout_add": (DA._DropoutAddFunction, lambda: DA.dropout_add(x, r, 0.25, bias=b)),
        "gated_activation": (GA._GatedActivationFunction, lambda: GA._gated_activation_trifuse(x, r, "silu")),
        "group_norm": (GN._GroupNormFunction,
                       lambda: GN._group_norm_trifuse(x.view(3, 8, 5), 4, w[:8], b[:8], 1e-5, "silu", None)),
        "channel_norm": (CN._ChannelNormFunction,
                         lambda: CN._channel_norm_trifuse(x.view(3, 8, 5), 1, w[:8], b[:8], 1e-5, False,
                                                          False)),
        "attention": (A._AttentionFunction, lambda: A._attention_trifuse(q, k, v, None, 0.25, True, None, False)),
        "rotary": (RO._RotaryEmbeddingFunction, lambda: RO._rotary_trifuse(q, k, cos, sin)),
        "cast_for_readers": (C._CastForReaders, lambda: C.cast_for_readers(x, torch.float16, 2)),
    }


def _flat(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", list(_cases()))
def test_no_grad_calls_skip_function_apply_and_give_the_same_bits(name, monkeypatch):
    function, call = _cases()[name]
    torch.manual_seed(0)
    recorded = _flat(call())
    assert any(t.grad_fn is not None for t in recorded), "with grad, the Function records its node"

    def refused(*args):
        raise AssertionError(f"{function.__name__}.apply called without grad mode")

    monkeypatch.setattr(function, "apply", refused)
    torch.manual_seed(0)
    with torch.no_grad():
        direct = _flat(call())
    assert len(direct) == len(recorded)
    for a, e in zip(direct, recorded):
        assert a.grad_fn is None and not a.requires_grad
        assert a.dtype == e.dtype and torch.equal(a, e.detach())


@pytest.mark.parametrize("name", list(_cases()))
def test_inside_a_torch_func_transform_an_op_says_it_does_not_implement_it(name):
    # not PyTorch's "must override the setup_context staticmethod", which names no trifuse op
    function, call = _cases()[name]
    public = _common._PUBLIC_OPS.get(function.__name__, function.__name__)
    with pytest.raises(NotImplementedError, match=rf"trifuse\.ops\.{public.split()[0]} .*torch\.func transform"):
        torch.func.grad(lambda t: _flat(call())[0].sum() * t)(torch.tensor(1.0, device=DEVICE))
    assert torch.isfinite(_flat(call())[0]).all()  # outside the transform it runs as before


def test_the_ctx_stand_in_says_no_input_needs_a_gradient():
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            seen["needs"] = ctx.needs_input_grad
            ctx.save_for_backward(a)
            ctx.set_materialize_grads(False)
            return a + b

    a = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        out = _common.apply_function(Probe, a, 1.0)
    assert seen["needs"] == (False, False) and out.grad_fn is None
    assert _common.apply_function(Probe, a, 1.0).grad_fn is not None


def _leaves(outs):
    """The tensors requiring grad that `outs` were computed from (the closures' inputs)."""
    seen, stack, leaves = set(), [o.grad_fn for o in outs if o.grad_fn is not None], []
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            leaves.append(fn.variable)
        stack += [f for f, _ in fn.next_functions if f is not None]
    return leaves


# Ops whose gradients are functions of their inputs (second derivatives exist); the others are
# linear in every input that requires grad here (dropout_add, rotary, a cast): their gradients
# are constants of those inputs, as in PyTorch.
_SECOND_ORDER = ("layer_norm", "residual_stream", "layer_norm_add", "bias_gelu", "gated_activation",
                 "attention", "group_norm", "channel_norm")


@pytest.mark.parametrize("name", list(_cases()))
def test_a_second_backward_through_an_op_differentiates_its_gradients(name):
    """create_graph=True (a gradient penalty): the first-order gradients are the kernels' own,
    and differentiating them again reaches every input they depend on (the ops' backward in
    PyTorch ops there: `_common.reference_grads`; tests/kernels/test_double_backward.py checks
    the values). Before, the kernels' gradients entered the second backward as constants, and
    the ops' second-order terms were missing."""
    function, call = _cases()[name]
    torch.manual_seed(0)
    outs = _flat(call())
    leaves = _leaves(outs)
    seeds = [torch.randn_like(o) for o in outs]
    first = torch.autograd.grad(outs, leaves, seeds, create_graph=True, allow_unused=True)
    torch.manual_seed(0)
    plain = torch.autograd.grad(_flat(call()), leaves, seeds, allow_unused=True)
    for a, b in zip(first, plain):
        assert (a is None) == (b is None)
        if a is not None:  # the same values (the PyTorch ops' rounding, not the kernels', in fp32)
            torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-5)
    grads = [g for g in first if g is not None and g.requires_grad]
    if name not in _SECOND_ORDER:  # linear in its inputs: gradients that are constants of them
        assert grads == []
        return
    penalty = sum((g.float() ** 2).sum() for g in grads)
    second = torch.autograd.grad(penalty, leaves, allow_unused=True)
    assert any(s is not None and s.abs().sum() > 0 for s in second)
    assert all(s is None or torch.isfinite(s).all() for s in second)


@pytest.mark.parametrize("in_by_out", [False, True])
def test_a_second_backward_through_autocast_linear(in_by_out):
    """autocast_linear (fp32 weights, x in the autocast dtype, as a fused block hands it over):
    the penalty's gradients are autocast's F.linear's (its casts and GEMM by autograd). With an
    fp32 x, whose 16-bit copy made in the forward leads back to nothing, it raises naming the op."""
    from trifuse.kernels import linear as LI

    torch.manual_seed(0)
    x, w, b = _t(3, 8), _t(8, 5) if in_by_out else _t(5, 8), _t(5)
    x16 = x.detach().to(torch.bfloat16).requires_grad_()

    def penalty_grads(linear):
        y = linear(x16, w, b)
        gx, gw = torch.autograd.grad(y.float().pow(2).sum(), (x16, w), create_graph=True)
        return torch.autograd.grad(gx.float().pow(2).sum() + gw.pow(2).sum(), (x16, w, b))

    got = penalty_grads(lambda x, w, b: LI._AutocastLinear.apply(x, w, b, torch.bfloat16, in_by_out))
    want = penalty_grads(lambda x, w, b: F.linear(x, (w.t() if in_by_out else w).to(torch.bfloat16),
                                                   b.to(torch.bfloat16)))
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), rtol=5e-2, atol=5e-2)  # bf16 GEMMs apart
    y = LI._AutocastLinear.apply(x, w, b, torch.bfloat16, in_by_out)
    gx, gw = torch.autograd.grad(y.float().pow(2).sum(), (x, w), create_graph=True)
    with pytest.raises(RuntimeError, match=r"trifuse\.ops\.autocast_linear has no double backward"):
        (gx.pow(2).sum() + gw.pow(2).sum()).backward()
