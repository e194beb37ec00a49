"""fuse() on real models nobody here wrote (Hugging Face GPT-2, BERT, ViT, Llama and more from tiny
configs; torch.nn.TransformerEncoder post-norm and pre-norm) and on nanoGPT as written: every
block fused, the trifuse ops run, outputs and gradients equal the unfused model by the oracle
rule, the model keeps its class, Parameter objects and state_dict."""
import contextlib
import copy
import functools
import inspect

import _models
import pytest
import torch
import torch.nn.functional as F
import trifuse
from _fusing import available_counts, has_op, op_names, trifuse_ops_run
from tolerances import assert_close

L = _models.LAYERS
PRE_NORM = {"layer_norm": L + 1, "attention": L, "bias_gelu": L, "residual_stream": L, "dropout_add": L}
LOSS = {"cross_entropy": 1}
# Gated MLPs (Llama, Gemma, OLMo, Phi-3, Qwen2): act(gate_proj(x)) * up_proj(x), once per block.
GATED = {"gated_activation": L}
# q and k of every block rotated together (partial-rotary Phi, GPT-NeoX and GLM: on their slices;
# Cohere, GLM and Helium in the interleaved convention)
ROTARY = {"rotary": L}
# nanoGPT calls its blocks from the forward that computes the loss: the head capture (installed
# when the cross-entropy ops exist) traces the whole model, and the residual stream fuses across
# blocks (each ln_1 and ln_f take the add before them). Without it, its blocks fuse one by one.
NANOGPT = ({"layer_norm": 1, "attention": L, "bias_gelu": L, "residual_stream": 2 * L, **LOSS}
           if has_op("cross_entropy") else PRE_NORM)
BERT = {"layer_norm": 2, "attention": L, "bias_gelu": L + 1, "residual_stream": 2 * L, **LOSS}
# The attention pattern each eager model's blocks take (a dict: the patterns its layers take, how often).
EAGER_ATTENTION = {"gpt2-eager": "attention_chain_mul_add_dropout_cast",
                   "bert-eager": "attention_chain_mul_add_dropout",
                   "gpt_oss": "attention_chain_sinks_add_repeat_kv", "trocr": "attention_bmm_add_dropout",
                   "xglm": "attention_bmm_add_clamp_dropout", "wavlm": "self_attention_mha",
                   "imagegpt": "attention_chain_div_where_tensor_dropout_cast",
                   "squeezebert": "attention_chain_div_add_dropout_k_transposed",
                   "granite_swa": "attention_chain_sink_scale_add_repeat_kv",
                   "mimo_v2_flash": {"attention_chain_max_sub_add_repeat_kv": 1, "attention_chain_sinks_add": 1}}
# In eval without grad, nn.TransformerEncoderLayer runs PyTorch's own fused fast path
# (torch._transformer_encoder_layer_fwd): nothing is left to fuse there.
EVAL_FAST_PATH = ("encoder-post-norm", "encoder-pre-norm")
# nn.Transformer in eval: its encoder layers take that fast path, its decoder layers (which have
# none) fuse as in training.
EVAL_COUNTS = {"transformer": {"layer_norm": 2, "attention": 2 * L, "bias_gelu": L, "residual_stream": 3 * L}}
# BLOOM's GeLU is an autograd.Function in training and its tanh formula written out in eval: fused in eval only.
EVAL_ONLY = {"bloom": {"bias_gelu": L}}


def _family(name):
    return functools.partial(_models.hf_family, name)


