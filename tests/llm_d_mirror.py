"""A Python rendering of llm-d's KV-event subscriber and precise prefix-cache scorer, written from
its Go source (llm-d-router: pkg/kvevents/zmq_subscriber.go, pool.go, engineadapter/vllm_adapter.go,
pkg/kvcache/kvblock/token_processor.go, extra_keys parsing, the scorer's cache-salt folding), so a
test can show that llm-d would route to kvserve instances unchanged. Test code: kvserve never uses it.

    subscriber  SUB with topic filter "kv@"; on connect a replay from 0 over a DEALER
                ([b"", seq] -> [topic, seq, payload]..., then [topic, -1, b""])
    pool        pod and model from the topic `kv@<pod>@<model>`; BlockStored -> request keys from
                token_ids (lora_name, if set, stands for the model); extra_keys strings fold into
                their block's hash; BlockRemoved evicts by engine key; AllBlocksCleared drops the pod
    keys        FNV-64a over canonical CBOR of [parent, tokens, extra]; the chain starts at
                hash(FNV-64a(seed), nil, model); extra is nil or [{"Hash": s}, ...]
    scorer      a prompt's keys (its cache_salt folded into block 0), each pod's longest run of
                leading keys it holds; the highest run wins
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence

import msgpack
import zmq

FNV_OFFSET, FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


def fnv64a(data: bytes) -> int:
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(n)


def cbor(value) -> bytes:
    """Canonical CBOR (RFC 7049 §3.9, fxamacker's CanonicalEncOptions) of the few types the keys
    use: unsigned ints, None, text, lists, maps with text keys."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise TypeError("no bools in block keys")
    if isinstance(value, int):
        if value < 0:
            raise TypeError("block keys hold unsigned ints")
        return _head(0, value)
    if isinstance(value, str):
        raw = value.encode()
        return _head(3, len(raw)) + raw
    if isinstance(value, (list, tuple)):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    if isinstance(value, dict):
        items = sorted((cbor(k), cbor(v)) for k, v in value.items())
        items.sort(key=lambda kv: (len(kv[0]), kv[0]))  # length first, then bytewise
        return _head(5, len(items)) + b"".join(k + v for k, v in items)
    raise TypeError(type(value))


class TokenProcessor:
    """chunkedTokenDatabase with HashAlgorithm "cbor-fnv" (the default)."""

    def __init__(self, block_size: int = 16, hash_seed: str = "") -> None:
        self.block_size = block_size
        self.init_hash = fnv64a(hash_seed.encode())

    def hash(self, parent: int, tokens: Sequence[int] | None, extra) -> int:
        return fnv64a(cbor([parent, None if tokens is None else list(tokens), extra]))

    def keys(self, parent: int, tokens: Sequence[int], model: str,
             extra_features: list[list[str] | None] | None = None) -> list[int]:
        chunks = [tokens[i:i + self.block_size]
                  for i in range(0, len(tokens) - self.block_size + 1, self.block_size)]
        if not chunks:
            return []
        prefix = parent if parent else self.hash(self.init_hash, None, model)
        extra_features = extra_features or [None] * len(chunks)
        keys = []
        for chunk, features in zip(chunks, extra_features):
            prefix = self.hash(prefix, chunk, [{"Hash": h} for h in features] if features else None)
            keys.append(prefix)
        return keys


def parse_topic(topic: str) -> tuple[str, str]:
    """`kv@<pod>@<model>` -> (pod, model)."""
    parts = topic.split("@", 2)
    return (parts[1], parts[2]) if len(parts) == 3 else ("", "")


def parse_extra_keys(raw: list | None) -> list[list[str] | None] | None:
    """ParseRawExtraKeys: per block, bare strings (vLLM >= 0.18 identifiers, the cache salt) and the
    first element of legacy [hash, offset] pairs taint the block; other entries are skipped."""
    if raw is None:
        return None
    out: list[list[str] | None] = []
    for block in raw:
        found = []
        for entry in block or []:
            if isinstance(entry, str):
                found.append(entry)
            elif isinstance(entry, list) and entry and isinstance(entry[0], str):
                found.append(entry[0])
        out.append(found or None)
    return out


def event_fields(raw) -> list:
    """vllm_adapter.decodeVLLMEvent: a positional event, or a map normalized to positions."""
    if isinstance(raw, list):
        return raw
    order = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                             "medium", "lora_name", "extra_keys"],
             "BlockRemoved": ["block_hashes", "medium"]}.get(raw["type"], [])
    return [raw["type"], *(raw.get(name) for name in order)]


def at(fields: list, i: int):
    return fields[i] if i < len(fields) else None


