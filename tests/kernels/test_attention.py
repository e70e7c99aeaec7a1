"""The native paged-attention kernel on every instruction set this host runs: values against a float64
reference over the codec's own dequantized keys (and against the torch path), and the same bits for a
query whatever else the step holds: one prefill, uneven chunks, token-by-token decode, other rows
beside it, 1 or 2 threads."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import kernels
from kvserve.kernels import attention as native
from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.kv_quant import PagedKV, codec_for

CODECS = ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]


@pytest.fixture(params=kernels.host_isas())
def isa(request, monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNELS", "on")
    monkeypatch.setenv("KVSERVE_KERNELS_ISA", request.param)
    if kernels.library() is None:
        pytest.skip("native kernels not built")
    return request.param


def make_caches(kv_dtype: str, num_pages: int, page_size: int, kv_heads: int, head_dim: int):
    codec = codec_for(kv_dtype)
    return tuple(PagedKV(codec, *codec.make_cache(num_pages, page_size, kv_heads, head_dim)) for _ in "kv")


def run_schedule(kv_dtype, q, k, v, page_size, block_table, chunks, window=None):
    """Attend one sequence in the given chunk sizes on a fresh cache -> [n, heads, hd]."""
    k_cache, v_cache = make_caches(kv_dtype, max(block_table) + 1, page_size, k.shape[1], k.shape[2])
    outs, start = [], 0
    for size in chunks:
        meta = AttentionMetadata.build([start], [size], [block_table], page_size)
        if window is not None:
            meta = meta.with_window(window)
        rows = slice(start, start + size)
        outs.append(paged_attention(q[rows], k[rows], v[rows], k_cache, v_cache, meta))
        start += size
    return torch.cat(outs), (k_cache, v_cache)


def float64_reference(q, k_values, v_values, window=None):
    """Causal (optionally windowed) attention in float64 over the given key/value values."""
    n, heads, hd = q.shape
    group = heads // k_values.shape[1]
    kk, vv = (x.double().repeat_interleave(group, 1).transpose(0, 1) for x in (k_values, v_values))
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) / hd**0.5  # [H, n, n]
    pos = torch.arange(n)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vv).transpose(0, 1)


def sequence(seed, n, heads, kv_heads, hd, page_size):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, kv_heads, hd, generator=gen)
    v = torch.randn(n, kv_heads, hd, generator=gen)
    q = torch.randn(n, heads, hd, generator=gen)
    pages = list(range(1, -(-n // page_size) + 1))
    random.Random(seed).shuffle(pages)
    return q, k, v, pages


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (4, 1, 32), (20, 2, 16)])
def test_float_codecs_match_a_float64_reference(isa, kv_dtype, heads, kv_heads, hd):
    """Keys read back through the codec (as the cache stores them), attended in float64: the kernel
    agrees to float32 rounding, for GQA groups of 3, 4 and 10 (more than the 8 heads of one pass)."""
    n, page_size = 40, 16
    q, k, v, pages = sequence(1, n, heads, kv_heads, hd, page_size)
    out, (k_cache, v_cache) = run_schedule(kv_dtype, q, k, v, page_size, pages, [n])
    table = torch.tensor(pages)
    k_values = k_cache.read(table, torch.float64).reshape(-1, kv_heads, hd)[:n]
    v_values = v_cache.read(table, torch.float64).reshape(-1, kv_heads, hd)[:n]
    expected = float64_reference(q, k_values, v_values)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", CODECS)
def test_every_codec_matches_the_torch_path(isa, kv_dtype, monkeypatch):
    """The same chunked schedule (mid-page chunk ends) on the kernel and on the torch path."""
    n, page_size = 45, 4
    q, k, v, pages = sequence(2, n, 9, 3, 32, page_size)
    k = k * torch.logspace(-1, 1, n)[:, None, None]  # int page scales rise while pages fill
    chunks = [7, 1, 13, 2, 22]
    out, _ = run_schedule(kv_dtype, q, k, v, page_size, pages, chunks)
    monkeypatch.setenv("KVSERVE_KERNELS", "off")
    reference, _ = run_schedule(kv_dtype, q, k, v, page_size, pages, chunks)
    torch.testing.assert_close(out, reference, atol=3e-6, rtol=3e-5)


@pytest.mark.parametrize("kv_dtype", CODECS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_query_gets_the_same_bits_however_its_sequence_is_chunked(isa, kv_dtype, page_size):
    """One prefill, uneven chunks (some ending mid-page), or one decode step per token: every query
    row's output is bitwise the same (int codecs: each prefill query sees its own page as decode did)."""
    n = 40
    q, k, v, pages = sequence(3, n, 9, 3, 64, page_size)
    k = k * torch.logspace(-1, 1, n)[:, None, None]
    at_once, _ = run_schedule(kv_dtype, q, k, v, page_size, pages, [n])
    assert torch.equal(run_schedule(kv_dtype, q, k, v, page_size, pages, [21, 1, 11, 7])[0], at_once)
    assert torch.equal(run_schedule(kv_dtype, q, k, v, page_size, pages, [1] * n)[0], at_once)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
