"""Reading a backend's answer without waiting on a hung one: every read has a deadline (the first
byte, then each next chunk), and a backend marked down (its health checks stopped answering) ends
the reads still waiting on it at once, so their requests can move to another backend.

Deadlines are `asyncio.timeout` scopes in the reading task itself; marking a backend down
reschedules the scopes registered on its `Alarm` to now.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


class Stalled(Exception):
    """A backend sent nothing within the deadline, or was marked down while a read waited on it."""


class TooLarge(Exception):
    """A backend's answer passed the size the router accepts."""


@dataclass(frozen=True, slots=True)
class ReadTimeouts:
    first_byte_s: float | None = 60.0  # to the answer's head and, for a stream, its first output
    between_chunks_s: float | None = 30.0  # between two chunks of a stream past its first output
    whole_s: float | None = 600.0  # for a whole (not streamed) answer, which comes at its end


@dataclass(slots=True)
class Alarm:
    """The reads waiting on one backend; `ring` (the backend is down) ends them all now."""
    waiting: set[asyncio.Timeout] = field(default_factory=set)
    rings: int = 0

    def ring(self) -> None:
        self.rings += 1
        now = asyncio.get_running_loop().time()
        for deadline in list(self.waiting):
            deadline.reschedule(now)


async def within(awaitable: Awaitable[T], seconds: float | None, alarm: Alarm | None,
                 what: str = "the backend's answer") -> T:
    """`await awaitable`, raising Stalled after `seconds` (None: no limit) or when `alarm` rings."""
    rings = alarm.rings if alarm is not None else 0
    deadline = asyncio.timeout(seconds)
    try:
        async with deadline:
            if alarm is not None:
                alarm.waiting.add(deadline)
            try:
                return await awaitable
            finally:
                if alarm is not None:
                    alarm.waiting.discard(deadline)
    except TimeoutError:
        if not deadline.expired():
            raise  # the awaitable's own
        if alarm is not None and alarm.rings != rings:
            raise Stalled(f"the backend was marked down while waiting for {what}") from None
        raise Stalled(f"no byte of {what} within {seconds:g} s") from None


async def timed_chunks(chunks: AsyncIterator[bytes], seconds: Callable[[], float | None],
                       alarm: Alarm | None) -> AsyncIterator[bytes]:
    """`chunks`, each awaited within `seconds()` (asked anew per chunk: the first output may have
    a longer deadline than the chunks after it)."""
    iterator = chunks.__aiter__()
    while True:
        try:
            chunk = await within(iterator.__anext__(), seconds(), alarm, "the next chunk")
        except StopAsyncIteration:
            return
        yield chunk


async def read_capped(chunks: AsyncIterator[bytes], max_bytes: int) -> bytes:
    """The whole body of `chunks`, raising TooLarge past `max_bytes`."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"the backend's answer passed {max_bytes:,} bytes")
        parts.append(chunk)
    return b"".join(parts)
