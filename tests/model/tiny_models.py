"""Tiny random-weight models for architecture tests: a transformers model from a small config (fixed
seed), saved as a HF folder (safetensors + tokenizer.json) and written as GGUF the way llama.cpp's
converter lays it out (Q/K rows permuted for llama, Gemma norms stored as 1 + w, llama3 rope_freqs).
The tokenizer is the bundled SmolLM2 one, cut to 2048 tokens (or whole: a draft model for SmolLM2)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from kvserve.model import architectures
from kvserve.model.gguf_loader import bundled_model_path

VOCAB = 2048  # the bundled SmolLM2 tokenizer cut to its first 2048 tokens
FULL_VOCAB = 49152  # all of it
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
              initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_config(kind: str, **overrides):
    """A transformers config for one of: llama3, qwen2, qwen3, gemma3, gemma3-scaled (folder only);
    `overrides` replace COMMON's values (e.g. a longer max_position_embeddings)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = {**COMMON, **overrides}
    if kind == "llama3":
        return LlamaConfig(**common, num_hidden_layers=3, tie_word_embeddings=False, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if kind == "qwen2":
        return Qwen2Config(**common, num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1000000.0)
    if kind == "qwen3":
        return Qwen3Config(**common, num_hidden_layers=3, tie_word_embeddings=True, rope_theta=1000000.0)
    if kind in ("gemma3", "gemma3-scaled"):  # GGUF has no query_pre_attn_scalar: llama.cpp uses head_dim
        return Gemma3TextConfig(**common, num_hidden_layers=6, sliding_window=8, tie_word_embeddings=True,
                                query_pre_attn_scalar=16 if kind == "gemma3" else 40, rope_theta=1000000.0)
    raise ValueError(kind)


def make_hf_model(kind: str, seed: int = 0, **overrides):
    """A float32 transformers model with random weights; norm weights get noise too, so the (1 + w)
    convention and QK-norms are exercised."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **overrides), dtype=torch.float32).eval()
    qkv_bias = kind == "qwen2"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or (qkv_bias and name.endswith("bias")):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def save_folder(model, folder: Path) -> Path:
    """save_pretrained (safetensors) plus the bundled tokenizer as tokenizer.json."""
    from kvserve.model.tokenizer import build_tokenizer

    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(_bundled_tokenizer_meta()).save(str(folder / "tokenizer.json"))
    return folder


def write_gguf(model, kind: str, path: Path, add_bos: bool = False,
               chat_template: str | None = None, full_vocab: bool = False, store=None) -> Path:
    """Write `model` as an F32 GGUF in llama.cpp's conventions, with the bundled tokenizer (a BOS
    added to prompts, and a chat template, when asked: Gemma's conventions); `full_vocab`: all of it,
    for a model of SmolLM2's 49,152 tokens. `store(name, float32 array)` may return (raw blocks,
    ggml type) to write a tensor in another format (None: F32)."""
    import gguf

    arch_name = {"llama3": "llama"}.get(kind, kind)
    arch = architectures.ARCHITECTURES[arch_name]
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch_name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope["full_attention"]["rope_theta"] if kind == "gemma3" else rope["rope_theta"]))
    if kind == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    _copy_tokenizer(w, add_bos, full_vocab)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    to_gguf = {hf: g for g, hf in arch.layer_names.items()}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().float()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{to_gguf[rest]}"
        else:
            gname = {hf: g for g, hf in architectures.GLOBAL_NAMES.items()}[name]
        if arch.permuted_qk and ("q_proj" in name or "k_proj" in name):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            t = _permute(t, heads)
        if arch.gguf_norm_offset and name.endswith("norm.weight"):
            t = t + arch.gguf_norm_offset
        stored = store(gname, t.numpy().astype(np.float32)) if store else None
        if stored is None:
            w.add_tensor(gname, t.numpy().astype(np.float32))
        else:
            w.add_tensor(gname, stored[0], raw_shape=stored[0].shape, raw_dtype=stored[1])
    if kind == "llama3":
        factors = architectures.rope_freq_factors(rope, cfg.head_dim, rope["rope_theta"])
        w.add_tensor(architectures.ROPE_FREQS, np.array(factors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _permute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order: per head, rows i and i + head_dim/2 become neighbours."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


@functools.cache
def _bundled_tokenizer_meta() -> dict:
    meta = _full_tokenizer_meta()
    # its first VOCAB tokens and the merges among them: a smaller but consistent BPE tokenizer
    tokens = meta["tokenizer.ggml.tokens"][:VOCAB]
    known = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"] if m.replace(" ", "", 1) in known
              and all(part in known for part in m.split(" ", 1))]
    return meta | {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
                   "tokenizer.ggml.token_type": meta["tokenizer.ggml.token_type"][:VOCAB]}


def write_draft_for_bundled(path: Path, seed: int = 2) -> Path:
    """A tiny random llama with the bundled SmolLM2's whole tokenizer and context: a draft model for it
    (its drafts are mostly rejected)."""
    model = make_hf_model("llama3", seed, vocab_size=FULL_VOCAB, max_position_embeddings=8192)
    return write_gguf(model, "llama3", path, full_vocab=True)


@functools.cache
def _full_tokenizer_meta() -> dict:
    import gguf

    reader = gguf.GGUFReader(bundled_model_path())
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}


def _copy_tokenizer(w, add_bos: bool = False, full_vocab: bool = False) -> None:
    field = _full_tokenizer_meta() if full_vocab else _bundled_tokenizer_meta()
    w.add_tokenizer_model(field["tokenizer.ggml.model"])
    w.add_tokenizer_pre(field.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(field["tokenizer.ggml.tokens"])
    w.add_token_types(field["tokenizer.ggml.token_type"])
    w.add_token_merges(field["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
