"""PagePool: null page, all-or-nothing allocation, free order (uncached first, then cached LRU)."""

from __future__ import annotations

import pytest

from kvserve.cache.pages import NULL_PAGE, PagePool


class Recorder:
    """A listener that lets the pool pick its LRU head and records evictions."""

    def __init__(self) -> None:
        self.evicted: list[int] = []
        self.idle: list[int] = []

    def choose_victim(self) -> int | None:
        return None

    def on_evict(self, page_id: int) -> None:
        self.evicted.append(page_id)

    def on_idle(self, page_id: int) -> None:
        self.idle.append(page_id)


def make_pool(num_pages: int) -> tuple[PagePool, Recorder]:
    pool = PagePool(num_pages)
    pool.listener = Recorder()
    return pool, pool.listener


def cache(pool: PagePool, pages: list[int]) -> None:
    for page in pages:
        pool.mark_cached(page)


def test_null_page_is_never_handed_out():
    pool, _ = make_pool(5)
    pages = pool.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and NULL_PAGE not in pages
    assert pool.allocate(1) is None
    pool.check_invariants()


def test_allocate_is_all_or_nothing():
    pool, _ = make_pool(5)
    pool.allocate(2)
    before = pool.free_order()
    assert pool.allocate(3) is None
    assert pool.free_order() == before and pool.num_free == 2
    pool.check_invariants()


def test_too_small_pool_is_refused():
    with pytest.raises(ValueError):
        PagePool(1)


def test_freed_uncached_pages_are_free_and_cached_ones_idle():
    pool, rec = make_pool(5)
    a, b = pool.allocate(2)
    cache(pool, [a])
    pool.decref(a)
    pool.decref(b)
    assert pool.num_free == 4 and pool.num_used == 0
    assert pool.num_cached_idle == 1 and rec.idle == [a]
    pool.check_invariants()


def test_uncached_pages_are_reused_before_cached_ones():
    pool, rec = make_pool(4)
    a, b, c = pool.allocate(3)
    cache(pool, [a, b])
    for page in (a, b, c):
        pool.decref(page)
    assert pool.allocate(1) == [c]
    assert rec.evicted == [] and pool.num_evictions == 0


def test_cached_idle_pages_are_evicted_least_recently_freed_first():
    pool, rec = make_pool(4)
    pages = pool.allocate(3)
    cache(pool, pages)
    for page in (pages[2], pages[0], pages[1]):
        pool.decref(page)
    assert pool.allocate(2) == [pages[2], pages[0]]
    assert rec.evicted == [pages[2], pages[0]]
    assert pool.num_evictions == 2 and pool.num_cached == 1
    pool.check_invariants()


def test_a_hit_takes_an_idle_page_off_the_free_order():
    pool, rec = make_pool(3)
    a, b = pool.allocate(2)
    cache(pool, [a, b])
    pool.decref(a)
    pool.decref(b)
    pool.incref(a)  # a prefix hit re-uses a
    assert pool.free_order() == [b]
    assert pool.allocate(1) == [b] and rec.evicted == [b]
    assert pool.allocate(1) is None
    pool.decref(a)  # back to the LRU tail, still cached
    assert pool.is_cached(a) and pool.free_order() == [a]
    pool.check_invariants()


def test_shared_page_returns_only_when_the_last_ref_goes():
    pool, _ = make_pool(3)
    (a,) = pool.allocate(1)
    pool.incref(a)
    pool.decref(a)
    assert pool.num_used == 1
    pool.decref(a)
    assert pool.num_used == 0
    pool.check_invariants()


def test_unmarking_an_idle_page_makes_it_plain_free():
    pool, rec = make_pool(3)
    (a,) = pool.allocate(1)
    cache(pool, [a])
    pool.decref(a)
    pool.unmark_cached(a)
    assert pool.num_cached == 0 and pool.num_cached_idle == 0 and pool.num_free == 2
    pool.allocate(2)
    assert rec.evicted == []
    pool.check_invariants()


def test_check_invariants_catches_a_corrupt_pool():
    pool, _ = make_pool(3)
    (a,) = pool.allocate(1)
    pool._free.append(a)  # a used page also on the free list
    with pytest.raises(AssertionError):
        pool.check_invariants()
