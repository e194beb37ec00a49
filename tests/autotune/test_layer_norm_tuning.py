"""LayerNorm / RMSNorm launch configurations go through trifuse's tuner (autotune/configs.py:
norm_fwd, norm_bwd): decided once per tuning key, replayed from a launch plan per exact call,
recorded for trifuse.report, and the same numbers (dweight bitwise repeatable) whichever config
won. On CPU a fake timer stands in for do_bench, so the interpreter runs every timed config."""
import pytest
import torch
import triton
from tolerances import assert_close

from _device import DEVICE, configs_run_here
from trifuse.autotune import Tuner, configs, records
from trifuse.autotune.tuner import DeviceLimits, config_label
from trifuse.kernels import layer_norm as ln

M, N = 300, 32  # several programs in the backward, and more row blocks than the interpreter's 4 SMs x 2


@pytest.fixture
def fresh(monkeypatch):
    """New tuners (nothing decided) and empty launch plans, restored afterwards."""
    fwd = Tuner("layer_norm_fwd", configs.norm_fwd, ln._FWD_KEY_NAMES, prune=configs.prune_norm_fwd)
    bwd = Tuner("layer_norm_bwd", configs.norm_bwd, ln._BWD_KEY_NAMES, prune=configs.prune_norm_bwd)
    monkeypatch.setattr(ln, "_FWD_TUNER", fwd)
    monkeypatch.setattr(ln, "_BWD_TUNER", bwd)
    monkeypatch.setattr(ln, "_FWD_PLANS", {})
    monkeypatch.setattr(ln, "_BWD_PLANS", {})
    return fwd, bwd


@pytest.fixture
def launches(record_launches):
    """Every launch of the two norm kernels, as (kernel, grid, launch keywords); they still run."""
    return record_launches({name: getattr(ln, name) for name in ("_layer_norm_fwd", "_layer_norm_bwd")})


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r, dy = (torch.randn(M, N, generator=g).to(DEVICE) for _ in range(3))
    w, b = (torch.randn(N, generator=g).to(DEVICE) for _ in range(2))
    return x, r, w, b, dy


def _fwd_bwd(x, r, w, b, dy, is_rms_norm=False):
    """The fused residual form forward and backward through the launchers."""
    y, s, mean, rstd = ln.layer_norm_fwd(x, N, w, None if is_rms_norm else b, 1e-5, is_rms_norm=is_rms_norm,
                                         residual=r, store_s=True)
    grads = ln.layer_norm_bwd(dy, s, N, w, mean, rstd, is_rms_norm=is_rms_norm, ds=dy)
    return (y, s, *grads)


def _labels(space, prune):
    return [config_label(c) for c in space if prune(c, DeviceLimits(), N) is not None]


# Configs that win under the fake timer: not the defaults, and with more backward programs than
# the default (a different partial-sum split: the reduction order changes).
FWD_WIN = "TILE=2048,warps=4,stages=3"
BWD_WIN = "TILE=2048,PROGRAMS_PER_SM=4,warps=4,stages=3"


def test_defaults_without_tuning_launch_the_former_fixed_configuration(fresh, launches, cache_dir, monkeypatch):
    """TRIFUSE_AUTOTUNE=0: entry 0 of each space, nothing timed; the launches are exactly what
    the launcher ran before it was tuned (BLOCK_M = 8192 // 32 with 8 warps forward; 4096 // 32
    rows with 8 warps and min(rows, 2 x SMs) programs backward)."""
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    _fwd_bwd(*_inputs())
    (_, fgrid, fmeta), (_, bgrid, bmeta) = launches
    assert (fgrid, fmeta["BLOCK_M"], fmeta["num_warps"]) == ((2,), 256, 8)
    assert (bgrid, bmeta["BLOCK_M"], bmeta["num_warps"]) == ((3,), 128, 8)
    for d in records(kind="kernel"):
        assert d.source == "default (TRIFUSE_AUTOTUNE=0)" and not d.times_ms
    assert {d.name for d in records(kind="kernel")} == {"layer_norm_fwd", "layer_norm_bwd"}


