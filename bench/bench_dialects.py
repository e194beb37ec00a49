"""Operator dialects on the benchmark shapes: each candidate forced, against the dialect's own
choice (trifuse.ops.<op>, which measures once per shape bucket and replays).

    python bench/bench_dialects.py     # GPU: writes bench/results/dialects.json/.md
    pytest bench/bench_dialects.py     # CPU: a tiny smoke in the interpreter

The claim checked: with dialects on, every shape runs at least as fast as the best single
candidate, within noise ("dialect / best" near 1.00 or below), since the choice is measured.
Rows also say which candidate the dialect chose and what it rejected. Dialects covered:
layer_norm, rms_norm, bias_gelu (erf and tanh), gated_activation (SiLU), cross_entropy,
rotary_embedding, group_norm (SiLU), dropout_add, dropout_add_layer_norm and layer_norm_add
(without dropout) and attention (causal and full). Bytes as in
bench_layer_norm.py (LayerNorm fwd+bwd: 5·M·N·e + 5·N·e; RMSNorm the same without the bias:
5·M·N·e + 3·N·e; y = r + LayerNorm(x): 6·M·N·e + 5·N·e), bench_dropout_add.py,
bench_residual_stream.py, bench_bias_gelu.py, bench_gated_activation.py (8·M·N·e),
bench_cross_entropy.py (logits read twice, dlogits written: 3·N·C·e), bench_rotary.py and
bench_group_norm.py; attention FLOPs as in bench_attention.py. A forced candidate that cannot
take a shape is an error row with its reason (never a silent fallback to trifuse's kernels).
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest

import torch

import bench_attention as BA
import bench_bias_gelu as BG
import bench_cross_entropy as BCE
import bench_dropout_add as BDA
import bench_gated_activation as BGA
import bench_group_norm as BGN
import bench_layer_norm as BL
import bench_residual_stream as BRS
import bench_rotary as BR
import trifuse
from trifuse.autotune import dialects

MODE = "fwd+bwd"


def layer_norm_case():
    """(dialect, providers, shapes, make_inputs, bytes_for) for LayerNorm without residual."""
    dialect = dialects.get("layer_norm")

    def forced(candidate):
        return lambda x, w, b: candidate.fn(x, (x.shape[-1],), w, b, 1e-5)

    providers = {f"only {c.name}": forced(c) for c in dialect.candidates}
    providers["dialect"] = lambda x, w, b: trifuse.ops.layer_norm(x, (x.shape[-1],), w, b)
    shapes = [*BL.TARGET_SHAPES, *((BL.ELEMENTS // n, n) for n in BL.WIDTHS)]
    return dialect, providers, shapes, BL.make_inputs, BL.bytes_for


def _forced(candidate, *options):
    """A provider running one candidate on (tensors..., *options); one that cannot take the call
    raises its reason instead of falling back."""
    def fn(*tensors):
        args = (*tensors, *options)
        reason = candidate.rejection(args, False)
        if reason is not None:
            raise RuntimeError(reason)
        return candidate.fn(*args)
    return fn


def rms_norm_case():
    """(dialect, providers, shapes, make_inputs, bytes_for, explain) for RMSNorm without residual."""
    dialect = dialects.get("rms_norm")

    def make_inputs(shape):
        (x, w, _), _ = BL.make_inputs(shape)
        return (x, w), (x, w)

    def bytes_for(shape, mode):
        m, n = shape
        e = torch.finfo(BL.DTYPE).bits // 8
        fwd, bwd = 2 * m * n * e + n * e, 3 * m * n * e + 2 * n * e
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]

    def forced(candidate):
        return lambda x, w: _forced(candidate, (x.shape[-1],), w, 1e-6)(x)

    providers = {f"only {c.name}": forced(c) for c in dialect.candidates}
    providers["dialect"] = lambda x, w: trifuse.ops.rms_norm(x, (x.shape[-1],), w, 1e-6)
    shapes = [*BL.TARGET_SHAPES, *((BL.ELEMENTS // n, n) for n in BL.WIDTHS)]

    def explain(shape):
        x, w = make_inputs(shape)[0]
        return dialect.explain(x, (shape[1],), w, 1e-6)
    return dialect, providers, shapes, make_inputs, bytes_for, explain


def bias_gelu_case(approximate: str):
    """(dialect, providers, shapes, make_inputs, bytes_for, explain) for bias + GeLU in one form."""
    dialect = dialects.get("bias_gelu")
    providers = {f"only {c.name}": _forced(c, approximate) for c in dialect.candidates}
    providers["dialect"] = lambda x, b: trifuse.ops.bias_gelu(x, b, approximate)
    shapes = [*BG.TARGET_SHAPES, *((BG.ELEMENTS // n, n) for n in BG.WIDTHS)]

    def explain(shape):
        x, b = BG.make_inputs(shape)[0]
        return dialect.explain(x, b, approximate)
    return dialect, providers, shapes, BG.make_inputs, BG.bytes_for, explain


def gated_activation_case(activation: str):
    """(dialect, providers, shapes, make_inputs, bytes_for, explain) for act(gate) * up."""
    dialect = dialects.get("gated_activation")
    providers = {f"only {c.name}": _forced(c, activation) for c in dialect.candidates}
    providers["dialect"] = lambda gate, up: trifuse.ops.gated_activation(gate, up, activation)

    def explain(shape):
        gate, up = BGA.make_inputs(shape)[0]
        return dialect.explain(gate, up, activation)
    return dialect, providers, list(BGA.SHAPES[activation]), BGA.make_inputs, BGA.bytes_for, explain


def cross_entropy_case():
    """(dialect, providers, shapes, make_inputs, bytes_for, explain) for cross-entropy with an
    fp32 loss (HF's upcast), "mean" over the labels with ignored positions as HF shifts them."""
    dialect = dialects.get("cross_entropy")
    options = (-100, "mean", 0.0, torch.float32)
    providers = {f"only {c.name}": _forced(c, *options) for c in dialect.candidates}
    providers["dialect"] = lambda logits, y: trifuse.ops.cross_entropy(logits, y, out_dtype=torch.float32)

    def bytes_for(shape, mode):
        n, c = shape
        e = torch.finfo(BCE.LOGITS_DTYPE).bits // 8
        return {"fwd": n * c * e, "bwd": 2 * n * c * e, "fwd+bwd": 3 * n * c * e}[mode]

    def explain(shape):
        logits, y = BCE.make_ce_inputs(shape)[0]
        return dialect.explain(logits, y, *options)
    return dialect, providers, list(BCE.CE_SHAPES), BCE.make_ce_inputs, bytes_for, explain


def rotary_case():
    """(dialect, providers, shapes, make_inputs, bytes_for, explain) for the rotary embedding of q
    and k (Llama-7B/8B shapes at batch 1 and 8)."""
    dialect = dialects.get("rotary_embedding")
    providers = {f"only {c.name}": _forced(c) for c in dialect.candidates}
    providers["dialect"] = trifuse.ops.rotary_embedding
    shapes = [s for s in BR.SHAPES if s[0] in (1, 8)]

    def explain(shape):
        return dialect.explain(*BR.make_inputs(shape)[0])
    return dialect, providers, shapes, BR.make_inputs, BR.bytes_for, explain


def group_norm_case(channels_last: bool = False):
    """(dialect, providers, shapes, make_inputs, bytes_for, explain) for GroupNorm + SiLU at SD's
    UNet's and VAE's shapes (bench_group_norm.py), x contiguous or channels-last (its own key)."""
    dialect = dialects.get("group_norm")
    def forced(candidate):
        return lambda x, w, b: _forced(candidate)(x, BGN.GROUPS, w, b, 1e-5, "silu", None)

    providers = {f"only {c.name}": forced(c) for c in dialect.candidates}
    providers["dialect"] = lambda x, w, b: trifuse.ops.group_norm(x, BGN.GROUPS, w, b, 1e-5, "silu")

    def make_inputs(shape):
        return BGN.make_inputs(shape, channels_last)

    def explain(shape):
        x, w, b = make_inputs(shape)[0]
        return dialect.explain(x, BGN.GROUPS, w, b, 1e-5, "silu", None)
    return dialect, providers, list(BGN.SHAPES), make_inputs, BGN.bytes_for, explain


def dropout_add_case():
    """(dialect, providers, shapes, make_inputs, bytes_for, explain) for residual + (x + bias)
    without dropout (with dropout only trifuse's kernels take the call)."""
    dialect = dialects.get("dropout_add")

    def forced(candidate):
        return lambda x, r, b: _forced(candidate, 0.0, b, None)(x, r)

    providers = {f"only {c.name}": forced(c) for c in dialect.candidates}
    providers["dialect"] = lambda x, r, b: trifuse.ops.dropout_add(x, r, 0.0, bias=b)
    shapes = [*BDA.TARGET_SHAPES, *((BDA.ELEMENTS // n, n) for n in BDA.WIDTHS)]

    def explain(shape):
        x, r, b = BDA.make_inputs(shape)[0]
        return dialect.explain(x, r, 0.0, b, None)
    return dialect, providers, shapes, BDA.make_inputs, BDA.bytes_for, explain


def residual_stream_case():
    """(dialect, providers, shapes, make_inputs, bytes_for, explain) for the pre-norm residual
    stream without dropout: s = r + (x + x_bias), y = LayerNorm(s), (y, s) returned."""
    dialect = dialects.get("dropout_add_layer_norm")

    def forced(candidate):
        return lambda x, r, w, b, xb: _forced(candidate, r, (x.shape[-1],), w, b, BRS.EPS, 0.0, xb, None)(x)

    def through_the_dialect(x, r, w, b, xb):
        return trifuse.ops.dropout_add_layer_norm(x, r, (x.shape[-1],), w, b, BRS.EPS, x_bias=xb)

    providers = {f"only {c.name}": forced(c) for c in dialect.candidates}
    providers["dialect"] = through_the_dialect
    shapes = [*BRS.TARGET_SHAPES, *((BRS.ELEMENTS // n, n) for n in BRS.WIDTHS)]

    def explain(shape):
        x, r, w, b, xb = BRS.make_inputs(shape)[0]
        return dialect.explain(x, r, (shape[1],), w, b, BRS.EPS, 0.0, xb, None)
    return dialect, providers, shapes, BRS.make_inputs, BRS.bytes_for, explain


def layer_norm_add_case():
    """(dialect, providers, shapes, make_inputs, bytes_for, explain) for the post-norm add
    y = r + LayerNorm(x)."""
    dialect = dialects.get("layer_norm_add")

    def make_inputs(shape):
        return BL.make_inputs(shape, residual=True)

    def bytes_for(shape, mode):
        m, n = shape
        e = torch.finfo(BL.DTYPE).bits // 8
        fwd, bwd = 3 * m * n * e + 2 * n * e, 3 * m * n * e + 3 * n * e  # r read, y written; dy read, dx written
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]

    def forced(candidate):
        return lambda x, r, w, b: _forced(candidate, r, [x.shape[-1]], w, b, 1e-5)(x)

    providers = {f"only {c.name}": forced(c) for c in dialect.candidates}
    providers["dialect"] = lambda x, r, w, b: trifuse.ops.layer_norm_add(x, r, (x.shape[-1],), w, b)
    shapes = [*BL.TARGET_SHAPES, *((BL.ELEMENTS // n, n) for n in BL.WIDTHS)]

    def explain(shape):
        x, r, w, b = make_inputs(shape)[0]
        return dialect.explain(x, r, [shape[1]], w, b, 1e-5)
    return dialect, providers, shapes, make_inputs, bytes_for, explain


def other_cases() -> list[tuple[str, tuple]]:
    """(variant, case) for the dialects beside layer_norm and attention."""
    return [("rms_norm", rms_norm_case()), ("bias_gelu none", bias_gelu_case("none")),
            ("bias_gelu tanh", bias_gelu_case("tanh")), ("gated_activation silu", gated_activation_case("silu")),
            ("cross_entropy", cross_entropy_case()), ("rotary_embedding", rotary_case()),
            ("group_norm silu", group_norm_case()),
            ("group_norm silu channels_last", group_norm_case(channels_last=True)),
            ("dropout_add", dropout_add_case()), ("dropout_add_layer_norm", residual_stream_case()),
            ("layer_norm_add", layer_norm_add_case())]


def attention_case(causal: bool):
    """(dialect, providers, shapes, make_inputs, flops_for) for attention, causal or full."""
    dialect = dialects.get("attention")

    def forced(candidate):
        def fn(q, k, v):
            args = (q, k, v, None, 0.0, causal, None, False)
            reason = candidate.rejection(args, False)
            if reason is not None:
                raise RuntimeError(reason)
            return candidate.fn(*args)
        return fn

    providers = {f"only {c.name}": forced(c) for c in dialect.candidates}
    providers["dialect"] = lambda q, k, v: trifuse.ops.attention(q, k, v, is_causal=causal)
    shapes = BA.SHAPES["causal" if causal else "full"]
    return dialect, providers, shapes, BA.make_inputs, lambda s, m: BA.flops_for(s, m, causal)


def winners_table(rows: list[dict]) -> list[dict]:
    """One row per (op, shape): each provider's ms, the dialect's choice and its ratio to the best."""
    table: dict[tuple[str, str], dict] = {}
    for r in rows:
        if "ms" not in r:
            continue
        t = table.setdefault((r["variant"], r["shape"]), {"op": r["variant"], "shape": r["shape"]})
        t[r["provider"]] = r["ms"]
    for t in table.values():
        singles = [v for k, v in t.items() if k.startswith("only ")]
        if singles and "dialect" in t:
            t["dialect / best"] = t["dialect"] / min(singles)
    return list(table.values())


def main() -> None:
    dialect, providers, shapes, make_inputs, bytes_for = layer_norm_case()
    rows = H.sweep(providers, shapes, make_inputs, bytes_for, modes=(MODE,), reference="only torch",
                   variant=dialect.name)
    names = list(providers)
    explainers = {}
    for variant, (_, o_providers, o_shapes, o_inputs, o_bytes, o_explain) in other_cases():
        rows += H.sweep(o_providers, o_shapes, o_inputs, o_bytes, modes=(MODE,), reference="only torch",
                        variant=variant)
        names += [n for n in o_providers if n not in names]
        explainers[variant] = o_explain
    for causal in (True, False):
        _, a_providers, a_shapes, a_inputs, a_flops = attention_case(causal)
        rows += H.sweep(a_providers, a_shapes, a_inputs, flops_for=a_flops, modes=(MODE,),
                        reference="only trifuse", x_name="D",
                        variant="attention causal" if causal else "attention full")
        names += [n for n in a_providers if n not in names]
    table = winners_table(rows)
    for t in table:
        shape = tuple(map(int, t["shape"].split("x")))
        if t["op"] in explainers:
            decision = explainers[t["op"]](shape)
        elif t["op"].startswith("attention"):
            q, k, v = BA.make_inputs(shape)[0]
            decision = dialects.get("attention").explain(q, k, v, None, 0.0, t["op"].endswith("causal"), None, False)
        else:
            x, w, b = make_inputs(shape)[0]
            decision = dialect.explain(x, (shape[1],), w, b, 1e-5)
        t["chosen"] = f"{decision.chosen} ({decision.source})"
        t["rejected"] = "; ".join(f"{k}: {v}" for k, v in decision.rejected.items())
    columns = ("op", "shape", *names, "dialect / best", "chosen", "rejected")
    H.print_table(table, columns)
    H.write_results("dialects", table, columns)


# ---------------------------------------------------------------------------------------------
# pytest entry points: on CPU a tiny smoke of every provider in the interpreter.
# ---------------------------------------------------------------------------------------------

SMOKE_SHAPE = (64, 4096) if H.on_gpu() else (3, 100)


@pytest.mark.parametrize("provider", ["only trifuse", "only torch", "dialect"])
def test_dialects(benchmark, provider):
    _, providers, _, make_inputs, _ = layer_norm_case()
    step = H.make_step(providers[provider], lambda: make_inputs(SMOKE_SHAPE), MODE)
    H.check_against_reference(providers, "only torch", make_inputs, SMOKE_SHAPE)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


@pytest.mark.parametrize("provider", ["only trifuse", "only sdpa-flash", "dialect"])
def test_attention_dialect(benchmark, provider):
    _, providers, _, make_inputs, _ = attention_case(causal=True)
    if provider == "only sdpa-flash" and not H.on_gpu():
        with pytest.raises(RuntimeError, match="runs on CUDA"):
            providers[provider](*make_inputs(BA.SMOKE_SHAPE)[0])
        return
    step = H.make_step(providers[provider], lambda: make_inputs(BA.SMOKE_SHAPE), MODE)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)


@pytest.mark.parametrize("provider", ["only trifuse", "only torch", "dialect"])
@pytest.mark.parametrize("variant", ["rms_norm", "bias_gelu none", "bias_gelu tanh", "gated_activation silu",
                                     "cross_entropy", "rotary_embedding", "group_norm silu",
                                     "group_norm silu channels_last", "dropout_add", "dropout_add_layer_norm",
                                     "layer_norm_add"])
def test_other_dialects(benchmark, variant, provider):
    _, providers, _, make_inputs, _, explain = dict(other_cases())[variant]
    shape = {"cross_entropy": BCE.SMOKE_CE, "rotary_embedding": BR.SMOKE_SHAPE,
             "group_norm silu": BGN.SMOKE_SHAPE,
             "group_norm silu channels_last": BGN.SMOKE_SHAPE}.get(variant, SMOKE_SHAPE)
    step = H.make_step(providers[provider], lambda: make_inputs(shape), MODE)
    H.check_against_reference(providers, "only torch", make_inputs, shape)
    benchmark.pedantic(step, rounds=3 if H.on_gpu() else 1, iterations=1)
    assert explain(shape).chosen in ("trifuse", "torch")


def test_winners_table_compares_with_the_best_single():
    rows = [{"provider": p, "variant": "layer_norm", "shape": "4x8", "ms": ms}
            for p, ms in (("only trifuse", 2.0), ("only torch", 1.0), ("dialect", 1.1))]
    (t,) = winners_table(rows)
    assert t["dialect / best"] == pytest.approx(1.1)


if __name__ == "__main__":
    main()
