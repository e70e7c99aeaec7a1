"""FairShareTable: a bounded dict whose entries each belong to a tenant. Past its capacity the least
recently put entry of the tenant holding the most entries goes, so a tenant within an equal share
keeps every entry whatever another tenant puts (the pool's fair shares, applied to what the server
remembers about requests). Pure Python."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FairShareTable(Generic[K, V]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: dict[K, tuple[str, V]] = {}  # least recently put first
        self._by_tenant: dict[str, OrderedDict[K, None]] = {}  # each tenant's keys, least recent first
        # tenants by how many entries they hold, so that finding the one holding the most costs O(1)
        # however many tenants there are (a max over them cost 1 ms a put at 10,000 tenants)
        self._of_size: dict[int, dict[str, None]] = {}
        self._largest = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        return entry[1] if entry is not None else None

    def put(self, key: K, value: V, tenant: str) -> None:
        """Add or replace `key`'s entry, now its tenant's most recent."""
        self.pop(key)
        self._entries[key] = (tenant, value)
        keys = self._by_tenant.setdefault(tenant, OrderedDict())
        keys[key] = None
        self._resize(tenant, len(keys) - 1, len(keys))
        while len(self._entries) > self.capacity:
            largest = next(iter(self._of_size[self._largest]))
            self.pop(next(iter(self._by_tenant[largest])))

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        keys = self._by_tenant[entry[0]]
        del keys[key]
        self._resize(entry[0], len(keys) + 1, len(keys))
        if not keys:
            del self._by_tenant[entry[0]]
        return entry[1]

    def _resize(self, tenant: str, old: int, new: int) -> None:
        """Move `tenant` from the tenants holding `old` entries to those holding `new` (0: none)."""
        if old:
            bucket = self._of_size[old]
            del bucket[tenant]
            if not bucket:
                del self._of_size[old]
        if new:
            self._of_size.setdefault(new, {})[tenant] = None
        if new > self._largest:
            self._largest = new
        elif old == self._largest and old not in self._of_size:
            self._largest = new  # (sizes change by one: `new` holds this tenant, or the table is empty)

    def touch(self, key: K) -> None:
        """Make `key` its tenant's most recent (a use, as a put would)."""
        entry = self._entries.get(key)
        if entry is not None:
            self.put(key, entry[1], entry[0])

    def tenant_size(self, tenant: str) -> int:
        return len(self._by_tenant.get(tenant, ()))

    def items(self) -> Iterator[tuple[K, V]]:
        return ((key, value) for key, (_, value) in self._entries.items())

    def items_of(self, tenant: str) -> Iterator[tuple[K, V]]:
        return ((key, self._entries[key][1]) for key in self._by_tenant.get(tenant, ()))
