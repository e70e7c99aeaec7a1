"""RedisTier: KV pages shared by every kvserve instance that points at one Redis (or Valkey).

A page lives under `kvserve:{model fingerprint}:{kv dtype}:{page size}:{name}`; the name comes
from the page hash, the chained hash of cache/hashing.py (namespace in the first page), the same in
every process, so instance B finds the pages instance A computed for the same tokens in the same
namespace. The value is a header, then the page's K/V bytes for all layers (made and read by the
engine; this module sees opaque bytes and never imports torch):

    offset  0  magic b"KVSP" | 4 version u16, reserved u16 | 8 payload length u64
           16  crc32 of the payload u32, reserved u32      | 24 payload (page_bytes)
           24 + page_bytes   MAC over key, header and payload (32 bytes, only with a secret)

With a shared secret (tier_auth.py: --kv-tier-secret-file or $KVSERVE_KV_TIER_SECRET) the name is a
keyed hash of the page hash and every value carries a keyed MAC: a writer without the secret can
neither guess which key holds which prompt nor plant a page that verifies. Without one, the name is
the page hash in hex and the tier trusts every writer (start-up says so).

Writes: `offer` puts pages on a bounded queue that a background thread drains with pipelined SETs
(no expiry: Redis's own `maxmemory` + `maxmemory-policy allkeys-lru` is the capacity policy; a page
pinned for 24h retention is written with the pin's TTL, and `expire` sets it on pages already there); when
the queue is full the page is dropped and counted, the caller never waits. `put_many` writes
synchronously (a prefill instance, whose decode instance reads the pages next).
Reads: `fetch` asks for the pages after a local hit with one MGET (per `batch_pages`) under a short
socket timeout, and keeps the leading run of valid values.
Faults: Redis down, slow or full, a value with a wrong magic, size, checksum or MAC: each is a miss,
counted in `stats.errors`, never an exception. After a failed call the tier is skipped for
`backoff_s`, doubling with each failure in a row up to `max_backoff_s` (a dead or hung Redis costs
one timeout per period, not one per engine step); redis-py opens a new connection on the next call
after that, and a success resets the backoff.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.cache.pins import PinLedger
from kvserve.cache.tier_auth import TierAuth, default_auth
from kvserve.cache.tiers import page_hashes_from

log = logging.getLogger("kvserve.redis")

MAGIC = b"KVSP"
VERSION = 1
HEADER = struct.Struct("<4sHHQII")  # magic, version, reserved, payload length, crc32, reserved
KEY_PREFIX = "kvserve"
Payload = bytes | bytearray | memoryview | Any  # anything with the buffer protocol (a numpy row)


_NO_AUTH = TierAuth(None)


def pack_page(payload: Payload, auth: TierAuth = _NO_AUTH, key: str = "") -> bytes:
    """Header + payload (+ MAC of key, header and payload with a secret): one page's stored value."""
    view = memoryview(payload).cast("B")
    header = HEADER.pack(MAGIC, VERSION, 0, view.nbytes, zlib.crc32(view), 0)
    return b"".join((header, view, auth.tag(key, header, view)))


def unpack_page(value: bytes, page_bytes: int, auth: TierAuth = _NO_AUTH,
                key: str = "") -> memoryview | None:
    """The payload of a stored value, or None if its magic, version, size, checksum or MAC is
    wrong."""
    if len(value) != HEADER.size + page_bytes + auth.tag_bytes:
        return None
    magic, version, _, length, crc, _ = HEADER.unpack_from(value)
    view = memoryview(value)
    payload = view[HEADER.size:HEADER.size + page_bytes]
    if magic != MAGIC or version != VERSION or length != page_bytes or zlib.crc32(payload) != crc:
        return None
    if auth.enabled and auth.open(key, view) is None:
        return None
    return payload


@dataclass(slots=True)
class RedisTierStats:
    queries: int = 0  # MGET round trips
    hits: int = 0  # valid pages returned by fetch
    errors: int = 0  # failed calls and rejected values (each one a miss or a lost write)
    writes: int = 0  # pages stored
    drops: int = 0  # pages not written: queue full, or Redis unreachable
    skipped: int = 0  # calls not made while backing off after an error


