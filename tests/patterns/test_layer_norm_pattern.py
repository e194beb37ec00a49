"""LayerNorm / RMSNorm spellings become one trifuse norm, through fx and through Dynamo; the
fused model equals the unfused one by the oracle rule; near misses stay as written."""
import copy

import pytest
import torch
import torch.nn.functional as F
import trifuse
from _fusing import check_against_unfused, fuse_via, trifuse_ops_run
from _hf_norms import (
    CentredOnceLayerNorm,
    CohereLayerNorm,
    GemmaRMSNorm,
    HFRMSNorm,
    MochiRMSNorm,
    OlmoLayerNorm,
    T5LayerNorm,
)
from torch import nn
from transformers.models.clip.modeling_clip import _get_vector_norm as clip_vector_norm
from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm
from transformers.models.deberta.modeling_deberta import DebertaLayerNorm
from transformers.models.dory.modeling_dory import DoryL2Norm
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
from transformers.models.nanochat.modeling_nanochat import NanoChatRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import l2norm as qwen3_next_l2norm
from transformers.models.vitdet.modeling_vitdet import VitDetLayerNorm

N = 24
X = (torch.randn(3, 5, N),)
CAPTURES = ["fx", "dynamo"]


class ModuleLayerNorm(nn.Module):
    def __init__(self, affine=True):
        super().__init__()
        self.ln = nn.LayerNorm(N, eps=1e-6, elementwise_affine=affine)

    def forward(self, x):
        return self.ln(x) * 2.0


class FunctionalLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(N)), nn.Parameter(torch.randn(N))

    def forward(self, x):
        return F.layer_norm(x, (N,), weight=self.w, bias=self.b, eps=1e-4)


class TorchLayerNorm(FunctionalLayerNorm):
    def forward(self, x):
        return torch.layer_norm(x, [N], self.w, self.b, 1e-5)


class ModuleRMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(N, eps=1e-6)

    def forward(self, x):
        return self.norm(x)


class FP32CopyNotCastBack(GemmaRMSNorm):
    def forward(self, x):
        return self._norm(x.float()) * (1.0 + self.weight.float())


def deberta_layer_norm(dtype=torch.float32):
    """transformers' own DebertaLayerNorm (written out on an fp32 copy, divided by the root, cast
    back, then weight * h + bias), its parameters random and in `dtype`."""
    norm = DebertaLayerNorm(N, 1e-7)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(N))
        norm.bias.copy_(0.1 * torch.randn(N))
    return norm.to(dtype)


class HandRMSNorm(nn.Module):
    def __init__(self, dim=-1):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(N))
        self.dim = dim

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(self.dim, keepdim=True) + 1e-5) * self.weight


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [
    (ModuleLayerNorm, "layer_norm"),
    (lambda: ModuleLayerNorm(affine=False), "layer_norm"),
    (FunctionalLayerNorm, "layer_norm"),
    (TorchLayerNorm, "layer_norm"),
    (ModuleRMSNorm, "rms_norm"),
    (HFRMSNorm, "rms_norm_upcast"),
    (HandRMSNorm, "rms_norm_written_out"),
    (GemmaRMSNorm, "rms_norm_in_fp32"),
    (OlmoLayerNorm, "layer_norm_in_fp32"),
    (T5LayerNorm, "rms_norm_t5"),
    (MochiRMSNorm, "rms_norm_t5_cast_back"),
    (CohereLayerNorm, "layer_norm_in_fp32"),  # written out on an fp32 copy: spelling, then the copy goes
    (CentredOnceLayerNorm, "layer_norm_written_out_centred_once"),
    # transformers' own Gemma 4 norm: pow(ms, -0.5) on an fp32 copy, with a weight or none
    (lambda: Gemma4RMSNorm(N), "rms_norm_in_fp32"),
    (lambda: Gemma4RMSNorm(N, with_scale=False), "rms_norm_in_fp32"),
    (NanoChatRMSNorm, "rms_norm_in_fp32"),  # no weight, rsqrt, on an fp32 copy
    (deberta_layer_norm, "layer_norm_upcast_div_sqrt"),
], ids=["nn.LayerNorm", "nn.LayerNorm-no-affine", "F.layer_norm-kwargs", "torch.layer_norm", "nn.RMSNorm",
        "hf-rmsnorm", "written-out-rmsnorm", "gemma-rmsnorm", "olmo-layernorm", "t5-layernorm",
        "mochi-rmsnorm", "cohere-layernorm", "written-out-layernorm-centred-once", "gemma4-rmsnorm",
        "gemma4-rmsnorm-no-scale", "nanochat-rmsnorm", "deberta-layernorm"])
def test_spelling_fuses_and_matches(make, pattern, capture):
    report = check_against_unfused(make, X, capture)
    assert report.by_pattern() == {pattern: 1}


def test_trifuse_op_runs():
    from _fusing import fuse_via, trifuse_ops_run

    model = fuse_via(HFRMSNorm(), "dynamo")
    x = X[0].clone().requires_grad_()
    names = trifuse_ops_run(lambda: model(x).sum().backward())
    assert "trifuse::rms_norm" in names
    assert any(n.endswith("_backward") for n in names), names


@pytest.mark.parametrize("capture", CAPTURES)
def test_hf_rmsnorm_mixed_dtypes_keeps_the_weight_apart(capture):
    # fp16 activations, fp32 weight: HF rounds the normalized value to fp16, then multiplies by the
    # fp32 weight, returning fp32. The fused model does the same (weight kept apart).
    x = (torch.randn(3, 5, N).half(),)
    report = check_against_unfused(HFRMSNorm, x, capture, grads=False)
    assert report.by_pattern() == {"rms_norm_upcast_weight_apart": 1}


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [
    (GemmaRMSNorm, "rms_norm_in_fp32"),  # the fp32 (1 + w) joins the fp32 maths; one rounding to fp16
    (OlmoLayerNorm, "layer_norm_in_fp32"),
    (T5LayerNorm, "rms_norm_t5"),  # fp32 weight: the model returns fp32, the op normalizes an fp32 copy
    # the weight in x's dtype joins the norm (rounded once, as Llama's fp16 weight)
    (lambda: T5LayerNorm(dtype=torch.float16), "rms_norm_t5_half"),
    # the weight, fp32 or fp16, joins the fp32 product before the one cast back
    (MochiRMSNorm, "rms_norm_t5_cast_back"),
    (lambda: MochiRMSNorm(dtype=torch.float16), "rms_norm_t5_cast_back"),
    (CohereLayerNorm, "layer_norm_in_fp32"),
    (lambda: Gemma4RMSNorm(N), "rms_norm_in_fp32"),
    # fp32 weight and bias: the normalized value rounds to fp16, the affine promotes to fp32
    (deberta_layer_norm, "layer_norm_upcast_div_sqrt_weight_apart"),
    (lambda: deberta_layer_norm(torch.float16), "layer_norm_upcast_div_sqrt"),  # fp16 parameters join
], ids=["gemma", "olmo", "t5-fp32-weight", "t5-fp16-weight", "mochi-fp32-weight", "mochi-fp16-weight",
        "cohere", "gemma4", "deberta-fp32-params", "deberta-fp16-params"])
