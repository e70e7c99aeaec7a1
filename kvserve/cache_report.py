"""The live cache report (`GET /v1/cache/report`, the dashboard's advice panel): hit rate overall and
per tenant, the prefixes reused most and those taking the most bytes, pages by state, thrash,
preemption rate, and an operator's advice when a threshold is crossed. Fed by the engine after each
step; torch-free."""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from kvserve.cache.fair_table import FairShareTable
from kvserve.cache.hashing import tenant_of
from kvserve.cache.pages import PAGE_CACHED, PAGE_FREE, PAGE_LEASED, PAGE_SHARED, PAGE_USED
from kvserve.cache.spans import find_hidden_spans
from kvserve.engine_stats import EngineStats
from kvserve.request import Request

MAX_TENANTS = 16  # labels beyond these are summed as "other" (bounded metric cardinality)
MAX_OWN_VIEWS = 4096  # tenants whose own report is kept (least recently seen dropped first)
MAX_PREFIXES = 1000
RECENT_PROMPTS = 64
LOW_HIT_RATE = 0.30
HIGH_USAGE = 0.85
USAGE_WINDOW_S = 60.0
QUANTIZED_KV = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")


@dataclass(slots=True)
class TenantStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class PrefixStats:
    tenant: str  # whose requests made it (a prefix is per namespace), never folded into "other"
    requests: int = 0
    cached_tokens: int = 0  # summed over the requests that hit it
    longest: int = 0  # longest prompt prefix cached under it (tokens)


@dataclass(slots=True)
class _Prompt:  # what find_hidden_spans reads
    token_ids: list[int]
    namespace: str


