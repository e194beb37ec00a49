"""DTensor conversions in captured graphs, one spelling across torch versions.

Under tensor/sequence parallelism a captured block converts between local tensors and DTensors
(`DTensor.from_local(x, mesh, placements, ...)`, `t.redistribute(mesh, placements, ...)`,
`t.to_local(...)`), with a DeviceMesh and Placement objects as constant arguments. torch 2.13's
Dynamo writes them as those calls (the mesh a graph input, placements printable constants); torch
2.11's cannot print such constants into a graph's code, so it writes each call as a closure over
its constant arguments (`prim_to_local(t)`, `prim_redistribute(t)`, `prim from_local(x)`), which
no pattern (patterns/) would match.

`open_closures` turns those closures into the explicit calls, so that the patterns see one
spelling; `close_constants` turns every explicit call whose constants this torch cannot print
(anything the rewriter left, and the copies its replacements made) back into a closure over them,
as Dynamo did, before the graph is compiled into code. On torch 2.13 both find nothing to do.
"""
import functools
from collections.abc import Callable
from typing import Any

from torch import fx

# The methods torch 2.11's Dynamo closes over, by the closure's name.
_METHOD_CLOSURES = {"prim_to_local": "to_local", "prim_redistribute": "redistribute"}
_CLOSED_METHODS = frozenset(_METHOD_CLOSURES.values())


def _closure_values(fn: Callable) -> dict[str, Any] | None:
    """The variables a closure closes over, by name, or None for a function that closes over none."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return None
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return None


def _from_local() -> Callable | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor.from_local


def _opened(node: fx.Node) -> tuple[str, Any, tuple, dict] | None:
    """The explicit call a Dynamo closure node stands for, as (op, target, args, kwargs), or None."""
    if node.op != "call_function" or not callable(node.target):
        return None
    name = getattr(node.target, "__name__", "")
    if name not in _METHOD_CLOSURES and name != "prim from_local":
        return None
    values = _closure_values(node.target)
    if values is None or not isinstance(values.get("args_as_value"), list) \
            or not isinstance(values.get("kwargs_as_value"), dict) or len(node.args) != 1:
        return None
    args, kwargs = tuple(values["args_as_value"]), dict(values["kwargs_as_value"])
    if name in _METHOD_CLOSURES:
        if node.kwargs:
            return None
        return "call_method", _METHOD_CLOSURES[name], (node.args[0], *args), kwargs
    from_local = _from_local()
    if from_local is None or getattr(values.get("self"), "value", None) is not from_local:
        return None
    # shape and stride stay graph values (the closure's own arguments); None is the default
    extra = {k: v for k, v in node.kwargs.items() if v is not None}
    return "call_function", from_local, (node.args[0], *args), {**kwargs, **extra}


def open_closures(graph: fx.Graph) -> int:
    """Rewrites torch 2.11's DTensor closures into the calls they make, in place; returns how many."""
    count = 0
    for node in list(graph.nodes):
        call = _opened(node)
        if call is not None:
            node.op, node.target, node.args, node.kwargs = call
            count += 1
    return count


@functools.cache
def _dtensor_constant_types() -> tuple[type, ...]:
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.placement_types import Placement
    except ImportError:  # a torch built without distributed
        return ()
    return DeviceMesh, Placement


def _unprintable(value: Any) -> bool:
    """Whether fx's code generation cannot write `value` as a constant in this torch: a DeviceMesh
    or Placement that torch has not registered as printable (2.13 registers placements; a mesh is
    never a constant there)."""
    if not isinstance(value, _dtensor_constant_types()):
        return False
    try:
        from torch._library.opaque_object import is_opaque_value_type
    except ImportError:
        return True
    return not is_opaque_value_type(type(value))


def holds_unprintable(value: Any, unprintable: Callable[[Any], bool] | None = None) -> bool:
    """Whether `value` (through tuples, lists and dicts) holds a constant fx cannot print
    (`unprintable`, default: a mesh or placement this torch cannot print)."""
    unprintable = unprintable or _unprintable
    if isinstance(value, (tuple, list)):
        return any(holds_unprintable(v, unprintable) for v in value)
    if isinstance(value, dict):
        return any(holds_unprintable(v, unprintable) for v in value.values())
    return not isinstance(value, fx.Node) and unprintable(value)


class _Input(int):
    """Where a closure's argument goes among the call's arguments: the graph value it was."""


def _fill(template: Any, values: tuple) -> Any:
    if isinstance(template, _Input):
        return values[template]
    if isinstance(template, (tuple, list)):
        return type(template)(_fill(v, values) for v in template)
    if isinstance(template, dict):
        return {k: _fill(v, values) for k, v in template.items()}
    return template


def _closure(op: str, target: Any, args: tuple, kwargs: dict, name: str) -> Callable:
    """A function of the call's graph values that makes the call with its constants, as torch
    2.11's Dynamo writes one."""
    def call(*values: Any) -> Any:
        a, k = _fill(args, values), _fill(kwargs, values)
        return getattr(a[0], target)(*a[1:], **k) if op == "call_method" else target(*a, **k)

    call.__name__ = call.__qualname__ = name
    return call


def close_constants(graph: fx.Graph, unprintable: Callable[[Any], bool] | None = None) -> int:
    """Rewrites each DTensor conversion (`to_local`, `redistribute`, `DTensor.from_local`) whose
    arguments hold constants fx cannot print (`unprintable`) into a call of a closure over them,
    its graph values the closure's arguments, in place; returns how many."""
    from_local = _from_local()
    count = 0
    for node in list(graph.nodes):
        is_method = node.op == "call_method" and node.target in _CLOSED_METHODS
        if not (is_method or (node.op == "call_function" and from_local is not None
                              and node.target is from_local)):
            continue
        if not holds_unprintable((node.args, node.kwargs), unprintable):
            continue
        inputs: list[fx.Node] = []

        def slot(n: fx.Node) -> _Input:
            if n not in inputs:
                inputs.append(n)
            return _Input(inputs.index(n))

        args, kwargs = fx.map_arg((node.args, node.kwargs), slot)
        name = f"prim_{node.target}" if is_method else "prim_from_local"
        node.target = _closure(node.op, node.target, args, kwargs, name)
        node.op, node.args, node.kwargs = "call_function", tuple(inputs), {}
        count += 1
    return count


def recompile(gm: fx.GraphModule) -> None:
    """`gm.recompile()` after closing over the constants its code could not print (close_constants)."""
    close_constants(gm.graph)
    gm.recompile()