def test_fp16_activations_keep_the_models_roundings(make, pattern, capture):
    x = (torch.randn(3, 5, N).half(),)
    report = check_against_unfused(make, x, capture, grads=False)
    assert report.by_pattern() == {pattern: 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_t5_norm_of_fp32_activations_with_a_16_bit_weight_keeps_its_two_roundings(capture):
    """fp32 x, fp16 weight: T5 rounds the normalized value to fp16, then multiplies by the weight
    in fp16; the op's fp32 output would be wider. The weight stays apart, the cast with it."""
    report = check_against_unfused(lambda: T5LayerNorm(dtype=torch.float16), X, capture)
    assert report.by_pattern() == {"rms_norm_t5_half_weight_apart": 1}, report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_fp32_copy_kept_when_the_result_stays_fp32(capture):
    # fp16 in, fp32 out: the norm needs the fp32 copy (its result is fp32); only the spelling fuses.
    x = (torch.randn(3, 5, N).half(),)
    report = check_against_unfused(FP32CopyNotCastBack, x, capture, grads=False)
    assert report.by_pattern() == {"rms_norm_written_out": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_eps_is_kept(capture):
    # A large eps changes the result visibly: fusing with any other eps would fail the oracle.
    report = check_against_unfused(lambda: HFRMSNorm(eps=0.5), X, capture)
    assert report.by_pattern() == {"rms_norm_upcast": 1}


class WrittenOutLayerNorm(nn.Module):
    """LayerNorm written out in x's dtype, as BERT ports from before `nn.LayerNorm` and hand-written
    models spell it: `variance` and `root` choose the spelling, `affine` what follows the norm."""

    def __init__(self, variance, root, affine="weight_bias", eps=1e-5):
        super().__init__()
        self.variance, self.root, self.affine, self.eps = variance, root, affine, eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(N))
        self.bias = nn.Parameter(0.1 * torch.randn(N))

    def forward(self, x):
        if self.variance == "var_mean":
            var, mean = torch.var_mean(x, dim=-1, unbiased=False, keepdim=True)
            centred = x - mean
        else:
            mean = x.mean(-1, keepdim=True)
            centred = x - mean
            if self.variance == "var":
                var = x.var(-1, keepdim=True, unbiased=False)
            elif self.variance == "var_correction":
                var = torch.var(x, dim=[-1], correction=0, keepdim=True)
            elif self.variance == "centred_twice":
                var = ((x - mean) ** 2).mean(-1, keepdim=True)
            else:
                var = centred.square().mean(-1, keepdim=True)
        if self.root == "div_sqrt":
            h = centred / torch.sqrt(var + self.eps)
        else:
            h = centred * (var + self.eps).rsqrt()
        if self.affine == "weight_bias":  # the pytorch-pretrained-bert order
            return self.weight * h + self.bias
        if self.affine == "bias_weight_after":
            return h * self.weight + self.bias
        if self.affine == "weight":
            return h * self.weight
        if self.affine == "bias":
            return h + self.bias
        return h


LAYER_NORM_SPELLINGS = [(v, r) for v in ("centred_twice", "centred_once", "var", "var_correction", "var_mean")
                        for r in ("rsqrt", "div_sqrt")]
_BARE = {"var_correction": "var"}  # torch.var(correction=0) and x.var(unbiased=False): one form


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("variance, root", LAYER_NORM_SPELLINGS,
                         ids=[f"{v}-{r}" for v, r in LAYER_NORM_SPELLINGS])
def test_layer_norm_written_out_fuses_with_its_weight_and_bias(variance, root, capture):
    report = check_against_unfused(lambda: WrittenOutLayerNorm(variance, root), X, capture)
    assert report.counts() == {"layer_norm": 1}, report.table()
    # the spellings whose weight comes last fuse with the weight in the first step
    assert report.by_pattern() == {"layer_norm_bias_folded": 1}
    if root == "div_sqrt" or variance in ("var", "var_correction", "var_mean"):
        bare = f"layer_norm_bare_{_BARE.get(variance, variance)}_{root}"
        assert f"spelled as {bare}; weight folded in; bias folded in" in report.table()


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("affine, pattern", [
    ("bias_weight_after", "layer_norm_bias_folded"), ("weight", "layer_norm_weight_folded"),
    ("bias", "layer_norm_bias_folded"), ("none", "layer_norm_bare_var_div_sqrt"),
])
def test_layer_norm_written_out_takes_what_affine_follows(affine, pattern, capture):
    report = check_against_unfused(lambda: WrittenOutLayerNorm("var", "div_sqrt", affine), X, capture)
    assert report.by_pattern() == {pattern: 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_layer_norm_written_out_keeps_its_eps_and_fp16_roundings(capture):
    report = check_against_unfused(lambda: WrittenOutLayerNorm("centred_twice", "div_sqrt", eps=0.5), X,
                                   capture)
    assert report.by_pattern() == {"layer_norm_bias_folded": 1}
    x16 = (torch.randn(3, 5, N).half(),)
    report = check_against_unfused(lambda: WrittenOutLayerNorm("var", "rsqrt").half(), x16, capture,
                                   grads=False)
    assert report.by_pattern() == {"layer_norm_bias_folded": 1}


class ParamsApart(WrittenOutLayerNorm):
    """fp32 parameters on fp16 activations (the product promotes): the norm fuses, the affine
    stays the model's; or a per-token scale and shift (adaLN's modulation), which is no affine but
    a modulation per token: one op with it."""

    def __init__(self, kind):
        super().__init__("var", "div_sqrt", "none")
        self.kind = kind

    def forward(self, x):
        h = super().forward(x)
        if self.kind == "fp32_params":
            return h * self.weight.float() + self.bias.float()
        return h * (1 + x[..., :1]) + x[..., 1:2]


@pytest.mark.parametrize("capture", CAPTURES)
def test_an_affine_that_is_not_the_norms_own_stays_apart(capture):
    x16 = (torch.randn(3, 5, N).half(),)
    report = check_against_unfused(lambda: ParamsApart("fp32_params").half(), x16, capture, grads=False)
    assert report.by_pattern() == {"layer_norm_bare_var_div_sqrt": 1}
    assert report.rejected() == []  # a product that is no norm's weight is not worth a line
    report = check_against_unfused(lambda: ParamsApart("per_token"), X, capture)
    assert report.by_pattern() == {"layer_norm_modulate_offset": 1}


class WrittenOutRMSNorm(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(N))

    def forward(self, x):
        if self.spelling == "square":
            return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.weight
        if self.spelling == "self_product":
            return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6) * self.weight
        if self.spelling == "div_sqrt":
            return self.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        return x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()  # no weight, sqrt as a method


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("spelling, pattern", [
    ("square", "rms_norm_written_out"), ("self_product", "rms_norm_written_out"),
    ("div_sqrt", "rms_norm_weight_folded"), ("div_sqrt_no_weight", "rms_norm_div_sqrt_no_weight"),
])
def test_rmsnorm_written_out_with_a_square_or_a_division(spelling, pattern, capture):
    report = check_against_unfused(lambda: WrittenOutRMSNorm(spelling), X, capture)
    assert report.by_pattern() == {pattern: 1}


# ---------------------------------------------------------------------------------------------
# Norms over the channels of channels-first maps (conv nets' LayerNorm2d and RmsNorm2d, written
# out): one norm over x with its channels moved last, the weight and bias folded in.
# ---------------------------------------------------------------------------------------------

C = 6
MAP = (torch.randn(2, C, 5, 3),)


class ChannelsRMSNorm(nn.Module):
    """timm's `rms_norm2d` (RmsNorm2d: MobileNet V5, Gemma 3n's vision tower), with a weight
    (`weight.reshape(1, -1, 1, 1)`) or without; `dim` as it writes it or as a one-entry tuple."""

    def __init__(self, affine=True, dim=1):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(C)) if affine else None
        self.dim = dim

    def forward(self, x):
        v = torch.mean(x.pow(2), dim=self.dim, keepdim=True)
        x = x * torch.rsqrt(v + 1e-6)
        return x if self.weight is None else x * self.weight.reshape(1, -1, 1, 1)


