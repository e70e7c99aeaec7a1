"""The KV-aware router's bookkeeping, pure Python with no I/O: which backend holds which page hashes
(fed by each backend's KV events), how loaded each one is, and the score that picks a backend.

Score (lower is better), for a prompt of P full pages of which backend b holds the first m_b:

    cost_b = (P - m_b) + P * (load_weight * load_b + kv_weight * kv_usage_b)

`P - m_b` is the prefill work left on b; `load_b` (running + waiting requests, or the requests the
router has in flight there if that is more recent and higher) prices the queue a request joins,
each queued request costing about as much as this one, as Dynamo's and llm-d's routers weigh
overlap against load; `kv_usage_b` in 0..1 is how full b's page pool is (a full pool must evict
to take new pages). With nothing cached anywhere the cost is lowest on the least-loaded backend.
With the default weights a full hit wins until the cached backend has 2 more requests queued
than a cold one. Ties go to the backend after the last one chosen (round robin).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvserve.cache.events import MEDIUM_REDIS, WireEvent

WireHash = int | bytes


@dataclass(frozen=True, slots=True)
class Weights:
    load: float = 0.5
    kv_usage: float = 0.25


@dataclass(slots=True)
class BackendState:
    url: str
    healthy: bool = False
    num_running: int = 0  # reported by the backend's /metrics
    num_waiting: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0  # requests the router sent there and has not seen finish
    page_size: int | None = None  # from its KV events description; None: no events
    hash_format: str = "int"
    namespace_by_api_key: bool = False
    epoch: int = 0  # bumped when the backend is marked down: older subscriptions are void
    pages: dict[WireHash, set[str]] = field(default_factory=dict)  # page hash -> media holding it

    @property
    def load(self) -> int:
        return max(self.num_running + self.num_waiting, self.in_flight)

    def apply(self, events: list[WireEvent]) -> None:
        """One batch of this backend's KV events. Redis pages are every instance's, so they say
        nothing about where to route and are not kept."""
        for event in events:
            if event.kind == "AllBlocksCleared":
                self.pages.clear()
            elif event.medium == MEDIUM_REDIS:
                continue
            elif event.kind == "BlockStored":
                for h in event.hashes:
                    self.pages.setdefault(h, set()).add(event.medium or "")
            elif event.kind == "BlockRemoved":
                for h in event.hashes:
                    media = self.pages.get(h)
                    if media is not None:
                        media.discard(event.medium or "")
                        if not media:
                            del self.pages[h]

    def forget(self) -> None:
        """A dead or restarted backend: nothing it announced is trusted any more."""
        self.pages.clear()
        self.page_size = None

    def matched_pages(self, hashes: list[WireHash]) -> int:
        """Length of the leading run of `hashes` this backend holds (a prefix hit needs every page
        before it)."""
        for i, h in enumerate(hashes):
            if h not in self.pages:
                return i
        return len(hashes)


@dataclass(frozen=True, slots=True)
class Choice:
    backend: BackendState
    matched_pages: int
    cost: float


def rank(backends: list[BackendState], hashes: list[WireHash], weights: Weights = Weights(),
         start: int = 0) -> list[Choice]:
    """Backends by cost, best first; equal costs in order from index `start` on (round robin)."""
    num_pages = max(len(hashes), 1)
    n = len(backends)
    choices = []
    for offset in range(n):
        b = backends[(start + offset) % n]
        matched = b.matched_pages(hashes) if hashes else 0
        cost = (num_pages - matched) + num_pages * (weights.load * b.load
                                                    + weights.kv_usage * b.kv_usage)
        choices.append((cost, offset, Choice(b, matched, cost)))
    return [c for _, _, c in sorted(choices, key=lambda t: (t[0], t[1]))]


def key_namespace(api_key: str) -> str:
    """The cache namespace `kvserve serve` gives an API key (kvserve.server.api.key_namespace; the
    router keeps its own copy so it never imports the engine)."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def request_namespace(api_key: str | None, cache_salt: str | None,
                      namespace_by_api_key: bool) -> str:
    """The namespace the engine hashes a request's first page with (LLMEngine.add_request)."""
    key_ns = key_namespace(api_key) if (namespace_by_api_key and api_key) else ""
    salt = cache_salt or ""
    return f"{key_ns}\x00{salt}" if key_ns else salt


_METRIC = re.compile(r"^kvserve:(\w+?)(?:_total)?(?:\{[^}]*\})?\s+(\S+)$")


def parse_load(metrics_text: str) -> dict[str, float]:
    """num_requests_running, num_requests_waiting and kv_cache_usage_perc from Prometheus text."""
    wanted = {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(1) in wanted:
            try:
                found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(2))
            except ValueError:
                continue
    return found


def events_address(endpoint: str, backend_url: str) -> str:
    """A backend's announced ZMQ endpoint as the router can reach it: a wildcard or unspecified
    host (`tcp://*:5557`, `tcp://0.0.0.0:5557`) becomes the backend URL's host."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme == "tcp" and colon and host in ("*", "0.0.0.0", "[::]", "::", ""):
        backend_host = urlsplit(backend_url).hostname or "127.0.0.1"
        if ":" in backend_host:
            backend_host = f"[{backend_host}]"
        return f"tcp://{backend_host}:{port}"
    return endpoint


def anthropic_to_chat(body: dict) -> list[dict[str, str]] | None:
    """An Anthropic Messages body as chat messages with text content (what /tokenize takes), or None
    when it holds something other than text."""
    def text(content) -> str | None:
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = [b.get("text") for b in content if isinstance(b, dict)]
            return "".join(parts) if all(isinstance(p, str) for p in parts) else None
        return None

    messages = []
    if body.get("system") is not None:
        system = text(body["system"])
        if system is None:
            return None
        messages.append({"role": "system", "content": system})
    for message in body.get("messages") or []:
        content = text(message.get("content")) if isinstance(message, dict) else None
        if content is None:
            return None
        messages.append({"role": message.get("role", "user"), "content": content})
    return messages
