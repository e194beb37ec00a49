"""Operator dialects: several implementations of one op, the fastest correct one chosen per shape.

An op is a `Dialect`: a name, a `key` function, the op's reference (`<op>_ref`, the spec) and a
tuple of `Candidate`s that op files register into it with explicit `register` calls (the trifuse
Triton kernel, PyTorch's own, flash-attn or xformers when importable). Calling the dialect with
the op's positional arguments runs the chosen candidate:

    LAYER_NORM = dialects.define("layer_norm", key=_key, key_names=(...), reference=layer_norm_ref)
    LAYER_NORM.register(Candidate("trifuse", _layer_norm_trifuse))
    LAYER_NORM.register(Candidate("torch", _layer_norm_torch, supports=_torch_supports))
    y = LAYER_NORM(x, normalized_shape, weight, bias, eps)

`key(*args)` turns an eager call into a small tuple (the device index, dtype, shape buckets and
flags, named by `key_names`, "device" among them), or None when the call is traced (Dynamo, fake
or proxy tensors) or degenerate: then the first candidate, the op's own registered implementation,
runs. Otherwise the choice for (key, deterministic mode) is made once:

1. Eligibility, per candidate in order: its `requires` modules import; `supports(*args)` returns
   None (else a reason, as text); it is deterministic when torch.are_deterministic_algorithms_
   enabled(). The others are rejected with their reason. When none is eligible, the first
   candidate runs and raises the op's own error.
2. Where nothing may be timed (TRIFUSE_AUTOTUNE=0, the interpreter, a CPU without a timer, CUDA-
   graph capture): the shipped default for the GPU family when it names an eligible candidate,
   else the first eligible one.
3. The disk cache, when it names an eligible candidate.
4. Measuring, on the real inputs' shapes (detached views of them): each eligible candidate runs
   forward, and backward when the call needs gradients, and its outputs and gradients are checked
   against the reference run in float64 (`gate`; computed once for all the candidates of the call,
   also by an op's own `check`, through `shared_by_checks`); those that pass are timed, forward and backward
   together, by wall time per call run back to back (`tuner.wall_timer`: host overhead counts);
   inside `graphed_calls()` (a block that `fuse(cuda_graphs=True)` runs from a CUDA graph, whose
   host paths are gone) by GPU time replayed from a CUDA graph instead (`tuner.graph_timer`),
   those choices kept apart (the bucket ends in ",graphed"). Candidates are first checked and
   timed with their kernels at default configs where those are not tuned yet; a candidate whose
   kernels wanted tuning is tuned (`tuner.Tuner`) and timed again only when it came within
   SCREEN_MARGIN of the fastest (tuning a clear loser would cost the first step every config's
   compile and timing). On the GPU's own timers, each round's kernels are compiled first, all
   candidates together, in parallel (`_compile_first`: a fwd+bwd check compiles several kernels
   one after another otherwise, most of a cold first step); so are the kernels of a candidate
   chosen without measuring (the only eligible one, the disk cache's), before the call that tunes
   them. The fastest wins and goes to the disk cache. A candidate that raises is
   rejected with the exception as its reason; when none passes, the first eligible one is kept
   for this process (not written). Random generators are restored afterwards: tuning never
   shifts a seeded run.

Afterwards the same key is one dict lookup. Every choice is recorded (`records`, `explain`) with
the times and the reasons the others were rejected, for trifuse.report and the autotune command.
"""
import contextlib
import contextvars
import dataclasses
import functools
import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .cache import disk_cache, environment, shipped_default
from .decisions import Clock, Decision, Timer, bucket_string, deciding, log, lookup, phase, record, records
from .tuner import (PRECOMPILING, capturing, error_text, graph_timer, on_device, progress, timer_for, tuned, untuned,
                    wall_timer)

