"""A CPU proxy for the host overhead of trifuse's cross-entropy ops: what a GPU-less session can
measure. Kernel launches are stubbed (CachedKernel.run does nothing), so what is timed is the
Python and the eager torch ops around them; the torch ops are counted with a TorchDispatchMode.

    python bench/host_cross_entropy_cpu.py [--vocab V] [--cpu-target-check]

The CPU-only target range check (a host sync CUDA tensors never pay) is left out unless asked
for, so the counts are those of the CUDA path. Numbers are only comparable on one machine; the
GPU's own host time is bench/profile_host.py's.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before trifuse: the Triton launch path is taken

import argparse  # noqa: E402
from collections import Counter  # noqa: E402

import _harness as H  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import trifuse  # noqa: E402
from trifuse.kernels import _launch  # noqa: E402
from trifuse.kernels import cross_entropy as ce  # noqa: E402

launches = Counter()


def _stub_run(self, grid, args, kwargs):
    launches[self.fn.__name__] += 1


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--cpu-target-check", action="store_true")
    args = parser.parse_args()
    _launch.CachedKernel.run = _stub_run
    if not args.cpu_target_check:
        ce._check_target_range = lambda *a: None
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokens, hidden, vocab = 64, 32, args.vocab
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,))
    logits = torch.randn(tokens, vocab, requires_grad=True)

    def lce_fwd():
        return trifuse.ops.linear_cross_entropy(h, w, t)

    def lce_fwd_bwd():
        torch.autograd.grad(trifuse.ops.linear_cross_entropy(h, w, t), (h, w))

    def lce_nograd():
        with torch.no_grad():
            return trifuse.ops.linear_cross_entropy(h, w, t)

    def torch_fwd_bwd():
        torch.autograd.grad(F.cross_entropy(F.linear(h, w), t), (h, w))

    def ce_fwd_bwd():
        torch.autograd.grad(trifuse.ops.cross_entropy(logits, t), (logits,))

    def torch_ce_fwd_bwd():
        torch.autograd.grad(F.cross_entropy(logits, t), (logits,))

    cases = {"lce fwd": lce_fwd, "lce fwd+bwd": lce_fwd_bwd, "lce no_grad": lce_nograd,
             "torch linear+ce fwd+bwd": torch_fwd_bwd,
             "ce fwd+bwd": ce_fwd_bwd, "torch ce fwd+bwd": torch_ce_fwd_bwd}
    # A dispatch mode turns the eager fast path off; count the ops of the path users take.
    fast = ce.eager_fast_path
    ce.eager_fast_path = lambda *ts: True
    counts = {}
    for name, fn in cases.items():
        launches.clear()
        with _CountOps() as mode:
            fn()
        counts[name] = (sum(mode.ops.values()), dict(mode.ops), dict(launches))
    ce.eager_fast_path = fast
    for name, fn in cases.items():
        n, ops, kernels = counts[name]
        print(f"{name:26s} {H.best_us_per_call(fn, runs=5):7.1f} us  {n:3d} torch ops  launches {kernels}")
        print(f"{'':26s} {ops}")


if __name__ == "__main__":
    main()
