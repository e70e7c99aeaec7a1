"""Operator-issued subscriber keys for the CURVE-encrypted event stream. CURVE alone encrypts, but
lets in any subscriber that knows the server's public key (which is not a secret in CURVE's model);
with `--kv-events-curve-clients-file` only subscribers whose own public key is listed get in (ZAP,
ZeroMQ's authentication protocol), so a tenant that learned the server's key still reads nothing.
The publisher's sockets then live on a context of their own, whose ZAP handler is this allowlist.

    kvserve serve ... --kv-events-curve-secret-file server.key --kv-events-curve-clients-file clients
    kvserve router ... --kv-events-curve-client-secret-file router.key     (its public key in `clients`)
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("kvserve.events")
Z85_KEY_CHARS = 40


def read_client_keys(path: str) -> frozenset[bytes]:
    """Subscriber public keys (Z85, 40 characters), one per line; blank lines and # comments skipped."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read --kv-events-curve-clients-file {path}: {err}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    for number, key in enumerate(keys, 1):
        if len(key) != Z85_KEY_CHARS:
            raise ValueError(f"--kv-events-curve-clients-file {path}: key {number} is {len(key)} characters; "
                             f"put one CURVE public key (Z85, {Z85_KEY_CHARS} characters) per line")
    if not keys:
        raise ValueError(f"--kv-events-curve-clients-file {path} holds no key; put one per line")
    return frozenset(k.encode() for k in keys)


class _Listed:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        if key not in self.keys:
            log.warning("refused a KV events subscriber whose CURVE key is not listed: %s...", key[:8].decode())
            return False
        return True


class ClientAllowlist:
    """A ZAP handler on `context` that admits the listed CURVE client keys only."""

    def __init__(self, context: zmq.Context, keys: frozenset[bytes]) -> None:
        self.auth = ThreadAuthenticator(context)
        self.auth.start()
        self.auth.configure_curve_callback("*", _Listed(keys))

    def stop(self) -> None:
        self.auth.stop()


def client_keys(secret: str | None) -> tuple[bytes, bytes] | None:
    """(public, secret) of a subscriber's own CURVE key, from its Z85 secret; None without one."""
    if not secret:
        return None
    secret_bytes = secret.strip().encode()
    try:
        return zmq.curve_public(secret_bytes), secret_bytes
    except (zmq.ZMQError, ValueError) as err:
        raise ValueError(f"not a CURVE secret key (40 Z85 characters): {err}") from None
