"""The table and the plot of a bench report."""

from __future__ import annotations

ROWS = (("wall time", "wall_s", "{:.2f} s"), ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
        ("total tokens/s", "total_tokens_per_s", "{:.1f}"), ("TTFT p50", "ttft_p50_s", "{:.3f} s"),
        ("TTFT p95", "ttft_p95_s", "{:.3f} s"), ("time per output token", "tpot_s", "{:.4f} s"),
        ("prefix hit rate", "prefix_hit_rate", "{:.1%}"), ("TTFT p95 cached", "ttft_cached_p95_s", "{:.3f} s"),
        ("TTFT p95 cold", "ttft_cold_p95_s", "{:.3f} s"), ("peak RSS", "peak_rss_bytes", "mib"),
        ("KV bytes (allocated)", "kv_bytes", "mib"), ("KV bytes (peak used)", "kv_bytes_used_peak", "mib"),
        ("KV capacity", "kv_capacity_tokens", "{:,} tokens"))


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    return f"{value / 2**20:,.0f} MiB" if spec == "mib" else spec.format(value)


def render(report: dict, console) -> None:
    from rich.table import Table

    w, m = report["workload"], report["machine"]
    table = Table(title=f"kvserve bench: {w['name']} ({w['num_requests']} requests, {w['prompt_tokens']:,} prompt "
                        f"tokens, {w['max_tokens']:,} output tokens, shared prefix {w['shared_prefix_tokens']:,})")
    table.add_column("")
    for name in report["engines"]:
        table.add_column(name, justify="right")
    for name in report["ratios"]:
        ours = "kvserve" + (name[name.index("/"):] if "/" in name else "")  # the same pass over HTTP
        table.add_column(f"{ours} / {name}", justify="right")
    for label, key, spec in ROWS:
        cells = [_fmt(e[key], spec) for e in report["engines"].values()]
        cells += [_fmt(r.get(key), "{:.2f}x") for r in report["ratios"].values()]
        table.add_row(label, *cells)
    if report["ratios"]:
        table.add_row("speedup (peer wall / kvserve wall)", *[""] * len(report["engines"]),
                      *[_fmt(r["speedup"], "{:.2f}x") for r in report["ratios"].values()])
    console.print(table)
    for name, a in report["greedy_agreement"].items():
        console.print(f"greedy agreement with {name}: {a['identical_requests']}/{a['num_requests']} requests "
                      f"identical ({a['fraction']:.0%}); mean common prefix {a['mean_common_prefix_frac']:.0%}")
    for name, ours in report["engines"].items():
        if name.startswith("kvserve") and ours["num_cached_requests"] + ours["num_cold_requests"]:
            console.print(f"{name} TTFT p95 cached / cold: {_fmt(ours['ttft_cached_over_cold_p95'], '{:.2f}x')} "
                          f"({ours['num_cached_requests']} cached, {ours['num_cold_requests']} cold requests)")
    for name, a in report.get("agent", {}).items():
        ttft = [_fmt(a[f"follow_up_ttft_{q}_s"], "{:.3f} s") for q in ("p50", "p95")]
        console.print(f"{name} agent loops (--tool-call-kv-ttl {a['tool_call_kv_ttl']:g}): follow-up hit rate "
                      f"[bold]{_fmt(a['follow_up_hit_rate'], '{:.1%}')}[/] over {a['num_follow_ups']} follow-ups, TTFT "
                      f"p50 {ttft[0]} p95 {ttft[1]}; "
                      f"{a['tool_call_holds_granted']} holds granted, {a['tool_call_holds_used']} ended by their "
                      f"follow-up; {a['num_failed']} failed; pages in use at the end {a['pages_in_use_at_end']} "
                      f"of {a['pool_pages']}, {a['pages_leaked']} leaked")
    agents = list(report.get("agent", {}).values())
    if len(agents) == 2 and None not in (agents[0]["follow_up_hit_rate"], agents[1]["follow_up_hit_rate"]):
        on, off = agents
        console.print(f"tool-call retention raises the follow-up hit rate by "
                      f"[bold]{on['follow_up_hit_rate'] - off['follow_up_hit_rate']:+.3f}[/] "
                      f"({on['follow_up_hit_rate']:.3f} on, {off['follow_up_hit_rate']:.3f} off); follow-up TTFT p50 "
                      f"{_fmt(on['follow_up_ttft_p50_s'], '{:.2f} s')} on, "
                      f"{_fmt(off['follow_up_ttft_p50_s'], '{:.2f} s')} off; p95 {_fmt(on['follow_up_ttft_p95_s'], '{:.2f} s')} on, "
                      f"{_fmt(off['follow_up_ttft_p95_s'], '{:.2f} s')} off")
    for problem in agent_problems(report):
        console.print(f"[bold red]{problem}[/]")
    if "memory_wall" in report:
        wall = report["memory_wall"]
        rates = ", ".join(f"{name} {e['achieved_gbs']:.1f} GB/s ({e['fraction_of_host']:.0%})"
                          for name, e in wall["engines"].items())
        console.print(f"memory wall: a decode token reads {wall['bytes_per_token'] / 1e6:.1f} MB (weights "
                      f"{wall['weights'] / 1e6:.1f} MB, KV at {wall['context']:,} tokens {wall['kv'] / 1e6:.1f} MB); "
                      f"this host reads {wall['host_read_gbs']:.1f} GB/s (the best of "
                      f"{', '.join(f'{g:.1f}' for g in wall.get('host_read_samples_gbs', []))}); achieved: {rates}")
    kernels = report.get("kernels")
    if kernels:
        console.print(f"kvserve's native kernels: {kernels['isa']}, {kernels['label']}")
    if "grammar" in report:
        g = report["grammar"]
        console.print(f"grammar engine {g['engine']}: vocabulary preprocessing {g['startup_s'] * 1e3:.0f} ms at "
                      f"start-up, the bench's JSON schema compiled in {g['compile_s'] * 1e3:.1f} ms")
    if "http" in report:
        h = report["http"]
        peer = h.get("llama_server")
        console.print(f"over HTTP: {h['concurrency']} concurrent streaming clients on {h['endpoint']}, "
                      f"{h['passes']} pass(es) per server (the first cold)"
                      + (f"; llama-server --parallel {peer['parallel']} -c {peer['context_tokens']}" if peer else ""))
    console.print(f"machine: {m['cpu']}, {m['threads'] or m['usable_cpus']} threads; load average "
                  f"{m['load_avg_before'][0]:.2f} before, {m['load_avg_after'][0]:.2f} after (1 min)")


