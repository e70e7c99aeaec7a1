"""The router's HTTP app: each completion request (body capped as `kvserve serve` caps it) goes to
the backend the Router picks; a whole answer is read within its deadline and checked before it is
relayed (a malformed one is that backend's failure: the next backend is tried, then a 502 of the
router's own); a stream goes through ResumingRelay. Also /v1/models and /v1/models/{id}, /health,
/metrics and /router/backends.
"""

# (no `from __future__ import annotations` here: FastAPI must see the endpoint signatures' types)
import asyncio
import contextlib
import json
import logging
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.server.auth import ApiKeys, KeyGate
from kvserve.server.forwarding import add_forward_routes, forwarded_headers, prefill, read_forwarded
from kvserve.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from kvserve.server.protocol import error_body
from kvserve.server.proxy import base_url
from kvserve.server import router_responses
from kvserve.server.router_core import Router, failure_kind
from kvserve.server.router_checks import MAX_ANSWER_BYTES, answer_problem
from kvserve.server.router_index import Weights
from kvserve.server.router_metrics import reported_cached_tokens
from kvserve.server.router_reads import ReadTimeouts, Stalled, TooLarge, read_capped, within
from kvserve.server.router_stream import Attempt, ResumingRelay, Transcript, with_seed

log = logging.getLogger("kvserve.router")


def build_router_app(backend_urls: list[str], *, policy: str = "kv",
                     prefill_urls: list[str] | None = None,
                     timeouts: ReadTimeouts = ReadTimeouts(), poll_interval_s: float = 0.5,
                     weights: Weights = Weights(), backend_keys: dict[str, str] | None = None,
                     max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                     api_keys: list[str] | None = None, curve_client_secret: str | None = None) -> FastAPI:
    """`api_keys`: the clients' keys, checked before anything else (None: forwarded unchecked, the
    backends decide). `curve_client_secret`: the router's own CURVE key for backends' event streams
    that admit listed subscribers only (--kv-events-curve-clients-file)."""
    router = Router(backend_urls, policy, weights, poll_interval_s, backend_keys, timeouts)
    router.curve_client_secret = curve_client_secret
    prefills = [base_url(u) for u in prefill_urls or []]
    prefill_turn = [0]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # per-read deadlines come from router.timeouts; this one only bounds a request's total
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)) as client:
            router.client = client
            await asyncio.gather(*(router.poll(b) for b in router.backends))
            if (warning := router.blind_warning()) is not None:
                log.warning("%s", warning)
            if backend_keys and not api_keys:
                log.warning("the backends take API keys and the router has no --api-key-file: a client's "
                            "wrong key is found only by a backend, after the router has worked for it")
            poller = asyncio.create_task(router.poll_forever())
            try:
                yield
            finally:
                poller.cancel()
                router.close()

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_keys:  # outermost: a wrong key is refused before the body is read or a backend asked
        app.add_middleware(KeyGate, keys=ApiKeys(api_keys))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("unhandled error in the router")
        return JSONResponse(error_body(f"internal error: {type(err).__name__}", "server_error"),
                            500)

    async def forward(path: str, raw: Request):
        request = await read_forwarded(raw)
        content, body, headers = request.content, request.body, request.headers
        stream = isinstance(body, dict) and body.get("stream") is True
        hashes = await router.prompt_hashes(path, body, headers)
        cache_key = router.affinity.key_of(headers, body)
        if prefills:
            url = prefills[prefill_turn[0] % len(prefills)] + path
            prefill_turn[0] += 1
            await prefill(router.client, url, request, timeout=timeouts.whole_s)
        seeded = with_seed(path, body)
        if seeded is not None:
            content = json.dumps(seeded).encode()
        tried: set[str] = set()
        why = None  # the last backend's failure that send() did not see (a malformed answer)
        while True:
            sent = await router.send(path, content, headers, hashes, tried, stream, cache_key)
            if isinstance(sent, str):
                why = sent if why is None or sent != "no backend" else why
                return JSONResponse(error_body(f"no backend could answer ({why})", "server_error"),
                                    502)
            ticket, response, reason, predicted = sent
            b = ticket.backend
            kind = response.headers.get("content-type", "application/json")
            if response.status_code == 200 and kind.startswith("text/event-stream") and stream:
                break
            try:
                data = await within(read_capped(response.aiter_raw(), MAX_ANSWER_BYTES),
                                    timeouts.whole_s, router.alarms[b.url])
                problem = answer_problem(path, response.status_code, kind, data, stream)
            except (httpx.HTTPError, Stalled, TooLarge) as err:  # died or hung mid-answer
                problem, data = f"{err or type(err).__name__}", b""
                failure = "invalid" if isinstance(err, TooLarge) else failure_kind(err)
            else:
                failure = "invalid"
            finally:
                ticket.release()
                with contextlib.suppress(Exception):
                    await response.aclose()
            if problem is not None:
                why = f"{b.url}: {problem}"
                await router.failed(b, why, failure)
                continue
            router.metrics.decided(b.url, reason, predicted)
            router.metrics.reported(predicted, reported_cached_tokens(data))
            return Response(data, response.status_code, media_type=kind)
        router.metrics.decided(b.url, reason, predicted)

        async def reopen(tried: set[str]) -> Attempt | None:
            while not isinstance(sent := await router.send(path, content, headers, hashes, tried,
                                                           True, cache_key), str):
                ticket, response, _, predicted = sent
                kind = response.headers.get("content-type", "")
                if response.status_code == 200 and kind.startswith("text/event-stream"):
                    return Attempt(ticket, response, predicted, router.alarms[ticket.backend.url])
                ticket.release()
                await response.aclose()
            return None

        relay = ResumingRelay(Transcript(anthropic=path == "/v1/messages",
                                         chat=path == "/v1/chat/completions"),
                              Attempt(ticket, response, predicted, router.alarms[b.url]), reopen,
                              router.failed, router.metrics, timeouts)
        return StreamingResponse(relay.body(), 200, media_type=kind,
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(relay.finish))

    add_forward_routes(app, forward, ("/v1/completions", "/v1/chat/completions", "/v1/messages"))
    router_responses.register(app, router)

    async def ask_a_backend(raw: Request, path: str, valid) -> JSONResponse:
        """The first reachable backend's answer to GET `path` (the backends serve the same model); a 200
        that `valid` refuses marks that backend failed, as an unreachable one."""
        for b, _, _ in router.candidates({}):
            try:
                response = await router.client.get(b.url + path, headers=forwarded_headers(raw),
                                                   timeout=timeouts.first_byte_s)
                data = response.json()
            except (httpx.HTTPError, ValueError) as err:
                await router.failed(b, f"{b.url}: {path}: {err or type(err).__name__}",
                                    "invalid" if isinstance(err, ValueError) else failure_kind(err))
                continue
            if response.status_code == 200 and not (isinstance(data, dict) and valid(data)):
                await router.failed(b, f"{b.url}: {path} answered no model", "invalid")
                continue
            return JSONResponse(data, response.status_code)
        return JSONResponse(error_body("no backend is reachable", "server_error"), 502)

    @app.get("/v1/models")
    async def models(raw: Request):
        return await ask_a_backend(raw, "/v1/models", lambda data: isinstance(data.get("data"), list))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, raw: Request):
        return await ask_a_backend(raw, "/v1/models/" + quote(model_id, safe="/"),
                                   lambda data: isinstance(data.get("id"), str))

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
                 "index_pages": len(b.pages), "events": b.events_note}
                for b in router.backends]

    return app
