"""Communication volume of a sharded GPT-2 step, counted on the collectives, against the formula.

Counted: every DTensor collective (torch's `_c10d_functional` ops) seen by a dispatch mode
during one forward and one backward, with the size N of the *whole* tensor it moves (all-reduce:
its input; all-gather: its output; reduce-scatter: its input), in bytes. The formula, per
transformer layer, A = batch * sequence * hidden * bytes per element, t = tensor-parallel degree:

    TP      forward  2 all-reduce (A)               backward 2 all-reduce (A)
    TP+SP   forward  2 all-gather (A), 2 reduce-scatter (A)
            backward 2 all-gather (A), 2 reduce-scatter (A), 4 all-reduce (hidden * bytes: the two
                     LayerNorms' weight and bias gradients, partial sums over sequence shards)
    + once per model with SP: the stack's entry all-gathers in the backward, its exit in the
      forward (A each).

A ring all-reduce of N bytes sends 2 (t-1)/t N per rank, an all-gather or reduce-scatter (t-1)/t N,
so both schemes send 8 (t-1)/t A per layer and step; SP adds only the LayerNorm all-reduces.
The README's table comes from `expected_collectives` and this count.
"""

from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from _tp_models import batch, build, loss_of

_NAMES = {
    "all_reduce": "all-reduce",
    "all_gather_into_tensor": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter",
}


