"""Norm outputs in the autocast dtype where only autocast's matmuls read them.

Under autocast a pre-norm block's residual stream stays fp32, so its norm returns fp32 and each
matmul after it (the attention's q/k/v projections, the MLP's first linear or gate and up) casts
that to bf16 or fp16 first: a kernel reading 4 and writing 2 bytes an element per matmul forward,
and backward one casting each matmul's 16-bit gradient back to fp32 and adds summing them for the
norm's backward, on every layer (a diffusion transformer's modulated norms, `layer_norm_modulate`,
the same: their outputs are fp32 too, a 16-bit scale times an fp32 norm). When a fused norm's
output goes to such matmuls alone (through views and reshapes), the norm writes the 16-bit
values itself (`out_dtype`): the kernel rounds the same fp32 result once, as each cast did, so
every matmul sees the same bits. With several matmuls (up to `MAX_READERS`) the norm returns one
view of its output for each (`readers`), so that their gradients reach its backward apart and
are summed there in fp32, as autograd summed the casts' fp32 gradients; one 16-bit tensor read by
all of them would have its gradients summed in 16 bits. Where other ops read the output in full
as well (a post-norm block's norm output is also the next residual: BERT's), the norm returns both
(`full_y`): its output as before and the 16-bit one for one matmul, both stored by the kernel,
their two gradients added in the backward.

The same for an fp32 value that is not a norm's and that several such matmuls read (a post-norm
block's input, read by its query, key and value projections): `share_input_casts` casts it once,
a view per matmul, and sums their gradients in fp32 in one kernel (kernels/cast.py).

And the matmuls of fp32 weights themselves (`fp32_weight_grads`): autocast's casts of a weight
and bias to 16 bits make their gradients 16-bit GEMM and sum results that a kernel then converts
to fp32, one per weight and bias on every layer; `kernels.linear.autocast_linear` runs the same
forward and dx, and computes dW and db in fp32 directly.

The autocast state is the capture's (a capture is made per autocast mode and replayed only under
the same one); graphs that switch autocast inside are left alone, and so is any output that
only reaches the graph's result or ops that are not in autocast's lower-precision list.
"""
import inspect
import operator

import torch
from torch import fx

from ..kernels import adaptive_norm
from ..kernels import layer_norm as ln
from ..kernels.cast import cast_for_readers
from ..kernels.linear import autocast_linear
from ..patterns._base import example_value

# Ops autocast runs in its lower-precision dtype, casting every fp32 tensor argument to it: the
# matmuls, and the convolutions (F.conv2d is torch.conv2d) that read a UNet's GroupNorm + SiLU.
# The notes below say "matmul" for either.
LOWERED = frozenset({torch._C._nn.linear, torch.addmm, torch.mm, torch.matmul, torch.bmm, torch.baddbmm,
                     operator.matmul, torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
                     torch.conv_transpose2d, torch.conv_transpose3d})
# Methods that pass values on unchanged (any dtype), and those that read only the shape.
_VIEWS = frozenset({"view", "reshape", "flatten", "unflatten"})
_SHAPE_ONLY = frozenset({"size", "dim"})
# The trifuse ops that take out_dtype and readers, and which of their results is y (None: the
# op's value).
_NORMS = {ln.layer_norm: None, ln.rms_norm: None, ln.dropout_add_layer_norm: 0,
          adaptive_norm.layer_norm_modulate: None, adaptive_norm.gated_add_layer_norm_modulate: 0}


def narrow_norm_outputs(graph: fx.Graph) -> list[fx.Node]:
    """Sets out_dtype to the autocast dtype on the norm nodes whose fp32 output autocast-lowered
    matmuls read: readers to their number when nothing else reads it, else full_y for one of
    them; returns the nodes changed."""
    if any(_switches_autocast(n) for n in graph.nodes):
        return []
    changed = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _NORMS or readers(node) != 1 or full_y(node):
            continue
        # (an out_dtype already set widens: the modulated norm of a 16-bit x, fp32 under CUDA's
        # autocast; the op's own dtype is then not the one the graph reads)
        widened = out_dtype(node) is not None
        y = _output(node, _NORMS[node.target])
        value = example_value(y) if y is not None else None
        dtype = _autocast_dtype_for(value)
        if dtype is None:
            continue
        branches, others = _branches_to_matmuls(y)
        if not branches:
            continue
        keep_full = others or len(branches) > ln.MAX_READERS
        if keep_full and widened:
            continue
        if keep_full:
            branches = branches[:1]
        narrow = value.to(dtype)
        _set_argument(node, "out_dtype", dtype)
        for _, chain in branches:
            _narrow_example_values(chain, dtype)
        if len(branches) == 1 and not keep_full:
            y.meta["example_value"] = y.meta["val"] = narrow
        else:
            _split_into_readers(node, y, branches, narrow, value if keep_full else None)
        changed.append(node)
    return changed


