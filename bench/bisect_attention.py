"""Which feature makes the failing GPU attention case fail (H200, 2026-11-30, Triton 3.6:
tests/kernels/test_attention.py::test_dropout_matches_oracle_with_the_kernels_mask with bf16 and
Case(b=2, sq=40, sk=40, d=24, dv=8, mask="hf"): output max error 1.3 against a bound of 0.065;
the four other dropout cases passed in bf16, and fp32/fp16 pass in the interpreter).

Forward only, the kernel's own dropout mask read back as the test does, TRIFUSE_AUTOTUNE=0 (the
default configs the test ran with). One line per variant and dtype: the max error against the
float64 reference with the same mask, PyTorch's own error in that dtype, and where the worst
entry is (b, h, row, col). Run on a GPU: `python bench/bisect_attention.py`."""
import os
import sys
from pathlib import Path

os.environ.setdefault("TRIFUSE_AUTOTUNE", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "kernels")]

import torch  # noqa: E402

import trifuse  # noqa: E402
import test_attention as T  # noqa: E402  (its Case, make, kernel_keep_mask and reference)

BASE = dict(b=2, sq=40, sk=40, d=24, dv=8, mask="hf")
VARIANTS = {
    "failing case": ({}, 0.3),
    "no dropout": ({}, 0.0),
    "dv 16": ({"dv": 16}, 0.3),
    "dv = d (24)": ({"dv": None}, 0.3),
    "d 16, dv 8": ({"d": 16}, 0.3),
    "no mask": ({"mask": ""}, 0.3),
    "bool key padding": ({"mask": "keypad"}, 0.3),
    "batch 1 (no row masked whole)": ({"b": 1}, 0.3),
    "sq = sk = 70": ({"sq": 70, "sk": 70}, 0.3),
}


def one(dtype: torch.dtype, changes: dict, p: float) -> str:
    case = T.Case(**{**BASE, **changes})
    keep = T.kernel_keep_mask(case.b, case.h, case.sq, case.sk, p, seed=123) if p else None
    q, k, v, mask = T.make(case, dtype)
    torch.manual_seed(123)
    with torch.no_grad():
        out = trifuse.ops.attention(q, k, v, attn_mask=mask, dropout_p=p, **T.kwargs_of(case))
        ref = T.attention_ref(*(t.double() for t in (q, k, v)), T.as_ref(mask, torch.float64), p,
                              dropout_mask=keep, **T.kwargs_of(case))
        ref_lp = T.attention_ref(q, k, v, mask, p, dropout_mask=keep, **T.kwargs_of(case))
    err = (out.double() - ref).abs().nan_to_num(float("inf"))
    own = (ref_lp.double() - ref).abs().nan_to_num(float("inf")).max().item()
    worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    return f"{err.max().item():10.3g} {own:10.3g}  {worst}"


def main() -> None:
    print(torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (interpreter)", torch.__version__)
    print(f"{'variant':32s} {'dtype':9s} {'max err':>10s} {'torch err':>10s}  worst (b, h, row, col)")
    for name, (changes, p) in VARIANTS.items():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            try:
                line = one(dtype, changes, p)
            except Exception as e:  # noqa: BLE001  (report and go on)
                line = f"raised {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            print(f"{name:32s} {str(dtype)[6:]:9s} {line}", flush=True)


if __name__ == "__main__":
    main()
