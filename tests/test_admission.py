"""One admission, one walk of the prefix index: the scheduler's ordering lookup is the only match a
request's admission makes; the fork cut, the tier pages, the explanation and the leases granted at
commit all come from that one answer (a frozen PrefixHit), and allocate() says what it used."""

from __future__ import annotations

from collections import Counter

import pytest

from kvserve.cache.leases import Breakpoint, Retention
from kvserve.cache.manager import KVCacheManager
from kvserve.cache.offload import Offloader
from kvserve.cache.tiers import HostTier
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler
from tests.test_scheduler import FakeRunner, finish_step

PS = 4


def counting(manager: KVCacheManager) -> Counter:
    """Count the prefix index's matches, per queried token sequence."""
    calls: Counter = Counter()
    match = manager.index.match

    def counted(token_ids, namespace):
        calls[tuple(token_ids)] += 1
        return match(token_ids, namespace)

    manager.index.match = counted
    return calls


def serve(scheduler: Scheduler, runner: FakeRunner, request: Request) -> None:
    scheduler.add(request)
    step = 0
    while scheduler.has_unfinished():
        finish_step(scheduler, runner, scheduler.schedule(), now=float(step))
        scheduler.manager.check_invariants()
        step += 1


@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_an_admission_with_tier_pages_a_fork_an_explanation_and_a_lease_matches_once(policy):
    num_pages = 12
    host = HostTier(capacity_bytes=64, page_bytes=1)
    manager = KVCacheManager(num_pages, PS, policy, offload=Offloader(PS, host, offload_evicted=True),
                             max_leased_fraction=0.9)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1000)
    runner = FakeRunner(num_pages, PS)
    calls = counting(manager)
    prefix = list(range(1, 25))  # 6 pages
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    serve(scheduler, runner, Request("a", prefix + [90, 91], params))
    serve(scheduler, runner, Request("flood", [500 + i for i in range(40)], params))  # evicts a's pages
    prompt = prefix + [70, 71, 72]
    b = Request("b", prompt, SamplingParams(max_tokens=2, ignore_eos=True, n=2), kv_explain=True,
                retention=Retention.of([Breakpoint(24, 60.0)], len(prompt), "", min_cacheable_tokens=8))
    b.fork_children = [Request("b#1", prompt, params)]
    calls.clear()
    serve(scheduler, runner, b)
    assert calls[tuple(prompt)] == 1, calls  # the ordering lookup: nothing after it walks again
    assert sum(calls.values()) == 1
    assert b.cache.cached_by_source["host"] > 0 and b.num_cached_tokens == 24
    assert b.cache.explanation.reason == "evicted"
    assert b.lease_usage is not None and len(b.lease_usage.lease_ids) == 1
    assert manager.leases.stats.grants == 1
    for lease_id in list(manager.leases.leases):
        manager.leases.release(lease_id)
    manager.check_invariants()


def test_allocate_returns_what_it_used_and_leaves_the_callers_hit_alone():
    manager = KVCacheManager(7, PS, "radix")
    tokens = list(range(12))
    assert manager.allocate("a", tokens, "", manager.lookup(tokens), 12) is not None
    manager.commit("a", tokens, 12)
    manager.free("a")
    query = tokens + [5]
    hit = manager.lookup(query)
    assert hit.num_tokens == 12
    assert manager.allocate("x", [9] * 13, "", manager.lookup([9] * 13), 13) is not None  # evicts a page
    manager.free("x")
    got = manager.allocate("b", query, "", hit, 13)
    assert got.hit.num_tokens == 8 and got.cached_by_source["pool"] == 8
    assert hit.num_tokens == 12 and len(hit.pages) == 3  # frozen: untouched
    with pytest.raises(AttributeError):
        hit.num_tokens = 0  # type: ignore[misc]


def test_a_fork_parent_is_cut_two_tokens_short_on_a_page_boundary_without_partial_pages():
    manager = KVCacheManager(16, PS, "hash", partial_page_hits=False)
    tokens = list(range(16))
    manager.allocate("a", tokens, "", manager.lookup(tokens), 16)
    manager.commit("a", tokens, 16)
    manager.free("a")
    hit = manager.plan_admission(tokens, "", max_tokens=14, budget=64)  # 16 tokens, a fork parent
    assert hit.num_tokens == 12 and len(hit.pages) == 3  # not 14 (a partial page copy)
