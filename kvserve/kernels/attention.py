"""ctypes wrapper of the native paged-attention kernel (src/attention.cpp): float32 queries attend
their keys straight from the cache pages, through the layer's KV codec; for fp32 and bf16 caches the
step's new K/V rows are written into their slots by the same call.

Which rows see which keys crosses the boundary as `AttentionRows` (built once per step by
model/attention.py); the caches and codec parameters are passed per layer."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvserve.kernels import KernelLibrary
from kvserve.kernels.api import Codec, KvsAttention, Schedule

# codec name (model/kv_quant.py) -> the kernel's codec
CODECS = {"fp32": Codec.FP32, "bf16": Codec.BF16, "fp16": Codec.FP16, "fp8_e4m3": Codec.FP8, "fp8_e5m2": Codec.FP8,
          "int8": Codec.INT8, "int4": Codec.INT4}
# codecs whose write (a plain cast) the kernel does itself, with the torch cast's bits
WRITES = frozenset({"fp32", "bf16"})


@dataclass(frozen=True, slots=True)
class AttentionRows:
    """Per query row: its position, where its block table starts in `tables` and which logical page
    that first entry is (a sliding-window table may start past page 0), and which own-page view it
    reads (int codecs' prefill rows; -1: its own page is read from the cache)."""

    positions: torch.Tensor  # [T] int64
    table_offsets: torch.Tensor  # [T] int64
    table_first: torch.Tensor  # [T] int64
    tables: torch.Tensor  # [N] int64, every row's table, concatenated
    own_index: torch.Tensor | None  # [T] int64, or None when no row has an own-page view


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def supports(lib: KernelLibrary, codec: str, head_dim: int, q: torch.Tensor) -> bool:
    """True when the kernel runs this codec and head_dim for these queries (float32 on the CPU)."""
    if codec not in CODECS or q.dtype != torch.float32 or q.device.type != "cpu":
        return False
    return head_dim % (2 * lib.simd_width if codec == "int4" else lib.simd_width) == 0


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, kv_heads, head_dim] with heads contiguous (any token stride), as the kernel reads new rows."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def paged_attention(
    lib: KernelLibrary, q: torch.Tensor, codec: str, k: tuple[torch.Tensor, torch.Tensor],
    v: tuple[torch.Tensor, torch.Tensor], page_size: int, rows: AttentionRows, window: int | None,
    fp8_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    own: tuple[torch.Tensor, torch.Tensor] | None = None, num_threads: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, schedule: str = "auto",
) -> torch.Tensor:
    """q [T, heads, head_dim] float32 (rows may be strided) -> out [T, heads, head_dim]: softmax of
    q.k / sqrt(head_dim) over each row's keys lo..p, read from the pages k = (data, scales) and
    v = (data, scales) [num_pages, page_size, kv_heads, ...] in place. `own`: float32 views
    [n, page_size, kv_heads, head_dim] that rows with own_index >= 0 read their own page from.
    `new_kv` (codecs in WRITES): (k, v [T, kv_heads, head_dim] float32, slot_mapping [T]), written
    into their slots before any row reads them."""
    num_rows, heads, head_dim = q.shape
    kv_heads = k[0].shape[2]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    for t in (*k, *v):
        assert t.is_contiguous(), "the kernel reads pages as laid out contiguously"
    out = torch.empty(num_rows, heads, head_dim, dtype=torch.float32)
    if num_rows == 0:
        return out
    own_k, own_v = own if own is not None else (None, None)
    k_table, v_table = fp8_tables if fp8_tables is not None else (None, None)
    scaled = k[1].shape[-1] > 0
    k_new = v_new = slots = None
    if new_kv is not None:
        assert codec in WRITES and k[0].dtype == (torch.float32 if codec == "fp32" else torch.bfloat16)
        k_new, v_new = _rows(new_kv[0].float()), _rows(new_kv[1].float())
        slots = new_kv[2].contiguous()
    args = KvsAttention(
        q=_ptr(q), out=_ptr(out), k_data=_ptr(k[0]), v_data=_ptr(v[0]), k_scales=_ptr(k[1] if scaled else None),
        v_scales=_ptr(v[1] if scaled else None), k_table=_ptr(k_table), v_table=_ptr(v_table),
        positions=_ptr(rows.positions), table_offsets=_ptr(rows.table_offsets), table_first=_ptr(rows.table_first),
        tables=_ptr(rows.tables), k_own=_ptr(own_k), v_own=_ptr(own_v),
        own_index=_ptr(rows.own_index if own is not None else None), k_new=_ptr(k_new), v_new=_ptr(v_new),
        slot_mapping=_ptr(slots), q_row_stride=q.stride(0), num_rows=num_rows,
        k_new_stride=k_new.stride(0) if k_new is not None else 0,
        v_new_stride=v_new.stride(0) if v_new is not None else 0,
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, window=window or 0,
        codec=CODECS[codec], schedule=Schedule[schedule.upper()], num_threads=num_threads or torch.get_num_threads(),
        scale=head_dim**-0.5)
    rc = lib.lib.kvs_paged_attention(ctypes.byref(args))
    if rc != 0:
        raise ValueError(f"native attention cannot run codec {codec} with head_dim {head_dim}")
    return out
