"""DiskTier: page payloads in files by page hash, within a byte budget (least recently used dropped
first), that survive restarts: the index is rebuilt from the directory at start-up.

Layout: `{path}/{layout id}/{hash hex[:2]}/{hash hex}.kvp`, where the layout id is a digest of the
`layout` string (model fingerprint : KV dtype : page size, as the Redis key), so two models never
read each other's pages. A file is a header, then the payload:

    offset  0  magic b"KVDP" | 4 version u16 | 6 seal algorithm u16 | 8 payload length u64
           16  page hash length u8, 7 zero bytes | 24 page hash (32 bytes, zero-padded)
           56  tag (32 bytes, zero-padded)       | 88 payload (page_bytes)

The tag seals (layout, page hash, payload): `Blake2bChecksum` by default; `KeyedBlake2b(secret)`
(or any `PageSealer`, e.g. one from a TierAuth) makes it a MAC. A file whose header, length or tag
is wrong is deleted and counted in `stats.corrupt`, and the read is a miss (the engine recomputes).
Pages pinned in `pins` (24h retention, cache/pins.py) are skipped by the LRU until their pins expire.
Writes go to a bounded queue that a background thread drains (temp file + rename, so a crash leaves
either the old state or the whole page); a page is readable from the queue until it is on disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvserve.cache.background import drain, stop
from kvserve.cache.log_limit import LogLimit
from kvserve.cache.pins import PinLedger
from kvserve.cache.stats import DiskTierStats
from kvserve.cache.tier_auth import TierAuth

log = logging.getLogger("kvserve.disk")

MAGIC = b"KVDP"
VERSION = 1
HEADER = struct.Struct("<4sHHQB7x32s32s")  # magic, version, algorithm, length, hash len, hash, tag
SUFFIX = ".kvp"


class PageSealer(Protocol):
    """Makes the tag that proves a page file is whole (and, keyed, that this deployment wrote it)."""

    algorithm: int  # stored in the header: a file sealed another way is rejected

    def tag(self, layout: bytes, page_hash: bytes, payload: memoryview) -> bytes: ...  # <= 32 bytes


@dataclass(frozen=True)
class Blake2bChecksum:
    algorithm: int = 1

    def tag(self, layout: bytes, page_hash: bytes, payload: memoryview) -> bytes:
        return _blake2b(b"", layout, page_hash, payload)


@dataclass(frozen=True)
class KeyedBlake2b:
    """A keyed MAC (blake2b with a key of up to 64 bytes): a page file forged or moved by someone
    without the secret is rejected like a corrupt one."""

    secret: bytes
    algorithm: int = 2

    def __post_init__(self) -> None:
        if not 1 <= len(self.secret) <= 64:
            raise ValueError("the disk tier's MAC secret must be 1 to 64 bytes")

    def tag(self, layout: bytes, page_hash: bytes, payload: memoryview) -> bytes:
        return _blake2b(self.secret, layout, page_hash, payload)


@dataclass(frozen=True)
class TierAuthSealer:
    """The shared tier secret (tier_auth.TierAuth, --kv-tier-secret-file) as the disk tier's MAC."""

    auth: TierAuth
    algorithm: int = 3

    def tag(self, layout: bytes, page_hash: bytes, payload: memoryview) -> bytes:
        parts = (len(layout).to_bytes(4, "little"), layout, len(page_hash).to_bytes(4, "little"), page_hash)
        return self.auth.tag("disk", *parts, payload)


def _blake2b(key: bytes, layout: bytes, page_hash: bytes, payload: memoryview) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=32, person=b"kvserve-disk")
    h.update(struct.pack("<I", len(layout)) + layout + struct.pack("<I", len(page_hash)) + page_hash)
    h.update(payload)
    return h.digest()


