"""kvserve's CUDA kernels, written in Triton: paged attention that reads the KV pages in place, and a
batch-invariant matmul. They import nothing from kvserve; `triton` is optional (pip extra `cuda`).

Where torch has no CUDA device, `triton_module()` turns on Triton's interpreter first, so the same
kernels run on CPU tensors: that is how the test suite checks their arithmetic on machines without a
GPU (slowly: a test-sized problem only).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import ModuleType

import torch


def available() -> bool:
    """True when triton is installed (the kernels can run: compiled on CUDA, interpreted elsewhere)."""
    return importlib.util.find_spec("triton") is not None


def triton_module() -> ModuleType:
    """`triton`, imported with the interpreter on when no CUDA device exists. The switch must come
    before the first import: `triton.jit` reads it when a kernel is defined."""
    if not torch.cuda.is_available():
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("triton was imported before kvserve.kernels.cuda with no CUDA device: set "
                               "TRITON_INTERPRET=1 first to run kvserve's Triton kernels on the CPU")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    return triton


@functools.cache
def invariant_matmul() -> bool:
    """The CUDA path's linears: the batch-invariant Triton matmul (default, when triton is installed),
    or cuBLAS through torch with KVSERVE_GPU_MATMUL=cublas (faster on big batches; a row's bits may
    then depend on its batch)."""
    choice = os.environ.get("KVSERVE_GPU_MATMUL", "invariant")
    if choice not in ("invariant", "cublas"):
        raise ValueError(f"KVSERVE_GPU_MATMUL must be invariant or cublas, got {choice!r}")
    return choice == "invariant" and available()
