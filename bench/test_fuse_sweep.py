"""The sweep's autocast verdict, on CPU: `_ill_conditioned` explains a MISMATCH only where PyTorch's
own model, nudged by half an ulp, misses float64 as far on every gradient past the rule."""
import copy

import fuse_sweep as fs  # (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch
import transformers

# Models (and model builds) the sweep's inputs were written for on CI's transformers 5.25 that older
# ones lack or build otherwise (5.17, the lent GPU's: no Granite Docling or MiniCPM-o OCR tower,
# AutoModel does not map Qwen2.5-VL's vision config, MusicGen's config validates differently)
SINCE_5_25 = pytest.mark.skipif(tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 25),
                                reason="a model or model build of transformers 5.25 (CI's)")


class _TwoBranches(torch.nn.Module):
    """Two GeLU layers side by side: each one's gradients depend on its own weights only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(torch.cat((self.a(x), self.b(x)), dim=-1))


def _square_mean(out: torch.Tensor, task: str) -> torch.Tensor:
    return out.float().square().mean()


def loss_of(kwargs: dict):
    """The step's loss through a model, as the sweep's explanations take it."""
    return lambda m: _square_mean(m(**kwargs), "")


def _grads(model: torch.nn.Module, x: torch.Tensor, autocast) -> tuple:
    with autocast:
        loss = _square_mean(model(x), "")
    return torch.autograd.grad(loss, list(model.parameters()))


@pytest.fixture
def case():
    """A well-conditioned model under bf16 autocast: its unfused and float64 gradients."""
    torch.manual_seed(0)
    model, x = _TwoBranches(), torch.randn(64, 16)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model64 = copy.deepcopy(model).double()
    grads64 = torch.autograd.grad(_square_mean(model64(x.double()), ""), list(model64.parameters()))
    return model, {"x": x}, autocast, _grads(model, x, autocast), grads64


def test_a_wrong_gradient_of_a_well_conditioned_model_is_not_explained(case):
    """5% off on every gradient: the nudged model's own errors stay near its unnudged ones."""
    model, kwargs, autocast, grads0, grads64 = case
    wrong = tuple(g * 1.05 for g in grads0)
    assert fs._oracle_error(grads0, wrong, grads64, 1e-10, 8e-3) > 0
    assert fs._ill_conditioned(model, loss_of(kwargs), autocast, grads0, wrong, grads64, 1e-10, 8e-3) == ""


def test_explained_only_when_every_gradient_past_the_rule_is_reached(case, monkeypatch):
    """The nudged runs must reach half the fused error on each failing gradient, not on one."""
    model, kwargs, autocast, grads0, grads64 = case
    wrong = tuple(g * 1.05 for g in grads0)

    def scaled_copy(factor_a: float, factor_b: float):
        def nudged(m: torch.nn.Module, seed: int) -> torch.nn.Module:
            m = copy.deepcopy(m)
            with torch.no_grad():  # each branch's gradients moved about as far as the 5% above, or not
                m.a.weight.mul_(factor_a)
                m.b.weight.mul_(factor_b)
            return m
        return nudged

    monkeypatch.setattr(fs, "_nudged", scaled_copy(1.05, 1.05))
    why = fs._ill_conditioned(model, loss_of(kwargs), autocast, grads0, wrong, grads64, 1e-10, 8e-3)
    assert why.startswith("ill-conditioned") and "gradient(s) past the rule" in why, why
    monkeypatch.setattr(fs, "_nudged", scaled_copy(1.05, 1.0))
    assert fs._ill_conditioned(model, loss_of(kwargs), autocast, grads0, wrong, grads64, 1e-10, 8e-3) == ""


