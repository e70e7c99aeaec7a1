"""kvserve: an LLM inference server built around its KV cache. Public API: LLM, SamplingParams, RequestOutput."""

import os

# OpenMP threads that wait at a barrier sleep instead of spinning (read once, when torch loads its
# OpenMP runtime, so it is set before anything imports torch; $OMP_WAIT_POLICY overrides it). On a
# busy host a spinning thread holds the core its descheduled partner needs: at load 8 on 2 cores a
# native decode step took 1.8-3.1 s spinning against 49-52 ms passive (docs/performance.md, Round 3).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvserve.beam_search import BeamSearchParams  # noqa: E402
from kvserve.request import CompletionOutput, RequestOutput, SamplingParams  # noqa: E402
from kvserve.structured.params import StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "StructuredOutputsParams"]


def __getattr__(name: str):
    # The engine pulls in torch; import it only when asked so the cache layer and tools stay light.
    if name == "LLM":
        from kvserve.llm import LLM
        return LLM
    if name == "LLMEngine":
        from kvserve.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
