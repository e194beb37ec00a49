"""Where tests run. Imported first by conftest.py: sets TRITON_INTERPRET=1 on machines without
a GPU *before* anything imports trifuse (the interpreter must be chosen before a kernel module
is imported), so CPU runs execute the real Triton kernels in Triton's interpreter."""
import os

import torch

ON_GPU: bool = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE: str = "cuda" if ON_GPU else "cpu"
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET") == "1"


def _patch_triton_language_once_per_launch() -> None:
    """Speed only, under the interpreter: Triton's interpreter patches `triton.language` when a
    kernel is launched (restoring it when the grid is done), then walks the language modules again
    (`inspect.getmembers` over tl, tl.tensor and tl.math, ~1 ms) on every call of a @triton.jit
    function from inside the kernel, per program instance: our helpers and Triton's own `tl.sum`,
    `tl.max`, `tl.cdiv`. Those walks find every builtin already wrapped and change nothing, so
    inside a launch they are skipped once the modules the function sees have been walked. The
    kernels run exactly as before; a Triton without these internals is left as it is."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or hasattr(original, "__wrapped__"):
        return
    walked: set[int] = set()  # the language modules patched inside the running launch
    launch_depth = [0]
    seen: dict = {}  # function -> the ids of the language modules among its globals

    def languages(fn) -> set[int]:
        found = seen.get(fn)
        if found is None:
            modules = (v for v in fn.__globals__.values() if inspect.ismodule(v))
            found = seen[fn] = {id(v) for v in modules if v in (tl, tl.core)}
        return found

    class LaunchScope:
        def __init__(self, scope) -> None:
            self.scope = scope

        def restore(self) -> None:
            launch_depth[0] -= 1
            walked.clear()
            self.scope.restore()

    def patch_lang(fn):
        needed = languages(fn)
        if launch_depth[0] == 0:  # a launch: GridExecutor restores what it patched
            scope = LaunchScope(original(fn))
            launch_depth[0] += 1
            walked.update(needed)
            return scope
        if needed <= walked:  # a call inside the launch, its modules already patched
            return scope_type()
        scope = original(fn)  # as Triton does: patched for good, never restored
        walked.update(needed)
        return scope

    patch_lang.__wrapped__ = original
    interpreter._patch_lang = patch_lang


def set_interpreter_overflow_checks(enabled: bool) -> None:
    """Speed only, under the interpreter: Triton's interpreter options ask for the integer-overflow
    sanitizer (each int32 add, sub and mul in a kernel redone in int64 and compared against the
    int32 range, about a fifth of a kernel's interpreted time), but the check's assert is emitted
    only in debug mode, which the interpreter never sets: the comparisons are computed and dropped.
    Off, the kernels run exactly as before (tests/kernels/test_launch.py checks both, and fails if a
    Triton starts asserting there, when this should be left on). A Triton without these options is
    left as it is."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", enabled) != enabled:
        builder.options = dataclasses.replace(options, sanitize_overflow=enabled)


def _skip_dynamo_guard_latency_profile() -> None:
    """Speed only: after building the guards of each new capture, Dynamo times them once for its
    compilation metrics (`profile_guard_manager`, which first flushes the CPU caches: ~20 ms a
    capture on this machine, a twentieth of the model tests' time). The tests read no metrics;
    the guards are built and checked as before, only the timing is skipped (reported as 0 us)."""
    import torch._dynamo.guards as guards

    profile = getattr(guards, "profile_guard_manager", None)
    if profile is not None and not hasattr(profile, "__wrapped__"):
        def no_profile(*args, **kwargs) -> float:
            return 0.0

        no_profile.__wrapped__ = profile
        guards.profile_guard_manager = no_profile


_skip_dynamo_guard_latency_profile()
if INTERPRETED:
    _patch_triton_language_once_per_launch()
    set_interpreter_overflow_checks(False)
