"""Rewriting a canonical graph with the pattern library: `rewrite(gm, patterns) -> RewriteLog`.

For each pattern, in stage order (spellings -> one op; ops -> combined ops; biases folded), every
candidate node is matched (match.py) and each match is checked before anything changes:

1. the pattern's intermediate values are used nowhere else (else the model still needs them),
   except for their shape: a `size()` of an intermediate (Dynamo writes OPT's `x.shape`, taken
   before a reshape, as one when the sequence length is dynamic) then reads a pattern input of
   provably the same shape instead;
2. the pattern's filters accept the matched values;
3. the replacement, traced with the matched constants, runs on the matched example values (fake
   tensors, no data): the trifuse op's own input checks decide whether it takes these shapes,
   dtypes and devices, and each replacement output must have its original's shape. Where it
   comes out in another dtype than the original (a norm under autocast returns the activation
   dtype, autocast's would return float32), a cast back keeps every dtype the model sees.

Then the replacement is spliced in before the first matched node and the matched nodes are
removed, and so are the replacement's nodes that nothing uses and that have no side effects (a
post-norm block drops the sum a residual-stream op also returns). A replacement's
`from_local(x, placements)` (patterns/_base.py) is a copy of the DTensor conversion its search
matched (match.py's `resolve_from_local`). A replaced op consumed by a later, larger pattern
counts only once, as the larger one.
Every candidate left in the graph is reported with the reasons it was rejected, and so is every
op of interest no pattern took. Last, under autocast, a fused norm whose output only autocast's
matmuls read writes it in their dtype, and a replacement's output that was cast back to fp32 for
one such matmul alone reaches it uncast (narrow.py).
"""
import functools
import operator
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from ..patterns._base import Pattern, available, example_value, same_shape
from .dtensor_calls import holds_unprintable, recompile
from .match import Match, compile_pattern, matches, resolve_from_local, trace_function
from .narrow import drop_cast_backs, full_y, narrow_norm_outputs, out_dtype, readers
from .normalize import canonicalize_node, reads_only_metadata, writes_in_place

FAMILIES = ("attention", "layer_norm", "rms_norm", "bias_gelu", "gated_activation", "dropout_add",
            "residual_stream", "cross_entropy", "rotary", "group_norm", "xielu")
# Families whose patterns build on another family's output (the residual stream starts from a
# fused norm), so selecting them selects those too.
DEPENDS = {"residual_stream": ("layer_norm", "rms_norm")}

# Ops whose presence in a rewritten graph is worth a line in the report when no pattern took them.
_OF_INTEREST = {
    F.layer_norm: "layer_norm",
    F.group_norm: "group_norm",
    F.gelu: "gelu",
    F.dropout: "dropout",
    F.scaled_dot_product_attention: "scaled_dot_product_attention",
    torch.softmax: "softmax",
    F.multi_head_attention_forward: "multi_head_attention_forward",
    F.cross_entropy: "cross_entropy",
    # an activation left as written: x * sigmoid(c x) with a slope other than QuickGELU's 1.702,
    # a SiLU written out with no gate after it, a router's sigmoid
    torch.sigmoid: "sigmoid",
}
if hasattr(F, "rms_norm"):
    _OF_INTEREST[F.rms_norm] = "rms_norm"


@dataclass
class Replaced:
    pattern: str
    family: str
    where: str  # module path(s) inside the captured module
    node: str  # the graph node of the new op
    note: str = ""
    absorbed: bool = False  # consumed later by a larger pattern, counted there


@dataclass
class Rejected:
    pattern: str
    family: str
    where: str
    node: str
    reason: str


@dataclass
class Left:
    op: str
    where: str
    node: str
    reason: str


@dataclass
class RewriteLog:
    """What one rewrite did. `counts` is per family, `by_pattern` per pattern name."""

    replaced: list[Replaced] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # pattern -> why it did not run
    shared_casts: list[str] = field(default_factory=list)  # values cast once for their matmuls (narrow.py)
    fp32_weight_grads: list[str] = field(default_factory=list)  # autocast matmuls with fp32 dW, db (narrow.py)
    dialects: list[str] = field(default_factory=list)  # choices made while compiling (backend.py)

    @property
    def active(self) -> list[Replaced]:
        return [r for r in self.replaced if not r.absorbed]

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(r.family for r in self.active))

    @property
    def by_pattern(self) -> dict[str, int]:
        return dict(Counter(r.pattern for r in self.active))


