"""A streamed answer relayed whole to the client even when its backend dies mid-stream: the router
sends the request again to another backend and the new stream resumes where the client is, its
events cut so the client never sees text twice (OpenAI chat and completions, Anthropic messages).

Exact when both backends generate the same text: greedy, or seeded sampling (seeded draws depend
only on the seed and the token's position, kvserve/model/sampler.py). The router gives a sampled
OpenAI stream without a seed one of its own for that reason (`with_seed`). When the replacement's
text still disagrees with what the client has (Anthropic sampling has no seed), the stream ends
with an error event rather than splice two different answers.

Every event is checked before it is relayed (router_checks.py): a malformed one, a stream that
stalls past its read deadline (router_reads.py) or breaks are the backend's failure, and the
stream resumes on the next backend; the client never sees the bad event.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.server import sse
from kvserve.server.router_checks import MAX_EVENT_BYTES, event_problem
from kvserve.server.router_index import BackendState, Ticket
from kvserve.server.router_metrics import RouterMetrics, reported_cached_tokens
from kvserve.server.router_reads import Alarm, ReadTimeouts, Stalled, timed_chunks

DELTA_KEYS = ("text", "thinking", "partial_json")  # an Anthropic delta's growing field


class BackendBroke(Exception):
    """The backend's stream ended (or reported its own shutdown) before the answer did."""


class BackendInvalid(BackendBroke):
    """The backend's stream holds an event no client should get."""


class Diverged(Exception):
    """The replacement stream's text differs from what the client already has."""


@dataclass(slots=True)
class Event:
    raw: bytes  # as the backend sent it, blank line included
    name: str | None  # the `event:` field (Anthropic)
    data: Any  # the `data:` field as JSON, "[DONE]", or None


def parse_event(raw: bytes) -> Event:
    name, data = None, []
    for line in raw.split(b"\n"):
        if line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
        elif line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" "))
    joined = b"\n".join(data)
    if joined == b"[DONE]":
        return Event(raw, name, "[DONE]")
    try:
        return Event(raw, name, json.loads(joined))
    except ValueError:
        return Event(raw, name, None)


def encode(name: str | None, payload: Any) -> bytes:
    return sse.event(payload, name or None).encode()


