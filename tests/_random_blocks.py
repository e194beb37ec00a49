"""Random transformer blocks for fuzzing the rewriter: each block is drawn from the spellings real
models use (LayerNorm and RMSNorm as modules, functions and written out; SDPA and the explicit
attention chain with its scale and mask spellings; the GeLU forms; residual adds with dropout;
pre- and post-norm) and from near misses that must NOT be fused as the op they resemble (eps
outside the square root, an unbiased variance, a GeLU constant off by a little, a scale applied
after the softmax, a softmax over the wrong axis, a residual that is subtracted...). Whatever
`fuse` does with a block, the fused model must compute what the block computes: a near miss is
left as written, a faithful spelling is fused or left, never changed.

`Spec` is one draw; `RandomBlock(spec)` builds it; `random_model(spec)` stacks two of them in a
ModuleList (so that `fuse` captures them through Dynamo, one capture for both)."""
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("ln_module", "ln_functional", "ln_no_bias", "ln_written", "rms_module", "rms_written",
         "rms_written_upcast",
         # L2 norms (eps under the root; nGPT's on an fp32 copy, cast back; F.normalize's floor, and
         # written out), a weight after
         "l2_written", "l2_fp32_copy", "l2_normalize", "l2_clamped",
         # F.normalize times its weight, then sqrt(width) (lucidrains' RMSNorm)
         "l2_normalize_weight_first",
         # near misses
         "ln_unbiased_var", "rms_eps_outside_sqrt", "rms_mean_over_seq", "ln_no_centering",
         "l2_eps_outside", "l2_clamped_above")
ATTENTIONS = ("sdpa", "sdpa_causal", "sdpa_gqa", "chain_mul", "chain_div", "chain_masked_fill",
              "chain_where", "chain_softmax_fp32", "chain_gqa_repeat_interleave", "chain_gqa_expand",
              # other ranks: 5-D (batch, head pairs, 2, seq, dim), the mask over the 5-D scores
              # (timm's Hiera, torchvision's MaxViT); SDPA's unbatched call per sequence
              "sdpa_windows", "chain_windows", "chain_windows_inplace_dropout", "sdpa_unbatched",
              # relative positions from q written into the scores past the first token's row and
              # column: over a view of that slice (timm's MViT V2), or `+=` (torchvision's MViT)
              "chain_slice_positions", "chain_slice_positions_inplace",
              # a mask per window of two over a view of the scores that leaves the images to -1
              # (timm's Swin WindowAttention, written out: swin_s3)
              "chain_shifted_window_mask",
              # a bool mask added to the scores (1 where True, no key dropped: BERT's eager attention
              # handed Grounding DINO's bool mask)
              "chain_bool_added",
              # positions from q per axis of the tokens' grid, added over a 6-D view of the scores
              # and viewed back (SAM's and ViTDet's decomposed relative positions)
              "chain_decomposed_positions",
              # near misses
              "chain_scale_after_softmax", "chain_softmax_wrong_axis", "chain_mask_multiplied",
              "chain_no_scale_sqrt_off", "chain_gqa_tiled")
# (no ReLU: its kink makes the gradient jump where the fp16 rounding of the fused and the unfused
# model differ in the sign of an input near 0, which the oracle rule reads as an error, 0.32 on a
# weight's gradient in the first fp16 fuzz run; SiLU is a smooth activation no GeLU pattern takes;
# the squared ReLU's gradient, 2 relu(x), and the cube's are continuous, so they are drawn)
ACTIVATIONS = ("gelu", "gelu_tanh", "nn_gelu", "new_gelu_written", "erf_written", "silu", "silu_gated",
               "silu_gated_up_silu", "silu_gated_fp32_copy", "relu_squared", "relu_squared_gated",
               # near misses
               "new_gelu_constant_off", "erf_sqrt2_off", "gelu_of_half", "relu_cubed")
RESIDUALS = ("plus_dropout", "dropout_plus",
             # near misses
             "minus_dropout", "scaled_residual")
MASKS = ("none", "bool_keypad", "float_keypad")
NEAR_MISSES = {"ln_unbiased_var", "rms_eps_outside_sqrt", "rms_mean_over_seq", "ln_no_centering",
               "l2_eps_outside", "l2_clamped_above",
               "chain_scale_after_softmax", "chain_softmax_wrong_axis", "chain_mask_multiplied",
               "chain_no_scale_sqrt_off", "chain_gqa_tiled", "new_gelu_constant_off", "erf_sqrt2_off",
               "gelu_of_half", "relu_cubed",
               "minus_dropout", "scaled_residual"}


class _Drawn:
    """What every spec below has: an id, its fields joined (the fuzz prints it for a failure)."""

    @property
    def id(self) -> str:
        return "-".join(str(v) for v in dataclasses.astuple(self))


@dataclasses.dataclass(frozen=True)
class Spec(_Drawn):
    norm: str = "ln_module"
    attention: str = "sdpa"
    activation: str = "gelu"
    residual: str = "plus_dropout"
    mask: str = "none"
    pre_norm: bool = True
    eps: float = 1e-5
    dropout: float = 0.1
    mlp_bias: bool = True

    def near_misses(self) -> list[str]:
        return [v for v in (self.norm, self.attention, self.activation, self.residual) if v in NEAR_MISSES]


