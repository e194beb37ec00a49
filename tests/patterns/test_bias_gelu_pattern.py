"""Bias + GeLU: every GeLU spelling after a biased linear (nn.Linear, F.linear, HF Conv1D) moves
the bias into trifuse.bias_gelu; exact stays exact, tanh stays tanh, CLIP's QuickGELU stays quick.
ReLU MLPs take the op's relu form where a bias moves in or a dropout in training follows."""
import math

import pytest
import torch
import torch.nn.functional as F
import trifuse
from _fusing import (
    Act,
    check_against_unfused,
    check_sharded_against_unfused,
    fuse_via,
    needs_ops,
    trifuse_ops_run,
)
from torch import nn

pytestmark = needs_ops("bias_gelu")
N = 16
X = (torch.randn(2, 5, N),)
CAPTURES = ["fx", "dynamo"]


def new_gelu(x):  # transformers' NewGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def fast_gelu(x):  # transformers' FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def erf_gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def cube_product_gelu(x):  # the cube as a product of x's
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))


def cube_scaled_first_gelu(x):  # `0.044715 * x * x * x`: the constant multiplies first
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def erf_times_root_half_gelu(x):  # x * 1/sqrt(2), to 16 digits
    return x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))


def special_erf_gelu(x):  # torch.special.erf: torch.erf by another name
    return 0.5 * x * (1.0 + torch.special.erf(x / math.sqrt(2.0)))


def erf_over_1_41421_gelu(x):  # Megatron's erf_gelu: 1.41421, 2.5e-6 off sqrt(2), another function
    return x * 0.5 * (1.0 + torch.erf(x / 1.41421))


def quick_gelu(x):  # transformers' QuickGELUActivation (CLIP): other maths than either GeLU form
    return x * torch.sigmoid(1.702 * x)


def quick_gelu_slope_after(x):
    return torch.sigmoid(x * 1.702) * x


def quick_gelu_method(x):
    return x * (1.702 * x).sigmoid()


def sigmoid_slope_1_7(x):  # QuickGELU's shape with another slope: another function
    return x * torch.sigmoid(1.7 * x)


def silu_as_slope_1(x):  # x * sigmoid(1.0 x) is SiLU, not QuickGELU
    return x * torch.sigmoid(1.0 * x)


def wrong_constant_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.04 * torch.pow(x, 3.0))))


class LinearAct(nn.Module):
    def __init__(self, act, bias=True, conv1d=False):
        super().__init__()
        if conv1d:
            from transformers.pytorch_utils import Conv1D

            self.fc = Conv1D(2 * N, N)
            nn.init.normal_(self.fc.bias)
        else:
            self.fc = nn.Linear(N, 2 * N, bias=bias)
        self.act = act

    def forward(self, x):
        return self.act(self.fc(x))


