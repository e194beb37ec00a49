"""Dropout + residual add, either way round, with the bias of the linear before folded in."""
import pytest
import torch
import trifuse
from _fusing import check_against_unfused, fuse_via, needs_ops, trifuse_ops_run
from torch import nn

pytestmark = needs_ops("dropout_add")
N = 16
X = (torch.randn(2, 5, N),)
CAPTURES = ["fx", "dynamo"]


class Sublayer(nn.Module):
    def __init__(self, p=0.0, bias=True, order="residual_first", conv1d=False):
        super().__init__()
        if conv1d:
            from transformers.pytorch_utils import Conv1D

            self.fc = Conv1D(N, N)
            nn.init.normal_(self.fc.bias)
        else:
            self.fc = nn.Linear(N, N, bias=bias)
        self.drop = nn.Dropout(p)
        self.order = order

    def forward(self, x):
        h = self.drop(self.fc(x))
        return x + h if self.order == "residual_first" else h + x


class AddmmSublayer(nn.Module):
    """rows + dropout(addmm(b, rows, w)): the linear as a plain addmm, on (tokens, N) rows."""

    def __init__(self, p=0.0, bias_shape=(N,)):
        super().__init__()
        self.w = nn.Parameter(torch.randn(N, N) / N ** 0.5)
        self.b = nn.Parameter(torch.randn(bias_shape))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        rows = x.reshape(-1, N)
        return rows + self.drop(torch.addmm(self.b, rows, self.w))


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [
    (Sublayer, "linear_dropout_add"),
    (lambda: Sublayer(order="dropout_first"), "linear_dropout_add"),
    (lambda: Sublayer(bias=False), "dropout_add"),
    (lambda: Sublayer(conv1d=True), "conv1d_dropout_add"),
    (AddmmSublayer, "addmm_dropout_add"),
    (lambda: AddmmSublayer(bias_shape=(10, N)), "dropout_add"),  # a 2-D addmm bias stays in the addmm
], ids=["residual+dropout", "dropout+residual", "no-bias", "conv1d", "addmm", "addmm-2d-bias"])
def test_spelling_fuses_and_matches(make, pattern, capture):
    assert check_against_unfused(make, X, capture).by_pattern() == {pattern: 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_p_and_training_are_carried(capture):
    model = fuse_via(Sublayer(p=1.0), capture)
    x = torch.randn(2, 5, N)
    torch.testing.assert_close(model(x), x, rtol=0, atol=0)  # p = 1: the residual only
    model.eval()
    inner = model if capture == "fx" else model.blocks[0].inner
    torch.testing.assert_close(model(x), x + inner.fc(x))
    assert trifuse.report(model).by_pattern() == {"linear_dropout_add": 1}


def test_trifuse_op_runs():
    model = fuse_via(Sublayer(p=0.1), "dynamo")
    x = X[0].clone().requires_grad_()
    assert "trifuse::dropout_add" in trifuse_ops_run(lambda: model(x).sum().backward())


class BiasAdd(nn.Module):
    """dropout(h) + a bias vector: a broadcast, not a residual."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(N, N)
        self.drop = nn.Dropout(0.0)
        self.b = nn.Parameter(torch.randn(N))

    def forward(self, x):
        return self.drop(self.fc(x)) + self.b


@pytest.mark.parametrize("capture", CAPTURES)
def test_broadcast_add_is_rejected_by_the_op(capture):
    report = check_against_unfused(BiasAdd, X, capture)
    assert report.by_pattern() == {}
    assert any(pattern == "dropout_add" for _, _, pattern, _ in report.rejected())
