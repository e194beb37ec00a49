"""One canonical form for every graph the rewriter sees, so each pattern is written once.

fx's `symbolic_trace` and TorchDynamo spell the same model differently (STYLE.md facts 1-3):
fx keeps `nn.Linear`/`nn.LayerNorm`/... as `call_module` nodes and methods as `call_method`,
Dynamo inlines modules into functional calls with parameters as placeholders; both keep whatever
mix of positional and keyword arguments the source used, and omit defaults. `canonicalize`
rewrites, in place:

- `call_module` of modules whose maths does not depend on `.training` (Linear, LayerNorm,
  RMSNorm, GELU, SiLU, ReLU, Softmax, Identity, CrossEntropyLoss) into their functional call, parameters as `get_attr`.
  `nn.Dropout` becomes `F.dropout(x, p, training=<the module's flag now>)`: only for graphs that
  are specialized to the module tree's training flags (fx captures are keyed on them; see
  capture.py), never otherwise. A module with hooks stays a module call (its hooks must run).
- functions and methods with one meaning into one target: `x.tanh()`/`torch.tanh(x)` ->
  `torch.tanh(x)`, `torch.add(a, b)`/`a.add(b)` -> `a + b`, `x ** 2` -> `torch.pow(x, 2)`,
  `F.softmax` -> `torch.softmax`, `F.relu(x)` / `x.relu()` -> `torch.relu(x)` (not the in-place
  `F.relu(x, inplace=True)`), `torch.layer_norm` -> `F.layer_norm`, `torch.special.erf` ->
  `torch.erf` (and `expit` -> `torch.sigmoid`), `torch.concat` ->
  `torch.cat(tensors, dim)` (and `torch.stack(tensors, dim)`), `x.logsumexp(dim=-1)` -> `torch.logsumexp(x, -1, False)`,
  `x.float()` -> `x.to(torch.float32)`, `a @ b` -> `torch.matmul(a, b)`, `x.square()` and
  (x floating point) `x * x` -> `torch.pow(x, 2)`, `x.var(-1, unbiased=False)` and the other
  overloads of `var`/`var_mean` -> `torch.var(x, -1, correction=0, keepdim=False)`,
  `x.sum(-1, keepdim=True)` -> `torch.sum(x, -1, True, dtype=None)`, the 2-norm over one dim
  (`x.norm(dim=-1)`, `torch.norm(x, 2, -1)`, `torch.linalg.norm(x, dim=-1)`) ->
  `torch.linalg.vector_norm(x, 2, -1, False, dtype=None)`, a clamp from below alone
  (`x.clamp(min=e)`, `torch.clamp(x, e)`, `x.clip(min=e)`, `x.clamp_min(e)`) -> `torch.clamp_min(x, e)`,
  `x.unsqueeze(d)`/`torch.unsqueeze(x, dim=d)`/`x[:, :, None]` (whole slices and one None) ->
  `torch.unsqueeze(x, d)`, ...
- the fields of a (values, indices) result as indices, as Dynamo writes them:
  `x.max(dim=-1, keepdim=True).values` -> `x.max(dim=-1, keepdim=True)[0]`.
- arguments into one layout: positional parameters positional, keyword-only ones as keywords,
  every default spelled out (`F.gelu(x)` -> `F.gelu(x, approximate='none')`);
  `x.view(a, b)` -> `x.view((a, b))`; `x.transpose(2, 1)` -> `x.transpose(1, 2)`.
- with example values known (fx graphs after shape propagation), `x.dtype` becomes a constant
  and `y.type_as(x)` becomes `y.to(<x's dtype>)`.
- `a += b` (also -=, *=, /=) on a fresh intermediate that nothing else reads -> `a + b`, where
  the result keeps a's shape (MPNet's `attention_scores += position_bias`); `(a + b).to(a.dtype)`
  where the sum promotes (16-bit scores and an fp32 bias under autocast: what the update stores); and
  `a.masked_fill_(mask, v)` on a fresh intermediate read only after it -> `a.masked_fill(mask, v)`
  (ldm's CrossAttention), its later readers reading the filled tensor; likewise an in-place
  `F.dropout(a, p, training, True)` of a fresh softmax (timm's TNT) -> the out-of-place dropout.
- fresh scores updated in place through a slice past a class token's row and column (or through
  a whole slice), `s[:, :, 1:, 1:] = (s[:, :, 1:, 1:].view(...) + rel_h + rel_w).view(...)` (timm's
  MViT V2) or `s[:, :, 1:, 1:] += rel_pos` (torchvision's MViT), nothing else reading s before ->
  `s + F.pad(<the added terms' sum>, (1, 0, 1, 0))`, which the attention patterns take as a mask
  (the one change of rounding: timm's two terms are summed before the scores).
- `out = torch.empty_like(x); out[..., 0::2] = a; out[..., 1::2] = b`, out read by nothing
  before both writes (Wan's rotary) -> `torch.stack([a, b], -1).flatten(-2)`, each half cast to
  out's dtype where the write would cast it.
- `(s.view(shape) + a + b).view(<s's shape>)`, a + b of the view's shape (SAM's and ViTDet's
  decomposed relative positions, segment-anything's and detectron2's spelling; transformers'
  SegGPT and VitDet) -> `s + (a + b).reshape(<s's shape>)`, a mask the attention patterns take
  (as for MViT's, the two terms summed before the scores).
- `y.expand_as(x)` -> `y.expand(<x's shape>)` (likewise `view_as`, `reshape_as`) in Dynamo graphs,
  where x's shape is static (guarded).
- `torch.softmax(x.to(dtype), dim)` -> `torch.softmax(x, dim, dtype)` (softmax casts its input to
  its dtype argument first: `softmax(scores.float(), dim=-1)` and the dtype form are one spelling);
  and, with example values, `torch.softmax(x, dim, <x's dtype>)` -> `torch.softmax(x, dim)`
  (Falcon's `dtype=hidden_states.dtype`), except where the result is cast (Llama's
  `softmax(x, dtype=float32).to(q.dtype)` keeps the upcast spelling its patterns name).
- the same cast of one value written twice (`q.float() * cos + rotate_half(q.float()) * sin`,
  ModernBERT's rotary) becomes one cast read by both, unless something writes to either in place.
- `torch.baddbmm(torch.zeros(...), a, b, beta=β, alpha=α)` -> `torch.bmm(a, b) * α` (GPT-NeoX-
  Japanese's scores: β times zeros adds nothing), the zeros read by nothing else.
- a two-operand `torch.einsum` that is a batched matrix product (`"bhid,bhjd->bhij"`, spaces and
  a leading `...` allowed) -> `torch.matmul`, the second operand transposed where the equation
  contracts its last dim.
- a view there and back, `x.view(s).view(<x's shape>)`, -> `x`, where example values give the shapes.
- an attention mask computed from literals alone (transformers' causal mask under torch.compile)
  that keeps every score -> no mask; one that keeps SDPA's causal pattern -> `is_causal=True`
  (`constant_masks`).

Nothing here changes what the graph computes (up to the rounding of sums noted above).
"""
import contextlib
import functools
import inspect
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch.nn.modules import module as _nn_module

from ..patterns._base import known_equal, same_shape
from .dtensor_calls import open_closures


# Signatures for builtins (inspect cannot read them); only their names and defaults matter.
def _sig_linear(input, weight, bias=None): ...
def _sig_gelu(input, *, approximate="none"): ...
def _sig_addmm(input, mat1, mat2, *, beta=1, alpha=1): ...
def _sig_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
              enable_gqa=False): ...
def _sig_softmax(input, dim, dtype=None): ...
def _sig_f_softmax(input, dim=None, _stacklevel=3, dtype=None): ...
def _sig_mean(input, dim=None, keepdim=False, *, dtype=None): ...
def _sig_sum(input, dim=None, keepdim=False, *, dtype=None): ...
def _sig_torch_norm(input, p="fro", dim=None, keepdim=False, out=None, dtype=None): ...
def _sig_linalg_norm(input, ord=None, dim=None, keepdim=False, *, out=None, dtype=None): ...
def _sig_vector_norm(input, ord=2, dim=None, keepdim=False, *, dtype=None, out=None): ...
def _sig_binary(input, other): ...
def _sig_pow(input, exponent): ...
def _sig_unary(input): ...
def _sig_where(condition, input, other): ...
def _sig_masked_fill(input, mask, value): ...
def _sig_torch_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True): ...
def _sig_torch_rms_norm(input, normalized_shape, weight=None, eps=None): ...
def _sig_torch_group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True): ...
def _sig_torch_dropout(input, p, train): ...
def _sig_add(input, other, *, alpha=1): ...
def _sig_div(input, other, *, rounding_mode=None): ...
def _sig_repeat_interleave(input, repeats, dim=None, *, output_size=None): ...
def _sig_cat(tensors, dim=0): ...
def _sig_stack(tensors, dim=0): ...
def _sig_logsumexp(input, dim, keepdim=False): ...
def _sig_unsqueeze(input, dim): ...
def _sig_clamp(input, min=None, max=None): ...
def _sig_clamp_min(input, min): ...
def _sig_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                       reduction="mean", label_smoothing=0.0): ...


