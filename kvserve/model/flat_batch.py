"""A step's flat batch in integers: which sequence each query row belongs to, its position and the
cache slot its K/V go to, from each sequence's start, query length and block table. Both attention
metadata kinds (the CPU/torch one and the GPU one) are built from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class FlatBatch:
    block_tables: np.ndarray  # [S, width] int64, each sequence's pages, padded with null page 0
    num_pages: list[int]  # [S] pages each sequence's context spans
    seq_of_row: np.ndarray  # [T] int64
    first_row: np.ndarray  # [S] int64, each sequence's first row in the flat batch
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, slot = page_id * page_size + offset

    @classmethod
    def build(cls, start_positions: list[int], query_lens: list[int], block_tables: list[list[int]],
              page_size: int, width: int | None = None) -> FlatBatch:
        """Sequence i computes query_lens[i] tokens from position start_positions[i], over the pages
        block_tables[i] (which must cover them). `width`: the tables' padded width (default: the
        widest context's)."""
        # The integer bookkeeping runs in numpy (a numpy op costs about a microsecond, a torch op on
        # a few elements several): the callers make each field a tensor once.
        num_pages = [-(-(s + n) // page_size) for s, n in zip(start_positions, query_lens)]
        width = max(num_pages) if width is None else width
        assert all(len(bt) >= p for bt, p in zip(block_tables, num_pages)), "block table too short"
        assert width >= max(num_pages), "padded width below a context's pages"
        padded = np.zeros((len(query_lens), width), dtype=np.int64)  # [S, width]
        for row, bt, p in zip(padded, block_tables, num_pages):
            row[:p] = bt[:p]
        lens = np.array(query_lens, dtype=np.int64)  # [S]
        starts = np.array(start_positions, dtype=np.int64)  # [S]
        # flat token index -> its sequence, its position, its slot (no per-sequence loop)
        seq_of_row = np.repeat(np.arange(len(query_lens)), lens)
        first_row = np.cumsum(lens) - lens  # [S]
        positions = starts[seq_of_row] + np.arange(int(lens.sum())) - first_row[seq_of_row]  # [T]
        slot_mapping = padded[seq_of_row, positions // page_size] * page_size + positions % page_size
        return cls(padded, num_pages, seq_of_row, first_row, positions, slot_mapping)
