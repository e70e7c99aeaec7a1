"""Who may open the KV event stream (issue 44): over CURVE the server's public key is what lets a
subscriber in, and the events carry every tenant's pages, so `GET /v1/kv_events_endpoint` gives it to
an admin key (a router's) and never to a tenant's key."""

from __future__ import annotations

import httpx
import pytest
import zmq

from tests.redis_server import free_port
from tests.server.conftest import SMALL_ENGINE, ServerThread

TENANT, ADMIN = "sk-events-tenant", "sk-events-admin"


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_only_an_admin_key_gets_the_curve_key(tmp_path):
    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app

    public, secret = zmq.curve_keypair()
    (tmp_path / "curve.key").write_bytes(secret)
    engine = LLMEngine(EngineConfig(**SMALL_ENGINE, kv_events_endpoint=f"tcp://127.0.0.1:{free_port(2)}",
                                    kv_events_curve_secret_file=str(tmp_path / "curve.key")))
    try:
        with ServerThread(build_app(engine, api_keys=[TENANT], admin_api_keys=[ADMIN])) as running:
            def described(key: str) -> dict:
                answer = httpx.get(running.url + "/v1/kv_events_endpoint",
                                   headers={"authorization": f"Bearer {key}"}, timeout=30)
                assert answer.status_code == 200, answer.text
                return answer.json()

            tenant, admin = described(TENANT), described(ADMIN)
    finally:
        engine.close()
    assert admin["curve_public_key"] == public.decode()
    assert tenant["curve_public_key"] is None
    assert tenant["endpoint"] == admin["endpoint"]  # where it is is no secret; the key to it is
