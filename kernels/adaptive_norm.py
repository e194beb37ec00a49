"""Adaptive LayerNorm / RMSNorm (adaLN): y = norm(x) * mul + add, mul and add one vector per sample.

Diffusion transformers (DiT, PixArt, SD3, Flux and their kin) modulate each normalized activation
with vectors computed from the timestep and the condition, one per sample:

    y = LayerNorm(x; weight, bias, eps) * (1 + scale[:, None]) + shift[:, None]

Eagerly that is three passes over the activation forward (the norm, the product, the sum) and
more backward (the products, the per-sample sums of dscale and dshift). Here the modulation folds
into per-group affine parameters, computed by PyTorch on those small (G, N) vectors:

    W_g = weight * mul_g          B_g = bias * mul_g + add_g          (weight 1, bias 0 if absent)

so that y = xhat * W_g + B_g, one LayerNorm pass each way (kernels/layer_norm.py with GROUPED
affine: row r reads group r // rows_per_group). The backward's dW_g = sum over the group's rows
of dy * xhat and dB_g = sum of dy come out of the norm's backward, summed per group in a fixed
order (deterministic); autograd over the (G, N) products takes them on to weight, bias, mul and
add.

Groups: `mul` and `add` broadcast against x (..., N) over a leading prefix of its dims, 1 over
the rest: (B, 1, N) or (B, N)[:, None] against (B, S, N) is B groups of S rows; (N,) or (1, 1, N)
one group. The normalized shape is the last dim. Dtypes: x fp16 / bf16 / fp32 / fp64; mul, add,
weight and bias any float dtype; y in the dtype of `norm(x) * mul + add` (x's promoted with mul's
and add's); the folded affine and all maths in fp32 (fp64 for fp64).

The residual add before such a norm, s = residual + gate * x (a DiT block's gated add, a
LayerScale's gamma before a plain norm), folds into the same kernels: `gated_add_layer_norm_modulate`
further down.

Per token (mul or add varying along a sample's rows: FLUX.3's, Qwen-Image 2.1's, Helios' mixed
timesteps, scale and shift (B, S, N)) the fold would write (M, N) parameters; kernels of their own
read a row of mul and of add beside each row of x instead, `1 + scale` in the load (mul_offset),
and write dmul per element in the backward: the last two sections of this file, the second with
the gated residual add before the norm read a row at a time as well (Qwen-Image 2.1's image
stream: gate, scale and shift all per token).
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..autotune import Tuner, configs, dialects, pow2_bucket
from ._common import (
    acc_dtype,
    apply_function,
    as_rows,
    cast,
    check_float,
    check_same_device,
    check_shape,
    check_tensor,
    device_sms,
    eager_fast_path,
    empty_like,
    no_autocast,
    outside_device_modes,
    profiled,
    reference_grads,
    single_backward,
    unscoped,
    use_triton,
)
from ._launch import CachedKernel, store_plan
from .layer_norm import (
    _bwd_plan,
    _cast_for_readers,
    _check_narrowing,
    _div,
    _flat,
    _fwd_plan,
    _narrowed_key,
    _narrowed_ref,
    _row_constants,
    _stat_dtype,
    _statistics_of_sums,
    _sum_partials,
    _tile_input_grads,
    _tile_statistics,
    _xhat_and_ds,
    layer_norm_bwd,
    layer_norm_fwd,
)

OP = "layer_norm_modulate"


# =============================================================================================
# Reference: the spec, in PyTorch ops
# =============================================================================================


def layer_norm_modulate_ref(x: torch.Tensor, normalized_shape, mul: torch.Tensor | None = None,
                            add: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                            bias: torch.Tensor | None = None, eps: float = 1e-5,
                            is_rms_norm: bool = False) -> torch.Tensor:
    """`norm(x) * mul + add` as a model writes it (the oracle's formula)."""
    if is_rms_norm:
        y = F.rms_norm(x, normalized_shape, weight, eps)
    else:
        y = F.layer_norm(x, normalized_shape, weight, bias, eps)
    if mul is not None:
        y = y * mul
    return y if add is None else y + add


def _grouped_norm_torch(x: torch.Tensor, weight, bias, n: int, eps: float, is_rms_norm: bool, groups: int):
    """y = xhat * W_g + B_g in PyTorch ops (differentiable), in the folded affine's dtype; with
    (mean, rstd) per row."""
    acc = _stat_dtype(x)
    h = x.reshape(groups, -1, n).to(acc)
    mean = torch.zeros(h.shape[:2], dtype=acc, device=x.device) if is_rms_norm else h.mean(-1)
    d = h - mean[..., None]
    rstd = torch.rsqrt(d.pow(2).mean(-1) + eps)
    y = d * rstd[..., None]
    if weight is not None:
        y = y * weight[:, None]
    if bias is not None:
        y = y + bias[:, None]
    return y.reshape(x.shape), mean.reshape(-1), rstd.reshape(-1)


# =============================================================================================
# Launch: the norm with grouped affine parameters, forward and backward
# =============================================================================================


def _grouped_fwd(x, weight, bias, n, eps, is_rms_norm, groups, out_dtype, y2_dtype=None):
    """(y, mean, rstd), and y2 with y2_dtype: y in out_dtype (y2, the same values, in y2_dtype);
    mean (empty for RMSNorm) and rstd per row, fp32 (fp64 for fp64)."""
    if not use_triton(x):
        with torch.no_grad():
            y, mean, rstd = _grouped_norm_torch(x, weight, bias, n, eps, is_rms_norm, groups)
        # no mean for RMSNorm, as the kernels
        out = (y.to(out_dtype), mean[:0] if is_rms_norm else mean, rstd)
        return out if y2_dtype is None else (*out, y.to(y2_dtype))
    rows = x.numel() // n
    # one group: the plain launch, its affine read once per tile rather than per row
    out = layer_norm_fwd(x, n, weight, bias, eps, is_rms_norm=is_rms_norm, out_dtype=out_dtype,
                         y2_dtype=y2_dtype, rows_per_group=rows // groups if groups > 1 else None)
    return out[0], *out[2:]


def _grouped_grads_torch(dy, x, weight, mean, rstd, n, is_rms_norm, groups, more_dy=()):
    """The grouped norm's backward in PyTorch ops (no grad), (groups, rows, n) in fp32 (fp64):
    (dx, y's gradient summed over more_dy, xhat)."""
    acc = _stat_dtype(x)
    for extra in more_dy:
        dy = dy.to(acc) + extra
    with torch.no_grad():
        h = x.reshape(groups, -1, n).to(acc)
        g_y = dy.reshape(groups, -1, n).to(acc)
        rstd3 = rstd.reshape(groups, -1, 1)
        xhat = (h if is_rms_norm else h - mean.reshape(groups, -1, 1)) * rstd3
        g = g_y if weight is None else g_y * weight[:, None]
        c1 = (g * xhat).mean(-1, keepdim=True)
        dx = (g - xhat * c1 if is_rms_norm else g - g.mean(-1, keepdim=True) - xhat * c1) * rstd3
    return dx, g_y, xhat


def _grouped_bwd(dy, x, weight, mean, rstd, n, eps, is_rms_norm, groups, needs, more_dy=()):
    """(dx in x's dtype, dW_g, dB_g in fp32 / fp64) as `needs` (x, weight, bias) asks; None where not.
    y's gradient is dy plus, summed in fp32 in that order, those of its other views (more_dy)."""
    acc = _stat_dtype(x)
    if not use_triton(x):
        dx, g_y, xhat = _grouped_grads_torch(dy, x, weight, mean, rstd, n, is_rms_norm, groups, more_dy)
        return (dx.reshape(x.shape).to(x.dtype) if needs[0] else None,
                (g_y * xhat).sum(1) if needs[1] else None, g_y.sum(1) if needs[2] else None)
    grad_dtypes = (acc if needs[1] and weight is not None else None, acc if needs[2] else None, None)
    dx, _, dw, db, _ = layer_norm_bwd(dy, x, n, weight, mean, rstd, is_rms_norm=is_rms_norm,
                                      grad_dtypes=grad_dtypes, dx_dtype=x.dtype, more_dy=more_dy,
                                      groups=groups)
    # one group comes back as (n,) vectors
    return dx if needs[0] else None, *(None if v is None else v.view(groups, n) for v in (dw, db))


# =============================================================================================
# Checks, shared by the public function, the registered ops and their fakes
# =============================================================================================


def _width(op: str, x: torch.Tensor, normalized_shape) -> int:
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        normalized_shape = [normalized_shape]
    shape = list(normalized_shape) if isinstance(normalized_shape, (list, tuple, torch.Size)) else None
    if (shape is None or len(shape) != 1 or not isinstance(shape[0], int) or x.dim() < 1
            or x.shape[-1] != shape[0]):
        raise ValueError(f"trifuse.{op}: normalized_shape must be the last dim of input "
                         f"({list(x.shape[-1:])}), one dim; got {normalized_shape!r}")
    return shape[0]


def _not_per_sample(op: str, name: str, t: torch.Tensor, x: torch.Tensor, n: int) -> str:
    return (f"trifuse.{op}: {name} must broadcast against input {list(x.shape)} as one vector per sample "
            f"(shaped like input over its leading dims, 1 over the rest, last dim {n} or 1); "
            f"got {list(t.shape)}")


def _sample_dims(t: torch.Tensor, x: torch.Tensor) -> int:
    """How many of x's leading dims a per-sample vector t follows: up to its last leading dim that
    is not 1 (t padded on the left to x's dims). The groups it makes of x's rows: the product of
    those dims of x."""
    shape = (1,) * (x.dim() - t.dim()) + tuple(t.shape)
    k = x.dim() - 1
    while k > 0 and shape[k - 1] == 1:
        k -= 1
    return k


def _check_per_sample(op: str, name: str, t: torch.Tensor, x: torch.Tensor, n: int) -> None:
    """t must broadcast against x over a leading prefix of x's dims (equal there) and be 1 over the
    others but the last, which is n or 1."""
    shape = (1,) * (x.dim() - t.dim()) + tuple(t.shape)
    if t.dim() > x.dim() or shape[-1] not in (n, 1):
        raise ValueError(_not_per_sample(op, name, t, x, n))
    k = _sample_dims(t, x)
    if tuple(shape[:k]) != tuple(x.shape[:k]):
        raise ValueError(_not_per_sample(op, name, t, x, n))


def _check_per_token(op: str, name: str, t: torch.Tensor, x: torch.Tensor, n: int) -> bool:
    """Whether t, which must broadcast against x (each dim x's or 1, the last n or 1), is per token:
    not one vector per sample (`_check_per_sample`) but varying along a sample's rows."""
    shape = (1,) * (x.dim() - t.dim()) + tuple(t.shape)
    if t.dim() > x.dim() or shape[-1] not in (n, 1) or any(
            a != b and a != 1 for a, b in zip(shape[:-1], x.shape[:-1])):
        raise ValueError(f"trifuse.{op}: {name} must broadcast against input {list(x.shape)} as one vector "
                         f"per sample or per token (each dim the input's or 1, last dim {n} or 1); "
                         f"got {list(t.shape)}")
    k = _sample_dims(t, x)
    # one vector a row (k = x's leading dims) or shared along a leading dim of x's that is not 1
    return k == x.dim() - 1 > 0 or tuple(shape[:k]) != tuple(x.shape[:k])


def _check(op, x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm=False, per_token=False) -> bool:
    """A TypeError / ValueError naming the op and the argument, for a call that does not fit.
    With per_token, mul and add may also vary along a sample's rows: returns whether either does."""
    if is_rms_norm and bias is not None:
        raise ValueError(f"trifuse.{op}: RMSNorm has no bias (is_rms_norm=True with a bias given)")
    check_tensor(op, "input", x)
    check_float(op, "input", x)
    n = _width(op, x, normalized_shape)
    rows = False
    for name, t in (("mul", mul), ("add", add)):
        if t is not None:
            check_tensor(op, name, t)
            check_float(op, name, t)
            if per_token:
                rows = _check_per_token(op, name, t, x, n) or rows
            else:
                _check_per_sample(op, name, t, x, n)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(op, name, t)
            check_float(op, name, t)
            check_shape(op, name, t, (n,))
    check_same_device(op, "input", x, mul=mul, add=add, weight=weight, bias=bias)
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"trifuse.{op}: eps must be a non-negative number, got {eps!r}")
    return rows


def _as_groups(t: torch.Tensor, x: torch.Tensor, n: int, k: int, acc: torch.dtype) -> torch.Tensor:
    """t (a per-sample vector, checked) as (groups, n) in acc, the groups those of x's first k
    dims: broadcast over the samples it is shared by and over the features where it is 1."""
    groups = math.prod(x.shape[:k])
    if t.numel() == groups * n:  # one vector a group already (DiT's (B, 1, N)): a view, no copy
        v = t.reshape(groups, n)
    else:  # shared by several groups, or one value for every feature
        shape = (1,) * (x.dim() - t.dim()) + tuple(t.shape)
        v = t.reshape(shape).expand(*x.shape[:k], *shape[k:-1], n).reshape(groups, n)
    return v if v.dtype == acc else v.to(acc)


def _folded_affine(x, n, k, mul, add, weight, bias):
    """(W_g, B_g), each (groups, n) in fp32 (fp64 for fp64 x) or None where it is the identity,
    the groups those of x's first k dims: differentiable PyTorch ops on the small vectors."""
    acc = _stat_dtype(x)
    groups = math.prod(x.shape[:k])
    m = None if mul is None else _as_groups(mul, x, n, k, acc)
    a = None if add is None else _as_groups(add, x, n, k, acc)
    w = None if weight is None else weight.to(acc)
    b = None if bias is None else bias.to(acc)
    if m is None:
        wg = None if w is None else w.expand(groups, n)
        bg = b.expand(groups, n) if b is not None else None
    else:
        wg = m if w is None else m * w
        bg = None if b is None else m * b
    if a is not None:
        bg = a if bg is None else bg + a
    return wg, bg


# =============================================================================================
# Registered ops: what torch.compile, fx and exported graphs see (the folded affine stays in
# PyTorch ops around them)
# =============================================================================================

Tensor = torch.Tensor
OptTensor = torch.Tensor | None


@torch.library.custom_op("trifuse::grouped_norm", mutates_args=())
def _grouped_norm_op(x: Tensor, weight: OptTensor, bias: OptTensor, eps: float, is_rms_norm: bool,
                     groups: int, out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd): the norm of x's last dim with affine (groups, N) parameters, row r of
    group r // (rows / groups)."""
    return _grouped_fwd(x, weight, bias, x.shape[-1], eps, is_rms_norm, groups, out_dtype)


@torch.library.custom_op("trifuse::grouped_norm_backward", mutates_args=())
def _grouped_norm_backward_op(dy: Tensor, x: Tensor, weight: OptTensor, mean: Tensor, rstd: Tensor,
                              eps: float, is_rms_norm: bool, groups: int, need_dw: bool,
                              need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW_g, dB_g); the two vectors (groups, N) fp32 (fp64 for fp64), empty where not needed."""
    dx, dw, db = _grouped_bwd(dy, x, weight, mean, rstd, x.shape[-1], eps, is_rms_norm, groups,
                              (True, need_dw, need_db))
    # an empty tensor of its own for each output not needed: a registered op's outputs never alias
    stat = _stat_dtype(x)
    return dx, *(x.new_empty(0, dtype=stat) if v is None else v for v in (dw, db))


@_grouped_norm_op.register_fake
def _(x, weight, bias, eps, is_rms_norm, groups, out_dtype):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    stat = _stat_dtype(x)
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(0 if is_rms_norm else rows, dtype=stat),
            x.new_empty(rows, dtype=stat))


@_grouped_norm_backward_op.register_fake
def _(dy, x, weight, mean, rstd, eps, is_rms_norm, groups, need_dw, need_db):
    n = x.shape[-1]
    vec = (groups, n)
    return (x.new_empty(x.shape), x.new_empty(vec if need_dw else 0, dtype=_stat_dtype(x)),
            x.new_empty(vec if need_db else 0, dtype=_stat_dtype(x)))


def _twice(ctx, *grads):
    """The backward in PyTorch ops, differentiable again (create_graph=True); y's gradient the sum
    of its views' (the first ctx.outputs grads; the registered op's others are mean's and rstd's)."""
    x, weight, bias, _, _ = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dy = None
    for g in grads[:ctx.outputs]:
        if g is not None:
            dy = g.to(_stat_dtype(x)) if dy is None else dy + g
    if dy is None:
        return (None,) * len(needs)
    dx, dw, db = reference_grads(
        lambda x, w, b: _grouped_norm_torch(x, w, b, x.shape[-1], ctx.eps, ctx.is_rms_norm, ctx.groups)[0],
        (x, weight, bias), needs[:3], (dy,))
    return (None if dx is None else dx.to(x.dtype), dw, db, *(None,) * (len(needs) - 3))


def _setup(ctx, inputs, output):
    x, weight, bias, eps, is_rms_norm, groups, _ = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.eps, ctx.is_rms_norm, ctx.groups, ctx.outputs = eps, is_rms_norm, groups, 1
    ctx.set_materialize_grads(False)


@single_backward(twice=_twice, op=OP)
def _backward(ctx, dy, *_):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if dy is None:
        return (None,) * 7
    need_dw, need_db = needs[1] and weight is not None, needs[2] and bias is not None
    dx, dw, db = torch.ops.trifuse.grouped_norm_backward(dy, x, weight, mean, rstd, ctx.eps, ctx.is_rms_norm,
                                                         ctx.groups, need_dw, need_db)
    return (dx if needs[0] else None, dw if need_dw else None, db if need_db else None, *(None,) * 4)


torch.library.register_autograd("trifuse::grouped_norm", _backward, setup_context=_setup)


# =============================================================================================
# Eager fast path: a thin autograd.Function straight over the launchers
# =============================================================================================


class _GroupedNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms_norm, groups, y_dtype, narrowing):
        # narrowing: None, or (out_dtype, readers, full_y) as `layer_norm_modulate` takes them
        out_dtype, readers, full_y = narrowing or (None, 1, False)
        y_out = y_dtype if full_y or out_dtype is None else out_dtype
        out = _grouped_fwd(x, weight, bias, x.shape[-1], eps, is_rms_norm, groups, y_out,
                           out_dtype if full_y else None)
        y, mean, rstd = out[:3]
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.eps, ctx.is_rms_norm, ctx.groups = eps, is_rms_norm, groups
        # y (in full as well, with full_y) and a view of the narrowed y for each reader beyond the
        # first: one buffer, each view's gradient reaching the backward apart (summed there in fp32)
        narrow = out[3] if full_y else y
        ys = ((y,) if full_y else ()) + (narrow, *(narrow.view_as(narrow) for _ in range(readers - 1)))
        ctx.outputs = len(ys)
        return ys if len(ys) > 1 else y

    @staticmethod
    @single_backward(twice=_twice)
    def backward(ctx, dy, *more_dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        with profiled("trifuse::grouped_norm_backward"):
            dx, dw, db = _grouped_bwd(dy, x, weight, mean, rstd, x.shape[-1], ctx.eps, ctx.is_rms_norm,
                                      ctx.groups, (needs[0], needs[1] and weight is not None,
                                                   needs[2] and bias is not None), more_dy)
        return dx, dw, db, None, None, None, None, None


# =============================================================================================
# Public API
# =============================================================================================


@outside_device_modes
def layer_norm_modulate(
    x: torch.Tensor,
    normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
    mul: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    is_rms_norm: bool = False,
    out_dtype: torch.dtype | None = None,
    readers: int = 1,
    full_y: bool = False,
    mul_offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`norm(x) * mul + add` in one pass each way: the adaptive LayerNorm (RMSNorm) of diffusion
    transformers, `F.layer_norm(x, (N,), weight, bias, eps) * (1 + scale[:, None]) + shift[:, None]`
    with mul = 1 + scale[:, None] and add = shift[:, None]; or per token, `norm(x) * (1 + scale) +
    shift` with scale and shift shaped like x (FLUX.3, Qwen-Image 2.1: a timestep per token).

    Args:
        x: (..., N), fp16 / bf16 / fp32 / fp64; any strides.
        normalized_shape: N (the last dim; one dim only).
        mul, add: None, or broadcastable to x (each dim x's or 1, the last N or 1), any float
            dtype. Per-sample vectors (equal to x over a leading prefix of its dims, 1 over its
            other leading dims: (B, 1, N), (B, T, 1, N)) fold into the norm's affine; anything
            varying along a sample's rows (per token: (B, S, N), a chunk of a (B, S, 3N)
            projection read in place) is read a row at a time beside x.
        weight, bias: (N,) or None, the norm's own affine (no bias for RMSNorm).
        eps: added to the variance (mean square for RMSNorm).
        is_rms_norm: RMSNorm instead of LayerNorm.
        out_dtype: y's dtype when not the promoted one, rounded once from the fp32 result:
            narrower for autocast's matmuls (a DiT block's modulated norms feed the attention's
            q, k and v projections, and the MLP's first linear, alone), or wider where the model
            modulates the norm's output in a wider dtype (CUDA autocast returns fp32 from a
            16-bit LayerNorm). `fuse` sets it.
        readers, full_y: with a narrower out_dtype, as `trifuse.ops.layer_norm` takes them: that
            many views of y, their gradients summed in fp32 in the backward; or (y in its
            own dtype, y in out_dtype).
        mul_offset: added to mul as it is read: `norm(x) * (1 + scale) + shift` is mul=scale,
            mul_offset=1, with no pass to write 1 + scale (needs mul).

    Returns:
        y shaped like x, contiguous, in x's dtype promoted with mul's and add's (or as narrowed).
        Gradients reach x, mul, add, weight and bias; the per-sample sums are deterministic.

    Eager calls run trifuse's kernels or PyTorch's norm, product and sum, whichever the
    `layer_norm_modulate` dialect (per token: `layer_norm_modulate_rows`) measured faster for
    this shape on this GPU (on tiny activations PyTorch's shorter host path can win); elsewhere,
    and under torch.compile, trifuse's (`trifuse::grouped_norm`, per token
    `trifuse::norm_modulate_rows`).

    Raises:
        TypeError for non-float tensors; ValueError for shapes, devices or eps that do not fit.
    """
    per_token = _check(OP, x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, per_token=True)
    _check_offset(OP, mul, mul_offset)
    plain = out_dtype is None and readers == 1 and not full_y
    if not plain:  # narrowed: a choice of its own, timed with the casts PyTorch's candidate needs
        _check_narrowing(OP, out_dtype, readers, full_y)
    narrowing = () if plain else (out_dtype, readers, full_y)
    if per_token:
        return LAYER_NORM_MODULATE_ROWS(x, normalized_shape, mul, add, weight, bias, float(eps), is_rms_norm,
                                        float(mul_offset), *narrowing)
    # per sample: the offset joins the small vector
    mul = _with_offset(mul, mul_offset)
    return LAYER_NORM_MODULATE(x, normalized_shape, mul, add, weight, bias, float(eps), is_rms_norm, *narrowing)


