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

from kvserve import kernels
from kvserve.config import ModelConfig
from kvserve.kernels import attention as native_attention, layers as native_layers, ops as native_ops
from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.gpu_attention import GpuAttentionMetadata
from kvserve.model.gguf_loader import GGUFTensor
from kvserve.model.kv_quant import PagedKV
from kvserve.model.linear import NativeLinear, WeightBuilder

# steps of up to this many rows (the default token budget's chunks) run every layer in one native call
# (kernels/layers.py) when the model and its KV codec allow; longer prefill chunks run op by op. Both
# give the same bits. Op by op, a chunk's intermediates over glibc's 32 MB mmap ceiling come from fresh
# pages in every layer (a 1.5B model's 1,547-token prefill: 22-36k page faults, 1.3-2.0 s of system
# time); the fused call makes one scratch a step (docs/performance.md, "the decode rows' own
# instruction set").
FUSED_MAX_ROWS = 2048


class RMSNorm(nn.Module):
    """RMSNorm with a float32 weight. Llama: one fused kernel (in float32 bit-identical to the
    reference's x * rsqrt(mean(x^2) + eps) * w). Gemma (offset 1): scales by (1 + w) in float32
    before casting back, as its reference does."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.is_offset = bool(offset)
        self.weight = nn.Parameter(weight.float() + offset, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, lib: kernels.KernelLibrary | None = None) -> torch.Tensor:
        if lib is not None:  # float32 on the CPU (the offset is folded into the weight)
            return native_ops.rms_norm(lib, x, self.weight, self.eps)
        if self.is_offset:
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
        if x.dtype == torch.float32:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return torch.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor, lib: kernels.KernelLibrary | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it): one native pass when `lib` is given."""
        if lib is not None:
            return native_ops.rms_norm(lib, x, self.weight, self.eps, residual=delta)
        h = x + delta
        return h, self(h)


