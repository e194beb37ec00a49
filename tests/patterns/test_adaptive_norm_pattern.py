"""The adaptive norm's spellings (patterns/adaptive_norm.py): a norm modulated per sample by
vectors a conditioning MLP computes becomes `layer_norm_modulate`, through fx and Dynamo, with
outputs and every gradient (the conditioning MLP's included) equal to the unfused model's; so does
one modulated per token (FLUX.3's scale and shift (B, S, N)), read a row at a time, while a product
or a sum alone that varies along a sample's rows is left to the other patterns. The residual add
before such a norm (DiT's gated `h + gate * attn_out`) and a LayerScale's `h + gamma * x` before a
plain one fold into the norm as `gated_add_layer_norm_modulate`."""
import pytest
import torch
import torch.nn.functional as F
from _device import DEVICE
from _fusing import available_counts, check_against_unfused, cuda_like_autocast, fuse_via, op_names
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
        elif self.spelling == "scale_only":  # Lumina 2's, Z-Image's: a scale, no shift
            h = h * (1 + scale[:, None])
        elif self.spelling == "shift_only":  # HunyuanDiT's AdaLayerNormShift: a shift, no scale
            h = h + shift.unsqueeze(dim=1)
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


class SharedNorm(nn.Module):
    """LTX-2's audio-video cross-attention: one norm, modulated twice by vectors of its own per
    direction; `also` reads the norm itself as well (a projection), or has it read by products
    that are no modulation (gates that vary along the rows) instead."""

    def __init__(self, norm: str = "rms_norm", also: str | None = None) -> None:
        super().__init__()
        self.also = also
        self.norm = nn.RMSNorm(N, eps=1e-6, elementwise_affine=False) if norm == "rms_norm" else \
            nn.LayerNorm(N, eps=1e-6, elementwise_affine=False)
        self.ada = nn.Linear(COND, 4 * N)
        self.proj = nn.Linear(N, N)

    def forward(self, x, cond):
        scale_a, shift_a, scale_b, shift_b = self.ada(F.silu(cond))[:, None].chunk(4, dim=-1)
        h = self.norm(x)
        if self.also == "gated":  # (products alone: with a full-size sum a product is a per-token modulation)
            return self.proj(h * torch.sigmoid(x)) * (h * torch.tanh(x))
        if self.also == "gated_once":
            return self.proj(h * torch.sigmoid(x)) + (h * (1 + scale_a) + shift_a)
        out = self.proj(h * (1 + scale_a) + shift_a) * (h * (1 + scale_b) + shift_b)
        return out + self.proj(h) if self.also == "projection" else out


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_one_norm_modulated_twice_becomes_two_ops(norm, capture):
    report = check_against_unfused(lambda: SharedNorm(norm), inputs(), capture, train=True)
    assert report.by_pattern() == {f"{norm}_modulate": 2}, report.table()
    assert report.counts() == available_counts({norm: 2}), report.table()


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_a_norm_read_by_its_modulations_and_a_projection_stays_for_the_projection(capture):
    """(`proj(h) + proj(a) * b`: a sum of a full-size product, the gated add's op.)"""
    report = check_against_unfused(lambda: SharedNorm(also="projection"), inputs(), capture, train=True)
    assert report.by_pattern() == {"rms_norm_modulate": 2, "rms_norm": 1, "gated_add": 1}, report.table()


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("also, patterns", [("gated", {"rms_norm": 1}),
                                            ("gated_once", {"rms_norm": 1, "rms_norm_modulate": 1})])
