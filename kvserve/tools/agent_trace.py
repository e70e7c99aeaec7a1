"""The agent trace (`--workload agent` and `agent-small`, issue 26): closed tool loops as an agent
client sends them, beside other users' traffic, in synthetic token ids, the same for the same (n, seed).

A session's every call sends the same system prompt and tool definitions (~4k tokens; 1k in
agent-small), then its task (the user's request with its context: an issue, a file), then each
earlier tool call (the model's own output: the line `continues` the previous one) and that tool's
result between the template's turn markers, `delay_s` (the tool's latency, lognormal) after the
previous answer. Other users' unrelated requests come from closed loops too (a request, a think time,
the next one), so they keep the pool churning at whatever speed the engine runs.

Two shapes: AGENT_SHAPE (`agent`), the issue's scale (4.1k tokens of system prompt and tools, 4-6
calls a session, two other users); SMALL_AGENT_SHAPE (`agent-small`), sized so that `kvserve bench
--workload agent-small --vs no-tool-holds` runs in minutes on a 2-core host (docs/simulate.md, "The
agent bench"): 1k tokens of tools there, since every follow-up that loses its conversation is
computed again at this host's 60-150 prompt tokens/s.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from kvserve.tools.trace_line import TraceRequest, synthetic_tokens


@dataclass(frozen=True, slots=True)
class AgentShape:
    """The agent trace's knobs; the estimated rates only order the lines (which are in the first n):
    a run decides the real times."""

    system_tokens: int = 300
    tool_tokens: int = 3800
    task_tokens: tuple[int, int] = (1500, 2500)
    result_tokens: tuple[int, int] = (150, 400)
    turns: tuple[int, int] = (4, 6)  # calls a session makes, the last one its answer
    call_max_tokens: int = 64  # a forced call ends itself well before 64
    answer_max_tokens: int = 32
    tool_latency_median_s: float = 12.0
    tool_latency_sigma: float = 0.4
    tool_latency_max_s: float = 25.0
    session_gap_s: float = 25.0  # mean time between session starts (uniform, 0.5-1.5x)
    other_clients: int = 2
    other_prompt_tokens: tuple[int, int] = (1000, 2000)
    other_max_tokens: int = 16
    other_think_s: tuple[float, float] = (0.2, 1.0)
    est_prefill_tps: float = 500.0
    est_decode_tps: float = 15.0

    @property
    def prefix_tokens(self) -> int:
        """The system prompt and tool definitions every call starts with."""
        return self.system_tokens + self.tool_tokens


AGENT_SHAPE = AgentShape()
# `kvserve bench --workload agent-small` on 2 cores (picked with `kvserve simulate`, docs/simulate.md):
# one or two agents at a time on a 3k-token pool; a tool runs ~40 s, in which the other user's
# back-to-back 300-600-token prompts write about the whole pool, so a conversation nobody holds is
# evicted and one held (1k + ~1k tokens, under a 0.85 lease cap) survives.
SMALL_AGENT_SHAPE = AgentShape(
    system_tokens=100, tool_tokens=900, task_tokens=(600, 900), result_tokens=(60, 150), turns=(3, 3),
    call_max_tokens=32, answer_max_tokens=16, tool_latency_median_s=40.0, tool_latency_sigma=0.15,
    tool_latency_max_s=56.0, session_gap_s=70.0, other_clients=1, other_prompt_tokens=(300, 600),
    other_max_tokens=8, other_think_s=(0.5, 1.5), est_prefill_tps=70.0, est_decode_tps=5.0)


def tool_latency(rng: random.Random, shape: AgentShape = AGENT_SHAPE) -> float:
    draw = rng.lognormvariate(math.log(shape.tool_latency_median_s), shape.tool_latency_sigma)
    return round(min(shape.tool_latency_max_s, draw), 3)


def _agent_session(rng: random.Random, s: int, start: float, prefix: list[int],
                   markers: tuple[list[int], list[int]], shape: AgentShape) -> list[tuple[float, TraceRequest]]:
    """One whole session: (estimated send time, line) for each call, the first at `start`."""
    to_tool, to_assistant = markers
    turns = rng.randint(*shape.turns)
    task = synthetic_tokens(rng, rng.randint(*shape.task_tokens))
    first = TraceRequest(f"agent-s{s}-t0", prefix + task, None, round(start, 3), shape.call_max_tokens,
                         f"agent-s{s}", tool_call=turns > 1)
    lines, t = [(start, first)], start + len(task) / shape.est_prefill_tps
    for k in range(1, turns):
        delay = tool_latency(rng, shape)
        result = to_tool + synthetic_tokens(rng, rng.randint(*shape.result_tokens)) + to_assistant
        t += shape.call_max_tokens / 2 / shape.est_decode_tps + delay
        last = k == turns - 1
        lines.append((t, TraceRequest(
            f"agent-s{s}-t{k}", result, None, None, shape.answer_max_tokens if last else shape.call_max_tokens,
            f"agent-s{s}", after=lines[-1][1].id, delay_s=delay, continues=True, tool_call=not last)))
        t += len(result) / shape.est_prefill_tps
    return lines


def _other_client(rng: random.Random, c: int, shape: AgentShape):
    """Another user's requests, endless: each sent a think time after the last one finished."""
    t, k, previous = rng.uniform(0.0, 2.0), 0, None
    while True:
        prompt = synthetic_tokens(rng, rng.randint(*shape.other_prompt_tokens))
        think = round(rng.uniform(*shape.other_think_s), 3)
        if previous is None:
            line = TraceRequest(f"other-c{c}-0", prompt, None, round(t, 3), shape.other_max_tokens, f"other-c{c}")
        else:
            t += think
            line = TraceRequest(f"other-c{c}-{k}", prompt, None, None, shape.other_max_tokens, f"other-c{c}",
                                after=previous, delay_s=think)
        yield t, line
        t += len(prompt) / shape.est_prefill_tps + shape.other_max_tokens / shape.est_decode_tps
        k, previous = k + 1, line.id


