"""CPU proxy for the set-up time of torch.compile's backends and of trifuse.fuse (issue 6).

    TRITON_INTERPRET=1 python bench/compile_time_proxy.py [--model gpt2|bert] [--inductor] [--save]

The models of bench/e2e_host_proxy.py (24 blocks of GPT-2 medium or BERT-large, width 64, 2 x 16
tokens): what a compile costs there is tracing and code generation, which does not depend on the
width. Each provider runs in a fresh process (Dynamo's and Inductor's in-process caches would
serve a second provider; Inductor's on-disk cache is pointed at an empty folder): the first
training step (forward, loss, backward) less a later one is its set-up. trifuse's kernel launches
are stubbed (bench/norm_host_proxy.py: the interpreter would add seconds of kernel work to every
step, which a GPU does not have) and nothing is timed on a CPU, so trifuse's rows are capture and
rewriting alone: on a GPU, compiling and tuning the kernels comes on top, once per
machine (bench_e2e.py's "tuning s" column). `--inductor` adds plain torch.compile (Inductor
generates and compiles C++ here: minutes). These are this CPU's seconds: the GPU box's host is a
different machine, and the issue's targets are for that box (bench_e2e.py --compile).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

PROVIDERS = {  # name: what model becomes (evaluated in the child process)
    "trifuse.fuse": "trifuse.fuse(model)",
    "compile(backend=eager)": "torch.compile(model, backend='eager')",  # Dynamo's tracing alone
    "compile(backend=aot_eager)": "torch.compile(model, backend='aot_eager')",  # + AOTAutograd
    "compile(backend=trifuse)": "torch.compile(model, backend='trifuse')",
    "compile(backend=trifuse_inductor)": "torch.compile(model, backend='trifuse_inductor')",
    "torch.compile": "torch.compile(model)",
}


def one(model_name: str, provider: str) -> dict:
    """Runs in the child: set-up and step times of one provider."""
    import _harness as H  # noqa: F401  (sets the interpreter up as the other benchmarks do)
    import e2e_host_proxy as E
    import norm_host_proxy
    import torch

    import trifuse  # noqa: F401  (the expressions below name it)

    norm_host_proxy.stub_launches()
    torch.set_num_threads(1)
    model = E.MODELS[model_name]()
    ids = torch.randint(0, 128, (2, 16))
    t0 = time.perf_counter()
    model = eval(PROVIDERS[provider])  # noqa: S307  (our own table above)
    wrap_s = time.perf_counter() - t0
    step = E.training_step(model, ids)
    t0 = time.perf_counter()
    step()
    first_s = time.perf_counter() - t0
    steady_ms = min(_timed(step) for _ in range(3)) * 1e3
    return {"model": model_name, "provider": provider, "first step s": first_s + wrap_s,
            "step ms": steady_ms, "set-up s": first_s + wrap_s - steady_ms / 1e3}


def _timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("gpt2", "bert"), default="gpt2")
    ap.add_argument("--inductor", action="store_true", help="also plain torch.compile (minutes)")
    ap.add_argument("--save", action="store_true", help="write bench/results/compile_time_proxy-<model>.*")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args.model, args.one)))
        return
    rows = []
    for provider in PROVIDERS:
        if provider == "torch.compile" and not args.inductor:
            continue
        with tempfile.TemporaryDirectory() as inductor_dir, tempfile.TemporaryDirectory() as trifuse_dir:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir, "TRIFUSE_CACHE_DIR": trifuse_dir}
            done = subprocess.run([sys.executable, __file__, "--model", args.model, "--one", provider],
                                  env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        error = (done.stderr.strip().splitlines() or ["?"])[-1][:200]
        row = json.loads(line[7:]) if line else {"model": args.model, "provider": provider, "error": error}
        rows.append(row)
        print(row, flush=True)
    import _harness as H

    columns = ("model", "provider", "set-up s", "first step s", "step ms", "error")
    H.print_table(rows, columns)
    if args.save:
        H.write_results("compile_time_proxy", rows, columns, suffix=args.model)


if __name__ == "__main__":
    main()
