"""The tier side of KVCacheManager (a mixin over its pool, index and sequences): full pages a tier
holds extend a pool hit, a preempted sequence swaps out to the host tier and back, and the page moves
decided meanwhile are handed to the runner (take_page_moves) and their payloads back (complete)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.cache.offload import SaveTarget
from kvserve.cache.sequence import PrefixHit, SeqPages, cdiv

if TYPE_CHECKING:
    from kvserve.cache.offload import Offloader
    from kvserve.cache.pages import PagePool


class TierMoves:
    offload: Offloader
    index: Any
    pool: PagePool
    page_size: int
    _seqs: dict[str, SeqPages]

    def extend_from_tiers(self, token_ids: list[int], namespace: str, hit: PrefixHit,
                          max_tokens: int, budget: int) -> PrefixHit:
        """Add to a pool hit the full pages after it that the tiers hold, asked once per admission:
        at most up to `max_tokens` and as many as surely fit with this step's chunk of `budget`
        tokens, so the allocation that follows succeeds. A partial pool hit is cut to its page
        boundary if the tiers have that page."""
        if not self.offload.has_tiers or self.index is None:
            return hit
        ps = self.page_size
        first = hit.num_tokens // ps
        free = self.num_free_pages - len(hit.pages)
        rest = cdiv(len(token_ids) - first * ps, ps)  # pages from the hit's boundary on
        room = free if rest <= free else free - cdiv(budget, ps)  # loads + this step's chunk fit
        found = self.offload.fetch(token_ids, namespace, first, min(max_tokens // ps - first, room))
        if not found.payloads:
            return hit
        return PrefixHit(hit.pages[:first], first * ps, found.payloads, found.sources,
                         len(found.payloads) * ps)

    def _load_from_tiers(self, seq_id: str, token_ids: list[int], hit: PrefixHit) -> None:
        """The sequence's pages after its pool hit get their K/V from the tiers: counted as hits,
        committed, and queued as loads (the runner writes them before this step computes)."""
        seq = self._seqs[seq_id]
        start, num_pages = seq.num_committed_pages, len(hit.loads)
        pages = seq.block_table[start:start + num_pages]
        self.prefix_cache_hits += hit.num_loaded_tokens
        # (radix may swap a page for an identical cached one here: then its load is just unused)
        self.commit(seq_id, token_ids, (start + num_pages) * self.page_size)
        self.offload.load(pages, hit.loads)

    # -- swap: a preempted sequence's pages to the host tier and back ---------------------------
    def swap_out(self, seq_id: str) -> bool:
        """Move the sequence's pages to the host tier (read before this step writes anything) and
        free them. False, with nothing changed, when the host tier has no room."""
        if not self.offload.swap_out(seq_id, self._seq(seq_id).block_table):
            return False
        self.free(seq_id)
        return True

    def num_swapped_pages(self, seq_id: str) -> int:
        return self.offload.num_swapped_pages(seq_id)

    def swap_in(self, seq_id: str, namespace: str) -> bool:
        """Fresh pages for a swapped-out sequence, filled from the host tier before this step
        computes; no prefix lookup, nothing counted (the pages are committed again as the sequence
        goes on). False, with nothing changed, if pages are short."""
        pages = self.allocate_pages(seq_id, namespace, self.offload.num_swapped_pages(seq_id))
        if pages is None:
            return False
        self.offload.swap_in(seq_id, pages)
        return True

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

