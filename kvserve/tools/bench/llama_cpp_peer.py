"""llama-cpp-python as a peer (installed only to benchmark, from ../shared/peers/llama.cpp/wheels):
sequential Llama.generate on the same GGUF, which reuses the prefix shared with the prompt it last ran."""

from __future__ import annotations

import os
import time

from kvserve.cache.hashing import common_prefix_len
from kvserve.tools.bench.spec import WARMUP_IDS, Reporter, RunSpec, wait_until


def run_llama_cpp(spec: RunSpec, report: Reporter) -> dict:
    from llama_cpp import Llama

    longest = max(len(p) + m for p, m in zip(spec.token_ids, spec.max_tokens))
    start = time.perf_counter()
    threads = spec.threads or len(os.sched_getaffinity(0))
    llm = Llama(model_path=spec.model_path, n_ctx=longest + 16, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    load_s = time.perf_counter() - start

    def generate(ids: list[int], max_tokens: int, on_token=None) -> tuple[list[int], float | None]:
        out, first = [], None  # Llama.generate reuses the longest prefix shared with what it last ran
        for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            first = first or time.monotonic()
            out.append(token)
            if on_token:
                on_token()
            if len(out) == max_tokens:
                break
        return out, first

    on_token = report.warm_up_then_count(lambda: generate(WARMUP_IDS, 4))
    requests = []
    t0 = time.monotonic()
    for ids, max_tokens, arrival in zip(spec.token_ids, spec.max_tokens, spec.arrivals):
        wait_until(t0 + arrival)
        cached = min(common_prefix_len(list(llm.input_ids[: llm.n_tokens]), ids), len(ids) - 1)
        new, first = generate(ids, max_tokens, on_token)
        requests.append({"output_token_ids": new, "ttft_s": first - t0 - arrival,
                         "e2e_s": time.monotonic() - t0 - arrival, "cached_tokens": max(cached, 0)})
    wall = time.monotonic() - t0
    meta = llm.metadata
    arch = meta.get("general.architecture", "llama")
    try:
        layers, kv_heads = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.attention.head_count_kv"])
        head_dim = int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"])
        kv = llm.n_ctx() * 2 * layers * kv_heads * head_dim * 2  # f16 K and V
    except (KeyError, ValueError):
        kv = None
    return {"wall_s": wall, "load_s": load_s, "requests": requests, "kv_bytes": kv, "kv_bytes_used_peak": kv,
            "kv_capacity_tokens": llm.n_ctx(),
            "prefix_hit_rate": sum(r["cached_tokens"] for r in requests) / sum(map(len, spec.token_ids))}

