"""The row-wise kernels (bias + GeLU, dropout + add, gated activations) take their launch
configurations from trifuse's tuner (autotune/configs.py: rowwise_fwd, rowwise_bwd;
kernels/_tiles.py: RowwiseTuning): the defaults are the plans they launched before they were
tuned, a tuned config is decided once per key and replayed from a launch per exact call shape,
and every config of every space computes the same outputs (the interpreter runs each one, the
backward's PREFETCH loop included). On CPU a fake timer stands in for do_bench."""
import pytest
import torch
import triton

from _device import DEVICE, configs_run_here
from trifuse.autotune import DeviceLimits, configs, records
from trifuse.autotune.tuner import config_label
from trifuse.kernels import _tiles
from trifuse.kernels import bias_gelu as bg
from trifuse.kernels import dropout_add as da
from trifuse.kernels import gated_activation as ga

# 1000 rows of 40: a ragged last row tile, and (4 SMs under the interpreter) backward programs
# that walk several row tiles each, so a prefetch crosses tiles and runs past the last one.
M, N = 1000, 40
P = 0.3


@pytest.fixture
def fresh(monkeypatch):
    """New tuners (nothing decided) and no stored launches for the three modules."""
    tunings = {}
    for module in (bg, da, ga):
        for attr in ("_FWD_TUNING", "_BWD_TUNING"):
            old = getattr(module, attr)
            new = _renewed(old)
            monkeypatch.setattr(module, attr, new)
            tunings[old.tuner.name] = new
    return tunings


def _renewed(tuning: _tiles.RowwiseTuning) -> _tiles.RowwiseTuning:
    """A new RowwiseTuning like `tuning` (key names: device, dtype, n, rows, then its variant's)."""
    return _tiles.RowwiseTuning(tuning.tuner.name, tuning.tuner.key_names[4:], summing=tuning.summing)


@pytest.fixture
def launches(record_launches):
    """Every launch of the six kernels, as (kernel, grid, launch keywords); they still run."""
    modules = ((bg, "bias_gelu"), (da, "dropout_add"), (ga, "gated_activation"))
    return record_launches({name: getattr(module, name) for module, op in modules
                            for name in (f"_{op}_fwd", f"_{op}_bwd")})


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r, dy = (torch.randn(M, N, generator=g).to(DEVICE, dtype) for _ in range(3))
    b = torch.randn(N, generator=g).to(DEVICE)
    return x, r, b, dy


def _bias_gelu(x, r, b, dy):
    y = bg.bias_gelu_fwd(x, b, "none")
    return (y, *bg.bias_gelu_bwd(dy, x, b, "none"))


def _dropout_add(x, r, b, dy):
    seed = torch.tensor([1234], dtype=torch.int64, device=x.device)
    y = da.dropout_add_fwd(x, r, b, P, seed)
    return (y, *da.dropout_add_bwd(dy, seed, P, True))


def _gated(x, r, b, dy):
    y = ga.gated_activation_fwd(x, r, "gelu_tanh")
    return (y, *ga.gated_activation_bwd(dy, x, r, "gelu_tanh"))


OPS = {"bias_gelu": _bias_gelu, "dropout_add": _dropout_add, "gated_activation": _gated}


def test_defaults_without_tuning_launch_the_former_fixed_plans(fresh, launches, cache_dir, monkeypatch):
    """TRIFUSE_AUTOTUNE=0: entry 0 of each space, nothing timed, and the launches are what the
    launchers ran before they were tuned: forward tiles of 4096 elements (64 x 64 here: 40
    columns take a 64-wide block) with 8 warps, one per program; the summing backward 2048-element
    tiles (32 x 64) with 4 warps, min(4 x SMs, row tiles) = 16 programs of 64 rows, no prefetch."""
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    for op in OPS.values():
        op(*_inputs())
    got = {name: (grid, meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"], meta.get("PREFETCH"))
           for name, grid, meta in launches}
    forward = ((16,), 64, 64, 8, None)
    assert got == {"_bias_gelu_fwd": forward, "_dropout_add_fwd": forward, "_gated_activation_fwd": forward,
                   "_gated_activation_bwd": forward,
                   "_bias_gelu_bwd": ((16,), 32, 64, 4, False), "_dropout_add_bwd": ((16,), 32, 64, 4, False)}
    decided = {d.name: d.source for d in records(kind="kernel")}
    assert set(decided) == set(fresh) and set(decided.values()) == {"default (TRIFUSE_AUTOTUNE=0)"}


def _spaces(tuning: _tiles.RowwiseTuning, bias: bool) -> list[triton.Config]:
    return configs_run_here(configs.rowwise_bwd(bias) if tuning.summing else configs.rowwise_fwd())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_every_config_computes_the_same(op, dtype, fresh, cache_dir):
    """Each config of each space, forced to win in turn: y and the input gradients bitwise the
    default's (an element's arithmetic does not depend on the tile), dbias within fp32 rounding
    of it (another split of the rows into partial sums) and bitwise the same on a second run."""
    inputs = _inputs(dtype)
    fwd_name, bwd_name = f"{op}_fwd", f"{op}_bwd"
    fwd_space, bwd_space = _spaces(fresh[fwd_name], True), _spaces(fresh[bwd_name], True)
    default = None
    for i in range(max(len(fwd_space), len(bwd_space))):
        fwd_cfg, bwd_cfg = fwd_space[min(i, len(fwd_space) - 1)], bwd_space[min(i, len(bwd_space) - 1)]
        for name, cfg in ((fwd_name, fwd_cfg), (bwd_name, bwd_cfg)):
            tuning = _renewed(fresh[name])
            # this config, undecided: not stored
            tuning.tuner.config = lambda key, launch, *args, _cfg=cfg: _cfg
            setattr(OPS_MODULES[op], "_FWD_TUNING" if name.endswith("_fwd") else "_BWD_TUNING", tuning)
        runs = [OPS[op](*inputs) for _ in range(2)]
        for a, b in zip(*runs):
            assert torch.equal(a, b), f"{op}: config {i} differs between two runs"
        if default is None:
            default = runs[0]
            continue
        for k, (a, ref) in enumerate(zip(runs[0], default)):
            if op != "gated_activation" and k == 2:  # dbias: fp32 sums in another order
                torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-4 * M ** 0.5)
            else:
                labels = f"{config_label(fwd_cfg)} / {config_label(bwd_cfg)}"
                assert torch.equal(a, ref), f"{op} output {k}: {labels}"


