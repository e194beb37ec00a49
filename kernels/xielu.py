"""xIELU: the trainable activation of Apertus (Swiss AI; https://arxiv.org/abs/2411.13010),
transformers' XIELUActivation, in one pass each way.

Maths, per element, in fp32 (fp64 for fp64 inputs), with the model's coefficients
ap = softplus(alpha_p) and an = beta + softplus(alpha_n) (computed by the model; the op takes them
as one-element tensors, and beta and eps too, read on the device: no host sync):

    y  = ap x^2 + beta x                            x > 0
         (expm1(min(x, eps)) - x) an + beta x       otherwise (NaN included, as torch.where)

    dx  = dy (2 ap x + beta)                        x > 0
          dy ((exp(m) dm - 1) an + beta)            otherwise, m = min(x, eps), dm = 1 where
                                                    x < eps, 1/2 at x == eps, 0 above (PyTorch's
                                                    minimum backward); NaN x gives NaN
    dap = sum of dy x^2 over x > 0;   dan = sum of dy (expm1(m) - x) over the rest

beta and eps are the activation's buffers: no gradient (the op refuses them requiring one).
expm1 is Kahan's exp-based form, `(u - 1) m / log(u)` with u = exp(m): accurate to a few ulps
where `exp(m) - 1` loses every digit for m near 0; and `expm1(x) - x` for x just below eps, where
that difference is ~x^2/2, its series (x^2/2 + x^3/6 + x^4/24 + x^5/120 for -0.01 < x): each
value keeps its own digits, not only the tensor's scale.

transformers computes this in twelve PyTorch kernels forward in the model's dtype (its CUDA kernel,
from an optional package, is used only where installed); here one read and one write forward, two
reads and one write backward, the coefficient gradients reduced in fixed order (bitwise the same
run to run): each program writes one partial per coefficient, its terms formed and summed in fp64
(they cancel: fp32 sums missed float64 by more than PyTorch's own error), summed afterwards.

Shapes: x any shape, read as one flat run of elements (a non-contiguous x is copied once); y and
dx like x. Dtypes: x fp16 / bf16 / fp32 / fp64; the coefficients any float dtype, their gradients
in their dtype.
Launch: one program per BLOCK elements, BLOCK = 2048 (8 warps on a GPU); not tuned yet (no GPU
has run it).
"""
import torch
import triton
import triton.language as tl

from ..autotune import dialects, pow2_bucket
from ._common import (
    acc_dtype,
    apply_function,
    cast,
    check_float,
    check_same_device,
    check_tensor,
    eager_fast_path,
    empty_like,
    outside_device_modes,
    profiled,
    reference_grads,
    single_backward,
    use_triton,
)
from ._launch import CachedKernel

# =============================================================================================
# Reference: the spec. Tests run it in float64 as the oracle and in the input dtype to measure
# PyTorch's own error.
# =============================================================================================


def xielu_ref(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: torch.Tensor,
              eps: torch.Tensor) -> torch.Tensor:
    """transformers' `XIELUActivation._xielu_python`, given its coefficients after the softplus:
    `alpha_p` = softplus(alpha_p param), `alpha_n` = beta + softplus(alpha_n param)."""
    return torch.where(x > 0, alpha_p * x * x + beta * x,
                       (torch.expm1(torch.min(x, eps)) - x) * alpha_n + beta * x)


# =============================================================================================
# Kernels
# =============================================================================================

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _expm1(m):
    """exp(m) - 1 without the cancellation near 0 (Kahan): (u - 1) m / log(u), u = exp(m), for
    |m| < 1. Further out u - 1 loses nothing, and the ratio would: where exp underflows into the
    subnormals (m below -87 in fp32) log(u) is no longer m (at m = -103.8, 0.5% off)."""
    u = tl.exp(m)
    d = u - 1.0
    near = (tl.abs(m) < 1.0) & (d != 0.0)
    return tl.where(d == 0.0, m, tl.where(near, d * m / tl.log(tl.where(near, u, 2.0)), d))