class ChannelsLayerNorm(nn.Module):
    """LayerNorm2d written out: the centred value twice, `* rsqrt`, `weight[:, None, None]` after
    (ConvNeXt's original); over (B, C, L) maps too (`unsqueeze(-1)` for the weight); with
    `var_mean`, timm's LayerNormExp2d on a channels-last map (`_layer_norm_cf`)."""

    def __init__(self, var_mean=False):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(C))
        self.bias = nn.Parameter(0.1 * torch.randn(C))
        self.var_mean = var_mean

    def forward(self, x):
        if self.var_mean:
            s, u = torch.var_mean(x, dim=1, unbiased=False, keepdim=True)
        else:
            u = x.mean(1, keepdim=True)
            s = ((x - u) ** 2).mean(dim=1, keepdim=True)
        x = (x - u) * torch.rsqrt(s + 1e-6)
        if x.dim() == 3:
            return x * self.weight.unsqueeze(-1) + self.bias.unsqueeze(-1)
        return x * self.weight[:, None, None] + self.bias[:, None, None]


def vitdet_layer_norm():
    """transformers' own VitDetLayerNorm: `(x - u) / sqrt(s + eps)`, `weight[:, None, None] * x + bias`."""
    norm = VitDetLayerNorm(C)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(C))
        norm.bias.copy_(0.1 * torch.randn(C))
    return norm


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, inputs, pattern, spelled", [
    (ChannelsRMSNorm, MAP, "rms_norm_over_channels", "rms_norm_written_out_no_weight; weight folded in"),
    (lambda: ChannelsRMSNorm(affine=False), MAP, "rms_norm_over_channels", "rms_norm_written_out_no_weight"),
    (lambda: ChannelsRMSNorm(dim=(1,)), MAP, "rms_norm_over_channels",
     "rms_norm_written_out_no_weight; weight folded in"),
    (lambda: ChannelsRMSNorm(dim=-3), MAP, "rms_norm_over_channels",
     "rms_norm_written_out_no_weight; weight folded in"),
    (ChannelsLayerNorm, MAP, "layer_norm_over_channels",
     "layer_norm_bare_centred_twice_rsqrt; weight folded in; bias folded in"),
    (ChannelsLayerNorm, (torch.randn(3, C, 7),), "layer_norm_over_channels",
     "layer_norm_bare_centred_twice_rsqrt; weight folded in; bias folded in"),
    (lambda: ChannelsLayerNorm(var_mean=True), (MAP[0].to(memory_format=torch.channels_last),),
     "layer_norm_channels_bias_folded", "layer_norm_bare_var_mean_rsqrt; weight folded in; bias folded in"),
    (vitdet_layer_norm, MAP, "layer_norm_over_channels",
     "layer_norm_bare_centred_twice_div_sqrt; weight folded in; bias folded in"),
], ids=["rms-norm-2d", "rms-norm-2d-no-weight", "dim-tuple", "dim-negative", "layer-norm-2d",
        "layer-norm-1d-map", "layer-norm-exp-2d-channels-last", "vitdet-layer-norm"])
def test_channels_first_norms_fuse_with_their_weight_and_bias(make, inputs, pattern, spelled, capture):
    """A contiguous map's norm ends as the norm over its channels where they lie (no copy of x
    with its channels last, none of y back: kernels/channel_norm.py); a channels-last map's,
    which needs no copy, stays on the row kernels."""
    report = check_against_unfused(make, inputs, capture)
    assert report.by_pattern() == {pattern: 1}, report.table()
    in_place = "; read over the channels where they lie" if pattern.endswith("over_channels") else ""
    assert f"spelled as {spelled}{in_place})" in report.table()


