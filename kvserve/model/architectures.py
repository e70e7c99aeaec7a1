"""Per-architecture knowledge (llama, qwen2, qwen3, gemma3): GGUF metadata or a HF config.json ->
ModelConfig, GGUF tensor names -> HF names, and the token texts that end a turn."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import ConfigError, ModelConfig

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N."), shared by all architectures
_COMMON_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
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
_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_LLAMA_FFN_NORM = {"ffn_norm.weight": "post_attention_layernorm.weight"}  # the MLP's input norm
_GEMMA_NORMS = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",  # Gemma's ffn_norm is the MLP's input norm
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # on the attention output
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",  # on the MLP output
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling factors, one per frequency (not a weight)


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # GGUF general.architecture
    hf_model_types: tuple[str, ...]
    layer_names: dict[str, str]
    permuted_qk: bool = False  # llama.cpp's converter permuted Q/K rows for its interleaved RoPE
    gguf_norm_offset: float = 0.0  # llama.cpp stores (offset + w) for Gemma's (1 + w) norms
    stop_texts: tuple[str, ...] = ()  # control tokens that end a turn besides the EOS id
    options: dict[str, Any] = field(default_factory=dict)  # fixed ModelConfig options

    def hf_name(self, gguf_name: str) -> str | None:
        if gguf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[gguf_name]
        parts = gguf_name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in self.layer_names:
            return f"model.layers.{parts[1]}.{self.layer_names[parts[2]]}"
        return None


ARCHITECTURES = {
    a.name: a for a in (
        Architecture("llama", ("llama",), _COMMON_LAYER_NAMES | _LLAMA_FFN_NORM, permuted_qk=True,
                     stop_texts=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")),
        Architecture("qwen2", ("qwen2",), _COMMON_LAYER_NAMES | _LLAMA_FFN_NORM,
                     stop_texts=("<|im_end|>", "<|endoftext|>")),
        Architecture("qwen3", ("qwen3",), _COMMON_LAYER_NAMES | _LLAMA_FFN_NORM | _QK_NORM_NAMES,
                     stop_texts=("<|im_end|>", "<|endoftext|>"), options={"qk_norm": True}),
        Architecture("gemma3", ("gemma3_text", "gemma3"), _COMMON_LAYER_NAMES | _QK_NORM_NAMES | _GEMMA_NORMS,
                     gguf_norm_offset=1.0, stop_texts=("<end_of_turn>", "<eos>"),
                     options={"qk_norm": True, "post_norms": True, "norm_weight_offset": 1.0,
                              "hidden_act": "gelu_tanh"}),
    )
}
GEMMA_LOCAL_ROPE_THETA = 10_000.0
GEMMA_SLIDING_PATTERN = 6  # five sliding-window layers, then one global


def architecture(name: str | None) -> Architecture:
    """The Architecture of a GGUF `general.architecture` or a HF `model_type`."""
    for arch in ARCHITECTURES.values():
        if name == arch.name or name in arch.hf_model_types:
            return arch
    raise ConfigError(
        f"architecture {name!r} is not supported; kvserve runs {', '.join(sorted(ARCHITECTURES))}"
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str],
                     rope_freqs: list[float] | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata; `rope_freqs` is the `rope_freqs.weight` tensor if present."""
    arch = architecture(meta.get("general.architecture"))
    a = arch.name

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{a}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    num_layers = int(get("block_count"))
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    options: dict[str, Any] = dict(arch.options)
    factors = tuple(float(f) for f in rope_freqs) if rope_freqs is not None else None
    if factors is None and get("rope.scaling.type") == "linear":
        factors = (float(get("rope.scaling.factor", 1.0)),) * (head_dim // 2)
    if a == "gemma3":
        # llama.cpp: query_pre_attn_scalar is head_dim, except Gemma 3 27B (62 layers): hidden / heads
        scalar = hidden // heads if num_layers == 62 else head_dim
        window = get("attention.sliding_window")
        options |= dict(
            embedding_scale=math.sqrt(hidden), attention_scale=scalar ** -0.5,
            sliding_window=int(window) if window else None,
            sliding_layers=tuple((i + 1) % GEMMA_SLIDING_PATTERN != 0 for i in range(num_layers)),
            rope_local_theta=GEMMA_LOCAL_ROPE_THETA,
        )
    return ModelConfig(
        name=str(meta.get("general.basename") or meta.get("general.name") or a),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        architecture=a,
        rope_freq_factors=factors,
        **options,
    )


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a HF config.json (transformers 4 `rope_theta`/`rope_scaling` or 5 `rope_parameters`)."""
    if cfg.get("model_type") == "gemma3" and "text_config" in cfg:
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    arch = architecture(cfg.get("model_type"))
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    num_layers = int(cfg["num_hidden_layers"])
    rope = cfg.get("rope_parameters") or {}
    if arch.name == "gemma3" and "full_attention" in rope:
        global_rope, local_rope = rope["full_attention"], rope.get("sliding_attention", {})
    else:
        global_rope, local_rope = rope, {}
    global_rope = {**(cfg.get("rope_scaling") or {}), **global_rope}
    theta = float(global_rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    options: dict[str, Any] = dict(arch.options)
    if arch.name == "gemma3":
        layer_types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", GEMMA_SLIDING_PATTERN) == 0
            else "sliding_attention" for i in range(num_layers)]
        options |= dict(
            embedding_scale=math.sqrt(hidden),
            attention_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            sliding_window=cfg.get("sliding_window"),
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            rope_local_theta=float(local_rope.get("rope_theta", cfg.get("rope_local_base_freq",
                                                                        GEMMA_LOCAL_ROPE_THETA))),
        )
    return ModelConfig(
        name=str(cfg.get("_name_or_path") or arch.name),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.name == "gemma3")),
        architecture=arch.name,
        rope_freq_factors=rope_freq_factors(global_rope, head_dim, theta),
        **options,
    )


def rope_freq_factors(scaling: dict[str, Any], head_dim: int, theta: float) -> tuple[float, ...] | None:
    """Per-frequency divisors of the RoPE inverse frequencies for a HF rope_scaling dict, computed
    as llama.cpp's converter writes `rope_freqs` (llama3) or a constant (linear); None: no scaling."""
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    factor = float(scaling["factor"])
    if kind == "linear":
        return (factor,) * (head_dim // 2)
    if kind != "llama3":
        raise ConfigError(f"RoPE scaling {kind!r} is not supported (kvserve knows linear and llama3)")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def stop_token_ids(arch_name: str, eos_ids: list[int | None], tokens: list[str],
                   token_types: list[int] | None = None) -> tuple[int, ...]:
    """EOS ids plus the architecture's end-of-turn control tokens found in the vocabulary."""
    ids = [i for i in eos_ids if i is not None]
    stop_texts = architecture(arch_name).stop_texts
    by_text = {t: i for i, t in enumerate(tokens) if t in stop_texts}
    for text, i in by_text.items():
        if token_types is None or token_types[i] == 3:  # llama.cpp type 3: control token
            ids.append(i)
    return tuple(dict.fromkeys(int(i) for i in ids))
