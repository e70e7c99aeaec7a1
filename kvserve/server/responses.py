"""OpenAI's Responses API: `POST /v1/responses` (streamed as its typed events, or whole), `GET` and
`DELETE /v1/responses/{id}`. A request runs as a chat request (responses_protocol.py) through the
serving layer; its output becomes `message` and `function_call` items. `store: true` (the default)
keeps the response and its conversation for the tenant (responses_store.py; also beside the disk tier or
in Redis when the server has one, so it outlives a restart: responses_persist.py) and holds the
conversation's KV pages under the response id (the tool-call hold's mechanism, for 5 minutes), so
a follow-up by `previous_response_id` renders the same prefix and hits it."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvserve.server import sse
from kvserve.server.anthropic import read_json
from kvserve.server.front import ClosingStream, SSE_HEADERS
from kvserve.server.ollama_protocol import validated
from kvserve.server.protocol import APIError
from kvserve.server.responses_diagnostics import compare, prompt_record
from kvserve.server.responses_protocol import ResponsesRequest
from kvserve.server.responses_persist import response_backing
from kvserve.server.responses_store import MAX_BYTES, MAX_RESPONSES, ResponseStore
from kvserve.server.router_responses import RESPONSE_ID_HEADER
from kvserve.server.serving import OpenAIServing


RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


class ResponseBuilder:
    """The response object and its stream events, from the chat chunks of one request."""

    def __init__(self, response_id: str, body: ResponsesRequest, model: str, extra: dict[str, Any]) -> None:
        self.body, self.items, self.seq = body, [], 0
        self.message: dict[str, Any] | None = None
        self.thinking: dict[str, Any] | None = None  # a thinking model's reasoning item (reasoning.py)
        self.logprobs: list[dict[str, Any]] = []  # entries not yet sent with a text delta (include's logprobs)
        self.calls: dict[int, dict[str, Any]] = {}
        self.response = {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "instructions": body.instructions, "error": None,
            "incomplete_details": None, "previous_response_id": body.previous_response_id,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
                            else body.tool_choice.model_dump()) or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "store": body.store,
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text and body.text.format else {"type": "text"}},
            "metadata": body.metadata or {}, "truncation": "disabled", "usage": None,
            "prompt_cache_key": body.prompt_cache_key, **extra}
        if body.prompt_cache_options is not None:
            self.response["prompt_cache_options"] = body.prompt_cache_options.applied()

    def event(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **fields}

    def snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": [dict(item) for item in self.items]}

    async def events(self, payloads: AsyncIterator[dict[str, Any]]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        yield self.event("response.created", response=self.snapshot())
        yield self.event("response.in_progress", response=self.snapshot())
        async for chunk in payloads:
            if "error" in chunk:
                yield self.event("error", code=chunk["error"].get("code"), message=chunk["error"]["message"],
                                 param=chunk["error"].get("param"))
                return
            if not chunk.get("choices"):
                continue
            choice = chunk["choices"][0]
            delta = {} if self.body.prewarm else choice.get("delta") or {}  # prewarm: no output
            if self.body.wants_logprobs and not self.body.prewarm:
                self.logprobs += (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content"):
                for e in self._reasoning(delta["reasoning_content"]):
                    yield e
            if delta.get("content"):
                for e in self._text(delta["content"]):
                    yield e
            for call in delta.get("tool_calls") or []:
                for e in self._call(call):
                    yield e
            if choice.get("finish_reason") is not None and chunk.get("usage"):
                for e in self._finish(choice["finish_reason"], chunk["usage"], chunk):
                    yield e

    def _text(self, piece: str) -> list[tuple[str, dict[str, Any]]]:
        out = []
        if self.message is None:
            self.message = {"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "in_progress",
                            "role": "assistant", "content": []}
            self.items.append(self.message)
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item={**self.message, "content": []}))
            part = {"type": "output_text", "text": "", "annotations": [],
                    **({"logprobs": []} if self.body.wants_logprobs else {})}
            self.message["content"].append(part)
            out.append(self.event("response.content_part.added", item_id=self.message["id"],
                                  output_index=len(self.items) - 1, content_index=0, part=dict(part)))
        part, sent, self.logprobs = self.message["content"][0], self.logprobs, []
        part["text"] += piece
        if self.body.wants_logprobs:
            part["logprobs"] = part["logprobs"] + sent
        out.append(self.event("response.output_text.delta", item_id=self.message["id"],
                              output_index=self.items.index(self.message), content_index=0, delta=piece,
                              logprobs=sent))
        return out

    def _reasoning(self, piece: str) -> list[tuple[str, dict[str, Any]]]:
        """A piece of the reasoning, as vLLM's Responses API gives a thinking model's: a `reasoning` item whose
        `reasoning_text` grows by `response.reasoning_text.delta` events."""
        out = []
        if self.thinking is None:
            self.thinking = {"type": "reasoning", "id": f"rs_{secrets.token_hex(12)}", "summary": [],
                             "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            self.items.append(self.thinking)
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item={**self.thinking, "content": []}))
        self.thinking["content"][0]["text"] += piece
        out.append(self.event("response.reasoning_text.delta", item_id=self.thinking["id"],
                              output_index=self.items.index(self.thinking), content_index=0, delta=piece))
        return out

    def _call(self, call: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out, fn = [], call.get("function") or {}
        item = self.calls.get(call["index"])
        if item is None:
            item = {"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call.get("id") or
                    f"call_{secrets.token_hex(12)}", "name": fn.get("name") or "", "arguments": "",
                    "status": "in_progress"}
            self.calls[call["index"]] = item
            self.items.append(item)
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=dict(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.items.index(item), delta=fn["arguments"]))
        return out

    def _finish(self, reason: str, usage: dict[str, Any], chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        # the last tokens' logprobs, whose text never came (a stop string held it back); none without a message:
        # those were a tool call's tokens
        out = self._text("") if self.message is not None and self.logprobs else []
        for index, item in enumerate(self.items):
            item["status"] = "completed"
            if item is self.message:
                part = item["content"][0]
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=part.get("logprobs", [])))
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
            elif item is self.thinking:
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=item["content"][0]["text"]))
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"], name=item["name"]))
            out.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        if self.body.prewarm:  # the one token computed is dropped, not output
            usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
            reason = "stop"
        self.response.update(
            status="incomplete" if reason == "length" else "completed",
            incomplete_details={"reason": "max_output_tokens"} if reason == "length" else None,
            usage={"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                   "output_tokens": usage["completion_tokens"],
                   "output_tokens_details": {"reasoning_tokens": usage.get("completion_tokens_details", {}).get(
                       "reasoning_tokens", 0)}, "total_tokens": usage["total_tokens"]},
            **{k: chunk[k] for k in ("prompt_cache_retention", "prompt_cache_retention_note", "kv_cache")
               if k in chunk})
        done = "response.incomplete" if reason == "length" else "response.completed"
        out.append(self.event(done, response=self.snapshot()))
        return out

    def assistant_message(self) -> list[dict[str, Any]]:
        """The output as the chat turn a follow-up renders (calls with their ids); none for a prewarm."""
        if self.body.prewarm:
            return []
        text = self.message["content"][0]["text"] if self.message else ""
        turn: dict[str, Any] = {"role": "assistant", "content": text or None}
        calls = [i for i in self.items if i["type"] == "function_call"]
        if calls:
            turn["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                   "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        return [turn]


def register(app: FastAPI, serving: OpenAIServing, namespace: Callable[[Request], Awaitable[str]]) -> None:
    config = serving.engine.engine.config
    store = ResponseStore(backing=response_backing(config.kv_disk_path, config.redis_url, MAX_RESPONSES, MAX_BYTES,
                                                   serving.engine.engine.tier_auth))
    app.state.responses = store

    async def io(work: Callable[[], Any]) -> Any:
        """The store's calls: on worker threads when they write to disk or Redis."""
        return work() if store.backing is None else await serving.door.off_loop(work)

    def not_found(response_id: str, param: str | None = None) -> APIError:
        return APIError(f"Response with id '{response_id}' not found.", 404, "invalid_request_error", param)

    async def resumed_id(raw: Request, tenant: str) -> str | None:
        """`kvserve router` resuming a stream another backend began asks for that response's id (one
        of this id's shape, not stored here for the tenant: a caller can only name a new one)."""
        asked = raw.headers.get(RESPONSE_ID_HEADER)
        if asked is None or not RESPONSE_ID.fullmatch(asked):
            return None
        return None if await io(lambda: store.get(tenant, asked)) is not None else asked

    @app.post("/v1/responses")
    async def create(raw: Request):
        tenant = await namespace(raw)
        body = validated(ResponsesRequest, await read_json(raw))
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = await io(lambda: store.get(tenant, body.previous_response_id))
            if previous is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            earlier = previous.messages
        chat = body.chat_request(earlier)
        response_id = await resumed_id(raw, tenant) or f"resp_{secrets.token_hex(16)}"
        result = await serving.chat(chat, raw, tenant, hold_key=response_id if body.store else None,
                                    continues=body.previous_response_id)
        record = prompt_record(body.prompt_cache_key, chat.tools and [t.model_dump() for t in chat.tools],
                               body.text.model_dump() if body.text else None, result.prompt or [])
        extra = {}
        options = body.prompt_cache_options
        if options is not None and options.comparison_response_id is not None:
            compared = await io(lambda: store.get(tenant, options.comparison_response_id))
            extra["prompt_cache_diagnostics"] = compare(compared.prompt if compared else None, record)
        builder = ResponseBuilder(response_id, body, serving.model_names[0], extra)
        events = builder.events(sse.payloads(result.body))

        async def keep() -> None:
            if body.store and builder.response["status"] in ("completed", "incomplete"):
                snapshot = builder.snapshot()
                messages = [*earlier, *body.new_messages(breakpoints=False), *builder.assistant_message()]
                await io(lambda: store.put(tenant, snapshot, messages, record))

        if body.stream:
            async def lines() -> AsyncIterator[str]:
                async for kind, payload in events:
                    yield sse.event(payload, kind)
                await keep()
            return ClosingStream(lines(), result.close, media_type="text/event-stream",
                                 headers={**SSE_HEADERS, RESPONSE_ID_HEADER: response_id})
        try:
            async for kind, payload in events:
                if kind == "error":
                    raise APIError(payload["message"], 503, "server_error", payload.get("param"), payload.get("code"))
        finally:
            result.close()
        await keep()
        return JSONResponse(builder.snapshot(), headers={RESPONSE_ID_HEADER: response_id})

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str, raw: Request):
        tenant = await namespace(raw)
        found = await io(lambda: store.get(tenant, response_id))
        if found is None:
            raise not_found(response_id)
        return found.response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, raw: Request):
        tenant = await namespace(raw)
        if not await io(lambda: store.delete(tenant, response_id)):
            raise not_found(response_id)
        await serving.door.tool_holds.release(tenant, response_id)  # its KV need not wait for the TTL
        return {"id": response_id, "object": "response.deleted", "deleted": True}