class ChannelsNormThenFlatten(ChannelsRMSNorm):
    """The norm's output (through a GeLU, which keeps its layout) flattened by `view`: only a
    contiguous map can be, as the model's own output of a contiguous x is."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(C * 5 * 3, 4)

    def forward(self, x):
        y = super().forward(x)
        return y, self.head(F.gelu(y).view(x.shape[0], -1))


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_channels_first_norm_leaves_its_output_laid_out_as_the_model_did(channels_last, capture):
    x = MAP[0].to(memory_format=torch.channels_last) if channels_last else MAP[0]
    if not channels_last:
        report = check_against_unfused(ChannelsNormThenFlatten, (x,), capture)
        assert report.by_pattern() == {"rms_norm_over_channels": 1}, report.table()
    torch.manual_seed(0)
    model = ChannelsRMSNorm()
    fused = fuse_via(copy.deepcopy(model), capture)
    y, ref = fused(x), model(x)
    assert trifuse.report(fused).counts() == {"rms_norm": 1}
    assert y.stride() == ref.stride()
    torch.testing.assert_close(y, ref)
    # the contiguous map's norm reads it where it lies; the channels-last map's rows are contiguous
    def step():
        fused(x.detach().requires_grad_()).sum().backward()

    step()  # (a first call wanting x's gradient may capture again)
    op = "rms_norm" if channels_last else "channel_norm"
    assert trifuse_ops_run(step) == {f"trifuse::{op}", f"trifuse::{op}_backward"}


# Norms over the last dim of a permuted view of a contiguous map: ConvNeXt's blocks, its
# channels-first LayerNorm (permute, LayerNorm, permute back), wav2vec2's conv feature encoder
# (transpose, LayerNorm): the row norm would copy x first; the channel norm reads the map itself.


class ConvNextBlock(nn.Module):
    """ConvNeXt's block: depthwise conv, `permute(0, 2, 3, 1)`, LayerNorm, the MLP on the last dim,
    permuted back into the residual; `norm` F.normalize (an L2-normalized ConvNeXt V2-like
    variant) or an RMSNorm in place of the LayerNorm."""

    def __init__(self, norm="layer"):
        super().__init__()
        self.dw = nn.Conv2d(C, C, 3, padding=1, groups=C)
        self.norm = nn.LayerNorm(C, eps=1e-6) if norm == "layer" else nn.RMSNorm(C, eps=1e-6) \
            if norm == "rms" else None
        self.fc1, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.norm(h) if self.norm is not None else F.normalize(h, dim=-1)
        return x + self.fc2(F.gelu(self.fc1(h))).permute(0, 3, 1, 2)


class TransposedLayerNorm(nn.LayerNorm):
    """wav2vec2's `Wav2Vec2LayerNormConvLayer` norm: (B, C, L) transposed, normalized, back."""

    def forward(self, x):
        return super().forward(x.transpose(-2, -1)).transpose(-2, -1)


def convnext_channels_first_norm():
    norm = ConvNextLayerNorm(C, eps=1e-6, data_format="channels_first")
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(C))
        norm.bias.copy_(0.1 * torch.randn(C))
    return norm


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, inputs, pattern", [
    (ConvNextBlock, MAP, "layer_norm_over_permuted_channels"),
    (lambda: ConvNextBlock("rms"), MAP, "rms_norm_over_permuted_channels"),
    (lambda: ConvNextBlock("l2"), MAP, "l2_normalize_over_permuted_channels"),
    (convnext_channels_first_norm, MAP, "layer_norm_over_permuted_channels"),
    (lambda: TransposedLayerNorm(C), (torch.randn(3, C, 11),), "layer_norm_over_permuted_channels"),
], ids=["convnext-block", "rms-norm", "f-normalize", "convnext-channels-first", "wav2vec2-transposed"])
def test_norms_of_permuted_maps_read_the_map_where_it_lies(make, inputs, pattern, capture):
    """The norm runs as `channel_norm` over the contiguous map the view was taken of, y written
    with its channels innermost: the tensor the row norm returned (strides too, as the layout test
    checks), from one read of x and one write of y, and the backward one read of dy and x; the
    kernels it runs are the channel norm's alone."""
    report = check_against_unfused(make, inputs, capture, train=True)
    norms = {k: v for k, v in report.by_pattern().items() if k != "linear_gelu"}
    assert norms == {pattern: 1}, report.table()
    assert "read over the channels where they lie" in report.table()
    model = fuse_via(make(), capture)
    x = inputs[0].clone().requires_grad_()

    def step():
        model(x).sum().backward()

    step()  # (a first call wanting x's gradient may capture again)
    assert {n for n in trifuse_ops_run(step) if "norm" in n} == {"trifuse::channel_norm",
                                                                  "trifuse::channel_norm_backward"}


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_permuted_maps_norm_keeps_the_models_layout(capture):
    """ConvNeXt's channels-first norm returns a channels-last view of a contiguous (N, H, W, C)
    tensor; the fused one returns the same strides, so what reads it sees what it saw."""
    torch.manual_seed(0)
    model = convnext_channels_first_norm()
    fused = fuse_via(copy.deepcopy(model), capture)
    y, ref = fused(MAP[0]), model(MAP[0])
    assert y.stride() == ref.stride()
    torch.testing.assert_close(y, ref)


class PermutedNearMiss(nn.LayerNorm):
    """Views the channel norm cannot take whole: a map already channels-last (its permuted view
    is contiguous: the row norm reads it in place), a permutation that reorders the other dims
    too (no contiguous map has that view), a norm over two dims."""

    def __init__(self, kind):
        super().__init__(C if kind != "two_dims" else (3, C))
        self.kind = kind

    def forward(self, x):
        if self.kind == "reordered":
            return super().forward(x.transpose(1, 3))
        if self.kind == "two_dims":
            return super().forward(x.permute(0, 2, 3, 1))
        return super().forward(x.permute(0, 2, 3, 1))


