"""The Anthropic Messages API request schema (text, `tool_use` and `tool_result` blocks, `tools`,
`tool_choice`, `cache_control`, `diagnostics`, structured outputs' `output_config.format`: read in
structured_fields.py, as the OpenAI routes' constraints are), its error body, and the chat and breakpoints a request
describes (a `cache_control` on a tool definition is a breakpoint like one on a block).

Unknown fields are ignored; known ones of the wrong type, other content blocks (images, documents) and
server tools are a 400 in Anthropic's shape (extended thinking, on a model that thinks: reasoning.py;
an earlier answer's thinking blocks are not rendered, as templates drop past reasoning):
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from kvserve.server import tool_protocol as tp
from kvserve.server.breakpoints import RESULT_BASE, SYSTEM, TOOLS, BlockRef, Turn
from kvserve.server.protocol import APIError, Text
from kvserve.server.structured_fields import AnthropicStructuredFields

MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks
MAX_STOP_SEQUENCES = 16
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(message: str, status: int = 400) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class ResultPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Text
    text: Text | None = None


class Block(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Text
    text: Text | None = None
    cache_control: CacheControl | None = None
    id: Text | None = None  # tool_use
    name: Text | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: Text | None = None  # tool_result
    content: Text | list[ResultPart] | None = None  # tool_result
    is_error: StrictBool | None = None  # tool_result

    def result_text(self, where: str) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for k, part in enumerate(self.content):
            if part.type != "text":
                raise APIError(f"{where}.content.{k}: tool_result content of type {part.type!r} is "
                               "not supported; send text")
        return "\n".join(part.text or "" for part in self.content)


class Tool(BaseModel):
    """A client tool definition (server tools, e.g. web search, are not served)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["custom"] | None = None
    name: tp.ToolName
    description: Text | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        tp.check_schema(value)
        return value


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: StrictBool = False


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")
    user_id: Text | None = None


class DiagnosticsParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    previous_message_id: Text | None = None


