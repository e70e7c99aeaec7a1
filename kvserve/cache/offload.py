"""Offloader: the cache layer's decisions about pages that leave or enter the device pool. It turns
swap-out, swap-in, offload of evicted prefix pages, load-back from the tiers and publishing to a
shared tier into page operations (`batch.PageOps`) that the runner applies, and routes the payloads
the runner reads back to where they belong. Torch-free: payloads are opaque here.

    schedule:  KVCacheManager calls swap_out / swap_in / evicted / fetch+load   -> pending ops
    step:      scheduler.schedule() takes the ops into SchedulerOutput.page_ops
               runner.execute() reads `saves` first, writes `loads`, copies, computes
               KVCacheManager.complete(saves, payloads) -> deliver(): swap store, host tier, Redis
    update:    commit -> committed(): pages Redis or disk lack become saves, flushed after the step
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.cache.stats import DiskTierCounts, HostTierCounts, RemoteTierCounts, TierStats
from kvserve.cache.tiers import HostTier, Tier, page_hashes_from


class SaveKind(enum.Enum):
    SWAP = "swap"  # a preempted request's page, pinned in the host tier until it resumes
    OFFLOAD = "offload"  # an evicted prefix page, kept in the host tier by hash
    PUBLISH = "publish"  # a committed page offered to the shared tier
    DISK = "disk"  # a committed page written through to the disk tier (survives restarts)


@dataclass(frozen=True, slots=True)
class SaveTarget:
    """Where the payload of one saved page goes (opaque to the runner)."""

    kind: SaveKind
    key: str | bytes  # SWAP: request id; OFFLOAD/PUBLISH: page hash
    index: int = 0  # SWAP: position in the request's block table


class SharedTier(Tier, Protocol):
    """A tier other instances read (Redis): knows what it holds, takes pages in the background."""

    def is_known(self, page_hash: bytes) -> bool: ...
    def available(self) -> bool: ...
    def offer(self, items: list[tuple[bytes, Any]]) -> int: ...
    def put_many(self, items: list[tuple[bytes, Any]]) -> int: ...


@dataclass
class TierLoad:
    """Pages found below the pool for an admitted request: payloads of its next full pages."""

    payloads: list[Any] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # "host" | "redis" per page


@dataclass
class Offloader:
    page_size: int
    host: HostTier | None = None
    shared: SharedTier | None = None
    disk: Tier | None = None  # DiskTier: pages by hash on local disk, kept across restarts
    offload_evicted: bool = False  # keep evicted prefix pages in the host tier
    publish_sync: bool = False  # a prefill instance writes pages before it replies
    _saves: list[tuple[int, SaveTarget]] = field(default_factory=list)
    _loads: list[tuple[int, Any]] = field(default_factory=list)

    @classmethod
    def for_pool(cls, page_size: int, host: HostTier, *, prefix_caching: bool, windowed: bool,
                 shared: SharedTier | None = None, disk: Tier | None = None,
                 publish_sync: bool = False) -> Offloader:
        """The engine's and the simulator's offloader: evicted prefix pages go to the host tier when
        it has room, prefix caching is on, and the pool has no sliding-window slots (their pages
        hold only the window, not a whole prefix)."""
        return cls(page_size, host, shared=shared, disk=disk,
                   offload_evicted=bool(host.capacity_pages) and prefix_caching and not windowed,
                   publish_sync=publish_sync)

    # -- swap: a preempted request's pages to the host tier and back ---------------------------
    def swap_out(self, seq_id: str, block_table: list[int]) -> bool:
        """Reserve host room for the sequence's pages and queue their reads. False: no room. A page
        whose load is still queued (swapped in earlier in this same step) keeps that payload
        instead: the runner would read it before writing it."""
        if self.host is None or not self.host.reserve_swap(seq_id, len(block_table)):
            return False
        queued = dict(self._loads)
        for i, page in enumerate(block_table):
            if page in queued:
                self.host.swapped[seq_id][i] = queued[page]
            else:
                self._saves.append((page, SaveTarget(SaveKind.SWAP, seq_id, i)))
        self._loads = [(page, payload) for page, payload in self._loads if page not in set(block_table)]
        return True

    def num_swapped_pages(self, seq_id: str) -> int:
        return len(self.host.swapped[seq_id]) if self.host is not None else 0

    def swap_in(self, seq_id: str, pages: list[int]) -> None:
        assert self.host is not None
        self._loads += zip(pages, self.host.take_swap(seq_id))

    def drop_swap(self, seq_id: str) -> None:
        if self.host is not None:
            self.host.drop_swap(seq_id)

    # -- offload and load-back -----------------------------------------------------------------
    def evicted(self, page_hash: bytes, page_id: int) -> None:
        """A cached page is being reused: read it before the step writes over it."""
        if self.offload_evicted:
            self._saves.append((page_id, SaveTarget(SaveKind.OFFLOAD, page_hash)))

    @property
    def has_tiers(self) -> bool:
        return self.offload_evicted or self.shared is not None or self.disk is not None

    def fetch(self, token_ids: Sequence[int], namespace: str, start_page: int, max_pages: int) -> TierLoad:
        """Payloads of full pages start_page, start_page + 1, ... of `token_ids` (at most `max_pages`),
        up to the first one no tier holds: the host tier first, then disk, then the shared tier."""
        found = TierLoad()
        if not self.has_tiers:
            return found
        hashes = page_hashes_from(token_ids, self.page_size, namespace, start_page, max_pages)
        tiers = (("host", self.host if self.offload_evicted else None), ("disk", self.disk),
                 ("redis", self.shared))
        for name, tier in tiers:
            if tier is None or len(found.payloads) == len(hashes):
                continue
            pages = tier.get_pages(hashes[len(found.payloads):])
            found.payloads += pages
            found.sources += [name] * len(pages)
        return found

    def load(self, page_ids: list[int], payloads: list[Any]) -> None:
        self._loads += zip(page_ids, payloads)

    # -- publish -------------------------------------------------------------------------------
    def committed(self, items: list[tuple[bytes, int]]) -> None:
        """Pages just indexed: the shared tier and the disk tier get those they do not hold yet."""
        if self.shared is not None:
            self._saves += [(page, SaveTarget(SaveKind.PUBLISH, h)) for h, page in items
                            if not self.shared.is_known(h)]
        if self.disk is not None:
            self._saves += [(page, SaveTarget(SaveKind.DISK, h)) for h, page in items
                            if not self.disk.contains(h)]

    # -- the step boundary ---------------------------------------------------------------------
    def take(self) -> tuple[list[tuple[int, SaveTarget]], list[tuple[int, Any]]]:
        """This step's saves and loads, handed over once."""
        saves, loads = self._saves, self._loads
        self._saves, self._loads = [], []
        return saves, loads

    def deliver(self, saves: list[tuple[int, SaveTarget]], payloads: list[Any]) -> None:
        """Route the payloads the runner read for `saves` (same order) to their owners."""
        publish: dict[bytes, Any] = {}  # by hash: one page per content
        for (_, target), payload in zip(saves, payloads, strict=True):
            if target.kind is SaveKind.SWAP:
                if target.key in self.host.swapped:  # (not dropped meanwhile)
                    self.host.swapped[target.key][target.index] = payload
            elif target.kind is SaveKind.OFFLOAD:
                self.host.put(target.key, payload.copy())  # a row of its own: the tier counts pages
            elif target.kind is SaveKind.DISK:
                self.disk.put(target.key, payload)  # (written by the tier's own thread)
            else:
                publish[target.key] = payload
        if publish and self.shared.available():
            items = list(publish.items())
            if self.publish_sync:
                self.shared.put_many(items)
            else:
                self.shared.offer(items)

    def stats(self) -> TierStats:
        host = remote = disk = None
        if self.host is not None:
            counts = self.host.stats
            host = HostTierCounts(self.host.usage(), counts.swap_outs, counts.swap_ins, counts.offloads,
                                  counts.offload_hits * self.page_size)
        if self.shared is not None:
            remote = RemoteTierCounts(**self.shared.engine_stats())
        if self.disk is not None:
            disk = self.disk.stats
            disk = DiskTierCounts(self.disk.num_pages, disk.hits, disk.corrupt, disk.misses, disk.writes,
                                  disk.evictions, disk.errors, disk.drops, self.disk.used_bytes)
        return TierStats(host, remote, disk)
