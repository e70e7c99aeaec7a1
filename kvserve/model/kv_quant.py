"""KV cache codecs: how K and V rows are stored in their pages (quantize on write) and turned back
into compute-dtype values when attention reads the pages (dequantize on read).

One codec per `kv_cache_dtype` (float dtypes: a plain cast); attention writes and reads through it:

    data   [num_pages, page_size, num_kv_heads, head_dim]        fp32/fp16/bf16/fp8 elements, or int8
           [num_pages, page_size, num_kv_heads, head_dim // 2]   int4: two codes per uint8
    scales [num_pages, num_kv_heads] float32                     int8/int4: one scale per page per head
           [num_pages, 0]                                        float codecs: empty, zero bytes

so page moves carry `data[p]` and `scales[p]` alike, and `bytes_per_page` (data + scales of one page)
is exactly `config.kv_bytes_per_page` per layer.

fp8 (e4m3, e5m2) uses one per-tensor scale, a float fixed at start-up (1.0, or amax / fp8 max from a
calibration pass); values beyond the fp8 range saturate instead of turning into NaN.

int8/int4: rows are first Hadamard-rotated (spreads K's outlier channels; see IntCodec). Pages
fill token by token, so a page's scale must be able to grow after some of its tokens are stored.
Re-quantizing those tokens with round-to-nearest would round twice, and the stored page would then
depend on how its tokens were chunked: a page written during a prefill would differ from the same
tokens written one decode step at a time. Instead every scale is a power of two and codes are
floors (a mid-rise quantizer):

    scale  s = the smallest power of two with amax < 2**(bits-1) * s   (amax over the page's tokens
                                                                        and head_dim, per KV head)
    code   q = floor(x / s)             in [-2**(bits-1), 2**(bits-1) - 1], never clamped
    value  x' = (q + 0.5) * s           so |x - x'| <= s / 2

When a new token raises the scale from s to s * 2**k, the stored codes become floor(q / 2**k), and
floor(floor(y) / n) == floor(y / n) for any integer n: the page holds exactly the codes it would
hold had all its tokens been written at once with the final scale. A page's stored tokens are a
function of those tokens only, never of the write history (slots past the last written token are
unspecified). The price: a power-of-two scale is up to 2x (on average ~1.4x) coarser than
amax / 127, about half a bit. A write at offset 0 of a page starts that page afresh (its old
contents belong to a freed request).

A token's dequantized value depends on its page-mates (they set the scale), including ones written
after it. In a decode step a query sees its own page holding the tokens up to itself; in a prefill
chunk the page already holds later tokens too. So that outputs do not depend on how a sequence was
chunked (prefill, decode, recompute after preemption), attention gives each prefill query its own
page as decode would have seen it (`causal_page_views`), and the earlier pages, which are full,
as stored. A partly matching page would carry another request's tokens into the scale, so int8/int4
prefix hits are whole pages (CacheConfig.partial_page_hits). fp8 (elementwise) has none of this.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from kvserve.config import KV_DTYPES, KVDtype
from kvserve.model.hadamard import hadamard_rotate
from kvserve.model.host_heap import zeroed

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FLOAT_STORAGE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_FP8_STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MIN_SCALE_EXP = -120  # int scales never go below 2**-120 (an all-zero page still has a finite scale)
ROTATE_LIMIT = 2.0**112  # rotating codecs saturate |x| here (~5e33; activations are nowhere near)


@dataclass(frozen=True, slots=True)
class KVCodec:
    """Plain cast codec (fp32, fp16, bf16); the base of the quantizing codecs."""

    kv_dtype: KVDtype
    storage_dtype: torch.dtype
    compute_dtype: torch.dtype = torch.float32  # what `read` returns by default

    @property
    def name(self) -> str:
        return self.kv_dtype.name

    def data_shape(self, num_pages: int, page_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
        return (num_pages, page_size, num_kv_heads, head_dim)

    def make_cache(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                   device: torch.device | str = "cpu", num_layers: int | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed (data, scales) pair for K or for V of one layer; with `num_layers`, one pair for
        all of them, K and V: data [num_layers, 2, num_pages, ...], scales [num_layers, 2, num_pages, n]."""
        lead = () if num_layers is None else (num_layers, 2)
        shape = (*lead, *self.data_shape(num_pages, page_size, num_kv_heads, head_dim))
        if torch.device(device).type == "cpu":  # zeroed by the kernel as pages are first written
            data = zeroed(shape, self.storage_dtype)
        else:
            data = torch.zeros(shape, dtype=self.storage_dtype, device=device)
        scales = torch.zeros(*lead, num_pages, self.scales_per_page(num_kv_heads), device=device)
        return data, scales

    def head_dim_of(self, data: torch.Tensor) -> int:
        return data.shape[-1]

    def scales_per_page(self, num_kv_heads: int) -> int:
        return num_kv_heads if self.kv_dtype.scale_bytes_per_page_head else 0

    def bytes_per_page(self, page_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one page of K (or of V) of one layer takes: data plus scales. Twice this, times the
        number of layers, is `config.kv_bytes_per_page`."""
        elements = page_size * num_kv_heads * head_dim
        return elements * self.kv_dtype.bits // 8 + num_kv_heads * self.kv_dtype.scale_bytes_per_page_head

    def write(self, cache: torch.Tensor, scales: torch.Tensor, values: torch.Tensor,
              slot_mapping: torch.Tensor, page_size: int) -> None:
        """Store values [T, kvh, hd] at slots [T] (slot = page_id * page_size + offset)."""
        kvh, hd = cache.shape[2:]
        encoded = self.encode(values)
        if cache.element_size() == 1 and cache.is_floating_point():  # index_copy_ has no fp8 kernel
            cache, encoded = cache.view(torch.uint8), encoded.view(torch.uint8)
        cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, encoded)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        if self.storage_dtype == torch.float16:  # saturate: 1e6 becomes 65504, not inf
            values = values.clamp(-65504.0, 65504.0)
        return values.to(self.storage_dtype)

    @property
    def rotates(self) -> bool:
        """True when values are stored Hadamard-rotated (see `hadamard_rotate`)."""
        return False

    def rotate_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Into (and, being an involution, out of) the basis the cache stores: [..., head_dim]."""
        return hadamard_rotate(x) if self.rotates else x

    def read(self, cache: torch.Tensor, scales: torch.Tensor, page_ids: torch.Tensor,
             dtype: torch.dtype | None = None, rotated: bool = False) -> torch.Tensor:
        """Pages page_ids [...] (any shape, e.g. a block table) -> [..., page_size, kvh, hd] values.
        `rotated=True` skips the inverse rotation of a rotating codec: attention rotates its queries
        and outputs instead, which costs O(queries), not O(context)."""
        stored = cache.index_select(0, page_ids.reshape(-1))
        out = self.decode(stored, scales, page_ids.reshape(-1))
        if self.rotates and not rotated:
            out = hadamard_rotate(out)
        out = out.to(dtype or self.compute_dtype)
        return out.view(*page_ids.shape, *out.shape[1:])

    def decode(self, stored: torch.Tensor, scales: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        return stored


@dataclass(frozen=True, slots=True)
class Fp8Codec(KVCodec):
    """fp8 storage with one per-tensor scale: stored = saturate(x / scale), read = stored * scale."""

    scale: float = 1.0

    @property
    def fp8_max(self) -> float:
        return torch.finfo(self.storage_dtype).max

    def with_amax(self, amax: float) -> Fp8Codec:
        """The codec calibrated for values up to `amax`: scale = amax / fp8 max (1.0 if amax is 0)."""
        return replace(self, scale=fp8_scale_for(amax, self.storage_dtype))

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        x = values.float()
        if self.scale != 1.0:
            x = x / self.scale
        return x.clamp(-self.fp8_max, self.fp8_max).to(self.storage_dtype)  # fp8 overflow would be NaN

    def lookup_table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[256] float32: stored byte -> value * scale (what `decode` reads; the native kernel too)."""
        return _fp8_table(self.storage_dtype, self.scale, torch.device(device))

    def decode(self, stored: torch.Tensor, scales: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        # a 256-entry table of byte -> value * scale: ~4x faster on CPU than casting fp8 to float32
        table = self.lookup_table(stored.device)
        return table.index_select(0, stored.view(torch.uint8).reshape(-1).int()).view(stored.shape)


@functools.lru_cache(maxsize=16)
def _fp8_table(storage_dtype: torch.dtype, scale: float, device: torch.device) -> torch.Tensor:
    values = torch.arange(256, dtype=torch.uint8).view(storage_dtype).float() * scale
    return values.nan_to_num(0.0).to(device)  # the NaN codes are never written (writes saturate)


def fp8_scale_for(amax: float, storage_dtype: torch.dtype) -> float:
    amax = float(amax)
    if not amax > 0 or amax == float("inf"):
        return 1.0
    return amax / torch.finfo(storage_dtype).max


@dataclass(frozen=True, slots=True)
class IntCodec(KVCodec):
    """Symmetric int8 / int4 with per-page-per-head power-of-two scales (see the module docstring).

    Rows are Hadamard-rotated before quantizing (`hadamard`, on by default): K has a few outlier
    channels that would set every page's scale; the rotation spreads them over all channels, which
    halves K's rounding error at no byte cost (measured on SmolLM2: int4 K rms error 30% -> 16%).

    int4 packs head_dim in halves: byte j of a row holds code j (low nibble) and code j + hd/2 (high
    nibble), each stored as code + 8 in 0..15."""

    hadamard: bool = True

    @property
    def rotates(self) -> bool:
        return self.hadamard

    @property
    def bits(self) -> int:
        return self.kv_dtype.bits

    def data_shape(self, num_pages: int, page_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
        if self.bits == 4 and head_dim % 2:
            raise ValueError(f"int4 KV needs an even head_dim, got {head_dim}; use int8")
        return (num_pages, page_size, num_kv_heads, head_dim * self.bits // 8)

    def head_dim_of(self, data: torch.Tensor) -> int:
        return data.shape[-1] * 8 // self.bits

    # -- codes <-> stored bytes -----------------------------------------------------------------
    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Integer codes [..., hd] in range -> storage [..., hd * bits / 8]."""
        if self.bits == 8:
            return codes.to(torch.int8)
        u = (codes + 8).to(torch.uint8)
        half = u.shape[-1] // 2
        return u[..., :half] | (u[..., half:] << 4)

    def unpack(self, stored: torch.Tensor) -> torch.Tensor:
        """Storage -> integer codes [..., hd] (int16 for int4, int8 for int8)."""
        if self.bits == 8:
            return stored
        return torch.cat([stored & 15, stored >> 4], dim=-1).to(torch.int16) - 8

    # -- write ----------------------------------------------------------------------------------
    def prepare(self, values: torch.Tensor) -> torch.Tensor:
        """The float32 rows `write` quantizes: values, Hadamard-rotated when the codec rotates."""
        x = values.detach().float()
        if self.hadamard:  # clamp first: a rotated row's max can grow by sqrt(block) <= 2**8
            x = hadamard_rotate(x.clamp(-ROTATE_LIMIT, ROTATE_LIMIT))
        return x

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        """Smallest power of two s with amax < 2**(bits-1) * s, and at least 2**MIN_SCALE_EXP."""
        # amax = m * 2**e with 0.5 <= m < 1, so amax < 2**e; zero maps to the smallest scale
        _, exponent = torch.frexp(amax.clamp(min=2.0**-126))
        return torch.ldexp(torch.ones_like(amax), (exponent - (self.bits - 1)).clamp_(min=MIN_SCALE_EXP))

    def write(self, cache: torch.Tensor, scales: torch.Tensor, values: torch.Tensor,
              slot_mapping: torch.Tensor, page_size: int) -> None:
        """Raise each touched page's scale to cover the new tokens, shift its stored codes down to
        the new scale (exact, see the module docstring), then store the new tokens' codes. Works on
        the [num_pages, kvh] scales in place, token by token, so a decode step costs O(T)."""
        x = self.prepare(values)
        page_ids = torch.div(slot_mapping, page_size, rounding_mode="floor")  # [T]
        index = page_ids[:, None].expand(-1, x.shape[1])  # [T, kvh]
        # a write at offset 0 starts its page afresh (the old contents belong to a freed request)
        kept = (slot_mapping - page_ids * page_size != 0).float()[:, None].expand_as(index)
        scales.scatter_reduce_(0, index, kept, "prod")
        before = scales.index_select(0, page_ids)  # [T, kvh]: each token's page scale, 0 if fresh
        scales.scatter_reduce_(0, index, self.scale_for(x.abs().amax(dim=-1)), "amax")
        after = scales.index_select(0, page_ids)  # [T, kvh]: the raised scales
        grown = (after != before) & (before > 0)  # pages with stored tokens whose scale rose
        if bool(grown.any()):
            self._requantize(cache, page_ids, before, after, grown.any(dim=1).nonzero().squeeze(1))
        # float64: x / 2**e is exact for every float32 x, so floor sees the true quotient
        codes = torch.floor(x.double() / after.double()[:, :, None])  # [T, kvh, hd]
        kvh, width = cache.shape[2:]
        cache.view(-1, kvh, width).index_copy_(0, slot_mapping, self.pack(codes))

    def _requantize(self, cache: torch.Tensor, page_ids: torch.Tensor, before: torch.Tensor,
                    after: torch.Tensor, tokens: torch.Tensor) -> None:
        """Shift the stored codes of the pages of `tokens` from scale `before` to `after`."""
        pages, inverse = torch.unique(page_ids[tokens], return_inverse=True)
        one_token = tokens.new_empty(pages.shape).scatter_(0, inverse, tokens)  # any token of each page
        ratio = (before[one_token].double() / after[one_token].double())[:, None, :, None]  # 2**-k
        codes = self.unpack(cache.index_select(0, pages)).double()  # [P, page_size, kvh, hd]
        cache.index_copy_(0, pages, self.pack(torch.floor(codes * ratio)))

    # -- read -----------------------------------------------------------------------------------
    def causal_page_views(self, rows: torch.Tensor, row_scales: torch.Tensor, page_size: int,
                          first_query: int) -> torch.Tensor:
        """What each query row sees of its own page, as a decode step at that row would: the page's
        rows up to it, dequantized at the page's scale as of that row.

        rows [L, kvh, hd] are prepared values (or values read back at their scale) of consecutive
        positions starting at a page boundary; row_scales [L, kvh] the scale each row asks for.
        Returns [L - first_query, page_size, kvh, hd] float32 for rows first_query.. ; entries past
        the query's own offset are unspecified. floor(x / s) at the later, coarser scale equals the
        stored code shifted down (module docstring), so these are exactly the values decode reads."""
        length, kvh, hd = rows.shape
        pad = -length % page_size
        pages = torch.nn.functional.pad(rows, (0, 0, 0, 0, 0, pad)).view(-1, page_size, kvh, hd)
        running = torch.nn.functional.pad(row_scales, (0, 0, 0, pad)).view(-1, page_size, kvh)
        running = running.cummax(dim=1).values.view(-1, kvh)[first_query:length]  # [Q, kvh]
        page_of = torch.arange(first_query, length, device=rows.device) // page_size
        s = running.double()[:, None, :, None]
        return ((torch.floor(pages[page_of].double() / s) + 0.5) * s).float()

    def decode(self, stored: torch.Tensor, scales: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        s = scales.index_select(0, page_ids)[:, None, :, None]  # [N, 1, kvh, 1]
        if self.bits == 8:
            return stored.float().add_(0.5).mul_(s)  # (code + 0.5) * s, exact
        # int4 bytes hold code + 8 in each nibble: (nibble - 7.5) * s
        return torch.cat([stored & 15, stored >> 4], dim=-1).float().sub_(7.5).mul_(s)


@dataclass(slots=True)
class PagedKV:
    """One layer's K (or V) cache behind its codec (identity for float dtypes), as attention sees
    it: `shape` is the logical [num_pages, page_size, num_kv_heads, head_dim] whatever the storage."""

    codec: KVCodec
    data: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int, int]:
        num_pages, page_size, num_kv_heads, _ = self.data.shape
        return num_pages, page_size, num_kv_heads, self.head_dim

    @property
    def head_dim(self) -> int:
        return self.codec.head_dim_of(self.data)

    @property
    def page_scaled(self) -> bool:
        """True when a page's scale is shared by its tokens (int8/int4), not fixed (fp8)."""
        return self.scales.shape[-1] > 0

    def write(self, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.codec.write(self.data, self.scales, values, slot_mapping, self.data.shape[1])

    def read(self, page_ids: torch.Tensor, dtype: torch.dtype | None = None,
             rotated: bool = False) -> torch.Tensor:
        return self.codec.read(self.data, self.scales, page_ids, dtype, rotated)

    def own_page_views(self, new_rows: torch.Tensor, start_pos: int, block_table: torch.Tensor,
                       ) -> torch.Tensor:
        """For a prefill chunk whose rows new_rows [n, kvh, hd] go to positions start_pos.., before
        they are written: what each of its queries sees of its own page (IntCodec.causal_page_views),
        [n, page_size, kvh, hd] in the stored (rotated) basis."""
        page_size = self.data.shape[1]
        lead = start_pos % page_size  # rows of the first page written before this chunk
        rows = self.codec.prepare(new_rows)
        row_scales = self.codec.scale_for(rows.abs().amax(dim=-1))
        if lead:
            page = block_table[start_pos // page_size:][:1]
            earlier = self.read(page, torch.float32, rotated=True)[0, :lead]  # at the page's scale
            rows = torch.cat([earlier, rows])
            row_scales = torch.cat([self.scales.index_select(0, page).expand(lead, -1), row_scales])
        return self.codec.causal_page_views(rows, row_scales, page_size, lead)


def write_kv_pair(k_cache: PagedKV, v_cache: PagedKV, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write one layer's K and V rows. When the two caches are the halves of one tensor (the
    runner's [layers, 2, pages, ...] layout), one codec call covers both: V's page p is page
    num_pages + p of the pair, which halves the per-step cost of the small ops."""
    both = _joined(k_cache.data, v_cache.data), _joined(k_cache.scales, v_cache.scales)
    if both[0] is None or both[1] is None or k_cache.codec is not v_cache.codec:
        k_cache.write(k, slot_mapping)
        v_cache.write(v, slot_mapping)
        return
    num_pages, page_size = k_cache.data.shape[:2]
    slots = torch.cat([slot_mapping, slot_mapping + num_pages * page_size])
    k_cache.codec.write(both[0], both[1], torch.cat([k, v]), slots, page_size)


def _joined(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """first and second stacked on dim 0, as a view, when second starts where first ends."""
    if not (first.is_contiguous() and second.is_contiguous() and first.shape == second.shape
            and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
            and second.storage_offset() == first.storage_offset() + first.numel()):
        return None
    return first.as_strided((2 * first.shape[0], *first.shape[1:]), first.stride(), first.storage_offset())


def codec_for(kv_dtype: KVDtype | str, model_dtype: torch.dtype | str = torch.float32,
              fp8_scale: float = 1.0) -> KVCodec:
    """The codec of a resolved kv dtype (`config.resolve_kv_dtype` turns "auto" into the model's
    dtype). `model_dtype` is what `read` returns: the dtype attention computes in."""
    if isinstance(kv_dtype, str):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown kv dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
        kv_dtype = KV_DTYPES[kv_dtype]
    compute = _TORCH_DTYPES[model_dtype] if isinstance(model_dtype, str) else model_dtype
    if kv_dtype.name in _FLOAT_STORAGE:
        return KVCodec(kv_dtype, _FLOAT_STORAGE[kv_dtype.name], compute)
    if kv_dtype.name in _FP8_STORAGE:
        return Fp8Codec(kv_dtype, _FP8_STORAGE[kv_dtype.name], compute, scale=fp8_scale)
    if kv_dtype.name in ("int8", "int4"):
        return IntCodec(kv_dtype, torch.int8 if kv_dtype.bits == 8 else torch.uint8, compute)
    raise ValueError(f"no KV codec for {kv_dtype.name!r}")
