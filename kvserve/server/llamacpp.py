"""llama-server's native `POST /completion`: its body (llama.cpp's defaults and field names, `n_predict`,
`grammar`, `json_schema`, `cache_prompt`, `logit_bias` as `[[token, bias | false], ...]`) served by the
/v1/completions machinery, answered in its shape (`content`, `stop`, `tokens_predicted`,
`tokens_evaluated`, `tokens_cached`, `stop_type`, `timings`, and with `n_probs` its
`completion_probabilities`), streamed as `data: {...}` lines. llama.cpp sampler fields kvserve does not
implement are a 400 unless sent at their neutral value. `POST /infill` (code completion: `input_prefix`,
`input_suffix`, `input_extra`) answers the same way on a prompt laid out as llama-server lays it out
(infill.py), the code's special-token spellings read as text. `GET /props` tells llama-server's clients the
context size, chat template and those defaults."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

from kvserve.server import sse
from kvserve.server.front import sse_response
from kvserve.server.infill import InfillParts, infill_ids
from kvserve.server.llamacpp_fields import (LLAMA_REPEAT_LAST_N, NOT_LLAMA_SERVERS, UNSUPPORTED_SAMPLERS, LastN, MinP,
                                             RepetitionPenalty)
from kvserve.server.protocol import MAX_LOGPROBS, CompletionRequest, Temperature, TopP
from kvserve.server.sampler_chain import LLAMA_SAMPLERS, SamplerChain
from kvserve.server.serving import OpenAIServing, SSEResult

# /completion's fields kvserve takes only at their neutral value
NEUTRAL_ONLY = {**UNSUPPORTED_SAMPLERS, "n_keep": 0, "post_sampling_probs": False}
MAX_EXTRA_CHUNKS = 1024  # /infill's input_extra items (llama.vim sends a ring of 16 by default)


class LlamaCppCompletion(CompletionRequest):
    """/completion's body: OpenAI's completion fields plus llama.cpp's, with llama.cpp's defaults.
    `n_probs` N > 0: each token's logprob and the N most likely ones (before sampling, as llama-server's
    default), N capped at the server's logprobs limit as llama-server caps it at the vocabulary."""

    logprobs_shape = "llamacpp"
    temperature: Temperature | None = 0.8
    top_p: TopP | None = 0.95
    top_k: Annotated[StrictInt, Field(ge=-1, le=2**31)] | None = 40
    n_predict: Annotated[StrictInt, Field(ge=-1, le=2**31)] | None = -1
    n_probs: Annotated[StrictInt, Field(ge=-(2**31), le=2**31)] | None = 0  # 0 or less: none
    min_p: MinP | None = 0.05
    repeat_penalty: RepetitionPenalty | None = 1.0
    repeat_last_n: LastN | None = LLAMA_REPEAT_LAST_N
    default_chain = SamplerChain(frozenset(LLAMA_SAMPLERS), temperature_last=True)  # llama.cpp's: the temperature last

    @model_validator(mode="before")
    @classmethod
    def _llamacpp_shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, neutral in NEUTRAL_ONLY.items():
            if name in data and data[name] != neutral:
                raise ValueError(f"{name} is not supported by kvserve; leave it out or send {json.dumps(neutral)}")
        n_probs = data.get("n_probs")
        if isinstance(n_probs, int) and not isinstance(n_probs, bool) and n_probs > 0:
            if data.get("logprobs") is not None:
                raise ValueError("send n_probs or logprobs, not both")
            data = {**data, "logprobs": min(n_probs, MAX_LOGPROBS)}
        return data

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        """llama.cpp's `[[token, bias], ...]`, where a bias of false bans the token."""
        if not isinstance(value, list):
            return value
        out = {}
        for i, pair in enumerate(value):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int)):
                raise ValueError(f"item {i} must be a [token_id, bias] pair")
            out[str(pair[0])] = -100.0 if pair[1] is False else pair[1]
        return out


class InfillChunk(BaseModel):
    """One of /infill's `input_extra` items: a chunk of another file."""

    model_config = ConfigDict(extra="ignore")
    filename: StrictStr = "tmp"
    text: StrictStr = ""


class LlamaCppInfill(LlamaCppCompletion):
    """/infill's body: /completion's plus the code around the gap (`prompt`: text typed at the gap)."""

    prompt: StrictStr = ""
    input_prefix: StrictStr = ""
    input_suffix: StrictStr = ""
    input_extra: Annotated[list[InfillChunk], Field(max_length=MAX_EXTRA_CHUNKS)] = []


