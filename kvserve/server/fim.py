"""`suffix` on /v1/completions: fill-in-the-middle, for models whose tokenizer has FIM tokens. The
prompt becomes prefix-suffix-middle (PSM, the order StarCoder, Qwen2.5-Coder and CodeLlama were trained
on); a model without FIM tokens gets a 400 naming `suffix`."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from kvserve.server.protocol import APIError

# (prefix, suffix, middle) spellings, as the families name them
FIM_SPELLINGS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                 ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
                 ("<PRE>", "<SUF>", "<MID>"))


@dataclass(frozen=True, slots=True)
class FimTokens:
    prefix: str
    suffix: str
    middle: str

    def prompt(self, before: str, after: str) -> str:
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


def fim_tokens(tokenizer) -> FimTokens | None:
    """The FIM tokens of a `tokenizers.Tokenizer` (added tokens included), or None."""
    for spelling in FIM_SPELLINGS:
        if all(tokenizer.token_to_id(token) is not None for token in spelling):
            return FimTokens(*spelling)
    return None


def text_only(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that encodes special-token spellings (`<|im_end|>`, `<fim_prefix>`) as the
    text they are, not as the tokens."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy


def fim_prompt(tokens: FimTokens | None, prompt: str | list[int], suffix: str) -> str:
    """The PSM prompt for one text prompt; APIError (400) when the model or the prompt cannot."""
    if tokens is None:
        raise APIError("suffix needs a fill-in-the-middle model; this model's tokenizer has no FIM "
                       "tokens (<fim_prefix>, <fim_suffix>, <fim_middle>); leave suffix out",
                       param="suffix")
    if not isinstance(prompt, str):
        raise APIError("suffix needs a text prompt, not token ids", param="suffix")
    return tokens.prompt(prompt, suffix)
