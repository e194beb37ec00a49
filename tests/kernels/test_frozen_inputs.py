"""Every op's gradients do not depend on which of its other inputs want one.

LoRA and partial fine-tuning freeze most parameters: a linear's bias folded into an op, a norm's
weight, an adaLN projection's output. The backward kernels skip what nobody asked for (a dbias
partial sum, a dgate product), and each such skip must not change what is computed for the
inputs that do want gradients (a bias still shifts the z that dgate multiplies). For each op and
each of its differentiable inputs, the gradients are computed once with every input requiring
grad (what the op's own tests check against float64), then with that one input frozen and with it
alone requiring grad: the gradients that remain must be the same. Both paths: the eager
`autograd.Function` and the registered `trifuse::` op (what torch.compile and fx graphs call),
reached here under a no-op TorchFunctionMode.
"""
import pytest
import torch
from _op_cases import CASES, run


def _grads(name: str, wanted: set[str], traced: bool) -> dict[str, torch.Tensor]:
    inputs, outs = run(name, wanted, traced)
    torch.manual_seed(2)
    loss = sum((o.float() * torch.randn(o.shape)).sum() for o in outs)
    grads = torch.autograd.grad(loss, [inputs[n] for n in sorted(wanted)], allow_unused=True)
    return dict(zip(sorted(wanted), grads))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "registered"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_do_not_depend_on_which_other_inputs_want_one(name, traced):
    every = set(CASES[name][0]())
    full = _grads(name, every, traced)
    for held in sorted(every):
        for wanted in (every - {held}, {held}):
            if not wanted:
                continue
            part = _grads(name, wanted, traced)
            for n in sorted(wanted):
                assert (part[n] is None) == (full[n] is None), (name, n, wanted)
                if part[n] is not None:
                    torch.testing.assert_close(part[n], full[n], rtol=1e-5, atol=1e-5,
                                               msg=lambda m, n=n, w=wanted: f"{name}: d{n} with {sorted(w)} "
                                                                             f"wanting gradients: {m}")
