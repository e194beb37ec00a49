"""Which modules of a model to shard, and how: recognition of transformer blocks and the
Megatron-style plan derived from them.

Recognition lives here and only here, so that it can later share the rewriter's knowledge
(`trifuse.fuse` finds the same blocks in graphs). A block is recognized structurally: a
container module holding projections (nn.Linear or HF Conv1D) at known relative paths, with
shapes that agree (a fused QKV has three times the output projection's input features; a head
count that divides the width). The spellings are a tuple; adding a model family is adding one.

The plan, for tensor-parallel degree t (Megatron-LM, Shoeybi et al. 2019; sequence parallel,
Korthikanti et al. 2022), per block:

    attention   entry (the module fed the normalized hidden states)  gather: Shard(1) or Replicate -> Repl.
                Q, K, V (or fused QKV, split per head)               column-parallel, H/t heads per rank
                output projection                                    row-parallel -> Shard(1) or Replicate
                Q/K norms in the core (per head, or over all heads)  HeadCoreNorm (weight replicated)
                per-head parameters in the core (gpt-oss's sinks)    HeadParameters (Shard(0), as Q's heads)
                per-head arguments built for all heads (ALiBi)       HeadRowsArguments (this rank's rows)
                nn.MultiheadAttention: its packed in_proj, the gather  MultiheadAttentionParallel
                of query/key/value and a forward on the local heads  (multihead.py); out_proj row-par.
    latent      multi-head latent attention (DeepSeek V2/V3): the    ReplicatedModule, whole on
    attention   down projections to the latents and their norms      every rank
                (and V3.2's sparse-attention indexer)
                the up projections from the latents, per head        column-parallel, gradient of
                                                                     the latent input reduced
                the rotary key shared by every head (the last        its output gradient reduced
                features of kv_a_proj_with_mqa's output)             (this rank's heads' share)
    MLP         entry (its first linear if the container is the      gather, as above
                whole block: OPT's, BART's fc1)
                first linear(s)                                      column-parallel
                second linear                                        row-parallel
    MoE         the block (router + experts): gather in, reduce out  MoEBlockParallel (experts.py)
                every expert's [gate | up] and down, split inside    ExpertsParallel; router replicated
                (gpt-oss's interleaved, transposed, with biases)     (down bias: 1/t per rank)
                a shared expert (a dense MLP inside the block)       column- / row-parallel, left partial
                its gate (sigmoid scale of the shared output)        replicated, output grad reduced
    norms       LayerNorms on the residual stream                    SequenceParallel (only with SP)
    stack       first block's input                                  Replicate -> Shard(1) (only with SP)
                last block's output                                  Shard(1) -> Replicate (only with SP)

With sequence parallelism (SP) the residual stream between blocks (norms, dropout, residual
adds) holds a 1/t slice of the sequence on each rank; the entry's all-gather replaces
Megatron's all-reduce-free copy, the row-parallel reduce-scatter replaces its all-reduce. A
block that flattens its tokens to (tokens, features) (OPT's MLP half) holds the same rows split
along dim 0: the styles read Shard(1) on a 2-D tensor as Shard(0) (styles.py's `_on_rows`).
"""

