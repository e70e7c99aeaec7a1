"""Synthetic models: GGUF files with random weights but a real model's exact tensor names, shapes, quant
type per tensor and metadata, so speed is measured at 1-8B shapes without a download
(`--model synthetic:qwen2.5-1.5b-q4_k_m`). Speed does not depend on the weights' values; quality
figures stay on real models.

    SHAPES (ModelConfig, from each model's config.json) x QuantMix (llama.cpp's per-tensor rule)
      -> tensor_specs(): [TensorSpec(name, shape, ggml type)]
      -> build(): metadata and tensor table, then each tensor streamed in chunks of random blocks whose
         fp16 scales are set small and positive (the weights come out at a real model's magnitude,
         so every activation stays finite); a temp file beside the target, renamed when complete

The tokenizer is the bundled SmolLM2's byte-level BPE (llama.cpp and kvserve both load it), its token
list padded with unused "[PAD<i>]" tokens up to the real vocabulary size, as llama.cpp's converter
pads Qwen's, so token_embd and output keep their real shapes."""

from __future__ import annotations

import enum
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGUFWriter, LlamaFileType, TokenType
from gguf import GGMLQuantizationType as Q

from kvserve.config import ConfigError, ModelConfig
from kvserve.model.architectures import ROPE_FREQS, rope_freq_factors
from kvserve.model.gguf_file import GGUFFile

__all__ = ["SHAPES", "QuantMix", "SyntheticSpec", "TensorSpec", "build", "file_bytes", "parameter_count",
           "synthetic_names", "synthetic_spec", "tensor_specs"]


class QuantMix(enum.Enum):
    Q4_K_M = "q4_k_m"  # Q4_K, with Q6_K on the lm_head and on half the attn_v and ffn_down tensors
    Q8_0 = "q8_0"  # every matrix Q8_0


