"""The benchmark harness every op uses.

- Steps: `make_step(fn, make_inputs, mode)` builds a zero-argument callable for "fwd", "bwd" or
  "fwd+bwd". Gradients come from `torch.autograd.grad` (nothing accumulates into `.grad`).
  Several input sets are built and rotated call by call, so that L2 does not flatter a size.
- GPU time: `triton.testing.do_bench`, median, CUDA events ("ms"): the whole call, so a step whose
  host path is longer than its GPU work measures the host path. Beside it, the same step with
  the host path taken out ("graph ms"): several steps captured in one CUDA graph and replayed,
  which is what the kernels cost when the host runs ahead of the GPU, as in a training step.
- Wall time: host time per call (`host_us`), measured at tiny sizes where the GPU is idle,
  because host overhead decides eager speed (DESIGN.md, "Host overhead").
- Results: one JSON (device, versions, date, measured copy bandwidth, every row) and one
  markdown table per op under bench/results/, plus a PNG of GB/s against width when
  matplotlib is there.

Bytes are counted as DESIGN.md says: each input read once and each output written once, per
pass; a fwd+bwd step is the sum of its forward and its backward (the backward reads what the
forward saved). The formulas live in each bench_<op>.py next to its shapes.
"""
import argparse
import datetime
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Before anything imports trifuse: without a GPU the kernels run in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODES = ("fwd", "bwd", "fwd+bwd")
L2_BYTES = 50 * 2**20  # H100; rotation keeps the inputs of consecutive calls apart


def cli(description: str | None) -> argparse.Namespace:
    """A benchmark script's arguments: `--quick` times the issue's target shapes only (what fits
    a lent GPU's short call); every script writes its host-overhead table first, and its results
    after each part, so a call cut by its limit keeps what was measured."""
    ap = argparse.ArgumentParser(description=description.splitlines()[0] if description else None)
    ap.add_argument("--quick", action="store_true", help="the target shapes only, no width sweep")
    return ap.parse_args()


def on_gpu() -> bool:
    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------


def make_step(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    make_inputs: Callable[[], tuple[tuple, Sequence[torch.Tensor]]],
    mode: str,
    *,
    bytes_per_set: int = 0,
    max_sets: int = 8,
) -> Callable[[], object]:
    """A callable running one `mode` step of `fn`, on a fresh input set each call.

    `make_inputs()` returns (args, grad_targets): fn(*args) is the forward and grad_targets the
    tensors (among args) to differentiate. Outputs that are tuples are all differentiated.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    n_sets = 1
    if on_gpu() and bytes_per_set:
        n_sets = max(1, min(max_sets, math.ceil(2 * L2_BYTES / bytes_per_set)))
    sets = [make_inputs() for _ in range(n_sets)]
    if mode != "fwd":
        sets = [(args, targets, _as_tuple(fn(*args))) for args, targets in sets]
        sets = [(args, targets, outs, tuple(torch.randn_like(o) for o in outs)) for args, targets, outs in sets]
    state = {"i": 0}

    def next_set():
        i = state["i"]
        state["i"] = (i + 1) % len(sets)
        return sets[i]

    if mode == "fwd":
        def step():
            args, _ = next_set()
            with torch.no_grad():
                return fn(*args)
    elif mode == "bwd":
        def step():
            _, targets, outs, grads = next_set()
            return torch.autograd.grad(outs, targets, grads, retain_graph=True)
    else:
        def step():
            args, targets, _, grads = next_set()
            return torch.autograd.grad(_as_tuple(fn(*args)), targets, grads)
    return step


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def gpu_ms(step: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median GPU time of one step in ms (CUDA events through triton.testing.do_bench)."""
    return triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def graph_ms(build_step: Callable[[], Callable[[], object]], calls: int = 8, replays: int = 10) -> float:
    """Median GPU time of one step in ms with no host path in it: `calls` consecutive steps (the
    input sets rotate as they do under do_bench) captured in one CUDA graph, replayed `replays`
    times. `build_step()` makes the step; it runs on the capture's stream, because autograd runs
    each backward op on its forward's stream, and a "bwd" step's forward runs when it is built (on
    the legacy default stream, a backward op invalidates the capture). The step must have run
    before (compiled, tuned, its dialect chosen): nothing may be compiled, timed or synchronized
    inside a capture. Raises what the capture raises, after undoing what a failed capture leaves."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up a capture needs (PyTorch's CUDA-graph notes)
        step = build_step()
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    stream_before = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, stream=side):
            for _ in range(calls):
                step()
    except BaseException:
        _undo_failed_capture(stream_before)
        raise
    try:
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
    finally:
        del graph
    times.sort()
    return times[len(times) // 2]


def _undo_failed_capture(stream_before: torch.cuda.Stream) -> None:
    """What a failed capture leaves behind (torch.cuda.graph's __exit__ raises from capture_end
    before it restores the stream, and the default generator stays marked as capturing, so every
    later random op fails with "Offset increment outside graph capture"): the stream comes back,
    and the generator gets a copy of its state that is not capturing (seed and offset kept)."""
    torch.cuda.set_stream(stream_before)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except (AttributeError, RuntimeError) as e:  # older torch (NotImplementedError is a RuntimeError): later random ops may fail; say why
        print(f"note: the CUDA generator could not be reset after a failed capture ({e})")


def graph_calls(ms: float) -> int:
    """Steps per captured graph: about 2 ms of work per replay, 4 to 64 steps."""
    return max(4, min(64, math.ceil(2.0 / max(ms, 1e-3))))


def host_us(step: Callable[[], object], iters: int = 200) -> float:
    """Wall time per step in µs, synchronizing once at the end. At tiny sizes the GPU finishes
    each step before the host enqueues the next, so this is the host path's cost."""
    for _ in range(10):
        step()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    _sync()
    return (time.perf_counter() - t0) / iters * 1e6


