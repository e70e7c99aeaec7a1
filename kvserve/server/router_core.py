"""The router's decisions and its view of the backends (`Router`): the candidates for a request,
sending it, health and load polls, following each backend's KV events, and what a failed attempt
means for its backend. The overview is in router.py, the HTTP app in router_app.py."""

import asyncio
import logging
from typing import Any

from kvserve.cache.hashing import page_hashes
from kvserve.kv_events import KVEventSubscriber, external_hash
from kvserve.server.proxy import base_url
from kvserve.server.router_affinity import CacheKey, CacheKeyAffinity
from kvserve.server.router_index import (BackendState, Ticket, Weights, bearer, events_address,
                                         parse_load, rank, request_namespace, tokenize_request)
from kvserve.server.router_metrics import RouterMetrics
from kvserve.server.router_reads import Alarm, ReadTimeouts, Stalled, within

log = logging.getLogger("kvserve.router")

EVENTS_NOTES = {
    401: "401 on /v1/kv_events_endpoint: give the router its key with --backend-api-key-file",
    403: "403 on /v1/kv_events_endpoint: give the router its key with --backend-api-key-file",
    404: "404 on /v1/kv_events_endpoint: start it with --kv-events-endpoint"}
RETRY_STATUSES = (502, 503, 504)  # the backend is going down or its engine died: try another
POLL_TIMEOUTS_DOWN = 3  # health checks timing out in a row that mark a backend down


def failure_kind(err: BaseException) -> str:
    """Router.failed's kind for an error of a request to a backend."""
    import httpx

    if isinstance(err, Stalled):
        return "stalled"
    if isinstance(err, httpx.WriteError):
        return "refused"
    return "down" if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)) else "broken"