def _llama3_rope(factor: float, head_dim: int = 128, theta: float = 500000.0) -> tuple[float, ...] | None:
    """The rope_freqs of config.json's rope_scaling {"rope_type": "llama3", "factor": factor, ...}."""
    return rope_freq_factors({"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, head_dim, theta)


# From each model's config.json. A qwen2 model has q/k/v biases (llama.cpp requires them); llama none.
SHAPES = {
    "qwen2.5-1.5b": ModelConfig("Qwen2.5-1.5B-Instruct", vocab_size=151936, hidden_size=1536,
                                intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                                rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                                tie_word_embeddings=True, architecture="qwen2"),
    "llama-3.2-3b": ModelConfig("Llama-3.2-3B-Instruct", vocab_size=128256, hidden_size=3072,
                                intermediate_size=8192, num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
                                rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                                tie_word_embeddings=True, rope_freq_factors=_llama3_rope(32.0)),
    "llama-3.1-8b": ModelConfig("Llama-3.1-8B-Instruct", vocab_size=128256, hidden_size=4096,
                                intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                                rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                                tie_word_embeddings=False, rope_freq_factors=_llama3_rope(8.0)),
}


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    name: str  # e.g. "qwen2.5-1.5b-q4_k_m"
    config: ModelConfig  # llama or qwen2: what kvserve reads back from the file, but for the name
    mix: QuantMix
    control_tokens: tuple[str, ...] = ()  # the first padding tokens' names instead (control tokens: FIM's)

    @property
    def file_name(self) -> str:
        return f"synthetic-{self.name}.gguf"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order (rows, columns): the columns are GGUF's innermost dimension
    qtype: Q

    @property
    def n_bytes(self) -> int:
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * block_bytes


def synthetic_names() -> list[str]:
    return [f"{shape}-{mix.value}" for shape in SHAPES for mix in QuantMix]


def synthetic_spec(name: str) -> SyntheticSpec:
    """The spec of `synthetic:NAME`'s NAME: a SHAPES key, a dash, a QuantMix value."""
    key = name.lower()
    for shape_name, config in SHAPES.items():
        for mix in QuantMix:
            if key == f"{shape_name}-{mix.value}":
                return SyntheticSpec(key, config, mix)
    raise ConfigError(f"unknown synthetic model {name!r}; known: "
                      + ", ".join(f"synthetic:{n}" for n in synthetic_names()))


def _use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's llama-quant.cpp: the first and last eighth of the layers, and every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def _matrix_type(role: str, layer: int, spec: SyntheticSpec) -> Q:
    """llama.cpp's llama_tensor_get_type for the mix; `role` is the GGUF name less "blk.N." and ".weight".
    A tied token_embd is the lm_head too, so it gets the output's type."""
    if spec.mix is QuantMix.Q8_0:
        return Q.Q8_0
    if role == "output" or (role == "token_embd" and spec.config.tie_word_embeddings):
        return Q.Q6_K
    if role in ("attn_v", "ffn_down") and _use_more_bits(layer, spec.config.num_layers):
        return Q.Q6_K
    return Q.Q4_K


def tensor_specs(spec: SyntheticSpec) -> list[TensorSpec]:
    """Every tensor of the file, in the order llama.cpp's converter writes them."""
    s = spec.config
    h, f = s.hidden_size, s.intermediate_size
    q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    if s.architecture not in ("llama", "qwen2"):
        raise ValueError(f"{s.name}: synthetic models are llama or qwen2, not {s.architecture}")
    for dim in (h, f, q_dim):
        if dim % 256:  # K-quant blocks span 256 columns (llama.cpp would fall back to another type)
            raise ValueError(f"{s.name}: dimension {dim} is not a multiple of 256")
    specs = [TensorSpec(ROPE_FREQS, (s.head_dim // 2,), Q.F32)] if s.rope_freq_factors else []
    specs.append(TensorSpec("token_embd.weight", (s.vocab_size, h), _matrix_type("token_embd", 0, spec)))
    for i in range(s.num_layers):
        def matrix(role: str, rows: int, cols: int) -> TensorSpec:
            return TensorSpec(f"blk.{i}.{role}.weight", (rows, cols), _matrix_type(role, i, spec))

        specs.append(TensorSpec(f"blk.{i}.attn_norm.weight", (h,), Q.F32))
        for role, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            specs.append(matrix(role, rows, h))
            if s.architecture == "qwen2":
                specs.append(TensorSpec(f"blk.{i}.{role}.bias", (rows,), Q.F32))
        specs.append(matrix("attn_output", h, q_dim))
        specs.append(TensorSpec(f"blk.{i}.ffn_norm.weight", (h,), Q.F32))
        specs += [matrix("ffn_gate", f, h), matrix("ffn_up", f, h), matrix("ffn_down", h, f)]
    specs.append(TensorSpec("output_norm.weight", (h,), Q.F32))
    if not s.tie_word_embeddings:
        specs.append(TensorSpec("output.weight", (s.vocab_size, h), _matrix_type("output", 0, spec)))
    return specs


def parameter_count(spec: SyntheticSpec) -> int:
    """The model's parameters as its card counts them (rope_freqs is not one)."""
    return sum(int(np.prod(t.shape)) for t in tensor_specs(spec) if t.name != ROPE_FREQS)


def file_bytes(spec: SyntheticSpec) -> int:
    """The bytes of tensor data (the file is this plus ~2 MB of metadata and tokenizer)."""
    return sum(t.n_bytes for t in tensor_specs(spec))


# Where each block's fp16 scales sit (bytes from its start) and the range they are drawn from: the
# weights come out with a std of ~0.03-0.1, as in real models. Q4_K is d*sc*q - dmin*m (sc, m: 6 bits,
# q: 4 bits): dmin ~7.5x d centres it on 0. Q6_K's int8 scales times (q - 32) are wide already.
_SCALES = {
    Q.Q4_K: ((0, 1e-4, 2e-4), (2, 7.5e-4, 1.5e-3)),  # d, dmin
    Q.Q6_K: ((208, 6.2e-5, 1.2e-4),),  # d (after ql, qh and scales)
    Q.Q8_0: ((0, 2e-4, 4e-4),),  # d
}
_CHUNK_BYTES = 32 << 20


def _write_random_blocks(out: BinaryIO, t: TensorSpec, rng: np.random.Generator) -> None:
    block_bytes = GGML_QUANT_SIZES[t.qtype][1]
    num_blocks, chunk = t.n_bytes // block_bytes, max(1, _CHUNK_BYTES // block_bytes)
    for start in range(0, num_blocks, chunk):
        n = min(chunk, num_blocks - start)
        words = rng.bit_generator.random_raw(-(-n * block_bytes // 8))  # uint64: the fastest source
        blocks = words.view(np.uint8)[:n * block_bytes].reshape(n, block_bytes)
        for offset, low, high in _SCALES[t.qtype]:
            scales = rng.uniform(low, high, n).astype(np.float16)
            blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(n, 2)
        blocks.tofile(out)


def _float_data(t: TensorSpec, s: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    if t.name == ROPE_FREQS:
        return np.asarray(s.rope_freq_factors, dtype=np.float32)
    if t.name.endswith(".bias"):
        return rng.normal(0.0, 0.02, t.shape).astype(np.float32)
    return np.ones(t.shape, dtype=np.float32)  # RMSNorm weights


def _add_metadata(w: GGUFWriter, spec: SyntheticSpec) -> None:
    s = spec.config
    w.add_name(f"synthetic {spec.name}")
    w.add_basename(f"synthetic-{spec.name}")
    w.add_description(f"random weights with the tensor shapes, quant types and metadata of {s.name} "
                      f"{spec.mix.value.upper()}: for speed measurements only (kvserve synthetic.py)")
    w.add_file_type(LlamaFileType.MOSTLY_Q4_K_M if spec.mix is QuantMix.Q4_K_M else LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(GGML_QUANT_VERSION)
    w.add_context_length(s.max_position_embeddings)
    w.add_embedding_length(s.hidden_size)
    w.add_block_count(s.num_layers)
    w.add_feed_forward_length(s.intermediate_size)
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    if s.architecture == "llama":  # as llama.cpp's converter writes Llama 3
        w.add_vocab_size(s.vocab_size)
        w.add_rope_dimension_count(s.head_dim)


def _add_tokenizer(w: GGUFWriter, fields: dict[str, Any], vocab_size: int, control: tuple[str, ...] = ()) -> None:
    """The tokenizer keys of `fields` (the bundled GGUF's), the token list padded to `vocab_size`, the
    first pads named by `control` (control tokens)."""
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    if vocab_size < len(tokens) + len(control):
        raise ValueError(f"vocabulary of {vocab_size} is smaller than the tokenizer's {len(tokens) + len(control)} "
                         "tokens")
    pads = range(len(tokens) + len(control), vocab_size)
    w.add_tokenizer_model(fields["tokenizer.ggml.model"])
    w.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    w.add_token_list(tokens + list(control) + [f"[PAD{i}]" for i in pads])
    # CONTROL: matched whole, as special tokens; UNUSED: never matched in text
    w.add_token_types(types + [TokenType.CONTROL] * len(control) + [TokenType.UNUSED] * len(pads))
    w.add_token_merges(fields["tokenizer.ggml.merges"])
    for key in ("bos", "eos", "unknown", "padding"):
        if (value := fields.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    for key in ("add_bos_token", "add_space_prefix"):
        if (value := fields.get(f"tokenizer.ggml.{key}")) is not None:
            w.add_bool(f"tokenizer.ggml.{key}", value)
    if (template := fields.get("tokenizer.chat_template")) is not None:
        w.add_chat_template(template)


def build(spec: SyntheticSpec, target: Path, tokenizer_path: str, seed: int = 0) -> Path:
    """Write `spec`'s file at `target`: a temp file beside it, renamed when complete. The same seed
    gives the same bytes. `tokenizer_path`: a GGUF whose byte-level BPE tokenizer is copied."""
    tensors = tensor_specs(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    started = time.monotonic()
    print(f"kvserve: building synthetic:{spec.name} ({file_bytes(spec) / 1e9:.2f} GB of random weights) "
          f"into {target} ...", end="", file=sys.stderr, flush=True)
    w = GGUFWriter(str(tmp), spec.config.architecture)
    try:
        _add_metadata(w, spec)
        _add_tokenizer(w, GGUFFile(tokenizer_path).fields, spec.config.vocab_size, spec.control_tokens)
        for t in tensors:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        out = w.fout[0]
        w.write_padding(out, out.tell())  # the data section starts aligned; each tensor is padded after
        for t in tensors:
            rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
            if t.qtype == Q.F32:
                _float_data(t, spec.config, rng).tofile(out)
            else:
                _write_random_blocks(out, t, rng)
            w.write_padding(out, t.n_bytes)
        out.flush()
        os.fsync(out.fileno())
        w.close()
        os.replace(tmp, target)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        print(" failed", file=sys.stderr)
        raise
    print(f" done in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return target
