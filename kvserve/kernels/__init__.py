"""kvserve's own CPU kernels: C++17 sources under `src/`, built once per instruction set by `build.py`
(scalar, AVX2+FMA+F16C, AVX-512 with VNNI/BF16, and that with Intel's AMX tiles for the prefill), loaded with
ctypes and picked at run time.

`KVSERVE_KERNELS=off` forces the pure-torch path; `KVSERVE_KERNELS_ISA=scalar|avx2|avx512|amx` forces one
instruction set (an error if this CPU cannot run it); else a model's start-up calibration picks the faster
SIMD build where the CPU runs two (kernels/tuning.py), else the best it runs. `library()` is None whenever
the kernels cannot be used, and every caller then takes the torch path, which stays the reference."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.errors import ConfigError
from kvserve.kernels import api

ISAS = ("scalar", "avx2", "avx512", "amx")
LIB_DIR = Path(__file__).with_name("_lib")
SRC_DIR = Path(__file__).with_name("src")
# /proc/cpuinfo flags each build needs (the compiler flags in build.py turn on the same set)
ISA_FLAGS = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "fma", "f16c"),
}
ISA_FLAGS["amx"] = (*ISA_FLAGS["avx512"], "avx512vbmi", "amx_tile", "amx_bf16")


def library_path(isa: str) -> Path:
    return LIB_DIR / f"libkvserve_{isa}.so"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of every kernel source and header: a library built from other sources (a checkout
    that moved on without a rebuild) has other C signatures, and calling it would crash."""
    digest = hashlib.sha256()
    for path in sorted([*SRC_DIR.glob("*.cpp"), *SRC_DIR.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "cpu family", "model", "flags", ...);
    empty where there is none."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


@functools.lru_cache(maxsize=1)  # (kernels.library() asks on every forward: ~20 us a step rebuilt)
def cpu_flags() -> frozenset[str]:
    return frozenset(cpu_info().get("flags", "").split())


def host_isas() -> list[str]:
    """Instruction sets this CPU can run, slowest first."""
    flags = cpu_flags()
    return [isa for isa in ISAS if all(f in flags for f in ISA_FLAGS[isa]) and (isa != "amx" or _amx_usable())]


@functools.lru_cache(maxsize=1)
def _amx_usable() -> bool:
    """Whether Linux lets this process use the AMX tile registers (asked once for the whole process, as the
    kernels ask again: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA) and the AMX build exists or the compiler
    can make it; else the AVX-512 build is the widest."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(158, 0x1023, 18) != 0:  # SYS_arch_prctl on x86-64
            return False
    except (OSError, AttributeError):
        return False
    if library_path("amx").is_file():
        return True
    from kvserve.kernels import build

    cxx = build.compiler()
    return cxx is not None and build.compiler_takes(cxx, "amx")


def enabled() -> bool:
    return os.environ.get("KVSERVE_KERNELS", "on").lower() not in ("off", "0", "false", "no")


def interleave_enabled() -> bool:
    """Whether block-format weights (Q4_0 .. Q8_0, the K formats) are laid out for the decode rows at load
    (kernels/matmul.py interleave); `KVSERVE_KERNELS_INTERLEAVE=off` keeps the file's layout (the same
    bits, slower decode rows)."""
    return os.environ.get("KVSERVE_KERNELS_INTERLEAVE", "on").lower() not in ("off", "0", "false", "no")


_chosen_isas: dict[str, str] = {}  # the start-up calibration's choice per kind of call (kernels/tuning.py choose_isa)


def use_isa(isa: str | None, decode_isa: str | None = None) -> None:
    """Makes `isa` this process's instruction set where KVSERVE_KERNELS_ISA forces none (None: the best
    this CPU runs), and `decode_isa` (default: `isa`) that of calls of at most api.DECODE_ROWS rows. The
    SIMD builds give the same bits (tests/kernels/test_isa_identity.py), so the choice is only one of
    speed, and a step may run on either."""
    _chosen_isas.clear()
    if isa is not None:
        _chosen_isas.update(prefill=isa, decode=decode_isa or isa)


def forced_isa() -> str | None:
    """KVSERVE_KERNELS_ISA if set (checked against this CPU), else None."""
    forced = os.environ.get("KVSERVE_KERNELS_ISA", "").lower()
    if not forced:
        return None
    if forced not in ISAS:
        raise ConfigError(f"KVSERVE_KERNELS_ISA must be one of {', '.join(ISAS)}, got {forced!r}")
    available = host_isas()
    if forced not in available:
        raise ConfigError(f"KVSERVE_KERNELS_ISA={forced}: this CPU runs only {', '.join(available)}")
    return forced


def selected_isa(rows: int | None = None) -> str:
    """KVSERVE_KERNELS_ISA if set, else the calibration's choice if one was made (for a call of `rows`
    activation rows: up to api.DECODE_ROWS, the decode rows' choice), else the best this CPU runs."""
    forced = forced_isa()
    if forced:
        return forced
    available = host_isas()
    chosen = _chosen_isas.get("decode" if rows is not None and rows <= api.DECODE_ROWS else "prefill")
    return chosen if chosen in available else available[-1]


