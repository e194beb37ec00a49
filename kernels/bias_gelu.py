"""Bias + GeLU: y = gelu(x + bias), the activation after a transformer's first MLP linear; and,
in the same kernels, bias + ReLU (`approximate="relu"`, for the ReLU MLPs of T5, OPT, DETR and
`nn.TransformerEncoderLayer`) and bias + squared ReLU (`approximate="relu2"`, Primer's relu(z)^2:
Nemotron, Persimmon, Fuyu, Arcee, nanochat).

Maths, per element with z = x + bias, in fp32 (fp64 for fp64 inputs):

    erf form  ("none"):  gelu(z)  = z * Phi(z) = 0.5 * z * (1 + erf(z / sqrt(2)))
                         gelu'(z) = Phi(z) + z * phi(z),  phi(z) = exp(-z^2 / 2) / sqrt(2 pi)
    tanh form ("tanh"):  gelu(z)  = 0.5 * z * (1 + tanh(u)) = z * sigmoid(2u),
                                    u = sqrt(2 / pi) * (z + 0.044715 z^3)
                         gelu'(z) = s + 2 z s (1 - s) u',  s = sigmoid(2u),
                                    u' = sqrt(2 / pi) * (1 + 3 * 0.044715 z^2)
    quick form ("quick"): qgelu(z) = z * sigmoid(1.702 z)   (CLIP's QuickGELU)
                         qgelu'(z) = s + 1.702 z s (1 - s),  s = sigmoid(1.702 z)
    ReLU ("relu"):       relu(z)  = max(z, 0), NaN kept (as torch.relu)
                         backward: dz = 0 where z <= 0, else dy (as PyTorch's threshold_backward:
                         no inf * 0 for a large dy where z is negative)
    squared ReLU ("relu2"): relu2(z) = relu(z)^2, as `torch.square(torch.relu(z))`
                         backward: dz = 0 where z <= 0, else dy * 2z (PyTorch's pow_backward,
                         then threshold_backward)

The erf and tanh forms are exactly the functions `F.gelu(z, approximate=...)` defines; the quick
form is transformers' QuickGELUActivation, `z * torch.sigmoid(1.702 * z)` (PyTorch has no
F.gelu for it); "relu" is `torch.relu` and "relu2" its square, not GeLUs: they share the kernels
because the pass over the activation is the same. The tanh form is written through the identity
0.5 (1 + tanh(u)) = sigmoid(2u), which is exact and avoids the cancellation of 1 + tanh(u) for
negative u. Every sigmoid is
1 / (1 + exp(-t)): for large negative t the exp overflows to inf and s to 0, so y is -0 and the
derivative 0, never NaN. No form is ever substituted for another (tests show each pair differs
by more than the tolerance).

Backward: dx = dy * gelu'(x + bias); dbias = sum over rows of dx.

Shapes: x (..., N); bias (N,) or None; y and dx like x; dbias (N,).
Dtypes: x fp16 / bf16 / fp32 / fp64; bias any float dtype (fp32 master weights under autocast);
y and dx take x's dtype, dbias bias's dtype.

Memory plan: the forward saves its inputs x and bias, nothing else; the backward recomputes
z = x + bias and act'(z) from them (one activation read instead of a stored z or gelu'(z)).
dbias is reduced deterministically: each backward program walks a range of rows for one column
tile and writes one fp32 partial row, summed afterwards in a fixed order (no atomics).

Kernels: 2-D tiles of several rows x up to 1024 columns (kernels/_tiles.py), 16 elements per
thread by default, int64 row offsets (tensors past 2^31 elements), fp32 arithmetic on fp16/bf16
loads. Tile sizes, warps, programs per SM and the backward's prefetch of the next row tile are
tuned per shape bucket (autotune/configs.py: rowwise_fwd, rowwise_bwd).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..autotune import dialects, pow2_bucket
from ._common import (
    DROPOUT_NOT_EXCHANGED,
    acc_dtype,
    apply_function,
    as_rows,
    cast,
    check_float,
    check_probability,
    check_same_device,
    check_shape,
    check_tensor,
    device_sms,
    eager_fast_path,
    empty_like,
    outside_device_modes,
    philox_seed,
    profiled,
    reference_grads,
    single_backward,
    use_triton,
)
from ._launch import CachedKernel
from ._random import dropout_keep_quads
from ._tiles import RowwiseTuning, run_one_tile, run_summing, time_one_tile, time_summing
from .dropout_add import _dropout_scale, _DropoutMask, _dropped

APPROXIMATE = ("none", "tanh", "quick", "relu", "relu2")
# The GeLU forms alone (trifuse.nn.LinearGELU's).
GELU_FORMS = APPROXIMATE[:3]
# The quick form's slope: z * sigmoid(1.702 z), transformers' QuickGELUActivation.
QUICK_ALPHA = 1.702
# The kernels' FORM constexpr for each value of `approximate`.
_FORM_CODE = {"none": 0, "tanh": 1, "quick": 2, "relu": 3, "relu2": 4}

# =============================================================================================
# Reference: the spec. Tests run it in float64 as the oracle and in the input dtype to measure
# PyTorch's own error.
# =============================================================================================


def bias_gelu_ref(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias) in plain PyTorch; the quick form as transformers' QuickGELUActivation
    writes it, "relu" as torch.relu, "relu2" as transformers' ReLUSquaredActivation."""
    z = x if bias is None else x + bias
    if approximate == "relu":
        return torch.relu(z)
    if approximate == "relu2":
        return torch.square(torch.relu(z))
    return _quick_gelu_torch(z) if approximate == "quick" else F.gelu(z, approximate=approximate)