class AddmmAct(nn.Module):
    """A linear written as `torch.addmm(bias, x2d, w)` on rows, no view after it."""

    def __init__(self, act, bias_shape=(2 * N,)):
        super().__init__()
        self.w = nn.Parameter(torch.randn(N, 2 * N) / N ** 0.5)
        self.b = nn.Parameter(torch.randn(bias_shape))
        self.act = act

    def forward(self, x):
        return self.act(torch.addmm(self.b, x.reshape(-1, N), self.w))


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [
    (lambda: LinearAct(nn.GELU()), "linear_gelu"),
    (lambda: LinearAct(nn.GELU(approximate="tanh")), "linear_gelu"),
    (lambda: LinearAct(Act(lambda x: F.gelu(x, approximate="tanh"))), "linear_gelu"),
    (lambda: LinearAct(Act(new_gelu), conv1d=True), "conv1d_bias_gelu"),
    (lambda: LinearAct(Act(new_gelu)), "linear_bias_gelu"),
    (lambda: LinearAct(Act(fast_gelu)), "linear_bias_gelu"),
    (lambda: LinearAct(Act(erf_gelu)), "linear_bias_gelu"),
    (lambda: LinearAct(Act(cube_product_gelu)), "linear_bias_gelu"),
    (lambda: LinearAct(Act(erf_times_root_half_gelu)), "linear_bias_gelu"),
    (lambda: LinearAct(nn.GELU(), conv1d=True), "conv1d_gelu"),
    (lambda: AddmmAct(nn.GELU()), "addmm_gelu"),
    (lambda: AddmmAct(Act(new_gelu)), "addmm_bias_gelu"),
    (lambda: LinearAct(Act(quick_gelu)), "linear_bias_gelu"),
    (lambda: LinearAct(Act(quick_gelu_slope_after)), "linear_bias_gelu"),
    (lambda: LinearAct(Act(quick_gelu_method)), "linear_bias_gelu"),
    (lambda: LinearAct(_hf_activation("quick_gelu")), "linear_bias_gelu"),
    (lambda: LinearAct(Act(quick_gelu), conv1d=True), "conv1d_bias_gelu"),
    (lambda: AddmmAct(Act(quick_gelu)), "addmm_bias_gelu"),
], ids=["nn.GELU", "nn.GELU-tanh", "F.gelu-tanh", "conv1d-new-gelu", "new-gelu", "fast-gelu", "erf-written-out",
        "cube-product", "erf-times-root-half", "conv1d-nn.GELU", "addmm-nn.GELU", "addmm-new-gelu", "quick-gelu",
        "quick-gelu-slope-after",
        "quick-gelu-method", "hf-QuickGELUActivation", "conv1d-quick-gelu", "addmm-quick-gelu"])
def test_spelling_fuses_and_matches(make, pattern, capture):
    # The oracle would catch one form for another: exact and tanh differ by ~1e-3, quick and
    # either by ~2e-2, far above fp32's bound.
    assert check_against_unfused(make, X, capture).by_pattern() == {pattern: 1}


def _hf_activation(name):
    """transformers' own activation module for `hidden_act=name` (ACT2FN), as its models hold it."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]


@pytest.mark.parametrize("capture", CAPTURES)
def test_quick_gelu_becomes_the_quick_form(capture):
    """CLIP's MLP: fc1 + QuickGELU is one bias_gelu(..., approximate="quick"), never a GeLU form."""
    model = fuse_via(LinearAct(Act(quick_gelu)), capture)
    x = X[0].clone().requires_grad_()
    calls = []
    real = trifuse.ops.bias_gelu

    def spy(x, bias=None, approximate="none"):
        calls.append(approximate)
        return real(x, bias, approximate)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trifuse.ops, "bias_gelu", spy)
        model(x).sum().backward()
    assert calls and set(calls) == {"quick"}, calls  # (fusing runs the replacement on example values too)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("act, pattern", [(new_gelu, "gelu_tanh_written_out"),
                                          (quick_gelu, "gelu_quick_written_out"),
                                          (cube_product_gelu, "gelu_tanh_cubed_written_out"),
                                          (cube_scaled_first_gelu,
                                           "gelu_tanh_cubed_written_out_scaled_first"),
                                          (erf_times_root_half_gelu, "gelu_erf_times_root_half_written_out"),
                                          (special_erf_gelu, "gelu_erf_written_out")],
                         ids=["new-gelu", "quick-gelu", "cube-product", "cube-scaled-first",
                              "erf-times-root-half", "special-erf"])
def test_written_out_gelu_without_linear_still_becomes_one_op(act, pattern, capture):
    assert check_against_unfused(lambda: Act(act), X, capture).by_pattern() == {pattern: 1}


def test_trifuse_op_runs():
    model = fuse_via(LinearAct(nn.GELU()), "dynamo")
    x = X[0].clone().requires_grad_()
    names = trifuse_ops_run(lambda: model(x).sum().backward())
    assert "trifuse::bias_gelu" in names


# ---------------------------------------------------------------------------------------------
# Negatives
# ---------------------------------------------------------------------------------------------