import fnmatch
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from .experts import ExpertsParallel, MoEBlockParallel, ReplicatedModule
from .experts import unsupported as experts_unsupported
from .experts import widths as expert_widths
from .multihead import MultiheadAttentionParallel, unsupported
from .styles import (
    ColwiseParallel,
    HeadCoreNorm,
    HeadParameters,
    HeadRowsArguments,
    PrepareFirstInput,
    PrepareFirstOutput,
    RowwiseParallel,
    SequenceParallel,
    linear_kind,
)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear-like module."""
    w = module.weight
    return (w.shape[1], w.shape[0]) if linear_kind(module) == "linear" else (w.shape[0], w.shape[1])


@dataclass(frozen=True)
class AttentionSpelling:
    """Paths relative to the matched container. `entry` is the submodule whose first input (or
    `hidden_states=`) is the normalized hidden states and which owns the head count ("" = the
    container). Head counts may be dotted paths (`config.num_attention_heads`): those are read,
    never written (a config is shared by every layer); the module then must not need them
    changed (HF's modern attentions reshape with -1 and a fixed head_dim)."""

    name: str
    entry: str
    qkv: tuple[str, ...]  # one fused [Q | K | V] projection, or Q, K, V
    out: str
    heads_attr: str  # the head count on `entry`
    width_attrs: tuple[str, ...]  # widths and K/V head counts on `entry`, divided by the TP degree
    # Grouped-query attention: the K/V head count on `entry` (K and V then have kv heads x
    # head_dim output features each, Q heads x head_dim).
    kv_heads_attr: str | None = None
    # The module reads its width from its input's last dim (nanoGPT: `B, T, C = x.size()`, then
    # `view(B, T, n_head, C // n_head)` and `view(B, T, C)`): it is handed this rank's slice of
    # the features, and the Q/K/V projection gathers them back (see derive_plan).
    width_from_input: bool = False
    # The keyword `entry` gets the hidden states by, when its caller passes them by name.
    keyword: str | None = None
    # A fused projection whose output features are grouped per head ([q_0 k_0 v_0 | q_1 k_1 v_1
    # | ...], GPT-NeoX): a contiguous split of its columns hands each rank whole heads, so it is
    # not permuted as [Q | K | V] is.
    heads_major: bool = False
    # Class names the spelling is limited to, when shapes cannot tell the layout: Falcon names
    # its projections as GPT-NeoX does, with its features laid out [Q | K | V] or per K/V group.
    classes: tuple[str, ...] = ()
    # Head counts the module reads from its config (Phi-3 slices its fused projection at
    # `self.config.num_attention_heads * head_dim`): the module gets a view of the shared config
    # with this rank's counts (sharding.py's LocalHeadsConfig).
    config_heads: tuple[str, ...] = ()
    # Keyword arguments with one row per (batch, head), built for all heads by the caller
    # (BLOOM's ALiBi bias, (batch * H, 1, keys)): sliced to this rank's heads.
    head_rows_args: tuple[str, ...] = ()
    # Multi-head latent attention (DeepSeek V2/V3, MLA): the modules before `qkv` that project the
    # hidden states down to latents every head reads, and norm them. They run whole on every
    # rank; `qkv` are then the up projections from the latents (Q, and K's and V's per-head
    # parts), split per head. `shared_key` is the down projection whose output ends with the
    # rotary key that every head shares (`qk_rope_head_dim` features).
    latent: tuple[str, ...] = ()
    shared_key: str | None = None
    # Of `latent`, a module that picks from the latents which keys each query attends (DeepSeek
    # V3.2's sparse-attention indexer, top-k key indices): it runs whole on every rank, and any
    # gradient its output gets from this rank's heads is reduced.
    indexer: str | None = None


@dataclass(frozen=True)
class MLPSpelling:
    name: str
    entry: str
    up: tuple[str, ...]
    down: str
    # Equal parts of one up projection's output ([gate | up] = 2, Phi-3's gate_up_proj, which the
    # MLP chunks in two): each split per rank, as a fused QKV is.
    fused: int = 1


ATTENTION_SPELLINGS: tuple[AttentionSpelling, ...] = (
    AttentionSpelling(
        "fused c_attn + c_proj (GPT-2)", "", ("c_attn",), "c_proj", "num_heads", ("split_size",)
    ),
    AttentionSpelling(
        "fused c_attn + c_proj with n_head (nanoGPT)",
        "",
        ("c_attn",),
        "c_proj",
        "n_head",
        ("n_embd",),
        width_from_input=True,
    ),
    AttentionSpelling(
        "query/key/value + output.dense (BERT)",
        "self",
        ("self.query", "self.key", "self.value"),
        "output.dense",
        "num_attention_heads",
        ("all_head_size",),
    ),
    AttentionSpelling(
        "q_proj/k_proj/v_proj + o_proj, grouped KV heads (Llama)",
        "",
        ("q_proj", "k_proj", "v_proj"),
        "o_proj",
        "config.num_attention_heads",
        (),
        kv_heads_attr="config.num_key_value_heads",
        keyword="hidden_states",
    ),
    AttentionSpelling(
        "q_proj/k_proj/v_proj + o_proj (ViT)",
        "",
        ("q_proj", "k_proj", "v_proj"),
        "o_proj",
        "num_attention_heads",
        (),
    ),
    AttentionSpelling(
        "fused qkv_proj [Q | K | V] + o_proj, grouped KV heads (Phi-3)",
        "",
        ("qkv_proj",),
        "o_proj",
        "config.num_attention_heads",
        ("num_key_value_heads",),
        kv_heads_attr="config.num_key_value_heads",
        keyword="hidden_states",
        config_heads=("num_attention_heads", "num_key_value_heads"),
    ),
    AttentionSpelling(
        "q_proj/k_proj/v_proj + out_proj (OPT, BART, Whisper, CLIP, SigLIP)",
        "",
        ("q_proj", "k_proj", "v_proj"),
        "out_proj",
        "num_heads",
        ("embed_dim",),
        keyword="hidden_states",
    ),
    AttentionSpelling(
        "fused query_key_value per head + dense (GPT-NeoX)",
        "",
        ("query_key_value",),
        "dense",
        "config.num_attention_heads",
        (),
        keyword="hidden_states",
        heads_major=True,
        classes=("GPTNeoXAttention",),
    ),
    AttentionSpelling(
        "fused query_key_value per head + dense, ALiBi (BLOOM)",
        "",
        ("query_key_value",),
        "dense",
        "num_heads",
        (),
        heads_major=True,
        classes=("BloomAttention",),
        head_rows_args=("alibi",),
    ),
    AttentionSpelling(
        "latent q_a_proj/q_b_proj, kv_a_proj_with_mqa/kv_b_proj + o_proj, sparse-attention indexer "
        "(DeepSeek V3.2, GLM-5 DSA)",
        "",
        ("q_b_proj", "kv_b_proj"),
        "o_proj",
        "num_heads",
        (),
        keyword="hidden_states",
        latent=("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "indexer"),
        shared_key="kv_a_proj_with_mqa",
        indexer="indexer",
    ),
    AttentionSpelling(
        "latent q_a_proj/q_b_proj, kv_a_proj_with_mqa/kv_b_proj + o_proj (DeepSeek V2/V3 MLA)",
        "",
        ("q_b_proj", "kv_b_proj"),
        "o_proj",
        "num_heads",
        (),
        keyword="hidden_states",
        latent=("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"),
        shared_key="kv_a_proj_with_mqa",
    ),
    AttentionSpelling(
        "q_proj, latent kv_a_proj_with_mqa/kv_b_proj + o_proj (DeepSeek V2-Lite MLA)",
        "",
        ("q_proj", "kv_b_proj"),
        "o_proj",
        "num_heads",
        (),
        keyword="hidden_states",
        latent=("kv_a_proj_with_mqa", "kv_a_layernorm"),
        shared_key="kv_a_proj_with_mqa",
    ),
)

# Multi-head latent attention: the module's widths (read, never written).
_LATENT_WIDTHS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")

# nn.MultiheadAttention, recognized by its class: one packed in_proj_weight, a forward of its own
# that multihead.py replaces on the shards.
MULTIHEAD_SPELLING = AttentionSpelling(
    "nn.MultiheadAttention (packed in_proj_weight + out_proj)", "", (), "out_proj", "num_heads", ()
)

MLP_SPELLINGS: tuple[MLPSpelling, ...] = (
    MLPSpelling("c_fc + c_proj (GPT-2, nanoGPT)", "", ("c_fc",), "c_proj"),
    MLPSpelling(
        "intermediate.dense + output.dense (BERT)", "intermediate", ("intermediate.dense",), "output.dense"
    ),
    MLPSpelling("gate_proj/up_proj + down_proj (Llama)", "", ("gate_proj", "up_proj"), "down_proj"),
    # after the gated one, which a Llama MLP matches first
    MLPSpelling("up_proj + down_proj (Nemotron, Arcee, nanochat)", "", ("up_proj",), "down_proj"),
    MLPSpelling("fc1 + fc2 (ViT, CLIP, OPT, BART)", "", ("fc1",), "fc2"),
    MLPSpelling("dense_h_to_4h + dense_4h_to_h (GPT-NeoX, BLOOM)", "", ("dense_h_to_4h",), "dense_4h_to_h"),
    MLPSpelling("fused gate_up_proj + down_proj (Phi-3)", "", ("gate_up_proj",), "down_proj", fused=2),
    MLPSpelling("linear1 + linear2 (nn.TransformerEncoderLayer, DecoderLayer)", "", ("linear1",), "linear2"),
)


def _join(prefix: str, rel: str) -> str:
    return ".".join(p for p in (prefix, rel) if p)


def _sub(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path) if path else module
    except AttributeError:
        return None


def _attr(module: nn.Module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part, None)
    return module


@dataclass(frozen=True)
class Attention:
    path: str  # the container
    spelling: AttentionSpelling
    heads: int
    hidden: int
    kv_heads: int  # = heads without grouped-query attention
    # Norms inside the core, beside the projections: (module name, per head or over all heads'
    # features); see `_core_params`.
    norms: tuple[tuple[str, bool], ...] = ()
    # Parameters with one value per head inside the core (gpt-oss's attention sinks): (module
    # name, parameter names), each split by heads as Q is (`HeadParameters`).
    head_params: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def fqn(self, rel: str) -> str:
        return _join(self.path, rel)


@dataclass(frozen=True)
class MLP:
    path: str
    spelling: MLPSpelling
    inner: int
    # Where its input is gathered, relative to `path`: the spelling's entry, or its one up
    # projection when the container is the whole block (OPT's and BART's fc1/fc2 sit beside the
    # attention and the norms, which must not see the gathered input).
    entry: str = ""

    def fqn(self, rel: str) -> str:
        return _join(self.path, rel)


def _attention_mismatch(module: nn.Module, s: AttentionSpelling) -> str | tuple[int, int, int]:
    """(heads, kv heads, hidden) when `module` is spelled as `s`, else why not."""
    if s.classes and type(module).__name__ not in s.classes:
        return "no such projections"
    entry, out = _sub(module, s.entry), _sub(module, s.out)
    projs = [_sub(module, p) for p in s.qkv]
    if entry is None or out is None or any(linear_kind(m) is None for m in (out, *projs)):
        return "no such projections"
    heads = _attr(entry, s.heads_attr)
    if not isinstance(heads, int) or heads < 1:
        heads_name = _join(s.entry, s.heads_attr)
        return f"its projections match, but it has no head count {heads_name} (an int)"
    if s.latent:
        return _latent_mismatch(module, s, heads)
    kv = heads if s.kv_heads_attr is None else _attr(entry, s.kv_heads_attr)
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        kv_name = _join(s.entry, s.kv_heads_attr)
        return f"its projections match, but it has no K/V head count {kv_name} dividing {heads}"
    width = _features(out)[0]
    outs = [_features(m)[1] for m in projs]
    if width % heads:
        return f"its output projection's {width} input features do not split into {heads} heads"
    head_dim = width // heads
    want = [width + 2 * kv * head_dim] if len(projs) == 1 else [width, kv * head_dim, kv * head_dim]
    if outs != want:
        return f"its projections have {outs} output features, not {want} for {heads} heads ({kv} K/V)"
    return heads, kv, _features(projs[0])[0]


def _latent_mismatch(module: nn.Module, s: AttentionSpelling, heads: int) -> str | tuple[int, int, int]:
    """(heads, heads, hidden) when `module` is a multi-head latent attention spelled as `s`
    (Q from the hidden states or from a latent, K without rotary and V from a latent of
    `kv_lora_rank` features, one rotary key for all heads), else why not."""
    if any(_sub(module, p) is None for p in s.latent) or linear_kind(_sub(module, s.shared_key)) is None:
        return "no such projections"
    widths = {w: getattr(module, w, None) for w in _LATENT_WIDTHS}
    if not all(isinstance(v, int) and v >= 1 for v in widths.values()):
        return f"its projections match, but its widths are not all ints >= 1: {widths}"
    nope, rope, v, rank = (widths[w] for w in _LATENT_WIDTHS)
    q, kv_b = (_sub(module, p) for p in s.qkv)
    shapes = {
        s.qkv[0]: (_features(q)[1], heads * (nope + rope)),
        s.qkv[1]: (_features(kv_b), (rank, heads * (nope + v))),
        s.out: (_features(_sub(module, s.out))[0], heads * v),
        s.shared_key: (_features(_sub(module, s.shared_key))[1], rank + rope),
    }
    wrong = [f"{name} {got}, not {want}" for name, (got, want) in shapes.items() if got != want]
    if wrong:
        return f"its features do not agree with {heads} heads and {widths}: " + "; ".join(wrong)
    return heads, heads, _features(_sub(module, s.shared_key))[0]


def _match_attention(module: nn.Module, s: AttentionSpelling) -> tuple[int, int, int] | None:
    m = _attention_mismatch(module, s)
    return None if isinstance(m, str) else m


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


# Parameters inside an attention core known to hold one value per head, read by the core per
# head: gpt-oss's attention sinks (a logit per head, joined to that head's scores).
_HEAD_PARAM_NAMES = ("sinks",)


@dataclass(frozen=True)
class CoreParams:
    """What an attention core holds besides its projections (see `_core_params`)."""

    norms: list[tuple[str, bool]] = field(default_factory=list)
    head_params: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)


def _core_params(
    model: nn.Module, entry: str, projections: set[str], heads: int, head_dim: int, widths: tuple[int, ...]
) -> CoreParams:
    """The parameters in an attention core (the modules under `entry`, which tensor parallelism
    hands this rank's heads) outside its `projections`. Left plain, each would get a gradient
    summed over this rank's heads alone. The norms `HeadCoreNorm` shards, as (module name, per
    head), a norm weight over `head_dim` (per head) or over one of `widths` (a projection's output
    features, OLMo 2's Q/K norms); the per-head parameters `HeadParameters` shards, as (module
    name, parameter names), gpt-oss's attention sinks, one value per each of the `heads`; and
    (module name, why) for every other module holding parameters (a norm of another width, sinks
    of another shape)."""
    found = CoreParams()
    for name, module in model.get_submodule(entry).named_modules(prefix=entry):
        if any(name == p or name.startswith(p + ".") for p in projections):
            continue
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        w = params.get("weight")
        if _is_norm(module) and w is not None and w.dim() == 1 and all(
            p.shape == w.shape for p in params.values()
        ):
            if w.numel() == head_dim:
                found.norms.append((name, True))
                continue
            if w.numel() in widths:
                found.norms.append((name, False))
                continue
            why = (
                f"a norm over {w.numel()} features inside an attention core, neither one head's "
                f"{head_dim} nor a projection's output {' or '.join(map(str, dict.fromkeys(widths)))}"
            )
        elif all(n in _HEAD_PARAM_NAMES and p.shape == (heads,) for n, p in params.items()):
            found.head_params.append((name, tuple(params)))
            continue
        else:
            why = (
                f"parameters {', '.join(params)} inside an attention core (each rank holds its own "
                "heads there) that no style knows how to shard"
            )
            shapes = [f"{n} {tuple(p.shape)}" for n, p in params.items() if n in _HEAD_PARAM_NAMES]
            if shapes:
                why += f" ({', '.join(shapes)}: not one value per each of its {heads} heads)"
        found.problems.append((name, why))
    return found


def _match_mlp(module: nn.Module, s: MLPSpelling) -> tuple[int, str] | None:
    """(inner width, entry) when `module` is spelled as `s` (see MLP.entry), else None."""
    entry, down = _sub(module, s.entry), _sub(module, s.down)
    ups = [_sub(module, p) for p in s.up]
    if entry is None or down is None or any(linear_kind(m) is None for m in (down, *ups)):
        return None
    inner = _features(down)[0]
    if any(_features(m)[1] != s.fused * inner for m in ups):
        return None
    mine = {_join(s.entry, p) for p in (*s.up, s.down)}
    others = [n for n, _ in entry.named_parameters(prefix=s.entry) if n.rpartition(".")[0] not in mine]
    if not others:
        return inner, s.entry
    # The container holds more than the MLP: gather at the up projection, if there is one.
    return (inner, s.up[0]) if len(s.up) == 1 else None


@dataclass(frozen=True)
class MoE:
    path: str  # the block holding the router and the experts (Mixtral's, Qwen3-MoE's `mlp`)
    experts: str
    router: str
    inner: int  # one expert's inner width
    # A shared expert beside the routed ones, which every token goes through (Qwen2-MoE's
    # `shared_expert`, DeepSeek's `shared_experts`): a dense MLP inside the block.
    shared: MLP | None = None
    # Its gate, one (1, hidden) weight whose sigmoid scales the shared expert's output (Qwen2-MoE).
    shared_gate: str | None = None


_ROUTER_NAMES = ("gate", "router")
_SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts")
_SHARED_GATE_NAME = "shared_expert_gate"


def _match_shared_expert(module: nn.Module, path: str) -> tuple[MLP | None, str | None] | str:
    """(the shared expert's MLP, the name of its gate), each None when absent, for an MoE block
    `module` at `path`; why not when a shared expert or gate is spelled in a way trifuse does not
    shard."""
    names = [n for n in _SHARED_EXPERT_NAMES if isinstance(getattr(module, n, None), nn.Module)]
    if not names:
        return None, None
    if len(names) > 1:
        return f"two shared experts ({', '.join(names)})"
    shared = getattr(module, names[0])
    for s in MLP_SPELLINGS:
        m = _match_mlp(shared, s)
        if m is not None and m[1] == s.entry == "":
            mlp = MLP(_join(path, names[0]), s, inner=m[0])
            break
    else:
        return f"a shared expert {names[0]} ({type(shared).__name__}) that is no known MLP spelling"
    gate = getattr(module, _SHARED_GATE_NAME, None)
    if gate is None:
        return mlp, None
    hidden = _features(shared.get_submodule(s.down))[1]
    if linear_kind(gate) is None or _features(gate) != (hidden, 1):
        return f"a {_SHARED_GATE_NAME} other than one ({hidden} -> 1) projection"
    return mlp, _SHARED_GATE_NAME


def _match_moe(module: nn.Module, path: str) -> MoE | str | None:
    """The MoE block `module` at `path` when trifuse shards it: an `experts` child with stacked
    gate_up_proj / down_proj, a router with one (experts, hidden) weight, optionally a shared
    expert (an MLP spelling) and its gate, and nothing else holding parameters. Why not, for a
    block with such experts; None otherwise."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module) or getattr(experts, "gate_up_proj", None) is None:
        return None
    why = experts_unsupported(experts)
    if why is not None:
        return f"its experts ({type(experts).__name__}) have {why}"
    n = experts.gate_up_proj.shape[0]
    hidden, inner = expert_widths(experts)
    routers = [r for r in _ROUTER_NAMES if getattr(getattr(module, r, None), "weight", None) is not None]
    if len(routers) != 1 or getattr(module, routers[0]).weight.shape != (n, hidden):
        return f"no router ({' or '.join(_ROUTER_NAMES)}) with one ({n}, hidden) weight beside its experts"
    shared = _match_shared_expert(module, path)
    if isinstance(shared, str):
        return shared
    mlp, gate = shared
    children = ["experts", routers[0], *([mlp.path.rpartition(".")[2]] if mlp else []), *([gate] if gate else [])]
    others = [name for name, _ in module.named_parameters() if name.split(".")[0] not in children]
    if others:
        return f"parameters beside its router, experts and shared expert ({', '.join(others)})"
    router = _join(path, routers[0])
    return MoE(path, _join(path, "experts"), router, inner, shared=mlp, shared_gate=gate and _join(path, gate))


@dataclass
class Recognized:
    attentions: list[Attention] = field(default_factory=list)
    mlps: list[MLP] = field(default_factory=list)
    moes: list[MoE] = field(default_factory=list)
    # Each stack: the names of its blocks in order (the children of one nn.ModuleList that hold
    # recognized attention or MLP containers).
    stacks: list[list[str]] = field(default_factory=list)
    # Recognized containers that sit in no nn.ModuleList.
    unstacked: list[str] = field(default_factory=list)
    # (module name, why): attention-like modules, and projections inside recognized blocks,
    # that no spelling covers, so the derived plan would leave them unsharded.
    unrecognized: list[tuple[str, str]] = field(default_factory=list)
    # Parameter names of elementwise activations between an MLP's column- and row-parallel
    # projections (Apertus's xIELU coefficients): each rank sees its columns only, so their
    # gradients are per-rank partial sums, summed over the tensor-parallel group by `shard`.
    partial_gradients: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.attentions or self.mlps or self.moes)


def recognize(model: nn.Module) -> Recognized:
    """The attention and MLP blocks of `model` that trifuse knows, and the stacks they sit in."""
    found = Recognized()
    claimed: set[str] = set()
    in_cores: list[tuple[str, str]] = []
    moe_problems: list[tuple[str, str]] = []
    for path, module in model.named_modules():
        moe = _match_moe(module, path)
        if isinstance(moe, MoE):
            found.moes.append(moe)
            # The router runs whole on every rank, with whatever it holds (Ernie 4.5's score bias).
            claimed |= {moe.experts, *_subtree(model, moe.router)}
            if moe.shared is not None:
                claimed |= {moe.shared.fqn(p) for p in (*moe.shared.spelling.up, moe.shared.spelling.down)}
            if moe.shared_gate is not None:
                claimed.add(moe.shared_gate)
            continue
        if isinstance(moe, str):
            moe_problems.append((_join(path, "experts"), f"an MoE block {path}: {moe}"))
        if isinstance(module, nn.MultiheadAttention):
            if unsupported(module) is None:
                heads = module.num_heads
                found.attentions.append(
                    Attention(path, MULTIHEAD_SPELLING, heads=heads, hidden=module.embed_dim, kv_heads=heads)
                )
                claimed |= {path, _join(path, "out_proj")}
            continue
        for s in ATTENTION_SPELLINGS:
            m = _match_attention(module, s)
            projs = {_join(path, p) for p in (*s.qkv, s.out, *s.latent)}
            if m is not None and not projs & claimed:
                heads, kv, _ = m
                width = _features(model.get_submodule(_join(path, s.out)))[0]
                core = _core_params(
                    model, _join(path, s.entry), projs, heads, width // heads, (width, kv * (width // heads))
                )
                found.attentions.append(
                    Attention(
                        path, s, heads=heads, kv_heads=kv, hidden=m[2], norms=tuple(core.norms),
                        head_params=tuple(core.head_params),
                    )
                )
                in_cores += core.problems
                claimed |= projs
                # Latent modules run whole with whatever they hold (the indexer's own projections).
                for p in s.latent:
                    claimed |= _subtree(model, _join(path, p))
                break
        for s in MLP_SPELLINGS:
            m = _match_mlp(module, s)
            projs = {_join(path, p) for p in (*s.up, s.down)}
            if m is not None and not projs & claimed:
                # No core check here: an MLP's container may be the whole block (OPT's and BART's
                # fc1/fc2 sit beside the attention and the norms), whose other parameters do not
                # see column shards.
                found.mlps.append(MLP(path, s, inner=m[0], entry=m[1]))
                claimed |= projs
                break
    blocks = {}
    lists = {p: m for p, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    containers = [b.path for b in (*found.attentions, *found.mlps, *found.moes)]
    for container in containers:
        for list_path in sorted(lists, key=len, reverse=True):
            prefix = list_path + "." if list_path else ""
            if container.startswith(prefix) and container != list_path:
                index = container[len(prefix) :].split(".")[0]
                blocks.setdefault(list_path, set()).add(index)
                break
        else:
            found.unstacked.append(container)
    for list_path, indices in blocks.items():
        found.stacks.append([_join(list_path, i) for i in sorted(indices, key=int)])
    found.unrecognized = moe_problems + [
        u for u in _unrecognized(model, found, claimed) if all(u[0] != n for n, _ in moe_problems)
    ]
    found.unrecognized += [(n, why) for n, why in in_cores if all(n != r for r, _ in found.unrecognized)]
    return found


def _attention_like(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention) or "attention" in type(module).__name__.lower()


def _why_not_attention(module: nn.Module) -> str:
    cls = type(module).__name__
    if isinstance(module, nn.MultiheadAttention):
        return f"nn.MultiheadAttention: {unsupported(module)}"
    near = []
    for s in ATTENTION_SPELLINGS:
        m = _attention_mismatch(module, s)
        if isinstance(m, str) and m != "no such projections":
            near.append(f"as {s.name}, {m}")
    if near:
        return f"{cls} is not recognized: " + "; ".join(near)
    known = ", ".join(s.name for s in ATTENTION_SPELLINGS)
    return f"{cls} matches no known attention spelling ({known})"


def _unrecognized(model: nn.Module, found: Recognized, claimed: set[str]) -> list[tuple[str, str]]:
    """Attention-like modules (nn.MultiheadAttention, or a class named *Attention*) holding
    weights no recognized block claims, anywhere; then any other unclaimed weight matrix in a
    recognized block. Norm weights and biases (1-D) are not projections and are left out."""

    def unclaimed(path: str, module: nn.Module) -> list[str]:
        return [
            n.rpartition(".")[0]
            for n, p in module.named_parameters(prefix=path)
            if p.dim() >= 2 and n.rpartition(".")[0] not in claimed
        ]

    def under(name: str, path: str) -> bool:
        return name == path or name.startswith(path + ".") or not path

    out: list[tuple[str, str]] = []
    # A module that holds a recognized attention further down (SigLIP's pooling head around its
    # nn.MultiheadAttention) is no attention core itself: its other weights (the head's learned
    # probe, the query it feeds the attention) run replicated, outside any rank's heads.
    holders = {p for a in found.attentions for p in _ancestors(a.path)}
    # A recognized attention's other parameters are `_core_params`' to report (or its block's).
    recognized = {a.path for a in found.attentions}
    for path, module in model.named_modules():
        if (
            _attention_like(module)
            and path not in holders
            and path not in recognized
            and not any(under(path, r) for r, _ in out)
            and unclaimed(path, module)
        ):
            out.append((path, _why_not_attention(module)))
    for block in (b for stack in found.stacks for b in stack):
        for name in dict.fromkeys(unclaimed(block, model.get_submodule(block))):
            if not any(under(name, r) for r, _ in out):
                why = (
                    f"a weight in the recognized block {block} that no known attention or MLP spelling covers"
                )
                out.append((name, why))
    # Parameters between an MLP's column- and row-parallel projections, which would see one rank's
    # columns only: a norm's statistics or a trainable activation's gradient silently per rank
    # (Apertus's xIELU, two one-value coefficients). Where the MLP's container holds more than the
    # MLP (OPT's and BART's block, its norms hidden wide), those are told apart by shape: one value,
    # or one per intermediate feature where that width is not also the hidden width (a norm of the
    # block, then, as far as its shape can say). One-value parameters of an elementwise activation
    # in an MLP module of its own are kept whole instead, their gradients summed over the group.
    attention_paths = [a.path for a in found.attentions]
    for mlp in found.mlps:
        projections = [mlp.fqn(p) for p in (*mlp.spelling.up, mlp.spelling.down)]
        hidden = _features(model.get_submodule(mlp.fqn(mlp.spelling.down)))[1]
        params = list(model.get_submodule(mlp.path).named_parameters(prefix=mlp.path))
        # An MLP module of its own (Llama's, Apertus's): its parameters are the projections' and
        # its activations', so an activation there runs between the projections, on each rank's
        # columns. In a whole block's container (OPT's) an activation module may run anywhere.
        own_module = all(any(under(n.rpartition(".")[0], q) for q in projections)
                         or (p.numel() == 1 and _elementwise_activation(model.get_submodule(n.rpartition(".")[0])))
                         for n, p in params)
        for n, p in params:
            owner = n.rpartition(".")[0]
            known = (*projections, *attention_paths, *(r for r, _ in out))
            if owner == mlp.path or any(under(owner, q) for q in known):
                continue  # (held by the container itself: a whole block's own scale, say)
            if own_module and p.numel() == 1 and _elementwise_activation(model.get_submodule(owner)):
                found.partial_gradients.append(n)
                continue
            if p.numel() == 1 or (p.dim() == 1 and p.shape[0] == mlp.inner != hidden):
                why = (f"a parameter inside the MLP {mlp.path}, between its column- and row-parallel "
                       "projections, that would see one rank's columns only (a norm's statistics or an "
                       "activation's gradient per rank): keep that MLP whole by naming its projections in "
                       "plan= with None")
                out.append((owner, why))
    return out


def _elementwise_activation(module: nn.Module) -> bool:
    """Whether `module` is an activation known to act element by element (transformers'
    activations, Apertus's xIELU among them; torch's, PReLU with one slope): a one-value parameter
    of it sees each rank's columns alike, and only its gradient needs the other ranks' parts. Any
    other module (a norm over the features with a one-value gain, say) stays refused."""
    return type(module).__module__ in ("transformers.activations", "torch.nn.modules.activation")


def _subtree(model: nn.Module, path: str) -> set[str]:
    """The names of the module at `path` and of every module under it."""
    return {n for n, _ in model.get_submodule(path).named_modules(prefix=path)}


def _ancestors(path: str) -> list[str]:
    """The module names strictly above `path` ("" is the model)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts))]


