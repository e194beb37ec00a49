"""Rotary position embedding of q and k (rotate-half, Hugging Face's apply_rotary_pos_emb) against
PyTorch eager (HF's formula), torch.compile of it and, when importable, Liger-Kernel's
`liger_rotary_pos_emb`; and the complex product with the model's casts (Llama 4, torchtitan)
against what fuse replaces it with (`rotary-complex` results).

    python bench/bench_rotary.py            # full sweep on the GPU, writes bench/results/
    pytest bench/bench_rotary.py            # CPU: a tiny smoke in the interpreter

Shapes: Llama-7B/8B attention, B 1-8, S 2048 / 4096, Hq 32, Hkv 8 (GQA) or 32, D 128; q and k
as the model makes them (a projection viewed (B, S, H, D) and transposed), cos and sin
(1, 1, S, D) as after HF's unsqueeze (Liger takes them before it).

Bytes per step, e bytes per element, Nq = B·Hq·S·D, Nk = B·Hkv·S·D, Nc = S·D (one table):
    fwd      read q, k, cos, sin; write q_embed, k_embed        2·(Nq + Nk)·e + 2·Nc·e
    bwd      read dq_embed, dk_embed, cos, sin; write dq, dk     2·(Nq + Nk)·e + 2·Nc·e
    fwd+bwd  the sum of the two
The least any implementation must move; PyTorch eager moves several times that (about ten
elementwise kernels per tensor each way), and what it saves for the backward is not counted.
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch

import trifuse
from trifuse.kernels import rotary as rk

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
HQ, D = 32, 128
SHAPES = tuple((b, HQ, hkv, s, D) for hkv in (8, 32) for s in (2048, 4096) for b in (1, 2, 4, 8))


def _tables(s, d):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device=DEVICE, dtype=torch.float32) / d)
    freqs = torch.arange(s, device=DEVICE, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None, None]  # (1, 1, S, D)
    return emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def make_inputs(shape):
    b, hq, hkv, s, d = shape
    q = torch.randn(b, s, hq, d, device=DEVICE, dtype=DTYPE).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hkv, d, device=DEVICE, dtype=DTYPE).transpose(1, 2).requires_grad_()
    cos, sin = _tables(s, d)
    return (q, k, cos, sin), (q, k)


def bytes_for(shape, mode):
    b, hq, hkv, s, d = shape
    e = torch.finfo(DTYPE).bits // 8
    one_way = 2 * b * (hq + hkv) * s * d * e + 2 * s * d * e
    return {"fwd": one_way, "bwd": one_way, "fwd+bwd": 2 * one_way}[mode]


def torch_rotary(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb after its unsqueeze."""
    return rk.rotary_embedding_ref(q, k, cos, sin)


def trifuse_rotary(q, k, cos, sin):
    # trifuse's kernel, always: trifuse.ops.rotary_embedding may choose PyTorch (its dialect)
    return rk._rotary_trifuse(q, k, cos, sin)


def dialect_rotary(q, k, cos, sin):
    return trifuse.ops.rotary_embedding(q, k, cos, sin)


def providers() -> dict:
    out = {"trifuse": trifuse_rotary, "trifuse.ops (dialect)": dialect_rotary, "torch": torch_rotary}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_rotary)
        liger = H.try_import("liger_kernel.transformers.rope")
        if liger is not None:
            out["liger"] = lambda q, k, cos, sin: liger.liger_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])
    return out


def with_peak_memory(rows: list[dict]) -> list[dict]:
    """Adds each timed row's peak memory (MiB) for one step."""
    fns = providers()
    by_shape = {"x".join(map(str, s)): s for s in SHAPES}
    for row in rows:
        if "ms" in row and row["shape"] in by_shape:
            shape = by_shape[row["shape"]]
            step = H.make_step(fns[row["provider"]], lambda s=shape: make_inputs(s), row["mode"])
            row["peak MiB"] = H.peak_memory_mib(step)
    if H.on_gpu():
        torch.cuda.empty_cache()
    return rows


def host_overhead() -> list[dict]:
    """Wall µs per call at a tiny size: trifuse's eager path, its dialect and its registered op,
    beside the PyTorch eager sequence they replace (HF's formula for q and k)."""
    shape = (1, 2, 2, 16, 64)

    def registered(q, k, cos, sin):
        return torch.ops.trifuse.rotary_embedding(q, k, cos, sin)

    cases = {}
    for mode in ("fwd", "fwd+bwd"):
        cases[f"trifuse eager path {mode}"] = H.make_step(trifuse_rotary, lambda: make_inputs(shape), mode)
        cases[f"trifuse.ops.rotary_embedding (dialect) {mode}"] = H.make_step(
            dialect_rotary, lambda: make_inputs(shape), mode)
        cases[f"trifuse registered op {mode}"] = H.make_step(registered, lambda: make_inputs(shape), mode)
        cases[f"torch HF apply_rotary_pos_emb {mode}"] = H.make_step(torch_rotary, lambda: make_inputs(shape), mode)
    return H.host_overhead_rows(cases)