OPS_MODULES = {"bias_gelu": bg, "dropout_add": da, "gated_activation": ga}

# A summing backward config that wins under the fake timer: not the default, with a prefetch and
# half the programs of 8 warps (another partial-sum split).
BWD_WIN = "TILE=2048,PROGRAMS_PER_SM=2,PREFETCH=True,warps=8,stages=3"
FWD_WIN = "TILE=8192,warps=16,stages=3"


def test_tuned_once_per_key_then_replayed(fresh, launches, cache_dir, timer):
    fwd, bwd = fresh["bias_gelu_fwd"], fresh["bias_gelu_bwd"]
    fwd.tuner.timer, bwd.tuner.timer = timer({FWD_WIN: 0.1}), timer({BWD_WIN: 0.1})
    asked = []
    for tuning in (fwd, bwd):
        real = tuning.tuner.config

        def counting(key, launch, *args, _real=real, _name=tuning.tuner.name):
            asked.append(_name)
            return _real(key, launch, *args)
        tuning.tuner.config = counting
    inputs = _inputs()
    _bias_gelu(*inputs)
    assert fwd.tuner.timer.calls == [config_label(c) for c in configs.rowwise_fwd()]
    assert bwd.tuner.timer.calls == [config_label(c) for c in configs.rowwise_bwd(True)]
    first = [[c for c in launches if c[0] == name][-1] for name in ("_bias_gelu_fwd", "_bias_gelu_bwd")]
    launches.clear()
    for _ in range(3):
        _bias_gelu(*inputs)
    assert asked == ["bias_gelu_fwd", "bias_gelu_bwd"], "a repeated call is a lookup, not a tuner call"
    assert launches == first * 3, "later calls replay the winner's launch"
    (_, fgrid, fmeta), (_, bgrid, bmeta) = first
    # 8192-element tiles: 128 rows of 64 columns with 16 warps; the backward's 32 x 64 tiles with
    # 8 warps, min(2 x 4 SMs, 32 row tiles) = 8 programs of 128 rows, prefetching.
    assert (fgrid, fmeta["BLOCK_M"], fmeta["num_warps"]) == ((8,), 128, 16)
    assert (bgrid, bmeta["BLOCK_M"], bmeta["num_warps"], bmeta["PREFETCH"]) == ((8,), 32, 8, True)
    # Another row count in the same bucket: its own launch, the tuner's memo, nothing timed again.
    _bias_gelu(*(t[: M - 20] if t.dim() == 2 else t for t in inputs))
    assert asked == ["bias_gelu_fwd", "bias_gelu_bwd"] * 2
    assert len(fwd.tuner.timer.calls) == len(configs.rowwise_fwd())
    assert len(fwd.launches) == len(bwd.launches) == 2
    chosen = {d.name: (d.chosen, d.source) for d in records(kind="kernel")}
    assert chosen == {"bias_gelu_fwd": (FWD_WIN, "measured"), "bias_gelu_bwd": (BWD_WIN, "measured")}


def test_without_a_bias_the_backward_takes_one_tile_per_program(fresh, launches, cache_dir, timer):
    """Nothing to sum: the one-tile space (no programs-per-SM or prefetch choice), one program a
    tile, and the tuning key says bias=False."""
    bwd = fresh["bias_gelu_bwd"]
    bwd.tuner.timer = timer({})
    x, r, b, dy = _inputs()
    dx, dbias = bg.bias_gelu_bwd(dy, x, None, "tanh")
    assert dbias.numel() == 0
    assert bwd.tuner.timer.calls == [config_label(c) for c in configs.rowwise_bwd(False)]
    (_, grid, meta), = [c for c in launches if c[0] == "_bias_gelu_bwd"][-1:]
    assert grid == (triton.cdiv(M, meta["BLOCK_M"]),) and meta["PREFETCH"] is False
    assert "bias=False" in next(d.bucket for d in records(kind="kernel") if d.name == "bias_gelu_bwd")


