"""Cross-entropy spellings become trifuse.cross_entropy, and an LM head whose logits only feed the
loss becomes trifuse.linear_cross_entropy (the logits never exist); options are carried."""
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
