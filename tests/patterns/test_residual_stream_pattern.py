"""The residual stream: add (+ dropout) feeding a norm becomes dropout_add_layer_norm, with the
bias of the linear before it folded in; pre-norm and post-norm; p and training carried. A norm
feeding the add (OLMo 2's and Gemma 2's post-sublayer norms) becomes layer_norm_add."""
import copy

import pytest
import torch
import torch.nn.functional as F
import trifuse
from _fusing import check_against_unfused, check_sharded_against_unfused, fuse_via, trifuse_ops_run
from _hf_norms import GemmaRMSNorm, HFRMSNorm, OlmoLayerNorm, T5LayerNorm
from tolerances import assert_close
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


class BertLayerNorm(nn.Module):
    """The LayerNorm of BERT ports from before `nn.LayerNorm` (pytorch-pretrained-bert), written
    out: mean, biased variance, divided by the root, then weight * x + bias."""

    def __init__(self, hidden_size, eps=1e-12):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden_size))
        self.bias = nn.Parameter(0.1 * torch.randn(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class WrittenOutPostNorm(PostNorm):
    def __init__(self, p=0.0):
        super().__init__(p)
        self.LayerNorm = BertLayerNorm(N)


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


class ReshapedPreNorm(nn.Module):
    """OPT's MLP half: the sum flattened to rows before the norm, and carried on flat."""

    def __init__(self, flat=(-1, N), norm_dim=N):
        super().__init__()
        self.fc = nn.Linear(N, N)
        self.drop = nn.Dropout(0.0)
        self.ln = nn.LayerNorm(norm_dim)
        self.flat = flat

    def forward(self, x):
        h = (x + self.drop(self.fc(x))).reshape(self.flat)
        return self.ln(h) * 2.0, h


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, expected", [
    (PreNorm, {"layer_norm": 1, "linear_residual_norm": 1}),
    (lambda: PreNorm(bias=False), {"layer_norm": 1, "dropout_add_layer_norm": 1}),
    (lambda: PreNorm(norm=nn.RMSNorm), {"rms_norm": 1, "linear_residual_norm": 1}),
    # Norms computed on an fp32 copy and cast back (Gemma, OLMo) or T5's: the add still fuses.
    (lambda: PreNorm(norm=GemmaRMSNorm), {"rms_norm_in_fp32": 1, "linear_residual_norm": 1}),
    (lambda: PreNorm(norm=OlmoLayerNorm), {"layer_norm_in_fp32": 1, "linear_residual_norm": 1}),
    (PostNorm, {"linear_residual_norm": 1}),
    (WrittenOutPostNorm, {"linear_residual_norm": 1}),
    (Conv1DPostNorm, {"conv1d_residual_norm": 1}),
    (ReshapedPreNorm, {"linear_residual_norm": 1}),
    # the reshape merges the normalized dim with another: it does not commute with the norm
    (lambda: ReshapedPreNorm(flat=(2, -1), norm_dim=5 * N), {"layer_norm": 1, "linear_dropout_add": 1}),
    (AddmmPostNorm, {"addmm_residual_norm": 1}),
    (lambda: AddmmPostNorm(bias_shape=(10, N)), {"dropout_add_layer_norm": 1}),  # 2-D bias stays in the addmm
], ids=["pre-norm", "pre-norm-no-bias", "pre-norm-rms", "pre-norm-gemma", "pre-norm-olmo",
        "post-norm-bert", "post-norm-bert-written-out-layernorm",
        "post-norm-conv1d", "pre-norm-reshaped-opt", "pre-norm-reshape-merging-dims",
        "post-norm-addmm", "post-norm-addmm-2d-bias"])
def test_spelling_fuses_and_matches(make, expected, capture):
    assert check_against_unfused(make, X, capture).by_pattern() == expected


def test_t5_layernorm_fuses_with_the_add_through_dynamo():
    # T5LayerNorm branches on its weight's dtype, which fx cannot trace: a block holding it is
    # captured whole only by Dynamo (as Hugging Face blocks are); through fx each norm fuses alone.
    assert check_against_unfused(lambda: PreNorm(norm=T5LayerNorm), X, "dynamo").by_pattern() == \
        {"rms_norm_t5": 1, "linear_residual_norm": 1}
    assert check_against_unfused(lambda: PreNorm(norm=T5LayerNorm), X, "fx").by_pattern() == {"rms_norm_t5": 2}


