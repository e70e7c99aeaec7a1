"""WindowPool: the pages of sliding-window layers (Gemma 3's local layers) in a second, smaller pool
beside the main one, as vLLM's hybrid KV cache manager and SGLang's SWA cache do. A sequence holds
window pages only for the positions its next query can still see; the rest go back to the pool as
decode advances, and stay reusable (LRU) while their main page is cached, so prefix hits stay exact.

Each window page ("slot") is attached to at most one main page (same tokens, same positions):

    attached, ref > 0   a sequence's next query can see it
    attached, ref 0     idle: reusable by a prefix hit until the window pool evicts it (LRU)
    detached, ref > 0   its main page was freed (a radix swap): the sequence still reads it
    free                nothing

A prefix hit of L tokens is usable for the windowed layers only if every page under the window
before position L still has its slot (usable_hit); earlier pages need none. A sequence's window
block table has NULL_PAGE where it released a slot: attention masks those positions anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.cache.stats import WindowStats
from kvserve.cache.pages import NULL_PAGE, PagePool
from kvserve.cache.sequence import cdiv
from kvserve.config import first_window_page


@dataclass(slots=True)
class _SeqSlots:
    slots: list[int]  # window page per logical page, NULL_PAGE once released
    first_held: int = 0  # logical pages below this were released


class WindowPool:
    def __init__(self, num_slots: int, page_size: int, window: int) -> None:
        self.pool = PagePool(num_slots)
        self.pool.listener = self
        self.page_size = page_size
        self.window = window
        self._slot_of: dict[int, int] = {}  # main page -> its attached slot
        self._page_of: dict[int, int] = {}  # slot -> the main page it is attached to
        self._seqs: dict[str, _SeqSlots] = {}
        self._copies: list[tuple[int, int]] = []  # slot copies for the runner (copy-on-write)

    def first_needed(self, num_tokens: int) -> int:
        """First logical page the query at position `num_tokens` can see."""
        return first_window_page(num_tokens, self.window, self.page_size)

    # -- prefix hits ---------------------------------------------------------------------------
    def usable_hit(self, pages: list[int], num_tokens: int) -> int:
        """The longest hit, at most `num_tokens`, whose pages under the window all have slots."""
        while num_tokens > 0:
            missing = [i for i in range(self.first_needed(num_tokens), cdiv(num_tokens, self.page_size))
                       if pages[i] not in self._slot_of]
            if not missing:
                return num_tokens
            num_tokens = missing[-1] * self.page_size
        return 0

    # -- a sequence's slots ----------------------------------------------------------------------
    def num_needed(self, hit_pages: list[int], num_hit: int, num_new: int) -> int:
        """Slots admit() takes from the free order: new ones plus the idle hit slots it re-uses."""
        held = hit_pages[self.first_needed(num_hit):]
        return num_new + sum(1 for page in held if self.pool.ref(self._slot_of[page]) == 0)

    def can_allocate(self, num: int) -> bool:
        return num <= self.pool.num_free

    def admit(self, seq_id: str, hit_pages: list[int], num_hit: int, new_pages: list[int]) -> None:
        """A sequence whose table is hit_pages' full pages, then new_pages; when the hit ends inside
        a page (its last hit page), the first new page is a copy of it, window page too."""
        num_full, first = num_hit // self.page_size, self.first_needed(num_hit)
        held = [self._slot_of[page] for page in hit_pages[first:]]
        for slot in held:  # refs first: the allocation below must not evict the hit
            self.pool.incref(slot)
        fresh = self._attach_fresh(new_pages)
        slots = [NULL_PAGE] * first + held[:num_full - first] + fresh
        if len(hit_pages) > num_full:  # the partial page: copied, not shared
            self._copies.append((held[-1], fresh[0]))
            self.pool.decref(held[-1])
        self._seqs[seq_id] = _SeqSlots(slots, first)

    def grow(self, seq_id: str, table: list[int], replaced: list[int]) -> None:
        """The sequence's table grew to `table`; at the logical pages in `replaced` a fresh page
        replaced a shared one (copy-on-write): its window page is copied as well."""
        seq = self._seqs[seq_id]
        for i in replaced:
            old, (new,) = seq.slots[i], self._attach_fresh([table[i]])
            self._copies.append((old, new))
            self.pool.decref(old)
            seq.slots[i] = new
        seq.slots += self._attach_fresh(table[len(seq.slots):])

    def release_before(self, seq_id: str, num_tokens: int) -> None:
        """The sequence computed `num_tokens`: return the slots its next queries cannot see."""
        seq = self._seqs[seq_id]
        first = min(self.first_needed(num_tokens), len(seq.slots))
        for i in range(seq.first_held, first):
            self.pool.decref(seq.slots[i])
            seq.slots[i] = NULL_PAGE
        seq.first_held = max(seq.first_held, first)

    def truncate(self, seq_id: str, num_pages: int) -> None:
        """Speculation rolled back: the sequence keeps its first `num_pages` logical pages."""
        seq = self._seqs[seq_id]
        for i in range(len(seq.slots) - 1, num_pages - 1, -1):
            if i >= seq.first_held:
                self.pool.decref(seq.slots[i])
        del seq.slots[num_pages:]
        seq.first_held = min(seq.first_held, num_pages)

    def adopt(self, seq_id: str, table: list[int]) -> None:
        """After a radix commit swapped own pages for cached ones: a cached page without a slot
        takes the sequence's (same tokens, same positions: same K/V)."""
        seq = self._seqs[seq_id]
        for i in range(seq.first_held, len(seq.slots)):
            page, slot = table[i], seq.slots[i]
            if page not in self._slot_of and slot not in self._page_of:
                self._attach(page, slot)

    def fork(self, parent_id: str, child_id: str) -> None:
        parent = self._seqs[parent_id]
        for slot in parent.slots[parent.first_held:]:
            self.pool.incref(slot)
        self._seqs[child_id] = _SeqSlots(list(parent.slots), parent.first_held)

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id)
        for slot in reversed(seq.slots[seq.first_held:]):
            self.pool.decref(slot)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._seqs[seq_id].slots)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    # -- the main pool's pages come and go -------------------------------------------------------
    def page_gone(self, page: int) -> None:
        """A main page was freed or evicted: its slot no longer stands for cached content."""
        slot = self._slot_of.pop(page, None)
        if slot is not None:
            del self._page_of[slot]
            self.pool.unmark_cached(slot)

    def _attach_fresh(self, pages: list[int]) -> list[int]:
        slots = self.pool.allocate(len(pages))
        assert slots is not None, "window pool short: check can_allocate first"
        for page, slot in zip(pages, slots):
            self._attach(page, slot)
        return slots

    def _attach(self, page: int, slot: int) -> None:
        self._slot_of[page], self._page_of[slot] = slot, page
        self.pool.mark_cached(slot)

    # -- window pool listener ---------------------------------------------------------------------
    def choose_victim(self) -> int | None:
        return None  # least recently released first

    def on_evict(self, slot: int) -> None:
        del self._slot_of[self._page_of.pop(slot)]

    def on_idle(self, slot: int) -> None:
        pass

    # -- accounting --------------------------------------------------------------------------------
    def stats(self) -> WindowStats:
        return WindowStats(self.pool.num_usable, self.pool.num_free, self.pool.num_used,
                           self.pool.num_cached_idle, self.pool.num_evictions)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for seq in self._seqs.values():
            assert all(s == NULL_PAGE for s in seq.slots[:seq.first_held])
            for slot in seq.slots[seq.first_held:]:
                assert slot != NULL_PAGE, "a held window slot is the null page"
                refs[slot] = refs.get(slot, 0) + 1
        for slot in range(1, self.pool.num_pages):
            assert self.pool.ref(slot) == refs.get(slot, 0), f"window slot {slot}: wrong ref count"
            assert self.pool.is_cached(slot) == (slot in self._page_of), f"window slot {slot}: attach flag"
        assert all(self._slot_of[p] == s for s, p in self._page_of.items())
        assert len(self._slot_of) == len(self._page_of)