def test_a_norm_read_by_products_that_are_no_modulation_runs_once(also, patterns, capture):
    """Gates that vary along the rows take no norm in: the norm runs once for them, beside the
    one modulation that takes it in."""
    report = check_against_unfused(lambda: SharedNorm(also=also), inputs(), capture, train=True)
    assert report.by_pattern() == patterns, report.table()
    fused = fuse_via(SharedNorm(also=also), capture)
    with torch.no_grad():
        fused(*inputs())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fused(*inputs())
    assert op_names(prof).count("trifuse::rms_norm") == 1


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("spelling, form", [("scale_only", "scale"), ("shift_only", "shift")])
def test_a_norm_scaled_or_shifted_alone_becomes_one_op(spelling, form, norm, capture):
    """Lumina 2's and Z-Image's `norm(x) * scale` (no shift), HunyuanDiT's `norm(x) +
    shift.unsqueeze(1)` (no scale): `layer_norm_modulate` with mul or add alone."""
    report = check_against_unfused(lambda: Modulated(spelling, norm, affine=True), inputs(), capture,
                                   train=True)
    assert report.by_pattern() == {f"{norm}_modulate_{form}": 1}, report.table()


def test_a_residual_added_after_a_norm_is_no_shift():
    """`norm(x) + x`: a full-size summand, not one vector per sample (negative control): the norm
    is fused alone."""
    report = check_against_unfused(lambda: NormPlusInput(), inputs(), "dynamo", train=True)
    assert "modulate" not in str(report.by_pattern()), report.table()


class NormPlusInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(N, elementwise_affine=False)
        self.proj = nn.Linear(N, N)

    def forward(self, x, cond):
        return self.proj(self.norm(x) + x)


def test_a_product_over_tokens_is_modulated_per_token():
    """`norm(x) * sigmoid(x) + shift`: the product varies along the rows, a per-token modulation
    (the row kernels read sigmoid(x) a row at a time beside the per-sample shift); outputs and
    gradients the unfused model's."""
    report = check_against_unfused(lambda: Modulated("full_size_gate"), inputs(), "dynamo", train=True)
    assert report.by_pattern() == {"layer_norm_modulate": 1}, report.table()


class PerToken(nn.Module):
    """FLUX.3's block: a conditioning vector per token (B, S, COND) projected to shift, scale and
    gate (B, S, N), then `(1 + scale) * norm(x) + shift` and the per-token gated add at the end (`scale_only`: Qwen-Image 2.1's
    `norm(x) * (1 + scale)`; `one_plus_read_twice`: the `1 + scale` read by a second product)."""

    def __init__(self, spelling: str = "flux3", norm: str = "layer_norm", affine: bool = False) -> None:
        super().__init__()
        self.spelling = spelling
        self.norm = (nn.RMSNorm(N, eps=1e-6, elementwise_affine=affine) if norm == "rms_norm"
                     else nn.LayerNorm(N, eps=1e-6, elementwise_affine=affine))
        self.ada = nn.Linear(COND, 3 * N)
        self.proj = nn.Linear(N, N)

    def forward(self, x, cond):
        shift, scale, gate = self.ada(F.silu(cond)).chunk(3, dim=-1)
        h = self.norm(x)
        if self.spelling == "flux3":
            h = (1 + scale) * h + shift
        elif self.spelling == "scale_only":
            h = h * (1 + scale)
        elif self.spelling == "one_plus_read_twice":
            one_plus = 1 + scale
            h = h * one_plus + shift + one_plus.sum()
        return x + gate * self.proj(h)


def per_token_inputs():
    return torch.randn(3, 7, N) * 2 + 0.5, torch.randn(3, 7, COND)


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("norm, affine", [("layer_norm", False), ("rms_norm", False), ("layer_norm", True),
                                          ("rms_norm", True)])
def test_a_norm_modulated_per_token_becomes_one_op(norm, affine, capture):
    """FLUX.3's per-token modulation: one op whose loads add the 1 to scale (`*_offset`), scale
    and shift read in place as chunks of the projection; every gradient the unfused model's."""
    report = check_against_unfused(lambda: PerToken("flux3", norm, affine), per_token_inputs(), capture,
                                   train=True)
    assert report.counts() == available_counts({norm: 1, "dropout_add": 1}), report.table()
    assert report.by_pattern() == {f"{norm}_modulate_offset": 1, "linear_gated_add": 1}, report.table()


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_a_norm_scaled_per_token_alone_becomes_one_op(norm):
    """Qwen-Image 2.1's `norm(x) * (1 + scale)` per token: the `1 +` says modulation."""
    report = check_against_unfused(lambda: PerToken("scale_only", norm), per_token_inputs(), "dynamo", train=True)
    assert report.by_pattern() == {f"{norm}_modulate_scale_offset": 1, "linear_gated_add": 1}, report.table()


