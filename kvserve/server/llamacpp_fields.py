"""llama.cpp's own request fields, as llama-server reads them on its OpenAI routes and on `/completion`:
`n_predict` (max tokens), `grammar` (GBNF), `json_schema` (a schema the output follows), `cache_prompt`
(false: compute the whole prompt, reusing no cached prefix), `repeat_penalty` / `repeat_last_n` and `samplers`
(which samplers run, in which order: sampler_chain.py). Each is honoured; none is ignored. Mixed into the
OpenAI request models (protocol.py) and llama.cpp's /completion (llamacpp.py).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, field_validator

from kvserve.sampling_params import MAX_REPETITION_PENALTY
from kvserve.server.sampler_chain import MAX_SAMPLERS, SamplerChain
from kvserve.structured import StructuredOutputsParams


# llama.cpp's (and Ollama's) sampler fields without a kvserve counterpart, and the value meaning "off"
UNSUPPORTED_SAMPLERS = {"typical_p": 1.0, "mirostat": 0, "tfs_z": 1.0,
                        "dynatemp_range": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
                        "penalize_nl": False, "penalize_newline": False, "top_n_sigma": -1.0}
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
LastN = Annotated[StrictInt, Field(ge=-1, le=2**31)]  # -1: the whole context, 0: off
LLAMA_REPEAT_LAST_N = 64  # llama-server's and Ollama's default window of the repetition penalty
# those of them llama-server itself no longer reads (Ollama's names, and tfs_z, which llama.cpp dropped)
NOT_LLAMA_SERVERS = ("tfs_z", "penalize_nl", "penalize_newline")


class LlamaCppFields(BaseModel):
    n_predict: Annotated[StrictInt, Field(ge=-1, le=2**31)] | None = None  # -1: until the context ends
    grammar: StrictStr | None = None
    json_schema: dict[str, Any] | None = None
    cache_prompt: StrictBool | None = None
    # llama.cpp's repetition penalty (Ollama's too): over the last repeat_last_n tokens of the context
    repeat_penalty: RepetitionPenalty | None = None
    repeat_last_n: LastN | None = None
    samplers: (Annotated[list[StrictStr], Field(max_length=MAX_SAMPLERS)]
               | Annotated[StrictStr, Field(max_length=MAX_SAMPLERS)] | None) = None
    answers_prompt_only: ClassVar[bool] = False  # n_predict 0 allowed: the route answers the prompt alone
    default_chain: ClassVar[SamplerChain | None] = None  # the samplers without `samplers` (None: vLLM's order)

    @field_validator("samplers")
    @classmethod
    def _chain(cls, value: list[str] | str | None) -> list[str] | str | None:
        if value is not None:
            SamplerChain.parse(value)  # (raises what is wrong)
        return value

    def sampler_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams' fields as `samplers` (or the route's default chain) runs them."""
        chain = SamplerChain.parse(self.samplers) if self.samplers is not None else self.default_chain
        return chain.apply(fields) if chain is not None else fields

    def llamacpp_constraints(self) -> list[StructuredOutputsParams | None]:
        """`grammar` and `json_schema` as constraints (at most one may be given with the others)."""
        out: list[StructuredOutputsParams | None] = []
        if self.grammar is not None:
            out.append(StructuredOutputsParams(grammar=self.grammar, field="grammar"))
        if self.json_schema is not None:
            out.append(StructuredOutputsParams(json=self.json_schema, field="json_schema"))
        return out

    def predict_limit(self, max_tokens: int | None) -> int | None:
        """`max_tokens` or `n_predict` (None: neither, or n_predict -1); both given must agree."""
        if self.n_predict is None or self.n_predict == -1:
            return max_tokens
        if self.n_predict == 0 and not self.answers_prompt_only:
            raise ValueError("n_predict must be -1 (until the context ends) or at least 1 here, got 0 "
                             "(0, the prompt alone, is for /completion and /v1/completions)")
        if max_tokens is not None and max_tokens != self.n_predict:
            raise ValueError(f"n_predict ({self.n_predict}) and max_tokens ({max_tokens}) disagree; "
                             "send one")
        return self.n_predict

    def repetition(self, vllm_penalty: float | None) -> dict[str, Any]:
        """SamplingParams' repetition fields: vLLM's `repetition_penalty` covers the whole context, llama.cpp's
        `repeat_penalty` its last LLAMA_REPEAT_LAST_N tokens, unless `repeat_last_n` says otherwise."""
        if vllm_penalty is not None and self.repeat_penalty is not None and vllm_penalty != self.repeat_penalty:
            raise ValueError(f"repetition_penalty ({vllm_penalty}) and repeat_penalty ({self.repeat_penalty}) "
                             "disagree; send one")
        if vllm_penalty is None and self.repeat_penalty is None:
            return {}
        last_n = self.repeat_last_n
        if last_n is None:
            last_n = -1 if vllm_penalty is not None else LLAMA_REPEAT_LAST_N
        return {"repetition_penalty": self.repeat_penalty if vllm_penalty is None else vllm_penalty,
                "repetition_last_n": None if last_n == -1 else last_n}

    def prompt_salt(self, cache_salt: str | None) -> str | None:
        """cache_prompt false: a salt of this request's own, so no cached prefix is reused."""
        if self.cache_prompt is False:
            return f"{cache_salt or ''}:uncached:{secrets.token_hex(8)}"
        return cache_salt
