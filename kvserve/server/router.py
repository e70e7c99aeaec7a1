"""`kvserve router`: one OpenAI/Anthropic endpoint in front of several `kvserve serve` instances that
sends each request where its prompt's pages already are.

    client -> router: /tokenize on a backend -> page hashes (cache/hashing.py, the request's namespace)
                      -> rank backends (router_index.rank: cached prefix vs load) -> the best one
                      (connection lost: mark it down, try the next; a stream broken mid-answer is
                      resumed on the next, router_stream.py)
    backend KV events (ZMQ, vLLM's schema) -> KVEventSubscriber -> BackendState.pages
    every poll interval: /health, /metrics (running, waiting, KV usage), /v1/kv_events_endpoint

Each backend describes its event stream at `GET /v1/kv_events_endpoint` (docs/scale-out.md), so the
router needs no flag per backend. A backend that fails a health check or a request is marked down and
its pages forgotten; when it answers again its stream is followed anew, from a replay of everything
its publisher still buffers. With `--policy round-robin`, or before a backend's events are known,
requests go round robin or to the least loaded. With `--prefill URL`, each request is first computed
by a prefill instance (max_tokens=1, pages to Redis) as `kvserve proxy` does, then routed.
"""

import argparse
import asyncio
import contextlib
import json
import logging
from typing import Any

from kvserve.kv_events import KVEventSubscriber, external_hash
from kvserve.cache.hashing import page_hashes
from kvserve.server.proxy import base_url, prefill_body
from kvserve.server.router_index import (BackendState, Ticket, Weights, bearer, events_address,
                                         parse_load, rank, request_namespace, tokenize_request)
from kvserve.server.router_metrics import RouterMetrics, reported_cached_tokens

log = logging.getLogger("kvserve.router")

RETRY_STATUSES = (502, 503, 504)  # the backend is going down or its engine died: try another
POLL_TIMEOUTS_DOWN = 3  # health checks timing out in a row that mark a backend down


class Router:
    """Backends, their indexes and subscribers, and the choice for each request."""

    def __init__(self, urls: list[str], policy: str = "kv", weights: Weights = Weights(),
                 poll_interval_s: float = 0.5) -> None:
        if not urls:
            raise ValueError("the router needs at least one --backend URL")
        if policy not in ("kv", "round-robin"):
            raise ValueError(f"--policy is kv or round-robin, not {policy!r}")
        self.backends = [BackendState(base_url(u)) for u in dict.fromkeys(urls)]
        self.policy, self.weights, self.poll_interval_s = policy, weights, poll_interval_s
        self.metrics = RouterMetrics()
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._turn = 0
        self.client = None  # httpx.AsyncClient, set by the app's lifespan

    # -- choosing ---------------------------------------------------------------------------------
    def candidates(self, hashes: dict[str, list]) -> list[tuple[BackendState, int, str]]:
        """Backends to try in order, each with its predicted cached pages and the decision's
        reason. Down backends come last: a stale health check must not fail a request."""
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
                                              headers=headers, timeout=10.0)
            tokens = response.json().get("tokens") if response.status_code == 200 else None
        except Exception as err:  # httpx errors, a body that is not JSON
            log.debug("tokenize on %s failed: %s", source.url, err)
            tokens = None
        if not isinstance(tokens, list):
            self.metrics.tokenize_failures.inc()
            return None
        return tokens

    async def send(self, path: str, content: bytes, headers: dict[str, str],
                   hashes: dict[str, list], tried: set[str]) -> tuple[Ticket, Any, str, int] | str:
        """The request sent to the best backend not in `tried` (added to it) that takes it: its
        ticket, the response (status and headers read, body streamed), the decision's reason and
        the predicted cached tokens; or why no backend took it. A backend that fails is marked down."""
        import httpx

        last_error = "no backend"
        for b, matched, reason in self.candidates(hashes):
            if b.url in tried:
                continue
            if tried:
                self.metrics.retries.inc()
            tried.add(b.url)
            ticket = b.admit(hashes.get(b.hash_format, []) if b.page_size else [], matched)
            try:
                response = await self.client.send(
                    self.client.build_request("POST", b.url + path, content=content,
                                              headers=headers), stream=True)
                if response.status_code in RETRY_STATUSES:
                    await response.aclose()
                    raise httpx.HTTPError(f"answered {response.status_code}")
                return ticket, response, reason, matched * (b.page_size or 0)
            except BaseException as err:
                ticket.release()
                if not isinstance(err, httpx.HTTPError):
                    raise  # (a client gone: cancelled)
                last_error = f"{b.url}: {err or type(err).__name__}"
                self.mark_down(b, last_error)
        return last_error

    # -- health, load and events ------------------------------------------------------------------
    async def poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(b) for b in self.backends))
            await asyncio.sleep(self.poll_interval_s)

    async def poll(self, b: BackendState) -> None:
        try:
            health = await self.client.get(b.url + "/health", timeout=2.0)
            if health.status_code != 200:
                raise ConnectionError(f"/health answered {health.status_code}")
            metrics = await self.client.get(b.url + "/metrics", timeout=2.0)
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
        self.metrics.observe_backend(b)

    async def follow_events(self, b: BackendState) -> None:
        """Learn the backend's event stream from the backend itself and subscribe to it."""
        response = await self.client.get(b.url + "/v1/kv_events_endpoint", timeout=2.0)
        if response.status_code != 200:
            return  # no events (flag not set, or an older server): routed by load
        info = response.json()
        if not isinstance(info, dict) or not info.get("endpoint") or not info.get("page_size"):
            return
        b.forget()
        b.page_size = int(info["page_size"])
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
            apply, topic=info.get("topic", ""), curve_server_key=info.get("curve_public_key"))
        log.info("following %s's KV events at %s", b.url, info["endpoint"])

    def mark_down(self, b: BackendState, why: str) -> None:
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


