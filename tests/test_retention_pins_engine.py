"""prompt_cache_retention 24h on the real model: a prefix pinned by `pin_prefix` stays in the disk tier
while other prefixes fill it far past its budget, so a restarted engine still hits it and answers with
the cold run's greedy tokens; the same traffic without the pin loses it (what the pin changes). In Redis
a pinned page carries a 24h TTL (written with it, or given it by EXPIRE), unpinned ones none; a pin over
a tenant's cap is refused whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import SamplingParams
from kvserve.cache.disk_tier import HEADER
from tests.conftest import IDENTITY_MODES, make_llm, pool_memory
from tests.redis_server import redis_server  # noqa: F401

PAGE = 16
PROMPT = [1 + (j * 7) % 4000 for j in range(200)]  # 12 full pages and 8 tokens
OTHERS = [[2 + (j * 13 + 97 * k) % 4000 for j in range(200)] for k in range(1, 5)]  # 48 pages more
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
DISK_PAGES = 30


def engine(disk: Path, dtype: str):
    page_bytes = pool_memory(1, dtype=dtype)
    return make_llm(dtype=dtype, kv_cache_memory=pool_memory(40, dtype=dtype), max_model_len=256,
                    swap_space=0, kv_disk_path=str(disk),
                    kv_disk_bytes=DISK_PAGES * (HEADER.size + page_bytes),
                    kv_pin_bytes=16 * page_bytes, kv_pin_tenant_bytes=16 * page_bytes)


def fill_then_restart(disk: Path, dtype: str, pin: bool):
    llm = engine(disk, dtype)
    if pin:
        result = llm.engine.pin_prefix(PROMPT, "", None)
        assert result.pinned and result.num_pages == 12
    cold = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    for other in OTHERS:  # 48 more pages through a 30-page disk tier (and a 40-page pool)
        llm.generate({"prompt_token_ids": other}, PARAMS)
    evictions = llm.stats()["disk_cache_evictions"]
    llm.engine.close()
    llm = engine(disk, dtype)  # a restart: empty pool, the disk tier and its pin ledger reloaded
    warm = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    llm.engine.close()
    return cold, warm, evictions


@pytest.mark.slow
@pytest.mark.parametrize("dtype", IDENTITY_MODES)
def test_a_pinned_prefix_outlives_a_full_disk_tier_and_a_restart(tmp_path, dtype):
    cold, warm, evictions = fill_then_restart(tmp_path, dtype, pin=True)
    assert evictions >= 60 - DISK_PAGES  # the tier really was filled past its budget
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 192
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.slow
def test_without_the_pin_the_same_traffic_evicts_the_prefix(tmp_path):
    cold, warm, _ = fill_then_restart(tmp_path, "float32", pin=False)
    assert warm.num_cached_tokens == 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.slow
def test_pinned_pages_carry_a_24h_ttl_in_redis_and_a_restart_hits_them(redis_server):  # noqa: F811
    from kvserve.cache.hashing import page_hashes

    def redis_engine():
        return make_llm(kv_cache_memory=pool_memory(40), max_model_len=256, swap_space=0,
                        redis_url=redis_server.url)

    llm = redis_engine()
    llm.generate({"prompt_token_ids": OTHERS[0]}, PARAMS)  # written before any pin: no TTL yet
    assert llm.engine.pin_prefix(PROMPT, "", None).pinned  # its pages are not in Redis yet
    cold = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    tier = llm.engine.redis_tier
    assert tier.flush()
    client = redis_server.client()
    ttls = [client.ttl(tier.key(h)) for h in page_hashes(PROMPT, PAGE, "")]
    assert len(ttls) == 12 and all(86_000 < t <= 86_400 for t in ttls)  # written with the pin's TTL
    others = page_hashes(OTHERS[0], PAGE, "")
    assert {client.ttl(tier.key(h)) for h in others} == {-1}  # unpinned pages: no expiry
    assert llm.engine.pin_prefix(OTHERS[0], "", None).pinned  # already there: EXPIRE gives the TTL
    assert all(86_000 < client.ttl(tier.key(h)) <= 86_400 for h in others)
    llm.engine.close()
    llm = redis_engine()  # a restart: empty pool, the pages only in Redis
    warm = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    assert warm.num_cached_tokens == 192 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    llm.engine.close()


def test_a_pin_over_the_tenant_cap_is_refused_whole(redis_server):  # noqa: F811
    llm = make_llm(kv_cache_memory=pool_memory(40), max_model_len=256, swap_space=0,
                   redis_url=redis_server.url, kv_pin_tenant_bytes=4 * pool_memory(1))
    refused = llm.engine.pin_prefix(PROMPT, "key:a", None)
    assert not refused.pinned and "--kv-pin-tenant-bytes" in refused.reason
    assert llm.engine.pins.num_pages == 0
    assert llm.engine.pin_prefix(PROMPT[:64], "key:a", None).pinned  # 4 pages fit
    assert llm.engine.pin_prefix(PROMPT[:64], "key:b", None).pinned  # another tenant's own share
    llm.engine.close()
