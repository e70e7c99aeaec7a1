"""Paged attention equals dense causal attention over each sequence's full K/V, for batches that mix
decode tokens and prefill chunks, any page size and scattered page ids."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.kv_quant import PagedKV, codec_for, write_kv_pair

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 16


def dense_reference(q, k, v, start):
    """q [n, H, D] at positions start..start+n-1; k, v [start+n, KVH, D] of the whole context."""
    n, ctx = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, D]
    v = v.repeat_interleave(group, 1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / HEAD_DIM**0.5  # [H, n, ctx]
    allowed = torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, H, D]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch_matches_dense_attention(page_size):
    gen = torch.Generator().manual_seed(page_size)
    # (context already cached, new tokens): decodes, a fresh prefill, a mid-page chunk, a 1-token prompt
    shapes = [(9, 1), (0, 7), (13, 6), (30, 1), (0, 1), (5, 11)]
    num_pages = 1 + sum(-(-(c + n) // page_size) for c, n in shapes)
    pages = list(range(1, num_pages))
    random.Random(page_size).shuffle(pages)
    codec = codec_for("fp32")
    k_cache, v_cache = (PagedKV(codec, *codec.make_cache(num_pages, page_size, KV_HEADS, HEAD_DIM))
                        for _ in range(2))

    seqs, block_tables = [], []
    for cached, new in shapes:
        total = cached + new
        k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
        q = torch.randn(new, HEADS, HEAD_DIM, generator=gen)
        bt = [pages.pop() for _ in range(-(-total // page_size))]
        if cached:  # the earlier context is already in the cache
            meta = AttentionMetadata.build([0], [cached], [bt], page_size)
            write_kv_pair(k_cache, v_cache, k[:cached], v[:cached], meta.slot_mapping)
        seqs.append((q, k, v, cached))
        block_tables.append(bt + [0] * 2)  # tables may be longer than needed

    meta = AttentionMetadata.build([c for c, _ in shapes], [n for _, n in shapes], block_tables, page_size)
    q_all = torch.cat([q for q, *_ in seqs])
    out = paged_attention(q_all, torch.cat([k[c:] for _, k, _, c in seqs]),
                          torch.cat([v[c:] for _, _, v, c in seqs]), k_cache, v_cache, meta)

    assert meta.num_decode == 3 and len(meta.prefills) == 3
    row = 0
    for q, k, v, cached in seqs:
        expected = dense_reference(q, k, v, cached)
        torch.testing.assert_close(out[row : row + q.shape[0]], expected, atol=1e-5, rtol=1e-5)
        row += q.shape[0]


def test_slot_mapping_and_positions():
    meta = AttentionMetadata.build([3, 0], [2, 3], [[7, 2], [5, 6]], page_size=4)
    assert meta.positions.tolist() == [3, 4, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 5 * 4, 5 * 4 + 1, 5 * 4 + 2]


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3", "int8", "int4"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_outputs_do_not_depend_on_chunking(kv_dtype, page_size):
    """A sequence attended as one prefill, in uneven chunks (some ending mid-page), or one decode
    token at a time gives the same outputs with every KV dtype. int8/int4 pages share a scale that
    later tokens raise; each prefill query must see its own page as decode saw it, or recompute
    after preemption would not reproduce what decode computed."""

    gen = torch.Generator().manual_seed(page_size)
    n = 45
    # later tokens larger, so int page scales rise while pages fill
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) * torch.logspace(-1, 1, n)[:, None, None]
    v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) * torch.logspace(1, -1, n)[:, None, None]
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    codec = codec_for(kv_dtype)
    pages = -(-n // page_size)
    block_table = list(range(pages, 0, -1))  # scattered, reversed page ids

    def run(chunks: list[int]) -> torch.Tensor:
        (kd, ks), (vd, vs) = (codec.make_cache(pages + 1, page_size, KV_HEADS, HEAD_DIM) for _ in "kv")
        k_cache, v_cache = PagedKV(codec, kd, ks), PagedKV(codec, vd, vs)
        outs, start = [], 0
        for size in chunks:
            meta = AttentionMetadata.build([start], [size], [block_table], page_size)
            rows = slice(start, start + size)
            outs.append(paged_attention(q[rows], k[rows], v[rows], k_cache, v_cache, meta))
            start += size
        return torch.cat(outs)

    at_once = run([n])
    torch.testing.assert_close(run([7, 1, 13, 2, 22]), at_once, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(run([1] * n), at_once, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_rows_sharing_leading_pages_match_dense_attention(page_size):
    """Decode rows whose block tables start with the same pages (a shared prompt, then each its own
    suffix) are attended with the shared pages read once; outputs equal dense attention, also for a
    row whose context ends right after the shared pages and next to a prefill in the same step."""
    gen = torch.Generator().manual_seed(100 + page_size)
    shared_len = 3 * page_size + (page_size > 1)  # the last shared-prefix page is partly shared
    suffixes = [5, 0, 17, 2 * page_size]
    total_pages = 64 + sum(-(-(shared_len + s + 1) // page_size) for s in suffixes)
    pages = list(range(1, total_pages))
    random.Random(page_size).shuffle(pages)
    codec = codec_for("fp32")
    k_cache, v_cache = (PagedKV(codec, *codec.make_cache(total_pages, page_size, KV_HEADS, HEAD_DIM))
                        for _ in range(2))
    prefix_k = torch.randn(shared_len, KV_HEADS, HEAD_DIM, generator=gen)
    prefix_v = torch.randn(shared_len, KV_HEADS, HEAD_DIM, generator=gen)
    shared_pages = [pages.pop() for _ in range(shared_len // page_size)]  # full pages only are shared
    rows = []
    for suffix in suffixes:
        ctx = shared_len + suffix + 1
        k = torch.cat([prefix_k, torch.randn(ctx - shared_len, KV_HEADS, HEAD_DIM, generator=gen)])
        v = torch.cat([prefix_v, torch.randn(ctx - shared_len, KV_HEADS, HEAD_DIM, generator=gen)])
        bt = shared_pages + [pages.pop() for _ in range(-(-ctx // page_size) - len(shared_pages))]
        meta = AttentionMetadata.build([0], [ctx - 1], [bt], page_size)
        paged_attention(torch.zeros(ctx - 1, HEADS, HEAD_DIM), k[:-1], v[:-1], k_cache, v_cache, meta)
        rows.append((torch.randn(1, HEADS, HEAD_DIM, generator=gen), k, v, bt))
    prompt_k, prompt_v = (torch.randn(9, KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv")
    prompt_q = torch.randn(9, HEADS, HEAD_DIM, generator=gen)
    prompt_bt = [pages.pop() for _ in range(-(-9 // page_size))]

    meta = AttentionMetadata.build([k.shape[0] - 1 for _, k, _, _ in rows] + [0], [1] * len(rows) + [9],
                                   [bt for *_, bt in rows] + [prompt_bt], page_size)
    assert meta.decode_shared_pages.tolist() == shared_pages
    out = paged_attention(torch.cat([q for q, *_ in rows] + [prompt_q]),
                          torch.cat([k[-1:] for _, k, _, _ in rows] + [prompt_k]),
                          torch.cat([v[-1:] for _, _, v, _ in rows] + [prompt_v]), k_cache, v_cache, meta)
    for i, (q, k, v, _) in enumerate(rows):
        torch.testing.assert_close(out[i:i + 1], dense_reference(q, k, v, k.shape[0] - 1),
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[len(rows):], dense_reference(prompt_q, prompt_k, prompt_v, 0),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_sliding_window_reads_only_the_window(kv_dtype, page_size):
    """A sliding-window layer's queries, as one prefill, in chunks or one decode token at a time,
    equal dense windowed attention (fp32) and each other (int8), and never read a page wholly before
    the window: those pages are poisoned with NaN after every step (the hybrid allocator hands them
    to other sequences), and a read of one would turn the outputs into NaN."""
    gen = torch.Generator().manual_seed(7 + page_size)
    n, window = 45, 8
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv")
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    codec = codec_for(kv_dtype)
    pages = -(-n // page_size)
    block_table = list(range(pages, 0, -1))

    def run(chunks: list[int]) -> torch.Tensor:
        (kd, ks), (vd, vs) = (codec.make_cache(pages + 1, page_size, KV_HEADS, HEAD_DIM) for _ in "kv")
        k_cache, v_cache = PagedKV(codec, kd, ks), PagedKV(codec, vd, vs)
        outs, start = [], 0
        for size in chunks:
            meta = AttentionMetadata.build([start], [size], [block_table], page_size).with_window(window)
            rows = slice(start, start + size)
            outs.append(paged_attention(q[rows], k[rows], v[rows], k_cache, v_cache, meta))
            start += size
            for index in range(max(0, start - window + 1) // page_size):  # no later query sees it
                for cache in (k_cache, v_cache):
                    target = cache.data if cache.data.is_floating_point() else cache.scales
                    target[block_table[index]] = float("nan")
        return torch.cat(outs)

    at_once = run([n])
    assert not at_once.isnan().any()
    if kv_dtype == "fp32":
        group = HEADS // KV_HEADS
        kk, vv = (x.repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))  # [H, n, D]
        scores = q.transpose(0, 1) @ kk.transpose(1, 2) / HEAD_DIM**0.5
        pos = torch.arange(n)
        allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        expected = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vv).transpose(0, 1)
        torch.testing.assert_close(at_once, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run([7, 1, 13, 2, 22]), at_once, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(run([1] * n), at_once, atol=2e-5, rtol=1e-5)
