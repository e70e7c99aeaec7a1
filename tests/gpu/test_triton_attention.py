"""The CUDA path's Triton kernels, run by Triton's interpreter on the CPU (no GPU needed; compiled on
a CUDA device when there is one, tests/cuda/run.sh): paged
attention equals the torch reference path on the same pages for every codec the kernel reads, with
GQA and MHA, sliding windows, decode rows, prefill chunks that start mid-page and pages out of
order; the matmul is batch-invariant and correct."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.kernels import cuda as gpu
from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.gpu_attention import GpuAttentionMetadata, attend_in_place, supports
from kvserve.model.kv_quant import PagedKV, codec_for

if not gpu.available():  # (not importorskip: triton must first be imported by kvserve.kernels.cuda)
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4
HEAD_DIM = 16
NUM_PAGES = 24
# (dtype the model computes in, tolerance against the torch path)
CODECS = {"fp32": (torch.float32, 2e-6), "fp16": (torch.float16, 4e-3), "bf16": (torch.bfloat16, 3e-2),
          "fp8_e4m3": (torch.float32, 2e-6), "fp8_e5m2": (torch.float32, 2e-6)}
# each step: (start position, query length) per sequence; sequences keep their pages across steps
STEPS = [
    [(0, 9), (0, 6)],  # two prefills, the second ending mid-page
    [(9, 1), (6, 5), (0, 3)],  # a decode row, a chunk starting mid-page, a new sequence
    [(10, 1), (11, 1), (3, 1)],  # decode rows only
]


def _caches(codec, num_kv_heads: int) -> tuple[PagedKV, PagedKV]:
    data, scales = codec.make_cache(NUM_PAGES, PAGE, num_kv_heads, HEAD_DIM, DEVICE, num_layers=1)
    return PagedKV(codec, data[0, 0], scales[0, 0]), PagedKV(codec, data[0, 1], scales[0, 1])


def _run_steps(kind: str, codec_name: str, num_heads: int, num_kv_heads: int, window: int | None, seed: int):
    dtype = CODECS[codec_name][0]
    codec = codec_for(codec_name, dtype, fp8_scale=0.05 if codec_name.startswith("fp8") else 1.0)
    k_cache, v_cache = _caches(codec, num_kv_heads)
    free = list(range(1, NUM_PAGES))
    random.Random(seed).shuffle(free)  # pages out of order
    tables: dict[int, list[int]] = {}
    gen = torch.Generator().manual_seed(seed)
    outputs = []
    for step in STEPS:
        starts, lens = [s for s, _ in step], [n for _, n in step]
        for i, (s, n) in enumerate(step):
            table = tables.setdefault(i, [])
            while len(table) * PAGE < s + n:
                table.append(free.pop())
        block_tables = [tables[i] for i in range(len(step))]
        t = sum(lens)
        q = torch.randn(t, num_heads, HEAD_DIM, generator=gen).to(DEVICE, dtype)
        k = torch.randn(t, num_kv_heads, HEAD_DIM, generator=gen).to(DEVICE, dtype)
        v = torch.randn(t, num_kv_heads, HEAD_DIM, generator=gen).to(DEVICE, dtype)
        if kind == "triton":
            meta = GpuAttentionMetadata.build(starts, lens, block_tables, PAGE, DEVICE)
            if window:
                meta = meta.with_window(window)
            outputs.append(attend_in_place(q, k, v, k_cache, v_cache, meta))
        else:
            meta = AttentionMetadata.build(starts, lens, block_tables, PAGE, DEVICE)
            if window:
                meta = meta.with_window(window)
            outputs.append(paged_attention(q, k, v, k_cache, v_cache, meta, lib=None))
    return outputs, k_cache, v_cache


@pytest.mark.parametrize("codec_name", list(CODECS))
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_triton_paged_attention_equals_the_torch_path(codec_name, heads, window):
    assert supports(codec_for(codec_name))
    got, k_got, v_got = _run_steps("triton", codec_name, *heads, window, seed=3)
    want, k_want, v_want = _run_steps("torch", codec_name, *heads, window, seed=3)
    tol = CODECS[codec_name][1]
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        err = (g.float() - w.float()).abs().max().item()
        assert err <= tol, f"step {step}: max |diff| {err} over {tol}"
    # the same codec wrote the same pages
    assert torch.equal(k_got.data.view(torch.uint8), k_want.data.view(torch.uint8))
    assert torch.equal(v_got.data.view(torch.uint8), v_want.data.view(torch.uint8))


def test_a_row_gives_the_same_bits_alone_and_in_a_batch():
    codec = codec_for("fp32")
    k_cache, v_cache = _caches(codec, 2)
    gen = torch.Generator().manual_seed(0)
    k_cache.data.copy_(torch.randn(k_cache.data.shape, generator=gen))
    v_cache.data.copy_(torch.randn(v_cache.data.shape, generator=gen))
    from kvserve.kernels.cuda.paged_attention import paged_attention as kernel

    q = torch.randn(3, 6, HEAD_DIM, generator=gen).to(DEVICE)
    tables = torch.tensor([[5, 9, 2, 7], [11, 3, 0, 0], [8, 0, 0, 0]], device=DEVICE)
    positions, seqs = torch.tensor([14, 6, 2], device=DEVICE), torch.tensor([0, 1, 2], device=DEVICE)
    batch = kernel(q, k_cache.data, v_cache.data, positions, seqs, tables)
    alone = kernel(q[1:2], k_cache.data, v_cache.data, positions[1:2], torch.tensor([0], device=DEVICE), tables[1:2])
    assert torch.equal(batch[1], alone[0])


def test_int_codecs_are_not_on_the_triton_path():
    assert not supports(codec_for("int8")) and not supports(codec_for("int4"))


def test_matmul_is_correct_and_batch_invariant():
    from kvserve.kernels.cuda.matmul import linear

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70, 100, generator=gen).to(DEVICE)
    w, b = torch.randn(130, 100, generator=gen).to(DEVICE), torch.randn(130, generator=gen).to(DEVICE)
    y = linear(x, w, b)
    torch.testing.assert_close(y, x @ w.T + b, rtol=1e-5, atol=1e-4)
    for row in (0, 5, 69):
        assert torch.equal(linear(x[row:row + 1], w, b)[0], y[row])
    xb = x.to(torch.bfloat16)
    yb = linear(xb, w.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), xb.float() @ w.to(torch.bfloat16).float().T, rtol=2e-2, atol=0.5)
