"""`kvserve simulate` and the engine agree: one trace through the simulator and through LLMEngine, with
the same pool (small enough to evict and preempt), gives the same prefix-cache hit tokens, to the token;
and with cache breakpoints (leases), a host tier and kv_explain, the same hit tokens by source, lease
reads and grants and miss reasons, request by request.

Both drive the same Scheduler and KVCacheManager; the engine computes with the model, the simulator
with a virtual clock and synthetic output ids. Prompts never extend one another, so the output ids
(the model's or the simulator's) cannot be hit by a later prompt. Admission aging is off on both
sides: the engine ages by wall time, which on a busy machine would reorder admissions."""

from __future__ import annotations

import math

import pytest

from kvserve.tools.simulate import SchedulerLimits, prepare, replay
from kvserve.tools.traces import TraceRequest
from tests.conftest import pool_memory

PAGE_SIZE = 8
NUM_PAGES = 12  # page 0 included: 11 usable pages for 12 requests of 3-5 pages each
MAX_TOKENS = 4


def shared_prefix_trace() -> list[TraceRequest]:
    """12 requests at t=0: three prefixes (17, 20, 27 tokens) with 4 distinct suffixes each; one group
    is split by cache_salt and one request has a tenant, which must keep them apart."""
    trace = []
    for g, prefix_len in enumerate((17, 20, 27)):
        prefix = [1000 + 100 * g + t for t in range(prefix_len)]
        for i in range(4):
            suffix = [5000 + 50 * (4 * g + i) + t for t in range(2 + 2 * i)]
            salt = "s1" if g == 1 and i >= 2 else None
            tenant = "acme" if g == 2 and i == 3 else None
            trace.append(TraceRequest(f"g{g}-{i}", prefix + suffix, None, 0.0, MAX_TOKENS, cache_salt=salt,
                                      tenant=tenant))
    return trace


def run_engine(trace: list[TraceRequest]) -> dict:
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(dtype="float32", page_size=PAGE_SIZE, prefix_cache="radix",
                                    kv_cache_memory=pool_memory(NUM_PAGES, PAGE_SIZE), max_model_len=64,
                                    swap_space=0))  # no host tier: the simulator models the pool only
    assert hasattr(engine.scheduler, "admission_age_bound_s")
    engine.scheduler.admission_age_bound_s = math.inf
    for r in trace:
        engine.add_request({"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, cache_salt=r.cache_salt),
                           request_id=r.id, tenant=r.tenant or "")
    while engine.has_unfinished():
        engine.step()
    assert engine.manager.num_used_pages == 0
    return engine.stats().as_dict()


@pytest.mark.slow
def test_simulator_and_engine_hit_the_same_tokens():
    trace = shared_prefix_trace()
    sim = replay(prepare(trace, [r.prompt_token_ids for r in trace]), "radix", PAGE_SIZE, NUM_PAGES - 1,
                 check_invariants=True, limits=SchedulerLimits(admission_age_bound_s=math.inf))
    engine = run_engine(trace)
    assert engine["num_evictions"] > 0 and engine["prefix_cache_hits"] > 0  # the pool is small enough
    assert sim.num_requests_served == len(trace) and not sim.unservable_request_ids
    assert (sim.prefix_cache_hits, sim.prefix_cache_queries, sim.num_evictions, sim.num_preemptions) == (
        engine["prefix_cache_hits"], engine["prefix_cache_queries"], engine["num_evictions"],
        engine["num_preemptions"])


# -- leases, a host tier and explanations, request by request ---------------------------------------
HOST_PAGES = 6
MIN_CACHEABLE = 16


def lease_and_tier_trace() -> list[TraceRequest]:
    """One request at a time: three prefixes, the middle one leased (`cache_control` at its end);
    the pool holds about two prefixes, so the first is evicted to the host tier while the leased one
    stays; then each prefix again, and a prompt never seen."""
    prefixes = [[2000 + 100 * g + t for t in range(length)] for g, length in enumerate((24, 20, 27))]
    trace, n = [], 0
    for wave in range(2):
        for g, prefix in enumerate(prefixes):
            for i in range(2):
                n += 1
                suffix = [7000 + 40 * n + t for t in range(3 + i)]
                breakpoints = [(len(prefix), 300.0)] if g == 1 else None
                trace.append(TraceRequest(f"w{wave}-g{g}-{i}", prefix + suffix, None, None, MAX_TOKENS,
                                          cache_breakpoints=breakpoints))
    trace.append(TraceRequest("never-seen", [9000 + t for t in range(19)], None, None, MAX_TOKENS))
    return trace


def run_engine_one_at_a_time(trace: list[TraceRequest]) -> tuple[dict, dict]:
    from kvserve.cache.leases import Breakpoint
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.sampling_params import SamplingParams
    from kvserve.tools.simulate.replayer import RequestRecord

    engine = LLMEngine(EngineConfig(dtype="float32", page_size=PAGE_SIZE, prefix_cache="radix",
                                    kv_cache_memory=pool_memory(NUM_PAGES, PAGE_SIZE), max_model_len=64,
                                    swap_space=pool_memory(HOST_PAGES, PAGE_SIZE),
                                    min_cacheable_tokens=MIN_CACHEABLE))
    records = {}
    for r in trace:
        engine.add_request({"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), request_id=r.id,
                           leases=[Breakpoint(n, ttl) for n, ttl in r.cache_breakpoints or ()],
                           kv_explain=True)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    records[out.request_id] = RequestRecord.of(out)
    return records, engine.stats().as_dict()


@pytest.mark.slow
def test_simulator_and_engine_agree_request_by_request_with_leases_host_tier_and_explanations():
    from kvserve.tools.simulate.replayer import CacheOptions

    trace = lease_and_tier_trace()
    sim = replay(prepare(trace, [r.prompt_token_ids for r in trace]), "radix", PAGE_SIZE, NUM_PAGES - 1,
                 check_invariants=False, cache=CacheOptions(host_tier_pages=HOST_PAGES,
                                                            min_cacheable_tokens=MIN_CACHEABLE, explain=True))
    engine, stats = run_engine_one_at_a_time(trace)
    assert sim.requests == engine  # hit tokens, lease reads and grants, miss reasons, by source
    assert sim.num_lease_grants == stats["lease_grants"] > 0
    assert sim.host_tier_hits > 0 and sim.num_evictions == stats["num_evictions"] > 0
    reasons = {r.miss_reason for r in engine.values()}
    assert len(reasons) >= 3, reasons  # not only hits: cold, evicted-and-reloaded, ...
