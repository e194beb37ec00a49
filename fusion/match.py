"""Finding a pattern's search function in a canonical graph, by dataflow.

A pattern's `search` is traced once into a small graph and canonicalized like the model's graph.
Its first sink (an output no other output feeds) is the anchor: each graph node with the
anchor's target is a candidate, and the pattern is matched backwards from it through arguments,
so the order in which the model wrote independent statements never matters. A search with
several sinks (rotary embedding of q and of k with one cos and sin) matches each further sink at
a graph node of its target, in graph order, sharing the bindings made so far. Additions and
multiplications match either way round. A placeholder matches any value (a node, or a constant
such as eps), the same value wherever it recurs; one annotated `torch.Tensor` only a node. Float
constants compare within 1e-6 relative: models write sqrt(2/pi) to different numbers of digits.

All matches at a candidate are produced (full backtracking), so the rewriter can try the next
one when a filter rejects the first.

The marker `patterns._base.from_local(x, placements)` matches a model's `DTensor.from_local(x,
mesh, placements, ...)` call (`local_to_dtensor`) whatever its mesh; in a replacement,
`resolve_from_local` turns it into a copy of the call the search matched, reading the new input.
"""
import inspect
import math
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import fx

from ..patterns._base import Pattern, example_value, from_local, tracing_ops
from .normalize import canonicalize_graph

COMMUTATIVE = (operator.add, operator.mul)
_TENSOR_ANNOTATIONS = (torch.Tensor, "torch.Tensor", "Tensor")


def trace_function(fn: Callable[..., Any], constants: dict[str, Any] | None = None,
                   inputs: Iterable[str] | None = None) -> fx.Graph:
    """Traces `fn` into a canonical graph. trifuse ops called through `patterns._base.ops`
    become single nodes.

    Without `inputs` (a search function) every positional parameter is a placeholder. With
    `inputs` (a replacement) only those are; the others take their value from `constants` or
    their default. Keyword-only parameters with defaults are options, left to their (bound)
    values: `functools.partial(search, masking="add")` is one spelling.
    """
    constants = constants or {}
    tracer = fx.Tracer()
    graph = fx.Graph()
    tracer.graph = graph
    tracer.root = torch.nn.Module()
    tracer.tensor_attrs = {}
    kwargs: dict[str, Any] = {}
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind == param.KEYWORD_ONLY and param.default is not param.empty:
            continue
        if name in constants:
            kwargs[name] = constants[name]
        elif inputs is None or name in inputs:
            annotation = param.annotation if param.annotation is not param.empty else None
            kwargs[name] = fx.Proxy(graph.placeholder(name, type_expr=annotation), tracer)
        elif param.default is not param.empty:
            kwargs[name] = param.default
        else:
            raise TypeError(f"{getattr(fn, '__name__', fn)}: nothing matched parameter {name!r}")
    with tracing_ops():
        out = fn(**kwargs)
    graph.output(tracer.create_arg(out))
    canonicalize_graph(graph)
    return graph


@dataclass(frozen=True)
class CompiledPattern:
    pattern: Pattern
    graph: fx.Graph
    params: dict[str, fx.Node]  # parameter name -> placeholder
    outputs: tuple[fx.Node, ...]
    anchor: fx.Node
    others: tuple[fx.Node, ...] = ()  # further sinks, matched after the anchor

    def is_candidate(self, node: fx.Node) -> bool:
        return node.op == self.anchor.op and node.target == self.anchor.target


@cache
def compile_pattern(pattern: Pattern) -> CompiledPattern:
    graph = trace_function(pattern.search)
    params = {n.target: n for n in graph.nodes if n.op == "placeholder"}
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(o, fx.Node) and o.op != "placeholder" for o in outputs):
        raise ValueError(f"pattern {pattern.name}: every output must be computed, got {outputs}")
    sinks = [o for o in outputs if not any(o is not p and o in _ancestors(p) for p in outputs)]
    return CompiledPattern(pattern, graph, params, outputs, sinks[0], tuple(sinks[1:]))


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


