"""Capturing a module's forward as a graph, rewriting it, and running the rewrite in its place.

A *unit* is what `fuse` installs: the instance attribute `module.forward`, a bound method that
runs the rewritten graph (STYLE.md fact 11: the class, its methods, the Parameter objects and the
state_dict keys stay as they were; `module.train()`, hooks and `copy.deepcopy` keep working).
Two kinds:

- `DynamoUnit`, one per block class (the modules repeated in a ModuleList that fx cannot trace):
  the class's forward compiled by TorchDynamo with a backend that canonicalizes, rewrites and
  returns the graph to run eagerly. One capture serves every identical layer; Dynamo's guards
  recapture when train/eval, grad mode, autocast, dtypes or (once, then symbolically) shapes
  change. Each unit compiles its own copy of the forward's code object, so its recompile budget
  (Dynamo's limit of 8 per code object) is its own, not shared with other fused models or with
  the user's torch.compile.
- `FxUnit`, for a module `torch.fx.symbolic_trace` can trace: traced on the first call for each
  *key* (the arguments' dtypes, devices and ranks, the non-tensor arguments' values, the training
  flags of the module tree, grad mode and autocast), with the non-tensor arguments as constants
  (fx would otherwise take `if mask is not None` as true for every call), shape-propagated on fake
  tensors, rewritten, and cached per key. The generated code reads parameters through the live
  module, so `.to()`, `load_state_dict` and parameter swaps are seen.

Never break a model: a call that a capture cannot take (a KV cache or any other object argument,
which would make Dynamo guard on per-layer state and recompile for every layer; a trace that
fails) runs the original forward, and every such call is counted with its reason. A Dynamo call
that ran no graph of ours (Dynamo fell back to eager: recompile limit, skipped frame) is counted
as a fallback. `trifuse.report(model)` shows all of it.
"""
import collections
import contextvars
import functools
import inspect
import itertools
import logging
import operator
import sys
import types
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from ..kernels._common import is_fx_tracing
from ..patterns._base import Pattern, example_value
from .dtensor_calls import recompile
from .graphs import BlockGraphs
from .narrow import fp32_weight_grads, share_input_casts
from .normalize import baked_attributes, canonicalize, global_hooks, has_hooks
from .outputs import collecting_attentions, collector_active, collector_restore, collector_to_global
from .rewriter import RewriteLog, rewrite_graph

_log = logging.getLogger("trifuse")

_SIMPLE = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass(eq=False)
class Capture:
    """One captured and rewritten graph set: for a unit, in one mode (or one graph compiled by
    a torch.compile backend)."""

    mode: str
    graphs: int = 0
    log: RewriteLog = field(default_factory=RewriteLog)
    error: str | None = None  # the rewrite failed: the graph runs as captured, unfused
    frame: int | None = None  # Dynamo's frame id, for backend captures
    serial: int = field(default_factory=lambda: next(_SERIAL))
    # Backend captures (backend.counted): the sequence numbers of the graph's recent runs, and per
    # parameter the graph took first (a module it ran for: id -> its latest run), from which the
    # report tells what ran in a model's latest forward, and how many times.
    runs: list[int] = field(default_factory=list)
    runs_for: dict[int, list] = field(default_factory=dict)  # id -> [latest run, weakref]
    # Dynamo's graph breaks while this was captured: what runs between its graphs runs as written
    # (a frame with a break inside a loop runs unfused whole: Mochi's per-sample attention).
    graph_breaks: list[str] = field(default_factory=list)


_SERIAL = itertools.count()
_BREAKS_SEEN: dict[str, int] = {}  # Dynamo's graph-break counts at the latest capture


def _new_graph_breaks() -> list[str]:
    """The graph breaks Dynamo counted since the previous call (process-wide: at a capture's
    compile they are the ones on the way to its graph), each as its reason and explanation."""
    counts = torch._dynamo.utils.counters["graph_break"]
    if any(counts.get(reason, 0) < n for reason, n in _BREAKS_SEEN.items()):
        _BREAKS_SEEN.clear()  # the counters were cleared (torch._dynamo.reset() in a test, say)
    new = [reason for reason, n in counts.items() if n > _BREAKS_SEEN.get(reason, 0)]
    _BREAKS_SEEN.clear()
    _BREAKS_SEEN.update(counts)
    described = []
    for reason in new:
        lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
        why = next((line.removeprefix("Explanation:").strip() for line in lines[1:]
                    if line.startswith("Explanation:")), "")
        described.append(f"{lines[0] if lines else reason}{': ' + why if why else ''}"[:300])
    return described


class Unit:
    """What `fuse` installed on one module class (Dynamo) or one module (fx)."""

    strategy = ""

    def __init__(self, cls: type, patterns: Sequence[Pattern], verbose: bool) -> None:
        self.cls = cls
        self.patterns = tuple(patterns)
        self.verbose = verbose
        self.original = cls.forward
        self.paths: list[str] = []
        self.captures: list[Capture] = []
        self.eager_calls: Counter[str] = Counter()
        self.fallbacks = 0
        self.calls = 0
        self.last: weakref.WeakKeyDictionary[torch.nn.Module, Capture | None] = weakref.WeakKeyDictionary()
        self.outside_traces = 0  # traces by a torch.compile or torch.export of the model (_installed_forward)
        forward = _installed_forward(self)
        self.forward = forward

    def install(self, module: torch.nn.Module, path: str, attribute: str = "forward") -> None:
        """Binds the unit's forward to `module` as its instance `forward`, or as `attribute`: the
        `_old_forward` that accelerate's hook wrapper (in `forward`) calls (`wrapped_by_accelerate`)."""
        self.paths.append(path)
        bind_forward(module, attribute, self.forward)

    def _named_reason(self, args: tuple, kwargs: dict, reason: str) -> str:
        """'argument 1 is a DynamicCache' -> 'argument past_key_values is a DynamicCache (...)'."""
        try:
            names = list(inspect.signature(self.original).parameters)[1:]
        except (TypeError, ValueError):
            names = []
        for i, name in enumerate(names[: len(args)]):
            reason = reason.replace(f"argument {i} is", f"argument {name} is")
        if "Cache" in reason:
            reason += (" (per-layer state: a capture would recompile for every layer; call with use_cache=False to "
                       "train fused, unless the model makes one regardless, as XLM's does)")
        return reason

    def host_time_hidden(self) -> bool:
        """True when this unit's training calls replay from CUDA graphs, where the host path of
        an op costs nothing per step: rewrites that trade host time for GPU time (the autocast
        matmuls' fp32 weight gradients, an autograd.Function of Python each) apply there alone.
        An ungraphed fused step is host-bound on the lent GPU, and CPU calls gain nothing."""
        return False

    def _before_rewrite(self, graph: fx.Graph) -> None:
        """Changes the canonical graph before the patterns run, where only this kind of unit may."""

    def _annotate(self, graph: fx.Graph, log: RewriteLog) -> None:
        """Adds to the notes of this rewrite's replacements what only this kind of unit knows."""

    def _eager(self, module: torch.nn.Module, args: tuple, kwargs: dict, reason: str) -> Any:
        self.eager_calls[reason] += 1
        self.last[module] = None
        return self.original(module, *args, **kwargs)

    def _new_capture(self, mode: str) -> Capture:
        capture = Capture(mode)
        self.captures.append(capture)
        return capture

    def _rewrite(
        self, gm: fx.GraphModule, capture: Capture, root: torch.nn.Module | None
    ) -> tuple[fx.GraphModule, RewriteLog]:
        """Canonicalizes and rewrites a copy of `gm`, and returns it with this graph's own part of
        the capture's log; on failure returns `gm` untouched and an empty log."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        work = fx.GraphModule(gm, graph)
        try:
            canonicalize(work, root)
            bodies = checkpoint_bodies(work)
            self._before_rewrite(work.graph)
            log = rewrite_graph(work.graph, self.patterns)
            for value, readers, dtype in share_input_casts(work.graph):
                name = value.name.removeprefix("l_").rstrip("_")
                name = f"input {name}" if value.op == "placeholder" else value.name
                log.shared_casts.append(f"{name}: read by {readers} autocast matmuls, cast to "
                                        f"{str(dtype).removeprefix('torch.')} once (a view each)")
            fp32_grads = fp32_weight_grads(work.graph) if self.host_time_hidden() else []
            for node, dtype in fp32_grads:
                text = f"{str(dtype).removeprefix('torch.')} GEMM, its fp32 gradient from the GEMM itself"
                log.fp32_weight_grads.append(f"{_parameter_name(node.args[1])}: {text} (no conversion kernel)")
            rewrite_checkpoints(work, self.patterns, log, bodies)
            self._annotate(work.graph, log)
            recompile(work)
        except Exception as e:  # noqa: BLE001  (never break a model: run the capture unfused)
            capture.error = f"{type(e).__name__}: {e}"
            return gm, RewriteLog()
        _merge(capture.log, log)
        capture.graphs += 1
        if self.verbose:
            from .report import capture_table

            print(capture_table(self, capture))
        return work, log


_peek_functorch = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None)


def function_transform() -> str | None:
    """Why a call must run as the model wrote it, when it must: inside a torch.func transform
    (`grad`, `vmap`, `jvp`, `jacrev`: per-sample gradients, JVP-based losses) or under forward-mode
    AD, which trifuse's ops do not implement (their autograd Functions have no vmap or jvp rule),
    or under `torch.jit.trace`."""
    if _peek_functorch() is not None:
        return "inside a torch.func transform (grad, vmap, jvp, ...), which trifuse's ops do not implement"
    if torch.autograd.forward_ad._current_level >= 0:
        return "under forward-mode AD (a dual level is open), which trifuse's ops do not implement"
    if torch._C._get_tracing_state() is not None:
        # Dynamo refuses to run under the tracer; the traced module stays portable without trifuse
        return "under torch.jit.trace, which records the model's own ops"
    return None


def bind_forward(module: torch.nn.Module, attribute: str, function: Callable[..., Any]) -> None:
    """Sets `function`, bound to `module`, as its instance `attribute` ("forward", or accelerate's
    "_old_forward"), and makes nn.DataParallel's replicas of `module` bind it to themselves."""
    setattr(module, attribute, types.MethodType(function, module))
    module.__dict__["_replicate_for_data_parallel"] = types.MethodType(_replicate_for_data_parallel, module)


