"""What the router accepts from a backend before any of it reaches a client: the shape of a whole
JSON answer and of each streamed SSE event (OpenAI completions and chat, Anthropic messages).

A backend is not trusted to be well formed: one that answers something else (a 200 that is not
JSON, `{"choices": 5}`, a chunk whose text is a number) has failed, like one that dropped the
connection, and the router retries elsewhere or answers 502 itself. Only the fields the router and
the clients' SDKs rely on are checked; anything else in an answer passes through.
"""

from __future__ import annotations

import json
from typing import Any

MAX_ANSWER_BYTES = 64 << 20  # a whole JSON answer larger than this is a backend error
MAX_EVENT_BYTES = 4 << 20  # one SSE event larger than this (no blank line yet) is one too
ANTHROPIC_EVENTS = ("message_start", "message_delta", "message_stop", "content_block_start",
                    "content_block_delta", "content_block_stop", "ping", "error")


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 16


def _optional(value: Any, kind: type | tuple[type, ...]) -> bool:
    return value is None or isinstance(value, kind)


def error_problem(data: Any) -> str | None:
    """An error answer (any non-200 status, or an error event) needs `error.message`."""
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return "an error answer without error.message"
    return None


def _openai_choice_problem(choice: Any, chat: bool, stream: bool) -> str | None:
    if not isinstance(choice, dict):
        return "a choice that is not an object"
    if not _is_index(choice.get("index", 0)):
        return "a choice index that is not a small non-negative integer"
    if not _optional(choice.get("finish_reason"), str):
        return "a finish_reason that is not a string"
    if not chat:
        text = choice.get("text")
        return None if isinstance(text, str) else "a choice whose text is not a string"
    message = choice.get("delta" if stream else "message")
    if not isinstance(message, dict):
        return f"a choice without a {'delta' if stream else 'message'} object"
    if not _optional(message.get("content"), str) or not _optional(message.get("role"), str):
        return "a message whose content or role is not a string"
    return None


def openai_problem(data: Any, chat: bool, stream: bool) -> str | None:
    """A completion or chat answer (or one chunk of its stream) as clients parse it."""
    if not isinstance(data, dict):
        return "an answer that is not a JSON object"
    if "error" in data:
        return error_problem(data)
    choices = data.get("choices")
    if not isinstance(choices, list) or (not stream and not choices):
        return "choices is not a list" if not isinstance(choices, list) else "no choices"
    if not _optional(data.get("usage"), dict):
        return "usage is not an object"
    for choice in choices:
        if problem := _openai_choice_problem(choice, chat, stream):
            return problem
    return None


def anthropic_problem(data: Any) -> str | None:
    """A whole Anthropic message."""
    if not isinstance(data, dict) or data.get("type") != "message":
        return "an answer that is not a message object"
    content = data.get("content")
    if not isinstance(content, list) or not all(
            isinstance(b, dict) and isinstance(b.get("type"), str) for b in content):
        return "a message whose content is not a list of blocks"
    if not _optional(data.get("usage"), dict):
        return "usage is not an object"
    return None


def anthropic_event_problem(name: str | None, data: Any) -> str | None:
    if not isinstance(data, dict):
        return "an event whose data is not a JSON object"
    kind = data.get("type")
    if kind not in ANTHROPIC_EVENTS or (name is not None and name != kind):
        return f"an unknown event {str(name or kind)[:40]!r}"
    if kind == "error":
        return error_problem(data)
    if kind == "message_start" and not isinstance(data.get("message"), dict):
        return "message_start without a message"
    if kind.startswith("content_block") and not _is_index(data.get("index")):
        return f"{kind} without a valid index"
    if kind == "content_block_start" and not isinstance(data.get("content_block"), dict):
        return "content_block_start without a content_block"
    if kind in ("content_block_delta", "message_delta") and not isinstance(data.get("delta"), dict):
        return f"{kind} without a delta"
    if kind == "content_block_delta":
        delta = data["delta"]
        if any(key in delta and not isinstance(delta[key], str)
               for key in ("text", "thinking", "partial_json")):
            return "a delta whose text is not a string"
    return None


def answer_problem(path: str, status: int, content_type: str, body: bytes,
                   stream_requested: bool) -> str | None:
    """Why a backend's whole (not streamed) answer to `path` cannot go to the client, or None."""
    if status == 200 and stream_requested:
        return f"a stream was asked for, the answer is {content_type[:60]!r}"
    if content_type.startswith("text/event-stream"):
        return "a stream that was not asked for"
    try:
        data = json.loads(body)
    except ValueError:
        return f"a {status} answer that is not JSON"
    if status != 200:
        return error_problem(data)
    if path == "/v1/messages":
        return anthropic_problem(data)
    return openai_problem(data, chat=path == "/v1/chat/completions", stream=False)


def event_problem(anthropic: bool, chat: bool, name: str | None, data: Any) -> str | None:
    """Why one event of a backend's stream cannot go to the client, or None. `data` is the event's
    JSON, "[DONE]", or None (its data was not JSON)."""
    if anthropic:
        return anthropic_event_problem(name, data)
    if data == "[DONE]":
        return None
    return openai_problem(data, chat=chat, stream=True)
