"""`trifuse.fuse` on every architecture the installed transformers has for a task (causal LM by
default; masked LM, seq2seq LM, image classification, sequence and token classification,
question answering, multiple choice, speech recognition with CTC, audio classification, video
classification, image and text to text: the vision-language models; and the base models of every
other type), built from a tiny config: does the fused model still run, train and give the
unfused model's loss and gradients, and what did fuse replace? A net for "never break a model"
wider than the test suite's hand-configured families (tests/_models.py); on CPU, in the Triton
interpreter.

    TRITON_INTERPRET=1 python bench/fuse_sweep.py [--task TASK] [--via VIA] [--dtype DTYPE] [--attn ATTN]
                                                   [MODEL_TYPE ...]
        # TASK: causal-lm (default; all 200 types of transformers 5.25, ~25-40 min on 2 cores), masked-lm, seq2seq,
        # image-cls, seq-cls (sequence classification: 3 labels, the model's own loss), token-cls (a label
        # per token, some -100), qa (extractive question answering: start and end positions, one past
        # the sequence), multiple-choice (3 choices an example), ctc (speech to characters: 2 clips,
        # transcripts of 4 and 2 tokens), audio-cls (a class per clip), video-cls (a class per clip of the
        # config's frames, 32x32), image-text (vision-language
        # models: two sequences with a small image each, as _image_text_inputs lays them out), base
        # (AutoModel, no head, for the types no other task reaches: detection, segmentation, depth,
        # speech synthesis, backbones, time series, composite models' towers; token ids, a 32x32
        # image or audio by the model's main input, with a dual encoder's other input or a speech
        # seq2seq model's decoder ids where it needs them (_base_layouts), the loss the squared
        # error of every floating output against fixed random targets: _loss);
        # VIA: fuse (default), backend (torch.compile(model, backend="trifuse")), inductor
        # (backend="trifuse_inductor": the rewritten graph compiled by Inductor, C++ on this CPU)
        # or hf-attention (the model
        # with attn_implementation="trifuse", unfused, on the sweep's batch and a packed one; causal-lm);
        # DTYPE: float64 (default), fp16-autocast or bf16-autocast (an fp32 model under CPU autocast
        # to fp16 / bf16, at that dtype's tolerance);
        # ATTN: sdpa (default) or eager (transformers' eager attention, the explicit
        # chains, where a model has SDPA too); named types replace their rows; --jobs N runs N types at once
        # VIA generate (causal-lm, seq2seq; float64): greedy generation of 5 tokens with and without the
        # KV cache, after a training step of the fused model, against the unfused model: the tokens equal,
        # every step's scores within 1e-6
        # VIA checkpoint (any task, float64): dropout on (0.1), the fused model beside two fused copies
        # under transformers' gradient checkpointing (non-reentrant, reentrant); after a first step (the
        # captures), a step from the same seed: each copy's loss and gradients within 1e-9 of the
        # un-checkpointed fused model's (the recompute must draw the forward's dropout masks), and
        # trifuse's ops run again in the backward's recompute (RECOMPUTE UNFUSED otherwise)

Each type runs in its own process (memory-capped, timed out), in float64 (or fp32 under fp16 or
bf16 autocast), one training step (dropout off) before and after fuse, then a second fused call.
Status per type:
    ok              loss within 1e-6 and every gradient within 1e-5 (relative to its largest
                    entry, or to 1e-10 of the model's largest where a gradient is numerically
                    zero) of the unfused model's; the models compute parts in fp32 themselves
                    (HF's norms upcast), so float64 agreement is at fp32's level, not better.
                    fp16-autocast: against a float64 copy, the fused loss and every gradient at
                    most twice as far as the unfused ones, plus 1e-3 (bf16-autocast: 8e-3;
                    TOLERANCES)
    MISMATCH        runs, but differs by more
    FUSED CRASH     the unfused model ran and the fused one raised: a trifuse bug
    refused         (--via hf-attention) a model trifuse/hf.py refuses with a clear error, by design
    Dynamo fails    (--via backend, inductor) torch.compile(backend="eager"), without trifuse, fails on it too
    Inductor fails  (--via inductor) plain torch.compile (Inductor), without trifuse, fails on it too
    RECOMPUTE UNFUSED (--via checkpoint) equal, but the backward's recompute ran no trifuse op
    FEWER FUSED     (--via checkpoint) a checkpointed copy fused fewer ops than the model unchecked
                    (so its dropout draws differ and its loss with them: not compared)
    no checkpointing  (--via checkpoint) the model does not support gradient checkpointing
    unfused NaN     (--via generate) the unfused model's scores are NaN/inf from the first step, in both
                    modes: nothing to compare with
    config / build / unfused fails / too big / died: the tiny config does not suit the
                    architecture (a harness limit, not a verdict on trifuse)
Writes bench/results/fuse_sweep[_<task>][_backend][_eager][_fp16-autocast|_bf16-autocast].json and .md
(no task suffix for causal-lm).
"""
import contextlib
import copy
import inspect
import json
import math
import os
import re
import resource
import subprocess
import sys
import time
import traceback

if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1].startswith("--one="):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 64, "n_embd": 32, "n_layer": 2,
         "n_head": 2, "d_model": 32, "n_positions": 64, "num_layers": 2, "num_heads": 2, "ffn_dim": 64, "head_dim": 16,
         "moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
         "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False, "use_cache": False}
NO_DROPOUT = {k: 0.0 for k in ("hidden_dropout", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                               "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "activation_dropout",
                               "embed_dropout", "ffn_dropout", "attention_dropout_prob", "residual_dropout",
                               "router_jitter_noise", "input_jitter_noise", "dropout_rate", "classifier_dropout",
                               "drop_path_rate", "hidden_dropout_rate", "attention_dropout_rate", "classifier_dropout_prob",
                               # the classification heads' own (sequence classification)
                               "seq_classif_dropout", "summary_first_dropout", "summary_last_dropout", "pooler_dropout",
                               "cls_dropout", "final_dropout", "qa_dropout",
                               # Reformer's attention probabilities (functional dropout, seeded anew per call)
                               "local_attention_probs_dropout_prob", "lsh_attention_probs_dropout_prob",
                               # Grounding DINO's drop path around its image-text fusion
                               "fusion_droppath")}
# Sizes only the encoder-decoder and vision configs have; kept apart so the causal-LM sweep's
# configs stay as they were.
SMALL_EXTRA = {"encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2, "encoder_attention_heads": 2,
               "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_ff": 64, "d_kv": 16,
               "embedding_size": 32, "decoder_start_token_id": 0, "image_size": 32, "patch_size": 8,
               "num_channels": 3, "num_labels": 3, "embed_dim": 32, "hidden_sizes": 32, "depths": 1}
# Per-type settings the tiny config needs to run at all. T5Gemma masks decoder tokens equal to
# pad, so a start token equal to pad masks the first query row whole (NaN in the unfused model).
# Swin halves its patch grid at each of its 4 stages: 16x16 patches (patch size 2) in windows of 2.
# ProphetNet counts its layers per stack only, Funnel per block; BiT's group norms take 32 groups
# of its bottlenecks' quarter width. Multi-head latent attention (DeepSeek-V2/V3/V3.2, Sarvam-MLA)
# needs its own small sizes: a key head per query head, low-rank q and kv, a rotary width equal
# to head_dim (the rotary table's), few routed experts; Kimi-Linear's delta-rule heads likewise.
_MLA = {"num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1}
# Sparse (indexed) attention over MLA: the indexer's heads small too.
_DSA = {**_MLA, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8}
# Gemma 4's per-layer input embeddings (vocab x layers x width) take small sizes of their own.
_GEMMA4 = {"vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8}
# Hybrid models alternate linear-attention (or state-space) layers with attention ones, attention
# every 4th or 8th layer by default: with two layers, one of each (not Qwen4-exp's indexed attention,
# whose tiny config lacks the indexer's sizes; not Bailing's, whose tiny heads then disagree).
_HYBRID = {"layer_types": ["linear_attention", "full_attention"]}
# Decoders of encoder-decoder families built alone (BART's ForCausalLM, ...) read their sizes from
# the encoder-decoder names; Whisper's and PLBart's heads would not divide the small width.
_DECODER = {k: SMALL_EXTRA[k] for k in ("encoder_layers", "decoder_layers", "encoder_attention_heads",
                                        "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim")}
# State-space mixers' sizes: their heads must tile expand x width (2 x 32) exactly.
_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16}
_TINY_SWIN = {"model_type": "swin", "embed_dim": 16, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 2, 2],
              "window_size": 2, "patch_size": 2, "image_size": 32,
              "out_features": ["stage1", "stage2", "stage3", "stage4"]}
_TINY_RESNET = {"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32], "depths": [1, 1],
                "out_indices": [1, 2]}
_SAM2_HIERA = {"model_type": "sam2_hiera_det_model", "hidden_size": 16,
               "embed_dim_per_stage": [16, 32, 64, 128], "num_attention_heads_per_stage": [1, 1, 2, 2],
               "blocks_per_stage": [1, 1, 2, 1],
               "global_attention_blocks": [3], "window_size_per_stage": [4, 4, 2, 2], "image_size": [64, 64],
               "window_positional_embedding_background_size": [4, 4]}
_SAM2_VISION = {"backbone_channel_list": [128, 64, 32, 16],
                "backbone_feature_sizes": [[16, 16], [8, 8], [4, 4]], "fpn_hidden_size": 32}

