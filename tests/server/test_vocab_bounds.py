"""What the front door reads from the vocabulary at start-up: the longest piece's bytes (the character
bound) equals the piece-by-piece maximum for any vocabulary, and the FIM tokens are found among the
tokenizer's added tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models

from kvserve.server.fim import FimTokens, fim_tokens
from kvserve.server.front import max_token_bytes
from kvserve.server.render import piece_bytes

# byte-alphabet stand-ins (one byte each, two in UTF-8), printable ASCII, and characters outside the alphabet
CHARACTERS = "ĠĊÃ¤ab!~ \u2581中🙂"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet=CHARACTERS, max_size=12), max_size=40, unique=True))
def test_the_longest_piece_is_the_piece_by_piece_maximum(pieces):
    vocab = {piece: i for i, piece in enumerate(pieces)}
    assert max_token_bytes(vocab) == max((len(piece_bytes(p)) for p in pieces), default=1)


def test_fim_tokens_are_found_among_added_tokens_and_missing_ones_give_none():
    tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    assert fim_tokens(tokenizer) is None
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|fim_prefix|>", "<|fim_suffix|>")])
    assert fim_tokens(tokenizer) is None  # no middle: not a FIM vocabulary
    tokenizer.add_special_tokens([AddedToken("<|fim_middle|>", special=True)])
    assert fim_tokens(tokenizer) == FimTokens("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
