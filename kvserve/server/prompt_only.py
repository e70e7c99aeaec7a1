"""A completion of the prompt alone: OpenAI's legacy `echo` with `max_tokens: 0` (the prompt's text and, with
`logprobs`, its tokens' scores; vLLM's "echo without generation") and llama.cpp's `n_predict: 0` (the prompt
evaluated into the cache, no token predicted). The engine runs the prompt and samples one token, as for
Anthropic's `max_tokens: 0`; the answer leaves that token out."""

from __future__ import annotations

from dataclasses import replace

from kvserve.request import RequestOutput

ENGINE_MAX_TOKENS = 1  # what the engine is asked for: the prompt's pass and one token, dropped
NEEDS_ECHO = ("max_tokens 0 answers the prompt alone: send echo: true with it (and logprobs for the prompt's "
              "scores), or a max_tokens of at least 1")


def without_generated(output: RequestOutput) -> RequestOutput:
    """`output` with no generated token: empty text and token ids; finished, it ends by "length" (the limit
    of 0 tokens) unless it was aborted or failed."""
    first = output.outputs[0]
    reason = first.finish_reason
    if output.finished and reason not in ("abort", "error"):
        reason = "length"
    empty = replace(first, token_ids=[], text="", finish_reason=reason, stop_reason=None,
                    logprobs=None if first.logprobs is None else [])
    return replace(output, outputs=[empty, *output.outputs[1:]])
