"""The dynamic-shapes sweep's verdict, on CPU: a model whose graphs compile once under Dynamo's own
backend compiles once with trifuse's too (llama: "ok"), and a guard a pattern's check adds on the
sequence length is caught ("RECOMPILES", with Dynamo's reason)."""
import dynamic_sweep as ds  # (bench/conftest.py sets TRITON_INTERPRET before this)
import torch
from trifuse.fusion import rewriter


def test_llama_compiles_once_for_every_length():
    row = ds.run_one("llama")
    assert row["status"] == "ok", row
    assert row["graphs_trifuse"] == row["graphs_eager"] == 1
    assert row["replaced"].get("attention") == 2 and row["replaced"].get("rms_norm") == 1


def test_a_check_that_guards_on_the_sequence_length_recompiles(monkeypatch):
    checked = rewriter._check

    def guarding(m):  # reads the sequence length as a number: Dynamo specializes it
        x = m.value("x") if "x" in m.pattern.replacement.__code__.co_varnames else None
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            int(x.shape[1])
        return checked(m)

    monkeypatch.setattr(rewriter, "_check", guarding)
    row = ds.run_one("llama")
    assert row["status"] == "RECOMPILES", row
    assert row["graphs_trifuse"] == 3 and "size mismatch" in row["why"], row
