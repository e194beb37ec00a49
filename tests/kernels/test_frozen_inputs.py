"""Every op's gradients do not depend on which of its other inputs want one.

LoRA and partial fine-tuning freeze most parameters: a linear's bias folded into an op, a norm's
weight, an adaLN projection's output. The backward kernels skip what nobody asked for (a dbias
partial sum, a dgate product), and each such skip must not change what is computed for the
inputs that do want gradients (a bias still shifts the z that dgate multiplies). For each op and
each of its differentiable inputs, the gradients are computed once with every input requiring
grad (what the op's own tests check against float64), then with that one input frozen and with it
alone requiring grad: the gradients that remain must be the same. Both paths: the eager
`autograd.Function` and the registered `trifuse::` op (what torch.compile and fx graphs call),
reached here under a no-op TorchFunctionMode.
"""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from trifuse import ops

N = 24  # not a power of two


class _Traced(TorchFunctionMode):
    """Any active function mode sends the public ops to their registered `trifuse::` form."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _rand(*shape, scale=1.0, shift=0.0):
    return torch.randn(*shape) * scale + shift


def _cases():
    """name -> (inputs: dict of differentiable tensors, call(inputs) -> tensor or tuple)."""
    cases = {}

    def case(name, make, call):
        cases[name] = (make, call)

    case("bias_gelu", lambda: {"x": _rand(3, 5, N), "bias": _rand(N, scale=2)},
         lambda t: ops.bias_gelu(t["x"], t["bias"]))
    case("dropout_add_gated", lambda: {"x": _rand(3, 5, N), "residual": _rand(3, 5, N), "bias": _rand(N, scale=3),
                                           "gate": _rand(3, 1, N)},
         lambda t: ops.dropout_add(t["x"], t["residual"], 0.0, True, t["bias"], t["gate"]))
    case("dropout_add_gated_per_token", lambda: {"x": _rand(3, 5, N), "residual": _rand(3, 5, N),
                                                     "bias": _rand(N, scale=3), "gate": _rand(3, 5, N)},
         lambda t: ops.dropout_add(t["x"], t["residual"], 0.0, True, t["bias"], t["gate"]))
    case("dropout_add_layer_norm", lambda: {"x": _rand(3, 5, N), "residual": _rand(3, 5, N), "weight": _rand(N, shift=1),
                                                "bias": _rand(N), "x_bias": _rand(N, scale=3)},
         lambda t: ops.dropout_add_layer_norm(t["x"], t["residual"], N, t["weight"], t["bias"], x_bias=t["x_bias"]))
    case("gated_activation", lambda: {"gate": _rand(3, 5, N), "up": _rand(3, 5, N)},
         lambda t: ops.gated_activation(t["gate"], t["up"]))
    for per in ("sample", "token"):
        rows = 1 if per == "sample" else 5
        case(f"gated_add_layer_norm_modulate_per_{per}",
             lambda rows=rows: {"x": _rand(3, 5, N), "residual": _rand(3, 5, N), "gate": _rand(3, rows, N),
                                    "mul": _rand(3, rows, N), "add": _rand(3, rows, N), "weight": _rand(N, shift=1),
                                    "bias": _rand(N)},
             lambda t: ops.gated_add_layer_norm_modulate(t["x"], t["residual"], t["gate"], N, t["mul"], t["add"],
                                                         t["weight"], t["bias"], mul_offset=1.0))
        case(f"layer_norm_modulate_per_{per}",
             lambda rows=rows: {"x": _rand(3, 5, N), "mul": _rand(3, rows, N), "add": _rand(3, rows, N),
                                    "weight": _rand(N, shift=1), "bias": _rand(N)},
             lambda t: ops.layer_norm_modulate(t["x"], N, t["mul"], t["add"], t["weight"], t["bias"]))
    case("group_norm_silu", lambda: {"x": _rand(2, 6, 5, 3), "weight": _rand(6, shift=1), "bias": _rand(6)},
         lambda t: ops.group_norm(t["x"], 3, t["weight"], t["bias"], activation="silu"))
    case("layer_norm_residual", lambda: {"x": _rand(3, 5, N), "weight": _rand(N, shift=1), "bias": _rand(N),
                                             "residual": _rand(3, 5, N)},
         lambda t: ops.layer_norm(t["x"], N, t["weight"], t["bias"], residual=t["residual"]))
    case("layer_norm_add", lambda: {"x": _rand(3, 5, N), "residual": _rand(3, 5, N), "weight": _rand(N, shift=1),
                                        "bias": _rand(N)},
         lambda t: ops.layer_norm_add(t["x"], t["residual"], N, t["weight"], t["bias"]))
    case("rms_norm_residual", lambda: {"x": _rand(3, 5, N), "weight": _rand(N, shift=1), "residual": _rand(3, 5, N)},
         lambda t: ops.rms_norm(t["x"], N, t["weight"], residual=t["residual"]))
    case("rotary", lambda: {"q": _rand(2, 3, 5, 8), "k": _rand(2, 1, 5, 8)},
         lambda t: ops.rotary_embedding(t["q"], t["k"], *_rotary_table()))
    case("linear_cross_entropy", lambda: {"hidden": _rand(7, N), "weight": _rand(11, N, scale=0.3),
                                              "bias": _rand(11)},
         lambda t: ops.linear_cross_entropy(t["hidden"], t["weight"], torch.arange(7) % 11, t["bias"]))
    case("attention_sinks", lambda: {"q": _rand(2, 2, 5, 8), "k": _rand(2, 2, 6, 8), "v": _rand(2, 2, 6, 8),
                                         "sinks": _rand(2)},
         lambda t: ops.attention(t["q"], t["k"], t["v"], sinks=t["sinks"]))
    return cases


def _rotary_table():
    angle = torch.arange(5.0)[:, None] * torch.arange(1.0, 5.0)[None, :] * 0.3
    angle = torch.cat([angle, angle], dim=-1)[None, None]
    return angle.cos(), angle.sin()


CASES = _cases()


def _grads(make, call, wanted: set[str], traced: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    inputs = make()
    for name, t in inputs.items():
        t.requires_grad_(name in wanted)
    if traced:
        with _Traced():
            out = call(inputs)
    else:
        out = call(inputs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None and o.requires_grad]
    torch.manual_seed(2)
    loss = sum((o.float() * torch.randn(o.shape)).sum() for o in outs)
    grads = torch.autograd.grad(loss, [inputs[n] for n in sorted(wanted)], allow_unused=True)
    return dict(zip(sorted(wanted), grads))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "registered"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_do_not_depend_on_which_other_inputs_want_one(name, traced):
    make, call = CASES[name]
    every = set(make())
    full = _grads(make, call, every, traced)
    for held in sorted(every):
        for wanted in (every - {held}, {held}):
            if not wanted:
                continue
            part = _grads(make, call, wanted, traced)
            for n in sorted(wanted):
                assert (part[n] is None) == (full[n] is None), (name, n, wanted)
                if part[n] is not None:
                    torch.testing.assert_close(part[n], full[n], rtol=1e-5, atol=1e-5,
                                               msg=lambda m, n=n, w=wanted: f"{name}: d{n} with {sorted(w)} "
                                                                             f"wanting gradients: {m}")