def select_patterns(patterns: Sequence[Pattern], families: Iterable[str] | None) -> tuple[Pattern, ...]:
    """The patterns of the chosen families (all for None), in stage order."""
    if families is not None:
        chosen = set(families)
        unknown = chosen - set(FAMILIES)
        if unknown:
            raise ValueError(f"trifuse.fuse: ops must name families among {list(FAMILIES)}, got {sorted(unknown)}")
        for fam in list(chosen):
            chosen.update(DEPENDS.get(fam, ()))
        patterns = [p for p in patterns if p.family in chosen]
    return tuple(sorted(patterns, key=lambda p: p.stage))


def rewrite(gm: fx.GraphModule, patterns: Sequence[Pattern] | None = None) -> RewriteLog:
    """Rewrites a canonical GraphModule (see normalize.py) in place and recompiles it."""
    if patterns is None:
        from ..patterns import PATTERNS

        patterns = PATTERNS
    log = rewrite_graph(gm.graph, select_patterns(patterns, None))
    recompile(gm)
    return log


# Reads whose value nobody uses can go before matching: pure, and a use outside a pattern would
# block it (WavLM's attention weights, returned by F.multi_head_attention_forward, indexed and
# broadcast, then dropped: Dynamo keeps the dead reads in its graph).
_PURE_METHODS = frozenset(("broadcast_to", "expand", "view", "reshape", "unsqueeze", "squeeze", "transpose",
                           "permute", "flatten", "contiguous", "size", "dim", "numel"))
_PURE_FUNCTIONS = frozenset((operator.getitem, torch.broadcast_to, torch.reshape, torch.unsqueeze,
                             torch.squeeze, torch.transpose, torch.permute, torch.flatten, torch.numel))


def _drop_dead_reads(graph: fx.Graph) -> None:
    """Erases getitem and view-like method nodes that have no users, and then those left unused:
    one pass from the output back suffices, as every user of a node comes after it."""
    for node in reversed(list(graph.nodes)):
        if node.users:
            continue
        if (node.op == "call_function" and _hashable(node.target) and node.target in _PURE_FUNCTIONS) or \
                (node.op == "call_method" and node.target in _PURE_METHODS):
            graph.erase_node(node)


def _under_functorch_transforms(graph: fx.Graph) -> set[fx.Node]:
    """The nodes Dynamo inlined from inside a torch.func transform (vmap, grad, jvp: between its
    `_*_increment_nesting` and `_*_decrement_nesting` calls; a higher-order scan's combine
    function, Mamba's `associative_scan`, runs under vmap). trifuse's ops have no batching rule,
    so nothing there is rewritten: it runs as written."""
    inside: set[fx.Node] = set()
    depth = 0
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name.endswith("_decrement_nesting"):
            depth = max(depth - 1, 0)
        if depth:
            inside.add(node)
        if name.endswith("_increment_nesting"):
            depth += 1
    return inside


def rewrite_graph(graph: fx.Graph, patterns: Sequence[Pattern]) -> RewriteLog:
    log = RewriteLog()
    _drop_dead_reads(graph)
    rejections: dict[fx.Node, list[Rejected]] = {}
    transformed = _under_functorch_transforms(graph)
    for pattern in patterns:
        missing = [name for name in pattern.ops if not available(name)]
        if missing:
            log.skipped[pattern.name] = f"op not available: trifuse.ops.{missing[0]}"
            continue
        cp = compile_pattern(pattern)
        for node in list(graph.nodes):
            if node.graph is not graph or _erased(node) or node in transformed or not cp.is_candidate(node):
                continue
            reason = _rewrite_at(graph, node, cp, log, rejections.get(node, []))
            if reason is not None and not pattern.quiet:
                rejections.setdefault(node, []).append(Rejected(
                    pattern.name, pattern.family, where([node]), node.name, reason))
    for node, rejected in rejections.items():
        if not _erased(node):
            log.rejected.extend(rejected)
    for source, dtype, k in drop_cast_backs(graph):
        event = _event_of(source)
        if event is not None:
            name = str(dtype).replace("torch.", "")
            read = "one autocast matmul reads it" if k == 1 else \
                f"only autocast's matmuls read it ({k}, a view each)"
            note = f"output in {name}: {read}"
            if "output cast back to torch.float32" in event.note:
                event.note = event.note.replace("output cast back to torch.float32", note, 1)
            else:  # another replacement's cast, absorbed here (GPT-2's written-out GeLU, then its bias)
                event.note = "; ".join(n for n in (event.note, note) if n)
    for node in narrow_norm_outputs(graph):
        event = node.meta.get("trifuse_event")
        if event is not None:
            dtype = str(out_dtype(node)).replace("torch.", "")
            k = readers(node)
            if full_y(node):
                note = f"y in {dtype} too, for the autocast matmul that reads it"
            else:
                note = f"y in {dtype}: only autocast's matmuls read it"
                note += f" ({k}, a view each)" if k > 1 else ""
            event.note = "; ".join(n for n in (event.note, note) if n)
    for node in graph.nodes:
        op = _OF_INTEREST.get(node.target) if node.op == "call_function" and _hashable(node.target) else None
        if op is not None:
            reasons = "; ".join(f"{r.pattern}: {r.reason}" for r in rejections.get(node, []))
            if node in transformed:
                reasons = "inside a torch.func transform (vmap, grad, jvp): trifuse's ops have no batching rule"
            log.left.append(Left(op, where([node]), node.name, reasons or _why_no_pattern(node, op)))
    return log