MODELS = {
    # name: (builder, counts in every forward)
    "gpt2": (_models.gpt2, {**PRE_NORM, **LOSS}),
    "bert": (_models.bert, BERT),
    # transformers' eager attention: the explicit chain (GPT-2's with `.type(value.dtype)` after the softmax)
    "gpt2-eager": (lambda: _models.gpt2(attn_implementation="eager"), {**PRE_NORM, **LOSS}),
    "bert-eager": (lambda: _models.bert(attn_implementation="eager"), BERT),
    "vit": (_models.vit, {**PRE_NORM, **LOSS}),
    "llama": (_models.llama, {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED, **ROTARY, **LOSS}),
    # transformers' eager attention over repeat_kv: fused with enable_gqa on the un-repeated K and V
    "llama-eager": (lambda: _models.llama(attn_implementation="eager"),
                    {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED, **ROTARY, **LOSS}),
    "encoder-post-norm": (lambda: _models.transformer_encoder(False),
                          {"attention": L, "bias_gelu": L, "residual_stream": 2 * L}),
    "encoder-pre-norm": (lambda: _models.transformer_encoder(True),
                         {"layer_norm": L, "attention": L, "bias_gelu": L, "residual_stream": L, "dropout_add": L}),
    # nn.Transformer: the decoder layers' self- and cross-attention (nn.MultiheadAttention, which
    # Dynamo traces into where fx would keep it a module call); post-norm, ReLU
    "transformer": (_models.transformer, {"layer_norm": 2, "attention": 3 * L, "bias_gelu": 2 * L,
                                          "residual_stream": 5 * L}),
    "nanogpt": (_models.nanogpt, NANOGPT),
    "nanogpt-explicit-attention": (lambda: _models.nanogpt(flash=False), NANOGPT),
    # A Llama as PyTorch-native training code writes it (tests/_models.py), its loss outside the
    # model. torchtitan's: blocks in a ModuleDict, the rotary as a complex product, K and V
    # repeated on (B, S, H, D) before the transpose (GQA); torchtune's: a RoPE module with a cache
    # of (cos, sin) pairs on q and on k, the repeat by unsqueeze + expand + flatten
    "native-llama": (_models.native_llama, {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED,
                                            **ROTARY}),
    "native-llama-torchtune": (lambda: _models.native_llama(style="torchtune"),
                               {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED, **ROTARY}),
    # More Hugging Face families (tests/_models.py, _FAMILIES says what each writes differently).
    # Parallel blocks (Falcon, Phi, GPT-NeoX) have no add feeding a norm inside a block: their
    # residual adds fuse as dropout_add. T5's self-attention adds a learned position bias as
    # attn_mask, which needs its gradient (the attention op gives it).
    "gemma": (_family("gemma"), {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED, **ROTARY,
                                 **LOSS}),
    # Gemma 2's eager attention with its logit soft cap; four norms a block, the two after a sublayer
    # each one op with the add after it (layer_norm_add)
    "gemma2": (_family("gemma2"), {"rms_norm": 2 * L + 1, "attention": L, "residual_stream": 2 * L, **GATED, **ROTARY,
                                   **LOSS}),
    "falcon": (_family("falcon"), {"layer_norm": L + 1, "attention": L, "dropout_add": L, **ROTARY, **LOSS}),
    "olmo": (_family("olmo"), {"layer_norm": L + 1, "attention": L, "residual_stream": L, **GATED, **ROTARY,
                               **LOSS}),
    # Phi, GPT-NeoX, GPT-J, CodeGen: parallel blocks, `dropout(attn) + dropout(mlp) + residual`, both
    # dropouts fused (parallel_dropouts_add)
    "phi": (_family("phi"), {"layer_norm": L + 1, "attention": L, "bias_gelu": L, "dropout_add": 2 * L, **ROTARY,
                             **LOSS}),
    # Phi-3: `gate, up = gate_up_proj(x).chunk(2, dim=-1)`, the halves read in place; its residual
    # dropouts (p = 0 here) before the add fuse as dropout_add, the add into the next norm
    "phi3": (_family("phi3"), {"rms_norm": L + 1, "attention": L, "residual_stream": L, "dropout_add": L, **GATED,
                               **ROTARY, **LOSS}),
    "qwen2": (_family("qwen2"), {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED, **ROTARY,
                                 **LOSS}),
    "gpt_neox": (_family("gpt_neox"),
                 {"layer_norm": 2 * L + 1, "attention": L, "bias_gelu": L, "dropout_add": 2 * L, **ROTARY, **LOSS}),
    # The interleaved rotary convention (rotary_interleaved_q_k). Cohere rotates fp32 copies of
    # q and k (`.float()`, cast back after); its parallel block sums residual + attention + MLP
    # in one expression, with no norm after it inside the block: nothing there to fuse.
    "cohere": (_family("cohere"), {"layer_norm": L + 1, "attention": L, **GATED, **ROTARY, **LOSS}),
    # GLM: partial rotary on the first half of each head, tables halved and repeated per pair
    "glm": (_family("glm"), {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED, **ROTARY, **LOSS}),
    "helium": (_family("helium"), {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED, **ROTARY,
                                   **LOSS}),
    # OPT flattens the sum to rows before the MLP's norm (a reshape that commutes with the norm)
    "opt": (_family("opt"), {"layer_norm": L + 1, "attention": L, "bias_gelu": L, "residual_stream": L,
                             "dropout_add": L, **LOSS}),
    # encoder-decoder: L encoder and L decoder blocks; each stack's last add feeds its final norm
    # across the block boundary (left as dropout_add), the others fuse with the next block's norm
    "t5": (_family("t5"), {"rms_norm": 2 * L + 2, "residual_stream": 3 * L, "dropout_add": 2 * L,
                           "attention": 3 * L, **LOSS}),
    "bart": (_family("bart"), {"layer_norm": 2, "attention": 3 * L, "bias_gelu": 2 * L, "residual_stream": 5 * L,
                               **LOSS}),
    # ModernBERT: GeGLU from one projection chunked in two, rotary on q and k cast to fp32 twice (one
    # cast after normalize.py), its first block without an attention norm, a sliding-window layer
    "modernbert": (_family("modernbert"), {"layer_norm": L + 2, "attention": L, "residual_stream": L, **GATED,
                                           **ROTARY, **LOSS}),
    # Gemma 3: six RMSNorms a block (q and k norms among them), sliding-window and global layers
    "gemma3_text": (_family("gemma3_text"), {"rms_norm": 4 * L + 1, "attention": L, "residual_stream": 2 * L, **GATED,
                                             **ROTARY, **LOSS}),
    # mixtures of experts: all experts' SwiGLU in one call a block; the router's softmax is left
    "qwen3_moe": (_family("qwen3_moe"), {"rms_norm": 3 * L + 1, "attention": L, "residual_stream": L, **GATED,
                                         **ROTARY, **LOSS}),
    "olmoe": (_family("olmoe"), {"rms_norm": 3 * L + 1, "attention": L, "residual_stream": L, **GATED, **ROTARY,
                                 **LOSS}),
    # SmolLM3: every second layer without rotary
    "smollm3": (_family("smollm3"), {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED,
                                     "rotary": L // 2, **LOSS}),
    # Whisper: pre-norm encoder-decoder as T5 (each stack's last add feeds its final norm across the
    # block boundary, left as dropout_add)
    "whisper": (_family("whisper"), {"layer_norm": 2 * L + 2, "attention": 3 * L, "bias_gelu": 2 * L,
                                     "residual_stream": 3 * L, "dropout_add": 2 * L, **LOSS}),
    # two towers of L blocks; CLIP's quick_gelu becomes bias_gelu's quick form; SigLIP's pooling
    # head adds a LayerNorm, a GeLU MLP and its probe's nn.MultiheadAttention (weights dropped)
    "clip": (_family("clip"), {"layer_norm": 2 * L + 3, "attention": 2 * L, "bias_gelu": 2 * L,
                               "residual_stream": 2 * L}),
    # CLIP's vision tower alone (OWL-ViT, CLIPSeg and X-CLIP build on it): pre- and post-LayerNorm,
    # fc1 + QuickGELU as bias_gelu's quick form
    "clip-vision": (_models.clip_vision, {"layer_norm": L + 2, "attention": L, "bias_gelu": L,
                                          "residual_stream": L}),
    "siglip": (_family("siglip"), {"layer_norm": 2 * L + 3, "attention": 2 * L + 1, "bias_gelu": 2 * L + 1,
                                   "residual_stream": 2 * L}),
    # Swin V2: cosine attention (a learned scale per head moved onto q, the relative position bias
    # the op's mask, in shifted windows with the window mask added; q's and k's F.normalize floored
    # RMSNorms), two stages of two blocks; its norms after each sublayer (y = r + LN(x)) become
    # layer_norm_add with their adds
    "swinv2": (_models.swinv2, {"layer_norm": 3, "residual_stream": 4 * L, "attention": 2 * L, "bias_gelu": 2 * L,
                                "rms_norm": 4 * L, **LOSS}),
    # Hiera: attention on (batch, heads, windows, tokens, dim) tensors, q scaled before the product
    # (the op's scale 1), heads and windows flattened into the op's heads; four stages of one block
    "hiera": (_models.hiera, {"layer_norm": 5, "attention": 4, "bias_gelu": 4, "residual_stream": 4, **LOSS}),
    # DeBERTa-v2's disentangled attention: the relative-position scores become the op's mask
    "deberta-v2": (_family("deberta-v2"), BERT),
    # DeBERTa (v1): q scaled before the product, the relative scores the op's mask; its LayerNorm
    # written out (on an fp32 copy, divided by the root) fuses with the residual add before it
    "deberta": (_family("deberta"), BERT),
    # MPNet's position bias and padding mask, added one after the other, become the op's one mask;
    # RemBERT's blocks return their probabilities (dropped: output_attentions=False by position)
    "mpnet": (_family("mpnet"), BERT),
    "rembert": (_family("rembert"), BERT),
    # DistilBERT: the MLM head in the model's forward, its loss a CrossEntropyLoss child (head capture)
    "distilbert": (_family("distilbert"), BERT),
    # SqueezeBERT: the encoder calls `layer.forward(...)`, so fx traces its blocks into the encoder's
    # graph; the key multiplied as laid out, (B, H, D, S), no transpose; its GeLU after a grouped
    # convolution and the MLM head's GeLU after a Linear (the one bias_gelu)
    "squeezebert": (_family("squeezebert"), {"layer_norm": 2 * L + 2, "attention": L, "dropout_add": 2 * L,
                                             "bias_gelu": 1, **LOSS}),
    # DeepSeek-V3: q/k and v of different head dims; three norms a block (input, q LoRA, kv LoRA),
    # SwiGLU in the dense MLP, the routed experts and the shared expert; its rotary reads the pairs
    # interleaved and writes halves (halves_out)
    "deepseek_v3": (_family("deepseek_v3"), {"rms_norm": 3 * L + 1, "attention": L, "residual_stream": L,
                                             "gated_activation": 3, **ROTARY, **LOSS}),
    # DeepSeek-V2 and Llama 4: the rotary as a complex product (heads first in DeepSeek-V2, after
    # the positions in Llama 4); Llama 4's q and k L2 norms are RMSNorms without a weight
    "deepseek_v2": (_family("deepseek_v2"), {"rms_norm": 3 * L + 1, "attention": L, "residual_stream": L,
                                             "gated_activation": 3, **ROTARY, **LOSS}),
    "llama4_text": (_family("llama4_text"), {"rms_norm": 3 * L + 1, "attention": L, "residual_stream": L,
                                             "gated_activation": 2 * L, **ROTARY, **LOSS}),
    # Gemma 4 (see _FAMILIES): rotary on q and on k apart (k's norm between), GeGLU in the MLP and
    # the per-layer input gate
    "gemma4_text": (_family("gemma4_text"), {"rms_norm": 12, "attention": L, "residual_stream": 3 * L, "rotary": 2 * L,
                                             "gated_activation": 2 * L, **LOSS}),
    # Blocks that return their attention weights whatever output_attentions says (GPT-J, CodeGen,
    # GPT-Neo, BLOOM, MPT): called with output_attentions=False they return None in their place, and
    # the attention fuses: GPT-J's as GPT-2's eager chain, CodeGen's mask added before the scaling,
    # GPT-Neo's unscaled scores under a causal where() and an additive mask, BLOOM's ALiBi through
    # baddbmm, MPT's ALiBi added before a masked_fill. GPT-J and CodeGen's parallel block ends in
    # attention + MLP + residual, no norm after it: the MLP's dropout and add fuse; their interleaved
    # partial rotary (rotate_every_two on (B, S, H, D)) fuses. BLOOM's GeLU is an autograd.Function
    # in training (EVAL_ONLY); MPT's MLP has no bias.
    "gptj": (_family("gptj"), {"layer_norm": L + 1, "attention": L, "bias_gelu": L, "dropout_add": 2 * L, **ROTARY,
                               **LOSS}),
    "codegen": (_family("codegen"), {"layer_norm": L + 1, "attention": L, "bias_gelu": L, "dropout_add": 2 * L,
                                     **ROTARY, **LOSS}),
    "gpt_neo": (_family("gpt_neo"), {"layer_norm": L + 1, "attention": L, "bias_gelu": L, "residual_stream": L,
                                     "dropout_add": L, **LOSS}),
    # ImageGPT: RMSNorm written out with NumPy's keyword names, its weight folded in; the attention
    # chain's causal where fills with a 0-d tensor
    "imagegpt": (_family("imagegpt"), {"rms_norm": L + 1, "attention": L, "bias_gelu": L, "residual_stream": L,
                                       "dropout_add": L, **LOSS}),
    "bloom": (_family("bloom"), {"layer_norm": L + 2, "attention": L, "residual_stream": L, "dropout_add": L,
                                 **LOSS}),
    "mpt": (_family("mpt"), {"layer_norm": L + 1, "attention": L, "residual_stream": L, "dropout_add": L, **LOSS}),
    "biogpt": (_family("biogpt"), {**PRE_NORM, **LOSS}),
    # gpt-oss: attention sinks in every layer (a sliding-window one and a full one), the sinks'
    # gradient through the op's dsinks; the router and the clamps of the SwiGLU experts are left,
    # their `gate * sigmoid(gate * 1.702)` (swiglu_alpha: QuickGELU's function) is bias_gelu's
    # quick form, one call for all experts; its rotary (`second * cos + first * sin` on the halves, cat
    # back) is no spelling the rotary op takes, and q's and k's sum of products are gated adds (per
    # position) where the sin table has a unit last-dim stride (older transformers give a transposed view)
    "gpt_oss": (_family("gpt_oss"), {"rms_norm": L + 1, "attention": L, "bias_gelu": L, "residual_stream": L,
                                     **({"dropout_add": 2 * L} if _models.gpt_oss_rotary_tables_have_unit_stride()
                                        else {}), **LOSS}),
    # TrOCR: BART's older bmm attention on (B*H, S, D) tensors under the causal mask, a LayerNorm on
    # the embeddings; MiMo-V2-Flash: one layer without sinks (the max-subtracted chain), one with;
    # Granite's sinks as an output scale, the sinks' gradient through the op's dsinks
    "trocr": (_family("trocr"), {"layer_norm": 1, "attention": L, "bias_gelu": L, "residual_stream": 2 * L, **LOSS}),
    "xglm": (_family("xglm"), {**PRE_NORM, **LOSS}),
    # The squared ReLU: Nemotron's without a bias (relu_squared), Persimmon's with its linear's
    # (and q, k LayerNorms), BitNet's gated (bias_gelu_mul) before its sub-norm
    "nemotron": (_family("nemotron"), {"layer_norm": L + 1, "attention": L, "residual_stream": L, "bias_gelu": L,
                                       **ROTARY, **LOSS}),
    "persimmon": (_family("persimmon"), {"layer_norm": 3 * L + 1, "attention": L, "residual_stream": L,
                                         "dropout_add": L, "bias_gelu": L, **ROTARY, **LOSS}),
    "bitnet": (_family("bitnet"), {"rms_norm": 3 * L + 1, "attention": L, "residual_stream": L, **GATED, **ROTARY,
                                   **LOSS}),
    # Apertus's xIELU, its two trainable coefficients' gradients from the op
    "apertus": (_family("apertus"), {"rms_norm": 3 * L + 1, "attention": L, "residual_stream": L, "xielu": L,
                                     **ROTARY, **LOSS}),
    "mimo_v2_flash": (_family("mimo_v2_flash"), {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED,
                                                 **ROTARY, **LOSS}),
    "granite_swa": (_family("granite_swa"), {"rms_norm": L + 1, "attention": L, "residual_stream": L, **GATED,
                                             **ROTARY, **LOSS}),
    # Speech with a CTC loss (not a cross-entropy): wav2vec 2.0's post-norm blocks; WavLM's pre-norm
    # ones call F.multi_head_attention_forward themselves (separate q/k/v weights, the gated relative
    # position bias as a per-head float mask, a boolean key padding mask, need_weights with the
    # weights dropped), and its feature encoder's 7 convolutions each end in a LayerNorm
    # (wav2vec2's feature encoder: its first convolution's GroupNorm, one group per channel)
    "wav2vec2": (_family("wav2vec2"), {"layer_norm": 2, "attention": L, "bias_gelu": L,
                                       "residual_stream": 2 * L, "group_norm": 1}),
    "wavlm": (_family("wavlm"), {"layer_norm": 9 + L, "attention": L, "bias_gelu": L, "residual_stream": L,
                                 "dropout_add": L}),
    # Vision-language models: the vision tower's blocks and the LM's fuse alike. LLaVA: CLIP's
    # pre-norm tower (its embeddings' and its unused pooled output's LayerNorms; QuickGELU MLPs)
    # and the projector's GeLU, then a Llama; Qwen2-VL: its tower's attention one image at a time
    # (the loop over images in one capture) after its rotary on (patches, heads, head_dim) with no
    # batch, the patch merger's LayerNorm and GeLU, the LM's rotary on (time, height, width)
    # positions; Gemma 3: SigLIP's tower with its attention-pooling
    # head, then Gemma 3's four norms a block (q and k norms too) with the image tokens attending
    # to each other (a mask from token_type_ids)
    "llava": (functools.partial(_models.vision_language, "llava"),
              {"layer_norm": L + 2, "attention": 2 * L, "bias_gelu": L + 1, "residual_stream": 2 * L,
               "rms_norm": L + 1, **GATED, **ROTARY, **LOSS}),
    # (its vision blocks attend per image: a batch of two runs their attention twice a block)
    "qwen2_vl": (functools.partial(_models.vision_language, "qwen2_vl"),
                 {"layer_norm": L + 1, "attention": 3 * L, "bias_gelu": L + 1, "residual_stream": 2 * L,
                  "rms_norm": L + 1, "rotary": 2 * L, **GATED, **LOSS}),
    "gemma3": (functools.partial(_models.vision_language, "gemma3"),
               {"layer_norm": L + 2, "attention": 2 * L + 1, "bias_gelu": L + 1, "residual_stream": 3 * L,
                "rms_norm": 5 * L, **GATED, **ROTARY, **LOSS}),
}
OPS = {"layer_norm": ("trifuse::layer_norm",), "rms_norm": ("trifuse::rms_norm",),
       "attention": ("trifuse::attention",), "bias_gelu": ("trifuse::bias_gelu",),
       "gated_activation": ("trifuse::gated_activation",),
       "dropout_add": ("trifuse::dropout_add", "trifuse::gated_dropout_add", "trifuse::gated_dropout_add_rows"),
       "residual_stream": ("trifuse::dropout_add_layer_norm", "trifuse::dropout_add_rms_norm",
                           "trifuse::layer_norm_add", "trifuse::rms_norm_add"),
       "cross_entropy": ("trifuse::cross_entropy", "trifuse::linear_cross_entropy"),
       "rotary": ("trifuse::rotary_embedding",), "group_norm": ("trifuse::group_norm",),
       "xielu": ("trifuse::xielu",)}


def _double_inputs(kw):
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}


def _first_output(out):
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits_per_image", "logits", "image_embeds"):
        if name in out:
            return out[name]
    raise KeyError(f"no output to compare among {list(out)}")


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_model_matches_and_runs_trifuse_ops(name):
    build, counts = MODELS[name]
    counts = available_counts(counts)
    eval_counts = {} if name in EVAL_FAST_PATH else {k: v for k, v in counts.items() if k != "cross_entropy"}
    eval_counts = available_counts(EVAL_COUNTS.get(name, eval_counts))
    eval_counts.update(available_counts(EVAL_ONLY.get(name, {})))
    torch.manual_seed(0)
    model, inputs, loss_fn = build()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    params_before = [id(p) for p in model.parameters()]
    keys_before = list(model.state_dict())
    cls = type(model)
    assert trifuse.fuse(model) is model
    kw = inputs(2, 8)

    # a training step with dropout 0 (the first call: it captures, then runs the rewritten graphs):
    # the loss and every gradient by the oracle rule
    for m in (model, ref, ref64):
        m.train()
    fused = []

    def fused_step():
        fused.append(loss_fn(model, kw))
        fused[0].backward()

    names = trifuse_ops_run(fused_step)
    (fused_loss,), loss, loss64 = fused, loss_fn(ref, kw), loss_fn(ref64, _double_inputs(kw))
    for value in (loss, loss64):
        value.backward()
    assert_close("loss", fused_loss, loss64, loss)
    for (pname, p), p64, pr in zip(model.named_parameters(), ref64.parameters(), ref.parameters()):
        if p64.grad is not None:
            assert_close(f"grad {pname}", p.grad, p64.grad, pr.grad)
    assert trifuse.report(model).counts() == counts
    if name in EAGER_ATTENTION and has_op("attention"):
        expected = EAGER_ATTENTION[name]
        for pattern, count in (expected.items() if isinstance(expected, dict) else [(expected, L)]):
            assert trifuse.report(model).by_pattern()[pattern] == count
    for family in counts:
        assert set(OPS[family]) & names, f"{family}: trifuse ops that ran: {sorted(names)}"

    # eval outputs
    for m in (model, ref, ref64):
        m.eval()
    with torch.no_grad():
        kw_eval = {k: v for k, v in kw.items() if k not in ("labels", "targets")}
        out = _first_output(model(**kw_eval))
        assert_close("eval output", out, _first_output(ref64(**_double_inputs(kw_eval))),
                     _first_output(ref(**kw_eval)))
    assert trifuse.report(model).counts() == eval_counts

    # still the same model
    assert type(model) is cls
    assert [id(p) for p in model.parameters()] == params_before
    assert list(model.state_dict()) == keys_before
    fresh, *_ = build()
    fresh.load_state_dict(model.state_dict())
    assert not trifuse.report(model).unfused_calls()


@pytest.mark.skipif(not has_op("linear_cross_entropy"), reason="trifuse.ops.linear_cross_entropy not in this build")
@pytest.mark.parametrize("name, reason", [
    # BERT's head and loss are in one graph: the model returns the logits, so the head stays
    ("bert", "is also used by output, outside the pattern"),
    # GPT-2's loss_function logs a warning_once: a no-op inside the head capture, so head and
    # loss are one graph, and the logits are returned as with BERT
    ("gpt2", "is also used by output, outside the pattern"),
])
def test_report_says_why_the_head_is_not_fused(name, reason):
    torch.manual_seed(0)
    model, inputs, loss_fn = getattr(_models, name)()
    trifuse.fuse(model)
    loss_fn(model, inputs(2, 8))
    report = trifuse.report(model)
    assert report.by_pattern()["cross_entropy" if name == "bert" else "cross_entropy_upcast"] == 1
    line = next(row for row in report.table().splitlines() if "replaced  cross_entropy" in row)
    assert "(not linear_cross_entropy" in line and reason in line, line


class CallsTheLM(torch.nn.Module):
    """A user's module around a Hugging Face LM that computes nothing itself: the loss is the LM's."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, **kw):
        return self.lm(**kw)


def _wrapped_in_peft_lora(model, targets):
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    for name, p in lora.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: adapters that change nothing would test nothing
            torch.nn.init.normal_(p, std=0.02)
    return lora


@pytest.mark.parametrize("name, wrap, head_path", [
    ("gpt2", lambda m: _wrapped_in_peft_lora(m, ["c_attn", "c_fc"]), "base_model.model"),
    ("llama", lambda m: _wrapped_in_peft_lora(m, ["q_proj", "v_proj", "up_proj"]), "base_model.model"),
    ("gpt2", CallsTheLM, "lm"),
], ids=["gpt2-peft-lora", "llama-peft-lora", "gpt2-user-wrapper"])
def test_a_wrapped_model_fuses_its_blocks_and_its_loss(name, wrap, head_path):
    """PEFT's LoRA (PeftModel -> LoraModel -> the transformers model) and a user's module around
    the LM: the blocks fuse as unwrapped (the LoRA linears' sums feed GPT-2's GeLU, fused without a
    bias to fold), and the loss, computed by the model inside, is captured there; the trainable
    parameters' gradients by the oracle rule."""
    torch.manual_seed(0)
    model, inputs, loss_fn = getattr(_models, name)()
    model = wrap(model)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    trifuse.fuse(model)
    kw = inputs(2, 8)
    fused_loss, loss, loss64 = loss_fn(model, kw), loss_fn(ref, kw), loss_fn(ref64, _double_inputs(kw))
    for value in (fused_loss, loss, loss64):
        value.backward()
    assert_close("loss", fused_loss, loss64, loss)
    trained = 0
    for (pname, p), p64, pr in zip(model.named_parameters(), ref64.parameters(), ref.parameters()):
        if p64.grad is not None:
            trained += 1
            assert_close(f"grad {pname}", p.grad, p64.grad, pr.grad)
    assert trained > 0
    report = trifuse.report(model)
    assert report.counts() == available_counts(MODELS[name][1])
    if has_op("cross_entropy"):
        assert any(head_path in row and "head and loss captured" in row for row in report.table().splitlines())


def test_t5_self_attention_with_its_position_bias_is_fused():
    """T5's relative position bias requires grad: every attention is replaced, none rejected, and
    the bias embedding gets its gradient through the fused op's dMask."""
    if not has_op("attention"):
        pytest.skip("trifuse.ops.attention not in this build")
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.hf_family("t5")
    ref64 = copy.deepcopy(model).double()
    trifuse.fuse(model)
    kw = inputs(3, 9)
    loss_fn(model, kw).backward()
    loss_fn(ref64, _double_inputs(kw)).backward()
    report = trifuse.report(model)
    assert report.counts()["attention"] == 3 * L
    assert not [r for r in report.rejected() if r[2].startswith("sdpa")], report.table()
    for stack in ("encoder", "decoder"):
        bias = getattr(model, stack).block[0].layer[0].SelfAttention.relative_attention_bias.weight
        bias64 = getattr(ref64, stack).block[0].layer[0].SelfAttention.relative_attention_bias.weight
        assert bias.grad is not None and bias.grad.abs().max() > 0
        assert_close(f"{stack} position bias grad", bias.grad, bias64.grad, None)


@pytest.mark.parametrize("name", ["gptj", "trocr"])
def test_attention_weights_still_returned_when_asked_for(name):
    """GPT-J's blocks return their attention probabilities whatever output_attentions says, TrOCR's
    (BART's older attention) only when asked: fused with output_attentions=False (None in their
    place), as written with True (the weights equal the unfused model's, the attention left)."""
    torch.manual_seed(0)
    model, inputs, _ = _models.hf_family(name)
    ref64 = copy.deepcopy(model).double()
    trifuse.fuse(model)
    kw = {k: v for k, v in inputs(2, 8).items() if k != "labels"}
    assert model(**kw).attentions is None
    assert trifuse.report(model).counts().get("attention", 0) == available_counts({"attention": L}).get("attention", 0)
    out, out64 = model(**kw, output_attentions=True), ref64(**kw, output_attentions=True)
    assert len(out.attentions) == L
    for i, (a, a64) in enumerate(zip(out.attentions, out64.attentions)):
        assert_close(f"attentions[{i}]", a, a64, None)
    assert "attention" not in trifuse.report(model).counts()
    assert_close("logits", out.logits, out64.logits, None)


@pytest.mark.parametrize("hooks_first", [True, False], ids=["hooks-before-fuse", "hooks-after-capture"])
def test_transformers_output_capture_hooks_keep_blocks_whole_and_collect(hooks_first):
    """transformers records hidden states and attention probabilities through forward hooks it
    installs, for good, on the first call that asks for them; each hook reads a ContextVar, which
    Dynamo cannot trace. Hooks there before fuse (an evaluation first): each GPT-2 block is still
    one graph with its eager attention fused (it was three graphs, the attention left). Hooks
    installed after the blocks were captured: a call asking for outputs gets all of them (a capture
    made without the hooks returned no attentions), equal to the unfused model's."""
    torch.manual_seed(0)
    model, inputs, _ = _models.gpt2(attn_implementation="eager")
    kw = inputs(2, 8)
    if hooks_first:
        with torch.no_grad():
            model(**kw, output_hidden_states=True, output_attentions=True)
    ref64 = copy.deepcopy(model).double()
    trifuse.fuse(model)
    model(**kw).loss.backward()
    report = trifuse.report(model)
    assert report.counts().get("attention", 0) == available_counts({"attention": L}).get("attention", 0)
    block = next(u for u in report.units if u.unit.cls.__name__ == "GPT2Block")
    assert block.unit.last[block.modules[0]].graphs == 1
    for asks in ({"output_hidden_states": True}, {"output_hidden_states": True, "output_attentions": True}):
        out, out64 = model(**kw, **asks), ref64(**kw, **asks)
        assert_close("loss", out.loss, out64.loss, None)
        assert len(out.hidden_states) == L + 1
        for i, (h, h64) in enumerate(zip(out.hidden_states, out64.hidden_states)):
            assert_close(f"hidden_states[{i}]", h, h64, None)
        assert len(out.attentions or ()) == (L if asks.get("output_attentions") else 0)
        for i, (a, a64) in enumerate(zip(out.attentions or (), out64.attentions or ())):
            assert_close(f"attentions[{i}]", a, a64, None)


def test_optimizer_made_before_fuse_trains_the_fused_model():
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trifuse.fuse(model)
    kw = inputs(2, 8)
    before = loss_fn(model, kw).item()
    for _ in range(3):
        loss_fn(model, kw).backward()
        opt.step()
        opt.zero_grad()
    assert loss_fn(model, kw).item() < before


def test_training_with_dropout_tracks_the_unfused_model():
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2(dropout=0.1)
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    batches = [inputs(4, 16)] * 6  # one batch: the loss must fall, not just differ between batches
    losses = {}
    for name, m in (("fused", model), ("unfused", ref)):
        torch.manual_seed(1)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        losses[name] = []
        for kw in batches:
            loss = loss_fn(m, kw)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    fused, unfused = torch.tensor(losses["fused"]), torch.tensor(losses["unfused"])
    assert fused[-1] < fused[0] and unfused[-1] < unfused[0]
    # different dropout masks from the same distribution: the curves agree within dropout's noise
    assert (fused - unfused).abs().max() < 0.05 * unfused.mean(), losses
    assert trifuse.report(model).counts() == available_counts({**PRE_NORM, **LOSS})


def test_t5s_relu_and_its_dropout_are_one_op_in_training_and_the_relu_alone_in_eval():
    """The original T5's MLP, `wo(dropout(relu(wi(x))))` with dropout 0.1: in training the ReLU and
    the dropout become one bias_gelu (relu_dropout; its mask a seed) in every block, and it runs;
    in eval, where the dropout drops nothing, the ReLU stays as written and the outputs are the
    unfused model's. (That the dropout keeps its distribution in training: the op's tests; the
    model's loss varies by ~20% from mask to mask at this size, too much to compare two runs.)"""
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.hf_family("t5", dropout_rate=0.1)
    ref64 = copy.deepcopy(model).double()
    trifuse.fuse(model)
    kw = inputs(2, 8)
    ran = trifuse_ops_run(lambda: loss_fn(model, kw).backward())
    assert "trifuse::bias_gelu_dropout" in ran and "trifuse::bias_gelu_dropout_backward" in ran, sorted(ran)
    assert trifuse.report(model).counts() == available_counts({**MODELS["t5"][1], "bias_gelu": 2 * L})
    assert trifuse.report(model).by_pattern()["relu_dropout"] == 2 * L
    model.eval()
    ref64.eval()
    with torch.no_grad():
        kw_eval = {k: v for k, v in kw.items() if k != "labels"}
        assert_close("eval logits", model(**kw_eval).logits, ref64(**kw_eval).logits, None)
    assert "bias_gelu" not in trifuse.report(model).counts()


class LogitsAndLoss(torch.nn.Module):
    """nanoGPT's real return, `(logits, loss)`: the head's output is both returned and the loss's input.
    `soft_targets`: class probabilities as the target, which linear_cross_entropy does not take."""

    def __init__(self, soft_targets: bool = False):
        super().__init__()
        self.soft_targets = soft_targets
        self.embed = torch.nn.Embedding(_models.VOCAB, _models.HIDDEN)
        self.h = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(_models.HIDDEN),
                                                         torch.nn.Linear(_models.HIDDEN, _models.HIDDEN))
                                     for _ in range(2))
        self.lm_head = torch.nn.Linear(_models.HIDDEN, _models.VOCAB, bias=False)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for block in self.h:
            x = x + block(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        if self.soft_targets:
            targets = torch.nn.functional.one_hot(targets, logits.size(-1)).to(logits.dtype)
            return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1, logits.size(-1)))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _logits_and_loss(soft_targets=False):
    model = LogitsAndLoss(soft_targets)

    def inputs(batch, seq):
        ids = torch.randint(0, _models.VOCAB, (batch, seq))
        return {"idx": ids, "targets": ids}

    return model, inputs


