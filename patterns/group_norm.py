"""GroupNorm, and GroupNorm followed by SiLU, each becoming one `group_norm`.

`nn.GroupNorm` and `torch.group_norm` reach the rewriter as `F.group_norm` (fusion/normalize.py).
diffusers' ResNet blocks (Stable Diffusion's UNets and VAEs) write `nonlinearity(norm1(x))` with
`nonlinearity` an `nn.SiLU` (`F.silu(y, False)`); the SiLU written out, `y * torch.sigmoid(y)`,
is taken too. The SiLU joins the op only where it is the norm's one reader (the matcher leaves a
norm output read elsewhere to the plain spelling); an in-place SiLU is left as written.

Under CUDA autocast GroupNorm runs in fp32 (a 16-bit x in, fp32 out): the op computes in fp32 too
and returns x's dtype, and the rewriter casts it back to fp32 for the readers, so every value
the model sees keeps its dtype (fusion/rewriter.py).

Filters: num_groups and eps are constants (numbers); the op's own checks (run on the match's
example values before anything is replaced) reject a weight or bias of another shape or dtype,
and channels that do not divide into the groups, with their message in the report.
"""
import torch
import torch.nn.functional as F

from ._base import Match, Pattern, needs_number, ops


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
)
