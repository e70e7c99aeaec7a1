"""CacheHistory: a bounded memory of the pages the pool has held, so a miss can be explained after
the fact (was this page ever cached? when and why did it leave?) and thrash can be counted. Pure Python;
the manager feeds it on commit, eviction and lease expiry. Past its bound it forgets the oldest entry
of the tenant holding the most, so a tenant within its share is never made to forget by another's
traffic (the pool's fair shares, applied to what it remembers)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.cache.fair_table import FairShareTable
from kvserve.cache.hashing import tenant_of

THRASH_WINDOW_S = 60.0  # a page committed again within this long after its eviction is thrash


@dataclass(slots=True)
class PageRecord:
    committed_at: float
    evicted_at: float | None = None
    lease_expired_at: float | None = None  # a lease held it, and ran out before it was evicted


class CacheHistory:
    def __init__(self, page_size: int, capacity: int = 100_000) -> None:
        self.page_size = page_size
        self.pages: FairShareTable[bytes, PageRecord] = FairShareTable(capacity)  # by chained page hash
        # parent (a page hash, or a namespace for first pages) -> the pages committed after it
        self.children: FairShareTable[bytes | str, set[bytes]] = FairShareTable(capacity)
        self.num_thrash = 0

    def stored(self, page_hash: bytes, parent: bytes | None, namespace: str, now: float) -> None:
        """A page was committed (indexed)."""
        tenant = tenant_of(namespace)  # a chained hash carries its namespace: one tenant's pages
        old = self.pages.get(page_hash)  # (put replaces it, as its tenant's newest)
        if old is not None and old.evicted_at is not None and now - old.evicted_at <= THRASH_WINDOW_S:
            self.num_thrash += 1
        self.pages.put(page_hash, PageRecord(now), tenant)
        key = parent if parent is not None else namespace
        children = self.children.get(key) or set()
        children.add(page_hash)
        self.children.put(key, children, tenant)  # (put again: now the tenant's most recent)

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
        return bool((self.children.get(parent) or set()) - {page_hash})
