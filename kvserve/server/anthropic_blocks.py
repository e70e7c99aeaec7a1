"""The assistant's content blocks of a /v1/messages answer: a thinking model's `thinking` block (reasoning.py),
its text and, when tools were offered, the `tool_use` blocks read from the model's text (tool_parser.py), whole
or as the streaming events Anthropic sends (`content_block_start`, `thinking_delta` / `signature_delta` /
`text_delta` / `input_json_delta`, `content_block_stop`)."""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from kvserve.server.tool_parser import ToolFormat, ToolStream, parse_output

if TYPE_CHECKING:
    from kvserve.server.reasoning import ReasoningSplit
    from kvserve.server.text_delta import TextDelta

# a thinking block's `signature` (clients send it back with the block; kvserve renders past reasoning from
# nothing, so it signs nothing)
SIGNATURE = ""


def tool_use_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def content_blocks(text: str, fmt: ToolFormat | None, parallel: bool = True,
                   reasoning: ReasoningSplit | None = None) -> list[dict[str, Any]]:
    """The answer's blocks: its reasoning's thinking block (`reasoning`: a thinking model's splitter), one text
    block (when there is text), then one tool_use block per call (`fmt` None: tools were not offered)."""
    thinking = []
    if reasoning is not None:
        thought, text = reasoning.whole(text)
        if thought:
            thinking = [{"type": "thinking", "thinking": thought, "signature": SIGNATURE}]
    if fmt is None:
        return thinking + [{"type": "text", "text": text}]
    found = parse_output(text, fmt)
    calls = found.calls if parallel else found.calls[:1]
    blocks = thinking + ([{"type": "text", "text": found.content}] if found.content or not calls else [])
    blocks += [{"type": "tool_use", "id": tool_use_id(), "name": c.name, "input": _input(c.arguments)}
               for c in calls]
    return blocks


class BlockEvents:
    """Streaming: the cumulative text in, Anthropic's content block events out (as (name, payload)
    pairs). Text streams as it comes; a tool call opens its tool_use block once its name is known
    and streams its arguments as `input_json_delta`."""

    def __init__(self, fmt: ToolFormat | None, parallel: bool, text_delta: TextDelta,
                 reasoning: ReasoningSplit | None = None) -> None:
        self.stream = ToolStream(fmt, parallel) if fmt is not None else None
        self.text_delta = text_delta  # what of the cumulative text is safe to send
        self.reasoning = reasoning  # a thinking model's: its reasoning goes to a thinking block
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
        signed = [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                           "delta": {"type": "signature_delta", "signature": SIGNATURE}})
                  ] if self.open_kind == "thinking" else []
        self.open_kind = None
        return signed + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _thinking(self, thought: str) -> list[tuple[str, dict[str, Any]]]:
        if not thought:
            return []
        events = [] if self.open_kind == "thinking" else self._open({"type": "thinking", "thinking": "",
                                                                     "signature": ""})
        return events + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "thinking_delta", "thinking": thought}})]

    def _text(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        events = [] if self.open_kind == "text" else self._open({"type": "text", "text": ""})
        return events + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "text_delta", "text": text}})]

    def update(self, text: str, finished: bool) -> list[tuple[str, dict[str, Any]]]:
        new_text, events = self.text_delta.update(text, finished), []
        if self.reasoning is not None:
            thought, new_text = self.reasoning.update(new_text, finished)
            events = self._thinking(thought)
        if self.stream is None:
            events += self._text(new_text)
        else:  # what the TextDelta let out, read for tool calls (as the OpenAI stream does)
            said = self.reasoning.content if self.reasoning is not None else self.text_delta.sent
            content, deltas = self.stream.update(said, finished)
            events += self._text(content)
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
            if self.index < 0 or self.open_kind == "thinking":  # an answer without text still has a text block
                events += self._open({"type": "text", "text": ""})
            events += self._close()
        return events

    @property
    def num_calls(self) -> int:
        return len(self.ids)
