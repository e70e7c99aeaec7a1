"""What of a stream's cumulative text can be sent now: the difference between the engine's text and
what was sent, holding back a trailing U+FFFD (a multi-byte character split across tokens decodes to
it until its last byte arrives) and, when stop strings are set, the last len(stop) - 1 characters
(they may turn out to be the start of a stop string, which the engine cuts from the final text)."""

from __future__ import annotations


class TextDelta:
    """What of the cumulative text can be sent now."""

    def __init__(self, stop: list[str] | None) -> None:
        self.sent = ""
        # an empty stop string (clients send [""]) can start nothing, so it holds nothing back
        self.hold = max((len(s) - 1 for s in stop or [] if s), default=0)

    def update(self, text: str, finished: bool) -> str:
        if not text.startswith(self.sent):
            return ""  # cannot happen with byte-level BPE; never resend what was sent
        end = len(text)
        if not finished:
            end = max(end - self.hold, 0)
            while end > len(self.sent) and text[end - 1] == "\ufffd":
                end -= 1
        if end <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):end], text[:end]
        return delta
