import _device  # noqa: F401  (first: sets TRITON_INTERPRET before trifuse is imported)
import pytest
import torch
from hypothesis import register_random

from _device import DEVICE, ON_GPU


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class _TorchGlobalRandom:
    """torch's global generators (CPU, and CUDA's once initialized) as Hypothesis manages
    `random`'s: seeded at the start of each example (0, or the seed `st.random_module()` draws)
    and restored after it. Without this an example's tensors depended on every example run before
    it in the test, so a failing draw Hypothesis replayed alone got other tensors, passed, and was
    reported as flaky without a way to reproduce it (xIELU's, 2026-12-06)."""

    def seed(self, n: int) -> None:
        torch.manual_seed(n)

    def getstate(self) -> tuple:
        cuda_live = torch.cuda.is_available() and torch.cuda.is_initialized()
        cuda = torch.cuda.get_rng_state_all() if cuda_live else None
        return torch.get_rng_state(), cuda

    def setstate(self, state: tuple) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


_TORCH_RANDOM = _TorchGlobalRandom()  # Hypothesis keeps a weak reference only
register_random(_TORCH_RANDOM)


def pytest_configure(config):
    # An xdist worker (`pytest -n auto`, as CI runs) shares the cores with the other workers: one
    # intra-op thread each, or their thread pools oversubscribe the machine (2 cores: 12 min of
    # tests instead of 14).
    if hasattr(config, "workerinput"):
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n auto` (the README's command) schedules as xdist's `--dist load` does, but sends
    the distributed tests (tests/parallel, on persistent gloo worlds: _world.py) to one worker
    together, and first: each worker would otherwise start worlds of its own, processes importing
    torch and transformers (seconds of CPU each, on the cores the tests share). xdist's
    `xdist_group` marks would do this, but under pytest 9.2 its `loadgroup` silently groups nothing
    (pytest-dev/pytest-xdist#1386, open: the group is written into a node id pytest no longer reads)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class DistributedTestsTogether(LoadScopeScheduling):
        # A unit of work per test, the distributed tests one unit; xdist runs the largest first.
        def _split_scope(self, nodeid: str) -> str:
            return "tests/parallel" if nodeid.startswith("tests/parallel/") else nodeid

    return DistributedTestsTogether(config, log)

