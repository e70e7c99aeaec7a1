"""SpeculativeConfig: vLLM's `--speculative-config` JSON as kvserve reads it. Method "ngram" (prompt
lookup over the request's own tokens) with `prompt_lookup_min`, `prompt_lookup_max`, or "draft_model"
(a smaller model sharing the tokenizer: `model`, a .gguf path or a name), each with
`num_speculative_tokens` and `disable_by_batch_size` (no drafts while more requests than this decode).
As in vLLM, a `model` without a `method` means "draft_model"."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.errors import ConfigError

METHODS = ("ngram", "draft_model")
INT_KEYS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size")
KEYS = ("method", "model", *INT_KEYS)
MAX_SPECULATIVE_TOKENS = 16
# Verifying k + 1 rows costs about one row only while the step is small (weights read once, few rows):
# past this many decoding requests a step's drafts cost more than they save on a CPU.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 3
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # draft_model: the draft's .gguf path or name

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"--speculative-config: method must be one of {', '.join(METHODS)}, "
                              f"got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model.strip()):
            raise ConfigError("--speculative-config: method draft_model needs \"model\": the draft's .gguf "
                              "path (a smaller model with the target's tokenizer)")
        if self.method == "ngram" and self.model is not None:
            raise ConfigError("--speculative-config: \"model\" is for method draft_model, not ngram")
        for name in INT_KEYS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"--speculative-config: num_speculative_tokens must be at most "
                              f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) must be "
                              f"<= prompt_lookup_max ({self.prompt_lookup_max})")


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a dict or its JSON text -> SpeculativeConfig (or None: off). As in
    vLLM, a missing prompt_lookup_min or _max takes the other's value, a `model` alone means method
    draft_model; num_speculative_tokens is required."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--speculative-config must be JSON, e.g. '{{\"method\": \"ngram\", "
                              f"\"num_speculative_tokens\": 4}}': {err}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: {', '.join(KEYS)})")
    if "num_speculative_tokens" not in value:
        raise ConfigError("--speculative-config: num_speculative_tokens is required")
    args = dict(value)
    args.setdefault("method", "draft_model" if args.get("model") is not None else "ngram")
    low, high = args.get("prompt_lookup_min"), args.get("prompt_lookup_max")
    if low is None and high is not None:
        args["prompt_lookup_min"] = high
    if high is None and low is not None:
        args["prompt_lookup_max"] = low
    return SpeculativeConfig(**args)