OVERRIDES = {"t5gemma": {"bos_token_id": 2},
             # LiLT's layout embeddings are six of hidden_size // 6; BROS's box embeddings take an eighth of a
             # quarter of it, halved again; LayoutLMv3's are 4 coordinates and 2 shapes that add up to it
             "lilt": {"hidden_size": 48}, "bros": {"hidden_size": 64},
             "layoutlmv3": {"coordinate_size": 4, "shape_size": 8},
             # XLNet's head size is checked against width / heads; X-MOD runs its language adapters only
             # for a language; ESM C has no grouped-query heads
             "xlnet": {"d_head": 16, "d_inner": 64}, "xmod": {"default_language": "en_XX"},
             "esmc": {"num_key_value_heads": 2},
             # Reformer: axial position embeddings that add up to the width and tile the 12 tokens, one
             # local and one LSH layer with chunks that divide them, hashing seeded (its random rotations)
             "reformer": {"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [3, 4],
                          "attn_layers": ["local", "lsh"], "local_attn_chunk_length": 4,
                          "lsh_attn_chunk_length": 4, "feed_forward_size": 64, "attention_head_size": 16,
                          "hash_seed": 0},
             **{t: _DECODER for t in ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian",
                                      "mbart", "mvp", "pegasus", "plbart", "whisper", "trocr")},
             # partial rotary over 8 of the 16-wide heads (the default 64 is past the head)
             **{t: {"rotary_dim": 8} for t in ("gptj", "codegen")},
             "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
             "diffllama": {"num_key_value_heads": 2},
             # DBRX's attention reads rope_theta from its attention config, which transformers 5.25's
             # DbrxAttentionConfig no longer declares, and clamps q, k and v to clip_qkv unconditionally
             # (None fails): both as DBRX's config.json sets them; experts at the tiny width
             "dbrx": {"attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
                      "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}},
             "dots1": {"n_shared_experts": 1},
             "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
             "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                            "rope_theta": 1e4}}},
             **{t: _DSA for t in ("glm_moe_dsa", "hy_v4")},
             # HY-V4-VL's text model: HY-V4's, with multimodal rotary sections that sum to the tiny
             # rotary half (validated when the config is built: _small_mrope comes too late)
             "hy_v4_vl_text": {**_DSA, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                                           "mrope_section": [2, 1, 1]}},
             # Cosmos 3 Edge's text model likewise (sections for the tiny head_dim 16); HY-V4-VL's vision
             # tower's positions for 64-pixel images at most (65537 of 2048 pixels: 2.1M parameters)
             "cosmos3_edge_text": {"rope_parameters": {"rope_theta": 1e8, "rope_type": "default",
                                                       "mrope_section": [4, 2, 2]}},
             "hy_v4_vl_vision": {"max_image_size": 64},
             # Muse Spark's audio encoder writes onto the text embeddings: its output at the text width
             "muse_spark_audio": {"out_hidden_size": 32},
             # Qwen3-Omni's audio encoder: its convolutions' width apart from its own (480), 16 positions
             "qwen3_omni_moe_audio_encoder": {"downsample_hidden_size": 32, "max_source_positions": 16,
                                              "num_mel_bins": 16, "output_dim": 32},
             # DeepSeek-OCR 2's and Unlimited OCR's SAM encoders: their necks' channels (256 to 1024 by
             # default), the last at the text width, one global-attention layer among the 2; DeepSeek-OCR
             # 2's text model names its layers' MLPs (the default names none, and the model reads them)
             **{t: {"output_channels": 16, "downsample_channels": [32, 32], "mlp_dim": 64,
                    "global_attn_indexes": [1]}
                for t in ("deepseek_ocr2_sam_vision_model", "unlimited_ocr_sam_vision_model")},
             "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
             # Janus's VQ-GAN (image generation; its group norms take 32 groups): 32 channels, two levels
             "janus_vqgan": {"base_channels": 32, "channel_multiplier": [1, 1], "num_res_blocks": 1,
                             "latent_channels": 32, "num_embeddings": 64, "projection_dim": 32,
                             "image_token_embed_dim": 32},
             # GLM-5 Next's text model: sparse latent attention (which validates as many KV heads as query
             # heads) beside gated linear attention, each with small heads; a layer of each, the second with
             # experts
             **{t: {**_DSA, "qk_rope_head_dim": 0, "qk_nope_head_dim": 16, "head_dim": 0, "index_kpool": 4,
                    "linear_head_dim": 16, "linear_num_heads": 2, "mlp_layer_types": ["dense", "sparse"],
                    "layer_types": ["linear_attention", "indexed_attention"]}
                for t in ("glm5_next", "glm5_next_text")},
             "longcat_flash": {**_MLA, "ffn_hidden_size": 64, "expert_ffn_hidden_size": 32,
                               "zero_expert_num": 2, "moe_topk": 2},
             # Inkling's sliding-window layers have sizes of their own (64 heads of 128 by default:
             # minutes a step in the interpreter)
             **{t: {"unpadded_vocab_size": 64, "swa_head_dim": 16, "swa_num_attention_heads": 2,
                    "swa_num_key_value_heads": 1, "sliding_window_size": 8, "rel_extent": 8,
                    "n_routed_experts": 4}
                for t in ("inkling_text", "inkling2_text", "inkling2_loop_text")},
             # Kolibri 1.1 (transformers 5.25): a sliding-window layer, then an indexed one (its
             # indexer scores keys with one query head; a few local and sink tokens, top 4), MoE after
             "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention"], "mlp_only_layers": [0],
                            "index_num_heads": 1, "index_topk": 4, "index_num_local_tokens": 4,
                            "index_num_sink_tokens": 1, "sliding_window": 8},
             "luke": {"entity_vocab_size": 64, "entity_emb_size": 16},
             # Perceiver's masked LM decodes max_position_embeddings tokens: the sweep's 12
             "perceiver": {"max_position_embeddings": 12, "num_latents": 16, "d_latents": 32,
                           "num_self_attends_per_block": 1, "num_self_attention_heads": 2,
                           "num_cross_attention_heads": 1},
             "roc_bert": {"pronunciation_vocab_size": 64, "shape_vocab_size": 64,
                          "pronunciation_embed_dim": 32, "shape_embed_dim": 32},
             "mamba2": {"num_heads": 4, "head_dim": 16, "n_groups": 1, "state_size": 16, "chunk_size": 16},
             "bamba": {**_MAMBA, "attn_layer_indices": [1]},
             "granitemoehybrid": {**_MAMBA, "layer_types": ["mamba", "attention"]},
             "zamba": {"layers_block_type": ["mamba", "hybrid"], "attention_head_dim": 16, "mamba_dt_rank": 8,
                       "attn_layer_period": 2, "attn_layer_offset": 1},
             "zamba2": {"layers_block_type": ["mamba", "hybrid"], "hybrid_layer_ids": [1],
                        "attention_head_dim": 16, "mamba_headdim": 16, "n_mamba_heads": 4,
                        "mamba_d_state": 16, "num_query_groups": 2},
             **{t: _HYBRID for t in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                                     "qwen3_next")},
             "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
             **{t: _GEMMA4 for t in ("gemma4", "gemma4_text", "gemma4_assistant", "gemma4_unified",
                                     "gemma4_unified_assistant", "gemma4_unified_text")},
             "prophetnet": {"num_encoder_layers": 2, "num_decoder_layers": 2},
             "funnel": {"block_sizes": [1, 1, 1], "bos_token_id": None}, "bit": {"hidden_sizes": 128},
             **{t: {"window_size": 2, "patch_size": 2} for t in ("swin", "swinv2", "donut-swin")},
             # MobileViT unfolds its feature maps (4x4 at most here) into patches of its own default 2x2:
             # with the sweep's 8, each pixel was a one-token sequence (128 of them a layer)
             "mobilevit": {"patch_size": 2},
             **{t: _MLA for t in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "sarvam_mla", "axk1", "axk2",
                                  "youtu", "glm4_moe_lite", "minicpm3")},
             # its rotary covers half of head_dim (partial_rotary_factor 0.5): 8 of 16, the qk rope width
             "mistral4": {**_MLA, "head_dim": 16},
             "kimi_linear": {**_HYBRID, "linear_head_dim": 16, "linear_num_heads": 2, "qk_rope_head_dim": 8,
                             "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16, "head_dim": 8},
             # detectors that pick their queries as the top k of the encoder's tokens: a 32 x 32 image
             # has fewer than their 900 or 300 (Grounding DINO's Swin leaves 4 over its feature levels).
             # Grounding DINO's GroupNorm(32, d_model) on those 1 x 1 maps: at a width of 32, one value
             # a group, normalized to PyTorch's rounding noise (1e-14, where trifuse gives the exact 0)
             # and blown up to O(1) by the layer norms after it. A width of 64 (d_model, alias
             # hidden_size) puts two values in a group. Its Swin backbone at Swin's sizes above.
             "rf_detr": {"num_queries": 4},
             **{t: {"num_queries": 4, "d_model": 64, "hidden_size": 64, "patch_size": 2, "window_size": 2}
                for t in ("grounding-dino", "mm-grounding-dino")},
             # SAM: the vision neck's channels and the positional features (two per channel pair) at
             # the prompt encoder's and mask decoder's width
             **{t: {"output_channels": 32, "num_pos_feats": 16, "mlp_dim": 64, "iou_head_hidden_dim": 32}
                for t in ("sam", "sam_hq")},
             # SAM 2: its Hiera backbone (four stages, the windowed attention pooling the queries from one
             # stage to the next; a block of the third global) and FPN on 64-pixel images (IMAGE_SIZES),
             # the prompt encoder's image embeddings as large as the third stage's map
             "sam2": {"vision_config": {**_SAM2_VISION, "backbone_config": _SAM2_HIERA},
                      "prompt_encoder_config": {"hidden_size": 32, "image_size": 64, "patch_size": 16,
                                                "mask_input_channels": 4},
                      "mask_decoder_config": {"hidden_size": 32, "mlp_dim": 64, "num_attention_heads": 2,
                                              "iou_head_hidden_dim": 32}},
             "sam2_vision_model": {**_SAM2_VISION, "backbone_config": _SAM2_HIERA},
             "sam2_hiera_det_model": _SAM2_HIERA,
             # X-CLIP: its prompt generator and the video encoder's frame-integration transformer (MIT) at
             # the tiny width (512 by default)
             "xclip": {"projection_dim": 32, "prompt_num_attention_heads": 2, "mit_hidden_size": 32,
                       "mit_intermediate_size": 64, "mit_num_attention_heads": 2},
             # VLM vision towers alone whose merger projects to the text model's width (4096 by default)
             **{t: {"out_hidden_size": 32} for t in ("glm4v_vision", "glm4v_moe_vision", "glm_ocr_vision",
                                                     "granite_docling_vision")},
             "glm5_next_vision": {"out_hidden_size": 32, "projection_intermediate_size": 64},
             # LeViT: its stem's four stride-2 convolutions make 16-pixel patches, whatever the config says
             "levit": {"patch_size": 16},
             # ALIGN's EfficientNet on 32-pixel images at a quarter of its width and a third of its depth,
             # without its random drop-connect; its projection as wide as the image embeddings (80)
             "align": {"vision_config": {"image_size": 32, "width_coefficient": 0.25, "hidden_dim": 64,
                                         "depth_coefficient": 0.35, "drop_connect_rate": 0.0},
                       "projection_dim": 80},
             # FastSpeech 2 at the tiny width, its many dropouts off, 16 mel bins
             "fastspeech2_conformer": {
                 "hidden_size": 32, "encoder_linear_units": 64, "decoder_linear_units": 64,
                 "num_mel_bins": 16, "speech_decoder_postnet_units": 32, "duration_predictor_channels": 32,
                 "energy_predictor_channels": 32, "pitch_predictor_channels": 32,
                 **{f"{part}_dropout": 0.0 for part in ("energy_predictor", "energy_embed", "pitch_predictor",
                                                         "pitch_embed", "speech_decoder_postnet")},
                 **{f"{part}_{kind}dropout_rate": 0.0 for part in ("encoder", "decoder")
                    for kind in ("", "positional_", "attention_")},
                 "duration_predictor_dropout_rate": 0.0},
             # CLAP's HTSAT audio encoder, a Swin over the spectrogram, at the tiny width: two stages of
             # one block, 4x4 patches of a 64-frame, 16-bin spectrogram in windows of 4
             "clap": {"audio_config": {"patch_embeds_hidden_size": 16, "hidden_size": 32, "depths": [1, 1],
                                       "num_attention_heads": [2, 2], "spec_size": 64, "num_mel_bins": 16,
                                       "window_size": 4, "patch_size": 4, "patch_stride": [4, 4],
                                       "projection_dim": 32, "hidden_dropout_prob": 0.0},
                      "projection_dim": 32},
             # transducers' prediction networks (a 2-layer LSTM of 640 by default) and OmniASR's feature
             # encoder (7 convolutions of 512 channels) at the tiny width
             **{t: {"decoder_hidden_size": 32}
                for t in ("parakeet_tdt", "parakeet_rnnt", "nemotron_asr_streaming")},
             # Nemotron 3.5 ASR's too, and its prompts (128 of them through a 2048-wide MLP by default)
             "nemotron3_5_asr": {"decoder_hidden_size": 32, "prompt_intermediate_size": 64, "num_prompts": 4,
                                 "default_prompt_id": 1},
             "omniasr_audio": {"conv_dim": [32] * 7},
             # CLVP's encoders rotate max(projection_dim / (2 * heads), 32) channels of each head (32 of
             # its 64, as CLVP's own sizes: 64-wide heads, a projection of 64); the codes it writes over
             # the decoder's output from its first stop on (83, 45, 248 by default) within the tiny vocabulary
             "clvp": {"hidden_size": 128, "num_attention_heads": 2, "projection_dim": 64,
                      "decoder_fixing_codes": [43, 45, 45, 48]},
             # SAM 3: its vision FPN at the width of the rest
             **{t: {"fpn_hidden_size": 32} for t in ("sam3", "sam3_tracker", "sam3_lite_text")},
             # time series: a context of 8 (plus 3 lags) to forecast 4 with 2 time features; patches of
             # 4 over 3 channels (PatchTST's default patch is one step); TimesFM's patches of 8
             **{t: {"context_length": 8, "prediction_length": 4, "lags_sequence": [1, 2, 3],
                    "num_time_features": 2} for t in ("informer", "autoformer", "time_series_transformer")},
             **{t: {"patch_length": 4, "patch_stride": 4, "num_input_channels": 3}
                for t in ("patchtst", "patchtsmixer")},
             **{t: {"patch_length": 8, "context_length": 32, "horizon_length": 8}
                for t in ("timesfm", "timesfm2_5")},
             # Gemma 3n's text model: its last layers reuse the KV of the last earlier layer of their type
             # (default 15 of 35 layers: of 2, none would make the cache); 4 layers, the last 2 sharing,
             # its widths and its activations' sparsity (a Gaussian top-k in the MLP) per layer, its
             # per-layer token embeddings at the tiny vocabulary
             "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                              "layer_types": ["sliding_attention", "full_attention"] * 2,
                              "intermediate_size": [64] * 4, "activation_sparsity_pattern": [0.95, 0.0] * 2,
                              "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8},
             "gemma3n_audio": {"conf_num_hidden_layers": 2, "conf_num_attention_heads": 2},
             # the full model: its vision tower's tokens per image, 2 x 2 (TIMM_TOWERS)
             "gemma3n": {"vision_soft_tokens_per_image": 4},
             # dots.3 Note: a text model of sparse latent attention (as many KV heads as query heads, which
             # the composite validates too), a vision tower with experts in its later layers (a layer of
             # each; the default sizes those 25 to 41 of 42) and an audio encoder whose convolutions and
             # adapter are sized apart from its width
             "dots3_note_text": {**_DSA, "shared_experts_intermediate_size": 32, "sliding_window": 8},
             "dots3_note": {"num_key_value_heads": 2},
             "dots3_note_vision_encoder": {"per_layer_config": {}, "mlp_layer_types": ["dense", "sparse"],
                                           "adapter_in_dim": 32, "adapter_out_dim": 32,
                                           "num_local_experts": 4},
             "dots3_note_audio_encoder": {"adapter_input_size": 32, "adapter_out_dim": 32,
                                          "num_key_value_heads": 2, "downsample_hidden_size": 32,
                                          "feature_size": 16, "conv_output_size": 64},
             # its decoder views the query as num_key_value_heads heads: no grouped queries
             "moonshine_streaming": {"num_key_value_heads": 2},
             # Whisper-style encoders alone: 16 positions of 16 mel bins (their 1500 take 3000 frames)
             **{t: {"max_source_positions": 16, "num_mel_bins": 16}
                for t in ("qwen2_audio_encoder", "voxtral_encoder", "moss_transcribe_diarize_audio",
                          "audioflamingo3_encoder")},
             # ViTDet's checkpoints (VitMatte's backbone too) add decomposed relative positions; the
             # config's default leaves them off. A residual conv block after its second layer, as
             # VitMatte's backbone has after every third: its LayerNorms over the map's channels
             "vitdet": {"use_relative_position_embeddings": True, "residual_block_indices": [1]},
             "muse_spark_text": {"moe_hidden_size": 64},  # its experts' width past the tiny one
             "mistral_large4_text": {**_MLA, "head_dim": 16},  # Mistral 4's latent attention, as mistral4's
             # Swin2SR: 2 x 2 windows of 1-pixel patches on 16-pixel images (its 64 make 4096 tokens)
             "swin2sr": {"window_size": 2, "patch_size": 1, "image_size": 16},
             # BridgeTower's link tower has hidden_size // 64 heads: one at 64
             "bridgetower": {"hidden_size": 64},
             # RT-DETR: its ResNet's last three stages (a sub-config built anew keeps only the last)
             # into the hybrid encoder at the tiny width, on 64-pixel images (IMAGE_SIZES); the
             # denoising queries off
             **{t: {"backbone_config": {"model_type": "rt_detr_resnet", "embedding_size": 16,
                                        "hidden_sizes": [16, 32, 32, 32], "depths": [1, 1, 1, 1],
                                        "out_indices": [2, 3, 4]},
                    "encoder_in_channels": [32, 32, 32], "decoder_in_channels": [32, 32, 32],
                    "encoder_hidden_dim": 32, "num_queries": 4, "num_denoising": 0}
                for t in ("rt_detr", "rt_detr_v2")},
             # the MaskFormer family: a Swin of 16 channels, pixel decoder and queries at the tiny width
             "maskformer": {"backbone_config": _TINY_SWIN, "fpn_feature_size": 32, "mask_feature_size": 32,
                            "num_queries": 4},
             "mask2former": {"backbone_config": _TINY_SWIN, "feature_size": 32, "mask_feature_size": 32,
                             "hidden_dim": 32, "encoder_feedforward_dim": 64, "dim_feedforward": 64,
                             "decoder_layers": 3, "num_queries": 4},
             "oneformer": {"backbone_config": _TINY_SWIN, "conv_dim": 32, "mask_dim": 32, "hidden_dim": 32,
                           "encoder_feedforward_dim": 64, "dim_feedforward": 64, "decoder_layers": 3,
                           "num_queries": 4, "text_encoder_width": 32, "text_encoder_vocab_size": 64,
                           "task_seq_len": 8},
             # the DETR family's default backbone is timm's ResNet-50: transformers' own ResNet at the
             # tiny width instead (timm needs a torchvision that matches the CPU torch)
             **{t: {"backbone_config": _TINY_RESNET, "num_queries": 4}
                for t in ("detr", "conditional_detr", "dab-detr", "deformable_detr", "table-transformer")}}
TASKS = ("causal-lm", "masked-lm", "seq2seq", "image-cls", "seq-cls", "token-cls", "qa", "multiple-choice",
         "ctc", "audio-cls", "video-cls", "image-text", "base")
AUDIO_TASKS = ("ctc", "audio-cls")
# trifuse.fuse(model), torch.compile(model, backend="trifuse" or "trifuse_inductor"), the model with
# attn_implementation="trifuse" (trifuse/hf.py; causal LMs, float64: _hf_attention_row), or
# greedy generation after a training step, fused against unfused (causal and seq2seq LMs, float64:
# _generate_row)
VIAS = ("fuse", "backend", "inductor", "hf-attention", "generate", "checkpoint")
COMPILE_BACKENDS = {"backend": "trifuse", "inductor": "trifuse_inductor"}  # --via: torch.compile's backend
GENERATE_TOKENS = 5
MAX_PARAMS = 3_000_000
# (loss, gradient, zero-gradient floor) tolerances per run dtype. The floor: a gradient below it
# (relative to the model's largest) is numerically zero (a key bias's, exactly zero in exact
# arithmetic) and is compared at the floor (float64) or relative to the model's largest gradient
# (_oracle_error); under fp16, anything below 1% of the largest is rounding from upstream (a
# BatchNorm bias before another BatchNorm in MobileViT). fp16-autocast: both models round to fp16 in their own places, so fused and unfused agree only to fp16's level
# (q and k projections' gradients differ by ~8% of their largest entry in some models, for both
# against float64); there the oracle rule judges: the fused model's error against a float64 copy
# of the model at most twice the unfused model's own, plus the tolerance below as slack.
# bf16-autocast: the same rule, the slack 8x fp16's (bf16 keeps 3 bits fewer).
TOLERANCES = {"float64": (1e-6, 1e-5, 1e-10), "fp16-autocast": (1e-3, 1e-3, 1e-2),
              "bf16-autocast": (8e-3, 8e-3, 1e-2)}
AUTOCAST_DTYPES = {"fp16-autocast": torch.float16, "bf16-autocast": torch.bfloat16}
# A multiple-choice head scores each choice with one logit: a bias that shifts every choice's logit alike
# is cancelled by the softmax over the choices, so its gradient is zero in exact arithmetic and holds
# float64 rounding only, which the 1e-10 floor judges against 1e-15 of the largest gradient.
_ZERO_CLASSIFIER_BIAS = (
    "a bias that shifts every choice's logit alike has a gradient zero in exact arithmetic (classifier.bias; "
    "ConvBERT's last LayerNorm bias, before its linear summary): fused 1.0-1.8e-15 of the largest gradient, the "
    "unfused model itself with its batch reversed up to 1.0e-15: float64 rounding, judged at the 1e-10 floor "
    "against 1e-15")
