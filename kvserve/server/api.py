"""The FastAPI app of `kvserve serve`: OpenAI's /v1/completions, /v1/chat/completions and /v1/models,
plus /health, /metrics (Prometheus text), /dashboard (a live page) and /dashboard/stats (its JSON).

`build_app(engine)` wraps an `LLMEngine` (or an `AsyncEngine` the caller owns) and starts the engine
loop with the app. Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}` with a
4xx status (validation is 400, not FastAPI's 422). With API keys, `/v1/*`, `/docs` and
`/openapi.json` need `Authorization: Bearer KEY`, and each key gets its own prefix-cache namespace
unless the keys share one. Bodies over `max_request_bytes` get a 413 before parsing; requests beyond
the admission limits a 429 with Retry-After (limits.py). `kvserve serve` itself is in launch.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from kvserve.async_engine import AsyncEngine
from kvserve.engine import LLMEngine
from kvserve.engine_stats import EngineStats
from kvserve.metrics import CONTENT_TYPE, EngineMetrics
from kvserve.server import anthropic, caches, llamacpp, ollama, render_routes, responses
from kvserve.server.auth import (DEFAULT_MAX_UNAUTHENTICATED, INVALID_KEY, NAMESPACE_SCOPE_KEY,
                                 ApiKeys, KeyGate, key_namespace)  # noqa: F401 (re-exported)
from kvserve.server.error_shapes import api_family, front_error
from kvserve.server.front import FrontDoor, sse_response
from kvserve.server.inflight import InFlight, InFlightCaps
from kvserve.server.kv_routes import kv_routes
from kvserve.server.limits import (DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT_S, Admission,
                                   BodyLimit)
from kvserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body, model_not_found
from kvserve.server.ollama_info import kvserve_version, model_info
from kvserve.server.openapi_doc import document
from kvserve.server.serving import OpenAIServing, SSEResult

log = logging.getLogger("kvserve.server")
DASHBOARD = Path(__file__).with_name("dashboard.html")
STATS_KEYS = ("kv_cache_usage_perc", "cpu_cache_usage_perc", "num_pages_total", "num_pages_free",
              "num_pages_used", "num_pages_cached", "num_requests_running", "num_requests_waiting",
              "num_requests_swapped", "num_preemptions", "num_evictions", "prefix_cache_queries",
              "prefix_cache_hits", "prompt_tokens", "prompt_tokens_cached", "generation_tokens",
              "remote_cache_hits", "remote_cache_errors", "page_size", "kv_cache_dtype",
              "max_model_len", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
              "spec_decode_num_accepted_tokens")


def build_app(engine: LLMEngine | AsyncEngine, *, model_name: str | None = None,
              api_keys: list[str] | None = None, shared_cache_namespace: bool = False,
              admin_api_keys: list[str] | None = None,
              extra_model_names: list[str] | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_waiting_requests: int = 0,
              max_requests_per_tenant: int = 0, metrics_name_prefix: str = "kvserve",
              metrics_tenant_labels: str = "keyed", metrics_tenant_secret: bytes | None = None,
              metrics_v0_names: bool = False,
              read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
              max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
              in_flight_caps: InFlightCaps | None = None, reasoning_format: str = "auto") -> FastAPI:
    owns_engine = isinstance(engine, LLMEngine)
    llm_engine = engine if owns_engine else engine.engine
    model_name = model_name or default_model_name(llm_engine)
    metrics = EngineMetrics(model_name, prefix=metrics_name_prefix,
                            cache_config=cache_config_labels(llm_engine),
                            tenant_labels=metrics_tenant_labels, tenant_secret=metrics_tenant_secret,
                            max_model_len=llm_engine.max_model_len, v0_names=metrics_v0_names)
    metrics.requests.start_after(llm_engine.num_steps, llm_engine.num_step_tokens)
    if owns_engine:
        async_engine = AsyncEngine(engine, on_step=metrics.observe)
    else:
        async_engine = engine
        previous = async_engine.on_step  # several apps may watch one engine (tests)
        async_engine.on_step = _chain(previous, metrics.observe)
    names = [model_name, *(n for n in extra_model_names or [] if n and n != model_name)]
    door = FrontDoor(async_engine, Admission(max_waiting_requests, max_requests_per_tenant), reasoning_format)
    serving = OpenAIServing(door, names)
    keys = ApiKeys(api_keys, shared_cache_namespace, admin_api_keys)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            door.close()
            if owns_engine:
                async_engine.shutdown()

    hidden = bool(keys)  # with keys, the schema is served below, behind the key
    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url=None if hidden else "/docs",
                  redoc_url=None, openapi_url=None if hidden else "/openapi.json")
    app.openapi = lambda: document(app, names)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.door = door
    in_flight = InFlight(in_flight_caps) if in_flight_caps is not None else None
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, read_timeout_s=read_timeout_s,
                       in_flight=in_flight)
    # added last, so outermost: the key is checked before the body cap reads a byte of the body
    app.add_middleware(KeyGate, keys=keys, max_unauthenticated=max_unauthenticated,
                       read_timeout_s=read_timeout_s)
    _add_error_handlers(app)

    async def namespace(request: Request) -> str:
        """The tenant's cache namespace, as KeyGate found it from the headers."""
        found = request.scope.get(NAMESPACE_SCOPE_KEY)
        if found is None:
            found = keys.namespace_of({k.lower(): v for k, v in request.headers.items()})
        if found is None:
            raise APIError(INVALID_KEY, 401, "invalid_request_error", None, "invalid_api_key")
        return found

    async def is_admin(request: Request) -> bool:
        return keys.is_admin({k.lower(): v for k, v in request.headers.items()})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request, ns: str = Depends(namespace)):
        return _respond(await serving.completions(body, raw, ns))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request,
                               ns: str = Depends(namespace)):
        return _respond(await serving.chat(body, raw, ns))

    def model_card(name: str, created: int) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "kvserve", "root": names[0],
                "max_model_len": async_engine.engine.max_model_len}

    @app.get("/v1/models")
    async def models(ns: str = Depends(namespace)):
        created = int(time.time())
        return {"object": "list", "data": [model_card(name, created) for name in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, ns: str = Depends(namespace)):
        """One served model (the OpenAI SDK's `models.retrieve`); a name this server does not serve is a 404."""
        if model_id not in names:
            raise model_not_found(model_id, names)
        return model_card(model_id, int(time.time()))

    app.include_router(kv_routes(door, namespace, bool(keys) and not shared_cache_namespace, is_admin,
                                 metrics.tenant_label))

    if hidden:
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(ns: str = Depends(namespace)):
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False)
        async def docs(ns: str = Depends(namespace)):
            return get_swagger_ui_html(openapi_url="/openapi.json", title="kvserve")

    anthropic.register(app, door, names, namespace)
    caches.register(app, door, names, namespace)
    render_routes.register(app, door, names, namespace)
    llamacpp.register(app, serving, namespace)
    responses.register(app, serving, namespace)
    ollama.register(app, serving, model_info(llm_engine, names, kvserve_version(), door.reasoning is not None),
                    namespace)

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            return JSONResponse(error_body("the engine loop is not running", "server_error"), 503)
        if door.draining:  # load balancers: route new requests elsewhere
            return JSONResponse(error_body("the server is shutting down", "server_error"), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return HTMLResponse(DASHBOARD.read_text(encoding="utf-8"))

    @app.get("/dashboard/stats")
    async def dashboard_stats():
        pages = await async_engine.call(async_engine.page_states) if async_engine.is_running else None
        return dashboard_payload(async_engine.latest_stats, pages, model_name)

    return app


def dashboard_payload(stats: EngineStats | None, pages: str | None, model_name: str) -> dict[str, Any]:
    """/dashboard/stats: STATS_KEYS of the flat view (zeros before the first read) and the hit rate."""
    flat = stats.as_dict() if stats is not None else dict.fromkeys(STATS_KEYS, 0)
    payload = {key: flat[key] for key in STATS_KEYS}
    payload.update(model=model_name, time=time.time(),
                   prefix_cache_hit_rate=stats.hit_rate if stats is not None else 0.0, pages=pages)
    return payload


def cache_config_labels(engine: LLMEngine) -> dict[str, str]:
    """`cache_config_info`'s labels, named as vLLM's CacheConfig fields (llm-d reads block_size)."""
    cache = engine.cache_config
    return {"block_size": str(cache.page_size), "num_gpu_blocks": str(cache.num_pages),
            "num_cpu_blocks": str(engine.host_tier.capacity_pages), "cache_dtype": cache.kv_dtype.name,
            "enable_prefix_caching": str(cache.prefix_cache.value != "off")}


def default_model_name(engine: LLMEngine) -> str:
    name = getattr(getattr(engine.loaded, "config", None), "name", None)
    return str(name or (Path(engine.config.model).stem if engine.config.model else "kvserve"))


def validation_error_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """pydantic's first error as OpenAI's error JSON, with `param` the field's dotted path."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": (), "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_body(f"the request body is not valid JSON: {detail}".rstrip(": "))
    # a union field fails once per member; a member's range or length error (the value had the
    # right shape) names the problem better than "Input should be a valid string"
    field_path = _field_path(first)
    same_field = [e for e in errors if _field_path(e) == field_path]
    first = next((e for e in same_field if not str(e.get("type", "")).endswith("_type")), first)
    param = ".".join(_field_path(first)) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    return error_body(message, "invalid_request_error", param, None)


def _field_path(error: dict[str, Any]) -> list[str]:
    """The error's location without "body" and pydantic's union-member tags ("str", "list[int]")."""
    loc = error.get("loc", ())[1:]
    return [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after",
              "function-before", "function-wrap"}


def _respond(result: dict | SSEResult) -> Any:
    return JSONResponse(result) if isinstance(result, dict) else sse_response(result)


def _chain(first, second):
    if first is None:
        return second

    def both(stats, outputs):
        first(stats, outputs)
        second(stats, outputs)
    return both


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError):
        return JSONResponse(validation_error_body(err.errors()), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        """A path or method no route serves, in the shape of the API family the path belongs to."""
        path, message = request.url.path, str(err.detail)
        if err.status_code == 404 and api_family(path) == "ollama":  # e.g. `ollama pull`, /api/embed
            served = sorted({r.path for r in request.app.routes if getattr(r, "path", "").startswith("/api/")})
            message = (f"{path} is not served here: kvserve serves the one model it started with (--model), "
                       f"on {', '.join(served)}")
        type_ = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(front_error(path, err.status_code, message, type_), err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(err).__name__}", "server_error"), 500)