# Products that make attention scores (q @ kᵀ), in the canonical graph's spellings.
_PRODUCTS = frozenset((torch.matmul, operator.matmul, torch.bmm, torch.baddbmm, torch.einsum, torch.mm))


def _produced_by(node: fx.Node, targets: frozenset, hops: int = 8) -> bool:
    """Whether a call of one of `targets` lies at most `hops` nodes upstream of node."""
    seen, frontier = set(), [node]
    for _ in range(hops):
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen]
        seen.update(frontier)
        if any(a.op == "call_function" and _hashable(a.target) and a.target in targets for a in frontier):
            return True
    return False


def _unbiased_product(node: fx.Node) -> bool:
    """A Linear without bias or a bare matrix product."""
    if node.op != "call_function" or not _hashable(node.target):
        return False
    if node.target is F.linear:
        return _arg(node, 2, "bias", None) is None
    return node.target in _PRODUCTS


def _biased_product(node: fx.Node) -> bool:
    """A Linear with a bias, or addmm: what bias_gelu takes the bias of."""
    if node.op != "call_function" or not _hashable(node.target):
        return False
    return node.target is torch.addmm or node.target is F.linear and _arg(node, 2, "bias", None) is not None


def _describe(node: fx.Node) -> str:
    """A node's computation in a word for the report: `layer_norm`'s output, a placeholder."""
    if node.op in ("call_function", "call_method"):
        target = node.target
        name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
        return f"{name}'s output"
    return "the block's input" if node.op == "placeholder" else f"{node.op} {node.target}"


def _arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _why_no_pattern(node: fx.Node, op: str) -> str:
    """The reason shown for an op of interest that no pattern even tried: what it is, where that
    can be told from the graph (a p = 0 dropout, a router's softmax), so a user reading the report
    sees whether something was missed or there was nothing to fuse."""
    if op == "dropout":
        p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
        if isinstance(p, (int, float)) and p == 0:
            return "p = 0: the identity in PyTorch too (nothing to fuse)"
        if training is False:
            return "training=False: the identity (nothing to fuse)"
        return "no residual add takes its result (dropout_add fuses residual + dropout(x)): an activation's " \
               "or a sublayer's own dropout"
    if op == "gelu" and node.args and isinstance(node.args[0], fx.Node) and not _biased_product(node.args[0]):
        source = node.args[0]
        what = "a Linear without one" if _unbiased_product(source) else f"its input is {_describe(source)}"
        return f"no bias before it ({what}): a lone GeLU is one pass either way (bias_gelu fuses gelu(x + b))"
    if op == "softmax" and not _produced_by(node, _PRODUCTS):
        return "not over attention scores (no q @ kᵀ before it): a router's or a gate's softmax"
    if op == "sigmoid":
        return "not in an activation trifuse fuses (QuickGELU's x * sigmoid(1.702 x), a gated SiLU): a " \
               "router's or a gate's sigmoid, or another slope"
    return "no pattern matches it here"


