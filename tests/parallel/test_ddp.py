"""trifuse.fuse under torch's DistributedDataParallel, FSDP1 (whose blocks Dynamo can capture only
with use_orig_params=True) and FSDP2 (`fully_shard` per block, no tensor parallelism), 2 gloo ranks: each rank trains on half of the batch, the
wrapper averages the gradients, so the weights after each step are those of one unfused process on
the whole batch (float64 models, float32's rule for GPT-2's fp32 loss: test_fused_shard.py).

Inside DDP's forward, Dynamo would split a capture at DDP's gradient buckets (DDPOptimizer): with a
bucket cap under its first bucket's 1 MB it raised ("First bucket should be smaller/equal to other
buckets"), and otherwise it cut a block's graph in pieces that patterns could not span. The fused
blocks' captures turn it off (capture.py, `_dynamo_settings`): a block is one graph here.
"""
import contextlib
import functools

import pytest
import torch

from _tp_models import batch, build, loss_of
from tolerances import check_close


def _train(rank, size, wrap, steps=2, kind="gpt2"):
    """(failures, checks, fused counts, graphs per block capture)."""
    import trifuse

    ref = build(kind)
    model = trifuse.fuse(build(kind))
    block = type(model.transformer.h[0])
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, bucket_cap_mb=0.01)  # a bucket or more per block
    elif wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.transformer.h:
            fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block})
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True,
                                           device_id=torch.device("cpu"))
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    failures, checks = [], 0
    for step in range(steps):
        whole = batch(kind, step, b=4)
        mine = {k: v[2 * rank: 2 * rank + 2] if isinstance(v, torch.Tensor) else v for k, v in whole.items()}
        loss_of(wrapped(**mine)).backward()
        loss_of(ref(**whole)).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        full = FullyShardedDataParallel.summon_full_params(wrapped) if wrap == "fsdp1" else contextlib.nullcontext()
        with full:
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2's DTensor shards
                ok, msg = check_close(f"step {step} {name}", whole.detach().float(), q, None)
                checks += 1
                if not ok:
                    failures.append(msg)
    report = trifuse.report(model)
    graphs = [c.graphs for u in report.units if u.unit.cls is block for c in u.unit.captures]
    return failures, checks, dict(report.counts()), graphs


@pytest.mark.parametrize("wrap", ["ddp", "fsdp1", "fsdp2"])
def test_fused_model_under_data_parallel_wrappers_trains_as_one_process(world, wrap):
    for failures, checks, counts, graphs in world.run(_train, wrap):
        assert checks > 50
        assert not failures, "\n".join(failures[:10])
        assert counts["attention"] == 2 and counts["residual_stream"] == 2 and counts["bias_gelu"] == 2, counts
        assert graphs and all(n == 1 for n in graphs), f"a block's capture in {graphs} graphs"
