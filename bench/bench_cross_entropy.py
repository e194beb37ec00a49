"""The LM head + loss, and cross-entropy alone, against PyTorch eager and torch.compile.

    python bench/bench_cross_entropy.py         # full sweep on the GPU, writes bench/results/
    pytest bench/bench_cross_entropy.py         # CPU: a tiny smoke in the interpreter

LM head (the target: GPT-2 medium, T = 8192 tokens x H = 1024 -> V = 50257), under bf16 autocast
with an fp32 hidden state and fp32 master weight, as a training step of HF GPT-2 has them:
    hf        F.linear(h, W) -> logits.float() -> F.cross_entropy(ignore_index=-100)  (HF's path)
    trifuse   trifuse.ops.linear_cross_entropy(h, W, y, out_dtype=torch.float32)
FLOPs: fwd (no grad) 2 T H V; fwd+bwd 6 T H V (logits, dhidden, dweight). trifuse computes the
gradients inside its forward when autograd will want them and only scales them in the backward,
so its "fwd" row is the no-grad forward and fwd+bwd is the number to compare. Peak memory is the
step's peak above what was allocated before it (harness peak_memory_mib); the fp32 weight
gradient (V H 4 bytes) is part of every provider's peak.

Cross-entropy alone on bf16 logits (N x C):
    hf        F.cross_entropy(logits.float(), y)      (HF's upcast path)
    torch     F.cross_entropy(logits, y)              (bf16 in, bf16 loss)
    trifuse   trifuse.ops.cross_entropy(logits, y, out_dtype=torch.float32)
Bytes, e bytes per logit: fwd reads N C e; bwd reads N C e and writes N C e; fwd+bwd 3 N C e.

Targets on the H100 (issue 9), GPT-2 medium head fwd+bwd: <= 0.9x torch.compile's time, >= 4x
faster than eager, peak memory <= 0.5x torch.compile's.
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch
import torch.nn.functional as F

import trifuse

DEVICE = "cuda" if H.on_gpu() else "cpu"
AUTOCAST = torch.bfloat16  # autocast's bf16, as training runs the head (the CPU smoke too)
LOGITS_DTYPE = torch.bfloat16
SEQ = 1024  # tokens per sequence: HF's label shift ignores the last one of each
HEAD_SHAPES = ((8192, 1024, 50257), (8192, 768, 50257), (4096, 4096, 32000), (4096, 4096, 128256))
CE_SHAPES = ((8192, 50257), (4096, 128256))
MODES = ("fwd", "fwd+bwd")


def _autocast():
    return torch.autocast(DEVICE, dtype=AUTOCAST)


def make_labels(tokens: int, vocab: int) -> torch.Tensor:
    y = torch.randint(0, vocab, (tokens,), device=DEVICE)
    y[SEQ - 1:: SEQ] = -100
    return y


def make_head_inputs(shape):
    tokens, hidden, vocab = shape
    h = torch.randn(tokens, hidden, device=DEVICE, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=DEVICE) / hidden**0.5).requires_grad_()
    return (h, w, make_labels(tokens, vocab)), (h, w)


def make_ce_inputs(shape):
    n, c = shape
    logits = (torch.randn(n, c, device=DEVICE) * 2).to(LOGITS_DTYPE).requires_grad_()
    return (logits, make_labels(n, c)), (logits,)


def hf_head(h, w, y):
    with _autocast():
        logits = F.linear(h, w)
        return F.cross_entropy(logits.float(), y, ignore_index=-100)


def trifuse_head(h, w, y):
    with _autocast():
        return trifuse.ops.linear_cross_entropy(h, w, y, out_dtype=torch.float32)


def hf_ce(logits, y):
    return F.cross_entropy(logits.float(), y, ignore_index=-100)


def torch_ce(logits, y):
    return F.cross_entropy(logits, y, ignore_index=-100)


def trifuse_ce(logits, y):
    return trifuse.ops.cross_entropy(logits, y, out_dtype=torch.float32)


def head_providers() -> dict:
    out = {"trifuse": trifuse_head, "hf eager": hf_head}
    if H.on_gpu():
        out["hf torch.compile"] = H.compiled(hf_head)
        liger = H.try_import("liger_kernel.transformers.functional")
        if liger is not None:
            def liger_head(h, w, y):
                with _autocast():
                    return liger.liger_fused_linear_cross_entropy(h, w, y, ignore_index=-100)
            out["liger"] = liger_head
    return out


def ce_providers() -> dict:
    out = {"trifuse": trifuse_ce, "hf eager": hf_ce, "torch bf16 eager": torch_ce}
    if H.on_gpu():
        out["hf torch.compile"] = H.compiled(hf_ce)
        liger = H.try_import("liger_kernel.transformers.functional")
        if liger is not None:
            # Last: Liger writes the gradient into the logits during its forward.
            out["liger"] = lambda logits, y: liger.liger_cross_entropy(logits, y, ignore_index=-100)
    return out


def head_flops(shape, mode):
    tokens, hidden, vocab = shape
    return (2 if mode == "fwd" else 6) * tokens * hidden * vocab


def ce_bytes(shape, mode):
    n, c = shape
    e = torch.finfo(LOGITS_DTYPE).bits // 8
    return {"fwd": 1, "bwd": 2, "fwd+bwd": 3}[mode] * n * c * e


def check_agreement(providers: dict, make_inputs, shape, reference: str = "hf eager") -> None:
    """Loss and gradients of every provider against the reference provider before anything is
    timed (loosely, for bf16 matmuls: the tests are the oracle)."""
    args, targets = make_inputs(shape)
    ref_loss = providers[reference](*args)
    ref_grads = torch.autograd.grad(ref_loss, targets)
    for name, fn in providers.items():
        loss = fn(*args)
        grads = torch.autograd.grad(loss, targets)
        for what, a, r in (("loss", loss, ref_loss), *zip(("grad",) * len(grads), grads, ref_grads)):
            err = (a.float() - r.float()).abs().max().item()
            scale = max(r.float().abs().max().item(), 1e-30)
            if not err <= 2e-2 * scale:
                raise AssertionError(f"{name} {what} disagrees with {reference} at {shape}: {err:.3e} vs scale {scale:.3e}")


def measure(providers: dict, shapes, make_inputs, variant: str, flops_for=None, bytes_for=None) -> list[dict]:
    """ms (GPU median), TFLOP/s or GB/s, and peak MiB for every provider x mode x shape."""
    rows = []
    copy = H.copy_bandwidth_tbps()
    for shape in shapes:
        check_agreement(providers, make_inputs, shape)
        point = []
        for mode in MODES:
            for name, fn in providers.items():
                row = {"provider": name, "variant": variant, "mode": mode, "shape": "x".join(map(str, shape))}
                try:
                    step = H.make_step(fn, lambda s=shape: make_inputs(s), mode)
                    row["ms"] = H.gpu_ms(step) if H.on_gpu() else H._cpu_smoke_ms(step)
                    row["peak MiB"] = H.peak_memory_mib(step)
                except Exception as e:  # noqa: BLE001  (a baseline that fails is reported, not fatal)
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}" if str(e) else type(e).__name__
                    rows.append(row)
                    continue
                if flops_for is not None:
                    row["TFLOP/s"] = flops_for(shape, mode) / (row["ms"] * 1e-3) / 1e12
                if bytes_for is not None:
                    row["GB/s"] = bytes_for(shape, mode) / (row["ms"] * 1e-3) / 1e9
                    row["% copy"] = 100 * row["GB/s"] / (copy * 1e3) if H.on_gpu() else float("nan")
                point.append(row)
                rows.append(row)
                if H.on_gpu():
                    torch.cuda.empty_cache()
        for row in point:
            for other in point:
                if other["mode"] == row["mode"] and other is not row:
                    row[f"x vs {other['provider']}"] = other["ms"] / row["ms"]
                    row[f"peak / {other['provider']}"] = row["peak MiB"] / other["peak MiB"]
    return rows


def host_overhead() -> list[dict]:
    """Wall µs per call at tiny sizes: trifuse's eager path and registered op beside PyTorch
    eager's op sequences they replace."""
    head_shape, ce_shape = (4, 64, 128), (4, 128)

    def registered_head(h, w, y):
        grad = torch.is_grad_enabled()
        return torch.ops.trifuse.linear_cross_entropy(h, w, y, None, -100, "mean", 0.0, torch.float32, torch.float32,
                                                      None, grad, grad, False)[0]

    def registered_ce(logits, y):
        return torch.ops.trifuse.cross_entropy(logits, y, -100, "mean", 0.0, torch.float32)[0]

    def fp32_head(h, w, y):
        return trifuse.ops.linear_cross_entropy(h, w, y)

    def fp32_hf_head(h, w, y):
        return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100)

    cases = {}
    for mode in MODES:
        head_inputs, ce_inputs = (lambda: make_head_inputs(head_shape)), (lambda: make_ce_inputs(ce_shape))
        cases[f"trifuse linear_cross_entropy eager path {mode}"] = H.make_step(fp32_head, head_inputs, mode)
        cases[f"trifuse linear_cross_entropy registered op {mode}"] = H.make_step(registered_head, head_inputs, mode)
        cases[f"torch F.linear -> float -> F.cross_entropy {mode}"] = H.make_step(fp32_hf_head, head_inputs, mode)
        cases[f"trifuse cross_entropy eager path {mode}"] = H.make_step(trifuse_ce, ce_inputs, mode)
        cases[f"trifuse cross_entropy registered op {mode}"] = H.make_step(registered_ce, ce_inputs, mode)
        cases[f"torch float -> F.cross_entropy {mode}"] = H.make_step(hf_ce, ce_inputs, mode)
    return H.host_overhead_rows(cases)


