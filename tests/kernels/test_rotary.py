"""Rotary position embedding of q and k, rotate-half and interleaved conventions, against the
float64 oracle.

On CPU these run the real Triton kernel in the interpreter (tests/_device.py); on a GPU the same
tests run natively and add bf16.
"""
import pytest
import torch
import trifuse
from _device import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import DTYPES, assert_close, check_close
from trifuse.kernels import rotary as rk
from trifuse.kernels.rotary import rotary_embedding_ref

# (B, Hq, Hkv, S, D): S = 1, 37 (two position blocks at D = 80), 130 (three at D = 64); D = 2, 6
# (halves of 1 and 3), 80 and 96 (not powers of two), 128, 256; grouped and multi-query K heads;
# an empty batch.
SHAPES = [(2, 4, 2, 37, 80), (1, 2, 2, 1, 2), (2, 3, 1, 5, 96), (1, 2, 1, 7, 6), (2, 4, 4, 16, 128),
          (1, 2, 2, 130, 64), (1, 2, 1, 9, 256), (0, 2, 2, 4, 8)]
COS = ["shared", "per-batch", "expanded"]
CONVENTIONS = pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])


def _ids(shape):
    return "B{}-Hq{}-Hkv{}-S{}-D{}".format(*shape)


def rope_tables(b, s, d, dtype, per_batch=False, base=10000.0, interleaved=False):
    """Hugging Face's cos and sin after `unsqueeze(1)`: (1 or B, 1, S, D), from positions that
    differ per batch row when `per_batch` (position_ids of packed or left-padded sequences); in
    the interleaved layout (each frequency twice in a row, as Cohere's) when `interleaved`."""
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    pos = torch.arange(s, dtype=torch.float64)[None]
    if per_batch:
        pos = pos + torch.arange(max(b, 1), dtype=torch.float64)[:, None] * 3
    freqs = pos[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None].to(DEVICE, dtype), emb.sin()[:, None].to(DEVICE, dtype)


def make(shape, dtype, cos_kind="shared", scale=1.0, interleaved=False):
    b, hq, hkv, s, d = shape
    q = (torch.randn(b, hq, s, d, device=DEVICE, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    k = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    cos, sin = rope_tables(b, s, d, dtype, per_batch=cos_kind != "shared", interleaved=interleaved)
    if cos_kind == "expanded":  # (1, 1, S, D) expanded to (B, 1, S, D): batch stride 0
        cos, sin = rope_tables(b, s, d, dtype, interleaved=interleaved)
        cos, sin = cos.expand(b, 1, s, d), sin.expand(b, 1, s, d)
    return q, k, cos, sin


def _wide(t):
    return None if t is None else t.detach().double().requires_grad_(t.requires_grad)


def _same(t):
    return None if t is None else t.detach().clone().requires_grad_(t.requires_grad)


def check_fwd_bwd(q, k, cos, sin, dys=None, interleaved=False, halves_out=False):
    """q_embed, k_embed, dq, dk (and dcos, dsin when they require grad) against float64, bounded
    by PyTorch's own error in q's dtype; the interleaved convention when `interleaved`, read
    interleaved and written rotate-half when also `halves_out`."""
    out = trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=interleaved, halves_out=halves_out)
    args64 = [_wide(t) for t in (q, k, cos, sin)]
    argslp = [_same(t) for t in (q, k, cos, sin)]
    out64 = rotary_embedding_ref(*args64, interleaved, halves_out)
    outlp = rotary_embedding_ref(*argslp, interleaved, halves_out)
    names = ("q_embed", "k_embed")
    for name, o, o64, olp, x in zip(names, out, out64, outlp, (q, k)):
        if x is None:
            assert o is None
            continue
        assert o.dtype == olp.dtype and o.shape == x.shape and o.is_contiguous()
        assert_close(name, o, o64, olp)
    if q.numel() == 0:
        return
    pairs = [(o, o64, olp) for o, o64, olp in zip(out, out64, outlp) if o is not None]
    dys = dys or [torch.randn_like(o) for o, _, _ in pairs]
    inputs = [(n, t, t64, tlp) for n, t, t64, tlp in zip(("dq", "dk", "dcos", "dsin"), (q, k, cos, sin), args64, argslp)
              if t is not None and t.requires_grad]
    grads = torch.autograd.grad([p[0] for p in pairs], [i[1] for i in inputs], dys)
    g64 = torch.autograd.grad([p[1] for p in pairs], [i[2] for i in inputs], [d.double() for d in dys])
    glp = torch.autograd.grad([p[2] for p in pairs], [i[3] for i in inputs], dys)
    for (name, t, _, _), a, a64, alp in zip(inputs, grads, g64, glp):
        assert a.dtype == t.dtype and a.shape == t.shape
        assert_close(name, a, a64, alp)


@pytest.mark.parametrize("cos_kind", COS)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, shape, cos_kind):
    check_fwd_bwd(*make(shape, dtype, cos_kind))


