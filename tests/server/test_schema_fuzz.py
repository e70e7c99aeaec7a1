"""Issue 42: every route of a running `kvserve serve` fuzzed from its own OpenAPI document with
schemathesis (valid and invalid cases), then with structure mutations the schema cannot describe
(deep nesting, huge arrays, invalid UTF-8, duplicate keys, NaN). Properties: no 5xx, every answer
inside its documented schema (errors in their API family's shape), /health fast throughout, and no
KV page in use once the leases the run took have expired.

CI runs KVSERVE_FUZZ_CASES (default 2,000) schema cases; set it higher for a long run."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")

NUM_CASES = int(os.environ.get("KVSERVE_FUZZ_CASES", "2000"))
NUM_MUTATIONS = int(os.environ.get("KVSERVE_FUZZ_MUTATIONS", "200"))
HEALTH_P99_S = float(os.environ.get("KVSERVE_FUZZ_HEALTH_P99_S", "0.1"))
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")
SERVE = ["--kv-cache-memory", "64MiB", "--max-model-len", "512", "--max-num-seqs", "8",
         "--min-cacheable-tokens", "16", "--lease-ttl-scale", "0.0002", "--log-level", "warning"]


def generated(num_cases: int):
    """Hypothesis settings of a fuzz run: `num_cases` fresh cases, no shrinking, no example database."""
    return settings(max_examples=num_cases, deadline=None, database=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))


class HealthWatch:
    """Polls /health every 50 ms on its own thread; the latencies (a failed poll counts as 10 s)."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = http.get(self.url + "/health").status_code == 200
                except httpx.TransportError:
                    ok = False
                self.latencies.append(time.monotonic() - t0 if ok else 10.0)
                time.sleep(0.05)

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def little_work(path: str, body):
    """A valid body asks for at most 2 generated tokens (a fuzz case is about the request, not the
    model's speed); the route's own token limit is set where the body left it out."""
    if not isinstance(body, dict):
        return body
    for name in TOKEN_LIMITS:
        if isinstance(body.get(name), int) and not isinstance(body.get(name), bool) and body[name] > 2:
            body[name] = 2
    limit = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_tokens",
             "/v1/responses": "max_output_tokens", "/completion": "n_predict"}.get(path)
    if limit and not any(name in body for name in TOKEN_LIMITS):
        body[limit] = 2
    if path in ("/api/chat", "/api/generate"):
        options = body.get("options")
        if options is None or isinstance(options, dict):
            options = dict(options or {})
            if not isinstance(options.get("num_predict"), int) or options["num_predict"] < 0 or options["num_predict"] > 2:
                options["num_predict"] = 2
            body["options"] = options
    return body


def call_with_little_work(case, base_url: str):
    """A schemathesis case sent to `base_url`, its body asking for little work (little_work)."""
    case.body = little_work(case.operation.path, case.body)
    return case.call(base_url=base_url, timeout=120)


def family_shape(path: str, body) -> bool:
    """Whether an error body is in its API family's documented shape."""
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and isinstance(body.get("error", {}).get("message"), str)
    if path.startswith("/api/"):
        return isinstance(body.get("error"), str)
    error = body.get("error")
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


def pages_in_use(url: str) -> int:
    return httpx.get(url + "/dashboard/stats", timeout=30).json()["num_pages_used"]


def wait_no_pages_in_use(url: str, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while (used := pages_in_use(url)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return used


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.redis_server import free_port
    from tests.server.test_router import start, stop, wait_healthy

    port, log = free_port(), tmp_path_factory.mktemp("fuzz") / "serve.log"
    proc = start(["serve", "--port", str(port), *SERVE], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc], [log])
        yield url
    finally:
        stop([proc])
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]


@pytest.mark.slow
def test_every_route_fuzzed_from_its_openapi_document(served):
    from schemathesis import GenerationMode
    from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                     response_schema_conformance, status_code_conformance)

    schema = schemathesis.openapi.from_url(served + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/messages", "/v1/responses", "/api/chat", "/v1/chat/completions", "/v1/caches"} <= paths
    strategies = []
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and not (op.body or op.path_parameters or op.query):
                continue  # nothing to make invalid
            strategies.append(op.as_strategy(generation_mode=mode))
    statuses: Counter = Counter()
    by_route: Counter = Counter()
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]

    @generated(NUM_CASES)
    @given(case=st.one_of(strategies))
    def run(case):
        response = call_with_little_work(case, served)
        statuses[response.status_code] += 1
        by_route[f"{case.method} {case.operation.path}"] += 1
        case.validate_response(response, checks=checks)
        if response.status_code >= 400:  # every error is JSON in its family's shape
            assert family_shape(case.operation.path, json.loads(response.content)), (
                case.operation.path, response.content[:300])

    t0 = time.monotonic()
    with HealthWatch(served) as health:
        run()
    elapsed = time.monotonic() - t0
    used = wait_no_pages_in_use(served)
    report = {"cases": sum(statuses.values()), "seconds": round(elapsed, 1), "statuses": dict(statuses),
              "routes": len(by_route), "health_polls": len(health.latencies),
              "health_p99_ms": round(health.p99() * 1000, 1), "pages_in_use_after": used}
    print("schema fuzz:", json.dumps(report))
    assert report["cases"] >= NUM_CASES and not any(s >= 500 for s in statuses)
    assert len(by_route) >= len({(op.method, op.path) for op in operations}) - 1, sorted(by_route)
    assert used == 0
    assert health.p99() < HEALTH_P99_S, report


