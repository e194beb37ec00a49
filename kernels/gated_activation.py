"""Gated activation: y = act(gate) * up, the middle of a gated MLP (SwiGLU, GeGLU, ReGLU).

Llama, Mistral, Qwen2, Gemma, Phi-3, OLMo and Cohere write their MLP as
`down_proj(act(gate_proj(x)) * up_proj(x))`; Phi-3 computes both projections at once and splits
them, `gate, up = gate_up_proj(x).chunk(2, dim=-1)`.

Maths, per element with g = gate, u = up, in fp32 (fp64 for fp64 inputs):

    "silu"       act(g)  = g * s,  s = sigmoid(g) = 1 / (1 + exp(-g))
                 act'(g) = s * (1 + g * (1 - s))
    "gelu"       act = gelu's erf form, g * Phi(g)            (as F.gelu(g, approximate="none"))
    "gelu_tanh"  act = gelu's tanh form, g * sigmoid(2 u(g))  (as F.gelu(g, approximate="tanh"))
                 (both gelu forms and their derivatives are bias_gelu.py's `_gelu`/`_gelu_grad`)
    "relu"       act = relu(g), NaN kept (as torch.relu)                    (T5's "gated-relu")
    "relu2"      act = relu(g)^2, as `torch.square(torch.relu(g))`     (BitNet's gated relu2)
                 backward: dgate = 0 where g <= 0, else dy * u (relu) or dy * u * 2g (relu2): a
                 select, as PyTorch's threshold_backward, so an infinite dy * u where g < 0
                 gives 0, not NaN

    y = act(g) * u;  backward: dgate = dy * u * act'(g),  dup = dy * act(g)

With dropout (p > 0 in training: T5 v1.1's, mT5's and Flan-T5's `dropout(act(wi_0 x) * wi_1 x)`
before their down projection), y = keep ? act(g) * u / (1 - p) : 0 and the backward first takes
dy through the same mask. keep is dropout_add's Philox draw for (seed, row, column) of the (M, N)
output (kernels/_random.py): the same seed drops the same elements in every kernel that drops.

Each activation is exactly the function its name says; none is substituted for another (tests
show the two gelu forms differ by more than the tolerance). For |g| large, exp overflows to inf
and sigmoid saturates to 0 or 1: every formula above then gives finite values, never 0 * inf.

Shapes: gate, up (..., N), the same shape; y, dgate, dup contiguous, shaped like gate.
Dtypes: fp16 / bf16 / fp32 / fp64, gate and up alike; y and both gradients in that dtype.
Layout: each input is read as M rows of N unit-stride features with its own row stride, so
Phi-3's chunked halves (row stride 2N) are read in place; other layouts are copied once.

Memory plan: the forward saves gate and up, nothing else; the backward recomputes act(g) and
act'(g) from them. PyTorch eager saves act(g) as well (the input of its multiplication): one
(tokens x intermediate) activation less per layer, and one pass over it less each way. With
dropout it saves a seed (one int64 drawn from PyTorch's generator on the device: torch.manual_seed
controls it, CUDA-graph safe) where `F.dropout` stores a byte mask and makes its own pass each way.

Kernels: 2-D tiles of several rows x up to 1024 columns, one tile per program
(kernels/_tiles.py; tile size and warps tuned per shape bucket, autotune/configs.py:
rowwise_fwd), int64 row offsets (tensors past 2^31 elements), fp32 arithmetic on fp16/bf16
loads. No reduction: forward and backward are one pass each.
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
    check_float,
    check_probability,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    eager_fast_path,
    empty_like,
    outside_device_modes,
    philox_seed,
    profiled,
    reference_grads,
    rows_2d,
    single_backward,
    use_triton,
)
from ._launch import CachedKernel
from ._random import dropout_keep_quads
from ._tiles import RowwiseTuning, run_one_tile, time_one_tile
from .bias_gelu import _gelu, _gelu_grad
from .dropout_add import _dropout_scale, _DropoutMask, _dropped

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")
# The kernels' ACT constexpr for each activation.
SILU, GELU, GELU_TANH, RELU, RELU2 = 0, 1, 2, 3, 4
_ACT_CODE = {"silu": SILU, "gelu": GELU, "gelu_tanh": GELU_TANH, "relu": RELU, "relu2": RELU2}

# =============================================================================================
# Reference: the spec. Tests run it in float64 as the oracle and in the input dtype to measure
# PyTorch's own error.
# =============================================================================================


def _act_ref(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    if activation == "relu":
        return torch.relu(gate)
    if activation == "relu2":  # transformers' ReLUSquaredActivation
        return torch.square(torch.relu(gate))
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")


def gated_activation_ref(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up in plain PyTorch."""
    return _act_ref(gate, activation) * up


