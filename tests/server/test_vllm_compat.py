"""What vLLM-built routers read from a kvserve server: with `--metrics-name-prefix vllm` the five
metric families llm-d's endpoint picker scrapes by default, with vLLM's types and labels; and
`POST /reset_prefix_cache` behind an admin key."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ServerThread

# vLLM (vllm/v1/metrics/loggers.py): family -> (type, labels every sample carries)
VLLM_FAMILIES = {
    "vllm:num_requests_waiting": ("gauge", {"model_name", "engine"}),
    "vllm:num_requests_running": ("gauge", {"model_name", "engine"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    "vllm:lora_requests_info": ("gauge", {"running_lora_adapters", "max_lora", "waiting_lora_adapters"}),
    "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks", "engine"}),
}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_vllm_prefix_serves_the_five_families_llm_d_scrapes(async_engine, client, model_name):
    from kvserve.server.api import build_app

    with ServerThread(build_app(async_engine, metrics_name_prefix="vllm")) as running:
        client.completions.create(model=model_name, prompt="Hello there", max_tokens=2)
        text = httpx.get(running.url + "/metrics").text
    found = families(text)
    for name, (kind, labels) in VLLM_FAMILIES.items():
        assert name in found, f"{name} missing"
        family = found[name]
        assert family.type == kind, (name, family.type)
        assert family.samples and all(labels <= set(s.labels) for s in family.samples), name
    (config,) = found["vllm:cache_config_info"].samples
    engine = async_engine.engine
    assert config.value == 1 and config.labels["block_size"] == str(engine.config.page_size)
    assert config.labels["num_gpu_blocks"] == str(engine.cache_config.num_pages)
    (usage,) = found["vllm:kv_cache_usage_perc"].samples
    assert usage.labels == {"model_name": model_name, "engine": "0"} and 0 <= usage.value <= 1
    assert not any(name.startswith("kvserve:") for name in found)


def test_kvserve_names_stay_the_default_with_the_info_families(server):
    found = families(httpx.get(server.url + "/metrics").text)
    assert "kvserve:num_requests_waiting" in found and "vllm:num_requests_waiting" not in found
    (config,) = found["kvserve:cache_config_info"].samples
    assert {"block_size", "num_gpu_blocks"} <= set(config.labels)
    assert "kvserve:lora_requests_info" in found and "kvserve:disk_tier_hits" in found


def test_reset_prefix_cache_needs_an_admin_key_and_forgets_cached_pages(async_engine, model_name):
    from openai import OpenAI

    from kvserve.server.api import build_app

    with ServerThread(build_app(async_engine, api_keys=["sk-reset"], admin_api_keys=["sk-admin"])) as running:
        client = OpenAI(base_url=running.url + "/v1", api_key="sk-reset", max_retries=0)
        prompt = "Count the ships in the harbor, one by one, and name each of them " * 4
        client.completions.create(model=model_name, prompt=prompt, max_tokens=1)
        assert httpx.post(running.url + "/reset_prefix_cache").status_code == 401
        tenant = httpx.post(running.url + "/reset_prefix_cache", headers={"Authorization": "Bearer sk-reset"})
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_key_required"
        reset = httpx.post(running.url + "/reset_prefix_cache",
                           headers={"Authorization": "Bearer sk-admin"})
        assert reset.status_code == 200
        again = client.completions.create(model=model_name, prompt=prompt, max_tokens=1)
        assert (again.usage.prompt_tokens_details.cached_tokens or 0) == 0


def test_render_gives_the_token_ids_the_request_is_served_with(server, client, model_name):
    """llm-d's tokenizer plugin reads `token_ids` of /v1/completions/render (a list, one per prompt)
    and /v1/chat/completions/render (one object): the ids the completion routes serve."""
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three rivers of Europe."}]
    chat = httpx.post(server.url + "/v1/chat/completions/render",
                      json={"model": model_name, "messages": messages}).json()
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    served = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    assert chat["token_ids"] == tokenized["tokens"]
    assert len(chat["token_ids"]) == served.usage.prompt_tokens
    assert chat["model"] == model_name and chat["cache_salt"] is None

    prompts = ["The capital of France is", "One, two, three,"]
    rendered = httpx.post(server.url + "/v1/completions/render",
                          json={"model": model_name, "prompt": prompts, "cache_salt": "s1"}).json()
    assert [r["cache_salt"] for r in rendered] == ["s1", "s1"]  # as the events' extra_keys carry it
    for prompt, one in zip(prompts, rendered):
        tokenized = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()
        served = client.completions.create(model=model_name, prompt=prompt, max_tokens=1)
        assert one["token_ids"] == tokenized["tokens"]
        assert len(one["token_ids"]) == served.usage.prompt_tokens
    ids = [5, 6, 7]
    (given,) = httpx.post(server.url + "/v1/completions/render", json={"prompt": ids}).json()
    assert given["token_ids"] == ids
    missing = httpx.post(server.url + "/v1/chat/completions/render",
                         json={"model": "nope", "messages": messages})
    assert missing.status_code == 404 and "error" in missing.json()
