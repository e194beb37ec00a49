"""End-to-end training: HF GPT-2 medium, BERT-large and a Llama 3.2 1B-shaped Llama from configs,
and diffusers' DiT-XL/2 (256 px, class-conditional, the noise predicted from a noisy latent:
"tokens" are its 256 patches a sample), eager (SDPA) against `trifuse.fuse(model)` (and
torch.compile with --compile; Liger-Kernel's patched Llama when it loads), bf16 autocast, AdamW.

    python bench/bench_e2e.py [--compile] [--steps 10] [--grad-ckpt]   # GPU: bench/results/e2e.*
    pytest bench/bench_e2e.py                             # CPU: a tiny config, one step each

Reports tokens/s, step time, peak memory (allocated, and reserved by the allocator: a CUDA graph's
pool holds its freed temporaries) and set-up time (the fuse or compile call plus the first three
steps' excess over a steady step), all measured in this process, and of it, for the fused runs,
the time spent tuning ("tuning s": kernel configs and op dialects chosen in those steps, the
costliest listed in the JSON); for each provider a profile of one more step: its top CUDA kernels
(e2e-top-kernels.*) and how busy the GPU was over the step's wall time (what host overhead
leaves); for the fused runs, what each op's dialect chose and why (the rows' "dialect choices",
in the log and the JSON); and a bar plot of tokens/s (e2e.png).
"""
import argparse
import collections
import gc
import os
import re
import time
from unittest import mock

import _harness as H  # noqa: I001
import pytest
import torch

import trifuse
from trifuse.autotune import decisions

transformers = H.try_import("transformers")

MODELS = {
    # name: (config factory kwargs, batch, sequence)
    "gpt2-medium": ("gpt2", dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024), 8, 1024),
    "bert-large": ("bert", dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                                intermediate_size=4096), 16, 512),
    # Llama 3.2 1B's shape (GQA, SwiGLU, RoPE, RMSNorm, a 128256 vocabulary, tied embeddings):
    # Liger-Kernel's own end-to-end benchmark family
    "llama-1b": ("llama", dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
                               num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                               max_position_embeddings=2048, tie_word_embeddings=True), 4, 2048),
    # DiT-XL/2 at 256 px (32 x 32 latents, 2 x 2 patches: 256 tokens), its adaLN-Zero blocks
    "dit-xl": ("dit", dict(num_layers=28, num_attention_heads=16, attention_head_dim=72, in_channels=4,
                           out_channels=8, sample_size=32, patch_size=2, num_embeds_ada_norm=1000), 32, 256),
}
TINY = {
    "gpt2-medium": ("gpt2", dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128), 2, 16),
    "bert-large": ("bert", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                intermediate_size=128, vocab_size=128), 2, 16),
    "llama-1b": ("llama", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                               tie_word_embeddings=True), 2, 16),
    "dit-xl": ("dit", dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, in_channels=4,
                           out_channels=8, sample_size=8, patch_size=2, num_embeds_ada_norm=10), 2, 16),
}

DiffusionOutput = collections.namedtuple("DiffusionOutput", "loss")