class DiskTier:
    """Pages of `page_bytes` each under `path`, at most `capacity_bytes` of files. Thread-safe: the
    engine thread calls get/put/contains, the writer thread writes and deletes files."""

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, page_bytes: int, *,
                 layout: str = "", sealer: PageSealer | None = None,
                 queue_bytes: int = 64 << 20,
                 on_evict: Callable[[bytes], None] | None = None,
                 on_store: Callable[[bytes], None] | None = None,
                 pins: PinLedger | None = None) -> None:
        if page_bytes < 1:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.page_bytes = page_bytes
        self.file_bytes = HEADER.size + page_bytes
        self.capacity_pages = max(0, capacity_bytes) // self.file_bytes
        self.layout = layout.encode()
        self.sealer: PageSealer = sealer or Blake2bChecksum()
        self.root = Path(path) / hashlib.blake2b(self.layout, digest_size=8).hexdigest()
        self.stats = DiskTierStats()
        self.pins = pins  # 24h retention (cache/pins.py): pinned pages are never the LRU victim
        # told (page_hash) of every page that leaves the tier: budget, corruption, write failure
        # (the KV events' BlockRemoved(medium="disk")); called without the tier's lock held
        self.on_evict = on_evict
        self.on_store = on_store  # told (page_hash) of every page taken (BlockStored(medium="STORAGE"))
        self._lock = threading.Lock()  # _index, _pending, stats
        self._warn = LogLimit(log)  # a failing disk fails every page: one line per kind every 10 s
        self._index: OrderedDict[bytes, None] = OrderedDict()  # pages on disk or queued, LRU first
        self._pending: dict[bytes, bytes] = {}  # queued, not yet on disk
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(
            maxsize=max(1, queue_bytes // page_bytes))
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"cannot use {path} for the disk tier: {err}") from None
        self._load_index()
        self._thread = threading.Thread(target=self._write_loop, name="kvserve-disk-writer",
                                        daemon=True)
        self._thread.start()

    def file_of(self, page_hash: bytes) -> Path:
        name = page_hash.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def page_hashes(self) -> list[bytes]:
        """Every page held, least recently used first (e.g. to announce them after a restart)."""
        with self._lock:
            return list(self._index)

    @property
    def num_pages(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.file_bytes

    # -- Tier protocol ----------------------------------------------------------------------------
    def put(self, page_hash: bytes, payload: Any) -> bool:
        """Take the page (copied now, written by the writer thread); False if the tier has no room
        or the write queue is full."""
        view = memoryview(payload).cast("B")
        if view.nbytes != self.page_bytes:
            raise ValueError(f"a disk page is {self.page_bytes} bytes, got {view.nbytes}")
        if self.capacity_pages == 0:
            return False
        with self._lock:
            if page_hash in self._index:
                self._index.move_to_end(page_hash)
                return True
            data = bytes(view)
            try:
                self._queue.put_nowait((page_hash, data))
            except queue.Full:
                self.stats.drops += 1
                return False
            self._pending[page_hash] = data
            self._index[page_hash] = None
            victims = self._make_room()
        for victim in victims:  # a queued write of a victim sees it gone and skips itself
            self._remove(self.file_of(victim))
            self._evicted(victim)
        if self.on_store is not None and page_hash not in victims:
            self._tell(self.on_store, page_hash)
        return True

    def get(self, page_hash: bytes) -> bytes | None:
        with self._lock:
            if page_hash not in self._index:
                self.stats.misses += 1
                return None
            self._index.move_to_end(page_hash)
            data = self._pending.get(page_hash)
            if data is not None:
                self.stats.hits += 1
                return data
        data = self._read(page_hash)
        with self._lock:
            if data is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return data

    def get_pages(self, hashes: list[bytes]) -> list[bytes]:
        """Payloads of the leading run of `hashes` held here, valid."""
        found = []
        for page_hash in hashes:
            data = self.get(page_hash)
            if data is None:
                break
            found.append(data)
        return found

    def contains(self, page_hash: bytes) -> bool:
        with self._lock:
            return page_hash in self._index

    # -- lifecycle --------------------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued writes are on disk; False if `timeout` passed first."""
        return drain(self._queue, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to `timeout`), then stop the writer."""
        stop(self._queue, self._thread, timeout)

    # -- internals --------------------------------------------------------------------------------
    def _make_room(self) -> list[bytes]:
        """Under the lock: drop least recently used pages until the index fits the budget; returns
        them (their files are deleted after the lock is released)."""
        victims, kept = [], []
        while len(self._index) + len(kept) > self.capacity_pages and self._index:
            victim, _ = self._index.popitem(last=False)
            if self.pins is not None and self.pins.is_pinned(victim):
                kept.append(victim)  # pinned (24h retention): skipped, put back as recently used
                continue
            self._pending.pop(victim, None)
            self.stats.evictions += 1
            victims.append(victim)
        self._index.update(dict.fromkeys(kept))
        return victims

    def _read(self, page_hash: bytes) -> bytes | None:
        path = self.file_of(page_hash)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:  # evicted meanwhile, or the whole directory deleted
            if not self.root.is_dir():
                self._root_gone()
            self._forget(page_hash)
            return None
        except OSError as err:
            self._warn.warning("read", "cannot read disk page %s: %s", path, err)
            with self._lock:
                self.stats.errors += 1
            return None
        payload = self._check(page_hash, raw)
        if payload is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # the access order survives a restart
        else:
            self._warn.warning("corrupt", "corrupt disk page %s (%d bytes): dropped, the engine recomputes it",
                               path, len(raw))
            with self._lock:
                self.stats.corrupt += 1
            self._forget(page_hash)
            self._remove(path)
        return payload

    def _check(self, page_hash: bytes, raw: bytes) -> bytes | None:
        if len(raw) != self.file_bytes:
            return None
        magic, version, algorithm, length, hash_len, stored_hash, tag = HEADER.unpack_from(raw)
        payload = memoryview(raw)[HEADER.size:]
        if (magic != MAGIC or version != VERSION or algorithm != self.sealer.algorithm
                or length != self.page_bytes or stored_hash[:hash_len] != page_hash):
            return None
        expected = self.sealer.tag(self.layout, page_hash, payload)
        if tag[:len(expected)] != expected:
            return None
        return bytes(payload)

    def _pack(self, page_hash: bytes, data: bytes) -> bytes:
        tag = self.sealer.tag(self.layout, page_hash, memoryview(data))
        return HEADER.pack(MAGIC, VERSION, self.sealer.algorithm, len(data), len(page_hash),
                           page_hash, tag) + data

    def _remove(self, path: Path) -> None:
        """Delete a page file; on a read-only or failing disk the file stays (it is out of the index,
        so never read again) and the error is counted: a tier fault is a miss, never a failed step."""
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            self._warn.warning("delete", "cannot delete disk page %s: %s", path, err)
            with self._lock:
                self.stats.errors += 1

    def _forget(self, page_hash: bytes) -> None:
        with self._lock:
            held = self._index.pop(page_hash, False) is not False
            self._pending.pop(page_hash, None)
        if held:
            self._evicted(page_hash)

    def _root_gone(self) -> None:
        """The tier's directory was deleted under it: the pages not still queued went with it."""
        with self._lock:
            lost = [page_hash for page_hash in self._index if page_hash not in self._pending]
            for page_hash in lost:
                del self._index[page_hash]
        self._warn.warning("gone", "the disk tier's directory %s is gone: %d pages forgotten; new pages "
                           "are written there again", self.root, len(lost))
        for page_hash in lost:
            self._evicted(page_hash)

    def _evicted(self, page_hash: bytes) -> None:
        if self.on_evict is not None:
            self._tell(self.on_evict, page_hash)

    @staticmethod
    def _tell(listener: Callable[[bytes], None], page_hash: bytes) -> None:
        try:
            listener(page_hash)
        except Exception:  # a listener's bug must not break the tier
            log.exception("disk tier listener failed")

    def _load_index(self) -> None:
        """Pages already on disk, oldest access first (file mtimes; a hit touches its file). Files of
        the wrong size and leftover temp files are deleted; tags are checked when a page is read."""
        found: list[tuple[float, bytes]] = []
        for path in self.root.glob("*/*"):
            try:
                if path.suffix != SUFFIX:
                    path.unlink()  # a temp file from a crash mid-write
                    continue
                page_hash = bytes.fromhex(path.stem)
                stat = path.stat()
            except (OSError, ValueError):
                continue
            if stat.st_size != self.file_bytes:
                self.stats.corrupt += 1
                self._remove(path)
                continue
            found.append((stat.st_mtime, page_hash))
        for _, page_hash in sorted(found):
            self._index[page_hash] = None
        self.stats.loaded = len(self._index)
        for victim in self._make_room():  # the budget shrank since the last run
            self._remove(self.file_of(victim))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # never let the writer die
                log.exception("disk tier writer failed")
            finally:
                self._queue.task_done()

    def _write(self, page_hash: bytes, data: bytes) -> None:
        with self._lock:
            if self._pending.get(page_hash) is not data:
                return  # evicted (or re-put) before its turn
        path = self.file_of(page_hash)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        if not self.root.is_dir():
            self._root_gone()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # (re-creates a deleted tier directory)
            tmp.write_bytes(self._pack(page_hash, data))
            os.replace(tmp, path)
        except OSError as err:
            with contextlib.suppress(OSError):  # (a read-only disk never made it)
                tmp.unlink(missing_ok=True)
            self._warn.warning("write", "cannot write disk page %s: %s", path, err)
            with self._lock:
                self.stats.errors += 1
            self._forget(page_hash)
            return
        with self._lock:
            if self._pending.get(page_hash) is data:
                del self._pending[page_hash]
                self.stats.writes += 1
            elif page_hash not in self._index:  # evicted while writing: its delete may have run
                self._remove(path)
