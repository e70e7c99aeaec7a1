"""Issue 28's router findings against a real in-process router: a hostile backend's malformed
answers and events never reach a client (the request completes on the honest backend, a real
kvserve), bodies over --max-request-bytes get a 413 without any backend seeing them, a client that
resets its upload marks no backend down, a read past its deadline moves the request on without
marking the backend down, and a router with no backend's events warns that it routes blind."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import pytest

from kvserve.server.router_app import build_router_app
from kvserve.server.router_reads import Alarm, ReadTimeouts, Stalled, within
from tests.server.conftest import ServerThread
from tests.server.test_router import metric, wait_for

ROLE = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
WHOLE = {  # a non-streamed answer a client must never get
    "not json": (200, "application/json", b"<html>not json</html>"),
    "a list": (200, "application/json", b"[]"),
    "choices 5": (200, "application/json", b'{"choices": 5}'),
    "no choices": (200, "application/json", b'{"choices": []}'),
    "text 5": (200, "application/json", b'{"choices": [{"index": 0, "text": 5}]}'),
    "cut short": (200, "application/json", b'{"choices": [{"index": 0, "te'),
    "html 500": (500, "text/html", b"<h1>Internal Server Error</h1>"),
    "error without message": (400, "application/json", b'{"error": 5}'),
    "unasked stream": (200, "text/event-stream", b'data: {"choices": []}\n\n'),
}
STREAMED = {  # a stream's events a client must never get
    "choices 5": [b'data: {"choices": 5}\n\n'],
    "not json": [b"data: {not json\n\n"],
    "no data line": [b"garbage\n\n"],
    "content 7 after the role": [
        b"data: " + json.dumps({"id": "x", "choices": [ROLE]}).encode() + b"\n\n",
        b'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": 7}}]}\n\n'],
    "index -1": [b'data: {"choices": [{"index": -1, "text": "x"}]}\n\n'],
    "one endless event": [b"data: " + b"x" * (5 << 20)],
    "unasked json": None,  # a JSON 200 where a stream was asked for
}


class Hostile:
    """A backend that answers every completion with `self.mode`'s garbage."""

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        self.mode: tuple = WHOLE["not json"]
        self.hits = 0

        async def completion(request):
            await request.body()
            self.hits += 1
            if isinstance(self.mode, list):
                async def events():
                    for event in self.mode:
                        yield event
                return StreamingResponse(events(), media_type="text/event-stream")
            if self.mode is None:
                return JSONResponse({"choices": [{"index": 0, "text": "x"}]})
            status, kind, body = self.mode
            return Response(body, status, media_type=kind)

        async def health(request):
            return Response(status_code=200)

        async def metrics(request):
            return Response("", media_type="text/plain")

        async def no_events(request):
            return JSONResponse({"error": {"message": "off"}}, 404)

        self.app = Starlette(routes=[
            Route("/health", health), Route("/metrics", metrics),
            Route("/v1/kv_events_endpoint", no_events),
            *(Route(p, completion, methods=["POST"])
              for p in ("/v1/completions", "/v1/chat/completions", "/v1/messages"))])


@pytest.fixture(scope="module")
def hostile():
    backend = Hostile()
    with ServerThread(backend.app) as running:
        backend.url = running.url
        yield backend


@pytest.fixture(scope="module")
def routed(hostile, server):
    """The router in front of the hostile backend and the real one (`server`)."""
    app = build_router_app([hostile.url, server.url], poll_interval_s=0.2)
    with ServerThread(app) as running:
        yield running


def backend_state(router_url: str) -> dict[str, dict]:
    return {b["url"]: b for b in httpx.get(router_url + "/router/backends", timeout=30).json()}


def through_the_hostile(routed, hostile, send) -> list:
    """`send()` until the hostile backend got one of them (the router alternates between equally
    loaded backends; one marked down waits for its next health check)."""
    answers = []
    hits = hostile.hits
    for _ in range(6):
        wait_for(lambda: backend_state(routed.url)[hostile.url]["healthy"])
        answers.append(send())
        if hostile.hits > hits:
            return answers
    raise AssertionError("the router never tried the hostile backend")


