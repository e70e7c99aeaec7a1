"""Cache leases on the real model: a leased prefix survives a flood that evicts every unleased page
and is read on the next call; after its TTL it is evictable again; prefixes under the minimum get no
lease; the leased-fraction cap refuses without failing the request; leases never deadlock a small
pool. Outputs (float32, greedy) equal the unleased run's. A fake clock stands in for minutes."""

from __future__ import annotations

from kvserve import SamplingParams
from kvserve.cache.leases import LeaseRefusal
from kvserve.metrics import EngineMetrics
from kvserve.request import CacheLease
from tests.conftest import pooled_llm

PAGE = 16
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def prompt(seed: int, length: int) -> list[int]:
    return [1 + (seed * 131 + j * 7) % 4000 for j in range(length)]


def leased_llm(num_pages: int, **kwargs):
    llm = pooled_llm(num_pages, max_model_len=256, swap_space=0, min_cacheable_tokens=64, **kwargs)
    clock = Clock()
    llm.engine.manager.clock = clock
    return llm, clock


def run(llm, tokens: list[int], leases: list[CacheLease] | None = None):
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": tokens}, PARAMS, leases=leases)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def flood(llm, count: int = 6) -> None:
    for seed in range(100, 100 + count):
        run(llm, prompt(seed, 120))


def test_a_leased_prefix_survives_a_flood_and_expires_after_its_ttl():
    llm, clock = leased_llm(24)  # 23 usable pages: a flood of 6 x 8 pages evicts everything unleased
    system, other = prompt(1, 128), prompt(2, 128)
    first = run(llm, system + [5, 6, 7], [CacheLease(128, 300.0, "5m")])
    assert first.lease_usage.cache_creation_tokens == {"5m": 128} and first.lease_usage.cache_read_tokens == 0
    run(llm, other + [5, 6, 7])  # cached but not leased
    flood(llm)
    stats = llm.stats()
    assert stats["leased_pages"] == 8 and stats["lease_grants"] == 1
    again = run(llm, system + [8, 9, 10], [CacheLease(128, 300.0, "5m")])
    assert again.num_cached_tokens >= 128  # read back: the lease kept its pages
    assert again.lease_usage.cache_read_tokens == 128 and again.lease_usage.cache_creation_tokens == {}
    assert run(llm, other + [5, 6, 7]).num_cached_tokens == 0  # the unleased one was evicted
    clock.now += 301  # past the TTL (the read above refreshed it from then on)
    assert llm.stats()["lease_expiries"] == 0 and llm.stats()["leased_pages"] == 8  # reading changes nothing
    llm.engine.expire_leases()  # what each step, and an idle server's loop, does
    metrics = EngineMetrics("m")
    metrics.observe(llm.engine.stats())
    assert llm.stats()["lease_expiries"] == 1 and llm.stats()["leased_pages"] == 0
    assert b'kvserve:lease_expiries_total{model_name="m"} 1.0' in metrics.render()
    flood(llm)
    late = run(llm, system + [8, 9, 10])
    assert late.num_cached_tokens == 0  # evictable again, and evicted
    assert late.outputs[0].token_ids == again.outputs[0].token_ids  # same answer cold or leased


def test_a_miss_after_a_lease_ran_out_is_explained_as_lease_expired():
    llm, clock = leased_llm(24)
    system = prompt(11, 128)
    run(llm, system + [5, 6, 7], [CacheLease(128, 300.0, "5m")])
    clock.now += 301
    llm.engine.manager.expire_leases()
    flood(llm)
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": system + [8, 9]}, PARAMS, kv_explain=True)
    while not (done := [o for o in engine.step() if o.request_id == request_id and o.finished]):
        pass
    explanation = done[0].kv_cache
    assert explanation["reason"] == "lease_expired" and explanation["cached_tokens"] == 0


def test_a_prefix_under_the_minimum_gets_no_lease():
    llm, _ = leased_llm(40)
    out = run(llm, prompt(3, 80), [CacheLease(48, 300.0, "5m")])
    assert out.lease_usage.refused == LeaseRefusal.BELOW_MIN_CACHEABLE
    assert out.lease_usage.cache_creation_tokens == {} and llm.stats()["leased_pages"] == 0


def test_over_the_leased_fraction_cap_the_request_runs_without_a_lease():
    llm, _ = leased_llm(40, max_leased_fraction=0.25)  # 39 usable pages: at most 9 leased
    ok = run(llm, prompt(4, 130), [CacheLease(128, 300.0, "1h")])
    assert ok.lease_usage.cache_creation_tokens == {"1h": 128}
    refused = run(llm, prompt(5, 130), [CacheLease(128, 300.0, "1h")])
    assert refused.lease_usage.refused == LeaseRefusal.LEASED_FRACTION_CAP
    assert refused.lease_usage.cache_creation_tokens == {} and refused.outputs[0].finish_reason == "length"
    assert llm.stats()["lease_refusals"] == 1


def test_leases_at_the_cap_never_block_a_small_pool():
    """A pool of about two requests, half of it leased: a request needing more than the rest is
    still admitted (leases give way, oldest first) and every request completes."""
    llm, _ = leased_llm(22, max_leased_fraction=0.5)  # 21 usable pages
    run(llm, prompt(6, 80), [CacheLease(80, 3600.0, "1h")])
    run(llm, prompt(7, 80), [CacheLease(80, 3600.0, "1h")])
    assert llm.stats()["leased_pages"] == 10
    big = prompt(8, 200)  # 13 pages: more than the 11 unleased ones
    out = llm.generate({"prompt_token_ids": big}, SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 16
    assert llm.stats()["lease_breaks"] >= 1
    for lease_id in list(llm.engine.manager.leases.leases):  # the leak check wants no page held
        llm.engine.release_lease("", lease_id)
