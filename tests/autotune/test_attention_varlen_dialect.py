"""The attention_varlen dialect wired into trifuse.ops.attention_varlen: trifuse's kernels,
PyTorch's varlen_attn and flash-attn's flash_attn_varlen_func when importable.

On the CPU only trifuse's kernels can run: these tests pin the other candidates' rejection
reasons, the check (each sequence against a blockwise float64 reference, the dropout check, with
negative controls), the decision plumbing with a fake timer on a per-sequence SDPA candidate that
stands in for the GPU ones, what never reaches the dialect (a soft cap, sinks, traced calls) and
the cost of the dispatch key. The GPU test times the real candidates in bf16."""
import pytest
import torch
import torch.nn.functional as F
import trifuse
from _device import DEVICE, ON_GPU
from trifuse.autotune import cache, dialects
from trifuse.autotune.dialects import Candidate, Dialect
from trifuse.kernels import attention_varlen as AV

LENS = (5, 0, 19, 1, 12)  # an empty sequence, one of one token


@pytest.fixture
def varlen_dialect(fresh_dialects):
    """The real dialect with its memory cleared before and after the test."""
    return fresh_dialects(AV.ATTENTION_VARLEN)


def packed(lens=LENS, h=2, h_kv=None, d=16, dtype=torch.float32, grad=True, device=DEVICE):
    total = sum(lens)
    q = torch.randn(total, h, d, device=device, dtype=dtype, requires_grad=grad)
    k = torch.randn(total, h_kv or h, d, device=device, dtype=dtype, requires_grad=grad)
    v = torch.randn(total, h_kv or h, d, device=device, dtype=dtype, requires_grad=grad)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def dialect_args(q, k, v, cu, causal=False, dropout_p=0.0, window=0, scale=None):
    """The dialect's normalized positional arguments."""
    m = int((cu[1:] - cu[:-1]).max())
    return (q, k, v, cu, cu, m, m, dropout_p, scale, causal, window)


def per_sequence_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window):
    """A correct stand-in for the GPU candidates: SDPA (math) one sequence at a time."""
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    for b in range(cu_q.shape[0] - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sq.start == sq.stop or sk.start == sk.stop:
            continue
        mask = None
        if window:
            i, j = torch.arange(sq.stop - sq.start)[:, None], torch.arange(sk.stop - sk.start)[None, :]
            mask = (j <= i) & (j > i - window)
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q[sq], k[sk], v[sk])), attn_mask=mask,
                                           dropout_p=dropout_p, is_causal=causal and not window, scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
        out = out.index_copy(0, torch.arange(sq.start, sq.stop), o[0].transpose(0, 1))
    return out


def fwd_bwd(fn, *args):
    o = fn(*args)
    gen = torch.Generator(device=o.device).manual_seed(1)
    do = torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype)
    return (o, *torch.autograd.grad(o, args[:3], do))


def public(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window):
    return trifuse.ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal,
                                        sliding_window=window or None)


@pytest.fixture
def stand_in(varlen_dialect, monkeypatch):
    """The real dialect with the per-sequence SDPA stand-in as a further candidate."""
    monkeypatch.setattr(varlen_dialect, "candidates",
                        (*varlen_dialect.candidates, Candidate("sdpa-per-sequence", per_sequence_sdpa)))
    return varlen_dialect


# ---------------------------------------------------------------------------------------------
# The key and what never reaches the dialect
# ---------------------------------------------------------------------------------------------


def test_key_is_a_small_tuple_of_plain_values(count_calls):
    device = -1 if DEVICE == "cpu" else 0
    args = dialect_args(*packed(h=4, h_kv=2), causal=True, window=4)
    assert AV._varlen_key(*args) == (device, torch.float32, 8, 64, 32, 32, 4, 2, 16, 16, True, 4, False, True)
    assert len(AV._varlen_key(*args)) == len(AV.ATTENTION_VARLEN.key_names)
    assert count_calls(AV._varlen_key, *args) <= 30  # it runs on every eager call: counted, not timed
    q, k, v, cu = packed(grad=False)
    assert AV._varlen_key(*dialect_args(q[:0], k[:0], v[:0], cu.zero_())) is None  # nothing packed


