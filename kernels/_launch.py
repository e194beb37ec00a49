"""A thin launch path for Triton kernels whose eager host time matters.

`kernel[grid](...)` re-derives the specialization of every argument, builds and stringifies a
cache key (including `str(options)`), checks globals and looks up the device and stream on
every call: about 60 µs per launch on the lent H100 box, against a few µs of GPU work for the
small tensors of a training step. `CachedKernel` pays that once per specialization and then
calls the compiled kernel's launcher directly.

The cache key covers everything Triton specializes on, more finely: each tensor's dtype,
its address modulo 16 and whether it is on a GPU, each integer's value (Triton
specializes on its width and whether it is 1 or a multiple of 16; keying on the value itself
costs less per call than deriving those, at one entry per distinct shape, which pays Triton's
own path once), every constexpr's value and launch option, and the device. Tensors reach the
launcher as their addresses (ints); launch hooks are passed on as Triton does, with the tensors.
Anything else (the interpreter, a Triton without `triton.knobs` or whose launcher signature
differs) takes Triton's own path.
"""
import inspect
import logging
import os
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

from ..autotune.decisions import backward_here
from ..autotune.env import INTERPRET
from ..autotune.tuner import PRECOMPILING as _PRECOMPILING

_knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older ones take Triton's own path
try:  # Triton's own parallel compilation (JIT compiles submitted to an executor); not in every Triton
    from triton.runtime._async_compile import AsyncCompileMode
except ImportError:
    AsyncCompileMode = None

log = logging.getLogger("trifuse")


# A bound on the entries of one kernel: one per distinct launch signature (shapes, strides,
# constexprs); a process that sees endlessly many shapes starts over rather than grow.
MAX_ENTRIES = 4096


def store_plan(plans: dict, key: tuple, plan: tuple) -> None:
    """Keeps an op's launch plan (grid and launch keywords per exact call shape), bounded like
    CachedKernel's entries: a process that sees endlessly many shapes starts over."""
    if len(plans) >= MAX_ENTRIES:
        plans.clear()
    plans[key] = plan


def precompile(calls: Iterable[Callable[[], object]], workers: int | None = None) -> bool:
    """Compiles what each call would launch through CachedKernel, several kernels at once, and
    launches nothing: each call runs with CachedKernel in compile-only mode (`JITFunction.warmup`)
    inside Triton's AsyncCompileMode, which hands every compile to a pool of `workers` threads
    (default: one per CPU, at most 16); Triton's passes and ptxas run outside the GIL, so a tuner's
    dozens of configs compile in parallel instead of one after another. Inside, a tuner that would
    time an undecided key hands every config it would time to the pool instead and decides nothing
    (so a whole fwd+bwd call compiles its kernels' configs together); kernels launched through
    Triton's own path compile there and run. Later launches of the same specializations find them
    compiled. A call whose compile fails is skipped here: its real launch raises the error. Returns
    False (doing nothing) under the interpreter or on a Triton without AsyncCompileMode."""
    calls = list(calls)
    if INTERPRET or AsyncCompileMode is None or not calls or _PRECOMPILING.get():
        return False
    workers = workers or min(len(calls), os.cpu_count() or 1, 16)
    token = _PRECOMPILING.set(True)
    try:
        # backward_here: the calls' backward passes see the flag and the mode (contextvars both)
        with backward_here(), ThreadPoolExecutor(workers, thread_name_prefix="trifuse-compile") as pool:
            try:
                mode = AsyncCompileMode(pool, ignore_errors=True)
            except TypeError:  # a Triton whose mode has no ignore_errors: failures raise at exit
                mode = AsyncCompileMode(pool)
            with mode:
                for call in calls:
                    try:
                        call()
                    except Exception as e:  # noqa: BLE001  (the timed launch reports it)
                        log.debug("trifuse: precompiling a launch failed: %r", e)
    except Exception as e:  # noqa: BLE001  (a compile error surfacing at the mode's exit)
        log.debug("trifuse: precompiling ended with %r", e)
    finally:
        _PRECOMPILING.reset(token)
    return True


def _active(hook):
    """A launch hook that calls something, else None. Newer Tritons keep a hook chain even when
    nothing is hooked; handing the launcher an empty one costs a Python call per launch, and
    Triton's launch metadata (a dict built per launch) on top."""
    calls = getattr(hook, "calls", None)
    return None if hook is None or (calls is not None and not calls) else hook


