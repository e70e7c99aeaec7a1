"""The ids a sequence may not take next: under min_tokens the ids that would end it, and the last token of each
of vLLM's bad words whose tokens before it end the output so far. Pure Python over token ids; the sampler
masks what this returns (model/logit_adjust.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

BadWordTokens = tuple[tuple[int, ...], ...]


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> BadWordTokens:
    """Each word's tokens as it starts a text, and as it follows a space where that is another token of the same
    length (vLLM's rule, so that a word is banned at the start of the output and in its middle)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        if not plain:  # (a tokenizer that normalizes the word away)
            raise ValueError(f"bad_words: {word!r} gives no token in this model's vocabulary")
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return tuple(sequences)


def completed_by(output_ids: Sequence[int], sequences: BadWordTokens) -> set[int]:
    """The last token of each sequence whose other tokens are the last of `output_ids` (a one-token word's
    always): the tokens that would complete a bad word here."""
    banned = set()
    for sequence in sequences:
        head = len(sequence) - 1
        if head <= len(output_ids) and (head == 0 or tuple(output_ids[-head:]) == sequence[:-1]):
            banned.add(sequence[-1])
    return banned


def masked_ids(endings: set[int], word_bans: set[int], allowed: Sequence[int] | None) -> list[int] | None:
    """What the sampler masks: the endings min_tokens holds back and the bad words' bans. Where they would leave
    none of allowed_token_ids, the bad words' bans are lifted first, then the endings: the output takes an
    allowed token rather than none (vLLM leaves such a row with every logit at minus infinity)."""
    for masked in (endings | word_bans, endings):
        if allowed is None or not set(allowed) <= masked:
            return sorted(masked) or None
    return None