@pytest.mark.parametrize("kind, inputs", [
    ("channels_last", (MAP[0].to(memory_format=torch.channels_last),)),
    ("reordered", MAP),
    ("two_dims", MAP),
])
def test_views_the_channel_norm_cannot_read_stay_row_norms(kind, inputs):
    report = check_against_unfused(lambda: PermutedNearMiss(kind), inputs, "dynamo", train=True)
    assert report.by_pattern() == {"layer_norm": 1}, report.table()


def test_a_permuted_maps_norm_with_symbolic_sizes_stays_a_row_norm():
    """Under `dynamic=True` the view's strides are symbolic: asking whether it is a permuted
    contiguous map would guard on its sizes. The row norm takes it, and the answer is right."""
    report = check_against_unfused(convnext_channels_first_norm, MAP, "compile", dynamic=True)
    assert report.by_pattern() == {"layer_norm": 1}, report.table()


def test_a_permuted_maps_norm_cast_for_autocasts_matmuls_stays_a_row_norm():
    """Under autocast ConvNeXt's block norm returns fp32 for the Linear after it; the fused row
    norm writes the Linear's 16 bits itself instead (fusion/narrow.py), a pass the channel norm
    could not save: the block keeps the row norm there."""
    report = check_against_unfused(ConvNextBlock, MAP, "dynamo", train=True, autocast=torch.bfloat16)
    assert report.by_pattern().get("layer_norm") == 1, report.table()


class ChannelsNormParamsApart(ChannelsRMSNorm):
    """A weight that is no vector along the channels (one per row of the map), or an fp32 weight
    on fp16 activations (the product promotes): the norm fuses, the product stays the model's."""

    def __init__(self, kind):
        super().__init__(affine=False)
        self.kind = kind
        self.scale = nn.Parameter(torch.randn(5, 1))
        self.channel_weight = nn.Parameter(1 + 0.1 * torch.randn(C))

    def forward(self, x):
        h = super().forward(x)
        return h * self.scale if self.kind == "per_row" else h * self.channel_weight.float()[:, None, None]


@pytest.mark.parametrize("capture", CAPTURES)
def test_channels_first_norm_keeps_a_product_that_is_not_its_weight(capture):
    report = check_against_unfused(lambda: ChannelsNormParamsApart("per_row"), MAP, capture)
    assert report.by_pattern() == {"rms_norm_over_channels": 1}
    x16 = (MAP[0].half(),)
    report = check_against_unfused(lambda: ChannelsNormParamsApart("fp32").half(), x16, capture, grads=False)
    assert report.by_pattern() == {"rms_norm_over_channels": 1}


# ---------------------------------------------------------------------------------------------
# Negatives: near misses stay as they are, and the model still matches.
# ---------------------------------------------------------------------------------------------


class EpsTensorRMSNorm(HFRMSNorm):
    def __init__(self):
        super().__init__()
        self.register_buffer("eps", torch.tensor(1e-6))

    def forward(self, hidden_states):
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(hidden_states.dtype)


class CubicNorm(HandRMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(3).abs().mean(-1, keepdim=True) + 1e-5) * self.weight


@pytest.mark.parametrize("capture", CAPTURES)
def test_rmsnorm_over_another_dim_keeps_a_weight_along_the_last(capture):
    """The statistics over dim 1, the weight over the last dim: the norm fuses over dim 1 and the
    weight, which is no vector along that dim, stays the model's product."""
    report = check_against_unfused(lambda: HandRMSNorm(dim=1), X, capture)
    assert report.by_pattern() == {"rms_norm_over_channels": 1}
    assert report.rejected() == []  # a product that is no norm's weight is not worth a line


@pytest.mark.parametrize("capture", CAPTURES)
def test_eps_from_a_tensor_is_rejected_with_a_reason(capture):
    report = check_against_unfused(EpsTensorRMSNorm, X, capture)
    assert report.by_pattern() == {}
    assert any("eps" in reason and "not a number" in reason for *_, reason in report.rejected())


@pytest.mark.parametrize("capture", CAPTURES)
def test_mochi_norm_with_a_float64_weight_keeps_its_float64_product(capture):
    """An fp64 weight makes the model's product fp64 before the cast back: not the op's fp32 maths."""
    report = check_against_unfused(lambda: MochiRMSNorm(dtype=torch.float64), X, capture)
    assert report.by_pattern() == {}
    assert any(pattern == "rms_norm_t5_cast_back" and "float64" in reason
               for _, _, pattern, reason in report.rejected()), report.table()


class QuarterPowerNorm(nn.Module):
    """Gemma 4's spelling with another exponent than -0.5: not an RMSNorm."""

    def forward(self, x):
        return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + 1e-6, -0.25)


@pytest.mark.parametrize("capture", CAPTURES)
def test_other_powers_are_not_rmsnorm(capture):
    assert check_against_unfused(CubicNorm, X, capture).by_pattern() == {}
    assert check_against_unfused(QuarterPowerNorm, X, capture).by_pattern() == {}


def test_ops_selection_leaves_other_families():
    report = check_against_unfused(ModuleLayerNorm, X, "fx", ops=["rms_norm"])
    assert report.by_pattern() == {}
    report = check_against_unfused(ModuleRMSNorm, X, "fx", ops=["rms_norm"])
    assert report.by_pattern() == {"rms_norm": 1}
    with pytest.raises(ValueError, match="families"):
        trifuse.fuse(ModuleLayerNorm(), ops=["layernorm"])


class NotLayerNorm(nn.Module):
    """Near misses of LayerNorm written out: the unbiased variance (`x.var()`'s default, the
    Annotated Transformer's std), eps outside the root, the statistics over two dims (the mean
    and variance over dim 1 instead of the last are a LayerNorm: `test_channels_first_norms_...`)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        if self.kind == "unbiased":
            return (x - mean) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5)
        if self.kind == "std":
            return (x - mean) / (x.std(-1, keepdim=True) + 1e-5)
        if self.kind == "eps_outside":
            return (x - mean) / (torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True)) + 1e-5)
        var_mean = torch.var_mean(x, dim=(1, 2), unbiased=False, keepdim=True)
        return (x - var_mean[1]) * torch.rsqrt(var_mean[0] + 1e-5)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("kind", ["unbiased", "std", "eps_outside", "two_dims"])
def test_near_misses_of_layer_norm_are_not_fused(kind, capture):
    assert check_against_unfused(lambda: NotLayerNorm(kind), X, capture).by_pattern() == {}


class SmallRowsRMSNorm(nn.Module):
    """nn.RMSNorm with eps None over rows of small values, where the epsilon weighs."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(N, N), nn.RMSNorm(N)

    def forward(self, x):
        return self.norm(self.proj(x) * 0.01)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rms_norm_module_without_eps_keeps_pytorchs_default(dtype, capture):
    """eps None in a 16-bit model is fp32's epsilon, as PyTorch computes it (not fp16's, 8192 times
    larger, which moved these outputs by up to 1.3 before)."""
    report = check_against_unfused(lambda: SmallRowsRMSNorm().to(dtype), (X[0].to(dtype),), capture)
    assert report.counts() == {"rms_norm": 1}


