"""Sampling: greedy is argmax, seeded draws are reproducible and depend only on (seed, position),
top-k / top-p / min-p restrict the support, logprobs are log-softmax of the raw logits."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.batch import ScheduledSeq
from kvserve.model.distribution import CANDIDATES, target_probs
from kvserve.model.sampler import greedy, sample
from kvserve.sampling_params import SamplingParams


def seq(num_output_tokens: int = 0, **params) -> ScheduledSeq:
    return ScheduledSeq("r", [0], 0, [1], True, SamplingParams(**params), num_output_tokens)


def logits_rows(n: int = 4, vocab: int = 100, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = logits_rows()
    got = [t.token_id for t in sample(logits, [seq() for _ in range(4)])]
    assert got == logits.argmax(-1).tolist()
    assert all(t.logprob is None and t.top_logprobs is None for t in sample(logits, [seq()] * 4))


# logits where the first-of-ties and NaN rules decide: few distinct values, infinities, NaNs, signed zeros
special_logits = st.lists(st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.0, float("inf"), float("-inf"), float("nan")]),
                                   min_size=1, max_size=40), min_size=1, max_size=4).filter(
    lambda rows: len({len(r) for r in rows}) == 1)


@settings(max_examples=300, deadline=None)
@given(special_logits)
def test_greedy_picks_what_torchs_argmax_picks(rows):
    """The CPU's numpy argmax is torch's to the index: the first of ties, a NaN as the largest."""
    logits = torch.tensor(rows, dtype=torch.float32)
    assert greedy(logits).tolist() == logits.argmax(-1).tolist()
    assert greedy(logits[:, ::2]).tolist() == logits[:, ::2].argmax(-1).tolist()  # a strided view too


def test_seeded_sampling_is_reproducible_and_stateless():
    logits = logits_rows(1, 1000)
    draws = lambda n_out: [sample(logits, [seq(temperature=1.0, seed=7, num_output_tokens=n_out)])[0].token_id
                           for _ in range(3)]
    first = draws(5)
    torch.rand(10)  # global RNG use in between must not matter
    assert draws(5) == first and len(set(first)) == 1
    # a different position or seed gives (for a flat distribution, almost surely) another token
    flat = torch.zeros(1, 1000)
    tokens = {sample(flat, [seq(temperature=1.0, seed=7, num_output_tokens=i)])[0].token_id for i in range(20)}
    assert len(tokens) > 10
    # the same seed in a batch, next to other rows, gives the same token
    batch = torch.cat([logits_rows(3, 1000, seed=1), logits])
    mixed = sample(batch, [seq(), seq(temperature=0.7), seq(temperature=1.0, seed=3),
                           seq(temperature=1.0, seed=7, num_output_tokens=5)])
    assert mixed[3].token_id == first[0]


def test_top_k_one_equals_greedy():
    logits = logits_rows(8, 500)
    seqs = [seq(temperature=1.5, top_k=1, seed=i) for i in range(8)]
    assert [t.token_id for t in sample(logits, seqs)] == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0, -2.0]])
    top3 = {sample(logits, [seq(temperature=5.0, top_k=3, seed=i)])[0].token_id for i in range(200)}
    assert top3 == {0, 1, 2}
    probs = logits.softmax(-1)[0]  # ~[0.66, 0.24, 0.09, ...]: top_p 0.8 keeps the first two
    assert probs[0] < 0.8 < probs[0] + probs[1]
    top_p = {sample(logits, [seq(temperature=1.0, top_p=0.8, seed=i)])[0].token_id for i in range(200)}
    assert top_p == {0, 1}


def test_min_p_keeps_what_transformers_min_p_keeps_after_temperature():
    """vLLM's min-p (tokens under min_p x the top token's probability, after temperature, are out): the
    distribution equals transformers' temperature then MinPLogitsWarper, row by row, each row its own
    min_p; min_p 0 leaves the row alone, and greedy ignores it."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = logits_rows(4, 300, seed=7)
    params = [SamplingParams(temperature=t, min_p=m) for t, m in ((0.7, 0.1), (1.3, 0.02), (1.0, 0.0), (2.0, 0.5))]
    got = target_probs(logits.clone(), params)
    for row, p in enumerate(params):
        scores = TemperatureLogitsWarper(p.temperature)(None, logits[row:row + 1].clone())
        if p.min_p > 0:
            scores = MinPLogitsWarper(p.min_p)(None, scores)
        want = scores.softmax(-1)[0]
        assert torch.equal(got[row] > 0, want > 0) and torch.allclose(got[row], want, atol=1e-6)
    assert 0 < int((got[0] > 0).sum()) < 300 and int((got[2] > 0).sum()) == 300
    seqs = [seq(min_p=0.9), seq(temperature=0.0, min_p=1.0)]
    assert [t.token_id for t in sample(logits[:2].clone(), seqs)] == logits[:2].argmax(-1).tolist()


