"""diffusers' denoisers built from tiny configs (no download), for bench/fuse_sweep_diffusers.py:
BUILDERS maps a name to a function returning (model, call, inputs[, train]), `call(model, *inputs)`
the training call (its output's `.sample`, or its first entry, the prediction). The models that
tests/fusion/test_fuse_diffusers.py checks come from there; the rest are built here, each as small
as its config allows (two heads of 16, one or two blocks of each kind, 8 x 8 latents, a few text
tokens). Weights that are zero at init and would make a part trivial (modulations, gates, output
layers) are drawn; inputs are tensors only (sizes and flags are constants of `call`)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "fusion")]

import diffusers
import test_fuse_diffusers as _tested

B, HEADS, HEAD_DIM = 2, 2, 16


def _from_tests(build):
    def builder():
        denoiser, inputs, train = build()
        return denoiser, lambda m, *x: m(*x), inputs, train

    return builder


# ---------------------------------------------------------------------------------------------
# Image models: the Flux family and other MMDiTs
# ---------------------------------------------------------------------------------------------


def _grid_ids(h, w, axes=3, offset=0):
    """(h*w, axes) integer positions: axis 0 (frame/index) = offset, then row and column (any further axes 0)."""
    ids = torch.zeros(h, w, axes, dtype=torch.long)
    ids[..., 0] = offset
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, axes)


def flux3():
    # FLUX.3: per-mode blocks (text, image, reference image: each self-attends within itself) then
    # joint single blocks over the concatenation, both parallel attention + SwiGLU from one
    # modulated LayerNorm (per-token modulation), fp32 RMSNorm q/k norms; 4-axis real rotary
    model = diffusers.Flux3Transformer2DModel(
        in_channels=16,
        cond_in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=24,
        timestep_channels=16,
        mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4),
    )

    def call(m, x, t, text, img_ids, txt_ids, cond, cond_ids):
        return m(
            x,
            encoder_hidden_states=text,
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
            image_cond_hidden_states=cond,
            image_cond_ids=cond_ids,
        )

    txt_ids = torch.zeros(7, 4, dtype=torch.long)
    txt_ids[:, 3] = torch.arange(7)
    inputs = (
        torch.randn(B, 64, 16),
        torch.tensor([0.1, 0.5]),
        torch.randn(B, 7, 24),
        _grid_ids(8, 8, 4),
        txt_ids,
        torch.randn(B, 16, 16),
        _grid_ids(4, 4, 4, offset=1),
    )
    return model, call, inputs


def bria():
    # Bria 3.x: Flux's joint and single blocks (AdaLayerNormZero, GELU-tanh MLPs, RMSNorm q/k,
    # BFL's real rotary over the joint sequence) without pooled or guidance embeddings
    model = diffusers.BriaTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=24,
        axes_dims_rope=[4, 6, 6],
    )

    def call(m, x, t, text, img_ids, txt_ids):
        return m(x, encoder_hidden_states=text, timestep=t, img_ids=img_ids, txt_ids=txt_ids)

    inputs = (
        torch.randn(B, 64, 16),
        torch.tensor([1, 5]),
        torch.randn(B, 7, 24),
        _grid_ids(8, 8).float(),
        torch.zeros(7, 3),
    )
    return model, call, inputs


def bria_fibo():
    # Bria FIBO: Bria's (Flux's) joint and single blocks; each block's text stream is half the
    # running context and half a projection of its own text-encoder layer; a bool key-padding mask
    model = diffusers.BriaFiboTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=24,
        axes_dims_rope=[4, 6, 6],
        text_encoder_dim=20,
    )

    def call(m, x, t, text, layers, img_ids, txt_ids, mask):
        return m(
            x,
            encoder_hidden_states=text,
            text_encoder_layers=list(layers.unbind(0)),
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
            joint_attention_kwargs={"attention_mask": mask[:, None, None, :]},
        )

    mask = torch.ones(B, 7 + 64, dtype=torch.bool)  # the pipeline's: text padding, then the image tokens
    mask[1, 5:7] = False
    inputs = (
        torch.randn(B, 64, 16),
        torch.tensor([1, 5]),
        torch.randn(B, 7, 24),
        torch.randn(2, B, 7, 20),
        _grid_ids(8, 8).float(),
        torch.zeros(7, 3),
        mask,
    )
    return model, call, inputs


def bria_fibo2():
    # Bria FIBO 2: Z-Image's single-stream blocks (RMSNorm sandwich norms scaled per token, tanh
    # gates, SwiGLU, complex rotary) over gist + image tokens, injection blocks with a tanh-gated
    # cross-attention to the text, a Perceiver resampler making the gist tokens (masked when padded)
    model = diffusers.BriaFibo2Transformer2DModel(
        in_channels=4,
        patch_size=2,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=HEADS,
        cap_feat_dim=24,
        injection_layer_ids=(1,),
        perceiver_num_layers=1,
        min_num_gist_tokens=4,
        max_num_gist_tokens=8,
        gist_step=2,
        gist_min_text_len=2,
        gist_max_text_len=7,
        axes_dims=(4, 6, 6),
        axes_lens=(16, 8, 8),
    )
    with torch.no_grad():  # zero at init: the injection block's cross-attention would vanish
        for block in model.layers:
            if block.cross_attention is not None:
                block.cross_attn_gate.normal_()

    def call(m, x, t, text, text_mask):
        return m(x, timestep=t, encoder_hidden_states=text, encoder_attention_mask=text_mask)

    text_mask = torch.ones(B, 7, dtype=torch.bool)
    text_mask[1, 3:] = False  # 7 and 3 real tokens: 8 and 6 gist tokens, the second prompt's padded
    inputs = (torch.randn(B, 4, 8, 8), torch.tensor([0.1, 0.5]), torch.randn(B, 2, 7, 24), text_mask)
    return model, call, inputs


def krea2():
    # Krea 2: single-stream blocks over [text, image]: zero-centred RMSNorm (`1 + weight`, of an fp32
    # copy) modulated by a shared vector plus a per-block table, grouped-query attention (kv heads
    # repeated) with a sigmoid output gate, SwiGLU; a text-fusion stack (pre-norm blocks across the
    # tapped-layer axis, a linear over it, then across tokens, text key-padding mask)
    model = diffusers.Krea2Transformer2DModel(
        in_channels=16,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=1,
        intermediate_size=64,
        timestep_embed_dim=16,
        text_hidden_dim=32,
        num_text_layers=3,
        text_num_attention_heads=HEADS,
        text_num_key_value_heads=HEADS,
        text_intermediate_size=48,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6),
    )
    with torch.no_grad():  # zero at init (the norms' `1 + weight`, the modulation tables): drawn small
        for name, p in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight")) or "scale_shift_table" in name:
                p.normal_(0, 0.1)

    def call(m, x, text, t, position_ids, text_mask):
        return m(
            x,
            encoder_hidden_states=text,
            timestep=t,
            position_ids=position_ids,
            encoder_attention_mask=text_mask,
        )

    position_ids = torch.cat([torch.zeros(7, 3, dtype=torch.long), _grid_ids(8, 8)])
    text_mask = torch.ones(B, 7, dtype=torch.bool)
    text_mask[1, 5:] = False
    inputs = (
        torch.randn(B, 64, 16),
        torch.randn(B, 7, 3, 32),
        torch.tensor([0.1, 0.5]),
        position_ids,
        text_mask,
    )
    return model, call, inputs


def longcat_image():
    # LongCat-Image: Flux's joint and single blocks (AdaLayerNormZero, GELU-tanh MLPs, RMSNorm q/k,
    # BFL's real rotary over the joint sequence), no pooled or guidance embedding
    model = diffusers.LongCatImageTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=24,
        pooled_projection_dim=24,
        axes_dims_rope=[4, 6, 6],
    )

    def call(m, x, t, text, img_ids, txt_ids):
        return m(x, encoder_hidden_states=text, timestep=t, img_ids=img_ids, txt_ids=txt_ids)

    txt_ids = torch.zeros(7, 3)  # the pipeline's: modality 0, the token index on both axes
    txt_ids[:, 1] = txt_ids[:, 2] = torch.arange(7.0)
    img_ids = (_grid_ids(8, 8, offset=1) + torch.tensor([0, 7, 7])).float()
    inputs = (torch.randn(B, 64, 16), torch.tensor([0.1, 0.5]), torch.randn(B, 7, 24), img_ids, txt_ids)
    return model, call, inputs


def ovis_image():
    # Ovis-Image: Flux's joint and single blocks with SwiGLU MLPs (diffusers' "swiglu" FeedForward in
    # the joint blocks; the single block's proj_mlp split into value and SiLU gate), an RMSNorm on
    # the text features before the context embedder
    model = diffusers.OvisImageTransformer2DModel(
        patch_size=1,
        in_channels=16,
        out_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=24,
        axes_dims_rope=(4, 6, 6),
    )

    def call(m, x, t, text, img_ids, txt_ids):
        return m(x, encoder_hidden_states=text, timestep=t, img_ids=img_ids, txt_ids=txt_ids)

    txt_ids = torch.zeros(7, 3)  # the pipeline's: the token index on the two spatial axes
    txt_ids[:, 1] = txt_ids[:, 2] = torch.arange(7.0)
    inputs = (
        torch.randn(B, 64, 16),
        torch.tensor([0.1, 0.5]),
        torch.randn(B, 7, 24),
        _grid_ids(8, 8).float(),
        txt_ids,
    )
    return model, call, inputs


def qwenimage21():
    # Qwen-Image 2.1: single-stream blocks over [text, image] (LayerNorm times `1 + scale` and a tanh
    # gate, per token: text rows modulated from t = 0; SwiGLU; RMSNorm q/k; complex rotary),
    # block-causal attention run as one SDPA per text segment (causal triangle) plus one for the
    # image; a zero-centred RMSNorm (written out in fp32) on the text input
    model = diffusers.QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        context_in_dim=24,
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
    )
    with torch.no_grad():  # zero at init: the text norm's `weight + 1`
        model.txt_in.text_norm.weight.normal_(0, 0.1)

    def call(m, x, text, t, text_mask, img_mask):
        out = m(
            x,
            encoder_hidden_states=text,
            timestep=t,
            encoder_hidden_states_mask=text_mask,
            img_shapes=[[(1, 8, 8)]] * B,
            img_mask=img_mask,
        )
        return SimpleNamespace(sample=out.sample[:, -x.shape[1] :])  # the pipeline's: the target image's rows

    text_mask = torch.ones(B, 7, dtype=torch.bool)
    text_mask[1, 5:] = False  # right-padded prompt
    img_mask = torch.cat(
        [torch.zeros(B, 7, dtype=torch.bool), torch.ones(B, 16, dtype=torch.bool)], 1
    )  # 2x2 slots
    inputs = (torch.randn(B, 64, 16), torch.randn(B, 7, 24), torch.tensor([0.1, 0.5]), text_mask, img_mask)
    return model, call, inputs


def auraflow():
    # AuraFlow: SD3-like joint (MMDiT) blocks then single DiT blocks over [registers, text, image]:
    # fp32 LayerNorms (AdaLayerNormZero "fp32_layer_norm", FP32LayerNorm q/k norms), the gated
    # attention add taken *inside* norm2 (`norm2(residual + gate * attn)`), SwiGLU MLPs; no rotary
    model = diffusers.AuraFlowTransformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=1,
        num_single_dit_layers=1,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=24,
        caption_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=16,
    )

    def call(m, x, t, text):
        return m(x, encoder_hidden_states=text, timestep=t)

    inputs = (torch.randn(B, 4, 8, 8), torch.tensor([0.1, 0.5]), torch.randn(B, 7, 24))
    return model, call, inputs


# ---------------------------------------------------------------------------------------------
# Image models (others), audio
# ---------------------------------------------------------------------------------------------


def _draw(*modules):
    # zero-initialised modulations / output layers: drawn, so that the blocks are not trivial
    with torch.no_grad():
        for m in modules:
            m.reset_parameters()


def hunyuandit():
    # HunyuanDiT: a self- and a cross-attention (q/k LayerNorms, the rotary as real pairs on the
    # image tokens), FP32LayerNorms, the first norm shifted per sample (no scale), a GELU MLP; the
    # second half's blocks take a long skip (cat, LayerNorm, linear)
    model = diffusers.HunyuanDiT2DModel(
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=4,
        patch_size=2,
        sample_size=8,
        hidden_size=HEADS * HEAD_DIM,
        num_layers=4,
        mlp_ratio=2.0,
        cross_attention_dim=32,
        cross_attention_dim_t5=24,
        pooled_projection_dim=16,
        text_len=5,
        text_len_t5=6,
        use_style_cond_and_image_meta_size=False,
    )

    def call(m, x, t, text, text_mask, t5, t5_mask, cos, sin):
        return m(
            x,
            t,
            encoder_hidden_states=text,
            text_embedding_mask=text_mask,
            encoder_hidden_states_t5=t5,
            text_embedding_mask_t5=t5_mask,
            image_rotary_emb=(cos, sin),
        )

    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    cos, sin = get_2d_rotary_pos_embed(HEAD_DIM, ((0, 0), (4, 4)), (4, 4), use_real=True)
    inputs = (
        torch.randn(B, 4, 8, 8),
        torch.tensor([1.0, 5.0]),
        torch.randn(B, 5, 32),
        torch.ones(B, 5, dtype=torch.long),
        torch.randn(B, 6, 24),
        torch.ones(B, 6, dtype=torch.long),
        cos.float(),
        sin.float(),
    )
    return model, call, inputs


def hunyuanimage():
    # HunyuanImage 2.1: Flux-like dual-stream and single-stream blocks (q/k RMSNorms, rotary in
    # pairs on the image tokens), a token refiner (self-attention blocks, gated by the timestep)
    model = diffusers.HunyuanImageTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=(1, 1),
        text_embed_dim=24,
        rope_axes_dim=(8, 8),
    )

    def call(m, x, t, text, text_mask):
        return m(x, t, encoder_hidden_states=text, encoder_attention_mask=text_mask)

    inputs = (
        torch.randn(B, 4, 4, 4),
        torch.tensor([1.0, 5.0]),
        torch.randn(B, 7, 24),
        torch.ones(B, 7, dtype=torch.long),
    )
    return model, call, inputs


def cogview3plus():
    # CogView3-Plus: CogVideoX-like joint blocks (image and text modulated apart, one attention over
    # both, q/k LayerNorms, no rotary), GELU MLPs
    model = diffusers.CogView3PlusTransformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        out_channels=4,
        text_embed_dim=24,
        time_embed_dim=16,
        condition_dim=8,
        pos_embed_max_size=8,
        sample_size=8,
    )

    def call(m, x, text, t, original_size, target_size, crop_coords):
        return m(
            x,
            encoder_hidden_states=text,
            timestep=t,
            original_size=original_size,
            target_size=target_size,
            crop_coords=crop_coords,
        )

    sizes = torch.tensor([[64.0, 64.0]] * B)
    inputs = (
        torch.randn(B, 4, 8, 8),
        torch.randn(B, 7, 24),
        torch.tensor([1, 5]),
        sizes,
        sizes.clone(),
        torch.zeros(B, 2),
    )
    return model, call, inputs


def ernieimage():
    # ERNIE-Image: single-stream blocks over image+text in (S, B, H) layout, RMSNorms modulated in
    # an fp32 copy with gated adds, q/k RMSNorms, rotary in halves, a GELU-gated MLP (no SwiGLU);
    # its modulation and output linear are zero at init (drawn here)
    model = diffusers.ErnieImageTransformer2DModel(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_layers=2,
        ffn_hidden_size=64,
        in_channels=4,
        out_channels=4,
        patch_size=1,
        text_in_dim=24,
        rope_axes_dim=(4, 6, 6),
    )
    _draw(model.adaLN_modulation[-1], model.final_linear)

    def call(m, x, t, text, text_lens):
        return m(x, t, text, text_lens)

    inputs = (torch.randn(B, 4, 4, 4), torch.tensor([1.0, 5.0]), torch.randn(B, 7, 24), torch.tensor([7, 5]))
    return model, call, inputs


def glmimage():
    # GLM-Image: CogView4-like joint blocks (text and image modulated apart, one attention, q/k
    # LayerNorms without affine, rotary in halves written into the image slice of q and k), the
    # prior tokens' embedding added to the image tokens
    model = diffusers.GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        text_embed_dim=24,
        time_embed_dim=16,
        condition_dim=8,
        prior_vq_quantizer_codebook_size=16,
    )

    def call(m, x, text, prior_ids, prior_drop, t, target_size, crop_coords):
        return m(x, text, prior_ids, prior_drop, t, target_size, crop_coords)

    inputs = (
        torch.randn(B, 4, 8, 8),
        torch.randn(B, 7, 24),
        torch.randint(0, 16, (B, 16)),
        torch.tensor([False, True]),
        torch.tensor([1.0, 5.0]),
        torch.tensor([[64.0, 64.0]] * B),
        torch.zeros(B, 2),
    )
    return model, call, inputs


def ideogram4():
    # Ideogram 4: single-stream sandwich-norm blocks over packed text+image tokens (RMSNorm times a
    # per-sample scale before attention and MLP, RMSNorm of each output times a tanh gate), q/k
    # RMSNorms, an interleaved M-RoPE applied as rotate-half, a SwiGLU MLP, a segment mask
    model = diffusers.Ideogram4Transformer2DModel(
        in_channels=4,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        intermediate_size=64,
        adaln_dim=16,
        llm_features_dim=24,
        mrope_section=(4, 2, 2),
    )
    n_txt, n_img = 6, 16
    ys, xs = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    img_pos = torch.stack([torch.zeros(16, dtype=torch.long), ys.flatten(), xs.flatten()], -1) + 65536
    txt_pos = torch.arange(n_txt).unsqueeze(-1).expand(-1, 3)
    position_ids = torch.cat([txt_pos, img_pos]).unsqueeze(0).expand(B, -1, -1).contiguous()
    indicator = (
        torch.cat([torch.full((n_txt,), 3), torch.full((n_img,), 2)]).unsqueeze(0).expand(B, -1).contiguous()
    )

    def call(m, x, t, llm, position_ids, segment_ids, indicator):
        return m(x, t, llm, position_ids, segment_ids, indicator)

    inputs = (
        torch.randn(B, n_txt + n_img, 4),
        torch.tensor([0.1, 0.5]),
        torch.randn(B, n_txt + n_img, 24),
        position_ids,
        torch.zeros(B, n_txt + n_img, dtype=torch.long),
        indicator,
    )
    return model, call, inputs


def dreamlite():
    # DreamLite's UNet transformer: BasicTransformerBlock with plain LayerNorms, a self- and a
    # cross-attention with q/k RMSNorms and grouped-query heads (one k/v head), a GEGLU MLP; the
    # UNet installs DreamLiteAttnProcessor2_0 (GQA-aware), as here
    from diffusers.models.attention_processor import Attention
    from diffusers.models.unets.unet_dreamlite import DreamLiteAttnProcessor2_0

    model = diffusers.DreamLiteTransformer2DModel(
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=HEADS * HEAD_DIM,
        num_layers=2,
        norm_num_groups=8,
        cross_attention_dim=24,
        qk_norm="rms_norm",
        num_kv_heads=1,
        ff_mult=2,
    )
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_processor(DreamLiteAttnProcessor2_0())

    def call(m, x, text):
        return m(x, encoder_hidden_states=text)

    return model, call, (torch.randn(B, HEADS * HEAD_DIM, 8, 8), torch.randn(B, 7, 24))


def nucleusmoe():
    # NucleusMoE-Image: single-stream blocks, image queries against image+text keys (text k/v
    # projected per block, q/k RMSNorms, GQA), the norm scaled per sample (no shift), tanh gates,
    # complex rotary; the first block a dense SwiGLU, the second an expert-choice MoE (top-k tokens
    # per expert, a shared SwiGLU expert, per-expert loop after `.tolist()`)
    model = diffusers.NucleusMoEImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=1,
        joint_attention_dim=24,
        axes_dims_rope=(4, 6, 6),
        mlp_ratio=6.0,
        dense_moe_strategy="leave_first_block_dense",
        num_experts=4,
        moe_intermediate_dim=32,
        capacity_factors=1.0,
    )
    with torch.no_grad():  # the experts' packed weights are torch.empty
        for block in model.transformer_blocks:
            if block.moe_enabled:
                block.img_mlp.experts.gate_up_proj.normal_(0, 0.2)
                block.img_mlp.experts.down_proj.normal_(0, 0.2)

    def call(m, x, t, text, text_mask):
        return m(
            x,
            img_shapes=[(1, 4, 4)] * B,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=text_mask,
            timestep=t,
        )

    inputs = (
        torch.randn(B, 16, 16),
        torch.tensor([0.1, 0.5]),
        torch.randn(B, 7, 24),
        torch.ones(B, 7, dtype=torch.long),
    )
    return model, call, inputs


def omnigen():
    # OmniGen: Phi-3-style decoder blocks over text tokens, a time token and the image tokens
    # (RMSNorms, rotary in halves with Su-scaled frequencies, a SwiGLU MLP from one gate_up linear,
    # plain residual adds), an AdaLayerNorm at the output
    model = diffusers.OmniGenTransformer2DModel(
        in_channels=4,
        patch_size=2,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        intermediate_size=64,
        num_layers=2,
        pad_token_id=0,
        vocab_size=32,
        max_position_embeddings=8192,
        original_max_position_embeddings=4096,
        rope_scaling={"short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [2.0] * (HEAD_DIM // 2)},
        pos_embed_max_size=8,
        time_step_dim=16,
    )
    n = 6 + 1 + 16  # text tokens, the time token, the image tokens
    mask = torch.ones(n, n, dtype=torch.long).tril()  # causal over the text, the rest sees all
    mask[6:] = 1

    def call(m, x, t, input_ids, attention_mask, position_ids):  # the 0/1 mask in the model's dtype
        return m(x, t, input_ids, [], {}, attention_mask.to(x.dtype), position_ids)

    inputs = (
        torch.randn(B, 4, 8, 8),
        torch.tensor([0.1, 0.5]),
        torch.randint(1, 32, (B, 6)),
        mask.expand(B, -1, -1).contiguous(),
        torch.arange(n).unsqueeze(0).expand(B, -1).contiguous(),
    )
    return model, call, inputs


def prx():
    # PRX (Photoroom): single-stream blocks, image queries against text+image keys (q/k and text-k
    # RMSNorms, rotary as each pair times a 2x2 matrix), LayerNorms modulated per sample with gated
    # adds, a GELU(tanh)-gated MLP; its modulation is zero at init (drawn here)
    model = diffusers.PRXTransformer2DModel(
        in_channels=4,
        patch_size=2,
        context_in_dim=24,
        hidden_size=HEADS * HEAD_DIM,
        mlp_ratio=2.0,
        num_heads=HEADS,
        depth=2,
        axes_dim=[8, 8],
    )
    _draw(*(block.modulation.lin for block in model.blocks))

    def call(m, x, t, text, text_mask):
        return m(x, t, text, attention_mask=text_mask)

    inputs = (
        torch.randn(B, 4, 8, 8),
        torch.tensor([0.1, 0.5]),
        torch.randn(B, 7, 24),
        torch.ones(B, 7, dtype=torch.long),
    )
    return model, call, inputs


def stableaudio():
    # Stable Audio DiT: pre-norm LayerNorm blocks, self-attention with a partial rotary (half the
    # head, in halves, on an fp32 copy), cross-attention with grouped k/v heads, a SwiGLU MLP
    model = diffusers.StableAudioDiTModel(
        sample_size=16,
        in_channels=8,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_attention_heads=1,
        out_channels=8,
        cross_attention_dim=32,
        time_proj_dim=16,
        global_states_input_dim=12,
        cross_attention_input_dim=24,
    )

    def call(m, x, t, text, global_states, cos, sin):
        return m(
            x, t, encoder_hidden_states=text, global_hidden_states=global_states, rotary_embedding=(cos, sin)
        )

    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    cos, sin = get_1d_rotary_pos_embed(HEAD_DIM // 2, 16 + 1, use_real=True, repeat_interleave_real=False)
    inputs = (
        torch.randn(B, 8, 16),
        torch.tensor([0.1, 0.5]),
        torch.randn(B, 7, 24),
        torch.randn(B, 1, 12),
        cos.float(),
        sin.float(),
    )
    return model, call, inputs


def acestep():
    # ACE-Step 1.5: Qwen3-like blocks, RMSNorms modulated per sample with gated adds (a shared
    # scale-shift table plus the timestep's), q/k RMSNorms, rotary in halves, GQA, a sliding-window
    # layer and a full one, a plain cross-attention, a SwiGLU MLP
    model = diffusers.AceStepTransformer1DModel(
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        in_channels=16,
        audio_acoustic_hidden_dim=8,
        patch_size=2,
        sliding_window=4,
        encoder_hidden_size=24,
    )

    def call(m, x, t, t_r, text, context):
        return m(x, t, t_r, text, context)

    inputs = (
        torch.randn(B, 16, 8),
        torch.tensor([0.3, 0.8]),
        torch.tensor([0.1, 0.5]),
        torch.randn(B, 7, 24),
        torch.randn(B, 16, 8),
    )
    return model, call, inputs


# ---------------------------------------------------------------------------------------------
# Video models: HunyuanVideo, Cosmos, Allegro, Latte, EasyAnimate, ConsisID, Kandinsky
# ---------------------------------------------------------------------------------------------


def _text_mask(n=7, valid=5):
    """(B, n) integer mask: the first sample all valid, the second `valid` tokens then padding."""
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, valid:] = 0
    return mask


def hunyuan_video15():
    # HunyuanVideo 1.5: a token refiner as HunyuanVideo's, then dual-stream blocks only
    # (AdaLayerNormZero, q/k RMSNorm, real cos/sin rotary on image tokens, GELU-tanh MLPs); the three
    # conditions (text, ByT5 glyphs, image) reordered per sample by boolean indexing. Its ByT5
    # projection's 2048-wide hidden layer is fixed (4.2M parameters): swapped for a 32-wide one
    # of the same class
    model = diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=24,
        text_embed_2_dim=20,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
    )
    model.context_embedder_2 = type(model.context_embedder_2)(20, 32, HEADS * HEAD_DIM)

    def call(m, x, t, text, text_mask, glyphs, glyph_mask, image):
        return m(
            x,
            timestep=t,
            encoder_hidden_states=text,
            encoder_attention_mask=text_mask,
            encoder_hidden_states_2=glyphs,
            encoder_attention_mask_2=glyph_mask,
            image_embeds=image,
        )

    inputs = (
        torch.randn(B, 4, 2, 8, 8),
        torch.tensor([1.0, 5.0]),
        torch.randn(B, 7, 24),
        _text_mask(),
        torch.randn(B, 5, 20),
        _text_mask(5, 3),
        torch.randn(B, 3, 16),
    )
    return model, call, inputs


def hunyuan_video_framepack():
    # FramePack: HunyuanVideo's refiner, dual- and single-stream blocks, over the noisy latents
    # packed behind clean history latents patchified at 1x, 2x and 4x (their rotary tables
    # average-pooled to match) and a CLIP-image projection (Linear, SiLU, Linear) prepended to
    # the text
    model = diffusers.HunyuanVideoFramepackTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=2,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=24,
        pooled_projection_dim=12,
        rope_axes_dim=(4, 6, 6),
        has_image_proj=True,
        image_proj_dim=16,
        has_clean_x_embedder=True,
    )

    def call(m, x, t, text, text_mask, pooled, image, guidance, clean, history_2x, history_4x):
        # frame indices: prefix 0, 4x history 1-4, 2x history 5-6, 1x history 7, noisy latents 8-9
        return m(
            x,
            timestep=t,
            encoder_hidden_states=text,
            encoder_attention_mask=text_mask,
            pooled_projections=pooled,
            image_embeds=image,
            indices_latents=torch.arange(8, 10),
            guidance=guidance,
            latents_clean=clean,
            indices_latents_clean=torch.tensor([0, 7]),
            latents_history_2x=history_2x,
            indices_latents_history_2x=torch.arange(5, 7),
            latents_history_4x=history_4x,
            indices_latents_history_4x=torch.arange(1, 5),
        )

    inputs = (
        torch.randn(B, 4, 2, 8, 8),
        torch.tensor([1, 5]),
        torch.randn(B, 7, 24),
        _text_mask(),
        torch.randn(B, 12),
        torch.randn(B, 3, 16),
        torch.tensor([3.5, 4.0]),
        torch.randn(B, 4, 2, 8, 8),
        torch.randn(B, 4, 2, 8, 8),
        torch.randn(B, 4, 4, 8, 8),
    )
    return model, call, inputs


def cosmos():
    # Cosmos: per block self-attention (q/k RMSNorm, real rotary with unbind dim -2), cross-attention
    # to the text, a GELU MLP, each behind a LayerNorm modulated by an adaLN-LoRA (shift, scale, gate)
    # with a gated residual add. No learned position embedding (Cosmos 1's "learnable" takes a
    # vector_norm with dtype=float32, which a float64 twin cannot run; Cosmos Predict2's is None),
    # no concat_padding_mask (it resizes the mask with torchvision)
    model = diffusers.CosmosTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        num_layers=2,
        mlp_ratio=2.0,
        text_embed_dim=24,
        adaln_lora_dim=16,
        max_size=(4, 16, 16),
        patch_size=(1, 2, 2),
        concat_padding_mask=False,
        extra_pos_embed_type=None,
    )

    def call(m, x, t, text, text_mask):
        return m(x, timestep=t, encoder_hidden_states=text, attention_mask=text_mask, fps=24)

    inputs = (
        torch.randn(B, 4, 2, 8, 8),
        torch.tensor([0.1, 0.5]),
        torch.randn(B, 7, 24),
        _text_mask().bool(),
    )
    return model, call, inputs


def _allegro_rope(model, frames, h, w):
    """The pipeline's rotary tables and positions (AllegroPipeline._prepare_rotary_positional_embeddings)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    c = model.config
    freqs_t, freqs_h, freqs_w, grid_t, grid_h, grid_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=c.attention_head_dim,
        crops_coords=((0, 0), (h, w)),
        grid_size=(h, w),
        temporal_size=frames,
        interpolation_scale=(c.interpolation_scale_t, c.interpolation_scale_h, c.interpolation_scale_w),
    )
    pos = torch.cartesian_prod(grid_t.long(), grid_h.long(), grid_w.long())
    pos = pos.reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1).contiguous()
    return (freqs_t, freqs_h, freqs_w), tuple(pos)


