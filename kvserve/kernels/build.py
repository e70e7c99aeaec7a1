"""Builds every `src/*.cpp` once per instruction set into `_lib/libkvserve_<isa>.so`
(`python -m kvserve.kernels.build`, run by `make install`). Never `-march=native`: each build names
its instruction set, and the loader picks the one this CPU runs. Each source compiles to its own
object, all of them side by side on every core, and an object is rebuilt only when its source, a
header it includes or its flags change. A missing compiler prints one line and leaves the torch path."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvserve.kernels import ISAS, LIB_DIR, SRC_DIR, built_digest, digest_path, library_path, source_digest

# No -ffast-math, no FMA contraction: the kernels' results must not depend on how the compiler
# reassociates or fuses (an element's arithmetic must be the same in every code path that computes it).
# -O2 would halve matmul.cpp's compile time, but its one-row GEMV runs ~10% slower (same bits).
BASE_FLAGS = ["-std=c++17", "-O3", "-fPIC", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wall",
              "-fvisibility=hidden"]
ISA_COMPILER_FLAGS = {
    "scalar": ["-march=x86-64", "-mtune=generic", "-DKVS_ISA_SCALAR", '-DKVS_ISA_NAME="scalar"'],
    "avx2": ["-march=haswell", "-mtune=znver3", "-DKVS_ISA_AVX2", '-DKVS_ISA_NAME="avx2"'],
    "avx512": ["-march=skylake-avx512", "-mavx512vnni", "-mavx512bf16", "-DKVS_ISA_AVX512",
               '-DKVS_ISA_NAME="avx512"'],
    "amx": ["-march=skylake-avx512", "-mavx512vnni", "-mavx512bf16", "-mavx512vbmi", "-mamx-tile", "-mamx-bf16",
            "-DKVS_ISA_AVX512", "-DKVS_ISA_AMX", '-DKVS_ISA_NAME="amx"'],
}
# builds a compiler may not know the instructions of (AMX: GCC 11, clang 12): skipped with one line where it
# does not (kernels.host_isas then leaves them out, as on a CPU without them)
OPTIONAL_ISAS = ("amx",)
OBJ_DIR = LIB_DIR / "obj"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class CompileJob:
    """One source compiled for one instruction set, named by everything that decides its bytes."""

    isa: str
    source: Path
    flags: tuple[str, ...]
    object_path: Path


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def sources() -> list[Path]:
    return sorted(SRC_DIR.glob("*.cpp"))


def included_headers(source: Path) -> list[Path]:
    """The project headers `source` includes, directly or through another header."""
    seen: dict[str, Path] = {}
    todo = [source]
    while todo:
        for name in _INCLUDE.findall(todo.pop().read_text()):
            header = SRC_DIR / name
            if name not in seen and header.is_file():
                seen[name] = header
                todo.append(header)
    return [seen[name] for name in sorted(seen)]


def compile_job(cxx: str, isa: str, source: Path) -> CompileJob:
    flags = (*BASE_FLAGS, *ISA_COMPILER_FLAGS[isa], f"-I{SRC_DIR}")
    if source.name == "kvs_api.cpp":  # the one source that records the digest of them all
        flags += (f'-DKVS_SOURCE_DIGEST="{source_digest()}"',)
    key = hashlib.sha256("\0".join((cxx, *flags)).encode())
    for path in (source, *included_headers(source)):
        key.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return CompileJob(isa, source, flags, OBJ_DIR / isa / f"{source.stem}-{key.hexdigest()[:16]}.o")


def compiler_takes(cxx: str, isa: str) -> bool:
    """Whether cxx compiles a file that includes the intrinsics' header with isa's flags."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.cpp"
        probe.write_text("#include <immintrin.h>\nint main() { return 0; }\n")
        done = subprocess.run([cxx, *BASE_FLAGS, *ISA_COMPILER_FLAGS[isa], "-c", str(probe), "-o",
                               str(Path(tmp) / "p.o")], capture_output=True)
        return done.returncode == 0


def run_compiler(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the {what} failed:\n{' '.join(cmd)}\n{result.stderr}")


def compile_one(cxx: str, job: CompileJob) -> None:
    job.object_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=job.object_path.parent, suffix=".o", delete=False) as tmp:
        tmp_path = tmp.name
    try:
        run_compiler([cxx, *job.flags, "-c", str(job.source), "-o", tmp_path], f"{job.isa} kernels")
    except RuntimeError:
        os.unlink(tmp_path)
        raise
    os.replace(tmp_path, job.object_path)


def link_one(cxx: str, isa: str, jobs: list[CompileJob]) -> None:
    out = library_path(isa)
    with tempfile.NamedTemporaryFile(dir=LIB_DIR, suffix=".so", delete=False) as tmp:
        tmp_path = tmp.name
    try:
        run_compiler([cxx, "-shared", "-fopenmp", *(str(j.object_path) for j in jobs), "-o", tmp_path],
                     f"{isa} kernel library")
    except RuntimeError:
        os.unlink(tmp_path)
        raise
    os.replace(tmp_path, out)  # atomic: a running process never sees half a library
    digest_path(isa).write_text(source_digest() + "\n")
    for stale in set((OBJ_DIR / isa).glob("*.o")) - {j.object_path for j in jobs}:
        stale.unlink(missing_ok=True)


def up_to_date(isa: str) -> bool:
    out = library_path(isa)
    if not out.is_file() or built_digest(isa) != source_digest():
        return False
    return out.stat().st_mtime >= Path(__file__).stat().st_mtime  # (flags changed: rebuild)


def build(isas: list[str] | tuple[str, ...] = ISAS, force: bool = False) -> int:
    cxx = compiler()
    if cxx is None:
        print("kvserve: no C++ compiler (g++/clang++) found: native kernels not built, the torch path runs",
              file=sys.stderr)
        return 0
    LIB_DIR.mkdir(exist_ok=True)
    todo = [isa for isa in isas if force or not up_to_date(isa)]
    refused = [isa for isa in todo if isa in OPTIONAL_ISAS and not compiler_takes(cxx, isa)]
    if refused:
        print(f"kvserve: {cxx} cannot build for {', '.join(refused)} (its instructions are too new for it): "
              f"skipped; the other builds run", file=sys.stderr)
        todo = [isa for isa in todo if isa not in refused]
    jobs = {isa: [compile_job(cxx, isa, source) for source in sources()] for isa in todo}
    to_compile = [j for isa_jobs in jobs.values() for j in isa_jobs if force or not j.object_path.is_file()]
    to_compile.sort(key=lambda j: -j.source.stat().st_size)  # the longest compiles start first
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda job: compile_one(cxx, job), to_compile))
        list(pool.map(lambda isa: link_one(cxx, isa, jobs[isa]), todo))
    if todo:
        print(f"kvserve: built native kernels for {', '.join(todo)} in {time.perf_counter() - start:.1f} s "
              f"({len(to_compile)} of {sum(map(len, jobs.values()))} objects compiled)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.kernels.build", description=__doc__)
    parser.add_argument("--isa", choices=ISAS, action="append", help="build only these (default: all)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    try:
        return build(args.isa or ISAS, args.force)
    except RuntimeError as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
