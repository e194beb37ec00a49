"""The layer_norm_modulate dialect wired into trifuse.ops.layer_norm_modulate: trifuse's kernels or
PyTorch's norm, product and sum, chosen with a fake timer here (on the GPU: measured). Whichever
runs, the result is bitwise that implementation's, in the op's dtype; traced calls always see
trifuse::grouped_norm."""
import pytest
import torch
import trifuse
from _device import DEVICE
from trifuse.kernels import adaptive_norm as an

N = 48


@pytest.fixture
def modulate_dialect(cache_dir, monkeypatch):
    an.LAYER_NORM_MODULATE.clear()
    monkeypatch.setattr(an.LAYER_NORM_MODULATE, "timer", None)
    yield an.LAYER_NORM_MODULATE
    an.LAYER_NORM_MODULATE.clear()


def inputs(dtype=torch.float32, samples=2, tokens=3):
    x = torch.randn(samples, tokens, N, device=DEVICE, dtype=dtype, requires_grad=True)
    scale, shift = (torch.randn(samples, N, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
    return x, scale, shift


def fwd_bwd(fn, x, scale, shift):
    y = fn(x, (N,), 1 + scale[:, None], shift[:, None], None, None, 1e-6, False)
    dy = torch.randn(y.shape, generator=torch.Generator(device=y.device).manual_seed(1), device=y.device,
                     dtype=y.dtype)
    return (y, *torch.autograd.grad(y, (x, scale, shift), dy))


def public(x, ns, mul, add, w, b, eps, rms):
    return trifuse.ops.layer_norm_modulate(x, ns, mul, add, w, b, eps, is_rms_norm=rms)


@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_the_measured_winner_runs_bitwise(modulate_dialect, timer, monkeypatch, winner):
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(modulate_dialect, "timer", fake)
    x, scale, shift = inputs()
    got = fwd_bwd(public, x, scale, shift)
    want = fwd_bwd(an._modulate_trifuse if winner == "trifuse" else an._modulate_torch, x, scale, shift)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = modulate_dialect.explain(x, (N,), 1 + scale[:, None], shift[:, None], None, None, 1e-6, False)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    fwd_bwd(public, *inputs(tokens=4))  # 8 rows either way: the same rows bucket, replayed
    assert len(fake.calls) == 2


def test_the_torch_candidate_keeps_the_ops_dtype_under_autocast(modulate_dialect, timer, monkeypatch):
    """Autocast runs PyTorch's norm in fp32; the candidate must return the op's dtype all the same."""
    monkeypatch.setattr(modulate_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, scale, shift = inputs(torch.float16)
    with torch.autocast(DEVICE if DEVICE == "cuda" else "cpu", dtype=torch.float16):
        y = public(x, (N,), 1 + scale[:, None], shift[:, None], None, None, 1e-6, False)
    assert y.dtype == torch.float16


def test_compiled_graphs_keep_the_registered_op(modulate_dialect, timer, monkeypatch):
    monkeypatch.setattr(modulate_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, scale, shift = inputs()
    fwd_bwd(public, x, scale, shift)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda *a: public(*a), backend=backend, fullgraph=True)(
        x, (N,), 1 + scale[:, None], shift[:, None], None, None, 1e-6, False)
    assert any("trifuse.grouped_norm" in gm.code for gm in graphs)


@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_a_narrowed_call_is_chosen_apart_and_runs_bitwise(modulate_dialect, timer, monkeypatch, winner):
    """y in fp16 for three readers (fuse's narrowing under autocast): a key of its own, timed with
    the casts PyTorch's candidate needs; the winner's three ys and gradients bitwise."""
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(modulate_dialect, "timer", fake)
    x, scale, shift = inputs()
    args = (x, (N,), 1 + scale[:, None], shift[:, None], None, None, 1e-6, False)
    narrowing = (torch.float16, 3, False)
    assert modulate_dialect.key(*args, *narrowing) == (*modulate_dialect.key(*args), "float16x3")

    def run(fn):
        ys = fn(*args, *narrowing)
        dys = [torch.randn(y.shape, generator=torch.Generator(device=y.device).manual_seed(i),
                           device=y.device, dtype=y.dtype) for i, y in enumerate(ys)]
        return (*ys, *torch.autograd.grad(ys, (x, scale, shift), dys))

    got = run(lambda *a: trifuse.ops.layer_norm_modulate(*a[:7], is_rms_norm=a[7], out_dtype=a[8],
                                                         readers=a[9], full_y=a[10]))
    want = run(an._modulate_trifuse if winner == "trifuse" else an._modulate_torch)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and torch.equal(a, e)
    rec = modulate_dialect.explain(*args, *narrowing)
    assert rec.chosen == winner and set(fake.calls) == {"trifuse", "torch"}


# ---------------------------------------------------------------------------------------------
# gated_add_layer_norm_modulate: the residual add before the norm, its own dialect
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def gated_dialect(cache_dir, monkeypatch):
    an.GATED_ADD_LAYER_NORM_MODULATE.clear()
    monkeypatch.setattr(an.GATED_ADD_LAYER_NORM_MODULATE, "timer", None)
    yield an.GATED_ADD_LAYER_NORM_MODULATE
    an.GATED_ADD_LAYER_NORM_MODULATE.clear()


def gated_inputs(dtype=torch.float32, tokens=3):
    x, residual = (torch.randn(2, tokens, N, device=DEVICE, dtype=dtype, requires_grad=True)
                   for _ in range(2))
    gate, scale, shift = (torch.randn(2, N, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    return x, residual, gate, scale, shift


def gated_fwd_bwd(fn, x, residual, gate, scale, shift, *narrowing):
    """y (or its views), s and the gradients of all five inputs, for fixed output gradients (the
    candidates return y's views and s as one flat tuple, the public function (y, s))."""
    outs = fn(x, residual, gate[:, None], (N,), 1 + scale[:, None], shift[:, None], None, None, 1e-6, False,
              *narrowing)
    grads = [torch.randn(o.shape, generator=torch.Generator(device=o.device).manual_seed(i), device=o.device,
                         dtype=o.dtype) for i, o in enumerate(outs)]
    return (*outs, *torch.autograd.grad(outs, (x, residual, gate, scale, shift), grads))


def gated_public(x, residual, gate, ns, mul, add, w, b, eps, rms, out_dtype=None, readers=1, full_y=False):
    y, s = trifuse.ops.gated_add_layer_norm_modulate(x, residual, gate, ns, mul, add, w, b, eps,
                                                     is_rms_norm=rms, out_dtype=out_dtype, readers=readers,
                                                     full_y=full_y)
    return an._ys_then_s(y, s)


@pytest.mark.parametrize("narrowing", [(), (torch.float16, 3, False)], ids=["plain", "fp16x3"])
@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_gated_the_measured_winner_runs_bitwise(gated_dialect, timer, monkeypatch, winner, narrowing):
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(gated_dialect, "timer", fake)
    inputs = gated_inputs()
    got = gated_fwd_bwd(gated_public, *inputs, *narrowing)
    want = gated_fwd_bwd(an._gated_trifuse if winner == "trifuse" else an._gated_torch, *inputs, *narrowing)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and torch.equal(a, e)
    x, residual, gate, scale, shift = inputs
    args = (x, residual, gate[:, None], (N,), 1 + scale[:, None], shift[:, None], None, None, 1e-6, False)
    rec = gated_dialect.explain(*args, *narrowing)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    if narrowing:
        assert gated_dialect.key(*args, *narrowing) == (*gated_dialect.key(*args), "float16x3")
        # the dialect's trial sees y's three views and s as four outputs, each checked and differentiated
        assert len(an._gated_dialect_ref(*args, *narrowing)) == 4


def test_gated_compiled_graphs_keep_the_registered_op(gated_dialect, timer, monkeypatch):
    monkeypatch.setattr(gated_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, residual, gate, scale, shift = gated_inputs()
    gated_fwd_bwd(gated_public, x, residual, gate, scale, shift)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda *a: gated_public(*a), backend=backend, fullgraph=True)(
        x, residual, gate[:, None], (N,), 1 + scale[:, None], shift[:, None], None, None, 1e-6, False)
    assert any("trifuse.gated_grouped_norm" in gm.code for gm in graphs)


# ---------------------------------------------------------------------------------------------
# Per token: the layer_norm_modulate_rows dialect (the row kernels or PyTorch's ops)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def rows_dialect(cache_dir, monkeypatch):
    an.LAYER_NORM_MODULATE_ROWS.clear()
    monkeypatch.setattr(an.LAYER_NORM_MODULATE_ROWS, "timer", None)
    yield an.LAYER_NORM_MODULATE_ROWS
    an.LAYER_NORM_MODULATE_ROWS.clear()


def per_token_fwd_bwd(fn, x, emb):
    """FLUX.3's `(1 + scale) * norm(x) + shift`, scale and shift chunks of one (B, S, 3N) tensor."""
    shift, scale, _ = emb.chunk(3, dim=-1)
    y = fn(x, (N,), scale, shift, None, None, 1e-6, False, 1.0)
    dy = torch.randn(y.shape, generator=torch.Generator(device=y.device).manual_seed(1), device=y.device,
                     dtype=y.dtype)
    return (y, *torch.autograd.grad(y, (x, emb), dy))


def public_rows(x, ns, mul, add, w, b, eps, rms, mul_offset):
    return trifuse.ops.layer_norm_modulate(x, ns, mul, add, w, b, eps, is_rms_norm=rms, mul_offset=mul_offset)


def per_token_inputs(tokens=3):
    x = torch.randn(2, tokens, N, device=DEVICE, requires_grad=True)
    return x, torch.randn(2, tokens, 3 * N, device=DEVICE, requires_grad=True)


@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_per_token_the_measured_winner_runs_bitwise(rows_dialect, timer, monkeypatch, winner):
    """A per-token call goes to its own dialect (not the per-sample one), which runs what it
    measured faster, bitwise; the same rows bucket is replayed without measuring again."""
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(rows_dialect, "timer", fake)
    x, emb = per_token_inputs()
    got = per_token_fwd_bwd(public_rows, x, emb)
    want = per_token_fwd_bwd(an._rows_trifuse if winner == "trifuse" else an._rows_torch_candidate, x, emb)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    shift, scale, _ = emb.chunk(3, dim=-1)
    rec = rows_dialect.explain(x, (N,), scale, shift, None, None, 1e-6, False, 1.0)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    per_token_fwd_bwd(public_rows, *per_token_inputs(tokens=4))
    assert len(fake.calls) == 2


def test_per_token_compiled_graphs_keep_the_registered_op(rows_dialect, timer, monkeypatch):
    monkeypatch.setattr(rows_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, emb = per_token_inputs()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x, emb: per_token_fwd_bwd(public_rows, x, emb)[0], backend=backend)(x, emb)
    assert any("trifuse.norm_modulate_rows" in gm.code for gm in graphs)


# ---------------------------------------------------------------------------------------------
# Per token with the gated add: the gated_add_layer_norm_modulate_rows dialect
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def gated_rows_dialect(cache_dir, monkeypatch):
    an.GATED_ADD_LAYER_NORM_MODULATE_ROWS.clear()
    monkeypatch.setattr(an.GATED_ADD_LAYER_NORM_MODULATE_ROWS, "timer", None)
    yield an.GATED_ADD_LAYER_NORM_MODULATE_ROWS
    an.GATED_ADD_LAYER_NORM_MODULATE_ROWS.clear()


def gated_per_token_fwd_bwd(fn, x, residual, emb):
    """Qwen-Image 2.1's `h + gate * x`, then `norm(h) * (1 + scale) + shift`, gate, scale and shift
    chunks of one (B, S, 3N) tensor: y, s and the gradients of x, the residual and emb."""
    shift, scale, gate = emb.chunk(3, dim=-1)
    y, s = fn(x, residual, gate, (N,), scale, shift, None, None, 1e-6, False, 1.0)
    gen = torch.Generator(device=y.device).manual_seed(1)
    dy, ds = (torch.randn(y.shape, generator=gen, device=y.device, dtype=y.dtype) for _ in range(2))
    return (y, s, *torch.autograd.grad((y, s), (x, residual, emb), (dy, ds)))


def public_gated_rows(x, residual, gate, ns, mul, add, w, b, eps, rms, mul_offset):
    return trifuse.ops.gated_add_layer_norm_modulate(x, residual, gate, ns, mul, add, w, b, eps, is_rms_norm=rms,
                                                     mul_offset=mul_offset)


def gated_per_token_inputs(tokens=3):
    x, emb = per_token_inputs(tokens)
    return x, torch.randn(2, tokens, N, device=DEVICE, requires_grad=True), emb


@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_gated_per_token_the_measured_winner_runs_bitwise(gated_rows_dialect, timer, monkeypatch, winner):
    """A per-token gated call goes to its own dialect, which runs what it measured faster, bitwise;
    the same rows bucket is replayed without measuring again."""
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(gated_rows_dialect, "timer", fake)
    x, residual, emb = gated_per_token_inputs()
    got = gated_per_token_fwd_bwd(public_gated_rows, x, residual, emb)
    candidate = an._gated_rows_trifuse if winner == "trifuse" else an._gated_rows_torch_candidate
    want = gated_per_token_fwd_bwd(lambda *a: candidate(*a), x, residual, emb)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    shift, scale, gate = emb.chunk(3, dim=-1)
    rec = gated_rows_dialect.explain(x, residual, gate, (N,), scale, shift, None, None, 1e-6, False, 1.0)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    gated_per_token_fwd_bwd(public_gated_rows, *gated_per_token_inputs(tokens=4))
    assert len(fake.calls) == 2


def test_gated_per_token_compiled_graphs_keep_the_registered_op(gated_rows_dialect, timer, monkeypatch):
    monkeypatch.setattr(gated_rows_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    x, residual, emb = gated_per_token_inputs()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda *a: gated_per_token_fwd_bwd(public_gated_rows, *a)[0], backend=backend)(x, residual, emb)
    assert any("trifuse.gated_norm_modulate_rows" in gm.code for gm in graphs)
