"""HashPrefixIndex over a PagePool: full-page chains, namespaces, LRU eviction, collision safety."""

from __future__ import annotations

from kvserve.cache import prefix_hash
from kvserve.cache.hashing import page_hashes
from kvserve.cache.pages import PagePool
from kvserve.cache.prefix_hash import HashPrefixIndex

PS = 4


def make_index(num_pages: int = 16) -> tuple[HashPrefixIndex, PagePool]:
    pool = PagePool(num_pages)
    return HashPrefixIndex(pool, PS), pool


def computed(index: HashPrefixIndex, pool: PagePool, tokens: list[int], namespace: str = "",
             hash_fn=page_hashes) -> list[int]:
    """Pages of a sequence that computed `tokens` and committed its full pages (still held)."""
    pages = pool.allocate(-(-len(tokens) // PS))
    index.insert(tokens, namespace, pages, hash_fn(tokens, PS, namespace), 0, len(tokens) // PS)
    return pages


def release(pool: PagePool, pages: list[int]) -> None:
    for page in reversed(pages):
        pool.decref(page)


def test_full_pages_are_indexed_and_matched_in_order():
    index, pool = make_index()
    pages = computed(index, pool, list(range(10)))
    assert index.match(list(range(10)), "") == (pages[:2], 8)
    assert index.match(list(range(8)) + [99], "") == (pages[:2], 8)
    assert len(index) == 2 and pool.num_cached == 2
    index.check_invariants()


def test_match_stops_at_the_first_differing_page():
    index, pool = make_index()
    pages = computed(index, pool, list(range(12)))
    query = list(range(4)) + [50, 5, 6, 7] + list(range(8, 12))
    assert index.match(query, "") == (pages[:1], 4)
    assert index.match([1, 0, 2, 3], "") == ([], 0)


def test_a_page_is_only_reachable_through_its_prefix():
    index, pool = make_index()
    computed(index, pool, [9, 9, 9, 9, 1, 2, 3, 4])
    assert index.match([1, 2, 3, 4], "") == ([], 0)


def test_namespaces_never_share_pages():
    index, pool = make_index()
    computed(index, pool, list(range(8)), "tenant-a")
    assert index.match(list(range(8)), "tenant-b") == ([], 0)
    assert index.match(list(range(8)), "tenant-a")[1] == 8


def test_duplicate_content_keeps_the_first_page():
    index, pool = make_index()
    first = computed(index, pool, list(range(8)))
    second = computed(index, pool, list(range(8)))
    assert index.match(list(range(8)), "")[0] == first
    assert not any(pool.is_cached(page) for page in second)
    index.check_invariants()


def test_evicted_pages_leave_the_index_least_recently_freed_first():
    index, pool = make_index(num_pages=5)  # 4 usable
    old = computed(index, pool, [1] * 8)
    new = computed(index, pool, [2] * 8)
    release(pool, old)
    release(pool, new)
    assert pool.allocate(1) == [old[1]]  # old's tail page: freed first
    assert index.match([1] * 8, "") == (old[:1], 4)
    assert pool.allocate(2) == [old[0], new[1]]
    assert index.match([1] * 8, "") == ([], 0)
    assert index.match([2] * 8, "") == (new[:1], 4)
    assert pool.num_evictions == 3
    index.check_invariants()
    pool.check_invariants()


def test_a_hash_collision_is_a_miss_not_a_wrong_page(monkeypatch):
    def colliding(parent, token_ids, namespace):
        return b"\x00" * 16  # every page hashes alike

    monkeypatch.setattr(prefix_hash, "page_hash", colliding)

    def colliding_hashes(tokens, page_size, namespace):
        return [colliding(None, None, None)] * (len(tokens) // page_size)

    monkeypatch.setattr(prefix_hash, "page_hashes", colliding_hashes)
    index, pool = make_index()
    pages = computed(index, pool, [1, 2, 3, 4], hash_fn=colliding_hashes)
    assert index.match([5, 6, 7, 8], "") == ([], 0)
    assert index.match([1, 2, 3, 4], "other") == ([], 0)
    assert index.match([1, 2, 3, 4], "") == (pages, 4)


def test_clear_forgets_everything():
    index, pool = make_index()
    release(pool, computed(index, pool, list(range(8))))
    index.clear()
    assert index.match(list(range(8)), "") == ([], 0)
    assert pool.num_cached == 0 and pool.num_free == 15
    pool.check_invariants()
