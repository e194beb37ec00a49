"""LayerNorm and RMSNorm over a channels-first map's channels: trifuse's kernels reading the map
where it lies, against what ran before they existed (the row kernels on a channels-last copy, y
copied back), PyTorch eager as models write it and torch.compile of that.

    python bench/bench_channel_norm.py            # full sweep on the GPU, writes bench/results/
    pytest bench/bench_channel_norm.py            # CPU: a tiny smoke in the interpreter

Bytes per step, x of numel elements, e bytes per element (one pass over each tensor, the least):
    fwd      read x; write y                    2·numel·e
    bwd      read dy, x; write dx               3·numel·e
    fwd+bwd  the sum of the two                 5·numel·e
trifuse's kernels make exactly those passes where a tile holds every channel (up to 512 at 16
positions a tile); wider, they re-read x (and dy) from L2 for each pass over the channels. The
row path adds a copy of x and one of y forward, of dy and dx backward (4 more passes); eager
PyTorch's written-out norm makes several more and keeps its intermediates for the backward.

Providers: "trifuse" the channel kernels through the eager autograd.Function path, whatever the
dialect would choose; "trifuse rows" the row kernels on the copy (the dialect's "rows" candidate);
"trifuse.ops (dialect)" the public function (the measured winner); "torch" the norm written out
as models write it (timm's LayerNorm2d and RmsNorm2d over dim 1, Wan's VAE norm
`F.normalize(x, dim=1) * C ** 0.5 * gamma`); "torch.compile" of that. Shapes: Wan 2.1's VAE
decoder at 480p (its 96, 192 and 384 channel levels, 5-D video maps of a few frames), SD 3's VAE
widths as timm-style LayerNorm2d, and ConvNeXt's downsampling norms (1024 channels); bf16 on the
GPU (the CPU smoke: tiny shapes).
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch
import torch.nn.functional as F

import trifuse
from trifuse.kernels import channel_norm as cn

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
# (kind, shape): Wan's VAE norm (F.normalize, floored RMSNorm) on video maps; LayerNorm2d; RmsNorm2d
SHAPES = {
    "l2_floored": ((1, 96, 4, 240, 416), (1, 192, 4, 120, 208), (1, 384, 4, 60, 104)),
    "layer": ((4, 128, 256, 256), (4, 512, 64, 64), (16, 1024, 14, 14)),
    "rms": ((4, 256, 128, 128), (8, 768, 24, 24)),
}


def make_inputs(shape, kind):
    x = torch.randn(shape, device=DEVICE, dtype=DTYPE).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[1], device=DEVICE, dtype=DTYPE)).requires_grad_()
    if kind != "layer":  # (no bias)
        return (x, w), (x, w)
    b = (0.1 * torch.randn(shape[1], device=DEVICE, dtype=DTYPE)).requires_grad_()
    return (x, w, b), (x, w, b)


def bytes_for(shape, mode):
    numel = 1
    for s in shape:
        numel *= s
    e = torch.finfo(DTYPE).bits // 8
    fwd, bwd = 2 * numel * e, 3 * numel * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _along(p, x):
    return p.view(-1, *(1,) * (x.dim() - 2))


def written_out(kind: str):
    """The norm as models write it (what `fuse` finds), x's channels at dim 1."""
    def layer(x, w, b=None):  # timm's LayerNorm2d written out (ConvNeXt's original, ViTDet's)
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        return (x - u) * torch.rsqrt(s + 1e-6) * _along(w, x) + _along(b, x)

    def rms(x, w, b=None):  # timm's RmsNorm2d
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * _along(w, x)

    def l2_floored(x, w, b=None):  # Wan's VAE norm (WanRMS_norm), its bias the number 0
        return F.normalize(x, dim=1) * x.shape[1] ** 0.5 * _along(w, x) + 0.0
    return {"layer": layer, "rms": rms, "l2_floored": l2_floored}[kind]


