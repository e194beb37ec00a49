"""trifuse.parallel.shard on the other block spellings the rewriter knows, 2 gloo ranks:
nanoGPT (nn.Linear fused c_attn, head count `n_head`, width read from the input), HF Llama
(q/k/v/o_proj with grouped key/value heads, gated MLP, RMSNorm), HF ViT (q/k/v/o_proj,
fc1/fc2), and the q/k/v_proj + out_proj family: OPT (fc1/fc2 beside the attention in the decoder
layer, on tokens flattened to rows), BART and Whisper (encoder-decoder, cross-attention on the
encoder's output, Whisper behind convolutions), CLIP's vision tower; GPT-NeoX (a fused
query_key_value laid out per head, parallel residual); and Phi-3 (a fused [Q | K | V] with fewer
K/V heads, its head count read from the config, a fused [gate | up]). Same oracle as test_shard.py: the unsharded model in one process, float64, same
weights and inputs; the loss, every gradient gathered back and the weights after each AdamW
step (SGD here: see equal_to_single_process) agree to float64 rounding (tests/tolerances.py).

And what shard must not do: leave an attention it cannot shard replicated without saying so.
"""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from _models import gpt_oss_rotary_tables_have_unit_stride
from _tp_models import LATENT, batch, build, train_alongside


def _mesh(size):
    return init_device_mesh("cpu", (size,))


# Where each kind's first attention is, and its K (or fused QKV) projection.
ATTENTION = {
    "nanogpt": ("transformer.h.0.attn", "c_attn"),
    "llama": ("model.layers.0.self_attn", "k_proj"),
    "gemma3": ("model.layers.0.self_attn", "k_proj"),
    "olmo2": ("model.layers.0.self_attn", "k_proj"),
    "apertus": ("model.layers.0.self_attn", "k_proj"),
    "vit": ("vit.layers.0.attention", "k_proj"),
    "opt": ("model.decoder.layers.0.self_attn", "k_proj"),
    "bart": ("model.decoder.layers.0.encoder_attn", "k_proj"),  # the cross-attention
    "whisper": ("model.decoder.layers.0.encoder_attn", "k_proj"),
    "clip": ("vision_model.encoder.layers.0.self_attn", "k_proj"),
    "neox": ("gpt_neox.layers.0.attention", "query_key_value"),
    "phi3": ("model.layers.0.self_attn", "qkv_proj"),
    "bloom": ("transformer.h.0.self_attention", "query_key_value"),
    "torch_encoder": ("body.layers.0.self_attn", "out_proj"),
    "torch_seq_first": ("body.layers.0.self_attn", "out_proj"),
    "torch_transformer": ("body.decoder.layers.0.multihead_attn", "out_proj"),  # the cross-attention
    "torch_mha_options": ("cross", "out_proj"),
    "siglip": ("vision.head.attention", "out_proj"),  # the pooling head's nn.MultiheadAttention
    "qwen3_moe": ("model.layers.0.mlp", "experts"),
    "mixtral": ("model.layers.0.mlp", "experts"),
    "olmoe": ("model.layers.0.mlp", "experts"),
    "qwen2_moe": ("model.layers.0.mlp", "experts"),
    "glm4_moe": ("model.layers.1.mlp", "experts"),  # its first layer's MLP is dense
    "ernie4_5_moe": ("model.layers.0.mlp", "experts"),
    "dots1": ("model.layers.0.mlp", "experts"),
    "gpt_oss": ("model.layers.0.mlp", "experts"),
    "deepseek_v3": ("model.layers.0.self_attn", "kv_b_proj"),
    "deepseek_v2": ("model.layers.0.self_attn", "kv_b_proj"),
    "deepseek_v32": ("model.layers.0.self_attn", "kv_b_proj"),
    "glm4_moe_lite": ("model.layers.0.self_attn", "kv_b_proj"),
    "glm_moe_dsa": ("model.layers.0.self_attn", "kv_b_proj"),
    "minicpm3": ("model.layers.0.self_attn", "kv_b_proj"),
}


def _naive_qkv_plan(kind):
    """A fused QKV split the wrong way: nanoGPT's [Q | K | V] cut by columns (rank 0: Q and half
    of K), Phi-3's too; GPT-NeoX's per-head layout permuted as if it were [Q | K | V]."""
    from torch.distributed.tensor import Shard

    from trifuse.parallel import ColwiseParallel

    if kind == "nanogpt":
        return {"*.attn.c_attn": ColwiseParallel(input_layouts=Shard(2))}
    if kind == "phi3":  # cut by columns: rank 0 holds all of Q
        return {"*.self_attn.qkv_proj": ColwiseParallel()}
    return {"*.attention.query_key_value": ColwiseParallel(fused_parts=3)}


