"""diffusers' denoisers, built from small configs (no download): the DiT, PixArt-alpha, SD3,
Flux, Flux 2, Chroma, HunyuanVideo, Sana, CogVideoX, Wan, LTX-Video, LTX-2, Qwen-Image, Lumina 2,
Z-Image, CogView4, HiDream and Mochi transformers, the Stable Diffusion UNet and its VAE
(AutoencoderKL), Wan's video VAE. `fuse` replaces the
attention, LayerNorm, RMSNorm (Flux's q/k norms), GeLU and residual-stream ops of their transformer
blocks (diffusers' `Attention` with its SDPA processor, `FeedForward`'s GELU / GEGLU,
`BasicTransformerBlock`'s and the joint blocks' norms), the ResNet blocks' GroupNorm + SiLU and
the attention blocks' GroupNorm, and the adaptive norms of the diffusion transformers (a norm
times `1 + scale` plus `shift` per sample, or times a scale alone: Lumina 2, Z-Image) become
`layer_norm_modulate`; outputs and every gradient equal the unfused model's by the oracle rule.
"""
from types import SimpleNamespace

import pytest
import torch
from _device import DEVICE
from _fusing import available_counts, check_against_unfused, cuda_like_autocast
from torch import nn

diffusers = pytest.importorskip("diffusers")

B, HEADS, HEAD_DIM = 2, 2, 16


class Denoiser(nn.Module):
    """A training loop's call of a diffusers model, positional tensors in, the prediction out:
    `call(model, *inputs)` names the arguments (the keyword ones diffusers takes)."""

    def __init__(self, model: nn.Module, call) -> None:
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        sample = self.call(self.model, *inputs).sample
        return torch.stack(sample) if isinstance(sample, list) else sample  # Z-Image: one per image


def dit():
    # DiT-style class-conditional adaLN-Zero blocks. Its label embedding drops labels at random in
    # training (class_dropout_prob 0.1): the three runs of the check would see different labels.
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=8, num_layers=2,
        sample_size=8, patch_size=2, num_embeds_ada_norm=10)

    def call(m, x, t, labels):
        return m(x, timestep=t, class_labels=labels)

    return Denoiser(model, call), (torch.randn(B, 4, 8, 8), torch.tensor([1, 5]), torch.tensor([1, 2])), False


def pixart():
    model = diffusers.PixArtTransformer2DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=8, num_layers=2,
        sample_size=8, patch_size=2, cross_attention_dim=32, caption_channels=24,
        use_additional_conditions=False)

    def call(m, x, t, text):
        return m(x, encoder_hidden_states=text, timestep=t,
                 added_cond_kwargs={"resolution": None, "aspect_ratio": None})

    return Denoiser(model, call), (torch.randn(B, 4, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24)), True


def sd3():
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=24, caption_projection_dim=32,
        pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16)

    def call(m, x, t, text, pooled):
        return m(x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t)

    inputs = (torch.randn(B, 4, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24), torch.randn(B, 12))
    return Denoiser(model, call), inputs, True


def flux():
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=24, pooled_projection_dim=12, axes_dims_rope=(4, 6, 6))

    def call(m, x, t, text, pooled, img_ids, txt_ids):
        return m(x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t, img_ids=img_ids,
                 txt_ids=txt_ids)

    inputs = (torch.randn(B, 16, 16), torch.tensor([0.1, 0.5]), torch.randn(B, 7, 24), torch.randn(B, 12),
              torch.randn(16, 3), torch.zeros(7, 3))
    return Denoiser(model, call), inputs, True


def unet():
    model = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=24, attention_head_dim=8,
        norm_num_groups=8)

    def call(m, x, t, text):
        return m(x, t, encoder_hidden_states=text)

    return Denoiser(model, call), (torch.randn(B, 4, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24)), True


def vae():
    """Stable Diffusion's AutoencoderKL, encode and decode: ResNet blocks (GroupNorm + SiLU twice
    each) and one attention block (GroupNorm, then SDPA) in each of the encoder and decoder."""
    model = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=8)
    return Denoiser(model, lambda m, x: m(x)), (torch.randn(B, 3, 8, 8),), True


