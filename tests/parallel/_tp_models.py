"""Tiny Hugging Face models built from configs (no downloads), identical on every rank."""

import torch

from tolerances import check_close

VOCAB = 64


class TorchTransformerLM(torch.nn.Module):
    """A language model as PyTorch users write one, on nn.MultiheadAttention: an embedding, layers
    of torch.nn, a linear head; returns the loss.

    torch_encoder      nn.TransformerEncoder, pre-norm, batch first, GeLU, a final norm; a causal
                       mask (is_causal) and a key padding mask
    torch_seq_first    nn.TransformerEncoder, post-norm, sequence first (so sequence parallelism
                       splits the batch), ReLU; a key padding mask
    torch_transformer  nn.Transformer (encoder-decoder: cross-attention on the encoder's output),
                       batch first; causal target mask, padding on the memory
    """

    def __init__(self, kind: str, heads: int, dropout: float):
        super().__init__()
        nn, width = torch.nn, 8 * heads
        self.kind, self.embed, self.head = kind, nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        if kind == "torch_transformer":
            self.body = nn.Transformer(width, heads, 2, 2, 64, dropout, batch_first=True)
            return
        first = kind == "torch_encoder"
        activation = "gelu" if first else "relu"
        layer = nn.TransformerEncoderLayer(
            width, heads, 64, dropout, activation=activation, batch_first=first, norm_first=first
        )
        norm = nn.LayerNorm(width) if first else None
        self.body = nn.TransformerEncoder(layer, 2, norm=norm, enable_nested_tensor=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        b, s = input_ids.shape
        pad = torch.zeros(b, s, dtype=torch.bool)
        pad[0, -2:] = True  # the first sequence's last two tokens are padding
        causal = torch.nn.Transformer.generate_square_subsequent_mask(s, dtype=x.dtype)
        if self.kind == "torch_encoder":
            h = self.body(x, mask=causal, src_key_padding_mask=pad, is_causal=True)
        elif self.kind == "torch_seq_first":
            h = self.body(x.transpose(0, 1), src_key_padding_mask=pad).transpose(0, 1)
        else:
            h = self.body(x, x.flip(1), tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class SiglipPooled(torch.nn.Module):
    """SigLIP's vision tower with its pooling head (a learned probe attending to the patches
    through an nn.MultiheadAttention, then an MLP); the loss is the pooled output's mean square."""

    def __init__(self, config):
        super().__init__()
        import transformers

        self.vision = transformers.SiglipVisionModel(config)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.vision(pixel_values=pixel_values).pooler_output.square().mean()


class MultiheadOptions(torch.nn.Module):
    """nn.MultiheadAttention called directly, with the options its layers never use: an
    ALiBi-like additive mask per head (3-D, batch x heads rows), add_zero_attn, the attention
    weights returned per head and averaged (both in the loss), a sequence-first cross-attention
    with key padding, and an unbatched call. Blocks in no nn.ModuleList: tensor parallelism only."""

    def __init__(self, heads: int, dropout: float):
        super().__init__()
        nn, width = torch.nn, 8 * heads
        self.heads, self.embed, self.head = heads, nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.attn = nn.MultiheadAttention(width, heads, dropout, batch_first=True, add_zero_attn=True)
        self.cross = nn.MultiheadAttention(width, heads, dropout, bias=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        b, s = input_ids.shape
        distance = (torch.arange(s)[:, None] - torch.arange(s)[None, :]).abs().to(x.dtype)
        slopes = 2.0 ** -torch.arange(1, self.heads + 1, dtype=x.dtype)
        alibi = (-slopes[:, None, None] * distance).repeat(b, 1, 1)  # (b * heads, s, s)
        y, per_head = self.attn(x, x, x, attn_mask=alibi, average_attn_weights=False)
        h = self.norm(x + y)
        memory = x.flip(1).transpose(0, 1)
        pad = torch.zeros(b, s, dtype=torch.bool)
        pad[1, :3] = True
        z, averaged = self.cross(h.transpose(0, 1), memory, memory, key_padding_mask=pad)
        alone, _ = self.attn(h[0], h[0], h[0], need_weights=False)  # (s, width): no batch dim
        out = h + z.transpose(0, 1) + alone
        loss = torch.nn.functional.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())
        return loss + per_head.square().mean() + averaged.square().mean()


# Models with DeepSeek's multi-head latent attention.
LATENT = ("deepseek_v3", "deepseek_v2", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "minicpm3")


def build(kind: str, *, dropout: float = 0.0, heads: int = 4, dtype=torch.float64, seed: int = 0, **extra):
    """GPT-2 (LM head, Conv1D projections, fused c_attn), BERT (MLM head, nn.Linear Q/K/V),
    nanoGPT (tests/_models.py: nn.Linear fused c_attn, head count `n_head`, width read from the
    input), Llama (q/k/v/o_proj, `heads` query and heads / 2 key/value heads, gated MLP, RMSNorm)
    ViT (q/k/v/o_proj, fc1/fc2; 3 x 3 patches + CLS = 10 tokens, divisible for SP), or Gemma 3 and
    OLMo 2 (Llama's shape with Q/K norms in the attention core), or Gemma 2 (sandwich norms)."""
    import transformers

    torch.manual_seed(seed)
    # The shape every model here shares: 2 blocks of `heads` heads of 8, an MLP 64 wide.
    base = dict(hidden_size=8 * heads, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=64)
    if kind in ("torch_encoder", "torch_seq_first", "torch_transformer"):
        return TorchTransformerLM(kind, heads, dropout).to(dtype)
    if kind == "torch_mha_options":
        return MultiheadOptions(heads, dropout).to(dtype)
    if kind == "nanogpt":
        import _models

        model = _models.NanoGPT(flash=extra.pop("flash", True), dropout=dropout)
        model.transformer.h = torch.nn.ModuleList(
            [_models.Block(_models.HIDDEN, heads, dropout, model.block_size, True) for _ in range(2)]
        )
        return model.to(dtype)
    moe = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "glm4_moe", "ernie4_5_moe", "dots1", "gpt_oss")
    if kind in (*moe, *LATENT):
        # mixtures of 4 experts, 2 per token, each 16 wide
        common = dict(
            **{**base, "intermediate_size": 16},
            num_key_value_heads=heads // 2,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            attention_dropout=dropout,
            num_experts_per_tok=2,
            # Hugging Face's loop unless told (its default, grouped_mm, takes float64 through a fallback)
            experts_implementation=extra.pop("experts_implementation", "eager"),
        )
        if kind == "qwen3_moe":
            config = transformers.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=16, head_dim=8, **extra)
            return transformers.Qwen3MoeForCausalLM(config).to(dtype)
        if kind == "mixtral":
            config = transformers.MixtralConfig(**common, num_local_experts=4, **extra)
            return transformers.MixtralForCausalLM(config).to(dtype)
        if kind == "qwen2_moe":  # a shared expert 24 wide beside the routed ones, scaled by a sigmoid gate
            config = transformers.Qwen2MoeConfig(
                **common, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, **extra
            )
            return transformers.Qwen2MoeForCausalLM(config).to(dtype)
        if kind == "glm4_moe":  # DeepSeek's shape: a dense first layer, then shared experts (2 x 16 wide)
            config = transformers.Glm4MoeConfig(
                **common, n_routed_experts=4, moe_intermediate_size=16, n_shared_experts=2,
                first_k_dense_replace=1, n_group=1, topk_group=1, **extra,
            )
            return transformers.Glm4MoeForCausalLM(config).to(dtype)
        if kind == "dots1":  # DeepSeek's shape too, with Q/K norms per head
            config = transformers.Dots1Config(
                **common, n_routed_experts=4, moe_intermediate_size=16, n_shared_experts=1,
                first_k_dense_replace=0, n_group=1, topk_group=1, **extra,
            )
            return transformers.Dots1ForCausalLM(config).to(dtype)
        if kind in LATENT:
            # Multi-head latent attention: Q from a 16-wide latent (V2-Lite: from the hidden
            # states), K and V from a 12-wide one, one 4-wide rotary key shared by all heads, heads
            # of 8 + 4 (Q, K) and 6 (V); then a dense layer and an MoE with a shared expert
            # (MiniCPM3: dense only). DeepSeek V3.2 and GLM-5 add a sparse-attention indexer
            # keeping 5 keys per query.
            mla = dict(
                q_lora_rank=None if kind == "deepseek_v2" else 16, kv_lora_rank=12, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, moe_intermediate_size=16,
                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            )
            if kind in ("deepseek_v32", "glm_moe_dsa"):
                mla.update(index_topk=5, index_n_heads=2, index_head_dim=8)
            config = transformers.CONFIG_MAPPING[kind](**{**common, "num_key_value_heads": heads, **mla, **extra})
            return transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        if kind == "gpt_oss":
            # Attention sinks (a logit per head), biases on every projection, sliding-window layers
            # (4 keys) alternating with full ones; experts with gate and up interleaved, transposed,
            # with biases, and a clamped gating of their own; a router with a bias.
            config = transformers.GptOssConfig(
                **common, num_local_experts=4, head_dim=8, sliding_window=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **extra,
            )
            model = transformers.GptOssForCausalLM(config).to(dtype)
            # Hugging Face initializes the experts' biases to zero: give them values, so that a
            # bias counted on every rank instead of once shows in the loss.
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for layer in model.model.layers:
                    for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                        bias.copy_(0.1 * torch.randn(bias.shape, generator=gen, dtype=dtype))
            return model
        if kind == "ernie4_5_moe":  # a shared expert; the router holds a (frozen) score bias of its own
            config = transformers.Ernie4_5_MoeConfig(
                **common, moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1,
                moe_layer_start_index=0, **extra,
            )
            return transformers.Ernie4_5_MoeForCausalLM(config).to(dtype)
        config = transformers.OlmoeConfig(**common, num_experts=4, pad_token_id=1, eos_token_id=0, **extra)
        return transformers.OlmoeForCausalLM(config).to(dtype)
    if kind in ("llama", "gemma2", "gemma3", "olmo2", "phi3", "nemotron", "apertus"):
        # Decoders of Llama's shape. Gemma 2 adds sandwich norms (a norm after each sublayer,
        # added to the residual stream); Gemma 3 and OLMo 2 Q/K norms inside the attention core,
        # Gemma 3's per head (over head_dim), OLMo 2's over all heads' features (so under tensor
        # parallelism a row spans every rank).
        common = dict(
            **base,
            num_key_value_heads=extra.pop("kv_heads", heads // 2),
            vocab_size=VOCAB,
            max_position_embeddings=32,
            attention_dropout=dropout,
        )
        if kind == "llama":
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, **extra)).to(dtype)
        if kind == "apertus":  # xIELU (two trainable coefficients) after an unbiased up_proj; Q/K norms
            return transformers.ApertusForCausalLM(transformers.ApertusConfig(**common, **extra)).to(dtype)
        if kind == "nemotron":  # the squared ReLU after an unbiased up_proj; LayerNorm1P (w + 1)
            return transformers.NemotronForCausalLM(transformers.NemotronConfig(**common, **extra)).to(dtype)
        if kind == "phi3":  # fused qkv_proj [Q | K | V] with fewer K/V heads, fused gate_up_proj
            config = transformers.Phi3Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
            return transformers.Phi3ForCausalLM(config).to(dtype)
        if kind == "gemma2":  # sandwich norms: post-norms added to the residual stream
            config = transformers.Gemma2Config(head_dim=8, **common, **extra)
            return transformers.Gemma2ForCausalLM(config).to(dtype)
        if kind == "gemma3":
            config = transformers.Gemma3TextConfig(head_dim=8, **common, **extra)
            return transformers.Gemma3ForCausalLM(config).to(dtype)
        config = transformers.Olmo2Config(**common, **extra)
        return transformers.Olmo2ForCausalLM(config).to(dtype)
    if kind == "opt":  # q/k/v_proj + out_proj; fc1/fc2 beside them in the decoder layer, on flattened tokens
        config = transformers.OPTConfig(
            hidden_size=8 * heads,
            num_hidden_layers=2,
            num_attention_heads=heads,
            ffn_dim=64,
            vocab_size=VOCAB,
            word_embed_proj_dim=8 * heads,
            max_position_embeddings=32,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=0,
            dropout=dropout,
            attention_dropout=dropout,
            **extra,
        )
        return transformers.OPTForCausalLM(config).to(dtype)
    if kind in ("bart", "whisper"):
        # Encoder-decoders: post-norm (BART) or pre-norm (Whisper) blocks, cross-attention on the
        # encoder's output; Whisper's encoder behind a convolutional front end (8 frames from 16).
        common = dict(
            d_model=8 * heads,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=heads,
            decoder_attention_heads=heads,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            vocab_size=VOCAB,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            dropout=dropout,
            attention_dropout=dropout,
            activation_dropout=dropout,
        )
        if kind == "bart":
            config = transformers.BartConfig(max_position_embeddings=32, forced_eos_token_id=None, **common, **extra)
            return transformers.BartForConditionalGeneration(config).to(dtype)
        config = transformers.WhisperConfig(
            num_mel_bins=4,
            max_source_positions=8,
            max_target_positions=32,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            **common,
            **extra,
        )
        return transformers.WhisperForConditionalGeneration(config).to(dtype)
    if kind == "bloom":  # fused query_key_value per head; ALiBi built for all heads outside the attention
        config = transformers.BloomConfig(
            hidden_size=8 * heads,
            n_layer=2,
            n_head=heads,
            vocab_size=VOCAB,
            attention_dropout=dropout,
            hidden_dropout=dropout,
            **extra,
        )
        return transformers.BloomForCausalLM(config).to(dtype)
    if kind == "neox":  # fused query_key_value laid out per head, parallel residual, partial rotary
        config = transformers.GPTNeoXConfig(
            **base,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            attention_dropout=dropout,
            hidden_dropout=dropout,
            **extra,
        )
        return transformers.GPTNeoXForCausalLM(config).to(dtype)
    if kind in ("vit", "clip", "siglip"):  # 3 x 3 patches + CLS = 10 tokens, divisible for SP
        common = dict(
            **base,
            image_size=24,
            patch_size=8,
        )
        if kind == "vit":
            config = transformers.ViTConfig(
                num_labels=3,
                hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout,
                **common,
                **extra,
            )
            return transformers.ViTForImageClassification(config).to(dtype)
        if kind == "siglip":  # 3 x 3 patches, no CLS; the pooling head outside the stack
            return SiglipPooled(transformers.SiglipVisionConfig(attention_dropout=dropout, **common, **extra)).to(dtype)
        # CLIP's vision tower: q/k/v_proj + out_proj, an MLP module fc1/fc2
        vision = transformers.CLIPVisionConfig(attention_dropout=dropout, **common, **extra)
        config = transformers.CLIPConfig(
            vision_config=vision.to_dict(), text_config={"hidden_size": 8 * heads}, num_labels=3
        )
        return transformers.CLIPForImageClassification(config).to(dtype)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=8 * heads,
            n_layer=2,
            n_head=heads,
            n_positions=32,
            vocab_size=VOCAB,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            **extra,
        )
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "bert":
        config = transformers.BertConfig(
            **base,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            **extra,
        )
        model = transformers.BertForMaskedLM(config)
    else:
        raise ValueError(kind)
    return model.to(dtype)