def text_of_stream(response: httpx.Response) -> str:
    text = ""
    for line in response.iter_lines():
        assert not line or line.startswith("data: "), line  # nothing but events
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                assert isinstance(choice["index"], int)
                text += choice["delta"].get("content") or ""
    return text


@pytest.mark.slow  # (about 20 real requests)
def test_a_hostile_backends_answers_never_reach_a_client(routed, hostile, server, model_name):
    body = {"model": model_name, "prompt": "Ships passing the lighthouse:", "max_tokens": 2,
            "temperature": 0}
    chat = {"model": model_name, "messages": [{"role": "user", "content": "Name a ship."}],
            "max_tokens": 2, "temperature": 0}
    expected = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
    expected_chat = httpx.post(server.url + "/v1/chat/completions", json=chat,
                               timeout=300).json()["choices"][0]["message"]["content"]
    hits = hostile.hits
    for name, mode in WHOLE.items():
        hostile.mode = mode

        def send():
            return httpx.post(routed.url + "/v1/completions", json=body, timeout=300)
        for answer in through_the_hostile(routed, hostile, send):
            assert answer.status_code == 200, (name, answer.text)
            assert answer.json()["choices"][0]["text"] == expected["choices"][0]["text"], name
    for name, mode in STREAMED.items():
        hostile.mode = mode

        def send():
            with httpx.stream("POST", routed.url + "/v1/chat/completions",
                              json={**chat, "stream": True}, timeout=300) as response:
                assert response.status_code == 200, name
                return text_of_stream(response)
        assert all(t == expected_chat for t in through_the_hostile(routed, hostile, send)), name
    text = httpx.get(routed.url + "/metrics").text
    invalid = metric(text, f'kvserve_router:attempt_failures_total{{backend="{hostile.url}",'
                           f'kind="invalid"}}')
    assert invalid == hostile.hits - hits == len(WHOLE) + len(STREAMED)
    assert backend_state(routed.url)[server.url]["healthy"]


def test_when_every_backend_is_hostile_the_client_gets_a_502_with_a_json_error(hostile):
    hostile.mode = WHOLE["choices 5"]
    with ServerThread(build_router_app([hostile.url], poll_interval_s=60)) as running:
        answer = httpx.post(running.url + "/v1/completions", json={"prompt": "x"}, timeout=60)
    assert answer.status_code == 502
    assert "choices is not a list" in answer.json()["error"]["message"]