# The check's bound, in the form of the tests' oracle rule (tests/tolerances.py) but with twice
# the factor: it guards the choice against a broken implementation (a library bug, a backend that
# is wrong for a shape); the tests remain the oracle for trifuse's own kernels. Floors: two ulps
# at 1.0 for the half types; for fp32, the spread between correct fp32 accumulations over a few
# thousand terms, as in the tests.
GATE_FACTOR = 4.0
GATE_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# Screening before tuning: a candidate whose kernels would be tuned for this call is tuned (every
# config compiled and timed) only when, at its kernels' default configs, it takes at most this
# many times the fastest candidate's time. A default config is rarely off its tuned best by 2x;
# on the lent H200 the losers were further off than that (GPT-2 medium's fp32 LayerNorm 2.1x
# PyTorch's, attention with dropout 2.5x cuDNN's, both tuned), and tuning them was most of the
# first step's set-up.
SCREEN_MARGIN = 2.0


@functools.cache
def import_problem(module: str) -> str | None:
    """None when `module` imports, else why not (as text)."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        # "xformers.ops" is not installed when "xformers" (or "xformers.ops") is the missing one.
        if missing and (module == missing or module.startswith(missing + ".")):
            return f"{module} is not installed ({e})"
        return error_text(e)
    except Exception as e:  # noqa: BLE001  (broken installs fail in many ways: wrong-torch wheels...)
        return f"{module} does not import: {error_text(e)}"
    return None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One implementation of an op.

    Args:
        name: short and stable (it is stored on disk): "trifuse", "torch", "sdpa-flash", "flash-attn".
        fn: takes the op's positional arguments, returns what the op returns.
        supports: `supports(*args) -> str | None`: None when it can take the call, else why not.
        deterministic: whether it is bitwise repeatable (eligible under deterministic algorithms).
        requires: modules that must import (checked once; a missing one is the rejection reason).
    """

    name: str
    fn: Callable[..., Any]
    supports: Callable[..., str | None] | None = None
    deterministic: bool = True
    requires: tuple[str, ...] = ()

    def rejection(self, args: tuple, deterministic: bool) -> str | None:
        for module in self.requires:
            problem = import_problem(module)
            if problem is not None:
                return problem
        if self.supports is not None:
            reason = self.supports(*args)
            if reason is not None:
                return reason
        if deterministic and not self.deterministic:
            return "not deterministic (torch.use_deterministic_algorithms is on)"
        return None


# While a dialect measures its candidates on one call (`Dialect._measure`): what their checks
# share (`shared_by_checks`); None otherwise.
_TRIAL_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("trifuse_trial_memo", default=None)


@contextlib.contextmanager
def _checks_sharing():
    """Around one measurement: its checks share what they compute (`shared_by_checks`), dropped at the end."""
    token = _TRIAL_MEMO.set({})
    try:
        yield
    finally:
        _TRIAL_MEMO.reset(token)


def shared_by_checks(name: str | tuple, args: tuple, compute: Callable[[], Any]) -> Any:
    """`compute()`, once per `args` object inside a dialect's measurement of one call: the checks
    of all its candidates (the tuned ones' re-check too) share what a check derives from the
    call's arguments alone, its references above all, instead of computing it per candidate.
    Outside a measurement, computed each time."""
    memo = _TRIAL_MEMO.get()
    if memo is None:
        return compute()
    held = memo.get(name)
    if held is None or held[0] is not args:  # the args held too: their id stays theirs
        held = memo[name] = (args, compute())
    return held[1]


# True while a block whose calls will replay from a CUDA graph runs its fused forward (its first
# call and its capture, fusion/graphs.py): the ops it calls choose by GPU time, not wall time.
_GRAPHED: contextvars.ContextVar[bool] = contextvars.ContextVar("trifuse_graphed_calls", default=False)


@contextlib.contextmanager
def graphed_calls():
    """The dialect calls made inside run from a CUDA graph: choose (and remember, apart from the
    eager choices) by GPU time in a CUDA graph. For host-bound ops the two differ: on the lent
    H200, PyTorch's LayerNorm won GPT-2's fp32 norm by wall time, 0.22 against 0.46 ms a
    fwd+bwd, almost all of it our host path."""
    token = _GRAPHED.set(True)
    try:
        yield
    finally:
        _GRAPHED.reset(token)