def body_routes(url: str) -> list[tuple[str, str]]:
    spec = httpx.get(url + "/openapi.json", timeout=30).json()
    return [(method.upper(), path.replace("{cache_id}", "kvc_x").replace("{response_id}", "resp_x"))
            for path, operations in spec["paths"].items() for method, op in operations.items()
            if "requestBody" in op]


SEED_BODY = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
             "input": "hi", "name": "c", "options": {"num_predict": 1}, "stream": False}


def _nest(depth: int, leaf: bytes, array: bool) -> bytes:
    return (b"[" * depth + leaf + b"]" * depth) if array else (b'{"a":' * depth + leaf + b"}" * depth)


@st.composite
def structure_mutation(draw) -> tuple[str, bytes]:
    """A body the schema cannot describe: (what it is, its bytes)."""
    kind = draw(st.sampled_from(["deep", "deep-field", "huge-array", "invalid-utf8", "duplicate-keys",
                                 "nan", "truncated", "bare-scalar"]))
    seed = json.dumps(SEED_BODY).encode()
    if kind == "deep":
        return kind, _nest(draw(st.integers(129, 100_000)), b"1", draw(st.booleans()))
    if kind == "deep-field":
        field = draw(st.sampled_from([b"metadata", b"messages", b"prompt", b"options", b"response_format"]))
        return kind, b'{"model":"m","max_tokens":1,"' + field + b'":' + _nest(
            draw(st.integers(129, 50_000)), b"1", draw(st.booleans())) + b"}"
    if kind == "huge-array":
        count = draw(st.integers(525_000, 700_000))
        return kind, b'{"model":"m","prompt":[' + b",".join([b"0"] * count) + b"],\"max_tokens\":1}"
    if kind == "invalid-utf8":
        at = draw(st.integers(0, len(seed) - 1))
        return kind, seed[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])) + seed[at:]
    if kind == "duplicate-keys":
        return kind, seed[:-1] + b',"max_tokens":1,"model":"m","stream":false}'
    if kind == "nan":
        field = draw(st.sampled_from(["temperature", "top_p", "max_tokens", "n", "metadata"]))
        value = draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
        return kind, seed[:-1] + f',"{field}":{value}}}'.encode()
    if kind == "truncated":
        return kind, seed[:draw(st.integers(1, len(seed) - 1))]
    return kind, draw(st.sampled_from([b"1", b'"x"', b"null", b"true", b"[]", b"1e999999"]))


@pytest.mark.slow
def test_structure_mutations_on_every_body_route(served):
    routes = body_routes(served)
    assert len(routes) >= 12, routes
    seen: Counter = Counter()

    @generated(NUM_MUTATIONS)
    @given(route=st.sampled_from(routes), mutation=structure_mutation())
    def run(route, mutation):
        (method, path), (kind, body) = route, mutation
        response = httpx.request(method, served + path, content=body, timeout=120,
                                 headers={"content-type": "application/json"})
        seen[(kind, response.status_code)] += 1
        assert response.status_code < 500, (kind, path, response.text[:300])
        if response.status_code >= 400:
            assert family_shape(path, response.json()), (kind, path, response.text[:300])

    with HealthWatch(served) as health:
        run()
    used = wait_no_pages_in_use(served)
    print("structure mutations:", json.dumps({"cases": sum(seen.values()), "health_p99_ms": round(health.p99() * 1000, 1),
                                             "by_kind_status": {f"{k} {s}": n for (k, s), n in sorted(seen.items())},
                                             "pages_in_use_after": used}))
    assert {kind for kind, _ in seen} >= {"deep", "huge-array", "invalid-utf8", "nan"}
    assert used == 0
    assert health.p99() < HEALTH_P99_S
