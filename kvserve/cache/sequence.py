"""What the cache manager knows of one sequence (SeqPages) and what a prefix lookup found (PrefixHit)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class PrefixHit:
    pages: list[int] = field(default_factory=list)  # cached pages covering the hit, in order
    num_tokens: int = 0  # cached tokens; the scheduler sets num_computed_tokens = num_tokens
    # If num_tokens % page_size != 0 the LAST page is a partial hit: only its first
    # num_tokens % page_size tokens match; allocate() copies it into a fresh page instead of sharing it.
    # Full pages after the pool's hit that tiers below the pool hold (the local hit then ends on a
    # page boundary): their payloads are loaded into fresh pages instead of being computed.
    loads: list[Any] = field(default_factory=list)
    load_sources: list[str] = field(default_factory=list)  # "host" | "redis", one per load
    num_loaded_tokens: int = 0

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the request does not compute: the pool's hit plus the loaded pages."""
        return self.num_tokens + self.num_loaded_tokens


@dataclass(slots=True)
class SeqPages:
    namespace: str
    block_table: list[int]
    num_committed_pages: int = 0  # pages 0..n-1 are full of computed tokens and were offered to the index
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the committed pages
    committed_token_ids: list[int] = field(default_factory=list)  # their tokens (for checks)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
