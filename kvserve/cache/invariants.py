"""The cache manager's invariants, checked after every test step: every page is exactly one of free /
cached idle / used; refs equal block-table occurrences plus lease references; every indexed page a
sequence committed holds the tokens the sequence committed there."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvserve.cache.pages import NULL_PAGE
from kvserve.cache.prefix_radix import RadixPrefixIndex

if TYPE_CHECKING:
    from kvserve.cache.manager import KVCacheManager


def check_manager_invariants(m: KVCacheManager) -> None:
    m.pool.check_invariants()
    occurrences = Counter(page for seq in m._seqs.values() for page in seq.block_table)
    assert NULL_PAGE not in occurrences, "the null page is in a block table"
    occurrences.update(m.leases.page_refs())
    for page in range(1, m.num_pages):
        assert m.pool.ref(page) == occurrences[page], (
            f"page {page}: ref {m.pool.ref(page)} but {occurrences[page]} block-table and lease references")
    if m.index is None:
        assert m.pool.num_cached == 0
        return
    m.index.check_invariants()
    cached = {page for page in range(1, m.num_pages) if m.pool.is_cached(page)}
    assert set(m._hash_of_cached) == cached, "an evicted page would be offloaded without its hash"
    ps = m.page_size
    for seq_id, seq in m._seqs.items():
        assert len(seq.committed_token_ids) == seq.num_committed_pages * ps
        assert len(seq.page_hashes) >= seq.num_committed_pages
        for i in range(seq.num_committed_pages):
            tokens = m.index.page_tokens(seq.block_table[i])
            expected = tuple(seq.committed_token_ids[i * ps:(i + 1) * ps])
            if isinstance(m.index, RadixPrefixIndex):
                assert tokens is not None, f"{seq_id}: committed page {i} is not in the tree"
            assert tokens is None or tokens == expected, f"{seq_id}: page {i} holds other tokens"
