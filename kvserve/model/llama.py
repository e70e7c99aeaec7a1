"""The Llama-family decoder (SmolLM2, Llama, Qwen2) in plain torch over a paged KV cache.

One step runs a flat batch of T tokens from many sequences: tokens -> embedding -> N x (RMSNorm,
attention with RoPE over the paged cache, RMSNorm, SiLU MLP) -> final RMSNorm. Logits are computed
separately, only for the rows that get sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig
from kvserve.model.attention import AttentionMetadata, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in float32 whatever the model dtype, as the reference does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """RoPE in the rotate-half (NeoX/HF) convention, cos/sin tables precomputed in float32."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
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


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, eps: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        att, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        self.input_norm = RMSNorm(w[f"{prefix}.input_layernorm.weight"], eps)
        self.post_attention_norm = RMSNorm(w[f"{prefix}.post_attention_layernorm.weight"], eps)
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
        qk = apply_rope(qkv[:, : (h_q + h_kv) * hd].view(t, h_q + h_kv, hd), *rope)
        q, k = qk[:, :h_q], qk[:, h_q:]  # [T, H, hd], [T, KVH, hd]
        v = qkv[:, (h_q + h_kv) * hd :].view(t, h_kv, hd)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta)  # [T, H, hd]
        h = x + F.linear(attn.reshape(t, q_size), self.o_proj)  # [T, hidden]

        gate, up = F.linear(self.post_attention_norm(h), self.gate_up).chunk(2, dim=-1)  # [T, inter] x2
        return h + F.linear(F.silu(gate) * up, self.down)


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
        self.norm = RMSNorm(w["model.norm.weight"], eps)
        lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = lm_head if isinstance(lm_head, nn.Parameter) else nn.Parameter(lm_head, requires_grad=False)
        self.rope = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, hidden]."""
        x = F.embedding(input_ids, self.embed)  # [T, hidden]
        rope = self.rope(positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, rope, k_cache, v_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        return F.linear(hidden, self.lm_head).float()
