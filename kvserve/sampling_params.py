"""What a request asks the sampler and the stop rules for: vLLM's SamplingParams, checked when built."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.structured.params import StructuredOutputsParams


MAX_REPETITION_PENALTY = 10.0


@dataclass(slots=True)
class SamplingParams:
    """vLLM's shape. Greedy when temperature is 0."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # each prompt token's logprob given the tokens before it, and this many alternatives (vLLM's); such a
    # request computes its whole prompt (it takes no prefix-cache hit)
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice, grammar
    # vLLM's (and OpenAI's) definitions: each logit minus frequency_penalty x the token's count in the
    # output so far, minus presence_penalty if it occurs there; logit_bias adds to the token's logit
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    # vLLM's (CTRL's) repetition penalty: the logit of each token the context holds is divided by it where
    # positive, multiplied where negative; over the prompt and the output, or llama.cpp's last N tokens of them
    repetition_penalty: float = 1.0
    repetition_last_n: int | None = None  # None: the whole context (vLLM's); 0: no token (off)
    min_p: float = 0.0  # vLLM's: after temperature, tokens under min_p x the top token's probability are out
    # llama.cpp's order: top-k, top-p and min-p on the untempered distribution, then the temperature over the
    # tokens they keep (vLLM's, False: the temperature first, then min-p, top-k and top-p)
    temperature_last: bool = False
    # vLLM's: no stop (EOS, stop_token_ids, stop strings) before this many output tokens; the ids that
    # would end the output are masked until then
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string, not before it
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens (<|im_end|>, ...) in the text
    allowed_token_ids: list[int] | None = None  # vLLM's: the only ids the output may take
    # vLLM's: words the output must not contain, each as its tokens with and without a leading space (a
    # word's last token is masked wherever the output ends with the tokens before it: token_bans.py)
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 20:
                raise ValueError(f"{name} must be between 0 and 20, got {getattr(self, name)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.structured_outputs is not None:
            # the constraint decides which tokens come next and where the output ends
            for name in ("min_tokens", "allowed_token_ids", "bad_words"):
                if getattr(self, name):
                    raise ValueError(f"{name} cannot be combined with an output constraint, which decides the "
                                     "tokens allowed and where the output may end")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise ValueError("stop_token_ids must be token ids (integers >= 0)")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words or []):
            raise ValueError("bad_words must be words: strings with at least one character other than a space")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be between 0 and 1, got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if self.repetition_last_n is not None and self.repetition_last_n < 0:
            raise ValueError(f"repetition_last_n must be >= 0 (or None: the whole context), got {self.repetition_last_n}")
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be between -100 and 100; token {token_id} "
                                 f"has {bias}")

    @property
    def penalizes(self) -> bool:
        """Whether the sampler needs the tokens generated so far."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def repeats(self) -> bool:
        """Whether the repetition penalty applies (a penalty other than 1 over a window of some tokens)."""
        return self.repetition_penalty != 1.0 and self.repetition_last_n != 0

    def repetition_tokens(self, token_ids: list[int]) -> list[int] | None:
        """The tokens the repetition penalty applies to, of a sequence's `token_ids` (prompt and output)."""
        if not self.repeats:
            return None
        return list(token_ids) if self.repetition_last_n is None else token_ids[-self.repetition_last_n:]

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this row's logits before choosing (penalties, logit_bias, min_tokens,
        allowed_token_ids, bad_words)."""
        return (self.penalizes or self.repeats or bool(self.logit_bias) or self.min_tokens > 0
                or self.allowed_token_ids is not None or bool(self.bad_words))

    @property
    def filters(self) -> bool:
        """Whether top-k, top-p or min-p leaves tokens out of a sampled row's distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
