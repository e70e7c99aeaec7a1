"""HTTP routes about the KV cache itself rather than completions: `POST /tokenize` (vLLM's shape:
find the token offset of your own text) and `POST /detokenize` (its inverse, as vLLM and llama-server
have it), `GET /v1/cache/report` (the live cache report), `GET /v1/kv_events_endpoint` (where a
KV-aware router subscribes to this instance's KV events), `POST /reset_prefix_cache` (vLLM's: forget
every cached page; KV events send AllBlocksCleared; an admin key's only, since it spans tenants) and
`GET /v1/kv_events` (a tenant's own KV events, SSE: kv_event_view.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvserve.server.chat_fields import ChatTemplateFields
from kvserve.server.front import FrontDoor
from kvserve.server.kv_event_view import TenantEventView
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage, error_body


class TokenizeRequest(ChatTemplateFields):
    """A prompt, or messages rendered as /v1/chat/completions renders them (vLLM's template fields too)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # accepted for vLLM's clients; the ids are always those the completion endpoints would use
    add_special_tokens: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[StrictInt]


def kv_routes(door: FrontDoor, namespace: Callable[..., Awaitable[str]],
              namespace_by_api_key: bool, is_admin: Callable[..., Awaitable[bool]],
              metrics_label: Callable[[str], str]) -> APIRouter:
    router = APIRouter()
    async_engine = door.engine
    engine = async_engine.engine

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest, ns: str = Depends(namespace)):
        """The token ids the completion endpoints give the engine for the same prompt or messages
        (the front door's rendering and rule, off the event loop)."""
        if (body.prompt is None) == (body.messages is None):
            return JSONResponse(error_body("send exactly one of `prompt` or `messages`"), 400)
        if body.messages is None:
            ids = (await door.tokenize([body.prompt]))[0]
        else:
            conversation = ChatCompletionRequest(messages=body.messages).conversation()
            ids = await door.render_chat(conversation, options=body.template_options())
        # a JSONResponse skips FastAPI's per-item encoder, which would hold the loop on long prompts
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, ns: str = Depends(namespace)):
        """The text of `tokens`, special tokens included (so /tokenize's ids come back as their text):
        `prompt` as vLLM answers, `content` as llama-server does."""
        vocab = engine.loaded.config.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            return JSONResponse(error_body(f"token ids must be in [0, {vocab}); item {bad} is {body.tokens[bad]}",
                                           param="tokens"), 400)
        text = await door.off_loop(lambda: engine.tokenizer.decode(body.tokens, skip_special_tokens=False))
        return {"prompt": text, "content": text}

    @router.get("/v1/cache/report")
    async def cache_report(ns: str = Depends(namespace), admin: bool = Depends(is_admin)):
        """Hit rates, top prefixes, pages by state, thrash, preemptions, and advice (cache_report.py):
        all of it to an admin key (or a server without keys), a tenant's own part to other keys."""
        report = await async_engine.call(lambda: engine.cache_report(None if admin else ns))
        if admin:  # which /metrics series is whose (the labels are keyed hashes)
            for tenant, view in report["tenants"].items():
                view["metrics_label"] = metrics_label(tenant)
        return report

    @router.get("/v1/kv_events_endpoint")
    async def kv_events_endpoint(ns: str = Depends(namespace), admin: bool = Depends(is_admin)):
        """Where the events are published. The CURVE public key (what lets a subscriber in) only to an
        admin key, a router's: the events span every tenant, so a tenant's key must not open them."""
        publisher = engine.event_publisher
        if publisher is None:
            return JSONResponse(error_body("KV events are off; start with --kv-events-endpoint",
                                           "not_found_error"), 404)
        return {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
                "page_size": engine.config.page_size, "hash_format": publisher.hash_format,
                "topic": publisher.topic.decode(), "encoding": publisher.encoding,
                "curve_public_key": publisher.curve_public_key if admin else None,
                "namespace_by_api_key": namespace_by_api_key, "tenant_events": "/v1/kv_events"}

    view: list[TenantEventView] = []  # made on the first subscriber

    @router.get("/v1/kv_events")
    async def kv_events(ns: str = Depends(namespace), admin: bool = Depends(is_admin)):
        """The caller's own KV events as SSE; an admin key's (or a keyless server's): every tenant's."""
        publisher = engine.event_publisher
        if publisher is None:
            return JSONResponse(error_body("KV events are off; start with --kv-events-endpoint",
                                           "not_found_error"), 404)
        if not view:
            view.append(TenantEventView(publisher))
        return StreamingResponse(view[0].stream(None if admin else ns), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(ns: str = Depends(namespace), admin: bool = Depends(is_admin)):
        """Every tenant's cache, so an admin key's (or a server without keys); refused (409) while
        requests hold pages, as vLLM refuses it."""
        if not admin:
            return JSONResponse(error_body("resetting the prefix cache drops every tenant's pages; "
                                           "it needs a key from --admin-api-key-file",
                                           "permission_error", None, "admin_key_required"), 403)
        def reset() -> tuple[bool, int, int]:
            done = engine.reset_prefix_cache()
            stats = engine.stats().as_dict()
            return done, stats["num_requests_running"] + stats["num_requests_swapped"], stats["num_leases"]

        done, num_running, num_leases = await async_engine.call(reset)
        if not done:  # say what holds the pages: requests, or leases (named caches, cache_control, holds)
            return JSONResponse(error_body(
                f"{num_running} requests are running and {num_leases} leases hold pages (named caches, "
                f"cache_control, tool-call holds); reset the prefix cache when no request runs and the "
                f"leases are released or expired", "conflict_error", None, "pages_in_use"), 409)
        return Response(status_code=200)

    return router

