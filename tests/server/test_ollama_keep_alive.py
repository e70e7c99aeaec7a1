"""Ollama's `keep_alive: 0` with the `ollama` client: the model stays (other tenants share it), and what
the caller's requests hold in the pool is released (a prompt lease made through the OpenAI API, after an
answer or on the empty "unload" call), while a named cache (released by its id) stays."""

from __future__ import annotations

import httpx
import ollama

from tests.server.conftest import on_engine

LONG = ("The lighthouse log records each ship that passed the point: its flag, its cargo and the hour "
        "the fog lifted. ") * 50  # over --min-cacheable-tokens: leased


def labels(async_engine) -> list[str]:
    table = async_engine.engine.manager.leases
    return on_engine(async_engine, lambda: sorted(lease.label for lease in table.leases.values()))


def lease_prompt(client, model_name, word: str) -> None:
    client.chat.completions.create(model=model_name, max_tokens=1, prompt_cache_options={"ttl": "30m"},
                                   messages=[{"role": "user", "content": word + " " + LONG}])


def test_keep_alive_0_releases_the_callers_leases_not_its_named_caches(server, client, model_name,
                                                                        async_engine):
    cache = httpx.post(server.url + "/v1/caches", json={"name": "keep-alive-test", "prompt": "named " + LONG, "ttl": "5m"}, timeout=300)
    assert cache.status_code == 200, cache.text
    try:
        lease_prompt(client, model_name, "first")
        assert labels(async_engine) == ["30m", "5m"]
        oclient = ollama.Client(host=server.url, timeout=300)
        answer = oclient.generate(model=model_name, prompt="Hi", options={"num_predict": 1}, keep_alive=0)
        assert answer.done
        assert labels(async_engine) == ["5m"]  # the prompt lease went, the named cache stayed
        lease_prompt(client, model_name, "second")
        unloaded = oclient.generate(model=model_name, prompt="", keep_alive=0)
        assert unloaded.done_reason == "unload" and labels(async_engine) == ["5m"]
        kept = oclient.generate(model=model_name, prompt="Hi", options={"num_predict": 1}, keep_alive="5m")
        assert kept.done and labels(async_engine) == ["5m"]
        assert [m.model for m in oclient.ps().models]  # the model itself is still there
    finally:
        httpx.delete(server.url + "/v1/caches/" + cache.json()["id"], timeout=60)
