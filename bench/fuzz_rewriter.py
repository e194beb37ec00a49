"""A long fuzz of the rewriter: random blocks (tests/_random_blocks.py) fused and compared with the
unfused model and float64 by the tests' oracle rule, outputs and every gradient.

    TRITON_INTERPRET=1 python bench/fuzz_rewriter.py [--examples 200] [--seed 0] [--save]

Each example draws a Spec (faithful spellings and near misses of every family; one in three a
HeadSpec: an LM head and its loss), a capture (fx, Dynamo, torch.compile with backend "trifuse"
or, one in ten, "trifuse_inductor"), a mode (eval; or train without dropout) and a dtype (fp32 or
fp16). Prints one line per failure and a summary (how many examples fused each family); --save
writes bench/results/fuzz_rewriter.{json,md}.
The CI test (tests/fusion/test_fuzz_rewriter.py) runs a fixed 24 of these."""
import argparse
import dataclasses
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

import _device  # noqa: E402,F401  (before trifuse: the interpreter)
import _random_blocks as rb  # noqa: E402
import torch  # noqa: E402
from _fusing import check_against_unfused  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "fusion"))
from test_fuzz_rewriter import checked  # noqa: E402


def draw(rng: random.Random) -> tuple[rb.Spec, str, bool, torch.dtype]:
    spec = rb.Spec(norm=rng.choice(rb.NORMS), attention=rng.choice(rb.ATTENTIONS),
                   activation=rng.choice(rb.ACTIVATIONS), residual=rng.choice(rb.RESIDUALS),
                   mask=rng.choice(rb.MASKS), pre_norm=rng.random() < 0.5, eps=rng.choice([1e-5, 1e-6, 1e-2]),
                   dropout=rng.choice([0.0, 0.1]), mlp_bias=rng.random() < 0.5)
    train = rng.random() < 0.5
    if train:
        spec = dataclasses.replace(spec, dropout=0.0)  # the kernels' dropout masks are not PyTorch's
    capture = rng.choices(["fx", "dynamo", "compile", "compile-inductor"], weights=[3, 3, 3, 1])[0]
    return spec, capture, train, rng.choice([torch.float32, torch.float16])


def draw_head(rng: random.Random) -> tuple[rb.HeadSpec, str, bool, torch.dtype]:
    spec = rb.HeadSpec(vocab=rng.choice([1030, 77, 64]), bias=rng.random() < 0.5, tied=rng.random() < 0.5,
                       upcast=rng.random() < 0.5, shift=rng.random() < 0.5,
                       ignored=rng.choice(["none", "some", "all"]),
                       reduction=rng.choice(["mean", "sum", "none"]),
                       smoothing=rng.choice([0.0, 0.1]), returns_logits=rng.random() < 0.5,
                       loss=rng.choice(rb.LOSSES))
    capture = rng.choices(["fx", "dynamo", "compile", "compile-inductor"], weights=[3, 3, 3, 1])[0]
    return spec, capture, True, rng.choice([torch.float32, torch.float16])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    failures, fused, t0 = [], Counter(), time.perf_counter()
    for i in range(args.examples):
        spec, capture, train, dtype = draw(rng) if i % 3 else draw_head(rng)
        try:
            def run(spec=spec, dtype=dtype, capture=capture, train=train):
                if isinstance(spec, rb.HeadSpec):
                    def make():
                        torch.manual_seed(0)
                        return rb.RandomHead(spec).to(dtype)
                    return check_against_unfused(make, rb.head_inputs(spec), capture, train=True)
                return check_against_unfused(lambda: rb.random_model(spec, dtype=dtype),
                                             rb.inputs(dtype=dtype), capture, train=train)

            report = checked(run, capture)
            fused.update(report.counts().keys())
        except Exception as e:  # noqa: BLE001  (a failure is the finding: record it, go on)
            line = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            failures.append({"spec": {"kind": type(spec).__name__, **dataclasses.asdict(spec)},
                             "capture": capture, "train": train,
                             "dtype": str(dtype), "error": line})
            print(f"FAIL {i}: {spec.id} {capture} train={train} {dtype}: {line}", flush=True)
    seconds = time.perf_counter() - t0
    print(f"{args.examples} examples, {len(failures)} failures, {seconds:.0f} s; "
          "examples fusing each family: "
          + ", ".join(f"{k} {v}" for k, v in sorted(fused.items())))
    if args.save:
        out = ROOT / "bench" / "results" / "fuzz_rewriter"
        data = {"examples": args.examples, "seed": args.seed, "seconds": round(seconds, 1),
                "fused_families": dict(fused), "failures": failures}
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        lines = ["# fuzz_rewriter", "",
                 f"{args.examples} random draws (blocks; one in three an LM head and its loss; "
                 f"seed {args.seed}), {len(failures)} failures, {seconds:.0f} s on this CPU "
                 "(Triton interpreter).", "",
                 "| family | examples that fused it |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(fused.items())]
        if failures:
            lines += ["", "| spec | capture | train | dtype | error |", "|---|---|---|---|---|"]
            lines += [f"| {f['spec']} | {f['capture']} | {f['train']} | {f['dtype']} "
                      f"| {f['error']} |" for f in failures]
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
