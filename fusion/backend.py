"""The pattern library inside `torch.compile`: two TorchDynamo backends.

    torch.compile(model, backend="trifuse")            rewrite the Dynamo graph, run it eagerly
    torch.compile(model, backend="trifuse_inductor")   rewrite, then compile the rest with Inductor

Both work after `pip install` without importing trifuse: setup.py registers them under the
`torch_dynamo_backends` entry point, which Dynamo reads when it meets an unknown backend name.
`import trifuse` also registers them when no entry point did (a source checkout on PYTHONPATH).

`trifuse`: canonicalize (normalize.py) and rewrite (rewriter.py) each graph Dynamo hands over,
exactly as `fuse()` does for its captures, and return it to run eagerly: set-up time is Dynamo's
tracing and the rewrite, no code generation. Replacements call trifuse's public functions, which
take their thin eager path at run time.

`trifuse_inductor`: the same rewrite, then `torch._inductor.compile_fx` on the rewritten graph.
AOTAutograd traces the public functions into the registered `trifuse::` custom ops (their fake
and autograd implementations), which Inductor keeps opaque: the trifuse kernels run forward and
backward, Inductor generates everything around them. With `mode="reduce-overhead"` the graph is
replayed by CUDA graphs: the ops draw their dropout seeds on the device (no host sync), so every
replay draws fresh masks.

`trifuse.report(compiled_model)` lists what each backend replaced in the graphs holding that
model's parameters, and in the graphs compiled while one of the model's calls was running (the
graph after a graph break, such as GPT-2's loss, reads no parameter).
"""
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

from ..patterns import PATTERNS
from .capture import Capture, rewrite_checkpoints
from .normalize import canonicalize
from .rewriter import rewrite_graph, select_patterns

log = logging.getLogger("trifuse")

# Parameter -> the captures of compiled graphs that read it (what report(compiled) shows); keyed
# by identity (tensors compare elementwise).
_COMPILED: "WeakIdKeyDictionary[torch.Tensor, list[Capture]]" = WeakIdKeyDictionary()
# Module -> the captures of graphs compiled while a call of it was on the Python stack.
_COMPILED_IN: "WeakIdKeyDictionary[torch.nn.Module, list[Capture]]" = WeakIdKeyDictionary()


def _calling_modules() -> list[torch.nn.Module]:
    """The modules whose methods are on the Python stack: Dynamo compiles a frame from inside the
    call that runs it, so these are the model being compiled and whatever called it."""
    found: dict[int, torch.nn.Module] = {}
    frame = sys._getframe(1)
    while frame is not None:
        if "self" in frame.f_code.co_varnames[:1]:
            obj = frame.f_locals.get("self")
            if isinstance(obj, torch.nn.Module):
                found.setdefault(id(obj), obj)
        frame = frame.f_back
    return list(found.values())


def _attach(table: WeakIdKeyDictionary, key: Any, capture: Capture) -> None:
    captures = table.get(key)
    if captures is None:
        table[key] = captures = []
    if not captures or captures[-1] is not capture:
        captures.append(capture)


def _rewrite(gm: fx.GraphModule, example_inputs: list[Any], backend: str, eager: bool = False) -> fx.GraphModule:
    """The graph rewritten. `eager`: it runs as it is, so the bodies of its activation checkpoints
    are rewritten too and run by torch.utils.checkpoint keeping the RNG state for the recompute.
    Otherwise (AOTAutograd, Inductor) they stay as captured: their recompute would run a trifuse
    op again, drawing a new dropout seed where Inductor replays its own RNG."""
    compile_id = gm.meta.get("dynamo_compile_id")
    capture = Capture(mode=f"{backend}, graph {compile_id}" if compile_id is not None else backend)
    capture.frame = getattr(compile_id, "frame_id", None)
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    work = fx.GraphModule(gm, graph)
    try:
        canonicalize(work)
        patterns = select_patterns(PATTERNS, None)
        capture.log = rewrite_graph(work.graph, patterns)
        if eager:
            rewrite_checkpoints(work, patterns, capture.log)
        work.recompile()
    except Exception as e:  # noqa: BLE001  (never break a model: compile the graph as captured)
        capture.error = f"{type(e).__name__}: {e}"
        work = gm
    capture.graphs = 1
    work.meta["trifuse_capture"] = capture
    for t in example_inputs:
        if isinstance(t, torch.nn.Parameter):
            _attach(_COMPILED, t, capture)
    for module in _calling_modules():
        _attach(_COMPILED_IN, module, capture)
    return work


