"""Every op gives the same answer on its two paths: the eager `autograd.Function` (what a fused
model runs) and the registered `trifuse::` op (what torch.compile, fx graphs and export run).

A model compiled with `backend="trifuse"` must train as the same model fused eagerly. For each
op and form of tests/_op_cases.py, outputs and input gradients must agree between the paths in
dtype, shape and value; also under CPU autocast to fp16, where each path has to make the same
casting choice (SDPA-style inputs cast to the autocast dtype, norms kept in their input dtype).
Dropout forms draw the same seed on both paths (the same generator state before each), so they
are compared too.
"""
import pytest
import torch
from _op_cases import CASES, Traced


def _run(name: str, traced: bool, autocast: bool):
    make, call = CASES[name]
    torch.manual_seed(1)
    inputs = make()
    for t in inputs.values():
        t.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        if traced:
            with Traced():
                out = call(inputs)
        else:
            out = call(inputs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    flat = [o for item in outs for o in (item if isinstance(item, tuple) else (item,))]
    differentiable = [o for o in flat if o.requires_grad]
    torch.manual_seed(2)
    dys = [torch.randn(o.shape, dtype=o.dtype) for o in differentiable]
    names = sorted(inputs)
    grads = torch.autograd.grad(differentiable, [inputs[n] for n in names], dys, allow_unused=True)
    return flat, dict(zip(names, grads))


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast_fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_and_registered_paths_agree(name, autocast):
    eager_out, eager_grads = _run(name, False, autocast)
    reg_out, reg_grads = _run(name, True, autocast)
    assert len(eager_out) == len(reg_out), name
    for i, (a, b) in enumerate(zip(eager_out, reg_out)):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (name, f"output {i}")
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=lambda m, i=i: f"{name}: output {i}: {m}")
    for n in sorted(eager_grads):
        a, b = eager_grads[n], reg_grads[n]
        assert (a is None) == (b is None), (name, n)
        if a is not None:
            assert (a.dtype, a.shape) == (b.dtype, b.shape), (name, f"d{n}")
            torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=lambda m, n=n: f"{name}: d{n}: {m}")
