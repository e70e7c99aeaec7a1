"""The recent prompts a miss is explained against (cache/recent_prompts.py) are kept per tenant: whatever
another tenant sends, a tenant's own list, and so its partial_page explanations, stay what they would be
alone; each tenant's list and all of them together stay within their bounds, and past the bound on all
a tenant within an equal share keeps what it would keep alone."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cache.hashing import namespace, tenant_of
from kvserve.cache.manager import KVCacheManager
from kvserve.cache.recent_prompts import RecentPrompts

NAMESPACES = [namespace("key:a", None), namespace("key:a", "s"), namespace("key:b", None),
              namespace("key:b", "s"), namespace("", "s"), ""]
adds = st.lists(st.tuples(st.sampled_from(NAMESPACES), st.lists(st.integers(0, 9), max_size=12)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(adds=adds, per_tenant=st.integers(1, 6), per_tenant_tokens=st.integers(1, 40))
def test_a_tenants_recent_prompts_are_what_they_would_be_without_the_others(adds, per_tenant, per_tenant_tokens):
    shared, alone = RecentPrompts(per_tenant, per_tenant_tokens), {}
    for ns, tokens in adds:
        shared.add(ns, tokens)
        alone.setdefault(tenant_of(ns), RecentPrompts(per_tenant, per_tenant_tokens)).add(ns, tokens)
        for other in NAMESPACES:
            if tenant_of(other) == tenant_of(ns):
                assert [list(p) for p in shared.before_last(other)] == \
                    [list(p) for p in alone[tenant_of(ns)].before_last(other)]
        for prompts in shared._by_tenant.values():
            assert len(prompts) <= per_tenant
            assert len(prompts) == 1 or sum(len(p) for _, p in prompts) <= per_tenant_tokens


def tokens_of(recent: RecentPrompts, tenant: str) -> int:
    return sum(len(p) for _, p in recent._by_tenant.get(tenant, ()))


@settings(max_examples=300, deadline=None)
@given(adds=st.lists(st.tuples(st.sampled_from(["key:a", "key:b", "key:c"]), st.integers(0, 30)), max_size=80),
       in_all=st.integers(1, 90))
def test_past_the_bound_on_all_a_tenant_within_an_equal_share_keeps_what_it_would_alone(adds, in_all):
    shared, alone = RecentPrompts(8, 60, in_all), {t: RecentPrompts(8, 60, 10**9) for t in ("a", "b", "c")}
    for i, (key, length) in enumerate(adds):
        tokens = [i] * length
        shared.add(namespace(key, None), tokens)
        alone[key[-1]].add(namespace(key, None), tokens)
        assert shared._total == sum(tokens_of(shared, t) for t in shared._by_tenant) <= in_all
        for t in ("a", "b", "c"):
            own = alone[t]._by_tenant.get(f"key:{t}", ())
            if sum(len(p) for _, p in own) <= in_all // 3:  # an equal share of three tenants
                assert [list(p) for _, p in shared._by_tenant.get(f"key:{t}", ())] == [list(p) for _, p in own]


def test_past_the_bound_on_all_the_tenant_holding_the_most_gives_up_its_oldest():
    recent = RecentPrompts(tokens_in_all=10)
    for tenant, length in (("key:a", 3), ("key:b", 2), ("key:a", 3), ("key:b", 2), ("key:c", 1)):
        recent.add(namespace(tenant, None), [7] * length)
    # 11 tokens: A holds 6 of them and loses its first prompt; B and C keep theirs
    assert {t: [len(p) for _, p in q] for t, q in recent._by_tenant.items()} == \
        {"key:a": [3], "key:b": [2, 2], "key:c": [1]}


def test_ten_thousand_tenants_each_keep_their_prompt():
    """(A cap on the number of tenants, 256 before, dropped a quiet tenant's list once 256 others came.)"""
    recent = RecentPrompts()
    for i in range(10_000):
        recent.add(namespace(f"key:{i}", None), [i, i + 1])
        recent.add(namespace(f"key:{i}", None), [i])
    assert all([list(p) for p in recent.before_last(namespace(f"key:{i}", None))] == [[i, i + 1]]
               for i in range(10_000))


def admit(m: KVCacheManager, seq_id: str, tokens: list[int], ns: str):
    hit = m.lookup(tokens, ns)
    allocation = m.allocate(seq_id, tokens, ns, hit, len(tokens))
    explanation = m.explain(tokens, ns, allocation)
    m.commit(seq_id, tokens, len(tokens))
    m.free(seq_id)
    return explanation.as_dict()


def test_another_tenants_flood_leaves_a_partial_page_explained_as_one():
    """B shares a head shorter than a page with its own earlier prompt; A's hundred prompts in between
    (more than a tenant's list holds) must not turn B's answer into a cold miss."""
    ns_a, ns_b = namespace("key:a", None), namespace("key:b", None)
    head = [5, 6, 7]
    told = {}
    for flood in (0, 100):
        m = KVCacheManager(512, 8, "hash")
        admit(m, "b1", head + [1, 2, 3, 4, 9], ns_b)
        for i in range(flood):
            admit(m, f"a{i}", [100 + i, 1, 2, 3], ns_a)
        told[flood] = admit(m, "b2", head + [8, 8, 8, 8, 8], ns_b)
    assert told[0]["reason"] == "partial_page" and told[0]["diverged_at"] == 3
    assert told[100] == told[0]


def test_any_integer_is_a_token_id():
    """The simulator's generated ids start at 2**40; the cache takes any integer."""
    recent = RecentPrompts()
    for tokens in ([2**40, 5], [2**70, 6], [-1, 7], []):
        recent.add("", tokens)
    assert [list(p) for p in recent.before_last("")] == [[2**40, 5], [2**70, 6], [-1, 7]]
