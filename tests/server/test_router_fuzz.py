"""Generated: `kvserve router` in front of a running `kvserve serve`, fuzzed on every route it forwards with
the backend's own OpenAPI document (valid and invalid cases) and with structure mutations the schema cannot
describe. Properties: no 5xx from the router, every error JSON in its API family's shape, no traceback in
either process's log, and no KV page in use on the backend afterwards. And through the router, as straight
to a server (test_stream_equivalence.py), a streamed answer adds up to the whole one.

CI runs KVSERVE_ROUTER_FUZZ_CASES (default 200) schema cases and a quarter as many mutations."""

from __future__ import annotations

import json
import os
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_schema_fuzz import (SERVE, call_with_little_work, family_shape, generated,
                                           structure_mutation, wait_no_pages_in_use)
from tests.server.test_stream_equivalence import READERS, STOP_PIECES, request

schemathesis = pytest.importorskip("schemathesis")

NUM_CASES = int(os.environ.get("KVSERVE_ROUTER_FUZZ_CASES", "200"))
FORWARDED = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/messages"),
             ("POST", "/v1/responses")}


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """(router url, backend url)."""
    from tests.redis_server import free_port
    from tests.server.test_router import start, stop, wait_healthy

    logs = tmp_path_factory.mktemp("router-fuzz")
    backend_port, router_port = free_port(), free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    procs = [start(["serve", "--port", str(backend_port), *SERVE], logs / "serve.log")]
    try:
        wait_healthy(backend, procs, [logs / "serve.log"])
        procs.append(start(["router", "--backend", backend, "--port", str(router_port), "--log-level", "warning"],
                           logs / "router.log"))
        router = f"http://127.0.0.1:{router_port}"
        wait_healthy(router, procs, [logs / "serve.log", logs / "router.log"])
        yield router, backend
    finally:
        stop(procs)
    for name in ("serve.log", "router.log"):
        text = (logs / name).read_text()
        assert "Traceback" not in text, (name, text[-4000:])


def answered_in_shape(path: str, response) -> None:
    assert response.status_code < 500, (path, response.status_code, response.content[:300])
    if response.status_code >= 400:
        assert family_shape(path, json.loads(response.content)), (path, response.content[:300])


@pytest.mark.slow
def test_the_routers_routes_fuzzed_from_the_backends_document(routed):
    from schemathesis import GenerationMode

    router, backend = routed
    schema = schemathesis.openapi.from_url(backend + "/openapi.json")
    operations = [op for op in (r.ok() for r in schema.get_all_operations())
                  if (op.method.upper(), op.path) in FORWARDED]
    assert {(op.method.upper(), op.path) for op in operations} == FORWARDED
    strategies = [op.as_strategy(generation_mode=mode) for op in operations
                  for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    statuses: Counter = Counter()

    @generated(NUM_CASES)
    @given(case=st.one_of(strategies))
    def run(case):
        response = call_with_little_work(case, router)
        statuses[response.status_code] += 1
        answered_in_shape(case.operation.path, response)

    run()

    @generated(max(NUM_CASES // 4, 20))
    @given(path=st.sampled_from(sorted(path for _, path in FORWARDED)), mutation=structure_mutation())
    def mutate(path, mutation):
        kind, raw = mutation
        response = httpx.post(router + path, content=raw, headers={"content-type": "application/json"},
                              timeout=120)
        statuses[response.status_code] += 1
        answered_in_shape(path, response)

    mutate()
    print("router fuzz:", json.dumps(dict(statuses)))
    assert statuses[200] and sum(n for s, n in statuses.items() if 400 <= s < 500)  # both kinds were reached
    assert wait_no_pages_in_use(backend) == 0


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(family=st.sampled_from(["completions", "chat", "anthropic", "responses"]),
       stop=st.lists(STOP_PIECES, max_size=3), max_tokens=st.integers(1, 16),
       seed=st.none() | st.integers(0, 2**31 - 1), n=st.integers(1, 2), logprobs=st.booleans())
def test_through_the_router_a_stream_adds_up_to_the_whole_answer(routed, family, stop, max_tokens, seed, n,
                                                                 logprobs):
    """The router relays (and, to resume a broken stream, re-reads) each event: what reaches the client
    still adds up to the whole answer, for the four API families it forwards."""
    router, _ = routed
    seeded = seed is not None and family in ("completions", "chat")  # (the others have no seed)
    sampling = {"temperature": 0.9, "seed": seed} if seeded else {"temperature": 0}
    path, body = request(family, stop, max_tokens, sampling, n if seeded else 1, logprobs)
    model = httpx.get(router + "/v1/models", timeout=30).json()["data"][0]["id"]
    with httpx.Client(base_url=router, timeout=120) as http:
        whole = http.post(path, json={**body, "model": model, "stream": False})
        assert whole.status_code == 200, whole.text
        with http.stream("POST", path, json={**body, "model": model, "stream": True}) as streamed:
            assert streamed.status_code == 200
            lines = [line for line in streamed.iter_lines() if line.strip()]
    expected, got = READERS[family](whole.json(), lines)
    assert got == expected