class Dialect:
    """The candidates of one op and the choice among them per key (see the module docstring).

    `timer` (an attribute, None = `wall_timer` on CUDA) may be replaced, e.g. by a fake in tests;
    `graph_timer` likewise for calls inside `graphed_calls()` (None = `tuner.graph_timer` on CUDA,
    or `timer` when only that is replaced).
    `check(fn, args) -> str | None` replaces the float64 reference comparison for ops whose
    reference does not fit in memory at real shapes. `captures` pairs the torch.nn module types
    whose calls this op replaces with `to_args(module, inputs) -> args`: the autotune command
    reads a model's shapes through them when the model is not fused. `output_like(*args)` returns
    tensors shaped like the op's outputs (requiring grad where the call trains): with `check`, the
    trial takes the shapes of the output gradients from it instead of running the reference.
    """

    def __init__(self, name: str, key: Callable[..., tuple | None], key_names: Sequence[str],
                 reference: Callable[..., Any], check: Callable[[Callable, tuple], str | None] | None = None,
                 captures: tuple[tuple[type, Callable[..., tuple]], ...] = (),
                 output_like: Callable[..., Any] | None = None):
        if "device" not in key_names:
            raise ValueError(f"trifuse.autotune.dialects: key_names of {name!r} must include 'device'")
        self.name = name
        self.key = key
        self.key_names = tuple(key_names)
        self.reference = reference
        self.check = check
        self.captures = tuple(captures)
        self.output_like = output_like
        self.candidates: tuple[Candidate, ...] = ()
        self.timer: Timer | None = None
        self.graph_timer: Timer | None = None
        self._device_pos = self.key_names.index("device")
        self._memo: dict[tuple, Callable] = {}
        self._memo_deterministic: dict[tuple, Callable] = {}
        self._memo_graphed: dict[tuple, Callable] = {}
        self._memo_graphed_deterministic: dict[tuple, Callable] = {}

    def register(self, candidate: Candidate) -> Candidate:
        """Adds a candidate after the existing ones (the first registered is the op's own)."""
        if any(c.name == candidate.name for c in self.candidates):
            raise ValueError(f"trifuse.autotune.dialects: {self.name!r} already has a candidate "
                             f"{candidate.name!r}")
        self.candidates = (*self.candidates, candidate)
        self.clear()
        return candidate

    def candidate(self, name: str) -> Candidate:
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(f"trifuse.autotune.dialects: {self.name!r} has no candidate {name!r} "
                       f"(it has {[c.name for c in self.candidates]})")

    def clear(self) -> None:
        """Forgets this process's choices (the disk cache stays)."""
        for memo in (self._memo, self._memo_deterministic,
                     self._memo_graphed, self._memo_graphed_deterministic):
            memo.clear()

    def __call__(self, *args):
        return self.implementation(*args)(*args)

    def implementation(self, *args) -> Callable:
        """The candidate's function a call with these arguments runs (choosing it if not yet
        chosen), for an op that adds to the call what the candidates do not take."""
        key = self.key(*args)
        if key is None:
            return self.candidates[0].fn
        deterministic = torch.are_deterministic_algorithms_enabled()
        graphed = _GRAPHED.get()
        fn = self._memo_for(deterministic, graphed).get(key)
        if fn is None:
            fn = self._decide(key, args, deterministic, graphed)
        return fn

    def _memo_for(self, deterministic: bool, graphed: bool) -> dict[tuple, Callable]:
        if graphed:
            return self._memo_graphed_deterministic if deterministic else self._memo_graphed
        return self._memo_deterministic if deterministic else self._memo

    # -----------------------------------------------------------------------------------------

    def _where(self, key: tuple, deterministic: bool, graphed: bool = False) -> tuple[int, str, str]:
        device_index = key[self._device_pos]
        bucket = (bucket_string(self.key_names, key) + (",deterministic" if deterministic else "")
                  + (",graphed" if graphed else ""))
        return device_index, environment(device_index).device, bucket

    def _eligible(self, args: tuple, deterministic: bool) -> tuple[list[Candidate], dict[str, str]]:
        eligible, rejected = [], {}
        for c in self.candidates:
            reason = c.rejection(args, deterministic)
            if reason is None:
                eligible.append(c)
            else:
                rejected[c.name] = reason
        return eligible, rejected

    def _decide(self, key: tuple, args: tuple, deterministic: bool, graphed: bool = False) -> Callable:
        with deciding() as clock, tuned():
            return self._choose(key, args, deterministic, graphed, clock)

    def _choose(self, key: tuple, args: tuple, deterministic: bool, graphed: bool, clock: Clock) -> Callable:
        device_index, device, bucket = self._where(key, deterministic, graphed)
        eligible, rejected = self._eligible(args, deterministic)

        def keep(c: Candidate, source: str, times: dict | None = None) -> Callable:
            self._memo_for(deterministic, graphed)[key] = c.fn
            record(Decision("dialect", self.name, device, bucket, c.name, source, times or {}, rejected,
                            clock.seconds(), clock.nested, dict(clock.phases)))
            return c.fn

        if not eligible:
            # Nothing memoized: the op's own implementation raises its error, or copes.
            record(Decision("dialect", self.name, device, bucket, self.candidates[0].name,
                            "fallback (no candidate takes this call)", {}, rejected))
            return self.candidates[0].fn
        if capturing() or PRECOMPILING.get():
            # Nothing timed in a capture; nor while another op's candidate is being compiled
            # (`_compile_first`): its kernels launch nothing, so nothing could be checked.
            return eligible[0].fn
        if graphed:
            timer, why_not = timer_for(device_index, self.graph_timer or self.timer, graph_timer)
        else:
            timer, why_not = timer_for(device_index, self.timer, wall_timer)
        if timer is None:
            shipped = shipped_default(device_index, "dialect:" + self.name, bucket)
            if shipped is not None:
                match = [c for c in eligible if c.name == shipped[1].get("choice")]
                if match:
                    return keep(match[0], f"shipped {shipped[0]} defaults")
            return keep(eligible[0], f"default ({why_not})")
        # On the GPU's own timers (not a test's fake), kernels compile together ahead of their use.
        compile_first = ((self.graph_timer or self.timer) if graphed else self.timer) is None

        def unmeasured(c: Candidate, source: str, times: dict | None = None) -> Callable:
            # The call that follows tunes the winner's kernels one after another (forward, then
            # backward) where they are not tuned yet: compile all their configs together first.
            if compile_first:
                with torch.random.fork_rng(devices=[device_index] if device_index >= 0 else []), \
                        on_device(device_index):
                    _compile_call(c.fn, args)
            return keep(c, source, times)

        if len(eligible) == 1:
            return unmeasured(eligible[0], "only eligible candidate")
        cache = disk_cache(device_index)
        hit = cache.get("dialect:" + self.name, bucket)
        if hit is not None:
            match = [c for c in eligible if c.name == hit.get("choice")]
            if match:
                rejected.update({k: v for k, v in hit.get("rejected", {}).items() if k not in rejected})
                return unmeasured(match[0], "disk cache", dict(hit.get("ms", {})))
        times, problem, untuned_names = self._measure(eligible, args, timer, device_index, rejected,
                                                      compile_first=compile_first)
        if not times:
            # Kept for this process (a retry per call would cost a trial each time), not on disk.
            log.warning("trifuse: could not choose for %s [%s] (%s); using %s",
                        self.name, bucket, problem, eligible[0].name)
            return keep(eligible[0], f"fallback ({problem})")
        best = min(times, key=times.get)
        cache.put("dialect:" + self.name, bucket, {"choice": best, "ms": times, "rejected": rejected})
        source = "measured"
        if untuned_names:
            source += (f"; not tuned, over {SCREEN_MARGIN:g}x the fastest at default configs: "
                       + ", ".join(untuned_names))
        return keep(self.candidate(best), source, times)

    def _measure(self, eligible: list[Candidate], args: tuple, timer: Timer, device_index: int,
                 rejected: dict[str, str], compile_first: bool = False) -> tuple[dict[str, float], str, list[str]]:
        """({candidate: ms} of those that passed the check, what went wrong when none did, the
        candidates left untuned). Each candidate is first checked and timed with its kernels at
        their default configs where they are not tuned yet (`tuner.untuned`); one whose kernels
        wanted tuning is then tuned, checked and timed again, unless it took more than
        SCREEN_MARGIN times the fastest: its default-config time stands, and it loses. With
        `compile_first` (the GPU's own timers), each round's kernels compile together first."""
        times: dict[str, float] = {}
        left: list[str] = []
        devices = [device_index] if device_index >= 0 else []
        with torch.random.fork_rng(devices=devices), on_device(device_index), _checks_sharing():
            try:
                with phase("reference"):
                    trial = _Trial(self.reference, args, self.check, self.output_like)
            except Exception as e:  # noqa: BLE001  (bad inputs, or no memory for the float64 reference)
                return {}, f"the reference {error_text(e)}", left
            wants_tuning: list[Candidate] = []
            with untuned() as pending:
                if compile_first:
                    _compile_first(trial, eligible)
                for c in progress(eligible, f"trifuse: choosing {self.name}"):
                    before = len(pending)
                    ms = self._checked_time(c, trial, timer, rejected)
                    if ms is not None:
                        times[c.name] = ms
                        if len(pending) > before:
                            wants_tuning.append(c)
            fastest = min(times.values(), default=0.0)
            left = [c.name for c in wants_tuning if times[c.name] > SCREEN_MARGIN * fastest]
            to_tune = [c for c in wants_tuning if c.name not in left]
            if compile_first and to_tune:
                _compile_first(trial, to_tune)  # every config of every kernel they tune, together
            for c in to_tune:
                del times[c.name]  # timed again with its kernels tuned (or rejected now)
                ms = self._checked_time(c, trial, timer, rejected)
                if ms is not None:
                    times[c.name] = ms
        return times, "every candidate failed", left

    @staticmethod
    def _checked_time(c: Candidate, trial: "_Trial", timer: Timer, rejected: dict[str, str]) -> float | None:
        """ms per call of `c` on the trial's inputs, or None (and its reason in `rejected`) when
        its result is wrong or it raises."""
        try:
            with phase(f"check {c.name}"):
                problem = trial.problem(c.fn)
            if problem is not None:
                rejected[c.name] = f"wrong result: {problem}"
                return None
            with phase(f"time {c.name}"):
                return float(timer(c.name, trial.step(c.fn)))
        except Exception as e:  # noqa: BLE001  (candidates from other libraries fail in many ways)
            rejected[c.name] = error_text(e)
            return None

    def explain(self, *args) -> Decision:
        """The decision for this call: the recorded one, or (not decided yet) who is eligible and
        why the others are not, without tuning anything."""
        key = self.key(*args)
        if key is None:
            return Decision("dialect", self.name, "-", "traced", self.candidates[0].name,
                            "traced or empty call: the op's registered implementation")
        deterministic = torch.are_deterministic_algorithms_enabled()
        _, device, bucket = self._where(key, deterministic, _GRAPHED.get())
        done = lookup("dialect", self.name, device, bucket)
        if done is not None:
            return done
        eligible, rejected = self._eligible(args, deterministic)
        chosen = (eligible or self.candidates)[0].name
        return Decision("dialect", self.name, device, bucket, chosen, "not decided yet", {}, rejected)


