"""A chat of text blocks rendered through the model's template, and where given blocks end in it, as
token counts: the prefix a `cache_control` breakpoint (or a named cache) leases.

Method: render the chat once as sent (`P`), and once with a marker character, absent from `P`, right
after each block of interest. Every template that copies message text verbatim gives back `P` when
the markers are removed, and each marker's index (less the markers before it) is where its block ends
in `P`. The token count is then the number of leading tokens of `P`'s own encoding whose characters
all lie before that point: a prefix of the very tokens the engine runs. A block followed by template
markup (the end of a message, e.g. `<|im_end|>`, a special token) ends on a token boundary, so the
count is exact there (the whole system prompt, the whole of a message); inside a message, a block
joined to the next one by "\\n" may share a token with it, and the count stops before that token.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.request import CacheLease
from kvserve.server.openai_breakpoints import marker_offsets
from kvserve.server.protocol import APIError

if TYPE_CHECKING:
    from kvserve.model.tokenizer import Encoded

BLOCK_SEPARATOR = "\n"  # text blocks of one message (or of `system`) are joined with it
SYSTEM = -1  # the message index of the system prompt in a BlockRef
TOOLS = -2  # ... and of the tool definitions (block index = the tool's index)
RESULT_BASE = -10_000  # block index RESULT_BASE + k: a turn's k-th tool result (rendered before its text)
_MARKERS = ("\x00", "\x01", "\ue000", "\ue001", "\U000f0000")
_JSON_MARKERS = _MARKERS[2:]  # kept verbatim by tojson (ensure_ascii off), as tool JSON needs
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0, "30m": 1800.0, "12h": 43200.0}  # Anthropic's; OpenAI's


@dataclass(slots=True)
class Turn:
    role: str  # "system" | "user" | "assistant"
    blocks: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # assistant: template-shaped calls
    tool_results: list[dict[str, Any]] = field(default_factory=list)  # user: {"tool_call_id", "content"}

    @property
    def text(self) -> str:
        return BLOCK_SEPARATOR.join(self.blocks)

    def messages(self) -> list[dict[str, Any]]:
        """The template's messages for this turn: tool results first (role "tool"), then the text."""
        out: list[dict[str, Any]] = [{"role": "tool", "content": r["content"], "tool_call_id": r["tool_call_id"]}
                                     for r in self.tool_results]
        if self.tool_calls:
            out.append({"role": self.role, "content": self.text, "tool_calls": self.tool_calls})
        elif self.blocks or not self.tool_results:
            out.append({"role": self.role, "content": self.text})
        return out


BlockRef = tuple[int, int]  # (index into the turns, or SYSTEM; block index)


@dataclass(slots=True)
class RenderedChat:
    text: str
    token_ids: list[int]
    token_ends: list[int] | None = None  # character offset where each token ends in `text`
    is_sorted: bool | None = None  # token_ends never decrease (then a count is a binary search)
    encoded: Encoded | None = None  # where token_ends come from, on first use

    def ends(self) -> list[int]:
        if self.token_ends is None:
            self.token_ends = self.encoded.ends() if self.encoded is not None else []
        if self.is_sorted is None:
            ends = self.token_ends
            self.is_sorted = all(a <= b for a, b in zip(ends, ends[1:]))
        return self.token_ends

    def tokens_before(self, char_pos: int) -> int:
        """Leading tokens that end at or before `char_pos`."""
        ends = self.ends()
        if self.is_sorted:
            return bisect.bisect_right(ends, char_pos)
        count = 0
        for end in ends:
            if end > char_pos:
                break
            count += 1
        return count