_UNARY = ("tanh", "erf", "rsqrt", "sqrt", "exp", "sigmoid", "neg", "relu", "square", "logical_not")

# target -> (canonical target, signature to bind against, or None for the target's own)
_FUNCTIONS: dict[Any, tuple[Callable[..., Any], Callable[..., Any] | None]] = {
    F.linear: (F.linear, _sig_linear),
    F.gelu: (F.gelu, _sig_gelu),
    torch.addmm: (torch.addmm, _sig_addmm),
    torch.mm: (torch.mm, _sig_binary),
    torch.matmul: (torch.matmul, _sig_binary),
    operator.matmul: (torch.matmul, _sig_binary),
    F.scaled_dot_product_attention: (F.scaled_dot_product_attention, _sig_sdpa),
    F.layer_norm: (F.layer_norm, None),
    torch.layer_norm: (F.layer_norm, _sig_torch_layer_norm),
    F.group_norm: (F.group_norm, None),
    torch.group_norm: (F.group_norm, _sig_torch_group_norm),
    F.dropout: (F.dropout, None),
    torch.dropout: (F.dropout, _sig_torch_dropout),
    F.softmax: (torch.softmax, _sig_f_softmax),
    torch.softmax: (torch.softmax, _sig_softmax),
    torch.mean: (torch.mean, _sig_mean),
    torch.sum: (torch.sum, _sig_sum),
    torch.pow: (torch.pow, _sig_pow),
    operator.pow: (torch.pow, _sig_pow),
    torch.where: (torch.where, _sig_where),
    torch.add: (operator.add, _sig_add),
    torch.mul: (operator.mul, _sig_binary),
    torch.sub: (operator.sub, _sig_add),
    torch.div: (operator.truediv, _sig_div),
    torch.repeat_interleave: (torch.repeat_interleave, _sig_repeat_interleave),
    F.cross_entropy: (F.cross_entropy, _sig_cross_entropy),
    torch.cat: (torch.cat, _sig_cat),
    torch.concat: (torch.cat, _sig_cat),
    torch.stack: (torch.stack, _sig_stack),
    torch.logsumexp: (torch.logsumexp, _sig_logsumexp),
    torch.unsqueeze: (torch.unsqueeze, _sig_unsqueeze),
    torch.clamp: (torch.clamp_min, _sig_clamp),  # with no max (_MUST_BE), else as written
    torch.clip: (torch.clamp_min, _sig_clamp),
    torch.clamp_min: (torch.clamp_min, _sig_clamp_min),
    **{getattr(torch, name): (getattr(torch, name), _sig_unary) for name in _UNARY},
    torch.special.erf: (torch.erf, _sig_unary),  # aliases of one function
    torch.special.expit: (torch.sigmoid, _sig_unary),
}
if hasattr(F, "rms_norm"):
    _FUNCTIONS[F.rms_norm] = (F.rms_norm, None)
if hasattr(torch, "rms_norm"):
    _FUNCTIONS[torch.rms_norm] = (F.rms_norm, _sig_torch_rms_norm)

# method name -> (canonical function target, signature with `self` as the first parameter)
_METHODS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "add": (operator.add, _sig_add),
    "mul": (operator.mul, _sig_binary),
    "sub": (operator.sub, _sig_add),
    "div": (operator.truediv, _sig_div),
    "pow": (torch.pow, _sig_pow),
    "mean": (torch.mean, _sig_mean),
    "sum": (torch.sum, _sig_sum),
    "softmax": (torch.softmax, _sig_softmax),
    "matmul": (torch.matmul, _sig_binary),
    "repeat_interleave": (torch.repeat_interleave, _sig_repeat_interleave),
    "logsumexp": (torch.logsumexp, _sig_logsumexp),
    "unsqueeze": (torch.unsqueeze, _sig_unsqueeze),
    "clamp": (torch.clamp_min, _sig_clamp),
    "clip": (torch.clamp_min, _sig_clamp),
    "clamp_min": (torch.clamp_min, _sig_clamp_min),
    **{name: (getattr(torch, name), _sig_unary) for name in _UNARY},
}

# Canonical spellings that drop an argument: (argument, value it must have, or _ANY).
_ANY = object()
_MUST_BE = {
    (torch.softmax, "_stacklevel"): _ANY,
    (operator.add, "alpha"): 1,
    (operator.sub, "alpha"): 1,
    (operator.truediv, "rounding_mode"): None,
    (F.layer_norm, "cudnn_enable"): True,
    (F.group_norm, "cudnn_enabled"): True,
    (torch.clamp_min, "max"): None,
}

_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                 "double": torch.float64}


def canonicalize(gm: fx.GraphModule, root: torch.nn.Module | None = None) -> fx.GraphModule:
    """Rewrites `gm`'s graph into the canonical form above, in place, and recompiles it.

    `root` is the module the graph was traced from (fx graphs); module calls are resolved in it.
    """
    canonicalize_graph(gm.graph, root)
    gm.recompile()
    return gm


def canonicalize_graph(graph: fx.Graph, root: torch.nn.Module | None = None) -> None:
    open_closures(graph)
    for node in list(graph.nodes):
        if node.op == "call_module" and root is not None:
            _module_to_function(graph, node, root)
        elif node.op == "call_method":
            _method(node)
        elif node.op == "call_function":
            canonicalize_node(node)
    _fold_dtypes(graph)
    _merge_repeated_casts(graph)
    _einsum_as_matmul(graph)
    _baddbmm_over_zeros(graph)
    _static_shapes_as(graph)
    _out_of_place_updates(graph)
    _slice_updates_of_scores(graph)
    _interleaved_writes(graph)
    _softmax_of_casts(graph)
    _window_mask_views(graph)
    _terms_over_a_view_of_the_scores(graph)
    _view_round_trips(graph)
    constant_masks(graph)


# Reductions whose dim form returns a (values, indices) named tuple; fx keeps `.values` as getattr.
_VALUES_INDICES = ("max", "min", "sort", "topk", "kthvalue", "median", "mode", "cummax", "cummin")
_FIELDS = {"values": 0, "indices": 1}


def _values_indices_field(node: fx.Node) -> int | None:
    """For `r.values` / `r.indices` of such a reduction r, the field's index; else None."""
    if node.target is not getattr or len(node.args) != 2 or node.args[1] not in _FIELDS:
        return None
    r = node.args[0]
    if not isinstance(r, fx.Node) or r.op not in ("call_method", "call_function"):
        return None
    name = r.target if r.op == "call_method" else getattr(r.target, "__name__", None)
    return _FIELDS[node.args[1]] if name in _VALUES_INDICES else None


def canonicalize_node(node: fx.Node) -> None:
    """Canonical target and argument layout for one call_function node (no-op for others)."""
    if node.op != "call_function":
        return
    field = _values_indices_field(node)
    if field is not None:
        node.target, node.args = operator.getitem, (node.args[0], field)
        return
    if node.target is operator.getitem and len(node.args) == 2 and not node.kwargs:
        dim = _unsqueeze_index(node.args[1])
        if dim is not None:
            node.target, node.args = torch.unsqueeze, (node.args[0], dim)
            return
    if node.target is operator.pow and _numbers_only(node):
        return  # `head_dim ** 0.5` of a symbolic size: Python arithmetic, which torch.pow refuses
    if node.target in _VARIANCES:
        _variance(node)
        return
    if _hashable(node.target) and node.target in _NORMS:
        _vector_norm(node, *_NORMS[node.target])
        return
    if _squares(node):
        node.target, node.args, node.kwargs = torch.pow, (node.args[0], 2), {}
        return
    entry = _FUNCTIONS.get(node.target) if _hashable(node.target) else None
    if entry is not None:
        target, sig = entry
        _bind(node, target, sig if sig is not None else node.target, aliases=sig is not None)
    elif _is_python_function(node.target):
        _bind(node, node.target, node.target)
        if node.target is F.relu and len(node.args) == 2 and node.args[1] is False:
            node.target, node.args = torch.relu, node.args[:1]  # one spelling of an out-of-place ReLU


_ARITHMETIC = frozenset((operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
                         operator.pow, operator.mod, operator.neg, len))


def _self_product(node: fx.Node) -> bool:
    """`x * x` of one graph value that is not a number."""
    return node.target is operator.mul and len(node.args) == 2 and not node.kwargs \
        and isinstance(node.args[0], fx.Node) and node.args[0] is node.args[1] and not _numbers_only(node)


def _squares(node: fx.Node) -> bool:
    """`torch.square(x)` and, for a floating-point x, `x * x`: ATen computes both as `pow(x, 2)`
    does, one rounding of x * x."""
    if node.target is torch.square:
        return len(node.args) == 1 and not node.kwargs
    if not _self_product(node):
        return False
    x = node.args[0]
    value = x.meta.get("val", x.meta.get("example_value"))
    return isinstance(value, torch.Tensor) and value.is_floating_point()  # bool * bool is no power


