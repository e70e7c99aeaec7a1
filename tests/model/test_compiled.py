"""`--compile`: the torch.compile'd decode step gives transformers' greedy tokens (float32, a tiny
Gemma 3 with sliding-window layers, batched decode rows and a lone one), and without a C++ compiler
the engine runs the eager model."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.model.compiled import compiler_available
from tests.conftest import make_llm
from tests.model.test_architectures import NEW_TOKENS, prompts, reference, tiny  # noqa: F401 (fixture)


def generate(path: str, batch: list[list[int]], **engine_args) -> tuple[list[list[int]], object]:
    llm = make_llm(model=path, dtype="float32", page_size=4, kv_cache_memory="32MiB",
                   max_num_batched_tokens=32, **engine_args)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)], llm.engine.runner.compiled


@pytest.mark.skipif(not compiler_available(), reason="no C++ compiler for inductor")
def test_compiled_decode_equals_transformers(tiny):  # noqa: F811
    model, gguf_path, _ = tiny("gemma3")
    batch = prompts()
    tokens, compiled = generate(gguf_path, batch, compile=True)
    assert tokens == [reference(model, p) for p in batch]
    # decode steps of 3, 2 and 1 rows ran compiled (batch size 1 is its own graph)
    assert not compiled.failed and compiled.compile_s > 0
    assert compiled._shapes == {True, False}


def test_without_a_compiler_the_eager_model_runs(tiny, monkeypatch, tmp_path):  # noqa: F811
    model, gguf_path, _ = tiny("llama3")
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no g++, c++ or clang++
    batch = prompts()[:2]
    tokens, compiled = generate(gguf_path, batch, compile=True)
    assert compiled.failed and compiled.compile_s == 0
    assert tokens == [reference(model, p) for p in batch]
