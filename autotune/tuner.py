"""Choosing a kernel's launch configuration once per shape bucket, then replaying it.

A `Tuner` replaces `triton.autotune` for kernels whose launchers must stay cheap (DESIGN.md,
"Host overhead"): the launcher builds a small key tuple and calls `tuner.config(key, launch, *args)`,
which is one dict lookup once that key is decided. The first call with a new key decides:

1. the config space: `configs(**shape)` (a function in autotune/configs.py; entry 0 is the
   default), minus the configs `prune(config, limits, **shape)` rejects with a reason (shared
   memory or register estimates against this device's `DeviceLimits`);
2. with TRIFUSE_AUTOTUNE=0, or where nothing can be timed (CPU, Triton's interpreter, inside
   CUDA-graph capture): the shipped per-GPU-family default if there is one, else the first
   config that fits. No timing;
3. else the disk cache (autotune/cache.py) for this device, Triton, torch, kernel and bucket;
4. else every fitting config is timed (`launch(config, *args)` under triton.testing.do_bench, median)
   and the fastest is written to the disk cache: a second process does no timing. On the GPU's
   own timer, every config is first compiled, in parallel (`kernels._launch.precompile`: compiles,
   not timings, are most of a first step's tuning time).

`launch(config, *args)` must be repeatable: it is called many times while timing, so it writes
only outputs that the next call overwrites (or scratch buffers); the launcher then launches the
winner for real. Pass a module-level function and its arguments, so that the hot path builds no
closure. Keys are tuples whose names are `key_names`; one of them is "device" (the CUDA index,
-1 for CPU), the others make the shape bucket (bucket sizes with `pow2_bucket`).
"""
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import statistics
import time
from collections.abc import Callable, Sequence

import triton

from .cache import disk_cache, environment, shipped_default
from .env import INTERPRET, tuning_requested
from .decisions import Clock, Decision, Timer, bucket_string, deciding, log, lookup, phase, record

# Short timing windows: tuning runs inside the first training step, once per shape bucket.
WARMUP_MS = 5
REP_MS = 25


