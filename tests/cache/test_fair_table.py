"""FairShareTable (cache/fair_table.py), the bound on what the server remembers per tenant (explain's
page history, the cache report's prefixes, /v1/messages diagnostics, tool-call holds): with one tenant
it is an LRU dict of its capacity; with several, a tenant within an equal share keeps exactly what it
would keep alone, whatever the others put."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cache.fair_table import FairShareTable

ops = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["put", "pop", "touch"]),
                         st.integers(0, 12), st.integers()), max_size=150)


@settings(max_examples=400, deadline=None)
@given(ops=ops, capacity=st.integers(1, 8))
def test_one_tenant_is_an_lru_dict(ops, capacity):
    table, model = FairShareTable(capacity), OrderedDict()
    for _, op, key, value in ops:
        if op == "put":
            model.pop(key, None)
            model[key] = value
            if len(model) > capacity:
                model.popitem(last=False)
            table.put(key, value, "a")
        elif op == "pop":
            assert table.pop(key) == model.pop(key, None)
        elif key in model:
            model.move_to_end(key)
            table.touch(key)
        assert list(table.items()) == list(model.items()) == list(table.items_of("a"))


@settings(max_examples=400, deadline=None)
@given(ops=ops, capacity=st.integers(2, 10))
def test_a_tenant_within_its_share_keeps_what_it_would_alone(ops, capacity):
    shared, alone = FairShareTable(capacity), FairShareTable(capacity)
    within = True
    for tenant, op, key, value in ops:
        targets = [shared] + ([alone] if tenant == "b" else [])
        for table in targets:
            if op == "put":
                table.put((tenant, key), value, tenant)
            elif op == "pop":
                table.pop((tenant, key))
            else:
                table.touch((tenant, key))
        within = within and alone.tenant_size("b") <= capacity // 2
        if within:  # (once past its share, what B forgot is B's own doing)
            assert list(shared.items_of("b")) == list(alone.items_of("b"))
        assert len(shared) <= capacity
        assert sum(shared.tenant_size(t) for t in "ab") == len(shared)


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("abcde"), st.sampled_from(["put", "put", "pop", "touch"]),
                              st.integers(0, 9)), max_size=200), capacity=st.integers(1, 12))
def test_past_capacity_the_least_recent_entry_of_a_tenant_holding_the_most_goes(ops, capacity):
    table = FairShareTable(capacity)
    for tenant, op, key in ops:
        before = {t: list(dict(table.items_of(t))) for t in "abcde"}
        if op == "pop":
            table.pop((tenant, key))
        elif op == "touch":
            table.touch((tenant, key))
        else:
            table.put((tenant, key), 0, tenant)
            if (tenant, key) in before[tenant]:
                before[tenant].remove((tenant, key))
            before[tenant].append((tenant, key))  # what the put added, before anything went
            after = {t: list(dict(table.items_of(t))) for t in "abcde"}
            gone = [(t, k) for t in "abcde" for k in before[t] if k not in after[t]]
            assert len(gone) == (sum(map(len, before.values())) > capacity)
            for t, k in gone:
                assert len(before[t]) == max(map(len, before.values())) and k == before[t][0]
        assert len(table) <= capacity
        assert sum(table.tenant_size(t) for t in "abcde") == len(table)


def test_a_zero_capacity_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        FairShareTable(0)
