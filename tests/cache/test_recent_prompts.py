"""The recent prompts a miss is explained against (cache/recent_prompts.py) are kept per tenant: whatever
another tenant sends, a tenant's own list, and so its partial_page explanations, stay what they would be
alone; each tenant's list and the number of tenants stay within their bounds."""

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


def test_past_the_tenants_cap_the_least_recent_tenants_prompts_go():
    recent = RecentPrompts(max_tenants=2)
    for tenant in ("key:a", "key:b", "key:a", "key:c", "key:a"):
        recent.add(namespace(tenant, None), [1, 2])
    assert list(recent._by_tenant) == ["key:c", "key:a"]
    assert len(recent.before_last(namespace("key:a", None))) == 2  # its three, less the newest


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
