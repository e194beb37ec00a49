"""GroupNorm's kernels take their launch configuration from trifuse's tuner (autotune/configs.py:
group_norm): the default is the plan they launched before they were tuned, a tuned config is
decided once per key for the forward's and the backward's launches apart and replayed from a plan
per exact call shape, and every config computes the same result up to the order of its sums (the
interpreter runs each one, at the config's own block sizes). On CPU a fake timer stands in for
do_bench."""
import pytest
import torch

from _device import DEVICE
from trifuse.autotune import Tuner, configs, records
from trifuse.autotune.tuner import config_label
from trifuse.kernels import group_norm as gn

KERNELS = {"stats": gn._stats, "fwd": gn._fwd, "bwd_sums": gn._bwd_sums, "bwd_dx": gn._bwd_dx,
           "row_fwd": gn._row_fwd, "row_bwd": gn._row_bwd, "bwd_sums_cl": gn._bwd_sums_cl}


@pytest.fixture
def fresh(monkeypatch):
    """New tuners (nothing decided), no stored plans, the configs' own block sizes (not the
    interpreter's small test blocks), and every row through the chunked kernels (the tuned ones)."""
    fwd = Tuner("group_norm_fwd", configs.group_norm, gn._FWD_KEY_NAMES)
    bwd = Tuner("group_norm_bwd", configs.group_norm, gn._BWD_KEY_NAMES)
    monkeypatch.setattr(gn, "_FWD_TUNER", fwd)
    monkeypatch.setattr(gn, "_BWD_TUNER", bwd)
    monkeypatch.setattr(gn, "_LAUNCHES", {})
    monkeypatch.setattr(gn, "_INTERPRET_CAPS", None)
    monkeypatch.setattr(gn, "_ROW_MAX", 0)
    return fwd, bwd


@pytest.fixture
def launches(record_launches):
    """Every launch of the four kernels, as (name, grid, launch keywords); they still run."""
    return record_launches(KERNELS)


def _inputs(shape, groups, seed=0, dtype=torch.float32, layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 2).to(DEVICE, dtype)
    if layout == "channels_last":
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    c = shape[1]
    w = (1 + 0.5 * torch.randn(c, generator=g)).to(DEVICE, dtype)
    b = (0.5 * torch.randn(c, generator=g)).to(DEVICE, dtype)
    dy = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return x, groups, w, b, dy


def _fwd_bwd(x, groups, w, b, dy, activation="silu"):
    y, mean, rstd = gn.group_norm_fwd(x, groups, w, b, 1e-5, activation, x.dtype)
    dx, dw, db = gn.group_norm_bwd(dy, x, groups, w, b, mean, rstd, activation)
    return y, mean, rstd, dx, dw, db


def test_default_without_tuning_is_the_former_fixed_plan(fresh, launches, cache_dir, monkeypatch):
    """TRIFUSE_AUTOTUNE=0: entry 0, nothing timed, and the launches the kernels ran before they
    were tuned (blocks of 1024, chunks of 4 blocks at least, 4 programs an SM wanted, 4 warps):
    two rows of 8192 on the interpreter's 4 SMs are cut in 2 chunks of 4096; the backward's 4
    planes of 4096 take one chunk each."""
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    _fwd_bwd(*_inputs((1, 4, 64, 64), 2))
    got = [(name, grid, meta["BLOCK"], meta["num_warps"]) for name, grid, meta in launches]
    assert got == [("stats", (4,), 1024, 4), ("fwd", (4,), 1024, 4), ("bwd_sums", (4,), 1024, 4),
                   ("bwd_dx", (4,), 1024, 4)]
    assert {d.source for d in records(kind="kernel")} == {"default (TRIFUSE_AUTOTUNE=0)"}


def test_narrow_rows_take_fewer_warps(fresh, launches, cache_dir, monkeypatch):
    """A row narrower than the block shrinks the block to the row and its warps to keep 4 values
    a thread: 3 channels x 21 positions = 63 values a row run in blocks of 64 with one warp."""
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    _fwd_bwd(*_inputs((2, 6, 3, 7), 2))
    forward = {(name, meta["BLOCK"], meta["num_warps"]) for name, _, meta in launches
               if name in ("stats", "fwd")}
    assert forward == {("stats", 64, 1), ("fwd", 64, 1)}


def _block(meta: dict) -> int:
    """Values a loop step: BLOCK, or channels-last's sums' (positions x channels) tile."""
    return meta["BLOCK"] if "BLOCK" in meta else meta["BS"] * meta["CB"]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_every_config_computes_the_same(activation, layout, fresh, cache_dir, launches):
    """Each config forced in turn on rows of 12000 values (several blocks and chunks at every
    config): outputs, statistics and gradients equal the default's up to rounding (the sums are
    taken in another order), and each launch runs the config's block."""
    inputs = _inputs((2, 8, 40, 75), 2, seed=1, layout=layout)
    default = None
    for cfg in configs.group_norm():
        for tuner in fresh:
            tuner.config = lambda key, launch, *args, _cfg=cfg: _cfg  # forced, undecided: not stored
        launches.clear()
        got = _fwd_bwd(*inputs, activation=activation)
        assert {_block(meta) for _, _, meta in launches} == {cfg.kwargs["BLOCK"]}, config_label(cfg)
        if default is None:
            default = got
            continue
        for name, a, ref in zip(("y", "mean", "rstd", "dx", "dw", "db"), got, default):
            torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5, msg=f"{name}: {config_label(cfg)}")
    assert not gn._LAUNCHES, "forced, undecided configs are not stored"


