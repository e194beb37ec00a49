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
backward, Inductor generates everything around them; the compiled graphs call each op's direct
twin (`direct_ops`: its body, without the registered op's Python layers). With
`mode="reduce-overhead"` the graph is replayed by CUDA graphs: the ops draw their dropout seeds on
the device (no host sync), so every replay draws fresh masks.

`trifuse.report(compiled_model)` lists what each backend replaced in the graphs holding that
model's parameters, and in the graphs compiled while one of the model's calls was running (the
graph after a graph break, such as GPT-2's loss, reads no parameter). Its counts are those of
the model's latest forward: each graph counted as many times as it ran there (a graph break
inside every layer compiles the layer's frame once, and its graph runs once a layer).
"""
import bisect
import contextlib
import functools
import hashlib
import itertools
import logging
import sys
import types
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

from ..autotune.env import direct_ops_requested
from ..patterns import PATTERNS
from .capture import Capture, rewrite_checkpoints
from .dtensor_calls import recompile
from .normalize import canonicalize, constant_masks
from .rewriter import rewrite_graph, select_patterns

log = logging.getLogger("trifuse")

# Parameter -> the captures of compiled graphs that read it (what report(compiled) shows); keyed
# by identity (tensors compare elementwise).
_COMPILED: "WeakIdKeyDictionary[torch.Tensor, list[Capture]]" = WeakIdKeyDictionary()
# Module, or function compiled by torch.compile -> the captures of graphs compiled while a call
# of it was on the Python stack.
_COMPILED_IN: "WeakIdKeyDictionary[torch.nn.Module | types.FunctionType, list[Capture]]" = \
    WeakIdKeyDictionary()
# Every capture whose graph may still run: a second model of the same class runs the graphs
# compiled for the first (Dynamo's guards pass) without compiling anything of its own, and is
# found through the parameters the graphs ran for.
_RUNNABLE: "weakref.WeakSet[Capture]" = weakref.WeakSet()


def _callers() -> list[torch.nn.Module | types.FunctionType]:
    """What is being compiled, from the Python stack (one walk): Dynamo compiles a frame from
    inside the call that runs it, so the modules whose methods are on the stack are the model
    being compiled and whatever called it; and the functions `torch.compile(fn)` wrapped, which
    Dynamo's wrapper (in its eval_frame.py) holds as `fn`: every frame Dynamo compiles for such a
    function, the graphs after a graph break among them, is compiled inside that wrapper's call."""
    found: dict[int, torch.nn.Module | types.FunctionType] = {}
    frame = sys._getframe(1)
    while frame is not None:
        if "self" in frame.f_code.co_varnames[:1]:
            obj = frame.f_locals.get("self")
            if isinstance(obj, torch.nn.Module):
                found.setdefault(id(obj), obj)
        if frame.f_code.co_filename.endswith("eval_frame.py"):
            fn = frame.f_locals.get("fn")
            if isinstance(fn, types.FunctionType):
                found.setdefault(id(fn), fn)
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
        constant_masks(work.graph)  # the masks of attention chains the rewrite made trifuse calls
        if eager:
            rewrite_checkpoints(work, patterns, capture.log)
        recompile(work)
    except Exception as e:  # noqa: BLE001  (never break a model: compile the graph as captured)
        capture.error = f"{type(e).__name__}: {e}"
        work = gm
    capture.graphs = 1
    work.meta["trifuse_capture"] = capture
    for t in example_inputs:
        if isinstance(t, torch.nn.Parameter):
            _attach(_COMPILED, t, capture)
    for caller in _callers():
        _attach(_COMPILED_IN, caller, capture)
    return work


# A sequence number per run of any graph the backends compiled (`counted`).
_RUN_SEQ = itertools.count(1)
# The run numbers a capture keeps: enough for any forward's runs of one graph.
MAX_RUNS = 1 << 14


def counted(fn: Callable[..., Any], capture: Capture, example_inputs: list[Any]) -> Callable[..., Any]:
    """`fn`, the compiled graph, noting each run in `capture.runs` (a list append, a fraction of a
    µs) and, when the graph takes parameters (Dynamo passes a module's parameters as inputs), the
    identity of the first one: the module it ran for. The report tells from them which graphs ran
    in a model's latest forward, and how often."""
    _RUNNABLE.add(capture)  # for as long as the graph may run: `run` holds the capture
    first = next((i for i, t in enumerate(example_inputs) if isinstance(t, torch.nn.Parameter)), None)

    def run(*args: Any) -> Any:
        runs, runs_for = capture.runs, capture.runs_for
        seq = next(_RUN_SEQ)
        runs.append(seq)
        if len(runs) > MAX_RUNS:
            del runs[: MAX_RUNS // 2]
            runs_for.clear()
        if first is not None:
            param = args[first]
            entry = runs_for.get(id(param))
            if entry is not None and entry[1]() is param:
                entry[0] = seq
            else:  # a weak reference: an id alone may be a dead parameter's, reused
                runs_for[id(param)] = [seq, weakref.ref(param)]
        return fn(*args)

    return run


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

        return counted(cudagraphs(work, example_inputs), work.meta["trifuse_capture"], example_inputs)
    return counted(work.forward, work.meta["trifuse_capture"], example_inputs)


# setup.py's sub-packages: what an installed trifuse is made of.
_SUBPACKAGES = ("autotune", "fusion", "kernels", "parallel", "patterns")


@functools.cache
def source_hash(root: Path = Path(__file__).resolve().parent.parent) -> str:
    """sha256 of the trifuse package's Python source: the top-level modules and the installed
    sub-packages (setup.py's), not the tests, benchmarks or examples beside them in a checkout."""
    hasher = hashlib.sha256()
    paths = [*root.glob("*.py"), *(p for sub in _SUBPACKAGES for p in (root / sub).rglob("*.py"))]
    for path in sorted(p for p in paths if p.name != "setup.py"):
        hasher.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return hasher.hexdigest()


def _keyed_on_trifuse(current: Any) -> Any:
    """A post-grad pass for Inductor's config that keys its caches on trifuse's source as well,
    and has the graph call the trifuse ops' direct twins (`call_directly`).

    Inductor's FX-graph and AOTAutograd caches key a graph on its code, which names a custom op
    but not what its fake implementation returns: after an upgrade that changes a trifuse op's
    outputs (the attention statistics' shape, say), a warm cache would hand back code laid out
    for the old ones. The pass changes nothing; its uuid, which Inductor hashes into both keys,
    carries `source_hash()`. A pass already configured (`current`) still runs, keyed as before:
    one without a uuid keeps Inductor's caches bypassed, as it did."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    inner = () if current is None else tuple(current) if isinstance(current, (list, tuple)) else (current,)

    direct = direct_ops_requested()

    class KeyedOnTrifuse(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            if direct:
                call_directly(graph)
            for run in inner:
                run(graph)

        def uuid(self) -> Any:
            keys = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in inner]
            return None if None in keys else ("trifuse", source_hash(), direct, *keys)

    return KeyedOnTrifuse()


# The namespace of the registered ops' direct twins: `trifuse_direct::layer_norm` is
# `trifuse::layer_norm` without the layers around its body.
DIRECT_NAMESPACE = "trifuse_direct"
_DIRECT_LIB: torch.library.Library | None = None
_DIRECT: dict[Any, Any] = {}  # trifuse op overload -> its twin's


def direct_ops() -> dict[Any, Any]:
    """{registered trifuse op: its direct twin}, the twins defined on first use (and as ops are
    registered later).

    Inductor's compiled forward and backward run with autograd off, yet a call of a
    `torch.library.custom_op` still passes its Python autograd kernel (which finds nothing to
    record and redispatches), Dynamo's disable wrapper and a check that no output aliases an
    input before it reaches its body: 13 of a LayerNorm call's 30 µs on a 2-core CPU with the
    launch stubbed (bench/norm_host_proxy.py), per call of every trifuse op in the graph. A twin
    has the op's schema and tags, the op's body as its kernel for every backend
    (CompositeExplicitAutograd) and the op's fake; no autograd kernel, so the dispatcher's
    fallback (C++) passes it through. Only graphs AOTAutograd has already differentiated may
    call one: the post-grad graphs of `call_directly`. An op with per-device kernels
    (`register_kernel`), or a torch whose custom ops keep their parts elsewhere, gets none."""
    global _DIRECT_LIB
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return _DIRECT
    for qualname, opdef in list(OPDEFS.items()):
        namespace, name = qualname.split("::", 1)
        try:
            op, body, fake, schema = opdef._opoverload, opdef._init_fn, opdef._abstract_fn, opdef._schema
            per_device = list(opdef._backend_fns) != [None]
        except AttributeError:
            continue
        if namespace != "trifuse" or op in _DIRECT or per_device or body is None or fake is None:
            continue
        if _DIRECT_LIB is None:
            _DIRECT_LIB = torch.library.Library(DIRECT_NAMESPACE, "FRAGMENT")
        _DIRECT_LIB.define(name + schema, tags=tuple(op.tags))
        _DIRECT_LIB.impl(name, body, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{DIRECT_NAMESPACE}::{name}", fake, lib=_DIRECT_LIB)
        _DIRECT[op] = getattr(getattr(torch.ops, DIRECT_NAMESPACE), name).default
    return _DIRECT


def call_directly(graph: fx.Graph) -> int:
    """Each call of a registered trifuse op in a post-grad graph retargeted to its direct twin
    (`direct_ops`): the same body and outputs, less host time a call. Returns how many."""
    twins = direct_ops()
    changed = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in twins:
            node.target = twins[node.target]
            changed += 1
    return changed


def trifuse_inductor_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                             options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """`backend="trifuse_inductor"`: the rewritten graph compiled by Inductor, the trifuse ops
    kept opaque. torch.compile's `mode` ("reduce-overhead", "max-autotune", ...) and `options`
    mean what they mean for Inductor."""
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    work = _rewrite(gm, example_inputs, "backend=trifuse_inductor")
    capture = work.meta["trifuse_capture"]
    config = {**(list_mode_options(mode) if mode else {}), **(options or {})}
    if work is not gm:  # CUDA graphs: "reduce-overhead", "max-autotune", or the option itself
        attention_as_chosen(work, capture.log, graphed=bool(config.get("triton.cudagraphs", False)))
    config["post_grad_custom_post_pass"] = _keyed_on_trifuse(
        config.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass))
    if direct_ops_requested():
        direct_ops()  # before compile_fx: code from Inductor's caches may call the twins
    try:
        compiled = compile_fx(work, example_inputs, config_patches=config)
        return counted(compiled, capture, example_inputs)
    except Exception as e:  # noqa: BLE001  (never break a model: Inductor on the graph as captured)
        # Dynamo's restarts (TensorifyScalarRestartAnalysis, ...) are control flow, not failures.
        if work is gm or isinstance(e, (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame)):
            raise
        why = f"Inductor failed on the rewritten graph ({type(e).__name__}: {str(e)[:200]}); compiled unfused"
        capture.error, capture.log = why, type(capture.log)()  # nothing of the rewrite runs
        log.warning("trifuse: %s", why)
        return counted(compile_fx(gm, example_inputs, config_patches=config), capture, example_inputs)


# Where the attention dialect has candidates besides trifuse's kernels (SDPA's are CUDA's).
_DIALECT_DEVICES = ("cuda",)
# The attention dialect's SDPA candidates and the backend each forces (kernels/attention.py).
_SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
                  "sdpa-cudnn": "CUDNN_ATTENTION"}


@functools.cache
def sdpa_preferring(name: str) -> Callable[..., torch.Tensor]:
    """SDPA with the attention dialect's candidate `name` (an `_SDPA_BACKENDS` key) first and the
    math backend after it. For Inductor's graphs: AOTAutograd traces SDPA into the backend's own
    aten op (`_scaled_dot_product_cudnn_attention`, ...) by the backend flags set while it traces,
    so this runs that backend forward and backward in the compiled graph. Math only where the
    chosen backend refuses a call at trace time: never a failed compile."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, _SDPA_BACKENDS[name])
    backends = [chosen] + ([SDPBackend.MATH] if chosen != SDPBackend.MATH else [])

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        with sdpa_kernel(backends, set_priority=True):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    sdpa.__name__ = sdpa.__qualname__ = "sdpa_" + name.split("-")[1]
    return sdpa


def _stand_in(value: torch.Tensor) -> torch.Tensor:
    """A real tensor like a graph value (shape, dtype, device, strides, requires_grad): random
    floats, a bool mask keeping everything, a float mask of zeros. Broadcast dims (stride 0) stay
    broadcast."""
    base = [1 if st == 0 else n for n, st in zip(value.shape, value.stride())]
    if value.dtype == torch.bool:
        t = torch.ones(base, dtype=torch.bool, device=value.device)
    elif value.dim() >= 3 and 0 not in value.stride():  # q, k, v: their own layout
        t = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).normal_()
    else:
        t = torch.zeros(base, dtype=value.dtype, device=value.device)
    return t.expand(value.shape).requires_grad_(value.requires_grad and value.is_floating_point())


def attention_as_chosen(gm: fx.GraphModule, log: Any, graphed: bool = False) -> int:
    """Each trifuse attention call of a graph for Inductor runs what the attention dialect chooses
    for its shapes, as `fuse` and `backend="trifuse"` do at run time: a traced call has no dialect
    key, so the compiled graph would run trifuse's kernels whatever the dialect measured (on the
    lent H100 trifuse's masked attention took 17.0 ms a BERT-large step where `fuse` ran cuDNN's in
    9.4). The choice is made here, once per call site, on stand-ins of the call's shapes, dtypes,
    layouts and flags; an SDPA candidate becomes `sdpa_preferring(name)`, flash-attn, xformers and
    trifuse stay trifuse's op (Inductor keeps it opaque). CUDA values only: elsewhere trifuse's
    kernels are the only candidate. `graphed`: the graph replays from CUDA graphs (Inductor's
    `triton.cudagraphs`), so the choice is by GPU time in a graph. Returns how many calls changed."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ..autotune import dialects
    from ..kernels.attention import ATTENTION, attention
    from .normalize import _value

    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not attention or len(node.args) != 8 \
                or any(v is not None for v in node.kwargs.values()):  # softcap, sinks: trifuse's own
            continue
        values = [_value(a) if isinstance(a, fx.Node) else a for a in node.args[:4]]
        q, k, v, mask = values
        if not all(isinstance(t, torch.Tensor) and t.device.type in _DIALECT_DEVICES for t in (q, k, v)) \
                or not (mask is None or isinstance(mask, torch.Tensor)) \
                or any(isinstance(a, fx.Node) for a in node.args[4:]):
            continue
        try:
            with unset_fake_temporarily(), torch.enable_grad() if q.requires_grad else torch.no_grad(), \
                    dialects.graphed_calls() if graphed else contextlib.nullcontext():
                args = (*(_stand_in(t) for t in (q, k, v)), None if mask is None else _stand_in(mask),
                        *node.args[4:])
                fn = ATTENTION.implementation(*args)
        except Exception as e:  # noqa: BLE001  (the choice is an optimization: trifuse's op stays)
            log.dialects.append(f"{node.name}: no dialect choice, trifuse's op ({type(e).__name__}: "
                                f"{str(e)[:120]})")
            continue
        name = next((c.name for c in ATTENTION.candidates if c.fn is fn), None)
        if name not in _SDPA_BACKENDS:
            continue
        node.target, node.kwargs = sdpa_preferring(name), {}
        changed += 1
        note = f"runs {name}, the attention dialect's choice for {tuple(q.shape)} {str(q.dtype)[6:]}"
        for r in log.replaced:
            if r.node == node.name:
                r.note = "; ".join(filter(None, (r.note, note)))
        log.dialects.append(f"{node.name}: {note}")
    if changed:
        gm.recompile()
    return changed


def compiled_captures(model: torch.nn.Module | types.FunctionType) -> list[Capture]:
    """The backends' captures of graphs that read `model`'s parameters, were compiled during one
    of its calls, or ran for its modules, oldest first; for a function, those compiled during
    its calls."""
    seen: dict[int, Capture] = {}
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    for p in params:
        for capture in _COMPILED.get(p, ()):
            seen.setdefault(id(capture), capture)
    for capture in _COMPILED_IN.get(model, ()):
        seen.setdefault(id(capture), capture)
    by_id = {id(p): p for p in params}
    for capture in list(_RUNNABLE):
        if _ran_for(capture, by_id):
            seen.setdefault(id(capture), capture)
    return sorted(seen.values(), key=lambda c: c.serial)


def _ran_for(capture: Capture, params: dict[int, torch.Tensor]) -> dict[int, int]:
    """id -> latest run, for the parameters in `params` (id -> parameter) the graph ran for."""
    return {pid: seq for pid, (seq, ref) in list(capture.runs_for.items())
            if pid in params and ref() is params[pid]}


def latest_forward(captures: list[Capture], params: dict[int, torch.Tensor]) -> list[tuple[Capture, int]]:
    """(capture, how many times its graph ran) for the graphs of a model's latest forward;
    `params`: the model's parameters by id.

    A model compiled whole: its forward starts with the model's first compiled frame (the lowest
    Dynamo frame id among its captures: Dynamo converts the outermost frame first), whose graph
    runs once a forward, for the same parameters; what ran since that frame's latest run is the
    latest forward. A model compiled region by region (`block.compile()` on each block: the
    lowest frame's graphs ran for several of the model's modules): each module counts once, with
    the graph that ran for it last; graphs taking no parameter there count once. Graphs that ran
    no more (an earlier mode's, such as training's after model.eval()) are left out."""
    ran = [c for c in captures if c.runs]
    if not ran:
        return []
    first = min((c.frame for c in ran if c.frame is not None), default=None)
    roots = [c for c in ran if c.frame == first]
    if len({p for c in roots for p in _ran_for(c, params)}) <= 1:
        start = max(c.runs[-1] for c in roots)
        counts = [(c, len(c.runs) - bisect.bisect_left(c.runs, start)) for c in ran]
        return [(c, n) for c, n in counts if n]
    owner: dict[int, tuple[int, Capture]] = {}
    for c in ran:
        for p, seq in _ran_for(c, params).items():
            if seq > owner.get(p, (0, c))[0]:
                owner[p] = (seq, c)
    modules = Counter(id(c) for _, c in owner.values())
    latest: dict[Any, Capture] = {}
    for c in ran:
        if not c.runs_for:
            latest[c.frame if c.frame is not None else id(c)] = c
    return [(c, modules[id(c)]) for c in ran if modules[id(c)]] + [(c, 1) for c in latest.values()]


def register() -> None:
    """Registers both backends by name unless an entry point already did (source checkouts)."""
    known = set(torch._dynamo.list_backends(exclude_tags=()))
    for name, fn in (("trifuse", trifuse_backend), ("trifuse_inductor", trifuse_inductor_backend)):
        if name not in known:
            torch._dynamo.register_backend(fn, name)