def equal_to_single_process(rank, size, kind, sp, steps, naive_qkv=False, heads=4, config=None):
    """(failures, checks, local shape of a K projection). With `naive_qkv`, the fused QKV is split
    the wrong way (`_naive_qkv_plan`); `config` changes the model's config."""
    from trifuse.parallel import shard

    plan = _naive_qkv_plan(kind) if naive_qkv else None
    ref = build(kind, heads=heads, **(config or {}))
    model = shard(build(kind, heads=heads, **(config or {})), _mesh(size), sequence_parallel=sp, plan=plan)
    # SGD, not AdamW: the key bias (nanoGPT, ViT) has a gradient that is zero in exact arithmetic
    # (adding q.b_k to every score of a query leaves its softmax unchanged), so each run's is
    # float64 rounding noise (~1e-17), which AdamW divides by its eps (1e-8): two summation
    # orders then differ by lr * 1e-9 after one step, in one process as across ranks.
    # Gemma 3's, OLMo 2's and DeepSeek V2's norms compute in float32 whatever the model's dtype,
    # so the ranks' partial sums of their weights' gradients differ from one process's sum by
    # float32 rounding.
    fp32 = kind in ("gemma3", "olmo2", "deepseek_v2")
    failures, checks = train_alongside(kind, model, ref, steps, fp32=fp32, optimizer=torch.optim.SGD)
    attn, proj = ATTENTION[kind]
    module = model.get_submodule(f"{attn}.{proj}")
    if proj == "experts":  # stacked expert weights: the local gate_up_proj and down_proj
        local = (module.gate_up_proj.to_local(), module.down_proj.to_local())
        return failures, checks, tuple(tuple(t.shape) for t in local)
    return failures, checks, tuple(module.weight.to_local().shape)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "glm4_moe", "ernie4_5_moe", "dots1"])
def test_mixture_of_experts_matches_single_process(world, kind, sp):
    """4 experts of inner width 16, 2 per token: each rank holds every expert's half (gate_up_proj
    [gate_r | up_r] 2 x 8 rows, down_proj 8 columns); the router replicated, its gradient whole on
    every rank. OLMoE adds Q/K norms over all heads' features. Qwen2-MoE adds a shared expert
    (a dense MLP, split as one) whose output a replicated sigmoid gate scales; GLM-4-MoE a dense
    first layer, then shared experts beside the routed ones, and DeepSeek's grouped router; Dots1
    the same with Q/K norms; Ernie 4.5 a router holding a parameter of its own (a frozen bias)."""
    for failures, checks, shapes in world.run(equal_to_single_process, kind, sp, 2):
        assert shapes == ((4, 16, 32), (4, 32, 8))
        assert checks > 60
        assert not failures, "\n".join(failures[:10])


def gpt_oss_pieces(rank, size, sp):
    """What each rank of a sharded gpt-oss holds of its attention sinks and experts' biases, and
    what its state dict shows: {name: (placements, local shape, state-dict shape)}."""
    from trifuse.parallel import shard

    model = shard(build("gpt_oss"), _mesh(size), sequence_parallel=sp)
    state = model.state_dict()
    names = ("self_attn.sinks", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
             "mlp.experts.down_proj", "mlp.experts.down_proj_bias")
    out = {}
    for name in names:
        key = f"model.layers.1.{name}"
        param = dict(model.named_parameters())[key]
        local, whole = tuple(param.to_local().shape), tuple(state[key].shape)
        out[name] = (tuple(map(repr, param.placements)), local, whole)
    attention = model.model.layers[1].self_attn
    # Outside its forward the attribute is the parameter (FSDP2's lazy init reads it so); inside,
    # what the core reads is this rank's heads (a hook after the style's sees it).
    sinks = dict(model.named_parameters())["model.layers.1.self_attn.sinks"]
    out["parameter outside forward"] = attention.sinks is sinks
    seen = []
    attention.register_forward_pre_hook(lambda module, args: seen.append(module.sinks.detach().tolist()))
    model(**batch("gpt_oss"))
    out["local sinks"] = seen[0]
    out["whole sinks"] = state["model.layers.1.self_attn.sinks"].full_tensor().tolist()
    # One swapped class for every layer: Dynamo guards on a module's type, so a class per layer
    # would recompile `fuse`'s capture per layer and leave layers past its limit unfused.
    layers = model.model.layers
    out["classes"] = {m: len({type(layer.get_submodule(m)) for layer in layers}) for m in ("self_attn", "mlp.experts")}
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_gpt_oss_matches_single_process(world, sp):
    """gpt-oss: attention sinks (a logit per head, joined to each head's scores before the
    softmax) split by heads as Q is, sliding-window layers beside full ones, biases on Q/K/V/O;
    experts whose gate_up_proj (experts, hidden, 2 x inner) interleaves gate and up features
    (each rank's contiguous half holds whole (gate, up) pairs, 2 x 8 of them), with biases and a
    clamped gating of their own; the down projection's bias, inside each expert's partial sum,
    counted once (1/t per rank; the builder gives the biases values, Hugging Face zeros); a
    router with a bias, replicated. Loss, every gradient and the weights after a step."""
    for failures, checks, shapes in world.run(equal_to_single_process, "gpt_oss", sp, 2):
        assert shapes == ((4, 32, 16), (4, 8, 32))
        assert checks > 60
        assert not failures, "\n".join(failures[:10])
    for rank, pieces in enumerate(world.run(gpt_oss_pieces, sp)):
        assert pieces["self_attn.sinks"] == (("Shard(dim=0)",), (2,), (4,))
        assert pieces["mlp.experts.gate_up_proj"] == (("Shard(dim=2)",), (4, 32, 16), (4, 32, 32))
        assert pieces["mlp.experts.gate_up_proj_bias"] == (("Shard(dim=1)",), (4, 16), (4, 32))
        assert pieces["mlp.experts.down_proj"] == (("Shard(dim=1)",), (4, 8, 32), (4, 16, 32))
        assert pieces["mlp.experts.down_proj_bias"] == (("Replicate()",), (4, 32), (4, 32))
        assert pieces["local sinks"] == pieces["whole sinks"][2 * rank : 2 * rank + 2]  # q_proj's heads
        assert pieces["parameter outside forward"]
        assert pieces["classes"] == {"self_attn": 1, "mlp.experts": 1}


