"""DiskTier: LRU within the byte budget (a hypothesis state machine against a model, restarts
included), pages that survive a restart, and corrupt, truncated, moved or forged files detected,
dropped and counted as misses."""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvserve.cache.disk_tier import HEADER, DiskTier, KeyedBlake2b
from kvserve.cache.hashing import page_hash

PAGE = 32


def h(i: int) -> bytes:
    return page_hash(None, [i], "")


def payload(i: int, version: int = 0) -> bytes:
    return bytes((i * 7 + version + k) % 256 for k in range(PAGE))


def tier(path, pages: int = 8, **kw) -> DiskTier:
    return DiskTier(path, pages * (HEADER.size + PAGE), PAGE, layout="m:fp32:16", **kw)


def test_pages_survive_a_restart(tmp_path):
    t = tier(tmp_path)
    for i in range(5):
        assert t.put(h(i), payload(i))
    t.close()
    t = tier(tmp_path)
    assert t.stats.loaded == 5 and t.num_pages == 5
    assert t.get_pages([h(i) for i in range(6)]) == [payload(i) for i in range(5)]
    assert t.stats.hits == 5 and t.stats.corrupt == 0
    t.close()


def test_a_corrupt_page_is_dropped_counted_and_a_miss(tmp_path):
    t = tier(tmp_path)
    t.put(h(1), payload(1))
    t.put(h(2), payload(2))
    t.flush()
    path = t.file_of(h(1))
    raw = bytearray(path.read_bytes())
    raw[HEADER.size + 3] ^= 0x40  # one bit of the payload
    path.write_bytes(bytes(raw))
    assert t.get(h(1)) is None
    assert t.stats.corrupt == 1 and not t.contains(h(1)) and not path.exists()
    assert t.get_pages([h(1), h(2)]) == []  # a leading run: the first page is gone
    assert t.get(h(2)) == payload(2)
    t.close()