def _check_offset(op: str, mul: torch.Tensor | None, mul_offset) -> None:
    if mul_offset != 0.0:
        if not isinstance(mul_offset, (int, float)) or isinstance(mul_offset, bool) or not math.isfinite(mul_offset):
            raise TypeError(f"trifuse.{op}: mul_offset must be a finite number, got {mul_offset!r}")
        if mul is None:
            raise ValueError(f"trifuse.{op}: mul_offset ({mul_offset}) needs a mul to add it to")


def _y_dtype(dtype: torch.dtype, mul: torch.Tensor | None, add: torch.Tensor | None) -> torch.dtype:
    """The dtype of `norm(x) * mul + add` as written, the norm in `dtype` (x's, or s's)."""
    out = dtype
    for t in (mul, add):
        if t is not None:
            out = torch.promote_types(out, t.dtype)
    return out


# The candidates take the narrowing arguments (out_dtype, readers, full_y) after the plain ones:
# trifuse's kernels write y in out_dtype, PyTorch's y is cast once per reader.


def _traced_y_dtype(y_dtype: torch.dtype, out_dtype: torch.dtype | None, readers: int,
                    full_y: bool) -> torch.dtype:
    """The dtype a registered forward op (what compiled graphs run) writes y in: out_dtype for one
    reader (a compiler cannot fuse a cast into an opaque op: a cast after it would be one more pass
    over y, and one over its gradient); y's own with full_y; with several readers, the widest of
    y's, out_dtype and fp32, cast after the op once per reader (`_cast_for_readers`): their
    gradients come back in fp32 and autograd sums them there, as the model's casts of its fp32 y
    did (a 16-bit x's y, widened by CUDA's autocast, then narrowed: DiT's q, k and v)."""
    if out_dtype is None or full_y:
        return y_dtype
    if readers == 1:
        return out_dtype
    return torch.promote_types(torch.promote_types(y_dtype, out_dtype), torch.float32)


def _modulate_trifuse(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, out_dtype=None,
                      readers=1, full_y=False):
    """The op's own candidate: the folded affine (PyTorch, on the small vectors) and the norm
    kernels with it. Checked inputs."""
    n = x.shape[-1]
    k = max(0 if t is None else _sample_dims(t, x) for t in (mul, add))
    groups = math.prod(x.shape[:k])
    y_dtype = _y_dtype(x.dtype, mul, add)
    if x.numel() == 0:  # no rows: nothing to normalize (the empty product keeps the gradients' paths)
        y = layer_norm_modulate_ref(x.to(y_dtype), [n], mul, add, weight, bias, eps, is_rms_norm)
        return _cast_for_readers(y.to(y_dtype), out_dtype, readers, full_y)
    wg, bg = _folded_affine(x, n, k, mul, add, weight, bias)
    if eager_fast_path(x, wg, bg):
        plain = out_dtype is None and readers == 1 and not full_y
        narrowing = None if plain else (out_dtype, readers, full_y)
        with profiled(f"trifuse::{OP}"):
            return apply_function(_GroupedNormFunction, x, wg, bg, eps, is_rms_norm, groups, y_dtype,
                                  narrowing)
    # traced: the registered op, y in the dtype it is read in (`_traced_y_dtype`)
    y = torch.ops.trifuse.grouped_norm(x, wg, bg, eps, is_rms_norm, groups,
                                       _traced_y_dtype(y_dtype, out_dtype, readers, full_y))[0]
    return _cast_for_readers(y, out_dtype, readers, full_y)


