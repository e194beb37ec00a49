"""The layout moves shard() relies on, with rank-encoded inputs and exact expected values.

Every value is a small integer, so every expected result is exact in float32: a wrong
collective (wrong rank order, a missing reduction, a reduction twice) changes a number.
Forward and backward are both checked: the backward of each move is its conjugate
(all-gather <-> reduce-scatter, scatter <-> all-gather, identity <-> all-reduce).
"""

import os
import time

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from trifuse.parallel.random import RankStream
from trifuse.parallel.styles import from_rank_major, to_rank_major


def _mesh(size):
    return init_device_mesh("cpu", (size,))


def sequence_scatter_and_gather(rank, size):
    """Replicate -> Shard(1) (the stack's entry) and Shard(1) -> Replicate (attention's entry)."""
    from trifuse.parallel.styles import PrepareFirstInput, PrepareFirstOutput

    mesh = _mesh(size)
    s = 2 * size
    full = torch.arange(s, dtype=torch.float32).reshape(1, s, 1).requires_grad_()
    enter = nn.Identity()
    PrepareFirstInput(input_layout=Replicate(), desired_layout=Shard(1), use_local_output=True)._apply(
        enter, mesh
    )
    local = enter(full)
    (local * (rank + 1)).sum().backward()  # upstream gradient on rank r: r + 1

    mine = torch.full((1, 2, 1), 10.0 * (rank + 1)).requires_grad_()  # rank-encoded sequence slice
    gather = nn.Identity()
    PrepareFirstInput(input_layout=Shard(1), desired_layout=Replicate(), use_local_output=False)._apply(
        gather, mesh
    )
    # As a column-parallel consumer does: its input gradient is this rank's partial sum.
    gathered = gather(mine).to_local(grad_placements=(Partial(),))
    (gathered * (rank + 1)).sum().backward()

    leave = nn.Identity()
    PrepareFirstOutput(output_layout=Shard(1), desired_layout=Replicate())._apply(leave, mesh)
    left = leave(torch.full((1, 2, 1), 10.0 * (rank + 1)))
    return local.detach(), full.grad, gathered.detach(), mine.grad, left


def rowwise_reduce_scatter(rank, size):
    """A row-parallel linear with all-ones weights on rank-encoded inputs: the partial products
    are summed over ranks and scattered along the sequence."""
    from trifuse.parallel import RowwiseParallel

    mesh = _mesh(size)
    lin = nn.Linear(2 * size, 3, bias=True)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.fill_(100.0)
    RowwiseParallel(output_layouts=Shard(1))._apply(lin, mesh)
    x = torch.full((1, 2 * size, 2), float(rank + 1)).requires_grad_()  # this rank's 2 input features
    y = lin(x)
    rows = torch.arange(1, 1 + y.shape[1], dtype=torch.float32) + y.shape[1] * rank  # global row index + 1
    (y * rows.reshape(1, -1, 1)).sum().backward()
    return y.detach(), x.grad, lin.bias.grad.full_tensor()


def fused_colwise_conv1d(rank, size):
    """GPT-2's c_attn (Conv1D, [Q | K | V]) column-parallel with fused_parts=3: rank r holds the
    q, k, v columns of its own heads; its state_dict piece is the unsharded layout's."""
    from transformers.pytorch_utils import Conv1D

    from trifuse.parallel import ColwiseParallel

    mesh = _mesh(size)
    heads, d = 2 * size, 1
    conv = Conv1D(3 * heads * d, 2)
    with torch.no_grad():
        conv.weight.copy_(torch.arange(3 * heads).repeat(2, 1))  # column c holds c
        conv.bias.copy_(torch.arange(3 * heads))
    ColwiseParallel(fused_parts=3)._apply(conv, mesh)
    out = conv(torch.tensor([[[1.0, 0.0]]]))  # picks weight row 0 (+ bias): 2 * column index
    sd = conv.state_dict()
    return (
        conv.weight.to_local()[0].detach(),
        out[0, 0].detach(),
        sd["weight"].to_local()[0],
        sd["bias"].to_local(),
    )


def test_sequence_scatter_and_gather_exact(world):
    size = 2
    for rank, (local, full_grad, gathered, mine_grad, left) in enumerate(
        world.run(sequence_scatter_and_gather)
    ):
        assert local.flatten().tolist() == [2.0 * rank, 2.0 * rank + 1]  # my slice, no communication
        assert full_grad.flatten().tolist() == [1.0, 1.0, 2.0, 2.0]  # all-gather of r + 1 slices
        assert gathered.flatten().tolist() == [10.0, 10.0, 20.0, 20.0]  # all-gather in rank order
        assert mine_grad.flatten().tolist() == [1.0 + 2.0] * 2  # reduce-scatter of the partial grads
        assert left.flatten().tolist() == [10.0, 10.0, 20.0, 20.0]
    assert size == 2


def test_rowwise_reduce_scatter_exact(world):
    for rank, (y, x_grad, bias_grad) in enumerate(world.run(rowwise_reduce_scatter)):
        # 2 features per rank, all-ones weights: sum_r 2 * (r + 1) = 6, plus the bias added once.
        assert y.shape == (1, 2, 3)
        assert torch.equal(y, torch.full((1, 2, 3), 106.0))
        # The upstream gradient of output row i is i + 1; it is all-gathered, so every rank's input
        # gradient sees all four rows: 3 outputs x (i + 1).
        assert x_grad[0, :, 0].tolist() == [3.0, 6.0, 9.0, 12.0]
        assert bias_grad.tolist() == [1.0 + 2 + 3 + 4] * 3  # summed over the whole sequence, once


