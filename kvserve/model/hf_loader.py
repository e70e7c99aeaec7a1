"""Hugging Face folder (config.json, *.safetensors, tokenizer.json) -> the same LoadedModel as the
GGUF path: float32 weights under HF names, ModelConfig from architectures.py, the tokenizer as saved."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from kvserve.config import ConfigError
from kvserve.model import architectures
from kvserve.model.loaded import FloatTensor, LoadedModel

# Prefixes that multimodal checkpoints put before the text decoder's "model." names
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


def load_hf_folder(path: str) -> LoadedModel:
    """Load a Hugging Face model folder once per process (memoized by absolute path)."""
    return _load(os.path.abspath(path))


def _read_json(folder: Path, name: str) -> dict[str, Any]:
    file = folder / name
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None


@functools.lru_cache(maxsize=4)
def _load(path: str) -> LoadedModel:
    from safetensors.torch import load_file

    folder = Path(path)
    cfg = _read_json(folder, "config.json")
    if not cfg:
        raise ConfigError(f"{path}: no config.json; a model folder needs config.json, *.safetensors, tokenizer.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors weights (kvserve does not read .bin checkpoints)")
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"{path}: no tokenizer.json (save the tokenizer with a fast tokenizer)")
    try:
        config = architectures.config_from_hf(cfg)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}/config.json: missing or bad field {e}") from None
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except Exception as e:  # safetensors raises its own error type for a damaged file
            raise ConfigError(f"{file}: not a readable safetensors file ({e})") from None
        for name, tensor in tensors.items():
            for prefix in _TEXT_PREFIXES:
                if name.startswith(prefix):
                    name = "model." + name[len(prefix):]
            weights[name] = tensor.to(torch.float32)
    tied = "lm_head.weight" not in weights
    if tied != config.tie_word_embeddings:
        import dataclasses

        config = dataclasses.replace(config, tie_word_embeddings=tied)

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok_cfg = _read_json(folder, "tokenizer_config.json")
    template = tok_cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    gen = _read_json(folder, "generation_config.json")
    eos_ids = _ids(gen.get("eos_token_id")) + _ids(cfg.get("eos_token_id"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    tokens = [tokenizer.id_to_token(i) or "" for i in range(vocab)]
    return LoadedModel(
        path=path,
        config=config,
        tensors={name: FloatTensor(w) for name, w in weights.items()},
        tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None,
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_id=eos_ids[0] if eos_ids else None,
        add_bos_token=True,  # tokenizer.json's post-processor decides whether a BOS is added
        fingerprint=_fingerprint(folder, files),
        eos_token_ids=architectures.stop_token_ids(config.architecture, eos_ids, tokens, _special_flags(tokenizer)),
    )


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _special_flags(tokenizer: Tokenizer) -> list[int]:
    """llama.cpp-style token types (3 = control) from tokenizer.json's special added tokens."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    types = [1] * vocab
    for i, token in tokenizer.get_added_tokens_decoder().items():
        if token.special and i < vocab:
            types[i] = 3
    return types


def _fingerprint(folder: Path, files: list[Path]) -> str:
    """sha256 over config.json and the weight files' names and sizes: cheap and stable."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in files:
        digest.update(f"{file.name}:{file.stat().st_size}:".encode())
    return digest.hexdigest()[:16]
