"""The sweep's autocast verdict, on CPU: `_ill_conditioned` explains a MISMATCH only where PyTorch's
own model, nudged by half an ulp, misses float64 as far on every gradient past the rule."""
import copy

import fuse_sweep as fs  # noqa: I001  (bench/conftest.py sets TRITON_INTERPRET before this)
import pytest
import torch


class _TwoBranches(torch.nn.Module):
    """Two GeLU layers side by side: each one's gradients depend on its own weights only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(torch.cat((self.a(x), self.b(x)), dim=-1))


def _square_mean(out: torch.Tensor, task: str) -> torch.Tensor:
    return out.float().square().mean()


def _grads(model: torch.nn.Module, x: torch.Tensor, autocast) -> tuple:
    with autocast:
        loss = _square_mean(model(x), "")
    return torch.autograd.grad(loss, list(model.parameters()))


@pytest.fixture
def case(monkeypatch):
    """A well-conditioned model under bf16 autocast: its unfused and float64 gradients."""
    monkeypatch.setattr(fs, "_loss", _square_mean)
    torch.manual_seed(0)
    model, x = _TwoBranches(), torch.randn(64, 16)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model64 = copy.deepcopy(model).double()
    grads64 = torch.autograd.grad(_square_mean(model64(x.double()), ""), list(model64.parameters()))
    return model, {"x": x}, autocast, _grads(model, x, autocast), grads64


def test_a_wrong_gradient_of_a_well_conditioned_model_is_not_explained(case):
    """5% off on every gradient: the nudged model's own errors stay near its unnudged ones."""
    model, kwargs, autocast, grads0, grads64 = case
    wrong = tuple(g * 1.05 for g in grads0)
    assert fs._oracle_error(grads0, wrong, grads64, 1e-10, 8e-3) > 0
    assert fs._ill_conditioned(model, kwargs, "", autocast, grads0, wrong, grads64, 1e-10, 8e-3) == ""


def test_explained_only_when_every_gradient_past_the_rule_is_reached(case, monkeypatch):
    """The nudged runs must reach half the fused error on each failing gradient, not on one."""
    model, kwargs, autocast, grads0, grads64 = case
    wrong = tuple(g * 1.05 for g in grads0)

    def scaled_copy(factor_a: float, factor_b: float):
        def nudged(m: torch.nn.Module, seed: int) -> torch.nn.Module:
            m = copy.deepcopy(m)
            with torch.no_grad():  # each branch's gradients moved about as far as the 5% above, or not
                m.a.weight.mul_(factor_a)
                m.b.weight.mul_(factor_b)
            return m
        return nudged

    monkeypatch.setattr(fs, "_nudged", scaled_copy(1.05, 1.05))
    why = fs._ill_conditioned(model, kwargs, "", autocast, grads0, wrong, grads64, 1e-10, 8e-3)
    assert why.startswith("ill-conditioned") and "gradient(s) past the rule" in why, why
    monkeypatch.setattr(fs, "_nudged", scaled_copy(1.05, 1.0))
    assert fs._ill_conditioned(model, kwargs, "", autocast, grads0, wrong, grads64, 1e-10, 8e-3) == ""