def _hf(name):
    def build():
        model, inputs, _ = getattr(_models, name)()
        return model, inputs
    return build


def _vision_language(name):  # a vision-language model's LM head and loss, its labels -100 at the image
    def build():
        model, inputs, _ = _models.vision_language(name)
        return model, inputs
    return build


def _loss_and_logits(out):
    return (out[1], out[0]) if isinstance(out, tuple) else (out.loss, out.logits)


@pytest.mark.skipif(not has_op("linear_cross_entropy"), reason="trifuse.ops.linear_cross_entropy not in this build")
@pytest.mark.parametrize("name, build", [("gpt2", _hf("gpt2")), ("llama", _hf("llama")), ("bert", _hf("bert")),
                                         ("logits-and-loss", _logits_and_loss),
                                         ("qwen2_vl", _vision_language("qwen2_vl"))])
def test_skip_logits_fuses_the_head_into_linear_cross_entropy(name, build):
    torch.manual_seed(0)
    model, inputs = build()
    ref64 = copy.deepcopy(model).double()
    trifuse.fuse(model, skip_logits=True)
    kw = inputs(2, 8)
    model.train()
    ref64.train()
    loss, logits = _loss_and_logits(model(**kw))
    assert logits is None  # training with a loss: not materialized, returned as None
    loss64, logits64 = _loss_and_logits(ref64(**_double_inputs(kw)))
    loss.backward()
    loss64.backward()
    assert_close("loss", loss, loss64, None)
    for (pname, p), p64 in zip(model.named_parameters(), ref64.parameters()):
        if p64.grad is not None:
            assert_close(f"grad {pname}", p.grad, p64.grad, None)
    report = trifuse.report(model)
    assert sum(n for pattern, n in report.by_pattern().items() if pattern.startswith("linear_cross_entropy")) == 1
    assert "the logits are not returned (fuse(..., skip_logits=True))" in report.table()

    # eval, and training without grad: the logits as always
    model.eval()
    ref64.eval()
    with torch.no_grad():
        _, logits = _loss_and_logits(model(**kw))
        _, logits64 = _loss_and_logits(ref64(**_double_inputs(kw)))
        assert_close("eval logits", logits, logits64, None)
        model.train()
        assert _loss_and_logits(model(**kw))[1] is not None