def squares_as_powers(graph: fx.Graph) -> None:
    """Every `x * x` as `pow(x, 2)`, x's dtype unknown: for a throwaway copy of a graph without
    example values that is only searched for where patterns could match (fuse.py), never run."""
    for node in graph.nodes:
        if node.op == "call_function" and _self_product(node):
            node.target, node.args, node.kwargs = torch.pow, (node.args[0], 2), {}


_VARIANCES = (torch.var, torch.var_mean)


def _variance(node: fx.Node) -> None:
    """`torch.var`/`torch.var_mean` (and the `var` method) in their overloads, `(x, unbiased)`,
    `(x, dim, unbiased, keepdim)`, `(x, dim, *, correction, keepdim)`, as one:
    `(x, dim, correction=c, keepdim=k)`, c a number and a one-entry dim list its entry. A call
    that fits none of them stays as written."""
    args, kwargs = list(node.args), _numpy_names(node.kwargs)
    if not args or not set(kwargs) <= {"dim", "unbiased", "correction", "keepdim"}:
        return
    x, rest = args[0], args[1:]
    if rest and isinstance(rest[0], bool):  # var(x, unbiased)
        if len(rest) > 1 or "unbiased" in kwargs or "correction" in kwargs:
            return
        kwargs["unbiased"], rest = rest[0], []
    names = ("dim", "unbiased", "keepdim")
    if len(rest) > len(names) or any(n in kwargs for n in names[:len(rest)]):
        return
    kwargs.update(zip(names, rest))
    unbiased, correction = kwargs.get("unbiased"), kwargs.get("correction")
    if unbiased is not None and correction is not None:
        return
    if isinstance(unbiased, bool):
        correction = int(unbiased)
    elif unbiased is not None or not (correction is None or isinstance(correction, (int, float))):
        return
    dim = kwargs.get("dim")
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    keepdim = kwargs.get("keepdim", False)
    node.args = (x, dim)
    node.kwargs = {"correction": 1 if correction is None else correction, "keepdim": keepdim}


# The norms that are the 2-norm over given dims for some orders: (signature, the order's name).
_NORMS = {torch.norm: (_sig_torch_norm, "p"), torch.linalg.norm: (_sig_linalg_norm, "ord"),
          torch.linalg.vector_norm: (_sig_vector_norm, "ord")}


def _vector_norm(node: fx.Node, sig: Callable[..., Any], order: str) -> None:
    """The 2-norm over one dim, `x.norm(dim=-1, keepdim=True)`, `torch.norm(x, 2, -1)`,
    `torch.linalg.norm(x, dim=[-1])`, `torch.linalg.vector_norm(x, ord=2, dim=-1)`, as one:
    `torch.linalg.vector_norm(x, 2, dim, keepdim, dtype=dtype)`, dim one dim (what `torch.norm`
    calls for "fro" and numbers, and `torch.linalg.norm` for one dim). Any other call (another
    order, several dims or none, an `out`) stays as written."""
    try:
        bound = inspect.signature(sig).bind(*node.args, **_numpy_names(node.kwargs))
    except (TypeError, ValueError):
        return
    bound.apply_defaults()
    a = bound.arguments
    p, dim = a[order], a["dim"]
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    two = (p is None and sig is _sig_linalg_norm) or (p == "fro" and sig is _sig_torch_norm) or \
        (type(p) in (int, float) and p == 2)
    # (dim a node: a pattern's wildcard, or a number the graph computes)
    if not two or not (type(dim) is int or isinstance(dim, fx.Node)) or a["out"] is not None \
            or type(a["keepdim"]) is not bool:
        return
    node.op, node.target = "call_function", torch.linalg.vector_norm
    node.args, node.kwargs = (a["input"], 2, dim, a["keepdim"]), {"dtype": a["dtype"]}


def _numbers_only(node: fx.Node) -> bool:
    """Whether every operand of a Python operator's call is a number (`_is_number`)."""
    return all(_is_number(a) for a in (*node.args, *node.kwargs.values()))


def _is_number(a: Any, depth: int = 8) -> bool:
    """A constant, or a node computing a number: Dynamo's recorded value is a SymInt, a SymFloat
    or a number; or (fx graphs record none) an entry of a shape (`x.shape[-1]`, `x.size(-1)`),
    `x.dim()`, `x.numel()`, or arithmetic on such numbers (`head_dim ** -0.5`)."""
    if not isinstance(a, fx.Node):
        return isinstance(a, (int, float, bool)) or a is None
    value = a.meta.get("val", a.meta.get("example_value"))
    if value is not None:
        return not isinstance(value, torch.Tensor)
    if depth == 0:
        return False
    if a.op == "call_method" and a.target in ("dim", "numel"):
        return True
    if a.op == "call_method" and a.target == "size":
        return len(a.args) > 1 or "dim" in a.kwargs
    if a.op == "call_function" and a.target is operator.getitem and isinstance(a.args[0], fx.Node):
        shape = a.args[0]
        return (shape.op == "call_function" and shape.target is getattr and shape.args[1] == "shape") or \
            (shape.op == "call_method" and shape.target == "size" and len(shape.args) == 1)
    if a.op == "call_function" and _hashable(a.target) and a.target in _ARITHMETIC:
        return all(_is_number(x, depth - 1) for x in (*a.args, *a.kwargs.values()))
    return False


def _unsqueeze_index(index: Any) -> int | None:
    """The dim of the unsqueeze an index is (`x[:, :, None]` -> 2, `x[..., None, :]` -> -2,
    `x[None]` -> 0): whole slices, at most one Ellipsis and exactly one None; else None."""
    entries = index if isinstance(index, tuple) else (index,)
    whole = slice(None, None, None)
    if sum(e is None for e in entries) != 1 or sum(e is Ellipsis for e in entries) > 1 \
            or any(not (e is None or e is Ellipsis or (isinstance(e, slice) and e == whole)) for e in entries):
        return None
    at = next(i for i, e in enumerate(entries) if e is None)
    if Ellipsis in entries[:at]:
        return at - len(entries)  # counted from the end
    return at


def _method(node: fx.Node) -> None:
    name = node.target
    if name == "var":
        node.op, node.target = "call_function", torch.var
        _variance(node)
    elif name == "norm":
        _vector_norm(node, _sig_torch_norm, "p")
    elif name in _METHODS:
        target, sig = _METHODS[name]
        # Only a call that binds becomes the function: `x.div(k, rounding_mode="trunc")` stays the
        # method (operator.truediv has no rounding mode; fx would emit `x / k`, a float result).
        if _bind(node, target, sig, aliases=True):
            node.op = "call_function"
            if _squares(node):
                node.target, node.args = torch.pow, (node.args[0], 2)
    elif name in ("view", "reshape", "expand") and len(node.args) > 2:
        node.args = (node.args[0], tuple(node.args[1:]))
    elif name in ("view", "reshape", "expand") and len(node.args) == 2 and isinstance(node.args[1], list):
        node.args = (node.args[0], tuple(node.args[1]))
    elif name == "transpose" and len(node.args) == 3 and not node.kwargs:
        a, b = node.args[1], node.args[2]
        if isinstance(a, int) and isinstance(b, int) and (a < 0) == (b < 0) and a > b:
            node.args = (node.args[0], b, a)
    elif name in _CAST_METHODS and len(node.args) == 1 and not node.kwargs:
        node.target = "to"
        node.args = (node.args[0], _CAST_METHODS[name])
    elif name == "to":
        dtype = node.kwargs.get("dtype") if len(node.args) == 1 else node.args[1]
        other = {k: v for k, v in node.kwargs.items() if k != "dtype"}
        if isinstance(dtype, torch.dtype) and not other and len(node.args) <= 2:
            node.args, node.kwargs = (node.args[0], dtype), {}
    elif name == "type" and len(node.args) == 2 and not node.kwargs and _is_dtype(node.args[1]):
        node.target = "to"  # `p.type(v.dtype)`: fx keeps `v.dtype` a node until example values fold it


def _is_dtype(arg: Any) -> bool:
    """A dtype constant, or an `x.dtype` node (fx's symbolic trace: a dtype, whatever x holds)."""
    if isinstance(arg, torch.dtype):
        return True
    return isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is getattr \
        and arg.args[1:] == ("dtype",)


# NumPy's keyword names, which torch's builtins take for their own (`x.mean(axis=-1, keepdims=True)`)
_NUMPY_NAMES = {"axis": "dim", "keepdims": "keepdim", "x": "input", "a": "input", "x1": "input", "x2": "other"}


