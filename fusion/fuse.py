"""`fuse(model)`: find what to capture in a model and install the rewritten forwards, in place.

Progressive capture (DESIGN.md, "Capture"):

1. Blocks: the modules held in a `ModuleList` or `ModuleDict` (transformer layers), grouped by class. A block
   class fx can trace gets an `FxUnit`; otherwise (every Hugging Face layer today) a
   `DynamoUnit`: one Dynamo capture per class, shared by every identical layer.
2. The rest: from the root down, each module fx can trace (with blocks kept as calls) and that
   holds something a pattern looks for gets an `FxUnit` (a final LayerNorm, an MLP head);
   modules fx cannot trace are named in the report and their children tried instead; a norm fx
   cannot trace (a leaf branching on its weight's dtype, T5LayerNorm) gets a `DynamoUnit`, and so
   does a module fx cannot trace that computes an attention and holds no block (Perceiver's
   cross-attention layers and decoders), one per class.
3. The head: the outermost module on the way to the blocks whose forward computes a loss (the
   model, or the transformers model inside a wrapper: PEFT's PeftModel -> LoraModel -> model, a
   user's module calling the LM) gets a `HeadUnit`, its body fenced off: the LM head and the loss.

Nothing is captured at `fuse` time: captures happen on the first call in each mode, with the
real arguments (Dynamo needs them; fx needs the constant ones). `report(model)` tells what was
installed where, and after a forward what each capture replaced.
"""
import functools
import inspect
import types
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx

from ..patterns import PATTERNS
from ..patterns._base import available
from .capture import (
    DynamoUnit,
    FxUnit,
    HeadUnit,
    LeafTracer,
    Unit,
    checkpoints_per_call,
    installed_unit,
    wrapped_by_accelerate,
    wrapped_calls,
)
from .graphs import BlockGraphs
from .match import compile_pattern, matches
from .normalize import canonicalize, squares_as_powers
from .rewriter import select_patterns


@dataclass
class Note:
    """Something `fuse` left as it was, and why (kind "left"), or did in a way worth saying."""

    path: str
    cls: str
    reason: str
    kind: str = "left"


@dataclass
class FuseRecord:
    families: tuple[str, ...] | None
    notes: list[Note]


_RECORDS: "weakref.WeakKeyDictionary[torch.nn.Module, FuseRecord]" = weakref.WeakKeyDictionary()



