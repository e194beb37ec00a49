import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts from empty Dynamo caches: compiles of one model class in earlier tests
    count towards the recompile limit of its code object and seed automatic dynamic shapes."""
    torch._dynamo.reset()
    yield
