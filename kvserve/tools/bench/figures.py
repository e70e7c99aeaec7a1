"""Figures from per-request results: throughput, TTFT percentiles (cached vs cold), TPOT, the ratios
kvserve / peer, and the greedy agreement of two engines' outputs."""

from __future__ import annotations

from kvserve.cache.hashing import common_prefix_len

ENGINE_KEYS = (  # every engine's figures carry exactly these keys (null where not measurable)
    "num_requests", "prompt_tokens", "output_tokens", "wall_s", "output_tokens_per_s", "total_tokens_per_s",
    "ttft_p50_s", "ttft_p95_s", "ttft_mean_s", "tpot_s", "prefix_hit_rate", "cached_prompt_tokens",
    "num_cached_requests", "num_cold_requests", "ttft_cached_p50_s", "ttft_cached_p95_s", "ttft_cold_p50_s",
    "ttft_cold_p95_s", "ttft_cached_over_cold_p95", "peak_rss_bytes", "kv_bytes", "kv_bytes_used_peak",
    "kv_capacity_tokens", "load_s", "threads", "ttft_s")
RATIO_KEYS = ("wall_s", "output_tokens_per_s", "total_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "tpot_s",
              "prefix_hit_rate", "peak_rss_bytes", "kv_bytes", "kv_bytes_used_peak", "kv_capacity_tokens")



def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def num_output(request: dict) -> int:
    """Output tokens of one request: its ids (in-process engines) or the server's count (HTTP)."""
    ids = request.get("output_token_ids")
    return len(ids) if ids is not None else request["num_output_tokens"]


def summarize(raw: dict) -> dict:
    """One engine's figures from its per-request results (ttft_s, e2e_s, cached_tokens, outputs)."""
    reqs = raw["requests"]
    ttft = [r["ttft_s"] for r in reqs]
    known = [r for r in reqs if r["cached_tokens"] is not None]  # a server may not say
    cached = [r["ttft_s"] for r in known if r["cached_tokens"] > 0]
    cold = [r["ttft_s"] for r in known if r["cached_tokens"] == 0]
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (num_output(r) - 1) for r in reqs if num_output(r) > 1]
    prompt = raw["prompt_tokens"]
    output = sum(num_output(r) for r in reqs)
    wall = raw["wall_s"]
    fig = {"num_requests": len(reqs), "prompt_tokens": prompt, "output_tokens": output, "wall_s": wall,
           "output_tokens_per_s": _div(output, wall), "total_tokens_per_s": _div(prompt + output, wall),
           "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
           "ttft_mean_s": sum(ttft) / len(ttft), "tpot_s": sum(tpot) / len(tpot) if tpot else None,
           "prefix_hit_rate": raw.get("prefix_hit_rate"), "cached_prompt_tokens": sum(r["cached_tokens"] for r in known) if known else None,
           "num_cached_requests": len(cached), "num_cold_requests": len(cold),
           "ttft_cached_p50_s": percentile(cached, 50), "ttft_cached_p95_s": percentile(cached, 95),
           "ttft_cold_p50_s": percentile(cold, 50), "ttft_cold_p95_s": percentile(cold, 95),
           "ttft_cached_over_cold_p95": _div(percentile(cached, 95), percentile(cold, 95)),
           "peak_rss_bytes": raw.get("peak_rss_bytes"), "kv_bytes": raw.get("kv_bytes"),
           "kv_bytes_used_peak": raw.get("kv_bytes_used_peak"),
           "kv_capacity_tokens": raw.get("kv_capacity_tokens"), "load_s": raw.get("load_s"),
           "threads": raw.get("threads"), "ttft_s": ttft}
    assert tuple(fig) == ENGINE_KEYS
    return fig


def ratios(ours: dict, peer: dict) -> dict:
    """kvserve's figure / the peer's; `speedup` = the peer's wall time / kvserve's."""
    out = {key: _div(ours[key], peer[key]) for key in RATIO_KEYS}
    out["speedup"] = _div(peer["wall_s"], ours["wall_s"])
    return out


def agreement(ours: list[list[int]], peer: list[list[int]]) -> dict:
    same = sum(a == b for a, b in zip(ours, peer))
    common = [common_prefix_len(a, b) / max(len(a), 1) for a, b in zip(ours, peer)]
    return {"num_requests": len(ours), "identical_requests": same, "fraction": same / len(ours),
            "mean_common_prefix_frac": sum(common) / len(common)}


