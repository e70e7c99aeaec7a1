"""One request of a trace (DESIGN.md §4, the fields in tools/traces.py), and the synthetic token ids
the generated mixes are made of."""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB_LOW, VOCAB_HIGH = 256, 49_000  # synthetic ids stay inside SmolLM2's 49,152-token vocabulary


def synthetic_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


@dataclass(slots=True)
class TraceRequest:
    id: str
    prompt_token_ids: list[int] | None
    prompt: str | None
    arrival: float | None = None
    max_tokens: int | None = None
    session: str | None = None
    cache_salt: str | None = None  # namespace: equal tokens of different salts never share pages
    tenant: str | None = None  # the server's per-API-key namespace, combined with the salt
    cache_breakpoints: list[tuple[int, float]] | None = None  # (num_tokens, ttl_s): cache_control
    after: str | None = None  # closed loop: sent delay_s after this earlier request finishes
    delay_s: float | None = None
    continues: bool = False  # prompt = after's prompt + its output + these tokens
    tool_call: bool = False  # its answer is a tool call (held while the tool runs)

    def to_json(self) -> dict:
        line: dict = {"id": self.id}
        if self.prompt_token_ids is not None:
            line["prompt_token_ids"] = self.prompt_token_ids
        else:
            line["prompt"] = self.prompt
        for key in ("arrival", "max_tokens", "session", "cache_salt", "tenant", "after", "delay_s"):
            if getattr(self, key) is not None:
                line[key] = getattr(self, key)
        for key in ("continues", "tool_call"):
            if getattr(self, key):
                line[key] = True
        if self.cache_breakpoints is not None:
            line["cache_breakpoints"] = [{"num_tokens": n, "ttl_s": ttl} for n, ttl in self.cache_breakpoints]
        return line
