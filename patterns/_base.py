"""What a pattern is, and the few helpers its filters use.

A pattern is two plain functions over the same parameter names:

    search(x, weight, bias, ...)       what a model writes, in PyTorch (torch, F, tensor methods)
    replacement(x, weight, bias, ...)  the same maths through a trifuse public function (`ops.<name>`)

`fusion/` traces `search` into a small graph, finds it by dataflow in a model's canonical graph
(`fusion/normalize.py`), checks the filters, traces `replacement` with the matched values and
splices it in. Parameters annotated `torch.Tensor` must match a tensor computed in the graph;
unannotated ones also match constants (eps, p, shapes), which then reach `replacement` as plain
Python values, so a replacement may branch on them.

Filters take the `Match` and return None to accept or a sentence saying why not (it goes into
`trifuse.report`). `m[name]` is what a parameter matched (a graph node or a constant) and
`m.value(name)` its example value (a tensor with dtype and shape, the constant itself, or None when
unknown).

`derive` may compute further constants for the replacement from the match (its example values).

Under tensor/sequence parallelism (trifuse.parallel) the captured graph converts local tensors
to DTensors between ops (`DTensor.from_local(x, mesh, placements, ...)`, from the styles' hooks).
A pattern writes such a conversion as `from_local(x, placements)`: in a search it matches the
model's call whatever its mesh and options, with `placements` bound to the call's placements; in
a replacement it becomes a copy of the call the search matched, reading `x`.

Stages order the rewriting: 0 turns each spelling into one op, 1 combines ops (an add feeding a
fused norm becomes the residual-stream op), 2 folds the bias of a preceding linear into the op.
"""
import contextvars
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Match(Protocol):
    def __getitem__(self, name: str) -> Any: ...

    def value(self, name: str) -> Any: ...


Filter = Callable[[Match], "str | None"]


@dataclass(frozen=True)
class Pattern:
    """One spelling of one op family; `name` says what it matches (`linear_gelu`)."""

    name: str
    family: str  # what trifuse.report counts it as: layer_norm, rms_norm, bias_gelu, ...
    search: Callable[..., Any]
    replacement: Callable[..., Any]
    ops: tuple[str, ...]  # the trifuse.ops functions the replacement (and search) call
    filters: tuple[Filter, ...] = ()
    stage: int = 0
    # Constants for the replacement computed from the match's values (they override matched ones),
    # e.g. eps=None resolved to the input dtype's epsilon, as the op it replaces would.
    derive: Callable[[Match], dict[str, Any]] | None = None
    # For a replacement that makes several trifuse calls (a parallel block's two dropout_adds): the
    # family of each, in the order the replacement makes them; the report counts each call apart.
    call_families: tuple[str, ...] | None = None
    # True for a pattern whose anchor is an op most of whose calls it is not meant for (every
    # linear, for the padded LM head): its rejections stay out of the report.
    quiet: bool = False
    # For a pattern that folds a weight or bias written after a fused norm into it ("weight",
    # "bias"; or what it did, "an added 0 dropped"): the report keeps the spelling of the norm it
    # absorbed in its note.
    folds: str | None = None


# ---------------------------------------------------------------------------------------------
# `ops.<name>` inside patterns: trifuse's public functions, looked up when used. While fusion
# traces a pattern they are leaves: a call becomes one graph node whose target is the public
# function itself (fx must not trace into its launcher; STYLE.md fact 4).
# ---------------------------------------------------------------------------------------------

_tracing = contextvars.ContextVar("trifuse_tracing_ops", default=False)


