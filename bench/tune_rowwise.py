"""Sweeps the row-wise kernels' launch configurations (autotune/configs.py: rowwise_fwd,
rowwise_bwd, group_norm) on the GPU through their launchers' own tuners, at the shapes of the end-to-end
models, and writes every config's GB/s: the evidence for (or against) the backward's PREFETCH
loop and more programs an SM. On the H200 (2026-11-27) the summing backward passes moved
2.0-2.6 TB/s at their defaults (BERT-large's bias + GeLU backward 92 us a call), the one-tile
forward passes 3.3-3.9 TB/s. Every run times afresh (a private cache directory); the tuner
times each config as `do_bench` does (median, L2 flushed), the launch alone.

    python bench/tune_rowwise.py      ->  bench/results/tune_rowwise.{json,md}
"""
import os
import tempfile

import _harness as H  # noqa: I001  (first: sets TRITON_INTERPRET before trifuse is imported on CPU)
import torch

from trifuse.autotune import records
from trifuse.autotune.decisions import clear_records
from trifuse.kernels import bias_gelu as bg
from trifuse.kernels import dropout_add as da
from trifuse.kernels import gated_activation as ga
from trifuse.kernels import group_norm as gn

BF16 = 2  # bytes an element


def _bias_gelu(m: int, n: int, form: str):
    x, dy = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    bg.bias_gelu_fwd(x, b, form)  # times every forward config: reads x, writes y
    bg.bias_gelu_bwd(dy, x, b, form)  # and every backward config: reads dy and x, writes dx
    return {"bias_gelu_fwd": 2, "bias_gelu_bwd": 3}


def _dropout_add(m: int, n: int):
    x, r, dy = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor([7], dtype=torch.int64, device="cuda")
    da.dropout_add_fwd(x, r, b, 0.1, seed)  # reads x and the residual, writes y
    da.dropout_add_bwd(dy, seed, 0.1, True)  # reads dy, writes dx
    return {"dropout_add_fwd": 3, "dropout_add_bwd": 2}


def _gated(m: int, n: int):
    g, u, dy = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ga.gated_activation_fwd(g, u, "silu")  # reads gate and up, writes y
    ga.gated_activation_bwd(dy, g, u, "silu")  # reads dy, gate and up, writes both gradients
    return {"gated_activation_fwd": 3, "gated_activation_bwd": 5}


def _group_norm(shape: tuple[int, ...], silu: bool, channels_last: bool = False):
    x, dy = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if channels_last:  # its own tuning key: the kernels read it in another order
        x, dy = (t.movedim(1, -1).contiguous().movedim(-1, 1) for t in (x, dy))
    w, b = (torch.randn(shape[1], device="cuda", dtype=torch.bfloat16) for _ in range(2))
    act = "silu" if silu else None
    _, mean, rstd = gn.group_norm_fwd(x, 32, w, b, 1e-5, act, x.dtype)  # reads x twice, writes y
    gn.group_norm_bwd(dy, x, 32, w, b, mean, rstd, act)  # dy and x twice each, writes dx
    return {"group_norm_fwd": 3, "group_norm_bwd": 5}


# (label, m, n, run): BERT-large's MLP (16 x 512 tokens, 4096 wide, exact GeLU), GPT-2 medium's
# (8 x 1024, tanh), a 1024-wide dropout + add with a bias, Llama 3.2 1B's SwiGLU (4 x 2048, 8192);
# GroupNorm (32 groups) + SiLU of Stable Diffusion 1.5's UNet at 512 px, batch 8 (its first and last
# stages' widths; m x n = the tensor's numel), and of its VAE decoder's last stage at 512 px.
CASES = (
    ("BERT-large MLP", 8192, 4096, lambda m, n: _bias_gelu(m, n, "none")),
    ("GPT-2 medium MLP", 8192, 4096, lambda m, n: _bias_gelu(m, n, "tanh")),
    ("ViT-B / BERT-base MLP", 8192, 3072, lambda m, n: _bias_gelu(m, n, "none")),
    ("dropout + add, bias", 8192, 1024, _dropout_add),
    ("Llama 3.2 1B SwiGLU", 8192, 8192, _gated),
    ("SD UNet GN+SiLU 8x320x64x64", 8 * 320, 64 * 64, lambda m, n: _group_norm((8, 320, 64, 64), True)),
    ("SD UNet GN+SiLU 8x1280x8x8", 8 * 1280, 8 * 8, lambda m, n: _group_norm((8, 1280, 8, 8), True)),
    ("SD VAE GN+SiLU 1x128x512x512", 128, 512 * 512, lambda m, n: _group_norm((1, 128, 512, 512), True)),
    ("SD UNet GN+SiLU 8x320x64x64 channels_last", 8 * 320, 64 * 64,
     lambda m, n: _group_norm((8, 320, 64, 64), True, channels_last=True)),
)


def _forget_tuning() -> None:
    """Every swept kernel's choices, stored launches and records forgotten: the next call times
    again, and records() holds this case's decisions only."""
    clear_records()
    for module in (bg, da, ga):
        for tuning in (module._FWD_TUNING, module._BWD_TUNING):
            tuning.tuner.clear()
            tuning.launches.clear()
    gn._FWD_TUNER.clear()
    gn._BWD_TUNER.clear()
    gn._LAUNCHES.clear()


def main() -> None:
    if not H.on_gpu():
        raise SystemExit("bench/tune_rowwise.py times configurations on a GPU; there is none here")
    os.environ["TRIFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="trifuse-tune-rowwise-")
    os.environ.pop("TRIFUSE_AUTOTUNE", None)
    copy = H.copy_bandwidth_tbps() * 1e3  # GB/s
    rows = []
    for label, m, n, run in CASES:
        _forget_tuning()
        passes = run(m, n)
        for name, tensors in passes.items():
            d = records(name=name, kind="kernel")[-1]  # this case's: the records were cleared
            default = next(iter(d.times_ms), None)
            for config, ms in d.times_ms.items():
                gbs = tensors * m * n * BF16 / ms / 1e6
                rows.append({"case": label, "kernel": name, "shape": f"{m}x{n}", "config": config, "ms": ms,
                             "GB/s": gbs, "% copy": 100 * gbs / copy, "default": config == default,
                             "chosen": config == d.chosen,
                             "x vs default": d.times_ms[default] / ms if default else float("nan")})
            for config, why in d.rejected.items():
                rows.append({"case": label, "kernel": name, "shape": f"{m}x{n}", "config": config,
                             "pruned": why})
        H.write_results("tune_rowwise", rows, ("case", "kernel", "shape", "config", "ms", "GB/s", "% copy",
                                               "x vs default", "default", "chosen", "pruned"))
        H.print_table([r for r in rows if r["case"] == label and r.get("chosen")],
                      ("case", "kernel", "config", "ms", "GB/s", "% copy", "x vs default"))


if __name__ == "__main__":
    main()
