"""Real `kvserve serve` backends behind `kvserve router`, one killed (SIGKILL) in the middle of each
answer: OpenAI chat and completions streams, an Anthropic stream and a non-streamed completion all
complete on another backend, and the client's text equals an uninterrupted greedy run's."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.server.test_router import ENGINE, metric, start, stop, wait_for, wait_healthy

STORY = "Write a long story about a lighthouse keeper and the ships she counts."


@pytest.mark.slow
def test_answers_survive_their_backend_being_killed_mid_answer(tmp_path):
    import httpx

    from tests.redis_server import free_port

    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:3]]
    logs = [tmp_path / f"{i}.log" for i in range(4)]
    serve = [["serve", "--port", str(p), *ENGINE] for p in ports[:3]]
    procs = [start(args, logs[i]) for i, args in enumerate(serve)]
    backends = list(procs)
    router = f"http://127.0.0.1:{ports[3]}"
    try:
        for url in urls:
            wait_healthy(url, procs, logs)
        procs.append(start(["router", *sum((["--backend", u] for u in urls), []), "--port",
                            str(ports[3]), "--poll-interval", "0.2", "--log-level", "warning"],
                           logs[3]))
        wait_healthy(router, procs, logs)

        def state() -> list[dict]:
            return httpx.get(router + "/router/backends", timeout=30).json()

        def kill_the_busy_backend() -> None:
            """SIGKILL the backend serving the one request in flight, and start it again (the
            router follows it when it answers its health check)."""
            i = next(i for i, b in enumerate(state()) if b["in_flight"])
            backends[i].kill()
            backends[i].wait(30)
            backends[i] = start(serve[i], tmp_path / f"{i}.restart.log")
            procs.append(backends[i])

        def healthy_backends(n: int) -> None:
            wait_for(lambda: sum(b["healthy"] for b in state()) >= n, timeout=300)

        chat = {"messages": [{"role": "user", "content": STORY}], "max_tokens": 80,
                "temperature": 0, "ignore_eos": True}
        completion = {"prompt": "The lighthouse keeper counted the ships. " * 2, "max_tokens": 80,
                      "temperature": 0, "ignore_eos": True}
        model = httpx.get(router + "/v1/models", timeout=30).json()["data"][0]["id"]
        anthropic = {"model": model, "messages": chat["messages"], "max_tokens": 80,
                     "temperature": 0}

        def post(path: str, body: dict) -> dict:
            response = httpx.post(router + path, json=body, timeout=300)
            assert response.status_code == 200, response.text
            return response.json()

        expected = {  # uninterrupted greedy answers
            "chat": post("/v1/chat/completions", chat)["choices"][0]["message"]["content"],
            "completion": post("/v1/completions", completion)["choices"][0]["text"],
            "anthropic": post("/v1/messages", anthropic)["content"][0]["text"]}
        assert len(expected["anthropic"]) > 100  # long enough to be killed in the middle

        def stream(path: str, body: dict) -> tuple[str, list]:
            """The streamed text; the backend is killed after the third piece of text."""
            text, events, pieces = "", [], 0
            with httpx.stream("POST", router + path, json={**body, "stream": True},
                              timeout=300) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    event = data if data == "[DONE]" else json.loads(data)
                    events.append(event)
                    if isinstance(event, dict):
                        assert "error" not in event and event.get("type") != "error", event
                        piece = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                                        for c in event.get("choices") or [])
                        piece += (event.get("delta") or {}).get("text") or ""
                        text += piece
                        pieces += bool(piece)
                        if pieces == 3 and piece:
                            kill_the_busy_backend()
            return text, events

        text, events = stream("/v1/chat/completions", chat)
        assert text == expected["chat"]
        chunks = [e for e in events if isinstance(e, dict)]
        assert len({e["id"] for e in chunks}) == 1  # one coherent stream
        assert sum("role" in c["delta"] for e in chunks for c in e["choices"]) == 1
        assert sum(bool(c["finish_reason"]) for e in chunks for c in e["choices"]) == 1
        assert events[-1] == "[DONE]"

        healthy_backends(2)
        text, events = stream("/v1/completions", completion)
        assert text == expected["completion"] and events[-1] == "[DONE]"

        healthy_backends(2)
        text, events = stream("/v1/messages", anthropic)
        assert text == expected["anthropic"]
        kinds = [e["type"] for e in events]
        assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]

        healthy_backends(2)  # not streamed: the router retries the whole request
        answer: dict = {}
        worker = threading.Thread(target=lambda: answer.update(
            post("/v1/completions", {**completion, "max_tokens": 120})))
        worker.start()
        wait_for(lambda: any(b["in_flight"] for b in state()), timeout=60)
        time.sleep(0.5)
        kill_the_busy_backend()
        worker.join(300)
        reference = post("/v1/completions", {**completion, "max_tokens": 120})
        assert answer["choices"][0]["text"] == reference["choices"][0]["text"]

        text = httpx.get(router + "/metrics").text
        assert metric(text, "kvserve_router:stream_resumes_total") == 3
        assert metric(text, "kvserve_router:backend_failures_total") >= 4
    finally:
        stop(procs)