def test_skip_logits_returns_the_logits_when_the_head_cannot_fuse():
    # soft targets: linear_cross_entropy's filter rejects the match, so the logits stay an output
    torch.manual_seed(0)
    model, inputs = _logits_and_loss(soft_targets=True)
    ref = copy.deepcopy(model)
    trifuse.fuse(model, skip_logits=True)
    kw = inputs(2, 8)
    logits, loss = model(**kw)
    ref_logits, ref_loss = ref(**kw)
    assert logits is not None and logits.shape == ref_logits.shape
    torch.testing.assert_close(loss, ref_loss)
    assert "no LM head fused into linear_cross_entropy: the logits are returned" in trifuse.report(model).table()


def test_skip_logits_off_by_default_returns_the_logits():
    torch.manual_seed(0)
    model, inputs = _logits_and_loss()
    trifuse.fuse(model)
    logits, _ = model(**inputs(2, 8))
    assert logits is not None and logits.shape == (2, 8, _models.VOCAB)


def test_head_capture_leaves_dynamos_logging_config_as_it_was():
    # the once-only transformers loggers are ignored only while the head unit runs
    ignored = getattr(torch._dynamo.config, "ignore_logging_functions", None)
    if ignored is None:
        pytest.skip("this torch has no ignore_logging_functions")
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    trifuse.fuse(model)
    before = set(ignored)
    loss_fn(model, inputs(2, 8)).backward()
    assert set(torch._dynamo.config.ignore_logging_functions) == before
    assert trifuse.report(model).by_pattern().get("cross_entropy_upcast") == 1



