"""Issue 42: no tenant key changes another tenant's state. Tenant A caches a prompt, creates a named
cache and stores a response; tenant B then calls every route of the app (walked from the app itself,
A's ids in the path parameters, a valid body where one is known), and after each call A's state is
read again. The routes that changed it are listed; the answer must be none."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import ServerThread

KEY_A, KEY_B, ADMIN = "sk-walk-a", "sk-walk-b", "sk-walk-admin"
PROMPT_A = "Alpha keeps the harbour ledger: " + "ships in, ships out, cargo weighed, " * 12
UNLEASED_A = "Alpha's unleased diary: " + "tides, gulls and rope, " * 12  # cached, held by nothing


def call(url: str, method: str, path: str, key: str, **kw) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {key}"}, timeout=300, **kw)


def bodies(model: str) -> dict[str, dict]:
    """A valid body for each body route (the others get `{}`), each asking for little work."""
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPT_A}], "max_tokens": 1}
    return {"/v1/completions": {"model": model, "prompt": PROMPT_A, "max_tokens": 1},
            "/v1/chat/completions": chat, "/v1/chat/completions/render": chat,
            "/v1/completions/render": {"model": model, "prompt": PROMPT_A},
            "/v1/messages": chat, "/v1/messages/count_tokens": chat,
            "/v1/caches": {"name": "b-cache", "prompt": PROMPT_A},
            "/v1/responses": {"model": model, "input": PROMPT_A, "max_output_tokens": 1},
            "/api/chat": {**chat, "stream": False, "keep_alive": "1s", "options": {"num_ctx": 512}},
            "/api/generate": {"model": model, "prompt": "", "keep_alive": 0},
            "/api/show": {"model": model}, "/tokenize": {"prompt": PROMPT_A},
            "/completion": {"prompt": PROMPT_A, "n_predict": 1}}


@pytest.fixture(scope="module")
def walk(model_name):
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app
    from tests.server.conftest import SMALL_ENGINE

    engine = LLMEngine(EngineConfig(**SMALL_ENGINE, min_cacheable_tokens=32))
    app = build_app(engine, api_keys=[KEY_A, KEY_B], admin_api_keys=[ADMIN])
    with ServerThread(app) as running:
        cache = call(running.url, "POST", "/v1/caches", KEY_A, json={"name": "a-cache", "prompt": PROMPT_A})
        stored = call(running.url, "POST", "/v1/responses", KEY_A,
                      json={"model": model_name, "input": "Alpha's note", "max_output_tokens": 1})
        chat = call(running.url, "POST", "/api/chat", KEY_A, json={
            "model": model_name, "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "keep_alive": "1h", "options": {"num_ctx": 1024}})
        assert cache.status_code == stored.status_code == chat.status_code == 200, (cache.text, stored.text)
        yield running, app, cache.json()["id"], stored.json()["id"]


def state_of_a(url: str, model: str, cache_id: str, response_id: str) -> dict:
    """What tenant A observes of its own state (reading it changes none of it)."""
    cached = [call(url, "POST", "/v1/completions", KEY_A, json={"model": model, "prompt": p, "max_tokens": 1})
              .json()["usage"]["prompt_tokens_details"]["cached_tokens"] for p in (PROMPT_A, UNLEASED_A)]
    ps = call(url, "GET", "/api/ps", KEY_A).json()["models"][0]
    return {"cached_tokens": cached,
            "caches": sorted(c["id"] for c in call(url, "GET", "/v1/caches", KEY_A).json()["data"]),
            "cache": call(url, "GET", f"/v1/caches/{cache_id}", KEY_A).status_code,
            "response": call(url, "GET", f"/v1/responses/{response_id}", KEY_A).status_code,
            "ps": (ps.get("expires_at"), ps.get("context_length"))}


def test_no_route_lets_one_tenant_change_another_tenants_state(walk, model_name):
    running, app, cache_id, response_id = walk
    before = state_of_a(running.url, model_name, cache_id, response_id)
    before = state_of_a(running.url, model_name, cache_id, response_id)  # the first read cached UNLEASED_A
    assert min(before["cached_tokens"]) > 0 and before["cache"] == before["response"] == 200, before
    known = bodies(model_name)
    changed, walked = [], []
    for route in app.routes:
        for method in sorted(set(getattr(route, "methods", None) or ()) - {"HEAD"}):
            path = route.path.replace("{cache_id}", cache_id).replace("{response_id}", response_id)
            body = known.get(route.path, {}) if method in ("POST", "PUT", "PATCH") else None
            if method == "PATCH":
                body = {"ttl": "1h"}
            response = call(running.url, method, path, KEY_B, json=body)
            assert response.status_code < 500, (method, path, response.text[:300])
            walked.append((method, route.path))
            if state_of_a(running.url, model_name, cache_id, response_id) != before:
                changed.append((method, route.path))
                before = state_of_a(running.url, model_name, cache_id, response_id)
    assert len(walked) >= 25, walked
    assert changed == [], f"tenant B changed tenant A's state through {changed}"


def test_one_tenant_cannot_wipe_every_tenants_cache_but_the_admin_can(model_name):
    """The probe's case: A's prompt cached, B's reset used to answer 200 and leave A at 0 cached."""
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app
    from tests.server.conftest import SMALL_ENGINE

    app = build_app(LLMEngine(EngineConfig(**SMALL_ENGINE)), api_keys=[KEY_A, KEY_B], admin_api_keys=[ADMIN])
    body = {"model": model_name, "prompt": UNLEASED_A, "max_tokens": 1}
    with ServerThread(app) as running:
        call(running.url, "POST", "/v1/completions", KEY_A, json=body)
        refused = call(running.url, "POST", "/reset_prefix_cache", KEY_B)
        assert refused.status_code == 403, refused.text
        cached = call(running.url, "POST", "/v1/completions", KEY_A, json=body).json()
        assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        assert call(running.url, "POST", "/reset_prefix_cache", ADMIN).status_code == 200
        again = call(running.url, "POST", "/v1/completions", KEY_A, json=body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
