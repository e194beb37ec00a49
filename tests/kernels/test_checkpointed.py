"""Every op under activation checkpointing, as transformers' gradient checkpointing runs a fused
block: `torch.utils.checkpoint.checkpoint`, non-reentrant (transformers' default) and reentrant.

A non-reentrant checkpoint replaces each tensor an op saves for its backward by a handle that
recomputes the forward on first use and may be unpacked once: a backward that reads
`ctx.saved_tensors` twice raises CheckpointError there (xIELU's did: Apertus crashed fused under
gradient checkpointing and ran unfused). A reentrant one runs the forward under no_grad and the
whole call again in the backward, with the RNG state restored: dropout must draw the same masks.
Either way the gradients are the ones the op gives unchecked, bitwise: the same kernels on the
same inputs. Both paths: the eager `autograd.Function` and the registered `trifuse::` op."""
import contextlib

import pytest
import torch
from _op_cases import CASES, Traced
from torch.utils.checkpoint import checkpoint


def _grads(name: str, traced: bool, reentrant: bool | None) -> tuple[list, list]:
    """(outputs, gradients of every input) of case `name`, called plainly (reentrant None) or
    under a checkpoint of that kind."""
    make, call = CASES[name]
    torch.manual_seed(1)
    inputs = make()
    names = sorted(inputs)
    for t in inputs.values():
        t.requires_grad_(True)

    def body(*tensors):
        with Traced() if traced else contextlib.nullcontext():
            out = call(dict(zip(names, tensors)))
        return out if isinstance(out, tuple) else (out,)

    torch.manual_seed(3)  # the dropout cases draw their masks from here, in the recompute too
    tensors = [inputs[n] for n in names]
    out = body(*tensors) if reentrant is None else checkpoint(body, *tensors, use_reentrant=reentrant)
    outs = [o for o in out if o is not None and o.requires_grad]
    torch.manual_seed(2)
    loss = sum((o.float() * torch.randn(o.shape)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [inputs[n].grad for n in names]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "registered"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpointed_op_gives_the_unchecked_outputs_and_gradients(name, traced, reentrant):
    out, grads = _grads(name, traced, None)
    out_ck, grads_ck = _grads(name, traced, reentrant)
    assert len(out_ck) == len(out)
    for a, b in zip(out_ck, out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for i, (g_ck, g) in enumerate(zip(grads_ck, grads)):
        assert (g_ck is None) == (g is None), (name, i)
        if g is not None:
            torch.testing.assert_close(g_ck, g, rtol=0, atol=0, msg=lambda m, i=i: f"{name}: input {i}: {m}")
