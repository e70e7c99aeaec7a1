"""ctypes wrappers of the fused row-wise ops (src/ops.cpp) on float32 CPU tensors: RMSNorm (with an
optional residual add first), RoPE in the rotate-half layout with the query scale, and the gated MLP
activations. Each row's result is the same bits whatever the number of rows or threads."""

from __future__ import annotations

import torch

from kvserve.kernels import KernelLibrary
from kvserve.kernels.api import Activation


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., dim] -> (x, outer, inner, outer stride) for a [outer, inner, dim] view whose inner rows
    are contiguous (2-D: inner 1; 3-D: [T, heads, dim] with any token stride)."""
    if x.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) != x.shape[2]) or x.dim() not in (2, 3):
        x = x.contiguous()
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0)
    return x, x.shape[0], x.shape[1], x.stride(0)


def rms_norm(lib: KernelLibrary, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, dim] or [T, heads, dim] float32 -> x / rms(x) * weight (a new contiguous tensor). With
    `residual` [T, dim]: returns (x + residual, rms_norm(x + residual))."""
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.float32)
    total = None
    if residual is not None:
        x, residual = x.contiguous(), residual.contiguous()
        total = torch.empty_like(x)
    x, outer, inner, stride = _rows_view(x)
    lib.lib.kvs_rms_norm(x.data_ptr(), outer, inner, dim, stride, residual.data_ptr() if residual is not None else 0,
                     total.data_ptr() if total is not None else 0, weight.data_ptr(), eps, out.data_ptr(),
                     inner * dim, torch.get_num_threads())
    return out if total is None else (total, out)


def rope(lib: KernelLibrary, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaled_heads: int = 0,
         scale: float = 1.0) -> torch.Tensor:
    """x [T, heads, head_dim] (heads contiguous, any token stride); cos, sin [T, 1, head_dim] as
    model/llama.py's Rotary gives them -> a new [T, heads, head_dim], the first `scaled_heads` heads
    times `scale`."""
    tokens, heads, head_dim = x.shape
    x, _, _, stride = _rows_view(x)
    cos, sin = cos.reshape(tokens, head_dim).contiguous(), sin.reshape(tokens, head_dim).contiguous()
    out = torch.empty(tokens, heads, head_dim, dtype=torch.float32)
    lib.lib.kvs_rope(x.data_ptr(), tokens, heads, head_dim, stride, cos.data_ptr(), sin.data_ptr(), scaled_heads,
                     scale, out.data_ptr(), torch.get_num_threads())
    return out


def gated_activation(lib: KernelLibrary, x: torch.Tensor, activation: str) -> torch.Tensor:
    """x [T, 2 * inter] = [gate | up] -> act(gate) * up [T, inter]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=torch.float32)
    lib.lib.kvs_gated_act(x.data_ptr(), tokens, inter, x.stride(0), Activation[activation.upper()], out.data_ptr(),
                     torch.get_num_threads())
    return out
