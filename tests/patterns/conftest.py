import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts from empty Dynamo caches: compiles of one model class in earlier tests
    count towards the recompile limit of its code object and seed automatic dynamic shapes."""
    torch._dynamo.reset()
    yield


@pytest.fixture(scope="module")
def one_rank_mesh():
    """A DeviceMesh over a one-process gloo group, for graphs with DTensor conversions in them
    (what trifuse.parallel's styles capture as); torch.distributed is torn down after the module."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()
