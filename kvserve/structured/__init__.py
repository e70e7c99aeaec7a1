"""Structured outputs: a request's constraint (JSON schema, JSON object, regex, choice, Lark/GBNF grammar)
compiled by llguidance into one matcher per sequence, whose bitmask the sampler applies to the logits.

    params.py    StructuredOutputsParams (what a request asks for), GrammarError (-> HTTP 400)
    compiler.py  GrammarCompiler: tokenizer preprocessing once, grammars validated and cached
    state.py     GrammarState: one sequence's matcher (bitmask, accept, finished, copy)

Interface for other parts of kvserve (the server's tool calling builds its constraint here):

    from kvserve.structured import StructuredOutputsParams, GrammarError
    from kvserve.sampling_params import SamplingParams

    # a JSON schema (e.g. one function's `parameters`); strict=True refuses keywords that cannot be
    # enforced, otherwise they are ignored
    c = StructuredOutputsParams(json=schema, strict=True, field="tools[0].function.parameters")
    # a Lark grammar (llguidance's dialect), e.g. a forced tool call in a model's own format, with a
    # JSON schema embedded by lark_json (`%json{...}` with fixed separators and closed objects):
    c = StructuredOutputsParams(grammar='start: "<tool_call>\\n" ' + lark_json(call_schema)
                                        + ' "\\n</tool_call>"', field="tool_choice")
    check(c)                                     # optional early check: GrammarError naming c.field
    SamplingParams(..., structured_outputs=c)    # the engine compiles it; LLMEngine.add_request
                                                 # raises GrammarError (a ValueError) if it cannot

The sequence stops with finish_reason "stop" as soon as its grammar is complete and nothing can
follow; EOS is allowed wherever the grammar accepts.
"""

from __future__ import annotations

import threading

from kvserve.structured.params import GrammarError, StructuredOutputsParams

__all__ = ["GrammarError", "StructuredOutputsParams", "check", "compiler_for", "lark_json"]


def lark_json(schema: dict) -> str:
    """`%json{...}` for a Lark grammar (compiler.lark_json)."""
    from kvserve.structured.compiler import lark_json as build

    return build(schema)


def check(params: StructuredOutputsParams) -> None:
    """Raise GrammarError (naming params.field) if the constraint cannot compile, without a tokenizer.
    (Grammars that compile but can match no text of this tokenizer are found by the engine.)"""
    import llguidance

    from kvserve.structured.compiler import _one_line, to_grammar

    error = llguidance.LLMatcher.validate_grammar(to_grammar(params))
    if error:
        raise GrammarError(_one_line(error), params.field)


_by_tokenizer: dict[tuple[int, int, tuple[int, ...]], tuple[object, object]] = {}
_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """The GrammarCompiler of a `tokenizers.Tokenizer` (one per tokenizer object in a process: the
    loaded models are memoized, so engines over one model share it)."""
    from kvserve.structured.compiler import GrammarCompiler

    key = (id(tokenizer), vocab_size, tuple(eos_token_ids))
    with _lock:
        found = _by_tokenizer.get(key)
        if found is None or found[0] is not tokenizer:
            found = (tokenizer, GrammarCompiler(tokenizer.to_str(), vocab_size, tuple(eos_token_ids)))
            _by_tokenizer[key] = found  # holds the tokenizer, so its id is not reused
    return found[1]