def _quick_gelu_torch(z: torch.Tensor) -> torch.Tensor:
    return z * torch.sigmoid(QUICK_ALPHA * z)


# =============================================================================================
# Kernels
# =============================================================================================

# sqrt(2 / pi), 1 / sqrt(2), 1 / sqrt(2 pi), and the cubic coefficient of the tanh form.
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
SQRT_HALF = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
KAPPA = tl.constexpr(0.044715)
# The quick form's sigmoid slope, as CLIP's QuickGELU writes it.
QUICK_ALPHA_C = tl.constexpr(QUICK_ALPHA)
# FORM: 0 erf ("none"), 1 tanh, 2 quick, 3 relu, 4 relu2 (_FORM_CODE).
FORM_TANH = tl.constexpr(1)
FORM_QUICK = tl.constexpr(2)
FORM_RELU = tl.constexpr(3)
FORM_RELU2 = tl.constexpr(4)


@triton.jit
def _gelu(z, TANH: tl.constexpr):
    if TANH:
        u = SQRT_2_OVER_PI * (z + KAPPA * z * z * z)
        return z / (1.0 + tl.exp(-2.0 * u))
    else:
        return 0.5 * z * (1.0 + tl.erf(z * SQRT_HALF))


@triton.jit
def _gelu_grad(z, TANH: tl.constexpr):
    if TANH:
        u = SQRT_2_OVER_PI * (z + KAPPA * z * z * z)
        s = 1.0 / (1.0 + tl.exp(-2.0 * u))
        du = SQRT_2_OVER_PI * (1.0 + 3.0 * KAPPA * z * z)
        return s + 2.0 * z * s * (1.0 - s) * du
    else:
        return 0.5 * (1.0 + tl.erf(z * SQRT_HALF)) + z * tl.exp(-0.5 * z * z) * INV_SQRT_2PI


@triton.jit
def _quick_gelu(z):
    return z / (1.0 + tl.exp(-(z * QUICK_ALPHA_C)))


@triton.jit
def _quick_gelu_grad(z):
    s = 1.0 / (1.0 + tl.exp(-(z * QUICK_ALPHA_C)))
    return s + z * QUICK_ALPHA_C * s * (1.0 - s)


@triton.jit
def _act(z, FORM: tl.constexpr):
    if FORM == FORM_QUICK:
        return _quick_gelu(z)
    elif FORM == FORM_RELU:
        return tl.where(z < 0.0, 0.0, z)  # not max(z, 0): that would turn NaN into 0
    elif FORM == FORM_RELU2:
        r = tl.where(z < 0.0, 0.0, z)
        return r * r
    else:
        return _gelu(z, FORM == FORM_TANH)


@triton.jit
def _act_vjp(g, z, FORM: tl.constexpr):
    """dz = g * act'(z); for the ReLUs a select, as PyTorch's threshold_backward (dz is 0 where
    z <= 0 even for an infinite g, and NaN where z is NaN)."""
    if FORM == FORM_QUICK:
        return g * _quick_gelu_grad(z)
    elif FORM == FORM_RELU:
        return tl.where(z <= 0.0, 0.0, g)
    elif FORM == FORM_RELU2:
        return tl.where(z <= 0.0, 0.0, g * (2.0 * z))  # pow_backward's grad * (2 * relu(z))
    else:
        return g * _gelu_grad(z, FORM == FORM_TANH)