def deepseek_rope(x, cos, sin):
    """DeepSeek-V3's rotary as transformers 5.x writes it (apply_rotary_pos_emb_interleave):
    the interleaved pairs in, the rotate-half halves out, tables of one entry per pair."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("table", ["per-pair", "full"])
@pytest.mark.parametrize("shape", [(2, 4, 1, 37, 24), (1, 2, 2, 1, 2), (2, 3, 1, 5, 64), (0, 2, 2, 4, 8)],
                         ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_halves_out_matches_float64_oracle(dtype, shape, table):
    b, hq, hkv, s, d = shape
    q = torch.randn(b, s, hq, d, device=DEVICE, dtype=dtype).transpose(1, 2).requires_grad_()  # a projection view
    k = torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype).requires_grad_()
    cos, sin = rope_tables(b, s, d, dtype, per_batch=True)
    if table == "per-pair":
        cos, sin = cos[..., : d // 2], sin[..., : d // 2]
    check_fwd_bwd(q, k, cos, sin, interleaved=True, halves_out=True)
    check_fwd_bwd(q, k, cos.clone().requires_grad_(), sin.clone().requires_grad_(), interleaved=True,
                  halves_out=True)


def test_halves_out_oracle_is_deepseeks_spelling():
    q, k, cos, sin = make((2, 3, 1, 7, 16), torch.float64, "per-batch")
    cos_h, sin_h = cos[..., :8], sin[..., :8]
    q_embed, k_embed = rotary_embedding_ref(q, k, cos_h, sin_h, True, True)
    torch.testing.assert_close(q_embed, deepseek_rope(q, cos_h, sin_h), rtol=0, atol=0)
    torch.testing.assert_close(k_embed, deepseek_rope(k, cos_h, sin_h), rtol=0, atol=0)
    # and not the plain interleaved convention (a test that could not tell them apart proves nothing)
    assert not torch.allclose(q_embed, rotary_embedding_ref(q, k, cos, sin, True)[0])


def test_halves_out_eager_path_and_registered_op_are_bitwise_equal():
    q, k, cos, sin = make((2, 4, 2, 9, 16), torch.float32, "per-batch")
    cos, sin = cos[..., :8], sin[..., :8]
    eager = trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=True, halves_out=True)
    op = torch.ops.trifuse.rotary_embedding(q, k, cos, sin, True, True)
    for a, a_ in zip(eager, op):
        assert torch.equal(a, a_)
    dys = [torch.randn_like(o) for o in eager]
    for a, a_ in zip(torch.autograd.grad(eager, (q, k), dys), torch.autograd.grad(op, (q, k), dys)):
        assert torch.equal(a, a_)
    torch.library.opcheck(torch.ops.trifuse.rotary_embedding.default, (q, k, cos, sin, True, True))
    torch.library.opcheck(torch.ops.trifuse.rotary_embedding_backward.default,
                          (dys[0], dys[1], cos, sin, torch.float32, False, False, True, True))


def test_halves_out_bad_arguments():
    q, k, cos, sin = make((1, 2, 1, 4, 8), torch.float32)
    with pytest.raises(ValueError, match="rotary_embedding: halves_out=True .* needs interleaved=True"):
        trifuse.ops.rotary_embedding(q, k, cos, sin, halves_out=True)
    with pytest.raises(TypeError, match="rotary_embedding: halves_out must be a bool"):
        trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=True, halves_out=1)
    with pytest.raises(ValueError, match=r"rotary_embedding: cos must be 4-D .* \(1 or 1, 1, 4, 8\)"):
        trifuse.ops.rotary_embedding(q, k, cos[..., :4], sin[..., :4])  # per-pair: the interleaved conventions only
    with pytest.raises(ValueError, match=r"rotary_embedding: cos .* \(1 or 1, 1, 4, 8 or 4\)"):
        trifuse.ops.rotary_embedding(q, k, cos[..., :3], sin[..., :3], interleaved=True, halves_out=True)


def complex_table(b, s, d, per_batch=False):
    """Meta's Llama reference's (and torchtitan's, Llama 4's, DeepSeek-V2's) table: complex
    `torch.polar(1, pos * inv_freq)`, one entry per pair, (1 or B, 1, S, D / 2) complex128."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    pos = torch.arange(s, dtype=torch.float64)[None]
    if per_batch:
        pos = pos + torch.arange(max(b, 1), dtype=torch.float64)[:, None] * 3
    freqs = pos[..., None] * inv_freq
    return torch.polar(torch.ones_like(freqs), freqs)[:, None].to(DEVICE)


def complex_rope(x, freqs):
    """The rotation as those models write it: pairs as complex numbers times the table."""
    x_ = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs).flatten(3)


