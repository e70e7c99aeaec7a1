"""KV events: a subscriber written from vLLM's published schema (tests/vllm_kv_schema.py: its current
msgspec structs, both encodings, and the ZmqEventPublisher wire protocol with the replay topic frame),
not from kvserve's encoder, decodes kvserve's stream and, after a dropped connection, replays the
missed batches by sequence number."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack
import msgspec
import pytest
import zmq

from kvserve.cache.events import (MEDIUM_DISK, MEDIUM_HOST, MEDIUM_POOL, AllBlocksCleared,
                                  BlockRemoved, BlockStored, KVEventBuffer, namespace_extra_keys)
from kvserve.cache.hashing import namespace, page_hashes
from kvserve.kv_events import (CurveKeys, KVEventPublisher, KVEventSubscriber, encode_batch,
                               external_hash, fill_topic, is_loopback, replay_endpoint_for)
from tests.vllm_kv_schema import decode, replay

TOPIC = "kv@10.0.0.7:8000@SmolLM2"


def vllm_decode(payload: bytes, encoding: str = "array") -> dict:
    batch = decode(payload, encoding)
    events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
    return {"ts": batch.ts, "events": events, "data_parallel_rank": batch.data_parallel_rank}


@dataclass
class Subscriber:
    """vLLM's example subscriber: SUB for the live stream; on a gap, ask the replay ROUTER (through
    a DEALER, which reads the several replies) for everything from the first missed seq."""

    endpoint: str
    replay_endpoint: str
    encoding: str = "array"
    topic: bytes = b""
    batches: dict[int, dict] = field(default_factory=dict)
    last_seq: int = -1
    replays: int = 0

    def __post_init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.connect()

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)

    def drop(self) -> None:
        self.sub.close(linger=0)

    def poll(self, timeout_ms: int = 100) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic.startswith(self.topic)
        seq = int.from_bytes(seq_bytes, "big")
        if seq > self.last_seq + 1:
            self.replay(self.last_seq + 1)
        self.take(seq, payload)
        return True

    def replay(self, start: int) -> None:
        self.replays += 1
        for topic, seq, payload in replay(self.replay_endpoint, start):
            assert topic.startswith(self.topic)  # the topic frame comes with every reply
            self.take(seq, payload)

    def take(self, seq: int, payload: bytes) -> None:
        if seq not in self.batches:
            self.batches[seq] = vllm_decode(payload, self.encoding)
        self.last_seq = max(self.last_seq, seq)


def stored(i: int) -> BlockStored:
    tokens = list(range(i * 4, i * 4 + 4))
    return BlockStored(page_hashes(tokens, 4, ""), None, tokens, 4)


def publish_until_seen(pub: KVEventPublisher, sub: Subscriber, events_of, sent: list) -> None:
    """Publish batches until the subscriber receives one (a fresh SUB misses the first messages)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        events = events_of(len(sent))
        pub.publish(events)
        sent.append(events)
        pub.flush()
        if sub.poll(50):
            while sub.poll(20):
                pass
            return
    raise AssertionError("the subscriber never received a batch")


@pytest.fixture(params=["array", "map"])
def pub(request):
    p = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=1000, topic=TOPIC,
                         encoding=request.param)
    yield p
    p.close()


def test_vllm_subscriber_decodes_the_stream_and_replays_after_a_dropped_connection(pub):
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, pub.encoding, b"kv@")
    sent: list[list] = []
    publish_until_seen(pub, sub, lambda i: [stored(i)], sent)
    assert sorted(sub.batches) == list(range(len(sent)))  # early ones by replay from 0

    sub.drop()
    for _ in range(5):  # missed while disconnected
        pub.publish([stored(len(sent)), BlockRemoved([stored(len(sent)).page_hashes[0]])])
        sent.append(None)
    pub.flush()
    sub.connect()
    replays = sub.replays
    publish_until_seen(pub, sub, lambda i: [stored(i)], sent)
    assert sub.replays > replays
    assert sorted(sub.batches) == list(range(len(sent)))

    for seq, batch in sub.batches.items():
        assert batch["data_parallel_rank"] == 0 and batch["ts"] > 0
        first = batch["events"][0]
        event = stored(seq)
        assert first["type"] == "BlockStored"
        assert first["block_hashes"] == [external_hash(event.page_hashes[0])]
        assert first["parent_block_hash"] is None and first["token_ids"] == event.token_ids
        assert first["block_size"] == 4 and first["lora_id"] is None and first["medium"] == "GPU"
        assert first["lora_name"] is None and first["extra_keys"] is None
        if len(batch["events"]) == 2:
            assert batch["events"][1] == {"type": "BlockRemoved", "medium": "GPU", "group_idx": None,
                                          "block_hashes": first["block_hashes"]}


def test_hashes_are_vllms_default_uint64_or_whole_bytes():
    h = page_hashes([1, 2, 3, 4], 4, "")[0]
    value = external_hash(h)
    assert value == int.from_bytes(h[-8:], "big") and 0 <= value < 2**64
    assert external_hash(h, "bytes") == h


