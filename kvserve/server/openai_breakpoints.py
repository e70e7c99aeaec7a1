"""OpenAI's explicit cache breakpoints: `prompt_cache_breakpoint: {"mode": "explicit", "ttl"?}` on a
chat content part (or a Responses input part) marks the exact end of a reusable prefix. kvserve leases
that prefix (as Anthropic's `cache_control` does: breakpoints.py) for the part's ttl, else the request's
`prompt_cache_options.ttl`, else 30m.

Where a part ends in the prompt: the conversation is rendered once as sent and once with a marker
character (absent from the prompt) right after each marked part's text; the template must copy text
verbatim (the marked render, markers removed, is the prompt), and a marker's index, less the markers
before it, is the part's end. The count is the leading tokens of the prompt's own encoding that end at
or before it: a prefix of the very tokens the engine runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


MAX_BREAKPOINTS = 4  # OpenAI writes at most four per request
_MARKERS = ("\x00", "\x01", "\ue000", "\ue001", "\U000f0000")

BreakpointRef = tuple[int, int, str | None]  # (message index, part index, its own ttl)


class PromptCacheBreakpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["explicit"] = "explicit"
    ttl: Literal["30m", "12h"] | None = None


def part_end(parts: list[Any], j: int) -> int:
    """Characters of a message's content up to and including part j (parts joined with nothing)."""
    return sum(len(p.text or "") for p in parts[:j + 1])


def breakpoint_tokens(conversation: list[dict[str, Any]], contents: dict[int, list[Any]], refs: list[BreakpointRef],
                      render: Callable[[list[dict[str, Any]]], str], text: str, encoded: Any) -> list[int] | None:
    """Per ref, the prompt tokens up to the end of its part; None when the template does not copy the
    text verbatim (then no breakpoint can be placed)."""
    marker = next((m for m in _MARKERS if m not in text), None)
    if marker is None:
        return None
    marked = [dict(m) for m in conversation]
    for i, j, _ in sorted(refs, key=lambda r: (r[0], -r[1])):  # the latest part first: offsets hold
        end = part_end(contents[i], j)
        marked[i]["content"] = marked[i]["content"][:end] + marker + marked[i]["content"][end:]
    ends = marker_offsets(render(marked), marker, text)
    if ends is None:
        return None
    token_ends = encoded.ends()
    by_order = [_tokens_before(token_ends, end) for end in ends]  # in prompt order: (message, part)
    order = sorted(range(len(refs)), key=lambda k: (refs[k][0], refs[k][1]))
    counts = [0] * len(refs)
    for rank, k in enumerate(order):
        counts[k] = by_order[rank]
    return counts


def marker_offsets(rendered: str, marker: str, text: str) -> list[int] | None:
    """Where each `marker` stood in `rendered`, as offsets into `text` (rendered without the markers);
    None if the markers changed more of the rendering than themselves."""
    if rendered.replace(marker, "") != text:
        return None
    ends, seen = [], 0
    for index, char in enumerate(rendered):
        if char == marker:
            ends.append(index - seen)
            seen += 1
    return ends


def _tokens_before(token_ends: list[int], char_pos: int) -> int:
    """Leading tokens that end at or before `char_pos` (breakpoints.RenderedChat's rule)."""
    count = 0
    for end in token_ends:
        if end > char_pos:
            break
        count += 1
    return count
