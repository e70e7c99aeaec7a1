"""Micro-benchmark of paged attention, native kernel against the torch path, at SmolLM2-135M's shapes
(9 heads, 3 KV heads, head_dim 64, 30 layers): one decode row at ~1.5k context and one 512-row
prefill chunk. `python -m kvserve.tools.bench_attention [--kv bf16] [--threads 1]`; not a test."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvserve import kernels
from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.kv_quant import PagedKV, codec_for

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def _time_ms(fn, repeats: int) -> tuple[float, float]:
    """Median wall ms and mean CPU ms of this process per call (CPU time is the steadier figure on a
    shared host)."""
    fn()
    samples = []
    cpu = time.process_time()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), (time.process_time() - cpu) * 1e3 / repeats


def bench(kv_dtype: str, context: int, num_rows: int, page_size: int,
          repeats: int) -> dict[str, tuple[float, float]]:
    """(wall, CPU) ms of one layer's paged_attention (K/V write included, step metadata not) for `num_rows` query rows ending
    at position context - 1, per path."""
    codec = codec_for(kv_dtype)
    num_pages = -(-context // page_size) + 1
    k_cache, v_cache = (PagedKV(codec, *codec.make_cache(num_pages, page_size, KV_HEADS, HEAD_DIM)) for _ in "kv")
    gen = torch.Generator().manual_seed(0)
    table = list(range(1, num_pages))
    start = context - num_rows
    fill = AttentionMetadata.build([0], [start], [table], page_size) if start else None
    if fill is not None:
        k, v = (torch.randn(start, KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv")
        paged_attention(torch.zeros(start, HEADS, HEAD_DIM), k, v, k_cache, v_cache, fill)
    q = torch.randn(num_rows, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(num_rows, KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv")
    results = {}
    for path in ("torch", "native"):
        os.environ["KVSERVE_KERNELS"] = "on" if path == "native" else "off"
        if path == "native" and kernels.library() is None:
            continue

        meta = AttentionMetadata.build([start], [num_rows], [table], page_size)  # once per step

        def step() -> None:
            paged_attention(q, k, v, k_cache, v_cache, meta)

        results[path] = _time_ms(step, repeats)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.tools.bench_attention", description=__doc__)
    parser.add_argument("--kv", default="bf16", help="KV cache dtype (default bf16, the native mode's)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--context", type=int, default=1536)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = kernels.library()
    print(f"isa {lib.isa if lib else 'none'}, threads {args.threads}, kv {args.kv}, page_size {args.page_size}, "
          f"load average {open('/proc/loadavg').read().split()[:3]}")
    for name, rows, repeats in (("decode row", 1, args.repeats), ("512-row prefill chunk", 512,
                                                                   max(3, args.repeats // 10))):
        r = bench(args.kv, args.context, rows, args.page_size, repeats)
        line = ", ".join(f"{p} {wall:.3f} ms/layer wall, {cpu:.3f} CPU ({cpu * LAYERS:.1f} ms CPU per {LAYERS} layers)"
                         for p, (wall, cpu) in r.items())
        ratio = f"; torch/native CPU {r['torch'][1] / r['native'][1]:.2f}x" if "native" in r else ""
        print(f"{name} at context {args.context}: {line}{ratio}")
    print(f"load average after {open('/proc/loadavg').read().split()[:3]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
