"""Tool definitions and tool choices of both APIs, validated and turned into one neutral form: the
`tools` list a chat template receives (transformers' shape, `{"type": "function", "function": {name,
description, parameters}}`), so equal tools give equal prompt tokens whichever API sent them, and a
`ToolChoice`. Also the assistant tool calls and tool results a conversation sends back, as the
template's messages."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
ToolName = Annotated[StrictStr, Field(pattern=TOOL_NAME.pattern)]


def check_schema(schema: Any, where: str = "") -> None:
    """A JSON Schema's structure, enough that a grammar can be built from it: objects all the way
    down, known type names, `properties` of schemas, `required` naming strings. Raises ValueError
    naming the offending path."""
    at = f" at {where}" if where else ""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object{at}, got {type(schema).__name__}")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for name in kinds:
        if name not in SCHEMA_TYPES:
            raise ValueError(f"unknown JSON schema type {name!r}{at}; use one of {sorted(SCHEMA_TYPES)}")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError(f"`properties` must be an object{at}")
    for key, sub in properties.items():
        check_schema(sub, f"{where}.properties.{key}".lstrip("."))
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"`required` must be a list of property names{at}")
    if "items" in schema:
        check_schema(schema["items"], f"{where}.items".lstrip("."))
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list):
                raise ValueError(f"`{key}` must be a list of schemas{at}")
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{where}.{key}.{i}".lstrip("."))


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: ToolName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_schema(value)
        return value


class ToolDef(BaseModel):
    """OpenAI's `tools` item."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


OpenAIToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr = "{}"


class ToolCallIn(BaseModel):
    """An assistant message's `tool_calls` item sent back in a later request."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What the model may or must do with the tools: "auto", "none", "required" or "named"."""

    mode: str = "auto"
    name: str | None = None  # the function a "named" choice forces
    parallel: bool = True  # more than one call in a response
    # a forced call may be several calls: only when the request says so (OpenAI's
    # parallel_tool_calls: true); else the grammar ends after one
    forced_several: bool = False

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")


def template_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """One tool as chat templates receive it (the same dict, key order included, from both APIs)."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolSet:
    """A request's tools in the neutral form, and its choice."""

    tools: tuple[dict[str, Any], ...]
    choice: ToolChoice

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def schema_of(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"]["parameters"]
        raise KeyError(name)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return list(self.tools) or None

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"


def openai_toolset(tools: list[ToolDef] | None, choice: OpenAIToolChoice | None,
                   parallel: bool | None) -> ToolSet:
    """Raises ValueError("param: message") for a choice that names no given tool, or duplicate names."""
    tools = tools or []
    neutral = tuple(template_tool(t.function.name, t.function.description, t.function.parameters)
                    for t in tools)
    _check_unique([t["function"]["name"] for t in neutral], "tools")
    if isinstance(choice, NamedToolChoice):
        mode, name = "named", choice.function.name
    else:
        mode, name = (choice or ("auto" if tools else "none")), None
    toolset = ToolSet(neutral, ToolChoice(mode, name, parallel is not False, parallel is True))
    check_choice(toolset, "tool_choice")
    return toolset


def check_choice(toolset: ToolSet, param: str) -> None:
    choice = toolset.choice
    if choice.mode in ("required", "named") and not toolset.tools:
        raise ValueError(f"{param}: {choice.mode!r} needs at least one tool in `tools`")
    if choice.mode == "named" and choice.name not in toolset.names:
        raise ValueError(f"{param}: no tool named {choice.name!r} in tools "
                         f"(known: {', '.join(toolset.names) or 'none'})")


def _check_unique(names: list[str], param: str) -> None:
    seen = set()
    for i, name in enumerate(names):
        if name in seen:
            raise ValueError(f"{param}.{i}: a second tool named {name!r}; tool names must be unique")
        seen.add(name)


def parse_arguments(arguments: str, where: str) -> Any:
    """A tool call's JSON `arguments` text as the object a template renders (`| tojson`)."""
    try:
        return json.loads(arguments)
    except ValueError as err:
        raise ValueError(f"{where}: arguments must be JSON text: {err}") from None


def template_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """An assistant tool call as templates read it (Qwen: `tool_call.function.name`, arguments a
    mapping; Llama 3.1 the same)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def check_tool_results(messages: list[dict[str, Any]], param: str = "messages") -> None:
    """Every tool result answers a call an earlier assistant message made (ids must match)."""
    known: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            known.add(call["id"])
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if not call_id:
                raise ValueError(f"{param}.{i}.tool_call_id: a tool message needs the id of the call it answers")
            if call_id not in known:
                raise ValueError(f"{param}.{i}.tool_call_id: {call_id!r} answers no tool call of an "
                                 "earlier assistant message")
