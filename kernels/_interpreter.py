"""bf16 in Triton's interpreter (TRITON_INTERPRET=1), computed as a GPU computes it.

The interpreter runs kernels on numpy arrays, and numpy has no bf16: it holds bf16 values as
their raw 16 bits and converts them only in a cast to or from fp32. Everything else read the bits
as integers: arithmetic, comparisons, `tl.max` / `tl.min` / `tl.sum`, `tl.dot` on bf16 operands
and casts to any other type; and the fp32 -> bf16 cast truncated where a GPU rounds to nearest
even. A bf16 kernel run there gave wrong answers, silently (seen with Triton 3.6 and 3.9).

`correct_bf16()` makes each of those take its bf16 operands to fp32 (exactly), compute there and
round a bf16 result once to nearest even (toward zero for `fp_downcast_rounding="rtz"`), as a GPU
does for one operation; `tl.dot` accumulates bf16 products in its accumulator's dtype, as tensor
cores do. Loads, stores, `where`, reshapes and bitcasts keep the bits, as before; fp16, fp32 and
every other dtype take Triton's own path untouched. Not corrected: bf16 atomics and scans
(`tl.cumsum`), which no trifuse kernel uses. trifuse calls it when kernels/ is imported
under the interpreter. Should a Triton's interpreter lack the internals it corrects, nothing is
changed, it returns False, and trifuse's ops send bf16 CPU tensors to their PyTorch path
(`_common.use_triton`) rather than run them wrong.
"""
import logging

log = logging.getLogger("trifuse")

# InterpreterBuilder methods given bf16 operands: each computes on fp32 copies and rounds once.
_ELEMENTWISE = ("unary_op", "create_erf", "create_rsqrt", "create_fma", "create_clampf")
_CORRECTED = ("binary_op", *_ELEMENTWISE, "create_dot", "cast_impl", "create_fp_to_fp")

_corrected: bool | None = None  # None: not tried yet


def correct_bf16() -> bool:
    """Make Triton's interpreter compute bf16 as a GPU does (see the module docstring). Idempotent.

    Returns:
        True when bf16 is computed right (corrected now or before), False when this Triton's
        interpreter lacks the internals the correction needs (then nothing was changed).
    """
    global _corrected
    if _corrected is None:
        _corrected = _install()
        if not _corrected:
            log.debug("Triton's interpreter left as it is: bf16 CPU tensors take the PyTorch path")
    return _corrected