@pytest.mark.parametrize("shape", [(2, 4, 1, 37, 24), (1, 2, 2, 1, 2), (2, 3, 1, 5, 80), (0, 2, 2, 4, 8)],
                         ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_pair_tables_interleaved_match_float64_oracle(dtype, shape):
    """The interleaved convention with one table entry per pair: a complex table's real and
    imaginary parts (views with a stride of 2 along the pairs), q a projection view, k GQA;
    again with the tables training."""
    b, hq, hkv, s, d = shape
    q = torch.randn(b, s, hq, d, device=DEVICE, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype).requires_grad_()
    table = torch.view_as_real(complex_table(b, s, d, per_batch=True).to(torch.complex64 if dtype != torch.float64
                                                                          else torch.complex128))
    cos, sin = table[..., 0].to(dtype), table[..., 1].to(dtype)
    check_fwd_bwd(q, k, cos, sin, interleaved=True)
    check_fwd_bwd(q, k, cos.clone().requires_grad_(), sin.clone().requires_grad_(), interleaved=True)
    view_cos, view_sin = table[..., 0], table[..., 1]  # stride 2: what a replacement hands the op
    if dtype == torch.float32 and b:
        check_fwd_bwd(q, None, view_cos, view_sin, interleaved=True)


@pytest.mark.parametrize("q_dtype, table_dtype, out", [
    (torch.float16, torch.float32, torch.float16),  # upcast, rotate, cast back (Llama 4, torchtitan, torchtune)
    (torch.float32, torch.float32, torch.float16),
    (torch.float16, torch.float16, torch.float32),
], ids=["fp16-q-fp32-tables-to-fp16", "fp32-to-fp16", "fp16-to-fp32"])
@pytest.mark.parametrize("table", ["full", "per-pair"])
def test_outputs_in_another_dtype_are_rounded_once(q_dtype, table_dtype, out, table):
    """dtype=: the rotation computed as `q * cos` is (fp32 here) and rounded once to `dtype`, as
    a model's `(rotate(q.float())).to(q.dtype)` gives; dq and dk in q's dtype, dcos and dsin in the
    tables'."""
    b, hq, hkv, s, d = 2, 4, 2, 9, 16
    q = torch.randn(b, s, hq, d, device=DEVICE).to(q_dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, hkv, s, d, device=DEVICE).to(q_dtype).requires_grad_()
    cos, sin = rope_tables(b, s, d, torch.float64, per_batch=True, interleaved=True)
    if table == "per-pair":
        cos, sin = cos[..., 0::2], sin[..., 0::2]
    cos, sin = cos.to(table_dtype).requires_grad_(), sin.to(table_dtype).requires_grad_()
    got = trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=True, dtype=out)
    op = torch.ops.trifuse.rotary_embedding(q, k, cos, sin, True, False, out)
    ref64 = rotary_embedding_ref(*(_wide(t) for t in (q, k, cos, sin)), True)
    # PyTorch's own: in the promoted dtype, then one cast
    reflp = rotary_embedding_ref(*(_same(t) for t in (q, k, cos, sin)), True, False, out)
    for name, o, o_op, r64, rlp in zip(("q_embed", "k_embed"), got, op, ref64, reflp):
        assert o.dtype == out and o_op.dtype == out and o.is_contiguous()
        assert torch.equal(o, o_op)
        assert_close(name, o, r64, rlp)
    dys = [torch.randn_like(o) for o in got]
    grads = torch.autograd.grad(got, (q, k, cos, sin), dys)
    wide = [_wide(t) for t in (q, k, cos, sin)]
    g64 = torch.autograd.grad(rotary_embedding_ref(*wide, True), wide, [d.double() for d in dys])
    same = [_same(t) for t in (q, k, cos, sin)]
    glp = torch.autograd.grad(rotary_embedding_ref(*same, True, False, out), same, dys)
    for name, t, g, gw, gl in zip(("dq", "dk", "dcos", "dsin"), (q, k, cos, sin), grads, g64, glp):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert_close(name, g, gw, gl)


def test_bad_output_dtype_raises():
    q, k, cos, sin = make((1, 2, 1, 4, 8), torch.float32)
    for bad in (torch.int32, "float16", torch.bool):
        with pytest.raises(TypeError, match="rotary_embedding: dtype must be None or a float torch.dtype"):
            trifuse.ops.rotary_embedding(q, k, cos, sin, dtype=bad)


