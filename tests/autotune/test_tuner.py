"""Kernel configuration tuning with a fake timer: the fastest config wins, is cached on disk and
replayed without timing; pruning, failing configs, TRIFUSE_AUTOTUNE=0, shipped defaults; and the
config spaces' contracts (entry 0 is the default, pruning rules give reasons)."""
import json
import logging

import pytest
import torch
import triton

import trifuse
from trifuse.autotune import DeviceLimits, Tuner, cache, configs, records
from trifuse.autotune.tuner import config_label, config_to_json

SPACE = [triton.Config({"BLOCK": 64}, num_warps=4), triton.Config({"BLOCK": 128}, num_warps=4),
         triton.Config({"BLOCK": 256}, num_warps=8)]
LABELS = [config_label(c) for c in SPACE]


def space(n):
    return SPACE


def launch(config, out):
    out.append(config.kwargs["BLOCK"])


def make_tuner(timer, prune=None):
    t = Tuner("toy", space, key_names=("device", "n", "dtype"), prune=prune)
    t.timer = timer
    return t


KEY = (-1, 1024, torch.float16)


def test_fastest_config_wins_and_is_replayed_without_timing(cache_dir, timer):
    fake = timer({LABELS[0]: 3.0, LABELS[1]: 1.0, LABELS[2]: 2.0})
    t, launched = make_tuner(fake), []
    assert t.config(KEY, launch, launched) is SPACE[1]
    assert fake.calls == LABELS and launched == [64, 128, 256]
    assert t.config(KEY, launch, launched) is SPACE[1]
    assert fake.calls == LABELS, "a decided key is a dict hit"
    (d,) = records(name="toy")
    assert d.source == "measured" and d.chosen == LABELS[1] and d.bucket == "n=1024,dtype=float16"
    assert d.times_ms[LABELS[0]] == 3.0
    assert t.decision(KEY) == d and t.decision((-1, 2048, torch.float16)) is None


def test_on_the_gpus_own_timer_every_config_is_precompiled_before_timing(cache_dir, timer, monkeypatch):
    """With the GPU's timer (no explicit one), the tuner hands every fitting config's launch to
    `precompile` (parallel compiles) before it times them one by one; explicit timers (tests,
    fakes) get no precompile."""
    from trifuse.autotune import tuner as tuner_mod
    from trifuse.kernels import _launch

    fake, order = timer({}), []

    def precompile(calls):
        for call in calls:
            call()
        order.append("precompiled")

    monkeypatch.setattr(_launch, "precompile", precompile)
    monkeypatch.setattr(tuner_mod, "timer_for", lambda device, explicit: (fake, ""))
    t, launched = Tuner("toy", space, key_names=("device", "n", "dtype")), []
    t.config(KEY, launch, launched)
    assert order == ["precompiled"] and launched[:3] == [64, 128, 256], "all configs, before any timing"
    assert fake.calls == LABELS
    t2, launched2 = make_tuner(timer({})), []
    t2.config((-1, 4096, torch.float16), launch, launched2)
    assert order == ["precompiled"] and launched2 == [64, 128, 256], "an explicit timer: no precompile"


def test_inside_a_precompile_pass_an_undecided_key_compiles_every_config_and_decides_nothing(cache_dir, timer):
    """What a dialect's compile-first pass relies on: the tuner hands every fitting config's
    launch to the compile pool (here: launch records it) and returns the default, with nothing
    timed, remembered, recorded or written; the next real call tunes as usual."""
    from trifuse.autotune.tuner import PRECOMPILING

    fake, launched = timer({LABELS[1]: 0.1}), []
    t = make_tuner(fake)
    token = PRECOMPILING.set(True)
    try:
        assert t.config(KEY, launch, launched) is SPACE[0]
    finally:
        PRECOMPILING.reset(token)
    assert launched == [64, 128, 256] and fake.calls == []
    assert not t.is_decided(KEY) and not records(name="toy") and not cache_dir.exists()
    assert t.config(KEY, launch, launched) is SPACE[1] and fake.calls == LABELS


def test_a_decisions_backward_passes_run_on_its_own_thread(cache_dir, timer):
    """While a tuner decides (and a dialect: `deciding()`), the backward passes its calls start run
    on the deciding thread: on CUDA autograd would run them on its device thread, where the
    decision's contextvars (a screening, a compile pass, the clock) and Triton's compile mode are
    not set (torch 2.11 on the lent H200, 2026-12-04: a compile pass's backward kernels compiled
    one after another there, and their tuners timed every config). The thread's setting is back
    after."""
    seen = []

    def launch(cfg, launched):
        seen.append(torch._C._is_multithreading_enabled())

    def timing(label, step):
        step()
        return {LABELS[1]: 0.1}.get(label, 1.0)

    t = make_tuner(timing)
    assert torch._C._is_multithreading_enabled()
    assert t.config(KEY, launch, []) is SPACE[1]
    assert seen == [False] * len(SPACE) and torch._C._is_multithreading_enabled()