# ---------------------------------------------------------------------------------------------
# The check: run the reference in float64 (the oracle) and in the inputs' dtypes (PyTorch's own
# error), the candidate on the same inputs, and compare outputs and gradients.
# ---------------------------------------------------------------------------------------------


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _leaf(a, dtype: torch.dtype | None = None):
    """A fresh leaf sharing `a`'s storage (or cast to `dtype`), with `a`'s requires_grad."""
    if not isinstance(a, torch.Tensor):
        return a
    t = a.detach() if dtype is None or not a.is_floating_point() else a.detach().to(dtype)
    return t.requires_grad_(a.requires_grad and t.is_floating_point())


def gate(label: str, out: torch.Tensor | None, ref64: torch.Tensor, ref_lowp: torch.Tensor) -> str | None:
    """None when `out` is close enough to the float64 reference, else what is wrong:

        max|out - ref64| <= GATE_FACTOR * max|ref_lowp - ref64| + GATE_FLOOR[dtype] * max(1, max|ref64|)

    over the entries finite in all three, with NaN and inf where the reference has them.
    """
    if out is None:
        return f"{label} is missing"
    if tuple(out.shape) != tuple(ref64.shape):
        return f"{label} has shape {tuple(out.shape)}, the reference {tuple(ref64.shape)}"
    o, r, lp = out.detach().double(), ref64.detach().double(), ref_lowp.detach().double()
    # Non-finite where the reference is, and only there or where PyTorch's own computation in
    # the same dtype overflows too (fp16 inputs near the top of their range).
    finite = torch.isfinite(r)
    o_finite = torch.isfinite(o)
    if (o_finite & ~finite).any():
        return f"{label} is finite where the reference has NaN/inf"
    if (~o_finite & finite & torch.isfinite(lp)).any():
        return f"{label} has NaN/inf where the reference does not"
    finite &= o_finite & torch.isfinite(lp)
    if not finite.any():
        return None
    err = (o - r)[finite].abs().max().item()
    own = (lp - r)[finite].abs().max().item()
    scale = max(1.0, r[finite].abs().max().item())
    floor = GATE_FLOOR.get(out.dtype, 2 * torch.finfo(out.dtype).eps)
    bound = GATE_FACTOR * own + floor * scale
    if err > bound:
        return f"{label} max error {err:.3g} > {bound:.3g} against the float64 reference"
    return None


