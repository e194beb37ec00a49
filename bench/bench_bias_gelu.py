"""bias + GeLU (erf, tanh and quick forms) and bias + ReLU against PyTorch eager `F.gelu(x + b)`
(for the quick form, CLIP's QuickGELU as transformers writes it, `z * torch.sigmoid(1.702 * z)`;
for relu, `torch.relu(x + b)`) and torch.compile of it.

    python bench/bench_bias_gelu.py            # full sweep on the GPU, writes bench/results/
    pytest bench/bench_bias_gelu.py            # CPU: a tiny smoke in the interpreter

Bytes per step, M rows of N features, e bytes per element (activations and bias alike):
    fwd      read x, b; write y                   2·M·N·e + N·e
    bwd      read x, b, dy; write dx, db          3·M·N·e + 2·N·e
    fwd+bwd  the sum of the two                   5·M·N·e + 3·N·e
The backward reads what the forward saved: trifuse recomputes from x and b, PyTorch eager reads
its saved x + b; either way one M·N activation.
Targets (DESIGN.md, issue 3; H100, bf16): fwd+bwd >= 2.3 TB/s and >= 2x PyTorch eager.
With dropout on the output (variant "erf p=0.1", BART's activation dropout at (8192, 4096)): the
same bytes for trifuse, whose mask is a seed; eager's F.dropout makes its own pass each way and
saves a byte mask. Variant "relu p=0.1" is T5's `dropout(relu(wi(x)))` at the same shape (no bias
in T5; the bias here, as OPT's fc1 would add it, is the same pass). Before timing, every provider
equals PyTorch at p = 0 and trifuse keeps 1 - p of the elements.
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch
import torch.nn.functional as F

import trifuse
from trifuse.kernels import bias_gelu as bg_mod

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
WIDTHS = (768, 1024, 2048, 3072, 4096, 8192, 16384)
TARGET_SHAPES = ((16384, 1024), (8192, 4096), (4096, 8192))
ELEMENTS = 2**26  # rows x width for the width sweep: 128 MiB of bf16 per activation
FORMS = ("none", "tanh", "quick", "relu", "relu2")
VARIANT = {"none": "erf", "tanh": "tanh", "quick": "quick", "relu": "relu", "relu2": "relu2"}
P = 0.1  # the dropout variant's: BART's activation_dropout


def make_inputs(shape):
    m, n = shape
    x = torch.randn(m, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    b = torch.randn(n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    return (x, b), (x, b)


def bytes_for(shape, mode):
    m, n = shape
    e = torch.finfo(DTYPE).bits // 8
    fwd = 2 * m * n * e + n * e
    bwd = 3 * m * n * e + 2 * n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def providers(approximate: str, p: float = 0.0) -> dict:
    def torch_bias_gelu(x, b):
        z = x + b
        if approximate == "relu":
            y = torch.relu(z)
        elif approximate == "relu2":  # transformers' ReLUSquaredActivation
            y = torch.square(torch.relu(z))
        else:
            y = z * torch.sigmoid(1.702 * z) if approximate == "quick" else F.gelu(z, approximate=approximate)
        return F.dropout(y, p) if p else y

    def trifuse_bias_gelu(x, b):
        # trifuse's kernels, always: trifuse.ops.bias_gelu may choose F.gelu (its dialect)
        return bg_mod._bias_gelu_trifuse(x, b, approximate, p)

    def dialect_bias_gelu(x, b):
        return trifuse.ops.bias_gelu(x, b, approximate, p)

    out = {"trifuse": trifuse_bias_gelu, "trifuse.ops (dialect)": dialect_bias_gelu, "torch": torch_bias_gelu}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_bias_gelu)
    return out


def check_dropout(shape, approximate: str = "none") -> float:
    """Before timing a dropout variant: every provider equals PyTorch at p = 0; returns the
    fraction trifuse keeps at p = P, asserted within 5 sigma of 1 - P."""
    H.check_against_reference(providers(approximate), "torch", make_inputs, shape)
    m, n = shape
    x = torch.full((m, n), 4.0, device=DEVICE, dtype=DTYPE)  # act(4) > 0: only the mask zeroes
    with torch.no_grad():
        kept = (providers(approximate, P)["trifuse"](x, torch.zeros(n, device=DEVICE, dtype=DTYPE)) != 0)
    kept = kept.double().mean().item()
    sigma = (P * (1 - P) / (m * n)) ** 0.5
    assert abs(kept - (1 - P)) < 5 * sigma + 1e-12, f"trifuse keeps {kept:.4f}, not {1 - P}"
    return kept


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path and its registered op, beside the
    PyTorch eager sequence they replace, F.gelu(x + b)."""
    shape = (4, 1024)
    p = providers("none")

    def registered(x, b):
        return torch.ops.trifuse.bias_gelu(x, b, "none")

    cases = {}
    for mode in ("fwd", "fwd+bwd"):
        cases[f"trifuse eager path {mode}"] = H.make_step(p["trifuse"], lambda: make_inputs(shape), mode)
        cases[f"trifuse registered op {mode}"] = H.make_step(registered, lambda: make_inputs(shape), mode)
        cases[f"torch F.gelu(x + b) {mode}"] = H.make_step(p["torch"], lambda: make_inputs(shape), mode)
    return H.host_overhead_rows(cases)


COLUMNS = ("provider", "variant", "mode", "shape", "ms", "GB/s", "% copy", "graph ms", "graph GB/s",
           "x vs torch", "x vs torch.compile", "error", "graph error")


def main() -> None:
    args = H.cli(__doc__)
    overhead = host_overhead()
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("bias_gelu", overhead, ("provider", "host µs"), suffix="host-overhead")
    parts = [TARGET_SHAPES] if args.quick else [TARGET_SHAPES, [(ELEMENTS // n, n) for n in WIDTHS]]
    rows = []
    for shapes in parts:
        for approximate in FORMS:
            rows += H.sweep(providers(approximate), shapes, make_inputs, bytes_for,
                            variant=VARIANT[approximate])
            H.write_results("bias_gelu", rows, COLUMNS, plot_x="N")
    shape = (8192, 4096)
    for approximate in ("none", "relu"):
        check_dropout(shape, approximate)
        rows += H.sweep(providers(approximate, P), (shape,), make_inputs, bytes_for, reference="",
                        variant=f"{VARIANT[approximate]} p={P}")
    H.write_results("bias_gelu", rows, COLUMNS, plot_x="N")
    H.print_table(rows, COLUMNS)


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (64, 4096) if H.on_gpu() else (3, 100)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "torch"])
@pytest.mark.parametrize("approximate", FORMS)
def test_bias_gelu(benchmark, approximate, provider, mode):
    fn = providers(approximate)[provider]
    step = H.make_step(fn, lambda: make_inputs(SMOKE_SHAPE), mode)
    H.check_against_reference(providers(approximate), "torch", make_inputs, SMOKE_SHAPE)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "trifuse.ops (dialect)", "torch"])
@pytest.mark.parametrize("approximate", ["none", "relu"])
def test_bias_gelu_dropout(benchmark, approximate, provider, mode):
    check_dropout(SMOKE_SHAPE, approximate)
    step = H.make_step(providers(approximate, P)[provider], lambda: make_inputs(SMOKE_SHAPE), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_host_overhead_runs():
    rows = host_overhead()
    assert all(r["host µs"] > 0 for r in rows)


if __name__ == "__main__":
    main()
