"""Verification of drafts: greedy keeps exactly the drafts that are the target's argmax, then the
target's own token; sampling keeps the target's distribution (the rejection rule for a point-mass
draft), checked by frequency over many draws."""

from __future__ import annotations

import torch

from kvserve.batch import ScheduledSeq
from kvserve.model.spec_verify import verify
from kvserve.sampling_params import SamplingParams


def seq(drafts: list[int], **params) -> ScheduledSeq:
    return ScheduledSeq("r", [0, *drafts], 10, [1], True, SamplingParams(**params), 3, draft_token_ids=drafts)


def test_greedy_keeps_the_matching_drafts_then_the_targets_token():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 1, 5]):
        logits[row, best] = 5.0
    assert [t.token_id for t in verify(logits, seq([2, 4, 0]))] == [2, 4, 1]  # third draft rejected
    assert [t.token_id for t in verify(logits, seq([2, 4, 1]))] == [2, 4, 1, 5]  # all + the bonus token
    assert [t.token_id for t in verify(logits, seq([3, 4, 1]))] == [2]
    with_logprobs = verify(logits, seq([2, 0, 1], logprobs=1))
    assert len(with_logprobs) == 2 and all(t.logprob is not None and len(t.top_logprobs) == 1 for t in with_logprobs)


def test_sampling_keeps_the_target_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(2, 1)  # [2, 4]: one draft row, one bonus row
    draws = 4000
    first = torch.zeros(4)
    num_accepted = 0
    for _ in range(draws):
        kept = verify(logits, seq([1], temperature=1.0))
        first[kept[0].token_id] += 1
        num_accepted += kept[0].token_id == 1 and len(kept) == 2
    assert torch.allclose(first / draws, probs, atol=0.03), first / draws
    assert abs(num_accepted / draws - 0.3) < 0.03  # draft 1 accepted with probability p(1)


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(3, 50)
    a = [t.token_id for t in verify(logits, seq([7, 8], temperature=0.8, seed=5))]
    b = [t.token_id for t in verify(logits, seq([7, 8], temperature=0.8, seed=5))]
    assert a == b
