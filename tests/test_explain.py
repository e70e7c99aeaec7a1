"""Why did this request miss? Each reason of the per-request explanation is produced by the situation
it names, on the real model; the live cache report names a mid-prompt shared span; fair shares keep
one tenant's working set through another's flood; the preemption-loop guard lets every request end."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.request import CacheLease
from tests.conftest import pooled_llm

PAGE = 16
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    return [1 + (seed * 131 + j * 7) % 4000 for j in range(length)]


def explained(llm, tokens: list[int], tenant: str = "", params: SamplingParams = PARAMS, **kwargs):
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": tokens}, params, tenant=tenant,
                                    kv_explain=True, **kwargs)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output.kv_cache


@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_diverged_evicted_cold_and_full_hit(policy):
    llm = pooled_llm(40, prefix_cache=policy, max_model_len=512, swap_space=0)
    a = prompt(1, 289)  # 18 full pages and one token: a second run can hit all but the last token
    cold = explained(llm, a)
    assert cold["reason"] == "cold" and cold["cached_tokens"] == 0
    changed = a[:200] + [7] + a[201:]  # differs at token 200, inside page 12 (192..207)
    diverged = explained(llm, changed)
    boundary = 192 if policy == "hash" else 200  # hash hits whole pages; radix down to the token
    assert diverged["reason"] == "diverged" and diverged["diverged_at"] == boundary
    assert diverged["cached_tokens"] == boundary
    again = explained(llm, a)
    assert again["reason"] == "full_hit" and again["cached_tokens"] == 288
    for seed in range(10, 14):  # a flood of foreign prompts evicts a's pages
        explained(llm, prompt(seed, 300))
    evicted = explained(llm, a)
    assert evicted["reason"] == "evicted" and "evicted from the pool" in evicted["detail"]
    assert evicted["cached_tokens"] == evicted["diverged_at"]


def test_evicted_pages_loaded_back_from_the_host_tier_are_said_so():
    llm = pooled_llm(30, max_model_len=320, swap_space="64MiB")
    a = prompt(2, 300)
    explained(llm, a)
    explained(llm, prompt(3, 300))  # evicts most of a's pages, which go to the host tier
    back = explained(llm, a)
    assert back["reason"] == "evicted" and "loaded back from the host tier" in back["detail"]
    assert back["cached_by_source"]["host"] > 0 and back["cached_tokens"] == 288


def test_other_namespaces_are_never_revealed_partial_page_and_below_min_cacheable():
    # hash: page-granular hits, so a shared head shorter than a page is never cached (radix would
    # hit it token by token)
    llm = pooled_llm(40, max_model_len=256, swap_space=0,
                     page_size=64, min_cacheable_tokens=128, prefix_cache="hash")
    a = prompt(4, 150)
    explained(llm, a, tenant="key:a")
    other = explained(llm, a, tenant="key:b")  # to B, A's prefix is cold: nothing about A
    assert other == explained(llm, prompt(40, 150), tenant="key:c")  # as a never-seen prompt's
    assert other["reason"] == "cold" and other["cached_tokens"] == 0
    salted = explained(llm, a, tenant="key:a", params=SamplingParams(max_tokens=2, ignore_eos=True,
                                                                      cache_salt="s"))
    assert salted["reason"] == "cold"
    # a shared head of 40 tokens, shorter than the 64-token page: never cacheable
    head = prompt(5, 40)
    explained(llm, head + prompt(6, 100))
    short = explained(llm, head + prompt(7, 100))
    assert short["reason"] == "partial_page" and short["diverged_at"] == 40
    retained = explained(llm, prompt(8, 100), leases=[CacheLease(100, 300.0)])
    assert retained["reason"] == "below_min_cacheable"


def test_full_hits_read_from_a_lease_are_counted_as_lease():
    llm = pooled_llm(40, max_model_len=256, swap_space=0, min_cacheable_tokens=64)
    a = prompt(9, 129)
    explained(llm, a, leases=[CacheLease(128, 300.0)])
    hit = explained(llm, a)
    assert hit["reason"] == "full_hit" and hit["cached_by_source"]["lease"] == 128
    assert hit["cached_by_source"]["pool"] == 0
    for lease_id in list(llm.engine.manager.leases.leases):
        llm.engine.release_lease("", lease_id)


def test_the_cache_report_finds_a_shared_span_placed_mid_prompt():
    """The `midprompt` mix: a per-request header, then a shared 200-token system text."""
    llm = pooled_llm(200, max_model_len=512, swap_space=0)
    shared = prompt(20, 200)
    for i in range(12):
        header = prompt(100 + i, 24)
        llm.generate({"prompt_token_ids": header + shared + prompt(200 + i, 8)}, PARAMS)
    report = llm.engine.cache_report()
    assert report["hit_rate"] < 0.3
    (span,) = [a for a in report["advice"] if a["kind"] == "mid_prompt_shared_text"]
    assert span["offset"] == 24 and span["length"] >= 200 and span["num_requests"] >= 10


def hit_rate_of_a_under_b_flood(share: str) -> float:
    llm = pooled_llm(48, max_model_len=256, swap_space=0, tenant_kv_share=share)
    working_set = [prompt(300 + i, 96) for i in range(3)]  # 18 of the 47 pages: tenant A (the default)
    one_token = SamplingParams(max_tokens=1)  # the prompt's pages are what is shared: no decode step
    hits = queries = 0
    for round_ in range(3):
        for i, tokens in enumerate(working_set):
            result = explained(llm, tokens, params=one_token)
            if round_:  # the first round is cold
                hits += result["cached_tokens"]
                queries += len(tokens) - 1
            for j in range(3):  # tenant B floods unique prompts: 30 pages between two A requests
                explained(llm, prompt(1000 + round_ * 100 + i * 10 + j, 150), tenant="key:b",
                          params=one_token)
    return hits / queries


def test_fair_shares_keep_a_tenants_working_set_through_anothers_flood():
    fair, unfair = hit_rate_of_a_under_b_flood("fair"), hit_rate_of_a_under_b_flood("off")
    assert fair >= 0.9 and unfair < fair, (fair, unfair)


def test_a_preemption_loop_ends_with_every_request_complete():
    # 6 requests of 2.5 + 3.75 pages in an 11-page pool, on pages of 8 (the run on pages of 16 with
    # every length doubled has the same page counts, preemptions (6) and guards (2) in twice the steps)
    llm = pooled_llm(12, max_model_len=56, swap_space=0, page_size=8, prefix_cache="off")
    llm.engine.scheduler.max_preemptions = 1  # (3 by default) so that this small run crosses it
    prompts = [{"prompt_token_ids": prompt(400 + i, 20)} for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_preemption_loop_guards"] >= 1
