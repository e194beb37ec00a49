"""xIELU: Apertus's activation as transformers writes it (XIELUActivation's PyTorch path) becomes
one trifuse.xielu, in fx and Dynamo captures; coefficients that are not one value each, a beta
that requires grad, or a result promoted past x's dtype are left as written with the reason."""
import pytest
import torch
from _fusing import check_against_unfused, fuse_via, needs_ops, trifuse_ops_run
from torch import nn

pytestmark = needs_ops("xielu")
N, I = 16, 24
X = (torch.randn(2, 5, N),)
CAPTURES = ["fx", "dynamo"]


def _xielu(dtype=torch.float32):
    """transformers' XIELUActivation (its parameters default to bf16: cast to the test's dtype)."""
    from transformers.activations import ACT2FN

    return ACT2FN["xielu"].to(dtype)


class ApertusMLP(nn.Module):
    """Apertus's MLP: down_proj(act_fn(up_proj(x))), neither linear biased."""

    def __init__(self, act, bias=False):
        super().__init__()
        self.up_proj = nn.Linear(N, I, bias=bias)
        self.down_proj = nn.Linear(I, N, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class Written(nn.Module):
    """xIELU written out with its own parameters and buffers, `shape` giving alpha_p's."""

    def __init__(self, shape=(1,), beta_grad=False):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.full(shape, 0.3))
        self.alpha_n = nn.Parameter(torch.full((1,), -0.5))
        if beta_grad:
            self.beta = nn.Parameter(torch.tensor(0.5))
        else:
            self.register_buffer("beta", torch.tensor(0.5))
        self.register_buffer("eps", torch.tensor(-1e-6))

    def forward(self, x):
        ap = nn.functional.softplus(self.alpha_p)
        an = self.beta + nn.functional.softplus(self.alpha_n)
        return torch.where(x > 0, ap * x * x + self.beta * x, (torch.expm1(torch.min(x, self.eps)) - x) * an + self.beta * x)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make", [lambda: ApertusMLP(_xielu()), lambda: ApertusMLP(_xielu(), bias=True),
                                  lambda: ApertusMLP(Written()), lambda: _xielu()],
                         ids=["hf", "hf-biased-up", "written", "alone"])
def test_xielu_fuses_and_matches(make, capture):
    """The oracle checks y and every gradient, the coefficients' parameters' included."""
    assert check_against_unfused(make, X, capture).by_pattern() == {"xielu_written_out": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_bf16_parameters_beside_fp32_activations_fuse(capture):
    """transformers makes the parameters bf16 by default: with fp32 x the result is still fp32
    (a bf16 (1,) tensor and an fp32 one promote to fp32), so the op takes them as they are."""
    model = ApertusMLP(_xielu(torch.bfloat16))
    model.up_proj.float(), model.down_proj.float()
    assert check_against_unfused(lambda: model, X, capture).by_pattern() == {"xielu_written_out": 1}


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, why", [
    (lambda: ApertusMLP(Written(shape=(I,))), "alpha_p has shape (24,), not one value"),
    (lambda: ApertusMLP(Written(beta_grad=True)), "beta requires grad"),
], ids=["per-feature", "beta-trained"])
def test_what_the_op_cannot_take_is_left_with_a_reason(make, why, capture):
    report = check_against_unfused(make, X, capture)
    assert "xielu" not in report.counts(), report.table()  # (its adds may be other families' ops)
    assert any(pattern == "xielu_written_out" and why in reason for _, _, pattern, reason in report.rejected()), \
        report.rejected()


@pytest.mark.parametrize("capture", CAPTURES)
def test_coefficients_wider_than_x_give_the_models_wider_result(capture):
    """fp64 coefficients beside fp32 x (as fp32 master weights beside bf16 activations under
    autocast): PyTorch promotes the result to fp64, and the op writes fp64 too, not fp32 cast up."""
    report = check_against_unfused(lambda: _xielu(torch.float64), X, capture)
    assert report.by_pattern() == {"xielu_written_out": 1}, report.table()


def test_trifuse_op_runs():
    model = fuse_via(ApertusMLP(_xielu()), "dynamo")
    x = X[0].clone().requires_grad_()
    names = trifuse_ops_run(lambda: model(x).sum().backward())
    assert {"trifuse::xielu", "trifuse::xielu_backward"} <= names, names
