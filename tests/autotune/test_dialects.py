"""Operator dialects with a toy op and a fake timer: the fastest correct candidate wins; the
others are rejected with reasons (not installed, unsupported, raises, wrong result, not
deterministic); choices replay from memory and disk; TRIFUSE_AUTOTUNE=0, traced calls and
calls nobody supports fall back to the op's own implementation; tuning leaves RNG state alone."""
import pytest
import triton
import torch

from trifuse.autotune import Tuner, cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.autotune.tuner import config_label


def scale_ref(x, s):
    return x * s


def key(x, s):
    if type(x) is not torch.Tensor:
        return None
    return (x.get_device(), x.dtype, x.shape[-1], torch.is_grad_enabled() and x.requires_grad)


def raising(x, s):
    raise RuntimeError("kernel launch failed")


CANDIDATES = (
    Candidate("own", lambda x, s: x * s),
    Candidate("fast", lambda x, s: torch.mul(x, s)),
    Candidate("wrong", lambda x, s: x * (s * 1.01)),  # plausible and wrong: must fail the check
    Candidate("raises", raising),
    Candidate("missing", lambda x, s: x * s, requires=("trifuse_no_such_module",)),
    Candidate("picky", lambda x, s: x * s,
              supports=lambda x, s: None if x.dtype == torch.float16 else "float16 only"),
    Candidate("nondet", lambda x, s: x * s, deterministic=False),
)
TIMES = {"own": 3.0, "fast": 1.0, "wrong": 0.1, "raises": 0.1, "missing": 0.1, "picky": 0.1, "nondet": 2.0}


def make(timer, candidates=CANDIDATES):
    d = Dialect("scale", key, ("device", "dtype", "n", "grad"), reference=scale_ref)
    for c in candidates:
        d.register(c)
    d.timer = timer
    return d


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def x_(n=16, dtype=torch.float32, grad=True):
    return torch.randn(4, n, dtype=dtype, requires_grad=grad)


def test_fastest_correct_candidate_wins_and_others_say_why(cache_dir, timer):
    fake = timer(TIMES)
    d = make(fake)
    x = x_()
    torch.testing.assert_close(d(x, 2.0), x * 2.0)
    rec = d.explain(x, 2.0)
    assert rec.chosen == "fast" and rec.source == "measured"
    assert fake.calls == ["own", "fast", "nondet"], "only eligible candidates that pass the check are timed"
    assert rec.times_ms == {"own": 3.0, "fast": 1.0, "nondet": 2.0}
    assert rec.rejected["wrong"].startswith("wrong result: output 0 max error")
    assert rec.rejected["raises"] == "raised RuntimeError: kernel launch failed"
    assert "trifuse_no_such_module is not installed" in rec.rejected["missing"]
    assert rec.rejected["picky"] == "float16 only"
    assert set(rec.rejected) == {"wrong", "raises", "missing", "picky"}


def _scale_function(grad_error: float = 0.0, on_backward=None):
    """x * s as an autograd.Function (a candidate with a Python backward): its gradient is
    dy * (s + grad_error); on_backward() runs first in each backward."""
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, s):
            ctx.s = s
            return x * s

        @staticmethod
        def backward(ctx, dy):
            if on_backward is not None:
                on_backward()
            return dy * (ctx.s + grad_error), None
    return Scale.apply


def test_candidates_backward_passes_run_on_the_deciding_thread(cache_dir, timer):
    """A dialect's checks and timed calls run their backward on the thread that decides (on CUDA
    autograd's device thread would not see the decision's contextvars: tests/autotune/
    test_tuner.py); the calls after the decision run theirs as usual."""
    seen = []
    recording = _scale_function(on_backward=lambda: seen.append(torch._C._is_multithreading_enabled()))
    d = make(timer({"own": 2.0, "recording": 1.0}), (CANDIDATES[0], Candidate("recording", recording)))
    x = x_()
    d(x, 2.0).sum().backward()
    assert d.explain(x, 2.0).chosen == "recording"
    assert seen[:-1] and not any(seen[:-1]), "the check's and the timed calls' backward passes"
    assert seen[-1], "the call's own backward, after the decision"