def _numpy_names(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A builtin's keyword arguments with NumPy's names as torch's (an alias beside its own name:
    left alone, for the call to fail as written)."""
    renamed = {_NUMPY_NAMES.get(k, k): v for k, v in kwargs.items()}
    return renamed if len(renamed) == len(kwargs) else dict(kwargs)


def _bind(node: fx.Node, target: Callable[..., Any], sig_of: Callable[..., Any],
          aliases: bool = False) -> bool:
    """Rewrites `node` as a call of `target` with `sig_of`'s argument layout; False (the node left
    exactly as it was) for a call that does not bind or that `target` cannot express. aliases: the
    call is a torch builtin's, which takes NumPy's keyword names too."""
    try:
        sig = inspect.signature(sig_of)
        bound = sig.bind(*node.args, **(_numpy_names(node.kwargs) if aliases else node.kwargs))
    except (TypeError, ValueError):
        return False  # a call we do not understand: leave it exactly as it was
    bound.apply_defaults()
    args, kwargs = [], {}
    for name, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            return False
        value = bound.arguments[name]
        must = _MUST_BE.get((target, name), _NO_VALUE)
        if must is not _NO_VALUE:
            if must is not _ANY and value is not must and value != must:
                return False
            continue
        if param.kind == param.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    if target is torch.softmax and args[1] is None:
        return False  # F.softmax's legacy implicit dim: keep F.softmax
    node.target = target
    node.args = tuple(args)
    node.kwargs = kwargs
    return True


_NO_VALUE = object()


def global_hooks() -> bool:
    """Whether hooks registered for every module (`register_module_forward_hook`, ...) exist."""
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
                or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks)


def own_hooks(module: torch.nn.Module) -> bool:
    """Whether `module` has hooks of its own, forward or backward."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling `module` runs hooks around its forward (its own, forward or backward, or
    global ones): a graph must then call the module, not inline its forward."""
    return own_hooks(module) or global_hooks()


# The attributes of a module that its functional call takes as constants (its parameters stay
# reads of the module): a graph holding the call is right only while they keep these values.
_BAKED: dict[type, tuple[str, ...]] = {
    torch.nn.LayerNorm: ("normalized_shape", "eps"),
    torch.nn.GroupNorm: ("num_groups", "eps"),
    torch.nn.GELU: ("approximate",),
    torch.nn.SiLU: ("inplace",),
    torch.nn.ReLU: ("inplace",),
    torch.nn.Softmax: ("dim",),
    torch.nn.Dropout: ("p", "inplace"),
    torch.nn.CrossEntropyLoss: ("ignore_index", "reduction", "label_smoothing"),
}
if hasattr(torch.nn, "RMSNorm"):
    _BAKED[torch.nn.RMSNorm] = ("normalized_shape", "eps")


def _bake(graph: fx.Graph, path: str, name: str, value: Any) -> None:
    graph.__dict__.setdefault("_trifuse_baked", []).append((path, name, value))


def baked_attributes(graph: fx.Graph) -> list[tuple[str, str, Any]]:
    """(submodule path, attribute, value) for each module attribute `canonicalize` turned into a
    constant of `graph` (a Dropout's p, a LayerNorm's eps): a caller running the graph later
    checks they still hold (fx captures; Dynamo's guard on them itself)."""
    return list(graph.__dict__.get("_trifuse_baked", ()))


def _module_to_function(graph: fx.Graph, node: fx.Node, root: torch.nn.Module) -> None:
    try:
        mod = root.get_submodule(node.target)
    except AttributeError:
        return
    if has_hooks(mod) or node.kwargs:
        return
    if type(mod) is torch.nn.CrossEntropyLoss and len(node.args) == 2:
        for name in _BAKED[torch.nn.CrossEntropyLoss]:
            _bake(graph, node.target, name, getattr(mod, name))
        with graph.inserting_before(node):
            weight = graph.get_attr(f"{node.target}.weight") if mod.weight is not None else None
            new = graph.call_function(F.cross_entropy, (*node.args, weight, None, mod.ignore_index, None,
                                                        mod.reduction, mod.label_smoothing))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        return
    if len(node.args) != 1:
        return
    x = node.args[0]

    def param(name: str) -> fx.Node | None:
        value = getattr(mod, name, None)
        if value is None:
            return None
        attr = graph.get_attr(f"{node.target}.{name}")
        attr.meta["val"] = value  # the live parameter: its dtype and shape, for filters
        return attr

    for name in _BAKED.get(type(mod), ()):
        _bake(graph, node.target, name, getattr(mod, name))
    with graph.inserting_before(node):
        if type(mod) is torch.nn.Linear:
            new = graph.call_function(F.linear, (x, param("weight"), param("bias")))
        elif type(mod) is torch.nn.LayerNorm:
            new = graph.call_function(F.layer_norm, (x, tuple(mod.normalized_shape), param("weight"),
                                                     param("bias"), mod.eps))
        elif type(mod) is torch.nn.GroupNorm:
            new = graph.call_function(F.group_norm, (x, mod.num_groups, param("weight"), param("bias"),
                                                     mod.eps))
        elif hasattr(torch.nn, "RMSNorm") and type(mod) is torch.nn.RMSNorm:
            new = graph.call_function(F.rms_norm, (x, tuple(mod.normalized_shape), param("weight"), mod.eps))
        elif type(mod) is torch.nn.GELU:
            new = graph.call_function(F.gelu, (x,), {"approximate": mod.approximate})
        elif type(mod) is torch.nn.SiLU:
            new = graph.call_function(F.silu, (x, mod.inplace))
        elif type(mod) is torch.nn.ReLU:
            new = graph.call_function(F.relu, (x, mod.inplace))
        elif type(mod) is torch.nn.Softmax and mod.dim is not None:
            new = graph.call_function(torch.softmax, (x, mod.dim, None))
        elif type(mod) is torch.nn.Dropout:
            new = graph.call_function(F.dropout, (x, mod.p, mod.training, mod.inplace))
        elif type(mod) is torch.nn.Identity:
            new = x
        else:
            return
    if isinstance(new, fx.Node):
        new.meta = dict(node.meta)
        canonicalize_node(new)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _fold_dtypes(graph: fx.Graph) -> None:
    """`x.dtype` -> its value, and `y.type_as(x)` -> `y.to(<x's dtype>)`, where x's example value
    is known (the graph is specialized on it)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is getattr and node.args[1:] == ("dtype",):
            value = _value(node.args[0])
            if isinstance(value, torch.Tensor):
                replace_uses(node, value.dtype)
                graph.erase_node(node)
        elif node.op == "call_method" and node.target == "type_as" and len(node.args) == 2 and not node.kwargs:
            value, source = _value(node.args[1]), _value(node.args[0])
            # type_as also moves to the other tensor's device: a cast only when they share one
            if isinstance(value, torch.Tensor) and isinstance(source, torch.Tensor) and source.device == value.device:
                node.target, node.args = "to", (node.args[0], value.dtype)


def _merge_repeated_casts(graph: fx.Graph) -> None:
    """Two `x.to(dtype)` of one x and one dtype compute the same tensor: the later one's users read
    the first. Not when either is written in place (then they are two tensors), nor across a change
    of grad or autocast mode in the graph (a cast under no_grad does not require grad)."""
    order, region, regions = {}, 0, {}
    for i, n in enumerate(graph.nodes):
        if _changes_global_mode(n):
            region += 1
        order[n], regions[n] = i, region
    for node in list(graph.nodes):
        first: dict[tuple[torch.dtype, int], fx.Node] = {}
        for cast in sorted(node.users, key=order.__getitem__):
            if not _plain_cast_of(cast, node) or _written_in_place(cast):
                continue
            kept = first.setdefault((cast.args[1], regions[cast]), cast)
            if kept is not cast:
                cast.replace_all_uses_with(kept)
                graph.erase_node(cast)


# `a += b` on a fresh intermediate that nothing else reads computes `a + b`: MPNet's
# `attention_scores += position_bias`. Only these producers count as fresh (never a view, an input
# or a parameter).
_UPDATES = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
            operator.itruediv: operator.truediv}
_FRESH = (operator.add, operator.sub, operator.mul, operator.truediv, torch.matmul, torch.bmm, torch.baddbmm)


def _out_of_place_updates(graph: fx.Graph) -> None:
    """`a += b` -> `a + b` where `a` is a fresh result read by nothing else and the sum keeps a's
    shape (no broadcast of a): the same tensor, so patterns written with `+` match it. Where the
    sum promotes (16-bit scores += an fp32 bias, under autocast), the update computes it in the
    wider dtype and stores it rounded to a's: `(a + b).to(a.dtype)`, the same values. Needs
    example values; without them the update stays."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _UPDATES or len(node.args) != 2 or node.kwargs:
            continue
        a, b = node.args
        if not isinstance(a, fx.Node) or a.op != "call_function" or a.target not in _FRESH or len(a.users) != 1:
            continue
        va, vb = _value(a), _value(b) if isinstance(b, fx.Node) else b
        if not isinstance(va, torch.Tensor) or not isinstance(vb, (torch.Tensor, int, float, bool)):
            continue
        try:
            wide = torch.result_type(va, vb)
            if isinstance(vb, torch.Tensor) and torch.broadcast_shapes(va.shape, vb.shape) != va.shape:
                continue
        except RuntimeError:
            continue
        if wide != va.dtype and not (va.is_floating_point() and wide.is_floating_point):
            continue
        node.target = _UPDATES[node.target]
        if wide != va.dtype:
            key = "val" if "val" in node.meta else "example_value"
            with graph.inserting_after(node):
                cast = graph.call_method("to", (node, va.dtype))
            node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
            cast.meta[key] = node.meta.get(key, va)
            with _meta_only(va):
                node.meta[key] = va.to(wide)
    _out_of_place_fills_and_dropouts(graph)


def _out_of_place_fills_and_dropouts(graph: fx.Graph) -> None:
    """`a.masked_fill_(mask, value)` -> `a.masked_fill(mask, value)` where `a` is a fresh result
    whose every other reader comes after the fill (ldm's CrossAttention: `sim.masked_fill_(~mask,
    max_neg_value)`, then `sim.softmax(-1)`), or before it reads only its shape (XLM's
    `mask.expand_as(scores)`): the later readers read the filled tensor instead, the same values,
    so patterns written with masked_fill match. Likewise an in-place dropout of fresh attention
    probabilities (timm's TNT: `nn.Dropout(p, inplace=True)` after the softmax) becomes
    `F.dropout(a, p, training, False)`, the chain's spelling."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        fill = node.op == "call_method" and node.target == "masked_fill_" and len(node.args) == 3 \
            and not node.kwargs
        drop = node.op == "call_function" and node.target is F.dropout and len(node.args) == 4 \
            and node.args[3] is True and not node.kwargs
        if not (fill or drop):
            continue
        a = node.args[0]
        fresh = _FRESH + ((torch.softmax,) if drop else ())
        if not isinstance(a, fx.Node) or a.op != "call_function" or a.target not in fresh \
                or any(order[u] < order[node] and not reads_only_metadata(u, a)
                       for u in a.users if u is not node):
            continue
        if fill:
            node.target = "masked_fill"
        else:
            node.args = (*node.args[:3], False)
        for user in [u for u in a.users if order[u] > order[node]]:
            user.replace_input_with(a, node)


def _slice_starts(index: Any, dims: int) -> list[int] | None:
    """For `x[index]` with `index` slices from a start to the end (`:`, `1:`), after an optional
    `...`, on an x of `dims` dims: each dim's start. Else None."""
    index = index if isinstance(index, tuple) else (index,)
    if index[:1] == (Ellipsis,):
        index = (slice(None),) * (dims - len(index) + 1) + index[1:]
    if len(index) > dims or not all(isinstance(i, slice) for i in index):
        return None
    starts = []
    for i in index:
        if i.stop is not None or i.step not in (None, 1) or not (i.start is None or type(i.start) is int):
            return None
        if i.start is not None and i.start < 0:
            return None
        starts.append(i.start or 0)
    return starts + [0] * (dims - len(starts))


def _added_terms(node: fx.Node, start: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """`((start + a) + b) ...` at `node` -> ([a, b, ...], the sums), each sum read only by the
    next; else None."""
    terms, sums = [], []
    while node is not start:
        if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not operator.add \
                or len(node.args) != 2 or node.kwargs or len(node.users) != 1:
            return None
        sums.append(node)
        left, right = node.args
        on_left = left is start or right is not start and isinstance(left, fx.Node) \
            and left.target is operator.add
        node, term = (left, right) if on_left else (right, left)
        if not isinstance(term, fx.Node):
            return None
        terms.insert(0, term)
    return terms, sums


def _fresh_scores(node: Any) -> bool:
    """A fresh result of arithmetic, a product, or a mask applied (`masked_fill`, `where`)."""
    return isinstance(node, fx.Node) and (node.op == "call_function" and node.target in (*_FRESH, torch.where)
                                          or node.op == "call_method" and node.target == "masked_fill")


def _sum_of_terms(graph: fx.Graph, terms: list[fx.Node], values: list[torch.Tensor],
                  key: str) -> tuple[fx.Node, torch.Tensor]:
    """`terms[0] + terms[1] + ...` as graph nodes (at the graph's insertion point) with their
    example values under `key`; returns the last node and its value."""
    delta, vd = terms[0], values[0]
    for term, vt in zip(terms[1:], values[1:]):
        delta = graph.call_function(operator.add, (delta, term))
        vd = vd + vt
        delta.meta[key] = vd
    return delta, vd


def _slice_updates_of_scores(graph: fx.Graph) -> None:
    """Fresh scores s (a product, arithmetic, a mask applied) updated through a slice of their
    trailing dims, where a class token's row and column are left out (`1:`) or nothing is (`0:`):

    - `s[i] = (s[i].view(...) + a + b).view(<s[i]'s shape>)`, with a + b of the inner view's
      shape (timm's MViT V2, `cal_rel_pos_type`: its decomposed relative positions);
    - `s[i] += d`, d of s[i]'s shape (torchvision's MViT, `_add_rel_pos`)

    -> `s + F.pad(d, <the starts>)`, d = `(a + b).reshape(<s[i]'s shape>)` in the first form, cast to
    s's dtype where the sum promotes (the write casts): every later reader reads that, a tensor
    the attention patterns take as scores + mask. The same values, but for the first form's sum,
    which adds a and b before s (one rounding of the scores apart, as MPNet's two masks). Only
    where nothing else reads s, the slice or the steps before the write, and with example values."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for write in list(graph.nodes):
        if write.op != "call_function" or write.target is not operator.setitem or len(write.args) != 3 \
                or write.kwargs:
            continue
        s, index, value = write.args
        if not _fresh_scores(s) or not isinstance(value, fx.Node) or write.users:
            continue
        vs, vv = _value(s), _value(value)
        if not isinstance(vs, torch.Tensor) or not isinstance(vv, torch.Tensor):
            continue
        starts = _slice_starts(index, vs.dim())
        readers = [u for u in s.users if u is not write and order[u] < order[write]]
        if starts is None or len(readers) != 1:
            continue
        part = readers[0]
        if part.op != "call_function" or part.target is not operator.getitem or part.args != (s, index) \
                or len(part.users) != 1 or len(value.users) != 1:
            continue
        vp = _value(part)
        if not isinstance(vp, torch.Tensor) or not same_shape(vp, vv):
            continue
        back = None
        if value.op == "call_function" and value.target is operator.iadd and len(value.args) == 2 \
                and value.args[0] is part and isinstance(value.args[1], fx.Node) and not value.kwargs:
            terms, steps = [value.args[1]], [value, part]  # torchvision's `s[i] += d`
        elif _is_view(value) and _is_view(next(iter(part.users))):
            back, inner = value, next(iter(part.users))  # timm's view, add, view back
            found = _added_terms(value.args[0], inner) if len(inner.users) == 1 else None
            if not found or not found[0]:
                continue
            terms, steps = found[0], [back, *found[1], inner, part]
        else:
            continue
        values = [_value(t) for t in terms]
        if not all(isinstance(t, torch.Tensor) for t in values):
            continue
        try:
            shape = torch.broadcast_shapes(*(t.shape for t in values))
            wide = functools.reduce(torch.promote_types, (t.dtype for t in values), vs.dtype)
        except RuntimeError:
            continue
        target = _value(back.args[0]) if back is not None else vp
        if not isinstance(target, torch.Tensor) or len(shape) != target.dim() or not wide.is_floating_point \
                or not all(known_equal(a, b) for a, b in zip(shape, target.shape)):
            continue
        first = next((d for d, start in enumerate(starts) if start), None)
        pads = () if first is None else tuple(p for start in reversed(starts[first:]) for p in (start, 0))
        key = "val" if "val" in s.meta else "example_value"
        with graph.inserting_before(write), _meta_only(vs):
            delta, vd = _sum_of_terms(graph, terms, values, key)
            if back is not None:  # the inner view's sizes flattened as the view back flattens them
                delta = graph.call_method("reshape", (delta, back.args[1]))
                vd = vd.reshape(vp.shape)
                delta.meta[key] = vd
            if pads:
                delta = graph.call_function(F.pad, (delta, pads))
                vd = F.pad(vd, pads)
                delta.meta[key] = vd
            updated = graph.call_function(operator.add, (s, delta))
            updated.meta[key] = vs + vd
            if wide != vs.dtype:
                updated = graph.call_method("to", (updated, vs.dtype))
                updated.meta[key] = vs
        for user in [u for u in s.users if u in order and order[u] > order[write]]:
            user.replace_input_with(s, updated)
        graph.erase_node(write)
        for step in steps:
            graph.erase_node(step)


_EVEN = ((Ellipsis, slice(0, None, 2)), (Ellipsis, slice(None, None, 2)))
_ODD = ((Ellipsis, slice(1, None, 2)),)


def _interleaved_writes(graph: fx.Graph) -> None:
    """`out = torch.empty_like(x); out[..., 0::2] = a; out[..., 1::2] = b` (Wan's rotary, Sana-Video's)
    -> `torch.stack([a, b], -1).flatten(-2)`, each cast to out's dtype as the writes cast: every
    element written once, the same values and gradients, so patterns written functionally match.
    Only where nothing reads out before both writes and a and b have the slices' shape (no
    broadcast). Needs example values; without them the writes stay."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for out in list(graph.nodes):
        if out.op != "call_function" or out.target is not torch.empty_like or len(out.args) != 1 \
                or out.kwargs:
            continue
        writes = [u for u in out.users if u.op == "call_function" and u.target is operator.setitem]
        if len(writes) != 2 or any(len(w.args) != 3 or w.kwargs or w.args[0] is not out for w in writes):
            continue
        even = next((w for w in writes if w.args[1] in _EVEN), None)
        odd = next((w for w in writes if w.args[1] in _ODD), None)
        if even is None or odd is None:
            continue
        last = max(writes, key=order.__getitem__)
        if any(order[u] < order[last] for u in out.users if u not in writes):
            continue
        a, b = even.args[2], odd.args[2]
        vo, va, vb = _value(out), _value(a), _value(b)
        if not all(isinstance(v, torch.Tensor) for v in (vo, va, vb)) or va.shape != vb.shape \
                or vo.dim() != va.dim() or vo.shape[:-1] != va.shape[:-1] or vo.shape[-1] != 2 * va.shape[-1]:
            continue
        key = "val" if "val" in out.meta else "example_value"
        halves = []
        with graph.inserting_before(last.next), _meta_only(vo):  # in this order, after both writes
            for half, value in ((a, va), (b, vb)):
                if value.dtype != vo.dtype:
                    half = graph.call_method("to", (half, vo.dtype))
                    half.meta[key] = value.to(vo.dtype)
                halves.append(half)
            stacked = graph.call_function(torch.stack, (halves, -1))
            stacked.meta[key] = torch.stack([va.to(vo.dtype), vb.to(vo.dtype)], -1)
            flat = graph.call_method("flatten", (stacked, -2))
            flat.meta[key] = vo
        canonicalize_node(stacked)
        _method(flat)
        for user in [u for u in out.users if u not in writes]:
            user.replace_input_with(out, flat)
        for w in writes:
            graph.erase_node(w)
        graph.erase_node(out)
        order = {n: i for i, n in enumerate(graph.nodes)}


# Methods that read only the shape, dtype or device of their argument at this position (XLM's
# `mask.expand_as(scores)` before `scores.masked_fill_(mask, ...)`).
_METADATA_ARGS = {"expand_as": 1, "view_as": 1, "reshape_as": 1, "type_as": 1, "size": 0, "dim": 0}


def reads_only_metadata(user: fx.Node, a: fx.Node) -> bool:
    """Whether `user` reads no value of `a`, only its shape, dtype or device."""
    if user.op == "call_function" and user.target is getattr and user.args[1:] in (("shape",), ("dtype",)):
        return True
    position = _METADATA_ARGS.get(user.target) if user.op == "call_method" else None
    return position is not None and len(user.args) > position and user.args[position] is a \
        and sum(arg is a for arg in (*user.args, *user.kwargs.values())) == 1


# y.<method>_as(x) -> y.<method>(<x's shape>): the same result, x read for its shape only
_SHAPE_AS = {"expand_as": "expand", "view_as": "view", "reshape_as": "reshape"}


def _static_shapes_as(graph: fx.Graph) -> None:
    """`y.expand_as(x)`, `y.view_as(x)`, `y.reshape_as(x)` -> `y.expand(<x's shape>)` (`view`,
    `reshape`) in a Dynamo graph where x's example value has a static shape: the same tensor, no
    longer reading x. XLM expands its mask to the scores it then fills (`mask.expand_as(scores)`),
    SAM's vision attention (GOT-OCR2's, DeepSeek-OCR's) reshapes its relative-position bias to
    the scores it adds it to (`rel_pos.reshape_as(scores)`): read that way, the scores fed the
    mask, and no attention pattern could take them whole. Dynamo guards a static size (another size
    recaptures); an fx capture serves every size of its key, so its graphs keep the `_as` forms."""
    if not any(n.op == "placeholder" and "grapharg" in n.meta for n in graph.nodes):
        return
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target not in _SHAPE_AS or len(node.args) != 2 or node.kwargs:
            continue
        value = _value(node.args[1])
        if isinstance(value, torch.Tensor) and all(type(d) is int for d in value.shape):
            node.target, node.args = _SHAPE_AS[node.target], (node.args[0], tuple(value.shape))


def _softmax_of_casts(graph: fx.Graph) -> None:
    """`torch.softmax(x.to(dtype), dim, None)` -> `torch.softmax(x, dim, dtype)` for a floating
    dtype: softmax's dtype argument casts its input before computing (T5's and XLM's
    `softmax(scores.float(), dim=-1)`), the same values and the same gradient, so the upcast
    spelling of a pattern matches both. The cast stays where something else reads it; not where
    x or the cast is written in place. Not where the softmax's result is of another dtype than
    the cast's (CUDA autocast computes `softmax(x.half())` in fp32, and `softmax(x, dtype=half)`
    as asked), nor, without example values, for a cast to 16 bits. Then a softmax whose dtype is
    its input's own (example values show it) and whose result no cast reads loses the dtype: the
    plain softmax (Falcon's `dtype=hidden_states.dtype`)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.softmax or len(node.args) != 3 \
                or node.args[2] is not None or node.kwargs:
            continue
        cast = node.args[0]
        if not isinstance(cast, fx.Node) or not isinstance(cast.args[0] if cast.args else None, fx.Node) \
                or not _plain_cast_of(cast, cast.args[0]) or not cast.args[1].is_floating_point:
            continue
        out = _value(node)
        as_cast = out.dtype == cast.args[1] if isinstance(out, torch.Tensor) else cast.args[1].itemsize >= 4
        if not as_cast:
            continue
        x = cast.args[0]
        if _written_in_place(cast) or _written_in_place(x):
            continue
        node.args = (x, node.args[1], cast.args[1])
        if not cast.users:
            graph.erase_node(cast)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.softmax and len(node.args) == 3 \
                and isinstance(node.args[2], torch.dtype) and not node.kwargs:
            x = _value(node.args[0]) if isinstance(node.args[0], fx.Node) else None
            cast_after = any(u.op == "call_method" and u.target == "to" for u in node.users)
            if isinstance(x, torch.Tensor) and x.dtype == node.args[2] and not cast_after:
                node.args = (node.args[0], node.args[1], None)  # a no-op dtype: the plain spelling


def _batched_product(equation: str) -> bool | None:
    """For a two-operand einsum equation that is a batched matrix product, whether the second
    operand is transposed: "bhid,bhjd->bhij" (q k^T) -> True, "bhij,bhjd->bhid" (P v) -> False,
    "...id,...jd->...ij" -> True. None for anything else (another contraction, a repeated or
    reordered batch letter, an implicit output)."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1 or eq.count(",") != 1:
        return None
    lhs, out = eq.split("->")
    a, b = lhs.split(",")
    batch = out[:-2]
    if batch.startswith("..."):
        rest = batch[3:]
        if "." in rest or not all(t.startswith("...") for t in (a, b)):
            return None
    elif "." in eq:
        return None
    letters = batch.replace("...", "")
    if len(set(letters)) != len(letters) or not a.startswith(batch) or not b.startswith(batch):
        return None
    if len(a) != len(batch) + 2 or len(b) != len(batch) + 2:
        return None
    (i, c), b_tail, (i2, j) = a[len(batch):], b[len(batch):], out[len(batch):]
    if i2 != i or len({i, c, j}) != 3 or {i, c, j} & set(letters):
        return None
    if b_tail == j + c:
        return True
    if b_tail == c + j:
        return False
    return None


def _einsum_as_matmul(graph: fx.Graph) -> None:
    """`torch.einsum("bhid,bhjd->bhij", q, k)` (or its operands as a list) -> `torch.matmul(q,
    k.transpose(-2, -1))`, and `einsum("bhij,bhjd->bhid", p, v)` -> `torch.matmul(p, v)`: the
    attention written with einsum (CvT, ldm's CrossAttention, lucidrains-style code) then meets
    the patterns written with matmul. Only equations that are exactly a batched matrix product;
    the result is the same tensor."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.einsum or node.kwargs or not node.args \
                or not isinstance(node.args[0], str):
            continue
        operands = node.args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        transposed = _batched_product(node.args[0])
        if len(operands) != 2 or not all(isinstance(o, fx.Node) for o in operands) or transposed is None:
            continue
        a, b = operands
        with graph.inserting_before(node), _meta_only(_value(b)):
            if transposed:
                value = _value(b)
                b = graph.call_method("transpose", (b, -2, -1))
                if isinstance(value, torch.Tensor):
                    b.meta["val"] = value.transpose(-2, -1)
            new = graph.call_function(torch.matmul, (a, b))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


_ZEROS = (torch.zeros, torch.zeros_like)


def _baddbmm_over_zeros(graph: fx.Graph) -> None:
    """`torch.baddbmm(z, a, b, beta=β, alpha=α)` with z a fresh `torch.zeros` (or `zeros_like`)
    read by nothing else and β a finite number: β z is zero, so the call is `torch.bmm(a, b)`
    times α (α = 1: the product alone), which the bmm attention patterns take."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.baddbmm or len(node.args) != 3 \
                or not set(node.kwargs) <= {"beta", "alpha"}:
            continue
        zeros, a, b = node.args
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if not isinstance(zeros, fx.Node) or zeros.op != "call_function" or zeros.target not in _ZEROS \
                or len(zeros.users) != 1 or not all(isinstance(x, (int, float)) for x in (beta, alpha)) \
                or not math.isfinite(beta):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.bmm, (a, b))
            new.meta = dict(node.meta)
            if alpha != 1:
                new = graph.call_function(operator.mul, (new, alpha))
                new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        graph.erase_node(zeros)


