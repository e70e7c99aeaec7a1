"""The report: every replay asked for, the ideals, radix against hash, the diagnosis, and the capacity
to recommend."""

from __future__ import annotations

from dataclasses import asdict, replace

from kvserve.cache.spans import find_hidden_spans
from kvserve.config import ConfigError
from kvserve.tools.simulate.ideals import Ideals, compute_ideals, short_prefixes
from kvserve.tools.simulate.replayer import CacheOptions, RunResult, SchedulerLimits, ServiceModel, replay
from kvserve.tools.simulate.requests import SimRequest, pages_needed, unbounded_pages
from kvserve.tools.simulate.spans import move_span_to_front

POLICIES = ("hash", "radix")


def _pages_for(capacity: int | None, page_size: int) -> int | None:
    if capacity is None:
        return None
    if capacity < page_size:
        raise ConfigError(f"--capacity-tokens {capacity} is less than one page of {page_size} tokens")
    return capacity // page_size


def compare_runs(radix: RunResult, hashed: RunResult) -> dict:
    queries = max(1, radix.prefix_cache_queries)
    delta = 100 * (radix.hit_rate - hashed.hit_rate)
    tail = 100 * (radix.partial_page_hit_tokens - hashed.partial_page_hit_tokens) / queries
    order = delta - tail
    parts = []
    if abs(tail) >= 0.05:
        parts.append(f"{tail:+.1f} points from token-granular tail hits (a match that ends inside a page: "
                     "radix copies the partly matching page, hash reuses full pages only)")
    if abs(order) >= 0.05:
        parts.append(f"{order:+.1f} points from eviction order (which full pages were still cached: radix "
                     "evicts least recently used leaves, so shared prefixes outlive the tails below them; "
                     "hash evicts the least recently freed pages)")
    if abs(delta) < 0.05:
        reason = "radix and hash hit the same tokens"
    else:
        reason = f"radix {'above' if delta > 0 else 'below'} hash by {abs(delta):.1f} points: " + "; ".join(parts)
    return {"page_size": radix.page_size, "capacity_tokens": radix.capacity_tokens,
            "radix_hit_rate": radix.hit_rate, "hash_hit_rate": hashed.hit_rate, "delta_points": delta,
            "token_granular_tail_points": tail, "eviction_order_points": order, "reason": reason}


