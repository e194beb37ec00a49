"""torch.compile(model, backend="trifuse") and backend="trifuse_inductor": the pattern library
inside torch.compile. Outputs and gradients equal eager by the oracle rule; fullgraph and
dynamic shapes work; graph breaks in user code are fine; the backends are found by entry point
in a process that never imports trifuse."""
import copy
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import _models
import _random_blocks as rb
import pytest
import torch
import trifuse
from _device import ON_GPU
from _fusing import FAMILY_OPS, RecordPostGrad, has_op, needs_ops, op_names, trifuse_ops_run
from tolerances import assert_close

MODELS = {
    "gpt2": lambda: _models.gpt2(layers=1),
    "bert": lambda: _models.bert(layers=1),
    "vit": lambda: _models.vit(layers=1),
    "encoder": lambda: _models.transformer_encoder(norm_first=True, layers=1),
}
EXPECTED = {  # families each model's graphs must show (those whose op this build has)
    # GPT-2's loss is compiled as a graph of its own, after a graph break, reading no parameter
    "gpt2": ("attention", "bias_gelu", "residual_stream", "cross_entropy"),
    "bert": ("attention", "bias_gelu", "residual_stream", "cross_entropy"),
    "vit": ("attention", "bias_gelu", "residual_stream"),
    "encoder": ("attention", "bias_gelu", "residual_stream"),
}


def _double(kw):
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}


def _trains_like_eager(model, compiled, ref, ref64, loss_fn, kw) -> None:
    """One more step of `compiled` (`model` compiled) against copies of the model taken before:
    loss and every gradient by the oracle rule (float64 `ref64`, the dtype's own `ref`)."""
    model.zero_grad()
    loss, lowp, loss64 = loss_fn(compiled, kw), loss_fn(ref, kw), loss_fn(ref64, _double(kw))
    for value in (loss, lowp, loss64):
        value.backward()
    assert_close("loss", loss, loss64, lowp)
    for (pname, p), p64, pr in zip(model.named_parameters(), ref64.parameters(), ref.parameters()):
        if p64.grad is not None:
            assert_close(f"grad {pname}", p.grad, p64.grad, pr.grad)


@pytest.mark.parametrize("backend", ["trifuse", "trifuse_inductor"])
@pytest.mark.parametrize("name", list(MODELS))
def test_backend_matches_eager(name, backend):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = torch.compile(model, backend=backend)
    kw = inputs(2, 8)
    names = trifuse_ops_run(lambda: loss_fn(compiled, kw).backward())
    _trains_like_eager(model, compiled, ref, ref64, loss_fn, kw)
    counts = trifuse.report(compiled).counts()
    for family in EXPECTED[name]:
        if has_op(FAMILY_OPS[family]):
            assert counts.get(family), f"{family} not replaced: {counts}"
            assert any(n.startswith(f"trifuse::{FAMILY_OPS[family]}") for n in names), sorted(names)


@pytest.mark.parametrize("backend", ["trifuse", "trifuse_inductor"])
def test_backend_folds_a_dit_blocks_gated_add_into_its_modulated_norm(backend):
    """DiT's adaLN-Zero blocks (tests/_random_blocks.py) compiled: the modulated norms and the gated
    residual adds before them run as trifuse's registered ops inside the compiled graphs; loss and
    every gradient (the conditioning's included) by the oracle rule."""
    import _random_blocks as rb

    torch.manual_seed(0)
    model = rb.AdaptiveModel("dit")
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    x, cond = rb.adaptive_inputs()

    def loss_fn(m, *inputs):
        return m(*inputs).square().mean()

    compiled = torch.compile(model, backend=backend)
    names = trifuse_ops_run(lambda: loss_fn(compiled, x, cond).backward())
    assert {"trifuse::grouped_norm", "trifuse::gated_grouped_norm"} <= names, sorted(names)
    model.zero_grad()
    loss, lowp = loss_fn(compiled, x, cond), loss_fn(ref, x, cond)
    loss64 = loss_fn(ref64, x.double(), cond.double())
    for value in (loss, lowp, loss64):
        value.backward()
    assert_close("loss", loss, loss64, lowp)
    for (pname, p), p64, pr in zip(model.named_parameters(), ref64.parameters(), ref.parameters()):
        assert_close(f"grad {pname}", p.grad, p64.grad, pr.grad)
    assert trifuse.report(compiled).by_pattern().get("gated_add_layer_norm_modulate", 0) >= 2


