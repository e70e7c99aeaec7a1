"""Paged attention in Triton: every query row (decode and prefill alike) attends the keys of its own
sequence straight from the KV pages its block table names, one page at a time, with an online
softmax. No page is gathered into a dense copy first.

One program per (query row, KV head) computes that KV head's G query heads (GQA) together:

    for page in block_table[first_page .. pos // page_size]:       in this fixed order
        K, V = cache[page]                      [page_size, head_dim] each, decoded to float32
        scores = q . K^T, keys outside [key_start, pos] masked
        running max / sum / output rescaled (flash-attention's online softmax)

A row's output depends on its query, its position and the stored pages only: never on the other
rows of the step (batch neighbours, prefill chunking, a prefix hit), which keeps greedy answers the
same bits whatever the batch holds. fp8 pages are decoded through a 256-entry table of byte ->
value * scale, as the CPU paths decode them.
"""

from __future__ import annotations

import torch

from kvserve.kernels.cuda import triton_module

triton = triton_module()
import triton.language as tl  # noqa: E402  (after the interpreter switch)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, positions_ptr, seq_of_row_ptr, tables_ptr, k_lut_ptr, v_lut_ptr,
    sm_scale, window,
    q_row, q_head, k_page, k_slot, k_head, v_page, v_slot, v_head, o_row, o_head, table_row,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, USE_LUT: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    seq = tl.load(seq_of_row_ptr + row).to(tl.int64)
    key_start = pos * 0
    if window > 0:  # a sliding-window layer: keys at positions > pos - window
        key_start = tl.maximum(pos - window + 1, 0)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, PAGE_SIZE)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * q_row + heads[:, None] * q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * sm_scale  # [G, D]

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for logical in range(key_start // PAGE_SIZE, pos // PAGE_SIZE + 1):
        page = tl.load(tables_ptr + seq * table_row + logical).to(tl.int64)
        key_pos = logical * PAGE_SIZE + n
        valid = (key_pos >= key_start) & (key_pos <= pos)
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page * k_page + n[:, None] * k_slot + kv_head * k_head + d[None, :],
                    mask=kv_mask, other=0)
        v = tl.load(v_ptr + page * v_page + n[:, None] * v_slot + kv_head * v_head + d[None, :],
                    mask=kv_mask, other=0)
        if USE_LUT:  # fp8 codes (as bytes) -> value * scale
            k = tl.load(k_lut_ptr + k.to(tl.int32), mask=kv_mask, other=0.0)
            v = tl.load(v_lut_ptr + v.to(tl.int32), mask=kv_mask, other=0.0)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, page_size]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / total[:, None]
    tl.store(out_ptr + row * o_row + heads[:, None] * o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
    seq_of_row: torch.Tensor, block_tables: torch.Tensor, window: int = 0,
    k_lut: torch.Tensor | None = None, v_lut: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, heads, head_dim] (the model's query scale already applied) -> [T, heads, head_dim].

    k_cache, v_cache [num_pages, page_size, kv_heads, head_dim]: float pages, or fp8 codes viewed as
    uint8 with k_lut / v_lut [256] float32 (byte -> value * scale). Row t sits at positions[t] of
    sequence seq_of_row[t], whose pages are block_tables[seq_of_row[t]] ([S, W], padded); it attends
    keys at positions <= positions[t] (and > positions[t] - window when window > 0). The pages must
    already hold this step's own K/V rows."""
    num_rows, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {kv_heads} KV heads")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if (k_lut is None) != (v_lut is None) or (k_lut is not None and k_cache.dtype != torch.uint8):
        raise ValueError("fp8 pages come as uint8 codes with both lookup tables")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    group = num_heads // kv_heads
    use_lut = k_lut is not None
    lut_k = k_lut if use_lut else q  # any pointer: not read
    lut_v = v_lut if use_lut else q
    _paged_attention_kernel[(num_rows, kv_heads)](
        q, k_cache, v_cache, out, positions, seq_of_row, block_tables, lut_k, lut_v,
        head_dim ** -0.5, int(window),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim), PAGE_SIZE=page_size, USE_LUT=use_lut,
    )
    return out