def test_sliding_window_values_and_bits(isa, kv_dtype):
    n, page_size, window = 50, 4, 11
    q, k, v, pages = sequence(4, n, 9, 3, 32, page_size)
    at_once, (k_cache, v_cache) = run_schedule(kv_dtype, q, k, v, page_size, pages, [n], window)
    table = torch.tensor(pages)
    k_values = k_cache.read(table, torch.float64, rotated=True).reshape(-1, 3, 32)[:n]
    v_values = v_cache.read(table, torch.float64, rotated=True).reshape(-1, 3, 32)[:n]
    if kv_dtype != "int8":  # int8's prefill queries see their own page as decode did, not as stored
        torch.testing.assert_close(at_once.double(), float64_reference(q, k_values, v_values, window),
                                   atol=2e-6, rtol=2e-5)
    assert torch.equal(run_schedule(kv_dtype, q, k, v, page_size, pages, [9, 1, 17, 23], window)[0], at_once)
    assert torch.equal(run_schedule(kv_dtype, q, k, v, page_size, pages, [1] * n, window)[0], at_once)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int4"])
def test_rows_do_not_depend_on_their_batch_neighbours_or_the_thread_count(isa, kv_dtype):
    """Three sequences with a shared first page: attended alone, or in one step as decode rows beside
    a prefill chunk, with 1 or 2 threads, each row gives the same bits."""
    page_size, heads, kv_heads, hd = 8, 9, 3, 64
    gen = torch.Generator().manual_seed(5)
    lengths = [30, 9, 21]  # context before this step's token
    k_cache, v_cache = make_caches(kv_dtype, 40, page_size, kv_heads, hd)
    shared_k, shared_v = (torch.randn(page_size, kv_heads, hd, generator=gen) for _ in "kv")
    tables = [[1, 2, 3, 4, 5], [1, 6, 7], [1, 8, 9, 10]]
    ks, vs = [], []
    for length, table in zip(lengths, tables):
        k = torch.randn(length + 1, kv_heads, hd, generator=gen)
        v = torch.randn(length + 1, kv_heads, hd, generator=gen)
        k[:page_size], v[:page_size] = shared_k, shared_v
        ks.append(k)
        vs.append(v)
        meta = AttentionMetadata.build([0], [length], [table], page_size)
        paged_attention(torch.zeros(length, heads, hd), k[:-1], v[:-1], k_cache, v_cache, meta)
    snapshot = [(c.data.clone(), c.scales.clone()) for c in (k_cache, v_cache)]
    qs = [torch.randn(1, heads, hd, generator=gen) for _ in lengths]
    prompt = [torch.randn(12, x, hd, generator=gen) for x in (heads, kv_heads, kv_heads)]

    def step(which: list[int], with_prompt: bool, threads: int) -> list[torch.Tensor]:
        for c, (data, scales) in zip((k_cache, v_cache), snapshot):
            c.data.copy_(data)
            c.scales.copy_(scales)
        starts = [lengths[i] for i in which] + ([0] if with_prompt else [])
        lens = [1] * len(which) + ([12] if with_prompt else [])
        meta = AttentionMetadata.build(starts, lens, [tables[i] for i in which] + ([[20, 21]] if with_prompt else []),
                                       page_size)
        q = torch.cat([qs[i] for i in which] + ([prompt[0]] if with_prompt else []))
        k = torch.cat([ks[i][-1:] for i in which] + ([prompt[1]] if with_prompt else []))
        v = torch.cat([vs[i][-1:] for i in which] + ([prompt[2]] if with_prompt else []))
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = paged_attention(q, k, v, k_cache, v_cache, meta)
        finally:
            torch.set_num_threads(before)
        return list(out[: len(which)].split(1))

    alone = [step([i], False, 1)[0] for i in range(3)]
    for threads in (1, 2):
        together = step([2, 0, 1], True, threads)
        for i, row in zip([2, 0, 1], together):
            assert torch.equal(row, alone[i])
        assert torch.equal(step([1, 2], False, threads)[1], alone[2])


