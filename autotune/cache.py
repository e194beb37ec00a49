"""The persistent cache of tuning results, and the per-GPU-family defaults shipped in the package.

Layout: one JSON file per environment in `env.cache_dir()` (TRIFUSE_CACHE_DIR), named after the
device, the Triton version and the torch version, e.g.

    nvidia-h100-80gb-hbm3--triton-3.6.0--torch-2.11.0+cu130.json
    {"format": 1, "device": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "torch": "2.11.0+cu130",
     "entries": {"layer_norm_fwd|n=1024,rows=8192,dtype=bfloat16": {...}, ...}}

so a cache entry is keyed by device name, Triton and torch versions (the file), kernel or op name,
shape bucket and dtype (the entry). Another GPU, or an upgrade of Triton or torch, reads another
file: results tuned elsewhere are never replayed.

Writes are atomic and merge: under an exclusive lock on a sibling `.lock` file, the current file
is read, the new entries are merged in, and the result is written to a temporary file that
`os.replace` moves over the old one. Readers take no lock: they see the old file or the new one,
never half of either, and two processes tuning at once lose no entry. A file that does not parse,
has another format, or names another environment than its own name says is ignored with a
warning on the `trifuse` logger (and replaced at the next write); the cache never raises.
Nothing is loaded with pickle.

Shipped defaults (autotune/defaults/<family>.json, e.g. h100.json) hold the same entries without
versions; they are what TRIFUSE_AUTOTUNE=0 replays on a matching GPU, or on the same chip with
other memory where its family has no entry (SAME_CHIP: the H100 and the H200).
"""
import dataclasses
import functools
import json
import logging
import os
import re
import tempfile
from pathlib import Path

from .env import cache_dir

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; os.replace alone keeps the file whole
    fcntl = None

FORMAT = 1
DEFAULTS_DIR = Path(__file__).resolve().parent / "defaults"

log = logging.getLogger("trifuse")


@dataclasses.dataclass(frozen=True)
class Environment:
    """What a tuning result depends on besides the kernel and the shapes."""

    device: str
    triton: str
    torch: str

    def file_name(self) -> str:
        parts = (_slug(self.device), "triton-" + _slug(self.triton), "torch-" + _slug(self.torch))
        return "--".join(parts) + ".json"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.+_-]+", "-", text.lower()).strip("-") or "unknown"


@functools.cache
def environment(device_index: int) -> Environment:
    """The environment of CUDA device `device_index`; -1 stands for the CPU (interpreter, tests)."""
    import torch
    import triton

    name = "cpu" if device_index < 0 else torch.cuda.get_device_name(device_index)
    return Environment(name, triton.__version__, torch.__version__)


def entry_key(kernel: str, bucket: str) -> str:
    return f"{kernel}|{bucket}"


class DiskCache:
    """Tuning results of one environment in one directory: `get` and `put` by (kernel, bucket).

    Entries are JSON objects chosen by the caller. Reads are served from memory; the file is
    re-read only after a miss, when another process may have written it since.
    """

    def __init__(self, directory: Path, env: Environment):
        self.directory = Path(directory)
        self.env = env
        self.path = self.directory / env.file_name()
        self._entries: dict[str, dict] = {}
        self._stamp: tuple[int, int] | None = None
        self._warned: set[str] = set()

    def get(self, kernel: str, bucket: str) -> dict | None:
        key = entry_key(kernel, bucket)
        hit = self._entries.get(key)
        if hit is None and self._file_stamp() != self._stamp:
            self._entries, self._stamp = self._read()
            hit = self._entries.get(key)
        return hit

    def put(self, kernel: str, bucket: str, value: dict) -> None:
        """Merges one entry into the file (atomically, under the lock). An unwritable directory
        is warned about once; the entry is then kept for this process only."""
        key = entry_key(kernel, bucket)
        self._entries[key] = value
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with _locked(self.path.with_name(self.path.name + ".lock")):
                entries, _ = self._read()
                entries[key] = value
                self._write(entries)
                self._entries, self._stamp = entries, self._file_stamp()
        except OSError as e:
            self._warn_once(f"write:{self.path}", "trifuse: cannot write the tuning cache %s (%s); "
                            "results are kept for this process only", self.path, e)

    def entries(self) -> dict[str, dict]:
        """Every entry of this environment's file (a copy)."""
        self._entries, self._stamp = self._read()
        return dict(self._entries)

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _read(self) -> tuple[dict[str, dict], tuple[int, int] | None]:
        stamp = self._file_stamp()
        if stamp is None:
            return {}, None
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            self._warn_once(f"corrupt:{stamp}", "trifuse: ignoring the unreadable tuning cache %s (%s); "
                            "it will be rewritten", self.path, e)
            return {}, stamp
        problem = _header_problem(data, self.env)
        if problem is not None:
            self._warn_once(f"foreign:{stamp}", "trifuse: ignoring the tuning cache %s: %s; "
                            "it will be rewritten", self.path, problem)
            return {}, stamp
        return {k: v for k, v in data["entries"].items() if isinstance(v, dict)}, stamp

    def _write(self, entries: dict[str, dict]) -> None:
        data = {"format": FORMAT, **dataclasses.asdict(self.env), "entries": dict(sorted(entries.items()))}
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=self.path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            # Whatever stopped the write (a full disk, ctrl-C), the old file stays whole.
            Path(tmp).unlink(missing_ok=True)
            raise

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)


