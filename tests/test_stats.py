"""Typed stats: every name /metrics exports is read from a field of EngineStats that exists (a rename
fails here, not on a dashboard as a silent 0); reading stats changes nothing (no lease expires); the
flat view LLM.stats() shows keeps its names."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from kvserve.cache.leases import Breakpoint, Retention
from kvserve.cache.manager import KVCacheManager
from kvserve.cache.stats import CacheStats
from kvserve.engine_stats import EngineStats
from kvserve.metrics import COUNTERS, GAUGES, TENANT_COUNTERS, EngineMetrics, read
from kvserve.scheduler import SchedulerCounts


def declared(cls: type, path: str) -> None:
    """Follow `path` through the declared fields (and properties) of the dataclass `cls`."""
    for name in path.split("."):
        if isinstance(getattr(cls, name, None), property):
            assert name == path.split(".")[-1], f"{path}: a property on the way"
            return
        hints = typing.get_type_hints(cls)
        assert name in hints, f"{path}: {cls.__name__} has no field {name!r}"
        kind = hints[name]
        if isinstance(kind, types.UnionType):  # X | None: a part the engine may not have
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        cls = kind


@pytest.mark.parametrize("path", [p for p, _ in (*COUNTERS.values(), *GAUGES.values(), *TENANT_COUNTERS.values())])
def test_every_exported_series_reads_a_declared_field(path):
    declared(EngineStats, path)


def test_a_missing_field_raises_instead_of_exporting_zero():
    renamed = types.SimpleNamespace(cache=types.SimpleNamespace(prefix_cache_queries_renamed=5))
    with pytest.raises(AttributeError):
        read(renamed, "cache.prefix_cache_queries")  # type: ignore[arg-type]
    assert read(EngineStats(), "cache.tiers.disk.disk_cache_hits") == 0  # no disk tier: 0, by design


def test_the_metrics_page_shows_the_typed_values():
    stats = EngineStats(CacheStats(prefix_cache_queries=40, prefix_cache_hits=16, num_pages_total=9),
                        SchedulerCounts(num_requests_running=2))
    metrics = EngineMetrics("m")
    metrics.observe(stats)
    text = metrics.render().decode()
    assert 'kvserve:prefix_cache_queries_total{model_name="m"} 40.0' in text
    assert 'kvserve:prefix_cache_hits_total{model_name="m"} 16.0' in text
    assert 'kvserve:num_pages_total{model_name="m"} 9.0' in text
    assert 'kvserve:num_requests_running{model_name="m"} 2.0' in text


def test_the_flat_view_keeps_the_names_llm_stats_shows():
    flat = EngineStats().as_dict()
    for name in ("kv_cache_usage_perc", "num_pages_total", "num_pages_free", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions", "num_evictions", "num_requests_running",
                 "leased_pages", "lease_grants", "cpu_cache_usage_perc", "remote_cache_hits", "window_pool",
                 "kv_bytes_used", "pool_tokens", "prompt_tokens_cached"):
        assert name in flat, name
    assert all(dataclasses.is_dataclass(v) is False for v in flat.values())


def test_reading_stats_expires_no_lease():
    now = [0.0]
    m = KVCacheManager(16, 4, "radix", clock=lambda: now[0], max_leased_fraction=0.9)
    tokens = list(range(12))
    m.allocate("a", tokens, "", m.lookup(tokens), 12)
    retention = Retention.of([Breakpoint(8, 5.0)], 12, "", min_cacheable_tokens=0)
    assert m.commit("a", tokens, 12, retention).lease_ids
    m.free("a")
    now[0] = 10.0  # past the TTL
    before = m.stats()
    assert m.stats() == before and before.leases.num_leases == 1  # read twice: nothing changed
    assert m.expire_leases() == 1 and m.stats().leases.num_leases == 0
    m.check_invariants()


def test_every_name_the_dashboard_shows_is_in_the_flat_view():
    """The dashboard's JSON is a part of the flat view (0 before the first step): a renamed field must
    fail here, not show 0 on a page."""
    from kvserve.server.api import STATS_KEYS, dashboard_payload

    flat = EngineStats().as_dict()
    for name in STATS_KEYS:
        assert name in flat, name
    before = dashboard_payload(None, None, "m")
    assert all(before[name] == 0 for name in STATS_KEYS) and before["prefix_cache_hit_rate"] == 0.0
