"""A thinking model's reasoning, told apart from its answer: the text between `<think>` and `</think>` (Qwen3,
DeepSeek-R1, QwQ) goes to `reasoning_content` (vLLM's and llama-server's field; Ollama's `thinking`), the rest
to `content`. The same splitter cuts a stream as it comes and a whole answer, so both give the same texts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """The model's think markers (one pair today: every family above writes these)."""

    open: str = OPEN
    close: str = CLOSE

    @classmethod
    def of(cls, vocabulary_has: Callable[[str], bool], chat_template: str | None) -> ReasoningFormat | None:
        """The format of a model whose vocabulary holds the closing marker as a token, or whose chat template
        writes a marker; None for a model that does not think."""
        if vocabulary_has(CLOSE) or (chat_template is not None and (OPEN in chat_template or CLOSE in chat_template)):
            return cls()
        return None

    def splitter(self, prompt_tail: str) -> ReasoningSplit:
        """A splitter for one answer; a prompt that ends inside an open think block (DeepSeek-R1's and QwQ's
        templates open it for the model) starts the answer in its reasoning."""
        tail = prompt_tail.rstrip()
        return ReasoningSplit(self, opened=tail.endswith(self.open))


class ReasoningSplit:
    """Cuts an answer's text, piece by piece, into reasoning and content. An answer that does not start with
    the open marker (and whose prompt did not open it) is all content. The whitespace around the markers is
    dropped; a piece that may be the start of a marker is held back until the next piece tells."""

    def __init__(self, format_: ReasoningFormat, opened: bool) -> None:
        self.format, self.opened = format_, opened
        self.state = "reasoning" if opened else "start"  # start -> reasoning -> content, or start -> content
        self.pending = ""
        self.reasoning = ""  # what has been let out, cumulative
        self.content = ""
        self.after_close = False  # the whitespace after the close marker is still to drop

    def fresh(self) -> ReasoningSplit:
        """A splitter for the same answer from its start (a whole answer cut apart from its stream's)."""
        return ReasoningSplit(self.format, self.opened)

    def num_tokens(self, token_ids: list[int], decode: Callable[[list[int]], str]) -> int:
        """How many of the answer's tokens are its reasoning (OpenAI's `reasoning_tokens`): those up to the end of
        the close marker, all of them while it has not closed, none in an answer without a think block."""
        text, close = decode(token_ids), self.format.close
        if not (self.opened or text.lstrip().startswith(self.format.open)):
            return 0
        if close not in text:
            return len(token_ids)
        low, high = 1, len(token_ids)  # the fewest leading tokens whose text holds the close marker
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if close in decode(token_ids[:middle]) else (middle + 1, high)
        return low

    def whole(self, text: str) -> tuple[str, str]:
        """A whole answer's (reasoning, content), by a fresh splitter (this one's state untouched)."""
        splitter = self.fresh()
        splitter.update(text, finished=True)
        return splitter.reasoning, splitter.content

    def update(self, piece: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) let out by this piece of the answer's text (all of what is held once finished)."""
        self.pending += piece
        thought, said = "", ""
        while True:
            if self.state == "start":
                text = self.pending.lstrip()
                if text.startswith(self.format.open):
                    self.pending, self.state = text[len(self.format.open):], "reasoning"
                    continue
                if not finished and self.format.open.startswith(text):  # (whitespace, or the marker's start)
                    break
                self.state = "content"
                continue
            if self.state == "reasoning":
                self.pending = self.pending.lstrip() if not self.reasoning else self.pending
                at = self.pending.find(self.format.close)
                if at >= 0:
                    thought += self.pending[:at].rstrip()
                    self.pending, self.state = self.pending[at + len(self.format.close):], "content"
                    self.after_close = True
                    continue
                keep = 0 if finished else _held(self.pending, self.format.close)
                thought += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                break
            if self.after_close:  # (the whitespace after the close marker may come in pieces of its own)
                self.pending = self.pending.lstrip()
                self.after_close = not self.pending
            said, self.pending = said + self.pending, ""
            break
        self.reasoning += thought
        self.content += said
        return thought, said


def _held(text: str, marker: str) -> int:
    """How many trailing characters of `text` to hold back: a start of `marker`, and the whitespace before it
    (dropped if the marker follows)."""
    keep = next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)
    return len(text) - len(text[:len(text) - keep].rstrip())


def split(format_: ReasoningFormat, prompt_tail: str, text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    return format_.splitter(prompt_tail).whole(text)
