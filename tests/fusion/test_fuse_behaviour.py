"""fuse() keeps a model working in every way it was used: generate with a KV cache, train/eval,
new shapes without unbounded recaptures, autocast, data-dependent control flow and numpy,
deep copies; it says what it could not fuse (the KV-cache trap, Dynamo fallbacks, missing
ops); it runs on the PyTorch reference path too."""
import collections
import contextlib
import functools
import math
import copy
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import _models
import pytest
import torch
import torch.nn.functional as F
import trifuse
from _fusing import PassThroughMode, available_counts, has_op, needs_ops, op_names, trifuse_ops_run
from tolerances import assert_close
from torch import nn


def test_gpt2_generate_still_works_and_cache_calls_are_reported():
    torch.manual_seed(0)
    model, inputs, _ = _models.gpt2()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    model.eval()
    ref.eval()
    ids = inputs(2, 5)["input_ids"]
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    unfused = trifuse.report(model).unfused_calls()
    # the argument's name is transformers' (past_key_values up to 5.23, cache from 5.24)
    assert any(
        re.match(r"argument \w+ is a DynamicCache", reason) for calls in unfused.values() for reason in calls
    ), unfused


def test_generate_without_the_cache_after_training_runs_the_fused_blocks():
    # As a model evaluated during training is: the blocks hold training captures, and generate's
    # eval, no_grad calls at a growing length (6, 7, ... tokens) capture anew and run trifuse's ops.
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    model = model.double()
    ref = copy.deepcopy(model).eval()
    trifuse.fuse(model)
    loss_fn(model, inputs(2, 8)).backward()
    model.eval()
    ids = inputs(2, 6)["input_ids"]
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "use_cache": False,
              "output_scores": True, "return_dict_in_generate": True}
    out = {}
    ran = trifuse_ops_run(lambda: out.setdefault("fused", model.generate(ids, **kwargs)))
    expected = ref.generate(ids, **kwargs)
    assert torch.equal(out["fused"].sequences, expected.sequences)
    for fused, unfused in zip(out["fused"].scores, expected.scores, strict=True):
        # float64 models; transformers' norms compute in fp32, so they agree to fp32's level
        assert float((fused - unfused).abs().max()) <= 1e-6 * float(unfused.abs().max())
    assert {"trifuse::attention", "trifuse::bias_gelu", "trifuse::dropout_add_layer_norm",
            "trifuse::layer_norm"} <= ran, ran
    assert trifuse.report(model).unfused_calls() == {}


def test_kv_cache_in_training_does_not_recompile_per_layer():
    # With use_cache=True transformers builds a DynamicCache in training; capturing it would
    # make Dynamo guard on each layer's cache entry and recompile per layer (DESIGN.md's trap).
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2(layers=4)
    trifuse.fuse(model)
    kw = inputs(2, 8)
    kw["use_cache"] = True
    loss_fn(model, kw).backward()
    block = next(u for u in trifuse.report(model).units if u.unit.strategy == "dynamo")
    assert block.unit.captures == [] and block.unit.eager_calls.total() == 4
    kw["use_cache"] = False
    loss_fn(model, kw).backward()
    assert len(block.unit.captures) == 1 and block.unit.fallbacks == 0
    assert trifuse.report(model).counts()["layer_norm"] == 5


def test_training_calls_without_use_cache_run_fused():
    """The usual training call (Trainer's: labels, no use_cache) would build a KV cache and keep
    the blocks unfused; fuse makes such calls use_cache=False, with the same loss and gradients,
    says so in its report, and leaves eval calls (which return the cache) alone."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2(layers=3)
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    kw = inputs(2, 8)
    kw.pop("use_cache")
    loss, loss_ref = loss_fn(model, kw), loss_fn(ref, kw)
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref)
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5)
    report = trifuse.report(model)
    block = next(u for u in report.units if u.unit.strategy == "dynamo")
    assert len(block.unit.captures) == 1 and block.unit.eager_calls.total() == 0
    assert any("use_cache=False" in n.reason for n in report.notes)
    model.eval()
    with torch.no_grad():
        assert model(kw["input_ids"]).past_key_values is not None


class PerLayer(nn.Module):
    """A block whose forward reads a per-layer constant: Dynamo recompiles for each layer."""

    def __init__(self, i):
        super().__init__()
        self.i = i
        self.norm = nn.LayerNorm(8)

    def forward(self, x, *args):
        return self.norm(x) * float(self.i + 1)


@torch._dynamo.config.patch(recompile_limit=2)  # not monkeypatch: its undo deletes the entry
def test_dynamo_fallback_is_detected_and_reported():
    model = nn.Sequential(*[PerLayer(i) for i in range(4)])
    model = nn.ModuleDict({"layers": nn.ModuleList(model)})
    trifuse.fuse(model)
    x = torch.randn(2, 8)
    for layer in model["layers"]:
        x = layer(x)
    unit = trifuse.report(model).units[0].unit
    assert unit.fallbacks == 2 and len(unit.captures) == 2
    assert "fell back to eager" in trifuse.report(model).table()


class PerRowLoop(nn.Module):
    """Mochi's attention processor's shape: a loop over the batch that selects each row's valid
    tokens with `nonzero` (an output shape Dynamo cannot know): a graph break inside a loop, so
    Dynamo runs that frame as written, its attention unfused."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def attend(self, x, mask):
        rows = []
        for i in range(x.shape[0]):
            keep = mask[i].nonzero()[:, 0]
            q = x[i:i + 1, keep]
            rows.append(F.scaled_dot_product_attention(q, q, q))
        return torch.cat(rows)

    def forward(self, x, mask):
        return self.attend(self.norm(x), mask)


def test_a_graph_break_in_a_block_is_reported_with_its_reason():
    model = nn.ModuleDict({"layers": nn.ModuleList([PerRowLoop(), PerRowLoop()])})
    trifuse.fuse(model)
    x, mask = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.bool)
    for layer in model["layers"]:
        x = layer(x, mask)
    table = trifuse.report(model).table()
    assert "graph break" in table and "nonzero" in table, table


def test_a_block_dynamo_cannot_capture_runs_as_written_and_is_reported(monkeypatch):
    """Dynamo's own failure on a block (a TorchDynamoException, e.g. from its fake tensors) must
    not break the model: that call and every later one run the block as written, once eager has
    shown the model itself is fine; the report names the block and the reason."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    block = next(u for u in trifuse.report(model).units if u.unit.strategy == "dynamo").unit
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise torch._dynamo.exc.TorchRuntimeError("Dynamo failed to run FX node with fake tensors")

    monkeypatch.setattr(block, "compiled", failing)
    kw = inputs(2, 8)
    for _ in range(2):
        torch.testing.assert_close(loss_fn(model, kw), loss_fn(ref, kw))
    assert len(calls) == 3, "after the first failure (and its retries: static shapes, then without .item() in the " \
                            "graph) the block runs as written without asking Dynamo again"
    reasons = trifuse.report(model).unfused_calls()
    assert any("TorchDynamo could not capture it (TorchRuntimeError: Dynamo failed" in r and n == 4
               for calls_by_reason in reasons.values() for r, n in calls_by_reason.items())


def test_a_block_dynamo_fails_on_with_a_plain_error_runs_as_written():
    """Some of Dynamo's own checks fail with plain errors, not a TorchDynamoException: tracing
    Longformer's global attention (the question's tokens attend to all, as its QA head asks)
    raises `AssertionError: Expected bool, got FakeTensor` (torch.compile of the layer alone fails
    the same way). That crashed the fused model; its layers must run as written, and say so."""
    tf = _models._quiet_transformers()
    torch.manual_seed(0)
    cfg = tf.LongformerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=64, attention_window=4, max_position_embeddings=64,
                              pad_token_id=0, bos_token_id=0, eos_token_id=0, sep_token_id=2,
                              attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    model = tf.LongformerForQuestionAnswering(cfg)
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    ids = torch.randint(3, 64, (2, 12))
    ids[:, 3] = ids[:, 4] = ids[:, -1] = cfg.sep_token_id  # question, two separators, context, one
    kw = {"input_ids": ids, "start_positions": torch.tensor([5, 7]), "end_positions": torch.tensor([6, 9])}
    for _ in range(2):
        loss, expected = model(**kw).loss, ref(**kw).loss
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        loss.backward()
        expected.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    reasons = trifuse.report(model).unfused_calls()
    if not reasons and torch.torch_version.TorchVersion(torch.__version__) < "2.13":
        pytest.skip("Dynamo captures Longformer's global attention here (torch 2.11, transformers 5.17)")
    expected_reason = "TorchDynamo could not capture it (AssertionError: Expected bool"
    assert any("LongformerLayer" in unit and any(expected_reason in r and n == 4 for r, n in calls.items())
               for unit, calls in reasons.items()), reasons


def test_an_error_of_the_block_itself_is_raised_not_taken_for_dynamo(monkeypatch):
    """An error raised while the captured block runs (not while Dynamo traces it) is the model's:
    it raises, as it would unfused, and the block is not marked as one Dynamo cannot capture."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    trifuse.fuse(model)
    kw = inputs(2, 8)
    loss_fn(model, kw)
    block = next(u for u in trifuse.report(model).units if u.unit.strategy == "dynamo").unit
    compiled = block.compiled

    def fails(*args, **kwargs):
        raise ValueError("the block's own error")

    monkeypatch.setattr(block, "compiled", fails)
    with pytest.raises(ValueError, match="the block's own error"):
        loss_fn(model, kw)
    monkeypatch.setattr(block, "compiled", compiled)
    assert block.failed is None
    loss_fn(model, kw)
    assert not trifuse.report(model).unfused_calls()


def test_a_capture_that_fails_with_scalars_in_the_graph_is_retried_without(monkeypatch):
    """Dynamo captures keep `.item()` in the graph (capture_scalar_outputs); should Dynamo fail on
    a block with that setting, the block is captured again with static shapes (where DeBERTa's
    unbacked attention span works), then, failing that too, without scalars, and stays fused."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    block = next(u for u in trifuse.report(model).units if u.unit.strategy == "dynamo").unit
    compiled, settings = block.compiled, []

    def fails_with_scalars(*args, **kwargs):
        config = torch._dynamo.config
        settings.append((config.capture_scalar_outputs, config.automatic_dynamic_shapes))
        if config.capture_scalar_outputs:
            raise torch._dynamo.exc.TorchRuntimeError("Dynamo failed on an unbacked symbol")
        return compiled(*args, **kwargs)

    monkeypatch.setattr(block, "compiled", fails_with_scalars)
    kw = inputs(2, 8)
    for _ in range(2):
        torch.testing.assert_close(loss_fn(model, kw), loss_fn(ref, kw))
    dynamic = torch._dynamo.config.automatic_dynamic_shapes
    assert settings[:3] == [(True, dynamic), (True, False), (False, False)], settings
    assert all(setting == (False, False) for setting in settings[3:]), settings
    assert block.failed is None and not trifuse.report(model).unfused_calls()
    assert torch._dynamo.config.capture_scalar_outputs is False, "the user's Dynamo setting is left as it was"
    assert torch._dynamo.config.automatic_dynamic_shapes is dynamic
    assert trifuse.report(model).counts()["attention"] == _models.LAYERS


def test_an_error_of_the_model_itself_still_raises_through_a_fused_block():
    """A block called with an input it rejects (Dynamo's tracing fails on it too) raises the
    model's own error from the eager run, and the block stays fused for the next good call."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    trifuse.fuse(model)
    with pytest.raises(RuntimeError, match="shape|size"):
        model.transformer.h[0](torch.randn(2, 8, _models.HIDDEN + 1))  # the wrong hidden size
    loss_fn(model, inputs(2, 8)).backward()
    block = next(u for u in trifuse.report(model).units if u.unit.strategy == "dynamo").unit
    assert block.failed is None and trifuse.report(model).counts()["attention"] == 2


class SharedKV(collections.UserDict):
    """Like transformers' KVSharingDict (Gemma 4): a UserDict the layers write and read."""


class SharingBlock(nn.Module):
    def __init__(self, stores: bool):
        super().__init__()
        self.stores = stores
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x, shared):
        h = self.norm(x)
        if self.stores:
            shared["kv"] = (self.proj(h),)
        return x + h * shared["kv"][0]