@pytest.mark.skipif(not has_op("cross_entropy"), reason="trifuse.ops.cross_entropy not in this build")
def test_each_head_capture_fences_with_its_own_code_object():
    # Dynamo compiles a fence as a frame of its own (its graph breaks at the fenced call), with
    # guards on the fenced module's class and the grad mode; were the fence's code object shared
    # by every fused model, a process fusing a few model families (tests, benchmarks) would hit
    # Dynamo's recompile limit on it (a warning, then that frame eager).
    fences = []
    for _ in range(2):
        model, inputs, loss_fn = _models.llama(layers=1)
        trifuse.fuse(model)
        loss_fn(model, inputs(2, 5)).backward()
        assert "fenced off: model" in trifuse.report(model).table()
        fences.append(model.model.forward.__func__)
    assert fences[0].__code__ is not fences[1].__code__


@pytest.mark.parametrize("name", ["opt", "deberta-v2", "deberta"])
def test_a_second_sequence_length_keeps_every_fusion(name):
    # The second length makes Dynamo recapture each block with the sequence length symbolic.
    # There OPT's `hidden_states.shape` (taken before its flatten) is a size() of the residual
    # sum, which kept the sum from fusing with the norm; DeBERTa-v2's per-head view of the
    # relative-position bias holds symbolic dims the attention's replacement could not take; and
    # DeBERTa's attention span (an `.item()` kept in the graph) next to a symbolic length fails
    # Dynamo itself, which dropped the scalar and broke the graph inside the attention. Counts
    # as after the first length, and the outputs are still the unfused model's.
    build, counts = MODELS[name]
    torch.manual_seed(0)
    model, inputs, loss_fn = build()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    trifuse.fuse(model)
    first = None
    for s in (8, 11):
        kw = inputs(2, s)
        loss_fn(model, kw).backward()
        first = first or trifuse.report(model).counts()
        assert trifuse.report(model).counts() == first == available_counts(counts), (s, trifuse.report(model).counts())
        with torch.no_grad():
            for m in (model, ref, ref64):
                m.eval()
            kw_eval = {k: v for k, v in kw.items() if k not in ("labels", "targets")}
            assert_close(f"eval output, {s} positions", _first_output(model(**kw_eval)),
                         _first_output(ref64(**_double_inputs(kw_eval))), _first_output(ref(**kw_eval)))
            model.train()


@pytest.mark.skipif(not has_op("cross_entropy"), reason="trifuse.ops.cross_entropy not in this build")
@torch._dynamo.config.patch(recompile_limit=2)  # not monkeypatch: its undo deletes the entry
def test_many_model_families_in_one_process_keep_their_head_captures():
    # Hugging Face's decorators share one code object between model classes, and a head
    # capture's fence makes Dynamo compile the wrapper as a frame of its own: one entry per model
    # class and shape. Past the recompile limit (8, here 2 to show it with three models) that
    # code ran uncompiled from then on, and every later model's head and loss went unfused. Each
    # unit now compiles its own copy of the decorator chain.
    for name in ("qwen2", "helium", "glm"):
        model, inputs, loss_fn = _models.hf_family(name)
        trifuse.fuse(model)
        for s in (5, 7):  # the second length recompiles with the sequence dim dynamic
            loss_fn(model, inputs(2, s)).backward()
            assert trifuse.report(model).counts().get("cross_entropy") == 1, (name, s)


@torch._dynamo.config.patch(recompile_limit=2)  # not monkeypatch: its undo deletes the entry
def test_torch_nn_blocks_of_several_models_keep_their_captures():
    # torch.compile wraps a forward from torch's own files (nn.TransformerEncoderLayer's) in
    # wrap_inline, whose code object is shared by every such function: every unit of a torch.nn
    # block class shared one cache, and past the recompile limit (8, here 2) later models' blocks
    # ran unfused. Each unit now enters through a frame of its own.
    for layers in (1, 2, 3):
        model, inputs, loss_fn = _models.transformer_encoder(True, layers=layers)
        trifuse.fuse(model)
        loss_fn(model, inputs(2, 5)).backward()
        assert trifuse.report(model).counts().get("attention", 0) == (layers if has_op("attention") else 0)
        assert not trifuse.report(model).unfused_calls(), layers


def test_unit_entry_frames_differ_in_what_every_torch_keys_dynamic_state_by():
    """Dynamo's automatic-dynamic state is keyed by a code's file, first line and name (torch
    2.11), plus its closure's code hash (2.13): two units of one class must differ in the first
    three, or on torch 2.11 they share the state (the test below then fails there, not here)."""
    from trifuse.fusion.capture import _entry

    def forward(x):
        return x

    first, second = (_entry(forward, "Block").__code__ for _ in range(2))
    keys = {(c.co_filename, c.co_firstlineno, c.co_name) for c in (first, second)}
    assert len(keys) == 2 and all("Block" in c.co_name for c in (first, second)), keys
    assert _entry(forward, "Block")(3) == 3


@pytest.mark.skipif(not has_op("rotary_embedding"), reason="trifuse.ops.rotary_embedding not in this build")
def test_block_classes_keep_their_dynamic_shape_state_apart():
    # Hugging Face wraps every layer class's forward in one `forward_with_checkpointing`, and
    # Dynamo keeps its automatic-dynamic state (what went symbolic after two values) per file,
    # line and name of a frame's code (torch 2.13 adds the hash of the code in its closure; torch
    # 2.11 does not). Were the units' entry frames keyed alike, a model's
    # first capture would see what the models before it had as already varying, and a partial
    # rotary whose width changed would go unfused (rotate_half's split no longer a known int):
    # GPT-NeoX's after other models, and a second GPT-NeoX of another rotary width after the first
    # (one class; so too GLM-4-MoE's after Llama's, whose decoder-layer forwards are the same code
    # in two files and hash alike). Each unit keeps its own.
    models = [("phi3", {}), ("opt", {}), ("bart", {}), ("gpt_neox", {}), ("gpt_neox", {"rotary_pct": 0.5})]
    for name, overrides in models:
        model, inputs, loss_fn = _models.hf_family(name, **overrides)
        trifuse.fuse(model)
        loss_fn(model, inputs(2, 8)).backward()
        if name not in ("opt", "bart"):
            assert trifuse.report(model).counts().get("rotary") == L, (name, overrides)


