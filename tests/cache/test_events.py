"""KV events: a subscriber written from vLLM's published schema (kv_events.py structs and the
ZmqEventPublisher wire protocol), not from kvserve's encoder, decodes kvserve's stream and, after a
dropped connection, replays the missed batches by sequence number."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack
import pytest
import zmq

from kvserve.cache.events import (MEDIUM_HOST, MEDIUM_POOL, AllBlocksCleared, BlockRemoved,
                                  BlockStored, KVEventBuffer, KVEventPublisher, encode_batch,
                                  external_hash)
from kvserve.cache.hashing import page_hashes

# vLLM's structs (msgspec, array_like=True, tag=True: [tag, fields in declaration order]);
# trailing fields with defaults may be omitted (omit_defaults=True)
VLLM_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def vllm_decode(payload: bytes) -> dict:
    ts, events, *rest = msgpack.unpackb(payload, raw=False)
    decoded = []
    for tag, *values in events:
        fields = VLLM_FIELDS[tag]
        assert len(values) <= len(fields)
        decoded.append({"type": tag, **dict(zip(fields, values + [None] * len(fields)))})
    return {"ts": ts, "events": decoded, "data_parallel_rank": rest[0] if rest else None}


@dataclass
class Subscriber:
    """vLLM's example subscriber: SUB for the live stream; on a gap, ask the replay ROUTER (here
    through a DEALER, which may read the several replies) for everything from the first missed seq."""

    endpoint: str
    replay_endpoint: str
    batches: dict[int, dict] = field(default_factory=dict)
    last_seq: int = -1
    replays: int = 0

    def __post_init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.connect()

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.endpoint)

    def drop(self) -> None:
        self.sub.close(linger=0)

    def poll(self, timeout_ms: int = 100) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq > self.last_seq + 1:
            self.replay(self.last_seq + 1)
        self.take(seq, payload)
        return True

    def replay(self, start: int) -> None:
        self.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        try:
            while True:
                assert dealer.poll(5000), "no replay answer"
                _, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    return
                self.take(seq, payload)
        finally:
            dealer.close(linger=0)

    def take(self, seq: int, payload: bytes) -> None:
        if seq not in self.batches:
            self.batches[seq] = vllm_decode(payload)
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


@pytest.fixture
def pub():
    p = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=1000)
    yield p
    p.close()


def test_vllm_subscriber_decodes_the_stream_and_replays_after_a_dropped_connection(pub):
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
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
        assert first["block_size"] == 4 and first["lora_id"] is None and first["medium"] == "pool"
        if len(batch["events"]) == 2:
            assert batch["events"][1] == {"type": "BlockRemoved", "medium": "pool",
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
                             "medium": "host"}
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
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    sub.replay(1)
    assert sorted(sub.batches) == [1]


def test_kvserve_subscriber_learns_the_past_by_replay_then_follows_live(pub):
    from kvserve.cache.events import KVEventSubscriber

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
        assert seen[0].token_ids == stored(0).token_ids and seen[0].medium == "pool"
    finally:
        sub.close()


def test_replay_endpoint_defaults_to_the_next_port():
    from kvserve.cache.events import replay_endpoint_for

    assert replay_endpoint_for("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5558"
    assert replay_endpoint_for("tcp://*:*") == "tcp://*:*"
    assert replay_endpoint_for("ipc:///tmp/kv") == "ipc:///tmp/kv-replay"
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        replay_endpoint_for("tcp://host")