def test_add_without_dropout():
    class AddNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(N)

        def forward(self, x, y):
            return self.ln(x + y)

    report = check_against_unfused(AddNorm, (torch.randn(2, 5, N), torch.randn(2, 5, N)), "dynamo")
    assert report.by_pattern() == {"add_layer_norm": 1}


class ReshapedPreNormShapeKept(ReshapedPreNorm):
    """OPT's whole MLP half: the sum's shape taken before it is flattened, the flat result viewed
    back to it. Under dynamic shapes Dynamo writes that shape as a `size()` of the sum, a use of
    the pattern's intermediate outside it."""

    def forward(self, x):
        s = x + self.drop(self.fc(x))
        shape = s.shape
        h = s.reshape(-1, N)
        return (self.ln(h) * 2.0 + h).view(shape)


def test_a_second_sequence_length_keeps_the_reshaped_residual_stream():
    # The second length makes Dynamo recapture with the sequence dim symbolic: the sum's size()
    # then reads x's (provably the same shape) and the add still fuses with the norm.
    torch.manual_seed(0)
    model = ReshapedPreNormShapeKept()
    ref64 = copy.deepcopy(model).double()
    fused = fuse_via(model, "dynamo")
    for s in (5, 7):
        x = torch.randn(2, s, N)
        assert_close(f"output, {s} positions", fused(x), ref64(x.double()), model(x))
        assert trifuse.report(fused).by_pattern() == {"linear_residual_norm": 1}, trifuse.report(fused).by_pattern()
    assert trifuse.report(fused).counts() == {"residual_stream": 1}


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
# Norm, then add: y = residual + norm(sublayer(x))
# ---------------------------------------------------------------------------------------------


class NormThenAdd(nn.Module):
    """OLMo 2's block half: `residual + post_attention_layernorm(o_proj(...))`. `sandwich`: Gemma 2's,
    where the sum then goes through the next sublayer's pre-norm too (and on as the residual)."""

    def __init__(self, norm=nn.RMSNorm, sandwich=False, norm_first=False):
        super().__init__()
        self.fc = nn.Linear(N, N)
        self.post, self.pre = norm(N), norm(N)
        self.sandwich, self.norm_first = sandwich, norm_first

    def forward(self, x):
        h = self.post(self.fc(x))
        s = h + x if self.norm_first else x + h
        if self.sandwich:
            return self.pre(s) * 2.0, s
        return s


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, expected", [
    (NormThenAdd, {"rms_norm_add": 1}),
    (lambda: NormThenAdd(norm_first=True), {"rms_norm_add": 1}),
    (lambda: NormThenAdd(norm=nn.LayerNorm), {"layer_norm_add": 1}),
    (lambda: NormThenAdd(norm=HFRMSNorm), {"rms_norm_add": 1}),
    (lambda: NormThenAdd(norm=OlmoLayerNorm), {"layer_norm_add": 1}),
    # the first norm goes into the add, the second stays a norm (not add_rms_norm: that grouping
    # would write the first norm's output and read it back)
    (lambda: NormThenAdd(norm=GemmaRMSNorm, sandwich=True), {"rms_norm_add": 1, "rms_norm_in_fp32": 1}),
    (lambda: NormThenAdd(sandwich=True), {"rms_norm_add": 1, "rms_norm": 1}),
], ids=["olmo2", "norm-first", "layer-norm", "hf-rms", "olmo-layer-norm", "gemma2-sandwich", "sandwich"])
def test_norm_then_add_fuses_and_matches(make, expected, capture):
    report = check_against_unfused(make, X, capture)
    assert report.by_pattern() == expected
    assert report.counts().get("residual_stream") == 1


def test_norm_then_add_runs_one_trifuse_op_each_way():
    model = fuse_via(NormThenAdd(), "dynamo")
    x = X[0].clone().requires_grad_()
    model(x)  # the capture (its tracing runs ops on fake tensors) before the profiled call
    ran = trifuse_ops_run(lambda: model(x).sum().backward())
    assert {"trifuse::rms_norm_add", "trifuse::rms_norm_add_backward"} <= ran
    assert "trifuse::rms_norm" not in ran


class NormOutputUsedTwice(NormThenAdd):
    def forward(self, x):
        h = self.post(self.fc(x))
        return x + h, h


class NormThenBroadcastAdd(NormThenAdd):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 5, N))

    def forward(self, x):
        return self.pos + self.post(self.fc(x))


@pytest.mark.parametrize("capture", CAPTURES)
def test_norm_output_used_elsewhere_stays_a_norm(capture):
    assert check_against_unfused(NormOutputUsedTwice, X, capture).by_pattern() == {"rms_norm": 1}


