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
from kvserve.cache.stats import LeaseCounts


TOOL_CALL = "tool_call"  # the label of a lease that holds a conversation while its tool runs


class LeaseRefusal:
    BELOW_MIN_CACHEABLE = "below_min_cacheable"
    LEASED_FRACTION_CAP = "leased_fraction_cap"
    LEASE_COUNT_CAP = "lease_count_cap"  # the tenant holds MAX_LEASES_PER_TENANT leases already
    NOT_CACHED = "not_cached"  # the prefix's pages were not (all) in the cache
    PREFIX_CACHE_OFF = "prefix_cache_off"


@dataclass(slots=True)
class Breakpoint:
    """A cache breakpoint (Anthropic's `cache_control`, `kv_retention`, a named cache): keep the
    prompt's first `num_tokens` cached for `ttl_s` seconds after its last read."""

    num_tokens: int
    ttl_s: float
    label: str = "5m"  # "5m" | "1h": how usage reports the tokens it wrote
    shared: bool = True  # False (a named cache): its own lease, never merged with an equal one


@dataclass(frozen=True, slots=True)
class Retention:
    """What a request asks the cache to keep once its prompt is computed: its breakpoints of at least
    --min-cacheable-tokens (TTLs already scaled), shortest first."""

    breakpoints: tuple[Breakpoint, ...]
    num_prompt_tokens: int
    owner: str = ""  # the tenant that may extend, read back or release the leases by id
    num_below_min: int = 0  # breakpoints left out for being under --min-cacheable-tokens
    longest_asked: int = 0
    num_cached_tokens: int = 0  # the prompt's cached tokens at first admission (what was read)

    @property
    def below_min_cacheable(self) -> int | None:
        """The longest prefix asked for, when every breakpoint was under --min-cacheable-tokens."""
        return self.longest_asked if not self.breakpoints and self.num_below_min else None

    @classmethod
    def of(cls, breakpoints: list[Breakpoint], num_prompt_tokens: int, owner: str,
           min_cacheable_tokens: int, ttl_scale: float = 1.0) -> Retention | None:
        if not breakpoints:
            return None
        eligible = sorted((b for b in breakpoints if b.num_tokens >= min_cacheable_tokens),
                          key=lambda b: b.num_tokens)
        return cls(tuple(Breakpoint(b.num_tokens, b.ttl_s * ttl_scale, b.label, b.shared) for b in eligible),
                   num_prompt_tokens, owner, len(breakpoints) - len(eligible),
                   max(b.num_tokens for b in breakpoints))


@dataclass(slots=True)
class LeaseUsage:
    """What a request's breakpoints did, in Anthropic's terms."""

    cache_read_tokens: int = 0  # cached tokens up to the last breakpoint that could be cached
    cache_creation_tokens: dict[str, int] = field(default_factory=dict)  # by label: tokens newly leased
    refused: str | None = None  # why a breakpoint got no lease (LeaseRefusal), if one did not
    lease_ids: list[str] = field(default_factory=list)


MAX_LEASES_PER_TENANT = 64  # leases one tenant may hold at once (pages are capped by the fraction)