def test_output_dtype_under_compile_and_opcheck():
    q, k, cos, sin = make((2, 4, 2, 9, 16), torch.float16, "per-batch", interleaved=True)
    cos, sin = cos.float(), sin.float()
    compiled = torch.compile(lambda *a: trifuse.ops.rotary_embedding(*a, interleaved=True, dtype=torch.float16),
                             backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(q, k, cos, sin), trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=True,
                                                                          dtype=torch.float16)):
        assert a.dtype == torch.float16 and torch.equal(a, b)
    torch.library.opcheck(torch.ops.trifuse.rotary_embedding.default, (q, k, cos, sin, True, False, torch.float16))


def test_per_pair_interleaved_oracle_is_the_complex_product():
    q, k, _, _ = make((2, 3, 1, 7, 16), torch.float64)
    freqs = complex_table(2, 7, 16, per_batch=True)
    q_embed, k_embed = rotary_embedding_ref(q, k, freqs.real, freqs.imag, True)
    torch.testing.assert_close(q_embed, complex_rope(q, freqs), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(k_embed, complex_rope(k, freqs), rtol=1e-15, atol=1e-15)
    # the kernel too, and not the rotate-half pairs (a test that could not tell them apart proves nothing)
    out = trifuse.ops.rotary_embedding(q, k, freqs.real.contiguous(), freqs.imag.contiguous(), interleaved=True)
    torch.testing.assert_close(out[0], complex_rope(q, freqs), rtol=1e-12, atol=1e-12)
    halves = rotary_embedding_ref(q, k, freqs.real, freqs.imag, True, True)[0]
    assert not torch.allclose(halves, q_embed, atol=1e-3)


@pytest.mark.parametrize("cos_kind", COS)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interleaved_matches_float64_oracle(dtype, shape, cos_kind):
    """GPT-J's, Cohere's, GLM's convention: pairs (x[2i], x[2i+1]); D = 2 and 6 give one and
    three pairs, 80 and 96 a masked tail of pairs."""
    check_fwd_bwd(*make(shape, dtype, cos_kind, interleaved=True), interleaved=True)


@CONVENTIONS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_alone(dtype, interleaved):
    q, _, cos, sin = make((2, 3, 1, 11, 64), dtype, "per-batch", interleaved=interleaved)
    check_fwd_bwd(q, None, cos, sin, interleaved=interleaved)
    _, k_embed = torch.ops.trifuse.rotary_embedding(q, None, cos, sin, interleaved)
    assert k_embed.shape == (0,)


@CONVENTIONS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs_are_read_in_place(dtype, interleaved, monkeypatch):
    """q and k as models make them: a projection viewed (B, S, H, D) and transposed, a chunk of a
    fused qkv projection, a partial-rotary slice; cos and sin sliced out of a wider table and a
    transposed incoming gradient. None of them is copied."""
    b, s, h, d = 2, 13, 4, 48
    q = torch.randn(b, s, h, d, device=DEVICE, dtype=dtype).transpose(1, 2).requires_grad_()
    qkv = torch.randn(b, s, h, 3 * d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = qkv.transpose(1, 2).chunk(3, dim=-1)[1]  # GPT-NeoX: (B, H, S, D) with row stride 3 D
    wide = torch.randn(1, 1, s, 2 * d, device=DEVICE, dtype=dtype)
    cos, sin = wide[..., :d], wide[..., d:]
    copies = []
    real_contiguous = rk._unit_last
    monkeypatch.setattr(rk, "_unit_last", lambda t: copies.append(t) or real_contiguous(t))
    dys = [torch.randn(b, s, h, d, device=DEVICE, dtype=dtype).transpose(1, 2) for _ in range(2)]
    check_fwd_bwd(q, k, cos, sin, dys, interleaved=interleaved)
    assert all(c.stride(-1) == 1 for c in copies)
    rot = 16  # partial rotary (Phi, GPT-NeoX, GLM): the first `rot` features of each head
    cos_r, sin_r = rope_tables(b, s, rot, dtype, interleaved=interleaved)
    check_fwd_bwd(q[..., :rot], k[..., :rot], cos_r, sin_r, interleaved=interleaved)


@CONVENTIONS
@pytest.mark.parametrize("path", ["eager", "registered", "reference"])
def test_gradients_take_the_layout_of_projection_views(path, interleaved, monkeypatch):
    """dq and dk of transposed (B, S, H, D) q and k come in that layout: the projection's gradient
    then needs no copy through the transpose and the view. Other layouts get contiguous ones."""
    if path == "reference":
        monkeypatch.setattr(rk, "use_triton", lambda t: False)
    b, s, h, d = 2, 5, 4, 8
    q = torch.randn(b, s, h, d, device=DEVICE).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, 3 * h, d, device=DEVICE)[:, :, :h].transpose(1, 2).requires_grad_()  # a slice
    cos, sin = rope_tables(b, s, d, torch.float32, interleaved=interleaved)
    if path == "registered":
        outs = torch.ops.trifuse.rotary_embedding(q, k, cos, sin, interleaved)
    else:
        outs = trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=interleaved)
    dq, dk = torch.autograd.grad(outs, (q, k), [torch.ones_like(o) for o in outs])
    assert dq.stride() == q.stride() and dq.transpose(1, 2).is_contiguous()
    assert dk.is_contiguous()
    check_fwd_bwd(q, k, cos, sin, interleaved=interleaved)