def test_second_process_with_the_same_shapes_does_no_timing(cache_dir, timer, new_process):
    make_tuner(timer({LABELS[2]: 0.5})).config(KEY, launch, [])
    new_process()
    fake = timer({})
    assert make_tuner(fake).config(KEY, launch, []) is SPACE[2]
    assert fake.calls == []
    assert records(name="toy")[0].source == "disk cache"


def test_other_shapes_and_dtypes_tune_separately(cache_dir, timer):
    fake = timer({})
    t = make_tuner(fake)
    t.config(KEY, launch, [])
    t.config((-1, 1024, torch.float32), launch, [])
    t.config((-1, 4096, torch.float16), launch, [])
    assert len(fake.calls) == 3 * len(SPACE)
    assert len(records(name="toy")) == 3


def test_cached_config_no_longer_in_the_space_is_retuned(cache_dir, timer, new_process):
    make_tuner(timer({LABELS[0]: 0.1})).config(KEY, launch, [])
    path = cache.disk_cache(-1).path
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["config"] = config_to_json(triton.Config({"BLOCK": 32}, num_warps=2))
    path.write_text(json.dumps(data))
    new_process()
    fake = timer({LABELS[2]: 0.1})
    assert make_tuner(fake).config(KEY, launch, []) is SPACE[2]
    assert fake.calls == LABELS


def test_autotune_off_uses_the_default_and_times_nothing(cache_dir, timer, monkeypatch):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    fake = timer({LABELS[1]: 0.1})
    assert make_tuner(fake).config(KEY, launch, []) is SPACE[0]
    assert fake.calls == []
    assert records(name="toy")[0].source == "default (TRIFUSE_AUTOTUNE=0)"
    assert not cache_dir.exists(), "nothing is written when nothing was measured"


def test_without_a_timer_the_interpreter_uses_the_default(cache_dir):
    t = Tuner("toy", space, key_names=("device", "n", "dtype"))
    assert t.config(KEY, launch, []) is SPACE[0]
    assert records(name="toy")[0].source.startswith("default (")


def _untimed_on(device_name, monkeypatch, defaults_dir):
    """TRIFUSE_AUTOTUNE=0 on a GPU named `device_name`, with shipped defaults read from defaults_dir."""
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    env = cache.Environment(device_name, triton.__version__, torch.__version__)
    monkeypatch.setattr("trifuse.autotune.tuner.environment", lambda i: env)
    monkeypatch.setattr(cache, "environment", lambda i: env)
    monkeypatch.setattr(cache, "DEFAULTS_DIR", defaults_dir)


def test_autotune_off_replays_shipped_defaults_for_the_gpu_family(cache_dir, timer, monkeypatch, tmp_path):
    _untimed_on("NVIDIA H100 80GB HBM3", monkeypatch, tmp_path)
    cache.write_defaults(tmp_path / "h100.json", "h100",
                         {"toy|n=1024,dtype=float16": {"config": config_to_json(SPACE[2])}}, "test")
    fake = timer({})
    t = make_tuner(fake)
    assert t.config((0, 1024, torch.float16), launch, []) is SPACE[2]
    assert t.config((0, 2048, torch.float16), launch, []) is SPACE[0], "no shipped entry: the default"
    assert fake.calls == []
    sources = {d.source for d in records(name="toy")}
    assert sources == {"shipped h100 defaults", "default (TRIFUSE_AUTOTUNE=0)"}


def test_the_same_chips_shipped_defaults_serve_where_a_family_has_none(cache_dir, timer, monkeypatch, tmp_path):
    """An H200 (the H100's chip with other memory) replays H100 defaults for shapes its own file
    lacks; its own entries win where both have one."""
    _untimed_on("NVIDIA H200", monkeypatch, tmp_path)
    cache.write_defaults(tmp_path / "h100.json", "h100",
                         {"toy|n=1024,dtype=float16": {"config": config_to_json(SPACE[2])},
                          "toy|n=2048,dtype=float16": {"config": config_to_json(SPACE[2])}}, "test")
    cache.write_defaults(tmp_path / "h200.json", "h200",
                         {"toy|n=2048,dtype=float16": {"config": config_to_json(SPACE[1])}}, "test")
    t = make_tuner(timer({}))
    assert t.config((0, 1024, torch.float16), launch, []) is SPACE[2]
    assert t.config((0, 2048, torch.float16), launch, []) is SPACE[1]
    assert t.config((0, 4096, torch.float16), launch, []) is SPACE[0]
    assert [d.source for d in records(name="toy")] == [
        "shipped h100 defaults", "shipped h200 defaults", "default (TRIFUSE_AUTOTUNE=0)"]


