"""Under torch's default-device mode (`torch.set_default_device`, `with torch.device(...)`: a
torch function mode that only gives factory calls without a device one) the ops take their thin
eager path, as without it: they used to take the registered `trifuse::` ops, whose dispatch made
a fused GPT-2 step's host time 48.96 ms against eager's 29.95 (bench/e2e_host_proxy.py
--default-device). The same bits forward and backward, every tensor on the inputs' device even
when the default device is another. Any other function mode (a tracer, a logger) still sees the
registered ops."""
import contextlib

import pytest
import torch

import trifuse
from _device import DEVICE, INTERPRETED, ON_GPU
from _fusing import PassThroughMode

ops = trifuse.ops


def _t(*shape, grad=True):
    return torch.randn(*shape, device=DEVICE, requires_grad=grad)


def _cases():
    torch.manual_seed(0)
    x, r, w, b, xb = _t(3, 40), _t(3, 40), _t(40), _t(40), _t(40)
    q, k, v = _t(1, 2, 9, 16), _t(1, 2, 9, 16), _t(1, 2, 9, 16)
    cos, sin = _t(1, 1, 9, 16, grad=False), _t(1, 1, 9, 16, grad=False)
    pq, pk, pv = _t(9, 2, 16), _t(9, 2, 16), _t(9, 2, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    h, hw = _t(5, 16), _t(7, 16)
    logits, target = _t(5, 7), torch.tensor([0, 3, -100, 6, 2], device=DEVICE)
    x3, r3, mul, add, gate = _t(2, 3, 40), _t(2, 3, 40), _t(2, 1, 40), _t(2, 1, 40), _t(2, 1, 40)
    mul_t, add_t, gate_t = _t(2, 3, 40), _t(1, 3, 40), _t(2, 3, 1)  # per token (the row kernels)
    return {
        "layer_norm": lambda: ops.layer_norm(x, (40,), w, b),
        "rms_norm": lambda: ops.rms_norm(x, (40,), w, 1e-6),
        "residual_stream": lambda: ops.dropout_add_layer_norm(x, r, 40, w, b, p=0.25, x_bias=xb),
        "layer_norm_add": lambda: ops.layer_norm_add(x, r, 40, w, b),
        "bias_gelu": lambda: ops.bias_gelu(x, b, "tanh"),
        "dropout_add": lambda: ops.dropout_add(x, r, 0.25, bias=b),
        "gated_activation": lambda: ops.gated_activation(x, r, "silu"),
        "group_norm": lambda: ops.group_norm(x.view(3, 8, 5), 4, w[:8], b[:8], 1e-5, "silu"),
        "channel_norm": lambda: ops.channel_norm(x.view(3, 8, 5), w[:8], b[:8]),
        "attention": lambda: ops.attention(q, k, v, dropout_p=0.25, is_causal=True),
        "attention_varlen": lambda: ops.attention_varlen(pq, pk, pv, cu, cu, 5, 5, causal=True),
        "rotary": lambda: ops.rotary_embedding(q, k, cos, sin),
        "cross_entropy": lambda: ops.cross_entropy(logits, target, label_smoothing=0.1),
        "linear_cross_entropy": lambda: ops.linear_cross_entropy(h, hw, target),
        "layer_norm_modulate": lambda: ops.layer_norm_modulate(x3, (40,), mul, add, w, b),
        "gated_add_layer_norm_modulate":
            lambda: ops.gated_add_layer_norm_modulate(x3, r3, gate, (40,), mul, add, w, b),
        "layer_norm_modulate_per_token":
            lambda: ops.layer_norm_modulate(x3, (40,), mul_t, add_t, w, b, mul_offset=1.0),
        "gated_add_rms_norm_modulate_per_token":
            lambda: ops.gated_add_layer_norm_modulate(x3, r3, gate_t, (40,), mul_t, add_t, w, is_rms_norm=True),
        "dropout_add_gated_per_token": lambda: ops.dropout_add(x3, r3, 0.25, bias=b, gate=mul_t),
    }


@contextlib.contextmanager
def _default_device(device):
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


MODES = {
    "with-torch.device": lambda: torch.device(DEVICE),
    "set_default_device": lambda: _default_device(DEVICE),
    # another default device than the inputs': nothing the op makes may land there
    "with-torch.device-meta": lambda: torch.device("meta"),
}


def _outputs(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def _leaf_grads(outs):
    """Every leaf the outputs depend on (in a fixed order), its gradient for random output
    gradients, and the class names of every autograd node on the way."""
    leaves, names, seen, stack = [], set(), set(), [t.grad_fn for t in outs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    leaves.sort(key=lambda t: (tuple(t.shape), t.detach().flatten()[0].item()))
    torch.manual_seed(2)
    seeds = [torch.randn(t.shape, dtype=t.dtype, device=t.device) for t in outs if t.requires_grad]
    grads = torch.autograd.grad([t for t in outs if t.requires_grad], leaves, seeds, allow_unused=True)
    return leaves, grads, names


def _run(call):
    """The call's tensor outputs, its leaves' gradients for random output gradients, and the
    class names of every autograd node it recorded."""
    torch.manual_seed(1)
    outs = _outputs(call())
    _, grads, names = _leaf_grads(outs)
    return outs, grads, names


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(_cases()))
def test_under_a_default_device_the_ops_take_their_eager_path(name, mode):
    call = _cases()[name]
    outs, grads, nodes = _run(call)
    with MODES[mode]():
        outs_m, grads_m, nodes_m = _run(call)
    assert not any(n.startswith("GeneratedBackwardFor_trifuse") for n in nodes_m), nodes_m
    assert nodes_m == nodes
    for a, b in zip((*outs, *grads), (*outs_m, *grads_m)):
        if a is None:
            assert b is None
            continue
        assert b.device == a.device
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["layer_norm", "attention", "cross_entropy"])
def test_under_another_function_mode_the_ops_take_their_registered_ops(name):
    outs, grads, _ = _run(_cases()[name])
    with PassThroughMode():
        outs_m, grads_m, nodes_m = _run(_cases()[name])
    assert any(n.startswith("GeneratedBackwardFor_trifuse") for n in nodes_m), nodes_m
    for a, b in zip((*outs, *grads), (*outs_m, *grads_m)):
        torch.testing.assert_close(b, a)


@pytest.mark.skipif(ON_GPU or INTERPRETED, reason="the PyTorch path: CPU tensors without TRITON_INTERPRET "
                    "(test_the_reference_path_in_a_process_of_its_own runs it)")
@pytest.mark.parametrize("name", [*_cases(), "residual_stream_p0"])
def test_on_the_reference_path_the_registered_ops_equal_the_eager_path(name):
    """CPU tensors without the interpreter run the PyTorch path, inside the registered ops too
    (torch.compile, a function mode, torch.jit.trace): gated_activation's backward op failed there
    (it took its derivative with torch.autograd.grad, which records nothing below the Autograd
    key), and the residual stream's without dropout returned dx and dresidual as one buffer, which
    a custom op may not."""
    if name == "residual_stream_p0":
        torch.manual_seed(0)
        x, r, w, b, xb = _t(3, 40), _t(3, 40), _t(40), _t(40), _t(40)
        cases = {name: lambda: ops.dropout_add_layer_norm(x, r, 40, w, b, p=0.0, x_bias=xb)}
    else:
        cases = _cases()
    results = []
    for mode in (contextlib.nullcontext, PassThroughMode):
        torch.manual_seed(1)
        with mode():
            outs = _outputs(cases[name]())
            leaves, grads, _ = _leaf_grads(outs)
        results.append((outs, leaves, grads))
    (outs, leaves, grads), (outs_r, leaves_r, grads_r) = results
    assert [id(t) for t in leaves_r] == [id(t) for t in leaves]
    for a, b in zip((*outs, *grads), (*outs_r, *grads_r)):
        if a is None:
            assert b is None
            continue
        torch.testing.assert_close(b, a)


def test_the_reference_path_in_a_process_of_its_own():
    """The PyTorch path, which CPU tensors take without TRITON_INTERPRET (a CPU user's default; the
    suite runs with the interpreter): the tests above that need it, the jit-trace tests, and the
    norm, residual-stream, adaptive-norm (gated, per token), gated-activation and double-backward
    suites, in a pytest process of its own. Left out: tests of the kernels' own partial sums, and
    NaN/inf propagation (PyTorch's fp32 CPU gelu returns NaN for inf in its vectorized path, which
    the float64 oracle does not)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve()
    env = {**os.environ, "TRITON_INTERPRET": "", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTEST_XDIST_WORKER", None)
    files = ["test_layer_norm.py", "test_residual_stream.py", "test_gated_activation.py",
             "test_double_backward.py", "test_jit_trace.py", "test_adaptive_norm.py",
             "test_gated_adaptive_norm.py", "test_adaptive_norm_rows.py", "test_gated_adaptive_norm_rows.py"]
    args = [f"{here}::test_on_the_reference_path_the_registered_ops_equal_the_eager_path",
            *(str(here.parent / f) for f in files), "-k", "not partial_sums and not nan_and_inf_propagate"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args]
    out = subprocess.run(command, cwd=here.parents[2], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    passed = re.search(r"(\d+) passed", out.stdout)
    assert out.returncode == 0 and passed and int(passed.group(1)) >= 500, out.stdout[-4000:]