class RedisTier:
    """Pages of one model / KV dtype / page size in Redis at `url`. Thread-safe: the engine thread
    calls fetch/offer/put_many, the writer thread drains the queue."""

    def __init__(self, url: str, *, fingerprint: str, kv_dtype: str, page_size: int, page_bytes: int,
                 timeout_s: float = 0.25, write_timeout_s: float = 2.0, backoff_s: float = 1.0,
                 max_backoff_s: float = 16.0, queue_bytes: int = 256 << 20, batch_pages: int = 128, write_batch_pages: int = 16,
                 known_pages: int = 1 << 16, auth: TierAuth | None = None) -> None:
        self.auth = auth if auth is not None else default_auth()
        if not self.auth.enabled:
            log.warning("the Redis KV tier trusts every writer: anyone who can write to %s can change "
                        "other users' outputs, and key names reveal prompts; set "
                        "--kv-tier-secret-file or $KVSERVE_KV_TIER_SECRET", _redact(url))
        self.prefix = f"{KEY_PREFIX}:{fingerprint}:{kv_dtype}:{page_size}:"
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.batch_pages = batch_pages
        self.write_batch_pages = write_batch_pages
        self.stats = RedisTierStats()
        self.pins: PinLedger | None = None  # 24h retention (cache/pins.py): pinned pages get a TTL
        # no retries inside redis-py: a failed call is a miss now, and the backoff decides when to
        # try again. Timeouts in the URL (?socket_timeout=0.05) win over these defaults.
        no_retry = Retry(NoBackoff(), 0)
        self._reader = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s, retry=no_retry)
        self._writer = redis.Redis.from_url(url, socket_timeout=write_timeout_s,
                                            socket_connect_timeout=timeout_s, retry=no_retry)
        self._lock = threading.Lock()  # stats, _known, _down_until, _failures
        self._down_until = 0.0
        self._failures = 0  # failed calls in a row
        # hashes Redis holds as far as we know (written or read here): not offered again
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._known_limit = known_pages
        self._queue: queue.Queue[tuple[bytes, Payload] | None] = queue.Queue(
            maxsize=max(1, queue_bytes // max(page_bytes, 1)))
        self._thread = threading.Thread(target=self._write_loop, name="kvserve-redis-writer",
                                        daemon=True)
        self._thread.start()

    def key(self, page_hash: bytes) -> str:
        return self.prefix + self.auth.key_for(page_hash)

    # -- reads ---------------------------------------------------------------------------------
    def fetch(self, token_ids: Sequence[int], namespace: str, start_page: int,
              max_pages: int) -> list[memoryview]:
        """Payloads of full pages start_page, start_page + 1, ... of `token_ids` (at most
        `max_pages`), up to the first one Redis does not hold (or holds damaged)."""
        return self.get_pages(page_hashes_from(token_ids, self.page_size, namespace, start_page, max_pages))

    def get_pages(self, hashes: list[bytes]) -> list[memoryview]:
        """Payloads of the leading run of `hashes` that Redis holds, valid."""
        if not hashes or not self._usable():
            return []
        found: list[memoryview] = []
        try:
            for i in range(0, len(hashes), self.batch_pages):
                chunk = hashes[i:i + self.batch_pages]
                values = self._reader.mget([self.key(h) for h in chunk])
                self._count(queries=1)
                self._succeeded()
                for page_hash, value in zip(chunk, values):
                    key = self.key(page_hash)
                    payload = (None if value is None
                               else unpack_page(value, self.page_bytes, self.auth, key))
                    if payload is None:
                        if value is not None:
                            log.warning("damaged or unauthenticated page %s in Redis (%d bytes): "
                                        "recomputing it", key, len(value))
                            self._count(errors=1)
                        return found
                    found.append(payload)
                    self._remember([page_hash])
        except (redis.RedisError, OSError) as err:
            self._failed("read", err)
        finally:
            self._count(hits=len(found))
        return found

    # -- writes --------------------------------------------------------------------------------
    def is_known(self, page_hash: bytes) -> bool:
        with self._lock:
            return page_hash in self._known

    def offer(self, items: list[tuple[bytes, Payload]]) -> int:
        """Queue pages for the background writer, never waiting; returns how many were queued (the
        rest are dropped: queue full, or Redis unreachable)."""
        if not self._usable():
            self._count(drops=len(items))
            return 0
        queued = dropped = 0
        for page_hash, payload in items:
            if self.is_known(page_hash):
                continue
            try:
                self._queue.put_nowait((page_hash, payload))
            except queue.Full:
                dropped += 1
                continue
            self._remember([page_hash])
            queued += 1
        self._count(drops=dropped)
        return queued

    def put_many(self, items: list[tuple[bytes, Payload]]) -> int:
        """Write pages now (pipelined), on the caller's thread; returns how many were stored."""
        if not items:
            return 0
        if not self._usable():
            self._count(drops=len(items))
            return 0
        return self._write(items)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queue is written (or dropped); False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to `timeout`), stop the writer, close the connections."""
        if self._thread.is_alive():
            self.flush(timeout)
            self._queue.put(None)
            self._thread.join(timeout)
        self._reader.close()
        self._writer.close()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            batch = [] if item is None else [item]
            while item is not None and len(batch) < self.write_batch_pages:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    batch.append(item)
            try:
                if batch and self._usable():
                    self._write(batch)
                elif batch:
                    self._forget([h for h, _ in batch])
                    self._count(drops=len(batch))
            except Exception:  # never let the writer die
                log.exception("Redis writer failed")
            finally:
                for _ in range(len(batch) + (item is None)):
                    self._queue.task_done()
            if item is None:
                return

    def _write(self, items: list[tuple[bytes, Payload]]) -> int:
        pipe = self._writer.pipeline(transaction=False)
        for page_hash, payload in items:
            key = self.key(page_hash)
            ttl = self.pins.remaining_s(page_hash) if self.pins is not None else 0.0
            pipe.set(key, pack_page(payload, self.auth, key), ex=max(1, int(ttl)) if ttl else None)
        try:
            results = pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as err:
            self._forget([h for h, _ in items])
            self._count(drops=len(items))
            self._failed("write", err)
            return 0
        failed = [h for (h, _), r in zip(items, results) if isinstance(r, Exception)]
        stored = len(items) - len(failed)
        self._count(writes=stored)
        self._succeeded()
        if failed:  # e.g. OOM: maxmemory reached with a noeviction policy
            self._forget(failed)
            self._count(drops=len(failed))
            error = next(r for r in results if isinstance(r, Exception))
            self._failed("write", error)
        else:
            self._remember([h for h, _ in items])
        return stored

    def expire(self, hashes: list[bytes], ttl_s: float) -> int:
        """Give the pages Redis already holds a TTL of `ttl_s` (a 24h retention pin; pages not there
        yet get it when they are written); returns how many were there. Those missing are forgotten,
        so a later commit offers them again."""
        if not hashes or not self._usable():
            return 0
        pipe = self._writer.pipeline(transaction=False)
        for page_hash in hashes:
            pipe.expire(self.key(page_hash), max(1, int(ttl_s)))
        try:
            results = pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as err:
            self._failed("write", err)
            return 0
        self._succeeded()
        self._forget([h for h, r in zip(hashes, results) if r is not True and r != 1])
        return sum(1 for r in results if r is True or r == 1)

    # -- Tier protocol (by page hash) ----------------------------------------------------------
    def get(self, page_hash: bytes) -> memoryview | None:
        pages = self.get_pages([page_hash])
        return pages[0] if pages else None

    def put(self, page_hash: bytes, payload: Payload) -> bool:
        return self.put_many([(page_hash, payload)]) == 1

    def contains(self, page_hash: bytes) -> bool:
        if not self._usable():
            return False
        try:
            found = bool(self._reader.exists(self.key(page_hash)))
            self._succeeded()
            return found
        except (redis.RedisError, OSError) as err:
            self._failed("read", err)
            return False

    # -- health and bookkeeping ----------------------------------------------------------------
    def available(self) -> bool:
        """False while backing off after an error."""
        with self._lock:
            return time.monotonic() >= self._down_until

    def _usable(self) -> bool:
        if self.available():
            return True
        self._count(skipped=1)
        return False

    def _failed(self, what: str, err: BaseException) -> None:
        with self._lock:
            self.stats.errors += 1
            first = self._failures == 0
            delay = min(self.backoff_s * 2 ** self._failures, self.max_backoff_s)
            self._failures += 1
            self._down_until = time.monotonic() + delay
            self._known.clear()  # Redis may come back empty (restarted): offer pages again
        if first:
            log.warning("Redis %s failed (%s: %s); skipping the shared tier for %.1f s",
                        what, type(err).__name__, err, delay)

    def _succeeded(self) -> None:
        with self._lock:
            if self._failures:
                log.info("Redis is reachable again")
            self._failures = 0

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def _remember(self, hashes: list[bytes]) -> None:
        with self._lock:
            for page_hash in hashes:
                self._known[page_hash] = None
                self._known.move_to_end(page_hash)
            while len(self._known) > self._known_limit:
                self._known.popitem(last=False)

    def _forget(self, hashes: list[bytes]) -> None:
        with self._lock:
            for page_hash in hashes:
                self._known.pop(page_hash, None)

    def engine_stats(self) -> dict[str, int]:
        """The engine's `remote_cache_*` stats keys."""
        with self._lock:
            return {f"remote_cache_{name}": value for name, value in asdict(self.stats).items()}


def _redact(url: str) -> str:
    """The URL without a password (redis://:secret@host)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url