def capacity_for(requests: list[SimRequest], policy: str, page_size: int, goal: float,
                 service: ServiceModel, limits: SchedulerLimits | None = None) -> RunResult:
    """The smallest pool (to 1% of the unbounded page count) that serves the trace without making any
    request wait for pages and reaches the hit rate `goal`: binary search over page counts, from the
    unbounded replay's peak of pages in use up to unbounded."""
    def ok(run: RunResult) -> bool:
        return run.hit_rate >= goal and run.num_requests_waited == 0 and not run.unservable_request_ids

    hi = unbounded_pages(requests, page_size)
    best = replay(requests, policy, page_size, hi, service, limits=limits)
    biggest = max(pages_needed(r, page_size) for r in requests)
    lo = max(best.peak_pages_used, biggest + 1)
    low = replay(requests, policy, page_size, lo, service, limits=limits)
    if ok(low):
        return low
    while hi - lo > max(1, hi // 100):
        mid = (lo + hi) // 2
        run = replay(requests, policy, page_size, mid, service, limits=limits)
        if ok(run):
            hi, best = mid, run
        else:
            lo = mid
    return best


def analyze(requests: list[SimRequest], policies: list[str], page_sizes: list[int],
            capacities: list[int | None], target_hit_rate: float = 0.9, service: ServiceModel | None = None,
            min_span: int = 64, limits: SchedulerLimits | None = None, cache: CacheOptions | None = None) -> dict:
    """Every run asked for, the ideals, the radix/hash comparisons, the diagnosis and a recommendation;
    with tool calls in the trace, each run again with the tool-call holds off beside it."""
    service, limits, cache = service or ServiceModel(), limits or SchedulerLimits(), cache or CacheOptions()
    ideals = compute_ideals(requests, page_sizes)
    results: dict[tuple[str, int, int | None], RunResult] = {}

    def run(policy: str, ps: int, capacity: int | None) -> RunResult:
        key = (policy, ps, capacity)
        if key not in results:
            r = results[key] = replay(requests, policy, ps, _pages_for(capacity, ps), service, limits=limits,
                                      cache=cache)
            r.attainable_hit_rate = ideals.rate((ideals.radix if policy == "radix" else ideals.hash)[ps])
        return results[key]

    runs = [run(p, ps, c) for ps in page_sizes for c in capacities for p in policies]
    holds = []
    if any(r.tool_call for r in requests) and cache.tool_call_kv_ttl > 0:
        off = replace(cache, tool_call_kv_ttl=0.0)
        for r in runs:
            o = replay(requests, r.policy, r.page_size, _pages_for(r.capacity_tokens, r.page_size), service,
                       limits=limits, cache=off)
            holds.append({"policy": r.policy, "page_size": r.page_size, "capacity_tokens": r.capacity_tokens,
                          "tool_call_kv_ttl": cache.tool_call_kv_ttl, "num_follow_ups": r.num_follow_ups,
                          "follow_up_hit_rate_on": r.follow_up_hit_rate, "follow_up_hit_rate_off": o.follow_up_hit_rate,
                          "holds_granted": r.tool_call_holds_granted, "holds_used": r.tool_call_holds_used,
                          "hit_rate_on": r.hit_rate, "hit_rate_off": o.hit_rate})
    comparisons = [compare_runs(run("radix", ps, c), run("hash", ps, c))
                   for ps in page_sizes for c in capacities if set(POLICIES) <= set(policies)]

    # recommendation: the best policy and page size unbounded, then the capacity that reaches the target
    best_rate = max(run(p, ps, None).hit_rate for p in policies for ps in page_sizes)
    policy, page_size = max(((p, ps) for p in policies for ps in page_sizes
                             if run(p, ps, None).hit_rate >= best_rate - 0.005),
                            key=lambda c: (c[1], c[0] == "radix"))
    reachable = best_rate >= target_hit_rate
    goal = target_hit_rate if reachable else max(0.0, best_rate - 0.01)
    sized = capacity_for(requests, policy, page_size, goal, service, limits)
    recommendation = {
        "policy": policy, "page_size": page_size, "target_hit_rate": target_hit_rate,
        "unbounded_hit_rate": run(policy, page_size, None).hit_rate, "target_reachable": reachable,
        "capacity_tokens": sized.num_pages * page_size, "hit_rate_at_capacity": sized.hit_rate,
        "peak_tokens_used_at_capacity": sized.peak_tokens_used,
    }

    spans = []
    now = run(policy, page_size, capacities[0])  # the diagnosis replays the recommended policy, first capacity
    for span in find_hidden_spans(requests, ideals.shared, min_span):
        moved = replay(move_span_to_front(requests, span), policy, page_size,
                       _pages_for(capacities[0], page_size), service, limits=limits)
        spans.append({"offset": span.offset, "min_offset": span.min_offset, "max_offset": span.max_offset,
                      "length": span.length, "num_requests": span.num_requests,
                      "num_hidden_tokens": span.num_hidden_tokens, "policy": policy, "page_size": page_size,
                      "capacity_tokens": now.capacity_tokens, "hit_rate_now": now.hit_rate,
                      "hit_rate_if_moved_to_front": moved.hit_rate})
    shorts = [short_prefixes(ideals, ps) for ps in page_sizes]
    recommendation["text"] = _recommendation_text(recommendation, spans, shorts, ideals)
    return {
        "trace": {"num_requests": len(requests), "num_prompt_tokens": sum(ideals.num_tokens),
                  "num_generated_tokens": sum(r.num_generated for r in requests),
                  "num_namespaces": len({r.namespace for r in requests}),
                  "replay": "sequential" if requests[0].arrival is None else "arrivals"},
        "service_model": asdict(service),
        "scheduler": asdict(limits),
        "ideal_hit_rate": ideals.rate(ideals.token),
        "runs": [_run_json(r) for r in runs],
        "tool_call_holds": holds,
        "comparisons": comparisons,
        "diagnosis": {"hidden_spans": spans, "short_prefixes": shorts},
        "recommendation": recommendation,
    }


def _run_json(r: RunResult) -> dict:
    out = asdict(r)
    out["num_requests_unservable"] = len(out.pop("unservable_request_ids"))
    return out


def _recommendation_text(rec: dict, spans: list[dict], shorts: list[dict], ideals: Ideals) -> str:
    config = f"prefix_cache={rec['policy']} with page_size {rec['page_size']}"
    capacity = (f"about {rec['capacity_tokens']:,} tokens of KV cache ({rec['peak_tokens_used_at_capacity']:,} "
                f"at peak in flight, no request waiting)")
    if rec["target_reachable"]:
        text = (f"use {config} and {capacity} for a {rec['target_hit_rate']:.0%} hit rate "
                f"(got {rec['hit_rate_at_capacity']:.1%})")
    elif rec["unbounded_hit_rate"] < 0.02:
        text = (f"as sent, this trace gives a prefix cache almost nothing to reuse (best: {config}, "
                f"{rec['unbounded_hit_rate']:.1%} unbounded); size the pool for the requests in flight: {capacity}")
    else:
        text = (f"a {rec['target_hit_rate']:.0%} hit rate is out of reach at any capacity: {config} hits "
                f"{rec['unbounded_hit_rate']:.1%} unbounded (token-granular ideal {ideals.rate(ideals.token):.1%}); "
                f"{capacity} gets within a point of that ({rec['hit_rate_at_capacity']:.1%})")
    for span in spans[:1]:
        text += (f"; move the {span['length']:,}-token span repeated at offset {span['offset']:,} in "
                 f"{span['num_requests']} requests to the front of the prompt: hit rate "
                 f"{span['hit_rate_now']:.1%} -> {span['hit_rate_if_moved_to_front']:.1%}")
    short = next((s for s in shorts if s["page_size"] == rec["page_size"] and s["num_requests"]), None)
    if short is not None and short["points"] >= 1:
        text += (f"; {short['num_requests']} requests share fewer than {short['page_size']} tokens with earlier "
                 f"ones ({short['points']:.1f} points): hash cannot reuse them, a smaller page size can")
    return text