@pytest.mark.parametrize("backend", ["trifuse", "trifuse_inductor"])
def test_backend_keeps_a_channels_last_resnet_in_its_layout(backend):
    """A ResNet model (tests/_random_blocks.py: GroupNorm + SiLU before each conv) converted to
    channels_last, compiled: its norms run as trifuse::group_norm on the channels-last activations
    (the op's fake gives Inductor the kernels' strides: y channels-last), the output keeps the
    eager layout, and loss and every gradient match the float64 model by the oracle rule."""
    import _random_blocks as rb

    model = rb.resnet_model("gn_module", "nn_silu", channels_last=True)
    ref, ref64 = copy.deepcopy(model), rb.resnet_float64_twin(copy.deepcopy(model).double())
    # x requires grad: PyTorch's own CPU GroupNorm backward (the unfused references) segfaults on
    # a channels-last input whose gradient is not wanted (torch 2.11 and 2.13)
    x, temb = (t.requires_grad_() for t in rb.resnet_inputs(channels_last=True))
    compiled = torch.compile(model, backend=backend)
    names = trifuse_ops_run(lambda: compiled(x, temb).square().mean().backward())
    assert "trifuse::group_norm" in names, sorted(names)
    model.zero_grad()
    out, lowp, out64 = compiled(x, temb), ref(x, temb), ref64(x.double(), temb.double())
    assert out.stride() == lowp.stride()
    losses = [o.square().mean() for o in (out, lowp, out64)]
    for value in losses:
        value.backward()
    assert_close("loss", losses[0], losses[2], losses[1])
    for (pname, p), p64, pr in zip(model.named_parameters(), ref64.parameters(), ref.parameters()):
        assert_close(f"grad {pname}", p.grad, p64.grad, pr.grad)
    assert trifuse.report(compiled).counts() == {"group_norm": 4}


def _fullgraph_works(model, kw, backend):
    try:
        torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)(**kw)
    except torch._dynamo.exc.Unsupported:
        return False
    return True


@pytest.mark.parametrize("backend", ["trifuse", "trifuse_inductor"])
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_fullgraph_introduces_no_graph_break(name, backend):
    torch.manual_seed(0)
    model, inputs, _ = MODELS[name]()
    kw = {k: v for k, v in inputs(2, 8).items() if k != "labels"}
    if not _fullgraph_works(model, kw, "eager"):
        pytest.skip("the model itself breaks the graph in this transformers version")
    out = torch.compile(model, backend=backend, fullgraph=True)(**kw)
    torch.testing.assert_close(out.logits, model(**kw).logits)
    assert trifuse.report(model).counts().get("attention", 0) >= 1 or not has_op("attention")


@pytest.mark.parametrize("backend", ["trifuse", "trifuse_inductor"])
def test_dynamic_shapes_compile_once(backend):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["gpt2"]()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for i, (batch, seq) in enumerate([(2, 8), (3, 5), (4, 11)]):
        kw = inputs(batch, seq)
        # After the first call, a new shape must not recompile (Dynamo raises if it would).
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            torch.testing.assert_close(loss_fn(compiled, kw), loss_fn(model, kw))
    assert trifuse.report(compiled).counts().get("attention", 0) >= 1 or not has_op("attention")


def _layer_norm_written_out(x, w, b):
    u = x.mean(-1, keepdim=True)
    return (x - u) * torch.rsqrt((x - u).pow(2).mean(-1, keepdim=True) + 1e-6) * w + b


def _layer_norm_bare(x):
    u = x.mean(-1, keepdim=True)
    return (x - u) / torch.sqrt((x - u).pow(2).mean(-1, keepdim=True) + 1e-5)


def _rms_norm_over_channels(x, w):  # timm's RmsNorm2d
    return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * w.reshape(1, -1, 1, 1)


