"""ctypes wrapper of the fused decoder layers (src/ops_layers.cpp): a Llama-style model's layers and
final norm for a step's rows in one native call, made of the same kernel calls (same arguments) as
model/llama.py's per-op path, so the bits are the same. The weights' part of the arguments is made
once; a step fills in its rows, RoPE tables, attention rows and one scratch buffer (kept between steps)."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from kvserve.kernels import KernelLibrary
from kvserve.kernels.api import MAX_PARTS, STEP_SCRATCH, Activation, KvsLayer, KvsLinear, KvsStep
from kvserve.kernels.attention import CODECS, AttentionRows

KEPT_ROWS = 256  # a step's scratch is kept for the next up to this many rows (a prefill chunk's is not)


@dataclass(frozen=True, slots=True)
class LinearWeights:
    """One linear layer as the kernel reads it: (ggml type, blocks [rows, row bytes] uint8) parts
    stacked by rows, over `in_features` inputs."""

    parts: list[tuple[int, torch.Tensor]]
    in_features: int
    bias: torch.Tensor | None = None  # [out] float32


@dataclass(frozen=True, slots=True)
class LayerWeights:
    qkv: LinearWeights
    o_proj: LinearWeights
    gate_up: LinearWeights
    down: LinearWeights
    input_norm: torch.Tensor  # [hidden] float32
    post_attention_norm: torch.Tensor
    q_norm: torch.Tensor | None = None  # [head_dim] (QK-norm)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [hidden] (Gemma's norms of the attention and MLP outputs)
    mlp_out_norm: torch.Tensor | None = None
    windowed: bool = False  # attends the step's sliding-window rows, with the local RoPE tables if any


@dataclass(frozen=True, slots=True)
class Shapes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    q_scale: float  # queries' extra factor (RoPE's scaled heads)
    activation: str


def _linear(w: LinearWeights) -> KvsLinear:
    assert 1 <= len(w.parts) <= MAX_PARTS
    out = KvsLinear(num_parts=len(w.parts), in_features=w.in_features,
                  out_features=sum(int(b.shape[0]) for _, b in w.parts))
    for i, (qtype, blocks) in enumerate(w.parts):
        assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
        out.formats[i], out.weights[i], out.rows[i] = int(qtype), blocks.data_ptr(), int(blocks.shape[0])
    if w.bias is not None:
        out.bias = _floats(w.bias)
    return out


def _floats(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    assert t.dtype == torch.float32 and t.is_contiguous()
    return t.data_ptr()


class DecoderLayers:
    """The layers' weights as the native call reads them (made once: the tensors must not move);
    `run` executes one step's rows through every layer and the final norm."""

    def __init__(self, lib: KernelLibrary, layers: list[LayerWeights], final_norm: torch.Tensor, shapes: Shapes,
                 rope: tuple[torch.Tensor, torch.Tensor], local_rope: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """rope, local_rope: (cos, sin) tables [positions, head_dim / 2] float32 (model/llama.py's
        Rotary, widened per row by the native step); the windowed layers use local_rope when given."""
        self.fn = lib.lib.kvs_decoder_layers
        self.shapes = shapes
        self._keep = (layers, final_norm, rope, local_rope)  # the pointers below point into these
        self.layers = (KvsLayer * len(layers))()
        for dst, w in zip(self.layers, layers):
            dst.qkv, dst.o_proj, dst.gate_up, dst.down = (_linear(x) for x in (w.qkv, w.o_proj, w.gate_up, w.down))
            for name in ("input_norm", "post_attention_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"):
                setattr(dst, name, _floats(getattr(w, name)))
            dst.rows_set = int(w.windowed)
            dst.rope_set = int(w.windowed and local_rope is not None)
        self.qkv_width = max(layer.qkv.out_features for layer in self.layers)
        s = shapes
        self.step = KvsStep(num_layers=len(layers), hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads,
                          head_dim=s.head_dim, inter=s.inter, activation=Activation[s.activation.upper()], eps=s.eps,
                          q_scale=s.q_scale, attn_scale=s.head_dim ** -0.5, final_norm=_floats(final_norm))
        for i, tables in enumerate((rope, local_rope)):
            if tables is not None:
                self.step.cos_table[i], self.step.sin_table[i] = _floats(tables[0]), _floats(tables[1])
        qk = (s.heads + s.kv_heads) * s.head_dim
        widths = {"m": s.hidden, "normed": s.hidden, "qkv": self.qkv_width, "qk_normed": qk, "qk": qk,
                  "attn": s.heads * s.head_dim, "gate_up": 2 * s.inter, "act_out": s.inter, "out": s.hidden,
                  "cos": 2 * s.head_dim, "sin": 2 * s.head_dim}
        self.widths = [widths[n] for n in STEP_SCRATCH]
        self.row_floats = sum(self.widths)
        # kept from step to step up to KEPT_ROWS rows, as llama.cpp keeps its compute buffers (a decode step's
        # activations allocated afresh each step came from new pages); a longer chunk's (hundreds of MB at
        # 1-8B shapes) is made for its step and freed after: one allocation a step, on huge pages, where
        # the op-by-op path made one an op and faulted in fresh pages in every layer
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._lock = threading.Lock()  # engines that share a model (build_model's cache) share this step and scratch

    def run(self, x: torch.Tensor, codec: str, kv: list[tuple[torch.Tensor, torch.Tensor]], page_size: int,
            row_sets: list[tuple[AttentionRows, torch.Tensor, int | None]], num_threads: int) -> torch.Tensor:
        """x [T, hidden] float32 contiguous (the embeddings; overwritten: it holds the residual stream)
        -> the final norm's output [T, hidden]. kv: each layer's (K data, V data) pages of a codec
        whose write the attention kernel does (fp32, bf16). row_sets: (rows, slot_mapping [T] int64,
        window) for the full-attention layers, then (if any) for the windowed ones."""
        with self._lock:
            return self._run(x, codec, kv, page_size, row_sets, num_threads)

    def _run(self, x: torch.Tensor, codec: str, kv: list[tuple[torch.Tensor, torch.Tensor]], page_size: int,
             row_sets: list[tuple[AttentionRows, torch.Tensor, int | None]], num_threads: int) -> torch.Tensor:
        t = x.shape[0]
        assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == self.shapes.hidden
        if t > KEPT_ROWS:
            scratch = torch.empty(t * self.row_floats, dtype=torch.float32)
        else:
            if self._scratch.numel() < t * self.row_floats:
                self._scratch = torch.empty(0, dtype=torch.float32)  # (the old one freed before the new is made)
                self._scratch = torch.empty(t * self.row_floats, dtype=torch.float32)
            scratch = self._scratch
        step = self.step
        step.rows, step.page_size, step.codec, step.num_threads = t, page_size, CODECS[codec], num_threads
        step.h = x.data_ptr()
        for dst, (rows, slots, window) in zip(step.row_sets, row_sets):
            assert slots.dtype == torch.int64 and slots.is_contiguous()
            dst.positions, dst.table_offsets = rows.positions.data_ptr(), rows.table_offsets.data_ptr()
            dst.table_first, dst.tables = rows.table_first.data_ptr(), rows.tables.data_ptr()
            dst.slot_mapping, dst.window = slots.data_ptr(), window or 0
        address, out_at = scratch.data_ptr(), 0
        for name, width in zip(STEP_SCRATCH, self.widths):
            if name == "out":
                out_at = (address - scratch.data_ptr()) // 4
            setattr(step, name, address)
            address += 4 * t * width
        for layer, (k, v) in zip(self.layers, kv):
            layer.k_data, layer.v_data = k.data_ptr(), v.data_ptr()
        rc = self.fn(self.layers, ctypes.byref(step))
        if rc:
            raise RuntimeError(f"the fused decoder layers failed (kernel code {rc})")
        # a copy: the next step writes the scratch again while the caller may still hold this step's output
        return scratch[out_at:out_at + t * self.shapes.hidden].view(t, self.shapes.hidden).clone()
