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
at the end of this file.
"""
import math

import torch
import torch.nn.functional as F

from ..autotune import dialects, pow2_bucket
from ._common import (
    apply_function,
    check_float,
    check_same_device,
    check_shape,
    check_tensor,
    eager_fast_path,
    no_autocast,
    outside_device_modes,
    profiled,
    reference_grads,
    single_backward,
    unscoped,
    use_triton,
)
from .layer_norm import (
    _cast_for_readers,
    _check_narrowing,
    _narrowed_key,
    _narrowed_ref,
    _stat_dtype,
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


def _check(op, x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm=False) -> None:
    """A TypeError / ValueError naming the op and the argument, for a call that does not fit."""
    if is_rms_norm and bias is not None:
        raise ValueError(f"trifuse.{op}: RMSNorm has no bias (is_rms_norm=True with a bias given)")
    check_tensor(op, "input", x)
    check_float(op, "input", x)
    n = _width(op, x, normalized_shape)
    for name, t in (("mul", mul), ("add", add)):
        if t is not None:
            check_tensor(op, name, t)
            check_float(op, name, t)
            _check_per_sample(op, name, t, x, n)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(op, name, t)
            check_float(op, name, t)
            check_shape(op, name, t, (n,))
    check_same_device(op, "input", x, mul=mul, add=add, weight=weight, bias=bias)
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"trifuse.{op}: eps must be a non-negative number, got {eps!r}")


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
    empty = x.new_empty(0, dtype=_stat_dtype(x))
    return dx, empty if dw is None else dw, empty if db is None else db


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
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`norm(x) * mul + add` in one pass each way: the adaptive LayerNorm (RMSNorm) of diffusion
    transformers, `F.layer_norm(x, (N,), weight, bias, eps) * (1 + scale[:, None]) + shift[:, None]`
    with mul = 1 + scale[:, None] and add = shift[:, None].

    Args:
        x: (..., N), fp16 / bf16 / fp32 / fp64; any strides.
        normalized_shape: N (the last dim; one dim only).
        mul, add: per-sample vectors or None: broadcastable to x over a leading prefix of its
            dims (equal there), 1 over the other leading dims, last dim N or 1; any float dtype.
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

    Returns:
        y shaped like x, contiguous, in x's dtype promoted with mul's and add's (or as narrowed).
        Gradients reach x, mul, add, weight and bias; the per-sample sums are deterministic.

    Eager calls run trifuse's kernels or PyTorch's norm, product and sum, whichever the
    `layer_norm_modulate` dialect measured faster for this shape on this GPU (on tiny
    activations PyTorch's shorter host path can win); elsewhere, and under torch.compile,
    trifuse's.

    Raises:
        TypeError for non-float tensors; ValueError for shapes, devices or eps that do not fit.
    """
    _check(OP, x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm)
    if out_dtype is None and readers == 1 and not full_y:
        return LAYER_NORM_MODULATE(x, normalized_shape, mul, add, weight, bias, float(eps), is_rms_norm)
    # narrowed: a choice of its own, timed with the casts PyTorch's candidate needs
    _check_narrowing(OP, out_dtype, readers, full_y)
    return LAYER_NORM_MODULATE(x, normalized_shape, mul, add, weight, bias, float(eps), is_rms_norm,
                               out_dtype, readers, full_y)


def _y_dtype(dtype: torch.dtype, mul: torch.Tensor | None, add: torch.Tensor | None) -> torch.dtype:
    """The dtype of `norm(x) * mul + add` as written, the norm in `dtype` (x's, or s's)."""
    out = dtype
    for t in (mul, add):
        if t is not None:
            out = torch.promote_types(out, t.dtype)
    return out


# The candidates take the narrowing arguments (out_dtype, readers, full_y) after the plain ones:
# trifuse's kernels write y in out_dtype, PyTorch's y is cast once per reader.


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
    # traced: the registered op, y in the wider of its dtype and out_dtype, narrowed by a cast after
    # it (which a compiler fuses into the kernel before it)
    wide = y_dtype if out_dtype is None or full_y else torch.promote_types(y_dtype, out_dtype)
    y = torch.ops.trifuse.grouped_norm(x, wg, bg, eps, is_rms_norm, groups, wide)[0]
    return _cast_for_readers(y, out_dtype, readers, full_y)