class LinearOutputReused(LinearAct):
    def forward(self, x):
        h = self.fc(x)
        return self.act(h) + h


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make", [
    lambda: LinearAct(nn.GELU(), bias=False),
    lambda: LinearAct(Act(sigmoid_slope_1_7)),
    lambda: LinearAct(Act(silu_as_slope_1)),
    lambda: LinearAct(Act(wrong_constant_gelu)),
    lambda: LinearAct(Act(erf_over_1_41421_gelu)),
    lambda: LinearAct(nn.SiLU()),
    lambda: AddmmAct(nn.GELU(), bias_shape=(10, 2 * N)),  # addmm's bias per element, not a vector
], ids=["no-bias", "sigmoid-slope-1.7", "sigmoid-slope-1", "wrong-constant", "erf-over-1.41421", "silu",
        "addmm-2d-bias"])
def test_not_gelu_after_a_biased_linear_is_left(make, capture):
    assert check_against_unfused(make, X, capture).by_pattern() == {}


@pytest.mark.parametrize("capture", CAPTURES)
def test_quick_gelu_without_bias_is_one_op_without_bias(capture):
    """A linear without bias: QuickGELU still becomes one op (its own maths, no bias to take)."""
    report = check_against_unfused(lambda: LinearAct(Act(quick_gelu), bias=False), X, capture)
    assert report.by_pattern() == {"gelu_quick_written_out": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_sigmoid_with_another_slope_is_left_with_a_reason(capture):
    """Negative control for the slope: x * sigmoid(1.7 x) is not QuickGELU; the report says so,
    and (in a block Dynamo captures) lists its sigmoid as left."""
    report = check_against_unfused(lambda: LinearAct(Act(sigmoid_slope_1_7)), X, capture)
    assert report.by_pattern() == {}
    assert any(pattern == "gelu_quick_written_out" and "is not QuickGELU's x * sigmoid(1.702 x)" in why
               for _, _, pattern, why in report.rejected()), report.table()
    if capture == "dynamo":
        assert [op for *_, op, _ in report.left()] == ["sigmoid"], report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_linear_output_used_elsewhere_is_rejected_with_a_reason(capture):
    report = check_against_unfused(lambda: LinearOutputReused(nn.GELU()), X, capture)
    assert report.by_pattern() == {}
    assert any("outside the pattern" in reason for *_, reason in report.rejected())


def test_addmm_with_a_2d_bias_says_why():
    report = check_against_unfused(lambda: AddmmAct(nn.GELU(), bias_shape=(10, 2 * N)), X, "dynamo")
    assert any("addmm's bias has shape" in reason for *_, reason in report.rejected())


# ---------------------------------------------------------------------------------------------
# Column-parallel (trifuse.parallel's ColwiseParallel, on a one-rank mesh): the linear runs on
# DTensors and the GeLU on the local columns; the bias moves in as its local shard.
# tests/parallel/test_fused_shard.py runs GPT-2 and BERT on two ranks.
# ---------------------------------------------------------------------------------------------


def _colwise(mesh, act, conv1d=False, output_layouts=None):
    from torch.distributed.tensor.parallel import parallelize_module
    from trifuse.parallel.styles import ColwiseParallel

    def make(dtype):
        model = LinearAct(act, conv1d=conv1d).to(dtype)
        parallelize_module(model, mesh, {"fc": ColwiseParallel(output_layouts=output_layouts)})
        return model

    return make


@pytest.mark.parametrize("make_act, conv1d, expected", [
    (nn.GELU, False, "linear_gelu_on_shards"),
    (lambda: nn.GELU(approximate="tanh"), False, "linear_gelu_on_shards"),
    (lambda: Act(new_gelu), True, "conv1d_bias_gelu_on_shards"),
    (lambda: Act(new_gelu), False, "linear_bias_gelu_on_shards"),
    (lambda: Act(quick_gelu), False, "linear_bias_gelu_on_shards"),
    (lambda: Act(quick_gelu), True, "conv1d_bias_gelu_on_shards"),
    (nn.ReLU, False, "linear_relu_on_shards"),
    (lambda: _hf_activation("relu2"), False, "linear_bias_gelu_on_shards"),
], ids=["linear-nn.GELU", "linear-nn.GELU-tanh", "conv1d-new-gelu", "linear-new-gelu", "linear-quick-gelu",
        "conv1d-quick-gelu", "linear-nn.ReLU", "linear-relu2"])
def test_column_parallel_bias_moves_into_the_gelu(one_rank_mesh, make_act, conv1d, expected):
    report = check_sharded_against_unfused(_colwise(one_rank_mesh, make_act(), conv1d), X)
    assert report.by_pattern() == {expected: 1}, report.by_pattern()


def test_column_parallel_output_not_on_its_columns_keeps_the_bias(one_rank_mesh):
    """The output replicated (gathered) before the GeLU: the local bias would not be its columns'."""
    from torch.distributed.tensor import Replicate

    report = check_sharded_against_unfused(_colwise(one_rank_mesh, nn.GELU(), output_layouts=Replicate()), X)
    assert "linear_gelu_on_shards" not in report.by_pattern()
    assert any(pattern == "linear_gelu_on_shards" and "not sharded over the output features alike" in why
               for _, _, pattern, why in report.rejected()), report.rejected()


def test_column_parallel_output_not_on_its_columns_keeps_the_bias_of_a_written_out_gelu(one_rank_mesh):
    """The same for QuickGELU written out: one op without bias, the bias stays in the linear."""
    from torch.distributed.tensor import Replicate

    make = _colwise(one_rank_mesh, Act(quick_gelu), output_layouts=Replicate())
    report = check_sharded_against_unfused(make, X)
    assert report.by_pattern() == {"gelu_quick_written_out": 1}, report.by_pattern()
    assert any(pattern == "linear_bias_gelu_on_shards" and "not sharded over the output features alike" in why
               for _, _, pattern, why in report.rejected()), report.rejected()


class BartFFN(nn.Module):
    """BART's and Pegasus' feed-forward: `fc2(dropout(gelu(fc1(x)), activation_dropout))`."""

    def __init__(self, p=0.0, act=None):
        super().__init__()
        self.fc1 = nn.Linear(N, 24)
        self.fc2 = nn.Linear(24, N)
        self.p = p
        self.act = act or nn.GELU()

    def forward(self, x):
        h = F.dropout(self.act(self.fc1(x)), p=self.p, training=self.training)
        return self.fc2(h)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh"), Act(new_gelu), nn.ReLU()],
                         ids=["erf", "tanh", "written-out-tanh", "relu"])
