"""Stored responses (`store: true` on /v1/responses): per tenant, the response object and the
conversation it ended (the chat messages, its own output included) that a `previous_response_id`
continues. Bounded per tenant in count and bytes (the oldest go first) and expiring; a tenant only
ever finds its own."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024  # per tenant
MAX_BYTES = 64 << 20  # per tenant
TTL_S = 24 * 3600.0


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation up to and including this response's output
    prompt: Any  # what its prompt was (responses_diagnostics.PromptRecord), for cache diagnostics
    num_bytes: int
    expires: float


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES,
                 ttl_s: float = TTL_S) -> None:
        self.max_responses, self.max_bytes, self.ttl_s = max_responses, max_bytes, ttl_s
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}

    def put(self, tenant: str, response: dict[str, Any], messages: list[dict[str, Any]], prompt: Any = None) -> None:
        size = len(json.dumps(response)) + len(json.dumps(messages)) + 8 * len(getattr(prompt, "token_ids", ()))
        if size > self.max_bytes:
            return  # too large to keep at all: a follow-up by its id gets a 404
        stored = self._tenants.setdefault(tenant, OrderedDict())
        stored[response["id"]] = StoredResponse(response, messages, prompt, size, time.monotonic() + self.ttl_s)
        total = sum(s.num_bytes for s in stored.values())
        while len(stored) > self.max_responses or total > self.max_bytes:
            _, dropped = stored.popitem(last=False)
            total -= dropped.num_bytes

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        stored = self._tenants.get(tenant)
        found = stored.get(response_id) if stored else None
        if found is not None and found.expires <= time.monotonic():
            del stored[response_id]
            return None
        return found

    def delete(self, tenant: str, response_id: str) -> bool:
        stored = self._tenants.get(tenant)
        return bool(stored) and stored.pop(response_id, None) is not None
