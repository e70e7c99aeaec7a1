"""`kvserve simulate`: replay a trace through the engine's own cache code (`KVCacheManager`, no model)
and explain the hit rate: what each policy, page size and capacity achieves, what was attainable, and
why tokens that repeat across requests were missed.

Replay of one request (the same calls the scheduler makes, with a simple clock instead of a model):

    arrival ─► waiting (FIFO) ─► lookup ─► allocate(prompt, room for max_tokens) ─► commit(prompt)
            ─► runs for (prompt tokens / prefill rate + max_tokens / decode rate) seconds
            ─► commit(prompt + generated) ─► free        (generated ids are synthetic: never shared)

With `arrival` times requests overlap; without them the trace is replayed one request at a time.
A request waits while the pool is short of pages (admission reserves its whole length up front, so
nothing is preempted). The prompt is committed at admission, as the scheduler holds back a request
whose prefix another request is computing, so it hits once that prefix is committed. The service time
ignores hits on purpose: every policy, page size and capacity then replays the same interleaving (up
to waits for pages), so their hit rates differ by what the cache did, not by a shifted clock.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvserve.cache.manager import KVCacheManager, PrefixHit
from kvserve.config import ConfigError
from kvserve.tools.planner import parse_tokens
from kvserve.tools.traces import GENERATORS, TraceRequest, encode_prompts, generate_trace, load_trace, write_trace

POLICIES = ("hash", "radix")
GENERATED_ID_BASE = 1 << 40  # synthetic generated-token ids: above any vocabulary, unique per request


@dataclass(slots=True)
class ServiceModel:
    prefill_tokens_per_s: float = 2000.0
    decode_tokens_per_s: float = 50.0  # per request

    def seconds(self, num_prompt: int, num_generated: int) -> float:
        return num_prompt / self.prefill_tokens_per_s + num_generated / self.decode_tokens_per_s


@dataclass(slots=True)
class SimRequest:
    """A trace request resolved to token ids, in replay order."""

    id: str
    token_ids: list[int]
    namespace: str = ""
    arrival: float | None = None
    num_generated: int = 0


def prepare(requests: list[TraceRequest], token_ids: list[list[int]], model_generation: bool = True) -> list[SimRequest]:
    """Replay order: by arrival (stable), or trace order when no request has one."""
    timed = [r.arrival is not None for r in requests]
    if any(timed) and not all(timed):
        raise ConfigError(f"{timed.count(False)} of {len(requests)} trace requests have no arrival; give "
                          "arrival on every line (overlapping replay) or on none (one at a time)")
    sims = [SimRequest(r.id, ids, r.cache_salt or "", r.arrival, (r.max_tokens or 0) if model_generation else 0)
            for r, ids in zip(requests, token_ids)]
    if len({s.id for s in sims}) != len(sims):
        raise ConfigError("trace request ids must be unique")
    return sorted(sims, key=lambda s: s.arrival or 0.0)


# -- replay through the real cache -------------------------------------------------------------------
@dataclass(slots=True)
class RunResult:
    policy: str
    page_size: int
    capacity_tokens: int | None  # None: unbounded (no eviction can happen)
    num_pages: int  # usable pages
    hit_rate: float
    attainable_hit_rate: float  # this policy and page size with unbounded capacity, requests one at a time
    prefix_cache_queries: int
    prefix_cache_hits: int
    partial_page_hit_tokens: int  # hit tokens inside partly matched last pages (token-granular tails)
    num_evictions: int
    peak_pages_used: int
    peak_tokens_used: int
    num_requests_served: int
    num_requests_waited: int
    unservable_request_ids: list[str] = field(default_factory=list)


def unbounded_pages(requests: list[SimRequest], page_size: int) -> int:
    """Enough pages that no request ever waits and no cached page is ever evicted."""
    return sum(-(-(len(r.token_ids) + r.num_generated) // page_size) for r in requests) + 1


def replay(requests: list[SimRequest], policy: str, page_size: int, num_pages: int | None = None,
           service: ServiceModel | None = None, check_invariants: bool = False) -> RunResult:
    """Drive a fresh KVCacheManager with the trace; `num_pages` usable pages (None: unbounded)."""
    service = service or ServiceModel()
    capacity = None if num_pages is None else num_pages * page_size
    num_pages = unbounded_pages(requests, page_size) if num_pages is None else num_pages
    m = KVCacheManager(num_pages + 1, page_size, policy)  # + the reserved null page
    sequential = requests and requests[0].arrival is None
    running: list[tuple[float, int, int]] = []  # (finish time, admission order, request index)
    waiting: deque[int] = deque()
    hits: dict[int, PrefixHit] = {}
    now, peak, partial, num_waited, admitted = 0.0, 0, 0, 0, 0
    unservable: list[str] = []
    stride = max((r.num_generated for r in requests), default=0) + 1

    def full_tokens(i: int) -> list[int]:
        start = GENERATED_ID_BASE + i * stride
        return requests[i].token_ids + list(range(start, start + requests[i].num_generated))

    def complete_one() -> None:
        nonlocal now
        finish, _, i = heapq.heappop(running)
        now = max(now, finish)
        tokens = full_tokens(i)
        m.commit(requests[i].id, tokens, len(tokens))
        m.free(requests[i].id)

    def admit() -> None:
        nonlocal peak, partial, num_waited, admitted
        while waiting:
            i = waiting[0]
            r = requests[i]
            hit = hits.pop(i) if i in hits else m.lookup(r.token_ids, r.namespace)
            total = len(r.token_ids) + r.num_generated
            copies = m.allocate(r.id, r.token_ids, r.namespace, hit, total)
            if copies is None and running:
                hits[i] = hit  # still valid later: only this request allocates before it, nothing evicts
                num_waited += 1
                return
            if copies is None and hit.num_tokens:  # reusing idle hit pages can cost one page: retry cold
                hit = PrefixHit()
                copies = m.allocate(r.id, r.token_ids, r.namespace, hit, total)
            waiting.popleft()
            if copies is None:
                unservable.append(r.id)  # larger than the whole pool
                continue
            m.commit(r.id, r.token_ids, len(r.token_ids))
            partial += hit.num_tokens % page_size
            peak = max(peak, m.num_used_pages)
            finish = now + service.seconds(len(r.token_ids), r.num_generated)
            heapq.heappush(running, (finish, admitted, i))
            admitted += 1

    for i, r in enumerate(requests):
        if sequential:
            while running:
                complete_one()
        else:
            while running and running[0][0] <= r.arrival:
                complete_one()
                admit()
            now = max(now, r.arrival)
        waiting.append(i)
        admit()
    while running:
        complete_one()
        admit()
    if check_invariants:
        m.check_invariants()
        assert m.num_used_pages == 0, "pages leaked after the replay"
    stats = m.stats()
    queries, num_hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
    return RunResult(policy, page_size, capacity, num_pages, num_hits / queries if queries else 0.0, math.nan,
                     queries, num_hits, partial, stats["num_evictions"], peak, peak * page_size,
                     len(requests) - len(unservable), num_waited, unservable)


# -- what an unbounded cache could hit ---------------------------------------------------------------
@dataclass(slots=True)
class Ideals:
    """Per request (replay order): `shared` = longest prefix shared with any earlier request of the same
    namespace (uncapped); `token` = min(shared, len - 1), the token-granular ideal; per page size,
    `hash` = full pages of it and `radix` = its part inside pages the earlier requests filled."""

    num_tokens: list[int]
    shared: list[int]
    token: list[int]
    hash: dict[int, list[int]]
    radix: dict[int, list[int]]

    def rate(self, hits: list[int]) -> float:
        return sum(hits) / max(1, sum(self.num_tokens))


def compute_ideals(requests: list[SimRequest], page_sizes: list[int]) -> Ideals:
    """One token trie over all prompts (node ids in one dict keyed node * stride + token): O(total tokens).
    Each node keeps the longest total length (prompt + generated) of the requests through it, which
    says how far those requests' full pages reach."""
    stride = max((max(r.token_ids) for r in requests), default=0) + 1
    children: dict[int, int] = {}
    reach: list[int] = []  # per node: max total tokens of the requests passing through it
    roots: dict[str, int] = {}
    ideals = Ideals([], [], [], {ps: [] for ps in page_sizes}, {ps: [] for ps in page_sizes})
    for r in requests:
        n, total = len(r.token_ids), len(r.token_ids) + r.num_generated
        if r.namespace not in roots:
            roots[r.namespace] = len(reach)
            reach.append(0)
        node, depth, path_reach = roots[r.namespace], 0, []
        for token in r.token_ids:
            child = children.get(node * stride + token)
            if child is None:
                break
            node = child
            path_reach.append(reach[node])
            depth += 1
        ideals.num_tokens.append(n)
        ideals.shared.append(depth)
        ideals.token.append(min(depth, n - 1))
        for ps in page_sizes:
            ideals.hash[ps].append(min(depth // ps * ps, n - 1))
            # largest d whose node an earlier request passes with full pages reaching d (monotone in d)
            lo, hi = 0, depth
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if path_reach[mid - 1] // ps * ps >= mid else (lo, mid - 1)
            ideals.radix[ps].append(min(lo, n - 1))
        node = roots[r.namespace]
        for token in r.token_ids:  # insert, raising the reach along the path
            key = node * stride + token
            child = children.get(key)
            if child is None:
                child = children[key] = len(reach)
                reach.append(0)
            node = child
            reach[node] = max(reach[node], total)
    return ideals


# -- diagnosis: repeated spans the prefix cache cannot see -------------------------------------------
_MOD, _BASE = (1 << 61) - 1, 1_000_003


def _winnow(tokens: list[int], k: int, w: int) -> list[tuple[int, int]]:
    """(hash, position) of the k-grams selected by winnowing: the rightmost minimum of every w
    consecutive k-gram hashes. Any span of >= w + k - 1 tokens that two sequences share yields a
    common selected k-gram in both (Schleimer et al. 2003)."""
    if len(tokens) < k:
        return []
    top = pow(_BASE, k - 1, _MOD)
    h = 0
    for t in tokens[:k]:
        h = (h * _BASE + t + 1) % _MOD
    hashes = [h]
    for p in range(k, len(tokens)):
        h = ((h - (tokens[p - k] + 1) * top) * _BASE + tokens[p] + 1) % _MOD
        hashes.append(h)
    picked, window, last = [], deque(), -1
    for j, h in enumerate(hashes):
        while window and hashes[window[-1]] >= h:
            window.pop()
        window.append(j)
        if window[0] <= j - w:
            window.popleft()
        if (j >= w - 1 or j == len(hashes) - 1) and window[0] != last:
            last = window[0]
            picked.append((hashes[last], last))
    return picked


@dataclass(slots=True)
class HiddenSpan:
    offset: int  # most common start position
    min_offset: int
    max_offset: int
    length: int
    num_requests: int  # requests where the span repeats but their cached prefix cannot reach it
    num_hidden_tokens: int
    starts: dict[int, int]  # request index -> start of the span there


def find_hidden_spans(requests: list[SimRequest], shared: list[int], min_length: int = 64,
                      min_requests: int | None = None, max_spans: int = 5) -> list[HiddenSpan]:
    """Spans of >= min_length tokens repeated in at least `min_requests` requests at a position their
    shared prefix does not reach (a per-request header before a shared system prompt). Winnowed
    fingerprints find candidates in O(total tokens); each is extended left and right while all its
    requests agree."""
    if min_requests is None:
        min_requests = max(2, math.ceil(0.05 * len(requests)))
    k = max(1, min_length // 2)
    w = max(1, min_length - k + 1)
    occurrences: dict[tuple[str, int], dict[int, int]] = {}
    for i, r in enumerate(requests):
        for h, pos in _winnow(r.token_ids, k, w):
            if pos > 0 and shared[i] < pos + k:  # the prefix cache cannot reach this k-gram here
                occurrences.setdefault((r.namespace, h), {}).setdefault(i, pos)
    spans: list[HiddenSpan] = []
    covered: dict[int, list[tuple[int, int]]] = {}
    for members in sorted((m for m in occurrences.values() if len(m) >= min_requests),
                          key=lambda m: (next(iter(m)), next(iter(m.values())))):
        if any(s <= pos < e for i, pos in members.items() for s, e in covered.get(i, ())):
            continue
        items = list(members.items())
        (i0, p0) = items[0]
        ref = requests[i0].token_ids
        left = min(p for _, p in items)
        for t in range(1, left + 1):
            if any(requests[i].token_ids[p - t] != ref[p0 - t] for i, p in items):
                left = t - 1
                break
        right = 0
        while all(p + right < len(requests[i].token_ids) and p0 + right < len(ref)
                  and requests[i].token_ids[p + right] == ref[p0 + right] for i, p in items):
            right += 1
        length = left + right
        if length < min_length:
            continue
        starts = {i: p - left for i, p in items}
        for i, s in starts.items():
            covered.setdefault(i, []).append((s, s + length))
        offset = Counter(starts.values()).most_common(1)[0][0]
        hidden = sum(min(length, s + length - max(shared[i], s)) for i, s in starts.items())
        spans.append(HiddenSpan(offset, min(starts.values()), max(starts.values()), length, len(starts),
                                hidden, starts))
    spans.sort(key=lambda s: -s.num_hidden_tokens)
    return spans[:max_spans]


def move_span_to_front(requests: list[SimRequest], span: HiddenSpan) -> list[SimRequest]:
    """The trace as it would be if each request sent the span first and its own header after it."""
    out = []
    for i, r in enumerate(requests):
        tokens = r.token_ids
        if i in span.starts:
            s, e = span.starts[i], span.starts[i] + span.length
            tokens = tokens[s:e] + tokens[:s] + tokens[e:]
        out.append(SimRequest(r.id, tokens, r.namespace, r.arrival, r.num_generated))
    return out


def short_prefixes(ideals: Ideals, page_size: int) -> dict:
    """Requests whose prefix shared with earlier ones is shorter than one page: hash cannot reuse it."""
    lengths = [s for s in ideals.shared if 0 < s < page_size]
    tokens = sum(t for s, t in zip(ideals.shared, ideals.token) if 0 < s < page_size)
    return {"page_size": page_size, "num_requests": len(lengths),
            "median_shared_tokens": sorted(lengths)[len(lengths) // 2] if lengths else 0,
            "tokens": tokens, "points": 100 * tokens / max(1, sum(ideals.num_tokens))}


# -- the report --------------------------------------------------------------------------------------
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
                 service: ServiceModel) -> RunResult:
    """The smallest pool (to 1% of the unbounded page count) that serves the trace without making any
    request wait for pages and reaches the hit rate `goal`: binary search over page counts, from the
    unbounded replay's peak of pages in use up to unbounded."""
    def ok(run: RunResult) -> bool:
        return run.hit_rate >= goal and run.num_requests_waited == 0 and not run.unservable_request_ids

    hi = unbounded_pages(requests, page_size)
    best = replay(requests, policy, page_size, hi, service)
    biggest = max(-(-(len(r.token_ids) + r.num_generated) // page_size) for r in requests)
    lo = max(best.peak_pages_used, biggest + 1)
    low = replay(requests, policy, page_size, lo, service)
    if ok(low):
        return low
    while hi - lo > max(1, hi // 100):
        mid = (lo + hi) // 2
        run = replay(requests, policy, page_size, mid, service)
        if ok(run):
            hi, best = mid, run
        else:
            lo = mid
    return best


def analyze(requests: list[SimRequest], policies: list[str], page_sizes: list[int],
            capacities: list[int | None], target_hit_rate: float = 0.9, service: ServiceModel | None = None,
            min_span: int = 64) -> dict:
    """Every run asked for, the ideals, the radix/hash comparisons, the diagnosis and a recommendation."""
    service = service or ServiceModel()
    ideals = compute_ideals(requests, page_sizes)
    results: dict[tuple[str, int, int | None], RunResult] = {}

    def run(policy: str, ps: int, capacity: int | None) -> RunResult:
        key = (policy, ps, capacity)
        if key not in results:
            r = results[key] = replay(requests, policy, ps, _pages_for(capacity, ps), service)
            r.attainable_hit_rate = ideals.rate((ideals.radix if policy == "radix" else ideals.hash)[ps])
        return results[key]

    runs = [run(p, ps, c) for ps in page_sizes for c in capacities for p in policies]
    comparisons = [compare_runs(run("radix", ps, c), run("hash", ps, c))
                   for ps in page_sizes for c in capacities if set(POLICIES) <= set(policies)]

    # recommendation: the best policy and page size unbounded, then the capacity that reaches the target
    best_rate = max(run(p, ps, None).hit_rate for p in policies for ps in page_sizes)
    policy, page_size = max(((p, ps) for p in policies for ps in page_sizes
                             if run(p, ps, None).hit_rate >= best_rate - 0.005),
                            key=lambda c: (c[1], c[0] == "radix"))
    reachable = best_rate >= target_hit_rate
    goal = target_hit_rate if reachable else max(0.0, best_rate - 0.01)
    sized = capacity_for(requests, policy, page_size, goal, service)
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
                       _pages_for(capacities[0], page_size), service)
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
        "ideal_hit_rate": ideals.rate(ideals.token),
        "runs": [_run_json(r) for r in runs],
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


# -- command line ------------------------------------------------------------------------------------
def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", help="JSON-lines trace, or a generated mix: " + ", ".join(GENERATORS))
    parser.add_argument("--policy", default="hash,radix", help="comma list of hash, radix (default both)")
    parser.add_argument("--page-size", default="16", help="comma list of page sizes, e.g. 16,64 (default 16)")
    parser.add_argument("--capacity-tokens", default=None,
                        help="comma list of KV capacities in tokens, e.g. 32k,128k (default: unbounded)")
    parser.add_argument("--target-hit-rate", type=float, default=0.9, help="for the capacity recommendation")
    parser.add_argument("--tokenizer", default="bundled",
                        help="for text prompts: bundled (SmolLM2), a .gguf path, or none (one token per byte)")
    parser.add_argument("--no-generation", action="store_true",
                        help="ignore max_tokens: do not reserve and commit generated tokens")
    parser.add_argument("--prefill-tps", type=float, default=2000.0, help="service model: prompt tokens/s")
    parser.add_argument("--decode-tps", type=float, default=50.0, help="service model: tokens/s per request")
    parser.add_argument("--min-span", type=int, default=64, help="shortest repeated span the diagnosis reports")
    parser.add_argument("--generate", default=None, choices=list(GENERATORS), help="write an example trace")
    parser.add_argument("-n", "--num-requests", type=int, default=64, help="requests to generate (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", default=None, help="where --generate writes the trace")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _csv(value: str, what: str) -> list[str]:
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    if not items:
        raise ConfigError(f"{what} needs at least one value")
    return items


def _parse_args(args: argparse.Namespace) -> tuple[list[str], list[int], list[int | None]]:
    policies = _csv(args.policy, "--policy")
    for p in policies:
        if p not in POLICIES:
            raise ConfigError(f"--policy {p!r} is not a prefix cache policy; choose hash, radix or hash,radix")
    page_sizes = []
    for v in _csv(args.page_size, "--page-size"):
        if not v.isdigit() or not 1 <= int(v) <= 256 or int(v) & (int(v) - 1):
            raise ConfigError(f"--page-size must be a power of two from 1 to 256, got {v!r}")
        page_sizes.append(int(v))
    capacities: list[int | None] = [None]
    if args.capacity_tokens is not None:
        capacities = [None if v == "unbounded" else parse_tokens(v) for v in _csv(args.capacity_tokens, "--capacity-tokens")]
    if not 0 < args.target_hit_rate <= 1:
        raise ConfigError(f"--target-hit-rate must be in (0, 1], got {args.target_hit_rate}")
    if args.prefill_tps <= 0 or args.decode_tps <= 0:
        raise ConfigError("--prefill-tps and --decode-tps must be positive")
    if args.min_span < 2:
        raise ConfigError(f"--min-span must be at least 2 tokens, got {args.min_span}")
    return list(dict.fromkeys(policies)), list(dict.fromkeys(page_sizes)), list(dict.fromkeys(capacities))


def main_simulate(args: argparse.Namespace) -> int:
    """`kvserve simulate`. A ConfigError propagates for the CLI to print as one line."""
    if args.generate is not None:
        if not args.output:
            raise ConfigError("--generate needs -o FILE to write the trace to")
        trace = generate_trace(args.generate, args.num_requests, args.seed)
        write_trace(trace, args.output)
        summary = {"generated": args.generate, "path": args.output, "num_requests": len(trace),
                   "num_prompt_tokens": sum(len(r.prompt_token_ids) for r in trace), "seed": args.seed}
        print(json.dumps(summary, indent=2) if args.json else
              f"wrote {summary['num_requests']} {args.generate} requests "
              f"({summary['num_prompt_tokens']:,} prompt tokens) to {args.output}")
        return 0
    if not args.trace:
        raise ConfigError("give a trace file (JSON lines) or --generate NAME -o FILE")
    policies, page_sizes, capacities = _parse_args(args)
    if not Path(args.trace).exists() and args.trace in GENERATORS:
        trace = generate_trace(args.trace, args.num_requests, args.seed)
    else:
        trace = load_trace(args.trace)
    requests = prepare(trace, encode_prompts(trace, args.tokenizer), not args.no_generation)
    result = analyze(requests, policies, page_sizes, capacities, args.target_hit_rate,
                     ServiceModel(args.prefill_tps, args.decode_tps), args.min_span)
    result["trace"]["source"] = args.trace
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from rich.console import Console

        render_simulation(result, Console())
    return 0


def render_simulation(result: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = result["trace"]
    console.print(f"[bold]{escape(str(t.get('source', 'trace')))}[/]: {t['num_requests']} requests, "
                  f"{t['num_prompt_tokens']:,} prompt tokens, {t['num_generated_tokens']:,} generated, "
                  f"replayed {'one at a time' if t['replay'] == 'sequential' else 'at their arrival times'}")
    console.print(f"ideal hit rate (unbounded, token-granular, longest prefix shared with any earlier "
                  f"request): [bold]{result['ideal_hit_rate']:.1%}[/]")
    table = Table(title="replay through KVCacheManager")
    runs = result["runs"]
    show_waits = any(r["num_requests_waited"] or r["num_requests_unservable"] for r in runs)
    columns = ["policy", "page", "capacity", "hit rate", "attainable", "evictions", "peak pages"]
    for col in columns + (["waited", "unservable"] if show_waits else []):
        table.add_column(col, justify="right")
    for r in runs:
        cells = [r["policy"], str(r["page_size"]),
                 "unbounded" if r["capacity_tokens"] is None else f"{r['capacity_tokens']:,}",
                 f"{r['hit_rate']:.1%}", f"{r['attainable_hit_rate']:.1%}", f"{r['num_evictions']:,}",
                 f"{r['peak_pages_used']:,}"]
        if show_waits:
            cells += [str(r["num_requests_waited"]), str(r["num_requests_unservable"])]
        table.add_row(*cells)
    console.print(table)
    console.print("(attainable: this policy and page size with unbounded capacity, each earlier request "
                  "finished: hash reuses full pages only, radix also the matching start of a filled page)")
    for c in result["comparisons"]:
        cap = "unbounded" if c["capacity_tokens"] is None else f"{c['capacity_tokens']:,} tokens"
        console.print(f"page size {c['page_size']}, {cap}: {c['reason']}")
    d = result["diagnosis"]
    for s in d["hidden_spans"]:
        where = f"offset {s['offset']:,}" if s["min_offset"] == s["max_offset"] else \
            f"offsets {s['min_offset']:,}..{s['max_offset']:,} (mostly {s['offset']:,})"
        console.print(f"[yellow]hidden span[/]: {s['length']:,} tokens repeated at {where} in "
                      f"{s['num_requests']} requests, after tokens that differ, so no prefix cache sees it; "
                      f"moved to the front: {s['hit_rate_now']:.1%} -> {s['hit_rate_if_moved_to_front']:.1%} "
                      f"({s['policy']}, page size {s['page_size']})")
    for s in d["short_prefixes"]:
        if s["num_requests"] and s["points"] >= 0.5:
            console.print(f"[yellow]short shared prefixes[/]: {s['num_requests']} requests share only "
                          f"{s['median_shared_tokens']} tokens (median) with earlier ones, under one page of "
                          f"{s['page_size']}: {s['points']:.1f} points hash cannot reuse")
    console.print(f"[bold]recommendation[/]: {escape(result['recommendation']['text'])}")
