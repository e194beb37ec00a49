"""Packed sequences (padding-free training): trifuse's varlen kernels against the other ways a
packed batch of documents gets its attention.

    python bench/bench_attention_varlen.py     # on the GPU, writes bench/results/attention_varlen*
    pytest bench/bench_attention_varlen.py     # CPU: a tiny smoke in the interpreter

A shape (T, H, N, D) is one row of T tokens holding N documents (lengths drawn once from a
seeded Dirichlet split, every document >= 1 token), H heads of dim D, causal within each
document: what transformers' DataCollatorWithFlattening hands a decoder. Providers:
    trifuse varlen            trifuse's varlen kernels over the offsets (the op's checks, then its
                              "trifuse" candidate)
    trifuse.ops.attention_varlen (dialect)
                              the public op: its dialect's choice of trifuse's kernels, PyTorch's
                              varlen_attn or flash-attn
    trifuse.ops.attention     the public op on the row with the (1, 1, T, T) bool mask transformers
                              builds for SDPA from packed position ids: what a fused model calls;
                              it recognizes the block-diagonal mask (checked once per mask, cached)
                              and runs varlen (not in its "graph ms": inside a CUDA graph capture
                              nothing may sync, and a graph replays fixed shapes: the dense kernels)
    trifuse block mask        trifuse's dense kernels over the row under that mask, visiting only
                              the key blocks each query block's rows see (the mask's bounds): what
                              a fused model runs for packed rows in batches of more than one
    trifuse every block       the same kernels visiting every block (no bounds; what the op ran
                              before it recognized packed masks)
    sdpa-efficient block mask SDPA's memory-efficient backend with that mask (flash takes none)
    sdpa-flash per document   one causal SDPA flash call per document (a loop on the host)
    flex-attention            FlexAttention with a document block mask (compiled), GPU only
    torch varlen_attn         torch.nn.attention.varlen.varlen_attn (its flash backend), GPU only
    flash-attn varlen         flash_attn_varlen_func, when importable
The mask and the offsets are built once, outside the timing (transformers builds them once a
step). FLOPs count each document's own square, halved for causal: sum_b 2 * H * s_b^2 * (D + D)
/ 2 forward, 2.5x that backward (FlashAttention's convention); the dense providers do more work
than that for the same answer, which is the point.
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import trifuse
from trifuse.kernels import attention as attn_mod
from trifuse.kernels import attention_varlen as varlen_mod

DTYPE = torch.bfloat16 if H.on_gpu() else torch.float32
DEVICE = "cuda" if H.on_gpu() else "cpu"
MODES = ("fwd", "fwd+bwd")
# (T tokens, H heads, N documents, D head dim)
SHAPES = ((16384, 16, 8, 128), (16384, 16, 64, 128), (8192, 32, 16, 64)) if H.on_gpu() else ((48, 2, 3, 16),)


@functools.cache
def lengths(shape) -> tuple[int, ...]:
    t, _, n, _ = shape
    state = torch.random.get_rng_state()
    torch.manual_seed(t * 31 + n)
    share = torch.distributions.Dirichlet(torch.full((n,), 2.0)).sample()
    torch.random.set_rng_state(state)
    sizes = (share * (t - n)).floor().long() + 1  # each document at least one token
    sizes[-1] += t - int(sizes.sum())
    return tuple(sizes.tolist())


@functools.cache
def packing(shape):
    """(cu_seqlens int32, longest, (1, 1, T, T) bool block-causal mask) for the shape's row."""
    sizes = torch.tensor(lengths(shape))
    cu = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    cu[1:] = sizes.cumsum(0)
    doc = torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(DEVICE)
    pos = torch.arange(shape[0], device=DEVICE)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    return cu.to(DEVICE), int(sizes.max()), mask[None, None]


