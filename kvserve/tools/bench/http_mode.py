"""The bench over HTTP: each server (kvserve serve, and llama-server with --vs llama-server) is started
fresh, answers one short warm-up request, then gets the workload `passes` times from N concurrent
streaming clients: pass 1 is cold (empty prefix cache), later passes are warm."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvserve.tools.bench.http_client import HttpTarget, run_pass
from kvserve.tools.bench.spec import WARMUP_IDS
from kvserve.tools.bench.servers import SERVED_MODEL_NAME, kvserve_server, llama_server

# fields each server needs to generate exactly max_tokens greedily, with its prefix cache on
EXTRA_BODY = {"kvserve": {"ignore_eos": True}, "llama-server": {"ignore_eos": True, "cache_prompt": True}}


def pass_labels(engine: str, passes: int) -> list[str]:
    if passes == 1:
        return [engine]
    return [f"{engine}/cold"] + [f"{engine}/warm" + (str(i) if passes > 2 else "") for i in range(1, passes)]


def llama_server_context(token_ids: list[list[int]], max_tokens: list[int], parallel: int,
                         kv_capacity_tokens: int | None = None) -> int:
    """Total context: kvserve's KV capacity in tokens when known (the same capacity for both servers),
    at least enough that every slot (context / parallel) holds the longest request."""
    longest = max(len(p) + m for p, m in zip(token_ids, max_tokens)) + 16
    fits = parallel * (-(-longest // 256) * 256)
    return max(fits, kv_capacity_tokens or 0)


def same_slots_kwargs(engine_kwargs: dict, concurrency: int) -> dict:
    """kvserve's engine flags beside `llama-server --parallel N`: both sized for N sequences
    (--max-num-seqs at most N). A sliding-window model's window pool is sized by it, as llama-server's
    SWA cache is by its slots, so the same KV capacity holds for both layer kinds, not only for the
    full-attention layers' tokens."""
    return {**engine_kwargs, "max_num_seqs": min(engine_kwargs["max_num_seqs"], concurrency)}


def kv_capacity_tokens(metrics_text: str) -> int | None:
    """Pages x page size from kvserve's `cache_config_info` series (vLLM's num_gpu_blocks, block_size)."""
    for line in metrics_text.splitlines():
        if line.startswith(("kvserve:cache_config_info{", "vllm:cache_config_info{")):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            try:
                return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            except (KeyError, ValueError):
                return None
    return None


def run_http(engine: str, model_path: str, token_ids: list[list[int]], max_tokens: list[int], concurrency: int,
             passes: int, engine_kwargs: dict, threads: int | None, llama_server_binary: Path,
             progress=None, llama_server_context_tokens: int | None = None,
             same_capacity_as: int | None = None) -> dict[str, dict]:
    """Raw results per pass label: {"wall_s", "requests", "peak_rss_bytes", "load_s", "threads",
    "kv_capacity_tokens", ...}. llama-server's -c: `llama_server_context_tokens` when given, else
    `same_capacity_as` (kvserve's pool in tokens) or enough for its slots, whichever is more.
    `progress(phase, tokens_done)` as in-process engines report."""
    num_threads = threads or len(os.sched_getaffinity(0))
    extra: dict = {}
    if engine.startswith("kvserve"):  # kvserve, kvserve+ngram
        server = kvserve_server(model_path, engine_kwargs)
    else:
        context = llama_server_context_tokens or llama_server_context(token_ids, max_tokens, concurrency,
                                                                       same_capacity_as)
        server = llama_server(llama_server_binary, model_path, concurrency, context, num_threads)
        extra = {"context_tokens": context, "parallel": concurrency, "kv_capacity_tokens": context}
    target = HttpTarget(engine, "", SERVED_MODEL_NAME, EXTRA_BODY[server_of(engine)])
    total = sum(max_tokens)
    out: dict[str, dict] = {}
    if progress:
        progress("starting", None)
    with server:
        target.base_url = server.base_url
        if engine.startswith("kvserve"):
            import httpx

            extra = {"kv_capacity_tokens": kv_capacity_tokens(httpx.get(f"{server.base_url}/metrics").text)}
        run_pass(target, [WARMUP_IDS], [4], 1)
        for index, label in enumerate(pass_labels(engine, passes)):
            if progress:
                progress(label, index * total)
            raw = run_pass(target, token_ids, max_tokens, concurrency,
                           (lambda done, base=index * total: progress(None, base + done)) if progress else None)
            cached = [r["cached_tokens"] for r in raw["requests"]]
            raw.update(peak_rss_bytes=server.peak_rss_bytes(), load_s=server.load_s, threads=num_threads,
                       kv_bytes=None, kv_bytes_used_peak=None, concurrency=concurrency, **extra,
                       prefix_hit_rate=None if None in cached else sum(cached) / sum(map(len, token_ids)))
            out[label] = raw
    return out


def server_of(label: str) -> str:
    """The server a pass label belongs to: llama-server for llama-server/warm, kvserve for kvserve+ngram."""
    name = label.split("/", 1)[0]
    return "kvserve" if name.startswith("kvserve") else name


def kvserve_label_for(peer_label: str) -> str:
    """The kvserve pass a peer's pass is compared with: the same pass."""
    return "kvserve" + peer_label[len(peer_label.split("/", 1)[0]):]

