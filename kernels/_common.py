"""Helpers every op file shares: input checks, layout, device dispatch, the eager fast path.

No kernels live here.
"""
import contextlib
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton.language as tl
from torch.utils._device import DeviceContext

from ..autotune.env import INTERPRET
from ._interpreter import correct_bf16

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Under the interpreter, bf16 computed as on a GPU (kernels/_interpreter.py); where this Triton's
# interpreter cannot be corrected, bf16 CPU tensors take the PyTorch path instead.
INTERPRETER_BF16: bool = INTERPRET and correct_bf16()


# ---------------------------------------------------------------------------------------------
# Input checks. They raise TypeError for dtypes and ValueError for everything else, and name
# the op, the argument, what was expected and what came. They run in the fake implementations
# too, so torch.compile raises the same errors.
# ---------------------------------------------------------------------------------------------


def check_tensor(op: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"trifuse.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"trifuse.{op}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}"
        )


def check_same_device(op: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"trifuse.{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; "
                "all tensors must be on one device"
            )


def check_same_dtype(op: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != ref.dtype:
            raise TypeError(f"trifuse.{op}: {name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")


def check_shape(op: str, name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"trifuse.{op}: {name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_probability(op: str, name: str, p: float) -> None:
    # Under torch.compile(dynamic=True) p may be symbolic: check its example value (no guard);
    # one without any is checked when the op runs.
    value = p
    if isinstance(p, (torch.SymFloat, torch.SymInt)):
        value = p.node.hint
        if value is None:
            return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"trifuse.{op}: {name} must be a probability in [0, 1], got {p!r}")


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


def as_rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """(base, row_stride) so that row i of `t` viewed as (rows, n) starts at base + i * row_stride
    with unit stride along n. Contiguous tensors are used as they are (no view op: each costs
    host time); sliced and batched inputs keep their row stride; others are copied."""
    if t.is_contiguous():
        return t, n
    t2 = rows_2d(t, n)
    return t2, t2.stride(0)


def rows_2d(t: torch.Tensor, n: int) -> torch.Tensor:
    """View `t` as (rows, n) with unit stride along n; copies only when no such view exists.

    Sliced and batched inputs keep their row stride (no copy); permuted ones are copied.
    """
    t2 = t.reshape(-1, n)
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def default_rms_eps(dtype: torch.dtype) -> float:
    """RMSNorm's eps when none is given, as PyTorch computes it (`torch.rms_norm`, `nn.RMSNorm(eps=None)`):
    the epsilon of the dtype it computes in, fp32 for 16-bit inputs (2.11 to 2.13 do; their docs say
    the input dtype's, which for fp16 is 8192 times larger and moves a small row's output a lot)."""
    return torch.finfo(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype).eps


def acc_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton accumulation dtype: fp64 for fp64 inputs (gradcheck), fp32 otherwise."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@functools.cache
def num_sms(device_index: int) -> int:
    """Multiprocessor count of a CUDA device (a small fixed number under the interpreter)."""
    if INTERPRET or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index or 0) if t.is_cuda else num_sms(-1)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), in plain Python: Triton 3.9's
    `triton.next_power_of_2` is JIT-wrapped and costs a few µs per host call."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors do too under TRITON_INTERPRET=1 (bf16
    ones where the interpreter computes bf16 right, kernels/_interpreter.py), and otherwise fall
    back to the PyTorch reference, so models still run on CPU machines."""
    if t.is_cuda:
        return True
    return INTERPRET and t.device.type == "cpu" and (t.dtype != torch.bfloat16 or INTERPRETER_BF16)


def eager_fast_path(*tensors: torch.Tensor | None) -> bool:
    """True when plain eager autograd can take the thin `autograd.Function` path.

    Anything traced (Dynamo, AOTAutograd's fake and proxy tensors, tensor subclasses, active
    dispatch or function modes, torch.jit.trace) must see the registered `trifuse::` op instead.
    One function mode is not a tracer: torch's DeviceContext (`torch.set_default_device`, `with
    torch.device(...)`), which only gives factory calls without a device one; the fast path passes
    its devices. Under it the registered ops' dispatch made a fused GPT-2 step's host time 48.96
    ms against eager's 29.95 (bench/e2e_host_proxy.py --default-device).
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if _jit_tracing() is not None:
        return False
    if torch._C._is_torch_function_mode_enabled() and not _only_device_modes():
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


_jit_tracing = torch._C._get_tracing_state  # torch.jit.trace records the registered op, not the kernels'
                                            # launches, which it cannot see (its sizes are traced values)


def outside_device_modes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A public op run with torch function handling off when the only active function modes are
    DeviceContexts (see eager_fast_path): its checks, dialect keys and launchers make thousands
    of tensor calls a step (shape, device, data_ptr, ...), and each would go through the mode's
    Python handler; the registered op ran its implementation outside the mode too. Every tensor
    made there names its device. Anything else (compiling, another mode) runs as it is.

    Called on fx Proxies (torch.fx.symbolic_trace of a model that calls trifuse.ops itself), the
    op becomes one graph node whose target is the public function: its checks cannot read a
    Proxy, and `fuse` then sees the call as it sees the ops its own rewrites put in a graph."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if is_fx_tracing():
            proxy = next((a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                          if isinstance(a, torch.fx.Proxy)), None)
            if proxy is not None:
                return proxy.tracer.create_proxy("call_function", call, args, kwargs)
        if (not torch.compiler.is_compiling() and torch._C._is_torch_function_mode_enabled()
                and _only_device_modes()):
            with torch._C.DisableTorchFunction():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return call


# Whether torch.fx.symbolic_trace is tracing (not Dynamo): an older torch's is_fx_tracing, which
# also warns once, where it has no is_fx_symbolic_tracing.
is_fx_tracing = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", None) \
    or torch.fx._symbolic_trace.is_fx_tracing


def _only_device_modes() -> bool:
    """True when every active torch function mode is a DeviceContext."""
    n = torch._C._len_torch_function_stack()
    return n > 0 and all(type(torch._C._get_function_stack_at(i)) is DeviceContext for i in range(n))


# A model's weights are nn.Parameter: plain tensors for this purpose (not a subclass that
# overrides dispatch).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _NoGradCtx:
    """What a Function's forward gets for `ctx` when `apply_function` calls it directly: it may
    save tensors, set attributes and read needs_input_grad (all False); nothing is kept."""

    def __init__(self, n_inputs: int) -> None:
        self.needs_input_grad = (False,) * n_inputs

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


class _NotTwiceDifferentiable(torch.autograd.Function):
    """The identity on a backward's gradients, made to depend on what they are functions of (the
    op's saved tensors and incoming gradients): differentiating them again raises."""

    @staticmethod
    def forward(ctx, message: str, n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        raise RuntimeError(ctx.message)


def single_backward(backward=None, *, twice: Callable[..., Any] | None = None, op: str | None = None):
    """For an autograd.Function's backward computed by kernels autograd cannot see into: its
    gradients are not differentiable. Under `create_graph=True` (a gradient penalty, a
    Hessian-vector product, MAML) they would enter the second backward as constants, and the
    second-order terms through the op would be silently missing.

    `twice(ctx, *grads)`, where given, returns what the backward returns, computed with
    differentiable PyTorch ops (`reference_grads`): under create_graph=True it stands in for
    the kernels, and the op is twice differentiable (at PyTorch's speed and memory there). Where
    it returns None (a call it has no such form for: autocast_linear's fp32 input, whose 16-bit
    copy leads back to nothing), or where there is none, the gradients depend on the op's saved
    tensors and incoming gradients through a node that raises, naming the op (`op`, the public
    function's name, or else the one its autograd.Function serves), when a second backward reaches
    it. (PyTorch's `once_differentiable` connects them to the incoming gradients only: a second
    backward towards the op's inputs, a weight say, would never reach its error.)

    It serves the registered ops' autograd formulas too (`torch.library.register_autograd`: what
    runs under a DTensor, torch.export or a torch function mode), with their own `twice`."""
    if backward is None:
        return functools.partial(single_backward, twice=twice, op=op)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():  # the engine enables grad mode for create_graph=True only
            if torch._C._is_torch_function_mode_enabled() and _only_device_modes():
                with torch._C.DisableTorchFunction():  # as outside_device_modes, for the backward
                    return backward(ctx, *grads)
            return backward(ctx, *grads)
        if twice is not None:
            outputs = twice(ctx, *grads)
            if outputs is not None:
                return outputs
        sources = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, torch.Tensor) and t.requires_grad]
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        if not tensors or not sources:
            return outputs[0] if single else outputs
        name = type(ctx).__name__.removesuffix("Backward")
        message = (f"trifuse.ops.{op or _PUBLIC_OPS.get(name, name)} has no double backward: its gradients, "
                   "taken with create_graph=True, cannot be differentiated again (a gradient penalty, a "
                   "Hessian-vector product); leave that op's family out of trifuse.fuse(model, ops=...) or "
                   "run the model unfused")
        connected = iter(_NotTwiceDifferentiable.apply(message, len(tensors), *tensors, *sources))
        outputs = tuple(next(connected) if isinstance(t, torch.Tensor) else t for t in outputs)
        return outputs[0] if single else outputs

    return wrapper


def ctx_as(ctx, needs_input_grad: tuple, **attributes: Any) -> types.SimpleNamespace:
    """A stand-in for `ctx` with its saved tensors, the given needs_input_grad and attributes:
    lets a registered op's autograd formula call its eager autograd.Function's `twice`, whose
    inputs come in another order and whose attributes are spelled apart."""
    attributes = {"saved_tensors": ctx.saved_tensors, **attributes}
    return types.SimpleNamespace(**attributes, needs_input_grad=needs_input_grad)


def reference_grads(forward: Callable[..., Any], inputs: tuple, needs: tuple, grads: tuple) -> list:
    """The gradients of `forward(*inputs)` (a tensor or a tuple) for the given output gradients,
    by autograd over PyTorch ops with create_graph=True: differentiable again, towards the
    inputs (the op's saved tensors, which are its inputs or outputs in the outer graph) and the
    output gradients. One entry per input: None where `needs` says no gradient, or where the
    input is None; a needed input the outputs do not reach gets zeros."""
    wanted = [t for t, need in zip(inputs, needs) if need and t is not None]
    with torch.enable_grad():
        outputs = forward(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True,
                                   allow_unused=True) if pairs and wanted else [None] * len(wanted))
    result = []
    for t, need in zip(inputs, needs):
        if need and t is not None:
            g = next(got)
            result.append(torch.zeros_like(t) if g is None else g)
        else:
            result.append(None)
    return result


# The public functions each autograd.Function serves, for messages.
_PUBLIC_OPS = {"_AttentionFunction": "attention", "_VarlenFunction": "attention_varlen",
               "_BiasGeluFunction": "bias_gelu",
               "_BiasGeluDropoutFunction": "bias_gelu", "_CrossEntropyFunction": "cross_entropy",
               "_LinearCrossEntropyFunction": "linear_cross_entropy", "_DropoutAddFunction": "dropout_add",
               "_GatedDropoutAddFunction": "dropout_add", "_GatedRowsDropoutAddFunction": "dropout_add",
               "_GatedActivationFunction": "gated_activation",
               "_GatedActivationDropoutFunction": "gated_activation", "_NormFunction": "layer_norm (or rms_norm)",
               "_XieluFunction": "xielu",
               "_NormAddFunction": "layer_norm_add", "_RotaryEmbeddingFunction": "rotary_embedding",
               "_CastForReaders": "cast_for_readers", "_AutocastLinear": "autocast_linear",
               "_GroupedNormFunction": "layer_norm_modulate",
               "_GatedNormFunction": "gated_add_layer_norm_modulate",
               "_RowsNormFunction": "layer_norm_modulate",
               "_GatedRowsNormFunction": "gated_add_layer_norm_modulate",
               "_GroupNormFunction": "group_norm"}


def apply_function(fn: type[torch.autograd.Function], *args):
    """`fn.apply(*args)`, or with grad mode off `fn.forward` called directly: no autograd node
    can be recorded then, and Function.apply still costs about a quarter of a LayerNorm's eager
    forward on the host (the CPU proxy, bench/norm_host_proxy.py).

    Inside a torch.func transform (grad, vmap, jvp, ...) it raises NotImplementedError: the
    Triton kernels have no batching rule and the Functions no functorch one."""
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            f"trifuse.ops.{_PUBLIC_OPS.get(fn.__name__, fn.__name__)} was called inside a torch.func transform "
            "(grad, vmap, jvp, ...), "
            "which trifuse's ops do not implement; call the PyTorch op there (a trifuse.fuse()d model does: "
            "its fused blocks run as written inside transforms)")
    if torch.is_grad_enabled():
        return fn.apply(*args)
    return fn.forward(_NoGradCtx(len(args)), *args)


def profiled(name: str):
    """A profiler scope named like the registered op, entered only while a profiler runs:
    users profiling a fused model see which trifuse op ran, and nobody else pays for it."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NO_SCOPE


_NO_SCOPE = contextlib.nullcontext()  # stateless and reentrant: one for every call


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized contiguous tensor shaped like t, in `dtype` (t's by default). On the host
    torch.empty_like costs about 40% of torch.empty(t.shape, dtype=..., device=...), which parses
    a shape and a device."""
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)


def unscoped(device: torch.device) -> bool:
    """True when no profiler runs and autocast is off on `device`'s type: code that would enter
    `profiled(...)` and `no_autocast(device)` can call PyTorch directly (the two contexts cost
    ~1.5 µs a call on the host, where the checks cost a tenth of that)."""
    return not torch.autograd.profiler._is_profiler_enabled and not torch.is_autocast_enabled(device.type)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`: t itself when it already is (skips a dispatcher call on the eager path)."""
    return t if t.dtype == dtype else t.to(dtype)


def no_autocast(device: torch.device):
    """Autocast off on `device`'s type, for code that chose its dtypes itself. Entered only when
    autocast is on: an autocast context costs ~2 µs of host time a call, a check a tenth of it."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return _NO_SCOPE


# Why a dialect keeps trifuse's kernels for a call with dropout: PyTorch's candidate is another op.
DROPOUT_NOT_EXCHANGED = ("dropout: PyTorch's draws another mask and stores it for the backward (trifuse's is "
                         "regenerated from a seed), not exchanged")


def philox_seed(device: torch.device) -> torch.Tensor:
    """A fresh int64 seed drawn from PyTorch's generator on `device`, kept on that device.

    `torch.manual_seed` controls it; it never syncs the host, so it is CUDA-graph safe (the
    kernel loads the seed from memory). Save it to regenerate the same mask in the backward.
    """
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)