class DiffusionLoss(torch.nn.Module):
    """A diffusion model's training loss as a training loop computes it: the noise predicted from
    a noisy latent (the first `in_channels` output channels; DiT predicts a variance too), mean
    squared error in fp32."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, sample, timestep, class_labels, noise):
        pred = self.model(sample, timestep=timestep, class_labels=class_labels).sample
        return DiffusionOutput(torch.nn.functional.mse_loss(pred[:, :noise.shape[1]].float(), noise.float()))


def build(kind: str, kwargs: dict, device: str) -> torch.nn.Module:
    if kind == "gpt2":
        cfg = transformers.GPT2Config(**kwargs, attn_implementation="sdpa")
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(**kwargs, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "dit":
        model = DiffusionLoss(H.try_import("diffusers").DiTTransformer2DModel(**kwargs))
    else:
        cfg = transformers.BertConfig(**kwargs, attn_implementation="sdpa")
        model = transformers.BertForMaskedLM(cfg)
    return model.to(device)


def make_batch(kind: str, model: torch.nn.Module, batch: int, seq: int, device: str) -> dict:
    if kind == "dit":  # seq: the patches of a latent
        cfg = model.config
        latent = torch.randn(batch, cfg.in_channels, cfg.sample_size, cfg.sample_size, device=device)
        noise = torch.randn_like(latent)
        labels = torch.randint(0, cfg.num_embeds_ada_norm, (batch,), device=device)
        return {"sample": latent + noise, "timestep": torch.randint(0, 1000, (batch,), device=device),
                "class_labels": labels, "noise": noise}
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    if kind in ("gpt2", "llama"):
        return {"input_ids": ids, "labels": ids, "use_cache": False}
    labels = torch.full_like(ids, -100)
    masked = torch.rand(ids.shape, device=device) < 0.15
    labels[masked] = ids[masked]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def train_steps(model, opt, batch, steps: int, autocast: bool) -> list[float]:
    """Wall seconds of each step (synchronized), forward + backward + optimizer."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def run_one(name: str, provider: str, spec, steps: int, device: str, checkpointing: bool = False) -> dict:
    kind, kwargs, batch, seq = spec
    if torch.cuda.is_available():  # the providers before gave their memory back: peaks are this one's
        gc.collect()
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = build(kind, kwargs, device)  # same seed: every provider starts from the same weights
    model.train()
    if checkpointing:  # transformers' gradient checkpointing, before fuse/compile as users do it
        model.gradient_checkpointing_enable()
    decided_before = set(map(id, decisions.records()))
    if provider.startswith("compile("):
        torch._dynamo.reset()  # a graph another provider compiled (another env) is not reused
    dynamo_before = _dynamo_seconds()  # (after the reset, which clears Dynamo's time metrics)
    t_setup = time.perf_counter()
    if provider == "trifuse.fuse":
        trifuse.fuse(model)
    elif provider == "trifuse.fuse(skip_logits)":  # the loop uses only .loss: the head fuses with it
        trifuse.fuse(model, skip_logits=True)
    elif provider == "trifuse.fuse(cuda_graphs)":  # blocks replayed from CUDA graphs (built in step 2)
        trifuse.fuse(model, cuda_graphs=True)
    elif provider == "torch.compile":
        model = torch.compile(model)
    elif provider.startswith("compile("):  # compile(backend=trifuse_inductor, mode=reduce-overhead)
        model = torch.compile(model, **compile_kwargs(provider))
    elif provider == "liger":  # Liger-Kernel's kernels patched into this model instance
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    setup_call = time.perf_counter() - t_setup
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = make_batch(kind, model, batch, seq, device)
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    first = train_steps(model, opt, data, 1, gpu)[0]
    warm = train_steps(model, opt, data, 2 if gpu else 0, gpu)
    timed = train_steps(model, opt, data, steps, gpu)
    step = sorted(timed)[len(timed) // 2]
    row = {
        "model": name + (" (grad ckpt)" if checkpointing else ""), "provider": provider,
        "batch x seq": f"{batch}x{seq}",
        "step ms": step * 1e3, "tokens/s": batch * seq / step,
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan"),
        # What the allocator held: tensors plus its cached free blocks, and a CUDA graph's private
        # pool, whose freed temporaries count as reserved, not allocated (each graphed block's own
        # pool keeps its forward's and backward's temporaries). What an out-of-memory error sees.
        "peak reserved GiB": torch.cuda.max_memory_reserved() / 2**30 if gpu else float("nan"),
        # the first steps' excess over a steady one: captures, tuning, CUDA graphs (built in step 2)
        "set-up s": setup_call + sum(max(0.0, t - step) for t in [first, *warm]),
    }
    if provider.startswith("trifuse.fuse"):
        row["fused"] = _fused_summary(model)
        graphs = [u.graphs.summary() for u in _block_units(model) if u.graphs is not None]
        if graphs:
            row["cuda graphs"] = graphs
    if "trifuse" in provider:
        row["dialect choices"] = _dialect_choices()
        # What the first steps spent tuning (compiles, checks, timing), of the set-up above.
        new = [d for d in decisions.records() if id(d) not in decided_before]
        row["tuning s"], row["costliest decisions"] = decisions.set_up_seconds(new)
    if provider == "torch.compile" or provider.startswith("compile("):
        row.update(_dynamo_seconds(dynamo_before))
    top, busy, device_ms = profile_step(model, opt, data, gpu)
    row["device busy %"] = busy
    row["device ms"] = device_ms
    row["top kernels"] = top
    del warm, opt, model
    return row


# Each GPU kernel's kind, by its name (first match): where two providers' device times differ.
KERNEL_KINDS = (
    ("attention", re.compile(r"sdpa|flash|fmha|_attn_|attention", re.I)),
    ("matmul", re.compile(r"nvjet|gemm|cutlass|xmma|cublas|sm\d\d_", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply")),
    ("Inductor's Triton", re.compile(r"^triton_")),
    ("trifuse's Triton", re.compile(r"^_\w+$")),  # trifuse's kernels: `_layer_norm_fwd_kernel`, ...
    ("aten elementwise, copies", re.compile(r"elementwise|vectorized|copy|fill|unrolled", re.I)),
    ("aten reductions", re.compile(r"reduce|softmax|norm|nll|cross_entropy", re.I)),
)


def kernel_kind(name: str) -> str:
    """The KERNEL_KINDS entry a kernel's name matches first, else "other"."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def profile_step(model, opt, data, gpu: bool, top: int = 12) -> tuple[list[dict], float, float]:
    """One more step under torch.profiler: the `top` kernels by self device time (on a CPU, the
    ops by self CPU time), how busy the device was over the step's wall time (device time /
    wall: what host overhead leaves of the GPU) and the device time in ms (the GPU's work alone,
    to compare providers whatever their host paths)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        wall = train_steps(model, opt, data, 1, gpu)[0]

    def self_time(e) -> float:  # µs; the attribute's name changed across torch versions
        if not gpu:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    # On the GPU, kernels only: a profiler range (record_function: trifuse's op scopes,
    # Optimizer.step) also shows up with device time, the span of the kernels inside it, which
    # would count them twice (torch's own table totals leave user annotations out the same way).
    events = [e for e in prof.key_averages()
              if not gpu or (e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))]
    events = [e for e in events if self_time(e) > 0]
    total = sum(self_time(e) for e in events)
    ranked = sorted(events, key=self_time, reverse=True)[:top]
    rows = [{"name": e.key[:90], "calls": e.count, "ms": self_time(e) / 1e3,
             "% of device time": 100 * self_time(e) / total if total else float("nan")} for e in ranked]
    if gpu:  # then every kernel by kind (the top ones leave a provider's small kernels out)
        kinds: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        for e in events:
            entry = kinds[kernel_kind(e.key)]
            entry[0] += e.count
            entry[1] += self_time(e)
        rows += [{"name": f"all {kind}", "calls": n, "ms": us / 1e3, "% of device time": 100 * us / total}
                 for kind, (n, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])]
    busy = 100 * total / 1e6 / wall if gpu and wall > 0 else float("nan")
    return rows, busy, total / 1e3 if gpu else float("nan")


