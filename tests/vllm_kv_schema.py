"""vLLM's KV event structs, written from vllm/distributed/kv_events.py as it is today (msgspec,
tag=True, omit_defaults=True; `lora_name` and `extra_keys` after `medium`), in both of the forms a
publisher may send: `array_like=True` (positional, vLLM <= 0.11 and what Dynamo and llm-d decode) and
maps (current vLLM). A test decodes kvserve's payloads with these, never with kvserve's own decoder."""


from typing import Any

import msgspec
import zmq

Hash = int | bytes


def structs(array_like: bool) -> dict[str, Any]:
    opts = dict(omit_defaults=True, gc=False, array_like=array_like)

    class KVCacheEvent(msgspec.Struct, tag=True, **opts):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[Hash]
        parent_block_hash: Hash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[Hash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, **opts):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
            "AllBlocksCleared": AllBlocksCleared, "decoder": msgspec.msgpack.Decoder(KVEventBatch)}


SCHEMAS = {"array": structs(True), "map": structs(False)}


def decode(payload: bytes, encoding: str):
    """A KVEventBatch; raises msgspec.ValidationError when the payload does not fit the schema."""
    return SCHEMAS[encoding]["decoder"].decode(payload)


END_SEQ = -1


def replay(endpoint: str, start: int, timeout_ms: int = 5000) -> list[tuple[bytes, int, bytes]]:
    """[(topic, seq, payload)] from a publisher's replay ROUTER, asked through a DEALER as vLLM's
    test does since #45177: each reply is [b"", topic, seq, payload], the last [b"", topic, -1, b""]."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(timeout_ms), "no replay answer"
            empty, topic, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                assert payload == b""
                return got
            got.append((topic, seq, payload))
    finally:
        dealer.close(linger=0)
