"""PagePool: the KV pages as integers, with reference counts and a free order that is also the
eviction order. Page 0 is the null page: reserved, never handed out (padding in block tables).

Every usable page is in exactly one state:

    free         ref 0, no cached content       -> `_free` (FIFO), reused first
    cached idle  ref 0, indexed by a prefix     -> `_idle` (LRU: least recently freed first);
                 index, reusable until evicted     taking one evicts it from the index
    used         ref > 0 (held by sequences)    -> in block tables; may also be indexed

`num_free` counts free + cached idle: both can be handed out. Which cached idle page goes first is
the listener's choice (the radix index picks its LRU leaf); without one, the LRU head goes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

NULL_PAGE = 0
# page states of PagePool.states(), one character per page (the dashboard's colours)
PAGE_FREE, PAGE_CACHED, PAGE_USED, PAGE_SHARED, PAGE_NULL, PAGE_LEASED = "0", "1", "2", "3", "4", "5"


class PoolListener(Protocol):
    """The prefix index that owns the pool's cached pages."""

    def choose_victim(self) -> int | None:
        """A cached idle page to evict next, or None for the pool's LRU head."""

    def on_evict(self, page_id: int) -> None:
        """`page_id` is being reused: drop it from the index."""

    def on_idle(self, page_id: int) -> None:
        """A cached page's ref count just fell to 0 (it became evictable)."""


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages  # including the null page
        self._ref = [0] * num_pages
        self._cached = [False] * num_pages
        self._num_cached = 0
        self._free: deque[int] = deque(range(1, num_pages))
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.listener: PoolListener | None = None
        self.on_evicted: Callable[[int], None] | None = None  # after the index dropped the page
        self.on_freed: Callable[[int], None] | None = None  # an uncached page went back to `_free`
        self.num_evictions = 0

    # -- counts --------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now: free plus cached idle."""
        return len(self._free) + len(self._idle)

    @property
    def num_free_uncached(self) -> int:
        """Free pages holding nothing cached: taking them evicts nothing."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages indexed by the prefix cache, idle or in use."""
        return self._num_cached

    @property
    def num_cached_idle(self) -> int:
        return len(self._idle)

    def ref(self, page_id: int) -> int:
        return self._ref[page_id]

    def is_cached(self, page_id: int) -> bool:
        return self._cached[page_id]

    def free_order(self) -> list[int]:
        """Pages in the order the pool hands them out (without a listener's victim choice)."""
        return [*self._free, *self._idle]

    def idle_pages(self):
        """Cached idle pages, least recently freed first."""
        return iter(self._idle)

    # -- taking and returning pages ------------------------------------------------------------
    def allocate(self, num: int) -> list[int] | None:
        """`num` pages with ref 1 each, evicting cached idle pages as needed; None (nothing changed)
        if fewer than `num` can be handed out."""
        if num < 0:
            raise ValueError(f"cannot allocate {num} pages")
        if num > self.num_free:
            return None
        return [self._take() for _ in range(num)]

    def _take(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            page = self.listener.choose_victim() if self.listener is not None else None
            if page is None:
                page = next(iter(self._idle))
            del self._idle[page]  # KeyError here: the victim was not cached idle
            if self.listener is not None:
                self.listener.on_evict(page)
            self._cached[page] = False
            self._num_cached -= 1
            self.num_evictions += 1
            if self.on_evicted is not None:
                self.on_evicted(page)
        self._ref[page] = 1
        return page

    def incref(self, page_id: int) -> None:
        """Share a used page, or re-use a cached idle one (a prefix hit takes it off the free order)."""
        assert 0 < page_id < self.num_pages, f"page {page_id} out of range"
        if self._ref[page_id] == 0:
            assert self._cached[page_id], f"page {page_id} is free: its content is gone"
            del self._idle[page_id]
        self._ref[page_id] += 1

    def decref(self, page_id: int) -> None:
        """Drop one reference; at 0 a cached page goes to the LRU tail, an uncached one to `_free`."""
        assert self._ref[page_id] > 0, f"page {page_id} is not in use"
        self._ref[page_id] -= 1
        if self._ref[page_id] == 0:
            if self._cached[page_id]:
                self._idle[page_id] = None
                if self.listener is not None:
                    self.listener.on_idle(page_id)
            else:
                self._release(page_id)

    def _release(self, page_id: int) -> None:
        self._free.append(page_id)
        if self.on_freed is not None:
            self.on_freed(page_id)

    def mark_cached(self, page_id: int) -> None:
        """The index now holds this (used) page's content."""
        assert self._ref[page_id] > 0 and not self._cached[page_id], page_id
        self._cached[page_id] = True
        self._num_cached += 1

    def unmark_cached(self, page_id: int) -> None:
        """The index dropped this page without an eviction (reset): an idle one becomes free."""
        assert self._cached[page_id], page_id
        self._cached[page_id] = False
        self._num_cached -= 1
        if self._ref[page_id] == 0:
            del self._idle[page_id]
            self._release(page_id)

    def states(self, leased: set[int] = frozenset()) -> str:
        """PAGE_NULL, then per page: PAGE_LEASED (in `leased`), PAGE_SHARED (ref > 1), PAGE_USED,
        PAGE_CACHED (idle but indexed) or PAGE_FREE."""
        states = [PAGE_NULL]
        for page_id in range(1, self.num_pages):
            refs = self._ref[page_id]
            states.append(PAGE_LEASED if page_id in leased else PAGE_SHARED if refs > 1
                          else PAGE_USED if refs == 1 else PAGE_CACHED if self._cached[page_id] else PAGE_FREE)
        return "".join(states)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice in the free list"
        assert NULL_PAGE not in free and NULL_PAGE not in self._idle, "the null page is in the free order"
        assert self._ref[NULL_PAGE] == 0 and not self._cached[NULL_PAGE], "the null page is in use"
        for page in range(1, self.num_pages):
            in_free, in_idle, used = page in free, page in self._idle, self._ref[page] > 0
            assert in_free + in_idle + used == 1, (
                f"page {page}: free={in_free} idle={in_idle} ref={self._ref[page]}")
            assert self._ref[page] >= 0
            assert not (in_free and self._cached[page]), f"free page {page} is marked cached"
            assert not (in_idle and not self._cached[page]), f"idle page {page} is not cached"
        assert sum(self._cached) == self._num_cached
        assert self.num_free + self.num_used == self.num_usable
