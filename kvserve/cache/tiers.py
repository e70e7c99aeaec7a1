"""Tiers below the device page pool. `HostTier` keeps page payloads in CPU memory for two uses: swap
(a preempted request's pages, pinned until it resumes) and offload (evicted prefix-cache pages by page
hash, least recently used dropped first). `page_hashes_from` names the pages a tier is asked for after
a local hit (cache/offload.py asks the host tier, disk, then Redis). Payloads are opaque here: the
runner makes and reads them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.cache.events import MEDIUM_HOST
from kvserve.cache.hashing import page_hashes


class Tier(Protocol):
    """A store of page payloads keyed by page hash (HostTier, RedisTier)."""

    def get(self, page_hash: bytes) -> Any | None: ...
    def put(self, page_hash: bytes, payload: Any) -> bool: ...
    def contains(self, page_hash: bytes) -> bool: ...

    def get_pages(self, hashes: list[bytes]) -> list[Any]:
        """Payloads of the leading run of `hashes` the store holds."""


class TierListener(Protocol):
    """Told of every page a tier takes or drops by hash (cache/events.KVEventBuffer)."""

    def tier_stored(self, page_hash: bytes, medium: str) -> None: ...
    def removed(self, page_hash: bytes, medium: str) -> None: ...


def page_hashes_from(token_ids: Sequence[int], page_size: int, namespace: str, start_page: int,
                    max_pages: int) -> list[bytes]:
    """Chained hashes of the full pages start_page, start_page + 1, ... of `token_ids` (at most
    `max_pages`): what a tier is asked for after a hit that ends at `start_page`."""
    if max_pages <= 0:
        return []
    end = start_page + max_pages
    return page_hashes(token_ids[:end * page_size], page_size, namespace)[start_page:]


@dataclass(slots=True)
class HostTierStats:
    swap_outs: int = 0  # pages
    swap_ins: int = 0
    offloads: int = 0
    offload_hits: int = 0
    offload_evictions: int = 0


@dataclass
class HostTier:
    """CPU memory of `capacity_bytes`, counted in whole pages of `page_bytes`."""

    capacity_bytes: int
    page_bytes: int
    swapped: dict[str, list[Any]] = field(default_factory=dict)  # request id -> its pages, in order
    offloaded: OrderedDict[bytes, Any] = field(default_factory=OrderedDict)  # LRU first
    stats: HostTierStats = field(default_factory=HostTierStats)
    listener: TierListener | None = None  # KV events: offloaded pages stored and dropped ("CPU")

    @property
    def capacity_pages(self) -> int:
        return self.capacity_bytes // self.page_bytes if self.page_bytes else 0

    @property
    def num_swapped_pages(self) -> int:
        return sum(len(pages) for pages in self.swapped.values())

    @property
    def num_pages(self) -> int:
        return self.num_swapped_pages + len(self.offloaded)

    def usage(self) -> float:
        return self.num_pages / self.capacity_pages if self.capacity_pages else 0.0

    # -- swap: pinned until the request resumes or ends ---------------------------------------
    def can_swap(self, num_pages: int) -> bool:
        """Swapped pages may push out offloaded ones, never other swapped pages."""
        return self.num_swapped_pages + num_pages <= self.capacity_pages

    def reserve_swap(self, request_id: str, num_pages: int) -> bool:
        if request_id in self.swapped or not self.can_swap(num_pages):
            return False
        self._make_room(num_pages)
        self.swapped[request_id] = [None] * num_pages
        self.stats.swap_outs += num_pages
        return True

    def take_swap(self, request_id: str) -> list[Any]:
        pages = self.swapped.pop(request_id)
        self.stats.swap_ins += len(pages)
        return pages

    def drop_swap(self, request_id: str) -> None:
        self.swapped.pop(request_id, None)

    # -- offload: evicted prefix pages by hash, LRU --------------------------------------------
    def put(self, page_hash: bytes, payload: Any) -> bool:
        if self.capacity_pages - self.num_swapped_pages <= 0:
            return False
        if page_hash in self.offloaded:
            self.offloaded.move_to_end(page_hash)
            return True
        self._make_room(1)
        self.offloaded[page_hash] = payload
        self.stats.offloads += 1
        if self.listener is not None:
            self.listener.tier_stored(page_hash, MEDIUM_HOST)
        return True

    def get(self, page_hash: bytes) -> Any | None:
        payload = self.offloaded.get(page_hash)
        if payload is not None:
            self.offloaded.move_to_end(page_hash)
            self.stats.offload_hits += 1
        return payload

    def get_pages(self, hashes: list[bytes]) -> list[Any]:
        found = []
        for page_hash in hashes:
            payload = self.get(page_hash)
            if payload is None:
                break
            found.append(payload)
        return found

    def contains(self, page_hash: bytes) -> bool:
        return page_hash in self.offloaded

    def _make_room(self, num_pages: int) -> None:
        while self.offloaded and self.num_pages + num_pages > self.capacity_pages:
            page_hash, _ = self.offloaded.popitem(last=False)
            self.stats.offload_evictions += 1
            if self.listener is not None:
                self.listener.removed(page_hash, MEDIUM_HOST)
