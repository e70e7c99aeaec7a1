"""The cache manager's invariants, checked after every test step: every page is exactly one of free /
cached idle / used; refs equal block-table occurrences plus lease references; every indexed page a
sequence committed holds the tokens the sequence committed there; given each sequence's real tokens
(after speculative decoding), what it committed is a prefix of them (no rejected draft token indexed)
and its block table holds no page past its tokens (rolled-back pages returned)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvserve.cache.leases import LeaseTable
from kvserve.cache.pages import NULL_PAGE, PagePool
from kvserve.cache.prefix_radix import RadixPrefixIndex
from kvserve.cache.sequence import SeqPages


def check_manager_invariants(pool: PagePool, seqs: dict[str, SeqPages], leases: LeaseTable, index: Any,
                             hash_of_cached: dict[int, bytes], page_of_hash: dict[bytes, int],
                             page_size: int, token_ids: dict[str, list[int]] | None = None,
                             window: Any = None) -> None:
    """The KVCacheManager's parts, handed over by its check_invariants()."""
    pool.check_invariants()
    if window is not None:
        window.check_invariants()
    for seq_id, tokens in (token_ids or {}).items():
        seq = seqs.get(seq_id)
        if seq is None:
            continue
        assert seq.committed_token_ids == tokens[:len(seq.committed_token_ids)], (
            f"{seq_id}: committed tokens that are not the sequence's (a rejected draft indexed?)")
        assert len(seq.block_table) <= -(-len(tokens) // page_size), (
            f"{seq_id}: {len(seq.block_table)} pages for {len(tokens)} tokens (a rolled-back page kept)")
        if window is not None:
            assert len(window.block_table(seq_id)) == len(seq.block_table), f"{seq_id}: window table length"
    occurrences = Counter(page for seq in seqs.values() for page in seq.block_table)
    assert NULL_PAGE not in occurrences, "the null page is in a block table"
    occurrences.update(leases.page_refs())
    for page in range(1, pool.num_pages):
        assert pool.ref(page) == occurrences[page], (
            f"page {page}: ref {pool.ref(page)} but {occurrences[page]} block-table and lease references")
    if index is None:
        assert pool.num_cached == 0
        return
    index.check_invariants()
    cached = {page for page in range(1, pool.num_pages) if pool.is_cached(page)}
    assert set(hash_of_cached) == cached, "an evicted page would be offloaded without its hash"
    assert {h: p for p, h in hash_of_cached.items()} == page_of_hash, "a cached content in two pages"
    ps = page_size
    for seq_id, seq in seqs.items():
        assert len(seq.committed_token_ids) == seq.num_committed_pages * ps
        assert len(seq.page_hashes) >= seq.num_committed_pages
        for i in range(seq.num_committed_pages):
            tokens = index.page_tokens(seq.block_table[i])
            expected = tuple(seq.committed_token_ids[i * ps:(i + 1) * ps])
            if isinstance(index, RadixPrefixIndex):
                assert tokens is not None, f"{seq_id}: committed page {i} is not in the tree"
            assert tokens is None or tokens == expected, f"{seq_id}: page {i} holds other tokens"