def check_unrecognized(model: nn.Module, found: Recognized, user: dict | None) -> None:
    """Raises ValueError naming each module the derived plan would leave unsharded without
    saying so (a half-recognized block would otherwise be sharded in part and silently run
    the rest replicated, or fail later on a misleading symptom). A user `plan` entry matching
    the module, or a module inside it, takes responsibility for it."""
    names = [n for n, _ in model.named_modules()]
    patterns = [p for p in (user or {}) if isinstance(p, str)]
    left = [
        (path, why)
        for path, why in found.unrecognized
        if not any(
            fnmatch.fnmatchcase(n, p)
            for p in patterns
            for n in names
            if n == path or n.startswith(path + ".")
        )
    ]
    if left:
        where = "; ".join(f"{path or type(model).__name__}: {why}" for path, why in left)
        raise ValueError(
            f"trifuse.parallel.shard: would leave unsharded {len(left)} module(s) of {type(model).__name__} "
            f"that look like part of a transformer block: {where}. Shard them with plan= "
            "{module-name pattern: style}, or name them in plan= with None to keep them replicated "
            "(then sequence_parallel=False)"
        )


# ---------------------------------------------------------------------------------------------
# The plan: an ordered list of (module name, style) and the attribute changes that go with it.
# ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    styles: list[tuple[str, object]] = field(default_factory=list)
    # (module name, attribute, value for this rank): head counts and widths of the local shard.
    attributes: list[tuple[str, str, int]] = field(default_factory=list)
    # (module name, {config attribute: value for this rank}): head counts a module reads from its
    # config, which it then reads from a view with these values (sharding.py's LocalHeadsConfig).
    config_views: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    # Modules whose forward runs on tensors that differ across ranks, for dropout (see random.py):
    # (enter at this module, leave after any of these).
    rank_regions: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    # Sequence parallel only: the modules (blocks) whose parameters all must be covered by a style.
    sp_blocks: list[str] = field(default_factory=list)


