"""Every trifuse Triton kernel compiled for a GPU it does not need: Hopper (sm_90) by default.

A session without a GPU still has Triton's compiler, its `ptxas` and `cuobjdump`. This script
compiles, for a chosen target, exactly the kernels trifuse launches for a catalogue of
production shapes (bf16, LLM and BERT widths), and reads back what only a GPU run would
otherwise reveal:

    compiles     the kernel gets through Triton's passes and ptxas for the target
    regs, stack  registers per thread, and local-memory bytes (spills) from the cubin
    smem         shared memory per program, against the device's limit (a launch past it fails)
    SASS         instruction counts that say which path the compiler took: HGMMA (Hopper's
                 warpgroup tensor-core MMA) vs HMMA (the older MMA), UTMALDG/UTMASTG (TMA),
                 LDGSTS (cp.async), LDL/STL (spill traffic)

Two phases. The first runs in a child process under TRITON_INTERPRET=1: it calls each op family
at the catalogue's shapes (small batch, real widths, so that every constexpr and launch option
is what the GPU would get) forward and backward, and records every launch at CachedKernel (the
one launch path of all trifuse kernels) instead of running it. With --spaces, each tuner's whole
config space (after pruning against the H100's limits) is recorded too: the configs a GPU session
would time.
The second compiles each distinct launch through `JITFunction.warmup` with a stand-in driver
that names the target, so nothing is launched and no GPU is asked for.

    python bench/compile_sm90.py [--spaces | --smoke] [--only attention layer_norm ...] [--arch 90]
                                 [--json bench/results/sm90_compile.json] [--md ...]
                                 [--memo tests/kernels/sm90_compile_memo.json [--write-memo]]

--memo reads what earlier compiles of the same launches gave: a launch is compiled again unless
the memo holds it under the same key, the kernel's Triton cache key (its source, the source of
every @jit function it calls, the constexpr globals it reads), the launch's arguments and
constexprs, the target and the Triton version. A compile is deterministic in those, so a hit is
the compile's own result; an edited kernel misses and is compiled. --write-memo writes this run's
rows into the memo and drops the entries whose kernel's source has changed since (the test suite
reads it: regenerate it after editing kernels, or CI compiles them again, a minute or two).

Exit status 1 when any kernel fails to compile, spills, or needs more shared memory than the
target has. Run it with the Triton the GPU has (3.6 on the lent H100) as well as CI's.
"""
import argparse
import collections
import hashlib
import importlib
import json
import os
import pickle
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Shared memory one program may use on Hopper (cudaDevAttrMaxSharedMemoryPerBlockOptin, H100/H200).
HOPPER_SMEM = 232448
SASS_COUNTED = ("HGMMA", "HMMA", "UTMALDG", "UTMASTG", "LDGSTS", "LDL", "STL", "MUFU")

FAMILIES = ("layer_norm", "adaptive_norm_rows", "residual_stream", "bias_gelu", "dropout_add", "gated_activation", "rotary",
            "attention", "attention_dropout", "attention_varlen", "cross_entropy", "cast", "group_norm", "xielu",
            "channel_norm")


# ---------------------------------------------------------------------------------------------
# Phase 1 (child, interpreter): the catalogue, and the launch recorder.
# ---------------------------------------------------------------------------------------------

