"""The ctypes mirror of `src/kvs_api.h`, the kernels' one declared contract: its enums, argument structs and
entry points, written here once for Python. `bind` sets every entry's argument types on a loaded library
and compares this mirror with the library's own manifest (each entry's signature, each struct's size,
each enum value) and its format table with gguf's block sizes; any difference refuses the library."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from enum import IntEnum

_i32, _i64, _f32, _ptr, _str = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p


class Format(IntEnum):
    """KvsFormat: weight formats by ggml type id."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30
    # kvserve's own: a format's rows interleaved in groups of eight (kvs_interleave_rows), 1000 + its id
    Q4_0_R8 = 1002
    Q4_1_R8 = 1003
    Q5_0_R8 = 1006
    Q5_1_R8 = 1007
    Q8_0_R8 = 1008
    Q4_K_R8 = 1012
    Q5_K_R8 = 1013
    Q6_K_R8 = 1014


class Codec(IntEnum):
    """KvsCodec: how a layer's KV pages are stored."""

    FP32 = 0
    BF16 = 1
    FP16 = 2
    FP8 = 3
    INT8 = 4
    INT4 = 5


class Schedule(IntEnum):
    """KvsSchedule: how paged attention spreads its work (the same bits for each)."""

    AUTO = 0
    TILE = 1
    SEGMENT = 2


class Activation(IntEnum):
    """KvsActivation: the gated MLP's activation."""

    SILU = 0
    GELU_TANH = 1


class MatmulStatus(IntEnum):
    """KvsMatmulStatus: kvs_matmul's and kvs_dequantize_rows' results."""

    OK = 0
    NO_FORMAT = -1
    BAD_ROW_LENGTH = -2


class Prefetch(IntEnum):
    """KvsPrefetch: the cache level a software prefetch fills."""

    NONE = 0
    L1 = 1
    L2 = 2
    L3 = 3


MAX_PARTS = 4  # KVS_MAX_PARTS
DECODE_ROWS = 8  # KVS_DECODE_ROWS: up to this many rows a matmul runs the decode rows, more the prefill tiles

# the header's enum names for each mirrored value
ENUM_VALUES: dict[str, int] = {
    **{f"KVS_{m.name}": m.value for m in Format},
    **{f"KVS_CODEC_{m.name}": m.value for m in Codec},
    **{f"KVS_SCHEDULE_{m.name}": m.value for m in Schedule},
    **{f"KVS_ACT_{m.name}": m.value for m in Activation},
    **{f"KVS_MATMUL_{m.name}": m.value for m in MatmulStatus},
    "KVS_MAX_PARTS": MAX_PARTS,
    "KVS_DECODE_ROWS": DECODE_ROWS,
    **{f"KVS_PREFETCH_{m.name}": m.value for m in Prefetch},
}


class KvsFormatInfo(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("block", ctypes.c_int32), ("bytes", ctypes.c_int32),
                ("is_float", ctypes.c_int32), ("name", ctypes.c_char * 8), ("group_rows", ctypes.c_int32),
                ("base", ctypes.c_int32)]


class KvsTuning(ctypes.Structure):
    _fields_ = [("weight_prefetch", ctypes.c_int32), ("weight_prefetch_ahead", ctypes.c_int32),
                ("kv_prefetch", ctypes.c_int32), ("weight_prefetch_spread", ctypes.c_int32),
                ("chained_sums", ctypes.c_int32)]


class KvsAttention(ctypes.Structure):
    _fields_ = [*((n, _ptr) for n in ("q", "out", "k_data", "v_data", "k_scales", "v_scales", "k_table", "v_table",
                                      "positions", "table_offsets", "table_first", "tables", "k_own", "v_own",
                                      "own_index", "k_new", "v_new", "slot_mapping")),
                *((n, _i64) for n in ("q_row_stride", "num_rows", "k_new_stride", "v_new_stride")),
                *((n, ctypes.c_int32) for n in ("heads", "kv_heads", "head_dim", "page_size", "window", "codec",
                                                "schedule", "num_threads")),
                ("scale", _f32), ("pad", _f32)]


class KvsLinear(ctypes.Structure):
    _fields_ = [("num_parts", _i64), ("in_features", _i64), ("out_features", _i64), ("formats", _i64 * MAX_PARTS),
                ("weights", _ptr * MAX_PARTS), ("rows", _i64 * MAX_PARTS), ("bias", _ptr)]


class KvsRows(ctypes.Structure):
    _fields_ = [*((n, _ptr) for n in ("positions", "table_offsets", "table_first", "tables", "slot_mapping")),
                ("window", _i64)]


class KvsLayer(ctypes.Structure):
    _fields_ = [("qkv", KvsLinear), ("o_proj", KvsLinear), ("gate_up", KvsLinear), ("down", KvsLinear),
                *((n, _ptr) for n in ("input_norm", "post_attention_norm", "q_norm", "k_norm", "attn_out_norm",
                                      "mlp_out_norm", "k_data", "v_data")),
                ("rows_set", _i64), ("rope_set", _i64)]


STEP_SCRATCH = ("m", "normed", "qkv", "qk_normed", "qk", "attn", "gate_up", "act_out", "out", "cos", "sin")


class KvsStep(ctypes.Structure):
    _fields_ = [("rows", _i64), ("num_layers", _i64), *((n, _i64) for n in (
        "hidden", "heads", "kv_heads", "head_dim", "inter", "page_size", "codec", "activation", "num_threads")),
        *((n, _f32) for n in ("eps", "q_scale", "attn_scale", "pad")),
        ("row_sets", KvsRows * 2), ("cos_table", _ptr * 2), ("sin_table", _ptr * 2),
        *((n, _ptr) for n in ("final_norm", "h", *STEP_SCRATCH))]


