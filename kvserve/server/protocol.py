"""The OpenAI request schema as pydantic models, the error body, and `SamplingParams` from a request.

Unknown fields are ignored (as vLLM does); known fields of the wrong type or out of range are a 400
with OpenAI's error JSON. vLLM's sampling fields: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`, `ignore_eos`, `prompt_logprobs`,
`allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`.
Fields kvserve adds: `cache_salt` (cache isolation), `kv_retention` (lease the prompt's KV), `kv_explain`
(a `kv_cache` explanation beside `usage`).
OpenAI's `prompt_cache_key` (a routing hint: `kvserve router` keeps a key on one backend; never an
isolation boundary), `prompt_cache_retention` (`24h` pins the prompt's pages in a disk or Redis tier;
without one, or over a pin cap, the answer says it was capped to `in_memory`) and `prompt_cache_options`
(prompt_cache_options.py).
Output constraints (`response_format`, `structured_outputs`, `guided_*`): structured_fields.py; the chat
template's (`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`): chat_fields.py;
llama.cpp's fields (`n_predict`, `grammar`, `json_schema`, `cache_prompt`, `repeat_penalty`):
llamacpp_fields.py.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt,
                      StrictStr, field_validator, model_validator)

from kvserve.sampling_params import SamplingParams
from kvserve.server import tool_protocol as tp
from kvserve.server.chat_fields import ChatTemplateFields
from kvserve.server.llamacpp_fields import LlamaCppFields, MinP, RepetitionPenalty
from kvserve.server.openai_breakpoints import BreakpointRef, PromptCacheBreakpoint
from kvserve.server.prompt_cache_options import LeaseAsk, PromptCacheOptions
from kvserve.server.prompt_only import NEEDS_ECHO
from kvserve.server.prompt_shape import MAX_PROMPTS, MAX_TOKEN_ID, check_prompt, json_type
from kvserve.server.structured_fields import StructuredFields, one_constraint
from kvserve.structured import GrammarError, StructuredOutputsParams

MAX_N = 16  # choices per request
MAX_STOP = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_ALLOWED_TOKENS = 2**18  # allowed_token_ids: more than any vocabulary served
MAX_BAD_WORDS = 256


def _utf8(text: str) -> str:
    """JSON can carry lone surrogates (\\ud800) that no tokenizer or hash can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogate code points)") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_utf8)]
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
Temperature = Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
MaxTokens = Annotated[StrictInt, Field(ge=1, le=2**31)]


class APIError(Exception):
    """Raised by handlers; rendered as OpenAI's `{"error": {...}}` with `status`."""

    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code
        self.headers: dict[str, str] | None = None  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def model_not_found(model: str, model_names: list[str]) -> APIError:
    """The 404 for a model this server does not serve (vLLM's shape)."""
    return APIError(f"The model `{model}` does not exist; this server serves {', '.join(model_names)}", 404,
                    "NotFoundError", "model", "model_not_found")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class KVRetention(BaseModel):
    """`kv_retention: {"ttl": "5m" | "1h"}`: lease the whole prompt's KV (as Anthropic's cache_control)."""

    model_config = ConfigDict(extra="ignore")
    ttl: Literal["5m", "1h"] = "5m"


