"""Weights in a GGUF format the native kernels lack (IQ4_XS, Q3_K, Q2_K, ...) under the native mode:
each such tensor is requantized to Q8_0 at load and runs on the Q8_0 kernel, while the rest of the
model keeps its own formats. The load says so once per format."""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from kvserve.model.loaded import GGUFTensor

log = logging.getLogger("kvserve.model")
FALLBACK_TYPE = GGMLQuantizationType.Q8_0  # 8.5 bits a weight, error under 0.4% of a block's largest value
FALLBACK_BLOCK = 32


class NativeFallback:
    """Requantizes one tensor at a time; remembers which formats it has announced."""

    def __init__(self) -> None:
        self.announced: set[str] = set()

    def blocks(self, t: GGUFTensor) -> tuple[int, torch.Tensor]:
        """(ggml type, [rows, row bytes] uint8) of `t` in Q8_0 (F32 where a row is no whole number of
        blocks), rows in HF order as native_blocks gives them."""
        from gguf.quants import quantize

        self._announce(t.qtype.name)
        w = t.dequantize()  # float32 [rows, cols], rope rows already in HF order
        if w.shape[1] % FALLBACK_BLOCK:
            return int(GGMLQuantizationType.F32), w.contiguous().view(torch.uint8)
        blocks = quantize(w.numpy(), FALLBACK_TYPE)
        return int(FALLBACK_TYPE), torch.from_numpy(np.ascontiguousarray(blocks))

    def _announce(self, name: str) -> None:
        if name not in self.announced:
            self.announced.add(name)
            log.warning("%s weights: the native kernels have no %s kernel; each %s tensor is requantized "
                        "to Q8_0 at load (the other tensors keep their own format; --dtype int8 or "
                        "float32 to run every tensor another way)", name, name, name)
