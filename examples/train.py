"""Fuses a real Hugging Face model and trains it a few steps: prints what was fused and the speed
against the same model unfused.

    python examples/train.py              # GPU: GPT-2 medium from its config, bf16 autocast, AdamW
    python examples/train.py --small      # a tiny GPT-2 (what runs on a CPU, in Triton's interpreter)
    python examples/train.py --model llama   # Llama 3.2 1B's shape: RoPE, SwiGLU, GQA (tiny on a CPU)

Both models start from the same weights and see the same batches; the losses are printed side by
side (with dropout they differ by the masks, not by trend). The model is built from a config: no
download. Both get `use_cache=False`: transformers builds a KV cache otherwise, even in training
(fuse turns it off in the fused model's training calls that do not set it; the eager model would
pay for building it).
"""
import argparse
import copy
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before trifuse is imported

import transformers  # noqa: E402

import trifuse  # noqa: E402

# model: (config class, LM class, name, full-size config, batch, seq, tiny config)
MODELS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "GPT-2 medium",
             {"n_layer": 24, "n_embd": 1024, "n_head": 16, "n_positions": 1024}, 8, 1024,
             {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, "vocab_size": 256}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "Llama 3.2 1B-shaped Llama",
              {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
               "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 2048,
               "tie_word_embeddings": True}, 4, 2048,
              {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}),
}


def train(model, batches, autocast: bool, warmup: int) -> tuple[list[float], float]:
    """Losses of every step, and the tokens/s of the steps after `warmup` (synchronized)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device = next(model.parameters()).device
    losses, t0, tokens = [], None, 0
    for i, ids in enumerate(batches):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if i >= warmup:
            tokens += ids.numel()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return losses, tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    ap.add_argument("--small", action="store_true", help="a tiny model (the default without a GPU)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--no-cuda-graphs", action="store_true",
                    help="run the fused blocks without CUDA graphs (on a GPU they are replayed from graphs)")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    small = args.small or not gpu
    device = "cuda" if gpu else "cpu"
    config_class, lm_class, full_name, full, full_batch, full_seq, tiny = MODELS[args.model]
    config, batch, seq = (tiny, 2, 32) if small else (full, full_batch, full_seq)
    steps = args.steps or (4 if small else 12)
    warmup = 1 if small else 3
    autocast = gpu  # bf16 autocast on a GPU; fp32 on a CPU, whose autocast runs its own matmuls

    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    cfg = getattr(transformers, config_class)(**config, attn_implementation="sdpa")
    model = getattr(transformers, lm_class)(cfg).to(device).train()
    unfused = copy.deepcopy(model)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq), device=device) for _ in range(steps)]
    name = f"tiny {lm_class}" if small else full_name
    where = torch.cuda.get_device_name() if gpu else "cpu (Triton interpreter)"
    print(f"{name} from its config, batch {batch} x {seq}, {'bf16 autocast, ' if autocast else ''}AdamW, on {where}")

    t0 = time.perf_counter()
    # The loop reads only the loss: skip_logits lets the LM head and the loss fuse into
    # linear_cross_entropy, so the (tokens x vocab) logits are never materialized. On a GPU the
    # fused blocks replay from CUDA graphs (from the second step): the host no longer paces the step.
    trifuse.fuse(model, skip_logits=True, cuda_graphs=gpu and not args.no_cuda_graphs)
    set_up = time.perf_counter() - t0
    torch.manual_seed(1)
    fused_losses, fused_tps = train(model, batches, autocast, warmup)
    torch.manual_seed(1)
    ref_losses, ref_tps = train(unfused, batches, autocast, warmup)

    print(trifuse.report(model))
    print(f"\n{'step':>4} {'loss fused':>11} {'loss unfused':>13}")
    for i, (a, b) in enumerate(zip(fused_losses, ref_losses)):
        print(f"{i:>4} {a:11.4f} {b:13.4f}")
    print(f"\nfuse() took {set_up:.2f} s (captures happen on the first step)")
    print(f"tokens/s: fused {fused_tps:,.0f}, unfused {ref_tps:,.0f}: {fused_tps / ref_tps:.2f}x")
    if not gpu:
        print("(on a CPU the kernels run in Triton's interpreter: the speed says nothing; run on a GPU)")


if __name__ == "__main__":
    main()