def is_comment(raw: bytes) -> bool:
    """An event of SSE comment lines only (`: keep-alive`): clients ignore it, so it is dropped."""
    return all(line.startswith(b":") for line in raw.strip().split(b"\n"))


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[Event]:
    """Whole events from a byte stream; a trailing partial event (the stream broke) is dropped, one
    longer than MAX_EVENT_BYTES is the backend's fault."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while (end := buffer.find(b"\n\n")) >= 0:
            raw, buffer = buffer[:end + 2], buffer[end + 2:]
            if raw.strip() and not is_comment(raw):
                yield parse_event(raw)
        if len(buffer) > MAX_EVENT_BYTES:
            raise BackendInvalid(f"an event longer than {MAX_EVENT_BYTES:,} bytes")


def with_seed(path: str, body: Any) -> dict | None:
    """An OpenAI stream that samples without a seed, given a random one (so a resumed stream draws
    the same tokens); None when the body needs none."""
    if (path == "/v1/messages" or not isinstance(body, dict) or body.get("stream") is not True
            or body.get("seed") is not None or body.get("temperature") == 0):
        return None
    return {**body, "seed": secrets.randbelow(2**63)}


@dataclass
class Transcript:
    """What the client has of one streamed answer, and the filter that turns a replacement stream
    into the rest of it."""
    anthropic: bool
    chat: bool = True
    # per choice / content block (a choice's reasoning: (index, "reasoning_content")): the client's text
    text: dict[int | tuple[int, str], str] = field(default_factory=dict)
    read: dict[int | tuple[int, str], int] = field(default_factory=dict)  # ... of which the current stream repeated
    opened: set[int] = field(default_factory=set)  # chat roles / Anthropic blocks started
    closed: set[int] = field(default_factory=set)  # finish_reasons / Anthropic blocks stopped
    sent: set[str] = field(default_factory=set)  # Anthropic message_start, message_delta
    ids: dict[str, Any] | None = None  # the first stream's id and created (OpenAI)
    attempt: int = 0
    done: bool = False

    def resume(self) -> None:
        self.attempt += 1
        self.read = {}

    def accept(self, event: Event) -> bytes | None:
        """The bytes to send the client for `event` of the current stream, or None; BackendInvalid
        when the event is malformed."""
        problem = event_problem(self.anthropic, self.chat, event.name, event.data)
        if problem is not None:
            raise BackendInvalid(f"a malformed event: {problem}")
        return self._anthropic(event) if self.anthropic else self._openai(event)

    def first_output(self, event: Event) -> bool:
        """Whether the event shows the prompt's prefill is done."""
        if self.anthropic:
            return event.name == "message_start"
        choices = event.data.get("choices") if isinstance(event.data, dict) else None
        return bool(choices) and any(
            c.get("finish_reason") or (c.get("delta") or {}).get("content") or c.get("text")
            or (c.get("delta") or {}).get("reasoning_content") for c in choices if isinstance(c, dict))

    def error_event(self, message: str) -> bytes:
        if self.anthropic:
            return encode("error", {"type": "error",
                                    "error": {"type": "api_error", "message": message}})
        return encode(None, {"error": {"message": message, "type": "server_error", "param": None,
                                       "code": "stream_resume_failed"}}) + sse.DONE.encode()

    def _fresh(self, i: int | tuple[int, str], piece: str) -> tuple[str, bool]:
        """The part of `piece` (the current stream's next text of item i) the client lacks, and
        whether the piece began inside what the client has."""
        have, pos = self.text.get(i, ""), self.read.get(i, 0)
        self.read[i] = pos + len(piece)
        if pos >= len(have):
            self.text[i] = have + piece
            return piece, False
        seen = have[pos:pos + len(piece)]
        if piece[:len(seen)] != seen:
            raise Diverged(f"the resumed answer differs from the one being streamed at character "
                           f"{pos} (sampling without a seed?)")
        fresh = piece[len(seen):]
        self.text[i] = have + fresh
        return fresh, True

    # -- OpenAI: data-only events, `data: [DONE]` last --------------------------------------------
    def _openai(self, event: Event) -> bytes | None:
        data = event.data
        if data == "[DONE]":
            self.done = True
            return event.raw
        if not isinstance(data, dict):
            return event.raw
        error = data.get("error")
        if isinstance(error, dict):
            if error.get("code") == "shutting_down" or error.get("type") == "server_error":
                raise BackendBroke(str(error.get("message")))
            return event.raw
        changed = False
        if self.ids is None:
            self.ids = {k: data[k] for k in ("id", "created") if k in data}
        for key, value in self.ids.items():
            if key in data and data[key] != value:
                data[key], changed = value, True
        choices = data.get("choices")
        if isinstance(choices, list) and choices:
            kept = []
            for choice in choices:
                out = self._choice(choice) if isinstance(choice, dict) else choice
                if out is not None:
                    kept.append(out)
                changed |= out is not choice
            if not kept and not data.get("usage"):
                return None
            data["choices"] = kept
        return encode(event.name, data) if changed else event.raw

    def _choice(self, choice: dict) -> dict | None:
        """The choice as the client should get it, or None when it has all of it."""
        i = choice.get("index", 0)
        holder = dict(choice.get("delta") or {}) if self.chat else choice
        key = "content" if self.chat else "text"
        thought = holder.get("reasoning_content") if self.chat else None  # a thinking model's, kept apart
        thought = thought if isinstance(thought, str) else ""
        fresh_thought = self._fresh((i, "reasoning_content"), thought)[0] if thought else ""
        piece = holder.get(key) or ""
        fresh, old = self._fresh(i, piece if isinstance(piece, str) else "")
        role_repeated = self.chat and "role" in holder and i in self.opened
        finish = choice.get("finish_reason")
        new_finish = bool(finish) and i not in self.closed
        if not fresh and not fresh_thought and not new_finish and (old or role_repeated or thought):
            return None
        if fresh == piece and fresh_thought == thought and not role_repeated and (new_finish or not finish):
            out = choice
        else:
            holder[key] = fresh
            if thought:
                holder["reasoning_content"] = fresh_thought
            if role_repeated:
                del holder["role"]
            out = {**choice, "finish_reason": finish if new_finish else None}
            if self.chat:
                out["delta"] = holder
            else:
                out["text"] = fresh
        if self.chat and "role" in holder:
            self.opened.add(i)
        if new_finish:
            self.closed.add(i)
        return out

    # -- Anthropic: named events, message_stop last -----------------------------------------------
    def _anthropic(self, event: Event) -> bytes | None:
        data = event.data if isinstance(event.data, dict) else {}
        name = event.name or data.get("type")
        if name in ("message_start", "message_delta"):
            if name in self.sent:
                return None
            self.sent.add(name)
        elif name == "ping":
            return event.raw if self.attempt == 0 else None
        elif name in ("content_block_start", "content_block_stop"):
            marks = self.opened if name == "content_block_start" else self.closed
            i = data.get("index", 0)
            if i in marks:
                return None
            marks.add(i)
        elif name == "content_block_delta":
            return self._anthropic_delta(event, data)
        elif name == "message_stop":
            self.done = True
        elif name == "error":
            error = data.get("error") or {}
            if error.get("type") in ("overloaded_error", "api_error"):
                raise BackendBroke(str(error.get("message")))
            self.done = True
        return event.raw

    def _anthropic_delta(self, event: Event, data: dict) -> bytes | None:
        delta = data.get("delta") or {}
        key = next((k for k in DELTA_KEYS if isinstance(delta.get(k), str)), None)
        if key is None:
            return event.raw if self.attempt == 0 else None
        fresh, _ = self._fresh(data.get("index", 0), delta[key])
        if not fresh:
            return None
        if fresh == delta[key]:
            return event.raw
        return encode(event.name, {**data, "delta": {**delta, key: fresh}})


