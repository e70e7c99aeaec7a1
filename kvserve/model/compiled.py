"""The decoder compiled with torch.compile (inductor, dynamic batch size) for decode steps, opt-in
(`EngineConfig.compile`). Paged attention stays eager, behind one opaque custom op; everything
between (norms, RoPE, residuals, the MLP's activation) is fused. Without a working compiler the
first compile fails and the runner falls back to the eager model for good."""

from __future__ import annotations

import logging
import shutil
import sys
import time
from dataclasses import dataclass, field

import torch

from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.llama import LlamaModel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Step:
    """The running step's caches and per-layer metadata: what the opaque attention op reads (they
    change every step, so they cannot be inputs of the compiled graph without recompiling)."""

    kv_caches: list = field(default_factory=list)
    metas: list[AttentionMetadata] = field(default_factory=list)


_STEP = _Step()


@torch.library.custom_op("kvserve::paged_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    # writes the layer's K/V into the cache (not an argument: the graph orders the layers by data)
    out = paged_attention(q, k, v, *_STEP.kv_caches[layer], _STEP.metas[layer])
    return out.contiguous()  # the layout the fake below promises the compiled graph


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


def _attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvserve.paged_attention(q, k, v, layer)


def compiler_available() -> bool:
    """Inductor's CPU backend writes C++: it needs a compiler on PATH."""
    return sys.platform != "win32" and any(shutil.which(c) for c in ("g++", "c++", "clang++"))


class CompiledDecoder:
    """`model`'s forward compiled for steps whose rows are all decode tokens; `__call__` returns None
    when the step is not one (or compiling failed), and the caller runs the eager model."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.failed = not compiler_available()
        if self.failed:
            log.warning("--compile: no C++ compiler found; running the eager model")
        self.compile_s = 0.0  # wall time of the calls that compiled a graph
        self._shapes: set[bool] = set()  # batch size 1 and > 1 compile separately (1 specializes)
        self._fn = torch.compile(self._forward, dynamic=True)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, None, None, attend=_attend)

    def __call__(self, input_ids: torch.Tensor, kv_caches: list, meta: AttentionMetadata) -> torch.Tensor | None:
        if self.failed or meta.prefills:
            return None
        _STEP.kv_caches, _STEP.metas = kv_caches, self.model.layer_metadata(meta)
        first = (input_ids.shape[0] == 1) not in self._shapes
        start = time.perf_counter()
        try:
            return self._fn(input_ids, meta.positions)
        except Exception as e:  # a missing or broken toolchain surfaces here, on the first compile
            if not first:
                raise
            log.warning("--compile: compiling the decode step failed (%s); running the eager model",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            self.failed = True
            return None
        finally:
            if first and not self.failed:
                self._shapes.add(input_ids.shape[0] == 1)
                self.compile_s += time.perf_counter() - start
            _STEP.kv_caches, _STEP.metas = [], []
