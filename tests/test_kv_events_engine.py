"""The engine's live KV events, decoded with vLLM's current msgspec structs (tests/vllm_kv_schema.py)
in both encodings: pool stores and removals ("GPU"), host tier stores and removals ("CPU"), disk
tier stores and removals ("STORAGE"), the salt in the first page's extra_keys, AllBlocksCleared
after a prefix-cache reset; replayed from a sequence number over a DEALER with the topic frame."""

from __future__ import annotations

import time

import pytest
import zmq

from kvserve import SamplingParams
from kvserve.cache.hashing import page_hashes
from kvserve.kv_events import external_hash
from tests.conftest import make_llm, pool_memory
from tests.vllm_kv_schema import SCHEMAS, decode, replay

PAGE = 16
A = [1 + (j * 7) % 4000 for j in range(5 * PAGE)]  # 5 full pages
B = [2 + (j * 11) % 4000 for j in range(9 * PAGE)]  # 9: pushes A out of the pool
TOPIC = "kv@127.0.0.1:8000@SmolLM2"
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def run_engine(tmp_path, encoding: str):
    llm = make_llm(kv_cache_memory=pool_memory(12), max_model_len=160, swap_space=pool_memory(2),
                   kv_disk_path=str(tmp_path / "disk"), kv_disk_bytes=pool_memory(6) + 6 * 512,
                   kv_events_endpoint="tcp://127.0.0.1:*", kv_events_topic=TOPIC,
                   kv_events_encoding=encoding)
    engine = llm.engine
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(engine.event_publisher.endpoint)
    time.sleep(0.3)  # (a fresh SUB misses what is sent before it joins; replay covers it anyway)
    llm.generate({"prompt_token_ids": A}, SamplingParams(max_tokens=2, ignore_eos=True, cache_salt="s1"))
    llm.generate({"prompt_token_ids": B}, PARAMS)
    engine.disk_tier.flush()
    assert engine.reset_prefix_cache()
    engine.event_publisher.flush()
    live = []
    while sub.poll(500):
        live.append(sub.recv_multipart())
    sub.close(linger=0)
    return llm, live


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["array", "map"])
def test_live_events_of_every_medium_decode_with_vllms_structs_and_replay(tmp_path, encoding):
    llm, live = run_engine(tmp_path, encoding)
    publisher = llm.engine.event_publisher
    replayed = replay(publisher.replay_endpoint, 0)
    assert [t for t, _, _ in replayed] == [TOPIC.encode()] * len(replayed)
    assert [s for _, s, _ in replayed] == list(range(len(replayed)))
    assert live and all(topic == TOPIC.encode() for topic, _, _ in live)
    assert {int.from_bytes(s, "big"): p for _, s, p in live}.items() <= {s: p for _, s, p in replayed}.items()

    Stored, Removed = SCHEMAS[encoding]["BlockStored"], SCHEMAS[encoding]["BlockRemoved"]
    events = [e for _, _, payload in replayed for e in decode(payload, encoding).events]
    stores = {}
    for e in events:
        if isinstance(e, Stored):
            assert e.block_size == PAGE and e.lora_name is None and e.lora_id is None
            for i, h in enumerate(e.block_hashes):
                stores.setdefault(e.medium, {})[h] = (e.token_ids[i * PAGE:(i + 1) * PAGE],
                                                       e.extra_keys[i] if e.extra_keys else None)
    removed = {}
    for e in events:
        if isinstance(e, Removed):
            removed.setdefault(e.medium, set()).update(e.block_hashes)
    a_hashes = [external_hash(h) for h in page_hashes(A, PAGE, "s1")]
    b_hashes = [external_hash(h) for h in page_hashes(B, PAGE, "")]
    for i, h in enumerate(a_hashes):  # the pool's stores carry the tokens, page 0 the salt
        assert stores["GPU"][h] == (A[i * PAGE:(i + 1) * PAGE], ("s1",) if i == 0 else None)
    assert set(b_hashes) <= set(stores["GPU"]) and set(a_hashes) & removed["GPU"]
    offloaded = set(stores["CPU"])  # A's evicted pages went to the host tier, tokens and all
    assert offloaded and offloaded <= set(a_hashes) | set(b_hashes)
    for h in offloaded:
        assert stores["CPU"][h][0] == stores["GPU"][h][0]
    assert removed["CPU"]  # 2 host pages for the 4 pages offloaded
    assert set(stores["STORAGE"]) <= set(a_hashes) | set(b_hashes) and len(stores["STORAGE"]) >= 6
    assert removed["STORAGE"]  # a budget of 6 pages for 14 written
    assert type(events[-1]).__name__ == "AllBlocksCleared"
    assert llm.stats()["disk_cache_evictions"] == len(removed["STORAGE"])

    start = len(replayed) - 2
    assert [s for _, s, _ in replay(publisher.replay_endpoint, start)] == [start, start + 1]


def test_the_memory_line_counts_a_disk_tier_only_when_there_is_one(tmp_path):
    from kvserve.server.launch import engine_memory_promise

    llm = make_llm(kv_cache_memory=pool_memory(12), max_model_len=160, swap_space=0)
    assert "disk tier" not in engine_memory_promise(llm.engine, None).line()
    llm = make_llm(kv_cache_memory=pool_memory(12), max_model_len=160, swap_space=0,
                   kv_disk_path=str(tmp_path), kv_disk_bytes="3GiB")
    assert engine_memory_promise(llm.engine, None).line().endswith("plus a disk tier of 3 GiB")
    llm.engine.close()
