"""The rewriter against random blocks (tests/_random_blocks.py): faithful spellings and near misses
of every family, drawn together, pre- and post-norm, with and without masks, captured by fx, by
Dynamo and by torch.compile(backend="trifuse"), in fp32 and fp16, and in fp32 under autocast.
The fused model's outputs and every gradient must match the unfused model by the oracle rule,
whatever was fused. Derandomized for CI; `bench/fuzz_rewriter.py` draws many more."""
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import _random_blocks as rb
import trifuse
from _fusing import check_against_unfused

SPECS = st.builds(
    rb.Spec, norm=st.sampled_from(rb.NORMS), attention=st.sampled_from(rb.ATTENTIONS),
    activation=st.sampled_from(rb.ACTIVATIONS), residual=st.sampled_from(rb.RESIDUALS),
    mask=st.sampled_from(rb.MASKS), pre_norm=st.booleans(), eps=st.sampled_from([1e-5, 1e-6, 1e-2]),
    dropout=st.sampled_from([0.0, 0.1]), mlp_bias=st.booleans())


def check_spec(spec: rb.Spec, capture: str, train: bool, dtype: torch.dtype = torch.float32,
               autocast: torch.dtype | None = None) -> "trifuse.FusionReport":
    """Fused against unfused (and float64) on one batch, the forwards under `autocast` when given;
    train mode only without dropout (the kernels' masks are not PyTorch's: with both models'
    dropout on, PyTorch's own error against float64 would be the masks' difference, and the check
    vacuous)."""
    if train and spec.dropout:
        spec = rb.Spec(**{**spec.__dict__, "dropout": 0.0})
    def run():
        return check_against_unfused(lambda: rb.random_model(spec, dtype=dtype), rb.inputs(dtype=dtype),
                                     capture, train=train, autocast=autocast)

    return checked(run, capture)


def checked(run, capture: str) -> "trifuse.FusionReport":
    """`run()`'s report; for torch.compile captures, after a reset of Dynamo's caches and with a
    check that a rewritten graph ran: every draw compiles the same forward code, and past
    Dynamo's recompile limit it would run unfused, the comparison then vacuous."""
    if capture.startswith("compile"):
        torch._dynamo.reset()
    report = run()
    if capture.startswith("compile"):
        assert report.compiled_runs, "torch.compile ran no rewritten graph"
    return report


