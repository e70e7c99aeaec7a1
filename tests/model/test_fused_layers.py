"""The one-call native decoder layers (kernels/layers.py) give the per-op path's bits: the bundled
model's hidden states over prefill chunks, decode rows and a step mixing both, for the two KV codecs
whose write the attention kernel does; and the steps they cover make no per-op kernel call."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve import kernels
from kvserve.config import KV_DTYPES
from kvserve.kernels import ops
from kvserve.model import llama
from kvserve.model.attention import AttentionMetadata
from kvserve.model.gguf_loader import bundled_model_path, load_gguf
from kvserve.model.runner import ModelRunner

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="native kernels not built")
PAGE = 16
# (start positions, tokens) per sequence of each step: A's prefill in two chunks, then A decoding
# beside B's prefill, then both decoding
STEPS = [
    {"a": (0, 37)},
    {"a": (37, 20)},
    {"a": (57, 1), "b": (0, 23)},
    {"b": (23, 1), "a": (58, 1)},
]


@pytest.fixture(scope="module")
def loaded():
    return load_gguf(bundled_model_path())


def hidden_states(loaded, kv_dtype: str) -> list[torch.Tensor]:
    runner = ModelRunner(loaded, 12, PAGE, KV_DTYPES[kv_dtype], dtype="native")
    tables = {"a": list(range(1, 6)), "b": list(range(6, 9))}
    gen = torch.Generator().manual_seed(0)
    out = []
    for step in STEPS:
        names = list(step)
        starts, lens = [step[n][0] for n in names], [step[n][1] for n in names]
        meta = AttentionMetadata.build(starts, lens, [tables[n] for n in names], PAGE, runner.device)
        ids = torch.randint(3, 49_000, (sum(lens),), generator=gen)
        with torch.inference_mode():
            out.append(runner.model(ids, meta.positions, runner.kv_caches, meta).clone())
    return out


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp32"])
def test_fused_layers_equal_the_per_op_path_bitwise(loaded, kv_dtype, monkeypatch):
    fused = hidden_states(loaded, kv_dtype)
    monkeypatch.setattr(llama, "FUSED_MAX_ROWS", 0)
    per_op = hidden_states(loaded, kv_dtype)
    for a, b in zip(fused, per_op, strict=True):
        assert torch.equal(a, b)


def test_the_bundled_models_interleaved_rows_give_the_files_bits(loaded, monkeypatch):
    """The bundled model's Q4_1 and Q8_0 matrices interleaved at load (kernels/matmul.py interleave): the
    hidden states of prefill chunks, decode rows and a mixed step equal the file layout's, bit for bit."""
    interleaved = hidden_states(loaded, "fp32")
    monkeypatch.setenv("KVSERVE_KERNELS_INTERLEAVE", "off")
    as_filed = hidden_states(loaded, "fp32")
    assert all(torch.equal(a, b) for a, b in zip(interleaved, as_filed))


def test_chunks_past_the_kept_scratch_run_on_their_own(loaded, monkeypatch):
    """Chunks longer than KEPT_ROWS get a scratch of their own for the step (the kept one stays at the
    decode steps' size), steps within it the kept one: the same bits as op by op."""
    from kvserve.kernels import layers as native_layers

    monkeypatch.setattr(native_layers, "KEPT_ROWS", 10)  # the 37-, 20- and 24-row steps are past it
    fused = hidden_states(loaded, "bf16")
    monkeypatch.setattr(llama, "FUSED_MAX_ROWS", 0)
    per_op = hidden_states(loaded, "bf16")
    for a, b in zip(fused, per_op, strict=True):
        assert torch.equal(a, b)


def test_covered_steps_make_no_per_op_kernel_call(loaded, monkeypatch):
    def per_op(*args, **kwargs):
        raise AssertionError("a per-op kernel ran")

    monkeypatch.setattr(ops, "rms_norm", per_op)
    hidden_states(loaded, "bf16")


def test_long_chunks_and_other_codecs_run_op_by_op(loaded, monkeypatch):
    monkeypatch.setattr(llama, "FUSED_MAX_ROWS", 30)  # the 37-token chunk is past it
    calls = []
    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    hidden_states(loaded, "bf16")
    assert len(calls) == 61  # the first step only: 2 norms a layer and the final one
    calls.clear()
    monkeypatch.setattr(llama, "FUSED_MAX_ROWS", 256)
    hidden_states(loaded, "int8")  # its page scales are written by the torch codec
    assert len(calls) == 61 * len(STEPS)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gemma3"])
