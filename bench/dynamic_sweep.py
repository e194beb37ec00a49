"""`torch.compile(model, backend="trifuse", dynamic=True)` on transformers' text models, built
small as bench/fuse_sweep.py builds them: does the rewrite add guards that make Dynamo compile
again for every new batch or sequence length? A model whose graphs compile once with Dynamo's own
backend ("eager") must compile as often with trifuse's; a guard a pattern's check or a rewrite's
bookkeeping adds on a symbolic size (an `int()` of it, a shape compared or computed with guards
on) specializes the capture to the first call's sizes, and training on batches of varying
length then recompiles at every new length (until Dynamo's recompile limit, then runs unfused).

    TRITON_INTERPRET=1 python bench/dynamic_sweep.py [--task TASK] [--backend trifuse|trifuse_inductor]
                                                     [--jobs N] [MODEL_TYPE ...]
        # TASK: causal-lm (default; ~20 min on 2 cores with --jobs 2), masked-lm or seq2seq;
        # MODEL_TYPE: transformers' model types (default: every type of the task, as
        # bench/fuse_sweep.py sweeps them); named types replace their rows

Each type runs in its own process: the model in fp32, train mode, dropout off; a training step
(forward, the model's own loss, backward) on each of SIZES (batch, sequence) through
torch.compile(dynamic=True) with backend "eager", then with the trifuse backend, each after
torch._dynamo.reset(). Status per type:
    ok              the trifuse backend compiled as many graphs as Dynamo's own, and every loss within
                    1e-4 (relative) of the eager backend's
    RECOMPILES      more graphs with trifuse: `why` is Dynamo's first guard failure that recompiled
    MISMATCH        a loss further off
    FUSED CRASH     the eager backend ran and trifuse's raised
    Dynamo fails / config / build / timeout: the harness's (not a verdict on trifuse)
Writes bench/results/dynamic_sweep[_<task>][_inductor].json and .md.
"""
import copy
import json
import logging
import os
import sys
import time

if __name__ == "__main__" and any(a.startswith("--one=") for a in sys.argv):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

# (batch, sequence): three lengths, none 0 or 1 (Dynamo specializes those whatever the backend)
SIZES = ((2, 12), (3, 9), (2, 17))
LOSS_RTOL = 1e-4
TASKS = ("causal-lm", "masked-lm", "seq2seq")


class _FirstRecompile(logging.Handler):
    """Keeps the first recompile reason Dynamo logs (its `recompiles` artifact)."""

    def __init__(self) -> None:
        super().__init__()
        self.why: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.why is None:
            lines = [ln.strip() for ln in record.getMessage().splitlines() if ln.strip().startswith("- ")]
            self.why = lines[0][2:][:200] if lines else record.getMessage()[:200]


def _batch(task: str, batch: int, seq: int) -> dict:
    """The sweep's batch (bench/fuse_sweep.py `_inputs`: token ids that are their own labels) at
    (batch, seq)."""
    ids = torch.randint(1, 64, (batch, seq))
    kwargs = {"input_ids": ids, "labels": ids}
    if task in ("causal-lm", "seq2seq"):
        kwargs["use_cache"] = False
    return kwargs


def _steps(model, task: str, backend: str) -> tuple[int, list[float], dict]:
    """Graphs compiled, each size's loss, and what trifuse's report counts, for one backend."""
    import trifuse
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    losses = []
    for batch, seq in SIZES:
        torch.manual_seed(batch * 100 + seq)
        loss = compiled(**_batch(task, batch, seq)).loss
        loss.backward()
        losses.append(float(loss.detach()))
    counts = trifuse.report(compiled).counts() if backend != "eager" else {}
    return counters["stats"]["unique_graphs"], losses, dict(sorted(counts.items()))


