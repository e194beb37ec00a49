"""trifuse is one import namespace: its subpackages (`kernels`, `patterns`, `fusion`, `autotune`)
never become top-level names, even where Python runs from the checkout's root and puts it on
sys.path. transformers 5.25 imports the Hub's `kernels` package, and found `trifuse/kernels`."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import trifuse

PACKAGE = Path(trifuse.__file__).resolve().parent
SUBPACKAGES = ("kernels", "patterns", "fusion", "autotune")

FIND = """
import importlib.util, sys
assert sys.path[0] == "", sys.path[:2]  # python -c: the current directory first, as python -m puts it
import trifuse
for name in {names!r}:
    spec = importlib.util.find_spec(name)
    print(name, spec.origin if spec is not None else None)
"""


def _found_in_the_package(origins: dict) -> dict:
    """The top-level names found as trifuse's own folders (a venv inside the checkout, as CI's,
    holds the Hub's `kernels` under it too: that one is right)."""
    return {name: origin for name, origin in origins.items()
            if origin is not None and Path(origin).resolve().parent == PACKAGE / name}


def test_this_test_process_has_no_checkout_root_on_its_path():
    """tests/_device.py takes the root off sys.path before any test imports transformers
    (`python -m pytest` and xdist's workers put the current directory there)."""
    assert not [p for p in sys.path if Path(os.path.realpath(p or os.curdir)) == PACKAGE]
    origins = {name: getattr(importlib.util.find_spec(name), "origin", None) for name in SUBPACKAGES}
    assert not _found_in_the_package(origins)


def test_importing_trifuse_from_the_checkout_root_shadows_no_top_level_package():
    """A process started in the checkout's root (where the README's commands run) finds no
    trifuse subpackage under its top-level name once trifuse is imported."""
    out = subprocess.run([sys.executable, "-c", FIND.format(names=SUBPACKAGES)], cwd=PACKAGE, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    origins = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    origins = {name: None if origin == "None" else origin for name, origin in origins.items()}
    assert set(origins) == set(SUBPACKAGES), out.stdout
    assert not _found_in_the_package(origins), origins
