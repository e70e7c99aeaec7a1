"""GGUF file -> ModelConfig, weights (HF names, HF layout: packed blocks as stored, dequantized to
float32 on first use), tokenizer and chat template. Loads are memoized by absolute path, so engines in
one process share one copy of the weights."""

from __future__ import annotations

import functools
import hashlib
import os

import numpy as np

from kvserve.config import ConfigError
from kvserve.model import architectures
from kvserve.model.gguf_config import config_from_metadata, gguf_metadata, read_gguf
from kvserve.model.known_models import BUNDLED_NAMES, bundled_model_path, known_model_path
from kvserve.model.loaded import FloatTensor, GGUFTensor, LoadedModel, unpermute_rope_rows
from kvserve.model.tokenizer import apply_chat_template, build_tokenizer

__all__ = ["FloatTensor", "GGUFTensor", "LoadedModel", "apply_chat_template", "bundled_model_path", "load_gguf",
           "unpermute_rope_rows",
           "resolve_model_path"]


def resolve_model_path(model: str | None) -> str:
    """None or a bundled name -> the bundled GGUF; a known name (known_models.py) -> its GGUF;
    else an existing .gguf path or a Hugging Face folder (config.json, *.safetensors, tokenizer.json)."""
    if model is None or model in BUNDLED_NAMES:
        return bundled_model_path()
    if model.endswith(".gguf") and os.path.isfile(model):
        return os.path.abspath(model)
    if (known := known_model_path(model)) is not None:
        return known
    if os.path.isfile(os.path.join(model, "config.json")):
        return os.path.abspath(model)
    raise ConfigError(
        f"model not found: {model!r} (give a .gguf path, a folder with config.json and "
        "*.safetensors, a known name: gemma-3-270m, synthetic:NAME (random weights of a real model's shapes, "
        "kvserve/model/synthetic.py), or omit --model for the bundled SmolLM2-135M-Instruct)"
    )


def load_gguf(path: str) -> LoadedModel:
    """Load a GGUF file, or a Hugging Face folder, once per process (memoized by absolute path)."""
    if os.path.isdir(path):
        from kvserve.model.hf_loader import load_hf_folder

        return load_hf_folder(path)
    return _load(os.path.abspath(path))


@functools.lru_cache(maxsize=4)
def _load(path: str) -> LoadedModel:
    if not os.path.isfile(path):
        raise ConfigError(f"model not found: {path!r}")
    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    arch = architectures.architecture(meta.get("general.architecture"))
    rope_freqs = [t for t in reader.tensors if t.name == architectures.ROPE_FREQS]
    factors = np.asarray(rope_freqs[0].data, dtype=np.float32).tolist() if rope_freqs else None
    config = config_from_metadata(meta, {t.name for t in reader.tensors}, path, rope_freqs=factors)
    rope_heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads} if arch.permuted_qk else {}
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name == architectures.ROPE_FREQS:
            continue
        name = arch.hf_name(tensor.name)
        if name is None:
            raise ConfigError(f"{path}: unsupported tensor {tensor.name!r} for architecture {arch.name!r}")
        proj = name.split(".")[-2] if ".self_attn." in name else ""
        offset = arch.gguf_norm_offset if name.endswith("norm.weight") else 0.0
        tensors[name] = GGUFTensor(tensor.data, tensor.tensor_type,
                                   tuple(int(d) for d in reversed(tensor.shape)),  # GGUF: innermost first
                                   rope_heads.get(proj), offset, (path, tensor.data_offset))
    tokenizer = build_tokenizer(meta)
    eos_ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return LoadedModel(
        path=path,
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        fingerprint=file_fingerprint(path),
        eos_token_ids=architectures.stop_token_ids(arch.name, eos_ids, meta["tokenizer.ggml.tokens"],
                                                   meta.get("tokenizer.ggml.token_type")),
    )


def file_fingerprint(path: str) -> str:
    """sha256 over name, size and the first MiB: cheap, and stable across processes and hosts."""
    digest = hashlib.sha256(f"{os.path.basename(path)}:{os.path.getsize(path)}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]