def make_inputs(shape):
    t, h, _, d = shape
    q, k, v = (torch.randn(1, h, t, d, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
    return (q, k, v, shape), (q, k, v)


def flops_for(shape, mode) -> float:
    _, h, _, d = shape
    fwd = sum(2 * h * s * s * 2 * d * 0.5 for s in lengths(shape))
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode]


def _tokens_first(t):
    return t[0].transpose(0, 1)  # (1, H, T, D) -> (T, H, D), a view


def trifuse_varlen(q, k, v, shape):
    """trifuse's kernels, always (trifuse.ops.attention_varlen may choose PyTorch's varlen_attn or
    flash-attn: its dialect), after the checks the op runs."""
    cu, longest, _ = packing(shape)
    q, k, v = (_tokens_first(t) for t in (q, k, v))
    varlen_mod._check_inputs(q, k, v, cu, cu, 0.0, True, None)
    varlen_mod._check_offsets(q, k, cu, cu, longest, longest, True)
    out = varlen_mod.ATTENTION_VARLEN.candidate("trifuse").fn(q, k, v, cu, cu, longest, longest, 0.0, None, True, 0)
    return out.transpose(0, 1)[None]


def dialect_varlen(q, k, v, shape):
    cu, longest, _ = packing(shape)
    out = trifuse.ops.attention_varlen(_tokens_first(q), _tokens_first(k), _tokens_first(v), cu, cu, longest,
                                       longest, causal=True)
    return out.transpose(0, 1)[None]


def trifuse_ops_attention(q, k, v, shape):
    return trifuse.ops.attention(q, k, v, attn_mask=packing(shape)[2])


def trifuse_block_mask(q, k, v, shape):
    return attn_mod._attention_trifuse(q, k, v, packing(shape)[2], 0.0, False, None, False)


class _EveryBlock(torch.autograd.Function):
    """trifuse's dense kernels with the mask's bounds off, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        with _bounds_off():
            o, lse = attn_mod.attention_fwd(q, k, v, mask, 0.0, False, q.shape[-1] ** -0.5, None)
        ctx.save_for_backward(q, k, v, mask, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, mask, o, lse = ctx.saved_tensors
        with _bounds_off():
            dq, dk, dv, *_ = attn_mod.attention_bwd(do.contiguous(), q, k, v, o, lse, None, mask, 0.0, False,
                                                    q.shape[-1] ** -0.5)
        return dq, dk, dv, None


class _bounds_off:
    def __enter__(self):
        self.saved, attn_mod._BOUNDS_MIN_KEYS = attn_mod._BOUNDS_MIN_KEYS, 1 << 62

    def __exit__(self, *exc):
        attn_mod._BOUNDS_MIN_KEYS = self.saved


def trifuse_every_block(q, k, v, shape):
    return _EveryBlock.apply(q, k, v, packing(shape)[2])


def sdpa_efficient_block_mask(q, k, v, shape):
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=packing(shape)[2])


def sdpa_math_block_mask(q, k, v, shape):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=packing(shape)[2])


def sdpa_flash_per_document(q, k, v, shape):
    outs, start = [], 0
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for n in lengths(shape):
            span = slice(start, start + n)
            outs.append(F.scaled_dot_product_attention(q[:, :, span], k[:, :, span], v[:, :, span],
                                                       is_causal=True))
            start += n
    return torch.cat(outs, 2)


def providers() -> dict:
    out = {"trifuse varlen": trifuse_varlen, "trifuse.ops.attention_varlen (dialect)": dialect_varlen,
           "trifuse.ops.attention": trifuse_ops_attention,
           "trifuse block mask": trifuse_block_mask, "trifuse every block": trifuse_every_block}
    if not H.on_gpu():
        return {**out, "sdpa-math block mask": sdpa_math_block_mask}
    out["sdpa-efficient block mask"] = sdpa_efficient_block_mask
    out["sdpa-flash per document"] = sdpa_flash_per_document
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)

        @functools.cache
        def block_mask(shape):
            cu, _, _ = packing(shape)
            doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=DEVICE), cu.diff())
            return create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi), None, None,
                                     shape[0], shape[0], device=DEVICE)

        out["flex-attention"] = lambda q, k, v, shape: flex(q, k, v, block_mask=block_mask(shape))
    except ImportError:
        pass
    torch_varlen = H.try_import("torch.nn.attention.varlen")
    if torch_varlen is not None:
        def torch_varlen_attn(q, k, v, shape):
            cu, longest, _ = packing(shape)
            q, k, v = (_tokens_first(t) for t in (q, k, v))
            out = torch_varlen.varlen_attn(q, k, v, cu.int(), cu.int(), longest, longest, window_size=(-1, 0))
            return out.transpose(0, 1)[None]
        out["torch varlen_attn"] = torch_varlen_attn
    flash_attn = H.try_import("flash_attn")
    if flash_attn is not None:
        def flash_varlen(q, k, v, shape):
            cu, longest, _ = packing(shape)
            q, k, v = (_tokens_first(t) for t in (q, k, v))
            out = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)
            return out.transpose(0, 1)[None]
        out["flash-attn varlen"] = flash_varlen
    return out


def with_peak_memory(rows: list[dict], fns: dict) -> list[dict]:
    by_shape = {"x".join(map(str, s)): s for s in SHAPES}
    for row in rows:
        if "ms" in row:
            shape = by_shape[row["shape"]]
            row["peak MiB"] = H.peak_memory_mib(H.make_step(fns[row["provider"]], lambda: make_inputs(shape),
                                                            row["mode"]))
            row["longest"] = max(lengths(shape))
    return rows


COLUMNS = ("provider", "mode", "shape", "longest", "ms", "TFLOP/s", "graph ms", "peak MiB",
           "x vs trifuse block mask", "x vs trifuse every block", "x vs trifuse.ops.attention",
           "x vs sdpa-efficient block mask", "x vs sdpa-flash per document",
           "x vs flex-attention", "x vs flash-attn varlen", "error", "graph error")


def main() -> None:
    fns = providers()
    rows = H.sweep(fns, SHAPES, make_inputs, flops_for=flops_for, modes=MODES, reference="trifuse block mask",
                   x_name="N")
    rows = with_peak_memory(rows, fns)
    H.print_table(rows, COLUMNS)
    H.write_results("attention_varlen", rows, COLUMNS)


# pytest: on CPU the steps run once in the interpreter and agree, so this file cannot rot.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", ["trifuse varlen", "trifuse.ops.attention", "trifuse block mask",
                                      "trifuse every block"])
def test_attention_varlen(benchmark, provider, mode):
    fns = providers()
    H.check_against_reference(fns, "sdpa-math block mask" if not H.on_gpu() else "trifuse block mask",
                              make_inputs, SHAPES[0])
    step = H.make_step(fns[provider], lambda: make_inputs(SHAPES[0]), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)
    assert sum(lengths(SHAPES[0])) == SHAPES[0][0] and min(lengths(SHAPES[0])) >= 1
    assert flops_for(SHAPES[0], mode) > 0


if __name__ == "__main__":
    main()
