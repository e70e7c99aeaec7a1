"""A tenant's view of the KV event stream: `GET /v1/kv_events` streams (SSE) the engine's KV events of
the caller's own pages only, so a tenant's API key never sees another tenant's block hashes or tokens,
whatever the ZMQ socket's encryption. An admin key (or a server without keys) sees every event.

The ZMQ stream (kv_events/) stays as llm-d, Dynamo and kvserve router read it; it has no notion of
API keys, which is why it is the operator's (loopback, CURVE) and this route is the tenants'. Events
come from the publisher's taps on the engine thread: each subscriber gets the events whose `tenant`
(cache/events.py) is its own (plus AllBlocksCleared, which is everyone's), queued for the event loop.
A subscriber that falls `max_batches` behind loses batches; the next one it gets counts them in
`dropped`. Each SSE event is one engine step:

    data: {"seq": 3, "ts": 1733..., "dropped": 0, "events": [{"type": "BlockStored",
           "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...], "block_size": 16,
           "lora_id": null, "medium": "GPU", "lora_name": null}, ...]}

Hashes are the ZMQ stream's (its --kv-events hash format); token ids are the tenant's own prompt.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvserve.cache.events import AllBlocksCleared, Event
from kvserve.kv_events import KVEventPublisher, encode_event

DEFAULT_MAX_BATCHES = 1000
KEEPALIVE_S = 15.0


@dataclass(slots=True)
class Subscription:
    """One listener: `tenant` None sees every event."""

    tenant: str | None
    loop: asyncio.AbstractEventLoop
    max_batches: int = DEFAULT_MAX_BATCHES
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_dropped: int = 0

    def offer(self, events: list[Event]) -> None:
        """On the engine thread: keep this subscriber's events of one step, never blocking."""
        mine = [e for e in events if self.tenant is None or isinstance(e, AllBlocksCleared)
                or getattr(e, "tenant", None) == self.tenant]
        if mine:
            try:
                self.loop.call_soon_threadsafe(self._put, time.time(), mine)
            except RuntimeError:  # the server's loop is closed: nobody is listening any more
                pass

    def _put(self, ts: float, events: list[Event]) -> None:
        if self.queue.qsize() >= self.max_batches:
            self.num_dropped += 1
            return
        self.queue.put_nowait((ts, events))


class TenantEventView:
    """The taps on one publisher: subscribe, stream, unsubscribe."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher

    def subscribe(self, tenant: str | None) -> Subscription:
        subscription = Subscription(tenant, asyncio.get_running_loop())
        self.publisher.taps.append(subscription.offer)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        try:
            self.publisher.taps.remove(subscription.offer)
        except ValueError:
            pass

    async def stream(self, tenant: str | None) -> AsyncIterator[bytes]:
        """SSE lines of `tenant`'s events (None: all) until the client leaves (the response is
        cancelled); a comment every KEEPALIVE_S so proxies keep the connection. Subscribed here,
        when the response starts, so a client gone before that leaves no tap behind."""
        publisher = self.publisher
        subscription = self.subscribe(tenant)
        seq = 0
        try:
            yield b": kvserve kv events\n\n"
            while True:
                try:
                    ts, events = await asyncio.wait_for(subscription.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": keepalive\n\n"
                    continue
                dropped, subscription.num_dropped = subscription.num_dropped, 0
                encoded = [encode_event(e, publisher.hash_format, "map",
                                        subscription.tenant is not None or publisher.send_token_ids)
                           for e in events]
                batch = {"seq": seq, "ts": ts, "dropped": dropped, "events": [_jsonable(e) for e in encoded]}
                seq += 1
                yield b"data: " + json.dumps(batch).encode() + b"\n\n"
        finally:
            self.unsubscribe(subscription)


def _jsonable(value):
    """msgpack-ready values as JSON: bytes hashes (hash_format "bytes") as hex."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
