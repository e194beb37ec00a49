"""The rotary_embedding dialect wired into trifuse.ops.rotary_embedding: trifuse's kernel or
Hugging Face's formula in PyTorch, chosen with a fake timer here (on the GPU: measured). Whichever
runs, the result is bitwise that implementation's; traced calls always see
trifuse::rotary_embedding; the check rejects a wrong one."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import trifuse
from _device import DEVICE
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import rotary as rk

B, HQ, HKV, S, D = 2, 4, 2, 7, 16


@pytest.fixture
def rope_dialect(cache_dir, monkeypatch):
    """The real rotary_embedding dialect with its memory cleared before and after the test."""
    rk.ROTARY_EMBEDDING.clear()
    monkeypatch.setattr(rk.ROTARY_EMBEDDING, "timer", None)
    yield rk.ROTARY_EMBEDDING
    rk.ROTARY_EMBEDDING.clear()


def inputs(dtype=torch.float32, batch=B, seq=S, with_k=True):
    q = torch.randn(batch, seq, HQ, D, device=DEVICE, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(batch, HKV, seq, D, device=DEVICE, dtype=dtype, requires_grad=True) if with_k else None
    angles = torch.randn(1, 1, seq, D // 2, device=DEVICE, dtype=torch.float64).repeat(1, 1, 1, 2)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def fwd_bwd(fn, q, k, cos, sin):
    outs = [o for o in fn(q, k, cos, sin) if o is not None]
    gen = torch.Generator(device=q.device).manual_seed(1)
    dys = [torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in outs]
    return (*outs, *torch.autograd.grad(outs, [t for t in (q, k) if t is not None], dys))


def registered(q, k, cos, sin):
    q_embed, k_embed = torch.ops.trifuse.rotary_embedding(q, k, cos, sin)
    return q_embed, None if k is None else k_embed


# ---------------------------------------------------------------------------------------------
# The key: cheap, a plain tuple, None where trifuse decides
# ---------------------------------------------------------------------------------------------


def test_key_is_a_small_tuple_of_plain_values():
    q, k, cos, sin = inputs()
    device = -1 if DEVICE == "cpu" else 0
    assert rk._rotary_key(q, k, cos, sin) == (device, torch.float32, torch.float32, 16, HQ, HKV, D, D, True,
                                              True, False, False)
    assert rk._rotary_key(q, k, cos, sin, True)[-2:] == (True, False)  # the convention: its own choice
    assert rk._rotary_key(q, k, cos, sin, True, True)[-2:] == (True, True)
    assert len(rk._rotary_key(q, k, cos, sin)) == len(rk.ROTARY_EMBEDDING.key_names)
    with torch.no_grad():
        assert rk._rotary_key(q, None, cos.expand(B, 1, S, D).double(), sin) == (
            device, torch.float32, torch.float64, 16, HQ, 0, D, D, False, False, False, False)
    assert rk._rotary_key(q, k, cos[..., : D // 2], sin[..., : D // 2], True)[7] == D // 2  # one entry per pair


@pytest.mark.parametrize("case", ["traced", "empty", "integer", "3-d", "odd head_dim", "cos 3-d", "k seq",
                                  "not a tensor", "interleaved not a bool", "halves_out not a bool"])
def test_key_is_none_where_trifuse_decides(case):
    q, k, cos, sin = inputs()
    if case == "traced":
        with FakeTensorMode():
            t = torch.empty(B, HQ, S, D)
            assert rk._rotary_key(t, None, torch.empty(1, 1, S, D), torch.empty(1, 1, S, D)) is None
        return
    args = {"empty": (q[:0], k[:0], cos, sin), "integer": (q.long(), None, cos, sin),
            "3-d": (q[0], None, cos, sin), "odd head_dim": (q[..., :3], None, cos[..., :3], sin[..., :3]),
            "cos 3-d": (q, k, cos[0], sin[0]), "k seq": (q, k[:, :, :2], cos, sin),
            "not a tensor": (q, k, 1.0, sin), "interleaved not a bool": (q, k, cos, sin, 1),
            "halves_out not a bool": (q, k, cos, sin, True, 1)}[case]
    assert rk._rotary_key(*args) is None


KEY_CALLS = 35  # 23 today: a budget with room, that a string format or a loop would overrun


def test_key_is_a_few_dozen_calls(count_calls):
    q, k, cos, sin = inputs()
    assert count_calls(rk._rotary_key, q, k, cos, sin) <= KEY_CALLS


# ---------------------------------------------------------------------------------------------
# The choice, its replay, and what every call sees
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_k", [True, False], ids=["q-k", "q"])
def test_untimed_default_is_trifuse_and_bitwise_equal_to_the_registered_op(rope_dialect, monkeypatch, with_k):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    args = inputs(with_k=with_k)
    for a, e in zip(fwd_bwd(trifuse.ops.rotary_embedding, *args), fwd_bwd(registered, *args)):
        assert torch.equal(a, e)
    assert rope_dialect.explain(*args).chosen == "trifuse"


@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_the_measured_winner_runs_bitwise(rope_dialect, timer, monkeypatch, winner):
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(rope_dialect, "timer", fake)
    args = inputs()
    got = fwd_bwd(trifuse.ops.rotary_embedding, *args)
    want = fwd_bwd(registered if winner == "trifuse" else rk._rotary_hf_formula, *args)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    rec = rope_dialect.explain(*args)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "torch"}
    assert rec.bucket == (f"dtype=float32,cos_dtype=float32,positions=16,q_heads={HQ},k_heads={HKV},head_dim={D},"
                          f"table_width={D},cos_batch_broadcast=True,grad=True,interleaved=False,halves_out=False")
    fwd_bwd(trifuse.ops.rotary_embedding, *inputs(seq=6))  # same positions bucket: replayed
    assert len(fake.calls) == 2


@pytest.mark.parametrize("halves_out", [False, True], ids=["interleaved", "pairs-to-halves"])
@pytest.mark.parametrize("winner", ["trifuse", "torch"])
def test_interleaved_calls_are_chosen_apart_and_run_bitwise(rope_dialect, timer, monkeypatch, winner, halves_out):
    """The convention is part of the key: an interleaved call (or DeepSeek's pairs to halves) is
    measured (both candidates pass the check against that convention's reference) and replayed on
    its own, never on the rotate-half choice of the same shape."""
    fake = timer({"trifuse": 1.0, "torch": 2.0} if winner == "trifuse" else {"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(rope_dialect, "timer", fake)
    args = inputs()
    fwd_bwd(trifuse.ops.rotary_embedding, *args)  # the rotate-half choice of this shape
    assert len(fake.calls) == 2

    def interleaved(q, k, cos, sin):
        return trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=True, halves_out=halves_out)

    def want_fn(q, k, cos, sin):
        if winner == "trifuse":
            q_embed, k_embed = torch.ops.trifuse.rotary_embedding(q, k, cos, sin, True, halves_out)
            return q_embed, None if k is None else k_embed
        return rk._rotary_hf_formula(q, k, cos, sin, True, halves_out)

    for a, e in zip(fwd_bwd(interleaved, *args), fwd_bwd(want_fn, *args)):
        assert torch.equal(a, e)
    assert len(fake.calls) == 4
    rec = rope_dialect.explain(*args, True, halves_out)
    assert rec.chosen == winner and rec.source == "measured" and not rec.rejected
    assert rec.bucket.endswith(f"grad=True,interleaved=True,halves_out={halves_out}")


def test_a_per_pair_table_is_chosen_apart(rope_dialect, timer, monkeypatch):
    """The table's width is part of the key: an interleaved call with one table entry per pair
    (D / 2, as torchtitan's complex rotary gives it), which PyTorch's formula first widens, is
    measured on its own, never replayed from the full-width choice of the same shape."""
    fake = timer({"trifuse": 2.0, "torch": 1.0})
    monkeypatch.setattr(rope_dialect, "timer", fake)
    q, k, cos, sin = inputs()

    def interleaved(q, k, cos, sin):
        return trifuse.ops.rotary_embedding(q, k, cos, sin, interleaved=True)

    fwd_bwd(interleaved, q, k, cos, sin)
    assert len(fake.calls) == 2
    pair_cos, pair_sin = cos[..., : D // 2].contiguous(), sin[..., : D // 2].contiguous()
    want = fwd_bwd(lambda *a: rk._rotary_hf_formula(*a, True), q, k, pair_cos, pair_sin)
    for a, e in zip(fwd_bwd(interleaved, q, k, pair_cos, pair_sin), want):
        assert torch.equal(a, e)
    assert len(fake.calls) == 4
    assert f"table_width={D // 2}," in rope_dialect.explain(q, k, pair_cos, pair_sin, True).bucket


def test_a_second_process_replays_the_choice_from_disk(rope_dialect, timer, monkeypatch, new_process):
    monkeypatch.setattr(rope_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    args = inputs()
    trifuse.ops.rotary_embedding(*args)
    new_process()
    rope_dialect.clear()
    second = timer({"trifuse": 1.0, "torch": 2.0})  # would choose trifuse if it timed anything
    monkeypatch.setattr(rope_dialect, "timer", second)
    for a, e in zip(fwd_bwd(trifuse.ops.rotary_embedding, *args), fwd_bwd(rk._rotary_hf_formula, *args)):
        assert torch.equal(a, e)
    rec = rope_dialect.explain(*args)
    assert (rec.chosen, rec.source, second.calls) == ("torch", "disk cache", [])


def test_compiled_graphs_keep_the_registered_op(rope_dialect, timer, monkeypatch):
    monkeypatch.setattr(rope_dialect, "timer", timer({"trifuse": 2.0, "torch": 1.0}))
    args = inputs()
    trifuse.ops.rotary_embedding(*args)
    assert rope_dialect.explain(*args).chosen == "torch"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda *a: trifuse.ops.rotary_embedding(*a), backend=backend, fullgraph=True)(*args)
    assert "trifuse.rotary_embedding" in str(graphs[0].graph)
    for a, e in zip(out, rk.rotary_embedding_ref(*args)):
        torch.testing.assert_close(a, e)


# ---------------------------------------------------------------------------------------------
# The torch candidate: its errors, its dtype and layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["odd head_dim", "cos seq", "sin dtype", "k batch", "q 3-d"])
def test_torch_candidate_raises_trifuse_errors(case):
    q, k, cos, sin = inputs()
    args = {"odd head_dim": (q[..., :5], None, cos[..., :5], sin[..., :5]),
            "cos seq": (q, k, cos[:, :, :-1], sin[:, :, :-1]),
            "sin dtype": (q, k, cos, sin.double()),  # PyTorch would promote
            "k batch": (q, k[:1], cos, sin),  # PyTorch would broadcast k's batch
            "q 3-d": (q[0], None, cos, sin)}[case]
    with pytest.raises((TypeError, ValueError)) as want:
        rk.ROTARY_EMBEDDING.candidate("trifuse").fn(*args)
    with pytest.raises(want.type) as got:
        rk.ROTARY_EMBEDDING.candidate("torch").fn(*args)
    assert str(got.value) == str(want.value) and "trifuse.rotary_embedding" in str(got.value)


def test_torch_candidate_keeps_the_dtype_and_returns_contiguous():
    q, k, cos, sin = inputs(torch.float16)
    q_embed, k_embed = rk.ROTARY_EMBEDDING.candidate("torch").fn(q, k, cos, sin)
    assert q_embed.dtype == k_embed.dtype == torch.float16
    assert q_embed.is_contiguous() and k_embed.is_contiguous()
    assert rk.ROTARY_EMBEDDING.candidate("torch").fn(q, None, cos, sin)[1] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_check_passes_both_and_rejects_a_wrong_rotation(cache_dir, timer, dtype):
    """Negative control on the real op: a candidate with the rotate-half sign flipped must fail."""
    d = Dialect("rotary_check", rk._rotary_key, rk.ROTARY_EMBEDDING.key_names, rk.rotary_embedding_ref)
    for c in rk.ROTARY_EMBEDDING.candidates:
        d.register(c)

    def flipped(q, k, cos, sin):
        return tuple(None if x is None else x * cos - rk.rotate_half(x) * sin for x in (q, k))

    d.register(Candidate("sign-flipped", flipped))
    d.timer = timer({"sign-flipped": 0.1})
    args = inputs(dtype)
    d(*args)
    rec = d.explain(*args)
    assert set(rec.times_ms) == {"trifuse", "torch"} and rec.chosen in ("trifuse", "torch")
    assert rec.rejected["sign-flipped"].startswith("wrong result: output 0")


def test_explain_is_reachable_by_op_name(rope_dialect, timer, monkeypatch):
    monkeypatch.setattr(rope_dialect, "timer", timer({"trifuse": 1.0, "torch": 2.0}))
    args = inputs()
    trifuse.ops.rotary_embedding(*args)
    assert dialects.explain("rotary_embedding", *args).chosen == "trifuse"


# ---------------------------------------------------------------------------------------------
# GPU: the real timer
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dialect_measures_and_replays(rope_dialect, dtype):
    q = torch.randn(2, 2048, 32, 128, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 2048, 8, 128, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    angles = torch.randn(1, 1, 2048, 64, device="cuda").repeat(1, 1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_embed, k_embed = trifuse.ops.rotary_embedding(q, k, cos, sin)
    (q_embed.sum() + k_embed.sum()).backward()
    rec = rope_dialect.explain(q, k, cos, sin)
    assert rec.source.startswith(("measured", "disk cache")) and rec.chosen in rec.times_ms
    assert set(rec.times_ms) == {"trifuse", "torch"}, rec.rejected
