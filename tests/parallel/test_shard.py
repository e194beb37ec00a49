"""trifuse.parallel.shard on real Hugging Face architectures, 2 gloo ranks.

The oracle is the same model, same weights and inputs, run in one process, in float64: tensor
parallelism changes only the order of sums, so the loss, every gradient (gathered back to the
unsharded layout) and the weights after three AdamW steps must agree to float64 rounding
(tests/tolerances.py, float64 floor). A negative control shards GPT-2's fused QKV naively by
columns and must fail the same check.
"""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

from _tp_models import batch, build, compare_full, train_alongside
from tolerances import check_close

# ---------------------------------------------------------------------------------------------
# Worker functions: run on every rank by World.run(fn, ...) as fn(rank, size, ...).
# ---------------------------------------------------------------------------------------------


def _mesh(size):
    return init_device_mesh("cpu", (size,))


def equal_to_single_process(rank, size, kind, sp, steps, plan=None):
    """(failed checks, number of checks) for `steps` AdamW steps of the sharded model against
    the single-process one."""
    from trifuse.parallel import shard

    ref = build(kind)
    model = shard(build(kind), _mesh(size), sequence_parallel=sp, plan=plan)
    return train_alongside(kind, model, ref, steps)


def foreach_optimizers_equal_to_single_process(rank, size, steps):
    """torch.optim's for-each path (CUDA's default, forced here on CPU) over a sharded model's
    DTensors and plain replicated tensors together: AdamW and SGD with momentum step as the
    unsharded model's. Returns (failures, checks, implicit replication still on after a step)."""
    from torch.distributed.tensor import DTensor

    from trifuse.parallel import shard

    failures, checks = [], 0
    for optimizer in (functools.partial(torch.optim.AdamW, foreach=True),
                      functools.partial(torch.optim.SGD, momentum=0.9, foreach=True)):
        ref = build("gpt2")
        model = shard(build("gpt2"), _mesh(size))
        f, c = train_alongside("gpt2", model, ref, steps, optimizer=optimizer)
        failures += f
        checks += c
    return failures, checks, DTensor._op_dispatcher._allow_implicit_replication


def vocab_parallel_equal_to_single_process(rank, size, steps):
    """GPT-2 with the tied embedding / LM head split over the vocabulary, loss under
    loss_parallel(). Hugging Face computes the loss in float32 (logits.float()), whatever the
    model's dtype, so the comparison is at float32's rule: gradients are cast to float32 first."""
    from torch.distributed.tensor.parallel import loss_parallel

    from trifuse.parallel import shard

    ref = build("gpt2")
    model = shard(build("gpt2"), _mesh(size), vocab_parallel=True)
    tied = model.lm_head.weight is model.transformer.wte.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    failures, checks = [], 0
    for step in range(steps):
        with loss_parallel():
            out = model(**batch("gpt2", step))
            out.loss.backward()
        ref_loss = ref(**batch("gpt2", step)).loss
        ref_loss.backward()
        local_logits = tuple(out.logits.to_local().shape)
        ok, msg = check_close(f"step {step} loss", out.loss.full_tensor(), ref_loss, None)
        failures += [] if ok else [msg]
        checks += 1 + compare_full(f"step {step} grad", model, ref, failures, True, fp32=True)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return failures, checks, tied, local_logits


def dropout_masks(rank, size, sp):
    """Masks of GPT-2's first residual dropout and first attention dropout (eager attention, which
    returns the dropped probabilities) over two forwards under one seed, and the losses."""
    from trifuse.parallel import shard

    model = shard(
        build("gpt2", dropout=0.3, dtype=torch.float32, attn_implementation="eager"),
        _mesh(size),
        sequence_parallel=sp,
    )
    model.train()
    seen = {}

    def resid(module, args, output):
        seen["resid"] = (output == 0) & (args[0] != 0)

    def attn(module, args, output):
        probs = output[1]
        seen["attn"] = (probs == 0) & torch.ones_like(probs, dtype=torch.bool).tril()

    block = model.transformer.h[0]
    block.attn.resid_dropout.register_forward_hook(resid)
    block.attn.register_forward_hook(attn)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        loss = model(**batch("gpt2")).loss
        runs.append({"loss": loss.item(), **seen})
    return runs


def grad_after_dropout_backward(rank, size):
    """Backward through sharded dropout regions works and leaves finite gradients."""
    from trifuse.parallel import gather_full, shard

    model = shard(build("bert", dropout=0.2), _mesh(size))
    model(**batch("bert")).loss.backward()
    return all(torch.isfinite(g).all().item() for g in gather_full(model, grads=True).values())