def _modulate_torch(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, out_dtype=None,
                    readers=1, full_y=False):
    """PyTorch's norm, product and sum, in the op's dtypes (autocast, which would run the norm in
    fp32, off: the implementation chosen must not change the output dtype); where the modulation
    or out_dtype is wider than x (Wan's fp32 modulation of a bf16 x; CUDA autocast's fp32 norm
    of a 16-bit x), the norm of x's exact upcast, in that dtype: y is never rounded to x's dtype on
    the way, as the kernels compute it. Narrowed (out_dtype set by fusion/narrow.py), in fp32 at
    least: the model's y was fp32 (a 16-bit x's norm that CUDA's autocast widened, modulated in
    fp32: DiT's), rounded once to out_dtype."""
    wide = _y_dtype(x.dtype, mul, add)
    if out_dtype is not None and not full_y:
        wide = torch.promote_types(wide, out_dtype)
    if out_dtype is not None:
        wide = torch.promote_types(wide, torch.float32)
    if wide != x.dtype:
        x, weight, bias = (None if t is None else t.to(wide) for t in (x, weight, bias))
    if unscoped(x.device):
        y = layer_norm_modulate_ref(x, [x.shape[-1]], mul, add, weight, bias, eps, is_rms_norm)
    else:
        with profiled(f"trifuse::{OP}"), no_autocast(x.device):
            y = layer_norm_modulate_ref(x, [x.shape[-1]], mul, add, weight, bias, eps, is_rms_norm)
    return _cast_for_readers(y.to(_y_dtype(x.dtype, mul, add)), out_dtype, readers, full_y)