def test_a_userdict_argument_is_captured_and_its_writes_seen():
    """A dict-like container of tensors (Gemma 4's shared KV states) goes through the capture:
    the block fuses, and what one layer writes into it the next reads."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"layers": nn.ModuleList([SharingBlock(True), SharingBlock(False)])})
    ref = copy.deepcopy(model)

    def run(m, x):
        shared = SharedKV()
        for layer in m["layers"]:
            x = layer(x, shared)
        return x

    trifuse.fuse(model)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(run(model, x), run(ref, x))
    report = trifuse.report(model)
    # each `x + norm(x) * kv` a per-token modulation; the first norm also stays for the projection
    assert not report.unfused_calls() and report.counts()["layer_norm"] == 3


class FilledInPlace(nn.Module):
    """RecurrentGemma's scan: a buffer created, then filled in place step by step, then gated.
    The buffer is one graph node from its creation on; the gated activation's replacement, which
    goes where the pattern starts (before the loop), would read it empty."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 8)

    def forward(self, x):
        gate = F.gelu(self.gate(x), approximate="tanh")
        out = torch.zeros_like(x)
        for t in range(x.shape[1]):
            out[:, t] = x[:, t] * 2.0
        return gate * out


def test_an_input_written_in_place_after_the_pattern_starts_is_read_where_the_pattern_ends():
    """Where the pattern starts the buffer is still empty: the replacement goes after the last
    matched node (the product), where the buffer is filled, and says so in its note."""
    from _fusing import check_against_unfused

    # Dynamo: fx cannot trace the loop over a traced length
    report = check_against_unfused(FilledInPlace, (torch.randn(2, 3, 8),), "dynamo")
    assert report.counts() == {"gated_activation": 1}
    assert "placed where the pattern ends: an input is written in place after it starts" in report.table()


class _MaskFilledAfterTheScores(nn.Module):
    """torchvision's Swin: the scores first, then a window mask made by `mask[h, w] = i` and
    turned into an additive mask by ops that copy (not views of the written tensor), then added.
    With `write_key` ("key", or "base": the tensor the key is a view of), the key is also written
    in place between the scores that read it and the product with v: then neither where the
    pattern starts (the mask is filled after it) nor where it ends (the key changed) may the
    replacement go."""

    def __init__(self, write_key: str | None = None):
        super().__init__()
        self.qkv, self.write_key = nn.Linear(16, 48), write_key

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        base = k.clone() if self.write_key else k
        k = base.view_as(base) if self.write_key == "base" else base
        scores = (q * 8 ** -0.5) @ k.transpose(-2, -1)
        if self.write_key:
            base.mul_(3.0)
        ids = x.new_zeros(n)
        ids[n // 2:] = 1.0
        mask = (ids.unsqueeze(0) - ids.unsqueeze(1)).abs() * -100.0
        out = torch.softmax(scores + mask, dim=-1) @ v
        return out + k.mean() if self.write_key else out


def test_what_a_moved_input_reads_is_not_written_after_the_pattern_starts():
    """The replacement would go where the pattern starts, the mask's computation moved up with
    it: the tensor it reads is filled in place after the scores (no view of the mask itself), so
    moved up it read zeros, a wrong answer (the first version did). It goes where the pattern
    ends instead, after the fill and the mask's computation, nothing moved."""
    from _fusing import check_against_unfused

    for capture in ("dynamo", "fx"):
        report = check_against_unfused(_MaskFilledAfterTheScores, (torch.randn(2, 6, 16),), capture)
        assert report.counts() == {"attention": 1}, capture
        assert "placed where the pattern ends" in report.table()


class _ValueBaseWrittenAfterTheScores(nn.Module):
    """The value is a view of a tensor written in place after the scores (and before the product
    with v): where the pattern starts the replacement would read v before the write, where it ends
    after it, as the unfused code does."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        base = v.clone()
        value = base.view_as(base)
        scores = (q * 8 ** -0.5) @ k.transpose(-2, -1)
        base.mul_(3.0)
        return torch.softmax(scores, dim=-1) @ value


def test_a_write_to_the_base_of_an_input_after_the_pattern_starts_is_seen():
    from _fusing import check_against_unfused

    block = _ValueBaseWrittenAfterTheScores
    report = check_against_unfused(block, (torch.randn(2, 6, 16),), "dynamo", grads=False)
    assert report.counts() == {"attention": 1}
    assert "placed where the pattern ends" in report.table()


@pytest.mark.parametrize("written", ["key", "base"])
def test_an_input_written_while_the_pattern_reads_it_is_left_as_written(written):
    from _fusing import check_against_unfused

    writing = functools.partial(_MaskFilledAfterTheScores, write_key=written)
    report = check_against_unfused(writing, (torch.randn(2, 6, 16),), "dynamo", grads=False)
    assert "attention" not in report.counts()
    rejected = [reason for *_, reason in report.rejected()]
    assert any("written in place after the pattern starts; nor where it ends: " in r
               and "is written in place while the pattern reads it" in r for r in rejected), rejected


class _ShiftedWindowAttention(nn.Module):
    """Swin's shifted windows as torchvision and timm (fused_attn off) write them: the
    relative position bias added, then the (windows, N, N) mask over a (B / nW, nW, H, N, N)
    view of the scores, viewed back."""

    def __init__(self, heads=2, windows=3, n=5, per_batch=None):
        super().__init__()
        self.heads, self.qkv, self.per_batch = heads, nn.Linear(16, 48), per_batch
        self.bias = nn.Parameter(torch.randn(1, heads, n, n))
        self.register_buffer("mask", torch.where(torch.rand(windows, n, n) < 0.3, -100.0, 0.0))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1) + self.bias
        windows = self.mask.shape[0]
        per = b // windows if self.per_batch is None else self.per_batch  # timm writes -1
        attn = attn.view(per, windows, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = F.dropout(torch.softmax(attn.view(-1, self.heads, n, n), dim=-1), 0.0, self.training)
        return (attn @ v).transpose(1, 2).reshape(b, n, c)


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_a_window_mask_added_over_a_view_of_the_scores_is_fused(capture):
    """The normalizer tiles the window mask over the batch, (B, 1, N, N), and the attention
    chain with two added masks takes it (without: the softmax stayed unfused)."""
    from _fusing import check_against_unfused

    make = (lambda: _Stack([_ShiftedWindowAttention()])) if capture == "fx" else _ShiftedWindowAttention
    report = check_against_unfused(make, (torch.randn(6, 5, 16),), capture, train=True)
    assert report.counts() == available_counts({"attention": 1}), report.table()
    assert ("(_ShiftedWindowAttention, fx)" if capture == "fx" else "dynamo") in report.table()
    # `view(-1, nW, ...)` (timm's): the images read off q's size at run time (once tiled over nW
    # entries only, a wrong shape: timm's Swin crashed)
    report = check_against_unfused(lambda: _Stack([_ShiftedWindowAttention(per_batch=-1)]),
                                   (torch.randn(6, 5, 16),), capture, train=True)
    assert report.counts() == available_counts({"attention": 1}), report.table()


class _DecomposedRelPosAttention(nn.Module):
    """SAM's and ViTDet's global attention with decomposed relative positions, as segment-anything
    and detectron2 write it (transformers' SegGPT with `reshape`): per head, on (B * H, h * w, d),
    q's products with a table per axis added over a (B * H, h, w, h, w) view of the scores, viewed
    back, then an fp32 softmax cast back."""

    def __init__(self, heads=2, grid=(3, 4), dim=16, reshape=False):
        super().__init__()
        self.heads, self.grid, self.reshape = heads, grid, reshape
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        d = dim // heads
        self.rel_h = nn.Parameter(0.3 * torch.randn(grid[0], grid[0], d))
        self.rel_w = nn.Parameter(0.3 * torch.randn(grid[1], grid[1], d))

    def forward(self, x):
        b, n, c = x.shape
        (h, w), d = self.grid, c // self.heads
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, -1, n, d).unbind(0)
        attn = (q * d ** -0.5) @ k.transpose(-2, -1)
        r_q = q.reshape(-1, h, w, d)
        rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, self.rel_h)
        rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, self.rel_w)
        if self.reshape:  # SegGPT's
            attn = attn.reshape(-1, h, w, h, w)
            attn = (attn + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]).reshape(-1, n, n)
        else:
            attn = attn.view(-1, h, w, h, w) + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]
            attn = attn.view(-1, n, n)
        attn = torch.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)
        o = (attn @ v).view(b, self.heads, h, w, d).permute(0, 2, 3, 1, 4).reshape(b, n, c)
        return self.proj(o)


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
@pytest.mark.parametrize("reshape", [False, True], ids=["view", "reshape"])
def test_decomposed_relative_positions_over_a_view_of_the_scores_are_fused(capture, reshape):
    """The normalizer makes the two position terms, added over a 5-D view of the scores, a mask
    added to the scores, which the attention chain takes with its gradient (without: the softmax
    stayed unfused in transformers' SegGPT and VitDet)."""
    from _fusing import check_against_unfused

    def make():
        block = _DecomposedRelPosAttention(reshape=reshape)
        return _Stack([block]) if capture == "fx" else block

    report = check_against_unfused(make, (torch.randn(2, 12, 16),), capture, train=True)
    assert report.counts() == available_counts({"attention": 1}), report.table()


class _ShiftedCosineWindowAttention(nn.Module):
    """torchvision's Swin V2 in shifted windows: cosine scores times a learned scale per head
    (the exp of a clamp, (H, 1, 1)), the relative position bias, the window mask once over a
    (B / nW, nW, H, N, N) view. The scale moves onto q (the op's scale is 1)."""

    def __init__(self, heads=2, windows=3, n=5):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(16, 48)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(heads, 1, 1) + 1.0))
        self.bias = nn.Parameter(torch.randn(1, heads, n, n))
        self.register_buffer("mask", torch.where(torch.rand(windows, n, n) < 0.3, -100.0, 0.0))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=math.log(100.0)).exp() + self.bias
        windows = self.mask.shape[0]
        attn = attn.view(b // windows, windows, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = F.dropout(torch.softmax(attn.view(-1, self.heads, n, n), dim=-1), 0.0, self.training)
        return (attn @ v).transpose(1, 2).reshape(b, n, c)


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_a_learned_scale_per_head_with_a_window_mask_is_fused(capture):
    """Its scale a tensor, the two-mask chain's number-scaled form refuses it; the per-head form
    takes it, and the scale's gradient comes through q's product (without: the softmax stayed
    unfused, one attention in two of torchvision's Swin V2). q's and k's F.normalize fuse too."""
    from _fusing import check_against_unfused

    make = ((lambda: _Stack([_ShiftedCosineWindowAttention()])) if capture == "fx"
            else _ShiftedCosineWindowAttention)
    report = check_against_unfused(make, (torch.randn(6, 5, 16),), capture, train=True)
    assert report.counts() == available_counts({"attention": 1, "rms_norm": 2}), report.table()
    if "attention" in report.counts():
        assert report.by_pattern() == {"attention_chain_per_head_add_add": 1, "l2_normalize": 2}, report.table()


def test_new_shapes_and_modes_recapture_a_bounded_number_of_times():
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    trifuse.fuse(model)
    for batch, seq in [(2, 8), (3, 5), (2, 11), (4, 7), (3, 9), (2, 6)]:
        loss_fn(model, inputs(batch, seq)).backward()
    model.eval()
    with torch.no_grad():
        for batch, seq in [(2, 8), (3, 5), (2, 11)]:
            model(inputs(batch, seq)["input_ids"], use_cache=False)
    model.train()
    loss_fn(model, inputs(2, 7)).backward()
    report = trifuse.report(model)
    block = next(u for u in report.units if u.unit.strategy == "dynamo")
    assert len(block.unit.captures) <= 4  # train: static then symbolic shapes; eval: the same
    assert not report.unfused_calls()
    assert report.counts()["residual_stream"] == _models.LAYERS


class _Stage(nn.Module):
    """A hierarchical model's stage (Swin's): one class, a width and a token count of its own."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.down = nn.Linear(2 * width, out)

    def forward(self, x):
        if x.shape[1] % 2:  # Python control flow on a shape (Swin pads odd windows): fx cannot trace it
            x = F.pad(x, (0, 0, 0, 1))
        x = x + F.gelu(self.fc(self.norm(x)))
        return self.down(x.reshape(x.shape[0], x.shape[1] // 2, 2 * x.shape[2]))  # merge token pairs


class _Hierarchical(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(_Stage(w, n) for w, n in zip(widths, widths[1:] + [4]))

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x


def test_blocks_of_one_class_and_other_widths_capture_with_static_shapes(monkeypatch):
    """Stages of one class but their own widths (Swin's) each get a compiled forward of their own,
    so Dynamo's automatic-dynamic state of one does not make the others' captures symbolic (Swin
    V2's spent 10-20 s each in SymPy); past four widths the rest share one, which goes dynamic."""
    from trifuse.fusion import capture

    symbolic = []
    compile_graph = capture.DynamoUnit._compile

    def recording(self, gm):
        symbolic.append(any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes
                            if n.op == "placeholder"))
        return compile_graph(self, gm)

    monkeypatch.setattr(capture.DynamoUnit, "_compile", recording)
    widths = [4, 8, 12, 16, 20, 24, 28]
    torch.manual_seed(0)
    model = _Hierarchical(widths).to(_models.DEVICE)
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    x = torch.randn(2, 128, 4, device=_models.DEVICE)
    for _ in range(2):  # the second call reuses every capture
        loss, loss_ref = model(x).square().sum(), ref(x).square().sum()
        loss.backward(), loss_ref.backward()
        torch.testing.assert_close(loss, loss_ref)
    for p, pr in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, pr.grad)
    # widths 4..16 one forward each, static; 20, 24 and 28 share one: static first, then as
    # Dynamo decides (symbolic token counts for 24). Nothing captured again on the second call.
    assert symbolic[:5] == [False] * 5 and True in symbolic and len(symbolic) <= len(widths), symbolic
    report = trifuse.report(model)
    assert report.counts()["layer_norm"] == len(widths) and not report.unfused_calls()


AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]  # bf16 first: what training on a GPU runs