def test_a_200mb_body_is_refused_with_413_and_no_backend_is_marked_down(routed, hostile, server):
    total = 200 << 20
    block = b" " * (1 << 20)
    hits = hostile.hits

    def body():
        for _ in range(total // len(block)):
            yield block

    answer = httpx.post(routed.url + "/v1/completions", content=body(), timeout=120,
                        headers={"content-type": "application/json",
                                 "content-length": str(total)})
    assert answer.status_code == 413
    assert "--max-request-bytes" in answer.json()["error"]["message"]

    # a client that resets its connection mid-upload: no backend sees the request
    sock = socket.create_connection(("127.0.0.1", routed.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000000\r\n\r\n" + b"{" * 200_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # linger 0: a reset
    time.sleep(0.5)
    state = backend_state(routed.url)
    assert state[server.url]["healthy"] and state[hostile.url]["healthy"]
    text = httpx.get(routed.url + "/metrics").text
    assert metric(text, "kvserve_router:backend_failures_total") == metric(
        text, f'kvserve_router:backend_failures_total{{backend="{hostile.url}"}}')  # earlier tests
    assert metric(text, f'kvserve_router:attempt_failures_total{{backend="{server.url}"}}') == 0
    assert hostile.hits == hits


class Resetting:
    """A healthy backend (it answers its health checks) that resets the connection of every
    completion, as one does when a request's upload passes its own limit."""

    def __init__(self) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.resets = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, data = data.split(b"\r\n\r\n", 1)
                if head.startswith(b"POST"):
                    self.resets += 1
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                    b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    return  # closed with linger 0: a reset
                status = b"404 Not Found" if b"kv_events" in head else b"200 OK"
                conn.sendall(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\n\r\n")

    def close(self) -> None:
        self.sock.close()


def test_a_connection_reset_by_a_healthy_backend_does_not_mark_it_down(server, model_name):
    backend = Resetting()
    body = {"model": model_name, "prompt": "Ships passing the lighthouse:", "max_tokens": 2,
            "temperature": 0}
    expected = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
    try:
        with ServerThread(build_router_app([backend.url, server.url],
                                           poll_interval_s=60)) as routed:
            for _ in range(3):  # whichever backend comes first
                answer = httpx.post(routed.url + "/v1/completions", json=body, timeout=300)
                assert answer.json()["choices"] == expected["choices"]
            state = backend_state(routed.url)
            text = httpx.get(routed.url + "/metrics").text
    finally:
        backend.close()
    assert backend.resets >= 1 and state[backend.url]["healthy"]
    assert metric(text, "kvserve_router:backend_failures_total") == 0
    assert metric(text, f'kvserve_router:attempt_failures_total{{backend="{backend.url}",'
                        f'kind="broken"}}') == backend.resets


def test_a_read_past_its_deadline_or_on_a_backend_found_hung_stalls():
    async def run():
        never = asyncio.Event()
        with pytest.raises(Stalled, match="within 0.05 s"):
            await within(never.wait(), 0.05, Alarm())
        alarm = Alarm()
        waiting = asyncio.create_task(within(never.wait(), None, alarm))
        await asyncio.sleep(0.05)
        alarm.ring()
        with pytest.raises(Stalled, match="marked down"):
            await waiting
        assert not alarm.waiting
        assert await within(asyncio.sleep(0, "ok"), 1.0, alarm) == "ok"
    asyncio.run(run())


def test_a_stalled_stream_moves_on_without_marking_its_backend_down(server, model_name):
    """A backend that accepts a stream and then sends nothing: after the first-byte deadline the
    stream is sent to the real backend; the silent one stays up (it may only be busy)."""
    from starlette.applications import Starlette
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def silent(request):
        async def nothing():
            await asyncio.sleep(3600)
            yield b""
        return StreamingResponse(nothing(), media_type="text/event-stream")

    async def ok(request):
        return Response(status_code=200)

    app = Starlette(routes=[Route("/health", ok), Route("/metrics", ok),
                            Route("/v1/chat/completions", silent, methods=["POST"])])
    chat = {"model": model_name, "messages": [{"role": "user", "content": "Name a ship."}],
            "max_tokens": 2, "temperature": 0}
    expected = httpx.post(server.url + "/v1/chat/completions", json=chat,
                          timeout=300).json()["choices"][0]["message"]["content"]
    with ServerThread(app) as stuck, ServerThread(build_router_app(
            [stuck.url, server.url], timeouts=ReadTimeouts(1.0, 1.0, 60.0),
            poll_interval_s=60)) as routed:
        for _ in range(2):  # whichever backend comes first
            with httpx.stream("POST", routed.url + "/v1/chat/completions",
                              json={**chat, "stream": True}, timeout=60) as response:
                assert text_of_stream(response) == expected
        state = backend_state(routed.url)
        text = httpx.get(routed.url + "/metrics").text
    assert state[stuck.url]["healthy"]
    assert metric(text, f'kvserve_router:attempt_failures_total{{backend="{stuck.url}",'
                        f'kind="stalled"}}') >= 1


def test_a_router_that_follows_no_events_warns_at_start_up(server, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.router"):
        with ServerThread(build_router_app([server.url], poll_interval_s=60)) as running:
            state = backend_state(running.url)[server.url]
    assert "404" in state["events"] and "--kv-events-endpoint" in state["events"]
    assert any("index stays empty" in r.getMessage() for r in caplog.records)


# -- real processes: keyed backends with KV events ----------------------------------------------
@pytest.mark.slow
def test_keyed_backends_stopped_mid_answer_and_a_200mb_body(tmp_path):
    """Two `kvserve serve --api-key-file` backends publishing KV events behind `kvserve router
    --backend-api-key-file`: the router follows their events (a known prefix is routed by KV, not
    least-loaded); a 200 MB body gets a 413 and leaves every backend up with its index; a stream
    and a whole answer whose backend is SIGSTOPped complete on the other backend."""
    import os
    import signal
    import threading

    from tests.redis_server import free_port
    from tests.server.test_router import ENGINE, start, stop, wait_healthy

    keys = tmp_path / "keys"
    keys.write_text("sk-client\nsk-router\n")
    router_key = tmp_path / "router-key"
    router_key.write_text("# the router's own key\nsk-router\n")
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    logs = [tmp_path / f"{i}.log" for i in range(3)]
    backends = [start(["serve", "--port", str(p), "--api-key-file", str(keys),
                       "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port(2)}", *ENGINE], logs[i])
                for i, p in enumerate(ports[:2])]
    procs = list(backends)
    stopped: list = []
    router = f"http://127.0.0.1:{ports[2]}"
    auth = {"authorization": "Bearer sk-client"}
    try:
        for url in urls:
            wait_healthy(url, procs, logs)
        procs.append(start(["router", "--backend", urls[0], "--backend", urls[1],
                            "--backend-api-key-file", str(router_key), "--port", str(ports[2]),
                            "--poll-interval", "0.2", "--first-byte-timeout", "30",
                            "--chunk-timeout", "3", "--timeout", "300", "--log-level", "info"],
                           logs[2]))
        wait_healthy(router, procs, logs)
        wait_for(lambda: all(b["page_size"] for b in backend_state(router).values()), timeout=30)
        assert "index stays empty" not in logs[2].read_text()

        system = "You are a careful lighthouse keeper who logs every passing ship. " * 12
        chat = {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "Any ships today?"}],
                "max_tokens": 3, "temperature": 0}

        def post(path: str, body: dict) -> dict:
            answer = httpx.post(router + path, json=body, headers=auth, timeout=300)
            assert answer.status_code == 200, answer.text
            return answer.json()

        post("/v1/chat/completions", chat)
        wait_for(lambda: max(b["index_pages"] for b in backend_state(router).values()) >= 8,
                 timeout=30)
        again = post("/v1/chat/completions", chat)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * 16
        text = httpx.get(router + "/metrics").text
        assert sum(metric(text, f'kvserve_router:requests_total{{backend="{u}",reason="prefix"}}')
                   for u in urls) == 1

        before = backend_state(router)
        total, block = 200 << 20, b" " * (1 << 20)
        refused = httpx.post(router + "/v1/chat/completions", timeout=120,
                             content=(block for _ in range(total // len(block))),
                             headers={**auth, "content-type": "application/json",
                                      "content-length": str(total)})
        assert refused.status_code == 413
        after = backend_state(router)
        assert all(after[u]["healthy"] for u in urls)
        assert [after[u]["index_pages"] for u in urls] == [before[u]["index_pages"] for u in urls]
        assert metric(httpx.get(router + "/metrics").text,
                      "kvserve_router:backend_failures_total") == 0

        def stop_the_busy_backend() -> None:
            i = next(i for i, u in enumerate(urls) if backend_state(router)[u]["in_flight"])
            os.kill(backends[i].pid, signal.SIGSTOP)
            stopped.append(backends[i])

        story = {"messages": [{"role": "user", "content": "Write a long story about a ship."}],
                 "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        expected = post("/v1/chat/completions", story)["choices"][0]["message"]["content"]
        text, pieces = "", 0
        with httpx.stream("POST", router + "/v1/chat/completions", json={**story, "stream": True},
                          headers=auth, timeout=60) as response:  # (the router's --timeout: 300)
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    piece = "".join(c["delta"].get("content") or "" for c in event["choices"])
                    text, pieces = text + piece, pieces + bool(piece)
                    if pieces == 3 and piece:
                        stop_the_busy_backend()
        assert text == expected

        os.kill(stopped[0].pid, signal.SIGCONT)
        stopped.clear()
        wait_for(lambda: all(b["healthy"] for b in backend_state(router).values()), timeout=60)
        completion = {"prompt": "The lighthouse keeper counted the ships. ", "max_tokens": 60,
                      "temperature": 0, "ignore_eos": True}
        reference = post("/v1/completions", completion)["choices"][0]["text"]
        answer: dict = {}
        worker = threading.Thread(target=lambda: answer.update(post("/v1/completions",
                                                                    completion)))
        worker.start()
        wait_for(lambda: any(b["in_flight"] for b in backend_state(router).values()), timeout=60)
        stop_the_busy_backend()  # its health checks time out: marked down, the request moves on
        worker.join(120)
        assert answer["choices"][0]["text"] == reference
        text = httpx.get(router + "/metrics").text
        assert metric(text, "kvserve_router:stream_resumes_total") == 1
        assert metric(text, 'kvserve_router:attempt_failures_total') >= 2
    finally:
        for proc in stopped:
            os.kill(proc.pid, signal.SIGCONT)
        stop(procs)


def test_the_checks_pass_real_shapes_and_name_the_problem_of_bad_ones():
    from kvserve.server.router_checks import answer_problem, event_problem

    ok = {"choices": [{"index": 0, "text": "hi", "finish_reason": "length"}], "usage": {}}
    assert answer_problem("/v1/completions", 200, "application/json", json.dumps(ok).encode(),
                          False) is None
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None}}]}
    assert answer_problem("/v1/chat/completions", 200, "application/json",
                          json.dumps(chat).encode(), False) is None
    message = {"type": "message", "content": [{"type": "text", "text": "hi"}], "usage": {}}
    assert answer_problem("/v1/messages", 200, "application/json", json.dumps(message).encode(),
                          False) is None
    error = {"error": {"message": "bad", "type": "invalid_request_error"}}
    assert answer_problem("/v1/messages", 400, "application/json", json.dumps(error).encode(),
                          True) is None  # an error answer to a stream request is relayed
    assert "not a message" in answer_problem("/v1/messages", 200, "application/json",
                                             json.dumps(ok).encode(), False)
    assert "not a string" in answer_problem("/v1/chat/completions", 200, "application/json",
                                            b'{"choices": [{"message": {"content": 1}}]}', False)
    assert event_problem(False, True, None, "[DONE]") is None
    assert event_problem(False, True, None, {"choices": [], "usage": {"prompt_tokens": 1}}) is None
    assert "error.message" in event_problem(False, True, None, {"error": "x"})
    assert event_problem(True, False, "content_block_delta", {
        "type": "content_block_delta", "index": 0, "delta": {"text": "a"}}) is None
    assert "unknown event" in event_problem(True, False, "message_start",
                                            {"type": "content_block_delta"})
    assert "not a string" in event_problem(True, False, None, {
        "type": "content_block_delta", "index": 0, "delta": {"text": 5}})
    assert "index" in event_problem(False, False, None, {"choices": [{"index": True, "text": ""}]})


def test_backend_key_files_take_one_key_or_one_per_url(tmp_path):
    from kvserve.server.router import load_backend_keys
    from kvserve.server.router_core import Router

    path = tmp_path / "keys"
    path.write_text("# comment\nsk-all\nhttp://b:1/v1 sk-b\n")
    keys = load_backend_keys(str(path))
    assert keys == {"": "sk-all", "http://b:1/v1": "sk-b"}
    router = Router(["http://a:1", "http://b:1"], backend_keys=keys)
    a, b = router.backends
    assert router.own_headers(a) == {"authorization": "Bearer sk-all"}
    assert router.own_headers(b) == {"authorization": "Bearer sk-b"}
    with pytest.raises(ValueError, match="no --backend"):
        Router(["http://a:1"], backend_keys={"http://c:1": "k"})
    path.write_text("a b c\n")
    with pytest.raises(ValueError, match="line 1"):
        load_backend_keys(str(path))
    path.write_text("\n# only a comment\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_backend_keys(str(path))
