"""Trace requests resolved to token ids and namespaces, in the order the simulator replays them."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.cache.hashing import namespace
from kvserve.cache.leases import Breakpoint
from kvserve.config import ConfigError
from kvserve.tools.traces import TraceRequest


@dataclass(slots=True)
class SimRequest:
    """One request to replay. `num_generated` is its max_tokens (0: only the prompt is computed)."""

    id: str
    token_ids: list[int]
    namespace: str = ""
    arrival: float | None = None
    num_generated: int = 0
    breakpoints: tuple[Breakpoint, ...] = ()  # cache_control: leased once the prompt is committed

    @property
    def num_computed(self) -> int:
        """Tokens whose KV the server computes and commits: the prompt and every generated token but
        the last (it is sampled, never fed back)."""
        return len(self.token_ids) + max(0, self.num_generated - 1)


def prepare(requests: list[TraceRequest], token_ids: list[list[int]], model_generation: bool = True) -> list[SimRequest]:
    """Replay order: by arrival (stable), or trace order when no request has one. The namespace is the
    server's: `namespace(tenant, cache_salt)`."""
    timed = [r.arrival is not None for r in requests]
    if any(timed) and not all(timed):
        raise ConfigError(f"{timed.count(False)} of {len(requests)} trace requests have no arrival; give "
                          "arrival on every line (overlapping replay) or on none (one at a time)")
    sims = [SimRequest(r.id, ids, namespace(r.tenant or "", r.cache_salt), r.arrival,
                       (r.max_tokens or 0) if model_generation else 0,
                       tuple(Breakpoint(n, ttl) for n, ttl in r.cache_breakpoints or ()))
            for r, ids in zip(requests, token_ids)]
    if len({s.id for s in sims}) != len(sims):
        raise ConfigError("trace request ids must be unique")
    return sorted(sims, key=lambda s: s.arrival or 0.0)


def pages_needed(request: SimRequest, page_size: int) -> int:
    return -(-(len(request.token_ids) + request.num_generated) // page_size)


def unbounded_pages(requests: list[SimRequest], page_size: int) -> int:
    """Enough pages that no request ever waits and no cached page is ever evicted."""
    return sum(pages_needed(r, page_size) for r in requests) + 1
