"""llama.cpp's own request fields, as llama-server reads them on its OpenAI routes and on `/completion`:
`n_predict` (max tokens), `grammar` (GBNF), `json_schema` (a schema the output follows) and
`cache_prompt` (false: compute the whole prompt, reusing no cached prefix). Each is honoured; none is
ignored. Mixed into the OpenAI request models (protocol.py) and llama.cpp's /completion (llamacpp.py).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from kvserve.structured import StructuredOutputsParams


# llama.cpp's (and Ollama's) sampler fields without a kvserve counterpart, and the value meaning "off"
UNSUPPORTED_SAMPLERS = {"min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "mirostat": 0, "tfs_z": 1.0,
                        "dynatemp_range": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
                        "penalize_nl": False, "penalize_newline": False, "top_n_sigma": -1.0}
# those of them llama-server itself no longer reads (Ollama's names, and tfs_z, which llama.cpp dropped)
NOT_LLAMA_SERVERS = ("tfs_z", "penalize_nl", "penalize_newline")


class LlamaCppFields(BaseModel):
    n_predict: Annotated[StrictInt, Field(ge=-1, le=2**31)] | None = None  # -1: until the context ends
    grammar: StrictStr | None = None
    json_schema: dict[str, Any] | None = None
    cache_prompt: StrictBool | None = None
    answers_prompt_only: ClassVar[bool] = False  # n_predict 0 allowed: the route answers the prompt alone

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

    def prompt_salt(self, cache_salt: str | None) -> str | None:
        """cache_prompt false: a salt of this request's own, so no cached prefix is reused."""
        if self.cache_prompt is False:
            return f"{cache_salt or ''}:uncached:{secrets.token_hex(8)}"
        return cache_salt
