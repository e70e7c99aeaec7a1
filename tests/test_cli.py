"""`kvserve generate` prints a completion; user mistakes end as one line on stderr, exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve import kernels
from kvserve.cli import main


def test_generate_prints_the_completion(capsys):
    assert main(["generate", "The capital of France is", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("dtype, weights", [
    ("float32", "float32 on kvserve's native kernels ("),  # the exact path's matrices on the F32 rows
    ("int4", "int4 (torch)"),
])
def test_every_weight_mode_names_what_runs_it(capsys, dtype, weights):
    """The start-up line for modes other than the native formats (it raised AttributeError there)."""
    if dtype == "float32" and kernels.library() is None:
        weights = "float32 (torch)"
    assert main(["generate", "The capital of France is", "--max-tokens", "4", "--dtype", dtype]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert f"kvserve: weights: {weights}" in captured.err


def test_unknown_model_is_one_line_on_stderr(capsys):
    assert main(["generate", "hi", "--model", "/no/such/model.gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve: error: model not found") and "\n" not in err


def test_context_that_cannot_fit_is_one_line(capsys):
    assert main(["generate", "hi", "--kv-cache-memory", "4MiB", "--max-model-len", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--kv-cache-memory" in err and "4,096" in err and "\n" not in err


def test_bad_flag_values_are_one_line(capsys):
    assert main(["generate", "hi", "--page-size", "3"]) == 2
    assert "power of two" in capsys.readouterr().err
    assert main(["generate", "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "hi", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    assert main(["generate", "hi", "--repeat-penalty", "0"]) == 2
    assert "repetition_penalty" in capsys.readouterr().err
    assert main(["generate", "hi", "--min-p", "2"]) == 2
    assert "min_p" in capsys.readouterr().err


def test_repeat_penalty_flag_changes_the_greedy_text(capsys):
    prompt = "List the days of the week: Monday, Tuesday, Monday, Tuesday, Monday,"
    texts = []
    for flags in ([], ["--repeat-penalty", "1.5"]):
        assert main(["generate", prompt, "--max-tokens", "8", "--ignore-eos", *flags]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] != texts[1]


def test_threads_flag_sets_torchs_threads(capsys):
    import torch

    before = torch.get_num_threads()
    try:
        assert main(["generate", "hi", "--max-tokens", "2", "-t", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_console_script_runs_as_a_process():
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "--chat", "Say hi",
                             "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_engine_argv_is_engine_kwargs_inverse():
    """What the bench hands to a `kvserve serve` child parses back to the same EngineConfig fields,
    on|off flags, bare switches and JSON among them."""
    import argparse

    from kvserve.engine_args import add_engine_arguments, engine_argv, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-events-token-ids", "off", "--calculate-kv-scales", "--page-size", "32",
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    kwargs = engine_kwargs(args)
    assert engine_kwargs(parser.parse_args(engine_argv(kwargs))) == kwargs
    with pytest.raises(ValueError, match="no engine flag"):
        engine_argv({"not_a_field": 1})


