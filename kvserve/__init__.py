"""kvserve: an LLM inference server built around its KV cache. Public API: LLM, SamplingParams, RequestOutput."""

import os

# OpenMP threads that wait at a barrier sleep instead of spinning (read once, when torch loads its
# OpenMP runtime, so it is set before anything imports torch; $OMP_WAIT_POLICY overrides it). On a
# busy host a spinning thread holds the core its descheduled partner needs: at load 8 on 2 cores a
# native decode step took 1.8-3.1 s spinning against 49-52 ms passive (docs/performance.md, Round 3).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ... after a short spin (libgomp's pause loop, ~100 turns: microseconds), which catches a partner that
# is a moment behind: a step makes ~150 parallel regions, and a futex wake-up on a VM costs ~40 us
# each. W1 decode step at 1.5k context, 2 threads (Zen 5): quiet 14.1 -> 7.1 ms; two engines at
# once 10.2 -> 11.3 ms; beside two busy processes 14.7 -> 12.3 ms (docs/performance.md, Zen 5).
os.environ.setdefault("GOMP_SPINCOUNT", "100")

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