def _fused_under_autocast(build, dtype: torch.dtype = torch.bfloat16):
    """(fused model, its loss, the unfused loss in the autocast dtype, the float64 loss)."""
    torch.manual_seed(0)
    model, inputs, loss_fn = build()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    trifuse.fuse(model)
    kw = inputs(2, 8)
    with torch.autocast(_models.DEVICE, dtype=dtype):
        fused, lowp = loss_fn(model, kw), loss_fn(ref, kw)
    return model, fused, lowp, loss_fn(ref64, kw)


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=str)
def test_autocast(dtype):
    model, fused, lowp, ref64 = _fused_under_autocast(_models.gpt2, dtype)
    assert fused.dtype == lowp.dtype
    assert_close("autocast loss", fused, ref64, lowp)
    assert f"autocast {_models.DEVICE} {str(dtype)[6:]}" in trifuse.report(model).table()


@pytest.mark.parametrize("build", ["gpt2", "bert"])
def test_fp16_training_with_a_grad_scaler_skips_and_steps_as_the_unfused_model(build):
    """fp16 autocast with torch.amp.GradScaler, as fp16 training runs: at a scale that overflows
    fp16 (2^40) the fused ops' gradients come out non-finite as the unfused model's do, so the
    scaler skips that step in both (the parameters stay where they were); at the scale it falls to
    (2^8) both step, and the losses and parameters then track the unfused model's. (At scales on
    the edge they may differ: the fused ops sum a folded bias's gradient in fp32, which autocast's
    fp16 addmm backward overflows first, so the fused model skips fewer steps.)"""
    from _fusing import cuda_like_autocast

    torch.manual_seed(0)
    model, inputs, loss_fn = getattr(_models, build)()
    ref = copy.deepcopy(model)
    start = copy.deepcopy(model.state_dict())
    trifuse.fuse(model)
    kw = inputs(2, 8)
    runs = []
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler(_models.DEVICE, init_scale=2.0**40, backoff_factor=2.0**-32)
        losses, scales = [], []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with cuda_like_autocast(), torch.autocast(_models.DEVICE, dtype=torch.float16):
                loss = loss_fn(m, kw)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach().float())
            scales.append(scaler.get_scale())
            if len(scales) == 1:
                assert all(torch.equal(v, start[k]) for k, v in m.state_dict().items()), "the overflow was skipped"
        runs.append((losses, scales, m))
    (ref_losses, ref_scales, _), (losses, scales, _) = runs
    assert scales == ref_scales == [2.0**8] * 3, "one skipped step, then two taken"
    for i, (got, want) in enumerate(zip(losses, ref_losses)):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3, msg=f"loss of step {i}")
    assert losses[2] < losses[0], "it trained"
    assert trifuse.report(model).counts()["attention"] > 0


def _frozen_for_fine_tuning(name: str) -> bool:
    """What fine-tuning commonly freezes: the embeddings, the first block, the norms' weights."""
    return any(part in name for part in ("embeddings", "wte", "wpe", ".0.", "LayerNorm.weight", "ln_1.weight",
                                         "ln_2.weight"))


@pytest.mark.parametrize("build", ["gpt2", "bert"])
def test_a_partly_frozen_model_trains_fused_and_runs_under_inference_mode(build):
    """Fine-tuning with the embeddings, the first block and the norms' weights frozen: the fused
    ops take frozen weights and a first block whose input needs no gradient, the trained
    parameters' gradients pass the oracle rule and the frozen ones get none; then evaluation
    under torch.inference_mode (inference tensors, which no op may save) gives the unfused logits."""
    torch.manual_seed(0)
    model, inputs, loss_fn = getattr(_models, build)()
    for name, p in model.named_parameters():
        p.requires_grad_(not _frozen_for_fine_tuning(name))
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    trifuse.fuse(model)
    kw = inputs(2, 8)
    for m in (model, ref, ref64):
        loss_fn(m, kw).backward()
    frozen = 0
    for (name, p), q, q64 in zip(model.named_parameters(), ref.parameters(), ref64.parameters()):
        if not p.requires_grad:
            frozen += 1
            assert p.grad is None, name
            continue
        assert_close(f"grad of {name}", p.grad, q64.grad, q.grad)
    assert frozen >= 6
    counts = trifuse.report(model).counts()
    assert counts["attention"] == 2 and (counts.get("residual_stream", 0) + counts.get("dropout_add", 0)) >= 2, counts
    model.eval()
    ref64.eval()
    kw.pop("labels")
    with torch.inference_mode():
        logits = model(**kw).logits
        ref_logits = ref.eval()(**kw).logits
    assert logits.is_inference()
    assert_close("logits under inference_mode", logits, ref64(**kw).logits.detach(), ref_logits)


def test_blocks_under_accelerates_hooks_fuse_inside_them():
    """A model dispatched by accelerate (device_map over several devices, offload) has a hook
    wrapper as each block's `forward`: the fused forward goes in as the `_old_forward` the wrapper
    calls, after its pre_forward has moved the inputs (and loaded offloaded weights). Training
    matches the unfused model; taking the hook off leaves the fused forward in place."""
    hooks = pytest.importorskip("accelerate.hooks")
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    moved = []

    class Recording(hooks.AlignDevicesHook):
        def pre_forward(self, module, *args, **kwargs):
            moved.append(module)
            return super().pre_forward(module, *args, **kwargs)

    for block in model.transformer.h:
        hooks.add_hook_to_module(block, Recording(execution_device=_models.DEVICE, io_same_device=True))
    trifuse.fuse(model)
    kw = inputs(2, 8)
    for m in (model, ref, ref64):
        loss_fn(m, kw).backward()
    assert moved == list(model.transformer.h), "the hook still runs, once a block"
    for (name, p), q, q64 in zip(model.named_parameters(), ref.parameters(), ref64.parameters()):
        assert_close(f"grad of {name}", p.grad, q64.grad, q.grad)
    report = trifuse.report(model)
    assert report.counts()["attention"] == 2, report.table()
    assert "accelerate's hook kept" in report.table()
    for block in model.transformer.h:
        hooks.remove_hook_from_module(block)
    loss_fn(model, kw)
    assert trifuse.report(model).counts()["attention"] == 2 and len(moved) == 2


def test_a_model_dispatched_with_a_disk_offloaded_block_fuses_for_inference(tmp_path):
    """accelerate.dispatch_model with one block offloaded to disk: that block's weights live on the
    meta device between calls and are loaded by the hooks of its submodules (Dynamo breaks its
    graph around each load); every block still runs its fused ops, and the logits are the
    unfused model's."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model, inputs, _ = _models.gpt2(layers=3)
    model.eval()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    device = _models.DEVICE if _models.DEVICE == "cpu" else 0
    device_map = {name: device for name in ("transformer.wte", "transformer.wpe", "transformer.drop",
                                            "transformer.h.0", "transformer.h.2", "transformer.ln_f", "lm_head")}
    device_map["transformer.h.1"] = "disk"
    model = accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    assert model.transformer.h[1].attn.c_attn.weight.device.type == "meta"
    trifuse.fuse(model)
    kw = inputs(2, 8)
    kw.pop("labels")
    with torch.no_grad():
        logits = model(**kw).logits
        assert_close("logits", logits, ref64(**kw).logits, ref(**kw).logits)
    counts = trifuse.report(model).counts()
    assert counts["attention"] == 3 and counts["layer_norm"] >= 3, counts


def _replica(network: nn.Module, scale: float) -> nn.Module:
    """One replica as torch.nn.parallel.replicate makes it for nn.DataParallel (which needs several
    GPUs): each module's `_replicate_for_data_parallel()`, the children linked, every parameter set
    as a non-leaf tensor attribute (there Broadcast's outputs; here the parameter times `scale`, so
    that a replica running its original's parameters shows)."""
    modules = list(network.modules())
    copies = [m._replicate_for_data_parallel() for m in modules]
    index = {m: i for i, m in enumerate(modules)}
    for i, m in enumerate(modules):
        for key, child in m._modules.items():
            setattr(copies[i], key, None if child is None else copies[index[child]])
        for key, p in m._parameters.items():
            if p is None:
                copies[i]._parameters[key] = None
            else:
                setattr(copies[i], key, p * scale)
    return copies[0]


@pytest.mark.parametrize("build", ["gpt2", "bert"])
def test_nn_data_parallel_replicas_run_fused_on_their_own_parameters(build):
    """nn.DataParallel (Hugging Face's Trainer uses it on several GPUs without a distributed
    launch) replicates the model at every forward by copying each module's __dict__, which holds
    the fused forward bound to the original module (and the head's fence around the model body):
    a replica ran the original's parameters. Each replica now binds them to itself: its loss is the
    unfused replica's, the gradients reach the original parameters through the replica's, and the
    captures are reused from one step's replicas to the next's."""
    torch.manual_seed(0)
    model, inputs, loss_fn = getattr(_models, build)()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    trifuse.fuse(model)
    kw = inputs(2, 8)
    loss_fn(model, kw)  # captured on the original, as DataParallel's first device would
    for step in range(2):
        fused = loss_fn(_replica(model, 1.5), kw)
        lowp, wide = loss_fn(_replica(ref, 1.5), kw), loss_fn(_replica(ref64, 1.5), kw)
        assert_close(f"replica loss, step {step}", fused, wide, lowp)
        for loss in (fused, lowp, wide):
            loss.backward()
    for (name, p), q, q64 in zip(model.named_parameters(), ref.parameters(), ref64.parameters()):
        assert_close(f"grad of {name}", p.grad, q64.grad, q.grad)
    report = trifuse.report(model)
    assert report.counts()["attention"] == 2, report.table()
    assert all(len(u.unit.captures) <= 2 and not u.unit.eager_calls for u in report.units), report.table()


class _FxMLP(nn.Module):
    """An MLP block fx traces whole: Linear + GeLU + Linear, residual, LayerNorm."""

    def __init__(self):
        super().__init__()
        self.fc, self.proj, self.ln = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.ln(x + self.proj(F.gelu(self.fc(x))))


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=str)
def test_autocast_with_an_fx_capture(dtype):
    """A block fx captures on its first call, here under autocast: the capture's fake-tensor
    propagation must leave nothing in autocast's per-region cache of cast weights (it once left
    fake fp16 copies of the Linear weights there, and the real forward returned fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor

    torch.manual_seed(0)
    ref = _FxMLP().to(_models.DEVICE)
    model = trifuse.fuse(copy.deepcopy(ref))
    x = torch.randn(2, 5, 16, device=_models.DEVICE)
    with torch.autocast(_models.DEVICE, dtype=dtype):
        out, lowp = model(x), ref(x)
    assert not isinstance(out, FakeTensor)
    assert_close("autocast output", out, ref.double()(x.double()), lowp)
    out.sum().backward()
    assert "fx" in trifuse.report(model).table() and trifuse.report(model).counts().get("bias_gelu") == 1


def test_autocast_llama_rotary_and_gated_mlp():
    """Hugging Face's rotary tables are fp32 beside 16-bit q and k under autocast: the fused
    rotary keeps the promotion (fp32 q and k, as `q * cos` gives), the gated MLP runs on the 16-bit
    projections, and the loss matches the unfused model's."""
    model, fused, lowp, ref64 = _fused_under_autocast(_models.llama)
    assert fused.dtype == lowp.dtype
    assert_close("autocast loss", fused, ref64, lowp)
    fused.backward()
    counts = trifuse.report(model).counts()
    assert counts["rotary"] == _models.LAYERS and counts["gated_activation"] == _models.LAYERS


def test_autocast_llama_fuses_its_attention():
    """Under autocast q and k are fp32 (rotary with fp32 tables) and v 16-bit: the op casts them
    as SDPA's autocast does, so the attention fuses (found in review: it was left as written)."""
    model, fused, lowp, ref64 = _fused_under_autocast(_models.llama)
    assert trifuse.report(model).counts().get("attention", 0) == _models.LAYERS
    assert_close("autocast loss", fused, ref64, lowp)