@pytest.mark.parametrize("extra", ["softcap", "sinks"])
def test_a_soft_cap_or_sinks_go_to_trifuse_kernels_without_the_dialect(stand_in, timer, monkeypatch, extra):
    fake = timer({"trifuse": 2.0, "sdpa-per-sequence": 1.0})
    monkeypatch.setattr(stand_in, "timer", fake)
    q, k, v, cu = packed()
    options = {"softcap": 5.0} if extra == "softcap" else {"sinks": torch.randn(2, device=DEVICE)}
    trifuse.ops.attention_varlen(q, k, v, cu, cu, causal=True, **options)
    assert fake.calls == [] and dialects.explain("attention_varlen") == ()


def test_other_candidates_say_why_not_on_this_machine():
    args = dialect_args(*packed(device="cpu"))
    rejected = dict(AV.ATTENTION_VARLEN._eligible(args, False)[1])
    assert "runs on CUDA" in rejected["torch-varlen"]
    assert "flash" in rejected["flash-attn"]  # not installed, or not on CUDA
    assert AV._torch_varlen_supports(*args[:7], 0.1, *args[8:]) == "PyTorch's varlen_attn runs on CUDA, got cpu tensors"


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_reasons_on_the_gpu():
    q, k, v, cu = packed(d=20, dtype=torch.bfloat16, device="cuda")
    assert "multiples of 8" in AV._torch_varlen_supports(*dialect_args(q, k, v, cu))
    q, k, v, cu = packed(dtype=torch.float32, device="cuda")
    assert "float16 / bfloat16" in AV._flash_attn_varlen_supports(*dialect_args(q, k, v, cu))
    q, k, v, cu = packed(dtype=torch.bfloat16, device="cuda")
    assert AV._torch_varlen_supports(*dialect_args(q, k, v, cu, dropout_p=0.1)) == "PyTorch's varlen_attn takes no dropout"


# ---------------------------------------------------------------------------------------------
# The choice, its replay, and what every call sees
# ---------------------------------------------------------------------------------------------


def test_untimed_default_is_trifuse_and_bitwise_equal_to_the_registered_op(varlen_dialect, monkeypatch):
    monkeypatch.setenv("TRIFUSE_AUTOTUNE", "0")
    monkeypatch.setattr(cache, "DEFAULTS_DIR", cache.DEFAULTS_DIR / "none")  # no shipped defaults
    args = dialect_args(*packed(), causal=True)

    def registered(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window):
        return torch.ops.trifuse.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, 0.0,
                                                  None, window)[0]

    for a, e in zip(fwd_bwd(public, *args), fwd_bwd(registered, *args)):
        assert torch.equal(a, e)
    assert varlen_dialect.explain(*args).chosen == "trifuse"


@pytest.mark.parametrize("winner", ["trifuse", "sdpa-per-sequence"])
@pytest.mark.parametrize("form", ["full", "causal", "window", "gqa"])
def test_the_measured_winner_runs_bitwise(stand_in, timer, monkeypatch, winner, form):
    fake = timer({"trifuse": 1.0, "sdpa-per-sequence": 2.0} if winner == "trifuse"
                 else {"trifuse": 2.0, "sdpa-per-sequence": 1.0})
    monkeypatch.setattr(stand_in, "timer", fake)
    args = dialect_args(*packed(h=4, h_kv=2 if form == "gqa" else None), causal=form in ("causal", "window"),
                        window=4 if form == "window" else 0)
    want = fwd_bwd(stand_in.candidate(winner).fn, *args)
    for a, e in zip(fwd_bwd(public, *args), want):
        assert torch.equal(a, e)
    rec = stand_in.explain(*args)
    assert rec.chosen == winner and rec.source == "measured" and set(fake.calls) == {"trifuse", "sdpa-per-sequence"}
    assert rec.rejected.keys() == {"torch-varlen", "flash-attn"}
    public(*args)  # replayed
    assert len(fake.calls) == 2


def test_dropout_calls_are_checked_for_a_changed_repeatable_output(stand_in, timer, monkeypatch):
    monkeypatch.setattr(stand_in, "timer", timer({"trifuse": 2.0, "sdpa-per-sequence": 1.0}))
    args = dialect_args(*packed(), causal=True, dropout_p=0.3)
    public(*args)
    rec = stand_in.explain(*args)
    assert rec.chosen == "sdpa-per-sequence" and set(rec.times_ms) == {"trifuse", "sdpa-per-sequence"}
    assert rec.bucket.endswith("dropout=True,grad=True")


