"""Where stored responses outlive the process: beside the disk tier (`--kv-disk-path`) or in Redis
(`--redis-url`), so a `previous_response_id` still continues its conversation after a restart (and, in
Redis, on another instance). responses_store.ResponseStore writes each stored response through to one
of these and reads it back on a miss in memory.

A record is the stored response as JSON (response object, conversation, prompt record) with its
wall-clock expiry. Names are digests: of the tenant (an API key's namespace) and of the response id,
so a tenant's id never reaches another tenant's records and no id becomes a path. Per tenant the count
and the bytes are bounded as in memory, the oldest dropped first; expired records are never returned.
A failing disk or Redis loses persistence (logged), never the request. With the tier secret
(--kv-tier-secret-file: the engine's `tier_auth`) each record carries a keyed MAC over its name and
bytes, so one written or moved by someone without the secret is never served (as absent).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("kvserve.responses")


class Sealer(Protocol):
    """cache/tier_auth.TierAuth, as the engine hands it over (seal: value + MAC; open: None if forged)."""

    def seal(self, key: str, value: bytes) -> bytes: ...
    def open(self, key: str, sealed: bytes) -> Any: ...


class _Plain:
    def seal(self, key: str, value: bytes) -> bytes:
        return value

    def open(self, key: str, sealed: bytes) -> bytes:
        return sealed


class ResponseBacking(Protocol):
    def put(self, tenant: str, response_id: str, record: dict[str, Any], ttl_s: float) -> None: ...
    def get(self, tenant: str, response_id: str) -> dict[str, Any] | None: ...
    def delete(self, tenant: str, response_id: str) -> bool: ...


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvserve-resp").hexdigest()


def _name(tenant: str, response_id: str) -> str:
    """What a record's MAC covers besides its bytes: it cannot be moved to another tenant or id."""
    return f"response:{digest(tenant)}:{digest(response_id)}"


def _encode(response_id: str, record: dict[str, Any], ttl_s: float) -> bytes:
    return json.dumps({"id": response_id, "expires_at": time.time() + ttl_s, **record},
                      ensure_ascii=False).encode()


def _decode(response_id: str, raw: bytes | None) -> dict[str, Any] | None:
    """The record, or None when it is unreadable, another id's (a digest collision) or expired."""
    if raw is None:
        return None
    try:
        record = json.loads(bytes(raw))
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("id") != response_id:
        return None
    return record if record.get("expires_at", 0) > time.time() else None


class DiskResponses:
    """`{root}/{tenant digest}/{id digest}.json`, written as temp file + rename."""

    def __init__(self, root: str | os.PathLike, max_responses: int, max_bytes: int,
                 sealer: Sealer | None = None) -> None:
        self.root = Path(root)
        self.sealer = sealer or _Plain()
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._lock = threading.Lock()  # one trim at a time

    def _file(self, tenant: str, response_id: str) -> Path:
        return self.root / digest(tenant) / f"{digest(response_id)}.json"

    def put(self, tenant: str, response_id: str, record: dict[str, Any], ttl_s: float) -> None:
        path = self._file(tenant, response_id)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(self.sealer.seal(_name(tenant, response_id), _encode(response_id, record, ttl_s)))
            os.replace(tmp, path)
            self._trim(path.parent)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            log.warning("cannot keep stored response %s on disk: %s", response_id, err)

    def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        path = self._file(tenant, response_id)
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        opened = self.sealer.open(_name(tenant, response_id), raw)
        record = _decode(response_id, opened) if opened is not None else None
        if record is None:
            with contextlib.suppress(OSError):
                path.unlink()
        return record

    def delete(self, tenant: str, response_id: str) -> bool:
        try:
            self._file(tenant, response_id).unlink()
            return True
        except OSError:
            return False

    def _trim(self, folder: Path) -> None:
        """The oldest records go until the tenant is within its count and bytes."""
        with self._lock:
            found = []
            for path in folder.glob("*.json"):
                with contextlib.suppress(OSError):
                    stat = path.stat()
                    found.append((stat.st_mtime, stat.st_size, path))
            found.sort()
            total = sum(size for _, size, _ in found)
            while found and (len(found) > self.max_responses or total > self.max_bytes):
                _, size, path = found.pop(0)
                total -= size
                with contextlib.suppress(OSError):
                    path.unlink()