def _rewrite_at(graph: fx.Graph, node: fx.Node, cp: Any, log: RewriteLog, earlier: list[Rejected]) -> str | None:
    """Rewrites the first acceptable match anchored at `node`; None when done, else why not.
    A larger pattern rejected here because the model needs one of its intermediate values (the
    logits it returns) is named in the replacement's note: the report says why it is not used."""
    first_reason = None
    for m in matches(cp, node):
        stand_ins = _shape_stand_ins(m)
        reason = stand_ins if isinstance(stand_ins, str) else _check(m)
        plan = None
        if reason is None:
            plan, reason = _plan(m)
        at_end = False
        if reason is None and plan is not None:
            reason = _placement_problem(graph, m, plan)
            if reason is not None:
                at_end_reason = _end_placement_problem(graph, m, plan, stand_ins)
                at_end = at_end_reason is None
                reason = None if at_end else f"{reason}; nor where it ends: {at_end_reason}"
        if reason is None and plan is not None:
            _splice(graph, m, plan, log, stand_ins, at_end)
            kept = [f"not {r.pattern}: {r.reason}" for r in earlier if "outside the pattern" in r.reason]
            log.replaced[-1].note = "; ".join([n for n in (log.replaced[-1].note, *kept) if n])
            return None
        first_reason = first_reason or reason
    return first_reason


_SHAPE_READERS = ("size", "dim", "numel")


def _shape_stand_ins(m: Match) -> dict[fx.Node, fx.Node] | str:
    """{intermediate: pattern input of the same shape} for the matched intermediates whose only
    users outside the pattern read their shape (`size()`, `dim()`, `numel()`), or why a use
    outside the pattern blocks the rewrite. A matched upcast of a pattern input read outside too
    (Wan's `h.float()`, its sum's and its norm's), or a fused norm of pattern inputs, is kept for
    those readers (`m.kept`)."""
    matched, outputs = set(m.nodes), set(m.outputs)
    inputs = [v for v in m.bindings().values() if isinstance(v, fx.Node) and v not in matched]
    stand_ins: dict[fx.Node, fx.Node] = {}
    for g in m.nodes:
        outside = [u for u in g.users if u not in matched]
        if g in outputs or not outside:
            continue
        kept_for_readers = _exact_cast_of_input(g, inputs) or \
            _norm_of_inputs(g, inputs) and _passes_after(g, matched) >= 2
        if kept_for_readers and any(not _reads_metadata(u, g) for u in outside):
            m.kept.add(g)
            continue
        value = example_value(g)
        reader = next((u for u in outside if not (u.op == "call_method" and u.target in _SHAPE_READERS)), None)
        same = None
        if reader is None and isinstance(value, torch.Tensor):
            same = next((i for i in inputs if isinstance(example_value(i), torch.Tensor)
                         and same_shape(example_value(i), value)), None)
        if same is None:
            return f"{g.name} is also used by {(reader or outside[0]).name}, outside the pattern"
        stand_ins[g] = same
    return stand_ins


def _norm_of_inputs(g: fx.Node, inputs: list[fx.Node]) -> bool:
    """g is a fused norm (an earlier pattern's) of pattern inputs alone: the replacement computes
    it again inside its own op, and g stays for its other readers (LTX-2's one norm, modulated
    per cross-attention direction: each modulation takes the norm in). Only where the pattern
    takes two or more passes over the norm's output (a product and a sum; `_passes_after`): the
    second read of the norm's input then costs less than the passes saved. After one pass alone
    (a residual add, a scale) the traffic would be the same, with a norm more to compute."""
    norms = _norm_ops()
    return (g.op == "call_function" and _hashable(g.target) and g.target in norms
            and all(n in inputs for n in g.all_input_nodes))


def _passes_after(g: fx.Node, matched: set[fx.Node]) -> int:
    """How many matched operations read g's value, directly or through one another."""
    seen: set[fx.Node] = set()
    stack = [u for u in g.users if u in matched]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(u for u in n.users if u in matched)
    return len(seen)


@functools.cache
def _norm_ops() -> frozenset:
    from .. import ops

    return frozenset(getattr(ops, name) for name in ("layer_norm", "rms_norm") if available(name))


def _reads_metadata(user: fx.Node, g: fx.Node) -> bool:
    return reads_only_metadata(user, g) or user.op == "call_method" and user.target in _SHAPE_READERS


