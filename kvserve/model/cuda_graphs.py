"""Decode steps replayed as CUDA graphs (vLLM's approach): a step whose every row is one decode token
runs the whole decoder as one graph launch instead of thousands of small kernel launches.

One graph per batch-size bucket, captured at start-up over persistent buffers; a step of B rows
copies its rows into the buffers of the smallest bucket >= B and replays that bucket's graph. The
padding rows decode token 0 at position 0 into slot 0 of the null page 0 (never attended: every
row's keys stop at its own position) and their outputs are dropped. Rows are computed one per
program by the Triton kernels, so a row's bits do not depend on the bucket it was padded to.

    buffers (bucket = 4, B = 3):   input_ids  [t0 t1 t2 0]
                                   positions  [p0 p1 p2 0]
                                   slots      [s0 s1 s2 0]
                                   tables     [bt0 | bt1 | bt2 | 0...]   width = max_model_len / page_size
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.model.flat_batch import FlatBatch
from kvserve.model.gpu_attention import GpuAttentionMetadata

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def buckets_up_to(max_batch: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The capture sizes for at most `max_batch` decode rows: the buckets below it, and max_batch."""
    return tuple(b for b in buckets if b < max_batch) + (max_batch,)


@dataclass(slots=True)
class DecodeBuffers:
    """The persistent inputs a captured decode step reads (on the model's device)."""

    input_ids: torch.Tensor  # [max_batch] int64
    meta: GpuAttentionMetadata  # positions, slot_mapping, seq_of_row [max_batch]; tables [max_batch, W]
    window_meta: GpuAttentionMetadata | None  # the hybrid allocator's window pool tables

    @classmethod
    def allocate(cls, max_batch: int, table_width: int, page_size: int, device: torch.device,
                 hybrid: bool) -> DecodeBuffers:
        def meta() -> GpuAttentionMetadata:
            return GpuAttentionMetadata(page_size, torch.zeros(max_batch, dtype=torch.int64, device=device),
                                        torch.zeros(max_batch, dtype=torch.int64, device=device),
                                        torch.arange(max_batch, dtype=torch.int64, device=device),
                                        torch.zeros(max_batch, table_width, dtype=torch.int64, device=device))
        return cls(torch.zeros(max_batch, dtype=torch.int64, device=device), meta(), meta() if hybrid else None)

    def view(self, bucket: int) -> tuple[torch.Tensor, GpuAttentionMetadata, GpuAttentionMetadata | None]:
        """The first `bucket` rows of every buffer (what a graph of that size was captured over)."""
        def rows(m: GpuAttentionMetadata) -> GpuAttentionMetadata:
            return GpuAttentionMetadata(m.page_size, m.positions[:bucket], m.slot_mapping[:bucket],
                                        m.seq_of_row[:bucket], m.block_tables[:bucket])
        return self.input_ids[:bucket], rows(self.meta), None if self.window_meta is None else rows(self.window_meta)

    def fill(self, bucket: int, token_ids: list[int], flat: FlatBatch, window_flat: FlatBatch | None) -> None:
        """Copy a step of B <= bucket decode rows in; rows B..bucket become padding (token 0 at
        position 0, slot 0, an all-null table)."""
        self.input_ids[:bucket].copy_(torch.from_numpy(_padded(np.array(token_ids, dtype=np.int64), bucket)))
        for meta, f in ((self.meta, flat), (self.window_meta, window_flat)):
            if meta is not None:
                tables = np.zeros((bucket, meta.block_tables.shape[1]), dtype=np.int64)
                tables[:len(token_ids), :f.block_tables.shape[1]] = f.block_tables
                meta.positions[:bucket].copy_(torch.from_numpy(_padded(f.positions, bucket)))
                meta.slot_mapping[:bucket].copy_(torch.from_numpy(_padded(f.slot_mapping, bucket)))
                meta.block_tables[:bucket].copy_(torch.from_numpy(tables))


def _padded(values: np.ndarray, length: int) -> np.ndarray:
    return np.pad(values, (0, length - values.shape[0]))


class DecodeGraphs:
    """The captured decode steps of one model over one KV pool, by bucket."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, buffers: DecodeBuffers,
                 buckets: tuple[int, ...]) -> None:
        self.buffers = buffers
        self.buckets = tuple(sorted(buckets))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bucket in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
                ids, meta, window_meta = buffers.view(bucket)
                model(ids, meta.positions, kv_caches, meta, window_meta)  # warm-up: Triton compiles here
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = model(ids, meta.positions, kv_caches, meta, window_meta)
                self.graphs[bucket] = (graph, out)
        torch.cuda.synchronize()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_rows: int) -> int | None:
        return bucket_for(self.buckets, num_rows)

    def run(self, token_ids: list[int], flat: FlatBatch, window_flat: FlatBatch | None) -> torch.Tensor:
        """One decode step of len(token_ids) rows -> hidden states [rows, hidden] (a view of the
        graph's output buffer: valid until the next replay)."""
        bucket = self.bucket_for(len(token_ids))
        assert bucket is not None, "decode step larger than the largest captured bucket"
        self.buffers.fill(bucket, token_ids, flat, window_flat)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[: len(token_ids)]


def bucket_for(buckets: tuple[int, ...], num_rows: int) -> int | None:
    """The smallest bucket holding num_rows rows (None: more rows than the largest)."""
    i = bisect.bisect_left(buckets, num_rows)
    return buckets[i] if i < len(buckets) and num_rows >= 1 else None
