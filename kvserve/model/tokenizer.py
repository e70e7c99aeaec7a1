"""Tokenizers rebuilt from GGUF metadata (`tokenizer.ggml.*`) with HF `tokenizers`: byte-level BPE
("gpt2") and SentencePiece BPE with byte fallback ("llama": Gemma, Llama 2); and the chat template
rendered with jinja2 the way transformers renders it; and `encode_prompt`, the one rule that turns a
prompt text into token ids (BOS included where the model wants one, never twice)."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from kvserve.config import ConfigError
from kvserve.model.spm_merges import spm_merges

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
    if kind == "llama":
        return sentencepiece_tokenizer(meta)
    if kind != "gpt2":
        raise ConfigError(
            f"tokenizer type {kind!r} is not supported; kvserve reads byte-level BPE ('gpt2') and "
            "SentencePiece ('llama') GGUF tokenizers"
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

    _add_bos(tok, meta, tokens)
    return tok


def sentencepiece_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """SentencePiece BPE as HF `tokenizers` runs it: spaces become "▁", a BPE model with byte
    fallback (<0x41> tokens), merges recovered from the vocabulary (GGUF files store none; spm_merges.py
    keeps them on disk): every split of a token into two tokens, ranked by the merged token's priority.
    Gemma's priority is its position in the file (its scores do not follow the merge order); other
    models rank by score."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # a token of spaces only ("  ") is stored with real spaces; the normalized text spells them "▁"
    spelled = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if str(meta.get("general.architecture", "")).startswith("gemma"):
        priority = {t: -i for t, i in vocab.items()}
    else:
        priority = dict(zip(spelled, meta.get("tokenizer.ggml.scores") or [-i for i in range(len(tokens))]))
    merges = spm_merges(spelled, vocab, priority)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_prefix else replace
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    control = [t for t, k in zip(tokens, token_types) if k == _CONTROL]
    user = [t for t, k in zip(tokens, token_types) if k == _USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    _add_bos(tok, meta, tokens)
    return tok


def _add_bos(tok: Tokenizer, meta: dict[str, Any], tokens: list[str]) -> None:
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )


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


def read_chat_template(value: str) -> str:
    """`--chat-template FILE|STRING` (vLLM's flag): a file's text, or the value itself when it is a
    Jinja template; ConfigError for neither, or for a template that does not compile."""
    import jinja2

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    try:
        _compile(template)
    except jinja2.TemplateError as err:
        raise ConfigError(f"--chat-template does not compile: {err}") from None
    return template


# the template variables kvserve sets itself, which chat_template_kwargs may not replace
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                         "bos_token", "eos_token"})


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """How a chat renders beyond its messages and tools (vLLM's and transformers' names): a generation prompt
    opening the answer's turn, or the last message left open so that the answer continues it (assistant
    prefill), and extra template variables (`enable_thinking`, ...)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message continues the last message instead of opening a new turn: "
                             "send add_generation_prompt false with it")
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(self.template_kwargs))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}, which kvserve sets itself")

    def rendered(self, text: str, messages: list[dict[str, Any]]) -> str:
        """The template's `text` of `messages`, cut after the last message's content when it is continued
        (transformers' rule: its text as given, else stripped, found last in the rendered chat)."""
        if not self.continue_final_message:
            return text
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str) or not final.strip():
            raise ValueError("continue_final_message needs a last message with text to continue")
        for content in (final, final.strip()):
            at = text.rfind(content)
            if at >= 0:
                return text[:at + len(content)]
        raise ValueError("continue_final_message: the chat template does not copy the last message's text, so "
                         "it cannot be continued")


def apply_chat_template(
    template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
) -> str:
    """Render `messages` ([{"role", "content"}, ...]) with a HF-style jinja chat template;
    `extra` (bos_token, eos_token, tools, ...) is passed to the template as variables."""
    return _compile(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **extra
    )


@dataclass(slots=True)
class Encoded:
    """A text's prompt token ids and, on demand, the character offset where each token ends
    (made only when asked for: on a long prompt the conversion holds the GIL a while)."""

    ids: list[int]
    known_ends: list[int] | None = None
    encoding: Any = field(default=None, repr=False)  # the tokenizers Encoding the ends come from
    skip: int = 0  # leading tokens of `encoding` dropped (a doubled BOS)

    def ends(self) -> list[int]:
        if self.known_ends is None:
            self.known_ends = [end for _, end in self.encoding.offsets[self.skip:]]
        return self.known_ends


def encode_prompt(tokenizer: Tokenizer, text: str, add_bos: bool, bos_token_id: int | None) -> Encoded:
    """The one tokenization rule for every prompt text (plain prompts and rendered chats alike):
    special tokens written in the text are recognised, and a BOS is added where the model wants one
    unless the text already starts with it (chat templates write `{{ bos_token }}` themselves), so
    a prompt never starts with two. encode_batch releases the GIL while it works (encode does not),
    so worker threads tokenizing long prompts leave the event loop free."""
    encoding = tokenizer.encode_batch([text], add_special_tokens=add_bos)[0]
    ids = encoding.ids
    skip = int(add_bos and bos_token_id is not None and len(ids) >= 2
               and ids[0] == ids[1] == bos_token_id)
    return Encoded(ids[skip:] if skip else ids, None, encoding, skip)