def wan_vae():
    """Wan's video VAE (Qwen-Image's is its copy), encode and decode over 5 frames: causal 3D
    convolutions whose cache each block is handed in a list and writes in place (so fx leaves
    those blocks to Dynamo, which replays the writes), its RMS norms `F.normalize(x, dim=1).to(x.dtype) *
    scale * gamma + 0.0` over the channels (a floored RMSNorm each, the cast, scale, gamma and 0.0
    folded into it), one attention block in each of the encoder and decoder."""
    torch.manual_seed(0)
    model = diffusers.AutoencoderKLWan(base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                       attn_scales=[], temperal_downsample=[True])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return Denoiser(model, lambda m, x: m(x)), (torch.randn(1, 3, 5, 16, 16),), True


def sana():
    model = diffusers.SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, num_layers=2,
        num_cross_attention_heads=HEADS, cross_attention_head_dim=HEAD_DIM, cross_attention_dim=32,
        caption_channels=24, sample_size=8, patch_size=2)

    def call(m, x, t, text):
        return m(x, encoder_hidden_states=text, timestep=t)

    return Denoiser(model, call), (torch.randn(B, 4, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24)), True


def cogvideox():
    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4,
        time_embed_dim=16, text_embed_dim=24, num_layers=2, sample_width=8, sample_height=8, sample_frames=9,
        patch_size=2, max_text_seq_length=7)

    def call(m, x, t, text):
        return m(x, encoder_hidden_states=text, timestep=t)

    inputs = (torch.randn(B, 3, 4, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24))
    return Denoiser(model, call), inputs, True


def wan():
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4,
        out_channels=4, text_dim=24, freq_dim=16, ffn_dim=48, num_layers=2, rope_max_seq_len=32)

    def call(m, x, t, text):
        return m(x, timestep=t, encoder_hidden_states=text)

    inputs = (torch.randn(B, 4, 2, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24))
    return Denoiser(model, call), inputs, True


def qwenimage():
    # Qwen-Image's dual-stream blocks: the rotary a complex product with a 3-D (S, 1, D/2) table
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=24, axes_dims_rope=(4, 6, 6))

    def call(m, x, t, text, text_mask):
        return m(x, encoder_hidden_states=text, encoder_hidden_states_mask=text_mask, timestep=t,
                 img_shapes=[(1, 4, 4)] * B)

    inputs = (torch.randn(B, 16, 16), torch.tensor([0.1, 0.5]), torch.randn(B, 7, 24), torch.ones(B, 7))
    return Denoiser(model, call), inputs, True


def ltx():
    # diffusers' own RMSNorm (written out, the mean square of an fp32 copy), modulated per sample
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM, cross_attention_dim=32, num_layers=2, caption_channels=24)

    def call(m, x, t, text, text_mask):
        return m(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=text_mask, num_frames=2,
                 height=4, width=4)

    inputs = (torch.randn(B, 32, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24), torch.ones(B, 7))
    return Denoiser(model, call), inputs, True


def ltx2():
    # LTX-2: a video and an audio stream, 32 wide each, with cross-attention both ways between them,
    # each direction's query and key modulated from one shared norm per stream; the output the
    # video and audio samples flattened side by side
    model = diffusers.LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
        cross_attention_dim=32, audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=HEADS,
        audio_attention_head_dim=HEAD_DIM, audio_cross_attention_dim=32, num_layers=1, caption_channels=24)

    def call(m, x, audio, text, audio_text, t, text_mask):
        out = m(x, audio, text, audio_text, t, encoder_attention_mask=text_mask,
                audio_encoder_attention_mask=text_mask, num_frames=2, height=4, width=4, audio_num_frames=4)
        return SimpleNamespace(sample=torch.cat([out.sample.flatten(1), out.audio_sample.flatten(1)], 1))

    inputs = (torch.randn(B, 32, 8), torch.randn(B, 4, 8), torch.randn(B, 7, 24), torch.randn(B, 7, 24),
              torch.tensor([1, 5]), torch.ones(B, 7))
    return Denoiser(model, call), inputs, True


def lumina2():
    # Lumina 2: sandwich norms scaled per sample (`norm(x) * scale`, no shift; the gate the same way
    # on the output's norm), diffusers' FP32SiLU in its feed-forward, grouped-query attention
    model = diffusers.Lumina2Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
        num_attention_heads=HEADS, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6),
        axes_lens=(32, 16, 16), cap_feat_dim=24)

    def call(m, x, t, text, text_mask):
        return m(x, t, encoder_hidden_states=text, encoder_attention_mask=text_mask)

    inputs = (torch.randn(B, 4, 8, 8), torch.tensor([0.1, 0.5]), torch.randn(B, 7, 24),
              torch.ones(B, 7, dtype=torch.bool))
    return Denoiser(model, call), inputs, True