def test_per_head_tables():
    """cos and sin with a head dim (Hq == Hkv): one table per head."""
    q, k, _, _ = make((2, 3, 3, 5, 8), torch.float32)
    angles = torch.randn(2, 3, 5, 4, device=DEVICE, dtype=torch.float64).repeat(1, 1, 1, 2)
    check_fwd_bwd(q, k, angles.cos().float(), angles.sin().float())


def test_last_dim_strided_cos_is_copied_once():
    q, k, cos, sin = make((1, 2, 2, 5, 8), torch.float32)
    cos2 = torch.stack((cos, cos), dim=-1).flatten(-2)[..., ::2]  # stride 2 along D
    assert cos2.stride(-1) == 2
    check_fwd_bwd(q, k, cos2, sin)


@CONVENTIONS
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=str)
def test_fp32_tables_with_16_bit_q_and_k(dtype, interleaved):
    """Under autocast Hugging Face computes cos and sin in fp32 beside 16-bit q and k: the outputs
    are fp32 as PyTorch's `q * cos` makes them, the gradients of q and k in their dtype."""
    q, k, cos, sin = make((2, 4, 2, 37, 80), dtype, "per-batch")
    cos, sin = rope_tables(2, 37, 80, torch.float32, per_batch=True, interleaved=interleaved)
    q_embed, k_embed = trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=interleaved)
    assert q_embed.dtype == k_embed.dtype == torch.float32
    check_fwd_bwd(q, k, cos, sin, interleaved=interleaved)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_values(dtype):
    scale = {torch.float32: 1e6, torch.float16: 4e3, torch.bfloat16: 1e30}[dtype]
    check_fwd_bwd(*make((2, 2, 1, 17, 64), dtype, "per-batch", scale=scale))


def test_nan_and_inf_propagate_like_pytorch():
    q, k, cos, sin = make((1, 1, 1, 3, 8), torch.float32)
    with torch.no_grad():
        q[0, 0, 1, 2], q[0, 0, 2, 5] = float("nan"), float("inf")
    out, ref = trifuse.ops.rotary_embedding(q, k, cos, sin)[0], rotary_embedding_ref(q.double(), None, cos.double(),
                                                                                     sin.double())[0]
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isinf(out), torch.isinf(ref))


@CONVENTIONS
def test_cos_and_sin_gradients_when_they_train(interleaved):
    """Learned or trained cos/sin tables get their gradients (summed over heads, and over the
    batch for a shared table), never a silent zero."""
    for kind in COS[:2]:
        q, k, cos, sin = make((2, 4, 2, 9, 16), torch.float32, kind, interleaved=interleaved)
        check_fwd_bwd(q, k, cos.requires_grad_(), sin.requires_grad_(), interleaved=interleaved)
    q, _, cos, sin = make((2, 4, 2, 9, 16), torch.float32, interleaved=interleaved)
    check_fwd_bwd(q, None, cos.requires_grad_(), sin, interleaved=interleaved)


@CONVENTIONS
def test_gradcheck_float64(interleaved):
    # fast mode (random directions through the Jacobian): each evaluation is an interpreted kernel
    q, k, cos, sin = make((2, 3, 1, 4, 6), torch.float64, "per-batch", interleaved=interleaved)
    cos, sin = cos.requires_grad_(), sin.requires_grad_()
    il = interleaved
    assert torch.autograd.gradcheck(lambda *a: trifuse.ops.rotary_embedding(*a, interleaved=il), (q, k, cos, sin),
                                    fast_mode=True)
    assert torch.autograd.gradcheck(lambda *a: torch.ops.trifuse.rotary_embedding(*a, il), (q, k, cos, sin),
                                    fast_mode=True)
    assert torch.autograd.gradcheck(lambda q, c, s: trifuse.ops.rotary_embedding(q, None, c, s, interleaved=il)[0],
                                    (q, cos, sin), fast_mode=True)


def test_backward_saves_only_cos_and_sin():
    """The rotation's backward needs cos and sin, not q and k: nothing else is saved."""
    q, k, cos, sin = make((1, 2, 2, 4, 8), torch.float32)
    q_embed, _ = trifuse.ops.rotary_embedding(q, k, cos, sin)
    saved = q_embed.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0] is cos and saved[1] is sin