def test_a_one_plus_scale_read_elsewhere_is_taken_as_written():
    """`1 + scale` read by another op too: the offset form would drop it, so the plain form takes
    the tensor the model computes as mul."""
    report = check_against_unfused(lambda: PerToken("one_plus_read_twice"), per_token_inputs(), "dynamo",
                                   train=True)
    assert report.by_pattern() == {"layer_norm_modulate": 1, "linear_gated_add": 1}, report.table()


def test_cuda_autocasts_fp32_norm_modulated_per_token():
    """Under CUDA-like autocast the norm of an fp16 x returns fp32 and the per-token modulation
    runs in fp32: the upcast offset form, y written in fp16 for the one matmul that reads it."""
    x, cond = per_token_inputs()
    with cuda_like_autocast(), torch.autocast("cuda" if DEVICE == "cuda" else "cpu", dtype=torch.float16):
        report = check_against_unfused(lambda: PerToken("flux3"), (x.half(), cond), "dynamo", train=True)
    assert report.by_pattern() == {"layer_norm_modulate_offset_upcast": 1, "linear_gated_add": 1}, report.table()


class GatedPerToken(PerToken):
    """Qwen-Image 2.1's image stream: `h = x + gate * attn(x)` with a per-token gate, then the
    norm of h modulated per token (`sum`: "gated", "plain" (Helios' cross-attention output added
    ungated), "per_sample_gate" (a per-sample gate beside the per-token modulation)); `form`: the
    modulation "flux3" `(1 + scale) * norm + shift`, "scale_only" `norm * (1 + scale)`, or
    "as_written" with `1 + scale` also read elsewhere (the plain stage-1 form)."""

    def __init__(self, sum_kind: str = "gated", form: str = "flux3", norm: str = "layer_norm",
                 affine: bool = False) -> None:
        super().__init__("flux3", norm, affine)
        self.sum_kind, self.form = sum_kind, form
        self.gate_proj = nn.Linear(COND, N)

    def forward(self, x, cond):
        shift, scale, gate = self.ada(F.silu(cond)).chunk(3, dim=-1)
        out = self.proj(x)
        if self.sum_kind == "gated":
            h = x + gate * out
        elif self.sum_kind == "per_sample_gate":
            h = x + self.gate_proj(cond.mean(1, keepdim=True)) * out
        else:
            h = x + out
        if self.form == "flux3":
            y = (1 + scale) * self.norm(h) + shift
        elif self.form == "scale_only":
            y = self.norm(h) * (1 + scale)
        else:
            one_plus = 1 + scale
            y = self.norm(h) * one_plus + shift + one_plus.mean()
        return self.proj(y) + h


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("norm, affine", [("layer_norm", False), ("rms_norm", True)])
def test_a_gated_add_before_a_norm_modulated_per_token_folds_into_it(norm, affine, capture):
    """The per-token gated add, the norm and its per-token modulation: one op (the row kernels with
    the residual), s read by the block's end; every gradient the unfused model's."""
    report = check_against_unfused(lambda: GatedPerToken("gated", "flux3", norm, affine), per_token_inputs(),
                                   capture, train=True)
    name = "gated_add_layer_norm_modulate_offset".replace("layer_norm", norm)
    assert report.by_pattern() == {name: 1}, report.table()


@pytest.mark.parametrize("sum_kind, form, pattern", [
    ("plain", "flux3", "add_layer_norm_modulate_offset"),
    ("gated", "scale_only", "gated_add_layer_norm_modulate_offset"),
    ("gated", "as_written", "gated_add_layer_norm_modulate"),
    ("per_sample_gate", "flux3", "gated_add_layer_norm_modulate_offset"),
])
def test_the_sums_and_modulations_per_token(sum_kind, form, pattern):
    """An ungated add (Helios), Qwen-Image 2.1's scale alone, a `1 + scale` read elsewhere (taken as
    written), a per-sample gate beside a per-token modulation: each sum folds into the norm."""
    report = check_against_unfused(lambda: GatedPerToken(sum_kind, form), per_token_inputs(), "dynamo", train=True)
    assert report.by_pattern() == {pattern: 1}, report.table()


