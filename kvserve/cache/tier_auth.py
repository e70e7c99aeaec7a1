"""Keyed names and MACs for shared KV tiers (Redis, disk): with a secret, a tier key reveals nothing
about the tokens behind it and a value only verifies under the key it was written for.

Two sub-keys are derived from the secret (HMAC-SHA256 with fixed labels): one names pages
(`key_for`: keyed blake2b of the page hash), one signs values (`tag`/`seal`: keyed blake2b over the
full key and the value, so a valid value moved onto another key fails). Without a secret, keys are
the page hash in hex and values are not signed: the tier trusts every writer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

SECRET_ENV = "KVSERVE_KV_TIER_SECRET"
TAG_BYTES = 32
_KEY_BYTES = 20  # 160-bit names: collisions are out of reach, keys stay short
_process_secret: bytes | None = None  # set by the CLI from --kv-tier-secret-file


class TierAuth:
    """Key derivation and value signing for one secret (or none)."""

    def __init__(self, secret: bytes | None) -> None:
        if secret is not None and not secret:
            raise ValueError("the KV tier secret is empty; put at least 16 random bytes in it")
        self.secret = secret
        self._name_key = _subkey(secret, b"kvserve tier key names v1") if secret else b""
        self._mac_key = _subkey(secret, b"kvserve tier value mac v1") if secret else b""

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    @property
    def tag_bytes(self) -> int:
        return TAG_BYTES if self.enabled else 0

    def key_for(self, page_hash: bytes) -> str:
        """The name of a page in a tier: keyed (unguessable without the secret) or the hash's hex."""
        if not self.enabled:
            return page_hash.hex()
        return hashlib.blake2b(page_hash, digest_size=_KEY_BYTES, key=self._name_key).hexdigest()

    def tag(self, key: str, *parts: bytes | bytearray | memoryview) -> bytes:
        """MAC of `key` and the concatenation of `parts` (b"" without a secret)."""
        if not self.enabled:
            return b""
        mac = hashlib.blake2b(digest_size=TAG_BYTES, key=self._mac_key)
        encoded = key.encode()
        mac.update(len(encoded).to_bytes(4, "little"))  # unambiguous split between key and value
        mac.update(encoded)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def seal(self, key: str, value: bytes | bytearray | memoryview) -> bytes:
        """`value` followed by its tag (the value itself without a secret)."""
        return b"".join((value, self.tag(key, value)))

    def open(self, key: str, sealed: bytes | bytearray | memoryview) -> memoryview | None:
        """The value inside `sealed`, or None if its tag does not verify for `key`."""
        view = memoryview(sealed).cast("B")
        if not self.enabled:
            return view
        if view.nbytes < TAG_BYTES:
            return None
        value, tag = view[:-TAG_BYTES], view[-TAG_BYTES:]
        return value if hmac.compare_digest(self.tag(key, value), bytes(tag)) else None


def _subkey(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, label, hashlib.sha256).digest()


def read_secret_file(path: str | Path) -> bytes:
    """The secret in a file (surrounding whitespace dropped); ValueError with what to change."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as err:
        raise ValueError(f"cannot read --kv-tier-secret-file {path}: {err.strerror}") from None
    if len(secret) < 16:
        raise ValueError(f"--kv-tier-secret-file {path} holds {len(secret)} bytes; put at least 16 "
                         f"random bytes in it (e.g. `head -c 32 /dev/urandom | base64 > {path}`)")
    return secret


def set_process_secret(secret: bytes | None) -> None:
    """The secret tiers of this process use when they are not given one (the CLI flag)."""
    global _process_secret
    _process_secret = secret


def default_auth() -> TierAuth:
    """From --kv-tier-secret-file (via `set_process_secret`), else $KVSERVE_KV_TIER_SECRET."""
    if _process_secret is not None:
        return TierAuth(_process_secret)
    env = os.environ.get(SECRET_ENV, "").strip()
    return TierAuth(env.encode() if env else None)