def _train_step(model, loss_fn, kw, seed):
    torch.manual_seed(seed)
    loss = loss_fn(model, kw)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _assert_steps_equal(plain, checkpointed, loss_fn, kw, attention_runs: int | None = None):
    """From the same seeds (1, 2), `checkpointed`'s losses and gradients equal `plain`'s; with
    `attention_runs`, trifuse's attention runs that many times in each checkpointed step."""
    for seed in (1, 2):
        for m in (plain, checkpointed):
            m.zero_grad()
        loss, grads = _train_step(plain, loss_fn, kw, seed)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss_ck, grads_ck = _train_step(checkpointed, loss_fn, kw, seed)
        torch.testing.assert_close(loss_ck, loss)
        for (name, _), g, g_ck in zip(plain.named_parameters(), grads, grads_ck):
            torch.testing.assert_close(g_ck, g, msg=name)
        if attention_runs is not None:
            assert op_names(prof).count("trifuse::attention") == attention_runs


def test_gradient_checkpointing_fuses_and_matches_the_unfused_model():
    # transformers' gradient checkpointing: Dynamo captures each block inside a
    # tag_activation_checkpoint op whose body holds the block's graph; fuse rewrites the body.
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    ref64 = copy.deepcopy(model).double()
    model.gradient_checkpointing_enable()
    trifuse.fuse(model)
    model.train()
    ref64.train()
    kw = inputs(2, 8)
    loss, grads = _train_step(model, loss_fn, kw, 1)
    loss64, grads64 = _train_step(ref64, loss_fn, _double_inputs(kw), 1)
    assert_close("loss", loss, loss64, None)
    for (name, _), g, g64 in zip(model.named_parameters(), grads, grads64):
        assert_close(f"grad {name}", g, g64, None)
    assert trifuse.report(model).counts() == available_counts({**PRE_NORM, **LOSS})


def test_gradient_checkpointing_of_blocks_with_a_graph_break_fuses_them():
    # Qwen2-VL's vision blocks split their attention per image by `lengths.tolist()`: a graph break
    # inside the checkpointed body, so Dynamo cannot make it one checkpoint op and runs
    # torch.utils.checkpoint as written, Dynamo off inside (the first call, unfused: the report
    # says so). From the next call on fuse checkpoints the block's own forward compiled apart: the
    # vision blocks fuse, the recompute in the backward saves what the forward saved (no
    # CheckpointError: the capture's checks on fake tensors record no autograd graph), and the
    # gradients are the float64 model's.
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.vision_language("qwen2_vl")
    ref64 = copy.deepcopy(model).double().train()
    model.gradient_checkpointing_enable()
    trifuse.fuse(model).train()
    kw = inputs(2, 8)
    loss64, grads64 = _train_step(ref64, loss_fn, _double_inputs(kw), 1)
    for step in range(2):
        model.zero_grad()
        loss, grads = _train_step(model, loss_fn, kw, 1)
        assert_close("loss", loss, loss64, None)
        for (name, _), g, g64 in zip(model.named_parameters(), grads, grads64):
            assert_close(f"grad {name}", g, g64, None)
    assert trifuse.report(model).counts() == available_counts(MODELS["qwen2_vl"][1])


