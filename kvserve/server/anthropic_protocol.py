"""The Anthropic Messages API request schema (text blocks, `cache_control`, `diagnostics`), its error
body, and the chat and breakpoints a request describes.

Unknown fields are ignored; known ones of the wrong type, content blocks other than text, tools and
extended thinking are a 400 in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from kvserve.server.breakpoints import SYSTEM, BlockRef, Turn
from kvserve.server.protocol import APIError, Text

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


class Block(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Text
    text: Text | None = None
    cache_control: CacheControl | None = None


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


class MessagesRequest(BaseModel):
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
    tools: list[Any] | None = None
    thinking: dict[str, Any] | None = None

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


def parse_request(payload: Any) -> MessagesRequest:
    """Validate a JSON body; raises APIError (400) with the first problem's path."""
    try:
        body = MessagesRequest.model_validate(payload)
    except ValidationError as err:
        raise APIError(_first_error(err.errors())) from None
    if body.tools:
        raise APIError("tools are not supported by this server; send text messages only")
    if body.thinking and body.thinking.get("type") not in (None, "disabled"):
        raise APIError("extended thinking is not supported by this server; leave `thinking` out")
    return body


def parse_chat(body: MessagesRequest) -> ParsedChat:
    """The turns to render (consecutive same-role messages merged, as Anthropic does) and the
    breakpoints: block `cache_control`s plus the top-level one on the last block."""
    breakpoints: list[Breakpoint] = []
    system = None
    if body.system is not None:
        blocks = [body.system] if isinstance(body.system, str) else body.system
        system = Turn("system", _texts(blocks, SYSTEM, breakpoints, "system"))
    turns: list[Turn] = []
    message_ends: list[BlockRef | None] = []
    for m, message in enumerate(body.messages):
        if not turns or turns[-1].role != message.role:
            turns.append(Turn(message.role))
        turn = turns[-1]
        blocks = [message.content] if isinstance(message.content, str) else message.content
        found: list[Breakpoint] = []
        texts = _texts(blocks, len(turns) - 1, found, f"messages.{m}.content")
        for point in found:  # block indices within the merged turn
            point.ref = (point.ref[0], point.ref[1] + len(turn.blocks))
        breakpoints += found
        turn.blocks += texts
        message_ends.append((len(turns) - 1, len(turn.blocks) - 1) if turn.blocks
                            else (message_ends[-1] if message_ends else None))
    if body.cache_control is not None:
        last = (len(turns) - 1, len(turns[-1].blocks) - 1) if turns[-1].blocks else None
        if last is not None and all(b.ref != last for b in breakpoints):
            breakpoints.append(Breakpoint(last, body.cache_control.ttl))
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise APIError(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                       f"Found {len(breakpoints)}.")
    for earlier, later in zip(breakpoints, breakpoints[1:]):
        if earlier.ttl == "5m" and later.ttl == "1h":
            raise APIError("a cache_control ttl='1h' breakpoint must not come after a ttl='5m' one: "
                           "put the longer-lived prefix first")
    return ParsedChat(system, turns, breakpoints, message_ends)


def _texts(blocks: list[Block | str], turn_index: int, breakpoints: list[Breakpoint],
           where: str) -> list[str]:
    texts = []
    for j, block in enumerate(blocks):
        if isinstance(block, str):
            texts.append(block)
            continue
        if block.type != "text" or block.text is None:
            raise APIError(f"{where}.{j}: content blocks of type {block.type!r} are not supported; "
                           "send text blocks")
        if block.cache_control is not None:
            if not block.text:
                raise APIError(f"{where}.{j}: cache_control cannot be set on an empty text block")
            breakpoints.append(Breakpoint((turn_index, j), block.cache_control.ttl))
        texts.append(block.text)
    return texts


def _first_error(errors: list[dict[str, Any]]) -> str:
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
