"""bias + dropout + residual add against PyTorch eager `r + F.dropout(x + b, p)` and torch.compile.

    python bench/bench_dropout_add.py            # full sweep on the GPU, writes bench/results/
    pytest bench/bench_dropout_add.py            # CPU: a tiny smoke in the interpreter

Bytes per step, M rows of N features, e bytes per element (activations and bias alike):
    fwd      read x, r, b; write y                3·M·N·e + N·e
    bwd      read dy; write dx, db                2·M·N·e + N·e
    fwd+bwd  the sum of the two                   5·M·N·e + 2·N·e
dresidual is dy itself (no bytes). What a provider keeps for its backward is not counted:
trifuse keeps an 8-byte seed and regenerates the mask; PyTorch eager writes and reads back a
one-byte-per-element mask.
Outputs differ between providers (each draws its own mask), so correctness is checked at p = 0
against PyTorch, and at p = P by the kept fraction (within 5 sigma of 1 - P).
Targets (DESIGN.md, issue 3; H100, bf16): fwd+bwd >= 2.3 TB/s and >= 2x PyTorch eager.

The gated form (a diffusion transformer block's end, `h + gate[:, None] * ff_out`), B samples of
S tokens, the gate one (B, N) row per sample, against PyTorch eager and torch.compile of the same
expression; "wan": Wan's fp32 gate and `(h.float() + ff_out.float() * gate).type_as(h)`:
    fwd      read x, h; write y                   3·M·N·e   (M = B·S; the gate's B·N not counted)
    bwd      read dy, x; write dx                 3·M·N·e   (dh is dy; dgate's partial rows small)
"gated per token": FLUX.3's and Qwen-Image 2.1's block end, the gate (B, S, N) per token:
    fwd      read x, h, gate; write y             4·M·N·e
    bwd      read dy, gate, x; write dx, dgate    5·M·N·e
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch
import torch.nn.functional as F

from trifuse.kernels import dropout_add as da_mod

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
WIDTHS = (768, 1024, 2048, 4096, 8192, 16384)
TARGET_SHAPES = ((16384, 1024), (8192, 4096), (4096, 8192))
ELEMENTS = 2**26  # rows x width for the width sweep: 128 MiB of bf16 per activation
P = 0.1


def make_inputs(shape):
    m, n = shape
    x = torch.randn(m, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    r = torch.randn(m, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    b = torch.randn(n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    return (x, r, b), (x, r, b)


def bytes_for(shape, mode):
    m, n = shape
    e = torch.finfo(DTYPE).bits // 8
    fwd = 3 * m * n * e + n * e
    bwd = 2 * m * n * e + n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def providers(p: float = P) -> dict:
    def torch_dropout_add(x, r, b):
        return r + F.dropout(x + b, p)

    def trifuse_dropout_add(x, r, b):
        # trifuse's kernels, always: without dropout trifuse.ops.dropout_add may choose PyTorch's
        # adds (its dialect); the op's checks as it runs them
        da_mod._check_inputs(x, r, p, b)
        return da_mod.DROPOUT_ADD.candidate("trifuse").fn(x, r, p, b, None)

    out = {"trifuse": trifuse_dropout_add, "torch": torch_dropout_add}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_dropout_add)
    return out


def check(shape) -> None:
    """Before timing: every provider equals PyTorch at p = 0, and trifuse keeps 1 - P of the
    elements at p = P (within 5 sigma)."""
    H.check_against_reference(providers(0.0), "torch", make_inputs, shape)
    m, n = shape
    ones = torch.ones(m, n, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        kept = (providers()["trifuse"](ones, torch.zeros_like(ones), torch.zeros(n, device=DEVICE, dtype=DTYPE)) != 0)
    fraction, sigma = kept.double().mean().item(), (P * (1 - P) / (m * n)) ** 0.5
    if abs(fraction - (1 - P)) > 5 * sigma:
        raise AssertionError(f"trifuse keeps {fraction:.5f} of the elements at p = {P}, shape {shape}")


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path and its registered op, beside the
    PyTorch eager sequence they replace, r + F.dropout(x + b, p)."""
    shape = (4, 1024)
    prov = providers()

    def registered(x, r, b):
        return torch.ops.trifuse.dropout_add(x, r, P, b)[0]

    cases = {}
    for mode in ("fwd", "fwd+bwd"):
        cases[f"trifuse eager path {mode}"] = H.make_step(prov["trifuse"], lambda: make_inputs(shape), mode)
        cases[f"trifuse registered op {mode}"] = H.make_step(registered, lambda: make_inputs(shape), mode)
        cases[f"torch r + F.dropout(x + b) {mode}"] = H.make_step(prov["torch"], lambda: make_inputs(shape), mode)
    return H.host_overhead_rows(cases)