def _catalogue(torch, family: str):
    """Yields (label, thunk): each thunk runs one op forward and backward at a production width
    (its tensors bound as default arguments: the list is built before any thunk runs)."""
    import trifuse

    bf16, ops = torch.bfloat16, trifuse.ops

    def leaf(*shape, dtype=bf16):
        return torch.randn(*shape, dtype=dtype).requires_grad_()

    def fwd_bwd(fn):
        def run():
            out = fn()
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward([o for o in outs if o is not None and o.requires_grad],
                                    [torch.ones_like(o) for o in outs if o is not None and o.requires_grad])
        return run

    rows = 4
    # The row-wise elementwise kernels' tiles take up to 32 rows (autotune/configs.py's spaces):
    # fewer rows would compile smaller blocks than a training step's thousands of rows get.
    tile_rows = 32
    if family == "layer_norm":
        for n in (768, 1024, 2048, 4096, 8192, 16384, 20000):
            x, w, b = leaf(rows, n), leaf(n), leaf(n)
            yield f"layer_norm {n}", fwd_bwd(lambda x=x, w=w, b=b, n=n: ops.layer_norm(x, n, w, b))
            yield f"rms_norm {n}", fwd_bwd(lambda x=x, w=w, n=n: ops.rms_norm(x, n, w, 1e-6))
        # The registered ops, as trifuse_inductor's graphs call them: their backward op sums only
        # the per-feature vectors autograd asks for (an RMSNorm's dweight alone).
        for n in (1024, 4096):
            x, w, b = leaf(rows, n), leaf(n), leaf(n)
            yield f"registered layer_norm {n}", fwd_bwd(
                lambda x=x, w=w, b=b, n=n: torch.ops.trifuse.layer_norm(x, [n], w, b, 1e-5)[0])
            yield f"registered rms_norm {n}", fwd_bwd(
                lambda x=x, w=w, n=n: torch.ops.trifuse.rms_norm(x, [n], w, 1e-6)[0])
        # The floored RMSNorm F.normalize becomes (clamp_eps), in the two paths: one block, wide rows.
        for n in (1024, 20000):
            x, w = leaf(rows, n), leaf(n, dtype=torch.float32)
            yield f"rms_norm clamp_eps {n}", fwd_bwd(
                lambda x=x, w=w, n=n: ops.rms_norm(x, n, w, 1e-12, clamp_eps=True))
        # The partial sums' reduction as a training step has it: 4 rows above make 4 partial
        # rows, a GPU step up to PROGRAMS_PER_SM x SMs (here 4 x 132).
        from trifuse.kernels import layer_norm as ln_mod

        for n in (1024, 4096, 16384):
            yield f"partial sums 528 x {n}", lambda n=n: _sum_partials_at(torch, ln_mod, 528, n)
        # Diffusion transformers' adaptive norms (DiT 1152, SD3 1536, Flux 3072, and a wide row):
        # the affine read per group of rows, the backward's partial sums per group.
        for n in (1152, 1536, 3072, 20000):
            x, scale, shift = leaf(2, rows, n), leaf(2, 1, n), leaf(2, 1, n)
            for rms in (False, True):
                yield f"{'rms' if rms else 'layer'}_norm_modulate {n}", fwd_bwd(
                    lambda x=x, scale=scale, shift=shift, n=n, rms=rms: ops.layer_norm_modulate(
                        x, n, 1 + scale, shift, eps=1e-6, is_rms_norm=rms))
        # DiT's under autocast, narrowed (fusion/narrow.py): y for the q, k and v projections, the
        # backward summing their three gradients per group.
        for n in (1152, 1536):
            x, scale, shift = leaf(2, rows, n), leaf(2, 1, n), leaf(2, 1, n)
            yield f"layer_norm_modulate {n} -> bf16 x 3 readers", fwd_bwd(
                lambda x=x, scale=scale, shift=shift, n=n: ops.layer_norm_modulate(
                    x, n, 1 + scale, shift, eps=1e-6, out_dtype=bf16, readers=3))
        # DiT's gated residual add folded into the MLP's modulated norm: the gate read per group
        # in the forward; x read again and dgate summed per group in the backward.
        for n in (1152, 3072, 20000):
            x, r, gate = leaf(2, rows, n), leaf(2, rows, n), leaf(2, 1, n)
            scale, shift = leaf(2, 1, n), leaf(2, 1, n)
            for rms in (False, True):
                yield f"gated_add_{'rms' if rms else 'layer'}_norm_modulate {n}", fwd_bwd(
                    lambda x=x, r=r, gate=gate, scale=scale, shift=shift, n=n, rms=rms:
                    ops.gated_add_layer_norm_modulate(x, r, gate, n, 1 + scale, shift, eps=1e-6, is_rms_norm=rms))
    elif family == "adaptive_norm_rows":
        # Per-token modulation (FLUX.3, Qwen-Image 2.1): scale and shift chunks of one (B, S, 3N)
        # projection read in place, `1 + scale` in the load; the backward writes dscale per element.
        # With the norm's own affine too (its partial sums), and a wide row.
        for n in (1152, 3072, 20000):
            x, emb, w, b = leaf(2, rows, n), leaf(2, rows, 3 * n), leaf(n), leaf(n)
            for rms in (False, True):
                for affine in (False, True):
                    yield (f"{'rms' if rms else 'layer'}_norm_modulate per-token {n}{' affine' if affine else ''}",
                           fwd_bwd(lambda x=x, emb=emb, w=w, b=b, n=n, rms=rms, affine=affine:
                                   ops.layer_norm_modulate(x, n, emb[..., n:2 * n], emb[..., :n],
                                                           w if affine else None, b if affine and not rms else None,
                                                           eps=1e-6, is_rms_norm=rms, mul_offset=1.0)))
            # with the per-token gated add before the norm (Qwen-Image 2.1): the residual and the
            # gate read beside x, s stored; dresidual, dx and dgate written per element
            r = leaf(2, rows, n)
            for rms in (False, True):
                yield (f"gated_add_{'rms' if rms else 'layer'}_norm_modulate per-token {n}",
                       fwd_bwd(lambda x=x, r=r, emb=emb, n=n, rms=rms:
                               ops.gated_add_layer_norm_modulate(x, r, emb[..., 2 * n:], n, emb[..., n:2 * n],
                                                                 emb[..., :n], eps=1e-6, is_rms_norm=rms,
                                                                 mul_offset=1.0)))
    elif family == "residual_stream":
        for n in (1024, 4096):
            x, r, w, b, xb = leaf(rows, n), leaf(rows, n), leaf(n), leaf(n), leaf(n)
            yield f"dropout_add_layer_norm {n} p=0.1 bias", fwd_bwd(
                lambda x=x, r=r, w=w, b=b, xb=xb, n=n: ops.dropout_add_layer_norm(x, r, n, w, b, p=0.1, x_bias=xb))
            yield f"rms_norm residual {n}", fwd_bwd(lambda x=x, r=r, w=w, n=n: ops.rms_norm(x, n, w, 1e-6, residual=r))
            yield f"rms_norm_add {n}", fwd_bwd(
                lambda x=x, r=r, w=w, n=n: ops.layer_norm_add(x, r, n, w, None, 1e-6, is_rms_norm=True))
        # Llama's narrowed norms under autocast (fusion/narrow.py): fp32 stream, bf16 y read by
        # three projections (q, k, v), the backward summing their three gradients.
        fp32 = torch.float32
        for n in (2048, 4096):
            x, r, w = leaf(rows, n, dtype=fp32), leaf(rows, n, dtype=fp32), leaf(n, dtype=fp32)
            yield f"rms_norm residual {n} -> bf16 x 3 readers", fwd_bwd(
                lambda x=x, r=r, w=w, n=n: ops.rms_norm(x, n, w, 1e-6, residual=r, out_dtype=bf16,
                                                        readers=3)[0])
        # BERT's post-norm: y in fp32 (the next residual) and in bf16 (the intermediate dense).
        x, r, w, b = leaf(rows, 1024), leaf(rows, 1024, dtype=fp32), leaf(1024), leaf(1024)
        yield "layer_norm residual 1024 -> fp32 and bf16", fwd_bwd(
            lambda x=x, r=r, w=w, b=b: ops.layer_norm(x, 1024, w, b, residual=r, out_dtype=bf16,
                                                      full_y=True)[0])
    elif family == "bias_gelu":
        for n in (3072, 4096):
            x, b = leaf(tile_rows, n), leaf(n)
            for approximate in ("none", "tanh", "quick", "relu", "relu2"):
                yield f"bias_gelu {n} {approximate}", fwd_bwd(
                    lambda x=x, b=b, a=approximate: ops.bias_gelu(x, b, approximate=a))
        yield "bias_gelu 4096 none p=0.1", fwd_bwd(lambda x=x, b=b: ops.bias_gelu(x, b, p=0.1))
        # (last, the smoke's) T5's ReLU and dropout, without a bias
        yield "bias_gelu 4096 relu p=0.1 no bias", fwd_bwd(lambda x=x: ops.bias_gelu(x, None, "relu", p=0.1))
    elif family == "dropout_add":
        # (first, the smoke's) the plain one, then a per-token fp32 gated add of its output with a bias
        # and dropout, every per-token flag on: both of their backward kernels in one call
        x, r, b = leaf(2, tile_rows, 1024), leaf(2, tile_rows, 1024), leaf(1024)
        g = leaf(2, tile_rows, 1024, dtype=torch.float32)
        yield "dropout_add 1024 p=0.1 bias, then a per-token float32 gate p=0.1 bias", fwd_bwd(
            lambda x=x, r=r, g=g, b=b: ops.dropout_add(ops.dropout_add(x, r, 0.1, bias=b), r, 0.1, bias=b, gate=g))
        # the gated add at a diffusion transformer block's end: Flux's bf16 gate; FLUX.3's per-token
        # bf16 gate, and a per-token fp32 one with a bias and dropout (the per-token kernels); then
        # (last, the smoke's) Wan's fp32 gate with a linear's bias folded in and dropout, every flag on
        for n, gate_dtype, bias, p, per_token in ((3072, bf16, False, 0.0, False), (3072, bf16, False, 0.0, True),
                                                  (3072, torch.float32, True, 0.1, True),
                                                  (5120, torch.float32, True, 0.1, False)):
            x, r = leaf(2, tile_rows, n), leaf(2, tile_rows, n)
            g = leaf(2, tile_rows if per_token else 1, n, dtype=gate_dtype)
            b = leaf(n) if bias else None
            kind = "per-token " if per_token else ""
            yield f"gated dropout_add {n} {kind}{str(gate_dtype)[6:]} gate p={p}{' bias' if bias else ''}", fwd_bwd(
                lambda x=x, r=r, g=g, b=b, p=p: ops.dropout_add(x, r, p, bias=b, gate=g))
    elif family == "cast":
        # A post-norm block's fp32 input cast once for its q, k and v projections (BERT), and a
        # cross-attention's encoder states for k and v (T5): the backward sums 3 and 2 gradients.
        from trifuse.kernels.cast import cast_for_readers

        x = leaf(rows, 1024, dtype=torch.float32)
        for readers in (3, 2):
            yield f"cast_for_readers 1024 -> bf16 x {readers}", fwd_bwd(
                lambda x=x, k=readers: cast_for_readers(x, bf16, k))
    elif family == "group_norm":
        # SD's UNet's first level's norm (320 channels, 32 groups) with its SiLU at 8x8, contiguous
        # and channels-last: a row a program (its two kernels); a VAE's one-group norm of 80x80:
        # the chunked four
        x, w, b = leaf(2, 320, 8, 8), leaf(320), leaf(320)
        yield "group_norm 2x320x8x8 silu", fwd_bwd(lambda: ops.group_norm(x, 32, w, b, 1e-5, "silu"))
        xl = leaf(2, 320, 8, 8).detach().to(memory_format=torch.channels_last).requires_grad_()
        yield "group_norm 2x320x8x8 silu channels_last", fwd_bwd(lambda: ops.group_norm(xl, 32, w, b, 1e-5, "silu"))
        # the chunked kernels of both layouts in one call (the smoke compiles the first and the
        # last): the VAE's row contiguous, and 1x128x32x32 in 8 groups read channels-last where
        # it lies (the channels-last sums at 64 channels a program)
        xv, wv, bv = leaf(1, 8, 80, 80), leaf(8), leaf(8)
        xc, wc, bc = leaf(1, 128, 32, 32), leaf(128), leaf(128)
        xc = xc.detach().to(memory_format=torch.channels_last).requires_grad_()
        yield "group_norm 1x8x80x80 silu; 1x128x32x32 g8 silu channels_last", fwd_bwd(
            lambda: (ops.group_norm(xv, 1, wv, bv, 1e-5, "silu"), ops.group_norm(xc, 8, wc, bc, 1e-5, "silu")))
    elif family == "channel_norm":
        # Norms over a contiguous map's channels: a video VAE's F.normalize at 96 channels (one
        # tile each way, the fp32 constant scale), 384 (one tile forward; the backward's tile of
        # 4096 walks them in blocks) and a LayerNorm2d at 1024 (blocks both ways)
        x, w = leaf(1, 96, 4, 32, 32), leaf(96, dtype=torch.float32)
        yield "channel_norm 1x96x4x32x32 l2 floored", fwd_bwd(
            lambda x=x, w=w: ops.channel_norm(x, w, None, 1e-13, rms=True, clamp_eps=True))
        x, w = leaf(1, 384, 32, 32), leaf(384)
        yield "channel_norm 1x384x32x32 rms", fwd_bwd(lambda x=x, w=w: ops.channel_norm(x, w, None, 1e-6, rms=True))
        # ConvNeXt-T's block norm at 56x56 (96 channels): a contiguous map in, y written channels-last
        # (the permuted view the MLP reads), dy read channels-last
        x, w, b = leaf(8, 96, 56, 56), leaf(96), leaf(96)
        yield "channel_norm 8x96x56x56 layer -> channels-last y", fwd_bwd(
            lambda x=x, w=w, b=b: ops.channel_norm(x, w, b, 1e-6, y_channels_last=True))
        x, w, b = leaf(2, 1024, 16, 16), leaf(1024), leaf(1024)
        yield "channel_norm 2x1024x16x16 layer", fwd_bwd(lambda x=x, w=w, b=b: ops.channel_norm(x, w, b, 1e-6))
    elif family == "gated_activation":
        g, u = leaf(tile_rows, 8192), leaf(tile_rows, 8192)
        for act in ("silu", "gelu", "gelu_tanh", "relu2"):
            yield f"gated_activation 8192 {act}", fwd_bwd(lambda act=act, g=g, u=u: ops.gated_activation(g, u, act))
        yield "gated_activation 8192 gelu_tanh p=0.1", fwd_bwd(lambda: ops.gated_activation(g, u, "gelu_tanh", p=0.1))
    elif family == "xielu":
        # Apertus's MLP activation (intermediate 21504 in the 8B), bf16 with fp32 coefficients as
        # under autocast: y in fp32, the coefficients' partial sums
        x = leaf(tile_rows, 21504)
        ap, an = leaf(1, dtype=torch.float32), leaf(1, dtype=torch.float32)
        beta, eps = torch.tensor(0.5), torch.tensor(-1e-6)
        yield "xielu 21504 -> fp32", fwd_bwd(lambda: ops.xielu(x, ap, an, beta, eps, out_dtype=torch.float32))
        yield "xielu 21504", fwd_bwd(lambda: ops.xielu(x, ap.detach().to(bf16).requires_grad_(),
                                                        an.detach().to(bf16).requires_grad_(), beta, eps))
    elif family == "rotary":
        # 128 positions: the tiles of autotune/configs.py's rotary space take up to 128 of them at
        # head dim 64 (fewer would compile smaller blocks than a training step's 2048 positions get)
        positions = 128
        for hq, hkv, d in ((32, 8, 128), (16, 16, 64)):
            q, k = leaf(1, hq, positions, d), leaf(1, hkv, positions, d)
            cos, sin = torch.randn(1, 1, positions, d), torch.randn(1, 1, positions, d)
            for inter in (False, True):
                yield f"rotary {hq}/{hkv}x{d} interleaved={inter}", fwd_bwd(
                    lambda q=q, k=k, cos=cos, sin=sin, i=inter: ops.rotary_embedding(q, k, cos, sin, interleaved=i))
        # DeepSeek-V3's rotary part: 64 features of q (128 heads) and of its one k head, pairs in,
        # halves out, tables of one entry per pair
        q, k = leaf(1, 128, positions, 64), leaf(1, 1, positions, 64)
        cos, sin = torch.randn(1, 1, positions, 32), torch.randn(1, 1, positions, 32)
        yield "rotary 128/1x64 halves_out", fwd_bwd(
            lambda: ops.rotary_embedding(q, k, cos, sin, interleaved=True, halves_out=True))
        # Llama 4's, torchtitan's and torchtune's product: (B, S, H, D) bf16 q and k (transposed
        # views), the interleaved pairs, fp32 tables of one entry per pair, bf16 out (the model's
        # upcast and cast back taken in)
        q, k = leaf(1, positions, 40, 128).transpose(1, 2), leaf(1, positions, 8, 128).transpose(1, 2)
        cos = torch.randn(1, 1, positions, 64, dtype=torch.float32)
        sin = torch.randn(1, 1, positions, 64, dtype=torch.float32)
        yield "rotary 40/8x128 interleaved per-pair (complex), bf16 out", fwd_bwd(
            lambda: ops.rotary_embedding(q, k, cos, sin, interleaved=True, dtype=bf16))
    elif family == "attention":
        s = 128
        for d in (64, 80, 128):
            q, k, v = leaf(1, 2, s, d), leaf(1, 2, s, d), leaf(1, 2, s, d)
            yield f"attention d{d} causal", fwd_bwd(lambda q=q, k=k, v=v: ops.attention(q, k, v, is_causal=True))
            yield f"attention d{d} full", fwd_bwd(lambda q=q, k=k, v=v: ops.attention(q, k, v))
        q, k = leaf(1, 4, s, 128), leaf(1, 2, s, 128)
        yield "attention d128 causal softcap", fwd_bwd(lambda q=q: ops.attention(q, q, q, is_causal=True, softcap=50.0))
        # gpt-oss: GQA at head dim 64 with attention sinks, causal and under a sliding-window float mask
        q, k, v, sinks = leaf(1, 4, s, 64), leaf(1, 2, s, 64), leaf(1, 2, s, 64), leaf(4)
        yield "attention d64 gqa causal sinks", fwd_bwd(
            lambda q=q, k=k, v=v, sinks=sinks: ops.attention(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks))
        window = torch.ones(s, s, dtype=torch.bool).tril().triu(-16)
        window = torch.zeros(1, 1, s, s, dtype=bf16).masked_fill(~window, torch.finfo(bf16).min)
        yield "attention d64 gqa window mask sinks", fwd_bwd(
            lambda q=q, k=k, v=v, sinks=sinks, m=window: ops.attention(q, k, v, m, enable_gqa=True, sinks=sinks))
        # DeepSeek-V2/V3's multi-head latent attention: q and k 192 wide (128 + 64 rotary), v 128
        q, k, v = leaf(1, 2, s, 192), leaf(1, 2, s, 192), leaf(1, 2, s, 128)
        yield "attention MLA d192 v128 causal", fwd_bwd(lambda q=q, k=k, v=v: ops.attention(q, k, v, is_causal=True))
        q, k, v = leaf(2, 2, s, 64), leaf(2, 2, s, 64), leaf(2, 2, s, 64)
        keep = torch.ones(2, 1, 1, s, dtype=torch.bool)
        keep[0, ..., s // 2:] = False
        yield "attention d64 bool key-padding mask", fwd_bwd(lambda q=q, k=k, v=v: ops.attention(q, k, v, attn_mask=keep))
        bias = torch.randn(1, 2, s, s, dtype=bf16).requires_grad_()
        yield "attention d64 float mask with grad", fwd_bwd(lambda q=q, k=k, v=v: ops.attention(q, k, v, attn_mask=bias))
    elif family == "attention_dropout":
        # attention in training with dropout 0.1 on the probabilities: GPT-2's (causal) and BERT's
        # (full) at head dim 64, a GQA model's at 128; dropout's Philox draws cost registers
        # (the smoke compiles the first and the last: head dim 64; dK/dV at 128 spills 72 bytes,
        # kernels/attention.py's _DROPOUT_16BIT_DEFAULT says why it stays)
        s = 128
        q, k, v = leaf(1, 2, s, 64), leaf(1, 2, s, 64), leaf(1, 2, s, 64)
        yield "attention d64 causal dropout", fwd_bwd(
            lambda q=q, k=k, v=v: ops.attention(q, k, v, is_causal=True, dropout_p=0.1))
        q4, k4, v4 = leaf(1, 4, s, 128), leaf(1, 2, s, 128), leaf(1, 2, s, 128)
        yield "attention d128 gqa causal dropout", fwd_bwd(
            lambda q=q4, k=k4, v=v4: ops.attention(q, k, v, is_causal=True, dropout_p=0.1, enable_gqa=True))
        full_dropout = fwd_bwd(lambda q=q, k=k, v=v: ops.attention(q, k, v, dropout_p=0.1))

        def and_its_mask():  # a double backward materializes the mask (attention.dropout_keep)
            from trifuse.kernels.attention import dropout_keep

            full_dropout()
            dropout_keep(torch.tensor([1234], dtype=torch.int64), (1, 2, s, s), 0.1, q)

        yield "attention d64 full dropout, and its mask for a double backward", and_its_mask
    elif family == "attention_varlen":
        # packed sequences (padding-free training): three documents in one row of 128 tokens, GQA
        cu = torch.tensor([0, 40, 100, 128], dtype=torch.int32)
        for d in (64, 128):
            q, k, v = leaf(128, 4, d), leaf(128, 2, d), leaf(128, 2, d)
            yield f"attention_varlen d{d} gqa causal", fwd_bwd(
                lambda q=q, k=k, v=v: ops.attention_varlen(q, k, v, cu, cu, 60, 60, causal=True))
        # gpt-oss: sinks and a sliding window, with attention dropout
        q, k, v, sinks = leaf(128, 4, 64), leaf(128, 2, 64), leaf(128, 2, 64), leaf(4)
        yield "attention_varlen d64 gqa causal dropout sinks window", fwd_bwd(
            lambda q=q, k=k, v=v, sinks=sinks: ops.attention_varlen(
                q, k, v, cu, cu, 60, 60, dropout_p=0.1, causal=True, sinks=sinks, sliding_window=32))
    elif family == "cross_entropy":
        for vocab in (32000, 50257, 128256):
            logits, target = leaf(2, vocab), torch.randint(0, vocab, (2,))
            yield f"cross_entropy {vocab}", fwd_bwd(lambda lg=logits, t=target: ops.cross_entropy(lg, t))
        h, w, t = leaf(8, 64), leaf(50257, 64), torch.randint(0, 50257, (8,))
        yield "linear_cross_entropy 64->50257", fwd_bwd(lambda h=h, w=w, t=t: ops.linear_cross_entropy(h, w, t))


def _sum_partials_at(torch, ln_mod, programs: int, n: int) -> None:
    """The LayerNorm backward's reduction of `programs` fp32 partial rows of width n (dW, dB)."""
    grid, meta = ln_mod._sum_plan(n, programs, {"STORE_DW": True, "STORE_DB": True, "STORE_DXB": False})
    partials = torch.randn(3, programs, n)
    dw, db = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    ln_mod._sum_partials.run(grid, (partials, dw, db, partials, programs, n, programs * n), meta)


def _arg_spec(torch, tl, a):
    if isinstance(a, torch.Tensor):
        return ("tensor", str(a.dtype).removeprefix("torch."), a.data_ptr() % 16 == 0)
    if isinstance(a, tl.dtype):
        return ("tl.dtype", a.name)
    return ("value", a)


def record(families: list[str], spaces: bool, smoke: bool = False) -> list[dict]:
    """Runs the catalogue's host code in this (interpreted) process (the first and last call of
    each family when `smoke`: together they launch every kernel) and returns one dict per launch.
    The launches are recorded, not run: what the host launches never depends on what an earlier
    kernel computed (on 2026-12-02 the smoke's 73 launches and the whole catalogue's 256 were the
    same with every kernel run in the interpreter, which took 6x as long)."""
    import torch
    import triton.language as tl
    from trifuse.autotune import tuner as tuner_mod
    from trifuse.kernels import _launch
    from trifuse.kernels import attention as attention_mod
    from trifuse.kernels import channel_norm as channel_norm_mod
    from trifuse.kernels import group_norm as group_norm_mod

    launches: list[dict] = []
    state = {"label": "", "config": ""}

    def run(self, grid, args, kwargs):
        fn = getattr(self.fn, "fn", self.fn)  # the interpreter's wrapper holds the Python function
        launches.append({
            "kernel": f"{fn.__module__}:{fn.__name__}", "call": state["label"], "config": state["config"],
            "args": [_arg_spec(torch, tl, a) for a in args],
            "kwargs": {k: _arg_spec(torch, tl, v) for k, v in kwargs.items()},
        })

    original_decide = tuner_mod.Tuner._decide
    hopper = tuner_mod.DeviceLimits()  # the H100's limits (what pruning assumes without a device)

    def decide(self, key, launch, args):
        # The configs a GPU session would time for this key, pruned against Hopper's limits:
        # recorded, not run.
        shape = {n: v for n, v in zip(self.key_names, key) if n != "device"}
        if "smem" in shape:
            shape["smem"] = HOPPER_SMEM
        space = list(self.configs(**self._configs_kwargs(shape)))
        if self.prune is not None:
            kwargs = self._prune_kwargs(shape)
            space = [c for c in space if self.prune(c, hopper, **kwargs) is None] or space[:1]
        try:
            for cfg in space:
                state["config"] = f"{self.name} {tuner_mod.config_label(cfg)}"
                launch(cfg, *args)
        finally:
            state["config"] = ""
        return original_decide(self, key, launch, args)

    _launch.CachedKernel.run = run
    # Attention's block sizes as on the GPU, not the interpreter's small test blocks; GroupNorm's
    # blocks and row chunks likewise (an H100's 132 multiprocessors).
    attention_mod.INTERPRET = False
    group_norm_mod._INTERPRET_CAPS, group_norm_mod._ROW_MAX = None, 4096
    group_norm_mod.device_sms = lambda t: 132
    channel_norm_mod._INTERPRET_TILE, channel_norm_mod.MIN_RUN, channel_norm_mod.RUN = None, 16, 64
    channel_norm_mod.device_sms = lambda t: 132
    if spaces:
        tuner_mod.Tuner._decide = decide
    torch.manual_seed(0)
    for family in families:
        calls = list(_catalogue(torch, family))
        for label, thunk in (calls[:1] + calls[-1:] if smoke and len(calls) > 1 else calls):
            state["label"] = f"{family}: {label}"
            thunk()
    return launches


# ---------------------------------------------------------------------------------------------
# Phase 2 (this process, compiler only): compile each distinct launch for the target.
# ---------------------------------------------------------------------------------------------

class _TargetOnlyDriver:
    """Enough of a Triton driver for `JITFunction.warmup` to compile for `target`: no device."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else name


def _materialize(torch, tl, spec):
    kind = spec[0]
    if kind == "tensor":
        dtype = getattr(torch, spec[1])
        buf = torch.empty(64, dtype=dtype)
        return buf if spec[2] else buf[1:]  # an address off the 16-byte grid, as recorded
    if kind == "tl.dtype":
        return tl.dtype(spec[1])
    return spec[1]


def _resources(cubin: bytes) -> dict:
    """Registers, stack (spill) bytes and SASS instruction counts of one cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=False).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=False).stdout
    out = {}
    for field in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"\b{field}:(\d+)", usage)
        out[field.lower()] = int(m.group(1)) if m else None
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    counts = collections.Counter(op for op in opcodes)
    out["sass"] = {name: sum(v for k, v in counts.items() if k == name or k.startswith(name + "_"))
                   for name in SASS_COUNTED}
    out["instructions"] = len(opcodes)
    return out


