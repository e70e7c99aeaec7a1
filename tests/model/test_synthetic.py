"""Synthetic models (kvserve/model/synthetic.py): the real specs count the published parameters and
follow llama.cpp's Q4_K_M rule; tiny specs, built through the same code, hold exactly the tensor table
they promise, and both kvserve and llama.cpp's llama-bench run them."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from kvserve.config import ConfigError, ModelConfig
from kvserve.model import synthetic
from kvserve.model.architectures import rope_freq_factors
from kvserve.model.gguf_config import read_gguf_config
from kvserve.model.gguf_file import GGUFFile
from kvserve.model.known_models import bundled_model_path
from kvserve.model.synthetic import QuantMix, SyntheticSpec
from kvserve.tools.planner import count_params
from tests.conftest import make_llm

LLAMA_BENCH = Path(os.environ.get("KVSERVE_LLAMA_BENCH", "/work/shared/peers/llama.cpp/llama-bench"))
# 8 layers: use_more_bits picks layers 0, 3, 6 and 7; 49,408 tokens: the bundled 49,152 and 256 pads
TINY_QWEN2 = ModelConfig("tiny-qwen2", vocab_size=49408, hidden_size=256, intermediate_size=512, num_layers=8,
                         num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=2048, tie_word_embeddings=True, architecture="qwen2")
TINY_LLAMA = ModelConfig("tiny-llama", vocab_size=49408, hidden_size=256, intermediate_size=512, num_layers=8,
                         num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=2048, tie_word_embeddings=False, architecture="llama",
                         rope_freq_factors=rope_freq_factors(
                             {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 256}, 64, 500000.0))
TINY = {
    "qwen2-q4_k_m": SyntheticSpec("tiny-qwen2-q4_k_m", TINY_QWEN2, QuantMix.Q4_K_M),
    "llama-q4_k_m": SyntheticSpec("tiny-llama-q4_k_m", TINY_LLAMA, QuantMix.Q4_K_M),
    "llama-q8_0": SyntheticSpec("tiny-llama-q8_0", TINY_LLAMA, QuantMix.Q8_0),
}


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    built: dict[str, Path] = {}

    def build(kind: str) -> Path:
        if kind not in built:
            spec = TINY[kind]
            built[kind] = synthetic.build(spec, tmp_path_factory.mktemp("synthetic") / spec.file_name,
                                          bundled_model_path())
        return built[kind]

    return build


@pytest.mark.parametrize("name, published", [("qwen2.5-1.5b", 1.54e9), ("llama-3.2-3b", 3.21e9),
                                             ("llama-3.1-8b", 8.03e9)])
def test_real_specs_count_the_published_parameters(name, published):
    spec = synthetic.synthetic_spec(f"{name}-q4_k_m")
    count = synthetic.parameter_count(spec)
    assert count == pytest.approx(published, rel=0.005)
    assert count == count_params(spec.config, qkv_bias=spec.config.architecture == "qwen2")  # `kvserve plan`


@pytest.mark.parametrize("name, published_gb", [("llama-3.1-8b-q4_k_m", 4.92), ("llama-3.2-3b-q4_k_m", 2.02),
                                                ("qwen2.5-1.5b-q8_0", 1.65)])
def test_real_specs_weigh_what_public_quants_weigh(name, published_gb):
    assert synthetic.file_bytes(synthetic.synthetic_spec(name)) / 1e9 == pytest.approx(published_gb, rel=0.02)


def test_q4_k_m_puts_q6_k_where_llama_cpp_does():
    types = {t.name: t.qtype for t in synthetic.tensor_specs(synthetic.synthetic_spec("llama-3.1-8b-q4_k_m"))}
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K  # untied
    more_bits = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]  # use_more_bits over 32 layers
    for role in ("attn_v", "ffn_down"):
        assert [i for i in range(32) if types[f"blk.{i}.{role}.weight"] == Q.Q6_K] == more_bits
    assert {types[f"blk.{i}.{r}.weight"] for i in range(32) for r in ("attn_q", "attn_k", "attn_output",
                                                                      "ffn_gate", "ffn_up")} == {Q.Q4_K}
    qwen = {t.name: t.qtype for t in synthetic.tensor_specs(synthetic.synthetic_spec("qwen2.5-1.5b-q4_k_m"))}
    assert "output.weight" not in qwen and qwen["token_embd.weight"] == Q.Q6_K  # tied: it is the lm_head
    assert qwen["blk.0.attn_q.bias"] == Q.F32


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match="synthetic:llama-3.1-8b-q4_k_m"):
        synthetic.synthetic_spec("llama-9b-q4_k_m")


@pytest.mark.parametrize("kind", list(TINY))
def test_the_file_holds_the_spec_tensor_table_and_metadata(tiny_file, kind):
    spec = TINY[kind]
    f = GGUFFile(str(tiny_file(kind)))
    expected = [(t.name, tuple(reversed(t.shape)), t.qtype) for t in synthetic.tensor_specs(spec)]
    assert [(t.name, t.shape, t.tensor_type) for t in f.tensors] == expected
    config, num_params = read_gguf_config(str(tiny_file(kind)))  # the metadata, as `kvserve plan` reads it
    assert config == dataclasses.replace(spec.config, name=f"synthetic-{spec.name}", rms_norm_eps=config.rms_norm_eps,
                                         rope_freq_factors=None)  # the planner reads no tensor
    assert config.rms_norm_eps == pytest.approx(spec.config.rms_norm_eps)  # stored as float32
    rope = [t.data.tolist() for t in f.tensors if t.name == "rope_freqs.weight"]
    assert rope == ([pytest.approx(spec.config.rope_freq_factors)] if spec.config.rope_freq_factors else [])
    assert num_params == synthetic.parameter_count(spec) + (32 if spec.config.rope_freq_factors else 0)
    tokens, vocab_size = f.fields["tokenizer.ggml.tokens"], spec.config.vocab_size
    assert len(tokens) == len(set(tokens)) == vocab_size and tokens[-1] == f"[PAD{vocab_size - 1}]"
    for t in f.tensors:
        if t.tensor_type != Q.F32:
            w = quants.dequantize(t.data[:4], t.tensor_type)
            assert np.isfinite(w).all() and 0.01 < w.std() < 0.2, t.name  # a real model's magnitude
        elif "norm" in t.name:
            assert (t.data == 1.0).all()


def test_the_same_seed_gives_the_same_bytes(tiny_file, tmp_path):
    again = synthetic.build(TINY["llama-q8_0"], tmp_path / "again.gguf", bundled_model_path())
    assert again.read_bytes() == tiny_file("llama-q8_0").read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["again.gguf"]  # the temp file was renamed


@pytest.mark.parametrize("kind", list(TINY))
def test_kvserve_generates_greedily_without_nan(tiny_file, kind):
    from kvserve import SamplingParams

    llm = make_llm(model=str(tiny_file(kind)))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    out = llm.generate(["The capital of France is"], params)[0].outputs[0]
    assert len(out.token_ids) == 4 and all(0 <= t < TINY[kind].config.vocab_size for t in out.token_ids)
    assert all(math.isfinite(lp) for step in out.logprobs for lp in step.values())


def test_a_synthetic_name_builds_once_into_the_cache(monkeypatch, tmp_path):
    from kvserve.model.gguf_loader import resolve_model_path

    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    monkeypatch.setitem(synthetic.SHAPES, "tiny-qwen2", TINY_QWEN2)
    path = Path(resolve_model_path("synthetic:tiny-qwen2-q4_k_m"))
    assert path == tmp_path / "synthetic-tiny-qwen2-q4_k_m.gguf" and path.is_file()
    monkeypatch.setattr(synthetic, "build", lambda *args: pytest.fail("built twice"))
    assert resolve_model_path("synthetic:tiny-qwen2-q4_k_m") == str(path)


@pytest.mark.skipif(not LLAMA_BENCH.is_file(), reason=f"no llama-bench at {LLAMA_BENCH}")
@pytest.mark.parametrize("kind", list(TINY))
def test_llama_bench_runs_the_file(tiny_file, kind):
    result = subprocess.run(["nice", "-n", "19", str(LLAMA_BENCH), "-m", str(tiny_file(kind)), "-p", "8", "-n", "8",
                             "-t", "2", "-r", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pp8" in result.stdout and "tg8" in result.stdout
