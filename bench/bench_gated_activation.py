"""Gated activation act(gate) * up (SwiGLU, GeGLU) against PyTorch eager `F.silu(gate) * up`,
torch.compile of it, and Liger-Kernel's LigerSiLUMulFunction / LigerGELUMulFunction when importable.

    python bench/bench_gated_activation.py            # full sweep on the GPU, writes bench/results/
    pytest bench/bench_gated_activation.py            # CPU: a tiny smoke in the interpreter

Bytes per step, M tokens x N intermediate features, e bytes per element:
    fwd      read gate, up; write y                        3·M·N·e
    bwd      read dy, gate, up; write dgate, dup           5·M·N·e
    fwd+bwd  the sum of the two                            8·M·N·e
The formula counts the fused kernels' traffic, the least any implementation needs; PyTorch eager
moves more (it writes act(gate) in the forward and reads it again in the backward), which shows as
lower GB/s. Peak memory per step (above what was allocated before it) shows what each saves for the
backward: trifuse and Liger save gate and up, eager also act(gate).

Providers: "trifuse" the registered op's kernels through the eager autograd.Function path, whatever
the dialect would choose; "trifuse.ops (dialect)" the public function (the measured winner of
trifuse and PyTorch for the shape); "torch" eager; "torch.compile"; "liger".
Liger's backward writes its gradients into the gate and up it saved (its inputs): the "bwd" mode,
which replays one graph's backward, then computes on overwritten values. Its time stands; its
values are checked in the forward only, as every provider's are here.
With dropout on the product (p = 0.1, variant "gelu_tanh p=0.1": T5 v1.1's, mT5's and Flan-T5's
`dropout(gelu_new(wi_0 x) * wi_1 x)`): the same bytes for trifuse, whose mask is a seed; eager's
F.dropout makes its own pass each way and saves a byte mask, torch.compile's its own. Before timing,
every provider equals PyTorch at p = 0 and trifuse keeps 1 - p of the elements.
Shapes: Llama-7B (intermediate 11008) and Llama-3-8B / Mistral-7B (14336) MLPs at 4096, 8192 and
16384 tokens for SwiGLU, 8192 x 14336 for the GeGLU forms and the squared ReLU (BitNet's
`relu2(gate) * up`); bf16 on the GPU.
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch
import torch.nn.functional as F

import trifuse
from trifuse.kernels import gated_activation as ga

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
TOKENS = (4096, 8192, 16384)
INTERMEDIATE = (11008, 14336)
TARGET_SHAPES = tuple((m, n) for n in INTERMEDIATE for m in TOKENS)
ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu2")
# SwiGLU at every target shape; the GeGLU forms (same traffic, more arithmetic) and BitNet's relu2
# at one, so that the sweep fits its stage of bench/gpu_session.sh.
SHAPES = {"silu": TARGET_SHAPES, "gelu_tanh": ((8192, 14336),), "gelu": ((8192, 14336),), "relu2": ((8192, 14336),)}
P = 0.1  # the dropout variant's: T5 v1.1's dropout_rate


def make_inputs(shape):
    m, n = shape
    gate = torch.randn(m, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    up = torch.randn(m, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    return (gate, up), (gate, up)


def bytes_for(shape, mode):
    m, n = shape
    e = torch.finfo(DTYPE).bits // 8
    fwd, bwd = 3 * m * n * e, 5 * m * n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _liger(activation: str):
    """Liger-Kernel's fused gated activation for `activation`, or None (not installed, or no such
    form: Liger's GEGLU computes the tanh form only)."""
    module = H.try_import("liger_kernel.ops.swiglu") if activation == "silu" else H.try_import("liger_kernel.ops.geglu")
    if module is None:
        return None
    if activation == "silu":
        return lambda gate, up: module.LigerSiLUMulFunction.apply(gate, up)
    if activation == "gelu_tanh":
        return lambda gate, up: module.LigerGELUMulFunction.apply(gate, up)
    return None


def providers(activation: str, p: float = 0.0) -> dict:
    def torch_gated(gate, up):
        y = ga.gated_activation_ref(gate, up, activation)
        return F.dropout(y, p) if p else y

    def trifuse_kernels(gate, up):
        return ga.GATED_ACTIVATION.candidate("trifuse").fn(gate, up, activation, p)

    def trifuse_dialect(gate, up):
        return trifuse.ops.gated_activation(gate, up, activation, p)

    out = {"trifuse": trifuse_kernels, "trifuse.ops (dialect)": trifuse_dialect, "torch": torch_gated}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_gated)
        liger = _liger(activation)
        if liger is not None and not p:  # Liger's has no dropout
            out["liger"] = liger
    return out


