"""The adaptive norm's spellings (patterns/adaptive_norm.py): a norm modulated per sample by
vectors a conditioning MLP computes becomes `layer_norm_modulate`, through fx and Dynamo, with
outputs and every gradient (the conditioning MLP's included) equal to the unfused model's; a
product or sum that varies along a sample's rows is left to the other patterns."""
import pytest
import torch
import torch.nn.functional as F
from _device import DEVICE
from _fusing import available_counts, check_against_unfused, cuda_like_autocast
from torch import nn

N, COND = 24, 10


class Modulated(nn.Module):
    """x (B, S, N) normalized, then modulated by (B, N) vectors from a conditioning vector (B,
    COND), in one of the spellings diffusion transformers use."""

    def __init__(self, spelling: str, norm: str = "layer_norm", affine: bool = False) -> None:
        super().__init__()
        self.spelling = spelling
        if norm == "rms_norm":
            self.norm = nn.RMSNorm(N, eps=1e-6, elementwise_affine=affine)
        else:
            self.norm = nn.LayerNorm(N, eps=1e-6, elementwise_affine=affine)
        self.ada = nn.Linear(COND, 2 * N)
        self.proj = nn.Linear(N, N)

    def forward(self, x, cond):
        shift, scale = self.ada(F.silu(cond)).chunk(2, dim=1)
        h = self.norm(x)
        if self.spelling == "dit":  # AdaLayerNormZero
            h = h * (1 + scale[:, None]) + shift[:, None]
        elif self.spelling == "continuous":  # AdaLayerNormContinuous: 1 + scale unsqueezed after
            h = h * (1 + scale)[:, None, :] + shift[:, None, :]
        elif self.spelling == "commuted":
            h = shift.unsqueeze(1) + (1 + scale.unsqueeze(1)) * h
        elif self.spelling == "pixart":  # (B, 1, N) chunks of a table plus the timestep embedding
            h = h * (1 + scale.view(-1, 1, N)) + shift.view(-1, 1, N)
        elif self.spelling == "full_size_gate":  # a product over tokens: not one vector per sample
            h = h * torch.sigmoid(x) + shift[:, None]
        return self.proj(h)


def inputs():
    return torch.randn(3, 7, N) * 2 + 0.5, torch.randn(3, COND)


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("spelling", ["dit", "continuous", "commuted", "pixart"])
def test_a_norm_modulated_per_sample_becomes_one_op(spelling, capture):
    report = check_against_unfused(lambda: Modulated(spelling), inputs(), capture, train=True)
    assert report.counts() == available_counts({"layer_norm": 1}), report.table()
    assert report.by_pattern() == {"layer_norm_modulate": 1}, report.table()


@pytest.mark.parametrize("norm, family", [("layer_norm", "layer_norm"), ("rms_norm", "rms_norm")])
def test_the_norms_own_affine_and_rms_norm(norm, family):
    report = check_against_unfused(lambda: Modulated("dit", norm, affine=True), inputs(), "dynamo",
                                   train=True)
    assert report.counts() == available_counts({family: 1}), report.table()
    pattern = "layer_norm_modulate" if norm == "layer_norm" else "rms_norm_modulate"
    assert report.by_pattern() == {pattern: 1}, report.table()


def test_a_product_over_tokens_is_not_a_modulation():
    """`norm(x) * sigmoid(x) + shift`: the product varies along the rows; the norm is fused alone,
    the product and the sum stay PyTorch's (negative control)."""
    report = check_against_unfused(lambda: Modulated("full_size_gate"), inputs(), "dynamo", train=True)
    assert report.by_pattern() == {"layer_norm": 1}, report.table()