# =============================================================================================
# Kernels
# =============================================================================================


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:  # SILU
        return g / (1.0 + tl.exp(-g))
    elif ACT >= 3:  # RELU, RELU2; where, not max(g, 0): that would turn NaN into 0
        r = tl.where(g < 0.0, 0.0, g)
        if ACT == 4:
            r = r * r
        return r
    else:
        return _gelu(g, ACT == 2)  # GELU_TANH


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)), sharing the sigmoid for SiLU."""
    if ACT == 0:  # SILU
        s = 1.0 / (1.0 + tl.exp(-g))
        return g * s, s * (1.0 + g * (1.0 - s))
    else:
        return _gelu(g, ACT == 2), _gelu_grad(g, ACT == 2)


@triton.jit
def _gated_activation_fwd_kernel(
    GATE,  # in (M, N), row stride stride_gm
    UP,  # in (M, N), row stride stride_um
    Y,  # out (M, N)
    SEED,  # in (1,) int64 Philox seed; unused unless HAS_DROPOUT
    M, N, stride_gm, stride_um, stride_ym, p, scale, col_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, ACC: tl.constexpr,
    HAS_DROPOUT: tl.constexpr = False,
):
    # A 1-D grid over (row tile, column tile): no 65535 limit on a second grid axis.
    pid = tl.program_id(0)
    rows = (pid // col_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows * stride
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    g = tl.load(GATE + rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0).to(ACC)
    u = tl.load(UP + rows[:, None] * stride_um + cols[None, :], mask=mask, other=0.0).to(ACC)
    y = _act(g, ACT) * u
    if HAS_DROPOUT:  # the (M, N) output's mask, as dropout_add draws it for the same seed
        y = tl.where(dropout_keep_quads(tl.load(SEED), rows[:, None], cols[None, :], p), y * scale, 0.0)
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gated_activation_bwd_kernel(
    DY,  # in (M, N)
    GATE,  # in (M, N) the forward's gate
    UP,  # in (M, N) the forward's up
    DGATE,  # out (M, N)
    DUP,  # out (M, N)
    SEED,  # in (1,) int64 the forward's Philox seed; unused unless HAS_DROPOUT
    M, N, stride_dym, stride_gm, stride_um, stride_dgm, stride_dum, p, scale, col_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, ACC: tl.constexpr,
    HAS_DROPOUT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    rows = (pid // col_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows * stride
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    g = tl.load(GATE + rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0).to(ACC)
    u = tl.load(UP + rows[:, None] * stride_um + cols[None, :], mask=mask, other=0.0).to(ACC)
    dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(ACC)
    if HAS_DROPOUT:  # the forward's mask, regenerated from its seed
        dy = tl.where(dropout_keep_quads(tl.load(SEED), rows[:, None], cols[None, :], p), dy * scale, 0.0)
    # Recomputed from gate: act(g) was not saved (one activation less per call).
    if ACT >= 3:  # RELU, RELU2: a select, as threshold_backward (never inf * 0 where g <= 0)
        a = _act(g, ACT)
        dgate = dy * u
        if ACT == 4:
            dgate = dgate * (2.0 * g)  # pow_backward's grad * (2 * relu(g))
        dgate = tl.where(g <= 0.0, 0.0, dgate)
    else:
        a, da = _act_and_grad(g, ACT)
        dgate = dy * u * da
    tl.store(DGATE + rows[:, None] * stride_dgm + cols[None, :], dgate.to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + rows[:, None] * stride_dum + cols[None, :], (dy * a).to(DUP.dtype.element_ty), mask=mask)


# =============================================================================================
# Launchers: check nothing, allocate the outputs, launch. Tensors in, tensors out.
# =============================================================================================


def _width(t: torch.Tensor) -> int:
    return t.shape[-1] if t.dim() else 1


# Thin launch path: Triton's own costs ~60 µs of host time per launch (_launch.py).
_gated_activation_fwd = CachedKernel(_gated_activation_fwd_kernel)
_gated_activation_bwd = CachedKernel(_gated_activation_bwd_kernel)


# Launch configurations: tuned per (device, dtype, width, rows bucket, activation) by trifuse's
# tuner over autotune/configs.py's one-tile row-wise space (kernels/_tiles.py).
_FWD_TUNING = RowwiseTuning("gated_activation_fwd", ("activation", "dropout"), summing=False)
_BWD_TUNING = RowwiseTuning("gated_activation_bwd", ("activation", "dropout"), summing=False)


def gated_activation_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str, p: float = 0.0,
                         seed: torch.Tensor | None = None) -> torch.Tensor:
    """y = dropout(act(gate) * up, p), contiguous, shaped like gate, in gate's dtype; the mask
    drawn from `seed` (a (1,) int64 tensor, needed for p > 0)."""
    if gate.numel() and not use_triton(gate):
        return _gated_activation_torch(gate, up, activation, p, seed)
    n = _width(gate)
    y = empty_like(gate)
    if y.numel() == 0:
        return y
    g2, u2 = rows_2d(gate, n), rows_2d(up, n)  # chunked halves keep their row stride: no copy
    m = g2.shape[0]
    y2 = y.view(m, n)
    dropout = p > 0.0
    args = (g2, u2, y2, seed if dropout else y2, m, n, g2.stride(0), u2.stride(0), y2.stride(0), p,
            _dropout_scale(p))
    constexprs = {"ACT": _ACT_CODE[activation], "ACC": acc_dtype(gate.dtype), "HAS_DROPOUT": dropout}
    device = gate.get_device() if gate.is_cuda else -1
    launch = _FWD_TUNING.launch(device, gate.dtype, m, n, 0, False, (activation, dropout), constexprs,
                                time_one_tile, _gated_activation_fwd, m, n, constexprs, args)
    run_one_tile(_gated_activation_fwd, launch, args)
    return y


def gated_activation_bwd(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup), each contiguous, shaped like gate, in gate's dtype; for p > 0 through the
    forward's mask, regenerated from its `seed`."""
    if gate.numel() and not use_triton(gate):
        return _gated_activation_bwd_torch(dy, gate, up, activation, p, seed)
    n = _width(gate)
    dgate = empty_like(gate)
    dup = empty_like(gate)
    if gate.numel() == 0:
        return dgate, dup
    dy2, g2, u2 = rows_2d(dy, n), rows_2d(gate, n), rows_2d(up, n)
    m = g2.shape[0]
    dg2, du2 = dgate.view(m, n), dup.view(m, n)
    dropout = p > 0.0
    args = (dy2, g2, u2, dg2, du2, seed if dropout else dg2, m, n,
            dy2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0), p, _dropout_scale(p))
    constexprs = {"ACT": _ACT_CODE[activation], "ACC": acc_dtype(gate.dtype), "HAS_DROPOUT": dropout}
    device = gate.get_device() if gate.is_cuda else -1
    launch = _BWD_TUNING.launch(device, gate.dtype, m, n, 0, False, (activation, dropout), constexprs,
                                time_one_tile, _gated_activation_bwd, m, n, constexprs, args)
    run_one_tile(_gated_activation_bwd, launch, args)
    return dgate, dup