@needs_ops("layer_norm", "rms_norm")
@pytest.mark.parametrize("backend", ["trifuse", "trifuse_inductor"])
@pytest.mark.parametrize("fn, shapes, family", [
    (_layer_norm_written_out, [(3, 7), (5, 9)], "layer_norm"),
    (_layer_norm_bare, [(3, 7), (2, 4, 9)], "layer_norm"),
    (_rms_norm_over_channels, [(2, 5, 3, 4), (3, 6, 2, 5)], "rms_norm"),
], ids=["weight_and_bias", "bare", "over_channels"])
def test_norms_of_a_symbolic_width_fuse_under_dynamic_shapes(fn, shapes, family, backend):
    # dynamic=True with no parameter fixing the normalized width: the width is symbolic. The fused
    # op reads it off x in the graph (it was once rejected as SymInts, and written into the graph
    # as the number it had when matched), and the weight folds without a guard on it (comparing
    # it with int() specialized the width: every new width recompiled).
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for i, shape in enumerate(shapes):
        torch.manual_seed(i)
        width = shape[1] if fn is _rms_norm_over_channels else shape[-1]
        args = [torch.randn(shape, dtype=torch.float64).float().requires_grad_()]
        args += [torch.randn(width).requires_grad_() for _ in range(fn.__code__.co_argcount - 1)]
        args64 = [a.detach().double().requires_grad_() for a in args]
        args32 = [a.detach().clone().requires_grad_() for a in args]
        new_rank = i > 0 and len(shape) != len(shapes[0])  # a new rank is a new graph
        with torch._dynamo.config.patch(error_on_recompile=i > 0 and not new_rank), warnings.catch_warnings():
            warnings.filterwarnings("error", message="Raw SymInt")
            out = compiled(*args)
            grads = torch.autograd.grad(out.square().sum(), args)
        ref, ref64 = fn(*args32), fn(*args64)
        assert_close("out", out, ref64, ref)
        for name, g, g64, gr in zip("xwb", grads, torch.autograd.grad(ref64.square().sum(), args64),
                                    torch.autograd.grad(ref.square().sum(), args32)):
            assert_close(f"grad {name}", g, g64, gr)
        assert trifuse.report(compiled).counts() == {family: 1}
    assert trifuse.report(fn).counts() == {family: 1}


# Relative positions written into the scores through a slice (MViT V2's, torchvision's MViT's):
# the pass that makes them a sum padded its example values, which equated the capture's batch and
# sequence with the first call's (every new size recompiled); a GQA chain beside them.
@needs_ops("attention")
@pytest.mark.parametrize("attention", ["chain_slice_positions", "chain_slice_positions_inplace",
                                       "chain_gqa_expand"])
def test_rewritten_graphs_compile_once_under_dynamic_shapes(attention):
    torch._dynamo.reset()
    model = rb.random_model(rb.Spec(attention=attention, dropout=0.0)).eval()
    compiled = torch.compile(model, backend="trifuse", dynamic=True)
    for i, (batch, seq) in enumerate([(2, 7), (3, 9), (4, 5)]):
        x, lengths = rb.inputs(batch=batch, seq=seq)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(x, lengths)
        torch.testing.assert_close(out, model(x, lengths))
    assert trifuse.report(compiled).counts().get("attention") == 2


def _two_norms_and_a_graph_break(x):
    y = torch.nn.functional.layer_norm(x, x.shape[-1:])
    torch._dynamo.graph_break()
    return torch.nn.functional.rms_norm(y.relu(), y.shape[-1:])


@needs_ops("layer_norm", "rms_norm")
def test_report_of_a_compiled_function():
    torch._dynamo.reset()
    compiled = torch.compile(_two_norms_and_a_graph_break, backend="trifuse")
    x = torch.randn(4, 24)
    torch.testing.assert_close(compiled(x), _two_norms_and_a_graph_break(x))
    # both graphs, the one after the graph break too, whether asked of the wrapper or the function
    for target in (compiled, _two_norms_and_a_graph_break):
        report = trifuse.report(target)
        assert report.counts() == {"layer_norm": 1, "rms_norm": 1}
        assert len(report.compiled) == 2 and "layer_norm" in str(report)
    assert trifuse.report(_double).compiled == []  # a function never compiled: nothing
    with pytest.raises(TypeError, match=r"trifuse\.report: model must be a torch\.nn\.Module or a function"):
        trifuse.report(42)


def test_graph_breaks_in_user_code():
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.quirky()
    kw = inputs(2, 8)
    compiled = torch.compile(model, backend="trifuse")
    torch.testing.assert_close(loss_fn(compiled, kw), loss_fn(model, kw))
    report = trifuse.report(compiled)
    assert len(report.compiled) >= 2 and report.counts().get("layer_norm")