# MISMATCH rows whose cause was found and is not trifuse's: shown in the results' "why" column.
EXPLAINED = {
    ("causal-lm", "fp16-autocast", "youtu"):
        "with eager attention (--attn eager), seed 0: one gradient (layer 0's kv_a_layernorm) 2e-5 past the "
        "rule (fused 3.4e-3 off float64, unfused 1.2e-3), fp16 rounding compounding over attention and "
        "rotary; seeds 1-3: within it by 0.9-2.4e-3 (as its SDPA row)",
    ("seq2seq", "fp16-autocast", "t5"):
        "ReLU kink: a pre-activation within fp16 rounding of 0 flips sign (T5 with gelu_new, 3 seeds: ok; relu, "
        "5 seeds: the unfused model flips too, seed 4)",
    **{("causal-lm", "fp16-autocast", model_type): (
        "an ill-conditioned draw: the unfused model's own fp16 gradients are 1-9% off float64 in layer 0 and "
        f"move that much when its weights move by 1e-6 ({draws}, each ahead in some); other seeds: both 1e-5")
       for model_type, draws in (
           ("gemma4_unified",
            "4 draws: k_proj unfused 6.5-8.2e-2, fused 7.5-8.7e-2; gate_proj 1.1-2.4e-2, 1.8-2.3e-2"),
           ("gemma4_unified_text", "5 draws: k_proj unfused 1.6-7.2e-2, fused 1.5-5.0e-2"))},
    ("causal-lm", "bf16-autocast", "hunyuan_v1_moe"):
        "a routing flip: one token's router logits for experts 0 and 1 are 6.7e-4 apart in float64, within "
        "bf16's rounding of the inputs upstream (fused and unfused 1.8e-4 apart there), and the fused model "
        "sends it to the other expert: layer 1's expert weights' gradients differ (0.37, 0.17); every "
        "other gradient as unfused; seeds 1 and 2: ok (errors 1e-5 to 1e-4)",
    ("seq2seq", "bf16-autocast", "t5"):
        "ReLU kink, as its fp16-autocast row, more often in bf16: relu, seeds 0-2 MISMATCH; gelu_new, seeds "
        "0-2 ok (excess -6e-3 to -8e-3)",
    ("base", "bf16-autocast", "fun_asr_nano_encoder"):
        "ReLU kink, as T5's: a pre-activation within bf16 rounding of 0 flips sign, and a token's whole "
        "gradient through that unit goes or comes (layer 0's fc1 weight: unfused 9.3e-2 from float64 itself, "
        "fused 0.26; its FSMN conv 7e-3 and 0.12); the forward's activations as unfused everywhere; "
        "with gelu in its place: ok (excess -8e-3), seeds 0 and 2 within the rule in every gradient",
    ("qa", "fp16-autocast", "t5"):
        "ReLU kink, as T5's seq2seq row (with gelu_new: ok, oracle excess -1e-3)",
    ("image-cls", "float64", "mobilevit"):
        "BatchNorm biases before another BatchNorm (reduce_1x1.normalization.bias): gradients zero in exact "
        "arithmetic, at most 2.3e-13 (1e-15 of the largest, 202), differ by about 3e-13 and are judged at the "
        "1e-10 floor; every gradient above 1e-12 of the largest within 7e-11",
    ("image-cls", "float64", "bit"):
        "only the loss fused; the rows are gradients at 1e-14 of the largest (its last stage's, zero in exact "
        "arithmetic), judged at the 1e-10 floor: another formula for the unfused loss moves them as much "
        "(bench/fp64_truth.py --task image-cls)",
    # torch.compile(backend="trifuse") rows (fuse leaves their attention: every layer gets a cache object)
    **{(task, "float64", model_type): (
        f"the model's own fp32 softmax (`scores.float()`, a downcast in float64): unfused {err} from float64 "
        f"itself (its key biases' gradients, zero in exact arithmetic), fused {fused} (fp64_truth's "
        "Float64Throughout against torch.compile(backend='trifuse'))")
       for task, err, fused in (("causal-lm", "1.4e-2", "5.1e-11"), ("masked-lm", "1.4e-2", "5.1e-11"),
                                ("seq-cls", "1.2e-2", "5.3e-11"), ("qa", "1.2e-2", "4.2e-7"))
       for model_type in ("xlm", "flaubert")},
    ("causal-lm", "float64", "deepseek_v4"):
        "the model's own fp32 parts (hyper-connection head): unfused is 1.8e-5 from float64 itself "
        "(bench/fp64_truth.py, results README)",
    ("seq2seq", "float64", "t5gemma"):
        "the model's own fp32 softmax (a downcast in float64): unfused is 1.9e-5 from float64 itself and differs "
        "run to run (up to 2.4e-4, CPU fp32 kernels), fused 1.8e-7 (bench/fp64_truth.py --task seq2seq)",
    ("causal-lm", "float64", "qwen3_5_text"):
        "the model's own fp32 parts (gated delta rule): unfused is 2.0e-5 from float64 itself "
        "(bench/fp64_truth.py, results README)",
    ("seq-cls", "float64", "markuplm"):
        "the model's own fp32 softmax (a downcast in float64): unfused is 1.0e-2 from float64 itself (its key "
        "biases' gradients, zero in exact arithmetic), fused 3.8e-11 (bench/fp64_truth.py --task seq-cls)",
    ("seq-cls", "float64", "t5gemma"):
        "the model's own fp32 softmax, as in seq2seq: unfused 1.8e-5 from float64 itself, fused 3.3e-7 "
        "(bench/fp64_truth.py --task seq-cls)",
    ("seq-cls", "float64", "zamba2"):
        "the model's own fp32 parts (its Mamba-2 mixers): unfused 1.3e-5 from float64 itself, fused 4.0e-6 "
        "(bench/fp64_truth.py --task seq-cls)",
    ("qa", "float64", "splinter"):
        "the model's own fp32 parts: unfused 3.2e-2 from float64 itself (its query and key biases), fused 1.1e-7 "
        "(bench/fp64_truth.py --task qa)",
    ("qa", "float64", "markuplm"):
        "the model's own fp32 softmax, as in seq-cls: unfused 1.9e-2 from float64 itself, fused 7.7e-7 "
        "(bench/fp64_truth.py --task qa)",
    ("token-cls", "float64", "markuplm"):
        "the model's own fp32 softmax, as in seq-cls: unfused 1.3e-2 from float64 itself, fused 4.7e-11 "
        "(bench/fp64_truth.py --task token-cls)",
    ("qa", "float64", "mobilebert"):
        "qa_outputs.bias's gradient is zero in exact arithmetic (each row's softmax sums to 1): fused 9.3e-15 of "
        "the largest gradient, float64 rounding, which the 1e-10 floor judges against 1e-15 (bench/fp64_truth.py "
        "--task qa)",
    **{("multiple-choice", "float64", t): _ZERO_CLASSIFIER_BIAS
       for t in ("big_bird", "convbert", "deberta-v2", "distilbert", "squeezebert")},
    ("video-cls", "float64", "videoprism_vision_model"):
        "the model's own fp32 softmax (`softmax(..., dtype=torch.float32)` in its eager attention, the only one "
        "it has): the loss unfused 3.1e-8 from float64 itself, fused 7.6e-16; worst at the pooling head's "
        "k_proj.bias, whose gradient is zero in exact arithmetic: unfused 4e-9 (fp32 rounding), fused ~1e-17 "
        "(bench/fp64_truth.py --task video-cls)",
    **{("base", "float64", t): (
        "the model's own fp32 softmax (`softmax(..., dtype=torch.float32)` in the eager attention of its "
        "Swin backbone: the model has no SDPA path): the Swin k_proj biases' gradients, zero in exact "
        f"arithmetic, unfused {err} from float64 itself, fused within {fused} of it everywhere "
        "(bench/fp64_truth.py --task base)")
       for t, err, fused in (("grounding-dino", "0.6", "1.5e-7"), ("mm-grounding-dino", "0.72", "2.3e-7"),
                             ("mask2former", "0.31", "5.8e-7"), ("oneformer", "1.8e-3", "3.6e-8"))},
    ("base", "float64", "clap"):
        "the model's own fp32 softmax (`softmax(..., dtype=torch.float32)` in its text model's eager "
        "attention: the model has no SDPA path): the text k biases' gradients, zero in exact arithmetic, "
        "unfused 1.7-2.0e-8 (fp32 rounding), fused ~6e-17; the loss unfused 3.4e-9 from float64 itself, "
        "fused 2.7e-16, every gradient within 3.3e-9 of it (bench/fp64_truth.py --task base)",
    ("image-text", "float64", "hy_v4_vl"):
        "the model's own fp32 parts (its hyper-connections' mixes and norms take `.float()` copies): unfused "
        "1.2e-5 from float64 itself, worst at the head's hc_scale, fused 1.9e-6 (bench/fp64_truth.py --task "
        "image-text)",
    ("image-text", "float64", "muse_spark"):
        "the model's own fp32 parts (its vision tower's rotary takes `q.float(), k.float()`): unfused 1.5e-5 "
        "from float64 itself, worst at the tower's second attention's output projection, fused 6.3e-7 "
        "(bench/fp64_truth.py --task image-text)",
    ("base", "float64", "align"):
        "the model's own fp32 softmax (`softmax(..., dtype=torch.float32)` in its text model's eager "
        "attention: the model has no SDPA path): the text k biases' gradients, zero in exact arithmetic, "
        "unfused up to 5.3e-12 (fp32 rounding; below the 1e-10 floor, compared at it), fused ~1e-17; the "
        "loss unfused 9.8e-13 from float64 itself, fused 0 (bench/fp64_truth.py --task base)",
    ("base", "float64", "videoprism"):
        "the model's own fp32 softmax, as video-cls's videoprism_vision_model, at its video pooling head's "
        "k_proj.bias, whose gradient is zero in exact arithmetic (float64 truth 1.9e-18): unfused 4.4e-10, fused "
        "4.8e-10, both the fp32 rounding of that head, which stays as written in both (its attention weights "
        "are the module's output: the capture cannot tell the caller drops them) (bench/fp64_truth.py --task base)",
    ("causal-lm", "float64", "gemma4"):  # its text model, now at the tiny head_dim: gemma4_text's numbers
        "the model's own fp32 parts (worst at its q and k norms): unfused is 3.3e-5 from float64 itself, "
        "fused 2.1e-5 (bench/fp64_truth.py)",
    ("causal-lm", "float64", "gemma4_text"):
        "the model's own fp32 parts (worst at its q and k norms): unfused is 3.3e-5 from float64 itself, "
        "fused 2.1e-5 (bench/fp64_truth.py)",
    ("image-text", "float64", "git"):
        "its vision tower's k_proj biases, whose gradient is zero in exact arithmetic (a softmax ignores "
        "a shift of every key's score): unfused 0.9-1.2e-15 (float64 rounding), fused ~1e-24, 5-6e-5 "
        "of the 1e-10 floor",
    ("causal-lm", "float64", "cpmant"):
        "the model's own fp32 parts (its RMSNorm's mean square of `hidden.to(torch.float32)`, a downcast in "
        "float64): unfused is 2.8e-5 from float64 itself, fused 3.7e-14 (bench/fp64_truth.py)",
    ("base", "bf16-autocast", "clvp"):
        "a near tie in its argmax of the speech decoder's logits (the tokens its speech encoder reads): at "
        "one position tokens 20 and 18 are 2.3e-3 apart in float64, one bf16 ulp of the logit (2.1e-3); the "
        "fused attention or bias-GeLU rounds to 18, unfused to 20 (as float64): loss 9.6% off float64 fused, "
        "0.66% unfused",
    ("causal-lm", "float64", "longcat_flash"):
        "the model's own fp32 parts (its router's logits of `hidden.type(torch.float32)`): unfused is 2.6e-5 "
        "from float64 itself at the router weights, fused 2.1e-7 (bench/fp64_truth.py)",
    ("causal-lm", "float64", "lara_mini"):
        "the model's own fp32 parts (Qwen3.5's gated delta rule): unfused is 2.0e-4 from float64 itself, "
        "another fp32 formula for its loss moves it 1.7e-5 (bench/fp64_truth.py)",
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _attribute(cfg, name: str):
    """cfg.name, or None where it has none, or where reading it raises (Gemma 4's per-layer
    attributes refuse a global read)."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001
        return None


def _has(cfg, name: str) -> bool:
    try:
        return hasattr(cfg, name)
    except Exception:  # noqa: BLE001  (a per-layer attribute: the config has it)
        return True


def _read_only(cls, name: str) -> bool:
    """Whether cls derives `name` (a property with no setter: Falcon's head_dim)."""
    attr = inspect.getattr_static(cls, name, None)
    return isinstance(attr, property) and attr.fset is None


def _refused(cls, names) -> set[str]:
    """The names among `names` that cls will not have set at all: a property whose setter raises
    NotImplementedError (XLNet has no max_position_embeddings: no sequence length limit)."""
    refused, default = set(), None
    for name in names:
        attr = inspect.getattr_static(cls, name, None)
        if not isinstance(attr, property) or attr.fset is None:
            continue
        default = cls() if default is None else default
        try:
            attr.fset(default, attr.fget(default))
        except NotImplementedError:
            refused.add(name)
    return refused


def _small_config(cls, kw: dict):
    """cls built with the small sizes (encoder-decoder and vision tasks): per-stage sizes (Swin's
    depths and num_heads, PVT's, ...) become one small value per stage, zeroed rates keep the
    default's type, sub-configs (CLIP's text and vision towers, T5Gemma's encoder and decoder) are
    made small too, and sizes the config's own validation rejects (a head_dim it does not have,
    BiT's, Funnel's and ProphetNet's layer counts) are left at their defaults."""
    default = cls()
    kw = dict(kw)
    for k, v in list(kw.items()):
        d = _attribute(default, k)
        if isinstance(d, (list, tuple)) and d and all(isinstance(x, (int, float)) for x in d) \
                and isinstance(v, (int, float)):
            kw[k] = type(d)([v] * len(d))
        elif k in NO_DROPOUT and isinstance(d, int) and not isinstance(d, bool):
            kw[k] = 0
    for name, sub_cls in (getattr(default, "sub_configs", None) or {}).items():
        sub = _attribute(default, name)
        if sub is None or isinstance(kw.get(name), dict):  # none, or given whole (OVERRIDES)
            continue
        if hasattr(sub, "to_dict") and not isinstance(sub, type):  # the default's own class (an AutoConfig
            sub_cls = type(sub)  # placeholder names none: Gemma 3's SigLIP tower, Llama 4's vision config)
        if isinstance(sub_cls, type):
            # its own overrides, as when swept alone (Gemma 3n's text model's per-layer sizes); a copy, as
            # a config keeps the dicts it is given and the sweep writes into them (_small_mrope)
            own = copy.deepcopy(OVERRIDES.get(getattr(sub_cls, "model_type", None), {}))
            try:
                shared = {k: v for k, v in kw.items()
                          if k != "attn_implementation" and k not in default.sub_configs}
                kw[name] = _small_config(sub_cls, {**shared, **own})
            except Exception:  # noqa: BLE001, S110  (a sub-config not buildable small stays its default)
                pass
    if not _has(default, "head_dim") or _read_only(cls, "head_dim"):  # the sub-configs' head_dim set above
        kw.pop("head_dim", None)
    for k in [k for k in kw if _read_only(cls, k)]:  # sizes the config derives (X-Codec's hidden_size)
        kw.pop(k)
    try:
        return cls(**kw)
    except Exception:  # noqa: BLE001, S110  (the config's own validation)
        pass
    # only sizes the config has: a stray one becomes an attribute its validation may read (a VLM's
    # text model given the vision tower's embed_dim: HY-V4-VL's and Mistral Large 4's check it
    # against their heads x head_dim)
    kw = {k: v for k, v in kw.items()
          if k in ("attn_implementation", "experts_implementation") or _has(default, k)}
    try:
        return cls(**kw)
    except Exception:  # noqa: BLE001  (the layer count stays its own: ProphetNet's num_encoder_layers is
        aliases = getattr(cls, "attribute_map", {}) or {}  # set, not decoder_layers)
        return cls(**{k: v for k, v in kw.items() if k != "num_hidden_layers"
                      and aliases.get(k) != "num_hidden_layers"})


# Speech models' own sizes and training-time randomness: the wav2vec2 family's 7-layer convolutional
# feature encoder (512 channels each by default) and its convolutional position embedding (kernel
# 128); SpecAugment's time and feature masks and LayerDrop, drawn per training call (off, as
# dropout is); the spectrogram sizes of AST (time x mel patches) and Whisper's encoder (mel x frames,
# twice its positions); the x-vector head's TDNN.
SMALL_AUDIO = {"conv_dim": 32, "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
               "mask_time_prob": 0.0, "mask_feature_prob": 0.0, "layerdrop": 0.0, "feat_proj_dropout": 0.0,
               "max_length": 32, "num_mel_bins": 16, "max_source_positions": 16, "tdnn_dim": 32,
               "xvector_output_dim": 32, "classifier_proj_size": 32}


# Vision-language models (image-text): the vision tower's output width is the text model's
# (Qwen2.5-VL's out_hidden_size, PaliGemma's projection, Llama 4's and Cohere 2 Vision's
# projectors; the projectors' own widths: LFM2-VL's, Muse Spark's 4096), Gemma 3 pools the 4x4
# patches of a 32-pixel image into 4 tokens, LLaVA-NeXT tiles an image on one 32x32 grid point (a
# base image and one tile).
SMALL_IMAGE_TEXT = {"out_hidden_size": 32, "projection_dim": 32, "mm_tokens_per_image": 4,
                    "image_grid_pinpoints": [[32, 32]], "projector_input_dim": 32, "projector_output_dim": 32,
                    "vision_output_dim": 32, "alignment_intermediate_size": 64, "projector_hidden_size": 64}
# Llama 4's pixel shuffle (ratio 0.5) hands its adapter 4x the tower's width: its intermediate size.
# Gemma 4 pools its 4x4 patches 2x2 into 4 tokens (its global layers' heads as small as the rest).
# Mllama: a cross-attention layer among the two text layers, its tower's global layer and the
# intermediate layers it concatenates (two, so 3 x 32 wide) within its two layers; Molmo 2's
# adapter reads its tower's two layers.
_GEMMA4_IMAGE_TEXT = {"pooling_kernel_size": 2, "global_head_dim": 16}
IMAGE_TEXT_OVERRIDES = {"llama4": {"intermediate_size": 128}, "gemma4": _GEMMA4_IMAGE_TEXT,
                        # Gemma 4 Unified's patch embedder (no vision tower): its width and positions
                        "gemma4_unified": {**_GEMMA4_IMAGE_TEXT, "mm_embed_dim": 32, "output_proj_dims": 32,
                                           "mm_posemb_size": 16},
                        "molmo2": {"vision_feature_layer": [1, 0]},
                        "mllama": {"cross_attention_layers": [1], "intermediate_layers_indices": [0, 1],
                                   "num_global_layers": 1, "vision_output_dim": 96},
                        # Kimi K2.5: DeepSeek-V3's latent attention (its validation wants head_dim x heads
                        # = embed_dim), a projector that normalizes the vision tower's width by this name
                        "kimi_k25": {**_MLA, "embed_dim": 16, "projection_hidden_size": 32},
                        # Florence-2's DaViT: its stages' patch convolutions at their own kernels (7 then 3)
                        "florence2": {"patch_size": [7, 3, 3, 3], "window_size": 4},
                        # VipLLaVA: the 5 tower layers it reads (-2, -5, -8, -11, 6 by default), of the tiny 2
                        "vipllava": {"vision_feature_layers": [-2, -3, 0, 1, 2]},
                        # Kosmos-2: 8 latent queries an image (64 by default)
                        "kosmos-2": {"latent_query_num": 8},
                        # Qwen2.5-Omni's and Qwen3-Omni's thinkers: their rope index reads the vision-start
                        # token, which their checkpoints' config names and the default leaves out
                        **{t: {"vision_start_token_id": 0}
                           for t in ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")},
                        # Step 3.7: its text model builds a sliding-window mask whatever its layer types
                        "step3p7": {"sliding_window": 8},
                        # Aria: its projector's query count per patch count (1225 and 4900 by default)
                        "aria": {"projector_patch_to_query_dict": {16: 4}},
                        # Muse Spark and Muse Glimmer: the width their projector reads is the vision tower's
                        # after its 2 x 2 merge, 4 x 32 (the audio encoder's, the text model's: OVERRIDES)
                        **{t: {"out_hidden_size": 128} for t in ("muse_spark", "muse_glimmer")},
                        # Inkling 2: its vision tower's projection to the text width, which it validates
                        **{t: {"text_hidden_size": 32} for t in ("inkling2", "inkling2_loop")},
                        # Nemotron H Omni: its RADIO tower's video patches as its own (the tower made small
                        # takes RADIO's default, none)
                        "nemotron_h_omni": {"video_temporal_patch_size": 2},
                        # BLIP-2 and InstructBLIP: their Q-Former's queries take the image tokens' places,
                        # which a checkpoint's config names (image_token_index) and the default leaves out
                        **{t: {"image_token_id": 0, "num_query_tokens": 8}
                           for t in ("blip-2", "instructblip")}}
# Token ids a config keeps as such, not the special tokens a multimodal model marks its inputs with
_PLAIN_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "_pad_token_id",
                    "user_token_id")


def _small_token_ids(cfg, vocab: int = 64) -> None:
    """Moves the special tokens of a multimodal config (image_token_id, vision_start_token_id,
    boi_token_index, ...) into the tiny vocabulary, the same name to the same id in the config and
    its sub-configs: the text model embeds every input id, an image token's too, in some models."""
    configs = [cfg] + [c for c in (_attribute(cfg, n) for n in (getattr(cfg, "sub_configs", None) or {}))
                       if hasattr(c, "to_dict")]
    names = sorted({k for c in configs for k, v in c.to_dict().items()
                    if re.search(r"token_(id|index)$", k) and k not in _PLAIN_TOKEN_IDS
                    and type(v) is int})
    for i, name in enumerate(names):
        for c in configs:
            if type(_attribute(c, name)) is int:
                setattr(c, name, vocab - 1 - i)


# Text configs whose models read `mrope_section` with a default of their own, undeclared in the config
_UNDECLARED_MROPE = {"paddleocr_vl_text"}
# Text configs whose `mrope_section` lists the height's and width's sections before time's
_HW_FIRST_MROPE = {"ernie4_5_vl_moe_text"}


def _small_mrope(cfg) -> None:
    """Multimodal rotary (Qwen-VL's t/h/w sections of the rotary frequencies): sections that sum to
    the tiny heads' rotary half, where the text config takes `mrope_section` (their defaults are
    for head_dim 128)."""
    for c in (cfg, _attribute(cfg, "text_config")):
        params = _attribute(c, "rope_parameters")
        takes_sections = "mrope_section" in getattr(type(c), "ignore_keys_at_rope_validation", ()) \
            or getattr(c, "model_type", None) in _UNDECLARED_MROPE
        if not takes_sections or not isinstance(params, dict):
            continue
        head_dim = _attribute(c, "head_dim") or c.hidden_size // c.num_attention_heads
        half = int(head_dim * params.get("partial_rotary_factor", 1.0)) // 2
        t, hw = half - 2 * (half // 3), half // 3
        # (t, h, w); ERNIE 4.5 VL orders them (h, w, t) and interleaves h with w, which must match
        params["mrope_section"] = [hw, hw, t] if c.model_type in _HW_FIRST_MROPE else [t, hw, hw]


# timm vision towers (TimmWrapper configs have no sizes of their own: timm builds the named
# architecture with the config's `model_args`), made small, by the model type: its architecture, those
# arguments, its output width (hidden_size) and the image side the harness feeds it.
# - Gemma 3n: timm's MobileNet V5 encoder (300M parameters) cut to four stages of one to three blocks
#   of 16 to 32 channels, in timm's block notation (an edge residual, universal inverted residuals,
#   multi-query attention of 2 heads of 8 in the last two stages), which its fusion adapter reads and
#   pools to 2 x 2 tokens of its fixed width, 2048.
# - FastVLM: FastViT-HD (MCI3: repmixer stages, then attention stages) at one block of 8 to 32 channels a
#   stage, 2 x 2 tokens of a 128-pixel image (its stride is 64); the default config's tower is a
#   ResNet-50 placeholder once made small.
# - Perception LM: the Perception Encoder (a rotary ViT), 2 layers of 32, 2 x 2 patches of 16 and its
#   class token; the default config names no architecture (a ResNet-50 placeholder).
TIMM_TOWERS = {
    "gemma3n": {"architecture": "mobilenetv5_300m_enc", "hidden_size": 2048, "image_size": 32,
                "model_args": {"stem_size": 16, "msfa_output_resolution": 2, "block_args": (
                    ("er_r1_k3_s2_e4_c16",), ("uir_r1_a3_k5_s2_e4_c16",),
                    ("uir_r1_a3_k5_s2_e4_c32", "mqa_r1_k3_h2_s2_d8_c32", "uir_r1_a0_k0_s1_e2_c32"),
                    ("uir_r1_a5_k5_s2_e4_c32", "mqa_r1_k3_h2_s1_d8_c32", "uir_r1_a0_k0_s1_e2_c32"))}},
    "fast_vlm": {"architecture": "fastvit_mci3", "hidden_size": 64, "image_size": 128,
                 "model_args": {"inference_mode": True, "layers": [1] * 5,
                                "embed_dims": [8, 16, 16, 32, 32]}},
    "perception_lm": {"architecture": "vit_pe_core_tiny_patch16_384", "hidden_size": 32, "image_size": 32,
                      "model_args": {"embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": [32, 32],
                                     "ref_feat_shape": [2, 2], "global_pool": ""}},
}


def _small_timm_tower(cfg, model_type: str) -> None:
    """A composite model's timm vision tower made small (TIMM_TOWERS)."""
    tower = TIMM_TOWERS.get(model_type)
    vision = _attribute(cfg, "vision_config")
    if tower is None or vision is None:
        return
    args = copy.deepcopy(tower["model_args"])
    if "block_args" in args:  # timm's notation decoded here (timm's builder consumes the dicts it is given)
        try:
            from timm.models._efficientnet_builder import decode_arch_def

            args["block_args"] = decode_arch_def([list(stage) for stage in args["block_args"]])
        except ImportError:  # no timm: the build fails as it would have, on transformers' message
            pass
    vision.architecture, vision.model_args = tower["architecture"], args
    vision.hidden_size, vision.image_size = tower["hidden_size"], tower["image_size"]


def _config(tf, model_type: str, attn: str, task: str = "causal-lm"):
    small = SMALL if task == "causal-lm" else {**SMALL, **SMALL_EXTRA}
    if task in AUDIO_TASKS:
        small = {**small, **SMALL_AUDIO}
    if task == "image-text":
        small = {**small, **SMALL_IMAGE_TEXT, **IMAGE_TEXT_OVERRIDES.get(model_type, {})}
    if task == "qa":  # a start and an end logit per token: heads that split num_labels take 2
        small = {**small, "num_labels": 2}
    kw = {**small, **NO_DROPOUT, **copy.deepcopy(OVERRIDES.get(model_type, {}))}  # (see _small_config)
    extra = {"attn_implementation": attn, "experts_implementation": "batched_mm"}
    config_cls = tf.CONFIG_MAPPING[model_type]
    for name in _refused(config_cls, kw):
        kw.pop(name)
    plain = task == "causal-lm" and not getattr(config_cls, "sub_configs", None)
    if plain and _read_only(config_cls, "head_dim"):
        kw.pop("head_dim", None)
    if plain:
        try:
            cfg = config_cls(**kw, **extra)
        except Exception:  # noqa: BLE001  (its validation refuses a size: set only the sizes it takes)
            cfg = _small_config(config_cls, {**kw, **extra})
    else:  # composite configs (a text model beside vision or audio towers): each part made small
        vision_cls = (getattr(config_cls, "sub_configs", None) or {}).get("vision_config")
        if task == "image-text" and isinstance(vision_cls, type) \
                and _attribute(config_cls(), "vision_config") is None:
            kw["vision_config"] = _small_config(vision_cls, kw)  # a tower the default leaves out (Gemma 4)
        cfg = _small_config(config_cls, {**kw, **extra})
    for k, v in small.items():  # sizes some constructors ignore; head_dim may be a derived property
        if k == "head_dim" or k in OVERRIDES.get(model_type, {}) or k not in kw:
            continue
        if not plain and isinstance(_attribute(cfg, k), (list, tuple)):
            continue  # per-stage sizes, made small above
        try:
            if _has(cfg, k):
                setattr(cfg, k, v)
        except Exception:  # noqa: BLE001, S110  (per-layer or read-only attributes stay as built)
            pass
    if task == "image-text":
        _small_token_ids(cfg)
    _small_mrope(cfg)  # a VLM's text model alone takes the sections too
    _small_timm_tower(cfg, model_type)
    if task == "causal-lm" and _attribute(cfg, "is_decoder") is False:  # an encoder family's LM head
        cfg.is_decoder = True  # (BertLMHeadModel, Reformer's) as a decoder: causal, as it is trained
    return cfg


def _grad_error(grads0: tuple, grads1: tuple, floor: float = 1e-10) -> float:
    """The largest relative gradient error, each parameter's relative to its own largest entry;
    parameters whose gradient is numerically zero (below `floor` of the largest over the model, e.g.
    a router's weights through a top-k) are compared at that floor instead. NaN and inf entries
    (some models' unfused gradients have them: LED's padded windows) must sit in the same places
    (inf with the same sign); the rest is compared. A None gradient matches an all-zero one."""
    finite = [a[a.isfinite()] for a in grads0 if a is not None]
    floor = floor * max((float(a.abs().max()) for a in finite if a.numel()), default=0.0)
    worst = 0.0
    for a, b in zip(grads0, grads1):
        if a is None or b is None:  # None beside zeros is the same gradient: a reentrant checkpoint
            other = b if a is None else a  # gives zeros where unused outputs lead (LiLT's last layout layer)
            if other is not None and bool(other.count_nonzero()):
                return float("inf")
            continue
        if not torch.equal(a.isnan(), b.isnan()) or not torch.equal(a.isinf(), b.isinf()) \
                or not torch.equal(a[a.isinf()], b[b.isinf()]):
            return float("inf")
        keep = a.isfinite()
        if keep.any():
            a, b = a[keep], b[keep]
            worst = max(worst, float((a - b).abs().max()) / max(float(a.abs().max()), floor, 1e-300))
    return worst


def _oracle_errors(grads0: tuple, grads1: tuple, grads64: tuple,
                   floor: float) -> list[tuple[int, float, float]]:
    """Per parameter (its index), the unfused and the fused gradient's error against float64, each
    relative to the float64 gradient's largest entry. A gradient below `floor` of the model's
    largest is numerically zero (exactly zero in exact arithmetic: a BatchNorm bias before another
    BatchNorm): it holds only rounding noise from upstream, which differs at random between the two
    models, so its errors are measured relative to the model's largest gradient instead. Entries
    compared: where float64's and the unfused model's are finite (Longformer's float64 gradients
    hold NaN in its padded windows); a fused entry not finite there is an infinite error."""
    finite64 = [g[g.isfinite()] for g in grads64 if g is not None]
    largest = max((float(g.abs().max()) for g in finite64 if g.numel()), default=0.0)
    rows = []
    for i, (a, b, c) in enumerate(zip(grads0, grads1, grads64)):
        if a is None or b is None or c is None:
            continue
        keep = c.isfinite() & a.isfinite()
        if not keep.any():
            continue
        a, b, c = a[keep].double(), b[keep].double(), c[keep]
        scale = float(c.abs().max())
        scale = max(largest if scale < floor * largest else scale, 1e-300)
        fused = float((b - c).abs().max()) / scale if bool(b.isfinite().all()) else float("inf")
        rows.append((i, float((a - c).abs().max()) / scale, fused))
    return rows


def _oracle_error(grads0: tuple, grads1: tuple, grads64: tuple, floor: float, slack: float) -> float:
    """The worst excess, over parameters, of the fused gradient's error against float64 beyond
    twice the unfused one's plus `slack` (_oracle_errors): <= 0 when the fused model is as accurate
    as the rule asks."""
    return max((e1 - 2 * e0 - slack for _, e0, e1 in _oracle_errors(grads0, grads1, grads64, floor)),
               default=float("-inf"))


def past_the_rule(names: list[str], grads0: tuple, grads1: tuple, grads64: tuple, floor: float,
                  slack: float) -> str:
    """An autocast row's gradients past the oracle rule (_oracle_errors; `names`: the parameters'):
    how many, and the worst one's fused and unfused errors against float64. "" when none is."""
    failing = [(i, e0, e1) for i, e0, e1 in _oracle_errors(grads0, grads1, grads64, floor)
               if e1 > 2 * e0 + slack]
    if not failing:
        return ""
    i, e0, e1 = max(failing, key=lambda r: r[2] - 2 * r[1])
    return f"{len(failing)} gradient(s) past the rule, the worst {names[i]}: fused {e1:.2g}, unfused {e0:.2g}"


def nudge_outputs(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`model`, its every Linear's and convolution's output moved by half an ulp of its dtype, up or
    down at random (a generator seeded by `seed`), by forward hooks: the size of what a fused op
    changes where it rounds once instead of twice, or takes a bias out of a matmul. PyTorch's own
    model so nudged shows how far rounding alone moves what it computes (_ill_conditioned here,
    bench/fuzz_rewriter.py's ill_conditioned)."""
    gen = torch.Generator().manual_seed(seed)

    def nudge(module, args, out):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        sign = torch.randint(0, 2, out.shape, generator=gen).to(out.dtype) * 2 - 1
        return out + sign * out.abs() * (torch.finfo(out.dtype).eps / 2)

    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            m.register_forward_hook(nudge)
    return model


def _nudged(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of `model`, nudged (nudge_outputs)."""
    return nudge_outputs(copy.deepcopy(model), seed)


def _ill_conditioned(model: torch.nn.Module, loss_of, autocast, grads0: tuple, grads1: tuple,
                     grads64: tuple, floor: float, slack: float, tries: int = 4) -> str:
    """For an autocast MISMATCH: whether PyTorch's own model (`model`, unfused), with its Linear and
    conv outputs nudged by half an ulp (_nudged), misses float64 at least half as far as the fused
    model on every gradient where the fused one breaks the oracle rule (each in one of `tries` runs,
    not necessarily the same one). Then
    the rule's yardstick, the unfused model's own error, is luck: a saturated softmax, a ReLU whose
    input sits within a rounding of 0 or a router's near tie move that much on a rounding. LongT5
    under bf16 autocast, GeLU: its decoder's first cross-attention k gradient fused 4.0e-2 off,
    unfused 1.0e-2, nudged 2.8e-2 to 4.6e-2. `loss_of(m)`: the training step's loss through `m`.
    Returns the row's explanation, or "" when not so."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    failing = [(i, e0, e1) for i, e0, e1 in _oracle_errors(grads0, grads1, grads64, floor)
               if e1 > 2 * e0 + slack]
    if not failing:
        return ""
    reached = dict.fromkeys((i for i, _, _ in failing), 0.0)
    for seed in range(tries):
        nudged = _nudged(model, seed)
        with autocast:
            loss = loss_of(nudged)
        grads = torch.autograd.grad(loss, [p for p in nudged.parameters() if p.requires_grad],
                                    allow_unused=True)
        for i, _, e in _oracle_errors(grads0, grads, grads64, floor):
            if i in reached:
                reached[i] = max(reached[i], e)
    if any(reached[i] < e1 / 2 for i, _, e1 in failing):
        return ""
    worst = max(failing, key=lambda r: r[2] - 2 * r[1])
    i, e0, e1 = worst
    return (f"ill-conditioned: unfused, Linear/conv outputs nudged by half an ulp, as far off float64 on the "
            f"{len(failing)} gradient(s) past the rule ({names[i]}: fused {e1:.2g}, unfused {e0:.2g}, "
            f"nudged up to {reached[i]:.2g} in {tries} runs)")


def _non_finite(grads: tuple) -> int:
    return sum(int((~g.isfinite()).sum()) for g in grads if g is not None)


def _auto_class(tf, task: str):
    return {"causal-lm": tf.AutoModelForCausalLM, "masked-lm": tf.AutoModelForMaskedLM,
            "seq2seq": tf.AutoModelForSeq2SeqLM, "image-cls": tf.AutoModelForImageClassification,
            "seq-cls": tf.AutoModelForSequenceClassification,
            "token-cls": tf.AutoModelForTokenClassification, "qa": tf.AutoModelForQuestionAnswering,
            "multiple-choice": tf.AutoModelForMultipleChoice, "ctc": tf.AutoModelForCTC,
            "audio-cls": tf.AutoModelForAudioClassification, "video-cls": tf.AutoModelForVideoClassification,
            "image-text": tf.AutoModelForImageTextToText, "base": tf.AutoModel}[task]


def _from_config(auto, cfg):
    """The task's model for `cfg`, built by its auto class, or by the task's class from a part of a
    composite config where the class declares the part's config (MusicGen's causal LM is its
    decoder: MusicgenForCausalLM takes the MusicgenDecoderConfig in the MusicgenConfig that
    AutoModelForCausalLM maps to it, and fails on the whole)."""
    cls = auto._model_mapping.get(type(cfg), None)
    cls = cls[0] if isinstance(cls, (tuple, list)) else cls
    want = getattr(cls, "config_class", None)
    if isinstance(want, type) and not isinstance(cfg, want):
        for name in getattr(cfg, "sub_configs", None) or {}:
            if isinstance(_attribute(cfg, name), want):
                return cls._from_config(_attribute(cfg, name))
    return auto.from_config(cfg)


# audio encoders that take their features mel bins first, as Whisper's, with no fixed window (CLVP's
# conditioning encoder)
_MEL_FIRST = {"voxtral_realtime_encoder", "glmasr_encoder", "clvp"}
# mel bins an encoder takes that its config does not name (Gemma 4's audio subsampling: 128) or names
# in a part (CLVP's decoder config's feature_size)
_MEL_BINS = {"gemma4_audio": 128, "clvp": 80}
# waveform encoders that take a channel dim, (batch, 1, samples)
_MONO_CHANNEL = {"pocket_tts_audio_tokenizer_encoder"}
# samples an encoder takes in whole frames (Muse Spark's audio: a multiple of 1920)
_SAMPLES = {"muse_spark_audio": 3840}


def _audio_inputs(model, task: str, dtype: torch.dtype, name: str | None = None) -> dict:
    """One batch of two clips for the model's main input, with labels: 0.2 s of 16 kHz samples
    (`input_values`: the wav2vec2 family, ~9 frames after its feature encoder), a time x mel
    spectrogram (AST's `input_values`), or mel x frames features (`input_features`: Whisper's
    encoder, its full window). ctc: transcripts of 4 and 2 tokens, the second padded with -100 as
    a CTC collator pads them; audio-cls: a class per clip. `name`: the input's, where it is not the
    model's main one (a text-to-speech model's `input_features` beside its `input_ids`)."""
    cfg, name = model.config, name or model.main_input_name
    own = type(cfg)().to_dict()  # the config's own fields (the small sizes were passed to every config)
    mel_first = False  # features as (batch, mel bins, frames)
    audio_cfg = _attribute(cfg, "audio_config")
    if name == "input_features" and _attribute(audio_cfg, "spec_size"):
        # CLAP's HTSAT encoder reads the spectrogram as a one-channel image, (batch, 1, frames, mel
        # bins), which it folds into a spec_size square
        x = torch.randn(2, 1, audio_cfg.spec_size, audio_cfg.num_mel_bins, dtype=dtype)
    elif name == "input_values" and "num_mel_bins" in own and "max_length" in own:
        x = torch.randn(2, cfg.max_length, cfg.num_mel_bins, dtype=dtype)
    elif name == "input_values":
        # OmniASR's encoder and Pocket TTS's tokenizer take (batch, 1, samples), a channel dim their
        # first convolution reads; the wav2vec2 family adds that dim itself
        x = torch.randn(2, 1, 3200, dtype=dtype) if cfg.model_type.startswith("omniasr") \
            or cfg.model_type in _MONO_CHANNEL else \
            torch.randn(2, _SAMPLES.get(cfg.model_type, 3200), dtype=dtype)
    elif "max_source_positions" in own and "num_mel_bins" in own:
        x = torch.randn(2, cfg.num_mel_bins, 2 * cfg.max_source_positions, dtype=dtype)
        mel_first = True
    elif cfg.model_type in _MEL_FIRST:
        mel_first = True
        x = torch.randn(2, _MEL_BINS.get(cfg.model_type) or cfg.num_mel_bins, 40, dtype=dtype)
    else:  # filter-bank frames (time, features; Wav2Vec2-BERT stacks 2 frames of 80 into one of 160,
        # FunASR's encoder 7 into one of 560)
        width = (own.get("feature_projection_input_dim") or own.get("feature_size") or own.get("num_mel_bins")
                 or _MEL_BINS.get(cfg.model_type) or 80) * (own.get("num_stacked_frames") or 1)
        x = torch.randn(2, 40, width, dtype=dtype)
    labels = torch.tensor([0, 2]) if task == "audio-cls" else torch.tensor([[3, 4, 5, 6], [7, 8, -100, -100]])
    extra = {}
    if "input_features_mask" in inspect.signature(model.forward).parameters:  # the frames' padding mask
        frames = x.shape[-1] if mel_first else x.shape[1]
        extra["input_features_mask"] = torch.ones(2, frames, dtype=torch.long)
        extra["input_features_mask"][1, frames * 3 // 4:] = 0  # the second clip a quarter shorter
    if cfg.model_type.startswith("omniasr"):  # its CTC loss reads the frames' lengths from the padding mask
        extra["padding_mask"] = torch.ones(2, x.shape[-1], dtype=torch.long)
        extra["padding_mask"][1, -800:] = 0  # the second clip 0.05 s shorter, padded as a collator pads it
    return {name: x, "labels": labels, **extra}


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x


def _naflex_inputs(vision_cfg, dtype: torch.dtype) -> dict:
    """SigLIP 2's NaFlex layout, as its processor pads a batch: each image's patches flattened
    (patches x channels * patch * patch), its (height, width) in patches, and a mask; the first
    image 4 x 4 patches, the second 4 x 3, its last 4 rows padding."""
    patch, channels = _first(vision_cfg.patch_size), getattr(vision_cfg, "num_channels", 3) or 3
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    return {"pixel_values": torch.randn(2, 16, channels * patch * patch, dtype=dtype),
            "spatial_shapes": torch.tensor([[4, 4], [4, 3]]), "pixel_attention_mask": mask}


def _grid_patches(vision_cfg, grid: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-VL's layout, as its processor builds it: two images of grid x grid patches, each patch
    flattened (channels x temporal patch x patch x patch) and the images' patches one after the
    other, with each image's (t, h, w) in patches."""
    patch = _first(vision_cfg.patch_size)
    temporal = getattr(vision_cfg, "temporal_patch_size", None) or getattr(vision_cfg, "patch_temporal", 1)
    temporal = temporal or 1
    channels = getattr(vision_cfg, "in_channels", None) or getattr(vision_cfg, "num_channels", 3) or 3
    return (torch.randn(2 * grid * grid, channels * temporal * patch * patch, dtype=dtype),
            torch.tensor([[1, grid, grid]] * 2))


def _positioned_patches(patch: int, grid: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 4's layout: two images of grid x grid patches, each image's patches flattened (patches x
    3 * patch * patch), with every patch's (x, y) in the grid."""
    xy = torch.stack(torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="xy"), -1).reshape(-1, 2)
    return torch.randn(2, grid * grid, 3 * patch * patch, dtype=dtype), xy.expand(2, -1, -1).contiguous()


def _vision_tower_layouts(model, dtype: torch.dtype) -> list[dict]:
    """A VLM's vision tower alone: Qwen-VL's and its kin's `forward(hidden_states | pixel_values,
    grid_thw)`, two images of 4 merged patches a side as `_grid_patches` lays them out, each patch
    flattened or as an image (Kimi K2.5's conv takes channels x patch x patch); Gemma 4's
    `forward(pixel_values, pixel_position_ids)`, two of 4 x 4 patches."""
    forward = inspect.signature(model.forward).parameters
    if "pixel_position_ids" in forward:
        patches, xy = _positioned_patches(_first(model.config.patch_size), 4, dtype)
        return [{"pixel_values": patches, "pixel_position_ids": xy}]
    merge = getattr(model.config, "spatial_merge_size", 2) or 2
    patches, grid_thw = _grid_patches(model.config, 4 * merge, dtype)
    kwargs = {"grid_thw": grid_thw}
    if "merge_sizes" in forward:  # VideoLLaMA 3: each image's merge
        kwargs["merge_sizes"] = torch.tensor([merge] * 2)
    name, patch = next(iter(forward)), _first(model.config.patch_size)
    return [{name: patches, **kwargs}, {name: patches.view(len(patches), -1, patch, patch), **kwargs}]


# Image sides for models whose 32-pixel images leave too few tokens (over the config's image_size):
# RT-DETR's encoder attends over its last level, one token at 32 pixels, 2 x 2 at 64; SAM 2's Hiera
# pools its tokens three times (a 16 x 16 grid at 64 pixels to 2 x 2)
IMAGE_SIZES = {"rt_detr": 64, "rt_detr_v2": 64,
               **dict.fromkeys(("sam2", "sam2_vision_model", "sam2_hiera_det_model"), 64),
               # PP-OCRv6's recognizers pool a 1/16 height by 3: 32 pixels leave 2 rows
               "pp_ocrv6_small_rec": 64, "pp_ocrv6_tiny_rec": 64}


def _pixels(model, dtype: torch.dtype) -> dict:
    """Images for the model's vision side: 2 x channels x 32 x 32 (or the config's own size up to
    64), video clips of the config's frames (VideoMAE, ViViT, TimeSformer; VideoPrism's
    `pixel_values_videos`), or SigLIP 2's patches."""
    forward = inspect.signature(model.forward).parameters
    vision = _attribute(model.config, "vision_config") or model.config
    if "spatial_shapes" in forward:
        return _naflex_inputs(vision, dtype)
    size = IMAGE_SIZES.get(model.config.model_type) or _first(getattr(vision, "image_size", 32))
    size = size if isinstance(size, int) and 8 <= size <= 64 else 32
    frames = _attribute(vision, "num_frames")
    frames = (frames,) if isinstance(frames, int) and 0 < frames <= 32 else ()
    name = "pixel_values_videos" if model.main_input_name == "pixel_values_videos" else "pixel_values"
    return {name: torch.randn(2, *frames, getattr(vision, "num_channels", 3) or 3, size, size, dtype=dtype)}


def _series_inputs(model, dtype: torch.dtype) -> dict:
    """A batch of 2 time series: the GluonTS-style encoder-decoders' (Informer, Autoformer, the Time
    Series Transformer) context with its lags and time features and the values to forecast;
    TimesFM's univariate series of four patches with their padding; PatchTST's and PatchTSMixer's
    multivariate context."""
    cfg = model.config
    forward = inspect.signature(model.forward).parameters
    if "past_time_features" in forward:
        past, future = cfg.context_length + max(cfg.lags_sequence), cfg.prediction_length
        return {"past_values": torch.randn(2, past, dtype=dtype),
                "past_time_features": torch.randn(2, past, cfg.num_time_features, dtype=dtype),
                "past_observed_mask": torch.ones(2, past, dtype=dtype),
                "future_values": torch.randn(2, future, dtype=dtype),
                "future_time_features": torch.randn(2, future, cfg.num_time_features, dtype=dtype)}
    if "past_values_padding" in forward:
        length = 4 * cfg.patch_length
        kwargs = {"past_values": torch.randn(2, length, dtype=dtype),
                  "past_values_padding": torch.zeros(2, length, dtype=dtype)}
        if "freq" in forward:
            kwargs["freq"] = torch.zeros(2, 1, dtype=torch.long)
        return kwargs
    return {"past_values": torch.randn(2, cfg.context_length, cfg.num_input_channels, dtype=dtype)}


def _other_inputs(model, dtype: torch.dtype) -> dict | None:
    """The batch of a model whose inputs are none of the usual ones: the Decision Transformer's
    trajectories (states, actions, rewards and returns to go), the BLIP-2 Q-Former's queries with
    the image features they read, Gemma 3n's audio encoder's mel frames (40 tokens after its
    subsampling), OneFormer's images with its task prompt, SegGPT's image and its prompt image and
    mask (each half the config's height), MiniCPM-V's packed images (a row of patches, 4 x 4 and
    2 x 6 of them, with their sizes in patches), SpeechT5's encoder-decoder without its pre-nets
    (hidden states in, for the encoder and the decoder), FastSpeech 2's text with its training
    targets (spectrogram, durations, pitch and energy)."""
    cfg = model.config
    forward = inspect.signature(model.forward).parameters
    if "duration_labels" in forward:  # FastSpeech 2 trains on its targets: 2 frames a token
        return {"input_ids": torch.randint(1, 40, (2, 8)),
                "spectrogram_labels": torch.randn(2, 16, cfg.num_mel_bins, dtype=dtype),
                "duration_labels": torch.full((2, 8), 2), "pitch_labels": torch.randn(2, 8, 1, dtype=dtype),
                "energy_labels": torch.randn(2, 8, 1, dtype=dtype)}
    if model.main_input_name == "states":
        return {"states": torch.randn(2, 12, cfg.state_dim, dtype=dtype),
                "actions": torch.randn(2, 12, cfg.act_dim, dtype=dtype),
                "rewards": torch.randn(2, 12, 1, dtype=dtype),
                "returns_to_go": torch.randn(2, 12, 1, dtype=dtype),
                "timesteps": torch.randint(0, 8, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=dtype)}
    if "query_embeds" in forward and "input_ids" not in forward:
        return {"query_embeds": torch.randn(2, 4, cfg.hidden_size, dtype=dtype),
                "encoder_hidden_states": torch.randn(2, 6, cfg.encoder_hidden_size, dtype=dtype)}
    if model.main_input_name == "audio_mel":
        return {"audio_mel": torch.randn(2, 160, cfg.input_feat_size, dtype=dtype),
                "audio_mel_mask": torch.zeros(2, 160, dtype=torch.bool)}
    if cfg.model_type == "speecht5":
        return {"input_values": torch.randn(2, 12, cfg.hidden_size, dtype=dtype),
                "decoder_input_values": torch.randn(2, 6, cfg.hidden_size, dtype=dtype)}
    if model.main_input_name == "pixel_values" and "target_sizes" in forward:
        patch, channels = _first(cfg.patch_size), getattr(cfg, "num_channels", 3) or 3
        return {"pixel_values": torch.randn(1, channels, patch, 28 * patch, dtype=dtype),
                "target_sizes": torch.tensor([[4, 4], [2, 6]])}
    if "task_inputs" in forward:  # OneFormer's task prompt ("the task is semantic") as token ids
        return {**_pixels(model, dtype), "task_inputs": torch.randint(1, 64, (2, cfg.task_seq_len))}
    if "prompt_pixel_values" in forward:
        height, width = cfg.image_size
        return {k: torch.randn(2, 3, height // 2, width, dtype=dtype)
                for k in ("pixel_values", "prompt_pixel_values", "prompt_masks")}
    return None


def _base_layouts(model, dtype: torch.dtype) -> list[dict]:
    """The batches a model without a head may take, fewest inputs first: its main input alone, then
    with what its forward takes beside it (a dual encoder's images or audio for its text, CLIP's
    text for its images, a speech seq2seq model's decoder ids)."""
    name = model.main_input_name
    forward = inspect.signature(model.forward).parameters
    ids = {"input_ids": torch.randint(1, 64, (2, 12))}

    def audio(name: str | None = None) -> dict:
        kwargs = _audio_inputs(model, "ctc", dtype, name)
        del kwargs["labels"]
        return kwargs

    if {"grid_thw", "pixel_position_ids"} & forward.keys():  # a VLM's vision tower (its main input
        return _vision_tower_layouts(model, dtype)  # name is often the default's)
    other = _other_inputs(model, dtype)
    if other:
        return [other]
    if name == "input_ids":
        main = dict(ids)
    elif name in ("pixel_values", "pixel_values_videos"):
        main = _pixels(model, dtype)
    elif name in ("input_values", "input_features"):
        main = audio()
    elif name == "past_values":
        main = _series_inputs(model, dtype)
    else:
        return []
    layouts = [main]
    if name == "input_ids" and "pixel_values" in forward:
        layouts.append({**main, **_pixels(model, dtype)})
    if name == "input_ids" and "input_features" in forward:
        layouts.append({**main, **audio("input_features")})
    if name != "input_ids" and "input_ids" in forward:
        layouts.append({**main, **ids})
    if name != "input_ids" and "decoder_input_ids" in forward:
        layouts.append({**main, "decoder_input_ids": torch.randint(1, 64, (2, 6))})
    return layouts


def _base_inputs(model, dtype: torch.dtype) -> dict:
    """One batch for a model without a head: the first of `_base_layouts` it runs on (a forward
    without gradients); where none of the others does, the last, to fail in the unfused step. A
    main input with no batch here raises (status "inputs": a harness limit)."""
    layouts = _base_layouts(model, dtype)
    if not layouts:
        raise ValueError(f"main input {model.main_input_name!r}: no batch for it in this sweep")
    for kwargs in layouts[:-1]:
        try:
            with torch.no_grad():
                _seeded(model)(**kwargs)
            return kwargs
        except Exception:  # noqa: BLE001, S112  (not this layout)
            continue
    return layouts[-1]


def _seeded(model):
    """The model, called after reseeding PyTorch's generator: a model's own randomness in training
    (DINOv3's random rescale of its rotary coordinates, an audio encoder's masking) then draws the
    same numbers fused and unfused, and in the second fused call. Dropout is off; trifuse draws
    nothing without it."""
    torch.manual_seed(1234)
    return model


def _loss(out, task: str) -> torch.Tensor:
    """The model's own loss; for a model without a head ("base"), the mean squared error of every
    floating output tensor (nested tuples and ModelOutput fields included) against fixed random
    targets of its shape: the same outputs give the same loss fused or not, every output's
    gradient flows (a plain sum would give a norm's output none but its bias's), and no terms
    cancel (a sum against random weights can end near 0, where a relative error means nothing).
    Infinite entries (Grounding DINO's text logits past the text, -inf) count as 0: an output
    that is infinite in one model and finite in the other still changes the loss, a NaN spreads."""
    if task != "base":
        return out.loss
    leaves = [t for t in torch.utils._pytree.tree_leaves(out.to_tuple() if hasattr(out, "to_tuple") else out)
              if torch.is_tensor(t) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ValueError("no floating output wants a gradient")
    total = 0.0
    for i, t in enumerate(leaves):
        g = torch.Generator().manual_seed(i)
        t = torch.where(t.isinf(), 0, t)
        total = total + (t - torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)).square().mean()
    return total


def _image_token_counts(out, images: int) -> list[int] | None:
    """How many text positions each image's features fill, from what get_image_features returns
    (transformers 5: an output whose pooler_output holds the features, a tensor or one per image;
    Llama 4's, the tower's last hidden state, projected later)."""
    feats = out
    if not torch.is_tensor(out) and not isinstance(out, (list, tuple)):
        feats = getattr(out, "pooler_output", None)
        feats = feats if feats is not None else getattr(out, "last_hidden_state", None)
    if feats is None:
        return None
    if isinstance(feats, (list, tuple)):
        if all(torch.is_tensor(f) for f in feats) and len(feats) == images:
            return [f.reshape(-1, f.shape[-1]).shape[0] for f in feats]
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    rows = feats.reshape(-1, feats.shape[-1]).shape[0]
    return [rows // images] * images if rows % images == 0 else None


def _image_text_inputs(model, dtype: torch.dtype) -> dict:
    """A batch of two sequences with one small image each, as a processor builds them: text, the
    image's placeholder tokens (as many as its features; after a vision-start token where the
    config has one), more text; labels the ids with the image positions -100. The pixel layout
    is the first of the usual ones the model's get_image_features takes: Qwen-VL's flattened
    patches with a (t, h, w) grid, one image (with its size where asked), or a stack of tiles."""
    cfg = model.config
    # a vision encoder-decoder's encoder, or the config itself (Fuyu's linear patch embedding has no tower)
    vc = _attribute(cfg, "vision_config") or _attribute(cfg, "encoder") or cfg
    # a timm tower has neither size (but what TIMM_TOWERS gives it): a 32-pixel image, the patch layouts tried
    side, patch = _first(_attribute(vc, "image_size") or 32), _first(_attribute(vc, "patch_size") or 16)
    forward = inspect.signature(model.forward).parameters
    if "cross_attention_mask" in forward:
        return _cross_attention_image_text_inputs(model, dtype)
    image_features = getattr(model, "get_image_features", None) or getattr(getattr(model, "model", None),
                                                                            "get_image_features", None)
    image = _attribute(cfg, "image_token_id")
    image = image if image is not None else _attribute(cfg, "image_token_index")
    if image_features is None or image is None:
        # no image placeholders: the image conditions the text some other way (a vision encoder-
        # decoder's cross-attention, GIT's and BLIP's image tokens prepended by the model)
        ids = torch.randint(1, 32, (2, 12), generator=torch.Generator().manual_seed(1))
        if "flattened_patches" in forward:  # Pix2Struct's patches (_flattened_patches)
            return {**_flattened_patches(vc, dtype), "labels": ids}
        if "image_embeds_position_mask" in forward:  # Kosmos-2: the image's latent queries take the
            queries = cfg.latent_query_num  # positions the mask marks, after the text's first 2 tokens
            ids = torch.cat([ids[:, :2], torch.full((2, queries), 3), ids[:, 2:]], 1)
            mask = torch.zeros_like(ids)
            mask[:, 2:2 + queries] = 1
            return {"pixel_values": torch.randn(2, 3, side, side, dtype=dtype), "input_ids": ids,
                    "image_embeds_position_mask": mask, "labels": ids.masked_fill(mask.bool(), -100)}
        return {"pixel_values": torch.randn(2, 3, side, side, dtype=dtype), "labels": ids,
                **({"input_ids": ids} if "input_ids" in forward else {})}
    sig = inspect.signature(image_features).parameters
    qformer = {}  # InstructBLIP's instruction, which its Q-Former reads beside its queries
    if "qformer_input_ids" in forward:
        instruction = torch.randint(1, 32, (2, 6), generator=torch.Generator().manual_seed(2))
        qformer = {"qformer_input_ids": instruction, "qformer_attention_mask": torch.ones_like(instruction)}
    layouts = []
    if "image_grid_thw" in sig:
        patches, grid_thw = _grid_patches(vc, side // patch, dtype)
        grid = {"image_grid_thw": grid_thw}
        if "image_merge_sizes" in forward:  # VideoLLaMA 3: each image's merge (in its head's **kwargs)
            grid["image_merge_sizes"] = torch.tensor([getattr(vc, "spatial_merge_size", 2) or 2] * 2)
        layouts.append((patches, grid))
        # Kimi K2.5's and PaddleOCR-VL's convs take each patch as an image
        layouts.append((patches.view(len(patches), -1, patch, patch), grid))
        # Inkling 2: a block of merge x merge patches per image token, channels last, the grid counted
        # in those tokens
        merge = _attribute(vc, "spatial_merge_size") or 2
        tokens = side // patch // merge
        layouts.append((torch.randn(2 * tokens * tokens, patch * merge, patch * merge, 3, dtype=dtype),
                        {"image_grid_thw": torch.tensor([[1, tokens, tokens]] * 2)}))
    if "image_position_ids" in sig:  # Gemma 4's patches, or Gemma 4 Unified's merged ones (model_patch_size)
        for size in dict.fromkeys((patch, _attribute(vc, "model_patch_size") or patch)):
            patches, xy = _positioned_patches(size, side // size, dtype)
            layouts.append((patches, {"image_position_ids": xy}))
    if "spatial_shapes" in sig:  # SigLIP 2's NaFlex patches (LFM2-VL): flattened, with their grid and mask
        grid = side // patch
        layouts.append((torch.randn(2, grid * grid, 3 * patch * patch, dtype=dtype),
                        {"spatial_shapes": torch.tensor([[grid, grid]] * 2),
                         "pixel_attention_mask": torch.ones(2, grid * grid, dtype=torch.long)}))
    sizes = {"image_sizes": torch.tensor([[side, side]] * 2)} if "image_sizes" in sig else {}
    layouts.append((torch.randn(2, 3, side, side, dtype=dtype), dict(sizes)))
    for tiles in (1, 2):
        extra = dict(sizes)
        if "pixel_attention_mask" in sig:  # a mask per pixel (Idefics 3), or per tile (Granite Docling)
            extra["pixel_attention_mask"] = torch.ones(2, tiles, side, side, dtype=torch.bool)
            layouts.append((torch.randn(2, tiles, 3, side, side, dtype=dtype),
                            {**sizes, "pixel_attention_mask": torch.ones(2, tiles, dtype=torch.bool)}))
        layouts.append((torch.randn(2, tiles, 3, side, side, dtype=dtype), extra))
    # each image's patches flattened, row by row (Fuyu's linear patch embedding)
    layouts.append((torch.randn(2, (side // patch) ** 2, 3 * patch * patch, dtype=dtype), dict(sizes)))
    failure = None
    for pixels, extra in layouts:
        try:
            with torch.no_grad():
                counts = _image_token_counts(image_features(pixel_values=pixels, **extra, **qformer), 2)
        except Exception as e:  # noqa: BLE001  (not this layout)
            failure = e
            continue
        if counts:
            break
    else:
        raise ValueError(f"no pixel layout suits get_image_features ({type(failure).__name__}: {failure})")
    start, end = _attribute(cfg, "vision_start_token_id"), None
    if cfg.model_type in BRACKETED_IMAGES:
        start, end = cfg.image_start_token_id, cfg.image_end_token_id
    ids, gen = [], torch.Generator().manual_seed(1)
    for n in counts:
        text = torch.randint(1, 32, (10,), generator=gen).tolist()
        ids.append(text[:2] + ([start] if start is not None else []) + [image] * n
                   + ([end] if end is not None else []) + text[2:])
    ids = torch.tensor(ids)
    labels = ids.masked_fill(ids >= 32, -100)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels,
              "labels": labels, **extra, **qformer}
    for name in ("token_type_ids", "mm_token_type_ids"):  # 1 at the image's positions (Gemma 3, Qwen-VL)
        if name in forward:
            kwargs[name] = (ids == image).long()
    if "use_cache" in forward:
        kwargs["use_cache"] = False
    return kwargs


def _flattened_patches(vision_cfg, dtype: torch.dtype) -> dict:
    """Pix2Struct's input as its processor lays it out: 4 x 4 patches an image, each a row of its
    1-based (row, column) and its pixels (patch_embed_hidden_size of them); the second image 3 rows
    of 4 patches, its last 4 padding (zeros, masked)."""
    rows, cols = torch.meshgrid(torch.arange(1, 5), torch.arange(1, 5), indexing="ij")
    positions = torch.stack([rows.flatten(), cols.flatten()], -1).to(dtype)
    pixels = torch.randn(2, 16, vision_cfg.patch_embed_hidden_size, dtype=dtype)
    patches = torch.cat([positions.expand(2, -1, -1), pixels], -1)
    mask = torch.ones(2, 16, dtype=torch.long)
    patches[1, 12:], mask[1, 12:] = 0, 0
    return {"flattened_patches": patches, "attention_mask": mask}


# Models that count an image-start and an image-end token around each image's tokens (Ovis 2.5
# raises without them; GLM-4V's processor writes them too, but its model does not ask).
BRACKETED_IMAGES = {"ovis2_5"}


def _cross_attention_image_text_inputs(model, dtype: torch.dtype) -> dict:
    """Mllama's layout: an image token, then text that cross-attends to the image's tiles (one
    tile of the model's maximum, aspect ratio 1:1)."""
    cfg = model.config
    side, tiles = _first(cfg.vision_config.image_size), cfg.vision_config.max_num_tiles
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(1, 32, (2, 11), generator=gen)
    ids = torch.cat([torch.full((2, 1), cfg.image_token_index), text], 1)
    one_tile = torch.zeros(2, 1, tiles, dtype=torch.long)
    one_tile[..., 0] = 1
    labels = ids.masked_fill(ids >= 32, -100)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "pixel_values": torch.randn(2, 1, tiles, 3, side, side, dtype=dtype),
            "aspect_ratio_ids": torch.ones(2, 1, dtype=torch.long), "aspect_ratio_mask": one_tile,
            "cross_attention_mask": one_tile[:, None].expand(2, ids.shape[1], 1, tiles).contiguous(),
            "use_cache": False}


def _inputs(task: str, dtype: torch.dtype = torch.float64) -> dict:
    """One batch with labels, so the model computes its own loss."""
    if task in ("image-cls", "video-cls"):  # video-cls: `batch` puts the clips in (_pixels)
        return {"pixel_values": torch.randn(2, 3, 32, 32, dtype=dtype), "labels": torch.tensor([0, 2])}
    ids = torch.randint(1, 64, (2, 12))
    if task == "seq-cls":  # one of SMALL_EXTRA's 3 labels per sequence; each sequence ends with eos (= pad,
        ids[:, -1] = 0     # token 0): BART-like heads pool at the eos, decoder-only ones at the token before the pad
        return {"input_ids": ids, "labels": torch.tensor([0, 2])}
    if task == "token-cls":  # a label per token, some -100 (not scored) as a tokenizer leaves sub-words
        labels = torch.randint(0, 3, (2, 12))
        labels[0, :3], labels[1, 7] = -100, -100
        return {"input_ids": ids, "labels": labels}
    if task == "multiple-choice":  # 3 choices per example, each a sequence ending with eos; the right one's index
        ids = torch.randint(1, 64, (2, 3, 12))
        ids[..., -1] = 0
        return {"input_ids": ids, "labels": torch.tensor([2, 0])}
    if task == "qa":  # answer spans; 30 lies past the sequence: clamped to 12, the losses' ignore_index
        return {"input_ids": ids, "start_positions": torch.tensor([1, 30]), "end_positions": torch.tensor([4, 9])}
    kwargs = {"input_ids": ids, "labels": ids}
    if task in ("causal-lm", "seq2seq"):
        kwargs["use_cache"] = False
    return kwargs


def batch(model, task: str, dtype: torch.dtype = torch.float64) -> dict:
    """The batch the sweep feeds a model of a task, floating inputs in `dtype`; raises where the
    harness has none for the model (status "inputs")."""
    if task in AUDIO_TASKS:
        return _audio_inputs(model, task, dtype)
    if task == "image-text":
        return _image_text_inputs(model, dtype)
    if task == "base":
        return _base_inputs(model, dtype)
    kwargs = _inputs(task, dtype)
    model_type = getattr(model.config, "model_type", "")
    if model_type == "bros":  # boxes are required: two corners a token, as fractions of the page
        corner = torch.rand(*kwargs["input_ids"].shape, 2, dtype=dtype) / 2
        kwargs["bbox"] = torch.cat([corner, corner + torch.rand_like(corner) / 2], dim=-1)
    if model_type == "longformer" and task in ("qa", "multiple-choice"):
        # these heads put global attention on the question: the tokens before the first of exactly
        # three separators a sequence (question, two, context, one)
        ids, sep = kwargs["input_ids"], model.config.sep_token_id
        ids[ids == sep] = 1 if sep != 1 else 3
        ids[..., 3], ids[..., 4], ids[..., -1] = sep, sep, sep
    codebooks = getattr(model.config, "num_codebooks", None)
    if task == "causal-lm" and isinstance(codebooks, int) and "audio_channels" in model.config:
        # MusicGen's decoder: a sequence of codes per codebook, its rows (batch * codebooks), its labels
        # (batch, sequence, codebooks)
        ids = torch.randint(1, 64, (2, codebooks, 12))
        kwargs.update(input_ids=ids.flatten(0, 1), labels=ids.transpose(1, 2))
    if task == "video-cls" or task == "image-cls" and "spatial_shapes" in inspect.signature(model.forward).parameters:
        kwargs.update(_pixels(model, dtype))  # clips, or SigLIP 2's patches, for the image
    return kwargs


def _inductor_alone(model, loss_of, leaves: list, loss0, grads0, floor: float,
                    err: tuple[float, float], failed: tuple[bool, bool]) -> dict:
    """--via inductor, a MISMATCH: plain torch.compile (Inductor, no trifuse) against the same
    unfused step. Inductor's kernels need not round as eager does (a float32 downcast in a float64
    model, its own RNG for a model's random draws); where plain Inductor differs by at least half
    as much in what failed (`err`: the fused loss's and gradients' errors, `failed` which of them
    is over its tolerance), the row says so. `loss_of(m)`: the training step's loss through `m`."""
    torch._dynamo.reset()
    try:
        loss = loss_of(torch.compile(model))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    except Exception as e:  # noqa: BLE001
        return {"inductor_alone": f"{type(e).__name__}: {str(e).strip()[:100]}"}
    loss_err = abs(float(loss) - float(loss0)) / max(abs(float(loss0)), 1e-30)
    alone = (loss_err, _grad_error(grads0, grads, floor))
    out = {"inductor_alone": {"loss_rel_err": alone[0], "grad_rel_err": alone[1]}}
    if all(a >= e / 2 for a, e, f in zip(alone, err, failed) if f):
        out["why"] = ("plain torch.compile (Inductor, no trifuse) differs from eager as much: "
                      f"loss {alone[0]:.2g}, grad {alone[1]:.2g}")
    return out


def _inductor_alone_mixed(model, loss_of, leaves: list, autocast, losses: tuple[float, float],
                          grads0: tuple, grads64: tuple, floor: float, loss_tol: float, slack: float,
                          fused: tuple[float, float]) -> dict:
    """--via inductor under autocast, a MISMATCH: plain torch.compile (Inductor, no trifuse) held to
    the same oracle rule as the fused model (`losses`: the unfused and the float64 loss; `fused`:
    the fused model's loss excess and gradient excess over the rule). Where plain Inductor breaks
    it too, on the loss where the fused loss broke it and by at least half the fused excess on the
    gradients where those broke it, the row says so: Inductor's CPU code under bf16 rounds
    elsewhere than eager does (RegNet: the fused loss 23% off the unfused one)."""
    torch._dynamo.reset()
    try:
        with autocast:
            loss = loss_of(torch.compile(model))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    except Exception as e:  # noqa: BLE001
        return {"inductor_alone": f"{type(e).__name__}: {str(e).strip()[:100]}"}
    finally:
        torch._dynamo.reset()
    l0, l64, loss = *losses, float(loss.detach())
    alone = (abs(loss - l64) - 2 * abs(l0 - l64) - loss_tol * abs(l64),
             _oracle_error(grads0, grads, grads64, floor, slack))
    out = {"inductor_alone": {"loss_excess": alone[0], "oracle_excess": alone[1]}}
    if all(a > 0 and a >= f / 2 for a, f in zip(alone, fused) if f > 0):
        out["why"] = ("plain torch.compile (Inductor, no trifuse) breaks the same rule: loss "
                      f"{abs(loss - l64) / max(abs(l64), 1e-30):.2g} off float64 (unfused "
                      f"{abs(l0 - l64) / max(abs(l64), 1e-30):.2g}), gradients' excess {alone[1]:.2g}")
    return out


def _dynamo_fails(model, loss_of, autocast, backend: str = "eager") -> bool:
    """Whether torch.compile with Dynamo's own backend, or Inductor (no trifuse), fails on the model too
    (`loss_of(m)`: the training step's loss through `m`)."""
    torch._dynamo.reset()
    try:
        with autocast:
            loss_of(torch.compile(model, backend=backend)).backward()
    except Exception:  # noqa: BLE001
        return True
    return False


def crash_row(e: Exception, model, loss_of, autocast, via: str) -> dict:
    """The row of a fused step that raised `e` (in an except block: its traceback kept): "FUSED
    CRASH", or "Dynamo fails" / "Inductor fails" where torch.compile without trifuse fails on the
    unfused `model` too (`loss_of(m)`: the training step's loss through `m`)."""
    crash = {"status": "FUSED CRASH", "why": f"{type(e).__name__}: {str(e).strip()[:300]}",
             "traceback": traceback.format_exc()[-3000:]}
    if via in COMPILE_BACKENDS and _dynamo_fails(model, loss_of, autocast):
        crash["status"] = "Dynamo fails"
    elif via == "inductor" and _dynamo_fails(model, loss_of, autocast, backend="inductor"):
        crash["status"] = "Inductor fails"
    return crash


PACKED_LENGTHS = (5, 4, 3)


def _packed_inputs() -> dict:
    """One row of three sequences as transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    lays it out: position ids restarting at 0, each sequence's first label -100, the offsets."""
    ids = torch.randint(1, 64, (1, sum(PACKED_LENGTHS)))
    labels = ids.clone()
    starts = torch.tensor([0, *PACKED_LENGTHS]).cumsum(0)
    labels[0, starts[:-1]] = -100
    cu = starts.to(torch.int32)
    longest = max(PACKED_LENGTHS)
    positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest, "use_cache": False}


def _hf_attention_row(model, other, kwargs: dict, loss0, grads0, floor: float, loss_tol: float,
                      grad_tol: float) -> dict:
    """The model with attn_implementation="trifuse" against itself with SDPA (or eager), on the
    sweep's batch and on a packed one (_packed_inputs): the loss and every gradient. The row says
    how many calls ran varlen (trifuse.ops.attention recognizing transformers' block-diagonal
    mask) and whether the model keeps packed sequences apart at all (its logits those of each
    sequence run alone: transformers builds the packed mask only where a model hands its mask
    code the position ids). `other`: a copy of the model taken before its training step."""
    import trifuse.hf
    from trifuse.kernels import attention_varlen as varlen_mod

    trifuse.hf.register()
    other.train()
    try:
        other.set_attn_implementation("trifuse")
    except Exception as e:  # noqa: BLE001
        return {"status": "no interface", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    leaves1 = [p for p in other.parameters() if p.requires_grad]
    calls = []
    launcher = varlen_mod.attention_varlen_fwd
    varlen_mod.attention_varlen_fwd = lambda *a, **k: calls.append(1) or launcher(*a, **k)
    fallbacks = dict(trifuse.hf.FALLBACKS)
    try:
        loss1 = other(**kwargs).loss
        grads1 = torch.autograd.grad(loss1, leaves1, allow_unused=True)
    except Exception as e:  # noqa: BLE001
        if "does not run with SDPA in transformers" in str(e):  # hf.py's refusal, by design
            return {"status": "refused", "why": str(e).strip()[:200]}
        return {"status": "FUSED CRASH", "why": f"{type(e).__name__}: {str(e).strip()[:300]}",
                "traceback": traceback.format_exc()[-3000:]}
    loss0, loss1 = float(loss0.detach()), float(loss1.detach())
    loss_err = abs(loss1 - loss0) / max(abs(loss0), 1e-30)
    grad_err = _grad_error(grads0, grads1, floor)
    ok = loss_err < loss_tol and grad_err < grad_tol
    row = {"attn": "trifuse", "loss_rel_err": loss_err, "grad_rel_err": grad_err}
    packed = _packed_inputs()
    leaves = [p for p in model.parameters() if p.requires_grad]
    notes = []
    try:
        out0 = model(**packed)
        gp0 = torch.autograd.grad(out0.loss, leaves, allow_unused=True)
        starts = [0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()]
        with torch.no_grad():
            alone = torch.cat([model(input_ids=packed["input_ids"][:, a:b], use_cache=False).logits
                               for a, b in zip(starts[:-1], starts[1:])], 1)
    except Exception as e:  # noqa: BLE001
        notes.append(f"packed batch: the unfused model fails ({type(e).__name__})")
    else:
        n_calls = len(calls)
        try:
            out1 = other(**packed)
            gp1 = torch.autograd.grad(out1.loss, leaves1, allow_unused=True)
        except Exception as e:  # noqa: BLE001
            return {"status": "FUSED CRASH", "why": f"packed: {type(e).__name__}: {str(e).strip()[:300]}",
                    "traceback": traceback.format_exc()[-3000:]}
        l0, l1 = float(out0.loss.detach()), float(out1.loss.detach())
        p_loss = abs(l1 - l0) / max(abs(l0), 1e-30)
        p_grad = _grad_error(gp0, gp1, floor)
        row.update(packed_loss_rel_err=p_loss, packed_grad_rel_err=p_grad)
        ok = ok and p_loss < loss_tol and p_grad < grad_tol
        logits = out0.logits.detach()
        apart = float((logits - alone).abs().max()) <= 1e-6 * max(float(alone.abs().max()), 1e-30)
        row["replaced"] = {"attention_varlen": len(calls) - n_calls}
        kept = "sequences kept apart" if apart else "the model lets packed sequences see each other"
        ran = len(calls) - n_calls
        notes.append(f"packed: loss {p_loss:.2g}, grads {p_grad:.2g}; {ran} varlen calls; {kept}")
    new = {k: v - fallbacks.get(k, 0) for k, v in trifuse.hf.FALLBACKS.items() if v != fallbacks.get(k, 0)}
    if new:
        notes.append("fell back: " + "; ".join(f"{k} ({v})" for k, v in new.items()))
    row["why"] = "; ".join(notes)
    row["status"] = "ok" if ok else "MISMATCH"
    return row


def _first_difference(ref, out) -> str:
    """Where two greedy generations part: the step, the row, the two tokens and how far apart the
    unfused model's scores put them (a near tie lets either rounding pick either token)."""
    new0, new1 = (o.sequences[:, -len(o.scores):] for o in (ref, out))
    step = int((new0 != new1).any(0).nonzero()[0])
    row = int((new0[:, step] != new1[:, step]).nonzero()[0])
    a, b = int(new0[row, step]), int(new1[row, step])
    scores = ref.scores[step][row]
    finite = scores[torch.isfinite(scores)]
    gap = float(scores[a] - scores[b]) / float(finite.abs().max().clamp_min(1e-30)) if finite.numel() else float("nan")
    return f"step {step}, row {row}: tokens {a} and {b}, the unfused scores {gap:.2g} apart (relative)"


def _generate_row(model, ref, kwargs: dict, task: str, tol: float) -> dict:
    """Greedy generation, fused against unfused: `generate` with and without the KV cache, after
    one training step of the fused model (as a model evaluated during training is: its blocks hold
    their training captures, and eval and no_grad capture anew). The prompt is the first 6 tokens of
    each sequence (causal LM) or the whole batch (seq2seq: the encoder's input). The tokens must be
    equal and each step's scores within `tol` of the unfused ones (relative to their largest finite
    entry). The row counts the blocks' calls that ran unfused, and why (a KV cache: by design)."""
    import trifuse

    prompt = kwargs["input_ids"][:, :6] if task == "causal-lm" else kwargs["input_ids"]
    gen = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": GENERATE_TOKENS,
           "min_new_tokens": GENERATE_TOKENS, "do_sample": False, "num_beams": 1, "pad_token_id": 0,
           "output_scores": True, "return_dict_in_generate": True}
    ref.eval()
    refs, notes = {}, []
    for cache in (True, False):
        try:
            refs[cache] = ref.generate(prompt, use_cache=cache, **gen)
        except Exception as e:  # noqa: BLE001
            notes.append(f"use_cache={cache}: the unfused model fails ({type(e).__name__}: {str(e).strip()[:100]})")
    if not refs:
        return {"status": "unfused fails", "why": "; ".join(notes)}
    try:
        fused = trifuse.fuse(model)
        _loss(_seeded(fused)(**kwargs), task).backward()
        fused.eval()
        outs = {cache: fused.generate(prompt, use_cache=cache, **gen) for cache in refs}
    except Exception as e:  # noqa: BLE001
        return {"status": "FUSED CRASH", "why": f"{type(e).__name__}: {str(e).strip()[:300]}",
                "traceback": traceback.format_exc()[-3000:]}
    ok, err, referenced = True, 0.0, 0
    for cache, out in outs.items():
        r = refs[cache]
        # From a step where a row of the unfused scores holds no finite entry (T5Gemma's decoder start
        # token is its pad token: a row masked whole, whose float64 mask turns -inf when its eager
        # attention casts to fp32), the unfused model has no answer to compare with.
        valid = next((i for i, s0 in enumerate(r.scores) if not torch.isfinite(s0).any(-1).all()), len(r.scores))
        if valid < len(r.scores):
            notes.append(f"use_cache={cache}: the unfused scores hold a row with no finite entry from step "
                         f"{valid} on; compared before it")
        referenced += valid > 0
        new0, new1 = (o.sequences[:, -len(o.scores):][:, :valid] for o in (r, out))
        if not torch.equal(new0, new1) or r.sequences.shape != out.sequences.shape:
            ok = False
            notes.append(f"use_cache={cache}: the tokens differ at {_first_difference(r, out)}")
            continue
        for s0, s1 in zip(r.scores[:valid], out.scores[:valid]):
            finite = torch.isfinite(s0)
            if not torch.equal(finite, torch.isfinite(s1)):
                ok = False
                notes.append(f"use_cache={cache}: the scores are non-finite in other places")
                break
            err = max(err, float((s1 - s0)[finite].abs().max()) / float(s0[finite].abs().max().clamp_min(1e-30)))
    if not referenced:
        return {"status": "unfused NaN", "why": "; ".join(notes)}
    ok = ok and err < tol
    report = trifuse.report(fused)
    return {"status": "ok" if ok else "MISMATCH", "scores_rel_err": err, "why": "; ".join(notes),
            "replaced": dict(sorted(report.counts().items())), "left": len(report.left()),
            "unfused_calls": {k: dict(v) for k, v in report.unfused_calls().items()}}


CHECKPOINT_DROPOUT = 0.1


def _trifuse_forwards(prof) -> int | None:
    """How many trifuse forward ops a profiled step ran (their backward ops not counted); None
    where the profiler's events do not fit in memory (Qwen4-exp's per-token recurrences)."""
    try:
        return sum(1 for e in prof.events() if e.name.startswith("trifuse::") and "backward" not in e.name)
    except MemoryError:
        return None


def _checkpoint_row(model, kwargs: dict, task: str) -> dict:
    """--via checkpoint: `model` fused beside two fused copies under gradient checkpointing."""
    import trifuse

    if not getattr(model, "supports_gradient_checkpointing", False):
        why = f"{type(model).__name__}.supports_gradient_checkpointing is False"
        return {"status": "no checkpointing", "why": why}
    copies = {}
    try:
        for mode in ("non-reentrant", "reentrant"):
            copies[mode] = copy.deepcopy(model)
            copies[mode].gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    except Exception as e:  # noqa: BLE001
        why = f"gradient_checkpointing_enable: {type(e).__name__}: {str(e)[:150]}"
        return {"status": "unfused fails", "why": why}
    models = {"plain": model, **copies}
    leaves = {name: [p for p in m.parameters() if p.requires_grad] for name, m in models.items()}
    unfused = {}  # each model's own training step, unfused: a model that fails here is not trifuse's to
    try:  # judge, and one whose checkpointed copies differ unfused differs fused too
        for name, m in models.items():
            torch.manual_seed(1)
            _loss(m(**kwargs), task).backward()
            unfused[name] = tuple(None if p.grad is None else p.grad.clone() for p in leaves[name])
            m.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001
        return {"status": "unfused fails", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    unfused_err = {mode: _grad_error(unfused["plain"], unfused[mode], 1e-10) for mode in copies}

    def step(name: str, seed: int, profiled: bool = True):
        # .backward(), not autograd.grad: a reentrant checkpoint refuses the latter
        torch.manual_seed(seed)
        models[name].zero_grad(set_to_none=True)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with prof if profiled else contextlib.nullcontext():
            loss = _loss(models[name](**kwargs), task)
            loss.backward()
        return loss.detach(), tuple(p.grad for p in leaves[name]), _trifuse_forwards(prof) if profiled else 0

    try:
        for m in models.values():
            trifuse.fuse(m).train()
        for name in models:
            step(name, 0, profiled=False)  # the captures (a checkpointed block's first call may run unfused)
        loss_err = grad_err = 0.0
        recomputed = {}
        for seed in (1,):
            loss0, grads0, ops0 = step("plain", seed)
            for mode in copies:
                loss1, grads1, ops1 = step(mode, seed)
                err = abs(float(loss1) - float(loss0)) / max(abs(float(loss0)), 1e-30)
                loss_err = max(loss_err, 0.0 if math.isnan(err) and math.isnan(float(loss0)) else err)
                grad_err = max(grad_err, _grad_error(grads0, grads1, 1e-10))
                recomputed[mode] = None if ops0 is None or ops1 is None else ops1 - ops0
    except Exception as e:  # noqa: BLE001
        return {"status": "FUSED CRASH", "why": f"{type(e).__name__}: {str(e).strip()[:300]}",
                "traceback": traceback.format_exc()[-3000:]}
    report = trifuse.report(models["reentrant"])
    replaced = dict(sorted(trifuse.report(model).counts().items()))
    fewer = {}
    for mode, m in copies.items():
        counts = trifuse.report(m).counts()
        changed = {family: f"{n} -> {counts.get(family, 0)}" for family, n in replaced.items()
                   if counts.get(family, 0) != n}
        if changed:
            fewer[mode] = changed
    ok = loss_err < 1e-9 and grad_err < 1e-9
    status = "ok" if ok else "MISMATCH"
    counted = [n for n in recomputed.values() if n is not None]
    recomputed_why = None
    if ok and replaced and counted and min(counted) <= 0:
        status = "RECOMPUTE UNFUSED"
        # unless the checkpointed layers run as written anyway (Dynamo cannot capture Longformer's):
        # then nothing fused is there to recompute
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in models["reentrant"].modules() if isinstance(m, GradientCheckpointingLayer)]
        as_written = {id(m) for u in report.units if getattr(u.unit, "failed", None) for m in u.modules}
        if layers and all(id(m) in as_written for m in layers):
            status = "ok"
            recomputed_why = ("its checkpointed layers run as written (TorchDynamo cannot capture them): "
                              "nothing fused to recompute")
    if fewer and not ok:  # other ops fused, other dropout draws: the comparison says nothing
        status = "FEWER FUSED"
    row = {"status": status, "loss_rel_err": loss_err, "grad_rel_err": grad_err, "replaced": replaced,
           "left": len(report.left()), "recomputed_ops": recomputed,
           "unfused_calls": {k: sum(v.values()) for k, v in report.unfused_calls().items()}}
    if status == "RECOMPUTE UNFUSED":
        row["why"] = f"trifuse forward ops run again in the backward: {recomputed}"
    elif recomputed_why:
        row["why"] = recomputed_why
    if len(counted) < len(recomputed):
        row["why"] = "the recompute's ops not counted: the profiler's events did not fit in memory"
    as_much = {mode: e for mode, e in unfused_err.items() if status == "MISMATCH" and e >= grad_err / 2}
    if as_much:  # a model whose gradients checkpointing changes as written (a tensor its layers share
        # outside their arguments, which a reentrant checkpoint's backward does not reach)
        row["why"] = "the unfused model differs as much under checkpointing: " + ", ".join(
            f"{mode} grads {e:.2g}" for mode, e in as_much.items())
    if fewer:
        row["why"] = "under checkpointing: " + "; ".join(
            f"{mode} {', '.join(f'{k} {v}' for k, v in d.items())}" for mode, d in fewer.items())
    return row


def run_one(model_type: str, attn: str = "sdpa", task: str = "causal-lm", via: str = "fuse",
            dtype: str = "float64") -> dict:
    import transformers as tf
    import trifuse

    tf.logging.set_verbosity_error()
    try:
        cfg = _config(tf, model_type, attn, task)
        if via == "checkpoint":  # the masks are what a recompute can get wrong: dropout on
            for name in NO_DROPOUT:
                if _has(cfg, name) and "jitter" not in name and not _read_only(type(cfg), name):
                    try:
                        setattr(cfg, name, CHECKPOINT_DROPOUT)
                    except Exception:  # noqa: BLE001, S110  (its validation refuses a float there: CvT's
                        pass  # drop_path_rate is per stage, LeViT's an int; that one stays off)
    except Exception as e:  # noqa: BLE001
        return {"status": "config", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    torch.manual_seed(0)
    auto = _auto_class(tf, task)
    names = auto._model_mapping._model_mapping.get(model_type)
    if isinstance(names, (tuple, list)) and not getattr(cfg, "architectures", None):
        cfg.architectures = [names[0]]  # several classes for the task (DeiT's with and without teacher): the first
    refused = []  # under checkpointing, the dropout rates a model refuses above 0 (DiffLlama's attention's)
    while True:
        try:
            model = _from_config(auto, cfg)
            model = model.double() if dtype == "float64" else model.float()
            break
        except Exception as e:  # noqa: BLE001
            if attn == "sdpa" and "does not support an attention implementation" in str(e):
                return run_one(model_type, "eager", task, via, dtype)
            names = [n for n in NO_DROPOUT if via == "checkpoint" and n not in refused
                     and re.search(rf"\b{n} *>", str(e)) and _attribute(cfg, n)]
            if not names:
                return {"status": "build", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
            for name in names:
                setattr(cfg, name, 0.0)
            refused += names
    for module in model.modules():  # a head's dropout its config has no field for (a token classifier's
        if isinstance(module, torch.nn.Dropout):  # falls back to 0.1): off like the rest
            module.p = CHECKPOINT_DROPOUT if via == "checkpoint" else 0.0
    params = sum(p.numel() for p in model.parameters())
    if params > MAX_PARAMS:
        return {"status": "too big", "why": f"{params} parameters with the tiny config"}
    input_dtype = torch.float64 if dtype == "float64" else torch.float32
    try:
        kwargs = batch(model, task, input_dtype)
    except Exception as e:  # noqa: BLE001
        return {"status": "inputs", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    if via == "checkpoint":
        row = _checkpoint_row(model, kwargs, task)
        if refused:
            note = f"{', '.join(refused)} 0 (the model refuses more)"
            row["why"] = f"{row['why']}; {note}" if row.get("why") else note
        return row
    leaves = [p for p in model.parameters() if p.requires_grad]

    def loss_of(m: torch.nn.Module) -> torch.Tensor:  # the step's loss through m (the explanations')
        return _loss(_seeded(m)(**kwargs), task)

    # Copies taken before the training step (after it a model may hold non-leaf tensors deepcopy
    # refuses: RecurrentGemma's recurrent state): generate's reference, the model hf-attention
    # switches to trifuse, the float64 oracle of an autocast sweep.
    ref = copy.deepcopy(model) if via in ("generate", "hf-attention") else None
    model64 = copy.deepcopy(model).double().train() if dtype != "float64" else None
    unfused = copy.deepcopy(model).train() if dtype != "float64" else None  # for _ill_conditioned
    model.train()
    # fp16- / bf16-autocast: the model in fp32 under CPU autocast, as a user trains in mixed precision
    autocast = torch.autocast("cpu", dtype=AUTOCAST_DTYPES.get(dtype, torch.float16),
                              enabled=dtype in AUTOCAST_DTYPES)
    loss_tol, grad_tol, floor = TOLERANCES[dtype]
    try:
        with autocast:
            loss0 = _loss(_seeded(model)(**kwargs), task)
        grads0 = torch.autograd.grad(loss0, leaves, allow_unused=True)
        if model64 is not None:  # the oracle: the same model and batch in float64
            inputs64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                        for k, v in kwargs.items()}
            loss64 = _loss(_seeded(model64)(**inputs64), task)
            grads64 = torch.autograd.grad(loss64, [p for p in model64.parameters() if p.requires_grad],
                                          allow_unused=True)
            del model64
    except Exception as e:  # noqa: BLE001
        return {"status": "unfused fails", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    if via == "hf-attention":
        return _hf_attention_row(model, ref, kwargs, loss0, grads0, floor, loss_tol, grad_tol)
    if via == "generate":
        return _generate_row(model, ref, kwargs, task, loss_tol)
    try:
        fused = trifuse.fuse(model) if via == "fuse" else torch.compile(model, backend=COMPILE_BACKENDS[via])
        with autocast:
            loss1 = _loss(_seeded(fused)(**kwargs), task)
        grads1 = torch.autograd.grad(loss1, leaves, allow_unused=True)
        with autocast:
            loss2 = _loss(_seeded(fused)(**kwargs), task).detach()
    except Exception as e:  # noqa: BLE001
        return crash_row(e, model, loss_of, autocast, via)
    # NaN against NaN agrees, as the gradients are compared by place (a model whose own loss is NaN)
    loss_err = 0.0 if float(loss0) != float(loss0) and float(loss1) != float(loss1) else \
        abs(float(loss1) - float(loss0)) / max(abs(float(loss0)), 1e-30)
    grad_err = _grad_error(grads0, grads1, floor)
    report = trifuse.report(fused)
    if dtype == "float64":
        ok = loss_err < loss_tol and grad_err < grad_tol
    else:
        l0, l1, l64 = float(loss0), float(loss1), float(loss64)
        excess = _oracle_error(grads0, grads1, grads64, floor, grad_tol)
        ok = abs(l1 - l64) <= 2 * abs(l0 - l64) + loss_tol * abs(l64) and excess <= 0
        if l0 != l0 or l64 != l64:
            # A NaN loss of the model's own (fp16, or its float64 copy): no oracle. Fused against
            # unfused, NaN for NaN by place; each rounds to fp16 in its own places, which the oracle's
            # 2x-plus-slack allows for and a direct comparison must too: 10x the slack (~20 fp16 ulps).
            ok = loss_err < loss_tol and grad_err < 10 * grad_tol
    again, first = float(loss2), float(loss1.detach())
    ok = ok and (again == first or again != again and first != first)
    row = {"status": "ok" if ok else "MISMATCH", "attn": attn, "loss_rel_err": loss_err, "grad_rel_err": grad_err,
            "replaced": dict(sorted(report.counts().items())), "left": len(report.left()),
            "unfused_calls": {k: sum(v.values()) for k, v in report.unfused_calls().items()}}
    if dtype != "float64":
        row["oracle_excess"] = excess
        loss_excess = abs(l1 - l64) - 2 * abs(l0 - l64) - loss_tol * abs(l64)
        whys = []
        if not ok and excess > 0 and loss_excess <= 0 and again == first:
            whys.append(_ill_conditioned(unfused, loss_of, autocast, grads0, grads1, grads64, floor,
                                         grad_tol))
        if not ok and via == "inductor" and (excess > 0 or loss_excess > 0):
            trainable = [p for p in unfused.parameters() if p.requires_grad]
            alone = _inductor_alone_mixed(unfused, loss_of, trainable, autocast,
                                          (l0, l64), grads0, grads64, floor, loss_tol, grad_tol,
                                          (loss_excess, excess))
            whys.append(alone.pop("why", ""))
            row.update(alone)
        if not any(whys):
            trainable = [n for n, p in unfused.named_parameters() if p.requires_grad]
            whys.append(past_the_rule(trainable, grads0, grads1, grads64, floor, grad_tol))
        if any(whys):
            row["why"] = "; ".join(w for w in whys if w)
    if via == "inductor" and not ok and dtype == "float64":
        failed = (loss_err >= loss_tol, grad_err >= grad_tol)
        row.update(_inductor_alone(model, loss_of, leaves, loss0, grads0, floor, (loss_err, grad_err),
                                   failed))
    if _non_finite(grads0):
        row["why"] = f"the unfused model's gradients hold {_non_finite(grads0)} NaN/inf entries (compared by place)"
    if dtype != "float64" and (float(loss0) != float(loss0) or float(loss64) != float(loss64)):
        row["why"] = (f"the model's own loss is NaN ({dtype.split('-')[0]} {float(loss0):.4g}, its float64 "
                      f"copy {float(loss64):.4g}): no oracle; fused against unfused by place, NaN for NaN")
    return row


def _child(model_type: str, task: str = "causal-lm", via: str = "fuse", dtype: str = "float64",
           timeout: int = 300, threads: int | None = None, attn: str = "sdpa") -> dict:
    """One type in its own process. `threads`: its intra-op threads (OMP_NUM_THREADS), one per child
    when several run at once: two children each spinning as many OpenMP threads as there are cores
    took 40x longer on Qwen 3.5's many small ops (its recurrence), timing out. --via checkpoint
    trains three models, each recomputing its blocks, with dropout in the interpreted kernels:
    three times the time (Swin's windowed attention, a minute a step)."""
    timeout = timeout * 3 if via in ("checkpoint", "inductor") else timeout  # Inductor: C++ compiles
    args = [f"--one={model_type}", f"--task={task}", f"--via={via}", f"--dtype={dtype}", f"--attn={attn}"]
    return child_row(__file__, args, model_type, timeout, threads, memory_gib=8)


def child_row(script: str, args: list[str], name: str, timeout: int, threads: int | None, memory_gib: int,
              env: dict | None = None) -> dict:
    """A sweep's row for `name`, computed by `python script *args` in a child process (address space
    capped at memory_gib, killed after timeout seconds, `threads` intra-op threads): the last JSON
    line it prints, else why it died; with the row's name and wall time."""
    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (memory_gib << 30, memory_gib << 30))

    t0 = time.time()
    env = dict(os.environ, **(env or {}), **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    try:
        done = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True, text=True,
                              timeout=timeout, preexec_fn=cap_memory, check=False, env=env)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"status": f"died (rc {done.returncode})",
                                                    "why": done.stderr.strip().splitlines()[-1:][0][:150]
                                                    if done.stderr.strip() else ""}
    except subprocess.TimeoutExpired:
        row = {"status": "timeout"}
    return {"type": name, **row, "s": round(time.time() - t0, 1)}


def _markdown(rows: list[dict], header: str, task: str = "causal-lm", dtype: str = "float64") -> str:
    from collections import Counter

    counts = Counter(r["status"] for r in rows)
    out = [f"# fuse sweep ({task})\n\n{header}\n", "| status | types |", "|---|---|"]
    out += [f"| {s} | {n} |" for s, n in counts.most_common()]
    errors = "scores rel err | " if any("scores_rel_err" in r for r in rows) else "loss rel err | max grad rel err"
    out += ["", f"| type | status | replaced | left as written | {errors} | why |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        replaced = ", ".join(f"{k} {v}" for k, v in r.get("replaced", {}).items())
        err = (f"{r['loss_rel_err']:.2g}", f"{r['grad_rel_err']:.2g}") if "loss_rel_err" in r else \
            (f"{r['scores_rel_err']:.2g}", "") if "scores_rel_err" in r else ("", "")
        why = r.get("why", "").replace("|", "/").replace("\n", " ")
        # (an error message: its start; the sweep's own verdicts whole)
        why = why if why.startswith(("ill-conditioned", "plain torch.compile")) else why[:120]
        explained = EXPLAINED.get((task, dtype, r["type"]), "") if r["status"] == "MISMATCH" else ""
        why = "; ".join(w for w in (why, explained) if w)
        out.append(f"| {r['type']} | {r['status']} | {replaced} | {r.get('left', '')} | {err[0]} | {err[1]} | {why} |")
    return "\n".join(out) + "\n"


def save_rows(stem: str, rows: list[dict], header: str, markdown, partial: bool) -> None:
    """Writes bench/results/<stem>.json and .md (`markdown(rows, header)`). A partial rerun (rows for
    named models only) replaces those rows and keeps the others, and the sweep's header, which then
    says which rows are newer."""
    path = os.path.join(RESULTS, f"{stem}.json")
    if partial and os.path.exists(path):
        with open(path) as f:
            swept = json.load(f)
        fields = header.split(" · ")  # the date, then the versions up to python's
        versions = ", ".join(f for f in fields[1:] if not f.startswith(("python", "CPU")))
        header = f"{swept['header']} · rerun {fields[0][len('date '):]} ({versions}): " \
            f"{', '.join(r['type'] for r in rows)}"
        rows = [*(r for r in swept["rows"] if r["type"] not in {row["type"] for row in rows}), *rows]
    rows = sorted(rows, key=lambda r: r["type"])
    with open(path, "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
        f.write(markdown(rows, header))


def run_rows(names: list[str], child, jobs: int) -> list[dict]:
    """`child(name, threads)` for each name, `jobs` at a time (each a child process: the pool's
    threads only wait on them, each child gets its share of the cores), printing each row as it
    comes; the rows in the order of `names`."""
    from concurrent.futures import ThreadPoolExecutor

    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None
    rows = []
    with ThreadPoolExecutor(jobs) as pool:
        for row in pool.map(lambda name: child(name, threads), names):
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            if "traceback" in row:
                print(row["traceback"], flush=True)
    return rows


# transformers' auto mapping of each task's architectures. "base" sweeps the models without a
# head (AutoModel) of the types no other task reaches: detection, segmentation, depth, speech
# synthesis, backbones, time series, the towers of composite models.
TASK_MAPPINGS = {"causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
                 "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                 "image-cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                 "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                 "token-cls": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
                 "qa": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
                 "multiple-choice": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
                 "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
                 "audio-cls": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
                 "video-cls": "MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES",
                 "image-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                 "base": "MODEL_MAPPING_NAMES"}


def task_types(modeling_auto, task: str) -> list[str]:
    """The model types a task sweeps by default."""
    types = set(getattr(modeling_auto, TASK_MAPPINGS[task]))
    if task == "base":
        for other in TASKS:
            if other != "base":
                types -= set(getattr(modeling_auto, TASK_MAPPINGS[other]))
    return sorted(types)


def main(types: list[str], task: str = "causal-lm", via: str = "fuse", dtype: str = "float64", jobs: int = 1,
         attn: str = "sdpa") -> None:
    import platform

    import transformers as tf
    import triton
    from transformers.models.auto import modeling_auto

    stem = "fuse_sweep" + ("" if task == "causal-lm" else f"_{task}") + ("" if via == "fuse" else f"_{via}") \
        + ("" if attn == "sdpa" else f"_{attn}") + ("" if dtype == "float64" else f"_{dtype}")
    path = os.path.join(RESULTS, f"{stem}.json")
    # Named types replace their rows in the results; the others stay as last swept.
    kept = {}
    outside = sorted(set(types) - set(task_types(modeling_auto, task)))
    if outside:  # no such head: a row of "build" would only grow the table
        print(f"fuse_sweep: {task} has no model for {', '.join(outside)} ({TASK_MAPPINGS[task]}); not swept",
              file=sys.stderr)
        types = [t for t in types if t not in outside]
        if not types:
            return
    if types and os.path.exists(path):
        with open(path) as f:
            kept = {r["type"]: r for r in json.load(f)["rows"]}
    types = types or task_types(modeling_auto, task)
    rows = run_rows(types, lambda mt, threads: _child(mt, task, via, dtype, threads=threads, attn=attn), jobs)
    header = (f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · torch {torch.__version__} · triton "
              f"{triton.__version__} · transformers {tf.__version__} · python {platform.python_version()} · CPU "
              f"(TRITON_INTERPRET=1), {dtype}, "
              + (f"dropout {CHECKPOINT_DROPOUT}" if via == "checkpoint" else "one training step, dropout off")
              + f", task {task}, via {via}"
              + ("" if attn == "sdpa" else f", {attn} attention"))
    if kept:  # a partial rerun: the sweep's header stays, earlier reruns too, and says which rows are newer
        with open(path) as f:
            swept = json.load(f)["header"]
        rerun = header.split(" · ")[0][len("date "):]
        versions = f"torch {torch.__version__}, triton {triton.__version__}, transformers {tf.__version__}"
        header = f"{swept} · rerun {rerun} ({versions}): {', '.join(types)}"
    rows = sorted({**kept, **{r["type"]: r for r in rows}}.values(), key=lambda r: r["type"])
    os.makedirs(RESULTS, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
        f.write(_markdown(rows, header, task, dtype))


def test_fuse_sweep_smoke():
    """One architecture end to end through the child process (`pytest bench/fuse_sweep.py`; not
    in CI's default collection, which takes bench_*.py)."""
    row = _child("llama")
    assert row["status"] == "ok", row
    assert row["replaced"].get("attention") == 2 and row["replaced"].get("rms_norm") == 3


if __name__ == "__main__":
    args = sys.argv[1:]
    opts = {"task": "causal-lm", "via": "fuse", "dtype": "float64", "jobs": "1", "attn": "sdpa"}
    for name in opts:
        for a in list(args):
            if a.startswith(f"--{name}="):
                opts[name] = a.split("=", 1)[1]
                args.remove(a)
        if f"--{name}" in args:
            i = args.index(f"--{name}")
            opts[name] = args[i + 1]
            del args[i:i + 2]
    unknown = [a for a in args if a.startswith("-") and not a.startswith("--one=")]
    if unknown:
        sys.exit(f"fuse_sweep: unknown option {unknown[0]!r}\n{__doc__}")
    if opts["task"] not in TASKS:
        sys.exit(f"fuse_sweep: --task must be one of {', '.join(TASKS)}, got {opts['task']!r}")
    if opts["via"] not in VIAS:
        sys.exit(f"fuse_sweep: --via must be one of {', '.join(VIAS)}, got {opts['via']!r}")
    if opts["dtype"] not in TOLERANCES:
        sys.exit(f"fuse_sweep: --dtype must be one of {', '.join(TOLERANCES)}, got {opts['dtype']!r}")
    if opts["via"] == "hf-attention" and (opts["task"], opts["dtype"]) != ("causal-lm", "float64"):
        sys.exit("fuse_sweep: --via hf-attention sweeps causal LMs in float64")
    if opts["via"] == "checkpoint" and opts["dtype"] != "float64":
        sys.exit("fuse_sweep: --via checkpoint sweeps in float64")
    if opts["via"] == "generate" and (opts["task"] not in ("causal-lm", "seq2seq") or opts["dtype"] != "float64"):
        sys.exit("fuse_sweep: --via generate sweeps causal and seq2seq LMs in float64")
    if opts["attn"] not in ("sdpa", "eager"):
        sys.exit(f"fuse_sweep: --attn must be sdpa or eager, got {opts['attn']!r}")
    if args and args[0].startswith("--one="):
        row = run_one(args[0][len("--one="):], attn=opts["attn"], task=opts["task"], via=opts["via"],
                      dtype=opts["dtype"])
        print(json.dumps(row), flush=True)
    else:
        main(args, opts["task"], opts["via"], opts["dtype"], int(opts["jobs"]), opts["attn"])
