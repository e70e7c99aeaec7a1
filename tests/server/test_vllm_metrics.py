"""Under `--metrics-name-prefix vllm`: vLLM V1's request histograms with vLLM's buckets, moving as
requests run, and none of V0's retired names unless asked (--metrics-v0-names)."""

from __future__ import annotations

import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.request_metrics import (ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS,
                                     buckets_1_2_5)
from tests.server.conftest import SMALL_ENGINE, ServerThread, wait_no_pages_in_use

LENGTHS = buckets_1_2_5(SMALL_ENGINE["max_model_len"])
# vllm/v1/metrics/loggers.py: histogram -> its buckets
VLLM_HISTOGRAMS = {
    "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:inter_token_latency_seconds": TOKEN_LATENCY_BUCKETS,
    "vllm:request_prompt_tokens": LENGTHS,
    "vllm:request_generation_tokens": LENGTHS,
    "vllm:iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
}
V0_NAMES = {"vllm:cpu_cache_usage_perc", "vllm:num_requests_swapped"}


def scrape(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}


def sample(family, suffix: str) -> float:
    return sum(s.value for s in family.samples if s.name.endswith(suffix))


def test_vllm_histograms_with_vllms_buckets_move_as_requests_run(async_engine, client, model_name):
    from kvserve.server.api import build_app

    assert LENGTHS[:4] == [1, 2, 5, 10] and LENGTHS[-1] == 2000
    with ServerThread(build_app(async_engine, metrics_name_prefix="vllm")) as running:
        before = scrape(running.url)
        prompt = f"Histogram check {uuid.uuid4().hex}: the sea is wide."
        for _ in range(2):
            client.completions.create(model=model_name, prompt=prompt, max_tokens=5, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        wait_no_pages_in_use(async_engine)
        after = scrape(running.url)
    assert V0_NAMES.isdisjoint(after)
    for name, buckets in VLLM_HISTOGRAMS.items():
        family = after[name]
        assert family.type == "histogram"
        les = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
        assert les == [*map(float, buckets), float("inf")], name
        assert all({"model_name", "engine"} <= set(s.labels) for s in family.samples), name

    def moved(name: str, suffix: str) -> float:
        return sample(after[name], suffix) - sample(before[name], suffix)

    num_prompt = len(async_engine.engine.tokenizer.encode(prompt, add_special_tokens=False).ids)
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds"):
        assert moved(f"vllm:{name}", "_count") == 2, name
    assert moved("vllm:request_prefill_time_seconds", "_sum") > 0
    assert moved("vllm:request_decode_time_seconds", "_sum") > 0
    assert moved("vllm:request_prompt_tokens", "_sum") == 2 * num_prompt
    assert moved("vllm:request_generation_tokens", "_sum") == 10
    assert moved("vllm:inter_token_latency_seconds", "_count") == 2 * 4  # tokens 2..5 of each request
    # the steps computed every prompt token not served from the cache and each decode token
    computed = moved("vllm:iteration_tokens_total", "_sum")
    assert 2 * 4 < computed <= 2 * (num_prompt + 4)
    assert moved("vllm:iteration_tokens_total", "_count") >= 2 * 5


def test_v0_names_only_when_asked(async_engine):
    from kvserve.server.api import build_app

    with ServerThread(build_app(async_engine, metrics_name_prefix="vllm", metrics_v0_names=True)) as running:
        assert V0_NAMES <= set(scrape(running.url))