def zimage():
    # Z-Image: Lumina 2's block with a tanh gate, one list entry per image and per caption
    model = diffusers.ZImageTransformer2DModel(
        in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=HEADS, n_kv_heads=HEADS,
        cap_feat_dim=24, axes_dims=[4, 6, 6], axes_lens=[128, 16, 16])

    def call(m, x, t, text):
        return m(list(x.unbind(0)), t, list(text.unbind(0)))

    inputs = (torch.randn(B, 4, 1, 8, 8), torch.tensor([0.1, 0.5]), torch.randn(B, 7, 24))
    return Denoiser(model, call), inputs, True


def cogview4():
    # CogView4: `norm(x).to(dtype=x.dtype)` before the modulation, diffusers' rotary in halves
    model = diffusers.CogView4Transformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, text_embed_dim=24, time_embed_dim=16, condition_dim=8,
        pos_embed_max_size=8, sample_size=8, rope_axes_dim=(8, 8))

    def call(m, x, text, t, original_size, target_size, crop_coords):
        return m(x, encoder_hidden_states=text, timestep=t, original_size=original_size,
                 target_size=target_size, crop_coords=crop_coords)

    sizes = torch.tensor([[64.0, 64.0]] * B)
    inputs = (torch.randn(B, 4, 8, 8), torch.randn(B, 7, 24), torch.tensor([1, 5]), sizes, sizes.clone(),
              torch.zeros(B, 2))
    return Denoiser(model, call), inputs, True



def hidream():
    # HiDream's dual- and single-stream blocks: the rotary each pair times a 2x2 matrix (BFL's
    # apply_rope), a mixture of SwiGLU experts routed by a softmax gate (a per-expert `nonzero`:
    # graph breaks); llama_layers index the stacked Llama states, one per block
    model = diffusers.HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, caption_channels=[24, 20], text_emb_dim=12,
        num_routed_experts=2, num_activated_experts=1, axes_dims_rope=(8, 4, 4), max_resolution=(8, 8),
        llama_layers=[0, 1])

    def call(m, x, t, t5, llama, pooled):
        return m(x, timesteps=t, encoder_hidden_states_t5=t5, encoder_hidden_states_llama3=llama,
                 pooled_embeds=pooled)

    inputs = (torch.randn(B, 4, 8, 8), torch.tensor([1, 5]), torch.randn(B, 5, 24), torch.randn(2, B, 6, 20),
              torch.randn(B, 12))
    return Denoiser(model, call), inputs, True


def mochi():
    # Mochi's asymmetric joint blocks: its rotary slices the even and odd features and casts each
    # apart, with a table per position and head from learned frequencies (zeros at init: drawn here,
    # so that the rotation is one); its attention runs per sample over the valid text tokens (a
    # `nonzero`: a graph break), and each rotation is then a graph of its own, run for q and for k
    model = diffusers.MochiTransformer3DModel(
        patch_size=2, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, num_layers=2,
        pooled_projection_dim=16, in_channels=4, text_embed_dim=24, time_embed_dim=16, max_sequence_length=7)
    with torch.no_grad():
        model.pos_frequencies.normal_()

    def call(m, x, text, t, mask):
        return m(x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask)

    inputs = (torch.randn(B, 4, 2, 8, 8), torch.randn(B, 7, 24), torch.tensor([1, 5]), torch.ones(B, 7))
    return Denoiser(model, call), inputs, True


def _grid_ids(h, w, axes=3):
    """(h * w, axes) positions of an h x w latent: row and column on axes 1 and 2, the others 0."""
    ids = torch.zeros(h, w, axes, dtype=torch.long)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None, :]
    return ids.reshape(h * w, axes)


