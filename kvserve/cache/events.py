"""KV events in vLLM's wire schema (msgpack over ZMQ PUB, sequence numbers, a replay socket), so a
router built for vLLM's events (Dynamo, llm-d, kvserve's own) can follow which pages an instance holds.

Wire format, as vLLM's `ZmqEventPublisher` with its msgspec structs (`array_like=True`, `tag=True`):

    multipart message   [topic, seq (8-byte big-endian), payload]
    payload             msgpack [ts, [event, ...], data_parallel_rank]
    BlockStored         ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                         lora_id, medium]
    BlockRemoved        ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared    ["AllBlocksCleared"]

Block hashes go out as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the
digest read big-endian, masked to its low 64 bits, an unsigned int; `hash_format="bytes"` sends the
whole 16-byte page hash instead. Page hashes already carry the tenant namespace (cache/hashing.py),
so events reveal no namespace and equal tokens of two tenants are two unrelated hashes.

Replay: a ROUTER socket answers a request frame holding a start sequence number (8 bytes
big-endian) with every buffered batch from there on, each as [seq, payload], then [-1, b""].
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgpack
import zmq

from kvserve.cache.background import drain, stop

log = logging.getLogger("kvserve.events")

# where a page lives; vLLM says "GPU"/"CPU", kvserve names its own tiers
MEDIUM_POOL, MEDIUM_HOST, MEDIUM_DISK, MEDIUM_REDIS = "pool", "host", "disk", "redis"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
HashFormat = Literal["int", "bytes"]


def external_hash(page_hash: bytes, hash_format: HashFormat = "int") -> int | bytes:
    """A page hash as it goes on the wire (vLLM's `maybe_convert_block_hash`)."""
    if hash_format == "bytes":
        return bytes(page_hash)
    return int.from_bytes(page_hash, "big") & ((1 << 64) - 1)


def replay_endpoint_for(endpoint: str) -> str:
    """The replay socket's default address: the events port + 1 (`tcp://h:5557` -> `tcp://h:5558`);
    a free port when the events port is `*`; `ipc://x` -> `ipc://x-replay`."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port == "*":
            return endpoint
        if not port.isdigit():
            raise ValueError(f"--kv-events-endpoint {endpoint!r}: expected tcp://HOST:PORT")
        return f"{host}:{int(port) + 1}"
    return endpoint + "-replay"


@dataclass(slots=True)
class BlockStored:
    page_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]  # all pages' tokens, in order: len == len(page_hashes) * page_size
    page_size: int
    medium: str = MEDIUM_POOL
    lora_id: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    page_hashes: list[bytes]
    medium: str = MEDIUM_POOL


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def encode_event(event: Event, hash_format: HashFormat = "int") -> list:
    def ext(hashes: Sequence[bytes]) -> list[int | bytes]:
        return [external_hash(h, hash_format) for h in hashes]

    if isinstance(event, BlockStored):
        parent = None if event.parent_hash is None else external_hash(event.parent_hash, hash_format)
        return ["BlockStored", ext(event.page_hashes), parent, list(event.token_ids),
                event.page_size, event.lora_id, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", ext(event.page_hashes), event.medium]
    return ["AllBlocksCleared"]


def encode_batch(events: Sequence[Event], ts: float, data_parallel_rank: int = 0,
                 hash_format: HashFormat = "int") -> bytes:
    """One KVEventBatch payload."""
    return msgpack.packb([ts, [encode_event(e, hash_format) for e in events], data_parallel_rank],
                         use_bin_type=True)


class KVEventBuffer:
    """Collects one engine step's cache changes as events; `drain()` hands them over once per step.
    Consecutive commits of one chain (each page's parent is the previous page) merge into one
    BlockStored, and consecutive removals of one medium into one BlockRemoved, as vLLM batches them.
    Thread-safe: a tier's writer thread may report a page it dropped."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def stored(self, page_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int],
               medium: str = MEDIUM_POOL) -> None:
        """A full page became cached (indexed) in `medium`."""
        if len(token_ids) != self.page_size:
            raise ValueError(f"a stored page holds {self.page_size} tokens, got {len(token_ids)}")
        with self._lock:
            last = self.events[-1] if self.events else None
            if (isinstance(last, BlockStored) and last.medium == medium
                    and last.page_hashes[-1] == parent_hash):
                last.page_hashes.append(page_hash)
                last.token_ids.extend(token_ids)
                return
            self.events.append(BlockStored([page_hash], parent_hash, list(token_ids),
                                           self.page_size, medium))

    def removed(self, page_hash: bytes, medium: str = MEDIUM_POOL) -> None:
        """A cached page left `medium` (evicted, dropped, or reused for other tokens)."""
        with self._lock:
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved) and last.medium == medium:
                last.page_hashes.append(page_hash)
                return
            self.events.append(BlockRemoved([page_hash], medium))

    def cleared(self) -> None:
        """Every cached page of every medium is gone (prefix cache reset): earlier events void."""
        with self._lock:
            self.events = [AllBlocksCleared()]

    def drain(self) -> list[Event]:
        with self._lock:
            events, self.events = self.events, []
        return events


