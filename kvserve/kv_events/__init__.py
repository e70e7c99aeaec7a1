"""The KV event wire: vLLM's schema (msgpack over ZMQ PUB, a topic, sequence numbers, a replay
socket) so that routers built for vLLM's events (llm-d, Dynamo, kvserve's own) can follow which pages
an instance holds. The engine publishes what cache/events.py collected; the router subscribes.

As vLLM's `ZmqEventPublisher` and its msgspec structs (vllm/distributed/kv_events.py) send them:

    multipart message   [topic, seq (8-byte big-endian), payload]
    replay reply        [topic, seq, payload] per batch, then [topic, -1 (int64), b""]  (vLLM #45177)
    payload "array"     [ts, [event, ...], data_parallel_rank]   (array_like=True: Dynamo, llm-d, vLLM <= 0.11)
            "map"       {"ts", "events", "data_parallel_rank"}   (current vLLM; llm-d decodes both)
    BlockStored         ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                         lora_id, medium, lora_name, extra_keys?]     (map: {"type": "BlockStored", ...})
    BlockRemoved        ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared    ["AllBlocksCleared"]

`extra_keys` (omitted when no page has any, as msgspec's omit_defaults does) holds a first page's
`(cache_salt,)`, or `(kvserve-ns:<digest>,)` for a tenant's namespace (cache/events.py). Block
hashes are vLLM's default form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the page hash read
big-endian, masked to its low 64 bits; `hash_format="bytes"` sends the whole 16-byte hash.

Trust: the stream tells who subscribes which token ids each instance caches (prompt text, all
tenants). The publisher binds loopback addresses only unless told otherwise (`allow_remote`), can
require CURVE encryption (a subscriber must know the server's public key), and can leave token ids
out (`send_token_ids=False`; only routers that match kvserve's own block hashes still work).
"""

from kvserve.kv_events.publisher import CurveKeys, KVEventPublisher, attach_tiers, publisher_for
from kvserve.kv_events.subscriber import KVEventSubscriber
from kvserve.kv_events.wire import (END_SEQ, ENCODINGS, Encoding, HashFormat, WireEvent, decode_batch,
                                    encode_batch, encode_event, event_cache_salt, external_hash,
                                    fill_topic,
                                    is_loopback, pod_ip, replay_endpoint_for)

__all__ = ["END_SEQ", "ENCODINGS", "CurveKeys", "Encoding", "HashFormat", "KVEventPublisher",
           "KVEventSubscriber", "WireEvent", "attach_tiers", "decode_batch", "encode_batch",
           "encode_event", "event_cache_salt", "external_hash", "fill_topic", "is_loopback", "pod_ip", "publisher_for",
           "replay_endpoint_for"]