@triton.jit
def _expm1_minus_x(m, x, WIDE: tl.constexpr):
    """expm1(m) - x in WIDE: for m == x small (x just below eps) the series x^2/2 + x^3/6 + ...,
    which keeps the digits the subtraction of two nearly equal numbers would lose. The subtraction
    in WIDE (fp64 for the backward's sums): x is exact there, so only expm1's rounding is left."""
    series = x * x * (0.5 + x * (0.16666666666666666 + x * (0.041666666666666664 + x * 0.008333333333333333)))
    return tl.where((m == x) & (x > -0.01), series.to(WIDE), _expm1(m).to(WIDE) - x.to(WIDE))


@triton.jit
def _xielu_fwd_kernel(X, Y, AP, AN, BETA, EPS, n, BLOCK: tl.constexpr, ACC: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
    ap, an = tl.load(AP).to(ACC), tl.load(AN).to(ACC)
    beta, eps = tl.load(BETA).to(ACC), tl.load(EPS).to(ACC)
    m = tl.where(x > eps, eps, x)  # min(x, eps), NaN kept as torch.min keeps it
    y = tl.where(x > 0.0, ap * x * x + beta * x, _expm1_minus_x(m, x, ACC) * an + beta * x)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _xielu_bwd_kernel(DY, X, DX, AP, AN, BETA, EPS, DAP_PART, DAN_PART, n, BLOCK: tl.constexpr,
                      ACC: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
    g = tl.load(DY + offs, mask=mask, other=0.0).to(ACC)
    ap, an = tl.load(AP).to(ACC), tl.load(AN).to(ACC)
    beta, eps = tl.load(BETA).to(ACC), tl.load(EPS).to(ACC)
    pos = x > 0.0
    m = tl.where(x > eps, eps, x)
    dm = tl.where(x > eps, 0.0, tl.where(x == eps, 0.5, 1.0))  # torch.minimum's backward
    dx = tl.where(pos, g * (2.0 * ap * x + beta), g * ((tl.exp(m) * dm - 1.0) * an + beta))
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    # The coefficient gradients sum terms of either sign up to |x dy| large, to a result that can
    # be 1000x smaller than their sum of magnitudes (x ~ 30: hypothesis found fp32 terms and sums
    # off by 2-3x PyTorch's own error on 0.2% of draws). Formed and summed in fp64: the products
    # of fp32 values are exact there, and the partials stay fp64 until the last sum.
    g64, x64 = g.to(tl.float64), x.to(tl.float64)
    dap = tl.where(pos & mask, g64 * x64 * x64, 0.0)
    dan = tl.where(pos | (offs >= n), 0.0, g64 * _expm1_minus_x(m, x, tl.float64))
    tl.store(DAP_PART + pid, tl.sum(dap, axis=0))
    tl.store(DAN_PART + pid, tl.sum(dan, axis=0))


# =============================================================================================
# Launchers: check nothing, allocate the outputs, launch. Tensors in, tensors out.
# =============================================================================================


# Thin launch path: Triton's own costs ~60 µs of host time per launch (_launch.py).
_xielu_fwd = CachedKernel(_xielu_fwd_kernel)
_xielu_bwd = CachedKernel(_xielu_bwd_kernel)


def _wide(*dtypes: torch.dtype | None) -> torch.dtype:
    """The arithmetic's dtype: fp64 where any tensor in or out is fp64 (PyTorch's promotion would
    compute in fp64 there), fp32 otherwise."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def xielu_fwd(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: torch.Tensor,
              eps: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y, contiguous, shaped like x, in out_dtype (x's by default), rounded once."""
    if x.numel() and not use_triton(x):
        return _xielu_torch(x, alpha_p, alpha_n, beta, eps, out_dtype)
    x = _flat(x)
    y = empty_like(x, out_dtype)
    n = x.numel()
    if n:
        acc = _wide(x.dtype, out_dtype, alpha_p.dtype, alpha_n.dtype)
        _xielu_fwd[(triton.cdiv(n, BLOCK),)](x, y, alpha_p, alpha_n, beta, eps, n, BLOCK=BLOCK, ACC=acc_dtype(acc),
                                             num_warps=NUM_WARPS)
    return y


def xielu_bwd(dy: torch.Tensor, x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor,
              beta: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx like x in x's dtype, dalpha_p, dalpha_n), the coefficient gradients (1,) in fp32 (fp64
    where any tensor is fp64), each term formed and summed in fp64, in a fixed order."""
    acc = _wide(x.dtype, dy.dtype, alpha_p.dtype, alpha_n.dtype)
    if x.numel() and not use_triton(x):
        return _xielu_bwd_torch(dy, x, alpha_p, alpha_n, beta, eps)
    x, dy = _flat(x), _flat(dy)
    dx = empty_like(x)
    n = x.numel()
    programs = triton.cdiv(n, BLOCK)
    dap_part = torch.empty(programs, device=x.device, dtype=torch.float64)
    dan_part = torch.empty(programs, device=x.device, dtype=torch.float64)
    if n:
        _xielu_bwd[(programs,)](dy, x, dx, alpha_p, alpha_n, beta, eps, dap_part, dan_part, n, BLOCK=BLOCK,
                                ACC=acc_dtype(acc), num_warps=NUM_WARPS)
    return dx, dap_part.sum().to(acc).reshape(1), dan_part.sum().to(acc).reshape(1)


# ---------------------------------------------------------------------------------------------
# PyTorch path for CPU tensors without the interpreter: same outputs, no Triton.
# ---------------------------------------------------------------------------------------------


def _xielu_torch(x, alpha_p, alpha_n, beta, eps, out_dtype=None):
    acc = _wide(x.dtype, out_dtype, alpha_p.dtype, alpha_n.dtype)
    y = xielu_ref(*(t.to(acc) for t in (x, alpha_p, alpha_n, beta, eps)))
    return y.to(out_dtype or x.dtype).contiguous()


def _xielu_bwd_torch(dy, x, alpha_p, alpha_n, beta, eps):
    # The formulas above in PyTorch ops, not autograd (the registered backward op runs below the
    # Autograd key, where autograd records nothing).
    acc = _wide(x.dtype, dy.dtype, alpha_p.dtype, alpha_n.dtype)
    xa, g = x.to(acc), dy.to(acc)
    ap, an, b, e = (t.to(acc).reshape(()) for t in (alpha_p, alpha_n, beta, eps))
    pos = xa > 0
    m = torch.min(xa, e)
    dm = torch.where(xa > e, 0.0, torch.where(xa == e, 0.5, 1.0)).to(xa.dtype)
    dx = torch.where(pos, g * (2 * ap * xa + b), g * ((torch.exp(m) * dm - 1) * an + b))
    wide = acc if x.device.type == "mps" else torch.float64  # the sums in fp64, as the kernel's (MPS has none)
    gw, xw = g.to(wide), xa.to(wide)
    dap = torch.where(pos, gw * xw * xw, 0.0).sum().to(acc).reshape(1)
    dan = torch.where(pos, 0.0, gw * (torch.expm1(m).to(wide) - xw)).sum().to(acc).reshape(1)
    return dx.to(x.dtype).contiguous(), dap, dan


# =============================================================================================
# Checks, shared by the registered ops (real and fake) and the eager path
# =============================================================================================


def _check_inputs(x: object, alpha_p: object, alpha_n: object, beta: object, eps: object,
                  out_dtype: object = None) -> None:
    op = "xielu"
    if out_dtype is not None and out_dtype not in (torch.float16, torch.bfloat16, torch.float32,
                                                   torch.float64):
        raise ValueError(f"trifuse.{op}: out_dtype must be None or a float dtype, got {out_dtype!r}")
    check_tensor(op, "input", x)
    check_float(op, "input", x)
    for name, t in (("alpha_p", alpha_p), ("alpha_n", alpha_n), ("beta", beta), ("eps", eps)):
        check_tensor(op, name, t)
        check_float(op, name, t)
        if t.numel() != 1:
            raise ValueError(f"trifuse.{op}: {name} must hold one value, got shape {tuple(t.shape)}")
        check_same_device(op, "input", x, **{name: t})
    for name, t in (("beta", beta), ("eps", eps)):
        if t.requires_grad:
            raise ValueError(f"trifuse.{op}: {name} requires grad, which the op does not compute (xIELU's "
                             f"{name} is a buffer)")


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see.
# =============================================================================================

Tensor = torch.Tensor


@torch.library.custom_op("trifuse::xielu", mutates_args=())
def _xielu_op(x: Tensor, alpha_p: Tensor, alpha_n: Tensor, beta: Tensor, eps: Tensor,
              out_dtype: torch.dtype | None = None) -> Tensor:
    _check_inputs(x, alpha_p, alpha_n, beta, eps, out_dtype)
    return xielu_fwd(x, alpha_p, alpha_n, beta, eps, out_dtype)


@torch.library.custom_op("trifuse::xielu_backward", mutates_args=())
def _xielu_backward_op(dy: Tensor, x: Tensor, alpha_p: Tensor, alpha_n: Tensor, beta: Tensor,
                       eps: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dalpha_p, dalpha_n); the coefficient gradients (1,) in fp32 (fp64 where any input is)."""
    return xielu_bwd(dy, x, alpha_p, alpha_n, beta, eps)


@_xielu_op.register_fake
def _(x, alpha_p, alpha_n, beta, eps, out_dtype=None):
    _check_inputs(x, alpha_p, alpha_n, beta, eps, out_dtype)
    return torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)


@_xielu_backward_op.register_fake
def _(dy, x, alpha_p, alpha_n, beta, eps):
    acc = _wide(x.dtype, dy.dtype, alpha_p.dtype, alpha_n.dtype)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(1, dtype=acc),
            x.new_empty(1, dtype=acc))