class _Trial:
    """One call's inputs, reference outputs and gradients, and the output gradients to apply."""

    def __init__(self, reference: Callable, args: tuple,
                 check: Callable[[Callable, tuple], str | None] | None,
                 output_like: Callable[..., Any] | None = None):
        self.args = args
        self.check = check
        self.train = torch.is_grad_enabled() and any(_needs_grad(a) for a in args)
        lowp = tuple(_leaf(a) for a in args)
        # The reference in the inputs' dtype gives the outputs' shapes, unless the check replaces
        # it and the op says its shapes more cheaply (attention's reference is O(S^2) in memory).
        shapes_from = output_like if check is not None and output_like is not None else reference
        out_lowp = _as_tuple(shapes_from(*lowp))
        self.n_outputs = len(out_lowp)
        self.grad_outputs = [i for i, o in enumerate(out_lowp) if _needs_grad(o)]
        gen = None
        self.dys = []
        for i in self.grad_outputs:
            o = out_lowp[i]
            if gen is None:
                gen = torch.Generator(device=o.device).manual_seed(0)
            self.dys.append(torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype))
        if check is not None:
            return
        wide = tuple(_leaf(a, torch.float64) for a in args)
        with torch.autocast(device_type=_device_type(args), enabled=False):
            out64 = _as_tuple(reference(*wide))
        self.expected = list(zip(out64, out_lowp))
        if self.train:
            self.expected += list(zip(self._grads(out64, wide, [d.double() for d in self.dys]),
                                      self._grads(out_lowp, lowp, self.dys)))

    def _grads(self, outs: tuple, args: tuple, dys: list) -> tuple:
        leaves = [a for a in args if _needs_grad(a)]
        return torch.autograd.grad([outs[i] for i in self.grad_outputs], leaves, dys, allow_unused=True)

    def problem(self, fn: Callable) -> str | None:
        if self.check is not None:
            return self.check(fn, self.args)
        args = tuple(_leaf(a) for a in self.args)
        outs = _as_tuple(fn(*args))
        if len(outs) != self.n_outputs:
            return f"{len(outs)} outputs, the reference has {self.n_outputs}"
        got = list(outs)
        if self.train:
            got += list(self._grads(outs, args, self.dys))
        for i, (g, (e64, elp)) in enumerate(zip(got, self.expected)):
            if not isinstance(e64, torch.Tensor):
                continue
            label = f"output {i}" if i < self.n_outputs else f"gradient {i - self.n_outputs}"
            problem = gate(label, g, e64, elp)
            if problem is not None:
                return problem
        return None

    def step(self, fn: Callable) -> Callable[[], object]:
        """One forward (+ backward when the call trains) of `fn` on fresh leaves of the inputs."""
        args = tuple(_leaf(a) for a in self.args)
        if not self.train:
            def run():
                with torch.no_grad():
                    return fn(*args)
            return run
        leaves = [a for a in args if _needs_grad(a)]

        def run():
            outs = _as_tuple(fn(*args))
            differentiated = [outs[i] for i in self.grad_outputs]
            return torch.autograd.grad(differentiated, leaves, self.dys, allow_unused=True)
        return run


