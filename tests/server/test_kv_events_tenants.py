"""KV events on a multi-tenant server (issue 42): with API keys and no CURVE key on the events socket,
`kvserve serve` publishes BlockStored without token ids (a local subscriber would read every tenant's
prompts) unless `--kv-events-token-ids on` asks for them; the start-up log says which and why."""

from __future__ import annotations

import time

import httpx
import pytest

PROMPT = "The quartermaster's private inventory: " + "rope, tar, canvas, biscuits, " * 10


def test_auto_keeps_token_ids_in_when_keys_are_set_without_curve():
    from kvserve.server.launch import event_token_ids

    assert event_token_ids("auto", has_api_keys=True, has_curve_key=False)[0] is False
    assert event_token_ids("auto", has_api_keys=True, has_curve_key=True)[0] is True
    assert event_token_ids("auto", has_api_keys=False, has_curve_key=False)[0] is True
    assert event_token_ids("on", has_api_keys=True, has_curve_key=False)[0] is True
    assert event_token_ids("off", has_api_keys=False, has_curve_key=True)[0] is False


@pytest.mark.slow
@pytest.mark.parametrize("flags,carried,said", [
    ([], False, "carry no token ids: API keys are set"),
    (["--kv-events-token-ids", "on"], True, "carry token ids: --kv-events-token-ids on")],
    ids=["default", "asked-for"])
def test_a_keyed_server_publishes_token_ids_only_when_asked(tmp_path, flags, carried, said):
    from kvserve.kv_events import KVEventSubscriber
    from tests.redis_server import free_port
    from tests.server.test_router import ENGINE, start, stop, wait_healthy

    keys = tmp_path / "keys"
    keys.write_text("sk-tenant-a\nsk-tenant-b\n")
    events_port = free_port(2)  # first: the serve port must not be its replay port
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    proc = start(["serve", "--port", str(port), "--api-key-file", str(keys), *ENGINE, "--log-level", "info",
                  "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}", *flags], log)
    stored: list = []
    subscriber = None
    try:
        wait_healthy(url, [proc], [log])
        subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{events_port + 1}",
                                       lambda batch: stored.extend(e for e in batch if e.kind == "BlockStored"))
        answer = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer sk-tenant-a"}, timeout=300,
                            json={"prompt": PROMPT, "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 30
        while not stored and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stored, "no BlockStored event arrived"
        assert all(bool(e.token_ids) is carried for e in stored), [e.token_ids[:8] for e in stored]
        assert all(e.hashes for e in stored)  # kvserve router still routes by the hashes
        assert said in log.read_text(), log.read_text()[-2000:]
    finally:
        if subscriber is not None:
            subscriber.close()
        stop([proc])
