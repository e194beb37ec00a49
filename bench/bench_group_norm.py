"""GroupNorm + SiLU (and GroupNorm alone) against PyTorch eager `F.silu(F.group_norm(...))`,
torch.compile of it, and Liger-Kernel's LigerGroupNormFunction (no SiLU) when importable.

    python bench/bench_group_norm.py            # full sweep on the GPU, writes bench/results/
    pytest bench/bench_group_norm.py            # CPU: a tiny smoke in the interpreter

Bytes per step, x of numel elements, e bytes per element:
    fwd      read x; write y                    2·numel·e
    bwd      read dy, x; write dx               3·numel·e
    fwd+bwd  the sum of the two                 5·numel·e
The formula counts one pass over each tensor, the least any implementation needs. trifuse's
kernels take two over x in the forward (its statistics, then y) and two over dy and x in the
backward (the sums, then dx): 3 and 5 passes, which shows as GB/s below the copy bandwidth.
PyTorch eager moves more still with the SiLU (it writes the norm's output, reads it for the SiLU,
keeps it for the backward and reads it there). Peak memory per step shows what each keeps.

Providers: "trifuse" the registered op's kernels through the eager autograd.Function path, whatever
the dialect would choose; "trifuse.ops (dialect)" the public function (the measured winner of
trifuse and PyTorch for the shape); "torch" eager; "torch.compile"; "liger" (GroupNorm alone).
Shapes: Stable Diffusion 1.5's UNet at 512 x 512 (latents 64 x 64), batch 8, the widths of its
four levels, and its VAE decoder's widest norm at 512 x 512 (batch 1: few, 1M-value rows); 32
groups; bf16 on the GPU (the CPU smoke: 4 groups, tiny shapes). Variants: with the SiLU and
without, and with the SiLU on x laid out channels_last (a UNet converted with
`.to(memory_format=torch.channels_last)`, as diffusers advises): trifuse reads it where it lies
and writes y channels-last; PyTorch's CUDA GroupNorm copies x to contiguous and returns y
contiguous (the next conv then copies it back, not counted here).
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch

import trifuse
from trifuse.kernels import group_norm as gn

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
GROUPS = 32 if H.on_gpu() else 4  # few programs in the interpreter's smoke
SHAPES = ((8, 320, 64, 64), (8, 640, 32, 32), (8, 1280, 16, 16), (8, 1280, 8, 8), (1, 128, 512, 512))
ACTIVATIONS = ("silu", None)
VARIANTS = (("silu", False), (None, False), ("silu", True))  # (activation, channels_last)


def make_inputs(shape, channels_last=False):
    x = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    if channels_last:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    x.requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[1], device=DEVICE, dtype=DTYPE)).requires_grad_()
    b = (0.1 * torch.randn(shape[1], device=DEVICE, dtype=DTYPE)).requires_grad_()
    return (x, w, b), (x, w, b)


def bytes_for(shape, mode):
    numel = 1
    for s in shape:
        numel *= s
    e = torch.finfo(DTYPE).bits // 8
    fwd, bwd = 2 * numel * e, 3 * numel * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _liger():
    """Liger-Kernel's GroupNorm (no activation), or None."""
    module = H.try_import("liger_kernel.ops.group_norm")
    if module is None:
        return None
    # (N, C, H*W): Liger's backward takes the row width from dY's last dim before flattening, so a
    # 4-D input writes past dX (linkedin/Liger-Kernel#1375); its 3-D form is right (a view here)
    return lambda x, w, b: module.LigerGroupNormFunction.apply(x.flatten(2), w, b, x.shape[1], GROUPS,
                                                               1e-5).view_as(x)


def providers(activation: str | None) -> dict:
    def torch_norm(x, w, b):
        return gn.group_norm_ref(x, GROUPS, w, b, 1e-5, activation)

    def trifuse_kernels(x, w, b):
        return gn.GROUP_NORM.candidate("trifuse").fn(x, GROUPS, w, b, 1e-5, activation, None)

    def trifuse_dialect(x, w, b):
        return trifuse.ops.group_norm(x, GROUPS, w, b, 1e-5, activation)

    out = {"trifuse": trifuse_kernels, "trifuse.ops (dialect)": trifuse_dialect, "torch": torch_norm}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_norm)
        liger = _liger() if activation is None else None
        if liger is not None:
            out["liger"] = liger
    return out


def with_peak_memory(rows: list[dict], activation: str | None, channels_last: bool) -> list[dict]:
    fns = providers(activation)
    for row in rows:
        if "ms" not in row or row["mode"] == "bwd":
            continue
        shape = tuple(int(s) for s in row["shape"].split("x"))
        step = H.make_step(fns[row["provider"]], lambda shape=shape: make_inputs(shape, channels_last),
                           row["mode"])
        row["peak MiB"] = H.peak_memory_mib(step)
    return rows


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path and its registered op, beside the
    PyTorch eager sequence they replace, F.silu(F.group_norm(x, ...))."""
    shape = (2, 64, 4, 4) if H.on_gpu() else (1, 8, 2, 2)
    p = providers("silu")

    def registered(x, w, b):
        return torch.ops.trifuse.group_norm(x, GROUPS, w, b, 1e-5, "silu", None)[0]

    cases = {}
    for mode in ("fwd", "fwd+bwd"):
        cases[f"trifuse eager path {mode}"] = H.make_step(p["trifuse"], lambda: make_inputs(shape), mode)
        cases[f"trifuse.ops (dialect) {mode}"] = H.make_step(p["trifuse.ops (dialect)"],
                                                              lambda: make_inputs(shape), mode)
        cases[f"trifuse registered op {mode}"] = H.make_step(registered, lambda: make_inputs(shape), mode)
        cases[f"torch F.silu(F.group_norm(x)) {mode}"] = H.make_step(p["torch"], lambda: make_inputs(shape),
                                                                      mode)
    return H.host_overhead_rows(cases)


COLUMNS = ("provider", "variant", "mode", "shape", "ms", "GB/s", "% copy", "graph ms", "graph GB/s",
           "peak MiB", "x vs torch", "x vs torch.compile", "x vs liger", "error", "graph error")


def main() -> None:
    rows = []
    for activation, channels_last in VARIANTS:
        swept = H.sweep(providers(activation), SHAPES, lambda shape, cl=channels_last: make_inputs(shape, cl),
                        bytes_for, variant=str(activation) + (" channels_last" if channels_last else ""))
        rows += with_peak_memory(swept, activation, channels_last)
    overhead = host_overhead()
    H.print_table(rows, COLUMNS)
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("group_norm", rows, COLUMNS)
    H.write_results("group_norm", overhead, ("provider", "host µs"), suffix="host-overhead")


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (2, 320, 16, 16) if H.on_gpu() else (2, 8, 3, 3)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "trifuse.ops (dialect)", "torch"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: str(v[0]) + ("-channels_last" if v[1] else ""))
def test_group_norm(benchmark, variant, provider, mode):
    activation, channels_last = variant
    fn = providers(activation)[provider]
    step = H.make_step(fn, lambda: make_inputs(SMOKE_SHAPE, channels_last), mode)
    H.check_against_reference(providers(activation), "torch", lambda shape: make_inputs(shape, channels_last),
                              SMOKE_SHAPE)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_host_overhead_runs():
    rows = host_overhead()
    assert all(r["host µs"] > 0 for r in rows)


if __name__ == "__main__":
    main()
