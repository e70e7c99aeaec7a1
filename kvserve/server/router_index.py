"""The KV-aware router's bookkeeping, pure Python with no I/O: which backend holds which page hashes
(fed by each backend's KV events, plus the pages of prompts just sent there), how loaded each one
is, and the score that picks a backend.

Score (lower is better, in pages of prefill), for a prompt of P full pages of which backend b holds
the first m_b:

    cost_b = prefill * (P - m_b) + backlog_b + decode * decoding_b
             + P * (unknown * others_b + kv * kv_usage_b)

`P - m_b` is this prompt's prefill left on b, weighed `prefill` (2) times: besides this request's
wait, a prefix computed again on a second backend takes compute and cache space from the others
and splits the prefix's later requests between two copies. `backlog_b` is the prefill queued ahead
of it: the uncached pages of the router's requests on b that have not produced their first token.
So a cached prefix moves only when more than two prompts' worth of prefill is queued where it is.
`decoding_b` counts the router's requests on b past their first token (each decode step they share
costs about `decode` pages). `others_b` are requests b reports (running + waiting, at the last poll)
beyond the router's own, of unknown size, each priced as a share of this prompt, as Dynamo's and
llm-d's routers weigh overlap against load; `kv_usage_b` in 0..1 is how full b's page pool is (a
full pool must evict to take new pages). With nothing cached the least-loaded backend wins.

m_b counts a page b announced in its events, or one of a prompt the router sent to b that is still
in flight or finished less than PREDICT_GRACE_S ago: its events may not have arrived yet, and a
request with the same prefix routed meanwhile belongs there too (llm-d's and Dynamo's "approximate"
index). Ties go to the backend holding more of the prompt, then to the one after the last one
chosen (round robin).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvserve.cache.events import MEDIUM_REDIS
from kvserve.cache.hashing import api_key_tenant, namespace
from kvserve.kv_events import WireEvent

WireHash = int | bytes
PREDICT_GRACE_S = 5.0  # a finished request's pages count as held until its events come


@dataclass(frozen=True, slots=True)
class Weights:
    prefill: float = 2.0  # this prompt's uncached pages against the prefill queued ahead of it
    decode: float = 2.0  # pages of prefill that one decoding request's share of each step is worth
    unknown: float = 0.5  # share of this prompt each request of unknown size is priced at
    kv_usage: float = 0.25


@dataclass(slots=True)
class Prediction:
    """Pages of prompts sent to a backend: held while a request with them is in flight, and for a
    grace period after the last one finished."""
    in_flight: int = 0
    until: float = 0.0


@dataclass(slots=True)
class BackendState:
    url: str
    healthy: bool = False
    num_running: int = 0  # reported by the backend's /metrics
    num_waiting: int = 0
    others: int = 0  # running + waiting beyond the router's own in flight, at the last poll
    kv_usage: float = 0.0
    in_flight: int = 0  # requests the router sent there and has not seen finish
    decoding: int = 0  # ... of which past their first token
    backlog: int = 0  # uncached prompt pages of the router's requests there still in prefill
    page_size: int | None = None  # from its KV events description; None: no events
    hash_format: str = "int"
    namespace_by_api_key: bool = False
    events_note: str = ""  # following its events, or why not (for the log and /router/backends)
    epoch: int = 0  # bumped when the backend is marked down: older subscriptions are void
    poll_timeouts: int = 0  # health checks timed out in a row
    pages: dict[WireHash, set[str]] = field(default_factory=dict)  # page hash -> media holding it
    predicted: dict[WireHash, Prediction] = field(default_factory=dict)  # (event loop only)
    purged_at: float = 0.0

    @property
    def load(self) -> int:
        return self.in_flight + self.others

    def observe_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.num_running, self.num_waiting, self.kv_usage = running, waiting, kv_usage
        self.others = max(0, running + waiting - self.in_flight)

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
        """A dead or restarted backend: nothing it announced or was sent is trusted any more."""
        self.pages.clear()
        self.predicted.clear()
        self.page_size = None

    def holds(self, h: WireHash, now: float) -> bool:
        if h in self.pages:
            return True
        p = self.predicted.get(h)
        return p is not None and (p.in_flight > 0 or p.until > now)

    def matched_pages(self, hashes: list[WireHash], now: float | None = None) -> int:
        """Length of the leading run of `hashes` this backend holds or is predicted to hold (a
        prefix hit needs every page before it)."""
        now = time.monotonic() if now is None else now
        for i, h in enumerate(hashes):
            if not self.holds(h, now):
                return i
        return len(hashes)

    def admit(self, hashes: list[WireHash], matched: int) -> Ticket:
        """A request sent here: its uncached pages join the backlog, its pages are predicted."""
        ticket = Ticket(self, list(hashes), len(hashes) - matched)
        self.in_flight += 1
        self.backlog += ticket.new_pages
        for h in ticket.hashes:
            self.predicted.setdefault(h, Prediction()).in_flight += 1
        return ticket

    def _purge(self, now: float) -> None:
        if now - self.purged_at >= 1.0:
            self.purged_at = now
            for h in [h for h, p in self.predicted.items() if not p.in_flight and p.until <= now]:
                del self.predicted[h]


@dataclass(slots=True)
class Ticket:
    """One request's claim on a backend, from routing until its answer ends."""
    backend: BackendState
    hashes: list[WireHash]
    new_pages: int
    prefilling: bool = True
    open: bool = True

    def first_token(self) -> None:
        """Its prefill is done: off the backlog, now decoding."""
        if self.open and self.prefilling:
            self.prefilling = False
            self.backend.backlog -= self.new_pages
            self.backend.decoding += 1

    def release(self, grace_s: float = PREDICT_GRACE_S) -> None:
        if not self.open:
            return
        self.open = False
        b = self.backend
        if self.prefilling:
            b.backlog -= self.new_pages
        else:
            b.decoding -= 1
        b.in_flight -= 1
        now = time.monotonic()
        for h in self.hashes:
            p = b.predicted.get(h)
            if p is not None:  # (gone if the backend was forgotten meanwhile)
                p.in_flight = max(0, p.in_flight - 1)
                p.until = now + grace_s
        b._purge(now)


