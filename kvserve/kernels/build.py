"""Builds every `src/*.cpp` once per instruction set into `_lib/libkvserve_<isa>.so`
(`python -m kvserve.kernels.build`, run by `make install`). Never `-march=native`: each build names
its instruction set, and the loader picks the one this CPU runs. A missing compiler prints one line
and leaves the torch path."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvserve.kernels import ISAS, LIB_DIR, SRC_DIR, built_digest, digest_path, library_path, source_digest
BASE_FLAGS = ["-std=c++17", "-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wall",
              "-fvisibility=hidden"]
# no -ffast-math, no FMA contraction: the kernels' results must not depend on how the compiler
# reassociates or fuses (an element's arithmetic must be the same in every code path that computes it)
ISA_COMPILER_FLAGS = {
    "scalar": ["-march=x86-64", "-mtune=generic", "-DKVS_ISA_SCALAR", '-DKVS_ISA_NAME="scalar"'],
    "avx2": ["-march=haswell", "-mtune=znver3", "-DKVS_ISA_AVX2", '-DKVS_ISA_NAME="avx2"'],
    "avx512": ["-march=skylake-avx512", "-mavx512vnni", "-mavx512bf16", "-DKVS_ISA_AVX512",
               '-DKVS_ISA_NAME="avx512"'],
}


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def sources() -> list[Path]:
    return sorted(SRC_DIR.glob("*.cpp"))


def up_to_date(isa: str) -> bool:
    out = library_path(isa)
    if not out.is_file() or built_digest(isa) != source_digest():
        return False
    return out.stat().st_mtime >= Path(__file__).stat().st_mtime  # (flags changed: rebuild)


def build_one(cxx: str, isa: str) -> None:
    out = library_path(isa)
    with tempfile.NamedTemporaryFile(dir=LIB_DIR, suffix=".so", delete=False) as tmp:
        tmp_path = tmp.name
    digest = source_digest()
    cmd = [cxx, *BASE_FLAGS, *ISA_COMPILER_FLAGS[isa], f'-DKVS_SOURCE_DIGEST="{digest}"', f"-I{SRC_DIR}",
           *map(str, sources()), "-o", tmp_path]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp_path)
        raise RuntimeError(f"building the {isa} kernels failed:\n{' '.join(cmd)}\n{result.stderr}")
    os.replace(tmp_path, out)  # atomic: a running process never sees half a library
    digest_path(isa).write_text(digest + "\n")


def build(isas: list[str] | tuple[str, ...] = ISAS, force: bool = False) -> int:
    cxx = compiler()
    if cxx is None:
        print("kvserve: no C++ compiler (g++/clang++) found: native kernels not built, the torch path runs",
              file=sys.stderr)
        return 0
    LIB_DIR.mkdir(exist_ok=True)
    todo = [isa for isa in isas if force or not up_to_date(isa)]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(todo) or 1) as pool:
        list(pool.map(lambda isa: build_one(cxx, isa), todo))
    if todo:
        print(f"kvserve: built native kernels for {', '.join(todo)} in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
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