def _replicate_for_data_parallel(module: torch.nn.Module) -> torch.nn.Module:
    """nn.DataParallel's replica of a fused module (`replicate` calls this for every module at each
    forward; Hugging Face's Trainer wraps a model in DataParallel when it sees several GPUs without
    a distributed launch). The class's own replica copies the module's `__dict__`, and with it the
    fused forward bound to `module`: it would run on the original's parameters, on the first GPU.
    The replica gets the fused forward bound to itself, as the class's forward would be. (Named
    as the method it stands in for: a pickled model stores a bound method as `getattr(module,
    name)`, which then finds the class's.)"""
    replica = type(module)._replicate_for_data_parallel(module)
    del replica.__dict__["_replicate_for_data_parallel"]  # a replica is not replicated again
    for attribute in ("forward", "_old_forward"):
        bound = replica.__dict__.get(attribute)
        if isinstance(bound, types.MethodType) and bound.__self__ is module:
            replica.__dict__[attribute] = types.MethodType(bound.__func__, replica)
    return replica


# Dynamo calls a function so marked while it traces and bakes in what it returns: its body runs
# once per trace, never in the compiled code.
_at_trace_time = (getattr(torch.compiler, "assume_constant_result", None)
                  or torch._dynamo.assume_constant_result)


OUTSIDE_TRACE_MESSAGE = (
    "trifuse: torch.compile (or torch.export) is tracing a model fused by trifuse.fuse, and sees the fused "
    "modules' code as the model wrote it. With backend='trifuse' or 'trifuse_inductor' the compile rewrites "
    "that code itself; with any other backend trifuse's kernels do not run in the compiled model. Run the "
    "fused model as it is, or compile the model with one of trifuse's backends (no fuse needed); "
    "trifuse.report(model) names the modules traced.")
_warned_outside_trace = False


