"""`kvserve cost`: what provider prompt caching costs or saves for a prefix and a call pattern.

Provider model (Anthropic's published one): a cacheable prefix is billed at a write multiplier on a
miss (1.25x for the 5-minute TTL, 2x for the 1-hour TTL) and at a read multiplier on a hit (0.1x);
every hit resets the expiry; a prefix shorter than the minimum cacheable length is silently not
cached and billed at 1x. Amounts are "billed token equivalents": prefix tokens x multiplier. Sums
use exact fractions so break-even comparisons do not hinge on float rounding.
"""

from __future__ import annotations

import argparse
import json
import re
from fractions import Fraction
from pathlib import Path

from kvserve.config import ConfigError

TTL_SECONDS = {"5m": 300, "1h": 3600}
DEFAULT_WRITE_MULTIPLIER = {"5m": 1.25, "1h": 2.0}
DEFAULT_READ_MULTIPLIER = 0.1
DEFAULT_OPENAI_READ_MULTIPLIER = 0.1  # OpenAI's cached-input rate for the gpt-5 family (gpt-4.1: 0.25, gpt-4o: 0.5)
DEFAULT_PRICE = 3.0  # $ per million base input tokens
DEFAULT_MIN_CACHEABLE = 1024
_SECONDS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}


def parse_duration(value: str | float) -> float:
    """'30s', '10m', '1.5h', '45' (seconds) -> seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(value).lower())
    if not match or match.group(2) not in _SECONDS:
        raise ConfigError(f"cannot read duration {value!r}; write it like 30s, 10m or 1h")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def load_arrivals(path: str) -> list[float]:
    """Call times in seconds from a JSON-lines trace (each line an object with `arrival`), sorted."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read --trace {path}: {exc.strerror or exc}") from None
    arrivals = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            arrival = json.loads(line)["arrival"]
        except (ValueError, TypeError, KeyError):
            raise ConfigError(f"--trace {path} line {number} is not a JSON object with an 'arrival' "
                              "time in seconds") from None
        if not isinstance(arrival, (int, float)) or arrival < 0:
            raise ConfigError(f"--trace {path} line {number}: arrival must be seconds >= 0, got {arrival!r}")
        arrivals.append(float(arrival))
    if not arrivals:
        raise ConfigError(f"--trace {path} has no calls")
    return sorted(arrivals)


def simulate_calls(arrivals: list[float], ttl_s: float) -> list[bool]:
    """Per call, in time order: True for a cache hit (read), False for a miss (write). A hit within
    the TTL refreshes the expiry; an entry expires exactly ttl_s after its last use."""
    hits, last_use = [], None
    for t in sorted(arrivals):
        hits.append(last_use is not None and t - last_use < ttl_s)
        last_use = t
    return hits


def break_even_calls(write: Fraction, read: Fraction, limit: int = 10_000) -> int | None:
    """Fewest back-to-back calls (one write, then hits) that cost less than uncached calls at 1x."""
    for n in range(1, limit + 1):
        if write + (n - 1) * read < n:
            return n
    return None