def test_plain_inductor_explains_only_when_it_breaks_the_same_rule(case, monkeypatch):
    """--via inductor: plain torch.compile held to the fused model's rule. Stood in for here by the
    model itself (eager: within the rule) and by its output scaled (breaks it as the fused model does)."""
    model, kwargs, autocast, grads0, grads64 = case
    wrong = tuple(g * 1.05 for g in grads0)
    with torch.no_grad():
        with autocast:
            l0 = float(_square_mean(model(**kwargs), ""))
        l64 = float(_square_mean(copy.deepcopy(model).double()(kwargs["x"].double()), ""))
    fused = (-1.0, fs._oracle_error(grads0, wrong, grads64, 1e-10, 8e-3))  # the loss within the rule

    def alone() -> dict:
        return fs._inductor_alone_mixed(model, loss_of(kwargs), list(model.parameters()), autocast, (l0, l64),
                                        grads0, grads64, 1e-10, 8e-3, 8e-3, fused)

    monkeypatch.setattr(fs.torch, "compile", lambda m: m)
    assert "why" not in alone()

    def off(m: torch.nn.Module):  # the parameters shared, as torch.compile's are; gradients 10% off
        return lambda *args, **kw: m(*args, **kw) * 1.05

    monkeypatch.setattr(fs.torch, "compile", off)
    out = alone()
    assert "why" in out, out
    assert out["why"].startswith("plain torch.compile (Inductor, no trifuse) breaks the same rule"), out


def test_the_oracle_compares_where_float64_and_unfused_are_finite():
    """NaN in float64's gradient (Longformer's padded windows) or the unfused one's is left out of
    the comparison; a fused entry that is not finite where both are is an infinite error."""
    g64 = (torch.tensor([1.0, float("nan"), 2.0], dtype=torch.float64),)
    g0 = (torch.tensor([1.01, 5.0, float("nan")]),)
    assert fs._oracle_errors(g0, (torch.tensor([1.02, float("nan"), 7.0]),), g64, 1e-10) == \
        [(0, pytest.approx(0.01, rel=1e-5), pytest.approx(0.02, rel=1e-5))]  # of 1.0, the one entry kept
    assert fs._oracle_errors(g0, (torch.tensor([float("nan"), 5.0, 2.0]),), g64, 1e-10)[0][2] == float("inf")
    assert fs._oracle_error(g0, (torch.tensor([float("nan"), 5.0, 2.0]),), g64, 1e-10, 8e-3) == float("inf")


def test_past_the_rule_names_the_worst_gradient(case):
    """An autocast MISMATCH names how many gradients break the rule and the worst one; none, nothing."""
    model, _, _, grads0, grads64 = case
    names = [n for n, _ in model.named_parameters()]
    assert fs.past_the_rule(names, grads0, grads0, grads64, 1e-10, 8e-3) == ""
    wrong = (*grads0[:2], grads0[2] * 1.02, grads0[3] * 1.2)  # b's weight a little off, its bias far
    why = fs.past_the_rule(names, grads0, wrong, grads64, 1e-10, 8e-3)
    assert why.startswith("2 gradient(s) past the rule, the worst b.bias: fused 0.2"), why


def test_a_crash_is_the_compiler_s_only_where_it_fails_without_trifuse(case):
    """crash_row: "FUSED CRASH" with its traceback, unless torch.compile without trifuse fails too."""
    model, kwargs, autocast, _, _ = case

    def crash(via: str, loss_of) -> dict:
        try:
            raise RuntimeError("the fused step failed")
        except RuntimeError as e:
            return fs.crash_row(e, model, loss_of, autocast, via)

    runs = loss_of(kwargs)

    def fails(m: torch.nn.Module) -> torch.Tensor:
        raise ValueError("so does PyTorch's")

    row = crash("fuse", fails)  # fuse: nothing compiled to blame
    assert row["status"] == "FUSED CRASH" and row["why"] == "RuntimeError: the fused step failed", row
    assert "the fused step failed" in row["traceback"]
    assert crash("backend", runs)["status"] == "FUSED CRASH"
    assert crash("backend", fails)["status"] == "Dynamo fails"
    assert crash("inductor", fails)["status"] == "Dynamo fails"  # Dynamo's own backend tried first


@pytest.mark.parametrize("model_type, fused", [
    pytest.param("qwen2_5_vl_vision", {"attention": 4, "rotary": 2}, marks=SINCE_5_25),
    ("qwen2_5_vl_text", {"attention": 2, "rotary": 2})])
def test_a_vlm_s_towers_alone_get_their_inputs(model_type, fused):
    """A VLM's vision tower alone takes Qwen-VL's flattened patches and (t, h, w) grid (its main
    input name is the default's), its text model the multimodal rotary's sections sized to the tiny
    heads: both run, fused and unfused, and agree."""
    row = fs.run_one(model_type, task="base")
    assert row["status"] == "ok", row
    assert fused.items() <= row["replaced"].items(), row["replaced"]