class Rotary(nn.Module):
    """RoPE in the rotate-half (NeoX/HF) convention. The tables are computed in float32 (as the
    reference does) and stored in the compute dtype at half width, one column an angle: both halves of
    a head rotate by the same angles, so a full-width table held each value twice (Gemma 3's two
    32k-position tables: 128 MB). `forward` widens the rows it looks up (the native step does the
    same), `sin` carrying the rotation's sign in its first half, so applying RoPE needs no negation."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, freq_factors: tuple[float, ...] | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if freq_factors is not None:  # llama3 / linear RoPE scaling
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().to(device, dtype), persistent=False)  # [positions, head_dim / 2]
        self.register_buffer("sin", angles.sin().to(device, dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, signed sin), each [T, 1, head_dim]: looked up once per step."""
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat([cos, cos], -1)[:, None, :], torch.cat([-sin, sin], -1)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]: pairs (i, i + head_dim/2) rotate by the position's angle:
    out = x * cos + [-x2, x1] * sin, written [x2, x1] * [-sin, sin] (bit-identical)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, wb: WeightBuilder, prefix: str, eps: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        att, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"

        def norm(name: str) -> RMSNorm:
            return RMSNorm(wb.tensor(f"{name}.weight", torch.float32), eps, cfg.norm_weight_offset)

        self.input_norm = norm(f"{prefix}.input_layernorm")
        # the MLP's input norm: Llama calls it post_attention_layernorm, Gemma pre_feedforward_layernorm
        self.post_attention_norm = norm(f"{prefix}.pre_feedforward_layernorm" if cfg.post_norms
                                        else f"{prefix}.post_attention_layernorm")
        self.attn_out_norm = self.mlp_out_norm = self.q_norm = self.k_norm = None
        if cfg.post_norms:  # Gemma: norms on the attention and MLP outputs before the residual add
            self.attn_out_norm = norm(f"{prefix}.post_attention_layernorm")
            self.mlp_out_norm = norm(f"{prefix}.post_feedforward_layernorm")
        if cfg.qk_norm:  # one RMSNorm over each head's head_dim, shared by the heads
            self.q_norm, self.k_norm = norm(f"{att}.q_norm"), norm(f"{att}.k_norm")
        self.hidden_act = cfg.hidden_act
        self.act = _ACTIVATIONS[cfg.hidden_act]
        # SDPA scales by head_dim ** -0.5; queries carry the ratio when the model wants another scale
        scale = cfg.attention_scale if cfg.attention_scale is not None else self.head_dim ** -0.5
        self.q_scale = scale * self.head_dim ** 0.5
        # one matmul for Q, K and V: rows [q (heads*hd) | k (kvh*hd) | v (kvh*hd)]
        self.qkv = wb.linear([f"{att}.{p}_proj.weight" for p in "qkv"], [f"{att}.{p}_proj.bias" for p in "qkv"])
        self.o_proj = wb.linear([f"{att}.o_proj.weight"])
        # one matmul for gate and up: rows [gate (inter) | up (inter)]
        self.gate_up = wb.linear([f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"])
        self.down = wb.linear([f"{mlp}.down_proj.weight"])

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: PagedKV, v_cache: PagedKV, meta: AttentionMetadata, lib: kernels.KernelLibrary | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is x + residual (residual None: x), added in the input norm's pass.
        Returns (h, m): the next input is h + m, left to the next norm. `lib`: the native kernels run
        the norms, RoPE, the KV write and attention, and the activation (float32 on the CPU)."""
        t = x.shape[0]
        if residual is None:
            normed = self.input_norm(x, lib)
        else:
            x, normed = self.input_norm.add_forward(x, residual, lib)
        qkv = self.qkv(normed)  # [T, (H + 2 KVH) * hd]
        h_q, h_kv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q_size = h_q * hd
        # Q and K heads side by side get RoPE in one pass: [T, H + KVH, hd]
        qk = qkv[:, : (h_q + h_kv) * hd].view(t, h_q + h_kv, hd)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :h_q], lib), self.k_norm(qk[:, h_q:], lib)], dim=1)
        if lib is not None:
            qk = native_ops.rope(lib, qk, *rope, scaled_heads=h_q, scale=self.q_scale)
            q, k = qk[:, :h_q], qk[:, h_q:]
        else:
            qk = apply_rope(qk, *rope)
            q, k = qk[:, :h_q], qk[:, h_q:]  # [T, H, hd], [T, KVH, hd]
            if self.q_scale != 1.0:
                q = q * self.q_scale
        v = qkv[:, (h_q + h_kv) * hd :].view(t, h_kv, hd)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, lib)  # [T, H, hd]
        o = self.o_proj(attn.reshape(t, q_size))  # [T, hidden]
        h, normed = self.post_attention_norm.add_forward(
            x, o if self.attn_out_norm is None else self.attn_out_norm(o, lib), lib)

        gate_up = self.gate_up(normed)  # [T, 2 * inter]
        if lib is not None:
            m = self.down(native_ops.gated_activation(lib, gate_up, self.hidden_act))
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, inter] x2
            m = self.down(self.act(gate) * up)
        return h, (m if self.mlp_out_norm is None else self.mlp_out_norm(m, lib))


class LlamaModel(nn.Module):
    """Weights come from `LoadedModel.tensors` (HF names), built for weight mode `mode`
    (kvserve/model/linear.py) on `device`."""

    def __init__(
        self, cfg: ModelConfig, tensors: dict[str, GGUFTensor], mode: str = "float32",
        device: torch.device | str = "cpu", max_positions: int | None = None,
    ) -> None:
        """`max_positions`: the RoPE tables' rows (the engine's max_model_len; default the model's own
        context, 2 x 64 MiB of float32 tables for a 131,072-token Llama 3.1)."""
        super().__init__()
        self.config = cfg
        device = torch.device(device)
        wb = WeightBuilder(tensors, mode, device)
        self.dtype = wb.dtype
        eps = cfg.rms_norm_eps
        self.embed, tied_head = wb.embedding("model.embed_tokens.weight")  # [vocab, hidden]
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, wb, f"model.layers.{i}", eps) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(wb.tensor("model.norm.weight", torch.float32), eps, cfg.norm_weight_offset)
        self.lm_head = tied_head if cfg.tie_word_embeddings else wb.linear(["lm_head.weight"])
        positions = min(cfg.max_position_embeddings, max_positions or cfg.max_position_embeddings)
        self.rope = Rotary(cfg.head_dim, cfg.rope_theta, positions, device, self.dtype, cfg.rope_freq_factors)
        # Gemma's sliding-window layers use their own RoPE base, without the global scaling
        self.local_rope = None
        if cfg.rope_local_theta is not None:
            self.local_rope = Rotary(cfg.head_dim, cfg.rope_local_theta, positions, device, self.dtype)
        self.windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
        self._fused: dict[kernels.KernelLibrary, native_layers.DecoderLayers | None] = {}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata | GpuAttentionMetadata,
        window_meta: AttentionMetadata | GpuAttentionMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, hidden]. Sliding-window layers
        use `window_meta` (their own pool's block tables, hybrid allocator) or else `meta`."""
        x = self.embed(input_ids)  # [T, hidden]
        if self.config.embedding_scale != 1.0:  # HF multiplies by the scale cast to the model dtype
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        lib = kernels.library(x.shape[0]) if (x.dtype == torch.float32 and x.device.type == "cpu"
                                              and not isinstance(meta, GpuAttentionMetadata)) else None
        fused = self._fused_layers(lib, kv_caches, x) if lib is not None else None
        windowed = {w: (window_meta or meta).with_window(w) for w in set(self.windows) if w is not None}
        if fused is not None:  # x is the embedding's own fresh tensor: the call may overwrite it
            row_sets = [(m.rows_for_kernel(), m.slot_mapping.contiguous(), m.window) for m in (meta, *windowed.values())]
            return fused.run(x, kv_caches[0][0].codec.name, [(k.data, v.data) for k, v in kv_caches],
                             meta.page_size, row_sets, torch.get_num_threads())
        rope = self.rope(positions)
        local_rope = self.local_rope(positions) if self.local_rope is not None else rope
        residual = None  # each layer's output is x + residual, added by the next norm
        for layer, window, (k_cache, v_cache) in zip(self.layers, self.windows, kv_caches):
            if window is None:
                x, residual = layer(x, residual, rope, k_cache, v_cache, meta, lib)
            else:
                x, residual = layer(x, residual, local_rope, k_cache, v_cache, windowed[window], lib)
        return self.norm(x, lib) if residual is None else self.norm.add_forward(x, residual, lib)[1]

    def _fused_layers(self, lib: kernels.KernelLibrary, kv_caches: list[tuple[PagedKV, PagedKV]],
                      x: torch.Tensor) -> native_layers.DecoderLayers | None:
        """The one-call native layers for this step, or None: op by op. They cover every layer kind
        (QK-norm, post-norms, biases, one sliding-window size) whose linears run on `lib` (the same
        kernels the per-op path would call) over a KV codec the attention kernel writes itself."""
        codec = kv_caches[0][0].codec
        if (x.shape[0] > FUSED_MAX_ROWS or codec.name not in native_attention.WRITES
                or any(k.codec is not codec or v.codec is not codec for k, v in kv_caches)
                or not native_attention.supports(lib, codec.name, self.config.head_dim, x)):
            return None
        if lib not in self._fused:
            self._fused[lib] = self._build_fused(lib)
        return self._fused[lib]

    def _build_fused(self, lib: kernels.KernelLibrary) -> native_layers.DecoderLayers | None:
        def weights(m: nn.Module) -> native_layers.LinearWeights | None:
            if not isinstance(m, NativeLinear) or lib not in m.libraries or len(m.qtypes) > native_layers.MAX_PARTS:
                return None
            return native_layers.LinearWeights([(q, m.blocks(i)) for i, q in enumerate(m.qtypes)], m.in_features,
                                               m.bias)

        def weight(norm: RMSNorm | None) -> torch.Tensor | None:
            return None if norm is None else norm.weight

        if len({w for w in self.windows if w is not None}) > 1:
            return None
        layers = []
        for layer, window in zip(self.layers, self.windows):
            linears = [weights(m) for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            if None in linears:
                return None
            layers.append(native_layers.LayerWeights(
                *linears, layer.input_norm.weight, layer.post_attention_norm.weight, weight(layer.q_norm),
                weight(layer.k_norm), weight(layer.attn_out_norm), weight(layer.mlp_out_norm), window is not None))
        first, cfg = self.layers[0], self.config
        shapes = native_layers.Shapes(cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                                      first.down.in_features, self.norm.eps, first.q_scale, first.hidden_act)
        local = self.local_rope
        return native_layers.DecoderLayers(lib, layers, self.norm.weight, shapes, (self.rope.cos, self.rope.sin),
                                           None if local is None else (local.cos, local.sin))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden.contiguous()).float()
