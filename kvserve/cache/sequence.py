"""What the cache manager knows of one sequence (SeqPages), what a request can reuse (PrefixHit,
decided once per admission by KVCacheManager.lookup) and what allocate did with it (Allocation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CACHE_SOURCES = ("pool", "lease", "host", "disk", "redis")  # where a cached token came from


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What a request can reuse: the pool's cached pages covering its first `num_tokens` tokens, then
    full pages the tiers below the pool hold (loaded instead of computed). A frozen value: allocate()
    takes it and says what it used in its Allocation; nobody edits it."""

    pages: tuple[int, ...] = ()  # cached pages covering the pool's hit, in order
    num_tokens: int = 0  # tokens the pool's pages cover
    # If num_tokens % page_size != 0 the LAST page is a partial hit: only its first
    # num_tokens % page_size tokens match; allocate() copies it into a fresh page instead of sharing it.
    # With loads, the pool's hit ends on a page boundary and they are the full pages after it.
    loads: tuple[Any, ...] = ()
    load_sources: tuple[str, ...] = ()  # "host" | "disk" | "redis", one per load
    num_loaded_tokens: int = 0
    # What the prefix index matched before the window pool and the token limit cut it (explanations),
    # and the hashes of `pages` when matched (allocate checks them instead of matching again).
    num_matched_tokens: int = field(default=0, compare=False)
    page_hashes: tuple[bytes, ...] = field(default=(), compare=False)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the request does not compute: the pool's hit plus the loaded pages."""
        return self.num_tokens + self.num_loaded_tokens


@dataclass(frozen=True, slots=True)
class Allocation:
    """What KVCacheManager.allocate did: the hit it used (smaller than the one it was given when
    pages of it were evicted since the lookup), the page copies to apply first, and where the
    cached tokens came from."""

    hit: PrefixHit
    copies: list[tuple[int, int]]
    cached_by_source: dict[str, int]

    @property
    def num_cached_tokens(self) -> int:
        return self.hit.num_cached_tokens


@dataclass(slots=True)
class SeqPages:
    namespace: str
    block_table: list[int]
    num_committed_pages: int = 0  # pages 0..n-1 are full of computed tokens and were offered to the index
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the committed pages
    committed_token_ids: list[int] = field(default_factory=list)  # their tokens (for checks)
    retention: Any = None  # leases.Retention: breakpoints to lease once the prompt is committed


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
