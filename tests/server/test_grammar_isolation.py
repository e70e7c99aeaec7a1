"""Grammar work cannot stall or inform another tenant (issue 44): while tenant A's 10,000-property JSON
schema compiles, tenant B's greedy requests keep their latency and /health stays fast; a schema past the
compile budget gets a 400 naming the limit, and its retry comes at once (no second compile); B sending
A's schema costs what a never-seen schema costs (the compiled cache is per tenant: no timing oracle)."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerThread, poll_health_while

KEY_A, KEY_B = "sk-grammar-a", "sk-grammar-b"
BUDGET_S = 3.0
MODEL = [""]  # the served model's name, set by the fixture


def schema(num_properties: int, tag: str = "p") -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(num_properties)}}


@pytest.fixture(scope="module")
def keyed():
    from kvserve.async_engine import AsyncEngine
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app, default_model_name
    from tests.server.conftest import SMALL_ENGINE

    engine = AsyncEngine(LLMEngine(EngineConfig(**SMALL_ENGINE, grammar_compile_timeout=BUDGET_S))).start()
    with ServerThread(build_app(engine, api_keys=[KEY_A, KEY_B])) as running:
        MODEL[0] = default_model_name(engine.engine)
        yield running
    engine.shutdown()


def ask(url: str, key: str, json_schema: dict | None = None, max_tokens: int = 1) -> tuple[int, float, dict]:
    body = {"model": MODEL[0], "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": max_tokens,
            "temperature": 0}
    if json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": json_schema}}
    start = time.perf_counter()
    answer = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                        timeout=300)
    return answer.status_code, time.perf_counter() - start, answer.json()


@pytest.mark.slow
def test_a_huge_schema_neither_stalls_nor_informs_another_tenant(keyed):
    url = keyed.url
    assert ask(url, KEY_B)[0] == 200  # (warm-up)

    # A's schema sent by B costs a compile, as a schema nobody sent does; A's repeat does not
    shared, fresh = schema(2_000, "s"), schema(2_000, "f")
    status, _, body = ask(url, KEY_A, shared)
    # compiled, then its first token: llguidance's parser may find the 2,000 properties past its row
    # limit there (7,999 items of 2,000), which the engine answers as a constraint it cannot enforce
    assert status == 200 or (status == 400 and body["error"]["code"] == "constraint_not_enforceable"), body
    a_again = ask(url, KEY_A, shared)[1]
    b_shared = ask(url, KEY_B, shared)[1]
    b_fresh = ask(url, KEY_B, fresh)[1]
    print(f"A repeat {a_again:.2f} s, B with A's schema {b_shared:.2f} s, B with a new one {b_fresh:.2f} s")
    assert b_shared > 0.5 * b_fresh and b_shared > 2 * a_again

    idle = [ask(url, KEY_B)[1] for _ in range(5)]

    outcome = {}

    def tenant_a() -> None:
        outcome["a"] = ask(url, KEY_A, schema(10_000))

    busy: list[tuple[int, float, dict]] = []

    def tenant_b() -> None:
        time.sleep(0.5)  # A's compile has started
        busy.extend(ask(url, KEY_B) for _ in range(5))

    health = poll_health_while(url, [threading.Thread(target=tenant_a), threading.Thread(target=tenant_b)])
    status, seconds, body = outcome["a"]
    assert all(b[0] == 200 for b in busy)
    busy = [b[1] for b in busy]
    print(f"B idle {statistics.median(idle) * 1e3:.0f} ms, during A's compile {statistics.median(busy) * 1e3:.0f} ms;"
          f" /health max {max(health) * 1e3:.0f} ms over {len(health)} polls; A: {status} in {seconds:.1f} s")
    assert statistics.median(busy) <= 1.5 * statistics.median(idle) + 0.1
    assert max(health) < 0.1
    if status == 400:  # this host did not compile it within the budget: the answer names the limit
        assert "--grammar-compile-timeout" in body["error"]["message"] and seconds < BUDGET_S + 2

    # past the budget: a 400 naming the limit, then at once for the retry
    status, first, body = ask(url, KEY_A, schema(15_000))
    assert status == 400 and "--grammar-compile-timeout" in body["error"]["message"], body
    assert first < BUDGET_S + 2
    status, retry, _ = ask(url, KEY_A, schema(15_000))
    assert status == 400 and retry < 1.0, retry
