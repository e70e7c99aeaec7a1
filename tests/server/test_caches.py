"""Named caches over HTTP: create (prefill and lease a prefix), use (a later prompt reads its tokens),
list, show, extend, delete; per tenant (another key can neither see nor use them); bad input is a 400.
"""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest

from kvserve.server.caches import CacheRegistry, NamedCache
from tests.server.test_anthropic import handbook, tokens_through

KEY_A = {"Authorization": "Bearer key-a"}
KEY_B = {"x-api-key": "key-b"}


@pytest.fixture(scope="module")
def keyed_server(async_engine):
    from kvserve.server.api import build_app
    from tests.server.conftest import ServerThread

    with ServerThread(build_app(async_engine, api_keys=["key-a", "key-b"])) as running:
        yield running


def call(server, method: str, path: str, headers=None, **kwargs) -> httpx.Response:
    return httpx.request(method, server.url + path, headers=headers, timeout=300, **kwargs)


# -- no engine needed ------------------------------------------------------------------------------
def test_the_registry_keeps_each_tenants_caches_apart():
    registry = CacheRegistry()
    cache = NamedCache("kvc_1", "handbook", 1500, "5m", 0, 300.0, "lease-1")
    registry.add("a", cache)
    assert registry.get("a", "kvc_1") is cache and registry.all("a") == [cache]
    assert registry.get("b", "kvc_1") is None and registry.all("b") == []
    assert registry.remove("b", "kvc_1") is None and registry.get("a", "kvc_1") is cache
    assert cache.body() == {"object": "cache", "id": "kvc_1", "name": "handbook", "tokens": 1500,
                            "ttl": "5m", "created_at": 0, "expires_at": 300.0}


@pytest.mark.parametrize("body, message", [
    ({"name": "x"}, "give either `prompt`, or `system` and/or `messages`"),
    ({"name": "x", "prompt": "a", "system": "b"}, "give either"),
    ({"name": "x", "prompt": "a", "ttl": "2h"}, "ttl"),
    ({"name": "", "prompt": "a"}, "name"),
    ({"name": "x", "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
])
def test_bad_cache_requests_are_400(keyed_server, body, message):
    response = call(keyed_server, "POST", "/v1/caches", KEY_A, json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_unknown_caches_are_404_and_keys_are_required(keyed_server):
    for method, body in (("GET", None), ("PATCH", {"ttl": "1h"}), ("DELETE", None)):
        response = call(keyed_server, method, "/v1/caches/kvc_nope", KEY_A, json=body)
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    assert call(keyed_server, "GET", "/v1/caches", {"x-api-key": "key-z"}).status_code == 401
    assert call(keyed_server, "GET", "/v1/caches", KEY_B).json() == {"object": "list", "data": []}


# -- with the engine's leases ----------------------------------------------------------------------
def test_a_named_cache_is_created_used_extended_and_deleted(keyed_server, async_engine, model_name):
    system = handbook(1300)
    created = call(keyed_server, "POST", "/v1/caches", KEY_A,
                   json={"name": "handbook", "system": system, "ttl": "5m"})
    assert created.status_code == 200, created.text
    cache = created.json()
    try:
        question = [{"role": "user", "content": "Which rule covers visitors?"}]
        assert cache["tokens"] == tokens_through(async_engine, system, question, system)
        assert cache["name"] == "handbook" and cache["id"].startswith("kvc_")
        assert time.time() < cache["expires_at"] <= time.time() + 301
        assert call(keyed_server, "POST", "/v1/caches", KEY_A,
                    json={"name": "handbook", "prompt": "x"}).status_code == 409

        claude = anthropic.Anthropic(base_url=keyed_server.url, api_key="key-a", max_retries=0)
        used = claude.messages.create(model=model_name, max_tokens=2, system=system, messages=question)
        page_size = async_engine.engine.config.page_size
        assert cache["tokens"] - page_size < used.usage.cache_read_input_tokens <= cache["tokens"]

        listed = call(keyed_server, "GET", "/v1/caches", KEY_A).json()["data"]
        assert [c["id"] for c in listed] == [cache["id"]]
        shown = call(keyed_server, "GET", f"/v1/caches/{cache['id']}", KEY_A).json()
        assert shown["tokens"] == cache["tokens"]
        extended = call(keyed_server, "PATCH", f"/v1/caches/{cache['id']}", KEY_A, json={"ttl": "1h"})
        assert extended.status_code == 200 and extended.json()["ttl"] == "1h"
        assert extended.json()["expires_at"] > cache["expires_at"] + 3000
    finally:
        deleted = call(keyed_server, "DELETE", f"/v1/caches/{cache['id']}", KEY_A)
    assert deleted.json() == {"id": cache["id"], "object": "cache.deleted", "deleted": True}
    assert call(keyed_server, "GET", f"/v1/caches/{cache['id']}", KEY_A).status_code == 404


def test_another_tenant_can_neither_list_nor_use_a_cache(keyed_server, async_engine, model_name):
    prompt = handbook(1200)
    cache = call(keyed_server, "POST", "/v1/caches", KEY_A,
                 json={"name": "shared-looking", "prompt": prompt}).json()
    try:
        assert call(keyed_server, "GET", "/v1/caches", KEY_B).json()["data"] == []
        for method, body in (("GET", None), ("PATCH", {"ttl": "1h"}), ("DELETE", None)):
            response = call(keyed_server, method, f"/v1/caches/{cache['id']}", KEY_B, json=body)
            assert response.status_code == 404
        b_use = call(keyed_server, "POST", "/v1/completions", KEY_B,
                     json={"model": model_name, "prompt": prompt + " Next", "max_tokens": 1}).json()
        assert b_use["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        a_use = call(keyed_server, "POST", "/v1/completions", KEY_A,
                     json={"model": model_name, "prompt": prompt + " Next", "max_tokens": 1}).json()
        assert a_use["usage"]["prompt_tokens_details"]["cached_tokens"] > cache["tokens"] - 16
        assert call(keyed_server, "GET", f"/v1/caches/{cache['id']}", KEY_A).status_code == 200
    finally:
        call(keyed_server, "DELETE", f"/v1/caches/{cache['id']}", KEY_A)