class CollectiveBytes(TorchDispatchMode):
    """Counts (phase, collective, whole-tensor bytes) for DTensor's functional collectives."""

    def __init__(self, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.phase = "forward"
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # DTensor's own dispatch runs below the modes: declining the call lets it run first,
            # so the collectives it issues inside an op (a redistribution its sharding rules ask
            # for, as torch 2.11's do at an MoE block's input) come back here on local tensors.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = _NAMES.get(func._opname) if func.namespace == "_c10d_functional" else None
        if name is not None:
            whole = out if name == "all-gather" else args[0]
            self.counts[(self.phase, name, whole.numel() * whole.element_size())] += 1
        return out


def expected_collectives(layers: int, b: int, s: int, h: int, elem: int, sp: bool) -> Counter:
    a = b * s * h * elem
    if not sp:
        return Counter({("forward", "all-reduce", a): 2 * layers, ("backward", "all-reduce", a): 2 * layers})
    return Counter(
        {
            ("forward", "all-gather", a): 2 * layers + 1,
            ("forward", "reduce-scatter", a): 2 * layers,
            ("backward", "all-gather", a): 2 * layers + 1,
            ("backward", "reduce-scatter", a): 2 * layers,
            ("backward", "all-reduce", h * elem): 4 * layers,
        }
    )


def wire_bytes_per_rank(counts: Counter, t: int) -> float:
    """Bytes each rank sends for `counts` with ring algorithms."""
    factor = {"all-reduce": 2 * (t - 1) / t, "all-gather": (t - 1) / t, "reduce-scatter": (t - 1) / t}
    return sum(n * factor[name] * nbytes for (_, name, nbytes), n in counts.items())


def count_step(rank, size, sp, b, s, fused=False, kind="gpt2", config=None):
    import trifuse
    from trifuse.parallel import shard

    model = build(kind, dtype=torch.float32, **(config or {}))
    if fused:
        trifuse.fuse(model)
    shard(model, init_device_mesh("cpu", (size,)), sequence_parallel=sp)
    if fused:  # capture first: what is counted is a step of the fused graphs
        model(**batch("gpt2", b=b, s=s)).loss.backward()
        model.zero_grad()  # else the counted backward adds to whole gradients: no all-reduce
        assert trifuse.report(model).counts().get("residual_stream") == 2
    mode = CollectiveBytes(size)
    with mode:
        loss = loss_of(model(**batch(kind, b=b, s=s)))
        mode.phase = "backward"
        loss.backward()
    return mode.counts


def count_implicit_reduction(rank, size):
    """A partial-sum DTensor through a nonlinear op: DTensor reduces it inside its dispatch."""
    from torch.distributed.tensor import Partial

    mesh = init_device_mesh("cpu", (size,))
    x = DTensor.from_local(torch.full((4, 6), rank + 1.0), mesh, (Partial(),))
    mode = CollectiveBytes(size)
    with mode:
        y = torch.relu(x)
    return mode.counts, y.to_local()


def test_the_count_sees_collectives_issued_inside_dtensor_ops(world):
    """The counter must see what DTensor's dispatch issues inside an op, not only what the
    redistributions at module boundaries issue: torch 2.11 reduced Qwen2-MoE's partial input
    gradients there, three all-reduces per block where one is the design, and a count blind to
    them read none (2 for the model's 2 layers where the formula says 4, the attentions')."""
    for counts, y in world.run(count_implicit_reduction):
        assert counts == Counter({("forward", "all-reduce", 4 * 6 * 4): 1})
        assert torch.equal(y, torch.full((4, 6), 3.0))


@pytest.mark.parametrize("b, s", [(2, 8), (3, 16)])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_counted_bytes_match_formula(world, sp, b, s):
    layers, h, elem = 2, 32, 4  # _tp_models.build("gpt2"): 2 layers, 4 heads of 8, float32
    expected = expected_collectives(layers, b, s, h, elem, sp)
    for counts in world.run(count_step, sp, b, s):
        assert counts == expected


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_fusing_moves_no_more_bytes(world, sp):
    """The fused model (the residual stream fused through the sequence-parallel conversions)
    runs the same collectives as the unfused one."""
    b, s, layers, h, elem = 2, 8, 2, 32, 4
    for counts in world.run(count_step, sp, b, s, True):
        assert counts == expected_collectives(layers, b, s, h, elem, sp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_nanogpt_gathers_its_attention_input_once_more(world, sp):
    """nanoGPT's attention reads its width from its input, so it gets its rank's feature slice
    and c_attn all-gathers it back (plan.py, width_from_input): per layer one all-gather (A)
    forward more than GPT-2; backward, TP alone replaces the attention's all-reduce by a
    reduce-scatter + all-gather (the same bytes), TP+SP adds one all-gather."""
    b, s, layers, h, elem = 2, 8, 2, 32, 4  # _models.NanoGPT: hidden 32; 2 layers here
    a = b * s * h * elem
    expected = expected_collectives(layers, b, s, h, elem, sp)
    expected[("forward", "all-gather", a)] += layers
    expected[("backward", "all-gather", a)] += layers
    if not sp:
        expected[("backward", "all-reduce", a)] -= layers
        expected[("backward", "reduce-scatter", a)] += layers
    for counts in world.run(count_step, sp, b, s, False, "nanogpt"):
        assert counts == expected


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_latent_attention_reduces_its_latents_not_the_hidden_states(world, sp):
    """DeepSeek V3's multi-head latent attention (both layers dense here): its down projections
    run whole on every rank, so its input's gradient comes back whole and its gather's backward
    is a slice. Instead of the attention's backward all-reduce (TP) or reduce-scatter (TP+SP) of
    A, each layer all-reduces the gradients of the query latent (16 wide), the key/value latent
    (12) and the rotary key every head shares (4). The MLP is GPT-2's; the residual stream's
    RMSNorms have weights only (2 all-reduces per layer with SP, not LayerNorm's 4)."""
    b, s, layers, h, elem = 2, 8, 2, 32, 4
    tokens, a = b * s, b * s * h * elem
    expected = expected_collectives(layers, b, s, h, elem, sp)
    if sp:
        expected[("backward", "reduce-scatter", a)] -= layers
        expected[("backward", "all-reduce", h * elem)] -= 2 * layers
    else:
        expected[("backward", "all-reduce", a)] -= layers
    for width in (16, 12, 4):
        expected[("backward", "all-reduce", tokens * width * elem)] += layers
    for counts in world.run(count_step, sp, b, s, False, "deepseek_v3", {"first_k_dense_replace": 2}):
        assert counts == expected


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_block_reduces_its_input_gradient_once(world, kind, sp):
    """A mixture-of-experts block moves what a dense MLP does: its input's gradient, the sum of
    the routed experts' and the shared expert's shares (this rank's slices of every expert) and
    the router's (whole on every rank), is reduced once, a reduce-scatter under SP. Beside it the
    routing weights' gradients (tokens x 2 per layer), and Qwen2-MoE's shared-expert gate's
    output gradient (tokens x 1). The residual stream's RMSNorms have weights only (SP: 2
    all-reduces per layer, not LayerNorm's 4)."""
    b, s, layers, h, elem = 3, 8, 2, 32, 4  # 24 tokens: the routing weights' 192 bytes are no norm's 128
    tokens = b * s
    expected = expected_collectives(layers, b, s, h, elem, sp)
    if sp:
        expected[("backward", "all-reduce", h * elem)] -= 2 * layers
    expected[("backward", "all-reduce", tokens * 2 * elem)] += layers
    if kind == "qwen2_moe":
        expected[("backward", "all-reduce", tokens * elem)] += layers
    for counts in world.run(count_step, sp, b, s, False, kind):
        assert +counts == +expected


def test_tp_and_sp_send_the_same_activation_bytes():
    t, layers, b, s, h, elem = 4, 24, 8, 1024, 1024, 2
    a = b * s * h * elem
    tp = wire_bytes_per_rank(expected_collectives(layers, b, s, h, elem, sp=False), t)
    sp = wire_bytes_per_rank(expected_collectives(layers, b, s, h, elem, sp=True), t)
    assert tp == 8 * (t - 1) / t * a * layers
    assert sp == tp + 2 * (t - 1) / t * a + 4 * layers * 2 * (t - 1) / t * h * elem



@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_gpt_oss_sinks_move_nothing_and_the_down_bias_one_reduction(world, sp):
    """gpt-oss moves what Mixtral does (its MoE block's input gradient reduced once, the routing
    weights' gradients beside it) plus one all-reduce per layer of the experts' down-projection
    bias gradient (experts x hidden: each rank adds 1/t of the bias inside its partial sum). The
    attention sinks, split by heads, and the Q/K/V biases, column-parallel, move nothing; the
    output projection's bias, whose gradient is whole on every rank, neither."""
    b, s, layers, h, elem, experts = 3, 8, 2, 32, 4, 4
    tokens = b * s
    expected = expected_collectives(layers, b, s, h, elem, sp)
    if sp:
        expected[("backward", "all-reduce", h * elem)] -= 2 * layers  # RMSNorms: weights only
    expected[("backward", "all-reduce", tokens * 2 * elem)] += layers
    expected[("backward", "all-reduce", experts * h * elem)] += layers
    for counts in world.run(count_step, sp, b, s, False, "gpt_oss"):
        assert +counts == +expected
