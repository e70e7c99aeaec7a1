"""Operator-issued subscriber keys end to end (issue 44): `kvserve serve` with a CURVE key and
`--kv-events-curve-clients-file`; a `kvserve router` given its listed key indexes the backend's pages
from the events, another router that gets the server's public key the same way (it asks
/v1/kv_events_endpoint as the operator) but has no listed key of its own indexes nothing."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
PROMPT = "The harbour master's log of arrivals: " + "a brig, a schooner, two fishing smacks, " * 10


@pytest.mark.slow
def test_a_router_with_a_listed_key_follows_the_events_and_one_without_does_not(tmp_path):
    from tests.redis_server import free_port
    from tests.server.test_router import ENGINE, start, stop, wait_healthy

    _, server_secret = zmq.curve_keypair()
    router_public, router_secret = zmq.curve_keypair()
    (tmp_path / "server.key").write_bytes(server_secret)
    (tmp_path / "router.key").write_bytes(router_secret)
    (tmp_path / "clients").write_bytes(router_public + b"\n")
    events_port = free_port(2)
    port, listed_port, unlisted_port = free_port(), free_port(), free_port()
    backend = f"http://127.0.0.1:{port}"
    procs = [start(["serve", "--port", str(port), *ENGINE, "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}",
                    "--kv-events-curve-secret-file", str(tmp_path / "server.key"),
                    "--kv-events-curve-clients-file", str(tmp_path / "clients")], tmp_path / "serve.log")]
    logs = [tmp_path / "serve.log", tmp_path / "listed.log", tmp_path / "unlisted.log"]
    try:
        wait_healthy(backend, procs, logs[:1])
        procs.append(start(["router", "--backend", backend, "--port", str(listed_port), "--poll-interval", "0.2",
                            "--kv-events-curve-client-secret-file", str(tmp_path / "router.key")], logs[1]))
        procs.append(start(["router", "--backend", backend, "--port", str(unlisted_port), "--poll-interval", "0.2"],
                           logs[2]))
        listed, unlisted = (f"http://127.0.0.1:{p}" for p in (listed_port, unlisted_port))
        wait_healthy(listed, procs, logs)
        wait_healthy(unlisted, procs, logs)

        def pages(router: str) -> int:
            return httpx.get(router + "/router/backends", timeout=30).json()[0]["index_pages"]

        answer = httpx.post(listed + "/v1/completions", timeout=300, json={"prompt": PROMPT, "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 30
        while pages(listed) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        print(f"index pages: listed router {pages(listed)}, unlisted router {pages(unlisted)}")
        assert pages(listed) > 0
        assert pages(unlisted) == 0
        assert "refused a KV events subscriber" in logs[0].read_text()
    finally:
        stop(procs)
