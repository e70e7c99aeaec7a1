"""Diagnosis: spans of tokens repeated across requests at positions the prefix cache cannot see (a
per-request header before a shared system prompt), found by winnowed fingerprints. Used offline by
`kvserve simulate` and online by the server's cache report. Requests are anything with `token_ids`
and `namespace`."""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


_MOD, _BASE = (1 << 61) - 1, 1_000_003


def _winnow(tokens: list[int], k: int, w: int) -> list[tuple[int, int]]:
    """(hash, position) of the k-grams selected by winnowing: the rightmost minimum of every w
    consecutive k-gram hashes. Any span of >= w + k - 1 tokens that two sequences share yields a
    common selected k-gram in both (Schleimer et al. 2003)."""
    if len(tokens) < k:
        return []
    top = pow(_BASE, k - 1, _MOD)
    h = 0
    for t in tokens[:k]:
        h = (h * _BASE + t + 1) % _MOD
    hashes = [h]
    for p in range(k, len(tokens)):
        h = ((h - (tokens[p - k] + 1) * top) * _BASE + tokens[p] + 1) % _MOD
        hashes.append(h)
    picked, window, last = [], deque(), -1
    for j, h in enumerate(hashes):
        while window and hashes[window[-1]] >= h:
            window.pop()
        window.append(j)
        if window[0] <= j - w:
            window.popleft()
        if (j >= w - 1 or j == len(hashes) - 1) and window[0] != last:
            last = window[0]
            picked.append((hashes[last], last))
    return picked


@dataclass(slots=True)
class HiddenSpan:
    offset: int  # most common start position
    min_offset: int
    max_offset: int
    length: int
    num_requests: int  # requests where the span repeats but their cached prefix cannot reach it
    num_hidden_tokens: int
    starts: dict[int, int]  # request index -> start of the span there


def find_hidden_spans(requests: Sequence[Any], shared: list[int], min_length: int = 64,
                      min_requests: int | None = None, max_spans: int = 5) -> list[HiddenSpan]:
    """Spans of >= min_length tokens repeated in at least `min_requests` requests at a position their
    shared prefix does not reach (a per-request header before a shared system prompt). Winnowed
    fingerprints find candidates in O(total tokens); each is extended left and right while all its
    requests agree."""
    if min_requests is None:
        min_requests = max(2, math.ceil(0.05 * len(requests)))
    k = max(1, min_length // 2)
    w = max(1, min_length - k + 1)
    occurrences: dict[tuple[str, int], dict[int, int]] = {}
    for i, r in enumerate(requests):
        for h, pos in _winnow(r.token_ids, k, w):
            if pos > 0 and shared[i] < pos + k:  # the prefix cache cannot reach this k-gram here
                occurrences.setdefault((r.namespace, h), {}).setdefault(i, pos)
    spans: list[HiddenSpan] = []
    covered: dict[int, list[tuple[int, int]]] = {}
    for members in sorted((m for m in occurrences.values() if len(m) >= min_requests),
                          key=lambda m: (next(iter(m)), next(iter(m.values())))):
        if any(s <= pos < e for i, pos in members.items() for s, e in covered.get(i, ())):
            continue
        items = list(members.items())
        (i0, p0) = items[0]
        ref = requests[i0].token_ids
        left = min(p for _, p in items)
        for t in range(1, left + 1):
            if any(requests[i].token_ids[p - t] != ref[p0 - t] for i, p in items):
                left = t - 1
                break
        right = 0
        while all(p + right < len(requests[i].token_ids) and p0 + right < len(ref)
                  and requests[i].token_ids[p + right] == ref[p0 + right] for i, p in items):
            right += 1
        length = left + right
        if length < min_length:
            continue
        starts = {i: p - left for i, p in items}
        for i, s in starts.items():
            covered.setdefault(i, []).append((s, s + length))
        offset = Counter(starts.values()).most_common(1)[0][0]
        hidden = sum(min(length, s + length - max(shared[i], s)) for i, s in starts.items())
        spans.append(HiddenSpan(offset, min(starts.values()), max(starts.values()), length, len(starts),
                                hidden, starts))
    spans.sort(key=lambda s: -s.num_hidden_tokens)
    return spans[:max_spans]
