"""The native matmul over GGUF blocks: each format's decoding equals gguf's reference dequantization
(and is the same on every ISA), the product matches float64 within the int8 activation rounding's
bound, and every output element is bitwise the same whatever the batch rows around it, the row
count, the tile edges and the thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import kernels
from kvserve.kernels import matmul as km
from kvserve.kernels.api import MatmulStatus

BLOCK_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOAT_TYPES = [Q.F32, Q.F16, Q.BF16]
# where the block's fp16 scales sit (byte offsets), so random blocks get sane, finite scales
SCALE_OFFSETS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
                 Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


@pytest.fixture(params=kernels.host_isas())
def lib(request, monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNELS_ISA", request.param)
    monkeypatch.delenv("KVSERVE_KERNELS", raising=False)
    kl = kernels.library()
    if kl is None:
        pytest.skip("native kernels not built")
    return kl


def random_weight(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] uint8: quantized from random floats where gguf can, else random bytes with
    fp16 scales set to small positive values."""
    rng = np.random.default_rng(seed)
    if qtype in FLOAT_TYPES or qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        w = rng.standard_normal((n, k)).astype(np.float32)
        if qtype == Q.F32:
            return w.view(np.uint8)
        if qtype == Q.F16:
            return w.astype(np.float16).view(np.uint8)
        return np.ascontiguousarray(quants.quantize(w, qtype))
    block, size = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(0.002, 0.05, size=(n, k // block)).astype(np.float16)
        raw[..., off:off + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def reference(qtype: Q, w: np.ndarray, k: int) -> np.ndarray:
    return np.asarray(quants.dequantize(w, qtype), dtype=np.float32).reshape(w.shape[0], k)


@pytest.mark.parametrize("qtype", BLOCK_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
def test_dequantize_rows_equals_gguf_reference(lib, qtype):
    k = 512
    w = random_weight(qtype, 6, k)
    rows = torch.tensor([5, 0, 3, 3])
    got = km.dequantize_rows(lib, qtype, torch.from_numpy(w), k, rows).numpy()
    np.testing.assert_allclose(got, reference(qtype, w, k)[rows.numpy()], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", BLOCK_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
def test_matmul_matches_float64_within_activation_rounding(lib, qtype):
    n, k, t = 37, 512, 9
    w = random_weight(qtype, n, k, seed=1)
    wf = reference(qtype, w, k).astype(np.float64)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(2))
    y = km.matmul(lib, qtype, torch.from_numpy(w), k, x).numpy().astype(np.float64)
    xd = x.double().numpy()
    accumulation = 1e-5 * (np.abs(xd) @ np.abs(wf).T) + 1e-6
    if qtype in FLOAT_TYPES:
        np.testing.assert_array_less(np.abs(y - xd @ wf.T), accumulation)
        return
    # int8 per block of 32 on the block's step, each sub-block of 8 on that step over 2^s (s <= 3, as
    # fine as the sub-block's max allows): |x - q m d| <= m d / 2 per element; the kernel equals x_q @ W
    # up to float32
    q, d, m = km.quantize_activations(lib, x)
    step = (m.double().view(t, -1, 32) * d.double()[..., None]).view(t, k).numpy()
    xq = q.double().numpy() * step
    half_step = step / 2 * 1.0001 + 1e-12
    assert np.all(np.abs(xq - xd) <= half_step)
    qi = np.abs(q.numpy().astype(np.int32))
    assert np.all(qi <= 127) and np.all(np.isin(m.numpy(), [1, 2, 4, 8]))
    # the block's largest element is on the block's own step (m = 8, |q| = 127); a sub-block of 8 is
    # on a finer step only where its own largest element still fits
    assert np.all((qi * m.numpy()).reshape(t, -1, 32).max(-1) == 127 * 8)
    sub = np.abs(xd).reshape(t, -1, 4, 8).max(-1)
    finer = m.numpy().reshape(t, -1, 4, 8)[..., 0] < 8
    assert np.all(sub[finer] * 2 <= np.repeat(np.abs(xd).reshape(t, -1, 32).max(-1, keepdims=True), 4, -1)[finer])
    assert finer.any() and not finer.all()
    np.testing.assert_array_less(np.abs(y - xq @ wf.T), 1e-5 * (np.abs(xq) @ np.abs(wf).T) + 1e-6)
    np.testing.assert_array_less(np.abs(y - xd @ wf.T), half_step @ np.abs(wf).T + accumulation)


def batch_invariance(lib, qtype: Q, n: int, k: int, counts: list[tuple[int, int]], total: int) -> None:
    """Every row of x equals its product alone (1 thread) in each (row count, thread count), and in a
    shuffled batch."""
    w = torch.from_numpy(random_weight(qtype, n, k, seed=3))
    x = torch.randn(total, k, generator=torch.Generator().manual_seed(4)) * 3

    def mm(rows: torch.Tensor, threads: int) -> torch.Tensor:
        return km.matmul(lib, qtype, w, k, rows, num_threads=threads)

    alone = torch.cat([mm(x[i:i + 1], 1) for i in range(total)])
    for rows, threads in counts:
        assert torch.equal(mm(x[:rows], threads), alone[:rows]), (rows, threads)
    shuffled = torch.randperm(total, generator=torch.Generator().manual_seed(5))
    assert torch.equal(mm(x[shuffled], 2), alone[shuffled])


@pytest.mark.parametrize("qtype", BLOCK_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
def test_each_row_is_bitwise_the_same_in_any_batch_and_thread_count(lib, qtype):
    # 70 weight rows: every tile width's edge (8, 4 and 3 weight rows per tile); 1-11 rows: every tile
    # height's edge and both decoded-block sizes (up to 4 rows and more); past the decode rows (8), a last
    # tile of 1, 2 or 3 rows (9, 10, 11: the offset pass takes the tile's rows together)
    counts = [(r, th) for r in range(1, 12) for th in (1, 2)] + [(17, 2), (64, 1), (300, 2), (300, 3)]
    batch_invariance(lib, qtype, 70, 256, counts, 300)


@pytest.mark.parametrize("qtype, k", [(Q.Q4_K, 2048), (Q.Q8_0, 2048), (Q.F32, 1001), (Q.F16, 37), (Q.Q4_1, 576),
                                      (Q.Q4_0, 608), (Q.Q8_0, 96), (Q.Q5_0, 352), (Q.Q5_1, 160)], ids=str)
def test_rows_spanning_several_decoded_blocks_and_ragged_float_rows(lib, qtype, k):
    # k = 2048: a thread's weight rows are decoded in several blocks; float rows off the 8/16 lanes
    # take the scalar tail; 576, 608, 96: rows whose last blocks are not a group of eight (decode rows
    # take them one by one)
    batch_invariance(lib, qtype, 37, k, [(1, 2), (4, 1), (5, 2), (13, 1), (14, 2), (15, 1), (40, 2)], 40)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.Q8_0, Q.Q5_1], ids=lambda q: q.name)
def test_rows_split_over_several_passes_over_the_panels(lib, qtype, monkeypatch):
    # a prefill takes its activation rows in passes that fit a quarter of the L3 (8 rows of 2,048 here, 5
    # passes for 40 rows, a last pass of 2 rows with 2 threads): every row as it is alone
    monkeypatch.setenv("KVSERVE_KERNELS_L3_BYTES", str(4 * 8 * (2048 + 1024)))
    batch_invariance(lib, qtype, 37, 2048, [(13, 1), (34, 2), (40, 2), (40, 1)], 40)


def test_more_threads_than_weight_rows(lib):
    w = torch.from_numpy(random_weight(Q.Q4_0, 3, 64))
    x = torch.randn(6, 64)
    assert torch.equal(km.matmul(lib, Q.Q4_0, w, 64, x, num_threads=8), km.matmul(lib, Q.Q4_0, w, 64, x, num_threads=1))


def test_output_into_a_column_slice_of_a_wider_matrix(lib):
    k = 64
    a, b = (torch.from_numpy(random_weight(Q.Q8_0, n, k, seed=n)) for n in (5, 7))
    x = torch.randn(3, k)
    out = torch.full((3, 12), float("nan"))
    km.matmul(lib, Q.Q8_0, a, k, x, out=out[:, :5])
    km.matmul(lib, Q.Q8_0, b, k, x, out=out[:, 5:])
    assert torch.equal(out, torch.cat([km.matmul(lib, Q.Q8_0, a, k, x), km.matmul(lib, Q.Q8_0, b, k, x)], 1))


def test_a_row_length_off_the_block_is_refused(lib):
    w = torch.zeros(2, 18 * 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not a multiple"):
        km.dequantize_rows(lib, Q.Q4_K, w, 96, torch.tensor([0]))


INTERLEAVED_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]  # each has a twin, its id + 1000


def interleaved_products_match(lib, qtype: Q, n: int, k: int, counts: list[tuple[int, int]], seed: int) -> None:
    """The format's rows interleaved in groups of eight (kvs_interleave_rows) hold the same bytes in
    another order, decode to the same weights and give the file layout's products bit for bit, for each
    (activation rows, threads) in counts: the decode rows up to 8 rows, the prefill tiles past them."""
    w = random_weight(qtype, n, k, seed=seed)
    twin, wi = km.interleave(lib, qtype, torch.from_numpy(w.copy()), k)
    assert twin == int(qtype) + 1000 and lib.formats[twin].group_rows == 8
    flat = wi.numpy().reshape(-1)
    assert not np.array_equal(flat, w.reshape(-1))
    if qtype in (Q.Q5_0, Q.Q5_1):  # their fifth bits also change order within their word (interleave.h twin_bit)
        assert np.unpackbits(flat).sum() == np.unpackbits(w).sum()
    else:
        assert np.array_equal(np.sort(flat), np.sort(w.reshape(-1)))
    as_filed = torch.from_numpy(w)
    rows = torch.tensor([0, n - 1, 8 % n, n // 2, 7])
    assert torch.equal(km.dequantize_rows(lib, twin, wi, k, rows), km.dequantize_rows(lib, qtype, as_filed, k, rows))
    x = torch.randn(max(t for t, _ in counts), k, generator=torch.Generator().manual_seed(seed)) * 3
    for t, threads in counts:
        got = km.matmul(lib, twin, wi, k, x[:t], num_threads=threads)
        assert torch.equal(got, km.matmul(lib, qtype, as_filed, k, x[:t], num_threads=threads)), (t, threads)


@pytest.mark.parametrize("qtype", INTERLEAVED_TYPES, ids=lambda q: q.name)
def test_interleaved_rows_give_the_file_layouts_bits(lib, qtype):
    counts = [(t, th) for t in (1, 2, 3, 5, 8, 9, 20) for th in (1, 2)]
    interleaved_products_match(lib, qtype, 40, 512, counts, seed=7)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(qtype=st.sampled_from(INTERLEAVED_TYPES), groups=st.integers(1, 9), superblocks=st.integers(1, 6),
       rows=st.integers(1, 12), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_interleaved_rows_give_the_file_layouts_bits_for_any_shape(lib, qtype, groups, superblocks, rows, threads,
                                                                   seed):
    interleaved_products_match(lib, qtype, 8 * groups, 256 * superblocks, [(rows, threads)], seed)


def test_only_whole_groups_of_a_format_with_a_twin_are_interleaved(lib, monkeypatch):
    ragged = torch.from_numpy(random_weight(Q.Q4_K, 12, 256))
    assert km.interleave(lib, Q.Q4_K, ragged, 256) == (int(Q.Q4_K), ragged)  # 12 rows: kept as filed
    with pytest.raises(ValueError, match="whole groups of eight"):
        km.matmul(lib, int(Q.Q4_K) + 1000, ragged, 256, torch.randn(1, 256))
    f16 = torch.from_numpy(random_weight(Q.F16, 16, 256))
    assert km.interleave(lib, Q.F16, f16, 256) == (int(Q.F16), f16)  # no twin: float rows
    assert lib.lib.kvs_interleave_rows(int(Q.F16), f16.data_ptr(), 16, 256) == MatmulStatus.NO_FORMAT
    assert lib.lib.kvs_interleave_rows(int(Q.Q6_K), f16.data_ptr(), 12, 256) == MatmulStatus.BAD_ROW_LENGTH
    monkeypatch.setenv("KVSERVE_KERNELS_INTERLEAVE", "off")
    whole = torch.from_numpy(random_weight(Q.Q6_K, 16, 256))
    before = whole.clone()
    assert km.interleave(lib, Q.Q6_K, whole, 256) == (int(Q.Q6_K), whole) and torch.equal(whole, before)


def on_every_isa(monkeypatch, fn, isas: list[str] | None = None) -> list:
    """fn(library) on each instruction set this host runs (or of `isas`), forced by KVSERVE_KERNELS_ISA."""
    got = []
    for isa in isas or kernels.host_isas():
        monkeypatch.setenv("KVSERVE_KERNELS_ISA", isa)
        kl = kernels.library()
        if kl is None:
            pytest.skip("native kernels not built")
        got.append(fn(kl))
    return got


def on_each_simd_library(monkeypatch, fn) -> list:
    """fn(library) on each SIMD build this host runs, AVX2's first (skipped where there is one): a list, where
    test_isa_identity.on_every_simd_build runs fn() and keys the results by build."""
    isas = kernels.simd_isas()
    if len(isas) < 2:
        pytest.skip("needs a host with AVX-512")
    return on_every_isa(monkeypatch, fn, isas)


@pytest.mark.parametrize("qtype", BLOCK_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
def test_the_decoded_weights_are_the_same_on_every_isa(qtype, monkeypatch):
    k = 512
    w = torch.from_numpy(random_weight(qtype, 4, k, seed=8))
    got = on_every_isa(monkeypatch, lambda kl: km.dequantize_rows(kl, qtype, w, k, torch.arange(4)))
    for rows in got[1:]:
        assert torch.equal(rows, got[0])


def test_the_int8_rounding_is_the_same_on_every_isa(monkeypatch):
    x = torch.randn(4, 128) * 5
    x[1, :32] = 0.0  # an all-zero block: q = 0, d = 0
    got = on_every_isa(monkeypatch, lambda kl: km.quantize_activations(kl, x))
    assert torch.equal(got[0][0][1, :32], torch.zeros(32, dtype=torch.int8)) and got[0][1][1, 0] == 0
    for q, d, m in got[1:]:
        assert torch.equal(q, got[0][0]) and torch.equal(d, got[0][1]) and torch.equal(m, got[0][2])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q5_K], ids=lambda q: q.name)
def test_wide_prefill_panels_give_the_avx2_products_bit_for_bit(qtype, monkeypatch):
    # a panel as wide as the AMX tile takes (16 groups of 16 weight rows, then 15 and a half) over a K the
    # tile unit takes in several slices (a slice's BF16 codes fill half the L2: 8,192 is two on a 4 MiB L2):
    # the sums carried from slice to slice give each output the bits of one pass over K
    n, k = 1000, 8192
    w = torch.from_numpy(random_weight(qtype, n, k, seed=13))
    x = torch.randn(144, k, generator=torch.Generator().manual_seed(14)) * 2
    got = on_each_simd_library(monkeypatch, lambda kl: km.matmul(kl, qtype, w, k, x, num_threads=1))
    for other in got[1:]:
        assert torch.equal(got[0], other)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_every_simd_build_gives_the_avx2_products_bit_for_bit(qtype, monkeypatch):
    # the AVX-512 build runs AVX2's chain with two weight rows a vector (prefill tiles and decode rows), the
    # AMX build sixteen activation rows a tile in the tile unit: each output the same bits; 37 weight rows
    # leave an odd row past every pair; row counts on both sides of the decode path's limit, of the vector
    # tiles' heights and of the calls AMX takes (from 128 rows, sixteen at a time: a remainder on the vector tiles)
    k = 512
    w = torch.from_numpy(random_weight(qtype, 37, k, seed=11))
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(12)) * 2
    calls = [(t, th) for t in (1, 2, 3, 4, 5, 8, 9, 16, 21, 127, 128, 150) for th in (1, 2)]
    got = on_each_simd_library(monkeypatch, lambda kl: [km.matmul(kl, qtype, w, k, x[:t], num_threads=th)
                                                        for t, th in calls])
    for other in got[1:]:
        for a, b in zip(got[0], other):
            assert torch.equal(a, b)