def fuse(model: torch.nn.Module, *, ops: Iterable[str] | None = None, skip_logits: bool = False,
         cuda_graphs: bool = False, verbose: bool = False) -> torch.nn.Module:
    """Swaps trifuse's fused ops into `model`, in place, and returns the same object.

    Args:
        model: any torch.nn.Module. Its class, methods, Parameter objects and state_dict keys
            are kept; train()/eval(), autocast, devices and new batch or sequence lengths keep
            working. Modules that cannot be captured run exactly as before.
        ops: the families to fuse (`trifuse.fusion.FAMILIES`: "attention", "layer_norm",
            "rms_norm", "bias_gelu", "gated_activation", "dropout_add", "residual_stream",
            "cross_entropy", "rotary", "group_norm", "xielu");
            None for all. "residual_stream" brings the norm families with it.
        skip_logits: in training calls (`model.training` and grad enabled) whose forward computes
            the loss from an LM head, return the logits as None so that the head and the loss fuse
            into `linear_cross_entropy` and the (tokens x vocab) logits are never materialized
            (Liger-Kernel's `skip_logits`). Off by default: the model returns its logits, and the
            loss alone is fused on them. Eval calls, calls without grad and calls computing no
            loss always return the logits. The report says where logits were skipped.
        cuda_graphs: replay each fused block's training forward and backward from CUDA graphs
            (`trifuse.fusion.graphs`), from the second training call of a block with the same
            shapes on: a step's host time then no longer grows with the block count. A block's
            outputs are overwritten when it runs again (clone activations kept across steps);
            eval, no-grad and gradient-checkpointed calls run ungraphed. Off by default.
        verbose: print what was installed now, and each capture's table when it happens.

    Returns:
        `model`. Call `trifuse.report(model)` for what was replaced, where, and what was not.

    Raises:
        TypeError if model is not a torch.nn.Module; ValueError for an unknown family in ops.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"trifuse.fuse: model must be a torch.nn.Module, got {type(model).__name__}")
    families = None if ops is None else tuple([ops] if isinstance(ops, str) else ops)
    patterns = select_patterns(PATTERNS, families)
    if model in _RECORDS or any(installed_unit(m) is not None for m in model.modules()):
        raise ValueError("trifuse.fuse: this model is already fused; fuse a fresh copy to change `ops`")
    _drop_rebound_forwards(model)
    notes: list[Note] = []
    blocks = _find_blocks(model)
    block_set = {id(m) for members in blocks.values() for _, m in members}

    def is_leaf(m: torch.nn.Module) -> bool:
        return id(m) in block_set or "forward" in m.__dict__

    for cls, members in blocks.items():
        unit = _unit_for_blocks(cls, members, patterns, verbose, is_leaf)
        if cuda_graphs and isinstance(unit, DynamoUnit):
            unit.graphs = BlockGraphs()
        for path, module in members:
            if wrapped_by_accelerate(module):
                unit.install(module, path, "_old_forward")
                notes.append(Note(path, cls.__name__, "accelerate's hook kept: the fused forward runs inside it",
                                  kind="note"))
                continue
            if "forward" in module.__dict__:
                notes.append(Note(path, cls.__name__, "has its own forward attribute: left as it is"))
                continue
            unit.install(module, path)
    _visit(model, "", patterns, verbose, is_leaf, notes, {})
    if blocks:
        _train_without_kv_cache(model, notes)
    found = _loss_module(model, block_set)
    head = _install_head(*found, patterns, verbose, block_set, notes, skip_logits) if found else None
    if skip_logits and head is None:
        notes.append(Note("(model)", type(model).__name__, "skip_logits: no LM head and loss capture was installed "
                          "(no loss in the model's forward, or fx traced it whole): the logits are returned",
                          kind="note"))
    _RECORDS[model] = FuseRecord(families, notes)
    if verbose:
        from .report import report

        print(report(model).table())
    return model


def _drop_rebound_forwards(model: torch.nn.Module) -> None:
    """Removes instance `forward` attributes that are only the module's own class forward bound
    to it again. Pickling a fused model (`torch.save(model)`) stores each installed forward as
    `getattr(module, "forward")`, so the loaded model holds its class's forwards as instance
    attributes: it runs unfused, as it should (a fused forward is this process's state), but
    `fuse` took every such module for one with a forward of its own and left it alone."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, types.MethodType) and forward.__self__ is module \
                and forward.__func__ is getattr(type(module), "forward", None):
            del module.__dict__["forward"]


def _train_without_kv_cache(model: torch.nn.Module, notes: list[Note]) -> None:
    """The outermost modules whose forward takes `use_cache` (Hugging Face decoders, the model
    itself or one inside a wrapper) get a forward pre-hook: a training call (module.training,
    grad enabled) that does not set use_cache runs with use_cache=False. transformers builds a
    KV cache in such calls unless told not to (Trainer does not say), and a block called with a
    cache runs unfused: a capture of it would recompile for every layer. Nothing reads a cache
    built in training; transformers itself turns it off under gradient checkpointing. A call
    that passes use_cache (True included), an eval call and a call without grad (generate) run
    as the caller asked."""
    hooked: list[str] = []
    for path, module in model.named_modules():
        if any(h == "" or path.startswith(h + ".") for h in hooked):
            continue  # inside a module already hooked: it passes use_cache on
        try:
            params = list(inspect.signature(type(module).forward).parameters)
        except (TypeError, ValueError):
            continue
        if "use_cache" not in params:
            continue
        hooked.append(path)
        # a model fused before, pickled and loaded, has the hook already
        if not any(isinstance(h, functools.partial) and h.func is _no_cache_in_training
                   for h in module._forward_pre_hooks.values()):
            module.register_forward_pre_hook(
                functools.partial(_no_cache_in_training, positional=params.index("use_cache") - 1), with_kwargs=True)
        notes.append(Note(path or "(model)", type(module).__name__,
                          "training calls that do not set use_cache run with use_cache=False (a KV cache would "
                          "keep the blocks unfused; transformers does the same under gradient checkpointing)",
                          kind="note"))


def _no_cache_in_training(module, args, kwargs, *, positional: int):
    """The pre-hook of `_train_without_kv_cache`; `positional`: how many positional arguments
    come before use_cache (more than that, and the caller set it)."""
    if module.training and kwargs.get("use_cache") is None and len(args) <= positional and torch.is_grad_enabled():
        return args, {**kwargs, "use_cache": False}
    return None


def _loss_module(model: torch.nn.Module, block_set: set[int]) -> tuple[torch.nn.Module, str] | None:
    """The outermost module, on the way from the model to its blocks, whose forward computes a
    loss (its source names one): the model itself, or the model a wrapper holds (PEFT's
    PeftModel -> LoraModel -> the transformers model; a user's module calling an LM with labels).
    Returns (module, its path), or None."""
    queue = [(model, "")]
    while queue:
        module, path = queue.pop(0)
        if id(module) in block_set or not blocks_of(module, block_set):
            continue
        if _computes_loss(module):
            return module, path or "(model)"
        queue.extend((child, f"{path}.{name}" if path else name) for name, child in module.named_children())
    return None


def _computes_loss(module: torch.nn.Module) -> bool:
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    # DistilBERT's forward calls a CrossEntropyLoss held as a child (`self.mlm_loss_fct`)
    return any(word in source for word in ("cross_entropy", "CrossEntropyLoss", "loss_function")) \
        or any(isinstance(m, torch.nn.CrossEntropyLoss) for m in module.children())


def _install_head(model: torch.nn.Module, path: str, patterns, verbose, block_set: set[int], notes: list[Note],
                  skip_logits: bool = False) -> HeadUnit | None:
    """`model` (the fused model, or the one inside a wrapper at `path`) computes a loss in its
    forward, and fx could not trace it whole: a Dynamo capture of that forward with its body
    fenced off holds the LM head and the loss (issue 9)."""
    if installed_unit(model) is not None or "forward" in model.__dict__:
        return None
    if not any(p.family == "cross_entropy" and all(available(op) for op in p.ops) for p in patterns):
        return None
    head = HeadUnit(type(model), patterns, verbose, skip_logits)
    # Every module between the model and its blocks is fenced, not only its children: a head may
    # call a grandchild directly (OPT's `self.model.decoder(...)`).
    for name, sub in model.named_modules():
        if sub is not model and id(sub) not in block_set and blocks_of(sub, block_set) \
                and "forward" not in sub.__dict__ and not isinstance(sub, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            head.fence(sub, name)
    head.install(model, path)
    fenced = ", ".join(head.fenced) or "nothing: its blocks are traced into the capture"
    skip = "; skip_logits: training calls return no logits" if skip_logits else ""
    notes.append(Note(path, type(model).__name__, f"head and loss captured by Dynamo; fenced off: {fenced}{skip}",
                      kind="note"))
    return head


def blocks_of(module: torch.nn.Module, block_set: set[int]) -> bool:
    return any(id(m) in block_set for m in module.modules())


def _find_blocks(model: torch.nn.Module) -> dict[type, list[tuple[str, torch.nn.Module]]]:
    """Children of ModuleLists (and ModuleDicts: PyTorch-native code such as torchtitan keys its
    layers by index) that have submodules of their own, outermost lists only. A list or dict
    inside one (`ModuleDict({"layers": ModuleList(...)})`) is a container, not a block: its own
    children are looked at."""
    blocks: dict[type, list[tuple[str, torch.nn.Module]]] = {}
    inside: set[int] = set()
    for path, module in model.named_modules():
        if id(module) in inside:
            inside.update(id(m) for m in module.children())
            continue
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for name, child in module.named_children():
                if next(child.children(), None) is None or isinstance(child, (torch.nn.ModuleList,
                                                                                 torch.nn.ModuleDict)):
                    continue
                blocks.setdefault(type(child), []).append((f"{path}.{name}" if path else name, child))
                inside.update(id(m) for m in child.children())
    return blocks


def _unit_for_blocks(cls, members, patterns, verbose, is_leaf) -> Unit:
    module = members[0][1]
    graph, _ = _trace(module, is_leaf)
    if graph is not None and not _hides_attention_from_fx(graph, module):
        return FxUnit(module, patterns, verbose, is_leaf)
    return DynamoUnit(cls, patterns, verbose)


def _softmax(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and name == "softmax"


def _hides_attention_from_fx(graph: fx.Graph, module: torch.nn.Module) -> bool:
    """Whether an fx graph of `module` keeps an attention in a call no pattern looks into: an
    nn.MultiheadAttention (a module call; Dynamo traces through it to
    F.multi_head_attention_forward, which the attention patterns fuse: nn.TransformerDecoderLayer,
    which fx traces), or a function fx.wrap'd by its library whose code fx cannot trace, with an
    attention in it (torchvision's Swin: shifted_window_attention branches on its padding) or its
    result softmaxed (torchvision's MViT: `_add_rel_pos` adds the relative positions to the
    scores, sizes read as Python numbers); Dynamo traces all three."""
    if any(node.op == "call_module" and isinstance(module.get_submodule(node.target),
                                                   torch.nn.MultiheadAttention) for node in graph.nodes):
        return True
    wrapped = wrapped_calls(graph)
    if any(node.op == "call_function" and node.target in wrapped and any(_softmax(u) for u in node.users)
           for node in graph.nodes):
        return True  # the scores go through the call on their way to the softmax (torchvision's MViT)
    for fn in wrapped:
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        if any(word in source for word in _ATTENTION_WORDS):
            return True
    return False


def _traced_into(module: torch.nn.Module, is_leaf) -> list[torch.nn.Module]:
    """`module` and the modules a trace of it goes into (not the leaves it keeps as calls)."""
    found, stack = [], [module]
    while stack:
        m = stack.pop()
        found.append(m)
        stack += [c for c in m.children() if not is_leaf(c)]
    return found


def _trace(module: torch.nn.Module, is_leaf) -> tuple[fx.Graph | None, str]:
    """(graph, "") if fx traces the module with its default arguments as constants, else
    (None, why not)."""
    try:
        sig = inspect.signature(type(module).forward)
    except (TypeError, ValueError) as e:
        return None, f"no signature: {e}"
    params = list(sig.parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None, "forward takes *args or **kwargs"
    inside = [m for m in _traced_into(module, is_leaf) if checkpoints_per_call(type(m))]
    if inside:
        # transformers' GradientCheckpointingLayer decides per call whether to checkpoint: a trace
        # would keep the choice of its own call, and lose the checkpoint (its body traced inline)
        return None, f"{type(inside[0]).__name__}'s forward checkpoints under gradient checkpointing, per call"
    concrete = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    try:
        return LeafTracer(is_leaf).trace(module, concrete_args=concrete), ""
    except Exception as e:  # noqa: BLE001  (fx cannot trace it: the caller decides what next)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _visit(module: torch.nn.Module, path: str, patterns, verbose, is_leaf, notes: list[Note],
           units: dict[type, DynamoUnit]) -> None:
    """Installs units from `module` down (step 2 of the module docstring). units: the Dynamo units
    made here so far, one per class, shared by the modules of that class as blocks share theirs."""
    if is_leaf(module):
        return
    if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
        for name, child in module.named_children():
            _visit(child, f"{path}.{name}" if path else name, patterns, verbose, is_leaf, notes, units)
        return
    graph, error = _trace(module, is_leaf)
    if graph is None:
        childless = next(module.children(), None) is None
        if childless and _computes_a_norm(module):
            # A leaf fx cannot trace: a norm whose forward branches on a parameter's dtype
            # (T5LayerNorm) is captured by Dynamo, which guards on it.
            DynamoUnit(type(module), patterns, verbose).install(module, path or "(model)")
            return
        if not any(is_leaf(m) for m in module.modules() if m is not module) and _computes_attention(module):
            # An attention outside the repeated blocks (Perceiver's cross-attention layers and its
            # decoders; an attention core with no children, scores written in place): split into
            # its submodules, the attention would be cut from its softmax's neighbours (fx cannot
            # trace the attention module either); captured whole by Dynamo, as a block is. Inside
            # a capture of the head, this forward shows Dynamo its own code.
            unit = units.get(type(module))
            if unit is None:
                unit = units[type(module)] = DynamoUnit(type(module), patterns, verbose)
            unit.install(module, path or "(model)")
            notes.append(Note(path or "(model)", type(module).__name__, f"fx cannot trace it ({error}): captured "
                              "whole by Dynamo (an attention outside the repeated blocks)", kind="note"))
            return
        if childless:
            return  # nothing a pattern looks for
        notes.append(Note(path or "(model)", type(module).__name__, f"fx cannot trace it ({error}); "
                          "its submodules were tried instead"))
        for name, child in module.named_children():
            _visit(child, f"{path}.{name}" if path else name, patterns, verbose, is_leaf, notes, units)
        return
    if _hides_attention_from_fx(graph, module):
        DynamoUnit(type(module), patterns, verbose).install(module, path or "(model)")
        return
    gm = canonicalize(fx.GraphModule(module, graph), module)
    if _has_candidates(gm.graph, patterns):
        FxUnit(module, patterns, verbose, is_leaf).install(module, path or "(model)")


# sqrt: rsqrt and x / sqrt(var + eps); norm(: the 2-norm an L2 norm divides by; normalize(: F.normalize
_NORM_WORDS = ("layer_norm", "rms_norm", "sqrt", ".var(", "var_mean", "norm(", "normalize(")
_ATTENTION_WORDS = ("softmax", "Softmax", "scaled_dot_product_attention", "multi_head_attention_forward",
                    "attention_interface", "ALL_ATTENTION_FUNCTIONS")


def _computes_attention(module: torch.nn.Module) -> bool:
    """Whether some module in `module`'s subtree (itself included) computes an attention: an
    nn.MultiheadAttention, or a forward whose source names a softmax or an attention function
    (transformers' attention interface)."""
    for m in module.modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            return True
        try:
            source = inspect.getsource(type(m).forward)
        except (OSError, TypeError):
            continue
        if any(word in source for word in _ATTENTION_WORDS):
            return True
    return False


def _computes_a_norm(module: torch.nn.Module) -> bool:
    """Whether a module's own forward (source) computes a LayerNorm or RMSNorm."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return any(word in source for word in _NORM_WORDS)


def _has_candidates(graph: fx.Graph, patterns) -> bool:
    """Whether some pattern whose op exists matches the graph's structure (filters aside: they
    need the example values only a call brings). Stage-0 and -1 patterns start from what models
    write, so they find every place a later stage could. The graph is a throwaway copy: its
    softmaxes may lose their dtype arguments, its `type_as` calls become casts."""
    compiled = [compile_pattern(p) for p in patterns if p.stage <= 1 and all(available(op) for op in p.ops)]
    squares_as_powers(graph)  # what a float x * x becomes once example values show x's dtype

    def found() -> bool:
        return any(next(matches(cp, n), None) is not None for cp in compiled for n in graph.nodes
                   if cp.is_candidate(n))

    if found():
        return True
    # A softmax's dtype argument may be its input's own dtype, which normalize.py drops once
    # example values show it (Falcon's `dtype=hidden_states.dtype`): without them, try it dropped.
    softmaxes = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.softmax
                 and len(n.args) == 3 and n.args[2] is not None]
    for n in softmaxes:
        n.args = (*n.args[:2], None)
    # `y.type_as(x)` is `y.to(<x's dtype>)` once example values show x's dtype and device:
    # without them, try it as the cast to `x.dtype` (a node, as `.to(x.dtype)` is written).
    typed = [n for n in graph.nodes if n.op == "call_method" and n.target == "type_as" and len(n.args) == 2
             and not n.kwargs]
    for n in typed:
        with graph.inserting_before(n):
            dtype = graph.call_function(getattr, (n.args[1], "dtype"))
        n.target, n.args = "to", (n.args[0], dtype)
    return bool(softmaxes or typed) and found()
