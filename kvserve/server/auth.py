"""API keys, checked from the request headers before any of the body is read.

`KeyGate` is plain ASGI middleware, outside the body cap and the app: with keys configured, a
request to anything but the open pages (/health, /metrics, /dashboard) without a valid key is
answered 401 and its connection closed, its body never buffered. So that an ordinary client with a
wrong key reads that 401 rather than a reset connection (closing a socket with unread data sends a
RST), up to `UNAUTHENTICATED_DRAIN_BYTES` of its body are read and dropped first, within the read
timeout; at most `max_unauthenticated` such requests are drained at once, and beyond that the 401
comes at once. A valid key's cache namespace is put in the ASGI scope for the app, and an id of the
key for the per-key caps of the body cap (limits.BodyLimit, inflight.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

from kvserve.server.error_shapes import front_error
from kvserve.server.inflight import CLIENT_KEY_SCOPE
from kvserve.server.limits import close_with, receive_by

# /dashboard is a page without data (its script asks /dashboard/stats with the key); /metrics is open by
# design (tenant series under keyed labels: metrics.py)
OPEN_PATHS = frozenset({"/health", "/metrics", "/dashboard"})
NAMESPACE_SCOPE_KEY = "kvserve.namespace"
UNAUTHENTICATED_DRAIN_BYTES = 1 << 20
DEFAULT_MAX_UNAUTHENTICATED = 64
DEFAULT_READ_TIMEOUT_S = 30.0
INVALID_KEY = ("Incorrect API key provided; send it as `Authorization: Bearer KEY` or "
               "`x-api-key: KEY`")

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


def key_namespace(api_key: str) -> str:
    """A tenant's cache namespace: derived from its key, never the key itself."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


class ApiKeys:
    """The server's keys and the cache namespace of each ("" for all when they share one). Admin keys
    (`--admin-api-key-file`) are keys too, with a namespace of their own, and also see what spans
    tenants (the whole cache report)."""

    def __init__(self, keys: list[str] | None, shared_namespace: bool = False,
                 admin_keys: list[str] | None = None) -> None:
        every = list(dict.fromkeys([*(keys or []), *(admin_keys or [])]))
        self.namespaces = {k: ("" if shared_namespace else key_namespace(k)) for k in every}
        self.admin_keys = list(admin_keys or [])

    def __bool__(self) -> bool:
        return bool(self.namespaces)

    def namespace_of(self, headers: dict[str, str]) -> str | None:
        """The namespace of the key in `Authorization: Bearer` or `x-api-key`; None if no valid key."""
        if not self.namespaces:
            return ""
        key = self._match(headers, self.namespaces)
        return None if key is None else self.namespaces[key]

    def key_id_of(self, headers: dict[str, str]) -> str | None:
        """An id of the valid key the headers carry (not the key, and apart from namespaces, which
        keys may share): what per-key caps count by (inflight.py)."""
        key = self._match(headers, self.namespaces) if self.namespaces else None
        return None if key is None else key_namespace(key)

    def is_admin(self, headers: dict[str, str]) -> bool:
        """Whether the request may see across tenants: an admin key, or a server without keys
        (whose one user is its operator)."""
        return not self.namespaces or self._match(headers, self.admin_keys) is not None

    @staticmethod
    def _match(headers: dict[str, str], keys) -> str | None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else ""
        for token in filter(None, (bearer, headers.get("x-api-key", "").strip())):
            for key in keys:
                if hmac.compare_digest(token.encode(), key.encode()):
                    return key
        return None


class KeyGate:
    def __init__(self, app, keys: ApiKeys, max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        self.app = app
        self.keys = keys
        self.max_unauthenticated = max_unauthenticated
        self.read_timeout_s = read_timeout_s
        self.num_draining = 0  # unauthenticated requests whose body is being read and dropped

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers") or []}
        namespace = self.keys.namespace_of(headers)
        if namespace is not None:
            scope[NAMESPACE_SCOPE_KEY] = namespace
            scope[CLIENT_KEY_SCOPE] = self.keys.key_id_of(headers)
            return await self.app(scope, receive, send)
        if self.num_draining < self.max_unauthenticated:
            self.num_draining += 1
            try:
                await self._drain(receive)
            finally:
                self.num_draining -= 1
        await self._refuse(scope, send)

    async def _drain(self, receive: Receive) -> None:
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s
        size = 0
        while size <= UNAUTHENTICATED_DRAIN_BYTES:
            message = await receive_by(receive, deadline)
            if message is None or message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
            size += len(message.get("body", b""))

    @staticmethod
    async def _refuse(scope: Scope, send: Send) -> None:
        body = front_error(str(scope.get("path", "")), 401, INVALID_KEY, code="invalid_api_key")
        await close_with(send, 401, body, [(b"www-authenticate", b"Bearer")])
