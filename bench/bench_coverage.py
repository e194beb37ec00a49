"""What `trifuse.fuse` finds in Hugging Face models of many families (tiny configs built from
scratch, no download), and whether the fused model trains like the unfused one: per family the
replacements of one training step, the loss and the largest gradient error against the unfused
model (fp32, dropout off), and the ops left as the model wrote them. Runs on a CPU in minutes.

    TRITON_INTERPRET=1 python bench/bench_coverage.py [family ...]   # writes bench/results/coverage.*

Named families replace their rows in the results and keep the others' (the header's date is then
that of the latest run).

This is coverage, not speed: the speed of what is fused is in the per-op and end-to-end tables.
"""
import copy
import json
import sys
import time
import warnings
from collections import Counter

import _harness as H  # noqa: I001
import torch

import trifuse

transformers = H.try_import("transformers")

HIDDEN, LAYERS, HEADS, VOCAB = 64, 2, 4, 96
_DECODER = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "intermediate_size": 2 * HIDDEN}
# family: (auto class, config overrides); dropout keys of every spelling are zeroed below.
FAMILIES = {
    "gpt2": ("causal", {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS}),
    "gpt_neox": ("causal", _DECODER),
    "gpt_bigcode": ("causal", {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS}),
    "opt": ("causal", {**_DECODER, "ffn_dim": 2 * HIDDEN, "word_embed_proj_dim": HIDDEN}),
    "falcon": ("causal", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
                          "multi_query": True, "new_decoder_architecture": False}),
    "phi": ("causal", _DECODER),
    "phi3": ("causal", _DECODER),
    "llama": ("causal", {**_DECODER, "num_key_value_heads": 2}),
    "mistral": ("causal", {**_DECODER, "num_key_value_heads": 2}),
    "mixtral": ("causal", {**_DECODER, "num_key_value_heads": 2}),
    "qwen2": ("causal", {**_DECODER, "num_key_value_heads": 2}),
    "qwen3": ("causal", {**_DECODER, "num_key_value_heads": 2, "head_dim": HIDDEN // HEADS}),
    "gemma": ("causal", {**_DECODER, "num_key_value_heads": 1, "head_dim": HIDDEN // HEADS}),
    # transformers' eager attention (SDPA has no logit soft cap), the cap small enough to bend tiny scores
    "gemma2": ("causal", {**_DECODER, "num_key_value_heads": 2, "head_dim": HIDDEN // HEADS,
                          "attn_logit_softcapping": 2.0, "attn_implementation": "eager"}),
    "olmo": ("causal", _DECODER),
    "olmo2": ("causal", _DECODER),
    "stablelm": ("causal", {**_DECODER, "num_key_value_heads": HEADS}),
    "starcoder2": ("causal", _DECODER),
    "granite": ("causal", _DECODER),
    "cohere": ("causal", {**_DECODER, "num_key_value_heads": HEADS}),
    "glm": ("causal", {**_DECODER, "num_key_value_heads": 2}),
    "helium": ("causal", {**_DECODER, "num_key_value_heads": 2, "head_dim": HIDDEN // HEADS}),
    "bert": ("masked", _DECODER),
    "roberta": ("masked", _DECODER),
    "distilbert": ("masked", {"dim": HIDDEN, "hidden_dim": 2 * HIDDEN, "n_layers": LAYERS, "n_heads": HEADS}),
    "albert": ("masked", {**_DECODER, "embedding_size": 32}),
    "electra": ("masked", _DECODER),
    "t5": ("seq2seq", {"d_model": HIDDEN, "d_ff": 2 * HIDDEN, "d_kv": HIDDEN // HEADS, "num_layers": LAYERS,
                       "num_heads": HEADS}),
    "bart": ("seq2seq", {"d_model": HIDDEN, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
                         "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
                         "encoder_ffn_dim": 2 * HIDDEN, "decoder_ffn_dim": 2 * HIDDEN}),
    # a sliding window (half-width local_attention // 2) narrower than the sequence on the second layer
    "modernbert": ("masked", {**_DECODER, "local_attention": 8, "global_attn_every_n_layers": 2,
                              "cls_token_id": 1, "sep_token_id": 2}),
    # a sliding-window layer (4 keys, of 12) and a global one
    "gemma3_text": ("causal", {**_DECODER, "num_key_value_heads": 2, "head_dim": HIDDEN // HEADS, "sliding_window": 4,
                               "layer_types": ["sliding_attention", "full_attention"]}),
    # transformers' default experts implementation (grouped_mm)
    "qwen3_moe": ("causal", {**_DECODER, "num_key_value_heads": 2, "head_dim": HIDDEN // HEADS, "num_experts": 4,
                             "num_experts_per_tok": 2, "moe_intermediate_size": HIDDEN}),
    "olmoe": ("causal", {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2}),
    # the second layer without rotary (SmolLM3's NoPE layers)
    "smollm3": ("causal", {**_DECODER, "num_key_value_heads": 2, "no_rope_layer_interval": 2}),
    "whisper": ("speech", {"d_model": HIDDEN, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
                           "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
                           "encoder_ffn_dim": 2 * HIDDEN, "decoder_ffn_dim": 2 * HIDDEN, "num_mel_bins": 16,
                           "max_source_positions": 8, "max_target_positions": 64}),
    # text and vision towers, the model's contrastive loss
    "clip": ("contrastive", _DECODER),
    "siglip": ("contrastive", _DECODER),
    # disentangled attention (transformers has only its eager code for it)
    "deberta-v2": ("masked", {**_DECODER, "relative_attention": True, "pos_att_type": ["p2c", "c2p"],
                              "position_buckets": 8, "attn_implementation": "eager"}),
    # DeBERTa (v1): q scaled before the product, c2p + p2c scores, its LayerNorm written out
    "deberta": ("masked", {**_DECODER, "relative_attention": True, "pos_att_type": ["c2p", "p2c"],
                           "attn_implementation": "eager"}),
    # older decoders with transformers' eager attention only, their blocks returning the attention
    # weights: GPT-J and CodeGen (interleaved partial rotary, parallel block), GPT-Neo (a global
    # and a local layer, window 4 of 12), BLOOM and MPT (ALiBi), XGLM
    "gptj": ("causal", {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "rotary_dim": 8,
                        "attn_implementation": "eager"}),
    "codegen": ("causal", {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "rotary_dim": 8, "n_ctx": 64,
                           "attn_implementation": "eager"}),
    "gpt_neo": ("causal", {**_DECODER, "attention_types": [[["global", "local"], LAYERS // 2]], "window_size": 4,
                           "attn_implementation": "eager"}),
    "bloom": ("causal", {"hidden_size": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "attn_implementation": "eager"}),
    "mpt": ("causal", {"d_model": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS, "attn_config": {"attn_pdrop": 0},
                       "emb_pdrop": 0, "attn_implementation": "eager"}),
    "biogpt": ("causal", _DECODER),
    "xglm": ("causal", {"d_model": HIDDEN, "num_layers": LAYERS, "attention_heads": HEADS, "ffn_dim": 2 * HIDDEN,
                        "attn_implementation": "eager"}),
    # the squared ReLU (`hidden_act="relu2"`): Nemotron's after an unbiased up_proj, Persimmon's after
    # a biased dense_h_to_4h, BitNet's gated before its sub-norm
    "nemotron": ("causal", {**_DECODER, "num_key_value_heads": 2}),
    "persimmon": ("causal", {**_DECODER, "qk_layernorm": True}),
    "bitnet": ("causal", {**_DECODER, "num_key_value_heads": 2}),
    # Apertus's trainable xIELU (transformers' PyTorch formula), its coefficients' gradients from the op
    "apertus": ("causal", {**_DECODER, "num_key_value_heads": 2}),
}
_NO_DROPOUT = {k: 0.0 for k in (
    "hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
    "attention_dropout", "hidden_dropout", "activation_dropout", "dropout_rate", "classifier_dropout")}


def build(family: str) -> tuple[torch.nn.Module, dict]:
    kind, overrides = FAMILIES[family]
    if kind == "contrastive":  # two towers, each a tiny config of its own
        text = {**overrides, "vocab_size": VOCAB, "max_position_embeddings": 64, "pad_token_id": 0,
                "bos_token_id": 0, "eos_token_id": 0, **_NO_DROPOUT}
        vision = {**overrides, "image_size": 16, "patch_size": 8, **_NO_DROPOUT}
        cfg = transformers.AutoConfig.for_model(family, text_config=text, vision_config=vision,
                                                projection_dim=HIDDEN, attn_implementation="sdpa")
        model = transformers.AutoModel.from_config(cfg)
        return model, {"input_ids": torch.randint(3, VOCAB, (2, 12)), "pixel_values": torch.randn(2, 3, 16, 16),
                       "return_loss": True}
    cfg = transformers.AutoConfig.for_model(
        family, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        decoder_start_token_id=0, tie_word_embeddings=False, **_NO_DROPOUT,
        **{"attn_implementation": "sdpa", **overrides})
    auto = {"causal": transformers.AutoModelForCausalLM, "masked": transformers.AutoModelForMaskedLM,
            "seq2seq": transformers.AutoModelForSeq2SeqLM, "speech": transformers.AutoModelForSpeechSeq2Seq}[kind]
    model = auto.from_config(cfg)
    ids = torch.randint(3, VOCAB, (2, 12))
    if kind == "speech":  # log-mel features: two convolutions (the second strided) to max_source_positions
        target = torch.randint(3, VOCAB, (2, 8))
        features = torch.randn(2, cfg.num_mel_bins, 2 * cfg.max_source_positions)
        return model, {"input_features": features, "decoder_input_ids": target, "labels": target, "use_cache": False}
    if kind == "seq2seq":
        target = torch.randint(3, VOCAB, (2, 8))
        return model, {"input_ids": ids, "decoder_input_ids": target, "labels": target, "use_cache": False}
    if kind == "masked":
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0
        return model, {"input_ids": ids, "attention_mask": mask, "labels": ids}
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}


def measure(family: str) -> dict:
    torch.manual_seed(0)
    model, kw = build(family)
    ref = copy.deepcopy(model)
    ref.train()
    ref_loss = ref(**kw).loss  # first: a config the model itself rejects is no finding about trifuse
    ref_loss.backward()
    t0 = time.perf_counter()
    trifuse.fuse(model).train()
    loss = model(**kw).loss
    loss.backward()
    losses = [loss.detach(), ref_loss.detach()]
    grad_err = max(((p.grad - q.grad).abs().max() / (q.grad.abs().max() + 1e-12)).item()
                   for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None and p.grad is not None
                   and q.grad.abs().max() > 1e-6)  # a mathematically zero gradient (a K bias) has no scale
    rep = trifuse.report(model)
    left = Counter(op for *_, op, _reason in rep.left())
    return {"family": family, "class": type(model).__name__,
            "replaced": ", ".join(f"{k} {v}" for k, v in sorted(rep.counts().items())),
            "left as written": ", ".join(f"{k} {v}" for k, v in sorted(left.items())) or "–",
            "loss rel err": ((losses[0] - losses[1]).abs() / losses[1].abs()).item(),
            "max grad rel err": grad_err,
            "calls run unfused": sum(sum(c.values()) for c in rep.unfused_calls().values()),
            "first step s": time.perf_counter() - t0}


COLUMNS = ("family", "class", "replaced", "left as written", "loss rel err", "max grad rel err", "calls run unfused",
           "first step s")


def main() -> None:
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    rows = []
    for family in sys.argv[1:] or FAMILIES:
        try:
            rows.append(measure(family))
        except Exception as e:  # noqa: BLE001  (one family failing is a finding, not the end of the sweep)
            rows.append({"family": family, "replaced": f"FAILED: {type(e).__name__}: {str(e)[:120]}"})
        print(rows[-1], flush=True)
    if sys.argv[1:]:
        rows = _merged(rows)
    H.print_table(rows, COLUMNS)
    H.write_results("coverage", rows, COLUMNS)


def _merged(rows: list[dict]) -> list[dict]:
    """The rows of the families just measured, with the other families' rows of the results file
    kept as they were, in FAMILIES order."""
    path = H.RESULTS_DIR / "coverage.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    by_family = {r["family"]: r for r in old} | {r["family"]: r for r in rows}
    order = [f for f in FAMILIES if f in by_family] + [f for f in by_family if f not in FAMILIES]
    return [by_family[f] for f in order]


def test_coverage_smoke():
    if transformers is None:
        import pytest

        pytest.skip("needs transformers")
    row = measure("gpt2")
    assert "attention 2" in row["replaced"] and row["max grad rel err"] < 1e-3
    assert row["left as written"] == "–" and row["calls run unfused"] == 0


if __name__ == "__main__":
    main()
