"""Tool-call holds in the cache layer: a finished conversation's cached pages leased while its tool
runs, ended by the follow-up's admission or the TTL, capped and broken like any lease."""

from __future__ import annotations

from kvserve.cache.leases import TOOL_CALL, LeaseRefusal
from kvserve.cache.manager import KVCacheManager

PAGE = 4


def finished(m: KVCacheManager, seq_id: str, tokens: list[int]) -> list[int]:
    """Run a sequence to the end of `tokens` (all computed and committed); returns its held pages."""
    hit = m.lookup(tokens, "")
    assert m.allocate(seq_id, tokens, "", hit, len(tokens)) is not None
    m.commit(seq_id, tokens, len(tokens))
    return list(m.lookup(tokens + [0], "").pages)


def test_a_hold_keeps_the_pages_through_eviction_pressure_until_used():
    now = [0.0]
    m = KVCacheManager(12, PAGE, "radix", clock=lambda: now[0], max_leased_fraction=0.9)
    conversation = list(range(100, 124))  # 6 full pages
    pages = finished(m, "a", conversation)
    hold = m.leases.hold("", pages, len(pages) * PAGE, 30.0, now[0], owner="t")
    assert not isinstance(hold, str) and hold.label == TOOL_CALL and hold.pages == pages
    m.free("a")
    other = list(range(500, 520))  # 5 pages of other traffic: would evict an unleased conversation
    finished(m, "b", other)
    m.free("b")
    finished(m, "c", list(range(600, 616)))
    m.free("c")
    assert m.lookup(conversation + [1, 2], "").num_cached_tokens == 24  # all of it still cached
    assert m.stats().leases.tool_call_leases == 1
    follow_up = conversation + list(range(900, 908))
    hit = m.lookup(follow_up, "")
    assert m.allocate("d", follow_up, "", hit, len(follow_up)) is not None
    assert m.leases.use_hold(hold.lease_id, "t") and m.stats().leases.tool_call_lease_used == 1
    assert not m.leases.use_hold(hold.lease_id, "t")  # once
    m.free("d")
    m.check_invariants()
    assert m.num_used_pages == 0


def test_a_hold_expires_counts_against_the_cap_and_gives_way():
    now = [0.0]
    m = KVCacheManager(11, PAGE, "radix", clock=lambda: now[0], max_leased_fraction=0.5)
    pages = finished(m, "a", list(range(100, 120)))  # 5 pages, cap is 5
    m.free("a")
    hold = m.leases.hold("", pages, 20, 30.0, now[0], owner="t")
    assert not isinstance(hold, str)
    more = finished(m, "b", list(range(200, 208)))
    m.free("b")
    assert m.leases.hold("", more, 8, 30.0, now[0], owner="t") == LeaseRefusal.LEASED_FRACTION_CAP
    assert not m.leases.use_hold(hold.lease_id, "someone else")  # only its tenant ends it
    now[0] = 31.0
    assert m.expire_leases() == 1 and m.stats().leases.tool_call_leases == 0
    hold = m.leases.hold("", pages[:2], 8, 30.0, now[0], owner="t")
    assert m.make_room()  # broken under pressure, like any lease
    assert hold.lease_id not in m.leases.leases
    m.check_invariants()


def test_no_hold_without_a_prefix_cache():
    m = KVCacheManager(8, PAGE, "off")
    assert m.leases.hold("", [1, 2], 8, 30.0, 0.0, owner="") == LeaseRefusal.PREFIX_CACHE_OFF


def test_one_tenants_holds_cannot_refuse_another_tenants_cache_request():
    """A's abandoned holds fill the leased-fraction cap; B's named cache still gets its pages: A's
    leases over an equal share of the cap give way (soonest to expire first), B's are never touched."""
    now = [0.0]
    m = KVCacheManager(21, PAGE, "radix", clock=lambda: now[0], max_leased_fraction=0.5)  # cap: 10 pages
    a_holds = []
    for i in range(5):  # 5 conversations of 2 pages: A holds the whole cap
        pages = finished(m, f"a{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 8)))
        m.free(f"a{i}")
        a_holds.append(m.leases.hold("", pages, 8, 30.0 + i, now[0], owner="tenant-a"))
    assert all(not isinstance(h, str) for h in a_holds) and m.leases.num_leased_pages == 10
    b_pages = finished(m, "b", list(range(50_000, 50_016)))  # 4 pages
    m.free("b")
    lease = m.leases.grant("", b_pages, 16, 3600.0, now[0], "1h", owner="tenant-b", shared=False)
    assert not isinstance(lease, str), lease
    left = [h.lease_id for h in a_holds if h.lease_id in m.leases.leases]
    assert left == [h.lease_id for h in a_holds[2:]]  # the two soonest to expire gave way
    # A cannot take B's lease back: B is within its share
    more = finished(m, "a9", list(range(90_000, 90_012)))
    m.free("a9")
    assert m.leases.hold("", more, 12, 30.0, now[0], owner="tenant-a") == LeaseRefusal.LEASED_FRACTION_CAP
    assert lease.lease_id in m.leases.leases
    m.check_invariants()


def test_a_tenant_holds_a_bounded_number_of_leases():
    from kvserve.cache.leases import MAX_LEASES_PER_TENANT

    m = KVCacheManager(400, PAGE, "radix", clock=lambda: 0.0, max_leased_fraction=0.9)
    pages = finished(m, "a", list(range(100, 104)))
    m.free("a")
    for _ in range(MAX_LEASES_PER_TENANT):
        assert not isinstance(m.leases.hold("", pages, 4, 30.0, 0.0, owner="t"), str)
    assert m.leases.hold("", pages, 4, 30.0, 0.0, owner="t") == LeaseRefusal.LEASE_COUNT_CAP
    assert not isinstance(m.leases.hold("", pages, 4, 30.0, 0.0, owner="u"), str)  # another tenant
