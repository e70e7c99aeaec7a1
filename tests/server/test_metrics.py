"""/metrics is Prometheus text that prometheus_client parses, with every name of DESIGN.md §4, and its
counters move as requests run; /dashboard/stats agrees with it."""

from __future__ import annotations

import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import wait_no_pages_in_use

DESIGN_NAMES = [
    "kvserve:kv_cache_usage_perc", "kvserve:cpu_cache_usage_perc",
    "kvserve:prefix_cache_queries_total", "kvserve:prefix_cache_hits_total",
    "kvserve:num_preemptions_total", "kvserve:num_requests_running",
    "kvserve:num_requests_waiting", "kvserve:num_requests_swapped", "kvserve:prompt_tokens_total",
    "kvserve:generation_tokens_total", "kvserve:prompt_tokens_cached_total",
    "kvserve:time_to_first_token_seconds", "kvserve:time_per_output_token_seconds",
    "kvserve:e2e_request_latency_seconds", "kvserve:remote_cache_hits_total",
    "kvserve:remote_cache_errors_total",
]


def scrape(url: str) -> dict[str, float]:
    """sample name -> value, summed over labels (one model here); histograms as _count / _sum."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_every_design_name_is_exported(server):
    values = scrape(server.url)
    for name in DESIGN_NAMES:
        if name.endswith("_seconds"):
            assert name + "_count" in values and name + "_sum" in values, name
        else:
            assert name in values, name


def test_counters_move_as_requests_run(server, client, model_name, async_engine):
    before = scrape(server.url)
    prompt = f"Metrics check {uuid.uuid4().hex}: " + "the tide comes in and goes out. " * 12
    for _ in range(2):  # the second run hits the first one's pages
        client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    wait_no_pages_in_use(async_engine)
    after = scrape(server.url)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    prompt_tokens = 2 * async_engine.engine.tokenizer.encode(prompt, add_special_tokens=False).ids.__len__()
    assert moved("kvserve:prompt_tokens_total") == prompt_tokens
    assert moved("kvserve:generation_tokens_total") == 12
    assert moved("kvserve:prefix_cache_queries_total") >= prompt_tokens / 2
    assert moved("kvserve:prefix_cache_hits_total") >= 64
    assert moved("kvserve:prompt_tokens_cached_total") >= 64
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds"):
        assert moved(f"kvserve:{name}_count") == 2
        assert moved(f"kvserve:{name}_sum") > 0
    assert moved('kvserve:request_success_total') == 2
    assert after["kvserve:num_requests_running"] == 0 and after["kvserve:kv_cache_usage_perc"] == 0


def test_dashboard_stats_agree_with_metrics(server, async_engine):
    wait_no_pages_in_use(async_engine)
    stats = httpx.get(server.url + "/dashboard/stats").json()
    values = scrape(server.url)
    assert stats["prefix_cache_queries"] == values["kvserve:prefix_cache_queries_total"]
    assert stats["prefix_cache_hits"] == values["kvserve:prefix_cache_hits_total"]
    assert stats["num_pages_total"] == values["kvserve:num_pages_total"]
    pages = stats["pages"]
    assert len(pages) == stats["num_pages_total"] + 1 and pages[0] == "4"  # page 0: the null page
    assert set(pages[1:]) <= {"0", "1"}  # idle: every page free or cached idle
    assert pages.count("1") == stats["num_pages_cached"]


def test_grafana_dashboard_queries_only_exported_names(server, async_engine, client, model_name):
    """deploy/grafana/kvserve.json plots the same metrics under either prefix (its $prefix variable): no
    typo'd name shows an empty panel; under vllm only V0's num_requests_swapped is missing (V1 dropped it)."""
    import json
    import re
    from pathlib import Path

    from kvserve.server.api import build_app
    from tests.server.conftest import ServerThread

    dashboard = json.loads((Path(__file__).parents[2] / "deploy/grafana/kvserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["name"] == "model_name"]
    assert all("kvserve:" not in e and "vllm:" not in e for e in exprs)

    def exported(url: str) -> set[str]:
        values = scrape(url)
        return set(values) | {f"{name[:-len('_count')]}_bucket" for name in values if name.endswith("_count")}

    with ServerThread(build_app(async_engine, metrics_name_prefix="vllm")) as vllm_server:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=2)  # (labelled series appear)
        wait_no_pages_in_use(async_engine)
        for prefix, url, allowed_missing in (("kvserve", server.url, set()),
                                             ("vllm", vllm_server.url, {"vllm:num_requests_swapped"})):
            used = {m for e in exprs for m in re.findall(rf"{prefix}:[a-z0-9_]+", e.replace("${prefix}", prefix))}
            assert used and used - exported(url) <= allowed_missing, (prefix, used - exported(url))
            assert {f"{prefix}:prefix_cache_hits_total", f"{prefix}:time_to_first_token_seconds_bucket",
                    f"{prefix}:kv_cache_usage_perc"} <= used