def drop_cast_backs(graph: fx.Graph) -> list[tuple[fx.Node, torch.dtype, int]]:
    """Under autocast, a replacement's output in the autocast dtype that the rewriter cast back to
    fp32 (the model computed it in fp32: Hugging Face's NewGELU, whose `pow` CUDA's autocast runs
    in fp32, makes GPT-2's MLP activation fp32; the trifuse op returns its input's 16-bit dtype)
    and that one autocast-lowered matmul alone reads (through views) reaches that matmul uncast:
    the matmul would cast the exact fp32 copy back to the same bits, and its 16-bit gradient would
    come back through two exact casts. GPT-2 medium (H200, 2026-11-30): 4.9 ms a step of
    conversion kernels, 48 of the 50 `direct_copy` calls. With several readers the gradients
    would be summed in 16 bits instead of fp32: those casts stay, but where the output is a
    norm's y (a 16-bit LayerNorm under CUDA's autocast, which returns fp32: SD's UNet
    transformer blocks, a ViT kept in bf16), the norm returns a view of it per matmul (`readers`),
    their gradients summed in fp32 by its backward kernel, where the copy's backward rounded
    their fp32 sum to 16 bits. Returns (source, dtype, readers) per cast dropped."""
    if any(_switches_autocast(n) for n in graph.nodes):
        return []
    dropped = []
    for node in list(graph.nodes):
        if not (node.op == "call_method" and node.target == "to" and node.meta.get("trifuse_cast_back")):
            continue
        source = node.args[0]
        dtype = _autocast_dtype_for(example_value(node))
        narrow = example_value(source) if isinstance(source, fx.Node) else None
        if dtype is None or not isinstance(narrow, torch.Tensor) or narrow.dtype != dtype:
            continue
        branches, others = _branches_to_matmuls(node)
        if others or not branches:
            continue
        norm = None
        if len(branches) > 1:  # a view each: a norm's y, which nothing else reads, for up to three
            norm = _norm_of(source)
            if norm is None or len(source.users) != 1 or len(branches) > ln.MAX_READERS:
                continue
        for first, chain in branches:
            first.replace_input_with(node, source)
            _narrow_example_values(chain, dtype)
        graph.erase_node(node)
        if norm is not None:
            _set_argument(norm, "out_dtype", dtype)
            _split_into_readers(norm, source, branches, narrow, None)
        dropped.append((source, dtype, len(branches)))
    return dropped


def _norm_of(y: fx.Node) -> fx.Node | None:
    """The norm node (of `_NORMS`, not narrowed yet) whose y `y` is, or None."""
    for node in (y, y.args[0] if y.op == "call_function" and y.target is operator.getitem else None):
        if isinstance(node, fx.Node) and node.op == "call_function" and node.target in _NORMS and \
                _output(node, _NORMS[node.target]) is y and out_dtype(node) is None and readers(node) == 1 \
                and not full_y(node):
            return node
    return None