def run_one(model_type: str, task: str = "causal-lm", backend: str = "trifuse") -> dict:
    import transformers as tf
    from fuse_sweep import _auto_class, _config, _from_config

    tf.logging.set_verbosity_error()
    for attn in ("sdpa", "eager"):  # eager attention where a model has no SDPA, as the sweep does
        try:
            cfg = _config(tf, model_type, attn, task)
            torch.manual_seed(0)
            model = _from_config(_auto_class(tf, task), cfg).float().train()
            break
        except Exception as e:  # noqa: BLE001
            if attn == "sdpa" and "does not support an attention implementation" in str(e):
                continue
            return {"status": "build", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    try:
        # each backend on its own copy: a model may change itself on its first call (BigBird
        # switches to full attention for short sequences, in its config)
        graphs0, losses0, _ = _steps(copy.deepcopy(model), task, "eager")
    except Exception as e:  # noqa: BLE001
        return {"status": "Dynamo fails", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    handler = _FirstRecompile()
    torch._logging.set_logs(recompiles=True)
    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    logger.addHandler(handler)
    try:
        graphs1, losses1, replaced = _steps(model, task, backend)
    except Exception as e:  # noqa: BLE001
        return {"status": "FUSED CRASH", "why": f"{type(e).__name__}: {str(e).strip()[:200]}"}
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()  # PyTorch's defaults again (the tests call this in their process)
    err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses1, losses0))
    status = "RECOMPILES" if graphs1 > graphs0 else "MISMATCH" if not err <= LOSS_RTOL else "ok"
    row = {"status": status, "graphs_eager": graphs0, "graphs_trifuse": graphs1, "loss_rel_err": err,
           "replaced": replaced}
    if status == "RECOMPILES":
        row["why"] = handler.why or "(no reason logged)"
    return row


def _markdown(rows: list[dict], header: str) -> str:
    lines = ["# dynamic_sweep", "", header, "",
             "| type | status | graphs (eager / trifuse) | loss rel err | replaced | why |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        replaced = ", ".join(f"{k} {v}" for k, v in r.get("replaced", {}).items())
        graphs = f"{r['graphs_eager']} / {r['graphs_trifuse']}" if "graphs_eager" in r else ""
        err = f"{r['loss_rel_err']:.1e}" if "loss_rel_err" in r else ""
        why = " ".join(r.get("why", "").split()).replace("|", "/")  # one table row
        lines.append(f"| {r['type']} | {r['status']} | {graphs} | {err} | {replaced} | {why} |")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines += ["", "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""]
    return "\n".join(lines)


def main(types: list[str], task: str, backend: str, jobs: int) -> None:
    import platform

    import transformers as tf
    import triton
    from fuse_sweep import child_row, run_rows, save_rows, task_types
    from transformers.models.auto import modeling_auto

    partial = bool(types)
    types = types or task_types(modeling_auto, task)

    def child(model_type: str, threads: int | None) -> dict:
        timeout = 900 if backend == "trifuse_inductor" else 400
        return child_row(__file__, [f"--one={model_type}", f"--task={task}", f"--backend={backend}"],
                         model_type, timeout, threads, memory_gib=8)

    rows = run_rows(types, child, jobs)
    header = (f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · torch {torch.__version__} · triton "
              f"{triton.__version__} · transformers {tf.__version__} · python {platform.python_version()} · CPU "
              f"(TRITON_INTERPRET=1), fp32, task {task}, backend {backend}, dynamic=True, sizes "
              + ", ".join(f"{b}x{s}" for b, s in SIZES))
    stem = "dynamic_sweep" + ("" if task == "causal-lm" else f"_{task}") \
        + ("_inductor" if backend == "trifuse_inductor" else "")
    save_rows(stem, rows, header, _markdown, partial)


def _option(args: list[str], name: str, default: str) -> str:
    for a in list(args):
        if a.startswith(f"--{name}="):
            args.remove(a)
            return a.split("=", 1)[1]
    if f"--{name}" in args:
        i = args.index(f"--{name}")
        value = args[i + 1]
        del args[i:i + 2]
        return value
    return default


if __name__ == "__main__":
    args = sys.argv[1:]
    task, backend = _option(args, "task", "causal-lm"), _option(args, "backend", "trifuse")
    jobs = int(_option(args, "jobs", "1"))
    if task not in TASKS:
        sys.exit(f"dynamic_sweep: --task must be one of {', '.join(TASKS)}, got {task!r}")
    if backend not in ("trifuse", "trifuse_inductor"):
        sys.exit(f"dynamic_sweep: --backend must be trifuse or trifuse_inductor, got {backend!r}")
    one = [a for a in args if a.startswith("--one=")]
    if one:
        print(json.dumps(run_one(one[0][len("--one="):], task, backend)), flush=True)
    else:
        unknown = [a for a in args if a.startswith("-")]
        if unknown:
            sys.exit(f"dynamic_sweep: unknown option {unknown[0]!r}\n{__doc__}")
        main(args, task, backend, jobs)