WIN = "BLOCK=2048,WAVES=8,MIN_BLOCKS=4,warps=4,stages=3"


def test_tuned_once_per_key_then_replayed(fresh, launches, cache_dir, timer):
    fwd_tuner, bwd_tuner = fresh
    fwd_tuner.timer = bwd_tuner.timer = timer({WIN: 0.1})
    inputs = _inputs((2, 4, 30, 50), 2)
    _fwd_bwd(*inputs)
    labels = [config_label(c) for c in configs.group_norm()]
    assert WIN in labels
    assert fwd_tuner.timer.calls == labels * 2, "forward and backward"
    launches.clear()
    _fwd_bwd(*inputs)
    assert len(fwd_tuner.timer.calls) == 2 * len(labels), "nothing timed again"
    replayed = [(name, grid, meta["BLOCK"]) for name, grid, meta in launches]
    assert [(name, block) for name, _, block in replayed] == [(name, 2048) for name in list(KERNELS)[:4]]
    launches.clear()
    _fwd_bwd(*inputs)
    assert [(name, grid, meta["BLOCK"]) for name, grid, meta in launches] == replayed
    assert len(gn._LAUNCHES) == 2
    buckets = {d.name: d.bucket for d in records(kind="kernel") if d.name.startswith("group_norm")}
    assert buckets == {
        "group_norm_fwd": "dtype=float32,out_dtype=float32,rows=4,width=4096,silu=True,channels_last=False",
        "group_norm_bwd": "dtype=float32,rows=4,width=4096,plane=2048,silu=True,dx=True,channels_last=False"}
    assert {d.chosen for d in records(kind="kernel") if d.name.startswith("group_norm")} == {WIN}


def test_rows_that_fit_one_program_take_no_tuning(fresh, launches, cache_dir, timer, monkeypatch):
    """Rows whose (channels x positions) tile fits _ROW_MAX run one program a row, one launch each
    way, with nothing to tune: 4 channels x 32 positions (3 x 21 padded) at 128 values, one warp."""
    monkeypatch.setattr(gn, "_ROW_MAX", 4096)
    fwd_tuner, bwd_tuner = fresh
    fwd_tuner.timer = bwd_tuner.timer = timer({})
    _fwd_bwd(*_inputs((2, 6, 3, 7), 2))
    assert [(name, grid, meta["CB"], meta["SB"], meta["num_warps"]) for name, grid, meta in launches] \
        == [("row_fwd", (4,), 4, 32, 1), ("row_bwd", (4,), 4, 32, 1)]
    assert not fwd_tuner.timer.calls and not records(kind="kernel")
    assert len(gn._LAUNCHES) == 2


def test_an_empty_input_decides_nothing(fresh, launches, cache_dir, timer):
    fwd_tuner, bwd_tuner = fresh
    fwd_tuner.timer = bwd_tuner.timer = timer({})
    _fwd_bwd(*_inputs((0, 4, 5), 2))
    assert not launches and not fwd_tuner.timer.calls and not gn._LAUNCHES


@pytest.mark.gpu
def test_gpu_tuning_measures_replays_and_matches_the_default(fresh, cache_dir, monkeypatch):
    """On the GPU with do_bench (every config compiled natively): the forward and the backward
    are measured once, later calls replay the winner bitwise, and the winner's outputs are the
    default config's within the rounding of another order of sums (bf16: a few ulps of y)."""
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t
              for t in _inputs((4, 64, 48, 40), 32, seed=3, dtype=torch.bfloat16)]
    default = _fwd_bwd(*inputs)
    monkeypatch.delenv("TRIFUSE_AUTOTUNE")
    for tuner in fresh:
        tuner.clear()
    gn._LAUNCHES.clear()
    tuned = [_fwd_bwd(*inputs) for _ in range(2)]
    sources = {d.name: d.source for d in records(kind="kernel") if d.name.startswith("group_norm")}
    assert sources == {"group_norm_fwd": "measured", "group_norm_bwd": "measured"}
    for name, a, b, ref in zip(("y", "mean", "rstd", "dx", "dw", "db"), *tuned, default):
        assert torch.equal(a, b), f"{name} differs between two tuned runs"
        torch.testing.assert_close(a.float(), ref.float(), rtol=2e-2, atol=2e-2, msg=name)


def test_channels_last_is_tuned_apart(fresh, launches, cache_dir, timer):
    """The same shape channels-last is its own key each way (its kernels read another order), and
    its backward sums run the channels-last kernel."""
    fwd_tuner, bwd_tuner = fresh
    fwd_tuner.timer = bwd_tuner.timer = timer({WIN: 0.1})
    _fwd_bwd(*_inputs((2, 4, 30, 50), 2))
    _fwd_bwd(*_inputs((2, 4, 30, 50), 2, layout="channels_last"))
    buckets = [d.bucket for d in records(kind="kernel") if d.name.startswith("group_norm")]
    assert sorted(b.endswith("channels_last=True") for b in buckets) == [False, False, True, True]
    assert [name for name, _, _ in launches].count("bwd_sums_cl") >= 1
