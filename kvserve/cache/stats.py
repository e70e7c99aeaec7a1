"""The cache layer's statistics as typed values, one per owner: the page pool and prefix index with
the manager's counters (CacheStats), the leases (LeaseCounts), the tiers below the pool (TierStats) and
the sliding-window pool (WindowStats). Built by reading counters; building one changes nothing.
`as_dict()` gives the flat names LLM.stats() has always shown."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class LeaseCounts:
    leased_pages: int = 0
    num_leases: int = 0
    lease_grants: int = 0
    lease_refreshes: int = 0
    lease_expiries: int = 0
    lease_refusals: int = 0
    lease_breaks: int = 0
    tool_call_leases: int = 0  # held now: conversations waiting on a tool's result
    tool_call_leased_pages: int = 0
    tool_call_lease_grants: int = 0
    tool_call_lease_used: int = 0  # released by the follow-up request that read them


@dataclass(frozen=True, slots=True)
class HostTierCounts:
    cpu_cache_usage_perc: float = 0.0
    num_swapped_out_pages: int = 0
    num_swapped_in_pages: int = 0
    num_offloaded_pages: int = 0
    cpu_prefix_cache_hits: int = 0  # tokens


@dataclass(frozen=True, slots=True)
class RemoteTierCounts:
    remote_cache_queries: int = 0
    remote_cache_hits: int = 0
    remote_cache_errors: int = 0
    remote_cache_writes: int = 0
    remote_cache_drops: int = 0
    remote_cache_skipped: int = 0


@dataclass(frozen=True, slots=True)
class DiskTierCounts:
    disk_cache_pages: int = 0
    disk_cache_hits: int = 0
    disk_cache_corrupt_pages: int = 0
    disk_cache_misses: int = 0
    disk_cache_writes: int = 0
    disk_cache_evictions: int = 0
    disk_cache_errors: int = 0
    disk_cache_dropped_writes: int = 0
    disk_cache_used_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TierStats:
    """Each tier's counters, None for a tier the engine does not have."""

    host: HostTierCounts | None = None
    remote: RemoteTierCounts | None = None
    disk: DiskTierCounts | None = None

    @property
    def cpu_cache_usage_perc(self) -> float:
        return self.host.cpu_cache_usage_perc if self.host is not None else 0.0

    @property
    def remote_cache_hits(self) -> int:
        return self.remote.remote_cache_hits if self.remote is not None else 0

    @property
    def remote_cache_errors(self) -> int:
        return self.remote.remote_cache_errors if self.remote is not None else 0

    def as_dict(self) -> dict[str, Any]:
        return {k: v for part in (self.host, self.remote, self.disk) if part is not None
                for k, v in asdict(part).items()}


@dataclass(frozen=True, slots=True)
class WindowStats:
    num_pages_total: int = 0
    num_pages_free: int = 0
    num_pages_used: int = 0
    num_pages_cached_idle: int = 0
    num_evictions: int = 0

    @property
    def usage(self) -> float:
        return self.num_pages_used / self.num_pages_total if self.num_pages_total else 0.0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """What KVCacheManager.stats() reads: the pool, the prefix index's counters (in tokens) and the
    parts below."""

    num_pages_total: int = 0
    num_pages_free: int = 0  # free plus cached idle pages: all can be handed out
    num_pages_used: int = 0
    num_pages_cached: int = 0
    num_pages_cached_idle: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_evictions: int = 0
    leases: LeaseCounts = field(default_factory=LeaseCounts)
    tiers: TierStats = field(default_factory=TierStats)
    num_fair_share_evictions: int = 0
    cached_pages_per_tenant: dict[str, int] = field(default_factory=dict)
    window: WindowStats | None = None

    def as_dict(self) -> dict[str, Any]:
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("leases", "tiers", "window")}
        tiers = {"cpu_cache_usage_perc": self.tiers.cpu_cache_usage_perc, "remote_cache_hits": self.tiers.remote_cache_hits,
                 "remote_cache_errors": self.tiers.remote_cache_errors, **self.tiers.as_dict()}
        return {**flat, **tiers, **asdict(self.leases),
                "cached_pages_per_tenant": dict(self.cached_pages_per_tenant),
                "window_pool": asdict(self.window) if self.window is not None else None}


@dataclass(slots=True)
class DiskTierStats:
    """The disk tier's own counters (cache/disk_tier.py), updated under its lock."""

    hits: int = 0  # pages read back valid
    misses: int = 0  # gets of pages not on disk (or unreadable)
    writes: int = 0  # page files written
    evictions: int = 0  # pages dropped for the byte budget
    corrupt: int = 0  # files rejected: bad header, length or tag
    drops: int = 0  # puts not taken: write queue full
    errors: int = 0  # I/O failures (disk full, permissions)
    loaded: int = 0  # pages found on disk at start-up
