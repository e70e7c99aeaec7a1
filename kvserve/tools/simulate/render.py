"""The rich report of `kvserve simulate`: the trace, the replays in a table, the diagnosis and the
recommendation."""

from __future__ import annotations


def render_simulation(result: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = result["trace"]
    console.print(f"[bold]{escape(str(t.get('source', 'trace')))}[/]: {t['num_requests']} requests, "
                  f"{t['num_prompt_tokens']:,} prompt tokens, {t['num_generated_tokens']:,} generated, "
                  f"replayed {'one at a time' if t['replay'] == 'sequential' else 'at their arrival times'}")
    console.print(f"ideal hit rate (unbounded, token-granular, longest prefix shared with any earlier "
                  f"request): [bold]{result['ideal_hit_rate']:.1%}[/]")
    table = Table(title="replay through the Scheduler and KVCacheManager")
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
    for h in result.get("tool_call_holds", []):
        cap = "unbounded" if h["capacity_tokens"] is None else f"{h['capacity_tokens']:,} tokens"
        console.print(f"tool-call holds ({h['policy']}, page size {h['page_size']}, {cap}): follow-up hit rate "
                      f"[bold]{h['follow_up_hit_rate_on']:.1%}[/] with --tool-call-kv-ttl {h['tool_call_kv_ttl']:g}, "
                      f"{h['follow_up_hit_rate_off']:.1%} with 0, over {h['num_follow_ups']} follow-ups "
                      f"({h['holds_granted']} holds granted, {h['holds_used']} ended by their follow-up)")
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