def experts_implementation_calls(rank, size, implementation):
    """The local gate_up_proj shapes Hugging Face's `implementation` of the experts saw in one
    forward of a sharded Qwen2-MoE (sequence parallel), one per call."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from trifuse.parallel import shard

    model = shard(build("qwen2_moe", experts_implementation=implementation), _mesh(size))
    mapping = ALL_EXPERTS_FUNCTIONS._global_mapping
    original, seen = mapping[implementation], []

    def spy(experts, *args):
        seen.append(tuple(experts.gate_up_proj.shape))
        return original(experts, *args)

    mapping[implementation] = spy
    try:
        model(**batch("qwen2_moe"))
    finally:
        mapping[implementation] = original
    return seen


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("kind, shapes", [
    ("qwen2_moe", ((4, 16, 32), (4, 32, 8))),
    # transposed weights, per-expert biases gathered by the implementation from the local pieces
    ("gpt_oss", ((4, 32, 16), (4, 8, 32))),
], ids=["qwen2_moe", "gpt_oss"])
def test_mixture_of_experts_run_the_configured_implementation_on_their_pieces(
    world, kind, shapes, implementation
):
    """The sharded experts run the implementation the config chose (Hugging Face's default is
    grouped_mm), on the local pieces: the same loss and gradients as one process running it
    (grouped_mm in float32, which it needs), sequence parallel."""
    config = {"experts_implementation": implementation}
    if implementation == "grouped_mm":
        config["dtype"] = torch.float32
    for failures, checks, local_shapes in world.run(equal_to_single_process, kind, True, 2, False, 4, config):
        assert local_shapes == shapes
        assert checks > 60
        assert not failures, "\n".join(failures[:10])
    if kind == "qwen2_moe" and implementation == "batched_mm":  # float64
        for seen in world.run(experts_implementation_calls, implementation):
            assert seen == [(4, 16, 32)] * 2, seen  # each layer's experts, on this rank's halves


# Fused before and after sharding: the experts layouts of their own (Qwen2-MoE's gated shared
# expert, gpt-oss's interleaved experts with biases) both ways, the others one way each (fuse keeps
# the modules, their classes and parameters, so `shard` recognizes the same model either way).
@pytest.mark.parametrize("kind, order", [
    ("qwen2_moe", "fuse_then_shard"), ("qwen2_moe", "shard_then_fuse"), ("gpt_oss", "fuse_then_shard"),
    ("gpt_oss", "shard_then_fuse"), ("qwen3_moe", "fuse_then_shard"), ("mixtral", "shard_then_fuse"),
    ("glm4_moe", "fuse_then_shard"),
])
def test_mixture_of_experts_fused_and_sharded(world, kind, order):
    """Sequence parallel, fused before or after: the attention, norms and rotary fuse as in one
    process. The sharded experts run Hugging Face's eager loop on their pieces, where each routed
    expert's act(gate) * up fuses (gated_activation, as many as experts were hit; gpt-oss's
    clamped gating as bias_gelu's quick form); the shared experts' (and GLM-4-MoE's dense first
    MLP) fuse on their column shards, one per layer. gpt-oss's attention with its sinks fuses on
    the local heads; its norms fuse alone, as in one process of this float64 model (they compute
    in float32: a cast down before the norm, which no residual-stream op takes; in float32 its
    residual adds fuse on shards as in one process); the second halves of its rotary, `second * cos +
    first * sin`, as gated adds on the local heads (where the sin table has a unit last-dim stride)."""
    counts_of = {"qwen3_moe": {"rms_norm": 7, "rotary": 2, "attention": 2, "residual_stream": 2},
                 "mixtral": {"rms_norm": 3, "rotary": 2, "attention": 2, "residual_stream": 2},
                 "gpt_oss": {"rms_norm": 5, "attention": 2,
                             **({"dropout_add": 4} if gpt_oss_rotary_tables_have_unit_stride() else {})}}
    counts_of["qwen2_moe"] = counts_of["glm4_moe"] = counts_of["mixtral"]
    for failures, checks, counts in world.run(fused_equal_to_single_process, kind, order, True):
        assert checks > 30
        assert not failures, "\n".join(failures[:10])
        counts.pop("cross_entropy", None)
        gated = counts.pop("gated_activation", 0) + counts.pop("bias_gelu", 0)
        assert gated >= (2 if kind in ("qwen2_moe", "glm4_moe", "gpt_oss") else 0), gated
        assert counts == counts_of[kind], counts


def test_mixture_of_experts_grouped_mm_fused_and_sharded(world):
    """Hugging Face's default experts implementation (grouped_mm, float32) on the local pieces,
    fused after sharding: the routed experts' gating fuses once per layer (one op over every
    routed token) on their column shards, as the shared expert's does."""
    config = {"experts_implementation": "grouped_mm", "dtype": torch.float32}
    for failures, checks, counts in world.run(fused_equal_to_single_process, "qwen2_moe", "shard_then_fuse", True,
                                              config):
        assert checks > 30
        assert not failures, "\n".join(failures[:10])
        assert counts == {"rms_norm": 3, "rotary": 2, "attention": 2, "residual_stream": 2, "gated_activation": 4,
                          "cross_entropy": 1}, counts