def test_a_truncated_page_is_dropped_while_running_and_at_restart(tmp_path):
    t = tier(tmp_path)
    for i in range(3):
        t.put(h(i), payload(i))
    t.flush()
    with open(t.file_of(h(0)), "r+b") as f:
        f.truncate(HEADER.size + PAGE // 2)
    assert t.get(h(0)) is None and t.stats.corrupt == 1
    with open(t.file_of(h(1)), "r+b") as f:
        f.truncate(10)
    t.close()
    t = tier(tmp_path)
    assert t.stats.corrupt == 1 and t.stats.loaded == 1 and not t.file_of(h(1)).exists()
    assert t.get(h(2)) == payload(2)
    t.close()


def test_a_file_under_another_pages_name_is_rejected(tmp_path):
    t = tier(tmp_path)
    t.put(h(1), payload(1))
    t.put(h(2), payload(2))
    t.flush()
    shutil.copy(t.file_of(h(1)), t.file_of(h(2)))
    assert t.get(h(2)) is None and t.stats.corrupt == 1
    t.close()


def test_keyed_mac_rejects_pages_sealed_without_the_secret(tmp_path):
    t = tier(tmp_path)  # unkeyed checksum: anyone could have written these
    t.put(h(1), payload(1))
    t.close()
    keyed = tier(tmp_path, sealer=KeyedBlake2b(b"secret-1"))
    assert keyed.get(h(1)) is None and keyed.stats.corrupt == 1
    keyed.put(h(2), payload(2))
    keyed.close()
    other = tier(tmp_path, sealer=KeyedBlake2b(b"secret-2"))
    assert other.get(h(2)) is None and other.stats.corrupt == 1
    other.close()
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        KeyedBlake2b(b"")


def test_layouts_never_share_pages(tmp_path):
    a = tier(tmp_path)
    a.put(h(1), payload(1))
    a.close()
    b = DiskTier(tmp_path, 8 * (HEADER.size + PAGE), PAGE, layout="m:fp16:16")
    assert not b.contains(h(1)) and b.get(h(1)) is None
    b.close()


def test_a_smaller_budget_at_restart_keeps_the_most_recently_used(tmp_path):
    t = tier(tmp_path)
    for i in range(6):
        t.put(h(i), payload(i))
        t.flush()
        Path(t.file_of(h(i))).touch()  # mtimes in order even on a coarse clock
    t.close()
    t = tier(tmp_path, pages=2)
    assert t.num_pages == 2 and t.stats.evictions == 4
    assert t.used_bytes <= 2 * t.file_bytes
    t.close()


def test_leftover_temp_files_are_removed_and_bad_puts_refused(tmp_path):
    t = tier(tmp_path)
    t.put(h(1), payload(1))
    t.close()
    stray = t.file_of(h(1)).with_suffix(".123.tmp")
    stray.write_bytes(b"half a page")
    t = tier(tmp_path)
    assert not stray.exists() and t.num_pages == 1
    with pytest.raises(ValueError, match="32 bytes"):
        t.put(h(2), b"short")
    t.close()


def test_a_zero_budget_stores_nothing(tmp_path):
    t = DiskTier(tmp_path, 10, PAGE)
    assert not t.put(h(1), payload(1)) and not t.contains(h(1))
    t.close()


def test_an_unusable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot use"):
        DiskTier(blocker / "sub", 1 << 20, PAGE)


class DiskTierMachine(RuleBasedStateMachine):
    """The tier against an OrderedDict model of LRU within `capacity` pages. Restarts rebuild the
    index from files; their order comes from coarse mtimes, so the model takes the tier's order
    after a restart and must agree on the set."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvdisk-")
        self.capacity = 4
        self.tier = tier(self.dir, pages=self.capacity)
        self.model: OrderedDict[bytes, bytes] = OrderedDict()
        self.version = 0

    @rule(i=st.integers(0, 9))
    def put(self, i: int) -> None:
        self.version += 1
        data = payload(i, self.version)
        assert self.tier.put(h(i), data) == (self.capacity > 0)
        if self.capacity == 0:
            return
        if h(i) in self.model:  # already held: refreshed, payload unchanged
            self.model.move_to_end(h(i))
        else:
            self.model[h(i)] = data
            while len(self.model) > self.capacity:
                self.model.popitem(last=False)

    @rule(i=st.integers(0, 9))
    def get(self, i: int) -> None:
        expected = self.model.get(h(i))
        assert self.tier.get(h(i)) == expected
        if expected is not None:
            self.model.move_to_end(h(i))

    @rule()
    def flush(self) -> None:
        assert self.tier.flush()
        on_disk = {bytes.fromhex(p.stem) for p in Path(self.tier.root).glob("*/*.kvp")}
        assert on_disk == set(self.model)

    @rule(capacity=st.integers(0, 5))
    def restart(self, capacity: int) -> None:
        self.tier.close()
        self.capacity = capacity
        self.tier = tier(self.dir, pages=capacity)
        kept = list(self.tier._index)
        assert set(kept) <= set(self.model) and len(kept) == min(capacity, len(self.model))
        self.model = OrderedDict((k, self.model[k]) for k in kept)

    @invariant()
    def bookkeeping(self) -> None:
        assert self.tier.num_pages == len(self.model) <= self.capacity
        assert self.tier.used_bytes <= self.capacity * self.tier.file_bytes
        assert all(self.tier.contains(k) for k in self.model)
        assert self.tier.stats.corrupt == 0

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)


DiskTierMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25,
                                             deadline=None)
test_disk_tier_lru_within_the_budget = DiskTierMachine.TestCase


def test_pages_leaving_the_tier_are_reported_for_kv_events(tmp_path):
    gone: list[bytes] = []
    t = tier(tmp_path, pages=2, on_evict=gone.append)
    for i in range(3):
        t.put(h(i), payload(i))
    assert gone == [h(0)]  # the budget
    t.flush()
    t.file_of(h(1)).write_bytes(b"garbage")
    assert t.get(h(1)) is None
    assert gone == [h(0), h(1)]  # corruption
    assert t.page_hashes() == [h(2)]
    t.close()


def test_a_deleted_tier_directory_is_recreated_and_listeners_hear_of_every_page(tmp_path):
    stored, evicted = [], []
    t = tier(tmp_path, pages=2, on_store=stored.append, on_evict=evicted.append)
    assert t.put(h(0), payload(0))
    t.flush()
    shutil.rmtree(tmp_path)  # an operator cleaned up the directory under a running server
    assert t.get(h(0)) is None and t.stats.misses == 1  # its page is gone: a miss, not an error
    assert t.put(h(1), payload(1)) and t.put(h(2), payload(2))
    t.flush()
    assert t.file_of(h(2)).exists() and t.stats.errors == 0
    assert t.get(h(2)) == payload(2)
    assert stored == [h(0), h(1), h(2)] and h(0) in evicted
    t.close()
