"""RedisTier against a real redis-server: key format, value header and checksum, leading-run reads,
the bounded write queue, and faults (down, hung, full, damaged values) as counted misses."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvserve.cache.hashing import page_hashes
from kvserve.cache.redis_tier import HEADER, RedisTier, pack_page, unpack_page
from kvserve.cache.tier_auth import TierAuth
from tests.redis_server import RedisServer, free_port, redis_server  # noqa: F401

PAGE_BYTES = 64
PAGE_SIZE = 4
TOKENS = list(range(100, 140))  # 10 full pages
SECRET = b"a shared secret of the test tier"


def make_tier(url: str, **kwargs) -> RedisTier:
    kwargs = {"fingerprint": "fp", "kv_dtype": "fp32", "page_size": PAGE_SIZE,
              "page_bytes": PAGE_BYTES, **kwargs}
    return RedisTier(url, **kwargs)


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(PAGE_BYTES))


@pytest.fixture
def tier(redis_server):
    t = make_tier(redis_server.url)
    yield t
    t.close()


def chain(namespace: str = "") -> list[bytes]:
    return page_hashes(TOKENS, PAGE_SIZE, namespace)


# -- values ------------------------------------------------------------------------------------
def test_key_names_model_dtype_page_size_and_page_hash():
    h = chain()[0]
    t = make_tier("redis://127.0.0.1:1/0", fingerprint="89052c25253c6bc8", kv_dtype="fp16")
    try:
        assert t.key(h) == f"kvserve:89052c25253c6bc8:fp16:{PAGE_SIZE}:{h.hex()}"
    finally:
        t.close()


def test_value_round_trips_and_any_damage_is_rejected():
    value = pack_page(payload(1))
    assert len(value) == HEADER.size + PAGE_BYTES and value[:4] == b"KVSP"
    assert bytes(unpack_page(value, PAGE_BYTES)) == payload(1)
    flipped = bytearray(value)
    flipped[HEADER.size + 10] ^= 0x01
    assert unpack_page(bytes(flipped), PAGE_BYTES) is None
    assert unpack_page(value[:-1], PAGE_BYTES) is None  # truncated
    assert unpack_page(value + b"x", PAGE_BYTES) is None
    assert unpack_page(b"XXXX" + value[4:], PAGE_BYTES) is None  # wrong magic
    assert unpack_page(value, PAGE_BYTES * 2) is None  # another page size
    assert unpack_page(b"", PAGE_BYTES) is None


# -- reads ---------------------------------------------------------------------------------------
def test_fetch_returns_the_leading_run_and_stops_at_the_first_miss(tier):
    hashes = chain()
    assert tier.put_many([(hashes[i], payload(i)) for i in (2, 3, 5)]) == 3
    pages = tier.fetch(TOKENS, "", start_page=2, max_pages=6)
    assert [bytes(p) for p in pages] == [payload(2), payload(3)]  # page 4 is missing
    assert tier.stats.hits == 2 and tier.stats.queries == 1 and tier.stats.errors == 0
    assert tier.fetch(TOKENS, "", start_page=2, max_pages=1) == [payload(2)]
    assert tier.fetch(TOKENS, "other-tenant", start_page=2, max_pages=6) == []  # namespaced


def test_fetch_splits_long_runs_into_batches(redis_server):
    t = make_tier(redis_server.url, batch_pages=3)
    try:
        t.put_many([(h, payload(i)) for i, h in enumerate(chain())])
        assert len(t.fetch(TOKENS, "", 0, 10)) == 10
        assert t.stats.queries == 4
    finally:
        t.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "garbage"])
def test_a_damaged_value_is_a_counted_miss(tier, redis_server, damage):
    hashes = chain()
    tier.put_many([(h, payload(i)) for i, h in enumerate(hashes[:4])])
    client = redis_server.client()
    key = tier.key(hashes[2])
    value = bytearray(client.get(key))
    if damage == "flip":
        value[HEADER.size + 5] ^= 0x80
    elif damage == "truncate":
        value = value[:-7]
    elif damage == "magic":
        value[0:4] = b"NOPE"
    else:
        value = bytearray(b"not a page")
    client.set(key, bytes(value))
    pages = tier.fetch(TOKENS, "", 0, 4)
    assert [bytes(p) for p in pages] == [payload(0), payload(1)]
    assert tier.stats.errors == 1 and tier.stats.hits == 2


# -- writes --------------------------------------------------------------------------------------
def test_offer_writes_in_the_background_once(tier, redis_server):
    items = [(h, payload(i)) for i, h in enumerate(chain())]
    assert tier.offer(items) == 10
    assert tier.flush(10)
    assert tier.stats.writes == 10
    assert redis_server.client().get(tier.key(items[3][0])) == pack_page(payload(3))
    assert tier.offer(items) == 0  # known to be there: not queued again
    assert tier.stats.writes == 10


def test_a_full_queue_drops_pages_and_never_waits(redis_server):
    t = make_tier(redis_server.url, queue_bytes=2 * PAGE_BYTES, write_batch_pages=1)
    gate = threading.Event()
    write = t._write
    t._write = lambda items: gate.wait(10) and write(items)  # a writer stuck on a slow Redis
    try:
        items = [(h, payload(i)) for i, h in enumerate(chain())]
        started = time.monotonic()
        queued = t.offer(items)
        assert time.monotonic() - started < 0.5
        assert 2 <= queued <= 3  # the queue's 2 pages, and perhaps one the writer holds
        assert t.stats.drops == 10 - queued
        gate.set()
        assert t.flush(10)
        assert t.stats.writes == queued
        assert not any(t.is_known(h) for h, _ in items[queued:])  # dropped: offered again later
    finally:
        gate.set()
        t.close()


def test_a_full_redis_is_counted_and_never_raises(tmp_path):
    server = RedisServer(str(tmp_path), maxmemory="1mb", policy="noeviction").start()
    big = 256 << 10
    t = RedisTier(server.url, fingerprint="fp", kv_dtype="fp32", page_size=PAGE_SIZE,
                  page_bytes=big)
    try:
        stored = t.put_many([(h, bytes(big)) for h in chain()])
        assert stored < 10  # OOM once maxmemory is reached
        assert t.stats.errors >= 1 and t.stats.drops == 10 - stored
    finally:
        t.close()
        server.stop()


# -- faults --------------------------------------------------------------------------------------
@pytest.fixture
def hung_url():
    """A loopback server that accepts connections (backlog) but never answers: a hung Redis."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    listener.close()


