"""Every environment variable trifuse reads, in one place.

TRITON_INTERPRET is Triton's own; it must be set before any module that defines a kernel is
imported, so it is read once here. The TRIFUSE_* variables are read on each call so that a test
can change them with monkeypatch.
"""
import os
from pathlib import Path

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def tuning_requested() -> bool:
    """False when TRIFUSE_AUTOTUNE=0: use the built-in (or shipped per-GPU) defaults, time nothing."""
    return os.environ.get("TRIFUSE_AUTOTUNE", "1") != "0"


def direct_ops_requested() -> bool:
    """False when TRIFUSE_DIRECT_OPS=0: the graphs Inductor compiles call the registered trifuse
    ops themselves instead of their direct twins (fusion/backend.py, `direct_ops`): to measure
    what the twins save, or to rule them out."""
    return os.environ.get("TRIFUSE_DIRECT_OPS", "1") != "0"


def attention_tma_requested() -> bool:
    """TRIFUSE_ATTENTION_TMA=1: the attention forward may load through tensor descriptors (TMA)
    on sm_90+; its configs join the tuner's list (opt-in until measured on a GPU)."""
    return os.environ.get("TRIFUSE_ATTENTION_TMA", "0") == "1"


def autotune_enabled() -> bool:
    """Whether `triton.autotune` may time several configurations: tuning is requested and kernels
    run on a real GPU (the interpreter cannot benchmark)."""
    return tuning_requested() and not INTERPRET


def cache_dir() -> Path:
    """Where tuned configurations persist: TRIFUSE_CACHE_DIR, else ~/.cache/trifuse (XDG)."""
    explicit = os.environ.get("TRIFUSE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trifuse"
