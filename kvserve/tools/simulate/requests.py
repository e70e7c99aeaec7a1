"""Trace requests resolved to token ids and namespaces, in the order the simulator replays them; a
line that continues a conversation gets the whole prompt it will send: the earlier request's prompt, the
output the replay will generate for it (synthetic ids, `synthetic_output`) and its own tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvserve.cache.hashing import namespace
from kvserve.cache.leases import Breakpoint
from kvserve.config import ConfigError
from kvserve.tools.traces import TraceRequest

GENERATED_ID_BASE = 1 << 40  # synthetic generated-token ids: above any vocabulary, unique per request
END_OF_TURN_ID = GENERATED_ID_BASE - 1  # ends a tool call's answer (a stop, as a model's end of turn)


@dataclass(slots=True)
class SimRequest:
    """One request to replay. `num_generated` is its max_tokens (0: only the prompt is computed)."""

    id: str
    token_ids: list[int]
    namespace: str = ""
    arrival: float | None = None
    num_generated: int = 0
    breakpoints: tuple[Breakpoint, ...] = ()  # cache_control: leased once the prompt is committed
    after: str | None = None  # closed loop: added delay_s after this request finishes (no arrival)
    delay_s: float = 0.0
    continues: bool = False  # token_ids start with after's prompt and output
    tool_call: bool = False  # its answer is a tool call: it ends in END_OF_TURN_ID, its KV may be held

    @property
    def num_computed(self) -> int:
        """Tokens whose KV the server computes and commits: the prompt and every generated token but
        the last (it is sampled, never fed back)."""
        return len(self.token_ids) + max(0, self.num_generated - 1)


def prepare(requests: list[TraceRequest], token_ids: list[list[int]], model_generation: bool = True) -> list[SimRequest]:
    """Replay order: by arrival (stable), or trace order when no request has one; the closed-loop
    lines (`after`) last, in trace order. The namespace is the server's: `namespace(tenant, cache_salt)`."""
    roots = [r for r in requests if r.after is None]
    timed = [r.arrival is not None for r in roots]
    if any(timed) and not all(timed):
        raise ConfigError(f"{timed.count(False)} of {len(roots)} trace requests have no arrival; give "
                          "arrival on every line (overlapping replay) or on none (one at a time)")
    if len(roots) < len(requests) and not all(timed):
        raise ConfigError("a trace with `after` lines replays at arrival times: give arrival on every "
                          "line without after")
    sims = [SimRequest(r.id, ids, namespace(r.tenant or "", r.cache_salt), r.arrival,
                       (r.max_tokens or 0) if model_generation else 0,
                       tuple(Breakpoint(n, ttl) for n, ttl in r.cache_breakpoints or ()),
                       r.after, r.delay_s or 0.0, r.continues, r.tool_call)
            for r, ids in zip(requests, token_ids)]
    if len({s.id for s in sims}) != len(sims):
        raise ConfigError("trace request ids must be unique")
    ordered = sorted((s for s in sims if s.after is None), key=lambda s: s.arrival or 0.0)
    ordered += [s for s in sims if s.after is not None]
    stride, position = output_stride(ordered), {s.id: i for i, s in enumerate(ordered)}
    by_id = {s.id: s for s in ordered}
    for s in ordered:
        if s.continues:
            parent = by_id[s.after]
            s.token_ids = parent.token_ids + synthetic_output(position[parent.id], stride, parent) + s.token_ids
    return ordered


def output_stride(requests: list[SimRequest]) -> int:
    return max((r.num_generated for r in requests), default=0) + 1


def synthetic_token(position: int, stride: int, request: SimRequest, k: int) -> int:
    """The k-th token the replay samples for the request at `position`: unique to it, the last one of
    a tool call's answer its end of turn."""
    if request.tool_call and k == max(1, request.num_generated) - 1:
        return END_OF_TURN_ID
    return GENERATED_ID_BASE + position * stride + k


def synthetic_output(position: int, stride: int, request: SimRequest) -> list[int]:
    return [synthetic_token(position, stride, request, k) for k in range(max(1, request.num_generated))]


def follow_ups(requests: list[SimRequest]) -> Iterator[SimRequest]:
    """The lines that continue a conversation (an agent's calls after its first)."""
    return (r for r in requests if r.continues)


def pages_needed(request: SimRequest, page_size: int) -> int:
    return -(-(len(request.token_ids) + request.num_generated) // page_size)


def unbounded_pages(requests: list[SimRequest], page_size: int) -> int:
    """Enough pages that no request ever waits and no cached page is ever evicted."""
    return sum(pages_needed(r, page_size) for r in requests) + 1
