"""`kvserve simulate`: replays through the real KVCacheManager hit what an independent brute-force
ideal says they can; the midprompt mistake is named; radix never trails hash by more than a point.

How the ideals are compared, page by page as the cache works (each ideal is capped at len - 1: the
last prompt token is always computed):
  - token ideal: longest prefix shared with any earlier request of the namespace. Radix at page
    size 1 has no partial pages, so it must equal this ideal, even with requests overlapping.
  - hash ideal: the full pages of the token ideal. Hash at page size 16 must equal it.
  - radix ideal at page size 16: the token ideal, but only as far as the earlier request's FULL pages
    reach (prompt + generated tokens, so its last prompt page counts once generation filled it). This
    needs each earlier request finished, so that comparison replays the trace one request at a time.
"""

from __future__ import annotations

import argparse
import io
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import ConfigError
from kvserve.tools.simulate import (
    RunResult,
    SimRequest,
    add_simulate_arguments,
    analyze,
    compare_runs,
    compute_ideals,
    find_hidden_spans,
    main_simulate,
    prepare,
    render_simulation,
    replay,
)
from kvserve.tools.traces import (
    MIDPROMPT_HEADER_TOKENS,
    MIDPROMPT_SYSTEM_TOKENS,
    TraceRequest,
    encode_prompts,
    generate_trace,
    write_trace,
)