def _grads(alpha_p, alpha_n, dx, dap, dan):
    """The backward's outputs: the coefficients' gradients in their dtypes and shapes. Takes the
    saved coefficients, not ctx: under non-reentrant checkpointing a saved tensor unpacks once."""
    return (dx, cast(dap, alpha_p.dtype).reshape(alpha_p.shape), cast(dan, alpha_n.dtype).reshape(alpha_n.shape),
            None, None, None)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])


def _xielu_twice(ctx, dy):
    """The backward in PyTorch ops, differentiable again (create_graph=True)."""
    saved = ctx.saved_tensors  # once: under non-reentrant checkpointing a saved tensor unpacks once
    grads = reference_grads(lambda x, ap, an: xielu_ref(x, ap, an, saved[3], saved[4]),
                            saved[:3], ctx.needs_input_grad[:3], (dy,))
    return (*grads, None, None, None)


@single_backward(twice=_xielu_twice, op="xielu")
def _backward(ctx, dy):
    x, alpha_p, alpha_n, beta, eps = ctx.saved_tensors
    return _grads(alpha_p, alpha_n, *torch.ops.trifuse.xielu_backward(dy, x, alpha_p, alpha_n, beta, eps))


torch.library.register_autograd("trifuse::xielu", _backward, setup_context=_setup)


