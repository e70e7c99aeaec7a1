"""Prompt lookup: the continuation of the latest earlier occurrence of the longest matching suffix."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvserve.speculative.ngram import propose_ngram


def test_the_latest_occurrence_of_the_longest_suffix_is_continued():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, 2, 2, 3) == [7, 8]  # [1, 2, 3] last seen before 7, 8
    assert propose_ngram([4, 2, 3, 6, 1, 2, 3], 3, 2, 3) == [6, 1, 2]  # only [2, 3] matches


def test_no_match_or_no_room_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], 4, 2, 3) == []
    assert propose_ngram([1, 2, 1, 2], 0, 2, 3) == []
    assert propose_ngram([5, 5], 3, 2, 3) == []  # the suffix itself is not an earlier occurrence


@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2))
def test_a_draft_follows_an_earlier_copy_of_a_suffix(tokens, k, low, extra):
    draft = propose_ngram(tokens, k, low, low + extra)
    assert len(draft) <= k
    if draft:
        n = next(n for n in range(low + extra, low - 1, -1) if any(
            tokens[i:i + n] == tokens[len(tokens) - n:] and tokens[i + n:i + n + len(draft)] == draft
            for i in range(len(tokens) - n)))
        assert n >= low