def test_other_layer_kinds_answer_as_op_by_op(kind, tmp_path, monkeypatch):
    """Biases (Qwen2), QK-norm (Qwen3), post-norms, sliding windows with their own RoPE base and the
    hybrid pool (Gemma 3): the same tokens and logprobs, bit for bit, fused or not."""
    from tests.conftest import make_llm
    from tests.model.tiny_models import make_hf_model, write_gguf

    from kvserve import SamplingParams

    path = str(write_gguf(make_hf_model(kind), kind, tmp_path / f"{kind}.gguf"))
    prompts = [{"prompt_token_ids": [3 + (7 * i + 11 * j) % 2000 for j in range(n)]} for i, n in enumerate((40, 9))]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)

    def answers():
        llm = make_llm(model=path, dtype="native", page_size=PAGE, max_model_len=256, kv_cache_memory="16MiB")
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    calls = []
    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = answers()
    assert not calls  # every step ran fused
    monkeypatch.setattr(llama, "FUSED_MAX_ROWS", 0)
    assert answers() == fused
    assert calls


K_FORMATS = {"attn_q": GGMLQuantizationType.Q4_K, "attn_k": GGMLQuantizationType.Q4_K,
             "attn_v": GGMLQuantizationType.Q6_K, "attn_output": GGMLQuantizationType.Q5_0,
             "ffn_gate": GGMLQuantizationType.Q4_K, "ffn_up": GGMLQuantizationType.Q5_K,
             "ffn_down": GGMLQuantizationType.Q5_1}


def random_k_blocks(name: str, w: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType] | None:
    """Random blocks of a Q4_K_M-like mix for the layers' matrices (V in Q6_K, up in Q5_K; the output
    projection in Q5_0 and down in Q5_1, as llama.cpp falls back to for rows off the superblock), so a fused
    QKV and gate+up hold parts of two formats; each fp16 scale a small normal value."""
    qtype = next((q for key, q in K_FORMATS.items() if f".{key}." in name), None)
    if qtype is None or w.ndim != 2:
        return None
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, block_bytes), dtype=np.uint8)
    halves = rng.uniform(2e-4, 4e-4, blocks.shape[:2] + (2,)).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        blocks[..., 208:210] = halves[..., :2]  # d
    else:
        blocks[..., 0:4] = halves  # d, dmin (Q5_0: d and half its qh; Q5_1: d, m)
    return blocks.reshape(w.shape[0], -1), qtype


def kmix_answers(tmp_path):
    """A function answering two prompts (tokens and logprobs) on a tiny Llama whose layers hold random
    blocks of K_FORMATS' mix, and the loaded layers' formats (qkv's, gate_up's, o_proj's and down's)."""
    from tests.conftest import make_llm
    from tests.model.tiny_models import make_hf_model, write_gguf

    from kvserve import SamplingParams

    model = make_hf_model("llama3", hidden_size=256, intermediate_size=512, head_dim=64)
    path = str(write_gguf(model, "llama3", tmp_path / "kmix.gguf", store=random_k_blocks))
    prompts = [{"prompt_token_ids": [3 + (7 * i + 11 * j) % 2000 for j in range(n)]} for i, n in enumerate((30, 7))]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)

    def answers():
        llm = make_llm(model=path, dtype="native", page_size=PAGE, max_model_len=256, kv_cache_memory="16MiB")
        layer = llm.engine.runner.model.layers[0]
        formats = (layer.qkv.qtypes, layer.gate_up.qtypes, layer.o_proj.qtypes, layer.down.qtypes)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)], formats
    return answers


def test_parts_of_two_formats_answer_as_op_by_op(tmp_path, monkeypatch):
    """A fused QKV of Q4_K and Q6_K parts and a gate+up of Q4_K and Q5_K run as one call over the parts'
    rows side by side (matmul.cpp run_parts_direct): the same tokens and logprobs, bit for bit, as each
    part's own kvs_matmul on the per-op path."""
    answers = kmix_answers(tmp_path)
    fused, formats = answers()
    assert [len(f) for f in formats] == [2, 2, 1, 1]
    monkeypatch.setattr(llama, "FUSED_MAX_ROWS", 0)
    assert answers()[0] == fused


def test_interleaved_k_formats_answer_as_the_files_layout(tmp_path, monkeypatch):
    """The K formats' and Q5's rows interleaved at load for the decode rows (kernels/matmul.py interleave) give
    the file layout's tokens and logprobs, bit for bit, fused and op by op."""
    answers = kmix_answers(tmp_path)
    interleaved, formats = answers()
    assert formats == ([1012, 1014], [1012, 1013], [1006], [1007])  # Q4_K, Q6_K / Q4_K, Q5_K / Q5_0 / Q5_1: twins
    monkeypatch.setenv("KVSERVE_KERNELS_INTERLEAVE", "off")
    as_filed, formats = answers()
    assert formats == ([12, 14], [12, 13], [6], [7])
    assert as_filed == interleaved
    monkeypatch.setattr(llama, "FUSED_MAX_ROWS", 0)
    assert answers()[0] == interleaved