def _modulate_torch_supports(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm,
                             *narrowing) -> str | None:
    allowed = (x.dtype, torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else (x.dtype,)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in allowed:
            norm = "rms_norm" if is_rms_norm else "layer_norm"
            return f"F.{norm} takes {name} in {' or '.join(map(str, allowed))}, got {t.dtype}"
    return None


def _modulate_key(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, out_dtype=None, readers=1,
                  full_y=False):
    """The dialect key of an eager call: None (the op's kernels) when traced or empty; a narrowed
    call's with the narrowing as its last entry (`layer_norm`'s keys the same)."""
    if not eager_fast_path(x, mul, add, weight, bias):
        return None
    n = x.shape[-1] if x.dim() else 0
    rows = x.numel() // n if n else 0
    if rows == 0:
        return None
    tensors = (x, mul, add, weight, bias)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    dtypes = tuple(None if t is None else t.dtype for t in tensors[1:])
    key = (x.get_device() if x.is_cuda else -1, x.dtype, pow2_bucket(rows), n, *dtypes, is_rms_norm, grad)
    if out_dtype is None and readers == 1 and not full_y:
        return key
    return _narrowed_key(key, x, out_dtype, readers, full_y)


def _modulate_dialect_ref(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, out_dtype=None,
                          readers=1, full_y=False):
    y = layer_norm_modulate_ref(x, [x.shape[-1]], mul, add, weight, bias, eps, is_rms_norm)
    return _narrowed_ref(y, x, out_dtype, readers, full_y)


# The op's kernels or PyTorch's three ops, whichever measured faster per shape on this GPU (on
# tiny activations the host path decides, and PyTorch's is shorter).
LAYER_NORM_MODULATE = dialects.define(
    OP, _modulate_key, ("device", "dtype", "rows", "n", "mul", "add", "weight", "bias", "rms", "grad", "out"),
    reference=_modulate_dialect_ref)
LAYER_NORM_MODULATE.register(dialects.Candidate("trifuse", _modulate_trifuse))
LAYER_NORM_MODULATE.register(dialects.Candidate("torch", _modulate_torch, supports=_modulate_torch_supports))


# =============================================================================================
# The gated residual feeding the adaptive norm: s = residual + gate * x, y = norm(s) * mul + add
# =============================================================================================
#
# A DiT block's second norm (and Flux's, SD3's, PixArt's) reads the residual stream just after
# the attention's gated residual add, `h = h + gate_msa[:, None] * attn_out`: eagerly the
# product and the sum are two more passes each way, and the backward's dgate a per-sample sum of
# its own. Here the norm kernel loads x, multiplies it by the group's gate row and adds the
# residual as it reads (_load_stream), stores s once, and its backward writes dx = ds * gate and
# dresidual = ds, summing dgate = sum over the group's rows of ds * x in the partial buffer
# dx_bias uses elsewhere (deterministic, as dW_g and dB_g).

GATED_OP = "gated_add_layer_norm_modulate"


def _gated_sum_torch(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor | None, groups: int,
                     s_dtype: torch.dtype) -> torch.Tensor:
    """s = residual + gate_g * x in PyTorch ops (differentiable), in fp32 (fp64) rounded once to s_dtype."""
    acc = _stat_dtype(x)
    n = x.shape[-1]
    h = x.reshape(groups, -1, n).to(acc)
    if gate is not None:
        h = h * gate.to(acc)[:, None]
    return (h + residual.reshape(groups, -1, n).to(acc)).to(s_dtype).reshape(x.shape)


def _gated_fwd(x, residual, gate, weight, bias, n, eps, is_rms_norm, groups, s_dtype, out_dtype,
               y2_dtype=None):
    """(y, s, mean, rstd), and y2 with y2_dtype: s = residual + gate * x in s_dtype, y its grouped
    norm in out_dtype; gate (groups, n) or None."""
    if not use_triton(x):
        with torch.no_grad():
            s = _gated_sum_torch(x, residual, gate, groups, s_dtype)
            y, mean, rstd = _grouped_norm_torch(s, weight, bias, n, eps, is_rms_norm, groups)
        out = (y.to(out_dtype), s, mean[:0] if is_rms_norm else mean, rstd)
        return out if y2_dtype is None else (*out, y.to(y2_dtype))
    rows = x.numel() // n
    return layer_norm_fwd(x, n, weight, bias, eps, is_rms_norm=is_rms_norm, residual=residual, store_s=True,
                          out_dtype=out_dtype, y2_dtype=y2_dtype, gate=gate,
                          rows_per_group=rows // groups if groups > 1 else None)


def _gated_bwd(dy, ds, x, s, gate, weight, mean, rstd, n, eps, is_rms_norm, groups, needs, dr_dtype,
               more_dy=()):
    """(dx in x's dtype, dresidual in dr_dtype, dW_g, dB_g, dgate_g in fp32 / fp64) as `needs`
    (x, residual, weight, bias, gate) asks; None where not. ds: the gradient arriving at s, or None."""
    acc = _stat_dtype(s)
    if not use_triton(s):
        d_s, g_y, xhat = _grouped_grads_torch(dy, s, weight, mean, rstd, n, is_rms_norm, groups, more_dy)
        with torch.no_grad():
            if ds is not None:
                d_s = d_s + ds.reshape(groups, -1, n).to(acc)
            dx = d_s if gate is None else d_s * gate.to(acc)[:, None]
            dgate = (d_s * x.reshape(groups, -1, n).to(acc)).sum(1) if needs[4] and gate is not None else None
            return (dx.reshape(x.shape).to(x.dtype) if needs[0] else None,
                    d_s.reshape(x.shape).to(dr_dtype) if needs[1] else None,
                    (g_y * xhat).sum(1) if needs[2] else None, g_y.sum(1) if needs[3] else None, dgate)
    grad_dtypes = (acc if needs[2] and weight is not None else None, acc if needs[3] else None,
                   acc if needs[4] and gate is not None else None)
    # without a gate dx is dresidual, stored once where the dtypes agree
    store_dr = gate is not None or dr_dtype != x.dtype
    dx, dr, dw, db, dg = layer_norm_bwd(dy, s, n, weight, mean, rstd, is_rms_norm=is_rms_norm, ds=ds,
                                        store_dresidual=store_dr, grad_dtypes=grad_dtypes, dx_dtype=x.dtype,
                                        dr_dtype=dr_dtype, more_dy=more_dy, groups=groups,
                                        x=x if gate is not None else None, gate=gate)
    # one group comes back as (n,) vectors
    return (dx if needs[0] else None, dr if needs[1] else None,
            *(None if v is None else v.view(groups, n) for v in (dw, db, dg)))


def _gated_s_dtype(x: torch.Tensor, residual: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, residual.dtype)


def _check_gated(op, x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm,
                 per_token=False) -> bool:
    """`_check`'s errors for the norm's input s (x's shape and dtype), and those of the residual and
    the gate. With per_token, mul, add and the gate may vary along a sample's rows: returns whether
    any does."""
    rows = _check(op, x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, per_token=per_token)
    check_tensor(op, "residual", residual)
    check_float(op, "residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"trifuse.{op}: residual must have the input's shape {list(x.shape)}, "
                         f"got {list(residual.shape)}")
    if gate is not None:
        check_tensor(op, "gate", gate)
        check_float(op, "gate", gate)
        if per_token:
            rows = _check_per_token(op, "gate", gate, x, x.shape[-1]) or rows
        else:
            _check_per_sample(op, "gate", gate, x, x.shape[-1])
        # the product and the sum are computed in the accumulation dtype: a gate wider than s (Wan's
        # fp32 gate beside a bf16 stream) is exact up to it, a wider one would lose digits
        acc = torch.float64 if _gated_s_dtype(x, residual) == torch.float64 else torch.float32
        if torch.promote_types(acc, gate.dtype) != acc:
            raise ValueError(f"trifuse.{op}: gate ({gate.dtype}) must be no wider than {acc}, the dtype the "
                             "product and the sum are computed in")
    check_same_device(op, "input", x, residual=residual, gate=gate)
    return rows


@torch.library.custom_op("trifuse::gated_grouped_norm", mutates_args=())
def _gated_grouped_norm_op(x: Tensor, residual: Tensor, gate: OptTensor, weight: OptTensor, bias: OptTensor,
                           eps: float, is_rms_norm: bool, groups: int,
                           out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, s, mean, rstd): s = residual + gate * x (gate (groups, N) or None), y the norm of s's last
    dim with affine (groups, N) parameters, row r of group r // (rows / groups)."""
    return _gated_fwd(x, residual, gate, weight, bias, x.shape[-1], eps, is_rms_norm, groups,
                      _gated_s_dtype(x, residual), out_dtype)


@torch.library.custom_op("trifuse::gated_grouped_norm_backward", mutates_args=())
def _gated_grouped_norm_backward_op(dy: Tensor, ds: OptTensor, x: Tensor, s: Tensor, gate: OptTensor,
                                    weight: OptTensor, mean: Tensor, rstd: Tensor, eps: float,
                                    is_rms_norm: bool, groups: int, need_dw: bool, need_db: bool,
                                    need_dgate: bool,
                                    dr_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dresidual, dW_g, dB_g, dgate_g); the three vectors (groups, N) fp32 (fp64 for fp64),
    empty where not needed."""
    out = _gated_bwd(dy, ds, x, s, gate, weight, mean, rstd, x.shape[-1], eps, is_rms_norm, groups,
                     (True, True, need_dw, need_db, need_dgate), dr_dtype)
    # a registered op returns no output aliasing another: dresidual may be dx itself, and each
    # output not needed gets an empty tensor of its own
    dr = out[1].clone() if out[1] is out[0] else out[1]
    return out[0], dr, *(x.new_empty(0, dtype=_stat_dtype(s)) if v is None else v for v in out[2:])


@_gated_grouped_norm_op.register_fake
def _(x, residual, gate, weight, bias, eps, is_rms_norm, groups, out_dtype):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    stat = _stat_dtype(x)
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=_gated_s_dtype(x, residual)),
            x.new_empty(0 if is_rms_norm else rows, dtype=stat), x.new_empty(rows, dtype=stat))


@_gated_grouped_norm_backward_op.register_fake
def _(dy, ds, x, s, gate, weight, mean, rstd, eps, is_rms_norm, groups, need_dw, need_db, need_dgate,
      dr_dtype):
    vec = (groups, x.shape[-1])
    stat = _stat_dtype(s)
    return (x.new_empty(x.shape), x.new_empty(x.shape, dtype=dr_dtype),
            *(x.new_empty(vec if need else 0, dtype=stat) for need in (need_dw, need_db, need_dgate)))


def _gated_twice(ctx, *grads):
    """The backward in PyTorch ops, differentiable again (create_graph=True): y's gradient the sum
    of its views' (the first ctx.outputs grads), then s's."""
    x, residual, gate, weight, bias, _, _, _ = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dy = None
    for g in grads[:ctx.outputs]:
        if g is not None:
            dy = g.to(_stat_dtype(x)) if dy is None else dy + g
    ds = grads[ctx.outputs]
    if dy is None and ds is None:
        return (None,) * len(needs)

    def forward(x, residual, gate, w, b):
        s = _gated_sum_torch(x, residual, gate, ctx.groups, _gated_s_dtype(x, residual))
        return _grouped_norm_torch(s, w, b, x.shape[-1], ctx.eps, ctx.is_rms_norm, ctx.groups)[0], s

    dx, dr, dg, dw, db = reference_grads(forward, (x, residual, gate, weight, bias), needs[:5], (dy, ds))
    return (None if dx is None else dx.to(x.dtype), None if dr is None else dr.to(residual.dtype), dg, dw, db,
            *(None,) * (len(needs) - 5))


def _gated_saved(ctx, x, residual, gate, weight, bias, s, mean, rstd, groups, eps, is_rms_norm, outputs):
    # residual is saved for its dtype and the double backward only: the backward reads s
    ctx.save_for_backward(x, residual, gate, weight, bias, s, mean, rstd)
    ctx.eps, ctx.is_rms_norm, ctx.groups, ctx.outputs = eps, is_rms_norm, groups, outputs


def _gated_setup(ctx, inputs, output):
    x, residual, gate, weight, bias, eps, is_rms_norm, groups, _ = inputs
    _, s, mean, rstd = output
    _gated_saved(ctx, x, residual, gate, weight, bias, s, mean, rstd, groups, eps, is_rms_norm, 1)
    ctx.set_materialize_grads(False)


def _gated_grads(ctx, dy, ds, more_dy=()):
    """(dx, dresidual, dgate_g, dW_g, dB_g) in the inputs' order, None where not needed."""
    x, residual, gate, weight, bias, s, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    need = (needs[0], needs[1], needs[3] and weight is not None, needs[4] and bias is not None,
            needs[2] and gate is not None)
    dx, dr, dw, db, dg = _gated_bwd(dy, ds, x, s, gate, weight, mean, rstd, x.shape[-1], ctx.eps,
                                    ctx.is_rms_norm, ctx.groups, need, residual.dtype, more_dy)
    return dx, dr, dg, dw, db


@single_backward(twice=_gated_twice, op=GATED_OP)
def _gated_backward(ctx, dy, ds, *_):
    x, residual, gate, weight, bias, s, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if dy is None and ds is None:
        return (None,) * 9
    need_dw, need_db = needs[3] and weight is not None, needs[4] and bias is not None
    need_dg = needs[2] and gate is not None
    dy = torch.zeros_like(s) if dy is None else dy
    dx, dr, dw, db, dg = torch.ops.trifuse.gated_grouped_norm_backward(
        dy, ds, x, s, gate, weight, mean, rstd, ctx.eps, ctx.is_rms_norm, ctx.groups, need_dw, need_db,
        need_dg, residual.dtype)
    return (dx if needs[0] else None, dr if needs[1] else None, dg if need_dg else None,
            dw if need_dw else None, db if need_db else None, *(None,) * 4)


torch.library.register_autograd("trifuse::gated_grouped_norm", _gated_backward, setup_context=_gated_setup)


class _GatedNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, gate, weight, bias, eps, is_rms_norm, groups, y_dtype, narrowing):
        out_dtype, readers, full_y = narrowing or (None, 1, False)
        y_out = y_dtype if full_y or out_dtype is None else out_dtype
        out = _gated_fwd(x, residual, gate, weight, bias, x.shape[-1], eps, is_rms_norm, groups,
                         _gated_s_dtype(x, residual), y_out, out_dtype if full_y else None)
        y, s, mean, rstd = out[:4]
        narrow = out[4] if full_y else y
        ys = ((y,) if full_y else ()) + (narrow, *(narrow.view_as(narrow) for _ in range(readers - 1)))
        _gated_saved(ctx, x, residual, gate, weight, bias, s, mean, rstd, groups, eps, is_rms_norm, len(ys))
        return (*ys, s)

    @staticmethod
    @single_backward(twice=_gated_twice)
    def backward(ctx, *grads):
        # (gradients materialized: zeros for an output nobody read)
        dy, *more_dy = grads[:ctx.outputs]
        with profiled("trifuse::gated_grouped_norm_backward"):
            return (*_gated_grads(ctx, dy, grads[ctx.outputs], tuple(more_dy)), *(None,) * 5)


@outside_device_modes
def gated_add_layer_norm_modulate(
    x: torch.Tensor,
    residual: torch.Tensor,
    gate: torch.Tensor | None,
    normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
    mul: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    is_rms_norm: bool = False,
    out_dtype: torch.dtype | None = None,
    readers: int = 1,
    full_y: bool = False,
    mul_offset: float = 0.0,
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
    """A diffusion transformer's gated residual add and the adaptive norm after it, in one pass
    each way:

        s = residual + gate * x;   y = norm(s) * (mul + mul_offset) + add;   returns (y, s)

    as DiT's, SD3's, Flux's and PixArt's blocks write `h = h + gate_msa[:, None] * attn_out`
    and then `norm2(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]`; or per token (Qwen-Image
    2.1's image stream: gate, scale and shift (B, S, N)), `h + gate1 * attn_out` and
    `norm2(h) * (1 + scale) + shift`.

    Args:
        x: (..., N), fp16 / bf16 / fp32 / fp64; any strides.
        residual: shaped like x, any float dtype; s takes the dtype x and residual promote to.
        gate: a per-sample vector as mul and add are, or per token (varying along a sample's rows,
            any broadcast of x's shape), or None (s = residual + x); no wider than fp32 (fp64 for
            fp64 s): the product and the sum are computed in fp32 and rounded once to s's dtype, as
            Wan writes `(h.float() + attn_out * gate).type_as(h)` with an fp32 gate.
        normalized_shape, mul, add, weight, bias, eps, is_rms_norm, out_dtype, readers, full_y,
            mul_offset: as `layer_norm_modulate` takes them, for the norm of s.

    Returns:
        (y, s): y as `layer_norm_modulate` returns it for the input s; s shaped like x,
        contiguous, rounded once (the model rounds the product, then the sum). Gradients reach x,
        residual, gate, mul, add, weight and bias; the per-sample sums are deterministic.

    Eager calls run trifuse's kernels or PyTorch's ops as written, whichever the
    `gated_add_layer_norm_modulate` dialect (per token: `gated_add_layer_norm_modulate_rows`)
    measured faster for this shape on this GPU; elsewhere, and under torch.compile, trifuse's
    (`trifuse::gated_grouped_norm`, per token `trifuse::gated_norm_modulate_rows`).

    Raises:
        TypeError for non-float tensors; ValueError for shapes, devices or eps that do not fit.
    """
    per_token = _check_gated(GATED_OP, x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm,
                             per_token=True)
    _check_offset(GATED_OP, mul, mul_offset)
    plain = out_dtype is None and readers == 1 and not full_y
    if not plain:
        _check_narrowing(GATED_OP, out_dtype, readers, full_y)
    narrowing = () if plain else (out_dtype, readers, full_y)
    if per_token:
        *ys, s = GATED_ADD_LAYER_NORM_MODULATE_ROWS(x, residual, gate, normalized_shape, mul, add, weight, bias,
                                                    float(eps), is_rms_norm, float(mul_offset), *narrowing)
    else:
        *ys, s = GATED_ADD_LAYER_NORM_MODULATE(x, residual, gate, normalized_shape, _with_offset(mul, mul_offset), add,
                                               weight, bias, float(eps), is_rms_norm, *narrowing)
    return (tuple(ys) if len(ys) > 1 else ys[0]), s


def _ys_then_s(y: torch.Tensor | tuple[torch.Tensor, ...], s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The candidates' results as one flat tuple, y's views first and s last: what the dialect
    checks and differentiates output by output."""
    return (*(y if isinstance(y, tuple) else (y,)), s)


def _gated_trifuse(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm,
                   out_dtype=None, readers=1, full_y=False):
    """The op's own candidate: the folded affine and gate (PyTorch, on the small vectors) and the
    norm kernels reading x, the residual and the gate. Checked inputs."""
    n = x.shape[-1]
    k = max(0 if t is None else _sample_dims(t, x) for t in (mul, add, gate))
    groups = math.prod(x.shape[:k])
    s_dtype = _gated_s_dtype(x, residual)
    y_dtype = _y_dtype(s_dtype, mul, add)
    if x.numel() == 0:  # no rows: the ops as written (the empty products keep the gradients' paths)
        s = _written_sum(x, residual, gate)
        y = layer_norm_modulate_ref(s.to(s_dtype), [n], mul, add, weight, bias, eps, is_rms_norm)
        return _ys_then_s(_cast_for_readers(y.to(y_dtype), out_dtype, readers, full_y), s.to(s_dtype))
    wg, bg = _folded_affine(x, n, k, mul, add, weight, bias)
    gate_g = None if gate is None else _as_groups(gate, x, n, k, _stat_dtype(x)).contiguous()
    if eager_fast_path(x, residual, gate_g, wg, bg):
        plain = out_dtype is None and readers == 1 and not full_y
        narrowing = None if plain else (out_dtype, readers, full_y)
        with profiled(f"trifuse::{GATED_OP}"):
            out = apply_function(_GatedNormFunction, x, residual, gate_g, wg, bg, eps, is_rms_norm, groups,
                                 y_dtype, narrowing)
        return out
    # traced: the registered op, y in the dtype it is read in (`_traced_y_dtype`)
    y, s = torch.ops.trifuse.gated_grouped_norm(x, residual, gate_g, wg, bg, eps, is_rms_norm, groups,
                                                _traced_y_dtype(y_dtype, out_dtype, readers, full_y))[:2]
    return _ys_then_s(_cast_for_readers(y, out_dtype, readers, full_y), s)


def _written_sum(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """s as the model writes it: the product, then the sum, each rounded in its dtype (a gate wider
    than s, Wan's: both in the gate's dtype, the sum rounded to s's)."""
    s = residual + (x if gate is None else gate * x)
    return s.to(_gated_s_dtype(x, residual))


def _gated_torch(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm,
                 out_dtype=None, readers=1, full_y=False):
    """PyTorch's product and sum as the model writes them, then `layer_norm_modulate`'s torch
    candidate on s."""
    s = _written_sum(x, residual, gate)
    y = _modulate_torch(s, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, out_dtype, readers,
                        full_y)
    return _ys_then_s(y, s)


def _gated_torch_supports(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm,
                          *narrowing) -> str | None:
    s = x.new_empty(0, dtype=_gated_s_dtype(x, residual))
    return _modulate_torch_supports(s, normalized_shape, mul, add, weight, bias, eps, is_rms_norm)


def _gated_key(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, out_dtype=None,
               readers=1, full_y=False):
    """The dialect key of an eager call (`_modulate_key`'s, with the residual's and the gate's
    dtypes); None (the op's kernels) when traced or empty."""
    if not eager_fast_path(residual, gate):
        return None
    key = _modulate_key(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm)
    if key is None:
        return None
    grad = key[-1] or torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (residual, gate))
    key = (*key[:-1], residual.dtype, None if gate is None else gate.dtype, grad)
    if out_dtype is None and readers == 1 and not full_y:
        return key
    return _narrowed_key(key, x, out_dtype, readers, full_y)


def _gated_dialect_ref(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm,
                       out_dtype=None, readers=1, full_y=False):
    s = _written_sum(x, residual, gate)
    y = layer_norm_modulate_ref(s, [x.shape[-1]], mul, add, weight, bias, eps, is_rms_norm)
    return _ys_then_s(_narrowed_ref(y, x, out_dtype, readers, full_y), s)


# The op's kernels or PyTorch's product, sum, norm, product and sum, whichever measured faster per
# shape on this GPU.
GATED_ADD_LAYER_NORM_MODULATE = dialects.define(
    GATED_OP, _gated_key, ("device", "dtype", "rows", "n", "mul", "add", "weight", "bias", "rms", "residual",
                           "gate", "grad", "out"),
    reference=_gated_dialect_ref)
GATED_ADD_LAYER_NORM_MODULATE.register(dialects.Candidate("trifuse", _gated_trifuse))
GATED_ADD_LAYER_NORM_MODULATE.register(
    dialects.Candidate("torch", _gated_torch, supports=_gated_torch_supports))


# =============================================================================================
# Per-token modulation: mul and add full-size, one row of each per row of x
# =============================================================================================
#
# Models that give each token its own timestep (FLUX.3, Qwen-Image 2.1's edit tokens, SANA-WM,
# Helios' and MiniMax's per-frame noise levels) modulate per token: scale and shift (B, S, N),
# usually chunks of one (B, S, 3N) projection. Folded into the affine as above they would become
# two fp32 (M, N) parameter tensors written by PyTorch first; instead these kernels read a row of
# mul and a row of add beside each row of x, in place (any row stride: the chunks are not copied):
#
#     y = (xhat * weight + bias) * (mul + mul_offset) + add
#
# mul_offset makes the model's `(1 + scale)` part of the load: no pass writes 1 + scale. The
# backward has no reduction for the modulation: dmul = dy * (xhat * weight + bias) is written
# per element beside dx, and dadd is dy itself (summed down only where add broadcasts). The
# norm's own weight and bias, where present, get their per-feature sums from fp32 partial rows
# summed in a fixed order (layer_norm's reduction kernel), deterministic like the others.


@triton.jit
def _row_modulation(y, W, B, MUL, ADD, cols, mask, N, mul_offset, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                    HAS_MUL: tl.constexpr, HAS_ADD: tl.constexpr, ACC: tl.constexpr):
    """(y * weight + bias) * (mul + mul_offset) + add on a tile of normalized rows; MUL and ADD
    point at the tile's rows."""
    if HAS_W:
        y *= tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
    if HAS_B:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(ACC)
    if HAS_MUL:
        y *= tl.load(MUL + cols, mask=mask, other=0.0).to(ACC) + mul_offset
    if HAS_ADD:
        y += tl.load(ADD + cols, mask=mask, other=0.0).to(ACC)
    return y


@triton.jit
def _row_input(X, R, GATE, S, cols, mask, HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr,
               STORE_S: tl.constexpr, ACC: tl.constexpr):
    """The norm's input on a tile (0 where masked; the pointers at the tile's rows): x, or with
    HAS_RESIDUAL s = residual + gate * x, computed in ACC and rounded once to S's dtype (the
    norm reads s as stored: the backward reads the stored s), stored where STORE_S."""
    h = tl.load(X + cols, mask=mask, other=0.0).to(ACC)
    if HAS_RESIDUAL:
        if HAS_GATE:
            h *= tl.load(GATE + cols, mask=mask, other=0.0).to(ACC)
        h = (h + tl.load(R + cols, mask=mask, other=0.0).to(ACC)).to(S.dtype.element_ty)
        if STORE_S:
            tl.store(S + cols, h, mask=mask)
        h = h.to(ACC)
    return h


@triton.jit
def _norm_modulate_rows_fwd_kernel(
    X,  # in (M, N), rows stride_xm apart
    MUL,  # in (M, N); unused unless HAS_MUL
    ADD,  # in (M, N); unused unless HAS_ADD
    W,  # in (N,); unused unless HAS_W
    B,  # in (N,); unused unless HAS_B
    Y,  # out (M, N) contiguous
    MEAN,  # out (M,) fp32 (fp64); unused for RMSNorm
    RSTD,  # out (M,)
    R,  # in (M, N) the residual, rows stride_rm apart; unused unless HAS_RESIDUAL
    GATE,  # in (M, N) multiplying x before the residual, rows stride_gm apart; unused unless HAS_GATE
    S,  # out (M, N) contiguous, s = residual + gate * x, the norm's input; unused unless HAS_RESIDUAL
    stride_xm, stride_mulm, stride_addm, stride_rm, stride_gm,
    M, N, eps, mul_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_MUL: tl.constexpr, HAS_ADD: tl.constexpr,
    ACC: tl.constexpr, HAS_RESIDUAL: tl.constexpr = False, HAS_GATE: tl.constexpr = False,
):
    # int64 rows: row * stride may pass 2^31
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows2 = rows[:, None]
    X += rows2 * stride_xm
    MUL += rows2 * stride_mulm
    ADD += rows2 * stride_addm
    Y += rows2 * N
    R += rows2 * stride_rm
    GATE += rows2 * stride_gm
    S += rows2 * N
    offs = tl.arange(0, BLOCK_N)[None, :]
    if SINGLE_BLOCK:
        mask = row_mask[:, None] & (offs < N)
        x = _row_input(X, R, GATE, S, offs, mask, HAS_RESIDUAL, HAS_GATE, True, ACC)
        mean, d, rstd, _ = _tile_statistics(x, mask, N, eps, IS_RMS_NORM, False, ACC)
        y = _row_modulation(d * rstd[:, None], W, B, MUL, ADD, offs, mask, N, mul_offset,
                            HAS_W, HAS_B, HAS_MUL, HAS_ADD, ACC)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Wide rows: the mean, then the variance around it (no cancellation for large means),
        # then normalize and modulate.
        # (s, where the residual is added, is stored by the first pass and recomputed by the others,
        # as layer_norm's wide path does)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        if not IS_RMS_NORM:
            for start in range(0, N, BLOCK_N):
                cols = start + offs
                acc += _row_input(X, R, GATE, S, cols, row_mask[:, None] & (cols < N), HAS_RESIDUAL, HAS_GATE,
                                  True, ACC)
        mean = _div(tl.sum(acc, axis=1), N, ACC)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        acc_d = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for start in range(0, N, BLOCK_N):
            cols = start + offs
            mask = row_mask[:, None] & (cols < N)
            d = tl.where(mask, _row_input(X, R, GATE, S, cols, mask, HAS_RESIDUAL, HAS_GATE, IS_RMS_NORM, ACC)
                         - mean[:, None], 0.0)
            acc += d * d
            acc_d += d
        shift, rstd, _ = _statistics_of_sums(acc_d, acc, N, eps, IS_RMS_NORM, False, ACC)
        for start in range(0, N, BLOCK_N):
            cols = start + offs
            mask = row_mask[:, None] & (cols < N)
            x = _row_input(X, R, GATE, S, cols, mask, HAS_RESIDUAL, HAS_GATE, False, ACC)
            y = _row_modulation(((x - mean[:, None]) - shift[:, None]) * rstd[:, None], W, B, MUL, ADD, cols,
                                mask, N, mul_offset, HAS_W, HAS_B, HAS_MUL, HAS_ADD, ACC)
            tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=mask)
        mean += shift
    if not IS_RMS_NORM:
        tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _row_tile_grads(DY, X, MUL, W, cols, mask, N, mean, mul_offset, IS_RMS_NORM: tl.constexpr,
                    HAS_W: tl.constexpr, HAS_MUL: tl.constexpr, ACC: tl.constexpr):
    """On a tile (0 where masked; the pointers at the tile's rows): d = x - mean (x for RMSNorm),
    y's gradient dy, the normalized output's dyn = dy * (mul + mul_offset), and g = dyn * weight."""
    if IS_RMS_NORM:
        d = tl.load(X + cols, mask=mask, other=0.0).to(ACC)
    else:
        d = tl.where(mask, tl.load(X + cols, mask=mask, other=0.0).to(ACC) - mean[:, None], 0.0)
    dy = tl.load(DY + cols, mask=mask, other=0.0).to(ACC)
    dyn = dy
    if HAS_MUL:
        dyn = dy * (tl.load(MUL + cols, mask=mask, other=0.0).to(ACC) + mul_offset)
    g = dyn
    if HAS_W:
        g = dyn * tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
    return d, dy, dyn, g


@triton.jit
def _store_row_grads(ds, dy, xhat, DX, DMUL, W, B, DS, XG, GATE, DXG, DGATE, cols, mask, N,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_DMUL: tl.constexpr, HAS_DS: tl.constexpr,
                     HAS_GATE: tl.constexpr, STORE_DXG: tl.constexpr, STORE_DGATE: tl.constexpr,
                     ACC: tl.constexpr):
    """The norm input's gradient ds (plus DS, the gradient arriving at s, with HAS_DS) into DX,
    and dmul = dy * (xhat * weight + bias); with a gated sum before the norm, DX is dresidual,
    DXG dx = ds * gate and DGATE dgate = ds * x (all pointers at the tile's rows)."""
    if HAS_DS:
        ds += tl.load(DS + cols, mask=mask, other=0.0).to(ACC)
    tl.store(DX + cols, ds.to(DX.dtype.element_ty), mask=mask)
    if STORE_DXG:
        dxg = ds
        if HAS_GATE:
            dxg = ds * tl.load(GATE + cols, mask=mask, other=0.0).to(ACC)
        tl.store(DXG + cols, dxg.to(DXG.dtype.element_ty), mask=mask)
    if STORE_DGATE:
        dgate = ds * tl.load(XG + cols, mask=mask, other=0.0).to(ACC)
        tl.store(DGATE + cols, dgate.to(DGATE.dtype.element_ty), mask=mask)
    if STORE_DMUL:
        u = xhat
        if HAS_W:
            u *= tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
        if HAS_B:
            u += tl.load(B + cols, mask=cols < N, other=0.0).to(ACC)
        tl.store(DMUL + cols, (dy * u).to(DMUL.dtype.element_ty), mask=mask)


@triton.jit
def _norm_modulate_rows_bwd_kernel(
    DY,  # in (M, N) contiguous
    X,  # in (M, N), rows stride_xm apart
    MUL,  # in (M, N); unused unless HAS_MUL
    W,  # in (N,); unused unless HAS_W
    B,  # in (N,); unused unless HAS_B
    MEAN,  # in (M,); unused for RMSNorm
    RSTD,  # in (M,)
    DX,  # out (M, N) contiguous
    DMUL,  # out (M, N) contiguous; unused unless STORE_DMUL
    PARTIAL,  # out (2, programs, N) fp32 (fp64): this program's shares of dweight, dbias
    DS,  # in (M, N) contiguous, the gradient arriving at s; unused unless HAS_DS
    XG,  # in (M, N) the x the gate multiplied, rows stride_xgm apart; unused unless STORE_DGATE
    GATE,  # in (M, N), rows stride_gm apart; unused unless HAS_GATE
    DXG,  # out (M, N) contiguous, x's gradient beside DX's dresidual; unused unless STORE_DXG
    DGATE,  # out (M, N) contiguous; unused unless STORE_DGATE
    stride_xm, stride_mulm, stride_xgm, stride_gm,
    M, N, rows_per_program, stride_pk, mul_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_MUL: tl.constexpr, STORE_DMUL: tl.constexpr,
    STORE_DW: tl.constexpr, STORE_DB: tl.constexpr, ACC: tl.constexpr, HAS_DS: tl.constexpr = False,
    HAS_GATE: tl.constexpr = False, STORE_DXG: tl.constexpr = False, STORE_DGATE: tl.constexpr = False,
):
    # With a gated sum before the norm, X is s (as stored by the forward) and DX dresidual.
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    DW_PARTIAL = PARTIAL + pid.to(tl.int64) * N
    DB_PARTIAL = DW_PARTIAL + stride_pk
    offs = tl.arange(0, BLOCK_N)[None, :]
    if SINGLE_BLOCK:
        col_mask = offs < N
        dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        db = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for row0 in range(row_start, row_end, BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows2 = rows[:, None]
            mask = row_mask[:, None] & col_mask
            mean = tl.zeros([BLOCK_M], dtype=ACC) if IS_RMS_NORM else tl.load(MEAN + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            d, dy, dyn, g = _row_tile_grads(DY + rows2 * N, X + rows2 * stride_xm, MUL + rows2 * stride_mulm, W,
                                            offs, mask, N, mean, mul_offset, IS_RMS_NORM, HAS_W, HAS_MUL, ACC)
            xhat, ds = _tile_input_grads(d, g, rstd, mask, N, IS_RMS_NORM, ACC)
            _store_row_grads(ds, dy, xhat, DX + rows2 * N, DMUL + rows2 * N, W, B, DS + rows2 * N,
                             XG + rows2 * stride_xgm, GATE + rows2 * stride_gm, DXG + rows2 * N, DGATE + rows2 * N,
                             offs, mask, N, HAS_W, HAS_B, STORE_DMUL, HAS_DS, HAS_GATE, STORE_DXG, STORE_DGATE,
                             ACC)
            if STORE_DW:
                dw += dyn * xhat
            if STORE_DB:
                db += dyn
        cols1 = tl.arange(0, BLOCK_N)
        if STORE_DW:
            tl.store(DW_PARTIAL + cols1, tl.sum(dw, axis=0), mask=cols1 < N)
        if STORE_DB:
            tl.store(DB_PARTIAL + cols1, tl.sum(db, axis=0), mask=cols1 < N)
    else:
        # Wide rows, one at a time: one pass for the row sums, one for the gradients. The partial
        # rows are this program's alone (zeroed by the launcher): read-add-write is deterministic.
        for row in range(row_start, row_end):
            rows = row + tl.arange(0, 1)
            rows2 = rows[:, None]
            mean = tl.zeros([1], dtype=ACC) if IS_RMS_NORM else tl.load(MEAN + rows)
            rstd = tl.load(RSTD + rows)
            acc_dg = tl.zeros([1, BLOCK_N], dtype=ACC)
            if not IS_RMS_NORM:
                acc_g = tl.zeros([1, BLOCK_N], dtype=ACC)
                acc_d = tl.zeros([1, BLOCK_N], dtype=ACC)
            for start in range(0, N, BLOCK_N):
                cols = start + offs
                mask = cols < N
                d, dy, dyn, g = _row_tile_grads(DY + rows2 * N, X + rows2 * stride_xm, MUL + rows2 * stride_mulm,
                                                W, cols, mask, N, mean, mul_offset, IS_RMS_NORM, HAS_W, HAS_MUL, ACC)
                acc_dg += d * g
                if not IS_RMS_NORM:
                    acc_g += g
                    acc_d += d
            if IS_RMS_NORM:  # (no accumulators of zeros: at 8192 columns and 16 warps they spilled)
                sum_d = tl.zeros([1], dtype=ACC)
                sum_g = sum_d
            else:
                sum_d, sum_g = tl.sum(acc_d, axis=1), tl.sum(acc_g, axis=1)
            shift, c1, c2 = _row_constants(sum_d, tl.sum(acc_dg, axis=1), sum_g, rstd, N, IS_RMS_NORM, ACC)
            for start in range(0, N, BLOCK_N):
                cols = start + offs
                mask = cols < N
                d, dy, dyn, g = _row_tile_grads(DY + rows2 * N, X + rows2 * stride_xm, MUL + rows2 * stride_mulm,
                                                W, cols, mask, N, mean, mul_offset, IS_RMS_NORM, HAS_W, HAS_MUL, ACC)
                xhat, ds = _xhat_and_ds(d, g, shift, c1, c2, rstd, mask, IS_RMS_NORM)
                _store_row_grads(ds, dy, xhat, DX + rows2 * N, DMUL + rows2 * N, W, B, DS + rows2 * N,
                                 XG + rows2 * stride_xgm, GATE + rows2 * stride_gm, DXG + rows2 * N,
                                 DGATE + rows2 * N, cols, mask, N, HAS_W, HAS_B, STORE_DMUL, HAS_DS, HAS_GATE,
                                 STORE_DXG, STORE_DGATE, ACC)
                if STORE_DW:
                    tl.store(DW_PARTIAL + cols, tl.load(DW_PARTIAL + cols, mask=mask) + dyn * xhat, mask=mask)
                if STORE_DB:
                    tl.store(DB_PARTIAL + cols, tl.load(DB_PARTIAL + cols, mask=mask) + dyn, mask=mask)


_rows_fwd_kernel = CachedKernel(_norm_modulate_rows_fwd_kernel)
_rows_bwd_kernel = CachedKernel(_norm_modulate_rows_bwd_kernel)


def _rows_bwd_configs(n: int) -> list[triton.Config]:
    """layer_norm's backward space without its PREFETCH configs (this kernel has no prefetch)."""
    return [c for c in configs.norm_bwd(n) if not c.kwargs.get("PREFETCH")]


# Tuned as layer_norm's kernels are (one Tuner a kernel, a launch plan per exact call). The
# modulation's rows are two more inputs a tile forward and one more input and output backward.
_ROWS_FWD_KEY_NAMES = ("device", "dtype", "n", "rows", "rms", "mod")
_ROWS_BWD_KEY_NAMES = ("device", "dtype", "n", "rows", "rms", "grads")
_ROWS_FWD_TUNER = Tuner("norm_modulate_rows_fwd", configs.norm_fwd, _ROWS_FWD_KEY_NAMES,
                        prune=configs.prune_norm_fwd)
_ROWS_BWD_TUNER = Tuner("norm_modulate_rows_bwd", _rows_bwd_configs, _ROWS_BWD_KEY_NAMES,
                        prune=configs.prune_norm_bwd)
_ROWS_FWD_PLANS: dict[tuple, tuple] = {}
_ROWS_BWD_PLANS: dict[tuple, tuple] = {}


def _rows_fwd_launch(cfg: triton.Config, m: int, n: int, constexprs: dict, args: tuple) -> None:
    grid, meta = _fwd_plan(cfg, m, n, constexprs)
    _rows_fwd_kernel.run(grid, args, meta)


def _rows_bwd_run(plan: tuple, args: tuple, m: int, n: int, acc: torch.dtype, need_dw: bool, need_db: bool,
                  device: torch.device) -> tuple:
    """The backward kernel, then (where the norm has an affine) the fixed-order sum of its partial
    rows. args: the kernel's arguments before PARTIAL, then those from DS to mul_offset bar M, N,
    rows_per_program and stride_pk."""
    grid, meta, programs, rows_per_program, zero, sum_grid, sum_meta = plan
    sums = need_dw or need_db
    partials = ((torch.zeros if zero else torch.empty)((2, programs, n), dtype=acc, device=device) if sums
                else args[0])
    head, tail = args[:9], args[9:]
    _rows_bwd_kernel.run(grid, (*head, partials, *tail[:-1], m, n, rows_per_program, programs * n, tail[-1]),
                         meta)
    if not sums:
        return None, None
    dw = torch.empty(n, dtype=acc, device=device) if need_dw else None
    db = torch.empty(n, dtype=acc, device=device) if need_db else None
    _sum_partials.run(sum_grid, (partials, partials if dw is None else dw, partials if db is None else db,
                                 partials, programs, n, programs * n), sum_meta)
    return dw, db


def _rows_bwd_launch(cfg: triton.Config, m: int, n: int, sms: int, constexprs: dict, sum_flags: dict,
                     args: tuple, acc: torch.dtype, device: torch.device) -> None:
    _rows_bwd_run(_bwd_plan(cfg, m, n, sms, constexprs, sum_flags), args, m, n, acc, sum_flags["STORE_DW"],
                  sum_flags["STORE_DB"], device)


def _rows_of(t: torch.Tensor, x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """(base, row stride) of t broadcast to x's shape, as (rows, n) with unit stride along n: a
    full-size tensor or a chunk of a wider one in place; a broadcasting one copied."""
    return as_rows(t if t.shape == x.shape else t.expand(x.shape), n)


def _rows_acc(dtype: torch.dtype, mul: torch.Tensor | None, add: torch.Tensor | None) -> torch.dtype:
    """The dtype of the maths and the statistics of a norm of a `dtype` input: fp64 where any input
    is, else fp32."""
    return torch.float64 if torch.float64 in (dtype, _y_dtype(dtype, mul, add)) else torch.float32


def _rows_torch(x, mul, add, weight, bias, eps, is_rms_norm, mul_offset, acc):
    """(y in acc, mean, rstd per row) in PyTorch ops: the path of CPU tensors without Triton, and
    the double backward's differentiable form."""
    h = x.to(acc)
    mean = torch.zeros(h.shape[:-1], dtype=acc, device=x.device) if is_rms_norm else h.mean(-1)
    d = h - mean[..., None]
    rstd = torch.rsqrt(d.pow(2).mean(-1) + eps)
    y = d * rstd[..., None]
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    if mul is not None:
        y = y * (mul.to(acc) + mul_offset)
    if add is not None:
        y = y + add.to(acc)
    return y, mean.reshape(-1), rstd.reshape(-1)


def _rows_sum_torch(x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor | None, s_dtype: torch.dtype,
                    acc: torch.dtype) -> torch.Tensor:
    """s = residual + gate * x in PyTorch ops (differentiable), in acc rounded once to s_dtype, the
    gate broadcasting as it will."""
    h = x.to(acc)
    if gate is not None:
        h = h * gate.to(acc)
    return (h + residual.to(acc)).to(s_dtype)


def _rows_fwd(x, mul, add, weight, bias, eps, is_rms_norm, mul_offset, out_dtype, residual=None, gate=None):
    """(y in out_dtype, mean (empty for RMSNorm), rstd, s) of the per-token modulated norm: mul and
    add broadcastable to x, neither needed full-size (the kernels read a broadcast one as copied).
    With a residual the norm's input is s = residual + gate * x (gate broadcastable to x, or None),
    in the dtype x and the residual promote to; s is None without one."""
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    s_dtype = x.dtype if residual is None else _gated_s_dtype(x, residual)
    acc = _rows_acc(s_dtype, mul, add)
    if m == 0 or not use_triton(x):
        with torch.no_grad():
            s = None if residual is None else _rows_sum_torch(x, residual, gate, s_dtype, acc)
            y, mean, rstd = _rows_torch(x if s is None else s, mul, add, weight, bias, eps, is_rms_norm, mul_offset,
                                        acc)
        return y.to(out_dtype), mean[:0] if is_rms_norm else mean, rstd, s
    y = empty_like(x, out_dtype)
    rstd = torch.empty(m, dtype=acc, device=x.device)
    mean = torch.empty(0 if is_rms_norm else m, dtype=acc, device=x.device)
    x2, stride_x = as_rows(x, n)
    mul2, stride_mul = _rows_of(mul, x, n) if mul is not None else (x2, 0)
    add2, stride_add = _rows_of(add, x, n) if add is not None else (x2, 0)
    s = empty_like(x, s_dtype) if residual is not None else None
    r2, stride_r = _rows_of(residual, x, n) if residual is not None else (x2, 0)
    gate2, stride_gate = _rows_of(gate, x, n) if gate is not None else (x2, 0)
    weight, bias = _flat(weight), _flat(bias)
    args = (x2, mul2, add2, x2 if weight is None else weight, x2 if bias is None else bias, y,
            rstd if is_rms_norm else mean, rstd, r2, gate2, y if s is None else s,
            stride_x, stride_mul, stride_add, stride_r, stride_gate, m, n, eps, float(mul_offset))
    device = x.get_device() if x.is_cuda else -1
    key = (device, x.dtype, y.dtype, tuple(None if t is None else t.dtype for t in (mul, add, weight, bias, residual,
                                                                                    gate)), m, n, is_rms_norm)
    plan = _ROWS_FWD_PLANS.get(key)
    if plan is None:
        constexprs = {"IS_RMS_NORM": is_rms_norm, "HAS_W": weight is not None, "HAS_B": bias is not None,
                      "HAS_MUL": mul is not None, "HAS_ADD": add is not None, "ACC": acc_dtype(acc),
                      "HAS_RESIDUAL": residual is not None, "HAS_GATE": gate is not None}
        mod = "".join(c for c, t in zip("marg", (mul, add, residual, gate)) if t is not None)
        tuning_key = (device, x.dtype, n, pow2_bucket(m), is_rms_norm, mod)
        cfg = _ROWS_FWD_TUNER.config(tuning_key, _rows_fwd_launch, m, n, constexprs, args)
        plan = _fwd_plan(cfg, m, n, constexprs)
        if _ROWS_FWD_TUNER.is_decided(tuning_key):
            store_plan(_ROWS_FWD_PLANS, key, plan)
    _rows_fwd_kernel.run(plan[0], args, plan[1])
    return y, mean, rstd, s


def _rows_bwd_torch(dy, x, mul, weight, bias, eps, is_rms_norm, mul_offset, need, acc):
    """(dx, dmul full-size, dweight, dbias) in acc, None where `need` (x, mul, weight, bias) says
    not: the path of CPU tensors without Triton, and of no rows. Closed-form PyTorch ops, not
    autograd over `_rows_torch`: inside the registered backward op (compiled graphs, function
    modes) the dispatcher is below the Autograd key, where autograd records nothing."""
    n = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    with torch.no_grad():
        h = x.to(acc)
        d = h if is_rms_norm else h - h.mean(-1, keepdim=True)
        rstd = torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps)  # as `_rows_torch` computes them
        xhat = d * rstd
        dz = dy.to(acc) if mul is None else dy.to(acc) * (mul.to(acc) + mul_offset)  # z: the affine's output
        dmul = None
        if need[1]:
            z = xhat if weight is None else xhat * weight.to(acc)
            dmul = dy.to(acc) * (z if bias is None else z + bias.to(acc))
        dw = (dz * xhat).reshape(rows, n).sum(0) if need[2] else None
        db = dz.reshape(rows, n).sum(0) if need[3] else None
        dx = None
        if need[0]:
            g = dz if weight is None else dz * weight.to(acc)
            c1 = (g * xhat).mean(-1, keepdim=True)
            dx = (g - xhat * c1 if is_rms_norm else g - g.mean(-1, keepdim=True) - xhat * c1) * rstd
    return dx, dmul, dw, db


def _rows_bwd(dy, x, mul, weight, bias, mean, rstd, eps, is_rms_norm, mul_offset, needs, dmul_dtype,
              stream=None):
    """(dx in x's dtype, dmul shaped like x in dmul_dtype, dweight, dbias in fp32 / fp64, dx_in,
    dgate), each None where `needs` (x, mul, weight, bias) does not ask for it.

    stream: None, or with a gated sum before the norm (x then the norm's input s)
    (ds, x_in, gate, need_dx_in, dx_in_dtype, need_dgate, dgate_dtype): ds the gradient arriving
    at s (or None); dx is then dresidual (in the dtype of the x given, or as the caller casts it),
    dx_in = ds_total * gate in dx_in_dtype and dgate = ds_total * x_in, full-size, in dgate_dtype."""
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    acc = rstd.dtype
    need_dmul, need_dw, need_db = needs[1] and mul is not None, needs[2] and weight is not None, \
        needs[3] and bias is not None
    ds_in, x_in, gate, need_dxg, dxg_dtype, need_dgate, dgate_dtype = stream or (None,) * 7
    need_dgate = bool(need_dgate) and gate is not None
    if m == 0 or not use_triton(x):
        dx, dmul, dw, db = _rows_bwd_torch(dy, x, mul, weight, bias, eps, is_rms_norm, mul_offset,
                                           (True, need_dmul, need_dw, need_db), acc)
        dxg = dgate = None
        if stream is not None:
            with torch.no_grad():
                if ds_in is not None:
                    dx = dx + ds_in.to(acc)
                if need_dxg:
                    dxg = (dx if gate is None else dx * gate.to(acc)).to(dxg_dtype)
                if need_dgate:
                    dgate = (dx * x_in.to(acc)).to(dgate_dtype)
        return (dx.to(x.dtype) if needs[0] else None, None if dmul is None else dmul.to(dmul_dtype),
                None if dw is None else dw.to(acc), None if db is None else db.to(acc), dxg, dgate)
    dx = empty_like(x)
    dmul = torch.empty(x.shape, dtype=dmul_dtype, device=x.device) if need_dmul else None
    dy2 = dy if dy.is_contiguous() else dy.contiguous()
    x2, stride_x = as_rows(x, n)
    mul2, stride_mul = _rows_of(mul, x, n) if mul is not None else (x2, 0)
    ds2 = x2 if ds_in is None else (ds_in if ds_in.is_contiguous() else ds_in.contiguous())
    xg2, stride_xg = _rows_of(x_in, x, n) if need_dgate else (x2, 0)
    gate2, stride_gate = _rows_of(gate, x, n) if need_dxg and gate is not None else (x2, 0)
    dxg = torch.empty(x.shape, dtype=dxg_dtype, device=x.device) if need_dxg else None
    dgate = torch.empty(x.shape, dtype=dgate_dtype, device=x.device) if need_dgate else None
    weight, bias = _flat(weight), _flat(bias)
    args = (dy2, x2, mul2, x2 if weight is None else weight, x2 if bias is None else bias,
            rstd if is_rms_norm else mean, rstd, dx, dx if dmul is None else dmul,
            ds2, xg2, gate2, dx if dxg is None else dxg, dx if dgate is None else dgate,
            stride_x, stride_mul, stride_xg, stride_gate, float(mul_offset))
    device = x.get_device() if x.is_cuda else -1
    deterministic = torch.are_deterministic_algorithms_enabled()
    stream_key = None if stream is None else (ds_in is not None, None if gate is None else gate.dtype,
                                              dxg_dtype if need_dxg else None, dgate_dtype if need_dgate else None)
    key = (device, x.dtype, dy.dtype, tuple(None if t is None else t.dtype for t in (mul, weight, bias)), dmul_dtype,
           m, n, is_rms_norm, need_dmul, need_dw, need_db, deterministic, stream_key)
    plan = _ROWS_BWD_PLANS.get(key)
    if plan is None:
        sum_flags = {"STORE_DW": need_dw, "STORE_DB": need_db, "STORE_DXB": False}
        constexprs = {"IS_RMS_NORM": is_rms_norm, "HAS_W": weight is not None, "HAS_B": bias is not None,
                      "HAS_MUL": mul is not None, "STORE_DMUL": need_dmul, "STORE_DW": need_dw,
                      "STORE_DB": need_db, "ACC": acc_dtype(acc), "HAS_DS": ds_in is not None,
                      "HAS_GATE": bool(need_dxg) and gate is not None, "STORE_DXG": bool(need_dxg),
                      "STORE_DGATE": need_dgate}
        grads = "".join(c for c, want in zip("mwbsxg", (need_dmul, need_dw, need_db, ds_in is not None, need_dxg,
                                                        need_dgate)) if want)
        tuning_key = (device, x.dtype, n, pow2_bucket(m), is_rms_norm, grads)
        sms = device_sms(x)
        if deterministic:  # the split into partial rows fixed: the same bits in every process
            cfg = _rows_bwd_configs(n)[0]
        else:
            cfg = _ROWS_BWD_TUNER.config(tuning_key, _rows_bwd_launch, m, n, sms, constexprs, sum_flags, args, acc,
                                         x.device)
        plan = _bwd_plan(cfg, m, n, sms, constexprs, sum_flags)
        if deterministic or _ROWS_BWD_TUNER.is_decided(tuning_key):
            store_plan(_ROWS_BWD_PLANS, key, plan)
    dw, db = _rows_bwd_run(plan, args, m, n, acc, need_dw, need_db, x.device)
    return dx if needs[0] else None, dmul, dw, db, dxg, dgate


def _dmul_dtype(mul: torch.Tensor, x: torch.Tensor, acc: torch.dtype) -> torch.dtype:
    """dmul as the kernel writes it: in mul's dtype where mul is full-size, else in fp32 (fp64),
    to be summed down to mul's shape."""
    return mul.dtype if mul.shape == x.shape else acc


def _rows_grads_down(dy, dmul, mul, add_meta):
    """(dmul, dadd) in mul's and add's shapes and dtypes: the full-size gradients summed over
    what each broadcast (PyTorch ops: traceable and differentiable)."""
    if dmul is not None and dmul.shape != mul.shape:
        dmul = dmul.sum_to_size(mul.shape)
    dadd = None
    if add_meta is not None:
        shape, dtype = add_meta
        dadd = cast(_sum_down(dy, shape), dtype)
    return None if dmul is None else cast(dmul, mul.dtype), dadd


def _sum_down(t: torch.Tensor, shape) -> torch.Tensor:
    """t summed to `shape` over what it broadcast (as `sum_to_size`), in fp32 at least: a 16-bit
    gradient (y narrowed for autocast's matmul) is summed as the model's fp32 cast of it was, and
    rounded once by the caller's cast."""
    shape = tuple(shape)
    if tuple(t.shape) == shape:
        return t
    lead = t.dim() - len(shape)
    dims = [*range(lead), *(lead + i for i, n in enumerate(shape) if n == 1 and t.shape[lead + i] != 1)]
    return t.sum(dims, keepdim=True, dtype=torch.promote_types(t.dtype, torch.float32)).reshape(shape)


def _rows_dy(grads, acc):
    """y's gradient: the sum of its views' (fp32 / fp64 when several), or None where none came."""
    present = [g for g in grads if g is not None]
    if len(present) <= 1:
        return present[0] if present else None
    total = present[0].to(acc)
    for g in present[1:]:
        total = total + g
    return total


def _rows_twice(ctx, *grads):
    """The backward in differentiable PyTorch ops (create_graph=True)."""
    x, mul, weight, bias, _, _ = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dy = _rows_dy(grads[:ctx.outputs], ctx.acc)
    if dy is None:
        return (None,) * len(needs)
    dx, dmul, dw, db = reference_grads(
        lambda x, mul, w, b: _rows_torch(x, mul, None, w, b, ctx.eps, ctx.is_rms_norm, ctx.mul_offset, ctx.acc)[0],
        (x, mul, weight, bias), (needs[0], needs[1], needs[3], needs[4]), (dy.to(ctx.acc),))
    dadd = _rows_grads_down(dy, None, mul, ctx.add_meta)[1] if needs[2] else None
    grads_out = (dx, dmul, dadd, dw, db)
    likes = (x, mul, None, weight, bias)
    grads_out = tuple(g if g is None or t is None else g.to(t.dtype) for g, t in zip(grads_out, likes))
    return (*grads_out, *(None,) * (len(needs) - 5))


def _rows_save(ctx, x, mul, add, weight, bias, mean, rstd, eps, is_rms_norm, mul_offset, outputs):
    ctx.save_for_backward(x, mul, weight, bias, mean, rstd)
    ctx.eps, ctx.is_rms_norm, ctx.mul_offset, ctx.outputs, ctx.acc = eps, is_rms_norm, mul_offset, outputs, rstd.dtype
    ctx.add_meta = None if add is None else (add.shape, add.dtype)
    ctx.set_materialize_grads(False)


def _rows_backward_grads(ctx, dy):
    """(dx, dmul, dadd, dweight, dbias) for y's gradient dy, by the kernels (or their registered op
    when `traced`), each None where not needed."""
    x, mul, weight, bias, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    need = (needs[0], needs[1] and mul is not None, needs[3] and weight is not None, needs[4] and bias is not None)
    dmul_dtype = None if mul is None else _dmul_dtype(mul, x, ctx.acc)
    dx, dmul, dw, db = _rows_bwd(dy, x, mul, weight, bias, mean, rstd, ctx.eps, ctx.is_rms_norm, ctx.mul_offset,
                                 need, dmul_dtype)[:4]
    dmul, dadd = _rows_grads_down(dy, dmul, mul, ctx.add_meta if needs[2] else None)
    return (dx, dmul, dadd, None if dw is None else cast(dw, weight.dtype),
            None if db is None else cast(db, bias.dtype))


class _RowsNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mul, add, weight, bias, eps, is_rms_norm, mul_offset, y_dtype, narrowing):
        # narrowing: None, or (out_dtype, readers, full_y) as `layer_norm_modulate` takes them
        out_dtype, readers, full_y = narrowing or (None, 1, False)
        y_out = y_dtype if full_y or out_dtype is None else out_dtype
        y, mean, rstd = _rows_fwd(x, mul, add, weight, bias, eps, is_rms_norm, mul_offset, y_out)[:3]
        # y and its narrowed copy (full_y), or y and a view of it for each reader beyond the first:
        # each view's gradient reaches the backward apart, summed there in fp32
        ys = (y, y.to(out_dtype)) if full_y else (y, *(y.view_as(y) for _ in range(readers - 1)))
        _rows_save(ctx, x, mul, add, weight, bias, mean, rstd, eps, is_rms_norm, mul_offset, len(ys))
        return ys if len(ys) > 1 else y

    @staticmethod
    @single_backward(twice=_rows_twice)
    def backward(ctx, *grads):
        dy = _rows_dy(grads, ctx.acc)
        if dy is None:
            return (None,) * 10
        with profiled("trifuse::norm_modulate_rows_backward"):
            return (*_rows_backward_grads(ctx, dy), *(None,) * 5)


@torch.library.custom_op("trifuse::norm_modulate_rows", mutates_args=())
def _rows_op(x: Tensor, mul: OptTensor, add: OptTensor, weight: OptTensor, bias: OptTensor, eps: float,
             is_rms_norm: bool, mul_offset: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd): the norm of x's last dim, then its affine, then * (mul + mul_offset) + add
    read per row (mul and add broadcastable to x)."""
    return _rows_fwd(x, mul, add, weight, bias, eps, is_rms_norm, mul_offset, out_dtype)[:3]


@torch.library.custom_op("trifuse::norm_modulate_rows_backward", mutates_args=())
def _rows_backward_op(dy: Tensor, x: Tensor, mul: OptTensor, weight: OptTensor, bias: OptTensor, mean: Tensor,
                      rstd: Tensor, eps: float, is_rms_norm: bool, mul_offset: float, need_dmul: bool,
                      need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dmul shaped like x, dweight, dbias in fp32 / fp64); empty where not needed."""
    dmul_dtype = None if mul is None else _dmul_dtype(mul, x, rstd.dtype)
    dx, dmul, dw, db = _rows_bwd(dy, x, mul, weight, bias, mean, rstd, eps, is_rms_norm, mul_offset,
                                 (True, need_dmul, need_dw, need_db), dmul_dtype)[:4]
    # (one empty tensor each: a custom op's outputs must not alias one another)
    return dx, *(x.new_empty(0, dtype=rstd.dtype) if t is None else t for t in (dmul, dw, db))


@_rows_op.register_fake
def _(x, mul, add, weight, bias, eps, is_rms_norm, mul_offset, out_dtype):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    acc = _rows_acc(x.dtype, mul, add)
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(0 if is_rms_norm else rows, dtype=acc),
            x.new_empty(rows, dtype=acc))


@_rows_backward_op.register_fake
def _(dy, x, mul, weight, bias, mean, rstd, eps, is_rms_norm, mul_offset, need_dmul, need_dw, need_db):
    n = x.shape[-1]
    acc = rstd.dtype
    dmul = (x.new_empty(x.shape, dtype=_dmul_dtype(mul, x, acc)) if need_dmul and mul is not None
            else x.new_empty(0, dtype=acc))
    return (x.new_empty(x.shape), dmul, x.new_empty(n if need_dw and weight is not None else 0, dtype=acc),
            x.new_empty(n if need_db and bias is not None else 0, dtype=acc))


def _rows_setup(ctx, inputs, output):
    x, mul, add, weight, bias, eps, is_rms_norm, mul_offset, _ = inputs
    _rows_save(ctx, x, mul, add, weight, bias, output[1], output[2], eps, is_rms_norm, mul_offset, 1)


@single_backward(twice=_rows_twice, op=OP)
def _rows_backward(ctx, dy, *_):
    x, mul, weight, bias, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if dy is None:
        return (None,) * 9
    need_dmul, need_dw, need_db = needs[1] and mul is not None, needs[3] and weight is not None, \
        needs[4] and bias is not None
    dx, dmul, dw, db = torch.ops.trifuse.norm_modulate_rows_backward(
        dy, x, mul, weight, bias, mean, rstd, ctx.eps, ctx.is_rms_norm, ctx.mul_offset, need_dmul, need_dw, need_db)
    dmul, dadd = _rows_grads_down(dy, dmul if need_dmul else None, mul, ctx.add_meta if needs[2] else None)
    return (dx if needs[0] else None, dmul, dadd, dw.to(weight.dtype) if need_dw else None,
            db.to(bias.dtype) if need_db else None, None, None, None, None)


torch.library.register_autograd("trifuse::norm_modulate_rows", _rows_backward, setup_context=_rows_setup)


# The dialect's candidates: the op's arguments, then mul_offset, then the narrowing ones.


def _rows_trifuse(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, mul_offset, out_dtype=None,
                  readers=1, full_y=False):
    """The op's own candidate for a per-token modulation: the row kernels. Checked inputs."""
    y_dtype = _y_dtype(x.dtype, mul, add)
    if eager_fast_path(x, mul, add, weight, bias):
        plain = out_dtype is None and readers == 1 and not full_y
        with profiled(f"trifuse::{OP}"):
            return apply_function(_RowsNormFunction, x, mul, add, weight, bias, eps, is_rms_norm, float(mul_offset),
                                  y_dtype, None if plain else (out_dtype, readers, full_y))
    y = torch.ops.trifuse.norm_modulate_rows(x, mul, add, weight, bias, eps, is_rms_norm, float(mul_offset),
                                             _traced_y_dtype(y_dtype, out_dtype, readers, full_y))[0]
    return _cast_for_readers(y, out_dtype, readers, full_y)


def _with_offset(mul: torch.Tensor | None, mul_offset: float) -> torch.Tensor | None:
    return mul + mul_offset if mul is not None and mul_offset != 0 else mul


def _rows_torch_candidate(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, mul_offset, out_dtype=None,
                          readers=1, full_y=False):
    """PyTorch's norm, product and sum; `mul + mul_offset` in y's dtype, or in a wider out_dtype
    (where the modulation is computed in that dtype, as the kernels compute it)."""
    if mul_offset != 0 and out_dtype is not None and not full_y:
        wide = torch.promote_types(_y_dtype(x.dtype, mul, add), out_dtype)
        mul = cast(mul, torch.promote_types(mul.dtype, wide))
    return _modulate_torch(x, normalized_shape, _with_offset(mul, mul_offset), add, weight, bias, eps, is_rms_norm,
                           out_dtype, readers, full_y)


def _rows_torch_supports(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, mul_offset,
                         *narrowing) -> str | None:
    return _modulate_torch_supports(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm)


def _rows_key(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, mul_offset, *narrowing):
    return _modulate_key(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, *narrowing)


def _rows_dialect_ref(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, mul_offset, *narrowing):
    return _modulate_dialect_ref(x, normalized_shape, _with_offset(mul, mul_offset), add, weight, bias, eps,
                                 is_rms_norm, *narrowing)


# A per-token modulation: the row kernels or PyTorch's norm, product and sum, whichever measured faster.
LAYER_NORM_MODULATE_ROWS = dialects.define(
    "layer_norm_modulate_rows", _rows_key,
    ("device", "dtype", "rows", "n", "mul", "add", "weight", "bias", "rms", "grad", "out"),
    reference=_rows_dialect_ref)
LAYER_NORM_MODULATE_ROWS.register(dialects.Candidate("trifuse", _rows_trifuse))
LAYER_NORM_MODULATE_ROWS.register(
    dialects.Candidate("torch", _rows_torch_candidate, supports=_rows_torch_supports))


# =============================================================================================
# Per token, with the gated residual add before the norm: s = residual + gate * x, y = norm(s) * (mul + offset) + add
# =============================================================================================
#
# The same blocks with a timestep per token (Qwen-Image 2.1's image stream, Helios' frames) add
# the attention's output through a per-token gate, `h = h + gate1 * attn_out` with gate1 (B, S, N),
# and normalize and modulate h per token next. The row kernels take the residual and the gate as
# two more rows read beside x (HAS_RESIDUAL, HAS_GATE), store s once, and normalize s as stored;
# the backward reads s, adds the gradient arriving at s, and writes dresidual = ds, dx = ds * gate
# and dgate = ds * x per element beside dmul: no reduction beyond the norm's affine.

GATED_ROWS_OP = "gated_add_layer_norm_modulate_rows"


def _gated_rows_torch(x, residual, gate, mul, add, weight, bias, eps, is_rms_norm, mul_offset, acc):
    """(y in acc, s) in differentiable PyTorch ops: the double backward's form."""
    s = _rows_sum_torch(x, residual, gate, _gated_s_dtype(x, residual), acc)
    return _rows_torch(s, mul, add, weight, bias, eps, is_rms_norm, mul_offset, acc)[0], s


def _gated_rows_grads(dy, ds, x, residual, gate, s, mul, weight, bias, mean, rstd, eps, is_rms_norm, mul_offset,
                      needs):
    """(dx, dresidual, dgate, dmul, dweight, dbias) as `needs` (x, residual, gate, mul, weight, bias)
    asks, each in its input's dtype and shape (dgate, dmul summed down where they broadcast; dweight,
    dbias in fp32 / fp64); None where not. dy or ds may be None (no gradient reached that output)."""
    acc = rstd.dtype
    if dy is None:
        dy = torch.zeros_like(s)
    need_dx, need_dr, need_dgate = needs[0], needs[1], needs[2] and gate is not None
    dmul_dtype = None if mul is None else _dmul_dtype(mul, s, acc)
    dgate_dtype = None if gate is None else _dmul_dtype(gate, s, acc)
    # without a gate, dx is dresidual: written once where their dtypes agree
    dx_apart = need_dx and (gate is not None or x.dtype != residual.dtype)
    stream = (ds, x, gate, dx_apart, x.dtype, need_dgate, dgate_dtype)
    dr, dmul, dw, db, dx, dgate = _rows_bwd(dy, s, mul, weight, bias, mean, rstd, eps, is_rms_norm, mul_offset,
                                            (True, needs[3], needs[4], needs[5]), dmul_dtype, stream)
    if need_dx and not dx_apart:
        dx = dr
    if dgate is not None and gate.shape != s.shape:
        dgate = dgate.sum_to_size(gate.shape)
    if dmul is not None and dmul.shape != mul.shape:
        dmul = dmul.sum_to_size(mul.shape)
    return (dx if need_dx else None, cast(dr, residual.dtype) if need_dr else None,
            None if dgate is None else cast(dgate, gate.dtype), None if dmul is None else cast(dmul, mul.dtype),
            dw, db)


def _gated_rows_twice(ctx, *grads):
    """The backward in differentiable PyTorch ops (create_graph=True): y's gradient the sum of its
    views' (the first ctx.outputs grads), then s's."""
    x, residual, gate, mul, weight, bias = ctx.saved_tensors[:6]
    needs = ctx.needs_input_grad
    dy = _rows_dy(grads[:ctx.outputs], ctx.acc)
    ds = grads[ctx.outputs]
    if dy is None and ds is None:
        return (None,) * len(needs)
    dx, dr, dg, dmul, dw, db = reference_grads(
        lambda x, r, g, mul, w, b: _gated_rows_torch(x, r, g, mul, None, w, b, ctx.eps, ctx.is_rms_norm,
                                                     ctx.mul_offset, ctx.acc),
        (x, residual, gate, mul, weight, bias), (needs[0], needs[1], needs[2], needs[3], needs[5], needs[6]),
        (None if dy is None else dy.to(ctx.acc), ds))
    dadd = None
    if needs[4] and ctx.add_meta is not None and dy is not None:
        dadd = _rows_grads_down(dy, None, mul, ctx.add_meta)[1]
    grads_out = (dx, dr, dg, dmul, dadd, dw, db)
    likes = (x, residual, gate, mul, None, weight, bias)
    grads_out = tuple(g if g is None or t is None else g.to(t.dtype) for g, t in zip(grads_out, likes))
    return (*grads_out, *(None,) * (len(needs) - 7))


def _gated_rows_save(ctx, x, residual, gate, mul, add, weight, bias, s, mean, rstd, eps, is_rms_norm, mul_offset,
                     outputs):
    # residual is saved for its dtype and the double backward only: the backward reads s
    ctx.save_for_backward(x, residual, gate, mul, weight, bias, s, mean, rstd)
    ctx.eps, ctx.is_rms_norm, ctx.mul_offset, ctx.outputs, ctx.acc = eps, is_rms_norm, mul_offset, outputs, rstd.dtype
    ctx.add_meta = None if add is None else (add.shape, add.dtype)
    ctx.set_materialize_grads(False)


def _gated_rows_backward_grads(ctx, dy, ds):
    """The gradients of the op's tensor inputs (x, residual, gate, mul, add, weight, bias)."""
    x, residual, gate, mul, weight, bias, s, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    need = (needs[0], needs[1], needs[2] and gate is not None, needs[3] and mul is not None,
            needs[5] and weight is not None, needs[6] and bias is not None)
    dx, dr, dg, dmul, dw, db = _gated_rows_grads(dy, ds, x, residual, gate, s, mul, weight, bias, mean, rstd,
                                                 ctx.eps, ctx.is_rms_norm, ctx.mul_offset, need)
    dadd = None
    if needs[4] and ctx.add_meta is not None and dy is not None:
        dadd = _rows_grads_down(dy, None, mul, ctx.add_meta)[1]
    return (dx, dr, dg, dmul, dadd, None if dw is None else cast(dw, weight.dtype),
            None if db is None else cast(db, bias.dtype))


class _GatedRowsNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, gate, mul, add, weight, bias, eps, is_rms_norm, mul_offset, y_dtype, narrowing):
        # narrowing: None, or (out_dtype, readers, full_y) as `gated_add_layer_norm_modulate` takes them
        out_dtype, readers, full_y = narrowing or (None, 1, False)
        y_out = y_dtype if full_y or out_dtype is None else out_dtype
        y, mean, rstd, s = _rows_fwd(x, mul, add, weight, bias, eps, is_rms_norm, mul_offset, y_out, residual, gate)
        ys = (y, y.to(out_dtype)) if full_y else (y, *(y.view_as(y) for _ in range(readers - 1)))
        _gated_rows_save(ctx, x, residual, gate, mul, add, weight, bias, s, mean, rstd, eps, is_rms_norm, mul_offset,
                         len(ys))
        return (*ys, s)

    @staticmethod
    @single_backward(twice=_gated_rows_twice)
    def backward(ctx, *grads):
        dy = _rows_dy(grads[:ctx.outputs], ctx.acc)
        ds = grads[ctx.outputs]
        if dy is None and ds is None:
            return (None,) * 12
        with profiled("trifuse::gated_norm_modulate_rows_backward"):
            return (*_gated_rows_backward_grads(ctx, dy, ds), *(None,) * 5)


@torch.library.custom_op("trifuse::gated_norm_modulate_rows", mutates_args=())
def _gated_rows_op(x: Tensor, residual: Tensor, gate: OptTensor, mul: OptTensor, add: OptTensor, weight: OptTensor,
                   bias: OptTensor, eps: float, is_rms_norm: bool, mul_offset: float,
                   out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, s, mean, rstd): s = residual + gate * x, then the norm of s's last dim, its affine, and
    * (mul + mul_offset) + add read per row (gate, mul and add broadcastable to x)."""
    y, mean, rstd, s = _rows_fwd(x, mul, add, weight, bias, eps, is_rms_norm, mul_offset, out_dtype, residual, gate)
    return y, s, mean, rstd


@torch.library.custom_op("trifuse::gated_norm_modulate_rows_backward", mutates_args=())
def _gated_rows_backward_op(dy: OptTensor, ds: OptTensor, x: Tensor, residual: Tensor, gate: OptTensor, s: Tensor,
                            mul: OptTensor, weight: OptTensor, bias: OptTensor, mean: Tensor, rstd: Tensor,
                            eps: float, is_rms_norm: bool, mul_offset: float, need_dx: bool, need_dr: bool,
                            need_dgate: bool, need_dmul: bool, need_dw: bool,
                            need_db: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dresidual, dgate, dmul in their inputs' shapes and dtypes, dweight, dbias in fp32 /
    fp64); each an empty tensor where not needed."""
    out = _gated_rows_grads(dy, ds, x, residual, gate, s, mul, weight, bias, mean, rstd, eps, is_rms_norm,
                            mul_offset, (need_dx, need_dr, need_dgate, need_dmul, need_dw, need_db))
    # (a custom op's outputs must not alias one another, nor its inputs: dx may be dresidual)
    dx, dr = out[:2]
    if dx is not None and dx is dr:
        dr = dr.clone()
    return tuple(x.new_empty(0, dtype=rstd.dtype) if t is None else t for t in (dx, dr, *out[2:]))


@_gated_rows_op.register_fake
def _(x, residual, gate, mul, add, weight, bias, eps, is_rms_norm, mul_offset, out_dtype):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    s_dtype = _gated_s_dtype(x, residual)
    acc = _rows_acc(s_dtype, mul, add)
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=s_dtype),
            x.new_empty(0 if is_rms_norm else rows, dtype=acc), x.new_empty(rows, dtype=acc))