def _view_round_trips(graph: fx.Graph) -> None:
    """`x.view(s).view(x's shape)` -> `x` (XGLM's `attn_weights.view(B, H, S, S).view(B * H, S, S)`
    between its softmax and dropout), where the example values show x's shape (provably, for
    symbolic shapes: no guard added); the first view is dropped when nothing else reads it. Only
    a chain that nothing writes to in place is folded."""
    for node in list(graph.nodes):
        inner = node.args[0] if _is_view(node) else None
        if not _is_view(inner) or _written_in_place(node) or _written_in_place(inner):
            continue
        x, value = _value(inner.args[0]), _value(node)
        if not isinstance(x, torch.Tensor) or not isinstance(value, torch.Tensor) or not same_shape(x, value):
            continue
        node.replace_all_uses_with(inner.args[0])
        graph.erase_node(node)
        if not inner.users:
            graph.erase_node(inner)


def _window_mask_views(graph: fx.Graph) -> None:
    """`s.view(B / nW, nW, H, N, M) + m` viewed back to s's (B, H, N, M), m (1, nW, 1 or H, N, M)
    -> `s + m.expand(B / nW, nW, ., N, M).reshape(B, ., N, M)`: Swin's shifted windows add their
    (nW, N, M) mask (`mask.unsqueeze(1).unsqueeze(0)`) over a 5-D view of the scores
    (torchvision's Swin, timm's with fused_attn off), where the attention patterns take a
    mask over the 4-D scores. The same sums; the tiled mask holds B x N x M values (per head only
    where m is), no stride can repeat the windows along the batch. Where example values show
    those shapes and nothing else reads the views or writes to them. A view that leaves B / nW to
    the tensor's size (timm's `view(-1, nW, H, N, N)`) has it read off the product's first operand
    (q's dim 0 is the scores'), so the graph stays right for every batch an fx capture serves."""
    for back in list(graph.nodes):
        added = back.args[0] if _is_view(back) else None
        if not isinstance(added, fx.Node) or added.op != "call_function" or added.target is not operator.add \
                or len(added.args) != 2 or added.kwargs or len(added.users) != 1:
            continue
        view, mask = added.args if _is_view(added.args[0]) else added.args[::-1]
        if not _is_view(view) or len(view.users) != 1 or not isinstance(mask, fx.Node) \
                or any(_written_in_place(n) for n in (view, added, back)):
            continue
        scores = view.args[0]
        s, v, m, out = (_value(n) for n in (scores, view, mask, back))
        # (the view back must show the scores' shape: a dynamic capture's example value of a -1 view
        # holds the batch as a symbolic quotient no later shape check could match)
        if not all(isinstance(t, torch.Tensor) for t in (s, v, m, out)) or s.dim() != 4 or v.dim() != 5 \
                or m.dim() != 5 or not same_shape(s, out) or not m.is_floating_point():
            continue
        shape = view.args[1]
        # The sizes come from the view (a size read off the scores would be a use outside the
        # attention's pattern); a -1 first (timm's `view(-1, nW, H, N, N)`) is read off the tensor
        # the scores' product starts from (q: an input of the pattern), divided by the windows.
        if not isinstance(shape, (tuple, list)) or len(shape) != 5 \
                or not all(isinstance(d, fx.Node) or (type(d) is int and (d > 0 or i == 0 and d == -1))
                           for i, d in enumerate(shape)):
            continue
        batch, heads, n, k = s.shape
        windows = v.shape[1]
        if not all(known_equal(a, b) for a, b in zip(v.shape[2:], (heads, n, k))) \
                or not known_equal(m.shape[0], 1) or not known_equal(m.shape[1], windows) \
                or not (known_equal(m.shape[2], 1) or known_equal(m.shape[2], heads)) \
                or not all(known_equal(a, b) for a, b in zip(m.shape[3:], (n, k))) \
                or shape[0] != -1 and not known_equal(v.shape[0] * windows, batch):
            continue
        per = batch // windows
        source = _batch_source(scores, batch) if shape[0] == -1 else None
        if shape[0] == -1 and source is None:
            continue
        mask_heads = 1 if m.shape[2] == 1 else shape[2]  # (decided before the guards go off below)
        with graph.inserting_before(back), _meta_only(m):
            if source is not None:
                rows = graph.call_method("size", (source, 0))
                rows.meta["val"] = batch
                per_node = graph.call_function(operator.floordiv, (rows, shape[1]))
                per_node.meta["val"] = per
                shape = (per_node, *shape[1:])
            # the view's own sizes (nodes of a dynamic capture, or ints), the mask's heads 1 or the view's
            sizes = (*shape[:2], mask_heads, *shape[3:])
            tiled = graph.call_method("expand", (mask, sizes))
            tiled.meta["val"] = m.expand(per, windows, m.shape[2], n, k)
            flat = graph.call_method("reshape", (tiled, (-1, *sizes[2:])))
            flat.meta["val"] = tiled.meta["val"].reshape(batch, m.shape[2], n, k)
            order = (scores, flat) if added.args[0] is view else (flat, scores)
            total = graph.call_function(operator.add, order)
            total.meta["val"] = out
        back.replace_all_uses_with(total)
        for node in (back, added, view):
            graph.erase_node(node)


