"""The residual stream: trifuse's `dropout_add_layer_norm` against the unfused PyTorch sequence
`s = r + F.dropout(x + b, p); y = F.layer_norm(s)`, eager and under torch.compile.

    python bench/bench_residual_stream.py            # full sweep on the GPU, writes bench/results/
    pytest bench/bench_residual_stream.py            # CPU: a tiny smoke in the interpreter

Every provider returns (y, s) and gets gradients for both, as in a pre-norm block where s
carries on as the next residual. Bytes per step, M rows of N features, e bytes per element
(activations and the three vectors w, b, x_bias alike):
    fwd      read x, r, w, b, x_bias; write y, s                  4·M·N·e + 3·N·e
    bwd      read dy, ds, s, w; write dx, dr, dw, db, dx_bias     5·M·N·e + 4·N·e
    fwd+bwd  the sum of the two                                   9·M·N·e + 7·N·e
What a provider keeps besides s is not counted: trifuse keeps mean and rstd (8 bytes a row)
and an 8-byte seed, and regenerates the mask; PyTorch eager writes and reads back a
one-byte-per-element dropout mask (and the dropped x + b).
Outputs differ between providers at p > 0 (each draws its own mask), so correctness is checked
at p = 0 against PyTorch, and at p = P by the kept fraction of s - r (within 5 sigma of 1 - P).
Target (issue 3; H100, bf16): fwd+bwd >= 1.5x the best of PyTorch eager and torch.compile at
every width 768-16384.

The post-norm add (variant rms_norm_add: OLMo 2's `r + post_attention_layernorm(x)`) beside it:
trifuse's `layer_norm_add` against `r + F.rms_norm(x)`, eager and compiled. Bytes, the least any
provider must move (dresidual is dy itself, never written):
    fwd      read x, r, w; write y                                3·M·N·e + N·e
    bwd      read dy, x, w; write dx, dw                          3·M·N·e + 2·N·e
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch
import torch.nn.functional as F

from trifuse.kernels import layer_norm as ln_mod

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
WIDTHS = (768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 8192, 12288, 16384)
TARGET_SHAPES = ((16384, 1024), (8192, 4096), (4096, 8192))
ELEMENTS = 2**26  # rows x width for the width sweep: 128 MiB of bf16 per activation
P = 0.1
EPS = 1e-5


def make_inputs(shape):
    m, n = shape
    x, r = (torch.randn(m, n, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    w, b, xb = (torch.randn(n, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
    return (x, r, w, b, xb), (x, r, w, b, xb)


def bytes_for(shape, mode):
    m, n = shape
    e = torch.finfo(DTYPE).bits // 8
    fwd = 4 * m * n * e + 3 * n * e
    bwd = 5 * m * n * e + 4 * n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def providers(p: float = P) -> dict:
    def torch_stream(x, r, w, b, xb):
        s = r + F.dropout(x + xb, p)
        return F.layer_norm(s, s.shape[-1:], w, b, EPS), s

    def trifuse_stream(x, r, w, b, xb):
        # trifuse's kernel, always: without dropout trifuse.ops.dropout_add_layer_norm may choose
        # PyTorch's add and norm (its dialect)
        return ln_mod.DROPOUT_ADD_LAYER_NORM.candidate("trifuse").fn(x, r, x.shape[-1:], w, b, EPS, p, xb, None)

    out = {"trifuse": trifuse_stream, "torch": torch_stream}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_stream)
    return out


def make_post_inputs(shape):
    m, n = shape
    x, r = (torch.randn(m, n, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    w = torch.randn(n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    return (x, r, w), (x, r, w)


def post_bytes_for(shape, mode):
    m, n = shape
    e = torch.finfo(DTYPE).bits // 8
    fwd, bwd = 3 * m * n * e + n * e, 3 * m * n * e + 2 * n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def post_providers() -> dict:
    def torch_post(x, r, w):
        return r + F.rms_norm(x, x.shape[-1:], w, EPS)

    def trifuse_post(x, r, w):
        # trifuse's kernel, always (trifuse.ops.layer_norm_add's dialect may choose PyTorch's)
        return ln_mod.RMS_NORM_ADD.candidate("trifuse").fn(x, r, list(x.shape[-1:]), w, None, EPS)

    out = {"trifuse": trifuse_post, "torch": torch_post}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_post)
    return out


def check(shape) -> None:
    """Before timing: every provider equals PyTorch at p = 0, and trifuse keeps 1 - P of the
    dropped branch at p = P (within 5 sigma)."""
    H.check_against_reference(providers(0.0), "torch", make_inputs, shape)
    (x, r, w, b, xb), _ = make_inputs(shape)
    with torch.no_grad():
        _, s = providers()["trifuse"](torch.ones_like(x), r, w, b, torch.zeros_like(xb))
    kept = s != r
    fraction, sigma = kept.double().mean().item(), (P * (1 - P) / kept.numel()) ** 0.5
    if abs(fraction - (1 - P)) > 5 * sigma:
        raise AssertionError(f"trifuse keeps {fraction:.5f} of the elements at p = {P}, shape {shape}")


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path and its registered op, beside the
    PyTorch eager sequence they replace (add, dropout, add, layer_norm)."""
    shape = (4, 1024)
    prov = providers()

    def registered(x, r, w, b, xb):
        return torch.ops.trifuse.dropout_add_layer_norm(x, r, [x.shape[-1]], w, b, EPS, P, xb)[:2]

    cases = {}
    for mode in ("fwd", "fwd+bwd"):
        cases[f"trifuse eager path {mode}"] = H.make_step(prov["trifuse"], lambda: make_inputs(shape), mode)
        cases[f"trifuse registered op {mode}"] = H.make_step(registered, lambda: make_inputs(shape), mode)
        cases[f"torch LN(r + F.dropout(x + b)) {mode}"] = H.make_step(prov["torch"], lambda: make_inputs(shape), mode)
    return H.host_overhead_rows(cases)