@_gated_rows_backward_op.register_fake
def _(dy, ds, x, residual, gate, s, mul, weight, bias, mean, rstd, eps, is_rms_norm, mul_offset, need_dx, need_dr,
      need_dgate, need_dmul, need_dw, need_db):
    n = x.shape[-1]
    acc = rstd.dtype

    def like(t, need):
        return t.new_empty(t.shape) if need and t is not None else x.new_empty(0, dtype=acc)

    return (like(x, need_dx), like(residual, need_dr), like(gate, need_dgate), like(mul, need_dmul),
            x.new_empty(n if need_dw and weight is not None else 0, dtype=acc),
            x.new_empty(n if need_db and bias is not None else 0, dtype=acc))


def _gated_rows_setup(ctx, inputs, output):
    x, residual, gate, mul, add, weight, bias, eps, is_rms_norm, mul_offset, _ = inputs
    _, s, mean, rstd = output
    _gated_rows_save(ctx, x, residual, gate, mul, add, weight, bias, s, mean, rstd, eps, is_rms_norm, mul_offset, 1)


@single_backward(twice=_gated_rows_twice, op=GATED_OP)
def _gated_rows_backward(ctx, dy, ds, *_):
    x, residual, gate, mul, weight, bias, s, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if dy is None and ds is None:
        return (None,) * 11
    need = (needs[0], needs[1], needs[2] and gate is not None, needs[3] and mul is not None,
            needs[5] and weight is not None, needs[6] and bias is not None)
    dx, dr, dg, dmul, dw, db = torch.ops.trifuse.gated_norm_modulate_rows_backward(
        dy, ds, x, residual, gate, s, mul, weight, bias, mean, rstd, ctx.eps, ctx.is_rms_norm, ctx.mul_offset, *need)
    # (add's gradient is dy, summed down where add broadcasts; none when no gradient reached y)
    dadd = None
    if needs[4] and ctx.add_meta is not None and dy is not None:
        dadd = _rows_grads_down(dy, None, mul, ctx.add_meta)[1]
    return (dx if need[0] else None, dr if need[1] else None, dg if need[2] else None, dmul if need[3] else None,
            dadd, dw.to(weight.dtype) if need[4] else None, db.to(bias.dtype) if need[5] else None,
            None, None, None, None)


