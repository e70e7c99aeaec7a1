"""A compressed fault soak (issue 42): asyncio clients send greedy chats through `kvserve router` to two
`kvserve serve` backends sharing a real Redis tier while faults land on schedule: 20% of clients
disconnect mid-answer, one backend is SIGSTOPped then resumed, Redis is SIGKILLed and restarted, one
backend is SIGKILLed and started again. Every request must end with the prompt's cold greedy answer or
a clean JSON error; afterwards no backend holds a page and their RSS stayed bounded."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest

from tests.redis_server import REDIS_SERVER, RedisServer, free_port
from tests.server.test_router import ENGINE, start, stop, wait_healthy

SOAK_S = float(os.environ.get("KVSERVE_SOAK_S", "40"))
NUM_CLIENTS = 4
PROMPTS = [f"Ship log {i}: the {w} sailed past the lighthouse at dusk. " * 6
           for i, w in enumerate(["Maria", "Santa Ana", "Blue Heron", "Gull", "Northern Star", "Osprey"])]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def chat(prompt: str, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0, "stream": stream}


def stream_text(lines: list[str]) -> tuple[str, bool]:
    """The streamed text and whether the stream ended cleanly ([DONE] with no error event)."""
    text, clean = "", False
    for line in lines:
        if line == "data: [DONE]":
            clean = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            if "error" in event:
                return text, False
            text += event["choices"][0]["delta"].get("content") or "" if event.get("choices") else ""
    return text, clean


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(REDIS_SERVER), reason="redis-server is not installed")
def test_faults_end_every_request_with_the_cold_answer_or_a_clean_error(tmp_path):
    redis = RedisServer(str(tmp_path)).start()
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    logs = [tmp_path / f"{i}.log" for i in range(3)]
    serve = lambda i: start(["serve", "--port", str(ports[i]), "--redis-url", redis.url, *ENGINE], logs[i])  # noqa: E731
    backends = [serve(0), serve(1)]
    procs = list(backends)
    router = f"http://127.0.0.1:{ports[2]}"
    outcomes: dict[str, int] = {"answered": 0, "clean_error": 0, "disconnected": 0}
    faults: list[str] = []
    try:
        for url in urls:
            wait_healthy(url, procs, logs)
        procs.append(start(["router", "--backend", urls[0], "--backend", urls[1], "--policy", "round-robin",
                            "--port", str(ports[2]), "--poll-interval", "0.2", "--first-byte-timeout", "8",
                            "--chunk-timeout", "3", "--timeout", "60", "--log-level", "warning"], logs[2]))
        wait_healthy(router, procs, logs)
        cold = {}
        for prompt in PROMPTS:  # each prompt's cold greedy answer, before any cache or fault
            answer = httpx.post(urls[0] + "/v1/chat/completions", json=chat(prompt, False), timeout=120)
            cold[prompt] = answer.json()["choices"][0]["message"]["content"]
        rss_before = [rss_bytes(p.pid) for p in backends]

        async def client(seed: int, deadline: float) -> None:
            rng = random.Random(seed)
            async with httpx.AsyncClient(timeout=90) as http:
                while time.monotonic() < deadline:
                    prompt, stream = rng.choice(PROMPTS), rng.random() < 0.5
                    if rng.random() < 0.2:  # the client leaves mid-answer
                        try:
                            async with asyncio.timeout(rng.uniform(0.05, 0.5)):
                                await http.post(router + "/v1/chat/completions", json=chat(prompt, True))
                        except TimeoutError:
                            pass
                        outcomes["disconnected"] += 1
                        continue
                    response = await http.post(router + "/v1/chat/completions", json=chat(prompt, stream))
                    if response.status_code != 200:
                        assert "error" in response.json(), response.text[:300]
                        outcomes["clean_error"] += 1
                    elif stream:
                        text, clean = stream_text(response.text.splitlines())
                        assert not clean or text == cold[prompt], (prompt, text, cold[prompt])
                        outcomes["answered" if clean else "clean_error"] += 1
                    else:
                        assert response.json()["choices"][0]["message"]["content"] == cold[prompt]
                        outcomes["answered"] += 1

        async def inject(t0: float) -> None:
            async def at(offset: float) -> None:
                await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            await at(SOAK_S * 0.15)
            os.kill(backends[1].pid, signal.SIGSTOP)
            faults.append("SIGSTOP backend 1")
            await at(SOAK_S * 0.3)
            os.kill(backends[1].pid, signal.SIGCONT)
            redis.kill()
            faults.append("SIGKILL redis")
            await at(SOAK_S * 0.45)
            redis.start()
            faults.append("redis restarted")
            await at(SOAK_S * 0.55)
            backends[0].kill()
            backends[0].wait(10)
            faults.append("SIGKILL backend 0")
            backends[0] = serve(0)
            procs.append(backends[0])
            faults.append("backend 0 restarted")

        async def soak() -> None:
            t0 = time.monotonic()
            await asyncio.gather(inject(t0), *(client(i, t0 + SOAK_S) for i in range(NUM_CLIENTS)))

        asyncio.run(soak())
        wait_healthy(urls[0], [backends[0]], [logs[0]])
        for url in urls:  # aborted and disconnected requests gave their pages back
            deadline = time.monotonic() + 60
            while (used := httpx.get(url + "/dashboard/stats", timeout=30).json()["num_pages_used"]) and \
                    time.monotonic() < deadline:
                time.sleep(0.5)
            assert used == 0, (url, used)
        rss_after = [rss_bytes(p.pid) for p in backends]
        print("fault soak:", json.dumps({"seconds": SOAK_S, "outcomes": outcomes, "faults": faults,
                                         "rss_mib_before": [r >> 20 for r in rss_before],
                                         "rss_mib_after": [r >> 20 for r in rss_after]}))
        assert outcomes["answered"] >= 10 and len(faults) == 5
        assert rss_after[1] < rss_before[1] + (512 << 20)  # the backend that lived through it all
    finally:
        for proc in backends:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        stop(procs)
        redis.stop()