def flux2():
    # Flux 2: joint blocks with SwiGLU MLPs and one modulation per stream shared by the blocks,
    # single blocks with one fused qkv + MLP projection; a 4-axis rotary
    model = diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=24, timestep_guidance_channels=16, mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)

    def call(m, x, t, text, img_ids, txt_ids, guidance):
        return m(x, encoder_hidden_states=text, timestep=t, img_ids=img_ids, txt_ids=txt_ids,
                 guidance=guidance)

    txt_ids = torch.zeros(7, 4, dtype=torch.long)
    txt_ids[:, 3] = torch.arange(7)
    inputs = (torch.randn(B, 64, 16), torch.tensor([0.1, 0.5]), torch.randn(B, 7, 24), _grid_ids(8, 8, 4),
              txt_ids, torch.tensor([3.5, 4.0]))
    return Denoiser(model, call), inputs, True


def chroma():
    # Chroma: Flux's blocks with the modulation made outside them by one approximator MLP; a text
    # mask over the joint sequence (float, as the pipeline passes it)
    model = diffusers.ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
        approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=2)

    def call(m, x, t, text, img_ids, txt_ids, mask):
        return m(x, encoder_hidden_states=text, timestep=t, img_ids=img_ids, txt_ids=txt_ids,
                 attention_mask=mask)

    mask = torch.ones(B, 7 + 64)
    mask[1, 5:7] = 0
    inputs = (torch.randn(B, 64, 16), torch.tensor([0.1, 0.5]), torch.randn(B, 7, 24),
              _grid_ids(8, 8).float(), torch.zeros(7, 3), mask)
    return Denoiser(model, call), inputs, True


def hunyuan_video():
    # HunyuanVideo: a token refiner (masked self-attention, a Linear-SiLU-Linear MLP, gated adds),
    # dual- and single-stream blocks (q/k RMSNorms, the rotary on the image tokens' pairs)
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=24, pooled_projection_dim=12, rope_axes_dim=(4, 6, 6))

    def call(m, x, t, text, text_mask, pooled, guidance):
        return m(x, timestep=t, encoder_hidden_states=text, encoder_attention_mask=text_mask,
                 pooled_projections=pooled, guidance=guidance)

    text_mask = torch.ones(B, 7, dtype=torch.long)
    text_mask[1, 5:] = 0
    inputs = (torch.randn(B, 4, 2, 8, 8), torch.tensor([1, 5]), torch.randn(B, 7, 24), text_mask,
              torch.randn(B, 12), torch.tensor([3.5, 4.0]))
    return Denoiser(model, call), inputs, True

