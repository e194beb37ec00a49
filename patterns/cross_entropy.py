"""Cross-entropy on class indices, and the LM head fused with it.

- `F.cross_entropy` / `nn.CrossEntropyLoss` (no class weights) -> `trifuse.cross_entropy`, with
  ignore_index, reduction and label smoothing carried.
- Hugging Face's loss path upcasts the logits first (`logits.float()`): the fused op reads them
  as they are and computes in fp32 (out_dtype=torch.float32), so the fp32 copy never exists.
- An LM head (`F.linear`, tied to the embedding or not) whose logits only feed the loss becomes
  `trifuse.linear_cross_entropy`: the (tokens x vocab) logits never exist. When the model also
  returns the logits (Hugging Face models do), the head's output is used outside the pattern:
  that match is rejected (the report says so) and the loss alone is fused on the logits.
"""
import torch
import torch.nn.functional as F

from ._base import Match, Pattern, is_runtime_number, ops


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
)