@pytest.mark.parametrize("capture", CAPTURES)
def test_norm_then_broadcast_add_is_rejected(capture):
    report = check_against_unfused(NormThenBroadcastAdd, X, capture)
    assert report.by_pattern() == {"rms_norm": 1}
    assert any(pattern == "rms_norm_add" and "broadcast" in reason for _, _, pattern, reason in report.rejected())


class HalfResidual(NormThenAdd):
    def forward(self, x):
        return x.half() + self.post(self.fc(x))


@pytest.mark.parametrize("make, pattern", [
    (lambda: NormThenAdd(norm=GemmaRMSNorm), "rms_norm_add"),
    (lambda: NormThenAdd(norm=HFRMSNorm), "rms_norm_weight_apart_add"),
    (lambda: HalfResidual(norm=HFRMSNorm), None),
], ids=["gemma-cast-back", "llama-weight-apart", "fp16-residual"])
def test_norm_then_add_in_fp16_under_autocast(make, pattern):
    """Autocast's mix: the fp16 linear output normed (fp32 weights) and added to the residual.
    Gemma's norm casts back to fp16, Llama's multiplies its fp32 weight last (stage 0 keeps the
    weight apart); either way the op returns fp32 as the model's add does. With an fp16 residual
    and Llama's norm the model's sum is fp32 and the op's would be fp16: left as it is."""
    torch.manual_seed(0)
    model = make()
    fused = fuse_via(copy.deepcopy(model), "dynamo")
    x = X[0]
    with torch.autocast("cpu", dtype=torch.float16):
        out, ref = fused(x), model(x)
    assert out.dtype == ref.dtype == torch.float32
    found = trifuse.report(fused).by_pattern()
    if pattern is None:
        assert not any(name.endswith("norm_add") for name in found), found
        assert any(p == "rms_norm_weight_apart_add" and "would be torch.float16" in reason
                   for _, _, p, reason in trifuse.report(fused).rejected())
        return
    assert found.get(pattern) == 1, found
    exact = copy.deepcopy(model).double()
    assert_close("y", out, exact.post(exact.fc(x.double()).half().double()) + x.double(), ref)


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


# ---------------------------------------------------------------------------------------------
# Under sequence parallelism: the add on local sequence shards, the norm on a DTensor made of
# them (what trifuse.parallel's styles put between the two). One process, a mesh of one rank;
# tests/parallel/test_fused_shard.py runs GPT-2 and BERT on two.
# ---------------------------------------------------------------------------------------------


class OnShards(nn.Module):
    """Pre-norm residual stream as sequence parallelism captures it: s = residual + dropout(x)
    on local tensors (dropout=False: no dropout call); y = norm(from_local(s, placement)) with
    replicated weights; s goes on as a local tensor."""

    def __init__(self, mesh, placement, dropout=True, rms=False):
        super().__init__()
        self.mesh, self.placement, self.dropout, self.rms = mesh, placement, dropout, rms
        self.weight = nn.Parameter(torch.randn(N))
        self.bias = nn.Parameter(torch.randn(N))

    def norm_on_shards(self, local: torch.Tensor) -> torch.Tensor:
        """The norm on a DTensor made of the local shards, its output made local again."""
        from torch.distributed.tensor import DTensor, Replicate

        rows = DTensor.from_local(local, self.mesh, (self.placement,), run_check=False)
        w = DTensor.from_local(self.weight, self.mesh, (Replicate(),), run_check=False)
        if self.rms:
            return F.rms_norm(rows, (N,), w, 1e-6).to_local()
        b = DTensor.from_local(self.bias, self.mesh, (Replicate(),), run_check=False)
        return F.layer_norm(rows, (N,), w, b, 1e-5).to_local()

    def forward(self, x, residual):
        s = residual + (F.dropout(x, 0.0, self.training) if self.dropout else x)
        return self.norm_on_shards(s) * 3.0, s


def _on_shards_against_unfused(mesh, placement, **kwargs):
    inputs = (torch.randn(2, 6, N), torch.randn(2, 6, N))
    return check_sharded_against_unfused(lambda dtype: OnShards(mesh, placement, **kwargs).to(dtype), inputs)


