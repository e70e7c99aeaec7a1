"""KV codecs: exact page bytes, round-trip error bounds, extreme values, and the property that makes
quantized pages safe to cache: a page's stored bytes depend on its tokens, not on how they were
written (at once, token by token, in chunks, or over a page a freed request left behind).

int codecs store rows Hadamard-rotated: their per-element bound (half a scale step) holds in that
basis (`read(..., rotated=True)`); back in the model's basis it becomes a bound on each row's norm."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvserve.config import KV_DTYPES, kv_bytes_per_page
from kvserve.model.kv_quant import ROTATE_LIMIT, Fp8Codec, IntCodec, KVCodec, codec_for, hadamard_rotate

ALL = list(KV_DTYPES)
QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8", "int4"]
INTS = ["int8", "int4"]
FP8_REL = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}  # half an ulp of the 3 / 2 mantissa bits
FP8_SUBNORMAL_HALF_STEP = {"fp8_e4m3": 2.0**-10, "fp8_e5m2": 2.0**-17}


def random_values(num_tokens: int, kvh: int = 3, hd: int = 64, magnitude: float = 1.0,
                  seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, kvh, hd, generator=g) * magnitude


def write_pages(codec: KVCodec, values: torch.Tensor, page_size: int = 16, first_page: int = 1,
                chunks: list[int] | None = None, num_pages: int | None = None):
    """Write values [T, kvh, hd] to consecutive slots from page `first_page` on, in chunks of the
    given sizes (one chunk by default). Returns (data, scales, page_ids covering the tokens)."""
    t, kvh, hd = values.shape
    used = -(-t // page_size)
    data, scales = codec.make_cache(num_pages or first_page + used + 1, page_size, kvh, hd)
    slots = torch.arange(first_page * page_size, first_page * page_size + t)
    start = 0
    for size in chunks or [t]:
        codec.write(data, scales, values[start:start + size], slots[start:start + size], page_size)
        start += size
    assert start == t
    return data, scales, torch.arange(first_page, first_page + used)


def read_tokens(codec: KVCodec, data, scales, page_ids, num_tokens: int, rotated: bool = False):
    out = codec.read(data, scales, page_ids, rotated=rotated)  # [P, page_size, kvh, hd]
    return out.reshape(-1, *out.shape[2:])[:num_tokens]


def stored_basis(codec: KVCodec, values: torch.Tensor) -> torch.Tensor:
    """What a codec quantizes: the values, Hadamard-rotated for int codecs."""
    if not codec.rotates:
        return values
    return hadamard_rotate(values.clamp(-ROTATE_LIMIT, ROTATE_LIMIT))


def assert_int_bounds(codec, data, scales, pages, values, page_size: int = 16) -> None:
    """Each stored element within half its page's scale step; each row read back in the model's
    basis within sqrt(head_dim) half-steps (in L2) of the value written."""
    n, hd = values.shape[0], values.shape[-1]
    half_step = token_scales(scales, pages, page_size, n) / 2  # [T, kvh, 1]
    stored = read_tokens(codec, data, scales, pages, n, rotated=True)
    assert ((stored - stored_basis(codec, values)).abs() <= half_step).all()
    out = read_tokens(codec, data, scales, pages, n)
    clipped = values.clamp(-ROTATE_LIMIT, ROTATE_LIMIT)
    row_err = (out - clipped).norm(dim=-1, keepdim=True)
    assert (row_err <= hd**0.5 * half_step * (1 + 1e-5) + 1e-6 * clipped.norm(dim=-1, keepdim=True)).all()


def stored_tokens(data: torch.Tensor, page_size: int, num_tokens: int, first_page: int = 1):
    """The stored bytes of the written tokens (slots past the last written one are unspecified)."""
    rows = data.view(torch.uint8).reshape(-1, *data.shape[2:])
    return rows[first_page * page_size:first_page * page_size + num_tokens]


def token_scales(scales: torch.Tensor, page_ids: torch.Tensor, page_size: int, num_tokens: int):
    """Per-token per-head scale [T, kvh, 1] of the page each token lives in."""
    return scales[page_ids].repeat_interleave(page_size, 0)[:num_tokens, :, None]


# -- codec_for and bytes ------------------------------------------------------------------------

def test_codec_for_maps_every_kv_dtype_to_its_storage():
    expected = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                "int8": torch.int8, "int4": torch.uint8}
    for name, storage in expected.items():
        assert codec_for(KV_DTYPES[name], torch.float32).storage_dtype == storage
    assert isinstance(codec_for("int4"), IntCodec) and isinstance(codec_for("fp8_e5m2"), Fp8Codec)
    with pytest.raises(ValueError, match="unknown kv dtype"):
        codec_for("int3")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("page_size,kvh,hd", [(16, 3, 64), (1, 1, 2), (32, 8, 128), (256, 2, 80)])
def test_cache_bytes_equal_the_engine_page_arithmetic(name, page_size, kvh, hd):
    """Data + scale tensors of a made cache, per page, are exactly what config.kv_bytes_per_page
    charges: K and V of every layer."""
    codec = codec_for(name)
    num_pages, num_layers = 7, 30
    data, scales = codec.make_cache(num_pages, page_size, kvh, hd)
    per_page = (data.nbytes + scales.nbytes) / num_pages
    assert per_page == codec.bytes_per_page(page_size, kvh, hd)
    assert 2 * num_layers * per_page == kv_bytes_per_page(num_layers, kvh, hd, page_size, KV_DTYPES[name])


def test_smollm2_page_bytes_by_hand():
    # 16 tokens x 3 kv heads x 64 dims, plus one float32 scale per kv head for int8/int4
    assert codec_for("fp16").bytes_per_page(16, 3, 64) == 6144
    assert codec_for("fp8_e4m3").bytes_per_page(16, 3, 64) == 3072
    assert codec_for("int8").bytes_per_page(16, 3, 64) == 3072 + 12
    assert codec_for("int4").bytes_per_page(16, 3, 64) == 1536 + 12


def test_int4_needs_an_even_head_dim():
    with pytest.raises(ValueError, match="even head_dim"):
        codec_for("int4").make_cache(2, 16, 1, 63)


# -- round trips ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,rel", [("fp32", 0.0), ("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_float_casts_round_to_nearest(name, rel):
    codec = codec_for(name)
    values = random_values(40)
    data, scales, pages = write_pages(codec, values)
    out = read_tokens(codec, data, scales, pages, 40)
    assert out.dtype == torch.float32
    assert ((out - values).abs() <= rel * values.abs()).all()


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_fp8_relative_error(name, scale):
    codec = codec_for(name, fp8_scale=scale)
    values = random_values(40, magnitude=3.0)
    data, scales, pages = write_pages(codec, values)
    out = read_tokens(codec, data, scales, pages, 40)
    top = codec.fp8_max * scale
    clipped = values.clamp(-top, top)  # beyond the range, values saturate
    bound = (FP8_REL[name] + 1e-6) * clipped.abs() + FP8_SUBNORMAL_HALF_STEP[name] * scale
    assert ((out - clipped).abs() <= bound).all()
    assert name == "fp8_e5m2" or scale == 1.0 or (values.abs() > top).any()  # e4m3 at 0.01 saturates


def test_fp8_calibrated_scale_uses_the_full_range():
    codec = codec_for("fp8_e4m3").with_amax(20.0)
    assert codec.scale == pytest.approx(20.0 / 448)
    values = random_values(16) * 5  # within +-20 mostly; the rest saturate at +-20
    data, scales, pages = write_pages(codec, values)
    out = read_tokens(codec, data, scales, pages, 16)
    clipped = values.clamp(-20, 20)
    assert ((out - clipped).abs() <= 2.0**-4 * clipped.abs() + 2.0**-10 * codec.scale + 1e-6).all()
    assert codec_for("fp8_e5m2").with_amax(0.0).scale == 1.0


@pytest.mark.parametrize("name", INTS)
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 50.0])
@pytest.mark.parametrize("hadamard", [True, False])
def test_int_error_within_half_a_scale_step(name, magnitude, hadamard):
    codec = replace(codec_for(name), hadamard=hadamard)
    values = random_values(45, magnitude=magnitude)
    data, scales, pages = write_pages(codec, values)
    assert_int_bounds(codec, data, scales, pages, values)
    if not hadamard:  # unrotated, the per-element bound holds in the model's basis too
        step = token_scales(scales, pages, 16, 45)
        assert ((read_tokens(codec, data, scales, pages, 45) - values).abs() <= step / 2).all()


def test_hadamard_rotation_is_an_involution_that_keeps_dot_products():
    x, y = random_values(8, 2, 64, seed=1), random_values(8, 2, 64, seed=2)
    assert torch.allclose(hadamard_rotate(hadamard_rotate(x)), x, atol=1e-6)
    assert torch.allclose((hadamard_rotate(x) * hadamard_rotate(y)).sum(-1), (x * y).sum(-1), atol=1e-5)
    odd = random_values(3, 1, 80)  # 80 = 5 blocks of 16
    assert torch.allclose(hadamard_rotate(hadamard_rotate(odd)), odd, atol=1e-6)


def test_rotation_spreads_an_outlier_channel():
    """Why int codecs rotate: one big K channel sets the page scale for all 64 channels unrotated."""
    values = random_values(16, 1, 64)
    values[..., 7] *= 20
    errors = {}
    for hadamard in (False, True):
        codec = replace(codec_for("int4"), hadamard=hadamard)
        data, scales, pages = write_pages(codec, values)
        errors[hadamard] = (read_tokens(codec, data, scales, pages, 16) - values).pow(2).mean()
    assert errors[True] < 0.5 * errors[False]


@pytest.mark.parametrize("name", INTS)
def test_int_scale_is_the_smallest_power_of_two_that_covers_the_page(name):
    codec = codec_for(name)
    levels = 2 ** (codec.kv_dtype.bits - 1)
    values = random_values(32, magnitude=7.0)
    data, scales, pages = write_pages(codec, values)
    amax = stored_basis(codec, values).abs().view(2, 16, 3, 64).amax(dim=(1, 3))  # [pages, kvh]
    s = scales[pages]
    assert (amax < levels * s).all() and (amax >= levels * s / 2).all()
    assert torch.equal(torch.log2(s), torch.log2(s).round())  # powers of two
    # int4 packs two codes per byte; every code is in range and the byte layout is 16 x 3 x 32
    assert data.shape[-1] == 64 * codec.kv_dtype.bits // 8


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_returns_the_requested_compute_dtype(name, dtype):
    codec = codec_for(name, dtype)
    data, scales, pages = write_pages(codec, random_values(16))
    assert codec.read(data, scales, pages).dtype == dtype
    assert codec.read(data, scales, pages, dtype=torch.float32).dtype == torch.float32


def test_read_keeps_the_shape_of_a_block_table():
    codec = codec_for("int4")
    data, scales, _ = write_pages(codec, random_values(64))
    block_tables = torch.tensor([[1, 2, 0], [3, 4, 2]])
    assert codec.read(data, scales, block_tables).shape == (2, 3, 16, 3, 64)


# -- extreme values ---------------------------------------------------------------------------------

def extreme_cases() -> dict[str, torch.Tensor]:
    base = random_values(20)
    outlier = base.clone()
    outlier[7, 1, 13] = 1e4
    return {
        "huge": base * 1e6,
        "near float32 max": base.sign() * 3e38,
        "zeros": torch.zeros(20, 3, 64),
        "single outlier": outlier,
        "tiny": base * 1e-30,
    }


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("case", list(extreme_cases()))
def test_no_nan_or_inf_on_extreme_values(name, case):
    codec = codec_for(name)
    values = extreme_cases()[case]
    data, scales, pages = write_pages(codec, values)
    out = read_tokens(codec, data, scales, pages, 20)
    assert torch.isfinite(out).all()
    assert torch.isfinite(scales).all()
    if isinstance(codec, IntCodec):
        assert_int_bounds(codec, data, scales, pages, values)
    if case == "zeros" and not isinstance(codec, IntCodec):
        assert (out == 0).all()
    if case == "zeros" and isinstance(codec, IntCodec):
        assert out.abs().max() <= 2.0**-116  # mid-rise codes: half the smallest scale, rotated back


@pytest.mark.parametrize("name", ["fp16", "fp8_e4m3", "fp8_e5m2"])
def test_out_of_range_values_saturate(name):
    codec = codec_for(name)
    top = 65504.0 if name == "fp16" else torch.finfo(codec.storage_dtype).max
    values = torch.full((1, 1, 2), 1e9)
    values[0, 0, 1] = -1e9
    data, scales, pages = write_pages(codec, values)
    assert read_tokens(codec, data, scales, pages, 1).flatten().tolist() == [top, -top]


def test_single_outlier_costs_only_its_own_page_and_head():
    codec = codec_for("int8")
    values = random_values(32)
    values[3, 1, 5] = 1e4  # page 1 (tokens 0..15), head 1
    data, scales, pages = write_pages(codec, values)
    out = read_tokens(codec, data, scales, pages, 32)
    err = (out - values).abs()
    assert err[16:].max() < 0.05  # page 2 untouched
    assert err[:16, [0, 2]].max() < 0.05  # other heads of page 1 untouched
    assert_int_bounds(codec, data, scales, pages, values)


# -- write history never changes a page --------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_token_by_token_equals_at_once(name):
    """Decode writes a page one token at a time, with magnitudes growing so int scales keep rising;
    the stored bytes are identical to writing the page at once."""
    codec = codec_for(name)
    values = random_values(40) * torch.logspace(-3, 3, 40)[:, None, None]
    at_once = write_pages(codec, values)
    one_by_one = write_pages(codec, values, chunks=[1] * 40)
    assert torch.equal(stored_tokens(at_once[0], 16, 40), stored_tokens(one_by_one[0], 16, 40))
    assert torch.equal(at_once[1], one_by_one[1])


@pytest.mark.parametrize("name", INTS)
def test_a_fresh_page_forgets_the_freed_request_that_used_it(name):
    """A write at offset 0 starts the page over: a big-valued previous owner leaves no trace."""
    codec = codec_for(name)
    old = random_values(32, magnitude=1000.0, seed=1)
    new = random_values(20, seed=2)
    data, scales, pages = write_pages(codec, old)
    for t in range(20):  # the new owner fills pages 1.. token by token
        codec.write(data, scales, new[t:t + 1], torch.tensor([16 + t]), 16)
    clean = write_pages(codec, new, num_pages=data.shape[0])
    assert torch.equal(data[1, :16], clean[0][1, :16]) and torch.equal(data[2, :4], clean[0][2, :4])
    assert torch.equal(scales[1:3], clean[1][1:3])


@pytest.mark.parametrize("name", QUANTIZED)
def test_copied_pages_read_back_the_same(name):
    """Runner page copies and swaps move data[p] and scales[p] together."""
    codec = codec_for(name)
    data, scales, pages = write_pages(codec, random_values(16), num_pages=4)
    data[3], scales[3] = data[1], scales[1]
    assert torch.equal(codec.read(data, scales, torch.tensor([3])),
                       codec.read(data, scales, torch.tensor([1])))


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(ALL), page_size=st.sampled_from([1, 2, 4, 16]),
       kvh=st.integers(1, 3), hd=st.sampled_from([2, 8, 64]), num_tokens=st.integers(1, 40),
       exponent=st.integers(-30, 30), growth=st.booleans(), seed=st.integers(0, 2**31 - 1),
       cuts=st.lists(st.integers(1, 40), max_size=6))
def test_write_read_property(name, page_size, kvh, hd, num_tokens, exponent, growth, seed, cuts):
    """Any chunking of the writes stores the same bytes as one write, and every codec reads back
    within its bound: half a scale step for int codecs, half an ulp for float codecs."""
    codec = codec_for(name)
    values = random_values(num_tokens, kvh, hd, magnitude=2.0**exponent, seed=seed)
    if growth:  # later tokens larger: every int page's scale rises while it fills
        values = values * torch.logspace(0, 4, num_tokens)[:, None, None]
    assume(torch.isfinite(values).all())
    bounds = sorted({c for c in cuts if c < num_tokens})
    chunks = [b - a for a, b in zip([0, *bounds], [*bounds, num_tokens])]
    data, scales, pages = write_pages(codec, values, page_size)
    chunked = write_pages(codec, values, page_size, chunks=chunks)
    assert torch.equal(stored_tokens(data, page_size, num_tokens),
                       stored_tokens(chunked[0], page_size, num_tokens))
    assert torch.equal(scales, chunked[1])

    out = read_tokens(codec, data, scales, pages, num_tokens)
    assert torch.isfinite(out).all()
    err = (out - values).abs()
    if isinstance(codec, IntCodec):
        assert_int_bounds(codec, data, scales, pages, values, page_size)
    elif isinstance(codec, Fp8Codec):
        clipped = values.clamp(-codec.fp8_max, codec.fp8_max)
        bound = FP8_REL[name] * clipped.abs() + FP8_SUBNORMAL_HALF_STEP[name]
        assert ((out - clipped).abs() <= bound).all()
    else:
        rel = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}[name]
        tiny = {"fp32": 0.0, "fp16": 2.0**-25, "bf16": 2.0**-134}[name]  # half a subnormal step
        clipped = values.clamp(-65504, 65504) if name == "fp16" else values
        assert ((out - clipped).abs() <= rel * clipped.abs() + tiny).all()