COLUMNS = ("provider", "mode", "shape", "ms", "GB/s", "% copy", "graph ms", "graph GB/s", "peak MiB",
           "x vs torch", "x vs torch.compile", "x vs liger", "error", "graph error")

# ---------------------------------------------------------------------------------------------
# The complex product with the model's casts (Llama 4, torchtitan, Meta's reference): q and k
# (B, S, H, D) as projected, upcast, their pairs times a complex (S, D/2) table, cast back; against
# what fuse puts there (rotary_complex_cast_q_k: one call, q and k read and written in their own
# dtype). Bytes, the least: q and k read and written once in their dtype, the table read once
# (8 bytes a pair), each way.
# ---------------------------------------------------------------------------------------------


def _complex_table(s, d):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device=DEVICE, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(s, device=DEVICE, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(freqs), freqs)  # (S, D/2) complex64


def make_complex_inputs(shape):
    b, hq, hkv, s, d = shape
    q = torch.randn(b, s, hq, d, device=DEVICE, dtype=DTYPE).requires_grad_()
    k = torch.randn(b, s, hkv, d, device=DEVICE, dtype=DTYPE).requires_grad_()
    return (q, k, _complex_table(s, d)), (q, k)


def complex_bytes_for(shape, mode):
    b, hq, hkv, s, d = shape
    e = torch.finfo(DTYPE).bits // 8
    one_way = 2 * b * (hq + hkv) * s * d * e + s * (d // 2) * 8
    return {"fwd": one_way, "bwd": one_way, "fwd+bwd": 2 * one_way}[mode]


def torch_complex_rotary(q, k, freqs):
    """Llama 4's apply_rotary_emb (the table indexed for (B, S, H, D/2) pairs)."""
    table = freqs[None, :, None, :]
    q_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    k_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    return (torch.view_as_real(q_ * table).flatten(3).type_as(q),
            torch.view_as_real(k_ * table).flatten(3).type_as(k))


def trifuse_complex_rotary(q, k, freqs):
    """What fuse's rotary_complex_cast_q_k replacement runs: the table's real and imaginary parts
    as per-pair cos and sin, q and k as (B, H, S, D) views, their dtype out."""
    table = torch.view_as_real(freqs)[None, None]
    q_embed, k_embed = rk._rotary_trifuse(q.transpose(1, 2), k.transpose(1, 2), table[..., 0], table[..., 1],
                                          True, False, q.dtype)
    return q_embed.transpose(1, 2), k_embed.transpose(1, 2)


def complex_providers() -> dict:
    out = {"trifuse": trifuse_complex_rotary, "torch": torch_complex_rotary}
    if H.on_gpu():
        out["torch.compile"] = H.compiled(torch_complex_rotary)
    return out


COMPLEX_COLUMNS = ("provider", "mode", "shape", "ms", "GB/s", "% copy", "x vs torch", "x vs torch.compile", "error")


def main() -> None:
    rows = with_peak_memory(H.sweep(providers(), SHAPES, make_inputs, bytes_for, x_name="D"))
    overhead = host_overhead()
    complex_rows = H.sweep(complex_providers(), SHAPES, make_complex_inputs, complex_bytes_for, x_name="D")
    H.print_table(rows, COLUMNS)
    H.print_table(overhead, ("provider", "host µs"))
    H.print_table(complex_rows, COMPLEX_COLUMNS)
    H.write_results("rotary", rows, COLUMNS)
    H.write_results("rotary", overhead, ("provider", "host µs"), suffix="host-overhead")
    H.write_results("rotary", complex_rows, COMPLEX_COLUMNS, suffix="complex")


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (2, HQ, 8, 256, D) if H.on_gpu() else (1, 4, 2, 5, 16)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "trifuse.ops (dialect)", "torch"])
def test_rotary(benchmark, provider, mode):
    fn = providers()[provider]
    step = H.make_step(fn, lambda: make_inputs(SMOKE_SHAPE), mode)
    H.check_against_reference(providers(), "torch", make_inputs, SMOKE_SHAPE)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "torch"])
def test_complex_rotary(benchmark, provider, mode):
    step = H.make_step(complex_providers()[provider], lambda: make_complex_inputs(SMOKE_SHAPE), mode)
    H.check_against_reference(complex_providers(), "torch", make_complex_inputs, SMOKE_SHAPE)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_bytes_formula_counts_each_tensor_once():
    b, hq, hkv, s, d = SMOKE_SHAPE
    e = torch.finfo(DTYPE).bits // 8
    q_k_tables = (b * hq * s * d + b * hkv * s * d + 2 * s * d) * e  # read once
    assert bytes_for(SMOKE_SHAPE, "fwd") == q_k_tables + (b * hq * s * d + b * hkv * s * d) * e


def test_host_overhead_runs():
    rows = host_overhead()
    assert all(r["host µs"] > 0 for r in rows)


if __name__ == "__main__":
    main()