class CacheReporter:
    def __init__(self, page_size: int, bytes_per_token: float, kv_dtype: str) -> None:
        self.page_size = page_size
        self.bytes_per_token = bytes_per_token
        self.kv_dtype = kv_dtype
        self.tenants: dict[str, TenantStats] = {}  # the operator's view and /metrics: MAX_TENANTS + "other"
        self.own: OrderedDict[str, TenantStats] = OrderedDict()  # each tenant's own view, never folded
        self.prefixes: FairShareTable[bytes, PrefixStats] = FairShareTable(MAX_PREFIXES)  # a tenant's kept in its share
        self.recent: deque[tuple[_Prompt, int]] = deque(maxlen=RECENT_PROMPTS)  # (prompt, cached)
        self.usage: deque[tuple[float, float]] = deque()
        self.admitted = 0
        self.most_preempted = 0  # preemptions of one request (recent finished ones)

    # -- feeding -------------------------------------------------------------------------------
    def first_token(self, request: Request) -> None:
        """A request's prompt is computed: its cached prefix is known."""
        self.admitted += 1
        tenant = label = tenant_of(request.namespace) or "default"
        if label not in self.tenants and len(self.tenants) >= MAX_TENANTS:
            label = "other"
        own = self.own.pop(tenant, None) or TenantStats()
        self.own[tenant] = own
        if len(self.own) > MAX_OWN_VIEWS:
            self.own.popitem(last=False)
        for stats in (self.tenants.setdefault(label, TenantStats()), own):
            stats.requests += 1
            stats.prompt_tokens += request.num_prompt_tokens
            stats.cached_tokens += request.num_cached_tokens
        self.recent.append((_Prompt(request.prompt_token_ids, request.namespace), request.num_cached_tokens))
        if request.num_prompt_tokens >= self.page_size:
            key = first_page_key(request.prompt_token_ids, self.page_size) + request.namespace.encode()
            prefix = self.prefixes.get(key) or PrefixStats(tenant)
            prefix.requests += 1
            prefix.cached_tokens += request.num_cached_tokens
            prefix.longest = max(prefix.longest, request.num_cached_tokens)
            self.prefixes.put(key, prefix, tenant)

    def finished(self, request: Request) -> None:
        self.most_preempted = max(self.most_preempted, request.num_preemptions)

    def step(self, usage: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.usage.append((now, usage))
        while self.usage and self.usage[0][0] < now - USAGE_WINDOW_S:
            self.usage.popleft()

    # -- the report ----------------------------------------------------------------------------
    def report(self, stats: EngineStats, page_states: str, tenant: str | None = None) -> dict[str, Any]:
        """The whole report (the operator's view), or with `tenant` (an API key's namespace, "" for
        none) only what that tenant's own requests made: its hit rate and prefixes, nothing of the
        others' (neither their names nor the pool's state, which their traffic shapes)."""
        if tenant is not None:
            return self.tenant_report(tenant or "default")
        queries, hits = stats.cache.prefix_cache_queries, stats.cache.prefix_cache_hits
        hit_rate = hits / queries if queries else 0.0
        counts = Counter(page_states[1:])
        report = {
            "scope": "all",
            "hit_rate": hit_rate, "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "tenants": {name: tenant_view(t) for name, t in self.tenants.items()},
            **self.top_prefixes(self.prefixes.items()),
            "pages": {"free": counts[PAGE_FREE], "cached": counts[PAGE_CACHED], "used": counts[PAGE_USED],
                      "shared": counts[PAGE_SHARED], "leased": counts[PAGE_LEASED]},
            "tool_call_holds": {"held": stats.cache.leases.tool_call_leases,  # conversations waiting on a tool
                                "pages": stats.cache.leases.tool_call_leased_pages,
                                "granted": stats.cache.leases.tool_call_lease_grants,
                                "used_by_follow_up": stats.cache.leases.tool_call_lease_used},
            "thrash_pages": stats.num_thrash_pages,  # evicted and committed again within a minute
            "preemption_rate": stats.scheduler.num_preemptions / self.admitted if self.admitted else 0.0,
            "advice": [],
        }
        report["advice"] = self.advice(hit_rate, stats)
        return report

    def tenant_report(self, label: str) -> dict[str, Any]:
        view = tenant_view(self.own.get(label, TenantStats()))
        return {"scope": "tenant", "hit_rate": view["hit_rate"], "tenants": {label: view},
                **self.top_prefixes(self.prefixes.items_of(label)),
                "advice": self.quantized_advice()}

    def top_prefixes(self, items) -> dict[str, list[dict[str, Any]]]:
        prefixes = [{"prefix_id": key[:8].hex(), "requests": p.requests, "cached_tokens": p.cached_tokens,
                     "longest_cached_tokens": p.longest, "bytes": int(p.longest * self.bytes_per_token)}
                    for key, p in items]
        return {"top_prefixes_by_reuse": sorted(prefixes, key=lambda p: -p["requests"])[:10],
                "top_prefixes_by_bytes": sorted(prefixes, key=lambda p: -p["bytes"])[:10]}

    def quantized_advice(self) -> list[dict[str, Any]]:
        if self.kv_dtype not in QUANTIZED_KV:
            return []
        return [{"kind": "quantized_kv", "message": (
            f"KV cache in {self.kv_dtype}: measure its perplexity drift and greedy agreement with "
            f"`kvserve eval-kv --kv-cache-dtype {self.kv_dtype}`")}]

    def advice(self, hit_rate: float, stats: EngineStats) -> list[dict[str, Any]]:
        advice = []
        if len(self.recent) >= 8 and hit_rate < LOW_HIT_RATE:
            prompts = [p for p, _ in self.recent]
            spans = find_hidden_spans(prompts, [cached for _, cached in self.recent], min_length=32)
            for span in spans[:1]:
                advice.append({"kind": "mid_prompt_shared_text", "offset": span.offset, "length": span.length,
                               "num_requests": span.num_requests, "message": (
                                   f"hit rate {hit_rate:.0%}: {span.num_requests} of the last {len(prompts)} "
                                   f"prompts repeat {span.length} tokens at offset ~{span.offset}, after text "
                                   f"that differs; put the shared text first to make it cacheable")})
        samples = [u for _, u in self.usage]
        sustained = len(samples) >= 5 and sum(samples) / len(samples) > HIGH_USAGE
        if sustained or self.most_preempted >= 2:
            usage = max(samples[-1] if samples else 0.0, 1e-9)
            running = max(1, stats.scheduler.num_requests_running)
            memory = stats.kv_cache_bytes
            advice.append({"kind": "memory_pressure", "message": (
                f"KV usage {usage:.0%}" + (f", one request preempted {self.most_preempted} times" if
                                            self.most_preempted >= 2 else "")
                + f": lower --max-num-seqs to {max(1, int(running * 0.7 / usage))} or raise "
                  f"--kv-cache-memory to about {int(memory * usage / 0.7) / 2**30:.2f}GiB")})
        return advice + self.quantized_advice()


def first_page_key(token_ids: list[int], page_size: int) -> bytes:
    """Content of a prompt's first page (the report's prefixes add the namespace to it)."""
    return hashlib.blake2b(repr(list(token_ids[:page_size])).encode(), digest_size=8).digest()


def tenant_view(stats: TenantStats) -> dict[str, Any]:
    return {"requests": stats.requests, "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens,
            "hit_rate": stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0}
