"""What the cache remembers to explain a miss (cache/history.py) is bounded with fair shares: a tenant
that holds no more than its share of the bound remembers exactly what it would remember alone, whatever
another tenant commits; past the bound the tenant holding the most forgets its oldest first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cache.hashing import namespace, page_hash
from kvserve.cache.history import CacheHistory

CAPACITY = 12
NS = {"a": namespace("key:a", None), "b": namespace("key:b", None), "b2": namespace("key:b", "salt")}
events = st.lists(st.tuples(st.sampled_from(["a", "b", "b2"]), st.sampled_from(["store", "evict", "expire"]),
                            st.integers(0, 30), st.integers(0, 3)), max_size=120)


def page(ns: str, i: int, parent: int) -> tuple[bytes, bytes | None]:
    """Page i's chained hash in `ns`, and its parent's (pages 0..3 start a chain: no parent)."""
    parent_hash = page_hash(None, [parent], NS[ns]) if i > 3 else None
    return page_hash(parent_hash, [i], NS[ns]), parent_hash


def view(history: CacheHistory, names: tuple[str, ...]):
    """Everything explain() can ask about these namespaces' pages."""
    out = []
    for ns in names:
        for i in range(31):
            for parent in range(4):
                h, p = page(ns, i, parent)
                record = history.record(h)
                out.append((record and (record.committed_at, record.evicted_at, record.lease_expired_at),
                            history.has_other_child(p if p is not None else NS[ns], h)))
    return out


@settings(max_examples=300, deadline=None)
@given(events=events)
def test_a_tenant_within_its_share_remembers_what_it_would_alone(events):
    shared, alone = CacheHistory(16, CAPACITY), CacheHistory(16, CAPACITY)
    for now, (ns, what, i, parent) in enumerate(events):
        h, p = page(ns, i, parent)
        targets = [shared] + ([alone] if ns != "a" else [])
        for history in targets:
            {"store": lambda: history.stored(h, p, NS[ns], now), "evict": lambda: history.evicted(h, now),
             "expire": lambda: history.lease_expired(h, now)}[what]()
        b_pages, b_keys = alone.pages.tenant_size("key:b"), alone.children.tenant_size("key:b")
        if max(b_pages, b_keys) <= CAPACITY // 2:  # B within its share (two tenants): A changes nothing
            assert view(shared, ("b", "b2")) == view(alone, ("b", "b2"))
        assert len(shared.pages) <= CAPACITY and len(shared.children) <= CAPACITY


def test_past_the_bound_the_tenant_holding_the_most_forgets_its_oldest():
    history = CacheHistory(16, 4)
    b0, _ = page("b", 0, 0)
    history.stored(b0, None, NS["b"], 0.0)
    for i in range(10):  # A's flood
        history.stored(page("a", i, 0)[0], None, NS["a"], 1.0 + i)
    assert history.record(b0) is not None and history.record(b0).committed_at == 0.0
    assert history.record(page("a", 9, 0)[0]) is not None and history.record(page("a", 0, 0)[0]) is None
    assert history.has_other_child(NS["b"], None)  # B's root still has its page 0 after A's flood