class Match:
    """One place where a pattern matched: parameter name -> matched value, plus the graph nodes
    the pattern's own operations matched."""

    def __init__(self, cp: CompiledPattern, env: dict[fx.Node, Any]) -> None:
        self.cp = cp
        self.env = env
        # matched casts of a pattern input that the model reads elsewhere too: they stay where
        # they are, for those readers (the replacement reads the input itself)
        self.kept: set[fx.Node] = set()

    @property
    def pattern(self) -> Pattern:
        return self.cp.pattern

    def __getitem__(self, name: str) -> Any:
        return self.env[self.cp.params[name]]

    def value(self, name: str) -> Any:
        return example_value(self[name])

    def bindings(self) -> dict[str, Any]:
        return {name: self.env[ph] for name, ph in self.cp.params.items() if ph in self.env}

    @property
    def nodes(self) -> list[fx.Node]:
        """Graph nodes matched by the pattern's operations (what the replacement removes), but
        those `kept`."""
        return [g for p, g in self.env.items() if p.op != "placeholder" and g not in self.kept]

    @property
    def outputs(self) -> list[fx.Node]:
        return [self.env[o] for o in self.cp.outputs]

    @property
    def anchor(self) -> fx.Node:
        return self.env[self.cp.anchor]


def matches(cp: CompiledPattern, node: fx.Node) -> Iterator[Match]:
    """Every way the pattern matches with its anchor at `node`."""
    if not cp.is_candidate(node):
        return
    for env in _match_node(cp, cp.anchor, node, {}):
        for env1 in _match_sinks(cp, list(cp.others), node.graph, env):
            yield Match(cp, env1)


def _match_sinks(cp: CompiledPattern, sinks: list[fx.Node], graph: fx.Graph, env: "Env") -> Iterator["Env"]:
    if not sinks:
        yield env
        return
    for g in graph.nodes:
        if g.op == sinks[0].op and g.target == sinks[0].target:
            for env1 in _match_node(cp, sinks[0], g, env):
                yield from _match_sinks(cp, sinks[1:], graph, env1)


Env = dict[fx.Node, Any]


def _match_node(cp: CompiledPattern, p: fx.Node, g: Any, env: Env) -> Iterator[Env]:
    if p.op == "placeholder":
        if p in env:
            if _same(env[p], g):
                yield env
            return
        if p.type in _TENSOR_ANNOTATIONS and not isinstance(g, fx.Node):
            return
        yield {**env, p: g}
        return
    dtensor_call = None
    if p.op == "call_function" and p.target is from_local:  # any DTensor.from_local call, by meaning
        dtensor_call = local_to_dtensor(g)
        if dtensor_call is None:
            return
    elif not isinstance(g, fx.Node) or g.op != p.op or g.target != p.target:
        return
    if p in env:
        if env[p] is g:
            yield env
        return
    if any(v is g for k, v in env.items() if k.op != "placeholder"):
        return  # two pattern operations cannot be one graph node
    if dtensor_call is not None:
        pairs = [(p.args[0], dtensor_call["local_tensor"]), (p.args[1], dtensor_call["placements"])]
        yield from _match_seq(cp, pairs, {**env, p: g})
        return
    if len(p.args) != len(g.args) or set(p.kwargs) != set(g.kwargs):
        return
    env = {**env, p: g}
    orders = [p.args]
    if p.target in COMMUTATIVE and len(p.args) == 2:
        orders.append(p.args[::-1])
    for pargs in orders:
        pairs = [*zip(pargs, g.args), *((p.kwargs[k], g.kwargs[k]) for k in p.kwargs)]
        yield from _match_seq(cp, pairs, env)


