"""The adaptive norm of diffusion transformers: trifuse's `layer_norm_modulate` against the
unfused PyTorch `F.layer_norm(x) * (1 + scale[:, None]) + shift[:, None]` (and per token, below),
eager and under torch.compile.

    python bench/bench_adaptive_norm.py              # the sweep on the GPU, writes bench/results/
    pytest bench/bench_adaptive_norm.py              # CPU: a tiny smoke in the interpreter

Shapes (batch x tokens x width) as the models train: DiT-XL/2 at 256 px (32 x 256 x 1152),
PixArt-alpha at 512 px (16 x 1024 x 1152), SD3-medium at 512 px (8 x 1024 x 1536), Flux at 1024
px (1 x 4096 x 3072). The norm without its own affine (elementwise_affine=False, as those models
have it); scale and shift one (B, N) vector each, as the adaLN linear makes them. Bytes per step,
the activation's M = B x S rows of N features, e bytes an element (the (B, N) vectors counted):
    fwd      read x, scale, shift; write y                    2·M·N·e + 2·B·N·e
    bwd      read dy, x, scale; write dx, dscale, dshift      3·M·N·e + 3·B·N·e
    fwd+bwd  the sum of the two
Eager PyTorch moves the activation ~3x in the forward (the norm, the product, the sum) and more
in the backward; trifuse folds the modulation into the norm's affine per sample.

The "autocast, 3 readers" variant is a DiT block's norm1 as a GPU training step runs it: bf16
autocast, the 16-bit residual stream normalized in fp32 (CUDA's autocast), modulated in fp32, and
cast to bf16 by each of the attention's q, k and v projections (the three casts timed here, the
matmuls not); trifuse's op as `fuse` calls it there, writing bf16 y once for the three
(`out_dtype`, `readers=3`), their gradients summed in its backward. Bytes (the minimum): fwd read x,
write y, 2·M·N·e; bwd read three dy and x, write dx, 5·M·N·e.

The "gated residual" variant is a DiT block's norm2 with the attention's gated residual add
before it, `h = h + gate[:, None] * attn_out; norm2(h) * (1 + scale[:, None]) + shift[:, None]`,
returning y and the new residual stream h (trifuse's `gated_add_layer_norm_modulate`). Bytes (the
minimum): fwd read x and the residual, write s and y, 4·M·N·e; bwd read dy, ds, s and x, write dx
and dresidual, 6·M·N·e (the vectors counted as above).

The "per token" variant is FLUX.3's (and Qwen-Image 2.1's, Helios') modulation with a timestep per
token: scale and shift (B, S, N) chunks of one (B, S, 3N) projection, `(1 + scale) * norm(x) +
shift` (trifuse's row kernels: the chunks read in place, the 1 added as scale is read). Bytes (the
minimum): fwd read x, scale and shift, write y, 4·M·N·e; bwd read dy, x and scale, write dx,
dscale and dshift (dshift is dy itself in PyTorch's autograd and in trifuse's: not counted),
5·M·N·e.

The "gated per token" variant is Qwen-Image 2.1's image stream: the attention's output added back
through a per-token gate, then the per-token modulated norm, `h = h + gate * attn_out;
norm2(h) * (1 + scale) + shift`, gate, scale and shift chunks of one (B, S, 3N) projection,
returning y and h (trifuse's `gated_add_layer_norm_modulate`, the row kernels with the residual).
Bytes (the minimum): fwd read x, the residual, gate, scale and shift, write s and y, 7·M·N·e; bwd
read dy, ds, s, x, gate and scale, write dx, dresidual, dgate and dscale, 10·M·N·e.
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch
import torch.nn.functional as F

import trifuse

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
MODEL_SHAPES = ((32, 256, 1152), (16, 1024, 1152), (8, 1024, 1536), (1, 4096, 3072))
EPS = 1e-6


def make_inputs(shape):
    b, s, n = shape
    x = torch.randn(b, s, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    scale, shift = (torch.randn(b, n, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    return (x, scale, shift), (x, scale, shift)


def bytes_for(shape, mode):
    b, s, n = shape
    e = torch.finfo(DTYPE).bits // 8
    fwd = 2 * b * s * n * e + 2 * b * n * e
    bwd = 3 * b * s * n * e + 3 * b * n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def providers() -> dict:
    def torch_modulate(x, scale, shift):
        return F.layer_norm(x, x.shape[-1:], eps=EPS) * (1 + scale[:, None]) + shift[:, None]

    def trifuse_modulate(x, scale, shift):
        return trifuse.ops.layer_norm_modulate(x, x.shape[-1:], 1 + scale[:, None], shift[:, None], eps=EPS)

    out = {"trifuse": trifuse_modulate, "torch": torch_modulate}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_modulate)
    return out


AUTOCAST_DTYPE = torch.bfloat16
READERS = 3


def make_autocast_inputs(shape):
    b, s, n = shape
    x = torch.randn(b, s, n, device=DEVICE, dtype=AUTOCAST_DTYPE, requires_grad=True)
    scale, shift = (torch.randn(b, n, device=DEVICE, dtype=AUTOCAST_DTYPE, requires_grad=True)
                    for _ in range(2))
    return (x, scale, shift), (x, scale, shift)


def autocast_bytes_for(shape, mode):
    b, s, n = shape
    e = torch.finfo(AUTOCAST_DTYPE).bits // 8
    fwd, bwd = 2 * b * s * n * e, (READERS + 2) * b * s * n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def autocast_providers() -> dict:
    def torch_modulate(x, scale, shift):
        with torch.autocast(DEVICE, dtype=AUTOCAST_DTYPE):
            y = F.layer_norm(x, x.shape[-1:], eps=EPS) * (1 + scale[:, None]) + shift[:, None]
            return tuple(y.to(AUTOCAST_DTYPE) for _ in range(READERS))  # each projection's cast

    def trifuse_modulate(x, scale, shift):
        return trifuse.ops.layer_norm_modulate(x, x.shape[-1:], 1 + scale[:, None], shift[:, None], eps=EPS,
                                               out_dtype=AUTOCAST_DTYPE, readers=READERS)

    out = {"trifuse": trifuse_modulate, "torch": torch_modulate}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_modulate)
    return out


def make_gated_inputs(shape):
    b, s, n = shape
    x, residual = (torch.randn(b, s, n, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    gate, scale, shift = (torch.randn(b, n, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
    args = (x, residual, gate, scale, shift)
    return args, args


def gated_bytes_for(shape, mode):
    b, s, n = shape
    e = torch.finfo(DTYPE).bits // 8
    fwd = 4 * b * s * n * e + 3 * b * n * e
    bwd = 6 * b * s * n * e + 6 * b * n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def gated_providers() -> dict:
    def torch_gated(x, residual, gate, scale, shift):
        s = residual + gate[:, None] * x
        return F.layer_norm(s, s.shape[-1:], eps=EPS) * (1 + scale[:, None]) + shift[:, None], s

    def trifuse_gated(x, residual, gate, scale, shift):
        return trifuse.ops.gated_add_layer_norm_modulate(x, residual, gate[:, None], x.shape[-1:],
                                                         1 + scale[:, None], shift[:, None], eps=EPS)

    out = {"trifuse": trifuse_gated, "torch": torch_gated}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_gated)
    return out


def make_per_token_inputs(shape):
    b, s, n = shape
    x = torch.randn(b, s, n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    emb = torch.randn(b, s, 3 * n, device=DEVICE, dtype=DTYPE, requires_grad=True)
    return (x, emb), (x, emb)


def per_token_bytes_for(shape, mode):
    b, s, n = shape
    e = torch.finfo(DTYPE).bits // 8
    fwd, bwd = 4 * b * s * n * e, 5 * b * s * n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def per_token_providers() -> dict:
    def torch_per_token(x, emb):
        shift, scale, _ = emb.chunk(3, dim=-1)
        return (1 + scale) * F.layer_norm(x, x.shape[-1:], eps=EPS) + shift

    def trifuse_per_token(x, emb):
        shift, scale, _ = emb.chunk(3, dim=-1)
        return trifuse.ops.layer_norm_modulate(x, x.shape[-1:], scale, shift, eps=EPS, mul_offset=1.0)

    out = {"trifuse": trifuse_per_token, "torch": torch_per_token}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_per_token)
    return out


def make_gated_per_token_inputs(shape):
    (x, emb), _ = make_per_token_inputs(shape)
    residual = torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=True)
    return (x, residual, emb), (x, residual, emb)


def gated_per_token_bytes_for(shape, mode):
    b, s, n = shape
    e = torch.finfo(DTYPE).bits // 8
    fwd, bwd = 7 * b * s * n * e, 10 * b * s * n * e
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def gated_per_token_providers() -> dict:
    def torch_gated_per_token(x, residual, emb):
        shift, scale, gate = emb.chunk(3, dim=-1)
        h = residual + gate * x
        return (1 + scale) * F.layer_norm(h, h.shape[-1:], eps=EPS) + shift, h

    def trifuse_gated_per_token(x, residual, emb):
        shift, scale, gate = emb.chunk(3, dim=-1)
        return trifuse.ops.gated_add_layer_norm_modulate(x, residual, gate, x.shape[-1:], scale, shift, eps=EPS,
                                                         mul_offset=1.0)

    out = {"trifuse": trifuse_gated_per_token, "torch": torch_gated_per_token}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_gated_per_token)
    return out


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path beside PyTorch's three ops."""
    shape = (2, 4, 1024)
    cases = {}
    for mode in ("fwd", "fwd+bwd"):
        for name, fn in providers().items():
            if name != "torch.compile":
                cases[f"{name} {mode}"] = H.make_step(fn, lambda: make_inputs(shape), mode)
    return H.host_overhead_rows(cases)