def test_every_other_layer_checkpointed_with_offload_fuses_and_keeps_both(monkeypatch):
    # transformers 5.24's activation_checkpointing_enable(every_n_layers=2, offload=True): every
    # other block checkpointed, what its checkpoint saves (the block's inputs) held on the host
    # through `save_on_cpu`. Every block fuses; the checkpointed ones still recompute their
    # forward in the backward (attention runs L + L/2 times a step), and their saved inputs still
    # go through the offload's pack hook as the unfused model's do; gradients are float64's.
    tf = _models._quiet_transformers()
    enable = getattr(tf.PreTrainedModel, "activation_checkpointing_enable", None)
    if enable is None or not {"every_n_layers", "offload"} <= set(inspect.signature(enable).parameters):
        pytest.skip("this transformers has no every_n_layers / offload checkpointing (5.24 added them)")
    import transformers.modeling_utils as modeling_utils

    packed = []

    class CountingSaveOnCpu(modeling_utils.save_on_cpu):
        def __init__(self, pin_memory: bool = True, device_type: str = "cuda"):
            # Pinned memory needs an accelerator: a CPU run holds the offloaded tensors unpinned.
            super().__init__(pin_memory=pin_memory and torch.cuda.is_available(), device_type=device_type)
            pack = self.pack_hook
            self.pack_hook = lambda t: packed.append(tuple(t.shape)) or pack(t)

    monkeypatch.setattr(modeling_utils, "save_on_cpu", CountingSaveOnCpu)
    torch.manual_seed(0)
    layers = 4
    model, inputs, loss_fn = _models.gpt2(layers=layers)
    ref64 = copy.deepcopy(model).double().train()
    unfused = copy.deepcopy(model).train()
    for m in (model, unfused):
        m.activation_checkpointing_enable(every_n_layers=2, offload=True)
    assert [block.gradient_checkpointing for block in model.transformer.h] == [True, False] * (layers // 2)
    trifuse.fuse(model).train()
    kw = inputs(2, 8)
    loss64, grads64 = _train_step(ref64, loss_fn, _double_inputs(kw), 1)
    _train_step(model, loss_fn, kw, 1)  # captures

    def profiled_step(m):
        """(loss, gradients, trifuse attention forwards run, shapes the offload packed)."""
        m.zero_grad()
        packed.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss, grads = _train_step(m, loss_fn, kw, 1)
        return loss, grads, op_names(prof).count("trifuse::attention"), list(packed)

    *_, saved_unfused = profiled_step(unfused)
    loss, grads, attention_runs, saved = profiled_step(model)
    assert_close("loss", loss, loss64, None)
    for (name, _), g, g64 in zip(model.named_parameters(), grads, grads64):
        assert_close(f"grad {name}", g, g64, None)
    assert attention_runs == layers + layers // 2
    assert saved == saved_unfused and len(saved) >= layers // 2, (saved, saved_unfused)
    per_block = {"attention": layers, "bias_gelu": layers, "residual_stream": layers, "dropout_add": layers}
    assert trifuse.report(model).counts() == available_counts({**LOSS, **per_block, "layer_norm": layers + 1})


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_recomputes_the_forwards_dropout_masks(reentrant):
    # The recompute in the backward must draw the forward's dropout seeds: the same fused model
    # with and without checkpointing, from the same seed, gives the same gradients. (The
    # checkpoint op's own eager path turns RNG preservation off: new masks, wrong gradients.)
    # transformers' default is the non-reentrant checkpoint; older recipes ask for the reentrant
    # one, which runs the forward under no_grad and the whole block again in the backward.
    torch.manual_seed(0)
    plain, inputs, loss_fn = _models.gpt2(dropout=0.2)
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for m in (plain, checkpointed):
        trifuse.fuse(m).train()
    kw = inputs(2, 8)
    loss, grads = _train_step(plain, loss_fn, kw, 3)
    loss_ck, grads_ck = _train_step(checkpointed, loss_fn, kw, 3)
    torch.testing.assert_close(loss_ck, loss)
    for (name, _), g, g_ck in zip(plain.named_parameters(), grads, grads_ck):
        torch.testing.assert_close(g_ck, g, msg=name)
    assert trifuse.report(checkpointed).counts() == trifuse.report(plain).counts()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_block_checkpointed_as_compiled_apart_recomputes_fused_with_the_forwards_masks(reentrant):
    # A block whose checkpointed body Dynamo cannot make one checkpoint op (Llama's attention sets
    # the Hub `kernels` package's context variable inside it where that is installed, as
    # transformers 5.25 requires; Qwen2-VL's vision blocks break the graph) runs as written on its
    # first call (the report says why); fuse then checkpoints the block's own compiled forward.
    # The backward's recompute runs that forward again after the block's call returned, for a
    # reentrant checkpoint in grad mode (its forward ran under no_grad), which Dynamo compiles anew:
    # it must be rewritten as the forward was, or the recompute runs unfused, with PyTorch's dropout
    # masks instead of the forward's (gradients off by 0.1 here). Against the same fused model
    # without checkpointing, from the same seeds: equal losses and gradients, and trifuse's
    # attention runs in the forward and in the recompute.
    torch.manual_seed(0)
    layers = 2
    plain, inputs, loss_fn = _models.llama(layers=layers)
    for layer in plain.model.layers:
        layer.self_attn.attention_dropout = 0.2
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for m in (plain, checkpointed):
        trifuse.fuse(m).train()
    kw = inputs(2, 8)
    _train_step(checkpointed, loss_fn, kw, 0)
    units = trifuse.report(checkpointed).units
    unit = next(u.unit for u in units if u.unit.cls.__name__ == "LlamaDecoderLayer")
    if not unit.checkpoint_outside:
        pytest.skip("no Hub `kernels` here: Dynamo took Llama's checkpointed body as one checkpoint op")
    assert any("under gradient checkpointing" in r for r in unit.eager_calls), unit.eager_calls
    _assert_steps_equal(plain, checkpointed, loss_fn, kw, attention_runs=2 * layers)


@contextlib.contextmanager
def _checkpoint_backwards_not_nested_in_themselves():
    """Fails, rather than recursing without end, when a reentrant checkpoint's backward runs
    inside its own backward (its recompute returned a tensor carrying the checkpoint's grad_fn)."""
    from torch.utils.checkpoint import CheckpointFunction

    backward, active = CheckpointFunction.backward, set()

    def guarded(ctx, *grads):
        assert id(ctx) not in active, "a reentrant checkpoint's backward ran inside its own backward"
        active.add(id(ctx))
        try:
            return backward(ctx, *grads)
        finally:
            active.discard(id(ctx))

    CheckpointFunction.backward = staticmethod(guarded)
    try:
        yield
    finally:
        CheckpointFunction.backward = staticmethod(backward)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("model_type, attention", [
    ("longt5", 2 * _models.LAYERS),  # the decoder's self- and cross-attention (the encoder's is local: left)
    ("switch_transformers", 3 * _models.LAYERS),
])
def test_a_block_checkpointed_as_compiled_apart_that_returns_its_probabilities_trains(model_type, attention,
                                                                                     reentrant):
    # T5's first decoder block sets `requires_grad` on a fresh position bias under checkpointing,
    # which breaks Dynamo's graph inside the cross-attention: the blocks run as written on their
    # first checkpointed call, then checkpoint their own compiled forward, whose graph after the
    # break returns the attention's probabilities. fuse drops them (a module-wide placeholder in
    # their place, None once returned) where nobody reads them:
    # - LongT5's blocks are called with output_attentions=False. A reentrant checkpoint set its
    #   grad_fn on the placeholder it returned, the next recompute returned it again, and the
    #   backward ran inside itself without end.
    # - SwitchTransformers' blocks take the flag in `**kwargs: TransformersKwargs` and get none
    #   (transformers records asked-for probabilities by hooks): the attention stayed unfused.
    # Against the same fused model without checkpointing, from the same seeds (dropout on): equal
    # losses and gradients, attention fused in both and run again in the recompute. Then, dropout
    # off, against the unfused model under the same checkpointing: hidden states asked for come
    # from the fused blocks, attention probabilities asked for from the blocks run as written.
    torch.manual_seed(0)
    plain, inputs, loss_fn = _models.hf_family(model_type, dropout_rate=0.1)
    checkpointed, unfused = copy.deepcopy(plain), copy.deepcopy(plain)
    for m in (checkpointed, unfused):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for m in (plain, checkpointed):
        trifuse.fuse(m).train()
    kw = inputs(2, 8)
    with _checkpoint_backwards_not_nested_in_themselves():
        # the captures: the blocks' first checkpointed call runs as written, the second compiles
        for m in (plain, checkpointed, checkpointed):
            _train_step(m, loss_fn, kw, 0)
        units = trifuse.report(checkpointed).units
        unit = next(u.unit for u in units if u.unit.cls.__name__.endswith("Block"))
        if not unit.checkpoint_outside:
            pytest.skip("Dynamo took the checkpointed body as one checkpoint op here")
        assert unit.drops_weights
        _assert_steps_equal(plain, checkpointed, loss_fn, kw, attention_runs=2 * attention)
    assert trifuse.fusion.capture._DROPPED_WEIGHTS.grad_fn is None
    counts = trifuse.report(checkpointed).counts()
    assert counts.get("attention") == attention == trifuse.report(plain).counts().get("attention"), counts
    for m in (checkpointed, unfused):
        for sub in m.modules():
            if isinstance(sub, torch.nn.Dropout):
                sub.p = 0.0
            elif isinstance(getattr(sub, "dropout", None), float):  # T5's attention: a float
                sub.dropout = 0.0
    for asked, kind in (("output_hidden_states", "hidden_states"), ("output_attentions", "attentions")):
        eager = sum(unit.eager_calls.values())
        out, ref = (m(**kw, **{asked: True}) for m in (checkpointed, unfused))
        names = [k for k in ref if k.endswith(kind)]
        assert names, list(ref.keys())
        for name in names:
            assert len(out[name]) == len(ref[name]), name
            for i, (a, r) in enumerate(zip(out[name], ref[name])):
                torch.testing.assert_close(a, r, msg=f"{name}[{i}]")
        ran_as_written = sum(unit.eager_calls.values()) - eager
        assert ran_as_written == (2 * _models.LAYERS if kind == "attentions" else 0), (kind, unit.eager_calls)


def _call_form_layer() -> type:
    """transformers' GradientCheckpointingLayer as releases before 5.2x wrote it (5.17, the lent
    GPU's): its own `__call__` checkpoints, where later ones wrap `forward`. Named as there."""

    class GradientCheckpointingLayer(torch.nn.Module):
        gradient_checkpointing = False

        def __call__(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training:
                return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
            return super().__call__(*args, **kwargs)

    return GradientCheckpointingLayer


CallFormLayer = _call_form_layer()


def _nested_checkpointed_layers(width: int = 32, layers: int = 2, graph_break: bool = True,
                                call_form: bool = False):
    """Blocks holding a checkpointed layer of their own, as Zamba's hybrid layer holds a Mamba
    layer, both transformers GradientCheckpointingLayers whose forwards fx can trace; the inner
    layer breaks Dynamo's graph (as the Hub `kernels` context variable or Qwen2-VL's `tolist()`
    do), so no checkpoint of either can be one checkpoint op, unless `graph_break` is False.
    `call_form`: the layers of the earlier transformers form (`_call_form_layer`)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    _Layer = CallFormLayer if call_form else GradientCheckpointingLayer

    class Inner(_Layer):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)

        def forward(self, x):
            h = self.norm(x)
            if graph_break:
                torch._dynamo.graph_break()
            return x + F.dropout(self.fc(h), 0.2, self.training)

    class Block(_Layer):
        def __init__(self):
            super().__init__()
            self.inner, self.fc, self.norm = Inner(), torch.nn.Linear(width, width), torch.nn.LayerNorm(width)

        def forward(self, x):
            x = self.inner(x)
            return self.norm(x + F.dropout(self.fc(x), 0.2, self.training))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Model()


def _checkpointing(model, reentrant: bool) -> list:
    """transformers' gradient checkpointing on a model's GradientCheckpointingLayers, as
    `gradient_checkpointing_enable` sets it on a PreTrainedModel's; returns the layers."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, (GradientCheckpointingLayer, CallFormLayer))]
    for m in layers:
        m.gradient_checkpointing = True
        m._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=reentrant)
    return layers


@pytest.mark.parametrize("call_form", [False, True], ids=["forward-wrapped", "call-form"])
@pytest.mark.parametrize("enabled", ["before fuse", "after fuse"])
def test_a_checkpointing_layer_that_fx_traces_keeps_its_checkpoint(enabled, call_form):
    # A GradientCheckpointingLayer decides on each call whether to checkpoint. fx traced such a
    # block (a user's layer with a plain signature): the trace kept the choice of the trace's
    # call and inlined the checkpoint's body, so checkpointing was gone either way (the activations
    # kept, nothing recomputed). Dynamo captures it instead: the backward recomputes the fused ops.
    # The call form (transformers before 5.2x) was traced until 2026-12-06: its backward raised
    # CheckpointError (64 tensors saved in the forward, 19 in the recompute).
    torch.manual_seed(0)
    model = _nested_checkpointed_layers(graph_break=False, call_form=call_form)
    if enabled == "before fuse":
        _checkpointing(model, reentrant=False)
    trifuse.fuse(model).train()
    if enabled == "after fuse":
        _checkpointing(model, reentrant=False)
    x = torch.randn(2, 5, 32)
    model(x).square().mean().backward()  # the captures
    def forward_ops(prof) -> int:
        return sum(1 for name in op_names(prof) if name.startswith("trifuse::") and "backward" not in name)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = model(x).square().mean()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_backward:
        loss.backward()
    # the recompute: the block's ops, and the inner layer's twice (its own checkpoint, nested)
    assert forward_ops(prof) == 6 and forward_ops(prof_backward) == 6 + 4, forward_ops(prof_backward)
    assert [type(u.unit).__name__ for u in trifuse.report(model).units] == ["DynamoUnit"]
    assert trifuse.report(model).counts() == {"layer_norm": 2, "dropout_add": 2, "residual_stream": 2}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_layer_inside_a_block_checkpointed_apart_fuses(reentrant):
    # Zamba's hybrid layer under gradient checkpointing: the block is checkpointed as compiled apart
    # (its body cannot be one checkpoint op), and the layer inside it would checkpoint again inside
    # that compiled forward, which Dynamo refuses as it refused the block's: the inner layer ran as
    # written, unfused. It runs inside the block's checkpoint without one of its own (the report says
    # so): every op fuses as without checkpointing, and from the same seeds losses and gradients equal
    # the unchecked fused model's; the inner layers checkpoint again between calls.
    torch.manual_seed(0)
    plain = _nested_checkpointed_layers()
    checkpointed = copy.deepcopy(plain)
    inner = _checkpointing(checkpointed, reentrant)
    for m in (plain, checkpointed):
        trifuse.fuse(m).train()
    x = torch.randn(2, 5, 32, requires_grad=True)

    def step(model, seed):
        torch.manual_seed(seed)
        model.zero_grad()
        x.grad = None
        model(x).square().mean().backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    step(checkpointed, 0)
    unit = next(u.unit for u in trifuse.report(checkpointed).units if u.unit.cls.__name__ == "Block")
    if not unit.checkpoint_outside:
        pytest.skip("this transformers checkpoints in GradientCheckpointingLayer.__call__, not in its forward")
    for seed in (1, 2):
        grads, grads_ck = step(plain, seed), step(checkpointed, seed)
        for g, g_ck in zip(grads, grads_ck):
            torch.testing.assert_close(g_ck, g)
    assert all(m.gradient_checkpointing for m in inner)
    counts = trifuse.report(plain).counts()
    assert trifuse.report(checkpointed).counts() == counts == {"layer_norm": 2, "dropout_add": 2, "residual_stream": 2}
    assert unit.inner_checkpoints == ["inner"]
    assert "without one of their own (the block's recomputes them): inner" in str(trifuse.report(checkpointed))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_block_with_batch_norm_trains_fused(reentrant):
    # Dynamo lifts what a checkpointed body reads into the checkpoint op's arguments, BatchNorm's
    # running statistics and step count among them, which the step changes in place. Passed as
    # the checkpoint's arguments, they failed its check that its saved inputs are unchanged at the
    # recompute: every backward raised (SwiftFormer). Against the same model unfused under the
    # same checkpointing: outputs, gradients and the statistics (updated again by the recompute,
    # as eager checkpointing does) equal; the norm fuses and runs again in the recompute.
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Block(GradientCheckpointingLayer):
        def __init__(self, width):
            super().__init__()
            self.bn, self.fc, self.norm = torch.nn.BatchNorm1d(width), torch.nn.Linear(width, width), \
                torch.nn.LayerNorm(width)

        def forward(self, x):
            return self.norm(x + self.fc(self.bn(x).relu()))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.layers = torch.nn.Linear(24, 24), torch.nn.ModuleList([Block(24), Block(24)])

        def forward(self, x):
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    unfused = Model().train()
    fused = copy.deepcopy(unfused)
    for m in (unfused, fused):
        _checkpointing(m, reentrant)
    trifuse.fuse(fused)
    x = torch.randn(10, 24)
    for step in range(3):
        grads = []
        for m in (unfused, fused):
            m.zero_grad()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                m(x).square().mean().backward()
            grads.append([p.grad for p in m.parameters()])
        for g, g_ref in zip(grads[1], grads[0]):
            torch.testing.assert_close(g, g_ref)
        for (name, b), b_ref in zip(fused.named_buffers(), unfused.buffers()):
            torch.testing.assert_close(b, b_ref, msg=name)
    assert fused.layers[0].bn.num_batches_tracked.item() == 6  # forward and recompute, as unfused
    assert trifuse.report(fused).counts() == {"residual_stream": 2}
    norms = sum(1 for name in op_names(prof) if name.startswith("trifuse::") and "backward" not in name)
    assert norms == 4, norms  # in the forward and again in the recompute


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("model_type, dropouts", [
    ("gpt_neo", {"attention_dropout": 0.2, "resid_dropout": 0.1}),
    ("bloom", {"attention_dropout": 0.2, "hidden_dropout": 0.1}),
])
def test_checkpointed_blocks_that_return_their_probabilities_fuse_attention(model_type, dropouts, reentrant):
    # GPT-Neo's and BLOOM's blocks return their attention probabilities whatever output_attentions
    # says. Under gradient checkpointing Dynamo captures the block as a checkpoint op whose body
    # returns them, and the block's graph returns the op's output: the body must drop them too,
    # or the attention stays unfused ("also used by output"). Against the same fused model without
    # checkpointing, from the same seeds: equal losses, gradients and counts, and the attention
    # runs in the forward and again in the recompute. A call that asks for the probabilities runs
    # as written and gets them; with the attention family off they stay in the body's outputs.
    torch.manual_seed(0)
    plain, inputs, loss_fn = _models.hf_family(model_type, **dropouts)
    layers = plain.config.num_hidden_layers if model_type == "gpt_neo" else plain.config.n_layer
    unfused = copy.deepcopy(plain)
    checkpointed = copy.deepcopy(plain)
    others = [f for f in trifuse.fusion.FAMILIES if f != "attention"]
    plain_others, checkpointed_others = copy.deepcopy(plain), copy.deepcopy(plain)
    for m in (checkpointed, checkpointed_others):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for m in (plain, checkpointed):
        trifuse.fuse(m).train()
    for m in (plain_others, checkpointed_others):
        trifuse.fuse(m, ops=others).train()
    kw = inputs(2, 8)
    for m in (plain, checkpointed):  # the captures, outside the profile
        _train_step(m, loss_fn, kw, 0)
        m.zero_grad()
    _assert_steps_equal(plain, checkpointed, loss_fn, kw, attention_runs=2 * layers)
    counts = trifuse.report(checkpointed).counts()
    assert counts == trifuse.report(plain).counts() and counts.get("attention") == layers, counts
    # the attention family off: the checkpoint's body returns the probabilities as written
    _assert_steps_equal(plain_others, checkpointed_others, loss_fn, kw)
    units = trifuse.report(checkpointed_others).units
    blocks = [u.unit for u in units if u.unit.cls.__name__.endswith("Block")]
    assert blocks and not any(u.drops_weights for u in blocks)
    assert "attention" not in trifuse.report(checkpointed_others).counts()
    # asked for, the probabilities come back as the unfused model computes them (the blocks run as written)
    asked = {**kw, "output_attentions": True}
    torch.manual_seed(4)
    out = checkpointed(**asked)
    torch.manual_seed(4)
    ref = unfused.train()(**asked)
    assert len(out.attentions) == layers
    for a, r in zip(out.attentions, ref.attentions):
        torch.testing.assert_close(a, r)


def _bert_head(head: str):
    """BERT from the tests' tiny config with a question-answering or token-classification head."""
    tf = _models._quiet_transformers()
    model, inputs, _ = _models.bert()
    cls = {"qa": tf.BertForQuestionAnswering, "token-cls": tf.BertForTokenClassification}[head]
    return cls(model.config).to(_models.DEVICE), inputs


@pytest.mark.skipif(not has_op("cross_entropy"), reason="trifuse.ops.cross_entropy not in this build")
@pytest.mark.parametrize("head, losses", [("qa", 2), ("token-cls", 1)])
def test_question_answering_and_token_classification_losses_fuse(head, losses):
    # Extractive QA scores the start and the end positions with two cross-entropies whose
    # ignore_index is the sequence length (positions past it are clamped there and not scored):
    # a constant at the first length, a symbolic size at the second (the blocks' recapture). Token
    # classification scores every token, -100 where a tokenizer leaves a sub-word. The losses and
    # every gradient are the unfused model's by the oracle rule, at both lengths.
    torch.manual_seed(0)
    model, inputs = _bert_head(head)
    model.train()
    ref64 = copy.deepcopy(model).double()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    for s in (8, 11):
        kw = {k: v for k, v in inputs(2, s).items() if k != "labels"}
        if head == "qa":
            kw["start_positions"] = torch.tensor([1, s + 5], device=_models.DEVICE)  # the second past the end
            kw["end_positions"] = torch.tensor([s - 1, 2], device=_models.DEVICE)
        else:
            labels = torch.randint(0, model.config.num_labels, (2, s), device=_models.DEVICE)
            labels[0, :3] = -100
            kw["labels"] = labels
        results = [_train_step(m, lambda m, kw: m(**kw).loss, k, 0)
                   for m, k in ((model, kw), (ref64, _double_inputs(kw)), (ref, kw))]
        (loss, grads), (loss64, grads64), (loss_r, grads_r) = results
        assert_close(f"loss, {s} positions", loss, loss64, loss_r)
        for (name, _), g, g64, gr in zip(model.named_parameters(), grads, grads64, grads_r):
            assert_close(f"grad {name}, {s} positions", g, g64, gr)
        for m in (model, ref64, ref):
            m.zero_grad(set_to_none=True)
        assert trifuse.report(model).counts().get("cross_entropy") == losses, (s, trifuse.report(model).counts())


class _TokenRows(torch.utils.data.Dataset):
    """Fixed rows of token ids, each its own labels (the tail of some ignored), as a causal-LM
    dataset hands them to Trainer."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].clone()
        labels[len(labels) - i % 4:] = -100  # rows of 9 to 6 counted tokens: the loss's ignore_index
        return {"input_ids": self.ids[i], "labels": labels}


def _trainer_run(model, ids, tmp_path):
    """Three optimizer steps of transformers' Trainer (AdamW, two batches accumulated a step, so
    the loss goes through Trainer's num_items_in_batch sum); returns the logged losses."""
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # Trainer needs it; peft, a test extra, brings it
    args = tf.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0,
        dataloader_num_workers=0, use_cpu=ids.device.type == "cpu", disable_tqdm=True)
    trainer = tf.Trainer(model=model, args=args, train_dataset=_TokenRows(ids))
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def test_transformers_trainer_trains_a_fused_model_as_the_unfused_one(tmp_path):
    """Hugging Face's Trainer over a fused GPT-2 (its own loop: accelerate's wrapping, gradient
    accumulation with num_items_in_batch passed to the model's loss, AdamW, clipping): after three
    steps every parameter equals the unfused model's by the oracle rule (float64 Trainer run as
    truth), the blocks and the loss ran fused, and the logged losses agree."""
    torch.manual_seed(0)
    model, inputs, _ = _models.gpt2()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    ids = inputs(12, 9)["input_ids"]
    trifuse.fuse(model)
    fused_losses = []
    ran = trifuse_ops_run(lambda: fused_losses.extend(_trainer_run(model, ids, tmp_path / "fused")))
    losses = _trainer_run(ref, ids, tmp_path / "unfused")
    _trainer_run(ref64, ids, tmp_path / "float64")
    assert len(fused_losses) == 3 and fused_losses == pytest.approx(losses, abs=2e-4)
    for (name, p), p64, pr in zip(model.named_parameters(), ref64.parameters(), ref.parameters()):
        assert_close(f"trained {name}", p.detach(), p64.detach(), pr.detach())
    assert trifuse.report(model).counts() == available_counts({**PRE_NORM, **LOSS})
    assert {"trifuse::attention", "trifuse::cross_entropy"} <= ran