# ---------------------------------------------------------------------------------------------
# PyTorch path for CPU tensors without the interpreter: same outputs, no Triton.
# ---------------------------------------------------------------------------------------------


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _gated_activation_torch(gate, up, activation, p=0.0, seed=None):
    y = gated_activation_ref(_upcast(gate), _upcast(up), activation)
    return _dropped(y, p, seed).to(gate.dtype).contiguous()


def _gated_activation_bwd_torch(dy, gate, up, activation, p=0.0, seed=None):
    # PyTorch's own backward formulas, not autograd: inside the registered backward op autograd
    # records nothing (it runs below the Autograd key), and torch.autograd.grad failed there.
    g, u = _upcast(gate), _upcast(up)
    dy = _dropped(dy.to(g.dtype), p, seed)
    if activation == "silu":
        dgate = torch.ops.aten.silu_backward(dy * u, g)
    elif activation in ("relu", "relu2"):
        dr = dy * u if activation == "relu" else dy * u * (2.0 * torch.relu(g))
        dgate = torch.ops.aten.threshold_backward(dr, g, 0.0)
    else:
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        dgate = torch.ops.aten.gelu_backward(dy * u, g, approximate=approximate)
    return dgate.to(gate.dtype).contiguous(), (dy * _act_ref(g, activation)).to(gate.dtype).contiguous()