def test_a_hung_redis_costs_one_timeout_then_the_tier_backs_off_longer_and_longer(hung_url):
    t = make_tier(hung_url, timeout_s=0.1, backoff_s=0.5)
    try:
        started = time.monotonic()
        assert t.fetch(TOKENS, "", 0, 4) == []
        assert 0.09 < time.monotonic() - started < 1.0
        assert t.stats.errors == 1
        started = time.monotonic()
        for _ in range(100):  # every engine step in the next half second: no network at all
            assert t.fetch(TOKENS, "", 0, 4) == []
        assert time.monotonic() - started < 0.05
        assert t.stats.errors == 1 and t.stats.skipped == 100
        assert t.offer([(chain()[0], payload(0))]) == 0 and t.stats.drops == 1
        time.sleep(0.55)
        assert t.fetch(TOKENS, "", 0, 4) == [] and t.stats.errors == 2  # tried again
        time.sleep(0.6)  # a second failure in a row: the backoff doubled to 1 s
        assert t.fetch(TOKENS, "", 0, 4) == [] and t.stats.errors == 2
        time.sleep(0.45)
        assert t.fetch(TOKENS, "", 0, 4) == [] and t.stats.errors == 3
    finally:
        t.close()


def test_url_query_sets_the_timeout(hung_url):
    t = make_tier(hung_url + "?socket_timeout=0.3")
    try:
        started = time.monotonic()
        assert t.get(chain()[0]) is None
        assert time.monotonic() - started >= 0.29
    finally:
        t.close()


def test_redis_down_is_a_miss_and_the_tier_reconnects_when_it_returns(tmp_path):
    server = RedisServer(str(tmp_path)).start()
    t = make_tier(server.url, backoff_s=0.2)
    h = chain()
    try:
        assert t.put(h[0], payload(0)) and t.contains(h[0])
        server.kill()
        assert t.get(h[0]) is None and t.stats.errors == 1
        assert not t.put(h[1], payload(1))  # backing off: dropped, not tried
        server.start()  # same port, empty
        time.sleep(0.25)
        assert t.get(h[0]) is None and t.stats.errors == 1  # a plain miss now
        assert t.offer([(h[0], payload(0))]) == 1  # forgotten on the error: offered again
        assert t.flush(10)
        assert bytes(t.get(h[0])) == payload(0)
    finally:
        t.close()
        server.stop()


def test_engine_stats_keys(tier):
    stats = tier.engine_stats()
    assert {"remote_cache_hits", "remote_cache_errors", "remote_cache_writes",
            "remote_cache_drops"} <= set(stats)


def test_unreachable_port_fails_fast():
    t = make_tier(f"redis://127.0.0.1:{free_port()}/0")
    try:
        started = time.monotonic()
        assert t.fetch(TOKENS, "", 0, 4) == []
        assert time.monotonic() - started < 0.5 and t.stats.errors == 1
    finally:
        t.close()


# -- authenticated tier (a shared secret) ------------------------------------------------------
def test_without_a_secret_start_up_warns_that_the_tier_trusts_every_writer(caplog):
    with caplog.at_level("WARNING", logger="kvserve.redis"):
        make_tier("redis://127.0.0.1:1/0").close()
    assert [r for r in caplog.records if "trusts every writer" in r.getMessage()]
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvserve.redis"):
        make_tier("redis://127.0.0.1:1/0", auth=TierAuth(SECRET)).close()
    assert not [r for r in caplog.records if "trusts every writer" in r.getMessage()]


def test_with_a_secret_keys_hide_the_page_hash_and_forged_values_are_counted_misses(redis_server):
    hashes = chain()
    tier = make_tier(redis_server.url, auth=TierAuth(SECRET))
    try:
        assert hashes[0].hex() not in tier.key(hashes[0])
        tier.put_many([(h, payload(i)) for i, h in enumerate(hashes[:4])])
        assert [bytes(p) for p in tier.fetch(TOKENS, "", 0, 4)] == [payload(i) for i in range(4)]
        client = redis_server.client()
        # a writer without the secret: a well-formed unsigned value, and a valid signed value
        # copied from another key
        client.set(tier.key(hashes[1]), pack_page(payload(99)) + bytes(32))
        client.set(tier.key(hashes[3]), client.get(tier.key(hashes[2])))
        pages = tier.fetch(TOKENS, "", 0, 4)
        assert [bytes(p) for p in pages] == [payload(0)]
        assert tier.stats.errors == 1
        pages = tier.fetch(TOKENS, "", 3, 1)
        assert pages == [] and tier.stats.errors == 2
        # the same pages, written by an instance without the secret, are not found
        plain = make_tier(redis_server.url)
        try:
            plain.put_many([(h, payload(50 + i)) for i, h in enumerate(hashes[4:8])])
            assert tier.fetch(TOKENS, "", 4, 4) == []
        finally:
            plain.close()
    finally:
        tier.close()