class ChatRenderer:
    """Renders `system` + turns with `chat_prompt` (the engine's template, generation prompt added)
    and tokenizes with `encode` (text -> Encoded with token ends: the front door's one rule).
    A chat that ends with an assistant turn is continued, as Anthropic's API does: the template
    renders the turns before it, and the assistant text follows the generation prompt unclosed."""

    def __init__(self, chat_prompt: Callable[..., str], encode: Callable[[str], Encoded]) -> None:
        self.chat_prompt = chat_prompt
        self.encode = encode

    def render_text(self, system: Turn | None, turns: list[Turn],
                    tools: list[dict[str, Any]] | None = None) -> str:
        messages = ([{"role": "system", "content": system.text}] if system is not None else [])
        for turn in turns:
            messages += turn.messages()
        def render(chat: list[dict[str, Any]]) -> str:
            return self.chat_prompt(chat, tools) if tools else self.chat_prompt(chat)

        try:
            if turns and turns[-1].role == "assistant" and not turns[-1].tool_calls:
                return render(messages[:-1]) + messages[-1]["content"]
            return render(messages)
        except APIError:
            raise
        except Exception as err:  # jinja raises its own types
            raise APIError(f"cannot apply the chat template: {err}", param="messages") from None

    def render(self, system: Turn | None, turns: list[Turn],
               tools: list[dict[str, Any]] | None = None) -> RenderedChat:
        text = self.render_text(system, turns, tools)
        encoded = self.encode(text)
        return RenderedChat(text, encoded.ids, encoded=encoded)

    def block_ends(self, system: Turn | None, turns: list[Turn], chat: RenderedChat,
                   refs: list[BlockRef], tools: list[dict[str, Any]] | None = None) -> list[int] | None:
        """Character offset in `chat.text` where each referenced block ends (refs in chat order),
        or None when the template does not copy text verbatim. A tool's "block" ends with the
        last string in its JSON (a few closing characters before the definition's end)."""
        tool_refs = [r for r in refs if r[0] == TOOLS]
        text_refs = [r for r in refs if r[0] != TOOLS]
        ends: list[int] = []
        if tool_refs:  # a pass of their own: templates may put the system text before the tools
            found = self._marked_ends(chat, _JSON_MARKERS, lambda m: (
                system, turns, [_mark_tool(t, m) if (TOOLS, i) in tool_refs else t
                                for i, t in enumerate(tools or [])]))
            if found is None or len(found) != len(set(tool_refs)):
                return None
            ends += found
        if text_refs:
            marked = set(text_refs)
            found = self._marked_ends(chat, _MARKERS, lambda m: (
                None if system is None else Turn("system", _mark(system.blocks, SYSTEM, marked, m)),
                [Turn(t.role, _mark(t.blocks, i, marked, m), t.tool_calls, _mark_results(t.tool_results, i, marked, m))
                 for i, t in enumerate(turns)], tools))
            if found is None or len(found) != len(marked):
                return None
            ends += found
        return ends

    def _marked_ends(self, chat: RenderedChat, markers: tuple[str, ...], marked_input) -> list[int] | None:
        marker = next((m for m in markers if m not in chat.text), None)
        if marker is None:
            return None
        return marker_offsets(self.render_text(*marked_input(marker)), marker, chat.text)

    def token_offsets(self, system: Turn | None, turns: list[Turn], chat: RenderedChat,
                      refs: list[BlockRef], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Per ref (in chat order), the number of prompt tokens up to and including that block."""
        ordered = sorted(set(refs))
        ends = self.block_ends(system, turns, chat, ordered, tools)
        if ends is None:
            raise APIError("this model's chat template does not copy message text verbatim, so "
                           "cache_control breakpoints cannot be placed; remove cache_control")
        by_ref = {ref: chat.tokens_before(end) for ref, end in zip(ordered, ends)}
        return [by_ref[ref] for ref in refs]


def _mark_tool(tool: Any, marker: str) -> Any:
    """A copy of a tool definition with `marker` after its last string (in JSON order)."""
    done = False

    def walk(value: Any) -> Any:
        nonlocal done
        if isinstance(value, dict):
            items = [(k, v) for k, v in value.items()]
            out = {}
            for k, v in reversed(items):
                out[k] = walk(v)
            return {k: out[k] for k, _ in items}
        if isinstance(value, list):
            return list(reversed([walk(v) for v in reversed(value)]))
        if isinstance(value, str) and not done:
            done = True
            return value + marker
        return value

    return walk(tool)


def _mark(blocks: list[str], turn_index: int, marked: set[BlockRef], marker: str) -> list[str]:
    return [b + marker if (turn_index, j) in marked else b for j, b in enumerate(blocks)]


def _mark_results(results: list[dict[str, Any]], turn_index: int, marked: set[BlockRef],
                  marker: str) -> list[dict[str, Any]]:
    return [{**r, "content": r["content"] + marker} if (turn_index, RESULT_BASE + k) in marked else r
            for k, r in enumerate(results)]


def lease_ttl_s(engine, label: str) -> float:
    """A TTL label in seconds (the engine applies its `lease_ttl_scale`, which tests shorten)."""
    return TTL_SECONDS[label]


def make_lease(engine, num_tokens: int, label: str) -> CacheLease:
    return CacheLease(num_tokens=num_tokens, ttl_s=lease_ttl_s(engine, label), label=label)


async def retained_requests(engine, items: list[tuple[list[int], Any, str]], namespace: str,
                            ask: Any, kv_explain: bool = False, tool_call: Any = None) -> list:
    """Queue (prompt token ids, params, request id) items, each distinct prompt with a lease on all
    its tokens for `ask.ttl` (`kv_retention`, prompt_cache_options) unless `ask.whole` is False, and
    on the first `n` tokens for each (n, label) of `ask.token_counts` (OpenAI's explicit breakpoints);
    all or none: a refused item aborts the ones queued before it."""
    streams, leased = [], set()
    whole, counts = getattr(ask, "whole", True), getattr(ask, "token_counts", ())
    try:
        for prompt, params, request_id in items:
            key = tuple(prompt)
            wanted = [*counts, *([(len(prompt), ask.ttl)] if whole else [])]
            leases = None if key in leased else [make_lease(engine.engine, n, label) for n, label in wanted]
            leased.add(key)
            streams.append(await engine.add_request(prompt, params, request_id, namespace,
                                                    leases=leases, kv_explain=kv_explain, tool_call=tool_call))
    except BaseException:
        for stream in streams:
            engine.abort(stream.request_id)
        raise
    return streams
