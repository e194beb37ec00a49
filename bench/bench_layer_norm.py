"""LayerNorm (and the pre-norm residual form) against PyTorch eager, torch.compile and Liger.

    python bench/bench_layer_norm.py            # full sweep on the GPU, writes bench/results/
    pytest bench/bench_layer_norm.py            # CPU: a tiny smoke in the interpreter

Bytes per step, M rows of N features, e bytes per activation, ew per weight:
    fwd      read x, w, b; write y                    2·M·N·e + 2·N·ew
    bwd      read x, dy, w; write dx, dw, db          3·M·N·e + 3·N·ew
    fwd+bwd  the sum of the two                        5·M·N·e + 5·N·ew
The residual form (s = x + r, y = LN(s)) adds r read and s written to the forward, and ds
read and dr written to the backward.
The statistics (mean, rstd: 8 bytes a row) are left out: not every provider saves them.
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch
import torch.nn.functional as F

import trifuse
from trifuse.kernels import layer_norm as ln_mod

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
WIDTHS = (768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 8192, 12288, 16384)
TARGET_SHAPES = ((16384, 1024), (8192, 4096), (4096, 8192))
ELEMENTS = 2**26  # rows x width for the width sweep: 128 MiB of bf16 per activation


def make_inputs(shape, residual: bool = False):
    m, n = shape
    x = torch.randn(m, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    w = torch.randn(n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    b = torch.randn(n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    if residual:
        r = torch.randn(m, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
        return (x, r, w, b), (x, r, w, b)
    return (x, w, b), (x, w, b)


def bytes_for(shape, mode, residual: bool = False):
    m, n = shape
    e = torch.finfo(DTYPE).bits // 8
    fwd = (2 + 2 * residual) * m * n * e + 2 * n * e  # + r read, s written
    bwd = (3 + 2 * residual) * m * n * e + 3 * n * e  # + ds read, dr written (s saved, read as x)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def providers(residual: bool = False) -> dict:
    if residual:
        def torch_ln(x, r, w, b):
            s = x + r
            return F.layer_norm(s, s.shape[-1:], w, b), s

        def trifuse_ln(x, r, w, b):
            # trifuse's kernel, always: trifuse.ops.layer_norm(residual=) may choose PyTorch's add
            # and F.layer_norm (the dropout_add_layer_norm dialect)
            return ln_mod.DROPOUT_ADD_LAYER_NORM.candidate("trifuse").fn(x, r, x.shape[-1:], w, b, 1e-5, 0.0, None,
                                                                         None)
    else:
        def torch_ln(x, w, b):
            return F.layer_norm(x, x.shape[-1:], w, b)

        def trifuse_ln(x, w, b):
            # trifuse's kernels, always: trifuse.ops.layer_norm may choose F.layer_norm (its dialect)
            return ln_mod._layer_norm_trifuse(x, x.shape[-1:], w, b, 1e-5)

        def dialect_ln(x, w, b):
            return trifuse.ops.layer_norm(x, x.shape[-1:], w, b)
    out = {"trifuse": trifuse_ln, "torch": torch_ln}
    if not residual:
        out["trifuse.ops (dialect)"] = dialect_ln
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_ln)
        liger = H.try_import("liger_kernel.transformers.functional")
        if liger is not None and not residual:
            out["liger"] = lambda x, w, b: liger.liger_layer_norm(x, w, b, 1e-5)
        apex = H.try_import("apex.normalization.fused_layer_norm")  # a CUDA extension: rarely there
        if apex is not None and not residual:
            out["apex"] = lambda x, w, b: apex.fused_layer_norm_affine(x, w, b, x.shape[-1:], 1e-5)
        flash_ln = H.try_import("flash_attn.ops.triton.layer_norm")
        if flash_ln is not None:
            if residual:
                out["flash-attn"] = lambda x, r, w, b: flash_ln.layer_norm_fn(x, w, b, residual=r, eps=1e-5,
                                                                             prenorm=True)
            else:
                out["flash-attn"] = lambda x, w, b: flash_ln.layer_norm_fn(x, w, b, eps=1e-5)
    return out


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path and its registered op, beside
    PyTorch eager's F.layer_norm and F.layer_norm(x + r)."""
    shape = (4, 1024)
    plain, res = providers(False), providers(True)

    def registered(x, w, b):
        return torch.ops.trifuse.layer_norm(x, [x.shape[-1]], w, b, 1e-5)[0]

    def registered_res(x, r, w, b):
        return torch.ops.trifuse.dropout_add_layer_norm(x, r, [x.shape[-1]], w, b, 1e-5, 0.0, None)[:2]

    cases = {}
    for mode in ("fwd", "fwd+bwd"):
        cases[f"trifuse eager path {mode}"] = H.make_step(plain["trifuse"], lambda: make_inputs(shape), mode)
        cases[f"trifuse.ops.layer_norm (dialect) {mode}"] = H.make_step(
            plain["trifuse.ops (dialect)"], lambda: make_inputs(shape), mode)
        cases[f"trifuse registered op {mode}"] = H.make_step(registered, lambda: make_inputs(shape), mode)
        cases[f"torch F.layer_norm {mode}"] = H.make_step(plain["torch"], lambda: make_inputs(shape), mode)
        cases[f"trifuse residual eager path {mode}"] = H.make_step(res["trifuse"], lambda: make_inputs(shape, True), mode)
        cases[f"trifuse residual registered op {mode}"] = H.make_step(registered_res, lambda: make_inputs(shape, True), mode)
        cases[f"torch F.layer_norm(x + r) {mode}"] = H.make_step(res["torch"], lambda: make_inputs(shape, True), mode)
    return H.host_overhead_rows(cases)


COLUMNS = ("provider", "variant", "mode", "shape", "ms", "GB/s", "% copy", "graph ms", "graph GB/s",
           "x vs torch", "x vs torch.compile", "x vs liger", "error", "graph error")


def main() -> None:
    args = H.cli(__doc__)
    overhead = host_overhead()
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("layer_norm", overhead, ("provider", "host µs"), suffix="host-overhead")
    rows = H.sweep(providers(), TARGET_SHAPES, make_inputs, bytes_for, variant="LN(x)")
    rows += H.sweep(providers(True), TARGET_SHAPES, lambda s: make_inputs(s, True),
                    lambda s, mode: bytes_for(s, mode, True), variant="LN(x+r), s")
    H.write_results("layer_norm", rows, COLUMNS, plot_x="N")
    if not args.quick:
        rows += H.sweep(providers(), [(ELEMENTS // n, n) for n in WIDTHS], make_inputs, bytes_for, variant="LN(x)")
        H.write_results("layer_norm", rows, COLUMNS, plot_x="N")
    H.print_table(rows, COLUMNS)


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (64, 4096) if H.on_gpu() else (3, 100)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "torch"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_layer_norm(benchmark, provider, mode, residual):
    fn = providers(residual)[provider]
    step = H.make_step(fn, lambda: make_inputs(SMOKE_SHAPE, residual), mode)
    H.check_against_reference(providers(residual), "torch", lambda s: make_inputs(s, residual), SMOKE_SHAPE)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_host_overhead_runs():
    rows = host_overhead()
    assert all(r["host µs"] > 0 for r in rows)


if __name__ == "__main__":
    main()
