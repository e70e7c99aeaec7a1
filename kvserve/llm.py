"""LLM: the synchronous batch API of DESIGN.md §4 (`LLM().generate(prompts, SamplingParams(...))`),
with beam search."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

from kvserve.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from kvserve.config import EngineConfig
from kvserve.engine import LLMEngine, Prompt
from kvserve.model.tokenizer import ChatTemplateOptions
from kvserve.request import RequestOutput
from kvserve.sampling_params import SamplingParams


class LLM:
    """Synchronous batch API: `LLM().generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = (sampling_params if isinstance(sampling_params, list)
                       else [sampling_params or SamplingParams()] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, replace(params)))
        except ValueError:
            for rid in ids:  # all or nothing: a bad prompt queues none of this batch
                self.engine.abort(rid)
            raise
        return self._run(ids)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation rendered by the model's template (tools where it puts them; a
        generation prompt, or the last message continued; chat_template_kwargs as template variables)."""
        options = ChatTemplateOptions(add_generation_prompt, continue_final_message, dict(chat_template_kwargs or {}))
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        return self.generate([self.engine.chat_prompt(c, tools, options) for c in conversations], sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(wanted):
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
        return [finished[rid] for rid in ids]

    def stats(self) -> dict[str, Any]:
        """The engine's statistics by name (the flat view of engine_stats.EngineStats)."""
        return self.engine.stats().as_dict()

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams
                    ) -> list[BeamSearchOutput]:
        """vLLM V1's beam search: beams share pages through the prefix cache (keep it on)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return [beam_search(self.engine, p, params) for p in prompts]