STRUCTS = (KvsFormatInfo, KvsTuning, KvsAttention, KvsLinear, KvsRows, KvsLayer, KvsStep)

# entry point -> (result type, argument types), in the header's order
ENTRY_POINTS: dict[str, tuple[type | None, list[type]]] = {
    "kvs_isa": (_str, []),
    "kvs_source_digest": (_str, []),
    "kvs_api_manifest": (_str, []),
    "kvs_max_threads": (_i32, []),
    "kvs_simd_width": (_i32, []),
    "kvs_formats": (_i32, [ctypes.POINTER(KvsFormatInfo), _i32]),
    "kvs_set_tuning": (None, [ctypes.POINTER(KvsTuning)]),
    "kvs_get_tuning": (None, [ctypes.POINTER(KvsTuning)]),
    "kvs_matmul": (_i32, [_i32, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32]),
    "kvs_interleave_rows": (_i32, [_i32, _ptr, _i64, _i64]),
    "kvs_dequantize_rows": (_i32, [_i32, _ptr, _i64, _ptr, _i64, _ptr]),
    "kvs_quantize_activations": (_i32, [_ptr, _i64, _i64, _ptr, _ptr, _ptr]),
    "kvs_rms_norm": (None, [_ptr, _i64, _i32, _i32, _i64, _ptr, _ptr, _ptr, _f32, _ptr, _i64, _i32]),
    "kvs_rope": (None, [_ptr, _i64, _i32, _i32, _i64, _ptr, _ptr, _i32, _f32, _ptr, _i32]),
    "kvs_gated_act": (None, [_ptr, _i64, _i32, _i64, _i32, _ptr, _i32]),
    "kvs_paged_attention": (_i32, [ctypes.POINTER(KvsAttention)]),
    "kvs_decoder_layers": (_i32, [ctypes.POINTER(KvsLayer), ctypes.POINTER(KvsStep)]),
}


def _letter(t: type | None) -> str:
    """kvs_api.cpp's letter for a C type."""
    if t is None:
        return "v"
    if t is _str:
        return "s"
    if t is _ptr or issubclass(t, (ctypes._Pointer, ctypes.Array)):
        return "p"
    if t is _f32:
        return "f"
    return {4: "i", 8: "l"}[ctypes.sizeof(t)]


def mirror_manifest() -> dict[str, str]:
    """What this module declares, keyed as the library's manifest lines are ("entry kvs_matmul", ...)."""
    out = {f"entry {name}": _letter(res) + ":" + "".join(map(_letter, args))
           for name, (res, args) in ENTRY_POINTS.items()}
    out.update({f"struct {s.__name__}": str(ctypes.sizeof(s)) for s in STRUCTS})
    out.update({f"enum {name}": str(value) for name, value in ENUM_VALUES.items()})
    return out


def parse_manifest(text: str) -> dict[str, str]:
    rows = (line.rsplit(" ", 1) for line in text.splitlines() if line.strip())
    return {key: value for key, value in rows}


def manifest_mismatch(library: dict[str, str], mirror: dict[str, str]) -> str | None:
    """The first difference between the library's manifest and this mirror, in words; None if they agree."""
    for key in sorted(library.keys() | mirror.keys()):
        theirs, ours = library.get(key), mirror.get(key)
        if theirs != ours:
            return (f"{key}: the library has {theirs or 'nothing'}, kvserve/kernels/api.py has "
                    f"{ours or 'nothing'}")
    return None


@dataclass(frozen=True, slots=True)
class FormatInfo:
    """One row of the library's format table."""

    format: Format
    block: int  # elements per block
    bytes: int  # bytes per block
    is_float: bool  # float32 activations (else rounded to int8 blocks of 32)
    group_rows: int  # 1, or 8: rows interleaved in groups of eight (matrices of whole groups)
    base: int  # the file's format of the values: the format itself, or the one interleaved

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.bytes


def read_formats(lib: ctypes.CDLL) -> dict[int, FormatInfo]:
    """The library's format table, checked against the Format enum and gguf's block geometry."""
    import gguf

    rows = (KvsFormatInfo * 64)()
    count = lib.kvs_formats(rows, len(rows))
    table: dict[int, FormatInfo] = {}
    for row in rows[:count]:
        fmt = Format(row.type)
        if row.name.decode() != fmt.name:
            raise ValueError(f"format {row.type} is {row.name.decode()} in the library, {fmt.name} in api.py")
        expected = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(row.base)]
        if (row.block, row.bytes) != expected:
            raise ValueError(f"format {fmt.name}: the library's block is {row.block} elements in {row.bytes} "
                             f"bytes, GGUF's is {expected[0]} in {expected[1]}")
        table[fmt.value] = FormatInfo(fmt, row.block, row.bytes, bool(row.is_float), row.group_rows, row.base)
    return table


def bind(lib: ctypes.CDLL) -> dict[int, FormatInfo]:
    """Declares every entry point's types on `lib` and checks this mirror against it; returns its format
    table. Raises ValueError, in one line, on the first disagreement (the library must then not be called)."""
    for name, (res, args) in ENTRY_POINTS.items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise ValueError(f"the library has no entry point {name}")
        fn.restype, fn.argtypes = res, args
    mismatch = manifest_mismatch(parse_manifest(lib.kvs_api_manifest().decode()), mirror_manifest())
    if mismatch:
        raise ValueError(mismatch)
    return read_formats(lib)