def agent_summary(report: dict) -> dict | None:
    """Holds on beside off (kvserve, then kvserve+no-tool-holds): the follow-up hit rate's gain and what
    must never show (agent_problems); None without a closed-loop run of both."""
    agents = list(report.get("agent", {}).values())
    if len(agents) != 2 or None in (agents[0]["follow_up_hit_rate"], agents[1]["follow_up_hit_rate"]):
        return None
    on, off = agents
    return {"follow_up_hit_rate_gain": on["follow_up_hit_rate"] - off["follow_up_hit_rate"],
            "num_failed": on["num_failed"] + off["num_failed"],
            "pages_leaked": on["pages_leaked"] + off["pages_leaked"],
            "problems": agent_problems(report)}


def agent_problems(report: dict) -> list[str]:
    """What a closed-loop run must never show, per engine: a request that failed, a page still in use
    once every lease is released (the pool not back to full)."""
    problems = []
    for name, a in report.get("agent", {}).items():
        if a["num_failed"]:
            problems.append(f"{name}: {a['num_failed']} requests failed ({'; '.join(a['failures'])})")
        if a["pages_leaked"] or a.get("pool_free_pages_at_end", a["pool_pages"]) != a["pool_pages"]:
            problems.append(f"{name}: {a['pages_leaked']} pages leaked (the pool did not return to full)")
    return problems


def plot(report: dict, path: str) -> None:
    """Side-by-side bars (wall time, tokens/s, TTFT p50/p95) and the TTFT distributions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = report["engines"]
    names = list(engines)
    colors = [f"C{i}" for i in range(len(names))]
    fig = plt.figure(figsize=(16, 8))
    grid = fig.add_gridspec(2, 4)
    bars = [("wall time (s, lower is better)", [("wall", "wall_s")]),
            ("output tokens/s (higher is better)", [("output", "output_tokens_per_s")]),
            ("total tokens/s (higher is better)", [("prompt + output", "total_tokens_per_s")]),
            ("TTFT (s, lower is better)", [("p50", "ttft_p50_s"), ("p95", "ttft_p95_s")])]
    width = 0.8 / len(names)
    for col, (title, groups) in enumerate(bars):
        ax = fig.add_subplot(grid[0, col])
        for i, name in enumerate(names):
            xs = [g + i * width for g in range(len(groups))]
            ys = [engines[name][key] or 0 for _, key in groups]
            ax.bar(xs, ys, width, color=colors[i], label=name)
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.3g}", (x, y), ha="center", va="bottom", fontsize=8)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [g for g, _ in groups])
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.12)
    fig.legend(*fig.axes[0].get_legend_handles_labels(), loc="upper right", fontsize=9)
    ax = fig.add_subplot(grid[1, :3])
    for i, name in enumerate(names):
        xs = sorted(engines[name]["ttft_s"])
        ax.step([xs[0]] + xs, [0] + [(k + 1) / len(xs) for k in range(len(xs))], where="post", color=colors[i],
                label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s), from each request's submission")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution (CDF)")
    ax = fig.add_subplot(grid[1, 3])
    ax.boxplot([engines[n]["ttft_s"] for n in names])
    ax.set_xticks(range(1, len(names) + 1), names, rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.set_title("TTFT per request (s)")
    w = report["workload"]
    fig.suptitle(f"kvserve bench: {w['name']}, {w['num_requests']} requests; load avg "
                 f"{report['machine']['load_avg_before'][0]:.1f}")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


