"""Which forward config and feature makes the 16-bit attention forward fail on the H200
(2026-12-04, Triton 3.6: the bisect_attention.py case Case(b=2, sq=40, sk=40, d=24, dv=8,
mask="hf") gave a max error of 1.3 in fp16 and bf16 and then an illegal memory access; fp32 and
the interpreter, with the same configs and the GPU's no-bounds path, pass).

Each variant runs in its own process (an illegal access ends a process's CUDA context), with
the forward's config list cut to the one config named: forward only, no dropout, fp16. One line
per variant: max error against the float64 reference and where, or how the process ended.
Run on a GPU: `python bench/bisect_attention_configs.py`."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (BLOCK_M, BLOCK_N, num_warps, num_stages), the case's changes
VARIANTS = [
    ((128, 64, 8, 3), {"raw": True}),  # unpadded (before 48a72ba): the failing launch, still failing?
    ((128, 128, 8, 3), {"raw": True}),
    ((128, 64, 8, 3), {}),  # the masked 16-bit default at head dim 64, its value head padded to 16
    ((128, 64, 8, 3), {"mask": ""}),
    ((128, 64, 8, 3), {"dv": 32}),
    ((128, 64, 8, 3), {"dv": 16}),
    ((128, 64, 8, 3), {"d": 32, "dv": 32}),
    ((128, 64, 8, 3), {"sq": 128, "sk": 128}),
    ((128, 64, 8, 3), {"dtype": "bfloat16"}),
    ((128, 64, 8, 1), {}),
    ((128, 64, 4, 3), {}),
    ((128, 128, 8, 3), {}),
    ((128, 32, 4, 4), {}),
    ((64, 64, 4, 4), {}),
    ((64, 32, 4, 3), {}),
    ((64, 64, 4, 1), {}),
    ((32, 32, 4, 1), {}),
    ((64, 32, 8, 2), {"dtype": "float32"}),
]


def child(shape: list, changes: dict) -> None:
    os.environ["TRIFUSE_AUTOTUNE"] = "0"
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "kernels")]
    import torch

    import trifuse
    import trifuse.kernels.attention as A
    import test_attention as T

    dtype = getattr(torch, changes.pop("dtype", "float16"))
    if changes.pop("raw", False):  # the kernels on the narrow head itself, as before the host's padding
        A._MIN_HEAD_DIM = 0
    A._MASKED_16BIT_DEFAULT.clear()
    A._DROPOUT_16BIT_DEFAULT.clear()
    for table in (A._SHAPES_16BIT, A._SHAPES_WIDE):
        for d_class in table["fwd"]:
            table["fwd"][d_class] = [tuple(shape)]
    case = T.Case(**{"b": 2, "sq": 40, "sk": 40, "d": 24, "dv": 8, "mask": "hf", **changes})
    q, k, v, mask = T.make(case, dtype)
    with torch.no_grad():
        out = trifuse.ops.attention(q, k, v, attn_mask=mask, **T.kwargs_of(case))
        if out.is_cuda:
            torch.cuda.synchronize()
        ref = T.attention_ref(*(t.double() for t in (q, k, v)), T.as_ref(mask, torch.float64), 0.0,
                              **T.kwargs_of(case))
    err = (out.double() - ref).abs().nan_to_num(float("inf"))
    worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    bad_rows = sorted({(int(b), int(r)) for b, _, r, _ in (err > 0.05).nonzero().tolist()})
    print(f"{err.max().item():10.3g}  worst {worst}  rows off: {len(bad_rows)} {bad_rows[:8]}")


def run(shape: tuple, changes: dict) -> str:
    try:
        done = subprocess.run([sys.executable, __file__, json.dumps([shape, changes])], capture_output=True,
                              text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return "timed out"
    lines = (done.stdout.strip().splitlines() or [""])
    if done.returncode:
        err = [ln for ln in done.stderr.splitlines() if "Error" in ln]
        return f"rc {done.returncode}: {(err[-1] if err else done.stderr[-200:])[:110]}"
    return lines[-1]


def main() -> None:
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda v: run(*v), VARIANTS))
    for (shape, changes), line in zip(VARIANTS, results):
        print(f"{shape!s:18s} {json.dumps(changes):28s} {line}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(*json.loads(sys.argv[1]))
    else:
        main()
