"""The speed-only patches tests/_device.py makes to Dynamo change no behaviour (the Triton
interpreter's are tested in tests/kernels/test_launch.py)."""
import pytest
import torch
import torch._dynamo.guards


def test_dynamo_guards_still_guard_without_their_latency_timing():
    """Dynamo no longer times each new guard set (reported as 0 us); the guards are built and
    checked as before: a call they reject recompiles, one they accept reuses the capture."""
    profile = getattr(torch._dynamo.guards, "profile_guard_manager", None)
    if profile is None:
        pytest.skip("this torch does not time its guards")
    assert hasattr(profile, "__wrapped__"), "tests/_device.py did not patch"
    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    @torch.compile(backend=backend, dynamic=False)
    def f(x):
        return x * 2 + 1

    x = torch.randn(3)
    assert torch.equal(f(x), x * 2 + 1) and len(frames) == 1
    f(torch.randn(3))  # same guards: the capture is reused
    assert len(frames) == 1
    y = torch.randn(3, dtype=torch.float64)
    assert torch.equal(f(y), y * 2 + 1) and len(frames) == 2  # a dtype the guards reject
    torch._dynamo.reset()
