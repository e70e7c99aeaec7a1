"""The engine's statistics as one typed value (EngineStats): the cache layer's CacheStats, the
scheduler's counts and the engine's own gauges. The package reads its fields (metrics.py, the cache
report, the server's admission); a renamed field fails their tests instead of exporting 0. `as_dict()`
is the flat view, for outside only: LLM.stats() and /dashboard/stats show it (README, DESIGN.md §4).
Building one reads counters and changes nothing."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvserve.cache.stats import CacheStats
from kvserve.scheduler import SchedulerCounts
from kvserve.speculative.policy import SpecDecodeStats


@dataclass(frozen=True, slots=True)
class EngineStats:
    cache: CacheStats = field(default_factory=CacheStats)
    scheduler: SchedulerCounts = field(default_factory=SchedulerCounts)
    num_thrash_pages: int = 0  # pages committed again within a minute of their eviction
    tenant_prompt_tokens: dict[str, int] = field(default_factory=dict)
    tenant_cached_tokens: dict[str, int] = field(default_factory=dict)
    page_size: int = 16
    kv_cache_dtype: str = ""
    kv_fp8_scale: float = 1.0
    kv_cache_bytes: int = 0
    kv_bytes_used: int = 0  # bytes of the pages running requests hold, both pools
    max_model_len: int = 0
    pool_tokens: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # zeros with speculation off
    num_steps: int = 0  # engine steps that computed tokens
    num_step_tokens: int = 0  # the tokens those steps computed (prompt chunks, decodes, drafts)

    @property
    def hit_rate(self) -> float:
        queries = self.cache.prefix_cache_queries
        return self.cache.prefix_cache_hits / queries if queries else 0.0

    @property
    def window_num_pages_total(self) -> int:
        return self.cache.window.num_pages_total if self.cache.window is not None else 0

    @property
    def window_num_pages_free(self) -> int:
        return self.cache.window.num_pages_free if self.cache.window is not None else 0

    @property
    def window_kv_cache_usage_perc(self) -> float:
        return self.cache.window.usage if self.cache.window is not None else 0.0

    def as_dict(self) -> dict[str, Any]:
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("cache", "scheduler", "spec_decode")}
        own.update(window_num_pages_total=self.window_num_pages_total, window_num_pages_free=self.window_num_pages_free,
                   window_kv_cache_usage_perc=self.window_kv_cache_usage_perc)
        spec = {f"spec_decode_{name}": value for name, value in asdict(self.spec_decode).items()}
        return {**self.cache.as_dict(), **asdict(self.scheduler), **own, **spec}
