"""Fixtures for the tuning tests: a private cache directory, fresh in-memory caches and records,
and a fake timer so tuning decisions are deterministic on the CPU."""
import pytest

from trifuse.autotune import cache, decisions


class FakeTimer:
    """Stands in for do_bench: runs the step once (so failures surface as on the GPU) and
    returns the time listed for its label; records every label it was asked to time."""

    def __init__(self, ms: dict[str, float], default: float = 1.0):
        self.ms = ms
        self.default = default
        self.calls: list[str] = []

    def __call__(self, label, step):
        self.calls.append(label)
        step()
        return self.ms.get(label, self.default)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """TRIFUSE_CACHE_DIR in a temporary directory, tuning on, nothing remembered from before."""
    monkeypatch.setenv("TRIFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRIFUSE_AUTOTUNE", raising=False)
    monkeypatch.setattr(cache, "_CACHES", {})
    monkeypatch.setattr(decisions, "_RECORDS", {})
    return tmp_path / "cache"


@pytest.fixture
def fresh_dialects(cache_dir, monkeypatch):
    """Call it with real dialects: their memory is cleared now and after the test, and their
    timer is the real one (None) until the test sets a fake."""
    held = []

    def fresh(*dialects):
        for d in dialects:
            d.clear()
            monkeypatch.setattr(d, "timer", None)
            held.append(d)
        return dialects[0] if len(dialects) == 1 else dialects

    yield fresh
    for d in held:
        d.clear()


@pytest.fixture
def new_process(monkeypatch):
    """Call it to forget what this process holds in memory (cache objects, records), as a second
    process would start; the disk cache stays."""
    def forget():
        monkeypatch.setattr(cache, "_CACHES", {})
        monkeypatch.setattr(decisions, "_RECORDS", {})
    return forget


@pytest.fixture
def timer():
    """A factory of fake timers: timer({"label": ms, ...})."""
    return FakeTimer


@pytest.fixture
def count_calls():
    """Returns calls(fn, *args): the Python and C function calls one `fn(*args)` makes, counted
    with sys.setprofile. How the per-call paths (dialect keys) are kept cheap without timing them:
    a count does not depend on how loaded the machine is."""
    import sys

    def calls(fn, *args) -> int:
        fn(*args)  # warm: caches filled, nothing lazy left
        n = 0

        def profile(frame, event, arg):
            nonlocal n
            if event in ("call", "c_call"):
                n += 1

        sys.setprofile(profile)
        try:
            fn(*args)
        finally:
            sys.setprofile(None)
        return n - 1  # setprofile(None) itself
    return calls


@pytest.fixture
def record_launches(monkeypatch):
    """Returns record({name: CachedKernel}): from then on every launch of those kernels is
    appended, as (name, grid, launch keywords), to the list record returns; they still run."""
    seen: list = []

    def record(kernels: dict) -> list:
        for name, kernel in kernels.items():
            def run(grid, args, kwargs, _run=kernel.run, _name=name):
                seen.append((_name, grid, dict(kwargs)))
                _run(grid, args, kwargs)
            monkeypatch.setattr(kernel, "run", run)
        return seen
    return record
