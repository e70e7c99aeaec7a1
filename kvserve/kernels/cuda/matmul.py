"""A batch-invariant linear layer in Triton: y = x @ w^T + b with one tile shape and one reduction
order for every batch size, so a row's output bits never depend on how many rows share the call.

cuBLAS picks its algorithm (tile shape, split-K) from the problem's shape, so the same row can come
out with different rounding in a batch of 1 and a batch of 64: a greedy answer could change with
its batch neighbours. Here every output element is the float32 sum over K in BLOCK_K steps, always
in the same order, whatever M is (bf16 on CUDA: tensor-core products; float32: IEEE products, never
tf32; Triton's interpreter, which mishandles bf16 dots, gets the bf16 values as float32 products); the price is speed on large prefill batches (the torch path stays
available: KVSERVE_GPU_MATMUL=cublas).
"""

from __future__ import annotations

import torch

from kvserve.kernels.cuda import triton_module

triton = triton_module()
import triton.language as tl  # noqa: E402  (after the interpreter switch)

# one tile for every call: changing these changes bits (never by M, which is the point)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_row, w_row, y_row,
    HAS_BIAS: tl.constexpr, FLOAT32_DOT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_row + (k0 + ks)[None, :],
                    mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * w_row + (k0 + ks)[None, :],
                    mask=(cols[:, None] < N) & k_ok[None, :], other=0.0)
        if FLOAT32_DOT:  # float32 products (exact for bf16 inputs), not tf32
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * y_row + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, batch-invariant."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("weight's rows must be contiguous")
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](x2, weight, bias if bias is not None else weight, y, m, n, k,
                             x2.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                             FLOAT32_DOT=x.dtype == torch.float32 or not x.is_cuda,
                             BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return y.view(*lead, n)
