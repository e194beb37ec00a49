"""Sweeps the LayerNorm launch configurations (autotune/configs.py: norm_fwd, norm_bwd) on the
GPU through the launchers' own tuners and prints the fastest per shape, in GB/s: the evidence
behind entry 0 of each space. Every run times afresh (a private cache directory, nothing kept
from the disk cache); `python -m trifuse.autotune ... --export-defaults` ships the winners.

    python bench/tune_layer_norm.py
"""
import os
import tempfile

import _harness as H  # noqa: I001  (first: sets TRITON_INTERPRET before trifuse is imported on CPU)
import torch

from trifuse.autotune import records
from trifuse.kernels import layer_norm as ln

SHAPES = ((16384, 1024), (87381, 768), (8192, 4096), (4096, 8192), (4096, 16384))


def main() -> None:
    if not H.on_gpu():
        raise SystemExit("bench/tune_layer_norm.py times configurations on a GPU; there is none here")
    os.environ["TRIFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="trifuse-tune-ln-")
    os.environ.pop("TRIFUSE_AUTOTUNE", None)
    e = 2
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        ln._FWD_TUNER.clear()
        ln._BWD_TUNER.clear()
        ln._FWD_PLANS.clear()
        ln._BWD_PLANS.clear()
        _, _, mean, rstd = ln.layer_norm_fwd(x, n, w, b, 1e-5)  # times every fitting forward config
        ln.layer_norm_bwd(dy, x, n, w, mean, rstd)  # and every backward config, with its reduction
        for name, passes in (("layer_norm_fwd", 2), ("layer_norm_bwd", 3)):
            d = [r for r in records(name=name, kind="kernel") if f"n={n}," in r.bucket][-1]
            gbs = sorted(((passes * m * n * e / ms / 1e6, label) for label, ms in d.times_ms.items()), reverse=True)
            default = d.times_ms.get(next(iter(d.times_ms)), float("nan"))
            print(f"{m}x{n} {name}: " + " | ".join(f"{g:.0f} GB/s {label}" for g, label in gbs[:4])
                  + f" | worst {gbs[-1][0]:.0f} | default {passes * m * n * e / default / 1e6:.0f}"
                  + (f" | pruned: {', '.join(d.rejected)}" if d.rejected else ""))


if __name__ == "__main__":
    main()