def shard_error(rank, size, case):
    """The message of the error `shard` raises in `case`, or None."""
    from trifuse.parallel import shard

    mesh = _mesh(size)
    try:
        if case == "heads":
            shard(build("gpt2", heads=3), mesh)
        elif case == "no_blocks":
            shard(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), mesh)
        elif case == "mesh_world":
            shard(build("gpt2"), DeviceMesh("cpu", torch.tensor([0])))
        elif case == "mesh_type":
            shard(build("gpt2"), "cpu")
        elif case == "mesh_3d":
            shard(build("gpt2"), init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("a", "b", "c")))
        elif case == "twice":
            model = shard(build("gpt2"), mesh)
            shard(model, mesh)
        elif case == "plan_type":
            shard(build("gpt2"), mesh, plan={"*.c_fc": "colwise"})
        elif case == "plan_nomatch":
            shard(build("gpt2"), mesh, plan={"*.nonexistent": None})
        elif case == "sp_uncovered":
            shard(build("gpt2"), mesh, plan={"*.mlp": None, "*.mlp.c_fc": None, "*.mlp.c_proj": None})
        elif case == "tie_split":
            shard(build("gpt2"), mesh, plan={"lm_head": TorchColwise()})
        elif case == "vocab_not_hf":
            shard(
                nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8)),
                mesh,
                vocab_parallel=True,
                plan={"1": TorchColwise()},
            )
        elif case == "sp_sequence":
            model = shard(build("gpt2"), mesh)
            model(**batch("gpt2", s=7))
        else:
            raise AssertionError(case)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def toy_mlp_with_user_plan(rank, size):
    """A model trifuse does not recognize, sharded by a user plan of torch's own styles."""
    from trifuse.parallel import gather_full, shard

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)).double()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)).double()
    shard(model, _mesh(size), plan={"0": TorchColwise(), "2": TorchRowwise()})
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, ref_out = model(x), ref(x)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    failures = [] if check_close("out", out, ref_out, None)[0] else ["out"]
    compare_full("grad", model, ref, failures, grads=True)
    return failures, type(model[0].weight).__name__, gather_full(model)["0.weight"].shape


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_loss_grads_and_three_steps_match_single_process(world, kind, sp):
    for failures, checks in world.run(equal_to_single_process, kind, sp, 3):
        assert checks > 100
        assert not failures, "\n".join(failures[:10])


def test_foreach_optimizers_step_over_dtensors_and_plain_tensors(world):
    """AdamW's first step failed on the H200 (mixed torch.Tensor and DTensor in one for-each call)."""
    for failures, checks, still_on in world.run(foreach_optimizers_equal_to_single_process, 2):
        assert checks > 100
        assert not failures, "\n".join(failures[:10])
        assert not still_on, "implicit replication must end with the step"


def test_naive_column_split_of_fused_qkv_fails_the_check(world):
    """Negative control: c_attn cut by columns (rank 0 gets Q and half of K) must not pass."""
    naive = {"*.attn.c_attn": TorchColwise()}
    for failures, _ in world.run(equal_to_single_process, "gpt2", False, 1, naive):
        assert any("loss" in f for f in failures)


def test_user_plan_overrides_derived_plan(world):
    """The MLPs left unsharded by the user's plan (sequence parallelism off), attention sharded."""
    keep_mlp = {"*.mlp": None, "*.mlp.c_fc": None, "*.mlp.c_proj": None}
    for failures, checks in world.run(equal_to_single_process, "gpt2", False, 1, keep_mlp):
        assert checks > 30
        assert not failures, "\n".join(failures[:10])


def test_user_plan_on_unrecognized_model(world):
    for failures, param_type, shape in world.run(toy_mlp_with_user_plan):
        assert not failures
        assert param_type == "DTensor"
        assert tuple(shape) == (8, 6)


def test_vocab_parallel_embedding_and_head_with_loss_parallel(world):
    for failures, checks, tied, local_logits in world.run(vocab_parallel_equal_to_single_process, 2):
        assert tied  # GPT-2's embedding and LM head still share one (sharded) parameter
        assert local_logits == (2, 8, 64 // 2)  # each rank holds its half of the vocabulary only
        assert checks > 50
        assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_dropout_masks_reproducible_per_rank_and_replicas_consistent(world, sp):
    r0, r1 = world.run(dropout_masks, sp)
    for runs in (r0, r1):
        first, second = runs
        assert first["loss"] == second["loss"]  # reproducible under one seed
        assert torch.equal(first["resid"], second["resid"]) and torch.equal(first["attn"], second["attn"])
        assert first["resid"].any() and first["attn"].any()
    assert r0[0]["loss"] == r1[0]["loss"]  # every rank computed the same model
    # Attention dropout runs on each rank's own heads: independent masks.
    assert not torch.equal(r0[0]["attn"], r1[0]["attn"])
    if sp:  # residual dropout on each rank's own sequence slice: independent masks
        assert r0[0]["resid"].shape[1] == 8 // 2
        assert not torch.equal(r0[0]["resid"], r1[0]["resid"])
    else:  # residual dropout on the replicated stream: the same mask, or the replicas drift
        assert r0[0]["resid"].shape[1] == 8
        assert torch.equal(r0[0]["resid"], r1[0]["resid"])


def test_backward_through_dropout_regions(world):
    assert all(world.run(grad_after_dropout_backward))


@pytest.mark.parametrize(
    "case, expected",
    [
        ("heads", "has 3 attention heads, which do not divide across a tensor-parallel degree of 2"),
        ("no_blocks", "found no attention or MLP block it knows in Sequential"),
        ("mesh_world", "the mesh covers 1 rank(s) but the world has 2"),
        (
            "mesh_type",
            "TypeError: trifuse.parallel.shard: mesh must be a torch.distributed.DeviceMesh, got str",
        ),
        ("mesh_3d", "mesh must be 1-D (tensor parallel) or 2-D with mesh_dim_names ('dp', 'tp')"),
        ("twice", "model is already sharded"),
        (
            "plan_type",
            "TypeError: trifuse.parallel.shard: plan['*.c_fc'] must be a ParallelStyle or None, got str",
        ),
        ("plan_nomatch", "plan entry '*.nonexistent' matches no module"),
        (
            "sp_uncovered",
            "parameter transformer.h.0.mlp.c_fc.weight sees sequence shards but no style covers it",
        ),
        ("sp_sequence", "it must be divisible by 2, got shape (2, 7, 32)"),
        (
            "tie_split",
            "the tied parameters transformer.wte.weight, lm_head.weight would be sharded in one place",
        ),
        ("vocab_not_hf", "vocab_parallel=True needs get_input_embeddings() -> nn.Embedding"),
    ],
)
def test_clear_errors(world, case, expected):
    for message in world.run(shard_error, case):
        assert message is not None and expected in message, message