torch.library.register_autograd("trifuse::gated_norm_modulate_rows", _gated_rows_backward,
                                setup_context=_gated_rows_setup)


# The dialect's candidates: the op's arguments, then mul_offset, then the narrowing ones.


def _gated_rows_trifuse(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, mul_offset,
                        out_dtype=None, readers=1, full_y=False):
    """The op's own candidate for a per-token gated add and modulation: the row kernels. Checked inputs."""
    y_dtype = _y_dtype(_gated_s_dtype(x, residual), mul, add)
    if eager_fast_path(x, residual, gate, mul, add, weight, bias):
        plain = out_dtype is None and readers == 1 and not full_y
        with profiled(f"trifuse::{GATED_OP}"):
            return apply_function(_GatedRowsNormFunction, x, residual, gate, mul, add, weight, bias, eps, is_rms_norm,
                                  float(mul_offset), y_dtype, None if plain else (out_dtype, readers, full_y))
    y, s = torch.ops.trifuse.gated_norm_modulate_rows(
        x, residual, gate, mul, add, weight, bias, eps, is_rms_norm, float(mul_offset),
        _traced_y_dtype(y_dtype, out_dtype, readers, full_y))[:2]
    return _ys_then_s(_cast_for_readers(y, out_dtype, readers, full_y), s)


