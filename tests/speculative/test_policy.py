"""SpecPolicy: drafts only for a request decoding one token at a time, within its limits and the spare
pages; k adapts to acceptance; counts are vLLM's."""

from __future__ import annotations

from kvserve.request import Request

from kvserve.sampling_params import SamplingParams
from kvserve.speculative_config import SpeculativeConfig
from kvserve.speculative.policy import COOLDOWN_STEPS, SpecPolicy

LOOP = [1, 2, 3, 4] * 4


def decoding(token_ids=LOOP, **params) -> Request:
    request = Request("r", token_ids[:8], SamplingParams(**{"max_tokens": 32, **params}))
    request.token_ids = list(token_ids)
    request.num_computed_tokens = len(token_ids) - 1
    return request


def tokens(policy: SpecPolicy, request: Request, *limits) -> list[int]:
    drafts = policy.drafts(request, *limits)
    return drafts.token_ids if drafts else []


def test_drafts_come_only_within_the_limits():
    policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=4), page_size=4)
    assert tokens(policy, decoding(), 100, 1000, 10) == [1, 2, 3, 4]
    assert tokens(policy, decoding(), 3, 1000, 10) == [1, 2]  # budget: the decode token + 2
    assert tokens(policy, decoding(max_tokens=10), 100, 1000, 10) == [1]  # 8 generated of 10
    assert tokens(policy, decoding(), 100, 18, 10) == [1]  # max_model_len
    assert tokens(policy, decoding(), 100, 1000, 0) == []  # position 16 starts a page: no spare one
    assert tokens(policy, decoding(LOOP[:14]), 100, 1000, 0) == [3, 4]  # the rest of page 3
    assert tokens(policy, decoding(stop=["x"]), 100, 1000, 10) == []  # stop strings need text
    prefill = decoding()
    prefill.num_computed_tokens -= 2
    assert tokens(policy, prefill, 100, 1000, 10) == []
    assert policy.wants_drafts(4) and not policy.wants_drafts(5)


def test_k_adapts_to_acceptance():
    policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=4), page_size=16)
    request = decoding()
    assert len(tokens(policy, request, 100, 1000, 10)) == 4
    policy.record(request, 4, 0)  # all rejected: k halves
    assert len(tokens(policy, request, 100, 1000, 10)) == 2
    policy.record(request, 2, 1)  # partly accepted: k stays
    assert len(tokens(policy, request, 100, 1000, 10)) == 2
    policy.record(request, 2, 0)
    assert len(tokens(policy, request, 100, 1000, 10)) == 1
    policy.record(request, 1, 0)  # k hit 0: a cooldown, then one token again
    assert all(tokens(policy, request, 100, 1000, 10) == [] for _ in range(COOLDOWN_STEPS))
    assert len(tokens(policy, request, 100, 1000, 10)) == 1
    policy.record(request, 1, 0)  # nothing accepted since: the next cooldown is twice as long
    assert all(tokens(policy, request, 100, 1000, 10) == [] for _ in range(2 * COOLDOWN_STEPS))
    assert len(tokens(policy, request, 100, 1000, 10)) == 1
    policy.record(request, 1, 1)
    assert len(tokens(policy, request, 100, 1000, 10)) == 2
    counts = request.spec_decode
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (6, 11, 2)
    assert policy.stats.accepted_per_pos == [2, 0, 0, 0]