# =============================================================================================
# Eager fast path: a thin autograd.Function straight over the launchers (DESIGN.md "Host
# overhead"). Same launchers, same bits as the registered op.
# =============================================================================================


class _XieluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha_p, alpha_n, beta, eps, out_dtype):
        ctx.save_for_backward(x, alpha_p, alpha_n, beta, eps)
        return xielu_fwd(x, alpha_p, alpha_n, beta, eps, out_dtype)

    @staticmethod
    @single_backward(twice=_xielu_twice)
    def backward(ctx, dy):
        x, alpha_p, alpha_n, beta, eps = ctx.saved_tensors
        with profiled("trifuse::xielu_backward"):
            return _grads(alpha_p, alpha_n, *xielu_bwd(dy, x, alpha_p, alpha_n, beta, eps))


# =============================================================================================
# Dialect: trifuse's kernels or transformers' formula in PyTorch ops, whichever is faster for the
# shape, chosen once per (device, dtype, elements bucket, coefficient dtype, grad) on the GPU and
# cached on disk (autotune/dialects.py). Traced calls always see trifuse::xielu.
# =============================================================================================


def _xielu_key(x, alpha_p, alpha_n, beta, eps, out_dtype=None):
    """The dialect key of an eager call; None (the trifuse op decides, and raises on bad input)
    when traced, empty, not float, or when a coefficient is not one value."""
    tensors = (x, alpha_p, alpha_n, beta, eps)
    if any(not isinstance(t, torch.Tensor) for t in tensors) or not eager_fast_path(*tensors):
        return None
    if not x.is_floating_point() or x.dim() == 0 or x.numel() == 0:
        return None
    if any(t.numel() != 1 or not t.is_floating_point() for t in tensors[1:]):
        return None
    grad = torch.is_grad_enabled() and (x.requires_grad or alpha_p.requires_grad or alpha_n.requires_grad)
    return (x.get_device() if x.is_cuda else -1, x.dtype, pow2_bucket(x.numel()), alpha_p.dtype, out_dtype,
            grad)


