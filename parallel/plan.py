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
    MLP         entry                                                gather, as above
                first linear(s)                                      column-parallel
                second linear                                        row-parallel
    norms       LayerNorms on the residual stream                    SequenceParallel (only with SP)
    stack       first block's input                                  Replicate -> Shard(1) (only with SP)
                last block's output                                  Shard(1) -> Replicate (only with SP)

With sequence parallelism (SP) the residual stream between blocks (norms, dropout, residual
adds) holds a 1/t slice of the sequence on each rank; the entry's all-gather replaces
Megatron's all-reduce-free copy, the row-parallel reduce-scatter replaces its all-reduce.
"""

import fnmatch
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from .styles import ColwiseParallel, PrepareFirstInput, PrepareFirstOutput, RowwiseParallel, linear_kind


def _features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear-like module."""
    w = module.weight
    return (w.shape[1], w.shape[0]) if linear_kind(module) == "linear" else (w.shape[0], w.shape[1])


@dataclass(frozen=True)
class AttentionSpelling:
    """Paths relative to the matched container. `entry` is the submodule whose first positional
    input is the normalized hidden states and which owns the head count ("" = the container)."""

    name: str
    entry: str
    qkv: tuple[str, ...]  # one fused [Q | K | V] projection, or Q, K, V
    out: str
    heads_attr: str  # the head count on `entry`
    width_attrs: tuple[str, ...]  # widths on `entry` proportional to the head count


@dataclass(frozen=True)
class MLPSpelling:
    name: str
    entry: str
    up: tuple[str, ...]
    down: str


ATTENTION_SPELLINGS: tuple[AttentionSpelling, ...] = (
    AttentionSpelling(
        "fused c_attn + c_proj (GPT-2)", "", ("c_attn",), "c_proj", "num_heads", ("split_size",)
    ),
    AttentionSpelling(
        "query/key/value + output.dense (BERT)",
        "self",
        ("self.query", "self.key", "self.value"),
        "output.dense",
        "num_attention_heads",
        ("all_head_size",),
    ),
)

MLP_SPELLINGS: tuple[MLPSpelling, ...] = (
    MLPSpelling("c_fc + c_proj (GPT-2)", "", ("c_fc",), "c_proj"),
    MLPSpelling(
        "intermediate.dense + output.dense (BERT)", "intermediate", ("intermediate.dense",), "output.dense"
    ),
)


def _join(prefix: str, rel: str) -> str:
    return ".".join(p for p in (prefix, rel) if p)


def _sub(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path) if path else module
    except AttributeError:
        return None


@dataclass(frozen=True)
class Attention:
    path: str  # the container
    spelling: AttentionSpelling
    heads: int
    hidden: int

    def fqn(self, rel: str) -> str:
        return _join(self.path, rel)


@dataclass(frozen=True)
class MLP:
    path: str
    spelling: MLPSpelling
    inner: int

    def fqn(self, rel: str) -> str:
        return _join(self.path, rel)


def _match_attention(module: nn.Module, s: AttentionSpelling) -> tuple[int, int] | None:
    """(heads, hidden) when `module` is spelled as `s`, else None."""
    entry, out = _sub(module, s.entry), _sub(module, s.out)
    projs = [_sub(module, p) for p in s.qkv]
    if entry is None or out is None or any(linear_kind(m) is None for m in (out, *projs)):
        return None
    heads = getattr(entry, s.heads_attr, None)
    if not isinstance(heads, int) or heads < 1:
        return None
    width = _features(out)[0]
    outs = [_features(m)[1] for m in projs]
    if outs != ([3 * width] if len(projs) == 1 else [width] * 3) or width % heads:
        return None
    return heads, _features(projs[0])[0]


def _match_mlp(module: nn.Module, s: MLPSpelling) -> int | None:
    entry, down = _sub(module, s.entry), _sub(module, s.down)
    ups = [_sub(module, p) for p in s.up]
    if entry is None or down is None or any(linear_kind(m) is None for m in (down, *ups)):
        return None
    inner = _features(down)[0]
    if any(_features(m)[1] != inner for m in ups):
        return None
    return inner