def share_input_casts(graph: fx.Graph) -> list[tuple[fx.Node, int, torch.dtype]]:
    """Under autocast, an fp32 value that several autocast-lowered matmuls read (through views) and
    that is not a norm's (those narrow above) — a post-norm block's input, which its query, key
    and value projections all read — is cast once, by `kernels.cast.cast_for_readers`, and each
    matmul reads its own view of that; whatever else reads the value reads it as before. Returns
    (value, readers, dtype) for each value changed. Eager graphs only (fuse's units): under
    Inductor the casts are its to fuse."""
    if any(_switches_autocast(n) for n in graph.nodes):
        return []
    changed = []
    for node in list(graph.nodes):
        if node.op not in ("placeholder", "call_function", "call_method") or \
                (node.op == "call_function" and node.target in _NORMS):
            continue
        value = example_value(node)
        dtype = _autocast_dtype_for(value)
        if dtype is None:
            continue
        branches, _ = _branches_to_matmuls(node)
        if len(branches) < 2:
            continue
        narrow = value.to(dtype)
        # after the last placeholder when the value is one: the graph's inputs stay first
        anchor = node if node.op != "placeholder" else [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(anchor):
            shared = graph.call_function(cast_for_readers, (node, dtype, len(branches)))
        shared.meta["example_value"] = shared.meta["val"] = (narrow,) * len(branches)
        with graph.inserting_after(shared):
            for i, (first, chain) in enumerate(branches):
                item = graph.call_function(operator.getitem, (shared, i))
                item.meta["example_value"] = item.meta["val"] = narrow
                first.replace_input_with(node, item)
                _narrow_example_values(chain, dtype)
        changed.append((node, len(branches), dtype))
    return changed


def fp32_weight_grads(graph: fx.Graph) -> list[tuple[fx.Node, torch.dtype]]:
    """Under autocast, each `F.linear(x, w[, b])`, `torch.mm(x, w)` and `torch.addmm(b, x, w)`
    (x 2-D, b a row vector, no scaling) whose weight w is an fp32 tensor that needs a gradient
    becomes `autocast_linear(x, w, b, dtype)`: the same forward, dW and db in fp32 from the GEMM
    and the sum. Returns (node, dtype) for each node changed. Eager graphs only (fuse's units):
    under Inductor the casts are its to fuse."""
    if any(_switches_autocast(n) for n in graph.nodes):
        return []
    changed = []
    for node in list(graph.nodes):
        call = _linear_call(node)
        if call is None:
            continue
        x, w, b, in_by_out = call
        weight = example_value(w)
        dtype = _autocast_dtype_for(weight)
        if dtype is None or not weight.requires_grad or weight.dim() != 2:
            continue
        if type(weight).__name__ == "DTensor":
            continue  # trifuse.parallel's sharded weights keep their own matmuls
        value = example_value(x)
        if not isinstance(value, torch.Tensor) or \
                value.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            continue
        bias = example_value(b) if b is not None else None
        if b is not None and not (isinstance(bias, torch.Tensor) and bias.is_floating_point()):
            continue
        if in_by_out and (value.dim() != 2 or (bias is not None and tuple(bias.shape) != (weight.shape[1],))):
            continue  # torch.mm / addmm as autocast_linear computes them: 2-D x, a bias per column
        node.target = autocast_linear
        node.args, node.kwargs = (x, w, b, dtype, in_by_out), {}
        changed.append((node, dtype))
    return changed


def _linear_call(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, bool] | None:
    """(x, weight, bias or None, weight stored (in, out)) of a linear / mm / addmm node with
    plain node arguments, else None."""
    if node.op != "call_function":
        return None
    args, kwargs = node.args, node.kwargs
    if node.target is torch._C._nn.linear:
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        call = (args[0], args[1], bias, False) if len(args) >= 2 and set(kwargs) <= {"bias"} else None
    elif node.target is torch.mm:
        call = (args[0], args[1], None, True) if len(args) == 2 and not kwargs else None
    elif node.target is torch.addmm:  # (captures spell out beta=1, alpha=1)
        plain = all(kwargs.get(k, 1) == 1 for k in ("beta", "alpha")) and set(kwargs) <= {"beta", "alpha"}
        call = (args[1], args[2], args[0], True) if len(args) == 3 and plain else None
    else:
        return None
    if call is None or not all(isinstance(a, fx.Node) for a in call[:2]) or \
            not (call[2] is None or isinstance(call[2], fx.Node)):
        return None
    return call


def _narrow_example_values(chain: list[fx.Node], dtype: torch.dtype) -> None:
    """The views between a narrowed value and its matmul now carry `dtype`: their example values
    say what runs."""
    for n in chain:
        v = example_value(n)
        n.meta["example_value"] = n.meta["val"] = v.to(dtype) if isinstance(v, torch.Tensor) else v


def _autocast_dtype_for(value: object) -> torch.dtype | None:
    """The 16-bit dtype autocast's matmuls cast `value` to, when it is an fp32 tensor on a device
    whose autocast (the capture's) is on with float16 or bfloat16; else None."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return None
    device_type = value.device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def full_y(node: fx.Node) -> bool:
    return bool(_argument(node, "full_y"))


def readers(node: fx.Node) -> int:
    return _argument(node, "readers") or 1


def out_dtype(node: fx.Node):
    return _argument(node, "out_dtype")


def _argument(node: fx.Node, name: str):
    """A norm node's argument, passed by keyword or (calls traced with every argument) position."""
    i = list(inspect.signature(node.target).parameters).index(name)
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def _set_argument(node: fx.Node, name: str, value) -> None:
    i = list(inspect.signature(node.target).parameters).index(name)
    if len(node.args) > i:
        node.args = (*node.args[:i], value, *node.args[i + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


def _output(node: fx.Node, index: int | None) -> fx.Node | None:
    """The node holding y: the op itself, or its only `getitem(op, index)` user."""
    if index is None:
        return node
    items = [u for u in node.users
             if u.op == "call_function" and u.target is operator.getitem and u.args[1] == index]
    return items[0] if len(items) == 1 else None


# A convolution module an fx graph calls (canonicalize keeps those as modules): autocast lowers it too.
_CONV_MODULES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
                 torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


def _lowered(node: fx.Node) -> bool:
    """Whether autocast runs `node` in its lower-precision dtype (LOWERED, or a convolution module)."""
    if node.op == "call_function":
        return node.target in LOWERED
    if node.op != "call_module" or node.graph.owning_module is None:
        return False
    try:
        module = node.graph.owning_module.get_submodule(node.target)
    except AttributeError:
        return False
    return type(module) in _CONV_MODULES


def _branches_to_matmuls(y: fx.Node) -> tuple[list[tuple[fx.Node, list[fx.Node]]], bool]:
    """(branches, others): y's uses that end in an autocast-lowered op reading them once, as
    (first node, its views), each view read by the next alone; and whether anything else reads y
    (the graph's output, another op, views feeding two matmuls or one matmul twice). Shape
    queries count as neither."""
    branches, others = [], False
    for first in y.users:
        if first.op == "call_method" and first.target in _SHAPE_ONLY:
            continue
        chain, value = [], first
        while value.op == "call_method" and value.target in _VIEWS:
            chain.append(value)
            uses = [u for u in value.users if not (u.op == "call_method" and u.target in _SHAPE_ONLY)]
            if len(uses) != 1:
                break
            value = uses[0]
        source = chain[-1] if chain else y
        if value is not source and _lowered(value) and \
                sum(a is source for a in (*value.args, *value.kwargs.values())) == 1:
            branches.append((first, chain))
        else:
            others = True
    return branches, others


def _split_into_readers(node: fx.Node, y: fx.Node, branches, narrow: torch.Tensor,
                        full: torch.Tensor | None) -> None:
    """y becomes a tuple: y in full first when `full` (its value) is given, then a view of the
    narrowed y per branch. Branch i reads its view; every other use (shape queries too) reads
    the first item."""
    _set_argument(node, "readers", len(branches))
    if full is not None:
        _set_argument(node, "full_y", True)
    values = ([full] if full is not None else []) + [narrow] * len(branches)
    graph = y.graph
    with graph.inserting_after(y):
        items = []
        for i, v in enumerate(values):
            item = graph.call_function(operator.getitem, (y, i))
            item.meta.update({k: y.meta[k] for k in ("nn_module_stack", "stack_trace") if k in y.meta})
            item.meta["example_value"] = item.meta["val"] = v
            items.append(item)
    views = items[1:] if full is not None else items
    for item, (first, _) in zip(views, branches):
        first.replace_input_with(y, item)
    for user in [u for u in y.users if u not in items]:
        user.replace_input_with(y, items[0])
    y.meta["example_value"] = y.meta["val"] = tuple(values)


def _switches_autocast(node: fx.Node) -> bool:
    """A node that turns autocast on or off inside the graph (Dynamo's `_enter_autocast`, a
    `torch.autocast` context object, `torch._C._set_autocast_enabled`)."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return "autocast" in str(target).lower()