# Per model: the replacements of one forward, per family, and how many of the norms are adaptive
# (`layer_norm_modulate`: DiT's, SD3's, PixArt's and Flux's norms modulated per sample, the
# final norm_out's too where it is inside a captured module). DiT, PixArt and SD3 two blocks
# (SD3's last one without its context MLP), Flux one joint and one single block (the rotary on q
# and k of each, diffusers' apply_rotary_emb: one call per block), the UNet four
# BasicTransformerBlocks (one in the down path, one in the middle, two in the up path), each with
# a self- and a cross-attention and a GEGLU, and plain norms. Sana's linear attention stays as
# written (no softmax); its cross-attention fuses. Wan modulates norms of fp32 copies (in fp32
# these are no copies; see the fp16 test below) and rotates q and k by strided writes into an
# empty tensor (one call a block), LTX-Video diffusers' written-out RMSNorm (its
# rotary on q and k before their heads are split, one call a block); their
# cross-attention's output, added after a `Dropout(0.0)`, folds into the next modulated norm.
# Qwen-Image two dual-stream blocks (the image's and the text's norms, gated adds and MLPs, the
# joint attention, the rotary on q and k of each stream). Lumina 2 and Z-Image a modulated refiner
# block, an unmodulated (caption) one and two main blocks, in three captures (the refiners' shapes
# differ): per modulated block the four norms scaled per sample (the attention's input and the MLP's,
# and the outputs' norms times their gates), the attention's gated output added into the MLP's
# norm; per unmodulated block the outputs' norms with their residual adds; and the final norm.
# CogView4 two blocks: the image's and the text's modulated norms (cast to their own dtype first),
# gated adds and MLPs, q/k LayerNorms, and the rotary on the image tokens' slice of q and of k
# (two calls: the slice is written back in place). LTX-2 one block of two streams: per stream the
# norm before the cross-attention between them is modulated twice (once as query, once as key and
# value), and each modulation takes the norm in (four norms fused with their modulations, the
# residual add before one of each pair folded in as well); the rotaries before the heads split in
# pairs of one table (each self-attention's q and k; the video tokens of both cross-attentions,
# the audio tokens likewise). "dropout_add": the gated adds no norm follows in the block (the
# feed-forward's at the block's end, Flux's single block's `residual + gate * proj_out(h)`, PixArt's
# and LTX-Video's gated attention output before an ungated cross-attention) become the gated
# dropout_add, the bias of the linear before them folded in where there is one. HiDream one dual- and
# one single-stream block: the modulated norms (an fp32 copy's), q/k RMSNorms, the rotary as each
# pair times a 2x2 matrix (q and k in one call a block), the routed SwiGLU experts each that got
# tokens (this draw: all of them), the gated adds; its router's softmax stays. Mochi two blocks
# (the last one's text stream without its MLP): the modulated RMSNorms of fp32 copies, the q/k
# norms, the rotary (one graph a block, run for q and for k); the blocks' attention, a per-sample
# loop around `nonzero` (graph breaks), stays as written: the attention fused is the caption
# pooler's. Flux 2, Chroma and HunyuanVideo, Flux's descendants, fuse as Flux does (Flux 2's
# SwiGLU MLPs as gated_activation; Chroma's approximator-made modulation per sample as any other;
# HunyuanVideo's token refiner too, but for its plain SiLU MLP). A replacement counts as often as
# its graph ran, as its op launches: a graph run twice in a block (Mochi's rotary and q/k norms,
# for q and for k; one of HiDream's experts' graphs, reused) counts twice.
# bench/fuse_sweep_diffusers.py checks 45 more of diffusers' denoisers the same way.
MODELS = {
    "dit": (dit, {"layer_norm": 3, "attention": 2, "bias_gelu": 2, "residual_stream": 2, "dropout_add": 2}, 4),
    "pixart": (pixart, {"layer_norm": 3, "attention": 4, "bias_gelu": 3, "residual_stream": 2,
                        "dropout_add": 4}, 4),
    "sd3": (sd3, {"layer_norm": 5, "attention": 2, "bias_gelu": 3, "residual_stream": 3, "dropout_add": 3}, 8),
    "flux": (flux, {"layer_norm": 4, "rms_norm": 6, "attention": 2, "bias_gelu": 3, "residual_stream": 2,
                    "rotary": 2, "dropout_add": 3}, 6),
    "unet": (unet, {"layer_norm": 4, "attention": 8, "gated_activation": 4, "residual_stream": 8,
                    "group_norm": 21}, 0),
    "vae": (vae, {"attention": 2, "group_norm": 24}, 0),
    "wan_vae": (wan_vae, {"attention": 2, "rms_norm": 20}, 0),
    "sana": (sana, {"layer_norm": 3, "rms_norm": 1, "attention": 2, "bias_gelu": 1,
                    "gated_activation": 2, "residual_stream": 2, "dropout_add": 4}, 5),
    "cogvideox": (cogvideox, {"layer_norm": 10, "attention": 2, "bias_gelu": 2, "residual_stream": 4,
                              "dropout_add": 4}, 9),
    "wan": (wan, {"layer_norm": 3, "rms_norm": 8, "attention": 4, "bias_gelu": 3, "residual_stream": 4,
                  "rotary": 2, "dropout_add": 2}, 4),
    "ltx": (ltx, {"layer_norm": 1, "rms_norm": 10, "attention": 4, "bias_gelu": 3, "residual_stream": 2,
                  "rotary": 2, "dropout_add": 4}, 4),
    "ltx2": (ltx2, {"layer_norm": 2, "rms_norm": 16, "attention": 6, "bias_gelu": 4,
                    "residual_stream": 6, "rotary": 4, "dropout_add": 2}, 8),
    "lumina2": (lumina2, {"layer_norm": 1, "rms_norm": 20, "attention": 4, "gated_activation": 4,
                          "residual_stream": 5, "rotary": 4}, 13),
    "zimage": (zimage, {"layer_norm": 1, "rms_norm": 20, "attention": 4, "gated_activation": 4,
                        "residual_stream": 5, "rotary": 4}, 13),
    "cogview4": (cogview4, {"layer_norm": 9, "attention": 2, "bias_gelu": 4, "residual_stream": 4,
                            "rotary": 4, "dropout_add": 4}, 9),
    "qwenimage": (qwenimage, {"layer_norm": 5, "rms_norm": 9, "attention": 2, "bias_gelu": 4,
                              "residual_stream": 4, "rotary": 4, "dropout_add": 4}, 9),
    "hidream": (hidream, {"layer_norm": 4, "rms_norm": 6, "attention": 2, "gated_activation": 7,
                          "residual_stream": 3, "rotary": 2, "dropout_add": 3}, 7),
    "mochi": (mochi, {"layer_norm": 1, "rms_norm": 18, "attention": 1, "gated_activation": 3,
                      "residual_stream": 3, "rotary": 4}, 14),
    "flux2": (flux2, {"layer_norm": 4, "rms_norm": 6, "attention": 2, "gated_activation": 3,
                      "residual_stream": 2, "rotary": 2, "dropout_add": 3}, 6),
    "chroma": (chroma, {"layer_norm": 4, "rms_norm": 7, "attention": 2, "bias_gelu": 3, "residual_stream": 3,
                        "rotary": 2, "dropout_add": 3}, 6),
    "hunyuan_video": (hunyuan_video, {"layer_norm": 5, "rms_norm": 6, "attention": 3, "bias_gelu": 3,
                                      "residual_stream": 3, "rotary": 2, "dropout_add": 4}, 6),
}


