"""Attention against PyTorch's SDPA backends (flash, efficient, cuDNN, math) and, when
importable, flash-attn and xformers.

    python bench/bench_attention.py            # full sweep on the GPU, writes bench/results/
    python bench/bench_attention.py --tma      # the forward through tensor descriptors (opt-in,
                                               # TRIFUSE_ATTENTION_TMA=1) against the pointer path
    pytest bench/bench_attention.py            # CPU: a tiny smoke in the interpreter

FLOPs per step, q/k/v (B, H, S, D), S queries and S keys (FlashAttention's convention):
    fwd      4·B·H·S·S·D          two matmuls (Q K^T and P V) of 2·S·S·D each per head
    bwd      2.5 × fwd            five matmuls (Q K^T recomputed, dV, dP, dQ, dK)
    fwd+bwd  3.5 × fwd
Causal attention counts half of each (only the lower triangle is computed).
The "softcap" variant is Gemma 2 9B's attention (16 query heads over 8 kv heads, head dim 256,
logit soft cap 50, causal): SDPA has no soft cap, so its baselines are what a Gemma 2 user runs
instead, transformers' eager code (scores materialized), FlexAttention with a tanh score_mod
(compiled), and flash-attn's softcap when importable.
The dropout variants are GPT-2 medium's and BERT-large's attention in training (dropout 0.1 on the
probabilities); every implementation draws its own masks, so their outputs are not compared.
The "mla" variant is DeepSeek-V2/V3's multi-head latent attention as it reaches SDPA: q and k
192 wide (128 + 64 rotary features), v 128 (so fwd counts 2·B·H·S·S·(192 + 128)); flash
backends that need one head dim for q, k and v report an error there.
Peak memory is what one step allocates above what was allocated before it (inputs excluded):
the output, the saved statistics and, for fwd+bwd, the gradients.
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import trifuse
from trifuse.kernels import attention as attn_mod

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
MODES = ("fwd", "fwd+bwd")
# (B, H, S, D), per variant
SHAPES = {
    "causal": ((4, 16, 2048, 128), (8, 16, 1024, 64), (2, 16, 8192, 128)),
    "full": ((4, 16, 2048, 128), (16, 12, 512, 64)),
    "softcap": ((2, 16, 4096, 256),),
    "mla": ((2, 16, 4096, 192),),
    # attention dropout 0.1, as GPT-2 medium and BERT-large train (one draw per probability)
    "causal, dropout 0.1": ((8, 16, 1024, 64),),
    "full, dropout 0.1": ((16, 16, 512, 64),),
}
DROPOUT = {"causal, dropout 0.1": 0.1, "full, dropout 0.1": 0.1}
MLA_DV = 128 if H.on_gpu() else 8
SOFTCAP, SOFTCAP_KV_HEADS = 50.0, 8


def make_inputs(shape):
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
    return (q, k, v), (q, k, v)


def make_gqa_inputs(shape):
    b, h, s, d = shape
    h_kv = min(h, SOFTCAP_KV_HEADS)
    q = torch.randn(b, h, s, d, device=DEVICE, dtype=DTYPE, requires_grad=True)
    k, v = (torch.randn(b, h_kv, s, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    return (q, k, v), (q, k, v)


def make_mla_inputs(shape):
    b, h, s, d = shape
    q, k = (torch.randn(b, h, s, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    v = torch.randn(b, h, s, MLA_DV, device=DEVICE, dtype=DTYPE, requires_grad=True)
    return (q, k, v), (q, k, v)


def softcap_providers() -> dict:
    """Gemma 2's capped causal GQA attention, each way a user can run it."""
    def hf_eager(q, k, v):  # transformers' gemma2 eager_attention_forward (repeat_kv, fp32 softmax)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        w = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
        w = torch.tanh(w / SOFTCAP) * SOFTCAP
        causal = torch.ones(w.shape[-2:], dtype=torch.bool, device=w.device).tril()
        w = w.masked_fill(~causal, torch.finfo(w.dtype).min)
        return torch.matmul(torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)

    out = {
        "trifuse": lambda q, k, v: trifuse.ops.attention(q, k, v, is_causal=True, enable_gqa=True, softcap=SOFTCAP),
        "hf-eager": hf_eager,
    }
    if not H.on_gpu():
        return out
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
        masks = {}

        def flex_fn(q, k, v):
            s = q.shape[2]
            if s not in masks:
                masks[s] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s, device=q.device)
            return flex(q, k, v, score_mod=lambda score, b, h, qi, ki: SOFTCAP * torch.tanh(score / SOFTCAP),
                        block_mask=masks[s], enable_gqa=True)
        out["flex-attention"] = flex_fn
    except ImportError:
        pass
    flash_attn = H.try_import("flash_attn")
    if flash_attn is not None:
        out["flash-attn"] = lambda q, k, v: flash_attn.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softcap=SOFTCAP).transpose(1, 2)
    return out