def _exact_cast_of_input(g: fx.Node, inputs: list[fx.Node]) -> bool:
    """g is `x.to(dtype)` of a pattern input x to a float dtype at least as wide (exact, a copy
    or x itself), neither written in place: what the replacement computes from x is what the
    pattern computed from g. (Kept only for a reader of its values, never for its shape alone.)"""
    if not (g.op == "call_method" and g.target == "to" and len(g.args) == 2 and not g.kwargs
            and g.args[0] in inputs and isinstance(g.args[1], torch.dtype)):
        return False
    source = example_value(g.args[0])
    if not (isinstance(source, torch.Tensor) and source.is_floating_point() and g.args[1].is_floating_point
            and torch.promote_types(source.dtype, g.args[1]) == g.args[1]):
        return False
    return not any(writes_in_place(u) for n in (g, g.args[0]) for u in n.users)


def _check(m: Match) -> str | None:
    for g in m.nodes:
        if g.op == "call_function" and g.target is F.dropout and g.args[3] is True:
            return "in-place dropout"
    for f in m.pattern.filters:
        try:
            reason = f(m)
        except Exception as e:  # noqa: BLE001  (a filter's own bug rejects its match, not the graph's others)
            name = getattr(f, "__name__", type(f).__name__)
            return f"the check {name} failed on this match ({type(e).__name__}: {e})"
        if reason is not None:
            return reason
    return None


@dataclass
class _Plan:
    graph: fx.Graph  # the traced replacement
    inputs: dict[str, fx.Node]  # its placeholders' names -> the graph nodes they read
    values: dict[fx.Node, Any] | None  # example values of its nodes (None when unknown)
    casts: list[torch.dtype | None]  # per output: the dtype to cast back to, if it differs


def _plan(m: Match) -> tuple[_Plan | None, str | None]:
    bindings = m.bindings()
    # A mesh or placements that this torch cannot write into code reach the replacement as inputs.
    constants = {k: v for k, v in bindings.items() if not isinstance(v, fx.Node) and not holds_unprintable(v)}
    if m.pattern.derive is not None:
        derived = m.pattern.derive(m)
        if derived is None:
            return None, "a value the replacement needs is unknown (no example value)"
        constants.update(derived)
    nodes = {k for k in bindings if k not in constants}
    try:
        rgraph = trace_function(m.pattern.replacement, constants, nodes)
        sources = {**bindings, **resolve_from_local(rgraph, m)}
    except Exception as e:  # noqa: BLE001  (a replacement that cannot take these constants)
        return None, f"replacement does not trace with these constants: {type(e).__name__}: {e}"
    inputs = {n.target: sources[n.target] for n in rgraph.nodes if n.op == "placeholder"}
    values, reason = _evaluate(rgraph, {k: example_value(v) for k, v in inputs.items()})
    if reason is not None:
        return None, reason
    casts: list[torch.dtype | None] = []
    if values is not None:
        new_outputs = _outputs(rgraph)
        if len(new_outputs) != len(m.outputs):
            return None, f"replacement returns {len(new_outputs)} values, the pattern {len(m.outputs)}"
        for old, new in zip(m.outputs, new_outputs):
            before, after = example_value(old), values.get(new) if isinstance(new, fx.Node) else new
            if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor):
                if before.dim() != after.dim() or not all(
                    _maybe_equal(a, b) for a, b in zip(before.shape, after.shape)):
                    return None, f"replacement gives shape {tuple(after.shape)} for {old.name}, not {tuple(before.shape)}"
                casts.append(before.dtype if before.dtype != after.dtype else None)
            else:
                casts.append(None)
    else:
        casts = [None] * len(m.outputs)
    return _Plan(rgraph, inputs, values, casts), None


def _evaluate(rgraph: fx.Graph, inputs: dict[str, Any]) -> tuple[dict[fx.Node, Any] | None, str | None]:
    """Runs the replacement on fake example values: its ops' checks, output shapes and dtypes."""
    inputs = {k: _hint(v) for k, v in inputs.items()}
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    if any(v is None for v in inputs.values()) or not tensors:
        return None, None
    modes = {id(t.fake_mode): t.fake_mode for t in tensors if isinstance(t, FakeTensor)}
    if len(modes) != 1:
        return None, None
    fake_mode = next(iter(modes.values()))
    inputs = {k: fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) else v
              for k, v in inputs.items()}
    env: dict[fx.Node, Any] = {}
    try:
        with fake_mode, _no_guards(fake_mode):
            for n in rgraph.nodes:
                if n.op == "placeholder":
                    env[n] = inputs[n.target]
                elif n.op in ("call_function", "call_method"):
                    args = fx.map_arg(n.args, env.__getitem__)
                    kwargs = fx.map_arg(n.kwargs, env.__getitem__)
                    if n.op == "call_function":
                        env[n] = n.target(*args, **kwargs)
                    else:
                        env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as e:
        return None, f"the fused op rejects these inputs: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    finally:
        torch.clear_autocast_cache()  # no fake casts kept for the autocast region (capture.py, _propagate_fake)
    return env, None


