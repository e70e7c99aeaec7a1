"""Memory pressure and forks on the real model: preemption by recompute or swap leaves greedy outputs
unchanged; n > 1 shares the prompt's pages; beam search equals transformers'; aborts in every state
free every page and every host-tier page."""

from __future__ import annotations

import pytest

from kvserve import BeamSearchParams, SamplingParams
from tests.conftest import IDENTITY_MODES, PROPERTY_MODE, make_llm, pool_memory, pooled_llm

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    return [[1 + (i * 37 + j * 11) % 5000 for j in range(40 + i % 7)] for i in range(n)]


def _run(llm, prompts):
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


@pytest.fixture(scope="module", params=IDENTITY_MODES)
def unconstrained(request):
    prompts = _prompts(32)
    llm = make_llm(prefix_cache="off", dtype=request.param)
    return request.param, prompts, _run(llm, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_quarter_of_the_pool_still_gives_identical_outputs(mode, unconstrained):
    dtype, prompts, expected = unconstrained
    needed_pages = sum(-(-(len(p) + 32) // 16) for p in prompts)  # what all 32 need at once
    llm = make_llm(prefix_cache="off", kv_cache_memory=pool_memory(needed_pages // 4 + 1, dtype=dtype),
                   max_model_len=128, preemption_mode=mode, swap_space="1GiB", dtype=dtype)
    assert _run(llm, prompts) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_in_pages"] > 0
    assert stats["num_requests_swapped"] == 0 and llm.engine.host_tier.num_pages == 0


def test_n_samples_share_the_prompt_pages_and_equal_seeded_single_runs():
    llm = make_llm(prefix_cache="off", dtype=PROPERTY_MODE)
    # 24.5 pages: the samples share 24 and each copies the partial last one
    prompt = {"prompt_token_ids": [1 + (j * 13) % 3000 for j in range(392)]}
    peaks = {}
    for n in (1, 4):
        engine = llm.engine
        rid = engine.add_request(prompt, SamplingParams(n=n, max_tokens=8, temperature=0.9, seed=7))
        peak, final = 0, None
        while final is None:
            for output in engine.step():
                if output.request_id == rid and output.finished:
                    final = output
            peak = max(peak, engine.manager.num_used_pages)
        peaks[n] = peak
        assert len(final.outputs) == n
        samples = [c.token_ids for c in final.outputs]
    assert peaks[4] <= 1.3 * peaks[1], peaks
    for i, sample in enumerate(samples):
        single = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=7 + i))[0]
        assert single.outputs[0].token_ids == sample
    assert len({tuple(s) for s in samples}) > 1, "different seeds should give different samples"


@pytest.mark.slow
def test_beam_search_equals_transformers(hf_model):
    import torch

    llm = make_llm(prefix_cache="radix")
    tokenizer = llm.get_tokenizer()
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time",
             "The three primary colours are", "In 1969, astronauts"]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        ours = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(beam_width=4, max_tokens=12))[0]
        with torch.inference_mode():
            theirs = hf_model.generate(torch.tensor([ids]), num_beams=4, do_sample=False,
                                       max_new_tokens=12, length_penalty=1.0, early_stopping=False,
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        best = theirs[0, len(ids):].tolist()
        eos = llm.engine.loaded.eos_token_id
        assert ours.beams[0].token_ids == [t for t in best if t != eos] + (
            [eos] if eos in best else []), text


def test_aborts_in_every_state_leave_no_page_behind():
    llm = pooled_llm(12, prefix_cache="off", max_model_len=128, preemption_mode="swap", swap_space="1GiB",
                     max_num_batched_tokens=64)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=64, ignore_eos=True))
           for p in _prompts(8)]
    seen = set()
    for _ in range(200):
        engine.step()
        states = {r.status.value for r in engine.scheduler.requests.values()}
        seen |= states
        if {"running", "waiting", "swapped"} <= states:
            break
    assert {"running", "waiting", "swapped"} <= seen, seen
    for rid in ids:
        engine.abort(rid)
    assert engine.manager.num_used_pages == 0
    assert engine.host_tier.num_pages == 0
    assert not engine.has_unfinished()


@pytest.mark.parametrize("dtype", IDENTITY_MODES)
@pytest.mark.parametrize("policy", ["radix", "hash"])
def test_evicted_prefix_pages_load_back_from_the_host_tier(policy, dtype):
    """A 300-token prompt (18 full pages) is cached, then a foreign prompt in a 29-page pool evicts
    most of it. With a host tier the evicted pages were offloaded and the prompt's second run loads
    them back (cached tokens 288 of 300); without one (swap_space=0) only what stayed in the pool
    hits. Outputs equal the cold run's either way."""
    prompt = [1 + (j * 7) % 4000 for j in range(300)]
    foreign = [2 + (j * 13) % 4000 for j in range(300)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    results = {}
    for swap_space in ("0", "64MiB"):
        llm = make_llm(prefix_cache=policy, kv_cache_memory=pool_memory(30, dtype=dtype), max_model_len=320,
                       swap_space=swap_space, dtype=dtype)
        cold, _, warm = (llm.generate({"prompt_token_ids": p}, params)[0]
                         for p in (prompt, foreign, prompt))
        assert cold.num_cached_tokens == 0 and llm.stats()["num_evictions"] >= 9
        assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
        results[swap_space] = warm.num_cached_tokens, llm.stats()
    local_only, no_tier = results["0"]
    assert local_only < 200 and no_tier["cpu_prefix_cache_hits"] == 0
    with_tier, stats = results["64MiB"]
    assert with_tier == 288 and stats["cpu_prefix_cache_hits"] == 288 - local_only
    assert stats["num_offloaded_pages"] >= 9 and stats["cpu_cache_usage_perc"] > 0