@pytest.mark.parametrize("kind, order", [
    ("deepseek_v3", "fuse_then_shard"), ("deepseek_v3", "shard_then_fuse"), ("deepseek_v2", "fuse_then_shard"),
    ("deepseek_v32", "shard_then_fuse"),
])
def test_latent_attention_fused_and_sharded(world, kind, order):
    """Sequence parallel, fused before or after: the latents' norms (replicated) fuse beside the
    residual stream's, the rotary on this rank's query heads and the key every head shares, the
    attention on this rank's heads; the dense MLP's and the shared expert's gating on their
    column shards. V3.2's indexer (no gradient) fuses its key norm and its rotaries too."""
    expected = {"rms_norm": 7, "rotary": 2, "attention": 2, "residual_stream": 2}
    if kind == "deepseek_v2":  # no query latent to norm
        expected["rms_norm"] = 5
    if kind == "deepseek_v32":
        expected.update(layer_norm=2, rotary=6)
    for failures, checks, counts in world.run(fused_equal_to_single_process, kind, order, True):
        assert checks > 30
        assert not failures, "\n".join(failures[:10])
        counts.pop("cross_entropy", None)
        assert counts.pop("gated_activation", 0) >= 2, counts
        assert counts == expected, counts


def multihead_attention_state(rank, size, kind, sp):
    """Whether `shard` left the model's nn.MultiheadAttention modules as its own local-heads
    kind; their local head counts; the local in_proj_weight's shape."""
    from trifuse.parallel import shard
    from trifuse.parallel.multihead import ShardedMultiheadAttention

    model = shard(build(kind), _mesh(size), sequence_parallel=sp)
    mhas = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    return (
        all(isinstance(m, ShardedMultiheadAttention) for m in mhas),
        {m.num_heads for m in mhas},
        tuple(mhas[0].in_proj_weight.to_local().shape),
    )


def fused_equal_to_single_process(rank, size, kind, order, sp, config=None):
    """`equal_to_single_process` for the model fused by trifuse.fuse before or after sharding,
    against the unfused one; also the fused op counts. Llama is compared at float32's rule:
    Hugging Face's RMSNorm computes in float32 whatever the model's dtype (and its loss upcasts
    the logits to float32), trifuse's fused norm and cross-entropy in the model's float64, so
    fused and unfused differ by float32 rounding even in one process (test_fused_shard.py's
    GPT-2 exception). `config` changes the model's config."""
    import trifuse
    from trifuse.parallel import shard

    ref, model = build(kind, **(config or {})), build(kind, **(config or {}))
    if order == "fuse_then_shard":
        model = trifuse.fuse(model)
        shard(model, _mesh(size), sequence_parallel=sp)
    else:
        shard(model, _mesh(size), sequence_parallel=sp)
        model = trifuse.fuse(model)
    # Their norms compute in float32 (see above); OPT's, BART's, NeoX's and Nemotron's losses upcast
    # the logits to float32, trifuse's fused cross-entropy keeps float64; BLOOM's softmax is float32,
    # trifuse's attention float64.
    fp32 = kind in ("llama", "gemma2", "gemma3", "olmo2", "phi3", "nemotron", "apertus", "opt", "bart", "neox",
                    "bloom", "qwen3_moe",
                    "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3", "deepseek_v2", "deepseek_v32", "gpt_oss")
    failures, checks = train_alongside(kind, model, ref, 1, fp32=fp32, optimizer=torch.optim.SGD)
    return failures, checks, trifuse.report(model).counts()


