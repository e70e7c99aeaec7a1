"""The cache-facing routes over HTTP with the real clients: `kv_explain` returns a `kv_cache` object
beside `usage` (non-streaming and in the last streamed chunk), `/tokenize` gives the ids the
completion endpoints use and `/detokenize` their text back, `/v1/models/{id}` the served model,
`/v1/cache/report` is JSON, and leased pages are in /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

SYSTEM = "You are a tide-table assistant. Answer in one short sentence. " * 6


def test_kv_explain_on_chat_completions_streaming_and_not(client, server, model_name):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is high tide?"}]
    first = client.chat.completions.create(model=model_name, messages=messages, max_tokens=3,
                                           temperature=0, extra_body={"kv_explain": True})
    explanation = first.model_extra["kv_cache"]
    assert set(explanation) == {"cached_tokens", "cached_by_source", "diverged_at", "reason", "detail"}
    assert explanation["cached_tokens"] == first.usage.prompt_tokens_details.cached_tokens
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=3, temperature=0,
                                            stream=True, extra_body={"kv_explain": True})
    chunks = list(stream)
    last = chunks[-1].model_extra.get("kv_cache")
    # the same prompt again: every full page hits; the tokens of its last, partly filled page were
    # never cached (the first answer's 3 tokens did not fill it)
    full_pages = first.usage.prompt_tokens // 16 * 16
    assert last is not None and last["cached_tokens"] == full_pages
    assert last["reason"] == ("full_hit" if full_pages >= first.usage.prompt_tokens - 1 else "partial_page")
    assert all("kv_cache" not in c.model_extra for c in chunks[:-1])


def test_tokenize_matches_the_prompt_the_chat_endpoint_counts(client, server, model_name):
    messages = [{"role": "user", "content": "Count my tokens, please."}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60).json()
    done = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1, temperature=0)
    assert tokens["count"] == len(tokens["tokens"]) == done.usage.prompt_tokens
    bad = httpx.post(server.url + "/tokenize", json={}, timeout=60)
    assert bad.status_code == 400 and "error" in bad.json()


def test_detokenize_gives_back_the_text_tokenize_made(server):
    messages = [{"role": "user", "content": "Count my tokens, please."}]
    for request in ({"prompt": "Hello, world!"}, {"messages": messages}):
        ids = httpx.post(server.url + "/tokenize", json=request, timeout=60).json()["tokens"]
        back = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=60)
        assert back.status_code == 200 and back.json()["prompt"] == back.json()["content"]
        text = back.json()["prompt"]
        if "prompt" in request:
            assert text == "Hello, world!"
        else:  # the template's own special tokens come back as their text
            assert "<|im_start|>user\nCount my tokens, please.<|im_end|>" in text
            assert httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=60).json()["tokens"] == ids
    assert httpx.post(server.url + "/detokenize", json={"tokens": []}, timeout=60).json()["prompt"] == ""
    for tokens in ([-1], [10**9], ["a"], [1.5], None):
        bad = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, timeout=60)
        assert 400 <= bad.status_code < 500 and "error" in bad.json(), (tokens, bad.text)


def test_the_sdk_retrieves_the_served_model_and_a_missing_one_is_a_404(client, model_name):
    import openai

    listed = client.models.list().data
    assert [client.models.retrieve(m.id).id for m in listed] == [m.id for m in listed]
    assert model_name in [m.id for m in listed]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such/model")
    assert missing.value.body["code"] == "model_not_found"


def test_cache_report_and_lease_metrics(server):
    report = httpx.get(server.url + "/v1/cache/report", timeout=60).json()
    for key in ("hit_rate", "tenants", "top_prefixes_by_reuse", "top_prefixes_by_bytes", "pages",
                "thrash_pages", "preemption_rate", "advice"):
        assert key in report
    json.dumps(report)
    metrics = httpx.get(server.url + "/metrics", timeout=60).text
    assert "kvserve:leased_pages" in metrics and "kvserve:lease_grants_total" in metrics


@pytest.mark.slow
def test_the_midprompt_mix_sent_live_is_diagnosed_by_the_cache_report():
    """The `midprompt` workload (a per-request header before a 1,500-token shared system prompt) over
    HTTP to a fresh server: the report names the shared span's offset and length."""
    from kvserve.async_engine import AsyncEngine
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app
    from kvserve.tools.traces import MIDPROMPT_HEADER_TOKENS, MIDPROMPT_SYSTEM_TOKENS, generate_trace
    from tests.server.conftest import SMALL_ENGINE, ServerThread

    engine = AsyncEngine(LLMEngine(EngineConfig(**SMALL_ENGINE)))
    with ServerThread(build_app(engine)) as running:
        for request in generate_trace("midprompt", 8):
            response = httpx.post(running.url + "/v1/completions", timeout=300, json={
                "model": "smollm2", "prompt": request.prompt_token_ids, "max_tokens": 1})
            assert response.status_code == 200, response.text
        report = httpx.get(running.url + "/v1/cache/report", timeout=60).json()
    engine.shutdown()
    assert report["hit_rate"] < 0.3
    (advice,) = [a for a in report["advice"] if a["kind"] == "mid_prompt_shared_text"]
    assert advice["offset"] == MIDPROMPT_HEADER_TOKENS and advice["length"] >= MIDPROMPT_SYSTEM_TOKENS
    assert advice["num_requests"] == 8