def _installed_forward(unit: Unit) -> Callable[..., Any]:
    @_at_trace_time
    def traced_from_outside() -> bool:
        # A trace of the model by someone else (a unit's own capture has _CALLING set): counted for
        # the report (once per trace Dynamo makes, restarts included), and said once
        global _warned_outside_trace
        if _CALLING.get() is None:
            unit.outside_traces += 1
            if not _warned_outside_trace:  # once a process: the report has the rest
                _warned_outside_trace = True
                warnings.warn(OUTSIDE_TRACE_MESSAGE, UserWarning)
        return True

    @functools.wraps(unit.original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0 or is_fx_tracing():
            # Someone compiles or fake-traces a model containing this module, or fx traces its
            # parent, which called `layer.forward(...)` where fx looks for `layer(...)` (a leaf
            # call): show them the original code. Not a call of this unit: fx records the ops
            # into the parent's graph, which is fused as a whole.
            if torch.compiler.is_compiling():
                traced_from_outside()
            return unit.original(self, *args, **kwargs)
        transform = function_transform()
        if transform is not None:
            return unit._eager(self, args, kwargs, transform)
        return unit(self, args, kwargs)

    forward.__trifuse_unit__ = unit  # type: ignore[attr-defined]
    return forward


def installed_unit(module: torch.nn.Module) -> Unit | None:
    for attribute in ("forward", "_old_forward"):  # the second: inside accelerate's hook wrapper
        fwd = module.__dict__.get(attribute)
        unit = getattr(getattr(fwd, "__func__", None), "__trifuse_unit__", None)
        if unit is not None:
            return unit
    return None


def wrapped_by_accelerate(module: torch.nn.Module) -> bool:
    """Whether `module.forward` is accelerate's hook wrapper (`add_hook_to_module`: device_map
    dispatch over several devices, CPU or disk offload), which runs the hook's pre_forward (inputs
    and offloaded weights moved to the execution device), then `module._old_forward`, then its
    post_forward. A fused forward goes in as `_old_forward`, inside the hook."""
    return "forward" in module.__dict__ and "_old_forward" in module.__dict__ and hasattr(module, "_hf_hook")


def _holds_units(module: torch.nn.Module) -> bool:
    """Whether a unit is installed below `module` (its blocks, when it is a model): a Dynamo
    capture of it would trace into their own captures."""
    return any(installed_unit(m) is not None for m in module.modules() if m is not module)


def _hop_bodies(gm: fx.GraphModule, hop: Any) -> list[fx.GraphModule]:
    """The bodies of `gm`'s activation checkpoints (`hop` calls), nested ones included, each
    replaced by a copy of its own so that the captured graph stays untouched."""
    bodies = []
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        body = getattr(gm, node.target, None)
        if not isinstance(body, fx.GraphModule) or not node.users or \
                not all(u.op == "call_function" and u.target is hop and u.args[0] is node for u in node.users):
            continue
        graph = fx.Graph()
        graph.output(graph.graph_copy(body.graph, {}))
        own = fx.GraphModule(body, graph)
        own.meta.update(body.meta)
        setattr(gm, node.target, own)
        bodies += [own, *_hop_bodies(own, hop)]
    return bodies


def checkpoint_bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The bodies of `gm`'s activation checkpoints (see rewrite_checkpoints), each made a copy of
    its own (nested ones included) and canonicalized: what the rewrite may change before the
    patterns run (a block's unread outputs, DynamoUnit._before_rewrite)."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    if hop is None:
        return []
    bodies = _hop_bodies(gm, hop)
    for body in bodies:
        canonicalize(body)
    return bodies


def checkpointed_output(value: fx.Node) -> tuple[fx.GraphModule, int] | None:
    """For `value` = `getitem(tag_activation_checkpoint(body, ...), i)` in a graph module, the
    body and i, where the body returns a flat tuple; else None."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    if value.op != "call_function" or value.target is not operator.getitem or len(value.args) != 2:
        return None
    call, index = value.args
    if not (isinstance(call, fx.Node) and call.op == "call_function" and call.target is hop
            and isinstance(index, int) and call.args and isinstance(call.args[0], fx.Node)
            and call.args[0].op == "get_attr"):
        return None
    body = getattr(value.graph.owning_module, call.args[0].target, None)
    if not isinstance(body, fx.GraphModule):
        return None
    returned = _output(body.graph).args[0]
    if not isinstance(returned, (tuple, list)) or not -len(returned) <= index < len(returned):
        return None
    return body, index % len(returned)


def rewrite_checkpoints(gm: fx.GraphModule, patterns: Sequence[Pattern], log: RewriteLog,
                        bodies: list[fx.GraphModule] | None = None) -> None:
    """For a graph run as it is (not compiled by Inductor): the bodies of its activation
    checkpoints are rewritten too, and each checkpoint calls `_checkpoint`. `bodies`: what
    `checkpoint_bodies(gm)` returned, when the caller needed them before; by default taken here.

    Dynamo puts a block called under activation checkpointing (Hugging Face's gradient
    checkpointing) into `tag_activation_checkpoint(body, ...)`. Only those bodies are rewritten:
    other higher-order ops (an autograd.Function's forward and backward, cond) have contracts of
    their own. The op's own eager path checkpoints with preserve_rng_state=False (Inductor
    restores the RNG state its own way), so its recompute in the backward would draw other
    dropout masks than the forward did: wrong gradients."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    if hop is None:
        return
    bodies = checkpoint_bodies(gm) if bodies is None else bodies
    for body in bodies:
        _merge(log, rewrite_graph(body.graph, patterns))
    for module in gm.modules():  # checkpoints anywhere, inside other higher-order ops too
        if not isinstance(module, fx.GraphModule):
            continue
        calls = [n for n in module.graph.nodes if n.op == "call_function" and n.target is hop]
        for node in calls:
            node.target = _checkpoint
        if calls or module in bodies:
            recompile(module)


def _checkpoint(body: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """torch.utils.checkpoint of a captured body, with the options the model passed (Hugging Face:
    use_reentrant=False, preserve_rng_state left at its default, True).

    Dynamo lifts what the body reads into its arguments: the parameters, and buffers a
    training step changes in place (BatchNorm's running statistics and `num_batches_tracked`,
    SwiftFormer's). A checkpoint saves its arguments and checks at the recompute that none
    changed since, which failed every backward. Eager checkpointing reads those as module
    attributes, not as arguments: tensors that need no gradient are held here likewise, and only
    the others are the checkpoint's arguments (the RNG state's device found among them)."""
    kwargs.setdefault("use_reentrant", False)
    context_fn = body.meta.get("_checkpoint_context_fn")
    if context_fn is not None:
        kwargs.setdefault("context_fn", context_fn)
    held = [isinstance(a, torch.Tensor) and not a.requires_grad for a in args]
    passed = [a for a, h in zip(args, held) if not h]
    if not any(held) or not any(isinstance(a, torch.Tensor) for a in passed):
        return checkpoint(body, *args, **kwargs)

    def run(*given: Any) -> Any:
        it = iter(given)
        return body(*(a if h else next(it) for a, h in zip(args, held)))

    return checkpoint(run, *passed, **kwargs)


def _output(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def _set_returned(body: fx.GraphModule, index: int, value: fx.Node | None) -> None:
    """Puts `value` at `index` of the flat tuple (or list) a checkpoint's body returns."""
    output = _output(body.graph)
    returned = list(output.args[0])
    returned[index] = value
    output.args = (type(output.args[0])(returned),)


def _parameter_name(node: fx.Node) -> str:
    """A parameter's name in the captured module ("attn.c_proj.weight") from its graph input
    (Dynamo names it after its source, `L['self']._modules['attn']..._parameters['weight']`) or
    its get_attr; other nodes by their own name."""
    if node.op == "get_attr":
        return str(node.target)
    name = node.name.removeprefix("l_").rstrip("_")
    if "_parameters_" not in name or "modules_" not in name:
        return name
    name = name.split("modules_", 1)[1]
    return name.replace("_modules_", ".").replace("_parameters_", ".")


def _merge(into: RewriteLog, log: RewriteLog) -> None:
    into.replaced.extend(log.replaced)
    into.rejected.extend(log.rejected)
    into.left.extend(log.left)
    into.skipped.update(log.skipped)
    into.shared_casts.extend(log.shared_casts)
    into.fp32_weight_grads.extend(log.fp32_weight_grads)
    into.dialects.extend(log.dialects)


def unsupported_argument(args: tuple, kwargs: dict, *, containers: bool = True) -> str | None:
    """Why these arguments cannot go through a capture (None when they can)."""
    for i, v in enumerate(args):
        why = _unsupported(v, containers)
        if why:
            return f"argument {i} is {why}"
    for k, v in kwargs.items():
        why = _unsupported(v, containers)
        if why:
            return f"argument {k} is {why}"
    return None


def _unsupported(v: Any, containers: bool) -> str | None:
    if isinstance(v, torch.Tensor):
        # A nested tensor (nn.TransformerEncoder's eval fast path hands its layers one) made Dynamo
        # skip the block's frame for good: every later call, training ones too, ran unfused.
        if v.is_nested:
            return "a nested tensor (nn.TransformerEncoder's fast path, in eval without grad)"
        return None if v.layout == torch.strided else f"a tensor of layout {v.layout}"
    if isinstance(v, _SIMPLE):
        return None
    if containers and type(v) in (tuple, list, torch.Size):  # BEiT passes its patch grid as a torch.Size
        return next((w for w in (_unsupported(x, containers) for x in v) if w), None)
    if containers and (type(v) is dict or isinstance(v, collections.UserDict)):
        return next((w for w in (_unsupported(x, containers) for x in v.values()) if w), None)
    return f"a {type(v).__name__}"


def describe_mode(module: torch.nn.Module, tensors: Sequence[torch.Tensor]) -> str:
    parts = ["train" if module.training else "eval", "grad" if torch.is_grad_enabled() else "no_grad"]
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            parts.append(f"autocast {device} {str(torch.get_autocast_dtype(device)).replace('torch.', '')}")
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors if t.is_floating_point()})
    if dtypes:
        parts.append("/".join(dtypes))
    return ", ".join(parts)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


# =============================================================================================
# Dynamo
# =============================================================================================


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a fresh code object: Dynamo keeps its cache (and recompile limit) per code object.
    A decorator's wrapper (functools.wraps, its closure holding the function it wraps) is copied
    down the chain: Hugging Face's `can_return_tuple` wrapper is one code object for every model
    class, and when a unit's graph breaks inside it (a head unit's fence) Dynamo compiles it as a
    frame of its own, one entry per model and shape; past the recompile limit (8) that code ran
    uncompiled for the rest of the process, and later models' heads went unfused."""
    closure = fn.__closure__
    inner = getattr(fn, "__wrapped__", None)
    if closure and isinstance(inner, types.FunctionType):
        own_inner = _own_code(inner)
        closure = tuple(types.CellType(own_inner) if _holds(cell, inner) else cell for cell in closure)
    new = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    return new


_UNIT_KEYS = itertools.count()
# compiled forwards of one block class whose modules differ in parameter shapes (see _compiled_for)
_SHAPE_ENTRIES = 4


def _entry(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A frame of trifuse's own in front of `fn`, fresh per unit. torch.compile wraps a function
    Dynamo would not start tracing at (one from torch's own files: nn.TransformerEncoderLayer's
    forward) in `external_utils.wrap_inline`, whose `inner` is one code object for every such
    function: every unit of a torch.nn block class then shared one cache, and past the
    recompile limit (8 entries, say two nn.Transformer models at two lengths) later captures
    ran unfused.

    Dynamo keeps a frame's automatic-dynamic state (which dims went symbolic after two values)
    per file, first line and name of its code (torch 2.13 adds the hash of its closure's code),
    so this frame's code is named after its unit alone (`name` and a process-wide count): Hugging
    Face wraps every layer class's forward in one `forward_with_checkpointing`, and Llama's and
    GLM-4's decoder layers are the same code in two files, so sharing made a model's dims
    symbolic from its first call once another model had other widths (GPT-NeoX's and GLM-4's
    rotary then went unfused)."""

    def enter(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    unit = f"{name}#{next(_UNIT_KEYS)}"
    names = {"co_name": unit} | ({"co_qualname": unit} if sys.version_info >= (3, 11) else {})
    code = enter.__code__.replace(**names)
    own = types.FunctionType(code, enter.__globals__, unit, None, enter.__closure__)
    own.__qualname__ = unit
    return own


def _holds(cell: types.CellType, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def checkpointing_forward(forward: Callable[..., Any]) -> bool:
    """Whether `forward` is Hugging Face's `forward_with_checkpointing` around a block's own (its
    GradientCheckpointingLayer: `torch.utils.checkpoint` of `__wrapped__` when checkpointing)."""
    code = getattr(forward, "__code__", None)
    return code is not None and code.co_name == "forward_with_checkpointing" and \
        isinstance(getattr(forward, "__wrapped__", None), types.FunctionType)


def checkpoints_per_call(cls: type) -> bool:
    """Whether a module class decides on each call whether to checkpoint: Hugging Face's
    GradientCheckpointingLayer, whose forward is `forward_with_checkpointing` (transformers 5.2x)
    or, in earlier releases (5.17, the lent GPU's), whose own `__call__` checkpoints. A trace
    keeps the choice of its own call and inlines the checkpoint's body: not to be traced by fx."""
    call = cls.__call__
    return checkpointing_forward(cls.forward) or \
        getattr(call, "__qualname__", "").endswith("GradientCheckpointingLayer.__call__")


def _checkpointing(module: torch.nn.Module) -> bool:
    """Whether Hugging Face's wrapper checkpoints this call (its own condition, outermost wrapper aside)."""
    return bool(getattr(module, "gradient_checkpointing", False)) and module.training \
        and torch.is_grad_enabled() and callable(getattr(module, "_gradient_checkpointing_func", None))


# Why a checkpointed block's first call ran unfused: the body held a graph break (Qwen2-VL's vision
# blocks) or a side effect Dynamo's checkpoint op refuses (the context variable that the Hub
# `kernels` package, which transformers 5.25 requires, sets in the attention of Llama and of the
# models copying it).
_CHECKPOINT_BODY_AS_WRITTEN = (
    "under gradient checkpointing, Dynamo could not make the checkpointed body one graph (a graph break "
    "or a side effect inside it) and ran it as written; the next calls checkpoint the block's own compiled "
    "forward")

_CALLING: contextvars.ContextVar["DynamoUnit | None"] = contextvars.ContextVar("trifuse_dynamo_unit", default=None)


@functools.cache
def _backend_for(patterns: tuple[Pattern, ...]) -> Callable[..., Any]:
    """One backend per pattern selection, shared by every unit using it: Dynamo keeps a compiled
    graph per backend, so units of the same class (several fused models in one process) and the
    resume functions after graph breaks reuse each other's graphs instead of piling up entries
    towards the recompile limit. The unit being called is found through a context variable."""

    def trifuse_fuse_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        unit = _CALLING.get()
        if unit is None:  # only units call their compiled forwards; anything else runs as captured
            return gm.forward
        return unit._compile(gm)

    return trifuse_fuse_backend


class _DynamoSettings:
    """torch._dynamo.config values for the duration of a call: `apply()` sets them and returns
    the previous ones, `restore(prior)` puts those back, as `config.patch` does, without the
    class `config.patch` builds on every call (18 µs a block call on this CPU, ~0.45 ms of a
    25-unit step; 4-6 µs this way). The prior values stay with the caller: re-entrant and
    thread-safe as one object per unit."""

    __slots__ = ("changes",)

    def __init__(self, changes: tuple[tuple[str, Any], ...]) -> None:
        self.changes = changes

    def apply(self) -> list[tuple[str, Any]]:
        config = torch._dynamo.config
        prior = [(name, getattr(config, name)) for name, _ in self.changes]
        for name, value in self.changes:
            setattr(config, name, value)
        return prior

    @staticmethod
    def restore(prior: list[tuple[str, Any]]) -> None:
        config = torch._dynamo.config
        for name, value in prior:
            setattr(config, name, value)


class DynamoUnit(Unit):
    strategy = "dynamo"
    # The capture traces its submodules' hooks, transformers' output capture among them (see
    # outputs.collector_to_global). Not the head's: the model body it fences sets the collector itself.
    traces_output_hooks = True

    def __init__(self, cls: type, patterns: Sequence[Pattern], verbose: bool) -> None:
        super().__init__(cls, patterns, verbose)
        entry = _entry(_own_code(self.original), f"{cls.__module__}.{cls.__qualname__}")
        self.compiled = torch.compile(entry, backend=_backend_for(self.patterns))
        # see _compiled_for: the compiled forwards per shapes of a module's parameters, and per module
        self._compiled_by_shapes: dict[tuple | str | None, Callable[..., Any] | None] = {}
        self._compiled_by_module: weakref.WeakKeyDictionary[torch.nn.Module, Callable[..., Any]] = \
            weakref.WeakKeyDictionary()
        self._compiled_collecting: Callable[..., Any] | None = None  # see _collecting
        self._compiled_checkpointed: Callable[..., Any] | None = None  # see _checkpoint_outside
        self.checkpoint_outside = False  # see _checkpoint_outside
        self.inner_checkpoints: list[str] = []  # see _run_checkpointed
        self._inner_layers: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[str, torch.nn.Module]]] = \
            weakref.WeakKeyDictionary()
        self.runs = 0
        self._call_seq = 0
        self._capture_seq = -1
        self._capture: Capture | None = None
        # The graphs run in this call, by their log's id: (the capture they were compiled in, their log).
        self._ran: dict[int, tuple[Capture, RewriteLog]] = {}
        self._ran_times: dict[int, int] = {}  # per graph in _ran, its runs in this call
        self._merged: dict[tuple[int, ...], tuple[Capture, list[RewriteLog]]] = {}  # see _ran_capture
        self._current: tuple[torch.nn.Module, tuple, dict] | None = None
        self._dropped: list[tuple[fx.Node, fx.Node]] = []  # (probabilities, placeholder) of the graph in rewrite
        # (checkpoint body, the checkpoint's call, its output index, the probabilities there, placeholder)
        self._dropped_in_bodies: list[tuple[fx.GraphModule, fx.Node, int, fx.Node, fx.Node]] = []
        self.drops_weights = False  # a capture returns None for the attention probabilities
        self.failed: str | None = None  # Dynamo could not capture this class: its calls run as written
        self.scalar_outputs = True  # captures keep `.item()` in the graph, unless Dynamo failed with it
        self.static_shapes = False  # captures specialize on each shape, once Dynamo failed with dynamic ones
        self._signature: inspect.Signature | None = None  # of the block's forward, once needed
        self._transformers_kwargs = False  # see _output_attentions
        # per module, what _output_attentions told its last call outside a backward (see there)
        self._flag_in_forward: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()
        self.graphs: BlockGraphs | None = None  # CUDA graphs of the blocks: fuse(cuda_graphs=True)
        self._settings: dict[tuple, _DynamoSettings] = {}

    def host_time_hidden(self) -> bool:
        return self.graphs is not None

    def install(self, module: torch.nn.Module, path: str, attribute: str = "forward") -> None:
        super().install(module, path, attribute)
        compiled = self._compiled_for(module)
        if compiled is not None:
            self._compiled_by_module[module] = compiled

    def _compiled_for(self, module: torch.nn.Module) -> Callable[..., Any] | None:
        """The compiled forward of a module whose parameters differ in shape from the first
        installed module's (None: `self.compiled`, that one's). Dynamo keeps the automatic-dynamic
        state (a dim seen with two values is symbolic from then on) per code object, so one shared
        by blocks of different widths made every capture after the first symbolic in the widths
        and the token counts: Swin V2's stages (a width and a window count each) spent 8-10 s in
        SymPy per capture on our CPU, 31 s of set-up in all, now 6. Blocks of one shape (every
        transformer's layers) share `self.compiled`; past `_SHAPE_ENTRIES` shapes (per-layer
        widths, as in OpenELM), the rest share one more, which goes dynamic as one shared forward
        did."""
        try:
            shapes = tuple(tuple(p.shape) for p in module.parameters())
        except (RuntimeError, ValueError):  # an uninitialized (lazy) parameter: no shape yet
            shapes = None
        if not self._compiled_by_shapes:
            self._compiled_by_shapes[shapes] = None
        key = shapes if shapes in self._compiled_by_shapes or len(self._compiled_by_shapes) < _SHAPE_ENTRIES \
            else "more shapes"
        if key not in self._compiled_by_shapes:
            name = f"{self.cls.__module__}.{self.cls.__qualname__}.shapes{len(self._compiled_by_shapes)}"
            entry = _entry(_own_code(self.original), name)
            self._compiled_by_shapes[key] = torch.compile(entry, backend=_backend_for(self.patterns))
        return self._compiled_by_shapes[key]

    def _dynamo_settings(self) -> _DynamoSettings:
        """The Dynamo config of this unit's captures: one object per distinct setting, reused by
        every call."""
        # guards on the modules' hooks: a hook registered after a capture (a user's forward hook on
        # a block's MLP) must run, not be left out of the graph that Dynamo's default would reuse.
        # optimize_ddp off: inside DistributedDataParallel's forward, Dynamo would split a capture at
        # DDP's gradient-bucket boundaries (DDPOptimizer, for an AOT-compiled backward that runs as
        # one node), cutting patterns in two; a rewritten graph's backward runs op by op, so DDP's
        # reducer overlaps its all-reduces with it as in eager.
        settings = (("capture_scalar_outputs", self.scalar_outputs), ("skip_nnmodule_hook_guards", False),
                    ("optimize_ddp", False))
        if self.static_shapes:
            settings += (("automatic_dynamic_shapes", False), ("assume_static_by_default", True))
        found = self._settings.get(settings)
        if found is None:
            found = self._settings[settings] = _DynamoSettings(settings)
        return found

    def _collecting(self) -> Callable[..., Any]:
        """The forward compiled apart for calls on which transformers collects outputs through
        hooks (output_hidden_states, output_attentions): the hooks' collecting is traced into these
        captures, which the other calls must not run. Like every capture of the unit, they guard
        on the modules' hooks, so one made before transformers installed them (it does so on the
        first call that asks) is not reused, leaving their outputs uncollected."""
        if self._compiled_collecting is None:
            name = f"{self.cls.__module__}.{self.cls.__qualname__}.collecting"
            entry = _entry(_own_code(self.original), name)
            self._compiled_collecting = torch.compile(entry, backend=_backend_for(self.patterns))
        return self._compiled_collecting

    def _checkpoint_outside(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """A block under Hugging Face's gradient checkpointing whose body Dynamo cannot take as
        one checkpointed graph (a graph break inside it: Qwen2-VL's vision blocks split their
        attention per image by `lengths.tolist()`). Dynamo then runs `torch.utils.checkpoint`
        as written, which disables Dynamo for the block: all of it ran unfused. Here the wrapper
        runs as written and checkpoints the block's own forward compiled apart (graph breaks
        allowed), so the forward and the backward's recompute both run the rewritten graphs;
        the checkpoint's own options (non-reentrant, the RNG state kept for the recompute) are
        the model's."""
        checkpoint_fn = module._gradient_checkpointing_func
        if self._compiled_checkpointed is None:
            name = f"{self.cls.__module__}.{self.cls.__qualname__}.checkpointed"
            entry = _entry(_own_code(self.original.__wrapped__), name)
            self._compiled_checkpointed = torch.compile(entry, backend=_backend_for(self.patterns))
        compiled = self._compiled_checkpointed

        def checkpoint_compiled(fn: functools.partial, *inputs: Any) -> Any:
            # fn: the wrapper's partial(forward, module, **kwargs)
            return checkpoint_fn(functools.partial(self._run_checkpointed, compiled, *fn.args, **fn.keywords),
                                 *inputs)

        own = "_gradient_checkpointing_func" in module.__dict__
        module._gradient_checkpointing_func = checkpoint_compiled
        try:
            return self.original(module, *args, **kwargs)
        finally:
            if own:
                module._gradient_checkpointing_func = checkpoint_fn
            else:
                del module._gradient_checkpointing_func

    def _run_checkpointed(self, compiled: Callable[..., Any], module: torch.nn.Module, *args: Any,
                          **kwargs: Any) -> Any:
        """The block's compiled forward as `_checkpoint_outside` checkpoints it: in this unit's
        call, and in the backward's recompute, which runs after the call returned. A reentrant
        checkpoint runs the forward under no_grad and the recompute in grad mode, a frame Dynamo
        compiles there; the backend rewrites only for the unit calling, so without this the
        recompute ran the block as written, unfused and with other dropout masks than the
        forward's: wrong gradients. The recompute's compiles make a capture of their own.

        A checkpointed layer inside the block (Zamba's hybrid layer holds a Mamba layer) would
        checkpoint again inside this compiled forward, where Dynamo refuses it as the block's was
        refused, and run it as written, unfused. It runs without a checkpoint of its own: the
        block's checkpoint recomputes it, and its activations live during the block's backward only."""
        layers = self._inner_layers.get(module)
        if layers is None:  # once per block: this runs in every checkpointed forward and recompute
            layers = [(name, m) for name, m in module.named_modules()
                      if m is not module and checkpointing_forward(type(m).forward)]
            self._inner_layers[module] = layers
        inner = [m for _, m in layers if _checkpointing(m)]
        if inner and not self.inner_checkpoints:
            self.inner_checkpoints = [name for name, m in layers if m in inner]
        for m in inner:
            m.gradient_checkpointing = False
        try:
            if _CALLING.get() is self:
                return _without_dropped_weights(compiled(module, *args, **kwargs))
            token = _CALLING.set(self)
            current, self._current = self._current, (module, args, kwargs)
            self._call_seq += 1
            try:
                return _without_dropped_weights(compiled(module, *args, **kwargs))
            finally:
                _CALLING.reset(token)
                self._current = current
        finally:
            for m in inner:
                m.gradient_checkpointing = True

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        self.calls += 1
        if self.graphs is not None and self.failed is None:
            return self.graphs.call(module, args, kwargs, self._call_fused, lambda m: self.last.get(m) is not None)
        return self._call_fused(module, args, kwargs)

    def _call_fused(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.failed is not None:
            return self._eager(module, args, kwargs, self.failed)
        reason = unsupported_argument(args, kwargs)
        if reason is not None:
            return self._eager(module, args, kwargs, self._named_reason(args, kwargs, reason))
        if self.drops_weights and self._output_attentions(module, args, kwargs) is not False:
            # Dynamo does not guard on a flag the block never reads: the captured graph would return
            # the placeholder here too
            return self._eager(module, args, kwargs, "output_attentions not False: the attention probabilities are returned")
        self._call_seq += 1
        self._current = (module, args, kwargs)
        self._ran, self._ran_times = {}, {}  # (a Counter costs 0.4 us a block call more)
        runs = self.runs
        token = _CALLING.set(self)
        failure = None
        try:
            # `.item()` of a 0-d tensor stays in the graph (DeBERTa's attention span slices the position
            # embeddings by it): a graph break there would split the attention chain in two. Should
            # Dynamo fail on a graph holding such a scalar, the capture is tried again with static
            # shapes (DeBERTa's span, unbacked, next to a symbolic sequence length fails Dynamo's
            # own bookkeeping: each new length is then a capture of its own), then without scalars.
            while True:
                try:
                    collector = collector_to_global() if self.traces_output_hooks else None
                    collecting = collector is not None and bool(collector[0].global_var)
                    settings = self._dynamo_settings()
                    prior = settings.apply()
                    target = self._collecting() if collecting else self.compiled
                    if self._compiled_by_module and not collecting:
                        target = self._compiled_by_module.get(module, target)
                    if self.checkpoint_outside and _checkpointing(module):
                        target = self._checkpoint_outside
                    try:
                        out = target(module, *args, **kwargs)
                    finally:
                        collector_restore(collector)
                        settings.restore(prior)
                    break
                except Exception as e:
                    if not self.scalar_outputs or not _dynamo_failed(e):
                        raise
                    if self.static_shapes:
                        self.scalar_outputs = False
                    self.static_shapes = True
        except Exception as e:
            if not _dynamo_failed(e):
                raise
            failure = e
        finally:
            _CALLING.reset(token)
            self._current = None
        if failure is not None:
            # Dynamo itself failed on this block (e.g. JetMoE's expert routing: its fake tensors
            # index with a float tensor that eager never sees). Never break a model: run it as
            # written. A graph captured before a graph break may already have run, so the block's
            # first part runs twice on this call (no effect on a pure forward but an extra draw of
            # any dropout there). Only once eager succeeds is the failure Dynamo's, not the model's:
            # an error of the model's own raises from the eager call, as it would unfused.
            first = (str(failure).strip().splitlines() or [""])[0][:200]
            reason = f"TorchDynamo could not capture it ({type(failure).__name__}: {first})"
            out = self._eager(module, args, kwargs, reason)
            self.failed = reason
            _log.warning("trifuse.fuse: %s runs unfused: %s", self.cls.__name__, reason)
            return out
        if self.runs == runs:
            self.last[module] = None
            if _checkpointing(module) and checkpointing_forward(self.original) and not self.checkpoint_outside:
                self.checkpoint_outside = True  # from the next call on; this one ran as written
                self.eager_calls[_CHECKPOINT_BODY_AS_WRITTEN] += 1
            else:
                self.fallbacks += 1
        else:
            self.last[module] = self._ran_capture()
        return _without_dropped_weights(out)

    def _before_rewrite(self, graph: fx.Graph) -> None:
        """A block called with `output_attentions=False` that returns its attention probabilities
        all the same (GPT-J, CodeGen, GPT-Neo, BLOOM, MPT: `return hidden_states, attn_weights`,
        which their models drop unless output_attentions): the probabilities leave the graph's
        outputs, replaced by `_dropped_weights()`, so an attention pattern may take the softmax.
        `__call__` returns None in their place, as transformers' SDPA and flash attention return for
        weights nobody asked for. Where no pattern takes them, `_annotate` puts them back. Once a
        capture has dropped them, calls with output_attentions not False run as written.

        Under gradient checkpointing the block's graph returns them from its checkpoint's body
        (`getitem(tag_activation_checkpoint(body, ...), i)`): the body returns None there instead
        (a tensor returned from a reentrant checkpoint would get its grad_fn), and the graph
        returns the placeholder."""
        self._dropped, self._dropped_in_bodies = [], []
        if self._current is None or self._output_attentions(*self._current) is not False:
            return
        output = _output(graph)
        for value in list(output.all_input_nodes):
            checkpointed = checkpointed_output(value) if set(value.users) == {output} else None
            if checkpointed is not None:
                body, index = checkpointed
                probabilities = _output(body.graph).args[0][index]
                if not isinstance(probabilities, fx.Node) or not _attention_probabilities(probabilities):
                    continue
                _set_returned(body, index, None)
            elif not _attention_probabilities(value):
                continue
            with graph.inserting_before(output):
                placeholder = graph.call_function(_dropped_weights, ())
            output.replace_input_with(value, placeholder)
            if checkpointed is not None:
                self._dropped_in_bodies.append((body, value.args[0], index, probabilities, placeholder))
                graph.erase_node(value)
            else:
                self._dropped.append((value, placeholder))

    def _output_attentions(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """The block's `output_attentions` on this call, passed by name or by position (RemBERT's
        encoder passes it positionally), else its default; None where it has none.

        A Hugging Face block that takes `**kwargs: Unpack[TransformersKwargs]` gets the flag there
        if at all: transformers 5 records attention probabilities by hooks instead, when a model's
        caller asks for them (SwitchTransformers). There, the flag absent and transformers' output
        collector active but not collecting attentions (hidden states, say), nobody reads the
        probabilities: False. With no collector active the caller reads what the block returns
        (BridgeTower's model gathers its cross-modal layers' probabilities itself, asked or not):
        unknown, None. A reentrant checkpoint recomputes the block in the backward, outside the
        model's forward and its collector: that call gets what the forward's got."""
        if "output_attentions" in kwargs:  # the usual call: no binding on the per-call path
            return kwargs["output_attentions"]
        if self._signature is None:
            try:
                self._signature = inspect.signature(self.original)
            except (TypeError, ValueError):
                return None
            self._transformers_kwargs = _takes_transformers_kwargs(self._signature)
        param = self._signature.parameters.get("output_attentions")
        if param is None:  # only **kwargs could carry it, and this call's do not: no binding either
            if not self._transformers_kwargs:
                return None
            if torch._C._current_graph_task_id() != -1:  # a recompute in the backward
                return self._flag_in_forward.get(module)
            flag = False if collector_active() and not collecting_attentions() else None
            self._flag_in_forward[module] = flag
            return flag
        try:
            bound = self._signature.bind(module, *args, **kwargs)
        except TypeError:
            return None
        if "output_attentions" in bound.arguments:
            return bound.arguments["output_attentions"]
        return None if param.default is inspect.Parameter.empty else param.default

    def _annotate(self, graph: fx.Graph, log: RewriteLog) -> None:
        live = set(graph.nodes)
        output = _output(graph)
        dropped = 0
        for value, placeholder in self._dropped:
            if value in live:  # no attention pattern took it: the block returns it as written
                output.replace_input_with(placeholder, value)
                graph.erase_node(placeholder)
            else:
                dropped += 1
        for body, call, index, probabilities, placeholder in self._dropped_in_bodies:
            if probabilities in set(body.graph.nodes):  # as above, in the checkpoint's body
                _set_returned(body, index, probabilities)
                recompile(body)
                with graph.inserting_before(output):  # the getitem, erased in _before_rewrite
                    value = graph.call_function(operator.getitem, (call, index))
                output.replace_input_with(placeholder, value)
                graph.erase_node(placeholder)
            else:
                dropped += 1
        if dropped:
            self.drops_weights = True
            for r in log.replaced:
                if r.family == "attention":
                    note = "its probabilities are not returned: output_attentions not asked for"
                    r.note = "; ".join(n for n in (r.note, note) if n)
        self._dropped, self._dropped_in_bodies = [], []

    def _compile(self, gm: fx.GraphModule) -> Callable[..., Any]:
        if self._capture is None or self._capture_seq != self._call_seq:
            module, args, kwargs = self._current or (None, (), {})
            mode = describe_mode(module, _tensors(args, kwargs)) if module is not None else "?"
            self._capture = self._new_capture(mode)
            self._capture_seq = self._call_seq
        capture = self._capture
        capture.graph_breaks += [b for b in _new_graph_breaks() if b not in capture.graph_breaks]
        with torch.no_grad():
            work, log = self._rewrite(gm, capture, None)
        fwd, key, ran = work.forward, id(log), (capture, log)

        def run(*args: Any) -> Any:
            unit = _CALLING.get()
            if unit is not None:  # the unit calling now, which may reuse another one's graph
                unit.runs += 1
                unit._ran.setdefault(key, ran)
                unit._ran_times[key] = unit._ran_times.get(key, 0) + 1
            return fwd(*args)

        return run

    def _ran_capture(self) -> Capture | None:
        """What the graphs run in this call replaced: their capture when they all come from one
        and each ran once, else one Capture holding the logs of the graphs that ran, each as
        many times as it ran, the same object for the same runs. Another capture's graph: a
        frame compiled for another model of the same class (Hugging Face's MoE block, called from
        the resumed layer after a graph break). A graph run twice: a frame after a graph break
        called per image (MiniCPM-V's packed attention), whose second shape reuses the first's
        graph once Dynamo made the shared frame's sizes dynamic (another model's images did so)."""
        captures = list(dict.fromkeys(c for c, _ in self._ran.values()))
        if len(captures) <= 1 and all(n == 1 for n in self._ran_times.values()):
            return captures[0] if captures else None
        key = tuple(self._ran_times.items())
        if key not in self._merged:
            logs = [log for _, log in self._ran.values()]  # held, so that their ids stay theirs
            merged = Capture(captures[0].mode, graphs=len(logs))
            for graph, (_, log) in self._ran.items():
                for _ in range(self._ran_times[graph]):
                    _merge(merged.log, log)
            self._merged[key] = (merged, logs)
        return self._merged[key][0]


# Views and casts between the head's output and the loss: `logits.float().view(-1, vocab)`.
_SHAPE_AND_DTYPE = {"view", "reshape", "flatten", "to", "float", "contiguous"}


def _logits_chain(loss: fx.Node) -> list[fx.Node]:
    """A cross-entropy node's logits argument and what it was viewed or cast from, back to the
    node that computed them (last); empty when the argument is no node."""
    chain, logits = [], loss.args[0] if loss.args else None
    while isinstance(logits, fx.Node):
        chain.append(logits)
        if not (logits.op in ("call_method", "call_function") and logits.args
                and getattr(logits.target, "__name__", logits.target) in _SHAPE_AND_DTYPE):
            break
        logits = logits.args[0]
    return chain


class HeadUnit(DynamoUnit):
    """The model's own forward, for what it does around its body: the LM head and the loss.

    The children holding the blocks (a Hugging Face model's `transformer`/`model`/`bert`) are
    fenced: while this unit runs, Dynamo does not trace into them (they run as they are, their
    blocks through their own units), so the capture holds only the head and the loss. Outside
    this unit's calls the fence is transparent (a user's torch.compile sees the whole model).
    """

    strategy = "dynamo (head)"
    traces_output_hooks = False

    def __init__(self, cls: type, patterns: Sequence[Pattern], verbose: bool, skip_logits: bool = False) -> None:
        super().__init__(cls, patterns, verbose)
        self.capturing = False
        self.fenced: list[str] = []
        self.skip_logits = skip_logits
        self._skip_now = False  # this call trains (module.training, grad enabled) with skip_logits
        self.skipped_logits = 0  # graphs whose logits output was dropped for linear_cross_entropy
        self._pending: list[tuple[fx.Node, fx.Node]] = []  # (logits, placeholder) of the graph in rewrite

    def fence(self, module: torch.nn.Module, path: str) -> None:
        original = type(module).forward
        outside = torch._dynamo.disable(original)
        unit = self

        @functools.wraps(original)
        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if unit.capturing:
                return outside(self, *args, **kwargs)
            return original(self, *args, **kwargs)

        # Dynamo compiles this wrapper as a frame of its own (it breaks the graph at `outside`):
        # a code object per fence keeps its cache entries apart from other models' fences.
        bind_forward(module, "forward", _own_code(forward))
        self.fenced.append(path)

    def _before_rewrite(self, graph: fx.Graph) -> None:
        """skip_logits, in a training call: the logits that feed a cross-entropy (through views and
        casts) leave the graph's outputs, replaced by `_skipped_logits()`, so the head and the loss
        have no other user and fuse into linear_cross_entropy. `__call__` turns the placeholder
        into None in what the model returns."""
        self._pending = []
        if not self._skip_now:
            return
        output = _output(graph)
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.nn.functional.cross_entropy:
                continue
            chain = _logits_chain(node)
            if not chain or chain[-1].target is not torch.nn.functional.linear:
                continue  # not an LM head's output: nothing to gain
            for logit in chain:
                if output in logit.users:
                    with graph.inserting_before(output):
                        placeholder = graph.call_function(_skipped_logits, ())
                    output.replace_input_with(logit, placeholder)
                    self._pending.append((logit, placeholder))

    def _annotate(self, graph: fx.Graph, log: RewriteLog) -> None:
        """A loss fused alone whose logits are an input of its graph: the LM head ran in an earlier
        graph (Dynamo broke the forward between the head and the loss, as at transformers'
        `loss_function`, which logs a warning), so linear_cross_entropy could not see it. The report
        says so, as it does when the model also needs the logits (BERT)."""
        nodes = {n.name: n for n in graph.nodes}
        live = set(graph.nodes)
        output = _output(graph)
        for logits, placeholder in self._pending:
            if logits in live:  # linear_cross_entropy did not take it: the logits are returned after all
                output.replace_input_with(placeholder, logits)
                graph.erase_node(placeholder)
            else:
                self.skipped_logits += 1
        if self._pending and not self.skipped_logits:
            log.skipped["skip_logits"] = "no LM head fused into linear_cross_entropy: the logits are returned"
        for r in log.replaced:
            if r.family == "cross_entropy" and r.pattern.startswith("linear_") and self._skip_now:
                r.note = "; ".join(n for n in (r.note, "the logits are not returned (fuse(..., skip_logits=True))")
                                   if n)
            if r.family != "cross_entropy" or r.pattern.startswith("linear_") or "not linear_cross_entropy" in r.note:
                continue
            node = nodes.get(r.node)
            chain = _logits_chain(node) if node is not None else []
            if chain and chain[-1].op == "placeholder":
                why = ("not linear_cross_entropy: the logits are an input of this graph, the head ran in an "
                       "earlier one (a graph break between the head and the loss)")
                r.note = "; ".join(n for n in (r.note, why) if n)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        self.capturing = True
        self._skip_now = self.skip_logits and module.training and torch.is_grad_enabled()
        ignored, added = _ignore_once_logging()
        if added:
            _METRICS_LOGGER.addFilter(_drop_metrics_log_failure)
        try:
            out = super().__call__(module, args, kwargs)
        finally:
            self.capturing = False
            ignored.difference_update(added)
            if added:
                _METRICS_LOGGER.removeFilter(_drop_metrics_log_failure)
        return _none_for_placeholder(out) if self._skip_now and self.skipped_logits else out


# skip_logits: what a graph returns in place of the logits it no longer outputs. One zero-size
# tensor, recognized by identity and replaced by None before the model's output reaches the user.
_SKIPPED = torch.empty(0)


def _skipped_logits() -> torch.Tensor:
    return _SKIPPED


def _none_for_placeholder(out: Any, placeholder: torch.Tensor = _SKIPPED) -> Any:
    """The model's output with a placeholder (the skipped logits', the dropped attention
    probabilities') as None: a Hugging Face ModelOutput (a dict subclass whose fields default to
    None) is rebuilt without it, a tuple or list gets None."""
    if isinstance(out, dict):
        if not any(v is placeholder for v in out.values()):
            return out
        kept = {k: v for k, v in out.items() if v is not placeholder}
        try:
            return type(out)(**kept)
        except TypeError:
            return {k: (None if v is placeholder else v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        items = [_none_for_placeholder(v, placeholder) if isinstance(v, (dict, tuple, list)) else
                 (None if v is placeholder else v) for v in out]
        return type(out)(items) if isinstance(out, list) or type(out) is tuple else type(out)(*items)
    return None if out is placeholder else out


# What a block's graph returns in place of attention probabilities its caller did not ask for
# (DynamoUnit._before_rewrite): zero-size, so any use of it fails loudly; None once returned.
_DROPPED_WEIGHTS = torch.empty(0)


def _dropped_weights() -> torch.Tensor:
    return _DROPPED_WEIGHTS


def _takes_transformers_kwargs(signature: inspect.Signature) -> bool:
    """Whether a forward's `**kwargs` is annotated `Unpack[TransformersKwargs]` (transformers 5's
    blocks: `output_attentions` and the other flags arrive there, if at all)."""
    kwargs = [p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    return bool(kwargs) and "TransformersKwargs" in str(kwargs[0].annotation)


def _dynamo_failed(error: BaseException) -> bool:
    """Whether `error` is TorchDynamo failing on a block, not the block failing: a
    TorchDynamoException, or any error raised while Dynamo traced it (its symbolic interpreter on
    the traceback). Some of Dynamo's own checks raise plain errors: Longformer's global attention,
    a data-dependent bool, gives `AssertionError: Expected bool, got FakeTensor` (with or without
    scalar outputs captured). An error of the model's own raised while tracing raises again from
    the eager call."""
    if isinstance(error, torch._dynamo.exc.TorchDynamoException):
        return True
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/_dynamo/symbolic_convert.py"):
            return True
        tb = tb.tb_next
    return False


def _without_dropped_weights(out: Any) -> Any:
    """A block's outputs with None for the placeholder, before anything else sees them. A
    reentrant checkpoint around the compiled forward (`_checkpoint_outside`) sets its own grad_fn
    on every tensor it returns, the module-wide placeholder included: the next recompute returned
    it again, and its backward ran the same checkpoint's backward inside itself, without end
    (LongT5, whose attention always returns its probabilities)."""
    if isinstance(out, tuple) and any(v is _DROPPED_WEIGHTS for v in out):
        return _none_for_placeholder(out, _DROPPED_WEIGHTS)
    return out


# Between a softmax and the probabilities a block returns: casts, dropout, views.
_PROBABILITY_STEPS = {"to", "type", "float", "dropout", "view", "reshape", "contiguous"}


def _attention_probabilities(node: fx.Node) -> bool:
    """Whether `node` is a softmax over the last dim, or reached from one through casts, dropout and views."""
    while True:
        name = getattr(node.target, "__name__", node.target)
        if node.op in ("call_function", "call_method") and name == "softmax":
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
            return dim == -1 or (isinstance(dim, int) and isinstance(example_value(node), torch.Tensor)
                                 and dim == example_value(node).dim() - 1)
        if node.op not in ("call_function", "call_method") or name not in _PROBABILITY_STEPS or not node.args \
                or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]


# Logger methods Hugging Face adds to logging.Logger (`warning_once`, `info_once`). Dynamo breaks the
# graph at any Logger call; transformers' `loss_function` property calls `warning_once` between the
# LM head and the loss, which split them into two graphs and kept linear_cross_entropy from seeing
# the head. While a head unit runs, these (and only these) are no-ops inside its capture: a
# once-only advisory message, not an error, is what the capture drops.
# Looked up per call: transformers may be imported after trifuse.
_ONCE_LOGGING = ("warning_once", "info_once")


def _ignore_once_logging() -> tuple[set, list]:
    """Adds the once-only Logger methods to Dynamo's ignored logging functions (the set's name
    changed across torch versions). Returns (the set, what this call added), for the caller to
    remove what it added and nothing else (a nested call adds nothing)."""
    config = torch._dynamo.config
    ignored = getattr(config, "ignore_logging_functions", None)
    if ignored is None:
        ignored = getattr(config, "ignore_logger_methods", None)
    if ignored is None:  # an older torch without the option: the break stays, the report says so
        return set(), []
    added = []
    for name in _ONCE_LOGGING:
        fn = getattr(logging.Logger, name, None)
        if fn is None or fn in ignored:
            continue
        if ignored and _metrics_log_sorts_ignored_functions():
            break  # a second function would make every compile log a traceback (below)
        ignored.add(fn)
        added.append(fn)
    return ignored, added


_METRICS_LOGGER = logging.getLogger("torch._dynamo.metrics_context")


def _drop_metrics_log_failure(record: logging.LogRecord) -> bool:
    """A log filter: torch 2.11's compilation-metrics logging writes Dynamo's config as JSON, the
    ignored logging functions included (2.13 leaves them out), and a function is not JSON: with
    `warning_once` in the set, every compile logged "Unexpected exception logging compilation
    metrics" and a traceback at ERROR (the NCCL example on the H200, 2026-11-27). While a head
    unit has put it there, that record, and only it, is dropped."""
    return not str(record.msg).startswith("Unexpected exception logging compilation metrics")


@functools.cache
def _metrics_log_sorts_ignored_functions() -> bool:
    """True on torch versions (2.11) whose compilation-metrics logging sorts the ignored logging
    functions (its clean-up skips the set under its old name only): two functions do not compare,
    and each compile then logs "Unexpected exception logging compilation metrics" at ERROR. There
    the set gets one function (`warning_once`, the one between a head and its loss) at a time."""
    config = torch._dynamo.config
    probe = getattr(getattr(torch._dynamo, "utils", None), "_get_dynamo_config_for_logging", None)
    name = "ignore_logging_functions" if hasattr(config, "ignore_logging_functions") else "ignore_logger_methods"
    if probe is None or not hasattr(config, name):
        return False
    with config.patch(**{name: {logging.Logger.info, logging.Logger.debug}}):
        try:
            probe()
        except TypeError:
            return True
        except Exception:  # noqa: BLE001  (anything else: the logging code changed; assume it copes)
            return False
    return False


# =============================================================================================
# fx
# =============================================================================================


@dataclass
class _FxEntry:
    fn: Callable[..., Any] | None  # generated forward(self, *placeholders), or None: run eagerly
    capture: Capture | None
    reason: str = ""
    # (submodule path, attribute, value) the graph took as constants (normalize.baked_attributes)
    baked: tuple[tuple[str, str, Any], ...] = ()
    # fx could not trace the call: Dynamo captures it instead (not for a module holding other units)
    untraceable: bool = False


def _baked_checks(module: torch.nn.Module, entry: _FxEntry) -> tuple[tuple[Any, str, Any], ...] | None:
    """The entry's baked attributes resolved on `module` (submodule, attribute, value), or None
    where one no longer holds its value (a Dropout's p set after the capture) or is gone."""
    checks = []
    for path, name, value in entry.baked:
        try:
            sub = module.get_submodule(path)
        except AttributeError:
            return None
        if getattr(sub, name, _MISSING) != value:
            return None
        checks.append((sub, name, value))
    return tuple(checks)


def _settings(module: torch.nn.Module) -> list[tuple[str, str, float | bool | str]]:
    """(submodule path, attribute, value) for each public float, bool or str attribute of the
    module's tree: fx reads them as constants while tracing (nanoGPT's `dropout_p=self.dropout`, a
    `self.approximate` passed to F.gelu, an `if self.pre_norm:`), so a graph is right only while
    they keep their values. Not ints: sizes never change, and counters change every call without
    meaning a new graph. Not `training`: the call key holds every module's."""
    return [(path, name, value) for path, sub in module.named_modules()
            for name, value in vars(sub).items()
            if type(value) in (float, bool, str) and value == value  # NaN: never equal
            and not name.startswith("_") and name != "training"]


_MISSING = object()
_MAX_RECAPTURES = 8


class FxUnit(Unit):
    strategy = "fx"

    def __init__(self, module: torch.nn.Module, patterns: Sequence[Pattern], verbose: bool,
                 leaves: Callable[[torch.nn.Module], bool]) -> None:
        super().__init__(type(module), patterns, verbose)
        self.signature = inspect.signature(self.original)
        self.leaves = leaves
        # per module, per call key: (entry, its baked attributes resolved on the module)
        self.cache: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, tuple[_FxEntry, tuple]]] = \
            weakref.WeakKeyDictionary()
        self.recaptures = 0  # captures made again because a module attribute they hold changed
        # (key, parameter dtypes and shapes, traced code) -> entry: identical layers share a capture
        self.shared: dict[tuple[tuple, tuple, str], _FxEntry] = {}
        self.dynamo: DynamoUnit | None = None  # captures the calls fx cannot trace (_via_dynamo)
        self.dynamo_calls: Counter[str] = Counter()  # why fx could not trace them

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        self.calls += 1
        try:
            bound = self.signature.bind(module, *args, **kwargs)
        except TypeError:
            return self.original(module, *args, **kwargs)  # raises the error the user would get
        bound.apply_defaults()
        values = list(bound.arguments.values())[1:]
        reason = next((f"argument {i} is {why}" for i, why in enumerate(map(_fx_unsupported, values)) if why),
                      None)
        if reason is not None:
            return self._eager(module, args, kwargs, reason)
        everywhere = global_hooks()
        key = (
            tuple(map(_fx_key, values)),
            # a hook registered after a capture keeps its module a call in a capture of its own; a
            # submodule replaced by one of another class (an adapter around a Linear) is traced anew
            tuple((type(m), m.training, everywhere or bool(m._forward_hooks or m._forward_pre_hooks
                                                           or m._backward_hooks or m._backward_pre_hooks))
                  for m in module.modules()),
            torch.is_grad_enabled(),
            _autocast_state(),
        )
        per_module = self.cache.setdefault(module, {})
        found = per_module.get(key)
        if found is None or any(getattr(sub, name, _MISSING) != value for sub, name, value in found[1]):
            # first call, or a module attribute the graph holds as a constant changed since
            if found is not None:
                self.recaptures += 1
                if self.recaptures > _MAX_RECAPTURES:  # as Dynamo's recompile limit: stop capturing
                    reason = "module attributes the captures hold as constants keep changing (a Dropout's p)"
                    return self._eager(module, args, kwargs, reason)
            entry = self._capture_fx(module, list(bound.arguments)[1:], values, key)
            found = per_module[key] = (entry, _baked_checks(module, entry) or ())
        entry = found[0]
        if entry.fn is None:
            if entry.untraceable:
                return self._via_dynamo(module, args, kwargs, entry.reason)
            return self._eager(module, args, kwargs, entry.reason)
        self.last[module] = entry.capture
        if any(type(v) in _FX_CONTAINERS for v in values):  # flattening costs ~1 us a call: only then
            values = pytree.tree_leaves(values)
        return entry.fn(module, *values)

    def _via_dynamo(self, module: torch.nn.Module, args: tuple, kwargs: dict, reason: str) -> Any:
        """A call fx cannot trace (its arguments take a branch the default ones did not: a block
        traced with `mask=None` that branches on the mask's dtype once one is passed) is captured
        by Dynamo, as a block fx cannot trace at all is: one DynamoUnit for this unit's class,
        made on the first such call. Its captures join this unit's in the report. (A module that
        holds other units, a model around its blocks, runs such calls as written.)"""
        if self.dynamo is None:
            self.dynamo = DynamoUnit(self.cls, self.patterns, self.verbose)
            # its captures and its calls run as written are this unit's, in the report
            self.dynamo.captures, self.dynamo.eager_calls = self.captures, self.eager_calls
        self.dynamo_calls[reason] += 1
        fallbacks = self.dynamo.fallbacks
        out = self.dynamo(module, args, kwargs)
        self.fallbacks += self.dynamo.fallbacks - fallbacks
        self.last[module] = self.dynamo.last.get(module)
        return out

    def _capture_fx(self, module: torch.nn.Module, names: list[str], values: list[Any], key: tuple) -> _FxEntry:
        # Plain values are traced as constants (the call key holds them); a container's tensors
        # become placeholders (fx.PH), one per leaf, as its plain values do.
        concrete = {n: pytree.tree_map(lambda x: fx.PH if isinstance(x, torch.Tensor) else x, v)
                    for n, v in zip(names, values) if not isinstance(v, torch.Tensor)}
        try:
            graph = LeafTracer(self.leaves).trace(module, concrete_args=concrete)
        except Exception as e:  # noqa: BLE001  (fx cannot trace this call: Dynamo will)
            why = f"fx cannot trace it: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            return _FxEntry(None, None, why, untraceable=not _holds_units(module))
        if not _flat_inputs(graph):
            return _FxEntry(None, None, "fx traced a different signature (outputs in a class it cannot "
                                        "rebuild)", untraceable=not _holds_units(module))
        _drop_specialization_asserts(graph)
        gm = fx.GraphModule(module, graph)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        values = pytree.tree_leaves(values)
        if len(placeholders) != len(values):
            return _FxEntry(None, None, "fx traced a different signature",
                            untraceable=not _holds_units(module))
        params = tuple((p.dtype, p.device, tuple(p.shape)) for p in module.parameters())
        shared = self.shared.get((key, params, gm.code))
        if shared is not None and _baked_checks(module, shared) is not None:
            return shared  # an identical layer was captured already: its code reads this one's parameters
        entry = self._rewrite_fx(module, gm, values)
        self.shared[(key, params, gm.code)] = entry
        return entry

    def _rewrite_fx(self, module: torch.nn.Module, gm: fx.GraphModule, values: list[Any]) -> _FxEntry:
        _propagate_fake(gm, values)
        capture = self._new_capture(describe_mode(module, [v for v in values if isinstance(v, torch.Tensor)]))
        work, _ = self._rewrite(gm, capture, module)
        missing = _unresolved_attributes(work.graph, module)
        if missing:
            capture.error = f"the traced graph holds values the module does not ({missing}): left unfused"
            return _FxEntry(None, capture, capture.error)
        baked = (*baked_attributes(work.graph), *_settings(module))
        return _FxEntry(type(work).forward, capture, baked=baked)


class LeafTracer(fx.Tracer):
    """fx's tracer, also keeping other fused units (blocks) as module calls, and each
    `torch.autograd.Function.apply` as one call: fx alone traces into the Function's forward and
    the graph loses its backward (a straight-through estimator, a gradient reversal layer would
    train with the gradient of their forward)."""

    def __init__(self, leaves: Callable[[torch.nn.Module], bool]) -> None:
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        # a submodule with hooks stays a call, which runs them (fx would trace its forward alone)
        return self._leaves(m) or has_hooks(m) or super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        """fx's trace; a forward that assigns to its modules' state (a cache, a counter) fails it:
        the graph would not do that when it runs, and the assignments (of Proxies) are undone. So
        does a forward that writes into a container it is handed (`create_args_for_root`), and a
        graph whose generated code does not compile.

        The placeholders lose their defaults: a unit calls its graph with every argument, defaults
        bound (FxUnit), and fx writes them into the unpacking of its containers' leaves as invalid
        Python where an argument is a container (Mask2Former's list of feature maps beside its
        defaulted flags; a tuple default, YOLOS's `img_size=(800, 1344)`, one placeholder per
        element, each defaulting to the whole tuple)."""
        state = _module_state(root) if isinstance(root, torch.nn.Module) else None
        try:
            graph = self._trace(root, concrete_args)
        finally:
            changed = _restore_module_state(state) if state is not None else []
        if changed:
            raise fx.proxy.TraceError(f"its forward assigns to {', '.join(changed[:3])}: a graph would not")
        for node in graph.nodes:
            if node.op == "placeholder":
                node.args = ()
        compile(graph.python_code(root_module="self").src, "<trifuse fx trace>", "exec")  # SyntaxError
        return graph

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool,
                             concrete_args: dict[str, Any] | tuple[Any, ...] | None = None
                             ) -> tuple[Any, list[Any]]:
        """fx's, the forward watched: one that writes into a list, dict or tuple of lists it is
        handed fails the trace. Wan's VAE keeps its causal convolutions' cache in a list each block
        is passed (`feat_cache[i] = x[:, :, -2:]`, `feat_idx[0] += 1`): fx runs that write once, on
        its own copy, the graph never, and every later call read a stale cache (an output 1e-2
        off). Dynamo replays such writes: those blocks are its. (Not where the forward takes
        *args or **kwargs: fx rewrites that function's code.)"""
        inner = inspect.unwrap(root_fn)
        code = getattr(inner, "__code__", None)
        if code is None or code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]

        @functools.wraps(root_fn)
        def watched(*args: Any) -> Any:
            before = [(i, *pytree.tree_flatten(a)) for i, a in enumerate(args) if type(a) in _FX_CONTAINERS]
            out = root_fn(*args)
            for i, leaves, spec in before:
                now, now_spec = pytree.tree_flatten(args[i])
                if now_spec != spec or any(a is not b for a, b in zip(now, leaves)):
                    name = names[i] if i < len(names) else f"argument {i}"
                    raise fx.proxy.TraceError(f"its forward writes into its argument `{name}` (a "
                                              f"{type(args[i]).__name__}): a graph would not")
            return out

        return super().create_args_for_root(watched, is_module, concrete_args)

    def _trace(self, root: Any, concrete_args: dict[str, Any] | None) -> fx.Graph:
        original = torch.autograd.Function.__dict__["apply"]
        tracer = self

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, fx.Proxy) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
                return tracer.create_proxy("call_function", _function_apply(cls), args, kwargs)
            return original.__func__(cls, *args, **kwargs)

        torch.autograd.Function.apply = classmethod(apply)
        try:
            removed = _trace_into_wrapped_functions()
            try:
                return super().trace(root, concrete_args)
            except Exception:
                if not removed:
                    raise
            finally:
                _WRAPPED_FUNCTIONS.update(removed)
            return super().trace(root, concrete_args)  # the wrapped functions as calls, as fx keeps them
        finally:
            torch.autograd.Function.apply = original

    def create_arg(self, a: Any) -> Any:
        # fx turns every dict into a plain dict: a block returning a Hugging Face ModelOutput would
        # hand its caller a dict, and the caller's `out[0]` or `out.last_hidden_state` fails
        # (SqueezeBERT's encoder). A dict subclass with string keys is rebuilt as its own type.
        if isinstance(a, dict) and type(a) is not dict and not isinstance(a, fx.immutable_collections.immutable_dict) \
                and all(isinstance(k, str) for k in a):
            return self.create_node("call_function", type(a), (), {k: self.create_arg(v) for k, v in a.items()})
        return super().create_arg(a)


def _module_state(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module, dict, dict]]:
    """Each module's attribute bindings, and the contents of its list and dict attributes (its
    parameters, buffers and submodules among them), before an fx trace runs its forward."""
    state = []
    for path, module in root.named_modules():
        contents = {name: (value, list(value) if isinstance(value, list) else dict(value))
                    for name, value in vars(module).items() if isinstance(value, (list, dict))}
        state.append((path, module, dict(vars(module)), contents))
    return state


# what fx itself adds to the root: the tensor constants its graph reads
_FX_CONSTANT = ("_tensor_constant", "_param_constant")


def _restore_module_state(state: list[tuple[str, torch.nn.Module, dict, dict]]) -> list[str]:
    """Undoes what a traced forward did to its modules, and names what it did. fx runs the
    forward with Proxies: a forward that caches into `self` (Qwen-Image 2.1's rope: `self.freqs =
    [f.to(device) for f in self.freqs]`, AnyFlow's `self._freqs_cache`) would keep Proxies there,
    and every later call would fail, fused or not."""
    changed = []
    for path, module, bindings, contents in state:
        attributes = vars(module)
        where = f"{path}." if path else "self."
        for name in [name for name in attributes if name not in bindings]:
            if not name.startswith(_FX_CONSTANT) or _holds_proxy(attributes[name]):
                changed.append(where + name)
                del attributes[name]
        changed += [where + name for name, value in bindings.items() if attributes.get(name, value) is not value]
        attributes.update(bindings)
        for name, (value, saved) in contents.items():
            if isinstance(value, list):
                if len(value) != len(saved) or any(a is not b for a, b in zip(value, saved)):
                    changed.append(where + name)
                    value[:] = saved
            elif list(value) != list(saved) or any(value[key] is not saved[key] for key in saved):
                changed.append(where + name)
                value.clear()
                value.update(saved)
    return changed


def _holds_proxy(value: Any) -> bool:
    return any(isinstance(leaf, fx.Proxy) for leaf in pytree.tree_leaves(value))


# fx.wrap's registry: functions each fx trace keeps as one call, (id(globals), name) -> globals.
_WRAPPED_FUNCTIONS: dict = getattr(fx._symbolic_trace, "_wrapped_fns_to_patch", {})


def _trace_into_wrapped_functions() -> dict:
    """Takes out of fx.wrap's registry the functions other libraries wrapped (torch's own stay),
    and returns them to put back after the trace: fx would keep each one call no pattern sees into,
    and they hold what the patterns look for (timm's `maybe_add_mask` between an explicit
    attention's scores and its softmax; torchvision's Swin attention whole). One whose code fx
    cannot trace (control flow on a size) fails the trace, and the caller traces again with them
    wrapped."""
    if not isinstance(_WRAPPED_FUNCTIONS, dict):
        return {}
    removed = {key: frame_globals for key, frame_globals in list(_WRAPPED_FUNCTIONS.items())
               if not str(frame_globals.get("__name__", "")).startswith("torch.")}
    for key in removed:
        del _WRAPPED_FUNCTIONS[key]
    return removed


def wrapped_calls(graph: fx.Graph) -> list[Callable[..., Any]]:
    """The functions of other libraries an fx graph calls without seeing into them (fx.wrap'd
    ones its code fx could not trace, e.g. torchvision's shifted_window_attention)."""
    if not isinstance(_WRAPPED_FUNCTIONS, dict):
        return []
    names = {name for (_, name), g in _WRAPPED_FUNCTIONS.items()
             if not str(g.get("__name__", "")).startswith("torch.")}
    return [n.target for n in graph.nodes
            if n.op == "call_function" and isinstance(n.target, types.FunctionType)
            and n.target.__name__ in names and not n.target.__module__.startswith("torch.")]


@functools.cache
def _function_apply(cls: type) -> Callable[..., Any]:
    """`cls.apply` as a plain function (what an fx graph node can call)."""

    def apply(*args: Any, **kwargs: Any) -> Any:
        return cls.apply(*args, **kwargs)

    apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
    return apply


_FX_CONTAINERS = (tuple, list, torch.Size, dict)


def _fx_unsupported(v: Any) -> str | None:
    """Why an fx unit cannot take `v` as an argument (None when it can): tensors, plain values,
    and tuples, lists, torch.Size and dicts of them (CoaT hands its blocks the token grid as a
    tuple, its parallel blocks a list of grids; CrossViT a list of token tensors)."""
    if type(v) in _FX_CONTAINERS:
        return next((w for w in map(_fx_unsupported, v.values() if type(v) is dict else v) if w), None)
    return _unsupported(v, containers=False)


def _fx_key(v: Any) -> Any:
    """An fx argument in the call key: a tensor by dtype, device type and rank (the graph holds
    no size), a plain value by value (the graph holds it as a constant), a container by its
    structure and its items' keys."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.device.type, v.dim()
    if type(v) is dict:
        return dict, tuple((k, _fx_key(x)) for k, x in v.items())
    if type(v) in _FX_CONTAINERS:
        return type(v), tuple(map(_fx_key, v))
    return type(v), v


def _flat_inputs(graph: fx.Graph) -> bool:
    """A graph fx traced with containers among its arguments takes their leaves flattened back
    into the containers (pytree code generation) and returns its outputs flattened: give it a
    placeholder per leaf, called as such, and its outputs in their own structure again. False
    where that structure holds a class that cannot be rebuilt in the graph."""
    codegen = graph._codegen
    if not isinstance(codegen, fx.graph._PyTreeCodeGen):
        return True
    out_spec = codegen.pytree_info.out_spec
    if out_spec is not None:
        output = graph.output_node()
        try:
            with graph.inserting_before(output):
                structured = _rebuilt_output(graph, iter(output.args[0]), out_spec)
        except TypeError:
            return False
        output.args = (structured,)
    graph._codegen = fx.graph.CodeGen()
    return True


def _rebuilt_output(graph: fx.Graph, leaves: Iterator[Any], spec: pytree.TreeSpec) -> Any:
    """The output's structure around its flattened leaves: tuples, lists and dicts as they are,
    a dict subclass with string keys (a Hugging Face ModelOutput: Mask2Former's transformer
    module takes a list and returns one) or a named tuple built by a node that calls its class."""
    if spec.is_leaf():
        return next(leaves)
    children = [_rebuilt_output(graph, leaves, child) for child in spec.children()]
    kind, keys = spec.type, spec.context
    if kind in (tuple, list):
        return kind(children)
    if kind is dict:
        return dict(zip(keys, children))
    if isinstance(kind, type) and issubclass(kind, dict) and isinstance(keys, (list, tuple)) \
            and len(keys) == len(children) and all(isinstance(k, str) for k in keys):
        return graph.call_function(kind, (), dict(zip(keys, children)))
    if isinstance(keys, type) and issubclass(keys, tuple) and hasattr(keys, "_fields"):  # pytree's namedtuple
        return graph.call_function(keys, tuple(children))
    raise TypeError(f"{kind} cannot be rebuilt in a graph")


def _drop_specialization_asserts(graph: fx.Graph) -> None:
    """fx checks each constant argument against its traced value; the cache key already does."""
    from torch.fx._symbolic_trace import _assert_is_none

    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (_assert_is_none, torch._assert):
            graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and node.target is operator.eq:
            graph.erase_node(node)


def _propagate_fake(gm: fx.GraphModule, values: list[Any]) -> None:
    """Example values (fake tensors: no compute, no side effects) on every node, for filters."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values]
    try:
        FakeTensorProp(gm, mode).propagate(*fake)
    except Exception:  # noqa: BLE001  (no metadata: filters that need it reject, nothing breaks)
        return
    finally:
        # Under autocast, the propagation's F.linear cast the real parameters (get_attr) to the
        # autocast dtype as fake tensors, and autocast caches such casts per parameter for the rest
        # of the autocast region: the real forward that follows would read fake weights (FNet's
        # layers under fp16 autocast raised in the backward). Only the cache goes; casts recur.
        torch.clear_autocast_cache()


def _unresolved_attributes(graph: fx.Graph, module: torch.nn.Module) -> str | None:
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            obj: Any = module
            for part in node.target.split("."):
                obj = getattr(obj, part, _MISSING)
                if obj is _MISSING:
                    return node.target
    return None


_MISSING = object()


def _autocast_state() -> tuple:
    return tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None)
        for d in ("cuda", "cpu")
    )