class Router:
    """Backends, their indexes and subscribers, and the choice for each request."""

    def __init__(self, urls: list[str], policy: str = "kv", weights: Weights = Weights(),
                 poll_interval_s: float = 0.5, backend_keys: dict[str, str] | None = None,
                 timeouts: ReadTimeouts = ReadTimeouts()) -> None:
        if not urls:
            raise ValueError("the router needs at least one --backend URL")
        if policy not in ("kv", "round-robin"):
            raise ValueError(f"--policy is kv or round-robin, not {policy!r}")
        self.backends = [BackendState(base_url(u)) for u in dict.fromkeys(urls)]
        self.policy, self.weights, self.poll_interval_s = policy, weights, poll_interval_s
        self.timeouts = timeouts
        self.backend_keys = {(base_url(u) if u else ""): k for u, k in (backend_keys or {}).items()}
        unknown = set(self.backend_keys) - {"", *(b.url for b in self.backends)}
        if unknown:
            raise ValueError(f"--backend-api-key-file names a URL that is no --backend: "
                             f"{sorted(unknown)[0]}")
        self.metrics = RouterMetrics()
        self.affinity = CacheKeyAffinity()
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self.curve_client_secret: str | None = None  # its own CURVE key, where backends list subscribers
        self.alarms = {b.url: Alarm() for b in self.backends}
        self._turn = 0
        self.client = None  # httpx.AsyncClient, set by the app's lifespan

    # -- choosing ---------------------------------------------------------------------------------
    def candidates(self, hashes: dict[str, list], cache_key: CacheKey | None = None
                   ) -> list[tuple[BackendState, int, str]]:
        """Backends to try in order, each with its predicted cached pages and the decision's
        reason. Down backends come last: a stale health check must not fail a request. A
        prompt_cache_key's backend, while healthy, comes first."""
        choices = self._ranked(hashes)
        pinned = self.affinity.backend_of(cache_key)
        for i, (b, matched, _) in enumerate(choices):
            if b.url == pinned and b.healthy:
                return [(b, matched, "prompt_cache_key"), *choices[:i], *choices[i + 1:]]
        return choices

    def _ranked(self, hashes: dict[str, list]) -> list[tuple[BackendState, int, str]]:
        start = self._turn
        self._turn += 1
        healthy = [b for b in self.backends if b.healthy] or self.backends
        rest = [b for b in self.backends if b not in healthy]
        if self.policy == "round-robin":
            order = healthy[start % len(healthy):] + healthy[:start % len(healthy)]
            return [(b, 0, "round_robin") for b in order + rest]
        choices = []
        for group in (healthy, rest):
            ranked_by_hash = {}
            for b in group:
                ranked_by_hash.setdefault(b.hash_format, []).append(b)
            # backends compare on their own hash format; usually all share one
            scored = []
            for fmt, members in ranked_by_hash.items():
                scored += rank(members, hashes.get(fmt, []), self.weights, start)
            scored.sort(key=lambda c: c.cost)
            log.debug("route: %s", [(c.backend.url, c.matched_pages, c.cost) for c in scored])
            for c in scored:
                choices.append((c.backend, c.matched_pages,
                                "prefix" if c.matched_pages else "least_loaded"))
        return choices

    def own_headers(self, b: BackendState) -> dict[str, str]:
        """The router's own credentials at backend b (its health, load, events and /tokenize)."""
        key = self.backend_keys.get(b.url) or self.backend_keys.get("")
        return {"authorization": f"Bearer {key}"} if key else {}

    async def prompt_hashes(self, path: str, body: Any, headers: dict[str, str]) -> dict[str, list]:
        """The request's full-page hashes, per wire format, as the backends hash them; {} when they
        cannot be known (no backend with events, tokenizing failed, not a text prompt)."""
        described = [b for b in self.backends if b.healthy and b.page_size]
        if self.policy != "kv" or not described or not isinstance(body, dict):
            return {}
        turn = self._turn % len(described)  # the least busy backend tokenizes, ties in turn
        source = min(described[turn:] + described[:turn], key=lambda b: (b.backlog, b.load))
        token_ids = await self._token_ids(source, path, body, headers)
        if token_ids is None:
            return {}
        api_key = bearer(headers) or headers.get("x-api-key")
        namespace = request_namespace(api_key, body.get("cache_salt"), source.namespace_by_api_key)
        raw = page_hashes(token_ids, source.page_size, namespace)
        return {fmt: [external_hash(h, fmt) for h in raw]
                for fmt in {b.hash_format for b in described}}

    async def _token_ids(self, source: BackendState, path: str, body: dict,
                         headers: dict[str, str]) -> list[int] | None:
        request = tokenize_request(path, body)
        if request is None or isinstance(request, list):
            return request  # not a text prompt / already token ids
        try:
            response = await self.client.post(source.url + "/tokenize", json=request,
                                              headers={**headers, **self.own_headers(source)},
                                              timeout=10.0)
            tokens = response.json().get("tokens") if response.status_code == 200 else None
        except Exception as err:  # httpx errors, a body that is not JSON
            log.debug("tokenize on %s failed: %s", source.url, err)
            tokens = None
        if not isinstance(tokens, list):
            self.metrics.tokenize_failures.inc()
            return None
        return tokens

    async def send(self, path: str, content: bytes, headers: dict[str, str],
                   hashes: dict[str, list], tried: set[str],
                   stream: bool = False, cache_key: CacheKey | None = None) -> tuple[Ticket, Any, str, int] | str:
        """The request sent to the best backend not in `tried` (added to it) that takes it: its
        ticket, the response (status and headers read, body streamed), the decision's reason and
        the predicted cached tokens; or why no backend took it. A backend that cannot be reached
        or answers 502-504 is marked down; one that stalls (a stream's head within the first-byte
        deadline, a whole answer's within the whole one) or stops reading the body (it refused
        it) is only skipped."""
        import httpx

        last_error = "no backend"
        for b, matched, reason in self.candidates(hashes, cache_key):
            if b.url in tried:
                continue
            if tried:
                self.metrics.retries.inc()
            tried.add(b.url)
            ticket = b.admit(hashes.get(b.hash_format, []) if b.page_size else [], matched)
            deadline = self.timeouts.first_byte_s if stream else self.timeouts.whole_s
            try:
                response = await within(self.client.send(
                    self.client.build_request("POST", b.url + path, content=content,
                                              headers=headers), stream=True),
                    deadline, self.alarms[b.url], "the answer's head")
                if response.status_code in RETRY_STATUSES:
                    await response.aclose()
                    raise httpx.ConnectError(f"answered {response.status_code}")
                self.affinity.place(cache_key, b.url)
                return ticket, response, reason, matched * (b.page_size or 0)
            except BaseException as err:
                ticket.release()
                if not isinstance(err, (httpx.HTTPError, Stalled)):
                    raise  # (a client gone: cancelled)
                last_error = f"{b.url}: {err or type(err).__name__}"
                await self.failed(b, last_error, failure_kind(err))
        return last_error

    async def failed(self, b: BackendState, why: str, kind: str) -> None:
        """A request's attempt on b failed (the request moves on either way):
        "down" (connection refused, 502-504) and "invalid" (a malformed answer) mark b down;
        "broken" (the connection lost mid-request) has b's health checked now, which decides;
        "stalled" (past a read deadline) and "refused" (it stopped reading the body: its own size
        limit) are counted only. So a busy backend, or one whose connection a client's upload
        reset, keeps its index."""
        self.metrics.attempt_failures.labels(b.url, kind).inc()
        if kind in ("down", "invalid"):
            self.mark_down(b, why)
            return
        log.info("request moved off %s: %s", b.url, why)
        if kind == "broken" and b.healthy:
            await self.poll(b)

    # -- health, load and events ------------------------------------------------------------------
    async def poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(b) for b in self.backends))
            await asyncio.sleep(self.poll_interval_s)

    async def poll(self, b: BackendState) -> None:
        headers = self.own_headers(b)
        try:
            health = await self.client.get(b.url + "/health", headers=headers, timeout=2.0)
            if health.status_code != 200:
                raise ConnectionError(f"/health answered {health.status_code}")
            metrics = await self.client.get(b.url + "/metrics", headers=headers, timeout=2.0)
            load = parse_load(metrics.text)
            b.observe_load(int(load.get("num_requests_running", 0)),
                           int(load.get("num_requests_waiting", 0)),
                           float(load.get("kv_cache_usage_perc", 0.0)))
            if not b.healthy:
                log.info("backend %s is up", b.url)
            b.healthy = True
            if self.policy == "kv" and b.url not in self.subscribers:
                await self.follow_events(b)
            b.poll_timeouts = 0
        except Exception as err:  # down, hung, or not a kvserve
            # a slow answer may be a busy backend: its index stays until several in a row
            timed_out = type(err).__name__.endswith("Timeout")
            b.poll_timeouts += timed_out
            if not timed_out or b.poll_timeouts >= POLL_TIMEOUTS_DOWN:
                self.mark_down(b, f"{type(err).__name__}: {err}")
            if timed_out and b.poll_timeouts >= POLL_TIMEOUTS_DOWN:
                self.alarms[b.url].ring()  # hung: requests waiting on it move on now
        self.metrics.observe_backend(b)

    async def follow_events(self, b: BackendState) -> None:
        """Learn the backend's event stream from the backend itself and subscribe to it."""
        response = await self.client.get(b.url + "/v1/kv_events_endpoint",
                                         headers=self.own_headers(b), timeout=2.0)
        if response.status_code != 200:  # routed by load
            self._events_note(b, EVENTS_NOTES.get(response.status_code,
                                                  f"/v1/kv_events_endpoint answered "
                                                  f"{response.status_code}"))
            return
        try:
            info = response.json()
            page_size = int(info["page_size"])
            if not info.get("endpoint") or page_size < 1:
                raise ValueError(info)
        except (ValueError, TypeError, KeyError):
            self._events_note(b, "its /v1/kv_events_endpoint answer is malformed")
            return
        b.forget()
        b.page_size = page_size
        b.hash_format = info.get("hash_format", "int")
        b.namespace_by_api_key = bool(info.get("namespace_by_api_key", False))
        replay = info.get("replay_endpoint")
        epoch = b.epoch

        def apply(events) -> None:  # (on the subscriber's thread)
            if b.epoch == epoch:
                b.apply(events)

        self.subscribers[b.url] = KVEventSubscriber(
            events_address(info["endpoint"], b.url),
            events_address(replay, b.url) if replay else None,
            apply, topic=info.get("topic", ""), curve_server_key=info.get("curve_public_key"),
            curve_client_secret=self.curve_client_secret)
        b.events_note = f"following {info['endpoint']}"
        log.info("following %s's KV events at %s", b.url, info["endpoint"])

    def _events_note(self, b: BackendState, note: str) -> None:
        if note != b.events_note:
            level = logging.INFO if "404" in note else logging.WARNING
            log.log(level, "backend %s: no KV events (%s); it is routed by load", b.url, note)
        b.events_note = note

    def blind_warning(self) -> str | None:
        """Why the kv policy can route nothing by prefix, when no backend's events are followed."""
        if self.policy != "kv" or any(b.page_size for b in self.backends):
            return None
        notes = "; ".join(f"{b.url}: {b.events_note or 'not reachable'}" for b in self.backends)
        return (f"the router follows no backend's KV events ({notes}): its index stays empty and "
                f"every request goes to the least loaded backend")

    def mark_down(self, b: BackendState, why: str) -> None:
        """b is down: its index and subscription are dropped until a health check answers."""
        if b.healthy:
            log.warning("backend %s is down (%s); forgetting its pages", b.url, why)
            self.metrics.backend_failures.labels(b.url).inc()
        b.healthy = False
        b.epoch += 1  # its subscriber's late batches are dropped
        subscriber = self.subscribers.pop(b.url, None)
        if subscriber is not None:  # it may come back as a new process: follow it anew
            subscriber.close(timeout=0)
        b.forget()

    def close(self) -> None:
        for subscriber in self.subscribers.values():
            subscriber.close()
        self.subscribers.clear()
