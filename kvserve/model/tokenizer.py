"""Byte-level BPE tokenizer rebuilt from GGUF metadata (`tokenizer.ggml.*`) with HF `tokenizers`,
and the chat template rendered with jinja2 the way transformers renders it."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kvserve.config import ConfigError

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

# Split regexes for the `tokenizer.ggml.pre` names whose merges were learned on a non-GPT-2 split.
# Everything else ("gpt2", "smollm", ...) uses ByteLevel's own GPT-2 split, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte value (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` from the GGUF metadata dict (keys `tokenizer.ggml.*`)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            f"tokenizer type {kind!r} is not supported; kvserve reads byte-level BPE ('gpt2') GGUF tokenizers"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = set(byte_alphabet().values())
    spell = byte_alphabet()

    def respell(token: str) -> str:
        # a few files store raw text for some tokens; byte-level BPE wants the byte alphabet
        return token if set(token) <= alphabet else "".join(spell[b] for b in token.encode("utf-8"))

    vocab = {respell(token): index for index, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))

    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>...) are matched whole and are special; user-defined ones are
    # matched whole but are ordinary text. A "control" token outside the byte alphabet is a mislabel.
    control = [t for t, k in zip(tokens, token_types) if k == _CONTROL and set(t) <= alphabet]
    user = [t for t, k in zip(tokens, token_types) if k == _USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok


def _raise(message: str) -> None:
    raise ValueError(message)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def apply_chat_template(
    template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
) -> str:
    """Render `messages` ([{"role", "content"}, ...]) with a HF-style jinja chat template;
    `extra` (bos_token, eos_token, tools, ...) is passed to the template as variables."""
    return _compile(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **extra
    )
