"""A 2-D mesh, ("dp", "tp") = (2, 2) on 4 gloo ranks: tensor (+ sequence) parallelism inside each
"dp" row, FSDP2 across rows. Each data-parallel replica gets half of the batch; FSDP2 averages
the gradients, so the result equals one process on the whole batch (float64 oracle). GPT-2, and
Qwen3-MoE's stacked experts and SigLIP's nn.MultiheadAttention (class-swapped modules, under
FSDP2's own class swap of each block)."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from _tp_models import batch, build, compare_full, loss_of
from _world import World


@pytest.fixture(scope="module")
def world4():
    w = World(4)  # its own module-scoped world: four processes are freed as soon as this file is done
    yield w
    w.close()


def fsdp_tp_equal_to_single_process(rank, size, steps, path, kind="gpt2", sp=True):
    from trifuse.parallel import gather_full, shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    ref = build(kind)
    model = shard(build(kind), mesh, sequence_parallel=sp)
    fp32 = kind == "qwen3_moe"  # its RMSNorm computes in float32 (test_shard_families.py)
    # SigLIP's key biases have a gradient that is zero in exact arithmetic, rounding noise that
    # AdamW would divide by its eps (test_shard_families.py): SGD there.
    optimizer = torch.optim.SGD if kind == "siglip" else torch.optim.AdamW
    opt = optimizer(model.parameters(), lr=1e-2)
    ref_opt = optimizer(ref.parameters(), lr=1e-2)
    failures, checks = [], 0
    for step in range(steps):
        whole = batch(kind, step, b=4)
        mine = {k: v[2 * dp : 2 * dp + 2] if isinstance(v, torch.Tensor) else v for k, v in whole.items()}
        loss_of(model(**mine)).backward()
        loss_of(ref(**whole)).backward()
        with warnings.catch_warnings():  # DTensor: gathering a _StridedShard takes two all-gathers
            warnings.simplefilter("ignore", UserWarning)
            checks += compare_full(f"step {step} grad", model, ref, failures, grads=True, fp32=fp32)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            checks += compare_full(f"after step {step}", model, ref, failures, grads=False, fp32=fp32)
    dcp.save(model.state_dict(), checkpoint_id=path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        expected = gather_full(model)
    dist.barrier()
    plain = build(kind, seed=1)
    state = plain.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    loaded = gather_full(plain)
    failures += [f"checkpoint {k}" for k in expected if not torch.equal(loaded[k], expected[k])]
    return failures, checks


def test_fsdp2_over_dp_with_tp_sp_matches_single_process(world4, tmp_path):
    for failures, checks in world4.run(fsdp_tp_equal_to_single_process, 3, str(tmp_path / "ckpt")):
        assert checks > 100
        assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize(
    "kind, sp",
    # stacked experts; gpt-oss's experts with biases and its attention sinks; nn.MultiheadAttention in
    # SigLIP's head
    [("qwen3_moe", True), ("gpt_oss", True), ("siglip", False)],
)
def test_fsdp2_over_the_other_sharded_families(world4, tmp_path, kind, sp):
    for failures, checks in world4.run(fsdp_tp_equal_to_single_process, 2, str(tmp_path / "ckpt"), kind, sp):
        assert checks > 60
        assert not failures, "\n".join(failures[:10])
