"""Cross-entropy spellings become trifuse.cross_entropy, and an LM head whose logits only feed the
loss becomes trifuse.linear_cross_entropy (the logits never exist); options are carried."""
import copy

import pytest
import torch
import torch.nn.functional as F
from _fusing import check_against_unfused, fuse_via, needs_ops, trifuse_ops_run
from torch import nn

pytestmark = needs_ops("cross_entropy", "linear_cross_entropy")
T, V, H = 12, 11, 8
CAPTURES = ["fx", "dynamo"]


def _target(ignore_index=-100):
    t = torch.randint(0, V, (T,))
    t[3] = ignore_index
    return t


class Loss(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, logits, target):
        return F.cross_entropy(logits, target, **self.options)


class ModuleLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.loss = nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, logits, target):
        return self.loss(logits, target)


class UpcastLoss(nn.Module):
    """transformers' ForCausalLMLoss: logits.float().view(-1, vocab)."""

    def forward(self, logits, target):
        return F.cross_entropy(logits.float().view(-1, V), target.view(-1), ignore_index=-100, reduction="mean")


class Head(nn.Module):
    """nanoGPT's head: tied weight, logits only feed the loss (or are returned too)."""

    def __init__(self, return_logits=False):
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lm_head.weight = self.wte.weight
        self.return_logits = return_logits

    def forward(self, x, target):
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=-100)
        return (loss, logits) if self.return_logits else loss


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, inputs, pattern", [
    (Loss, (torch.randn(T, V), _target()), "cross_entropy"),
    (lambda: Loss(reduction="sum", label_smoothing=0.2), (torch.randn(T, V), _target()), "cross_entropy"),
    (lambda: Loss(reduction="none", ignore_index=2), (torch.randn(T, V), _target(2)), "cross_entropy"),
    (ModuleLoss, (torch.randn(T, V), _target()), "cross_entropy"),
    (UpcastLoss, (torch.randn(2, T // 2, V).half(), _target().view(2, -1)), "cross_entropy_upcast"),
    (Head, (torch.randn(2, T // 2, H), _target().view(2, -1)), "linear_cross_entropy"),
], ids=["mean", "sum-smoothing", "none-ignore-2", "nn.CrossEntropyLoss", "hf-upcast", "lm-head-tied"])
def test_spelling_fuses_and_matches(make, inputs, pattern, capture):
    report = check_against_unfused(make, inputs, capture)
    if capture == "fx" and pattern == "linear_cross_entropy":
        # fx records `logits.size(-1)` as a use of the logits (Dynamo folds it): the head stays
        assert report.by_pattern() == {"cross_entropy": 1}
        assert "not linear_cross_entropy" in report.table() and "outside the pattern" in report.table()
        return
    assert report.by_pattern() == {pattern: 1}


def test_returned_logits_keep_the_head_apart():
    x, t = torch.randn(2, T // 2, H), _target().view(2, -1)
    report = check_against_unfused(lambda: Head(return_logits=True), (x, t), "dynamo")
    assert report.by_pattern() == {"cross_entropy": 1}
    assert "not linear_cross_entropy" in report.table()  # the report says why the head stayed


def test_trifuse_op_runs():
    model = fuse_via(Head(), "dynamo")
    x = torch.randn(2, T // 2, H, requires_grad=True)
    names = trifuse_ops_run(lambda: model(x, _target().view(2, -1)).backward())
    assert "trifuse::linear_cross_entropy" in names


def _hf_labels(batch=2, seq=T // 2):
    """Labels as a Hugging Face collator gives them: a masked prompt (-100) and a masked pad."""
    labels = torch.randint(0, V, (batch, seq))
    labels[:, :2] = -100
    labels[1, -1] = -100
    return labels


def for_causal_lm_loss(logits, labels, num_items_in_batch=None, ignore_index=-100):
    """transformers' ForCausalLMLoss + fixed_cross_entropy: upcast, pad/shift the labels, flatten,
    and reduction="sum" divided by num_items_in_batch when the trainer passes it."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, V)
    shift_labels = shift_labels.view(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch
    return loss


class HFLoss(nn.Module):
    """The loss alone, on logits the model computed (the head stays: it is not in this module)."""

    def forward(self, logits, labels):
        return for_causal_lm_loss(logits, labels)


class HFCausalLM(nn.Module):
    """A Hugging Face *ForCausalLM's head and loss, logits not returned (as with
    `return_dict=False` code paths that keep only the loss): linear -> .float() -> view -> loss."""

    def __init__(self, bias=False):
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=bias)

    def forward(self, hidden, labels, num_items_in_batch=None):
        logits = self.lm_head(hidden)
        return for_causal_lm_loss(logits, labels, num_items_in_batch)


class UntiedHead(nn.Module):
    """An untied head Linear with a bias, logits only feed the loss."""

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=True)

    def forward(self, x, target):
        return F.cross_entropy(self.lm_head(x).view(-1, V), target.view(-1), ignore_index=-100)


def _assert_hf_fused(report, pattern, capture):
    """Dynamo (how Hugging Face models are captured) folds `shift_labels.to(logits.device)`; fx records
    it as a use of the upcast logits outside the pattern, so the loss fuses without the upcast and
    the report says why."""
    if capture == "fx":
        assert report.by_pattern() == {"cross_entropy": 1}
        table = report.table()
        assert f"not {pattern}: view is also used by getattr" in table and "outside the pattern" in table
        return
    assert report.by_pattern() == {pattern: 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_hf_lm_head_fuses_upcast(capture):
    """linear -> .float() -> view -> cross_entropy, logits not returned: the upcast LM-head pattern."""
    report = check_against_unfused(HFCausalLM, (torch.randn(2, T // 2, H), _hf_labels()), capture)
    _assert_hf_fused(report, "linear_cross_entropy_upcast", capture)


@pytest.mark.parametrize("capture", CAPTURES)
def test_hf_label_pad_and_shift(capture):
    """F.pad(labels, (0, 1), value=-100)[..., 1:]: the shifted labels reach the fused op (the
    loss and the logits' gradient match the unfused model's)."""
    logits, labels = torch.randn(2, T // 2, V).half(), _hf_labels()
    report = check_against_unfused(HFLoss, (logits, labels), capture)
    _assert_hf_fused(report, "cross_entropy_upcast", capture)
    # the shift is taken: a loss on the unshifted labels differs from the one checked above
    shifted = for_causal_lm_loss(logits, labels)
    unshifted = F.cross_entropy(logits.float().view(-1, V), labels.view(-1), ignore_index=-100)
    assert not torch.allclose(shifted, unshifted)


@pytest.mark.parametrize("capture", CAPTURES)
def test_hf_num_items_in_batch(capture):
    """reduction="sum" then divided by the trainer's token count: fuses, the loss equals the unfused one."""
    hidden, labels = torch.randn(2, T // 2, H), _hf_labels()
    num_items = (F.pad(labels, (0, 1), value=-100)[..., 1:] != -100).sum() + 3  # + 3: other micro-batches
    report = check_against_unfused(HFCausalLM, (hidden, labels, num_items), capture)
    _assert_hf_fused(report, "linear_cross_entropy_upcast", capture)
    model = HFCausalLM()
    fused = fuse_via(copy.deepcopy(model), capture)
    loss = fused(hidden, labels, num_items)
    torch.testing.assert_close(loss, model(hidden, labels, num_items))
    torch.testing.assert_close(loss * num_items, model(hidden, labels) * (num_items - 3))  # sum / count


@pytest.mark.parametrize("capture", CAPTURES)
def test_untied_head_with_bias(capture):
    """An untied nn.Linear head with a bias: the bias goes into linear_cross_entropy (its gradient checked)."""
    report = check_against_unfused(UntiedHead, (torch.randn(2, T // 2, H), _target().view(2, -1)), capture)
    assert report.by_pattern() == {"linear_cross_entropy": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_probability_targets_and_class_weights_are_left(capture):
    probs = torch.softmax(torch.randn(T, V), -1)
    report = check_against_unfused(Loss, (torch.randn(T, V), probs), capture)
    assert report.by_pattern() == {}
    assert any("class indices" in reason for *_, reason in report.rejected())

    class Weighted(Loss):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.rand(V))

        def forward(self, logits, target):
            return F.cross_entropy(logits, target, weight=self.w)

    assert check_against_unfused(Weighted, (torch.randn(T, V), _target()), capture).by_pattern() == {}


class WideHead(nn.Module):
    """A head over a wide vocabulary, its logits returned beside the loss (Hugging Face models)."""

    def __init__(self, vocab, bias=False, dtype=torch.float16):
        super().__init__()
        self.lm_head = nn.Linear(H, vocab, bias=bias).to(dtype)

    def forward(self, x, target):
        logits = self.lm_head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1)), logits


@pytest.mark.parametrize("vocab, bias, dtype, padded", [
    (1030, False, torch.float16, True),
    (1030, True, torch.float16, True),    # BERT's decoder: the bias padded too
    (1030, False, torch.float32, False),  # only 16-bit matmuls fall onto the unaligned kernels
    (1032, False, torch.float16, False),  # a multiple of 8
    (1001, False, torch.float16, False),  # too narrow to pay for the padding
], ids=["misaligned", "bias", "fp32", "aligned", "narrow"])
@pytest.mark.parametrize("capture", CAPTURES)
def test_a_misaligned_16bit_head_runs_padded(vocab, bias, dtype, padded, capture):
    """The head's linear over a weight padded to a multiple of 64, logits sliced back: outputs and
    gradients as the unfused model's; the heads it declines are not listed in the report."""
    x = torch.randn(2, T // 2, H, dtype=dtype)
    t = torch.randint(0, vocab, (2, T // 2))
    report = check_against_unfused(lambda: WideHead(vocab, bias, dtype), (x, t), capture)
    assert report.by_pattern() == ({"cross_entropy": 1, "lm_head_padded": 1} if padded else {"cross_entropy": 1})
    assert not any(pattern == "lm_head_padded" for _, _, pattern, _ in report.rejected())
