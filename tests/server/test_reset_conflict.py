"""`POST /reset_prefix_cache` refused while pages are held says what holds them (issue 44): a lease
(here a tenant's named cache) is not "requests are running"; once the lease is gone the reset runs."""

from __future__ import annotations

import httpx

from tests.server.conftest import SMALL_ENGINE, ServerThread

TENANT, ADMIN = "sk-reset-tenant", "sk-reset-admin"
PROMPT = "The harbour ledger of the night watch: " + "ships in, ships out, cargo weighed, " * 12


def call(url: str, method: str, path: str, key: str, **kw) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {key}"}, timeout=300, **kw)


def test_a_reset_refused_for_a_lease_names_the_lease_and_runs_once_it_is_gone():
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app

    engine = LLMEngine(EngineConfig(**SMALL_ENGINE, min_cacheable_tokens=32))
    with ServerThread(build_app(engine, api_keys=[TENANT], admin_api_keys=[ADMIN])) as running:
        cache = call(running.url, "POST", "/v1/caches", TENANT, json={"name": "ledger", "prompt": PROMPT})
        assert cache.status_code == 200, cache.text
        refused = call(running.url, "POST", "/reset_prefix_cache", ADMIN)
        assert refused.status_code == 409, refused.text
        message = refused.json()["error"]["message"]
        assert message.startswith("0 requests are running and 1 leases hold pages"), message
        assert call(running.url, "DELETE", f"/v1/caches/{cache.json()['id']}", TENANT).status_code == 200
        assert call(running.url, "POST", "/reset_prefix_cache", ADMIN).status_code == 200
