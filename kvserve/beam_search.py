"""Beam search over the engine, as vLLM V1 does it: every step, each live beam is a one-token request
asking for its top 2*width logprobs. The prefix cache shares the beams' pages (a beam's history is a
cached prefix of its extension), so a step computes about one token per beam; beams that are dropped
simply stop being asked for, and their pages age out of the cache. With structured outputs each beam
carries its grammar state: its step request is masked by a copy of it (so its top tokens are allowed
ones), and each candidate extends a copy by its token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.sampling_params import SamplingParams
from kvserve.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from kvserve.engine import LLMEngine, Prompt


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width must be between 1 and 10, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass(slots=True)
class Beam:
    token_ids: list[int]  # generated tokens only
    cum_logprob: float = 0.0
    finished: bool = False
    grammar: Any = None  # structured/state.GrammarState after token_ids (None: unconstrained)

    def score(self, length_penalty: float) -> float:
        """HF's length-normalized score: sum of logprobs / generated length ** length_penalty."""
        return self.cum_logprob / max(len(self.token_ids), 1) ** length_penalty


@dataclass(slots=True)
class BeamSearchOutput:
    prompt_token_ids: list[int]
    beams: list[Beam] = field(default_factory=list)  # best first
    texts: list[str] = field(default_factory=list)


def beam_search(engine: LLMEngine, prompt: Prompt, params: BeamSearchParams) -> BeamSearchOutput:
    _, prompt_ids = engine.tokenize(prompt)
    width = params.beam_width
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True)
    engine.check_prompt(prompt_ids, SamplingParams(max_tokens=params.max_tokens))
    grammar = None
    if params.structured_outputs is not None:
        grammar = engine.grammar_compiler().compile(params.structured_outputs).new_state()
    live = [Beam([], grammar=grammar)]
    done: list[Beam] = []
    eos = {engine.loaded.eos_token_id, *engine.loaded.eos_token_ids}
    for _ in range(params.max_tokens):
        outputs = _run(engine, [prompt_ids + b.token_ids for b in live], step_params,
                       [b.grammar.copy() if b.grammar is not None else None for b in live])
        candidates = sorted(
            ((beam.cum_logprob + logprob, i, token)
             for i, (beam, out) in enumerate(zip(live, outputs))
             for token, logprob in out.outputs[0].logprobs[0].items()),
            key=lambda c: -c[0])[:2 * width]
        next_live: list[Beam] = []
        for rank, (cum, i, token) in enumerate(candidates):
            beam = Beam(live[i].token_ids + [token], cum)
            if live[i].grammar is not None:
                beam.grammar = live[i].grammar.copy()
                beam.grammar.accept(token)
            complete = beam.grammar is not None and beam.grammar.is_finished
            if complete or (token in eos and not params.ignore_eos):
                if rank < width:  # as in HF: an EOS below the top `width` candidates is ignored
                    beam.finished = True
                    done.append(beam)
            else:
                next_live.append(beam)
            if len(next_live) == width:
                break
        live = next_live
        if _cannot_improve(done, live, width, params.length_penalty):
            break
    ranked = sorted(done + live, key=lambda b: -b.score(params.length_penalty))[:width]
    return BeamSearchOutput(prompt_ids, ranked, [engine.decode(b.token_ids) for b in ranked])


def _cannot_improve(done: list[Beam], live: list[Beam], width: int, length_penalty: float) -> bool:
    """Stop once `width` beams have finished and no live beam scores above the worst of them."""
    if not live:
        return True
    if len(done) < width:
        return False
    worst = sorted(b.score(length_penalty) for b in done)[-width]
    return max(b.score(length_penalty) for b in live) <= worst


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, grammars: list):
    ids = [engine.add_request({"prompt_token_ids": p}, params, grammar=g) for p, g in zip(prompts, grammars)]
    finished = {}
    while len(finished) < len(ids):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[i] for i in ids]