def _hint(v: Any) -> Any:
    """A symbolic scalar's example value (the ops' checks want a number), None when unknown."""
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        hint = v.node.hint
        return None if hint is None else hint
    return v


class _no_guards:
    """Suppresses guard creation on a symbolic-shape env while replacements are checked."""

    def __init__(self, fake_mode: Any) -> None:
        env = getattr(fake_mode, "shape_env", None)
        self._ctx = env.suppress_guards() if env is not None else None

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def _maybe_equal(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b)) or str(a) == str(b)
    except Exception:  # noqa: BLE001  (symbolic comparison unavailable: do not block on it)
        return True


def _closure(nodes: Iterable[fx.Node], order: dict[fx.Node, int], first: int) -> set[fx.Node]:
    """`nodes` at or after position `first`, with their inputs at or after it (all movable)."""
    out: set[fx.Node] = set()
    stack = [n for n in nodes if order[n] >= first]
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack.extend(i for i in n.all_input_nodes if order[i] >= first)
    return out


def _outputs(rgraph: fx.Graph) -> list[Any]:
    out = next(n for n in rgraph.nodes if n.op == "output").args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _placement_problem(graph: fx.Graph, m: Match, plan: _Plan) -> str | None:
    """Why the replacement cannot go before the first matched node, where it goes (None when it
    can): every input must be (or be movable to) before it, and none may be written in place after
    it. fx reads parameters where they are used, and shape arithmetic sits wherever it was
    written; both move up, as long as they depend on nothing matched. A tensor filled in place
    (RecurrentGemma's `out = zeros_like(x)` then `out[:, t] = ...` in a loop) is one graph node
    from its creation on: moved up, the replacement would read it before the writes."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(order[n] for n in m.nodes)
    matched = set(m.nodes)
    seen: set[fx.Node] = set()

    def movable(node: fx.Node) -> bool:
        if order[node] < first or node in seen:
            return True
        if node in matched or node.op in ("placeholder", "output") or node.is_impure():
            return False
        seen.add(node)
        return all(movable(n) for n in node.all_input_nodes)

    inputs = [n for n in plan.inputs.values() if isinstance(n, fx.Node)]
    if not all(movable(n) for n in inputs):
        return "an input of the replacement is computed after the pattern starts"
    # What moves up reads what it read where it was: neither an input nor anything a moved node
    # reads may be written after the pattern starts (torchvision's Swin fills its window mask by
    # `mask[h, w] = i` between the scores and the mask's add; moved up, the mask read zeros).
    # (A write that moves up with them keeps its place among them: DeBERTa's `pos_query_layer /= s`.)
    # A write to the tensor an input is a view of, or to another view of it, counts too.
    read = [*inputs, *sorted({i for n in seen for i in (n, *n.all_input_nodes)}, key=order.__getitem__)]
    written = next((n for n in read if _written_after(_alias_root(n), first, order, seen)), None)
    if written is not None:
        return f"{written.name} is written in place after the pattern starts"
    return None


_FACTORIES = ("new_full", "new_zeros", "new_ones", "new_empty")


def _factories_at_the_start(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """A replacement's constant tensor made on a value's device (`x.new_full(shape, v, dtype=d)`,
    the scale of an L2 norm made an RMSNorm: patterns/layer_norm.py), made instead on the device
    of the graph's first input on that device, after the inputs: it then reads no value a later
    pattern could take in (the sum a residual stream adds before the norm)."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    for n in nodes:
        if not (n.op == "call_method" and n.target in _FACTORIES and "dtype" in n.kwargs
                and len(n.all_input_nodes) == 1 and isinstance(n.args[0], fx.Node)):
            continue
        value = example_value(n.args[0])
        if not isinstance(value, torch.Tensor):
            continue
        # (of the same type too: a DTensor's factory makes a DTensor, a plain tensor's a tensor)
        first = next((i for i in inputs if type(example_value(i)) is type(value)
                      and example_value(i).device == value.device), None)
        if first is not None:
            n.replace_input_with(n.args[0], first)
            inputs[-1].append(n)


