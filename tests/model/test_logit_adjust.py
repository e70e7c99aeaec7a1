"""logit_bias and the presence/frequency penalties in the sampler: the batched adjustment equals a
per-row loop of vLLM's formula, rows without them are untouched, and greedy picks the adjusted argmax."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvserve.batch import ScheduledSeq
from kvserve.model.logit_adjust import adjusted_rows, apply_logit_adjustments
from kvserve.model.sampler import sample
from kvserve.request import SamplingParams


def seq(output: list[int] | None = None, **params) -> ScheduledSeq:
    p = SamplingParams(**params)
    return ScheduledSeq("r", [0], 0, [1], True, p, len(output or []),
                        output_token_ids=list(output or []) if p.penalizes else None)


def reference(row: list[float], s: ScheduledSeq) -> list[float]:
    """One row by the definition, token by token."""
    p, out = s.sampling_params, list(row)
    for token_id, bias in (p.logit_bias or {}).items():
        out[token_id] += bias
    for token_id, count in Counter(s.output_token_ids or []).items():
        out[token_id] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_batched_adjustments_equal_the_per_row_definition():
    vocab = 50
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)) * 3
    seqs = [seq(),  # untouched
            seq([4, 4, 9], frequency_penalty=0.7),
            seq([1, 2, 2, 2], presence_penalty=1.5, frequency_penalty=-0.3, logit_bias={2: 5.0, 7: -100.0}),
            seq(logit_bias={0: 3.0, 49: -2.5}),
            seq([], frequency_penalty=2.0)]  # no output yet: nothing to count
    want = [reference(row, s) for row, s in zip(logits.tolist(), seqs)]
    got = logits.clone()
    apply_logit_adjustments(got, seqs, adjusted_rows(seqs))
    assert adjusted_rows(seqs) == [1, 2, 3, 4]
    assert torch.allclose(got, torch.tensor(want), atol=1e-5)
    assert torch.equal(got[0], logits[0])


def test_greedy_follows_the_adjusted_logits():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    assert sample(logits.clone(), [seq()])[0].token_id == 0
    assert sample(logits.clone(), [seq(logit_bias={0: -100.0})])[0].token_id == 1  # banned
    assert sample(logits.clone(), [seq([0, 0], frequency_penalty=1.0)])[0].token_id == 1  # 5 - 2 < 4
    assert sample(logits.clone(), [seq([0, 0], frequency_penalty=0.4)])[0].token_id == 0  # 5 - 0.8 > 4
    assert sample(logits.clone(), [seq([0], presence_penalty=1.5)])[0].token_id == 1


@pytest.mark.parametrize("params, message", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias")])
def test_out_of_range_values_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)
