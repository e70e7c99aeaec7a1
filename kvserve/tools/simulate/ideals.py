"""What an unbounded cache could hit: per request, the longest prefix shared with an earlier request
of its namespace, and how much of it each policy and page size can reuse."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.tools.simulate.requests import SimRequest


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
    Each node keeps the longest computed length (prompt + generated but the last) of the requests
    through it, which says how far those requests' full pages reach."""
    stride = max((max(r.token_ids) for r in requests), default=0) + 1
    children: dict[int, int] = {}
    reach: list[int] = []  # per node: max computed tokens of the requests passing through it
    roots: dict[str, int] = {}
    ideals = Ideals([], [], [], {ps: [] for ps in page_sizes}, {ps: [] for ps in page_sizes})
    for r in requests:
        n, total = len(r.token_ids), r.num_computed
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


def short_prefixes(ideals: Ideals, page_size: int) -> dict:
    """Requests whose prefix shared with earlier ones is shorter than one page: hash cannot reuse it."""
    lengths = [s for s in ideals.shared if 0 < s < page_size]
    tokens = sum(t for s, t in zip(ideals.shared, ideals.token) if 0 < s < page_size)
    return {"page_size": page_size, "num_requests": len(lengths),
            "median_shared_tokens": sorted(lengths)[len(lengths) // 2] if lengths else 0,
            "tokens": tokens, "points": 100 * tokens / max(1, sum(ideals.num_tokens))}