def test_wrong_gradient_is_caught_too(cache_dir, timer):
    d = make(timer({"bad-grad": 0.1}), (CANDIDATES[0], Candidate("bad-grad", _scale_function(grad_error=0.5))))
    d(x_(), 2.0)
    rec = d.explain(x_(), 2.0)
    assert rec.chosen == "own" and rec.rejected["bad-grad"].startswith("wrong result: gradient 0")


def test_training_calls_time_forward_and_backward_together(cache_dir):
    seen = {}

    def timing(label, step):
        seen[label] = step()
        return 1.0

    d = make(timing, CANDIDATES[:2])
    d(x_(grad=True), 2.0)
    assert all(isinstance(v, tuple) and v[0].shape == (4, 16) for v in seen.values()), "gradients computed"
    seen.clear()
    d(x_(n=32, grad=False), 2.0)
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in seen.values()), "forward only"


def test_choice_is_replayed_from_memory_then_from_disk(cache_dir, timer, new_process):
    fake = timer(TIMES)
    d = make(fake)
    d(x_(), 2.0)
    n = len(fake.calls)
    d(x_(), 3.0)
    assert len(fake.calls) == n, "a decided key is a dict hit"
    new_process()
    fake2 = timer(TIMES)
    d2 = make(fake2)
    x = x_()
    torch.testing.assert_close(d2(x, 2.0), x * 2.0)
    assert fake2.calls == [] and d2.explain(x_(), 2.0).source == "disk cache"
    assert d2.explain(x_(), 2.0).rejected["raises"] == "raised RuntimeError: kernel launch failed"


def test_a_cached_winner_that_is_gone_is_retuned(cache_dir, timer, new_process):
    make(timer(TIMES))(x_(), 2.0)
    new_process()
    fake = timer(TIMES)
    without_fast = tuple(c for c in CANDIDATES if c.name != "fast")
    d = make(fake, without_fast)
    d(x_(), 2.0)
    assert d.explain(x_(), 2.0).chosen == "nondet" and fake.calls == ["own", "nondet"]


def test_deterministic_mode_keeps_only_deterministic_candidates_and_still_tunes(cache_dir, timer,
                                                                                deterministic):
    fake = timer({"own": 3.0, "fast": 4.0, "nondet": 0.5})
    d = make(fake)
    d(x_(), 2.0)
    rec = d.explain(x_(), 2.0)
    assert rec.chosen == "own" and rec.source == "measured"
    assert "nondet" not in fake.calls
    assert rec.rejected["nondet"] == "not deterministic (torch.use_deterministic_algorithms is on)"
    assert rec.bucket.endswith(",deterministic")


def test_deterministic_and_default_modes_are_decided_apart(cache_dir, timer):
    fake = timer({"own": 3.0, "fast": 4.0, "nondet": 0.5})
    d = make(fake)
    d(x_(), 2.0)
    assert d.explain(x_(), 2.0).chosen == "nondet"
    torch.use_deterministic_algorithms(True)
    try:
        d(x_(), 2.0)
        assert d.explain(x_(), 2.0).chosen == "own"
    finally:
        torch.use_deterministic_algorithms(False)


