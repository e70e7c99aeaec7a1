"""TierAuth: keyed page names that reveal nothing and MACs that bind a value to its key."""

from __future__ import annotations

import pytest

from kvserve.cache.tier_auth import TAG_BYTES, TierAuth, default_auth, read_secret_file

SECRET = b"0123456789abcdef-shared-secret"
PAGE_HASH = bytes(range(16))


def test_keyed_names_are_stable_unguessable_and_per_secret():
    auth = TierAuth(SECRET)
    name = auth.key_for(PAGE_HASH)
    assert name == TierAuth(SECRET).key_for(PAGE_HASH)  # every instance with the secret agrees
    assert PAGE_HASH.hex() not in name
    assert name != TierAuth(SECRET + b"x").key_for(PAGE_HASH)
    assert name != auth.key_for(PAGE_HASH[:-1] + b"\x00")
    assert TierAuth(None).key_for(PAGE_HASH) == PAGE_HASH.hex()  # no secret: the plain hash


def test_sealed_values_open_only_unchanged_and_under_their_own_key():
    auth = TierAuth(SECRET)
    sealed = auth.seal("k1", b"page bytes")
    assert len(sealed) == len(b"page bytes") + TAG_BYTES
    assert bytes(auth.open("k1", sealed)) == b"page bytes"
    assert auth.open("k2", sealed) is None  # moved onto another key
    flipped = bytearray(sealed)
    flipped[3] ^= 1
    assert auth.open("k1", bytes(flipped)) is None
    assert auth.open("k1", sealed[:-1]) is None
    assert auth.open("k1", b"short") is None
    assert TierAuth(SECRET + b"x").open("k1", sealed) is None  # another secret
    assert TierAuth(None).open("k1", b"raw") == b"raw"  # no secret: trusted as is


def test_secret_file_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert read_secret_file(path) == SECRET
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 16"):
        read_secret_file(path)
    with pytest.raises(ValueError, match="cannot read"):
        read_secret_file(tmp_path / "missing")
    with pytest.raises(ValueError, match="empty"):
        TierAuth(b"")
    monkeypatch.setenv("KVSERVE_KV_TIER_SECRET", SECRET.decode())
    assert default_auth().key_for(PAGE_HASH) == TierAuth(SECRET).key_for(PAGE_HASH)
    monkeypatch.delenv("KVSERVE_KV_TIER_SECRET")
    assert not default_auth().enabled
