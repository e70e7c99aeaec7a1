"""Fair shares of the cache per tenant (`--tenant-kv-share fair`): under pressure, evict first from
the tenant holding the most cached pages above an equal share, so one tenant's flood of unique
prompts cannot evict another tenant's working set. A pool listener in front of the prefix index."""

from __future__ import annotations

from collections import Counter

from kvserve.cache.hashing import tenant_of
from kvserve.cache.pages import PagePool
from kvserve.cache.prefix_hash import HashPrefixIndex
from kvserve.cache.prefix_radix import RadixPrefixIndex


class FairShareEviction:
    def __init__(self, index: HashPrefixIndex | RadixPrefixIndex, pool: PagePool) -> None:
        self.index = index
        self.pool = pool
        self.tenant_of_page: dict[int, str] = {}  # cached page -> its tenant
        self.pages_per_tenant: Counter[str] = Counter()
        self.num_fair_evictions = 0  # victims taken from a tenant over its share
        pool.listener = self

    def cached(self, page_id: int, namespace: str) -> None:
        tenant = tenant_of(namespace)
        if self.tenant_of_page.get(page_id) != tenant:
            self.forget(page_id)
            self.tenant_of_page[page_id] = tenant
            self.pages_per_tenant[tenant] += 1

    def clear(self) -> None:
        self.tenant_of_page.clear()
        self.pages_per_tenant.clear()

    def forget(self, page_id: int) -> None:
        tenant = self.tenant_of_page.pop(page_id, None)
        if tenant is not None:
            self.pages_per_tenant[tenant] -= 1
            if not self.pages_per_tenant[tenant]:
                del self.pages_per_tenant[tenant]

    # -- pool listener -------------------------------------------------------------------------
    def choose_victim(self) -> int | None:
        if len(self.pages_per_tenant) > 1:
            share = sum(self.pages_per_tenant.values()) / len(self.pages_per_tenant)
            for tenant, count in self.pages_per_tenant.most_common():
                if count <= share:
                    break
                page = self.index.choose_victim_among(lambda p, t=tenant: self.tenant_of_page.get(p) == t)
                if page is not None:
                    self.num_fair_evictions += 1
                    return page
        return self.index.choose_victim()

    def on_evict(self, page_id: int) -> None:
        self.index.on_evict(page_id)
        self.forget(page_id)

    def on_idle(self, page_id: int) -> None:
        self.index.on_idle(page_id)