class KVEventPublisher:
    """Publishes one batch per engine step on a ZMQ PUB socket bound at `endpoint` (e.g.
    `tcp://127.0.0.1:5557`; port `*` picks a free one, read it back from `.endpoint`), keeps the last
    `buffer_steps` batches, and answers replay requests on `replay_endpoint`. Sockets live on one
    background thread (ZMQ sockets are not thread-safe); `publish` only queues and never blocks: a
    full queue drops the batch and counts it, and subscribers see the gap in sequence numbers."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *,
                 buffer_steps: int = 10_000, topic: str = "", data_parallel_rank: int = 0,
                 hash_format: HashFormat = "int", max_queue_batches: int = 100_000,
                 hwm: int = 100_000) -> None:
        if hash_format not in ("int", "bytes"):
            raise ValueError(f"hash_format is 'int' or 'bytes', not {hash_format!r}")
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.hash_format: HashFormat = hash_format
        self.num_dropped = 0  # batches not published: queue full
        self.num_published = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[tuple[float, list[Event]] | None] = queue.Queue(max_queue_batches)
        self._next_seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as err:
            self._close_sockets()
            raise ValueError(f"cannot bind the KV events socket at {endpoint}"
                             f"{'' if replay_endpoint is None else ' / ' + replay_endpoint}: {err}; "
                             f"choose another address or port") from None
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[Event]) -> None:
        """Queue one step's events as one batch (nothing is sent for an empty step)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), list(events)))
        except queue.Full:
            self.num_dropped += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch is sent; False if `timeout` passed first."""
        return drain(self._queue, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        stop(self._queue, self._thread, timeout)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                try:
                    if item is None:
                        return
                    self._send(*item)
                except Exception:  # never let the publisher thread die
                    log.exception("publishing KV events failed")
                finally:
                    self._queue.task_done()
        finally:
            self._close_sockets()

    def _send(self, ts: float, events: list[Event]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(events, ts, self.data_parallel_rank, self.hash_format)
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.num_published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # [identity, b"", start seq]
            log.warning("ignoring a malformed KV events replay request (%d frames)", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


# -- the reading side (the router) ---------------------------------------------------------------
@dataclass(slots=True)
class WireEvent:
    """One decoded event; hashes as they came (int, or bytes with hash_format="bytes")."""

    kind: str  # "BlockStored" | "BlockRemoved" | "AllBlocksCleared"
    hashes: list[int | bytes] = field(default_factory=list)
    medium: str | None = None
    parent: int | bytes | None = None
    token_ids: list[int] = field(default_factory=list)


def decode_batch(payload: bytes) -> list[WireEvent]:
    """The events of one KVEventBatch payload (vLLM's array form); unknown event kinds are skipped."""
    _, events, *_ = msgpack.unpackb(payload, raw=False)
    decoded = []
    for tag, *values in events:
        values += [None] * 6  # trailing fields with defaults may be omitted
        if tag == "BlockStored":
            decoded.append(WireEvent(tag, list(values[0]), values[5], values[1], list(values[2])))
        elif tag == "BlockRemoved":
            decoded.append(WireEvent(tag, list(values[0]), values[1]))
        elif tag == "AllBlocksCleared":
            decoded.append(WireEvent(tag))
    return decoded


class KVEventSubscriber:
    """Follows one publisher on a thread: connects, replays everything it buffered (so a late
    subscriber learns what is already cached), then applies live batches in sequence order,
    asking the replay socket for the batches it missed. `on_events` gets each batch's events."""

    def __init__(self, endpoint: str, replay_endpoint: str | None,
                 on_events: Callable[[list[WireEvent]], None], *, topic: str = "",
                 replay_timeout_s: float = 2.0) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.on_events = on_events
        self.topic = topic.encode()
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.last_seq = -1
        self.num_batches = self.num_replayed = self.num_missed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-subscriber", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        try:
            sub.connect(self.endpoint)
            self._replay(ctx, 0)
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq > self.last_seq + 1:
                    self._replay(ctx, self.last_seq + 1)
                self._take(seq, frames[2])
        except Exception:  # a bad endpoint or payload: this backend is routed without its events
            log.exception("KV events subscriber for %s stopped", self.endpoint)
        finally:
            sub.close(linger=0)

    def _replay(self, ctx: zmq.Context, start: int) -> None:
        if self.replay_endpoint is None:
            return
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(self.replay_timeout_ms):
                frames = dealer.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == -1:
                    return
                self.num_replayed += 1
                self._take(seq, frames[-1])
            log.warning("no KV events replay from %s", self.replay_endpoint)
        finally:
            dealer.close(linger=0)

    def _take(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return  # already applied (a live copy of a replayed batch)
        self.num_missed += seq - self.last_seq - 1  # lost for good: beyond the replay buffer
        self.last_seq = seq
        self.num_batches += 1
        self.on_events(decode_batch(payload))