def _compile_first(trial: _Trial, candidates: list[Candidate]) -> None:
    """Compiles, all at once, the Triton kernels that checking and timing `candidates` on `trial`
    will launch (`kernels._launch.precompile`: a pool of compile threads; each call runs with
    trifuse's kernels in compile-only mode, and a tuner that would time compiles all its configs
    instead, deciding nothing). Other libraries' candidates simply run once more. Without it a
    candidate's check compiles its forward and backward kernels, at each variant the check calls
    (attention's: without dropout, then with), one after another on the first step."""
    calls = []
    for c in candidates:
        calls.append(functools.partial(trial.problem, c.fn))  # the check's calls (its own shapes and variants)
        calls.append(lambda fn=c.fn: trial.step(fn)())  # the timed call
    _precompile(calls)


def _compile_call(fn: Callable, args: tuple) -> None:
    """`_compile_first` for one candidate chosen without a trial (the only eligible one, or the
    disk cache's): its forward and backward on `args`, the output gradients zeros."""
    leaves_args = tuple(_leaf(a) for a in args)

    def call():
        outs = [o for o in _as_tuple(fn(*leaves_args)) if _needs_grad(o)]
        leaves = [a for a in leaves_args if _needs_grad(a)]
        if outs and leaves and torch.is_grad_enabled():
            torch.autograd.grad(outs, leaves, [torch.zeros_like(o) for o in outs], allow_unused=True)
    _precompile([call])