def launch_key(device: int, args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """(the cache key of a launch, its runtime arguments with tensors as device addresses).

    Triton's launchers take an int for a pointer as it is, where a tensor costs a Python call of
    data_ptr() and a cuPointerGetAttribute each. The key reads each address's alignment off the
    same int, and is_cuda: a tensor elsewhere gets an entry of its own, whose first launch takes
    Triton's own path and raises there (the launcher checks no address it is given as an int).
    """
    addresses, spec = [], []
    for a in args:  # one loop for both lists: ~10% less host time than two comprehensions
        if isinstance(a, _Tensor):
            address = a.data_ptr()
            addresses.append(address)
            spec.append((a.dtype, address & 15, a.is_cuda))  # & 15: the misalignment, finer than Triton's
        else:
            addresses.append(a)
            spec.append(a if type(a) is int else type(a))  # floats, bools, None: not by value
    return (device, tuple(kwargs.items()), *spec), addresses


_Tensor = torch.Tensor


def launcher_tail(fn: triton.JITFunction, n_args: int, kwargs: dict) -> tuple:
    """The values a compiled launcher takes after the `n_args` positional ones: each later
    parameter's keyword value, or its default where the call leaves it out (a constexpr such as
    `PREFETCH: tl.constexpr = False` that only some configs set)."""
    python_fn = getattr(fn, "fn", None)  # the function under @triton.jit (also when interpreted)
    defaults = {} if python_fn is None else {
        name: p.default for name, p in inspect.signature(python_fn).parameters.items()
        if p.default is not inspect.Parameter.empty}
    tail = []
    for name in fn.arg_names[n_args:]:
        if name in kwargs:
            tail.append(kwargs[name])
        elif name in defaults:
            tail.append(defaults[name])
        else:
            raise TypeError(f"{fn.__name__}: argument {name!r} was not given and has no default")
    return tuple(tail)


class CachedKernel:
    """Wraps a `@triton.jit` function: `CachedKernel(fn)[grid](*args, **constexprs)`.

    Positional arguments are the kernel's runtime arguments in order; keyword arguments are its
    constexprs and launch options (num_warps, num_stages).
    """

    def __init__(self, fn: triton.JITFunction) -> None:
        self.fn = fn
        self._compiled: dict[tuple, object] = {}
        self._fast = not INTERPRET and _knobs is not None

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if _PRECOMPILING.get():
            self.fn.warmup(*args, grid=grid, **kwargs)
            return
        if not self._fast:
            self.fn[grid](*args, **kwargs)
            return
        device = torch.cuda.current_device()
        key, addresses = launch_key(device, args, kwargs)
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.fn[grid](*args, **kwargs)
            if len(self._compiled) >= MAX_ENTRIES:
                self._compiled.clear()
            # The launcher takes the constexprs after the runtime arguments; fixed for this key.
            tail = launcher_tail(self.fn, len(args), kwargs)
            self._compiled[key] = (compiled, tail)
            return
        compiled, tail = entry
        try:
            stream = torch._C._cuda_getCurrentRawStream(device)
            # Launch hooks (a profiler's) are honoured as Triton's own path does, with the tensors.
            enter_hook = _active(_knobs.runtime.launch_enter_hook)
            exit_hook = _active(_knobs.runtime.launch_exit_hook)
            metadata = None
            if enter_hook is not None or exit_hook is not None:
                metadata = compiled.launch_metadata(grid, stream, *args, *tail)
                addresses = args
            compiled.run(
                grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                stream, compiled.function, compiled.packed_metadata,
                metadata, enter_hook, exit_hook, *addresses, *tail,
            )
        except (TypeError, AttributeError, KeyError) as e:
            # This Triton's launcher differs from the one this path was written for: use
            # Triton's own path from now on (correct, only slower), and say so once.
            self._fast = False
            warnings.warn(f"trifuse: direct launch of {getattr(self.fn, '__name__', 'a kernel')} failed ({e!r}); "
                          "using Triton's launch path", RuntimeWarning, stacklevel=2)
            self.fn[grid](*args, **kwargs)
