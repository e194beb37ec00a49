"""Helpers for the pattern and fusion tests: fuse a module through fx or through Dynamo, compare
the fused model with the unfused one against the float64 oracle (tests/tolerances.py), list the
trifuse ops a run executed."""
import contextlib
import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import trifuse
from _device import DEVICE
from tolerances import assert_close, check_close, max_error
from torch import nn

# The trifuse op each family's replacements call (branches land one by one: a family whose op is
# not in this build is skipped by fuse, and its tests skip).
FAMILY_OPS = {"layer_norm": "layer_norm", "rms_norm": "rms_norm", "residual_stream": "dropout_add_layer_norm",
              "attention": "attention", "bias_gelu": "bias_gelu", "gated_activation": "gated_activation",
              "dropout_add": "dropout_add", "cross_entropy": "cross_entropy", "rotary": "rotary_embedding",
              "group_norm": "group_norm", "xielu": "xielu"}


class PassThroughMode(torch.overrides.TorchFunctionMode):
    """A torch function mode that changes nothing, as a user's tracer or logger might be: under
    it trifuse's ops take their registered `trifuse::` ops and those ops' autograd formulas (what
    a DTensor, torch.export or torch.compile sees) instead of the eager autograd.Functions."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# CUDA autocast's fp32 ops that transformers and diffusion models call (its "float32" list): the
# aten overload, and the position of a dtype argument that makes a call ineligible (None: none).
CUDA_AUTOCAST_FP32 = (("layer_norm", None), ("group_norm", None), ("softmax.int", 2), ("log_softmax.int", 2),
                      ("pow.Tensor_Scalar", None), ("pow.Tensor_Tensor", None), ("rsqrt", None),
                      ("exp", None), ("log", None), ("reciprocal", None))


@contextlib.contextmanager
def cuda_like_autocast():
    """CPU autocast as CUDA's for the ops of CUDA_AUTOCAST_FP32: 16-bit tensor arguments upcast,
    fp32 out (fp64 left; a call with an explicit dtype left). CPU's autocast runs them in the
    input's dtype, so without this the tests never see, say, the fp32 LayerNorm output that a GPU
    training run under autocast hands the ops after it, or GPT-2's fp32 `pow`. (On a GPU, nothing
    to change.)"""
    if DEVICE == "cuda":
        yield
        return
    lib = torch.library.Library("aten", "IMPL")
    autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    half = (torch.float16, torch.bfloat16)

    def upcast(op, dtype_at):
        def kernel(*args, **kwargs):
            explicit = kwargs.get("dtype") is not None or (dtype_at is not None and len(args) > dtype_at
                                                          and args[dtype_at] is not None)
            if not explicit:
                args = [a.float() if isinstance(a, torch.Tensor) and a.dtype in half else a for a in args]
            with torch._C._ExcludeDispatchKeyGuard(autocast):
                return op(*args, **kwargs)
        return kernel

    for name, dtype_at in CUDA_AUTOCAST_FP32:
        packet, _, overload = name.partition(".")
        lib.impl(name, upcast(getattr(getattr(torch.ops.aten, packet), overload or "default"), dtype_at),
                 "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()


def has_op(name: str) -> bool:
    return callable(getattr(trifuse.ops, name, None))


def needs_ops(*names: str):
    missing = [n for n in names if not has_op(n)]
    return pytest.mark.skipif(bool(missing), reason=f"trifuse.ops.{', '.join(missing)} not in this build")


def available_counts(counts: dict[str, int]) -> dict[str, int]:
    """The expected per-family counts, without families whose op this build lacks."""
    return {k: v for k, v in counts.items() if has_op(FAMILY_OPS[k])}


class _ViaDynamo(nn.Module):
    """A block whose forward fx cannot trace (it takes *args, **kwargs): fuse captures it with Dynamo."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class DynamoHost(nn.Module):
    """Holds `inner` as the one block of a ModuleList, so fuse captures it with Dynamo."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ViaDynamo(inner)])

    def forward(self, *args):
        return self.blocks[0](*args)


class Act(nn.Module):
    """A module around an activation function, as models hold theirs (`self.act_fn(x)`)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def fuse_via(module: nn.Module, capture: str, **kwargs) -> nn.Module:
    """The fused model to call: `module` itself fused by fx, a Dynamo host around it, or (capture
    "compile" or "compile-inductor") torch.compile of it with trifuse's backend."""
    if capture.startswith("compile"):
        backend = "trifuse_inductor" if capture == "compile-inductor" else "trifuse"
        return torch.compile(module, backend=backend, **kwargs)
    target = module if capture == "fx" else DynamoHost(module)
    trifuse.fuse(target, **kwargs)
    return target


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict) or hasattr(out, "to_tuple"):
        out = out.to_tuple() if hasattr(out, "to_tuple") else tuple(out.values())
    return [o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point()]