def test_what_is_not_one_vector_per_sample_is_named():
    from trifuse.patterns.adaptive_norm import _not_per_sample

    x = torch.empty(3, 7, N)
    assert _not_per_sample(torch.empty(3, 1, N), x) is None
    assert _not_per_sample(torch.empty(N), x) is None
    assert _not_per_sample(torch.empty(3, 1, 1), x) is None
    assert "varies along a sample's rows" in _not_per_sample(torch.empty(3, 7, N), x)
    assert "varies along a sample's rows" in _not_per_sample(torch.empty(3, 7, 1), x)
    assert "varies along a sample's rows" in _not_per_sample(torch.empty(2, 1, N), x)
    assert "last dim" in _not_per_sample(torch.empty(3, 1, 5), x)
    assert "more dims" in _not_per_sample(torch.empty(1, 3, 1, N), x)


class DiffusersRMSNormModulated(nn.Module):
    """diffusers' RMSNorm without a weight (LTX-Video's norm1 and norm2: the mean square of an fp32
    copy, x itself times its rsqrt, cast back), modulated per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.ada = nn.Linear(COND, 2 * N)
        self.proj = nn.Linear(N, N)

    def forward(self, x, cond):
        shift, scale = self.ada(cond).chunk(2, dim=1)
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = (x * torch.rsqrt(variance + 1e-6)).to(x.dtype)
        return self.proj(h * (1 + scale[:, None]) + shift[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_diffusers_rms_norm_written_out_modulated(dtype):
    x, cond = inputs()
    report = check_against_unfused(lambda: DiffusersRMSNormModulated().to(dtype),
                                   (x.to(dtype), cond.to(dtype)), "dynamo", train=True)
    assert report.by_pattern() == {"rms_norm_modulate": 1}, report.table()


@pytest.mark.parametrize("spelling", ["dit", "continuous"])
def test_cuda_autocasts_fp32_norm_of_a_16_bit_x_is_modulated_in_fp32(spelling):
    """CUDA autocast's LayerNorm returns fp32 for an fp16 x, so the modulation runs in fp32: one
    op all the same (`*_upcast`: y computed in fp32), and y, read by one autocast matmul alone,
    written in fp16 directly; outputs and gradients by the oracle rule against the float64 model,
    the unfused one under the same autocast the yardstick."""
    x, cond = inputs()  # x in fp16: diffusers' DiT keeps its residual stream 16-bit under autocast
    with cuda_like_autocast(), torch.autocast("cuda" if DEVICE == "cuda" else "cpu", dtype=torch.float16):
        report = check_against_unfused(lambda: Modulated(spelling), (x.half(), cond), "dynamo", train=True)
    assert report.by_pattern() == {"layer_norm_modulate_upcast": 1}, report.table()
    notes = [r.note for u in report.units for c in u.unit.captures for r in c.log.replaced
             if r.pattern == "layer_norm_modulate_upcast"]
    assert notes and all("y in float16: only autocast's matmuls read it" in n for n in notes), notes


def test_an_upcast_that_does_not_hold_the_product_is_left():
    """The `*_upcast` forms take a widening cast whose dtype holds the product and the sum."""
    from types import SimpleNamespace

    from trifuse.patterns.adaptive_norm import upcast_holds_the_product

    def match(x, mul, add, dtype):
        values = {"x": torch.empty(2, 3, 4, dtype=x), "mul": torch.empty(2, 1, 4, dtype=mul),
                  "add": torch.empty(2, 1, 4, dtype=add), "dtype": dtype}
        return SimpleNamespace(value=values.__getitem__)

    half, single, double = torch.float16, torch.float32, torch.float64
    assert upcast_holds_the_product(match(half, half, half, single)) is None
    assert upcast_holds_the_product(match(half, single, half, single)) is None
    assert "does not widen" in upcast_holds_the_product(match(single, half, half, half))
    assert "does not widen" in upcast_holds_the_product(match(single, single, single, single))
    assert "wider (torch.float64)" in upcast_holds_the_product(match(half, double, half, single))
    assert "not a float dtype" in upcast_holds_the_product(match(half, half, half, torch.int32))