HIDDEN, HEADS, KV_HEADS = 32, 4, 2  # head dim 8; the GQA spellings share each kv head by 2 heads
MAX_SEQ = 16  # the longest sequence a position table or a window mask covers
WINDOWS = 2  # windows per image in chain_shifted_window_mask (the batch a multiple of it)


class Norm(nn.Module):
    def __init__(self, kind: str, eps: float) -> None:
        super().__init__()
        self.kind, self.eps = kind, eps
        if kind == "ln_module":
            self.ln = nn.LayerNorm(HIDDEN, eps=eps)
        elif kind == "rms_module":
            self.rms = nn.RMSNorm(HIDDEN, eps=eps)
        else:
            self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(HIDDEN))
            if kind not in ("ln_no_bias",) and not kind.startswith(("rms", "l2")):
                self.bias = nn.Parameter(0.1 * torch.randn(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, eps = self.kind, self.eps
        if k == "ln_module":
            return self.ln(x)
        if k == "rms_module":
            return self.rms(x)
        if k == "ln_functional":
            return F.layer_norm(x, (HIDDEN,), self.weight, self.bias, eps)
        if k == "ln_no_bias":
            return F.layer_norm(x, (HIDDEN,), self.weight, None, eps)
        if k == "ln_written":
            mean = x.mean(-1, keepdim=True)
            var = (x - mean).pow(2).mean(-1, keepdim=True)
            return (x - mean) * torch.rsqrt(var + eps) * self.weight + self.bias
        if k == "rms_written":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight
        if k == "rms_written_upcast":  # Llama's: compute in fp32, back to the input dtype
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return self.weight * h.to(x.dtype)
        if k == "l2_written":
            return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps) * self.weight
        if k == "l2_fp32_copy":
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps)).type_as(x) * self.weight
        if k == "l2_normalize":
            return F.normalize(x, dim=-1, eps=eps) * self.weight
        if k == "l2_clamped":
            return x / x.norm(dim=-1, keepdim=True).clamp(min=eps) * self.weight
        if k == "l2_normalize_weight_first":
            return F.normalize(x, dim=-1, eps=eps) * self.weight * HIDDEN ** 0.5
        # near misses
        if k == "l2_clamped_above":  # a ceiling, not a floor
            return x / x.norm(dim=-1, keepdim=True).clamp(max=1.0) * self.weight
        if k == "l2_eps_outside":
            return x / (x.norm(dim=-1, keepdim=True) + eps) * self.weight
        if k == "ln_unbiased_var":
            mean = x.mean(-1, keepdim=True)
            return (x - mean) / torch.sqrt(x.var(-1, keepdim=True) + eps) * self.weight + self.bias
        if k == "rms_eps_outside_sqrt":
            return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * self.weight
        if k == "rms_mean_over_seq":  # (the norm over the sequence fuses as one; its weight stays)
            return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + eps) * self.weight
        if k == "ln_no_centering":
            var = x.var(-1, keepdim=True, unbiased=False)
            return x * torch.rsqrt(var + eps) * self.weight + self.bias
        raise ValueError(k)


def gelu_like(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "new_gelu_written":  # Hugging Face's NewGELUActivation
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if kind == "erf_written":
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if kind == "silu":
        return F.silu(x)
    if kind == "new_gelu_constant_off":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.0447 * torch.pow(x, 3.0))))
    if kind == "erf_sqrt2_off":
        return x * 0.5 * (1.0 + torch.erf(x / 1.41))
    if kind == "gelu_of_half":
        return F.gelu(0.5 * x)
    if kind == "relu_squared":  # Primer's, modded-nanoGPT's spelling (no kink: relu(x)^2 is C^1)
        return F.relu(x).square()
    if kind == "relu_cubed":  # another power: its ReLU may take the bias, the cube stays
        return torch.relu(x) ** 3
    raise ValueError(kind)


class Mlp(nn.Module):
    def __init__(self, kind: str, bias: bool) -> None:
        super().__init__()
        self.kind = kind
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN, bias=bias)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN, bias=bias)
        self.act = nn.GELU() if kind == "nn_gelu" else None
        if kind.startswith("silu_gated") or kind == "relu_squared_gated":  # Llama's: down(act(gate(x)) * up(x))
            self.gate = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu_gated":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        if self.kind == "silu_gated_up_silu":  # the other operand activated: another function
            return self.down(self.gate(x) * F.silu(self.up(x)))
        if self.kind == "silu_gated_fp32_copy":  # diffusers' FP32SiLU (Lumina 2)
            return self.down(F.silu(self.gate(x).float()).type_as(x) * self.up(x))
        if self.kind == "relu_squared_gated":  # BitNet's MLP (without its sub-norm)
            return self.down(torch.square(torch.relu(self.gate(x))) * self.up(x))
        h = self.up(x)
        h = self.act(h) if self.act is not None else gelu_like(self.kind, h)
        return self.down(h)


