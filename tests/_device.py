"""Where tests run. Imported first by conftest.py: sets TRITON_INTERPRET=1 on machines without
a GPU *before* anything imports trifuse (the interpreter must be chosen before a kernel module
is imported), so CPU runs execute the real Triton kernels in Triton's interpreter."""
import os
import sys

# Off sys.path first: the checkout's root, where `python -m pytest` puts it (the current directory)
# and xdist's workers too. There trifuse's `kernels/`, `patterns/`, ... shadow top-level packages
# of the same name, before any test imports trifuse (whose __init__ does the same): transformers
# 5.25 imports the Hub's `kernels` package.
_ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _ROOT]

import torch

ON_GPU: bool = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE: str = "cuda" if ON_GPU else "cpu"
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET") == "1"


def configs_run_here(configs: list) -> list:
    """The configs a test that forces each in turn runs on this machine: every one on a GPU; under
    the interpreter, which runs neither warps nor pipeline stages, the first of those that differ
    only in those (they compute alike there, launch for launch)."""
    if not INTERPRETED:
        return list(configs)
    seen, kept = set(), []
    for config in configs:
        key = tuple(sorted(config.kwargs.items()))
        if key not in seen:
            seen.add(key)
            kept.append(config)
    return kept


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


def _memoize_interpreter_types() -> None:
    """Speed only, under the interpreter: three pure functions of a Triton type that every op of
    every program instance calls again. `_get_np_dtype` (the numpy dtype an interpreted tensor of
    a Triton dtype holds) builds its table of 20 dtypes on each call; `block_type(element, shape)`
    unwraps, validates and names its shape on each construction; `tensor(handle, type)` wraps each
    dimension of its type's shape in a constexpr, the lot in Triton's tuple (a third of an
    attention kernel's interpreted time between them). Each now looks up what it computed for the
    same arguments: the numpy dtype; a block type's shape, element count and name, for a shape of
    plain ints (any other shape, one that raises included, takes Triton's own path); a tensor's
    shape and element count, for its type (shared between tensors: Triton never mutates them).
    The kernels run exactly as before; a Triton without these internals, or whose constructors set
    more than these, is left as it is."""
    import triton.language as tl
    from triton.runtime import interpreter

    get_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if get_np_dtype is not None and not hasattr(get_np_dtype, "__wrapped__"):
        np_dtypes: dict = {}

        def memo_np_dtype(tt_dtype):
            key = str(tt_dtype)  # a dtype's name, a block type's shape and element type
            found = np_dtypes.get(key)
            if found is None:
                found = np_dtypes[key] = get_np_dtype(tt_dtype)
            return found

        memo_np_dtype.__wrapped__ = get_np_dtype
        interpreter._get_np_dtype = memo_np_dtype

    init = tl.block_type.__init__
    if hasattr(init, "__wrapped__"):
        return
    blocks: dict = {}  # (element type, shape) -> (shape, numel, name)
    shapes = (list, getattr(tl, "tuple", list))  # what Triton takes for a shape (its `tuple`, not Python's)
    # What Triton's own __init__s set. One that sets more (another Triton) is never short-cut.
    block_fields = {"element_ty", "shape", "numel", "name"}
    tensor_fields = {"handle", "type", "dtype", "shape", "numel"}

    def memo_init(self, element_ty, shape):
        name = getattr(element_ty, "name", None)
        plain = name is not None and type(shape) in shapes and all(type(d) is int for d in shape)
        key = (name, *shape) if plain else None
        found = blocks.get(key) if plain else None
        if found is None:
            init(self, element_ty, shape)
            if plain and vars(self).keys() == block_fields:
                blocks[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = found

    memo_init.__wrapped__ = init
    tl.block_type.__init__ = memo_init

    tensor_init = tl.tensor.__init__
    tensor_shapes: dict = {}  # (type's class, type's name) -> (shape, numel): values, never mutated

    def memo_tensor_init(self, handle, type):
        key = (type.__class__, getattr(type, "name", None))
        found = tensor_shapes.get(key)
        if found is None:
            tensor_init(self, handle, type)
            if key[1] is not None and vars(self).keys() == tensor_fields:
                tensor_shapes[key] = (self.shape, self.numel)
            return
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        self.shape, self.numel = found

    memo_tensor_init.__wrapped__ = tensor_init
    tl.tensor.__init__ = memo_tensor_init


def _short_cut_broadcasts() -> None:
    """Speed only, under the interpreter: every binary op of every program instance first
    broadcasts its operands to a common shape (`broadcast_impl_value`), comparing the two shapes
    dimension by dimension through Triton's tuple class, or building the type a scalar is splat
    to (~30 us an op, a fifth of a kernel's interpreted time). Two blocks of one shape, which
    Triton returns unchanged after those comparisons, are returned at once; a number (not a
    pointer) beside a block is splat as Triton splats it, to a type built once per (block type,
    number type). Every other case (different shapes or ranks, pointers, two scalars) takes
    Triton's own path. The kernels run exactly as before; a Triton without these internals is
    left as it is."""
    import triton.language as tl
    from triton.runtime import interpreter

    semantic = getattr(interpreter, "interpreter_semantic", None)
    broadcast = getattr(semantic, "broadcast_impl_value", None)
    if broadcast is None or hasattr(broadcast, "__wrapped__"):
        return
    block = tl.block_type
    scalar = tl.dtype  # exactly: a number's type (a pointer's name leaves out its address space)
    make_tensor = getattr(semantic, "make_tensor", semantic.tensor)  # Triton 3.6: `tensor` itself
    splat_types: dict = {}  # (block type's name, scalar type's name) -> the splat's type, its IR type

    def splat(value, like):
        key = (like.name, value.type.name)
        found = splat_types.get(key)
        if found is None:
            splat_type = like.with_element_ty(value.type)
            found = splat_types[key] = (splat_type, splat_type.to_ir(semantic.builder))
        splat_type, ir_type = found
        return make_tensor(semantic.builder.create_splat(ir_type, value.handle), splat_type)

    def broadcast_short_cut(lhs, rhs):
        lhs_type, rhs_type = lhs.type, rhs.type
        if type(lhs_type) is block:
            if type(rhs_type) is block:
                left, right = lhs_type.shape, rhs_type.shape
                if left is right or list(left) == list(right):
                    return lhs, rhs
            elif type(rhs_type) is scalar:
                return lhs, splat(rhs, lhs_type)
        elif type(rhs_type) is block and type(lhs_type) is scalar:
            return splat(lhs, rhs_type), rhs
        return broadcast(lhs, rhs)

    broadcast_short_cut.__wrapped__ = broadcast
    semantic.broadcast_impl_value = broadcast_short_cut


def _short_cut_binary_type_checks() -> None:
    """Speed only, under the interpreter: every binary op of every program instance first works
    out the type both operands compute in (`binary_op_type_checking_impl`: pointer checks, the
    promotion rules, a cast of each operand), then broadcasts them (with the broadcast, about a
    fifth of the attention kernel tests' time in py-spy). Two tensors of one element type that is not a
    pointer compute in that type, and each cast returns its operand unchanged; the one exception
    is a division or modulo of floats narrower than 32 bits, which Triton upcasts to fp32. Those
    pairs go straight to the broadcast, and so does a pointer beside an integer tensor where the
    op allows a pointer on that side (an address plus offsets: Triton checks, then takes both as
    they are); every other case (a number, two element types, that division, other pointer pairs)
    takes Triton's own path. The kernels run exactly as before; a Triton without these internals
    is left as it is."""
    import triton.language as tl
    from triton.runtime import interpreter

    semantic = getattr(interpreter, "interpreter_semantic", None)
    checks = getattr(semantic, "binary_op_type_checking_impl", None)
    if checks is None or hasattr(checks, "__wrapped__") or not hasattr(semantic, "broadcast_impl_value"):
        return
    tensor, scalar = tl.tensor, tl.dtype
    # Element types that compute in themselves beside themselves: every float but in a division
    # or modulo (fp32 and fp64 there too), every integer (Triton's integer promotion of one type
    # is that type), by name: fixed per Triton type, never a pointer.
    same = {t.name for t in (tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int1, tl.int8, tl.int16,
                             tl.int32, tl.int64, tl.uint8, tl.uint16, tl.uint32, tl.uint64)}
    same_in_division = same - {tl.float16.name, tl.bfloat16.name}
    # A pointer and an integer, where the op allows a pointer on that side (an address plus
    # offsets): Triton checks, then takes both as they are.
    pointer = tl.pointer_type
    integers = same - {tl.float16.name, tl.bfloat16.name, tl.float32.name, tl.float64.name}

    def type_checks_short_cut(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True,
                              div_or_mod=False):
        if type(lhs) is tensor and type(rhs) is tensor:
            left, right = lhs.dtype, rhs.dtype
            if type(left) is scalar:
                if type(right) is scalar:
                    if left.name == right.name and left.name in (same_in_division if div_or_mod else same):
                        return semantic.broadcast_impl_value(lhs, rhs)
                elif type(right) is pointer and allow_rhs_ptr and left.name in integers:
                    return semantic.broadcast_impl_value(lhs, rhs)
            elif type(left) is pointer and allow_lhs_ptr and type(right) is scalar and right.name in integers:
                return semantic.broadcast_impl_value(lhs, rhs)
        return checks(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    type_checks_short_cut.__wrapped__ = checks
    semantic.binary_op_type_checking_impl = type_checks_short_cut


def _lean_builtin_calls() -> None:
    """Speed only, under the interpreter: each call of a Triton builtin inside a kernel (every
    `+`, `tl.load`, `tl.where`, ...) goes through two wrappers before the builtin itself: the
    interpreter's patch (a lambda that copies the keywords into a new dict without `_semantic`,
    then passes its own) and `tl.core.builtin`'s (which checks `_semantic` was passed). Each
    builtin is now patched with one wrapper that sets `_semantic` to the interpreter's and calls
    the builtin itself: the same call the two made. Builtins wrapped otherwise than by
    `tl.core.builtin` alone keep the interpreter's own patch. Also `_unwrap_if_constexpr`, which
    the builtins call on their arguments, returns a tensor, an int, a float, a bool or None at
    once (as it does after four isinstance checks). The kernels run exactly as before; a Triton
    without these internals is left as it is."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_attr = getattr(interpreter, "_patch_attr", None)
    semantic = getattr(interpreter, "interpreter_semantic", None)
    builtin = getattr(tl.core, "builtin", None)
    if patch_attr is None or semantic is None or builtin is None or hasattr(patch_attr, "__wrapped__"):
        return
    if list(inspect.signature(patch_attr).parameters) != ["obj", "name", "member", "builder", "scope"]:
        return
    try:
        wrapper_code = builtin(lambda _semantic=None: None).__code__  # every builtin's wrapper's
    except Exception:  # noqa: BLE001  (another Triton's builtin: leave the patch as it is)
        return

    def lean_patch_attr(obj, name, member, builder, scope):
        fn = getattr(member, "__wrapped__", None)
        if fn is None or getattr(member, "__code__", None) is not wrapper_code:
            return patch_attr(obj, name, member, builder, scope)

        def call(*args, **kwargs):
            kwargs["_semantic"] = semantic  # kwargs: this call's own dict
            return fn(*args, **kwargs)

        scope.set_attr(obj, name, call)

    lean_patch_attr.__wrapped__ = patch_attr
    interpreter._patch_attr = lean_patch_attr

    unwrap = getattr(tl.core, "_unwrap_if_constexpr", None)
    if unwrap is None or hasattr(unwrap, "__wrapped__"):
        return
    as_they_are = (tl.tensor, int, float, bool, type(None))

    def unwrap_short_cut(o):
        if type(o) in as_they_are:
            return o
        return unwrap(o)

    unwrap_short_cut.__wrapped__ = unwrap
    tl.core._unwrap_if_constexpr = unwrap_short_cut


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


def _keep_pytest_off_torchs_trace_log() -> None:
    """Speed only: pytest (9 and later) attaches its log-capture handlers to every logger that
    does not propagate, torch's structured-trace logger among them, and torch builds each trace
    event (its metadata, its payload: graphs, guards, as JSON with an MD5) whenever that logger
    has a handler at all. So under pytest every Dynamo capture paid for a trace that no test
    reads. That logger now refuses pytest's handlers; torch's own (TORCH_TRACE) still attach,
    and every other logger is captured as before."""
    import logging

    trace_log = logging.getLogger("torch.__trace")
    add = trace_log.addHandler
    if hasattr(add, "__wrapped__"):
        return

    def add_unless_pytests(handler: logging.Handler) -> None:
        if not type(handler).__module__.startswith("_pytest"):
            add(handler)

    add_unless_pytests.__wrapped__ = add
    trace_log.addHandler = add_unless_pytests


_skip_dynamo_guard_latency_profile()
_keep_pytest_off_torchs_trace_log()
if INTERPRETED:
    _patch_triton_language_once_per_launch()
    _memoize_interpreter_types()
    _short_cut_broadcasts()
    _short_cut_binary_type_checks()
    _lean_builtin_calls()
    set_interpreter_overflow_checks(False)
