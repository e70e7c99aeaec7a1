"""GrammarState: one sequence's place in its grammar (an llguidance matcher). The sampler asks it for
the next token's bitmask; the scheduler advances it with each sampled token, and only then, so
chunked prefill and recompute after preemption (which compute tokens, not sample them) leave it be."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

MAX_ERROR_CHARS = 300  # llguidance's errors can carry the grammar and parser state (~250 KB)

log = logging.getLogger("kvserve.structured")


class GrammarState:
    """Satisfies kvserve.request.TokenConstraint (the sampler and scheduler see only that)."""

    __slots__ = ("matcher", "vocab_size", "eos_token_ids", "num_tokens")

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.matcher = matcher  # llguidance.LLMatcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_tokens = 0  # tokens accepted so far

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit t % 32 of word t // 32).
        A dead end (nothing allowed, e.g. after an engine error) allows the EOS tokens, so the
        sequence ends instead of sampling from an empty distribution."""
        words = bitmask[row]
        assert words.flags.c_contiguous and words.dtype == np.int32
        if not self.matcher.is_error():
            self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self.matcher.is_error() or not words.any():
            words[:] = 0
            for token in self.eos_token_ids:
                words[token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the state is finished) if the grammar refused it."""
        ok = bool(self.matcher.consume_token(token_id))
        self.num_tokens += ok
        if not ok:
            log.warning("grammar refused sampled token %d: %s", token_id, self.error)
        return ok

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and nothing can follow (or it failed): the sequence stops here."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def violation(self) -> str:
        """Why an output that ended here would be outside the grammar ("" when it is inside)."""
        if self.matcher.is_error():
            return "the grammar could not be followed: " + self.error
        if self.matcher.is_stopped() or self.matcher.is_accepting():
            return ""
        return ("the output ended (an end-of-sequence or stop token) before the grammar was complete; "
                "the grammar requires a token that ends generation, or one this engine cannot emit")

    @property
    def error(self) -> str:
        """The matcher's error in one line of at most MAX_ERROR_CHARS ("" without one)."""
        if not self.matcher.is_error():
            return ""
        text = " ".join(self.matcher.get_error().split())
        return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."

    def copy(self) -> GrammarState:
        """An independent state at the same place (n > 1 forks, beam search candidates)."""
        twin = GrammarState(self.matcher.deep_copy(), self.vocab_size, self.eos_token_ids)
        twin.num_tokens = self.num_tokens
        return twin

    def can_start(self) -> bool:
        """Some first token is allowed, or the empty output already satisfies the grammar."""
        words = np.zeros((1, (self.vocab_size + 31) // 32), np.int32)
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self.matcher.is_error():  # llguidance reports a grammar with no way forward this way
            return False
        return bool(words.any()) or self.matcher.is_accepting()
