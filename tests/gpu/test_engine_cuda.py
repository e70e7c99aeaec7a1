"""The engine on a CUDA device (skipped without one; tests/cuda/run.sh runs it on a GPU machine):
decode graphs captured and replayed, float32 greedy tokens equal the CPU's, the default mode's
tokens and logprob bits unchanged by batch neighbours and a prefix hit, and the pool sized by
--gpu-memory-utilization, with the start-up error when max_model_len cannot fit."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.config import ConfigError
from kvserve.engine import LLMEngine
from kvserve.config import EngineConfig
from tests.conftest import make_llm
from tests.model.tiny_models import VOCAB, make_hf_model, write_gguf

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_gguf(make_hf_model("llama3"), "llama3", tmp_path_factory.mktemp("cuda") / "llama3.gguf"))


PROMPTS = [[5, 9, 33, 100, 7], list(range(3, 40)), [200 + i for i in range(19)]]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def run(llm, prompts):
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)]


def test_float32_greedy_on_cuda_equals_the_cpu(tiny):
    cpu = run(make_llm(model=tiny, kv_cache_memory="64MiB"), PROMPTS)
    llm = make_llm(model=tiny, device="cuda", kv_cache_memory="64MiB", max_num_seqs=4)
    assert llm.engine.runner.decode_graphs is not None and llm.engine.runner.triton_attention
    assert [t for t, _ in run(llm, PROMPTS)] == [t for t, _ in cpu]


def test_default_mode_is_invariant_to_neighbours_and_prefix_hits(tiny):
    llm = make_llm(model=tiny, device="cuda", dtype="auto", kv_cache_memory="64MiB", max_num_seqs=8)
    assert llm.engine.config.dtype == "bfloat16"
    alone = []
    for p in PROMPTS:
        llm.engine.reset_prefix_cache()
        alone += run(llm, [p])
    assert run(llm, PROMPTS) == alone  # side by side, and now every prompt is a prefix hit
    assert run(llm, PROMPTS[::-1])[::-1] == alone


def test_gpu_memory_utilization_sizes_the_pool_and_refuses_a_context_that_cannot_fit(tiny):
    free, total = torch.cuda.mem_get_info()
    util = (total - free + 512 * 2**20) / total  # about 512 MiB for the weights, a step and the pool
    engine = LLMEngine(EngineConfig(model=tiny, device="cuda", gpu_memory_utilization=util, max_num_seqs=4))
    budget = engine.gpu_budget
    pool = engine.runner.kv_cache_bytes()
    assert abs(pool - budget.kv_cache_bytes) <= engine.runner.page_bytes * 2
    bytes_per_token = engine.runner.page_bytes / engine.cache_config.page_size
    max_len = engine.max_model_len
    del engine
    util = (budget.in_use_bytes + budget.activation_peak_bytes + 0.5 * max_len * bytes_per_token) / budget.total_bytes
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        LLMEngine(EngineConfig(model=tiny, device="cuda", gpu_memory_utilization=util, max_num_seqs=4))


def test_decode_graphs_give_the_eager_steps_bits(tiny):
    graphs = make_llm(model=tiny, device="cuda", dtype="auto", kv_cache_memory="64MiB", max_num_seqs=4)
    eager = make_llm(model=tiny, device="cuda", dtype="auto", kv_cache_memory="64MiB", max_num_seqs=4,
                     enforce_eager=True)
    assert graphs.engine.runner.decode_graphs is not None and eager.engine.runner.decode_graphs is None
    assert run(graphs, PROMPTS) == run(eager, PROMPTS)
