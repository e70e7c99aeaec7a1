"""Stored responses (`store: true` on /v1/responses): per tenant, the response object and the
conversation it ended (the chat messages, its own output included) that a `previous_response_id`
continues. Bounded per tenant in count and bytes (the oldest go first) and expiring; a tenant only
ever finds its own. With a `backing` (responses_persist.py: the disk tier's directory or Redis) each one
is also written there and read back on a miss here, so it outlives a restart."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvserve.server.responses_diagnostics import PromptRecord
from kvserve.server.responses_persist import ResponseBacking

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
                 ttl_s: float = TTL_S, backing: ResponseBacking | None = None) -> None:
        self.max_responses, self.max_bytes, self.ttl_s = max_responses, max_bytes, ttl_s
        self.backing = backing  # blocking I/O: call put/get/delete off the event loop when set
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._lock = threading.Lock()  # the backing's callers run on worker threads

    def put(self, tenant: str, response: dict[str, Any], messages: list[dict[str, Any]], prompt: Any = None) -> None:
        size = len(json.dumps(response)) + len(json.dumps(messages)) + 8 * len(getattr(prompt, "token_ids", ()))
        if size > self.max_bytes:
            return  # too large to keep at all: a follow-up by its id gets a 404
        with self._lock:
            self._keep(tenant, StoredResponse(response, messages, prompt, size, time.monotonic() + self.ttl_s))
        if self.backing is not None:
            self.backing.put(tenant, response["id"], {"response": response, "messages": messages,
                                                      "prompt": _prompt_json(prompt)}, self.ttl_s)

    def _keep(self, tenant: str, found: StoredResponse) -> None:
        stored = self._tenants.setdefault(tenant, OrderedDict())
        stored[found.response["id"]] = found
        total = sum(s.num_bytes for s in stored.values())
        while len(stored) > self.max_responses or total > self.max_bytes:
            _, dropped = stored.popitem(last=False)
            total -= dropped.num_bytes

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._tenants.get(tenant)
            found = stored.get(response_id) if stored else None
            if found is not None and found.expires <= time.monotonic():
                del stored[response_id]
                return None
        if found is None and self.backing is not None:
            found = self._read_back(tenant, response_id)
        return found

    def _read_back(self, tenant: str, response_id: str) -> StoredResponse | None:
        record = self.backing.get(tenant, response_id)
        if record is None:
            return None
        try:
            found = StoredResponse(record["response"], record["messages"], _prompt_of(record.get("prompt")),
                                   len(json.dumps(record)),
                                   time.monotonic() + record["expires_at"] - time.time())
        except (KeyError, TypeError, ValueError):
            return None  # a record of another shape: as if absent
        with self._lock:
            self._keep(tenant, found)
        return found

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            stored = self._tenants.get(tenant)
            deleted = bool(stored) and stored.pop(response_id, None) is not None
        if self.backing is not None:
            deleted = self.backing.delete(tenant, response_id) or deleted
        return deleted


def _prompt_json(prompt: PromptRecord | None) -> dict[str, Any] | None:
    if prompt is None:
        return None
    return {"prompt_cache_key": prompt.prompt_cache_key, "tools": prompt.tools,
            "text_format": prompt.text_format, "token_ids": list(prompt.token_ids)}


def _prompt_of(record: dict[str, Any] | None) -> PromptRecord | None:
    if record is None:
        return None
    return PromptRecord(record["prompt_cache_key"], record["tools"], record["text_format"],
                        tuple(int(t) for t in record["token_ids"]))
