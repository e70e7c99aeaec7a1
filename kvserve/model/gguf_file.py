"""A GGUF file's header read straight from its memory map: metadata as plain Python values and the
tensor table, each tensor's data a read-only numpy view of the map (nothing of it is read until used).

gguf-py's GGUFReader keeps a numpy view per array element: for a 262k-token vocabulary that is ~680 MB
of Python objects while a model loads, more than the file itself. This reader keeps only the values.

    magic "GGUF" | version u32 | tensors u64 | kv pairs u64
    kv pair:     key (u64 length + bytes) | value type u32 | value (arrays: type u32, count u64, items)
    tensor info: name | dims u32 | dims x u64 (innermost first) | ggml type u32 | offset u64
    data:        from the next multiple of general.alignment (default 32), tensor offsets relative to it
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["GGUFFile", "GGUFTensorInfo"]

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count
# ggml types whose data are plain numbers (the rest are blocks: bytes per row)
_ELEMENT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost first
    n_elements: int
    data_offset: int  # in the file
    n_bytes: int
    data: np.ndarray  # numpy order; block types: uint8 [..., row bytes]


class _Truncated(Exception):
    """A header read ran past the end of the file."""


@dataclass(frozen=True, slots=True)
class _TensorPlace:
    """A tensor-table entry: where its data lie, checked against the file's size before any view."""

    name: str
    dims: tuple[int, ...]
    qtype: GGMLQuantizationType
    data_offset: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64))

    @property
    def n_bytes(self) -> int:
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * block_bytes


class GGUFFile:
    """`fields`: key -> value (str, int, float, bool, or a list of them); `tensors` in file order."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                raise ValueError(f"not a GGUF file ({size} bytes)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._map[:4] != b"GGUF":
            raise ValueError(f"not a GGUF file (it starts with {bytes(self._map[:4])!r}, not b'GGUF')")
        self._pos = 4
        try:
            self._read_header()
        except _Truncated:
            raise ValueError(f"truncated at byte {size:,}, inside the header; download the file again") from None
        expected = max((t.data_offset + t.n_bytes for t in self._infos), default=self._pos)
        if expected > size:
            raise ValueError(f"truncated at byte {size:,} of {expected:,}; download the file again")
        self.tensors = [self._tensor(info) for info in self._infos]

    def _read_header(self) -> None:
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3; big-endian files neither)")
        num_tensors, num_fields = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self._infos = [_TensorPlace(name, dims, qtype, start + offset) for name, dims, qtype, offset in infos]

    def _need(self, num_bytes: int) -> None:
        if self._pos + num_bytes > len(self._map):
            raise _Truncated

    def _scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        self._need(struct.calcsize(fmt))
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._strings(1)[0]

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            return self._scalar(kind)
        item, count = self._scalar(4), self._scalar(10)
        if item in _SCALARS:  # numbers: one read (numpy reads the struct codes as dtypes)
            self._need(count * struct.calcsize(_SCALARS[item]))
            values = np.frombuffer(self._map, np.dtype(_SCALARS[item]), count, self._pos)
            self._pos += values.nbytes
            return values.tolist()
        if item == _STRING:
            return self._strings(count)
        return [self._value(item) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """`count` strings (a vocabulary: 49k-262k of them) in one loop over locals: a third of the
        time of reading each through _scalar and _need."""
        data, pos, end, strings = self._map, self._pos, len(self._map), []
        length_at = _LENGTH.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise _Truncated
            (n,) = length_at(data, pos)
            pos += 8
            if pos + n > end:
                raise _Truncated
            strings.append(data[pos:pos + n].decode("utf-8"))
            pos += n
        self._pos = pos
        return strings

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
        return name, dims, GGMLQuantizationType(self._scalar(4)), self._scalar(10)

    def _tensor(self, place: _TensorPlace) -> GGUFTensorInfo:
        shape = tuple(reversed(place.dims))
        if place.qtype in _ELEMENT_TYPES:
            data = np.frombuffer(self._map, _ELEMENT_TYPES[place.qtype], place.n_elements, place.data_offset)
            data = data.reshape(shape)
        else:
            block, block_bytes = GGML_QUANT_SIZES[place.qtype]
            data = np.frombuffer(self._map, np.uint8, place.n_bytes, place.data_offset)
            data = data.reshape(*shape[:-1], shape[-1] // block * block_bytes)
        return GGUFTensorInfo(place.name, place.qtype, place.dims, place.n_elements, place.data_offset,
                              place.n_bytes, data)