def _double(v):
    return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def check_against_unfused(make: Callable[[], nn.Module], inputs: tuple, capture: str = "fx", *,
                          grads: bool = True, train: bool = False,
                          twin64: Callable[[nn.Module], nn.Module] | None = None,
                          transform: Callable[[nn.Module], nn.Module] | None = None,
                          autocast: torch.dtype | None = None,
                          errors: dict[str, float] | None = None,
                          failures: list[str] | None = None,
                          **fuse_kwargs) -> "trifuse.FusionReport | None":
    """Fuses a fresh `make()`, runs it and the unfused model (fp32 and float64) on `inputs`, and
    checks outputs and every parameter and input gradient by the oracle rule. Returns the report.
    `twin64(model64)`, for a model whose float64 copy cannot run as written (it casts to fp32
    inside), returns the float64 model that computes what the model means. `transform(model)`,
    when given, is the model checked instead of the fused one (PyTorch's own variant of what a
    rewrite does, held to the same rule); the return is then None. `autocast`: the fused and
    the unfused model's forwards run under autocast to that dtype, as mixed-precision training
    runs them on a GPU (cuda_like_autocast); float64's without. `errors`, when given, receives each
    checked value's largest error against float64 by name ("output 0", "grad NAME"), as checked.
    `failures`, when given, receives the message of every value that fails the rule, and the check
    goes on to the end instead of stopping at the first (a model that fails on its output may
    also fail on a gradient, which is what a caller may want to know)."""

    def check(name, out, out64, lowp, compute_dtype=None):
        if errors is not None and out.shape == out64.shape:
            errors[name] = max_error(out.detach(), out64.detach())
        if failures is None:
            assert_close(name, out, out64, lowp, compute_dtype=compute_dtype)
            return
        ok, msg = check_close(name, out, out64, lowp, compute_dtype)
        if not ok:
            failures.append(msg)

    torch.manual_seed(0)
    model = make().to(DEVICE)
    inputs = tuple(x.to(DEVICE) for x in inputs)
    ref = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double()
    if twin64 is not None:
        ref64 = twin64(ref64)
    for m in (model, ref, ref64):
        m.train(train)
    fused = fuse_via(model, capture, **fuse_kwargs) if transform is None else transform(model)
    xs = [x.detach().clone().requires_grad_(grads and x.is_floating_point()) for x in inputs]
    xr = [x.detach().clone().requires_grad_(grads and x.is_floating_point()) for x in inputs]
    x64 = [_double(x).detach().clone().requires_grad_(grads and x.is_floating_point()) for x in inputs]
    with _autocast(autocast):
        outs, outs_r = _outputs(fused(*xs)), _outputs(ref(*xr))
    outs64 = _outputs(ref64(*x64))
    assert len(outs) == len(outs64)
    for i, (o, o64, olp) in enumerate(zip(outs, outs64, outs_r)):
        assert o.dtype == olp.dtype, f"output {i}: dtype {o.dtype}, unfused {olp.dtype}"
        check(f"output {i}", o, o64, olp)
    if grads:
        seeds = [torch.randn_like(o) for o in outs]
        sum(((o * s).sum() for o, s in zip(outs, seeds)), torch.zeros(())).backward()
        sum(((o * s.double()).sum() for o, s in zip(outs64, seeds)), torch.zeros((), dtype=torch.float64)).backward()
        sum(((o * s).sum() for o, s in zip(outs_r, seeds)), torch.zeros(())).backward()
        named = dict(model.named_parameters())
        # a gradient is no more precise than the narrowest values it was computed from: an fp32
        # norm weight's in an fp16 model is a sum of fp16 products (tolerances.check_close), an
        # fp32 weight's under autocast a sum of the autocast dtype's
        widths = [torch.empty(0, dtype=autocast)] if autocast is not None else []
        narrowest = _narrowest_float(*xs, *model.parameters(), *widths)
        for (name, p64), pr in zip(ref64.named_parameters(), ref.parameters()):
            if p64.grad is not None:
                check(f"grad {name}", named[name].grad, p64.grad, pr.grad, compute_dtype=narrowest)
        for i, (a, a64, ar) in enumerate(zip(xs, x64, xr)):
            if a64.grad is not None:
                check(f"grad input {i}", a.grad, a64.grad, ar.grad, compute_dtype=narrowest)
    return trifuse.report(fused) if transform is None else None


@contextlib.contextmanager
def _autocast(dtype: torch.dtype | None):
    """Autocast to `dtype` as on a GPU (cuda_like_autocast), or nothing for None."""
    if dtype is None:
        yield
        return
    with torch.autocast(DEVICE, dtype=dtype), cuda_like_autocast():
        yield


def _narrowest_float(*tensors: torch.Tensor) -> torch.dtype | None:
    """The float dtype of least precision among tensors (None without one)."""
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=None)


def op_names(prof: "torch.profiler.profile") -> list[str]:
    """The name of every op a finished profile recorded, read off the profiler's raw events:
    `prof.events()` would first build PyTorch's tree of them all (a capturing step records every
    op Dynamo's fake tensors run: ~0.4 s a call here)."""
    raw = getattr(getattr(prof.profiler, "kineto_results", None), "events", None)
    return [e.name() for e in raw()] if raw is not None else [e.name for e in prof.events()]


