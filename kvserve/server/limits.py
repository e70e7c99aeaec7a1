"""What one client can make the server hold: a request body cap (413 before parsing), a read
timeout on the body (408), the body's structure (400, body_guard.py), the bytes of unfinished bodies
and the open requests of one API key (429, inflight.py), and admission control over engine requests
(429 with Retry-After before any work is queued, 400 for a request that could never be admitted).

`BodyLimit` is plain ASGI middleware: a declared Content-Length over the cap is refused before
any of it reaches the app; otherwise the body is read (counting bytes, which also covers chunked
uploads) and refused as soon as it passes the cap, then handed to the app whole. The whole body
must arrive within `read_timeout_s` of the request's start (a client trickling bytes is cut
off, not only an idle one). `Admission` counts the engine requests (prompts x n) each API request
holds from admission until its last output.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.body_guard import body_problem
from kvserve.server.error_shapes import front_error
from kvserve.server.inflight import (CLIENT_KEY_SCOPE, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_BODY_BYTES_PER_KEY,
                                     InFlight, InFlightCaps, Refusal)
from kvserve.server.protocol import APIError

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_READ_TIMEOUT_S = 30.0
# A refused body is still read (and dropped) before the 413, up to this much and within the read
# timeout, so the client, which sends its whole body before it reads an answer, gets the answer
# rather than a reset connection (nginx's lingering close is bounded by time alone). Past it the
# connection is closed mid-upload, and whether the client then sees the 413 is a race: at 64 MiB a
# 200 MB upload over loopback lost it to the reset on a fast host.
DRAIN_BYTES = 1 << 30

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


class BodyLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, in_flight: InFlight | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.in_flight = in_flight or InFlight(InFlightCaps(
            max(DEFAULT_MAX_BODY_BYTES, max_bytes), max(DEFAULT_MAX_BODY_BYTES_PER_KEY, max_bytes)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = scope.get(CLIENT_KEY_SCOPE)  # KeyGate's, with API keys
        refusal = self.in_flight.open(key)
        if refusal is not None:
            return await self._busy(scope, send, refusal)
        held = [0]  # body bytes this request holds in the in-flight count
        try:
            await self._read_then_call(scope, receive, send, key, held)
        finally:
            self.in_flight.give(key, held[0])
            self.in_flight.close(key)

    async def _read_then_call(self, scope: Scope, receive: Receive, send: Send, key: str | None,
                              held: list[int]) -> None:
        if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._drain(receive, 0, deadline)
            return await self._refuse(scope, send, int(declared))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive_by(receive, deadline)
            if message is None:
                return await self._timed_out(scope, send, size)
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, size, deadline)
                return await self._refuse(scope, send, None)
            refusal = self.in_flight.take(key, len(chunk))
            if refusal is not None:  # answered now: the rest of the body is never read
                return await self._busy(scope, send, refusal)
            held[0] += len(chunk)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        self.in_flight.give(key, held[0])  # whole: the route owns it now
        held[0] = 0
        problem = body_problem(body) if body else None
        if problem is not None:
            return await answer_with(send, 400, front_error(
                scope.get("path", ""), 400, problem.message, code="invalid_body", param=problem.param))
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later reads wait for the disconnect, as the app expects

        await self.app(scope, replay, send)

    @staticmethod
    async def _drain(receive: Receive, size: int, deadline: float) -> None:
        """Read and drop the rest of a refused body, up to DRAIN_BYTES in all, until `deadline`."""
        while size <= DRAIN_BYTES:
            message = await receive_by(receive, deadline)
            if message is None or message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
            size += len(message.get("body", b""))

    async def _refuse(self, scope: Scope, send: Send, declared: int | None) -> None:
        size = f"{declared:,} bytes" if declared is not None else "over the limit"
        message = (f"the request body is {size}; this server accepts at most {self.max_bytes:,} "
                   f"bytes (--max-request-bytes)")
        await close_with(send, 413, front_error(scope.get("path", ""), 413, message,
                                                code="request_too_large"))

    @staticmethod
    async def _busy(scope: Scope, send: Send, refusal: Refusal) -> None:
        body = front_error(scope.get("path", ""), 429, refusal.message, "rate_limit_error", refusal.code)
        await close_with(send, 429, body, [(b"retry-after", b"1")])

    async def _timed_out(self, scope: Scope, send: Send, size: int) -> None:
        message = (f"the request body did not arrive within {self.read_timeout_s:g} s "
                   f"({size:,} bytes came); send it faster (--request-read-timeout)")
        await close_with(send, 408, front_error(scope.get("path", ""), 408, message,
                                                code="request_timeout"))


async def receive_by(receive: Receive, deadline: float) -> dict[str, Any] | None:
    """The next ASGI message, or None once `deadline` (the event loop's clock) has passed."""
    try:
        async with asyncio.timeout_at(deadline):
            return await receive()
    except TimeoutError:
        return None


async def close_with(send: Send, status: int, body: dict[str, Any],
                     headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Answer `status` with a JSON body and close the connection (the body was not read whole)."""
    await answer_with(send, status, body, [*headers, (b"connection", b"close")])


async def answer_with(send: Send, status: int, body: dict[str, Any],
                      headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Answer `status` with a JSON body from middleware, before any route runs."""
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})


@dataclass(slots=True)
class Admission:
    """Engine requests held by API requests, in total and per tenant (namespace).

    Waiting requests are estimated as those held beyond the ones the engine ran at its last step;
    `max_waiting` caps that, `max_per_tenant` caps what one tenant holds (waiting or running).
    0 means no limit."""

    max_waiting: int = 0
    max_per_tenant: int = 0
    retry_after_s: int = 1
    held: int = 0
    by_tenant: Counter = field(default_factory=Counter)

    def admit(self, tenant: str, count: int, running: int) -> None:
        """Reserve `count` engine requests or raise a 429 APIError (nothing reserved); a 400 when
        `count` is over a limit by itself, so that no retry could ever succeed."""
        if self.max_waiting and count > self.max_waiting:
            raise APIError(f"this request needs {count} engine requests (prompts x n) and this "
                           f"server queues at most {self.max_waiting} (--max-waiting-requests); "
                           f"send fewer prompts or a smaller n", param="n", code="request_too_large")
        if self.max_per_tenant and count > self.max_per_tenant:
            raise APIError(f"this request needs {count} engine requests (prompts x n) and one API "
                           f"key may hold at most {self.max_per_tenant} (--max-requests-per-tenant); "
                           f"send fewer prompts or a smaller n", param="n", code="request_too_large")
        waiting = max(self.held - running, 0)
        if self.max_waiting and waiting + count > self.max_waiting:
            raise self._busy(f"the server has {waiting} requests waiting and this one adds {count} "
                             f"(prompts x n); the limit is {self.max_waiting} "
                             f"(--max-waiting-requests); retry later")
        if self.max_per_tenant and self.by_tenant[tenant] + count > self.max_per_tenant:
            raise self._busy(f"this API key has {self.by_tenant[tenant]} requests in flight and this "
                             f"one adds {count} (prompts x n); the limit is {self.max_per_tenant} "
                             f"per key (--max-requests-per-tenant); retry later")
        self.held += count
        self.by_tenant[tenant] += count

    def release(self, tenant: str, count: int) -> None:
        self.held -= count
        self.by_tenant[tenant] -= count
        if self.by_tenant[tenant] <= 0:
            del self.by_tenant[tenant]

    def _busy(self, message: str) -> APIError:
        err = APIError(message, 429, "rate_limit_error", None, "too_many_requests")
        err.headers = {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}
        return err