class _BrokenBlock(torch.nn.Module):
    """A block that breaks the graph in its middle: Dynamo compiles its two halves as frames of
    their own, whose graphs every block of the model runs."""

    def __init__(self, h):
        super().__init__()
        self.ln, self.fc, self.drop = torch.nn.LayerNorm(h), torch.nn.Linear(h, h), torch.nn.Dropout(0.1)

    def forward(self, x):
        h = self.ln(x)
        torch._dynamo.graph_break()
        return x + self.drop(self.fc(h))


class _BrokenBlocks(torch.nn.Module):
    def __init__(self, h=_models.HIDDEN):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(h, h), torch.nn.LayerNorm(h)
        self.b0, self.b1, self.b2 = (_BrokenBlock(h) for _ in range(3))

    def forward(self, x):
        return self.out(self.b2(self.b1(self.b0(self.inp(x)))))


@needs_ops("layer_norm", "dropout_add")
def test_report_counts_each_run_of_a_compiled_graph_in_the_latest_forward():
    # A graph break inside every block: one compiled frame per half block, run by all three
    # blocks. The report counts what the latest forward ran (3 layer norms of the blocks' graph
    # and the model's own), lists each graph once with its runs, and after model.eval() the eval
    # graphs, not the training graph that no longer runs.
    torch._dynamo.reset()
    x = torch.randn(2, 5, _models.HIDDEN)
    model = _BrokenBlocks()
    compiled = torch.compile(model, backend="trifuse")
    compiled(x).sum().backward()
    report = trifuse.report(compiled)
    assert report.counts() == {"layer_norm": 4, "dropout_add": 3}
    assert [runs for _, runs in report.compiled_runs].count(3) == 2
    assert "ran 3 time(s) in the latest forward" in report.table()
    training = {c.mode for c, _ in report.compiled_runs}
    model.eval()
    compiled(x)
    report = trifuse.report(compiled)
    assert report.counts() == {"layer_norm": 4, "dropout_add": 3}
    eval_modes = {c.mode for c, _ in report.compiled_runs}
    assert eval_modes != training and len(report.compiled) > len(report.compiled_runs)
    # a second model of the class runs the same graphs without compiling any: found by its parameters
    other = _BrokenBlocks()
    torch.compile(other, backend="trifuse")(x)
    assert trifuse.report(other).counts() == {"layer_norm": 4, "dropout_add": 3}


@needs_ops("layer_norm", "dropout_add")
def test_report_counts_blocks_compiled_one_by_one():
    # Regional compilation (block.compile() on each block, the model's own forward eager): each
    # block counted once, with the graphs that ran for it.
    torch._dynamo.reset()
    model = _BrokenBlocks()
    for block in (model.b0, model.b1, model.b2):
        block.compile(backend="trifuse")
    x = torch.randn(2, 5, _models.HIDDEN)
    model(x)
    model(x)
    assert trifuse.report(model).counts() == {"layer_norm": 3, "dropout_add": 3}


def test_compiling_a_fused_model_rewrites_the_whole_graph():
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["vit"]()
    ref = copy.deepcopy(model)
    trifuse.fuse(model)
    kw = inputs(2, 8)
    torch.testing.assert_close(loss_fn(torch.compile(model, backend="trifuse"), kw), loss_fn(ref, kw))
    assert trifuse.report(model).compiled  # the fused units stepped aside for the compiled graph


def test_trifuse_backend_reduce_overhead_matches_eager(monkeypatch):
    # CUDA graphs over AOTAutograd: the rewritten graph's trifuse ops traced as registered ops,
    # forward and backward (on CPU the graphs run without CUDA graphs, the rest is the same path)
    from torch._dynamo.backends import cudagraphs as cg

    handed = []
    real = cg.cudagraphs
    monkeypatch.setattr(cg, "cudagraphs", lambda gm, inputs: handed.append(gm) or real(gm, inputs))
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS["gpt2"]()
    ref = copy.deepcopy(model)
    kw = inputs(2, 8)
    compiled = torch.compile(model, backend="trifuse", mode="reduce-overhead")
    loss, ref_loss = loss_fn(compiled, kw), loss_fn(ref, kw)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert trifuse.report(compiled).counts().get("layer_norm", 0) >= 1
    # what was handed to the CUDA-graph backend is the rewritten graph
    assert handed and any("trifuse" in getattr(n.target, "__module__", "") or "trifuse" in str(n.target)
                          for gm in handed for n in gm.graph.nodes)