_EAGER_MODES = (None, "default", "reduce-overhead")


def trifuse_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                    options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """`backend="trifuse"`: the graph rewritten with trifuse's patterns, run eagerly.

    `mode="reduce-overhead"` replays the rewritten forward and backward as CUDA graphs (torch's
    "cudagraphs" backend over AOTAutograd: the trifuse ops are traced as registered ops, and
    their dropout seeds come from the device generator, which graph replays advance). Graphs on
    CPU run as they are. Inductor's modes and `options` belong to `backend="trifuse_inductor"`.
    """
    if mode not in _EAGER_MODES:
        raise ValueError(f"torch.compile(backend='trifuse'): mode must be one of 'default', 'reduce-overhead', "
                         f"got {mode!r} (Inductor's modes need backend='trifuse_inductor')")
    if options:
        raise ValueError(f"torch.compile(backend='trifuse') takes no options, got {sorted(options)} "
                         "(Inductor's options need backend='trifuse_inductor')")
    work = _rewrite(gm, example_inputs, "backend=trifuse", eager=mode != "reduce-overhead")
    if mode == "reduce-overhead":
        from torch._dynamo.backends.cudagraphs import cudagraphs

        return cudagraphs(work, example_inputs)
    return work.forward


def trifuse_inductor_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                             options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """`backend="trifuse_inductor"`: the rewritten graph compiled by Inductor, the trifuse ops
    kept opaque. torch.compile's `mode` ("reduce-overhead", "max-autotune", ...) and `options`
    mean what they mean for Inductor."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    work = _rewrite(gm, example_inputs, "backend=trifuse_inductor")
    config = {**(list_mode_options(mode) if mode else {}), **(options or {})}
    try:
        return compile_fx(work, example_inputs, config_patches=config or None)
    except Exception as e:  # noqa: BLE001  (never break a model: Inductor on the graph as captured)
        # Dynamo's restarts (TensorifyScalarRestartAnalysis, ...) are control flow, not failures.
        if work is gm or isinstance(e, (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame)):
            raise
        why = f"Inductor failed on the rewritten graph ({type(e).__name__}: {str(e)[:200]}); compiled unfused"
        capture = work.meta["trifuse_capture"]
        capture.error, capture.log = why, type(capture.log)()  # nothing of the rewrite runs
        log.warning("trifuse: %s", why)
        return compile_fx(gm, example_inputs, config_patches=config or None)


def compiled_captures(model: torch.nn.Module) -> list[Capture]:
    """The backends' captures of graphs that read `model`'s parameters or were compiled during
    one of its calls, oldest first."""
    seen: dict[int, Capture] = {}
    for p in model.parameters():
        for capture in _COMPILED.get(p, ()):
            seen.setdefault(id(capture), capture)
    for capture in _COMPILED_IN.get(model, ()):
        seen.setdefault(id(capture), capture)
    return sorted(seen.values(), key=lambda c: c.serial)


def latest_per_frame(captures: list[Capture]) -> list[Capture]:
    """Each compiled frame's (the function, the resume functions after graph breaks) most
    recent capture: what runs now."""
    latest: dict[Any, Capture] = {}
    for c in captures:
        latest[c.frame if c.frame is not None else id(c)] = c
    return list(latest.values())


def register() -> None:
    """Registers both backends by name unless an entry point already did (source checkouts)."""
    known = set(torch._dynamo.list_backends(exclude_tags=()))
    for name, fn in (("trifuse", trifuse_backend), ("trifuse_inductor", trifuse_inductor_backend)):
        if name not in known:
            torch._dynamo.register_backend(fn, name)
