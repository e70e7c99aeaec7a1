"""`kvserve bench` on a closed-loop workload (the agent trace's shape, issue 26): follow-ups sent after
the answers they continue, each call forced by the grammar and held, side by side with the holds off
(`--vs no-tool-holds`) in one run; no request fails, no page is left in use, the answers are the same."""

from __future__ import annotations

import json

import pytest

from kvserve import kernels
from kvserve.cli import main

SMALL_POOL = ["--kv-cache-memory", "64MiB", "--max-model-len", "512"]


def loop_trace(tmp_path):
    """Two agents (a call, a call, an answer) sharing 64 tokens of tool definitions, and another user."""
    tools = list(range(400, 464))
    lines = []
    for a in range(2):
        lines.append({"id": f"a{a}-0", "prompt_token_ids": tools + list(range(1000 + 40 * a, 1020 + 40 * a)),
                      "arrival": 0.05 * a, "max_tokens": 48, "tool_call": True, "session": f"a{a}"})
        for k in (1, 2):
            result = list(range(2000 + 100 * a + 20 * k, 2016 + 100 * a + 20 * k))
            lines.append({"id": f"a{a}-{k}", "prompt_token_ids": result,
                          "after": f"a{a}-{k - 1}", "delay_s": 0.05, "continues": True, "tool_call": k == 1,
                          "max_tokens": 48 if k == 1 else 4, "session": f"a{a}"})
    lines.append({"id": "o0", "prompt_token_ids": list(range(3000, 3060)), "arrival": 0.0, "max_tokens": 4})
    lines.append({"id": "o1", "prompt_token_ids": list(range(3100, 3160)), "after": "o0", "delay_s": 0.01,
                  "max_tokens": 4})
    path = tmp_path / "loops.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.slow
def test_agent_loops_with_holds_on_and_off_in_one_run(tmp_path, capsys):
    argv = ["bench", "--workload", str(loop_trace(tmp_path)), "--vs", "no-tool-holds", "--json", *SMALL_POOL]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    on, off = report["agent"]["kvserve"], report["agent"]["kvserve+no-tool-holds"]
    assert report["workload"]["closed_loop"] and report["workload"]["num_follow_ups"] == 4
    for a in (on, off):
        assert a["num_failed"] == 0 and a["num_follow_ups"] == 4 and a["num_tool_calls"] == 4
        assert a["num_calls_unfinished"] == 0  # every forced call ended itself (finish_reason stop)
        assert a["pages_in_use_at_end"] == 0 and a["pages_leaked"] == 0
    assert on["tool_call_holds_granted"] == on["tool_call_holds_used"] == 4 and on["leases_at_end"] == 0
    assert off["tool_call_holds_granted"] == 0
    assert on["follow_up_hit_rate"] >= off["follow_up_hit_rate"] > 0
    if kernels.available():  # the default mode is invariant on the kernels; int4 (kernels off) is not
        assert report["greedy_agreement"]["kvserve+no-tool-holds"]["fraction"] == 1.0
    assert report["engines"]["kvserve"]["num_requests"] == 8
    assert report["agent_summary"]["problems"] == [] and report["agent_summary"]["pages_leaked"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "2"], "runs in process"),
    (["--vs", "transformers"], "runs in process"),
])
def test_closed_loop_flag_mistakes_are_one_line(tmp_path, capsys, argv, message):
    assert main(["bench", "--workload", str(loop_trace(tmp_path)), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err



@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.model.tiny_models import make_hf_model, write_gguf

    return str(write_gguf(make_hf_model("llama3", max_position_embeddings=1024), "llama3",
                          tmp_path_factory.mktemp("bench-agent") / "llama3.gguf"))


@pytest.mark.slow
def test_a_closed_loop_run_reports_its_gain_failures_and_a_pool_back_to_full(tmp_path, capsys, tiny_llama):
    """The tiny model (ids folded into its 2,048-token vocabulary): the summary of holds on beside off,
    every page back in the pool once the leases are released, no failure; exit 0."""
    trace = []
    for line in map(json.loads, loop_trace(tmp_path).read_text().splitlines()):
        line["prompt_token_ids"] = [3 + t % 2000 for t in line["prompt_token_ids"]]
        trace.append(json.dumps(line) + "\n")
    (tmp_path / "tiny.jsonl").write_text("".join(trace))
    argv = ["bench", "--workload", str(tmp_path / "tiny.jsonl"), "--vs", "no-tool-holds", "--json",
            "--model", tiny_llama, "--kv-cache-memory", "4MiB", "--max-model-len", "512", "--swap-space", "0"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    for a in report["agent"].values():
        assert a["num_failed"] == 0 and a["pages_leaked"] == 0 and a["pool_free_pages_at_end"] == a["pool_pages"] > 0
    on, off = report["agent"]["kvserve"], report["agent"]["kvserve+no-tool-holds"]
    summary = report["agent_summary"]
    assert summary["follow_up_hit_rate_gain"] == on["follow_up_hit_rate"] - off["follow_up_hit_rate"]
    assert summary["num_failed"] == summary["pages_leaked"] == 0 and summary["problems"] == []


def test_a_failed_request_or_a_leaked_page_is_a_problem():
    from kvserve.tools.bench.report import agent_problems, agent_summary

    clean = {"num_failed": 0, "failures": [], "pages_leaked": 0, "pool_free_pages_at_end": 8, "pool_pages": 8,
             "follow_up_hit_rate": 0.9}
    report = {"agent": {"kvserve": dict(clean), "kvserve+no-tool-holds": dict(clean, follow_up_hit_rate=0.5)}}
    assert agent_problems(report) == [] and agent_summary(report)["follow_up_hit_rate_gain"] == pytest.approx(0.4)
    report["agent"]["kvserve"].update(pages_leaked=2, pool_free_pages_at_end=6)
    report["agent"]["kvserve+no-tool-holds"].update(num_failed=1, failures=["aborted"])
    assert agent_problems(report) == ["kvserve: 2 pages leaked (the pool did not return to full)",
                                      "kvserve+no-tool-holds: 1 requests failed (aborted)"]
    assert agent_summary(report)["problems"] == agent_problems(report)
