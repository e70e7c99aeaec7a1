"""Speculative decoding with a draft model (issue 27, must-show 4): a second GGUF sharing the target's
tokenizer proposes the drafts, with K/V in pages of its own counted in the same memory budget. Greedy
tokens are those without it, in float32 and the default mode, with prefix hits, preemption and n > 1 in
the batch; a model drafting for itself has every draft accepted (the kernels are batch-invariant), a
random draft has most rejected (the rollback path); both pools end full and consistent. The start-up
capacity check and `kvserve plan` count the draft's pages alike, and a bad draft is a one-line error."""

from __future__ import annotations

import argparse
import io
import json
import random

import pytest
from rich.console import Console

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.config import ConfigError, kv_bytes_per_page, resolve_kv_dtype, resolve_model_dtype
from kvserve.model.gguf_loader import bundled_model_path, load_gguf
from kvserve.tools.planner import add_plan_arguments, render_plan, run_plan
from tests.conftest import DEFAULT_MODE, IDENTITY_MODES, make_llm
from tests.model.tiny_models import VOCAB, make_hf_model, write_draft_for_bundled, write_gguf
from tests.test_spec_decode import batch, run

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def spec(draft: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k,
            "disable_by_batch_size": 8}  # (speculate with the whole test batch running)


def drafted_equals_off(kwargs: dict, prompts, params, draft: str, k: int = 4) -> LLM:
    """Asserts the outputs with the draft model equal those without it; returns the engine that drafted."""
    off = run(make_llm(**kwargs), prompts, params)
    llm = make_llm(**kwargs, speculative_config=spec(draft, k))
    assert run(llm, prompts, params) == off
    return llm


def assert_pools_full(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_pages_free"] == stats["num_pages_total"] and draft_pages_used(llm) == 0


def pages_memory(num_pages: int, page_size: int, target: str, draft: str | None, dtype: str) -> int:
    """The kv_cache_memory that gives exactly `num_pages` pages (page 0 included) to the target and
    as many to the draft."""
    kv_dtype = resolve_kv_dtype("auto", resolve_model_dtype(dtype, "cpu"))
    total = 0
    for path in (target, draft) if draft else (target,):
        cfg = load_gguf(path).config
        total += kv_bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, kv_dtype)
    return num_pages * total


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return str(write_gguf(make_hf_model("llama3"), "llama3", tmp_path_factory.mktemp("llama3") / "llama3.gguf"))


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """Another tiny llama (other weights, same tokenizer): its drafts are mostly rejected."""
    model = make_hf_model("llama3", seed=1)
    return str(write_gguf(model, "llama3", tmp_path_factory.mktemp("draft") / "draft.gguf"))


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return str(write_gguf(make_hf_model("gemma3"), "gemma3", tmp_path_factory.mktemp("gemma3") / "gemma3.gguf"))


@pytest.fixture(scope="module")
def bundled_draft(tmp_path_factory):
    return str(write_draft_for_bundled(tmp_path_factory.mktemp("smol-draft") / "smol-draft.gguf"))


