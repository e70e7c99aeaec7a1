"""KV kept while a tool runs, through the engine: agents whose answers end in a (grammar-forced)
call, other traffic that fills the pool while their tools run, then the follow-ups with the tool
results. With the holds the follow-ups find their whole conversation cached; without, only the
shared tool definitions survive. Same answers either way; no page is left in use."""

from __future__ import annotations

import random

import pytest

from kvserve.config import EngineConfig
from kvserve.engine import LLMEngine
from kvserve.request import ToolCallKV
from kvserve.sampling_params import SamplingParams
from kvserve.structured import StructuredOutputsParams

AGENTS = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tests.model.tiny_models import make_hf_model, write_gguf
    from tests.server.tool_templates import QWEN25_TEMPLATE

    return str(write_gguf(make_hf_model("qwen2", max_position_embeddings=4096), "qwen2",
                          tmp_path_factory.mktemp("agent") / "q.gguf", chat_template=QWEN25_TEMPLATE))


def agent_loops(model_path: str, hold: bool) -> tuple[list[float], list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(model=model_path, kv_cache_memory="3MiB", swap_space=0, max_model_len=4096,
                                    dtype="float32", max_leased_fraction=0.6, tool_call_kv_ttl=30.0))
    rng = random.Random(0)
    tools = [rng.randrange(3, 2000) for _ in range(1500)]  # the tool definitions every agent sends
    call = SamplingParams(max_tokens=8, temperature=0.0,
                          structured_outputs=StructuredOutputsParams(regex=r"call\(\d\)"))
    convs = [tools + [rng.randrange(3, 2000) for _ in range(200)] for _ in range(AGENTS)]
    held: list[tuple[str, ...]] = [()] * AGENTS
    hit_rates, answers = [], []

    def run(prompt, params, rid, tool_call=None):
        engine.add_request(prompt, params, rid, tool_call=tool_call)
        while True:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    return out

    for turn in range(3):
        for a in range(AGENTS):
            out = run(convs[a], call, f"a{a}t{turn}", ToolCallKV(hold=hold, answers=held[a]))
            assert out.outputs[0].finish_reason == "stop"
            if turn:
                hit_rates.append(out.num_cached_tokens / len(convs[a]))
            answers.append(out.outputs[0].token_ids)
            held[a] = (out.held_lease_id,) if out.held_lease_id else ()
            convs[a] = convs[a] + out.outputs[0].token_ids + [rng.randrange(3, 2000) for _ in range(60)]
        for k in range(6):  # other traffic while the tools run: more than the pool holds
            run([rng.randrange(3, 2000) for _ in range(1200)], SamplingParams(max_tokens=2, temperature=0.0),
                f"o{turn}{k}")
    engine.manager.check_invariants()
    return hit_rates, answers, engine


@pytest.mark.slow
def test_holds_keep_the_agents_conversations_through_pool_pressure(model_path):
    off, answers_off, engine_off = agent_loops(model_path, hold=False)
    on, answers_on, engine = agent_loops(model_path, hold=True)
    assert answers_on == answers_off  # a cache feature never changes a greedy answer
    mean_on, mean_off = sum(on) / len(on), sum(off) / len(off)
    assert mean_on - mean_off >= 0.3, (mean_on, mean_off)
    leases = engine.stats().cache.leases
    assert leases.tool_call_lease_grants == 3 * AGENTS and leases.tool_call_lease_used == 2 * AGENTS
    assert engine.num_used_pages == 0 and engine_off.num_used_pages == 0 and not engine.has_unfinished()
    for lease_id in list(engine.manager.leases.leases):  # the last turn's holds: released, nothing left
        engine.manager.leases.release(lease_id)
    assert engine.manager.pool.num_used == 0