@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(spec=SPECS, capture=st.sampled_from(["fx", "dynamo", "compile"]), train=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_random_blocks_fuse_to_what_they_compute(spec, capture, train, dtype):
    check_spec(spec, capture, train, dtype)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(spec=SPECS, capture=st.sampled_from(["fx", "dynamo", "compile"]), train=st.booleans(),
       autocast=st.sampled_from([torch.bfloat16, torch.float16]))
def test_random_blocks_under_autocast_fuse_to_what_they_compute(spec, capture, train, autocast):
    """Mixed precision as a GPU trains: an fp32 model whose forward runs under autocast (CUDA's
    fp32 list included), so the fused ops take 16-bit activations beside fp32 weights and
    residuals, and norms may write the autocast dtype for the matmuls after them. Left out: scores
    multiplied by a finfo.min float mask (a near miss), whose saturated softmax flips on one
    rounding: PyTorch's own model with its Linear outputs nudged by half an ulp misses the bound
    as far as the fused one (bench/fuzz_rewriter.py's ill_conditioned)."""
    assume(not (spec.attention == "chain_mask_multiplied" and spec.mask == "float_keypad"))
    check_spec(spec, capture, train, torch.float32, autocast)


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_faithful_spellings_are_fused(capture):
    """The fuzz compares something fused: a block of canonical spellings has every family replaced.
    Through fx, the block traces with its default `mask=None` (so fuse picks fx) but not with a
    mask passed (it branches on the mask's dtype): those calls are captured by Dynamo, not run
    unfused (the first fuzz run found them unfused)."""
    spec = rb.Spec(norm="ln_module", attention="chain_mul", activation="new_gelu_written",
                   residual="plus_dropout", mask="float_keypad", pre_norm=True)
    report = check_spec(spec, capture, train=False)
    assert {"attention", "bias_gelu", "layer_norm"} <= set(report.counts()), report.counts()
    assert not report.unfused_calls(), report.unfused_calls()
    if capture == "fx":
        assert "captured by Dynamo instead: 2 call(s): fx cannot trace it" in report.table()


@pytest.mark.parametrize("near_miss", sorted(rb.NEAR_MISSES))
def test_each_near_miss_is_left_as_written_or_fused_right(near_miss):
    """Every near miss alone in an otherwise canonical block."""
    field = next(f for f, values in (("norm", rb.NORMS), ("attention", rb.ATTENTIONS),
                                     ("activation", rb.ACTIVATIONS), ("residual", rb.RESIDUALS))
                 if near_miss in values)
    spec = rb.Spec(**{field: near_miss}, mask="bool_keypad")
    check_spec(spec, "fx", train=False)


@pytest.fixture
def layer_norm_without_its_eps(monkeypatch):
    """A wrong rewrite: trifuse's LayerNorm replacement with eps 0.5 whatever the model's."""
    from trifuse import ops

    real = ops.layer_norm

    def no_eps(x, normalized_shape, weight=None, bias=None, eps=1e-5, *args, **kwargs):
        return real(x, normalized_shape, weight, bias, 0.5, *args, **kwargs)

    monkeypatch.setattr(ops, "layer_norm", no_eps)


def test_the_fuzz_catches_a_wrong_rewrite(layer_norm_without_its_eps):
    """Negative control: a LayerNorm replacement that forgets eps is caught by the comparison."""
    with pytest.raises(AssertionError, match="max error"):
        check_spec(rb.Spec(norm="ln_module", attention="sdpa", activation="silu", residual="minus_dropout",
                           eps=1e-5), "fx", train=False)


def test_the_check_can_list_every_failing_value(layer_norm_without_its_eps):
    """With `failures`, check_against_unfused goes on past the first failing value and lists them
    all (the fuzz's ill_conditioned reads the value the fused model failed on, which a nudged model
    may fail only after failing on its output); without it, the first raises (the test above)."""
    spec = rb.Spec(norm="ln_module", attention="sdpa", activation="silu", residual="minus_dropout", eps=1e-5)
    failures: list[str] = []
    check_against_unfused(lambda: rb.random_model(spec), rb.inputs(), "fx", failures=failures)
    names = [m.split(":")[0] for m in failures]
    assert names[0] == "output 0" and len(names) > 1, failures
    assert all("max error" in m for m in failures), failures
    assert "grad blocks.0.norm2.ln.weight" in names, names


# ---------------------------------------------------------------------------------------------
# torch.nn's own layers over their options: TransformerEncoderLayer / TransformerDecoderLayer
# ---------------------------------------------------------------------------------------------


class _TorchLayers(torch.nn.Module):
    """Two nn.Transformer{Encoder,Decoder}Layer of one configuration in a ModuleList, called with
    a key padding mask and optionally a causal mask, as nn.TransformerEncoder calls them."""

    def __init__(self, decoder: bool, activation: str, norm_first: bool, bias: bool, batch_first: bool,
                 eps: float) -> None:
        super().__init__()
        cls = torch.nn.TransformerDecoderLayer if decoder else torch.nn.TransformerEncoderLayer
        act = {"gelu": "gelu", "gelu_fn": torch.nn.functional.gelu, "relu": "relu"}[activation]
        self.decoder, self.batch_first = decoder, batch_first
        self.layers = torch.nn.ModuleList(
            cls(32, 4, 64, dropout=0.0, activation=act, layer_norm_eps=eps, batch_first=batch_first,
                norm_first=norm_first, bias=bias) for _ in range(2))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        pad = torch.arange(s, device=x.device)[None, :] >= lengths[:, None]  # True = padding
        if not self.batch_first:
            x = x.transpose(0, 1)
        memory = x
        for layer in self.layers:
            if self.decoder:
                x = layer(x, memory, tgt_key_padding_mask=pad, memory_key_padding_mask=pad)
            else:
                x = layer(x, src_key_padding_mask=pad)
        return x if self.batch_first else x.transpose(0, 1)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(decoder=st.booleans(), activation=st.sampled_from(["gelu", "gelu_fn", "relu"]),
       norm_first=st.booleans(), bias=st.booleans(), batch_first=st.booleans(),
       eps=st.sampled_from([1e-5, 1e-3]), train=st.booleans(), capture=st.sampled_from(["fx", "compile"]))
def test_torch_transformer_layers_fuse_to_what_they_compute(decoder, activation, norm_first, bias,
                                                            batch_first, eps, train, capture):
    """fp32 (ReLU's kink: see _random_blocks.ACTIVATIONS), dropout 0; eval runs the layers' own
    fast path unfused where PyTorch takes it (no grad there: here grad is on)."""
    def make():
        torch.manual_seed(0)
        return _TorchLayers(decoder, activation, norm_first, bias, batch_first, eps)

    checked(lambda: check_against_unfused(make, rb.inputs(), capture, train=train), capture)


# ---------------------------------------------------------------------------------------------
# LM heads and losses: the cross-entropy patterns, the padded head, linear_cross_entropy
# ---------------------------------------------------------------------------------------------

HEAD_SPECS = st.builds(
    rb.HeadSpec, vocab=st.sampled_from([1030, 77, 64]), bias=st.booleans(), tied=st.booleans(),
    upcast=st.booleans(), shift=st.booleans(), ignored=st.sampled_from(["none", "some", "all"]),
    reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.1]),
    returns_logits=st.booleans(), loss=st.sampled_from(rb.LOSSES))