def test_data_dependent_control_flow_and_numpy_are_left_working():
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.quirky()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    kw = inputs(2, 8)
    torch.testing.assert_close(loss_fn(model, kw), loss_fn(ref, kw))
    report = trifuse.report(model)
    assert report.counts() == available_counts({"layer_norm": 2, "bias_gelu": 2})
    assert any("fx cannot trace" in n.reason for n in report.notes)


class _TupleDefaultEmbeddings(nn.Module):
    """YOLOS's embeddings, cut down: a forward with a tuple default (`img_size=(800, 1344)`), a
    position table cut to it, a LayerNorm and a biased GeLU after."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(64, width))
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)

    def forward(self, x, img_size=(4, 2)):
        pos = self.pos[: img_size[0] * img_size[1]]
        return F.gelu(self.fc(self.norm(x + pos)))


class _NotTraced(nn.Module):
    """A model fx cannot trace (its forward takes **kwargs, as transformers' do): fuse visits its
    children one by one, each traced as a root with its own defaults."""

    def __init__(self):
        super().__init__()
        self.embeddings = _TupleDefaultEmbeddings()
        self.out = nn.Linear(64, 16)

    def forward(self, x, **kwargs):
        return self.out(self.embeddings(x))


def test_a_module_with_a_tuple_default_is_fused_whole():
    """fx traces such a forward with one placeholder per element of the tuple, each defaulting to
    the whole tuple, and its code generation wrote that as invalid Python: fuse raised a
    SyntaxError on YOLOS (bench/results/fuse_sweep_base.md), then left the module as written and
    fused its children alone. The placeholders now lose their defaults (a unit passes every
    argument), so the module is traced whole: its biased GeLU is fused too."""
    torch.manual_seed(0)
    model = _NotTraced()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    x = torch.randn(2, 8, 16, requires_grad=True)
    torch.testing.assert_close(model(x), ref(x))
    torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    report = trifuse.report(model)
    assert not any("SyntaxError" in n.reason for n in report.notes), report
    assert report.counts() == available_counts({"layer_norm": 1, "bias_gelu": 1}), report.table()


class _ListBesideFlags(nn.Module):
    """Mask2Former's transformer module, cut down: a list of feature maps beside flags with
    defaults (`output_hidden_states: bool = False`), called with the list and one flag."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, 4 * width)

    def forward(self, features: list, x, output_hidden_states: bool = False, output_attentions: bool = False):
        h = features[0] + features[1] + x
        return F.gelu(self.fc(self.norm(h)))


class _CallsWithAList(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _ListBesideFlags()

    def forward(self, x, **kwargs):
        return self.block([x * 2, x + 1], x, output_hidden_states=True)


def test_a_list_argument_beside_defaulted_flags_is_traced_by_fx():
    """fx's code for a call with a container among its arguments unpacks the leaves into names
    with the flags' defaults (`flag_1 = False,` in a tuple target): invalid Python, so the call
    went to Dynamo, and a module holding other units (Mask2Former's transformer module) ran as
    written. The placeholders without their defaults compile: fx captures the call."""
    torch.manual_seed(0)
    _fused_by_fx_as_unfused(_CallsWithAList())


def _fused_by_fx_as_unfused(model: nn.Module) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """Fuses `model` (a `_ListBesideFlags` block inside), checks the output and every gradient
    against an unfused copy, and that fx captured the block (its norm and GeLU fused, no call sent
    to Dynamo); returns the fused model, the copy and the input."""
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    x = torch.randn(2, 8, 16, requires_grad=True)
    out = model(x)
    torch.testing.assert_close(out, ref(x))
    grads = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    for g, g_ref in zip(grads, torch.autograd.grad(ref(x).sum(), [x, *ref.parameters()])):
        torch.testing.assert_close(g, g_ref)
    report = trifuse.report(model)
    assert "captured by Dynamo instead" not in report.table(), report.table()
    assert report.counts() == available_counts({"residual_stream": 1, "bias_gelu": 1}), report.table()
    return model, ref, x


_ListOutput = collections.namedtuple("_ListOutput", ["last", "hidden"])


class _ListToStructure(_ListBesideFlags):
    """Mask2Former's transformer module again, with its output: a Hugging Face ModelOutput (a dict
    subclass with fields) or a named tuple, its hidden states a tuple inside it."""

    def __init__(self, structure: str):
        super().__init__()
        self.structure = structure

    def forward(self, features: list, x, output_hidden_states: bool = False, output_attentions: bool = False):
        h = features[0] + features[1] + x
        y = F.gelu(self.fc(self.norm(h)))
        hidden = (h, y) if output_hidden_states else None
        if self.structure == "model_output":
            from transformers.modeling_outputs import BaseModelOutput

            return BaseModelOutput(last_hidden_state=y, hidden_states=hidden)
        return _ListOutput(y, hidden)


class _ReadsTheStructure(nn.Module):
    def __init__(self, structure: str):
        super().__init__()
        self.block = _ListToStructure(structure)

    def forward(self, x, **kwargs):
        out = self.block([x * 2, x + 1], x, output_hidden_states=True)
        return out[0] * out[1][0].mean() + out[1][1]


@pytest.mark.parametrize("structure", ["model_output", "named_tuple"])
def test_a_list_argument_and_outputs_in_a_class_of_their_own_are_traced_by_fx(structure):
    """fx returns the outputs of a call with a container among its arguments flattened, with
    their structure beside: a ModelOutput or a named tuple there was taken as a signature fx
    could not give back, and the call went to Dynamo (a module holding other units ran as
    written: Mask2Former's transformer module). The graph now builds the class from its leaves."""
    if structure == "model_output":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, ref, x = _fused_by_fx_as_unfused(_ReadsTheStructure(structure))
    inner = model.block([x, x], x, output_hidden_states=True)
    assert type(inner) is type(ref.block([x, x], x, output_hidden_states=True))


def _attend_per_image(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


class _PerImageAttentionBlock(nn.Module):
    """Qwen-VL's and MiniCPM-V's packed vision attention, cut down: the images' tokens in one row,
    split by their lengths, each attended alone by one function, a graph break in the loop (as
    their `lengths.tolist()` makes): the loop runs as written, the function is a frame Dynamo
    compiles, its graph run once per image."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x, lengths):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(1, 2, 0, 3).unbind(0)
        outs = []
        for parts in zip(*(t.split(lengths.tolist(), dim=1) for t in (q, k, v))):
            torch._dynamo.graph_break()
            outs.append(_attend_per_image(*parts))
        return x + self.proj(torch.cat(outs, dim=1).transpose(0, 1).flatten(1))


class _PackedImages(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_PerImageAttentionBlock() for _ in range(2))

    def forward(self, x, lengths):
        for layer in self.layers:
            x = layer(x, lengths)
        return x


@pytest.mark.parametrize("lengths", [[6, 6], [6, 6, 6]], ids=["two_images", "three_images"])
def test_a_graph_run_once_per_image_counts_each_run(lengths):
    """A frame after a graph break that runs once per image reuses its graph for images of one
    shape: the report counted that graph once per block call, so the count of fused attentions
    depended on the images' sizes (and, where Dynamo had made the frame dynamic for another
    model, on what the process ran before). It counts every run, as the ops run."""
    torch.manual_seed(0)
    model = _PackedImages()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    x, sizes = torch.randn(sum(lengths), 16, requires_grad=True), torch.tensor(lengths)
    torch.testing.assert_close(model(x, sizes), ref(x, sizes))
    ops = collections.Counter()

    def step():
        model(x, sizes).sum().backward()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    ops.update(name for name in op_names(prof) if name == "trifuse::attention")
    report = trifuse.report(model)
    assert report.counts().get("attention", 0) == ops["trifuse::attention"], report.table()
    assert report.counts() == available_counts({"attention": 2 * len(lengths)}), report.table()


class _Logits(nn.Module):
    """A causal LM's logits from its ids alone: what jit.trace and torch.export take."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(input_ids=ids, use_cache=False).logits


def test_torch_jit_trace_of_a_fused_model_records_the_model_as_written():
    """torch.jit.trace (and the ONNX exporter's tracing mode) over a fused model: Dynamo refuses
    to run under the tracer (a RuntimeError from every fused block), so the blocks run as the
    model wrote them there and the traced module needs no trifuse; the report counts why."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    model.eval()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    kw, other = inputs(2, 8), inputs(2, 8)

    traced = torch.jit.trace(_Logits(model), kw["input_ids"], check_trace=False)
    assert not any(n.kind().startswith("trifuse::") for n in traced.inlined_graph.nodes())
    torch.testing.assert_close(traced(other["input_ids"]), _Logits(ref)(other["input_ids"]))
    reasons = collections.Counter()
    for calls in trifuse.report(model).unfused_calls().values():
        reasons.update(calls)
    assert any("torch.jit.trace" in r for r in reasons), reasons
    torch.testing.assert_close(loss_fn(model, kw), loss_fn(ref, kw))  # fused again outside
    assert trifuse.report(model).counts().get("attention") == _models.LAYERS


@contextlib.contextmanager
def _warnings_recorded():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield record


def _outside_trace_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "is tracing a model fused by trifuse.fuse" in str(w.message)]


@pytest.mark.parametrize("order", ["fuse, then compile", "compile, then fuse"])
def test_torch_compile_of_a_fused_model_says_its_blocks_run_as_written(order, monkeypatch):
    """torch.compile of a fused model (or fuse of a compiled one) traces the blocks' code as the
    model wrote it: with a backend other than trifuse's the compiled model runs no trifuse op.
    Said once a process, at trace time (never in the compiled code), and by the report per unit,
    so that an empty 'latest forward' is not read as 'nothing matched'. Run as it is afterwards,
    the fused model still fuses."""
    from trifuse.fusion import capture

    monkeypatch.setattr(capture, "_warned_outside_trace", False)
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    ref = copy.deepcopy(model)
    kw = inputs(2, 8)
    if order == "fuse, then compile":
        compiled = torch.compile(trifuse.fuse(model), backend="eager")
    else:
        compiled = trifuse.fuse(torch.compile(model, backend="eager"))
    with _warnings_recorded() as record:
        loss = loss_fn(compiled, kw)
    assert len(_outside_trace_warnings(record)) == 1, [str(w.message) for w in record]
    torch.testing.assert_close(loss, loss_fn(ref, kw))
    report = trifuse.report(model)
    traces = [u.unit.outside_traces for u in report.units]
    assert all(traces), traces
    loss_fn(compiled, inputs(2, 8))  # the compiled code: no trace
    assert [u.unit.outside_traces for u in report.units] == traces
    assert report.counts() == {}, report.table()
    text = report.table()
    assert text.count("traced by a torch.compile or torch.export of the model") == len(report.units), text
    assert "the model ran as compiled by torch.compile" in text, text
    with _warnings_recorded() as record:
        torch.testing.assert_close(loss_fn(model, kw), loss_fn(ref, kw))  # the fused model, called itself
    assert not _outside_trace_warnings(record)
    assert trifuse.report(model).counts().get("attention") == _models.LAYERS


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_fuse_own_captures_are_not_traces_from_outside(name, monkeypatch):
    """The control: fuse's own Dynamo captures trace fused modules' forwards too (BERT's head
    capture traces its MLM head, fused by fx), and neither count nor warn."""
    from trifuse.fusion import capture

    monkeypatch.setattr(capture, "_warned_outside_trace", False)
    torch.manual_seed(0)
    model, inputs, loss_fn = getattr(_models, name)()
    trifuse.fuse(model)
    with _warnings_recorded() as record:
        loss_fn(model, inputs(2, 8)).backward()
    assert not _outside_trace_warnings(record)
    report = trifuse.report(model)
    assert report.counts().get("attention") == _models.LAYERS
    assert all(u.unit.outside_traces == 0 for u in report.units)
    assert "traced by a torch.compile" not in report.table()


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_of_a_fused_model_records_the_model_as_written(strict, monkeypatch):
    """torch.export (Dynamo when strict, else its own tracer) of a fused model: the exported
    program holds the model's own ops and needs no trifuse; the units say they were traced."""
    from trifuse.fusion import capture

    monkeypatch.setattr(capture, "_warned_outside_trace", False)
    torch.manual_seed(0)
    model, inputs, _ = _models.gpt2()
    model.eval()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)

    ids, other = inputs(2, 8)["input_ids"], inputs(2, 8)["input_ids"]
    with _warnings_recorded() as record:
        program = torch.export.export(_Logits(model), (ids,), strict=strict)
    assert len(_outside_trace_warnings(record)) == 1
    assert not any("trifuse" in str(n.target) for n in program.graph.nodes)
    torch.testing.assert_close(program.module()(other), _Logits(ref)(other))
    assert all(u.unit.outside_traces for u in trifuse.report(model).units)


def test_backend_trifuse_over_a_fused_model_rewrites_the_code_it_traces(monkeypatch):
    """backend="trifuse" over a fused model: the compile sees the code as written and rewrites it
    itself, so trifuse's ops run (the compiled graphs' report), beside the note on the units."""
    from trifuse.fusion import capture

    monkeypatch.setattr(capture, "_warned_outside_trace", False)
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = torch.compile(trifuse.fuse(model), backend="trifuse")
    kw = inputs(2, 8)
    names = trifuse_ops_run(lambda: loss_fn(compiled, kw))
    assert_close("loss", loss_fn(compiled, kw), loss_fn(ref64, kw), loss_fn(ref, kw))
    report = trifuse.report(compiled)
    if has_op("attention"):
        assert report.counts().get("attention") == _models.LAYERS, report.table()
        assert "trifuse::attention" in names, sorted(names)
    assert "traced by a torch.compile or torch.export of the model" in report.table()


def test_torch_func_transforms_and_forward_ad_run_the_blocks_as_written():
    """torch.func's grad and jvp, vmap for per-sample gradients, and forward-mode AD through a
    fused model: trifuse's ops implement none of them, so each fused block and the fused loss run
    as the model wrote them there (the report counts why), and fused again outside."""
    from torch.autograd import forward_ad
    from torch.func import functional_call, grad, jvp, vmap

    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2(attn_implementation="eager")  # SDPA on CPU has no forward AD
    model.eval()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    kw = inputs(2, 8)
    torch.testing.assert_close(loss_fn(model, kw), loss_fn(ref, kw))
    fused = trifuse.report(model).counts()
    assert fused.get("attention") == 2
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, m, kw=kw):
        return functional_call(m, p, (), kw).loss

    for got, want in zip(grad(loss)(params, model).values(), grad(loss)(params, ref).values()):
        torch.testing.assert_close(got, want)
    tangents = {k: torch.randn_like(v) for k, v in params.items()}
    torch.testing.assert_close(jvp(lambda p: loss(p, model), (params,), (tangents,)),
                               jvp(lambda p: loss(p, ref), (params,), (tangents,)))

    def one_row_loss(p, ids, m):  # per-sample gradients: vmap over the batch
        return functional_call(m, p, (), {"input_ids": ids[None], "labels": ids[None], "use_cache": False}).loss

    per_row = [vmap(grad(one_row_loss), in_dims=(None, 0, None))(params, kw["input_ids"], m) for m in (model, ref)]
    torch.testing.assert_close(per_row[0]["transformer.h.0.attn.c_attn.weight"],
                               per_row[1]["transformer.h.0.attn.c_attn.weight"])
    with forward_ad.dual_level():
        embeds = model.transformer.wte(kw["input_ids"]).detach()
        tangent = torch.randn_like(embeds)
        outs = [m(inputs_embeds=forward_ad.make_dual(embeds, tangent), use_cache=False).logits for m in (model, ref)]
        torch.testing.assert_close(forward_ad.unpack_dual(outs[0]).tangent, forward_ad.unpack_dual(outs[1]).tangent)
    reasons = collections.Counter()
    for calls in trifuse.report(model).unfused_calls().values():
        reasons.update(calls)
    assert any("torch.func transform" in r for r in reasons), reasons
    assert any("forward-mode AD" in r for r in reasons), reasons
    torch.testing.assert_close(loss_fn(model, kw), loss_fn(ref, kw))
    assert trifuse.report(model).counts() == fused  # outside the transforms the model runs fused again