class MessagesRequest(AnthropicStructuredFields):
    model_config = ConfigDict(extra="ignore")
    model: Text
    max_tokens: Annotated[StrictInt, Field(ge=0, le=2**31)]
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: Text | list[Block] | None = None
    stop_sequences: Annotated[list[Text], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: StrictBool = False
    metadata: Metadata | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=2**31)] | None = None
    cache_control: CacheControl | None = None
    diagnostics: DiagnosticsParam | None = None
    kv_explain: StrictBool = False  # kvserve's own: a `kv_cache` explanation beside `usage`
    cache_salt: Annotated[Text, Field(min_length=1, max_length=1024)] | None = None  # as on /v1/*: isolation
    tools: Annotated[list[Tool], Field(max_length=tp.MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: dict[str, Any] | None = None

    @property
    def thinks(self) -> bool:
        """Extended thinking asked for (its budget is not enforced apart: max_tokens bounds thinking and text)."""
        return self.thinking is not None and self.thinking.get("type") == "enabled"

    def toolset(self) -> tp.ToolSet:
        """The tools in the neutral form both APIs render alike, and the choice; 400 for a choice
        that names no tool."""
        tools = tuple(tp.template_tool(t.name, t.description, t.input_schema) for t in self.tools or [])
        choice = self.tool_choice
        mode = {"any": "required", "tool": "named"}.get(choice.type, choice.type) if choice else (
            "auto" if tools else "none")
        toolset = tp.ToolSet(tools, tp.ToolChoice(mode, choice.name if choice else None,
                                                  not (choice and choice.disable_parallel_tool_use)))
        try:
            names = toolset.names
            if len(set(names)) != len(names):
                raise ValueError("tools: tool names must be unique")
            if mode == "named" and not toolset.choice.name:
                raise ValueError("tool_choice.name: a tool_choice of type 'tool' needs the tool's name")
            tp.check_choice(toolset, "tool_choice.name" if mode == "named" else "tool_choice")
        except ValueError as err:
            raise APIError(str(err)) from None
        return toolset

    @property
    def wants_diagnostics(self) -> bool:
        """`diagnostics` was sent (even `null` previous id: the first turn opts in)."""
        return "diagnostics" in self.model_fields_set and self.diagnostics is not None


@dataclass(slots=True)
class Breakpoint:
    ref: BlockRef
    ttl: str  # "5m" | "1h"


@dataclass(slots=True)
class ParsedChat:
    system: Turn | None
    turns: list[Turn]
    breakpoints: list[Breakpoint]  # in chat order
    message_ends: list[BlockRef | None]  # per request message, its last block (None: no text)
    toolset: tp.ToolSet = tp.ToolSet((), tp.ToolChoice("none"))

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self.toolset.template_tools


def parse_request(payload: Any) -> MessagesRequest:
    """Validate a JSON body; raises APIError (400) with the first problem's path."""
    try:
        body = MessagesRequest.model_validate(payload)
    except ValidationError as err:
        raise APIError(first_error(err.errors())) from None
    if body.thinking is not None and body.thinking.get("type") not in ("enabled", "disabled"):
        raise APIError("thinking.type: send \"enabled\" (with budget_tokens) or \"disabled\"")
    return body


def parse_chat(body: MessagesRequest) -> ParsedChat:
    """The turns to render (consecutive same-role messages merged, as Anthropic does) and the
    breakpoints: block `cache_control`s plus the top-level one on the last block."""
    breakpoints: list[Breakpoint] = [Breakpoint((TOOLS, i), t.cache_control.ttl)
                                      for i, t in enumerate(body.tools or []) if t.cache_control is not None]
    system = None
    if body.system is not None:
        blocks = [body.system] if isinstance(body.system, str) else body.system
        system = Turn("system", _texts(blocks, SYSTEM, breakpoints, "system", Turn("system"), set()))
    turns: list[Turn] = []
    message_ends: list[BlockRef | None] = []
    calls: set[str] = set()  # tool_use ids so far: a tool_result must answer one
    for m, message in enumerate(body.messages):
        if not turns or turns[-1].role != message.role:
            turns.append(Turn(message.role))
        turn = turns[-1]
        blocks = [message.content] if isinstance(message.content, str) else message.content
        found: list[Breakpoint] = []
        num_results = len(turn.tool_results)
        texts = _texts(blocks, len(turns) - 1, found, f"messages.{m}.content", turn, calls)
        for point in found:  # block indices within the merged turn
            if point.ref[1] >= 0:
                point.ref = (point.ref[0], point.ref[1] + len(turn.blocks))
        breakpoints += found
        turn.blocks += texts
        last_result = (len(turns) - 1, RESULT_BASE + len(turn.tool_results) - 1)
        message_ends.append((len(turns) - 1, len(turn.blocks) - 1) if texts
                            else last_result if len(turn.tool_results) > num_results
                            else (message_ends[-1] if message_ends else None))
    if turns[-1].tool_calls and turns[-1].role == "assistant":
        raise APIError(f"messages.{len(body.messages) - 1}: the last message is an assistant "
                       "tool_use; send the user turn with its tool_result")
    if body.cache_control is not None:
        last = message_ends[-1] if message_ends else None
        if last is not None and all(b.ref != last for b in breakpoints):
            breakpoints.append(Breakpoint(last, body.cache_control.ttl))
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise APIError(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                       f"Found {len(breakpoints)}.")
    for earlier, later in zip(breakpoints, breakpoints[1:]):
        if earlier.ttl == "5m" and later.ttl == "1h":
            raise APIError("a cache_control ttl='1h' breakpoint must not come after a ttl='5m' one: "
                           "put the longer-lived prefix first")
    return ParsedChat(system, turns, breakpoints, message_ends, body.toolset())


def _texts(blocks: list[Block | str], turn_index: int, breakpoints: list[Breakpoint],
           where: str, turn: Turn, calls: set[str]) -> list[str]:
    """The text blocks of one message; its tool_use blocks become the turn's calls, its tool_result
    blocks its results (each a breakpoint place too)."""
    texts = []
    for j, block in enumerate(blocks):
        if isinstance(block, str):
            texts.append(block)
            continue
        at = f"{where}.{j}"
        if block.type in ("thinking", "redacted_thinking") and turn.role == "assistant":
            continue  # (an earlier answer's reasoning, sent back: chat templates leave it out)
        if block.type == "tool_use":
            if turn.role != "assistant":
                raise APIError(f"{at}: tool_use blocks belong in assistant messages")
            if not block.id or not block.name:
                raise APIError(f"{at}: a tool_use block needs `id` and `name`")
            if block.cache_control is not None:
                raise APIError(f"{at}: cache_control on a tool_use block is not supported; put it "
                               "on the next tool_result or text block")
            calls.add(block.id)
            turn.tool_calls.append(tp.template_call(block.id, block.name, block.input or {}))
            continue
        if block.type == "tool_result":
            if turn.role != "user":
                raise APIError(f"{at}: tool_result blocks belong in user messages")
            if block.tool_use_id not in calls:
                raise APIError(f"{at}.tool_use_id: {block.tool_use_id!r} answers no tool_use block "
                               "of an earlier assistant message")
            turn.tool_results.append({"tool_call_id": block.tool_use_id, "content": block.result_text(at)})
            if block.cache_control is not None:
                breakpoints.append(Breakpoint((turn_index, RESULT_BASE + len(turn.tool_results) - 1),
                                              block.cache_control.ttl))
            continue
        if block.type != "text" or block.text is None:
            raise APIError(f"{at}: content blocks of type {block.type!r} are not supported; "
                           "send text, tool_use or tool_result blocks")
        if block.cache_control is not None:
            if not block.text:
                raise APIError(f"{at}: cache_control cannot be set on an empty text block")
            breakpoints.append(Breakpoint((turn_index, len(texts)), block.cache_control.ttl))
        texts.append(block.text)
    return texts


def first_error(errors: list[dict[str, Any]]) -> str:
    # a union (`str | list[Block]`) reports one error per member: the deepest names the real problem
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {"msg": "invalid request"}
    if first.get("type") == "missing":
        path = ".".join(str(p) for p in first.get("loc", ()))
        return f"{path}: Field required"
    path = [str(p) for p in first.get("loc", ())
            if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p or p.startswith("function")))]
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return f"{'.'.join(path)}: {message}" if path else message


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "Block"}
