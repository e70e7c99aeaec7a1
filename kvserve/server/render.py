"""OpenAI response bodies as plain dicts: choices, chunks, usage, and logprobs in OpenAI's two shapes and
llama-server's (`completion_probabilities`)."""

from __future__ import annotations

import functools
import math
import secrets
from typing import Any, Literal

from kvserve.request import CompletionOutput, PromptLogprob, RequestOutput
from kvserve.server.reasoning import ReasoningSplit
from kvserve.server.tool_parser import CallDelta, ToolFormat, parse_output

MIN_LOGPROB = -9999.0  # JSON has no -Infinity; vLLM clamps the same way
# how a route spells logprobs: OpenAI's completions (parallel lists), its chat (one entry per token),
# llama-server's /completion (chat's entries plus the token id)
LogprobsShape = Literal["completion", "chat", "llamacpp"]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `reasoning_tokens` (a thinking model's answers: reasoning.py) in completion_tokens_details."""
    details = {} if reasoning_tokens is None else {"completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}, **details}


def completion_choice(index: int, out: CompletionOutput, tokenizer, num_logprobs: int | None,
                      shape: LogprobsShape = "completion") -> dict[str, Any]:
    return {"index": index, "text": out.text, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
            "logprobs": logprobs_for(shape, out, 0, tokenizer, num_logprobs)}


def with_prompt(choice: dict[str, Any], output: RequestOutput, tokenizer, echo: str | None, body: Any) -> None:
    """A completion choice with its prompt: `echo`'s text before the output, and with logprobs the prompt's
    tokens before the output's in them (the first one without a logprob, as vLLM gives them); vLLM's
    `prompt_logprobs` (each token's logprob, rank and decoded text, and its most likely alternatives)."""
    entries = output.prompt_logprobs
    if echo is not None:
        choice["text"] = echo + choice["text"]
        if choice["logprobs"] is not None and entries is not None and body.logprobs_shape == "completion":
            out = output.outputs[0]  # (the prompt's entries in the engine's form: the token first)
            prompt = [None if e is None else {e.token_id: e.logprob, **e.top} for e in entries]
            choice["logprobs"] = _completion_lists(tokenizer, output.prompt_token_ids + out.token_ids,
                                                   prompt + (out.logprobs or []), body.logprobs)
    scored = prompt_logprobs(entries, tokenizer, body.prompt_logprobs)
    if scored is not None:
        choice["prompt_logprobs"] = scored


def prompt_logprobs(entries: list[PromptLogprob | None] | None, tokenizer, num: int | None
                    ) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: null for the first token, then each token's logprob, rank and decoded text with
    its `num` most likely alternatives, keyed by token id (None where none were asked for or made)."""
    if entries is None or num is None:
        return None
    return [None if e is None else {
        str(t): {"logprob": _clamp(lp), "rank": e.rank if t == e.token_id else rank,
                 "decoded_token": token_text(tokenizer, t)}
        for rank, (t, lp) in enumerate([(e.token_id, e.logprob), *_top(e.top, num)])}
        for e in entries]


def chat_choice(index: int, out: CompletionOutput, tokenizer, num_logprobs: int | None,
                tools: ToolFormat | None = None, parallel: bool = True,
                reasoning: ReasoningSplit | None = None) -> dict[str, Any]:
    """`tools`: the format to read tool calls in (None: tools were not offered); `reasoning`: a thinking
    model's splitter, which takes its reasoning out of the content (reasoning.py)."""
    text, thought = out.text, None
    if reasoning is not None:
        thought, text = reasoning.whole(out.text)
        thought = thought or None
    message: dict[str, Any] = {"role": "assistant", "content": text}
    reason = out.finish_reason
    if tools is not None:
        found = parse_output(text, tools)
        calls = found.calls if parallel else found.calls[:1]
        if calls:
            message = {"role": "assistant", "content": found.content or None,
                       "tool_calls": [{"id": tool_call_id(), "type": "function",
                                       "function": {"name": c.name, "arguments": c.arguments}}
                                      for c in calls]}
            reason = "tool_calls" if reason == "stop" else reason
    if thought is not None:
        message["reasoning_content"] = thought
    return {"index": index, "message": message, "finish_reason": reason, "stop_reason": out.stop_reason,
            "logprobs": logprobs_for("chat", out, 0, tokenizer, num_logprobs)}


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_call_deltas(deltas: list[CallDelta], ids: dict[int, str]) -> list[dict[str, Any]]:
    """OpenAI's streamed `tool_calls`: the first piece of a call carries its id, type and name."""
    out = []
    for delta in deltas:
        item: dict[str, Any] = {"index": delta.index}
        if delta.name is not None:
            ids[delta.index] = tool_call_id()
            item.update(id=ids[delta.index], type="function",
                        function={"name": delta.name, "arguments": delta.arguments})
        else:
            item["function"] = {"arguments": delta.arguments}
        out.append(item)
    return out


def completion_response(request_id: str, created: int, model: str, choices: list, usage_: dict
                        ) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_response(request_id: str, created: int, model: str, choices: list, usage_: dict,
                  prompt_logprobs_: list | None = None) -> dict[str, Any]:
    """`prompt_logprobs_`: the rendered template's, at the top level as vLLM gives them on chat."""
    response = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage_}
    return response if prompt_logprobs_ is None else {**response, "prompt_logprobs": prompt_logprobs_}


def completion_chunk(gen, index: int, text: str, finish_reason: str | None = None,
                     logprobs: Any = None, usage_: dict | None = None, stop_reason: str | int | None = None
                     ) -> dict[str, Any]:
    chunk = {"id": gen.request_id, "object": "text_completion", "created": gen.created,
             "model": gen.model, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                              **_finish(finish_reason, stop_reason)}]}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_chunk(gen, index: int, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: Any = None, usage_: dict | None = None, stop_reason: str | int | None = None
               ) -> dict[str, Any]:
    chunk = {"id": gen.request_id, "object": "chat.completion.chunk", "created": gen.created,
             "model": gen.model, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                              **_finish(finish_reason, stop_reason)}]}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def _finish(finish_reason: str | None, stop_reason: str | int | None) -> dict[str, Any]:
    """A chunk's finish fields: stop_reason (vLLM's) on the chunk that finishes its choice only."""
    return {"finish_reason": finish_reason} if finish_reason is None else \
        {"finish_reason": finish_reason, "stop_reason": stop_reason}


