"""What unfinished requests may hold at once: bytes of request bodies still being received (in
all, and per API key) and requests open per API key, each a cap answered with a 429 before any more
of the body is read.

A body's bytes count from the moment the front door (limits.BodyLimit) takes them from the socket
until the body is whole (then the route owns it and admission limits apply) or the request ends;
a key's requests count from its headers to its last response byte. Each client read from the
socket is at most uvicorn's 64 KiB window plus one 256 KiB read, so what a key can make the server
hold is bounded by `max_body_bytes_per_key` plus that window per open request, and the whole server
by `max_body_bytes` plus that window per connection. Memory given back after a burst is handed to
the OS with glibc's `malloc_trim`, at most once a second (freed body chunks otherwise stay in the
heap, and RSS would not come down).

Without API keys there is no key to count by: only the global byte cap applies.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time
from collections import Counter
from dataclasses import dataclass, field

CLIENT_KEY_SCOPE = "kvserve.client_key"  # set by auth.KeyGate: an id of the request's API key
DEFAULT_MAX_BODY_BYTES = 256 << 20
DEFAULT_MAX_BODY_BYTES_PER_KEY = 64 << 20
DEFAULT_MAX_REQUESTS_PER_KEY = 128
TRIM_AFTER_BYTES = 1 << 20  # released since the last trim
TRIM_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class InFlightCaps:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # --max-body-bytes-in-flight
    max_body_bytes_per_key: int = DEFAULT_MAX_BODY_BYTES_PER_KEY  # --max-body-bytes-per-key
    max_requests_per_key: int = DEFAULT_MAX_REQUESTS_PER_KEY  # --max-connections-per-key

    def check(self, max_request_bytes: int) -> None:
        """A cap under one whole body would refuse every large request: say which flag to raise."""
        for flag, value in (("--max-body-bytes-in-flight", self.max_body_bytes),
                            ("--max-body-bytes-per-key", self.max_body_bytes_per_key)):
            if value < max_request_bytes:
                raise ValueError(f"{flag} {value:,} is under --max-request-bytes {max_request_bytes:,}: "
                                 f"no body of the largest allowed size could arrive; raise {flag}")


@dataclass(frozen=True, slots=True)
class Refusal:
    message: str
    code: str


@dataclass(slots=True)
class InFlight:
    """The counters behind InFlightCaps; one per app, touched only on the event loop."""

    caps: InFlightCaps = field(default_factory=InFlightCaps)
    body_bytes: int = 0
    body_bytes_by_key: Counter = field(default_factory=Counter)
    requests_by_key: Counter = field(default_factory=Counter)
    peak_body_bytes: int = 0
    released_since_trim: int = 0
    last_trim: float = 0.0
    trim_pending: bool = False

    def open(self, key: str | None) -> Refusal | None:
        """Count a request of `key` from its headers, or say why not (nothing counted)."""
        if key is None:
            return None
        cap = self.caps.max_requests_per_key
        if self.requests_by_key[key] >= cap:
            return Refusal(f"this API key has {self.requests_by_key[key]} requests open; the limit is "
                           f"{cap} per key (--max-connections-per-key); retry when one ends",
                           "too_many_connections")
        self.requests_by_key[key] += 1
        return None

    def close(self, key: str | None) -> None:
        if key is None:
            return
        self.requests_by_key[key] -= 1
        if self.requests_by_key[key] <= 0:
            del self.requests_by_key[key]

    def take(self, key: str | None, size: int) -> Refusal | None:
        """Hold `size` more body bytes for `key`, or say which cap they would pass (nothing held)."""
        if key is not None and self.body_bytes_by_key[key] + size > self.caps.max_body_bytes_per_key:
            return Refusal(f"this API key's request bodies still arriving would pass "
                           f"{self.caps.max_body_bytes_per_key:,} bytes (--max-body-bytes-per-key); "
                           f"finish or close the uploads in progress, then retry", "body_bytes_in_flight")
        if self.body_bytes + size > self.caps.max_body_bytes:
            return Refusal(f"request bodies still arriving would pass {self.caps.max_body_bytes:,} "
                           f"bytes on this server (--max-body-bytes-in-flight); retry shortly",
                           "body_bytes_in_flight")
        self.body_bytes += size
        self.peak_body_bytes = max(self.peak_body_bytes, self.body_bytes)
        if key is not None:
            self.body_bytes_by_key[key] += size
        return None

    def give(self, key: str | None, size: int) -> None:
        """Release `size` body bytes; after a large release, hand freed heap back to the OS."""
        if size <= 0:
            return
        self.body_bytes -= size
        if key is not None:
            self.body_bytes_by_key[key] -= size
            if self.body_bytes_by_key[key] <= 0:
                del self.body_bytes_by_key[key]
        self.released_since_trim += size
        if self.released_since_trim >= TRIM_AFTER_BYTES and not self.trim_pending:
            self.trim_pending = True
            delay = max(0.05, self.last_trim + TRIM_EVERY_S - time.monotonic())
            trim_heap_later(delay, self._trimmed)

    def _trimmed(self) -> None:
        self.released_since_trim, self.last_trim, self.trim_pending = 0, time.monotonic(), False


def _libc_trim():
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _libc_trim()
_TRIMS: set[asyncio.Task] = set()


def trim_heap_later(delay_s: float, done) -> None:
    """malloc_trim(0) on a worker thread `delay_s` from now (the chunks just released are freed once
    the request's frames unwind; at most one trim a second), so the event loop never walks the heap;
    then `done()` on the loop."""
    if _TRIM is None:
        return done()
    loop = asyncio.get_running_loop()

    async def trim() -> None:
        try:
            await loop.run_in_executor(None, _TRIM, 0)
        finally:
            done()

    def start() -> None:
        task = loop.create_task(trim())
        _TRIMS.add(task)  # a task only the loop refers to may be collected mid-run
        task.add_done_callback(_TRIMS.discard)

    loop.call_later(delay_s, start)