@CONVENTIONS
@pytest.mark.parametrize("with_k", [True, False], ids=["q-k", "q"])
def test_eager_path_and_registered_op_are_bitwise_equal(with_k, interleaved):
    q, k, cos, sin = make((2, 4, 2, 37, 80), torch.float32, "per-batch", interleaved=interleaved)
    k = k if with_k else None
    eager = trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=interleaved)
    op = torch.ops.trifuse.rotary_embedding(q, k, cos, sin, interleaved)
    inputs = [t for t in (q, k) if t is not None]
    outs = [o for o in eager if o is not None]
    for a, a_ in zip(outs, op):
        assert torch.equal(a, a_)
    dys = [torch.randn_like(o) for o in outs]
    for a, a_ in zip(torch.autograd.grad(outs, inputs, dys), torch.autograd.grad(op[:len(outs)], inputs, dys)):
        assert torch.equal(a, a_)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiles_fullgraph_without_graph_breaks(dynamic):
    fn = torch.compile(lambda *a: trifuse.ops.rotary_embedding(*a), fullgraph=True, backend="aot_eager",
                       dynamic=dynamic)
    for s in (9, 13):  # a second length: recompiled (static) or reused (dynamic), same bits
        q = torch.randn(2, s, 4, 16, device=DEVICE).transpose(1, 2).requires_grad_()
        _, k, cos, sin = make((2, 4, 2, s, 16), torch.float32)
        out, ref = fn(q, k, cos, sin), trifuse.ops.rotary_embedding(q, k, cos, sin)
        for a, a_ in zip(out, ref):
            assert torch.equal(a, a_)
        dys = [torch.randn_like(o) for o in out]
        grads = torch.autograd.grad(out, (q, k), dys)
        for a, a_ in zip(grads, torch.autograd.grad(ref, (q, k), dys)):
            assert torch.equal(a, a_)
        assert grads[0].stride() == q.stride()


def test_compiles_the_interleaved_convention():
    """`interleaved=True` reaches the traced op as its constant argument."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda *a: trifuse.ops.rotary_embedding(*a, interleaved=True), fullgraph=True,
                       backend=backend)
    q, k, cos, sin = make((2, 4, 2, 9, 16), torch.float32, interleaved=True)
    out, ref = fn(q, k, cos, sin), trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=True)
    for a, a_ in zip(out, ref):
        assert torch.equal(a, a_)
    calls = [n for n in graphs[0].graph.nodes if "rotary_embedding" in str(n.target)]
    assert len(calls) == 1 and True in calls[0].args


def test_opcheck_every_op():
    q, k, cos, sin = make((2, 4, 2, 5, 8), torch.float32, "per-batch")
    torch.library.opcheck(torch.ops.trifuse.rotary_embedding.default, (q, k, cos, sin))
    torch.library.opcheck(torch.ops.trifuse.rotary_embedding.default, (q, None, cos[:1], sin[:1]))
    torch.library.opcheck(torch.ops.trifuse.rotary_embedding.default,
                          (q, k, cos.clone().requires_grad_(), sin.clone().requires_grad_()))
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    backward = torch.ops.trifuse.rotary_embedding_backward.default
    torch.library.opcheck(backward, (dq, dk, cos, sin, torch.float32, False, False))
    torch.library.opcheck(backward, (dq, None, cos, sin, torch.float32, True, False))
    torch.library.opcheck(backward, (dq, dk, cos, sin, torch.float16, False, True))
    torch.library.opcheck(torch.ops.trifuse.rotary_embedding.default, (q.half(), k.half(), cos, sin))
    # the interleaved convention
    torch.library.opcheck(torch.ops.trifuse.rotary_embedding.default, (q, k, cos, sin, True))
    torch.library.opcheck(torch.ops.trifuse.rotary_embedding.default,
                          (q, None, cos.clone().requires_grad_(), sin.clone().requires_grad_(), True))
    torch.library.opcheck(backward, (dq, dk, cos, sin, torch.float32, True, False, True))


@settings(max_examples=15, deadline=None)
@given(b=st.integers(0, 3), hq=st.integers(1, 4), hkv=st.integers(1, 3), s=st.integers(1, 40),
       half=st.integers(1, 70), kind=st.sampled_from(COS), interleaved=st.booleans())
def test_hypothesis_shapes(b, hq, hkv, s, half, kind, interleaved):
    torch.manual_seed(b * 10000 + s * 100 + half)
    check_fwd_bwd(*make((b, hq, hkv, s, 2 * half), torch.float32, kind, interleaved=interleaved),
                  interleaved=interleaved)


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_to_the_31_elements():
    """Offsets in int64: the last positions of a q past 2^31 elements are right."""
    b, h, d = 1, 32, 128
    s = 2**31 // (h * d) + 8
    q = torch.randn(b, h, s, d, device=DEVICE, dtype=torch.bfloat16)
    cos, sin = rope_tables(1, s, d, torch.bfloat16)
    q_embed, _ = trifuse.ops.rotary_embedding(q, None, cos, sin)
    tail = slice(s - 16, s)
    ref64 = rotary_embedding_ref(q[:, :, tail].double(), None, cos[:, :, tail].double(), sin[:, :, tail].double())[0]
    reflp = rotary_embedding_ref(q[:, :, tail], None, cos[:, :, tail], sin[:, :, tail])[0]
    assert_close("tail", q_embed[:, :, tail], ref64, reflp)


@pytest.mark.gpu
def test_cuda_graph_replays_the_eager_path():
    """Captured in a CUDA graph (what mode="reduce-overhead" does), a replay on new q and k gives
    what an eager call gives."""
    shape = (2, 32, 8, 256, 128)
    q, k, cos, sin = (t.detach() for t in make(shape, torch.bfloat16, "per-batch"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            trifuse.ops.rotary_embedding(q, k, cos, sin)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = trifuse.ops.rotary_embedding(q, k, cos, sin)
    q2, k2, _, _ = make(shape, torch.bfloat16, "per-batch")
    with torch.no_grad():
        q.copy_(q2)
        k.copy_(k2)
        graph.replay()
        torch.cuda.synchronize()
        want = trifuse.ops.rotary_embedding(q, k, cos, sin)
    for a, a_ in zip(out, want):
        assert torch.equal(a, a_)


# ---------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations must fail the same tolerance.
# ---------------------------------------------------------------------------------------------


def _rotate_half_sign_flipped(x):
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


def _rotate_interleaved(x):
    """GPT-J's and Cohere's convention: pairs (x0, x1), (x2, x3), ... rotated."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("wrong", [_rotate_half_sign_flipped, _rotate_interleaved], ids=["sign-flipped", "interleaved"])