def test_cuda_autocast_folds_a_per_token_gated_add_into_the_upcast_form():
    x, cond = per_token_inputs()
    with cuda_like_autocast(), torch.autocast("cuda" if DEVICE == "cuda" else "cpu", dtype=torch.float16):
        report = check_against_unfused(lambda: GatedPerToken("gated"), (x.half(), cond), "dynamo", train=True)
    assert report.by_pattern() == {"gated_add_layer_norm_modulate_offset_upcast": 1}, report.table()


def test_a_per_token_gate_read_twice_keeps_its_product():
    """The gated product read by another op as well: interior to the gated form, so the product
    stays PyTorch's and the add folds into the norm ungated, the product its x."""

    class ProductReadTwice(GatedPerToken):
        def forward(self, x, cond):
            shift, scale, gate = self.ada(F.silu(cond)).chunk(3, dim=-1)
            gated = gate * self.proj(x)
            h = x + gated
            return self.proj((1 + scale) * self.norm(h) + shift) + gated

    report = check_against_unfused(lambda: ProductReadTwice(), per_token_inputs(), "dynamo", train=True)
    assert report.by_pattern() == {"add_layer_norm_modulate_offset": 1}, report.table()


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


def test_what_is_no_modulation_per_token_is_named():
    from trifuse.patterns.adaptive_norm import _not_broadcast

    x = torch.empty(3, 7, N)
    for shape in ((3, 7, N), (7, N), (3, 7, 1), (1, 7, N), (3, 1, N), (N,)):
        assert _not_broadcast(torch.empty(shape), x) is None, shape
    assert "does not broadcast" in _not_broadcast(torch.empty(2, 7, N), x)
    assert "last dim" in _not_broadcast(torch.empty(3, 7, 5), x)
    assert "more dims" in _not_broadcast(torch.empty(1, 3, 7, N), x)


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