def test_an_activation_dropout_moves_into_the_op(act, capture):
    """After the bias moved in: p and the training flag carried (p = 0 in training here, against
    the unfused model)."""
    report = check_against_unfused(lambda: BartFFN(act=act), X, capture, train=True)
    assert report.by_pattern() == {"bias_gelu_dropout": 1}, report.table()
    assert report.counts() == {"bias_gelu": 1}
    assert not [left for left in report.left() if left[2] == "dropout"], report.table()


@pytest.mark.parametrize("capture", CAPTURES)
def test_the_dropout_in_the_op_drops_and_keeps_like_the_model(capture):
    """p = 1 drops every activation (fc2's bias alone comes out); eval keeps them all; p = 0.5 in
    training runs trifuse's dropout kernels."""
    ffn = BartFFN(p=1.0)
    model = fuse_via(ffn.train(), capture)
    x = torch.randn(2, 5, N)
    inner = ffn if capture == "fx" else model.blocks[0].inner
    torch.testing.assert_close(model(x), inner.fc2.bias.detach().expand(2, 5, N), rtol=0, atol=0)
    model.eval()
    with torch.no_grad():
        want = inner.fc2(F.gelu(inner.fc1(x)))
    torch.testing.assert_close(model(x), want)
    half = fuse_via(BartFFN(p=0.5).train(), capture)
    h = torch.randn(4, 50, N)
    ran = trifuse_ops_run(lambda: half(h).sum().backward())
    assert "trifuse::bias_gelu_dropout" in ran or "trifuse::bias_gelu_dropout_backward" in ran