# ---------------------------------------------------------------------------------------------
# L2 norms: x over its 2-norm, eps under the root (`x * rsqrt(sum(x^2) + eps)`) or none, as the
# RMSNorm they are (eps / width, the 1 / sqrt(width) a constant weight).
# ---------------------------------------------------------------------------------------------


class L2Norm(nn.Module):
    """The L2 norm as models write it: `spelling` names whose; eps 0.5 (the rows' squared norms
    are about N), so an eps not rescaled to the mean's would move the outputs by percents."""

    def __init__(self, spelling, eps=0.5):
        super().__init__()
        self.spelling, self.eps = spelling, eps

    def forward(self, x):
        eps = self.eps
        if self.spelling == "qwen3_next":  # transformers' own l2norm (Qwen3-Next, OLMo-Hybrid)
            return qwen3_next_l2norm(x, dim=-1, eps=eps)
        if self.spelling == "fla":
            return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)
        if self.spelling == "pow_method":
            return x * (x.pow(2).sum(-1, keepdim=True) + eps).rsqrt()
        if self.spelling == "channels":  # over a map's channels
            return x * torch.rsqrt(torch.sum(x.square(), dim=1, keepdim=True) + eps)
        if self.spelling == "norm_method":  # CLIP's embeddings: no eps
            return x / x.norm(p=2, dim=-1, keepdim=True)
        if self.spelling == "torch_norm":
            return x / torch.norm(x, dim=[-1], keepdim=True)
        if self.spelling == "clip":  # transformers' own _get_vector_norm
            return x / clip_vector_norm(x)
        return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("spelling, inputs, pattern", [
    ("qwen3_next", X, "l2_norm_rsqrt"),
    ("fla", X, "l2_norm_div_sqrt"),
    ("pow_method", X, "l2_norm_rsqrt"),
    ("channels", MAP, "l2_norm_over_channels"),
    ("norm_method", X, "l2_norm_no_eps"),
    ("torch_norm", X, "l2_norm_no_eps"),
    ("clip", X, "l2_norm_no_eps_pow_half"),
    ("vector_norm", X, "l2_norm_no_eps"),
])
def test_l2_norms_fuse_as_rms_norms(spelling, inputs, pattern, capture):
    report = check_against_unfused(lambda: L2Norm(spelling), inputs, capture)
    assert report.by_pattern() == {pattern: 1}, report.table()


def test_l2_norm_of_a_zero_row_is_zero_with_eps():
    """A zero row: 0 with eps, and the gradient rsqrt(eps) * dy (the eps under the root kept)."""
    x = X[0].clone()
    x[1, 2] = 0.0
    report = check_against_unfused(lambda: L2Norm("qwen3_next", eps=1e-6), (x,), "fx")
    assert report.by_pattern() == {"l2_norm_rsqrt": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_l2_norm_on_an_fp32_copy_cast_back_is_the_norm_of_x(capture):
    """Dory's norm (transformers' own: on an fp32 copy, `type_as(x)`): one op on the fp16 x,
    rounded once, as the model rounds."""
    x16 = (torch.randn(3, 5, N).half(),)
    report = check_against_unfused(DoryL2Norm, x16, capture, grads=False)
    assert report.by_pattern() == {"l2_norm_rsqrt_in_fp32": 1}
    report = check_against_unfused(DoryL2Norm, X, capture)
    assert report.by_pattern() == {"l2_norm_rsqrt_in_fp32": 1}


class L2NormBlock(nn.Module):
    """An L2 norm with a weight after it, of a residual add (nGPT's normalized stream, post-norm),
    `with_sum`: or of the branch alone, pre-norm style, the weight kept apart."""

    def __init__(self, with_sum=True):
        super().__init__()
        self.with_sum = with_sum
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(N))

    def forward(self, x, residual):
        h = residual + F.dropout(x, 0.1, self.training) if self.with_sum else x
        return qwen3_next_l2norm(h, eps=0.5) * self.weight


@pytest.mark.parametrize("capture", CAPTURES)
def test_l2_norm_takes_the_weight_after_it_and_the_add_before_it(capture):
    """The weight joins the norm's constant scale, and the add before it the norm (its scale made
    at the graph's start, so it reads no sum the residual stream takes in)."""
    inputs = (X[0], torch.randn(3, 5, N))
    report = check_against_unfused(lambda: L2NormBlock(with_sum=False), inputs, capture)
    assert report.by_pattern() == {"l2_norm_weight_folded": 1}, report.table()
    report = check_against_unfused(L2NormBlock, inputs, capture)
    assert report.counts() == {"residual_stream": 1}, report.table()