@dataclass(frozen=True, slots=True)
class Choice:
    backend: BackendState
    matched_pages: int
    cost: float


def rank(backends: list[BackendState], hashes: list[WireHash], weights: Weights = Weights(),
         start: int = 0) -> list[Choice]:
    """Backends by cost, best first; at equal cost the one holding more of the prompt (a request
    queued behind its own prefix's prefill reuses it), then in order from index `start` on."""
    num_pages = max(len(hashes), 1)
    now = time.monotonic()
    n = len(backends)
    choices = []
    for offset in range(n):
        b = backends[(start + offset) % n]
        matched = b.matched_pages(hashes, now) if hashes else 0
        cost = (weights.prefill * (num_pages - matched) + b.backlog + weights.decode * b.decoding
                + num_pages * (weights.unknown * b.others + weights.kv_usage * b.kv_usage))
        choices.append((cost, -matched, offset, Choice(b, matched, cost)))
    return [c[-1] for c in sorted(choices, key=lambda t: t[:3])]


def key_namespace(api_key: str) -> str:
    """The cache tenant `kvserve serve` gives an API key (cache.hashing.api_key_tenant, the rule the
    engine side uses too)."""
    return api_key_tenant(api_key)


def request_namespace(api_key: str | None, cache_salt: str | None,
                      namespace_by_api_key: bool) -> str:
    """The namespace the engine hashes a request's first page with: the engine's own rule
    (cache.hashing.namespace over Request.tenant and Request.cache_salt)."""
    return namespace(key_namespace(api_key) if (namespace_by_api_key and api_key) else "", cache_salt)


def bearer(headers: dict[str, str]) -> str | None:
    """The API key of an `Authorization: Bearer` header."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


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


def tokenize_request(path: str, body: dict) -> dict | list[int] | None:
    """What to ask a backend's /tokenize for the prompt of a request to `path`: a request body, the
    token ids themselves (a completion given as ids), or None (not a text prompt)."""
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # several prompts: route by the first
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        request = ({"prompt": prompt, "add_special_tokens": False} if isinstance(prompt, str)
                   else None)
    elif path == "/v1/chat/completions":
        request = {"messages": body.get("messages"), "add_generation_prompt": True,
                   "add_special_tokens": False}
    else:
        messages = anthropic_to_chat(body)
        request = None if messages is None else {"messages": messages,
                                                 "add_generation_prompt": True,
                                                 "add_special_tokens": False}
    return request
