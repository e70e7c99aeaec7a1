"""The agent trace (issue 26): closed tool loops as an agent client sends them (the same system prompt
and tool definitions on every call, the conversation growing by one call and one result per turn, a
tool's latency before each follow-up) beside other users' traffic; the closed-loop trace lines it is
written in; and its replay through the Scheduler and KVCacheManager, where the engine's own tool-call
holds keep the conversations through pool pressure."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import ConfigError
from kvserve.tools.agent_trace import AGENT_SHAPE, SMALL_AGENT_SHAPE
from kvserve.tools.simulate import add_simulate_arguments, main_simulate, prepare, replay
from kvserve.tools.simulate.replayer import CacheOptions, SchedulerLimits, ServiceModel
from kvserve.tools.simulate.requests import END_OF_TURN_ID, output_stride, pages_needed, synthetic_output
from kvserve.tools.traces import (TraceRequest, check_loops, encode_prompts, generate_trace, load_trace,
                                  write_trace)

PREFIX = AGENT_SHAPE.prefix_tokens


def test_every_call_sends_the_same_tools_and_each_follow_up_continues_a_call():
    trace = generate_trace("agent", 60, seed=2)
    assert [r.to_json() for r in trace] == [r.to_json() for r in generate_trace("agent", 60, seed=2)]
    assert {r.id for r in generate_trace("agent", 30, seed=2)} <= {r.id for r in trace}  # the same sessions
    check_loops(trace, "generated")  # every after names an earlier line
    by_id = {r.id: r for r in trace}
    firsts = [r for r in trace if r.session.startswith("agent-") and r.after is None]
    follow_ups = [r for r in trace if r.continues]
    others = [r for r in trace if r.session.startswith("other-")]
    assert len(firsts) >= 2 and len(follow_ups) >= 4 and len(others) >= 10
    assert len({tuple(r.prompt_token_ids[:PREFIX]) for r in firsts}) == 1  # ~4k tokens, identical every call
    assert PREFIX >= 4000 and all(len(r.prompt_token_ids) > PREFIX for r in firsts)
    for r in follow_ups:
        parent = by_id[r.after]
        assert parent.tool_call and parent.session == r.session and r.arrival is None
        assert 0 < r.delay_s <= AGENT_SHAPE.tool_latency_max_s  # the tool's latency
    assert len({r.delay_s for r in follow_ups}) > 1
    last = {}
    for r in trace:
        last[r.session] = r
    # a session ends with an answer, never a call left waiting; other users' lines never continue
    assert not any(r.tool_call for r in last.values())
    assert not any(r.continues or r.tool_call for r in others)
    assert sum(r.after is not None for r in others) >= len(others) - 3  # closed loops with think times


def test_the_small_agent_trace_is_whole_sessions_and_its_holds_survive_the_bench_pool():
    """agent-small as `kvserve bench` runs it (30 lines, docs/simulate.md): every session whole (3 calls,
    2 follow-ups), 1k tokens of system prompt and tools on each call; replayed at the bench's 3,072-token
    pool and flags at this host's speed, the holds keep each conversation and off loses most of it."""
    trace = generate_trace("agent-small", 30, seed=0)
    assert len(trace) == 30 and [r.to_json() for r in trace] == [r.to_json() for r in generate_trace("agent-small", 30)]
    sessions: dict[str, list[TraceRequest]] = {}
    for r in trace:
        sessions.setdefault(r.session, []).append(r)
    agents = {s: lines for s, lines in sessions.items() if s.startswith("agent-")}
    assert len(agents) == 2 and all(len(lines) == 3 for lines in agents.values())
    prefix = SMALL_AGENT_SHAPE.prefix_tokens
    assert len({tuple(lines[0].prompt_token_ids[:prefix]) for lines in agents.values()}) == 1 and prefix == 1000
    assert all(r.delay_s <= SMALL_AGENT_SHAPE.tool_latency_max_s for lines in agents.values() for r in lines[1:])
    requests = prepare(trace, encode_prompts(trace, "none"))
    on, off = (replay(requests, "radix", 16, 3072 // 16, ServiceModel(100.0, 7.0), check_invariants=True,
                      limits=SchedulerLimits(max_num_batched_tokens=256),
                      cache=CacheOptions(max_leased_fraction=0.85, tool_call_kv_ttl=ttl)) for ttl in (90.0, 0.0))
    assert on.num_follow_ups == off.num_follow_ups == 4
    assert on.tool_call_holds_granted == on.tool_call_holds_used == 4
    assert on.follow_up_hit_rate > 0.9 and on.follow_up_hit_rate - off.follow_up_hit_rate >= 0.4, \
        (on.follow_up_hit_rate, off.follow_up_hit_rate)


def test_loop_lines_round_trip_and_bad_ones_are_config_errors(tmp_path):
    trace = generate_trace("agent", 20, seed=1)
    path = tmp_path / "agent.jsonl"
    write_trace(trace, path)
    assert [r.to_json() for r in load_trace(path)] == [r.to_json() for r in trace]
    bad = tmp_path / "bad.jsonl"
    for lines, message in [
        ([{"id": "b", "prompt_token_ids": [1], "after": "a"}], "not an earlier request"),
        ([{"id": "a", "prompt_token_ids": [1], "arrival": 0}, {"prompt_token_ids": [2], "after": "a", "arrival": 1}],
         "has no arrival"),
        ([{"id": "a", "prompt_token_ids": [1]}, {"prompt_token_ids": [2], "continues": True}], "continues needs after"),
        ([{"id": "a", "prompt_token_ids": [1]}, {"prompt_token_ids": [2], "after": "a", "delay_s": -1}], "delay_s"),
    ]:
        bad.write_text("".join(json.dumps(line) + "\n" for line in lines))
        with pytest.raises(ConfigError, match=message):
            load_trace(bad)