class Index:
    """The in-memory index: request key -> {pod: tiers}, engine key -> request key."""

    def __init__(self, processor: TokenProcessor) -> None:
        self.processor = processor
        self.pods: dict[int, dict[str, set[str]]] = {}
        self.engine_to_request: dict[int, int] = {}
        self.lock = threading.Lock()
        self.num_skipped = 0  # stores whose parent was unknown (as llm-d, skipped)

    def process(self, topic: bytes, payload: bytes) -> None:
        pod, model = parse_topic(topic.decode())
        batch = msgpack.unpackb(payload, raw=False)
        events = batch["events"] if isinstance(batch, dict) else batch[1]
        with self.lock:
            for raw in events:
                fields = event_fields(raw)
                tag = fields[0]
                if tag == "BlockStored":
                    self._stored(pod, model, fields)
                elif tag == "BlockRemoved":
                    tier = (at(fields, 2) or "gpu").lower()
                    for engine_key in fields[1]:
                        request_key = self.engine_to_request.get(engine_key)
                        holders = self.pods.get(request_key, {})
                        if pod in holders:
                            holders[pod].discard(tier)
                            if not holders[pod]:
                                del holders[pod]
                elif tag == "AllBlocksCleared":
                    for holders in self.pods.values():
                        holders.pop(pod, None)

    def _stored(self, pod: str, model: str, fields: list) -> None:
        hashes, parent, tokens = fields[1], fields[2], fields[3]
        tier = (at(fields, 6) or "gpu").lower()
        lora_name = at(fields, 7)
        effective_model = lora_name or model
        parent_key = 0
        if parent:
            if parent not in self.engine_to_request:
                self.num_skipped += 1
                return
            parent_key = self.engine_to_request[parent]
        extra = parse_extra_keys(at(fields, 8))
        request_keys = self.processor.keys(parent_key, tokens, effective_model, extra)
        if not request_keys:  # a location-only store: tiers of blocks already known
            request_keys = [self.engine_to_request[h] for h in hashes if h in self.engine_to_request]
        else:
            for engine_key, request_key in zip(hashes, request_keys):
                self.engine_to_request[engine_key] = request_key
        for request_key in request_keys:
            self.pods.setdefault(request_key, {}).setdefault(pod, set()).add(tier)

    def score(self, tokens: Sequence[int], model: str, cache_salt: str = "") -> dict[str, int]:
        """Each pod's run of leading prompt blocks it holds (the precise prefix-cache scorer)."""
        num_blocks = len(tokens) // self.processor.block_size
        extra = None
        if cache_salt and num_blocks:  # foldCacheSalt: the salt joins block 0's extra features
            extra = [[cache_salt]] + [None] * (num_blocks - 1)
        keys = self.processor.keys(0, tokens, model, extra)
        with self.lock:
            scores: dict[str, int] = {}
            alive: set[str] | None = None
            for i, key in enumerate(keys):
                holders = set(self.pods.get(key, {}))
                alive = holders if alive is None else alive & holders
                if not alive:
                    break
                for pod in alive:
                    scores[pod] = i + 1
            return scores


class Subscriber:
    """zmqSubscriber: SUB on `endpoint` filtered by "kv@", a replay from 0 first, then live."""

    def __init__(self, index: Index, endpoint: str, replay_endpoint: str) -> None:
        self.index, self.endpoint, self.replay_endpoint = index, endpoint, replay_endpoint
        self.last_seq = -1
        self.num_batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(self.endpoint)
        try:
            self._replay(ctx, 0)
            while not self._stop.is_set():
                if not sub.poll(50):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) < 8:
                    continue  # a malformed frame
                seq = int.from_bytes(frames[1], "big")
                if seq > self.last_seq + 1:
                    self._replay(ctx, self.last_seq + 1)
                if seq > self.last_seq:
                    self._take(frames[0], seq, frames[2])
        finally:
            sub.close(linger=0)

    def _replay(self, ctx: zmq.Context, start: int) -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(2000):
                frames = dealer.recv_multipart()
                if frames and not frames[0]:
                    frames = frames[1:]
                if len(frames) == 3 and not frames[2]:
                    return  # the end marker
                if len(frames) != 3 or len(frames[1]) < 8:
                    raise AssertionError(f"malformed replay frame with {len(frames)} frames")
                seq = int.from_bytes(frames[1], "big")
                if seq > self.last_seq:
                    self._take(frames[0], seq, frames[2])
        finally:
            dealer.close(linger=0)

    def _take(self, topic: bytes, seq: int, payload: bytes) -> None:
        self.index.process(topic, payload)
        self.last_seq = seq
        self.num_batches += 1
