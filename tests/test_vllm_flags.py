"""Every flag kvserve shares with `vllm serve` means what it means there: one row per shared flag,
the value a vLLM user writes and the setting vLLM gives it. A flag kvserve gains that vLLM also has
must get a row here (test_every_shared_flag_has_a_row)."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import build_parser
from kvserve.config import EngineConfig, parse_bytes, resolve_kv_dtype
from kvserve.engine_args import engine_kwargs

GIB = 2**30
# `vllm serve --help` (engine and front-end flags, V1 and the V0 ones still spelled alike)
VLLM_FLAGS = {
    "--model", "--host", "--port", "--api-key", "--served-model-name", "--tokenizer", "--revision", "--dtype",
    "--seed", "--max-model-len", "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--prefix-caching-hash-algo", "--swap-space", "--kv-cache-dtype", "--kv-cache-memory-bytes",
    "--gpu-memory-utilization", "--enforce-eager", "--max-num-seqs", "--max-num-batched-tokens",
    "--preemption-mode", "--device", "--calculate-kv-scales", "--speculative-config", "--kv-events-config",
    "--disable-hybrid-kv-cache-manager", "--tensor-parallel-size", "--pipeline-parallel-size",
    "--data-parallel-size", "--quantization", "--trust-remote-code", "--download-dir", "--load-format",
    "--max-logprobs", "--disable-log-stats", "--disable-log-requests", "--enable-chunked-prefill",
    "--chat-template", "--response-role", "--ssl-keyfile", "--ssl-certfile", "--root-path",
    "--uvicorn-log-level", "--allowed-origins", "--enable-auto-tool-choice", "--tool-call-parser",
    "--reasoning-parser", "--cpu-offload-gb", "--num-gpu-blocks-override", "--kv-transfer-config",
    "--otlp-traces-endpoint", "--enable-lora", "--lora-modules", "--max-loras", "--generation-config",
    "--hf-overrides", "--max-seq-len-to-capture", "--limit-mm-per-prompt", "--scheduling-policy",
    "--enable-prompt-tokens-details", "--return-tokens-as-token-ids", "--show-hidden-metrics-for-version",
    "--structured-outputs-config", "--async-scheduling", "--enable-sleep-mode", "--max-num-partial-prefills",
}

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
# flag -> (argv as a vLLM user writes it, what kvserve reads from it, the value vLLM means)
TABLE = {
    "--model": (["--model", "m.gguf"], lambda a, c: a.model, "m.gguf"),
    "--host": (["--host", "0.0.0.0"], lambda a, c: a.host, "0.0.0.0"),
    "--port": (["--port", "8001"], lambda a, c: a.port, 8001),
    "--api-key": (["--api-key", "sk-1"], lambda a, c: a.api_key, ["sk-1"]),
    "--served-model-name": (["--served-model-name", "a", "b"], lambda a, c: a.served_model_name, ["a", "b"]),
    "--dtype": (["--dtype", "half"], lambda a, c: c.dtype, "float16"),
    "--max-model-len": (["--max-model-len", "1024"], lambda a, c: c.max_model_len, 1024),
    "--block-size": (["--block-size", "32"], lambda a, c: c.page_size, 32),
    "--enable-prefix-caching": (["--enable-prefix-caching"], lambda a, c: c.prefix_cache, "radix"),
    "--no-enable-prefix-caching": (["--no-enable-prefix-caching"], lambda a, c: c.prefix_cache, "off"),
    "--swap-space": (["--swap-space", "4"], lambda a, c: parse_bytes(c.swap_space), 4 * GIB),
    "--kv-cache-dtype": (["--kv-cache-dtype", "fp8"], lambda a, c: resolve_kv_dtype(c.kv_cache_dtype, c.dtype).name,
                         "fp8_e4m3"),
    "--kv-cache-memory-bytes": (["--kv-cache-memory-bytes", "1073741824"],
                                lambda a, c: parse_bytes(c.kv_cache_memory), GIB),
    "--gpu-memory-utilization": (["--gpu-memory-utilization", "0.5"], lambda a, c: c.gpu_memory_utilization, 0.5),
    "--enforce-eager": (["--enforce-eager"], lambda a, c: c.enforce_eager, True),
    "--max-num-seqs": (["--max-num-seqs", "8"], lambda a, c: c.max_num_seqs, 8),
    "--max-num-batched-tokens": (["--max-num-batched-tokens", "512"], lambda a, c: c.max_num_batched_tokens, 512),
    "--preemption-mode": (["--preemption-mode", "swap"], lambda a, c: c.preemption_mode, "swap"),
    "--device": (["--device", "cpu"], lambda a, c: c.device, "cpu"),
    "--calculate-kv-scales": (["--calculate-kv-scales"], lambda a, c: c.calculate_kv_scales, True),
    "--speculative-config": (["--speculative-config", json.dumps(SPEC)],
                             lambda a, c: (c.speculative_config.method, c.speculative_config.num_speculative_tokens),
                             ("ngram", 3)),
    "--chat-template": (["--chat-template", "{{ messages[0]['content'] }}"], lambda a, c: c.chat_template,
                        "{{ messages[0]['content'] }}"),  # vLLM: a file path or the template itself
    "--disable-hybrid-kv-cache-manager": (["--disable-hybrid-kv-cache-manager"],
                                          lambda a, c: c.disable_hybrid_kv_cache_manager, True),
    # vLLM: the <think> block's text goes to reasoning_content (kvserve's --reasoning-format auto)
    "--reasoning-parser": (["--reasoning-parser", "qwen3"], lambda a, c: a.reasoning_format, "auto"),
}


def serve_flags() -> set[str]:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return {flag for action in serve._actions for flag in action.option_strings}


def test_serve_takes_the_model_as_vllm_serve_does(capsys):
    from kvserve.cli import main

    args = build_parser().parse_args(["serve", "m.gguf", "--port", "8001"])
    assert args.model_tag == "m.gguf" and args.model is None
    assert main(["serve", "a.gguf", "--model", "b.gguf"]) == 2
    assert "two models given" in capsys.readouterr().err


def test_every_shared_flag_has_a_row():
    shared = serve_flags() & VLLM_FLAGS
    assert shared - set(TABLE) == set(), "add these flags to TABLE with vLLM's meaning"


@pytest.mark.parametrize("flag", sorted(TABLE))
def test_shared_flag_means_what_it_means_in_vllm(flag):
    if flag not in serve_flags():
        pytest.skip(f"kvserve has no {flag} yet")
    argv, read, vllm_value = TABLE[flag]
    args = build_parser().parse_args(["serve", *argv])
    config = EngineConfig(**engine_kwargs(args))
    assert read(args, config) == vllm_value


@pytest.mark.parametrize("value, expected", [("4", 4 * GIB), ("0.5", GIB // 2), ("0", 0), ("4GiB", 4 * GIB),
                                             ("512MiB", 512 * 2**20), ("2e9B", 2 * 10**9)])
def test_swap_space_without_a_unit_is_gib(value, expected):
    args = build_parser().parse_args(["serve", "--swap-space", value])
    assert parse_bytes(EngineConfig(**engine_kwargs(args)).swap_space) == expected


def test_swap_space_4_gives_the_engine_a_4_gib_host_tier():
    from kvserve.engine import LLMEngine
    from kvserve.server.launch import engine_memory_promise

    args = build_parser().parse_args(["serve", "--swap-space", "4", "--kv-cache-memory", "64MiB",
                                      "--max-model-len", "1024"])
    engine = LLMEngine(EngineConfig(**engine_kwargs(args)))
    assert engine.host_tier.capacity_bytes == 4 * GIB
    assert "host tier (--swap-space) 4 GiB" in engine_memory_promise(engine, args).line()
