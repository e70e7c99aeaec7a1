"""The manager's side below the pool: the full pages after a pool hit that the tiers hold (host, disk,
Redis) extend an admission's hit as loads (extend_with_tiers); a preempted sequence swaps out to the
host tier and back, and the page moves decided meanwhile go to the runner and their payloads back
(TierMoves, composed into KVCacheManager as `manager.tiers` over its pool and sequence table)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvserve.cache.offload import Offloader, SaveTarget
from kvserve.cache.pages import PagePool
from kvserve.cache.sequence import PrefixHit, SeqPages, cdiv


def extend_with_tiers(offload: Offloader, token_ids: Sequence[int], namespace: str, hit: PrefixHit,
                      max_tokens: int, budget: int, num_free_pages: int, page_size: int) -> PrefixHit:
    """`hit` plus the full pages after it that the tiers hold, asked once per admission: at most up to
    `max_tokens` and as many as surely fit with this step's chunk of `budget` tokens, so the allocation
    that follows succeeds. A partial pool hit is cut to its page boundary if the tiers have that page."""
    if not offload.has_tiers:
        return hit
    ps = page_size
    first = hit.num_tokens // ps
    free = num_free_pages - len(hit.pages)
    rest = cdiv(len(token_ids) - first * ps, ps)  # pages from the hit's boundary on
    room = free if rest <= free else free - cdiv(budget, ps)  # loads + this step's chunk fit
    found = offload.fetch(token_ids, namespace, first, min(max_tokens // ps - first, room))
    if not found.payloads:
        return hit
    return PrefixHit(hit.pages[:first], first * ps, tuple(found.payloads), tuple(found.sources),
                     len(found.payloads) * ps, hit.num_matched_tokens, hit.page_hashes[:first])


class TierMoves:
    def __init__(self, offload: Offloader, pool: PagePool, seqs: dict[str, SeqPages],
                 free: Callable[[str], None]) -> None:
        self.offload, self.pool = offload, pool
        self._seqs = seqs  # the manager's sequence table (shared, not copied)
        self._free = free  # the manager's free(seq_id)

    def swap_out(self, seq_id: str) -> bool:
        """Move the sequence's pages to the host tier (read before this step writes anything) and
        free them. False, with nothing changed, when the host tier has no room."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        if not self.offload.swap_out(seq_id, seq.block_table):
            return False
        self._free(seq_id)
        return True

    def num_swapped_pages(self, seq_id: str) -> int:
        return self.offload.num_swapped_pages(seq_id)

    def swap_in(self, seq_id: str, namespace: str) -> bool:
        """Fresh pages for a swapped-out sequence, filled from the host tier before this step computes;
        no prefix lookup, nothing counted (its pages are committed again as it goes on). False, with
        nothing changed, if pages are short."""
        pages = self.allocate_pages(seq_id, namespace, self.offload.num_swapped_pages(seq_id))
        if pages is not None:
            self.offload.swap_in(seq_id, pages)
        return pages is not None

    def allocate_pages(self, seq_id: str, namespace: str, num_pages: int) -> list[int] | None:
        """Fresh pages for a sequence whose contents come from elsewhere; None if pages are short."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has pages")
        pages = self.pool.allocate(num_pages)
        if pages is not None:
            self._seqs[seq_id] = SeqPages(namespace, list(pages))
        return pages

    def drop_swap(self, seq_id: str) -> None:
        self.offload.drop_swap(seq_id)

    def take_page_moves(self) -> tuple[list[tuple[int, SaveTarget]], list[tuple[int, Any]]]:
        """The saves and loads decided since the last call (see batch.PageOps)."""
        return self.offload.take()

    def complete(self, saves: list[tuple[int, SaveTarget]], payloads: list[Any]) -> None:
        """The runner read `saves`: hand the payloads to the tiers."""
        if saves:
            self.offload.deliver(saves, payloads)
