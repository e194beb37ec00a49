"""The harness itself, on CPU: a sweep returns its rows and prints each one as it is measured."""
import json

import _harness as H  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import torch


def test_sweep_prints_every_row_as_it_is_measured(capsys):
    def make_inputs(shape):
        x = torch.randn(*shape, requires_grad=True)
        return (x,), (x,)

    def broken(x):
        raise RuntimeError("no kernel here")

    providers = {"torch": torch.nn.functional.gelu, "tanh": lambda x: x * 0.5, "broken": broken}
    rows = H.sweep(providers, [(3, 5)], make_inputs, lambda s, m: 4 * s[0] * s[1], reference="",
                   modes=("fwd",))
    printed = [json.loads(line[len("row "):]) for line in capsys.readouterr().out.splitlines()
               if line.startswith("row ")]
    assert [r["provider"] for r in rows] == ["torch", "tanh", "broken"]
    assert rows[2]["error"] == "RuntimeError: no kernel here"
    assert len(printed) == len(rows)
    for shown, row in zip(printed, rows):  # printed before the speed-ups were added to the row
        shown.pop("% copy", None)  # NaN on CPU, unequal to itself
        assert shown == {k: row[k] for k in shown}


def test_results_rebuilt_from_a_cut_log_match_the_sweep(capsys, tmp_path):
    """A log's `row` lines give back the sweep's rows, speed-ups included (the last point of a
    cut run never had its speed-ups computed), and the tables carry the run's environment."""
    import results_from_log as R

    def make_inputs(shape):
        x = torch.randn(*shape, requires_grad=True)
        return (x,), (x,)

    providers = {"torch": torch.nn.functional.gelu, "half": lambda x: x * 0.5}
    rows = H.sweep(providers, [(3, 5), (2, 7)], make_inputs, lambda s, m: 4 * s[0] * s[1], reference="",
                   modes=("fwd", "fwd+bwd"))
    rebuilt = R.add_speedups(R.rows_from_log("noise\n" + capsys.readouterr().out))
    assert len(rebuilt) == len(rows) == 8
    for got, want in zip(rebuilt, rows):
        assert {k: v for k, v in got.items() if k != "% copy"} == {k: v for k, v in want.items() if k != "% copy"}
    env = {"device": "NVIDIA H200", "date": "2026-11-27 11:53 UTC"}
    path = H.write_results("gelu", rebuilt, R.columns_for("no_such_op", rebuilt), out_dir=tmp_path, env=env)
    assert json.loads(path.read_text())["environment"] == env
    assert "x vs half" in (tmp_path / "gelu.md").read_text()


def test_graph_calls_are_bounded():
    assert H.graph_calls(0.0) == 64
    assert H.graph_calls(0.05) == 40
    assert H.graph_calls(10.0) == 4


def test_copy_sources_name_who_copied_what():
    """profile_e2e_host's copy table on a CPU: a layout copy in the forward (a transposed view made
    contiguous) and a dtype cast, each found with its callers and shape, the backward's copy with
    its autograd node."""
    import profile_e2e_host as P

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 10))

        def forward(self, x):
            y = (x @ self.w).t().contiguous()  # a clone of a (10, 5) view
            return type("Out", (), {"loss": y.double().sum()})()  # a cast of (10, 5) to float64

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = P.copy_sources(model, opt, {"x": torch.randn(5, 6)}, gpu=False)
    by_callers = {(r["callers"], r["shape"]): r for r in rows}
    assert ("aten::clone < aten::contiguous", "[10, 5]") in by_callers, rows
    assert ("aten::_to_copy < aten::to", "[10, 5]") in by_callers, rows
    assert any(r["where"].endswith("Backward0") for r in rows), rows
    assert all(r["calls"] > 0 and r["ms"] >= 0 for r in rows)