def test_a_decode_row_equals_the_same_position_inside_a_prefill_chunk(isa):
    """Position 37 attended as row 37 of a 64-row chunk, and as a decode row after a prefix of 37
    tokens (a prefix-cache hit), gives the same bits (bf16 KV, the native mode's default)."""
    n, page_size = 64, 16
    q, k, v, pages = sequence(6, n, 9, 3, 64, page_size)
    chunk, _ = run_schedule("bf16", q, k, v, page_size, pages, [n])
    hit, _ = run_schedule("bf16", q, k, v, page_size, pages, [37, 1, 26])
    assert torch.equal(hit[37], chunk[37])


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3"])
@pytest.mark.parametrize("window", [None, 300])
def test_rows_across_segments_get_the_same_bits_on_every_schedule(isa, kv_dtype, window):
    """Rows whose keys span several 256-key segments (merged partial softmaxes): values agree with
    float64, and each row's bits are the same whether its segments run one after another on one
    thread or as units of their own on 1 or 2 threads, as a decode row or inside a prefill chunk."""
    n, page_size, tail = 600, 16, 20
    q, k, v, pages = sequence(7, n, 9, 3, 64, page_size)
    at_once, (k_cache, v_cache) = run_schedule(kv_dtype, q, k, v, page_size, pages, [n], window)
    table = torch.tensor(pages)
    k_values = k_cache.read(table, torch.float64).reshape(-1, 3, 64)[:n]
    v_values = v_cache.read(table, torch.float64).reshape(-1, 3, 64)[:n]
    torch.testing.assert_close(at_once.double(), float64_reference(q, k_values, v_values, window),
                               atol=2e-6, rtol=2e-5)
    lib = kernels.library()
    caches = (k_cache.data, k_cache.scales), (v_cache.data, v_cache.scales)
    tables = None
    if kv_dtype.startswith("fp8"):
        tables = (k_cache.codec.lookup_table(), v_cache.codec.lookup_table())
    for start, size in ((n - tail, tail), (n - 1, 1)):  # a prefill chunk's rows, a decode row
        meta = AttentionMetadata.build([start], [size], [pages], page_size)
        meta = meta.with_window(window) if window is not None else meta
        for schedule in ("tile", "segment", "auto"):
            for threads in (1, 2):
                out = native.paged_attention(lib, q[start:], kv_dtype, *caches, page_size, meta.rows_for_kernel(),
                                             window, tables, num_threads=threads, schedule=schedule)
                assert torch.equal(out, at_once[start:]), (start, schedule, threads)


@pytest.mark.parametrize("kv_dtype", sorted(native.WRITES))
def test_the_kernel_writes_new_rows_as_the_torch_codec_does(isa, kv_dtype, monkeypatch):
    """The kernel call writes the step's K/V itself for these codecs: the cache holds the same bytes
    as after the torch path's write, rounding ties, infinities, NaN and subnormals included."""
    n, page_size = 37, 4
    q, k, v, pages = sequence(8, n, 9, 3, 32, page_size)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), float("inf"), -float("inf"), float("nan"),
                         1e-40, -3e-39, 3.4e38, 0.0, -0.0])
    k[0, 0, : ties.numel()] = ties
    v[1, 2, -ties.numel():] = ties
    _, native_caches = run_schedule(kv_dtype, q, k, v, page_size, pages, [20, 1, 16])
    monkeypatch.setenv("KVSERVE_KERNELS", "off")
    _, torch_caches = run_schedule(kv_dtype, q, k, v, page_size, pages, [20, 1, 16])
    for ours, theirs in zip(native_caches, torch_caches):
        assert torch.equal(ours.data.view(torch.uint8), theirs.data.view(torch.uint8))


def test_unsupported_shapes_fall_back_to_the_torch_path(isa):
    lib = kernels.library()
    width = lib.simd_width if native.supports(lib, "fp32", 64, torch.zeros(1)) else 1
    assert native.supports(lib, "bf16", 64, torch.zeros(1))
    assert not native.supports(lib, "bf16", 64, torch.zeros(1, dtype=torch.bfloat16))
    assert native.supports(lib, "fp32", 12, torch.zeros(1)) == (12 % width == 0)
