"""The fused native ops (RMSNorm with and without the residual add, RoPE, the gated activations) on
every instruction set this host runs: values against the torch path / float64, and each row the same
bits whether it comes alone or with others, with 1 or 2 threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.kernels import ops
from kvserve.model.llama import Rotary, apply_rope


@pytest.fixture(params=kernels.host_isas())
def lib(request, monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNELS", "on")
    monkeypatch.setenv("KVSERVE_KERNELS_ISA", request.param)
    loaded = kernels.library()
    if loaded is None:
        pytest.skip("native kernels not built")
    return loaded


def with_threads(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def rows_alone_and_together(fn, x: torch.Tensor) -> None:
    """fn over all rows (1 and 2 threads) equals fn over each row alone, bitwise."""
    together = with_threads(1, lambda: fn(x))
    assert torch.equal(with_threads(2, lambda: fn(x)), together)
    for i in (0, 5, x.shape[0] - 1):
        assert torch.equal(fn(x[i:i + 1]), together[i:i + 1])


@pytest.mark.parametrize("dim", [576, 37])
def test_rms_norm_matches_float64_and_is_row_invariant(lib, dim):
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(64, dim, generator=gen) * 3
    w = torch.randn(dim, generator=gen)
    out = ops.rms_norm(lib, x, w, 1e-6)
    xd = x.double()
    expected = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, torch.rms_norm(x, (dim,), w, 1e-6), atol=1e-5, rtol=1e-5)
    rows_alone_and_together(lambda t: ops.rms_norm(lib, t, w, 1e-6), x)


def test_residual_add_then_norm(lib):
    gen = torch.Generator().manual_seed(1)
    x, r = torch.randn(64, 576, generator=gen), torch.randn(64, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    total, normed = ops.rms_norm(lib, x, w, 1e-5, residual=r)
    assert torch.equal(total, x + r)
    assert torch.equal(normed, ops.rms_norm(lib, x + r, w, 1e-5))
    assert torch.equal(x, torch.randn(64, 576, generator=torch.Generator().manual_seed(1)))  # not in place


def test_qk_norm_over_a_strided_head_view(lib):
    """QK-norm normalizes each head of q where it sits inside the fused qkv rows."""
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(10, (4 + 2 * 2) * 64, generator=gen)
    q = qkv[:, : 4 * 64].view(10, 4, 64)
    w = torch.randn(64, generator=gen)
    out = ops.rms_norm(lib, q, w, 1e-6)
    assert torch.equal(out, ops.rms_norm(lib, q.contiguous().view(40, 64), w, 1e-6).view(10, 4, 64))
    torch.testing.assert_close(out, torch.rms_norm(q, (64,), w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 20])
def test_rope_equals_the_torch_path_bitwise(lib, head_dim):
    """Same multiplies and add as model/llama.py's apply_rope (and the query scale after it)."""
    gen = torch.Generator().manual_seed(head_dim)
    rotary = Rotary(head_dim, 10000.0, 512, torch.device("cpu"))
    positions = torch.randint(0, 512, (33,), generator=gen)
    cos, sin = rotary(positions)
    qkv = torch.randn(33, 9 * head_dim, generator=gen)
    qk = qkv[:, : 6 * head_dim].view(33, 6, head_dim)  # 4 query heads, 2 key heads, strided rows
    out = ops.rope(lib, qk, cos, sin, scaled_heads=4, scale=0.37)
    expected = apply_rope(qk, cos, sin)
    assert torch.equal(out[:, 4:], expected[:, 4:])
    assert torch.equal(out[:, :4], expected[:, :4] * 0.37)
    assert torch.equal(with_threads(2, lambda: ops.rope(lib, qk, cos, sin, 4, 0.37)), out)
    for i in (0, 17):
        assert torch.equal(ops.rope(lib, qk[i:i + 1], cos[i:i + 1], sin[i:i + 1], 4, 0.37), out[i:i + 1])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activations(lib, activation):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(48, 2 * 1539, generator=gen) * 4  # an odd width: the tail lanes too
    out = ops.gated_activation(lib, x, activation)
    gate, up = x.double().chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    torch.testing.assert_close(out.double(), act * up, atol=2e-6, rtol=2e-6)
    rows_alone_and_together(lambda t: ops.gated_activation(lib, t, activation), x)
