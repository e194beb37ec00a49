"""End-to-end training: HF GPT-2 medium and BERT-large from configs, eager (SDPA) against
`trifuse.fuse(model)` (and torch.compile with --compile), bf16 autocast, AdamW.

    python bench/bench_e2e.py [--compile] [--steps 10]   # GPU: writes bench/results/e2e.*
    pytest bench/bench_e2e.py                             # CPU: a tiny config, one step each

Reports tokens/s, step time, peak memory and set-up time (the fuse or compile call plus the
first step's excess over a steady step), all measured in this process, and a profile of the
top CUDA kernels of one fused step.
"""
import argparse
import time

import _harness as H  # noqa: I001
import pytest
import torch

import trifuse

transformers = H.try_import("transformers")

MODELS = {
    # name: (config factory kwargs, batch, sequence)
    "gpt2-medium": ("gpt2", dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024), 8, 1024),
    "bert-large": ("bert", dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                                intermediate_size=4096), 16, 512),
}
TINY = {
    "gpt2-medium": ("gpt2", dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128), 2, 16),
    "bert-large": ("bert", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                intermediate_size=128, vocab_size=128), 2, 16),
}


def build(kind: str, kwargs: dict, device: str) -> torch.nn.Module:
    if kind == "gpt2":
        cfg = transformers.GPT2Config(**kwargs, attn_implementation="sdpa")
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.BertConfig(**kwargs, attn_implementation="sdpa")
        model = transformers.BertForMaskedLM(cfg)
    return model.to(device)


def make_batch(kind: str, model: torch.nn.Module, batch: int, seq: int, device: str) -> dict:
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    if kind == "gpt2":
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


def run_one(name: str, provider: str, spec, steps: int, device: str) -> dict:
    kind, kwargs, batch, seq = spec
    torch.manual_seed(0)
    model = build(kind, kwargs, device)  # same seed: every provider starts from the same weights
    model.train()
    t_setup = time.perf_counter()
    if provider == "trifuse.fuse":
        trifuse.fuse(model)
    elif provider == "trifuse.fuse(skip_logits)":  # the loop uses only .loss: the head fuses with it
        trifuse.fuse(model, skip_logits=True)
    elif provider == "torch.compile":
        model = torch.compile(model)
    elif provider.startswith("compile(backend="):
        model = torch.compile(model, backend=provider[len("compile(backend="):-1])
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
        "model": name, "provider": provider, "batch x seq": f"{batch}x{seq}",
        "step ms": step * 1e3, "tokens/s": batch * seq / step,
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan"),
        "set-up s": setup_call + max(0.0, first - step),
    }
    if provider.startswith("trifuse.fuse"):
        row["fused"] = _fused_summary(model)
    del warm, opt, model
    return row


def _fused_summary(model) -> str:
    rep = trifuse.report(model)
    return ", ".join(f"{k} {v}" for k, v in rep.by_pattern().items())


def providers(compile_: bool) -> list[str]:
    out = ["eager-sdpa", "trifuse.fuse", "trifuse.fuse(skip_logits)"]
    if compile_:
        out += ["torch.compile", "compile(backend=trifuse)", "compile(backend=trifuse_inductor)"]
    return out


COLUMNS = ("model", "provider", "batch x seq", "step ms", "tokens/s", "x vs eager-sdpa", "x vs torch.compile", "peak GiB",
           "set-up s", "fused")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (minutes of compile)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--suffix", default="", help="results file e2e-SUFFIX (to keep runs apart)")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        point = []
        for provider in providers(args.compile):
            try:
                row = run_one(name, provider, MODELS[name], args.steps, "cuda")
            except Exception as e:  # noqa: BLE001  (report the failure, keep measuring the rest)
                row = {"model": name, "provider": provider, "fused": f"{type(e).__name__}: {str(e)[:150]}"}
            point.append(row)
            torch.cuda.empty_cache()
        eager = next((r for r in point if r["provider"] == "eager-sdpa" and "tokens/s" in r), None)
        compiled = next((r for r in point if r["provider"] == "torch.compile" and "tokens/s" in r), None)
        for r in point:
            if eager and "tokens/s" in r:
                r["x vs eager-sdpa"] = r["tokens/s"] / eager["tokens/s"]
            if compiled and "tokens/s" in r:
                r["x vs torch.compile"] = r["tokens/s"] / compiled["tokens/s"]
        rows += point
    H.print_table(rows, COLUMNS)
    H.write_results("e2e", rows, COLUMNS, suffix=args.suffix)


@pytest.mark.skipif(transformers is None, reason="needs transformers")
@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("provider", ["eager-sdpa", "trifuse.fuse"])
def test_e2e_smoke(name, provider):
    device = "cuda" if H.on_gpu() else "cpu"
    row = run_one(name, provider, TINY[name], 1, device)
    assert row["tokens/s"] > 0


if __name__ == "__main__":
    main()
