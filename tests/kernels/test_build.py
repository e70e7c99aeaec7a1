"""The kernel build and its guard: each library records the sources it was built from, and a library
built from other sources (a checkout that moved on without a rebuild: other C signatures) is refused
with one line and the torch path, never called; a missing compiler is one line too."""

from __future__ import annotations

import pytest

from kvserve import kernels
from kvserve.kernels import build


@pytest.fixture
def fresh_loader():
    kernels._load.cache_clear()
    kernels._warned.clear()
    yield
    kernels._load.cache_clear()  # later tests load the real libraries again


def test_every_built_library_records_the_sources_it_was_built_from(monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNELS", "on")
    for isa in kernels.host_isas():
        if not kernels.library_path(isa).is_file():
            pytest.skip("native kernels not built")
        assert kernels.built_digest(isa) == kernels.source_digest()
        assert build.up_to_date(isa)


def test_a_library_built_from_other_sources_is_refused_with_one_line(monkeypatch, capsys, fresh_loader):
    monkeypatch.setenv("KVSERVE_KERNELS", "on")
    if not kernels.library_path(kernels.selected_isa()).is_file():
        pytest.skip("native kernels not built")
    for module in (kernels, build):  # the sources moved on
        monkeypatch.setattr(module, "source_digest", lambda: "0" * 16)
    assert kernels.library() is None and not kernels.available()
    assert not build.up_to_date(kernels.selected_isa())
    err = capsys.readouterr().err.strip()
    assert "built from other sources" in err and "kvserve.kernels.build" in err and "\n" not in err


def test_a_missing_compiler_is_one_line_and_builds_nothing(monkeypatch, capsys):
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert build.build(force=True) == 0
    err = capsys.readouterr().err.strip()
    assert "no C++ compiler" in err and "torch path" in err and "\n" not in err


def test_an_object_is_rebuilt_only_when_its_source_a_header_it_includes_or_the_digest_changes(
        tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.h").write_text("#pragma once\n#include \"b.h\"\n")
    (src / "b.h").write_text("#pragma once\n")
    (src / "c.h").write_text("#pragma once\n")
    (src / "one.cpp").write_text("#include \"a.h\"\n")
    (src / "two.cpp").write_text("#include \"c.h\"\n#include <vector>\n")
    (src / "kvs_api.cpp").write_text("")
    monkeypatch.setattr(build, "SRC_DIR", src)
    monkeypatch.setattr(build, "OBJ_DIR", tmp_path / "obj")
    digest = ["1" * 16]
    monkeypatch.setattr(build, "source_digest", lambda: digest[0])

    def objects() -> dict[str, str]:
        return {s.name: build.compile_job("g++", "avx2", s).object_path.name for s in build.sources()}

    assert [h.name for h in build.included_headers(src / "one.cpp")] == ["a.h", "b.h"]
    before = objects()
    (src / "b.h").write_text("#pragma once\n// changed\n")  # reached from one.cpp through a.h
    after = objects()
    assert after["one.cpp"] != before["one.cpp"]
    assert after["two.cpp"] == before["two.cpp"] and after["kvs_api.cpp"] == before["kvs_api.cpp"]
    digest[0] = "2" * 16  # kvs_api.cpp records the digest of every source
    assert objects()["kvs_api.cpp"] != after["kvs_api.cpp"] and objects()["two.cpp"] == after["two.cpp"]
    assert build.compile_job("g++", "avx2", src / "two.cpp") != build.compile_job("g++", "scalar", src / "two.cpp")


def test_the_simd_libraries_keep_their_prefetches():
    # the tuning's prefetch loops once compiled to nothing (GCC deletes a loop of __builtin_prefetch alone),
    # and every tuning choice then timed the same: the built code must hold each level's instruction
    import shutil
    import subprocess

    if shutil.which("objdump") is None:
        pytest.skip("no objdump")
    for isa in set(kernels.host_isas()) - {"scalar"}:
        if not kernels.library_path(isa).is_file():
            pytest.skip("native kernels not built")
        code = subprocess.run(["objdump", "-d", str(kernels.library_path(isa))], capture_output=True, text=True,
                              check=True).stdout
        assert all(f"prefetcht{level}" in code for level in (0, 1, 2)), isa


def test_a_missing_library_without_a_compiler_is_one_line_and_the_torch_path(monkeypatch, capsys, tmp_path,
                                                                             fresh_loader):
    """A pip install builds the library on first use (tests/test_fresh_install.py); with no compiler
    there, the first use says so in one line and runs the torch path."""
    monkeypatch.setenv("KVSERVE_KERNELS", "on")
    monkeypatch.setattr(kernels, "LIB_DIR", tmp_path)  # nothing built here
    monkeypatch.setattr(kernels, "_build_tried", set())
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert not kernels.available() and kernels.library() is None
    err = capsys.readouterr().err.strip()
    assert "no C++ compiler" in err and "torch path" in err and "\n" not in err


def test_a_first_use_builds_every_missing_simd_build_at_once_unless_one_is_forced(monkeypatch, tmp_path):
    """The calibration loads each SIMD build this CPU runs: built one by one as each was first loaded,
    their compiles ran one library at a time."""
    monkeypatch.setattr(kernels, "LIB_DIR", tmp_path)  # nothing built here
    monkeypatch.setattr(kernels, "host_isas", lambda: ["scalar", "avx2", "avx512"])
    monkeypatch.delenv("KVSERVE_KERNELS_ISA", raising=False)
    assert kernels.first_use_isas("avx512") == ["avx2", "avx512"]
    assert kernels.first_use_isas("scalar") == ["scalar"]
    kernels.library_path("avx2").touch()
    assert kernels.first_use_isas("avx512") == ["avx512"]
    kernels.library_path("avx2").unlink()
    monkeypatch.setenv("KVSERVE_KERNELS_ISA", "avx2")
    assert kernels.first_use_isas("avx2") == ["avx2"]


def test_a_compiler_that_cannot_build_amx_skips_it_in_one_line(monkeypatch, capsys, tmp_path):
    """(AMX needs GCC 11 or clang 12.) The other builds run; the CPU's list leaves AMX out where its library is
    missing and the compiler cannot make it, so the AVX-512 build is the widest rather than the torch path."""
    monkeypatch.setattr(build, "compiler_takes", lambda cxx, isa: isa != "amx")
    assert build.build(("amx",), force=True) == 0
    err = capsys.readouterr().err.strip()
    assert "cannot build for amx" in err and "\n" not in err
    monkeypatch.setattr(kernels, "LIB_DIR", tmp_path)  # no library there
    kernels._amx_usable.cache_clear()
    try:
        assert "amx" not in kernels.host_isas()
    finally:
        kernels._amx_usable.cache_clear()


def test_the_compiler_here_takes_every_builds_flags():
    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    assert all(build.compiler_takes(cxx, isa) for isa in kernels.ISAS)
