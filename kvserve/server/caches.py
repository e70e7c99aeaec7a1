"""Named caches, /v1/caches: a prefix computed once (prefill only) and leased under a name, per tenant,
like a provider's cached-content API. POST creates, GET lists or shows, PATCH extends, DELETE releases.

A cache holds the tokens of `prompt` (raw text), or of the chat prefix `system` + `messages` rendered
through the model's template up to the end of the last block (without the closing markup, so that
any longer chat starts with it). Using a named cache = sending a prompt that starts with that text:
a /v1/messages or /v1/chat/completions request with the same system (and first messages), or a
/v1/completions prompt that starts with `prompt`, from the same tenant; the prefix cache then reads
its tokens (`cache_read_input_tokens`, `prompt_tokens_details.cached_tokens`), and the read refreshes
the lease. Another tenant's caches are invisible (404) and its prompts never share the pages.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.async_engine import EngineDeadError
from kvserve.sampling_params import SamplingParams
from kvserve.server.anthropic_protocol import Block, InputMessage, parse_chat, MessagesRequest
from kvserve.server.breakpoints import lease_ttl_s, make_lease
from kvserve.server.front import FrontDoor
from kvserve.server.protocol import APIError, Text

MAX_CACHES_PER_TENANT = 256


class CreateCache(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[Text, Field(min_length=1, max_length=256)]
    prompt: Annotated[Text, Field(min_length=1)] | None = None
    system: Text | list[Block] | None = None
    messages: list[InputMessage] | None = None
    ttl: Literal["5m", "1h"] = "5m"

    @model_validator(mode="after")
    def _one_source(self) -> CreateCache:
        chat = self.system is not None or bool(self.messages)
        if (self.prompt is not None) == chat:
            raise ValueError("give either `prompt`, or `system` and/or `messages`")
        return self


class ExtendCache(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ttl: Literal["5m", "1h"]


@dataclass(slots=True)
class NamedCache:
    id: str
    name: str
    tokens: int
    ttl: str
    created_at: int
    expires_at: float
    lease_id: str

    def body(self) -> dict[str, Any]:
        out = asdict(self)
        del out["lease_id"]
        return {"object": "cache", **out}


class CacheRegistry:
    """tenant -> cache id -> NamedCache. Ids are random, and every lookup is within the tenant."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, dict[str, NamedCache]] = {}

    def add(self, tenant: str, cache: NamedCache) -> None:
        self._by_tenant.setdefault(tenant, {})[cache.id] = cache

    def get(self, tenant: str, cache_id: str) -> NamedCache | None:
        return self._by_tenant.get(tenant, {}).get(cache_id)

    def all(self, tenant: str) -> list[NamedCache]:
        return list(self._by_tenant.get(tenant, {}).values())

    def remove(self, tenant: str, cache_id: str) -> NamedCache | None:
        return self._by_tenant.get(tenant, {}).pop(cache_id, None)


