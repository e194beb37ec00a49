"""Gated activation: every spelling of a gated MLP's act(gate) * up (SiLU, the exact and the tanh
GeLU, as modules, functions, Hugging Face activations or written out; either order; Phi-3's chunked
projection) becomes one trifuse.gated_activation; the activation stays the one written; a GeLU
times another tensor is gated_activation, a lone GeLU after a biased linear stays bias_gelu."""
import math

import pytest
import torch
import torch.nn.functional as F
from _fusing import Act, check_against_unfused, fuse_via, needs_ops, trifuse_ops_run
from torch import nn

import trifuse

pytestmark = needs_ops("gated_activation")
N, I = 16, 24  # hidden, intermediate (not a power of two)
X = (torch.randn(2, 5, N),)
CAPTURES = ["fx", "dynamo"]


def new_gelu(x):  # transformers' NewGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def erf_gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def silu_written_out(x):
    return x * torch.sigmoid(x)


def sigmoid_first_silu(x):
    return torch.sigmoid(x) * x


def fp32_silu(x):  # diffusers' FP32SiLU (Lumina 2's feed-forward)
    return F.silu(x.float()).to(x.dtype)


def fp32_silu_type_as(x):
    return F.silu(x.to(torch.float32)).type_as(x)


def quick_gelu(x):  # x * sigmoid(1.702 x): not SiLU (it becomes bias_gelu's quick form)
    return x * torch.sigmoid(1.702 * x)


class GatedMLP(nn.Module):
    """Llama's MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)); `up_first` writes the product
    the other way round; `bias` gives the projections biases (some GeGLU models)."""

    def __init__(self, act, up_first=False, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(N, I, bias=bias)
        self.up_proj = nn.Linear(N, I, bias=bias)
        self.down_proj = nn.Linear(I, N, bias=False)
        self.act_fn = act
        self.up_first = up_first

    def forward(self, x):
        gate, up = self.act_fn(self.gate_proj(x)), self.up_proj(x)
        return self.down_proj(up * gate if self.up_first else gate * up)


class ChunkedMLP(nn.Module):
    """Phi-3's MLP: one projection to [gate | up], split with chunk."""

    def __init__(self, act):
        super().__init__()
        self.gate_up_proj = nn.Linear(N, 2 * I, bias=False)
        self.down_proj = nn.Linear(I, N, bias=False)
        self.activation_fn = act

    def forward(self, x):
        up_states = self.gate_up_proj(x)
        gate, up_states = up_states.chunk(2, dim=-1)
        return self.down_proj(up_states * self.activation_fn(gate))


def _hf(name):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [
    (lambda: GatedMLP(nn.SiLU()), "silu_mul"),
    (lambda: GatedMLP(nn.SiLU(), up_first=True), "silu_mul"),
    (lambda: GatedMLP(Act(F.silu)), "silu_mul"),
    (lambda: GatedMLP(_hf("silu")), "silu_mul"),
    (lambda: GatedMLP(Act(silu_written_out)), "silu_written_out_mul"),
    (lambda: GatedMLP(Act(sigmoid_first_silu), up_first=True), "silu_written_out_mul"),
    (lambda: GatedMLP(Act(fp32_silu)), "silu_of_fp32_copy_mul"),
    (lambda: GatedMLP(Act(fp32_silu_type_as), up_first=True), "silu_of_fp32_copy_mul"),
    (lambda: GatedMLP(nn.GELU()), "gelu_mul"),
    (lambda: GatedMLP(nn.GELU(approximate="tanh"), up_first=True), "gelu_mul"),
    (lambda: GatedMLP(_hf("gelu_pytorch_tanh")), "gelu_mul"),
    (lambda: GatedMLP(_hf("gelu")), "gelu_mul"),
    (lambda: GatedMLP(Act(new_gelu)), "bias_gelu_mul"),
    (lambda: GatedMLP(Act(erf_gelu), up_first=True), "bias_gelu_mul"),
    (lambda: ChunkedMLP(_hf("silu")), "silu_mul"),
    (lambda: ChunkedMLP(nn.GELU(approximate="tanh")), "gelu_mul"),
    (lambda: GatedMLP(nn.ReLU()), "relu_mul"),
    (lambda: GatedMLP(Act(F.relu), up_first=True), "relu_mul"),
    (lambda: GatedMLP(_hf("relu")), "relu_mul"),
    (lambda: GatedMLP(_hf("relu2")), "bias_gelu_mul"),
    (lambda: GatedMLP(Act(lambda g: F.relu(g).square()), up_first=True), "bias_gelu_mul"),
    (lambda: ChunkedMLP(_hf("relu2")), "bias_gelu_mul"),
], ids=["nn.SiLU", "nn.SiLU-up-first", "F.silu", "hf-silu", "silu-written-out", "sigmoid-first-up-first",
        "fp32-silu", "fp32-silu-type_as-up-first", "nn.GELU", "nn.GELU-tanh-up-first", "hf-gelu_pytorch_tanh",
        "hf-gelu", "new-gelu-written-out", "erf-gelu-written-out", "phi3-chunk-silu", "chunk-gelu-tanh",
        "nn.ReLU", "F.relu-up-first", "hf-relu", "hf-relu2", "relu-square-up-first", "chunk-relu2"])