COLUMNS = ("provider", "variant", "mode", "shape", "ms", "GB/s", "% copy", "graph ms", "graph GB/s",
           "x vs torch", "x vs torch.compile", "error", "graph error")


def main() -> None:
    args = H.cli(__doc__)
    overhead = host_overhead()
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("residual_stream", overhead, ("provider", "host µs"), suffix="host-overhead")
    for shape in TARGET_SHAPES:
        check(shape)
    # reference="": the outputs differ by their masks; check() did the checking.
    rows = H.sweep(providers(), TARGET_SHAPES, make_inputs, bytes_for, reference="", variant=f"p={P}")
    H.write_results("residual_stream", rows, COLUMNS, plot_x="N")
    rows += H.sweep(providers(0.0), TARGET_SHAPES, make_inputs, bytes_for, variant="p=0")
    rows += H.sweep(post_providers(), TARGET_SHAPES, make_post_inputs, post_bytes_for, variant="rms_norm_add")
    H.write_results("residual_stream", rows, COLUMNS, plot_x="N")
    if not args.quick:
        shapes = [(ELEMENTS // n, n) for n in WIDTHS]
        for shape in shapes:
            check(shape)
        rows += H.sweep(providers(), shapes, make_inputs, bytes_for, reference="", variant=f"p={P}")
        H.write_results("residual_stream", rows, COLUMNS, plot_x="N")
    H.print_table(rows, COLUMNS)


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (64, 4096) if H.on_gpu() else (3, 100)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "torch"])
def test_residual_stream(benchmark, provider, mode):
    step = H.make_step(providers()[provider], lambda: make_inputs(SMOKE_SHAPE), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "torch"])
def test_post_norm_add(benchmark, provider, mode):
    step = H.make_step(post_providers()[provider], lambda: make_post_inputs(SMOKE_SHAPE), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)
    H.check_against_reference(post_providers(), "torch", make_post_inputs, SMOKE_SHAPE)


def test_checks_pass():
    check(SMOKE_SHAPE if H.on_gpu() else (16, 256))


def test_host_overhead_runs():
    rows = host_overhead()
    assert all(r["host µs"] > 0 for r in rows)


if __name__ == "__main__":
    main()