class RedisResponses:
    """`kvserve:responses:{tenant digest}:{id digest}` with the record's TTL; per tenant a sorted set
    (by time stored) and a hash of sizes bound the count and the bytes."""

    def __init__(self, url: str, max_responses: int, max_bytes: int, timeout_s: float = 1.0,
                 sealer: Sealer | None = None) -> None:
        import redis

        self.sealer = sealer or _Plain()
        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.max_responses, self.max_bytes = max_responses, max_bytes

    @staticmethod
    def _keys(tenant: str, response_id: str | None = None) -> tuple[str, str, str]:
        base = f"kvserve:responses:{digest(tenant)}"
        return f"{base}:{digest(response_id or '')}", f"{base}:index", f"{base}:sizes"

    def put(self, tenant: str, response_id: str, record: dict[str, Any], ttl_s: float) -> None:
        key, index, sizes = self._keys(tenant, response_id)
        value = self.sealer.seal(_name(tenant, response_id), _encode(response_id, record, ttl_s))
        name, now = digest(response_id), time.time()
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(key, value, ex=max(1, int(ttl_s)))
            pipe.zadd(index, {name: now})
            pipe.hset(sizes, name, len(value))
            pipe.expire(index, max(1, int(ttl_s)))
            pipe.expire(sizes, max(1, int(ttl_s)))
            pipe.zrange(index, 0, -1, withscores=True)
            pipe.hgetall(sizes)
            *_, names, sized = pipe.execute()
            self._trim(tenant, names, sized, now - ttl_s)
        except self._errors as err:
            log.warning("cannot keep stored response %s in Redis: %s", response_id, err)

    def _trim(self, tenant: str, names: list[tuple[bytes, float]], sized: dict[bytes, bytes],
              expired_before: float) -> None:
        base = self._keys(tenant)[0].rsplit(":", 1)[0]
        total = sum(int(v) for v in sized.values())
        drop = []
        for count, (name, score) in enumerate(names):  # oldest first
            if score >= expired_before and len(names) - count <= self.max_responses and total <= self.max_bytes:
                break
            drop.append(name)
            total -= int(sized.get(name, 0))
        if drop:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(*(f"{base}:{n.decode()}" for n in drop))
            pipe.zrem(f"{base}:index", *drop)
            pipe.hdel(f"{base}:sizes", *drop)
            pipe.execute()

    def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        try:
            raw = self.client.get(self._keys(tenant, response_id)[0])
            opened = self.sealer.open(_name(tenant, response_id), raw) if raw is not None else None
            return _decode(response_id, opened)
        except self._errors as err:
            log.warning("cannot read stored response %s from Redis: %s", response_id, err)
            return None

    def delete(self, tenant: str, response_id: str) -> bool:
        key, index, sizes = self._keys(tenant, response_id)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(key)
            pipe.zrem(index, digest(response_id))
            pipe.hdel(sizes, digest(response_id))
            return bool(pipe.execute()[0])
        except self._errors as err:
            log.warning("cannot delete stored response %s from Redis: %s", response_id, err)
            return False


def response_backing(disk_path: str | None, redis_url: str | None, max_responses: int,
                     max_bytes: int, sealer: Sealer | None = None) -> ResponseBacking | None:
    """Redis when the server has it (every instance then finds a stored response), else the disk
    tier's directory (`{kv_disk_path}/responses`), else none (stored responses live in memory only)."""
    if redis_url:
        return RedisResponses(redis_url, max_responses, max_bytes, sealer=sealer)
    if disk_path:
        return DiskResponses(Path(disk_path) / "responses", max_responses, max_bytes, sealer)
    return None
