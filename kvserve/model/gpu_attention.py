"""The CUDA path's attention: per-step metadata for the Triton kernel (kvserve/kernels/cuda/paged_attention.py),
which reads each row's keys from the pages in place, and the call that writes the step's K/V and
attends. The metadata is four integer tensors, so a decode step's copy of it can live in persistent
buffers that a captured CUDA graph reads (model/cuda_graphs.py).

Codecs on this path: fp32, fp16, bf16 and fp8 (e4m3, e5m2, per-tensor scale). int8/int4 pages
(scales per page, Hadamard-rotated rows) keep the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kvserve.kernels import cuda as gpu
from kvserve.model.flat_batch import FlatBatch
from kvserve.model.kv_quant import Fp8Codec, KVCodec, PagedKV, write_kv_pair


def supports(codec: KVCodec) -> bool:
    """True when the Triton kernel reads this codec's pages (and triton is installed)."""
    return gpu.available() and not codec.rotates and not codec.scales_per_page(1)


@dataclass(slots=True)
class GpuAttentionMetadata:
    """One step's rows as the Triton kernel reads them, shared by every layer."""

    page_size: int
    positions: torch.Tensor  # [T] int64, position of each query row
    slot_mapping: torch.Tensor  # [T] int64, cache slot each new K/V row is written to
    seq_of_row: torch.Tensor  # [T] int64, the row's sequence: its row of block_tables
    block_tables: torch.Tensor  # [S, W] int64, padded with null page 0
    window: int | None = None  # sliding window: a row at position p sees keys at positions > p - window

    @classmethod
    def build(cls, start_positions: list[int], query_lens: list[int], block_tables: list[list[int]],
              page_size: int, device: torch.device | str) -> GpuAttentionMetadata:
        flat = FlatBatch.build(start_positions, query_lens, block_tables, page_size)
        return cls.from_flat(flat, page_size, device)

    @classmethod
    def from_flat(cls, flat: FlatBatch, page_size: int, device: torch.device | str) -> GpuAttentionMetadata:
        # one host-to-device copy for the four fields
        rows = torch.from_numpy(np.stack([flat.positions, flat.slot_mapping, flat.seq_of_row]))
        rows = rows.to(device, non_blocking=True)
        tables = torch.from_numpy(flat.block_tables).to(device, non_blocking=True)
        return cls(page_size, rows[0], rows[1], rows[2], tables)

    def with_window(self, window: int) -> GpuAttentionMetadata:
        return replace(self, window=window)


def attend_in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: PagedKV, v_cache: PagedKV,
                    meta: GpuAttentionMetadata) -> torch.Tensor:
    """Write this step's k, v [T, kv_heads, head_dim] into their slots, then attend:
    q [T, heads, head_dim] -> [T, heads, head_dim], keys read from the pages in place."""
    from kvserve.kernels.cuda.paged_attention import paged_attention

    write_kv_pair(k_cache, v_cache, k, v, meta.slot_mapping)
    k_data, v_data, luts = k_cache.data, v_cache.data, (None, None)
    if isinstance(k_cache.codec, Fp8Codec):  # codes as bytes, decoded by table in the kernel
        k_data, v_data = k_data.view(torch.uint8), v_data.view(torch.uint8)
        luts = (k_cache.codec.lookup_table(q.device), v_cache.codec.lookup_table(q.device))
    return paged_attention(q.contiguous(), k_data, v_data, meta.positions, meta.seq_of_row, meta.block_tables,
                           meta.window or 0, *luts)
