"""The CUDA-graph bookkeeping, checked on the CPU: bucket choice, and the persistent buffers a decode
step is copied into (its rows first, padding rows after them aimed at the null page)."""

from __future__ import annotations

import torch

from kvserve.model.cuda_graphs import DEFAULT_BUCKETS, DecodeBuffers, bucket_for, buckets_up_to
from kvserve.model.flat_batch import FlatBatch


def test_buckets_end_at_the_largest_batch_and_each_step_gets_the_smallest_that_fits():
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert buckets_up_to(20) == (1, 2, 4, 8, 16, 20)
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(300)[-2:] == (DEFAULT_BUCKETS[-1], 300)
    buckets = buckets_up_to(64)
    assert [bucket_for(buckets, n) for n in (1, 3, 16, 17, 49, 64)] == [1, 4, 16, 24, 64, 64]
    assert bucket_for(buckets, 65) is None and bucket_for(buckets, 0) is None


def test_fill_copies_the_rows_and_pads_the_rest_to_the_null_page():
    page = 4
    buffers = DecodeBuffers.allocate(8, 5, page, torch.device("cpu"), hybrid=False)
    buffers.meta.block_tables.fill_(99)  # stale rows from an earlier, larger step
    buffers.meta.positions.fill_(99)
    flat = FlatBatch.build([6, 0, 13], [1, 1, 1], [[7, 3], [5], [2, 9, 4, 8]], page)
    buffers.fill(4, [11, 12, 13], flat, None)
    ids, meta, window_meta = buffers.view(4)
    assert window_meta is None
    assert ids.tolist() == [11, 12, 13, 0]
    assert meta.positions.tolist() == [6, 0, 13, 0]
    assert meta.slot_mapping.tolist() == [3 * page + 2, 5 * page, 8 * page + 1, 0]
    assert meta.seq_of_row.tolist() == [0, 1, 2, 3]
    assert meta.block_tables.tolist() == [[7, 3, 0, 0, 0], [5, 0, 0, 0, 0], [2, 9, 4, 8, 0], [0, 0, 0, 0, 0]]
    # rows past the bucket are not the step's business
    assert buffers.meta.positions[4:].tolist() == [99] * 4


def test_the_window_pool_gets_its_own_tables_and_slots():
    page = 4
    buffers = DecodeBuffers.allocate(4, 3, page, torch.device("cpu"), hybrid=True)
    flat = FlatBatch.build([5, 2], [1, 1], [[1, 2], [3]], page)
    window_flat = FlatBatch.build([5, 2], [1, 1], [[6, 7], [8]], page)
    buffers.fill(2, [1, 2], flat, window_flat)
    _, meta, window_meta = buffers.view(2)
    assert meta.slot_mapping.tolist() == [2 * page + 1, 3 * page + 2]
    assert window_meta.slot_mapping.tolist() == [7 * page + 1, 8 * page + 2]
    assert window_meta.block_tables.tolist() == [[6, 7, 0], [8, 0, 0]]
    assert window_meta.positions.tolist() == [5, 2]
