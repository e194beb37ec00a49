"""Cross-entropy on class indices, and the LM head fused with it.

- `F.cross_entropy` / `nn.CrossEntropyLoss` (no class weights) -> `trifuse.cross_entropy`, with
  ignore_index, reduction and label smoothing carried.
- Hugging Face's loss path upcasts the logits first (`logits.float()`): the fused op reads them
  as they are and computes in fp32 (out_dtype=torch.float32), so the fp32 copy never exists.
- An LM head (`F.linear`, tied to the embedding or not) whose logits only feed the loss becomes
  `trifuse.linear_cross_entropy`: the (tokens x vocab) logits never exist. When the model also
  returns the logits (Hugging Face models do), the head's output is used outside the pattern:
  that match is rejected (the report says so) and the loss alone is fused on the logits.
- Such a head left as a linear, computing 16-bit logits over a vocabulary that is not a multiple
  of 8 (GPT-2's 50257, BERT's 30522), runs its three matmuls on cuBLAS's slow unaligned kernels
  (a row of the logits is not 16-byte aligned): 20 of GPT-2 medium's 115 ms a step on an H200;
  BERT-large's biased decoder took 6 ms of its 56 (three CUTLASS `align2` GEMMs of ~2 ms each:
  the bias epilogue does not save it). It becomes the same linear over a weight (and bias)
  padded to a multiple of 64 rows, whose logits are sliced back to the vocabulary (a view whose
  rows keep the padded stride, as Inductor's padding gives): the matmuls run aligned, for a copy
  of the weight and of the logits' gradient.
"""
import torch
import torch.nn.functional as F

from ._base import Match, Pattern, example_value, is_runtime_number, ops


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index, reduction, label_smoothing):
    return F.cross_entropy(logits, target, None, None, ignore_index, None, reduction, label_smoothing)


def cross_entropy_fused(logits, target, ignore_index, reduction, label_smoothing):
    return ops.cross_entropy(logits, target, ignore_index, reduction, label_smoothing)


def cross_entropy_upcast(logits: torch.Tensor, target: torch.Tensor, shape, ignore_index, reduction,
                         label_smoothing):
    """transformers' ForCausalLMLoss / fixed_cross_entropy: logits.float().view(-1, vocab)."""
    return F.cross_entropy(logits.to(torch.float32).view(shape), target, None, None, ignore_index, None,
                           reduction, label_smoothing)


def cross_entropy_upcast_fused(logits, target, shape, ignore_index, reduction, label_smoothing):
    return ops.cross_entropy(logits.view(shape), target, ignore_index, reduction, label_smoothing,
                             out_dtype=torch.float32)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias, target: torch.Tensor, shape,
                         ignore_index, reduction, label_smoothing):
    """nanoGPT: F.cross_entropy(lm_head(x).view(-1, vocab), targets.view(-1), ignore_index=-1)."""
    return F.cross_entropy(F.linear(hidden, weight, bias).view(shape), target, None, None, ignore_index, None,
                           reduction, label_smoothing)


def linear_cross_entropy_upcast(hidden: torch.Tensor, weight: torch.Tensor, bias, target: torch.Tensor, shape,
                                ignore_index, reduction, label_smoothing):
    return F.cross_entropy(F.linear(hidden, weight, bias).to(torch.float32).view(shape), target, None, None,
                           ignore_index, None, reduction, label_smoothing)


def linear_cross_entropy_fused(hidden, weight, bias, target, shape, ignore_index, reduction, label_smoothing):
    return ops.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias,
                                    ignore_index, reduction, label_smoothing)


def linear_cross_entropy_upcast_fused(hidden, weight, bias, target, shape, ignore_index, reduction,
                                      label_smoothing):
    return ops.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias,
                                    ignore_index, reduction, label_smoothing,
                                    out_dtype=torch.float32)


