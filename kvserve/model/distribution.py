"""The distribution a sampled row draws from (temperature, then min-p, then top-k and top-p, in vLLM's order;
or llama.cpp's, the temperature last) and the draw itself: one uniform number per row, from the request's seed
and output position when it has a seed, inverted through the row's cumulative distribution. The sampler and
speculative verification both draw here, so a seeded request gets the same token from either.

Every reduction runs over a whole row of the vocabulary, alone, so a row's distribution and draw do not depend
on its batch neighbours. Top-k and top-p read the few most likely tokens by `topk`, not a sort of the
vocabulary (3.6 ms a row over SmolLM2's 49,152 logits, Zen 4); a row whose nucleus is not within them falls
back to the sort.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads consecutive token counts over the seed space
CANDIDATES = 64  # tokens read by topk for top-k / top-p before falling back to a full sort


def _generator(seed: int, num_output_tokens: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * _MIX + num_output_tokens) % (1 << 64))
    return g


def uniforms(params: Sequence[SamplingParams], positions: Sequence[int], device: torch.device) -> torch.Tensor:
    """One number in [0, 1) per row [R]: a seeded row's depends only on (seed, output position), so a
    recompute after preemption, or verification of a draft, draws the same token; the others are fresh."""
    out = torch.rand(len(params), device=device)
    for r, (p, position) in enumerate(zip(params, positions)):
        if p.seed is not None:
            out[r] = torch.rand(1, generator=_generator(p.seed, position, device), device=device)[0]
    return out


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (each row summing to 1, up to rounding), u [R] in [0, 1) -> the token of each row [R]
    whose cumulative probability first passes u (a token of probability 0 is never drawn)."""
    cdf = probs.cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].contiguous(), right=True)[:, 0]
    return chosen.clamp_max(probs.shape[-1] - 1)


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [R, V] of rows with temperature > 0 -> the distribution each row samples from [R, V]. vLLM's
    order: the temperature, then min-p, top-k and top-p. A row with `temperature_last` takes llama.cpp's:
    top-k, top-p and min-p on the untempered distribution, then the tokens they keep at its temperature."""
    device = logits.device
    last = [p.temperature_last and p.temperature != 1.0 and p.filters for p in params]  # (else the same as vLLM's)
    temps = torch.tensor([1.0 if at_end else p.temperature for p, at_end in zip(params, last)], device=device,
                         dtype=logits.dtype)
    probs = (logits / temps[:, None]).softmax(dim=-1)  # [R, V]
    probs = _min_p(probs, [0.0 if at_end else p.min_p for p, at_end in zip(params, last)])
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        probs = probs.masked_fill(probs < _cutoffs(probs, params), 0.0)
    probs = _min_p(probs, [p.min_p if at_end else 0.0 for p, at_end in zip(params, last)])
    tempered = [r for r in range(len(params)) if last[r]]
    if tempered:  # the kept tokens (a probability of 0 at temperature 1 is one a filter took) at the row's temperature
        idx = torch.tensor(tempered, device=device)
        temps = torch.tensor([params[r].temperature for r in tempered], device=device, dtype=logits.dtype)
        kept = (logits.index_select(0, idx) / temps[:, None]).softmax(dim=-1)
        probs = probs.index_copy(0, idx, kept.masked_fill(probs.index_select(0, idx) == 0.0, 0.0))
    return probs / _totals(probs)


def _min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Each row's tokens under min_p x its most likely token's probability are out (a row at 0: none)."""
    if not any(m > 0.0 for m in min_p):
        return probs
    threshold = torch.tensor(min_p, device=probs.device, dtype=probs.dtype)[:, None]
    return probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * threshold, 0.0)


def _totals(probs: torch.Tensor) -> torch.Tensor:
    """Each row's sum [R, 1], as a sequential scan: a reduction that torch might split across threads for
    one row but not for many would make a row's bits depend on its neighbours."""
    return probs.cumsum(dim=-1)[:, -1:]


def _cutoffs(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The probability under which each row's tokens are out [R, 1]: its k-th largest (top-k), or higher,
    where the nucleus of mass top_p (among the tokens top-k kept) ends. Ties at either boundary are kept,
    as transformers' warpers keep them."""
    vocab, device = probs.shape[-1], probs.device
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    width = min(vocab, max([CANDIDATES, *(k for k in top_k if k < vocab)]))
    values = probs.topk(width, dim=-1).values  # [R, width], each row descending
    at = torch.tensor([min(k, width) - 1 for k in top_k], device=device)[:, None]
    has_k = torch.tensor([k < vocab for k in top_k], device=device)[:, None]
    kth = torch.where(has_k, values.gather(1, at), 0.0)  # [R, 1]
    nucleus = [r for r, p in enumerate(params) if p.top_p < 1.0]
    if not nucleus:
        return kth
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)[:, None]
    total = _totals(probs.masked_fill(probs < kth, 0.0))  # [R, 1]: the mass top-k kept
    ordered = values.masked_fill(values < kth, 0.0)
    before = ordered.cumsum(dim=-1) - ordered  # mass strictly above each candidate
    keep = before < top_p * total
    keep[:, 0] = True  # the most likely token is always kept
    cutoff = ordered.masked_fill(~keep, float("inf")).min(dim=-1, keepdim=True).values
    for r in nucleus:  # a nucleus that may go on past the candidates: read 16 times more, up to the row
        if width < vocab and bool(keep[r, -1]) and float(ordered[r, -1]) > 0.0:
            row = probs[r].masked_fill(probs[r] < kth[r], 0.0)
            cutoff[r] = _nucleus_end(row, top_p[r] * total[r], min(width * 16, vocab))
    return torch.where(top_p < 1.0, torch.maximum(cutoff, kth), kth)


def _nucleus_end(row: torch.Tensor, mass: torch.Tensor, width: int) -> torch.Tensor:
    """The smallest probability in `row`'s nucleus (the fewest largest tokens whose mass reaches `mass`),
    reading its `width` largest, then 16 times more until the nucleus ends within them."""
    vocab = row.shape[-1]
    while True:
        ordered = row.topk(width).values if width < vocab else row.sort(descending=True).values
        keep = ordered.cumsum(dim=0) - ordered < mass
        keep[0] = True
        if width == vocab or not bool(keep[-1]) or float(ordered[-1]) == 0.0:
            return ordered[keep].min()
        width = min(width * 16, vocab)
