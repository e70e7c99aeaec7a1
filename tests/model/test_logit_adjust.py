"""logit_bias, the repetition penalty and the presence/frequency penalties in the sampler: the batched
adjustment equals a per-row loop of vLLM's formula (transformers' processor for the repetition penalty),
rows without them are untouched, and greedy picks the adjusted argmax."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvserve.batch import ScheduledSeq
from kvserve.model.logit_adjust import adjusted_rows, apply_logit_adjustments
from kvserve.model.sampler import sample
from kvserve.sampling_params import SamplingParams


def seq(output: list[int] | None = None, prompt: tuple[int, ...] = (), **params) -> ScheduledSeq:
    p = SamplingParams(**params)
    context = [*prompt, *(output or [])]
    return ScheduledSeq("r", [0], 0, [1], True, p, len(output or []),
                        output_token_ids=list(output or []) if p.penalizes else None,
                        repetition_token_ids=p.repetition_tokens(context))


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


def test_repetition_penalty_equals_transformers_over_its_window():
    """vLLM's repetition penalty over the whole context (prompt and output) is transformers'
    RepetitionPenaltyLogitsProcessor over the sequence's ids; llama.cpp's last-N window is the same over
    the last N ids. Applied after logit_bias and before the frequency and presence penalties, as vLLM does."""
    from transformers import RepetitionPenaltyLogitsProcessor

    vocab, prompt = 60, (3, 5, 5, 8, 13, 21)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5)) * 3
    seqs = [seq([1, 2, 3], prompt, repetition_penalty=1.3),
            seq([40, 41], prompt, repetition_penalty=0.7, repetition_last_n=3),
            seq([8, 8, 50], prompt, repetition_penalty=2.0, repetition_last_n=0),  # a window of nothing: off
            seq([9], prompt, repetition_penalty=1.5, logit_bias={9: 4.0, 30: -1.0}, frequency_penalty=0.5)]
    windows = [[*prompt, 1, 2, 3], [21, 40, 41], [], [*prompt, 9]]
    got = logits.clone()
    apply_logit_adjustments(got, seqs, adjusted_rows(seqs))
    assert adjusted_rows(seqs) == [0, 1, 3]
    for row, (s, window) in enumerate(zip(seqs, windows)):
        want = logits[row:row + 1].clone()
        for token_id, bias in (s.sampling_params.logit_bias or {}).items():
            want[0, token_id] += bias
        if window:
            want = RepetitionPenaltyLogitsProcessor(s.sampling_params.repetition_penalty)(torch.tensor([window]), want)
        for token_id, count in Counter(s.output_token_ids or []).items():
            want[0, token_id] -= s.sampling_params.frequency_penalty * count
        assert torch.allclose(got[row], want[0], atol=1e-6), row


@pytest.mark.parametrize("params, message", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=11.0), "repetition_penalty"),
    (dict(repetition_last_n=-1), "repetition_last_n"),
    (dict(min_p=1.5), "min_p")])
def test_out_of_range_values_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)