def flops_for(shape, mode, causal: bool, dv: int | None = None) -> float:
    b, h, s, d = shape
    fwd = 2 * b * h * s * s * (d + (d if dv is None else dv)) * (0.5 if causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode]


def _sdpa(backend: SDPBackend, causal: bool, dropout_p: float = 0.0):
    def fn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
    return fn


def providers(causal: bool, dropout_p: float = 0.0) -> dict:
    p = dropout_p
    out = {
        # trifuse's kernels, always: trifuse.ops.attention may choose another implementation
        # (its dialect), which the "trifuse.ops (dialect)" provider measures.
        "trifuse": lambda q, k, v: attn_mod._attention_trifuse(q, k, v, None, p, causal, None, False),
        "trifuse.ops (dialect)": lambda q, k, v: trifuse.ops.attention(q, k, v, dropout_p=p, is_causal=causal),
        "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION, causal, p),
        "sdpa-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION, causal, p),
        "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, causal, p),
        "sdpa-math": _sdpa(SDPBackend.MATH, causal, p),
    }
    if not H.on_gpu():
        return {name: out[name] for name in ("trifuse", "trifuse.ops (dialect)", "sdpa-math")}
    flash_attn = H.try_import("flash_attn")
    if flash_attn is not None:
        # (B, S, H, D) views of the same tensors: flash-attn takes any strides with a unit last one.
        out["flash-attn"] = lambda q, k, v: flash_attn.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p, causal=causal).transpose(1, 2)
    xops = H.try_import("xformers.ops")
    if xops is not None:
        bias = xops.LowerTriangularMask() if causal else None
        out["xformers"] = lambda q, k, v: xops.memory_efficient_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=bias, p=p).transpose(1, 2)
    return out


def tma_providers(causal: bool) -> dict:
    """trifuse's kernels with and without the tensor-descriptor forward allowed (the tuner then
    times both kinds of config and keeps the faster), beside SDPA's flash and cuDNN."""
    base = providers(causal)

    def tma_allowed(q, k, v):
        os.environ["TRIFUSE_ATTENTION_TMA"] = "1"
        try:
            return base["trifuse"](q, k, v)
        finally:
            del os.environ["TRIFUSE_ATTENTION_TMA"]

    out = {"trifuse": base["trifuse"], "trifuse (TMA allowed)": tma_allowed}
    return {**out, **{name: base[name] for name in ("sdpa-flash", "sdpa-cudnn", "sdpa-math") if name in base}}


def with_peak_memory(rows: list[dict], shapes, fns: dict, make) -> list[dict]:
    """Adds each timed row's peak memory (MiB) for one step."""
    by_shape = {"x".join(map(str, s)): s for s in shapes}
    for row in rows:
        if "ms" in row:
            shape = by_shape[row["shape"]]
            step = H.make_step(fns[row["provider"]], lambda: make(shape), row["mode"])
            row["peak MiB"] = H.peak_memory_mib(step)
            row["S"] = shape[2]
    if H.on_gpu():
        torch.cuda.empty_cache()
    return rows


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path and its registered op, beside SDPA
    and the explicit softmax(Q K^T / sqrt(d)) V that HF's "eager" attention runs."""
    shape = (1, 2, 16, 64)

    def registered(q, k, v):
        return torch.ops.trifuse.attention(q, k, v, None, 0.0, True, None, False)[0]

    def explicit(q, k, v):
        s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        return torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v

    fns = {
        "trifuse eager path": providers(True)["trifuse"],
        "trifuse.ops.attention (dialect)": providers(True)["trifuse.ops (dialect)"],
        "trifuse registered op": registered,
        "torch F.scaled_dot_product_attention":
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "torch explicit softmax(QK^T)V": explicit,
    }
    cases = {f"{name} {mode}": H.make_step(fn, lambda: make_inputs(shape), mode)
             for mode in MODES for name, fn in fns.items()}
    return H.host_overhead_rows(cases)


