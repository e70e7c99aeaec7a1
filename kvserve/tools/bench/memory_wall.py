"""Decode against the memory wall: the bytes one decode token of a single stream must read (every weight
the step multiplies by, plus the KV of its context), this host's read bandwidth from a built-in probe, and
each engine's achieved GB/s (bytes per token / its time per output token) as a fraction of that probe.
The probe runs before the engines and after them and the best counts: on a shared host a neighbour's burst
can halve one probe (Zen 5, two vCPUs: 39-72 GB/s within minutes), which would put an engine above 100%."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

PROBE_BYTES = 256 << 20  # far past any last-level cache


@dataclass(frozen=True, slots=True)
class DecodeBytes:
    weights: int  # bytes of every matrix a decode step multiplies by (the embedding table only when tied)
    kv: int  # KV bytes of one sequence at `context` tokens, in kvserve's KV dtype
    context: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def decode_bytes(model_path: str, engine_kwargs: dict, context: int) -> DecodeBytes:
    """What one decode token of one sequence at `context` tokens reads, from the GGUF's own tensor sizes."""
    from kvserve.config import EngineConfig, kv_bytes_for_tokens, resolve_kv_dtype
    from kvserve.model.gguf_config import read_gguf, read_gguf_config

    sizes = {t.name: int(t.n_bytes) for t in read_gguf(model_path).tensors}
    weights = sum(size for name, size in sizes.items() if not name.endswith("norm.weight"))
    if "output.weight" in sizes:  # untied: an embedding lookup reads one row, not the table
        weights -= sizes.get("token_embd.weight", 0)
    config = EngineConfig(model=model_path, **engine_kwargs)
    model, _ = read_gguf_config(model_path)  # the header alone: no tokenizer built
    kv = kv_bytes_for_tokens(model, resolve_kv_dtype(config.kv_cache_dtype, config.dtype), context, 1)
    return DecodeBytes(weights, kv, context)


def read_bandwidth_gbs(threads: int | None, repeats: int = 7) -> float:
    """This host's read bandwidth: the best of a few sums over PROBE_BYTES of float32 on `threads` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        buffer = torch.ones(PROBE_BYTES // 4)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return PROBE_BYTES / best / 1e9
    finally:
        torch.set_num_threads(before)


def memory_wall(model_path: str, engine_kwargs: dict, context: int, threads: int | None,
                engines: dict[str, dict], earlier_probes: tuple[float, ...] = ()) -> dict:
    """The report's `memory_wall`: bytes per token, the probe (the best of one taken now and
    `earlier_probes`, those taken before the engines ran; each in `host_read_samples_gbs`), and each
    engine's GB/s and fraction of it."""
    need = decode_bytes(model_path, engine_kwargs, context)
    samples = [*earlier_probes, read_bandwidth_gbs(threads)]
    probe = max(samples)
    out = {**asdict(need), "bytes_per_token": need.total, "host_read_gbs": probe,
           "host_read_samples_gbs": samples, "engines": {}}
    for name, figures in engines.items():
        tpot = figures.get("tpot_s")
        if tpot:
            achieved = need.total / tpot / 1e9
            out["engines"][name] = {"achieved_gbs": achieved, "fraction_of_host": achieved / probe}
    return out
