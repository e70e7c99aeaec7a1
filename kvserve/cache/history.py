"""CacheHistory: a bounded memory of the pages the pool has held, so a miss can be explained after
the fact (was this page ever cached? when and why did it leave?) and thrash can be counted. Pure Python; the manager feeds it on commit, eviction and
lease expiry."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

THRASH_WINDOW_S = 60.0  # a page committed again within this long after its eviction is thrash


@dataclass(slots=True)
class PageRecord:
    committed_at: float
    evicted_at: float | None = None
    lease_expired_at: float | None = None  # a lease held it, and ran out before it was evicted


class CacheHistory:
    def __init__(self, page_size: int, capacity: int = 100_000) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self.pages: OrderedDict[bytes, PageRecord] = OrderedDict()  # by chained page hash, LRU first
        self.children: OrderedDict[bytes | str, set[bytes]] = OrderedDict()  # parent (or namespace) -> pages
        self.num_thrash = 0

    def stored(self, page_hash: bytes, parent: bytes | None, namespace: str, now: float) -> None:
        """A page was committed (indexed)."""
        old = self.pages.pop(page_hash, None)
        if old is not None and old.evicted_at is not None and now - old.evicted_at <= THRASH_WINDOW_S:
            self.num_thrash += 1
        self.pages[page_hash] = PageRecord(now)
        _bounded_add(self.children, parent if parent is not None else namespace, page_hash, self.capacity)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)

    def evicted(self, page_hash: bytes, now: float) -> None:
        record = self.pages.get(page_hash)
        if record is not None:
            record.evicted_at = now

    def lease_expired(self, page_hash: bytes, now: float) -> None:
        record = self.pages.get(page_hash)
        if record is not None:
            record.lease_expired_at = now

    def record(self, page_hash: bytes) -> PageRecord | None:
        return self.pages.get(page_hash)

    def has_other_child(self, parent: bytes | str, page_hash: bytes | None) -> bool:
        """Did the cache ever hold a different page after `parent` (a hash, or a namespace's root)?"""
        return bool(self.children.get(parent, set()) - {page_hash})


def _bounded_add(table: OrderedDict, key, value, capacity: int) -> None:
    table.setdefault(key, set()).add(value)
    table.move_to_end(key)
    while len(table) > capacity:
        table.popitem(last=False)