def check_head(spec: rb.HeadSpec, capture: str, dtype: torch.dtype) -> "trifuse.FusionReport":
    def make():
        torch.manual_seed(0)
        return rb.RandomHead(spec).to(dtype)

    return checked(lambda: check_against_unfused(make, rb.head_inputs(spec), capture, train=True), capture)


@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(spec=HEAD_SPECS, capture=st.sampled_from(["fx", "dynamo", "compile"]),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_random_heads_and_losses_fuse_to_what_they_compute(spec, capture, dtype):
    check_head(spec, capture, dtype)


def test_a_head_without_its_logits_fuses_into_linear_cross_entropy():
    """The fuzz's heads compare something fused: the loss alone becomes linear_cross_entropy."""
    spec = rb.HeadSpec(returns_logits=False, shift=False, upcast=False)
    assert check_head(spec, "fx", torch.float32).counts().get("cross_entropy") == 1


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings: each convention, partial rotary, k left alone, near misses
# ---------------------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(rb.ROPES), both=st.booleans(),
       capture=st.sampled_from(["fx", "dynamo", "compile"]),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_random_rotary_spellings_fuse_to_what_they_compute(kind, both, capture, dtype):
    check_rope(kind, both, capture, dtype)


def check_rope(kind: str, both: bool, capture: str, dtype: torch.dtype = torch.float32,
               autocast: torch.dtype | None = None) -> "trifuse.FusionReport":
    """A RopeModel fused against unfused (and float64), the forwards under `autocast` when given."""
    def make():
        torch.manual_seed(0)
        return rb.RopeModel(kind, both).to(dtype)

    return checked(lambda: check_against_unfused(make, (rb.inputs(dtype=dtype)[0],), capture, train=True,
                                                 autocast=autocast), capture)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(rb.ROPES), both=st.booleans(),
       capture=st.sampled_from(["fx", "dynamo", "compile"]),
       autocast=st.sampled_from([torch.bfloat16, torch.float16]))
def test_random_rotary_spellings_under_autocast_fuse_to_what_they_compute(kind, both, capture, autocast):
    """An fp32 model under autocast: q and k come 16-bit out of their Linears and meet fp32 tables."""
    check_rope(kind, both, capture, autocast=autocast)


@pytest.mark.parametrize("kind", rb.ROPES)
def test_each_rotary_spelling(kind):
    """Faithful conventions fuse (the fuzz compares something fused); with the near misses,
    whatever fuse does, the answer is the unfused model's."""
    def make():
        torch.manual_seed(0)
        return rb.RopeModel(kind)

    report = check_against_unfused(make, (rb.inputs()[0],), "fx", train=True)
    if kind not in rb.NEAR_MISSES_ROPE:
        assert report.counts().get("rotary", 0) > 0, report.counts()


# ---------------------------------------------------------------------------------------------
# Adaptive norms (DiT's adaLN-Zero blocks): each modulation spelling, near misses
# ---------------------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(rb.ADAPTIVE), capture=st.sampled_from(["fx", "dynamo", "compile"]),
       dtype=st.sampled_from([torch.float32, torch.float16]), residual=st.sampled_from(rb.ADAPTIVE_RESIDUALS))
def test_random_adaptive_norms_fuse_to_what_they_compute(kind, capture, dtype, residual):
    check_adaptive(kind, residual, capture, dtype)


