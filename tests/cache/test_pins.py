"""24h retention pins (cache/pins.py): a pinned page outlives the disk tier's LRU until its pin expires,
also across a restart (ledger and pages both reloaded); the caps per tenant and in all refuse a pin
whole and say which cap; an expired pin frees its room."""

from __future__ import annotations

from kvserve.cache.disk_tier import HEADER, DiskTier
from kvserve.cache.hashing import page_hash, tenant_of
from kvserve.cache.pins import PinLedger, ledger_for

PAGE = 32


def h(i: int) -> bytes:
    return page_hash(None, [i], "")


def payload(i: int) -> bytes:
    return bytes((i * 7 + k) % 256 for k in range(PAGE))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def disk(path, ledger: PinLedger, pages: int = 8) -> DiskTier:
    return DiskTier(path, pages * (HEADER.size + PAGE), PAGE, layout="m:fp32:16", pins=ledger)


def test_pinned_pages_survive_the_lru_and_a_restart(tmp_path):
    clock = Clock()
    ledger = PinLedger(4, 4, tmp_path, clock)
    t = disk(tmp_path, ledger)
    assert ledger.pin("", [h(0), h(1)], 3600).pinned
    for i in range(30):  # far past the 8-page budget
        assert t.put(h(i), payload(i))
    assert t.num_pages == 8 and t.contains(h(0)) and t.contains(h(1))
    assert not t.contains(h(2)) and t.stats.evictions == 22
    t.close()
    ledger = PinLedger(4, 4, tmp_path, clock)  # a restart: the ledger is read back
    t = disk(tmp_path, ledger)
    assert ledger.is_pinned(h(0)) and t.get(h(0)) == payload(0) and t.get(h(1)) == payload(1)
    clock.now += 3601  # expired: plain LRU pages again
    for i in range(100, 120):
        t.put(h(i), payload(i))
    assert not t.contains(h(0)) and not t.contains(h(1))
    t.close()


def test_an_unpinned_disk_tier_evicts_the_same_pages_first(tmp_path):
    t = DiskTier(tmp_path, 8 * (HEADER.size + PAGE), PAGE, layout="m:fp32:16")
    for i in range(30):
        t.put(h(i), payload(i))
    assert not t.contains(h(0))  # (what the pin above changes)
    t.close()


def test_caps_refuse_a_pin_whole_and_name_the_cap():
    clock = Clock()
    ledger = PinLedger(6, 4, None, clock)
    assert ledger.pin("a", [h(i) for i in range(4)], 60).pinned
    again = ledger.pin("a", [h(i) for i in range(4)], 120)  # renewing costs nothing
    assert again.pinned and ledger.remaining_s(h(0)) == 120
    over = ledger.pin("a", [h(9)], 60)
    assert not over.pinned and "tenant" in over.reason and "--kv-pin-tenant-bytes" in over.reason
    assert not ledger.is_pinned(h(9)) and ledger.tenant_pages("a") == 4
    assert ledger.pin("b", [h(10), h(11)], 60).pinned
    full = ledger.pin("c", [h(12)], 60)
    assert not full.pinned and "--kv-pin-bytes" in full.reason
    clock.now += 61  # a's first pins were renewed to 120 s, b's run out
    assert ledger.pin("c", [h(12)], 60).pinned and ledger.tenant_pages("b") == 0


def test_a_tenant_is_the_key_part_of_a_namespace():
    assert tenant_of("key:ab\x00salt") == "key:ab" and tenant_of("key:ab\x00") == "key:ab"
    assert tenant_of("salt-only") == "" and tenant_of("") == ""


def test_the_engine_ledger_never_pins_the_whole_disk_tier():
    assert ledger_for(100, 10, None, None, None).max_pages == 5  # half the tier by default
    assert ledger_for(100, 10, None, 10_000, None).max_pages == 9  # never all of it
    ledger = ledger_for(100, None, None, 4000, 1000)  # Redis only
    assert (ledger.max_pages, ledger.max_pages_per_tenant) == (40, 10)


def test_an_unreadable_ledger_is_ignored(tmp_path):
    (tmp_path / "pins.json").write_text("{not json")
    assert PinLedger(4, 4, tmp_path).num_pages == 0


def test_a_renewal_rewrites_the_ledger_only_when_it_moves_an_expiry_enough(tmp_path):
    clock = Clock()
    ledger = PinLedger(4, 4, tmp_path, clock)
    ledger.pin("", [h(0)], 3600)
    (tmp_path / "pins.json").write_text("{}")  # (so a rewrite would show)
    clock.now += 60
    ledger.pin("", [h(0)], 3600)  # renewed by a minute: in memory only
    assert (tmp_path / "pins.json").read_text() == "{}" and ledger.remaining_s(h(0)) == 3600
    clock.now += 3000
    ledger.pin("", [h(0)], 3600)  # renewed by 50 minutes: written
    assert h(0).hex() in (tmp_path / "pins.json").read_text()
