"""token_bans.py: the tokens that would complete a bad word are exactly those banned, the masks never leave an
allowed_token_ids row without a token, and bad words tokenize by vLLM's rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvserve.token_bans import bad_words_token_ids, completed_by, masked_ids

TOKENS = st.integers(0, 5)  # a small alphabet, so that outputs end with the words' heads often
WORDS = st.lists(st.lists(TOKENS, min_size=1, max_size=4).map(tuple), max_size=5).map(tuple)


@given(output=st.lists(TOKENS, max_size=8), sequences=WORDS)
def test_a_token_is_banned_exactly_where_it_would_complete_a_bad_word(output, sequences):
    banned = completed_by(output, sequences)
    for token in range(6):
        after = output + [token]
        completes = any(len(s) <= len(after) and tuple(after[-len(s):]) == s for s in sequences)
        assert (token in banned) == completes, (token, after)


@given(endings=st.sets(TOKENS), word_bans=st.sets(TOKENS), allowed=st.none() | st.lists(TOKENS, min_size=1))
def test_the_masks_leave_an_allowed_token_and_lift_the_words_first(endings, word_bans, allowed):
    masked = set(masked_ids(endings, word_bans, allowed) or ())
    if allowed is None:
        assert masked == endings | word_bans
        return
    assert set(allowed) - masked  # some allowed token can be taken
    if set(allowed) - (endings | word_bans):
        assert masked == endings | word_bans
    elif set(allowed) - endings:
        assert masked == endings  # the words' bans lifted, min_tokens' held
    else:
        assert not masked


def test_bad_words_tokenize_as_written_and_after_a_space():
    from kvserve.model.gguf_loader import bundled_model_path, load_gguf

    tokenizer = load_gguf(bundled_model_path()).tokenizer
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    monday, spaced_monday = encode("Monday"), encode(" Monday")
    assert len(monday) == len(spaced_monday) == 1 and monday != spaced_monday
    assert bad_words_token_ids(["  Monday"], encode) == (tuple(monday), tuple(spaced_monday))
    # a spaced form of another length is left out (vLLM's rule)
    assert len(encode("xylophone")) != len(encode(" xylophone"))
    assert bad_words_token_ids(["xylophone"], encode) == (tuple(encode("xylophone")),)
    assert len(bad_words_token_ids(["quokka"], encode)) == 2  # three tokens each way, the first differs
