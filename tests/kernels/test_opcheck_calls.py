"""Every registered `trifuse::` op passes torch.library.opcheck on the calls the ops really make.

The calls are recorded (a TorchDispatchMode) while each op and form of tests/_op_cases.py runs
forward and backward on its registered path, once with every input wanting a gradient and once
with each input alone wanting one: the backward ops then get their needs-gradient masks and the
empty outputs that stand for gradients nobody asked for. opcheck checks each call's schema
(no undeclared aliasing or mutation: two outputs that are one tensor fail here), the fake
implementation against the real outputs' shapes, strides and dtypes, and the op under
AOTAutograd with dynamic shapes. Every op in the namespace must be reached by some case.
"""
import pytest
import torch
from _op_cases import CASES, run
from torch.utils._python_dispatch import TorchDispatchMode


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in t's strides, also where they are not dense (clone() would make those
    contiguous)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t.detach())


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "trifuse":
            clone = torch.utils._pytree.tree_map_only(torch.Tensor, _copy, (args, kwargs))
            self.calls.append((func, *clone))
        return func(*args, **kwargs)


def _recorded_calls(name: str, layout: str = "contiguous") -> list:
    """(op, args, kwargs) of each distinct call: the forward once, the backward per gradient mask."""
    every = sorted(CASES[name][0]())
    calls, seen = [], set()
    for wanted in [every] + [[n] for n in every] if len(every) > 1 else [every]:
        with _Recorder() as recorder:
            inputs, outs = run(name, set(wanted), traced=True, layout=layout)
            torch.manual_seed(2)
            torch.autograd.grad(outs, [inputs[n] for n in wanted], [torch.randn_like(o) for o in outs],
                                allow_unused=True)
        for func, args, kwargs in recorder.calls:
            key = (str(func), repr(torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.numel() > 0,
                                                                      (args, kwargs))))
            if key not in seen:
                seen.add(key)
                calls.append((func, args, kwargs))
    return calls


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "sliced"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_registered_calls_pass_opcheck(name, layout):
    """With the inputs permuted and sliced too (tests/_op_cases.py, LAYOUTS): a fake that keeps
    its input's strides where the kernel writes a contiguous output fails Inductor's stride
    assertion at run time (Apertus's QK norm on a (batch, heads, seq, dim) view, 2026-12-06)."""
    calls = _recorded_calls(name, layout)
    assert calls, f"{name}: no trifuse op ran"
    for func, args, kwargs in calls:
        try:
            torch.library.opcheck(func, args, kwargs)
        except Exception as e:
            raise AssertionError(f"{name} ({layout}): {func} failed opcheck") from e


def test_the_cases_reach_every_registered_op():
    reached = {str(func).split(".")[1] for name in sorted(CASES) for func, _, _ in _recorded_calls(name)}
    registered = {n for n in dir(torch.ops.trifuse) if isinstance(getattr(torch.ops.trifuse, n),
                                                                  torch._ops.OpOverloadPacket)}
    assert registered - reached == set()