def test_graphed_calls_choose_by_their_own_timer_and_apart_from_eager_ones(cache_dir, timer, new_process):
    """Inside `graphed_calls()` (a block replayed from a CUDA graph) the host path is gone: the
    choice is timed by the graph timer, remembered apart (memory and disk) from the eager choice
    of the same call, and each mode replays its own."""
    wall = timer({"own": 1.0, "fast": 5.0, "nondet": 5.0})  # own's host path is the cheap one
    gpu = timer({"own": 3.0, "fast": 1.0, "nondet": 2.0})  # fast's kernels are
    d = make(wall)
    d.graph_timer = gpu
    x = x_()
    d(x, 2.0)
    assert d.explain(x, 2.0).chosen == "own" and gpu.calls == []
    with dialects.graphed_calls():
        torch.testing.assert_close(d(x, 2.0), x * 2.0)
        rec = d.explain(x, 2.0)
    assert rec.chosen == "fast" and rec.bucket.endswith(",graphed") and rec.times_ms["fast"] == 1.0
    assert gpu.calls == ["own", "fast", "nondet"] and wall.calls == ["own", "fast", "nondet"]
    assert d.explain(x, 2.0).chosen == "own", "the eager choice stays"
    with dialects.graphed_calls():
        d(x, 2.0)
    d(x, 2.0)
    assert len(gpu.calls) == 3 and len(wall.calls) == 3, "both replay from memory"
    new_process()
    d2 = make(timer({}))
    with dialects.graphed_calls():
        d2(x, 2.0)
        assert d2.explain(x, 2.0).chosen == "fast" and d2.explain(x, 2.0).source == "disk cache"
    d2(x, 2.0)
    assert d2.explain(x, 2.0).chosen == "own" and d2.explain(x, 2.0).source == "disk cache"


def test_graphed_calls_use_the_replaced_timer_when_only_that_is_replaced(cache_dir, timer):
    fake = timer(TIMES)
    d = make(fake)
    with dialects.graphed_calls():
        d(x_(), 2.0)
    assert fake.calls == ["own", "fast", "nondet"] and d.explain(x_(), 2.0).chosen == "own"
    with dialects.graphed_calls():
        assert d.explain(x_(), 2.0).chosen == "fast"


def test_autotune_off_takes_the_first_eligible_and_times_nothing(cache_dir, timer, monkeypatch):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    fake = timer(TIMES)
    d = make(fake, CANDIDATES[4:] + CANDIDATES[:2])  # missing, picky, nondet, own, fast
    d(x_(), 2.0)
    rec = d.explain(x_(), 2.0)
    assert rec.chosen == "nondet" and rec.source == "default (TRIFUSE_AUTOTUNE=0)" and fake.calls == []
    assert not cache_dir.exists()


def test_traced_calls_run_the_ops_own_implementation(cache_dir, timer):
    class Sub(torch.Tensor):
        pass

    calls = []
    first = Candidate("own", lambda x, s: calls.append("own") or x * s)
    d = make(timer({"fast": 0.0}), (first, CANDIDATES[1]))
    d(torch.randn(3).as_subclass(Sub), 2.0)
    assert calls == ["own"]
    assert d.explain(torch.randn(3).as_subclass(Sub), 2.0).source.startswith("traced")


def test_when_no_candidate_takes_the_call_the_first_raises_its_own_error(cache_dir, timer):
    def own(x, s):
        raise ValueError("trifuse.scale: x must be float16")

    picky = Candidate("own", own, supports=lambda x, s: "float16 only")
    d = make(timer({}), (picky, CANDIDATES[5]))
    for _ in range(2):
        with pytest.raises(ValueError, match="trifuse.scale: x must be float16"):
            d(x_(), 2.0)
    assert d.explain(x_(), 2.0).source == "fallback (no candidate takes this call)"
    assert not d._memo, "nothing memoized for a call nobody takes"


def test_when_every_candidate_fails_the_first_is_kept_but_not_written(cache_dir, timer):
    fake = timer({})
    d = make(fake, (Candidate("raises", raising), CANDIDATES[2]))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="kernel launch failed"):
            d(x_(), 2.0)
    assert d.explain(x_(), 2.0).source == "fallback (every candidate failed)"
    assert fake.calls == [], "nothing passed the check, nothing was timed, nothing retried"
    assert not cache_dir.exists()


def test_when_the_reference_fails_the_first_is_kept(cache_dir, timer):
    def broken_ref(x, s):
        raise MemoryError("float64 reference does not fit")

    d = Dialect("scale", key, ("device", "dtype", "n", "grad"), reference=broken_ref)
    for c in CANDIDATES[:2]:
        d.register(c)
    d.timer = timer({})
    x = x_()
    torch.testing.assert_close(d(x, 2.0), x * 2.0)
    expected = "fallback (the reference raised MemoryError: float64 reference does not fit)"
    assert d.explain(x, 2.0).source == expected