def _install() -> bool:
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder_type = getattr(interpreter, "InterpreterBuilder", None)
    handle_type = getattr(interpreter, "TensorHandle", None)
    reduce_type = getattr(interpreter, "ReduceOps", None)
    if builder_type is None or handle_type is None or reduce_type is None:
        return False
    if not all(hasattr(builder_type, name) for name in (*_CORRECTED, "get_fp32")):
        return False
    if not all(hasattr(reduce_type, name) for name in ("min_max", "sum", "to_tensor")):
        return False
    if hasattr(builder_type.binary_op, "__wrapped__"):
        return True  # corrected already (another copy of this module)

    bf16, fp32 = tl.bfloat16, tl.float32
    comparisons = {np.less, np.less_equal, np.greater, np.greater_equal, np.equal, np.not_equal}
    rounding_modes = getattr(getattr(interpreter, "_ir", None), "ROUNDING_MODE", None)
    rtz = getattr(rounding_modes, "RTZ", object())

    bits_dtype = np.dtype(np.uint16)  # what bf16 values are held in (uint16 too: checked second)

    def is_bf16(handle) -> bool:
        return handle.data.dtype is bits_dtype and handle.dtype.scalar == bf16

    def to_fp32(bits) -> np.ndarray:  # exact: bf16 is fp32's top half
        return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)

    def to_bf16(values, truncate: bool = False) -> np.ndarray:
        values = np.asarray(values, dtype=np.float32)
        bits = values.view(np.uint32).astype(np.uint64)
        if not truncate:  # to nearest, ties to even; a carry moves the exponent (to inf on overflow)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).astype(np.uint16)
        nan = np.isnan(values)
        if nan.any():  # stays NaN (quiet), whatever its payload
            out = np.where(nan, (values.view(np.uint32) >> 16).astype(np.uint16) | 0x0040, out)
        return out

    def up(handle):
        return handle_type(to_fp32(handle.data), fp32) if is_bf16(handle) else handle

    def down(handle, truncate: bool = False):
        return handle_type(to_bf16(handle.data, truncate), bf16)

    def binary(original):
        def binary_op(self, lhs, rhs, op):
            if not (is_bf16(lhs) or is_bf16(rhs)):
                return original(self, lhs, rhs, op)
            out = original(self, up(lhs), up(rhs), op)
            return out if op in comparisons else down(out)
        return binary_op

    def elementwise(original):  # every tensor argument a value of the result's dtype
        def op(self, *args):
            if not any(isinstance(a, handle_type) and is_bf16(a) for a in args):
                return original(self, *args)
            return down(original(self, *(up(a) if isinstance(a, handle_type) else a for a in args)))
        return op

    def dot(original):
        def create_dot(self, a, b, d, *args):
            if not (is_bf16(a) or is_bf16(b) or is_bf16(d)):
                return original(self, a, b, d, *args)
            out = original(self, up(a), up(b), up(d), *args)
            return down(out) if is_bf16(d) else out
        return create_dot

    def cast(original):
        def cast_impl(self, src, dst_type):
            to = dst_type.scalar
            if is_bf16(src) and to != bf16:
                return up(src) if to == fp32 else original(self, up(src), dst_type)
            if to == bf16 and not is_bf16(src):
                return down(src if src.dtype.scalar == fp32 else original(self, src, fp32))
            return original(self, src, dst_type)
        return cast_impl

    def fp_to_fp(original):
        def create_fp_to_fp(self, src, dst_type, rounding_mode):
            to = dst_type.scalar
            if to == bf16 and src.dtype.scalar == fp32:
                return down(src, truncate=rounding_mode == rtz)
            if is_bf16(src) and to == fp32:
                return up(src)
            return original(self, src, dst_type, rounding_mode)
        return create_fp_to_fp

    def min_max(original):
        def bf16_min_max(self, input, val_reduce_op, idx_reduce_op=None):
            value = input[0] if isinstance(input, tuple) else input
            if value.dtype.scalar != bf16 or not (val_reduce_op or idx_reduce_op):
                return original(self, input, val_reduce_op, idx_reduce_op)
            data, where = to_fp32(value.handle.data), {"axis": self.axis, "keepdims": self.keep_dims}
            found = []
            if val_reduce_op:  # a bf16 value: exact
                found.append(self.to_tensor(to_bf16(val_reduce_op(data, **where)), bf16))
            if idx_reduce_op:
                found.append(self.to_tensor(idx_reduce_op(data, **where), tl.int32))
            return tuple(found) if len(found) == 2 else found[0]
        return bf16_min_max

    def total(original):
        def bf16_sum(self, input):  # in fp32, rounded once (a GPU's tree rounds on the way)
            if input.dtype.scalar != bf16:
                return original(self, input)
            sums = np.sum(to_fp32(input.handle.data), axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(to_bf16(sums), bf16)
        return bf16_sum

    def wrap(owner, name, make) -> None:
        original = getattr(owner, name)
        patched = make(original)
        patched.__wrapped__ = original
        setattr(owner, name, patched)

    for name in _ELEMENTWISE:
        wrap(builder_type, name, elementwise)
    wrap(builder_type, "create_dot", dot)
    wrap(builder_type, "cast_impl", cast)
    wrap(builder_type, "create_fp_to_fp", fp_to_fp)
    wrap(reduce_type, "min_max", min_max)
    wrap(reduce_type, "sum", total)
    if not hasattr(builder_type, "get_bf16"):  # Triton 3.6: a bf16 constant (`other=0.0` of a bf16 load)
        builder_type.get_bf16 = lambda self, value: down(self.get_fp32(value))
    wrap(builder_type, "binary_op", binary)  # last: its __wrapped__ marks the whole as installed
    return True