def _xielu_trifuse(x, alpha_p, alpha_n, beta, eps, out_dtype=None):
    _check_inputs(x, alpha_p, alpha_n, beta, eps, out_dtype)
    if eager_fast_path(x, alpha_p, alpha_n, beta, eps):
        with profiled("trifuse::xielu"):
            return apply_function(_XieluFunction, x, alpha_p, alpha_n, beta, eps, out_dtype)
    return torch.ops.trifuse.xielu(x, alpha_p, alpha_n, beta, eps, out_dtype)


def _xielu_in_out_dtype(x, alpha_p, alpha_n, beta, eps, out_dtype=None):
    """transformers' formula, its result in out_dtype (x's by default), as the op returns it."""
    y = xielu_ref(x, alpha_p, alpha_n, beta, eps)
    dtype = out_dtype or x.dtype
    return (y if y.dtype == dtype else y.to(dtype)).contiguous()


def _xielu_torch_candidate(x, alpha_p, alpha_n, beta, eps, out_dtype=None):
    # trifuse's checks first: the same clear errors whichever candidate runs.
    _check_inputs(x, alpha_p, alpha_n, beta, eps, out_dtype)
    with profiled("trifuse::xielu"):
        return _xielu_in_out_dtype(x, alpha_p, alpha_n, beta, eps, out_dtype)


XIELU = dialects.define("xielu", _xielu_key, ("device", "dtype", "elements", "coefficients", "out", "grad"),
                        reference=_xielu_in_out_dtype)
XIELU.register(dialects.Candidate("trifuse", _xielu_trifuse))
XIELU.register(dialects.Candidate("torch", _xielu_torch_candidate))


# =============================================================================================
# Public API
# =============================================================================================


@outside_device_modes
def xielu(x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: torch.Tensor,
          eps: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """xIELU in one pass each way, like transformers' `XIELUActivation` given its coefficients:
    `torch.where(x > 0, alpha_p * x * x + beta * x, (torch.expm1(torch.min(x, eps)) - x) * alpha_n
    + beta * x)`.

    Args:
        x: any shape, fp16 / bf16 / fp32 / fp64 (a non-contiguous x is copied once).
        alpha_p: one value, `F.softplus(act.alpha_p)`; gets its gradient.
        alpha_n: one value, `act.beta + F.softplus(act.alpha_n)`; gets its gradient.
        beta, eps: one value each (the activation's buffers), read on the device; no gradient.
        out_dtype: y's dtype, x's when None; the fp32 result PyTorch's promotion gives for bf16 x
            beside fp32 coefficients (autocast's master weights), computed in fp32 and written once.

    Returns:
        y, contiguous, shaped like x, in out_dtype (x's dtype by default). The backward
        recomputes from x (nothing else is saved) and sums the coefficients' gradients in a fixed
        order.

    Eager calls run trifuse's kernels or transformers' formula in PyTorch ops, whichever the
    `xielu` dialect measured faster for this shape on this GPU; elsewhere, and under
    torch.compile, trifuse's.

    Raises:
        TypeError for non-float tensors; ValueError for a coefficient of more than one value,
        tensors on different devices, or a beta or eps that requires grad.
    """
    return XIELU(x, alpha_p, alpha_n, beta, eps, out_dtype)