@pytest.mark.parametrize("kwargs, words", [
    ({"mode": "max-autotune"}, "mode must be one of 'default', 'reduce-overhead', got 'max-autotune'"),
    ({"options": {"max_autotune": True}}, "takes no options, got ['max_autotune']"),
])
def test_trifuse_backend_names_what_it_does_not_take(kwargs, words):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with pytest.raises(Exception, match=re.escape(words)) as info:
        torch.compile(model, backend="trifuse", **kwargs)(torch.randn(2, 8))
    assert "trifuse_inductor" in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["trifuse", "trifuse_inductor"])
def test_reduce_overhead_replays_fresh_dropout_masks(backend):
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2(dropout=0.1, layers=1)
    model.cuda()
    compiled = torch.compile(model, backend=backend, mode="reduce-overhead")
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs(2, 16).items()}
    losses = [loss_fn(compiled, kw).item() for _ in range(4)]
    assert len(set(losses)) > 1, "every replay must draw new dropout masks"


ENTRY_POINT = """
import sys, torch
assert "trifuse" not in sys.modules
names = torch._dynamo.list_backends()
assert "trifuse" in names and "trifuse_inductor" in names, names
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
x = torch.randn(4, 8)
out = torch.compile(model, backend="trifuse")(x)
torch.testing.assert_close(out, model(x))
assert "trifuse" in sys.modules  # Dynamo imported it through the entry point
print("ok")
"""


