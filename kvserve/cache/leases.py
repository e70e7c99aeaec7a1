"""Cache leases: a retention promise on a prefix (Anthropic's `cache_control` TTLs, named caches).
A lease holds a reference on each page of its prefix, so LRU eviction cannot take them until it
expires; every read of the whole prefix refreshes its TTL. Leased pages are capped at a fraction of
the pool, so requests always keep the rest; when nothing runs and a request still cannot be admitted,
leases are broken oldest first rather than deadlock the pool. Pure Python over page ids."""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvserve.cache.pages import PagePool
from kvserve.cache.sequence import cdiv


class LeaseRefusal:
    BELOW_MIN_CACHEABLE = "below_min_cacheable"
    LEASED_FRACTION_CAP = "leased_fraction_cap"
    NOT_CACHED = "not_cached"  # the prefix's pages were not (all) in the cache
    PREFIX_CACHE_OFF = "prefix_cache_off"


@dataclass(slots=True)
class Lease:
    lease_id: str
    namespace: str
    pages: list[int]
    num_tokens: int
    ttl_s: float
    expires_at: float  # on the engine's monotonic clock
    label: str = "5m"
    owner: str = ""  # the tenant that may extend, read back or release it by id


@dataclass(slots=True)
class LeaseStats:
    grants: int = 0
    refreshes: int = 0
    expiries: int = 0
    refusals: int = 0
    breaks: int = 0  # leases dropped so a request could be admitted


@dataclass
class LeaseTable:
    pool: PagePool
    index: Any  # the prefix index (None: prefix caching off, nothing can be leased)
    page_size: int
    max_leased_fraction: float = 0.5
    leases: dict[str, Lease] = field(default_factory=dict)
    stats: LeaseStats = field(default_factory=LeaseStats)
    _by_pages: dict[tuple[str, tuple[int, ...]], str] = field(default_factory=dict)

    @property
    def num_leased_pages(self) -> int:
        """Distinct pages some lease holds."""
        return len({page for lease in self.leases.values() for page in lease.pages})

    def lease_prefix(self, token_ids: list[int], namespace: str, num_tokens: int, ttl_s: float, now: float,
                     label: str = "5m", owner: str = "", shared: bool = True) -> Lease | str:
        """Lease the cached pages covering the first `num_tokens` of `token_ids` (the page holding
        the last of them too, when it is full and cached). Returns the lease or a LeaseRefusal."""
        if self.index is None:
            return LeaseRefusal.PREFIX_CACHE_OFF
        pages, matched = self.index.match(list(token_ids), namespace)
        wanted = min(cdiv(num_tokens, self.page_size), len(token_ids) // self.page_size)
        if wanted == 0 or matched // self.page_size < wanted:
            self.stats.refusals += 1
            return LeaseRefusal.NOT_CACHED
        return self.grant(namespace, pages[:wanted], num_tokens, ttl_s, now, label, owner, shared)

    def grant(self, namespace: str, pages: list[int], num_tokens: int, ttl_s: float, now: float,
              label: str = "5m", owner: str = "", shared: bool = True) -> Lease | str:
        """Lease `pages` (a cached prefix of `num_tokens` tokens) or refresh the shared lease that
        holds exactly them; `shared=False` (a named cache, released by its own id) always makes a
        lease of its own. Returns the lease, or a LeaseRefusal reason."""
        key = (namespace, tuple(pages))
        existing = self.leases.get(self._by_pages.get(key, "")) if shared else None
        if existing is not None:
            existing.ttl_s = max(existing.ttl_s, ttl_s)
            existing.expires_at = max(existing.expires_at, now + ttl_s)
            existing.label = label if ttl_s >= existing.ttl_s else existing.label
            self.stats.refreshes += 1
            return existing
        held = {page for lease in self.leases.values() for page in lease.pages}
        if len(held | set(pages)) > self.max_leased_fraction * self.pool.num_usable:
            self.stats.refusals += 1
            return LeaseRefusal.LEASED_FRACTION_CAP
        lease = Lease(f"lease-{secrets.token_hex(12)}", namespace, list(pages), num_tokens, ttl_s,
                      now + ttl_s, label, owner)
        for page in pages:
            self.pool.incref(page)
        self.leases[lease.lease_id] = lease
        if shared:
            self._by_pages[key] = lease.lease_id
        self.stats.grants += 1
        return lease

    def touch(self, namespace: str, hit_pages: list[int], now: float) -> list[Lease]:
        """A request read these pages: refresh every lease of its namespace whose whole prefix they
        cover. Returns the refreshed leases."""
        if not self.leases or not hit_pages:
            return []
        refreshed = []
        for lease in self.leases.values():
            if lease.namespace == namespace and hit_pages[:len(lease.pages)] == lease.pages:
                lease.expires_at = max(lease.expires_at, now + lease.ttl_s)
                self.stats.refreshes += 1
                refreshed.append(lease)
        return refreshed

    def extend(self, lease_id: str, ttl_s: float, now: float) -> Lease | None:
        lease = self.leases.get(lease_id)
        if lease is not None:
            lease.ttl_s = ttl_s
            lease.expires_at = now + ttl_s
        return lease

    def release(self, lease_id: str) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        key = (lease.namespace, tuple(lease.pages))
        if self._by_pages.get(key) == lease_id:
            del self._by_pages[key]
        for page in reversed(lease.pages):  # tail first, as a sequence frees its pages
            self.pool.decref(page)
        return True

    def expiring(self, now: float) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.expires_at <= now]

    def expire(self, now: float) -> int:
        """Release the leases whose TTL ran out; their pages become evictable again."""
        expired = [lid for lid, lease in self.leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            self.release(lease_id)
        self.stats.expiries += len(expired)
        return len(expired)

    def break_oldest(self) -> bool:
        """Drop the lease closest to expiry (so a request that cannot otherwise fit is admitted)."""
        if not self.leases:
            return False
        self.release(min(self.leases.values(), key=lambda lease: lease.expires_at).lease_id)
        self.stats.breaks += 1
        return True

    def page_refs(self) -> Counter:
        """References the leases hold, per page (for the manager's invariants)."""
        return Counter(page for lease in self.leases.values() for page in lease.pages)

    def stats_dict(self) -> dict[str, int]:
        return {"leased_pages": self.num_leased_pages, "num_leases": len(self.leases),
                "lease_grants": self.stats.grants, "lease_refreshes": self.stats.refreshes,
                "lease_expiries": self.stats.expiries, "lease_refusals": self.stats.refusals,
                "lease_breaks": self.stats.breaks}