def allegro():
    # Allegro: PixArt-style blocks (a LayerNorm modulated from a scale-shift table plus the
    # timestep, gated self-attention with a 3-axis rotary gathered per position by F.embedding
    # on an fp32 copy, an ungated unnormalised cross-attention, a GELU-tanh MLP). Head dim 24: the
    # rotary splits it in three even parts
    model = diffusers.AllegroTransformer3DModel(
        patch_size=2,
        patch_size_t=1,
        num_attention_heads=HEADS,
        attention_head_dim=24,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        cross_attention_dim=HEADS * 24,
        sample_height=8,
        sample_width=8,
        sample_frames=2,
        caption_channels=24,
    )

    def call(m, x, text, t, text_mask):
        return m(
            x,
            encoder_hidden_states=text,
            timestep=t,
            encoder_attention_mask=text_mask,
            image_rotary_emb=_allegro_rope(m, 2, 4, 4),
        )

    inputs = (torch.randn(B, 4, 2, 8, 8), torch.randn(B, 7, 24), torch.tensor([1, 5]), _text_mask())
    return model, call, inputs


def latte():
    # Latte: alternating spatial and temporal BasicTransformerBlocks (ada_norm_single: PixArt's
    # LayerNorm modulated from a scale-shift table, gated adds; self-attention, cross-attention to
    # the text in the spatial ones, GELU-tanh MLP), a sin-cos temporal position table added once
    model = diffusers.LatteTransformer3DModel(
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=4,
        out_channels=8,
        num_layers=1,
        cross_attention_dim=HEADS * HEAD_DIM,
        attention_bias=True,
        sample_size=8,
        patch_size=2,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        caption_channels=24,
        video_length=2,
    )

    def call(m, x, t, text):
        return m(x, timestep=t, encoder_hidden_states=text, enable_temporal_attentions=True)

    inputs = (torch.randn(B, 4, 2, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24))
    return model, call, inputs