def test_fused_qkv_split_per_head_exact(world):
    for rank, (weight_row, out, sd_weight_row, sd_bias) in enumerate(world.run(fused_colwise_conv1d)):
        # 4 heads of width 1, [q0 q1 q2 q3 | k0 .. | v0 ..] = columns 0..11; rank r has heads 2r, 2r+1.
        q, k, v = [2 * rank, 2 * rank + 1], [4 + 2 * rank, 5 + 2 * rank], [8 + 2 * rank, 9 + 2 * rank]
        assert weight_row.tolist() == q + k + v
        assert out.tolist() == [2.0 * c for c in q + k + v]
        assert sd_weight_row.tolist() == list(range(6 * rank, 6 * rank + 6))  # unsharded layout
        assert sd_bias.tolist() == list(range(6 * rank, 6 * rank + 6))


def test_rank_major_permutation_round_trip_exact():
    t = torch.arange(24).reshape(2, 12)
    permuted = to_rank_major(t, 1, parts=3, tp=2)
    assert permuted[0].tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert torch.equal(from_rank_major(permuted, 1, parts=3, tp=2), t)
    assert torch.equal(from_rank_major(to_rank_major(t.T, 0, 3, 4), 0, 3, 4), t.T)


def test_local_heads_config_overrides_the_head_counts_and_reads_the_rest_through():
    from transformers import Phi3Config

    from trifuse.parallel.sharding import LocalHeadsConfig

    shared = Phi3Config(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    view = LocalHeadsConfig(shared, num_attention_heads=2, num_key_value_heads=1)
    assert (view.num_attention_heads, view.num_key_value_heads) == (2, 1)
    assert (shared.num_attention_heads, shared.num_key_value_heads) == (4, 2)
    shared._attn_implementation = "eager"  # a later change to the model's config reaches the module
    assert view._attn_implementation == "eager" and view.hidden_size == shared.hidden_size
    view.sliding_window = 7  # a write to anything but the local counts goes to the shared config
    assert shared.sliding_window == 7
    assert getattr(view, "no_such_option", None) is None


def test_rank_major_permutation_of_unequal_parts():
    # Phi-3's [Q | K | V] with half as many K/V heads: rank r gets its half of each part.
    t = torch.arange(16)
    permuted = to_rank_major(t, 0, parts=(8, 4, 4), tp=2)
    assert permuted.tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]
    assert torch.equal(from_rank_major(permuted, 0, parts=(8, 4, 4), tp=2), t)
    assert torch.equal(to_rank_major(t, 0, parts=(4, 4, 4, 4), tp=2), to_rank_major(t, 0, parts=4, tp=2))


def test_rank_stream_differs_per_rank_and_restores_default_stream():
    module = nn.Dropout(0.5).train()
    x = torch.ones(64)

    def run(rank, fail=False):
        torch.manual_seed(3)
        stream = RankStream(rank)
        stream.enter(module, (x,))
        y = module(x)
        if fail:  # an exception inside the region: the forward hook still runs (always_call)
            stream.leave(module, (x,), None)
        else:
            stream.leave(module, (x,), y)
        return y, torch.rand(4)

    y0, after0 = run(0)
    y1, after1 = run(1)
    y0_again, _ = run(0, fail=True)
    torch.manual_seed(3)
    torch.randint(0, 2**62, ())
    expected_after = torch.rand(4)
    assert torch.equal(y0, y0_again)  # reproducible under the seed
    assert not torch.equal(y0, y1)  # independent across ranks
    assert torch.equal(after0, expected_after) and torch.equal(after1, expected_after)  # one draw consumed


def test_rank_stream_is_inert_outside_training():
    module = nn.Dropout(0.5).eval()
    torch.manual_seed(3)
    state = torch.get_rng_state()
    stream = RankStream(1)
    stream.enter(module, (torch.ones(2),))
    stream.leave(module, (), None)
    assert torch.equal(torch.get_rng_state(), state)




def _abort_on_rank_1(rank, size, marker=None):
    """Rank 1 aborts (as a heap corruption's abort in a CPU kernel would); with a marker path,
    only on the first call, which leaves the marker."""
    if rank == 1 and (marker is None or not os.path.exists(marker)):
        if marker is not None:
            open(marker, "w").close()
        os.abort()
    return rank


def _rank_of(rank, size):
    return rank


def test_a_rank_that_dies_is_reported_at_once_with_its_stacks(worlds):
    """A rank killed by a signal fails the call within seconds, not at the 120 s timeout, naming
    the signal and the Python stack faulthandler wrote as it died; the call runs once more on
    fresh processes, and a second death fails the test with both reports."""
    world = worlds(2)
    start = time.monotonic()
    died = (r"(?s)rank\(s\) \[1\] died in _abort_on_rank_1.*signal SIGABRT.*in _abort_on_rank_1"
            r".*on the first run.*SIGABRT")
    with pytest.warns(RuntimeWarning, match="once more on fresh"), pytest.raises(AssertionError, match=died):
        world.run(_abort_on_rank_1)
    assert time.monotonic() - start < 60
    assert world.broken and worlds(2) is not world
    assert worlds(2).run(_rank_of) == [0, 1]


def test_a_rank_that_dies_once_is_rerun_with_a_warning(worlds, tmp_path):
    """A rank that dies once (a rare crash) costs a warning and a rerun, not the test."""
    world = worlds(2)
    with pytest.warns(RuntimeWarning, match=r"(?s)rank\(s\) \[1\] died.*SIGABRT.*once more on fresh"):
        assert world.run(_abort_on_rank_1, str(tmp_path / "died")) == [0, 1]
    assert not world.broken and world.run(_rank_of) == [0, 1]
