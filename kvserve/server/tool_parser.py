"""Tool calls read out of a model's text: Qwen2.5/Qwen3 (Hermes) `<tool_call>{json}</tool_call>`
blocks, Llama 3.x JSON calls (`{"name", "parameters"}`, after `<|python_tag|>` when the decoder
kept it), and a JSON fallback (the whole answer one call object, or a list of them). The same
scanner serves whole answers and streams: it reads the cumulative text and says what can be sent
(content, a call's name, more of its arguments text) without taking back anything sent before.

A call's arguments text is the exact JSON text the model wrote for the value, so the streamed
pieces add up to the final `arguments`.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_MAX_JSON_PREFIX = 64  # characters a JSON-format answer may run before its call header shows


class ToolFormat(enum.Enum):
    HERMES = "hermes"  # Qwen2.5, Qwen3, Hermes: <tool_call> blocks after optional content
    LLAMA3 = "llama3"  # Llama 3.x: the answer is the JSON call(s)
    JSON = "json"  # any other template: the answer is the JSON call(s)


def tool_format(chat_template: str | None) -> ToolFormat:
    """Which convention the model's own template teaches it."""
    template = chat_template or ""
    if OPEN in template:
        return ToolFormat.HERMES
    if PYTHON_TAG in template or "ipython" in template:
        return ToolFormat.LLAMA3
    return ToolFormat.JSON


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    is_complete: bool = False


@dataclass(slots=True)
class Scan:
    """What the text holds so far: content that is safe to show, and the calls begun."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def _args_text(block: str, start: int) -> str | None:
    """The JSON value starting at `start` in `block`, as written (a JSON-string value that holds
    JSON, as some models write arguments, is unwrapped)."""
    try:
        value, end = json.JSONDecoder().raw_decode(block, start)
    except ValueError:
        return None
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            return None
    return block[start:end]


def _closes(block: str, start: int) -> bool:
    """After the arguments value, only the call object's `}` (and whitespace) remains."""
    try:
        _, end = json.JSONDecoder().raw_decode(block, start)
    except ValueError:
        return False
    return block[end:].strip() == "}"


def _read_call(block: str, complete: bool) -> ParsedCall | None:
    """One call object's text (maybe unfinished). None until its name is known, or when it is not a
    call after all."""
    match = _HEADER.match(block)
    if match is None:
        return None
    try:
        name = json.loads(f'"{match.group(1)}"')
    except ValueError:
        return None
    start = match.end()
    if complete:
        args = _args_text(block, start)
        if args is None or not _closes(block, start):
            return None
        return ParsedCall(name, args, True)
    try:  # the value may be whole already, with the call's close still to come
        _, end = json.JSONDecoder().raw_decode(block, start)
        return ParsedCall(name, block[start:end])
    except ValueError:
        pass
    raw = block[start:]
    raw = raw[:len(raw) - _could_be_prefix(raw, CLOSE)]
    return ParsedCall(name, raw[:len(raw.rstrip().rstrip("}").rstrip())])


def _could_be_prefix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that begins `token` (hold it back: it may be the tag)."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def scan(text: str, fmt: ToolFormat, finished: bool) -> Scan:
    """The content and calls of `text` (the cumulative output). Unfinished: content stops where a
    call might begin and calls carry only the arguments text that cannot change."""
    if fmt is ToolFormat.HERMES:
        return _scan_hermes(text, finished)
    return _scan_json(text, finished)


def _scan_hermes(text: str, finished: bool) -> Scan:
    first = text.find(OPEN)
    if first < 0:
        if finished:
            return Scan(text)
        keep = len(text) - _could_be_prefix(text, OPEN)
        return Scan(text[:keep])
    out = Scan(text[:first].rstrip() if finished else text[:first].rstrip())
    for piece in text[first + len(OPEN):].split(OPEN):
        end = piece.find(CLOSE)
        complete = end >= 0 or finished
        body = piece[:end] if end >= 0 else piece
        call = _read_call(body.strip() if complete else body.lstrip(), complete)
        if call is None:
            if complete:  # not a call after all: what the model wrote stays visible
                out.content += (OPEN + piece) if finished else ""
            break
        out.calls.append(call)
        if not complete:
            break
    return out


def _scan_json(text: str, finished: bool) -> Scan:
    body = text.replace(PYTHON_TAG, "", 1) if text.lstrip().startswith(PYTHON_TAG) else text
    stripped = body.strip()
    fence = re.match(r"^```(?:json)?\s*", stripped)
    if fence:
        stripped = stripped[fence.end():].removesuffix("```").strip()
    if not stripped or (not finished and PYTHON_TAG.startswith(stripped)):
        return Scan("" if not finished else text)
    if stripped[0] not in "{[":
        return Scan(text)
    objects = _objects(stripped, finished)
    if objects is None:  # not calls: the answer is plain content
        if finished or len(stripped) > _MAX_JSON_PREFIX and not _HEADER.match(stripped):
            return Scan(text)
        return Scan("")
    return Scan("", objects)


def _objects(text: str, finished: bool) -> list[ParsedCall] | None:
    """Call objects separated by `;` or `,` (or a JSON list of them). None: this is not calls."""
    if finished:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, list):
            return _listed(value)
    inner = text[1:].lstrip() if text.startswith("[") else text
    calls, pos = [], 0
    decoder = json.JSONDecoder()
    while pos < len(inner):
        try:
            value, end = decoder.raw_decode(inner, pos)
        except ValueError:
            if finished:
                return None
            call = _read_call(inner[pos:], False)
            if call is None:
                return calls or (None if len(inner) - pos > _MAX_JSON_PREFIX else [])
            calls.append(call)
            return calls
        call = _read_call(inner[pos:end], True)
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(inner) and inner[pos] in " \t\r\n;,]":
            pos += 1
    return calls


def _listed(value: list) -> list[ParsedCall] | None:
    calls = []
    for item in value:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError:
                return None
        calls.append(ParsedCall(item["name"], args if isinstance(args, str)
                                else json.dumps(args, ensure_ascii=False), True))
    return calls


def parse_output(text: str, fmt: ToolFormat) -> Scan:
    """A finished answer's content and complete tool calls."""
    found = scan(text, fmt, finished=True)
    if any(not c.is_complete for c in found.calls):
        return Scan(text)
    return found


@dataclass(slots=True)
class CallDelta:
    """Something new to send about call `index`: its start (name set) and/or more arguments text."""

    index: int
    name: str | None = None
    arguments: str = ""


class ToolStream:
    """Turns a growing text into content deltas and call deltas, never resending what was sent."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self.content_sent = ""
        self.args_sent: list[str] = []  # per started call

    def update(self, text: str, finished: bool) -> tuple[str, list[CallDelta]]:
        found = scan(text, self.fmt, finished)
        if finished and any(not c.is_complete for c in found.calls) and not self.args_sent:
            found = Scan(text)
        content = ""
        if found.content.startswith(self.content_sent) and not self.args_sent:
            content = found.content[len(self.content_sent):]
            self.content_sent = found.content
        deltas = []
        calls = found.calls if self.parallel else found.calls[:1]
        for index, call in enumerate(calls):
            if index == len(self.args_sent):
                self.args_sent.append("")
                deltas.append(CallDelta(index, call.name))
            sent = self.args_sent[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                more = call.arguments[len(sent):]
                self.args_sent[index] = call.arguments
                if deltas and deltas[-1].index == index:
                    deltas[-1].arguments = more
                else:
                    deltas.append(CallDelta(index, None, more))
        return content, deltas

    @property
    def num_calls(self) -> int:
        return len(self.args_sent)
