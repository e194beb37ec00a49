"""A thin launch path for Triton kernels whose eager host time matters.

`kernel[grid](...)` re-derives the specialization of every argument, builds and stringifies a
cache key (including `str(options)`), checks globals and looks up the device and stream on
every call: about 60 µs per launch on the lent H100 box, against a few µs of GPU work for the
small tensors of a training step. `CachedKernel` pays that once per specialization and then
calls the compiled kernel's launcher directly.

The specialization key reproduces what Triton specializes on: each tensor's dtype and whether
its address is 16-byte aligned, each integer's width and whether it is 1 or a multiple of 16,
every constexpr's value, and the device. Launch hooks are passed on as Triton does. Anything
else (the interpreter, a Triton without `triton.knobs` or whose launcher signature differs) takes
Triton's own path.
"""
import warnings

import torch
import triton

from ..autotune.env import INTERPRET

_knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older ones take Triton's own path


def _int_spec(v: int) -> tuple[bool, bool, bool]:
    return (v == 1, v % 16 == 0, -(2**31) <= v < 2**31)


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
        if not self._fast:
            self.fn[grid](*args, **kwargs)
            return
        device = torch.cuda.current_device()
        key = (device, tuple(kwargs.items()), *(
            (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
            else _int_spec(a) if type(a) is int
            else type(a)
            for a in args
        ))
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = self.fn[grid](*args, **kwargs)
            return
        try:
            all_args = (*args, *(kwargs[name] for name in self.fn.arg_names[len(args):]))
            stream = torch._C._cuda_getCurrentRawStream(device)
            # Launch hooks (a profiler's) are honoured exactly as Triton's own path does.
            enter_hook = _knobs.runtime.launch_enter_hook
            metadata = None if enter_hook is None else compiled.launch_metadata(grid, stream, *all_args)
            compiled.run(
                grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                stream, compiled.function, compiled.packed_metadata,
                metadata, enter_hook, _knobs.runtime.launch_exit_hook, *all_args,
            )
        except (TypeError, AttributeError, KeyError) as e:
            # This Triton's launcher differs from the one this path was written for: use
            # Triton's own path from now on (correct, only slower), and say so once.
            self._fast = False
            warnings.warn(f"trifuse: direct launch of {getattr(self.fn, '__name__', 'a kernel')} failed ({e!r}); "
                          "using Triton's launch path", RuntimeWarning, stacklevel=2)
            self.fn[grid](*args, **kwargs)
