"""Ollama's request bodies (/api/chat, /api/generate) as pydantic models, and their translation into the
OpenAI requests the serving layer runs: `options` (Ollama's defaults: temperature 0.8, top_k 40,
top_p 0.9; `min_p`; `repeat_penalty` over the last `repeat_last_n` tokens), `format` ("json" or a JSON
schema), `tools` and tool-call turns, `num_ctx` (the request's context cap, checked once the prompt is
tokenized), `logprobs` and `top_logprobs` (OpenAI chat's entries, which Ollama's are). Sampler options
kvserve lacks are a 400 unless sent at their neutral value; runtime hints (threads, GPU layers, mmap)
change no output and are taken.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from kvserve.server.anthropic_protocol import first_error
from kvserve.server.llamacpp_fields import UNSUPPORTED_SAMPLERS, LastN, MinP, RepetitionPenalty
from kvserve.server.protocol import (MAX_LOGPROBS, APIError, ChatCompletionRequest, CompletionRequest, Int64,
                                     Penalty, Temperature, Text, TopP)

OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class Options(BaseModel):
    model_config = ConfigDict(extra="ignore")
    num_ctx: Annotated[StrictInt, Field(ge=1)] | None = None
    num_predict: Annotated[StrictInt, Field(ge=-2)] | None = None  # -1: no limit, -2: fill the context
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=2**31)] | None = None
    seed: Int64 | None = None
    stop: list[Text] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    min_p: MinP | None = None
    repeat_penalty: RepetitionPenalty | None = None  # over the last repeat_last_n tokens (64 unless given)
    repeat_last_n: LastN | None = None
    # runtime hints with no effect on the output here
    num_thread: StrictInt | None = None
    num_gpu: StrictInt | None = None
    num_batch: StrictInt | None = None
    num_keep: StrictInt | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Text
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    function: ToolCallFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: Text | None = None


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Annotated[Text, Field(min_length=1)]
    stream: StrictBool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | StrictStr | None = None
    think: StrictBool | StrictStr | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] = 0  # (as Ollama: none without logprobs)

    def keep_alive_s(self) -> float | None:
        """keep_alive in seconds (negative: forever); None when not given."""
        return parse_duration(self.keep_alive)

    def openai_fields(self) -> dict[str, Any]:
        """The sampling and format fields of the OpenAI request this body becomes."""
        opts = self.options or Options()
        fields: dict[str, Any] = {"model": None, "stream": True}  # (streamed inside: the timings need it)
        for name, default in OLLAMA_DEFAULTS.items():
            value = getattr(opts, name)
            fields[name] = default if value is None else value
        for name in ("seed", "stop", "presence_penalty", "frequency_penalty", "min_p", "repeat_penalty",
                     "repeat_last_n"):
            if getattr(opts, name) is not None:
                fields[name] = getattr(opts, name)
        if opts.num_predict is not None and opts.num_predict > 0:
            fields["max_tokens"] = opts.num_predict
        if self.logprobs:  # (chat's spelling; RawCompletion takes the count as `logprobs`)
            fields.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.think is False:  # (Qwen3's templates skip the thinking on this variable; its text is dropped)
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            fields["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "format", "schema": self.format}}
        return fields


class ChatRequest(_Base):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def openai(self) -> ChatCompletionRequest:
        messages, pending = [], []  # pending: ids of calls no tool turn has answered yet
        for i, m in enumerate(self.messages):
            if m.images:
                raise APIError("images are not supported by this model", param=f"messages.{i}.images")
            item: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                item["tool_calls"] = []
                for call in m.tool_calls:
                    pending.append((f"call_{i}_{len(item['tool_calls'])}", call.function.name))
                    item["tool_calls"].append({"id": pending[-1][0], "type": "function", "function": {
                        "name": call.function.name, "arguments": json.dumps(call.function.arguments)}})
            if m.role == "tool":
                match = next((p for p in pending if m.tool_name in (None, p[1])), None)
                if match is None:
                    raise APIError(f"messages.{i}: a tool message answers no earlier tool call",
                                   param=f"messages.{i}")
                pending.remove(match)
                item["tool_call_id"] = match[0]
            messages.append(item)
        payload = {**self.openai_fields(), "messages": messages}
        if self.tools:
            payload["tools"] = self.tools
        return validated(ChatCompletionRequest, payload)


class GenerateRequest(_Base):
    prompt: Text = ""
    suffix: Text | None = None
    system: Text | None = None
    raw: StrictBool = False
    template: Text | None = None
    context: list[int] | None = None
    images: list[Any] | None = None

    def openai(self) -> ChatCompletionRequest | CompletionRequest:
        """raw (or a suffix): the prompt as it is; else the prompt as a user turn through the template."""
        for name in ("template", "context", "images"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported on /api/generate; use /api/chat for "
                               "conversations", param=name)
        if self.raw or self.suffix:
            fields = self.openai_fields()
            if self.logprobs:
                del fields["top_logprobs"]
                fields["logprobs"] = self.top_logprobs
            return validated(RawCompletion, {**fields, "prompt": self.prompt, "suffix": self.suffix})
        turns = [{"role": "system", "content": self.system}] if self.system else []
        return validated(ChatCompletionRequest, {**self.openai_fields(),
                                                 "messages": [*turns, {"role": "user", "content": self.prompt}]})


class RawCompletion(CompletionRequest):
    """/api/generate's raw prompt (or one with a suffix) as a completion, its logprobs in Ollama's entries."""

    logprobs_shape = "chat"


def parse(model: type[_Base], payload: Any) -> Any:
    """Validate a JSON body; APIError (400) naming the first problem's field."""
    if isinstance(payload, dict):
        unsupported = {**(payload.get("options") or {})} if isinstance(payload.get("options"), dict) else {}
        for name, neutral in UNSUPPORTED_SAMPLERS.items():
            if name in unsupported and unsupported[name] != neutral:
                raise APIError(f"options.{name} is not supported by kvserve; leave it out or send "
                               f"{json.dumps(neutral)}", param=f"options.{name}")
    return validated(model, payload)


def validated(model: type[BaseModel], payload: Any) -> Any:
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        message = first_error(err.errors())
        raise APIError(message, param=message.split(":", 1)[0] if ":" in message else None) from None


def parse_duration(value: float | str | None) -> float | None:
    """Ollama's keep_alive: seconds as a number, or "30s", "5m", "1h" (negative: forever)."""
    if value is None or isinstance(value, (int, float)):
        return value
    found = _DURATION.match(value.strip())
    if found is None:
        raise APIError(f"keep_alive: {value!r} is not a duration (a number of seconds, or like '5m')",
                       param="keep_alive")
    return float(found.group(1)) * _UNIT_S[found.group(2)]
