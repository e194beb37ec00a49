"""CPU proxy for the host time of a fused model's training step, kernel launches stubbed.

    TRITON_INTERPRET=1 python bench/e2e_host_proxy.py [--model gpt2|bert] [--default-device] [--compile]

GPT-2 with GPT-2 medium's 24 blocks at a tiny width (64) and 2 x 16 tokens, so that the step is
host work: eager PyTorch (its ops run, on tensors too small to cost anything) against
`trifuse.fuse` of the same model, whose kernel launches stop after CachedKernel's key and lookup
(bench/norm_host_proxy.py). Forward, backward and set_to_none of the gradients; no optimizer.
What a GPU box adds on top: the launches themselves, and its slower host. On the lent GPU, a
step is host-bound when this host time, scaled to that box, exceeds the step's GPU time
(bench_e2e.py reports the device busy % there). The best of 5 runs of 5 steps is reported.
`--default-device`: both steps under `torch.set_default_device` (a torch function mode that
every torch call goes through). `--compile`: torch.compile's Inductor against
`backend="trifuse_inductor"`, with its graphs calling the trifuse ops' direct twins and (
TRIFUSE_DIRECT_OPS=0) the registered ops; Inductor's code for the rest runs on the CPU here,
compiled with `--layers` blocks (default 24; each compile takes minutes on 2 cores).
"""
import argparse
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
import _harness as H  # noqa: E402
import norm_host_proxy  # noqa: E402
import torch  # noqa: E402

import trifuse  # noqa: E402

transformers = __import__("transformers")


LAYERS = 24


def gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg).train()


def bert(seed: int = 0) -> torch.nn.Module:
    """BERT-large's 24 post-norm layers at width 64, masked-LM head and loss, padding mask on."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4,
                                  intermediate_size=256, max_position_embeddings=64, vocab_size=128,
                                  attn_implementation="sdpa")
    return transformers.BertForMaskedLM(cfg).train()


MODELS = {"gpt2": gpt2, "bert": bert}


def training_step(model: torch.nn.Module, ids: torch.Tensor):
    extra = {"attention_mask": torch.ones_like(ids)} if isinstance(model, transformers.BertForMaskedLM) \
        else {"use_cache": False}

    def step():
        model(input_ids=ids, labels=ids, **extra).loss.backward()
        for p in model.parameters():
            p.grad = None
    return step


def best_ms_per_step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    return H.best_us_per_call(training_step(model, ids), iters=5, runs=5, warmup=3) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    ap.add_argument("--default-device", action="store_true", help="run under torch.set_default_device('cpu')")
    ap.add_argument("--compile", action="store_true", help="Inductor against backend='trifuse_inductor'")
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    global LAYERS
    LAYERS = args.layers
    name = args.model
    build = MODELS[name]
    norm_host_proxy.stub_launches()
    torch.set_num_threads(1)
    ids = torch.randint(0, 128, (2, 16))
    if args.default_device:
        torch.set_default_device("cpu")
    if args.compile:
        compiled_steps(name, build, ids)
        return
    eager = best_ms_per_step(build(), ids)
    model = trifuse.fuse(build())
    fused = best_ms_per_step(model, ids)
    before = norm_host_proxy.launches[0]
    training_step(model, ids)()
    per_step = norm_host_proxy.launches[0] - before
    fused_ops = ", ".join(f"{k} {v}" for k, v in trifuse.report(model).by_pattern().items())
    print(f"fused: {fused_ops}")
    under = ", under set_default_device" if args.default_device else ""
    print(f"{name}, 24 blocks, width 64, 2 x 16 tokens, forward + backward{under}, host ms per step:")
    print(f"  eager PyTorch                     {eager:7.2f}")
    print(f"  trifuse.fuse (launches stubbed)   {fused:7.2f}   ({per_step} trifuse launches a step)")


def compiled_steps(name: str, build, ids: torch.Tensor) -> None:
    """Host ms per step of torch.compile (Inductor) and of backend="trifuse_inductor" with and
    without the direct twins, each compiled afresh."""
    rows = []
    for label, backend, direct in (("torch.compile (Inductor)", "inductor", "1"),
                                   ("trifuse_inductor, direct twins", "trifuse_inductor", "1"),
                                   ("trifuse_inductor, registered ops", "trifuse_inductor", "0")):
        os.environ["TRIFUSE_DIRECT_OPS"] = direct
        torch._dynamo.reset()
        model = torch.compile(build(), backend=backend)
        before = norm_host_proxy.launches[0]
        training_step(model, ids)()  # compiles
        per_step = norm_host_proxy.launches[0] - before
        rows.append((label, best_ms_per_step(model, ids), per_step))
    print(f"{name}, {LAYERS} blocks, width 64, 2 x 16 tokens, forward + backward, host ms per step:")
    for label, ms, launches in rows:
        print(f"  {label:34s} {ms:7.2f}   ({launches} trifuse launches a step)")


if __name__ == "__main__":
    main()