def shard_error(rank, size, case, sp):
    """The message of the ValueError `shard` raises in `case`, or None."""
    from torch import nn

    from trifuse.parallel import shard

    if case == "nanogpt_renamed_heads":  # an attention whose head count no spelling knows
        model = build("nanogpt")
        for block in model.transformer.h:
            block.attn.heads = block.attn.n_head
            del block.attn.n_head
    elif case.startswith("multihead_"):  # nn.MultiheadAttention variants not sharded
        model = build("torch_mha_options")
        if case == "multihead_kdim":  # separate Q, K and V weights: keys of another width
            model.cross = nn.MultiheadAttention(32, 4, kdim=16, vdim=16).double()
        elif case == "multihead_bias_kv":
            model.cross = nn.MultiheadAttention(32, 4, add_bias_kv=True).double()
        else:
            model.cross = type("MyAttention", (nn.MultiheadAttention,), {})(32, 4).double()
    elif case == "llama_kv_heads":
        model = build("llama", heads=4, kv_heads=1)
    elif case in ("apertus_fsdp", "bitnet_sub_norm"):  # parameters between the MLP's projections
        model = build("apertus")
        if case == "bitnet_sub_norm":  # a norm over the intermediate features, as BitNet's ffn_sub_norm
            from transformers.models.bitnet.modeling_bitnet import BitNetRMSNorm

            for layer in model.model.layers:
                layer.mlp.act_fn = nn.Sequential(nn.ReLU(), BitNetRMSNorm(64).double())
    elif case == "unknown_projection":  # a recognized block with one more weight matrix
        model = build("nanogpt")
        model.transformer.h[0].gate = nn.Linear(32, 32).double()
    elif case == "attention_sinks_per_kv_head":  # sink logits, but not one per head (per K/V head here)
        model = build("gpt_oss")
        model.model.layers[0].self_attn.sinks = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    elif case == "attention_core_vector":  # a vector over the heads under a name no style knows
        model = build("llama")
        model.model.layers[0].self_attn.head_scale = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    elif case == "moe_interleaved_other_gating":  # gpt-oss's layout with a gating trifuse does not know
        model = build("gpt_oss")
        experts = model.model.layers[1].mlp.experts
        experts.__class__ = type("MyExperts", (type(experts),), {"_apply_gate": lambda self, x: x[..., ::2]})
    elif case == "falcon":  # GPT-NeoX's names, its features laid out [Q | K | V] (multi-query here)
        import transformers

        config = transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
        model = transformers.FalconForCausalLM(config).double()
    elif case == "moe_shared_gate_per_feature":  # Qwen2-MoE's shared-expert gate, one scale per feature
        model = build("qwen2_moe")
        model.model.layers[1].mlp.shared_expert_gate = nn.Linear(32, 32, bias=False).double()
    elif case == "moe_transposed_experts":  # Llama 4's experts: (experts, hidden, 2 x inner) weights
        import transformers

        config = transformers.Llama4TextConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
            intermediate_size=16, intermediate_size_mlp=64, num_local_experts=4,
        )
        model = transformers.Llama4ForCausalLM(config).double()
    elif case == "core_norm_of_another_width":  # neither one head's width nor a projection's
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

        model = build("gemma3")
        model.model.layers[1].self_attn.q_norm = Gemma3RMSNorm(4).double()
    elif case == "latent_widths_disagree":  # an MLA whose V heads are not what its o_proj reads
        model = build("deepseek_v3")
        model.model.layers[1].self_attn.v_head_dim = 5
    elif case == "latent_core_norm":  # a norm on the shared rotary key, which no style shards
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        model = build("deepseek_v3")
        model.model.layers[0].self_attn.k_rope_norm = DeepseekV3RMSNorm(4).double()
    else:
        raise AssertionError(case)
    # (FSDP2 over a data-parallel dim of 1 beside the tensor-parallel one)
    mesh = init_device_mesh("cpu", (1, size), mesh_dim_names=("dp", "tp")) if case == "apertus_fsdp" else _mesh(size)
    try:
        shard(model, mesh, sequence_parallel=sp)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["nanogpt", "llama", "vit"])
