"""A hypothesis state machine drives KVCacheManager (radix, hash, off) the way the scheduler does:
admit (lookup + allocate), step (append + compute + commit), fork, free, preempt, lookup, stale hits,
speculate (append draft positions, write them, truncate the rejected ones, commit), on small pools so
eviction is constant.

A shadow model records what was written into every page: the copies the manager asks for, then the
tokens each step computes, into the pages of the block table. Every prefix hit must return pages
whose shadow content is exactly the tokens looked up, in the same namespace; every running sequence
must still read its own tokens back; no write may touch a shared or cached page.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from kvserve.cache.manager import KVCacheManager, PrefixHit

VOCAB = 3  # tiny: sequences collide on content all the time
NAMESPACES = st.sampled_from(["", "tenant-b"])
SUFFIX = st.lists(st.integers(0, VOCAB - 1), max_size=9)


@dataclass
class SeqModel:
    namespace: str
    token_ids: list[int]
    num_computed: int


class CacheMachine(RuleBasedStateMachine):
    policy = "radix"

    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(3, 20),
                prefixes=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=12),
                                  min_size=1, max_size=3),
                partial_page_hits=st.booleans())
    def setup(self, page_size: int, num_pages: int, prefixes: list[list[int]],
              partial_page_hits: bool) -> None:
        self.m = KVCacheManager(num_pages, page_size, self.policy, partial_page_hits)
        self.ps = page_size
        self.prefixes = prefixes
        self.content: dict[int, list[int | None]] = {}  # page -> token written at each slot
        self.content_ns: dict[int, str] = {}  # page -> namespace of whoever wrote it
        self.seqs: dict[str, SeqModel] = {}
        self.histories: list[tuple[str, list[int]]] = []  # finished conversations, for next turns
        self.next_id = 0

    # -- the shadow model ----------------------------------------------------------------------
    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            assert self.m.pool.ref(dst) >= 1
            self.content[dst] = list(self.content[src])
            self.content_ns[dst] = self.content_ns[src]

    def _write(self, seq_id: str, start: int, tokens: list[int]) -> None:
        """The runner writes `tokens` at positions start.. of the sequence into its pages."""
        seq = self.seqs[seq_id]
        table = self.m.block_table(seq_id)
        assert len(table) * self.ps >= start + len(tokens)
        for pos, token in enumerate(tokens, start):
            page = table[pos // self.ps]
            assert self.m.pool.ref(page) == 1, f"write into shared page {page}"
            assert not self.m.pool.is_cached(page), f"write into cached page {page}"
            slots = self.content.setdefault(page, [None] * self.ps)
            self.content_ns[page] = seq.namespace
            slots[pos % self.ps] = token

    def _compute(self, seq_id: str, start: int, end: int) -> None:
        """The runner writes positions start..end-1 of the sequence into its pages."""
        seq = self.seqs[seq_id]
        table = self.m.block_table(seq_id)
        self._write(seq_id, start, seq.token_ids[start:end])
        seq.num_computed = end
        self.m.commit(seq_id, seq.token_ids, end)
        if self.m.block_table(seq_id) != table:
            event("commit swapped in cached pages")
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append((sum(seq.token_ids) * 7 + len(seq.token_ids)) % VOCAB)  # "sample"

    def _check_hit(self, hit: PrefixHit, query: list[int], namespace: str) -> None:
        assert 0 <= hit.num_tokens <= max(0, len(query) - 1), "the last token must be computed"
        assert len(hit.pages) == -(-hit.num_tokens // self.ps)
        assert self.m.partial_page_hits or hit.num_tokens % self.ps == 0
        for pos in range(hit.num_tokens):
            page = hit.pages[pos // self.ps]
            assert self.content[page][pos % self.ps] == query[pos], f"hit page {page} holds other tokens"
            assert self.content_ns[page] == namespace, f"hit page {page} is from another namespace"

    def _snapshot(self):
        return (self.m.stats(), {s: self.m.block_table(s) for s in self.seqs}, self.m.pool.free_order())

    def _query(self, source: int, suffix: list[int], namespace: str, use_history: bool) -> list[int]:
        if use_history:
            turns = [tokens for ns, tokens in self.histories if ns == namespace]
            if turns:
                return turns[source % len(turns)] + suffix + [0]
        return self.prefixes[source % len(self.prefixes)] + suffix + [1]

    def _pick(self, index: int) -> str:
        return sorted(self.seqs)[index % len(self.seqs)]

    def _admit(self, tokens: list[int], namespace: str, chunk: int, hit: PrefixHit | None = None) -> None:
        if hit is None:
            hit = self.m.lookup(tokens, namespace)
            self._check_hit(hit, tokens, namespace)
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        end = min(len(tokens), hit.num_tokens + chunk)
        before, asked = self._snapshot(), hit
        got = self.m.allocate(seq_id, tokens, namespace, hit, end)
        if got is None:
            assert self._snapshot() == before, "a failed allocate changed something"
            event("allocate refused")
            return
        assert hit == asked, "allocate changed the caller's hit"
        copies, hit = got.copies, got.hit
        if hit.num_tokens < asked.num_tokens:
            event("stale hit shrunk")
        if hit.num_tokens:
            event("partial-page hit" if hit.num_tokens % self.ps else "page-aligned hit")
        if self.m.stats().num_evictions > before[0].num_evictions:
            event("eviction")
        self._check_hit(hit, tokens, namespace)  # possibly shrunk: still exact
        self.seqs[seq_id] = SeqModel(namespace, list(tokens), hit.num_tokens)
        self._apply_copies(copies)
        self._compute(seq_id, hit.num_tokens, end)

    # -- rules ---------------------------------------------------------------------------------
    @rule(source=st.integers(0, 5), suffix=SUFFIX, namespace=NAMESPACES, chunk=st.integers(1, 12),
          use_history=st.booleans())
    def admit(self, source, suffix, namespace, chunk, use_history):
        self._admit(self._query(source, suffix, namespace, use_history), namespace, chunk)

    @rule(source=st.integers(0, 5), suffix=SUFFIX, other=st.integers(1, 24), namespace=NAMESPACES,
          chunk=st.integers(1, 12))
    def admit_with_stale_hit(self, source, suffix, other, namespace, chunk):
        """Look up first, admit someone else (who may evict the hit's pages), then allocate."""
        tokens = self._query(source, suffix, namespace, True)
        hit = self.m.lookup(tokens, namespace)
        self._check_hit(hit, tokens, namespace)
        self._admit([2] * other, namespace, other)
        self._admit(tokens, namespace, chunk, hit)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 50), chunk=st.integers(1, 4), child_first=st.booleans())
    def fork_then_step_both(self, index, chunk, child_first):
        """Parallel sampling: both copies write next, so a shared partly filled page is copied."""
        parent_id = self._pick(index)
        self.fork(index)
        child_id = f"s{self.next_id - 1}"
        for seq_id in ([child_id, parent_id] if child_first else [parent_id, child_id]):
            if seq_id in self.seqs:
                self.step(sorted(self.seqs).index(seq_id), chunk)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 50), chunk=st.integers(1, 8))
    def step(self, index, chunk):
        seq_id = self._pick(index)
        seq = self.seqs[seq_id]
        end = min(len(seq.token_ids), seq.num_computed + chunk)
        before = self._snapshot()
        copies = self.m.append(seq_id, seq.num_computed, end)
        if copies is None:  # no room: preempt it, as the scheduler would
            assert self._snapshot() == before, "a failed append changed something"
            event("append refused: preempt")
            self.m.free(seq_id)
            del self.seqs[seq_id]
            return
        if copies:
            event("copy-on-write")
        self._apply_copies(copies)
        self._compute(seq_id, seq.num_computed, end)

    @precondition(lambda self: any(s.num_computed == len(s.token_ids) - 1 for s in self.seqs.values()))
    @rule(index=st.integers(0, 50), drafts=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
          num_accepted=st.integers(0, 6), correction=st.integers(0, VOCAB - 1))
    def speculate(self, index, drafts, num_accepted, correction):
        """A decoding sequence verifies draft tokens in one step: positions for the decode token and
        every draft are appended and written; the sequence keeps num_accepted drafts and one more
        token (the correction, never the rejected draft), and rolls the rest back before committing."""
        decoding = sorted(s for s, m in self.seqs.items() if m.num_computed == len(m.token_ids) - 1)
        seq_id = decoding[index % len(decoding)]
        seq = self.seqs[seq_id]
        start = seq.num_computed
        before = self._snapshot()
        copies = self.m.append(seq_id, start, start + 1 + len(drafts))
        if copies is None:
            assert self._snapshot() == before, "a failed append changed something"
            event("speculation refused: no room")
            return
        self._apply_copies(copies)
        self._write(seq_id, start, [seq.token_ids[start], *drafts])
        num_accepted = min(num_accepted, len(drafts))
        if num_accepted < len(drafts) and correction == drafts[num_accepted]:
            correction = (correction + 1) % VOCAB  # the target's token differs from a rejected draft
        seq.token_ids += [*drafts[:num_accepted], correction]
        seq.num_computed = len(seq.token_ids) - 1
        self.m.truncate(seq_id, seq.num_computed)
        assert len(self.m.block_table(seq_id)) == -(-seq.num_computed // self.ps), "a rolled-back page kept"
        self.m.commit(seq_id, seq.token_ids, seq.num_computed)
        event("all drafts accepted" if num_accepted == len(drafts) else "drafts rolled back")

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 50))
    def fork(self, index):
        parent_id = self._pick(index)
        parent = self.seqs[parent_id]
        child_id = f"s{self.next_id}"
        self.next_id += 1
        self.m.fork(parent_id, child_id)
        self.seqs[child_id] = SeqModel(parent.namespace, list(parent.token_ids), parent.num_computed)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 50))
    def free(self, index):
        self._free(self._pick(index))

    def _free(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id)
        self.m.free(seq_id)
        self.histories.append((seq.namespace, seq.token_ids))

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 50))
    def swap_out_and_in(self, index):
        """Preempt by swap: the pages' content goes to a host tier, comes back in fresh pages."""
        seq_id = self._pick(index)
        seq = self.seqs[seq_id]
        saved = [list(self.content.get(page, [None] * self.ps)) for page in self.m.block_table(seq_id)]
        self.m.free(seq_id)
        pages = self.m.tiers.allocate_pages(seq_id, seq.namespace, len(saved))
        if pages is None:
            del self.seqs[seq_id]
            self.histories.append((seq.namespace, seq.token_ids))
            return
        for page, slots in zip(pages, saved):
            self.content[page] = slots
            self.content_ns[page] = seq.namespace

    @rule(source=st.integers(0, 5), suffix=SUFFIX, namespace=NAMESPACES, use_history=st.booleans())
    def lookup(self, source, suffix, namespace, use_history):
        query = self._query(source, suffix, namespace, use_history)
        self._check_hit(self.m.lookup(query, namespace), query, namespace)

    @rule()
    def free_all(self):
        for seq_id in list(self.seqs):
            self._free(seq_id)
        assert self.m.num_used_pages == 0
        assert self.m.num_free_pages == self.m.num_pages - 1

    @rule()
    def reset_prefix_cache(self):
        assert self.m.reset_prefix_cache() is (not self.seqs)
        if not self.seqs:
            assert self.m.stats().num_pages_cached == 0

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def manager_invariants(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants({seq_id: seq.token_ids for seq_id, seq in self.seqs.items()})
        if self.policy == "off":
            assert self.m.stats().num_pages_cached == 0

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        if not hasattr(self, "m"):
            return
        holders: dict[int, str] = {}
        for seq_id, seq in self.seqs.items():
            table = self.m.block_table(seq_id)
            for page in table:
                assert holders.setdefault(page, seq.namespace) == seq.namespace, (
                    f"page {page} is shared across namespaces")
            for pos in range(seq.num_computed):
                page = table[pos // self.ps]
                assert self.content[page][pos % self.ps] == seq.token_ids[pos], f"{seq_id} lost {pos}"
                assert self.content_ns[page] == seq.namespace

    def teardown(self):
        if hasattr(self, "m"):
            for seq_id in list(self.seqs):
                self.m.free(seq_id)
            self.m.check_invariants()
            assert self.m.num_used_pages == 0


SETTINGS = settings(max_examples=200, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class RadixMachine(CacheMachine):
    policy = "radix"


class HashMachine(CacheMachine):
    policy = "hash"


class OffMachine(CacheMachine):
    policy = "off"


TestRadixManager = RadixMachine.TestCase
TestRadixManager.settings = SETTINGS
TestHashManager = HashMachine.TestCase
TestHashManager.settings = SETTINGS
TestOffManager = OffMachine.TestCase
TestOffManager.settings = settings(SETTINGS, max_examples=60)