def gpu_timer(label: str, step: Callable[[], object]) -> float:
    """Median GPU milliseconds of a CUDA step (CUDA events, L2 flushed between runs): for
    launch configurations of one kernel, whose host cost does not depend on the config."""
    return triton.testing.do_bench(step, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def wall_timer(label: str, step: Callable[[], object]) -> float:
    """Median milliseconds per call of a CUDA step run back to back, host and GPU overlapped as
    in an eager training loop: for implementations of an op, whose host paths differ (DESIGN.md,
    "Host overhead"; do_bench's GPU time overlaps up to its L2 flush of host time per call)."""
    import torch

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    n = max(1, min(1000, int(REP_MS * 1e-3 / max(time.perf_counter() - t0, 1e-6))))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(samples)


@contextlib.contextmanager
def capture_failures_recovered():
    """Around a CUDA-graph capture that may fail: on failure, ends the default CUDA generator's
    capture mode before the error propagates. PyTorch puts the generator in capture mode when a
    capture begins and takes it out only when the capture ends without error, so after a failed
    capture every later random op on that device (dropout, torch.randn) raises "Offset increment
    outside graph capture encountered unexpectedly" (seen on the lent H200, 2026-11-30: one
    failed block capture, and the model crashed in its next attention dropout). An empty capture
    that succeeds ends the mode, on the same generator state: graphs captured before keep
    advancing the one Philox offset eager ops draw from (a fresh state would replay their
    offsets)."""
    try:
        yield
    except BaseException:
        end_generator_capture_mode()
        raise


def end_generator_capture_mode() -> None:
    """Takes the current device's default CUDA generator out of capture mode (see
    `capture_failures_recovered`); a no-op on its state otherwise. Never raises."""
    import torch

    try:
        if not torch.cuda.is_initialized():
            return  # nothing ran on a GPU: no capture began
        if torch.cuda.is_current_stream_capturing():
            return  # a capture still under way (nested): its own end decides
        scratch = torch.empty(1, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # begin: capture mode on; a clean end: off
            scratch.zero_()
        del graph
    except Exception as e:  # noqa: BLE001  (a broken context: nothing left to save here)
        log.warning("trifuse: could not reset the CUDA generator after a failed graph capture: %s", e)


def graph_timer(label: str, step: Callable[[], object]) -> float:
    """Median GPU milliseconds of a CUDA step replayed from a CUDA graph: for implementations of
    an op that will run inside one (`fuse(cuda_graphs=True)`), where their host paths are gone and
    only their kernels count. The step is warmed up on a side stream and captured once (as
    make_graphed_callables does); its replays are timed back to back with CUDA events, so no
    host time enters. L2 is not flushed: every candidate replays with its inputs equally warm.
    A step that cannot be captured (it synchronizes, or allocates on the host) raises, as it
    would when its block's graph is built."""
    import torch

    # Autocast's cache off, as fusion/graphs.py builds a block's graphs: a cast cached in the
    # warm-up would be missing from the captured work.
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capture_failures_recovered():
            with torch.cuda.graph(graph):
                step()
    finally:
        torch.set_autocast_cache_enabled(cache)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    n = max(1, min(1000, int(REP_MS / max(start.elapsed_time(end), 1e-3))))
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / n)
    del graph  # its memory pool goes back to the caching allocator
    return statistics.median(samples)


def timer_for(device_index: int, explicit: Timer | None,
              default: Timer = gpu_timer) -> tuple[Timer | None, str]:
    """(the timer to use, why none) for a device: None with the reason when nothing may be timed."""
    if not tuning_requested():
        return None, "TRIFUSE_AUTOTUNE=0"
    if explicit is not None:
        return explicit, ""
    if INTERPRET:
        return None, "Triton interpreter"
    if device_index < 0:
        return None, "no GPU to time on"
    return default, ""


def on_device(device_index: int):
    """Makes CUDA device `device_index` current while timing (timers synchronize the current
    device); no-op for the CPU."""
    import torch

    return torch.cuda.device(device_index) if device_index >= 0 else contextlib.nullcontext()


# While a dialect screens its candidates (dialects.Dialect._measure): the list of the tuners that
# would have timed their configs and took their default instead; None otherwise.
_UNTUNED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("trifuse_untuned", default=None)


# True while `kernels._launch.precompile` runs its calls: CachedKernel compiles instead of
# launching, and a tuner that would time an undecided key compiles every config instead.
PRECOMPILING: contextvars.ContextVar[bool] = contextvars.ContextVar("trifuse_precompiling", default=False)


@contextlib.contextmanager
def untuned():
    """Inside, a tuner that would time its configs for an undecided key takes its default (the
    shipped one, else the first that fits) without timing, compiling the others or remembering
    it, and appends its name to the list this yields. Keys already decided (in this process, on
    disk, or with one config) run as decided. What a dialect screens candidates with: tuning a
    candidate that loses by far at its default config would cost a first step every config's
    compile and timing, for nothing."""
    pending: list[str] = []
    token = _UNTUNED.set(pending)
    try:
        yield pending
    finally:
        _UNTUNED.reset(token)


@contextlib.contextmanager
def tuned():
    """Undoes an enclosing `untuned()` inside: a dialect deciding while another screens its
    candidates (one op's candidate calling another op) makes its own choice in full."""
    token = _UNTUNED.set(None)
    try:
        yield
    finally:
        _UNTUNED.reset(token)


def capturing() -> bool:
    """True inside CUDA-graph capture, where nothing may be timed or synchronized."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def progress(items: Sequence, desc: str):
    """`items` under a tqdm progress bar (a dependency) when stderr is a terminal; plain `items`
    where tqdm was left out of an install made without dependencies."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False, disable=None)


def error_text(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    return f"raised {type(e).__name__}" + (f": {first}" if first else "")


# ---------------------------------------------------------------------------------------------
# Device limits for pruning
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What a block may use on one device. Under the interpreter (no device) an H100's numbers
    stand in, so pruning behaves as on the GPU the defaults come from."""

    shared_memory: int = 232448  # bytes per block, opt-in maximum (H100: 227 KiB)
    registers_per_thread: int = 255
    registers_per_sm: int = 65536
    sms: int = 132
    capability: tuple[int, int] = (9, 0)


@functools.cache
def device_limits(device_index: int) -> DeviceLimits:
    if device_index < 0 or INTERPRET:
        return DeviceLimits()
    import torch

    p = torch.cuda.get_device_properties(device_index)
    default = DeviceLimits()
    return DeviceLimits(
        shared_memory=getattr(p, "shared_memory_per_block_optin", None) or 101376,  # smallest of sm80+
        registers_per_thread=default.registers_per_thread,
        registers_per_sm=getattr(p, "regs_per_multiprocessor", None) or default.registers_per_sm,
        sms=p.multi_processor_count,
        capability=(p.major, p.minor),
    )


# ---------------------------------------------------------------------------------------------
# Configs as JSON (the disk cache holds no pickles) and as text (tables, progress bars)
# ---------------------------------------------------------------------------------------------


def config_to_json(c: triton.Config) -> dict:
    out = {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages,
           "num_ctas": getattr(c, "num_ctas", 1)}
    if getattr(c, "maxnreg", None) is not None:
        out["maxnreg"] = c.maxnreg
    return out


def config_label(c: triton.Config) -> str:
    parts = [f"{k}={v}" for k, v in c.kwargs.items()] + [f"warps={c.num_warps}", f"stages={c.num_stages}"]
    if getattr(c, "num_ctas", 1) != 1:
        parts.append(f"ctas={c.num_ctas}")
    if getattr(c, "maxnreg", None) is not None:
        parts.append(f"maxnreg={c.maxnreg}")
    return ",".join(parts)


def _accepting(fn: Callable) -> Callable[[dict], dict]:
    """A filter keeping the keyword arguments `fn` declares (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict
    names = set(params)
    return lambda kw: {k: v for k, v in kw.items() if k in names}


# Compilation or launch failures of one config: it is skipped with the reason, not fatal.
_CONFIG_ERRORS = (
    getattr(triton.runtime.errors, "TritonError", triton.runtime.errors.OutOfResources),
    triton.compiler.errors.CompilationError,
    RuntimeError,
)


class Tuner:
    """The launch configuration of one kernel per key: `config(key, launch, *args)`.

    Args:
        name: the kernel's name in the cache and the tables, e.g. "layer_norm_fwd".
        configs: `configs(**shape) -> list[triton.Config]`, entry 0 the default.
        key_names: names of the key tuple's entries; "device" among them.
        prune: `prune(config, limits, **shape) -> str | None`, a reason when it cannot fit.

    `timer` (an attribute, None = `gpu_timer` on CUDA) may be replaced, e.g. by a fake in tests.
    """

    def __init__(self, name: str, configs: Callable[..., Sequence[triton.Config]], key_names: Sequence[str],
                 prune: Callable[..., str | None] | None = None):
        if "device" not in key_names:
            raise ValueError(f"trifuse.autotune.Tuner({name!r}): key_names must include 'device', "
                             f"got {tuple(key_names)}")
        self.name = name
        self.configs = configs
        self.key_names = tuple(key_names)
        self.prune = prune
        self.timer: Timer | None = None
        self._device_pos = self.key_names.index("device")
        self._configs_kwargs = _accepting(configs)
        self._prune_kwargs = _accepting(prune) if prune is not None else None
        self._memo: dict[tuple, triton.Config] = {}
        self._untuned: dict[tuple, triton.Config] = {}  # defaults taken while screening (untuned())

    def config(self, key: tuple, launch: Callable[..., object], *args) -> triton.Config:
        """The chosen config for `key`: a dict hit once decided, else decided now by timing
        `launch(config, *args)` for each candidate config (see the module docstring)."""
        cfg = self._memo.get(key)
        if cfg is None:
            pending = _UNTUNED.get()
            if pending is not None and key in self._untuned:  # screening: the default, one lookup
                pending.append(self.name)
                return self._untuned[key]
            cfg = self._decide(key, launch, args)
        return cfg

    def clear(self) -> None:
        """Forgets this process's choices (the disk cache stays)."""
        self._memo.clear()
        self._untuned.clear()

    def is_decided(self, key: tuple) -> bool:
        """Whether `key` has its config for this process (not so inside CUDA-graph capture)."""
        return key in self._memo

    def _decide(self, key: tuple, launch: Callable[..., object], args: tuple) -> triton.Config:
        with deciding() as clock:
            return self._choose(key, launch, args, clock)

    def _choose(self, key: tuple, launch: Callable[..., object], args: tuple, clock: Clock) -> triton.Config:
        if len(key) != len(self.key_names):
            raise ValueError(f"trifuse.autotune.Tuner({self.name!r}): key {key!r} does not match "
                             f"{self.key_names}")
        device_index = key[self._device_pos]
        shape = {n: v for n, v in zip(self.key_names, key) if n != "device"}
        bucket = bucket_string(self.key_names, key)
        space = list(self.configs(**self._configs_kwargs(shape)))
        if not space:
            raise ValueError(f"trifuse.autotune.Tuner({self.name!r}): the config space for {bucket} is empty")
        fitting, rejected = self._fitting(space, device_index, shape)

        def keep(cfg: triton.Config, source: str, times: dict | None = None) -> triton.Config:
            self._memo[key] = cfg
            record(Decision("kernel", self.name, environment(device_index).device, bucket, config_label(cfg),
                            source, times or {}, rejected, clock.seconds(), clock.nested, dict(clock.phases)))
            return cfg

        if capturing():
            # No timing inside CUDA-graph capture, and nothing memoized: the next eager call tunes.
            return fitting[0]
        timer, why_not = timer_for(device_index, self.timer)
        if timer is None:
            family, match = self._shipped(fitting, device_index, bucket)
            if match is not None:
                return keep(match, f"shipped {family} defaults")
            return keep(fitting[0], f"default ({why_not})")
        if len(fitting) == 1:
            return keep(fitting[0], "only config")
        cache = disk_cache(device_index)
        hit = cache.get(self.name, bucket)
        match = None if hit is None else _find(fitting, hit.get("config"))
        if match is not None:
            return keep(match, "disk cache", dict(hit.get("ms", {})))
        pending = _UNTUNED.get()
        if pending is not None:  # a dialect screening its candidates: no timing, nothing kept
            pending.append(self.name)
            match = self._shipped(fitting, device_index, bucket)[1]
            self._untuned[key] = match if match is not None else fitting[0]
            return self._untuned[key]
        if PRECOMPILING.get():
            # A dialect compiling a candidate's kernels ahead of its check (`Dialect._measure`):
            # every config goes to the compile pool with the others, nothing is timed or kept;
            # the real call then tunes on configs already compiled.
            for cfg in fitting:
                launch(cfg, *args)
            return fitting[0]
        times: dict[str, float] = {}
        by_label = {config_label(c): c for c in fitting}
        with on_device(device_index):
            if self.timer is None:  # the GPU's own timer: every config compiles first, in parallel
                from ..kernels._launch import precompile  # (kernels import autotune, not the reverse)

                with phase("compile"):
                    precompile(functools.partial(launch, cfg, *args) for cfg in by_label.values())
            with phase("time"):  # a config that did not precompile compiles at its first timed launch
                for label, cfg in progress(list(by_label.items()), f"trifuse: tuning {self.name} [{bucket}]"):
                    try:
                        times[label] = float(timer(label, functools.partial(launch, cfg, *args)))
                    except _CONFIG_ERRORS as e:
                        rejected[label] = error_text(e)
        if not times:
            log.warning("trifuse: every config of %s failed for %s; using the default", self.name, bucket)
            return keep(fitting[0], "fallback (every config failed)")
        best = min(times, key=times.get)
        cache.put(self.name, bucket, {"config": config_to_json(by_label[best]), "ms": times})
        return keep(by_label[best], "measured", times)

    def _shipped(self, fitting: list, device_index: int,
                 bucket: str) -> tuple[str | None, triton.Config | None]:
        """(the GPU family, the config among `fitting`) of the shipped default for this bucket,
        (None, None) when none is shipped or it is no longer in the space."""
        shipped = shipped_default(device_index, self.name, bucket)
        if shipped is None:
            return None, None
        return shipped[0], _find(fitting, shipped[1].get("config"))

    def _fitting(self, space: list, device_index: int, shape: dict) -> tuple[list, dict[str, str]]:
        if self.prune is None:
            return space, {}
        limits = device_limits(device_index)
        kwargs = self._prune_kwargs(shape)
        fitting, rejected = [], {}
        for c in space:
            reason = self.prune(c, limits, **kwargs)
            if reason is None:
                fitting.append(c)
            else:
                rejected[config_label(c)] = reason
        if not fitting:
            # The estimates are conservative; the default is what the kernel always ran with.
            log.warning("trifuse: every config of %s was pruned for %s; keeping the default",
                        self.name, shape)
            fitting = space[:1]
        return fitting, rejected

    def decision(self, key: tuple) -> Decision | None:
        """The recorded decision for `key`, if it was decided in this process."""
        device = environment(key[self._device_pos]).device
        return lookup("kernel", self.name, device, bucket_string(self.key_names, key))


def _find(configs: Sequence[triton.Config], wanted: object) -> triton.Config | None:
    """The config among `configs` whose JSON form is `wanted` (a cached or shipped entry that is
    no longer in the space, because the kernel's space changed, is ignored)."""
    for c in configs:
        if config_to_json(c) == wanted:
            return c
    return None
