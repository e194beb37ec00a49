"""`attn_implementation="trifuse"` (trifuse/hf.py) on tiny transformers models: every call SDPA's
answer (padding, causal, sliding windows, soft caps, sinks, a KV cache), packed batches on the
varlen kernels (each sequence as if alone), and what it hands back to SDPA or the model's eager
code. Also fuse on packed batches: the same varlen dispatch in trifuse.ops.attention."""
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
        if p64.grad is None:  # a parameter the loss does not reach
            assert p.grad is None, name
            continue
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


def logits_alone(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model's logits for each packed sequence run by itself, concatenated as packed."""
    cu = batch["cu_seq_lens_q"].tolist()
    with torch.no_grad():
        return torch.cat([model(input_ids=batch["input_ids"][:, a:b], use_cache=False).logits
                          for a, b in zip(cu[:-1], cu[1:])], 1)


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["with-offsets", "position-ids-only"])
def test_packed_batch_runs_varlen_sequence_by_sequence(flash_kwargs):
    """transformers masks a packed row block-diagonally for SDPA (from the position ids; the
    collator's flash-attention offsets are not needed): trifuse runs varlen over the blocks."""
    model = tiny("llama", "trifuse")
    batch = packed_batch(flash_kwargs=flash_kwargs)
    assert batch["input_ids"].shape[0] == 1
    ran = trifuse_ops_run(lambda: model(**batch, use_cache=False))
    assert "trifuse::attention_varlen" in ran
    check_against(model, "sdpa", batch)
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits
    torch.testing.assert_close(logits, logits_alone(model, packed_batch()), rtol=1e-5, atol=1e-5)


def test_a_padded_batch_of_one_keeps_its_mask():
    model = tiny("llama", "trifuse")
    batch = {k: v[1:] for k, v in padded_batch().items()}  # the left-padded row alone
    ran = trifuse_ops_run(lambda: model(**batch, use_cache=False))
    assert "trifuse::attention" in ran and "trifuse::attention_varlen" not in ran
    check_against(model, "sdpa", batch)


def test_sliding_window_layers_run_varlen_with_the_window():
    """Mistral's packed mask is block-diagonal within its window: varlen with the window."""
    model = tiny("mistral", "trifuse", sliding_window=4)
    batch = packed_batch()
    ran = trifuse_ops_run(lambda: model(**batch, use_cache=False))
    assert "trifuse::attention_varlen" in ran
    check_against(model, "sdpa", batch)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch, use_cache=False).logits, logits_alone(model, batch),
                                   rtol=1e-5, atol=1e-5)


def test_gpt_oss_sinks_and_windows_packed_as_eager():
    """gpt-oss: sinks in every layer, a sliding window in every other one; transformers builds
    its masks without the position ids (its packed sequences see each other, in eager code too),
    and trifuse gives its eager code's answer."""
    model = tiny("gpt_oss", "trifuse", head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                 sliding_window=3, experts_implementation="eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    check_against(model, "eager", packed_batch())
    assert all(layer.self_attn.sinks.grad.abs().sum() > 0 for layer in model.model.layers)


def test_head_dims_over_256_run_sdpa():
    model = tiny("llama", "trifuse", head_dim=272)
    before = dict(trifuse.hf.FALLBACKS)
    check_against(model, "sdpa", padded_batch())
    assert trifuse.hf.FALLBACKS.get("head dim over 256", 0) > before.get("head dim over 256", 0)


def test_a_causal_model_that_leans_on_its_mask_is_refused_without_one():
    """BigBird-Pegasus' decoder attention says is_causal=False and lets its (eager) mask make it
    causal; transformers does not run it with SDPA. Without a mask: a clear error, not a
    bidirectional answer. With a padding mask (causal inside): SDPA's answer is the eager one."""
    model = tiny("bigbird_pegasus", "eager", attention_type="original_full", d_model=32, encoder_layers=1,
                 decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                 decoder_ffn_dim=64)
    other = as_attention(model, "trifuse")
    ids = torch.randint(1, VOCAB, (2, 12), device=DEVICE)
    with pytest.raises(ValueError, match="does not run with SDPA in transformers"):
        other(input_ids=ids, use_cache=False)
    check_against(other, "eager", padded_batch())


def test_sparse_attention_selected_keys_fold_into_the_mask():
    """GLM-5's and HY-V4's DeepSeek sparse attention hands a kernel implementation its top-k keys
    (`indices`) where it folds them into SDPA's mask: folded in the same way, the answer is
    SDPA's with the folded mask."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, device=DEVICE) for _ in range(3))
    indices = torch.stack([torch.randperm(6)[:3] for _ in range(12)]).view(2, 6, 3).to(DEVICE)
    keep = torch.zeros(2, 6, 6, dtype=torch.bool, device=DEVICE).scatter(-1, indices, True)[:, None]
    causal = torch.ones(6, 6, dtype=torch.bool, device=DEVICE).tril()
    module = torch.nn.Module()
    module.is_causal = True
    for mask, expected in ((None, keep & causal), (causal.expand(2, 1, 6, 6), keep & causal)):
        out, _ = trifuse.hf.attention_forward(module, q, k, v, mask, indices=indices)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=expected)
        torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_fuse_runs_packed_batches_on_varlen():
    """No attn_implementation needed: a fused SDPA model's attention sees the packed mask too."""
    model = tiny("llama", "sdpa")
    ref64 = copy.deepcopy(model).double()
    batch = packed_batch()
    fused = trifuse.fuse(copy.deepcopy(model))
    out = fused(**batch)
    unfused = model(**batch, use_cache=False).loss
    assert_close("fused loss", out.loss, ref64(**batch, use_cache=False).loss, unfused)
    assert "trifuse::attention_varlen" in trifuse_ops_run(lambda: fused(**batch))


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
