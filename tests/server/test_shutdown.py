"""`kvserve serve` as a process: API keys from a file (absent from its command line), the memory
promise at start-up, and a bounded shutdown: SIGTERM with 2,000-token streams in flight and
--shutdown-timeout 3 exits 0 within ~5 s, every client gets a final chunk, no page stays in use."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.redis_server import free_port
from tests.server.conftest import wait_until_serving

KEY = "sk-from-a-file-7f3a"


def read_stream(url: str, key: str, events: list, started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {key}"}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()
    except httpx.HTTPError as err:
        events.append(err)
    finally:
        started.set()


@pytest.mark.slow
def test_keys_from_a_file_and_sigterm_with_streams_in_flight(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# tenants\n{KEY}\n\nsk-second\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--api-key-file",
         str(keys), "--kv-cache-memory", "128MiB", "--max-model-len", "2048",
         "--shutdown-timeout", "3", "--log-level", "info"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until_serving(proc, url, log_path, 240)

        cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read()
        assert KEY.encode() not in cmdline and b"sk-second" not in cmdline
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        for key in (KEY, "sk-second"):
            assert httpx.get(url + "/v1/models", timeout=10,
                             headers={"authorization": f"Bearer {key}"}).status_code == 200
        assert "memory: weights" in log_path.read_text()

        streams = [([], threading.Event()) for _ in range(3)]
        readers = [threading.Thread(target=read_stream, args=(url, KEY, events, started))
                   for events, started in streams]
        for reader in readers:
            reader.start()
        for _, started in streams:
            assert started.wait(120)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0
        exit_s = time.monotonic() - t0
        for reader in readers:
            reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = log_path.read_text()
    print(f"exit {exit_s:.2f} s after SIGTERM\n{text}")
    assert exit_s < 6.0, text
    for events, _ in streams:
        assert events[-1] == "[DONE]", events[-3:]
        finals = [e for e in events if isinstance(e, dict) and e.get("choices")
                  and e["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "abort"
        assert "shutting down" in events[-2]["error"]["message"]
        generated = "".join(e["choices"][0]["text"] for e in events
                            if isinstance(e, dict) and e.get("choices"))
        assert generated  # tokens streamed before the deadline
    assert "aborting 3 requests" in text and "0 pages in use" in text, text
