"""OpenAI's `prompt_cache_options` (Chat Completions and Responses, the openai SDK's current shape)
mapped onto kvserve's cache, every field honoured or refused, none ignored:

- `ttl` "30m" (default) | "12h": the minimum lifetime of the implicit breakpoint, the end of the prompt:
  a lease on the whole prompt for that long (the leases of `kv_retention` and Anthropic's
  `cache_control`: prompts under --min-cacheable-tokens get none, as OpenAI caches from 1,024 tokens;
  leases are capped by --max-leased-fraction and broken only under pressure).
- `prompt_cache_breakpoint` on a content part (openai_breakpoints.py): a lease on the prompt up to the
  end of that part, for its own ttl or the request's (at most four per request).
- `mode` "implicit" (default): the whole-prompt lease, and the explicit ones. "explicit": the explicit
  breakpoints only; without any, as OpenAI says, the request uses no prompt caching: it runs under a
  salt of its own, reusing nothing and leaving nothing another request can reuse.
- `prewarm` (Responses): compute and lease the prompt, generate nothing (the one token the engine
  computes is dropped; the response has no output items and 0 output tokens).
- `comparison_response_id` (Responses): the miss diagnostics of responses_diagnostics.py.

A Responses answer says what was applied: `prompt_cache_options: {mode, ttl, comparison_response_id}`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

TTLS = ("30m", "12h")


@dataclass(frozen=True, slots=True)
class LeaseAsk:
    """A request's ask for a lease on its whole prompt (what `kv_retention` also gives `_submit`)."""

    ttl: str  # a breakpoints.TTL_SECONDS label
    whole: bool = True  # lease the whole prompt (the implicit breakpoint)
    token_counts: tuple[tuple[int, str], ...] = ()  # (tokens, label): explicit breakpoints' prefixes


class PromptCacheOptions(BaseModel):
    """Chat Completions' `prompt_cache_options` (kvserve also takes "12h" there, as Responses does)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m", "12h"] = "30m"

    def uses_cache(self, has_breakpoints: bool) -> bool:
        """An explicit request without breakpoints uses no prompt caching (OpenAI's rule)."""
        return self.mode == "implicit" or has_breakpoints

    def lease(self, breakpoints: tuple[tuple[int, str], ...] = ()) -> LeaseAsk | None:
        """The implicit breakpoint (mode implicit) and the explicit ones (tokens, ttl label)."""
        if self.mode == "explicit" and not breakpoints:
            return None
        return LeaseAsk(self.ttl, self.mode == "implicit", breakpoints)

    def private_salt(self, cache_salt: str | None) -> str:
        """The salt of a request that uses no prompt caching (a new one each time)."""
        return f"{cache_salt or ''}:no-prompt-cache:{secrets.token_hex(8)}"


class ResponsesPromptCacheOptions(PromptCacheOptions):
    comparison_response_id: Annotated[StrictStr, Field(min_length=1, max_length=128)] | None = None
    prewarm: StrictBool = False

    def applied(self) -> dict[str, Any]:
        """What the response object reports."""
        return {"mode": self.mode, "ttl": self.ttl, "comparison_response_id": self.comparison_response_id}