class NotL2Norm(nn.Module):
    """Near misses: eps outside the root, a 1-norm, the 2-norm over two dims; F.normalize with
    p=1, its norm clamped from above or on both sides, over two dims."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "eps_outside":
            return x / (x.norm(dim=-1, keepdim=True) + 1e-6)
        if self.kind == "one_norm":
            return x / x.norm(p=1, dim=-1, keepdim=True)
        if self.kind == "two_dims":
            return x * torch.rsqrt(x.pow(2).sum((1, 2), keepdim=True) + 1e-6)
        if self.kind == "normalize_p1":
            return F.normalize(x, p=1.0, dim=-1)
        if self.kind == "clamped_above":
            return x / x.norm(dim=-1, keepdim=True).clamp(max=1.0)
        if self.kind == "clamped_both":
            return x / x.norm(dim=-1, keepdim=True).clamp(1e-6, 10.0)
        return x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp_min(1e-6)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("kind", ["eps_outside", "one_norm", "two_dims", "normalize_p1", "clamped_above",
                                  "clamped_both", "clamped_two_dims"])
def test_near_misses_of_l2_norm_are_not_fused(kind, capture):
    assert check_against_unfused(lambda: NotL2Norm(kind), X, capture).by_pattern() == {}


# F.normalize and its arithmetic written out: x / max(|x|, eps), the RMSNorm with its eps a floor
# under the rms (`clamp_eps`).


class L2Normalize(nn.Module):
    """x over its 2-norm floored at eps, as models write it; eps 1e-3 floors X's rows scaled by
    1e-5 (their norms about 5e-5) and leaves the others."""

    def __init__(self, spelling, eps=1e-3):
        super().__init__()
        self.spelling, self.eps = spelling, eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(N))

    def forward(self, x):
        eps = self.eps
        if self.spelling == "normalize":  # Swin V2's q and k, XCiT's, embedding heads
            return F.normalize(x, dim=-1, eps=eps)
        if self.spelling == "clamp":
            return x / x.norm(dim=-1, keepdim=True).clamp(min=eps)
        if self.spelling == "clamp_min":
            return x / torch.clamp_min(torch.linalg.vector_norm(x, dim=-1, keepdim=True), eps)
        if self.spelling == "clip":
            return x / torch.norm(x, 2, -1, keepdim=True).clip(eps)
        if self.spelling == "fp32_copy":  # transformers' Xcodec2-style `F.normalize(v.float()).to(dtype)`
            return F.normalize(x.float(), dim=-1, eps=eps).to(x.dtype)
        if self.spelling == "weight":
            return F.normalize(x, p=2, dim=-1, eps=eps) * self.weight
        return F.normalize(x, dim=1, eps=eps)  # a map's channels (codebooks' `F.normalize(x)`)


def _with_floored_rows(x):
    x = x.clone()
    x.view(-1, x.shape[-1])[0] = 0.0
    x.view(-1, x.shape[-1])[1] *= 1e-5
    return x


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("spelling, inputs, pattern", [
    ("normalize", X, "l2_normalize"),
    ("clamp", X, "l2_normalize_written_out"),
    ("clamp_min", X, "l2_normalize_written_out"),
    ("clip", X, "l2_normalize_written_out"),
    ("fp32_copy", X, "l2_normalize_in_fp32"),
    ("weight", X, "l2_normalize_weight_folded"),
    ("channels", MAP, "l2_normalize_over_channels"),
])
def test_l2_normalize_fuses_as_an_rms_norm_with_a_floor(spelling, inputs, pattern, capture):
    """Rows under the floor (a zero row, a tiny one) are x / eps, with no gradient through their
    norm, as the model's clamp gives."""
    x = _with_floored_rows(inputs[0]) if spelling != "channels" else inputs[0]
    report = check_against_unfused(lambda: L2Normalize(spelling), (x,), capture)
    assert report.by_pattern() == {pattern: 1}, report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_l2_normalize_of_16_bit_x_keeps_its_rounded_eps(capture):
    """In an fp16 model F.normalize's clamp rounds eps 1e-12 to 0: a zero row is NaN, as the
    model's (the fused op's floor is that rounded eps); on an fp32 copy the eps stays 1e-12 and the
    zero row 0. The float64 twin has no such NaN: checked against the fp16 model itself."""
    x = _with_floored_rows(torch.randn(3, 5, N)).half()
    for spelling, nan_rows in (("normalize", 1), ("fp32_copy", 0)):
        model = L2Normalize(spelling, eps=1e-12).half()
        want = model(x)
        fused = fuse_via(copy.deepcopy(model), capture)
        got = fused(x)
        pattern = "l2_normalize" if spelling == "normalize" else "l2_normalize_in_fp32"
        assert trifuse.report(fused).by_pattern() == {pattern: 1}
        assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().all(-1).sum()) == nan_rows
        finite = ~want.isnan()
        torch.testing.assert_close(got[finite], want[finite], atol=2e-3, rtol=2e-3)