class CastToOwnDtype(Modulated):
    """CogView4's and HiDream's `norm(x).to(dtype=x.dtype)` before the modulation: a no-op cast."""

    def forward(self, x, cond):
        shift, scale = self.ada(F.silu(cond)).chunk(2, dim=1)
        h = self.norm(x).to(dtype=x.dtype)
        return self.proj(h * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_norm_cast_to_its_own_dtype_is_modulated(dtype):
    x, cond = inputs()
    report = check_against_unfused(lambda: CastToOwnDtype("dit").to(dtype), (x.to(dtype), cond.to(dtype)),
                                   "dynamo", train=True)
    assert report.by_pattern() == {"layer_norm_modulate_upcast": 1}, report.table()


def test_an_upcast_that_does_not_hold_the_product_is_left():
    """The `*_upcast` forms take a widening cast, or a cast to x's own dtype (a no-op), whose dtype
    holds the product and the sum; not a narrowing one."""
    from types import SimpleNamespace

    from trifuse.patterns.adaptive_norm import upcast_holds_the_product

    def match(x, mul, add, dtype):
        values = {"x": torch.empty(2, 3, 4, dtype=x), "mul": torch.empty(2, 1, 4, dtype=mul),
                  "add": torch.empty(2, 1, 4, dtype=add), "dtype": dtype}
        return SimpleNamespace(value=values.__getitem__)

    half, single, double = torch.float16, torch.float32, torch.float64
    assert upcast_holds_the_product(match(half, half, half, single)) is None
    assert upcast_holds_the_product(match(half, single, half, single)) is None
    assert "narrows" in upcast_holds_the_product(match(single, half, half, half))
    assert upcast_holds_the_product(match(single, single, single, single)) is None  # no-op: CogView4's
    assert upcast_holds_the_product(match(half, half, half, half)) is None
    assert "wider (torch.float32)" in upcast_holds_the_product(match(half, single, half, half))
    assert "wider (torch.float64)" in upcast_holds_the_product(match(half, double, half, single))
    assert "not a float dtype" in upcast_holds_the_product(match(half, half, half, torch.int32))


class GatedResidual(nn.Module):
    """A DiT block's middle: the attention's output (a linear here) added to the residual stream
    through a per-sample gate, then the MLP's modulated norm; `spelling` says how the add is written."""

    def __init__(self, spelling: str, norm: str = "layer_norm", p: float = 0.0) -> None:
        super().__init__()
        self.spelling = spelling
        self.drop = nn.Dropout(p)
        if norm == "rms_norm":
            self.norm = nn.RMSNorm(N, eps=1e-6, elementwise_affine=False)
        else:
            self.norm = nn.LayerNorm(N, eps=1e-6, elementwise_affine=False)
        self.ada = nn.Linear(COND, 3 * N)
        self.attn = nn.Linear(N, N)
        self.mlp = nn.Linear(N, N)

    def forward(self, h, cond):
        gate, shift, scale = self.ada(F.silu(cond)).chunk(3, dim=1)
        out = self.attn(h)
        if self.spelling == "dit":  # diffusers' BasicTransformerBlock: gate first, then the add
            out = gate.unsqueeze(1) * out
            h = out + h
        elif self.spelling == "flux":  # h + gate * out, the gate (B, 1, N) from a view
            h = h + gate.view(-1, 1, N) * out
        elif self.spelling == "ungated":  # PixArt's cross-attention output
            h = h + out
        elif self.spelling == "dropout":  # Wan's, LTX-Video's: the output's dropout right before
            h = h + self.drop(out)
        elif self.spelling == "gate_over_tokens":  # a product varying along the rows: not a gate
            h = h + torch.sigmoid(out) * out
        elif self.spelling == "broadcast":  # one token's output added to every row
            h = h + out[:, :1]
        norm = self.norm(h) * (1 + scale[:, None]) + shift[:, None]
        return h + self.mlp(norm)


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("spelling, pattern", [("dit", "gated_add_layer_norm_modulate"),
                                               ("flux", "gated_add_layer_norm_modulate"),
                                               ("ungated", "add_layer_norm_modulate")])
def test_the_residual_add_before_a_modulated_norm_folds_into_it(spelling, pattern, capture):
    """The sum the norm reads is the op's second result, which the block adds on (h + mlp(...))."""
    report = check_against_unfused(lambda: GatedResidual(spelling), inputs(), capture, train=True)
    assert report.counts() == available_counts({"residual_stream": 1}), report.table()
    assert report.by_pattern() == {pattern: 1}, report.table()


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("p, train", [(0.0, True), (0.1, False)], ids=["p0-train", "p0.1-eval"])
def test_an_add_after_an_inactive_dropout_folds_into_the_norm(p, train, norm, capture):
    """`h + dropout(out)` with the dropout an identity (diffusers' `Dropout(0.0)` on an attention's
    output, or any p in eval): stage 1 made it dropout_add; the add alone folds into the norm."""
    report = check_against_unfused(lambda: GatedResidual("dropout", norm, p), inputs(), capture, train=train)
    assert report.by_pattern() == {f"add_after_inactive_dropout_{norm}_modulate": 1}, report.table()


def test_an_active_dropout_keeps_its_dropout_add():
    """p = 0.1 in training: the dropout's mask needs dropout_add's pass (its bias folded in);
    the norm is modulated alone, and the report says why the add stayed out."""
    import trifuse
    from _fusing import fuse_via

    model = fuse_via(GatedResidual("dropout", p=0.1).train(), "dynamo")
    model(*inputs())
    report = trifuse.report(model)
    assert report.by_pattern() == {"layer_norm_modulate": 1, "linear_dropout_add": 1}, report.table()
    reasons = [why for *_, why in report.rejected()]
    assert any("the add is active (p = 0.1, training)" in why for why in reasons), report.table()


def test_rms_norm_after_a_gated_add():
    report = check_against_unfused(lambda: GatedResidual("dit", "rms_norm"), inputs(), "dynamo", train=True)
    assert report.by_pattern() == {"gated_add_rms_norm_modulate": 1}, report.table()


def test_a_product_over_tokens_is_a_per_token_gate():
    """`h + sigmoid(out) * out`: the product varies along the rows, a per-token gate (the row
    kernels read sigmoid(out) beside out); outputs and gradients the unfused model's."""
    report = check_against_unfused(lambda: GatedResidual("gate_over_tokens"), inputs(), "dynamo", train=True)
    assert report.by_pattern() == {"gated_add_layer_norm_modulate": 1}, report.table()


def test_a_broadcast_add_is_left():
    """`h + out[:, :1]` adds one row to every row: not a residual stream of one shape, so the
    modulated norm stays alone (negative control)."""
    report = check_against_unfused(lambda: GatedResidual("broadcast"), inputs(), "dynamo", train=True)
    assert report.by_pattern() == {"layer_norm_modulate": 1}, report.table()


def test_a_residual_stream_of_another_dtype_is_left():
    """x fp16 beside an fp32 residual: the model rounds the product to fp16 before an fp32 sum,
    which the op would not; the modulated norm is fused alone and the filter says why."""
    from types import SimpleNamespace

    from trifuse.patterns.adaptive_norm import gate_per_sample, sum_operands

    def match(x, residual, gate=None):
        values = {"x": x, "residual": residual, "gate": gate}
        return SimpleNamespace(value=values.__getitem__)

    x = torch.empty(2, 3, N, dtype=torch.float16)
    assert sum_operands(match(x, x)) is None
    assert "differ in dtype" in sum_operands(match(x, x.float()))
    assert "differ in shape" in sum_operands(match(x, torch.empty(1, 3, N, dtype=torch.float16)))
    assert gate_per_sample(match(x, x, torch.empty(2, 1, N, dtype=torch.float16))) is None
    assert "wider than x" in gate_per_sample(match(x, x, torch.empty(2, 1, N)))
    assert "varies along a sample's rows" in gate_per_sample(match(x, x, torch.empty(2, 3, N, dtype=x.dtype)))


def test_cuda_autocast_folds_the_gated_add_into_the_upcast_form():
    """A 16-bit residual stream under CUDA's autocast: the norm returns fp32 and is modulated in
    fp32 (`*_upcast`), the gated add before it folds in all the same."""
    x, cond = inputs()
    with cuda_like_autocast(), torch.autocast("cuda" if DEVICE == "cuda" else "cpu", dtype=torch.float16):
        report = check_against_unfused(lambda: GatedResidual("dit"), (x.half(), cond), "dynamo", train=True)
    assert report.by_pattern() == {"gated_add_layer_norm_modulate_upcast": 1}, report.table()


class LayerScaleBlock(nn.Module):
    """A ViT block with LayerScale (DINOv2, DeiT III, CaiT: timm's `ls1`, Hugging Face's
    `layer_scale1`): the attention's output (a linear here) scaled by a learned (N,) gamma, added to
    the residual stream, then the MLP's plain norm. `per_token`: a (S, N) scale instead, one vector
    per token (no LayerScale: a per-token gate)."""

    def __init__(self, norm: str = "layer_norm", per_token: bool = False,
                 product_first: bool = False) -> None:
        super().__init__()
        self.product_first = product_first
        self.norm = nn.RMSNorm(N, eps=1e-6) if norm == "rms_norm" else nn.LayerNorm(N, eps=1e-6)
        self.attn = nn.Linear(N, N)
        shape = (7, N) if per_token else (N,)
        self.gamma = nn.Parameter(torch.full(shape, 0.1) + 0.05 * torch.randn(shape))
        self.mlp = nn.Linear(N, N)

    def forward(self, h):
        h = self.attn(h) * self.gamma + h if self.product_first else h + self.gamma * self.attn(h)
        return h + self.mlp(self.norm(h))


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("norm, product_first",
                         [("layer_norm", False), ("rms_norm", False), ("layer_norm", True)])
def test_a_layer_scale_before_the_residual_add_folds_into_the_norm(norm, product_first, capture):
    """`h + gamma * attn(h)` feeding the norm (or `attn(h) * gamma + h`, as DINOv2 writes it): one
    op (its gamma's gradient summed in the norm's backward); outputs and every gradient, gamma's
    included, the unfused model's."""
    x = torch.randn(3, 7, N)
    report = check_against_unfused(lambda: LayerScaleBlock(norm, product_first=product_first), (x,), capture,
                                   train=True)
    assert report.counts() == available_counts({"residual_stream": 1}), report.table()
    assert report.by_pattern() == {"layer_scale_residual_norm": 1}, report.table()


def test_a_scale_per_token_folds_as_a_per_token_gate():
    """A (S, N) scale varies along a sample's rows: no LayerScale, but a per-token gate, which the
    gated op's row kernels read a row at a time; outputs and gradients the unfused model's."""
    x = torch.randn(3, 7, N)
    report = check_against_unfused(lambda: LayerScaleBlock(per_token=True), (x,), "dynamo", train=True)
    assert report.by_pattern() == {"layer_scale_residual_norm": 1}, report.table()


class FP32Norm(nn.Module):
    """diffusers' FP32LayerNorm: the norm of an fp32 copy, cast back; or the same RMSNorm."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.rms = norm == "rms_norm"
        self.weight, self.bias = nn.Parameter(1 + 0.1 * torch.randn(N)), nn.Parameter(0.1 * torch.randn(N))

    def forward(self, x):
        if self.rms:
            return F.rms_norm(x.float(), (N,), self.weight.float(), 1e-6).to(x.dtype)
        return F.layer_norm(x.float(), (N,), self.weight.float(), self.bias.float(), 1e-6).to(x.dtype)


class WanGatedAdd(nn.Module):
    """Wan's self-attention half: the modulation and the gate fp32 (a table plus the conditioning),
    the modulated norm of h's fp32 copy, the gated add written in fp32 and cast back to h's dtype,
    then the cross-attention's FP32 norm. `gate64`: an fp64 gate; `promoted`: ACE-Step's sum, no
    copy of h (the fp32 gate promotes it); `per_token`: Helios' fp32 gate, one per token."""

    def __init__(self, norm: str = "layer_norm", gate64: bool = False, promoted: bool = False,
                 per_token: bool = False) -> None:
        super().__init__()
        self.gate64, self.promoted, self.per_token = gate64, promoted, per_token
        self.gate_proj = nn.Linear(N, N)
        self.table = nn.Parameter(0.1 * torch.randn(1, 3, N))
        self.ada = nn.Linear(COND, 3 * N)
        self.attn = nn.Linear(N, N)
        self.norm2 = FP32Norm(norm)
        self.proj = nn.Linear(N, N)

    def forward(self, h, cond):
        shift, scale, gate = (self.table + self.ada(cond).view(-1, 3, N).float()).chunk(3, dim=1)
        gate = gate.double() if self.gate64 else gate
        if self.per_token:
            gate = 0.5 + 0.1 * self.gate_proj(h).float()
        norm = F.rms_norm if self.norm2.rms else F.layer_norm
        y = (norm(h.float(), (N,), eps=1e-6) * (1 + scale) + shift).type_as(h)
        h = ((h if self.promoted else h.float()) + self.attn(y) * gate).type_as(h)
        return h + self.proj(self.norm2(h.float()).type_as(h))


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_wans_gated_add_written_in_fp32_folds_into_the_norm_after_it(dtype, norm, capture):
    """`(h.float() + attn * gate).type_as(h)` then the fp32 norm of that: one op reading h in its
    own dtype and the fp32 gate (its sum in fp32, rounded once to h's dtype, as the model's). In
    fp16 the modulated norm of h's fp32 copy reads h too and writes fp16 itself. Outputs and every
    gradient."""
    x, cond = inputs()
    report = check_against_unfused(lambda: WanGatedAdd(norm).to(dtype), (x.to(dtype), cond.to(dtype)),
                                   capture, train=True)
    assert report.by_pattern().get(f"gated_add_in_fp32_{norm}") == 1, report.table()
    if dtype == torch.float16:
        assert report.by_pattern().get(f"fp32_copy_{norm}_modulate") == 1, report.table()


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_helios_per_token_fp32_gate_folds_into_the_norm_after_it(norm):
    """Helios' `(h.float() + attn * gate).type_as(h)` with an fp32 gate per token, then the fp32
    norm of that: one op (the row kernels with the residual); outputs and every gradient."""
    x, cond = inputs()
    report = check_against_unfused(lambda: WanGatedAdd(norm, per_token=True).half(), (x.half(), cond.half()),
                                   "dynamo", train=True)
    assert report.by_pattern().get(f"gated_add_in_fp32_{norm}") == 1, report.table()


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_ace_steps_gated_add_promoted_by_its_fp32_gate_folds(dtype, norm):
    """`(h + attn * gate).type_as(h)`: the same sum as Wan's, the fp32 gate promoting it without a
    copy of h written; one op as well. Outputs and every gradient."""
    x, cond = inputs()
    report = check_against_unfused(lambda: WanGatedAdd(norm, promoted=True).to(dtype),
                                   (x.to(dtype), cond.to(dtype)), "dynamo", train=True)
    assert report.by_pattern().get(f"gated_add_promoted_{norm}") == 1, report.table()


def test_an_fp64_gate_beside_an_fp32_stream_is_left():
    """A gate wider than fp32 beside an fp32 stream: the model's sum is fp64, rounded once to fp32,
    the op's would be fp32 throughout. Left as written, and the report says why (negative
    control)."""
    report = check_against_unfused(lambda: WanGatedAdd(gate64=True), inputs(), "dynamo", train=True)
    assert not any(p.startswith("gated_add") for p in report.by_pattern()), report.table()
    assert "the gate (torch.float64) is wider than" in report.table(), report.table()


def test_a_sum_in_fp32_cast_to_another_dtype_than_the_streams_is_left():
    """The filter of the fp32 sum: cast back to x's dtype (the op's s), over x's last dim alone,
    x and the residual alike, the gate no wider than fp32 (negative controls)."""
    from trifuse.patterns.residual_stream import sum_cast_back_to_the_stream

    class match(dict):  # a Match's reads: m["dtype"] (a constant), m.value(name)
        def __init__(self, x, residual, gate, dtype, shape=(N,)):
            super().__init__(x=x, residual=residual, gate=gate, dtype=dtype, normalized_shape=shape)

        value = dict.__getitem__

    x, gate = torch.empty(2, 3, N, dtype=torch.bfloat16), torch.empty(2, 1, N)
    fits = sum_cast_back_to_the_stream
    assert fits(match(x, x, gate, torch.bfloat16)) is None
    assert "not to x's dtype" in fits(match(x, x, gate, torch.float16))
    assert "not x's last dim alone" in fits(match(x, x, gate, torch.bfloat16, (3, N)))
    assert "differ in dtype" in fits(match(x, x.half(), gate, torch.bfloat16))
    assert "is wider than" in fits(match(x, x, gate.double(), torch.bfloat16))
    assert fits(match(x, x, torch.empty(2, 3, N), torch.bfloat16)) is None  # per token (Helios')
    assert "does not broadcast" in fits(match(x, x, torch.empty(4, 3, N), torch.bfloat16))


def test_dinov2s_layer_scales_fold_into_its_norms():
    """Hugging Face's DINOv2 (a tiny config): each block's two LayerScale adds fold into the norm
    after them (the next block's norm1, the final layernorm for the last), the model whole."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, image_size=16, patch_size=4, num_labels=3)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.Dinov2ForImageClassification(config)

        def forward(self, pixels):
            return self.model(pixel_values=pixels).logits

    report = check_against_unfused(Classifier, (torch.randn(2, 3, 16, 16),), "dynamo", train=True)
    assert report.by_pattern().get("layer_scale_residual_norm") == 4, report.table()
