"""Tenant isolation as a property (issue 42). Two servers, each its own engine, take the same
requests from tenant B; one of them also takes tenant A's requests interleaved with B's (drawn by
hypothesis, often A's prompts equal to B's). Whatever A did, B's observable answers must be the
same on both servers: texts, usage and cached tokens, kv_explain, named caches, stored responses
and their follow-ups, and B's own cache report. Timings are not compared (they depend on the
host's load, not on A). The pool is large enough that nothing is evicted, so capacity, which the
tenants do share, plays no part."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conftest import PROPERTY_MODE
from tests.server.conftest import ServerThread

KEY_A, KEY_B = "sk-iso-a", "sk-iso-b"
NUM_EXAMPLES = int(os.environ.get("KVSERVE_ISOLATION_EXAMPLES", "10"))
PROMPTS = ["The harbour master counts the boats at dawn, " * 4,
           "A recipe for bread: flour, water, salt and patience, " * 4,
           "The harbour master counts the boats at dawn, then the gulls, " * 3]
OPS = ["complete", "explain", "cache", "list_caches", "respond", "follow_up", "message", "report"]


class Refused(Exception):
    """A 4xx: the tenant's own limit (e.g. its named caches past its lease cap after many examples)."""


class Tenant:
    """One tenant's client on one server; `last_response` is its own latest stored response."""

    def __init__(self, url: str, key: str, model: str) -> None:
        self.url, self.key, self.model, self.last_response = url, key, model, None

    def post(self, path: str, body: dict) -> httpx.Response:
        r = httpx.post(self.url + path, json=body, timeout=300, headers={"Authorization": f"Bearer {self.key}"})
        return self._ok(path, r)

    def get(self, path: str) -> httpx.Response:
        return self._ok(path, httpx.get(self.url + path, timeout=60, headers={"Authorization": f"Bearer {self.key}"}))

    @staticmethod
    def _ok(path: str, r: httpx.Response) -> httpx.Response:
        if 400 <= r.status_code < 500:
            raise Refused(r.status_code, r.json())
        assert r.status_code == 200, (path, r.text[:300])
        return r

    def run(self, op: str, prompt: str, salt: int) -> object:
        """The op's observable answer, without ids and clock times (which differ by nature); a refusal
        is an answer too, and must be the same refusal on both servers."""
        try:
            return self._run(op, prompt, salt)
        except Refused as refused:
            return ("refused", *refused.args)

    def _run(self, op: str, prompt: str, salt: int) -> object:
        if op == "complete":
            r = self.post("/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0}).json()
            return r["choices"][0]["text"], r["usage"]
        if op == "explain":
            r = self.post("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                   "max_tokens": 2, "temperature": 0, "kv_explain": True}).json()
            return r["choices"][0]["message"]["content"], r["usage"], r["kv_cache"]
        if op == "cache":
            r = self.post("/v1/caches", {"name": f"c{salt}", "prompt": prompt})
            return {k: v for k, v in r.json().items() if k not in ("id", "created_at", "expires_at")}
        if op == "list_caches":
            return sorted((c["name"], c["tokens"]) for c in self.get("/v1/caches").json()["data"])
        if op in ("respond", "follow_up"):
            body = {"input": prompt[:60], "max_output_tokens": 2, "temperature": 0}
            if op == "follow_up" and self.last_response:
                body["previous_response_id"] = self.last_response
            r = self.post("/v1/responses", body).json()
            self.last_response = r["id"]
            return r["output"][0]["content"][0]["text"] if r.get("output") else None, r["usage"]
        if op == "message":
            r = self.post("/v1/messages", {"model": self.model, "max_tokens": 2, "temperature": 0, "messages": [
                {"role": "user", "content": [{"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}}]}]})
            r = r.json()
            return r.get("content"), r.get("usage")
        return self.get("/v1/cache/report").json()


@pytest.fixture(scope="module")
def two_servers():
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app

    config = dict(kv_cache_memory="256MiB", max_model_len=1024, dtype=PROPERTY_MODE, min_cacheable_tokens=16)
    with ServerThread(build_app(LLMEngine(EngineConfig(**config)), api_keys=[KEY_A, KEY_B])) as alone, \
            ServerThread(build_app(LLMEngine(EngineConfig(**config)), api_keys=[KEY_A, KEY_B])) as shared:
        yield alone, shared


step = st.tuples(st.sampled_from(["A", "B"]), st.sampled_from(OPS), st.sampled_from(range(len(PROMPTS))))


@pytest.mark.slow
def test_tenant_b_answers_the_same_whether_or_not_a_ran(two_servers, model_name):
    alone, shared = two_servers
    b_alone, b_shared = Tenant(alone.url, KEY_B, model_name), Tenant(shared.url, KEY_B, model_name)
    a_shared = Tenant(shared.url, KEY_A, model_name)
    tried = {"interleavings": 0, "a_steps": 0, "b_steps": 0, "b_refused": 0}
    counter = iter(range(1 << 30))

    @settings(max_examples=NUM_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(steps=st.lists(step, min_size=2, max_size=8).filter(lambda s: any(t == "B" for t, _, _ in s)))
    def run(steps):
        tried["interleavings"] += 1
        for tenant, op, prompt in steps:
            salt = next(counter)
            if tenant == "A":
                tried["a_steps"] += 1
                a_shared.run(op, PROMPTS[prompt], salt)
                continue
            tried["b_steps"] += 1
            expected = b_alone.run(op, PROMPTS[prompt], salt)
            assert b_shared.run(op, PROMPTS[prompt], salt) == expected, (op, steps)
            tried["b_refused"] += isinstance(expected, tuple) and expected[:1] == ("refused",)

    t0 = time.monotonic()
    run()
    print("tenant isolation:", json.dumps({**tried, "seconds": round(time.monotonic() - t0, 1)}))
    assert tried["b_refused"] <= tried["b_steps"] // 4, tried  # refusals on both sides would prove little
    for server in two_servers:  # nothing was evicted: capacity, which tenants share, played no part
        assert server.server.config.app.state.engine.engine.stats().as_dict()["num_evictions"] == 0
