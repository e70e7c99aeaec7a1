"""Streaming text: the deltas joined equal the final text, a multi-byte character split across
tokens is never sent half-decoded (no U+FFFD), and text that may start a stop string is held back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvserve.server.text_delta import TextDelta


def stream(deltas: TextDelta, texts: list[str], final: str) -> list[str]:
    sent = [deltas.update(t, finished=False) for t in texts]
    sent.append(deltas.update(final, finished=True))
    return sent


def test_split_multibyte_characters_are_held_until_complete(async_engine):
    tokenizer = async_engine.engine.tokenizer
    text = "Ships 🚢 dock at 東京 and Zürich — naïve café ✓"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    cumulative = [tokenizer.decode(ids[:i + 1], skip_special_tokens=True) for i in range(len(ids))]
    assert any(t.endswith("\ufffd") for t in cumulative)  # the tokenizer does split characters
    sent = stream(TextDelta(None), cumulative[:-1], cumulative[-1])
    assert "".join(sent) == text
    assert not any("\ufffd" in s for s in sent)


def test_text_that_may_start_a_stop_string_is_held_back():
    deltas = TextDelta(["STOP"])
    assert deltas.update("Hello S", finished=False) == "Hell"  # "o S" could begin "STOP"
    assert deltas.update("Hello ST", finished=False) == "o"
    assert deltas.update("Hello ", finished=True) == " "  # the engine cut the stop string


def test_nothing_sent_is_ever_taken_back():
    deltas = TextDelta(None)
    assert deltas.update("abc", finished=False) == "abc"
    assert deltas.update("abX", finished=False) == ""
    assert deltas.update("abcd", finished=True) == "d"


@given(stop=st.none() | st.lists(st.text(max_size=4), max_size=3),
       growth=st.lists(st.text(alphabet="ab\ufffdS", max_size=3), max_size=6),
       final_extra=st.text(alphabet="ab", max_size=3))
def test_any_stop_list_streams_a_prefix_then_the_final_text(stop, growth, final_extra):
    """Whatever the stop list (empty strings included: the schema fuzz sent stop_sequences [""] and
    the hold went negative, indexing past the text), the deltas never index out of the text, each
    joined prefix is a prefix of the text, and the finished text is sent whole."""
    deltas, texts, text = TextDelta(stop), [], ""
    for piece in growth:
        text += piece
        texts.append(text)
    final = text + final_extra
    sent = stream(deltas, texts, final)
    for i, piece in enumerate(sent[:-1]):
        assert texts[i].startswith("".join(sent[:i + 1]))
    assert "".join(sent) == final