@dataclass
class Attempt:
    """One backend's streamed answer to the request."""
    ticket: Ticket
    response: Any  # httpx.Response opened with stream=True
    predicted_tokens: int = 0
    alarm: Alarm | None = None  # rings when the backend is found hung


class ResumingRelay:
    """The client's stream: events of the current attempt through the transcript; when the attempt
    breaks, stalls or sends a malformed event, `failed(backend, why, kind)` is awaited (kind
    "broken", "stalled" or "invalid") and `reopen` (the router: the request sent to a backend not
    in `tried`, which it adds) gives the next. `finish` (the response's background task, run even
    when the client left before the stream started) closes whatever attempt is still open. A
    client that leaves is no backend's failure: the attempt is closed and nothing is told."""

    def __init__(self, transcript: Transcript, first: Attempt,
                 reopen: Callable[[set[str]], Awaitable[Attempt | None]],
                 failed: Callable[[BackendState, str, str], Awaitable[None]],
                 metrics: RouterMetrics,
                 timeouts: ReadTimeouts = ReadTimeouts()) -> None:
        self.transcript, self.current, self.reopen = transcript, first, reopen
        self.failed, self.metrics, self.timeouts = failed, metrics, timeouts
        self.tried = {first.ticket.backend.url}
        self.tail = b""

    def _deadline(self, attempt: Attempt) -> float | None:
        """Until its first output a stream may be prefilling a long prompt; after it, chunks come
        every few decode steps."""
        if attempt.ticket.prefilling:
            return self.timeouts.first_byte_s
        return self.timeouts.between_chunks_s

    async def body(self) -> AsyncIterator[bytes]:
        while self.current is not None:
            attempt = self.current
            chunks = timed_chunks(attempt.response.aiter_raw(), lambda: self._deadline(attempt),
                                  attempt.alarm)
            try:
                async for event in sse_events(chunks):
                    out = self.transcript.accept(event)
                    if attempt.ticket.prefilling and self.transcript.first_output(event):
                        attempt.ticket.first_token()
                    if out:
                        self.tail = (self.tail + out)[-65536:]
                        yield out
                    if self.transcript.done:
                        self.metrics.reported(attempt.predicted_tokens,
                                              reported_cached_tokens(self.tail, sse=True))
                        return
                raise BackendBroke("the stream ended before the answer did")
            except Stalled as err:
                await self.failed(attempt.ticket.backend, f"stream stalled: {err}", "stalled")
            except BackendInvalid as err:
                await self.failed(attempt.ticket.backend, f"stream invalid: {err}", "invalid")
            except (httpx.HTTPError, BackendBroke) as err:
                await self.failed(attempt.ticket.backend,
                                  f"stream broke: {err or type(err).__name__}", "broken")
            except Diverged as err:
                yield self.transcript.error_event(str(err))
                return
            finally:
                await self._close(attempt)
            self.current = await self.reopen(self.tried)
            if self.current is not None:
                self.transcript.resume()
                self.metrics.stream_resumes.inc()
        yield self.transcript.error_event("the backend died mid-stream and no other could "
                                          "resume it")

    async def finish(self) -> None:
        if self.current is not None:
            await self._close(self.current)

    @staticmethod
    async def _close(attempt: Attempt) -> None:
        attempt.ticket.release()
        with contextlib.suppress(Exception):  # (a stalled read may leave the connection broken)
            await attempt.response.aclose()