def _gated_rows_torch_candidate(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm,
                                mul_offset, out_dtype=None, readers=1, full_y=False):
    """PyTorch's product and sum as the model writes them, then `layer_norm_modulate_rows`' torch candidate."""
    s = _written_sum(x, residual, gate)
    y = _rows_torch_candidate(s, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, mul_offset, out_dtype,
                              readers, full_y)
    return _ys_then_s(y, s)


def _gated_rows_torch_supports(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm,
                               mul_offset, *narrowing) -> str | None:
    s = x.new_empty(0, dtype=_gated_s_dtype(x, residual))
    return _modulate_torch_supports(s, normalized_shape, mul, add, weight, bias, eps, is_rms_norm)


def _gated_rows_key(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, mul_offset,
                    *narrowing):
    return _gated_key(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, *narrowing)


def _gated_rows_dialect_ref(x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm,
                            mul_offset, *narrowing):
    return _gated_dialect_ref(x, residual, gate, normalized_shape, _with_offset(mul, mul_offset), add, weight, bias,
                              eps, is_rms_norm, *narrowing)


# A per-token gated add and modulation: the row kernels or PyTorch's ops, whichever measured faster.
GATED_ADD_LAYER_NORM_MODULATE_ROWS = dialects.define(
    GATED_ROWS_OP, _gated_rows_key,
    ("device", "dtype", "rows", "n", "mul", "add", "weight", "bias", "rms", "residual", "gate", "grad", "out"),
    reference=_gated_rows_dialect_ref)
GATED_ADD_LAYER_NORM_MODULATE_ROWS.register(dialects.Candidate("trifuse", _gated_rows_trifuse))
GATED_ADD_LAYER_NORM_MODULATE_ROWS.register(
    dialects.Candidate("torch", _gated_rows_torch_candidate, supports=_gated_rows_torch_supports))