def _modulate_torch(x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm, out_dtype=None,
                    readers=1, full_y=False):
    """PyTorch's norm, product and sum, in the op's dtypes (autocast, which would run the norm in
    fp32, off: the implementation chosen must not change the output dtype); where the modulation
    or out_dtype is wider than x (Wan's fp32 modulation of a bf16 x; CUDA autocast's fp32 norm
    of a 16-bit x), the norm of x's exact upcast, in that dtype: y is never rounded to x's dtype on
    the way, as the kernels compute it."""
    wide = _y_dtype(x.dtype, mul, add)
    if out_dtype is not None and not full_y:
        wide = torch.promote_types(wide, out_dtype)
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


def _check_gated(op, x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm) -> None:
    """`_check`'s errors for the norm's input s (x's shape and dtype), and those of the residual and
    the gate."""
    _check(op, x, normalized_shape, mul, add, weight, bias, eps, is_rms_norm)
    check_tensor(op, "residual", residual)
    check_float(op, "residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"trifuse.{op}: residual must have the input's shape {list(x.shape)}, "
                         f"got {list(residual.shape)}")
    if gate is not None:
        check_tensor(op, "gate", gate)
        check_float(op, "gate", gate)
        _check_per_sample(op, "gate", gate, x, x.shape[-1])
        # the product and the sum are computed in the accumulation dtype: a gate wider than s (Wan's
        # fp32 gate beside a bf16 stream) is exact up to it, a wider one would lose digits
        acc = torch.float64 if _gated_s_dtype(x, residual) == torch.float64 else torch.float32
        if torch.promote_types(acc, gate.dtype) != acc:
            raise ValueError(f"trifuse.{op}: gate ({gate.dtype}) must be no wider than {acc}, the dtype the "
                             "product and the sum are computed in")
    check_same_device(op, "input", x, residual=residual, gate=gate)


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
    empty = x.new_empty(0, dtype=_stat_dtype(s))
    # a registered op returns no output aliasing another: dresidual may be dx itself
    dr = out[1].clone() if out[1] is out[0] else out[1]
    return out[0], dr, *(empty if v is None else v for v in out[2:])


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
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]:
    """A diffusion transformer's gated residual add and the adaptive norm after it, in one pass
    each way:

        s = residual + gate * x;   y = norm(s) * mul + add;   returns (y, s)

    as DiT's, SD3's, Flux's and PixArt's blocks write `h = h + gate_msa[:, None] * attn_out`
    and then `norm2(h) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]`.

    Args:
        x: (..., N), fp16 / bf16 / fp32 / fp64; any strides.
        residual: shaped like x, any float dtype; s takes the dtype x and residual promote to.
        gate: a per-sample vector as mul and add are (or None: s = residual + x), no wider than
            fp32 (fp64 for fp64 s): the product and the sum are computed in fp32 and rounded once to
            s's dtype, as Wan writes `(h.float() + attn_out * gate).type_as(h)` with an fp32 gate.
        normalized_shape, mul, add, weight, bias, eps, is_rms_norm, out_dtype, readers, full_y:
            as `layer_norm_modulate` takes them, for the norm of s.

    Returns:
        (y, s): y as `layer_norm_modulate` returns it for the input s; s shaped like x,
        contiguous, rounded once (the model rounds the product, then the sum). Gradients reach x,
        residual, gate, mul, add, weight and bias; the per-sample sums are deterministic.

    Eager calls run trifuse's kernels or PyTorch's ops as written, whichever the
    `gated_add_layer_norm_modulate` dialect measured faster for this shape on this GPU; elsewhere,
    and under torch.compile, trifuse's.

    Raises:
        TypeError for non-float tensors; ValueError for shapes, devices or eps that do not fit.
    """
    _check_gated(GATED_OP, x, residual, gate, normalized_shape, mul, add, weight, bias, eps, is_rms_norm)
    args = (x, residual, gate, normalized_shape, mul, add, weight, bias, float(eps), is_rms_norm)
    if out_dtype is None and readers == 1 and not full_y:
        *ys, s = GATED_ADD_LAYER_NORM_MODULATE(*args)
    else:
        _check_narrowing(GATED_OP, out_dtype, readers, full_y)
        *ys, s = GATED_ADD_LAYER_NORM_MODULATE(*args, out_dtype, readers, full_y)
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
    # traced: the registered op, y in the wider of its dtype and out_dtype, narrowed by a cast after it
    wide = y_dtype if out_dtype is None or full_y else torch.promote_types(y_dtype, out_dtype)
    y, s = torch.ops.trifuse.gated_grouped_norm(x, residual, gate_g, wg, bg, eps, is_rms_norm, groups,
                                                wide)[:2]
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
