"""The one front door of every route that puts work on the engine (/v1/completions,
/v1/chat/completions, /v1/messages and its count_tokens, /v1/caches, /tokenize): drain and
admission, the size bounds before tokenizing, and chat rendering plus tokenization on worker
threads under one tokenization rule. Handlers only translate their JSON into these calls.

Order for one API request: `admit` (503 while draining; 400 when it could never fit the limits;
429 with Retry-After when the waiting queue or the tenant is full), then the character bound
(a text longer than `max_model_len` tokens of the longest token is refused untokenized), then
rendering and tokenizing off the event loop (`tokenize`, `render_chat`, `prepare`), then
`check_open` right before the engine is asked (503 once the shutdown deadline has passed). The
ticket `admit` returns is released when the response ends, however it ends; until then the request
is in flight, which is what the shutdown counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.responses import StreamingResponse

from kvserve.async_engine import AsyncEngine
from kvserve.model.tokenizer import ChatTemplateOptions
from kvserve.server import render
from kvserve.server.breakpoints import ChatRenderer
from kvserve.server.fim import fim_prompt, fim_tokens, text_only
from kvserve.server.limits import Admission
from kvserve.server.openai_breakpoints import MAX_BREAKPOINTS, breakpoint_tokens
from kvserve.server.reasoning import ReasoningFormat, ReasoningSplit
from kvserve.server.protocol import APIError
from kvserve.server.tool_holds import ToolHolds
from kvserve.server.tool_parser import tool_format

if TYPE_CHECKING:
    from kvserve.model.tokenizer import Encoded
    from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("kvserve.server")
MAX_CHOICES = 128  # engine requests one API request may start (prompts x n)
TOKENIZER_THREADS = 2


class FrontDoor:
    def __init__(self, engine: AsyncEngine, admission: Admission | None = None,
                 reasoning_format: str = "auto") -> None:
        self.engine = engine
        llm = engine.engine
        self.loaded = llm.loaded
        self.max_model_len = llm.max_model_len
        # no token is longer than this many bytes (so characters): a longer text cannot fit
        self.max_prompt_chars = self.max_model_len * max_token_bytes(llm.tokenizer.get_vocab(with_added_tokens=True))
        self.admission = admission or Admission()
        self.renderer = ChatRenderer(llm.chat_prompt, self.encode_with_ends)
        self.tool_format = tool_format(llm.chat_template)  # how this model writes tool calls
        # how this model marks its reasoning (None: it does not think, or --reasoning-format none)
        self.reasoning = None if reasoning_format == "none" else ReasoningFormat.of(
            lambda token: llm.tokenizer.token_to_id(token) is not None, llm.chat_template)
        self.fim = fim_tokens(llm.tokenizer)  # None: no `suffix`
        self.tool_holds = ToolHolds(engine, llm.config.tool_call_kv_ttl * llm.config.lease_ttl_scale,
                                    llm.config.lease_ttl_scale)
        self.draining = False  # shutting down: no new requests
        self.abort_note: str | None = None  # why in-flight requests were aborted (shutdown)
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvserve-tokenize")

    @functools.cached_property
    def text_tokenizer(self) -> Any:
        """The tokenizer reading special-token spellings as plain text, as llama-server reads the code sent to
        /infill; a copy made at its first use, since the switch belongs to a tokenizer, not to one call."""
        return text_only(self.loaded.tokenizer)

    # -- admission and drain -------------------------------------------------------------------
    def admit(self, namespace: str, count: int) -> Callable[[], None]:
        """Reserve `count` engine requests for one API request; returns the release (idempotent)."""
        if self.draining:
            raise shutting_down("the server is shutting down; send the request to another instance")
        if count > MAX_CHOICES:
            raise APIError(f"{count} choices (prompts x n) is over {MAX_CHOICES} choices per "
                           f"request; send fewer prompts or a smaller n", param="n")
        self.admission.admit(namespace, count, self.engine.num_requests_running)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.admission.release(namespace, count)
        return release

    def check_open(self) -> None:
        """Right before queueing on the engine: prepared after the shutdown deadline is a 503."""
        if self.abort_note is not None:
            raise shutting_down(self.abort_note)

    def cut_by_shutdown(self, finish_reasons: list[str | None]) -> APIError | None:
        """The 503 for a non-streamed response whose requests the shutdown deadline aborted."""
        if self.abort_note is not None and "abort" in finish_reasons:
            return shutting_down(self.abort_note)
        return None

    @property
    def num_in_flight(self) -> int:
        """Engine requests held by API requests on every route (what a shutdown would abort)."""
        return self.admission.held

    # -- bounds and tokenization ---------------------------------------------------------------
    def check_chars(self, num_chars: int, param: str = "prompt") -> None:
        if num_chars > self.max_prompt_chars:  # more tokens than max_model_len, surely
            raise APIError(f"the prompt is {num_chars:,} characters: over max_model_len "
                           f"{self.max_model_len} tokens however it tokenizes; shorten it",
                           param=param)

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """The one tokenization rule (model/tokenizer.encode_prompt), after the character bound.
        Blocking: call it on a worker thread (`off_loop`)."""
        self.check_chars(len(text), param)
        try:
            return self.loaded.encode(text)
        except Exception as err:  # the Rust tokenizer's own errors
            raise APIError(f"cannot tokenize the prompt: {err}", param=param) from None

    def encode_with_ends(self, text: str) -> Encoded:
        self.check_chars(len(text), "messages")
        try:
            return self.loaded.encode_with_ends(text)
        except Exception as err:
            raise APIError(f"cannot tokenize the prompt: {err}", param="messages") from None

    def chat_ids(self, conversation: list[dict[str, Any]], param: str = "messages",
                 tools: list[dict[str, Any]] | None = None,
                 options: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
        """A chat's prompt ids: the model's template (tools where the template puts them, the generation
        prompt or the last message continued as `options` asks), then `encode`. Blocking: call it on a worker
        thread."""
        self.check_chars(chat_chars(conversation, tools), param)
        return self.encode(self.chat_text(conversation, param, tools, options), param)

    def chat_text(self, conversation: list[dict[str, Any]], param: str = "messages",
                  tools: list[dict[str, Any]] | None = None,
                  options: ChatTemplateOptions = ChatTemplateOptions()) -> str:
        """The chat as the model's template renders it (template errors: a 400 naming `param`)."""
        try:
            return self.engine.engine.chat_prompt(conversation, tools, options)
        except APIError:
            raise
        except Exception as err:  # template errors: jinja raises its own types
            raise APIError(f"cannot apply the chat template: {err}", param=param) from None

    async def off_loop(self, fn: Callable[[], Any]) -> Any:
        """Run CPU-heavy request preparation on the tokenizer threads, never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def tokenize(self, prompts: list[str | list[int]], param: str = "prompt") -> list[list[int]]:
        """Each prompt's ids (token-id prompts as given), tokenized off the event loop."""
        for prompt in prompts:
            if isinstance(prompt, str):
                self.check_chars(len(prompt), param)
        return await self.off_loop(
            lambda: [p if isinstance(p, list) else self.encode(p, param) for p in prompts])

    async def render_chat(self, conversation: list[dict[str, Any]], param: str = "messages",
                          tools: list[dict[str, Any]] | None = None,
                          options: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
        self.check_chars(chat_chars(conversation, tools), param)
        return await self.off_loop(lambda: self.chat_ids(conversation, param, tools, options))

    async def render_completion_request(self, body: CompletionRequest) -> list[list[int]]:
        """The prompt ids /v1/completions gives the engine for `body` (one list per prompt); with a
        `suffix`, each prompt as fill-in-the-middle."""
        prompts = body.prompts()
        if body.suffix:  # (an empty suffix is none, as OpenAI takes it)
            prompts = [fim_prompt(self.fim, p, body.suffix) for p in prompts]
        return await self.tokenize(prompts)

    async def render_chat_request(self, body: ChatCompletionRequest) -> list[int]:
        """The prompt ids /v1/chat/completions gives the engine for `body`; its explicit cache
        breakpoints placed on them (body.place_breakpoints, openai_breakpoints.py)."""
        conversation, tools, options = body.conversation(), body.toolset().template_tools, body.template_options()
        refs = body.breakpoint_refs()
        if not refs:
            return await self.render_chat(conversation, tools=tools, options=options)
        if len(refs) > MAX_BREAKPOINTS:
            raise APIError(f"at most {MAX_BREAKPOINTS} prompt_cache_breakpoint parts per request, got "
                           f"{len(refs)}", param="messages")
        self.check_chars(chat_chars(conversation, tools), "messages")
        contents = {i: m.content for i, m in enumerate(body.messages) if isinstance(m.content, list)}

        def work() -> tuple[list[int], list[int] | None]:
            text = self.chat_text(conversation, "messages", tools, options)
            encoded = self.encode_with_ends(text)
            render = lambda chat: self.chat_text(chat, "messages", tools, options)  # noqa: E731
            return encoded.ids, breakpoint_tokens(conversation, contents, refs, render, text, encoded)
        ids, counts = await self.off_loop(work)
        if counts is None:
            raise APIError("this model's chat template does not copy message text verbatim, so "
                           "prompt_cache_breakpoint cannot be placed; remove it", param="messages")
        body.place_breakpoints(counts)
        return ids

    async def retain(self, asked: str | None, prompts: list[list[int]], tenant: str,
                     cache_salt: str | None) -> dict[str, Any]:
        """The response's `prompt_cache_retention` for what a request asked (nothing when it asked
        nothing). 24h pins the prompts' pages in the disk / Redis tier (cache/pins.py); without such a
        tier, or over a pin cap, it is capped to in_memory and the note says why, never refused."""
        if asked is None:
            return {}
        if asked != "24h":
            return {"prompt_cache_retention": asked}
        llm = self.engine.engine
        results = await self.off_loop(lambda: [llm.pin_prefix(p, tenant, cache_salt) for p in prompts])
        if any(r is None for r in results):
            return {"prompt_cache_retention": "in_memory",
                    "prompt_cache_retention_note": "capped: this server has no disk or Redis KV tier"}
        refused = next((r for r in results if not r.pinned), None)
        if refused is not None:
            return {"prompt_cache_retention": "in_memory", "prompt_cache_retention_note": refused.reason}
        return {"prompt_cache_retention": "24h"}

    def pin_answers(self, gen: Any) -> None:
        """A finished request that got 24h retention: pin each prompt's first answer with it (prompt +
        output ids, the prefix of the conversation's next turn), in the background, as far as the pin
        caps allow (the prompt alone stays pinned when they do not)."""
        if gen.retention.get("prompt_cache_retention") != "24h":
            return
        llm, firsts = self.engine.engine, {c.prompt_index: c.output for c in reversed(gen.choices)}
        done = [o.prompt_token_ids + o.outputs[0].token_ids for o in firsts.values() if o is not None]
        with contextlib.suppress(RuntimeError):  # (the pool is shut down: the server is stopping)
            self._pool.submit(lambda: [llm.pin_prefix(ids, gen.namespace, gen.cache_salt) for ids in done])

    def check_fits(self, num_tokens: int, param: str = "messages") -> None:
        if num_tokens >= self.max_model_len:
            raise APIError(f"the prompt is too long: {num_tokens} tokens, at or over max_model_len "
                           f"{self.max_model_len}; shorten it", param=param)

    def reasoning_split(self, prompt: list[int], constrained: bool) -> ReasoningSplit | None:
        """The splitter of one answer to `prompt` (None: the model does not think). Under an output constraint,
        which decides the answer from its first token, a think block the prompt opened is not reasoning."""
        if self.reasoning is None:
            return None
        tail = "" if constrained else self.loaded.tokenizer.decode(prompt[-4:], skip_special_tokens=False)
        return self.reasoning.splitter(tail)

    def room(self, prompt_len: int, max_tokens: int | None, num_ctx: int | None, param: str) -> int:
        """max_tokens, or the rest of the context (max_model_len, or a smaller num_ctx) after the prompt."""
        if num_ctx is not None and prompt_len + (max_tokens or 1) > num_ctx:
            asked = f" plus num_predict {max_tokens}" if max_tokens else ""
            raise APIError(f"the prompt is {prompt_len} tokens{asked}: over num_ctx {num_ctx}; raise "
                           "options.num_ctx or shorten the prompt", param="options.num_ctx")
        if max_tokens is not None:
            return max_tokens
        self.check_fits(prompt_len, param)
        return min(self.max_model_len, num_ctx or self.max_model_len) - prompt_len

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def chat_chars(conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """Characters a chat puts into its prompt before the template's own markup (the size bound)."""
    calls = sum(len(json.dumps(m.get("tool_calls"))) for m in conversation if m.get("tool_calls"))
    return (sum(len(m["content"]) for m in conversation) + calls
            + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0))


def shutting_down(message: str) -> APIError:
    return APIError(message, 503, "server_error", None, "shutting_down")


def max_token_bytes(vocab: dict[str, int]) -> int:
    """The most bytes one token of the vocabulary (piece -> id, added tokens included) stands for.
    A piece stands for at most its UTF-8 length (a byte-alphabet character is one byte, two in UTF-8),
    so the pieces are read longest first and only until none left can beat the best (a few, not all
    262k of Gemma 3's: 0.3-0.5 s a start-up)."""
    if not vocab:
        return 1
    pieces = list(vocab)
    utf8 = np.fromiter(map(len, map(str.encode, pieces)), dtype=np.int64, count=len(pieces))
    best = 0
    for i in np.argsort(-utf8, kind="stable").tolist():
        if utf8[i] <= best:
            break
        best = max(best, len(render.piece_bytes(pieces[i])))
    return best


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stream_failure(err: Exception) -> str:
    """A bug met after a stream's first bytes: logged with its traceback (operators and the fuzz tests
    see it), and the message its client gets in an error event instead of a cut connection."""
    log.error("a streamed answer failed after it started", exc_info=err)
    return f"internal error while streaming ({type(err).__name__}); the answer is incomplete"


def sse_response(result: Any) -> StreamingResponse:
    """A streamed result (`body`, `close`) as an SSE response that runs `close` when it ends."""
    return ClosingStream(result.body, result.close, media_type="text/event-stream",
                         headers=SSE_HEADERS)


class ClosingStream(StreamingResponse):
    """Runs `on_close` when the response ends, also if its body never started (client gone)."""

    def __init__(self, body, on_close, **kwargs) -> None:
        super().__init__(body, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