def test_spelling_fuses_and_matches(make, pattern, capture):
    # The oracle would catch erf <-> tanh (they differ by ~5e-4, far above fp32's bound), SiLU
    # for either, and relu <-> relu2: the activation stays the one written.
    assert check_against_unfused(make, X, capture).by_pattern() == {pattern: 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_the_silu_of_an_fp32_copy_in_a_16_bit_mlp_reads_the_16_bit_gate(capture):
    """diffusers' FP32SiLU in fp16: the SiLU of the gate's fp32 copy, rounded back to fp16, times
    up. The op reads the fp16 gate, its SiLU in fp32 as the copy's, and rounds the product once
    (the model rounds the SiLU as well: the fused result is the closer one to float64)."""
    report = check_against_unfused(lambda: GatedMLP(Act(fp32_silu)).half(), (X[0].half(),), capture)
    assert report.by_pattern() == {"silu_of_fp32_copy_mul": 1}, report.table()


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh")], ids=["erf", "tanh"])
def test_gelu_times_up_after_a_biased_gate_proj_is_gated_activation_not_bias_gelu(act, capture):
    """Stage 0 takes the GeLU with its product before bias_gelu's stage 1 could take it alone (the
    bias stays in the linear); a lone GeLU after a biased linear is still bias_gelu."""
    report = check_against_unfused(lambda: GatedMLP(act, bias=True), X, capture)
    assert report.counts() == {"gated_activation": 1}
    lone = nn.Sequential(nn.Linear(N, I), act, nn.Linear(I, N))
    assert check_against_unfused(lambda: lone, X, capture).counts() == {"bias_gelu": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_written_out_gelu_times_up_is_one_op(capture):
    """The written-out GeLU becomes bias_gelu in stage 0, then gated_activation takes it (one op,
    counted once: the bias_gelu step is absorbed)."""
    report = check_against_unfused(lambda: GatedMLP(Act(new_gelu), bias=True), X, capture)
    assert report.counts() == {"gated_activation": 1}


def test_trifuse_op_runs():
    model = fuse_via(ChunkedMLP(nn.SiLU()), "dynamo")
    x = X[0].clone().requires_grad_()
    names = trifuse_ops_run(lambda: model(x).sum().backward())
    assert {"trifuse::gated_activation", "trifuse::gated_activation_backward"} <= names


# ---------------------------------------------------------------------------------------------
# Negatives
# ---------------------------------------------------------------------------------------------


class Product(nn.Module):
    """act(a) * b on the inputs as given: shapes and dtypes the filters must look at."""

    def __init__(self, act=F.silu):
        super().__init__()
        self.act = act

    def forward(self, a, b):
        return self.act(a) * b


class ActivationReused(GatedMLP):
    def forward(self, x):
        gate = self.act_fn(self.gate_proj(x))
        return self.down_proj(gate * self.up_proj(x)) + self.down_proj(gate)  # (no sum of the product)


class ScaledByAParameter(nn.Module):
    """act(x) * a per-feature vector: broadcasting, not a gated MLP."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(N))

    def forward(self, x):
        return F.silu(x) * self.scale


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make", [
    lambda: GatedMLP(nn.LeakyReLU()),
    lambda: GatedMLP(Act(quick_gelu)),
    lambda: GatedMLP(nn.Tanh()),
    lambda: nn.Sequential(nn.Linear(N, I), nn.SiLU(), nn.Linear(I, N)),
], ids=["leaky-relu", "quick-gelu", "tanh", "silu-alone"])
def test_not_a_gated_activation_is_left(make, capture):
    assert "gated_activation" not in check_against_unfused(make, X, capture).counts()


@pytest.mark.parametrize("capture", CAPTURES)
def test_quick_gelu_gate_declines_with_a_reason(capture):
    """QuickGELU becomes bias_gelu's quick form; gated_activation has no quick form and says so
    instead of computing a GeLU."""
    report = check_against_unfused(lambda: GatedMLP(Act(quick_gelu)), X, capture)
    assert report.by_pattern() == {"gelu_quick_written_out": 1}, report.by_pattern()
    assert any(pattern == "bias_gelu_mul" and "approximate is 'quick': gated_activation has the forms" in why
               for _, _, pattern, why in report.rejected()), report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_broadcasting_product_is_rejected_with_a_reason(capture):
    report = check_against_unfused(ScaledByAParameter, X, capture)
    assert report.by_pattern() == {}
    assert any("(broadcasting)" in reason for *_, reason in report.rejected()), report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_broadcasting_between_inputs_is_rejected(capture):
    report = check_against_unfused(Product, (torch.randn(2, 5, N), torch.randn(5, N)), capture)
    assert report.by_pattern() == {}
    assert any("gate has shape (2, 5, 16) but up (5, 16) (broadcasting)" in reason
               for *_, reason in report.rejected()), report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_mixed_dtypes_are_rejected_with_a_reason(capture):
    model = fuse_via(Product(), capture)
    a, b = torch.randn(3, N), torch.randn(3, N, dtype=torch.float64)
    torch.testing.assert_close(model(a, b), F.silu(a) * b)
    report = trifuse.report(model)
    assert report.by_pattern() == {}
    assert any("gate has dtype torch.float32 but up torch.float64" in reason for *_, reason in report.rejected())


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("act, dtype, reason", [
    (lambda a: F.silu(a.float()).half(), torch.float32,
     "the SiLU of gate's fp32 copy is cast to torch.float16, not back to gate's torch.float32"),
    (fp32_silu, torch.float64, "gate (torch.float64) is wider than its fp32 copy"),
], ids=["cast-elsewhere", "fp64-gate"])
def test_an_fp32_copys_silu_not_cast_back_is_left_with_a_reason(act, dtype, reason, capture):
    """A SiLU of the copy cast to another dtype rounds where the op would not; an fp64 gate's fp32
    copy loses digits the op would keep: both left as written."""
    model = fuse_via(Product(act), capture)
    a, b = torch.randn(3, N, dtype=dtype), torch.randn(3, N, dtype=dtype)
    torch.testing.assert_close(model(a, b), act(a) * b, rtol=0, atol=0)
    report = trifuse.report(model)
    assert report.by_pattern() == {}
    assert any(reason in why for *_, why in report.rejected()), report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_activation_used_elsewhere_is_rejected_with_a_reason(capture):
    report = check_against_unfused(lambda: ActivationReused(nn.SiLU()), X, capture)
    assert "gated_activation" not in report.counts()
    assert any("outside the pattern" in reason for *_, reason in report.rejected())


@pytest.mark.parametrize("capture", CAPTURES)
def test_inplace_silu_product_keeps_its_maths(capture):
    """nn.SiLU(inplace=True) writes into the gate projection's output: left as written, or fused
    with the same result; never wrong."""
    check_against_unfused(lambda: GatedMLP(nn.SiLU(inplace=True)), X, capture)


class T5GatedFFN(nn.Module):
    """T5 v1.1's, mT5's and Flan-T5's T5DenseGatedActDense: `wo(dropout(act(wi_0(x)) * wi_1(x)))`
    with act transformers' NewGELUActivation (the tanh GeLU written out)."""

    def __init__(self, p=0.0, act=new_gelu):
        super().__init__()
        self.wi_0 = nn.Linear(N, I, bias=False)
        self.wi_1 = nn.Linear(N, I, bias=False)
        self.wo = nn.Linear(I, N, bias=False)
        self.dropout = nn.Dropout(p)
        self.act = act

    def forward(self, x):
        return self.wo(self.dropout(self.act(self.wi_0(x)) * self.wi_1(x)))


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("act", [new_gelu, F.silu], ids=["gelu-new", "silu"])
def test_a_dropout_on_the_product_moves_into_the_op(act, capture):
    """Its p and training flag carried: here p = 0 in training, checked against the unfused model."""
    report = check_against_unfused(lambda: T5GatedFFN(act=act), X, capture, train=True)
    assert report.by_pattern() == {"gated_activation_dropout": 1}, report.table()
    assert not [left for left in report.left() if left[2] == "dropout"], report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_the_dropout_in_the_op_drops_and_keeps_like_the_model(capture):
    """p = 1 drops every product (the output is 0); eval keeps them all (the unfused model's output);
    p = 0.5 in training runs trifuse's dropout kernels (their statistics: tests/kernels)."""
    ffn = T5GatedFFN(p=1.0)
    model = fuse_via(ffn.train(), capture)
    x = torch.randn(2, 5, N)
    torch.testing.assert_close(model(x), torch.zeros(2, 5, N), rtol=0, atol=0)
    model.eval()
    inner = ffn if capture == "fx" else model.blocks[0].inner
    with torch.no_grad():
        want = inner.wo(new_gelu(inner.wi_0(x)) * inner.wi_1(x))
    torch.testing.assert_close(model(x), want)
    half = fuse_via(T5GatedFFN(p=0.5).train(), capture)
    h = torch.randn(4, 50, N)
    ran = trifuse_ops_run(lambda: half(h).sum().backward())
    assert "trifuse::gated_activation_dropout" in ran or "trifuse::gated_activation_dropout_backward" in ran