COLUMNS = ("provider", "variant", "mode", "shape", "ms", "TFLOP/s", "GB/s", "% copy", "peak MiB",
           "x vs hf eager", "x vs hf torch.compile", "peak / hf torch.compile", "peak / hf eager", "error")


def main() -> None:
    rows = measure(head_providers(), HEAD_SHAPES, make_head_inputs, "linear + CE (bf16 autocast)", flops_for=head_flops)
    rows += measure(ce_providers(), CE_SHAPES, make_ce_inputs, "CE on bf16 logits", bytes_for=ce_bytes)
    overhead = host_overhead()
    H.print_table(rows, COLUMNS)
    H.print_table(overhead, ("provider", "host µs"))
    H.write_results("cross_entropy", rows, COLUMNS)
    H.write_results("cross_entropy", overhead, ("provider", "host µs"), suffix="host-overhead")


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every step in the interpreter, so this file
# cannot rot; on a GPU the same points timed by pytest-benchmark.
# ---------------------------------------------------------------------------------------------

SMOKE_HEAD = (2048, 1024, 50257) if H.on_gpu() else (6, 16, 67)
SMOKE_CE = (2048, 50257) if H.on_gpu() else (6, 67)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "hf eager"])
def test_linear_cross_entropy(benchmark, provider, mode):
    check_agreement(head_providers(), make_head_inputs, SMOKE_HEAD)
    step = H.make_step(head_providers()[provider], lambda: make_head_inputs(SMOKE_HEAD), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


@pytest.mark.parametrize("mode", H.MODES)
@pytest.mark.parametrize("provider", ["trifuse", "hf eager", "torch bf16 eager"])
def test_cross_entropy(benchmark, provider, mode):
    check_agreement(ce_providers(), make_ce_inputs, SMOKE_CE)
    step = H.make_step(ce_providers()[provider], lambda: make_ce_inputs(SMOKE_CE), mode)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


def test_measure_and_host_overhead_run():
    rows = measure(head_providers(), (SMOKE_HEAD,), make_head_inputs, "smoke", flops_for=head_flops)
    rows += measure(ce_providers(), (SMOKE_CE,), make_ce_inputs, "smoke", bytes_for=ce_bytes)
    assert all("error" not in r and r["ms"] > 0 for r in rows)
    assert all(r["host µs"] > 0 for r in host_overhead())


if __name__ == "__main__":
    main()