# ---------------------------------------------------------------------------------------------
# ReLU MLPs (OPT, T5, DETR, nn.TransformerEncoderLayer): the op's relu form, where a linear's
# bias moves in or a dropout in training follows; a ReLU alone stays torch.relu.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("act", [nn.ReLU(), Act(F.relu), Act(torch.relu), Act(lambda x: x.relu())],
                         ids=["nn.ReLU", "F.relu", "torch.relu", "method"])
def test_relu_after_a_biased_linear_takes_its_bias(act, capture):
    """OPT's fc1 + ReLU. The oracle would catch a GeLU form in its place (they differ by up to 0.17)."""
    report = check_against_unfused(lambda: LinearAct(act), X, capture)
    assert report.by_pattern() == {"linear_relu": 1}, report.table()


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make", [lambda: LinearAct(nn.ReLU(), bias=False),
                                  lambda: LinearAct(nn.ReLU(inplace=True))], ids=["no-bias", "in-place"])
def test_relu_alone_or_in_place_is_left(make, capture):
    """Without a bias to take or a dropout to fold, a ReLU is one kernel already; the in-place
    ReLU writes the linear's output, which the op would not."""
    assert check_against_unfused(make, X, capture).by_pattern() == {}


class T5DenseActDense(nn.Module):
    """The original T5's feed-forward: `wo(dropout(relu(wi(x))))`, neither linear biased."""

    def __init__(self, p=0.0):
        super().__init__()
        self.wi = nn.Linear(N, 24, bias=False)
        self.wo = nn.Linear(24, N, bias=False)
        self.act = nn.ReLU()
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return self.wo(self.dropout(self.act(self.wi(x))))


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_relus_dropout_in_training_becomes_the_op_without_bias(capture):
    """T5's ReLU and dropout are one op in training: p = 1 drops everything (zeros out), eval and
    p = 0 keep the ReLU as written (the dropout drops nothing), and p = 0.5 runs trifuse's
    dropout kernels."""
    x = torch.randn(2, 5, N)
    model = fuse_via(T5DenseActDense(p=1.0).train(), capture)
    torch.testing.assert_close(model(x), torch.zeros(2, 5, N), rtol=0, atol=0)
    assert trifuse.report(model).by_pattern() == {"relu_dropout": 1}, trifuse.report(model).table()
    model.eval()
    inner = model if capture == "fx" else model.blocks[0].inner
    with torch.no_grad():
        torch.testing.assert_close(model(x), inner.wo(torch.relu(inner.wi(x))))
    assert trifuse.report(model).by_pattern() == {}
    report = check_against_unfused(lambda: T5DenseActDense(p=0.0), X, capture, train=True)
    assert report.by_pattern() == {}
    assert any(pattern == "relu_dropout" and "p is 0" in why for _, _, pattern, why in report.rejected()), \
        report.rejected()
    half = fuse_via(T5DenseActDense(p=0.5).train(), capture)
    ran = trifuse_ops_run(lambda: half(torch.randn(4, 50, N)).sum().backward())
    assert "trifuse::bias_gelu_dropout" in ran or "trifuse::bias_gelu_dropout_backward" in ran


# ---------------------------------------------------------------------------------------------
# The squared ReLU (Nemotron, Persimmon, Fuyu, Arcee, nanochat; modded-nanoGPT): the op's relu2
# form, with the linear's bias where there is one and without where there is none.
# ---------------------------------------------------------------------------------------------


def relu_square_method(x):  # modded-nanoGPT's MLP
    return F.relu(x).square()


def relu_to_the_power_2(x):
    return torch.relu(x) ** 2


def relu_times_itself(x):
    r = F.relu(x)
    return r * r