def test_tuned_once_per_key_then_replayed_from_plans(fresh, launches, cache_dir, timer):
    fwd, bwd = fresh
    fwd.timer, bwd.timer = timer({FWD_WIN: 0.1}), timer({BWD_WIN: 0.1})
    asked = {"fwd": 0, "bwd": 0}
    for kind, tuner in (("fwd", fwd), ("bwd", bwd)):
        real = tuner.config

        def counting(key, launch, *args, _real=real, _kind=kind):
            asked[_kind] += 1
            return _real(key, launch, *args)
        tuner.config = counting
    x, r, w, b, dy = _inputs()
    _fwd_bwd(x, r, w, b, dy)
    timed = (len(fwd.timer.calls), len(bwd.timer.calls))
    assert timed == (len(configs.norm_fwd(N)) - len(_labels(configs.norm_fwd(N), configs.prune_norm_fwd)),
                     len(configs.norm_bwd(N)) - len(_labels(configs.norm_bwd(N), configs.prune_norm_bwd)))
    # The first call's own launches: the last of each kernel (after the timed ones).
    first = [[c for c in launches if c[0] == name][-1] for name in ("_layer_norm_fwd", "_layer_norm_bwd")]
    launches.clear()
    for _ in range(3):
        _fwd_bwd(x, r, w, b, dy)
    assert asked == {"fwd": 1, "bwd": 1}, "a repeated call is a plan lookup, not a tuner call"
    assert launches == first * 3, "later calls replay the winner's plan"
    (_, fgrid, fmeta), (_, bgrid, bmeta) = first
    assert (fgrid, fmeta["BLOCK_M"], fmeta["num_warps"]) == ((cdiv(M, 64),), 64, 4)
    assert (bmeta["BLOCK_M"], bmeta["num_warps"]) == (64, 4) and bgrid == (cdiv(M, 64),)
    assert len(ln._FWD_PLANS) == 1 and len(ln._BWD_PLANS) == 1
    # Another row count in the same bucket: its own plan, the tuner's memo, nothing timed again.
    _fwd_bwd(*(t[: M - 20] if t.dim() == 2 else t for t in (x, r, w, b, dy)))
    assert asked == {"fwd": 2, "bwd": 2} and (len(fwd.timer.calls), len(bwd.timer.calls)) == timed
    assert len(ln._FWD_PLANS) == 2 and len(ln._BWD_PLANS) == 2
    chosen = {d.name: (d.chosen, d.source) for d in records(kind="kernel")}
    assert chosen == {"layer_norm_fwd": (FWD_WIN, "measured"), "layer_norm_bwd": (BWD_WIN, "measured")}