class _OpNamespace:
    """`ops.layer_norm` etc.; AttributeError when this build has no such op."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        from .. import ops as public

        fn = getattr(public, name)
        return _leaf(fn) if _tracing.get() else fn


ops = _OpNamespace()


def available(name: str) -> bool:
    """Whether this build of trifuse has the public function `trifuse.ops.<name>`."""
    from .. import ops as public

    return callable(getattr(public, name, None))


@functools.cache
def _leaf(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        proxy = next((a for a in leaves if isinstance(a, torch.fx.Proxy)), None)
        if proxy is None:
            return fn(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", fn, args, kwargs)

    return call


class tracing_ops:
    """Context in which `ops.<name>` records graph nodes instead of running (used by fusion)."""

    def __enter__(self) -> None:
        self._token = _tracing.set(True)

    def __exit__(self, *exc: object) -> None:
        _tracing.reset(self._token)


def from_local(x: torch.Tensor, placements: Any) -> Any:
    """Pattern marker for `DTensor.from_local(x, <the model's mesh>, placements, ...)` (see the
    module docstring): traced, it is one graph node whose target is this function, which
    fusion/match.py resolves. Outside a pattern it is an error."""
    if isinstance(x, torch.fx.Proxy):
        return x.tracer.create_proxy("call_function", from_local, (x, placements), {})
    raise RuntimeError("trifuse.patterns._base.from_local is a pattern marker, for use inside patterns only")


# ---------------------------------------------------------------------------------------------
# Helpers for filters
# ---------------------------------------------------------------------------------------------


def example_value(node: Any) -> Any:
    """The value a graph node stands for, as far as it is known: a fake or real tensor from the
    node's metadata (Dynamo's `example_value`, fx's `val`), the constant itself for non-nodes,
    or None. Shape arithmetic (`x.size()[:-1] + (n,)`, `q.shape[1] // k.shape[1]`) is recomputed
    from its inputs' values: what fx's fake propagation stores for non-tensor results differs
    between torch versions."""
    if not isinstance(node, torch.fx.Node):
        return node
    meta = node.meta
    shape_math = _shape_arithmetic(node)
    if shape_math is not None:
        return shape_math
    if "example_value" in meta:
        return meta["example_value"]
    return meta.get("val")


_SHAPE_OPS = (operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv, getattr)


def _shape_arithmetic(node: torch.fx.Node) -> Any:
    """The value of a size/shape node or of integer arithmetic on them; None for anything else."""
    if node.op == "call_method" and node.target in ("size", "dim"):
        base = example_value(node.args[0])
        if isinstance(base, torch.Tensor):
            return getattr(base, node.target)(*node.args[1:])
        return None
    if node.op != "call_function" or node.target not in _SHAPE_OPS or node.kwargs:
        return None
    if node.target is getattr:
        if node.args[1] != "shape":
            return None
        base = example_value(node.args[0])
        return base.shape if isinstance(base, torch.Tensor) else None
    args = [example_value(a) for a in node.args]
    if not all(_is_shape_like(a) for a in args) or not any(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    try:
        return node.target(*args)
    except Exception:  # noqa: BLE001  (not shape arithmetic after all)
        return None


def _is_shape_like(v: Any) -> bool:
    if isinstance(v, (tuple, list)):  # torch.Size included
        return all(_is_shape_like(x) for x in v)
    return isinstance(v, (int, torch.SymInt, slice)) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_runtime_number(v: Any) -> bool:
    """A constant number, or a graph node that evaluates to a Python number when the graph runs:
    Dynamo passes a float attribute that differs between captures (one eps per model, one dropout
    p per layer) as a symbolic value rather than recompiling for each."""
    if is_number(v):
        return True
    return isinstance(v, torch.fx.Node) and isinstance(example_value(v), (int, float, torch.SymInt, torch.SymFloat)) \
        and not isinstance(example_value(v), bool)


def known_equal(a: Any, b: Any) -> bool:
    """a == b for ints or SymInts, True only when provably so (adds no guards)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(known_equal(x, y) for x, y in zip(a.shape, b.shape))


def params_fp32_or_like_input(m: Match) -> str | None:
    """For a norm of an fp32 copy of x, cast back, rewritten as the norm of x itself: that
    computes what the copy's norm did when each parameter (weight, bias, where the pattern has
    them) is fp32 (it joins the fp32 maths either way) or in x's dtype (upcast inside the kernel)."""
    x = m.value("x")
    if not isinstance(x, torch.Tensor):
        return "no dtype for x"
    for name in ("weight", "bias"):
        try:
            v = m.value(name)
        except KeyError:
            continue
        if isinstance(v, torch.Tensor) and v.dtype not in (torch.float32, x.dtype):
            return f"{name} dtype {v.dtype} is neither float32 nor the input's {x.dtype}"
    return None


def needs_number(*names: str) -> Filter:
    """The named parameters matched Python numbers: constants, or scalars the graph computes
    (`is_runtime_number`), never tensors."""

    def check(m: Match) -> str | None:
        for name in names:
            if not is_runtime_number(m[name]):
                return f"{name} is {_show(m[name])}, not a number"
        return None

    check.__name__ = f"needs_number({', '.join(names)})"
    return check


def needs_bool(*names: str) -> Filter:
    def check(m: Match) -> str | None:
        for name in names:
            if not isinstance(m[name], bool):
                return f"{name} is {_show(m[name])}, not a constant bool"
        return None

    check.__name__ = f"needs_bool({', '.join(names)})"
    return check


def needs_float_tensors(*names: str) -> Filter:
    """The named parameters are floating-point tensors (or None); unknown metadata fails."""

    def check(m: Match) -> str | None:
        for name in names:
            if m[name] is None:
                continue
            v = m.value(name)
            if not isinstance(v, torch.Tensor):
                return f"{name}: no tensor metadata"
            if not v.is_floating_point():
                return f"{name} has dtype {v.dtype}"
        return None

    check.__name__ = f"needs_float_tensors({', '.join(names)})"
    return check


def _show(v: Any) -> str:
    if isinstance(v, torch.fx.Node):
        return f"the value of node {v.name}"
    return repr(v)