@dataclass
class Recognized:
    attentions: list[Attention] = field(default_factory=list)
    mlps: list[MLP] = field(default_factory=list)
    # Each stack: the names of its blocks in order (the children of one nn.ModuleList that hold
    # recognized attention or MLP containers).
    stacks: list[list[str]] = field(default_factory=list)
    # Recognized containers that sit in no nn.ModuleList.
    unstacked: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.attentions or self.mlps)


def recognize(model: nn.Module) -> Recognized:
    """The attention and MLP blocks of `model` that trifuse knows, and the stacks they sit in."""
    found = Recognized()
    claimed: set[str] = set()
    for path, module in model.named_modules():
        for s in ATTENTION_SPELLINGS:
            m = _match_attention(module, s)
            projs = {_join(path, p) for p in (*s.qkv, s.out)}
            if m is not None and not projs & claimed:
                found.attentions.append(Attention(path, s, heads=m[0], hidden=m[1]))
                claimed |= projs
                break
        for s in MLP_SPELLINGS:
            inner = _match_mlp(module, s)
            projs = {_join(path, p) for p in (*s.up, s.down)}
            if inner is not None and not projs & claimed:
                found.mlps.append(MLP(path, s, inner=inner))
                claimed |= projs
                break
    blocks = {}
    lists = {p: m for p, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    for container in [a.path for a in found.attentions] + [m.path for m in found.mlps]:
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
    return found


# ---------------------------------------------------------------------------------------------
# The plan: an ordered list of (module name, style) and the attribute changes that go with it.
# ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    styles: list[tuple[str, object]] = field(default_factory=list)
    # (module name, attribute, value for this rank): head counts and widths of the local shard.
    attributes: list[tuple[str, str, int]] = field(default_factory=list)
    # Modules whose forward runs on tensors that differ across ranks, for dropout (see random.py):
    # (enter at this module, leave after any of these).
    rank_regions: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    # Sequence parallel only: the modules (blocks) whose parameters all must be covered by a style.
    sp_blocks: list[str] = field(default_factory=list)


def _norm_like(module: nn.Module, hidden: int) -> bool:
    shape = getattr(module, "normalized_shape", None)
    if isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("LayerNorm", "RMSNorm")):
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
        if a.heads % tp:
            raise ValueError(
                f"trifuse.parallel.shard: {a.path or type(model).__name__} has {a.heads} attention heads, "
                f"which do not divide across a tensor-parallel degree of {tp}"
            )
        plan.styles.append(
            (
                a.fqn(s.entry),
                PrepareFirstInput(input_layout=resid, desired_layout=Replicate(), use_local_output=False),
            )
        )
        fused = 3 if len(s.qkv) == 1 else 1
        plan.styles += [(a.fqn(p), ColwiseParallel(fused_parts=fused)) for p in s.qkv]
        plan.styles.append((a.fqn(s.out), RowwiseParallel(output_layouts=resid)))
        entry = model.get_submodule(a.fqn(s.entry))
        plan.attributes.append((a.fqn(s.entry), s.heads_attr, a.heads // tp))
        plan.attributes += [(a.fqn(s.entry), w, getattr(entry, w) // tp) for w in s.width_attrs]
        plan.rank_regions.append((a.fqn(s.entry), (a.fqn(s.entry), a.fqn(s.out))))
    for m in found.mlps:
        s = m.spelling
        if m.inner % tp:
            raise ValueError(
                f"trifuse.parallel.shard: {m.path or type(model).__name__} has an MLP width of {m.inner}, "
                f"which does not divide across a tensor-parallel degree of {tp}"
            )
        plan.styles.append(
            (
                m.fqn(s.entry),
                PrepareFirstInput(input_layout=resid, desired_layout=Replicate(), use_local_output=False),
            )
        )
        plan.styles += [(m.fqn(p), ColwiseParallel()) for p in s.up]
        plan.styles.append((m.fqn(s.down), RowwiseParallel(output_layouts=resid)))
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
    inside = [a.fqn(a.spelling.entry) for a in found.attentions] + [
        m.fqn(m.spelling.entry) for m in found.mlps
    ]
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
        rank_regions=list(plan.rank_regions),
        sp_blocks=list(plan.sp_blocks),
    )
    merged.styles += [(n, s) for n, s in chosen.items() if s is not None]
    return merged
