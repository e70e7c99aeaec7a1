"""The OpenAI endpoints' work: a request becomes one engine request per (prompt, choice); their
outputs become one JSON response, or SSE chunks as they arrive.

Text is streamed as the difference between the engine's cumulative text and what was sent (text_delta.py).

Admission, drain, the size bounds and tokenization are the front door's (front.py): each API
request holds its engine requests there from before tokenization until `close()`. Requests the
shutdown deadline aborts get a 503 with an error body, or, when streamed, finish_reason "abort"
and an error event that says why.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request

from kvserve.async_engine import AsyncEngine, EngineDeadError, RequestStream
from kvserve.request import RequestOutput, ToolCallKV
from kvserve.sampling_params import SamplingParams
from kvserve.server import render, sse
from kvserve.server.breakpoints import retained_requests
from kvserve.server.front import MAX_CHOICES, FrontDoor, stream_failure
from kvserve.server.constraint_error import unenforced
from kvserve.server.prompt_only import ENGINE_MAX_TOKENS, without_generated
from kvserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                     error_body, model_not_found)
from kvserve.server.reasoning import ReasoningSplit
from kvserve.server.text_delta import TextDelta
from kvserve.server.tool_grammar import with_tool_grammar
from kvserve.server.tool_parser import ToolStream
from kvserve.structured import GrammarError

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    stream: RequestStream
    delta: TextDelta
    output: RequestOutput | None = None
    num_sent_tokens: int = 0
    tools: ToolStream | None = None  # tools offered: the text is read for tool calls as it streams
    reasoning: ReasoningSplit | None = None  # a thinking model's chat: its reasoning told apart (reasoning.py)
    call_ids: dict[int, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.output is not None and self.output.finished


@dataclass(slots=True)
class Generation:
    """All engine requests of one API request."""

    request_id: str
    model: str
    prompts: list[list[int]]
    choices: list[Choice]
    created: int = field(default_factory=lambda: int(time.time()))
    release: Callable[[], None] | None = None  # gives back its admission; called once
    kv_explain: bool = False
    namespace: str = ""
    tool_kv: ToolCallKV | None = None  # the tool-call holds it asked for and ended
    hold_key: str | None = None  # a stored response's id: its hold is kept under it, call or not
    tool_hold: dict[str, Any] | None = None  # what became of its own hold (kv_explain)
    echo: list[str] | None = None  # /v1/completions with echo: each prompt's text, sent before the output
    retention: dict[str, Any] = field(default_factory=dict)  # the prompt_cache_retention it got
    cache_salt: str | None = None  # its requests' (the namespace their pages are hashed in)
    prompt_only: bool = False  # the answer leaves out the one token generated (prompt_only.py)
    decode: Callable[[list[int]], str] | None = None  # the tokenizer's, where a thinking model's reasoning is counted

    @property
    def held_under(self) -> list[str]:
        return [self.hold_key] if self.hold_key else []

    def kv_cache(self) -> dict[str, Any] | list[dict[str, Any]] | None:
        """kv_explain: the prefix-cache explanation of each prompt (one prompt: the object itself)."""
        firsts = {c.prompt_index: c for c in reversed(self.choices)}
        found = [c.output.kv_cache for _, c in sorted(firsts.items()) if c.output is not None]
        return found[0] if len(found) == 1 else found

    def respond(self, body: dict[str, Any]) -> dict[str, Any]:
        body.update(self.retention)
        if self.kv_explain:
            body["kv_cache"] = explained = self.kv_cache()
            if isinstance(explained, dict) and self.tool_kv is not None:
                explained = body["kv_cache"] = dict(explained)
                explained["tool_call_hold"] = self.tool_hold
                explained["tool_call_holds_ended"] = list(self.tool_kv.answers)
        return body

    def usage(self) -> dict[str, Any]:
        firsts = {c.prompt_index: c for c in reversed(self.choices)}  # choice 0 of each prompt
        cached = sum(c.output.num_cached_tokens for c in firsts.values() if c.output is not None)
        completion = sum(len(c.output.outputs[0].token_ids) for c in self.choices if c.output)
        thinking = [c.reasoning.num_tokens(c.output.outputs[0].token_ids, self.decode)
                    for c in self.choices if c.reasoning is not None and c.output is not None]
        return render.usage(sum(len(p) for p in self.prompts), completion, cached, sum(thinking) if thinking else None)


@dataclass(slots=True)
class SSEResult:
    """A streamed response: the SSE body, and `close` to run when the response ends however it
    ends (even if the body was never iterated): aborts what is unfinished, releases admission."""

    body: AsyncIterator[str]
    close: Callable[[], None]
    prompt: list[int] | None = None  # the chat's prompt ids (cache diagnostics compare them)


class OpenAIServing:
    def __init__(self, door: FrontDoor, model_names: list[str]) -> None:
        self.door = door
        self.engine = door.engine
        self.model_names = model_names
        self.tokenizer = self.engine.engine.tokenizer
        self.max_model_len = door.max_model_len

    # -- entry points --------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request, namespace: str,
                          num_ctx: int | None = None):
        """`num_ctx`: the request's own context cap (Ollama's option), checked against its prompt."""
        self._check_model(body.model)
        release = self.door.admit(namespace, len(body.prompts()) * body.n)
        try:
            prompts = [body.truncated(p, self.max_model_len) for p in await self.door.render_completion_request(body)]
            max_tokens = body.predict_limit(body.max_tokens)
            if max_tokens is None and body.n_predict != -1 and num_ctx is None:
                max_tokens = COMPLETION_DEFAULT_MAX_TOKENS  # (n_predict -1: to the context's end)
            prompt_only = max_tokens == 0  # (prompt_only.py)
            max_tokens = self.door.room(max(map(len, prompts)), ENGINE_MAX_TOKENS if prompt_only else max_tokens,
                                    num_ctx, "prompt")
            params = body.sampling_params(max_tokens, body.logprobs)
            gen = await self._submit("cmpl", prompts, params, body.n, namespace, release,
                                     retention=body.lease_ask(), kv_explain=body.kv_explain)
            gen.prompt_only = prompt_only
            gen.retention = await self.door.retain(body.prompt_cache_retention, prompts, namespace,
                                                   params.cache_salt)
        except BaseException:
            release()
            raise
        if body.echo:  # (a truncated prompt echoes what is left of it)
            shown = body.prompts() if body.truncate_prompt_tokens is None else prompts
            gen.echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in shown]
        if body.stream:
            return SSEResult(self._sse(gen, body, chat=False), lambda: self.close(gen))
        await self._finish(gen, raw)
        choices = [render.completion_choice(c.index, c.output.outputs[0], self.tokenizer,
                                            body.logprobs, body.logprobs_shape) for c in gen.choices]
        for choice, c in zip(choices, gen.choices):
            render.with_prompt(choice, c.output, self.tokenizer, gen.echo and gen.echo[c.prompt_index], body)
        return gen.respond(render.completion_response(gen.request_id, gen.created, gen.model, choices,
                                                      gen.usage()))

    async def chat(self, body: ChatCompletionRequest, raw: Request, namespace: str,
                   num_ctx: int | None = None, hold_key: str | None = None, continues: str | None = None):
        """`hold_key`: keep the conversation's KV held under this key when it finishes (a stored
        response); `continues`: the key of the hold this request continues (ended once it is admitted)."""
        self._check_model(body.model)
        toolset = body.toolset()
        fmt = self.door.tool_format if toolset.parses_calls else None
        answered = [m.tool_call_id for m in body.messages if m.role == "tool" and m.tool_call_id]
        tool_kv = self.door.tool_holds.request_kv(namespace, answered + ([continues] if continues else []),
                                                  (fmt is not None or hold_key is not None) and body.n == 1,
                                                  stored=hold_key is not None and body.n == 1)
        release = self.door.admit(namespace, body.n)
        try:
            prompt = body.truncated(await self.door.render_chat_request(body), self.max_model_len)
            if body.truncate_prompt_tokens is not None and body.breakpoint_refs():
                raise APIError("truncate_prompt_tokens moves the prompt_cache_breakpoint parts; send one of them",
                               param="truncate_prompt_tokens")
            max_tokens = self.door.room(len(prompt), body.requested_max_tokens, num_ctx, "messages")
            params = with_tool_grammar(body.sampling_params(max_tokens, body.num_logprobs), toolset, fmt)
            gen = await self._submit("chatcmpl", [prompt], params, body.n, namespace, release,
                                     retention=body.lease_ask(), kv_explain=body.kv_explain,
                                     tool_kv=tool_kv)
            gen.retention = await self.door.retain(body.prompt_cache_retention, [prompt], namespace,
                                                   params.cache_salt)
            gen.hold_key = hold_key
        except BaseException:
            release()
            raise
        gen.decode = self.tokenizer.decode
        reasoning = self.door.reasoning_split(prompt, params.structured_outputs is not None)  # each choice's: fresh()
        for c in gen.choices:
            c.tools = ToolStream(fmt, toolset.choice.parallel) if fmt is not None else None
            c.reasoning = reasoning.fresh() if reasoning is not None else None
        if body.stream:
            return SSEResult(self._sse(gen, body, chat=True), lambda: self.close(gen), prompt)
        await self._finish(gen, raw)
        choices = [render.chat_choice(c.index, c.output.outputs[0], self.tokenizer, body.num_logprobs, fmt,
                                      toolset.choice.parallel, c.reasoning) for c in gen.choices]
        if tool_kv is not None and tool_kv.hold:
            calls = [call["id"] for call in choices[0]["message"].get("tool_calls", [])] or gen.held_under
            gen.tool_hold = await self.door.tool_holds.settle(namespace, gen.choices[0].output, calls,
                                                              stored=gen.hold_key is not None)
        scored = render.prompt_logprobs(gen.choices[0].output.prompt_logprobs, self.tokenizer, body.prompt_logprobs)
        return gen.respond(render.chat_response(gen.request_id, gen.created, gen.model, choices, gen.usage(), scored))

    def close(self, gen: Generation) -> None:
        """The response is over: abort what did not finish, give back the admission."""
        self._abort_unfinished(gen)
        release, gen.release = gen.release, None
        if release is not None:
            release()
            self.door.pin_answers(gen)  # 24h retention: the answers too (the next turn's prefix)

    # -- shared steps --------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise model_not_found(model, self.model_names)

    async def _finish(self, gen: Generation, raw: Request) -> None:
        """Wait for every final output (non-streamed); a shutdown cut is a 503, not a 200."""
        try:
            await self._wait_all(gen, raw)
        finally:
            self.close(gen)
        cut = self.door.cut_by_shutdown([c.output.outputs[0].finish_reason for c in gen.choices])
        if cut is not None:
            raise cut

    async def _submit(self, kind: str, prompts: list[list[int]], params: SamplingParams, n: int,
                      namespace: str, release: Callable[[], None] | None = None,
                      retention: Any = None, kv_explain: bool = False,
                      tool_kv: ToolCallKV | None = None) -> Generation:
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(f"{len(prompts)} prompts x n={n} is over {MAX_CHOICES} choices per "
                           f"request; send fewer prompts or a smaller n", param="n")
        request_id = f"{kind}-{uuid.uuid4().hex}"
        items, choices = [], []
        self.door.check_open()
        for p, prompt in enumerate(prompts):
            for i in range(n):
                seed = params.seed
                if seed is not None and n > 1:  # distinct but reproducible samples
                    seed = (seed + i + 2**63) % 2**64 - 2**63
                items.append((prompt, replace(params, seed=seed), f"{request_id}-{p}-{i}"))
        try:
            if retention is None:
                streams = await self.engine.add_requests(items, namespace, kv_explain=kv_explain,
                                                         tool_call=tool_kv)
            else:  # kv_retention: each request leases its whole prompt
                streams = await retained_requests(self.engine, items, namespace, retention, kv_explain,
                                                  tool_kv)
        except GrammarError as err:  # compiles, but not for this tokenizer (e.g. can match nothing)
            raise APIError(str(err), param=err.field) from None
        except ValueError as err:
            message = str(err)
            fields = ("logit_bias", "stop_token_ids", "allowed_token_ids", "bad_words")
            param = next((f for f in fields if message.startswith(f)), "prompt" if "prompt" in message else None)
            raise APIError(message, param=param) from None
        except EngineDeadError as err:
            raise APIError(str(err), 503, "server_error") from None
        for index, stream in enumerate(streams):
            choices.append(Choice(index, index // n, stream, TextDelta(params.stop)))
        model = self.model_names[0]
        return Generation(request_id, model, prompts, choices, release=release, kv_explain=kv_explain,
                          namespace=namespace, tool_kv=tool_kv, cache_salt=params.cache_salt)

    def _abort_unfinished(self, gen: Generation) -> None:
        for choice in gen.choices:
            if not choice.finished and not choice.stream.finished:
                self.engine.abort(choice.stream.request_id)

    async def _outputs(self, gen: Generation) -> AsyncIterator[Choice]:
        """Each choice as it gets a new output (choice.output updated), until all finish."""
        merged: asyncio.Queue[tuple[Choice, RequestOutput | BaseException]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for output in choice.stream:
                    merged.put_nowait((choice, output))
            except Exception as err:
                merged.put_nowait((choice, err))

        tasks = [asyncio.create_task(pump(c)) for c in gen.choices]
        try:
            remaining = len(gen.choices)
            while remaining:
                choice, item = await merged.get()
                if isinstance(item, BaseException):
                    raise APIError(str(item), 503, "server_error")
                if item.finished and (broken := unenforced(item)) is not None:
                    raise broken  # (a stream's error event, a plain 400 otherwise)
                choice.output = without_generated(item) if gen.prompt_only else item
                remaining -= item.finished
                yield choice
        finally:
            for task in tasks:
                task.cancel()
            self._abort_unfinished(gen)

    async def _wait_all(self, gen: Generation, raw: Request) -> None:
        """Collect every final output; a client that disconnects first aborts the requests."""
        async def collect() -> None:
            outputs = self._outputs(gen)
            try:
                async for _ in outputs:
                    pass
            finally:
                await outputs.aclose()

        await unless_disconnected(collect(), raw, lambda: self._abort_unfinished(gen))

    async def _sse(self, gen: Generation, body: Any, chat: bool) -> AsyncIterator[str]:
        """The SSE body, returned unstarted: errors before it are plain 4xx responses."""
        chunk = render.chat_chunk if chat else render.completion_chunk
        num_logprobs = body.num_logprobs if chat else body.logprobs
        every_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        outputs = self._outputs(gen)
        try:
            if chat or gen.echo is not None:  # the role, or the echoed prompt, first
                for c in gen.choices:
                    yield sse.event(chunk(gen, c.index, {"role": "assistant", "content": ""} if chat
                                          else gen.echo[c.prompt_index]))
            num_finished = 0
            async for c in outputs:
                completion = c.output.outputs[0]
                text, thought = c.delta.update(completion.text, c.output.finished), ""
                if c.reasoning is not None:  # the reasoning apart, the rest read for tool calls
                    thought, text = c.reasoning.update(text, c.output.finished)
                calls = []
                if c.tools is not None:  # what TextDelta lets out, read for tool calls
                    said = c.reasoning.content if c.reasoning is not None else c.delta.sent
                    text, found = c.tools.update(said, c.output.finished)
                    calls = render.tool_call_deltas(found, c.call_ids)
                new_tokens = completion.token_ids[c.num_sent_tokens:]
                if (not text and not thought and not calls and not c.output.finished
                        and not (num_logprobs is not None and new_tokens)):
                    continue
                logprobs = render.logprobs_for("chat" if chat else body.logprobs_shape, completion,
                                               c.num_sent_tokens, self.tokenizer, num_logprobs)
                c.num_sent_tokens = len(completion.token_ids)
                reason = completion.finish_reason if c.output.finished else None
                if c.output.finished and c.index == 0 and gen.tool_kv is not None and gen.tool_kv.hold:
                    gen.tool_hold = await self.door.tool_holds.settle(gen.namespace, c.output,
                                                                      list(c.call_ids.values()) or gen.held_under,
                                                                      stored=gen.hold_key is not None)
                if reason == "stop" and c.call_ids:
                    reason = "tool_calls"
                num_finished += c.output.finished
                last = num_finished == len(gen.choices)
                usage = gen.usage() if every_usage or (last and not body.include_usage_chunk) else None
                delta = ({"content": text} if text or not (calls or thought) else {}) if chat else text
                if calls:
                    delta["tool_calls"] = calls
                if thought:
                    delta["reasoning_content"] = thought
                payload = chunk(gen, c.index, delta, reason, logprobs, usage, completion.stop_reason)
                yield sse.event(gen.respond(payload) if last and not body.include_usage_chunk else payload)
            if body.include_usage_chunk:
                yield sse.event(gen.respond(render.usage_chunk(gen, chat)))
            aborted = any(c.output.outputs[0].finish_reason == "abort" for c in gen.choices)
            if aborted and self.door.abort_note is not None:
                yield sse.event(error_body(self.door.abort_note, "server_error", None, "shutting_down"))
        except APIError as err:
            yield sse.event(error_body(err.message, err.type, err.param, err.code))
        except Exception as err:
            yield sse.event(error_body(stream_failure(err), "server_error"))
        finally:
            await outputs.aclose()
        yield sse.DONE


async def unless_disconnected(work: Awaitable[Any], raw: Request, abort: Callable[[], None]) -> Any:
    """Await `work`; a client that disconnects first gets it cancelled, `abort()` called (its
    engine requests aborted, pages freed) and a 499."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            abort()
    if not task.done():
        raise APIError("the client closed the connection", 499, code="client_closed_request")
    return task.result()


async def _disconnected(raw: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
