"""Cache diagnostics for /v1/messages: a bounded, per-tenant record of each opted-in response's prompt
fingerprint, and why a new prompt could not reuse the prefix of the one named by
`diagnostics.previous_message_id` (the `cache_miss_reason` types of Anthropic's SDK)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvserve.cache.fair_table import FairShareTable

DEFAULT_CAPACITY = 10_000


def digest(value: Any) -> str:
    """A stable hash of a JSON-able value (texts, blocks, tool schemas)."""
    data = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class PromptFingerprint:
    """What decides a prompt's cacheable prefix, in Anthropic's order: tools, system, messages."""

    model: str
    tools: str  # digest of the tool definitions
    system: str  # digest of the system prompt
    messages: tuple[str, ...]  # digest per message
    system_end: int  # prompt tokens up to the end of the system prompt
    message_ends: tuple[int, ...]  # prompt tokens up to the end of each message
    cacheable_tokens: int  # tokens the request left in the cache (to its last breakpoint)
    other: str = ""  # digest of any other prompt-affecting parameter
    tools_end: int = 0  # prompt tokens up to the end of the tool definitions (a template may put
    # them after the system text, or in the first user turn)


def fingerprint(model: str, tools: Any, system: Any, messages: list[Any], system_end: int,
                message_ends: list[int], cacheable_tokens: int, other: Any = None,
                tools_end: int = 0) -> PromptFingerprint:
    if len(message_ends) != len(messages):
        raise ValueError(f"{len(messages)} messages but {len(message_ends)} message ends")
    return PromptFingerprint(model, digest(tools), digest(system), tuple(digest(m) for m in messages),
                             system_end, tuple(message_ends), cacheable_tokens,
                             "" if other is None else digest(other), tools_end)


def cache_miss_reason(previous: PromptFingerprint | None, current: PromptFingerprint
                      ) -> dict[str, Any] | None:
    """Anthropic's `cache_miss_reason` for `current` after `previous`, or None when the previous
    prompt is a prefix of this one (or this one of it): nothing was missed by a change.
    `cache_missed_input_tokens` = the previous request's cached tokens past the first change."""
    if previous is None:
        return {"type": "previous_message_not_found"}

    def missed(kind: str, matched_tokens: int) -> dict[str, Any]:
        return {"type": kind,
                "cache_missed_input_tokens": max(previous.cacheable_tokens - matched_tokens, 0)}

    if previous.model != current.model:
        return missed("model_changed", 0)
    if previous.tools != current.tools:
        return missed("tools_changed", 0)
    if previous.system != current.system:
        return missed("system_changed", 0)
    if previous.other != current.other:
        return {"type": "unavailable"}
    for index, (before, now) in enumerate(zip(previous.messages, current.messages)):
        if before != now:
            matched = (previous.message_ends[index - 1] if index
                       else max(previous.system_end, previous.tools_end))
            return missed("messages_changed", matched)
    return None


class DiagnosticsStore:
    """Message id -> PromptFingerprint, keyed by (tenant, id) so a tenant never sees another's ids (they
    read as `previous_message_not_found`); past the capacity the least recently used of the tenant
    holding the most goes (FairShareTable), so another tenant's traffic never drops a tenant's ids."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._items: FairShareTable[tuple[str, str], PromptFingerprint] = FairShareTable(capacity)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tenant: str, message_id: str, value: PromptFingerprint) -> None:
        self._items.put((tenant, message_id), value, tenant)

    def get(self, tenant: str, message_id: str) -> PromptFingerprint | None:
        self._items.touch((tenant, message_id))
        return self._items.get((tenant, message_id))

    def diagnose(self, tenant: str, previous_message_id: str, current: PromptFingerprint
                 ) -> dict[str, Any] | None:
        return cache_miss_reason(self.get(tenant, previous_message_id), current)
