"""`precompile`: a tuner's configs compiled at once in a thread pool (Triton's AsyncCompileMode),
nothing launched, and later launches find them compiled. Real compiles for Hopper (sm_90) with
Triton's compiler and ptxas, in a child process without the interpreter and without a GPU."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

# Shared by the children: a driver that names the target (no device), a spy on which thread each
# compile runs in (a JITFunction binds triton.compiler.compile at first use), a kernel to compile.
PRELUDE = textwrap.dedent('''
    import functools, json, sys, threading
    import torch, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    sys.path.insert(0, BENCH)
    from compile_sm90 import _TargetOnlyDriver

    triton.runtime.driver.set_active(_TargetOnlyDriver(GPUTarget("cuda", 90, 32)))
    from trifuse.autotune import Tuner
    from trifuse.kernels import _launch

    threads = []
    compile_one = triton.compiler.compile

    def compile_spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return compile_one(*args, **kwargs)

    triton.compiler.compile = compile_spy

    @triton.jit
    def _scale_kernel(X, OUT, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + offs, tl.load(X + offs, mask=offs < n) * alpha, mask=offs < n)

    x, out = torch.empty(64), torch.empty(64)
''')

CHILD = textwrap.dedent('''
    kernel = _launch.CachedKernel(_scale_kernel)
    configs = [(64, 1), (128, 2), (256, 4), (512, 4)]
    done = _launch.precompile([functools.partial(kernel.run, (1,), (x, out, 64, 2.0), {"BLOCK": b, "num_warps": w})
                               for b, w in configs], workers=2)
    cache = _scale_kernel.device_caches[0][0]
    print(json.dumps({"done": done, "kinds": sorted(type(k).__name__ for k in cache.values()),
                      "entries": len(kernel._compiled), "threads": sorted(set(threads))}))
''')


def _run_child(tmp_path, body: str) -> dict:
    """Runs PRELUDE + body in a fresh process without the interpreter, with empty Triton and
    trifuse caches (real compiles; no choice from another run's disk cache); its JSON line."""
    script = tmp_path / "child.py"
    script.write_text(f"BENCH = {str(BENCH)!r}\n" + PRELUDE + body)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRIFUSE_AUTOTUNE")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["TRIFUSE_CACHE_DIR"] = str(tmp_path / "trifuse-cache")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    if "AsyncCompileMode" in run.stderr and run.returncode != 0:
        pytest.skip("this Triton has no AsyncCompileMode")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if not out["done"]:
        pytest.skip("this Triton has no AsyncCompileMode: precompile does nothing")
    return out


def test_precompile_compiles_every_config_in_worker_threads_and_launches_nothing(tmp_path):
    out = _run_child(tmp_path, CHILD)
    assert out["kinds"] == ["CompiledKernel"] * 4, "every config compiled and finalized in Triton's cache"
    assert out["entries"] == 0, "nothing was launched or planned"
    assert out["threads"] and all(t.startswith("trifuse-compile") for t in out["threads"]), out["threads"]


TUNED_CHILD = textwrap.dedent('''
    @triton.jit
    def _add_kernel(X, OUT, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + offs, tl.load(X + offs, mask=offs < n) + 1.0, mask=offs < n)

    scale, add = _launch.CachedKernel(_scale_kernel), _launch.CachedKernel(_add_kernel)
    space = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((64, 1), (128, 2), (256, 4))]
    timed = []
    tuner = Tuner("toy_scale", lambda n: space, key_names=("device", "n"))
    tuner.timer = lambda label, step: timed.append(label) or 1.0  # a stand-in: the pass must not time

    def launch(cfg, x, out):
        scale.run((1,), (x, out, 64, 2.0), {"BLOCK": cfg.kwargs["BLOCK"], "num_warps": cfg.num_warps})

    backward_threads = []

    def forward_and_backward():  # what a candidate's call launches: a tuned kernel, then another one
        launch(tuner.config((-1, 64), launch, x, out), x, out)
        add.run((1,), (out, x, 64), {"BLOCK": 64})
        backward_threads.append(torch._C._is_multithreading_enabled())  # (a backward: on this thread)

    done = _launch.precompile([forward_and_backward], workers=2)
    print(json.dumps({"done": done, "threads": threads, "timed": timed, "decided": tuner.is_decided((-1, 64)),
                      "scale": sorted(type(k).__name__ for k in _scale_kernel.device_caches[0][0].values()),
                      "add": sorted(type(k).__name__ for k in _add_kernel.device_caches[0][0].values()),
                      "entries": len(scale._compiled) + len(add._compiled),
                      "multithreaded_backward": backward_threads + [torch._C._is_multithreading_enabled()]}))
''')


def test_a_call_in_a_precompile_pass_compiles_its_tuners_configs_and_its_other_kernels_together(tmp_path):
    """What a dialect's compile-first pass does with a candidate's call (real sm_90 compiles): the
    tuner that would time an undecided key hands all its configs to the pool and decides nothing,
    the call goes on to its next kernel, whose compile joins them; all in the pool's threads."""
    out = _run_child(tmp_path, TUNED_CHILD)
    assert out["scale"] == ["CompiledKernel"] * 3 and out["add"] == ["CompiledKernel"], out
    assert len(out["threads"]) == 4 and all(t.startswith("trifuse-compile") for t in out["threads"]), out
    assert out["timed"] == [] and not out["decided"] and out["entries"] == 0, out
    # a pass's backward passes run on its thread, which holds its flag and Triton's compile mode
    # (on CUDA, autograd's device thread would not: torch 2.11 on the H200, 2026-12-04)
    assert out["multithreaded_backward"] == [False, True], out
