"""trifuse's attention as a transformers attention implementation: `attn_implementation="trifuse"`.

    import trifuse.hf
    trifuse.hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="trifuse")
    # or, on a loaded model: model.set_attn_implementation("trifuse")

What it adds over `trifuse.fuse` matching SDPA calls: packed batches without padding
(transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True), the padding-free
layout flash-attn users train with) run `trifuse.ops.attention_varlen`, each sequence attending
to its own tokens only, instead of a dense attention over the whole packed row under a (T, T)
block-diagonal mask. Every other call is SDPA's: the masks are transformers' SDPA masks
(padding, sliding windows, chunked or bidirectional spans), run by `trifuse.ops.attention` with
the soft cap and the sinks where a model has them.

The varlen path is taken only when the caller names the sequences: the four flash-attention
keyword arguments cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k on a batch of one,
and only in layers whose mask is causal-or-full within each sequence (no sliding window, no
sinks, no position bias). Offsets inferred from position_ids alone are not used: a batch of one
with a padding mask has position ids too, and ignoring its mask would give another answer.
transformers still builds the dense packed mask for such a batch (its mask functions never see
the offsets); this path leaves it unread.

`trifuse.fuse` on a model with this implementation fuses the other ops as usual; its attention
calls are trifuse's already.
"""
import torch

from .ops import attention, attention_varlen

NAME = "trifuse"
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def register(name: str = NAME) -> str:
    """Makes `attn_implementation=name` ("trifuse") available to transformers models: the
    attention function below, with transformers' SDPA masks. Idempotent; returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _varlen_offsets(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict):
    """(cu_q, cu_k, max_q, max_k) when this call may run varlen (see the module docstring)."""
    if query.shape[0] != 1 or any(kwargs.get(name) is None for name in _VARLEN_KWARGS):
        return None
    if kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        return None
    if kwargs.get("sliding_window") is not None or getattr(module, "sliding_window", None) is not None:
        return None
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor):
        return None
    return cu_q, cu_k, int(kwargs["max_length_q"]), int(kwargs["max_length_k"])


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
    returns ((B, S, Hq, Dv), None) as SDPA's and flash-attention's implementations do."""
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    softcap = kwargs.get("softcap") or None
    q_length = query.shape[2]
    varlen = _varlen_offsets(module, query, key, kwargs)
    if varlen is not None and q_length == key.shape[2]:
        cu_q, cu_k, max_q, max_k = varlen
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D): views, no copies
        out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout, softmax_scale=scaling,
                               causal=bool(is_causal) and q_length > 1, softcap=softcap or 0.0)
        return out.unsqueeze(0), None
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
                    scale=scaling, enable_gqa=key.shape[1] != query.shape[1], softcap=softcap,
                    sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None
