import _device  # noqa: F401  (first: sets TRITON_INTERPRET before trifuse is imported)
import pytest
import torch

from _device import DEVICE, ON_GPU


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


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
