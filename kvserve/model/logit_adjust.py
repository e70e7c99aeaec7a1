"""logit_bias, the repetition penalty and the presence/frequency penalties, applied in place to the rows of
a step's logits that ask for them, batched as the grammar mask is: one scatter for every row's bias, one
gather and scatter for every row's repeated tokens, one count of every row's output tokens. vLLM's
definitions (OpenAI's for the bias and the two penalties): the bias is added first; then each token of the
repetition penalty's context (the prompt and output, or their last N tokens) has a positive logit divided
by the penalty and a negative one multiplied; then `logit - frequency_penalty * count - presence_penalty *
(count > 0)` over the tokens generated so far. Last, the ids a row may not take are masked (under
`min_tokens` those that would end it, the last token of a bad word: token_bans.py), and with
`allowed_token_ids` every other id. A masked logit is minus infinity, so the order of the masks and the
additions does not matter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.batch import ScheduledSeq


def adjusted_rows(seqs: Sequence[ScheduledSeq]) -> list[int]:
    return [i for i, s in enumerate(seqs) if s.sampling_params.adjusts_logits]


def apply_logit_adjustments(logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]) -> None:
    """logits [N, V] float32, changed in place in `rows` (indices into seqs)."""
    _add_bias(logits, seqs, rows)
    _repeat(logits, seqs, [i for i in rows if seqs[i].repetition_token_ids])
    _penalize(logits, seqs, [i for i in rows if seqs[i].sampling_params.penalizes])
    _mask(logits, seqs, rows)
    _allow(logits, seqs, [i for i in rows if seqs[i].sampling_params.allowed_token_ids is not None])


def _add_bias(logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]) -> None:
    row_ids, token_ids, biases = [], [], []
    for i in rows:
        for token_id, bias in (seqs[i].sampling_params.logit_bias or {}).items():
            row_ids.append(i)
            token_ids.append(token_id)
            biases.append(bias)
    if not row_ids:
        return
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    logits.index_put_(index, torch.tensor(biases, device=device, dtype=logits.dtype), accumulate=True)


def _repeat(logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]) -> None:
    row_ids, token_ids, penalties = [], [], []
    for i in rows:
        tokens = sorted(set(seqs[i].repetition_token_ids or ()))  # (each token once: one write per entry)
        row_ids += [i] * len(tokens)
        token_ids += tokens
        penalties += [seqs[i].sampling_params.repetition_penalty] * len(tokens)
    if not row_ids:
        return
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    penalty = torch.tensor(penalties, device=device, dtype=logits.dtype)
    values = logits[index]
    logits[index] = torch.where(values > 0, values / penalty, values * penalty)


def _penalize(logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]) -> None:
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    outputs = [seqs[i].output_token_ids or [] for i in rows]
    width = max((len(o) for o in outputs), default=0)
    if width == 0:
        return
    # pad with an extra column `vocab`, dropped after counting
    padded = torch.tensor([o + [vocab] * (width - len(o)) for o in outputs], device=device)  # [P, W]
    counts = torch.zeros(len(rows), vocab + 1, device=device, dtype=logits.dtype)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))
    counts = counts[:, :vocab]  # [P, V]
    params = [seqs[i].sampling_params for i in rows]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=logits.dtype)
    presence = torch.tensor([p.presence_penalty for p in params], device=device, dtype=logits.dtype)
    index = torch.tensor(rows, device=device)
    penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0).to(logits.dtype)
    logits.index_copy_(0, index, logits.index_select(0, index) - penalty)


def _mask(logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]) -> None:
    """The ids a row may not take next (ScheduledSeq.masked_token_ids) can never be chosen."""
    pairs = [(i, t) for i in rows for t in seqs[i].masked_token_ids or () if t < logits.shape[-1]]
    if pairs:
        rows_, tokens = zip(*pairs)
        index = (torch.tensor(rows_, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits[index] = float("-inf")


def _allow(logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]) -> None:
    """allowed_token_ids: every other id of the row is masked."""
    for i in rows:
        allowed = torch.tensor([t for t in seqs[i].sampling_params.allowed_token_ids if t < logits.shape[-1]],
                               device=logits.device, dtype=torch.long)
        kept = logits[i, allowed]
        logits[i] = float("-inf")
        logits[i, allowed] = kept