def check_adaptive(kind: str, residual: str, capture: str, dtype: torch.dtype = torch.float32,
                   autocast: torch.dtype | None = None) -> "trifuse.FusionReport":
    """An AdaptiveModel fused against unfused (and float64), the forwards under `autocast` when given."""
    def make():
        torch.manual_seed(0)
        return rb.AdaptiveModel(kind, residual).to(dtype)

    return checked(lambda: check_against_unfused(make, rb.adaptive_inputs(dtype), capture, train=True,
                                                 autocast=autocast), capture)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(rb.ADAPTIVE), capture=st.sampled_from(["fx", "dynamo", "compile"]),
       autocast=st.sampled_from([torch.bfloat16, torch.float16]),
       residual=st.sampled_from(rb.ADAPTIVE_RESIDUALS))
def test_random_adaptive_norms_under_autocast_fuse_to_what_they_compute(kind, capture, autocast, residual):
    """An fp32 DiT under autocast, as it trains on a GPU: the norms take the fp32 stream, their
    modulated outputs are read by 16-bit matmuls (fusion/narrow.py writes them 16-bit), the gates
    multiply 16-bit outputs into the fp32 stream."""
    check_adaptive(kind, residual, capture, autocast=autocast)


@pytest.mark.parametrize("kind", rb.ADAPTIVE)
def test_each_adaptive_norm_spelling(kind):
    """Faithful spellings become `layer_norm_modulate` (both norms of both blocks: the Dynamo host
    captures the model whole), a scale alone and a shift alone too (the shift subtracted: its scale
    fuses, the subtraction stays), per token as well (`1 + scale` folded into the loads where the
    scale varies along the tokens); with the near misses whatever fuse does, the answer is the
    unfused model's, and no modulation is fused (the norms alone may be)."""
    # (in fp32 no wider product, and the copy no copy)
    dtype = torch.float16 if kind in ("wider_product", "fp32_copy") else torch.float32

    def make():
        torch.manual_seed(0)
        return rb.AdaptiveModel(kind).to(dtype)

    report = check_against_unfused(make, rb.adaptive_inputs(dtype), "dynamo", train=True)
    modulated = sum(n for p, n in report.by_pattern().items() if "modulate" in p)
    if kind in rb.NEAR_MISSES_ADAPTIVE or kind in rb.LEFT_ADAPTIVE:
        assert modulated == 0, report.table()
    else:
        assert modulated == 4, report.table()  # two norms a block
    if kind in ("per_token_scale", "per_token_both"):
        # (the residual adds before three of them fold in too: the gated and plain offset forms)
        offset = sum(n for p, n in report.by_pattern().items() if p.endswith("layer_norm_modulate_offset"))
        assert offset == 4, report.table()
    if kind == "fp32_copy":
        # the norms read the 16-bit x, not its fp32 copy; the gated adds before three of them
        # then fold in as well (the forms with out_dtype: y computed in fp32, written in x's dtype)
        patterns = report.by_pattern()
        assert patterns.get("fp32_copy_layer_norm_modulate") == 1, report.table()
        assert patterns.get("gated_add_layer_norm_modulate_upcast") == 3, report.table()


@pytest.mark.parametrize("residual", rb.ADAPTIVE_RESIDUALS)
def test_each_residual_add_before_a_modulated_norm(residual):
    """The attention's output added back before the MLP's modulated norm: through a gate per
    sample (either way round) or through a gate that varies along the tokens (read a row at a time)
    it folds in as `gated_add_*`, ungated or after a Dropout(0.0) as `add_*`, in each block; broadcast from one token it stays PyTorch's. The first block's gated MLP add before the
    second block's norm1 folds in every time (Dynamo captures the model whole). The answer is the
    unfused model's whatever fuse does."""
    def make():
        torch.manual_seed(0)
        return rb.AdaptiveModel("dit", residual)

    report = check_against_unfused(make, rb.adaptive_inputs(), "dynamo", train=True)
    patterns = report.by_pattern()
    gated = patterns.get("gated_add_layer_norm_modulate", 0)
    ungated = sum(patterns.get(name, 0) for name in ("add_layer_norm_modulate",
                                                     "add_after_inactive_dropout_layer_norm_modulate"))
    expected = {"gated": (3, 0), "gated_commuted": (3, 0), "ungated": (1, 2), "per_token_gate": (3, 0),
                "after_dropout_p0": (1, 2), "broadcast": (1, 0)}[residual]
    assert (gated, ungated) == expected, report.table()
    assert sum(n for p, n in patterns.items() if "modulate" in p) == 4, report.table()


# ---------------------------------------------------------------------------------------------
# ResNet blocks (GroupNorm + SiLU of the diffusion UNets and VAEs): spellings, near misses
# ---------------------------------------------------------------------------------------------


