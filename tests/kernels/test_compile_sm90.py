"""Every Triton kernel compiled for Hopper (sm_90) by Triton's own compiler and ptxas, on this
machine without a GPU (bench/compile_sm90.py --smoke): the kernels the interpreter runs must
also get through the GPU compiler, fit Hopper's shared memory and registers without spilling at
their default configs, and the attention matmuls must take Hopper's warpgroup MMA (HGMMA), not
the older mma.sync path; with TRIFUSE_ATTENTION_TMA=1 the forward loads and stores through the
copy engine (UTMALDG / UTMASTG), not cp.async. The GPU is needed for speed, not for any of this."""
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import trifuse.kernels
import triton

TOOL = Path(__file__).resolve().parents[2] / "bench" / "compile_sm90.py"
# Earlier compiles of the same launches (the kernel's Triton cache key, the launch, the target and
# the Triton version): a compile is deterministic in those, so only kernels edited since are
# compiled again. Regenerate after editing kernels (the command's doc: --memo ... --write-memo).
MEMO = Path(__file__).resolve().parent / "sm90_compile_memo.json"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _kernel_names() -> set[str]:
    """Every `*_kernel` Triton function defined in trifuse/kernels/."""
    names = set()
    for info in pkgutil.iter_modules(trifuse.kernels.__path__):
        module = importlib.import_module(f"trifuse.kernels.{info.name}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "fn") and getattr(obj.fn, "__module__", "") == module.__name__:
                names.add(name)
    return names


def _compile(tmp_path, *args: str, **env: str) -> list[dict]:
    out = tmp_path / "sm90.json"
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **env}
    run = subprocess.run([sys.executable, str(TOOL), "--smoke", "--json", str(out), "--memo", str(MEMO), *args],
                         env=env, check=False,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


needs_ptxas = pytest.mark.skipif(not PTXAS.exists(), reason="this Triton ships no ptxas for NVIDIA targets")


@needs_ptxas
def test_every_kernel_compiles_for_sm90_without_spills(tmp_path):
    rows = _compile(tmp_path)
    assert {r["kernel"] for r in rows} == _kernel_names(), "the smoke catalogue launches every kernel"
    for r in rows:
        assert not r["error"] and r["stack"] == 0 and r["smem"] <= 232448, r
        if r["kernel"] in ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel",
                           "_varlen_fwd_kernel", "_varlen_bwd_dkdv_kernel", "_varlen_bwd_dq_kernel"):
            assert r["sass"]["HGMMA"] > 0 and r["sass"]["HMMA"] == 0, (r["kernel"], r["sass"])


@needs_ptxas
def test_attention_forward_through_tensor_descriptors_compiles_to_tma(tmp_path):
    rows = _compile(tmp_path, "--only", "attention", TRIFUSE_ATTENTION_TMA="1")
    forward = [r for r in rows if r["kernel"] == "_attn_fwd_kernel"]
    assert forward and all(r["launch"]["USE_TMA"] for r in forward)
    for r in forward:
        assert r["sass"]["UTMALDG"] > 0 and r["sass"]["UTMASTG"] > 0 and r["sass"]["HGMMA"] > 0, r["sass"]
        assert not r["error"] and r["stack"] == 0, r


def test_the_memo_is_keyed_by_the_kernels_source_the_launch_and_the_target():
    """A memo entry stands for a compile only while everything the compile reads is the same: the
    kernel's source and its callees' (Triton's cache key, here two stand-ins), the launch, the
    target, the Triton version."""
    import types

    import compile_sm90 as tool

    kernel, edited = types.SimpleNamespace(cache_key="abc"), types.SimpleNamespace(cache_key="abd")
    key = tool.memo_key(kernel, '["launch", 1]', 90)
    assert key == tool.memo_key(kernel, '["launch", 1]', 90)
    assert len({key, tool.memo_key(kernel, '["launch", 2]', 90), tool.memo_key(edited, '["launch", 1]', 90),
                tool.memo_key(kernel, '["launch", 1]', 80)}) == 4
    entries = json.loads(MEMO.read_text())["entries"]
    assert entries and all(e["cache_key"] and not e["error"] for e in entries.values())