@pytest.mark.parametrize("model_type, fused", [("patchtst", {"attention": 2}), ("seggpt", {"attention": 2}),
                                               ("detr", {"attention": 6}),
                                               ("decision_transformer", {"attention": 2}),
                                               pytest.param("minicpm_ocr_vision", {"attention": 4},
                                                            marks=SINCE_5_25),
                                               ("fun_asr_nano_encoder", {"attention": 2}),
                                               ("voxtral_realtime_encoder", {"attention": 2}),
                                               ("sam2", {"attention": 12, "bias_gelu": 19}),
                                               ("clvp", {"attention": 6, "gated_activation": 4})])
def test_base_models_with_inputs_of_their_own_get_them(model_type, fused):
    """Models whose inputs are none of the usual ones get a batch: a time series (PatchTST), an
    image with its prompt image and mask (SegGPT, whose decomposed relative positions fuse), the
    Decision Transformer's trajectories, MiniCPM-V's packed images with their sizes, FunASR's
    stacked frames with their padding mask, Voxtral Realtime's and CLVP's mel bins first; DETR builds
    on transformers' ResNet (its default backbone is timm's); SAM 2's Hiera on 64-pixel images. Each
    runs fused and unfused, and they agree."""
    row = fs.run_one(model_type, task="base")
    assert row["status"] == "ok", row
    assert fused.items() <= row["replaced"].items(), row["replaced"]


@pytest.mark.parametrize("model_type, fused", [("instructblip", {"attention": 7, "bias_gelu": 8}),
                                               ("pix2struct", {"attention": 6, "gated_activation": 4}),
                                               pytest.param("granite_docling", {"attention": 4, "rotary": 2},
                                                            marks=SINCE_5_25),
                                               ("gemma4_unified", {"attention": 2, "layer_norm": 3}),
                                               ("fuyu", {"attention": 2, "bias_gelu": 2})])
def test_vlms_with_inputs_of_their_own_get_them(model_type, fused):
    """VLMs whose inputs are not a processor's usual ones get a batch: InstructBLIP's Q-Former
    queries in the image tokens' places (a token its checkpoints' config names) and its
    instruction ids, Pix2Struct's flattened patches with their positions, Granite Docling's mask
    per tile, Gemma 4 Unified's merged patches (no vision tower: its patch embedder's layer norms
    fuse), Fuyu's flattened patches for its linear patch embedding. Each runs fused and unfused, and
    they agree."""
    row = fs.run_one(model_type, task="image-text")
    assert row["status"] == "ok", row
    assert fused.items() <= row["replaced"].items(), row["replaced"]


def test_clap_gets_its_spectrogram_image_and_its_float64_mismatch_is_its_own_fp32_softmax():
    """CLAP's audio encoder (HTSAT, a Swin over the spectrogram) takes its mel spectrogram as a
    one-channel image beside the text: the fused model runs both towers' attention, and the float64
    row's MISMATCH (EXPLAINED) is the unfused model's fp32 softmax: fused is within 1e-6 of float64
    throughout where unfused is not."""
    import fp64_truth

    r = fp64_truth.measure("clap", task="base")
    assert r["trifuse_ops"].get("trifuse::attention") == 4, r["trifuse_ops"]
    assert r["fused vs unfused"][1] > 1e-5  # what the sweep's rule flags
    assert r["fused vs truth"][0] < 1e-12 and r["fused vs truth"][1] < 1e-6, r["fused vs truth"]
    assert r["unfused vs truth"][1] > 1e-5, r["unfused vs truth"]
    assert ("base", "float64", "clap") in fs.EXPLAINED


@SINCE_5_25
def test_a_causal_lm_of_a_part_of_a_composite_config_is_built_from_that_part():
    """AutoModelForCausalLM maps MusicGen's composite config to MusicgenForCausalLM, which takes its
    decoder's config alone: built from that part, on a sequence per codebook, it runs, and its loss
    (a cross-entropy per codebook) fuses."""
    row = fs.run_one("musicgen")
    assert row["status"] == "ok", row
    assert {"attention": 2, "cross_entropy": 4}.items() <= row["replaced"].items(), row["replaced"]


