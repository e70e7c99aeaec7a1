"""Paged attention: write each step's K/V into cache slots, then attend over the pages of each
sequence's block table. K/V go through the layer's codec (kv_quant.PagedKV: identity for float
dtypes, quantize on write / dequantize on read for fp8, int8, int4), so there is one path.

With the native kernels loaded and float32 queries on the CPU, every row (decode and prefill alike)
attends its keys from the pages in place (kernels/attention.py), in one fixed order, so a row's
output is the same bits whatever else the step holds. Otherwise the torch path below runs (the
reference, and the CUDA path): decode tokens (one query each) are batched into one gather and one
SDPA call; prefill chunks run one SDPA call per sequence with a causal mask offset.

When the decode rows' block tables start with the same pages (a shared system prompt), those pages
are read once for the whole batch and attended with one matmul per KV head; only the rest of each
table is gathered per sequence, and one softmax spans both parts (cascade attention).

Cache layout, per layer, for K and for V (slot = page_id * page_size + offset):

    cache[num_pages, page_size, num_kv_heads, head_dim]
    block_table [p0, p1, p2]  ->  positions 0..page_size-1 live in page p0, the next page_size in p1 ...
"""

from __future__ import annotations

from dataclasses import dataclass

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.kernels import attention as native
from kvserve.model.flat_batch import FlatBatch
from kvserve.model.gpu_attention import GpuAttentionMetadata, attend_in_place
from kvserve.model.kv_quant import Fp8Codec, PagedKV, write_kv_pair


# --- per-step metadata --------------------------------------------------------------------------

