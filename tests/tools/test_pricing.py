"""`kvserve cost`: provider prompt-cache billing, call by call, against paying 1x every time."""

from __future__ import annotations

import argparse
import io
import json
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.config import ConfigError
from kvserve.tools.pricing import (
    add_cost_arguments,
    break_even_calls,
    main_cost,
    parse_duration,
    render_cost,
    run_cost,
    simulate_calls,
)


def cost_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cost_arguments(parser)
    return parser.parse_args(list(argv))


def cost(*argv: str) -> dict:
    return run_cost(cost_args(*argv))


def ttl(result: dict, name: str) -> dict:
    return next(e for e in result["ttls"] if e["ttl"] == name)


def test_20000_token_prefix_bills_20000_uncached_25000_per_5m_write_40000_per_1h_write_2000_per_hit():
    result = cost("--prefix-tokens", "20000")
    assert result["billed_per_uncached_call"] == 20_000
    assert ttl(result, "5m")["billed_per_write"] == 25_000
    assert ttl(result, "1h")["billed_per_write"] == 40_000
    assert ttl(result, "5m")["billed_per_read"] == ttl(result, "1h")["billed_per_read"] == 2_000
    assert result["cost_per_uncached_call"] == pytest.approx(0.06)  # $3 per million


def test_5m_caching_pays_off_from_the_second_call():
    five = ttl(cost("--prefix-tokens", "20000"), "5m")
    assert five["break_even_calls"] == 2
    assert five["curve"][0] == {"calls": 1, "billed_uncached": 20_000, "billed_cached": 25_000}
    assert five["curve"][1] == {"calls": 2, "billed_uncached": 40_000, "billed_cached": 27_000}
    assert five["pays_off"] and "pays off from call 2" in five["verdict"]


def test_1h_caching_pays_off_after_two_hits_within_the_hour():
    hour = ttl(cost("--prefix-tokens", "20000"), "1h")
    assert hour["break_even_calls"] == 3
    assert hour["curve"][1]["billed_cached"] == 42_000 > hour["curve"][1]["billed_uncached"]
    assert hour["curve"][2]["billed_cached"] == 44_000 < hour["curve"][2]["billed_uncached"]
    assert "one write then 2 hits" in hour["verdict"]


def test_a_call_every_10_minutes_with_the_5m_ttl_saves_nothing():
    five = ttl(cost("--prefix-tokens", "20000", "--calls", "6", "--interval", "10m", "--ttl", "5m"), "5m")
    sim = five["simulation"]
    assert (sim["num_writes"], sim["num_reads"]) == (6, 0)
    assert sim["billed_cached"] == 150_000 > sim["billed_uncached"] == 120_000
    assert sim["savings"] < 0 and not five["pays_off"]
    assert "saves nothing" in five["verdict"] and "every call is a write" in five["verdict"]


def test_the_same_pattern_pays_off_with_the_1h_ttl():
    result = cost("--prefix-tokens", "20000", "--calls", "6", "--interval", "10m")
    sim = ttl(result, "1h")["simulation"]
    assert (sim["num_writes"], sim["num_reads"], sim["billed_cached"]) == (1, 5, 50_000)
    assert result["best_ttl"] == "1h"


def test_a_hit_refreshes_the_ttl():
    # every 4 minutes for an hour: each call is within 5 minutes of the last use, never of the write
    sim = ttl(cost("--prefix-tokens", "20000", "--calls", "16", "--interval", "4m", "--ttl", "5m"), "5m")["simulation"]
    assert (sim["num_writes"], sim["num_reads"]) == (1, 15)


def test_an_entry_expires_exactly_at_its_ttl():
    assert simulate_calls([0, 299.9, 600], 300) == [False, True, False]


def test_a_prefix_below_the_minimum_is_not_cached_and_saves_nothing():
    result = cost("--prefix-tokens", "1000", "--calls", "10", "--interval", "10s")
    assert result["cacheable"] is False and "not cache" in result["note"]
    for entry in result["ttls"]:
        assert entry["break_even_calls"] is None and not entry["pays_off"]
        assert entry["simulation"]["num_uncached"] == 10
        assert entry["simulation"]["billed_cached"] == entry["simulation"]["billed_uncached"] == 10_000
    assert cost("--prefix-tokens", "1000", "--min-cacheable", "512")["cacheable"] is True


def test_a_trace_gives_the_call_times(tmp_path):
    trace = tmp_path / "calls.jsonl"
    trace.write_text('{"arrival": 0}\n{"arrival": 100, "prompt": "x"}\n\n{"arrival": 2000}\n')
    result = cost("--prefix-tokens", "4000", "--trace", str(trace))
    assert result["pattern"] == {"source": "trace", "num_calls": 3, "interval_s": None, "span_s": 2000.0}
    assert (ttl(result, "5m")["simulation"]["num_reads"], ttl(result, "1h")["simulation"]["num_reads"]) == (1, 2)