def test_entry_point_found_without_importing_trifuse():
    """The torch_dynamo_backends entry point declared in setup.py, from a fresh process."""
    package = Path(trifuse.__file__).resolve().parent
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", tmp], cwd=package,
                       check=True, capture_output=True, timeout=120)
        assert "torch_dynamo_backends" in (Path(tmp) / "trifuse.egg-info" / "entry_points.txt").read_text()
        importable = Path(trifuse.__file__).parent.parent  # the folder holding the `trifuse` package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(importable)])}
        out = subprocess.run([sys.executable, "-c", ENTRY_POINT], env=env, capture_output=True, text=True,
                             timeout=300, cwd=tmp, check=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


pytestmark = pytest.mark.skipif(not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU runs use Triton's interpreter (tests/_device.py)")


def test_inductor_failing_on_the_rewritten_graph_compiles_it_unfused(monkeypatch, caplog):
    """Never break a model: if Inductor cannot compile the rewritten graph, the graph as
    captured is compiled instead, and the report says why."""
    import torch._inductor.compile_fx as cfx

    real = cfx.compile_fx

    def picky(gm, example_inputs, **kw):
        if "trifuse_capture" in gm.meta:  # the rewritten graph
            raise RuntimeError("no lowering for this op")
        return real(gm, example_inputs, **kw)

    monkeypatch.setattr(cfx, "compile_fx", picky)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    x = torch.randn(3, 8)
    compiled = torch.compile(model, backend="trifuse_inductor")
    torch.testing.assert_close(compiled(x), model(x))
    report = trifuse.report(compiled)
    assert "Inductor failed on the rewritten graph" in report.table() and not report.counts()
    assert "compiled unfused" in caplog.text


class _UserPass:
    """A post-grad pass a user configured, with or without the uuid Inductor's caches need."""

    def __init__(self, uuid):
        self.ran, self._uuid = 0, uuid

    def __call__(self, graph):
        self.ran += 1


@pytest.mark.parametrize("user_pass", [None, "keyed", "unkeyed"])
def test_inductor_caches_are_keyed_on_trifuse_source(monkeypatch, user_pass):
    """Inductor's caches key a graph on its code, which names a trifuse op but not what its fake
    implementation returns: the backend hands Inductor a post-grad pass that changes nothing and
    whose uuid carries the hash of trifuse's source, so a cache warmed by an older trifuse is not
    read (a changed output shape of the attention op failed `as_strided` on such a cache, and
    fell back to the unfused graph). A pass the user configured is chained, and keys as before."""
    from torch._inductor.custom_graph_pass import CustomGraphPass
    import torch._inductor.compile_fx as cfx
    from trifuse.fusion import backend

    configured = None
    if user_pass is not None:
        configured = (type("Keyed", (_UserPass, CustomGraphPass), {"uuid": lambda self: self._uuid})
                      if user_pass == "keyed" else _UserPass)("user-1")
    seen = []
    real = cfx.compile_fx
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, inputs, **kw: seen.append(kw.get("config_patches"))
                        or real(gm, inputs, **kw))
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    x = torch.randn(3, 8)
    options = {} if configured is None else {"post_grad_custom_post_pass": configured}
    compiled = torch.compile(model, backend="trifuse_inductor", options=options)
    torch.testing.assert_close(compiled(x), model(x))
    keyed = seen[0]["post_grad_custom_post_pass"]
    assert isinstance(keyed, CustomGraphPass)
    if user_pass != "unkeyed":
        assert keyed.uuid() == ("trifuse", backend.source_hash(), True, *(["user-1"] if configured else []))
    else:
        assert keyed.uuid() is None  # Inductor bypasses its caches, as for the user's pass alone
    if configured is not None:  # chained (Inductor runs no pass when its cache hits, so call it here)
        ran = configured.ran
        keyed(torch.fx.Graph())
        assert configured.ran == ran + 1


def test_source_hash_follows_the_package_source_only(tmp_path):
    from trifuse.fusion.backend import source_hash

    for name in ("__init__.py", "kernels/attention.py", "tests/test_x.py", "bench/b.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    before = source_hash(tmp_path)
    (tmp_path / "tests/test_x.py").write_text("x = 2\n")
    (tmp_path / "bench/b.py").write_text("x = 2\n")
    source_hash.cache_clear()
    assert source_hash(tmp_path) == before
    (tmp_path / "kernels/attention.py").write_text("x = 2\n")
    source_hash.cache_clear()
    assert source_hash(tmp_path) != before


class _CheckpointedBlocks(torch.nn.Module):
    """A model that checkpoints its blocks itself (torch.utils.checkpoint in its forward)."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        h = _models.HIDDEN
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(h), torch.nn.Linear(h, 2 * h), torch.nn.GELU(), torch.nn.Linear(2 * h, h),
            torch.nn.Dropout(0.2)) for _ in range(2))
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            if self.checkpointed:
                x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = x + block(x)
        return x


def test_trifuse_backend_fuses_inside_checkpoints_and_recomputes_the_same_dropout():
    # Dynamo puts each checkpointed call into a tag_activation_checkpoint op; backend="trifuse"
    # rewrites its body and runs it with torch.utils.checkpoint keeping the RNG state, so the
    # recompute draws the forward's dropout masks (torch's dropout here: no add follows it inside
    # the body), and the gradients equal those of the model run eagerly from the same seed.
    torch.manual_seed(0)
    model = _CheckpointedBlocks(checkpointed=True).to(_models.DEVICE)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 5, _models.HIDDEN, device=_models.DEVICE)
    compiled = torch.compile(model, backend="trifuse")
    for m in (compiled, ref):
        torch.manual_seed(7)
        m(x).square().sum().backward()
    for (name, p), pr in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, pr.grad, rtol=1e-4, atol=1e-5, msg=name)
    if has_op("bias_gelu"):
        assert trifuse.report(compiled).counts().get("bias_gelu") == 2


@pytest.mark.parametrize("choice", ["sdpa-math", "sdpa-cudnn"])
def test_inductor_runs_what_the_attention_dialect_chose(monkeypatch, choice):
    """backend="trifuse_inductor": a traced call has no dialect key, so the choice is made while
    compiling, on stand-ins of the call's shapes, and an SDPA candidate's backend is forced while
    AOTAutograd traces (its own aten op, forward and backward, in the compiled graph). On a CPU no
    SDPA candidate is eligible; here the dialect is made to choose one: the math backend (not
    the CPU's fused op; Inductor's attention patterns, which would fuse math's ops back into it,
    off), or cuDNN's, which a CPU refuses while tracing: math runs, never a failed compile."""
    from torch._inductor import config as inductor_config
    from trifuse.autotune.dialects import Candidate
    from trifuse.fusion import backend as B
    from trifuse.kernels.attention import ATTENTION

    chosen = Candidate(choice, lambda *a: None)
    monkeypatch.setattr(ATTENTION, "candidates", (*ATTENTION.candidates, chosen))
    monkeypatch.setattr(ATTENTION, "implementation", lambda *args: chosen.fn)
    monkeypatch.setitem(B._SDPA_BACKENDS, "sdpa-math", "MATH")
    monkeypatch.setattr(B, "_DIALECT_DEVICES", ("cuda", "cpu"))
    record = RecordPostGrad()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2(layers=1)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = torch.compile(model, backend="trifuse_inductor")
    kw = inputs(2, 8)
    with inductor_config.patch(post_grad_custom_pre_pass=record, pattern_matcher=choice != "sdpa-math"):
        names = trifuse_ops_run(lambda: loss_fn(compiled, kw).backward())
    assert not any(n.startswith("trifuse::attention") for n in names), sorted(names)
    assert any(n.startswith("trifuse::") for n in names)  # the rest of the block stays fused
    if choice == "sdpa-math":
        assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in record.targets
        assert "aten.bmm.default" in record.targets
    table = trifuse.report(compiled).table()
    assert f"runs {choice}, the attention dialect's choice for (2, 2, 8, 16)" in table, table
    _trains_like_eager(model, compiled, ref, ref64, loss_fn, kw)


def test_inductor_traces_sdpa_as_cpus_fused_op_by_default():
    """The control of the test above: unforced, AOTAutograd traces a CPU's SDPA into its fused op,
    so the op's absence there says the forced backend took the call."""
    import torch.nn.functional as F
    from torch._inductor import config as inductor_config

    record = RecordPostGrad()
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 4, 8, 8, requires_grad=True) for _ in range(3))
    f = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), backend="inductor")
    with inductor_config.patch(post_grad_custom_pre_pass=record):
        f(q, k, v).sum().backward()
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in record.targets, record.targets


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_inductor_asks_the_dialect_on_stand_ins_of_each_call(monkeypatch, name):
    """The dialect itself, on stand-ins of the calls' values (BERT's: a broadcast bool mask): on a
    CPU it keeps trifuse's op, and nothing fails on the way (a failure would be reported)."""
    from trifuse.fusion import backend as B
    from trifuse.kernels.attention import ATTENTION

    asked, choosing = [], []
    real, real_choice = ATTENTION.implementation, B.attention_as_chosen

    def implementation(*args):
        if choosing:  # not the op's own runs, which ask too
            asked.append([(tuple(a.shape), a.stride(), a.dtype, a.requires_grad)
                          if isinstance(a, torch.Tensor) else a for a in args])
        return real(*args)

    def attention_as_chosen(*args, **kwargs):
        choosing.append(True)
        try:
            return real_choice(*args, **kwargs)
        finally:
            choosing.pop()

    monkeypatch.setattr(ATTENTION, "implementation", implementation)
    monkeypatch.setattr(B, "attention_as_chosen", attention_as_chosen)
    monkeypatch.setattr(B, "_DIALECT_DEVICES", ("cuda", "cpu"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    compiled = torch.compile(model, backend="trifuse_inductor")
    names = trifuse_ops_run(lambda: loss_fn(compiled, inputs(2, 8)).backward())
    assert any(n.startswith("trifuse::attention") for n in names)
    assert len(asked) == 1, asked
    q, k, v, mask = asked[0][:4]
    assert q[0] == (2, 2, 8, 16) and q[3] and v[2] == torch.float32
    if name == "bert":
        assert mask[:3] == ((2, 1, 8, 8), (64, 64, 8, 1), torch.bool)  # transformers' padding mask
    else:
        assert mask is None  # the causal mask became is_causal
    assert "no dialect choice" not in trifuse.report(compiled).table()


def test_stand_ins_keep_shape_layout_and_broadcast():
    from trifuse.fusion.backend import _stand_in

    base = torch.randn(2, 8, 3, 4, 16).transpose(1, 3)[:, :, 0]  # a view of a fused QKV projection
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool).expand(2, 1, 8, 8)
    for value in (base.requires_grad_(False), mask, torch.zeros(1, 1, 8, 8, dtype=torch.float16)):
        t = _stand_in(value)
        assert (t.shape, t.stride(), t.dtype) == (value.shape, value.stride(), value.dtype)
    assert bool(_stand_in(mask).all())


@pytest.mark.parametrize("mode, options, graphed", [
    (None, None, False), ("reduce-overhead", None, True), (None, {"triton.cudagraphs": True}, True)])
def test_inductor_chooses_attention_by_graph_time_under_cuda_graphs(monkeypatch, mode, options, graphed):
    """Inductor's CUDA graphs hide the host paths: the attention choice is then by GPU time in a
    graph (the dialect's graphed choices), otherwise by wall time."""
    from trifuse.fusion import backend as B

    seen = []
    monkeypatch.setattr(B, "attention_as_chosen", lambda gm, log, graphed=False: seen.append(graphed))
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 4)
    torch.compile(model, backend="trifuse_inductor", mode=mode, options=options)(torch.randn(2, 4))
    assert seen == [graphed]


