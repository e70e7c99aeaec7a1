"""GGUF metadata -> ModelConfig, without torch: the model loader and `kvserve plan` both go through
`config_from_metadata`, so the two can never read a file's shape differently."""

from __future__ import annotations

from typing import Any

from kvserve.config import ConfigError, ModelConfig
from kvserve.model import architectures


def read_gguf(path: str) -> Any:
    """A GGUFFile over `path` (memory-mapped; gguf_file.py), or a one-line ConfigError."""
    from kvserve.model.gguf_file import GGUFFile  # lazy: importing gguf costs ~0.1 s

    try:
        return GGUFFile(path)
    except Exception as exc:  # ValueError, OSError, struct errors...
        raise ConfigError(f"cannot read GGUF file {path}: {exc}") from None


def gguf_metadata(reader: Any, tokenizer: bool = True) -> dict[str, Any]:
    """The key-value metadata. tokenizer=False leaves out the vocabulary and merges but keeps
    `tokenizer.ggml.tokens` (its length is the vocabulary size where the file gives none)."""
    meta = {k: v for k, v in reader.fields.items() if tokenizer or not k.startswith("tokenizer.ggml.")}
    if not tokenizer and "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.tokens"] = reader.fields["tokenizer.ggml.tokens"]
    return meta


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str], path: str = "",
                         supported_only: bool = True, rope_freqs: list[float] | None = None) -> ModelConfig:
    """The decoder's shape: architectures.py for the architectures kvserve runs (windows, RoPE
    scaling, norms); `supported_only=False` (the planner) also reads others that carry the
    Llama-style keys."""
    arch = meta.get("general.architecture")
    if arch in architectures.ARCHITECTURES:
        return architectures.config_from_gguf(meta, tensor_names, rope_freqs)
    if supported_only:
        architectures.architecture(arch)  # raises the one-line "not supported" error

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(key, default)
        if value is None:
            raise ConfigError(f"GGUF file {path} has no {key!r} metadata")
        return max(value) if isinstance(value, list) else value  # per-layer arrays: the largest

    hidden, heads = int(get(f"{arch}.embedding_length")), int(get(f"{arch}.attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    return ModelConfig(
        name=str(meta.get("general.basename") or meta.get("general.name") or arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get(f"{arch}.feed_forward_length")),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(get(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def read_gguf_config(path: str, supported_only: bool = True) -> tuple[ModelConfig, int]:
    """(ModelConfig, parameter count) of a GGUF file, reading only its header and tensor table."""
    reader = read_gguf(path)
    config = config_from_metadata(gguf_metadata(reader, tokenizer=False), {t.name for t in reader.tensors}, path,
                                  supported_only)
    return config, sum(int(t.n_elements) for t in reader.tensors)
