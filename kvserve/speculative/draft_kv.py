"""DraftKV: the draft model's paged KV as integers (speculative method draft_model). Its pages are a pool
of their own, as many as the target's and budgeted from the same --kv-cache-memory (cache_plan.plan_cache
splits the bytes), with one block table per request, like the target's but private: the draft never
shares, indexes, leases, tiers or publishes a page. Its K/V of a request's prefix is recomputed instead
(after admission, a prefix hit, a fork, a preemption or a swap), catching up under a per-step cap.

Per request, `num_computed` counts the tokens whose draft K/V its pages hold. A step computes the
known tokens past it (catch-up), then proposes k drafts, writing the decode token's and the first k - 1
drafts' K/V; after verification only the accepted drafts' K/V count (`verified`), and pages past the
kept tokens go back to the pool, as the target's rejected positions do (KVCacheManager.truncate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.batch import DraftSeq
from kvserve.cache.pages import PagePool
from kvserve.request import Request


@dataclass(slots=True)
class _DraftSeqState:
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0


class DraftKV:
    def __init__(self, num_pages: int, page_size: int, max_catch_up: int) -> None:
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.max_catch_up = max_catch_up  # draft rows a request computes per step before it proposes
        self._seqs: dict[str, _DraftSeqState] = {}

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    def caught_up(self, request: Request) -> bool:
        """Whether this step's catch-up reaches the request's last token (so it can propose)."""
        state = self._seqs.get(request.request_id)
        return request.num_tokens - (state.num_computed if state else 0) <= self.max_catch_up

    def fits(self, request: Request, num_drafts: int) -> bool:
        """Whether the pages for catch-up and `num_drafts` drafts can be had now."""
        return self._pages_needed(request, num_drafts) <= self.pool.num_free

    def plan(self, request: Request, num_drafts: int) -> DraftSeq | None:
        """The draft's work for the request this step (pages taken), or None when its pages cannot
        be had (then the target verifies no draft: memory pressure turns the draft path down)."""
        state = self._seqs.setdefault(request.request_id, _DraftSeqState())
        start = state.num_computed
        catch_up = min(request.num_tokens - start, self.max_catch_up)
        if start + catch_up < request.num_tokens:
            num_drafts = 0  # still catching up: nothing to propose from yet
        pages = self.pool.allocate(self._pages_needed(request, num_drafts))
        if pages is None:
            return None
        state.block_table.extend(pages)
        return DraftSeq(request.token_ids[start:start + catch_up], start, list(state.block_table), num_drafts)

    def _pages_needed(self, request: Request, num_drafts: int) -> int:
        """Pages past the request's draft block table for its catch-up and drafts: the decode token and
        the first num_drafts - 1 drafts are written; the last draft is proposed, not computed."""
        state = self._seqs.get(request.request_id) or _DraftSeqState()
        end = min(request.num_tokens, state.num_computed + self.max_catch_up) + max(0, num_drafts - 1)
        return max(0, -(-end // self.page_size) - len(state.block_table))

    def verified(self, request_id: str, work: DraftSeq, num_accepted: int) -> None:
        """After the target's verification: the draft K/V of rejected drafts no longer count, and the
        pages past the last counted token go back to the pool (tail first)."""
        state = self._seqs.get(request_id)
        if state is None:
            return
        written = work.start_pos + len(work.token_ids)
        state.num_computed = written + (min(num_accepted, work.num_drafts - 1) if work.num_drafts else 0)
        keep = -(-state.num_computed // self.page_size)
        while len(state.block_table) > keep:
            self.pool.decref(state.block_table.pop())

    def free(self, request_id: str) -> None:
        """Drop the request's draft K/V (finished, aborted, preempted, swapped out): its pages go back."""
        state = self._seqs.pop(request_id, None)
        for page in reversed(state.block_table if state else []):
            self.pool.decref(page)

    def check_invariants(self) -> None:
        """Each used page is in exactly one block table, once; free + used = total (PagePool's own)."""
        self.pool.check_invariants()
        held = [page for state in self._seqs.values() for page in state.block_table]
        assert len(held) == len(set(held)), "a draft page is in two block tables"
        assert len(held) == self.pool.num_used, f"{self.pool.num_used} draft pages used, {len(held)} held"
        for state in self._seqs.values():
            assert len(state.block_table) >= -(-state.num_computed // self.page_size), "draft K/V without a page"