# =============================================================================================
# Checks, shared by the registered ops (real and fake) and the eager path
# =============================================================================================


def _check_inputs(gate: object, up: object, activation: object, p: object = 0.0) -> None:
    op = "gated_activation"
    check_probability(op, "p", p)
    check_tensor(op, "gate", gate)
    check_tensor(op, "up", up)
    check_float(op, "gate", gate)
    check_float(op, "up", up)
    check_same_dtype(op, "gate", gate, up=up)
    check_shape(op, "up", up, tuple(gate.shape))  # no broadcasting: one up per gate element
    check_same_device(op, "gate", gate, up=up)
    if activation not in _ACT_CODE:
        raise ValueError(f"trifuse.{op}: activation must be 'silu', 'gelu', 'gelu_tanh', 'relu' or 'relu2', "
                         f"got {activation!r}")


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see.
# =============================================================================================

Tensor = torch.Tensor


@torch.library.custom_op("trifuse::gated_activation", mutates_args=())
def _gated_activation_op(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    _check_inputs(gate, up, activation)
    return gated_activation_fwd(gate, up, activation)


@torch.library.custom_op("trifuse::gated_activation_backward", mutates_args=())
def _gated_activation_backward_op(dy: Tensor, gate: Tensor, up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """(dgate, dup), each shaped like gate, in gate's dtype."""
    return gated_activation_bwd(dy, gate, up, activation)


@torch.library.custom_op("trifuse::gated_activation_dropout", mutates_args=())
def _gated_activation_dropout_op(gate: Tensor, up: Tensor, activation: str, p: float) -> tuple[Tensor, Tensor]:
    """(y, seed): y = dropout(act(gate) * up, p), its mask drawn from seed (for the backward)."""
    _check_inputs(gate, up, activation, p)
    seed = philox_seed(gate.device)
    return gated_activation_fwd(gate, up, activation, p, seed), seed


@torch.library.custom_op("trifuse::gated_activation_dropout_backward", mutates_args=())
def _gated_activation_dropout_backward_op(dy: Tensor, gate: Tensor, up: Tensor, activation: str, p: float,
                                          seed: Tensor) -> tuple[Tensor, Tensor]:
    """(dgate, dup) through the forward's mask, regenerated from its seed."""
    return gated_activation_bwd(dy, gate, up, activation, p, seed)


@_gated_activation_dropout_op.register_fake
def _(gate, up, activation, p):
    _check_inputs(gate, up, activation, p)
    return gate.new_empty(gate.shape), gate.new_empty(1, dtype=torch.int64)


@_gated_activation_dropout_backward_op.register_fake
def _(dy, gate, up, activation, p, seed):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


@_gated_activation_op.register_fake
def _(gate, up, activation):
    _check_inputs(gate, up, activation)
    return gate.new_empty(gate.shape)


@_gated_activation_backward_op.register_fake
def _(dy, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _setup(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


# Differentiable again under create_graph=True by the eager path's formula (defined below with it).
@single_backward(twice=lambda ctx, dy: _gated_activation_twice(ctx, dy), op="gated_activation")
def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dgate, dup = torch.ops.trifuse.gated_activation_backward(dy, gate, up, ctx.activation)
    return dgate, dup, None


torch.library.register_autograd("trifuse::gated_activation", _backward, setup_context=_setup)


def _setup_dropout(ctx, inputs, output):
    gate, up, activation, p = inputs
    ctx.save_for_backward(gate, up, output[1])
    ctx.activation, ctx.p = activation, p


@single_backward(twice=lambda ctx, dy, _: _gated_activation_dropout_twice(ctx, dy), op="gated_activation")
def _backward_dropout(ctx, dy, _):
    gate, up, seed = ctx.saved_tensors
    dgate, dup = torch.ops.trifuse.gated_activation_dropout_backward(dy, gate, up, ctx.activation, ctx.p, seed)
    return dgate, dup, None, None


torch.library.register_autograd("trifuse::gated_activation_dropout", _backward_dropout, setup_context=_setup_dropout)


# =============================================================================================
# Eager fast path: a thin autograd.Function straight over the launchers (see DESIGN.md "Host
# overhead"). Same launchers, same bits as the registered op.
# =============================================================================================


def _gated_activation_twice(ctx, dy):
    """The backward in PyTorch ops, differentiable again (create_graph=True)."""
    gate, up = ctx.saved_tensors
    dgate, dup = reference_grads(lambda g, u: _gated_activation_torch(g, u, ctx.activation), (gate, up),
                                 ctx.needs_input_grad[:2], (dy,))
    return dgate, dup, None


def _gated_activation_dropout_twice(ctx, dy):
    """The backward with dropout, differentiable again: the forward's mask as dropout_add's
    _DropoutMask (the same mask for the same seed), then PyTorch's gated activation."""
    gate, up, seed = ctx.saved_tensors
    dz = _DropoutMask.apply(dy, seed, ctx.p, dy.dtype)
    dgate, dup = reference_grads(lambda g, u: _gated_activation_torch(g, u, ctx.activation), (gate, up),
                                 ctx.needs_input_grad[:2], (dz,))
    return dgate, dup, None, None


class _GatedActivationDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, p):
        seed = philox_seed(gate.device)
        ctx.save_for_backward(gate, up, seed)
        ctx.activation, ctx.p = activation, p
        return gated_activation_fwd(gate, up, activation, p, seed)

    @staticmethod
    @single_backward(twice=_gated_activation_dropout_twice)
    def backward(ctx, dy):
        gate, up, seed = ctx.saved_tensors
        with profiled("trifuse::gated_activation_dropout_backward"):
            dgate, dup = gated_activation_bwd(dy, gate, up, ctx.activation, ctx.p, seed)
        return dgate, dup, None, None


class _GatedActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return gated_activation_fwd(gate, up, activation)

    @staticmethod
    @single_backward(twice=_gated_activation_twice)
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        with profiled("trifuse::gated_activation_backward"):
            dgate, dup = gated_activation_bwd(dy, gate, up, ctx.activation)
        return dgate, dup, None


# =============================================================================================
# Dialect: trifuse's kernels or PyTorch's `F.silu(gate) * up` (or the gelu form asked), whichever
# is faster for the shape, chosen once per (device, dtype, rows bucket, width, activation, grad) on
# the GPU and cached on disk (autotune/dialects.py). Traced calls (torch.compile, export) always
# see trifuse::gated_activation. The activation is part of the key and passed through as asked.
# =============================================================================================


def _gated_activation_key(gate, up, activation, p=0.0):
    """The dialect key of an eager call; None (the trifuse op decides, and raises on bad input)
    when traced, empty, not float, or when up or `activation` does not fit. It runs on every call."""
    if gate is None or up is None or not eager_fast_path(gate, up) or not gate.is_floating_point():
        return None
    if gate.dim() == 0 or activation not in _ACT_CODE or up.shape != gate.shape or up.dtype != gate.dtype:
        return None
    n = gate.shape[-1]
    rows = gate.numel() // n if n else 0
    if rows == 0:
        return None
    grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    return (gate.get_device() if gate.is_cuda else -1, gate.dtype, pow2_bucket(rows), n, activation, p > 0.0, grad)


def _gated_activation_trifuse(gate, up, activation, p=0.0):
    _check_inputs(gate, up, activation, p)
    if p > 0.0:
        if eager_fast_path(gate, up):
            with profiled("trifuse::gated_activation_dropout"):
                return apply_function(_GatedActivationDropoutFunction, gate, up, activation, p)
        return torch.ops.trifuse.gated_activation_dropout(gate, up, activation, p)[0]
    if eager_fast_path(gate, up):
        with profiled("trifuse::gated_activation"):
            return apply_function(_GatedActivationFunction, gate, up, activation)
    return torch.ops.trifuse.gated_activation(gate, up, activation)


def _gated_activation_torch_candidate(gate, up, activation, p=0.0):
    """PyTorch's ops for a call without dropout (supports rejects the others)."""
    # trifuse's checks first: the same clear errors whichever candidate runs (`*` would broadcast
    # an up of another shape, or promote one of another dtype).
    _check_inputs(gate, up, activation, p)
    with profiled("trifuse::gated_activation"):
        # The activation as asked: the exact erf form stays erf, tanh stays tanh. Contiguous like
        # trifuse's output (the product of two chunked halves may not be).
        return gated_activation_ref(gate, up, activation).contiguous()


def _gated_activation_torch_supports(gate, up, activation, p=0.0) -> str | None:
    return DROPOUT_NOT_EXCHANGED if p > 0.0 else None


def _gated_activation_dialect_ref(gate, up, activation, p=0.0):
    """The dialect's reference, for the calls it measures (no dropout)."""
    return gated_activation_ref(gate, up, activation)


GATED_ACTIVATION = dialects.define(
    "gated_activation", _gated_activation_key, ("device", "dtype", "rows", "n", "activation", "dropout", "grad"),
    reference=_gated_activation_dialect_ref)
GATED_ACTIVATION.register(dialects.Candidate("trifuse", _gated_activation_trifuse))
GATED_ACTIVATION.register(dialects.Candidate("torch", _gated_activation_torch_candidate,
                                             supports=_gated_activation_torch_supports))


# =============================================================================================
# Public API
# =============================================================================================


@outside_device_modes
def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", p: float = 0.0,
                     training: bool = True) -> torch.Tensor:
    """act(gate) * up in one pass each way: a gated MLP's SwiGLU / GeGLU; with p > 0 in training,
    `F.dropout(act(gate) * up, p)` (T5 v1.1's and mT5's dropout before their down projection).

    Args:
        gate: (..., N), fp16 / bf16 / fp32 / fp64; any strides (rows with a stride, such as the
            halves of `gate_up_proj(x).chunk(2, dim=-1)`, are read in place; other layouts are
            copied once).
        up: the same shape and dtype as gate, any strides.
        activation: "silu" (x * sigmoid(x), SwiGLU), "gelu" (the exact erf form), "gelu_tanh"
            (the tanh form), "relu" (ReGLU) or "relu2" (the squared ReLU, BitNet's), each as
            `F.silu` / `F.gelu(approximate=...)` / `torch.relu` / `torch.square(torch.relu(x))`
            define it.
        p: dropout probability on the product, in [0, 1]; kept values are scaled by 1 / (1 - p).
        training: dropout only applies when True (as `F.dropout`'s flag).

    Returns:
        y, contiguous, shaped like gate, in gate's dtype. Gradients reach gate and up; the backward
        recomputes act(gate) from gate and up, and the dropout mask from a seed (nothing else is
        saved: no mask, unlike `F.dropout`).

    Eager calls run trifuse's kernels or PyTorch's `act(gate) * up`, whichever the
    `gated_activation` dialect measured faster for this shape on this GPU
    (`trifuse.autotune.dialects.explain("gated_activation", gate, up, activation)` says which);
    elsewhere, and under torch.compile, trifuse's.

    Raises:
        TypeError for non-float tensors or gate and up of different dtypes; ValueError for shapes
        that differ, tensors on different devices, an unknown `activation`, or p outside [0, 1].
    """
    check_probability("gated_activation", "p", p)
    return GATED_ACTIVATION(gate, up, activation, p if training else 0.0)
