"""OpenAI's Responses API request (`POST /v1/responses`) and its translation into the chat request the
serving layer runs: `input` as text or items (messages, `function_call`, `function_call_output`),
`instructions` (a system turn, not carried to follow-ups, as OpenAI does), function `tools` and
`tool_choice`, `text.format`, `max_output_tokens`, `include`'s output-text logprobs with `top_logprobs`,
and the stored conversation of a `previous_response_id` put before the new input."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from kvserve.server.ollama_protocol import validated
from kvserve.server.openai_breakpoints import PromptCacheBreakpoint
from kvserve.server.prompt_cache_options import ResponsesPromptCacheOptions
from kvserve.server.protocol import (MAX_LOGPROBS, APIError, ChatCompletionRequest, MaxTokens, Temperature,
                                     Text, TopP)

MAX_INPUT_ITEMS = 2048


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: Annotated[Text, Field(min_length=1, max_length=64)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: Text


# what `include` may name: the output text's logprobs are given; the others name outputs of tools and
# reasoning this server has none of, so there is nothing to add for them
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs")
Includable = Literal[INCLUDABLE]  # type: ignore[valid-type]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    input: Text | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    store: StrictBool = True
    stream: StrictBool = False
    previous_response_id: Annotated[Text, Field(min_length=1, max_length=128)] | None = None
    metadata: dict[str, StrictStr] | None = None
    prompt_cache_key: Annotated[Text, Field(max_length=1024)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: ResponsesPromptCacheOptions | None = None  # prompt_cache_options.py
    truncation: Literal["disabled"] | None = None
    user: Text | None = None
    include: Annotated[list[Includable], Field(max_length=len(INCLUDABLE))] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @property
    def wants_logprobs(self) -> bool:
        """include's message.output_text.logprobs: each output token's logprob (and top_logprobs' alternatives)."""
        return LOGPROBS in (self.include or ())

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value  # the field's own type check names the problem
        for i, tool in enumerate(value):
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise ValueError(f"item {i}: tools of type {tool.get('type')!r} are not supported; "
                                 "send function tools")
        return value

    def new_messages(self, breakpoints: bool = True) -> list[dict[str, Any]]:
        """The request's own input as chat messages (OpenAI chat JSON); with `breakpoints`, a message
        with a prompt_cache_breakpoint part keeps its parts (what is stored keeps only the text)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                content = item.get("content")
                text = _text(content, i)
                marked = breakpoints and isinstance(content, list) and any(
                    isinstance(p, dict) and p.get("prompt_cache_breakpoint") is not None for p in content)
                out.append({"role": _role(item.get("role"), i), "content": [
                    {"type": "text", "text": p["text"], "prompt_cache_breakpoint": p.get("prompt_cache_breakpoint")}
                    for p in content] if marked else text})
            elif kind == "function_call":
                call = {"id": _field(item, "call_id", i), "type": "function",
                        "function": {"name": _field(item, "name", i), "arguments": _field(item, "arguments", i)}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                            "content": output if isinstance(output, str) else json.dumps(output)})
            else:
                raise APIError(f"input.{i}.type: items of type {kind!r} are not supported", param=f"input.{i}.type")
        return out

    @property
    def prewarm(self) -> bool:
        """prompt_cache_options.prewarm: compute (and lease) the prompt, generate nothing."""
        return self.prompt_cache_options is not None and self.prompt_cache_options.prewarm

    def chat_request(self, earlier: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request for `earlier` (a stored conversation, or none) plus this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        payload: dict[str, Any] = {"model": self.model, "stream": True,
                                   "messages": [*system, *earlier, *self.new_messages()],
                                   "temperature": self.temperature, "top_p": self.top_p,
                                   "max_tokens": 1 if self.prewarm else self.max_output_tokens,
                                   "prompt_cache_key": self.prompt_cache_key,
                                   "prompt_cache_retention": self.prompt_cache_retention}
        if self.prompt_cache_options is not None:
            payload["prompt_cache_options"] = self.prompt_cache_options.model_dump(include={"mode", "ttl"})
        if self.wants_logprobs:
            payload.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            payload["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                                for t in self.tools]
        if self.tool_choice is not None:
            payload["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str) else
                                      {"type": "function", "function": {"name": self.tool_choice.name}})
        if self.parallel_tool_calls is not None:
            payload["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
            raise APIError("text.format.schema: a json_schema format needs its schema", param="text.format.schema")
        if fmt is not None and fmt.type != "text":
            payload["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else
                                          {"type": "json_schema", "json_schema": {
                                              "name": fmt.name or "format", "schema": fmt.json_schema,
                                              "strict": fmt.strict}})
        return validated(ChatCompletionRequest, {k: v for k, v in payload.items() if v is not None})


def _role(role: Any, i: int) -> str:
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(f"input.{i}.role: must be user, assistant, system or developer, got {role!r}",
                       param=f"input.{i}.role")
    return role


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"input.{i}.content: must be text or a list of text parts", param=f"input.{i}.content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise APIError(f"input.{i}.content.{j}: only text parts are supported",
                           param=f"input.{i}.content.{j}")
        if part.get("prompt_cache_breakpoint") is not None:
            try:
                PromptCacheBreakpoint.model_validate(part["prompt_cache_breakpoint"])
            except ValidationError as err:
                where = f"input.{i}.content.{j}.prompt_cache_breakpoint"
                raise APIError(f"{where}: {err.errors()[0]['msg']}", param=where) from None
        texts.append(part["text"])
    return "".join(texts)


def _field(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(f"input.{i}.{name}: a non-empty string is required", param=f"input.{i}.{name}")
    return value
