"""A streamed Responses API answer (`POST /v1/responses`, typed SSE events) resumed on another backend
when its backend dies mid-stream, as router_stream.py does for chat: the replacement stream is cut to
what the client lacks and made to read as the one it has been getting.

    response.created / in_progress        sent once (the first stream's)
    output_item.added / content_part.added  once per output (and content) index
    output_text.delta, function_call_arguments.delta, reasoning_text.delta
                                          cut to the characters past what the client has (the
                                          replacement's text must repeat the client's: Diverged if not)
    *.done, response.completed / incomplete  once each, ids and sequence numbers rewritten

Every event gets the first stream's response id and item ids and the next sequence number. The
replacement request carries the first response's id (`x-kvserve-response-id`), so the backend stores
it under the id the client knows and a follow-up by `previous_response_id` finds it there.

Exact for greedy answers (the Responses API has no `seed`): a sampled answer that differs ends the
stream with an error event rather than splice two answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.server.router_stream import BackendBroke, BackendInvalid, Diverged, Event, encode

ONCE = ("response.created", "response.in_progress")
PER_ITEM = ("response.output_item.added", "response.output_item.done", "response.content_part.added",
            "response.content_part.done", "response.output_text.done", "response.reasoning_text.done",
            "response.function_call_arguments.done")
DELTAS = {"response.output_text.delta": "delta", "response.function_call_arguments.delta": "delta",
          "response.reasoning_text.delta": "delta"}  # (a thinking model's reasoning item)
FINAL = ("response.completed", "response.incomplete", "response.failed")


@dataclass
class ResponsesTranscript:
    response_id: str | None = None  # the first stream's
    item_ids: dict[int, str] = field(default_factory=dict)  # output_index -> the first stream's item id
    text: dict[tuple[int, int], str] = field(default_factory=dict)  # what the client has per output
    read: dict[tuple[int, int], int] = field(default_factory=dict)  # ... of which this stream repeated
    sent: set[tuple[str, int, int]] = field(default_factory=set)  # (type, output, content) sent once
    seq: int = 0
    attempt: int = 0
    done: bool = False

    def resume(self) -> None:
        self.attempt += 1
        self.read = {}

    def first_output(self, event: Event) -> bool:
        return isinstance(event.data, dict) and event.data.get("type") not in ONCE

    def error_event(self, message: str) -> bytes:
        self.seq += 1
        return encode("error", {"type": "error", "sequence_number": self.seq - 1, "code": "stream_resume_failed",
                                "message": message, "param": None})

    def accept(self, event: Event) -> bytes | None:
        data = event.data
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            raise BackendInvalid("a Responses event without a type")
        kind = data["type"]
        if kind == "error":
            if data.get("code") in ("shutting_down", None) or "server" in str(data.get("code")):
                raise BackendBroke(str(data.get("message")))
            self.done = True
            return self._out(kind, data)
        if kind in ONCE:
            if (kind, 0, 0) in self.sent:
                return None
            self.sent.add((kind, 0, 0))
            self.response_id = self.response_id or _response_id(data)
        elif kind in PER_ITEM:
            key = (kind, _index(data, "output_index"), _index(data, "content_index"))
            if key in self.sent:
                return None
            self.sent.add(key)
        elif kind in DELTAS:
            piece = data.get("delta")
            if not isinstance(piece, str):
                raise BackendInvalid(f"a {kind} event whose delta is not text")
            fresh = self._fresh((_index(data, "output_index"), _index(data, "content_index")), piece)
            if not fresh:
                return None
            data = {**data, "delta": fresh}
        elif kind in FINAL:
            self.done = True
        return self._out(kind, data)

    def _fresh(self, key: tuple[int, int], piece: str) -> str:
        have, pos = self.text.get(key, ""), self.read.get(key, 0)
        self.read[key] = pos + len(piece)
        seen = have[pos:pos + len(piece)]
        if piece[:len(seen)] != seen:
            raise Diverged(f"the resumed answer differs from the one being streamed at character {pos}")
        fresh = piece[len(seen):]
        self.text[key] = have + fresh
        return fresh

    def _out(self, kind: str, data: dict[str, Any]) -> bytes:
        """The event with the first stream's ids and the next sequence number."""
        data = dict(data)
        output = data.get("output_index")
        if isinstance(data.get("item"), dict) and _is_index(output):
            item = data["item"] = dict(data["item"])
            first = self.item_ids.setdefault(output, item.get("id"))
            item["id"] = first
        if "item_id" in data and _is_index(output):
            data["item_id"] = self.item_ids.setdefault(output, data["item_id"])
        if isinstance(data.get("response"), dict):
            response = data["response"] = dict(data["response"])
            if self.response_id is not None:
                response["id"] = self.response_id
            if isinstance(response.get("output"), list):
                response["output"] = [{**item, "id": self.item_ids.get(i, item.get("id"))}
                                      if isinstance(item, dict) else item
                                      for i, item in enumerate(response["output"])]
        data["sequence_number"] = self.seq
        self.seq += 1
        return encode(kind, data)


def _response_id(data: dict[str, Any]) -> str | None:
    response = data.get("response")
    return response.get("id") if isinstance(response, dict) and isinstance(response.get("id"), str) else None


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 16


def _index(data: dict[str, Any], name: str) -> int:
    value = data.get(name, 0)
    if not _is_index(value):
        raise BackendInvalid(f"a Responses event whose {name} is not a small non-negative integer")
    return value
