"""Sampled streams survive their backend's death with speculative decoding on (issue 44, must-show 7):
two `kvserve serve` backends with n-gram speculation behind `kvserve router`, the busy one SIGKILLed
after the third piece of each of 3 sampled streams (two with a seed, one the router seeds): each
resumes on the other backend, and the client's text equals an uninterrupted run with that seed.
Before seeded sampling was kept under speculation, 2 of 3 such streams ended `stream_resume_failed`."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.test_router import ENGINE, metric, start, stop, wait_for, wait_healthy

SPECULATION = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'
PROMPT = ("Repeat after me, many times: the keeper counts the ships, the keeper counts the ships, "
          "the keeper counts the ships, the keeper counts the ships.")


@pytest.mark.slow
def test_sampled_streams_resume_after_a_backend_kill_with_speculation_on(tmp_path):
    from tests.redis_server import free_port

    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    logs = [tmp_path / f"{i}.log" for i in range(3)]
    serve = [["serve", "--port", str(p), *ENGINE, "--speculative-config", SPECULATION] for p in ports[:2]]
    backends = [start(args, logs[i]) for i, args in enumerate(serve)]
    procs = list(backends)
    router = f"http://127.0.0.1:{ports[2]}"
    try:
        for url in urls:
            wait_healthy(url, procs, logs)
        procs.append(start(["router", *sum((["--backend", u] for u in urls), []), "--port", str(ports[2]),
                            "--poll-interval", "0.2", "--policy", "round-robin", "--log-level", "warning"],
                           logs[2]))
        wait_healthy(router, procs, logs)

        def state() -> list[dict]:
            return httpx.get(router + "/router/backends", timeout=30).json()

        def kill_the_busy_backend() -> None:
            i = next(i for i, b in enumerate(state()) if b["in_flight"])
            backends[i].kill()
            backends[i].wait(30)
            backends[i] = start(serve[i], tmp_path / f"{i}.restart.log")
            procs.append(backends[i])

        def stream(body: dict, kill: bool) -> tuple[str, list]:
            text, events, pieces = "", [], 0
            with httpx.stream("POST", router + "/v1/chat/completions", json={**body, "stream": True},
                              timeout=300) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
                    events.append(event)
                    if isinstance(event, dict):
                        assert "error" not in event, event
                        piece = "".join((c.get("delta") or {}).get("content") or "" for c in event["choices"])
                        text += piece
                        pieces += bool(piece)
                        if kill and pieces == 3 and piece:
                            kill_the_busy_backend()
            return text, events

        base = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 60, "temperature": 1.0,
                "top_p": 0.95, "ignore_eos": True}
        seeded = [{**base, "seed": 11}, {**base, "seed": 2026}]
        expected = [stream(body, kill=False)[0] for body in seeded]  # uninterrupted, speculation on
        accepted = sum(metric(httpx.get(u + "/metrics").text, "kvserve:spec_decode_num_accepted_tokens_total{")
                       for u in urls)
        assert accepted > 0  # speculation did run on these sampled requests

        resumed = []
        for body, reference in zip(seeded, expected):
            wait_for(lambda: sum(b["healthy"] for b in state()) >= 2, timeout=300)
            text, events = stream(body, kill=True)
            resumed.append(text == reference)
            assert text == reference, (text, reference)
            assert events[-1] == "[DONE]"
        wait_for(lambda: sum(b["healthy"] for b in state()) >= 2, timeout=300)
        text, events = stream(base, kill=True)  # no seed: the router gives it one
        chunks = [e for e in events if isinstance(e, dict)]
        assert len(text) > 20 and events[-1] == "[DONE]"
        assert sum(bool(c["finish_reason"]) for e in chunks for c in e["choices"]) == 1
        resumes = metric(httpx.get(router + "/metrics").text, "kvserve_router:stream_resumes_total")
        print(f"speculation accepted {accepted:.0f} draft tokens; seeded streams equal after the kill: "
              f"{resumed}; router stream resumes: {resumes:.0f}")
        assert resumes == 3
    finally:
        stop(procs)
