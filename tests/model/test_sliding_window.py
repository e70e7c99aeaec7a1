"""Sliding-window paged attention: a query at position p attends keys at positions > p - window,
for decode rows that share leading pages, mid-sequence prefill chunks, and every KV dtype."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.kv_quant import PagedKV, codec_for, write_kv_pair

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 4, 2, 16, 5


def dense_windowed(q, k, v, start, window):
    """q [n, H, D] at positions start..; k, v [start + n, KVH, D]."""
    n, ctx = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    v = v.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / HEAD_DIM**0.5
    pos = (start + torch.arange(n))[:, None]
    keys = torch.arange(ctx)[None, :]
    scores = scores.masked_fill(~((keys <= pos) & (keys > pos - window)), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def caches(kv_dtype: str, num_pages: int, page_size: int):
    codec = codec_for(kv_dtype)
    return [PagedKV(codec, *codec.make_cache(num_pages, page_size, KV_HEADS, HEAD_DIM)) for _ in range(2)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_window_masks_decode_rows_with_shared_pages_and_prefill_chunks(page_size):
    gen = torch.Generator().manual_seed(page_size)
    shared_len = 12  # two decode rows share this prefix (cascade path without a window)
    prefix_pages = list(range(1, 1 + shared_len // page_size))
    k_shared, v_shared = (torch.randn(shared_len, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    k_cache, v_cache = caches("fp32", 96, page_size)
    next_page = 1 + len(prefix_pages)
    seqs, tables, starts, lens = [], [], [], []
    for cached, new, shared in ((13, 1, True), (15, 1, True), (7, 6, False), (0, 9, False)):
        k = torch.randn(cached + new, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(cached + new, KV_HEADS, HEAD_DIM, generator=gen)
        if shared:
            k[:shared_len], v[:shared_len] = k_shared, v_shared
        n_pages = -(-(cached + new) // page_size)
        own = [next_page + i for i in range(n_pages)]
        next_page += n_pages
        table = (prefix_pages + own)[:n_pages] if shared else own
        if cached:
            meta = AttentionMetadata.build([0], [cached], [table], page_size)
            write_kv_pair(k_cache, v_cache, k[:cached], v[:cached], meta.slot_mapping)
        seqs.append((torch.randn(new, HEADS, HEAD_DIM, generator=gen), k, v, cached))
        tables.append(table)
        starts.append(cached)
        lens.append(new)
    meta = AttentionMetadata.build(starts, lens, tables, page_size)
    assert meta.decode_shared_pages.numel() > 0  # the cascade split the windowed metadata must undo
    out = paged_attention(torch.cat([q for q, *_ in seqs]), torch.cat([k[c:] for _, k, _, c in seqs]),
                          torch.cat([v[c:] for _, _, v, c in seqs]), k_cache, v_cache,
                          meta.with_window(WINDOW))
    row = 0
    for q, k, v, cached in seqs:
        expected = dense_windowed(q, k, v, cached, WINDOW)
        torch.testing.assert_close(out[row:row + q.shape[0]], expected, atol=1e-5, rtol=1e-5)
        row += q.shape[0]


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int4"])
def test_windowed_outputs_do_not_depend_on_chunking(kv_dtype):
    """One prefill of 14 tokens or 14 decode steps: the same windowed outputs (page-scaled KV too)."""
    gen = torch.Generator().manual_seed(0)
    page_size, n = 4, 14
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    table = [3, 1, 4, 2]
    outs = []
    for chunks in ([n], [1] * n):
        k_cache, v_cache = caches(kv_dtype, 5, page_size)
        pieces, start = [], 0
        for c in chunks:
            meta = AttentionMetadata.build([start], [c], [table], page_size).with_window(WINDOW)
            pieces.append(paged_attention(q[start:start + c], k[start:start + c], v[start:start + c],
                                          k_cache, v_cache, meta))
            start += c
        outs.append(torch.cat(pieces))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    if kv_dtype == "fp32":
        torch.testing.assert_close(outs[0], dense_windowed(q, k, v, 0, WINDOW), atol=1e-5, rtol=1e-5)
