"""KV kept while a tool runs, on the server's side: which engine lease holds the conversation that a
tool call id came from, per tenant, so the request that brings the tool's result names the holds it
ends; and the one rule for settling a finished answer's hold (kept when the answer is a tool call,
released at once when it is not). The engine grants the hold at finish (scheduler._hold)."""

from __future__ import annotations

import time
from typing import Any

from kvserve.cache.fair_table import FairShareTable
from kvserve.request import RequestOutput, ToolCallKV

MAX_IDS = 50_000  # remembered tool call ids: past these, the oldest of the tenant holding the most go
STORED_RESPONSE_HOLD_S = 300.0  # a stored response's conversation: OpenAI's in-memory 5 minutes


class ToolHolds:
    def __init__(self, engine, ttl_s: float, scale: float = 1.0) -> None:
        self.engine = engine  # AsyncEngine
        self.ttl_s = ttl_s  # --tool-call-kv-ttl (scaled): 0 is off
        self.stored_ttl_s = STORED_RESPONSE_HOLD_S * scale  # a stored response's hold (scaled)
        # (tenant, call id) -> (lease id, expiry): another tenant's calls never push a tenant's out
        self._by_call: FairShareTable[tuple[str, str], tuple[str, float]] = FairShareTable(MAX_IDS)

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def request_kv(self, tenant: str, answered_ids: list[str], hold: bool, stored: bool = False
                   ) -> ToolCallKV | None:
        """What a chat request with tools asks of the engine: hold its own KV when it finishes
        (`hold`) and end the holds of the calls whose results it brings. `stored`: the hold is a
        stored response's (STORED_RESPONSE_HOLD_S, whether or not tool-call holds are on)."""
        now = time.monotonic()
        answers = []
        for call_id in answered_ids:
            found = self._by_call.get((tenant, call_id))
            if found is not None and found[1] > now and found[0] not in answers:
                answers.append(found[0])
        if stored:
            return ToolCallKV(hold=True, answers=tuple(answers), hold_s=self.stored_ttl_s)
        if not (self.enabled and hold) and not answers:
            return None
        return ToolCallKV(hold=self.enabled and hold, answers=tuple(answers))

    async def release(self, tenant: str, key: str) -> bool:
        """End the hold kept under `key` now (a deleted stored response); False when there is none."""
        found = self._by_call.pop((tenant, key))
        if found is None or found[1] <= time.monotonic():
            return False
        await self.engine.call(lambda: self.engine.engine.release_lease(tenant, found[0]))
        return True

    async def settle(self, tenant: str, output: RequestOutput, call_ids: list[str],
                     stored: bool = False) -> dict[str, Any] | None:
        """After the answer finished: keep its hold under its tool call ids, or release it (no
        call). Returns what kv_explain shows about it."""
        lease_id = output.held_lease_id
        if lease_id is None:
            return None if output.hold_refused is None else {"held": False, "refused": output.hold_refused}
        if not call_ids:
            await self.engine.call(lambda: self.engine.engine.release_lease(tenant, lease_id))
            return {"held": False, "refused": None, "reason": "no_tool_call"}
        expires = time.monotonic() + (self.stored_ttl_s if stored else self.ttl_s)
        for call_id in call_ids:
            self._by_call.put((tenant, call_id), (lease_id, expires), tenant)
        return {"held": True, "lease_id": lease_id, "ttl_s": self.stored_ttl_s if stored else self.ttl_s,
                "tool_call_ids": list(call_ids)}