# The residual adds that feed a modulated norm in one block (`gated_add_layer_norm_modulate`): the
# attention's gated add before the MLP's norm (DiT, SD3 and Flux per joint stream; CogVideoX's
# video and text streams), the cross-attention's ungated add (PixArt, Sana; Wan's and LTX-Video's
# right after the output's `Dropout(0.0)`); Wan's gated add, written in fp32 and cast back, before
# its cross-attention's plain norm; Lumina 2's and Z-Image's add of the attention output's gated
# norm (itself a norm scaled by the gate) into the MLP's scaled norm.
GROUP_NORM_SILU = {"unet": 16, "vae": 22}
GATED_SUMS = {"dit": 2, "pixart": 2, "sd3": 3, "flux": 2, "sana": 2, "cogvideox": 4, "wan": 4, "ltx": 2,
              "ltx2": 4, "qwenimage": 4, "lumina2": 3, "zimage": 3, "cogview4": 4, "hidream": 3,
              "mochi": 3, "flux2": 2, "chroma": 2, "hunyuan_video": 2}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_diffusers_denoiser_fuses_its_blocks(name):
    build, counts, modulated = MODELS[name]
    model, inputs, train = build()
    report = check_against_unfused(lambda: model, inputs, train=train)
    assert report.counts() == available_counts(counts)
    patterns = report.by_pattern()
    assert sum(count for pattern, count in patterns.items()
               if pattern.endswith(("norm_modulate", "norm_modulate_scale", "norm_modulate_upcast"))) == modulated
    # the residual add before a modulated norm (DiT's gated `h + gate * attn_out`, PixArt's and
    # Sana's ungated cross-attention output) folded into it
    # each ResNet block's `nonlinearity(norm(x))`, twice (the UNet's output norm and SiLU are in the
    # model's own forward, which fx cannot trace: the norm fuses alone there)
    assert patterns.get("group_norm_silu", 0) == GROUP_NORM_SILU.get(name, 0)
    folded = sum(count for pattern, count in patterns.items()
                 if pattern.startswith(("gated_add_", "add_"))
                 and ("modulate" in pattern or "in_fp32" in pattern))
    assert folded == GATED_SUMS.get(name, 0)
    if name == "wan_vae":  # each norm's tail folded into it, to its last step, then read over the channels
        # where they lie; but one block's map, (1, 32, 2, 8, 8), has its channels innermost already,
        # and the row norm reads that one in place
        assert patterns.get("l2_normalize_over_channels") == counts["rms_norm"] - 1, patterns
        assert patterns.get("l2_normalize_zero_dropped") == 1, patterns
        assert "an added 0 dropped; read over the channels where they lie" in report.table()


