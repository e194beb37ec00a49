"""CUDA graphs of fused blocks: `fuse(model, cuda_graphs=True)`.

Why: a fused training step is host-bound on the lent H200 (2026-11-27: GPT-2 medium 8x1024 ran
62.5 ms of kernels in a 77-117 ms step, the host issuing it in 92 ms; eager PyTorch's host took
88 ms for 121 ms of kernels). Each block's forward is ~30 Python-level calls and 5 fused ops,
each with its autograd node. Replayed from a CUDA graph, a block's forward and its backward are
one launch each, plus a copy of the block's inputs (and of the gradient arriving at its output)
into the graph's own buffers; a block whose input is the block before's output (a buffer of that
block's graph) reads it where it is, with no copy and no buffer of its own. Measured there
(2026-11-30): GPT-2 medium 66.7 ms a step (1.90x eager, 61.4 ms of kernels; 1.22x ungraphed),
BERT-large 16x512 62.6 ms (1.13x; 0.87x ungraphed).

How: `torch.cuda.make_graphed_callables` on the block's fused forward (the Dynamo capture, with
the block's trainable parameters as inputs, so that their gradients flow out of the backward
graph into `.grad` as usual; captured on fresh leaves that alias them, see `_build`). One graph
pair per block instance and per call signature (shapes, strides, dtypes, non-tensor arguments,
autocast; parameters that move to new storage drop the graph, and a block whose parameters keep
moving runs ungraphed), built on the second training call with that signature (the first one
captures and tunes: no timing may run inside a capture). The ops of a block to be graphed choose
their implementations by GPU time in a CUDA graph, not wall time (`autotune.dialects.graphed_calls`):
their host paths no longer count. Only training calls with grad on CUDA tensors are graphed;
eval calls, calls without grad, gradient-checkpointed blocks and anything unsupported run the
fused forward as before, and a graph that cannot be built is reported (`BlockGraphs.failures`)
and never tried again for that signature (the CUDA generator taken out of the capture mode a
failed capture leaves it in: `tuner.capture_failures_recovered`).

A graph pair's buffers serve one call at a time (`_Buffers`): a block called again before the
backward of its last replayed call (two forwards, then one backward of both; a layer a model
calls several times in one forward, ALBERT's) runs that call ungraphed, since a replay would
overwrite the activations the pending backward reads. The parameters' gradients are the backward
graph's own buffers, handed to `.grad` without a copy; before either graph replays again, a
`.grad` still holding one of them (gradient accumulation, `zero_grad(set_to_none=False)`) is
copied out first, so accumulation adds to the right values. With `zero_grad()` (set to None)
between steps no gradient is copied at all (BERT-large on the H200, 2026-11-30: 432 device
copies, 1.9 ms of a 56 ms graphed step, 16 of a block's 18 its parameters' gradients; and the
copies took as much memory as the gradients).

What a user should know: a block's outputs live in its graph's buffers and are overwritten when
that block runs again (the next step), as with `torch.cuda.make_graphed_callables`; the loss and
the gradients are unaffected, but an activation kept across steps (hidden states returned with
`output_hidden_states=True`) must be cloned, and so must a `.grad` kept past `zero_grad()` (the
optimizer's step, clipping and accumulation are fine). Each block's graphs keep their own memory
pool: its saved activations, as eager keeps them, and its forward's and backward's temporaries,
which, freed, no other block can reuse, where eager reuses one block's for the next: that is the
graphs' memory beyond eager's. The summary gives the pools' size ("GiB in their memory pools");
`max_memory_allocated` does not count freed temporaries, `max_memory_reserved` does. One pool
shared by every block would need the captures in the replay order (every forward, then the
backwards in reverse), as make_graphed_callables does for a tuple of callables: captured block by
block, a block's saved activations, freed into the pool once its backward is captured, could take
the next block's, and in a step both are live from the forwards to the backwards. The dropout
masks differ from the ungraphed run's (graph-safe Philox offsets), with the same distribution.
"""
import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..autotune.dialects import graphed_calls
from ..autotune.tuner import capture_failures_recovered
from .outputs import collecting_outputs