def test_multipliers_and_price_can_be_overridden():
    result = cost("--prefix-tokens", "10000", "--ttl", "5m", "--write-multiplier", "1.5",
                  "--read-multiplier", "0.4", "--price", "15")
    five = ttl(result, "5m")
    assert (five["billed_per_write"], five["billed_per_read"]) == (15_000, 4_000)
    assert result["cost_per_uncached_call"] == pytest.approx(0.15)
    assert five["break_even_calls"] == 2  # 1.5 + 0.4 < 2 calls at 1x
    assert ttl(cost("--prefix-tokens", "10000", "--write-multiplier", "1.5", "--read-multiplier", "0.5"),
               "5m")["break_even_calls"] == 3  # 1.5 + 0.5 only ties 2 calls at 1x


def test_durations_read_seconds_minutes_and_hours():
    assert [parse_duration(v) for v in ("30s", "10m", "1.5h", "45", "2 min")] == [30, 600, 5400, 45, 120]


@pytest.mark.parametrize("argv", [
    ("--prefix-tokens", "-5"),
    ("--prefix-tokens", "20000", "--calls", "3", "--interval", "soon"),
    ("--prefix-tokens", "20000", "--ttl", "2h"),
    ("--prefix-tokens", "20000", "--calls", "0"),
    ("--prefix-tokens", "20000", "--interval", "30s"),
    ("--prefix-tokens", "20000", "--price", "-1"),
    ("--prefix-tokens", "20000", "--trace", "/nonexistent/calls.jsonl"),
])
def test_bad_input_is_a_one_line_config_error(argv):
    with pytest.raises(ConfigError) as error:
        cost(*argv)
    assert "\n" not in str(error.value)


def test_a_trace_line_without_arrival_is_a_config_error(tmp_path):
    trace = tmp_path / "calls.jsonl"
    trace.write_text('{"arrival": 0}\n{"prompt": "no time"}\n')
    with pytest.raises(ConfigError, match="line 2"):
        cost("--prefix-tokens", "4000", "--trace", str(trace))


