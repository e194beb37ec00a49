"""One call of every op and form with differentiable inputs, for the tests that run each op the
same way (tests/kernels/test_frozen_inputs.py, tests/kernels/test_grad_layouts.py): small awkward
shapes, each input drawn fresh, and a no-op TorchFunctionMode that sends the public ops to their
registered `trifuse::` form."""
import torch
from torch.overrides import TorchFunctionMode
from trifuse import ops

N = 24  # not a power of two


class Traced(TorchFunctionMode):
    """Any active function mode sends the public ops to their registered `trifuse::` form."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def rand(*shape, scale=1.0, shift=0.0):
    return torch.randn(*shape) * scale + shift


def _cases():
    """name -> (inputs: dict of differentiable tensors, call(inputs) -> tensor or tuple)."""
    cases = {}

    def case(name, make, call):
        cases[name] = (make, call)

    case("bias_gelu", lambda: {"x": rand(3, 5, N), "bias": rand(N, scale=2)},
         lambda t: ops.bias_gelu(t["x"], t["bias"]))
    case("dropout_add_gated", lambda: {"x": rand(3, 5, N), "residual": rand(3, 5, N), "bias": rand(N, scale=3),
                                       "gate": rand(3, 1, N)},
         lambda t: ops.dropout_add(t["x"], t["residual"], 0.0, True, t["bias"], t["gate"]))
    case("dropout_add_gated_per_token", lambda: {"x": rand(3, 5, N), "residual": rand(3, 5, N),
                                                 "bias": rand(N, scale=3), "gate": rand(3, 5, N)},
         lambda t: ops.dropout_add(t["x"], t["residual"], 0.0, True, t["bias"], t["gate"]))
    case("dropout_add_layer_norm", lambda: {"x": rand(3, 5, N), "residual": rand(3, 5, N), "weight": rand(N, shift=1),
                                            "bias": rand(N), "x_bias": rand(N, scale=3)},
         lambda t: ops.dropout_add_layer_norm(t["x"], t["residual"], N, t["weight"], t["bias"], x_bias=t["x_bias"]))
    case("gated_activation", lambda: {"gate": rand(3, 5, N), "up": rand(3, 5, N)},
         lambda t: ops.gated_activation(t["gate"], t["up"]))
    for per in ("sample", "token"):
        rows = 1 if per == "sample" else 5
        case(f"gated_add_layer_norm_modulate_per_{per}",
             lambda rows=rows: {"x": rand(3, 5, N), "residual": rand(3, 5, N), "gate": rand(3, rows, N),
                                "mul": rand(3, rows, N), "add": rand(3, rows, N), "weight": rand(N, shift=1),
                                "bias": rand(N)},
             lambda t: ops.gated_add_layer_norm_modulate(t["x"], t["residual"], t["gate"], N, t["mul"], t["add"],
                                                         t["weight"], t["bias"], mul_offset=1.0))
        case(f"layer_norm_modulate_per_{per}",
             lambda rows=rows: {"x": rand(3, 5, N), "mul": rand(3, rows, N), "add": rand(3, rows, N),
                                "weight": rand(N, shift=1), "bias": rand(N)},
             lambda t: ops.layer_norm_modulate(t["x"], N, t["mul"], t["add"], t["weight"], t["bias"]))
    case("group_norm_silu", lambda: {"x": rand(2, 6, 5, 3), "weight": rand(6, shift=1), "bias": rand(6)},
         lambda t: ops.group_norm(t["x"], 3, t["weight"], t["bias"], activation="silu"))
    case("layer_norm_residual", lambda: {"x": rand(3, 5, N), "weight": rand(N, shift=1), "bias": rand(N),
                                         "residual": rand(3, 5, N)},
         lambda t: ops.layer_norm(t["x"], N, t["weight"], t["bias"], residual=t["residual"]))
    case("layer_norm_add", lambda: {"x": rand(3, 5, N), "residual": rand(3, 5, N), "weight": rand(N, shift=1),
                                    "bias": rand(N)},
         lambda t: ops.layer_norm_add(t["x"], t["residual"], N, t["weight"], t["bias"]))
    case("rms_norm_residual", lambda: {"x": rand(3, 5, N), "weight": rand(N, shift=1), "residual": rand(3, 5, N)},
         lambda t: ops.rms_norm(t["x"], N, t["weight"], residual=t["residual"]))
    case("rotary", lambda: {"q": rand(2, 3, 5, 8), "k": rand(2, 1, 5, 8)},
         lambda t: ops.rotary_embedding(t["q"], t["k"], *_rotary_table()))
    case("linear_cross_entropy", lambda: {"hidden": rand(7, N), "weight": rand(11, N, scale=0.3),
                                          "bias": rand(11)},
         lambda t: ops.linear_cross_entropy(t["hidden"], t["weight"], torch.arange(7) % 11, t["bias"]))
    case("attention_sinks", lambda: {"q": rand(2, 2, 5, 8), "k": rand(2, 2, 6, 8), "v": rand(2, 2, 6, 8),
                                     "sinks": rand(2)},
         lambda t: ops.attention(t["q"], t["k"], t["v"], sinks=t["sinks"]))
    # forms the frozen-input cases above do not reach: several outputs (readers of one narrowed y,
    # the residual stream's y and sum), a per-row loss, causal GQA attention, packed sequences
    case("layer_norm_three_readers_fp16", lambda: {"x": rand(3, 5, N), "weight": rand(N, shift=1), "bias": rand(N)},
         lambda t: ops.layer_norm(t["x"], N, t["weight"], t["bias"], out_dtype=torch.float16, readers=3))
    case("rms_norm_full_y", lambda: {"x": rand(3, 5, N), "weight": rand(N, shift=1)},
         lambda t: ops.rms_norm(t["x"], N, t["weight"], out_dtype=torch.float16, full_y=True))
    case("dropout_add_rms_norm", lambda: {"x": rand(3, 5, N), "residual": rand(3, 5, N), "weight": rand(N, shift=1)},
         lambda t: ops.dropout_add_layer_norm(t["x"], t["residual"], N, t["weight"], is_rms_norm=True))
    case("dropout_add", lambda: {"x": rand(3, 5, N), "residual": rand(3, 5, N), "bias": rand(N, scale=3)},
         lambda t: ops.dropout_add(t["x"], t["residual"], 0.0, True, t["bias"]))
    case("dropout_add_p", lambda: {"x": rand(3, 5, N), "residual": rand(3, 5, N)},
         lambda t: ops.dropout_add(t["x"], t["residual"], 0.3))
    case("rms_norm_add", lambda: {"x": rand(3, 5, N), "residual": rand(3, 5, N), "weight": rand(N, shift=1)},
         lambda t: ops.layer_norm_add(t["x"], t["residual"], N, t["weight"], is_rms_norm=True))
    case("cross_entropy_per_row", lambda: {"logits": rand(7, 11, scale=3)},
         lambda t: ops.cross_entropy(t["logits"], torch.tensor([0, 3, -100, 10, 5, 5, 1]), reduction="none"))
    case("attention_causal_gqa", lambda: {"q": rand(2, 4, 5, 8), "k": rand(2, 2, 7, 8), "v": rand(2, 2, 7, 8)},
         lambda t: ops.attention(t["q"], t["k"], t["v"], is_causal=True, enable_gqa=True))
    case("attention_varlen", lambda: {"q": rand(9, 2, 8), "k": rand(9, 2, 8), "v": rand(9, 2, 8)},
         lambda t: ops.attention_varlen(t["q"], t["k"], t["v"], torch.tensor([0, 4, 9], dtype=torch.int32),
                                        torch.tensor([0, 4, 9], dtype=torch.int32), causal=True))
    case("gated_activation_gelu_tanh", lambda: {"gate": rand(3, 5, N), "up": rand(3, 5, N)},
         lambda t: ops.gated_activation(t["gate"], t["up"], "gelu_tanh"))
    case("bias_gelu_dropout", lambda: {"x": rand(3, 5, N), "bias": rand(N, scale=2)},
         lambda t: ops.bias_gelu(t["x"], t["bias"], "tanh", 0.3))
    case("gated_activation_relu2_fp16", lambda: {"gate": rand(3, 5, N).half(), "up": rand(3, 5, N).half()},
         lambda t: ops.gated_activation(t["gate"], t["up"], "relu2"))
    case("gated_activation_dropout", lambda: {"gate": rand(3, 5, N), "up": rand(3, 5, N)},
         lambda t: ops.gated_activation(t["gate"], t["up"], "gelu_tanh", 0.3))
    # options and dtypes: masks (one that wants a gradient), dropout, softcap, windows, q/k/v as
    # transposed views of (B, S, H, D), no affine, 16-bit inputs, label smoothing
    case("attention_float_mask", lambda: {"q": rand(2, 2, 5, 8), "k": rand(2, 2, 7, 8), "v": rand(2, 2, 7, 8),
                                          "mask": rand(1, 2, 5, 7)},
         lambda t: ops.attention(t["q"], t["k"], t["v"], attn_mask=t["mask"]))
    case("attention_bool_mask_softcap_dropout", lambda: {"q": rand(2, 2, 5, 8), "k": rand(2, 2, 7, 8),
                                                         "v": rand(2, 2, 7, 8)},
         lambda t: ops.attention(t["q"], t["k"], t["v"], attn_mask=torch.arange(7) < 5, dropout_p=0.25,
                                 softcap=4.0))
    case("attention_transposed_fp16", lambda: {"q": rand(2, 5, 2, 16).half(), "k": rand(2, 7, 2, 16).half(),
                                               "v": rand(2, 7, 2, 16).half()},
         lambda t: ops.attention(*(t[n].transpose(1, 2) for n in "qkv"), is_causal=True))
    case("attention_varlen_window_sinks", lambda: {"q": rand(9, 2, 8), "k": rand(9, 2, 8), "v": rand(9, 2, 8),
                                                   "sinks": rand(2)},
         lambda t: ops.attention_varlen(t["q"], t["k"], t["v"], torch.tensor([0, 6, 9], dtype=torch.int32),
                                        torch.tensor([0, 6, 9], dtype=torch.int32), causal=True, sinks=t["sinks"],
                                        sliding_window=2))
    case("bias_gelu_quick_fp16", lambda: {"x": rand(3, 5, N).half(), "bias": rand(N).half()},
         lambda t: ops.bias_gelu(t["x"], t["bias"], "quick"))
    case("bias_relu_dropout_fp16", lambda: {"x": rand(3, 5, N).half(), "bias": rand(N).half()},
         lambda t: ops.bias_gelu(t["x"], t["bias"], "relu", 0.3))
    case("bias_relu2_fp16", lambda: {"x": rand(3, 5, N).half(), "bias": rand(N).half()},
         lambda t: ops.bias_gelu(t["x"], t["bias"], "relu2"))
    case("xielu", lambda: {"x": rand(3, 5, N, scale=2), "alpha_p": rand(1, scale=0.1, shift=0.8),
                           "alpha_n": rand(1, scale=0.1, shift=0.8)},
         lambda t: ops.xielu(t["x"], t["alpha_p"], t["alpha_n"], torch.tensor(0.5), torch.tensor(-1e-6)))
    case("cross_entropy_smoothing_fp16", lambda: {"logits": rand(7, 11, scale=3).half()},
         lambda t: ops.cross_entropy(t["logits"], torch.tensor([0, 3, -100, 10, 5, 5, 1]), label_smoothing=0.1))
    case("dropout_add_layer_norm_p", lambda: {"x": rand(3, 5, N), "residual": rand(3, 5, N),
                                              "weight": rand(N, shift=1), "bias": rand(N)},
         lambda t: ops.dropout_add_layer_norm(t["x"], t["residual"], N, t["weight"], t["bias"], p=0.25))
    case("group_norm_no_affine", lambda: {"x": rand(2, 6, 7)}, lambda t: ops.group_norm(t["x"], 2))
    case("channel_norm", lambda: {"x": rand(2, 6, 5, 3, shift=1), "weight": rand(6, shift=1),
                                  "bias": rand(6)},
         lambda t: ops.channel_norm(t["x"], t["weight"], t["bias"]))
    case("channel_norm_floored", lambda: {"x": rand(2, 7, 9), "weight": rand(7, shift=1)},
         lambda t: ops.channel_norm(t["x"], t["weight"], None, 1e-3, rms=True, clamp_eps=True))
    case("layer_norm_no_affine", lambda: {"x": rand(4, 3, N, scale=5, shift=2)}, lambda t: ops.layer_norm(t["x"], N))
    case("linear_cross_entropy_smoothing_sum", lambda: {"hidden": rand(7, N), "weight": rand(11, N, scale=0.3)},
         lambda t: ops.linear_cross_entropy(t["hidden"], t["weight"], torch.tensor([0, 3, -100, 10, 5, 5, 1]),
                                            reduction="sum", label_smoothing=0.2))
    case("rms_norm_fp16", lambda: {"x": rand(3, 5, N).half(), "weight": rand(N, shift=1).half()},
         lambda t: ops.rms_norm(t["x"], N, t["weight"]))
    case("rotary_interleaved", lambda: {"q": rand(2, 3, 5, 8), "k": rand(2, 3, 5, 8)},
         lambda t: ops.rotary_embedding(t["q"], t["k"], *_rotary_table(), interleaved=True))
    return cases


def _rotary_table():
    angle = torch.arange(5.0)[:, None] * torch.arange(1.0, 5.0)[None, :] * 0.3
    angle = torch.cat([angle, angle], dim=-1)[None, None]
    return angle.cos(), angle.sin()


CASES = _cases()


def permuted(t: torch.Tensor) -> torch.Tensor:
    """t's values and shape in other strides, dense: its first two dims stored swapped (a
    (batch, heads, seq, dim) view of a (batch, seq, heads, dim) projection; the last dim stays
    contiguous from 3 dims on, a 2-dim t becomes column-major). 1-dim tensors as they are."""
    return t if t.dim() < 2 else t.transpose(0, 1).contiguous().transpose(0, 1)


def sliced(t: torch.Tensor) -> torch.Tensor:
    """t's values and shape as the first half of a buffer twice as wide (the query of a fused QKV
    projection): rows apart by twice their width, not dense. 1-dim tensors as they are."""
    if t.dim() < 2:
        return t
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


LAYOUTS = {"contiguous": lambda t: t, "permuted": permuted, "sliced": sliced}


def run(name: str, wanted: set[str] | None, traced: bool, layout: str = "contiguous") -> tuple[dict, list]:
    """(inputs, outputs) of case `name`: its inputs drawn after torch.manual_seed(1), those in
    `wanted` (None: all) requiring grad, and the call's outputs that require grad, on the
    registered path when `traced`. Every input stored as LAYOUTS[layout] lays it out, the same
    values."""
    make, call = CASES[name]
    torch.manual_seed(1)
    inputs = {n: LAYOUTS[layout](t) for n, t in make().items()}
    for n, t in inputs.items():
        t.requires_grad_(wanted is None or n in wanted)
    if traced:
        with Traced():
            out = call(inputs)
    else:
        out = call(inputs)
    return inputs, [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None and o.requires_grad]