@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(norm=st.sampled_from(rb.RESNET_NORMS), act=st.sampled_from(rb.RESNET_ACTS),
       capture=st.sampled_from(["fx", "dynamo", "compile"]),
       dtype=st.sampled_from([torch.float32, torch.float16]), eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
       channels_last=st.booleans())
def test_random_resnet_blocks_fuse_to_what_they_compute(norm, act, capture, dtype, eps, channels_last):
    assume(not rb.resnet_check_is_noise(norm, act, dtype))
    def make():
        return rb.resnet_model(norm, act, dtype, eps, channels_last)

    checked(lambda: check_against_unfused(make, rb.resnet_inputs(dtype, channels_last), capture, train=True,
                                          twin64=rb.resnet_float64_twin), capture)


@pytest.mark.parametrize("act", rb.RESNET_ACTS)
@pytest.mark.parametrize("norm", ["gn_module", "gn32_fp32_copy"])
def test_each_resnet_activation(norm, act):
    """Every norm of both blocks fuses (the Dynamo host captures the model whole); the SiLU joins
    it where it is the norm's SiLU and its only reader, nowhere else (QuickGELU, no SiLU, becomes
    bias_gelu's quick form; `y * sigmoid(y) + y` a gated add). In fp16, GroupNorm32's fp32 copy goes (the op reads the 16-bit x).
    The answer is the unfused model's."""
    dtype = torch.float16 if norm == "gn32_fp32_copy" else torch.float32
    if rb.resnet_check_is_noise(norm, act, dtype):
        dtype = torch.float32  # the one draw the oracle rule cannot judge (rb.resnet_check_is_noise)
    report = check_against_unfused(lambda: rb.resnet_model(norm, act, dtype), rb.resnet_inputs(dtype),
                                   "dynamo", train=True, twin64=rb.resnet_float64_twin)
    patterns = {p: n for p, n in report.by_pattern().items() if p.startswith("group_norm")}
    # norm_read_twice's `y * sigmoid(y) + y`: a sum of a full-size product, the gated add's op
    assert report.counts() == {"group_norm": 4, **({"bias_gelu": 4} if act == "quick_gelu" else {}),
                               **({"dropout_add": 4} if act == "norm_read_twice" else {})}, report.table()
    if norm == "gn32_fp32_copy":
        assert patterns == {"group_norm_in_fp32": 4}, report.table()
    else:
        joined = sum(n for p, n in patterns.items() if p.startswith("group_norm_silu"))
        assert joined == (4 if act in rb.RESNET_SILU_JOINS else 0), report.table()


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_channels_last_resnet_fuses_alike(dtype, capture):
    """The model and its input channels_last: the same four norms and SiLUs fuse, the answer is
    the unfused model's (the kernels read the norms' channels-last inputs where they lie)."""
    report = check_against_unfused(lambda: rb.resnet_model("gn_module", "nn_silu", dtype, channels_last=True),
                                   rb.resnet_inputs(dtype, channels_last=True), capture, train=True,
                                   twin64=rb.resnet_float64_twin)
    assert report.counts() == {"group_norm": 4}, report.table()
    assert report.by_pattern().get("group_norm_silu") == 4, report.table()


@pytest.mark.parametrize("norm", rb.RESNET_NORMS)
def test_each_resnet_norm_spelling(norm):
    report = check_against_unfused(lambda: rb.resnet_model(norm, "nn_silu"), rb.resnet_inputs(), "fx",
                                   train=True, twin64=rb.resnet_float64_twin)
    assert report.counts() == {rb.RESNET_NORM_FAMILY.get(norm, "group_norm"): 4}, report.table()
    if norm == "vae_rms2d":  # its cast, number, weight and added 0 all folded into the norm, which
        # then reads the map's channels where they lie
        assert report.by_pattern() == {"l2_normalize_over_channels": 4}, report.table()
        assert "an added 0 dropped; read over the channels where they lie" in report.table()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("norm", sorted(rb.RESNET_NORM_FAMILY))
def test_channel_norms_of_a_channels_last_resnet(norm, dtype):
    """The norms over each pixel's channels on channels-last maps (the channels moved last are
    then contiguous: no copy for the kernel): the same four norms, the unfused model's answer."""
    report = check_against_unfused(lambda: rb.resnet_model(norm, "f_silu", dtype, channels_last=True),
                                   rb.resnet_inputs(dtype, channels_last=True), "dynamo", train=True,
                                   twin64=rb.resnet_float64_twin)
    assert report.counts() == {rb.RESNET_NORM_FAMILY[norm]: 4}, report.table()