COLUMNS = ("provider", "variant", "mode", "shape", "ms", "GB/s", "% copy", "graph ms", "graph GB/s",
           "x vs torch", "x vs torch.compile", "error", "graph error")


def main() -> None:
    H.cli(__doc__)
    overhead = host_overhead()
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("adaptive_norm", overhead, ("provider", "host µs"), suffix="host-overhead")
    rows = H.sweep(providers(), MODEL_SHAPES, make_inputs, bytes_for)
    rows += H.sweep(autocast_providers(), MODEL_SHAPES[:1], make_autocast_inputs, autocast_bytes_for,
                    variant=f"autocast, {READERS} readers")
    rows += H.sweep(gated_providers(), MODEL_SHAPES, make_gated_inputs, gated_bytes_for,
                    variant="gated residual")
    rows += H.sweep(per_token_providers(), MODEL_SHAPES, make_per_token_inputs, per_token_bytes_for,
                    variant="per token")
    rows += H.sweep(gated_per_token_providers(), MODEL_SHAPES, make_gated_per_token_inputs,
                    gated_per_token_bytes_for, variant="gated per token")
    H.write_results("adaptive_norm", rows, COLUMNS, plot_x="N")
    H.print_table(rows, COLUMNS)


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (4, 64, 1152) if H.on_gpu() else (2, 3, 40)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "torch"])
def test_adaptive_norm(benchmark, provider, mode):
    step = H.make_step(providers()[provider], lambda: make_inputs(SMOKE_SHAPE), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_matches_pytorch():
    H.check_against_reference(providers(), "torch", make_inputs, SMOKE_SHAPE)


@pytest.mark.parametrize("mode", H.MODES)
def test_under_autocast_for_three_readers(mode):
    H.check_against_reference(autocast_providers(), "torch", make_autocast_inputs, SMOKE_SHAPE)
    for fn in autocast_providers().values():
        H.make_step(fn, lambda: make_autocast_inputs(SMOKE_SHAPE), mode)()


@pytest.mark.parametrize("mode", H.MODES)
def test_gated_residual(mode):
    H.check_against_reference(gated_providers(), "torch", make_gated_inputs, SMOKE_SHAPE)
    for fn in gated_providers().values():
        H.make_step(fn, lambda: make_gated_inputs(SMOKE_SHAPE), mode)()


@pytest.mark.parametrize("mode", H.MODES)
def test_per_token(mode):
    H.check_against_reference(per_token_providers(), "torch", make_per_token_inputs, SMOKE_SHAPE)
    for fn in per_token_providers().values():
        H.make_step(fn, lambda: make_per_token_inputs(SMOKE_SHAPE), mode)()


@pytest.mark.parametrize("mode", H.MODES)
def test_gated_per_token(mode):
    H.check_against_reference(gated_per_token_providers(), "torch", make_gated_per_token_inputs, SMOKE_SHAPE)
    for fn in gated_per_token_providers().values():
        H.make_step(fn, lambda: make_gated_per_token_inputs(SMOKE_SHAPE), mode)()


def test_host_overhead_runs():
    rows = host_overhead()
    assert all(r["host µs"] > 0 for r in rows)


if __name__ == "__main__":
    main()