def mix(name: str, n: int, seed: int = 0, sequential: bool = False) -> list[SimRequest]:
    trace = generate_trace(name, n, seed)
    requests = prepare(trace, encode_prompts(trace))
    if sequential:
        for r in requests:
            r.arrival = None
    return requests


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def brute_force_ideals(requests: list[SimRequest], page_size: int) -> dict[str, float]:
    """O(n^2) over pairs, written independently of simulate.compute_ideals."""
    token = hashed = radix = total = 0
    for i, r in enumerate(requests):
        n = len(r.token_ids)
        earlier = [q for q in requests[:i] if q.namespace == r.namespace]
        shared = [common_prefix(r.token_ids, q.token_ids) for q in earlier]
        longest = max(shared, default=0)
        token += min(longest, n - 1)
        hashed += min(longest // page_size * page_size, n - 1)
        # the server computes the prompt and every generated token but the last (sampled, never fed back)
        filled = [(len(q.token_ids) + max(0, q.num_generated - 1)) // page_size * page_size for q in earlier]
        radix += min(max((min(s, f) for s, f in zip(shared, filled)), default=0), n - 1)
        total += n
    return {"token": token / total, "hash": hashed / total, "radix": radix / total}


def sim_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    return parser.parse_args(list(argv))


def run_cli(capsys, *argv: str) -> str:
    assert main_simulate(sim_args(*argv)) == 0
    return capsys.readouterr().out


# -- must show 3: unbounded replay == independent ideal ---------------------------------------------
@pytest.mark.parametrize("name, n", [("agent-steps", 40), ("multiturn", 36), ("rag", 60)])
def test_unbounded_hit_rate_equals_the_independent_ideal(name, n):
    requests = mix(name, n, seed=11)
    ideal_1 = brute_force_ideals(requests, 1)
    ideal_16 = brute_force_ideals(requests, 16)
    assert ideal_16["hash"] < ideal_16["radix"] <= ideal_16["token"] == ideal_1["token"]

    radix_1 = replay(requests, "radix", 1, check_invariants=True)
    hash_16 = replay(requests, "hash", 16, check_invariants=True)
    assert radix_1.num_evictions == hash_16.num_evictions == 0
    assert radix_1.hit_rate == pytest.approx(ideal_1["token"], abs=0.005)
    assert hash_16.hit_rate == pytest.approx(ideal_16["hash"], abs=0.005)

    one_at_a_time = [SimRequest(r.id, r.token_ids, r.namespace, None, r.num_generated) for r in requests]
    radix_16 = replay(one_at_a_time, "radix", 16, check_invariants=True)
    assert radix_16.hit_rate == pytest.approx(ideal_16["radix"], abs=0.005)
    # overlapping, a request may start before an earlier one filled its last prompt page: between the two
    overlapping = replay(requests, "radix", 16).hit_rate
    assert ideal_16["hash"] - 0.005 <= overlapping <= ideal_16["radix"] + 0.005


def test_reported_ideals_match_the_brute_force_ones():
    requests = mix("agent-steps", 30, seed=3)
    result = analyze(requests, ["hash", "radix"], [16], [None])
    brute = brute_force_ideals(requests, 16)
    assert result["ideal_hit_rate"] == pytest.approx(brute["token"], abs=1e-12)
    attainable = {r["policy"]: r["attainable_hit_rate"] for r in result["runs"]}
    assert attainable == pytest.approx({"hash": brute["hash"], "radix": brute["radix"]}, abs=1e-12)


def test_namespaces_are_the_servers_tenant_then_salt():
    tokens = list(range(100, 164))
    trace = [TraceRequest("plain", tokens, None), TraceRequest("salted", tokens, None, cache_salt="s"),
             TraceRequest("tenant", tokens, None, tenant="acme"),
             TraceRequest("both", tokens, None, cache_salt="s", tenant="acme"),
             TraceRequest("salted-again", tokens, None, cache_salt="s")]
    requests = prepare(trace, [r.prompt_token_ids for r in trace])
    assert [r.namespace for r in requests] == ["", "s", "acme\x00", "acme\x00s", "s"]  # engine.add_request's rule
    assert replay(requests, "radix", 16, check_invariants=True).prefix_cache_hits == 63  # only salted-again


def test_namespaces_never_share():
    tokens = list(range(100, 164))
    requests = [SimRequest("a", tokens, "tenant-a"), SimRequest("b", tokens, "tenant-b"),
                SimRequest("c", tokens, "tenant-a")]
    run = replay(requests, "radix", 16, check_invariants=True)
    assert run.prefix_cache_hits == 63  # only c, from a; b is another tenant
    assert compute_ideals(requests, [16]).token == [0, 0, 63]


# -- must show 3: the midprompt mistake ------------------------------------------------------------------
def test_midprompt_hits_about_nothing_and_the_span_is_named(tmp_path, capsys):
    path = tmp_path / "mid.jsonl"
    run_cli(capsys, "--generate", "midprompt", "-n", "40", "--seed", "2", "-o", str(path))
    result = json.loads(run_cli(capsys, str(path), "--json"))
    assert all(r["hit_rate"] < 0.01 for r in result["runs"])
    assert result["ideal_hit_rate"] < 0.01
    span = result["diagnosis"]["hidden_spans"][0]
    assert (span["offset"], span["min_offset"], span["max_offset"]) == (MIDPROMPT_HEADER_TOKENS,) * 3
    assert span["length"] == MIDPROMPT_SYSTEM_TOKENS
    assert span["num_requests"] == 40
    assert span["hit_rate_if_moved_to_front"] > 0.9
    assert f"offset {MIDPROMPT_HEADER_TOKENS}" in result["recommendation"]["text"]


def test_spans_at_varying_offsets_are_found_and_prefix_shared_ones_are_not():
    rng = random.Random(5)
    system = [rng.randrange(1000, 2000) for _ in range(200)]
    requests = []
    for i in range(12):
        header = [rng.randrange(1000, 2000) for _ in range(3 + i)]  # the offset varies
        requests.append(SimRequest(f"r{i}", header + system + [rng.randrange(1000, 2000) for _ in range(20)]))
    ideals = compute_ideals(requests, [16])
    (span,) = find_hidden_spans(requests, ideals.shared, min_length=64)
    assert (span.length, span.min_offset, span.max_offset, span.num_requests) == (200, 3, 14, 12)
    prefixed = [SimRequest(f"p{i}", system + [i + 5000] * 30) for i in range(12)]
    assert find_hidden_spans(prefixed, compute_ideals(prefixed, [16]).shared) == []


# -- must show 4: radix >= hash - 1 point, and why ------------------------------------------------------
@pytest.mark.parametrize("name", ["agent-steps", "multiturn", "rag", "w1", "midprompt"])
def test_radix_is_never_a_point_below_hash_on_the_mixes(name):
    requests = mix(name, 40, seed=21)
    for page_size in (16, 64):
        for capacity in (None, 8192, 16384):
            pages = None if capacity is None else capacity // page_size
            radix = replay(requests, "radix", page_size, pages)
            hashed = replay(requests, "hash", page_size, pages)
            assert radix.hit_rate >= hashed.hit_rate - 0.01, (page_size, capacity)


@st.composite
def small_traces(draw):
    """Requests drawn from a few shared prefixes over a 4-token alphabet (so prefixes collide and
    diverge inside pages), some in a second namespace, with or without arrivals, and a pool of at
    least four times the largest request."""
    alphabet = st.integers(0, 3)
    prefixes = draw(st.lists(st.lists(alphabet, max_size=40), min_size=1, max_size=3))
    timed = draw(st.booleans())
    requests, t = [], 0.0
    for i in range(draw(st.integers(2, 24))):
        tokens = draw(st.sampled_from(prefixes)) + draw(st.lists(alphabet, min_size=1, max_size=30))
        t += draw(st.floats(0.0, 3.0))
        requests.append(SimRequest(f"r{i}", tokens, draw(st.sampled_from(["", "", "b"])),
                                   t if timed else None, draw(st.sampled_from([0, 0, 5, 20]))))
    page_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    biggest = max(-(-(len(r.token_ids) + r.num_generated) // page_size) for r in requests)
    pages = draw(st.one_of(st.none(), st.integers(4 * biggest, 12 * biggest)))
    return requests, page_size, pages


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_traces())
def test_radix_is_never_a_point_below_hash_on_random_small_traces(case):
    requests, page_size, pages = case
    radix = replay(requests, "radix", page_size, pages, check_invariants=True)
    hashed = replay(requests, "hash", page_size, pages, check_invariants=True)
    assert radix.prefix_cache_queries == hashed.prefix_cache_queries
    assert radix.hit_rate >= hashed.hit_rate - 0.01


def test_committing_into_the_start_of_a_cached_run_does_not_refresh_the_rest():
    """Found by fuzzing replays like the random test above. B ends one token into page 2 of A's cached run, so its commit
    finds that page cached; only that page was used, so the rest of A's run must keep its old
    recency, and C's allocation must evict it (as hash does) rather than X, which X2 then reuses."""
    a, x, c = list(range(100, 140)), list(range(200, 240)), list(range(300, 340))
    requests = [SimRequest("A", a), SimRequest("X", x), SimRequest("B", a[:12]), SimRequest("C", c),
                SimRequest("X2", x)]
    radix = replay(requests, "radix", 4, 22, check_invariants=True)
    hashed = replay(requests, "hash", 4, 22, check_invariants=True)
    assert radix.hit_rate >= hashed.hit_rate - 0.01


def test_where_radix_is_higher_the_report_says_token_granular_tail_hits():
    result = analyze(mix("rag", 40, seed=4), ["hash", "radix"], [64], [None])
    (comparison,) = result["comparisons"]
    assert comparison["delta_points"] > 1
    assert comparison["token_granular_tail_points"] == pytest.approx(comparison["delta_points"], abs=0.01)
    assert "token-granular tail hits" in comparison["reason"] and "eviction order" not in comparison["reason"]


def test_full_page_differences_are_reported_as_eviction_order():
    def run(policy: str, hits: int, partial: int) -> RunResult:
        return RunResult(policy, 16, 4096, 256, hits / 1000, 1.0, 1000, hits, partial, 10, 100, 1600, 10, 0)

    comparison = compare_runs(run("radix", 500, 20), run("hash", 450, 0))
    assert comparison["delta_points"] == pytest.approx(5.0)
    assert comparison["token_granular_tail_points"] == pytest.approx(2.0)
    assert comparison["eviction_order_points"] == pytest.approx(3.0)
    assert "+2.0 points from token-granular tail hits" in comparison["reason"]
    assert "+3.0 points from eviction order" in comparison["reason"]


# -- the report and the command line ---------------------------------------------------------------------
def test_json_keys_are_stable(capsys):
    result = json.loads(run_cli(capsys, "w1", "-n", "12", "--page-size", "16,64", "--capacity-tokens",
                                "8k,unbounded", "--json"))
    assert list(result) == ["trace", "service_model", "scheduler", "ideal_hit_rate", "runs", "tool_call_holds",
                            "comparisons", "diagnosis", "recommendation"]
    assert len(result["runs"]) == 2 * 2 * 2 and len(result["comparisons"]) == 4
    assert set(result["runs"][0]) >= {"policy", "page_size", "capacity_tokens", "hit_rate", "attainable_hit_rate",
                                      "prefix_cache_queries", "prefix_cache_hits", "num_evictions",
                                      "peak_pages_used", "num_requests_unservable"}
    assert set(result["recommendation"]) >= {"policy", "page_size", "capacity_tokens", "target_hit_rate",
                                             "target_reachable", "hit_rate_at_capacity", "text"}
    assert result["runs"][0]["capacity_tokens"] == 8192


def test_recommended_capacity_reaches_the_target_without_waiting():
    requests = mix("w1", 16, seed=1)
    rec = analyze(requests, ["hash", "radix"], [16], [None], target_hit_rate=0.9)["recommendation"]
    assert rec["target_reachable"] and rec["policy"] == "radix"
    run = replay(requests, "radix", 16, rec["capacity_tokens"] // 16)
    assert run.hit_rate >= 0.9 and run.num_requests_waited == 0
    assert rec["capacity_tokens"] < 16 * sum(len(r.token_ids) + r.num_generated for r in requests) // 16


def test_rich_report_names_the_hidden_span(capsys):
    from rich.console import Console

    result = analyze(mix("midprompt", 20, seed=3), ["hash", "radix"], [16], [None])
    out = io.StringIO()
    render_simulation(result, Console(file=out, width=200))
    text = out.getvalue()
    assert "hidden span" in text and f"offset {MIDPROMPT_HEADER_TOKENS}" in text and "recommendation" in text


def test_a_pool_smaller_than_a_request_marks_it_unservable():
    requests = [SimRequest("big", list(range(100, 200))), SimRequest("small", list(range(100, 110)))]
    run = replay(requests, "hash", 16, 4, check_invariants=True)
    assert run.unservable_request_ids == ["big"] and run.num_requests_served == 1


@pytest.mark.parametrize("argv, message", [
    ((), "give a trace file"),
    (("--generate", "rag"), "needs -o FILE"),
    (("w1", "--policy", "lru"), "--policy 'lru'"),
    (("w1", "--page-size", "24"), "power of two"),
    (("w1", "--capacity-tokens", "8"), "less than one page"),
    (("w1", "--capacity-tokens", "lots"), "cannot read token count"),
    (("w1", "--target-hit-rate", "1.5"), "--target-hit-rate"),
    (("/no/such/trace.jsonl",), "cannot read trace"),
])
def test_bad_input_is_a_one_line_config_error(argv, message):
    with pytest.raises(ConfigError, match=message) as err:
        main_simulate(sim_args(*argv))
    assert "\n" not in str(err.value)


def test_arrivals_on_some_lines_only_is_a_config_error(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace([TraceRequest("a", [1, 2, 3], None, 0.5), TraceRequest("b", [1, 2, 4], None)], path)
    with pytest.raises(ConfigError, match="1 of 2 trace requests have no arrival"):
        main_simulate(sim_args(str(path)))


def test_prefixes_shorter_than_a_page_are_reported():
    rng = random.Random(9)
    header = [7] * 10  # e.g. a chat template's opening, then everything differs
    requests = [SimRequest(f"r{i}", header + [rng.randrange(1000, 2000) for _ in range(30)]) for i in range(10)]
    result = analyze(requests, ["hash", "radix"], [16, 8], [None])
    short16, short8 = result["diagnosis"]["short_prefixes"]
    assert (short16["page_size"], short16["num_requests"], short16["median_shared_tokens"]) == (16, 9, 10)
    assert short8["num_requests"] == 0
    hits = {(r["policy"], r["page_size"]): r["prefix_cache_hits"] for r in result["runs"]}
    assert hits[("hash", 16)] == 0 and hits[("radix", 16)] == 90  # radix reuses the partial first page
    assert hits[("hash", 8)] == 72
    assert "a smaller page size can" in analyze(requests, ["hash"], [16], [None])["recommendation"]["text"]
