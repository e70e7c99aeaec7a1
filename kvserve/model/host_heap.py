"""The process heap of a CPU engine: glibc's malloc keeps the memory a step frees for the next step, and
the KV pool takes pages the kernel zeroes when they are first written (`zeroed`).

By default glibc serves each allocation over its (adaptive) mmap threshold with fresh pages and hands
freed memory at the top of the heap back to the kernel; a prefill chunk's activations (megabytes a
layer) then page-fault in again on every chunk: ~17,000 minor faults for each W1 prefill of the
bundled model, ~5% of its time (docs/performance.md, "Round 3, the host heap"). llama.cpp sizes its
compute buffers once; this keeps what a step used instead. What a step freed stays mapped for the
next one, so resident memory stays near its peak, and the peak itself moves little (the bundled
model over HTTP: 1,533 -> 1,580 MiB).
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for it on 64-bit hosts: larger blocks stay mmap'ed
TRIM_THRESHOLD_BYTES = 2**31 - 1  # (an int): the top of the heap is not trimmed
# glibc's own variables for the same settings: where the user set one, theirs stands
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"  # torch's switch (kvserve/__init__.py sets it unless the user did)

_applied = False


def retain_freed_memory() -> bool:
    """Set the two thresholds once per process (glibc only; elsewhere, or where the user set
    glibc's variables, nothing changes). True if they are set."""
    global _applied
    if _applied:
        return True
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _applied


def zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on fresh anonymous pages: the kernel supplies them zeroed on first write, so nothing
    is written here. torch.zeros writes every byte at once: the bundled model's default 1 GiB KV pool
    took 0.06-2.5 s of each start-up and was resident from the start; a pool's pages now cost time and
    memory as requests fill them, one fault per 2 MB page (huge pages asked for where torch's allocator
    asks for them: THP_MEM_ALLOC_ENABLE=1, kvserve/__init__.py's default). The same bits as torch.zeros;
    the mapping is freed with the tensor."""
    num_bytes = torch.Size(shape).numel() * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if os.environ.get(TORCH_HUGE_PAGES) == "1" and hasattr(mmap, "MADV_HUGEPAGE"):  # as torch's allocator does
        pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