def best_us_per_call(fn: Callable[[], object], iters: int = 2000, runs: int = 7, warmup: int = 50) -> float:
    """Wall µs per call of a CPU-only step: the best of `runs` runs of `iters` calls after
    `warmup` calls (the CPU proxies of the host path, bench/*_host_proxy.py, run on machines that
    may be shared)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def _sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


_COPY_TBPS: dict[str, float] = {}


def copy_bandwidth_tbps() -> float:
    """The device's measured limit: a large device-to-device copy, bytes read + written."""
    if not on_gpu():
        return float("nan")
    key = torch.cuda.get_device_name()
    if key not in _COPY_TBPS:
        n = 2**28  # 1 GiB of fp32 each way
        a = torch.empty(n, device="cuda", dtype=torch.float32)
        b = torch.empty_like(a)
        ms = gpu_ms(lambda: b.copy_(a))
        _COPY_TBPS[key] = 2 * a.numel() * a.element_size() / (ms * 1e-3) / 1e12
        del a, b
    return _COPY_TBPS[key]


def peak_memory_mib(step: Callable[[], object]) -> float:
    """Peak memory allocated while running one step, above what was allocated before, in MiB."""
    if not on_gpu():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


# ---------------------------------------------------------------------------------------------
# Baselines that may or may not be installed
# ---------------------------------------------------------------------------------------------


def compiled(fn: Callable, **kwargs) -> Callable:
    """torch.compile of a baseline; compile errors surface at the first call.

    Donated buffers are turned off (this process only) so that the "bwd" mode, which replays
    one graph's backward with retain_graph=True, can time compiled baselines too."""
    torch._functorch.config.donated_buffer = False
    return torch.compile(fn, **kwargs)


def try_import(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except Exception:  # noqa: BLE001  (an optional baseline may fail to import in many ways)
        return None


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if on_gpu() else f"cpu (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})",
    }
    for name in ("transformers", "liger_kernel", "flash_attn", "xformers"):  # baselines and model code, if here
        version = _version_of(name)
        if version is not None:
            env[name] = version
    if on_gpu():
        env["copy_TBps"] = round(copy_bandwidth_tbps(), 3)
        env["cuda"] = torch.version.cuda
    return env