def _header_problem(data: object, env: Environment) -> str | None:
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        return "not a trifuse tuning cache"
    if data.get("format") != FORMAT:
        return f"format {data.get('format')!r}, this trifuse reads format {FORMAT}"
    for field in ("device", "triton", "torch"):
        if data.get(field) != getattr(env, field):
            return f"written for {field} {data.get(field)!r}, running {getattr(env, field)!r}"
    return None


class _locked:
    """An exclusive advisory lock on `path` for the duration of a `with` block (POSIX flock)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if fcntl is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


_CACHES: dict[tuple[Path, Environment], DiskCache] = {}


def disk_cache(device_index: int) -> DiskCache:
    """The cache of device `device_index` in the current `TRIFUSE_CACHE_DIR` (one object per
    directory and environment, so a test that changes the variable gets a fresh one)."""
    key = (cache_dir(), environment(device_index))
    cache = _CACHES.get(key)
    if cache is None:
        cache = _CACHES[key] = DiskCache(*key)
    return cache


# ---------------------------------------------------------------------------------------------
# Shipped defaults, per GPU family
# ---------------------------------------------------------------------------------------------


def gpu_family(device_name: str) -> str | None:
    """'h100' for 'NVIDIA H100 80GB HBM3', 'a100' for 'NVIDIA A100-SXM4-80GB'; None for the CPU."""
    m = re.search(r"\b([A-Z]+[0-9]{2,4}[A-Z]*)\b", device_name)
    return m.group(1).lower() if m else None


def read_defaults(path: Path, family: str) -> dict[str, dict]:
    """The entries of a shipped-defaults file for `family`; {} (with a warning) when it is
    missing, unreadable, of another format or of another family."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("trifuse: ignoring the shipped defaults %s (%s)", path, e)
        return {}
    if (not isinstance(data, dict) or data.get("format") != FORMAT or data.get("family") != family
            or not isinstance(data.get("entries"), dict)):
        log.warning("trifuse: ignoring the shipped defaults %s: not format %d for %s", path, FORMAT, family)
        return {}
    return data["entries"]


@functools.cache
def _shipped(path: Path, family: str) -> dict[str, dict]:
    return read_defaults(path, family)


# Families that are one chip with other memory: the H100 and the H200 are both GH100 (sm_90, 132
# SMs), the H200 with more and faster HBM. Where a family ships no entry for a kernel and shape,
# its sibling's serves (the lent GPU is either; a tuned launch for one is a good start on the other).
SAME_CHIP = {"h100": "h200", "h200": "h100"}


def shipped_default(device_index: int, kernel: str, bucket: str) -> tuple[str, dict] | None:
    """(family, entry) from the defaults shipped for this device's GPU family, or else for its
    sibling on the same chip (SAME_CHIP), if any."""
    family = gpu_family(environment(device_index).device) if device_index >= 0 else None
    if family is None:
        return None
    key = entry_key(kernel, bucket)
    for source in (family, SAME_CHIP.get(family)):
        entry = None if source is None else _shipped(DEFAULTS_DIR / f"{source}.json", source).get(key)
        if entry is not None:
            return source, entry
    return None


def write_defaults(path: Path, family: str, entries: dict[str, dict], source: str) -> None:
    """Writes a shipped-defaults file (the same entries, no versions), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "family": family, "source": source, "entries": dict(sorted(entries.items()))}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