def test_tuning_does_not_shift_random_streams(cache_dir, timer):
    def noisy(x, s):
        torch.rand(1000)  # a candidate that draws random numbers (dropout, say)
        return x * s

    x = x_()
    torch.manual_seed(123)
    expected = torch.rand(3)
    d = make(timer({}), (CANDIDATES[0], Candidate("noisy", noisy)))
    torch.manual_seed(123)
    d(x, 2.0)
    assert d.explain(x, 2.0).source == "measured"
    assert torch.equal(torch.rand(3), expected)


def test_explain_before_deciding_lists_reasons_without_tuning(cache_dir, timer):
    fake = timer(TIMES)
    d = make(fake)
    rec = d.explain(x_(), 2.0)
    assert rec.source == "not decided yet" and rec.chosen == "own" and fake.calls == []
    assert set(rec.rejected) == {"missing", "picky"}


def test_registry_rules(monkeypatch):
    d = make(None, CANDIDATES[:1])
    with pytest.raises(ValueError, match="already has a candidate 'own'"):
        d.register(CANDIDATES[0])
    with pytest.raises(KeyError, match="no candidate 'fast'"):
        d.candidate("fast")
    monkeypatch.setattr(dialects, "_DIALECTS", ())
    defined = dialects.define("scale", key, ("device", "n"), scale_ref)
    assert dialects.get("scale") is defined and dialects.all_dialects() == (defined,)
    with pytest.raises(ValueError, match="already defined"):
        dialects.define("scale", key, ("device", "n"), scale_ref)
    with pytest.raises(ValueError, match="must include 'device'"):
        Dialect("x", key, ("n",), scale_ref)


def test_gate_negative_control():
    ref64 = torch.linspace(-3, 3, 101, dtype=torch.float64)
    lowp = ref64.to(torch.float16)
    assert dialects.gate("y", lowp, ref64, lowp) is None
    assert dialects.gate("y", (ref64 * 1.01).to(torch.float16), ref64, lowp) is not None
    nan = lowp.clone()
    nan[3] = float("nan")
    assert "NaN" in dialects.gate("y", nan, ref64, lowp)
    overflow64 = torch.tensor([1.0, 70000.0], dtype=torch.float64)
    overflow = overflow64.to(torch.float16)  # inf, like PyTorch's own fp16 result: accepted
    assert dialects.gate("y", overflow, overflow64, overflow) is None
    inf64 = torch.tensor([1.0, float("inf")], dtype=torch.float64)
    assert "finite where the reference has" in dialects.gate("y", lowp[:2], inf64, lowp[:2])


def test_autotune_off_replays_shipped_defaults_for_the_gpu_family(cache_dir, timer, monkeypatch, tmp_path):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    h100 = cache.Environment("NVIDIA H100 80GB HBM3", "3.6.0", "2.11.0")
    monkeypatch.setattr(cache, "environment", lambda i: h100)
    monkeypatch.setattr(dialects, "environment", lambda i: h100)
    monkeypatch.setattr(cache, "DEFAULTS_DIR", tmp_path)
    cache.write_defaults(tmp_path / "h100.json", "h100",
                         {"dialect:scale|dtype=float32,n=16,grad=True": {"choice": "fast"}}, "test")

    def on_gpu0(x, s):  # the key of a call on CUDA device 0, for CPU tensors
        return (0, *key(x, s)[1:])

    fake = timer({})
    d = Dialect("scale", on_gpu0, ("device", "dtype", "n", "grad"), reference=scale_ref)
    for c in CANDIDATES[:2]:
        d.register(c)
    d.timer = fake
    d(x_(), 2.0)
    d(x_(n=32), 2.0)
    assert d.explain(x_(), 2.0).chosen == "fast" and d.explain(x_(), 2.0).source == "shipped h100 defaults"
    assert d.explain(x_(n=32), 2.0).chosen == "own" and fake.calls == []


