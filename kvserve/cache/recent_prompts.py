"""RecentPrompts: the prompts each tenant had admitted lately, which cache/explain.py compares a new
prompt with to tell a page that never filled (partial_page) from a cold miss. Each tenant keeps its own
within its own bounds, so one tenant's traffic never pushes another's prompts out and changes what
that tenant is told. Pure Python."""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from kvserve.cache.hashing import tenant_of

PROMPTS_PER_TENANT = 64
TOKENS_PER_TENANT = 1 << 17  # at most 1 MiB of token ids a tenant (int64), past its newest prompt
MAX_TENANTS = 256  # tenants are API keys: more than this many at once, the least recent is dropped


class RecentPrompts:
    def __init__(self, prompts_per_tenant: int = PROMPTS_PER_TENANT, tokens_per_tenant: int = TOKENS_PER_TENANT,
                 max_tenants: int = MAX_TENANTS) -> None:
        self.prompts_per_tenant, self.tokens_per_tenant = prompts_per_tenant, tokens_per_tenant
        self.max_tenants = max_tenants
        self._by_tenant: OrderedDict[str, deque[tuple[str, Sequence[int]]]] = OrderedDict()
        self._tokens: dict[str, int] = {}

    def add(self, namespace: str, token_ids: Sequence[int]) -> None:
        """A prompt admitted in `namespace` (its newest)."""
        tenant = tenant_of(namespace)
        prompts = self._by_tenant.setdefault(tenant, deque())
        self._by_tenant.move_to_end(tenant)
        prompts.append((namespace, _compact(token_ids)))
        self._tokens[tenant] = self._tokens.get(tenant, 0) + len(token_ids)
        while len(prompts) > 1 and (len(prompts) > self.prompts_per_tenant
                                    or self._tokens[tenant] > self.tokens_per_tenant):
            self._tokens[tenant] -= len(prompts.popleft()[1])
        while len(self._by_tenant) > self.max_tenants:
            dropped, _ = self._by_tenant.popitem(last=False)
            del self._tokens[dropped]

    def before_last(self, namespace: str) -> list[Sequence[int]]:
        """The namespace's recent prompts, oldest first, without its tenant's newest (the request being
        explained, added when it was admitted)."""
        prompts = list(self._by_tenant.get(tenant_of(namespace), ()))[:-1]
        return [tokens for ns, tokens in prompts if ns == namespace]


def _compact(token_ids: Sequence[int]) -> Sequence[int]:
    """The ids as 8 bytes each; a tuple for ids past int64 (the cache takes any integer)."""
    try:
        return array("q", token_ids)
    except OverflowError:
        return tuple(token_ids)