def _norm_like(module: nn.Module, hidden: int) -> bool:
    shape = getattr(module, "normalized_shape", None)
    if _is_norm(module):
        w = getattr(module, "weight", None)
        return tuple(shape or (w.shape if w is not None else ())) == (hidden,)
    return False


def derive_plan(model: nn.Module, found: "Recognized", tp: int, *, sequence_parallel: bool) -> Plan:
    """The Megatron plan for `model`, whose blocks `recognize` found, at tensor-parallel degree
    `tp` (see the module docstring). Raises ValueError when nothing was recognized, when heads or
    widths do not divide, or when sequence parallelism cannot bracket the blocks."""
    if not found:
        raise ValueError(
            f"trifuse.parallel.shard: found no attention or MLP block it knows in {type(model).__name__} "
            f"(known: {', '.join(s.name for s in ATTENTION_SPELLINGS + MLP_SPELLINGS)}); pass plan= "
            "{module-name pattern: style} to shard it"
        )
    resid = Shard(1) if sequence_parallel else Replicate()
    plan = Plan()
    for a in found.attentions:
        s = a.spelling
        where = a.path or type(model).__name__
        if a.heads % tp:
            raise ValueError(
                f"trifuse.parallel.shard: {where} has {a.heads} attention heads, "
                f"which do not divide across a tensor-parallel degree of {tp}"
            )
        if a.kv_heads % tp:
            raise ValueError(
                f"trifuse.parallel.shard: {where} has {a.kv_heads} key/value heads (grouped-query "
                f"attention), which do not divide across a tensor-parallel degree of {tp}"
            )
        if s is MULTIHEAD_SPELLING:  # one style for the packed projection and the forward
            plan.styles.append((a.path, MultiheadAttentionParallel(input_layouts=resid)))
            plan.styles.append((a.fqn(s.out), RowwiseParallel(output_layouts=resid)))
            plan.rank_regions.append((a.path, (a.path, a.fqn(s.out))))
            continue
        # Per-head parameters split as the heads are (column-parallel Q, contiguous per rank).
        plan.styles += [(name, HeadParameters(names=names, heads=a.heads)) for name, names in a.head_params]
        if s.latent:
            plan.styles += _latent_styles(model, a, resid)
            plan.attributes.append((a.fqn(s.entry), s.heads_attr, a.heads // tp))
            plan.rank_regions.append((a.fqn(s.entry), (a.fqn(s.entry), a.fqn(s.out))))
            continue
        # nanoGPT reads its width from the input: hand it this rank's feature slice, which the
        # Q/K/V projection all-gathers back (one all-gather forward; backward, its reduce-scatter
        # and the slice's all-gather make the all-reduce a column-parallel input needs anyway).
        sliced = Shard(2) if s.width_from_input else Replicate()
        plan.styles.append(
            (
                a.fqn(s.entry),
                PrepareFirstInput(
                    input_layout=resid,
                    desired_layout=sliced,
                    use_local_output=s.width_from_input,
                    keyword=s.keyword,
                ),
            )
        )
        # A fused [Q | K | V] split per part (Phi-3's K and V narrower than Q); separate
        # projections, or GPT-NeoX's per-head layout, split as they are.
        width = _features(model.get_submodule(a.fqn(s.out)))[0]
        kv_width = a.kv_heads * width // a.heads
        fused = 1 if len(s.qkv) > 1 or s.heads_major else (width, kv_width, kv_width)
        qkv_in = sliced if s.width_from_input else None
        plan.styles += [(a.fqn(p), ColwiseParallel(input_layouts=qkv_in, fused_parts=fused)) for p in s.qkv]
        plan.styles.append((a.fqn(s.out), RowwiseParallel(output_layouts=resid)))
        plan.styles += [(name, HeadCoreNorm(per_head=per_head)) for name, per_head in a.norms]
        if s.head_rows_args:
            plan.styles.append((a.fqn(s.entry), HeadRowsArguments(names=s.head_rows_args, heads=a.heads)))
        entry = model.get_submodule(a.fqn(s.entry))
        if "." not in s.heads_attr:
            plan.attributes.append((a.fqn(s.entry), s.heads_attr, a.heads // tp))
        plan.attributes += [(a.fqn(s.entry), w, getattr(entry, w) // tp) for w in s.width_attrs]
        if s.config_heads:
            counts = {"num_attention_heads": a.heads // tp, "num_key_value_heads": a.kv_heads // tp}
            plan.config_views.append((a.fqn(s.entry), {n: counts[n] for n in s.config_heads}))
        plan.rank_regions.append((a.fqn(s.entry), (a.fqn(s.entry), a.fqn(s.out))))
    for m in found.mlps:
        s = m.spelling
        if m.inner % tp:
            raise ValueError(
                f"trifuse.parallel.shard: {m.path or type(model).__name__} has an MLP width of {m.inner}, "
                f"which does not divide across a tensor-parallel degree of {tp}"
            )
        if m.entry in s.up:  # the up projection gathers its own input
            plan.styles.append((m.fqn(m.entry), ColwiseParallel(input_layouts=resid, fused_parts=s.fused)))
        else:
            plan.styles.append(
                (
                    m.fqn(m.entry),
                    PrepareFirstInput(input_layout=resid, desired_layout=Replicate(), use_local_output=False),
                )
            )
            plan.styles += [(m.fqn(p), ColwiseParallel(fused_parts=s.fused)) for p in s.up]
        plan.styles.append((m.fqn(s.down), RowwiseParallel(output_layouts=resid)))
    for m in found.moes:
        if m.inner % tp:
            raise ValueError(
                f"trifuse.parallel.shard: {m.path} has experts of inner width {m.inner}, "
                f"which does not divide across a tensor-parallel degree of {tp}"
            )
        plan.styles += [
            (m.path, MoEBlockParallel(input_layouts=resid)),
            (m.experts, ExpertsParallel()),
            (m.router, ReplicatedModule()),
        ]
        if m.shared is not None:
            plan.styles += _shared_expert_styles(m.shared, tp)
        if m.shared_gate is not None:  # its output scales a partial sum: its gradient is partial
            plan.styles.append((m.shared_gate, ReplicatedModule(partial_output_grad=True)))
    if not sequence_parallel:
        return plan

    if found.unstacked:
        raise ValueError(
            "trifuse.parallel.shard: sequence_parallel=True needs the recognized blocks inside an "
            "nn.ModuleList (the residual stream is sharded from the first block's input to the last "
            f"block's output), but {found.unstacked[0] or type(model).__name__} is in none; "
            "pass sequence_parallel=False"
        )
    hidden = found.attentions[0].hidden if found.attentions else None
    inside = [a.fqn(a.spelling.entry) for a in found.attentions] + [m.fqn(m.entry) for m in found.mlps]
    inside += [m.path for m in found.moes]
    for stack in found.stacks:
        plan.styles.append(
            (
                stack[0],
                PrepareFirstInput(input_layout=Replicate(), desired_layout=Shard(1), use_local_output=True),
            )
        )
        plan.styles.append(
            (stack[-1], PrepareFirstOutput(output_layout=Shard(1), desired_layout=Replicate()))
        )
        for block in stack:
            for name, module in model.get_submodule(block).named_modules(prefix=block):
                in_core = any(name == e or name.startswith(e + ".") for e in inside)
                if not in_core and hidden is not None and _norm_like(module, hidden):
                    plan.styles.append((name, SequenceParallel(use_local_output=True)))
            # Everything inside a block sees sequence shards or head shards: one per-rank region.
            plan.rank_regions.append((block, (block,)))
            plan.sp_blocks.append(block)
    # With SP the attention regions are covered by the block regions.
    plan.rank_regions = [r for r in plan.rank_regions if r[0] in plan.sp_blocks]
    return plan


def _latent_styles(model: nn.Module, a: Attention, resid) -> list[tuple[str, object]]:
    """A multi-head latent attention (DeepSeek's MLA) on this rank's heads. Its input is gathered
    whole and handed on as a local tensor: the down projections to the latents and their norms
    run whole on every rank, the up projections from the latents (Q's, and K's and V's per head)
    are column-parallel on a whole input, whose gradient (this rank's heads' share) they reduce,
    and the rotary key that every head shares has its gradient reduced where it leaves the down
    projection. Every gradient into the down projections is then whole on every rank, so are
    their weights' gradients and the input's: its gather's backward is a plain slice. Backward
    all-reduces tokens x (q_lora_rank + kv_lora_rank + qk_rope_head_dim) values (V3: 2112 per
    token) where another attention reduce-scatters the hidden width (V3: 7168). V2-Lite's Q comes
    from the hidden states (q_proj), so there the query's share is an all-reduce of the hidden
    width, twice a reduce-scatter's bytes under sequence parallelism."""
    s = a.spelling
    rope = model.get_submodule(a.path).qk_rope_head_dim
    whole = PrepareFirstInput(
        input_layout=resid, desired_layout=Replicate(), use_local_output=True, keyword=s.keyword
    )
    return [
        (a.fqn(s.entry), whole),
        *[(a.fqn(p), ReplicatedModule(partial_output_grad=p == s.indexer)) for p in s.latent if p != s.shared_key],
        (a.fqn(s.shared_key), ReplicatedModule(partial_grad_last=rope)),
        *[(a.fqn(p), ColwiseParallel(input_layouts=Replicate())) for p in s.qkv],
        (a.fqn(s.out), RowwiseParallel(output_layouts=resid)),
    ]


def _shared_expert_styles(shared: MLP, tp: int) -> list[tuple[str, object]]:
    """A shared expert inside an MoE block, whose input MoEBlockParallel gathered whole: its up
    projections column-parallel (one reduction of their input gradients, as a dense MLP's), its
    down projection row-parallel left a partial sum, which the block's output reduces with the
    routed experts' in one collective."""
    s = shared.spelling
    if shared.inner % tp:
        raise ValueError(
            f"trifuse.parallel.shard: the shared expert {shared.path} has an MLP width of {shared.inner}, "
            f"which does not divide across a tensor-parallel degree of {tp}"
        )
    whole = PrepareFirstInput(input_layout=Replicate(), desired_layout=Replicate(), use_local_output=False)
    return [
        (shared.path, whole),
        *[(shared.fqn(p), ColwiseParallel(fused_parts=s.fused)) for p in s.up],
        (shared.fqn(s.down), RowwiseParallel(output_layouts=Partial())),
    ]


def _module_name(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is target), None) if target is not None else None


def vocab_plan(model: nn.Module, tp: int) -> list[tuple[str, object]]:
    """Vocabulary-parallel input embedding (rows split, partial lookups all-reduced) and LM head
    (columns split, logits left sharded on the vocabulary as a DTensor, for the cross-entropy of
    `torch.distributed.tensor.parallel.loss_parallel()` which never gathers them). The two are
    found with the Hugging Face methods `get_input_embeddings` / `get_output_embeddings`."""
    get_in, get_out = (
        getattr(model, "get_input_embeddings", None),
        getattr(model, "get_output_embeddings", None),
    )
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    emb_name, head_name = _module_name(model, emb), _module_name(model, head)
    if (
        not isinstance(emb, nn.Embedding)
        or not isinstance(head, nn.Linear)
        or emb_name is None
        or head_name is None
    ):
        raise ValueError(
            f"trifuse.parallel.shard: vocab_parallel=True needs get_input_embeddings() -> nn.Embedding and "
            f"get_output_embeddings() -> nn.Linear (Hugging Face models), got {type(emb).__name__} and "
            f"{type(head).__name__} from {type(model).__name__}"
        )
    vocab = emb.num_embeddings
    if vocab % tp or head.out_features % tp:
        raise ValueError(
            f"trifuse.parallel.shard: vocab_parallel=True needs a vocabulary divisible by the "
            f"tensor-parallel degree {tp}, got {vocab}; pad it "
            f"(e.g. model.resize_token_embeddings(n, pad_to_multiple_of={tp}))"
        )
    return [
        (emb_name, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())),
        (head_name, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)),
    ]


def merge(plan: Plan, user: dict | None, model: nn.Module) -> Plan:
    """`plan` with the user's entries {module-name glob: style or None} taking precedence: a
    module matched by a user glob gets the user's style (None: left alone) and none derived."""
    if not user:
        return plan
    names = [n for n, _ in model.named_modules()]
    chosen: dict[str, object] = {}
    for pattern, style in user.items():
        if not isinstance(pattern, str):
            raise TypeError(
                f"trifuse.parallel.shard: plan keys must be module-name patterns (str), got {pattern!r}"
            )
        if style is not None and not isinstance(style, ParallelStyle):
            raise TypeError(
                f"trifuse.parallel.shard: plan[{pattern!r}] must be a ParallelStyle or None, "
                f"got {type(style).__name__}"
            )
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"trifuse.parallel.shard: plan entry {pattern!r} matches no module of {type(model).__name__}"
            )
        for n in hits:
            chosen[n] = style
    merged = Plan(
        styles=[(n, s) for n, s in plan.styles if n not in chosen],
        attributes=list(plan.attributes),
        config_views=list(plan.config_views),
        rank_regions=list(plan.rank_regions),
        sp_blocks=list(plan.sp_blocks),
    )
    merged.styles += [(n, s) for n, s in chosen.items() if s is not None]
    return merged
