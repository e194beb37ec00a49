"""Operator dialects on the benchmark shapes: each candidate forced, against the dialect's own
choice (trifuse.ops.<op>, which measures once per shape bucket and replays).

    python bench/bench_dialects.py     # GPU: writes bench/results/dialects.json/.md
    pytest bench/bench_dialects.py     # CPU: a tiny smoke in the interpreter

The claim checked: with dialects on, every shape runs at least as fast as the best single
candidate, within noise ("dialect / best" near 1.00 or below), since the choice is measured.
Rows also say which candidate the dialect chose and what it rejected. Bytes as in
bench_layer_norm.py (LayerNorm fwd+bwd: 5·M·N·e + 5·N·e).
"""
import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest

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


def winners_table(rows: list[dict]) -> list[dict]:
    """One row per shape: each provider's ms, the dialect's choice and its ratio to the best."""
    table: dict[str, dict] = {}
    for r in rows:
        if "ms" not in r:
            continue
        t = table.setdefault(r["shape"], {"op": r["variant"], "shape": r["shape"]})
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
    table = winners_table(rows)
    for t in table:
        m, n = map(int, t["shape"].split("x"))
        x, w, b = make_inputs((m, n))[0]
        decision = dialect.explain(x, (n,), w, b, 1e-5)
        t["chosen"] = f"{decision.chosen} ({decision.source})"
        t["rejected"] = "; ".join(f"{k}: {v}" for k, v in decision.rejected.items())
    columns = ("op", "shape", *providers, "dialect / best", "chosen", "rejected")
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


def test_winners_table_compares_with_the_best_single():
    rows = [{"provider": p, "variant": "layer_norm", "shape": "4x8", "ms": ms}
            for p, ms in (("only trifuse", 2.0), ("only torch", 1.0), ("dialect", 1.1))]
    (t,) = winners_table(rows)
    assert t["dialect / best"] == pytest.approx(1.1)


if __name__ == "__main__":
    main()
