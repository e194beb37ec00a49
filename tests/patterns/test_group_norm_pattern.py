"""GroupNorm: `nn.GroupNorm`, `F.group_norm` and `torch.group_norm` become one trifuse.group_norm,
with the SiLU after it (`nn.SiLU`, `F.silu`, written out) where the norm's output has no other
reader, as in diffusers' ResNet blocks; outputs and gradients by the oracle rule, fx and Dynamo."""
import copy

import pytest
import torch
import torch.nn.functional as F
import trifuse
from _fusing import (
    Act,
    check_against_unfused,
    cuda_like_autocast,
    fuse_via,
    needs_ops,
    op_names,
    trifuse_ops_run,
)
from tolerances import assert_close
from torch import nn

pytestmark = needs_ops("group_norm")
C = 12
X = (torch.randn(2, C, 5, 7),)
CAPTURES = ["fx", "dynamo"]


class ResnetHalf(nn.Module):
    """diffusers' ResnetBlock2D, its first half: conv(nonlinearity(norm(x)))."""

    def __init__(self, norm, act):
        super().__init__()
        self.norm = norm
        self.nonlinearity = act
        self.conv = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        return self.conv(self.nonlinearity(self.norm(x)))


class FunctionalNorm(nn.Module):
    def __init__(self, fn, affine=True):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(C)) if affine else None
        self.bias = nn.Parameter(0.3 * torch.randn(C)) if affine else None
        self.fn = fn

    def forward(self, x):
        return self.fn(x, 4, self.weight, self.bias, 1e-6)


def silu_written_out(y):
    return y * torch.sigmoid(y)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [
    (lambda: ResnetHalf(nn.GroupNorm(4, C), nn.SiLU()), "group_norm_silu"),
    (lambda: ResnetHalf(nn.GroupNorm(3, C, eps=1e-6), Act(F.silu)), "group_norm_silu"),
    (lambda: ResnetHalf(nn.GroupNorm(4, C), Act(silu_written_out)), "group_norm_silu_written_out"),
    (lambda: ResnetHalf(nn.GroupNorm(C, C, affine=False), nn.SiLU()), "group_norm_silu"),
    (lambda: ResnetHalf(FunctionalNorm(torch.group_norm), nn.SiLU()), "group_norm_silu"),
    (lambda: ResnetHalf(nn.GroupNorm(4, C), nn.Identity()), "group_norm"),
    (lambda: ResnetHalf(FunctionalNorm(F.group_norm, affine=False), nn.GELU()), "group_norm"),
], ids=["nn.GroupNorm-nn.SiLU", "eps-F.silu", "silu-written-out", "no-affine-one-channel-a-group",
        "torch.group_norm", "no-activation", "functional-then-gelu"])
def test_spelling_fuses_and_matches(make, pattern, capture):
    report = check_against_unfused(make, X, capture)
    assert report.by_pattern() == {pattern: 1}, report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_norm_read_beside_its_silu_fuses_alone(capture):
    """The norm's output read by the SiLU and by a skip connection: the SiLU stays PyTorch's
    (the op returns only its SiLU), the norm is fused by itself."""
    class TwoReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(4, C)
            self.act = nn.SiLU()

        def forward(self, x):
            h = self.norm(x)
            return self.act(h) + h

    report = check_against_unfused(TwoReaders, X, capture)
    assert report.by_pattern() == {"group_norm": 1}, report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_an_in_place_silu_is_left_as_written(capture):
    report = check_against_unfused(lambda: ResnetHalf(nn.GroupNorm(4, C), nn.SiLU(inplace=True)), X, capture)
    assert report.by_pattern() == {"group_norm": 1}, report.table()


def test_the_fused_step_runs_the_op_and_keeps_no_activation():
    """One trifuse op forward, its backward op too; the SiLU's input (eager keeps it) is gone."""
    model = ResnetHalf(nn.GroupNorm(4, C), nn.SiLU())
    trifuse.fuse(model)
    x = X[0].clone().requires_grad_()
    names = trifuse_ops_run(lambda: model(x).sum().backward())
    assert {"trifuse::group_norm", "trifuse::group_norm_backward"} & names, names
    assert trifuse.report(model).counts() == {"group_norm": 1}


def test_ops_selection_leaves_group_norm_out():
    model = ResnetHalf(nn.GroupNorm(4, C), nn.SiLU())
    trifuse.fuse(model, ops=["layer_norm"])
    model(X[0])
    assert trifuse.report(model).counts() == {}


