"""Prometheus collectors for the server, named as vLLM names them but under `kvserve:` (DESIGN.md §4),
so a vLLM dashboard works after a rename; `prefix="vllm"` (`--metrics-name-prefix vllm`) serves the
same series under vLLM's own names and labels (`model_name`, `engine`), for scrapers that cannot be
told another name (llm-d's endpoint picker reads `vllm:num_requests_waiting`, `..._running`,
`vllm:kv_cache_usage_perc`, `vllm:lora_requests_info` and `vllm:cache_config_info` by default).

`EngineMetrics` owns its own `CollectorRegistry` (tests build several servers in one process). It is
fed from the engine loop: `observe(stats, outputs)` after every step turns the engine's cumulative
counters (`LLMEngine.stats()`, a typed EngineStats read field by field) into counter increments and observes the latency histograms of the
requests that finished in that step.

/metrics is open (no key), so a tenant's series is labelled with a keyed hash of its namespace
(HMAC-SHA256 under a server secret): nobody holding an API key can compute another's label, or its
own, from the key; `tenant_labels="off"` drops the per-tenant series altogether.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvserve.engine_stats import EngineStats
from kvserve.request import RequestOutput
from kvserve.request_metrics import REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS, RequestHistograms

PREFIX = "kvserve:"
PREFIXES = ("kvserve", "vllm")
TENANT_LABEL_MODES = ("keyed", "off")
PLAIN_TENANT_LABELS = ("default", "other")  # no key behind them
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, so quantiles line up with a vLLM deployment's (the other histograms: request_metrics.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = TOKEN_LATENCY_BUCKETS
E2E_BUCKETS = REQUEST_LATENCY_BUCKETS

# counter name (without _total) -> (field path in engine_stats.EngineStats of its cumulative value, help)
COUNTERS = {
    "prefix_cache_queries": ("cache.prefix_cache_queries", "Prefix cache lookups, in prompt tokens."),
    "prefix_cache_hits": ("cache.prefix_cache_hits", "Prefix cache hits, in prompt tokens."),
    "num_preemptions": ("scheduler.num_preemptions", "Requests preempted because the KV cache ran out."),
    "num_evictions": ("cache.num_evictions", "Cached pages evicted from the prefix cache."),
    "prompt_tokens": ("scheduler.prompt_tokens", "Prompt tokens of admitted requests."),
    "generation_tokens": ("scheduler.generation_tokens", "Generated tokens."),
    "prompt_tokens_cached": ("scheduler.prompt_tokens_cached", "Prompt tokens served from the prefix cache."),
    "remote_cache_hits": ("cache.tiers.remote.remote_cache_hits", "Pages loaded from the remote (Redis) tier."),
    "remote_cache_errors": ("cache.tiers.remote.remote_cache_errors", "Remote tier failures (each one a miss)."),
    "lease_grants": ("cache.leases.lease_grants", "Cache leases granted (cache_control, kv_retention, named caches)."),
    "lease_refreshes": ("cache.leases.lease_refreshes", "Cache leases whose TTL a read or a new breakpoint refreshed."),
    "lease_expiries": ("cache.leases.lease_expiries", "Cache leases that ran out (their pages became evictable)."),
    "lease_refusals": ("cache.leases.lease_refusals", "Breakpoints that got no lease (cap reached, prefix not cached)."),
    "num_preemption_loop_guards": ("scheduler.num_preemption_loop_guards",
                                   "Requests preempted past the limit; new admissions waited for them."),
    "num_fair_share_evictions": ("cache.num_fair_share_evictions",
                                 "Evictions taken from a tenant over its fair share (--tenant-kv-share fair)."),
    "num_thrash_pages": ("num_thrash_pages", "Pages committed again within a minute of their eviction."),
    "disk_tier_hits": ("cache.tiers.disk.disk_cache_hits", "Pages read back valid from the disk tier."),
    "disk_tier_misses": ("cache.tiers.disk.disk_cache_misses", "Disk tier reads of pages not there (or unreadable)."),
    "disk_tier_writes": ("cache.tiers.disk.disk_cache_writes", "Page files the disk tier wrote."),
    "disk_tier_evictions": ("cache.tiers.disk.disk_cache_evictions", "Pages the disk tier dropped for its byte budget."),
    "disk_tier_corrupt_pages": ("cache.tiers.disk.disk_cache_corrupt_pages",
                                "Disk tier files rejected (bad header, length or MAC): recomputed."),
    "disk_tier_errors": ("cache.tiers.disk.disk_cache_errors", "Disk tier I/O failures (each one a miss, never an error)."),
    "disk_tier_dropped_writes": ("cache.tiers.disk.disk_cache_dropped_writes", "Pages not written: the write queue was full."),
    "spec_decode_num_drafts": ("spec_decode.num_drafts", "Speculative decoding: verification steps with a draft."),
    "spec_decode_num_draft_tokens": ("spec_decode.num_draft_tokens", "Speculative decoding: draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("spec_decode.num_accepted_tokens",
                                        "Speculative decoding: draft tokens the target accepted."),
}

# per-tenant series (label "tenant", at most cache_report.MAX_TENANTS + "other"): field path -> help
TENANT_COUNTERS = {
    "tenant_prompt_tokens": ("tenant_prompt_tokens", "Prompt tokens of admitted requests, per tenant."),
    "tenant_prefix_cache_hits": ("tenant_cached_tokens", "Prompt tokens served from the cache, per tenant."),
}

# gauge name -> (field path, help)
GAUGES = {
    "kv_cache_usage_perc": ("cache.kv_cache_usage_perc", "Fraction of KV pages held by running requests (0-1)."),
    "cpu_cache_usage_perc": ("cache.tiers.host.cpu_cache_usage_perc", "Fraction of the CPU (host) tier in use (0-1)."),
    "num_requests_running": ("scheduler.num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("scheduler.num_requests_waiting", "Requests waiting to be admitted."),
    "num_requests_swapped": ("scheduler.num_requests_swapped", "Requests swapped out to the CPU tier."),
    "host_tier_usage_perc": ("cache.tiers.host.cpu_cache_usage_perc",
                             "Fraction of the host tier in use (0-1): cpu_cache_usage_perc under a name vLLM V1 "
                             "does not retire, so dashboards have it under either prefix."),
    "num_pages_total": ("cache.num_pages_total", "KV pages in the pool."),
    "num_pages_free": ("cache.num_pages_free", "Free KV pages, cached idle ones included."),
    "num_pages_cached": ("cache.num_pages_cached", "Idle pages that still hold a cached prefix."),
    "leased_pages": ("cache.leases.leased_pages", "KV pages held by cache leases."),
    "kv_cache_used_bytes": ("kv_bytes_used", "KV bytes of the pages running requests hold, both pools."),
    "window_kv_cache_usage_perc": ("window_kv_cache_usage_perc",
                                   "Fraction of the sliding-window pool's pages held (hybrid allocator)."),
    "window_num_pages_total": ("window_num_pages_total", "Pages of the sliding-window layers' pool."),
    "window_num_pages_free": ("window_num_pages_free", "Free sliding-window pages, cached idle ones included."),
    "disk_tier_pages": ("cache.tiers.disk.disk_cache_pages", "Pages held by the disk tier."),
    "disk_tier_used_bytes": ("cache.tiers.disk.disk_cache_used_bytes", "Bytes of the disk tier's page files."),
}
# vLLM V0's names that V1 dropped: served under the vllm prefix only when asked (v0_names)
V0_ONLY_GAUGES = ("cpu_cache_usage_perc", "num_requests_swapped")


def read(stats: EngineStats, path: str) -> float:
    """The field at `path` ("cache.tiers.disk.disk_cache_hits"); 0 where a part on the way is None (a
    tier the engine does not have). A field that does not exist raises: a rename never exports 0."""
    value: Any = stats
    for name in path.split("."):
        if value is None:
            return 0
        value = getattr(value, name)
    return 0 if value is None else value


class EngineMetrics:
    """The server's Prometheus collectors in a registry of their own."""

    def __init__(self, model_name: str, *, prefix: str = "kvserve",
                 cache_config: dict[str, str] | None = None, tenant_labels: str = "keyed",
                 tenant_secret: bytes | None = None, max_model_len: int = 8192, v0_names: bool = False) -> None:
        """`cache_config`: the labels of `cache_config_info` (vLLM's CacheConfig names:
        block_size, num_gpu_blocks, cache_dtype, ...). `tenant_secret`: the HMAC key of the tenant
        labels (random per process unless given, so that replicas and restarts can agree).
        `v0_names`: under the vllm prefix, vLLM V0's cpu_cache_usage_perc and num_requests_swapped too
        (V1 dropped them; the kvserve prefix always has them)."""
        if prefix not in PREFIXES:
            raise ValueError(f"--metrics-name-prefix is kvserve or vllm, not {prefix!r}")
        if tenant_labels not in TENANT_LABEL_MODES:
            raise ValueError(f"--metrics-tenant-labels is keyed or off, not {tenant_labels!r}")
        self.tenant_labels = tenant_labels
        self._tenant_secret = tenant_secret or secrets.token_bytes(32)
        self._tenant_labels: dict[str, str] = {}  # computed once per tenant (observe runs every step)
        self.registry = CollectorRegistry()
        self.model_name = model_name
        p = prefix + ":"
        vllm = prefix == "vllm"
        labels = ["model_name", "engine"] if vllm else ["model_name"]  # vLLM v1: engine index "0"
        base = (model_name, "0") if vllm else (model_name,)
        self._base = base
        self.counters = {
            name: Counter(p + name, help_, labels, registry=self.registry).labels(*base)
            for name, (_, help_) in COUNTERS.items()
        }
        self.gauges = {
            name: Gauge(p + name, help_, labels, registry=self.registry).labels(*base)
            for name, (_, help_) in GAUGES.items() if not vllm or v0_names or name not in V0_ONLY_GAUGES
        }
        self.tenant_counters = {
            name: Counter(p + name, help_, labels + ["tenant"], registry=self.registry)
            for name, (_, help_) in TENANT_COUNTERS.items()}
        self.tenant_pages = Gauge(p + "tenant_cached_pages", "Cached KV pages per tenant "
                                  "(with --tenant-kv-share fair).", labels + ["tenant"], registry=self.registry)
        self.accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens, per draft position.",
            labels + ["position"], registry=self.registry)
        self.request_success = Counter(
            p + "request_success", "Finished requests by finish reason.",
            labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(*base)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Time per output token after the first.", labels,
                              buckets=TPOT_BUCKETS, registry=self.registry).labels(*base)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(*base)
        self.requests = RequestHistograms(p, labels, base, max_model_len, self.registry)
        # vLLM's info gauges: the labels are the information, the value 1 (cache config) or the
        # time of the last update (LoRA: no adapters here, so both adapter lists stay empty)
        config = dict(cache_config or {})
        info_labels = [*config, "engine"]
        Gauge(p + "cache_config_info", "Information of the LLMEngine CacheConfig", info_labels,
              registry=self.registry).labels(*config.values(), "0").set(1)
        self.lora_info = Gauge(p + "lora_requests_info", "Running stats on lora requests.",
                               ["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
                               registry=self.registry).labels("", "0", "")
        self.lora_info.set(time.time())
        self._seen: dict[str, float] = {}  # cumulative engine values already counted
        self._lock = threading.Lock()

    def observe(self, stats: EngineStats, outputs: Iterable[RequestOutput] = ()) -> None:
        """Called by the engine loop after each step (and when idle) with `LLMEngine.stats()` and
        the outputs of that step."""
        with self._lock:
            for name, (path, _) in COUNTERS.items():
                value = read(stats, path)
                delta = value - self._seen.get(path, 0)
                if delta > 0:  # a counter never goes back, even if the engine's were reset
                    self.counters[name].inc(delta)
                self._seen[path] = value
            for name, gauge in self.gauges.items():
                gauge.set(read(stats, GAUGES[name][0]))
            if self.tenant_labels != "off":
                self._observe_tenants(stats)
            for position, value in enumerate(stats.spec_decode.accepted_per_pos):
                seen = f"spec_decode.accepted_per_pos:{position}"
                delta = value - self._seen.get(seen, 0)
                if delta > 0:
                    self.accepted_per_pos.labels(*self._base, str(position)).inc(delta)
                self._seen[seen] = value
            self.lora_info.set(time.time())
            self.requests.observe_step(stats, outputs)
        for output in outputs:
            if output.finished:
                self.observe_finished(output)

    def _observe_tenants(self, stats: EngineStats) -> None:
        for name, (path, _) in TENANT_COUNTERS.items():
            for tenant, value in getattr(stats, path).items():
                seen = f"{path}:{tenant}"
                delta = value - self._seen.get(seen, 0)
                if delta > 0:
                    self.tenant_counters[name].labels(*self._base, self.tenant_label(tenant)).inc(delta)
                self._seen[seen] = value
        for tenant, pages in stats.cache.cached_pages_per_tenant.items():
            self.tenant_pages.labels(*self._base, self.tenant_label(tenant or "default")).set(pages)

    def tenant_label(self, tenant: str) -> str:
        """The /metrics label of a tenant (the cache report's name for it)."""
        if tenant in PLAIN_TENANT_LABELS:
            return tenant
        label = self._tenant_labels.get(tenant)
        if label is None:
            label = "t-" + hmac.new(self._tenant_secret, tenant.encode(), hashlib.sha256).hexdigest()[:16]
            self._tenant_labels[tenant] = label
        return label

    def observe_finished(self, output: RequestOutput) -> None:
        metrics = output.metrics
        reason = output.outputs[0].finish_reason if output.outputs else None
        self.request_success.labels(*self._base, reason or "unknown").inc()
        self.requests.observe_finished(output)
        if metrics.first_token_time is not None:
            self.ttft.observe(max(metrics.first_token_time - metrics.arrival_time, 0.0))
        if metrics.finish_time is not None:
            self.e2e.observe(max(metrics.finish_time - metrics.arrival_time, 0.0))
            num_output = len(output.outputs[0].token_ids) if output.outputs else 0
            if metrics.first_token_time is not None and num_output > 1:
                decode_s = metrics.finish_time - metrics.first_token_time
                self.tpot.observe(max(decode_s / (num_output - 1), 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