def batch(kind: str, step: int = 0, *, b: int = 2, s: int = 8) -> dict:
    """Inputs and labels, the same on every rank (a seeded generator, not the global stream)."""
    gen = torch.Generator().manual_seed(100 + step)
    if kind in ("vit", "clip", "siglip"):
        pixels = torch.randn(b, 3, 24, 24, generator=gen, dtype=torch.float64)
        return {"pixel_values": pixels, "labels": torch.randint(0, 3, (b,), generator=gen)}
    ids = torch.randint(0, VOCAB, (b, s), generator=gen)
    if kind == "whisper":
        features = torch.randn(b, 4, 16, generator=gen, dtype=torch.float64)
        return {"input_features": features, "labels": ids, "use_cache": False}
    if kind == "nanogpt":
        return {"idx": ids, "targets": ids}
    out = {"input_ids": ids, "labels": ids}
    if kind in ("gpt2", "llama", "gemma2", "gemma3", "olmo2", "phi3", "nemotron", "apertus", "opt", "bart", "neox",
                "bloom",
                "qwen3_moe",
                "mixtral", "olmoe", "qwen2_moe", "glm4_moe", "ernie4_5_moe", "dots1", "gpt_oss", *LATENT):
        out["use_cache"] = False
    return out


def loss_of(output) -> torch.Tensor:
    """Hugging Face outputs carry .loss; nanoGPT returns the loss itself."""
    return output if isinstance(output, torch.Tensor) else output.loss


