"""kvserve: an LLM inference server built around its KV cache. Public API: LLM, SamplingParams, RequestOutput."""

from kvserve.beam_search import BeamSearchParams
from kvserve.request import CompletionOutput, RequestOutput, SamplingParams
from kvserve.structured.params import StructuredOutputsParams

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
