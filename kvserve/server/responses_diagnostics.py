"""OpenAI's prompt cache diagnostics on /v1/responses: `prompt_cache_options.comparison_response_id`
names an earlier stored response of the tenant, and `prompt_cache_diagnostics` says whether this prompt
could reuse that one's prefix (`cache_hit`), why not (`cache_miss` with OpenAI's reason, the previous
prompt's tokens past the first difference and the reusable prefix), or that the comparison is gone
(`comparison_response_not_found`). Compared on what decides the cache: the prompt_cache_key, the tools,
the text format, then the prompt's token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.server.cache_diagnostics import digest


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """What a stored response's prompt was, for later comparisons."""

    prompt_cache_key: str | None
    tools: str  # digest of the tool definitions
    text_format: str  # digest of text.format
    token_ids: tuple[int, ...]


def prompt_record(prompt_cache_key: str | None, tools: Any, text_format: Any, token_ids: list[int]) -> PromptRecord:
    return PromptRecord(prompt_cache_key, digest(tools), digest(text_format), tuple(token_ids))


def compare(previous: PromptRecord | None, current: PromptRecord) -> dict[str, Any]:
    if previous is None:
        return {"type": "comparison_response_not_found"}
    before = previous.token_ids

    def miss(reason: str, reusable: int) -> dict[str, Any]:
        return {"type": "cache_miss", "reason": reason, "cache_missed_tokens": len(before) - reusable,
                "comparison_reusable_tokens": reusable}

    if previous.prompt_cache_key != current.prompt_cache_key:
        return miss("prompt_cache_key_changed", 0)
    if previous.tools != current.tools:
        return miss("tools_changed", 0)
    if previous.text_format != current.text_format:
        return miss("text_format_changed", 0)
    common = 0
    for a, b in zip(before, current.token_ids):
        if a != b:
            break
        common += 1
    return {"type": "cache_hit"} if common == len(before) else miss("input_changed", common)