def _is_view_or_reshape(node: Any) -> bool:
    return _is_view(node) or isinstance(node, fx.Node) and node.op == "call_method" \
        and node.target == "reshape" and len(node.args) == 2 and not node.kwargs \
        and isinstance(node.args[0], fx.Node)


def _terms_over_a_view_of_the_scores(graph: fx.Graph) -> None:
    """`(s.view(shape) + a + b ...).view(<s's shape>)`, two terms or more whose sum has the inner
    view's shape -> `s + (a + b ...).reshape(<s's shape>)`: SAM's and ViTDet's decomposed relative
    positions, `(attn.view(B, qh, qw, kh, kw) + rel_h[..., None] + rel_w[..., None, :]).view(B, qh *
    qw, kh * kw)` (segment-anything's and detectron2's code; transformers' SegGPT and VitDet, the
    first with `reshape`), where the attention patterns take a mask added to the scores. The same values
    (the view and the view back pair the elements of s in one row-major order), but for the sum,
    which adds the terms before s (one rounding of the scores apart, as MPNet's two masks). Where
    example values show those shapes and nothing else reads the views and sums or writes to them."""
    for inner in list(graph.nodes):
        if not _is_view_or_reshape(inner) or len(inner.users) != 1 or _written_in_place(inner):
            continue
        node, terms, sums = inner, [], []
        while True:
            user = next(iter(node.users))
            if user.op != "call_function" or user.target is not operator.add or len(user.args) != 2 \
                    or user.kwargs or len(user.users) != 1 or _written_in_place(user):
                break
            term = user.args[1] if user.args[0] is node else user.args[0]
            if term is node or not isinstance(term, fx.Node):
                break
            terms.append(term)
            sums.append(user)
            node = user
        back = next(iter(node.users))
        # two terms at least: one mask over a view and back is BART's older attention (a mask per
        # head over (B, H, Sq, Sk)) and Swin's, which their own patterns take as written
        if len(terms) < 2 or not _is_view_or_reshape(back) or back.args[0] is not node \
                or _written_in_place(back):
            continue
        scores = inner.args[0]
        s, v, out = _value(scores), _value(inner), _value(back)
        values = [_value(t) for t in terms]
        if not all(isinstance(t, torch.Tensor) for t in (s, v, out, *values)) or not same_shape(s, out) \
                or not all(t.is_floating_point() for t in values):
            continue
        try:
            shape = torch.broadcast_shapes(*(t.shape for t in values))
        except RuntimeError:
            continue
        if len(shape) != v.dim() or not all(known_equal(a, b) for a, b in zip(shape, v.shape)):
            continue
        wide = functools.reduce(torch.result_type, values)  # the terms' sum's dtype: s + it must have the
        if torch.promote_types(s.dtype, wide) != out.dtype:  # unfused sum's (0-d terms promote by kind only)
            continue
        key = "val" if "val" in scores.meta else "example_value"
        with graph.inserting_before(back), _meta_only(s):
            delta, vd = _sum_of_terms(graph, terms, values, key)
            delta = graph.call_method("reshape", (delta, back.args[1]))  # the view back's own sizes
            vd = vd.reshape(s.shape)
            delta.meta[key] = vd
            total = graph.call_function(operator.add, (scores, delta))
            total.meta[key] = out
        back.replace_all_uses_with(total)
        for step in (back, *reversed(sums), inner):
            graph.erase_node(step)


