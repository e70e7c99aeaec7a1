"""Prompt lookup (vLLM's "ngram" proposer): the last n tokens of a request (n from prompt_lookup_max
down to prompt_lookup_min) are searched for in its earlier tokens; the tokens that followed the latest
earlier occurrence are the draft. Pure Python over token ids."""

from __future__ import annotations


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` draft tokens continuing `token_ids`, or [] when no suffix of length
    min_n..max_n occurred before. The latest occurrence wins (the most recent context)."""
    length = len(token_ids)
    if num_tokens < 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        first = suffix[0]
        # an occurrence starting at i must end before the suffix itself starts being the match
        for i in range(length - n - 1, -1, -1):
            if token_ids[i] == first and token_ids[i:i + n] == suffix:
                return token_ids[i + n:i + n + num_tokens]
    return []