class _Sampling(StructuredFields, LlamaCppFields):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=2**31)] | None = None  # -1 or 0: off
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    seed: Int64 | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    ignore_eos: StrictBool = False
    cache_salt: Annotated[Text, Field(max_length=1024)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_p: MinP | None = None  # vLLM's and llama.cpp's
    min_tokens: Annotated[StrictInt, Field(ge=0, le=2**31)] = 0  # vLLM's: no stop before this many tokens
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None  # vLLM's
    include_stop_str_in_output: StrictBool = False  # vLLM's
    skip_special_tokens: StrictBool = True  # vLLM's
    allowed_token_ids: Annotated[list[TokenId], Field(max_length=MAX_ALLOWED_TOKENS)] | None = None  # vLLM's
    bad_words: Annotated[list[Text], Field(max_length=MAX_BAD_WORDS)] | None = None  # vLLM's
    # vLLM's: keep the prompt's last k tokens (-1: as many as max_model_len holds)
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1, le=2**31)] | None = None
    # vLLM's (over the prompt and output); llama.cpp's `repeat_penalty` and `repeat_last_n`: llamacpp_fields.py
    repetition_penalty: RepetitionPenalty | None = None
    # vLLM's: each prompt token's logprob (on chat, the rendered template's), in a whole answer
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    kv_retention: KVRetention | None = None
    kv_explain: StrictBool = False  # add `kv_cache`: why the prompt hit or missed the prefix cache
    prompt_cache_key: Annotated[Text, Field(max_length=1024)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None  # prompt_cache_options.py

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        """Say what is wrong before pydantic tries each member of the union."""
        if isinstance(value, list):
            if len(value) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(value)}")
            for i, item in enumerate(value):
                if not isinstance(item, str):
                    raise ValueError(f"stop strings must be strings; item {i} is "
                                     f"{json_type(item)}")
        elif value is not None and not isinstance(value, str):
            raise ValueError(f"stop must be a string or a list of strings, got {json_type(value)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isascii() or not key.isdigit() or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> _Sampling:
        self.predict_limit(getattr(self, "max_completion_tokens", None) or self.max_tokens)
        if self.cache_salt == "":
            raise ValueError("cache_salt must not be empty; leave it out to share the cache")
        if self.stream and self.prompt_logprobs_asked is not None:
            raise ValueError("prompt logprobs come in a whole answer only; send stream: false")
        if self.kv_retention is not None and (self.prompt_cache_options is not None or self.breakpoint_refs()):
            raise ValueError("send kv_retention or prompt_cache_options / prompt_cache_breakpoint, not both")
        return self

    # (token count, ttl label) of each explicit breakpoint, placed by the front door once rendered
    _breakpoint_leases: tuple[tuple[int, str], ...] = PrivateAttr(default=())

    def breakpoint_refs(self) -> list[BreakpointRef]:
        return []  # (chat content parts carry them)

    def lease_ask(self) -> KVRetention | LeaseAsk | None:
        """The leases this request asks for, if any (prompt_cache_options.py)."""
        if self.kv_retention is not None:
            return self.kv_retention
        options = self.prompt_cache_options or (PromptCacheOptions() if self._breakpoint_leases else None)
        return options.lease(self._breakpoint_leases) if options is not None else None

    def place_breakpoints(self, counts: list[int]) -> None:
        default = self.prompt_cache_options.ttl if self.prompt_cache_options else "30m"
        self._breakpoint_leases = tuple((n, ttl or default) for n, (_, _, ttl) in zip(counts, self.breakpoint_refs()))

    def prompt_salt(self, cache_salt: str | None) -> str | None:
        options = self.prompt_cache_options
        if options is not None and not options.uses_cache(bool(self.breakpoint_refs())):
            return options.private_salt(cache_salt)
        return super().prompt_salt(cache_salt)

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """How many alternatives each prompt token's logprob comes with (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def truncated(self, prompt: list[int], max_model_len: int) -> list[int]:
        """The prompt's ids as truncate_prompt_tokens keeps them (its last k; -1: max_model_len)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt
        if k == 0:
            raise APIError("truncate_prompt_tokens must be at least 1 (or -1: max_model_len)",
                           param="truncate_prompt_tokens")
        return prompt[-(max_model_len if k == -1 else k):]

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises APIError (400) if the engine's own checks refuse the values."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            return self._sampling_params(max_tokens, logprobs, [s for s in stop if s] or None)
        except GrammarError as err:
            raise APIError(str(err), param=err.field) from None
        except ValueError as err:
            raise APIError(str(err)) from None

    def output_constraint(self) -> StructuredOutputsParams | None:
        return one_constraint(self._constraints() + self.llamacpp_constraints())

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         stop: list[str] | None) -> SamplingParams:
        return SamplingParams(**self.sampler_fields(dict(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs_asked,
            cache_salt=self.prompt_salt(self.cache_salt),
            structured_outputs=self.output_constraint(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            min_p=self.min_p or 0.0,
            **self.repetition(self.repetition_penalty),
        )))


PromptInput = (Text | Annotated[list[TokenId], Field(min_length=1)]
               | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
               | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                           Field(min_length=1, max_length=MAX_PROMPTS)])


class CompletionRequest(_Sampling):
    logprobs_shape: ClassVar[str] = "completion"  # (render.LogprobsShape: llama-server's /completion differs)
    answers_prompt_only: ClassVar[bool] = True  # max_tokens 0 with echo, n_predict 0: prompt_only.py
    prompt: PromptInput
    max_tokens: Annotated[StrictInt, Field(ge=0, le=2**31)] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        return check_prompt(value)

    @model_validator(mode="after")
    def _completion_only(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (other than best_of == n)")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError(NEEDS_ECHO)
        return self

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """prompt_logprobs, or echo with logprobs (the prompt's tokens lead the logprobs, as vLLM gives them)."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs or 0) if self.echo else self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: Text | None = None
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None  # openai_breakpoints.py


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[tp.ToolCallIn] | None = None  # an assistant's calls, sent back
    tool_call_id: Text | None = None  # role "tool": the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (str, list)):
            raise ValueError(f"content must be a string, a list of content parts or null, got "
                             f"{json_type(value)}")
        return value

    def text(self, param: str = "content") -> str:
        """The content as one text; an APIError (400) naming `param` for a part that is not text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise APIError(f"{param}: content parts of type {part.type!r} are not supported; "
                               f"send text", param=param)
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Sampling, ChatTemplateFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[tp.ToolDef], Field(max_length=tp.MAX_TOOLS)] | None = None
    tool_choice: tp.OpenAIToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _chat_only(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def breakpoint_refs(self) -> list[BreakpointRef]:
        """(message, part, ttl) of each content part marked with prompt_cache_breakpoint."""
        return [(i, j, part.prompt_cache_breakpoint.ttl) for i, m in enumerate(self.messages)
                if isinstance(m.content, list) for j, part in enumerate(m.content)
                if part.prompt_cache_breakpoint is not None]

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template reads them (tool calls with their arguments parsed).
        Raises APIError naming the message for bad tool-call arguments or an unknown tool_call_id."""
        messages = []
        for i, message in enumerate(self.messages):
            item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                    "content": message.text(f"messages.{i}.content")}
            if message.name:
                item["name"] = message.name
            if message.tool_calls:
                item["tool_calls"] = [
                    tp.template_call(c.id, c.function.name, _arguments(c.function.arguments,
                                                                       f"messages.{i}.tool_calls.{j}.function"))
                    for j, c in enumerate(message.tool_calls)]
            if message.role == "tool":
                item["tool_call_id"] = message.tool_call_id
            messages.append(item)
        try:
            tp.check_tool_results(messages)
        except ValueError as err:
            raise APIError(str(err), param=str(err).split(":", 1)[0]) from None
        return messages

    def toolset(self) -> tp.ToolSet:
        try:
            return tp.openai_toolset(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as err:
            raise APIError(str(err), param=str(err).split(":", 1)[0]) from None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.predict_limit(self.max_completion_tokens or self.max_tokens)


def _arguments(arguments: str, where: str) -> Any:
    try:
        return tp.parse_arguments(arguments, where)
    except ValueError as err:
        raise APIError(str(err), param=f"{where}.arguments") from None

