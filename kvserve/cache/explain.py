"""Why did this request miss? One explanation per admitted request (`kv_explain: true`): how many
prompt tokens came from each source, where the prompt left the longest cached prefix of its
namespace, and the reason the rest was computed. Every reason is decided from facts the cache
recorded (CacheHistory), never guessed:

    full_hit               everything but the last token (always computed) was cached
    evicted                the next page was cached once and left (or came back from a tier below)
    lease_expired          ... it left after a lease on it ran out
    below_min_cacheable    the request asked to retain a prefix shorter than --min-cacheable-tokens
    window_evicted         the full-attention pages are cached further, but the sliding-window layers'
                           pages under the window before that point were evicted (hybrid allocator)
    diverged               the cache held a different continuation of the matched prefix
    partial_page           the text shared with recent prompts ends inside a page that never filled
                           (e.g. a page size longer than the shared prefix): only full pages are cached
    cold                   nothing of this prompt was ever cached in its namespace

Only the request's own namespace is looked at: whether the same text is cached for another tenant
or cache_salt is never said (it would tell one tenant what another sent), so to B, A's prefix is
`cold`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.cache.hashing import common_prefix_len, page_hashes
from kvserve.cache.history import CacheHistory
from kvserve.cache.sequence import PrefixHit


@dataclass(slots=True)
class CacheExplanation:
    cached_tokens: int
    cached_by_source: dict[str, int] = field(default_factory=dict)
    diverged_at: int | None = None
    reason: str = "cold"
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"cached_tokens": self.cached_tokens, "cached_by_source": dict(self.cached_by_source),
                "diverged_at": self.diverged_at, "reason": self.reason, "detail": self.detail}


def explain(token_ids: Sequence[int], namespace: str, hit: PrefixHit, cached_by_source: dict[str, int],
            page_size: int, history: CacheHistory, now: float,
            below_min_cacheable: int | None = None, recent: Sequence[Sequence[int]] = (),
            window_matched: int = 0) -> CacheExplanation:
    """`hit` as allocate() used it (the pool's pages and any tier loads), `cached_by_source` as it
    counted them; `below_min_cacheable`: the
    longest breakpoint the request asked to retain, when all of them were too short; `recent`: the
    namespace's recent prompts (where the prompt leaves the text it shares with them);
    `window_matched`: tokens the main index matched when a window pool cut the hit shorter."""
    cached = hit.num_cached_tokens
    out = CacheExplanation(cached, dict(cached_by_source))
    num_tokens = len(token_ids)
    hashes = page_hashes(token_ids, page_size, namespace)
    first_missing = cached // page_size  # the page holding the first computed token
    if hit.loads:
        names = ", ".join(sorted({s for s in hit.load_sources}))
        out.reason = "evicted"
        out.detail = (f"{len(hit.loads)} pages had left the pool and were loaded back from the {names} "
                      f"tier" + ("" if cached >= num_tokens - 1 else f"; tokens {cached}.. were computed"))
        out.diverged_at = None if cached >= num_tokens - 1 else cached
        return out
    if cached >= num_tokens - 1:
        out.reason, out.detail = "full_hit", "every prompt token but the last was cached"
        return out
    out.diverged_at = cached
    if below_min_cacheable is not None:
        out.reason = "below_min_cacheable"
        out.detail = (f"the prefix to retain ({below_min_cacheable} tokens) is under "
                      f"--min-cacheable-tokens, so it got no lease and was not kept")
        return out
    if window_matched > cached:
        out.reason = "window_evicted"
        out.detail = (f"the full-attention pages hold tokens 0..{window_matched - 1}, but the sliding-window "
                      f"layers' pages of the window before token {window_matched} were evicted, so the hit "
                      f"stops at {cached}")
        return out
    record = history.record(hashes[first_missing]) if first_missing < len(hashes) else None
    if record is not None and record.evicted_at is not None:
        ago = now - record.evicted_at
        if record.lease_expired_at is not None and record.lease_expired_at <= record.evicted_at:
            out.reason = "lease_expired"
            out.detail = (f"page {first_missing} (tokens {first_missing * page_size}..) was leased; the "
                          f"lease ran out and the page was evicted {ago:.1f} s ago")
        else:
            out.reason = "evicted"
            out.detail = (f"page {first_missing} (tokens {first_missing * page_size}..) was evicted from the "
                          f"pool {ago:.1f} s ago and no tier below held it")
        return out
    shared = max((common_prefix_len(token_ids, p) for p in recent), default=0)  # same namespace
    if cached == 0 and 0 < shared < page_size:
        out.reason = "partial_page"
        out.detail = (f"recent prompts share only the first {shared} tokens, less than a page "
                      f"({page_size} tokens): only full pages are cached; a smaller --page-size would hit")
        out.diverged_at = shared
        return out
    parent = hashes[first_missing - 1] if first_missing else namespace
    nxt = hashes[first_missing] if first_missing < len(hashes) else None
    if history.has_other_child(parent, nxt):
        out.reason = "diverged"
        out.detail = f"the prompt leaves the cached prefix at token {cached}: the cache holds another continuation"
        return out
    if shared > cached:  # shared with a recent prompt, not cached: a page that never filled
        out.reason = "partial_page"
        out.detail = (f"tokens {cached}..{shared - 1} are shared with a recent prompt but lie in a page that "
                      f"was never full (page size {page_size}); only full pages are cached")
        out.diverged_at = shared
        return out
    out.diverged_at = None if cached == 0 else cached
    out.reason = "cold" if cached == 0 else "diverged"
    out.detail = ("no prefix of this prompt was ever cached in its namespace" if cached == 0
                  else f"the prompt leaves the cached prefix at token {cached}")
    return out


def explain_admission(token_ids: Sequence[int], namespace: str, allocation: Any, page_size: int,
                      history: CacheHistory, now: float, recent: Sequence[Sequence[int]],
                      windowed: bool, below_min_cacheable: int | None = None) -> CacheExplanation:
    """explain() for a request just admitted with `allocation` (sequence.Allocation), from the facts its
    lookup and allocation recorded (no index walk); `recent`: the namespace's prompts admitted before
    it (RecentPrompts); `windowed`: a window pool may have cut the hit."""
    hit = allocation.hit
    matched = hit.num_matched_tokens - hit.num_matched_tokens % page_size if windowed else 0
    return explain(token_ids, namespace, hit, allocation.cached_by_source, page_size, history, now,
                   below_min_cacheable, recent, matched)