@pytest.mark.parametrize("name", ["dit", "pixart", "sd3", "flux"])
def test_adaptive_norms_fuse_under_cuda_autocast_too(name):
    """Under CUDA's fp16/bf16 autocast a 16-bit x's LayerNorm returns fp32 (these models keep
    their residual stream in the autocast dtype), and the modulation runs in fp32: the same norms
    fuse (`*_upcast`), and those only autocast's matmuls read write the 16-bit y themselves (q, k
    and v: three views). The output by the oracle rule against the float64 model, the unfused one
    under the same autocast the yardstick (its loss only, as the other autocast tests: the
    gradients of fp16 matmuls differ with every reordering)."""
    build, _, modulated = MODELS[name]
    model, inputs, train = build()
    with cuda_like_autocast(), torch.autocast("cuda" if DEVICE == "cuda" else "cpu", dtype=torch.float16):
        report = check_against_unfused(lambda: model, inputs, train=train, grads=False)
    found = [r for u in report.units for c in u.unit.captures for r in c.log.replaced if not r.absorbed
             and (r.pattern.endswith("norm_modulate_upcast") or r.pattern.endswith("norm_modulate"))]
    assert len(found) == modulated, report.table()
    assert any(r.pattern.endswith("_upcast") for r in found), report.table()
    # the gated residual add before the MLP's norm folded in as well (the 16-bit residual stream);
    # PixArt's cross-attention output comes out in fp32 beside its fp16 stream, a sum the model
    # rounds as written: left, and the report says why
    if name == "pixart":
        assert "differ in dtype" in report.table()
    else:
        assert any(r.pattern.startswith("gated_add_") for r in found), report.table()
    assert any("only autocast's matmuls read it (3, a view each)" in r.note for r in found), report.table()


def test_wans_gated_add_in_fp32_reads_its_16_bit_stream():
    """Wan trained in 16 bits: its residual stream fp16 (bf16 on a GPU), its modulation and gates
    fp32 (`scale_shift_table + temb.float()`), the gated add written in fp32 and cast back
    (`(h.float() + attn_out * gate).type_as(h)`) before the cross-attention's FP32LayerNorm. The
    op takes the 16-bit stream and the fp32 gate, its sum and norm in fp32 as the model's, and
    the modulated norms of fp32 copies (`norm1(h.float()) * (1 + scale) + shift).type_as(h)`)
    read the 16-bit tensors: no fp32 copy of h is left. Outputs and gradients by the oracle rule."""
    model, inputs, train = wan()
    model = model.to(torch.bfloat16)
    inputs = tuple(t.to(model.model.dtype) if t.is_floating_point() else t for t in inputs)
    report = check_against_unfused(lambda: model, inputs, train=train)
    patterns = report.by_pattern()
    assert patterns["gated_add_in_fp32_layer_norm"] == 2, report.table()
    # the modulated norms of h's (and of the cross-attention's sum's) fp32 copies read the 16-bit
    # tensors and write 16 bits themselves
    assert patterns["fp32_copy_layer_norm_modulate"] == 2, report.table()
    # norm3's fp32 copy with the cross-attention's output added before it (after its Dropout(0.0))
    assert patterns["add_after_inactive_dropout_layer_norm_modulate_upcast"] == 2, report.table()
    # the feed-forward's gated add at the block's end, `(h.float() + ff_out.float() * c_gate).type_as(h)`:
    # the gated dropout_add reads both 16-bit tensors, the linear's bias folded in
    assert patterns["linear_gated_add"] == 2, report.table()
    notes = [r.note for u in report.units for c in u.unit.captures for r in c.log.replaced]
    assert not any("cast back" in note for note in notes), report.table()


def test_a_channels_last_vae_fuses_alike_and_its_group_norms_read_in_place(monkeypatch):
    """The VAE converted to channels_last (diffusers' advice for speed), its input too: the same
    replacements, outputs and gradients by the oracle rule, and every fused GroupNorm reads its
    channels-last input where it lies and writes y in that layout (PyTorch's CUDA GroupNorm
    copies x to contiguous and returns y contiguous, for the next conv to copy back)."""
    from trifuse.kernels import group_norm as gn_mod

    model, inputs, train = vae()
    model = model.to(memory_format=torch.channels_last)
    inputs = tuple(t.to(memory_format=torch.channels_last) for t in inputs)
    layouts = []

    def spy(x, *args, _real=gn_mod.group_norm_fwd):
        y, mean, rstd = _real(x, *args)
        layouts.append((gn_mod.channels_last(x), y.stride() == x.stride()))
        return y, mean, rstd
    monkeypatch.setattr(gn_mod, "group_norm_fwd", spy)
    report = check_against_unfused(lambda: model, inputs, train=train)
    assert report.counts() == available_counts(MODELS["vae"][1])
    assert layouts and set(layouts) == {(True, True)}


