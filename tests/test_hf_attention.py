"""`attn_implementation="trifuse"` (trifuse/hf.py) on tiny transformers models: every call SDPA's
answer (padding, causal, sliding windows, soft caps, a KV cache), and packed batches with
flash-attention offsets on the varlen kernels, each sequence alone."""
import copy

import pytest
import torch
import trifuse
from _device import DEVICE
from _fusing import trifuse_ops_run
from tolerances import assert_close

transformers = pytest.importorskip("transformers")
import trifuse.hf  # noqa: E402  (after the skip: it needs transformers only when registering)

VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def registered():
    transformers.logging.set_verbosity_error()
    assert trifuse.hf.register() == "trifuse"


def tiny(model_type: str, attn: str, **overrides) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        tie_word_embeddings=False, **overrides)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(DEVICE)


def as_attention(model: torch.nn.Module, attn: str) -> torch.nn.Module:
    other = copy.deepcopy(model)
    other.set_attn_implementation(attn)
    return other


def check_against(model: torch.nn.Module, ref_attn: str, batch: dict) -> None:
    """model (attn "trifuse", fp32) against the same weights with `ref_attn` in float64 and fp32:
    the loss, the logits where labels are not -100, and every parameter's gradient."""
    ref = as_attention(model, ref_attn)
    ref64 = copy.deepcopy(ref).double()
    outs = [m(**batch, use_cache=False) for m in (model, ref64, ref)]
    keep = batch["labels"] != -100
    assert_close("logits", outs[0].logits[keep], outs[1].logits[keep], outs[2].logits[keep])
    assert_close("loss", outs[0].loss, outs[1].loss, outs[2].loss)
    for out in outs:
        out.loss.backward()
    for (name, p), p64, pr in zip(model.named_parameters(), ref64.parameters(), ref.parameters()):
        assert_close(f"grad {name}", p.grad, p64.grad, pr.grad)


def padded_batch(left: int = 6, right: int = 0) -> dict:
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 20), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :left] = 0
    mask[1, ids.shape[1] - right:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(lengths=(5, 17, 1, 9), flash_kwargs: bool = True) -> dict:
    torch.manual_seed(2)
    features = [{"input_ids": torch.randint(1, VOCAB, (n,)).tolist()} for n in lengths]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collate(features, return_tensors="pt")
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_padded_batch_is_sdpa():
    model = tiny("llama", "trifuse")
    check_against(model, "sdpa", padded_batch())
    ran = trifuse_ops_run(lambda: model(**padded_batch(), use_cache=False))
    assert "trifuse::attention" in ran and "trifuse::attention_varlen" not in ran


def test_packed_batch_with_offsets_runs_varlen_sequence_by_sequence():
    model = tiny("llama", "trifuse")
    batch = packed_batch()
    assert batch["input_ids"].shape[0] == 1 and "cu_seq_lens_q" in batch
    ran = trifuse_ops_run(lambda: model(**batch, use_cache=False))
    assert "trifuse::attention_varlen" in ran and "trifuse::attention" not in ran
    check_against(model, "sdpa", batch)  # transformers' SDPA masks the packed row block-diagonally
    # and each sequence run alone gives the same logits
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        cu = batch["cu_seq_lens_q"].tolist()
        for start, end in zip(cu[:-1], cu[1:]):
            alone = model(input_ids=batch["input_ids"][:, start:end], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start:end], alone, rtol=1e-5, atol=1e-5)


def test_packed_batch_without_offsets_keeps_the_dense_mask():
    """position_ids alone do not say that a batch of one is packed (a padded one has them too)."""
    model = tiny("llama", "trifuse")
    batch = packed_batch(flash_kwargs=False)
    ran = trifuse_ops_run(lambda: model(**batch, use_cache=False))
    assert "trifuse::attention" in ran and "trifuse::attention_varlen" not in ran
    check_against(model, "sdpa", batch)


def test_sliding_window_layers_keep_the_mask_even_when_packed():
    model = tiny("mistral", "trifuse", sliding_window=4)
    batch = packed_batch()
    ran = trifuse_ops_run(lambda: model(**batch, use_cache=False))
    assert "trifuse::attention_varlen" not in ran
    check_against(model, "sdpa", batch)


def test_soft_cap_and_alternating_windows_match_eager():
    """Gemma 2: a logit soft cap (SDPA refuses it; transformers' eager code applies it) and
    sliding-window layers between global ones. Right padding shorter than the window: a query
    whose window holds no real token would be a fully masked row, NaN in transformers' float64
    eager code (the reference), where trifuse gives SDPA's 0."""
    model = tiny("gemma2", "trifuse", head_dim=8, sliding_window=6, attn_logit_softcapping=2.0)
    with torch.no_grad():  # scores of a few units, where the cap bends them (at 0.1 it would not show)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    check_against(model, "eager", padded_batch(left=0, right=4))


def test_generation_with_a_cache_is_sdpa():
    model = tiny("llama", "trifuse").eval()
    ref = as_attention(model, "sdpa")
    ids = torch.randint(1, VOCAB, (2, 7), device=DEVICE)
    kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_fuse_fuses_the_rest_of_a_model_with_this_attention():
    model = tiny("llama", "trifuse")
    ref64 = as_attention(model, "sdpa").double()
    batch = packed_batch()
    fused = trifuse.fuse(copy.deepcopy(model))
    out = fused(**batch)
    out64 = ref64(**batch, use_cache=False)
    assert_close("fused loss", out.loss, out64.loss, model(**batch, use_cache=False).loss)
    counts = trifuse.report(fused).counts()
    assert counts.get("rms_norm") and counts.get("gated_activation")
    ran = trifuse_ops_run(lambda: fused(**batch))
    assert "trifuse::attention_varlen" in ran
