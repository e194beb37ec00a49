"""trifuse: autotuned Triton kernels swapped into unmodified PyTorch models.

The repository root is the package `trifuse`; its sub-folders install as
`trifuse.kernels`, `trifuse.fusion`, ... (never as top-level packages).
tests/, bench/ and examples/ are not packaged.
"""
import os
import sys

# This folder off sys.path (`python setup.py` puts it first): its kernels/ would shadow the Hub's
# `kernels` package, whose setuptools plugin (an egg_info writer) every setup.py run imports.
_HERE = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]

from setuptools import setup

SUBPACKAGES = ("kernels", "fusion", "patterns", "autotune", "parallel")

setup(
    name="trifuse",
    version="0.1.0",
    description="Fused, autotuned Triton kernels for transformer training, applied by an fx rewriter",
    python_requires=">=3.10",
    package_dir={"trifuse": ".", **{f"trifuse.{p}": p for p in SUBPACKAGES}},
    packages=["trifuse", *(f"trifuse.{p}" for p in SUBPACKAGES)],
    package_data={"trifuse.autotune": ["defaults/*.json"]},
    install_requires=[
        "torch>=2.4",
        "triton>=3.0; platform_system == 'Linux'",
        "packaging",
        "tqdm",  # the tuning progress bar
    ],
    entry_points={
        "torch_dynamo_backends": [
            "trifuse = trifuse.fusion.backend:trifuse_backend",
            "trifuse_inductor = trifuse.fusion.backend:trifuse_inductor_backend",
        ],
    },
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "pytest-benchmark", "transformers", "peft",
                 "diffusers"],
        "bench": ["pytest-benchmark", "matplotlib"],
        "flash-attn": ["flash-attn"],
        "xformers": ["xformers"],
    },
)