def test_the_unets_16_bit_norms_under_cuda_autocast_feed_q_k_v_a_view_each():
    """The UNet's transformer blocks run their residual stream in the autocast dtype, and CUDA's
    autocast returns their LayerNorm's output in fp32: each block's first norm, read by the
    self-attention's q, k and v alone, returns three views of its 16-bit y (their gradients summed
    in fp32 by its backward), not an fp32 copy cast back three times. The output by the oracle
    rule, as above."""
    model, inputs, train = unet()
    with cuda_like_autocast(), torch.autocast("cuda" if DEVICE == "cuda" else "cpu", dtype=torch.float16):
        report = check_against_unfused(lambda: model, inputs, train=train, grads=False)
    views = [r for u in report.units for c in u.unit.captures for r in c.log.replaced
             if "only autocast's matmuls read it (3, a view each)" in r.note]
    assert len(views) == 4, report.table()  # one a BasicTransformerBlock


def test_lumina2_in_16_bits_fuses_as_in_fp32():
    """Lumina 2 trained in bf16: diffusers' RMSNorm rounds the
    normalized value to its 16-bit weight's dtype before the weight (T5's spelling), its FP32SiLU
    takes the SiLU of an fp32 copy and casts back. The weight joins the norm and the scale joins
    them both, as in fp32 (not the weight apart, nor the gate's product folded as a LayerScale);
    outputs and gradients by the oracle rule."""
    build, counts, modulated = MODELS["lumina2"]
    model, inputs, train = build()
    model = model.to(torch.bfloat16)
    inputs = tuple(t.to(model.model.dtype) if t.is_floating_point() else t for t in inputs)
    report = check_against_unfused(lambda: model, inputs, train=train)
    assert report.counts() == available_counts(counts), report.table()
    patterns = report.by_pattern()
    assert patterns["rms_norm_t5_half"] == 11 and patterns["silu_of_fp32_copy_mul"] == 4, report.table()
    assert patterns["rms_norm_modulate_scale"] + patterns["layer_norm_modulate_scale"] \
        + patterns["add_rms_norm_modulate"] == modulated, report.table()


# Mixed-timestep models modulate per token (a timestep per token or per frame: scale and shift
# (B, S, N)); bench/diffusers_models.py builds them (the sweep's builders).
PER_TOKEN = {
    # `(1 + scale) * norm(x) + shift`, chunks of one (B, S, 3N) projection: every LayerNorm of
    # the blocks and the output norm; each block's end `h + gate * (attn + ff)` with its per-token
    # gate (3 per-mode blocks, the joint block's text and content streams), no norm after it in the
    # block's graph
    "flux3": {"layer_norm_modulate_offset": 6, "gated_add": 5},
    # `norm(x) * (1 + scale)`, scale chosen per token by torch.where; the image stream's second
    # norm with the per-token gated add before it (`h + img_gate1 * attn_out`); the block's end
    "qwenimage21": {"layer_norm_modulate_scale_offset": 3, "gated_add_layer_norm_modulate_offset": 2,
                    "gated_add": 2},
    # the RMSNorm form, LTX-2's refiner blocks; the third norm with the cross-attention's output
    # added before it (through its Dropout(0.0)); the per-token gated adds at the block's end
    "sana_wm_refiner": {"rms_norm_modulate_offset": 2, "add_after_inactive_dropout_rms_norm_modulate_offset": 2,
                        "gated_add": 2},
}


@pytest.mark.parametrize("name, dtype", [(name, torch.float32) for name in PER_TOKEN] + [("flux3", torch.float16)],
                         ids=[*PER_TOKEN, "flux3-fp16"])
def test_a_per_token_modulation_fuses_in_mixed_timestep_models(name, dtype):
    """The modulated norms become one op each (the row kernels, `1 + scale` in their loads; with the
    residual add before them where there is one); the prediction and every gradient by the oracle rule against the float64 model (in fp16 too: the
    16-bit modulation computed in fp32 and rounded once)."""
    import diffusers_models

    torch.manual_seed(0)
    model, call, inputs = diffusers_models.BUILDERS[name]()[:3]
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    report = check_against_unfused(lambda: Denoiser(model, call).to(dtype), inputs, train=True)
    patterns = report.by_pattern()
    assert {p: patterns.get(p) for p in PER_TOKEN[name]} == PER_TOKEN[name], report.table()
