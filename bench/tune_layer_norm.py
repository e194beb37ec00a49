"""Sweeps the LayerNorm launch configuration (tile size, warps, backward programs per SM) on
the GPU and prints the best per shape: the evidence behind the defaults in
kernels/layer_norm.py. `python bench/tune_layer_norm.py`"""
import itertools

import _harness as H  # noqa: I001
import torch

from trifuse.kernels import layer_norm as ln

SHAPES = ((16384, 1024), (87381, 768), (8192, 4096), (4096, 8192), (4096, 16384))


def main() -> None:
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        e = 2
        best = {}
        y, _, mean, rstd = ln.layer_norm_fwd(x, n, w, b, 1e-5)
        for tile, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16)):
            bn = min(triton_np2(n), ln.MAX_SINGLE_BLOCK_FWD)
            if tile < bn:
                continue
            ln._fwd_config = lambda n_, t=tile, wp=warps, bn_=bn: (max(1, t // bn_), bn_, n_ <= ln.MAX_SINGLE_BLOCK_FWD, wp)
            ms = H.gpu_ms(lambda: ln.layer_norm_fwd(x, n, w, b, 1e-5))
            best.setdefault("fwd", []).append((2 * m * n * e / ms / 1e6, f"tile={tile} warps={warps}"))
        for tile, warps, per_sm in itertools.product((2048, 4096, 8192), (4, 8, 16), (1, 2, 4)):
            bn = min(triton_np2(n), ln.MAX_SINGLE_BLOCK_BWD)
            if tile < bn:
                continue
            ln._bwd_config = lambda n_, t=tile, wp=warps, bn_=bn: (max(1, t // bn_), bn_, n_ <= ln.MAX_SINGLE_BLOCK_BWD, wp)
            ln.BWD_PROGRAMS_PER_SM = per_sm
            ms = H.gpu_ms(lambda: ln.layer_norm_bwd(dy, x, n, w, mean, rstd))
            best.setdefault("bwd", []).append((3 * m * n * e / ms / 1e6, f"tile={tile} warps={warps} per_sm={per_sm}"))
        for k, v in best.items():
            v.sort(reverse=True)
            print(f"{m}x{n} {k}: " + " | ".join(f"{gbs:.0f} GB/s {cfg}" for gbs, cfg in v[:4]) + f" | worst {v[-1][0]:.0f}")


def triton_np2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
