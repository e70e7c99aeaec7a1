"""The page pool's plan at start-up: how many pages the KV budget buys (the hybrid allocator's window
pool and a draft model's pages included) and the capacity check whose one-line error names what to
change. The engine and `kvserve plan` share it."""

from __future__ import annotations

import dataclasses

from kvserve.config import (CacheConfig, ConfigError, DEFAULT_KV_CACHE_MEMORY, EngineConfig, KVDtype, ModelConfig,
                            PrefixCachePolicy, PreemptionMode, capacity_error_message, format_bytes,
                            kv_bytes_per_page, parse_bytes, pool_tokens_for, resolve_kv_dtype)


def uses_hybrid_kv(config: EngineConfig, model: ModelConfig) -> bool:
    """Sliding-window layers get their own page pool unless disabled or a tier below the pool is
    configured (swap, Redis, disk: their pages carry every layer's K/V), as vLLM does with connectors."""
    return (0 < model.num_window_layers < model.num_layers and not config.disable_hybrid_kv_cache_manager
            and config.preemption_mode == PreemptionMode.RECOMPUTE.value
            and not config.redis_url and not config.kv_disk_path)


def window_slots_needed(config: EngineConfig, window: int) -> int:
    """Window-pool pages that let max_num_seqs sequences hold their windows while one step's
    chunks (max_num_batched_tokens) are written: beyond this the pool would only hold idle pages."""
    per_seq = -(-(window - 1) // config.page_size) + 2  # the window's pages, one at each edge
    return config.max_num_seqs * per_seq + -(-config.max_num_batched_tokens // config.page_size)


def split_kv_budget(memory: int, model: ModelConfig, page_size: int, kv_dtype: KVDtype,
                    window_slots: int, draft_page_bytes: int = 0) -> tuple[int, int, int]:
    """(main pool pages, window pool pages, bytes of one main page) in `memory` bytes. With
    window_slots > 0 (hybrid allocator) the window pool gets that many pages (and the null page),
    never more than the main pool, and the main pool, for full-attention layers, the rest. A draft
    model (speculative decoding) gets as many pages as the main pool, of `draft_page_bytes` each."""
    layer_page = kv_bytes_per_page(1, model.num_kv_heads, model.head_dim, page_size, kv_dtype)
    num_windowed = model.num_window_layers if window_slots else 0
    num_full = model.num_layers - num_windowed
    # page 0, the null page, is inside the budget
    num_pages = memory // (layer_page * model.num_layers + draft_page_bytes)
    num_slots = 0
    if num_windowed:
        num_slots = min(num_pages, window_slots + 1)
        num_pages = (memory - num_slots * num_windowed * layer_page) // (num_full * layer_page + draft_page_bytes)
    return num_pages, num_slots, layer_page * num_full


def plan_cache(config: EngineConfig, model: ModelConfig, draft: ModelConfig | None = None,
               gpu_budget: tuple[int, str] | None = None) -> tuple[CacheConfig, int]:
    """Page count from the memory budget, and the start-up capacity check (split_kv_budget with the
    hybrid allocator, and the draft model's pages with one). `gpu_budget`: (bytes, how they were
    found) when --gpu-memory-utilization sizes the pool (model/gpu_memory.py). Returns (cache
    config, max_model_len)."""
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, config.dtype)
    memory = gpu_budget[0] if gpu_budget else parse_bytes(config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
    hybrid = uses_hybrid_kv(config, model)
    wanted = window_slots_needed(config, model.sliding_window) if hybrid else 0
    draft_bytes = kv_bytes_per_page(draft.num_layers, draft.num_kv_heads, draft.head_dim, config.page_size,
                                    kv_dtype) if draft else 0  # (every layer: a draft has no window pool)
    num_pages, num_slots, page_bytes = split_kv_budget(memory, model, config.page_size, kv_dtype, wanted,
                                                       draft_bytes)
    pool_tokens = pool_tokens_for(num_pages * page_bytes, page_bytes, config.page_size)
    max_model_len = config.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ConfigError(f"--max-model-len {max_model_len} is over the model's context "
                          f"{model.max_position_embeddings}; lower --max-model-len")
    if max_model_len > pool_tokens:
        raise ConfigError(capacity_error_message(max_model_len, pool_tokens, memory,
                                                 (page_bytes + draft_bytes) / config.page_size,
                                                 draft_bytes / config.page_size,
                                                 *((gpu_budget[1], "--gpu-memory-utilization") if gpu_budget else ())))
    if hybrid:
        one_seq = window_slots_needed(dataclasses.replace(config, max_num_seqs=1), model.sliding_window)
        if num_slots - 1 < min(one_seq, -(-max_model_len // config.page_size)):
            raise ConfigError(f"--kv-cache-memory {format_bytes(memory)} leaves the sliding-window layers "
                              f"{num_slots - 1} pages; one sequence needs {one_seq}: raise --kv-cache-memory")
    cache = CacheConfig(page_size=config.page_size, num_pages=num_pages, kv_dtype=kv_dtype,
                        prefix_cache=PrefixCachePolicy(config.prefix_cache),
                        max_leased_fraction=config.max_leased_fraction,
                        tenant_kv_share=config.tenant_kv_share, num_window_slots=num_slots,
                        sliding_window=model.sliding_window if hybrid else None)
    return cache, max_model_len