def _version_of(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return None


def write_results(op: str, rows: list[dict], columns: Sequence[str], *, plot_x: str | None = None,
                  plot_y: str = "GB/s", out_dir: Path = RESULTS_DIR, suffix: str = "",
                  env: dict | None = None) -> Path:
    """Writes <op>[-suffix].json (environment + rows) and .md (a table of `columns`), and a PNG
    of plot_y against plot_x per provider and mode when matplotlib is importable. `env`: the
    run's environment when it is not this process's (results rebuilt from a GPU run's log)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment() if env is None else env
    stem = f"{op}{'-' + suffix if suffix else ''}"
    json_path = out_dir / f"{stem}.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"op": op, "environment": env, "rows": rows}, indent=1))
    tmp.replace(json_path)
    lines = [f"# {op}", "", " · ".join(f"{k} {v}" for k, v in env.items()), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    if plot_x is not None:
        _plot(rows, out_dir / f"{stem}.png", plot_x, plot_y, op)
    return json_path


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _plot(rows: list[dict], path: Path, x: str, y: str, title: str) -> None:
    plt = try_import("matplotlib.pyplot")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if isinstance(r.get(y), float) and not math.isnan(r[y]):
            series.setdefault(f"{r['provider']} {r.get('variant', '')} {r['mode']}", []).append((r[x], r[y]))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(rows: list[dict], columns: Sequence[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)))


# ---------------------------------------------------------------------------------------------
# Sweeps: every provider x mode x shape, correctness checked against the first provider
# that is a PyTorch baseline before anything is timed.
# ---------------------------------------------------------------------------------------------


def sweep(
    providers: dict[str, Callable],
    shapes: Sequence[tuple[int, ...]],
    make_inputs: Callable[[tuple[int, ...]], tuple[tuple, Sequence[torch.Tensor]]],
    bytes_for: Callable[[tuple[int, ...], str], float] | None = None,
    flops_for: Callable[[tuple[int, ...], str], float] | None = None,
    modes: Sequence[str] = MODES,
    reference: str = "torch",
    x_name: str = "N",
    variant: str = "",
) -> list[dict]:
    """Times every (provider, mode, shape) and returns one row each with ms, GB/s (or TFLOP/s),
    % of the measured copy bandwidth, and speed-up over every other provider at that point; on a
    GPU also the same step's time replayed from a CUDA graph ("graph ms", "graph GB/s" or
    "graph TFLOP/s"; "graph error" when the step cannot be captured)."""
    rows = []
    copy = copy_bandwidth_tbps()
    for shape in shapes:
        check_against_reference(providers, reference, make_inputs, shape)
        point = []
        for mode in modes:
            for name, fn in providers.items():
                row = {"provider": name, "variant": variant, "mode": mode,
                       "shape": "x".join(map(str, shape)), x_name: shape[-1]}
                def build_step():
                    return make_step(fn, lambda: make_inputs(shape), mode,
                                     bytes_per_set=int(bytes_for(shape, "fwd")) if bytes_for else 0)
                try:
                    step = build_step()
                    ms = gpu_ms(step) if on_gpu() else _cpu_smoke_ms(step)
                    del step  # its input sets: the graph replay builds its own
                except Exception as e:  # noqa: BLE001  (a baseline that fails is reported, not fatal)
                    row["error"] = _error_text(e)
                    rows.append(row)
                    _print_row(row)
                    continue
                row["ms"] = ms
                if on_gpu():
                    try:
                        row["graph ms"] = graph_ms(build_step, graph_calls(ms))
                    except Exception as e:  # noqa: BLE001  (a provider that cannot be captured keeps its ms)
                        row["graph ms"] = float("nan")
                        row["graph error"] = _error_text(e)
                if bytes_for is not None:
                    row["GB/s"] = bytes_for(shape, mode) / (ms * 1e-3) / 1e9
                    row["% copy"] = 100 * row["GB/s"] / (copy * 1e3) if on_gpu() else float("nan")
                    if "graph ms" in row:
                        row["graph GB/s"] = bytes_for(shape, mode) / (row["graph ms"] * 1e-3) / 1e9
                if flops_for is not None:
                    row["TFLOP/s"] = flops_for(shape, mode) / (ms * 1e-3) / 1e12
                    if "graph ms" in row:
                        row["graph TFLOP/s"] = flops_for(shape, mode) / (row["graph ms"] * 1e-3) / 1e12
                point.append(row)
                rows.append(row)
                _print_row(row)
        for row in point:
            for other in point:
                if other["mode"] == row["mode"] and other is not row:
                    row[f"x vs {other['provider']}"] = other["ms"] / row["ms"]
        torch.cuda.empty_cache() if on_gpu() else None
    return rows


def _error_text(e: BaseException) -> str:
    """An exception as a table cell: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}" if str(e) else type(e).__name__


def _print_row(row: dict) -> None:
    """One JSON line per measured row, flushed: a run cut by its time limit (a lent GPU's call)
    still leaves every number it measured in its log, though its tables are never written."""
    print("row " + json.dumps(row), flush=True)


def check_against_reference(providers, reference, make_inputs, shape) -> None:
    """Runs each provider's forward on one input set and compares with the reference provider
    (loosely: this guards the benchmark against timing a wrong answer, the tests are the oracle)."""
    if reference not in providers:
        return
    args, _ = make_inputs(shape)
    with torch.no_grad():
        ref = _as_tuple(providers[reference](*args))
        for name, fn in providers.items():
            try:
                out = _as_tuple(fn(*args))
            except Exception:  # noqa: BLE001  (reported by the timing loop)
                continue
            for o, r in zip(out, ref):
                tol = 2e-2 if o.dtype in (torch.float16, torch.bfloat16) else 1e-4
                if not torch.allclose(o.float(), r.float(), atol=tol * max(1.0, r.abs().max().item()), rtol=tol):
                    raise AssertionError(f"{name} disagrees with {reference} at shape {shape}")


def _cpu_smoke_ms(step: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def host_overhead_rows(cases: dict[str, Callable[[], object]]) -> list[dict]:
    """Host µs per call for each named step (build them at tiny sizes)."""
    return [{"provider": name, "host µs": host_us(step, iters=200 if on_gpu() else 3)} for name, step in cases.items()]
