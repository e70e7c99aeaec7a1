"""Speculative decoding's verification, inside the target's normal step: one sequence's k draft tokens
against the logits of its last k + 1 rows (row j predicts the token after the decode token and the
first j drafts). Greedy keeps a draft while it is the target's argmax, so the tokens are exactly those
of decoding one at a time. Sampling uses the standard rejection rule for a point-mass draft (n-gram
proposals): keep draft d with probability p(d), else draw from p with d removed (the residual
max(p - q, 0) renormalized), so the output distribution is the target's own."""

from __future__ import annotations

import torch

from kvserve.batch import SampledToken, ScheduledSeq
from kvserve.model.distribution import draw, target_probs, uniforms
from kvserve.model.sampler import add_logprobs, greedy


def verify(logits: torch.Tensor, seq: ScheduledSeq) -> list[SampledToken]:
    """logits [k + 1, V] float32 for `seq`'s last k + 1 rows -> the tokens it keeps: the accepted
    drafts, then one more (the target's correction, or the bonus token when all k were accepted)."""
    drafts, params = seq.draft_token_ids, seq.sampling_params
    k = len(drafts)
    if params.temperature == 0:
        chosen = greedy(logits)  # [k + 1], as sampler.sample picks a greedy row
        picks = chosen.tolist()
        n = 0
        while n < k and picks[n] == drafts[n]:
            n += 1
        chosen = chosen[:n + 1]
    elif params.seed is not None:
        chosen = torch.tensor(_seeded_draws(logits, seq), device=logits.device)
    else:
        chosen = torch.tensor(_rejection_sample(logits, seq), device=logits.device)
    out = [SampledToken(t) for t in chosen.tolist()]
    add_logprobs(out, logits[:len(out)], chosen, [params] * len(out))
    return out


def _seeded_draws(logits: torch.Tensor, seq: ScheduledSeq) -> list[int]:
    """Row j's token is the seed's draw for output token num_output_tokens + j; drafts are kept while
    they match it."""
    drafts, params = seq.draft_token_ids, seq.sampling_params
    probs = target_probs(logits, [params] * logits.shape[0])  # [k + 1, V]
    kept: list[int] = []
    for j in range(len(drafts) + 1):
        token = int(draw(probs[j:j + 1], uniforms([params], [seq.num_output_tokens + j], logits.device))[0])
        kept.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return kept


def _rejection_sample(logits: torch.Tensor, seq: ScheduledSeq) -> list[int]:
    """The rejection rule, for a request without a seed (its draws need not be reproducible)."""
    drafts, params = seq.draft_token_ids, seq.sampling_params
    probs = target_probs(logits, [params] * logits.shape[0])  # [k + 1, V]
    kept: list[int] = []
    for j in range(len(drafts) + 1):
        if j == len(drafts):
            kept.append(int(torch.multinomial(probs[j], 1)))
            break
        d = drafts[j]
        if float(torch.rand((), device=logits.device)) < float(probs[j, d]):
            kept.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0  # p(d) < 1 here, so some mass is left
        kept.append(int(torch.multinomial(residual, 1)))
        break
    return kept