def _checked_choice(name: str, check, timer, reference=scale_ref):
    """(x, the decision) of a dialect with its own `check` and `output_like` over the first three
    candidates (own, fast, wrong), called once on x."""
    d = Dialect(name, key, ("device", "dtype", "n", "grad"), reference=reference, check=check,
                output_like=lambda x, s: torch.empty_like(x).requires_grad_(x.requires_grad))
    for c in CANDIDATES[:3]:
        d.register(c)
    d.timer = timer(TIMES)
    x = torch.randn(4, 8, requires_grad=True)
    d(x, 2.0)
    return x, d.explain(x, 2.0)


def test_a_check_on_a_smaller_call_runs_its_reference_once_for_all_candidates(cache_dir, timer):
    """A check that compares a sample of the call with `compare_with_reference` (cross-entropy's
    rows) builds its references once per measured call, whichever candidate it checks: the
    wrong candidate is still rejected against them; outside a measurement each comparison runs
    the reference anew."""
    ran = []

    def counted_ref(x, s):
        ran.append(x.dtype)
        return x * s

    def check(fn, args):
        sample = dialects.shared_by_checks("sample", args, lambda: (
            args[0].detach()[:2].requires_grad_(args[0].requires_grad), args[1]))
        return dialects.compare_with_reference(counted_ref, fn, sample)

    x, rec = _checked_choice("scale_sampled", check, timer)
    assert rec.chosen == "fast" and rec.rejected["wrong"].startswith("wrong result: output 0 max error")
    assert sorted(map(str, ran)) == ["torch.float32", "torch.float64"]
    sample = (x.detach()[:2].requires_grad_(), 2.0)
    assert dialects.compare_with_reference(counted_ref, CANDIDATES[0].fn, sample) is None
    assert dialects.compare_with_reference(counted_ref, CANDIDATES[0].fn, sample) is None
    assert len(ran) == 6


def test_a_check_with_output_like_never_runs_the_reference(cache_dir, timer):
    """Ops whose reference does not fit at real shapes (attention's is O(S^2)) pass `check` and
    `output_like`: the trial takes the output gradients' shapes from output_like, and the
    reference is never called."""
    def no_reference(x, s):
        raise AssertionError("the reference ran")

    checked = []

    def check(fn, args):
        checked.append(fn)
        return None if torch.equal(fn(*args), args[0] * args[1]) else "differs"

    _, rec = _checked_choice("scale_checked", check, timer, reference=no_reference)
    assert rec.chosen == "fast" and len(checked) == 3
    assert rec.rejected["wrong"] == "wrong result: differs"


def test_a_missing_parent_package_is_not_installed():
    assert dialects.import_problem("trifuse_no_such_pkg.ops").startswith("trifuse_no_such_pkg.ops is not installed")


def test_decisions_say_how_long_they_took_and_which_ran_inside_another(cache_dir):
    """Set-up accounting: a dialect's decision includes the tuning of its candidates' kernels
    (nested, not counted twice in the total); each decision's seconds are its wall time."""
    import time

    from trifuse.autotune import Tuner, decisions

    space = [triton.Config({"BLOCK": b}) for b in (64, 128)]
    tuner = Tuner("toy_kernel", lambda n: space, key_names=("device", "n"))
    tuner.timer = lambda label, step: (time.sleep(0.02), 1.0)[1]

    def tuned(x, s):
        tuner.config((-1, x.shape[-1]), lambda cfg: None)
        return x * s

    d = make(lambda label, step: (step(), time.sleep(0.05), 1.0)[2],
             (Candidate("own", lambda x, s: x * s), Candidate("tuned", tuned)))
    d(x_(), 2.0)
    (kernel,) = decisions.records(name="toy_kernel")
    (dialect,) = decisions.records(name="scale")
    assert kernel.nested and not dialect.nested
    assert kernel.seconds >= 0.04, "two configs timed at 20 ms each"
    assert dialect.seconds >= kernel.seconds + 0.1, "two candidates timed at 50 ms each, and the tuning"
    total, costliest = decisions.set_up_seconds([kernel, dialect])
    assert total == dialect.seconds
    assert costliest[0].startswith(f"{dialect.seconds:.2f} s dialect scale [")
    assert f"({dialect.source}, {dialect.seconds:.2f} s)" in str(dialect)
    # where the seconds went: the reference, each candidate's checks and timings; the kernel's
    # tuning inside the check that first ran it tuned (the re-check after screening)
    assert set(dialect.phases) == {"reference", "check own", "time own", "check tuned", "time tuned"}
    assert dialect.phases["time own"] >= 0.05 and dialect.phases["time tuned"] >= 0.1, "timed twice"
    assert dialect.phases["check tuned"] >= kernel.seconds >= kernel.phases["time"] >= 0.04
    assert "compile" not in kernel.phases, "a tuner with its own timer compiles nothing first"
    assert sum(dialect.phases.values()) <= dialect.seconds
    assert "; phases: " in costliest[0] and f"time tuned {dialect.phases['time tuned']:.2f} s" in costliest[0]