def test_pruned_configs_are_not_timed_and_say_why(cache_dir, timer):
    def prune(config, limits, n):
        return "too big" if config.kwargs["BLOCK"] > 128 else None

    fake = timer({})
    make_tuner(fake, prune).config(KEY, launch, [])
    assert fake.calls == LABELS[:2]
    assert records(name="toy")[0].rejected == {LABELS[2]: "too big"}


def test_when_everything_is_pruned_the_default_is_kept(cache_dir, timer, caplog):
    fake = timer({})
    with caplog.at_level(logging.WARNING, logger="trifuse"):
        assert make_tuner(fake, lambda c, limits: "never fits").config(KEY, launch, []) is SPACE[0]
    assert "every config of toy was pruned" in caplog.text
    assert fake.calls == [], "a single remaining config needs no timing"


def test_a_config_that_fails_to_compile_is_skipped(cache_dir, timer):
    class Failing:
        calls = []

        def __call__(self, label, step):
            self.calls.append(label)
            if label == LABELS[1]:
                raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
            return {LABELS[0]: 2.0, LABELS[2]: 1.0}[label]

    t = make_tuner(Failing())
    assert t.config(KEY, launch, []) is SPACE[2]
    assert "OutOfResources" in records(name="toy")[0].rejected[LABELS[1]]


def test_key_must_name_a_device():
    with pytest.raises(ValueError, match="key_names must include 'device'"):
        Tuner("toy", space, key_names=("n",))