class RecordPostGrad:
    """An Inductor post-grad pass (`post_grad_custom_pre_pass`) noting every call of the graphs it
    sees: `calls` as (target name, args), `targets` the names alone. No uuid: Inductor's caches are
    bypassed while it is configured, so every graph reaches it."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def __call__(self, graph) -> None:
        self.calls += [(str(n.target), n.args) for n in graph.nodes if n.op == "call_function"]

    @property
    def targets(self) -> list[str]:
        return [name for name, _ in self.calls]

    def uuid(self):
        return None


def traced_graphs(fn: Callable, *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """(forward, backward): AOTAutograd's graphs of `fn` compiled whole (what Inductor would get),
    run on `inputs` and backward from the sum of its floating outputs."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    record = AotEagerAndRecordGraphs()
    with warnings.catch_warnings():  # (its compilers return unboxed functions: harmless here)
        warnings.filterwarnings("ignore", message=".*doesn't take boxed arguments")
        out = torch.compile(fn, backend=record, fullgraph=True)(*inputs)
        leaves = torch.utils._pytree.tree_leaves(out)
        sum(t.float().sum() for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad).backward()
    return record.fw_graphs[0], record.bw_graphs[0]


def assert_readers_sum_in_fp32_when_traced(fn: Callable, x0: torch.Tensor, mats: list, op: str) -> None:
    """`fn(x)` returns a 16-bit y for each matmul of `mats` (a norm narrowed with `readers`):
    compiled (aot_eager), x's gradient is bitwise the eager kernels' (their views' gradients summed
    in fp32; each run from seed 1, the same dropout masks), and the registered op `op` writes y in
    fp32 for the readers' casts."""
    def grad(f):
        torch.manual_seed(1)
        x = x0.clone().requires_grad_()
        loss = sum((y @ m).float().square().sum() for y, m in zip(f(x), mats))
        return torch.autograd.grad(loss, x)[0]

    torch._dynamo.reset()
    assert torch.equal(grad(torch.compile(fn, backend="aot_eager", fullgraph=True)), grad(fn))
    forward, _ = traced_graphs(fn, x0.clone().requires_grad_())
    assert call_of(forward, op).args[-1] == torch.float32


def call_of(graph: torch.fx.GraphModule, op: str) -> torch.fx.Node:
    """The first node of an aten graph that calls `trifuse::<op>`."""
    target = getattr(torch.ops.trifuse, op).default
    return next(n for n in graph.graph.nodes if n.target is target)


def dtype_casts(graph: torch.fx.GraphModule) -> list[tuple[str, torch.dtype]]:
    """(the cast tensor's node name, the dtype cast to) for every dtype conversion in an aten graph."""
    casts = []
    for n in graph.graph.nodes:
        if n.target is torch.ops.aten._to_copy.default and "dtype" in n.kwargs:
            casts.append((n.args[0].name, n.kwargs["dtype"]))
        elif n.target is torch.ops.prims.convert_element_type.default:
            casts.append((n.args[0].name, n.args[1]))
    return casts


def trifuse_ops_run(fn: Callable[[], object]) -> set[str]:
    """Names of the trifuse:: ops (and their backward) a profiled call of `fn` ran; an op's direct
    twin (`trifuse_direct::`, what Inductor's graphs call: fusion/backend.py) by the op's name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = (name.replace("trifuse_direct::", "trifuse::", 1) for name in op_names(prof))
    return {name for name in names if name.startswith("trifuse::")}


def check_sharded_against_unfused(make: Callable[[torch.dtype], nn.Module],
                                  inputs: tuple) -> "trifuse.FusionReport":
    """Like `check_against_unfused`, for a model with DTensors in it: `make(dtype)` builds it
    (seeded, so three builds share weights); the fused float32 one, fused through Dynamo, against
    the unfused float64 (the oracle) and float32 ones: outputs, then input and parameter
    gradients (DTensor ones gathered whole). Returns the report."""
    results = []
    for dtype, fuse in ((torch.float32, True), (torch.float32, False), (torch.float64, False)):
        torch.manual_seed(0)
        model = make(dtype).train()
        run = fuse_via(model, "dynamo") if fuse else model
        xs = [x.detach().to(dtype).clone().requires_grad_() for x in inputs]
        outs = _outputs(run(*xs))
        sum(((o * o).sum() for o in outs), torch.zeros((), dtype=dtype)).backward()
        grads = [x.grad for x in xs] + [p.grad for p in model.parameters()]
        results.append([_whole(v) for v in [*outs, *grads]])
        if fuse:
            report = trifuse.report(run)
    for i, (got, lowp, want) in enumerate(zip(*results)):
        assert (got is None) == (want is None), f"value {i}: a gradient on one side only"
        if want is not None:
            assert_close(f"value {i}", got, want, lowp)
    return report


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t