class CacheService:
    def __init__(self, door: FrontDoor, model_names: list[str]) -> None:
        self.door = door
        self.engine = door.engine
        self.model_names = model_names
        self.registry = CacheRegistry()
        self.renderer = door.renderer

    def prefix_tokens(self, body: CreateCache) -> list[int]:
        """The cache's token ids, by the front door's rule (blocking: run it off the event loop)."""
        if body.prompt is not None:
            return self.door.encode(body.prompt)
        request = MessagesRequest(model=self.model_names[0], max_tokens=1, system=body.system,
                                  messages=body.messages or [InputMessage(role="user", content="")])
        chat = parse_chat(request)
        turns = chat.turns if body.messages else []
        system = len(chat.system.text) if chat.system is not None else 0
        self.door.check_chars(system + sum(len(t.text) for t in turns), "messages")
        rendered = self.renderer.render(chat.system, turns)
        last = chat.message_ends[-1] if body.messages else None
        if last is None:
            if chat.system is None or not chat.system.blocks:
                raise APIError("the cache has no text; send a non-empty `system` or `messages`")
            last = (-1, len(chat.system.blocks) - 1)
        return rendered.token_ids[:self.renderer.token_offsets(chat.system, turns, rendered, [last])[0]]

    async def create(self, body: CreateCache, tenant: str) -> dict[str, Any]:
        if any(c.name == body.name for c in self.registry.all(tenant)):
            raise APIError(f"a cache named {body.name!r} exists; delete it or pick another name", 409,
                           param="name")
        if len(self.registry.all(tenant)) >= MAX_CACHES_PER_TENANT:
            raise APIError(f"at most {MAX_CACHES_PER_TENANT} named caches per API key; delete some",
                           429)
        if body.prompt is not None:
            self.door.check_chars(len(body.prompt))
        release = self.door.admit(tenant, 1)
        try:
            token_ids = await self.door.off_loop(lambda: self.prefix_tokens(body))
            output, cache_id = await self._prefill(token_ids, body.ttl, tenant)
        finally:
            release()
        return await self._register(tenant, body, token_ids, output, cache_id)

    async def _prefill(self, token_ids: list[int], ttl: str, tenant: str) -> tuple[Any, str]:
        """Compute the prefix once under a lease (prefill only); a shutdown cut is a 503."""
        if not token_ids:
            raise APIError("the cache's text is empty")
        lease = make_lease(self.engine.engine, len(token_ids), ttl)
        lease.shared = False  # its own lease: deleting another cache of this prefix leaves it
        cache_id = f"kvc_{uuid.uuid4().hex}"
        self.door.check_open()
        try:
            stream = await self.engine.add_request(token_ids, SamplingParams(max_tokens=1), cache_id,
                                                   tenant, leases=[lease])
            output = None
            async for output in stream:
                pass
        except ValueError as err:
            raise APIError(str(err), param="prompt") from None
        except EngineDeadError as err:
            raise APIError(str(err), 503, "server_error") from None
        cut = self.door.cut_by_shutdown([output.outputs[0].finish_reason if output else "abort"])
        if cut is not None:
            raise cut
        return output, cache_id

    async def _register(self, tenant: str, body: CreateCache, token_ids: list[int], output: Any,
                        cache_id: str) -> dict[str, Any]:
        llm = self.engine.engine
        usage = getattr(output, "lease_usage", None)
        if usage is None or not usage.lease_ids:
            reason = getattr(usage, "refused", None) or "not granted"
            status = 400 if reason == "below_min_cacheable" else 429
            raise APIError(f"the {len(token_ids)}-token prefix was computed but not leased: {reason}",
                           status, code=reason)
        lease_id = usage.lease_ids[-1]
        info = await self.engine.call(lambda: llm.lease_info(tenant, lease_id))
        if info is None:
            raise APIError("the lease expired as it was granted; try again with a longer ttl", 409)
        cache = NamedCache(cache_id, body.name, info.num_tokens, body.ttl, int(time.time()),
                           info.expires_at, lease_id)
        self.registry.add(tenant, cache)
        return cache.body()

    async def refreshed(self, tenant: str, cache_id: str) -> NamedCache:
        """The cache with its current expiry (reads refresh it); an expired one is dropped: 404."""
        cache = self.registry.get(tenant, cache_id)
        if cache is not None:
            llm = self.engine.engine
            info = await self.engine.call(lambda: llm.lease_info(tenant, cache.lease_id))
            if info is not None:
                cache.expires_at = info.expires_at
                return cache
            self.registry.remove(tenant, cache_id)
        raise APIError(f"no cache {cache_id!r} (it may have expired)", 404, "not_found_error",
                       code="cache_not_found")

    async def extend(self, tenant: str, cache_id: str, body: ExtendCache) -> dict[str, Any]:
        cache = await self.refreshed(tenant, cache_id)
        llm, ttl_s = self.engine.engine, lease_ttl_s(self.engine.engine, body.ttl)
        info = await self.engine.call(lambda: llm.extend_lease(tenant, cache.lease_id, ttl_s))
        if info is None:
            self.registry.remove(tenant, cache_id)
            raise APIError(f"no cache {cache_id!r} (it expired)", 404, "not_found_error")
        cache.ttl, cache.expires_at = body.ttl, info.expires_at
        return cache.body()

    async def delete(self, tenant: str, cache_id: str) -> dict[str, Any]:
        cache = self.registry.remove(tenant, cache_id)
        if cache is None:
            raise APIError(f"no cache {cache_id!r}", 404, "not_found_error", code="cache_not_found")
        llm = self.engine.engine
        await self.engine.call(lambda: llm.release_lease(tenant, cache.lease_id))
        return {"id": cache_id, "object": "cache.deleted", "deleted": True}


def register(app: FastAPI, door: FrontDoor, model_names: list[str],
             namespace: Callable[[Request], Awaitable[str]]) -> None:
    service = CacheService(door, model_names)
    app.state.caches = service

    @app.post("/v1/caches")
    async def create_cache(body: CreateCache, tenant: str = Depends(namespace)):
        return await service.create(body, tenant)

    @app.get("/v1/caches")
    async def list_caches(tenant: str = Depends(namespace)):
        live = []
        for cache in service.registry.all(tenant):
            try:
                live.append((await service.refreshed(tenant, cache.id)).body())
            except APIError:
                pass  # expired since the last look
        return {"object": "list", "data": live}

    @app.get("/v1/caches/{cache_id}")
    async def get_cache(cache_id: str, tenant: str = Depends(namespace)):
        return (await service.refreshed(tenant, cache_id)).body()

    @app.patch("/v1/caches/{cache_id}")
    async def extend_cache(cache_id: str, body: ExtendCache, tenant: str = Depends(namespace)):
        return await service.extend(tenant, cache_id, body)

    @app.delete("/v1/caches/{cache_id}")
    async def delete_cache(cache_id: str, tenant: str = Depends(namespace)):
        return await service.delete(tenant, cache_id)