def test_negative_control_other_rotation_fails(dtype, wrong):
    q, _, cos, sin = make((2, 4, 2, 16, 64), dtype)
    bad = q * cos + wrong(q) * sin
    ref64 = rotary_embedding_ref(q.double(), None, cos.double(), sin.double())[0]
    ok, msg = check_close(f"{wrong.__name__}", bad, ref64, rotary_embedding_ref(q, None, cos, sin)[0])
    assert not ok, msg


@CONVENTIONS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_other_convention_fails(dtype, interleaved):
    """The op in one convention against the other convention's reference must not pass (with
    the tables of the convention it claims: the interleaved op on rotate-half tables and the
    reverse), forward and through the backward; and a plan or compiled kernel of one convention
    is never replayed for the other on the same shape."""
    q, k, cos, sin = make((2, 4, 2, 16, 64), dtype, "per-batch", interleaved=not interleaved)
    right = trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=not interleaved)  # same shape first
    out = trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=interleaved)
    ref64 = rotary_embedding_ref(*(t.detach().double() for t in (q, k, cos, sin)), not interleaved)
    reflp = rotary_embedding_ref(q, k, cos, sin, not interleaved)
    for name, o, good, r64, rlp in zip(("q_embed", "k_embed"), out, right, ref64, reflp):
        assert check_close(name, good, r64, rlp)[0]
        ok, msg = check_close(name, o, r64, rlp)
        assert not ok, msg
    dq_embed = torch.randn_like(q)
    wrong_dq, _ = rk._launch(dq_embed, None, cos, sin, True, dtype, interleaved=interleaved)
    q64 = q.detach().double().requires_grad_()
    (dq64,) = torch.autograd.grad(rotary_embedding_ref(q64, None, cos.double(), sin.double(), not interleaved)[0],
                                  q64, dq_embed.double())
    ok, msg = check_close("dq in the other convention", wrong_dq, dq64, None)
    assert not ok, msg


@CONVENTIONS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_control_forward_rotation_as_backward_fails(dtype, interleaved):
    """Gradients through the forward rotation (R instead of its transpose) must not pass."""
    q, k, cos, sin = make((2, 4, 2, 16, 64), dtype, interleaved=interleaved)
    dq_embed, dk_embed = torch.randn_like(q), torch.randn_like(k)
    wrong_dq, _ = rk._launch(dq_embed, dk_embed, cos, sin, False, dtype, interleaved=interleaved)
    q64 = q.detach().double().requires_grad_()
    (dq64,) = torch.autograd.grad(rotary_embedding_ref(q64, None, cos.double(), sin.double(), interleaved)[0], q64,
                                  dq_embed.double())
    ok, msg = check_close("dq by the forward rotation", wrong_dq, dq64, None)
    assert not ok, msg


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the op and the argument, in eager and under compile.
# ---------------------------------------------------------------------------------------------

_Q, _K = (2, 4, 5, 8), (2, 2, 5, 8)
_C = (1, 1, 5, 8)