def _args(kind, x, w, b):
    """The channel op's arguments for the kind (F.normalize's RMSNorm: the scale folded in)."""
    if kind == "layer":
        return x, 1, w, b, 1e-6, False, False
    if kind == "rms":
        return x, 1, w, None, 1e-6, True, False
    return x, 1, w, None, 1e-12 * x.shape[1] ** -0.5, True, True


def providers(kind: str) -> dict:
    def trifuse_kernels(x, w, b=None):
        return cn.CHANNEL_NORM.candidate("trifuse").fn(*_args(kind, x, w, b))

    def trifuse_rows(x, w, b=None):
        return cn.CHANNEL_NORM.candidate("rows").fn(*_args(kind, x, w, b))

    def trifuse_dialect(x, w, b=None):
        x, dim, w, b, eps, rms, clamp = _args(kind, x, w, b)
        return trifuse.ops.channel_norm(x, w, b, eps, dim=dim, rms=rms, clamp_eps=clamp)

    torch_norm = written_out(kind)
    out = {"trifuse": trifuse_kernels, "trifuse rows": trifuse_rows, "trifuse.ops (dialect)": trifuse_dialect,
           "torch": torch_norm}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_norm)
    return out


def with_peak_memory(rows: list[dict], kind: str) -> list[dict]:
    fns = providers(kind)
    for row in rows:
        if "ms" not in row or row["mode"] == "bwd":
            continue
        shape = tuple(int(s) for s in row["shape"].split("x"))
        step = H.make_step(fns[row["provider"]], lambda shape=shape: make_inputs(shape, kind), row["mode"])
        row["peak MiB"] = H.peak_memory_mib(step)
    return rows


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path, its registered op and the row path,
    beside the PyTorch eager sequence they replace."""
    shape = (2, 64, 4, 4) if H.on_gpu() else (1, 8, 2, 2)
    p = providers("layer")

    def registered(x, w, b):
        return torch.ops.trifuse.channel_norm(*_args("layer", x, w, b))[0]

    cases = {}
    for mode in ("fwd", "fwd+bwd"):
        for name in ("trifuse", "trifuse rows", "trifuse.ops (dialect)", "torch"):
            cases[f"{name} {mode}"] = H.make_step(p[name], lambda: make_inputs(shape, "layer"), mode)
        cases[f"trifuse registered op {mode}"] = H.make_step(registered, lambda: make_inputs(shape, "layer"),
                                                             mode)
    return H.host_overhead_rows(cases)


COLUMNS = ("provider", "variant", "mode", "shape", "ms", "GB/s", "% copy", "graph ms", "graph GB/s",
           "peak MiB", "x vs torch", "x vs torch.compile", "error", "graph error")


def main() -> None:
    rows = []
    for kind, shapes in SHAPES.items():
        swept = H.sweep(providers(kind), shapes, lambda shape, k=kind: make_inputs(shape, k), bytes_for,
                        variant=kind)
        rows += with_peak_memory(swept, kind)
    overhead = host_overhead()
    H.print_table(rows, COLUMNS)
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("channel_norm", rows, COLUMNS)
    H.write_results("channel_norm", overhead, ("provider", "host µs"), suffix="host-overhead")


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (2, 96, 16, 16) if H.on_gpu() else (2, 6, 3, 3)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "trifuse rows", "trifuse.ops (dialect)", "torch"])
@pytest.mark.parametrize("kind", list(SHAPES))
def test_channel_norm(benchmark, kind, provider, mode):
    fn = providers(kind)[provider]
    step = H.make_step(fn, lambda: make_inputs(SMOKE_SHAPE, kind), mode)
    H.check_against_reference(providers(kind), "torch", lambda shape: make_inputs(shape, kind), SMOKE_SHAPE)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_host_overhead_runs():
    rows = host_overhead()
    assert all(r["host µs"] > 0 for r in rows)


if __name__ == "__main__":
    main()
