"""Checkpoints of sharded models through torch.distributed.checkpoint, both directions.

A sharded model's state_dict holds DTensors in the unsharded layout (GPT-2's fused c_attn and
nn.MultiheadAttention's in_proj_weight included: the per-head permutation never reaches a checkpoint), so DCP saves each rank's piece
and an unsharded model loads the result in one process, bit for bit; and the reverse.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from _tp_models import batch, build, loss_of
from tolerances import check_close


def _trained(kind, size, sp):
    """A sharded model one AdamW step away from its initialization."""
    from trifuse.parallel import shard

    model = shard(build(kind), init_device_mesh("cpu", (size,)), sequence_parallel=sp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model(**batch(kind))).backward()
    opt.step()
    return model


def _mismatches(got: dict, want: dict) -> list[str]:
    if got.keys() != want.keys():
        return [f"keys differ: {sorted(got.keys() ^ want.keys())}"]
    return [k for k in want if not torch.equal(got[k], want[k])]


def sharded_to_unsharded(rank, size, kind, sp, path):
    from trifuse.parallel import gather_full

    model = _trained(kind, size, sp)
    dcp.save(model.state_dict(), checkpoint_id=path)
    expected = gather_full(model)
    dist.barrier()
    plain = build(kind, seed=1)
    state = plain.state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    # The loaded model computes what the sharded one does (not only what gather_full shows).
    loss, sharded_loss = loss_of(plain(**batch(kind, 1))), loss_of(model(**batch(kind, 1)))
    ok, msg = check_close("loss after loading", loss, sharded_loss, None)
    return _mismatches(gather_full(plain), expected) + ([] if ok else [msg])


def unsharded_to_sharded(rank, size, kind, sp, path):
    from trifuse.parallel import gather_full, shard

    source = build(kind, seed=1)
    if rank == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(source.state_dict(), checkpoint_id=path, no_dist=True)
    dist.barrier()
    model = shard(build(kind, seed=2), init_device_mesh("cpu", (size,)), sequence_parallel=sp)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    mismatches = _mismatches(gather_full(model), gather_full(source))
    loss, ref = loss_of(model(**batch(kind))), loss_of(source(**batch(kind)))
    ok, msg = check_close("loss after loading", loss, ref, None)
    return mismatches + ([] if ok else [msg])


KINDS = ["gpt2", "bert", "phi3", "torch_encoder", "qwen3_moe", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
# phi3: a fused QKV of unequal parts; torch_encoder: nn.MultiheadAttention's packed in_proj_weight;
# qwen3_moe: stacked experts, [gate | up] split per rank; deepseek_v3: latent attention (replicated
# down projections beside per-head up projections) and shared experts; gpt_oss: attention sinks split
# by heads, experts with gate and up interleaved and biases (one split, one replicated)
@pytest.mark.parametrize("kind", KINDS)
def test_sharded_checkpoint_loads_into_unsharded_model(world, tmp_path, kind, sp):
    for mismatches in world.run(sharded_to_unsharded, kind, sp, str(tmp_path / "ckpt")):
        assert not mismatches


@pytest.mark.parametrize("kind", KINDS)
def test_unsharded_checkpoint_loads_into_sharded_model(world, tmp_path, kind):
    for mismatches in world.run(unsharded_to_sharded, kind, True, str(tmp_path / "ckpt")):
        assert not mismatches