def plan(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


def draft_pages_used(llm) -> int:
    return llm.engine.scheduler.spec.draft_kv.num_used


@pytest.mark.parametrize("mode", IDENTITY_MODES)
@pytest.mark.parametrize("draft", ["self", "random"])
def test_tiny_model_greedy_tokens_are_unchanged_by_a_draft_model(mode, draft, llama_path, random_draft):
    rng = random.Random(7)
    prompts, params = batch(rng, VOCAB)
    draft_path = llama_path if draft == "self" else random_draft
    # 26 pages of 4 tokens each for ~6 x 50 tokens: requests are preempted and recomputed
    kwargs = dict(model=llama_path, dtype=mode, page_size=4, max_num_seqs=8, max_model_len=96,
                  kv_cache_memory=pages_memory(26, 4, llama_path, draft_path, mode))
    llm = drafted_equals_off(kwargs, prompts, params, draft_path)
    assert llm.engine.cache_config.num_pages == 26
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    if draft == "self":
        assert drafted > 0 and accepted == drafted  # the same model, batch-invariant: every draft kept
    else:
        assert accepted < drafted / 2  # rejected drafts rolled back in both pools
    assert_pools_full(llm)


@pytest.mark.parametrize("draft", ["self", "random"])
def test_prefix_hit_rate_with_a_draft_model_equals_off(draft, llama_path, random_draft):
    """A multi-turn trace, one request at a time, each turn quoting earlier text: the draft's pages
    are not the prefix cache's, so what the target's prefix cache holds and hits is the same."""
    results = []
    for config in (None, spec(llama_path if draft == "self" else random_draft)):
        llm = make_llm(model=llama_path, page_size=4, kv_cache_memory="1MiB", speculative_config=config)
        rng = random.Random(3)
        history = [rng.randrange(3, VOCAB) for _ in range(20)]
        for _ in range(4):
            history += [rng.randrange(3, VOCAB) for _ in range(5)] + history[-12:]
            history += list(llm.generate([{"prompt_token_ids": history}], GREEDY)[0].outputs[0].token_ids)
        stats = llm.stats()
        results.append((stats["prefix_cache_queries"], stats["prefix_cache_hits"], history))
        assert config is None or stats["spec_decode_num_drafts"] > 0
    assert results[0] == results[1] and results[0][1] > 0


def test_gemma3_window_pool_with_a_draft_model(gemma_path, random_draft):
    rng = random.Random(4)
    prompts, params = batch(rng, VOCAB)
    kwargs = dict(model=gemma_path, page_size=4, kv_cache_memory="1MiB", max_num_seqs=8,
                  max_num_batched_tokens=64)
    llm = drafted_equals_off(kwargs, prompts, params, random_draft)
    assert llm.stats()["window_pool"] is not None
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]
    assert stats["prefix_cache_hits"] > 0
    assert stats["window_pool"]["num_pages_free"] == stats["window_pool"]["num_pages_total"]
    assert_pools_full(llm)


@pytest.mark.parametrize("mode", [pytest.param("float32", marks=pytest.mark.slow), DEFAULT_MODE])
def test_bundled_model_with_a_tiny_draft_sharing_its_tokenizer(mode, bundled_draft):
    prompts = [[1, 9690, 314, 1345, 28, 33, 34, 35] * 3, [1, 504, 3458, 282, 4649, 314]]
    params = [SamplingParams(max_tokens=10, ignore_eos=True)] * 2
    kwargs = dict(dtype=mode, max_model_len=256, kv_cache_memory="64MiB")
    llm = drafted_equals_off(kwargs, prompts, params, bundled_draft, k=3)
    stats = llm.stats()
    assert stats["spec_decode_num_drafts"] > 0
    assert_pools_full(llm)


@pytest.mark.slow
@pytest.mark.parametrize("mode", IDENTITY_MODES)
def test_bundled_model_drafting_for_itself_has_every_draft_accepted(mode):
    rng = random.Random(1)
    prompts, params = batch(rng, 49152)
    prompts.append([rng.randrange(3, 49152) for _ in range(8)] * 4)
    params.append(GREEDY)
    bundled = bundled_model_path()
    kwargs = dict(dtype=mode, page_size=8, max_num_seqs=8, max_model_len=96,
                  kv_cache_memory=pages_memory(13, 8, bundled, bundled, mode))  # preempted, recomputed
    llm = drafted_equals_off(kwargs, prompts, params, bundled)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert 0 < stats["spec_decode_num_draft_tokens"] == stats["spec_decode_num_accepted_tokens"]
    assert_pools_full(llm)


def test_swap_preemption_with_a_draft_model(llama_path, random_draft):
    rng = random.Random(9)
    prompts, params = batch(rng, VOCAB)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)  # (swap: no forks)
    kwargs = dict(model=llama_path, page_size=4, max_num_seqs=8, max_model_len=96, preemption_mode="swap",
                  kv_cache_memory=pages_memory(26, 4, llama_path, random_draft, "float32"))
    llm = drafted_equals_off(kwargs, prompts, params, random_draft)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_drafts"] > 0
    assert_pools_full(llm)