# (B, S, N): Flux's and SD3's joint blocks at 1024 px (4096 image tokens), Flux's single block
# (image and text tokens), Wan 14B's 480p video latents
GATED_SHAPES = ((2, 4096, 3072), (1, 4608, 3072), (2, 4096, 1536), (1, 32760, 5120))


def make_gated_inputs(shape, gate_dtype=None, per_token=False):
    b, s, n = shape
    x = torch.randn(b, s, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    h = torch.randn(b, s, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    g = torch.randn(*((b, s, n) if per_token else (b, n)), device=DEVICE, dtype=gate_dtype or DTYPE,
                    requires_grad=True)
    return (x, h, g), (x, h, g)


def gated_bytes_for(shape, mode, per_token=False):
    e = torch.finfo(DTYPE).bits // 8
    elements = shape[0] * shape[1] * shape[2] * e
    fwd, bwd = (4, 5) if per_token else (3, 3)
    return {"fwd": fwd * elements, "bwd": bwd * elements, "fwd+bwd": (fwd + bwd) * elements}[mode]


def gated_providers(wan: bool = False, per_token: bool = False) -> dict:
    if per_token:
        def torch_gated(x, h, g):
            return h + g * x
    elif wan:
        def torch_gated(x, h, g):
            return (h.float() + x.float() * g[:, None]).type_as(h)
    else:
        def torch_gated(x, h, g):
            return h + g[:, None] * x

    def trifuse_gated(x, h, g):
        da_mod._check_inputs(x, h, 0.0, None)  # trifuse's kernels, always (as above)
        return da_mod.DROPOUT_ADD.candidate("trifuse").fn(x, h, 0.0, None, g if per_token else g[:, None])

    out = {"trifuse": trifuse_gated, "torch": torch_gated}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_gated)
    return out


COLUMNS = ("provider", "variant", "mode", "shape", "ms", "GB/s", "% copy", "graph ms", "graph GB/s",
           "x vs torch", "x vs torch.compile", "error", "graph error")


def main() -> None:
    args = H.cli(__doc__)
    overhead = host_overhead()
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("dropout_add", overhead, ("provider", "host µs"), suffix="host-overhead")
    parts = [TARGET_SHAPES] if args.quick else [TARGET_SHAPES, [(ELEMENTS // n, n) for n in WIDTHS]]
    rows = []
    for shapes in parts:
        for shape in shapes:
            check(shape)
        # reference="": the outputs differ by their masks; check() above did the checking.
        rows += H.sweep(providers(), shapes, make_inputs, bytes_for, reference="", variant=f"p={P}")
        H.write_results("dropout_add", rows, COLUMNS, plot_x="N")
    gated = []
    for variant, wan, per_token in (("gated", False, False), ("gated wan fp32 gate", True, False),
                                    ("gated per token", False, True)):
        gated += H.sweep(gated_providers(wan, per_token), GATED_SHAPES[:2] if args.quick else GATED_SHAPES,
                         lambda shape, wan=wan, t=per_token: make_gated_inputs(shape, torch.float32 if wan else None,
                                                                               t),
                         lambda shape, mode, t=per_token: gated_bytes_for(shape, mode, t), variant=variant)
        H.write_results("dropout_add", gated, COLUMNS, suffix="gated")
    H.print_table(rows + gated, COLUMNS)


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (64, 4096) if H.on_gpu() else (3, 100)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "torch"])
def test_dropout_add(benchmark, provider, mode):
    step = H.make_step(providers()[provider], lambda: make_inputs(SMOKE_SHAPE), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


@pytest.mark.parametrize("wan, per_token", [(False, False), (True, False), (False, True)],
                         ids=["gated", "wan", "per-token"])
@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "torch"])
def test_gated_dropout_add(benchmark, provider, mode, wan, per_token):
    shape = (2, 64, 3072) if H.on_gpu() else (2, 3, 40)
    step = H.make_step(gated_providers(wan, per_token)[provider],
                       lambda: make_gated_inputs(shape, torch.float32 if wan else None, per_token), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_gated_providers_agree():
    for wan, per_token in ((False, False), (True, False), (False, True)):
        H.check_against_reference(gated_providers(wan, per_token), "torch",
                                  lambda shape, wan=wan, t=per_token: make_gated_inputs(
                                      shape, torch.float32 if wan else None, t),
                                  (2, 5, 48))


def test_checks_pass():
    check(SMOKE_SHAPE if H.on_gpu() else (16, 256))


def test_host_overhead_runs():
    rows = host_overhead()
    assert all(r["host µs"] > 0 for r in rows)


if __name__ == "__main__":
    main()