def test_top_k_top_p_min_p_equal_transformers_warpers_in_vllms_order():
    """The distribution a row samples from: transformers' temperature, min-p, top-k and top-p warpers applied
    in vLLM's order, for rows of different settings side by side; a flat row whose nucleus runs past the
    candidates topk reads takes the full sort, and a row alone gets the same numbers as among others."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    vocab = 49_152
    logits = logits_rows(7, vocab, seed=11)
    logits[5] = torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * 0.05  # nearly flat
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9),  # Ollama's defaults
              SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # llama.cpp's
              SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.3, top_k=3),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.99),  # past CANDIDATES: 16 times more, then the sort
              SamplingParams(temperature=1.0, top_k=100, top_p=0.8)]  # the others read 100 candidates
    got = target_probs(logits.clone(), params)
    for row, p in enumerate(params):
        scores = TemperatureLogitsWarper(p.temperature)(None, logits[row:row + 1].clone())
        if p.min_p > 0:
            scores = MinPLogitsWarper(p.min_p)(None, scores)
        if p.top_k > 0:
            scores = TopKLogitsWarper(p.top_k)(None, scores)
        if p.top_p < 1.0:
            scores = TopPLogitsWarper(p.top_p)(None, scores)
        want = scores.softmax(-1)[0]
        assert torch.equal(got[row] > 0, want > 0), row
        assert torch.allclose(got[row], want, atol=1e-6), row
        assert torch.equal(target_probs(logits[row:row + 1].clone(), [p])[0], got[row]), row
    assert int((got[5] > 0).sum()) > CANDIDATES


def test_temperature_last_equals_transformers_warpers_in_llama_cpps_order():
    """temperature_last: transformers' top-k, top-p and min-p warpers on the raw logits, then the temperature
    (llama.cpp's default chain), for rows beside vLLM-order rows of the same settings, which differ; a row
    alone gets the same numbers as among others."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = logits_rows(6, 49_152, seed=5)
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, temperature_last=True),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
              SamplingParams(temperature=1.5, top_p=0.9, temperature_last=True),
              SamplingParams(temperature=1.5, min_p=0.1, temperature_last=True),
              SamplingParams(temperature=0.7, temperature_last=True),  # no filter: the same in either order
              SamplingParams(temperature=2.0, top_k=5, temperature_last=True)]
    got = target_probs(logits.clone(), params)
    for row, p in enumerate(params):
        scores = logits[row:row + 1].clone()
        if p.temperature_last:
            if p.top_k > 0:
                scores = TopKLogitsWarper(p.top_k)(None, scores)
            if p.top_p < 1.0:
                scores = TopPLogitsWarper(p.top_p)(None, scores)
            if p.min_p > 0:
                scores = MinPLogitsWarper(p.min_p)(None, scores)
            want = TemperatureLogitsWarper(p.temperature)(None, scores).softmax(-1)[0]
            assert torch.equal(got[row] > 0, want > 0), row
            assert torch.allclose(got[row], want, atol=1e-6), row
        assert torch.equal(target_probs(logits[row:row + 1].clone(), [p])[0], got[row]), row
    vllms = target_probs(logits[2:3].clone(), [SamplingParams(temperature=1.5, top_p=0.9)])[0]
    assert int((vllms > 0).sum()) > int((got[2] > 0).sum())  # the nucleus of the flatter distribution is wider
    assert torch.equal(got[4], target_probs(logits[4:5].clone(), [SamplingParams(temperature=0.7)])[0])


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = [0, 0, 0]
    for i in range(600):
        counts[sample(logits, [seq(temperature=1.0, seed=i)])[0].token_id] += 1
    assert 360 < counts[0] < 480 and 70 < counts[1] < 170 and counts[2] < 110


def test_logprobs():
    logits = logits_rows(3, 200)
    out = sample(logits, [seq(logprobs=5), seq(), seq(temperature=0.9, seed=1, logprobs=0)])
    logp = torch.log_softmax(logits, -1)
    assert math.isclose(out[0].logprob, logp[0, out[0].token_id].item(), rel_tol=1e-6)
    assert len(out[0].top_logprobs) == 5
    assert list(out[0].top_logprobs) == logp[0].topk(5).indices.tolist()
    assert out[0].top_logprobs[out[0].token_id] == out[0].logprob  # greedy pick is the top one
    assert sum(math.exp(v) for v in out[0].top_logprobs.values()) <= 1.0 + 1e-6
    assert math.isclose(sum(math.exp(v) for v in logp[0].tolist()), 1.0, rel_tol=1e-5)
    assert out[1].logprob is None and out[2].top_logprobs == {}
    assert out[2].logprob <= 0.0


def test_a_row_samples_the_same_alone_and_among_others():
    """Batch neighbours never change a row's token or logprobs, bit for bit, whatever they ask for
    (greedy or seeded, no logprobs or more of them), with 1 or 2 threads."""
    logits = logits_rows(6, 49152, seed=3)
    seqs = [seq(logprobs=0), seq(), seq(logprobs=5), seq(temperature=0.8, seed=1, logprobs=2),
            seq(logprobs=20), seq(temperature=1.0, seed=2, top_k=50, top_p=0.9)]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            together = sample(logits, seqs)
            alone = [sample(logits[i:i + 1], [s])[0] for i, s in enumerate(seqs)]
            assert [(t.token_id, t.logprob, t.top_logprobs) for t in together] == \
                   [(t.token_id, t.logprob, t.top_logprobs) for t in alone]
    finally:
        torch.set_num_threads(threads)
