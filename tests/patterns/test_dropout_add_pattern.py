"""Dropout + residual add, either way round, with the bias of the linear before folded in."""
import pytest
import torch
import torch.nn.functional as F
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


# ---------------------------------------------------------------------------------------------
# The gated add no norm follows: a diffusion transformer block's end, a LayerScale
# ---------------------------------------------------------------------------------------------

COND = (torch.randn(2, 5, N), torch.randn(2, N))


class GatedEnd(nn.Module):
    """h + gate * f(norm(h)), the gate one vector per sample from a conditioning linear (adaLN's),
    in the spellings models write; `cast` the fp32 forms of a 16-bit stream (Wan's, ACE-Step's).
    The norm stands for the rest of a block: fuse captures a module for the ops models write
    (stages 0 and 1), and the gated add is found in that capture."""

    def __init__(self, spelling="gate_first", bias=True, cast=None):
        super().__init__()
        self.norm = nn.LayerNorm(N)
        self.fc = nn.Linear(N, N, bias=bias)
        self.ada = nn.Linear(N, N)
        self.spelling, self.cast = spelling, cast

    def forward(self, h, cond):
        gate = self.ada(cond)
        if self.cast is not None:
            gate = gate.float()
        f = self.fc(self.norm(h))
        if self.cast == "wan_ff":
            return (h.float() + f.float() * gate[:, None]).type_as(h)
        if self.cast == "wan_attn":
            return (h.float() + f * gate[:, None]).type_as(h)
        if self.cast == "promoted":
            return (h + f * gate[:, None]).type_as(h)
        if self.spelling == "gate_first":
            return h + gate.unsqueeze(1) * f
        if self.spelling == "x_first":
            return h + f * gate[:, None]
        return gate[:, None] * f + h  # sum_reversed


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, pattern", [
    (GatedEnd, "linear_gated_add"),
    (lambda: GatedEnd("x_first"), "linear_gated_add"),
    (lambda: GatedEnd("sum_reversed"), "linear_gated_add"),
    (lambda: GatedEnd(bias=False), "gated_add"),
], ids=["gate-first", "x-first", "sum-reversed", "no-bias"])
def test_gated_spelling_fuses_and_matches(make, pattern, capture):
    report = check_against_unfused(make, COND, capture)
    assert report.by_pattern() == {"layer_norm": 1, pattern: 1}, report.table()


@pytest.mark.parametrize("cast", ["wan_ff", "wan_attn", "promoted"])
def test_gated_add_in_fp32_cast_back_to_a_16_bit_stream(cast):
    """Wan's `(h.float() + ff_out.float() * gate).type_as(h)` (and its attention's, ACE-Step's
    promoted sum) with an fp32 gate beside an fp16 stream: the op's fp32 product and sum rounded
    once to fp16, as the model's."""
    def make():
        model = GatedEnd(cast=cast).half()
        model.ada.float()
        return model
    inputs = (COND[0].half(), COND[1])
    report = check_against_unfused(make, inputs, "dynamo")
    assert report.by_pattern().get("linear_gated_add") == 1, report.table()


class LayerScaleEnd(nn.Module):
    """A LayerScale (CaiT, DINOv2, ConvNeXt): x + gamma * f(x), gamma one (N,) parameter."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(N)
        self.fc = nn.Linear(N, N)
        self.gamma = nn.Parameter(torch.full((N,), 0.1) + torch.rand(N))

    def forward(self, x):
        return x + self.gamma * self.fc(self.norm(x))


@pytest.mark.parametrize("capture", CAPTURES)
def test_layer_scale_fuses_as_a_gated_add(capture):
    assert check_against_unfused(LayerScaleEnd, X, capture).by_pattern() == {"layer_norm": 1, "linear_gated_add": 1}


class NotGated(nn.Module):
    """Sums of products that are no gated add: a scalar per position (the op would copy it to full
    size), an fp32 gate that widens a 16-bit sum (the model's result is fp32), a residual of
    another shape, a recurrent scan's 2-D steps (many small calls, where the op's host path would
    cost more than it saves)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(N)
        self.fc = nn.Linear(N, N, bias=False)
        self.pos = nn.Parameter(torch.randn(1, 5, 1))

    def forward(self, h, cond):
        f = self.fc(self.norm(h))
        if self.kind == "per-position":
            return h + self.pos * f
        if self.kind == "wider-gate":
            return h + cond.float()[:, None] * f
        if self.kind == "scan-step":  # a recurrent scan's (B, N) steps (RWKV's, RecurrentGemma's)
            state = f[:, 0]
            for t in range(1, f.shape[1]):
                state = f[:, t] + torch.sigmoid(h[:, t]) * state
            return state
        return h[:, :1] + cond[:, None] * f  # broadcast residual


