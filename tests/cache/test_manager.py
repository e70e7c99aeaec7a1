"""KVCacheManager: the scheduler's cache API, with every policy. Small factories, one behaviour each."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.cache.manager import KVCacheManager, PrefixHit
from kvserve.config import ConfigError, PrefixCachePolicy

POLICIES = ["radix", "hash", "off"]
CACHING = ["radix", "hash"]


def run_seq(m: KVCacheManager, seq_id: str, tokens: list[int], namespace: str = "") -> PrefixHit:
    """Admit `tokens` and compute them all in one step, then commit (what the scheduler does)."""
    hit = m.lookup(tokens, namespace)
    assert m.allocate(seq_id, tokens, namespace, hit, len(tokens)) is not None
    m.commit(seq_id, tokens, len(tokens))
    m.check_invariants()
    return hit


def test_kvserve_cache_imports_neither_torch_nor_numpy():
    code = ("import sys, kvserve.cache, kvserve.cache.manager; "
            "assert not {'torch', 'numpy'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="radix, hash or off"):
        KVCacheManager(8, 4, "lru")
    assert KVCacheManager(8, 4, PrefixCachePolicy.HASH).policy is PrefixCachePolicy.HASH


@pytest.mark.parametrize("policy", CACHING)
def test_lookup_never_returns_the_last_token(policy):
    m = KVCacheManager(16, 4, policy)
    tokens = list(range(8))
    run_seq(m, "a", tokens)
    m.free("a")
    hit = m.lookup(tokens)
    assert hit.num_tokens == 7 and len(hit.pages) == 2  # the last page is a partial hit
    assert m.lookup(tokens[:1]).num_tokens == 0
    assert m.lookup([]).num_tokens == 0


@pytest.mark.parametrize("policy", CACHING)
def test_a_capped_full_page_is_copied_not_shared(policy):
    m = KVCacheManager(16, 4, policy)
    tokens = list(range(8))
    run_seq(m, "a", tokens)
    m.free("a")
    hit = m.lookup(tokens)
    copies = m.allocate("b", tokens, "", hit, 8).copies
    assert copies == [(hit.pages[1], m.block_table("b")[1])]
    assert m.block_table("b")[0] == hit.pages[0]
    m.check_invariants()


def test_radix_hit_ending_inside_a_page_gives_a_copy():
    m = KVCacheManager(16, 4, "radix")
    run_seq(m, "a", list(range(12)))
    cached = m.block_table("a")
    m.free("a")
    query = list(range(6)) + [50, 51, 52]
    hit = m.lookup(query)
    assert hit == PrefixHit(tuple(cached[:2]), 6)
    copies = m.allocate("b", query, "", hit, len(query)).copies
    table = m.block_table("b")
    assert table[0] == cached[0] and table[1] not in cached and len(table) == 3
    assert copies == [(cached[1], table[1])]
    m.commit("b", query, len(query))
    m.check_invariants()
    assert m.lookup(query + [1]).num_tokens == 8  # b's own diverging page is cached now


def test_hash_hit_is_whole_pages_only():
    m = KVCacheManager(16, 4, "hash")
    run_seq(m, "a", list(range(12)))
    m.free("a")
    assert m.lookup(list(range(6)) + [50, 51, 52]).num_tokens == 4


def test_policy_off_caches_nothing():
    m = KVCacheManager(16, 4, "off")
    run_seq(m, "a", list(range(12)))
    m.free("a")
    assert m.lookup(list(range(12))) == PrefixHit()
    assert m.stats().num_pages_cached == 0 and m.num_free_pages == 15


@pytest.mark.parametrize("policy", POLICIES)
def test_allocate_without_room_changes_nothing(policy):
    m = KVCacheManager(6, 4, policy)  # 5 usable pages
    run_seq(m, "a", list(range(12)))
    before = (m.stats(), m.pool.free_order())
    assert m.allocate("b", [7] * 20, "", m.lookup([7] * 20), 20) is None
    assert (m.stats(), m.pool.free_order()) == before and not m.has_seq("b")
    m.check_invariants()


@pytest.mark.parametrize("policy", CACHING)
def test_allocate_never_evicts_the_hit_it_is_taking(policy):
    m = KVCacheManager(5, 4, policy)  # 4 usable pages
    run_seq(m, "a", list(range(12)))
    m.free("a")
    query = list(range(8)) + [60, 61, 62, 63]
    hit = m.lookup(query)
    assert hit.num_tokens == 8
    assert m.allocate("b", query, "", hit, 16) is not None  # 2 hit pages + 2 fresh: a's 3rd is evicted
    assert tuple(m.block_table("b")[:2]) == hit.pages
    assert m.allocate("c", [1, 2], "", PrefixHit(), 2) is None  # 4 pages held, nothing left
    m.check_invariants()


@pytest.mark.parametrize("policy", CACHING)
def test_hits_and_queries_are_counted_in_tokens(policy):
    m = KVCacheManager(32, 4, policy)
    run_seq(m, "a", list(range(20)))
    run_seq(m, "b", list(range(16)) + [99, 98])
    stats = m.stats()
    assert stats.prefix_cache_queries == 38 and stats.prefix_cache_hits == 16


@pytest.mark.parametrize("policy", CACHING)
def test_a_stale_hit_is_shrunk_to_what_is_still_cached(policy):
    m = KVCacheManager(7, 4, policy)  # 6 usable pages
    run_seq(m, "a", list(range(12)))
    cached = m.block_table("a")
    m.free("a")
    query = list(range(12)) + [5]
    hit = m.lookup(query)
    assert hit == PrefixHit(tuple(cached), 12)
    run_seq(m, "x", [9] * 13)  # needs 4 pages: evicts a's last page
    m.free("x")
    got = m.allocate("b", query, "", hit, 13)
    assert got.hit == PrefixHit(tuple(cached[:2]), 8)  # what allocate used, said in what it returns
    assert hit == PrefixHit(tuple(cached), 12)  # the caller's value is untouched
    assert m.block_table("b")[:2] == cached[:2]
    m.check_invariants()


@pytest.mark.parametrize("policy", CACHING)
def test_free_releases_the_tail_first_so_it_is_evicted_first(policy):
    m = KVCacheManager(5, 4, policy)  # 4 usable pages
    run_seq(m, "a", list(range(16)))
    table = m.block_table("a")
    m.free("a")
    assert m.pool.free_order() == table[::-1]
    run_seq(m, "b", [7, 7])  # takes one page: a's last
    assert m.block_table("b") == [table[3]]
    assert m.lookup(list(range(16))).num_tokens == 12


@pytest.mark.parametrize("policy", CACHING)
def test_multi_turn_hits_the_whole_previous_turn(policy):
    m = KVCacheManager(64, 4, policy)
    prompt = list(range(10))
    hit = m.lookup(prompt)
    m.allocate("turn1", prompt, "", hit, len(prompt))
    tokens, computed = list(prompt), len(prompt)
    m.commit("turn1", tokens, computed)
    for generated in (100, 101, 102, 103, 104, 105):  # decode, one token a step
        tokens.append(generated)
        assert m.append("turn1", computed, computed + 1) == []
        computed += 1
        m.commit("turn1", tokens, computed)
    tokens.append(106)  # sampled last, never computed
    m.free("turn1")
    history = tokens + [200, 201, 202]  # next turn resends the conversation
    hit = m.lookup(history)
    assert hit.num_tokens == 16  # every full page of the previous turn, generated tokens included
    assert len(hit.pages) == 4


@pytest.mark.parametrize("policy", CACHING)
def test_namespaces_never_share_pages(policy):
    m = KVCacheManager(32, 4, policy)
    tokens = list(range(13))
    run_seq(m, "a", tokens, "tenant-a")
    hit = run_seq(m, "b", tokens, "tenant-b")
    assert hit.num_tokens == 0
    assert not set(m.block_table("a")) & set(m.block_table("b"))
    assert m.lookup(tokens, "tenant-a").num_tokens == 12
    assert m.lookup(tokens, "").num_tokens == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_fork_shares_pages_and_the_first_write_copies_the_partial_page(policy):
    m = KVCacheManager(16, 4, policy)
    tokens = list(range(6))
    run_seq(m, "parent", tokens)
    m.fork("parent", "child")
    assert m.block_table("child") == m.block_table("parent")
    shared_last = m.block_table("parent")[1]
    copies = m.append("child", 6, 7)  # child writes position 6 into the shared page 1
    assert copies == [(shared_last, m.block_table("child")[1])]
    assert m.append("parent", 6, 7) == []  # the parent now holds page 1 alone: writes in place
    assert m.block_table("parent")[1] == shared_last
    assert m.block_table("parent")[0] == m.block_table("child")[0]
    m.check_invariants()
    m.free("parent")
    m.free("child")
    assert m.num_used_pages == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_append_grows_the_table_and_is_all_or_nothing(policy):
    m = KVCacheManager(4, 4, policy)  # 3 usable pages
    run_seq(m, "a", [1, 2, 3])
    assert m.append("a", 3, 8) == [] and len(m.block_table("a")) == 2
    run_seq(m, "b", [5])
    before = m.stats()
    assert m.append("a", 8, 9) is None
    assert m.stats() == before and len(m.block_table("a")) == 2
    m.check_invariants()


def test_recomputing_committed_positions_is_refused():
    m = KVCacheManager(16, 4, "radix")
    run_seq(m, "a", list(range(9)))
    with pytest.raises(ValueError, match="committed"):
        m.append("a", 4, 9)


def test_radix_swaps_a_duplicate_page_for_the_cached_one():
    m = KVCacheManager(32, 4, "radix")
    tokens = list(range(9))
    for seq_id in ("a", "b"):  # both admitted before either committed
        m.allocate(seq_id, tokens, "", m.lookup(tokens), len(tokens))
    m.commit("a", tokens, 9)
    used = m.num_used_pages
    m.commit("b", tokens, 9)
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.num_used_pages == used - 2  # b's duplicates went back to the pool
    m.check_invariants()


def test_hash_keeps_a_duplicate_page_private():
    m = KVCacheManager(32, 4, "hash")
    tokens = list(range(9))
    for seq_id in ("a", "b"):  # both admitted before either committed
        m.allocate(seq_id, tokens, "", m.lookup(tokens), len(tokens))
    m.commit("a", tokens, 9)
    m.commit("b", tokens, 9)
    assert m.stats().num_pages_cached == 2
    assert list(m.lookup(tokens).pages) == m.block_table("a")[:2]
    assert not any(m.pool.is_cached(page) for page in m.block_table("b"))
    m.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_prefix_cache_only_when_nothing_is_in_use(policy):
    m = KVCacheManager(16, 4, policy)
    run_seq(m, "a", list(range(9)))
    assert m.reset_prefix_cache() is False
    m.free("a")
    assert m.reset_prefix_cache() is True
    assert m.lookup(list(range(9))).num_tokens == 0
    assert m.stats().num_pages_cached == 0 and m.num_free_pages == 15
    m.check_invariants()


def test_stats_and_usage():
    m = KVCacheManager(11, 4, "radix")
    run_seq(m, "a", list(range(9)))
    stats = m.stats()
    assert stats.num_pages_total == 10 and stats.num_pages_used == 3
    assert stats.num_pages_free == 7 and stats.num_pages_cached == 2
    assert stats.kv_cache_usage_perc == pytest.approx(0.3) == m.usage()
    m.free("a")
    assert m.num_free_pages == 10 and m.num_used_pages == 0 and m.stats().num_pages_cached == 2


def test_unknown_sequences_and_reused_ids_are_errors():
    m = KVCacheManager(16, 4, "radix")
    run_seq(m, "a", [1, 2])
    with pytest.raises(ValueError):
        m.allocate("a", [1, 2], "", PrefixHit(), 2)
    with pytest.raises(ValueError):
        m.free("nope")
    with pytest.raises(ValueError):
        m.fork("a", "a")
    assert m.has_seq("a") and not m.has_seq("nope")


@pytest.mark.parametrize("policy", POLICIES)
def test_swap_in_pages_are_private_until_the_next_commit(policy):
    m = KVCacheManager(16, 4, policy)
    tokens = list(range(10))
    run_seq(m, "a", tokens)
    cached = m.block_table("a")
    m.free("a")  # swapped out: its content went to the host tier
    pages = m.tiers.allocate_pages("a", "", 3)
    assert len(pages) == 3 and m.block_table("a") == pages
    assert not any(m.pool.is_cached(page) for page in pages)
    m.commit("a", tokens, 10)
    if policy == "radix":  # the loaded copies of cached pages give way to the cached ones
        assert m.block_table("a")[:2] == cached[:2] and m.num_used_pages == 3
    m.check_invariants()
    assert m.tiers.allocate_pages("b", "", 20) is None


def test_radix_keeps_a_duplicate_shared_with_a_fork_private_until_the_fork_lets_go():
    m = KVCacheManager(32, 4, "radix")
    tokens = list(range(9))
    run_seq(m, "a", tokens)
    cached = m.block_table("a")
    m.free("a")
    pages = m.tiers.allocate_pages("b", "", 3)  # swapped in: its own copies of cached content
    m.fork("b", "c")
    m.commit("b", tokens, 9)
    assert m.block_table("b") == pages  # c shares b's copies: swapping them for b alone would
    m.check_invariants()                # leave c holding tree pages without their prefix
    m.free("c")
    m.commit("b", tokens, 9)  # retried at the next commit
    assert m.block_table("b")[:2] == cached[:2]
    m.check_invariants()


@pytest.mark.parametrize("policy", CACHING)
def test_without_partial_page_hits_a_hit_ends_on_a_page_boundary(policy):
    m = KVCacheManager(16, 4, policy, partial_page_hits=False)  # per-page-scale KV dtypes
    tokens = list(range(12))
    run_seq(m, "a", tokens)
    m.free("a")
    hit = m.lookup(tokens)
    assert hit.num_tokens == 8 and len(hit.pages) == 2
    assert m.allocate("b", tokens, "", hit, 12).copies == []
    m.check_invariants()
