"""The publishing side (the engine): a ZMQ PUB socket bound (or connected), a replay ROUTER, an
optional CURVE key pair; built from the engine's --kv-events-* flags, fed by cache/events.py."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from kvserve.cache.background import drain, stop
from kvserve.cache.events import MEDIUM_DISK, Event, KVEventBuffer
from kvserve.config import EngineConfig
from kvserve.kv_events.curve_clients import ClientAllowlist, read_client_keys
from kvserve.kv_events.wire import (END_SEQ, ENCODINGS, Encoding, HashFormat, encode_batch,
                                    is_loopback, replay_endpoint_for)

log = logging.getLogger("kvserve.events")


def publisher_for(config: EngineConfig) -> KVEventPublisher:
    """The engine's publisher from its --kv-events-* flags (the topic's {model} and {port} are
    filled in by `kvserve serve`, which knows them: `set_topic`)."""
    curve = None
    if config.kv_events_curve_secret_file:
        try:
            with open(config.kv_events_curve_secret_file, "rb") as f:
                curve = CurveKeys.from_secret(f.read())
        except OSError as err:
            raise ValueError(f"cannot read --kv-events-curve-secret-file: {err}") from None
    clients = None
    if config.kv_events_curve_clients_file:
        if curve is None:
            raise ValueError("--kv-events-curve-clients-file lists the subscribers of a CURVE-encrypted "
                             "stream; give the server's key too (--kv-events-curve-secret-file)")
        clients = read_client_keys(config.kv_events_curve_clients_file)
    endpoint, replay = config.kv_events_endpoint, config.kv_events_replay_endpoint
    if replay is None:
        replay = replay_endpoint_for(endpoint) if config.kv_events_mode == "bind" else None
    elif replay == "off":
        replay = None
    return KVEventPublisher(endpoint, replay, topic=config.kv_events_topic,
                            encoding=config.kv_events_encoding,  # type: ignore[arg-type]
                            connect=config.kv_events_mode == "connect",
                            allow_remote=config.kv_events_allow_remote,
                            allow_plaintext=config.kv_events_allow_plaintext,
                            send_token_ids=config.kv_events_token_ids, curve=curve, curve_clients=clients)


def attach_tiers(events: KVEventBuffer, host, disk) -> None:
    """Host and disk tiers report the pages they take and drop into `events` with their media;
    pages already on disk (a restart) are announced once, location-only."""
    if host is not None:
        host.listener = events
    if disk is not None:
        disk.on_store = lambda page_hash: events.tier_stored(page_hash, MEDIUM_DISK)
        disk.on_evict = lambda page_hash: events.removed(page_hash, MEDIUM_DISK)
        for page_hash in disk.page_hashes():
            events.tier_stored(page_hash, MEDIUM_DISK)


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """A CURVE key pair (Z85 text, 40 characters each) from `zmq.curve_keypair()`."""

    public: bytes
    secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> CurveKeys:
        if not zmq.has("curve"):
            raise ValueError("this pyzmq/libzmq has no CURVE support")
        secret = secret.strip()
        try:
            return cls(zmq.curve_public(secret), secret)
        except (zmq.ZMQError, ValueError) as err:
            raise ValueError(f"not a CURVE secret key (40 Z85 characters): {err}") from None


def _curve_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = keys.secret, keys.public, True


class KVEventPublisher:
    """Publishes one batch per engine step on a ZMQ PUB socket bound at (or, `connect=True`,
    connected to) `endpoint` (e.g. `tcp://127.0.0.1:5557`; port `*` picks a free one, read it back
    from `.endpoint`), keeps the last `buffer_steps` batches, and answers replay requests on
    `replay_endpoint`. Sockets live on one background thread (ZMQ sockets are not thread-safe);
    `publish` only queues and never blocks: a full queue drops the batch and counts it, and
    subscribers see the gap in sequence numbers."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *,
                 buffer_steps: int = 10_000, topic: str = "", data_parallel_rank: int = 0,
                 hash_format: HashFormat = "int", encoding: Encoding = "array",
                 connect: bool = False, allow_remote: bool = False, allow_plaintext: bool = False,
                 send_token_ids: bool = True,
                 curve: CurveKeys | None = None, curve_clients: frozenset[bytes] | None = None,
                 max_queue_batches: int = 100_000,
                 hwm: int = 100_000) -> None:
        if hash_format not in ("int", "bytes"):
            raise ValueError(f"hash_format is 'int' or 'bytes', not {hash_format!r}")
        if encoding not in ENCODINGS:
            raise ValueError(f"--kv-events-encoding is array or map, not {encoding!r}")
        if connect and not is_loopback(endpoint) and curve is None and not allow_plaintext:
            raise ValueError(f"--kv-events-mode connect to {endpoint} would send KV events in plain text "
                             f"to another machine; set a CURVE key (--kv-events-curve-secret-file) or pass "
                             f"--kv-events-allow-plaintext")
        binds = [e for e in ((None if connect else endpoint), replay_endpoint) if e]
        exposed = [e for e in binds if not is_loopback(e)]
        if exposed and not (allow_remote or curve):
            raise ValueError(f"the KV events socket {exposed[0]} would be reachable from other "
                             f"machines and hands out every tenant's prompt tokens; bind a "
                             f"loopback address, set a CURVE key (--kv-events-curve-secret-file), "
                             f"or pass --kv-events-allow-remote (docs/scale-out.md)")
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.hash_format: HashFormat = hash_format
        self.encoding: Encoding = encoding
        self.send_token_ids = send_token_ids
        self.curve_public_key = None if curve is None else curve.public.decode()
        self.num_dropped = 0  # batches not published: queue full
        self.num_published = 0
        self.taps: list[Callable[[list[Event]], None]] = []  # also handed each step's events
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[tuple[float, list[Event]] | None] = queue.Queue(max_queue_batches)
        self._next_seq = 0
        # with a subscriber allowlist the sockets get a context of their own, whose ZAP handler it is
        self._ctx = zmq.Context() if curve_clients else zmq.Context.instance()
        self._allowlist = ClientAllowlist(self._ctx, curve_clients) if curve is not None and curve_clients else None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        _curve_server(self._pub, curve)
        self._replay = None
        try:
            if connect:
                self._pub.connect(endpoint)
                self.endpoint: str = endpoint
            else:
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                _curve_server(self._replay, curve)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as err:
            self._close_sockets()
            if self._allowlist is not None:
                self._allowlist.stop()
            raise ValueError(f"cannot {'connect' if connect else 'bind'} the KV events socket at "
                             f"{endpoint}{'' if replay_endpoint is None else ' / ' + replay_endpoint}: "
                             f"{err}; choose another address or port") from None
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()

    def set_topic(self, topic: str) -> None:
        """The topic of every later batch (and of replies to later replay requests)."""
        self.topic = topic.encode()

    def publish(self, events: Sequence[Event]) -> None:
        """Queue one step's events as one batch (nothing is sent for an empty step)."""
        if not events:
            return
        for tap in list(self.taps):  # the tenant view (server/kv_event_view.py): never blocks
            tap(list(events))
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
        if self._allowlist is not None:
            self._allowlist.stop()
            if not self._thread.is_alive():  # (term() would wait for sockets a late thread still holds)
                self._ctx.term()

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
        payload = encode_batch(events, ts, self.data_parallel_rank, self.hash_format, self.encoding,
                               self.send_token_ids)
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
                self._replay.send_multipart((identity, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", self.topic, END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
