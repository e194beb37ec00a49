"""Norm outputs in the autocast dtype where only autocast's matmuls read them.

Under autocast a pre-norm block's residual stream stays fp32, so its norm returns fp32 and the
matmul after it (the attention's q/k/v projection, the MLP's first linear) casts that to bf16 or
fp16 first: one more kernel reading 4 and writing 2 bytes an element forward, and its backward
casting the matmul's 16-bit gradient back to fp32 for the norm's backward, on every layer. When
a fused norm's output goes to one such matmul alone (through views and reshapes), the norm may as
well write the 16-bit values itself (`out_dtype`): the kernel rounds the same fp32 result once, as
the cast did, so the matmul sees the same bits and the norm's backward gets the same gradient,
with two passes fewer. Not for an output several matmuls read (Llama's q/k/v projections):
autograd would sum their gradients in 16 bits, where the casts' gradients are summed in fp32.

The autocast state is the capture's (a capture is made per autocast mode and replayed only under
the same one); graphs that switch autocast inside are left alone, and so is any output that
reaches the graph's result or an op that is not in autocast's lower-precision list.
"""
import inspect
import operator

import torch
from torch import fx

from ..kernels import layer_norm as ln
from ..patterns._base import example_value

# Ops autocast runs in its lower-precision dtype, casting every fp32 tensor argument to it.
LOWERED = frozenset({torch._C._nn.linear, torch.addmm, torch.mm, torch.matmul, torch.bmm, torch.baddbmm,
                     operator.matmul})
# Methods that pass values on unchanged (any dtype), and those that read only the shape.
_VIEWS = frozenset({"view", "reshape", "flatten", "unflatten"})
_SHAPE_ONLY = frozenset({"size", "dim"})
# The trifuse ops that take out_dtype, and which of their results is y (None: the op's value).
_NORMS = {ln.layer_norm: None, ln.rms_norm: None, ln.dropout_add_layer_norm: 0}


def narrow_norm_outputs(graph: fx.Graph) -> list[fx.Node]:
    """Sets out_dtype to the autocast dtype on the norm nodes whose fp32 output goes to one
    autocast-lowered matmul alone; returns the nodes changed."""
    if any(_switches_autocast(n) for n in graph.nodes):
        return []
    changed = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _NORMS or out_dtype(node) is not None:
            continue
        y = _output(node, _NORMS[node.target])
        value = example_value(y) if y is not None else None
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            continue
        device_type = value.device.type
        if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
            continue
        dtype = torch.get_autocast_dtype(device_type)
        chain = _views_to_matmuls(y)
        if dtype not in (torch.float16, torch.bfloat16) or chain is None:
            continue
        _set_out_dtype(node, dtype)
        for n in (y, *chain):  # the example values say what now runs
            v = example_value(n)
            if isinstance(v, torch.Tensor) and v.dtype == torch.float32:
                n.meta["example_value"] = n.meta["val"] = v.to(dtype)
        changed.append(node)
    return changed


def _position(fn) -> int:
    return list(inspect.signature(fn).parameters).index("out_dtype")


def out_dtype(node: fx.Node):
    """The node's out_dtype, passed by keyword or (calls traced with every argument) position."""
    i = _position(node.target)
    return node.args[i] if len(node.args) > i else node.kwargs.get("out_dtype")


def _set_out_dtype(node: fx.Node, dtype: torch.dtype) -> None:
    i = _position(node.target)
    if len(node.args) > i:
        node.args = (*node.args[:i], dtype, *node.args[i + 1:])
    else:
        node.kwargs = {**node.kwargs, "out_dtype": dtype}


def _output(node: fx.Node, index: int | None) -> fx.Node | None:
    """The node holding y: the op itself, or its only `getitem(op, index)` user."""
    if index is None:
        return node
    items = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == index]
    return items[0] if len(items) == 1 else None


def _views_to_matmuls(y: fx.Node) -> list[fx.Node] | None:
    """The view nodes between y and the one autocast-lowered op that reads it, when that op (once)
    and shape queries are all y's uses; None otherwise (a second matmul, the graph's output, any
    other op). One reader only: the gradients of several would be summed in the 16-bit dtype,
    where autograd sums the fp32 gradients of their casts."""
    chain, todo, matmuls = [], [y], []
    while todo:
        value = todo.pop()
        for user in value.users:
            if user.op == "call_function" and user.target in LOWERED:
                matmuls += [user] * sum(a is value for a in (*user.args, *user.kwargs.values()))
            elif user.op == "call_method" and user.target in _SHAPE_ONLY:
                continue
            elif user.op == "call_method" and user.target in _VIEWS and user.args[0] is value:
                chain.append(user)
                todo.append(user)
            else:
                return None
    return chain if len(matmuls) == 1 else None


def _switches_autocast(node: fx.Node) -> bool:
    """A node that turns autocast on or off inside the graph (Dynamo's `_enter_autocast`, a
    `torch.autocast` context object, `torch._C._set_autocast_enabled`)."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return "autocast" in str(target).lower()
