"""GroupNorm, and GroupNorm followed by SiLU, each becoming one `group_norm`.

`nn.GroupNorm` and `torch.group_norm` reach the rewriter as `F.group_norm` (fusion/normalize.py).
diffusers' ResNet blocks (Stable Diffusion's UNets and VAEs) write `nonlinearity(norm1(x))` with
`nonlinearity` an `nn.SiLU` (`F.silu(y, False)`); the SiLU written out, `y * torch.sigmoid(y)`,
is taken too. The SiLU joins the op only where it is the norm's one reader (the matcher leaves a
norm output read elsewhere to the plain spelling); an in-place SiLU is left as written.

Under CUDA autocast GroupNorm runs in fp32 (a 16-bit x in, fp32 out): the op computes in fp32 too
and returns x's dtype, and the rewriter casts it back to fp32 for the readers, so every value
the model sees keeps its dtype (fusion/rewriter.py).

guided-diffusion's and CompVis' latent-diffusion's `GroupNorm32` (also in Stability's generative-
models, SDXL's training code) norms an fp32 copy and casts back, `super().forward(x.float()).type(
x.dtype)`, its parameters left in fp32 by `convert_to_fp16`: once fused, the op on the copy cast
back becomes the op on x itself (`group_norm_in_fp32`), which computes in fp32 and rounds once as
that did, without the copy (kept for the backward in fp32: twice x's bytes) or the two casts.

Filters: num_groups and eps are constants (numbers); the op's own checks (run on the match's
example values before anything is replaced) reject a weight or bias of another shape or dtype,
and channels that do not divide into the groups, with their message in the report.
"""
import torch
import torch.nn.functional as F

from ._base import Match, Pattern, needs_number, ops, params_fp32_or_like_input


def group_norm(x: torch.Tensor, num_groups, weight, bias, eps):
    return F.group_norm(x, num_groups, weight, bias, eps)


def group_norm_fused(x, num_groups, weight, bias, eps):
    return ops.group_norm(x, num_groups, weight, bias, eps)


def group_norm_silu(x: torch.Tensor, num_groups, weight, bias, eps):
    """diffusers' ResnetBlock2D: `self.nonlinearity(self.norm1(x))`, nonlinearity an nn.SiLU."""
    return F.silu(F.group_norm(x, num_groups, weight, bias, eps), False)


def group_norm_silu_written_out(x: torch.Tensor, num_groups, weight, bias, eps):
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return y * torch.sigmoid(y)


def group_norm_silu_fused(x, num_groups, weight, bias, eps):
    return ops.group_norm(x, num_groups, weight, bias, eps, "silu")


def group_norm_in_fp32(x: torch.Tensor, num_groups, weight, bias, eps, activation, dtype):
    return ops.group_norm(x.to(torch.float32), num_groups, weight, bias, eps, activation).to(dtype)


def group_norm_in_fp32_fused(x, num_groups, weight, bias, eps, activation, dtype):
    return ops.group_norm(x, num_groups, weight, bias, eps, activation)


def _casts_back_to_input(m: Match) -> str | None:
    """The result cast back to x's dtype, x 16-bit or fp32 (an fp32 x's copy is x itself; an fp64
    x's would round it: the op on x would compute in fp64, other maths)."""
    x = m.value("x")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x is {getattr(x, 'dtype', x)!r}, not 16-bit or float32"
    if m["dtype"] != x.dtype:
        return f"casts the result to {m['dtype']}, not to the input's {x.dtype}"
    return None


def groups_constant(m: Match) -> str | None:
    """num_groups a plain int: the op's grid and statistics are shaped by it."""
    groups = m["num_groups"]
    if isinstance(groups, bool) or not isinstance(groups, int):
        return f"num_groups is {groups!r}, not a constant int"
    return None


_OPS = ("group_norm",)
_FILTERS = (groups_constant, needs_number("eps"))

PATTERNS = (
    Pattern("group_norm_silu", "group_norm", group_norm_silu, group_norm_silu_fused, _OPS, _FILTERS),
    Pattern("group_norm_silu_written_out", "group_norm", group_norm_silu_written_out, group_norm_silu_fused,
            _OPS, _FILTERS),
    Pattern("group_norm", "group_norm", group_norm, group_norm_fused, _OPS, _FILTERS),
    # After the spellings above: the op on an fp32 copy of a 16-bit x, cast back, is the op on x.
    Pattern("group_norm_in_fp32", "group_norm", group_norm_in_fp32, group_norm_in_fp32_fused, _OPS,
            (*_FILTERS, _casts_back_to_input, params_fp32_or_like_input)),
)
