"""The disk tier when its disk goes away under it (issue 44): a deleted tier directory takes its
pages with it (they leave the index and are announced removed, instead of staying counted against
the budget and claimed in KV events), and a disk that fails every write logs one line, not one per
page."""

from __future__ import annotations

import logging
import shutil

from kvserve.cache.disk_tier import DiskTier
from kvserve.cache.log_limit import LogLimit

PAGE = 64


def page_hash(i: int, prefix: bytes = b"") -> bytes:
    return prefix + i.to_bytes(16 - len(prefix), "big")


def test_a_deleted_directory_takes_its_pages_out_of_the_index(tmp_path):
    removed: list[bytes] = []
    tier = DiskTier(tmp_path / "disk", 100 * (PAGE + 128), PAGE, on_evict=removed.append)
    try:
        for i in range(10):
            assert tier.put(page_hash(i), bytes([i]) * PAGE)
        assert tier.flush()
        shutil.rmtree(tmp_path / "disk")
        assert tier.get(page_hash(3)) is None  # a read finds the directory gone: every page goes
        assert tier.num_pages == 0 and sorted(removed) == [page_hash(i) for i in range(10)]
        assert tier.put(page_hash(20), b"\x14" * PAGE) and tier.flush()
        assert tier.get(page_hash(20)) == b"\x14" * PAGE  # written there again
    finally:
        tier.close()


def test_the_writer_notices_a_deleted_directory_too(tmp_path):
    tier = DiskTier(tmp_path / "disk", 100 * (PAGE + 128), PAGE)
    try:
        for i in range(10):
            tier.put(page_hash(i), bytes([i]) * PAGE)
        assert tier.flush()
        shutil.rmtree(tmp_path / "disk")
        tier.put(page_hash(30), b"\x1e" * PAGE)
        assert tier.flush()
        assert tier.page_hashes() == [page_hash(30)]
    finally:
        tier.close()


def test_a_disk_failing_every_write_logs_one_line(tmp_path, caplog):
    tier = DiskTier(tmp_path / "disk", 1000 * (PAGE + 128), PAGE)
    try:
        (tier.root / "ff").write_bytes(b"")  # a file where the pages' directory would go: writes fail
        with caplog.at_level(logging.WARNING, logger="kvserve.disk"):
            for i in range(200):
                tier.put(page_hash(i, b"\xff"), bytes([i % 256]) * PAGE)
            assert tier.flush()
        assert tier.stats.errors == 200 and tier.num_pages == 0
        lines = [r for r in caplog.records if "cannot write disk page" in r.getMessage()]
        assert len(lines) == 1, len(lines)
    finally:
        tier.close()


def test_a_held_back_warning_is_counted_in_the_next_line(caplog):
    now = [0.0]
    limit = LogLimit(logging.getLogger("kvserve.test"), every_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvserve.test"):
        for _ in range(5):
            limit.warning("write", "cannot write %s", "x")
        limit.warning("read", "cannot read %s", "y")
        now[0] = 11.0
        limit.warning("write", "cannot write %s", "z")
    assert [r.getMessage() for r in caplog.records] == [
        "cannot write x", "cannot read y", "cannot write z (4 more like it held back in the last 10 s)"]
