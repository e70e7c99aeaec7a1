"""Issue 18 against the in-process server: oversized bodies get a 413 before parsing while /health
stays fast, tokenization never blocks the event loop, admission control answers 429 with
Retry-After (counting prompts x n), validation names the actual problem, and API keys guard the
schema pages."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerThread, poll_health_while

MB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def post_raw(port: int, total: int, chunked: bool, timeout: float = 10.0) -> tuple[int, float]:
    """POST a `total`-byte body the way an abusive client does (declared up front, or chunked with
    no length), sending it from a thread while reading the answer; (status, seconds to it)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{length}\r\n\r\n").encode()
    block = b"x" * (64 << 10)
    start = time.monotonic()

    def send_body() -> None:
        try:
            sock.sendall(head)
            sent = 0
            while sent < total:
                sock.sendall(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
                sent += len(block)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: expected

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    finally:
        elapsed = time.monotonic() - start
        sock.close()
    return int(data.split(b" ")[1]), elapsed


def test_three_20mb_bodies_get_413_in_under_a_second_while_health_stays_fast(server):
    before = rss_bytes()
    results: list[tuple[int, float]] = []
    clients = [threading.Thread(target=lambda c=c: results.append(post_raw(server.port, 20 * MB, c)))
               for c in (False, False, True)]
    health: list[float] = []
    with httpx.Client(timeout=5) as http:
        for t in clients:
            t.start()
        while any(t.is_alive() for t in clients):
            t0 = time.monotonic()
            assert http.get(server.url + "/health").status_code == 200
            health.append(time.monotonic() - t0)
    assert sorted(status for status, _ in results) == [413, 413, 413]
    assert max(seconds for _, seconds in results) < 1.0
    assert health and max(health) < 0.5
    assert rss_bytes() - before < 32 * MB  # nothing near the 60 MB sent was kept


def test_413_names_the_limit(server):
    response = httpx.post(server.url + "/v1/completions", content=b"x" * (5 * MB),
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 413
    assert "--max-request-bytes" in response.json()["error"]["message"]


def test_tokenization_does_not_delay_health(server, model_name, async_engine):
    """Eight prompts of the longest text that might fit max_model_len (~0.3 s each to tokenize)
    at once: tokenized on worker threads that release the GIL."""
    door = server.server.config.app.state.door
    prompt = ("lorem ipsum dolor sit amet " * (door.max_prompt_chars // 27 + 1))
    prompt = prompt[:door.max_prompt_chars]
    done: list[httpx.Response] = []
    workers = [threading.Thread(target=lambda: done.append(httpx.post(
        server.url + "/v1/completions", json={"model": model_name, "prompt": prompt,
                                              "max_tokens": 1}, timeout=120)))
        for _ in range(8)]
    health = poll_health_while(server.url, workers)
    assert len(done) == 8
    for response in done:  # tokenized, then refused by the engine's length check
        assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"]
    assert len(health) > 5 and max(health) < 0.5


def test_text_too_long_for_any_tokenization_is_refused_without_tokenizing(server, model_name):
    t0 = time.monotonic()
    response = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"model": model_name, "prompt": "a" * (3 * MB), "max_tokens": 1})
    assert response.status_code == 400 and "however it tokenizes" in response.json()["error"]["message"]
    assert time.monotonic() - t0 < 1.0


def test_worker_tokenization_matches_the_engine(async_engine):
    from kvserve.server.front import FrontDoor

    door = FrontDoor(async_engine)
    for text in ("Hello, world!", "<|im_start|>user\nhé 日本語 🙂<|im_end|>", "  spaced\n\ttabs"):
        assert door.encode(text) == async_engine.engine.tokenize(text)[1]
    door.close()


@pytest.mark.parametrize("body, expected", [
    ({"prompt": [-1]}, "token ids must be non-negative"),
    ({"prompt": [[5, 6], [-3]]}, "prompt 1: token ids must be non-negative"),
    ({"prompt": "x", "stop": ["s"] * 1000}, "at most 16 stop strings"),
    ({"prompt": "x", "stop": 5}, "stop must be a string or a list of strings"),
    ({"prompt": ["a", 1]}, "not a mix"),
    ({"prompt": ["a"] * 65}, "at most 64 prompts"),
])
def test_validation_names_the_actual_problem(server, body, expected):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert expected in response.json()["error"]["message"]


def test_token_ids_beyond_the_vocabulary_are_a_400(server, async_engine):
    vocab = async_engine.engine.loaded.config.vocab_size
    response = httpx.post(server.url + "/v1/completions",
                          json={"prompt": [1, vocab], "max_tokens": 1}, timeout=30)
    assert response.status_code == 400 and str(vocab) in response.json()["error"]["message"]


# -- admission control -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited(async_engine):
    """At most 4 engine requests waiting; one API key may hold at most 3."""
    from kvserve.server.api import build_app

    app = build_app(async_engine, api_keys=["sk-a", "sk-b"], max_waiting_requests=4,
                    max_requests_per_tenant=3)
    with ServerThread(app) as running:
        yield running


def _complete(url: str, key: str, results: list, **body) -> None:
    payload = {"prompt": "Count: one, two,", "max_tokens": 8, "temperature": 0, **body}
    results.append(httpx.post(url + "/v1/completions", json=payload, timeout=120,
                              headers={"authorization": f"Bearer {key}"}))


def test_a_flood_beyond_max_waiting_requests_gets_429_and_the_admitted_complete(limited,
                                                                                async_engine):
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=_complete, args=(limited.url, key, results), kwargs={"n": 2})
               for _ in range(8) for key in ("sk-a", "sk-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = [r.status_code for r in results]
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses
    for r in results:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            choices = r.json()["choices"]
            assert len(choices) == 2 and all(c["finish_reason"] == "length" for c in choices)
    door = limited.server.config.app.state.door
    assert door.admission.held == 0 and not door.admission.by_tenant


def test_a_batch_counts_each_prompt_and_sample_and_one_that_can_never_fit_is_a_400(limited):
    """Issue 28 item 11: over a limit by itself, a request could never be admitted: 400, not 429."""
    results: list[httpx.Response] = []
    _complete(limited.url, "sk-a", results, prompt=["a", "b"], n=2)  # 4 > 3 per key
    _complete(limited.url, "sk-b", results, prompt=["a", "b", "c"], n=2)  # 6 > 4 waiting
    _complete(limited.url, "sk-b", results, n=5)  # 5 > 4 waiting, with one prompt
    assert [r.status_code for r in results] == [400, 400, 400]
    assert "--max-requests-per-tenant" in results[0].json()["error"]["message"]
    assert "--max-waiting-requests" in results[1].json()["error"]["message"]
    assert "n=" not in results[2].json()["error"]["message"] and "5 engine requests" in \
        results[2].json()["error"]["message"]
    assert all("retry-after" not in r.headers for r in results)
    _complete(limited.url, "sk-a", results, prompt=["a", "b", "c"])  # 3 fits
    assert results[-1].status_code == 200 and len(results[-1].json()["choices"]) == 3


def test_docs_and_schema_need_the_key_when_keys_are_set(limited, server):
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(limited.url + path, timeout=10).status_code == 401
        assert httpx.get(limited.url + path, timeout=10,
                         headers={"authorization": "Bearer sk-b"}).status_code == 200
        assert httpx.get(server.url + path, timeout=10).status_code == 200  # no keys: open
    assert httpx.get(limited.url + "/redoc", timeout=10,  # without a key, every path is a 401
                     headers={"authorization": "Bearer sk-b"}).status_code == 404