def simd_isas() -> list[str]:
    """The SIMD instruction sets this CPU runs, slowest first: the calibration's candidates."""
    return [isa for isa in host_isas() if isa != "scalar"]


def simd_libraries() -> list[KernelLibrary]:
    """The loaded library of each of simd_isas."""
    return [kl for isa in simd_isas() for kl in [_load(isa)] if kl is not None]


@dataclass(frozen=True)
class KernelLibrary:
    """The loaded shared object of one instruction set, its entry points typed by `api.bind`."""

    isa: str
    lib: ctypes.CDLL
    formats: dict[int, api.FormatInfo] = field(hash=False, compare=False)  # the library's format table
    simd_width: int = 1  # float lanes of a vector (attention's head_dim must be a multiple)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"kvserve: {message}", file=sys.stderr)


@functools.lru_cache(maxsize=None)
def _load(isa: str) -> KernelLibrary | None:
    import torch  # noqa: F401  (loads torch's OpenMP runtime first: kvs_max_threads reads that one)

    path = library_path(isa)
    build_if_missing(isa)
    if not path.is_file():
        if isa in _build_tried:
            return None  # (the build attempt said why, in its one line)
        _warn_once(f"native kernels not built ({path} missing; run `python -m kvserve.kernels.build`); "
                   "using the torch path")
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        _warn_once(f"native kernels failed to load ({e}); using the torch path")
        return None
    built_from = getattr(lib, "kvs_source_digest", None)
    if built_from is not None:
        built_from.restype = ctypes.c_char_p
    if built_from is None or built_from().decode() != source_digest():
        _warn_once(f"native kernels in {LIB_DIR} were built from other sources (run `python -m "
                   "kvserve.kernels.build`); using the torch path")
        return None
    try:
        formats = api.bind(lib)
    except ValueError as e:
        _warn_once(f"native kernels in {LIB_DIR} disagree with kvserve/kernels/api.py ({e}); using the torch path")
        return None
    if lib.kvs_isa().decode() != isa:
        raise RuntimeError(f"{path} was built for {lib.kvs_isa().decode()}, not {isa}")
    return KernelLibrary(isa, lib, formats, lib.kvs_simd_width())


def available() -> bool:
    """Whether `library()` would give kernels (enabled and built for this CPU), without loading them
    (no torch import: `--dtype auto` is resolved with it)."""
    if not enabled():
        return False
    try:
        isa = selected_isa()
    except ConfigError:
        return False
    build_if_missing(isa)
    return library_path(isa).is_file() and built_digest(isa) == source_digest()


def build_if_missing(isa: str) -> None:
    """A pip-installed kvserve carries the sources but no library: the first use builds this CPU's
    (first_use_isas; about 40 s on 2 cores, once per install), saying so in one line; without a compiler,
    one line and the torch path. A library built from other sources is not rebuilt here (a checkout that
    moved on: `python -m kvserve.kernels.build`, as the refusal says)."""
    if library_path(isa).is_file() or isa in _build_tried or not any(SRC_DIR.glob("*.cpp")):
        return
    isas = first_use_isas(isa)
    _build_tried.update(isas)
    from kvserve.kernels import build

    if build.compiler() is not None:
        _warn_once(f"building the native kernels for {', '.join(isas)} into {LIB_DIR} (first use after install; "
                   "once)")
    try:
        build.build(isas)
    except (RuntimeError, OSError) as e:
        _warn_once(f"native kernels could not be built ({str(e).splitlines()[0]}); using the torch path")


def first_use_isas(isa: str) -> list[str]:
    """What a first use of `isa` builds: `isa` and, unless KVSERVE_KERNELS_ISA forces one, every other SIMD
    build this CPU runs that is missing, in one build (the start-up calibration loads each: simd_libraries).
    Built one at a time as each was first loaded, AVX-512's and then AVX2's took 55 s on 2 Zen 4 cores; their
    compiles side by side fill both cores."""
    if forced_isa() or isa == "scalar":
        return [isa]
    return [i for i in simd_isas() if i == isa or not library_path(i).is_file()]


_build_tried: set[str] = set()


def digest_path(isa: str) -> Path:
    """Written beside each library by build.py: the source digest it was built from."""
    return LIB_DIR / f"libkvserve_{isa}.digest"


def built_digest(isa: str) -> str | None:
    try:
        return digest_path(isa).read_text().strip()
    except OSError:
        return None


def library(rows: int | None = None) -> KernelLibrary | None:
    """The kernels for this process, for a call of `rows` activation rows if given (selected_isa;
    KVSERVE_KERNELS / KVSERVE_KERNELS_ISA read on each call, so a test can switch them), or None: use
    the torch path."""
    if not enabled():
        return None
    return _load(selected_isa(rows))