def compare_full(tag, model, ref, failures, grads, *, fp32=False):
    """Appends to `failures` every parameter (grads=True: gradient) of `model`, gathered whole,
    that is not `ref`'s to float64 rounding (tests/tolerances.py); returns how many it checked.
    With `fp32`, model's values are cast to float32 first and compared at float32's rule."""
    from trifuse.parallel import gather_full

    got, want = gather_full(model, grads=grads), gather_full(ref, grads=grads)
    if got.keys() != want.keys():
        failures.append(f"{tag}: keys differ: {sorted(got.keys() ^ want.keys())}")
        return 0
    for k in want:
        ok, msg = check_close(f"{tag} {k}", got[k].float() if fp32 else got[k], want[k], None)
        if not ok:
            failures.append(msg)
    return len(want)


def train_alongside(kind, model, ref, steps, *, fp32=False, optimizer=torch.optim.AdamW):
    """(failures, checks) for `steps` optimizer steps (AdamW unless told) of `model` and `ref` on
    the same batches: the loss, every gradient and every weight after the step compared
    (`compare_full`)."""
    opt = optimizer(model.parameters(), lr=1e-2)
    ref_opt = optimizer(ref.parameters(), lr=1e-2)
    failures, checks = [], 0
    for step in range(steps):
        loss = loss_of(model(**batch(kind, step)))
        ref_loss = loss_of(ref(**batch(kind, step)))
        loss.backward()
        ref_loss.backward()
        ok, msg = check_close(f"step {step} loss", loss, ref_loss, None)
        failures += [] if ok else [msg]
        checks += 1 + compare_full(f"step {step} grad", model, ref, failures, True, fp32=fp32)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        checks += compare_full(f"after step {step}", model, ref, failures, False, fp32=fp32)
    return failures, checks