@pytest.mark.parametrize("under", ["plain", "function-mode"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-dropout"])
def test_a_gradient_penalty_through_a_fused_model_matches_the_unfused_one(train, under):
    """A second backward (an input-gradient penalty, create_graph=True) through the fused ops:
    their backward runs in PyTorch ops there (kernels/_common.reference_grads), so the penalty's
    gradients are the unfused model's. It used to raise, naming the op; before that, the kernels'
    gradients entered the second backward as constants and the penalty's gradient was silently
    off (GPT-2 with only its GeLUs fused: 1.99 against 2.16 for a weight's gradient norm). In
    training with dropout the fused model draws its own masks: its penalty is finite and its
    weights all get gradients.

    "function-mode": the step under a user's torch function mode, under which the ops take their
    registered `trifuse::` ops (as under a DTensor or torch.export) and those ops' autograd
    formulas; those raised PyTorch's "no autograd formula registered for trifuse.*_backward" at
    the second backward."""
    torch.manual_seed(0)
    model, inputs, _ = _models.gpt2(dropout=0.1 if train else 0.0, attn_implementation="eager")
    model.train(train)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    trifuse.fuse(model)
    kw = inputs(2, 8)

    def step(m):
        with PassThroughMode() if under == "function-mode" else contextlib.nullcontext():
            embeds = m.transformer.wte(kw["input_ids"]).detach().requires_grad_()
            loss = m(inputs_embeds=embeds, labels=kw["labels"], use_cache=False).loss
            (grad,) = torch.autograd.grad(loss, embeds, create_graph=True)
            (loss + grad.pow(2).sum()).backward()

    step(model)
    counts = trifuse.report(model).counts()
    assert {"attention", "bias_gelu", "residual_stream"} <= set(counts), counts
    if train:
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        return
    step(ref)
    step(ref64)
    for (name, p), p64, pr in zip(model.named_parameters(), ref64.parameters(), ref.parameters()):
        if p64.grad is not None:
            assert_close(f"grad {name}", p.grad, p64.grad, pr.grad)


def test_a_fused_model_under_a_default_device_takes_the_eager_path_with_the_same_bits():
    """Under `with torch.device(...)` (set_default_device's mode) the captured blocks' ops keep
    their thin eager path: no registered `trifuse::` op in the autograd graph, and the loss and
    every gradient the same bits as without the mode."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    trifuse.fuse(model)
    kw = inputs(2, 8)

    def step():
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, kw)
        nodes, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is not None and node not in nodes:
                nodes.add(node)
                stack.extend(n for n, _ in node.next_functions)
        loss.backward()
        return loss, [p.grad for p in model.parameters()], {type(n).__name__ for n in nodes}

    plain = step()
    with torch.device(_models.DEVICE):
        under = step()
    assert "_AttentionFunctionBackward" in under[2] or not trifuse.report(model).counts().get("attention")
    assert not any(n.startswith("GeneratedBackwardFor_trifuse") for n in under[2]), sorted(under[2])
    assert under[2] == plain[2]
    torch.testing.assert_close(under[0], plain[0], rtol=0, atol=0)
    for a, b in zip(plain[1], under[1]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def _gpt2_with_hooks():
    model, inputs, loss_fn = _models.gpt2()
    kw = inputs(2, 8)
    return model, lambda m: loss_fn(m, kw), lambda m: (m.transformer.h[0], m.transformer.h[1])


def _nanogpt_block_with_hooks():
    block = _models.Block(_models.HIDDEN, _models.HEADS, 0.0, 64, True)
    x = torch.randn(2, 8, _models.HIDDEN)
    return block, lambda m: m(x).square().mean(), lambda m: (m, m)


@pytest.mark.parametrize("make", [_gpt2_with_hooks, _nanogpt_block_with_hooks],
                         ids=["gpt2-blocks-by-dynamo", "nanogpt-block-by-fx"])
def test_hooks_registered_after_a_capture_run(make):
    """Hooks a user registers on a block's submodules after the blocks were captured (a forward
    hook steering an MLP's output, a pre-hook, a full backward hook reading gradients) run as in
    the unfused model, not left out of a graph captured without them; removed, they stop."""
    torch.manual_seed(0)
    model, loss_fn, blocks = make()
    model.eval()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    torch.testing.assert_close(loss_fn(model), loss_fn(ref))
    strategies = {u.unit.strategy for u in trifuse.report(model).units if u.unit.calls}
    # what captured the blocks
    assert ("dynamo" if make is _gpt2_with_hooks else "fx") in strategies, strategies
    seen = {id(model): [], id(ref): []}
    handles = []
    for m in (model, ref):
        first, second = blocks(m)
        handles += [first.mlp.register_forward_hook(lambda mod, args, out: out * 0.5),
                    second.ln_2.register_forward_pre_hook(lambda mod, args: (args[0] + 1.0,)),
                    first.attn.register_full_backward_hook(
                        lambda mod, gin, gout, key=id(m): seen[key].append(gout[0].detach().clone()))]
    loss = loss_fn(model)
    loss.backward()
    want = loss_fn(ref)
    want.backward()
    torch.testing.assert_close(loss, want)
    assert len(seen[id(model)]) == len(seen[id(ref)]) == 1
    torch.testing.assert_close(seen[id(model)][0], seen[id(ref)][0])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for h in handles:
        h.remove()
    torch.testing.assert_close(loss_fn(model), loss_fn(ref))
    assert loss_fn(model) != loss  # the hooks no longer run


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_module_attributes_changed_after_a_capture_take_effect(capture):
    """A Dropout's p set after the capture (disabling dropout for a fine-tuning phase, a schedule)
    and a LayerNorm's eps: the fused block computes with the new values, as the unfused one. fx
    graphs hold them as constants: a change brings a new capture, up to 8, then the block runs as
    written (the report says why); Dynamo guards on them itself."""
    from _fusing import fuse_via

    torch.manual_seed(0)
    block = _models.Block(_models.HIDDEN, _models.HEADS, 0.0, 64, True).train()  # no attention dropout
    ref = copy.deepcopy(block)
    fused = fuse_via(block, capture)
    x = torch.randn(2, 8, _models.HIDDEN)
    fused(x)
    for m in (block, ref):
        for d in (m.attn.resid_dropout, m.mlp.dropout):
            d.p = 1.0  # every sublayer's output dropped: the block returns x
        m.ln_2.eps = 0.5
    torch.testing.assert_close(fused(x), x)
    for m in (block, ref):
        for d in (m.attn.resid_dropout, m.mlp.dropout):
            d.p = 0.0
    torch.testing.assert_close(fused(x), ref(x))
    before = copy.deepcopy(ref)
    before.ln_2.eps = 1e-5
    assert (ref(x) - before(x)).abs().max() > 1e-2  # ln_2's eps 0.5 changes the block visibly
    for step in range(12):  # a schedule: p changes every call
        for m in (block, ref):
            m.mlp.dropout.p = 0.0 if step % 2 else 1e-9
        torch.testing.assert_close(fused(x), ref(x))
    reasons = collections.Counter()
    for calls in trifuse.report(fused).unfused_calls().values():
        reasons.update(calls)
    if capture == "fx":
        assert any("keep changing" in r for r in reasons), reasons


class ScaledNorm(nn.Module):
    """A float setting the forward reads (nanoGPT's `dropout_p=self.dropout`, a residual scale):
    fx traces it as a constant."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(_models.HIDDEN)
        self.alpha = 1.0

    def forward(self, x):
        return self.ln(x) * self.alpha


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_a_float_setting_changed_after_a_capture_takes_effect(capture):
    from _fusing import fuse_via

    model = ScaledNorm()
    fused = fuse_via(model, capture)
    x = torch.randn(2, 8, _models.HIDDEN)
    first = fused(x)
    model.alpha = 2.0
    torch.testing.assert_close(fused(x), 2 * first)
    assert trifuse.report(fused).counts() == {"layer_norm": 1}


class Switches(nn.Module):
    """A str and a bool setting the forward reads: fx traces the GeLU's form as a constant and
    only the branch its flag took."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(_models.HIDDEN, _models.HIDDEN)
        self.approximate = "none"
        self.post_norm = False

    def forward(self, x):
        y = F.gelu(self.fc(x), approximate=self.approximate)
        return F.layer_norm(y, y.shape[-1:]) if self.post_norm else y


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_str_and_bool_settings_changed_after_a_capture_take_effect(capture):
    from _fusing import fuse_via

    torch.manual_seed(0)
    model = Switches()
    ref = copy.deepcopy(model)
    fused = fuse_via(model, capture)
    x = torch.randn(2, 8, _models.HIDDEN)
    torch.testing.assert_close(fused(x), ref(x))
    for m in (model, ref):
        m.approximate, m.post_norm = "tanh", True
    out = fused(x)
    torch.testing.assert_close(out, ref(x))
    assert out.std(-1).sub(1).abs().max() < 0.1  # normalized: the new branch ran
    assert trifuse.report(fused).counts() == {"bias_gelu": 1, "layer_norm": 1}


def test_deepcopy_of_a_fused_model_runs_its_own_weights():
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.nanogpt()
    trifuse.fuse(model)
    kw = inputs(2, 8)
    loss_fn(model, kw)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    assert not torch.allclose(loss_fn(twin, kw), loss_fn(model, kw))
    assert trifuse.report(twin).counts() == trifuse.report(model).counts()


def test_a_fused_model_saved_whole_loads_unfused_and_fuses_again():
    """torch.save(model) pickles each installed forward as getattr(module, "forward"): the loaded
    model holds its classes' own forwards, runs as the unfused model does, and fuse takes it
    again (it took those attributes for forwards of the user's own and fused nothing)."""
    import io

    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    trifuse.fuse(model)
    kw = inputs(2, 8)
    loss_fn(model, kw).backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert not trifuse.report(loaded).counts()
    torch.testing.assert_close(loss_fn(loaded, kw), loss_fn(model, kw))
    trifuse.fuse(loaded)
    loss_fn(loaded, kw).backward()
    assert trifuse.report(loaded).counts() == trifuse.report(model).counts()
    assert "own forward attribute" not in trifuse.report(loaded).table()
    hooks = [h for m in loaded.modules() for h in m._forward_pre_hooks.values()
             if isinstance(h, functools.partial) and h.func.__name__ == "_no_cache_in_training"]
    assert len(hooks) == 1, "the use_cache hook that came with the pickle is not added twice"


def test_an_encoder_called_first_on_its_nested_eval_path_still_fuses_in_training():
    """nn.TransformerEncoder (enable_nested_tensor=True, its default) in eval without grad, with a
    key padding mask, turns its input into a nested tensor for its layers' fast path. Dynamo
    traced a layer called with it, found nothing, and skipped the frame for good: every later
    call, the training ones too, ran unfused (a validation pass before training). A nested
    tensor argument now runs the layer as written, named in the report."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(_models.HIDDEN, 4, 2 * _models.HIDDEN, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, _models.LAYERS).eval()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    x = torch.randn(3, 7, _models.HIDDEN)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 5:], pad[2, 3:] = True, True
    with torch.no_grad():
        torch.testing.assert_close(model(x, src_key_padding_mask=pad), ref(x, src_key_padding_mask=pad))
    reasons = [r for calls in trifuse.report(model).unfused_calls().values() for r in calls]
    assert any("nested tensor" in r for r in reasons), reasons
    model.train(), ref.train()
    torch.testing.assert_close(model(x, src_key_padding_mask=pad), ref(x, src_key_padding_mask=pad))
    assert trifuse.report(model).counts().get("attention") == _models.LAYERS


def test_model_to_another_dtype_after_fuse():
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.nanogpt()
    ref = copy.deepcopy(model).double()
    trifuse.fuse(model)
    model.double()  # parameters change dtype in place: the fused code reads them live
    kw = inputs(2, 8)
    torch.testing.assert_close(loss_fn(model, kw), loss_fn(ref, kw))
    assert trifuse.report(model).counts()["residual_stream"] >= _models.LAYERS


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        trifuse.fuse(lambda x: x)
    model, *_ = _models.nanogpt()
    trifuse.fuse(model)
    with pytest.raises(ValueError, match="already fused"):
        trifuse.fuse(model)
    assert "not fused" in trifuse.report(nn.Linear(2, 2)).table()


@needs_ops("bias_gelu")
def test_missing_op_is_reported_as_skipped(monkeypatch):
    monkeypatch.delattr(trifuse.ops, "bias_gelu")
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    trifuse.fuse(model)
    loss_fn(model, inputs(2, 8)).backward()
    report = trifuse.report(model)
    assert "bias_gelu" not in report.counts() and report.counts()["layer_norm"] == _models.LAYERS + 1
    assert "op not available: trifuse.ops.bias_gelu" in report.table()


def test_verbose_prints_the_table(capsys):
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.vit()
    trifuse.fuse(model, verbose=True)
    loss_fn(model, inputs(2, 8))
    out = capsys.readouterr().out
    assert "trifuse.fuse (all families)" in out and "replaced" in out and "residual_stream" in out


def test_report_shows_the_implementation_each_op_uses():
    from trifuse.autotune.decisions import clear_records
    from trifuse.kernels import layer_norm as ln

    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2()
    trifuse.fuse(model)
    clear_records()
    ln.LAYER_NORM.clear()
    loss_fn(model, inputs(2, 8)).backward()
    report = trifuse.report(model)
    chosen = [d for d in report.decisions() if d.kind == "dialect" and d.name == "layer_norm"]
    assert chosen and chosen[0].chosen in {c.name for c in ln.LAYER_NORM.candidates}
    assert "implementations chosen in this process" in report.table()
    assert "layer_norm" in report.table().split("implementations chosen")[1]


REFERENCE_PATH = """
import copy, sys, torch
sys.path.insert(0, {tests!r})
import _models, trifuse
from trifuse.kernels._common import use_triton
assert not use_triton(torch.zeros(1))
torch.manual_seed(0)
model, inputs, loss_fn = _models.gpt2()
ref = copy.deepcopy(model)
trifuse.fuse(model)
kw = inputs(2, 8)
a, b = loss_fn(model, kw), loss_fn(ref, kw)
a.backward(); b.backward()
torch.testing.assert_close(a, b)
for p, q in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
assert trifuse.report(model).counts()["residual_stream"] == _models.LAYERS
print("ok")
"""


def test_reference_path_without_the_interpreter():
    """CPU tensors without TRITON_INTERPRET take trifuse's PyTorch path: fused models still run."""
    tests = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors, also on a GPU machine
    out = subprocess.run([sys.executable, "-c", REFERENCE_PATH.format(tests=tests)], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


class _GridBlock(nn.Module):
    """BEiT's layers take the patch grid as a torch.Size (a tuple subclass)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(_models.HIDDEN)

    def forward(self, x, grid):
        return self.ln(x).view(x.shape[0], *grid, -1).flatten(1, 2)


def test_a_torch_size_argument_is_captured():
    from _fusing import fuse_via

    torch.manual_seed(0)
    ref = _GridBlock()
    model = fuse_via(copy.deepcopy(ref), "dynamo")
    x = torch.randn(2, 6, _models.HIDDEN)
    torch.testing.assert_close(model(x, torch.Size([2, 3])), ref(x, torch.Size([2, 3])))
    report = trifuse.report(model)
    assert report.counts() == available_counts({"layer_norm": 1}) and not report.unfused_calls()


class _TupleGridBlock(nn.Module):
    """timm's CoaT: a serial block takes its token grid as a tuple of ints, a parallel block a
    list of token tensors and a list of grids, and returns a tuple; fx traces both."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(_models.HIDDEN, _models.HIDDEN), nn.LayerNorm(_models.HIDDEN)

    def forward(self, x, size):
        h, w = size
        y = F.gelu(self.fc(x)).view(x.shape[0], h, w, -1)
        return self.ln(x + y.flatten(1, 2))


class _ListBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(_models.HIDDEN)

    def forward(self, xs, sizes, scale=None):
        outs = [self.ln(x + x.view(x.shape[0], *hw, -1).flatten(1, 2)) for x, hw in zip(xs, sizes)]
        return outs[0] * scale[0], outs[1] * scale[1]


class _Grids(nn.Module):
    def __init__(self):
        super().__init__()
        self.serial = nn.ModuleList([_TupleGridBlock() for _ in range(2)])
        self.parallel = nn.ModuleList([_ListBlock() for _ in range(2)])

    def forward(self, x, grid):
        for block in self.serial:
            x = block(x, grid)
        xs = [x, x.flip(1)]
        for block in self.parallel:
            xs = block(xs, [grid, grid[::-1]], scale={0: 2.0, 1: 0.5})
        return xs[0] + xs[1]


def test_tuple_list_and_dict_arguments_are_captured_by_fx():
    """Container arguments once left fx units unfused for good ("argument 1 is a tuple"): a
    plain value in one is a constant of the capture, keyed by value (another grid captures
    anew, no stale constant), a tensor in one is an input of the graph."""
    torch.manual_seed(0)
    ref = _Grids().double()  # float64: the comparison is tight, not fp32 rounding's
    model = trifuse.fuse(copy.deepcopy(ref))
    for grid in ((2, 3), (3, 2), (2, 3)):
        x = torch.randn(2, 6, _models.HIDDEN, dtype=torch.float64, requires_grad=True)
        out, expected = model(x, grid), ref(x, grid)
        torch.testing.assert_close(out, expected)
        grads = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
        ref_grads = torch.autograd.grad(expected.square().sum(), [x, *ref.parameters()])
        torch.testing.assert_close(grads, ref_grads)
        report = trifuse.report(model)
        assert "fx" in report.table() and not report.unfused_calls(), report.table()
        assert report.counts() == available_counts({"bias_gelu": 2, "residual_stream": 6}), report.counts()
    serial = next(u.unit for u in report.units if u.unit.cls is _TupleGridBlock)
    assert len(serial.shared) == 2  # one capture per grid, shared by both layers


def _scores_plus_mask(scores, mask=None):
    """timm's `maybe_add_mask`: fx.wrap'd by its library, so fx would keep it one opaque call
    between an explicit attention's scores and its softmax."""
    return scores if mask is None else scores + mask


def _padded_window_attention(q, k, v):
    """torchvision's shifted_window_attention in small: fx.wrap'd, and fx cannot trace its code
    (it branches on a size), so an fx graph keeps the whole attention one call."""
    pad = (4 - q.shape[-2] % 4) % 4
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    out = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v
    return out[..., : out.shape[-2] - pad, :]


torch.fx.wrap("_scores_plus_mask")
torch.fx.wrap("_padded_window_attention")


class _WrappedAttentionBlock(nn.Module):
    def __init__(self, windowed: bool):
        super().__init__()
        self.windowed = windowed
        self.qkv = nn.Linear(_models.HIDDEN, 3 * _models.HIDDEN)
        self.proj = nn.Linear(_models.HIDDEN, _models.HIDDEN)

    def forward(self, x, mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4).unbind(0)
        if self.windowed:
            o = _padded_window_attention(q, k, v)
        else:
            o = torch.softmax(_scores_plus_mask(q @ k.transpose(-2, -1) * (d // 2) ** -0.5, mask), dim=-1) @ v
        return x + self.proj(o.transpose(1, 2).reshape(b, n, d))


class _Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("windowed", [False, True], ids=["traced-into", "opaque-to-fx"])
def test_attention_inside_functions_other_libraries_fx_wrap_is_fused(windowed):
    """fx.wrap'd functions of other libraries: traced into where fx can (the attention chain
    around timm's maybe_add_mask fuses in an fx capture); where it cannot, the block goes to
    Dynamo, which traces through (torchvision's Swin attention). Both once stayed unfused."""
    torch.manual_seed(0)
    ref = _Stack(_WrappedAttentionBlock(windowed) for _ in range(2)).double()
    model = trifuse.fuse(copy.deepcopy(ref))
    x = torch.randn(2, 7, _models.HIDDEN, dtype=torch.float64, requires_grad=True)
    out, expected = model(x), ref(x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x), torch.autograd.grad(expected.sum(), x))
    report = trifuse.report(model)
    assert report.counts() == available_counts({"attention": 2}), report.table()
    strategy = "dynamo" if windowed else "fx"
    assert f"(_WrappedAttentionBlock, {strategy})" in report.table()
    assert torch.fx._symbolic_trace._wrapped_fns_to_patch  # the registry is whole again after the traces


class _BlockReturningModelOutput(nn.Module):
    """A block that fx traces and that returns a Hugging Face ModelOutput, which its caller
    indexes by position (SqueezeBERT's encoder: `encoder_outputs[0]`)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(_models.HIDDEN)

    def forward(self, x):
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=self.ln(x))


def test_a_model_output_returned_by_an_fx_capture_keeps_its_type():
    # fx's graphs turn any dict into a plain dict; the caller's `out[0]` then raised KeyError
    torch.manual_seed(0)
    ref = _BlockReturningModelOutput()
    model = trifuse.fuse(copy.deepcopy(ref))
    x = torch.randn(2, 3, _models.HIDDEN)
    out = model(x)
    assert type(out) is type(ref(x))
    torch.testing.assert_close(out[0], ref(x)[0])
    torch.testing.assert_close(out.last_hidden_state, ref(x).last_hidden_state)
    assert trifuse.report(model).counts() == available_counts({"layer_norm": 1})


class _ScaledNorm(torch.autograd.Function):
    """A user's autograd.Function whose forward holds a LayerNorm and whose backward is its own
    (deliberately not LayerNorm's): Dynamo captures it as one higher-order op with forward and
    backward bodies, which fuse must leave as they are."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, None, 1e-5)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * 2.0, (grad * 3.0).sum(dim=tuple(range(grad.dim() - 1)))


class _BlockWithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(_models.HIDDEN))
        self.ln = nn.LayerNorm(_models.HIDDEN)

    def forward(self, x):
        return self.ln(_ScaledNorm.apply(x, self.w) + x)


@pytest.mark.parametrize("capture", ["fx", "dynamo"])
def test_autograd_functions_keep_their_own_backward(capture):
    # fx would trace into the Function's forward (its graph then differentiates the forward), and
    # Dynamo captures it as a higher-order op whose bodies fuse must not rewrite: either way the
    # Function's own backward must run, while what surrounds it still fuses.
    from _fusing import fuse_via

    torch.manual_seed(0)
    ref = _BlockWithFunction()
    model = fuse_via(copy.deepcopy(ref), capture)
    x = torch.randn(2, 5, _models.HIDDEN, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    seed = torch.randn(2, 5, _models.HIDDEN)
    (model(x) * seed).sum().backward()
    (ref(xr) * seed).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    for (name, p), pr in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, pr.grad, msg=name)
    assert trifuse.report(model).counts() == available_counts({"residual_stream": 1})


class _NormAfterABranch(nn.Module):
    """Data-dependent control flow (fx cannot trace it; Dynamo breaks the graph there), then a
    LayerNorm: called from a block, this module's forward becomes a frame of its own, one code
    object for every model holding it."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(_models.HIDDEN)

    def forward(self, x):
        if x.abs().amax() > 1e9:
            x = x / 2
        return self.norm(x)


class _BlockAroundABranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(_models.HIDDEN, _models.HIDDEN)
        self.inner = _NormAfterABranch()

    def forward(self, x):
        return self.inner(self.proj(x)) + x


def test_graphs_compiled_for_another_model_of_the_same_classes_count_in_its_report():
    # The second model's blocks reuse the graphs Dynamo compiled for the first one's inner frame
    # (same code, same backend); the first model's do not see the second's. Each report counts
    # what ran in its own latest forward: the norm after the branch too.
    counts = []
    for _ in range(2):
        model = nn.ModuleDict({"layers": nn.ModuleList([_BlockAroundABranch() for _ in range(2)])})
        trifuse.fuse(model)
        x = torch.randn(2, 5, _models.HIDDEN)
        for layer in model["layers"]:
            x = layer(x)
        counts.append(trifuse.report(model).counts())
    assert counts[0] == counts[1] == {"layer_norm": 2}, counts


# ---------------------------------------------------------------------------------------------
# Hugging Face's once-only Logger methods inside a head capture, and torch 2.11's metrics log
# ---------------------------------------------------------------------------------------------


def _once_methods(monkeypatch):
    """logging.Logger with warning_once / info_once as transformers adds them (lru_cache'd)."""
    import functools
    import logging

    for name in ("warning_once", "info_once"):
        monkeypatch.setattr(logging.Logger, name, functools.lru_cache(None)(lambda self, *a, _n=name: None),
                            raising=False)


def _ignored_set_name() -> str:
    config = torch._dynamo.config
    return "ignore_logging_functions" if hasattr(config, "ignore_logging_functions") else "ignore_logger_methods"


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "ignore_logging_functions")
                    and not hasattr(torch._dynamo.config, "ignore_logger_methods"),
                    reason="this torch has no ignored logging functions")
@pytest.mark.parametrize("sorts", [False, True], ids=["torch sorts nothing", "torch 2.11 sorts the set"])
def test_once_logging_is_ignored_in_a_capture_without_breaking_metrics_logging(monkeypatch, sorts):
    """Both once-only methods join Dynamo's ignored set for a capture and leave it after; where
    torch's compilation-metrics logging sorts that set (2.11: two lru_cache wrappers do not compare,
    and every compile logs an ERROR traceback), only warning_once joins."""
    import logging

    from trifuse.fusion import capture as C

    _once_methods(monkeypatch)
    config = torch._dynamo.config
    name = _ignored_set_name()

    def sorting_probe():  # what torch 2.11's _get_dynamo_config_for_logging does with the set
        return sorted(getattr(config, name))
    monkeypatch.setattr(torch._dynamo.utils, "_get_dynamo_config_for_logging",
                        sorting_probe if sorts else (lambda: "{}"))
    C._metrics_log_sorts_ignored_functions.cache_clear()
    try:
        with config.patch(**{name: set()}):
            ignored, added = C._ignore_once_logging()
            assert added == ([logging.Logger.warning_once] if sorts
                             else [logging.Logger.warning_once, logging.Logger.info_once])
            assert ignored is getattr(config, name) and set(added) <= ignored
            if sorts:
                sorting_probe()  # the metrics log's sort works on what was added
            ignored.difference_update(added)
            assert not getattr(config, name)
    finally:
        C._metrics_log_sorts_ignored_functions.cache_clear()


def test_a_decoder_inside_a_wrapper_also_trains_without_kv_cache():
    """A user's module around a Hugging Face decoder (no use_cache in its own forward): the hook
    goes on the decoder, the outermost module that takes use_cache, and its blocks fuse."""
    torch.manual_seed(0)
    lm, inputs, _ = _models.gpt2(layers=2)

    class Wrapper(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids, labels=ids).loss

    model = Wrapper(lm)
    trifuse.fuse(model)
    model(inputs(2, 8)["input_ids"]).backward()
    report = trifuse.report(model)
    block = next(u for u in report.units if u.unit.strategy == "dynamo")
    assert len(block.unit.captures) == 1 and block.unit.eager_calls.total() == 0
    assert [n.path for n in report.notes if "use_cache=False" in n.reason] == ["lm"]


# ---------------------------------------------------------------------------------------------
# An LM head over a vocabulary that is not a multiple of 8, its logits returned: padded
# ---------------------------------------------------------------------------------------------


def _gpt2_with_vocab(vocab: int, layers: int = 1):
    tf = pytest.importorskip("transformers")
    cfg = tf.GPT2Config(n_layer=layers, n_embd=32, n_head=2, n_positions=32, vocab_size=vocab, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return tf.GPT2LMHeadModel(cfg).to(_models.DEVICE)


@pytest.mark.parametrize("vocab, padded", [(1030, True), (1024, False), (1001, False)],
                         ids=["misaligned", "multiple-of-8", "narrow"])
def test_a_misaligned_16bit_head_runs_padded_and_returns_its_logits(vocab, padded):
    """GPT-2's head (tied to the embedding) over a vocabulary that is not a multiple of 8, under
    16-bit autocast, its logits returned: the linear runs over a padded weight and the logits are
    sliced back, with the loss, the logits and every gradient as before; aligned or narrow
    vocabularies keep the plain linear, and no report lists every linear it declined."""
    torch.manual_seed(0)
    model = _gpt2_with_vocab(vocab)
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    ids = torch.randint(0, vocab, (2, 8), device=_models.DEVICE)

    def run(m):
        with torch.autocast(_models.DEVICE, dtype=torch.bfloat16):
            out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out

    out, out_ref = run(model), run(ref)
    report = trifuse.report(model)
    assert (report.by_pattern().get("lm_head_padded", 0) == 1) is padded, report.by_pattern()
    assert not any(r[2] == "lm_head_padded" for r in report.rejected())
    assert out.logits.shape == out_ref.logits.shape and out.logits.dtype == out_ref.logits.dtype
    if padded:
        assert out.logits.stride(-2) == 1088  # rows keep the padded width (1030 -> 17 x 64)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-2, atol=1e-2)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=5e-2, atol=5e-3, msg=name)
    assert model.transformer.wte.weight is model.lm_head.weight  # the tie is kept


def test_bert_biased_decoder_runs_padded_and_returns_its_logits():
    """BERT's MLM decoder (tied weight, and a bias the head module also holds) over 1030 words
    under 16-bit autocast: weight and bias padded, logits sliced back, loss, logits and every
    gradient (the bias's included) as before, the tie and the shared bias kept."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=32, vocab_size=1030, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    model = tf.BertForMaskedLM(cfg).to(_models.DEVICE).train()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    ids = torch.randint(0, 1030, (2, 8), device=_models.DEVICE)
    labels = ids.masked_fill(torch.rand(ids.shape, device=ids.device) < 0.5, -100)

    def run(m):
        with torch.autocast(_models.DEVICE, dtype=torch.bfloat16):
            out = m(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
        out.loss.backward()
        return out

    out, out_ref = run(model), run(ref)
    patterns = trifuse.report(model).by_pattern()
    assert patterns.get("lm_head_padded", 0) == 1, patterns
    assert out.logits.shape == out_ref.logits.shape and out.logits.stride(-2) == 1088
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-2, atol=1e-2)
    decoder = model.cls.predictions.decoder
    assert decoder.bias is not None and decoder.bias.grad is not None and decoder.bias.grad.abs().sum() > 0
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=5e-2, atol=5e-3, msg=name)
    assert decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_the_use_cache_hook_leaves_calls_that_set_it():
    """The pre-hook sets use_cache only where the caller left it unset: not when it is passed
    (keyword or positionally), not in eval, not without grad."""
    from trifuse.fusion.fuse import _no_cache_in_training

    class Decoder(nn.Module):
        def forward(self, ids, mask=None, use_cache=None):
            return use_cache

    m = Decoder().train()
    hook = functools.partial(_no_cache_in_training, positional=2)
    assert hook(m, (1,), {}) == ((1,), {"use_cache": False})
    assert hook(m, (1,), {"use_cache": None}) == ((1,), {"use_cache": False})
    assert hook(m, (1,), {"use_cache": True}) is None
    assert hook(m, (1, None, True), {}) is None  # passed positionally
    with torch.no_grad():
        assert hook(m, (1,), {}) is None
    assert hook(m.eval(), (1,), {}) is None


def test_torch_2_11_metrics_log_failure_is_not_shown_while_a_head_capture_ignores_once_logging(monkeypatch):
    """torch 2.11 writes Dynamo's config as JSON when it logs a compile's metrics, the ignored
    logging functions included: with warning_once there, every compile logged "Unexpected
    exception logging compilation metrics" and a traceback at ERROR (the NCCL example on the H200).
    torch 2.13 does not, so the head's capture is stood in for by a call that logs as 2.11 did:
    inside the head's call that record is dropped and others pass; outside it, it passes again."""
    import logging

    from trifuse.fusion import capture as C

    _once_methods(monkeypatch)
    monkeypatch.setattr(C, "_metrics_log_sorts_ignored_functions", lambda: True)

    def compile_and_log(self, module, args, kwargs):
        C._METRICS_LOGGER.error("Unexpected exception logging compilation metrics")
        C._METRICS_LOGGER.error("another error")
    monkeypatch.setattr(C.DynamoUnit, "__call__", compile_and_log)
    seen = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda r: seen.append(r.getMessage())  # on the logger: torch's need not propagate
    C._METRICS_LOGGER.addHandler(handler)
    config = torch._dynamo.config
    try:
        with config.patch(**{_ignored_set_name(): set()}):
            unit = C.HeadUnit.__new__(C.HeadUnit)
            unit.skip_logits, unit.skipped_logits = False, False
            unit(nn.Linear(2, 2), (), {})
            assert seen == ["another error"]
            assert C._drop_metrics_log_failure not in C._METRICS_LOGGER.filters
            compile_and_log(unit, None, (), {})
            assert seen == ["another error", "Unexpected exception logging compilation metrics", "another error"]
    finally:
        C._METRICS_LOGGER.removeHandler(handler)


class _NothingToFuse(nn.Module):
    """Ops of interest with nothing for trifuse to take: a router's softmax and sigmoid, a GeLU
    after a Linear without bias and one after a LayerNorm (GLM-4V's patch merger), dropouts with
    p = 0 and an activation's dropout (no residual add)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.router = nn.Linear(width, 4)
        self.up = nn.Linear(width, width, bias=False)
        self.down = nn.Linear(width, width)

    def forward(self, x):
        weights = torch.softmax(self.router(x), dim=-1) * torch.sigmoid(self.router(x))
        h = F.dropout(F.gelu(self.up(x)), 0.0, self.training)
        h = F.dropout(self.down(h), 0.25, self.training)
        return h * weights.sum(-1, keepdim=True) + F.gelu(F.layer_norm(x, (x.shape[-1],)))


def test_report_says_what_each_op_left_alone_is_when_no_pattern_tried_it():
    """Ops no pattern was a candidate for get a reason that says what they are (nothing missed);
    a softmax over q @ kᵀ scores that no pattern took keeps the generic reason."""
    from _fusing import fuse_via
    model = fuse_via(_NothingToFuse().train(), "dynamo")
    model(torch.randn(3, 16))
    left = {(op, why) for *_, op, why in trifuse.report(model).left()}
    reasons = collections.defaultdict(list)
    for op, why in left:
        reasons[op].append(why)
    assert set(reasons) == {"softmax", "sigmoid", "gelu", "dropout"}, left
    assert reasons["softmax"] == ["not over attention scores (no q @ kᵀ before it): a router's or a gate's softmax"]
    assert "a router's or a gate's sigmoid" in reasons["sigmoid"][0]
    assert sorted(reasons["gelu"]) == [
        f"no bias before it ({what}): a lone GeLU is one pass either way (bias_gelu fuses gelu(x + b))"
        for what in ("a Linear without one", "its input is layer_norm's output")]
    assert sorted(reasons["dropout"]) == [
        "no residual add takes its result (dropout_add fuses residual + dropout(x)): an activation's or a "
        "sublayer's own dropout", "p = 0: the identity in PyTorch too (nothing to fuse)"]

    class Scores(nn.Module):  # q @ kᵀ, then a softmax over it no attention spelling takes (a cube)
        def forward(self, q, k):
            return torch.softmax((q @ k.transpose(-1, -2)) ** 3, dim=-1)

    scores = fuse_via(Scores(), "dynamo")
    scores(torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    assert [(op, why) for *_, op, why in trifuse.report(scores).left()] == [("softmax", "no pattern matches it here")]


class _AttentionPool(nn.Module):
    """Attention pooling outside the repeated blocks (Perceiver's decoder, SigLIP's head): learned
    queries attend over the tokens. `**kwargs` keeps fx out, as transformers' forwards do."""

    def __init__(self, width: int = 16, heads: int = 2, queries: int = 3):
        super().__init__()
        self.heads = heads
        self.queries = nn.Parameter(torch.randn(1, queries, width))
        self.kv = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x, **kwargs):
        b, s, w = x.shape
        k, v = self.kv(x).view(b, s, 2, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        q = self.queries.expand(b, -1, -1).view(b, -1, self.heads, w // self.heads).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / (w // self.heads) ** 0.5
        out = torch.softmax(scores, dim=-1) @ v
        return self.norm(out.transpose(1, 2).reshape(b, -1, w))


class _PooledEncoder(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, 2, 32, dropout=0.0, batch_first=True)
                                    for _ in range(2))
        self.pool = _AttentionPool(width)

    def forward(self, x, **kwargs):  # not fx-traceable either: each module is visited on its own
        for layer in self.layers:
            x = layer(x)
        return self.pool(x)


def test_an_attention_outside_the_blocks_is_captured_whole_by_dynamo():
    """A module fx cannot trace that computes an attention and holds no block is captured whole
    by Dynamo (one unit per class), not split into submodules that cut the attention apart (it
    was: Perceiver's cross-attention layers and decoders kept their attention unfused)."""
    from _fusing import check_against_unfused
    report = check_against_unfused(_PooledEncoder, (torch.randn(2, 7, 16),), "fx")
    assert report.counts().get("attention") == available_counts({"attention": 3})["attention"], report.table()
    assert report.counts().get("layer_norm", 0) + report.counts().get("residual_stream", 0) >= 1
    pooled = [n for n in report.notes if n.path == "pool"]
    assert [n.kind for n in pooled] == ["note"] and "captured whole by Dynamo" in pooled[0].reason, report.notes


def test_python_arithmetic_on_shapes_stays_python_in_fx_graphs():
    """`(x.shape[-1] // heads) ** 0.5` in a module fx traces is Python arithmetic on sizes: the
    canonical form keeps it `operator.pow` (it became `torch.pow`, which refuses two numbers and
    failed the fused forward), and the attention it scales fuses."""
    from _fusing import check_against_unfused

    class Pool(_AttentionPool):
        def forward(self, x):  # fx-traceable: the scale's ** is traced on the shape's proxies
            return super().forward(x)

    report = check_against_unfused(Pool, (torch.randn(2, 7, 16),), "fx")
    assert report.counts().get("attention") == available_counts({"attention": 1})["attention"], report.table()


class _WithTrifuseModules(nn.Module):
    """A model written with trifuse.nn's modules beside torch.nn's: GroupNorm + SiLU fused already,
    a LinearGELU, a trifuse LayerNorm; the torch.nn norm after a residual add is fuse's to take."""

    def __init__(self):
        super().__init__()
        self.gn = trifuse.nn.GroupNorm(2, 4, activation="silu")
        self.ln = trifuse.nn.LayerNorm(4)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.fc = trifuse.nn.LinearGELU(4, 6)

    def forward(self, x):
        h = self.gn(x).flatten(2).transpose(1, 2)  # (B, positions, 4)
        return self.fc(self.norm(self.lin(self.ln(h)) + h))


class _CallsTrifuseOps(nn.Module):
    """A model calling trifuse.ops in its forward (a tuple-returning one among them)."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(1 + 0.3 * torch.randn(4)), nn.Parameter(0.3 * torch.randn(4))
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        h = trifuse.ops.group_norm(x, 2, self.w, self.b, 1e-5, "silu").flatten(2).transpose(1, 2)
        y, s = trifuse.ops.layer_norm(h, (4,), self.w, self.b, residual=h)
        return self.norm(self.lin(y) + s)


def test_symbolic_trace_keeps_a_trifuse_op_one_node():
    """torch.fx.symbolic_trace of code calling trifuse.ops: each op one call_function node whose
    target is the public function (its checks cannot read a Proxy), the graph running as the code."""
    torch.manual_seed(0)
    model = _CallsTrifuseOps()
    gm = torch.fx.symbolic_trace(model)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert trifuse.ops.group_norm in targets and trifuse.ops.layer_norm in targets
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("model", [_WithTrifuseModules, _CallsTrifuseOps], ids=["trifuse.nn", "trifuse.ops"])
def test_a_model_using_trifuse_traces_whole_and_the_rest_fuses(model):
    """A model holding trifuse.nn modules, or calling trifuse.ops in its forward: fx failed on it
    (the ops' checks read a Proxy) and fuse fell back to its submodules. Now each op is one node
    of the traced graph (kernels/_common.py: outside_device_modes), the model traces whole, and
    the residual add into the torch.nn LayerNorm after it fuses. Outputs and gradients by the
    oracle rule."""
    from _fusing import check_against_unfused

    def make():
        torch.manual_seed(0)
        return model()

    report = check_against_unfused(make, (torch.randn(2, 4, 3, 3),), "fx")
    # trifuse.nn.LayerNorm of the GroupNorm's map transposed runs over that map's channels where
    # they lie (the row kernels would copy the transposed view first); the ops' call passes a
    # residual, which the channel norm does not take
    permuted = {"layer_norm_over_permuted_channels": 1} if model is _WithTrifuseModules else {}
    assert report.by_pattern() == {"add_layer_norm": 1, **permuted}, report.table()
    assert "fx cannot trace" not in report.table(), report.table()


class _CachingRope(nn.Module):
    """A rope that caches into itself when called, as Qwen-Image 2.1's does (`self.freqs = [f.to(device)
    for f in self.freqs]`), counts its calls, and remembers the last shape in a dict; `branch` adds
    data-dependent control flow, so fx fails after the assignments (else it traces through them)."""

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.freqs = [torch.randn(8), torch.randn(8)]
        self.calls, self.seen, self.branch = 0, {}, branch

    def forward(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.freqs = [f.to(device) for f in self.freqs]
        self.calls += 1
        self.seen["shape"] = x.shape
        if self.branch and x.sum() > 0:
            return x * self.freqs[1]
        return x * self.freqs[0]


class _RopeThenNorm(nn.Module):
    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.rope, self.norm = _CachingRope(branch), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.rope(x, x.device))


@pytest.mark.parametrize("branch", [True, False], ids=["fx-fails", "fx-traces"])
def test_an_fx_trace_leaves_no_proxies_in_modules_that_cache_into_themselves(branch):
    """fx runs the forward with Proxies: whatever it assigned to the modules is undone after the
    trace, whether it failed or not. Before, Proxies stayed in `freqs` and every later call of the
    model failed (Qwen-Image 2.1's rope, found by bench/fuse_sweep_diffusers.py)."""
    torch.manual_seed(0)
    model = _RopeThenNorm(branch)
    ref = copy.deepcopy(model)
    x = torch.randn(3, 8)
    trifuse.fuse(model)
    rope = model.rope
    assert all(type(f) is torch.Tensor for f in rope.freqs) and rope.calls == 0 and rope.seen == {}
    for _ in range(2):
        assert_close("output", model(x), ref(x).double(), ref(x))
    assert rope.calls == 2 and rope.seen == {"shape": x.shape}
    assert all(type(f) is torch.Tensor for f in rope.freqs)


class _CachedCausalBlock(nn.Module):
    """Wan's VAE in small: a causal block handed its cache (a list) and the cache's index (a list
    of one int, a default shared by every call), writing both in place; a norm for fx to fuse."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.write, self.norm, self.proj = write, nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x, cache=None, index=[0]):  # noqa: B006  (Wan's own default)
        h = self.norm(x)
        if cache is not None:  # (fuse's first trace, with the defaults, sees no cache)
            i = index[0]
            previous = cache[i]
            if self.write == "item":
                cache[i] = x[:, -1:].clone()
            elif self.write == "append":
                cache.append(x)
            index[0] += 1
            if previous is not None:
                h = h + previous
        return self.proj(h)


class _ChunkedCausal(nn.Module):
    def __init__(self, write: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_CachedCausalBlock(write) for _ in range(2)])

    def forward(self, x):
        cache, out = [None, None], []
        for chunk in x.split(2, dim=1):
            index = [0]
            for block in self.blocks:
                chunk = block(chunk, cache, index)
            out.append(chunk)
        return torch.cat(out, 1)


@pytest.mark.parametrize("write", ["item", "append", "none"])
def test_a_block_writing_into_a_list_it_is_handed_is_left_to_dynamo(write):
    """fx would run such a write once, on its own copy, and the graph never: every later call read
    a stale cache (Wan's VAE, 1e-2 off, found by a sweep of it). The trace fails with the reason,
    Dynamo (which replays the writes) captures the block, and the outputs and gradients are the
    model's; a block that only reads the list stays fx's."""
    torch.manual_seed(0)
    ref = _ChunkedCausal(write).double()
    model = trifuse.fuse(copy.deepcopy(ref))
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        out, expected = model(x), ref(x)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(torch.autograd.grad(out.square().sum(), [x, *model.parameters()]),
                                   torch.autograd.grad(expected.square().sum(), [x, *ref.parameters()]))
    table = trifuse.report(model).table()
    assert ("writes into its argument `cache` (a list)" in table) == (write != "none"), table
    assert trifuse.report(model).counts() == available_counts({"layer_norm": 2}), table


def _transformers_kwargs_block():
    """A transformers 5 block: its flags in `**kwargs: Unpack[TransformersKwargs]`, its attention
    probabilities returned beside its output whether asked for or not."""
    from transformers.utils.generic import TransformersKwargs
    from typing_extensions import Unpack

    class Block(nn.Module):
        def __init__(self, width: int = 16, heads: int = 2):
            super().__init__()
            self.heads, self.qkv = heads, nn.Linear(width, 3 * width)

        def forward(self, x, **kwargs: Unpack[TransformersKwargs]):
            b, s, c = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
            probs = torch.softmax(q @ k.transpose(-1, -2) * (c // self.heads) ** -0.5, dim=-1)
            return x + (probs @ v).transpose(1, 2).reshape(b, s, c), probs

    return Block


class _GathersProbabilities(nn.Module):
    """BridgeTower's model, cut down: it calls its blocks without the flag and returns their
    probabilities itself, outside transformers' output collector."""

    def __init__(self, block):
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])

    def forward(self, x):
        probs = []
        for block in self.blocks:
            x, p = block(x)
            probs.append(p)
        return x, probs


@pytest.mark.parametrize("collector", [False, True], ids=["no-collector", "collector-active"])
def test_probabilities_a_caller_gathers_itself_are_returned(collector):
    """A transformers 5 block called without `output_attentions` returns its probabilities; under
    transformers' output collector (a model that records them by hooks, not collecting them now)
    nobody reads them, so the attention fuses and the block returns None there. Outside one, the
    caller may read them (BridgeTower returns its cross-modal layers' in its output, asked or
    not): they are returned as written, the attention left. fuse once returned None there too,
    and BridgeTower's output lost them."""
    pytest.importorskip("transformers")
    from transformers.utils import output_capturing

    torch.manual_seed(0)
    model = _GathersProbabilities(_transformers_kwargs_block())
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    x = torch.randn(2, 6, 16)
    collecting = output_capturing._active_collector
    token = collecting.set({}) if collector else None
    try:
        out, probs = model(x)
        out_ref, probs_ref = ref(x)
    finally:
        if token is not None:
            collecting.reset(token)
    torch.testing.assert_close(out, out_ref)
    if collector:
        assert all(p is None for p in probs), probs
        assert trifuse.report(model).counts() == available_counts({"attention": 2})
    else:
        for p, p_ref in zip(probs, probs_ref):
            torch.testing.assert_close(p, p_ref)
        assert "attention" not in trifuse.report(model).counts()
