"""Runs trifuse's LayerNorm kernels on the available device and prints speed against PyTorch.

    python examples/layer_norm_speed.py

On a GPU: bf16, fwd+bwd, a few transformer widths. On a CPU: the Triton interpreter at a tiny
size (speed there means nothing; it shows the kernels run and agree with PyTorch).
"""
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before trifuse is imported

import torch.nn.functional as F  # noqa: E402

import trifuse  # noqa: E402


def fwd_bwd_ms(fn, x, w, b, dy, iters):
    for _ in range(2):
        torch.autograd.grad(fn(x, w, b), (x, w, b), dy)
    if x.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.autograd.grad(fn(x, w, b), (x, w, b), dy)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    shapes = [(16384, 1024), (8192, 4096), (4096, 8192)] if gpu else [(8, 256)]
    print(f"device: {torch.cuda.get_device_name() if gpu else 'cpu (Triton interpreter)'}, dtype {dtype}")
    print(f"{'shape':>12} {'torch ms':>9} {'trifuse ms':>11} {'speed-up':>9} {'GB/s':>7} {'max |diff|':>11}")
    for m, n in shapes:
        x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(m, n, device=device, dtype=dtype)
        ref = lambda x, w, b: F.layer_norm(x, (n,), w, b)  # noqa: E731
        ours = lambda x, w, b: trifuse.ops.layer_norm(x, (n,), w, b)  # noqa: E731
        diff = (ours(x, w, b) - ref(x, w, b)).abs().max().item()
        iters = 50 if gpu else 2
        t_ref, t_ours = fwd_bwd_ms(ref, x, w, b, dy, iters), fwd_bwd_ms(ours, x, w, b, dy, iters)
        gbs = 5 * m * n * x.element_size() / (t_ours * 1e-3) / 1e9  # x, y | x, dy, dx
        print(f"{m}x{n:>6} {t_ref:9.3f} {t_ours:11.3f} {t_ref / t_ours:8.2f}x {gbs:7.0f} {diff:11.2e}")


if __name__ == "__main__":
    main()
