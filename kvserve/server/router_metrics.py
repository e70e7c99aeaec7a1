"""The router's Prometheus metrics (`kvserve_router:` prefix): its decisions, retries and backend
health, and the cached tokens it predicted against those the backends then reported in `usage`."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "kvserve_router:"


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Requests routed, by backend and reason "
                                "(prefix, least_loaded, round_robin, prompt_cache_key).", ["backend", "reason"],
                                registry=r)
        self.predicted_tokens = Counter(PREFIX + "predicted_cached_tokens",
                                 "Prompt tokens the router expected the chosen backend to hold.",
                                 registry=r)
        self.predicted_tokens_of_reported = Counter(
            PREFIX + "predicted_cached_tokens_of_reported",
            "Predicted cached tokens of the requests whose answer reported its cached tokens.",
            registry=r)
        self.reported_tokens = Counter(PREFIX + "reported_cached_tokens",
                                "Cached prompt tokens the backends reported in usage.", registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests sent again to another backend.",
                               registry=r)
        self.stream_resumes = Counter(PREFIX + "stream_resumes", "Streams whose backend broke "
                                      "mid-answer, resumed on another backend.", registry=r)
        self.backend_failures = Counter(PREFIX + "backend_failures",
                                        "Times a backend was marked down.", ["backend"], registry=r)
        self.attempt_failures = Counter(
            PREFIX + "attempt_failures", "Requests' attempts that failed on a backend, by kind: "
            "broken (connection lost, 502-504), invalid (a malformed answer or event), stalled "
            "(past a read deadline), refused (it stopped reading the request body).",
            ["backend", "kind"], registry=r)
        self.tokenize_failures = Counter(PREFIX + "tokenize_failures",
                                         "Prompts routed by load alone: /tokenize failed.",
                                         registry=r)
        self.backend_up = Gauge(PREFIX + "backend_up", "1 while the backend is healthy.",
                                ["backend"], registry=r)
        self.backend_load = Gauge(PREFIX + "backend_load", "Running + waiting requests (or the "
                                  "router's in flight there, if more).", ["backend"], registry=r)
        self.index_pages = Gauge(PREFIX + "index_pages", "Page hashes the router knows the backend "
                                 "holds.", ["backend"], registry=r)

    def decided(self, backend: str, reason: str, predicted_tokens: int) -> None:
        self.requests.labels(backend, reason).inc()
        self.predicted_tokens.inc(predicted_tokens)

    def reported(self, predicted_tokens: int, reported_tokens: int | None) -> None:
        if reported_tokens is not None:
            self.predicted_tokens_of_reported.inc(predicted_tokens)
            self.reported_tokens.inc(reported_tokens)

    def observe_backend(self, b: Any) -> None:
        self.backend_up.labels(b.url).set(1 if b.healthy else 0)
        self.backend_load.labels(b.url).set(b.load)
        self.index_pages.labels(b.url).set(len(b.pages))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def reported_cached_tokens(data: bytes, sse: bool = False) -> int | None:
    """Cached prompt tokens in an answer's usage (OpenAI `prompt_tokens_details.cached_tokens` or
    Anthropic `cache_read_input_tokens`); for a stream, from its last data line that has usage."""
    if not sse:
        return _cached(_json(data))
    for line in reversed(data.split(b"\n")):
        if line.startswith(b"data:") and b"usage" in line:
            found = _cached(_json(line[5:]))
            if found is not None:
                return found
    return None


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _cached(obj: Any) -> int | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage") or (obj.get("message") or {}).get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    value = usage.get("cache_read_input_tokens")
    return value if isinstance(value, int) else None
