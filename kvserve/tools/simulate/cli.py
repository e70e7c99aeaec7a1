"""`kvserve simulate` on the command line: flags, their checks, and the rich report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve.config import ConfigError
from kvserve.tools.planner import parse_tokens
from kvserve.tools.simulate.analysis import POLICIES, analyze
from kvserve.tools.simulate.replayer import CacheOptions, SchedulerLimits, ServiceModel
from kvserve.tools.simulate.requests import prepare
from kvserve.tools.traces import GENERATORS, encode_prompts, generate_trace, load_trace, write_trace


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
    parser.add_argument("--max-num-seqs", type=int, default=SchedulerLimits().max_num_seqs,
                        help="scheduler: requests running at once (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=SchedulerLimits().max_num_batched_tokens,
                        help="scheduler: tokens per step (default: the engine's)")
    parser.add_argument("--min-span", type=int, default=64, help="shortest repeated span the diagnosis reports")
    parser.add_argument("--tool-call-kv-ttl", type=float, default=CacheOptions().tool_call_kv_ttl,
                        help="seconds an answer that is a tool call keeps its KV (the engine's flag; 0: off). "
                             "A trace with tool calls is replayed with the holds off too, side by side")
    parser.add_argument("--max-leased-fraction", type=float, default=CacheOptions().max_leased_fraction,
                        help="of the pool, at most held by leases and tool-call holds (the engine's flag)")
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
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        raise ConfigError("--max-num-seqs and --max-num-batched-tokens must be at least 1")
    if args.min_span < 2:
        raise ConfigError(f"--min-span must be at least 2 tokens, got {args.min_span}")
    if not 0 <= args.tool_call_kv_ttl <= 3600 or not 0 <= args.max_leased_fraction <= 0.9:
        raise ConfigError("--tool-call-kv-ttl must be in [0, 3600] seconds and --max-leased-fraction in [0, 0.9]")
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
                     ServiceModel(args.prefill_tps, args.decode_tps), args.min_span,
                     SchedulerLimits(args.max_num_seqs, args.max_num_batched_tokens),
                     CacheOptions(max_leased_fraction=args.max_leased_fraction, tool_call_kv_ttl=args.tool_call_kv_ttl))
    result["trace"]["source"] = args.trace
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from rich.console import Console

        from kvserve.tools.simulate.render import render_simulation

        render_simulation(result, Console())
    return 0
