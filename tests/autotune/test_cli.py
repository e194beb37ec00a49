"""`python -m trifuse.autotune`: a tiny GPT-2 from its config class and a model factory run one
training step, every dialect on the path decides, the table of winners is printed; with a
(fake) timer the choices land in the cache and a second run replays them without timing."""
import re

import pytest

import trifuse
from trifuse.autotune import Tuner, configs
from trifuse.autotune import __main__ as cli
from trifuse.kernels import layer_norm as ln

TINY_GPT2 = "gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32"

FACTORY = '''
import torch

def make(batch, seq):
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 4))
    return model, (torch.randn(batch, seq, 16),)
'''


@pytest.fixture
def fresh_layer_norm(cache_dir, monkeypatch):
    """The layer_norm dialect, its kernel tuners and launch plans with nothing decided, as in a
    new process (a model run earlier in this process would otherwise have decided the shapes the
    table must show, and a decided shape is not recorded again)."""
    ln.LAYER_NORM.clear()
    monkeypatch.setattr(ln.LAYER_NORM, "timer", None)
    monkeypatch.setattr(ln, "_FWD_TUNER", Tuner("layer_norm_fwd", configs.norm_fwd, ln._FWD_KEY_NAMES,
                                                 prune=configs.prune_norm_fwd))
    monkeypatch.setattr(ln, "_BWD_TUNER", Tuner("layer_norm_bwd", configs.norm_bwd, ln._BWD_KEY_NAMES,
                                                 prune=configs.prune_norm_bwd))
    monkeypatch.setattr(ln, "_FWD_PLANS", {})
    monkeypatch.setattr(ln, "_BWD_PLANS", {})
    yield
    ln.LAYER_NORM.clear()


def test_transformers_config_by_model_type(fresh_layer_norm, monkeypatch, capsys):
    monkeypatch.delattr(trifuse, "fuse", raising=False)
    assert cli.main([TINY_GPT2, "--batch", "2", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "GPT2LMHeadModel (gpt2), batch 2, seq 8" in out
    assert "has no trifuse.fuse: running the model as is" in out
    # (column widths follow the longest name: the kernel tuners' rows are in the table too)
    assert re.search(r"dialect +layer_norm +dtype=float32,rows=16,n=32,weight=float32,bias=float32,grad=True", out)
    assert re.search(r"kernel +layer_norm_fwd +dtype=float32,n=32,rows=16,", out)


def test_fuse_is_used_when_there_is_one(fresh_layer_norm, monkeypatch, capsys):
    fused = []
    monkeypatch.setattr(trifuse, "fuse", lambda m: fused.append(m) or m, raising=False)
    cli.main([TINY_GPT2, "--batch", "1", "--seq", "4"])
    assert len(fused) == 1 and "has no trifuse.fuse" not in capsys.readouterr().out


def test_factory_tunes_and_a_second_run_replays_from_the_cache(fresh_layer_norm, tmp_path, timer, monkeypatch,
                                                               capsys, new_process):
    spec = tmp_path / "model.py"
    spec.write_text(FACTORY)
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(ln.LAYER_NORM, "timer", fake)
    cli.main([f"{spec}:make", "--batch", "3", "--seq", "5"])
    first = capsys.readouterr().out
    assert "rows=16,n=24" in first and "measured" in first and fake.calls == ["trifuse", "torch"]
    new_process()
    ln.LAYER_NORM.clear()
    cli.main([f"{spec}:make", "--batch", "3", "--seq", "5"])
    assert "disk cache" in capsys.readouterr().out and fake.calls == ["trifuse", "torch"]


def test_fused_model_under_autocast_is_tuned(fresh_layer_norm, tmp_path, capsys):
    """A fused model calls its modules only while it is captured, on fake tensors under
    autocast: the shapes still reach the table (this once found nothing to tune on a GPU)."""
    spec = tmp_path / "model.py"
    spec.write_text(FACTORY)
    cli.main([f"{spec}:make", "--batch", "3", "--seq", "5", "--dtype", "bf16", "--device", "cpu"])
    assert re.search(r"dialect +layer_norm +dtype=bfloat16,rows=16,n=24", capsys.readouterr().out)


@pytest.mark.parametrize("spec, message", [
    ("no-such-model-type", "is not a transformers model type"),
    ("missing.py:make", "does not exist"),
    (TINY_GPT2 + ",bad", "is not name=value"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(SystemExit, match=message):
        cli.main([spec, "--batch", "1", "--seq", "4"])


def test_seq_longer_than_the_model_is_refused():
    with pytest.raises(SystemExit, match="exceeds the model's 32 positions"):
        cli.main([TINY_GPT2, "--batch", "1", "--seq", "64"])


def test_presets_are_transformers_overrides():
    import transformers

    for name, (model_type, overrides) in cli.PRESETS.items():
        config = transformers.AutoConfig.for_model(model_type, **overrides)
        for k, v in overrides.items():
            assert getattr(config, k) == v, name


def test_export_defaults_into_a_folder_writes_the_gpus_family_file(tmp_path, monkeypatch, capsys):
    """`--export-defaults autotune/defaults/` (a folder) writes <family>.json in it: an H200's
    winners go to h200.json, not into another family's file."""
    import types

    from trifuse.autotune import cache

    env = cache.Environment("NVIDIA H200", "3.6.0", "2.11.0")
    entries = {"layer_norm_fwd|n=1024": {"config": {"kwargs": {"TILE": 4096}, "num_warps": 8}}}
    monkeypatch.setattr(cache, "disk_cache", lambda i: types.SimpleNamespace(env=env, entries=lambda: entries))
    cli._export(tmp_path, 0)
    assert cache.read_defaults(tmp_path / "h200.json", "h200") == entries
    assert "h200.json (h200)" in capsys.readouterr().out
