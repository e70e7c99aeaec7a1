"""Issue 28 item 10: named caches on one prefix each hold a lease of their own, so deleting one leaves
another working until its own TTL; lease ids are not a counter."""

from __future__ import annotations

import time

import httpx

from tests.server.test_anthropic import handbook


def call(server, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, server.url + path, timeout=300, **kwargs)


def test_deleting_one_named_cache_leaves_another_on_the_same_prefix(server, async_engine,
                                                                    model_name):
    prompt = handbook(1200)
    leases = async_engine.engine.manager.leases.leases
    before = set(leases)
    for first_ttl, second_ttl, second_s in (("5m", "1h", 3600), ("1h", "5m", 300)):
        first = call(server, "POST", "/v1/caches", json={"name": f"x-{first_ttl}", "prompt": prompt,
                                                         "ttl": first_ttl})
        second = call(server, "POST", "/v1/caches", json={"name": f"y-{second_ttl}",
                                                          "prompt": prompt, "ttl": second_ttl})
        assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
        x, y = first.json(), second.json()
        try:
            new = set(leases) - before
            assert len(new) == 2 and all(len(i) > 20 for i in new)  # not lease-0, lease-1
            assert call(server, "DELETE", f"/v1/caches/{x['id']}").status_code == 200
            shown = call(server, "GET", f"/v1/caches/{y['id']}")
            assert shown.status_code == 200, shown.text
            expires = shown.json()["expires_at"]
            assert time.time() + second_s - 60 < expires <= time.time() + second_s + 1  # its own
            used = call(server, "POST", "/v1/completions",
                        json={"model": model_name, "prompt": prompt + " Next", "max_tokens": 1})
            cached = used.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached > y["tokens"] - async_engine.engine.config.page_size
        finally:
            call(server, "DELETE", f"/v1/caches/{x['id']}")
            call(server, "DELETE", f"/v1/caches/{y['id']}")
        assert set(leases) <= before