def test_a_follow_up_resends_its_parents_prompt_and_output():
    trace = generate_trace("agent", 30, seed=4)
    requests = prepare(trace, encode_prompts(trace))
    position = {r.id: i for i, r in enumerate(requests)}
    by_id = {r.id: r for r in requests}
    stride = output_stride(requests)
    own = {r.id: r.prompt_token_ids for r in trace}
    for r in requests:
        if r.continues:
            parent = by_id[r.after]
            output = synthetic_output(position[parent.id], stride, parent)
            assert output[-1] == END_OF_TURN_ID  # a call's answer ends its turn
            assert r.token_ids == parent.token_ids + output + own[r.id]


def agent_replay(ttl: float, capacity_pages: int | None):
    trace = generate_trace("agent", 60, seed=0)
    requests = prepare(trace, encode_prompts(trace))
    return replay(requests, "radix", 16, capacity_pages, ServiceModel(500.0, 15.0), check_invariants=True,
                  cache=CacheOptions(max_leased_fraction=0.8, tool_call_kv_ttl=ttl))


def test_holds_keep_the_conversations_through_pool_pressure_and_change_nothing_without_it():
    on, off = agent_replay(30.0, 896), agent_replay(0.0, 896)  # 14k tokens: the other traffic churns it
    assert on.num_follow_ups == off.num_follow_ups >= 6
    # off keeps mostly the shared tool definitions; the holds keep each conversation whole
    assert on.follow_up_hit_rate > 0.9 and on.follow_up_hit_rate - off.follow_up_hit_rate >= 0.2, \
        (on.follow_up_hit_rate, off.follow_up_hit_rate)
    assert on.tool_call_holds_granted == on.tool_call_holds_used == on.num_follow_ups
    assert off.tool_call_holds_granted == 0
    assert on.num_used_pages_at_end == off.num_used_pages_at_end == 0
    assert not on.unservable_request_ids and not off.unservable_request_ids
    free_on, free_off = agent_replay(30.0, None), agent_replay(0.0, None)  # unbounded: nothing to keep
    assert free_on.follow_up_hit_rate == free_off.follow_up_hit_rate > 0.9


def test_simulate_runs_the_agent_trace_with_holds_on_and_off(capsys):
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    args = parser.parse_args(["agent", "-n", "30", "--policy", "radix", "--capacity-tokens", "16k", "--json"])
    assert main_simulate(args) == 0
    result = json.loads(capsys.readouterr().out)
    holds = result["tool_call_holds"]
    assert len(holds) == 1 and holds[0]["capacity_tokens"] == 16384 and holds[0]["num_follow_ups"] > 0
    assert holds[0]["follow_up_hit_rate_on"] >= holds[0]["follow_up_hit_rate_off"]
    assert result["runs"][0]["num_used_pages_at_end"] == 0


@st.composite
def loop_traces(draw):
    """Sessions over a 4-token alphabet (shared tools, prefixes that diverge inside pages), each a
    chain of calls that continue it (some tool calls, some not), after random delays; a pool of at
    least twice the largest request."""
    alphabet = st.integers(0, 3)
    tools = draw(st.lists(alphabet, max_size=24))
    trace = []
    for s in range(draw(st.integers(1, 4))):
        first = TraceRequest(f"s{s}-0", tools + draw(st.lists(alphabet, min_size=1, max_size=12)), None,
                             draw(st.floats(0.0, 2.0)), draw(st.integers(1, 6)), tool_call=draw(st.booleans()))
        trace.append(first)
        for k in range(1, draw(st.integers(1, 4))):
            trace.append(TraceRequest(f"s{s}-{k}", draw(st.lists(alphabet, min_size=1, max_size=10)), None,
                                      max_tokens=draw(st.integers(1, 6)), after=trace[-1].id,
                                      delay_s=draw(st.floats(0.0, 3.0)), continues=draw(st.booleans()),
                                      tool_call=draw(st.booleans())))
    trace.sort(key=lambda r: (r.after is not None, r.arrival or 0.0))  # roots first; chains keep their order
    requests = prepare(trace, encode_prompts(trace, "none"))
    page_size = draw(st.sampled_from([1, 4, 16]))
    biggest = max(pages_needed(r, page_size) for r in requests)
    return requests, page_size, draw(st.integers(2 * biggest, 6 * biggest)), draw(st.sampled_from([0.0, 0.5, 30.0]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loop_traces())
def test_closed_loops_replay_to_an_empty_pool_with_holds_ended_or_expired(case):
    requests, page_size, pages, ttl = case
    for policy in ("radix", "hash"):
        run = replay(requests, policy, page_size, pages, check_invariants=True,  # no page left in use
                     cache=CacheOptions(max_leased_fraction=0.5, tool_call_kv_ttl=ttl))
        assert run.num_requests_served == len(requests) and not run.unservable_request_ids
        assert run.tool_call_holds_used <= run.tool_call_holds_granted <= sum(r.tool_call for r in requests)
        if ttl == 0:
            assert run.tool_call_holds_granted == 0
