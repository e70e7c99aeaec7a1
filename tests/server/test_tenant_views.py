"""Issue 28 item 4 against an in-process server with two tenant keys and an admin key: a tenant's
`/v1/cache/report` shows its own part only (not the other tenant's name, prefixes or the pool), the
admin's shows everyone with each tenant's /metrics label, and the /metrics tenant labels are keyed
hashes that no API key yields without the server's secret, or absent with `tenant_labels="off"`."""

from __future__ import annotations

import hashlib
import re

import httpx
import pytest

from kvserve.server.auth import key_namespace
from tests.server.conftest import ServerThread

KEY_A, KEY_B, ADMIN = "sk-tenant-a", "sk-tenant-b", "sk-admin"
PROMPTS = {KEY_A: "Alpha's private ledger: " + "credits and debits, " * 20,
           KEY_B: "Bravo's travel notes: " + "harbours and ferries, " * 20}


def get(url: str, path: str, key: str) -> httpx.Response:
    return httpx.get(url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def complete(url: str, key: str, model: str) -> None:
    response = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                          json={"model": model, "prompt": PROMPTS[key], "max_tokens": 1})
    assert response.status_code == 200, response.text


def tenant_labels(metrics_text: str) -> set[str]:
    return set(re.findall(r'kvserve:tenant_prompt_tokens_total\{[^}]*tenant="([^"]+)"', metrics_text))


@pytest.fixture(scope="module")
def tenants(model_name):
    """An engine of its own: the suite's shared one has seen more tenants than the operator's view
    names one by one (cache_report.MAX_TENANTS)."""
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app
    from tests.server.conftest import SMALL_ENGINE

    app = build_app(LLMEngine(EngineConfig(**SMALL_ENGINE)), api_keys=[KEY_A, KEY_B], admin_api_keys=[ADMIN],
                    metrics_tenant_secret=b"a secret of this server only")
    with ServerThread(app) as running:
        for key in (KEY_A, KEY_B, KEY_A):
            complete(running.url, key, model_name)
        yield running


def test_a_tenant_sees_its_own_part_of_the_cache_report_and_the_admin_sees_all(tenants):
    own = get(tenants.url, "/v1/cache/report", KEY_B).json()
    everyone = get(tenants.url, "/v1/cache/report", ADMIN).json()
    assert own["scope"] == "tenant" and everyone["scope"] == "all"
    assert list(own["tenants"]) == [key_namespace(KEY_B)]
    assert own["tenants"][key_namespace(KEY_B)]["requests"] >= 1
    assert "pages" not in own and "thrash_pages" not in own  # the pool is everyone's
    assert {key_namespace(KEY_A), key_namespace(KEY_B)} <= set(everyone["tenants"])
    a_prefixes = {p["prefix_id"] for p in get(tenants.url, "/v1/cache/report", KEY_A).json()["top_prefixes_by_reuse"]}
    b_prefixes = {p["prefix_id"] for p in own["top_prefixes_by_reuse"]}
    assert a_prefixes and b_prefixes and not a_prefixes & b_prefixes
    assert a_prefixes | b_prefixes <= {p["prefix_id"] for p in everyone["top_prefixes_by_reuse"]}
    assert key_namespace(KEY_A) not in str(own)
    assert get(tenants.url, "/v1/cache/report", "sk-nobody").status_code == 401


def test_metrics_tenant_labels_are_keyed_by_the_server_secret(tenants):
    from kvserve.metrics import EngineMetrics

    text = httpx.get(tenants.url + "/metrics", timeout=60).text
    labels = tenant_labels(text)
    admin = get(tenants.url, "/v1/cache/report", ADMIN).json()["tenants"]
    for key in (KEY_A, KEY_B):
        label = admin[key_namespace(key)]["metrics_label"]
        assert label in labels
        derived = {key, key_namespace(key), hashlib.sha256(key.encode()).hexdigest()}
        assert not any(label in d or d in text for d in derived)  # nothing computable from the key
        other_secret = EngineMetrics("m", tenant_secret=b"another server's secret").tenant_label(key_namespace(key))
        assert other_secret != label  # the label depends on the secret


def test_metrics_tenant_labels_off(async_engine, model_name):
    from kvserve.server.api import build_app

    with ServerThread(build_app(async_engine, api_keys=[KEY_A], metrics_tenant_labels="off")) as running:
        complete(running.url, KEY_A, model_name)
        text = httpx.get(running.url + "/metrics", timeout=60).text
    assert 'tenant="' not in text


def test_a_tenant_past_the_named_ones_still_gets_its_own_report():
    """Past MAX_TENANTS the operator's view sums tenants as "other"; each still sees its own part."""
    from kvserve.cache_report import MAX_TENANTS, CacheReporter
    from kvserve.engine_stats import EngineStats
    from kvserve.request import Request
    from kvserve.sampling_params import SamplingParams

    reporter = CacheReporter(16, 1.0, "bfloat16")
    for i in range(MAX_TENANTS + 3):
        reporter.first_token(Request(f"r{i}", list(range(40)), SamplingParams(), tenant=f"key:{i}"))
    late = reporter.report(EngineStats(), "\0", tenant=f"key:{MAX_TENANTS + 2}")
    assert late["tenants"] == {f"key:{MAX_TENANTS + 2}": {"requests": 1, "prompt_tokens": 40, "cached_tokens": 0,
                                                          "hit_rate": 0.0}}
    assert len(late["top_prefixes_by_reuse"]) == 1
    assert "other" in reporter.report(EngineStats(), "\0")["tenants"]