def test_bytes_format_and_all_blocks_cleared_on_the_wire():
    p = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", hash_format="bytes")
    try:
        event = stored(0)
        p.publish([event, BlockRemoved(event.page_hashes, MEDIUM_HOST), AllBlocksCleared()])
        p.flush()
        sub = Subscriber(p.endpoint, p.replay_endpoint)
        sub.replay(0)  # nothing live yet: all of it comes by replay
        events = sub.batches[0]["events"]
        assert events[0]["block_hashes"] == event.page_hashes
        assert events[1] == {"type": "BlockRemoved", "block_hashes": event.page_hashes,
                             "medium": "CPU", "group_idx": None}
        assert events[2] == {"type": "AllBlocksCleared"}
    finally:
        p.close()


def test_tenant_namespace_never_appears_only_its_hash():
    tokens = list(range(8))
    a, b = page_hashes(tokens, 8, "tenant-a")[0], page_hashes(tokens, 8, "tenant-b")[0]
    payload_a = encode_batch([BlockStored([a], None, tokens, 8)], ts=1.0)
    assert b"tenant" not in payload_a
    assert external_hash(a) != external_hash(b)


def test_buffer_merges_one_chain_and_one_medium_per_step():
    tokens = list(range(12))
    h = page_hashes(tokens, 4, "")
    buf = KVEventBuffer(page_size=4)
    buf.stored(h[0], None, tokens[0:4])
    buf.stored(h[1], h[0], tokens[4:8])
    buf.stored(h[2], h[1], tokens[8:12], medium=MEDIUM_HOST)  # other medium: new event
    buf.removed(h[0])
    buf.removed(h[1])
    events = buf.drain()
    assert events == [BlockStored(h[:2], None, tokens[:8], 4, MEDIUM_POOL),
                      BlockStored([h[2]], h[1], tokens[8:12], 4, MEDIUM_HOST),
                      BlockRemoved(h[:2], MEDIUM_POOL)]
    assert buf.drain() == []
    buf.stored(h[0], None, tokens[0:4])
    buf.cleared()
    assert buf.drain() == [AllBlocksCleared()]
    with pytest.raises(ValueError, match="holds 4 tokens"):
        buf.stored(h[0], None, tokens[:3])


def test_bind_conflict_is_a_clear_error(pub):
    with pytest.raises(ValueError, match="cannot bind the KV events socket"):
        KVEventPublisher(pub.endpoint)


def test_empty_steps_send_nothing_and_sequence_numbers_count_batches(pub):
    pub.publish([])
    pub.publish([stored(0)])
    pub.publish([stored(1)])
    pub.flush()
    assert pub.num_published == 2 and pub.num_dropped == 0
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, pub.encoding)
    sub.replay(1)
    assert sorted(sub.batches) == [1]


def test_kvserve_subscriber_learns_the_past_by_replay_then_follows_live(pub):
    seen: list = []
    for i in range(3):
        pub.publish([stored(i)])
    pub.flush()
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, seen.extend)
    try:
        deadline = time.monotonic() + 10
        i = 3
        while sub.last_seq < 5 and time.monotonic() < deadline:
            if i <= 5:
                pub.publish([stored(i), BlockRemoved(stored(i - 3).page_hashes)])
                i += 1
            time.sleep(0.05)
        assert sub.last_seq == 5 and sub.num_missed == 0 and sub.num_replayed >= 3
        kinds = [(e.kind, e.hashes) for e in seen]
        expected = [("BlockStored", [external_hash(stored(j).page_hashes[0])]) for j in range(3)]
        for j in range(3, 6):
            expected += [("BlockStored", [external_hash(stored(j).page_hashes[0])]),
                         ("BlockRemoved", [external_hash(stored(j - 3).page_hashes[0])])]
        assert kinds == expected
        assert seen[0].token_ids == stored(0).token_ids and seen[0].medium == "GPU"
    finally:
        sub.close()


