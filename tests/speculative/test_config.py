"""--speculative-config as vLLM spells it: JSON or a dict, validated with messages that say what to change."""

from __future__ import annotations

import pytest

from kvserve.config import ConfigError, EngineConfig
from kvserve.speculative_config import SpeculativeConfig, parse_speculative_config


def test_vllm_json_is_read():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                   '"prompt_lookup_max": 3, "prompt_lookup_min": 2}')
    assert cfg == SpeculativeConfig("ngram", 4, 2, 3)
    assert EngineConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config.num_speculative_tokens == 2
    assert EngineConfig().speculative_config is None


def test_a_missing_lookup_bound_takes_the_other():
    assert parse_speculative_config({"num_speculative_tokens": 3, "prompt_lookup_max": 5}).prompt_lookup_min == 5
    assert parse_speculative_config({"num_speculative_tokens": 3, "prompt_lookup_min": 4}).prompt_lookup_max == 4


@pytest.mark.parametrize("value, words", [
    ("{not json", "must be JSON"),
    ("[1]", "JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
    ({"prompt_lookup_max": 3}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"num_speculative_tokens": 99}, "at most 16"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must be <="),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown key(s) draft_model"),
])
def test_bad_configs_name_what_to_change(value, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(speculative_config=value)


def test_the_cli_flag_reaches_the_engine_config():
    import argparse

    from kvserve.engine_args import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert EngineConfig(**engine_kwargs(args)).speculative_config.num_speculative_tokens == 3
