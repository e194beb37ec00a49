"""Small real models for the fusion tests: Hugging Face models built from tiny configs (no
download), torch.nn.TransformerEncoder, and hand-written models in the styles people write
(nanoGPT; a block with data-dependent control flow and numpy). Each builder returns
(model, make_inputs(batch, seq) -> kwargs, loss(model, inputs) -> scalar), on the GPU when there
is one (the real kernels), else on the CPU."""
import functools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, LAYERS, VOCAB = 32, 2, 2, 64
# Not from tests/_device.py: importing it sets TRITON_INTERPRET, which the reference-path test
# (a subprocess importing this module) must not have.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_device(builder):
    @functools.wraps(builder)
    def build(*args, **kwargs):
        model, inputs, loss = builder(*args, **kwargs)

        def inputs_on_device(batch, seq):
            return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(batch, seq).items()}

        return model.to(DEVICE), inputs_on_device, loss

    return build


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers



def gpt_oss_rotary_tables_have_unit_stride() -> bool:
    """Whether this transformers' gpt-oss rotary gives cos and sin tables with a unit last-dim
    stride. Newer ones multiply position by frequency (contiguous); older ones take a matmul's
    transpose (a view of last-dim stride head_dim / 2), which the per-position gated add reads
    only by copying, so its rotary halves are rightly left there."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    tf = _quiet_transformers()
    cfg = tf.AutoConfig.for_model("gpt_oss", **_FAMILIES["gpt_oss"])
    x = torch.zeros(1, 3, HIDDEN)
    _, sin = GptOssRotaryEmbedding(cfg)(x, torch.arange(3)[None])
    return sin.stride(-1) == 1

@_on_device
def gpt2(dropout: float = 0.0, layers: int = LAYERS, attn_implementation: str = "sdpa"):
    tf = _quiet_transformers()
    cfg = tf.GPT2Config(n_layer=layers, n_embd=HIDDEN, n_head=HEADS, n_positions=64, vocab_size=VOCAB,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
                        eos_token_id=0, attn_implementation=attn_implementation)
    model = tf.GPT2LMHeadModel(cfg)

    def inputs(batch, seq):
        ids = torch.randint(0, VOCAB, (batch, seq))
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return model, inputs, lambda m, kw: m(**kw).loss


@_on_device
def bert(dropout: float = 0.0, layers: int = LAYERS, attn_implementation: str = "sdpa"):
    tf = _quiet_transformers()
    cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                        intermediate_size=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=64,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                        attn_implementation=attn_implementation)
    model = tf.BertForMaskedLM(cfg)

    def inputs(batch, seq):
        ids = torch.randint(0, VOCAB, (batch, seq))
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, seq - 2:] = 0  # padding: a real attention mask reaches the blocks
        return {"input_ids": ids, "attention_mask": mask, "labels": ids}

    return model, inputs, lambda m, kw: m(**kw).loss


def _image_classification(model, size: int):
    """(model, inputs, loss) for an image classifier of 3-channel size x size images, 3 labels."""
    def inputs(batch, seq):
        return {"pixel_values": torch.randn(batch, 3, size, size), "labels": torch.randint(0, 3, (batch,))}

    return model, inputs, lambda m, kw: m(**kw).loss


@_on_device
def vit(dropout: float = 0.0, layers: int = LAYERS):
    tf = _quiet_transformers()
    cfg = tf.ViTConfig(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                       intermediate_size=2 * HIDDEN, image_size=16, patch_size=8, num_labels=3,
                       hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                       attn_implementation="sdpa")
    return _image_classification(tf.ViTForImageClassification(cfg), 16)


@_on_device
def swinv2(stages: int = 2):
    """Swin V2 (transformers' Swinv2ForImageClassification): cosine attention in windows of 2x2
    patches with a learned scale per head and a relative position bias from a small MLP; the
    second block of the first stage (4x4 patches of 8x8 images) shifts its windows (the window mask
    added, twice, over a per-window view; the second stage's 2x2 patches are one window, unshifted);
    LayerNorms after each sublayer (res-post-norm), patch merging between the stages."""
    tf = _quiet_transformers()
    cfg = tf.Swinv2Config(image_size=8, patch_size=2, embed_dim=HIDDEN, depths=[2] * stages,
                          num_heads=[HEADS] * stages, window_size=2, num_labels=3, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return _image_classification(tf.Swinv2ForImageClassification(cfg), 8)


@_on_device
def hiera():
    """Hiera (transformers' HieraForImageClassification, the hierarchical ViT of SAM 2's design):
    attention on (batch, heads, windows, tokens, dim) tensors, mask-unit windows in the first two
    stages, q scaled before the product and max-pooled over the query stride at the first block
    of the later stages; no mask. Four stages of one block."""
    tf = _quiet_transformers()
    cfg = tf.HieraConfig(embed_dim=HIDDEN, image_size=[32, 32], patch_size=[8, 8], patch_stride=[4, 4],
                         patch_padding=[3, 3], masked_unit_size=[8, 8], depths=[1, 1, 1, 1], num_heads=[HEADS] * 4,
                         num_labels=3, drop_path_rate=0.0)
    return _image_classification(tf.HieraForImageClassification(cfg), 32)


@_on_device
def clip_vision(layers: int = LAYERS):
    """CLIP's vision tower with its projection (CLIPVisionModelWithProjection): pre-LayerNorm on
    the patch embeddings, QuickGELU MLPs (hidden_act='quick_gelu', x * sigmoid(1.702 x)), a
    post-LayerNorm on the class token. Its loss: the mean square of the image embeddings (any
    scalar of them trains the whole tower)."""
    tf = _quiet_transformers()
    cfg = tf.CLIPVisionConfig(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                              intermediate_size=2 * HIDDEN, image_size=32, patch_size=8,
                              projection_dim=HIDDEN, hidden_act="quick_gelu", attention_dropout=0.0,
                              attn_implementation="sdpa")
    model = tf.CLIPVisionModelWithProjection(cfg)

    def inputs(batch, seq):
        return {"pixel_values": torch.randn(batch, 3, 32, 32)}

    return model, inputs, lambda m, kw: m(**kw).image_embeds.square().mean()


@_on_device
def llama(layers: int = LAYERS, attn_implementation: str = "sdpa"):
    """Hugging Face's RMSNorm written out (fp32 upcast), SDPA (or the eager chain over repeat_kv)
    with grouped KV heads, SiLU MLP."""
    tf = _quiet_transformers()
    cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * HIDDEN, vocab_size=VOCAB,
                         max_position_embeddings=64, attn_implementation=attn_implementation)
    model = tf.LlamaForCausalLM(cfg)

    def inputs(batch, seq):
        ids = torch.randint(0, VOCAB, (batch, seq))
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return model, inputs, lambda m, kw: m(**kw).loss


IMAGE_TOKEN = VOCAB - 1  # a vision-language model's image placeholder, in the tiny vocabulary
_TEXT = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 2 * HIDDEN, "vocab_size": VOCAB,
         "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
_VISION = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "intermediate_size": 2 * HIDDEN, "image_size": 16, "patch_size": 4}


@_on_device
def vision_language(model_type: str):
    """A vision-language model trained on text with an image per sequence, as its processor lays
    them out (text, the image's placeholder tokens, text; the labels -100 at the image):
    LLaVA: CLIP's vision tower, its second-to-last layer's patches through a GeLU projector into
    a Llama (16 image tokens); Qwen2-VL: its own tower on flattened patches, each image's
    attention apart (a loop over images, SDPA each), 2x2 patches merged into 4 tokens, then a
    Qwen2 whose rotary takes (time, height, width) positions; Gemma 3: SigLIP's tower pooled to
    4 tokens, which the Gemma 3 text model attends to bidirectionally (token_type_ids)."""
    tf = _quiet_transformers()
    if model_type == "llava":
        cfg = tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(**_VISION),
                             text_config=tf.LlamaConfig(**_TEXT), image_token_index=IMAGE_TOKEN,
                             attn_implementation="sdpa")
        tokens = 16
    elif model_type == "qwen2_vl":
        half = HIDDEN // 4 // 2  # the heads' rotary half, split over time, height and width
        text = {**_TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                             "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}}
        vision = {"depth": LAYERS, "embed_dim": HIDDEN, "hidden_size": HIDDEN, "num_heads": HEADS,
                  "mlp_ratio": 2, "patch_size": 4, "temporal_patch_size": 2}
        cfg = tf.Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                               vision_start_token_id=VOCAB - 2, vision_end_token_id=VOCAB - 3,
                               video_token_id=VOCAB - 4, attn_implementation="sdpa")
        tokens = 4  # a 16x16 image: 4x4 patches of 4 pixels, merged 2x2
    elif model_type == "gemma3":
        cfg = tf.Gemma3Config(vision_config=tf.SiglipVisionConfig(**_VISION),
                              text_config=tf.Gemma3TextConfig(**_TEXT, head_dim=8, sliding_window=4),
                              mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=VOCAB - 2,
                              eoi_token_index=VOCAB - 3, attn_implementation="sdpa")
        tokens = 4
    else:
        raise ValueError(f"vision_language: no tiny config for {model_type!r}")
    model = tf.AutoModelForImageTextToText.from_config(cfg)

    def inputs(batch, seq):
        text = torch.randint(1, VOCAB - 4, (batch, seq))
        image = torch.full((batch, tokens), IMAGE_TOKEN)
        start = torch.full((batch, 1), VOCAB - 2) if model_type == "qwen2_vl" else image[:, :0]
        ids = torch.cat([text[:, :2], start, image, text[:, 2:]], dim=1)
        kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "labels": ids.masked_fill(ids >= VOCAB - 4, -100), "use_cache": False}
        if model_type == "qwen2_vl":
            kw["pixel_values"] = torch.randn(batch * 16, 3 * 2 * 4 * 4)  # (patches, channels x time x 4 x 4)
            kw["image_grid_thw"] = torch.tensor([[1, 4, 4]] * batch)
            kw["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
        else:
            kw["pixel_values"] = torch.randn(batch, 3, 16, 16)
        if model_type == "gemma3":
            kw["token_type_ids"] = (ids == IMAGE_TOKEN).long()
        return kw

    return model, inputs, lambda m, kw: m(**kw).loss


# More Hugging Face families, each for what it writes differently: Gemma's RMSNorm on an fp32 copy
# with (1 + w); Falcon's multi-query SDPA (one K/V head broadcast); OLMo's parameter-free
# LayerNorm on an fp32 copy; Phi's parallel attention + MLP; GPT-NeoX's parallel residual; OPT's
# flattened sum before its MLP norm; T5's RMSNorm spelling, relative position bias and
# encoder-decoder; BART; Phi-3's gated MLP from one projection split in two (`chunk`); Qwen2's
# gated MLP with one key/value head.
_DECODER = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS}
_MLP = {"intermediate_size": 2 * HIDDEN}
_SPEECH_ENCODER = {**_DECODER, **_MLP, "conv_dim": (HIDDEN,) * 7, "num_conv_pos_embeddings": 16,
                   "num_conv_pos_embedding_groups": 4, "mask_time_prob": 0.0, "layerdrop": 0.0,
                   **{k: 0.0 for k in ("hidden_dropout", "attention_dropout", "activation_dropout",
                                       "feat_proj_dropout", "final_dropout")}}
_FAMILIES = {
    "gemma": {**_DECODER, **_MLP, "num_key_value_heads": 1, "head_dim": HIDDEN // HEADS},
    # Gemma 2 needs transformers' eager attention (SDPA has no soft cap); a cap small enough to bend
    # the tiny model's scores
    "gemma2": {**_DECODER, **_MLP, "num_key_value_heads": 2, "head_dim": HIDDEN // HEADS,
               "attn_logit_softcapping": 2.0, "attn_implementation": "eager"},
    "falcon": {**_DECODER, "multi_query": True, "new_decoder_architecture": False, "hidden_dropout": 0.0,
               "attention_dropout": 0.0},
    "olmo": {**_DECODER, **_MLP},
    "phi": {**_DECODER, **_MLP, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
    "phi3": {**_DECODER, **_MLP, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
    "qwen2": {**_DECODER, **_MLP, "num_key_value_heads": 1},
    "gpt_neox": {**_DECODER, **_MLP, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "opt": {**_DECODER, "ffn_dim": 2 * HIDDEN, "word_embed_proj_dim": HIDDEN, "dropout": 0.0,
            "attention_dropout": 0.0},
    "t5": {"d_model": HIDDEN, "d_ff": 2 * HIDDEN, "d_kv": HIDDEN // HEADS, "num_layers": LAYERS, "num_heads": HEADS,
           "dropout_rate": 0.0, "decoder_start_token_id": 0},
    # the interleaved rotary convention: Cohere's on fp32 copies of q and k (`.float()`), its
    # parallel attention + MLP after one LayerNorm; GLM's on the first half of each head (partial
    # rotary), its tables halved and repeated per pair; Helium's on the whole head
    "cohere": {**_DECODER, **_MLP, "num_key_value_heads": HEADS},
    "glm": {**_DECODER, **_MLP, "num_key_value_heads": 1, "head_dim": HIDDEN // HEADS},
    "helium": {**_DECODER, **_MLP, "num_key_value_heads": 1, "head_dim": HIDDEN // HEADS},
    "bart": {"d_model": HIDDEN, "encoder_layers": LAYERS, "decoder_layers": LAYERS, "encoder_attention_heads": HEADS,
             "decoder_attention_heads": HEADS, "encoder_ffn_dim": 2 * HIDDEN, "decoder_ffn_dim": 2 * HIDDEN,
             "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "decoder_start_token_id": 0},
}
_FAMILIES.update({
    # ModernBERT: GeGLU from one projection chunked in two (`act(input) * gate`, the first half
    # activated), LayerNorms without bias, q and k cast to fp32 twice in its rotary, global and
    # sliding-window layers (a window narrower than the test's sequence: SDPA gets it as a mask)
    "modernbert": {**_DECODER, **_MLP, "local_attention": 4, "global_attn_every_n_layers": 2, "cls_token_id": 1,
                   "sep_token_id": 2},
    # Gemma 3: Gemma 2's four norms a block plus q and k norms, a sliding-window layer and a global one
    "gemma3_text": {**_DECODER, **_MLP, "num_key_value_heads": 1, "head_dim": HIDDEN // HEADS, "sliding_window": 4,
                    "layer_types": ["sliding_attention", "full_attention"]},
    # mixtures of experts: every expert's SwiGLU in one call; the router's softmax and top-k stay as
    # written. transformers' batched_mm experts: its default, grouped_mm, has no float64 (the
    # oracle); bench_coverage.py runs the default
    "qwen3_moe": {**_DECODER, "num_key_value_heads": 1, "head_dim": HIDDEN // HEADS, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 2 * HIDDEN, "experts_implementation": "batched_mm"},
    "olmoe": {**_DECODER, **_MLP, "num_experts": 4, "num_experts_per_tok": 2, "experts_implementation": "batched_mm"},
    # SmolLM3: the second layer without rotary (its NoPE layers)
    "smollm3": {**_DECODER, **_MLP, "num_key_value_heads": 1, "no_rope_layer_interval": 2},
    # Whisper: a BART-like encoder-decoder over log-mel features (two convolutions, the second strided)
    "whisper": {"d_model": HIDDEN, "encoder_layers": LAYERS, "decoder_layers": LAYERS, "encoder_attention_heads": HEADS,
                "decoder_attention_heads": HEADS, "encoder_ffn_dim": 2 * HIDDEN, "decoder_ffn_dim": 2 * HIDDEN,
                "num_mel_bins": 8, "max_source_positions": 8, "max_target_positions": 64, "dropout": 0.0,
                "attention_dropout": 0.0, "activation_dropout": 0.0, "decoder_start_token_id": 0},
    # text and vision towers, the contrastive loss: CLIP's quick_gelu (x * sigmoid(1.702 x)) fuses as
    # bias_gelu's quick form, SigLIP's gelu_pytorch_tanh as its tanh form
    "clip": {**_DECODER, **_MLP},
    "siglip": {**_DECODER, **_MLP},
    # DeBERTa-v2: disentangled attention (relative-position scores added to the scaled q k^T, on
    # (B*H, S, D) tensors; transformers has only its eager code for it)
    "deberta-v2": {**_DECODER, **_MLP, "relative_attention": True, "pos_att_type": ["p2c", "c2p"],
                   "position_buckets": 4, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                   "attn_implementation": "eager"},
    # DeepSeek-V3's multi-head latent attention: q and k 24 wide (16 + 8 rotary), v 8 (a value
    # head dim of its own), LoRA-compressed q and kv with their norms; the first layer dense, then
    # routed experts beside a shared one. Its interleaved rotary (even and odd features in, halves
    # out) stays as written.
    "deepseek_v3": {**_DECODER, "num_key_value_heads": HEADS, "q_lora_rank": 16, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 8, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 2 * HIDDEN, "intermediate_size": 2 * HIDDEN,
                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "experts_implementation": "batched_mm"},
    # DeepSeek-V2: DeepSeek-V3's latent attention with the rotary as a complex product
    # (`view_as_complex`, a `torch.polar` table), on (B, H, S, D) q and k
    "deepseek_v2": {**_DECODER, "num_key_value_heads": HEADS, "q_lora_rank": 16, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 8, "head_dim": 8,
                    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 2 * HIDDEN, "intermediate_size": 2 * HIDDEN, "first_k_dense_replace": 1,
                    "n_group": 1, "topk_group": 1, "experts_implementation": "batched_mm"},
    # Llama 4's text model: the rotary as a complex product on (B, S, H, D) q and k, then an L2
    # norm of each (no weight), routed experts beside a shared one
    "llama4_text": {**_DECODER, **_MLP, "intermediate_size_mlp": 2 * HIDDEN, "num_key_value_heads": 1,
                    "head_dim": HIDDEN // HEADS, "num_local_experts": 4, "num_experts_per_tok": 1,
                    "experts_implementation": "batched_mm"},
    # Gemma 4: seven RMSNorms a block written with pow(-0.5) (the value norm without a weight), a
    # per-layer input gated by GeLU, a sliding-window layer and a global one with its own head dim
    # (512 in the real models, past trifuse's 256: 32 here), the shared KV states in a UserDict
    "gemma4_text": {**_DECODER, **_MLP, "num_key_value_heads": 1, "head_dim": HIDDEN // HEADS, "sliding_window": 4,
                    "layer_types": ["sliding_attention", "full_attention"], "per_layer_config": {"01": {"head_dim": HIDDEN}},
                    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8},
})
_FAMILIES.update({
    # Older decoders whose blocks return their attention weights (the blocks' second output), with
    # transformers' eager attention only. GPT-J and CodeGen: interleaved rotary (`rotate_every_two`)
    # on the first rotary_dim of each head of (B, S, H, D) tensors, q and k in fp32, a parallel block (attention + MLP +
    # residual in one sum). CodeGen splits its fused qkv in mp_num = 4 groups (heads a multiple of 4).
    "gptj": {**_DECODER, "rotary_dim": 8, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
             "attn_implementation": "eager"},
    "codegen": {**_DECODER, "num_attention_heads": 4, "rotary_dim": 4, "n_ctx": 64, "resid_pdrop": 0.0,
                "embd_pdrop": 0.0, "attn_pdrop": 0.0, "attn_implementation": "eager"},
    # GPT-Neo: unscaled scores in fp32, `torch.where(causal, scores, finfo.min)`; a global layer and
    # a local one (a window narrower than the test's sequence)
    "gpt_neo": {**_DECODER, **_MLP, "attention_types": [[["global", "local"], LAYERS // 2]], "window_size": 4,
                "resid_dropout": 0.0, "embed_dropout": 0.0, "attention_dropout": 0.0, "attn_implementation": "eager"},
    # ImageGPT: its own RMSNorm written out (`x / sqrt(mean(square(x), axis=-1) + eps) * w`), the
    # scores divided by sqrt(d), `torch.where(causal, scores, tensor(finfo.min))`, QuickGELU
    "imagegpt": {**_DECODER, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                 "attn_implementation": "eager"},
    # BLOOM: ALiBi through `alibi.baddbmm(q, k^T, beta=1, alpha=1/sqrt(d))` on (B*H, S, D) tensors, a
    # LayerNorm on the embeddings, its own GeLU (an autograd.Function in training)
    "bloom": {**_DECODER, "hidden_dropout": 0.0, "attention_dropout": 0.0, "attn_implementation": "eager"},
    # MPT: ALiBi, no biases in its linears and LayerNorms, its MLP 4x wide whatever the config says
    "mpt": {**_DECODER, "attn_config": {"attn_pdrop": 0}, "resid_pdrop": 0, "emb_pdrop": 0,
            "attn_implementation": "eager"},
    # gpt-oss: attention sinks (a learned logit per head in the softmax's denominator, transformers'
    # eager attention only) over repeat_kv, a sliding-window layer and a full one, its clamped SwiGLU
    # experts (the clamps left as written; gate * sigmoid(1.702 gate) is bias_gelu's quick form)
    "gpt_oss": {**_DECODER, **_MLP, "num_key_value_heads": 1, "head_dim": HIDDEN // HEADS, "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 4,
                "num_experts_per_tok": 2, "attn_implementation": "eager", "experts_implementation": "batched_mm"},
    # BioGPT: pre-norm blocks with SDPA
    "biogpt": {**_DECODER, **_MLP, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
               "activation_dropout": 0.0},
})
_FAMILIES.update({
    # MPNet: relative position bias added in place (`scores += position_bias`) before the padding
    # mask; RemBERT: BERT's eager chain in blocks that return their probabilities, called with
    # output_attentions by position
    "mpnet": {**_DECODER, **_MLP, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
              "attn_implementation": "eager"},
    "rembert": {**_DECODER, **_MLP, "input_embedding_size": HIDDEN, "output_embedding_size": HIDDEN,
                "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "attn_implementation": "eager"},
    # DistilBERT: its MLM head written in the model's own forward, the loss a CrossEntropyLoss child
    "distilbert": {"dim": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS, "hidden_dim": 2 * HIDDEN, "dropout": 0.0,
                   "attention_dropout": 0.0},
    # SqueezeBERT: 1x1 grouped convolutions on (B, C, S); its key viewed per head is k^T already
    "squeezebert": {**_DECODER, **_MLP, "embedding_size": HIDDEN, "hidden_dropout_prob": 0.0,
                    "attention_probs_dropout_prob": 0.0, "attn_implementation": "eager"},
    # DeBERTa (v1): disentangled attention on (B, H, S, D) tensors, q divided before the product,
    # c2p + p2c relative scores added, padding queries masked whole; its own LayerNorm written out
    "deberta": {**_DECODER, **_MLP, "relative_attention": True, "pos_att_type": ["c2p", "p2c"],
                "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "attn_implementation": "eager"},
})
_FAMILIES.update({
    # TrOCR's decoder: BART's older eager attention on (B*H, S, D) tensors (q scaled before the bmm,
    # the causal mask added to the scores viewed per head); MiMo-V2-Flash: a full-attention layer
    # without sinks whose eager chain subtracts the row max all the same, and a sliding-window one
    # with sinks (gpt-oss's spelling, its kv heads doubled: one per query head, no repeat_kv); q/k and
    # v of different head dims. Granite's sliding-window model: its sinks as a sigmoid(logsumexp -
    # sink) scale of the output, in both layers.
    "trocr": {"d_model": HIDDEN, "decoder_layers": LAYERS, "decoder_attention_heads": HEADS,
              "decoder_ffn_dim": 2 * HIDDEN, "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
              "attn_implementation": "eager"},
    "mimo_v2_flash": {**_DECODER, **_MLP, "num_key_value_heads": 1, "head_dim": HIDDEN // HEADS,
                      "v_head_dim": HIDDEN // (2 * HEADS), "sliding_window": 4,
                      "layer_types": ["full_attention", "sliding_attention"], "mlp_layer_types": ["dense", "dense"],
                      "attn_implementation": "eager"},
    "granite_swa": {**_DECODER, **_MLP, "num_key_value_heads": 1, "sliding_window": 4,
                    "layer_types": ["sliding_attention", "full_attention"], "attn_implementation": "eager"},
    # XGLM: BART's older chain with the masked scores clamped, `torch.max(scores + mask,
    # torch.full((), finfo(dtype).min))`; its float64 copy runs with float64 the default dtype (below)
    "xglm": {"d_model": HIDDEN, "num_layers": LAYERS, "attention_heads": HEADS, "ffn_dim": 2 * HIDDEN,
             "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "attn_implementation": "eager"},
    # Speech to characters with a CTC loss over raw 16 kHz samples: wav2vec 2.0's convolutional
    # feature encoder (GeLU after each convolution, unfused), a convolutional position embedding,
    # post-norm blocks; WavLM's pre-norm (stable) blocks call F.multi_head_attention_forward
    # themselves, with separate q/k/v weights, its gated relative position bias as a per-head float
    # attn_mask (which gets its gradient) and the frames' padding as a boolean key padding mask.
    # SpecAugment's masks and LayerDrop, drawn per training call, off.
    "wav2vec2": {**_SPEECH_ENCODER, "feat_extract_norm": "group"},
    "wavlm": {**_SPEECH_ENCODER, "feat_extract_norm": "layer", "do_stable_layer_norm": True, "num_buckets": 8,
              "max_bucket_distance": 16, "attn_implementation": "eager"},
})
_FAMILIES.update({
    # The squared ReLU (`hidden_act="relu2"`, transformers' ReLUSquaredActivation): Nemotron's
    # unbiased up_proj then relu2 (its LayerNorm1P, `F.layer_norm(x, w + 1, b)`, on partial rotary);
    # Persimmon's biased dense_h_to_4h then relu2 (q and k LayerNorms); BitNet's gated relu2,
    # `ffn_sub_norm(relu2(gate_proj(x)) * up_proj(x))`.
    "nemotron": {**_DECODER, **_MLP, "num_key_value_heads": 1},
    "persimmon": {**_DECODER, **_MLP, "qk_layernorm": True, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "bitnet": {**_DECODER, **_MLP, "num_key_value_heads": 1},
    # Apertus: xIELU (trainable, two coefficients, its PyTorch path) after an unbiased up_proj
    "apertus": {**_DECODER, **_MLP, "num_key_value_heads": 1},
})
# LongT5: T5 with local attention in its encoder, whose attention returns its probabilities always;
# SwitchTransformers: T5 with mixture-of-experts MLPs, its blocks' flags in TransformersKwargs
_FAMILIES["longt5"] = {**_FAMILIES["t5"], "local_radius": 4, "attn_implementation": "eager"}
_FAMILIES["switch_transformers"] = {**_FAMILIES["t5"], "num_decoder_layers": LAYERS, "num_experts": 2,
                                   "expert_capacity": 16, "attn_implementation": "eager"}
SEQ2SEQ = ("t5", "bart", "longt5", "switch_transformers")
MASKED = ("modernbert", "deberta-v2", "deberta", "mpnet", "rembert", "distilbert", "squeezebert")
SPEECH = ("whisper",)
CTC = ("wav2vec2", "wavlm")
CONTRASTIVE = ("clip", "siglip")


def _float64_default_for_float64_copies(model: nn.Module) -> None:
    """XGLM builds its clamp's floor as `torch.full((), finfo(scores' dtype).min)` in the default
    dtype, which overflows float32 (an error) in a float64 copy, the tests' oracle: the model's
    calls run with float64 as the default dtype while its parameters are float64 (hooks that
    `copy.deepcopy` carries to the copy)."""
    prior = []

    def before(module, args, kwargs):
        prior.append(torch.get_default_dtype())
        if next(module.parameters()).dtype == torch.float64:
            torch.set_default_dtype(torch.float64)

    def after(module, args, kwargs, output):
        torch.set_default_dtype(prior.pop())

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)


@_on_device
def hf_family(model_type: str, **overrides):
    """A tiny Hugging Face model of `model_type` (a key of _FAMILIES, its config changed by
    `overrides`) with its training loss: an LM, a masked LM with padding, a speech-to-text model,
    text and vision towers with a contrastive loss, or speech to characters (CTC). Dropout off,
    SDPA attention unless the family says otherwise."""
    tf = _quiet_transformers()
    if model_type in CONTRASTIVE:
        text = {**_FAMILIES[model_type], "vocab_size": VOCAB, "max_position_embeddings": 64, "pad_token_id": 0,
                "bos_token_id": 0, "eos_token_id": 0}
        vision = {**_FAMILIES[model_type], "image_size": 16, "patch_size": 8}
        cfg = tf.AutoConfig.for_model(model_type, text_config=text, vision_config=vision, projection_dim=HIDDEN,
                                      attn_implementation="sdpa")
        model = tf.AutoModel.from_config(cfg)
    else:
        # ImageGPT's head predicts vocab_size - 1 colour clusters (its last id is the start token)
        vocab = VOCAB + 1 if model_type == "imagegpt" else VOCAB
        cfg = tf.AutoConfig.for_model(model_type, vocab_size=vocab, max_position_embeddings=64, pad_token_id=0,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
                                      **{"attn_implementation": "sdpa", **_FAMILIES[model_type], **overrides})
        auto = (tf.AutoModelForSeq2SeqLM if model_type in SEQ2SEQ else tf.AutoModelForMaskedLM if model_type in MASKED
                else tf.AutoModelForSpeechSeq2Seq if model_type in SPEECH
                else tf.AutoModelForCTC if model_type in CTC
                else tf.ImageGPTForCausalImageModeling if model_type == "imagegpt"
                else tf.AutoModelForCausalLM)
        model = auto(cfg) if model_type == "imagegpt" else auto.from_config(cfg)
        if model_type == "xglm":
            _float64_default_for_float64_copies(model)

    def inputs(batch, seq):
        ids = torch.randint(1, VOCAB, (batch, seq))
        if model_type in SEQ2SEQ or model_type in SPEECH:
            target = torch.randint(1, VOCAB, (batch, seq - 2))
            source = ({"input_features": torch.randn(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions)}
                      if model_type in SPEECH else {"input_ids": ids})
            return {**source, "decoder_input_ids": target, "labels": target, "use_cache": False}
        if model_type in MASKED:
            mask = torch.ones(batch, seq, dtype=torch.long)
            mask[0, seq - 2:] = 0
            return {"input_ids": ids, "attention_mask": mask, "labels": ids}
        if model_type in CONTRASTIVE:
            return {"input_ids": ids, "pixel_values": torch.randn(batch, 3, 16, 16), "return_loss": True}
        if model_type in CTC:  # about `seq` frames of audio (320 samples each); the first clip's end padded
            samples = 320 * seq + 80
            mask = torch.ones(batch, samples, dtype=torch.long)
            mask[0, samples - 600:] = 0
            labels = torch.randint(1, VOCAB, (batch, 3))
            labels[0, -1] = -100  # a shorter transcript, padded as a CTC collator pads it
            return {"input_values": torch.randn(batch, samples), "attention_mask": mask, "labels": labels}
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return model, inputs, lambda m, kw: m(**kw).loss


@_on_device
def transformer_encoder(norm_first: bool, dropout: float = 0.0, layers: int = LAYERS):
    layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, 2 * HIDDEN, dropout=dropout, activation="gelu",
                                       batch_first=True, norm_first=norm_first)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def inputs(batch, seq):
        return {"src": torch.randn(batch, seq, HIDDEN)}

    return model, inputs, lambda m, kw: m(**kw).square().mean()


@_on_device
def transformer(layers: int = LAYERS):
    """nn.Transformer, batch first: post-norm encoder and decoder layers, the decoder's
    cross-attention on the encoder's output with a key padding mask, a causal target mask."""
    model = nn.Transformer(HIDDEN, HEADS, layers, layers, 2 * HIDDEN, dropout=0.0, batch_first=True)

    def inputs(batch, seq):
        pad = torch.zeros(batch, seq, dtype=torch.bool)
        pad[0, seq - 2:] = True
        return {"src": torch.randn(batch, seq, HIDDEN), "tgt": torch.randn(batch, seq - 1, HIDDEN),
                "tgt_mask": nn.Transformer.generate_square_subsequent_mask(seq - 1), "tgt_is_causal": True,
                "memory_key_padding_mask": pad}

    return model, inputs, lambda m, kw: m(**kw).square().mean()


# ---------------------------------------------------------------------------------------------
# nanoGPT, as Karpathy wrote it (flash: SDPA; otherwise the explicit masked chain)
# ---------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout, block_size, flash):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout, self.flash = n_head, n_embd, dropout, flash
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                               is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout, block_size, flash):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, block_size, flash)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    def __init__(self, flash=True, dropout=0.0, layers=LAYERS, block_size=64):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(VOCAB, HIDDEN), "wpe": nn.Embedding(block_size, HIDDEN), "drop": nn.Dropout(dropout),
            "h": nn.ModuleList([Block(HIDDEN, HEADS, dropout, block_size, flash) for _ in range(layers)]),
            "ln_f": nn.LayerNorm(HIDDEN)})
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        t = idx.size(1)
        assert t <= self.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


@_on_device
def nanogpt(flash: bool = True, dropout: float = 0.0, layers: int = LAYERS):
    model = NanoGPT(flash, dropout, layers)

    def inputs(batch, seq):
        ids = torch.randint(0, VOCAB, (batch, seq))
        return {"idx": ids, "targets": ids}

    return model, inputs, lambda m, kw: m(**kw)


# ---------------------------------------------------------------------------------------------
# A Llama written the way PyTorch-native training code writes it. torchtitan (and Meta's
# reference): blocks in a ModuleDict keyed by layer index, the rotary as a complex product with a
# torch.polar table passed to every block, the key and value heads repeated for GQA on (B, S, H,
# D) tensors before the transpose. torchtune (and gpt-fast): a RoPE module with a cache of (cos,
# sin) pairs applied to q and to k in real arithmetic, the repeat after the transpose by
# `unsqueeze(2).expand(...).flatten(1, 2)`, blocks in a ModuleList. Both: torch.nn.RMSNorm,
# SwiGLU as w2(silu(w1 x) * w3 x), SDPA causal.
# ---------------------------------------------------------------------------------------------


def polar_table(head_dim: int, positions: int, theta: float = 10000.0) -> torch.Tensor:
    """(positions, head_dim / 2) complex64: e^(i * position * theta^(-2j / head_dim))."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(positions).float(), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def rotate_as_complex(xq, xk, table):
    """xq, xk (B, S, H, D): their pairs times the table's first S rows as complex numbers."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    table = table[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * table).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * table).flatten(3).type_as(xk))


def repeat_heads(x, n_rep):
    """(B, S, Hkv, D) -> (B, S, Hkv * n_rep, D), each key head repeated n_rep times in a row."""
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x.unsqueeze(3).expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


class CachedRope(nn.Module):
    """torchtune's way: (positions, D/2, 2) cos and sin, the pairs of (B, S, H, D) rotated in real arithmetic."""

    def __init__(self, head_dim, positions):
        super().__init__()
        table = polar_table(head_dim, positions)
        self.register_buffer("cache", torch.stack([table.real, table.imag], dim=-1), persistent=False)

    def forward(self, x):
        xs = x.float().reshape(*x.shape[:-1], -1, 2)
        cache = self.cache[: x.size(1)].view(-1, xs.size(1), 1, xs.size(3), 2)
        out = torch.stack([xs[..., 0] * cache[..., 0] - xs[..., 1] * cache[..., 1],
                           xs[..., 1] * cache[..., 0] + xs[..., 0] * cache[..., 1]], -1)
        return out.flatten(3).type_as(x)


class NativeAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads, style="torchtitan", max_seq=64):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.style = heads, kv_heads, dim // heads, style
        if style == "torchtune":
            self.pos_embeddings = CachedRope(self.head_dim, max_seq)
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, table=None):
        b, s, _ = x.shape
        xq = self.wq(x).view(b, s, -1, self.head_dim)
        xk = self.wk(x).view(b, s, -1, self.head_dim)
        xv = self.wv(x).view(b, s, -1, self.head_dim)
        if self.style == "torchtune":
            q, k, v = self.pos_embeddings(xq).transpose(1, 2), self.pos_embeddings(xk).transpose(1, 2), xv.transpose(1, 2)
            expand_shape = (b, self.kv_heads, self.heads // self.kv_heads, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))
        xq, xk = rotate_as_complex(xq, xk, table)
        keys, values = repeat_heads(xk, self.heads // self.kv_heads), repeat_heads(xv, self.heads // self.kv_heads)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class NativeFeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class NativeBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden, eps=1e-5, style="torchtitan"):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)
        self.attention = NativeAttention(dim, heads, kv_heads, style)
        self.feed_forward = NativeFeedForward(dim, hidden)

    def forward(self, x, table=None):
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class NativeLlama(nn.Module):
    def __init__(self, layers=LAYERS, dim=HIDDEN, heads=HEADS, kv_heads=1, vocab=VOCAB, max_seq=64,
                 style="torchtitan"):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        blocks = [NativeBlock(dim, heads, kv_heads, 2 * dim, style=style) for _ in range(layers)]
        if style == "torchtitan":
            self.register_buffer("freqs_cis", polar_table(dim // heads, max_seq), persistent=False)
            self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        else:
            self.freqs_cis = None
            self.layers = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in (self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers):
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


@_on_device
def native_llama(layers: int = LAYERS, style: str = "torchtitan"):
    model = NativeLlama(layers, style=style)

    def inputs(batch, seq):
        return {"tokens": torch.randint(0, VOCAB, (batch, seq))}

    def loss(m, kw):
        logits = m(**kw)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), kw["tokens"][:, 1:].flatten())

    return model, inputs, loss


# ---------------------------------------------------------------------------------------------
# A block fx cannot trace and Dynamo must break on: data-dependent control flow and numpy.
# ---------------------------------------------------------------------------------------------


class QuirkyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.norm(x)
        if h.sum() > 0:  # data-dependent branch
            h = h * 2.0
        scale = float(np.sqrt(x.detach().cpu().numpy().shape[-1]))  # numpy on the data
        return x + F.gelu(self.fc(h)) / scale


class Quirky(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([QuirkyBlock() for _ in range(LAYERS)])
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
            if x.abs().max().item() > 1e6:  # more data-dependent control flow, outside the blocks
                x = x / 2
        return self.head(x)


@_on_device
def quirky():
    model = Quirky()

    def inputs(batch, seq):
        return {"x": torch.randn(batch, seq, HIDDEN)}

    return model, inputs, lambda m, kw: m(**kw).square().mean()