def check_dropout(activation: str, shape) -> float:
    """Before timing the dropout variant: every provider equals PyTorch at p = 0; returns the
    fraction trifuse keeps at p = P (the sweep asserts it within 5 sigma of 1 - P)."""
    H.check_against_reference(providers(activation), "torch", make_inputs, shape)
    ones = torch.ones(shape, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        kept = (providers(activation, P)["trifuse"](ones, ones) != 0).double().mean().item()
    sigma = (P * (1 - P) / ones.numel()) ** 0.5
    assert abs(kept - (1 - P)) < 5 * sigma + 1e-12, f"trifuse keeps {kept:.4f}, not {1 - P}"
    return kept


def with_peak_memory(rows: list[dict], activation: str, p: float = 0.0) -> list[dict]:
    """Adds each timed fwd and fwd+bwd row's peak memory (MiB) for one step. What a forward keeps
    for its backward is `saved_mib`'s (fwd steps run without grad)."""
    fns = providers(activation, p)
    for row in rows:
        if "ms" not in row or row["mode"] == "bwd":
            continue
        shape = tuple(int(s) for s in row["shape"].split("x"))
        step = H.make_step(fns[row["provider"]], lambda shape=shape: make_inputs(shape), row["mode"])
        row["peak MiB"] = H.peak_memory_mib(step)
    return rows


def saved_mib(activation: str, shape=(4096, 11008), p: float = 0.0) -> list[dict]:
    """MiB that one forward keeps alive for its backward, per provider (the memory plan)."""
    rows = []
    for name, fn in providers(activation, p).items():
        (gate, up), _ = make_inputs(shape)
        if H.on_gpu():
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        y = fn(gate, up)
        if H.on_gpu():
            torch.cuda.synchronize()
            kept = (torch.cuda.memory_allocated() - before - y.numel() * y.element_size()) / 2**20
        else:
            kept = float("nan")
        rows.append({"provider": name, "variant": activation + (f" p={p}" if p else ""), "shape": "x".join(map(str, shape)),
                     "saved MiB": kept})
        del y
    return rows


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path and its registered op, beside the
    PyTorch eager sequence they replace, F.silu(gate) * up."""
    shape = (4, 1024)
    p = providers("silu")

    def registered(gate, up):
        return torch.ops.trifuse.gated_activation(gate, up, "silu")

    cases = {}
    for mode in ("fwd", "fwd+bwd"):
        cases[f"trifuse eager path {mode}"] = H.make_step(p["trifuse"], lambda: make_inputs(shape), mode)
        cases[f"trifuse.ops (dialect) {mode}"] = H.make_step(p["trifuse.ops (dialect)"], lambda: make_inputs(shape),
                                                              mode)
        cases[f"trifuse registered op {mode}"] = H.make_step(registered, lambda: make_inputs(shape), mode)
        cases[f"torch F.silu(gate) * up {mode}"] = H.make_step(p["torch"], lambda: make_inputs(shape), mode)
        if "liger" in p:
            cases[f"liger LigerSiLUMulFunction {mode}"] = H.make_step(p["liger"], lambda: make_inputs(shape), mode)
    return H.host_overhead_rows(cases)


COLUMNS = ("provider", "variant", "mode", "shape", "ms", "GB/s", "% copy", "graph ms", "graph GB/s",
           "peak MiB", "x vs torch", "x vs torch.compile", "x vs liger", "error", "graph error")


def main() -> None:
    rows, saved = [], []
    for activation in ACTIVATIONS:
        swept = H.sweep(providers(activation), SHAPES[activation], make_inputs, bytes_for, variant=activation)
        rows += with_peak_memory(swept, activation)
        saved += saved_mib(activation)
    shape = SHAPES["gelu_tanh"][0]
    check_dropout("gelu_tanh", shape)
    swept = H.sweep(providers("gelu_tanh", P), (shape,), make_inputs, bytes_for, reference="",
                    variant=f"gelu_tanh p={P}")
    rows += with_peak_memory(swept, "gelu_tanh", P)
    saved += saved_mib("gelu_tanh", p=P)
    overhead = host_overhead()
    H.print_table(rows, COLUMNS)
    H.print_table(saved, ("provider", "variant", "shape", "saved MiB"))
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("gated_activation", rows, COLUMNS, plot_x="N")
    H.write_results("gated_activation", saved, ("provider", "variant", "shape", "saved MiB"), suffix="saved")
    H.write_results("gated_activation", overhead, ("provider", "host µs"), suffix="host-overhead")


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (64, 11008) if H.on_gpu() else (3, 100)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "trifuse.ops (dialect)", "torch"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_activation(benchmark, activation, provider, mode):
    fn = providers(activation)[provider]
    step = H.make_step(fn, lambda: make_inputs(SMOKE_SHAPE), mode)
    H.check_against_reference(providers(activation), "torch", make_inputs, SMOKE_SHAPE)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "trifuse.ops (dialect)", "torch"])
def test_gated_activation_dropout(benchmark, provider, mode):
    check_dropout("gelu_tanh", SMOKE_SHAPE)
    step = H.make_step(providers("gelu_tanh", P)[provider], lambda: make_inputs(SMOKE_SHAPE), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_saved_memory_rows_run():
    assert len(saved_mib("silu", SMOKE_SHAPE)) >= 3


def test_host_overhead_runs():
    rows = host_overhead()
    assert all(r["host µs"] > 0 for r in rows)


if __name__ == "__main__":
    main()