# Each variant's results are checked against this provider's: one that takes every shape of the
# variant (SDPA's flash backend refuses latent attention's D 192 with Dv 128; math takes it).
# None: no check, with dropout every implementation draws its own mask (the tests check ours).
REFERENCE = {"softcap": "hf-eager", "mla": "sdpa-math", "causal, dropout 0.1": None, "full, dropout 0.1": None}

COLUMNS = ("provider", "variant", "mode", "shape", "ms", "TFLOP/s", "graph ms", "graph TFLOP/s", "peak MiB",
           "x vs sdpa-flash", "x vs sdpa-cudnn", "x vs sdpa-efficient", "x vs sdpa-math", "x vs flash-attn",
           "x vs xformers", "x vs hf-eager", "x vs flex-attention", "error", "graph error")


def main(argv: list[str]) -> None:
    tma = "--tma" in argv
    rows = []
    for variant, shapes in SHAPES.items():
        causal = not variant.startswith("full")
        if tma and variant in ("softcap", "mla", *DROPOUT):
            continue
        dv = None
        if tma:
            fns, make = tma_providers(causal), make_inputs
        elif variant == "softcap":
            fns, make = softcap_providers(), make_gqa_inputs
        elif variant == "mla":
            fns, make, dv = providers(causal), make_mla_inputs, MLA_DV
        else:
            fns, make = providers(causal, DROPOUT.get(variant, 0.0)), make_inputs
        swept = H.sweep(fns, shapes, make, flops_for=lambda s, m, causal=causal, dv=dv: flops_for(s, m, causal, dv),
                        modes=MODES, reference=REFERENCE.get(variant, "sdpa-flash"), x_name="D",
                        variant=variant)
        rows += with_peak_memory(swept, shapes, fns, make)
    if tma:
        H.print_table(rows, COLUMNS)
        H.write_results("attention", rows, COLUMNS, plot_x="S", plot_y="TFLOP/s", suffix="tma")
        return
    overhead = host_overhead()
    H.print_table(rows, COLUMNS)
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("attention", rows, COLUMNS, plot_x="S", plot_y="TFLOP/s")
    H.write_results("attention", overhead, ("provider", "host µs"), suffix="host-overhead")


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (2, 16, 1024, 64) if H.on_gpu() else (1, 2, 24, 16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", ["trifuse", "trifuse.ops (dialect)", "sdpa-math"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention(benchmark, provider, mode, causal):
    fns = providers(causal)
    H.check_against_reference(fns, "sdpa-math", make_inputs, SMOKE_SHAPE)
    step = H.make_step(fns[provider], lambda: make_inputs(SMOKE_SHAPE), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)
    assert flops_for(SMOKE_SHAPE, mode, causal) > 0


@pytest.mark.parametrize("mode", MODES)
def test_softcap_providers(benchmark, mode):
    fns = softcap_providers()
    H.check_against_reference(fns, "hf-eager", make_gqa_inputs, SMOKE_SHAPE)
    step = H.make_step(fns["trifuse"], lambda: make_gqa_inputs(SMOKE_SHAPE), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_mla_providers_agree():
    """v narrower than q and k: the kernels against SDPA's math backend (the flash ones refuse it)."""
    H.check_against_reference({n: f for n, f in providers(True).items() if n in ("trifuse", "sdpa-math")},
                              "sdpa-math", make_mla_inputs, SMOKE_SHAPE)


@pytest.mark.parametrize("variant", list(DROPOUT))
def test_dropout_providers_run_and_drop(variant):
    """Each provider of a dropout variant runs forward and backward, and trifuse's output is not
    the one without dropout."""
    causal = not variant.startswith("full")
    fns = providers(causal, DROPOUT[variant])
    for fn in fns.values():
        H.make_step(fn, lambda: make_inputs(SMOKE_SHAPE), "fwd+bwd")()
    (q, k, v), _ = make_inputs(SMOKE_SHAPE)
    with torch.no_grad():
        assert not torch.equal(fns["trifuse"](q, k, v), providers(causal)["trifuse"](q, k, v))
    assert REFERENCE[variant] is None and variant in SHAPES


def test_host_overhead_runs():
    rows = host_overhead()
    assert all(r["host µs"] > 0 for r in rows)


def test_tma_providers_agree():
    H.check_against_reference(tma_providers(True), "sdpa-math", make_inputs, SMOKE_SHAPE)


if __name__ == "__main__":
    main(sys.argv[1:])
