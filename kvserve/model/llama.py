"""The Llama-family decoder (SmolLM2, Llama 3, Qwen2/3, Gemma 3) in plain torch over a paged KV cache.

One step runs a flat batch of T tokens from many sequences: tokens -> embedding -> N x (RMSNorm,
attention with RoPE over the paged cache, RMSNorm, SiLU MLP) -> final RMSNorm. Logits are computed
separately, only for the rows that get sampled. ModelConfig options add QK-norm, post-norms, a
gelu-tanh MLP, an embedding scale, and sliding-window layers with their own RoPE base (Gemma 3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.model.attention import AttentionMetadata, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        # Gemma scales by (1 + w) in float32 before casting back; Llama casts first, then scales by w
        self.is_offset = bool(offset)
        self.weight = nn.Parameter(weight.float() + offset if offset else weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in float32 whatever the model dtype, as the reference does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.is_offset:
            return (xf * self.weight).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """RoPE in the rotate-half (NeoX/HF) convention, cos/sin tables precomputed in float32."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device,
                 freq_factors: tuple[float, ...] | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if freq_factors is not None:  # llama3 / linear RoPE scaling
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)  # [max_pos, head_dim]
        self.register_buffer("cos", angles.cos().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_dim]: looked up once per step, used by every layer."""
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]: pairs (i, i + head_dim/2) rotate by the position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, eps: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        att, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        off = cfg.norm_weight_offset
        self.input_norm = RMSNorm(w[f"{prefix}.input_layernorm.weight"], eps, off)
        # the MLP's input norm: Llama calls it post_attention_layernorm, Gemma pre_feedforward_layernorm
        mlp_norm = "pre_feedforward_layernorm" if cfg.post_norms else "post_attention_layernorm"
        self.post_attention_norm = RMSNorm(w[f"{prefix}.{mlp_norm}.weight"], eps, off)
        self.attn_out_norm = self.mlp_out_norm = self.q_norm = self.k_norm = None
        if cfg.post_norms:  # Gemma: norms on the attention and MLP outputs before the residual add
            self.attn_out_norm = RMSNorm(w[f"{prefix}.post_attention_layernorm.weight"], eps, off)
            self.mlp_out_norm = RMSNorm(w[f"{prefix}.post_feedforward_layernorm.weight"], eps, off)
        if cfg.qk_norm:  # one RMSNorm over each head's head_dim, shared by the heads
            self.q_norm = RMSNorm(w[f"{att}.q_norm.weight"], eps, off)
            self.k_norm = RMSNorm(w[f"{att}.k_norm.weight"], eps, off)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        # SDPA scales by head_dim ** -0.5; queries carry the ratio when the model wants another scale
        scale = cfg.attention_scale if cfg.attention_scale is not None else self.head_dim ** -0.5
        self.q_scale = scale * self.head_dim ** 0.5
        # one matmul for Q, K and V: rows [q (heads*hd) | k (kvh*hd) | v (kvh*hd)]
        self.qkv = nn.Parameter(torch.cat([w[f"{att}.{p}_proj.weight"] for p in "qkv"]), requires_grad=False)
        bias = [w.get(f"{att}.{p}_proj.bias") for p in "qkv"]
        self.qkv_bias = None
        if any(b is not None for b in bias):
            rows = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
            bias = [b if b is not None else torch.zeros(r) for b, r in zip(bias, rows)]
            self.qkv_bias = nn.Parameter(torch.cat(bias), requires_grad=False)
        self.o_proj = nn.Parameter(w[f"{att}.o_proj.weight"], requires_grad=False)
        # one matmul for gate and up: rows [gate (inter) | up (inter)]
        self.gate_up = nn.Parameter(
            torch.cat([w[f"{mlp}.gate_proj.weight"], w[f"{mlp}.up_proj.weight"]]), requires_grad=False
        )
        self.down = nn.Parameter(w[f"{mlp}.down_proj.weight"], requires_grad=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
        v_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = F.linear(self.input_norm(x), self.qkv, self.qkv_bias)  # [T, (H + 2 KVH) * hd]
        h_q, h_kv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q_size = h_q * hd
        # Q and K heads side by side get RoPE in one pass: [T, H + KVH, hd]
        qk = qkv[:, : (h_q + h_kv) * hd].view(t, h_q + h_kv, hd)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :h_q]), self.k_norm(qk[:, h_q:])], dim=1)
        qk = apply_rope(qk, *rope)
        q, k = qk[:, :h_q], qk[:, h_q:]  # [T, H, hd], [T, KVH, hd]
        if self.q_scale != 1.0:
            q = q * self.q_scale
        v = qkv[:, (h_q + h_kv) * hd :].view(t, h_kv, hd)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta)  # [T, H, hd]
        o = F.linear(attn.reshape(t, q_size), self.o_proj)  # [T, hidden]
        h = x + (o if self.attn_out_norm is None else self.attn_out_norm(o))

        gate, up = F.linear(self.post_attention_norm(h), self.gate_up).chunk(2, dim=-1)  # [T, inter] x2
        m = F.linear(self.act(gate) * up, self.down)
        return h + (m if self.mlp_out_norm is None else self.mlp_out_norm(m))


class LlamaModel(nn.Module):
    """Weights come from `LoadedModel.weights` (HF names); converted to `dtype` on `device`."""

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = cfg
        device = torch.device(device)
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        eps = cfg.rms_norm_eps
        self.embed = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)  # [vocab, hidden]
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, w, f"model.layers.{i}", eps) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(w["model.norm.weight"], eps, cfg.norm_weight_offset)
        lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = lm_head if isinstance(lm_head, nn.Parameter) else nn.Parameter(lm_head, requires_grad=False)
        self.rope = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device,
                           cfg.rope_freq_factors)
        # Gemma's sliding-window layers use their own RoPE base, without the global scaling
        self.local_rope = None
        if cfg.rope_local_theta is not None:
            self.local_rope = Rotary(cfg.head_dim, cfg.rope_local_theta, cfg.max_position_embeddings, device)
        self.windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, hidden]."""
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        if self.config.embedding_scale != 1.0:  # HF multiplies by the scale cast to the model dtype
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        rope = self.rope(positions, x.dtype)
        local_rope = self.local_rope(positions, x.dtype) if self.local_rope is not None else rope
        windowed = {w: meta.with_window(w) for w in set(self.windows) if w is not None}  # once per step
        for layer, window, (k_cache, v_cache) in zip(self.layers, self.windows, kv_caches):
            if window is None:
                x = layer(x, rope, k_cache, v_cache, meta)
            else:
                x = layer(x, local_rope, k_cache, v_cache, windowed[window])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        return F.linear(hidden, self.lm_head).float()
