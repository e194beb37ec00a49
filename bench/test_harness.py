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