def agent_trace(rng: random.Random, n: int, shape: AgentShape = AGENT_SHAPE) -> list[TraceRequest]:
    """n lines: as many whole sessions as fit beside the other users' requests sent before the last
    of them ends (by the estimated times), then more of those requests up to n; in estimated send
    order (a line's `after` always before it). Each session and each other user draws from a
    generator of its own, so a shorter trace's sessions are a longer one's."""
    prefix = synthetic_tokens(rng, shape.system_tokens) + synthetic_tokens(rng, shape.tool_tokens)
    markers = (synthetic_tokens(rng, 4), synthetic_tokens(rng, 4))  # <|im_end|> <|im_start|>tool / assistant
    base = rng.random()
    starts = random.Random(f"{base}:starts")
    stream = heapq.merge(*(_other_client(random.Random(f"{base}:other:{c}"), c, shape)
                           for c in range(shape.other_clients)), key=lambda line: line[0])
    others: list[tuple[float, TraceRequest]] = []  # the other users' lines, in send order, as far as pulled

    def others_until(t: float) -> int:
        while not others or others[-1][0] <= t:
            others.append(next(stream))
        return sum(1 for sent, _ in others if sent <= t)

    sessions: list[tuple[float, TraceRequest]] = []
    start, end, s = starts.uniform(0.0, 0.5 * shape.session_gap_s), 0.0, 0
    while len(sessions) < n:
        session_rng = random.Random(f"{base}:session:{s}")
        session = _agent_session(session_rng, s, start, prefix, markers, shape)
        end_with = max(end, session[-1][0])
        if sessions and len(sessions) + len(session) + others_until(end_with) > n:
            break
        sessions += session[:n]  # (a first session longer than n is cut; its last line becomes an answer)
        start, end, s = start + starts.uniform(0.5, 1.5) * shape.session_gap_s, end_with, s + 1
    while len(others) < n - len(sessions):
        others.append(next(stream))
    kept = [line for _, line in sorted(sessions + others[:n - len(sessions)], key=lambda line: line[0])]
    last_turn = {r.session: r for r in kept if r.session.startswith("agent-")}
    for r in last_turn.values():  # a session cut short ends with an answer, not a call left waiting
        r.tool_call, r.max_tokens = False, shape.answer_max_tokens
    return kept


def small_agent_trace(rng: random.Random, n: int) -> list[TraceRequest]:
    return agent_trace(rng, n, SMALL_AGENT_SHAPE)
