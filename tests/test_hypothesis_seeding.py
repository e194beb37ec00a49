"""tests/conftest.py puts torch's global generator under Hypothesis' management: an example's
tensors are a function of its draw alone, so a failure Hypothesis replays is the same failure."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st


def test_each_example_draws_its_tensors_from_the_same_seed_and_the_state_is_restored_after():
    drawn = {}

    @settings(max_examples=12, deadline=None, database=None)
    @given(n=st.integers(1, 60))
    def draw(n):
        drawn[n] = torch.randn(n)
        torch.randn(1000)  # what an example consumes: the next one must not start from there

    torch.manual_seed(123)
    before = torch.get_rng_state()
    draw()
    assert torch.equal(torch.get_rng_state(), before)
    assert len(drawn) > 3
    for n, value in drawn.items():
        torch.manual_seed(0)
        assert torch.equal(value, torch.randn(n)), f"the example n={n} did not start from seed 0"
