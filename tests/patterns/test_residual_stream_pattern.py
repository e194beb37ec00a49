"""The residual stream: add (+ dropout) feeding a norm becomes dropout_add_layer_norm, with the
bias of the linear before it folded in; pre-norm and post-norm; p and training carried."""
import pytest
import torch
import trifuse
from _fusing import check_against_unfused, fuse_via, trifuse_ops_run
from torch import nn

N = 16
X = (torch.randn(2, 5, N),)
CAPTURES = ["fx", "dynamo"]


class PreNorm(nn.Module):
    """GPT-2 / ViT: s = x + dropout(fc(ln1(x))); y = ln2(s); both go on."""

    def __init__(self, p=0.0, bias=True, norm=nn.LayerNorm):
        super().__init__()
        self.ln1, self.ln2 = norm(N), norm(N)
        self.fc = nn.Linear(N, N, bias=bias)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        s = x + self.drop(self.fc(self.ln1(x)))
        return self.ln2(s) * 3.0, s


class PostNorm(nn.Module):
    """BERT's BertSelfOutput: LayerNorm(dropout(dense(h)) + input)."""

    def __init__(self, p=0.0):
        super().__init__()
        self.dense = nn.Linear(N, N)
        self.dropout = nn.Dropout(p)
        self.LayerNorm = nn.LayerNorm(N, eps=1e-12)

    def forward(self, x):
        return self.LayerNorm(self.dropout(self.dense(x)) + x)


class Conv1DPostNorm(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c_proj = Conv1D(N, N)
        nn.init.normal_(self.c_proj.bias)
        self.drop = nn.Dropout(p)
        self.ln = nn.LayerNorm(N)

    def forward(self, x):
        return self.ln(x + self.drop(self.c_proj(x)))


class AddmmPostNorm(nn.Module):
    """LayerNorm(rows + dropout(addmm(b, rows, w))): the linear as a plain addmm."""

    def __init__(self, p=0.0, bias_shape=(N,)):
        super().__init__()
        self.w = nn.Parameter(torch.randn(N, N) / N ** 0.5)
        self.b = nn.Parameter(torch.randn(bias_shape))
        self.drop = nn.Dropout(p)
        self.ln = nn.LayerNorm(N)

    def forward(self, x):
        rows = x.reshape(-1, N)
        return self.ln(rows + self.drop(torch.addmm(self.b, rows, self.w)))


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, expected", [
    (PreNorm, {"layer_norm": 1, "linear_residual_norm": 1}),
    (lambda: PreNorm(bias=False), {"layer_norm": 1, "dropout_add_layer_norm": 1}),
    (lambda: PreNorm(norm=nn.RMSNorm), {"rms_norm": 1, "linear_residual_norm": 1}),
    (PostNorm, {"linear_residual_norm": 1}),
    (Conv1DPostNorm, {"conv1d_residual_norm": 1}),
    (AddmmPostNorm, {"addmm_residual_norm": 1}),
    (lambda: AddmmPostNorm(bias_shape=(10, N)), {"dropout_add_layer_norm": 1}),  # 2-D bias stays in the addmm
], ids=["pre-norm", "pre-norm-no-bias", "pre-norm-rms", "post-norm-bert", "post-norm-conv1d", "post-norm-addmm",
        "post-norm-addmm-2d-bias"])
def test_spelling_fuses_and_matches(make, expected, capture):
    assert check_against_unfused(make, X, capture).by_pattern() == expected


def test_add_without_dropout():
    class AddNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(N)

        def forward(self, x, y):
            return self.ln(x + y)

    report = check_against_unfused(AddNorm, (torch.randn(2, 5, N), torch.randn(2, 5, N)), "dynamo")
    assert report.by_pattern() == {"add_layer_norm": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_dropout_p_and_training_are_carried(capture):
    # p = 1 drops every value: s is the residual exactly, in training only; eval keeps the branch.
    torch.manual_seed(0)
    model = PostNorm(p=1.0)
    fused = fuse_via(model, capture)
    x = torch.randn(2, 5, N)
    expected = model.LayerNorm(x)
    torch.testing.assert_close(fused(x), expected, rtol=0, atol=1e-5)
    fused.eval()
    model_eval = PostNorm(p=1.0)
    model_eval.load_state_dict(model.state_dict())
    torch.testing.assert_close(fused(x), model_eval.eval()(x), rtol=0, atol=1e-5)
    assert trifuse.report(fused).by_pattern() == {"linear_residual_norm": 1}


def test_dropout_trains_with_a_fresh_mask_each_step():
    model = fuse_via(PostNorm(p=0.5), "dynamo")
    x = torch.randn(4, 8, N)
    a, b = model(x), model(x)
    assert not torch.equal(a, b)
    names = trifuse_ops_run(lambda: model(x).sum().backward())
    assert "trifuse::dropout_add_layer_norm" in names


# ---------------------------------------------------------------------------------------------
# Negatives
# ---------------------------------------------------------------------------------------------


class BroadcastResidual(nn.Module):
    """x + positional embedding (broadcast over the batch), then a norm: not a residual stream."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 5, N))
        self.ln = nn.LayerNorm(N)

    def forward(self, x):
        return self.ln(x + self.pos)


class DropoutUsedTwice(PostNorm):
    def forward(self, x):
        d = self.dropout(self.dense(x))
        return self.LayerNorm(d + x), d


class InplaceDropout(PostNorm):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.0, inplace=True)


@pytest.mark.parametrize("capture", CAPTURES)
def test_broadcast_add_is_rejected_by_the_op(capture):
    report = check_against_unfused(BroadcastResidual, X, capture)
    assert report.by_pattern() == {"layer_norm": 1}
    assert any(pattern == "add_layer_norm" and "residual" in reason for _, _, pattern, reason in report.rejected())


@pytest.mark.parametrize("capture", CAPTURES)
def test_dropout_used_elsewhere_stays(capture):
    report = check_against_unfused(DropoutUsedTwice, X, capture)
    # the dropout's output is returned: only the add + norm around it fuse, the dropout stays
    assert report.by_pattern() == {"add_layer_norm": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_inplace_dropout_is_not_fused(capture):
    report = check_against_unfused(InplaceDropout, X, capture, grads=False)
    assert "linear_residual_norm" not in report.by_pattern()
