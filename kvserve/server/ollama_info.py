"""What Ollama's model routes report about the one served model: /api/tags' listing, /api/show's
details and template, and /api/ps' running entry, whose `kv_cache` puts the KV bytes running requests
hold beside what a runtime that reserves the whole context at load would hold for num_ctx."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from kvserve.config import kv_bytes_per_page
from kvserve.engine import LLMEngine
from kvserve.engine_stats import EngineStats
from kvserve.model.gguf_loader import resolve_model_path

FOREVER = datetime(2318, 1, 1, tzinfo=timezone.utc)  # keep_alive < 0: Ollama shows a far date too
DEFAULT_KEEP_ALIVE_S = 300.0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    names: tuple[str, ...]
    family: str
    num_parameters: int
    quantization: str
    size: int  # bytes of the model file
    digest: str
    context_length: int
    kv_bytes_per_token: float  # what one token's K and V take in the pool's dtype, all layers
    template: str
    version: str
    modified_at: str
    thinks: bool = False  # a thinking model, its reasoning told apart (reasoning.py): Ollama's "thinking"

    @property
    def tag(self) -> str:
        return f"{self.names[0]}:latest"

    def serves(self, name: str) -> bool:
        return name.removesuffix(":latest") in self.names

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": "gguf", "family": self.family, "families": [self.family],
                "parameter_size": _parameter_size(self.num_parameters),
                "quantization_level": self.quantization}

    def listing(self) -> dict[str, Any]:
        return {"name": self.tag, "model": self.tag, "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest, "details": self.details()}

    def show(self) -> dict[str, Any]:
        info = {"general.architecture": self.family, "general.parameter_count": self.num_parameters,
                f"{self.family}.context_length": self.context_length}
        return {"modelfile": f"FROM {self.names[0]}\n", "parameters": "", "template": self.template,
                "details": self.details(), "model_info": info, "modified_at": self.modified_at,
                # (the generic tool format serves any template)
                "capabilities": ["completion", "tools", *(["thinking"] if self.thinks else [])]}

    def expiry(self, keep_alive_s: float | None) -> datetime:
        seconds = DEFAULT_KEEP_ALIVE_S if keep_alive_s is None else keep_alive_s
        now = datetime.now(timezone.utc)
        if seconds < 0 or not seconds < (FOREVER - now).total_seconds():  # past FOREVER is forever
            return FOREVER
        return now + timedelta(seconds=seconds)

    def running(self, stats: EngineStats | None, expires_at: datetime | None,
                num_ctx: int | None) -> dict[str, Any]:
        """/api/ps: size is the model file plus the KV pool; the model is never unloaded here, so
        expires_at only repeats the last keep_alive asked. num_ctx: the last one a request asked."""
        num_ctx = num_ctx or self.context_length
        pool = stats.kv_cache_bytes if stats else 0
        per_token = self.kv_bytes_per_token
        return {**self.listing(), "size": self.size + pool, "size_vram": 0,
                "expires_at": (expires_at or self.expiry(None)).isoformat().replace("+00:00", "Z"),
                "context_length": self.context_length,
                "kv_cache": {"bytes_in_use": stats.kv_bytes_used if stats else 0, "pool_bytes": pool,
                             "bytes_per_token": per_token, "num_ctx": num_ctx,
                             "reserved_at_load_for_num_ctx": round(per_token * num_ctx),
                             "kv_cache_dtype": stats.kv_cache_dtype if stats else ""}}


def model_info(engine: LLMEngine, names: list[str], version: str, thinks: bool = False) -> ModelInfo:
    loaded, cache, cfg = engine.loaded, engine.cache_config, engine.loaded.config
    page_bytes = kv_bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache.page_size, cache.kv_dtype)
    path = resolve_model_path(engine.config.model)
    is_file = os.path.isfile(path)
    quant = Counter(getattr(getattr(t, "qtype", None), "name", "F32") for t in loaded.tensors.values())
    modified = datetime.fromtimestamp(os.path.getmtime(path), timezone.utc) if os.path.exists(path) \
        else datetime.now(timezone.utc)
    return ModelInfo(names=tuple(names), family=loaded.config.architecture,
                     num_parameters=sum(_numel(t.shape) for t in loaded.tensors.values()),
                     quantization=quant.most_common(1)[0][0] if quant else "F32",
                     size=os.path.getsize(path) if is_file else 0, digest=loaded.fingerprint,
                     context_length=engine.max_model_len, kv_bytes_per_token=page_bytes / cache.page_size,
                     template=engine.chat_template or "",
                     version=version, modified_at=modified.isoformat().replace("+00:00", "Z"), thinks=thinks)


def kvserve_version() -> str:
    import kvserve

    return kvserve.__version__


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _parameter_size(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
