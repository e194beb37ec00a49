"""Operator dialects on the benchmark shapes: each candidate forced, against the dialect's own
choice (trifuse.ops.<op>, which measures once per shape bucket and replays).

    python bench/bench_dialects.py     # GPU: writes bench/results/dialects.json/.md
    pytest bench/bench_dialects.py     # CPU: a tiny smoke in the interpreter

The claim checked: with dialects on, every shape runs at least as fast as the best single
candidate, within noise ("dialect / best" near 1.00 or below), since the choice is measured.
Rows also say which candidate the dialect chose and what it rejected. Bytes as in
bench_layer_norm.py (LayerNorm fwd+bwd: 5·M·N·e + 5·N·e); attention FLOPs as in
bench_attention.py. A forced candidate that cannot take a shape is an error row with its reason
(never a silent fallback to trifuse's kernels).
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest

import bench_attention as BA
import bench_layer_norm as BL
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
    for causal in (True, False):
        _, a_providers, a_shapes, a_inputs, a_flops = attention_case(causal)
        rows += H.sweep(a_providers, a_shapes, a_inputs, flops_for=a_flops, modes=(MODE,),
                        reference="only trifuse", x_name="D",
                        variant="attention causal" if causal else "attention full")
        names += [n for n in a_providers if n not in names]
    table = winners_table(rows)
    for t in table:
        shape = tuple(map(int, t["shape"].split("x")))
        if t["op"].startswith("attention"):
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


def test_winners_table_compares_with_the_best_single():
    rows = [{"provider": p, "variant": "layer_norm", "shape": "4x8", "ms": ms}
            for p, ms in (("only trifuse", 2.0), ("only torch", 1.0), ("dialect", 1.1))]
    (t,) = winners_table(rows)
    assert t["dialect / best"] == pytest.approx(1.1)


if __name__ == "__main__":
    main()