def test_replay_endpoint_defaults_to_the_next_port():
    assert replay_endpoint_for("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5558"
    assert replay_endpoint_for("tcp://*:*") == "tcp://*:*"
    assert replay_endpoint_for("ipc:///tmp/kv") == "ipc:///tmp/kv-replay"
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        replay_endpoint_for("tcp://host")


def test_a_first_page_carries_its_salt_or_an_opaque_tenant_digest_in_extra_keys():
    assert namespace_extra_keys("") is None
    assert namespace_extra_keys(namespace("", "s1")) == ("s1",)  # vLLM's (cache_salt,)
    a, b = namespace_extra_keys(namespace("key:aaaa", "")), namespace_extra_keys(namespace("key:bbbb", ""))
    assert a != b and a[0].startswith("kvserve-ns:") and "aaaa" not in a[0]
    assert namespace_extra_keys(namespace("key:aaaa", "s1")) not in (a, ("s1",))
    tokens = list(range(12))
    ns = namespace("key:aaaa", "s1")
    h = page_hashes(tokens, 4, ns)
    buf = KVEventBuffer(page_size=4)
    for i in range(3):
        buf.stored(h[i], h[i - 1] if i else None, tokens[i * 4:i * 4 + 4], namespace=ns)
    (event,) = buf.drain()
    assert event.extra_keys == [namespace_extra_keys(ns), None, None]
    wire = vllm_decode(encode_batch([event], ts=1.0))["events"][0]
    assert wire["extra_keys"] == [namespace_extra_keys(ns), None, None]


def test_tier_stores_reuse_the_pools_tokens_until_no_medium_holds_the_page():
    tokens = list(range(8))
    h = page_hashes(tokens, 4, "s")
    buf = KVEventBuffer(page_size=4)
    buf.stored(h[0], None, tokens[:4], namespace="s")
    buf.stored(h[1], h[0], tokens[4:])
    buf.drain()
    buf.removed(h[0])  # evicted from the pool; the host tier takes it in the same step
    buf.tier_stored(h[0], MEDIUM_HOST)
    buf.tier_stored(h[1], MEDIUM_DISK)
    assert buf.drain() == [BlockRemoved([h[0]], MEDIUM_POOL),
                           BlockStored([h[0]], None, tokens[:4], 4, MEDIUM_HOST, extra_keys=[("s",)]),
                           BlockStored([h[1]], h[0], tokens[4:], 4, MEDIUM_DISK)]
    buf.removed(h[0], MEDIUM_HOST)
    buf.drain()  # no medium holds page 0 now: forgotten
    buf.tier_stored(h[0], MEDIUM_DISK)  # (a page found on disk after a restart)
    assert buf.drain() == [BlockStored([h[0]], None, [], 4, MEDIUM_DISK)]


def test_topic_placeholders_and_the_replay_end_marker_carry_the_topic(pub):
    assert fill_topic("kv@{pod_ip}:{port}@{model}", pod_ip="10.0.0.7", port=8000,
                      model="SmolLM2") == TOPIC
    pub.publish([stored(0)])
    pub.flush()
    replies = replay(pub.replay_endpoint, 0)  # (asserts the [b"", topic, -1, b""] end marker)
    assert [(t, s) for t, s, _ in replies] == [(TOPIC.encode(), 0)]
    pub.set_topic("kv@other@m")
    assert [t for t, _, _ in replay(pub.replay_endpoint, 0)] == [b"kv@other@m"]


def test_remote_binds_need_to_be_asked_for():
    assert is_loopback("tcp://127.0.0.1:5557") and is_loopback("tcp://[::1]:5557")
    assert is_loopback("ipc:///tmp/kv") and not is_loopback("tcp://*:5557")
    assert not is_loopback("tcp://0.0.0.0:5557") and not is_loopback("tcp://10.1.2.3:5557")
    with pytest.raises(ValueError, match="every tenant's prompt tokens"):
        KVEventPublisher("tcp://*:*", "tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="kv-events-allow-remote"):
        KVEventPublisher("tcp://127.0.0.1:*", "tcp://0.0.0.0:*")
    KVEventPublisher("tcp://0.0.0.0:*", None, allow_remote=True).close()


def test_connect_mode_publishes_to_a_subscriber_that_binds():
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    p = KVEventPublisher(f"tcp://127.0.0.1:{port}", None, connect=True, topic="kv@x@m")
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            p.publish([stored(0)])
            if sub.poll(100):
                topic, _, payload = sub.recv_multipart()
                assert topic == b"kv@x@m"
                assert vllm_decode(payload)["events"][0]["token_ids"] == stored(0).token_ids
                return
        raise AssertionError("nothing arrived at the binding subscriber")
    finally:
        p.close()
        sub.close(linger=0)


def test_token_ids_off_sends_none_and_hashes_still_go_out():
    p = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", send_token_ids=False)
    try:
        p.publish([stored(3)])
        p.flush()
        (_, _, payload), = replay(p.replay_endpoint, 0)
        event = vllm_decode(payload)["events"][0]
        assert event["token_ids"] == [] and event["block_hashes"] == [external_hash(stored(3).page_hashes[0])]
        assert msgpack.packb(stored(3).token_ids)[1:] not in payload
    finally:
        p.close()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_with_curve_a_subscriber_without_the_servers_key_gets_nothing():
    public, secret = zmq.curve_keypair()
    p = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve=CurveKeys.from_secret(secret))
    blind: list = []
    keyed: list = []
    plain = KVEventSubscriber(p.endpoint, p.replay_endpoint, blind.extend, replay_timeout_s=0.5)
    good = KVEventSubscriber(p.endpoint, p.replay_endpoint, keyed.extend,
                             curve_server_key=public.decode())
    try:
        deadline = time.monotonic() + 10
        i = 0
        while not keyed and time.monotonic() < deadline:
            p.publish([stored(i)])
            i += 1
            time.sleep(0.05)
        for _ in range(10):  # well past the keyed subscriber's first batch
            p.publish([stored(i)])
            i += 1
        time.sleep(0.5)
        assert keyed and keyed[0].token_ids == stored(0).token_ids
        assert blind == [] and plain.num_batches == 0
    finally:
        plain.close()
        good.close()
        p.close()
    with pytest.raises(ValueError, match="CURVE secret key"):
        CurveKeys.from_secret(b"not a key")