def easyanimate():
    # EasyAnimate: one MMDiT block (per-stream q/k/v, q/k LayerNorms, text and video FP32LayerNorms
    # modulated (shift, scale, gate) per stream from one linear, GELU-tanh MLP per stream) and one
    # single-stream block (the streams concatenated, one MLP for both); the 3-axis real rotary
    # written into the video slice of q and k in place
    model = diffusers.EasyAnimateTransformer3DModel(
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=4,
        out_channels=4,
        patch_size=2,
        sample_width=8,
        sample_height=8,
        num_layers=2,
        mmdit_layers=1,
        time_embed_dim=32,
        text_embed_dim=24,
    )

    def call(m, x, t, text):
        return m(x, timestep=t, encoder_hidden_states=text)

    inputs = (torch.randn(B, 4, 2, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24))
    return model, call, inputs


def _cogvideox_rope(head_dim, frames, h, w, base_h, base_w):
    """CogVideoX's / ConsisID's pipeline rotary tables: get_3d_rotary_pos_embed over the grid's
    crop of the base size (get_resize_crop_region_for_grid)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    if h / w > base_h / base_w:
        rh, rw = base_h, round(base_h / h * w)
    else:
        rh, rw = round(base_w / w * h), base_w
    top, left = round((base_h - rh) / 2.0), round((base_w - rw) / 2.0)
    return get_3d_rotary_pos_embed(
        embed_dim=head_dim,
        crops_coords=((top, left), (top + rh, left + rw)),
        grid_size=(h, w),
        temporal_size=frames,
    )


def consisid():
    # ConsisID: CogVideoX blocks (text and video concatenated, each stream's LayerNorm modulated
    # (shift, scale, gate), q/k LayerNorms, the 3-axis real rotary on the video slice of q and k,
    # one GELU-tanh MLP for both), a Perceiver local facial extractor (LayerNorms, written-out
    # softmax attention on an fp32 copy, GELU MLPs, LeakyReLU mappings) and a Perceiver
    # cross-attention after every second block adding the face tokens
    inner = HEADS * HEAD_DIM
    model = diffusers.ConsisIDTransformer3DModel(
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=4,
        out_channels=4,
        time_embed_dim=16,
        text_embed_dim=24,
        num_layers=2,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        patch_size=2,
        max_text_seq_length=7,
        use_rotary_positional_embeddings=True,
        is_train_face=True,
        cross_attn_interval=2,
        cross_attn_dim_head=HEAD_DIM,
        cross_attn_num_heads=HEADS,
        LFE_id_dim=16,
        LFE_vit_dim=32,
        LFE_depth=2,
        LFE_dim_head=HEAD_DIM,
        LFE_num_heads=HEADS,
        LFE_num_id_token=2,
        LFE_num_querie=4,
        LFE_output_dim=int(inner / 3 * 2),
        LFE_ff_mult=2,
        LFE_num_scale=2,
    )

    def call(m, x, text, t, id_cond, vit_0, vit_1):
        return m(
            x,
            encoder_hidden_states=text,
            timestep=t,
            image_rotary_emb=_cogvideox_rope(HEAD_DIM, 2, 4, 4, 4, 4),
            id_cond=id_cond,
            id_vit_hidden=[vit_0, vit_1],
        )

    inputs = (
        torch.randn(B, 2, 4, 8, 8),
        torch.randn(B, 7, 24),
        torch.tensor([1, 5]),
        torch.randn(B, 16),
        torch.randn(B, 9, 32),
        torch.randn(B, 9, 32),
    )
    return model, call, inputs


def kandinsky5():
    # Kandinsky 5: text encoder blocks and visual decoder blocks (self-attention, cross-attention to
    # the text, bias-free GELU MLP), each behind a LayerNorm of an fp32 copy modulated (shift,
    # scale, gate) with a gated add in fp32; q/k nn.RMSNorm of fp32 copies; the rotary each pair
    # times a 2x2 matrix (rope * x summed), its output rounded to bfloat16. The modulations are
    # zero at init (every block the identity): drawn here
    model = diffusers.Kandinsky5Transformer3DModel(
        in_visual_dim=4,
        in_text_dim=24,
        in_text_dim2=12,
        time_dim=32,
        out_visual_dim=4,
        patch_size=(1, 2, 2),
        model_dim=HEADS * HEAD_DIM,
        ff_dim=64,
        num_text_blocks=1,
        num_visual_blocks=2,
        axes_dims=(4, 6, 6),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modulation" in name:
                p.normal_(std=0.1)
    # its time embedding casts the sinusoids to fp32 (the module is kept in fp32 when loaded): the
    # float64 twin's Linear then gets fp32 input; cast it to the layer's dtype (a no-op in fp32)
    model.time_embeddings.in_layer.register_forward_pre_hook(
        lambda mod, args: (args[0].to(mod.weight.dtype),)
    )

    def call(m, x, text, t, pooled):
        return m(
            x,
            encoder_hidden_states=text,
            timestep=t,
            pooled_projections=pooled,
            visual_rope_pos=[torch.arange(2), torch.arange(4), torch.arange(4)],
            text_rope_pos=torch.arange(7),
            scale_factor=(1.0, 1.0, 1.0),
        )

    inputs = (
        torch.randn(B, 2, 8, 8, 4),
        torch.randn(B, 7, 24),
        torch.tensor([100.0, 500.0]),
        torch.randn(B, 12),
    )
    return model, call, inputs


def kandinsky6():
    # Kandinsky 6 (text/image to video and audio): a text encoder block per modality and a fused
    # video/audio decoder block (each stream's self-attention, cross-attention to its text, then
    # video<->audio cross-attention both ways with rotary on q and kv (ca_rope) and cross gates,
    # bias-free GELU MLPs), every norm a LayerNorm of an fp32 copy modulated (shift, scale, gate)
    # with the gated add in fp32; q/k nn.RMSNorm; the rotary each pair times a 2x2 matrix written
    # (rope * x).sum(-1). The flags the released checkpoints set; the output the video and audio
    # predictions flattened side by side
    model = diffusers.Kandinsky6Transformer3DModel(
        in_visual_dim=4,
        out_visual_dim=4,
        in_text_dim=24,
        in_text_dim2=12,
        time_dim=32,
        patch_size=(1, 2, 2),
        model_dim=HEADS * HEAD_DIM,
        ff_dim=64,
        num_text_blocks=1,
        num_visual_blocks=1,
        axes_dims=(4, 6, 6),
        visual_cond=True,
        in_audio_dim=4,
        out_audio_dim=4,
        text_token_padding=True,
        ca_rope=True,
        cross_gates=True,
        fix_modulation=True,
    )

    def call(m, x, audio, text, pooled, t, text_mask):
        out = m(
            x,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=t,
            audio_hidden_states=audio,
            encoder_attention_mask=text_mask,
        )
        return SimpleNamespace(sample=torch.cat([out.sample.flatten(1), out.audio_sample.flatten(1)], 1))

    inputs = (
        torch.randn(B, 2, 8, 8, 9),
        torch.randn(B, 6, 4),
        torch.randn(B, 7, 24),
        torch.randn(B, 12),
        torch.tensor([100.0, 500.0]),
        _text_mask().bool(),
    )
    return model, call, inputs


# ---------------------------------------------------------------------------------------------
# Video models: the Wan family, Sana video, Helios, Motif, MiniMax, AnyFlow, JoyImage
# ---------------------------------------------------------------------------------------------


def skyreels_v2():
    # SkyReels-V2 (Wan's block): FP32LayerNorms modulated per sample from a learned table plus the
    # timestep, gated adds in fp32, self-attention with q/k RMSNorm across heads and rotary (cos/sin
    # interleaved), cross-attention after an affine norm, a tanh-GELU MLP
    model = diffusers.SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=4,
        out_channels=4,
        text_dim=24,
        freq_dim=16,
        ffn_dim=48,
        num_layers=2,
        rope_max_seq_len=32,
    )

    def call(m, x, t, text):
        return m(x, timestep=t, encoder_hidden_states=text)

    inputs = (torch.randn(B, 4, 2, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24))
    return model, call, inputs


def sana_video():
    # Sana-Video: ReLU linear attention (its rotary written into an empty tensor at strided slots,
    # fp32 matmuls, a 1/(k.sum @ q) normaliser) under a modulated LayerNorm, a plain SDPA
    # cross-attention on the unnormed stream (q/k RMSNorm across heads), and a GLUMBTempConv
    # feed-forward (1x1 conv, SiLU, depthwise conv, SiLU-gated halves, pointwise + temporal conv)
    model = diffusers.SanaVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        num_layers=2,
        num_cross_attention_heads=HEADS,
        cross_attention_head_dim=HEAD_DIM,
        cross_attention_dim=32,
        caption_channels=24,
        mlp_ratio=1.5,
        sample_size=8,
        patch_size=(1, 2, 2),
        rope_max_seq_len=32,
    )

    def call(m, x, text, t, text_mask):
        return m(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=text_mask)

    inputs = (torch.randn(B, 4, 2, 8, 8), torch.randn(B, 7, 24), torch.tensor([1, 5]), torch.ones(B, 7))
    return model, call, inputs


def sana_wm():
    # SANA-WM: per-frame modulated LayerNorms (table + per-frame timestep), a bidirectional
    # gated-delta-net linear attention (block 1: short temporal conv on k, q/k RMSNorm, ReLU kernel,
    # complex rotary on the numerator, a chunked fp32 scan) or softmax attention (block 2, run in
    # bf16), each beside a camera (UCPE) branch of its own and times a SiLU output gate; SDPA
    # cross-attention (RMSNorm q/k) on the unnormed stream; the GLUMBConvTemp conv feed-forward
    model = diffusers.SanaWMTransformer3DModel(
        in_channels=4,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=HEADS,
        patch_size=(1, 2, 2),
        softmax_every_n=2,
        linear_head_dim=HEAD_DIM,
        conv_kernel_size=2,
        use_chunk_plucker_post_attn=False,
        chunk_plucker_channels=6,
        image_size=16,
        caption_channels=24,
        mlp_ratio=1.5,
    )

    def call(m, x, t, text, text_mask, camera):
        return m(
            x,
            timestep=t,
            encoder_hidden_states=text,
            encoder_attention_mask=text_mask,
            camera_conditions=camera,
        )

    # per frame: a camera-to-world 4x4 (identity, a small shift) and the pinhole's fx, fy, cx, cy
    c2w = torch.eye(4).repeat(B, 2, 1, 1)
    c2w[:, :, :3, 3] = 0.1 * torch.randn(B, 2, 3)
    camera = torch.cat([c2w.flatten(2), torch.tensor([8.0, 8.0, 4.0, 4.0]).expand(B, 2, 4)], -1)
    inputs = (
        torch.randn(B, 4, 2, 8, 8),
        torch.tensor([[[1, 1]], [[5, 5]]]),
        torch.randn(B, 1, 7, 24),
        torch.ones(B, 7),
        camera,
    )
    return model, call, inputs


def sana_wm_refiner():
    # SANA-WM's stage-2 refiner (LTX-2's video stream alone): RMSNorms (no affine) modulated per token
    # from a table plus the timestep, self-attention with q/k RMSNorm across heads and LTX-2's
    # interleaved rotary (x * cos + stack(-x_imag, x_real) * sin, in fp32) before the heads split,
    # a plain-RMSNorm SDPA cross-attention, a tanh-GELU MLP, gated adds; no KV cache (full attention)
    model = diffusers.SanaWMLTX2RefinerTransformer3DModel(
        in_channels=8,
        out_channels=8,
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        cross_attention_dim=32,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_num_attention_heads=HEADS,
        audio_attention_head_dim=HEAD_DIM,
        audio_cross_attention_dim=32,
        num_layers=2,
        caption_channels=24,
    )

    def call(m, x, text, t, text_mask):
        rope = m.build_rotary_emb_for_absolute_positions(x.shape[0], [0, 1], 4, 4, x.device, fps=24.0)
        return m(
            x, encoder_hidden_states=text, timestep=t, video_rotary_emb=rope, encoder_attention_mask=text_mask
        )

    # the refiner's timestep per video token (2 frames of 4 x 4), already times 1000
    t = torch.tensor([[100.0], [500.0]]).expand(B, 32)
    inputs = (torch.randn(B, 32, 8), torch.randn(B, 7, 24), t, torch.ones(B, 7))
    return model, call, inputs


def chronoedit():
    # ChronoEdit (Wan 2.1's image-to-video block): FP32LayerNorms modulated per sample, q/k RMSNorm
    # across heads, the rotary as Wan's strided writes (2 frames: the temporal table's first and 8th
    # rows), a cross-attention over the text and (added k/v, its own k norm) the CLIP image tokens,
    # a tanh-GELU MLP; Wan's I2V attention takes the last 512 context tokens as text, hence 512 here
    model = diffusers.ChronoEditTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=8,
        out_channels=4,
        text_dim=24,
        freq_dim=16,
        ffn_dim=48,
        num_layers=2,
        image_dim=20,
        added_kv_proj_dim=HEADS * HEAD_DIM,
        rope_max_seq_len=32,
    )

    def call(m, x, t, text, image):
        return m(x, timestep=t, encoder_hidden_states=text, encoder_hidden_states_image=image)

    inputs = (
        torch.randn(B, 8, 2, 8, 8),
        torch.tensor([1, 5]),
        torch.randn(B, 512, 24),
        torch.randn(B, 5, 20),
    )
    return model, call, inputs


def wan_animate():
    # Wan-Animate: Wan 2.1's I2V blocks (FP32LayerNorms modulated per sample, q/k RMSNorm, Wan's
    # strided-write rotary, text + CLIP-image cross-attention, tanh-GELU MLP; 512 text tokens, as
    # Wan's I2V attention slices them) plus pose latents added to the patches, a face-video motion
    # encoder (StyleGAN convs with fused leaky ReLU, a QR), a face encoder (causal convs, LayerNorm +
    # SiLU) and a face adapter after block 0 (LayerNorms, per-frame SDPA, per-head RMSNorm q/k)
    model = diffusers.WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=12,
        latent_channels=4,
        out_channels=4,
        text_dim=24,
        freq_dim=16,
        ffn_dim=48,
        num_layers=2,
        image_dim=20,
        added_kv_proj_dim=HEADS * HEAD_DIM,
        rope_max_seq_len=32,
        motion_encoder_channel_sizes={"8": 16, "4": 16},
        motion_encoder_size=8,
        motion_style_dim=16,
        motion_dim=8,
        motion_encoder_dim=16,
        face_encoder_hidden_dim=16,
        face_encoder_num_heads=2,
        inject_face_latents_blocks=2,
    )

    def call(m, x, t, text, image, pose, face):
        return m(
            x,
            timestep=t,
            encoder_hidden_states=text,
            encoder_hidden_states_image=image,
            pose_hidden_states=pose,
            face_pixel_values=face,
        )

    # 2 latent frames (the reference and one), a pose latent for the second, one 8 x 8 face frame
    inputs = (
        torch.randn(B, 12, 2, 8, 8),
        torch.tensor([1, 5]),
        torch.randn(B, 512, 24),
        torch.randn(B, 5, 20),
        torch.randn(B, 4, 1, 8, 8),
        torch.randn(B, 3, 1, 8, 8),
    )
    return model, call, inputs


def wan_vace():
    # Wan-VACE: Wan's blocks (FP32LayerNorms modulated per sample, q/k RMSNorm, strided-write rotary,
    # cross-attention, tanh-GELU MLP) and as many VACE blocks of the same kind over the control latents
    # (the first adds the projected control to the video stream), each hint added back scaled per layer
    model = diffusers.WanVACETransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=4,
        out_channels=4,
        text_dim=24,
        freq_dim=16,
        ffn_dim=48,
        num_layers=2,
        rope_max_seq_len=32,
        vace_layers=[0, 1],
        vace_in_channels=8,
    )

    def call(m, x, t, text, control, control_scale):
        return m(
            x,
            timestep=t,
            encoder_hidden_states=text,
            control_hidden_states=control,
            control_hidden_states_scale=control_scale,
        )

    inputs = (
        torch.randn(B, 4, 2, 8, 8),
        torch.tensor([1, 5]),
        torch.randn(B, 7, 24),
        torch.randn(B, 8, 2, 8, 8),
        torch.tensor([1.0, 0.5]),
    )
    return model, call, inputs


def helios():
    # Helios (autoregressive Wan-style video): FP32LayerNorms modulated per token (the history's
    # tokens at timestep 0), q/k RMSNorm across heads, the rotary as strided writes into an empty
    # tensor from a (cos | sin) table per token, a cross-attention over the current chunk's tokens only
    # (split off the history, concatenated back), a tanh-GELU MLP; short / mid / long history latents
    # patchified at 1x, 2x and 4x
    model = diffusers.HeliosTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=4,
        out_channels=4,
        text_dim=24,
        freq_dim=16,
        ffn_dim=48,
        num_layers=2,
        rope_dim=(4, 6, 6),
    )

    def call(m, x, t, text, idx, idx_short, idx_mid, idx_long, short, mid, long):
        return m(
            x,
            timestep=t,
            encoder_hidden_states=text,
            indices_hidden_states=idx,
            indices_latents_history_short=idx_short,
            indices_latents_history_mid=idx_mid,
            indices_latents_history_long=idx_long,
            latents_history_short=short,
            latents_history_mid=mid,
            latents_history_long=long,
        )

    def frames(*f):
        return torch.tensor([list(f)] * B)

    # 2 current latent frames after 1 short-, 2 mid- and 4 long-history frames
    inputs = (
        torch.randn(B, 4, 2, 8, 8),
        torch.tensor([1, 5]),
        torch.randn(B, 7, 24),
        frames(7, 8),
        frames(6),
        frames(4, 5),
        frames(0, 1, 2, 3),
        torch.randn(B, 4, 1, 8, 8),
        torch.randn(B, 4, 2, 8, 8),
        torch.randn(B, 4, 4, 8, 8),
    )
    return model, call, inputs


def motif_video():
    # Motif-Video: Flux-like dual-stream blocks (AdaLayerNormZero per stream, joint attention with q/k
    # RMSNorm per head and diffusers' apply_rotary_emb on the video tokens, gated adds, tanh-GELU
    # MLPs) and single-stream blocks (AdaLayerNormZeroSingle, parallel attention + MLP into one
    # proj_out, gated), each with an extra text cross-attention; the last single block a decoder
    # over the first-pass tokens; the first frame's image embeddings ahead of the text
    model = diffusers.MotifVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        num_layers=1,
        num_single_layers=2,
        num_decoder_layers=1,
        mlp_ratio=1.5,
        patch_size=2,
        text_embed_dim=24,
        image_embed_dim=20,
        rope_axes_dim=(4, 6, 6),
        enable_text_cross_attention_dual=True,
        enable_text_cross_attention_single=True,
    )
    # its Timesteps are fp32 and cast only to 16-bit weights: cast them to the embedder's dtype, so
    # that the harness's float64 twin runs (a no-op in fp32)
    model.time_text_embed.timestep_embedder.register_forward_pre_hook(
        lambda mod, args: (args[0].to(mod.linear_1.weight.dtype),) + args[1:]
    )

    def call(m, x, t, text, text_mask, image):
        return m(
            x, timestep=t, encoder_hidden_states=text, encoder_attention_mask=text_mask, image_embeds=image
        )

    text_mask = torch.ones(B, 7, dtype=torch.bool)
    text_mask[1, 5:] = False
    inputs = (
        torch.randn(B, 4, 2, 8, 8),
        torch.tensor([1, 5]),
        torch.randn(B, 7, 24),
        text_mask,
        torch.randn(B, 5, 20),
    )
    return model, call, inputs


def minimax_h3():
    # MiniMax-H3: one packed sequence of text, video and audio rows through single-stream blocks:
    # RMSNorms modulated per row (a (timestep, modality) table gathered by index_select), full
    # self-attention with per-head RMSNorm q/k and a partial rotate-half rotary (12 of 16 channels,
    # three axes), gated adds, bias-free SwiGLU MLPs; the text first through plain pre-norm refiner
    # blocks; the prediction the video and audio heads' rows flattened side by side
    model = diffusers.MiniMaxH3Transformer3DModel(
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        hidden_size=32,
        num_layers=2,
        num_refiner_layers=1,
        ffn_dim=48,
        in_channels=4,
        audio_in_channels=8,
        patch_size=(1, 2, 2),
        text_dim=24,
        freq_dim=16,
        time_embed_hidden_dim=32,
        time_embed_dim=24,
        rope_freq_dim=2,
    )

    # packed rows: 7 text, 2 frames x 4 x 4 video (the first a clean conditioning frame), 4 audio
    n_text, n_video, n_audio = 7, 32, 4
    seq = n_text + n_video + n_audio
    text_idx, video_idx = torch.arange(n_text), torch.arange(n_text, n_text + n_video)
    audio_idx = torch.arange(n_text + n_video, seq)
    tags = torch.cat([torch.ones(n_text), torch.zeros(n_video), torch.full((n_audio,), 2)]).long()
    t_idx = torch.ones(seq, dtype=torch.long)
    t_idx[n_text : n_text + 16] = 0
    f, h, w = torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(4), indexing="ij")
    pos = torch.cat(
        [
            torch.stack(
                [
                    torch.arange(n_text),
                    torch.zeros(n_text, dtype=torch.long),
                    torch.zeros(n_text, dtype=torch.long),
                ],
                1,
            ),
            torch.stack([f.flatten(), h.flatten(), w.flatten()], 1),
            torch.stack(
                [
                    torch.arange(n_audio),
                    torch.zeros(n_audio, dtype=torch.long),
                    torch.zeros(n_audio, dtype=torch.long),
                ],
                1,
            ),
        ]
    )

    def call(m, x, audio, text, t, t_idx, tags, pos, video_idx, audio_idx, text_idx):
        out = m(
            x,
            audio,
            text,
            timestep=t,
            timestep_indices=t_idx,
            token_tags=tags,
            position_ids=pos,
            video_indices=video_idx,
            audio_indices=audio_idx,
            text_indices=text_idx,
        )
        return SimpleNamespace(sample=torch.cat([out.sample.flatten(1), out.audio_sample.flatten(1)], 1))

    inputs = (
        torch.randn(B, n_video, 16),
        torch.randn(B, n_audio, 8),
        torch.randn(B, n_text, 24),
        torch.tensor([0.0, 0.6]),
        t_idx,
        tags,
        pos,
        video_idx,
        audio_idx,
        text_idx,
    )
    return model, call, inputs


def anyflow():
    # AnyFlow (Wan 2.1's blocks, flow-map distilled): FP32LayerNorms modulated per token (a per-frame
    # mix of the source- and target-timestep embeddings), q/k RMSNorm across heads, the rotary as a
    # complex product computed in float64 (view_as_complex of a float64 copy, (B, H, L, D) layout),
    # a cross-attention, a tanh-GELU MLP; latents (B, F, C, H, W)
    model = diffusers.AnyFlowTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=4,
        out_channels=4,
        text_dim=24,
        freq_dim=16,
        ffn_dim=48,
        num_layers=2,
        rope_max_seq_len=32,
    )

    def call(m, x, t, r, text):
        return m(x, timestep=t, r_timestep=r, encoder_hidden_states=text)

    # source and target timesteps per sample and frame
    inputs = (
        torch.randn(B, 2, 4, 8, 8),
        torch.tensor([[800.0, 800.0], [400.0, 400.0]]),
        torch.tensor([[600.0, 600.0], [100.0, 100.0]]),
        torch.randn(B, 7, 24),
    )
    return model, call, inputs


def joyimage_edit():
    # JoyImage-Edit: SD3/Flux-style dual-stream blocks with Wan-style modulation tables (zero at
    # init, plus the timestep projection), FP32LayerNorms (no affine) modulated per sample, fused-qkv
    # joint attention with per-head RMSNorm q/k and a rotary written as x.float() * cos +
    # stack(-x_imag, x_real) * sin on the image tokens, gated adds, tanh-GELU MLPs; a multi-item
    # input (the edited image and its reference) folded into frames
    model = diffusers.JoyImageEditTransformer3DModel(
        patch_size=[1, 2, 2],
        in_channels=4,
        hidden_size=32,
        num_attention_heads=HEADS,
        text_dim=24,
        mlp_width_ratio=1.5,
        num_layers=2,
        rope_dim_list=[4, 6, 6],
    )

    def call(m, x, t, text):
        return m(x, timestep=t, encoder_hidden_states=text)

    # (batch, items, channels, frames, height, width): the target and one reference image
    inputs = (torch.randn(B, 2, 4, 1, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24))
    return model, call, inputs


# ---------------------------------------------------------------------------------------------
# Video VAEs beside Wan's (tests/fusion/test_fuse_diffusers.py `wan_vae`): their RMS norms are
# `F.normalize(x, dim=1)` over the channels times a scale and gamma, their causal convolutions
# write the cache they are handed (left to Dynamo, which replays the writes)
# ---------------------------------------------------------------------------------------------


def _vae_call(m, x):
    return m(x)


def qwenimage_vae():
    # Qwen-Image's VAE: Wan's architecture, its own copy of the code
    model = diffusers.AutoencoderKLQwenImage(base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                             attn_scales=[], temperal_downsample=[True])
    return model, _vae_call, (torch.randn(1, 3, 5, 16, 16),)


def hunyuan_video15_vae():
    # HunyuanVideo 1.5's VAE: the same RMS norm, a causal conv with its own cache
    model = diffusers.AutoencoderKLHunyuanVideo15(block_out_channels=(16, 32), layers_per_block=1, latent_channels=4,
                                                  spatial_compression_ratio=2, temporal_compression_ratio=2)
    return model, _vae_call, (torch.randn(1, 3, 5, 16, 16),)


def qwenimage21_vae():
    # Qwen-Image 2.1's VAE: Wan's for single images (its causal convs fold the frame away)
    model = diffusers.AutoencoderKLQwenImage21(base_dim=16, decoder_base_dim=16, z_dim=4, dim_mult=[1, 2, 2],
                                               num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True],
                                               in_channels=3, out_channels=3)
    return model, _vae_call, (torch.randn(1, 3, 1, 16, 16),)


def hunyuanimage_refiner_vae():
    # HunyuanImage 2.1's refiner VAE: HunyuanVideo 1.5's, its own copy
    model = diffusers.AutoencoderKLHunyuanImageRefiner(block_out_channels=(16, 32), layers_per_block=1,
                                                       latent_channels=4, spatial_compression_ratio=2,
                                                       temporal_compression_ratio=2)
    return model, _vae_call, (torch.randn(1, 3, 5, 16, 16),)


def kandinsky6_sr_vae():
    # Kandinsky 6's super-resolution VAE: causal convs that write their padding into a cache dict
    # they are handed, `F.normalize(x.float(), dim=1).to(dtype) * scale * gamma` norms
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRVAE

    model = Kandinsky6SRVAE(latent_channels=4, encoder_block_out_channels=(8, 16), decoder_block_out_channels=(8, 16),
                            layers_per_block=1, temporal_compression_ratio=2, temporal_compression_start_level=1)
    return model, _vae_call, (torch.randn(1, 3, 5, 16, 16),)


BUILDERS = {
    **{name: _from_tests(build) for name, (build, _, _) in _tested.MODELS.items()},
    "flux3": flux3,
    "bria": bria,
    "bria_fibo": bria_fibo,
    "bria_fibo2": bria_fibo2,
    "krea2": krea2,
    "longcat_image": longcat_image,
    "ovis_image": ovis_image,
    "qwenimage21": qwenimage21,
    "auraflow": auraflow,
    "hunyuandit": hunyuandit,
    "hunyuanimage": hunyuanimage,
    "cogview3plus": cogview3plus,
    "ernieimage": ernieimage,
    "glmimage": glmimage,
    "ideogram4": ideogram4,
    "dreamlite": dreamlite,
    "nucleusmoe": nucleusmoe,
    "omnigen": omnigen,
    "prx": prx,
    "stableaudio": stableaudio,
    "acestep": acestep,
    "hunyuan_video15": hunyuan_video15,
    "hunyuan_video_framepack": hunyuan_video_framepack,
    "cosmos": cosmos,
    "allegro": allegro,
    "latte": latte,
    "easyanimate": easyanimate,
    "consisid": consisid,
    "kandinsky5": kandinsky5,
    "kandinsky6": kandinsky6,
    "skyreels_v2": skyreels_v2,
    "sana_video": sana_video,
    "sana_wm": sana_wm,
    "sana_wm_refiner": sana_wm_refiner,
    "chronoedit": chronoedit,
    "wan_animate": wan_animate,
    "wan_vace": wan_vace,
    "helios": helios,
    "motif_video": motif_video,
    "minimax_h3": minimax_h3,
    "anyflow": anyflow,
    "joyimage_edit": joyimage_edit,
    "qwenimage_vae": qwenimage_vae,
    "hunyuan_video15_vae": hunyuan_video15_vae,
    "qwenimage21_vae": qwenimage21_vae,
    "hunyuanimage_refiner_vae": hunyuanimage_refiner_vae,
    "kandinsky6_sr_vae": kandinsky6_sr_vae,
}
