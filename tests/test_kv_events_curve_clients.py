"""CURVE keys per subscriber (issue 44): with `--kv-events-curve-clients-file`, a subscriber that
knows the server's public key but whose own key is not listed receives nothing, live or by replay
(a tenant that learned the server key reads no event); a listed one (the operator's router) receives
every batch."""

from __future__ import annotations

import time

import pytest
import zmq

from kvserve.cache.events import BlockStored
from kvserve.config import EngineConfig
from kvserve.kv_events import CurveKeys, KVEventPublisher, KVEventSubscriber, publisher_for
from kvserve.kv_events.curve_clients import read_client_keys

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def stored(i: int) -> BlockStored:
    return BlockStored([i.to_bytes(16, "big")], None, [i, i + 1], 2)


def test_only_listed_subscribers_get_in_even_with_the_servers_key():
    server_public, server_secret = zmq.curve_keypair()
    router_public, router_secret = zmq.curve_keypair()
    p = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=CurveKeys.from_secret(server_secret),
                         curve_clients=frozenset({router_public}))
    listed: list = []
    stranger: list = []
    router = KVEventSubscriber(p.endpoint, p.replay_endpoint, listed.extend, curve_server_key=server_public.decode(),
                               curve_client_secret=router_secret.decode())
    tenant = KVEventSubscriber(p.endpoint, p.replay_endpoint, stranger.extend, replay_timeout_s=0.5,
                               curve_server_key=server_public.decode())  # the server's key, its own pair
    try:
        deadline, i = time.monotonic() + 10, 0
        while not listed and time.monotonic() < deadline:
            p.publish([stored(i)])
            i += 1
            time.sleep(0.05)
        for _ in range(10):
            p.publish([stored(i)])
            i += 1
        time.sleep(1.0)
        late = KVEventSubscriber(p.endpoint, p.replay_endpoint, stranger.extend, replay_timeout_s=0.5,
                                 curve_server_key=server_public.decode())  # asks the replay socket
        time.sleep(1.0)
        late.close()
        assert listed and listed[0].token_ids == stored(0).token_ids
        assert stranger == [] and tenant.num_batches == 0
    finally:
        router.close()
        tenant.close()
        p.close()


def test_the_clients_file_is_read_strictly_and_needs_a_server_key(tmp_path):
    public, _ = zmq.curve_keypair()
    good = tmp_path / "clients"
    good.write_text(f"# the router\n{public.decode()}\n\n")
    assert read_client_keys(str(good)) == {public}
    bad = tmp_path / "bad"
    bad.write_text("not-a-key\n")
    with pytest.raises(ValueError, match="40 characters"):
        read_client_keys(str(bad))
    with pytest.raises(ValueError, match="--kv-events-curve-secret-file"):
        publisher_for(EngineConfig(kv_events_endpoint="tcp://127.0.0.1:*", kv_events_curve_clients_file=str(good)))
