"""Where the host time of trifuse's eager calls goes, on a GPU: wall µs per call at tiny sizes
for each op's eager path and registered op, beside PyTorch's, and the pieces they are made of
(an allocation, a launcher alone, autograd with a C++ backward against a Python one, with and
without a shorter GIL switch interval); then cProfile of the slowest fwd+bwd.

    python bench/profile_host.py [--profile OP]

The H100 run of 2026-11-23 measured fwd at 37–107 µs but fwd+bwd at 400–1350 µs for every op
with a Python backward (bench/results/README.md); the H200 run of 2026-11-27 632 µs for the
LayerNorm kernels' fwd+bwd against 275 for F.layer_norm (bench/results/h200-2026-11-27/). The
profiles run with the backward on the calling thread, so that they see it.
"""
import argparse
import cProfile
import pstats
import sys
import time

import _harness as H  # noqa: I001
import torch
import torch.nn.functional as F

import trifuse
from trifuse.kernels import layer_norm as ln
from trifuse.kernels.rotary import rotary_embedding_ref

DEV, DT = "cuda", torch.bfloat16


def per_call_us(fn, iters=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def leaf(*shape, dtype=DT):
    return torch.randn(*shape, device=DEV, dtype=dtype, requires_grad=True)


def fwd_bwd(fn, inputs):
    def step():
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        outs = [o for o in outs if o.requires_grad]
        torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs])
    return step


class _PyClone(torch.autograd.Function):
    """The cheapest possible Python backward: what any autograd.Function pays on top of C++."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def cases() -> dict:
    x, w, b, r = leaf(4, 1024), leaf(1024), leaf(1024), leaf(4, 1024)
    q, k, v = leaf(1, 2, 16, 64), leaf(1, 2, 16, 64), leaf(1, 2, 16, 64)
    logits, target = leaf(8, 512), torch.randint(0, 512, (8,), device=DEV)
    hid, head = leaf(8, 64), leaf(512, 64)
    cos, sin = torch.randn(1, 1, 16, 64, device=DEV, dtype=DT), torch.randn(1, 1, 16, 64, device=DEV, dtype=DT)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    y, _, mean, rstd = ln.layer_norm_fwd(xd, 1024, wd, bd, 1e-5)
    dy = torch.randn_like(xd)
    c = {
        # pieces
        "torch.empty (4,1024)": lambda: torch.empty(4, 1024, device=DEV, dtype=DT),
        "launcher layer_norm_fwd": lambda: ln.layer_norm_fwd(xd, 1024, wd, bd, 1e-5),
        "launcher layer_norm_bwd": lambda: ln.layer_norm_bwd(dy, xd, 1024, wd, mean, rstd),
        "C++ autograd: x.clone() fwd+bwd": fwd_bwd(lambda: x.clone(), (x,)),
        "Python autograd.Function clone fwd+bwd": fwd_bwd(lambda: _PyClone.apply(x), (x,)),
    }
    ops = {
        "layer_norm kernels": (lambda: ln._layer_norm_trifuse(x, (1024,), w, b, 1e-5), (x, w, b)),
        "layer_norm registered op": (lambda: torch.ops.trifuse.layer_norm(x, [1024], w, b, 1e-5)[0], (x, w, b)),
        "F.layer_norm": (lambda: F.layer_norm(x, (1024,), w, b), (x, w, b)),
        "residual stream": (lambda: trifuse.ops.layer_norm(x, (1024,), w, b, residual=r), (x, w, b, r)),
        "bias_gelu": (lambda: trifuse.ops.bias_gelu(x, b), (x, b)),
        "F.gelu(x + b)": (lambda: F.gelu(x + b), (x, b)),
        "dropout_add": (lambda: trifuse.ops.dropout_add(x, r, 0.1, bias=b), (x, r, b)),
        "r + F.dropout(x + b)": (lambda: r + F.dropout(x + b, 0.1), (x, r, b)),
        "attention": (lambda: trifuse.ops.attention(q, k, v, is_causal=True), (q, k, v)),
        "F.scaled_dot_product_attention": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v)),
        "rotary_embedding": (lambda: trifuse.ops.rotary_embedding(q, k, cos, sin), (q, k)),
        "HF apply_rotary_pos_emb": (lambda: rotary_embedding_ref(q, k, cos, sin), (q, k)),
        "cross_entropy": (lambda: trifuse.ops.cross_entropy(logits, target), (logits,)),
        "F.cross_entropy(float)": (lambda: F.cross_entropy(logits.float(), target), (logits,)),
        "linear_cross_entropy": (lambda: trifuse.ops.linear_cross_entropy(hid, head, target), (hid, head)),
        "F.linear -> F.cross_entropy": (lambda: F.cross_entropy(F.linear(hid, head).float(), target), (hid, head)),
    }
    for name, (fn, inputs) in ops.items():
        c[f"{name} fwd"] = fn
        c[f"{name} fwd+bwd"] = fwd_bwd(fn, inputs)
    return c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", nargs="*", default=["layer_norm kernels fwd+bwd", "dropout_add fwd+bwd"],
                    help="the cases to run under cProfile")
    args = ap.parse_args()
    steps = cases()
    rows = [{"provider": name, "host µs": per_call_us(fn)} for name, fn in steps.items()]
    default_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # does the backward wait on the GIL (another Python thread)?
    for name in ("Python autograd.Function clone fwd+bwd", "bias_gelu fwd+bwd", "layer_norm kernels fwd+bwd"):
        rows.append({"provider": f"{name}, GIL switch interval 1 µs", "host µs": per_call_us(steps[name])})
    sys.setswitchinterval(default_interval)
    # The backward of CUDA tensors runs on the autograd engine's device thread: what does handing
    # it over cost? (The 2026-11-27 H200 run: 151 µs for a C++ clone's fwd+bwd.)
    with torch.autograd.set_multithreading_enabled(False):
        for name in ("C++ autograd: x.clone() fwd+bwd", "Python autograd.Function clone fwd+bwd",
                     "F.layer_norm fwd+bwd", "layer_norm kernels fwd+bwd", "dropout_add fwd+bwd"):
            rows.append({"provider": f"{name}, backward on the calling thread", "host µs": per_call_us(steps[name])})
    H.print_table(rows, ("provider", "host µs"))
    H.write_results("host_profile", rows, ("provider", "host µs"))
    for name in args.profile:
        # On the calling thread, so that cProfile (which sees one thread) sees the backward too.
        prof = cProfile.Profile()
        step = steps[name]
        with torch.autograd.set_multithreading_enabled(False):
            prof.enable()
            for _ in range(300):
                step()
            prof.disable()
        torch.cuda.synchronize()
        print(f"=== cProfile: {name}, 300 calls, backward on the calling thread")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
