"""The kernels' declared contract (src/kvs_api.h) and its Python mirror (kernels/api.py): every built
library agrees with the mirror, and any disagreement in an entry's arguments, a struct's size, an enum
value or a format's block geometry refuses the library with one line (the torch path runs), never a call."""

from __future__ import annotations

import ctypes

import gguf
import pytest

from kvserve import kernels
from kvserve.kernels import api


def built_libraries() -> list[ctypes.CDLL]:
    libs = [ctypes.CDLL(str(kernels.library_path(isa))) for isa in kernels.host_isas()
            if kernels.library_path(isa).is_file() and kernels.built_digest(isa) == kernels.source_digest()]
    if not libs:
        pytest.skip("native kernels not built")
    return libs


@pytest.fixture
def fresh_loader(monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNELS", "on")
    kernels._load.cache_clear()
    kernels._warned.clear()
    yield
    kernels._load.cache_clear()  # later tests load the real libraries again


def test_every_built_library_agrees_with_the_mirror_and_lists_every_format():
    for lib in built_libraries():
        formats = api.bind(lib)
        assert set(formats) == {f.value for f in api.Format}
        for fmt in formats.values():
            assert (fmt.block, fmt.bytes) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(fmt.base)]
            assert fmt.is_float == (fmt.format in (api.Format.F32, api.Format.F16, api.Format.BF16))
            interleaved = fmt.format.name.endswith("_R8")  # kvserve's own twins of the K formats
            assert (fmt.group_rows, fmt.base) == ((8, fmt.format - 1000) if interleaved else (1, fmt.format))


def test_the_manifest_names_every_entry_struct_and_enum_the_mirror_declares():
    lib = built_libraries()[0]
    api.bind(lib)
    reported = api.parse_manifest(lib.kvs_api_manifest().decode())
    assert reported == api.mirror_manifest()
    assert reported["entry kvs_paged_attention"] == "i:p"  # attention's arguments travel as one struct
    assert reported["entry kvs_matmul"] == "i:ipllpllpli"


def _wider(struct: type) -> type:
    """A struct of the same name with one more field: the mirror of a header that moved on."""
    return type(struct.__name__, (ctypes.Structure,), {"_fields_": [*struct._fields_, ("extra", ctypes.c_int64)]})


@pytest.mark.parametrize("plant, names", [
    (lambda mp: mp.setitem(api.ENTRY_POINTS, "kvs_matmul", (ctypes.c_int, api.ENTRY_POINTS["kvs_matmul"][1][:-1])),
     "entry kvs_matmul"),
    (lambda mp: mp.setitem(api.ENTRY_POINTS, "kvs_rope", (None, [ctypes.c_int64 if t is ctypes.c_int else t
                                                                 for t in api.ENTRY_POINTS["kvs_rope"][1]])),
     "entry kvs_rope"),
    (lambda mp: mp.setattr(api, "STRUCTS", tuple(_wider(s) if s is api.KvsAttention else s for s in api.STRUCTS)),
     "struct KvsAttention"),
    (lambda mp: mp.setitem(api.ENUM_VALUES, "KVS_CODEC_INT4", 6), "enum KVS_CODEC_INT4"),
    (lambda mp: mp.setitem(api.ENUM_VALUES, "KVS_Q7_K", 15), "enum KVS_Q7_K"),
    (lambda mp: mp.setitem(api.ENTRY_POINTS, "kvs_flash_attention", (ctypes.c_int, [])),
     "no entry point kvs_flash_attention"),
])
def test_a_planted_mismatch_refuses_the_library(monkeypatch, plant, names):
    lib = built_libraries()[0]
    plant(monkeypatch)
    with pytest.raises(ValueError, match=names) as refused:
        api.bind(lib)
    assert "\n" not in str(refused.value)


def test_a_format_whose_geometry_disagrees_with_gguf_refuses_the_library(monkeypatch):
    lib = built_libraries()[0]
    sizes = dict(gguf.GGML_QUANT_SIZES)
    sizes[gguf.GGMLQuantizationType.Q4_K] = (256, 146)
    monkeypatch.setattr(gguf, "GGML_QUANT_SIZES", sizes)
    with pytest.raises(ValueError, match="Q4_K.*144 bytes.*146"):
        api.bind(lib)


def test_the_loader_takes_the_torch_path_with_one_line_when_the_mirror_disagrees(monkeypatch, capsys, fresh_loader):
    built_libraries()
    monkeypatch.setitem(api.ENUM_VALUES, "KVS_SCHEDULE_SEGMENT", 3)
    assert kernels.library() is None
    err = capsys.readouterr().err.strip()
    assert "disagree with kvserve/kernels/api.py" in err and "KVS_SCHEDULE_SEGMENT" in err and "\n" not in err


def test_the_loaded_library_carries_its_format_table_and_vector_width(fresh_loader):
    built_libraries()
    kl = kernels.library()
    assert kl is not None and kl.formats[api.Format.Q4_K].row_bytes(512) == 288
    # AVX2: two 256-bit halves (ops_simd.h)
    assert kl.simd_width == {"scalar": 1, "avx2": 16, "avx512": 16, "amx": 16}[kl.isa]