def test_loss_grads_and_steps_match_single_process(world, kind, sp):
    # Local K projection: nanoGPT's fused [Q|K|V] of 4 heads, 2 per rank; Llama's 2 K/V heads of 8
    # features, 1 per rank; ViT's 4 heads, 2 per rank.
    local = {"nanogpt": (3 * 32 // 2, 32), "llama": (8, 32), "vit": (16, 32)}[kind]
    for failures, checks, shape in world.run(equal_to_single_process, kind, sp, 2):
        assert shape == local
        assert checks > 60
        assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["opt", "bart", "whisper", "clip", "neox", "phi3", "bloom", "apertus"])
def test_more_families_match_single_process(world, kind, sp):
    # Local K projection: 4 heads of 8, 2 per rank (a K projection; NeoX's and BLOOM's whole heads
    # of their fused q, k, v: 2 x 3 x 8 rows; Phi-3's 2 query heads and 1 of its 2 K/V heads:
    # 2 x 8 + 2 x 8). BLOOM's ALiBi bias, built for all 4 heads, is sliced to each rank's 2.
    local = {"neox": (48, 32), "phi3": (32, 32), "bloom": (48, 32), "apertus": (8, 32)}.get(kind, (16, 32))
    for failures, checks, shape in world.run(equal_to_single_process, kind, sp, 2):
        assert shape == local
        assert checks > 60
        assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", LATENT)
def test_latent_attention_matches_single_process(world, kind, sp):
    """DeepSeek's multi-head latent attention (V3: Q through a latent; V2-Lite: Q straight from
    the hidden states; V3.2: V3's with a sparse-attention indexer, whole on every rank, picking
    5 of 8 keys per query for every head), then a dense layer and an MoE layer with a shared
    expert; the families built on its code (GLM-4.7-Flash, GLM-5's with an indexer, MiniCPM3's
    dense layers). Each rank's
    kv_b_proj holds its 2 heads' K (8) and V (6) rows: 2 x 14 from the 12-wide latent. The down
    projections run whole on every rank; the rotary key every head shares gets its whole
    gradient back, so do the latents, their norms and the down projections' weights."""
    for failures, checks, shape in world.run(equal_to_single_process, kind, sp, 2):
        assert shape == (28, 12)
        assert checks > 100
        assert not failures, "\n".join(failures[:10])


# Each fused by trifuse.fuse as in one process (tests/fusion/test_fuse_models.py): OPT's MLP-half
# residual stream on its flattened rows, BART's ten (post-norm, cross-attention), NeoX's parallel
# residual with none (its two dropouts each a dropout_add, the sum taken the other way round),
# Phi-3's gated activation on its rank's halves of gate_up_proj.
FUSED_COUNTS = {
    "phi3": {"rms_norm": 3, "attention": 2, "residual_stream": 2, "dropout_add": 2, "rotary": 2,
             "gated_activation": 2},
    "opt": {"layer_norm": 3, "attention": 2, "bias_gelu": 2, "residual_stream": 2, "dropout_add": 2},
    "bart": {"layer_norm": 2, "attention": 6, "bias_gelu": 4, "residual_stream": 10},
    "neox": {"layer_norm": 5, "attention": 2, "bias_gelu": 2, "dropout_add": 4, "rotary": 2},
    # BLOOM's ALiBi attention on each rank's slice of the bias (its GeLU fuses in eval only)
    "bloom": {"layer_norm": 4, "attention": 2, "residual_stream": 2, "dropout_add": 2},
    # Nemotron's squared ReLU on each rank's columns of up_proj (no bias to take)
    "nemotron": {"layer_norm": 3, "attention": 2, "residual_stream": 2, "rotary": 2, "bias_gelu": 2},
    # Apertus's xIELU on each rank's columns, its two coefficients whole on every rank and their
    # gradients (each rank's columns' part) summed over the group by shard's hooks
    "apertus": {"rms_norm": 7, "attention": 2, "residual_stream": 2, "rotary": 2, "xielu": 2},
}


def multihead_dropout_weights(rank, size):
    """A sharded nn.MultiheadAttention's attention weights (per head, whole on every rank) with
    dropout 0.5, twice under one seed."""
    from trifuse.parallel import shard

    model = shard(build("torch_mha_options", dropout=0.5), _mesh(size), sequence_parallel=False)
    x = torch.randn(2, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    weights = []
    for _ in range(2):
        torch.manual_seed(0)
        weights.append(model.attn(x, x, x, average_attn_weights=False)[1].detach())
    return weights


def bloom_alibi_of_the_wrong_rows(rank, size):
    """The error a sharded BLOOM attention raises for an ALiBi bias not of batch x heads rows."""
    from trifuse.parallel import shard

    model = shard(build("bloom"), _mesh(size), sequence_parallel=False)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    try:
        alibi = torch.zeros(6, 1, 8, dtype=torch.float64)
        model.transformer.h[0].self_attention(x, x, alibi=alibi, attention_mask=None)
    except ValueError as e:
        return str(e)
    return None


def test_per_head_argument_of_the_wrong_rows_is_a_clear_error(world):
    for message in world.run(bloom_alibi_of_the_wrong_rows):
        assert message == (
            "trifuse.parallel: BloomAttention's alibi must have batch x 4 heads rows, got shape (6, 1, 8)"
        )


def test_multihead_attention_dropout_on_each_ranks_heads(world):
    (a0, b0), (a1, b1) = world.run(multihead_dropout_weights)
    assert torch.equal(a0, b0) and torch.equal(a0, a1) and torch.equal(b0, b1)  # reproducible, gathered alike
    dropped = a0 == 0
    assert 0.3 < dropped.double().mean() < 0.7
    # rank 0 holds heads 0-1, rank 1 heads 2-3: independent masks (one stream would repeat them)
    assert not torch.equal(dropped[:, :2], dropped[:, 2:])


@pytest.mark.parametrize(
    "kind, sp",
    [
        ("torch_encoder", False),
        ("torch_encoder", True),
        ("torch_seq_first", True),  # sequence parallelism splits dim 1: the batch
        ("torch_transformer", False),
        ("torch_transformer", True),
        ("torch_mha_options", False),  # its blocks sit in no nn.ModuleList
        ("siglip", False),  # its pooling head sits in none either
    ],
)
def test_torch_multihead_attention_matches_single_process(world, kind, sp):
    """nn.MultiheadAttention (nn.TransformerEncoder, nn.Transformer, called directly with per-head
    masks, add_zero_attn, returned weights, an unbatched input, and SigLIP's pooling head, whose
    learned probe is the query): 2 of 4 heads per rank,
    out_proj row-parallel (16 of its 32 input features), the loss, gradients and steps those of
    the unsharded model."""
    for failures, checks, shape in world.run(equal_to_single_process, kind, sp, 2):
        assert shape == (32, 16)
        assert checks > 30
        assert not failures, "\n".join(failures[:10])
    for all_local, heads, in_proj in world.run(multihead_attention_state, kind, sp):
        assert all_local and heads == {2} and in_proj == (48, 32)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", list(FUSED_COUNTS))
def test_more_families_fused_and_sharded(world, kind, sp):
    for failures, checks, counts in world.run(fused_equal_to_single_process, kind, "shard_then_fuse", sp):
        assert checks > 30
        assert not failures, "\n".join(failures[:10])
        counts.pop("cross_entropy", None)
        assert counts == FUSED_COUNTS[kind], counts


# nn.MultiheadAttention's local forward fuses as SDPA on this rank's heads (self- and cross-
# attention); nn.Transformer's decoder layers are captured by Dynamo, as in one process.
TORCH_FUSED_COUNTS = {
    "torch_encoder": {"layer_norm": 3, "attention": 2, "bias_gelu": 2, "residual_stream": 2, "dropout_add": 2},
    "torch_seq_first": {"attention": 2, "bias_gelu": 2, "residual_stream": 4},
    "torch_transformer": {"layer_norm": 2, "attention": 6, "bias_gelu": 4, "residual_stream": 10},
}


def all_pairs(kinds) -> list:
    """(kind, order, sp) cases in which every pair of values of any two of the three occurs (each
    kind fused before and after sharding, with and without sequence parallelism, and each order in
    both modes): two runs a kind instead of four, the fused and sharded runs being the slow ones of
    the distributed tests (Dynamo tracing DTensor code in every rank)."""
    halves = ((("fuse_then_shard", False), ("shard_then_fuse", True)),
              (("fuse_then_shard", True), ("shard_then_fuse", False)))
    return [pytest.param(kind, order, sp, id=f"{kind}-{order}-{'tp+sp' if sp else 'tp'}")
            for i, kind in enumerate(kinds) for order, sp in halves[i % 2]]


@pytest.mark.parametrize("kind, order, sp", all_pairs(TORCH_FUSED_COUNTS))
def test_torch_multihead_attention_fused_and_sharded(world, kind, order, sp):
    for failures, checks, counts in world.run(fused_equal_to_single_process, kind, order, sp):
        assert checks > 30
        assert not failures, "\n".join(failures[:10])
        counts.pop("cross_entropy", None)
        assert counts == TORCH_FUSED_COUNTS[kind], counts


@pytest.mark.parametrize("kind, order, sp", all_pairs(["nanogpt", "llama", "vit"]))
def test_fused_and_sharded_match_single_process(world, kind, order, sp):
    for failures, checks, counts in world.run(fused_equal_to_single_process, kind, order, sp):
        assert checks > 40
        assert not failures, "\n".join(failures[:10])
        # The fused kernels ran. Llama's 5 RMSNorms all fused, the 2 after a residual add with
        # it (residual_stream), under sequence parallelism too (where Dynamo leaves the
        # normalized shape computed in the graph, `weight.shape` of a DTensor weight).
        assert counts.get("attention") == 2, counts
        if kind == "llama":
            assert counts.get("rms_norm") == 3 and counts.get("residual_stream") == 2, counts
            # the gated MLP's act(gate) * up, on the column-parallel projections' local outputs
            assert counts.get("gated_activation") == 2, counts
            # q and k rotated on each rank's heads (local shards of the column-parallel projections)
            assert counts.get("rotary") == 2, counts


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["gemma3", "olmo2"])
def test_norms_inside_the_attention_core(world, kind, sp):
    """Q/K norms on this rank's heads: Gemma 3's per head (no communication), OLMo 2's over all
    heads' features (all-to-all to whole rows and back). Left plain, Gemma 3's norm weights got
    this rank's heads' share of the gradient and OLMo 2's forward failed on half-width rows."""
    for failures, checks, shape in world.run(equal_to_single_process, kind, sp, 2):
        assert shape == (8, 32)  # 2 K/V heads of 8, 1 per rank
        assert checks > 60
        assert not failures, "\n".join(failures[:10])


def uneven_rows_equal_to_single_process(rank, size, b, s):
    """OLMo 2 under tensor parallelism on a batch whose sequence does not divide by the ranks:
    its full-width Q/K norms take whole rows sharded on the batch, or, when that does not divide
    either, gathered whole. (failures, checks) for the loss and every gradient."""
    from tolerances import check_close

    from _tp_models import compare_full, loss_of
    from trifuse.parallel import shard

    ref = build("olmo2")
    model = shard(build("olmo2"), _mesh(size), sequence_parallel=False)
    ids = torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(7))
    loss = loss_of(model(input_ids=ids, labels=ids, use_cache=False))
    ref_loss = loss_of(ref(input_ids=ids, labels=ids, use_cache=False))
    loss.backward()
    ref_loss.backward()
    ok, msg = check_close("loss", loss, ref_loss, None)
    failures = [] if ok else [msg]
    return failures, 1 + compare_full("grad", model, ref, failures, True, fp32=True)


