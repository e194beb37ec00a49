"""Where the host time of one fused op's eager call goes: cProfile over many fwd+bwd calls at a
tiny size, plus the cost of the pieces (a raw Triton launch, an empty allocation, autograd).
`python bench/profile_host.py`"""
import cProfile
import pstats
import time

import _harness as H  # noqa: I001
import torch
import torch.nn.functional as F

import trifuse
from trifuse.kernels import layer_norm as ln


def per_call_us(fn, iters=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    y, _, mean, rstd = ln.layer_norm_fwd(xd, 1024, wd, bd, 1e-5)
    pieces = {
        "torch.empty (4,1024)": lambda: torch.empty(4, 1024, device="cuda", dtype=torch.bfloat16),
        "launcher layer_norm_fwd": lambda: ln.layer_norm_fwd(xd, 1024, wd, bd, 1e-5),
        "launcher layer_norm_bwd": lambda: ln.layer_norm_bwd(dy, xd, 1024, wd, mean, rstd),
        "trifuse fwd (no grad)": lambda: trifuse.ops.layer_norm(xd, (1024,), wd, bd),
        "trifuse fwd+bwd": lambda: torch.autograd.grad(trifuse.ops.layer_norm(x, (1024,), w, b), (x, w, b), dy),
        "F.layer_norm fwd (no grad)": lambda: F.layer_norm(xd, (1024,), wd, bd),
        "F.layer_norm fwd+bwd": lambda: torch.autograd.grad(F.layer_norm(x, (1024,), w, b), (x, w, b), dy),
    }
    for name, fn in pieces.items():
        print(f"{name:32s} {per_call_us(fn):8.1f} us")
    prof = cProfile.Profile()
    step = pieces["trifuse fwd+bwd"]
    prof.enable()
    for _ in range(300):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
