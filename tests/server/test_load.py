"""Load: 100 concurrent streaming requests, a fifth of which hang up midway. Every other one gets the
same text as the same greedy request run alone, the ones that hung up are aborted, and afterwards no
page is in use. A non-streaming client that gives up is aborted too."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import wait_no_pages_in_use
from tests.server.test_metrics import scrape

NUM_REQUESTS = 100
MAX_TOKENS = 16
PROMPTS = [
    "The capital of France is", "Once upon a time, a lighthouse keeper", "def add(a, b):",
    "Three facts about the moon:", "The best way to learn a language is", "Dear team, this week",
    "In 1969, the first", "A recipe for bread: flour,", "The ocean is blue because",
    "Rain in the harbour, and the ships",
]


def body(model: str, prompt: str, stream: bool) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}


async def stream_one(client: httpx.AsyncClient, url: str, payload: dict, hang_up_after: int | None
                     ) -> tuple[str, bool]:
    """(text received, whether [DONE] arrived). With hang_up_after, close the connection after that
    many text chunks."""
    text, chunks = "", 0
    async with client.stream("POST", url, json=payload) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text, True
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return text, False  # leaving the block closes the half-read response
    return text, False


@pytest.mark.slow
def test_hundred_streams_with_a_fifth_hanging_up(server, model_name, async_engine):
    reference = {p: httpx.post(server.url + "/v1/completions", json=body(model_name, p, False),
                               timeout=300).json()["choices"][0]["text"] for p in PROMPTS}
    finished_before = scrape(server.url).get('kvserve:request_success_total', 0)

    async def load():
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            jobs = [stream_one(http, server.url + "/v1/completions",
                               body(model_name, PROMPTS[i % len(PROMPTS)], True),
                               hang_up_after=4 if i % 5 == 0 else None)
                    for i in range(NUM_REQUESTS)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(load())
    for i, (text, done) in enumerate(results):
        expected = reference[PROMPTS[i % len(PROMPTS)]]
        if i % 5 == 0:
            assert not done and expected.startswith(text)
        else:
            assert done and text == expected, f"request {i}"
    wait_no_pages_in_use(async_engine)
    finished = scrape_by_reason(server.url)
    assert finished.get("abort", 0) >= NUM_REQUESTS // 5 - 2  # a hang-up right at the end may finish
    assert sum(finished.values()) - finished_before >= NUM_REQUESTS


def scrape_by_reason(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "kvserve:request_success_total":
                reason = sample.labels["finished_reason"]
                out[reason] = out.get(reason, 0) + sample.value
    return out


def test_non_streaming_client_that_gives_up_is_aborted(server, model_name, async_engine):
    aborted = scrape_by_reason(server.url).get("abort", 0)
    payload = {"model": model_name, "prompt": "Count to a thousand:", "max_tokens": 1500,
               "temperature": 0.0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=payload, timeout=3)
    wait_no_pages_in_use(async_engine, timeout=30)  # 1,500 tokens would take far longer
    assert scrape_by_reason(server.url).get("abort", 0) == aborted + 1


def test_streaming_client_that_hangs_up_after_one_chunk_is_aborted(server, model_name, async_engine):
    aborted = scrape_by_reason(server.url).get("abort", 0)
    payload = dict(body(model_name, "Count to a thousand:", True), max_tokens=1500)

    async def hang_up():
        async with httpx.AsyncClient(timeout=60) as http:
            return await stream_one(http, server.url + "/v1/completions", payload, hang_up_after=1)

    text, done = asyncio.run(hang_up())
    assert not done
    wait_no_pages_in_use(async_engine, timeout=30)
    assert scrape_by_reason(server.url).get("abort", 0) == aborted + 1