def _num(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-tokens", type=int, default=None, help="tokens in the shared, cacheable prefix")
    parser.add_argument("--from-usage", default=None, metavar="FILE",
                        help="JSON lines of usage objects (Anthropic- or OpenAI-shaped, or whole responses "
                             "with `usage`): what that traffic is billed with and without caching")
    parser.add_argument("--calls", type=int, default=None, help="number of calls, --interval apart")
    parser.add_argument("--interval", default=None, help="time between calls: 30s, 10m, 1h (default 30s)")
    parser.add_argument("--trace", default=None, help="JSON lines with 'arrival' seconds, one call per line")
    parser.add_argument("--ttl", default="5m,1h", help="cache lifetime: 5m, 1h or both (default both)")
    parser.add_argument("--price", type=float, default=DEFAULT_PRICE, help="$ per million input tokens (3.0)")
    parser.add_argument("--write-multiplier", type=float, default=None,
                        help="cache write price multiplier (default 1.25 for 5m, 2.0 for 1h)")
    parser.add_argument("--read-multiplier", type=float, default=DEFAULT_READ_MULTIPLIER,
                        help="cache read price multiplier (default 0.1)")
    parser.add_argument("--openai-read-multiplier", type=float, default=DEFAULT_OPENAI_READ_MULTIPLIER,
                        help="OpenAI's cached-input price multiplier for OpenAI-shaped usage (default 0.1, "
                             "the gpt-5 family's; gpt-4.1 0.25, gpt-4o 0.5)")
    parser.add_argument("--min-cacheable", type=int, default=DEFAULT_MIN_CACHEABLE,
                        help="shortest prefix the provider caches (default 1024; some models 512 or 2048)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _arrivals(args: argparse.Namespace) -> tuple[list[float] | None, dict | None]:
    if args.trace is not None:
        if args.calls is not None or args.interval is not None:
            raise ConfigError("give either --trace or --calls/--interval, not both")
        arrivals = load_arrivals(args.trace)
        return arrivals, {"source": "trace", "num_calls": len(arrivals), "interval_s": None,
                          "span_s": arrivals[-1] - arrivals[0]}
    if args.calls is None:
        if args.interval is not None:
            raise ConfigError("--interval needs --calls N")
        return None, None
    if args.calls < 1:
        raise ConfigError(f"--calls must be at least 1, got {args.calls}")
    interval = parse_duration(args.interval if args.interval is not None else "30s")
    arrivals = [i * interval for i in range(args.calls)]
    return arrivals, {"source": "calls", "num_calls": args.calls, "interval_s": interval,
                      "span_s": arrivals[-1]}


def usage_tokens(usage: dict) -> dict[str, int]:
    """One usage object as input (1x), cache writes by TTL and cache reads (Anthropic's `read`,
    OpenAI's `read_openai`), in prompt tokens. Anthropic's input_tokens excludes cached ones; OpenAI's
    prompt_tokens (Chat Completions) and input_tokens with input_tokens_details (Responses) include
    their cached_tokens (OpenAI has no write premium, so it reports no writes)."""
    def count(value) -> int:
        if value is None:
            return 0
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"token counts must be integers >= 0, got {value!r}")
        return value

    responses = "input_tokens_details" in usage or "output_tokens_details" in usage
    if "prompt_tokens" in usage or responses:
        prompt_key, output_key = ("input_tokens", "output_tokens") if responses else ("prompt_tokens",
                                                                                       "completion_tokens")
        read = count((usage.get(f"{prompt_key}_details") or {}).get("cached_tokens"))
        prompt = count(usage.get(prompt_key))
        if read > prompt:
            raise ValueError(f"cached_tokens {read} is over {prompt_key} {prompt}")
        return {"input": prompt - read, "write_5m": 0, "write_1h": 0, "read": 0, "read_openai": read,
                "output": count(usage.get(output_key))}
    if "input_tokens" not in usage:
        raise ValueError("a usage object has input_tokens (Anthropic) or prompt_tokens (OpenAI)")
    written = count(usage.get("cache_creation_input_tokens"))
    split = usage.get("cache_creation") or {}
    hour = count(split.get("ephemeral_1h_input_tokens"))
    if hour > written:
        raise ValueError(f"ephemeral_1h_input_tokens {hour} is over cache_creation_input_tokens {written}")
    return {"input": count(usage["input_tokens"]), "write_5m": written - hour, "write_1h": hour,
            "read": count(usage.get("cache_read_input_tokens")), "read_openai": 0,
            "output": count(usage.get("output_tokens"))}


def bill_usage(usages: list[dict], price: float = DEFAULT_PRICE, write_multiplier: float | None = None,
               read_multiplier: float = DEFAULT_READ_MULTIPLIER,
               openai_read_multiplier: float = DEFAULT_OPENAI_READ_MULTIPLIER) -> dict:
    """What the providers bill for these requests' prompts with caching (Anthropic: writes at 1.25x/2x,
    reads at 0.1x; OpenAI: no write premium, cached tokens at its discount) and without (every prompt
    token at 1x), in billed token equivalents and dollars."""
    totals = dict.fromkeys(("input", "write_5m", "write_1h", "read", "read_openai", "output"), 0)
    for usage in usages:
        for key, value in usage_tokens(usage).items():
            totals[key] += value
    openai_reads = totals.pop("read_openai")
    write = {ttl: Fraction(str(write_multiplier if write_multiplier is not None else mult))
             for ttl, mult in DEFAULT_WRITE_MULTIPLIER.items()}
    plain = Fraction(totals["input"] + totals["write_5m"] + totals["write_1h"] + totals["read"] + openai_reads)
    cached = (totals["input"] + write["5m"] * totals["write_5m"] + write["1h"] * totals["write_1h"]
              + Fraction(str(read_multiplier)) * totals["read"]
              + Fraction(str(openai_read_multiplier)) * openai_reads)
    totals["read"] += openai_reads
    per_token = Fraction(str(price)) / 1_000_000
    return {"num_requests": len(usages), "prompt_tokens": int(plain),
            **{f"{key}_tokens": value for key, value in totals.items()},
            "billed_uncached": _num(plain), "billed_cached": _num(cached),
            "cost_uncached": float(plain * per_token), "cost_cached": float(cached * per_token),
            "savings": float((plain - cached) * per_token),
            "savings_fraction": float((plain - cached) / plain) if plain else 0.0,
            "openai_read_tokens": openai_reads, "price_per_mtok": price}


def load_usages(path: str) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read --from-usage {path}: {exc.strerror or exc}") from None
    usages = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            item = item.get("usage", item) if isinstance(item, dict) else None
            if not isinstance(item, dict):
                raise ValueError("not a JSON object")
            usage_tokens(item)
        except ValueError as err:
            raise ConfigError(f"--from-usage {path} line {number}: {err}") from None
        usages.append(item)
    if not usages:
        raise ConfigError(f"--from-usage {path} has no usage objects")
    return usages


def run_cost(args: argparse.Namespace) -> dict:
    """Everything `kvserve cost` reports, as a JSON-ready dict with stable keys."""
    if args.from_usage is not None:
        if args.prefix_tokens is not None or args.calls is not None or args.trace is not None:
            raise ConfigError("--from-usage takes the traffic from the file; leave out --prefix-tokens, "
                              "--calls and --trace")
        return {"from_usage": bill_usage(load_usages(args.from_usage), args.price, args.write_multiplier,
                                         args.read_multiplier, args.openai_read_multiplier)}
    if args.prefix_tokens is None:
        raise ConfigError("give --prefix-tokens N (a prefix and a call pattern) or --from-usage FILE")
    tokens = args.prefix_tokens
    if tokens < 0:
        raise ConfigError(f"--prefix-tokens cannot be negative, got {tokens}")
    for flag, value in (("--price", args.price), ("--read-multiplier", args.read_multiplier),
                        ("--write-multiplier", args.write_multiplier), ("--min-cacheable", args.min_cacheable)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} cannot be negative, got {value}")
    ttls = [t.strip() for t in args.ttl.replace("both", "5m,1h").split(",") if t.strip()]
    if not ttls or any(t not in TTL_SECONDS for t in ttls):
        raise ConfigError(f"--ttl must be 5m, 1h or both, got {args.ttl!r}")
    arrivals, pattern = _arrivals(args)
    cacheable = tokens > 0 and tokens >= args.min_cacheable
    price = Fraction(str(args.price)) / 1_000_000
    uncached = Fraction(tokens)
    result = {
        "prefix_tokens": tokens, "price_per_mtok": args.price, "min_cacheable": args.min_cacheable,
        "cacheable": cacheable,
        "note": None if cacheable else (
            f"the {tokens:,}-token prefix is below the {args.min_cacheable:,}-token minimum: providers "
            "silently do not cache it, bill every call at 1x, and caching gives no saving"),
        "billed_per_uncached_call": _num(uncached), "cost_per_uncached_call": float(uncached * price),
        "pattern": pattern, "ttls": [],
    }
    for ttl in dict.fromkeys(ttls):
        write_mult = Fraction(str(args.write_multiplier if args.write_multiplier is not None
                                  else DEFAULT_WRITE_MULTIPLIER[ttl]))
        read_mult = Fraction(str(args.read_multiplier))
        # An uncacheable prefix is billed like no caching at all, on every call.
        write, read = (write_mult * tokens, read_mult * tokens) if cacheable else (uncached, uncached)
        even = break_even_calls(write_mult, read_mult) if cacheable and tokens else None
        last = min(max(5, (even or 0) + 1), 50)
        entry = {
            "ttl": ttl, "ttl_s": TTL_SECONDS[ttl], "write_multiplier": float(write_mult),
            "read_multiplier": float(read_mult), "billed_per_write": _num(write), "billed_per_read": _num(read),
            "break_even_calls": even,
            "curve": [{"calls": n, "billed_uncached": _num(n * uncached), "billed_cached": _num(write + (n - 1) * read)}
                      for n in range(1, last + 1)],
            "simulation": None,
        }
        if arrivals is not None:
            hits = simulate_calls(arrivals, TTL_SECONDS[ttl]) if cacheable else []
            reads, writes = sum(hits), len(hits) - sum(hits)
            billed = writes * write + reads * read + (len(arrivals) - len(hits)) * uncached
            plain = len(arrivals) * uncached
            entry["simulation"] = {
                "num_calls": len(arrivals), "num_writes": writes, "num_reads": reads,
                "num_uncached": len(arrivals) - len(hits),
                "billed_uncached": _num(plain), "billed_cached": _num(billed),
                "cost_uncached": float(plain * price), "cost_cached": float(billed * price),
                "savings": float((plain - billed) * price),
                "savings_fraction": float((plain - billed) / plain) if plain else 0.0,
            }
        entry["pays_off"] = (even is not None if entry["simulation"] is None
                             else entry["simulation"]["savings"] > 0)
        entry["verdict"] = _verdict(result, entry)
        result["ttls"].append(entry)
    sims = [e for e in result["ttls"] if e["simulation"] and e["simulation"]["savings"] > 0]
    result["best_ttl"] = max(sims, key=lambda e: e["simulation"]["savings"])["ttl"] if sims else None
    return result


def _verdict(result: dict, entry: dict) -> str:
    ttl = entry["ttl"]
    if not result["cacheable"]:
        return (f"no saving: the prefix is below the {result['min_cacheable']:,}-token minimum, so it is "
                "never cached" if result["prefix_tokens"] else "no saving: there is no prefix")
    sim = entry["simulation"]
    if sim is None:
        even = entry["break_even_calls"]
        if even is None:
            return f"never pays off: a hit at {entry['read_multiplier']:g}x is not cheaper than 1x"
        return (f"pays off from call {even}: one write then {even - 1} hit{'s' if even > 2 else ''}, "
                f"each within {ttl} of the call before")
    if sim["savings"] > 0:
        return (f"caching saves {sim['savings_fraction']:.0%} ({_money(sim['savings'])}) over {sim['num_calls']:,} "
                f"calls: {_plural(sim['num_reads'], 'hit')}, {_plural(sim['num_writes'], 'write')}")
    if sim["num_reads"] == 0:
        return (f"caching saves nothing and costs {-sim['savings_fraction']:.0%} more: every call is a write, "
                f"the calls are further apart than the {ttl} TTL")
    return (f"caching saves nothing and costs {-sim['savings_fraction']:.0%} more: "
            f"{_plural(sim['num_reads'], 'hit')} do not repay {_plural(sim['num_writes'], 'write')} "
            f"at {entry['write_multiplier']:g}x")


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def format_duration(seconds: float) -> str:
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _money(value: float) -> str:
    return f"{'-' if value < 0 else ''}${abs(value):,.4f}"


def render_cost(result: dict, console) -> None:
    """Print the cost report as a rich table and verdict lines."""
    from rich.markup import escape
    from rich.table import Table

    if (bill := result.get("from_usage")) is not None:
        console.print(f"{bill['num_requests']:,} requests, {bill['prompt_tokens']:,} prompt tokens: "
                      f"{bill['input_tokens']:,} uncached, {bill['write_5m_tokens']:,} + "
                      f"{bill['write_1h_tokens']:,} written (5m + 1h), {bill['read_tokens']:,} read")
        console.print(f"Billed at ${bill['price_per_mtok']:g}/M: {_money(bill['cost_cached'])} with caching, "
                      f"{_money(bill['cost_uncached'])} without; saves {_money(bill['savings'])} "
                      f"({bill['savings_fraction']:.0%})")
        return
    console.print(f"{result['prefix_tokens']:,}-token prefix at ${result['price_per_mtok']:g} per million input "
                  f"tokens: {result['billed_per_uncached_call']:,} billed tokens "
                  f"(${result['cost_per_uncached_call']:,.4f}) per uncached call")
    if result["note"]:
        console.print(f"[yellow]{escape(result['note'])}[/]")
    if (pattern := result["pattern"]) is not None:
        how = (f"every {format_duration(pattern['interval_s'])}" if pattern["source"] == "calls"
               else f"from the trace over {format_duration(pattern['span_s'])}")
        console.print(f"Pattern: {pattern['num_calls']:,} calls {how}; a hit refreshes the TTL")
    table = Table(title="Prompt caching, billed token equivalents")
    table.add_column("")
    for entry in result["ttls"]:
        table.add_column(f"{entry['ttl']} TTL", justify="right")
    def rate(e, key, mult):
        return f"{e[key]:,} ({e[mult]:g}x)" if result["cacheable"] else f"{e[key]:,} (not cached, 1x)"

    rows = [("per write (miss)", lambda e: rate(e, "billed_per_write", "write_multiplier")),
            ("per read (hit)", lambda e: rate(e, "billed_per_read", "read_multiplier")),
            ("break-even calls", lambda e: "never" if e["break_even_calls"] is None else f"{e['break_even_calls']}")]
    rows += [(f"{n} call{'s' if n > 1 else ''}: cached vs uncached",
              lambda e, i=n - 1: f"{e['curve'][i]['billed_cached']:,} vs {e['curve'][i]['billed_uncached']:,}")
             for n in range(1, len(result["ttls"][0]["curve"]) + 1) if n <= 5]
    if pattern is not None:
        rows += [("pattern: writes / hits / uncached",
                  lambda e: "{num_writes:,} / {num_reads:,} / {num_uncached:,}".format(**e["simulation"])),
                 ("pattern: billed cached", lambda e: f"{e['simulation']['billed_cached']:,}"),
                 ("pattern: billed uncached", lambda e: f"{e['simulation']['billed_uncached']:,}"),
                 ("pattern: cost cached", lambda e: _money(e["simulation"]["cost_cached"])),
                 ("pattern: cost uncached", lambda e: _money(e["simulation"]["cost_uncached"])),
                 ("pattern: savings", lambda e: f"{_money(e['simulation']['savings'])} "
                                                f"({e['simulation']['savings_fraction']:.0%})")]
    for label, cell in rows:
        table.add_row(label, *[cell(e) for e in result["ttls"]])
    console.print(table)
    for entry in result["ttls"]:
        colour = "green" if entry["pays_off"] else "red"
        console.print(f"{entry['ttl']}: [{colour}]{escape(entry['verdict'])}[/]")
    if result["best_ttl"]:
        console.print(f"Cheapest for this pattern: the {result['best_ttl']} TTL")


def main_cost(args: argparse.Namespace) -> int:
    """`kvserve cost`. A ConfigError propagates for the CLI to print as one line."""
    result = run_cost(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from rich.console import Console

        render_cost(result, Console())
    return 0