def test_a_second_process_replays_the_choice_from_disk(stand_in, timer, monkeypatch, new_process):
    monkeypatch.setattr(stand_in, "timer", timer({"trifuse": 2.0, "sdpa-per-sequence": 1.0}))
    args = dialect_args(*packed(), causal=True)
    public(*args)
    new_process()
    stand_in.clear()
    second = timer({"trifuse": 1.0, "sdpa-per-sequence": 2.0})
    monkeypatch.setattr(stand_in, "timer", second)
    for a, e in zip(fwd_bwd(public, *args), fwd_bwd(per_sequence_sdpa, *args)):
        assert torch.equal(a, e)
    rec = stand_in.explain(*args)
    assert (rec.chosen, rec.source, second.calls) == ("sdpa-per-sequence", "disk cache", [])


def test_compiled_graphs_keep_the_registered_op(stand_in, timer, monkeypatch):
    monkeypatch.setattr(stand_in, "timer", timer({"trifuse": 2.0, "sdpa-per-sequence": 1.0}))
    q, k, v, cu = packed()
    m = max(LENS)
    trifuse.ops.attention_varlen(q, k, v, cu, cu, m, m, causal=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(lambda *a: trifuse.ops.attention_varlen(*a, causal=True), backend=backend,
                        fullgraph=True)(q, k, v, cu, cu, m, m)
    assert "trifuse.attention_varlen" in str(graphs[0].graph)
    torch.testing.assert_close(out, per_sequence_sdpa(*dialect_args(q, k, v, cu, causal=True)))


# ---------------------------------------------------------------------------------------------
# The check and its negative controls
# ---------------------------------------------------------------------------------------------


def _checking(candidate, timer):
    d = Dialect("attention_varlen_check", AV._varlen_key, AV._DIALECT_KEY_NAMES, AV._varlen_dialect_ref,
                check=AV._varlen_check, output_like=AV._varlen_output_like)
    d.register(AV.ATTENTION_VARLEN.candidate("trifuse"))
    d.register(Candidate("sdpa-per-sequence", per_sequence_sdpa))
    d.register(candidate)
    d.timer = timer({})
    return d


@pytest.mark.parametrize("wrong", ["one sequence", "not causal", "no window", "no dropout", "dropout unrepeatable"])
def test_check_rejects_a_wrong_candidate(cache_dir, timer, wrong):
    def one_sequence(q, k, v, cu_q, cu_k, *rest):  # attends across the packed sequences
        whole = torch.tensor([0, q.shape[0]], dtype=cu_q.dtype)
        return per_sequence_sdpa(q, k, v, whole, whole, *rest)

    def unrepeatable(*args):
        torch.manual_seed(torch.seed() % 1000 + 1)  # a fresh mask every call
        return per_sequence_sdpa(*args)

    fn = {"one sequence": one_sequence,
          "not causal": lambda *a: per_sequence_sdpa(*a[:9], False, a[10]),
          "no window": lambda *a: per_sequence_sdpa(*a[:10], 0),
          "no dropout": lambda *a: per_sequence_sdpa(*a[:7], 0.0, *a[8:]),
          "dropout unrepeatable": unrepeatable}[wrong]
    d = _checking(Candidate("wrong", fn), timer)
    args = dialect_args(*packed(), causal=True, window=4 if wrong == "no window" else 0,
                        dropout_p=0.3 if wrong.startswith(("no dropout", "dropout")) else 0.0)
    d(*args)
    rec = d.explain(*args)
    assert set(rec.times_ms) == {"trifuse", "sdpa-per-sequence"}, rec.rejected
    expected = {"no dropout": "wrong result: dropout check: the output at dropout_p=0.3 equals",
                "dropout unrepeatable": "wrong result: dropout check: output is not repeatable"}.get(wrong,
                                                                                                    "wrong result: output")
    assert rec.rejected["wrong"].startswith(expected), rec.rejected["wrong"]


# ---------------------------------------------------------------------------------------------
# GPU: the real candidates and the real timer
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_dialect_measures_and_replays(varlen_dialect, causal):
    # no GQA: torch 2.11's varlen_attn takes none
    q, k, v, cu = packed(lens=(1024, 300, 2048, 77), h=16, d=128, dtype=torch.bfloat16, device="cuda")
    args = dialect_args(q, k, v, cu, causal=causal)
    public(*args).sum().backward()
    rec = varlen_dialect.explain(*args)
    assert rec.source.startswith(("measured", "disk cache")) and rec.chosen in rec.times_ms
    assert {"trifuse", "torch-varlen"} <= set(rec.times_ms), rec.rejected