# A candidate whose "kernel" has three launch configs for a toy tuner: screening at the default
# config, then tuning only when the candidate is near the fastest.
KERNEL_SPACE = [triton.Config({"BLOCK": b}, num_warps=4) for b in (64, 128, 256)]


def _tuned_candidate(kernel: Tuner, launched: list) -> Candidate:
    def fn(x, s):
        kernel.config((-1, x.shape[-1]), lambda cfg, out: out.append(cfg.kwargs["BLOCK"]), launched)
        return x * s
    return Candidate("tuned", fn)


def _kernel(timer) -> Tuner:
    kernel = Tuner("toy_kernel", lambda n: KERNEL_SPACE, ("device", "n"))
    kernel.timer = timer
    return kernel


def test_a_candidate_far_behind_at_its_default_configs_is_not_tuned(cache_dir, timer):
    """Its kernels run their default config (no config compiled or timed, nothing remembered)
    and its time at that config stands: it loses, and the decision says it was not tuned."""
    kernel_timer, launched = timer({}), []
    kernel = _kernel(kernel_timer)
    dialect_timer = timer({"own": 1.0, "tuned": 2.5})
    d = make(dialect_timer, (CANDIDATES[0], _tuned_candidate(kernel, launched)))
    x = x_()
    torch.testing.assert_close(d(x, 2.0), x * 2.0)
    rec = d.explain(x, 2.0)
    assert rec.chosen == "own" and rec.times_ms == {"own": 1.0, "tuned": 2.5}
    assert rec.source == "measured; not tuned, over 2x the fastest at default configs: tuned"
    assert kernel_timer.calls == [] and launched == [] and not kernel.is_decided((-1, 16))
    assert dialect_timer.calls == ["own", "tuned"]


def test_a_candidate_near_the_fastest_is_tuned_then_checked_and_timed_again(cache_dir, timer):
    """Within SCREEN_MARGIN of the fastest at its default configs, the candidate's kernels are
    tuned (every config timed) and it is timed again with them: here it then wins."""
    kernel_timer, launched = timer({config_label(KERNEL_SPACE[2]): 0.1}), []
    kernel = _kernel(kernel_timer)

    def dialect_timer(label, step):
        step()
        calls.append(label)
        return {"own": 1.0}.get(label, 0.8 if kernel.is_decided((-1, 16)) else 1.5)

    calls: list[str] = []
    d = make(dialect_timer, (CANDIDATES[0], _tuned_candidate(kernel, launched)))
    x = x_()
    d(x, 2.0)
    rec = d.explain(x, 2.0)
    assert rec.chosen == "tuned" and rec.source == "measured" and rec.times_ms == {"own": 1.0, "tuned": 0.8}
    assert calls == ["own", "tuned", "tuned"]
    assert kernel_timer.calls == [config_label(c) for c in KERNEL_SPACE]
    assert kernel.config((-1, 16), None) is KERNEL_SPACE[2]


def _fake_precompile(events: list, launched: list):
    """Stands in for kernels._launch.precompile: runs the calls with the compile-only flag set
    (as the real one does, with Triton's compile pool) and notes what had launched by then."""
    from trifuse.autotune.tuner import PRECOMPILING

    def precompile(calls, workers=None):
        calls = list(calls)
        token = PRECOMPILING.set(True)
        try:
            for call in calls:
                try:
                    call()
                except Exception:  # noqa: BLE001, S110  (as the real one: the timed launch reports it)
                    pass
        finally:
            PRECOMPILING.reset(token)
        events.append((len(calls), list(launched)))
        return True
    return precompile


