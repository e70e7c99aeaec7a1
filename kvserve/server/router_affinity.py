"""`prompt_cache_key` in the router: the requests of one key (per API key: tenants never share an entry)
go to the backend the key's first request went to, while that backend is healthy, so a key's prefix
stays warm in one cache, as OpenAI routes by it. A key whose backend is down is placed again by the
routing policy, and stays on its new backend."""

from __future__ import annotations

from typing import Any

from kvserve.cache.fair_table import FairShareTable
from kvserve.server.router_index import bearer

MAX_KEYS = 100_000  # remembered keys: past these, the least recently used of the API key holding the most go

CacheKey = tuple[str, str]  # (API key or "", prompt_cache_key)


class CacheKeyAffinity:
    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._backend: FairShareTable[CacheKey, str] = FairShareTable(max_keys)  # tenant: the API key

    @staticmethod
    def key_of(headers: dict[str, str], body: Any) -> CacheKey | None:
        key = body.get("prompt_cache_key") if isinstance(body, dict) else None
        if not isinstance(key, str) or not key:
            return None
        return (bearer(headers) or headers.get("x-api-key") or "", key)

    def backend_of(self, key: CacheKey | None) -> str | None:
        if key is None:
            return None
        self._backend.touch(key)
        return self._backend.get(key)

    def place(self, key: CacheKey | None, url: str) -> None:
        if key is not None:
            self._backend.put(key, url, key[0])