def _end_placement_problem(graph: fx.Graph, m: Match, plan: _Plan,
                           stand_ins: dict[fx.Node, fx.Node]) -> str | None:
    """Why the replacement cannot go right after the last matched node instead, or None. There it
    reads its inputs as they are at the pattern's end, so none may be written in place between its
    first read by a matched node and that end (writes before that first read the pattern saw too:
    torchvision's Swin fills its window mask by `mask[h, w] = i` after the scores, then adds it;
    RecurrentGemma fills the scan's output before gating it). Nothing moves, so every input must
    already come before the end, and no node outside the pattern may use an output before it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    matched = set(m.nodes)
    last = max(order[n] for n in matched)
    for x in (n for n in plan.inputs.values() if isinstance(n, fx.Node)):
        if order[x] > last:
            return f"{x.name}, an input of the replacement, comes after the pattern ends"
        first_read = min((order[u] for u in x.users if u in matched), default=last)
        if _written_after(_alias_root(x), first_read, order, until=last):  # x, its base, any view of it
            return f"{x.name} is written in place while the pattern reads it"
    for out in m.outputs:
        early = next((u for u in out.users if u not in matched and order[u] < last), None)
        if early is not None:
            return f"{out.name} is used by {early.name} before the pattern ends"
    for old, same in stand_ins.items():
        early = next((u for u in old.users if u not in matched and order[u] < order[same]), None)
        if early is not None:
            return f"{early.name} reads the shape of {old.name} before {same.name} exists"
    return None


# Calls whose result may share memory with their first argument: a write through it writes that.
_ALIASING = {"view", "view_as", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "expand_as",
             "flatten", "unflatten", "narrow", "select", "as_strided", "t", "split", "chunk", "unbind", "contiguous",
             "detach", "to", "type", "float", "getitem", "movedim", "swapaxes", "diagonal", "unfold", "real", "imag"}


def _view_of(node: fx.Node) -> fx.Node | None:
    """The node whose memory `node`'s result may share (an _ALIASING call's first argument), or None."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    if not isinstance(node.args[0], fx.Node):
        return None
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.args[0] if name in _ALIASING else None


def _alias_root(node: fx.Node) -> fx.Node:
    """The tensor `node` is a view of (through _ALIASING calls), or `node` itself."""
    while (base := _view_of(node)) is not None:
        node = base
    return node