def test_on_the_gpus_own_timer_each_round_compiles_all_its_candidates_first(cache_dir, timer, monkeypatch):
    """A cold first step's time is mostly compiles: before the candidates are checked and timed,
    one pass hands the kernels of all of them (their check's calls and the timed call) to the
    compile pool together; before the near-fastest ones are tuned, a second pass compiles every
    config of their kernels together, timing nothing. An explicit timer (tests, fakes) gets no
    such pass."""
    from trifuse.kernels import _launch

    events, launched, wall_calls = [], [], []
    kernel_timer = timer({config_label(KERNEL_SPACE[2]): 0.1})
    kernel = _kernel(kernel_timer)

    def wall(label, step):
        step()
        wall_calls.append(label)
        return {"own": 1.0}.get(label, 0.8 if kernel.is_decided((-1, 16)) else 1.5)

    monkeypatch.setattr(_launch, "precompile", _fake_precompile(events, launched))
    monkeypatch.setattr(dialects, "timer_for", lambda device, explicit, default=None: (explicit or wall, ""))
    d = make(None, (CANDIDATES[0], _tuned_candidate(kernel, launched)))
    x = x_()
    torch.testing.assert_close(d(x, 2.0), x * 2.0)
    assert events[0] == (4, []), "both candidates, check and step, at default configs: nothing launched"
    assert events[1][0] == 2 and events[1][1][:3] == [64, 128, 256], "the tuned one's every config, compiled"
    assert len(events) == 2 and kernel_timer.calls == [config_label(c) for c in KERNEL_SPACE]
    rec = d.explain(x, 2.0)
    assert rec.chosen == "tuned" and rec.source == "measured" and wall_calls == ["own", "tuned", "tuned"]
    assert rec.phases["compile"] >= 0 and kernel.config((-1, 16), None) is KERNEL_SPACE[2]

    events.clear()
    make(timer({"own": 1.0}), (CANDIDATES[0], _tuned_candidate(_kernel(timer({})), [])))(x_(), 2.0)
    assert events == [], "an explicit timer: no compile pass"


def test_a_choice_made_without_measuring_compiles_the_winners_kernels_together_first(cache_dir, timer,
                                                                                     monkeypatch, new_process):
    """The only eligible candidate, or the disk cache's choice: the call that follows would tune
    its kernels one after another; on the GPU's own timer one pass first compiles every config of
    them together (the candidate's forward and backward in compile-only mode), with the random
    generator where it was."""
    from trifuse.kernels import _launch

    events, launched = [], []
    monkeypatch.setattr(_launch, "precompile", _fake_precompile(events, launched))
    monkeypatch.setattr(dialects, "timer_for", lambda device, explicit, default=None: (explicit or timer({}), ""))

    def drawing(x, s):  # draws from the generator, as a dropout's seed does
        torch.rand(1)
        return x * s

    kernel_timer = timer({})
    d = make(None, (_tuned_candidate(_kernel(kernel_timer), launched),
                    Candidate("picky", drawing, supports=lambda x, s: "no")))
    x = x_()
    state = torch.random.get_rng_state()
    d(x, 2.0)
    assert events == [(1, [64, 128, 256])], "one call, every config of its kernel compiled"
    assert kernel_timer.calls == [config_label(c) for c in KERNEL_SPACE], "then tuned by the real call"
    rec = d.explain(x, 2.0)
    assert rec.source == "only eligible candidate" and "compile" in rec.phases

    events.clear()
    launched.clear()
    d2 = make(None, (Candidate("own", drawing), Candidate("fast", drawing)))
    d2.timer = timer({"own": 2.0, "fast": 1.0})
    d2(x, 2.0)  # measured with a fake timer: written to the disk cache
    new_process()
    d3 = make(None, (Candidate("own", drawing), Candidate("fast", drawing)))
    torch.random.set_rng_state(state)
    d3(x, 2.0)
    after = torch.random.get_rng_state()
    assert d3.explain(x, 2.0).source == "disk cache" and events == [(1, [])]
    assert torch.equal(after, _after_one_draw(state)), "only the real call drew: the pass left the generator"