def memo_key(fn, launch_key: str, arch: int) -> str:
    """What a compile's result is a function of: the kernel's Triton cache key (source, callees,
    constexpr globals), the launch, the target, the Triton version (and with it ptxas)."""
    import triton

    return hashlib.sha256(json.dumps([fn.cache_key, launch_key, arch, triton.__version__]).encode()).hexdigest()


def read_memo(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    return json.loads(path.read_text())["entries"]


def write_memo(path: Path, memo: dict, rows: list[dict]) -> None:
    """The memo with this run's rows added, less the entries of kernels whose cache key has changed
    (an edited kernel's old results can never be hit again)."""
    entries = {**memo, **{r["memo_key"]: {k: v for k, v in r.items() if k not in ("calls", "memo_key", "memo_hit")}
                          for r in rows if "memo_key" in r and not r["error"]}}
    live = {}
    for key, row in entries.items():
        fn = getattr(importlib.import_module(row["kernel_path"][0]), row["kernel_path"][1], None)
        if fn is not None and getattr(fn, "cache_key", None) == row["cache_key"]:
            live[key] = row
    path.write_text(json.dumps({"note": "bench/compile_sm90.py --memo: compile results by launch (see its doc)",
                                "entries": dict(sorted(live.items()))}, indent=0, sort_keys=True, default=str) + "\n")


def compile_all(launches: list[dict], arch: int, memo: dict | None = None) -> list[dict]:
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    memo = memo or {}

    previous = triton.runtime.driver._active  # None on a machine without a GPU
    triton.runtime.driver.set_active(_TargetOnlyDriver(GPUTarget("cuda", arch, 32)))
    distinct: dict[str, dict] = {}
    for launch in launches:
        key = json.dumps([launch["kernel"], launch["args"], sorted(launch["kwargs"].items())], default=str)
        entry = distinct.setdefault(key, {**launch, "calls": [], "launch_key": key})
        entry["calls"].append(launch["config"] or launch["call"])
    rows = []
    try:
        for entry in distinct.values():
            module, name = entry["kernel"].split(":")
            fn = getattr(importlib.import_module(module), name)
            args = [_materialize(torch, tl, a) for a in entry["args"]]
            kwargs = {k: _materialize(torch, tl, v) for k, v in entry["kwargs"].items()}
            row = {"kernel": name, "module": module.rsplit(".", 1)[-1], "calls": sorted(set(entry["calls"])),
                   "launch": {k: v[1] for k, v in entry["kwargs"].items()}}
            row["memo_key"] = memo_key(fn, entry["launch_key"], arch)
            row["kernel_path"], row["cache_key"] = [module, name], fn.cache_key
            hit = memo.get(row["memo_key"])
            if hit is not None:
                rows.append({**hit, **row, "memo_hit": True})
                continue
            t0 = time.perf_counter()
            try:
                compiled = fn.warmup(*args, grid=(1,), **kwargs)
                row.update(_resources(compiled.asm["cubin"]))
                row["smem"] = int(compiled.metadata.shared)
                row["num_warps"] = int(compiled.metadata.num_warps)
                row["error"] = ""
            except Exception as e:  # noqa: BLE001  (a kernel that does not compile is the finding, not a crash)
                # Triton's CompilationError ends with the source line and a caret; the reason is
                # its cause (or its first line)
                cause = e.__cause__ or e
                lines = [ln for ln in str(cause).strip().splitlines() if ln.strip() and ln.strip() != "^"]
                row["error"] = f"{type(e).__name__}: {type(cause).__name__}: {lines[-1][:300] if lines else ''}"
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
    finally:
        triton.runtime.driver._active = previous
    return rows


def problems(row: dict, smem_limit: int = HOPPER_SMEM) -> list[str]:
    """What would go wrong on the GPU: no compile, spills, shared memory past the limit."""
    if row["error"]:
        return [row["error"]]
    out = []
    if row.get("stack") or row["sass"].get("LDL") or row["sass"].get("STL"):
        out.append(f"spills ({row.get('stack')} B stack, {row['sass']['LDL']} LDL / {row['sass']['STL']} STL)")
    if row["smem"] > smem_limit:
        out.append(f"needs {row['smem']} B shared memory, the limit is {smem_limit}")
    if row.get("reg") and row["reg"] * 32 * row["num_warps"] > 65536:
        out.append(f"{row['reg']} registers x {32 * row['num_warps']} threads exceed the 64K register file")
    return out


def _is_default(row: dict) -> bool:
    """Whether a catalogue call launched it (its label is "family: call"), not only a tuner's
    config list (labels "tuner config")."""
    return any(": " in call for call in row["calls"])


def _table(rows: list[dict]) -> list[str]:
    lines = ["| kernel | launch | calls | regs | stack B | smem KiB | HGMMA | HMMA | TMA | LDGSTS | problems |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["module"], r["kernel"], json.dumps(r["launch"], default=str))):
        shown = {k: v for k, v in r["launch"].items() if k.isupper() or k in ("num_warps", "num_stages")}
        launch = " ".join(f"{k}={v}" for k, v in shown.items())
        calls = "; ".join(r["calls"][:2]) + (f" (+{len(r['calls']) - 2})" if len(r["calls"]) > 2 else "")
        if r["error"]:
            lines.append(f"| {r['kernel']} | {launch} | {calls} | | | | | | | | {r['error']} |")
            continue
        s = r["sass"]
        lines.append(f"| {r['kernel']} | {launch} | {calls} | {r['reg']} | {r['stack']} | {r['smem'] / 1024:.1f} "
                     f"| {s['HGMMA']} | {s['HMMA']} | {s['UTMALDG'] + s['UTMASTG']} | {s['LDGSTS']} "
                     f"| {'; '.join(problems(r))} |")
    return lines


def markdown(rows: list[dict], header: str) -> str:
    """A summary per kernel, then every launch with a problem, then every launch the catalogue's
    calls made (the tuners' other configs are in the JSON)."""
    columns = "| kernel | compiled | default launches | registers | most smem KiB | on HGMMA | on TMA | with problems |"
    lines = [header, "", columns, "|---|---|---|---|---|---|---|---|"]
    by_kernel: dict[str, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_kernel[r["kernel"]].append(r)
    for name, group in sorted(by_kernel.items()):
        ok = [r for r in group if not r["error"]]
        regs = sorted(r["reg"] for r in ok)
        lines.append(f"| {name} | {len(group)} | {sum(map(_is_default, group))} "
                     f"| {f'{regs[0]}-{regs[-1]}' if regs else ''} | {max((r['smem'] for r in ok), default=0) / 1024:.1f} "
                     f"| {sum(r['sass']['HGMMA'] > 0 for r in ok)} "
                     f"| {sum(r['sass']['UTMALDG'] + r['sass']['UTMASTG'] > 0 for r in ok)} "
                     f"| {sum(bool(problems(r)) for r in group)} |")
    flagged = [r for r in rows if problems(r)]
    lines += ["", f"## With problems ({len(flagged)})", "", *_table(flagged)]
    defaults = [r for r in rows if _is_default(r)]
    lines += ["", f"## Default launches ({len(defaults)})", "", *_table(defaults)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--spaces", action="store_true", help="also every config the tuners would time")
    parser.add_argument("--smoke", action="store_true", help="two calls per family: every kernel (the test)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90 = Hopper)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--memo", type=Path, help="earlier compile results to reuse where the key matches")
    parser.add_argument("--write-memo", action="store_true", help="write this run's results into --memo")
    parser.add_argument("--record-to", type=Path, help=argparse.SUPPRESS)  # the child's side
    args = parser.parse_args(argv)

    if args.record_to is not None:
        launches = record(args.only, args.spaces, args.smoke)
        args.record_to.write_bytes(pickle.dumps(launches))
        return 0

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("run without TRITON_INTERPRET: the kernels are compiled, not interpreted "
                     "(the recording child sets it itself)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "launches.pkl"
        env = {**os.environ, "TRITON_INTERPRET": "1", "TRIFUSE_AUTOTUNE": "0"}
        cmd = [sys.executable, __file__, "--record-to", str(out), "--only", *args.only]
        cmd += (["--spaces"] if args.spaces else []) + (["--smoke"] if args.smoke else [])
        subprocess.run(cmd, env=env, check=True)
        launches = pickle.loads(out.read_bytes())

    import torch
    import triton

    t0 = time.perf_counter()
    memo = read_memo(args.memo)
    rows = compile_all(launches, args.arch, memo)
    if args.write_memo and args.memo is not None:
        write_memo(args.memo, memo, rows)
    bad = [(r, problems(r)) for r in rows if problems(r)]
    header = (f"# Kernels compiled for sm_{args.arch} without a GPU\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · triton {triton.__version__} · "
              f"torch {torch.__version__} · python {platform.python_version()} · {len(launches)} launches recorded, "
              f"{len(rows)} distinct ({sum(1 for r in rows if r.get('memo_hit'))} from the memo), "
              f"compiled in {time.perf_counter() - t0:.0f} s · "
              f"{'tuning spaces included' if args.spaces else 'the configs the catalogue launched'} · "
              f"{len(bad)} with problems")
    text = markdown(rows, header)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"arch": args.arch, "triton": triton.__version__, "torch": torch.__version__,
                                         "date": time.strftime("%Y-%m-%d"), "rows": rows}, default=str))
    if args.md:
        args.md.write_text(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
