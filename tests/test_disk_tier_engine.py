"""The disk tier on the real model: committed pages are written through to disk, a restarted engine
finds them (its first request with a known prefix is a hit), and a corrupted page file is detected,
dropped and recomputed, never served. Outputs equal the cold run's every time, in each
of IDENTITY_MODES."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvserve import SamplingParams
from kvserve.cache.hashing import page_hashes
from tests.conftest import IDENTITY_MODES, make_llm, pool_memory

PROMPT = [1 + (j * 7) % 4000 for j in range(200)]  # 12 full pages of 16 and 8 tokens
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def run_once(disk: Path, dtype: str):
    llm = make_llm(dtype=dtype, kv_cache_memory=pool_memory(40, dtype=dtype), max_model_len=256,
                   swap_space=0, kv_disk_path=str(disk), kv_disk_bytes="256MiB")
    out = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    stats = llm.stats()
    llm.engine.close()  # flushes the disk writer
    return out, stats, llm.engine.disk_tier


@pytest.mark.slow
@pytest.mark.parametrize("dtype", IDENTITY_MODES)
def test_a_restarted_engine_reads_its_pages_back_from_disk(tmp_path, dtype):
    cold, cold_stats, _ = run_once(tmp_path, dtype)
    assert cold.num_cached_tokens == 0 and cold_stats["disk_cache_pages"] >= 12
    warm, warm_stats, _ = run_once(tmp_path, dtype)  # a new engine: empty pool, pages only on disk
    assert warm.num_cached_tokens == 192 and warm_stats["disk_cache_hits"] == 12
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("dtype", IDENTITY_MODES)
def test_a_corrupted_page_on_disk_is_recomputed_not_served(tmp_path, dtype):
    cold, _, disk = run_once(tmp_path, dtype)
    victim = disk.file_of(page_hashes(PROMPT, 16, "")[5])  # the prompt's sixth page
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF  # one flipped byte in the K/V payload
    victim.write_bytes(bytes(raw))
    warm, stats, _ = run_once(tmp_path, dtype)
    assert stats["disk_cache_corrupt_pages"] == 1
    assert warm.num_cached_tokens == 5 * 16  # the pages before the bad one; the rest recomputed
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.fixture
def small_mount(tmp_path):
    """A 64 MiB tmpfs of its own, so that it can be remounted read-only (a disk gone read-only)."""
    mount = tmp_path / "tier"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.slow
def test_a_corrupt_page_on_a_read_only_disk_tier_is_a_counted_miss_never_a_failed_step(small_mount):
    """The disk turns read-only after a run: a corrupt page can no longer be deleted and the
    recomputed pages can no longer be written. Each is counted; the answer is the cold one."""
    cold, _, disk = run_once(small_mount, "float32")
    victim = disk.file_of(page_hashes(PROMPT, 16, "")[5])
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF
    victim.write_bytes(bytes(raw))
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    with pytest.raises(OSError):
        (small_mount / "probe").write_bytes(b"x")  # it really is read-only
    warm, stats, _ = run_once(small_mount, "float32")
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.num_cached_tokens == 5 * 16  # the pages before the bad one still serve
    assert stats["disk_cache_corrupt_pages"] == 1
    assert stats["disk_cache_errors"] >= 2  # the undeletable bad file and the refused rewrites
    assert victim.exists()  # left where it is, but out of the index
    again, stats, _ = run_once(small_mount, "float32")  # a third engine: same answer again
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    body = served_over_http(small_mount)  # and over HTTP: the tier's faults stay in the log
    assert body["choices"][0]["text"] and body["kv_cache"]["cached_tokens"] == 5 * 16
    assert str(small_mount) not in json.dumps(body)  # (the explanation names the tier, not its path)


def served_over_http(disk: Path) -> dict:
    """The prompt through /v1/completions (kv_explain on) of a server whose disk tier is `disk`."""
    import httpx

    from kvserve.config import EngineConfig
    from kvserve.engine import LLMEngine
    from kvserve.server.api import build_app
    from tests.server.conftest import ServerThread

    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory=pool_memory(40), max_model_len=256,
                                    swap_space=0, kv_disk_path=str(disk), kv_disk_bytes="256MiB"))
    with ServerThread(build_app(engine)) as running:
        response = httpx.post(running.url + "/v1/completions", timeout=300, json={
            "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "kv_explain": True})
    assert response.status_code == 200, response.text
    return response.json()