def test_the_start_up_check_and_kvserve_plan_count_the_draft_models_pages(llama_path, random_draft):
    memory = pages_memory(25, 4, llama_path, None, "float32")  # 96 tokens fit the target alone
    make_llm(model=llama_path, kv_cache_memory=memory, max_model_len=96, page_size=4)
    with pytest.raises(ConfigError, match="draft model") as err:
        LLM(model=llama_path, dtype="float32", kv_cache_memory=memory, max_model_len=96, page_size=4,
            speculative_config=spec(random_draft))
    argv = ("--model", llama_path, "--kv-cache-memory", str(memory), "--context", "96", "--page-size", "4",
            "--kv-cache-dtype", "fp32", "--speculative-config", json.dumps(spec(random_draft)))
    fp32 = plan(*argv)["dtypes"][0]
    assert fp32["startup_error"] == str(err.value)  # the planner's verdict is the engine's, word for word
    alone = plan(*argv[:-2])["dtypes"][0]
    assert fp32["draft_bytes_per_token"] > 0 and alone["draft_bytes_per_token"] == 0
    assert fp32["bytes_per_token"] == alone["bytes_per_token"] + fp32["draft_bytes_per_token"]
    fits = pages_memory(25, 4, llama_path, random_draft, "float32")
    llm = make_llm(model=llama_path, kv_cache_memory=fits, max_model_len=96, page_size=4,
                   speculative_config=spec(random_draft))
    planned = plan("--model", llama_path, "--kv-cache-memory", str(fits), "--context", "96", "--page-size", "4",
                   "--kv-cache-dtype", "fp32", "--speculative-config", json.dumps(spec(random_draft)))
    assert planned["dtypes"][0]["pool_tokens"] == (llm.engine.cache_config.num_pages - 1) * 4 == 96
    assert planned["draft"]["num_layers"] == 3
    out = io.StringIO()
    render_plan(planned, Console(file=out, width=200))
    assert "Draft model" in out.getvalue() and "1,536 bytes/token" in out.getvalue()


@pytest.mark.parametrize("draft, words", [
    ("/no/such/draft.gguf", "--speculative-config model: model not found"),
    ("smollm2", "another tokenizer (49,152 tokens) than the target (2,048)"),
])
def test_a_bad_draft_is_a_one_line_config_error(llama_path, draft, words, capsys):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        LLM(model=llama_path, speculative_config=spec(draft))
    argv = ["generate", "hi", "--model", llama_path, "--speculative-config", json.dumps(spec(draft))]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve: error: --speculative-config model") and "\n" not in err
    assert "Traceback" not in err


def test_a_draft_model_without_its_path_or_with_too_few_positions_is_refused(llama_path, tmp_path):
    with pytest.raises(ConfigError, match="needs \"model\""):
        LLM(model=llama_path, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    short = str(write_gguf(make_hf_model("llama3", seed=1, max_position_embeddings=64), "llama3",
                           tmp_path / "short.gguf"))
    with pytest.raises(ConfigError, match="has 64 positions, fewer than max_model_len 512"):
        LLM(model=llama_path, speculative_config=spec(short))
    make_llm(model=llama_path, max_model_len=64, speculative_config=spec(short))  # within its positions


def test_a_large_batch_turns_the_draft_model_down(llama_path, random_draft):
    """disable_by_batch_size holds for a draft model as for n-gram: no drafts (and no draft compute)
    in a step that begins with more decoding requests than it; once they finish, the last one drafts."""
    llm = make_llm(model=llama_path, page_size=4, speculative_config={**spec(llama_path), "disable_by_batch_size": 1})
    engine, rng = llm.engine, random.Random(5)
    for max_tokens in (6, 6, 30):
        engine.add_request({"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(10)]},
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    spec_stats, draft_kv = engine.scheduler.spec.stats, engine.scheduler.spec.draft_kv
    while engine.has_unfinished():
        batch_size, drafts_before = len(engine.scheduler.running), spec_stats.num_drafts
        engine.step()
        if batch_size > 1:
            assert spec_stats.num_drafts == drafts_before and draft_kv.num_used == 0
    assert spec_stats.num_drafts > 0 and spec_stats.num_accepted_tokens == spec_stats.num_draft_tokens
