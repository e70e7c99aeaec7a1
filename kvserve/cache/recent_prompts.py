"""RecentPrompts: the prompts each tenant had admitted lately, which cache/explain.py compares a new
prompt with to tell a page that never filled (partial_page) from a cold miss. Each tenant keeps its own
within its own bounds, and past the bound on all of them together the tenant holding the most tokens
gives up its oldest prompt: a tenant within an equal share keeps what it would keep alone, however many
other tenants send how much. Pure Python."""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Sequence

from kvserve.cache.hashing import tenant_of

PROMPTS_PER_TENANT = 64
TOKENS_PER_TENANT = 1 << 17  # at most 1 MiB of token ids a tenant (int64), past its newest prompt
TOKENS_IN_ALL = 1 << 25  # 256 MiB of ids for all tenants together: 256 tenants' full lists


class RecentPrompts:
    def __init__(self, prompts_per_tenant: int = PROMPTS_PER_TENANT, tokens_per_tenant: int = TOKENS_PER_TENANT,
                 tokens_in_all: int = TOKENS_IN_ALL) -> None:
        self.prompts_per_tenant, self.tokens_per_tenant = prompts_per_tenant, tokens_per_tenant
        self.tokens_in_all = tokens_in_all
        self._by_tenant: dict[str, deque[tuple[str, Sequence[int]]]] = {}
        self._tokens: dict[str, int] = {}
        self._total = 0
        # (-tokens, tenant) pushed at each change; an entry whose count is no longer the tenant's is stale
        self._heaviest: list[tuple[int, str]] = []

    def add(self, namespace: str, token_ids: Sequence[int]) -> None:
        """A prompt admitted in `namespace` (its newest)."""
        tenant = tenant_of(namespace)
        prompts = self._by_tenant.setdefault(tenant, deque())
        prompts.append((namespace, _compact(token_ids)))
        self._count(tenant, len(token_ids))
        while len(prompts) > 1 and (len(prompts) > self.prompts_per_tenant
                                    or self._tokens[tenant] > self.tokens_per_tenant):
            self._count(tenant, -len(prompts.popleft()[1]))
        self._mark(tenant)
        while self._total > self.tokens_in_all:
            self._drop_oldest(self._heaviest_tenant())

    def before_last(self, namespace: str) -> list[Sequence[int]]:
        """The namespace's recent prompts, oldest first, without its tenant's newest (the request being
        explained, added when it was admitted)."""
        prompts = list(self._by_tenant.get(tenant_of(namespace), ()))[:-1]
        return [tokens for ns, tokens in prompts if ns == namespace]

    def _count(self, tenant: str, tokens: int) -> None:
        self._tokens[tenant] = self._tokens.get(tenant, 0) + tokens
        self._total += tokens

    def _mark(self, tenant: str) -> None:
        heapq.heappush(self._heaviest, (-self._tokens[tenant], tenant))
        if len(self._heaviest) > 4 * len(self._tokens) + 64:  # stale entries: rebuild from the counts
            self._heaviest = [(-tokens, t) for t, tokens in self._tokens.items()]
            heapq.heapify(self._heaviest)

    def _heaviest_tenant(self) -> str:
        while True:
            tokens, tenant = self._heaviest[0]
            if self._tokens.get(tenant) == -tokens:
                return tenant
            heapq.heappop(self._heaviest)

    def _drop_oldest(self, tenant: str) -> None:
        prompts = self._by_tenant[tenant]
        self._count(tenant, -len(prompts.popleft()[1]))
        if prompts:
            self._mark(tenant)
        else:
            del self._by_tenant[tenant], self._tokens[tenant]


def _compact(token_ids: Sequence[int]) -> Sequence[int]:
    """The ids as 8 bytes each; a tuple for ids past int64 (the cache takes any integer)."""
    try:
        return array("q", token_ids)
    except OverflowError:
        return tuple(token_ids)