@pytest.mark.parametrize("b, s", [(2, 7), (1, 7)], ids=["rows-by-batch", "rows-gathered"])
def test_full_width_core_norm_on_rows_that_do_not_divide(world, b, s):
    for failures, checks in world.run(uneven_rows_equal_to_single_process, b, s):
        assert checks > 20
        assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("kind", ["gemma3", "olmo2"])
def test_fused_norms_inside_the_attention_core(world, kind):
    """Sharded with sequence parallelism, then fused: the Q/K norms run as trifuse's RMSNorm on the
    DTensors the core norms' style hands them."""
    for failures, checks, counts in world.run(fused_equal_to_single_process, kind, "shard_then_fuse", True):
        assert checks > 40
        assert not failures, "\n".join(failures[:10])
        assert counts.get("attention") == 2 and counts.get("rms_norm", 0) >= 9, counts


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_fused_sandwich_norms(world, sp):
    """Gemma 2 sharded, then fused: per block its post-attention norm is added to the residual
    stream (layer_norm_add), the sum fed to the pre-MLP norm (dropout_add_layer_norm), the
    post-MLP norm added again (layer_norm_add): under sequence parallelism on the local shards
    (`*_on_shards`), as without it. Norms and sums in float32 (see fused_equal_to_single_process)."""
    for failures, checks, counts in world.run(fused_equal_to_single_process, "gemma2", "shard_then_fuse", sp):
        assert checks > 40
        assert not failures, "\n".join(failures[:10])
        assert counts.get("residual_stream") == 4 and counts.get("rms_norm") == 5, counts
        assert counts.get("attention") == 2, counts


