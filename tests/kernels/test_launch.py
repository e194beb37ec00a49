"""CachedKernel: the thin launch path must launch exactly what Triton's own path launches."""
import types

import pytest
import torch
import triton
import triton.language as tl

from _device import DEVICE, ON_GPU, set_interpreter_overflow_checks
from trifuse.kernels._launch import CachedKernel, launcher_tail


@triton.jit
def _axpy_kernel(X, Y, OUT, n, alpha, BLOCK: tl.constexpr, HAS_Y: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(X + offs, mask=mask) * alpha
    if HAS_Y:
        v += tl.load(Y + offs, mask=mask)
    tl.store(OUT + offs, v, mask=mask)


AXPY = CachedKernel(_axpy_kernel)


def launch(x, y, n, alpha, has_y):
    out = torch.empty_like(x)
    AXPY[(triton.cdiv(n, 64),)](x, y, out, n, alpha, BLOCK=64, HAS_Y=has_y, num_warps=1)
    return out


@pytest.mark.parametrize("n", [1, 37, 256])
def test_repeated_launches_match_the_reference(n):
    base = torch.randn(n + 3, device=DEVICE)
    y = torch.randn(n + 3, device=DEVICE)
    for offset in (0, 1, 0, 1):  # aligned and misaligned pointers, each launched twice
        x = base[offset:offset + n]
        for alpha, has_y in ((2.0, True), (-0.5, False), (2.0, True)):
            out = launch(x, y[:n], n, alpha, has_y)
            torch.testing.assert_close(out, x * alpha + (y[:n] if has_y else 0), rtol=0, atol=1e-6)


@triton.jit
def _scale_kernel(X, OUT, n, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(X + offs, mask=offs < n)
    if NEGATE:
        v = -v
    tl.store(OUT + offs, v, mask=offs < n)


SCALE = CachedKernel(_scale_kernel)


def test_a_constexpr_left_to_its_default_reaches_the_launcher():
    """The direct launcher takes every parameter after the runtime ones. A constexpr with a default
    that a call leaves out (the norms' PREFETCH, set only by some configs) is its default there:
    on the H200 (2026-12-04) the launch raised KeyError: 'PREFETCH' and every fused LayerNorm
    backward failed; the interpreter takes Triton's own path and never ran this one."""
    assert launcher_tail(_scale_kernel, 3, {"BLOCK": 64, "num_warps": 1}) == (64, False)
    assert launcher_tail(_scale_kernel, 3, {"BLOCK": 64, "NEGATE": True}) == (64, True)
    with pytest.raises(TypeError, match="_scale_kernel: argument 'BLOCK'"):
        launcher_tail(_scale_kernel, 3, {"NEGATE": True})
    x = torch.randn(50, device=DEVICE)
    for negate in (None, True, None):  # the default, then set, then the default again
        out = torch.empty_like(x)
        kwargs = {} if negate is None else {"NEGATE": negate}
        SCALE[(1,)](x, out, 50, BLOCK=64, num_warps=1, **kwargs)
        torch.testing.assert_close(out, -x if negate else x, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_caches_one_compiled_kernel_per_specialization():
    assert ON_GPU
    AXPY._compiled.clear()
    x = torch.randn(100, device="cuda")
    launch(x, x, 100, 1.0, True)
    launch(x, x, 100, 3.0, True)  # floats do not specialize
    assert len(AXPY._compiled) == 1
    launch(x[1:], x[1:], 99, 1.0, True)  # misaligned pointers and n: a new specialization
    assert len(AXPY._compiled) == 2
    assert AXPY._fast, "the direct launcher path fell back to Triton's own path"



@pytest.mark.gpu
def test_gpu_direct_launch_of_rotary_gated_and_softcap_attention():
    """The kernels added last (rotary, gated_activation, attention with a soft cap) were only run
    in the interpreter, where CachedKernel takes Triton's own path. On the GPU the second call of
    a shape goes through the direct launcher (runtime arguments, then the constexprs in the
    kernel's order): it must give the first call's bits and never fall back (a launcher whose
    arguments do not line up raises, warns and falls back to Triton's path)."""
    import warnings

    from trifuse.kernels import attention as attn
    from trifuse.kernels import gated_activation as gk
    from trifuse.kernels import rotary as rk

    torch.manual_seed(0)
    bf16 = torch.bfloat16
    q = torch.randn(2, 37, 4, 80, device="cuda", dtype=bf16).transpose(1, 2)  # (B, H, S, D) views
    k = torch.randn(2, 37, 2, 80, device="cuda", dtype=bf16).transpose(1, 2)
    cos, sin = torch.randn(1, 1, 37, 80, device="cuda"), torch.randn(1, 1, 37, 80, device="cuda")  # fp32 tables
    gate, up = torch.randn(3, 7, 2 * 700, device="cuda", dtype=bf16).chunk(2, dim=-1)
    dy = torch.randn(3, 7, 700, device="cuda", dtype=bf16)
    aq = torch.randn(2, 4, 70, 64, device="cuda", dtype=bf16)
    ak, av = torch.randn(2, 2, 70, 64, device="cuda", dtype=bf16), torch.randn(2, 2, 70, 64, device="cuda", dtype=bf16)
    do = torch.randn_like(aq)

    def calls():
        fwd = rk.rotary_embedding_fwd(q, k, cos, sin)
        bwd = rk.rotary_embedding_bwd(fwd[0], fwd[1], cos, sin, bf16, True, True)
        y = gk.gated_activation_fwd(gate, up, "silu")
        dgate, dup = gk.gated_activation_bwd(dy, gate, up, "gelu_tanh")
        o, lse = attn.attention_fwd(aq, ak, av, None, 0.0, True, 0.125, None, 30.0)
        grads = attn.attention_bwd(do, aq, ak, av, o, lse, None, None, 0.0, True, 0.125, False, 30.0)
        return [*fwd, *bwd, y, dgate, dup, o, lse, *grads[:3]]

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to Triton's path warns
        first = calls()
        second, third = calls(), calls()
    torch.cuda.synchronize()
    for i, (a, b, c) in enumerate(zip(first, second, third)):
        assert torch.equal(a, b) and torch.equal(b, c), f"output {i}: the direct launch differs"
    for kernel in (rk._rotary_embedding, gk._gated_activation_fwd, gk._gated_activation_bwd, attn._FWD,
                   attn._BWD_PREPROCESS, attn._BWD_DKDV, attn._BWD_DQ):
        assert kernel._fast, f"{kernel.fn.__name__}: the direct launcher fell back to Triton's path"
    assert torch.isfinite(first[-4]).all() and torch.isfinite(first[-1]).all()

def test_attention_launches_through_cached_plans(monkeypatch):
    """The tuner decides once per tuning key; the launch plan (grid + launch keywords) is kept
    per exact shape, and every later call launches all four kernels (forward, backward
    preprocess, dK/dV, dQ) through CachedKernel with that plan: the same constexprs plus the
    config's block sizes and launch options, and no tuner call."""
    from trifuse.kernels import attention as attn

    calls, decided = [], []

    class FakeTuner:
        def config(self, key, launch, *args):
            decided.append(key)
            return triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=2, num_stages=1)

        def is_decided(self, key):
            return key in decided

    class FakeCached:
        def __init__(self, name):
            self.name = name

        def run(self, grid, args, kwargs):
            calls.append((self.name, grid, kwargs))

        def __getitem__(self, grid):
            return lambda *a, **kw: self.run(grid, a, kw)

    fakes = {name: FakeCached(name) for name in ("fwd", "pre", "dkdv", "dq")}
    monkeypatch.setattr(attn, "_TUNERS", {kind: FakeTuner() for kind in ("fwd", "dkdv", "dq")})
    monkeypatch.setattr(attn, "_FWD", fakes["fwd"])
    monkeypatch.setattr(attn, "_BWD_PREPROCESS", fakes["pre"])
    monkeypatch.setattr(attn, "_BWD_DKDV", fakes["dkdv"])
    monkeypatch.setattr(attn, "_BWD_DQ", fakes["dq"])
    monkeypatch.setattr(attn, "_CACHED", {"fwd": fakes["fwd"], "dkdv": fakes["dkdv"], "dq": fakes["dq"]})
    monkeypatch.setattr(attn, "_FWD_PLANS", {})
    monkeypatch.setattr(attn, "_BWD_PLANS", {})
    q = torch.randn(2, 3, 40, 16, device=DEVICE)
    for _ in range(3):
        o, lse = attn.attention_fwd(q, q, q, None, 0.0, True, 0.25, None)
        attn.attention_bwd(torch.ones_like(o), q, q, q, o, lse, None, None, 0.0, True, 0.25)
    assert len(decided) == 3, "the tuner is asked once per kernel, not per call"
    assert len(attn._FWD_PLANS) == 1 and len(attn._BWD_PLANS) == 1
    assert [c[0] for c in calls] == ["fwd", "pre", "dkdv", "dq"] * 3
    assert calls[4:8] == calls[8:12] and calls[0] == calls[4], "later calls replay the first call's plan"
    fwd, _, dkdv, dq = calls[4:8]
    assert fwd[1] == (3, 6) and dkdv[1] == (3, 6) and dq[1] == (3, 6)
    assert fwd[2] == {"HEAD_DIM": 16, "BLOCK_D": 16, "HEAD_DIM_V": 16, "BLOCK_DV": 16, "IS_CAUSAL": True, "MASK_KIND": 0, "HAS_DROPOUT": False,
                      "SOFTCAP": False, "DOT_PRECISION": "ieee", "ACC": attn.acc_dtype(q.dtype), "USE_TMA": False,
                      "HAS_SINKS": False, "HAS_BOUNDS": False, "BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2,
                      "num_stages": 1}
    attn.attention_fwd(q[:, :, :20], q, q, None, 0.0, True, 0.25, None)  # another shape: its own plan
    assert len(attn._FWD_PLANS) == 2


def test_attention_tuning_is_recorded_for_the_report():
    """Attention's block sizes go through trifuse's tuner: the decision is recorded (and kept on
    disk when timed), so trifuse.report and `python -m trifuse.autotune` show it."""
    import trifuse
    from trifuse.autotune import records
    from trifuse.kernels import attention as attn

    for t in attn._TUNERS.values():
        t.clear()
    attn._FWD_PLANS.clear()
    attn._BWD_PLANS.clear()
    q = torch.randn(1, 2, 5, 16, device=DEVICE, requires_grad=True)
    out = trifuse.ops.attention(q, q, q, is_causal=True)
    out.sum().backward()
    names = {d.name for d in records(kind="kernel")}
    assert {"attention_fwd", "attention_dkdv", "attention_dq"} <= names


class _FakeJit:
    """Stands in for a @triton.jit function on the direct-launch path: Triton's own launch
    (`fn[grid](...)`) returns a compiled kernel whose `run` records what it was given."""

    arg_names = ["X", "OUT", "n", "alpha", "BLOCK", "HAS_Y"]
    __name__ = "fake_kernel"

    def __init__(self):
        self.slow_launches = 0
        self.runs = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.slow_launches += 1
            fake = self

            class Compiled:
                function, packed_metadata = "function", "packed"

                def launch_metadata(self, grid, stream, *a):
                    return ("meta", grid, stream, *a)

                def run(self, *a):
                    fake.runs.append(a)
            return Compiled()
        return launch


def _direct_path(monkeypatch, enter_hook=None, exit_hook=None):
    """(fake jit function, CachedKernel on the direct path) with a fake device, stream and hooks."""
    import trifuse.kernels._launch as launch_mod

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(launch_mod, "_knobs", types.SimpleNamespace(
        runtime=types.SimpleNamespace(launch_enter_hook=enter_hook, launch_exit_hook=exit_hook)))
    fake = _FakeJit()
    kernel = CachedKernel(fake)
    kernel._fast = True
    return fake, kernel


def test_direct_launch_path_keys_and_arguments(monkeypatch):
    """The direct path (GPU only in real use) driven on CPU with a fake compiled kernel: one
    entry per launch signature, floats not part of it, and the launcher gets the grid, the stream,
    the runtime arguments and then the constexprs, in the kernel's order."""
    import trifuse.kernels._launch as launch_mod

    fake, kernel = _direct_path(monkeypatch)
    buf = torch.zeros(64)
    x, out = buf[:16], buf[16:32]
    kernel[(3,)](x, out, 16, 2.0, BLOCK=64, HAS_Y=True, num_warps=1)  # first: Triton's own path
    assert fake.slow_launches == 1 and not fake.runs
    kernel[(3,)](x, out, 16, 5.0, BLOCK=64, HAS_Y=True, num_warps=1)  # another float: same entry
    assert fake.slow_launches == 1 and len(kernel._compiled) == 1
    # tensors reach the launcher as their addresses, then the constexprs in the kernel's order
    assert fake.runs[-1] == (3, 1, 1, 1234, "function", "packed", None, None, None,
                             x.data_ptr(), out.data_ptr(), 16, 5.0, 64, True)
    for call in (
        lambda: kernel[(3,)](x, out, 17, 2.0, BLOCK=64, HAS_Y=True, num_warps=1),  # another int
        lambda: kernel[(3,)](buf[1:17], out, 16, 2.0, BLOCK=64, HAS_Y=True, num_warps=1),  # misaligned
        lambda: kernel[(3,)](x, out, 16, 2.0, BLOCK=64, HAS_Y=False, num_warps=1),  # a constexpr
        lambda: kernel[(3,)](x, out, 16, 2.0, BLOCK=64, HAS_Y=True, num_warps=2),  # a launch option
        lambda: kernel[(3,)](x.double(), out, 16, 2.0, BLOCK=64, HAS_Y=True, num_warps=1),  # a dtype
    ):
        before = fake.slow_launches
        call()
        assert fake.slow_launches == before + 1, "a different specialization reused a compiled kernel"
    monkeypatch.setattr(launch_mod, "MAX_ENTRIES", len(kernel._compiled))
    kernel[(3,)](x, out, 99, 2.0, BLOCK=64, HAS_Y=True, num_warps=1)
    assert len(kernel._compiled) == 1, "the cache is bounded"


def test_direct_launch_gives_launch_hooks_the_tensors(monkeypatch):
    """With a launch hook set (a profiler's), the launcher gets the tensors themselves and the
    hook its metadata, as on Triton's own path; without one, addresses."""
    hook = object()
    fake, kernel = _direct_path(monkeypatch, enter_hook=hook)
    x, out = torch.zeros(16), torch.zeros(16)
    for _ in range(2):  # the first through Triton's path, the second direct
        kernel[(3,)](x, out, 16, 2.0, BLOCK=64, HAS_Y=True, num_warps=1)
    assert fake.slow_launches == 1
    assert fake.runs[-1][7] is hook and fake.runs[-1][6] == ("meta", (3,), 1234, x, out, 16, 2.0, 64, True)
    assert fake.runs[-1][9] is x and fake.runs[-1][10] is out


def test_direct_launch_skips_empty_hook_chains(monkeypatch):
    """Newer Tritons keep a hook chain (with a `calls` list) even when nothing is hooked: an empty
    one is not handed to the launcher, which then gets addresses and no metadata."""
    enter, exit_ = types.SimpleNamespace(calls=[]), types.SimpleNamespace(calls=[])
    fake, kernel = _direct_path(monkeypatch, enter_hook=enter, exit_hook=exit_)
    x, out = torch.zeros(16), torch.zeros(16)
    for _ in range(2):
        kernel[(3,)](x, out, 16, 2.0, BLOCK=64, HAS_Y=True, num_warps=1)
    assert fake.runs[-1][6:11] == (None, None, None, x.data_ptr(), out.data_ptr())
    exit_.calls.append(print)  # a profiler hooks in: metadata and tensors again
    kernel[(3,)](x, out, 16, 2.0, BLOCK=64, HAS_Y=True, num_warps=1)
    assert fake.runs[-1][6][0] == "meta" and fake.runs[-1][8] is exit_
    assert fake.runs[-1][9] is x


@triton.jit
def _scaled(v, alpha):  # a helper: each call re-patched triton.language in Triton's own interpreter
    return v * alpha


@triton.jit
def _row_sum_kernel(X, OUT, n, alpha, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    v = tl.load(X + tl.program_id(0) * n + offs, mask=offs < n, other=0.0)
    tl.store(OUT + tl.program_id(0), tl.sum(_scaled(v, alpha), axis=0) + tl.max(v, axis=0))


@pytest.mark.skipif(ON_GPU, reason="the interpreter's language patch (tests/_device.py)")
def test_interpreter_patched_once_per_launch_runs_as_triton_patches_it(monkeypatch):
    """tests/_device.py skips the interpreter's re-patching of triton.language on calls inside a
    launch: the kernel gives bitwise what it gives with every call re-patched, and the language
    is Triton's own again after the launch (and after a launch that raised). Not `tl.core`'s
    functions: a call of Triton's own `tl.sum` patches those for good, in Triton's interpreter as
    it is too (the check passed or failed by test order)."""
    from triton.runtime import interpreter

    assert hasattr(interpreter._patch_lang, "__wrapped__"), "tests/_device.py did not install its patch"
    x = torch.randn(5, 37, device=DEVICE)

    def row_sums():
        out = torch.empty(5, device=DEVICE)
        _row_sum_kernel[(5,)](x, out, 37, 0.5, BLOCK=64)
        return out

    before = (tl.sum, tl.max, tl.load, tl.tensor.__add__, tl.exp)
    fast = row_sums()
    assert (tl.sum, tl.max, tl.load, tl.tensor.__add__, tl.exp) == before
    with pytest.raises(Exception):
        _row_sum_kernel[(5,)](x, None, 37, 0.5, BLOCK=64)  # OUT is None: fails inside the launch
    assert (tl.sum, tl.max, tl.load, tl.tensor.__add__, tl.exp) == before
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.__wrapped__)
    assert torch.equal(fast, row_sums())
    torch.testing.assert_close(fast, (x * 0.5).sum(1) + x.amax(1), rtol=1e-6, atol=1e-6)


@triton.jit
def _half_row_kernel(X, OUT, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tile = X + tl.program_id(0) * n + offs[:, None] * 0 + offs[None, :]  # the row, BLOCK times over
    v = tl.load(tile, mask=offs[None, :] < n, other=0.0)
    row = tl.sum(v.to(tl.float32) * 1.5, axis=0).to(tl.float16)
    tl.store(OUT + tl.program_id(0) * n + offs, row, mask=offs < n)


def _built_by_tritons_own(cls, *args):
    """cls(*args) by Triton's own __init__, tests/_device.py's memo set aside."""
    memo = cls.__init__
    cls.__init__ = memo.__wrapped__
    try:
        return cls(*args)
    finally:
        cls.__init__ = memo


@pytest.mark.skipif(ON_GPU, reason="the interpreter's memoized types (tests/_device.py)")
def test_interpreter_memoized_types_are_tritons_own(monkeypatch):
    """tests/_device.py memoizes three pure functions of a Triton type: what they give is what
    Triton's own give, for dtypes, pointers and block types of each; a bad shape still raises
    Triton's error (and is never remembered); and a kernel gives bitwise what it gives without."""
    from triton.runtime import interpreter

    memo_np, memo_init = interpreter._get_np_dtype, tl.block_type.__init__
    memo_tensor_init = tl.tensor.__init__
    for memo in (memo_np, memo_init, memo_tensor_init):
        assert hasattr(memo, "__wrapped__"), "tests/_device.py did not patch"
    scalars = [tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int1, tl.int8, tl.int32, tl.uint64,
               tl.float8e4nv, tl.pointer_type(tl.float32), tl.pointer_type(tl.float32, const=True)]
    for shape in ([4], [2, 8], tl.tuple([1, 16, 32]), tl.tuple([2, 8])):
        for element in scalars:
            tl.block_type(element, shape)  # remembered, if it was not yet
            block, own = tl.block_type(element, shape), _built_by_tritons_own(tl.block_type, element, shape)
            assert block == own and block.element_ty is element
            assert (block.shape, block.numel, block.name) == (own.shape, own.numel, own.name)
            for t in (element, block):
                tl.tensor(None, t)
                memo_tensor, own_tensor = tl.tensor(None, t), _built_by_tritons_own(tl.tensor, None, t)
                assert memo_tensor.type is t and memo_tensor.dtype == own_tensor.dtype
                assert memo_tensor.shape == own_tensor.shape and memo_tensor.numel == own_tensor.numel
                assert memo_np(t) == memo_np(t) == memo_np.__wrapped__(t), t
            # the memo is in use (not set aside by a Triton whose constructors set more)
            assert tl.tensor(None, block).shape is tl.tensor(None, block).shape
            assert tl.block_type(element, shape).shape is block.shape
    # (Triton's `tuple` is its own class: a Python tuple for a shape fails its assert)
    for bad, error in (([3], ValueError), ([], TypeError), ([2, 6], ValueError), ((4,), AssertionError)):
        for _ in range(2):
            with pytest.raises(error):
                tl.block_type(tl.float32, bad)
    x = torch.randn(3, 20, device=DEVICE).half()

    def launch():
        out = torch.empty_like(x)
        _half_row_kernel[(3,)](x, out, 20, BLOCK=32)
        return out

    fast = launch()
    monkeypatch.setattr(interpreter, "_get_np_dtype", memo_np.__wrapped__)
    monkeypatch.setattr(tl.block_type, "__init__", memo_init.__wrapped__)
    monkeypatch.setattr(tl.tensor, "__init__", memo_tensor_init.__wrapped__)
    assert torch.equal(fast, launch())
    torch.testing.assert_close(fast, (x.float() * 1.5 * 32).half(), rtol=1e-3, atol=1e-3)


@triton.jit
def _outer_kernel(X, Y, OUT, n, scale, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    y = tl.load(Y + offs, mask=offs < n, other=0.0)
    same = x * y + scale  # blocks of one shape, then a block and a scalar
    outer = x[:, None] * y[None, :] - same[None, :]  # (BLOCK, 1) against (1, BLOCK)
    rows = tl.sum(outer, axis=1) + x  # (BLOCK,) against (BLOCK,) again
    tl.store(OUT + offs, rows.to(tl.float16), mask=offs < n)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's broadcast short cut (tests/_device.py)")
def test_interpreter_broadcast_short_cut_is_tritons_own(monkeypatch):
    """tests/_device.py hands two blocks of one shape back from the interpreter's broadcast as
    they came, as Triton's own does after comparing the shapes, and splats a number beside a
    block to a type built once; every other pair goes to Triton's. Blocks of one shape come back
    as the same objects either way (whatever their dtypes); a splat number has Triton's type and
    values on either side of the block, the second time too; and a kernel broadcasting blocks of
    one shape, numbers, rows and columns gives bitwise the same."""
    import numpy as np
    from triton.runtime import interpreter

    semantic = interpreter.interpreter_semantic
    short_cut = semantic.broadcast_impl_value
    assert hasattr(short_cut, "__wrapped__"), "tests/_device.py did not patch"
    for shape in ([4], [2, 8], tl.tuple([1, 16, 32])):
        for left, right in ((tl.float32, tl.float32), (tl.int32, tl.float16)):
            a, b = tl.tensor(None, tl.block_type(left, shape)), tl.tensor(None, tl.block_type(right, shape))
            for broadcast in (short_cut, short_cut.__wrapped__):
                out = broadcast(a, b)
                assert out[0] is a and out[1] is b
    block = tl.tensor(interpreter.TensorHandle(np.arange(16, dtype=np.float32).reshape(2, 8), tl.float32),
                      tl.block_type(tl.float32, [2, 8]))
    for number in (semantic.to_tensor(2.5), semantic.to_tensor(3)):  # fp32, int32
        for pair in ((block, number), (number, block), (block, number)):
            for mine, own in zip(short_cut(*pair), short_cut.__wrapped__(*pair)):
                assert mine.type == own.type and mine.handle.dtype == own.handle.dtype
                assert np.array_equal(mine.handle.data, own.handle.data)
                assert mine.handle.data.dtype == own.handle.data.dtype
    x, y = torch.randn(2, 37, device=DEVICE)

    def launch():
        out = torch.empty(37, device=DEVICE, dtype=torch.float16)
        _outer_kernel[(1,)](x, y, out, 37, 0.25, BLOCK=64)
        return out

    fast = launch()
    monkeypatch.setattr(semantic, "broadcast_impl_value", short_cut.__wrapped__)
    assert torch.equal(fast, launch())
    padding = (64 - 37) * 0.25  # the masked columns load zeros: each subtracts the scale
    expected = (x[:, None] * y[None, :] - (x * y + 0.25)[None, :]).sum(1) - padding + x
    torch.testing.assert_close(fast, expected.half(), rtol=2e-3, atol=2e-3)


@triton.jit
def _typed_ops_kernel(X, OUT, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=1.0)  # pointer + offsets: Triton's own path
    h = x.to(tl.float16)
    q = h / (h + 2.0)  # fp16 / fp16 computes in fp32 in Triton: never short-cut
    r = (h * h - h).to(tl.float32) + q  # fp16 with fp16, then fp16-turned-fp32 with fp32
    i = offs * 3 % 7 + (offs // 2)  # int32 with int32, a modulo and a division among them
    keep = (offs < n) & (i > 2)  # int1 with int1
    tl.store(OUT + offs, tl.where(keep, r / x + i, 0.0), mask=offs < n)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's binary type-check short cut (tests/_device.py)")
def test_interpreter_binary_type_check_short_cut_is_tritons_own(monkeypatch):
    """tests/_device.py sends two tensors of one element type straight to the broadcast, skipping
    the interpreter's promotion rules and casts, except a division or modulo of fp16 or bf16 (fp32
    in Triton). For every pair of element types it takes, with and without a division, the types
    that come back are Triton's own; fp16 and bf16 divisions still come back in fp32; and a kernel
    of same-typed, mixed and pointer ops gives bitwise the same either way."""
    import numpy as np
    from triton.runtime import interpreter

    semantic = interpreter.interpreter_semantic
    short_cut = semantic.binary_op_type_checking_impl
    assert hasattr(short_cut, "__wrapped__"), "tests/_device.py did not patch"
    for element in (tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.int1, tl.int8, tl.int32, tl.int64,
                    tl.uint8, tl.uint32):
        for shape in ([4], [2, 8]):
            dtype = interpreter._get_np_dtype(element)
            a, b = (tl.tensor(interpreter.TensorHandle(np.ones(shape, dtype=dtype), element),
                              tl.block_type(element, shape)) for _ in range(2))
            for div_or_mod in (False, True):
                mine = short_cut(a, b, div_or_mod=div_or_mod)
                own = short_cut.__wrapped__(a, b, div_or_mod=div_or_mod)
                assert [t.type for t in mine] == [t.type for t in own], (element, div_or_mod)
                if element in (tl.float16, tl.bfloat16) and div_or_mod:
                    assert own[0].dtype == tl.float32 and mine[0].dtype == tl.float32
                else:
                    assert mine[0] is a and mine[1] is b
    # a pointer beside integers, allowed on its side (as they are), or not (Triton's error)
    fp32_pointer = tl.pointer_type(tl.float32)
    address = tl.tensor(interpreter.TensorHandle(np.array([64], dtype=np.uint64), fp32_pointer), fp32_pointer)
    for element in (tl.int32, tl.int64, tl.uint8, tl.int1):
        ones = np.ones([4], dtype=interpreter._get_np_dtype(element))
        offsets = tl.tensor(interpreter.TensorHandle(ones, element), tl.block_type(element, [4]))
        for pair, allow in (((address, offsets), (True, False)), ((offsets, address), (False, True))):
            mine, own = short_cut(*pair, *allow), short_cut.__wrapped__(*pair, *allow)
            assert [t.type for t in mine] == [t.type for t in own]  # the address splat beside the block
            assert all(np.array_equal(m.handle.data, o.handle.data) for m, o in zip(mine, own))
            for checks in (short_cut, short_cut.__wrapped__):
                with pytest.raises(Exception, match="invalid operands"):
                    checks(*pair, False, False)
    x = torch.rand(37, device=DEVICE) + 0.5

    def launch():
        out = torch.empty(37, device=DEVICE)
        _typed_ops_kernel[(1,)](x, out, 37, BLOCK=64)
        return out

    fast = launch()
    monkeypatch.setattr(semantic, "binary_op_type_checking_impl", short_cut.__wrapped__)
    assert torch.equal(fast, launch())
    h = x.half()
    r = (h * h - h).float() + (h.float() / (h.float() + 2.0))
    offs = torch.arange(37, device=DEVICE)
    i = offs * 3 % 7 + offs // 2
    expected = torch.where(i > 2, r / x + i, 0.0)
    torch.testing.assert_close(fast, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's lean builtin calls (tests/_device.py)")
def test_interpreter_lean_builtin_calls_are_tritons_own(monkeypatch):
    """tests/_device.py patches each `tl.core.builtin` with one wrapper that passes the
    interpreter's semantic, and short-cuts `_unwrap_if_constexpr` for plain values: inside a
    launch the builtins are the lean wrappers (and Triton's own again after it), the short cut
    gives what Triton's gives for tensors, numbers, None, constexprs and lists of them, and the
    kernels above give bitwise the same with both set aside."""
    from triton.runtime import interpreter

    lean, unwrap = interpreter._patch_attr, tl.core._unwrap_if_constexpr
    for patched in (lean, unwrap):
        assert hasattr(patched, "__wrapped__"), "tests/_device.py did not patch"
    seen = {}

    @triton.jit
    def spy(X):
        seen_here(tl.load(X))

    def seen_here(_):  # (called in the launch, as the interpreter runs a kernel in Python)
        seen["load"], seen["where"] = tl.load, tl.where

    monkeypatch.setitem(spy.fn.__globals__, "seen_here", seen_here)  # (this module's globals: put back after)
    before = tl.load
    spy[(1,)](torch.ones(1, device=DEVICE))
    assert seen["load"].__code__.co_name == "call" and seen["where"].__code__.co_name == "call"
    assert tl.load is before
    block = tl.tensor(None, tl.block_type(tl.float32, [4]))
    assert unwrap(block) is unwrap.__wrapped__(block) is block
    for value in (3, 2.5, True, None, tl.constexpr(7), [tl.constexpr(1), 2], tl.float32):
        mine, own = unwrap(value), unwrap.__wrapped__(value)
        assert type(mine) is type(own) and mine == own, value
    x = torch.rand(37, device=DEVICE) + 0.5

    def launches():
        out, rows = torch.empty(37, device=DEVICE), torch.empty(5, device=DEVICE)
        _typed_ops_kernel[(1,)](x, out, 37, BLOCK=64)
        _row_sum_kernel[(5,)](x[:35], rows, 7, 0.5, BLOCK=8)
        return out, rows

    fast = launches()
    monkeypatch.setattr(interpreter, "_patch_attr", lean.__wrapped__)
    monkeypatch.setattr(tl.core, "_unwrap_if_constexpr", unwrap.__wrapped__)
    for mine, own in zip(fast, launches()):
        assert torch.equal(mine, own)


@triton.jit
def _scale_int_kernel(X, OUT, factor):
    tl.store(OUT, tl.load(X) * factor)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's integer-overflow sanitizer (tests/_device.py)")
def test_interpreter_overflow_checks_assert_nothing_so_they_are_skipped():
    """tests/_device.py turns the interpreter's overflow sanitizer off for speed because its assert
    is dropped outside debug mode: an int32 product that wraps gives the same result with it on
    as off. Should a Triton assert there, this fails, and the sanitizer should stay on."""
    from triton.runtime import interpreter

    if not hasattr(interpreter.interpreter_builder.options, "sanitize_overflow"):
        pytest.skip("this Triton's interpreter has no overflow sanitizer")
    assert not interpreter.interpreter_builder.options.sanitize_overflow
    x = torch.tensor([2**30 + 3], dtype=torch.int32)
    wrapped = torch.zeros(1, dtype=torch.int32)
    _scale_int_kernel[(1,)](x, wrapped, 4)
    assert wrapped.item() == 12  # 2^32 + 12 wrapped to int32
    set_interpreter_overflow_checks(True)
    try:
        checked = torch.zeros(1, dtype=torch.int32)
        _scale_int_kernel[(1,)](x, checked, 4)  # Triton's default options: computed, never asserted
    finally:
        set_interpreter_overflow_checks(False)
    assert checked.item() == 12


def test_pytests_log_capture_stays_off_torchs_trace_log(caplog):
    """tests/_device.py keeps pytest's log-capture handlers off torch's structured-trace logger
    (torch builds every trace event while that logger has any handler): inside a test it has none
    of pytest's, a handler of torch's own still attaches, and other loggers are captured as before."""
    import logging

    trace_log = logging.getLogger("torch.__trace")
    assert hasattr(trace_log.addHandler, "__wrapped__"), "tests/_device.py did not patch"
    assert not [h for h in trace_log.handlers if type(h).__module__.startswith("_pytest")], trace_log.handlers
    own = logging.NullHandler()
    trace_log.addHandler(own)
    try:
        assert own in trace_log.handlers
    finally:
        trace_log.removeHandler(own)
    logging.getLogger("trifuse").warning("still captured")
    assert "still captured" in caplog.text
