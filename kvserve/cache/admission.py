"""Where a prefix hit is decided, once per admission: the pool's longest cached prefix (one walk of the
prefix index), cut by the last-token rule, a token limit (fork parents), the page-boundary rule and the
window pool, then extended by the tier pages after it. The answer is a frozen PrefixHit; allocate()
re-checks its pages by hash (never by walking the index again) and reports what it used."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvserve.cache.leases import LeaseTable
from kvserve.cache.manager_tiers import extend_with_tiers
from kvserve.cache.offload import Offloader
from kvserve.cache.sequence import CACHE_SOURCES, PrefixHit, cdiv
from kvserve.cache.window import WindowPool


class AdmissionPlanner:
    """Reads the manager's index, window pool, tiers, leases and its cached-page hashes; changes none."""

    def __init__(self, index: Any, window: WindowPool | None, offload: Offloader, leases: LeaseTable,
                 hash_of_cached: dict[int, bytes], page_size: int, partial_page_hits: bool) -> None:
        self.index, self.window, self.offload, self.leases = index, window, offload, leases
        self.hash_of_cached = hash_of_cached  # the manager's: cached page -> its chained hash
        self.page_size, self.partial_page_hits = page_size, partial_page_hits

    def lookup(self, token_ids: list[int], namespace: str = "", max_tokens: int | None = None) -> PrefixHit:
        """The longest prefix of `token_ids` the pool holds in `namespace`: at most len - 1 tokens (the
        last token is always computed: its logits are needed) and `max_tokens`, on a page boundary
        where partial pages cannot be shared, cut where the window pool lacks pages."""
        if self.index is None or len(token_ids) < 2:
            return PrefixHit()
        pages, matched = self.index.match(list(token_ids), namespace)
        matched = min(matched, len(token_ids) - 1)
        pages = pages[:cdiv(matched, self.page_size)]
        hit = PrefixHit(tuple(pages), matched, num_matched_tokens=matched,
                        page_hashes=tuple(self.hash_of_cached[page] for page in pages))
        return self.cut(hit, matched if max_tokens is None else min(matched, max_tokens))

    def cut(self, hit: PrefixHit, num_tokens: int) -> PrefixHit:
        """`hit` shortened to at most `num_tokens` pool tokens (its tier loads dropped if it shrinks),
        then to what the page-boundary rule and the window pool allow."""
        if not self.partial_page_hits:
            num_tokens -= num_tokens % self.page_size
        num_pages = cdiv(num_tokens, self.page_size)
        if self.window is not None:
            num_tokens = self.window.usable_hit(list(hit.pages[:num_pages]), num_tokens)
            num_pages = cdiv(num_tokens, self.page_size)
        if num_tokens == hit.num_tokens and num_pages == len(hit.pages):
            return hit
        return replace(hit, pages=hit.pages[:num_pages], num_tokens=num_tokens, loads=(), load_sources=(),
                       num_loaded_tokens=0, page_hashes=hit.page_hashes[:num_pages])

    def plan(self, token_ids: list[int], namespace: str, max_tokens: int, budget: int, num_free_pages: int,
             hit: PrefixHit | None = None) -> PrefixHit:
        """What a request being admitted now reuses: its pool hit (`hit`, from a lookup of the same
        tokens this step, or a lookup now) cut to `max_tokens` (a fork parent keeps two prompt tokens to
        compute), then the full pages after it that the tiers hold, as many as surely fit with this
        step's chunk of `budget` tokens (so the allocation that follows succeeds)."""
        if hit is None:
            hit = self.lookup(token_ids, namespace, max_tokens)
        elif hit.num_tokens > max_tokens:
            hit = self.cut(hit, max_tokens)
        if self.index is None:
            return hit
        return extend_with_tiers(self.offload, token_ids, namespace, hit, max_tokens, budget, num_free_pages,
                                 self.page_size)

    def still_cached(self, hit: PrefixHit) -> PrefixHit:
        """`hit` as far as its pages still hold what they held at the lookup (the same chained hash:
        allocations since may have evicted some), cut again for the window pool; no index walk."""
        valid = 0
        for page, h in zip(hit.pages, hit.page_hashes):
            if self.hash_of_cached.get(page) != h:
                break
            valid += 1
        used = hit if valid == len(hit.pages) else self.cut(hit, min(hit.num_tokens, valid * self.page_size))
        return self.cut(used, used.num_tokens) if self.window is not None else used

    def sources(self, hit: PrefixHit) -> dict[str, int]:
        """Cached tokens by where they came from (CACHE_SOURCES); pool pages a lease holds: "lease"."""
        leased_pages = self.leases.page_refs()
        leased = min(sum(self.page_size for page in hit.pages if page in leased_pages), hit.num_tokens)
        sources = dict.fromkeys(CACHE_SOURCES, 0)
        sources["pool"], sources["lease"] = hit.num_tokens - leased, leased
        for source in hit.load_sources:
            sources[source] += self.page_size
        return sources
