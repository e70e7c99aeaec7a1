"""The hybrid allocator under the manager state machine (test_manager_stateful.py): the same rules
with a small WindowPool beside the main pool, and a shadow of the window pages too. Every running
sequence must read its own tokens back from its window pages for every position its next query can
see, every hit must be exact in both pools, and no write may touch a window page someone else holds.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvserve.cache.manager import KVCacheManager
from kvserve.cache.pages import NULL_PAGE
from kvserve.cache.window import WindowPool
from tests.cache.test_manager_stateful import SETTINGS, VOCAB, CacheMachine


class WindowMachine(CacheMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(3, 20),
                num_slots=st.integers(3, 20), window=st.integers(1, 12),
                prefixes=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=12), min_size=1, max_size=3),
                partial_page_hits=st.booleans())
    def setup(self, page_size, num_pages, num_slots, window, prefixes, partial_page_hits):
        super().setup(page_size, num_pages, prefixes, partial_page_hits)
        self.m = KVCacheManager(num_pages, page_size, self.policy, partial_page_hits,
                                window=WindowPool(num_slots, page_size, window))
        self.window_content: dict[int, list[int | None]] = {}  # window page -> token per slot

    def _apply_copies(self, copies):
        super()._apply_copies(copies)
        for src, dst in self.m.take_window_copies():
            assert self.m.window.pool.ref(dst) == 1
            self.window_content[dst] = list(self.window_content[src])
            event("window copy")

    def _write(self, seq_id, start, tokens):
        table = self.m.window_block_table(seq_id)
        for pos, token in enumerate(tokens, start):
            slot = table[pos // self.ps]
            assert slot != NULL_PAGE and self.m.window.pool.ref(slot) == 1, f"write into window page {slot}"
            self.window_content.setdefault(slot, [None] * self.ps)[pos % self.ps] = token
        super()._write(seq_id, start, tokens)

    @precondition(lambda self: False)
    @rule()
    def swap_out_and_in(self):
        """Swap carries whole pages: the engine turns the hybrid allocator off with it."""

    @invariant()
    def every_sequence_reads_its_window(self):
        if not hasattr(self, "m"):
            return
        window = self.m.window
        for seq_id, seq in self.seqs.items():
            table = self.m.window_block_table(seq_id)
            assert len(table) == len(self.m.block_table(seq_id))
            for pos in range(window.first_needed(seq.num_computed) * self.ps, seq.num_computed):
                slot = table[pos // self.ps]
                assert self.window_content[slot][pos % self.ps] == seq.token_ids[pos], (
                    f"{seq_id} lost position {pos} in the window pool")

    @invariant()
    def window_pool_invariants(self):
        if hasattr(self, "m"):
            self.m.window.check_invariants()
            if self.m.window.stats().num_evictions:
                event("window eviction")

    def teardown(self):
        super().teardown()
        if hasattr(self, "m"):
            assert self.m.window.pool.num_used == 0


class RadixWindowMachine(WindowMachine):
    policy = "radix"


class HashWindowMachine(WindowMachine):
    policy = "hash"


class OffWindowMachine(WindowMachine):
    policy = "off"


TestRadixWindow = RadixWindowMachine.TestCase
TestRadixWindow.settings = SETTINGS
TestHashWindow = HashWindowMachine.TestCase
TestHashWindow.settings = SETTINGS
TestOffWindow = OffWindowMachine.TestCase
TestOffWindow.settings = SETTINGS
