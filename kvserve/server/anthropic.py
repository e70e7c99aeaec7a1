"""POST /v1/messages: Anthropic's Messages API over the engine, with `cache_control` breakpoints as KV
leases, usage split into input / cache creation / cache read tokens, and cache diagnostics.

The chat (system + messages, text blocks joined by "\\n") is rendered through the model's template;
each breakpoint becomes a `CacheLease` of the prompt tokens up to and including its block (see
breakpoints.py for how that count is found). Streaming sends Anthropic's event sequence:
message_start, content_block_start, ping, content_block_delta..., content_block_stop, message_delta
(the final cumulative usage), message_stop; a failure mid-stream is an `error` event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvserve.async_engine import AsyncEngine, EngineDeadError, RequestStream
from kvserve.model.tokenizer import ChatTemplateOptions
from kvserve.request import RequestOutput, ToolCallKV
from kvserve.sampling_params import SamplingParams
from kvserve.server import sse
from kvserve.server.anthropic_blocks import BlockEvents, content_blocks
from kvserve.server.anthropic_protocol import (MessagesRequest, ParsedChat, anthropic_error,
                                               parse_chat, parse_request)
from kvserve.server.breakpoints import SYSTEM, TOOLS, ChatRenderer, RenderedChat, make_lease
from kvserve.server.cache_diagnostics import DiagnosticsStore, PromptFingerprint, fingerprint
from kvserve.server.constraint_error import unenforced
from kvserve.server.protocol import APIError
from kvserve.server.reasoning import ReasoningSplit
from kvserve.server.tool_grammar import with_tool_grammar
from kvserve.server.tool_parser import ToolFormat
from kvserve.structured import GrammarError
from kvserve.server.front import FrontDoor, sse_response, stream_failure
from kvserve.server.serving import SSEResult, unless_disconnected
from kvserve.server.text_delta import TextDelta

LABELS = ("5m", "1h")


@dataclass(slots=True)
class Pending:
    """One /v1/messages request in the engine."""

    id: str
    model: str
    num_prompt_tokens: int
    stop_sequences: list[str]
    is_prewarm: bool  # max_tokens 0: fill the cache, generate nothing
    is_clamped: bool  # max_tokens cut to fit max_model_len
    leases_asked: bool
    diagnostics: dict[str, Any] | None  # the response's `diagnostics`, if asked for
    kv_explain: bool = False
    tool_format: ToolFormat | None = None  # tools offered (and not tool_choice none): read calls
    parallel_tools: bool = True
    tool_kv: ToolCallKV | None = None  # the tool-call holds it asked for and ended
    reasoning: ReasoningSplit | None = None  # a thinking model's: its reasoning goes to a thinking block


def usage(pending: Pending, output: RequestOutput) -> dict[str, Any]:
    """Anthropic's usage: input + cache creation + cache read = prompt tokens. Without leases, read
    is what the prefix cache served; with leases, the engine's count up to the last breakpoint."""
    n = pending.num_prompt_tokens
    lease = getattr(output, "lease_usage", None)
    if lease is not None:
        read = min(lease.cache_read_tokens, n)
        created = {label: int(lease.cache_creation_tokens.get(label, 0)) for label in LABELS}
    else:
        read, created = min(output.num_cached_tokens, n), dict.fromkeys(LABELS, 0)
    created["1h"] = min(created["1h"], n - read)
    created["5m"] = min(created["5m"], n - read - created["1h"])
    written = created["5m"] + created["1h"]
    num_output = 0 if pending.is_prewarm else len(output.outputs[0].token_ids)
    return {"input_tokens": n - read - written, "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read,
            "cache_creation": {"ephemeral_5m_input_tokens": created["5m"],
                               "ephemeral_1h_input_tokens": created["1h"]},
            "output_tokens": num_output}


def stop_reason(pending: Pending, output: RequestOutput) -> tuple[str, str | None]:
    completion = output.outputs[0]
    if pending.is_prewarm or completion.finish_reason == "length":
        return ("model_context_window_exceeded" if pending.is_clamped and not pending.is_prewarm
                else "max_tokens"), None
    if isinstance(completion.stop_reason, str):  # the stop string the engine cut the text at
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def message_body(pending: Pending, output: RequestOutput) -> dict[str, Any]:
    reason, sequence = stop_reason(pending, output)
    content = [] if pending.is_prewarm else content_blocks(output.outputs[0].text, pending.tool_format,
                                                            pending.parallel_tools, pending.reasoning)
    if reason == "end_turn" and any(b["type"] == "tool_use" for b in content):
        reason = "tool_use"
    body = {"id": pending.id, "type": "message", "role": "assistant", "model": pending.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(pending, output), "diagnostics": pending.diagnostics}
    if pending.leases_asked:
        body["cache_lease"] = lease_summary(output)
    if pending.kv_explain:
        body["kv_cache"] = output.kv_cache
    return body