def _dynamo_seconds(before: dict | None = None) -> dict:
    """Seconds torch.compile spent so far (less `before`): Dynamo's tracing and its backend's
    compile together ("compile s": every frame, graph breaks' resumes and recompiles included),
    and the backend's share ("backend compile s": the trifuse rewrite, AOTAutograd, Inductor).
    The rest of a compile provider's set-up is its first steps' running (kernel compiles, tuning)."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    out = {"compile s": sum(metrics.get("_compile.compile_inner", ())),
           "backend compile s": sum(metrics.get("OutputGraph.call_user_compiler", ()))}
    return out if before is None else {k: v - before.get(k, 0.0) for k, v in out.items()}


def _dialect_choices() -> list[str]:
    """What each op's dialect chose for the shapes this model ran, and why the others lost or were
    rejected (times and reasons): which implementation ran is part of the result."""
    return [str(d) for d in decisions.records(kind="dialect")]


def _block_units(model) -> list:
    from trifuse.fusion.capture import DynamoUnit, installed_unit

    units = {id(u): u for m in model.modules() if isinstance(u := installed_unit(m), DynamoUnit)}
    return list(units.values())


def _fused_summary(model) -> str:
    rep = trifuse.report(model)
    return ", ".join(f"{k} {v}" for k, v in rep.by_pattern().items())


def providers(compile_: bool, kind: str = "gpt2") -> list[str]:
    out = ["eager-sdpa", "trifuse.fuse", "trifuse.fuse(skip_logits)", "trifuse.fuse(cuda_graphs)"]
    if compile_:
        out += ["torch.compile", "compile(backend=trifuse)", "compile(backend=trifuse_inductor)",
                # the same graphs calling the registered trifuse ops: what their direct twins save
                "compile(backend=trifuse_inductor, direct=0)",
                # Dynamo alone (its graphs run as captured): its share of backend=trifuse's set-up
                "compile(backend=eager)",
                # Inductor's CUDA graphs against trifuse + Inductor's: the host paths gone on both sides
                "compile(mode=reduce-overhead)", "compile(backend=trifuse_inductor, mode=reduce-overhead)"]
    # Last: Liger patches transformers' Llama module globally (its RoPE function and norm class),
    # which would reach every Llama built after it. Its head fuses with the loss, as skip_logits.
    if kind == "llama" and H.try_import("liger_kernel.transformers") is not None:
        out.append("liger")
    return out


COLUMNS = ("model", "provider", "batch x seq", "step ms", "tokens/s", "x vs eager-sdpa", "x vs torch.compile",
           "x vs liger", "peak GiB", "peak reserved GiB",
           "device busy %", "device ms", "set-up s", "compile s", "backend compile s", "tuning s", "fused")
TOP_COLUMNS = ("model", "provider", "name", "calls", "ms", "% of device time")


def top_kernel_rows(rows: list[dict]) -> list[dict]:
    """The per-provider profiles flattened into one table."""
    return [{"model": r["model"], "provider": r["provider"], **k} for r in rows for k in r.get("top kernels", ())]


def plot_tokens_per_second(rows: list[dict], path) -> None:
    """Bars of tokens/s per model, one per provider (when matplotlib is importable)."""
    plt = H.try_import("matplotlib.pyplot")
    if plt is None:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    providers_ = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(2 + 2.2 * len(models), 4))
    width = 0.8 / max(1, len(providers_))
    for i, provider in enumerate(providers_):
        values = [next((r.get("tokens/s", 0.0) for r in rows if r["model"] == m and r["provider"] == provider), 0.0)
                  for m in models]
        ax.bar([j + i * width for j in range(len(models))], values, width, label=provider)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
    ax.set_ylabel("tokens/s (training)")
    ax.set_title("end-to-end training step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def split_providers(text: str) -> list[str]:
    """--providers' names: split at the commas outside parentheses, which a provider's keyword
    arguments use (`compile(backend=trifuse_inductor, mode=reduce-overhead)`)."""
    return [p.strip() for p in re.split(r",(?![^()]*\))", text) if p.strip()]


def compile_kwargs(provider: str) -> dict[str, str]:
    """`compile(backend=X, mode=Y)` -> {"backend": "X", "mode": "Y"}: torch.compile's arguments
    (`direct=0`, trifuse_inductor's graphs calling the registered ops, is the environment's)."""
    pairs = dict(kv.strip().split("=", 1) for kv in provider[len("compile("):-1].split(",") if kv.strip())
    pairs.pop("direct", None)
    return pairs


def provider_env(provider: str) -> dict[str, str]:
    """The environment a provider runs under: `compile(..., direct=0)` sets TRIFUSE_DIRECT_OPS=0
    (trifuse_inductor's graphs call the registered ops instead of their direct twins)."""
    if provider.startswith("compile(") and "direct=0" in provider.replace(" ", ""):
        return {"TRIFUSE_DIRECT_OPS": "0"}
    return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (minutes of compile)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--suffix", default="", help="results file e2e-SUFFIX (to keep runs apart)")
    ap.add_argument("--grad-ckpt", action="store_true", help="with transformers' gradient checkpointing on")
    ap.add_argument("--providers", default="", help="comma-separated subset of the providers (default: all)")
    args = ap.parse_args()
    chosen = set(split_providers(args.providers))
    rows = []
    for name in args.models.split(","):
        point = []
        for provider in providers(args.compile, MODELS[name][0]):
            if chosen and provider not in chosen:
                continue
            try:
                with mock.patch.dict(os.environ, provider_env(provider)):
                    row = run_one(name, provider, MODELS[name], args.steps, "cuda", args.grad_ckpt)
            except Exception as e:  # noqa: BLE001  (report the failure, keep measuring the rest)
                row = {"model": name, "provider": provider, "fused": f"{type(e).__name__}: {str(e)[:150]}"}
            H._print_row(row)  # each provider's numbers reach the log as soon as they exist
            point.append(row)
            torch.cuda.empty_cache()
        eager = next((r for r in point if r["provider"] == "eager-sdpa" and "tokens/s" in r), None)
        compiled = next((r for r in point if r["provider"] == "torch.compile" and "tokens/s" in r), None)
        liger = next((r for r in point if r["provider"] == "liger" and "tokens/s" in r), None)
        for r in point:
            if liger and "tokens/s" in r:
                r["x vs liger"] = r["tokens/s"] / liger["tokens/s"]
            if eager and "tokens/s" in r:
                r["x vs eager-sdpa"] = r["tokens/s"] / eager["tokens/s"]
            if compiled and "tokens/s" in r:
                r["x vs torch.compile"] = r["tokens/s"] / compiled["tokens/s"]
        rows += point
    H.print_table(rows, COLUMNS)
    top = top_kernel_rows(rows)
    H.print_table(top, TOP_COLUMNS)
    path = H.write_results("e2e", rows, COLUMNS, suffix=args.suffix)
    H.write_results("e2e", top, TOP_COLUMNS, suffix="-".join(filter(None, (args.suffix, "top-kernels"))))
    plot_tokens_per_second(rows, path.with_suffix(".png"))


# The baseline and the main job on every model; the two variants where their code differs: skip_logits
# on an LM head and on BERT's MLM head, CUDA graphs (the CPU's fallback says what it did) on one causal LM
# and the diffusion transformer. The GPU session runs the whole grid.
SMOKE = [*((p, n) for p in ("eager-sdpa", "trifuse.fuse") for n in TINY),
         ("trifuse.fuse(skip_logits)", "gpt2-medium"), ("trifuse.fuse(skip_logits)", "bert-large"),
         ("trifuse.fuse(cuda_graphs)", "llama-1b"), ("trifuse.fuse(cuda_graphs)", "dit-xl")]


@pytest.mark.skipif(transformers is None, reason="needs transformers")
@pytest.mark.parametrize("provider, name", SMOKE, ids=[f"{p}-{n}" for p, n in SMOKE])
def test_e2e_smoke(name, provider):
    if TINY[name][0] == "dit" and H.try_import("diffusers") is None:
        pytest.skip("needs diffusers")
    device = "cuda" if H.on_gpu() else "cpu"
    row = run_one(name, provider, TINY[name], 1, device)
    assert row["tokens/s"] > 0
    if provider == "trifuse.fuse(cuda_graphs)":
        assert row["cuda graphs"], "the blocks' graphs say what they did"
    if provider.startswith("trifuse.fuse"):  # the attention dialect decided, at the least
        assert any(c.startswith("attention [") for c in row["dialect choices"])
        assert row["tuning s"] >= 0 and isinstance(row["costliest decisions"], list)
    assert row["top kernels"] and all(k["ms"] > 0 for k in row["top kernels"])


@pytest.mark.skipif(transformers is None, reason="needs transformers")
def test_e2e_smoke_with_gradient_checkpointing():
    device = "cuda" if H.on_gpu() else "cpu"
    row = run_one("gpt2-medium", "trifuse.fuse", TINY["gpt2-medium"], 1, device, checkpointing=True)
    assert "grad ckpt" in row["model"] and "sdpa" in row["fused"]
    assert row["tokens/s"] > 0
    assert row["top kernels"] and all(k["ms"] > 0 for k in row["top kernels"])


@pytest.mark.skipif(transformers is None, reason="needs transformers")
def test_e2e_smoke_compile_backend():
    """A compile provider's row splits its set-up: Dynamo with the backend, the backend alone, and
    (a trifuse backend) the first steps' tuning."""
    device = "cuda" if H.on_gpu() else "cpu"
    row = run_one("gpt2-medium", "compile(backend=trifuse)", TINY["gpt2-medium"], 1, device)
    assert row["tokens/s"] > 0
    assert 0 < row["backend compile s"] < row["compile s"]
    assert row["tuning s"] >= 0 and isinstance(row["costliest decisions"], list)


def test_providers_with_compile_arguments():
    names = "eager-sdpa,compile(backend=trifuse_inductor, mode=reduce-overhead),compile(mode=reduce-overhead)"
    assert split_providers(names) == ["eager-sdpa", "compile(backend=trifuse_inductor, mode=reduce-overhead)",
                                      "compile(mode=reduce-overhead)"]
    assert compile_kwargs("compile(backend=trifuse_inductor, mode=reduce-overhead)") == {
        "backend": "trifuse_inductor", "mode": "reduce-overhead"}
    assert compile_kwargs("compile(backend=trifuse)") == {"backend": "trifuse"}
    assert compile_kwargs("compile(backend=trifuse_inductor, direct=0)") == {"backend": "trifuse_inductor"}
    assert provider_env("compile(backend=trifuse_inductor, direct=0)") == {"TRIFUSE_DIRECT_OPS": "0"}
    assert provider_env("compile(backend=trifuse_inductor)") == provider_env("trifuse.fuse") == {}
    assert set(split_providers(names)) <= set(providers(True)) | {"eager-sdpa"}


def test_kernel_kinds():
    names = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
        "_attn_bwd_dkdv_kernel": "attention",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_NNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::": "optimizer",
        "triton_per_fused__to_copy_add_native_dropout_native_layer_norm_4": "Inductor's Triton",
        "_layer_norm_bwd_kernel": "trifuse's Triton",
        "void at::native::vectorized_elementwise_kernel<4, at::native::BFloat16": "aten elementwise, copies",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float": "aten reductions",
        "Memset (Device)": "other",
    }
    assert {name: kernel_kind(name) for name in names} == names


def test_e2e_tables_and_plot(tmp_path):
    rows = [{"model": "m", "provider": p, "tokens/s": t, "top kernels": [{"name": "k", "calls": 1, "ms": 1.0,
                                                                          "% of device time": 100.0}]}
            for p, t in (("eager-sdpa", 1.0), ("trifuse.fuse", 2.0))]
    assert [r["provider"] for r in top_kernel_rows(rows)] == ["eager-sdpa", "trifuse.fuse"]
    plot_tokens_per_second(rows, tmp_path / "e2e.png")
    assert H.try_import("matplotlib.pyplot") is None or (tmp_path / "e2e.png").stat().st_size > 0


if __name__ == "__main__":
    main()
