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
from kvserve.server.protocol import APIError

if TYPE_CHECKING:
    from kvserve.model.tokenizer import Encoded

BLOCK_SEPARATOR = "\n"  # text blocks of one message (or of `system`) are joined with it
SYSTEM = -1  # the message index of the system prompt in a BlockRef
_MARKERS = ("\x00", "\x01", "\ue000", "\ue001", "\U000f0000")
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


@dataclass(slots=True)
class Turn:
    role: str  # "system" | "user" | "assistant"
    blocks: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return BLOCK_SEPARATOR.join(self.blocks)


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

    def __init__(self, chat_prompt: Callable[[list[dict[str, str]]], str],
                 encode: Callable[[str], Encoded]) -> None:
        self.chat_prompt = chat_prompt
        self.encode = encode

    def render_text(self, system: Turn | None, turns: list[Turn]) -> str:
        messages = ([{"role": "system", "content": system.text}] if system is not None else [])
        messages += [{"role": t.role, "content": t.text} for t in turns]
        try:
            if turns and turns[-1].role == "assistant":
                return self.chat_prompt(messages[:-1]) + messages[-1]["content"]
            return self.chat_prompt(messages)
        except APIError:
            raise
        except Exception as err:  # jinja raises its own types
            raise APIError(f"cannot apply the chat template: {err}", param="messages") from None

    def render(self, system: Turn | None, turns: list[Turn]) -> RenderedChat:
        text = self.render_text(system, turns)
        encoded = self.encode(text)
        return RenderedChat(text, encoded.ids, encoded=encoded)

    def block_ends(self, system: Turn | None, turns: list[Turn], chat: RenderedChat,
                   refs: list[BlockRef]) -> list[int] | None:
        """Character offset in `chat.text` where each referenced block ends (refs in chat order),
        or None when the template does not copy text verbatim."""
        marker = next((m for m in _MARKERS if m not in chat.text), None)
        if marker is None:
            return None
        marked = set(refs)
        copy_system = None if system is None else Turn("system", _mark(system.blocks, SYSTEM, marked, marker))
        copy_turns = [Turn(t.role, _mark(t.blocks, i, marked, marker)) for i, t in enumerate(turns)]
        rendered = self.render_text(copy_system, copy_turns)
        if rendered.replace(marker, "") != chat.text:
            return None
        ends, seen = [], 0
        for index, char in enumerate(rendered):
            if char == marker:
                ends.append(index - seen)
                seen += 1
        return ends if len(ends) == len(marked) else None

    def token_offsets(self, system: Turn | None, turns: list[Turn], chat: RenderedChat,
                      refs: list[BlockRef]) -> list[int]:
        """Per ref (in chat order), the number of prompt tokens up to and including that block."""
        ordered = sorted(set(refs))
        ends = self.block_ends(system, turns, chat, ordered)
        if ends is None:
            raise APIError("this model's chat template does not copy message text verbatim, so "
                           "cache_control breakpoints cannot be placed; remove cache_control")
        by_ref = {ref: chat.tokens_before(end) for ref, end in zip(ordered, ends)}
        return [by_ref[ref] for ref in refs]


def _mark(blocks: list[str], turn_index: int, marked: set[BlockRef], marker: str) -> list[str]:
    return [b + marker if (turn_index, j) in marked else b for j, b in enumerate(blocks)]


def lease_ttl_s(engine, label: str) -> float:
    """A TTL label in seconds (the engine applies its `lease_ttl_scale`, which tests shorten)."""
    return TTL_SECONDS[label]


def make_lease(engine, num_tokens: int, label: str) -> CacheLease:
    return CacheLease(num_tokens=num_tokens, ttl_s=lease_ttl_s(engine, label), label=label)


async def retained_requests(engine, items: list[tuple[list[int], Any, str]], namespace: str,
                            label: str, kv_explain: bool = False) -> list:
    """Queue (prompt token ids, params, request id) items, each distinct prompt with a lease on all
    its tokens (`kv_retention`); all or none: a refused item aborts the ones queued before it."""
    streams, leased = [], set()
    try:
        for prompt, params, request_id in items:
            key = tuple(prompt)
            leases = None if key in leased else [make_lease(engine.engine, len(prompt), label)]
            leased.add(key)
            streams.append(await engine.add_request(prompt, params, request_id, namespace,
                                                    leases=leases, kv_explain=kv_explain))
    except BaseException:
        for stream in streams:
            engine.abort(stream.request_id)
        raise
    return streams