def lease_summary(output: RequestOutput) -> dict[str, Any] | None:
    """kvserve's own field: the lease ids granted, or why none was (under the minimum, over the cap)."""
    lease = getattr(output, "lease_usage", None)
    return None if lease is None else {"lease_ids": list(lease.lease_ids), "refused": lease.refused}


@dataclass(slots=True)
class Prepared:
    """A /v1/messages request rendered and tokenized (on a worker thread), ready to queue."""

    chat: ParsedChat
    rendered: RenderedChat
    offsets: list[int]  # prompt tokens up to each breakpoint
    record: PromptFingerprint | None  # for cache diagnostics, when asked for


class MessagesService:
    def __init__(self, door: FrontDoor, model_names: list[str], store: DiagnosticsStore) -> None:
        self.door = door
        self.engine = door.engine
        self.model_names = model_names
        self.store = store
        self.renderer = door.renderer
        # a thinking model asked for no extended thinking: its template told so (Qwen3's variable)
        self.unthinking_renderer = ChatRenderer(
            lambda chat, tools=None: door.engine.engine.chat_prompt(
                chat, tools, ChatTemplateOptions(template_kwargs={"enable_thinking": False})),
            door.encode_with_ends) if door.reasoning is not None else door.renderer
        self.max_model_len = door.max_model_len

    def _renderer(self, body: MessagesRequest) -> ChatRenderer:
        return self.renderer if body.thinks else self.unthinking_renderer

    def _parse(self, body: MessagesRequest) -> ParsedChat:
        if body.model not in self.model_names:
            raise APIError(f"model: {body.model} (this server serves {', '.join(self.model_names)})",
                           404)
        if body.thinks and self.door.reasoning is None:
            raise APIError("thinking: this model does not think; leave `thinking` out or disable it")
        chat = parse_chat(body)
        system = len(chat.system.text) if chat.system is not None else 0
        self.door.check_chars(system + sum(len(t.text) for t in chat.turns), "messages")
        return chat

    async def count_tokens(self, payload: Any) -> dict[str, int]:
        """POST /v1/messages/count_tokens: the prompt tokens a request would have."""
        if isinstance(payload, dict):
            payload = {"max_tokens": 1, **payload}
        body = parse_request(payload)
        chat, renderer = self._parse(body), self._renderer(body)
        rendered = await self.door.off_loop(lambda: renderer.render(chat.system, chat.turns, chat.tools))
        return {"input_tokens": len(rendered.token_ids)}

    def _prepare(self, body: MessagesRequest, chat: ParsedChat) -> Prepared:
        """Blocking (render, tokenize, place breakpoints): runs on the front door's threads."""
        renderer = self._renderer(body)
        rendered = renderer.render(chat.system, chat.turns, chat.tools)
        n = len(rendered.token_ids)
        self.door.check_fits(n)
        offsets = (renderer.token_offsets(chat.system, chat.turns, rendered,
                                               [b.ref for b in chat.breakpoints], chat.tools)
                   if chat.breakpoints else [])
        record = (self._fingerprint(body, chat, rendered, max(offsets, default=n))
                  if body.wants_diagnostics else None)
        return Prepared(chat, rendered, offsets, record)

    async def create(self, body: MessagesRequest, raw: Request, namespace: str):
        chat = self._parse(body)
        release = self.door.admit(namespace, 1)
        try:
            prepared = await self.door.off_loop(lambda: self._prepare(body, chat))
            pending, stream = await self._queue(body, prepared, namespace)
        except BaseException:
            release()
            raise
        if body.stream:
            def close() -> None:  # however the response ends, even if its body never started
                if not stream.finished:
                    self.engine.abort(stream.request_id)
                release()
            return SSEResult(self._events(pending, stream, namespace), close)
        try:
            output = await self._final(stream, raw)
        finally:
            release()
        result = message_body(pending, output)
        calls = [b["id"] for b in result["content"] if b["type"] == "tool_use"]
        return await self._settle(pending, output, namespace, calls, result)

    async def _settle(self, pending: Pending, output: RequestOutput, namespace: str, calls: list[str],
                      result: dict[str, Any]) -> dict[str, Any]:
        """Keep the conversation's KV under its tool_use ids, or let it go (holds.ToolHolds)."""
        if pending.tool_kv is None:
            return result
        hold = await self.door.tool_holds.settle(namespace, output, calls) if pending.tool_kv.hold else None
        if pending.kv_explain and isinstance(result.get("kv_cache"), dict):
            result["kv_cache"] = {**result["kv_cache"], "tool_call_hold": hold,
                                  "tool_call_holds_ended": list(pending.tool_kv.answers)}
        return result

    async def _queue(self, body: MessagesRequest, prepared: Prepared, namespace: str
                     ) -> tuple[Pending, RequestStream]:
        chat, rendered, offsets = prepared.chat, prepared.rendered, prepared.offsets
        n = len(rendered.token_ids)
        best: dict[int, str] = {}  # token offset -> label; equal offsets keep the longer TTL
        for offset, point in zip(offsets, chat.breakpoints):
            if offset > 0 and best.get(offset) != "1h":
                best[offset] = point.ttl
        leases = [make_lease(self.engine.engine, k, label) for k, label in sorted(best.items())]
        diagnosis = None
        if body.wants_diagnostics:
            diagnosis = self._diagnose(body, prepared.record, namespace)
        max_tokens = min(max(body.max_tokens, 1), self.max_model_len - n)
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                stop=[s for s in body.stop_sequences or [] if s] or None,
                structured_outputs=body.output_constraint(), cache_salt=body.cache_salt)
        except GrammarError as err:
            raise APIError(str(err), param=err.field) from None
        except ValueError as err:
            raise APIError(str(err)) from None
        params = with_tool_grammar(params, chat.toolset,
                                   self.door.tool_format if chat.toolset.parses_calls else None)
        pending = Pending(f"msg_{uuid.uuid4().hex}", body.model, n, body.stop_sequences or [],
                          body.max_tokens == 0, max_tokens < max(body.max_tokens, 1), bool(leases),
                          diagnosis, body.kv_explain,
                          self.door.tool_format if chat.toolset.parses_calls else None,
                          chat.toolset.choice.parallel)
        pending.reasoning = self.door.reasoning_split(rendered.token_ids, params.structured_outputs is not None)
        answered = [r["tool_call_id"] for turn in chat.turns for r in turn.tool_results]
        pending.tool_kv = self.door.tool_holds.request_kv(namespace, answered, pending.tool_format is not None)
        self.door.check_open()
        stream = await self._submit(rendered.token_ids, params, pending.id, namespace, leases,
                                    body.kv_explain, pending.tool_kv)
        if prepared.record is not None:
            self.store.put(namespace, pending.id, prepared.record)
        return pending, stream

    # -- steps ---------------------------------------------------------------------------------
    def _fingerprint(self, body: MessagesRequest, chat: ParsedChat, rendered: RenderedChat,
                     cacheable_tokens: int) -> PromptFingerprint | None:
        refs = [(TOOLS, len(chat.tools) - 1)] if chat.tools else []
        refs += ([(SYSTEM, len(chat.system.blocks) - 1)] if chat.system and chat.system.blocks else [])
        refs += sorted({ref for ref in chat.message_ends if ref is not None})
        ends = self._renderer(body).block_ends(chat.system, chat.turns, rendered, refs, chat.tools)
        if ends is None:
            return None
        tokens = {ref: rendered.tokens_before(end) for ref, end in zip(refs, ends)}
        tools_end = tokens[(TOOLS, len(chat.tools) - 1)] if chat.tools else 0
        system_end = tokens[(SYSTEM, len(chat.system.blocks) - 1)] if chat.system and chat.system.blocks else 0
        message_ends, last = [], max(system_end, tools_end)
        for ref in chat.message_ends:
            last = tokens.get(ref, last)
            message_ends.append(last)
        system = chat.system.blocks if chat.system else None
        messages = [(m.role, m.content if isinstance(m.content, str) else
                     [b.text if b.type == "text" else b.model_dump(exclude_none=True, exclude={"cache_control"})
                      for b in m.content])
                    for m in body.messages]
        return fingerprint(body.model, chat.tools or [], system, messages, system_end, message_ends,
                           cacheable_tokens, tools_end=tools_end)

    def _diagnose(self, body: MessagesRequest, record: PromptFingerprint | None, namespace: str
                  ) -> dict[str, Any] | None:
        previous_id = body.diagnostics.previous_message_id
        if previous_id is None:
            return None  # the first turn opts in; nothing to compare yet
        if record is None:
            return {"cache_miss_reason": {"type": "unavailable"}}
        reason = self.store.diagnose(namespace, previous_id, record)
        return None if reason is None else {"cache_miss_reason": reason}

    async def _submit(self, prompt: list[int], params: SamplingParams, request_id: str,
                      namespace: str, leases: list, kv_explain: bool = False,
                      tool_kv: ToolCallKV | None = None) -> RequestStream:
        try:
            return await self.engine.add_request(prompt, params, request_id, namespace,
                                                 leases=leases or None, kv_explain=kv_explain, tool_call=tool_kv)
        except ValueError as err:
            raise APIError(str(err)) from None
        except EngineDeadError as err:
            raise APIError(str(err), 503) from None

    async def _final(self, stream: RequestStream, raw: Request) -> RequestOutput:
        """The last output; a client that disconnects first aborts the request."""
        async def collect() -> RequestOutput:
            last = None
            async for output in stream:
                last = output
            return last

        try:
            output = await unless_disconnected(collect(), raw, lambda: self.engine.abort(stream.request_id))
        except EngineDeadError as err:
            raise APIError(str(err), 503) from None
        return self._checked(output)

    def _checked(self, output: RequestOutput | None) -> RequestOutput:
        if output is None or output.outputs[0].finish_reason == "abort":
            raise APIError(self.door.abort_note or "the request was aborted before it finished", 503)
        if output.finished and (broken := unenforced(output)) is not None:
            raise broken
        return output

    async def _events(self, pending: Pending, stream: RequestStream, namespace: str) -> AsyncIterator[str]:
        delta = TextDelta(pending.stop_sequences or None)
        blocks = BlockEvents(pending.tool_format, pending.parallel_tools, delta, pending.reasoning)
        try:
            output = self._checked(await anext(stream))
            start = message_body(pending, output)
            start.update(content=[], stop_reason=None, stop_sequence=None)
            start["usage"]["output_tokens"] = 0
            start.pop("cache_lease", None)
            yield _event("message_start", {"type": "message_start", "message": start})
            yield _event("ping", {"type": "ping"})
            while True:
                if not pending.is_prewarm:
                    for name, payload in blocks.update(output.outputs[0].text, output.finished):
                        yield _event(name, payload)
                if output.finished:
                    break
                output = self._checked(await anext(stream))
            final = await self._settle(pending, output, namespace, list(blocks.ids),
                                       message_body(pending, output))
            reason = final["stop_reason"]
            if reason == "end_turn" and blocks.num_calls:
                reason = "tool_use"
            event = {"type": "message_delta",
                     "delta": {"stop_reason": reason, "stop_sequence": final["stop_sequence"]},
                     "usage": final["usage"]}
            if pending.leases_asked:
                event["cache_lease"] = final["cache_lease"]
            if pending.kv_explain:
                event["kv_cache"] = final["kv_cache"]
            yield _event("message_delta", event)
            yield _event("message_stop", {"type": "message_stop"})
        except (APIError, EngineDeadError, StopAsyncIteration) as err:
            status = err.status if isinstance(err, APIError) else 503
            yield _event("error", anthropic_error(str(err) or "the request ended early", status))
        except Exception as err:
            yield _event("error", anthropic_error(stream_failure(err), 500))
        finally:
            if not stream.finished:
                self.engine.abort(stream.request_id)


def _event(name: str, payload: dict[str, Any]) -> str:
    return sse.event(payload, name)


async def read_json(raw: Request) -> Any:
    try:
        return json.loads(await raw.body())
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(f"the request body is not valid JSON: {err}") from None


def register(app: FastAPI, door: FrontDoor, model_names: list[str],
             namespace: Callable[[Request], Awaitable[str]]) -> None:
    """Add /v1/messages; `namespace` is the app's tenant dependency (API key -> cache namespace)."""
    service = MessagesService(door, model_names, DiagnosticsStore())
    app.state.messages = service

    @app.post("/v1/messages")
    async def messages(raw: Request):
        try:
            tenant = await namespace(raw)
            body = parse_request(await read_json(raw))
            result = await service.create(body, raw, tenant)
        except APIError as err:
            return JSONResponse(anthropic_error(err.message, err.status), err.status,
                                headers=err.headers)
        if isinstance(result, dict):
            return JSONResponse(result)
        return sse_response(result)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw: Request):
        try:
            await namespace(raw)
            return JSONResponse(await service.count_tokens(await read_json(raw)))
        except APIError as err:
            return JSONResponse(anthropic_error(err.message, err.status), err.status,
                                headers=err.headers)
