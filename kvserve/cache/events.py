"""The KV event buffer: the cache layer's record of which pages became cached, or stopped being
cached, in which medium (device pool, host tier, disk tier), drained once per engine step. The
wire (vLLM's schema over ZMQ, replay, the subscriber) is kvserve/kv_events.py.

Media are vLLM's strings (`vllm/distributed/kv_events.py`, and what llm-d scores by tier):

    pool (the device's page pool)   "GPU"      (also on a CPU-only server: it is the engine's pool)
    host tier (RAM)                 "CPU"
    disk tier                       "STORAGE"
    Redis tier                      none       every instance reads it; an event would claim it for one

A page stored in a tier gets its parent hash and token ids from the pool's store event of the same
page (the buffer remembers them while some medium holds the page); a tier page the buffer never
saw in the pool (found on disk after a restart) goes out location-only, with no tokens, as vLLM's
offloading connectors send theirs.

Each event also names its pages' tenant (the tenant part of the request's namespace; a removal of
pages of several tenants is split per tenant), for the tenant-scoped view of the stream
(server/kv_event_view.py); the wire never carries it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.cache.hashing import tenant_of

MEDIUM_POOL, MEDIUM_HOST, MEDIUM_DISK = "GPU", "CPU", "STORAGE"
MEDIUM_REDIS = "REDIS"  # never published (see above); the router still ignores it if one comes
NAMESPACE_TAG_PREFIX = "kvserve-ns:"

ExtraKeys = tuple[str, ...]


def namespace_extra_keys(namespace: str) -> ExtraKeys | None:
    """What a request's first page carries in `extra_keys`: its `cache_salt` alone when no tenant
    (API key) is in the namespace, exactly as vLLM sends one; with a tenant, an opaque digest of the
    whole namespace (tenant and salt), so no router learns the tenant, and equal tokens of two
    tenants give two different keys in a router that folds this string into its block keys (llm-d)."""
    if not namespace:
        return None
    if not tenant_of(namespace):
        return (namespace,)
    digest = hashlib.blake2b(namespace.encode(), digest_size=12, person=b"kvserve-ns-v1").hexdigest()
    return (NAMESPACE_TAG_PREFIX + digest,)


@dataclass(slots=True)
class BlockStored:
    page_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]  # all pages' tokens, in order (len == pages * page_size), or [] location-only
    page_size: int
    medium: str = MEDIUM_POOL
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[ExtraKeys | None] | None = None  # one entry per page, or None for none at all
    tenant: str = ""  # whose pages (namespace's tenant; "" none or unknown): the tenant view's, never on the wire


@dataclass(slots=True)
class BlockRemoved:
    page_hashes: list[bytes]
    medium: str = MEDIUM_POOL
    tenant: str = ""


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class _Known:
    parent_hash: bytes | None
    token_ids: list[int]
    extra_keys: ExtraKeys | None
    media: set[str]
    tenant: str


class KVEventBuffer:
    """Collects one engine step's cache changes as events; `drain()` hands them over once per step.
    Consecutive stores of one chain (each page's parent is the previous page) in one medium merge
    into one BlockStored, and consecutive removals of one medium into one BlockRemoved, as vLLM
    batches them. Thread-safe: the disk tier's writer thread reports the pages it drops."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.events: list[Event] = []
        self._known: dict[bytes, _Known] = {}  # pages some medium holds: what their stores said
        self._lock = threading.Lock()

    def stored(self, page_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int],
               medium: str = MEDIUM_POOL, namespace: str = "") -> None:
        """A full page became cached in `medium`; `namespace` matters for a first page only."""
        if len(token_ids) != self.page_size:
            raise ValueError(f"a stored page holds {self.page_size} tokens, got {len(token_ids)}")
        extra = namespace_extra_keys(namespace) if parent_hash is None else None
        tenant = tenant_of(namespace)
        with self._lock:
            known = self._known.get(page_hash)
            if known is None:
                self._known[page_hash] = _Known(parent_hash, list(token_ids), extra, {medium}, tenant)
            else:
                known.media.add(medium)
            self._append_store(page_hash, parent_hash, list(token_ids), medium, extra, tenant)

    def tier_stored(self, page_hash: bytes, medium: str) -> None:
        """A tier below the pool took a page (by hash): announced with the tokens the pool's store
        of it gave, or location-only when the buffer never saw it."""
        with self._lock:
            known = self._known.get(page_hash)
            if known is None:
                self._append_store(page_hash, None, [], medium, None, "")
                return
            known.media.add(medium)
            self._append_store(page_hash, known.parent_hash, list(known.token_ids), medium,
                               known.extra_keys, known.tenant)

    def removed(self, page_hash: bytes, medium: str = MEDIUM_POOL) -> None:
        """A cached page left `medium` (evicted, dropped, or reused for other tokens)."""
        with self._lock:
            known = self._known.get(page_hash)
            if known is not None:
                known.media.discard(medium)  # (forgotten at drain: a tier may take it this step)
            tenant = "" if known is None else known.tenant
            last = self.events[-1] if self.events else None
            if isinstance(last, BlockRemoved) and last.medium == medium and last.tenant == tenant:
                last.page_hashes.append(page_hash)
                return
            self.events.append(BlockRemoved([page_hash], medium, tenant))

    def cleared(self) -> None:
        """Every cached page of every medium is gone (prefix cache reset): earlier events void."""
        with self._lock:
            self.events = [AllBlocksCleared()]
            self._known.clear()

    def drain(self) -> list[Event]:
        with self._lock:
            events, self.events = self.events, []
            for page_hash in [h for h, k in self._known.items() if not k.media]:
                del self._known[page_hash]
        return events

    def _append_store(self, page_hash: bytes, parent_hash: bytes | None, token_ids: list[int],
                      medium: str, extra: ExtraKeys | None, tenant: str) -> None:
        last = self.events[-1] if self.events else None
        if (isinstance(last, BlockStored) and last.medium == medium and token_ids and last.tenant == tenant
                and last.token_ids and last.page_hashes[-1] == parent_hash):
            last.page_hashes.append(page_hash)
            last.token_ids.extend(token_ids)
            if last.extra_keys is not None:
                last.extra_keys.append(None)
            return
        if (not token_ids and isinstance(last, BlockStored) and last.medium == medium and not last.token_ids
                and last.tenant == tenant):
            last.page_hashes.append(page_hash)  # location-only stores: one list of hashes
            return
        self.events.append(BlockStored([page_hash], parent_hash, token_ids, self.page_size, medium,
                                       extra_keys=None if extra is None else [extra], tenant=tenant))
