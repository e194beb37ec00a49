"""torch 2.11's spelling of DTensor conversions in Dynamo graphs (fusion/dtensor_calls.py).

torch 2.11's Dynamo writes `DTensor.from_local`, `redistribute` and `to_local` as closures over
their mesh and placements (it cannot print those into a graph's code); 2.13's writes the calls.
CI runs 2.13, so these tests write a 2.13 capture the way 2.11 does (`as_torch_2_11`, after
torch/_dynamo/variables/tensor.py and torch.py of 2.11) and check that the patterns still fuse
it and that its code runs where placements cannot be printed either. The lent GPU runs 2.11.
"""
import types

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import trifuse
from trifuse.fusion import dtensor_calls
from trifuse.fusion.backend import trifuse_backend


class ColumnParallelMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 24)

    def forward(self, x):
        return F.gelu(self.fc(x))


def _method_closure(method, args_as_value, kwargs_as_value):
    def fn_with_prim_types(x):
        return getattr(x, method)(*args_as_value, **kwargs_as_value)

    fn_with_prim_types.__name__ = f"prim_{method}"
    return fn_with_prim_types


def _from_local_closure(args_as_value, kwargs_as_value):
    from torch.distributed.tensor import DTensor

    self = types.SimpleNamespace(value=DTensor.from_local)  # 2.11: the function's VariableTracker

    def fn_with_prim_types(x, shape=None, stride=None):
        return self.value(x, *args_as_value, **kwargs_as_value, shape=shape, stride=stride)

    fn_with_prim_types.__name__ = "prim from_local"
    return fn_with_prim_types


def _is_mesh_input(a) -> bool:
    return isinstance(a, fx.Node) and a.op == "placeholder" and "DeviceMesh" in str(a.type)


def as_torch_2_11(gm: fx.GraphModule, mesh) -> int:
    """Rewrites gm's DTensor calls into torch 2.11's closures, the mesh (a graph input in 2.13)
    closed over as an object; returns how many closures the graph then holds (under torch 2.11
    Dynamo wrote them itself)."""
    from torch.distributed.tensor import DTensor

    def constant(a):
        return mesh if _is_mesh_input(a) else a

    for node in list(gm.graph.nodes):
        if node.op == "call_method" and node.target in ("to_local", "redistribute"):
            args = [constant(a) for a in node.args[1:]]
            kwargs = {k: constant(v) for k, v in node.kwargs.items()}
            node.op, node.target = "call_function", _method_closure(node.target, args, kwargs)
        elif node.op == "call_function" and node.target is DTensor.from_local:
            args = [constant(a) for a in node.args[1:]]
            kwargs = {k: constant(v) for k, v in node.kwargs.items()}
            node.target = _from_local_closure(args, kwargs)
        else:
            continue
        node.args, node.kwargs = node.args[:1], {}
    gm.recompile()
    return sum(getattr(n.target, "__name__", "").startswith("prim") for n in gm.graph.nodes)


def _conversions(graph, mesh):
    """The graph's DTensor conversions as (name, mesh, placements, options), arguments bound."""
    import inspect

    from torch.distributed.tensor import DTensor

    out = []
    for n in graph.nodes:
        if n.op == "call_method" and n.target in ("to_local", "redistribute"):
            fn, name = getattr(DTensor, n.target), n.target
        elif n.op == "call_function" and n.target is DTensor.from_local:
            fn, name = DTensor.from_local, "from_local"
        else:
            continue
        bound = inspect.signature(fn).bind(*n.args, **n.kwargs).arguments
        mesh_arg = bound.pop("device_mesh", None)
        out.append((name, mesh if _is_mesh_input(mesh_arg) else mesh_arg, bound.pop("placements", None),
                    {k: v for k, v in bound.items() if k not in ("self", "local_tensor")}))
    return out


def _sharded(mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    from trifuse.parallel.styles import ColwiseParallel

    torch.manual_seed(0)
    model = ColumnParallelMLP()
    parallelize_module(model, mesh, {"fc": ColwiseParallel()})
    return model


def _capture(model, x):
    captured = []

    def keep(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=keep, fullgraph=True)(x)
    return captured[0]


def _calls(graph):
    return [(n.op, n.target, n.args, n.kwargs) for n in graph.nodes
            if n.op in ("call_function", "call_method")]


def _unprintable_as_in_2_11(value):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

    return isinstance(value, (DeviceMesh, Placement))


def test_closures_open_into_the_calls_2_13_writes(one_rank_mesh):
    from torch.distributed.tensor import Replicate, Shard

    x = torch.randn(3, 5, 16)
    gm, inputs = _capture(_sharded(one_rank_mesh), x)
    want = gm(*inputs)
    assert as_torch_2_11(gm, one_rank_mesh) == 3  # from_local, redistribute, to_local
    names = [t if op == "call_method" else getattr(t, "__name__", "") for op, t, *_ in _calls(gm.graph)]
    assert names == ["prim from_local", "linear", "prim_redistribute", "prim_to_local", "gelu"], names
    torch.testing.assert_close(gm(*inputs), want, rtol=0, atol=0)  # the stand-in computes the same

    assert dtensor_calls.open_closures(gm.graph) == 3
    assert _conversions(gm.graph, one_rank_mesh) == [
        ("from_local", one_rank_mesh, (Replicate(),), {"run_check": False}),
        ("redistribute", one_rank_mesh, (Shard(-1),), {"async_op": False}),
        ("to_local", None, None, {})]

    # What 2.11 could not print, closed over again (from_local and redistribute; to_local takes no
    # constants and stays a method call): the code runs (the mesh alone as a constant would be a
    # NameError in it), and holds no placement either.
    assert dtensor_calls.close_constants(gm.graph, _unprintable_as_in_2_11) == 2
    gm.recompile()
    assert "Shard(" not in gm.code and "Replicate(" not in gm.code and "DeviceMesh(" not in gm.code
    torch.testing.assert_close(gm(*inputs), want, rtol=0, atol=0)


def test_open_calls_with_a_mesh_constant_do_not_run_unclosed(one_rank_mesh):
    """Negative control for the closing: opened, and compiled as they are, the mesh is printed
    into the code as its repr, which does not run."""
    x = torch.randn(3, 5, 16)
    gm, inputs = _capture(_sharded(one_rank_mesh), x)
    as_torch_2_11(gm, one_rank_mesh)
    dtensor_calls.open_closures(gm.graph)
    gm.recompile()
    with pytest.raises((NameError, AttributeError)):  # 2.13: the mesh; 2.11: from_local's name too
        gm(*inputs)


def test_torch_2_11_graph_fuses_and_runs_through_the_backend(one_rank_mesh, monkeypatch):
    """The whole path on a 2.11-style capture, placements unprintable as in 2.11: the bias moves
    into the GeLU on the local columns (the pattern of test_bias_gelu_pattern.py's column-parallel
    cases), and the rewritten graph computes what the model does."""
    monkeypatch.setattr(dtensor_calls, "_unprintable", _unprintable_as_in_2_11)
    x = torch.randn(3, 5, 16)
    model = _sharded(one_rank_mesh)
    want = model(x)
    seen = []

    def as_2_11_then_trifuse(gm, example_inputs):
        seen.append(as_torch_2_11(gm, one_rank_mesh))
        return trifuse_backend(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=as_2_11_then_trifuse, fullgraph=True)
    got = compiled(x)
    assert seen == [3]
    torch.testing.assert_close(got, want)
    assert trifuse.report(model).by_pattern() == {"linear_gelu_on_shards": 1}, trifuse.report(model)