def usage_chunk(gen, chat: bool) -> dict[str, Any]:
    """stream_options.include_usage: OpenAI's extra last chunk, no choices, only usage."""
    return {"id": gen.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": gen.created, "model": gen.model, "choices": [], "usage": gen.usage()}


# -- logprobs --------------------------------------------------------------------------------------
def logprobs_for(shape: LogprobsShape, out: CompletionOutput, start: int, tokenizer,
                 num_logprobs: int | None) -> dict[str, Any] | list[dict[str, Any]] | None:
    """Logprobs of tokens start.. of `out`. The engine gives, per token, a dict whose first key is
    the sampled token and whose other keys are the top alternatives."""
    if num_logprobs is None or out.logprobs is None:
        return None
    token_ids, entries = out.token_ids[start:], out.logprobs[start:]
    if shape != "completion":
        with_id = shape == "llamacpp"
        content = []
        for token_id, entry in zip(token_ids, entries):
            top = _top(entry, num_logprobs)
            content.append({**_token_info(tokenizer, token_id, entry.get(token_id), with_id),
                            "top_logprobs": [_token_info(tokenizer, t, lp, with_id) for t, lp in top]})
        return content if with_id else {"content": content}
    return _completion_lists(tokenizer, token_ids, entries, num_logprobs)


def _completion_lists(tokenizer, token_ids: list[int], entries: list[dict[int, float] | None], num: int
                      ) -> dict[str, Any]:
    """OpenAI's completion logprobs: parallel lists, a token's entry None where it has none (an echoed
    prompt's first token)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(None if entry is None else _clamp(entry.get(token_id)))
        top_logprobs.append(None if entry is None else
                            {token_text(tokenizer, t): _clamp(lp) for t, lp in _top(entry, num)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -_clamp(item[1]))[:k] if k else []


def _clamp(logprob: float | None) -> float:
    if logprob is None or math.isnan(logprob):
        return MIN_LOGPROB
    return max(float(logprob), MIN_LOGPROB)


def _token_info(tokenizer, token_id: int, logprob: float | None, with_id: bool = False) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    info = {"id": token_id} if with_id else {}
    return {**info, "token": raw.decode("utf-8", errors="replace"), "logprob": _clamp(logprob), "bytes": list(raw)}


def token_text(tokenizer, token_id: int) -> str:
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes of one token: byte-level BPE spells bytes as printable stand-ins."""
    piece = tokenizer.id_to_token(token_id)
    return b"" if piece is None else piece_bytes(piece)


def piece_bytes(piece: str) -> bytes:
    """The raw bytes a vocabulary piece stands for (token_bytes' rule)."""
    inverse = _byte_decoder()
    if inverse.keys() >= set(piece):
        return bytes(inverse[ch] for ch in piece)
    return piece.encode("utf-8")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    from kvserve.model.tokenizer import byte_alphabet

    return {ch: byte for byte, ch in byte_alphabet().items()}
