"""KVCacheManager: the scheduler's only cache API. It owns the page pool, every sequence's block table
and the prefix index ("radix", "hash" or "off"), and counts what the cache does.

A sequence's life, as the scheduler drives it each step:

    hit = lookup(tokens, ns)                      read-only: longest cached prefix, never the last token
    hit = plan_admission(tokens, ns, limit, budget, hit)   cut to a token limit, tier pages added
    got = allocate(id, tokens, ns, hit, end)      refs on the hit's pages (+ a copy of a partial last
                                                  page), fresh pages up to `end`; None: no room;
                                                  got.hit / .copies / .cached_by_source: what it did
    copies = append(id, num_computed, end)        grow to `end`; copy-on-write of shared pages about
                                                  to be written; None: no room (preempt someone)
    ... the runner applies `copies` in order, then computes positions num_computed..end-1 ...
    truncate(id, num_tokens)                      speculative decoding: drop rejected drafts' pages
    commit(id, tokens, num_computed, retention)   index the pages that are now full (radix may swap a
                                                  page for an identical cached one: re-read block_table);
                                                  the prompt computed: lease its breakpoints
    free(id)                                      pages back, tail first; cached ones stay reusable

Where a hit is decided: admission.py (lookup, plan_admission). Pages below the pool (swap, offload,
load-back, publish) are decided here too, through the Offloader; swap and the page moves handed to the
runner are `self.tiers` (manager_tiers.TierMoves). With a sliding-window model the windowed layers' pages live in a
WindowPool (window.py) that follows every sequence's table here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvserve.cache.admission import AdmissionPlanner
from kvserve.cache.explain import CacheExplanation, explain_admission
from kvserve.cache.fair_share import FairShareEviction
from kvserve.cache.hashing import page_hash
from kvserve.cache.history import CacheHistory
from kvserve.cache.invariants import check_manager_invariants
from kvserve.cache.leases import LeaseTable, LeaseUsage, Retention
from kvserve.cache.manager_tiers import TierMoves
from kvserve.cache.offload import Offloader
from kvserve.cache.pages import PagePool
from kvserve.cache.prefix_hash import HashPrefixIndex
from kvserve.cache.prefix_radix import RadixPrefixIndex
from kvserve.cache.recent_prompts import RecentPrompts
from kvserve.cache.sequence import Allocation, PrefixHit, SeqPages, cdiv
from kvserve.cache.stats import CacheStats
from kvserve.cache.window import WindowPool
from kvserve.config import CacheConfig, ConfigError, PrefixCachePolicy

if TYPE_CHECKING:
    from kvserve.cache.events import KVEventBuffer


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int,
                 policy: PrefixCachePolicy | str = PrefixCachePolicy.RADIX,
                 partial_page_hits: bool = True, offload: Offloader | None = None,
                 max_leased_fraction: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 events: KVEventBuffer | None = None, tenant_kv_share: str = "off",
                 window: WindowPool | None = None) -> None:
        if page_size < 1:
            raise ConfigError(f"page_size must be at least 1, got {page_size}")
        if num_pages < 2:
            raise ConfigError(f"the KV cache needs at least 2 pages (page 0 is reserved), got {num_pages}")
        try:
            self.policy = PrefixCachePolicy(policy)
        except ValueError:
            raise ConfigError(f"prefix cache policy must be radix, hash or off, got {policy!r}") from None
        self.num_pages = num_pages
        self.page_size = page_size
        self.partial_page_hits = partial_page_hits  # see CacheConfig.partial_page_hits
        self.pool = PagePool(num_pages)
        index_class = {PrefixCachePolicy.HASH: HashPrefixIndex, PrefixCachePolicy.RADIX: RadixPrefixIndex}
        self.index: HashPrefixIndex | RadixPrefixIndex | None = (
            index_class[self.policy](self.pool, page_size) if self.policy in index_class else None)
        self._seqs: dict[str, SeqPages] = {}
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.offload = offload or Offloader(page_size)
        self.leases = LeaseTable(self.pool, self.index, page_size, max_leased_fraction)
        self.clock = clock  # lease expiry; the simulator passes its virtual clock
        self.events = events  # KV events (vLLM's schema): pages stored in and removed from the pool
        self.history = CacheHistory(page_size)  # what the pool held, to explain misses
        self.recent_prompts = RecentPrompts()  # each tenant's admitted prompts, for explain
        fair = tenant_kv_share == "fair" and self.index is not None  # evict tenants over their share first
        self.fair = FairShareEviction(self.index, self.pool) if fair else None
        self._hash_of_cached: dict[int, bytes] = {}  # cached page -> its chained hash
        self._page_of_hash: dict[bytes, int] = {}  # and back (a content is cached in one page at most)
        self.pool.on_evicted = self._evicted
        self.tiers = TierMoves(self.offload, self.pool, self._seqs, self.free)
        self.planner = AdmissionPlanner(self.index, window, self.offload, self.leases, self._hash_of_cached,
                                        page_size, partial_page_hits)
        self.window = window  # sliding-window layers' pages (hybrid allocator), or None
        self.pool.on_freed = window.page_gone if window is not None else None

    @classmethod
    def from_config(cls, config: CacheConfig, offload: Offloader | None = None,
                    events: KVEventBuffer | None = None) -> KVCacheManager:
        return cls(config.num_pages, config.page_size, config.prefix_cache,
                   partial_page_hits=config.partial_page_hits, offload=offload,
                   max_leased_fraction=config.max_leased_fraction, events=events,
                   tenant_kv_share=config.tenant_kv_share,
                   window=WindowPool(config.num_window_slots, config.page_size, config.sliding_window)
                   if config.num_window_slots else None)

    # -- admission -----------------------------------------------------------------------------
    def lookup(self, token_ids: list[int], namespace: str = "", max_tokens: int | None = None) -> PrefixHit:
        """The pool's longest prefix of `token_ids` (admission.AdmissionPlanner.lookup): the one walk
        of the prefix index per admission. Read-only."""
        return self.planner.lookup(token_ids, namespace, max_tokens)

    def plan_admission(self, token_ids: list[int], namespace: str, max_tokens: int, budget: int,
                       hit: PrefixHit | None = None) -> PrefixHit:
        """What a request admitted now reuses: `hit` (or a lookup) cut to `max_tokens`, then the tier
        pages after it that fit this step's `budget` (admission.AdmissionPlanner.plan)."""
        return self.planner.plan(token_ids, namespace, max_tokens, budget, self.num_free_pages, hit)

    def allocate(self, seq_id: str, token_ids: list[int], namespace: str, hit: PrefixHit,
                 num_tokens: int) -> Allocation | None:
        """Admit a sequence whose first hit.num_cached_tokens tokens are cached and cover `num_tokens`
        positions. Returns what was done (the hit used: shorter than `hit` where its pages were evicted
        since the lookup, its tier loads dropped then; the (src, dst) page copies to apply first; cached
        tokens by source), or None with nothing changed when pages are short. Tier loads are committed
        and queued. `hit` is never changed."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has pages")
        if num_tokens <= hit.num_cached_tokens:
            raise ValueError(f"num_tokens ({num_tokens}) must exceed the hit ({hit.num_cached_tokens} tokens)")
        ps = self.page_size
        token_ids = list(token_ids)
        used = self.planner.still_cached(hit)
        pages, num_hit = list(used.pages), used.num_tokens
        num_full = num_hit // ps
        shared, partial = pages[:num_full], pages[num_full:]  # partial: [] or [page to copy]
        num_new = cdiv(num_tokens, ps) - num_full
        num_idle_hit = sum(1 for page in pages if self.pool.ref(page) == 0)  # not reclaimable now
        if num_new > self.pool.num_free - num_idle_hit:
            return None
        if self.window is not None and not self.window.can_allocate(self.window.num_needed(pages, num_hit, num_new)):
            return None
        for page in pages:  # refs first: the allocation below must not evict the hit
            self.pool.incref(page)
        new_pages = self.pool.allocate(num_new)
        assert new_pages is not None
        copies = [(partial[0], new_pages[0])] if partial else []
        if self.window is not None:
            self.window.admit(seq_id, pages, num_hit, new_pages)
        for page in partial:
            self.pool.decref(page)
        seq = SeqPages(namespace, shared + new_pages, num_committed_pages=num_full,
                       committed_token_ids=token_ids[:num_full * ps])
        if self.index is not None:
            self._extend_hashes(seq, token_ids, num_full)
            if num_full:
                self.index.on_hit(token_ids, namespace, num_full)
            self.leases.touch(namespace, pages, self.clock())  # a read refreshes the leases it covers
        self._seqs[seq_id] = seq
        self.recent_prompts.add(namespace, token_ids)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += used.num_cached_tokens
        if used.loads:
            self._load_from_tiers(seq_id, token_ids, used)
        return Allocation(used, copies, self.planner.sources(used))

    # -- running -------------------------------------------------------------------------------
    def append(self, seq_id: str, num_computed_tokens: int, num_tokens: int) -> list[tuple[int, int]] | None:
        """Cover `num_tokens` positions. Pages the step will write (positions num_computed_tokens..
        num_tokens-1) that are shared or cached are copied to fresh pages first (copy-on-write).
        Returns the copies, or None with nothing changed when pages are short."""
        seq = self._seq(seq_id)
        ps = self.page_size
        if num_computed_tokens < seq.num_committed_pages * ps:
            raise ValueError(f"sequence {seq_id!r}: positions below {seq.num_committed_pages * ps} "
                             f"are committed to the prefix cache and cannot be recomputed")
        table = seq.block_table
        end_page = cdiv(num_tokens, ps)
        num_grow = max(0, end_page - len(table))
        cow = []
        if num_tokens > num_computed_tokens:
            cow = [i for i in range(num_computed_tokens // ps, min(end_page, len(table)))
                   if self.pool.ref(table[i]) > 1 or self.pool.is_cached(table[i])]
        if self.window is not None and not self.window.can_allocate(num_grow + len(cow)):
            return None
        new_pages = self.pool.allocate(num_grow + len(cow))
        if new_pages is None:
            return None
        copies = []
        for i, dst in zip(cow, new_pages):
            copies.append((table[i], dst))
            self.pool.decref(table[i])
            table[i] = dst
        table.extend(new_pages[len(cow):])
        if self.window is not None:
            self.window.grow(seq_id, table, cow)
        return copies

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Roll back to `num_tokens` positions (rejected draft tokens): the pages past them go back, tail
        first; never committed, no index, tier, event or lease saw them."""
        seq = self._seq(seq_id)
        keep = cdiv(num_tokens, self.page_size)
        assert keep >= seq.num_committed_pages, f"{seq_id}: a rollback into committed pages"
        if self.window is not None:
            self.window.truncate(seq_id, keep)
        for page in reversed(seq.block_table[keep:]):
            self.pool.decref(page)
        del seq.block_table[keep:]

    def commit(self, seq_id: str, token_ids: list[int], num_computed_tokens: int,
               retention: Retention | None = None) -> LeaseUsage | None:
        """Index every page of the sequence now full of computed tokens (prompt and generated ones
        alike); pages committed before are skipped. Call after each step, with the request's tokens.
        With `retention`, once the prompt is computed its breakpoints are leased: returns what that did."""
        self._commit_pages(seq_id, token_ids, num_computed_tokens)
        if retention is None or num_computed_tokens < retention.num_prompt_tokens:
            return None
        seq = self._seq(seq_id)
        prompt_pages = []  # the cached pages holding the prompt (a duplicate page: its cached twin)
        for page, h in zip(seq.block_table[:retention.num_prompt_tokens // self.page_size], seq.page_hashes):
            page = page if self._hash_of_cached.get(page) == h else self._page_of_hash.get(h)
            if page is None:
                break
            prompt_pages.append(page)
        return self.leases.grant_retention(retention, seq.namespace, prompt_pages, self.clock())

    def _commit_pages(self, seq_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        seq = self._seq(seq_id)
        if self.window is not None:
            self.window.release_before(seq_id, num_computed_tokens)
        if self.index is None:
            return
        ps = self.page_size
        start = seq.num_committed_pages
        end = min(num_computed_tokens, len(token_ids)) // ps
        end = min(end, len(seq.block_table))
        if end <= start:
            return
        token_ids = list(token_ids)
        self._extend_hashes(seq, token_ids, end)
        end = self.index.insert(token_ids, seq.namespace, seq.block_table, seq.page_hashes, start, end)
        if self.window is not None:
            self.window.adopt(seq_id, seq.block_table)
        now = self.clock()
        for i in range(start, end):
            page, h = seq.block_table[i], seq.page_hashes[i]
            # (a duplicate of a page cached before stays uncached; radix may hand back the cached one)
            if self.pool.is_cached(page) and self._hash_of_cached.get(page) != h:
                self._hash_of_cached[page] = h
                self._page_of_hash[h] = page
                parent = seq.page_hashes[i - 1] if i else None
                self.history.stored(h, parent, seq.namespace, now)
                if self.fair is not None:
                    self.fair.cached(page, seq.namespace)
                if self.events is not None:
                    self.events.stored(h, parent, token_ids[i * ps:(i + 1) * ps], namespace=seq.namespace)
        seq.committed_token_ids.extend(token_ids[start * ps:end * ps])
        seq.num_committed_pages = end
        self.offload.committed(list(zip(seq.page_hashes[start:end], seq.block_table[start:end])))

    def _extend_hashes(self, seq: SeqPages, token_ids: list[int], num_pages: int) -> None:
        ps = self.page_size
        for i in range(len(seq.page_hashes), num_pages):
            parent = seq.page_hashes[-1] if seq.page_hashes else None
            seq.page_hashes.append(page_hash(parent, token_ids[i * ps:(i + 1) * ps], seq.namespace))

    def _evicted(self, page_id: int) -> None:
        page_hash_ = self._hash_of_cached.pop(page_id, None)
        if page_hash_ is not None:
            del self._page_of_hash[page_hash_]
            self.offload.evicted(page_hash_, page_id)
            self.history.evicted(page_hash_, self.clock())
            if self.events is not None:
                self.events.removed(page_hash_)
        if self.window is not None:
            self.window.page_gone(page_id)

    def free(self, seq_id: str) -> None:
        """Release the sequence's pages, tail first, so its last pages are the first evicted."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        if self.window is not None:
            self.window.free(seq_id)
        for page in reversed(seq.block_table):
            self.pool.decref(page)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares all of the parent's pages; the first write to a shared page copies it."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already has pages")
        for page in parent.block_table:
            self.pool.incref(page)
        if self.window is not None:
            self.window.fork(parent_id, child_id)
        self._seqs[child_id] = SeqPages(parent.namespace, list(parent.block_table), parent.num_committed_pages,
                                        list(parent.page_hashes), list(parent.committed_token_ids))

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def window_block_table(self, seq_id: str) -> list[int] | None:
        """The sequence's pages in the window pool (NULL_PAGE where released); None without one."""
        return None if self.window is None else self.window.block_table(seq_id)

    def take_window_copies(self) -> list[tuple[int, int]]:
        """Window-pool page copies (copy-on-write, partial hits) decided since the last call."""
        return [] if self.window is None else self.window.take_copies()

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def page_hashes(self, seq_id: str) -> list[bytes]:
        """Chained hashes of the sequence's committed pages (for tiers); empty with policy off."""
        return list(self._seq(seq_id).page_hashes)

    def _seq(self, seq_id: str) -> SeqPages:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        return seq

    # -- below the pool (swap and page moves: self.tiers, manager_tiers.TierMoves) -----------------
    def _load_from_tiers(self, seq_id: str, token_ids: list[int], hit: PrefixHit) -> None:
        """The sequence's pages after its pool hit get their K/V from the tiers: counted as hits (by
        allocate), committed, and queued as loads (the runner writes them before this step computes)."""
        seq = self._seqs[seq_id]
        start, num_pages = seq.num_committed_pages, len(hit.loads)
        # (radix may swap a page for an identical cached one here: then its load is just unused)
        self.commit(seq_id, token_ids, (start + num_pages) * self.page_size)
        self.offload.load(seq.block_table[start:start + num_pages], list(hit.loads))

    # -- accounting ----------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Free plus cached idle pages: all can be handed out."""
        return self.pool.num_free

    @property
    def num_spare_pages(self) -> int:
        """Pages that can be handed out without evicting cached content, in both pools."""
        return min(self.pool.num_free_uncached, self.window.pool.num_free_uncached if self.window else 1 << 62)

    @property
    def num_used_pages(self) -> int:
        refs = self.leases.page_refs()
        return self.pool.num_used - sum(1 for page, n in refs.items() if self.pool.ref(page) == n)

    def usage(self) -> float:
        return self.num_used_pages / self.pool.num_usable

    # -- leases ----------------------------------------------------------------------------------
    def expire_leases(self) -> int:
        now = self.clock()
        for lease in self.leases.expiring(now):  # remembered, to explain a later miss
            for page in lease.pages:
                if page in self._hash_of_cached:
                    self.history.lease_expired(self._hash_of_cached[page], now)
        return self.leases.expire(now)

    def explain(self, token_ids: list[int], namespace: str, allocation: Allocation,
                below_min_cacheable: int | None = None) -> CacheExplanation:
        """Why the request admitted with `allocation` computed what it did (cache/explain.py)."""
        return explain_admission(token_ids, namespace, allocation, self.page_size, self.history, self.clock(),
                                 self.recent_prompts.before_last(namespace), self.window is not None, below_min_cacheable)

    def make_room(self) -> bool:
        """Break the lease closest to expiry; False when there is none (nothing else can free pages)."""
        return self.leases.break_oldest()

    def stats(self) -> CacheStats:
        pool = self.pool
        return CacheStats(pool.num_usable, pool.num_free, pool.num_used, pool.num_cached, pool.num_cached_idle,
                          self.usage(), self.prefix_cache_queries, self.prefix_cache_hits, pool.num_evictions,
                          self.leases.counts(), self.offload.stats(),
                          self.fair.num_fair_evictions if self.fair else 0,
                          dict(self.fair.pages_per_tenant) if self.fair else {},
                          self.window.stats() if self.window is not None else None)

    def page_states(self) -> str:
        """One character per page (pages.PAGE_*); leased pages that no sequence holds are PAGE_LEASED."""
        refs = self.leases.page_refs()
        return self.pool.states({page for page, n in refs.items() if self.pool.ref(page) == n})

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page; refused (False) while sequences hold pages, as in vLLM."""
        if self.pool.num_used:
            return False
        if self.index is not None:
            self.index.clear()
        self._hash_of_cached.clear()
        self._page_of_hash.clear()
        if self.fair is not None:
            self.fair.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def check_invariants(self, token_ids: dict[str, list[int]] | None = None) -> None:
        check_manager_invariants(self.pool, self._seqs, self.leases, self.index, self._hash_of_cached,
                                 self._page_of_hash, self.page_size, token_ids, self.window)