@triton.jit
def _bias_gelu_fwd_kernel(
    X,  # in (M, N)
    B,  # in (N,) bias; unused unless HAS_BIAS
    Y,  # out (M, N)
    SEED,  # in (1,) int64 Philox seed; unused unless HAS_DROPOUT
    M, N, stride_xm, stride_ym, p, scale, col_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, FORM: tl.constexpr,
    ACC: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
):
    # A 1-D grid over (row tile, column tile): no 65535 limit on a second grid axis.
    pid = tl.program_id(0)
    rows = (pid // col_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows * stride
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    z = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(ACC)
    if HAS_BIAS:
        z += tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    y = _act(z, FORM)
    if HAS_DROPOUT:  # the (M, N) output's mask, as dropout_add draws it for the same seed
        y = tl.where(dropout_keep_quads(tl.load(SEED), rows[:, None], cols[None, :], p), y * scale, 0.0)
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY,  # in (M, N)
    X,  # in (M, N) the forward's input
    B,  # in (N,) bias; unused unless HAS_BIAS
    DX,  # out (M, N)
    DB_PARTIAL,  # out (groups, N) fp32: this program's rows' share of dbias; unused unless HAS_BIAS
    SEED,  # in (1,) int64 the forward's Philox seed; unused unless HAS_DROPOUT
    M, N, stride_dym, stride_xm, stride_dxm, p, scale, rows_per_program, col_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, FORM: tl.constexpr,
    ACC: tl.constexpr, PREFETCH: tl.constexpr = False, HAS_DROPOUT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    group = pid // col_tiles
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    row_start = group.to(tl.int64) * rows_per_program  # int64: rows * stride may pass 2^31
    row_end = tl.minimum(row_start + rows_per_program, M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    if PREFETCH:  # the first tile's loads, issued before the loop (see the loop's head)
        rows = row_start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        x_next = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        dy_next = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        if PREFETCH:
            # This tile was loaded one step ago; the next one's loads go out now, before this
            # tile's arithmetic, so each thread keeps two tiles' loads in flight, not one.
            x_tile, dy_tile = x_next, dy_next
            ahead = rows + BLOCK_M
            mask_ahead = (ahead < row_end)[:, None] & col_mask[None, :]
            x_next = tl.load(X + ahead[:, None] * stride_xm + cols[None, :], mask=mask_ahead, other=0.0)
            dy_next = tl.load(DY + ahead[:, None] * stride_dym + cols[None, :], mask=mask_ahead, other=0.0)
        else:
            x_tile = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
            dy_tile = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0)
        z = x_tile.to(ACC)
        if HAS_BIAS:
            z += b
        g = dy_tile.to(ACC)
        if HAS_DROPOUT:  # the forward's mask, regenerated from its seed
            g = tl.where(dropout_keep_quads(seed, rows[:, None], cols[None, :], p), g * scale, 0.0)
        dz = _act_vjp(g, z, FORM)
        tl.store(DX + rows[:, None] * stride_dxm + cols[None, :], dz.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc += tl.where(mask, dz, 0.0)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + group.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_mask)


# =============================================================================================
# Launchers: check nothing, allocate the outputs, launch. Tensors in, tensors out.
# =============================================================================================


def _width(x: torch.Tensor) -> int:
    return x.shape[-1] if x.dim() else 1


def _flat(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as a contiguous vector, as the kernels index it (no copy when it is one)."""
    return None if bias is None else bias.contiguous()


# Thin launch path: Triton's own costs ~60 µs of host time per launch (_launch.py).
_bias_gelu_fwd = CachedKernel(_bias_gelu_fwd_kernel)
_bias_gelu_bwd = CachedKernel(_bias_gelu_bwd_kernel)


# Launch configurations: tuned per (device, dtype, width, rows bucket, bias?, form) by
# trifuse's tuner over autotune/configs.py's row-wise spaces (kernels/_tiles.py).
_FWD_TUNING = RowwiseTuning("bias_gelu_fwd", ("bias", "form", "dropout"), summing=False)
_BWD_TUNING = RowwiseTuning("bias_gelu_bwd", ("bias", "form", "dropout"), summing=True)


def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor | None, approximate: str, p: float = 0.0,
                  seed: torch.Tensor | None = None) -> torch.Tensor:
    """y = dropout(gelu(x + bias), p), contiguous, shaped like x, in x's dtype; the mask drawn
    from `seed` (a (1,) int64 tensor, needed for p > 0)."""
    if x.numel() and not use_triton(x):
        return _bias_gelu_torch(x, bias, approximate, p, seed)
    n = _width(x)
    y = empty_like(x)
    if y.numel() == 0:
        return y
    # Row bases and strides, not (rows, n) views: a view op costs host time on every call.
    (x2, stride_x), bias = as_rows(x, n), _flat(bias)
    m = x.numel() // n
    dropout = p > 0.0
    args = (x2, bias if bias is not None else x2, y, seed if dropout else y, m, n, stride_x, n, p, _dropout_scale(p))
    constexprs = {"HAS_BIAS": bias is not None, "FORM": _FORM_CODE[approximate], "ACC": acc_dtype(x.dtype),
                  "HAS_DROPOUT": dropout}
    device, variant = x.get_device() if x.is_cuda else -1, (bias is not None, approximate, dropout)
    launch = _FWD_TUNING.launch(device, x.dtype, m, n, 0, False, variant, constexprs,
                                time_one_tile, _bias_gelu_fwd, m, n, constexprs, args)
    run_one_tile(_bias_gelu_fwd, launch, args)
    return y


def bias_gelu_bwd(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str, p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias): dx contiguous like x in x's dtype; dbias (N,) fp32 (fp64 for fp64 x), empty
    when bias is None; for p > 0 through the forward's mask, regenerated from its `seed`."""
    if x.numel() and not use_triton(x):
        return _bias_gelu_bwd_torch(dy, x, bias, approximate, p, seed)
    n = _width(x)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dx = empty_like(x)
    if x.numel() == 0:
        return dx, torch.zeros(0 if bias is None else n, dtype=acc, device=x.device)
    (x2, stride_x), (dy2, stride_dy), bias = as_rows(x, n), as_rows(dy, n), _flat(bias)
    m = x.numel() // n
    has_bias = bias is not None
    dropout = p > 0.0
    head = (dy2, x2, bias if has_bias else x2, dx)
    tail = (seed if dropout else dx, m, n, stride_dy, stride_x, n, p, _dropout_scale(p))
    constexprs = {"HAS_BIAS": has_bias, "FORM": _FORM_CODE[approximate], "ACC": acc_dtype(x.dtype),
                  "HAS_DROPOUT": dropout}
    sms = device_sms(x)
    device = x.get_device() if x.is_cuda else -1
    launch = _BWD_TUNING.launch(device, x.dtype, m, n, sms, has_bias, (has_bias, approximate, dropout), constexprs,
                                time_summing, _bias_gelu_bwd, m, n, sms, constexprs, head, tail, acc,
                                has_bias, x.device)
    partial = run_summing(_bias_gelu_bwd, launch, head, tail, n, acc, has_bias, x.device)
    return dx, partial.sum(dim=0) if has_bias else dx.new_empty(0, dtype=acc)


# ---------------------------------------------------------------------------------------------
# PyTorch path for CPU tensors without the interpreter: same outputs, no Triton.
# ---------------------------------------------------------------------------------------------


def _upcast(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.to(acc) if bias is None else x.to(acc) + bias.to(acc)


def _quick_gelu_grad_torch(z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(QUICK_ALPHA * z)
    return s + QUICK_ALPHA * z * s * (1.0 - s)


def _bias_gelu_torch(x, bias, approximate, p=0.0, seed=None):
    return _dropped(bias_gelu_ref(_upcast(x, bias), None, approximate), p, seed).to(x.dtype).contiguous()


def _bias_gelu_bwd_torch(dy, x, bias, approximate, p=0.0, seed=None):
    z = _upcast(x, bias)
    dy = _dropped(dy.to(z.dtype), p, seed)
    if approximate == "quick":
        dz = dy * _quick_gelu_grad_torch(z)
    elif approximate == "relu":
        dz = torch.ops.aten.threshold_backward(dy, z, 0.0)
    elif approximate == "relu2":
        dz = torch.ops.aten.threshold_backward(dy * (2.0 * torch.relu(z)), z, 0.0)
    else:
        dz = torch.ops.aten.gelu_backward(dy, z, approximate=approximate)
    dbias = dz.reshape(-1, _width(x)).sum(dim=0) if bias is not None else z.new_empty(0)
    return dz.to(x.dtype).contiguous(), dbias


# =============================================================================================
# Checks, shared by the registered ops (real and fake) and the eager path
# =============================================================================================


def _check_inputs(x: object, bias: object, approximate: object, p: object = 0.0) -> None:
    op = "bias_gelu"
    check_probability(op, "p", p)
    check_tensor(op, "input", x)
    check_float(op, "input", x)
    if bias is not None:
        check_tensor(op, "bias", bias)
        check_float(op, "bias", bias)
        check_shape(op, "bias", bias, (_width(x),))
        check_same_device(op, "input", x, bias=bias)
    if approximate not in APPROXIMATE:
        raise ValueError(f"trifuse.{op}: approximate must be 'none', 'tanh', 'quick', 'relu' or "
                         f"'relu2', got {approximate!r}")


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see.
# =============================================================================================

Tensor = torch.Tensor
OptTensor = torch.Tensor | None


@torch.library.custom_op("trifuse::bias_gelu", mutates_args=())
def _bias_gelu_op(x: Tensor, bias: OptTensor, approximate: str) -> Tensor:
    _check_inputs(x, bias, approximate)
    return bias_gelu_fwd(x, bias, approximate)


@torch.library.custom_op("trifuse::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward_op(dy: Tensor, x: Tensor, bias: OptTensor, approximate: str) -> tuple[Tensor, Tensor]:
    """(dx, dbias); dbias is (N,) in fp32 (fp64 for fp64 x), empty when bias is None."""
    return bias_gelu_bwd(dy, x, bias, approximate)


@torch.library.custom_op("trifuse::bias_gelu_dropout", mutates_args=())
def _bias_gelu_dropout_op(x: Tensor, bias: OptTensor, approximate: str, p: float) -> tuple[Tensor, Tensor]:
    """(y, seed): y = dropout(gelu(x + bias), p), its mask drawn from seed (for the backward)."""
    _check_inputs(x, bias, approximate, p)
    seed = philox_seed(x.device)
    return bias_gelu_fwd(x, bias, approximate, p, seed), seed


@torch.library.custom_op("trifuse::bias_gelu_dropout_backward", mutates_args=())
def _bias_gelu_dropout_backward_op(dy: Tensor, x: Tensor, bias: OptTensor, approximate: str, p: float,
                                   seed: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dbias) through the forward's mask, regenerated from its seed; dbias as bias_gelu_backward's."""
    return bias_gelu_bwd(dy, x, bias, approximate, p, seed)


@_bias_gelu_dropout_op.register_fake
def _(x, bias, approximate, p):
    _check_inputs(x, bias, approximate, p)
    return x.new_empty(x.shape), x.new_empty(1, dtype=torch.int64)


@_bias_gelu_dropout_backward_op.register_fake
def _(dy, x, bias, approximate, p, seed):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(x.shape), x.new_empty(0 if bias is None else _width(x), dtype=acc)


@_bias_gelu_op.register_fake
def _(x, bias, approximate):
    _check_inputs(x, bias, approximate)
    return x.new_empty(x.shape)


@_bias_gelu_backward_op.register_fake
def _(dy, x, bias, approximate):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(x.shape), x.new_empty(0 if bias is None else _width(x), dtype=acc)


def _grad_as(g: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if like is None else cast(g, like.dtype)


def _setup(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


# Differentiable again under create_graph=True by the eager path's formula (defined below with it).
@single_backward(twice=lambda ctx, dy: _bias_gelu_twice(ctx, dy), op="bias_gelu")
def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, dbias = torch.ops.trifuse.bias_gelu_backward(dy, x, bias, ctx.approximate)
    return dx, _grad_as(dbias, bias), None


torch.library.register_autograd("trifuse::bias_gelu", _backward, setup_context=_setup)


def _setup_dropout(ctx, inputs, output):
    x, bias, approximate, p = inputs
    ctx.save_for_backward(x, bias, output[1])
    ctx.approximate, ctx.p = approximate, p


@single_backward(twice=lambda ctx, dy, _: _bias_gelu_dropout_twice(ctx, dy), op="bias_gelu")
def _backward_dropout(ctx, dy, _):
    x, bias, seed = ctx.saved_tensors
    dx, dbias = torch.ops.trifuse.bias_gelu_dropout_backward(dy, x, bias, ctx.approximate, ctx.p, seed)
    return dx, _grad_as(dbias, bias), None, None


torch.library.register_autograd("trifuse::bias_gelu_dropout", _backward_dropout, setup_context=_setup_dropout)


# =============================================================================================
# Eager fast path: a thin autograd.Function straight over the launchers (see DESIGN.md "Host
# overhead"). Same launchers, same bits as the registered op.
# =============================================================================================


def _bias_gelu_twice(ctx, dy):
    """The backward in PyTorch ops, differentiable again (create_graph=True)."""
    x, bias = ctx.saved_tensors
    dx, dbias = reference_grads(lambda x, b: _bias_gelu_torch(x, b, ctx.approximate), (x, bias),
                                ctx.needs_input_grad[:2], (dy,))
    return dx, dbias, None


def _bias_gelu_dropout_twice(ctx, dy):
    """The backward with dropout, differentiable again: the forward's mask as dropout_add's
    _DropoutMask (the same mask for the same seed), then PyTorch's bias + GeLU."""
    x, bias, seed = ctx.saved_tensors
    dz = _DropoutMask.apply(dy, seed, ctx.p, dy.dtype)
    dx, dbias = reference_grads(lambda x, b: _bias_gelu_torch(x, b, ctx.approximate), (x, bias),
                                ctx.needs_input_grad[:2], (dz,))
    return dx, dbias, None, None


class _BiasGeluDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate, p):
        seed = philox_seed(x.device)
        ctx.save_for_backward(x, bias, seed)
        ctx.approximate, ctx.p = approximate, p
        return bias_gelu_fwd(x, bias, approximate, p, seed)

    @staticmethod
    @single_backward(twice=_bias_gelu_dropout_twice)
    def backward(ctx, dy):
        x, bias, seed = ctx.saved_tensors
        with profiled("trifuse::bias_gelu_dropout_backward"):
            dx, dbias = bias_gelu_bwd(dy, x, bias, ctx.approximate, ctx.p, seed)
        return dx, _grad_as(dbias, bias), None, None


class _BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return bias_gelu_fwd(x, bias, approximate)

    @staticmethod
    @single_backward(twice=_bias_gelu_twice)
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        with profiled("trifuse::bias_gelu_backward"):
            dx, dbias = bias_gelu_bwd(dy, x, bias, ctx.approximate)
        return dx, _grad_as(dbias, bias), None


# =============================================================================================
# Dialect: trifuse's kernels or PyTorch's F.gelu(x + bias) (the quick form written out as
# transformers writes it), whichever is faster for the shape, chosen once per (device, dtype, rows
# bucket, width, bias dtype, form, grad) on the GPU and cached on disk (autotune/dialects.py).
# Traced calls (torch.compile, export) always see trifuse::bias_gelu. The form is part of the key
# and passed through as asked: erf, tanh, quick, relu and relu2 are never exchanged.
# =============================================================================================


def _bias_gelu_key(x, bias, approximate, p=0.0):
    """The dialect key of an eager call; None (the trifuse op decides, and raises on bad input)
    when traced, empty, not float, or when the bias or `approximate` does not fit. About 2 µs: it
    runs on every call."""
    if x is None or not eager_fast_path(x, bias) or not x.is_floating_point() or x.dim() == 0:
        return None
    if approximate not in _FORM_CODE:
        return None
    n = x.shape[-1]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        return None
    rows = x.numel() // n if n else 0
    if rows == 0:
        return None
    grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    return (x.get_device() if x.is_cuda else -1, x.dtype, pow2_bucket(rows), n,
            None if bias is None else bias.dtype, approximate, p > 0.0, grad)


def _bias_gelu_trifuse(x, bias, approximate, p=0.0):
    _check_inputs(x, bias, approximate, p)
    if p > 0.0:
        if eager_fast_path(x, bias):
            with profiled("trifuse::bias_gelu_dropout"):
                return apply_function(_BiasGeluDropoutFunction, x, bias, approximate, p)
        return torch.ops.trifuse.bias_gelu_dropout(x, bias, approximate, p)[0]
    if eager_fast_path(x, bias):
        with profiled("trifuse::bias_gelu"):
            return apply_function(_BiasGeluFunction, x, bias, approximate)
    return torch.ops.trifuse.bias_gelu(x, bias, approximate)


def _bias_gelu_f_gelu(x, bias, approximate, p=0.0):
    """PyTorch's ops for a call without dropout (supports rejects the others)."""
    # trifuse's checks first: the same clear errors whichever candidate runs (F.gelu would take a
    # bias that broadcasts from another shape, for one).
    _check_inputs(x, bias, approximate, p)
    with profiled("trifuse::bias_gelu"):
        # `approximate` as asked: the exact erf form stays erf, tanh stays tanh, and the quick form
        # (no F.gelu for it) is QuickGELU's own spelling. A bias in another dtype (fp32 master
        # weights beside 16-bit activations) promotes x + bias; the result is cast back, because
        # trifuse returns x's dtype and the choice must not change it.
        return _bias_gelu_in_x_dtype(x, bias, approximate).contiguous()


def _bias_gelu_in_x_dtype(x, bias, approximate):
    """bias_gelu_ref with its result in x's dtype, as the op returns it. The dialect's reference:
    its check draws the output gradients in the reference's dtype, and an fp32 reference beside
    a 16-bit op would give the candidates those gradients rounded (autograd casts them to the
    output's dtype), the reference not: over 8192 rows the bias gradients then differ by ~1e-3
    relative and every candidate failed (GPT-2 and BERT on the H200, 2026-11-27)."""
    y = bias_gelu_ref(x, bias, approximate)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _bias_gelu_f_gelu_supports(x, bias, approximate, p=0.0) -> str | None:
    return DROPOUT_NOT_EXCHANGED if p > 0.0 else None


def _bias_gelu_dialect_ref(x, bias, approximate, p=0.0):
    """The dialect's reference, for the calls it measures (no dropout)."""
    return _bias_gelu_in_x_dtype(x, bias, approximate)


BIAS_GELU = dialects.define(
    "bias_gelu", _bias_gelu_key, ("device", "dtype", "rows", "n", "bias", "form", "dropout", "grad"),
    reference=_bias_gelu_dialect_ref)
BIAS_GELU.register(dialects.Candidate("trifuse", _bias_gelu_trifuse))
BIAS_GELU.register(dialects.Candidate("torch", _bias_gelu_f_gelu, supports=_bias_gelu_f_gelu_supports))


# =============================================================================================
# Public API
# =============================================================================================


@outside_device_modes
def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none", p: float = 0.0,
              training: bool = True) -> torch.Tensor:
    """gelu(x + bias) in one pass each way, like `F.gelu(x + bias, approximate=approximate)`
    (for "quick": `z * torch.sigmoid(1.702 * z)`, z = x + bias, CLIP's QuickGELU; for "relu":
    `torch.relu(x + bias)`; for "relu2": `torch.square(torch.relu(x + bias))`); with p > 0 in
    training, `F.dropout` of it (BART's and Pegasus' activation dropout before fc2, T5's dropout
    after its ReLU).

    Args:
        x: (..., N), fp16 / bf16 / fp32 / fp64; any strides (rows with a stride are read in
            place, other layouts are copied once).
        bias: (N,) or None; any float dtype.
        approximate: "none" for the exact erf form, "tanh" for the tanh approximation, "quick"
            for QuickGELU, z * sigmoid(1.702 z) (CLIP, OWL-ViT, X-CLIP, GroupViT, ...); "relu"
            for ReLU, not a GeLU but the same fused pass (T5, OPT, DETR, nn.Transformer);
            "relu2" for the squared ReLU (Nemotron, Persimmon, Fuyu, Arcee, nanochat).
        p: dropout probability on the output, in [0, 1]; kept values are scaled by 1 / (1 - p).
        training: dropout only applies when True (as `F.dropout`'s flag).

    Returns:
        y, contiguous, shaped like x, in x's dtype. Gradients reach x and bias; the backward
        recomputes from x and bias, and the dropout mask from a seed (nothing else is saved), and
        reduces dbias deterministically.

    Eager calls run trifuse's kernels or PyTorch's `F.gelu(x + bias, approximate=approximate)`
    (the quick form written out), whichever
    the `bias_gelu` dialect measured faster for this shape on this GPU
    (`trifuse.autotune.dialects.explain("bias_gelu", x, bias, approximate)` says which and why);
    elsewhere, and under torch.compile, trifuse's.

    Raises:
        TypeError for non-float tensors; ValueError for a bias that is not (N,), tensors on
        different devices, an unknown `approximate`, or p outside [0, 1].
    """
    check_probability("bias_gelu", "p", p)
    return BIAS_GELU(x, bias, approximate, p if training else 0.0)