def _precompile(calls: list[Callable[[], object]]) -> None:
    from ..kernels._launch import precompile  # (kernels import autotune, not the reverse)

    with phase("compile"):
        precompile(calls, workers=min(os.cpu_count() or 1, 16))


def compare_with_reference(reference: Callable[..., Any], fn: Callable[..., Any], args: tuple) -> str | None:
    """The check `Dialect` makes by default, on `args` (for a `check` that runs it on a smaller
    call than the real one): None when `fn`'s outputs, and gradients where `args` need them,
    pass `gate` against `reference` in float64, else what is wrong. The references are computed
    once per `args` object in a measurement (`shared_by_checks`)."""
    trial = shared_by_checks(("compare_with_reference", reference), args,
                             lambda: _Trial(reference, args, None))
    return trial.problem(fn)


def _needs_grad(a: object) -> bool:
    return isinstance(a, torch.Tensor) and a.requires_grad


def _device_type(args: tuple) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


# ---------------------------------------------------------------------------------------------
# The registry of dialects: explicit `define` calls from op files, a tuple, no import-time patching.
# ---------------------------------------------------------------------------------------------

_DIALECTS: tuple[Dialect, ...] = ()


def define(name: str, key: Callable[..., tuple | None], key_names: Sequence[str],
           reference: Callable[..., Any], check: Callable[[Callable, tuple], str | None] | None = None,
           captures: tuple[tuple[type, Callable[..., tuple]], ...] = (),
           output_like: Callable[..., Any] | None = None) -> Dialect:
    """Creates the dialect of op `name` and registers it (once per name); arguments as `Dialect`."""
    global _DIALECTS
    if any(d.name == name for d in _DIALECTS):
        raise ValueError(f"trifuse.autotune.dialects: {name!r} is already defined")
    dialect = Dialect(name, key, key_names, reference, check, captures, output_like)
    _DIALECTS = (*_DIALECTS, dialect)
    return dialect


def all_dialects() -> tuple[Dialect, ...]:
    return _DIALECTS


def get(name: str) -> Dialect:
    for d in _DIALECTS:
        if d.name == name:
            return d
    raise KeyError(f"trifuse.autotune.dialects: no op {name!r} (defined: {[d.name for d in _DIALECTS]})")


def explain(op: str, *args) -> Decision | tuple[Decision, ...]:
    """With the op's arguments: the decision for that call (see `Dialect.explain`). Without:
    every decision made for `op` in this process."""
    if args:
        return get(op).explain(*args)
    return records(op, kind="dialect")