_FAILED = object()  # an entry: this signature is not graphed
# Per block: each graph pair holds its own memory; a block called with ever new arguments (an
# object per call) stops being looked at, and one whose parameters move more than once (FSDP2
# gathers them into new storage each step) runs ungraphed instead of capturing every step.
MAX_SIGNATURES = 16
MAX_MOVES = 1
MOVING = "its parameters keep moving to new storage (FSDP's resharding?)"
IN_USE = "called again before the backward of its last graphed call (the graph's buffers are in use)"
NOT_IN_PLACE = "its input was not the block before's graphed output this time (that block ran ungraphed)"
HOOKED = "a parameter has gradient hooks, which a replay would not run"


class BlockGraphs:
    """The CUDA graphs of one unit's blocks, per block instance and call signature."""

    def __init__(self, warmup_iters: int = 2, device_type: str = "cuda") -> None:
        self.warmup_iters = warmup_iters
        self.device_type = device_type  # tests on a CPU graph "cpu" calls with a stand-in make_graphed_callables
        self._entries: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, Any]] = weakref.WeakKeyDictionary()
        self.built = 0  # graph pairs built
        self.replays = 0  # calls that ran from a graph
        self.failures: Counter[str] = Counter()  # why a signature could not be graphed
        self.skipped: Counter[str] = Counter()  # why a call was not graphed (eval, no grad, ...)
        self.moves: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        # Bytes the built pairs' private memory pools took from the GPU (their segments): saved
        # activations, and the temporaries each pool keeps to itself once freed (module docstring).
        self.pool_bytes = 0

    def call(self, module: torch.nn.Module, args: tuple, kwargs: dict,
             run: Callable[[torch.nn.Module, tuple, dict], Any],
             ran_fused: Callable[[torch.nn.Module], bool]) -> Any:
        """The block's output: `run(module, args, kwargs)` (its fused forward), from a graph of it
        from the second training call with this signature on. `ran_fused(module)` says whether
        the last `run` ran fused: a signature whose first call ran as written is never graphed."""
        why = _not_graphable(module)
        if why is not None:
            self.skipped[why] += 1
            return run(module, args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = _signature(leaves, spec, self.device_type)
        if isinstance(key, str):
            self.skipped[key] += 1
            return run(module, args, kwargs)
        # The graph reads the parameters where they were at capture (in-place optimizer steps are
        # fine); new storage (model.to(), a state_dict loaded with assign) drops the old graph.
        params = tuple(module.parameters())
        if any(_hooked(p) for p in params):
            self.skipped[HOOKED] += 1
            return run(module, args, kwargs)
        key += tuple((p.dtype, p.requires_grad) for p in params)
        where = tuple(p.data_ptr() for p in params)
        entries = self._entries.setdefault(module, {})
        slot = entries.get(key)
        if slot is not None and slot[0] != where:
            self.moves[module] = moves = self.moves.get(module, 0) + 1
            if moves > MAX_MOVES:
                if slot[1] is not _FAILED:
                    self.failures[MOVING] += 1
                slot[:] = [where, _FAILED]
            else:
                slot = entries[key] = [where, None]
        if slot is None and len(entries) >= MAX_SIGNATURES:
            self.skipped[f"more than {MAX_SIGNATURES} call signatures for one block"] += 1
            return run(module, args, kwargs)
        if slot is None or slot[1] is None:  # first call with this signature: it captures and tunes, ungraphed
            # its ops will replay from a graph: they choose by GPU time; autocast's cache off, as
            # the build will have it
            with graphed_calls(), _autocast_cache_off():
                out = run(module, args, kwargs)
            if ran_fused(module):
                entries[key] = [where, _SEEN]
            else:
                entries[key] = [where, _FAILED]
                self.failures["its first call did not run fused"] += 1
            return out
        entry = slot[1]
        if entry is _SEEN:
            entry = slot[1] = self._build(module, leaves, spec, run)
        # The calls of this signature that run ungraphed after all: as its first call ran (its capture's guards)
        if entry is _FAILED:
            with _autocast_cache_off():
                return run(module, args, kwargs)
        graphed, params, (out_spec, out_leaves), buffers = entry
        if buffers.in_use():
            self.skipped[IN_USE] += 1
            with _autocast_cache_off():
                return run(module, args, kwargs)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if buffers.read_in_place and any(tensors[i].data_ptr() != at for i, at in buffers.read_in_place):
            # The replay would copy this input into the other graph's output buffer.
            self.skipped[NOT_IN_PLACE] += 1
            with _autocast_cache_off():
                return run(module, args, kwargs)
        buffers.release_gradients(params)
        self.replays += 1
        outs = graphed(*tensors, *params)
        buffers.replayed(outs, params)
        results = iter(outs)
        return pytree.tree_unflatten([next(results) if x is _TENSOR else x for x in out_leaves], out_spec)

    def _build(self, module, leaves: list, spec, run) -> Any:
        params = _trainable(module)
        # The graph computes the gradients of fresh leaves that share the parameters' storage,
        # not of the parameters: autograd runs a leaf's gradient on the stream its
        # AccumulateGrad node was made on, and the parameters' nodes outlive a step while the
        # user holds its loss (`loss = model(x)` of the next step runs before the old loss is
        # dropped): made on the default stream, they end the capture ("operation failed due to
        # a previous error during capture": the lent H200, 2026-11-30, a training loop of four
        # steps). Replays take the parameters themselves (the same storage: nothing copied in), and
        # their gradients go to them (`_Buffers`).
        aliases = tuple(torch.nn.Parameter(p.detach(), requires_grad=True) for p in params)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        buffers = _Buffers()
        # The graph's own input buffers, in the arguments' layouts (clone keeps dense strides);
        # an argument that another graph returns from its own buffers (the block before's output)
        # is read where it is: no copy in at each replay, no second buffer (`_Buffers.readers`).
        static = []
        for t in tensors:
            producer = _producer_of(t)
            if producer is not None:
                producer.readers.add(buffers)
                buffers.read_in_place.append((len(static), t.data_ptr()))
                static.append(t.detach().requires_grad_(t.requires_grad))
            else:
                static.append(t.detach().clone().requires_grad_(t.requires_grad))
        n = len(static)

        out_structure: list = []  # the output's spec and its non-tensor leaves, as the block returns them

        def block(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            given = iter(flat[:n])
            args, kwargs = pytree.tree_unflatten(
                [next(given) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
            with _parameters_replaced(module, params, flat[n:]):
                out_leaves, out_spec = pytree.tree_flatten(run(module, args, kwargs))
            # The graph returns tensors only (a None among the outputs is a leaf to pytree).
            structure = (out_spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves])
            if out_structure and out_structure[0] != structure:
                raise RuntimeError("the block's output structure changed between calls")
            out_structure[:] = [structure]
            return tuple(x for x in out_leaves if isinstance(x, torch.Tensor))

        pools_before = _pool_bytes(self.device_type)
        try:
            with graphed_calls(), capture_failures_recovered(), _autocast_cache_off():
                graphed = torch.cuda.make_graphed_callables(
                    block, (*static, *aliases), num_warmup_iters=self.warmup_iters, allow_unused_input=True)
        except Exception as e:  # noqa: BLE001  (never break a model: the block runs ungraphed)
            self.failures[f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"] += 1
            return _FAILED
        self.built += 1
        self.pool_bytes += max(0, _pool_bytes(self.device_type) - pools_before)
        return graphed, params, out_structure[0], buffers

    def summary(self) -> str:
        """One line for the report."""
        pools = f"{self.pool_bytes / 2**30:.2f} GiB in their memory pools"
        parts = [f"{self.built} graph pair(s) built ({pools}), "
                 f"{self.replays} call(s) replayed"]
        parts += [f"not graphed: {why} ({n} call(s))" for why, n in self.skipped.items()]
        parts += [f"could not graph: {why} ({n} signature(s))" for why, n in self.failures.items()]
        return "CUDA graphs: " + "; ".join(parts)


class _Buffers:
    """What one graph pair's buffers hold between replays.

    In use: from a forward replay until its backward has run, or until nothing can run it any
    more (its autograd graph freed: the loss dropped), the forward graph's activations belong to
    that call. Tracked by a token that the replay's autograd node holds and its backward drops.

    The gradients: the backward graph hands each parameter's gradient out as its own buffer, and
    autograd takes it as `.grad` when `.grad` is None (no copy). Either graph's next replay may
    write there (the backward's outputs; the forward's temporaries, in the pool they share), so
    before a replay a `.grad` that is still one of them becomes a copy of itself."""

    __slots__ = ("_token", "_handed", "readers", "outputs_known", "read_in_place", "__weakref__")

    def __init__(self) -> None:
        self._token: weakref.ref | None = None
        self._handed: set[int] = set()  # storage addresses of the gradient buffers handed out
        # The graphs that read this one's outputs in place as their inputs: until their backward
        # ran, a replay of this one would overwrite an input they saved.
        self.readers: weakref.WeakSet[_Buffers] = weakref.WeakSet()
        self.outputs_known = False  # registered in _PRODUCERS
        # (input index, address): the inputs this graph reads in another graph's output buffer
        self.read_in_place: list[tuple[int, int]] = []

    def _claimed(self) -> bool:
        return self._token is not None and self._token() is not None

    def in_use(self) -> bool:
        return self._claimed() or any(r._claimed() for r in self.readers)

    def release_gradients(self, params: tuple[torch.Tensor, ...]) -> None:
        """Copies out each `.grad` of `params` that is one of this graph's gradient buffers."""
        if not self._handed:
            return
        for p in params:
            g = p.grad
            if g is not None and g.untyped_storage().data_ptr() in self._handed:
                p.grad = g.clone()

    def replayed(self, outs: tuple[torch.Tensor, ...], params: tuple[torch.Tensor, ...]) -> None:
        """Marks the buffers in use by the replay that returned `outs`, until its backward ran;
        on the first replay, registers its outputs for the next block's graph to read in place."""
        if not self.outputs_known:
            for o in outs:
                _PRODUCERS[o.data_ptr()] = weakref.ref(self)
            self.outputs_known = True
        node = next((o.grad_fn for o in outs if o.grad_fn is not None), None)
        if node is None:  # nothing will run a backward of this call
            return
        token = _Token()
        holder = [token]  # the post-hook holds it: freed with the node, or emptied when it ran
        self._token = weakref.ref(token)
        node.register_prehook(functools.partial(self._before_backward, params))
        node.register_hook(functools.partial(self._after_backward, holder, len(params)))

    def _before_backward(self, params: tuple, grad_outputs) -> None:
        # A second backward through the same replay (retain_graph=True) rewrites the buffers that
        # the first one handed to .grad.
        self.release_gradients(params)

    def _after_backward(self, holder: list, n_params: int, grad_inputs, grad_outputs) -> None:
        self._handed.update(g.untyped_storage().data_ptr() for g in grad_inputs[len(grad_inputs) - n_params:]
                            if g is not None)
        holder.clear()


# The address of each output a graph returns from its own buffers -> that graph's _Buffers:
# a block whose input is the block before's output reads it there (_build).
_PRODUCERS: dict[int, weakref.ref] = {}


@contextlib.contextmanager
def _autocast_cache_off():
    """Autocast's weight cache off inside (make_graphed_callables refuses it), the user's setting
    back after. A block's first call, the one that captures it, runs like this too: Dynamo guards
    the flag, and a capture made with it on was traced and rewritten once more inside the build
    (every distinct block, on the first graphed step). The cache only saves repeated casts of one
    weight inside an autocast region: the values are the same either way."""
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cache)


def _pool_bytes(device_type: str) -> int:
    """Bytes of the current GPU's memory held in private pools (CUDA graphs'), from the caching
    allocator's segments; 0 off CUDA or where the snapshot has no pool ids."""
    if device_type != "cuda":
        return 0
    try:
        device = torch.cuda.current_device()
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if seg.get("device") == device and tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))
    except Exception:  # noqa: BLE001  (a diagnostic: never let it break a build)
        return 0


def _producer_of(t: torch.Tensor) -> "_Buffers | None":
    """The live graph whose replays return `t` from their own buffers, or None."""
    ref = _PRODUCERS.get(t.data_ptr())
    producer = ref() if ref is not None else None
    if producer is None and ref is not None:
        del _PRODUCERS[t.data_ptr()]
    return producer


class _Token:
    """A replay's claim on its graph's buffers (weakly referenced by `_Buffers`)."""


_SEEN = object()  # an entry: called once with this signature, not graphed yet
_TENSOR = object()  # in an output structure: a tensor's place


def _not_graphable(module: torch.nn.Module) -> str | None:
    """Why no call of `module` can be graphed right now, or None."""
    if not (module.training and torch.is_grad_enabled()):
        return "not a training call (eval or no grad)"
    if getattr(module, "gradient_checkpointing", False):
        return "gradient checkpointing (the backward recomputes the forward)"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "called inside another CUDA graph capture"
    if torch.compiler.is_compiling():
        return "called inside torch.compile"
    if collecting_outputs():  # its hooks inside the block would not run in a replay
        return "transformers collects outputs on this call (output_hidden_states, output_attentions)"
    return None


def _hooked(p: torch.Tensor) -> bool:
    """Whether hooks run on `p`'s gradient: a replay hands .grad the graph's buffers without them
    (trifuse.parallel's sums over the tensor-parallel group, a DTensor's placement fix)."""
    return p.requires_grad and bool(getattr(p, "_backward_hooks", None)
                                    or getattr(p, "_post_accumulate_grad_hooks", None))


def _trainable(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(p for p in module.parameters() if p.requires_grad)


@contextlib.contextmanager
def _parameters_replaced(module: torch.nn.Module, params: tuple[torch.Tensor, ...],
                         replacements: tuple[torch.Tensor, ...]):
    """`module`'s parameters `params` replaced by `replacements` (every place each one is
    registered: a parameter shared by two submodules stays shared), restored on exit."""
    by_id = {id(p): r for p, r in zip(params, replacements)}
    replaced = []
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None and id(p) in by_id:
                replaced.append((sub, name, p))
    try:
        for sub, name, p in replaced:
            sub._parameters[name] = by_id[id(p)]
        yield
    finally:
        for sub, name, p in replaced:
            sub._parameters[name] = p


def _signature(leaves: list, spec, device_type: str) -> tuple | str:
    """The call's graph key (the parameters' addresses apart), or why it cannot have a graph."""
    parts: list = [spec, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)]
    cuda = False
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.device.type != device_type:
                return "an argument is not on a CUDA device"
            cuda = True
            parts.append((x.shape, x.stride(), x.dtype, x.requires_grad))
        else:
            try:
                hash(x)
            except TypeError:
                return f"an argument of type {type(x).__name__} is not hashable"
            parts.append((type(x), x))
    if not cuda:
        return "no CUDA tensor argument"
    try:
        hash(spec)
    except TypeError:  # a torch whose TreeSpec does not hash: its text says the same
        parts[0] = str(spec)
    return tuple(parts)
