"""Attention masks that a compiled graph computes from literals alone (`normalize.constant_masks`).

transformers builds its causal mask as a tensor when it is compiled, so SDPA under torch.compile
gets a dense mask where eager gets `is_causal=True`: on the lent H100 cuDNN took 17.2 ms a GPT-2
medium step with the mask and 7.8 ms causal. A mask that keeps exactly the causal pattern becomes
`is_causal`, one that keeps everything goes; every other mask stays, and so does any mask that
depends on an input, a random draw or a symbolic size."""
import copy

import _models
import pytest
import torch
import torch.nn.functional as F
from _device import DEVICE
from tolerances import assert_close
from trifuse.fusion import normalize
from trifuse.fusion.backend import _rewrite
from trifuse.kernels.attention import attention


class _MaskedAttention(torch.nn.Module):
    """SDPA under a mask the forward builds from the sizes (or takes as an input)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, given=None):
        sq, sk = q.shape[-2], k.shape[-2]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        kind = self.kind
        if kind == "causal bool":
            mask = (j <= i)[None, None].expand(q.shape[0], 1, sq, sk)  # transformers' layout
        elif kind == "keeps all":
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        elif kind == "causal -inf":
            mask = torch.zeros(sq, sk, device=q.device).masked_fill(j > i, float("-inf"))
        elif kind == "causal finfo.min":
            mask = torch.full((sq, sk), torch.finfo(q.dtype).min, device=q.device).triu(1)
        elif kind == "finite bias":  # ALiBi-like: a constant, but it changes the scores
            mask = (j - i).to(q.dtype) * 0.5
        elif kind == "causal -1e4":  # older transformers' fill: close to causal, not the same
            mask = torch.zeros(sq, sk, device=q.device).masked_fill(j > i, -1e4)
        elif kind == "bottom-right causal":
            mask = j <= i + (sk - sq)
        elif kind == "sliding window":
            mask = (j <= i) & (j > i - 2)
        elif kind == "random":
            mask = torch.rand(sq, sk, device=q.device) < 2.0  # keeps all, but drawn
        elif kind == "input":
            mask = given
        else:
            raise ValueError(kind)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _compiled_calls(model, args, dynamic=False):
    """The model compiled by a backend that canonicalizes Dynamo's graph and runs it; its output
    and each SDPA call's (mask is None, is_causal) as compiled."""
    calls = []

    def backend(gm, example_inputs):
        normalize.canonicalize(gm)
        calls.extend((n.args[3] is None, n.args[5]) for n in gm.graph.nodes
                     if n.target is F.scaled_dot_product_attention)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, dynamic=dynamic)(*args)
    return out, calls


def _qkv(sq=7, sk=7):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, s, 8, generator=g).to(DEVICE) for s in (sq, sk, sk)]


@pytest.mark.parametrize("kind, expected", [
    ("causal bool", (True, True)), ("causal -inf", (True, True)), ("causal finfo.min", (True, True)),
    ("keeps all", (True, False)),
    ("finite bias", (False, False)), ("causal -1e4", (False, False)), ("sliding window", (False, False)),
    ("random", (False, False)),
])
def test_a_constant_mask_that_keeps_the_causal_pattern_becomes_is_causal(kind, expected):
    model = _MaskedAttention(kind)
    args = _qkv()
    out, calls = _compiled_calls(model, args)
    assert calls == [expected]
    torch.testing.assert_close(out, model(*args))


def test_a_bottom_right_mask_is_not_sdpas_causal():
    """SDPA's is_causal is top-left aligned: with fewer queries than keys (a cache), the mask
    transformers builds keeps more keys than is_causal would."""
    model = _MaskedAttention("bottom-right causal")
    args = _qkv(sq=3, sk=7)
    out, calls = _compiled_calls(model, args)
    assert calls == [(False, False)]
    torch.testing.assert_close(out, model(*args))


def test_a_mask_from_an_input_or_a_symbolic_size_stays():
    q, k, v = _qkv()
    given = torch.ones(7, 7, dtype=torch.bool, device=DEVICE).tril()
    _, calls = _compiled_calls(_MaskedAttention("input"), (q, k, v, given))
    assert calls == [(False, False)]  # its values may differ next call
    out, calls = _compiled_calls(_MaskedAttention("causal bool"), (q, k, v), dynamic=True)
    assert calls == [(False, False)]  # built from a symbol: one graph serves every size
    torch.testing.assert_close(out, _MaskedAttention("causal bool")(q, k, v))


def test_a_mask_read_elsewhere_stays_for_its_other_reader():
    class Both(_MaskedAttention):
        def forward(self, q, k, v, given=None):
            i = torch.arange(q.shape[-2], device=q.device)
            mask = i[None, :] <= i[:, None]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), mask.sum()

    model = Both("causal bool")
    args = _qkv()
    (out, total), calls = _compiled_calls(model, args)
    assert calls == [(True, True)]
    assert total.item() == 7 * 8 // 2
    torch.testing.assert_close(out, model(*args)[0])


def _compiled_by_trifuse(model):
    """`model` compiled by backend="trifuse"'s own rewrite, and the list its graphs go to."""
    graphs = []

    def backend(gm, example_inputs):
        work = _rewrite(gm, example_inputs, "backend=trifuse", eager=True)
        graphs.append(work.graph)
        return work.forward

    torch._dynamo.reset()
    return torch.compile(model, backend=backend), graphs


def _attention_calls(graph):
    return [(n.args[3], n.args[5]) for n in graph.nodes
            if n.op == "call_function" and n.target in (F.scaled_dot_product_attention, attention)]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_gpt2_under_compile_attends_causally_without_its_mask(attn_implementation):
    """The whole GPT-2 compiled: transformers' mask (causal, and its packed-sequence check of the
    position ids, both from aranges) goes, each attention call is causal, and training equals
    eager's by the oracle rule. The explicit chain of eager attention too: it becomes trifuse's
    op in the rewrite, and its mask goes after."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2(layers=2, attn_implementation=attn_implementation)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    kw = inputs(2, 9)
    compiled, graphs = _compiled_by_trifuse(model)
    loss, lowp, loss64 = loss_fn(compiled, kw), loss_fn(ref, kw), loss_fn(ref64, kw)
    calls = [c for g in graphs for c in _attention_calls(g)]
    assert calls == [(None, True)] * 2
    for value in (loss, lowp, loss64):
        value.backward()
    assert_close("loss", loss, loss64, lowp)
    for (name, p), p64, pr in zip(model.named_parameters(), ref64.parameters(), ref.parameters()):
        assert_close(f"grad {name}", p.grad, p64.grad, pr.grad)


def test_bert_keeps_its_padding_mask():
    """BERT's mask comes from the attention_mask input: data, so it stays."""
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.bert(layers=1)
    compiled, graphs = _compiled_by_trifuse(model)
    loss_fn(compiled, inputs(2, 9))
    calls = [c for g in graphs for c in _attention_calls(g)]
    assert calls and all(mask is not None and causal is False for mask, causal in calls)