def _tenant_of(lease: Lease) -> str:
    return lease.owner or lease.namespace


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
    tool_call_grants: int = 0
    tool_call_used: int = 0


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

    def grant_retention(self, retention: Retention, namespace: str, prompt_pages: list[int],
                        now: float) -> LeaseUsage:
        """Lease the prefix up to each of the request's breakpoints, from `prompt_pages` (the cached
        pages holding its committed prompt, in order), and say what that did in Anthropic's terms:

        read     = the longest breakpoint whose whole prefix was served from the cache (a provider reads
                   at breakpoints: a partial hit of a prefix is a miss that writes it again)
        creation = for each granted breakpoint, the tokens past what was read or written before it
        A breakpoint shorter than --min-cacheable-tokens is silently not cached, as providers do; one
        refused by the leased-fraction cap leaves the request running without it (`refused` says so)."""
        usage = LeaseUsage()
        if not retention.breakpoints:
            usage.refused = LeaseRefusal.BELOW_MIN_CACHEABLE if retention.num_below_min else None
            return usage
        last_computable = retention.num_prompt_tokens - 1  # the last prompt token is always computed
        usage.cache_read_tokens = covered = max(
            (b.num_tokens for b in retention.breakpoints if retention.num_cached_tokens >= min(b.num_tokens, last_computable)),
            default=0)
        for breakpoint in retention.breakpoints:
            lease = self._lease_prefix(namespace, prompt_pages, retention, breakpoint, now)
            if isinstance(lease, str):
                usage.refused = lease
                continue
            usage.lease_ids.append(lease.lease_id)
            if breakpoint.num_tokens > covered:
                label = breakpoint.label
                usage.cache_creation_tokens[label] = (usage.cache_creation_tokens.get(label, 0)
                                                      + breakpoint.num_tokens - covered)
                covered = breakpoint.num_tokens
        return usage

    def _lease_prefix(self, namespace: str, prompt_pages: list[int], retention: Retention,
                      breakpoint: Breakpoint, now: float) -> Lease | str:
        """Lease the cached pages covering the breakpoint's tokens (the page holding the last of them
        too, when it is full and cached); a LeaseRefusal when they are not all cached."""
        if self.index is None:
            return LeaseRefusal.PREFIX_CACHE_OFF
        wanted = min(cdiv(breakpoint.num_tokens, self.page_size), retention.num_prompt_tokens // self.page_size)
        if wanted == 0 or len(prompt_pages) < wanted:
            self.stats.refusals += 1
            return LeaseRefusal.NOT_CACHED
        return self.grant(namespace, prompt_pages[:wanted], breakpoint.num_tokens, breakpoint.ttl_s, now,
                          breakpoint.label, retention.owner, breakpoint.shared)

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
        tenant = owner or namespace
        if sum(_tenant_of(lease) == tenant for lease in self.leases.values()) >= MAX_LEASES_PER_TENANT:
            self.stats.refusals += 1
            return LeaseRefusal.LEASE_COUNT_CAP
        cap = self.max_leased_fraction * self.pool.num_usable
        if not self._fits(pages, cap) and not self._reclaim(tenant, pages, cap):
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

    def _fits(self, pages: list[int], cap: float) -> bool:
        held = {page for lease in self.leases.values() for page in lease.pages}
        return len(held | set(pages)) <= cap

    def _reclaim(self, tenant: str, pages: list[int], cap: float) -> bool:
        """Make room under the cap for `tenant`'s new lease by releasing leases of other tenants that
        hold more than an equal share of it (soonest to expire first), so one tenant's holds cannot
        refuse another's cache request. True if the pages fit afterwards."""
        while not self._fits(pages, cap):
            tenants = {_tenant_of(lease) for lease in self.leases.values()} | {tenant}
            share = cap / len(tenants)
            held: dict[str, set[int]] = {}
            for lease in self.leases.values():
                held.setdefault(_tenant_of(lease), set()).update(lease.pages)
            over = [lease for lease in self.leases.values()
                    if _tenant_of(lease) != tenant and len(held[_tenant_of(lease)]) > share]
            if not over:
                return False
            self.release(min(over, key=lambda lease: lease.expires_at).lease_id)
            self.stats.breaks += 1
        return True

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

    def release_tenant(self, tenant: str) -> int:
        """Release the leases a tenant's requests made (prompt leases and tool-call holds), never its
        named caches (leases of their own, released by id); returns how many (Ollama's keep_alive 0)."""
        shared = set(self._by_pages.values())
        mine = [i for i, lease in self.leases.items() if _tenant_of(lease) == tenant
                and (i in shared or lease.label == TOOL_CALL)]
        return sum(self.release(i) for i in mine)

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

    def hold(self, namespace: str, pages: list[int], num_tokens: int, ttl_s: float, now: float,
             owner: str) -> Lease | str:
        """Hold a finished conversation's cached pages while its tool call runs: a lease of its own
        (label TOOL_CALL), under the same cap and broken under pressure like any other."""
        if self.index is None:
            return LeaseRefusal.PREFIX_CACHE_OFF
        if not pages:
            self.stats.refusals += 1
            return LeaseRefusal.NOT_CACHED
        lease = self.grant(namespace, pages, num_tokens, ttl_s, now, TOOL_CALL, owner, shared=False)
        if not isinstance(lease, str):
            self.stats.tool_call_grants += 1
        return lease

    def use_hold(self, lease_id: str, owner: str) -> bool:
        """The follow-up request was admitted (its own references hold the pages now): end the hold."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.label != TOOL_CALL or lease.owner != owner:
            return False
        self.stats.tool_call_used += 1
        return self.release(lease_id)

    def counts(self) -> LeaseCounts:
        holds = [lease for lease in self.leases.values() if lease.label == TOOL_CALL]
        return LeaseCounts(self.num_leased_pages, len(self.leases), self.stats.grants, self.stats.refreshes,
                           self.stats.expiries, self.stats.refusals, self.stats.breaks, len(holds),
                           len({page for lease in holds for page in lease.pages}),
                           self.stats.tool_call_grants, self.stats.tool_call_used)
