"""The native matmul over GGUF blocks: each format's decoding equals gguf's reference dequantization,
the product matches float64 within the int8 activation rounding's bound, and every output element is
bitwise the same whatever the batch rows around it, the row count and the thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from kvserve import kernels
from kvserve.kernels import matmul as km

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
    block, size = km.GEOMETRY[int(qtype)]
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
    exact = x.double().numpy() @ wf.T
    accumulation = 1e-5 * (np.abs(x.double().numpy()) @ np.abs(wf).T) + 1e-6
    if qtype in FLOAT_TYPES:
        bound = accumulation
    else:
        # two int8 levels: |x - q0 d0 - q1 d1| <= d1 / 2 per element; the kernel must equal x_q @ W up
        # to float32 accumulation
        q, d = km.quantize_activations(lib, x)
        levels = q.double().view(2, t, -1, 32) * d.double()[..., None]
        xq = levels.sum(0).view(t, k).numpy()
        half_step = np.repeat(d[1].double().numpy(), 32, 1) / 2 * 1.0001 + 1e-12
        assert np.all(np.abs(xq - x.double().numpy()) <= half_step)
        np.testing.assert_array_less(np.abs(y - xq @ wf.T), 1e-5 * (np.abs(xq) @ np.abs(wf).T) + 1e-6)
        bound = half_step @ np.abs(wf).T + accumulation
    np.testing.assert_array_less(np.abs(y - exact), bound)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_float_activations_match_float64_up_to_accumulation(lib, qtype):
    n, k, t = 21, 512, 5
    w = random_weight(qtype, n, k, seed=6)
    wf = reference(qtype, w, k).astype(np.float64)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(7))
    y = km.matmul(lib, qtype, torch.from_numpy(w), k, x, float_activations=True).numpy()
    xd = x.double().numpy()
    np.testing.assert_array_less(np.abs(y - xd @ wf.T), 1e-5 * (np.abs(xd) @ np.abs(wf).T) + 1e-6)


@pytest.mark.parametrize("qtype, float_act", [(Q.Q4_1, False), (Q.Q8_0, False), (Q.Q4_K, False), (Q.Q6_K, False),
                                              (Q.Q5_0, False), (Q.F16, False), (Q.Q8_0, True), (Q.Q6_K, True)],
                         ids=str)
def test_each_row_is_bitwise_the_same_in_any_batch_and_thread_count(lib, qtype, float_act):
    n, k = 70, 256
    w = torch.from_numpy(random_weight(qtype, n, k, seed=3))
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(4)) * 3

    def mm(rows: torch.Tensor, threads: int) -> torch.Tensor:
        return km.matmul(lib, qtype, w, k, rows, num_threads=threads, float_activations=float_act)

    alone = torch.cat([mm(x[i:i + 1], 1) for i in range(len(x))])
    for rows, threads in [(1, 2), (2, 1), (3, 2), (5, 1), (17, 2), (64, 1), (300, 2), (300, 1)]:
        assert torch.equal(mm(x[:rows], threads), alone[:rows]), (rows, threads)
    # a row's neighbours do not matter either
    shuffled = torch.randperm(300, generator=torch.Generator().manual_seed(5))
    assert torch.equal(mm(x[shuffled], 2), alone[shuffled])


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


def test_the_int8_rounding_is_the_same_on_every_isa(monkeypatch):
    x = torch.randn(4, 128) * 5
    got = []
    for isa in kernels.host_isas():
        monkeypatch.setenv("KVSERVE_KERNELS_ISA", isa)
        kl = kernels.library()
        if kl is None:
            pytest.skip("native kernels not built")
        got.append(km.quantize_activations(kl, x))
    for q, d in got[1:]:
        assert torch.equal(q, got[0][0]) and torch.equal(d, got[0][1])
