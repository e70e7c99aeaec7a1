"""ctypes wrapper of the native matmul over a GGUF format's own blocks: `matmul` (y = x @ W^T, float32
in and out, W as [N, row bytes] uint8), `dequantize_rows` (embedding lookups) and the int8
activation rounding the block formats use (`quantize_activations`, for tests)."""

from __future__ import annotations

import torch

from kvserve import kernels
from kvserve.kernels import KernelLibrary
from kvserve.kernels.api import MatmulStatus


def supported(kl: KernelLibrary, qtype: int) -> bool:
    return int(qtype) in kl.formats


def row_bytes(kl: KernelLibrary, qtype: int, k: int) -> int:
    return kl.formats[int(qtype)].row_bytes(k)


def interleave(kl: KernelLibrary, qtype: int, weight: torch.Tensor, k: int) -> tuple[int, torch.Tensor]:
    """(format, weight) as the decode rows read it fastest: a matrix of a format with an interleaved twin
    (every block format: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K formats) whose rows come in whole groups of
    eight, rewritten in place into the twin's layout (the same values and the same bits out, with no
    reduction across vector lanes in the decode rows: kvs_interleave_rows); anything else, or with
    KVSERVE_KERNELS_INTERLEAVE=off, as it was.
    `weight`: [N, row bytes] uint8, owned by the caller."""
    twin = next((f for f in kl.formats.values() if f.base == int(qtype) and f.group_rows > 1), None)
    if twin is None or not kernels.interleave_enabled() or weight.shape[0] % twin.group_rows:
        return int(qtype), weight
    assert weight.dtype == torch.uint8 and weight.is_contiguous() and weight.shape[1] == row_bytes(kl, qtype, k)
    _check(kl.lib.kvs_interleave_rows(int(qtype), weight.data_ptr(), weight.shape[0], k), qtype, k)
    return int(twin.format), weight


def _check(rc: int, qtype: int, k: int) -> None:
    if rc == MatmulStatus.NO_FORMAT:
        raise ValueError(f"ggml type {qtype} has no native kernel")
    if rc == MatmulStatus.BAD_ROW_LENGTH:
        raise ValueError(f"row length {k} is not a multiple of format {qtype}'s block, or the rows of an "
                         "interleaved format are not whole groups of eight")


def matmul(kl: KernelLibrary, qtype: int, weight: torch.Tensor, k: int, x: torch.Tensor,
           out: torch.Tensor | None = None, num_threads: int | None = None) -> torch.Tensor:
    """x [T, k] float32 (rows contiguous) @ W^T -> [T, N] float32; `out` may be a column slice of a
    wider matrix (its row stride is kept), so parts of a fused layer fill one output."""
    n = weight.shape[0]
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1
    assert weight.dtype == torch.uint8 and weight.is_contiguous() and weight.shape[1] == row_bytes(kl, qtype, k)
    t = x.shape[0]
    if out is None:
        out = torch.empty(t, n, dtype=torch.float32)
    assert out.shape == (t, n) and out.stride(1) == 1 and out.dtype == torch.float32
    threads = torch.get_num_threads() if num_threads is None else num_threads
    rc = kl.lib.kvs_matmul(int(qtype), weight.data_ptr(), n, k, x.data_ptr(), x.stride(0), t,
                               out.data_ptr(), out.stride(0), threads)
    _check(rc, qtype, k)
    return out


class PreparedMatmul:
    """`matmul` for one weight whose shape was checked once: the decode path's per-call cost is one
    ctypes call and one output tensor (a step makes ~120 of them)."""

    def __init__(self, kl: KernelLibrary, qtype: int, weight: torch.Tensor, k: int) -> None:
        assert weight.dtype == torch.uint8 and weight.is_contiguous() and weight.shape[1] == row_bytes(kl, qtype, k)
        self.fn = kl.lib.kvs_matmul
        self.qtype, self.weight, self.n, self.k = int(qtype), weight, int(weight.shape[0]), k

    def __call__(self, x: torch.Tensor, out: torch.Tensor, threads: int) -> None:
        """x [T, k] float32 with contiguous rows, out [T, n] float32 (rows may be strided)."""
        rc = self.fn(self.qtype, self.weight.data_ptr(), self.n, self.k, x.data_ptr(), x.stride(0), x.shape[0],
                     out.data_ptr(), out.stride(0), threads)
        if rc:
            _check(rc, self.qtype, self.k)


def dequantize_rows(kl: KernelLibrary, qtype: int, weight: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    """W[rows] as float32 [len(rows), k], decoded from the blocks."""
    rows = rows.to(torch.int64).contiguous()
    assert weight.is_contiguous() and weight.dtype == torch.uint8
    assert bool(((rows >= 0) & (rows < weight.shape[0])).all()), "row index out of range"
    out = torch.empty(rows.numel(), k, dtype=torch.float32)
    _check(kl.lib.kvs_dequantize_rows(int(qtype), weight.data_ptr(), k, rows.data_ptr(), rows.numel(),
                                          out.data_ptr()), qtype, k)
    return out


def quantize_activations(kl: KernelLibrary, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x as the block formats see it: (q [T, K] int8, d [T, K / 32] float32, m [T, K] int16), x ~ q * m *
    d per element (d: max|x| / 127 / 8 of the block of 32; m = 2^(3 - s) per sub-block of 8, whose step
    is the block's over 2^s)."""
    x = x.float().contiguous()
    t, k = x.shape
    q = torch.empty(t, k, dtype=torch.int8)
    d = torch.empty(t, k // 32, dtype=torch.float32)
    pairs = torch.empty(t, k // 2, dtype=torch.int16)
    _check(kl.lib.kvs_quantize_activations(x.data_ptr(), t, k, q.data_ptr(), d.data_ptr(), pairs.data_ptr()), 8, k)
    return q, d, pairs.repeat_interleave(2, dim=1)
