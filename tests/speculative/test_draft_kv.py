"""DraftKV, the draft model's pages: a request's draft K/V catches up under the per-step cap, drafts get
pages for the rows the draft writes, verification rolls rejected drafts' pages back, preemption and
finishing free them all; driven at random, the pool stays consistent and ends full."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.request import Request

from kvserve.sampling_params import SamplingParams
from kvserve.speculative_config import SpeculativeConfig
from kvserve.speculative.draft_kv import DraftKV
from kvserve.speculative.policy import SpecPolicy


def decoding(num_tokens: int, request_id: str = "r") -> Request:
    request = Request(request_id, list(range(3, 7)), SamplingParams(max_tokens=64))  # 4 prompt tokens
    request.token_ids = list(range(3, 3 + num_tokens))
    request.num_computed_tokens = num_tokens - 1
    return request


def test_a_new_request_computes_its_tokens_then_drafts():
    kv = DraftKV(num_pages=16, page_size=4, max_catch_up=64)
    request = decoding(10)
    work = kv.plan(request, 3)
    assert (work.token_ids, work.start_pos, work.num_drafts) == (request.token_ids, 0, 3)
    assert len(work.block_table) == 3  # positions 0..11: the 10 tokens and the first 2 drafts
    kv.verified("r", work, 1)  # 1 accepted: the K/V of tokens 0..10 counts
    kv.check_invariants()
    request.token_ids += [20, 21]  # the accepted draft and the target's correction
    work = kv.plan(request, 2)
    assert (work.token_ids, work.start_pos) == ([21], 11) and len(work.block_table) == 4
    kv.verified("r", work, 0)  # all rejected: only the correction's K/V counts; page 3 goes back
    assert kv.num_used == 3
    kv.free("r")
    assert kv.num_used == 0
    kv.check_invariants()


def test_catch_up_is_capped_per_step_and_proposes_only_when_done():
    kv = DraftKV(num_pages=16, page_size=4, max_catch_up=8)
    request = decoding(20)
    assert not kv.caught_up(request)
    work = kv.plan(request, 3)
    assert (work.start_pos, len(work.token_ids), work.num_drafts) == (0, 8, 0)
    kv.verified("r", work, 0)
    work = kv.plan(request, 3)
    assert (work.start_pos, len(work.token_ids), work.num_drafts) == (8, 8, 0)
    kv.verified("r", work, 0)
    assert kv.caught_up(request)
    work = kv.plan(request, 3)
    assert (work.start_pos, len(work.token_ids), work.num_drafts) == (16, 4, 3)
    kv.free("r")


def test_the_policy_gives_a_draft_model_drafts_only_where_its_pages_fit():
    cfg = SpeculativeConfig(method="draft_model", model="draft.gguf", num_speculative_tokens=4)
    policy = SpecPolicy(cfg, page_size=4, num_pages=4, max_catch_up=64)  # 3 usable draft pages
    request = decoding(8)
    drafts = policy.drafts(request, 100, 1000, 10)
    assert (drafts.num_tokens, drafts.token_ids) == (4, [])  # 8 tokens + 3 drafts written: 3 pages
    work = policy.start(request, drafts).work
    assert work.num_drafts == 4 and len(work.block_table) == 3
    other = decoding(8, "s")  # no draft page left for another request: no drafts, no catch-up
    assert policy.drafts(other, 100, 1000, 10) is None
    policy.preempted("r")
    assert policy.draft_kv.num_used == 0
    assert policy.drafts(other, 100, 1000, 10).num_tokens == 4
    policy.forget("s")
    policy.draft_kv.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 4), st.integers(0, 4)),
                max_size=40))
def test_random_steps_keep_the_draft_pool_consistent(ops):
    """ops: (request, action: 0-1 step, 2 preempt, 3 finish, k drafts, accepted)."""
    kv = DraftKV(num_pages=12, page_size=4, max_catch_up=6)
    requests = {i: decoding(5, f"r{i}") for i in range(3)}
    for which, action, k, accepted in ops:
        request = requests[which]
        if action <= 1:
            k = k if kv.caught_up(request) and kv.fits(request, k) else 0
            work = kv.plan(request, k)
            if work is None:
                continue
            assert work.start_pos + len(work.token_ids) <= request.num_tokens
            kept = min(accepted, k)
            kv.verified(request.request_id, work, kept)
            request.token_ids += [7] * (kept + 1)  # the target kept `kept` drafts and one token more
        elif action == 2:
            kv.free(request.request_id)
        else:
            kv.free(request.request_id)
            requests[which] = decoding(5, request.request_id)
        kv.check_invariants()
    for request in requests.values():
        kv.free(request.request_id)
    assert kv.num_used == 0
    kv.check_invariants()