class ProjectedL2Normalize(nn.Module):
    """F.normalize of a projection: a static width under `dynamic=True` (the weight's), and an eps
    Dynamo passes as a number computed at run time."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(N, N)

    def forward(self, x):
        return F.normalize(self.proj(x) * 5e-5, dim=-1, eps=1e-4)  # (some rows floored)


def test_l2_normalize_under_dynamic_shapes():
    """A static width fuses, its eps computed at run time; a symbolic width stays, with its reason."""
    report = check_against_unfused(ProjectedL2Normalize, X, "compile", dynamic=True)
    assert report.by_pattern() == {"l2_normalize": 1}, report.table()
    report = check_against_unfused(lambda: L2Normalize("normalize"), X, "compile", dynamic=True)
    assert report.counts() == {}
    assert any("is symbolic" in reason for *_, reason in report.rejected()), report.table()


def test_l2_normalize_keeps_no_residual_add():
    """The residual stream adds eps under the root: an add before F.normalize stays apart."""
    class Block(nn.Module):
        def forward(self, x, residual):
            return F.normalize(x + residual, dim=-1)

    report = check_against_unfused(Block, (X[0], torch.randn(3, 5, N)), "fx")
    assert report.counts() == {"rms_norm": 1}, report.table()


# What diffusers' video VAEs write after their channel norm (Wan's `WanRMS_norm`, Qwen-Image's,
# HunyuanVideo 1.5's, Kandinsky 6's): `F.normalize(x, dim=1).to(x.dtype) * dim ** 0.5 * gamma +
# bias`, the bias the number 0.0 where there is none. All but a real bias folds into the norm.


class VaeRMSNorm(nn.Module):
    """That norm over a map's channels (`channel_first`) or its last dim; `norm="l2_norm"`: the
    L2 norm with eps under the root in place of F.normalize; `upcast`: on an fp32 copy, as the
    VAEs do for 16-bit x. `near_miss` changes one step so that what follows it cannot fold."""

    def __init__(self, norm="normalize", images=True, bias=False, channel_first=True, upcast=False,
                 near_miss=None):
        super().__init__()
        self.norm, self.upcast, self.near_miss, self.dim = norm, upcast, near_miss, 1 if channel_first else -1
        self.scale = C ** 0.5
        shape = (C, *((1, 1) if images else (1, 1, 1))) if channel_first else (C,)
        self.gamma = nn.Parameter(1 + 0.1 * torch.randn(shape))
        self.bias = nn.Parameter(0.1 * torch.randn(shape)) if bias else 0.0
        self.register_buffer("tensor_scale", torch.tensor(self.scale))
        self.positions = nn.Parameter(torch.randn(MAP[0].shape[2:]))

    def forward(self, x):
        h = x.float() if self.upcast else x
        if self.norm == "normalize":
            h = F.normalize(h, dim=self.dim)
        else:
            h = h * torch.rsqrt(h.pow(2).sum(self.dim, keepdim=True) + 1e-6)
        if self.near_miss == "cast_elsewhere":
            return h.to(torch.float16) * self.scale * self.gamma + self.bias
        h = h.to(x.dtype)
        if self.near_miss == "tensor_scale":
            return h * self.tensor_scale * self.gamma + self.bias
        if self.near_miss == "weight_over_positions":
            return h * self.scale * self.positions + self.bias
        if self.near_miss == "gamma_in_fp16":
            return h * self.scale * self.gamma.half() + self.bias
        return h * self.scale * self.gamma + (1.0 if self.near_miss == "add_one" else self.bias)


VIDEO = (torch.randn(2, C, 3, 5, 4),)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("options, inputs, pattern, last", [
    ({}, MAP, "l2_normalize_over_channels", "an added 0 dropped"),
    ({"images": False}, VIDEO, "l2_normalize_over_channels", "an added 0 dropped"),
    ({"norm": "l2_norm"}, MAP, "l2_norm_over_channels", "an added 0 dropped"),
    ({"channel_first": False}, (torch.randn(2, 5, 3, C),), "l2_normalize_zero_dropped", None),
    ({}, (MAP[0].to(memory_format=torch.channels_last),), "l2_normalize_zero_dropped", None),
    ({"bias": True}, MAP, "l2_normalize_over_channels", "weight folded in"),  # the bias added after
])
def test_the_vae_channel_norm_folds_its_tail(options, inputs, pattern, last, capture):
    """The cast to y's own dtype goes, the number and the weight join the norm's constant scale,
    adding 0 goes: the report's note says the chain folded (each needs the norm's result itself),
    the last fold's name where the norm runs on rows (a channels-last map's), and on a contiguous
    map the norm then reads the channels where they lie. Forward and gradients (gamma's too)
    against the unfused model."""
    report = check_against_unfused(lambda: VaeRMSNorm(**options), inputs, capture, train=True)
    assert report.by_pattern() == {pattern: 1}, report.table()
    table = report.table()
    assert "a number folded in" in table and "weight folded in" in table, table
    if last is not None:
        assert f"{last}; read over the channels where they lie)" in table, table


@pytest.mark.parametrize("near_miss, chain", [
    ("cast_elsewhere", "l2_normalize"),  # a real cast: nothing after it folds
    ("tensor_scale", "l2_normalize; a cast to y's own dtype dropped"),  # a tensor, not a number
    # not laid along the channels
    ("weight_over_positions", "a cast to y's own dtype dropped; a number folded in"),
    ("gamma_in_fp16", "a cast to y's own dtype dropped; a number folded in"),  # not in x's dtype
    ("add_one", "a number folded in; weight folded in"),  # adds 1, not 0
])
def test_near_misses_of_the_vae_channel_norm_fold_no_further(near_miss, chain):
    report = check_against_unfused(lambda: VaeRMSNorm(near_miss=near_miss), MAP, "dynamo", train=True)
    assert report.by_pattern() == {"l2_normalize_over_channels": 1}, report.table()
    assert f"{chain}; read over the channels where they lie)" in report.table(), report.table()


class WeightFirstRMSNorm(nn.Module):
    """lucidrains' RMSNorm (x-transformers, denoising-diffusion-pytorch's UNet): the weight, then
    sqrt(dim), `F.normalize(x, dim=-1) * self.g * self.scale`; over a map's channels its g is
    shaped (1, C, 1, 1); `offset`: a weight of g + 1, computed each call."""

    def __init__(self, channels=False, offset=False):
        super().__init__()
        self.dim, self.offset, self.scale = 1 if channels else -1, offset, C ** 0.5
        self.g = nn.Parameter(1 + 0.1 * torch.randn((1, C, 1, 1) if channels else (C,)))

    def forward(self, x):
        g = self.g + 1 if self.offset else self.g
        return F.normalize(x, dim=self.dim) * g * self.scale


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("options, inputs, pattern", [
    ({}, (torch.randn(2, 5, C),), "l2_normalize_number_folded"),
    ({"offset": True}, (torch.randn(2, 5, C),), "l2_normalize_number_folded"),
    ({"channels": True}, MAP, "l2_normalize_over_channels"),
])
def test_a_weight_then_a_number_after_f_normalize_fold_too(options, inputs, pattern, capture):
    report = check_against_unfused(lambda: WeightFirstRMSNorm(**options), inputs, capture, train=True)
    assert report.by_pattern() == {pattern: 1}, report.table()
    assert "weight folded in; a number folded in" in report.table(), report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_the_vae_channel_norm_of_16_bit_x_folds_on_its_fp32_copy(capture):
    """fp16 x normalized on an fp32 copy and cast back (the VAEs' 16-bit path): the copy and the
    cast go with the norm, then the number and the 16-bit gamma join its fp32 scale, and the kernel
    rounds once where the model rounds three times."""
    x = MAP[0].half()
    report = check_against_unfused(lambda: VaeRMSNorm(upcast=True).half(), (x,), capture, train=True,
                                   twin64=lambda m: setattr(m, "upcast", False) or m)
    assert report.by_pattern() == {"l2_normalize_over_channels": 1}, report.table()
    assert "spelled as l2_normalize_in_fp32" in report.table(), report.table()


def test_l2_norm_over_a_symbolic_width_stays_with_a_reason():
    """Under `dynamic=True` an L2 norm of a model input has a symbolic width, from which its eps
    and scale would be computed (specializing it): left as written, and the report says why."""
    report = check_against_unfused(lambda: L2Norm("qwen3_next"), X, "compile", dynamic=True)
    assert report.counts() == {}
    assert any("is symbolic" in reason for *_, reason in report.rejected()), report.table()
