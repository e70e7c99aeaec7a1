"""Ollama's API on the same server: /api/chat and /api/generate (NDJSON streaming by default, Ollama's
field names and timings in ns), /api/tags, /api/ps (with the KV bytes actually in use beside what a
reserve-at-load runtime would hold for num_ctx), /api/show and /api/version. Requests are translated
(ollama_protocol.py) and served by the OpenAI serving layer, so keys, tenants, admission and the cache
are the same as on every route. Errors are Ollama's `{"error": "..."}` with a 4xx status."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvserve.server import sse
from kvserve.server.anthropic import read_json
from kvserve.server.front import ClosingStream
from kvserve.server.ollama_info import ModelInfo
from kvserve.server.ollama_protocol import ChatRequest, GenerateRequest, parse
from kvserve.server.protocol import APIError, ChatCompletionRequest
from kvserve.server.serving import OpenAIServing, SSEResult

NDJSON = "application/x-ndjson"


@dataclass(slots=True)
class Timer:
    """Ollama's durations (ns): the prompt's evaluation ends at the first output piece."""

    start: float = field(default_factory=time.monotonic)
    first: float | None = None

    def timings(self, usage: dict[str, Any]) -> dict[str, Any]:
        end = time.monotonic()
        first = self.first or end
        ns = lambda s: int(s * 1e9)  # noqa: E731
        return {"total_duration": ns(end - self.start), "load_duration": 0,
                "prompt_eval_count": usage["prompt_tokens"], "prompt_eval_duration": ns(first - self.start),
                "eval_count": usage["completion_tokens"], "eval_duration": ns(end - first)}


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


def ollama_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls (arguments as a JSON string) as Ollama's (arguments as an object)."""
    return [{"function": {"name": c["function"]["name"],
                          "arguments": json.loads(c["function"]["arguments"] or "{}")}} for c in calls]


def register(app: FastAPI, serving: OpenAIServing, info: ModelInfo,
             namespace: Callable[[Request], Awaitable[str]]) -> None:
    # each tenant's last keep_alive and num_ctx, which its /api/ps shows (never another tenant's)
    asked_by: dict[str, dict[str, Any]] = defaultdict(lambda: {"expires_at": None, "num_ctx": None})

    def check_model(name: str) -> str:
        if info.serves(name):
            return info.tag
        raise APIError(f"model '{name}' not found", 404, "not_found_error", "model")

    async def run(raw: Request, model: type, chat_route: bool):
        tenant = await namespace(raw)
        body = parse(model, await read_json(raw))
        name = check_model(body.model)
        asked = asked_by[tenant]
        if body.keep_alive_s() is not None:
            asked["expires_at"] = info.expiry(body.keep_alive_s())
        num_ctx = body.options.num_ctx if body.options else None
        asked["num_ctx"] = num_ctx or asked["num_ctx"]
        if num_ctx is not None and num_ctx > serving.max_model_len:
            raise APIError(f"options.num_ctx {num_ctx} is over this server's max_model_len "
                           f"{serving.max_model_len}; lower num_ctx", param="options.num_ctx")
        if not chat_route and not body.prompt:  # Ollama's "load the model" call
            if body.keep_alive_s() == 0:
                await unload(tenant)
            return {"model": name, "created_at": now_iso(), "response": "", "done": True,
                    "done_reason": "unload" if body.keep_alive_s() == 0 else "load"}
        if body.think not in (None, False) and serving.door.reasoning is None:
            raise APIError("think: this model does not think; leave think out or send false", param="think")
        request = body.openai()
        timer = Timer()
        serve = serving.chat if isinstance(request, ChatCompletionRequest) else serving.completions
        result: SSEResult = await serve(request, raw, tenant, num_ctx)
        events = _events(result.body, name, timer, chat_route, shows_thinking=body.think is not False)
        unloads = body.keep_alive_s() == 0  # once the answer is out
        if body.stream:
            async def lines():
                async for event in events:
                    yield json.dumps(event) + "\n"
                if unloads:
                    await unload(tenant)
            return ClosingStream(lines(), result.close, media_type=NDJSON)
        try:
            return await _whole(events, chat_route)
        finally:
            result.close()
            if unloads:
                await unload(tenant)

    async def unload(tenant: str) -> None:
        """keep_alive 0: Ollama frees the model's memory; the model here is shared, so what goes is this
        tenant's hold on the pool: its prompt leases and tool-call holds (its pages become evictable;
        named caches stay, they are released by id)."""
        llm = serving.engine.engine
        await serving.engine.call(lambda: llm.release_tenant_leases(tenant))

    async def answer(work: Awaitable[Any]):
        try:
            result = await work
        except APIError as err:
            message = err.message if not err.param or err.message.startswith(err.param) \
                else f"{err.param}: {err.message}"
            return JSONResponse({"error": message}, err.status, headers=err.headers)
        return result if isinstance(result, ClosingStream) else JSONResponse(result)

    @app.post("/api/chat")
    async def chat(raw: Request):
        return await answer(run(raw, ChatRequest, True))

    @app.post("/api/generate")
    async def generate(raw: Request):
        return await answer(run(raw, GenerateRequest, False))

    async def tags(raw: Request):
        await namespace(raw)
        return {"models": [info.listing()]}

    async def ps(raw: Request):
        asked = asked_by.get(await namespace(raw), {"expires_at": None, "num_ctx": None})
        engine = serving.engine  # read now, between steps: the last step's snapshot may predate a finish
        stats = await engine.call(engine.engine.stats) if engine.is_running else engine.latest_stats
        return {"models": [info.running(stats, asked["expires_at"], asked["num_ctx"])]}

    async def show(raw: Request):
        await namespace(raw)
        payload = await read_json(raw)
        name = payload.get("model") or payload.get("name") if isinstance(payload, dict) else None
        if not isinstance(name, str) or not name:
            raise APIError("model: give the model's name", param="model")
        check_model(name)
        return info.show()

    async def version(raw: Request):
        await namespace(raw)
        return {"version": info.version}

    def answered(handler):
        async def route(raw: Request):
            return await answer(handler(raw))
        return route

    for path, method, handler in (("/api/tags", "GET", tags), ("/api/ps", "GET", ps),
                                  ("/api/show", "POST", show), ("/api/version", "GET", version)):
        app.add_api_route(path, answered(handler), methods=[method])


