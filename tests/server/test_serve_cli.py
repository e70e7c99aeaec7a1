"""`kvserve serve` as a user starts it: a subprocess on a free loopback port with an API key, that
answers the openai client and stops on SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_kvserve_serve_answers_and_stops(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--api-key", "sk-test",
         "--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--served-model-name", "smol",
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvserve serve did not come up"
            time.sleep(0.5)
        client = OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smol"]
        out = client.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens >= 1
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=30) in (0, 130, -signal.SIGINT)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
