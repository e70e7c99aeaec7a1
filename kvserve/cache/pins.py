"""Retention pins: the pages that `prompt_cache_retention: "24h"` keeps in the disk and Redis tiers until
they expire, whatever those tiers' LRU would drop meanwhile (OpenAI's extended prompt caching).

    server   FrontDoor.retain -> LLMEngine.pin_prefix(prompt ids, namespace)
    ledger   PinLedger.pin(tenant, page hashes, ttl): all of them or none (over a cap: "capped")
    tiers    DiskTier._make_room skips pinned pages; RedisTier writes pinned pages with a TTL (EX) and
             sets the TTL of those it already holds (EXPIRE), so Redis drops them when the pin ends

Bounded: at most `max_pages` pinned in all and `max_pages_per_tenant` per tenant (an API key's
namespace; salts of one key count together). A pin that would go over either is refused whole, and the
response says retention was capped: never an error. Pinning a page again renews it. Expiry is wall-clock
(`time.time`), so with a `path` (the disk tier's directory) the ledger survives a restart: a small JSON
file, rewritten atomically on each change, expired pins dropped when it is read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvserve.pins")

DAY_S = 24 * 3600.0  # "24h"
FILE_NAME = "pins.json"
SAVE_SLACK_S = 600.0  # a renewal that moves no expiry by more than this is not written to the file


@dataclass(slots=True)
class Pin:
    tenant: str
    expires_at: float  # time.time() seconds


@dataclass(frozen=True, slots=True)
class PinResult:
    """What a pin request got: `pinned` False means capped (`reason` says which cap)."""

    pinned: bool
    num_pages: int
    expires_at: float = 0.0
    reason: str = ""


class PinLedger:
    """Page hash -> Pin, bounded in all and per tenant. Thread-safe: the server pins, the tiers'
    threads ask `is_pinned` / `remaining_s` (cheap, no I/O)."""

    def __init__(self, max_pages: int, max_pages_per_tenant: int, path: str | os.PathLike | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if max_pages < 0 or max_pages_per_tenant < 0:
            raise ValueError("pin caps must be >= 0 pages")
        self.max_pages = max_pages
        self.max_pages_per_tenant = min(max_pages_per_tenant, max_pages)
        self.path = Path(path) / FILE_NAME if path is not None else None
        self.clock = clock
        self._lock = threading.Lock()
        self._pins: dict[bytes, Pin] = {}
        self._by_tenant: Counter[str] = Counter()
        self._load()

    # -- asked by the tiers ----------------------------------------------------------------------
    def is_pinned(self, page_hash: bytes) -> bool:
        return self.remaining_s(page_hash) > 0

    def remaining_s(self, page_hash: bytes) -> float:
        """Seconds the page stays pinned (0: not pinned)."""
        with self._lock:
            pin = self._pins.get(page_hash)
            return max(0.0, pin.expires_at - self.clock()) if pin is not None else 0.0

    @property
    def num_pages(self) -> int:
        with self._lock:
            return len(self._pins)

    def tenant_pages(self, tenant: str) -> int:
        with self._lock:
            return self._by_tenant[tenant]

    # -- pinning ---------------------------------------------------------------------------------
    def pin(self, tenant: str, hashes: list[bytes], ttl_s: float = DAY_S) -> PinResult:
        """Pin every page of `hashes` until now + `ttl_s` (renewing those already pinned), or none when
        that would go over a cap."""
        with self._lock:
            now = self.clock()
            self._sweep(now)
            new = [h for h in dict.fromkeys(hashes) if h not in self._pins]
            if self._by_tenant[tenant] + len(new) > self.max_pages_per_tenant:
                return PinResult(False, len(hashes), reason=(
                    f"capped: pinning {len(new)} more pages for 24h would put this tenant at "
                    f"{self._by_tenant[tenant] + len(new)}, over its {self.max_pages_per_tenant} "
                    f"(--kv-pin-tenant-bytes)"))
            if len(self._pins) + len(new) > self.max_pages:
                return PinResult(False, len(hashes), reason=(
                    f"capped: pinning {len(new)} more pages for 24h would put the server at "
                    f"{len(self._pins) + len(new)}, over its {self.max_pages} (--kv-pin-bytes)"))
            expires_at, changed = now + ttl_s, bool(new)
            for h in dict.fromkeys(hashes):
                pin = self._pins.get(h)
                if pin is None:
                    self._pins[h] = Pin(tenant, expires_at)
                    self._by_tenant[tenant] += 1
                else:
                    changed |= expires_at - pin.expires_at > SAVE_SLACK_S
                    pin.expires_at = max(pin.expires_at, expires_at)
            # (a renewal alone is written at most once per SAVE_SLACK_S: a prefix that every request
            # repeats does not rewrite the file each time; after a restart its pin ends that much early)
            snapshot = self._snapshot() if self.path is not None and changed else None
        if snapshot is not None:
            self._save(snapshot)
        return PinResult(True, len(hashes), expires_at)

    def unpin_tenant(self, tenant: str) -> int:
        """Drop every pin of `tenant` (its pages become plain LRU entries again); returns how many."""
        with self._lock:
            mine = [h for h, pin in self._pins.items() if pin.tenant == tenant]
            for h in mine:
                del self._pins[h]
            self._by_tenant.pop(tenant, None)
            snapshot = self._snapshot() if mine and self.path is not None else None
        if snapshot is not None:
            self._save(snapshot)
        return len(mine)

    # -- internals -------------------------------------------------------------------------------
    def _sweep(self, now: float) -> None:
        """Under the lock: forget expired pins."""
        for h in [h for h, pin in self._pins.items() if pin.expires_at <= now]:
            pin = self._pins.pop(h)
            self._by_tenant[pin.tenant] -= 1
            if self._by_tenant[pin.tenant] <= 0:
                del self._by_tenant[pin.tenant]

    def _snapshot(self) -> dict[str, list]:
        return {h.hex(): [pin.tenant, pin.expires_at] for h, pin in self._pins.items()}

    def _save(self, snapshot: dict[str, list]) -> None:
        """Temp file + rename: a crash leaves the old ledger or the new one. A failing disk loses the
        pins' persistence (logged), never the request."""
        assert self.path is not None
        tmp = self.path.with_suffix(f".{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps(snapshot))
            os.replace(tmp, self.path)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            log.warning("cannot write the 24h pin ledger %s: %s", self.path, err)

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            raw = json.loads(self.path.read_text())
            entries = [(bytes.fromhex(h), str(t), float(e)) for h, (t, e) in raw.items()]
        except (OSError, ValueError, TypeError, AttributeError) as err:
            log.warning("ignoring the unreadable 24h pin ledger %s: %s", self.path, err)
            return
        now = self.clock()
        for h, tenant, expires_at in sorted(entries, key=lambda e: -e[2]):  # the longest first
            if expires_at > now and len(self._pins) < self.max_pages \
                    and self._by_tenant[tenant] < self.max_pages_per_tenant:  # (caps may have shrunk)
                self._pins[h] = Pin(tenant, expires_at)
                self._by_tenant[tenant] += 1


def ledger_for(page_bytes: int, disk_pages: int | None, disk_path: str | os.PathLike | None,
               max_bytes: int | None, tenant_bytes: int | None) -> PinLedger:
    """The engine's ledger: `max_bytes` (default: half the disk tier's `disk_pages`, 1 GiB with Redis
    only), never all of the disk tier (an unpinned page must always be left to evict), and per tenant
    `tenant_bytes` (default: a quarter of the total). Kept in the disk tier's directory when there is one."""
    if max_bytes is not None:
        total = max_bytes // page_bytes
    else:
        total = disk_pages // 2 if disk_pages is not None else (1 << 30) // page_bytes
    if disk_pages is not None:
        total = min(total, max(0, disk_pages - 1))
    per_tenant = tenant_bytes // page_bytes if tenant_bytes is not None else total // 4
    return PinLedger(total, per_tenant, disk_path)
