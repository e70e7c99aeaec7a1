"""The agent trace (`--workload agent`, issue 26): closed tool loops as an agent client sends them,
beside other users' traffic, in synthetic token ids, the same for the same (n, seed).

A session's every call sends the same system prompt and ~4k tokens of tool definitions, then its task
(the user's request with its context: an issue, a file), then each earlier tool call (the model's own
output: the line `continues` the previous one) and that tool's result between the template's turn
markers, `delay_s` (the tool's latency, lognormal) after the previous answer. Other users' unrelated
requests come from closed loops too (a request, a think time, the next one), so they keep the pool
churning at whatever speed the engine runs.
"""

from __future__ import annotations

import math
import random

from kvserve.tools.trace_line import TraceRequest, synthetic_tokens

AGENT_SYSTEM_TOKENS, AGENT_TOOL_TOKENS = 300, 3800
AGENT_KINDS = 1  # agents (apps) with a system prompt and tool definitions of their own
AGENT_TASK_TOKENS, AGENT_RESULT_TOKENS, AGENT_TURNS = (1500, 2500), (150, 400), (4, 6)
AGENT_CALL_MAX_TOKENS, AGENT_ANSWER_MAX_TOKENS = 64, 32  # a forced call ends itself well before 64
TOOL_LATENCY_MEDIAN_S, TOOL_LATENCY_SIGMA, TOOL_LATENCY_MAX_S = 12.0, 0.4, 25.0  # lognormal, capped
AGENT_SESSION_GAP_S = 25.0  # mean time between session starts (uniform, 0.5-1.5x)
OTHER_CLIENTS, OTHER_PROMPT_TOKENS, OTHER_MAX_TOKENS, OTHER_THINK_S = 2, (1000, 2000), 16, (0.2, 1.0)
_EST_TURN_S, _EST_OTHER_S = 3.0, 3.0  # for the line order only (the run decides the real times)


def tool_latency(rng: random.Random) -> float:
    return round(min(TOOL_LATENCY_MAX_S, rng.lognormvariate(math.log(TOOL_LATENCY_MEDIAN_S), TOOL_LATENCY_SIGMA)), 3)


def _agent_session(rng: random.Random, s: int, start: float, prefix: list[int],
                   markers: tuple[list[int], list[int]]) -> list[tuple[float, TraceRequest]]:
    """One session: (estimated send time, line) for each call, the first at `start`."""
    to_tool, to_assistant = markers
    turns = rng.randint(*AGENT_TURNS)
    first = TraceRequest(f"agent-s{s}-t0", prefix + synthetic_tokens(rng, rng.randint(*AGENT_TASK_TOKENS)), None,
                         round(start, 3), AGENT_CALL_MAX_TOKENS, f"agent-s{s}", tool_call=True)
    lines, t = [(start, first)], start
    for k in range(1, turns):
        delay = tool_latency(rng)
        t += _EST_TURN_S + delay
        last = k == turns - 1
        lines.append((t, TraceRequest(
            f"agent-s{s}-t{k}", to_tool + synthetic_tokens(rng, rng.randint(*AGENT_RESULT_TOKENS)) + to_assistant,
            None, None, AGENT_ANSWER_MAX_TOKENS if last else AGENT_CALL_MAX_TOKENS, f"agent-s{s}",
            after=lines[-1][1].id, delay_s=delay, continues=True, tool_call=not last)))
    return lines


def _other_client(rng: random.Random, c: int, horizon: float) -> list[tuple[float, TraceRequest]]:
    """Another user's requests up to `horizon`: each sent a think time after the last one finished."""
    def prompt() -> list[int]:
        return synthetic_tokens(rng, rng.randint(*OTHER_PROMPT_TOKENS))

    t = rng.uniform(0.0, 2.0)
    lines = [(t, TraceRequest(f"other-c{c}-0", prompt(), None, round(t, 3), OTHER_MAX_TOKENS, f"other-c{c}"))]
    while t < horizon:
        think = round(rng.uniform(*OTHER_THINK_S), 3)
        t += _EST_OTHER_S + think
        lines.append((t, TraceRequest(f"other-c{c}-{len(lines)}", prompt(), None, None, OTHER_MAX_TOKENS,
                                      f"other-c{c}", after=lines[-1][1].id, delay_s=think)))
    return lines


def agent_trace(rng: random.Random, n: int) -> list[TraceRequest]:
    """The first n lines by estimated send time (a line's `after` always before it). Each session and
    each other user draws from a generator of its own, so a longer trace starts with a shorter one."""
    prefixes = [synthetic_tokens(rng, AGENT_SYSTEM_TOKENS) + synthetic_tokens(rng, AGENT_TOOL_TOKENS)
                for _ in range(AGENT_KINDS)]
    markers = (synthetic_tokens(rng, 4), synthetic_tokens(rng, 4))  # <|im_end|> <|im_start|>tool / assistant
    base = rng.random()
    horizon = 30.0
    while True:  # lines sent before the horizon are the same whatever the horizon
        starts, lines, s = random.Random(f"{base}:starts"), [], 0
        start = starts.uniform(0.0, AGENT_SESSION_GAP_S)
        while start <= horizon:
            session_rng = random.Random(f"{base}:session:{s}")
            lines += _agent_session(session_rng, s, start, session_rng.choice(prefixes), markers)
            start, s = start + starts.uniform(0.5, 1.5) * AGENT_SESSION_GAP_S, s + 1
        for c in range(OTHER_CLIENTS):
            lines += _other_client(random.Random(f"{base}:other:{c}"), c, horizon)
        if sum(t <= horizon for t, _ in lines) >= n:
            break
        horizon *= 2
    lines.sort(key=lambda line: line[0])
    kept = [line for _, line in lines[:n]]
    last_turn = {r.session: r for r in kept if r.session.startswith("agent-")}
    for r in last_turn.values():  # a session cut short ends with an answer, not a call left waiting
        r.tool_call, r.max_tokens = False, AGENT_ANSWER_MAX_TOKENS
    return kept