class Attention(nn.Module):
    def __init__(self, kind: str, dropout: float) -> None:
        super().__init__()
        self.kind, self.p = kind, dropout
        self.kv_heads = KV_HEADS if "gqa" in kind else HEADS
        d = HIDDEN // HEADS
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.kv = nn.Linear(HIDDEN, 2 * self.kv_heads * d)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        if kind.startswith("chain_slice_positions"):  # a key position table and a bias per key
            self.rel = nn.Parameter(0.3 * torch.randn(MAX_SEQ, d))
            self.rel_bias = nn.Parameter(0.3 * torch.randn(MAX_SEQ))
        if kind == "chain_decomposed_positions":  # a table per axis: (query row, key row, d), and columns
            self.rel_rows = nn.Parameter(0.3 * torch.randn(MAX_SEQ, MAX_SEQ, d))
            self.rel_cols = nn.Parameter(0.3 * torch.randn(MAX_SEQ, MAX_SEQ, d))
        if kind == "chain_shifted_window_mask":  # Swin's: 0 where two tokens share a region, -100 elsewhere
            regions = torch.randint(0, 2, (WINDOWS, MAX_SEQ), generator=torch.Generator().manual_seed(5))
            apart = regions[:, :, None] != regions[:, None, :]
            self.register_buffer("window_mask",
                                 torch.zeros(WINDOWS, MAX_SEQ, MAX_SEQ).masked_fill(apart, -100.0))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        d, kind = HIDDEN // HEADS, self.kind
        q = self.q(x).view(b, s, HEADS, d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        group = HEADS // self.kv_heads
        if kind == "chain_gqa_repeat_interleave":
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        elif kind == "chain_gqa_expand":  # transformers' repeat_kv
            k, v = (t[:, :, None].expand(b, self.kv_heads, group, s, d).reshape(b, HEADS, s, d)
                    for t in (k, v))
        elif kind == "chain_gqa_tiled":  # near miss: head h reads kv head h % kv_heads, not h // group
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        p = self.p if self.training else 0.0
        if "windows" in kind:  # heads in pairs: (b, H/2, 2, s, d), the mask's heads dim kept as 1
            q, k, v = (t.reshape(b, HEADS // 2, 2, s, d) for t in (q, k, v))
            mask = mask.unsqueeze(1) if mask is not None else None
        if kind == "sdpa_unbatched":
            o = torch.stack([F.scaled_dot_product_attention(q[i], k[i], v[i], attn_mask=None if mask is None
                                                            else mask[i], dropout_p=p) for i in range(b)])
        elif kind in ("sdpa", "sdpa_causal", "sdpa_gqa", "sdpa_windows"):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                               is_causal=kind == "sdpa_causal" and mask is None,
                                               enable_gqa=kind == "sdpa_gqa")
        else:
            scores = q @ k.transpose(-1, -2)
            if kind == "chain_div":
                scores = scores / math.sqrt(d)
            elif kind == "chain_no_scale_sqrt_off":
                scores = scores / math.sqrt(d + 1)
            elif kind != "chain_scale_after_softmax":
                scores = scores * d ** -0.5
            if mask is not None:
                if mask.dtype == torch.bool:
                    if kind == "chain_where":
                        scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
                    elif kind == "chain_mask_multiplied":
                        scores = scores * mask
                    elif kind == "chain_bool_added":
                        scores = scores + mask
                    else:
                        scores = scores.masked_fill(~mask, float("-inf"))
                elif kind == "chain_mask_multiplied":
                    scores = scores * mask
                else:
                    scores = scores + mask
            if kind.startswith("chain_slice_positions"):
                rel = torch.einsum("bhqd,kd->bhqk", q[:, :, 1:], self.rel[: s - 1])
                if kind == "chain_slice_positions_inplace":
                    scores[:, :, 1:, 1:] += rel
                else:
                    grid = scores[:, :, 1:, 1:].view(b, HEADS, s - 1, 1, s - 1)
                    scores[:, :, 1:, 1:] = (grid + rel.unsqueeze(-2) + self.rel_bias[: s - 1]).view(
                        b, HEADS, s - 1, s - 1)
            if kind == "chain_decomposed_positions":  # the tokens as a grid of rows x cols
                rows = max(r for r in range(1, math.isqrt(s) + 1) if s % r == 0)
                cols = s // rows
                grid_q = q.reshape(b, HEADS, rows, cols, d)
                rel_rows = torch.einsum("bnhwc,hkc->bnhwk", grid_q, self.rel_rows[:rows, :rows])
                rel_cols = torch.einsum("bnhwc,wkc->bnhwk", grid_q, self.rel_cols[:cols, :cols])
                scores = (scores.view(b, HEADS, rows, cols, rows, cols) + rel_rows[..., None]
                          + rel_cols[..., None, :]).view(b, HEADS, s, s)
            if kind == "chain_shifted_window_mask":  # the batch as images of WINDOWS windows each
                windows = self.window_mask[:, :s, :s].to(scores.dtype)
                scores = scores.view(-1, WINDOWS, HEADS, s, s) + windows.unsqueeze(1).unsqueeze(0)
                scores = scores.view(-1, HEADS, s, s)
            if kind == "chain_softmax_fp32":  # transformers' eager attention
                probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            else:
                probs = scores.softmax(-2 if kind == "chain_softmax_wrong_axis" else -1)
            if kind == "chain_scale_after_softmax":
                probs = probs * d ** -0.5
            # in place (timm's TNT) only with p 0 or in eval: autograd refuses a write to the softmax's output
            inplace = kind == "chain_windows_inplace_dropout" and not (self.training and p)
            probs = F.dropout(probs, p, self.training, inplace)
            o = probs @ v
        o = o.reshape(b, HEADS, s, d)
        return self.out(o.transpose(1, 2).reshape(b, s, HIDDEN))


class RandomBlock(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.norm1, self.norm2 = Norm(spec.norm, spec.eps), Norm(spec.norm, spec.eps)
        self.attn = Attention(spec.attention, spec.dropout)
        self.mlp = Mlp(spec.activation, spec.mlp_bias)

    def residual(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        kind, p = self.spec.residual, self.spec.dropout
        if kind == "plus_dropout":
            return r + F.dropout(x, p, self.training)
        if kind == "dropout_plus":
            return F.dropout(x, p, self.training) + r
        if kind == "minus_dropout":
            return r - F.dropout(x, p, self.training)
        if kind == "scaled_residual":
            return 0.5 * r + F.dropout(x, p, self.training)
        raise ValueError(kind)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.spec.pre_norm:
            x = self.residual(self.attn(self.norm1(x), mask), x)
            return self.residual(self.mlp(self.norm2(x)), x)
        x = self.norm1(self.residual(self.attn(x, mask), x))
        return self.norm2(self.residual(self.mlp(x), x))


class RandomModel(nn.Module):
    """Two blocks of one spec in a ModuleList, and the mask the spec asks for built per call."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.blocks = nn.ModuleList([RandomBlock(spec) for _ in range(2)])

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        keep = torch.arange(s, device=x.device)[None, :] < lengths[:, None]  # key padding (B, S)
        mask = None
        if self.spec.mask == "bool_keypad":
            mask = keep[:, None, None, :]
        elif self.spec.mask == "float_keypad":
            mask = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(
                ~keep, torch.finfo(x.dtype).min)[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        return x


def random_model(spec: Spec, seed: int = 0, dtype: torch.dtype = torch.float32) -> RandomModel:
    torch.manual_seed(seed)
    return RandomModel(spec).to(dtype)


def inputs(batch: int = 2, seq: int = 7, seed: int = 1,
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, HIDDEN, generator=gen).to(dtype)
    lengths = torch.tensor([seq, max(1, seq - 3)][:batch] + [seq] * max(0, batch - 2))
    return x, lengths


# ---------------------------------------------------------------------------------------------
# LM heads and losses
# ---------------------------------------------------------------------------------------------

LOSSES = ("functional", "module", "log_softmax_nll",
          # near misses: a class-weighted loss, a temperature on the logits
          "class_weights", "temperature")


@dataclasses.dataclass(frozen=True)
class HeadSpec(_Drawn):
    vocab: int = 1030  # past 1024 and not a multiple of 8: a 16-bit head runs padded when kept
    bias: bool = False
    tied: bool = False
    upcast: bool = True  # transformers' logits.float() before the loss
    shift: bool = True  # a causal LM's labels[..., 1:] against logits[..., :-1, :]
    ignored: str = "some"  # "none", "some", "all" labels at ignore_index
    reduction: str = "mean"
    smoothing: float = 0.0
    returns_logits: bool = True  # without: the head and the loss become linear_cross_entropy
    loss: str = "functional"


class RandomHead(nn.Module):
    """Embedding -> a small body -> the LM head -> the loss, as `spec` writes them."""

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, HIDDEN)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, spec.vocab, bias=spec.bias)
        if spec.tied:
            self.head.weight = self.embed.weight
        if spec.loss == "class_weights":
            self.register_buffer("class_weight", torch.rand(spec.vocab) + 0.5)
        if spec.loss == "module":
            self.loss_fn = nn.CrossEntropyLoss(reduction=spec.reduction, label_smoothing=spec.smoothing)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        spec = self.spec
        h = torch.tanh(self.body(self.embed(ids)))
        logits = self.head(h)
        lg = logits.float() if spec.upcast else logits
        if spec.shift:
            lg, labels = lg[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
        lg, labels = lg.view(-1, spec.vocab), labels.view(-1)
        if spec.loss == "functional":
            loss = F.cross_entropy(lg, labels, reduction=spec.reduction, label_smoothing=spec.smoothing)
        elif spec.loss == "module":
            loss = self.loss_fn(lg, labels)
        elif spec.loss == "log_softmax_nll":
            loss = F.nll_loss(F.log_softmax(lg, dim=-1), labels, reduction=spec.reduction)
        elif spec.loss == "class_weights":
            loss = F.cross_entropy(lg, labels, weight=self.class_weight.to(lg.dtype),
                                   reduction=spec.reduction, label_smoothing=spec.smoothing)
        elif spec.loss == "temperature":
            loss = F.cross_entropy(lg / 0.7, labels, reduction=spec.reduction, label_smoothing=spec.smoothing)
        else:
            raise ValueError(spec.loss)
        return (loss, logits) if spec.returns_logits else loss


def head_inputs(spec: HeadSpec, batch: int = 2, seq: int = 6,
                seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, spec.vocab, (batch, seq), generator=gen)
    if spec.ignored == "some":
        labels[0, :2] = -100
        labels[-1, -1] = -100
    elif spec.ignored == "all":
        labels[:] = -100
    return ids, labels


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings
# ---------------------------------------------------------------------------------------------

ROPES = ("halves", "halves_partial", "interleaved", "pairs_to_halves", "complex", "diffusers_pairs",
         "diffusers_halves", "ltx_before_heads", "wan_written", "matrix", "mochi_slices", "halves_chunk",
         # near misses: rotate_half's sign on the wrong half, cos and sin swapped, pairs swapped,
         # diffusers' unbound pairs with the sign on the wrong one, each pair times the other column
         "halves_sign_flipped", "halves_cos_sin_swapped", "interleaved_pairs_swapped",
         "diffusers_pairs_sign_flipped", "matrix_columns_swapped")
NEAR_MISSES_ROPE = {"halves_sign_flipped", "halves_cos_sin_swapped", "interleaved_pairs_swapped",
                    "diffusers_pairs_sign_flipped", "matrix_columns_swapped"}


def _rotate_half(x: torch.Tensor, flipped: bool = False) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((x2, -x1) if flipped else (-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor, swapped: bool = False) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even, -odd) if swapped else (-odd, even), dim=-1).flatten(-2)


def _ltx_rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    real, imag = x.unflatten(2, (-1, 2)).unbind(-1)
    return (x.float() * cos + torch.stack([-imag, real], dim=-1).flatten(2).float() * sin).to(x.dtype)


class RopeAttention(nn.Module):
    """q, k, v projections, q and k rotated as `kind` writes it (the k rotation only with
    `both`), then SDPA."""

    def __init__(self, kind: str, both: bool = True) -> None:
        super().__init__()
        self.kind, self.both = kind, both
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def tables(self, s: int, d: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        freqs = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv[None, :]  # (S, d/2)
        if self.kind.startswith(("interleaved", "diffusers_pairs", "ltx", "wan")):
            emb = freqs.repeat_interleave(2, dim=-1)
        elif self.kind in ("pairs_to_halves", "mochi_slices"):
            emb = freqs
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]  # (1, 1, S, width)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, freqs) -> torch.Tensor:
        kind = self.kind
        if kind in ("halves", "halves_partial"):
            return x * cos + _rotate_half(x) * sin
        if kind == "halves_chunk":  # Megatron's and ERNIE-Image's rotate_half through chunk
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        if kind == "halves_sign_flipped":
            return x * cos + _rotate_half(x, flipped=True) * sin
        if kind == "halves_cos_sin_swapped":
            return x * sin + _rotate_half(x) * cos
        if kind == "interleaved":
            return x * cos + _rotate_pairs(x) * sin
        if kind == "interleaved_pairs_swapped":
            return x * cos + _rotate_pairs(x, swapped=True) * sin
        if kind == "pairs_to_halves":  # DeepSeek's apply_rotary_pos_emb_interleave
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if kind.startswith("diffusers_"):  # diffusers' apply_rotary_emb(use_real=True), each product cast
            if kind == "diffusers_halves":
                x_real, x_imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
                rotated = torch.cat([-x_imag, x_real], dim=-1)
            else:
                x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
                pair = [x_imag, -x_real] if kind.endswith("sign_flipped") else [-x_imag, x_real]
                rotated = torch.stack(pair, dim=-1).flatten(3)
            return (x.float() * cos + rotated.float() * sin).to(x.dtype)
        if kind == "wan_written":  # Wan's: strided writes of each half into an empty tensor
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            c, s = cos[..., 0::2], sin[..., 1::2]
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * c - x2 * s
            out[..., 1::2] = x1 * s + x2 * c
            return out.type_as(x)
        if kind == "mochi_slices":  # Mochi's: the even and odd features upcast apart, each half cast back
            even, odd = x[..., 0::2].float(), x[..., 1::2].float()
            return torch.stack([(even * cos - odd * sin).to(x.dtype), (even * sin + odd * cos).to(x.dtype)],
                               dim=-1).flatten(-2)
        if kind == "complex":  # Meta's Llama reference
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * freqs).flatten(3).to(x.dtype)
        if kind.startswith("matrix"):  # BFL's Flux apply_rope: each pair times a 2x2 matrix
            x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
            first, second = (1, 0) if kind == "matrix_columns_swapped" else (0, 1)
            out = freqs[..., first] * x_[..., 0] + freqs[..., second] * x_[..., 1]
            return out.reshape(*x.shape).type_as(x)
        raise ValueError(kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = HIDDEN // HEADS
        if self.kind == "ltx_before_heads":  # LTX-Video's: (B, S, C) q and k rotated, then the heads split
            cos, sin = (t[0] for t in self.tables(s, HIDDEN, x.dtype, x.device))  # (1, S, C)
            q, k, v = self.q(x), self.k(x), self.v(x)
            q = _ltx_rotated(q, cos, sin)
            k = _ltx_rotated(k, cos, sin) if self.both else k
            q, k, v = (t.view(b, s, HEADS, d).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(o.transpose(1, 2).reshape(b, s, HIDDEN))
        q, k, v = (lin(x).view(b, s, HEADS, d).transpose(1, 2) for lin in (self.q, self.k, self.v))
        rot = d // 2 if self.kind == "halves_partial" else d
        cos, sin = self.tables(s, rot, x.dtype, x.device)
        freqs = None
        if self.kind == "complex":
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
            angles = torch.arange(s, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
            freqs = torch.polar(torch.ones_like(angles), angles)[None, None]  # (1, 1, S, d/2)
        if self.kind.startswith("matrix"):  # BFL's rope(): (1, 1, S, d/2, 2, 2) rotation matrices
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
            angles = torch.arange(s, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
            c, sn = angles.cos(), angles.sin()
            freqs = torch.stack([c, -sn, sn, c], dim=-1).view(1, 1, s, d // 2, 2, 2)
        if rot < d:
            q = torch.cat((self.rotate(q[..., :rot], cos, sin, freqs), q[..., rot:]), dim=-1)
            if self.both:
                k = torch.cat((self.rotate(k[..., :rot], cos, sin, freqs), k[..., rot:]), dim=-1)
        else:
            q = self.rotate(q, cos, sin, freqs)
            if self.both:
                k = self.rotate(k, cos, sin, freqs)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, HIDDEN))


@dataclasses.dataclass(frozen=True)
class RopeSpec(_Drawn):
    """One draw of `RopeModel` (bench/fuzz_rewriter.py)."""

    kind: str = "halves"
    both: bool = True  # k rotated too


class RopeModel(nn.Module):
    def __init__(self, kind: str, both: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([RopeAttention(kind, both) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


# ---------------------------------------------------------------------------------------------
# Adaptive norms (diffusion transformers): a norm modulated per sample by a conditioning vector
# ---------------------------------------------------------------------------------------------

ADAPTIVE = ("dit", "continuous", "commuted", "pixart", "scale_only", "shift_only", "rms_dit",
            "affine_dit", "fp32_copy",
            # per token (FLUX.3's, Helios' mixed timesteps): a product over tokens beside a
            # per-sample shift, a scale that varies along the tokens (`1 + scale` folded into the
            # loads), scale and shift both per token
            "gate_over_tokens", "per_token_scale", "per_token_both",
            # near misses: the shift subtracted (its scale fuses alone, as Lumina 2's), the
            # modulation before the norm, a 16-bit norm modulated by an fp32 product (left: the
            # model rounds the norm first)
            "shift_subtracted", "modulated_before_norm", "wider_product")
NEAR_MISSES_ADAPTIVE = {"modulated_before_norm", "wider_product"}
# Faithful but left to PyTorch: none now (a scale alone is Lumina 2's and Z-Image's, a shift alone
# HunyuanDiT's: both fused).
LEFT_ADAPTIVE: set[str] = set()
COND = 12
# How the attention's output is added back before the MLP's norm: gated per sample (either way
# round), ungated (PixArt's cross-attention), through a gate that varies along the tokens (a
# per-token gate, Qwen-Image 2.1's), after a Dropout(0.0) (Wan's and LTX-Video's cross-
# attention output), or broadcast from one token (a near miss: no residual stream of one shape,
# the add stays PyTorch's).
ADAPTIVE_RESIDUALS = ("gated", "gated_commuted", "ungated", "per_token_gate", "after_dropout_p0", "broadcast")


class AdaptiveBlock(nn.Module):
    """adaLN-Zero as DiT writes it, its norm's modulation spelt as `kind`: the norm (no affine but
    for `affine_dit`), modulated per sample by shift and scale from a conditioning vector, the
    attention, gated and added back (as `residual` spells it); then the MLP the same way."""

    def __init__(self, kind: str, residual: str = "gated") -> None:
        super().__init__()
        self.kind, self.residual = kind, residual
        affine = kind == "affine_dit"
        make = nn.RMSNorm if kind == "rms_dit" else nn.LayerNorm
        self.norm1, self.norm2 = (make(HIDDEN, eps=1e-6, elementwise_affine=affine) for _ in range(2))
        self.ada = nn.Linear(COND, 6 * HIDDEN)
        self.attn = Attention("sdpa", 0.0)
        self.mlp = Mlp("gelu_tanh", True)

    def modulate(self, norm: nn.Module, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor):
        k = self.kind
        if k == "modulated_before_norm":
            return norm(x * (1 + scale[:, None]) + shift[:, None])
        if k == "fp32_copy":  # Wan's: the norm of an fp32 copy, modulated in fp32, cast back
            return (norm(x.float()) * (1 + scale[:, None].float()) + shift[:, None].float()).to(x.dtype)
        h = norm(x)
        if k in ("dit", "rms_dit", "affine_dit"):
            return h * (1 + scale[:, None]) + shift[:, None]
        if k == "continuous":
            return h * (1 + scale)[:, None, :] + shift[:, None, :]
        if k == "commuted":
            return shift.unsqueeze(1) + (1 + scale.unsqueeze(1)) * h
        if k == "pixart":
            return h * (1 + scale.view(-1, 1, HIDDEN)) + shift.view(-1, 1, HIDDEN)
        if k == "scale_only":
            return h * (1 + scale[:, None])
        if k == "shift_only":
            return h + shift[:, None]
        if k == "gate_over_tokens":
            return h * torch.sigmoid(x) + shift[:, None]
        if k in ("per_token_scale", "per_token_both"):
            ramp = torch.linspace(0.5, 1.5, x.shape[1], device=x.device, dtype=x.dtype)[:, None]
            if k == "per_token_both":
                return (1 + scale[:, None] * ramp) * h + shift[:, None] * ramp.flip(0)
            return h * (1 + scale[:, None] * ramp) + shift[:, None]
        if k == "shift_subtracted":
            return h * (1 + scale[:, None]) - shift[:, None]
        if k == "wider_product":
            return (h * (1 + scale[:, None].float()) + shift[:, None].float()).to(x.dtype)
        raise ValueError(k)

    def add_back(self, x: torch.Tensor, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        r = self.residual
        if r == "gated":
            return x + gate.unsqueeze(1) * h
        if r == "gated_commuted":
            return h * gate[:, None] + x
        if r == "ungated":
            return x + h
        if r == "per_token_gate":
            ramp = torch.linspace(0.5, 1.5, x.shape[1], device=x.device, dtype=x.dtype)[:, None]
            return x + gate[:, None] * ramp * h
        if r == "after_dropout_p0":
            return x + F.dropout(h, 0.0, self.training)
        if r == "broadcast":
            return x + h.mean(1, keepdim=True)
        raise ValueError(r)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(cond)).chunk(6, dim=1)
        h = self.attn(self.modulate(self.norm1, x, shift1, scale1), None)
        x = self.add_back(x, h, gate1)
        h = self.mlp(self.modulate(self.norm2, x, shift2, scale2))
        return x + gate2.unsqueeze(1) * h


@dataclasses.dataclass(frozen=True)
class AdaptiveSpec(_Drawn):
    """One draw of `AdaptiveModel` (bench/fuzz_rewriter.py)."""

    kind: str = "dit"
    residual: str = "gated"


class AdaptiveModel(nn.Module):
    def __init__(self, kind: str, residual: str = "gated") -> None:
        super().__init__()
        self.blocks = nn.ModuleList([AdaptiveBlock(kind, residual) for _ in range(2)])

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cond)
        return x


def adaptive_inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return inputs(dtype=dtype)[0], torch.randn(2, COND, generator=gen).to(dtype)


# ---------------------------------------------------------------------------------------------
# ResNet blocks of diffusion UNets and VAEs (GroupNorm, then SiLU, then a convolution, twice)
# ---------------------------------------------------------------------------------------------

# The norm's spellings: diffusers' nn.GroupNorm, the functional forms, no affine, one group
# (LayerNorm over C, H, W), one channel a group (InstanceNorm), and guided-diffusion's /
# latent-diffusion's GroupNorm32 (the norm of an fp32 copy, cast back); and conv nets' norms over
# the channels at each pixel, written out: ViTDet's LayerNorm, timm's RmsNorm2d; and the video
# VAEs' (diffusers' WanRMS_norm: F.normalize of an fp32 copy, cast back, times sqrt(C), the weight
# and 0.0).
RESNET_NORMS = ("gn_module", "gn_functional", "torch_group_norm", "gn_no_affine", "gn_one_group",
                "gn_channel_groups", "gn32_fp32_copy", "ln2d_written", "rms2d_written", "vae_rms2d")
# the family each norm spelling fuses as
RESNET_NORM_FAMILY = {"ln2d_written": "layer_norm", "rms2d_written": "rms_norm", "vae_rms2d": "rms_norm"}
# The activation after it: nn.SiLU, F.silu, written out, and near misses that must keep their
# own maths: SiLU in place (the norm's output overwritten: left), QuickGELU's y * sigmoid(1.702 y)
# (no SiLU: bias_gelu's quick form takes it), the SiLU of the norm plus the time embedding, the
# norm read twice (y * sigmoid(y) + y), GeLU.
RESNET_ACTS = ("nn_silu", "f_silu", "silu_written",
               "silu_inplace", "quick_gelu", "silu_after_add", "norm_read_twice", "gelu")
# where the SiLU joins the norm; elsewhere the norm is fused alone (or, silu_after_add's first
# norm, SiLU-less: its add comes first)
RESNET_SILU_JOINS = {"nn_silu", "f_silu", "silu_written"}
RESNET_CHANNELS, RESNET_TEMB = 8, 6


@dataclasses.dataclass(frozen=True)
class ResnetSpec(_Drawn):
    """One draw of `ResnetModel` (bench/fuzz_rewriter.py)."""

    norm: str = "gn_module"
    act: str = "nn_silu"
    eps: float = 1e-6
    channels_last: bool = False  # the model and its input (diffusers' advice for speed)


class ResnetNorm(nn.Module):
    def __init__(self, kind: str, eps: float) -> None:
        super().__init__()
        self.kind, self.eps = kind, eps
        self.groups = {"gn_one_group": 1, "gn_channel_groups": RESNET_CHANNELS}.get(kind, 4)
        affine = kind != "gn_no_affine"
        self.norm = nn.GroupNorm(self.groups, RESNET_CHANNELS, eps=eps, affine=affine)
        with torch.no_grad():
            if affine:
                self.norm.weight.add_(0.3 * torch.randn(RESNET_CHANNELS))
                self.norm.bias.add_(0.3 * torch.randn(RESNET_CHANNELS))
        self.in_float64 = False  # the float64 twin's (tests/_fusing.check_against_unfused's twin64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.kind, self.norm
        if k == "ln2d_written":
            u = x.mean(1, keepdim=True)
            s = (x - u).pow(2).mean(1, keepdim=True)
            return n.weight[:, None, None] * ((x - u) / torch.sqrt(s + self.eps)) + n.bias[:, None, None]
        if k == "rms2d_written":
            x = x * torch.rsqrt(torch.mean(x.pow(2), dim=1, keepdim=True) + self.eps)
            return x * n.weight.reshape(1, -1, 1, 1)
        if k == "vae_rms2d":
            h = F.normalize(x.double() if self.in_float64 else x.float(), dim=1, eps=self.eps).to(x.dtype)
            return h * RESNET_CHANNELS ** 0.5 * n.weight[:, None, None] + 0.0
        if k == "gn_functional":
            return F.group_norm(x, self.groups, n.weight, n.bias, self.eps)
        if k == "torch_group_norm":
            return torch.group_norm(x, self.groups, n.weight, n.bias, self.eps)
        if k == "gn32_fp32_copy":
            return n(x.double() if self.in_float64 else x.float()).type(x.dtype)
        return n(x)


def resnet_act(kind: str, y: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    if kind == "nn_silu":
        return nn.functional.silu(y, False)  # what nn.SiLU() calls
    if kind == "f_silu":
        return F.silu(y)
    if kind == "silu_written":
        return y * torch.sigmoid(y)
    if kind == "silu_inplace":
        return F.silu(y, inplace=True)
    if kind == "quick_gelu":
        return y * torch.sigmoid(1.702 * y)
    if kind == "silu_after_add":
        return F.silu(y + temb[:, :, None, None])
    if kind == "norm_read_twice":
        return y * torch.sigmoid(y) + y
    if kind == "gelu":
        return F.gelu(y)
    raise ValueError(kind)


class ResnetBlock(nn.Module):
    """diffusers' ResnetBlock2D: norm, activation, conv, plus the time embedding; norm,
    activation, dropout, conv; plus the input."""

    def __init__(self, norm: str, act: str, eps: float) -> None:
        super().__init__()
        self.act = act
        self.norm1, self.norm2 = ResnetNorm(norm, eps), ResnetNorm(norm, eps)
        self.conv1 = nn.Conv2d(RESNET_CHANNELS, RESNET_CHANNELS, 3, padding=1)
        self.conv2 = nn.Conv2d(RESNET_CHANNELS, RESNET_CHANNELS, 3, padding=1)
        self.time_proj = nn.Linear(RESNET_TEMB, RESNET_CHANNELS)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        t = self.time_proj(F.silu(temb))
        h = self.conv1(resnet_act(self.act, self.norm1(x), t))
        h = h + t[:, :, None, None]
        h = self.conv2(self.dropout(resnet_act(self.act, self.norm2(h), t)))
        return x + h


class ResnetModel(nn.Module):
    def __init__(self, norm: str, act: str, eps: float = 1e-6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResnetBlock(norm, act, eps) for _ in range(2)])

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, temb)
        return x


def resnet_model(norm: str, act: str, dtype: torch.dtype = torch.float32, eps: float = 1e-6,
                 channels_last: bool = False) -> ResnetModel:
    """Seeded, in `dtype`; GroupNorm32's parameters left in fp32, as guided-diffusion's
    convert_to_fp16 leaves them (its fp32 copy of x meets them; the other spellings in fp16 too:
    their fp32 gradients would be held to fp32's error bound while fp16's rounding of everything
    upstream moves them, by either ordering of the same sums: the fused SiLU, rounded once, moved
    a norm weight's gradient 0.2x to 2.6x as far from float64's as PyTorch's own, median 0.9).
    `channels_last`: its convolutions' weights so (their outputs, the norms' inputs, follow)."""
    torch.manual_seed(0)
    model = ResnetModel(norm, act, eps).to(dtype)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if norm == "gn32_fp32_copy":
        for m in model.modules():
            if isinstance(m, nn.GroupNorm):
                m.float()
    return model


def resnet_check_is_noise(norm: str, act: str, dtype: torch.dtype) -> bool:
    """Draws the oracle rule cannot judge: in fp16, GroupNorm32's fp32 norm weights' gradients,
    held to fp32's bound, behind a QuickGELU that fuses (its maths in fp32, rounded once; the
    model's rounds each of its ops to fp16): 2 of 150 draws of a long fuzz measured 2.7x
    PyTorch's own error there, both orderings of the same fp16-rounded sums, every other value
    within the rule."""
    return norm == "gn32_fp32_copy" and act == "quick_gelu" and dtype == torch.float16


def resnet_float64_twin(model: nn.Module) -> nn.Module:
    """The float64 model: GroupNorm32's copy in float64 (an fp32 copy beside float64 parameters
    cannot run, and the copy's precision is what is compared)."""
    for m in model.modules():
        if isinstance(m, ResnetNorm):
            m.in_float64 = True
    return model


def resnet_inputs(dtype: torch.dtype = torch.float32, channels_last: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, RESNET_CHANNELS, 6, 5, generator=gen).to(dtype)
    return (x.to(memory_format=torch.channels_last) if channels_last else x,
            torch.randn(2, RESNET_TEMB, generator=gen).to(dtype))