# ---------------------------------------------------------------------------------------------
# Config spaces
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 100, 768, 1024, 2048, 4096, 8192, 16384, 65536])
def test_norm_spaces_start_with_the_launchers_defaults(n):
    """Entry 0 launches what kernels/layer_norm.py launched before it was tuned (so untuned
    runs are bitwise unchanged): forward BLOCK_M = 8192 // BLOCK_N rows with 8 warps; backward
    4096 // BLOCK_N rows, one warp per 512 elements of the tile (4 to 16), 2 programs per SM up
    to 2048-wide row blocks and 1 past that; one row per program past a 16384-element block."""
    from trifuse.kernels import layer_norm as ln

    block_n = min(1 << (n - 1).bit_length(), 16384)
    single = n <= 16384
    fwd, bwd = configs.norm_fwd(n)[0], configs.norm_bwd(n)[0]
    wide_block = block_n if single else configs.NORM_WIDE_CHUNK
    assert ln._row_block(fwd, n, ln.MAX_SINGLE_BLOCK_FWD, configs.NORM_WIDE_CHUNK) == (
        max(1, 8192 // block_n) if single else 1, wide_block, single)
    assert fwd.num_warps == 8
    bwd_rows = max(1, 4096 // block_n) if single else 1
    assert ln._row_block(bwd, n, ln.MAX_SINGLE_BLOCK_BWD, configs.NORM_WIDE_CHUNK) == (bwd_rows, wide_block, single)
    assert bwd.num_warps == min(16, max(4, bwd_rows * block_n // 512))
    assert bwd.kwargs["PROGRAMS_PER_SM"] == (2 if block_n <= 2048 else 1)
    for space_fn, prune in ((configs.norm_fwd, configs.prune_norm_fwd), (configs.norm_bwd, configs.prune_norm_bwd)):
        cs = space_fn(n)
        assert len({config_label(c) for c in cs}) == len(cs), "no duplicates"
        assert configs.prune_rows(cs[0], DeviceLimits(), n) is None
        if n <= 8192:
            assert prune(cs[0], DeviceLimits(), n) is None, "the default is never pruned"
    if n == 16384:
        # A 16384-element row in one block at 16 warps (128 registers a thread) spills 24 bytes
        # in the backward (bench/results/sm90_compile.md): the estimate says so, and the Tuner
        # keeps the default when every config is pruned. Wider rows go in narrower chunks.
        assert "spill registers" in configs.prune_norm_bwd(configs.norm_bwd(n)[0], DeviceLimits(), n)
    elif n > 8192:
        assert configs.prune_norm_bwd(configs.norm_bwd(n)[0], DeviceLimits(), n) is None


def test_norm_pruning_drops_register_hungry_tiles():
    few_warps = triton.Config({"TILE": 16384}, num_warps=4)
    assert "spill registers" in configs.prune_norm_fwd(few_warps, DeviceLimits(), n=1024)
    bwd = triton.Config({"TILE": 8192, "PROGRAMS_PER_SM": 2}, num_warps=4)
    assert "spill registers" in configs.prune_norm_bwd(bwd, DeviceLimits(), n=1024)
    assert configs.prune_norm_bwd(configs.norm_bwd(1024)[0], DeviceLimits(), n=1024) is None


@pytest.mark.parametrize("tile, n, warps, spills", [
    # (TILE, width, warps) of backward configs compiled for sm_90 (bench/compile_sm90.py --spaces):
    (8192, 1024, 16, True), (8192, 1024, 8, True), (8192, 2048, 16, True),  # 8 and 4 rows a tile
    (8192, 8192, 16, False), (4096, 1024, 8, False), (2048, 1024, 16, False), (4096, 4096, 4, False),
])
def test_norm_bwd_pruning_agrees_with_the_compiled_kernels(tile, n, warps, spills):
    """At 16 warps a thread has 128 registers, not 255; a tile of several rows costs more."""
    cfg = triton.Config({"TILE": tile, "PROGRAMS_PER_SM": 1}, num_warps=warps)
    assert (configs.prune_norm_bwd(cfg, DeviceLimits(), n) is not None) == spills


def test_prune_rows_gives_reasons():
    idle = triton.Config({"TILE": 256}, num_warps=16)
    assert "512 threads for 256 elements" in configs.prune_rows(idle, DeviceLimits(), n=100)
    assert configs.prune_rows(idle, DeviceLimits(), n=1024) is None, "a row block of 1024 fills them"


def _slow_host_step(seconds: float):
    """A CUDA step that busy-waits `seconds` on the host before a tiny kernel."""
    import time

    x = torch.randn(1024, device="cuda")

    def slow_host():
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return x * 2
    return slow_host


@pytest.mark.gpu
def test_wall_timer_counts_host_time():
    """Why dialects use wall time: a step whose host path is slow (here 0.2 ms of busy host
    work before a tiny kernel) costs that host time per call in an eager training loop. The
    wall timer must count it: its result cannot fall below the busy wait. (Whether do_bench's
    GPU time hides part of it is a race with its L2 flush: under 8 pytest workers sharing the
    GPU it did not, 2026-11-27; no assertion on it.)"""
    from trifuse.autotune.tuner import wall_timer

    assert wall_timer("slow", _slow_host_step(2e-4)) >= 0.2


@pytest.mark.gpu
def test_graph_timer_leaves_host_time_out():
    """Why dialects inside graphed blocks use the graph timer: a replay runs the step's kernels
    without its Python. The step below busy-waits 2 ms on the host before a tiny kernel; its
    replays cost the kernel alone, far under the wait the wall timer counts."""
    from trifuse.autotune.tuner import graph_timer

    assert 0 < graph_timer("slow", _slow_host_step(2e-3)) < 1.0


@pytest.mark.gpu
def test_graph_timer_times_a_training_step_of_a_fused_op():
    """fwd+bwd of a trifuse op (its Philox seed drawn inside the capture) replays from a graph."""
    from trifuse.autotune.tuner import graph_timer
    from trifuse.kernels.layer_norm import _layer_norm_trifuse

    x = torch.randn(512, 1024, device="cuda", requires_grad=True)
    w = torch.ones(1024, device="cuda", requires_grad=True)
    r = torch.randn(512, 1024, device="cuda")
    dy = torch.randn(512, 1024, device="cuda")

    def step():
        y = trifuse.ops.dropout_add(_layer_norm_trifuse(x, (1024,), w, None, 1e-5), r, 0.1)
        return torch.autograd.grad(y, (x, w), dy)

    assert graph_timer("ln+dropout", step) > 0


@pytest.mark.gpu
def test_a_failed_capture_leaves_random_ops_working():
    """PyTorch leaves the default CUDA generator in capture mode after a capture that fails, and
    every later random op raises "Offset increment outside graph capture encountered
    unexpectedly" (H200, 2026-11-30: one failed block capture, then the model's next attention
    dropout). end_generator_capture_mode ends the mode; graph_timer applies it when the step it
    captures fails (here: it synchronizes), and random ops keep working after."""
    from trifuse.autotune.tuner import end_generator_capture_mode, graph_timer

    try:
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(Exception), torch.cuda.graph(graph):
            torch.cuda.synchronize()  # not allowed while capturing: the capture fails
        with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
            torch.randn(4, device="cuda")  # PyTorch's behaviour that the recovery is for
    finally:
        end_generator_capture_mode()
    torch.randn(4, device="cuda")

    x = torch.randn(1024, device="cuda")

    def syncs():
        torch.cuda.synchronize()
        return x * 2

    with pytest.raises(Exception):
        graph_timer("syncs", syncs)
    y = torch.nn.functional.dropout(x, 0.5)  # no error, and a fresh mask
    assert 0.3 < (y == 0).float().mean().item() < 0.7