@pytest.mark.parametrize("dropout", [True, False], ids=["dropout_add", "add"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_on_sequence_shards_fuses(one_rank_mesh, dropout, rms):
    from torch.distributed.tensor import Shard

    report = _on_shards_against_unfused(one_rank_mesh, Shard(1), dropout=dropout, rms=rms)
    name = ("dropout_" if dropout else "") + ("add_rms_norm" if rms else "add_layer_norm") + "_on_shards"
    assert report.by_pattern() == {name: 1}, report.by_pattern()


def _placement(name):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {"Shard(2)": Shard(2), "Shard(-1)": Shard(-1), "Replicate()": Replicate(),
            "Partial()": Partial()}[name]


@pytest.mark.parametrize("placement, reason", [
    ("Shard(2)", "is a normalized dim, not a row dim"),
    ("Shard(-1)", "is a normalized dim, not a row dim"),
    ("Replicate()", "no mesh dim shards the rows"),
    ("Partial()", "is neither a shard of rows nor a replica"),
])
def test_on_shards_needs_row_shards(one_rank_mesh, placement, reason):
    report = _on_shards_against_unfused(one_rank_mesh, _placement(placement))
    # Each stays its own op: the norm, and the dropout + add on the local tensors.
    assert report.by_pattern() == {"layer_norm": 1, "dropout_add": 1}, report.by_pattern()
    assert any(pattern == "dropout_add_layer_norm_on_shards" and reason in why
               for _, _, pattern, why in report.rejected()), report.rejected()


class ReshapedOnShards(OnShards):
    """OPT's MLP half under sequence parallelism: the local sum flattened to rows, the norm on a
    DTensor of them sharded on dim 0 (trifuse.parallel's reading of Shard(1) on 2-D tensors)."""

    def forward(self, x, residual):
        s = (residual + F.dropout(x, 0.0, self.training)).reshape(-1, N)
        return self.norm_on_shards(s) * 3.0, s


@pytest.mark.parametrize("placement, expected", [
    ("Shard(0)", {"dropout_add_reshape_layer_norm_on_shards": 1}),
    # the flattened sum's dim 1 is the normalized one
    ("Shard(1)", {"layer_norm": 1, "dropout_add": 1}),
])
def test_reshaped_sum_on_sequence_shards(one_rank_mesh, placement, expected):
    from torch.distributed.tensor import Shard

    layout = {"Shard(0)": Shard(0), "Shard(1)": Shard(1)}[placement]
    inputs = (torch.randn(2, 6, N), torch.randn(2, 6, N))
    report = check_sharded_against_unfused(lambda dtype: ReshapedOnShards(one_rank_mesh, layout).to(dtype), inputs)
    assert report.by_pattern() == expected, report.by_pattern()
    if placement == "Shard(1)":
        assert any(pattern == "dropout_add_reshape_layer_norm_on_shards" and "is a normalized dim" in why
                   for _, _, pattern, why in report.rejected()), report.rejected()


class NormThenAddOnShards(OnShards):
    """The post-norm residual add as trifuse.parallel's sequence parallelism writes it: the norm on
    a DTensor made of the local shards, its output made local again, then the add (Gemma 2's
    sandwich norms, OLMo 2's post-norms)."""

    def __init__(self, mesh, placement, rms=False):
        super().__init__(mesh, placement, dropout=False, rms=rms)

    def forward(self, x, residual):
        return (residual + self.norm_on_shards(x)) * 3.0


def _norm_then_add_on_shards(mesh, placement, rms):
    inputs = (torch.randn(2, 6, N), torch.randn(2, 6, N))
    return check_sharded_against_unfused(lambda dtype: NormThenAddOnShards(mesh, placement, rms).to(dtype), inputs)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_norm_then_add_on_sequence_shards_fuses(one_rank_mesh, rms):
    from torch.distributed.tensor import Shard

    report = _norm_then_add_on_shards(one_rank_mesh, Shard(1), rms)
    name = ("rms_norm" if rms else "layer_norm") + "_add_on_shards"
    assert report.by_pattern() == {name: 1}, report.by_pattern()


@pytest.mark.parametrize("placement, reason", [
    ("Shard(-1)", "is a normalized dim, not a row dim"),
    ("Replicate()", "no mesh dim shards the rows"),
])
def test_norm_then_add_on_shards_needs_row_shards(one_rank_mesh, placement, reason):
    report = _norm_then_add_on_shards(one_rank_mesh, _placement(placement), False)
    assert report.by_pattern() == {"layer_norm": 1}, report.by_pattern()
    assert any(pattern == "layer_norm_add_on_shards" and reason in why
               for _, _, pattern, why in report.rejected()), report.rejected()