def register(app: FastAPI, serving: OpenAIServing, namespace: Callable[..., Awaitable[str]]) -> None:
    @app.get("/props")
    async def props(ns: str = Depends(namespace)):
        """llama-server's /props, which its clients read for the context size, the chat template and the
        defaults /completion samples with (kvserve's own: those of LlamaCppCompletion)."""
        return server_props(serving)

    async def answer(body: LlamaCppCompletion, raw: Request, ns: str, start: float):
        result = await serving.completions(body, raw, ns)
        if isinstance(result, SSEResult):
            return sse_response(SSEResult(_stream(result.body, start), result.close))
        choice, usage = result["choices"][0], result["usage"]
        return JSONResponse(_final(choice["text"], choice, usage, result["model"], start) | _probabilities(choice))

    @app.post("/completion")
    async def completion(body: LlamaCppCompletion, raw: Request, ns: str = Depends(namespace)):
        return await answer(body, raw, ns, time.monotonic())

    @app.post("/infill")
    async def infill(body: LlamaCppInfill, raw: Request, ns: str = Depends(namespace)):
        """llama-server's code completion: the prompt laid out and trimmed as it does (infill.py), then
        answered as /completion answers."""
        start, door = time.monotonic(), serving.door
        parts = InfillParts(body.input_prefix, body.input_suffix, body.prompt,
                            [(c.filename, c.text) for c in body.input_extra])
        for name, text in (("input_prefix", parts.prefix), ("input_suffix", parts.suffix), ("prompt", parts.prompt),
                           *(("input_extra", c.text) for c in body.input_extra)):
            door.check_chars(len(text), name)
        loaded = door.loaded
        ids = await door.off_loop(lambda: infill_ids(
            loaded.tokenizer, door.fim, loaded.bos_token_id if loaded.add_bos_token else None, parts,
            door.max_model_len, -1 if body.n_predict is None else body.n_predict, code_tokenizer=door.text_tokenizer))
        return await answer(body.model_copy(update={"prompt": ids}), raw, ns, start)


def server_props(serving: OpenAIServing) -> dict[str, Any]:
    from kvserve import __version__

    engine = serving.engine.engine
    loaded, fields = engine.loaded, LlamaCppCompletion.model_fields
    params = {name: fields[name].default for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty",
                                                      "repeat_last_n", "n_predict", "n_probs")}
    params.update({name: neutral for name, neutral in NEUTRAL_ONLY.items() if name not in NOT_LLAMA_SERVERS})
    params["stream"], params["samplers"] = False, list(LLAMA_SAMPLERS)
    token = lambda i: loaded.tokenizer.id_to_token(i) if i is not None else None  # noqa: E731
    return {"default_generation_settings": {"n_ctx": serving.max_model_len, "params": params},
            "total_slots": engine.config.max_num_seqs, "model_alias": serving.model_names[0],
            "model_path": loaded.path, "modalities": {"vision": False, "audio": False},
            "chat_template": loaded.chat_template or "", "bos_token": token(loaded.bos_token_id),
            "eos_token": token(loaded.eos_token_id), "build_info": f"kvserve {__version__}"}


def _final(content: str, choice: dict[str, Any], usage: dict[str, Any], model: str, start: float) -> dict[str, Any]:
    """llama-server's last object; `choice`: the OpenAI choice that finished (its finish and stop reasons)."""
    reason = choice.get("stop_reason")
    word = reason if isinstance(reason, str) else ""
    stop_type = {"length": "limit", "stop": "word" if word else "eos"}.get(choice["finish_reason"] or "", "none")
    elapsed_ms = (time.monotonic() - start) * 1000
    return {"content": content, "stop": True, "model": model, "stop_type": stop_type, "stopping_word": word,
            "tokens_predicted": usage["completion_tokens"], "tokens_evaluated": usage["prompt_tokens"],
            "tokens_cached": usage["prompt_tokens_details"]["cached_tokens"], "truncated": False,
            "timings": {"prompt_n": usage["prompt_tokens"], "predicted_n": usage["completion_tokens"],
                        "total_ms": elapsed_ms}}


def _probabilities(choice: dict[str, Any]) -> dict[str, Any]:
    """n_probs' `completion_probabilities`: those of the choice's tokens (none asked: no field)."""
    return {} if choice.get("logprobs") is None else {"completion_probabilities": choice["logprobs"]}


async def _stream(chunks: AsyncIterator[str], start: float) -> AsyncIterator[str]:
    """OpenAI's completion chunks as llama.cpp's: `{"content", "stop": false}`, then the final one."""
    async for chunk in sse.payloads(chunks):  # ([DONE] left out: llama.cpp ends with its final object)
        if "error" in chunk:
            yield sse.event(chunk)
            continue
        choice = chunk["choices"][0]
        if choice["text"] or choice.get("logprobs"):
            yield sse.event({"content": choice["text"], "stop": False} | _probabilities(choice))
        if chunk.get("usage"):
            final = _final("", choice, chunk["usage"], chunk["model"], start)  # (its pieces carried the probabilities)
            yield sse.event(final)
