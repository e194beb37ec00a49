"""Where a training step's host time goes on the GPU, for the models of bench_e2e.py.

    python bench/profile_e2e_host.py [--models gpt2-medium,bert-large] [--providers eager-sdpa,trifuse.fuse]

bench_e2e.py's "device ms" says how much GPU work a step holds; when the step's wall time is well
above it (2026-11-27, fourth H200 session: fused GPT-2 medium 117 ms a step for 62.5 ms of
kernels), the host is the limit. For each model and provider this prints:
  - the step's wall ms (synchronized) and its host ms (until the last call returns, before the
    synchronize: when it is about the wall time, the GPU waited on the host);
  - every synchronizing call in one step (torch.cuda.set_sync_debug_mode), with where it came from;
  - one step under cProfile (Python's view: the most expensive functions by own and total time);
  - the step's copies and dtype conversions by input shape (which tensors they convert);
  - one step under torch.profiler, CPU ops and CUDA runtime calls by self CPU time.
Text only, to stdout.
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
import traceback
import warnings

import bench_e2e as E
import torch

import trifuse


def host_and_wall_ms(model, opt, batch) -> tuple[float, float]:
    """One step: ms until the host has issued everything, and ms until the GPU is done."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host * 1e3, (time.perf_counter() - t0) * 1e3


def one_step(model, opt, batch) -> None:
    E.train_steps(model, opt, batch, 1, True)


def report_syncs(model, opt, batch, limit: int = 6) -> None:
    seen: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        seen.append(f"{message}\n" + "".join(traceback.format_list(stack[-8:])))

    old = warnings.showwarning
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    torch.cuda.synchronize()
    print(f"  synchronizing calls in one step: {len(seen)}")
    for s in seen[:limit]:
        print("  ---", s)


def report_cprofile(model, opt, batch) -> None:
    pr = cProfile.Profile()
    pr.enable()
    one_step(model, opt, batch)
    pr.disable()
    for key, n in (("tottime", 30), ("cumtime", 45)):
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats(key).print_stats(n)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:12000])


def report_torch_profiler(model, opt, batch) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_step(model, opt, batch)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=70))


def copy_sources(model, opt, batch, gpu: bool = True, top: int = 25) -> list[dict]:
    """Where one step's copies come from: the `top` groups of aten::copy_ calls by CUDA time (CPU
    time on a CPU), kernels under them included. A group is the ops that asked for the copy (its
    callers up to the first that is not a copy or a conversion: aten::_to_copy is a dtype cast,
    aten::clone a layout copy), the shape copied, and where: the first Python frame outside torch
    (GPU only: on a CPU the frames would trace the interpreter's kernels), or in the backward the
    autograd node that ran it. Which tensors the ~10 ms of direct_copy / bfloat16_copy kernels in
    a fused GPT-2 medium step (H200, 2026-11-27) convert."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    with profile(activities=activities, record_shapes=True, with_stack=gpu) as prof:
        E.train_steps(model, opt, batch, 1, gpu)

    def time_us(e) -> float:
        if not gpu:
            return e.cpu_time_total
        return getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)

    conversions = ("aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::copy")
    groups: dict[tuple, list] = {}
    for e in prof.events():
        if e.name != "aten::copy_" or e.device_type.name != "CPU":
            continue
        up = [e]  # the copy and its callers, outermost last: ops, then Python frames ("file(line): fn")
        while up[-1].cpu_parent is not None:
            up.append(up[-1].cpu_parent)
        callers = []
        for x in up[1:]:
            if not x.name.startswith("aten::"):
                break
            callers.append(x.name)
            if not x.name.startswith(conversions):
                break
        where = next((x.name for x in up if ".py(" in x.name and not x.name.startswith("torch/")), "")
        if not where:
            nodes = (x.name.rsplit(": ", 1)[-1] for x in up if x.name.startswith("autograd::engine"))
            where = next(nodes, "")
        shapes = e.input_shapes
        shape = str(shapes[1] if len(shapes) > 1 else shapes)  # copy_(self, src): the source's
        key = (" < ".join(callers) or "(called directly)", shape, where)
        g = groups.setdefault(key, [0, 0.0])
        g[0] += 1
        g[1] += time_us(e)
    ranked = sorted(groups.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    return [{"callers": k[0], "shape": k[1], "where": k[2], "calls": n, "ms": us / 1e3}
            for k, (n, us) in ranked]


def report_casts(model, opt, batch) -> None:
    print("  copies and conversions: calls, CUDA ms (kernels included), callers, shape copied, where")
    for c in copy_sources(model, opt, batch):
        print(f"    {c['calls']:5} {c['ms']:8.3f}  {c['callers'][:70]:70} {c['shape'][:28]:28} "
              f"{c['where'][-100:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-medium,bert-large")
    ap.add_argument("--providers", default="eager-sdpa,trifuse.fuse",
                    help="eager-sdpa, trifuse.fuse, trifuse.fuse(cuda_graphs)")
    ap.add_argument("--no-profiles", action="store_true", help="wall and host ms only")
    args = ap.parse_args()
    for name in args.models.split(","):
        kind, kwargs, batch_size, seq = E.MODELS[name]
        for provider in args.providers.split(","):
            torch.manual_seed(0)
            model = E.build(kind, kwargs, "cuda").train()
            if provider.startswith("trifuse.fuse"):
                trifuse.fuse(model, cuda_graphs=provider == "trifuse.fuse(cuda_graphs)")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            batch = E.make_batch(kind, model, batch_size, seq, "cuda")
            E.train_steps(model, opt, batch, 3, True)
            times = sorted(host_and_wall_ms(model, opt, batch) for _ in range(5))
            host, wall = times[len(times) // 2]
            print(f"=== {name} {provider}: step {wall:.1f} ms wall, host issued it in {host:.1f} ms")
            sys.stdout.flush()
            if not args.no_profiles:
                report_syncs(model, opt, batch)
                report_casts(model, opt, batch)
                if provider != "eager-sdpa":
                    report_cprofile(model, opt, batch)
                report_torch_profiler(model, opt, batch)
            sys.stdout.flush()
            del model, opt
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