def test_a_composite_config_s_parts_get_their_own_overrides_which_stay_as_written():
    """A composite config's parts are made small with the overrides each gets when swept alone:
    Gemma 3n's text model its per-layer embeddings at the tiny vocabulary (2.3G parameters at its
    default 262144 x 8960) and its 4 layers, its audio encoder 2 conformer layers; Qwen2-Audio's
    encoder 16 positions of 16 mel bins. OVERRIDES stay as written though a config keeps the dicts
    it is given and the sweep writes into them (the multimodal rotary's sections into Cohere
    Compass's rope parameters: its text model alone then failed its validation after the
    composite's build)."""
    before = copy.deepcopy(fs.OVERRIDES)
    cfg = fs._config(transformers, "gemma3n", "sdpa", "image-text")
    assert (cfg.text_config.vocab_size_per_layer_input, cfg.text_config.num_hidden_layers) == (64, 4)
    assert cfg.audio_config.conf_num_hidden_layers == 2
    audio = fs._config(transformers, "qwen2_audio", "sdpa", "seq2seq").audio_config
    assert (audio.max_source_positions, audio.num_mel_bins) == (16, 16)
    if "cohere_compass" in transformers.CONFIG_MAPPING:
        for _ in range(2):
            fs._config(transformers, "cohere_compass", "sdpa", "image-text")
        fs._config(transformers, "cohere_compass_text", "sdpa")
    assert fs.OVERRIDES == before


@pytest.mark.parametrize("model_type, tower", [("gemma3n", "mobilenetv5_300m_enc"),
                                               ("fast_vlm", "fastvit_mci3"),
                                               ("perception_lm", "vit_pe_core_tiny_patch16_384")])
def test_a_timm_vision_tower_is_made_small_through_its_model_args(model_type, tower):
    """A VLM's timm tower (TimmWrapper: no sizes of its own) is the model's architecture built
    small through timm's arguments, at the width its projector reads (Perception LM's reads
    model_args' embed_dim). With timm (and a torchvision matching torch: not CI's), each trains
    fused and unfused and they agree; the vision tower's attention fuses."""
    cfg = fs._config(transformers, model_type, "sdpa", "image-text")
    vision = cfg.vision_config
    assert vision.architecture == tower and vision.model_args
    if model_type == "perception_lm":
        assert vision.model_args["embed_dim"] == vision.hidden_size == 32
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001  (ImportError, or a torchvision built for another torch: RuntimeError)
        pytest.skip("timm does not load here (it needs a torchvision matching torch)")
    row = fs.run_one(model_type, task="image-text")
    assert row["status"] == "ok", row
    assert row["replaced"]["attention"] > cfg.text_config.num_hidden_layers, row["replaced"]


def test_a_checkpointing_mismatch_the_unfused_model_has_too_says_so():
    """Gemma 3n's last layers read the KV of earlier ones outside their arguments, which a reentrant
    checkpoint's backward does not reach: the unfused model's gradients change under it as much as
    the fused one's, and the row says so."""
    row = fs.run_one("gemma3n_text", via="checkpoint")
    assert row["status"] == "MISMATCH", row
    assert row["why"].startswith("the unfused model differs as much under checkpointing: reentrant"), row


def test_the_fuzz_excuses_a_gradient_zero_in_exact_arithmetic_and_only_that():
    """bench/fuzz_rewriter.py's zero_in_exact_arithmetic: a ResNet block whose second norm has a
    group per channel removes the time embedding's per-channel shift, so that embedding's gradient
    is zero in exact arithmetic and a failure on it is excused, at the size of rounding noise; the
    image's gradient, the embedding's where the norm's groups span several channels, and an error
    as large as the gradients themselves (a wrong value, not noise) are not."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("bench/fuzz_rewriter.py runs in Triton's interpreter")
    import _random_blocks as rb
    import fuzz_rewriter

    inputs = rb.resnet_inputs(torch.float32, True)

    def excused(norm: str, name: str, error: str = "2.950e-03") -> bool:
        return fuzz_rewriter.zero_in_exact_arithmetic(
            lambda: rb.resnet_model(norm, "gelu", torch.float32, 1e-5, True), inputs, True,
            rb.resnet_float64_twin, f"{name}: max error {error} > bound 2.692e-03 (PyTorch's own 8.5e-04)")

    assert excused("gn_channel_groups", "grad input 1")
    assert not excused("gn_channel_groups", "grad input 1", error="4.0e+00")
    assert not excused("gn_channel_groups", "grad input 0")
    assert not excused("gn32", "grad input 1")
    assert not excused("gn_channel_groups", "output 0")