def local_to_dtensor(node: Any) -> dict[str, Any] | None:
    """The arguments of a `DTensor.from_local(...)` call node, by parameter name (local_tensor,
    device_mesh, placements, run_check, ...), or None when `node` is no such call. A call that
    states the global shape or stride is not one: a copy reading another tensor would be wrong."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not _is_dtensor_from_local(node.target):
        return None
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    args = dict(bound.arguments)
    if "local_tensor" not in args or args.get("placements") is None:
        return None
    if args.get("shape") is not None or args.get("stride") is not None:
        return None
    return args


def _is_dtensor_from_local(target: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return target is DTensor.from_local


def resolve_from_local(rgraph: fx.Graph, m: "Match") -> dict[str, fx.Node]:
    """Rewrites each `from_local(x, placements)` marker of a traced replacement into the model's
    call that the search's marker matched (its mesh and options), reading x with `placements`.
    A search has one marker, whose call gives the mesh. The graph nodes that call reads (the
    mesh) become placeholders of `rgraph`; returns their names -> those nodes."""
    markers = [n for n in rgraph.nodes if n.op == "call_function" and n.target is from_local]
    if not markers:
        return {}
    calls = [g for p, g in m.env.items() if p.op == "call_function" and p.target is from_local]
    if not calls:
        raise ValueError(f"pattern {m.pattern.name}: the replacement calls from_local, the search does not")
    model_call = calls[0]
    inputs: dict[str, fx.Node] = {}
    placeholders: dict[fx.Node, fx.Node] = {}
    first = next(iter(rgraph.nodes))

    def placeholder(node: fx.Node) -> fx.Node:
        if node not in placeholders:
            key = f"_from_local_{len(placeholders)}"
            inputs[key] = node
            with rgraph.inserting_before(first):
                placeholders[node] = rgraph.placeholder(key)
        return placeholders[node]

    signature = inspect.signature(model_call.target)
    for marker in markers:
        # The model's own argument layout, its graph nodes read through placeholders, with the
        # marker's input and placements.
        bound = signature.bind(*model_call.args, **model_call.kwargs)
        bound.arguments["local_tensor"] = bound.arguments["placements"] = None
        args, kwargs = fx.map_arg((bound.args, bound.kwargs), placeholder)
        bound = signature.bind(*args, **kwargs)
        bound.arguments["local_tensor"], bound.arguments["placements"] = marker.args
        args, kwargs = bound.args, bound.kwargs
        with rgraph.inserting_before(marker):
            call = rgraph.call_function(model_call.target, args, kwargs)
        marker.replace_all_uses_with(call)
        rgraph.erase_node(marker)
    return inputs


def _match_seq(cp: CompiledPattern, pairs: list[tuple[Any, Any]], env: Env) -> Iterator[Env]:
    if not pairs:
        yield env
        return
    (pa, ga), rest = pairs[0], pairs[1:]
    for env1 in _match_arg(cp, pa, ga, env):
        yield from _match_seq(cp, rest, env1)


def _match_arg(cp: CompiledPattern, pa: Any, ga: Any, env: Env) -> Iterator[Env]:
    if isinstance(pa, fx.Node):
        yield from _match_node(cp, pa, ga, env)
    elif isinstance(pa, (list, tuple)):
        if isinstance(ga, (list, tuple)) and len(ga) == len(pa):
            yield from _match_seq(cp, list(zip(pa, ga)), env)
    elif isinstance(pa, slice):  # x[..., :half]: the bounds may be placeholders
        if isinstance(ga, slice):
            yield from _match_seq(cp, [(pa.start, ga.start), (pa.stop, ga.stop), (pa.step, ga.step)], env)
    elif not isinstance(ga, fx.Node) and literal_equal(pa, ga):
        yield env


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op == "get_attr":
        return a.target == b.target  # fx reads an attribute once per use: one value, several nodes
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    return literal_equal(a, b)


def literal_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(literal_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    return type(a) is type(b) and a == b