async def _whole(events: AsyncIterator[dict[str, Any]], chat_route: bool) -> dict[str, Any]:
    """A non-streamed answer: the streamed events' text (and thinking) joined onto the last one."""
    pieces, thinking, logprobs, last = [], [], [], {}
    async for event in events:
        if "error" in event:
            raise APIError(event["error"], 503, "server_error")
        last = event
        pieces.append(event["message"]["content"] if chat_route else event["response"])
        thinking.append((event["message"] if chat_route else event).get("thinking", ""))
        logprobs += event.get("logprobs", [])
    answer = last["message"] if chat_route else last
    answer["content" if chat_route else "response"] = "".join(pieces)
    if any(thinking):
        answer["thinking"] = "".join(thinking)
    return last | ({"logprobs": logprobs} if logprobs else {})


async def _events(chunks: AsyncIterator[str], name: str, timer: Timer, chat_route: bool,
                  shows_thinking: bool = True) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's chunks as Ollama's events: a piece of text (or of thinking: Ollama's `thinking`, unless
    think is false) each, then the `done` one (tool calls, put together from their streamed pieces, go on it)."""
    calls: dict[int, dict[str, Any]] = {}
    async for payload in sse.payloads(chunks):
        if "error" in payload:
            yield {"error": payload["error"]["message"]}
            return
        choice = payload["choices"][0]
        delta = choice.get("delta")
        piece = (delta.get("content") or "") if delta is not None else choice.get("text", "")
        thought = (delta or {}).get("reasoning_content") or "" if shows_thinking else ""
        for call in (delta or {}).get("tool_calls") or []:
            got = calls.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})
            got["function"]["name"] += call.get("function", {}).get("name") or ""
            got["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
        logprobs = (choice.get("logprobs") or {}).get("content")  # (its tokens' entries, text held back or not)
        if piece or thought or logprobs:
            timer.first = timer.first or time.monotonic()
            text: dict[str, Any] = {"role": "assistant", "content": piece} if chat_route else {"response": piece}
            if thought:
                text["thinking"] = thought
            text = {"message": text} if chat_route else text
            yield {"model": name, "created_at": now_iso(), **text, "done": False,
                   **({"logprobs": logprobs} if logprobs else {})}
        if choice.get("finish_reason") is not None and payload.get("usage"):
            last: dict[str, Any] = {"message": {"role": "assistant", "content": ""}} if chat_route else {"response": ""}
            if calls:
                last["message"]["tool_calls"] = ollama_calls([calls[i] for i in sorted(calls)])
            yield {"model": name, "created_at": now_iso(), **last, "done": True,
                   "done_reason": done_reason(choice["finish_reason"]), **timer.timings(payload["usage"])}
