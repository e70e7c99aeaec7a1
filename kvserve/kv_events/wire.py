"""The KV event wire format (vLLM's schema, see kv_events/__init__.py): page hashes as sent, the
event and batch encodings (array or map), their decoding, topics and endpoint addresses."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from kvserve.cache.events import BlockRemoved, BlockStored, Event, namespace_extra_keys
from kvserve.cache.hashing import namespace

END_SEQ = (-1).to_bytes(8, "big", signed=True)
HashFormat = Literal["int", "bytes"]
Encoding = Literal["array", "map"]
ENCODINGS = ("array", "map")

def external_hash(page_hash: bytes, hash_format: HashFormat = "int") -> int | bytes:
    """A page hash as it goes on the wire (vLLM's `maybe_convert_block_hash`)."""
    if hash_format == "bytes":
        return bytes(page_hash)
    return int.from_bytes(page_hash, "big") & ((1 << 64) - 1)


def replay_endpoint_for(endpoint: str) -> str:
    """The replay socket's default address: the events port + 1 (`tcp://h:5557` -> `tcp://h:5558`);
    a free port when the events port is `*`; `ipc://x` -> `ipc://x-replay`."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port == "*":
            return endpoint
        if not port.isdigit():
            raise ValueError(f"--kv-events-endpoint {endpoint!r}: expected tcp://HOST:PORT")
        return f"{host}:{int(port) + 1}"
    return endpoint + "-replay"


def is_loopback(endpoint: str) -> bool:
    """Whether a bind address reaches this machine only (ipc:// is a local file)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a host name
        return False


def fill_topic(template: str, *, pod_ip: str, port: int | str, model: str) -> str:
    """vLLM's `topic` with `{pod_ip}`, `{port}` and `{model}` filled in (llm-d reads
    `kv@<pod>@<model>`: `--kv-events-topic 'kv@{pod_ip}:{port}@{model}'`)."""
    return template.replace("{pod_ip}", pod_ip).replace("{port}", str(port)).replace("{model}", model)


def event_cache_salt(tenant: str, cache_salt: str | None) -> str | None:
    """The string a request's first page carries in `extra_keys` (its salt, or with a tenant an
    opaque digest of the namespace): what a router folds into its block keys (render routes)."""
    extra = namespace_extra_keys(namespace(tenant, cache_salt))
    return extra[0] if extra else None


def pod_ip(endpoint: str = "") -> str:
    """`{pod_ip}` of a topic: $POD_IP (Kubernetes' downward API), else the events endpoint's own
    address when it names one, else 127.0.0.1."""
    if os.environ.get("POD_IP"):
        return os.environ["POD_IP"]
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]") if endpoint.startswith("tcp://") else ""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return "127.0.0.1"


# -- encoding ------------------------------------------------------------------------------------
def encode_event(event: Event, hash_format: HashFormat = "int", encoding: Encoding = "array",
                 send_token_ids: bool = True) -> list | dict:
    def ext(hashes: Sequence[bytes]) -> list[int | bytes]:
        return [external_hash(h, hash_format) for h in hashes]

    if isinstance(event, BlockStored):
        parent = None if event.parent_hash is None else external_hash(event.parent_hash, hash_format)
        names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name")
        values = [ext(event.page_hashes), parent, list(event.token_ids) if send_token_ids else [],
                  event.page_size, event.lora_id, event.medium, event.lora_name]
        if event.extra_keys is not None:
            names += ("extra_keys",)
            values.append([None if k is None else list(k) for k in event.extra_keys])
    elif isinstance(event, BlockRemoved):
        names, values = ("block_hashes", "medium"), [ext(event.page_hashes), event.medium]
    else:
        names, values = (), []
    tag = type(event).__name__
    if encoding == "map":
        return {"type": tag, **dict(zip(names, values))}
    return [tag, *values]


def encode_batch(events: Sequence[Event], ts: float, data_parallel_rank: int = 0,
                 hash_format: HashFormat = "int", encoding: Encoding = "array",
                 send_token_ids: bool = True) -> bytes:
    """One KVEventBatch payload."""
    encoded = [encode_event(e, hash_format, encoding, send_token_ids) for e in events]
    if encoding == "map":
        batch: Any = {"ts": ts, "events": encoded, "data_parallel_rank": data_parallel_rank}
    else:
        batch = [ts, encoded, data_parallel_rank]
    return msgpack.packb(batch, use_bin_type=True)


# -- the reading side (the router) ---------------------------------------------------------------
@dataclass(slots=True)
class WireEvent:
    """One decoded event; hashes as they came (int, or bytes with hash_format="bytes")."""

    kind: str  # "BlockStored" | "BlockRemoved" | "AllBlocksCleared"
    hashes: list[int | bytes] = field(default_factory=list)
    medium: str | None = None
    parent: int | bytes | None = None
    token_ids: list[int] = field(default_factory=list)


_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium"),
           "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def decode_batch(payload: bytes) -> list[WireEvent]:
    """The events of one KVEventBatch payload, array or map form; unknown event kinds are skipped."""
    batch = msgpack.unpackb(payload, raw=False)
    events = batch.get("events", []) if isinstance(batch, dict) else batch[1]
    decoded = []
    for raw in events:
        if isinstance(raw, dict):
            tag = raw.get("type")
            values = [raw.get(name) for name in _FIELDS.get(tag, ())]
        else:
            tag, *values = raw
            values += [None] * 6  # trailing fields with defaults may be omitted
        if tag == "BlockStored":
            decoded.append(WireEvent(tag, list(values[0]), values[5], values[1], list(values[2] or [])))
        elif tag == "BlockRemoved":
            decoded.append(WireEvent(tag, list(values[0]), values[1]))
        elif tag == "AllBlocksCleared":
            decoded.append(WireEvent(tag))
    return decoded