def _class_indices(m: Match) -> str | None:
    t = m.value("target")
    if not isinstance(t, torch.Tensor):
        return "no metadata for the target"
    if t.is_floating_point() or t.dtype == torch.bool:
        return f"the target is {t.dtype} (class probabilities), not class indices"
    if not is_runtime_number(m["ignore_index"]) or not is_runtime_number(m["label_smoothing"]):
        return "ignore_index / label_smoothing are not numbers"
    if m["reduction"] not in ("mean", "sum", "none"):
        return f"reduction {m['reduction']!r}"
    return None


def _rows_match_target(m: Match) -> str | None:
    """linear_cross_entropy flattens the hidden states to (tokens, H): the view must do the same."""
    h, t = m.value("hidden"), m.value("target")
    if not isinstance(h, torch.Tensor) or not isinstance(t, torch.Tensor):
        return "no metadata for hidden or target"
    if t.dim() != 1:
        return f"target has {t.dim()} dimensions after the view, not 1"
    return None


def lm_head(x: torch.Tensor, weight: torch.Tensor, bias):
    return F.linear(x, weight, bias)


def lm_head_padded(x, weight, bias, pad, out_features):
    """The head over `pad` zero rows more (and zeros past the bias; the pads' gradients are
    dropped), its logits sliced back."""
    if bias is not None:
        bias = F.pad(bias, (0, pad))
    return F.linear(x, F.pad(weight, (0, 0, 0, pad)), bias)[..., :out_features]


# Heads this wide or wider are padded: a vocabulary (narrower outputs cost little unaligned).
PAD_MIN_OUT_FEATURES = 1024
PAD_MULTIPLE = 64


def _misaligned_16bit_head(m: Match) -> str | None:
    w = m.value("weight")
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return "no metadata for the weight"
    if type(w).__name__ == "DTensor":  # trifuse.parallel's vocabulary-parallel head: its shards' own widths
        return "the weight is a DTensor"
    if m["bias"] is not None:
        b = m.value("bias")
        if not isinstance(b, torch.Tensor) or b.dim() != 1:
            return "the bias is not a 1-D tensor (no metadata, or a shape F.linear would not take)"
    n = w.shape[0]
    if n % 8 == 0:
        return f"out_features {n} is a multiple of 8: aligned already"
    if n < PAD_MIN_OUT_FEATURES:
        return f"out_features {n} < {PAD_MIN_OUT_FEATURES}: too narrow to pay for padding"
    outs = getattr(m, "outputs", ())
    y = example_value(outs[0]) if outs else None
    if not isinstance(y, torch.Tensor) or y.dtype not in (torch.float16, torch.bfloat16):
        return "the logits are not 16-bit (only 16-bit matmuls fall onto the unaligned kernels)"
    return None


def _padding(m: Match) -> dict:
    n = m.value("weight").shape[0]
    return {"pad": -n % PAD_MULTIPLE, "out_features": n}


_OPS = ("cross_entropy",)
_LCE_OPS = ("linear_cross_entropy",)
_LCE_FILTERS = (_class_indices, _rows_match_target)

PATTERNS = (
    Pattern("linear_cross_entropy_upcast", "cross_entropy", linear_cross_entropy_upcast,
            linear_cross_entropy_upcast_fused, _LCE_OPS, _LCE_FILTERS),
    Pattern("linear_cross_entropy", "cross_entropy", linear_cross_entropy, linear_cross_entropy_fused, _LCE_OPS,
            _LCE_FILTERS),
    Pattern("cross_entropy_upcast", "cross_entropy", cross_entropy_upcast, cross_entropy_upcast_fused, _OPS,
            (_class_indices,)),
    Pattern("cross_entropy", "cross_entropy", cross_entropy, cross_entropy_fused, _OPS, (_class_indices,)),
    # last: a head that linear_cross_entropy (or a bias-folding op) could not take
    Pattern("lm_head_padded", "cross_entropy", lm_head, lm_head_padded, (), (_misaligned_16bit_head,), stage=3,
            derive=_padding, quiet=True),
)