@dataclass(slots=True)
class PrefillChunk:
    """One sequence with more than one query token in this step."""

    row: int  # first row of its tokens in the flat batch
    num_tokens: int  # query length
    start_pos: int  # position of its first query token
    block_table: torch.Tensor  # [ceil(context_len / page_size)] int64
    mask: torch.Tensor | None  # [num_tokens, context_len - key_start] bool (True = attend); None: causal
    first_page: int = 0  # pages before it hold no key any query sees (sliding window): not read

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens

    def key_start(self, page_size: int) -> int:
        """Position of the first key read."""
        return self.first_page * page_size


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner, shared by every layer."""

    page_size: int
    positions: torch.Tensor  # [T] int64, position of each query token
    slot_mapping: torch.Tensor  # [T] int64, cache slot each new K/V row is written to
    decode_rows: torch.Tensor  # [B] int64, rows of the single-token sequences in the flat batch
    decode_shared_pages: torch.Tensor  # [S] int64, leading pages every decode row's table starts with
    decode_block_tables: torch.Tensor  # [B, P] int64, the pages after those, padded with null page 0
    decode_mask: torch.Tensor  # [B, 1, 1, P * page_size] bool, True where position < context_len
    prefills: list[PrefillChunk]
    window: int | None = None  # sliding window: a query at position p sees keys at positions > p - window
    # fast paths, found on the host once per step (None: not applicable)
    decode_context: int | None = None  # one decode row: its context length (attend it unmasked)
    decode_first_page: int = 0  # logical page of decode_block_tables' first column (sliding window)
    native_rows: native.AttentionRows | None = None  # the native kernel's view of the rows, made once

    @property
    def num_decode(self) -> int:
        return self.decode_rows.shape[0]

    @classmethod
    def build(
        cls,
        start_positions: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Sequence i computes query_lens[i] tokens from position start_positions[i], over the pages
        block_tables[i] (which must cover start_positions[i] + query_lens[i] positions)."""
        flat = FlatBatch.build(start_positions, query_lens, block_tables, page_size)
        padded, num_pages, first_row = flat.block_tables, flat.num_pages, flat.first_row
        lens = np.array(query_lens, dtype=np.int64)  # [S]
        starts = np.array(start_positions, dtype=np.int64)  # [S]

        decode = [i for i, n in enumerate(query_lens) if n == 1]
        decode_idx = np.array(decode, dtype=np.int64)
        decode_width = max((num_pages[i] for i in decode), default=0)
        num_shared = 0
        if len(decode) > 1:  # full pages before every row's own page, the same in every table
            limit = min(start_positions[i] for i in decode) // page_size
            same = (padded[decode_idx, :limit] == padded[decode_idx[:1], :limit]).all(axis=0)
            num_shared = int(np.cumprod(same).sum())
        decode_shared_pages = padded[decode_idx[:1], :num_shared].reshape(-1)  # [S]
        decode_block_tables = padded[decode_idx, num_shared:decode_width]  # [B, P]
        context_lens = (starts + lens)[decode_idx]  # [B]
        span = np.arange(num_shared * page_size, decode_width * page_size)
        decode_mask = (span[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
        single = len(decode) == 1 and not num_shared

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        prefills = []
        for i, n in enumerate(query_lens):
            if n == 1:
                continue
            start = start_positions[i]
            mask = None
            if start > 0:  # query j sees context positions 0..start+j
                mask = tensor(np.arange(start + n)[None, :] <= (start + np.arange(n))[:, None])
            prefills.append(PrefillChunk(int(first_row[i]), n, start, tensor(padded[i, : num_pages[i]]), mask))
        return cls(page_size, tensor(flat.positions), tensor(flat.slot_mapping), tensor(first_row[decode_idx]),
                   tensor(decode_shared_pages), tensor(decode_block_tables), tensor(decode_mask), prefills,
                   decode_context=start_positions[decode[0]] + 1 if single else None)

    def with_window(self, window: int) -> AttentionMetadata:
        """The same step for a sliding-window layer: every mask also hides keys at positions
        <= p - window. Decode rows attend their whole tables (no shared-prefix split: the shared
        pages may lie outside some rows' windows)."""
        device = self.positions.device
        b = self.num_decode
        tables = torch.cat([self.decode_shared_pages[None].expand(b, -1), self.decode_block_tables], dim=1)
        last = self.positions.index_select(0, self.decode_rows)[:, None]  # [B, 1]
        # pages wholly before every row's window are not read at all
        first = max(0, int(last.min()) - window + 1) // self.page_size if b else 0
        tables = tables[:, first:]
        span = torch.arange(first * self.page_size, (first + tables.shape[1]) * self.page_size, device=device)
        decode_mask = ((span[None, :] <= last) & (span[None, :] > last - window))[:, None, None, :]
        prefills = []
        for c in self.prefills:
            # the chunk's first query sees keys from start_pos - window + 1 on, the later ones less
            first_page = max(0, c.start_pos - window + 1) // self.page_size
            q_pos = c.start_pos + torch.arange(c.num_tokens, device=device)[:, None]  # [n, 1]
            ctx = torch.arange(first_page * self.page_size, c.context_len, device=device)[None, :]  # [1, keys]
            prefills.append(dataclasses.replace(c, mask=(ctx <= q_pos) & (ctx > q_pos - window),
                                                first_page=first_page))
        return dataclasses.replace(
            self, decode_shared_pages=self.decode_shared_pages[:0], decode_block_tables=tables,
            decode_mask=decode_mask, prefills=prefills, window=window, decode_context=None,
            decode_first_page=first, native_rows=None)

    def rows_for_kernel(self) -> native.AttentionRows:
        """Each query row's position and block table, as the native kernel reads them (made on the
        first layer's call, reused by the others)."""
        if self.native_rows is None:
            num_rows = self.positions.shape[0]
            offsets = np.zeros(num_rows, dtype=np.int64)
            first = np.zeros(num_rows, dtype=np.int64)
            own_index = np.full(num_rows, -1, dtype=np.int64)
            b, parts, base, own = self.num_decode, [], 0, 0
            if b:
                decode_rows = self.decode_rows.numpy()
                shared, own_pages = self.decode_shared_pages.numpy(), self.decode_block_tables.numpy()
                tables = np.concatenate([np.broadcast_to(shared, (b, shared.shape[0])), own_pages], axis=1)
                parts.append(tables.reshape(-1))
                offsets[decode_rows] = np.arange(b) * tables.shape[1]
                first[decode_rows] = self.decode_first_page
                base = tables.size
            for c in self.prefills:
                rows = slice(c.row, c.row + c.num_tokens)
                offsets[rows] = base
                own_index[rows] = np.arange(own, own + c.num_tokens)
                parts.append(c.block_table.numpy())
                base += c.block_table.numel()
                own += c.num_tokens
            tables = np.concatenate(parts) if parts else np.zeros(1, dtype=np.int64)
            self.native_rows = native.AttentionRows(self.positions.contiguous(), torch.from_numpy(offsets),
                                                    torch.from_numpy(first), torch.from_numpy(tables),
                                                    torch.from_numpy(own_index))
        return self.native_rows


# --- the two operations -------------------------------------------------------------------------

def gather_pages(cache: PagedKV, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """block_tables [B, P] -> [B, P * page_size, kvh, hd] values; rotated as stored (a rotating
    codec's queries and outputs are rotated to match in paged_attention). The copy is worth it even
    where a view of the cache would do: attention over the fresh copy is faster than over the cache
    in place (B = 1, bf16, 1.5k context: 0.32 against 0.46 ms a layer, docs/performance.md)."""
    b, p = block_tables.shape
    return cache.read(block_tables, dtype, rotated=True).view(b, p * cache.shape[1], *cache.shape[2:])


_FROM_ENV = object()  # paged_attention's `lib` default: kernels.library()


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: PagedKV, v_cache: PagedKV,
    meta: AttentionMetadata | GpuAttentionMetadata, lib: kernels.KernelLibrary | None | object = _FROM_ENV,
) -> torch.Tensor:
    """Write this step's k, v [T, kv_heads, head_dim] into their slots, then attend:
    q [T, heads, head_dim] -> [T, heads, head_dim]. `lib`: the native kernels (None: the torch
    path), when the caller already knows them (the model, once per step)."""
    if isinstance(meta, GpuAttentionMetadata):  # the Triton kernel (the CUDA path)
        return attend_in_place(q, k, v, k_cache, v_cache, meta)
    if lib is _FROM_ENV:
        lib = kernels.library()
    if lib is not None and native.supports(lib, k_cache.codec.name, q.shape[-1], q):
        return _native_attention(lib, q, k, v, k_cache, v_cache, meta)
    num_heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads  # query heads sharing one KV head (GQA)
    # per-page scales: each prefill query must see its own page as decode would (kv_quant.py)
    own_pages = [(k_cache.own_page_views(k[c.row:c.row + c.num_tokens], c.start_pos, c.block_table),
                  v_cache.own_page_views(v[c.row:c.row + c.num_tokens], c.start_pos, c.block_table))
                 if k_cache.page_scaled else None for c in meta.prefills]
    write_kv_pair(k_cache, v_cache, k, v, meta.slot_mapping)
    # int KV is stored Hadamard-rotated (kv_quant.py): (Hq).(Hk) = q.k, and sum p (Hv) = H out
    rotated = k_cache.codec.rotates
    if rotated:
        q = k_cache.codec.rotate_rows(q)
    b = meta.num_decode
    out = torch.empty_like(q) if b < q.shape[0] else None
    if b:
        # query head h uses KV head h // group, so the group becomes SDPA's query-length axis
        if b == q.shape[0]:  # decode rows only: rows are in order
            qd = q.reshape(b, kv_heads, group, head_dim)  # [B, kvh, G, hd]
        else:
            qd = q.index_select(0, meta.decode_rows).view(b, kv_heads, group, head_dim)
        kd = gather_pages(k_cache, meta.decode_block_tables, q.dtype)  # [B, L, kvh, hd]
        vd = gather_pages(v_cache, meta.decode_block_tables, q.dtype)
        shared = meta.decode_shared_pages
        if shared.numel():
            ks = gather_pages(k_cache, shared[None], q.dtype)[0].transpose(0, 1)  # [kvh, S * ps, hd]
            vs = gather_pages(v_cache, shared[None], q.dtype)[0].transpose(0, 1)
            o = _attend_shared_and_own(qd.permute(1, 2, 0, 3), ks, vs, None, kd, vd,
                                       meta.decode_mask[:, 0, 0]).permute(2, 0, 1, 3)  # [B, kvh, G, hd]
        elif meta.decode_context is not None:  # one row: its context, unpadded, needs no mask
            ctx = meta.decode_context
            o = F.scaled_dot_product_attention(qd, kd[:, :ctx].transpose(1, 2), vd[:, :ctx].transpose(1, 2))
        else:
            o = F.scaled_dot_product_attention(qd, kd.transpose(1, 2), vd.transpose(1, 2),
                                               attn_mask=meta.decode_mask)  # [B, kvh, G, hd]
        if b == q.shape[0]:  # no prefill rows to add
            out = o.reshape(b, num_heads, head_dim)
        else:
            out.index_copy_(0, meta.decode_rows, o.reshape(b, num_heads, head_dim))

    for chunk, own in zip(meta.prefills, own_pages):
        n, ctx = chunk.num_tokens, chunk.context_len
        key_start = chunk.key_start(meta.page_size)
        qp = q[chunk.row : chunk.row + n].transpose(0, 1)  # [heads, n, hd]
        pages = chunk.block_table[None, chunk.first_page:]
        kp = gather_pages(k_cache, pages, q.dtype)[0, : ctx - key_start].transpose(0, 1)  # [kvh, keys, hd]
        vp = gather_pages(v_cache, pages, q.dtype)[0, : ctx - key_start].transpose(0, 1)
        if own is None:
            o = F.scaled_dot_product_attention(
                qp[None], kp[None], vp[None], attn_mask=chunk.mask, is_causal=chunk.mask is None,
                enable_gqa=True)[0]  # [heads, n, hd]
        else:  # each query sees the pages before its own page as stored, its own page as decode did
            positions = chunk.start_pos + torch.arange(n, device=q.device)  # [n]
            own_start = positions - positions % meta.page_size
            keys = torch.arange(key_start, ctx, device=q.device)[None, :]  # [1, keys]
            earlier = keys < own_start[:, None]  # [n, keys]
            upto = torch.arange(meta.page_size, device=q.device)[None, :] <= (positions - own_start)[:, None]
            if meta.window is not None:
                earlier &= keys > (positions - meta.window)[:, None]
                own_pos = own_start[:, None] + torch.arange(meta.page_size, device=q.device)[None, :]
                upto &= own_pos > (positions - meta.window)[:, None]
            o = _attend_shared_and_own(qp.reshape(kv_heads, group, n, head_dim), kp, vp, earlier,
                                       *(x.to(q.dtype) for x in own), upto).reshape(num_heads, n, head_dim)
        out[chunk.row : chunk.row + n] = o.transpose(0, 1)
    return v_cache.codec.rotate_rows(out) if rotated else out


def _native_attention(
    lib: kernels.KernelLibrary, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: PagedKV,
    v_cache: PagedKV, meta: AttentionMetadata,
) -> torch.Tensor:
    """paged_attention on the native kernel: the same write (for fp32 / bf16 caches done by the kernel
    call itself), then every row (decode and prefill alike) attends its keys from the pages in place,
    in one fixed order (kernels/src/attention.cpp)."""
    name = k_cache.codec.name
    if name in native.WRITES and v_cache.codec is k_cache.codec:
        return native.paged_attention(lib, q, name, (k_cache.data, k_cache.scales), (v_cache.data, v_cache.scales),
                                      meta.page_size, meta.rows_for_kernel(), meta.window,
                                      new_kv=(k, v, meta.slot_mapping))
    own = None
    if k_cache.page_scaled and meta.prefills:  # each prefill query sees its own page as decode did
        views = [(k_cache.own_page_views(k[c.row:c.row + c.num_tokens], c.start_pos, c.block_table),
                  v_cache.own_page_views(v[c.row:c.row + c.num_tokens], c.start_pos, c.block_table))
                 for c in meta.prefills]
        own = tuple(torch.cat(x).float().contiguous() if len(x) > 1 else x[0].float().contiguous()
                    for x in zip(*views))
    write_kv_pair(k_cache, v_cache, k, v, meta.slot_mapping)
    rotated = k_cache.codec.rotates
    if rotated:
        q = k_cache.codec.rotate_rows(q)
    tables = None
    if isinstance(k_cache.codec, Fp8Codec):
        tables = (k_cache.codec.lookup_table(q.device), v_cache.codec.lookup_table(q.device))
    out = native.paged_attention(lib, q, k_cache.codec.name, (k_cache.data, k_cache.scales),
                                 (v_cache.data, v_cache.scales), meta.page_size, meta.rows_for_kernel(),
                                 meta.window, tables, own)
    return v_cache.codec.rotate_rows(out) if rotated else out


def _attend_shared_and_own(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    k_own: torch.Tensor, v_own: torch.Tensor, own_mask: torch.Tensor,
) -> torch.Tensor:
    """One softmax over two key sets: k, v [kvh, L, hd], the same for all n queries (a shared prefix,
    attended with one matmul per KV head), and k_own, v_own [n, M, kvh, hd], each query's own keys.
    q [kvh, G, n, hd] (G query heads per KV head); mask [n, L] / own_mask [n, M] bool, True = attend
    (None: all of k). -> [kvh, G, n, hd]."""
    kv_heads, group, n, head_dim = q.shape
    length = k.shape[1]
    q = q * head_dim**-0.5
    # the G query heads of a KV head as columns of one matmul (no broadcast copy of k per head);
    # k @ q^T reads k's rows where they are (q @ k^T would copy k transposed first)
    shared = (k @ q.reshape(kv_heads, group * n, head_dim).transpose(1, 2)).transpose(1, 2)
    shared = shared.view(kv_heads, group, n, length)
    if mask is not None:
        shared = shared.masked_fill(~mask, float("-inf"))
    own = torch.einsum("kgnd,nmkd->kgnm", q, k_own).masked_fill(~own_mask, float("-inf"))  # [kvh, G, n, M]
    probs = torch.cat([shared, own], dim=-1).softmax(dim=-1)
    out = (probs[..., :length].reshape(kv_heads, group * n, length) @ v).view(kv_heads, group, n, head_dim)
    return out + torch.einsum("kgnm,nmkd->kgnd", probs[..., length:], v_own)
