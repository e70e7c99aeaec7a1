"""Prefix caching on the real model: radix and hash give the same greedy tokens as no cache, on the W1
workload and on a multi-turn conversation, at page sizes 1, 16 and 64 and with a pool small enough
to evict, in each weight mode of IDENTITY_MODES; W1's token hit rate; namespaces share nothing.

Every (policy, page size) pair runs in every mode once: W1 (radix, 16), (hash, 1), (radix, 64); the
conversation (hash, 16), (radix, 1), (hash, 64); eviction in a small pool runs on pages of 16, hash
in float32 and radix in the default mode."""

from __future__ import annotations

import json

import pytest

from kvserve import SamplingParams
from tests.conftest import IDENTITY_MODES, PROPERTY_MODE, WORKLOADS, make_llm, pool_memory

W1_SUBSET = 4
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def _w1_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
    with open(WORKLOADS / "w1.jsonl") as f:
        texts = [json.loads(line)["prompt"] for line in f]
    return [tokenizer.encode(t, add_special_tokens=False).ids for t in texts[:limit]]


def _generate(llm, prompts):
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


@pytest.fixture(scope="module", params=IDENTITY_MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def w1_reference(mode):
    llm = make_llm(prefix_cache="off", dtype=mode)
    prompts = _w1_prompts(llm.get_tokenizer(), W1_SUBSET)
    return prompts, _generate(llm, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("policy, page_size", [("radix", 16), ("hash", 1), ("radix", 64)])
def test_w1_outputs_with_prefix_cache_equal_no_cache(policy, page_size, w1_reference, mode):
    prompts, expected = w1_reference
    llm = make_llm(prefix_cache=policy, page_size=page_size, dtype=mode)
    assert _generate(llm, prompts) == expected
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= (len(prompts) - 1) * 1400


def test_small_pool_evicts_and_outputs_stay_equal(w1_reference, mode):
    prompts, expected = w1_reference
    policy = "hash" if mode == "float32" else "radix"  # each policy in one mode (module docstring)
    # room for one W1 request and a bit: the shared prefix is evicted and recomputed along the way
    llm = make_llm(prefix_cache=policy, page_size=16, kv_cache_memory=pool_memory(110, dtype=mode),
                   max_model_len=1600, max_num_seqs=2, dtype=mode)
    assert llm.stats()["pool_tokens"] == 109 * 16
    # interleave foreign prompts so that the shared prefix must be evicted in between
    tokenizer = llm.get_tokenizer()
    noise = [tokenizer.encode(f"Unrelated text number {i}. " * 120, add_special_tokens=False).ids
             for i in range(len(prompts))]
    mixed = [p for pair in zip(prompts, noise) for p in pair]
    got = _generate(llm, mixed)
    assert got[0::2] == expected
    assert llm.stats()["num_evictions"] > 0


@pytest.mark.slow
def test_w1_token_hit_rate_is_at_least_90_percent():
    llm = make_llm(prefix_cache="radix", dtype=PROPERTY_MODE)
    prompts = _w1_prompts(llm.get_tokenizer())
    assert len(prompts) == 32
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1))
    stats = llm.stats()
    rate = stats["prefix_cache_hits"] / stats["prefix_cache_queries"]
    assert rate >= 0.90, rate


@pytest.mark.parametrize("policy, page_size", [("hash", 16), ("radix", 1), ("hash", 64)])
def test_conversation_hits_previous_turns_and_matches_no_cache(policy, page_size, mode):
    questions = ["Hi! What is a cache?", "Why do CPUs have several levels of it?",
                 "What is a cache line?", "And false sharing?"]
    results = {}
    for name in ("off", policy):
        llm = make_llm(prefix_cache=name, page_size=page_size, dtype=mode)
        history: list[dict[str, str]] = []
        outputs, cached = [], []
        for question in questions:
            history.append({"role": "user", "content": question})
            out = llm.chat(history, SamplingParams(max_tokens=8, ignore_eos=True))[0]
            history.append({"role": "assistant", "content": out.outputs[0].text})
            outputs.append(out.outputs[0].token_ids)
            cached.append((out.num_cached_tokens, len(out.prompt_token_ids)))
        results[name] = outputs, cached
    assert results[policy][0] == results["off"][0]
    # each turn after the first hits all of the previous turn's prompt, page-aligned or better
    for (hit, _), (_, previous_len) in zip(results[policy][1][1:], results[policy][1][:-1]):
        assert hit >= previous_len - page_size


def test_namespaces_share_no_page_and_no_hit(mode):
    llm = make_llm(prefix_cache="radix", dtype=mode)
    prompt = {"prompt_token_ids": [1 + (j * 7) % 4000 for j in range(300)]}
    a = llm.generate(prompt, SamplingParams(max_tokens=4, cache_salt="tenant-a"))[0]
    b = llm.generate(prompt, SamplingParams(max_tokens=4, cache_salt="tenant-b"))[0]
    again = llm.generate(prompt, SamplingParams(max_tokens=4, cache_salt="tenant-a"))[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    assert again.num_cached_tokens >= 288
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == again.outputs[0].token_ids