def _compiled_run(monkeypatch, direct: str):
    """One training step of a one-block GPT-2 with dropout, through backend="trifuse_inductor"
    with TRIFUSE_DIRECT_OPS=`direct`: (the names of the ops it ran, its loss and gradients)."""
    monkeypatch.setenv("TRIFUSE_DIRECT_OPS", direct)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs, loss_fn = _models.gpt2(dropout=0.1, layers=1)
    compiled = torch.compile(model.train(), backend="trifuse_inductor")
    kw = inputs(2, 8)
    loss_fn(compiled, kw).backward()  # compiles the forward and backward graphs
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = loss_fn(compiled, kw)
        loss.backward()
    return set(op_names(prof)), [loss.detach(), *(p.grad for p in model.parameters())]


def test_inductor_graphs_call_the_ops_direct_twins(monkeypatch):
    """Inductor's compiled forward and backward call each trifuse op's direct twin (the same body
    without the registered op's Python autograd and checking layers, which only cost host time
    there), and compute bitwise what the registered ops compute, dropout masks included. With
    TRIFUSE_DIRECT_OPS=0 the graphs call the registered ops."""
    names, values = _compiled_run(monkeypatch, "1")
    registered_names, registered_values = _compiled_run(monkeypatch, "0")
    twins = {n.split("::")[1] for n in names if n.startswith("trifuse_direct::")}
    ops = {n.split("::")[1] for n in registered_names if n.startswith("trifuse::")}
    expected = {"attention", "attention_backward", "dropout_add_layer_norm", "layer_norm_backward",
                "bias_gelu"}
    assert expected <= ops, " ".join(sorted(ops))
    assert twins == ops, (twins, ops)
    assert not any(n.startswith("trifuse::") for n in names), sorted(n for n in names if "trifuse" in n)
    assert not any(n.startswith("trifuse_direct::") for n in registered_names)
    for got, want in zip(values, registered_values, strict=True):
        assert torch.equal(got, want)