@pytest.mark.parametrize("kind", ["nanogpt", "llama"])
def test_four_ranks(worlds, kind):
    """World size 4, sequence parallel: nanoGPT's 4 heads 1 per rank (hidden 32); Llama with 8
    query and 4 key/value heads (hidden 64), 2 and 1 per rank."""
    heads = {"nanogpt": 4, "llama": 8}[kind]
    local = {"nanogpt": (3 * 32 // 4, 32), "llama": (8, 64)}[kind]
    for failures, checks, shape in worlds(4).run(equal_to_single_process, kind, True, 1, False, heads):
        assert shape == local
        assert checks > 30
        assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("kind", ["nanogpt", "neox", "phi3"])
def test_fused_qkv_split_the_wrong_way_fails_the_check(world, kind):
    """Negative control: the same check must catch nanoGPT's c_attn (and Phi-3's qkv_proj) cut by
    columns, and GPT-NeoX's per-head query_key_value split as [Q | K | V]."""
    for failures, _, _ in world.run(equal_to_single_process, kind, False, 1, True):
        assert any("loss" in f for f in failures)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "nanogpt_renamed_heads",
            (
                "would leave unsharded 2 module(s) of NanoGPT",
                "transformer.h.0.attn: CausalSelfAttention is not recognized: ",
                "as fused c_attn + c_proj with n_head (nanoGPT), its projections match, but it has no "
                "head count n_head (an int)",
            ),
        ),
        (
            "multihead_kdim",
            ("cross: nn.MultiheadAttention: separate Q/K/V weights (kdim=16, vdim=16 differ from embed_dim=32) "
             "are not supported",),
        ),
        ("multihead_bias_kv", ("cross: nn.MultiheadAttention: add_bias_kv=True is not supported",)),
        ("multihead_subclass", ("cross: nn.MultiheadAttention: MyAttention, a subclass (its forward may differ)",)),
        ("llama_kv_heads", ("has 1 key/value heads (grouped-query attention), which do not divide",)),
        # Apertus's trainable xIELU, whose gradients a hook sums over the tensor-parallel group, under
        # FSDP2, which would replace the parameters the hooks are on
        ("apertus_fsdp", ("model.layers.0.mlp.act_fn.alpha_p is a parameter of an activation between an MLP's "
                          "column- and row-parallel projections", "FSDP2 over a 2-D mesh")),
        ("bitnet_sub_norm", ("model.layers.0.mlp.act_fn.1: a parameter inside the MLP model.layers.0.mlp",)),
        (
            "unknown_projection",
            ("transformer.h.0.gate: a weight in the recognized block transformer.h.0 that no known",),
        ),
        (
            "attention_sinks_per_kv_head",
            ("model.layers.0.self_attn: parameters sinks inside an attention core",
             "(sinks (2,): not one value per each of its 4 heads)"),
        ),
        (
            "attention_core_vector",
            ("model.layers.0.self_attn: parameters head_scale inside an attention core",),
        ),
        (
            "moe_interleaved_other_gating",
            ("model.layers.1.mlp.experts: an MoE block model.layers.1.mlp: its experts (MyExperts) have a "
             "gating of its own (_apply_gate) on interleaved gate and up features",),
        ),
        ("falcon", ("transformer.h.0.self_attention: FalconAttention matches no known attention spelling",)),
        (
            "moe_shared_gate_per_feature",
            ("model.layers.1.mlp.experts: an MoE block model.layers.1.mlp: a shared_expert_gate other than one "
             "(32 -> 1) projection",),
        ),
        (
            "moe_transposed_experts",
            ("model.layers.0.feed_forward.experts: an MoE block model.layers.0.feed_forward: its experts "
             "(Llama4TextExperts) have an experts layout other than [gate | up]",),
        ),
        (
            "latent_widths_disagree",
            ("model.layers.1.self_attn: DeepseekV3Attention is not recognized: as latent q_a_proj/q_b_proj, "
             "kv_a_proj_with_mqa/kv_b_proj + o_proj (DeepSeek V2/V3 MLA), its features do not agree with 4 heads",
             "o_proj 24, not 20"),
        ),
        (
            "latent_core_norm",
            ("model.layers.0.self_attn.k_rope_norm: a norm over 4 features inside an attention core",),
        ),
        (
            "core_norm_of_another_width",
            ("model.layers.1.self_attn.q_norm: a norm over 4 features inside an attention core, neither "
             "one head's 8 nor a projection's output 32 or 16",),
        ),
    ],
)
def test_unshardable_attention_is_never_silent(world, case, expected, sp):
    for message in world.run(shard_error, case, sp):
        assert message is not None and all(e in message for e in expected), message


def test_a_blocks_norms_as_wide_as_its_mlp_are_not_taken_for_mlp_parameters():
    """nn.TransformerEncoderLayer holds its norms beside linear1/linear2; with dim_feedforward equal
    to d_model they are as wide as the MLP's intermediate features, and their shape cannot say
    which they are: they are not refused (they see the whole hidden width), nor is a parameter
    the block holds itself (a residual scale, say), while a one-value module beside the MLP's
    linears (a PReLU) still is."""
    from torch import nn

    from trifuse.parallel.plan import recognize

    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 32, batch_first=True), 2)
    found = recognize(model)
    assert len(found.mlps) == 2 and found.unrecognized == []
    model.layers[0].scale = nn.Parameter(torch.ones(1))
    assert recognize(model).unrecognized == []
    model.layers[0].act = nn.PReLU()
    assert [path for path, _ in recognize(model).unrecognized] == ["layers.0.act"]