def _t(shape, dtype=torch.float32):
    return torch.ones(shape, dtype=dtype)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((_t((4, 5, 8)), _t(_K), _t(_C), _t(_C)), ValueError, r"rotary_embedding: q must be 4-D .*got shape \(4, 5, 8\)"),
        ((_t((2, 4, 5, 7)), None, _t((1, 1, 5, 7)), _t((1, 1, 5, 7))), ValueError, "head_dim must be even.*got 7"),
        ((_t(_Q), _t((3, 2, 5, 8)), _t(_C), _t(_C)), ValueError, r"k must have shape \(2, heads, 5, 8\)"),
        ((_t(_Q), _t((2, 2, 6, 8)), _t(_C), _t(_C)), ValueError, r"k must have shape .* got \(2, 2, 6, 8\)"),
        ((_t(_Q), _t((2, 2, 5, 6)), _t(_C), _t(_C)), ValueError, "k must have shape"),
        ((_t(_Q), _t(_K), _t((1, 1, 6, 8)), _t(_C)), ValueError, r"cos must be 4-D and broadcast .*got shape \(1, 1, 6, 8\)"),
        ((_t(_Q), _t(_K), _t((1, 5, 8)), _t(_C)), ValueError, "cos must be 4-D"),
        ((_t(_Q), _t(_K), _t((3, 1, 5, 8)), _t((3, 1, 5, 8))), ValueError, r"cos must .*\(2 or 1, 1, 5, 8\)"),
        ((_t(_Q), _t(_K), _t((1, 4, 5, 8)), _t((1, 4, 5, 8))), ValueError, "cos must be 4-D and broadcast"),
        ((_t(_Q), _t(_K), _t(_C), _t((1, 1, 5, 4))), ValueError, "sin must be 4-D and broadcast"),
        ((_t(_Q), _t(_K), _t(_C), _t((2, 1, 5, 8))), ValueError, r"sin must have cos's shape \(1, 1, 5, 8\)"),
        ((_t(_Q), _t(_K), _t(_C), _t(_C, torch.float64)), TypeError, "sin has dtype torch.float64 but cos has torch.float32"),
        ((_t(_Q), _t(_K, torch.float16), _t(_C), _t(_C)), TypeError, "k has dtype torch.float16"),
        ((_t(_Q, torch.int64), None, _t(_C), _t(_C)), TypeError, "rotary_embedding: q must be float"),
        (("q", None, _t(_C), _t(_C)), TypeError, "q must be a torch.Tensor, got str"),
        ((_t(_Q), None, [1.0], _t(_C)), TypeError, "cos must be a torch.Tensor"),
    ],
    ids=["q-3d", "odd-head-dim", "k-batch", "k-seq", "k-head-dim", "cos-seq", "cos-3d", "cos-batch", "cos-heads",
         "sin-head-dim", "sin-not-like-cos", "sin-dtype", "k-dtype", "int-q", "q-not-tensor", "cos-list"],
)
def test_bad_input_raises_clear_error(args, exc, match):
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(exc, match=match):
        trifuse.ops.rotary_embedding(*args)
    if all(isinstance(a, torch.Tensor) or a is None for a in args):
        with pytest.raises(exc, match=match):
            torch.ops.trifuse.rotary_embedding(*args)


def test_bad_input_raises_under_compile():
    fn = torch.compile(lambda *a: trifuse.ops.rotary_embedding(*a), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="cos must be 4-D and broadcast"):
        fn(_t(_Q).to(DEVICE), _t(_K).to(DEVICE), _t((1, 1, 6, 8)).to(DEVICE), _t(_C).to(DEVICE))


def test_mismatched_devices_raise():
    q, k, cos, sin = make((1, 2, 2, 4, 8), torch.float32)
    with pytest.raises(ValueError, match="cos is on meta"):
        trifuse.ops.rotary_embedding(q, k, cos.to("meta"), sin)


@CONVENTIONS
def test_reference_path_without_interpreter_matches(monkeypatch, interleaved):
    """CPU tensors without TRITON_INTERPRET run the PyTorch path: same maths, same API."""
    monkeypatch.setattr(rk, "use_triton", lambda t: False)
    check_fwd_bwd(*make((2, 4, 2, 37, 80), torch.float32, "per-batch", interleaved=interleaved),
                  interleaved=interleaved)
    q, _, cos, sin = make((2, 3, 1, 5, 6), torch.float16, interleaved=interleaved)
    check_fwd_bwd(q, None, cos, sin, interleaved=interleaved)
    q, k, cos, sin = make((2, 4, 2, 9, 16), torch.float32, interleaved=interleaved)
    check_fwd_bwd(q, k, cos.requires_grad_(), sin.requires_grad_(), interleaved=interleaved)


def test_interleaved_must_be_a_bool():
    q, k, cos, sin = make((1, 2, 2, 4, 8), torch.float32)
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=1)
