"""Trains GPT-2 (from a config, random weights, random tokens) with tensor + sequence parallelism.

    torchrun --nproc-per-node N examples/train_tp.py                    # N-way TP+SP, fused
    torchrun --nproc-per-node N examples/train_tp.py --no-fuse          # PyTorch's ops instead
    torchrun --nproc-per-node 4 examples/train_tp.py --dp 2             # 2-way FSDP2 x 2-way TP+SP
    torchrun --nproc-per-node N examples/train_tp.py --vocab-parallel   # embedding + LM head split too
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/train_tp.py --dp 2   # TP in a node, DP across

On GPUs: NCCL, bf16 autocast, GPT-2 small by default. Without GPUs: gloo on CPU, a tiny model,
fp32. trifuse.fuse is applied before sharding unless --no-fuse: the fused blocks run trifuse's
kernels on the sequence shards (DTensors) too. Every rank prints its tokens/s (tokens it processed: the whole batch of its data-parallel
group, since the ranks of a tensor-parallel group share a batch).
"""

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before trifuse is imported

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402

import trifuse  # noqa: E402


def parse() -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (FSDP2); TP degree = world / dp")
    p.add_argument("--layers", type=int, default=12 if gpu else 2)
    p.add_argument("--hidden", type=int, default=768 if gpu else 64)
    p.add_argument("--heads", type=int, default=12 if gpu else 4)
    p.add_argument("--vocab", type=int, default=50304 if gpu else 256)
    p.add_argument("--batch", type=int, default=8 if gpu else 2, help="per data-parallel group")
    p.add_argument("--seq", type=int, default=1024 if gpu else 32)
    p.add_argument("--steps", type=int, default=20 if gpu else 4)
    p.add_argument("--warmup", type=int, default=3 if gpu else 1)
    p.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    p.add_argument(
        "--fuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply trifuse.fuse before sharding (default: on)",
    )
    p.add_argument(
        "--vocab-parallel",
        action="store_true",
        help="split embedding and LM head over the vocabulary (loss_parallel)",
    )
    return p.parse_args()


def main() -> None:
    args = parse()
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the world size {world}")
    device = torch.device("cuda" if gpu else "cpu")
    tp = world // args.dp
    mesh = (
        init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
        if args.dp == 1
        else init_device_mesh(device.type, (args.dp, tp), mesh_dim_names=("dp", "tp"))
    )

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        n_positions=args.seq,
        vocab_size=args.vocab,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).to(device)
    if args.fuse:
        model = trifuse.fuse(model)
    trifuse.parallel.shard(model, mesh, sequence_parallel=not args.no_sp, vocab_parallel=args.vocab_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    # Ranks of one tensor-parallel group must see the same batch: seed by the data-parallel rank.
    dp_rank = mesh["dp"].get_local_rank() if args.dp > 1 else 0
    gen = torch.Generator(device="cpu").manual_seed(1000 + dp_rank)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu)
    tokens = args.batch * args.seq
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
        # Vocabulary-parallel logits stay sharded: the loss and its backward run under loss_parallel().
        with loss_parallel() if args.vocab_parallel else contextlib.nullcontext():
            with autocast:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    last = loss.full_tensor() if args.vocab_parallel else loss
    peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if gpu else ""
    print(
        f"rank {rank}/{world} (dp {args.dp} x tp {tp}, sp {not args.no_sp}, fused {args.fuse}, {device.type}): "
        f"loss {last.item():.3f}, {tokens * args.steps / seconds:,.0f} tokens/s, "
        f"{seconds / args.steps * 1e3:.1f} ms/step{peak}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
