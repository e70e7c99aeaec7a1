"""The reading side (the router): a SUB socket that learns the past by replay, follows live batches
in sequence order and asks the replay socket for what it missed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from kvserve.kv_events.curve_clients import client_keys
from kvserve.kv_events.wire import WireEvent, decode_batch

log = logging.getLogger("kvserve.events")


def _curve_client(sock: zmq.Socket, server_key: str | None, own: tuple[bytes, bytes] | None) -> None:
    """CURVE as a client of `server_key`, with this subscriber's own key pair (one the publisher's
    allowlist names, curve_clients.py) or a fresh one."""
    if server_key:
        public, secret = own or zmq.curve_keypair()
        sock.curve_serverkey = server_key.encode()
        sock.curve_publickey, sock.curve_secretkey = public, secret


class KVEventSubscriber:
    """Follows one publisher on a thread: connects, replays everything it buffered (so a late
    subscriber learns what is already cached), then applies live batches in sequence order,
    asking the replay socket for the batches it missed. `on_events` gets each batch's events.
    `curve_server_key`: the publisher's CURVE public key, when it requires one; `curve_client_secret`:
    this subscriber's own CURVE secret key, when the publisher admits listed subscribers only."""

    def __init__(self, endpoint: str, replay_endpoint: str | None,
                 on_events: Callable[[list[WireEvent]], None], *, topic: str = "",
                 replay_timeout_s: float = 2.0, curve_server_key: str | None = None,
                 curve_client_secret: str | None = None) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.on_events = on_events
        self.topic = topic.encode()
        self.curve_server_key = curve_server_key
        self.curve_client = client_keys(curve_client_secret)
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
        _curve_client(sub, self.curve_server_key, self.curve_client)
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
        _curve_client(dealer, self.curve_server_key, self.curve_client)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(self.replay_timeout_ms):
                frames = dealer.recv_multipart()  # [b"", (topic,) seq, payload]: either layout
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