def _written_after(node: fx.Node, position: int, order: dict[fx.Node, int],
                   moving: set[fx.Node] = frozenset(), until: int | None = None) -> bool:
    """Whether `node`, or a view of it, is written in place by a node after `position` (and
    before `until`, when given), other than the nodes `moving` up before it."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            at = order.get(user, -1)
            in_span = position < at and (until is None or at < until)
            if writes_in_place(user) and in_span and user not in moving:
                return True
            if _view_of(user) is n:
                stack.append(user)
    return False


def _event_of(node: fx.Node):
    """The Replaced event of the trifuse op whose output `node` is (the op, or an item of it)."""
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return node.meta.get("trifuse_event") if isinstance(node, fx.Node) else None


def _splice(graph: fx.Graph, m: Match, plan: _Plan, log: RewriteLog,
            stand_ins: dict[fx.Node, fx.Node], at_end: bool = False) -> None:
    """Puts the replacement where the pattern starts (its late inputs moved up before it), or with
    `at_end` right after the last matched node (`_end_placement_problem`)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    matched = sorted(m.nodes, key=order.__getitem__)
    first = matched[0]
    if not at_end:
        inputs = [n for n in plan.inputs.values() if isinstance(n, fx.Node)]  # not a mesh or placements
        late = [n for n in _closure(inputs, order, order[first])]
        for node in sorted(late, key=order.__getitem__):
            first.prepend(node)
    meta = {k: m.anchor.meta[k] for k in ("nn_module_stack", "stack_trace") if k in m.anchor.meta}
    env: dict[fx.Node, Any] = {}
    new_nodes = []
    with graph.inserting_before(matched[-1].next if at_end else first):
        for n in plan.graph.nodes:
            if n.op == "placeholder":
                env[n] = plan.inputs[n.target]
            elif n.op in ("call_function", "call_method"):
                new = graph.node_copy(n, lambda a: env[a])
                new.meta.update(meta)
                if plan.values is not None and n in plan.values:
                    new.meta["example_value"] = new.meta["val"] = plan.values[n]
                canonicalize_node(new)
                env[n] = new
                new_nodes.append(new)
        outputs = [env[o] if isinstance(o, fx.Node) else o for o in _outputs(plan.graph)]
        for i, dtype in enumerate(plan.casts):
            if dtype is not None:
                cast = graph.call_method("to", (outputs[i], dtype))
                cast.meta.update(meta)
                cast.meta["trifuse_cast_back"] = True  # narrow.drop_cast_backs may take it out again
                value = example_value(outputs[i])
                if isinstance(value, torch.Tensor):
                    cast.meta["example_value"] = cast.meta["val"] = value.to(dtype)
                outputs[i] = cast
                new_nodes.append(cast)
    _factories_at_the_start(graph, new_nodes)
    placed = where(matched)
    notes = [f"output cast back to {d}" for d in plan.casts if d is not None]
    if at_end:
        notes.append("placed where the pattern ends: an input is written in place after it starts")
    event = Replaced(m.pattern.name, m.pattern.family, placed, "", note=", ".join(notes))
    events = [event]
    calls = [new for new in new_nodes
             if new.op == "call_function" and getattr(new.target, "__module__", "").startswith("trifuse.")]
    if m.pattern.call_families is not None:  # an event per call, each counted in its own family
        assert len(calls) == len(m.pattern.call_families), (m.pattern.name, calls)
        events = [Replaced(m.pattern.name, family, placed, "", note=event.note) for family in m.pattern.call_families]
        for new, call_event in zip(calls, events):
            new.meta["trifuse_event"] = call_event
            call_event.node = new.name
    else:
        for new in calls:
            new.meta["trifuse_event"] = event
            event.node = event.node or new.name
    for old, new in zip(m.outputs, outputs):
        old.replace_all_uses_with(new)
    for old, same in stand_ins.items():
        for user in [u for u in old.users if u not in m.nodes]:
            user.replace_input_with(old, same)
    for node in reversed(matched):
        if not node.users:
            absorbed = node.meta.get("trifuse_event")
            if absorbed is not None:
                absorbed.absorbed = True
                for new_event in events:
                    new_event.where = _join_where(absorbed.where, new_event.where)
                    if m.pattern.folds and absorbed.family == new_event.family:
                        spelled = absorbed.note or f"spelled as {absorbed.pattern}"
                        folds = m.pattern.folds
                        notes = (spelled, folds if " " in folds else f"{folds} folded in", new_event.note)
                        new_event.note = "; ".join(n for n in notes if n)
            graph.erase_node(node)
    # What the model does not use of the replacement (the sum a post-norm block drops, brought
    # back to a local tensor) goes, unless it has side effects.
    for new in reversed(new_nodes):
        if not new.users and not new.is_impure():
            graph.erase_node(new)
    log.replaced.extend(events)


_STACK_PREFIX = re.compile(r"^L\['[^']*'\](?:\[\d+\])?\.?")
# A submodule Dynamo reached through the module's dict (diffusers' Transformer2DModel iterates
# `self.transformer_blocks` so): `a.__dict__['_modules']['blocks'].0` is the submodule `a.blocks.0`.
_MODULES_ENTRY = re.compile(r"(^|\.)(?:__dict__\['_modules'\]|_modules)\['([^']+)'\]")


def module_path(node: fx.Node) -> str:
    """The submodule a node's code ran in, relative to the captured module ('' for itself), as
    named_modules() names it."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _MODULES_ENTRY.sub(r"\1\2", _STACK_PREFIX.sub("", str(path)))


def _join_where(a: str, b: str) -> str:
    parts = [p for w in (a, b) for p in w.split(", ") if p != "(the module itself)"]
    return ", ".join(dict.fromkeys(parts)) or "(the module itself)"


def where(nodes: Iterable[fx.Node]) -> str:
    paths: list[str] = []
    for n in nodes:
        p = module_path(n)
        if p and p not in paths:
            paths.append(p)
    return ", ".join(paths) or "(the module itself)"


def _erased(node: fx.Node) -> bool:
    return getattr(node, "_erased", False)


def _hashable(target: Any) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True