@pytest.mark.parametrize("kind", ["per-position", "wider-gate", "broadcast-residual", "scan-step"])
def test_sums_of_products_that_are_no_gated_add_stay(kind):
    def make():
        model = NotGated(kind)
        return model.half() if kind == "wider-gate" else model
    inputs = (COND[0].half(), COND[1].half()) if kind == "wider-gate" else COND
    report = check_against_unfused(make, inputs, "dynamo")
    assert report.by_pattern().get("layer_norm") == 1, report.table()  # the block was captured
    assert "gated_add" not in report.by_pattern() and "linear_gated_add" not in report.by_pattern()


def test_gated_trifuse_op_runs():
    model = fuse_via(GatedEnd(), "dynamo")
    h = COND[0].clone().requires_grad_()
    ran = trifuse_ops_run(lambda: model(h, COND[1]).sum().backward())
    assert "trifuse::gated_dropout_add" in ran and "trifuse::gated_dropout_add_backward" in ran


# ---------------------------------------------------------------------------------------------
# The gated add per token: FLUX.3's and Qwen-Image 2.1's block ends, gate (B, S, N)
# ---------------------------------------------------------------------------------------------

TOKEN_COND = (torch.randn(2, 5, N) * 2, torch.randn(2, 5, N))


class PerTokenEnd(nn.Module):
    """A block's end with a gate per token, a chunk of a per-token projection of the conditioning
    (B, S, N): FLUX.3's `h + gate * (attn + ff)` ("flux3"), one sublayer's `h + gate * fc(...)`
    ("linear"), Helios' fp32 gate beside its stream, cast back ("fp32_cast"), MiniMax H3's gate per
    position shared by the batch ("per_position"), a scalar per token ("scalar_per_token":
    broadcast, kept as written)."""

    def __init__(self, kind="linear"):
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(N)
        self.fc = nn.Linear(N, N)
        self.ff = nn.Linear(N, N, bias=False)
        self.ada = nn.Linear(N, 3 * N)
        self.scalar = nn.Linear(N, 1)

    def forward(self, h, cond):
        shift, scale, gate = self.ada(F.silu(cond)).chunk(3, dim=-1)
        if self.kind == "fp32_cast":  # gate fp32 (ada kept in fp32), the stream 16-bit
            return (h.float() + self.fc(self.norm(h)) * gate).type_as(h)
        n = self.norm(h) * (1 + scale) + shift
        if self.kind == "flux3":
            return h + gate * (self.fc(n) + self.ff(n))
        if self.kind == "scalar_per_token":
            return h + self.scalar(cond) * self.fc(n)
        if self.kind == "per_position":  # MiniMax H3's: one gate row per position, shared by the batch
            return h + gate[0] * self.fc(n)
        return h + gate * self.fc(n)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("kind, pattern", [("linear", "linear_gated_add"), ("flux3", "gated_add"),
                                           ("per_position", "linear_gated_add")])
def test_a_per_token_gate_at_the_block_end_fuses(kind, pattern, capture):
    """The per-token gated add no norm follows: one op, the gate read as the chunk it is, every
    gradient the unfused model's."""
    report = check_against_unfused(lambda: PerTokenEnd(kind), TOKEN_COND, capture, train=True)
    assert report.by_pattern().get(pattern) == 1, report.table()
    assert report.counts().get("dropout_add") == 1, report.table()


def test_a_per_token_fp32_gate_cast_back_to_a_16_bit_stream_fuses():
    """Helios' `(h.float() + out * gate).type_as(h)` with a per-token fp32 gate beside an fp16 stream:
    the op's fp32 product and sum rounded once to fp16, as the model's."""
    def make():
        model = PerTokenEnd("fp32_cast").half()
        model.ada.float()
        return model
    report = check_against_unfused(make, (TOKEN_COND[0].half(), TOKEN_COND[1]), "dynamo", train=True)
    assert report.counts().get("dropout_add") == 1, report.table()


def test_a_scalar_gate_per_token_stays_as_written():
    """(B, S, 1): the op would copy it to full size first; PyTorch's product broadcasts it free."""
    report = check_against_unfused(lambda: PerTokenEnd("scalar_per_token"), TOKEN_COND, "dynamo", train=True)
    assert "dropout_add" not in report.counts(), report.table()


def test_per_token_gated_trifuse_op_runs():
    model = fuse_via(PerTokenEnd(), "dynamo")
    h = TOKEN_COND[0].clone().requires_grad_()
    ran = trifuse_ops_run(lambda: model(h, TOKEN_COND[1]).sum().backward())
    assert "trifuse::gated_dropout_add_rows" in ran and "trifuse::gated_dropout_add_rows_backward" in ran


