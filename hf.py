"""trifuse's attention as a transformers attention implementation: `attn_implementation="trifuse"`.

    import trifuse.hf
    trifuse.hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="trifuse")
    # or, on a loaded model: model.set_attn_implementation("trifuse")

SDPA's semantics on trifuse's kernels: the masks are transformers' SDPA masks (padding, sliding
windows, chunked or bidirectional spans, packed sequences), run by `trifuse.ops.attention`, with
the logit soft cap (Gemma 2, which SDPA refuses) and gpt-oss's sinks where a model has them.
Packed batches need nothing more: transformers masks packed position ids block-diagonally for
SDPA, and `trifuse.ops.attention` runs such a mask as varlen attention over its blocks.

DeepSeek sparse attention (GLM-5, HY-V4) hands a kernel implementation the keys each query
selected (`indices`) where it folds them into the mask for SDPA: they are folded in here the
same way. Calls with head dims over 256 (Gemma 4's 512) run SDPA itself (`trifuse.hf.FALLBACKS`
counts them). A causal model whose attention modules say is_causal=False and rely on the mask
(BigBird-Pegasus, which transformers does not run with SDPA either) is refused on a call without
a mask, never answered as a bidirectional one.

`trifuse.fuse` on a model with this implementation fuses the other ops as usual.
"""
import logging
import sys

import torch

from .kernels.attention import MAX_HEAD_DIM
from .ops import attention

NAME = "trifuse"
log = logging.getLogger("trifuse")
FALLBACKS: dict[str, int] = {}
_SDPA_SUPPORT: dict[type, bool] = {}


def register(name: str = NAME) -> str:
    """Makes `attn_implementation=name` ("trifuse") available to transformers models: the
    attention function below, with transformers' SDPA masks. Idempotent; returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _supports_sdpa(attention_class: type) -> bool:
    """Whether the model an attention module belongs to declares SDPA support (its modeling file's
    PreTrainedModel classes' `_supports_sdpa`); True where none is found."""
    known = _SDPA_SUPPORT.get(attention_class)
    if known is None:
        home = attention_class.__module__
        flags = [cls._supports_sdpa for name, cls in vars(sys.modules.get(home, sys)).items()
                 if isinstance(cls, type) and cls.__module__ == home and name.endswith("PreTrainedModel")
                 and hasattr(cls, "_supports_sdpa")]
        known = _SDPA_SUPPORT[attention_class] = all(flags)
    return known


def _selected_keys(indices: torch.Tensor, mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
                  causal: bool) -> torch.Tensor:
    """DeepSeek sparse attention's top-k keys per query (indices (B, Sq, k)) folded into the mask,
    as GLM-5's and HY-V4's code folds them for SDPA: only the selected keys stay."""
    bsz, q_len, k_len = query.shape[0], query.shape[2], key.shape[2]
    keep = torch.zeros(bsz, q_len, k_len, dtype=torch.bool, device=query.device)
    keep = keep.scatter(-1, indices.long(), True).unsqueeze(1)
    if mask is None:
        if not causal or q_len == 1:
            return keep
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, torch.finfo(mask.dtype).min)


def _fallback(reason: str, fn, *args, **kwargs):
    if reason not in FALLBACKS:
        log.info("trifuse attention_forward: %s; the call runs without trifuse", reason)
    FALLBACKS[reason] = FALLBACKS.get(reason, 0) + 1
    return fn(*args, **kwargs)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (B, Hq, S, D), key and value (B, Hkv, S_k, D);
    returns ((B, S, Hq, Dv), None) as SDPA's implementation does, with its rules."""
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if kwargs.get("indices") is not None:
        attention_mask = _selected_keys(kwargs["indices"], attention_mask, query, key, bool(is_causal))
    if attention_mask is None and q_length > 1 and not is_causal and not _supports_sdpa(type(module)):
        raise ValueError(f"trifuse.hf: {type(module).__name__}'s model does not run with SDPA in "
                         f"transformers, and attn_implementation=\"{NAME}\" is SDPA's semantics on trifuse's "
                         "kernels; load it with attn_implementation=\"eager\" (trifuse.fuse fuses its eager "
                         "attention)")
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return _fallback(f"head dim over {MAX_HEAD_DIM}", sdpa_attention_forward, module, query, key, value,
                         attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    position_bias = kwargs.get("position_bias")
    # SDPA's rules (transformers' sdpa_attention_forward): causal only without a mask, and a
    # causal call with more keys than queries keeps the first q_length keys.
    is_causal = q_length > 1 and attention_mask is None and bool(is_causal)
    if is_causal and key.shape[2] > q_length:
        key, value = key[:, :, :q_length], value[:, :, :q_length]
        if position_bias is not None:
            position_bias = position_bias[..., :q_length]
    if position_bias is not None:
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False
    out = attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
                    scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
                    softcap=kwargs.get("softcap") or None, sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None
