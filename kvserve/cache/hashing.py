"""Chained page hashes: a full page's identity is blake2b(parent page hash, its token ids), with the
namespace mixed into the first page only, so the chain carries it to every later page.

The bytes hashed are spelled out (little-endian int64 per token), never `hash()` or pickle, so a hash is
the same in every process and every run: the Redis tier and the simulator rely on it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_SIZE = 16
_PERSON = b"kvserve-page-v1"  # domain separation: these digests mean "KV page", nothing else


def page_hash(parent: bytes | None, token_ids: Sequence[int], namespace: str) -> bytes:
    """Hash of one page. `namespace` counts only where `parent` is None (the first page)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_PERSON)
    if parent is None:
        ns = namespace.encode("utf-8")
        h.update(b"\x00" + struct.pack("<I", len(ns)) + ns)
    else:
        h.update(b"\x01" + parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    return h.digest()


def page_hashes(token_ids: Sequence[int], page_size: int, namespace: str,
                parent: bytes | None = None, start_page: int = 0) -> list[bytes]:
    """Chained hashes of the full pages of `token_ids`, from page `start_page` on; `parent` is the
    hash of page `start_page - 1` (None when starting at page 0)."""
    hashes: list[bytes] = []
    for page in range(start_page, len(token_ids) // page_size):
        parent = page_hash(parent, token_ids[page * page_size:(page + 1) * page_size], namespace)
        hashes.append(parent)
    return hashes


def api_key_tenant(api_key: str) -> str:
    """The tenant an API key's requests belong to: derived from the key, never the key itself."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def namespace(tenant: str, salt: str | None) -> str:
    """A request's cache namespace from its tenant (e.g. an API key's namespace; "" for none) and its
    `cache_salt`. The tenant comes first, NUL-separated, so no salt can pose as another tenant."""
    salt = salt or ""
    return f"{tenant}\x00{salt}" if tenant else salt


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def split_namespace(namespace_: str) -> tuple[str, str]:
    """A (tenant, salt) whose namespace() is `namespace_` (the inverse, up to that round trip)."""
    tenant, _, salt = namespace_.partition("\x00")
    return (tenant, salt) if "\x00" in namespace_ else ("", namespace_)


def tenant_of(namespace_: str) -> str:
    """The tenant part of a namespace(tenant, salt) ("" when it holds only a salt)."""
    return namespace_.split("\x00", 1)[0] if "\x00" in namespace_ else ""
