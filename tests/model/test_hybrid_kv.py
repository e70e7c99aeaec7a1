"""The hybrid KV allocator end to end on a tiny random-weight Gemma 3 (window 8, five sliding layers
and one global): float32 greedy tokens equal transformers' with the window pool on, off, and so small
that it evicts; sliding layers hold only their window's pages; prefix hits stay exact."""

from __future__ import annotations

import random

import pytest

from kvserve import SamplingParams
from kvserve.config import KV_DTYPES, kv_bytes_for_tokens
from kvserve.metrics import EngineMetrics
from tests.conftest import make_llm
from tests.model.test_architectures import reference
from tests.model.tiny_models import VOCAB, make_hf_model, write_gguf

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    model = make_hf_model("gemma3")
    return model, str(write_gguf(model, "gemma3", tmp_path_factory.mktemp("gemma3") / "gemma3.gguf"))


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(30)]
    return [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 40)] + [shared[:6]]


def tokens(llm, batch):
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, GREEDY)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_window_pool_keeps_greedy_equal_to_transformers(gemma, page_size):
    model, path = gemma
    batch = prompts(page_size)
    expected = [reference(model, p) for p in batch]
    hybrid = make_llm(model=path, page_size=page_size, kv_cache_memory="4MiB", max_num_batched_tokens=16,
                      max_num_seqs=4)
    stats = hybrid.stats()
    assert stats["window_pool"] is not None, "the hybrid allocator is on for a sliding-window model"
    for run in range(2):  # the second run reuses the first one's pages (shared prefix, same prompts)
        assert tokens(hybrid, batch) == expected, run
    assert hybrid.stats()["prefix_cache_hits"] > 0
    whole = make_llm(model=path, page_size=page_size, kv_cache_memory="4MiB", max_num_batched_tokens=16,
                     disable_hybrid_kv_cache_manager=True)
    assert whole.stats()["window_pool"] is None
    assert tokens(whole, batch) == expected


def test_evicted_window_pages_shorten_the_hit_and_outputs_stay_exact(gemma):
    """A window pool of one sequence: the first prompt's window pages are evicted by the second;
    its repeat then hits only as far as the window pages that survive, and is still exact."""
    model, path = gemma
    rng = random.Random(7)
    first, other = ([rng.randrange(3, VOCAB) for _ in range(48)] for _ in range(2))
    llm = make_llm(model=path, page_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=8,
                   max_num_seqs=1)
    window = llm.stats()["window_pool"]
    assert window["num_pages_total"] < llm.stats()["num_pages_total"]
    expected = reference(model, first)
    assert tokens(llm, [first]) == [expected]
    tokens(llm, [other])
    assert llm.stats()["window_pool"]["num_evictions"] > 0
    out = llm.generate([first], GREEDY)[0]
    assert list(out.outputs[0].token_ids) == expected
    assert out.num_cached_tokens < len(first) - 1  # the full-attention pages alone cannot serve it


def test_sliding_layers_hold_only_their_window(gemma):
    """Mid-decode, the request holds whole pages in the global layer and about window / page_size
    pages in the five sliding ones: the bytes kvserve plan's formula gives."""
    _, path = gemma
    llm = make_llm(model=path, page_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=128)
    engine = llm.engine
    prompt = prompts(3)[2]  # 70 tokens, window 8
    engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    engine.step()  # the whole prompt in one chunk, and the first token
    typed = engine.stats()
    stats = typed.as_dict()
    num_tokens = len(prompt)
    assert stats["num_pages_used"] == -(-num_tokens // 4)
    assert stats["window_pool"]["num_pages_used"] == 3  # positions 63..69 (window 8) on pages 15..17
    cfg = engine.loaded.config
    kv_dtype = KV_DTYPES[engine.cache_config.kv_dtype.name]
    assert stats["kv_bytes_used"] == kv_bytes_for_tokens(cfg, kv_dtype, num_tokens, 4)
    assert stats["kv_bytes_used"] < kv_bytes_for_tokens(cfg, kv_dtype, num_tokens, 4, hybrid=False) / 2
    metrics = EngineMetrics("tiny")
    metrics.observe(typed)
    text = metrics.render().decode()
    usage = stats["window_kv_cache_usage_perc"]
    assert usage == 3 / stats["window_num_pages_total"] > 0
    assert f'kvserve:window_kv_cache_usage_perc{{model_name="tiny"}} {usage}' in text
    assert f'kvserve:kv_cache_used_bytes{{model_name="tiny"}} {float(stats["kv_bytes_used"])}' in text
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().cache.window.num_pages_used == 0


def test_a_window_cut_hit_is_explained(gemma):
    """kv_explain names the window pool when it, not the main pool, cut the hit short."""
    _, path = gemma
    rng = random.Random(11)
    first, other = ([rng.randrange(3, VOCAB) for _ in range(48)] for _ in range(2))
    llm = make_llm(model=path, page_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=8,
                   max_num_seqs=1)
    llm.generate([first, other], GREEDY)
    engine = llm.engine
    engine.add_request(first, GREEDY, kv_explain=True)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    explanation = outputs[-1].kv_cache
    assert explanation["reason"] == "window_evicted", explanation
    assert explanation["cached_tokens"] < 44
