"""The assistant's content blocks of a /v1/messages answer: its text and, when tools were offered,
the `tool_use` blocks read from the model's text (tool_parser.py), whole or as the streaming events
Anthropic sends (`content_block_start`, `text_delta` / `input_json_delta`, `content_block_stop`)."""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from kvserve.server.tool_parser import ToolFormat, ToolStream, parse_output

if TYPE_CHECKING:
    from kvserve.server.text_delta import TextDelta


def tool_use_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def content_blocks(text: str, fmt: ToolFormat | None, parallel: bool = True) -> list[dict[str, Any]]:
    """The answer's blocks: one text block (when there is text), then one tool_use block per call
    (`fmt` None: tools were not offered, the text is all)."""
    if fmt is None:
        return [{"type": "text", "text": text}]
    found = parse_output(text, fmt)
    calls = found.calls if parallel else found.calls[:1]
    blocks = [{"type": "text", "text": found.content}] if found.content or not calls else []
    blocks += [{"type": "tool_use", "id": tool_use_id(), "name": c.name, "input": _input(c.arguments)}
               for c in calls]
    return blocks


class BlockEvents:
    """Streaming: the cumulative text in, Anthropic's content block events out (as (name, payload)
    pairs). Text streams as it comes; a tool call opens its tool_use block once its name is known
    and streams its arguments as `input_json_delta`."""

    def __init__(self, fmt: ToolFormat | None, parallel: bool, text_delta: TextDelta) -> None:
        self.stream = ToolStream(fmt, parallel) if fmt is not None else None
        self.text_delta = text_delta  # what of the cumulative text is safe to send
        self.index = -1
        self.open_kind: str | None = None
        self.call_index: dict[int, int] = {}  # call number -> block index
        self.ids: list[str] = []  # tool_use ids, in call order

    def _open(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        self.index += 1
        self.open_kind = block["type"]
        return events + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _text(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        events = [] if self.open_kind == "text" else self._open({"type": "text", "text": ""})
        return events + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "text_delta", "text": text}})]

    def update(self, text: str, finished: bool) -> list[tuple[str, dict[str, Any]]]:
        new_text = self.text_delta.update(text, finished)
        if self.stream is None:
            events = self._text(new_text)
        else:  # what the TextDelta let out, read for tool calls (as the OpenAI stream does)
            content, deltas = self.stream.update(self.text_delta.sent, finished)
            events = self._text(content)
            for delta in deltas:
                if delta.name is not None:
                    self.ids.append(tool_use_id())
                    events += self._open({"type": "tool_use", "id": self.ids[-1], "name": delta.name,
                                          "input": {}})
                    self.call_index[delta.index] = self.index
                if delta.arguments:
                    events.append(("content_block_delta", {
                        "type": "content_block_delta", "index": self.call_index[delta.index],
                        "delta": {"type": "input_json_delta", "partial_json": delta.arguments}}))
        if finished:
            if self.index < 0:  # an empty answer still has its (empty) text block
                events += self._open({"type": "text", "text": ""})
            events += self._close()
        return events

    @property
    def num_calls(self) -> int:
        return len(self.ids)