@pytest.mark.parametrize("capture", CAPTURES)
def test_16_bit_under_cuda_autocast_keeps_the_models_dtypes(capture):
    """CUDA's autocast runs GroupNorm in fp32 on a 16-bit x (the conv before it returns 16 bits):
    the fused op computes in fp32 as well and returns x's 16 bits, which the convolution after it
    reads as they are (it would round the model's fp32 output to the same 16 bits: no fp32 copy
    is written). Output by the oracle rule, the unfused model under the same autocast the
    yardstick (its loss-free output: fp16 convolutions' gradients move with any reordering)."""
    def make():
        return nn.Sequential(nn.Conv2d(C, C, 1), ResnetHalf(nn.GroupNorm(4, C), nn.SiLU()))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with cuda_like_autocast(), torch.autocast(device, dtype=torch.float16):
        report = check_against_unfused(make, X, capture, grads=False)
    assert report.by_pattern() == {"group_norm_silu": 1}, report.table()
    assert "output in float16: one autocast matmul reads it" in report.table(), report.table()


class GroupNorm32(nn.GroupNorm):
    """guided-diffusion's and latent-diffusion's (SD's original code, SDXL's generative-models):
    the norm of an fp32 copy, cast back."""

    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


class NormThenSiluInFp32(nn.Module):
    """The SiLU inside the cast too: `silu(group_norm(x.float())).to(x.dtype)`."""

    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(4, C)

    def forward(self, x):
        return F.silu(self.norm(x.float())).to(x.dtype)


class _GroupNorm32In64(GroupNorm32):
    def forward(self, x):
        return nn.GroupNorm.forward(self, x.double()).type(x.dtype)


class _NormThenSiluIn64(NormThenSiluInFp32):
    def forward(self, x):
        return F.silu(self.norm(x.double())).to(x.dtype)


def _computing_in_float64(model: nn.Module) -> nn.Module:
    """The float64 twin: the same modules computing on a float64 copy (on an fp32 one, with its
    float64 parameters, they could not run; and the copy's precision is what is compared)."""
    for m in model.modules():
        if type(m) is GroupNorm32:
            m.__class__ = _GroupNorm32In64
        elif type(m) is NormThenSiluInFp32:
            m.__class__ = _NormThenSiluIn64
    return model


def _half_but_norms(module: nn.Module) -> nn.Module:
    """What guided-diffusion's `convert_to_fp16` does: convolutions in fp16, norms left in fp32."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            m.half()
    return module


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, silu_fused", [
    (lambda: ResnetHalf(GroupNorm32(4, C), nn.SiLU()), False),
    (lambda: NormThenSiluInFp32(), True),
], ids=["GroupNorm32-then-silu", "silu-inside-the-cast"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_the_norm_of_an_fp32_copy_cast_back_is_the_norm_of_x(make, silu_fused, dtype, capture):
    """The op reads x itself, with the fp32 parameters, and returns x's dtype: the forward casts
    nothing (no fp32 copy is made or kept), and a SiLU inside the cast joins the op (in fp32
    before the one rounding, as the model computed it). Outputs and gradients by the oracle rule
    against the model as written. An fp32 x's copy is x: the casts go too."""
    def build():
        model = make()
        return _half_but_norms(model) if dtype == torch.float16 else model

    report = check_against_unfused(build, (X[0].to(dtype),), capture, twin64=_computing_in_float64)
    assert report.by_pattern() == {"group_norm_in_fp32": 1}, report.table()
    torch.manual_seed(0)
    model = fuse_via(build(), capture)
    x = X[0].to(dtype, copy=True).requires_grad_()
    model(x)  # captured
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
    names = set(op_names(prof))
    assert "aten::_to_copy" not in names, sorted(names)
    assert ("aten::silu" in names) != silu_fused, sorted(names)


class _RoundsToFp32(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(4, C)

    def forward(self, x):
        return self.norm(x.float()).type(x.dtype)


class _RoundsToFp32In64(_RoundsToFp32):
    def forward(self, x):
        return self.norm(x.float().double()).type(x.dtype)  # x rounded to fp32, as the model does


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_float64_input_keeps_its_fp32_copy(capture):
    """`x.float()` of a float64 x rounds it: the op on x would compute in float64, other maths, so
    the copy stays (the norm of it still fuses), and the report says why. The answer and x's
    gradient carry fp32's precision (float64 values of an fp32 computation): held to fp32's rule."""
    torch.manual_seed(0)
    model = _RoundsToFp32()
    ref, ref64 = copy.deepcopy(model), _RoundsToFp32In64()
    ref64.load_state_dict(model.state_dict())
    ref64.double()
    fused = fuse_via(model, capture)
    xs = [X[0].to(torch.float64, copy=True).requires_grad_() for _ in range(3)]
    outs = [m(x) for m, x in zip((fused, ref, ref64), xs)]
    seed = torch.randn_like(outs[0])
    for o in outs:
        (o * seed).sum().backward()
    assert_close("output", outs[0].float(), outs[2], outs[1].float())
    assert_close("grad x", xs[0].grad.float(), xs[2].grad, xs[1].grad.float())
    report = trifuse.report(fused)
    assert report.by_pattern() == {"group_norm": 1}, report.table()
    assert "not 16-bit or float32" in report.table(), report.table()
