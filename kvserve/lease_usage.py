"""Granting a request's cache breakpoints once its prompt is computed, and reporting what they did in
Anthropic's usage terms: tokens read from the cache, tokens written (leased) per TTL label, and why a
breakpoint got no lease. Torch-free; the engine calls it after each step."""

from __future__ import annotations

from kvserve.cache.leases import LeaseRefusal
from kvserve.cache.manager import KVCacheManager
from kvserve.request import LeaseUsage, Request


def grant_leases(manager: KVCacheManager, request: Request, min_cacheable_tokens: int,
                 ttl_scale: float = 1.0) -> LeaseUsage:
    """Lease the prefix up to each breakpoint of `request` (its prompt is computed and committed).

    read     = the longest breakpoint whose whole prefix was served from the cache (a provider reads at
               breakpoints: a partial hit of a prefix is a miss that writes it again)
    creation = for each granted breakpoint, the tokens past what was read or written before it
    A breakpoint shorter than `min_cacheable_tokens` is silently not cached, as providers do; one
    refused by the leased-fraction cap leaves the request running without it (`refused` says so).
    """
    usage = LeaseUsage()
    eligible = sorted((b for b in request.leases if b.num_tokens >= min_cacheable_tokens),
                      key=lambda b: b.num_tokens)
    if not eligible:
        usage.refused = LeaseRefusal.BELOW_MIN_CACHEABLE if request.leases else None
        return usage
    last_computable = request.num_prompt_tokens - 1  # the last prompt token is always computed
    usage.cache_read_tokens = covered = max(
        (b.num_tokens for b in eligible if request.num_cached_tokens >= min(b.num_tokens, last_computable)),
        default=0)
    for breakpoint in eligible:
        lease = manager.leases.lease_prefix(request.prompt_token_ids, request.namespace, breakpoint.num_tokens,
                                            breakpoint.ttl_s * ttl_scale, manager.clock(), breakpoint.label,
                                            owner=request.tenant, shared=breakpoint.shared)
        if isinstance(lease, str):
            usage.refused = lease
            continue
        usage.lease_ids.append(lease.lease_id)
        if breakpoint.num_tokens > covered:
            label = breakpoint.label
            usage.cache_creation_tokens[label] = (usage.cache_creation_tokens.get(label, 0)
                                                  + breakpoint.num_tokens - covered)
            covered = breakpoint.num_tokens
    return usage