def test_every_registered_op_has_a_direct_twin():
    """Same schema and tags as the op; the same outputs, and the same fake."""
    from torch._library.custom_ops import OPDEFS
    from torch._subclasses.fake_tensor import FakeTensorMode
    from trifuse.fusion.backend import DIRECT_NAMESPACE, direct_ops

    twins = direct_ops()
    ops = {d._opoverload for q, d in OPDEFS.items() if q.startswith("trifuse::")}
    assert len(ops) > 30 and set(twins) == ops
    for op, twin in twins.items():
        assert str(twin._schema) == str(op._schema).replace("trifuse::", f"{DIRECT_NAMESPACE}::", 1)
        assert twin.tags == op.tags
    op = torch.ops.trifuse.layer_norm.default
    args = (torch.randn(3, 5, 24), [24], torch.randn(24), torch.randn(24), 1e-5)
    for got, want in zip(twins[op](*args), op(*args), strict=True):
        assert torch.equal(got, want)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        got, want = twins[op](*fake), op(*fake)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]


WARM_CACHE = """
import torch
from torch._dynamo.utils import counters
import trifuse
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
x = torch.randn(4, 8, requires_grad=True)
compiled = torch.compile(model, backend="trifuse_inductor")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    out = compiled(x)
    out.sum().backward()
torch.testing.assert_close(out, model(x))
twins = sorted({e.name for e in prof.events() if e.name.startswith("trifuse_direct::")})
print("hits", counters["inductor"]["fxgraph_cache_hit"], "twins", " ".join(twins))
"""


def test_inductor_code_from_a_warm_cache_finds_the_twins(tmp_path):
    """Code Inductor cached in one process calls the twins in the next, which defines them before
    Inductor loads it: a process that compiles the same graph runs the cached code."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TRITON_INTERPRET": "1"}
    runs = [subprocess.run([sys.executable, "-c", WARM_CACHE], env=env, capture_output=True, text=True,
                           timeout=600, cwd=tmp_path, check=False) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    (cold, warm) = (run.stdout.strip().splitlines()[-1].split() for run in runs)
    assert cold[1] == "0" and int(warm[1]) >= 2, (cold, warm)  # the forward's and the backward's code
    twins = ["trifuse_direct::bias_gelu", "trifuse_direct::bias_gelu_backward", "trifuse_direct::layer_norm",
             "trifuse_direct::layer_norm_backward"]
    assert cold[3:] == warm[3:] == twins, (cold, warm)
