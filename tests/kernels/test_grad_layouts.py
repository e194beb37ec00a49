"""Every op's backward reads its output gradients at whatever strides autograd hands over.

Those are not always contiguous: `y.sum()` gives an expanded gradient (all strides 0), a
`y.transpose(1, 2)` downstream gives a transposed one, `y[..., :n]` a slice padded with zeros, a
per-head view of a projection an offset into a larger buffer. For each op and form (tests/_op_cases.py),
each output's gradient is handed over in each such layout, with the same values as a contiguous
gradient: the input gradients must be the same as with the contiguous one. Both paths: the eager
`autograd.Function` and the registered `trifuse::` op.
"""
import pytest
import torch
from _op_cases import CASES, run


def _transposed(g: torch.Tensor) -> torch.Tensor:
    return g.transpose(-1, -2).contiguous().transpose(-1, -2)


def _every_other(g: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(*g.shape[:-1], 2 * g.shape[-1], dtype=g.dtype)
    return wide[..., ::2].copy_(g)


def _offset(g: torch.Tensor) -> torch.Tensor:
    flat = torch.full((g.numel() + 3,), float("nan"), dtype=g.dtype)
    return flat[3:].view(g.shape).copy_(g)


def _broadcast_rows(g: torch.Tensor) -> torch.Tensor:
    # the first row's values broadcast over the leading dims (stride 0 there)
    return g.reshape(-1, g.shape[-1])[:1].reshape((1,) * (g.dim() - 1) + g.shape[-1:]).expand(g.shape)


def _expanded(g: torch.Tensor) -> torch.Tensor:
    # one value everywhere, all strides 0: what `y.sum()` or `y.mean()` hands back
    return g.reshape(-1)[:1].reshape(()).expand(g.shape)


LAYOUTS = {"transposed": _transposed, "every_other": _every_other, "offset": _offset,
           "broadcast_rows": _broadcast_rows, "expanded": _expanded}


def _input_grads(inputs, outs, grads):
    names = sorted(inputs)
    got = torch.autograd.grad(outs, [inputs[n] for n in names], grads, retain_graph=True, allow_unused=True)
    return dict(zip(names, got))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "registered"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_output_gradients_in_any_layout_give_the_same_input_gradients(name, traced):
    inputs, outs = run(name, None, traced)
    torch.manual_seed(2)
    values = [torch.randn(o.shape, dtype=o.dtype) for o in outs]
    for layout, make_layout in LAYOUTS.items():
        shaped = [make_layout(v) if v.dim() >= (2 if layout == "transposed" else 1) else v for v in values]
        if all(s is v for s, v in zip(shaped, values)):
            continue
        # the contiguous gradient with the very same values (broadcast layouts change them)
        reference = _input_grads(inputs, outs, [s.contiguous() for s in shaped])
        got = _input_grads(inputs, outs, shaped)
        for n in sorted(inputs):
            assert (got[n] is None) == (reference[n] is None), (name, layout, n)
            if got[n] is not None:
                torch.testing.assert_close(got[n], reference[n], rtol=1e-5, atol=1e-5, equal_nan=False,
                                           msg=lambda m, n=n, layout=layout: f"{name}: d{n} with {layout} output "
                                                                             f"gradients: {m}")