def test_json_keys_are_stable(capsys):
    assert main_cost(cost_args("--prefix-tokens", "20000", "--calls", "3", "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"prefix_tokens", "price_per_mtok", "min_cacheable", "cacheable", "note",
                           "billed_per_uncached_call", "cost_per_uncached_call", "pattern", "ttls", "best_ttl"}
    assert set(result["ttls"][0]) == {"ttl", "ttl_s", "write_multiplier", "read_multiplier", "billed_per_write",
                                      "billed_per_read", "break_even_calls", "curve", "simulation", "pays_off",
                                      "verdict"}
    assert set(result["ttls"][0]["simulation"]) == {
        "num_calls", "num_writes", "num_reads", "num_uncached", "billed_uncached", "billed_cached",
        "cost_uncached", "cost_cached", "savings", "savings_fraction"}


def test_rich_report_shows_rates_and_verdicts():
    from rich.console import Console

    out = io.StringIO()
    render_cost(cost("--prefix-tokens", "20000", "--calls", "6", "--interval", "10m"), Console(file=out, width=160))
    text = out.getvalue()
    for part in ("20,000 billed tokens", "25,000 (1.25x)", "40,000 (2x)", "2,000 (0.1x)", "every 10m",
                 "5m: caching saves nothing", "1h: caching saves"):
        assert part in text


@given(st.integers(1, 60), st.integers(0, 7200), st.integers(0, 200_000), st.sampled_from(["5m", "1h"]))
def test_cached_cost_lies_between_all_hits_and_all_writes(calls, interval_s, tokens, ttl_name):
    entry = ttl(cost("--prefix-tokens", str(tokens), "--calls", str(calls), "--interval", f"{interval_s}s",
                     "--ttl", ttl_name), ttl_name)
    write, read = (Fraction(str(entry[k])) for k in ("billed_per_write", "billed_per_read"))
    billed = Fraction(str(entry["simulation"]["billed_cached"]))
    assert write + (calls - 1) * read <= billed <= calls * write


@given(st.lists(st.floats(0, 20_000, allow_nan=False), min_size=1, max_size=40), st.sampled_from([300, 3600]))
def test_the_first_call_writes_and_a_hit_is_always_within_the_ttl_of_the_last_use(arrivals, ttl_s):
    hits = simulate_calls(arrivals, ttl_s)
    times = sorted(arrivals)
    assert hits[0] is False
    assert all(hit == (times[i] - times[i - 1] < ttl_s) for i, hit in enumerate(hits) if i)


@given(st.fractions(1, 4), st.fractions(0, Fraction(99, 100)))
def test_break_even_is_the_first_call_count_that_beats_paying_1x(write, read):
    n = break_even_calls(write, read)
    assert write + (n - 1) * read < n
    assert n == 1 or write + (n - 2) * read >= n - 1


# -- kvserve cost --from-usage ---------------------------------------------------------------------
ANTHROPIC_WRITE = {"input_tokens": 20, "cache_creation_input_tokens": 1000, "cache_read_input_tokens": 0,
                   "cache_creation": {"ephemeral_5m_input_tokens": 1000, "ephemeral_1h_input_tokens": 0},
                   "output_tokens": 7}
ANTHROPIC_READ = {"input_tokens": 20, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1000,
                  "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
                  "output_tokens": 5}


def usage_file(tmp_path, *lines) -> str:
    path = tmp_path / "usage.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_a_5m_write_then_a_read_bills_1_25x_then_0_1x_of_the_prefix(tmp_path):
    bill = cost("--from-usage", usage_file(tmp_path, ANTHROPIC_WRITE, ANTHROPIC_READ))["from_usage"]
    assert bill["num_requests"] == 2 and bill["prompt_tokens"] == 2040
    assert bill["billed_uncached"] == 2040
    assert bill["billed_cached"] == 20 + 1250 + 20 + 100
    assert bill["output_tokens"] == 12
    assert bill["savings"] == pytest.approx((2040 - 1390) * 3 / 1e6)


def test_1h_writes_bill_2x_and_whole_responses_count_by_their_usage(tmp_path):
    hour = {"input_tokens": 10, "cache_creation_input_tokens": 500,
            "cache_creation": {"ephemeral_5m_input_tokens": 200, "ephemeral_1h_input_tokens": 300}}
    bill = cost("--from-usage", usage_file(tmp_path, {"id": "msg_1", "usage": hour}))["from_usage"]
    assert (bill["write_5m_tokens"], bill["write_1h_tokens"]) == (200, 300)
    assert bill["billed_cached"] == 10 + 250 + 600 and bill["billed_uncached"] == 510
    assert bill["savings"] < 0  # one write and no read: caching costs more


def test_openai_usage_bills_cached_tokens_as_reads_and_the_rest_at_1x(tmp_path):
    usage = {"prompt_tokens": 1200, "completion_tokens": 9, "total_tokens": 1209,
             "prompt_tokens_details": {"cached_tokens": 1024}}
    bill = cost("--from-usage", usage_file(tmp_path, usage, "", usage))["from_usage"]
    assert bill["read_tokens"] == 2048 and bill["input_tokens"] == 352
    assert bill["billed_cached"] == pytest.approx(352 + 204.8)
    assert bill["billed_uncached"] == 2400


def test_responses_usage_includes_its_cached_tokens_and_openai_reads_have_their_own_rate(tmp_path):
    responses = {"input_tokens": 1200, "input_tokens_details": {"cached_tokens": 1024}, "output_tokens": 9,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 1209}
    bill = cost("--from-usage", usage_file(tmp_path, {"id": "resp_1", "usage": responses}, ANTHROPIC_READ),
                "--openai-read-multiplier", "0.5")["from_usage"]
    assert bill["openai_read_tokens"] == 1024 and bill["read_tokens"] == 2024
    assert bill["input_tokens"] == 176 + 20 and bill["output_tokens"] == 14
    assert bill["billed_uncached"] == 1200 + 1020
    assert bill["billed_cached"] == pytest.approx(176 + 0.5 * 1024 + 20 + 0.1 * 1000)


def test_multipliers_and_price_flags_apply_to_usage(tmp_path):
    bill = cost("--from-usage", usage_file(tmp_path, ANTHROPIC_WRITE), "--write-multiplier", "1",
                "--price", "1")["from_usage"]
    assert bill["billed_cached"] == bill["billed_uncached"] == 1020
    assert bill["cost_cached"] == pytest.approx(1020 / 1e6)


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1"),
    ({"output_tokens": 3}, "input_tokens (Anthropic) or prompt_tokens"),
    ({"input_tokens": -1}, ">= 0"),
    ({"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 6}}, "over prompt_tokens"),
    ({"input_tokens": 1, "cache_creation_input_tokens": 1,
      "cache_creation": {"ephemeral_1h_input_tokens": 2}}, "over cache_creation_input_tokens"),
])
def test_bad_usage_lines_are_one_line_errors(tmp_path, line, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cost("--from-usage", usage_file(tmp_path, line))


def test_from_usage_excludes_a_prefix_pattern_and_one_of_them_is_needed(tmp_path):
    with pytest.raises(ConfigError, match="leave out --prefix-tokens"):
        cost("--from-usage", usage_file(tmp_path, ANTHROPIC_READ), "--prefix-tokens", "10")
    with pytest.raises(ConfigError, match="--from-usage FILE"):
        cost()
    with pytest.raises(ConfigError, match="cannot read"):
        cost("--from-usage", str(tmp_path / "missing.jsonl"))


def test_cost_from_usage_on_the_command_line(tmp_path, capsys):
    from kvserve.cli import main

    path = usage_file(tmp_path, ANTHROPIC_WRITE, ANTHROPIC_READ)
    assert main(["cost", "--from-usage", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["from_usage"]["billed_cached"] == 1390
    assert main(["cost", "--from-usage", path]) == 0
    assert "saves" in capsys.readouterr().out
    assert main(["cost"]) == 2
    assert "--from-usage FILE" in capsys.readouterr().err
