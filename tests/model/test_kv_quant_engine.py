"""Quantized KV caches inside the engine: the pool holds 2x (fp8, int8) and ~4x (int4) the tokens of
fp16 in the same memory; prefix-cache hits never change a dtype's greedy outputs (the run with hits
is compared with the same dtype without them); preemption and swap keep outputs on track and move
pages bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.config import KV_DTYPES, kv_bytes_per_page
from kvserve.config import CORPUS_PATH
from tests.conftest import PROPERTY_MODE, make_llm

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8", "int4"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SMALL = dict(kv_cache_memory="24MiB", max_model_len=1024, dtype=PROPERTY_MODE)


@pytest.fixture(scope="module")
def corpus_ids() -> list[int]:
    from kvserve.model.gguf_loader import bundled_model_path, load_gguf

    text = CORPUS_PATH.read_text()[:40_000]
    return load_gguf(bundled_model_path()).tokenizer.encode(text, add_special_tokens=False).ids


def shared_prefix_prompts(ids: list[int]) -> list[list[int]]:
    """A 300-token prefix (18 pages and 12 tokens: the match ends inside a page, so the radix hit
    copies that page) with two different endings, then the first prompt again."""
    prefix = ids[:300]
    first, second = prefix + ids[2000:2030], prefix + ids[3000:3030]
    return [first, second, first]


def _greedy(llm, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """One request at a time, so later prompts find the earlier ones' pages cached."""
    return [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_pool_holds_more_tokens_at_the_same_memory(kv_dtype):
    tokens = {d: make_llm(kv_cache_dtype=d, kv_cache_memory="256MiB", max_model_len=1024).stats()["pool_tokens"]
              for d in ("fp16", kv_dtype)}
    ratio = tokens[kv_dtype] / tokens["fp16"]
    if kv_dtype == "int4":
        assert ratio >= 3.5, tokens
    else:  # int8 pays 12 bytes of scales per 3,072 of codes, per page and layer
        assert 1.98 <= ratio <= 2.01, tokens


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_prefix_hits_do_not_change_greedy_outputs(kv_dtype, corpus_ids):
    prompts = shared_prefix_prompts(corpus_ids)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cached = make_llm(kv_cache_dtype=kv_dtype, prefix_cache="radix", **SMALL)
    with_hits = _greedy(cached, prompts, params)
    # without the cache the third prompt (the first again) is the first one's run once more
    without = _greedy(make_llm(kv_cache_dtype=kv_dtype, prefix_cache="off", **SMALL), prompts[:2], params)
    # both hits happened; int8/int4 hits stop at a page boundary (288 of 300, 320 of 329 tokens)
    assert cached.stats()["prefix_cache_hits"] >= 288 + 320
    assert with_hits == without + [without[0]]


def test_page_scaled_dtypes_hit_whole_pages_only():
    """A partial page holds another request's tokens, and with int8/int4 they set its scale: those
    hits end on a page boundary. fp8's per-tensor scale keeps token-granular hits."""
    from kvserve.cache.manager import KVCacheManager

    prompt, other = list(range(100, 140)), list(range(100, 130)) + [7] * 10
    for partial_page_hits, expected in ((True, 30), (False, 16)):
        manager = KVCacheManager(16, 16, "radix", partial_page_hits=partial_page_hits)
        manager.allocate("a", prompt, "", manager.lookup(prompt), len(prompt))
        manager.commit("a", prompt, len(prompt))
        manager.free("a")
        assert manager.lookup(other).num_tokens == expected
    for kv_dtype, partial in (("fp8_e4m3", True), ("int8", False), ("int4", False)):
        assert make_llm(kv_cache_dtype=kv_dtype, **SMALL).engine.manager.partial_page_hits is partial


def greedy_gaps(llm, prompt: list[int], tokens: list[int]) -> list[float]:
    """Teacher-forced: at every position, how many nats the token lies below the best next-token
    log-probability the engine computes for prompt + the tokens before it (0 for a greedy choice)."""
    gaps = []
    for i, token in enumerate(tokens):
        step = llm.generate({"prompt_token_ids": prompt + tokens[:i]},
                            SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
        logprobs = step[0].outputs[0].logprobs[0]
        gaps.append(max(logprobs.values()) - logprobs.get(token, float("-inf")))
    return gaps


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_preemption_keeps_greedy_outputs_on_track(kv_dtype, corpus_ids):
    """Three 90-token requests (6 pages each) in a pool of 13 pages: two are admitted, their decode
    runs out of pages and preempts one, by recompute or by swap to the host tier.

    Stored pages are a function of their tokens, attention outputs do not depend on chunking
    (test_attention.py), and swapped pages come back bit for bit (next test). Still not token-exact
    with quantized KV: a different schedule means different batch shapes, whose last-bit float
    differences in K/V (~1e-5) can cross a quantization boundary and move logits (by up to ~2
    nats with int4's 16 levels, measured) and a greedy token with them. So where a run leaves the
    unconstrained one, its tokens from there on must still be (near-)greedy for their own context,
    teacher-forced; a request resumed from wrong pages is not (mean gap of several nats)."""
    prompts = [corpus_ids[i * 400 + 37:i * 400 + 127] for i in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reference = make_llm(kv_cache_dtype=kv_dtype, prefix_cache="radix", **SMALL)
    alone = [o.outputs[0].token_ids for o in reference.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    page_bytes = kv_bytes_per_page(30, 3, 64, 16, KV_DTYPES[kv_dtype])  # SmolLM2's shape
    for mode in ("recompute", "swap"):
        tight = make_llm(kv_cache_dtype=kv_dtype, prefix_cache="off", preemption_mode=mode,
                         kv_cache_memory=page_bytes * 14, max_model_len=128, dtype=PROPERTY_MODE)
        under_pressure = [o.outputs[0].token_ids for o in tight.generate(
            [{"prompt_token_ids": p} for p in prompts], params)]
        assert tight.stats()["num_preemptions"] > 0, mode
        for prompt, got, want in zip(prompts, under_pressure, alone):
            same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
            if same < len(want):
                gaps = greedy_gaps(reference, prompt + got[:same], got[same:])
                assert max(gaps) < 4.0 and sum(gaps) / len(gaps) < 1.0, (mode, same, gaps)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_page_payloads_round_trip_through_a_host_tier(kv_dtype, corpus_ids):
    """Swap and tiers move pages as runner payloads: codes and scales come back bit for bit."""
    llm = make_llm(kv_cache_dtype=kv_dtype, prefix_cache="radix", **SMALL)
    llm.generate({"prompt_token_ids": corpus_ids[:64]}, SamplingParams(max_tokens=1))
    runner = llm.engine.runner
    payload = runner.read_pages([1, 2, 3])
    assert payload.shape[0] == 3 and payload[0].numel() * payload.element_size() == runner.page_bytes
    runner.write_pages([7, 8, 9], payload)
    assert torch.equal(runner.read_pages([7, 8, 9]), payload)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_calculate_kv_scales_sets_the_fp8_scale_from_a_calibration_pass(kv_dtype, corpus_ids):
    """--calculate-kv-scales: scale = the largest |K|/|V| of a 512-token corpus pass over the fp8
    maximum (so the calibrated values span the format, none saturates); the default stays 1.0."""
    from kvserve.model.runner import calibrate_fp8_scale

    calibrated = make_llm(kv_cache_dtype=kv_dtype, calculate_kv_scales=True, **SMALL)
    scale = calibrated.stats()["kv_fp8_scale"]
    fp8_max = torch.finfo(calibrated.engine.runner.codec.storage_dtype).max
    assert scale == calibrate_fp8_scale(calibrated.engine.loaded, kv_dtype) != 1.0
    assert 1.0 < scale * fp8_max < 1e4  # the amax of real K/V: a few to a few hundred
    assert make_llm(kv_cache_dtype=kv_dtype, **SMALL).stats()["kv_fp8_scale"] == 1.0
    out = calibrated.generate({"prompt_token_ids": corpus_ids[:200]}, GREEDY)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
