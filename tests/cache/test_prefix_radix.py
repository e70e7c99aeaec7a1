"""RadixPrefixIndex over a PagePool: token-granular matches, splits, namespaces, leaf-LRU eviction."""

from __future__ import annotations

from kvserve.cache.pages import PagePool
from kvserve.cache.prefix_radix import RadixPrefixIndex

PS = 4


def make_index(num_pages: int = 32) -> tuple[RadixPrefixIndex, PagePool]:
    pool = PagePool(num_pages)
    return RadixPrefixIndex(pool, PS), pool


def computed(index: RadixPrefixIndex, pool: PagePool, tokens: list[int], namespace: str = "") -> list[int]:
    """Block table of a sequence that computed `tokens` and committed its full pages (still held)."""
    table = pool.allocate(-(-len(tokens) // PS))
    index.insert(tokens, namespace, table, [], 0, len(tokens) // PS)
    return table


def release(pool: PagePool, table: list[int]) -> None:
    for page in reversed(table):
        pool.decref(page)


def test_whole_pages_match_through_the_tree():
    index, pool = make_index()
    table = computed(index, pool, list(range(12)))
    assert index.match(list(range(12)), "") == (table, 12)
    assert index.match(list(range(8)), "") == (table[:2], 8)
    index.check_invariants()


def test_a_match_ending_inside_a_page_returns_it_as_partial():
    index, pool = make_index()
    table = computed(index, pool, list(range(12)))
    assert index.match(list(range(6)) + [99, 99], "") == (table[:2], 6)
    assert index.match(list(range(6)), "") == (table[:2], 6)  # the query itself ends mid-page
    assert index.match([0, 1, 7], "") == (table[:1], 2)


def test_partial_match_picks_the_child_with_the_longest_common_prefix():
    index, pool = make_index()
    computed(index, pool, [0, 1, 2, 3])
    b = computed(index, pool, [0, 1, 5, 6])
    assert index.match([0, 1, 5, 9], "") == (b[:1], 3)


def test_diverging_insert_splits_the_node_at_the_page_boundary():
    index, pool = make_index()
    a = computed(index, pool, list(range(12)))
    b_tokens = list(range(4)) + [40, 41, 42, 43]
    pool.incref(a[0])  # b hit a's first page
    b = [a[0]] + pool.allocate(1)
    index.insert(b_tokens, "", b, [], 1, 2)
    assert index.match(b_tokens, "") == (b, 8)
    assert index.match(list(range(12)), "") == (a, 12)
    root = index._roots[""]
    (top,) = root.children.values()
    assert top.page_ids == [a[0]] and len(top.children) == 2
    index.check_invariants()


def test_commit_of_content_already_cached_swaps_in_the_cached_page():
    index, pool = make_index()
    a = computed(index, pool, list(range(8)))
    b = pool.allocate(3)
    own = list(b)
    index.insert(list(range(12)), "", b, [], 0, 3)  # b computed the same first 8 tokens itself
    assert b[:2] == a and b[2] == own[2]
    assert pool.ref(own[0]) == 0 and not pool.is_cached(own[0])  # the duplicates went back
    assert index.match(list(range(12)), "") == (b, 12)
    index.check_invariants()
    pool.check_invariants()


def test_on_hit_splits_where_the_hit_ends():
    index, pool = make_index()
    a = computed(index, pool, list(range(16)))
    release(pool, a)
    for page in a[:2]:
        pool.incref(page)
    index.on_hit(list(range(8)), "", 2)
    (top,) = index._roots[""].children.values()
    assert top.page_ids == a[:2]
    (rest,) = top.children.values()
    assert rest.page_ids == a[2:] and rest.last_access < top.last_access
    index.check_invariants()


def test_namespaces_have_separate_roots():
    index, pool = make_index()
    computed(index, pool, list(range(8)), "tenant-a")
    assert index.match(list(range(8)), "tenant-b") == ([], 0)
    assert index.match(list(range(8)), "tenant-a")[1] == 8


def test_least_recently_used_leaf_pages_are_evicted_first_and_shared_parents_last():
    index, pool = make_index(num_pages=7)  # 6 usable
    shared = list(range(4))
    a = computed(index, pool, shared + [10] * 4)
    pool.incref(a[0])
    b = [a[0]] + pool.allocate(1)
    index.insert(shared + [20] * 4, "", b, [], 1, 2)
    release(pool, a)  # a's leaf is least recently used
    release(pool, b)
    assert pool.num_free == 6 and pool.num_cached == 3
    pool.allocate(3)  # the uncached pages first
    assert pool.num_evictions == 0
    assert pool.allocate(1) == [a[1]]
    assert index.match(shared + [10] * 4, "") == ([a[0]], 4)
    assert pool.allocate(1) == [b[1]]
    assert pool.allocate(1) == [a[0]]  # the parent only once it is a leaf
    assert len(index) == 0 and index._roots == {}
    index.check_invariants()
    pool.check_invariants()


def test_pages_in_use_are_never_evicted():
    index, pool = make_index(num_pages=5)  # 4 usable
    held = computed(index, pool, list(range(8)))
    idle = computed(index, pool, [7] * 8)
    release(pool, idle)
    assert pool.allocate(2) is not None
    assert pool.allocate(1) is None
    assert index.match(list(range(8)), "") == (held, 8)
    index.check_invariants()


def test_idle_leaf_with_a_held_parent_is_evictable():
    index, pool = make_index(num_pages=4)  # 3 usable
    a = computed(index, pool, list(range(8)))
    pool.incref(a[0])
    release(pool, a)  # a[0] still held by someone else, a[1] idle
    assert pool.allocate(2) is not None and pool.num_evictions == 1
    assert index.match(list(range(8)), "") == ([a[0]], 4)
    index.check_invariants()


def test_clear_forgets_everything():
    index, pool = make_index()
    release(pool, computed(index, pool, list(range(8))))
    index.clear()
    assert index.match(list(range(8)), "") == ([], 0)
    assert pool.num_cached == 0
    pool.check_invariants()


def test_a_commit_that_retraces_part_of_a_run_leaves_the_rest_least_recently_used():
    index, pool = make_index(num_pages=6)  # 5 usable
    a = computed(index, pool, list(range(12)))
    release(pool, a)
    x = computed(index, pool, [7] * 4)
    release(pool, x)  # x is more recent than all of a
    pool.incref(a[0])  # b hit a's first page, then computed a's second page itself
    b = [a[0]] + pool.allocate(1)
    own = b[1]
    index.insert(list(range(8)), "", b, [], 1, 2)
    assert b == a[:2]
    release(pool, b)
    assert pool.allocate(1) == [own]  # b's own copy went back uncached
    assert pool.allocate(1) == [a[2]]  # a's unused rest, not x
    index.check_invariants()
