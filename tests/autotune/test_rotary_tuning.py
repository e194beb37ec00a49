"""The rotary embedding kernel takes its launch configuration from trifuse's tuner
(autotune/configs.py: rotary): the default is the plan it launched before it was tuned, a tuned
config is decided once per key and replayed from a launch per exact call shape, and every config
computes the same bits in every convention (the interpreter runs each one). On CPU a fake timer
stands in for do_bench."""
import pytest
import torch

from _device import DEVICE, configs_run_here
from trifuse.autotune import Tuner, configs, records
from trifuse.autotune.tuner import config_label
from trifuse.kernels import rotary as rk

# 2 x (3 q heads + 1 k head) x 50 positions of head dim 40: halves of 20 pad to 32 lanes, and
# 50 positions leave every tile size a ragged last block.
B, HQ, HKV, S, D = 2, 3, 1, 50, 40
CONVENTIONS = {"halves": (False, False), "interleaved": (True, False), "to-halves": (True, True)}


@pytest.fixture
def fresh(monkeypatch):
    """A new tuner (nothing decided) and no stored launches."""
    tuner = Tuner("rotary_embedding", configs.rotary, rk._KEY_NAMES)
    monkeypatch.setattr(rk, "_TUNER", tuner)
    monkeypatch.setattr(rk, "_LAUNCHES", {})
    return tuner


@pytest.fixture
def launches(record_launches):
    """Every launch of the kernel, as ("rotary", grid, launch keywords); they still run."""
    return record_launches({"rotary": rk._rotary_embedding})


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, S, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, HKV, S, D, generator=g).to(DEVICE, dtype)
    angles = torch.randn(1, 1, S, D, generator=g)
    return q, k, angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


def _fwd_bwd(q, k, cos, sin, interleaved, halves_out):
    qe, ke = rk.rotary_embedding_fwd(q, k, cos, sin, interleaved=interleaved, halves_out=halves_out)
    dq, dk = rk.rotary_embedding_bwd(qe, ke, cos, sin, q.dtype, interleaved=interleaved,
                                     halves_out=halves_out)
    return qe, ke, dq, dk


def test_default_without_tuning_is_the_former_fixed_plan(fresh, launches, cache_dir, monkeypatch):
    """TRIFUSE_AUTOTUNE=0: entry 0, nothing timed, and the launch the kernel ran before it was
    tuned: halves of 32 lanes, 2048 // 32 = 64 positions capped at next_power_of_2(50) = 64, 8
    warps, one program per (batch, block of positions, head)."""
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    _fwd_bwd(*_inputs(), False, False)
    assert [(grid, meta["BLOCK_S"], meta["BLOCK_HALF"], meta["num_warps"]) for _, grid, meta in launches] \
        == [((B * (HQ + HKV),), 64, 32, 8)] * 2
    assert {d.source for d in records(kind="kernel")} == {"default (TRIFUSE_AUTOTUNE=0)"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
def test_every_config_computes_the_same(convention, dtype, fresh, cache_dir, launches):
    """Each config forced in turn: the embeddings and their gradients bitwise the default's (an
    element's rotation does not depend on the tile), in every convention."""
    inputs = _inputs(dtype, seed=1)
    default = None
    for cfg in configs_run_here(configs.rotary()):
        fresh.config = lambda key, launch, *args, _cfg=cfg: _cfg  # this config, undecided: not stored
        launches.clear()
        got = _fwd_bwd(*inputs, *CONVENTIONS[convention])
        assert launches[-1][2]["BLOCK_S"] == rk._plan(cfg, S, D)[0]
        if default is None:
            default = got
            continue
        for name, a, ref in zip(("q_embed", "k_embed", "dq", "dk"), got, default):
            assert torch.equal(a, ref), f"{name}: {config_label(cfg)}"
    assert not rk._LAUNCHES, "forced, undecided configs are not stored"


WIN = "TILE_HALF=1024,warps=4,stages=3"


def test_tuned_once_per_key_then_replayed(fresh, launches, cache_dir, timer):
    fresh.timer = timer({WIN: 0.1})
    inputs = _inputs()
    _fwd_bwd(*inputs, False, False)
    assert fresh.timer.calls == [config_label(c) for c in configs.rotary()] * 2, "forward and backward"
    _, first_grid, first_meta = launches[-1]
    assert first_meta["BLOCK_S"] == 1024 // 32 and first_meta["num_warps"] == 4
    assert first_grid == (B * 2 * (HQ + HKV),), "50 positions in 2 blocks of 32"
    launches.clear()
    for _ in range(2):
        _fwd_bwd(*inputs, False, False)
    assert len(fresh.timer.calls) == 2 * len(configs.rotary()), "nothing timed again"
    assert len(launches) == 4 and all(grid == first_grid for _, grid, _ in launches)
    assert len(rk._LAUNCHES) == 2
    buckets = {d.bucket for d in records(kind="kernel") if d.name == "rotary_embedding"}
    assert buckets == {f"dtype=float32,d={D},s=64,rows=8,backward={b},pairs=halves" for b in (False, True)}
    assert {d.chosen for d in records(kind="kernel")} == {WIN}
