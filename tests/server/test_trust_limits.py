"""Issue 28 items 9 and 12 against in-process servers: a request without a valid key is refused from
its headers, its body never buffered (200 slow 4 MB uploads hold little memory and are all closed,
those being drained after the read timeout); a slow body with a valid key gets a 408; and a
shutdown that cuts non-streamed requests answers each route with a 503 and counts them all."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerThread
from tests.server.test_limits import rss_bytes

MB = 1 << 20
READ_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def keyed(async_engine):
    from kvserve.server.api import build_app

    app = build_app(async_engine, api_keys=["sk-good"], read_timeout_s=READ_TIMEOUT_S,
                    max_unauthenticated=16)
    with ServerThread(app) as running:
        yield running


def start_upload(port: int, key: str | None, total: int = 4 * MB, send: int = 1 * MB) -> socket.socket:
    """Open a POST declaring `total` body bytes, push up to `send` of them without blocking (what
    the socket buffers take), then stall like a slow client."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"{auth}Content-Length: {total}\r\n\r\n").encode())
    sock.setblocking(False)
    block, sent = b"x" * (64 << 10), 0
    try:
        while sent < send:
            sent += sock.send(block)
    except (BlockingIOError, OSError):
        pass
    sock.settimeout(30)
    return sock


def answer(sock: socket.socket) -> tuple[int | None, float]:
    """(status or None if the connection was reset, seconds until the server closed it); raises
    socket.timeout if the server holds the connection open."""
    data, t0 = b"", time.monotonic()
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    status = int(data.split(b" ")[1]) if data.startswith(b"HTTP/1.1 ") else None
    return status, time.monotonic() - t0


@pytest.mark.slow
def test_200_unauthenticated_slow_4mb_uploads_add_little_memory_and_are_all_closed(keyed):
    before = rss_bytes()
    t0 = time.monotonic()
    socks = [start_upload(keyed.port, key=None) for _ in range(200)]
    time.sleep(0.5)  # let the server take what was sent
    grown = rss_bytes() - before
    answers = [answer(s) for s in socks]
    elapsed = time.monotonic() - t0
    statuses = [status for status, _ in answers]
    print(f"RSS +{grown / MB:.1f} MB with 200 uploads held; all closed after {elapsed:.1f} s; "
          f"401s: {statuses.count(401)}, resets: {statuses.count(None)}")
    assert set(statuses) <= {401, None} and statuses.count(401) >= 16  # the drained ones read it
    assert grown < 50 * MB
    assert keyed.server.config.app.state.door.admission.held == 0


def test_a_slow_body_with_a_valid_key_gets_a_408_after_the_read_timeout(keyed):
    status, seconds = answer(start_upload(keyed.port, key="sk-good", send=64 << 10))
    assert status == 408
    assert seconds >= READ_TIMEOUT_S - 0.5  # not refused before its time


def test_a_wrong_key_is_refused_before_the_body_but_the_client_reads_the_401(keyed):
    for path in ("/v1/completions", "/v1/messages", "/v1/caches", "/tokenize", "/v1/anything"):
        r = httpx.post(keyed.url + path, json={"prompt": "x" * 50_000}, timeout=30,
                       headers={"authorization": "Bearer sk-bad"})
        assert r.status_code == 401, path
        assert "API key" in (r.json()["error"]["message"])
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200  # open pages stay open
    ok = httpx.post(keyed.url + "/v1/completions", timeout=120, headers={"x-api-key": "sk-good"},
                    json={"prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200


# -- shutdown ---------------------------------------------------------------------------------------
def test_a_shutdown_cut_is_a_503_on_every_route_and_each_route_is_counted(async_engine, model_name):
    from kvserve.server.api import build_app
    from kvserve.server.launch import _Drain

    app = build_app(async_engine)
    door = app.state.door
    drain = _Drain(app, 0.5)
    story = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]
    requests = {
        "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True},
        "/v1/chat/completions": {"messages": story, "max_tokens": 1500, "ignore_eos": True},
        "/v1/messages": {"model": model_name, "messages": story, "max_tokens": 1500},
    }
    results: dict[str, httpx.Response] = {}
    with ServerThread(app) as running:
        workers = [threading.Thread(target=lambda p=p, b=b: results.__setitem__(
            p, httpx.post(running.url + p, json=b, timeout=300))) for p, b in requests.items()]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 120
        while door.num_in_flight < 3:
            assert time.monotonic() < deadline, "the requests never got in"
            time.sleep(0.02)
        drain.begin()
        for worker in workers:
            worker.join(120)
        late = httpx.post(running.url + "/v1/messages", json=requests["/v1/messages"], timeout=60)
    drain.done.set()
    assert drain.num_aborted == 3  # /v1/messages counted like the OpenAI routes
    for path, response in results.items():
        assert response.status_code == 503, (path, response.text[:300])
        body = response.json()
        assert "shutting down" in body["error"]["message"] and "0.5 s shutdown timeout" in \
            body["error"]["message"], path
    assert late.status_code == 503
    assert door.num_in_flight == 0