def test_deterministic_algorithms_take_the_default_backward(fresh, launches, cache_dir, timer):
    """Under torch.use_deterministic_algorithms a summing backward never takes a tuned config:
    its partial-sum split (the order dbias is summed in) is the same in every process. The
    forward passes (no sums) are still tuned."""
    for tuning in fresh.values():
        tuning.tuner.timer = timer({BWD_WIN: 0.1, FWD_WIN: 0.1})
    torch.use_deterministic_algorithms(True)
    try:
        _bias_gelu(*_inputs())
        _dropout_add(*_inputs())
    finally:
        torch.use_deterministic_algorithms(False)
    assert not fresh["bias_gelu_bwd"].tuner.timer.calls and not fresh["dropout_add_bwd"].tuner.timer.calls
    assert fresh["bias_gelu_fwd"].tuner.timer.calls
    for name in ("_bias_gelu_bwd", "_dropout_add_bwd"):
        (_, _, meta), = [c for c in launches if c[0] == name]
        assert (meta["BLOCK_M"], meta["num_warps"], meta["PREFETCH"]) == (32, 4, False)
    # and outside deterministic mode the same call is tuned, with a launch of its own
    _bias_gelu(*_inputs())
    assert fresh["bias_gelu_bwd"].tuner.timer.calls and len(fresh["bias_gelu_bwd"].launches) == 2


def test_pruning_keeps_the_summing_programs_resident():
    """Every config of the spaces fits an H100's register file by the estimate (the space was
    chosen so); on an SM with three quarters of it the configs with the most programs or
    prefetched tiles per SM go, and the one-tile space is never pruned."""
    h100 = DeviceLimits()
    assert all(configs.prune_rowwise_bwd(c, h100, bias=True) is None for c in configs.rowwise_bwd(True))
    smaller = DeviceLimits(registers_per_sm=49152)
    pruned = {config_label(c): configs.prune_rowwise_bwd(c, smaller, bias=True)
              for c in configs.rowwise_bwd(True)}
    kept = [label for label, why in pruned.items() if why is None]
    assert kept == ["TILE=2048,PROGRAMS_PER_SM=4,PREFETCH=False,warps=4,stages=3",
                    "TILE=2048,PROGRAMS_PER_SM=2,PREFETCH=True,warps=8,stages=3"]
    why = pruned["TILE=2048,PROGRAMS_PER_SM=4,PREFETCH=True,warps=4,stages=3"]
    assert "4 programs of 4 warps at ~120 registers a thread would not all be resident" in why
    assert all(configs.prune_rowwise_bwd(c, smaller, bias=False) is None for c in configs.rowwise_bwd(False))


def test_tuning_decisions_show_in_the_report(fresh, cache_dir):
    """The launch decisions are in trifuse.report's table (process records), per op and variant."""
    from trifuse.autotune import format_table
    import trifuse

    x = torch.randn(3, 5, 24, device=DEVICE, requires_grad=True)
    b = torch.randn(24, device=DEVICE, requires_grad=True)
    trifuse.ops.bias_gelu(x, b, approximate="tanh").sum().backward()
    table = format_table(records(kind="kernel"))
    assert "bias_gelu_fwd" in table and "bias_gelu_bwd" in table
    assert "form=tanh" in table and "rows=16" in table and "n=24" in table and "bias=True" in table


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(OPS))
def test_gpu_tuning_measures_replays_and_matches_the_default(op, fresh, cache_dir, monkeypatch):
    """On the GPU with do_bench (and every config compiled natively, the prefetching loops
    included): each kernel is measured once, later calls replay the winner, and the winner's
    outputs are the default config's (dbias within fp32 rounding: another split of the rows)."""
    inputs = [t.cuda() for t in _inputs(torch.bfloat16, seed=3)]
    inputs = [t.repeat(8, 1) if t.dim() == 2 else t for t in inputs]  # 8000 rows: several per program
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    default = OPS[op](*inputs)
    monkeypatch.delenv("TRIFUSE_AUTOTUNE")
    for tuning in fresh.values():
        tuning.tuner.clear()
        tuning.launches.clear()
    tuned = [OPS[op](*inputs) for _ in range(2)]
    sources = {d.name: d.source for d in records(kind="kernel") if d.name.startswith(op)}
    assert sources == {f"{op}_fwd": "measured", f"{op}_bwd": "measured"}
    for k, (a, b, ref) in enumerate(zip(*tuned, default)):
        assert torch.equal(a, b), f"{op} output {k} differs between two tuned runs"
        if op != "gated_activation" and k == 2:
            torch.testing.assert_close(a, ref, rtol=1e-4, atol=1e-2)
        else:
            assert torch.equal(a, ref), f"{op} output {k}: the tuned config's differs from the default's"
