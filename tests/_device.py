"""Where tests run. Imported first by conftest.py: sets TRITON_INTERPRET=1 on machines without
a GPU *before* anything imports trifuse (the interpreter must be chosen before a kernel module
is imported), so CPU runs execute the real Triton kernels in Triton's interpreter."""
import os

import torch

ON_GPU: bool = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE: str = "cuda" if ON_GPU else "cpu"
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET") == "1"