def build_router_app(backend_urls: list[str], *, policy: str = "kv",
                     prefill_urls: list[str] | None = None, timeout: float = 600.0,
                     poll_interval_s: float = 0.5, weights: Weights = Weights()):
    # (no `from __future__ import annotations` here: FastAPI must see the endpoint signatures' types)
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask

    from kvserve.server.forwarding import add_forward_routes, forwarded_headers, relay_get
    from kvserve.server.protocol import error_body
    from kvserve.server.router_stream import Attempt, ResumingRelay, Transcript, with_seed

    router = Router(backend_urls, policy, weights, poll_interval_s)
    prefills = [base_url(u) for u in prefill_urls or []]
    prefill_turn = [0]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0)) as client:
            router.client = client
            await asyncio.gather(*(router.poll(b) for b in router.backends))
            poller = asyncio.create_task(router.poll_forever())
            try:
                yield
            finally:
                poller.cancel()
                router.close()

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("unhandled error in the router")
        return JSONResponse(error_body(f"internal error: {type(err).__name__}", "server_error"), 500)

    async def prefill(path: str, body: Any, headers: dict[str, str]) -> None:
        if not prefills or not isinstance(body, dict):
            return
        url = prefills[prefill_turn[0] % len(prefills)] + path
        prefill_turn[0] += 1
        try:
            response = await router.client.post(url, json=prefill_body(body), headers=headers)
            if response.status_code != 200:
                log.warning("prefill %s answered %d", url, response.status_code)
        except httpx.HTTPError as err:
            log.warning("prefill %s failed (%s); the decode instance computes the prompt", url, err)

    async def forward(path: str, raw: Request):
        content = await raw.body()
        headers = forwarded_headers(raw)
        try:
            body = json.loads(content)
        except ValueError:
            body = None  # a backend answers with the right 400
        hashes = await router.prompt_hashes(path, body, headers)
        await prefill(path, body, headers)
        seeded = with_seed(path, body)
        if seeded is not None:
            content = json.dumps(seeded).encode()
        tried: set[str] = set()
        while True:
            sent = await router.send(path, content, headers, hashes, tried)
            if isinstance(sent, str):
                return JSONResponse(error_body(f"no backend could answer ({sent})", "server_error"),
                                    502)
            ticket, response, reason, predicted = sent
            b = ticket.backend
            kind = response.headers.get("content-type", "application/json")
            if kind.startswith("text/event-stream"):
                break
            try:
                data = await response.aread()
            except httpx.HTTPError as err:  # died before its whole answer came: try another
                router.mark_down(b, f"{b.url}: {err or type(err).__name__}")
                continue
            finally:
                ticket.release()
                await response.aclose()
            router.metrics.decided(b.url, reason, predicted)
            router.metrics.reported(predicted, reported_cached_tokens(data))
            return Response(data, response.status_code, media_type=kind)
        router.metrics.decided(b.url, reason, predicted)

        async def reopen(tried: set[str]) -> Attempt | None:
            while not isinstance(sent := await router.send(path, content, headers, hashes, tried),
                                 str):
                ticket, response, _, predicted = sent
                kind = response.headers.get("content-type", "")
                if response.status_code == 200 and kind.startswith("text/event-stream"):
                    return Attempt(ticket, response, predicted)
                ticket.release()
                await response.aclose()
            return None

        relay = ResumingRelay(Transcript(anthropic=path == "/v1/messages",
                                         chat=path == "/v1/chat/completions"),
                              Attempt(ticket, response, predicted), reopen, router.mark_down,
                              router.metrics)
        return StreamingResponse(relay.body(), response.status_code, media_type=kind,
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(relay.finish))

    add_forward_routes(app, forward, ("/v1/completions", "/v1/chat/completions", "/v1/messages"))

    @app.get("/v1/models")
    async def models(raw: Request):
        for b, _, _ in router.candidates({}):
            try:
                return await relay_get(router.client, b.url + "/v1/models", raw)
            except httpx.HTTPError as err:
                router.mark_down(b, str(err))
        return JSONResponse(error_body("no backend is reachable", "server_error"), 502)

    @app.get("/health")
    async def health():
        """200 while at least one backend is healthy."""
        if any(b.healthy for b in router.backends):
            return Response(status_code=200)
        return JSONResponse(error_body("no backend is healthy", "server_error"), 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @app.get("/router/backends")
    async def backends():
        return [{"url": b.url, "healthy": b.healthy, "num_requests_running": b.num_running,
                 "num_requests_waiting": b.num_waiting, "kv_cache_usage_perc": b.kv_usage,
                 "in_flight": b.in_flight, "backlog_pages": b.backlog, "page_size": b.page_size,
                 "index_pages": len(b.pages)}
                for b in router.backends]

    return app


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="a `kvserve serve` instance (repeat for several)")
    parser.add_argument("--policy", default="kv", choices=["kv", "round-robin"],
                        help="kv: by cached prefix against load (needs the backends' "
                             "--kv-events-endpoint); round-robin: in turn")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a `kvserve serve --role prefill` instance that computes each prompt "
                             "first (repeat for several); the --backend instances then decode")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for a backend's answer")
    parser.add_argument("--poll-interval", type=float, default=0.5,
                        help="seconds between health and load checks of each backend")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])


def main_router(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.server.launch import setup_logging

    setup_logging(args.log_level)  # the router's own lines (backends up and down, decisions)
    if args.poll_interval <= 0:
        raise ValueError("--poll-interval must be positive")
    app = build_router_app(args.backend, policy=args.policy, prefill_urls=args.prefill,
                           timeout=args.timeout, poll_interval_s=args.poll_interval)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
