"""The persistent tuning cache: JSON round trip, merge, atomicity across processes, corrupted and
foreign files, version changes, unwritable directories, shipped per-GPU-family defaults."""
import json
import logging
import multiprocessing
import sys

import pytest

from trifuse.autotune import cache
from trifuse.autotune.cache import DiskCache, Environment

ENV = Environment("NVIDIA H100 80GB HBM3", "3.6.0", "2.11.0+cu130")


def test_round_trip_through_a_json_file(tmp_path):
    DiskCache(tmp_path, ENV).put("layer_norm_fwd", "n=1024,dtype=bfloat16", {"config": {"num_warps": 8}})
    again = DiskCache(tmp_path, ENV)
    assert again.get("layer_norm_fwd", "n=1024,dtype=bfloat16") == {"config": {"num_warps": 8}}
    assert again.get("layer_norm_fwd", "n=2048,dtype=bfloat16") is None
    data = json.loads(again.path.read_text())
    assert data["device"] == ENV.device and data["triton"] == ENV.triton and data["torch"] == ENV.torch
    assert list(data["entries"]) == ["layer_norm_fwd|n=1024,dtype=bfloat16"]


def test_file_name_names_device_and_versions(tmp_path):
    name = DiskCache(tmp_path, ENV).path.name
    assert name == "nvidia-h100-80gb-hbm3--triton-3.6.0--torch-2.11.0+cu130.json"


def test_writers_merge_instead_of_overwriting(tmp_path):
    a, b = DiskCache(tmp_path, ENV), DiskCache(tmp_path, ENV)
    a.put("k", "1", {"v": 1})
    b.put("k", "2", {"v": 2})  # b never read a's entry, but its write merges with the file
    assert DiskCache(tmp_path, ENV).entries() == {"k|1": {"v": 1}, "k|2": {"v": 2}}


def test_a_miss_rereads_what_another_process_wrote(tmp_path):
    mine = DiskCache(tmp_path, ENV)
    assert mine.get("k", "1") is None
    DiskCache(tmp_path, ENV).put("k", "1", {"v": 1})
    assert mine.get("k", "1") == {"v": 1}


def _write_many(directory, tag, count):
    c = DiskCache(directory, ENV)
    for i in range(count):
        c.put("k", f"{tag}{i}", {"i": i, "pad": "x" * 200})


@pytest.mark.skipif(sys.platform == "win32", reason="needs fork and flock")
def test_two_processes_writing_at_once_lose_nothing_and_never_tear_the_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    count = 30
    procs = [ctx.Process(target=_write_many, args=(tmp_path, tag, count)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    path = DiskCache(tmp_path, ENV).path
    reads = 0
    while any(p.is_alive() for p in procs):
        if path.exists():
            json.loads(path.read_text())  # a reader never sees half a file
            reads += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    entries = DiskCache(tmp_path, ENV).entries()
    assert sorted(entries) == sorted(f"k|{t}{i}" for t in "ab" for i in range(count))
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
    assert reads > 0


def test_corrupted_file_is_ignored_with_a_warning_then_rewritten(tmp_path, caplog):
    c = DiskCache(tmp_path, ENV)
    c.path.write_text('{"format": 1, "entries": {"k|1": ')
    with caplog.at_level(logging.WARNING, logger="trifuse"):
        assert c.get("k", "1") is None
    assert "unreadable tuning cache" in caplog.text
    c.put("k", "2", {"v": 2})
    assert json.loads(c.path.read_text())["entries"] == {"k|2": {"v": 2}}


@pytest.mark.parametrize("header, expected", [
    ({"format": 1, "device": ENV.device, "triton": ENV.triton, "torch": "2.10.0"}, "torch"),
    ({"format": 99, "device": ENV.device, "triton": ENV.triton, "torch": ENV.torch}, "format"),
    ({"device": ENV.device}, "not a trifuse tuning cache"),
], ids=["foreign-torch", "foreign-format", "not-ours"])
def test_foreign_file_is_ignored_with_a_warning(tmp_path, caplog, header, expected):
    c = DiskCache(tmp_path, ENV)
    c.path.write_text(json.dumps({**header, "entries": {"k|1": {"v": 1}}} if "format" in header else header))
    with caplog.at_level(logging.WARNING, logger="trifuse"):
        assert c.get("k", "1") is None
    assert expected in caplog.text


def test_a_version_change_invalidates(tmp_path):
    DiskCache(tmp_path, ENV).put("k", "1", {"v": 1})
    for other in (Environment(ENV.device, "3.9.0", ENV.torch), Environment(ENV.device, ENV.triton, "2.13.0"),
                  Environment("NVIDIA A100-SXM4-80GB", ENV.triton, ENV.torch)):
        assert DiskCache(tmp_path, other).get("k", "1") is None
    assert DiskCache(tmp_path, ENV).get("k", "1") == {"v": 1}


def test_unwritable_directory_warns_and_keeps_results_in_memory(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    c = DiskCache(blocked / "cache", ENV)  # a directory under a regular file cannot exist
    with caplog.at_level(logging.WARNING, logger="trifuse"):
        c.put("k", "1", {"v": 1})
    assert "cannot write the tuning cache" in caplog.text
    assert c.get("k", "1") == {"v": 1}


def test_disk_cache_follows_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "_CACHES", {})
    monkeypatch.setenv("TRIFUSE_CACHE_DIR", str(tmp_path / "a"))
    a = cache.disk_cache(-1)
    monkeypatch.setenv("TRIFUSE_CACHE_DIR", str(tmp_path / "b"))
    b = cache.disk_cache(-1)
    assert a.directory == tmp_path / "a" and b.directory == tmp_path / "b"
    assert cache.disk_cache(-1) is b


@pytest.mark.parametrize("name, family", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H200", "h200"),
    ("NVIDIA L40S", "l40s"), ("cpu", None),
])
def test_gpu_family(name, family):
    assert cache.gpu_family(name) == family


def test_defaults_of_another_family_are_ignored(tmp_path, caplog):
    path = tmp_path / "h100.json"
    cache.write_defaults(path, "h100", {"k|1": {"v": 1}}, "test")
    assert cache.read_defaults(path, "h100") == {"k|1": {"v": 1}}
    with caplog.at_level(logging.WARNING, logger="trifuse"):
        assert cache.read_defaults(path, "a100") == {}
    assert "not format 1 for a100" in caplog.text


def test_the_shipped_h100_file_is_valid():
    assert isinstance(cache.read_defaults(cache.DEFAULTS_DIR / "h100.json", "h100"), dict)
