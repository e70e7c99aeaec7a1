"""Chained page hashes: pinned bytes (stable across processes and runs), namespace on the first page only."""

from __future__ import annotations

import os
import subprocess
import sys

from kvserve.cache.hashing import DIGEST_SIZE, page_hash, page_hashes

# Pinned: if these change, every hash stored in a shared tier (Redis) silently stops matching.
FIRST = "9f8166e98eb283bcc10556ae19e2c0ef"  # page_hash(None, [1, 2, 3, 4], "")
SECOND = "1415c1867c45213576262d5a865eb9db"  # page_hash(FIRST, [5, 6, 7, 8], "")


def test_page_hash_is_pinned_to_known_bytes():
    first = page_hash(None, [1, 2, 3, 4], "")
    assert len(first) == DIGEST_SIZE
    assert first.hex() == FIRST
    assert page_hash(first, [5, 6, 7, 8], "").hex() == SECOND


def test_page_hash_is_the_same_in_another_process_with_another_hash_seed():
    code = ("from kvserve.cache.hashing import page_hash; "
            "print(page_hash(None, [1, 2, 3, 4], '').hex(), page_hash(None, [9], 'tenant').hex())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    assert out == [FIRST, page_hash(None, [9], "tenant").hex()]


def test_namespace_separates_first_pages():
    assert page_hash(None, [1, 2], "a") != page_hash(None, [1, 2], "b")
    assert page_hash(None, [1, 2], "") != page_hash(None, [1, 2], "a")


def test_namespace_is_carried_by_the_parent_chain_only():
    parent = page_hash(None, [1, 2], "a")
    assert page_hash(parent, [3, 4], "a") == page_hash(parent, [3, 4], "b")
    other_parent = page_hash(None, [1, 2], "b")
    assert page_hash(parent, [3, 4], "a") != page_hash(other_parent, [3, 4], "b")


def test_same_tokens_after_different_prefixes_hash_differently():
    a = page_hash(None, [1, 2], "")
    b = page_hash(None, [1, 3], "")
    assert page_hash(a, [7, 7], "") != page_hash(b, [7, 7], "")


def test_token_encoding_is_unambiguous():
    assert page_hash(None, [1, 2], "") != page_hash(None, [1, 2, 0], "")
    assert page_hash(None, [256], "") != page_hash(None, [1, 0], "")
    assert page_hash(None, [2**40], "") != page_hash(None, [0], "")


def test_page_hashes_covers_full_pages_only_and_chains():
    tokens = list(range(10))
    hashes = page_hashes(tokens, 4, "ns")
    assert len(hashes) == 2
    assert hashes[0] == page_hash(None, tokens[:4], "ns")
    assert hashes[1] == page_hash(hashes[0], tokens[4:8], "ns")


def test_page_hashes_can_continue_from_a_parent():
    tokens = list(range(12))
    full = page_hashes(tokens, 4, "")
    assert page_hashes(tokens, 4, "", parent=full[0], start_page=1) == full[1:]