def _after_one_draw(state):
    torch.random.set_rng_state(state)
    torch.rand(1)
    return torch.random.get_rng_state()


def test_a_dialect_called_inside_a_compile_pass_decides_nothing(cache_dir, timer):
    """Another op's candidate being compiled (kernels launch nothing): the call runs the op's own
    implementation and nothing is checked, timed, remembered or recorded."""
    from trifuse.autotune.tuner import PRECOMPILING

    fake = timer(TIMES)
    d = make(fake)
    token = PRECOMPILING.set(True)
    try:
        d(x_(), 2.0)
    finally:
        PRECOMPILING.reset(token)
    assert fake.calls == [] and not dialects.records("scale") and not cache_dir.exists()
    d(x_(), 2.0)
    assert d.explain(x_(), 2.0).chosen == "fast"


def test_kernels_decided_before_are_not_screened(cache_dir, timer):
    """A candidate whose kernels are already tuned for the call runs as tuned: timed once."""
    kernel_timer, launched = timer({}), []
    kernel = _kernel(kernel_timer)
    kernel.config((-1, 16), lambda cfg, out: None, [])  # tuned earlier (three configs timed)
    dialect_timer = timer({"own": 1.0, "tuned": 1.5})
    d = make(dialect_timer, (CANDIDATES[0], _tuned_candidate(kernel, launched)))
    d(x_(), 2.0)
    assert dialect_timer.calls == ["own", "tuned"] and len(kernel_timer.calls) == 3


def test_a_dialect_deciding_inside_another_ones_screening_tunes_in_full(cache_dir, timer):
    """One op's candidate calling another op: the inner choice is made in full (its candidates'
    kernels tuned as its own screening says), not at the outer screening's default configs."""
    kernel_timer, launched = timer({}), []
    kernel = _kernel(kernel_timer)
    inner = make(timer({"own": 1.0, "tuned": 1.2}), (CANDIDATES[0], _tuned_candidate(kernel, launched)))
    outer = make(timer({"own": 1.0, "calls-inner": 1.0}),
                 (CANDIDATES[0], Candidate("calls-inner", lambda x, s: inner(x, s))))
    outer(x_(), 2.0)
    assert kernel.is_decided((-1, 16)) and len(kernel_timer.calls) == 3


def test_phases_add_to_the_innermost_decision_and_nothing_outside_one():
    """`phase` charges the decision being made, the innermost when one runs inside another (its
    seconds are not the outer one's phase), and is a no-op outside any decision; the costliest
    list names phases of 0.01 s and more, longest first."""
    from trifuse.autotune import decisions

    with decisions.phase("outside"):  # nothing to charge: no error, nothing recorded
        pass
    with decisions.deciding() as outer:
        with decisions.phase("a"):
            with decisions.deciding() as inner:
                with decisions.phase("b"):
                    pass
        with decisions.phase("a"):
            pass
    assert set(outer.phases) == {"a"} and set(inner.phases) == {"b"}
    d = decisions.Decision("dialect", "op", "cpu", "n=1", "x", "measured", seconds=3.0,
                           phases={"check x": 0.5, "reference": 2.0, "time x": 0.004})
    assert decisions.set_up_seconds([d])[1] == [
        "3.00 s dialect op [n=1] (measured); phases: reference 2.00 s, check x 0.50 s"]


def test_every_public_op_has_a_dialect_with_pytorchs_or_anothers_candidate():
    """Issue 7's rule, kept as ops are added: each op in trifuse.ops chooses per shape between its
    kernels and at least one other implementation (its dialect shares the op's name)."""
    import trifuse.ops

    defined = {d.name: d for d in dialects.all_dialects()}
    for name in trifuse.ops.__all__:
        assert name in defined, f"trifuse.ops.{name} has no dialect"
        assert defined[name].candidates[0].name == "trifuse" and len(defined[name].candidates) >= 2, name