class SumInsideVmap(nn.Module):
    """A sum of a full-size product inside torch.vmap (Mamba's `associative_scan` runs its combine
    function so), and one outside it."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(N)
        self.fc = nn.Linear(N, N, bias=False)

    def forward(self, h):
        f = self.fc(self.norm(h))
        inside = torch.vmap(lambda a, b, c: a + b * c)(h, f, torch.sigmoid(h))
        return inside + torch.tanh(f) * h


def test_nothing_inside_a_torch_func_transform_is_rewritten():
    """Dynamo inlines vmap's body into the block's graph; trifuse's ops have no batching rule, so
    the sum inside stays as written and the one outside fuses; the answer is the unfused model's."""
    report = check_against_unfused(SumInsideVmap, X, "dynamo", train=True)
    assert report.by_pattern() == {"layer_norm": 1, "gated_add": 1}, report.table()


class ParallelBlock(nn.Module):
    """GPT-J's, GPT-NeoX's and Phi's parallel block: `dropout(attn(h)) + dropout(mlp(h)) + x`, h the
    block's norm of x; `then_norm` adds the next block's norm on the sum (a whole model in one
    graph, as torch.compile captures it)."""

    def __init__(self, p=0.0, bias=True, order="branches_first", then_norm=False):
        super().__init__()
        self.norm = nn.LayerNorm(N)
        self.attn = nn.Linear(N, N, bias=bias)
        self.mlp = nn.Linear(N, N, bias=bias)
        self.attn_drop, self.mlp_drop = nn.Dropout(p), nn.Dropout(p)
        self.next_norm = nn.LayerNorm(N) if then_norm else None
        self.order = order

    def forward(self, x):
        h = self.norm(x)
        a, m = self.attn_drop(self.attn(h)), self.mlp_drop(self.mlp(h))
        s = a + m + x if self.order == "branches_first" else x + (m + a)
        return s if self.next_norm is None else self.next_norm(s)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("make, patterns", [
    (ParallelBlock, {"layer_norm": 1, "linear_dropout_add": 2}),
    (lambda: ParallelBlock(order="residual_first"), {"layer_norm": 1, "linear_dropout_add": 2}),
    (lambda: ParallelBlock(bias=False), {"layer_norm": 1, "parallel_dropouts_add": 2}),
    (lambda: ParallelBlock(then_norm=True), {"layer_norm": 1, "linear_dropout_add": 1, "linear_residual_norm": 1}),
    (lambda: ParallelBlock(order="residual_first", then_norm=True),
     {"layer_norm": 1, "linear_dropout_add": 1, "linear_residual_norm": 1}),
    (lambda: ParallelBlock(bias=False, then_norm=True), {"layer_norm": 1, "parallel_dropouts_add_norm": 2}),
], ids=["branches+residual", "residual+branches", "no-bias", "then-norm", "residual-first-then-norm",
        "no-bias-then-norm"])
def test_a_parallel_blocks_two_dropouts_both_fuse(make, patterns, capture):
    """The sum taken the other way round, `dropout_add(attn, dropout_add(mlp, x))`, each dropout the
    op's; each op counted apart, in its own family."""
    report = check_against_unfused(make, X, capture, train=True)
    assert report.by_pattern() == patterns, report.table()
    then_norm = "linear_residual_norm" in patterns or "parallel_dropouts_add_norm" in patterns
    assert report.counts() == ({"layer_norm": 1, "dropout_add": 1, "residual_stream": 1} if then_norm else
                               {"layer_norm": 1, "dropout_add": 2}), report.table()
    assert not [left for left in report.left() if left[2] == "dropout"], report.table()


def test_a_parallel_blocks_dropouts_draw_apart_and_backward_reuses_their_masks():
    """attn(h) = 1 and mlp(h) = 2 everywhere, p = 0.5: each kept value doubles, so the sum less x is
    0, 2, 4 or 6, and all four show only if the two masks are drawn apart. Each bias's gradient is
    then the count of its kept values (times 2): the backward regenerates the forward's masks."""
    block = ParallelBlock(p=0.5)
    with torch.no_grad():
        for lin, value in ((block.attn, 1.0), (block.mlp, 2.0)):
            lin.weight.zero_()
            lin.bias.fill_(value)
    model = fuse_via(block.train(), "fx")
    x = torch.randn(4, 50, N)
    z = model(x)
    drops = (z - x).detach()
    torch.testing.assert_close(drops, drops.round(), rtol=0, atol=1e-5)
    values = set(drops.round().flatten().tolist())
    assert values == {0.0, 2.0, 4.0, 6.0}, values
    z.sum().backward()
    kept_attn = drops.round().remainder(4) == 2  # 2 or 6
    kept_mlp = drops.round() >= 4
    torch.testing.assert_close(block.attn.bias.grad, 2.0 * kept_attn.sum((0, 1)).float())
    torch.testing.assert_close(block.mlp.bias.grad, 2.0 * kept_mlp.sum((0, 1)).float())
    assert trifuse.report(model).counts().get("dropout_add") == 2