def relus_product(x):  # two ReLU nodes: the normalizer makes no square of them
    return F.relu(x) * torch.relu(x)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [
    (lambda: LinearAct(_hf_activation("relu2")), "linear_bias_gelu"),
    (lambda: LinearAct(Act(relu_square_method)), "linear_bias_gelu"),
    (lambda: LinearAct(Act(relu_to_the_power_2)), "linear_bias_gelu"),
    (lambda: LinearAct(Act(relu_times_itself)), "linear_bias_gelu"),
    (lambda: LinearAct(_hf_activation("relu2"), conv1d=True), "conv1d_bias_gelu"),
    (lambda: AddmmAct(Act(relu_square_method)), "addmm_bias_gelu"),
    (lambda: LinearAct(_hf_activation("relu2"), bias=False), "relu_squared"),
    (lambda: _hf_activation("relu2"), "relu_squared"),
], ids=["hf-ReLUSquaredActivation", "square-method", "power-2", "times-itself", "conv1d", "addmm", "no-bias",
        "alone"])
def test_squared_relu_is_the_relu2_form(make, pattern, capture):
    """Persimmon's dense_h_to_4h + relu2 is one op with the bias; Nemotron's unbiased up_proj's
    relu2 one op without. The oracle would catch relu for relu2 (they differ by far more than
    fp32's bound)."""
    assert check_against_unfused(make, X, capture).by_pattern() == {pattern: 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_squared_relu_runs_the_relu2_kernels(capture):
    model = fuse_via(LinearAct(_hf_activation("relu2"), bias=False), capture)
    calls = []
    real = trifuse.ops.bias_gelu

    def spy(x, bias=None, approximate="none", p=0.0, training=True):
        calls.append(approximate)
        return real(x, bias, approximate, p, training)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trifuse.ops, "bias_gelu", spy)
        x = X[0].clone().requires_grad_()
        names = trifuse_ops_run(lambda: model(x).sum().backward())
    assert calls and set(calls) == {"relu2"}, calls
    assert {"trifuse::bias_gelu", "trifuse::bias_gelu_backward"} <= names, names


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("act, expected", [
    (Act(relus_product), {"relu_mul": 1}),
    (Act(lambda x: torch.relu(x) ** 3), {"linear_relu": 1}),
    (Act(lambda x: torch.relu(x).square().sqrt()), {"linear_bias_gelu": 1}),
], ids=["two-relus", "cube", "square-used-again"])
def test_what_is_not_a_squared_relu_is_not_relu2(act, expected, capture):
    """Two ReLU nodes multiplied are a ReGLU of the linear's output by its own ReLU (gated_activation),
    another power keeps its ReLU (which takes the bias) and the power as written; a squared ReLU
    whose square feeds something else is still relu2 (the square is the op's output)."""
    assert check_against_unfused(lambda: LinearAct(act), X, capture).by_pattern() == expected


@pytest.mark.parametrize("capture", CAPTURES)
def test_squared_relu_of_an_integer_tensor_is_left_with_a_reason(capture):
    """The op is for floating point: an integer relu(x)^2 stays as written, and the report says why."""

    class IntegerSquare(nn.Module):
        def forward(self, x):
            return x + torch.square(torch.relu(x.round().to(torch.int64))).to(x.dtype)

    report = check_against_unfused(IntegerSquare, X, capture)
    assert report.by_pattern() == {}, report.table()
    assert any(pattern == "relu_squared" and "int64" in why for _, _, pattern, why in report.rejected()), \
        report.rejected()


@pytest.mark.parametrize("capture", CAPTURES)
def test_squared_relus_dropout_in_training_moves_into_the_op(capture):
    """fc2(dropout(relu2(fc1 x))): the bias and the dropout both move in (p = 1 drops all)."""
    model = fuse_via(nn.Sequential(nn.Linear(N, 24), _hf_activation("relu2"), nn.Dropout(1.0),
                                   nn.Linear(24, N, bias=False)).train(), capture)
    torch.testing.assert_close(model(X[0]), torch.zeros(2, 5, N), rtol=0, atol=0)
    assert trifuse.report(model).counts() == {"bias_gelu": 1}, trifuse.report(model).table()
