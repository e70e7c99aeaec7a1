"""Structured outputs in the sampler: the rows whose sequence has a grammar get its allowed-token
bitmask applied to their logits, in one batched operation; rows without one are not touched, and a
batch without grammars costs one scan of the rows.

    bitmask  int32 [R, ceil(V / 32)]: bit t % 32 of word t // 32 set = token t allowed
    bias     float32 [R, V]: 0 where allowed, -inf elsewhere (a 256-entry byte table, no bit loop)
    logits[rows] += bias
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvserve.batch import ScheduledSeq

# byte value -> its 8 bits (little end first) as additive biases: 0 allowed, -inf not
_BYTE_BIAS = np.array([[0.0 if (b >> k) & 1 else -np.inf for k in range(8)] for b in range(256)],
                      dtype=np.float32)


def grammar_rows(seqs: Sequence[ScheduledSeq]) -> list[int]:
    return [i for i, s in enumerate(seqs) if s.grammar is not None]


def apply_grammar_masks(logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]) -> None:
    """logits [N, V] float, one row per seq; masks the given rows in place by their grammars."""
    vocab = logits.shape[-1]
    num_words = (vocab + 31) // 32
    bitmask = np.zeros((len(rows), num_words), np.int32)  # [R, W]
    for r, i in enumerate(rows):
        seqs[i].grammar.fill_bitmask(bitmask, r)
    bias = np.take(_BYTE_BIAS, bitmask.view(np.uint8), axis=0).reshape(len(rows), -1)[:, :vocab]  # [R, V]
    bias_t = torch.from_numpy(bias).to(device=logits.device, dtype=logits.dtype)
    if len(rows) == logits.shape[0]:
        logits.add_(bias_t)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), bias_t)