def _batch_source(scores: fx.Node, batch: int) -> fx.Node | None:
    """The tensor whose dim 0 is the scores' batch for every size: back from the scores through
    sums, products, masks applied and casts (a scale, a position bias added, a key padding filled)
    to their matrix product's first operand, where example values show that operand with the
    scores' batch and rank."""
    node = scores
    for _ in range(8):
        if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
            return None
        if node.target in (torch.matmul, torch.bmm):
            first = node.args[0]
            value = _value(first)
            ok = isinstance(value, torch.Tensor) and value.dim() == _value(node).dim() \
                and known_equal(value.shape[0], batch)
            return first if ok else None
        if node.target in (operator.add, operator.sub, operator.mul, operator.truediv, torch.where,
                           "masked_fill") or _plain_cast_of(node, node.args[0] if node.args else None):
            # the float operand of the scores' shape computed in the graph carries the product on
            # (a bias, a scale, a mask or a fill does not)
            out = _value(node)
            node = next((a for a in node.args[:3] if isinstance(_value(a), torch.Tensor)
                         and _value(a).is_floating_point() and a.op != "placeholder"
                         and isinstance(out, torch.Tensor) and same_shape(_value(a), out)), None)
            continue
        return None
    return None


def _is_view(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == "view" and len(node.args) == 2 \
        and not node.kwargs and isinstance(node.args[0], fx.Node)


def _changes_global_mode(node: fx.Node) -> bool:
    """Dynamo's grad-mode and autocast switches (`torch._C._set_grad_enabled`,
    `torch.amp.autocast_mode._enter_autocast` / `_exit_autocast`, inference mode), and anything
    else named like them."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name.startswith(("_set_", "_enter_", "_exit_"))


def _plain_cast_of(node: fx.Node, x: fx.Node) -> bool:
    return node.op == "call_method" and node.target == "to" and len(node.args) == 2 and not node.kwargs \
        and node.args[0] is x and isinstance(node.args[1], torch.dtype)


_IN_PLACE_OPERATORS = (*_UPDATES, operator.setitem)


def writes_in_place(user: fx.Node) -> bool:
    """Whether `user` may write to one of its tensor arguments: an in-place method or function
    (`x.mul_(y)`, `torch.relu_(x)`), `x += y`, `x[i] = y`."""
    if user.op not in ("call_function", "call_method"):
        return False
    if user.target in _IN_PLACE_OPERATORS:
        return True
    name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _written_in_place(node: fx.Node) -> bool:
    """Whether a user of `node` may write to it."""
    return any(writes_in_place(user) for user in node.users)


# Names of calls whose result is random, uninitialized or written in place: a value computed with
# one of them is no constant of the graph.
_NOT_CONSTANT = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "empty", "poisson",
                 "exponential", "geometric", "cauchy")
# The most elements a constant mask may have to be evaluated while compiling (a batch of 8 masks of
# 1024 x 1024 is 2^23; the evaluation's int64 index temporaries are 8 bytes an element).
CONSTANT_MASK_LIMIT = 1 << 26
# operator's functions that write their first operand (`and_`, `or_` do not: the rest of its
# names ending in "_" are pure)
_IN_PLACE_OPERATORS = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                       operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                       operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def _constant(node: fx.Node, memo: dict[fx.Node, Any]) -> Any:
    """The value of `node` where the graph computes it from literals alone: no placeholder (an
    input, a parameter, a buffer, a symbolic size), no attribute, nothing random or in place, and
    at most CONSTANT_MASK_LIMIT elements by its example value. Else None. transformers' causal mask
    under torch.compile is such a value: aranges of the static sizes Dynamo guards, compared."""
    if node in memo:
        return memo[node]
    memo[node] = None
    value = _value(node)
    if not isinstance(value, torch.Tensor) or value.numel() > CONSTANT_MASK_LIMIT:
        return None
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op not in ("call_function", "call_method"):
            return None
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
        trailing = name.endswith("_") and not name.endswith("__")
        pure_operator = getattr(n.target, "__module__", None) == "_operator"  # and_, or_, ...
        in_place = n.target in _IN_PLACE_OPERATORS or (trailing and not pure_operator)
        if in_place or any(bad in name for bad in _NOT_CONSTANT):
            return None
        stack.extend(n.all_input_nodes)
    order = [n for n in node.graph.nodes if n in seen]
    env: dict[fx.Node, Any] = {}
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with torch.no_grad(), unset_fake_temporarily():
            for n in order:
                args = fx.map_arg(n.args, env.__getitem__)
                kwargs = fx.map_arg(n.kwargs, env.__getitem__)
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" \
                    else n.target(*args, **kwargs)
    except Exception:  # noqa: BLE001  (anything it cannot evaluate stays as written)
        return None
    out = env[node]
    if isinstance(out, torch.Tensor) and out.shape == value.shape and out.dtype == value.dtype:
        memo[node] = out
    return memo[node]


def _kept(mask: torch.Tensor) -> torch.Tensor | None:
    """Which scores a mask keeps: a bool mask itself; an additive float mask where it is 0, when
    every other entry is -inf or at most the dtype's lowest value (what transformers fills with).
    None for any other float mask (it changes the kept scores)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    keep = mask == 0
    dropped = mask[~keep]
    if dropped.numel() and not bool((dropped <= torch.finfo(mask.dtype).min).all()):
        return None
    return keep


def constant_masks(graph: fx.Graph) -> int:
    """An attention call (`F.scaled_dot_product_attention`, or trifuse's op in a rewritten graph)
    whose mask is a constant of the graph (`_constant`) that keeps every score loses the mask; one
    that keeps exactly SDPA's causal pattern (key j for query i where j <= i) becomes `is_causal`
    without it. The same scores kept, the same result; the causal form lets every kernel skip the
    blocks above the diagonal (cuDNN's GPT-2 medium attention: 17.2 ms a step with the mask, 7.8 ms
    causal, on the lent H100). Dynamo specializes on the sizes the mask is built from (a new size
    compiles a new graph); a size that is a symbol (`dynamic=True`) is a placeholder, and the mask
    stays. Returns how many calls changed."""
    from ..kernels.attention import attention
    from .match import _ancestors

    memo: dict[fx.Node, Any] = {}
    changed = 0
    masks = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (F.scaled_dot_product_attention, attention) \
                or len(node.args) < 6 or node.args[5] is not False:
            continue
        mask = node.args[3]
        q, k = _value(node.args[0]), _value(node.args[1])
        if not isinstance(mask, fx.Node) or not isinstance(q, torch.Tensor) \
                or not isinstance(k, torch.Tensor) or q.dim() < 2 \
                or not all(type(d) is int for d in (*q.shape, *k.shape)):
            continue
        value = _constant(mask, memo)
        keep = _kept(value) if isinstance(value, torch.Tensor) else None
        sq, sk = q.shape[-2], k.shape[-2]
        if keep is None or keep.dim() < 2 or keep.shape[-2] not in (1, sq) or keep.shape[-1] not in (1, sk):
            continue
        keep = keep.expand(*keep.shape[:-2], sq, sk)
        if bool(keep.all()):
            causal = False
        elif bool((keep == torch.ones(sq, sk, dtype=torch.bool, device=keep.device).tril()).all()):
            causal = True
        else:
            continue
        node.args = (*node.args[:3], None, node.args[4], causal, *node.args[6:])
        masks.add(mask)
        changed += 1
    for mask in masks:  # what computed the masks, where nothing else reads it (pure, by _constant)
        if not mask.users:
            above = _ancestors(mask) | {mask}
            for n in reversed([n for n in graph.nodes if n in above]):
                if not n.users:
                    graph.erase_node(n)
    return changed


def _value(arg: Any) -> Any:
    return arg.meta.get("val", arg.meta.get("example_value")) if isinstance(arg, fx.Node) else None


def _meta_only(value: Any) -> contextlib.AbstractContextManager:
    """No guards from the example values computed for the nodes a pass inserts (fake tensors of a
    dynamic capture, `value` one of them): they are bookkeeping, where a guard would specialize the
    capture's sizes (a reshape or pad of symbolic sizes equates them with their example's: every
    new sequence length recompiled). The decisions a pass makes still guard as they must."""
    env = getattr(getattr(value, "fake_mode", None), "shape_env", None)
    return env.suppress_guards() if env is not None else contextlib.nullcontext()


def replace_uses(node: fx.Node, value: Any) -> None:
    """Every use of `node` reads `value` (a node or a constant) instead."""
    for user in list(node.users):
        user.args = fx.map_arg(user.args, lambda n: value if n is node else n)
        user.kwargs = fx.map_arg(user.kwargs, lambda n: value if n is node else n)


def _hashable(target: Any) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True


def _is_python_function(target: Any) -> bool:
    """Python functions of torch.nn.functional and of trifuse: bound by their own signature."""
    if not inspect.isfunction(target):
        return False
    module = getattr(target, "__module__", "") or ""
    return module == "torch.nn.functional" or module.startswith("trifuse.")