def test_pruned_configs_are_never_launched(fresh, launches, cache_dir, timer):
    fwd, bwd = fresh
    fwd.timer, bwd.timer = timer({}), timer({})
    _fwd_bwd(*_inputs())
    pruned = {"fwd": _labels(configs.norm_fwd(N), configs.prune_norm_fwd),
              "bwd": _labels(configs.norm_bwd(N), configs.prune_norm_bwd)}
    assert pruned["fwd"] and pruned["bwd"], "the spaces hold register-hungry configs at this width"
    assert not set(pruned["fwd"]) & set(fwd.timer.calls) and not set(pruned["bwd"]) & set(bwd.timer.calls)
    # (BLOCK_M, warps) of each pruned config: no launch used them (none of them shares its
    # geometry with a fitting one at this width).
    bad = {"_layer_norm_fwd": {(c.kwargs["TILE"] // N, c.num_warps) for c in configs.norm_fwd(N)
                               if config_label(c) in pruned["fwd"]},
           "_layer_norm_bwd": {(c.kwargs["TILE"] // N, c.num_warps) for c in configs.norm_bwd(N)
                               if config_label(c) in pruned["bwd"]}}
    assert all((meta["BLOCK_M"], meta["num_warps"]) not in bad[name] for name, _, meta in launches)
    for d in records(kind="kernel"):
        assert set(d.rejected) == set(pruned["fwd" if d.name == "layer_norm_fwd" else "bwd"])


@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
def test_a_tuned_config_matches_the_default_and_is_deterministic(fresh, cache_dir, timer, monkeypatch,
                                                                  is_rms_norm):
    """The winner (more backward programs than the default: another partial-sum split) gives the
    default's outputs within tolerance, and the same bits on every run."""
    inputs = _inputs(1)
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    default = _fwd_bwd(*inputs, is_rms_norm=is_rms_norm)
    monkeypatch.delenv("TRIFUSE_AUTOTUNE")
    fwd, bwd = fresh
    fwd.clear()
    bwd.clear()
    ln._FWD_PLANS.clear()
    ln._BWD_PLANS.clear()
    fwd.timer, bwd.timer = timer({FWD_WIN: 0.1}), timer({BWD_WIN: 0.1})
    runs = [_fwd_bwd(*inputs, is_rms_norm=is_rms_norm) for _ in range(2)]
    assert [d.chosen for d in records(kind="kernel") if d.source == "measured"] == [FWD_WIN, BWD_WIN]
    plan = next(iter(ln._BWD_PLANS.values()))
    assert plan[2] == cdiv(M, 64) > 3, "the winner splits the rows over more programs than the default"
    # The oracle: the same kernels in float64; the tuned config's error may be at most the
    # tolerance rule's multiple of the default config's.
    oracle = _fwd_bwd(*(t.double() for t in inputs), is_rms_norm=is_rms_norm)
    names = ("y", "s", "dx", "dresidual", "dweight", "dbias", "dx_bias")
    for name, a, b, ref, ref64 in zip(names, *runs, default, oracle):
        assert torch.equal(a, b), f"{name} differs between runs of one config"
        assert_close(name, a, ref64, ref)


def test_tuning_decisions_show_in_the_report(fresh, cache_dir):
    """The launch decisions are in `trifuse.report`'s table (they are process records)."""
    import trifuse
    from trifuse.autotune import format_table

    x = torch.randn(4, 8, 16, device=DEVICE, requires_grad=True)
    trifuse.ops.rms_norm(x, 16, torch.ones(16, device=DEVICE, requires_grad=True)).sum().backward()
    table = format_table(records(kind="kernel"))
    assert "layer_norm_fwd" in table and "layer_norm_bwd" in table
    assert "rms=True" in table and "rows=32" in table and "n=16" in table


def test_the_table_lists_two_rejections_a_row_and_counts_the_rest():
    from trifuse.autotune import Decision, format_table

    rejected = {f"TILE={t}": f"~{t // 16} fp32 values per thread would spill registers"
                for t in (2048, 4096, 8192, 16384)}
    decision = Decision(kind="kernel", name="layer_norm_fwd", bucket="n=32", device="cpu", chosen="TILE=1024",
                        source="default", times_ms={}, rejected=rejected)
    header, rule, row = format_table([decision]).splitlines()
    assert "TILE=2048: ~128" in row and "TILE=4096: ~256" in row and "TILE=8192" not in row
    assert row.endswith("+2 more (trifuse.autotune.records())")
    assert rule.endswith(" " + "-" * len("rejected")) and len(rule) < len(row)
    assert "TILE=16384" in format_table([decision], max_rejected=4)


def cdiv(a, b):
    return triton.cdiv(a, b)


@pytest.mark.gpu
def test_gpu_tuning_times_fitting_configs_and_replays(fresh, cache_dir, launches):
    """On the GPU with do_bench: the tuner measures (and caches) one winner per kernel; the
    next calls replay its plan, dweight bitwise repeatable, close to the untuned default."""
    x, r, w, b, dy = (t.cuda().to(torch.bfloat16) for t in _inputs(2))
    runs = [_fwd_bwd(x, r, w, b, dy) for _ in range(3)]
    sources = {d.name: d.source for d in records(kind="kernel")}
    assert sources == {"layer_norm_fwd": "measured", "layer_norm_bwd": "measured"}
    assert len(ln._FWD_PLANS) == 1 and len(ln._BWD_PLANS) == 1
    assert launches[-2:] == launches[-4:-2]
    for a, b_ in zip(runs[1], runs[2]):
        assert a is None or torch.equal(a, b_)


@pytest.mark.gpu
def test_gpu_tuning_compiles_the_configs_in_parallel_first(fresh, cache_dir, monkeypatch):
    """On the GPU the tuner hands every fitting config to `precompile` (Triton's AsyncCompileMode
    on a thread pool) before timing: it must really run there (where this Triton has the mode),
    and the tuned launches must still compute the norm."""
    from trifuse.kernels import _launch

    ran, precompile = [], _launch.precompile
    monkeypatch.setattr(_launch, "precompile", lambda calls: ran.append(precompile(calls)))
    x, r, w, b, dy = (t.cuda().to(torch.bfloat16) for t in _inputs(3))
    y, s, *_ = _fwd_bwd(x, r, w, b, dy)
    assert len(ran) == 2 and all(done == (_launch.AsyncCompileMode is not None) for done in ran)
    ref = torch.nn.functional.layer_norm((x + r).float(), (N,), w.float(), b.float(), 1e-5)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=3e-2)


def test_deterministic_algorithms_take_the_default_backward(fresh, launches, cache_dir, timer):
    """Under torch.use_deterministic_algorithms the backward never takes a tuned config: its
    partial-sum split (the order dweight is summed in) is the same in every process."""
    fwd, bwd = fresh
    fwd.timer, bwd.timer = timer({FWD_WIN: 0.1}), timer({BWD_WIN: 0.1})
    default = configs.norm_bwd(N)[0]
    torch.use_deterministic_algorithms(True)
    try:
        _fwd_bwd(*_inputs())
    finally:
        torch.use_deterministic_algorithms(False)
    assert not bwd.timer.calls
    (_, _, bmeta), = [c for c in launches if c[0] == "_layer_norm_bwd"]
    assert (bmeta["BLOCK_M"], bmeta["num_warps"]) == (default.kwargs["TILE"] // N, default.num_warps)
    # and outside deterministic mode the same call is tuned, with its own plan
    launches.clear()
    _fwd_bwd(*_inputs())
    assert bwd.timer.calls and len(ln._BWD_PLANS) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
def test_prefetching_backward_configs_compute_the_same(fresh, cache_dir, is_rms_norm, dtype):
    """The backward's PREFETCH configs (the next tile's s and dy loaded before this tile's row
    sums), forced one at a time, over 3000 rows: each program walks several tiles, the last one
    ragged, and the prefetch runs past its range. Every gradient is bitwise what the same config
    without the prefetch gives (a row's arithmetic does not depend on when its tile was loaded,
    and the partial-sum split is the same), and repeatable."""
    m = 3000
    g = torch.Generator().manual_seed(5)
    x, r, dy = (torch.randn(m, N, generator=g).to(DEVICE, dtype) for _ in range(3))
    w, b = (torch.randn(N, generator=g).to(DEVICE) for _ in range(2))
    _, bwd = fresh
    prefetching = [c for c in configs.norm_bwd(N) if c.kwargs.get("PREFETCH")]
    assert prefetching and all(configs.prune_norm_bwd(c, DeviceLimits(), N) is None for c in prefetching[:2])

    def run(cfg):
        bwd.clear()
        ln._BWD_PLANS.clear()
        bwd.config = lambda key, launch, *args: cfg
        y, s, mean, rstd = ln.layer_norm_fwd(x, N, w, None if is_rms_norm else b, 1e-5,
                                             is_rms_norm=is_rms_norm, residual=r, store_s=True)
        return ln.layer_norm_bwd(dy, s, N, w, mean, rstd, is_rms_norm=is_rms_norm, ds=dy,
                                 store_dresidual=True)

    for cfg in prefetching[:2]:
        without = {k: v for k, v in cfg.kwargs.items() if k != "PREFETCH"}
        plain = triton.Config(without, num_warps=cfg.num_warps)
        got, again, want = run(cfg), run(cfg), run(plain)
        plan = next(iter(ln._BWD_PLANS.values()), None)
        for name, a, b_, ref in zip(("dx", "dresidual", "dweight", "dbias", "dx_bias"), got, again, want):
            assert (a is None) == (ref is None)
            if a is not None:
                assert torch.equal(a, b_) and torch.equal(a, ref), f"{name}, {config_label(cfg)}"
    assert plan is None, "a forced, undecided config is not stored"


@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
def test_one_row_backward_configs_compute_what_the_default_does(fresh, cache_dir, launches, is_rms_norm):
    """Rows narrower than the smallest tile also get one-row tiles (a fraction of the default's
    registers): forced one at a time, dx and dresidual are bitwise the default's (a row's
    arithmetic does not depend on its tile), dweight and dbias the same within fp32 rounding (the
    rows are split into other partial sums), and every config is repeatable."""
    _, bwd = fresh
    one_row = [c for c in configs.norm_bwd(N) if c.kwargs["TILE"] == N]
    assert len(one_row) == 6 and {c.kwargs["PROGRAMS_PER_SM"] for c in one_row} == {2, 4, 8}
    inputs = _inputs(4)
    default = _fwd_bwd(*inputs, is_rms_norm=is_rms_norm)
    for cfg in configs_run_here(one_row):
        bwd.clear()
        ln._BWD_PLANS.clear()
        bwd.config = lambda key, launch, *args, _cfg=cfg: _cfg
        runs = [_fwd_bwd(*inputs, is_rms_norm=is_rms_norm) for _ in range(2)]
        _, _, meta = [c for c in launches if c[0] == "_layer_norm_bwd"][-1]
        assert (meta["BLOCK_M"], meta["num_warps"]) == (1, cfg.num_warps)
        names = ("y", "s", "dx", "dresidual", "dweight", "dbias", "dx_bias")
        for name, a, b, ref in zip(names, *runs, default):
            if a is None:
                assert ref is None
                continue
            assert torch.equal(a, b), f"{name} differs between runs of {config_label(cfg)}"
            if name in ("dweight", "dbias", "dx_bias"):
                torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(a, ref), f"{name}: {config_label(cfg)}"
