"""GGUF loading: the bundled model's shape, model resolution errors, the Q/K un-permute, and that a
second load in the process reuses the first."""

from __future__ import annotations

import torch

import pytest

from kvserve.config import ConfigError
from kvserve.model.gguf_loader import (
    bundled_model_path, load_gguf, resolve_model_path, unpermute_rope_rows,
)


def test_bundled_model_config_matches_design():
    cfg = load_gguf(bundled_model_path()).config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (49152, 576, 1536)
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings


def test_loaded_model_metadata_and_weights():
    loaded = load_gguf(bundled_model_path())
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.add_bos_token) == (1, 2, False)
    assert "<|im_start|>" in loaded.chat_template
    w = loaded.weights
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in w.values())
    assert "lm_head.weight" not in w  # tied
    assert len(loaded.fingerprint) == 16 and int(loaded.fingerprint, 16) >= 0


def test_loads_are_shared_within_a_process():
    assert load_gguf(bundled_model_path()) is load_gguf(resolve_model_path("smollm2"))


def test_model_names_resolve_to_the_bundled_file():
    path = bundled_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path(None) == resolve_model_path("SmolLM2-135M-Instruct") == path


@pytest.mark.parametrize("model", ["no-such-model", "/nonexistent/model.gguf"])
def test_unknown_model_raises_config_error(model):
    with pytest.raises(ConfigError, match="model not found: .*give a .gguf path"):
        resolve_model_path(model)


def llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to HF q/k rows (written from its description, as a test oracle):
    per head, row i of the first half and row i of the second half become rows 2i and 2i+1."""
    head_dim = w.shape[0] // num_heads
    out = torch.empty_like(w)
    for h in range(num_heads):
        for i in range(head_dim // 2):
            out[h * head_dim + 2 * i] = w[h * head_dim + i]
            out[h * head_dim + 2 * i + 1] = w[h * head_dim + head_dim // 2 + i]
    return out


@pytest.mark.parametrize("num_heads,head_dim", [(3, 8), (1, 4), (9, 64)])
def test_unpermute_inverts_llama_cpp_permute(num_heads, head_dim):
    hf = torch.randn(num_heads * head_dim, 5)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(hf, num_heads), num_heads), hf)
    bias = torch.randn(num_heads * head_dim)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(bias[:, None], num_heads)[:, 0], num_heads), bias)
