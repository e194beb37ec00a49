"""xIELU (Apertus's MLP activation) against transformers' XIELUActivation formula in PyTorch eager
(what the model runs without the optional xielu CUDA package) and torch.compile of it.

    python bench/bench_xielu.py            # the sweep on the GPU, writes bench/results/
    pytest bench/bench_xielu.py            # CPU: a tiny smoke in the interpreter

Bytes per step, M tokens x N intermediate features, x in e bytes, y in o bytes (the model's
result: fp32 under autocast, where its fp32 coefficients promote bf16 x):
    fwd      read x; write y                  (e + o)·M·N
    bwd      read dy, x; write dx             (o + 2e)·M·N
The formula counts the fused kernels' traffic, the least any implementation needs; PyTorch eager
runs twelve kernels forward (and more backward), which shows as lower GB/s.
Shapes: Apertus-8B's MLP (intermediate 21504) at 4096 and 8192 tokens, and 70B's (43008) at 4096;
bf16 x, fp32 coefficients (as under autocast), y in fp32.
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch

import trifuse
from trifuse.kernels import xielu as xi

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
SHAPES = ((4096, 21504), (8192, 21504), (4096, 43008))


def make_inputs(shape):
    x = torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=True)
    ap = torch.tensor([0.8], device=DEVICE, requires_grad=True)  # fp32 master weights, softplus'd
    an = torch.tensor([0.8], device=DEVICE, requires_grad=True)
    beta, eps = torch.tensor(0.5, device=DEVICE), torch.tensor(-1e-6, device=DEVICE)
    return (x, ap, an, beta, eps), (x, ap, an)


def bytes_for(shape, mode):
    m, n = shape
    e, o = torch.finfo(DTYPE).bits // 8, 4
    fwd, bwd = (e + o) * m * n, (o + 2 * e) * m * n
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def providers() -> dict:
    def torch_xielu(x, ap, an, beta, eps):  # transformers' _xielu_python
        return xi.xielu_ref(x, ap, an, beta, eps)

    def trifuse_kernels(x, ap, an, beta, eps):
        return xi.XIELU.candidate("trifuse").fn(x, ap, an, beta, eps, torch.float32)

    def trifuse_dialect(x, ap, an, beta, eps):
        return trifuse.ops.xielu(x, ap, an, beta, eps, out_dtype=torch.float32)

    out = {"trifuse": trifuse_kernels, "trifuse.ops (dialect)": trifuse_dialect, "torch": torch_xielu}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_xielu)
    return out


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path and registered op beside the formula."""
    shape = (4, 1024)
    p = providers()

    def registered(x, ap, an, beta, eps):
        return torch.ops.trifuse.xielu(x, ap, an, beta, eps, torch.float32)

    cases = {}
    for mode in ("fwd", "fwd+bwd"):
        cases[f"trifuse eager path {mode}"] = H.make_step(p["trifuse"], lambda: make_inputs(shape), mode)
        cases[f"trifuse registered op {mode}"] = H.make_step(registered, lambda: make_inputs(shape), mode)
        cases[f"torch (transformers' formula) {mode}"] = H.make_step(p["torch"], lambda: make_inputs(shape), mode)
    return H.host_overhead_rows(cases)


COLUMNS = ("provider", "variant", "mode", "shape", "ms", "GB/s", "% copy", "graph ms", "graph GB/s",
           "x vs torch", "x vs torch.compile", "error", "graph error")


def main() -> None:
    rows = H.sweep(providers(), SHAPES, make_inputs, bytes_for, variant="bf16 -> fp32")
    overhead = host_overhead()
    H.print_table(rows, COLUMNS)
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("xielu", rows, COLUMNS, plot_x="N")
    H.write_results("xielu", overhead, ("provider", "host µs"), suffix="host-overhead")


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (64, 21504) if H.on_gpu() else (3, 100)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "trifuse.ops (dialect)", "torch"])
def test_xielu(benchmark, provider, mode):
    step = H.make_step(providers()[provider], lambda: make_inputs(SMOKE_SHAPE), mode)
    H.check_against_reference(providers(), "torch", make_inputs, SMOKE_SHAPE)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_host_overhead_runs():
    assert len(host_overhead()) == 6


if __name__ == "__main__":
    main()
