"""`kvserve bench` on the command line: flags, their checks, and one run of every engine asked for,
in process (kvserve beside transformers or llama-cpp-python) or over HTTP (kvserve serve beside
llama-server, N streaming clients, cold and warm passes)."""

from __future__ import annotations

import argparse
import json
import os

from kvserve.config import ConfigError, EngineConfig
from kvserve.tools.bench.figures import agreement, ratios, summarize
from kvserve.tools.bench.transformers_peer import TRANSFORMERS_MODES
from kvserve.tools.bench.workload import DEFAULT_MAX_TOKENS, load_workload
from kvserve.tools.traces import GENERATORS

PEERS = ("transformers", "llama-cpp", "llama-server", "grammar", "ngram", "no-tool-holds", "none")
GRAMMAR_PEER = "kvserve+json-schema"
NGRAM_PEER = "kvserve+ngram"  # kvserve again with speculation on (unless the flags already set one)
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
NO_HOLDS_PEER = "kvserve+no-tool-holds"  # kvserve again with --tool-call-kv-ttl 0


def peer_kwargs(name: str, kwargs: dict) -> dict:
    """The engine flags of one engine of the run: the bench's, plus speculation for the ngram peer,
    the tool-call holds off for the no-tool-holds peer."""
    if name == NGRAM_PEER:
        return {**kwargs, "speculative_config": kwargs.get("speculative_config") or NGRAM_CONFIG}
    if name == NO_HOLDS_PEER:
        return {**kwargs, "tool_call_kv_ttl": 0.0}
    return kwargs
# --vs grammar: a list of records whose shortest valid output is far longer than any bench's
# max_tokens, so every request decodes to max_tokens under the grammar, as the plain run does
BENCH_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "required": ["id", "name", "tags"], "additionalProperties": False,
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}}}}}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine_args import add_engine_arguments

    parser.add_argument("--workload", default="w1",
                        help=f"w1 (../shared/workloads/w1.jsonl), a generated mix ({', '.join(GENERATORS)}) "
                             "or a JSON-lines trace file (default w1)")
    parser.add_argument("--limit", type=int, default=None, help="run only the first N requests")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"output tokens per request (default: the trace's, else {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of a generated mix")
    parser.add_argument("--vs", default="none", choices=PEERS,
                        help="the peer run in the same bench (default none: kvserve alone); llama-server "
                             "runs over HTTP with --parallel set to --concurrency; grammar: kvserve again "
                             "with a JSON-schema grammar on every request (structured outputs' cost); ngram: "
                             "kvserve again with n-gram speculation (or --speculative-config's), in process "
                             "or over HTTP (ratios: kvserve / kvserve+ngram); no-tool-holds: kvserve again "
                             "with --tool-call-kv-ttl 0 (the agent workload's tool-call retention off)")
    parser.add_argument("--transformers-modes", default="generate,prompt-cache",
                        help="comma list: generate (plain sequential), prompt-cache (shared prefix computed once, "
                             "deep-copied per request); default both")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="in process: submit request i at i / RATE seconds (default: all at t=0); TTFT "
                             "counts from each request's own submission")
    parser.add_argument("--concurrency", type=int, default=None, metavar="N",
                        help="over HTTP: start `kvserve serve` (and llama-server with --vs llama-server) and "
                             "send the workload from N concurrent streaming clients (default with --vs "
                             "llama-server: 1)")
    parser.add_argument("--passes", type=int, default=1,
                        help="over HTTP: send the workload this many times to the same server: pass 1 cold, "
                             "later passes warm (default 1)")
    parser.add_argument("--llama-server", default=None, metavar="PATH",
                        help="llama-server binary (default: $KVSERVE_LLAMA_SERVER, else "
                             "../shared/peers/llama.cpp/llama-server)")
    parser.add_argument("--llama-server-context", type=int, default=None, metavar="TOKENS",
                        help="llama-server -c, shared by its --parallel slots (default: kvserve's KV capacity "
                             "in tokens, so both hold the same KV; at least slots x the longest request)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="draw the bars and TTFT distributions")
    add_engine_arguments(parser)


def _check(args: argparse.Namespace) -> tuple[list[str], bool]:
    """The transformers modes asked for and whether the bench runs over HTTP; ConfigError on mistakes."""
    import importlib.util

    if args.vs == "llama-cpp" and importlib.util.find_spec("llama_cpp") is None:
        raise ConfigError("--vs llama-cpp needs llama-cpp-python, which is not installed "
                          "(pip install llama-cpp-python), or use --vs transformers")
    for wanted, module in ((args.vs == "transformers", "transformers"), (bool(args.plot), "matplotlib")):
        if wanted and importlib.util.find_spec(module) is None:  # the [bench] extra, not kvserve's own needs
            raise ConfigError(f"{'--vs transformers' if module == 'transformers' else '--plot'} needs {module}, "
                              f"which is not installed: pip install 'kvserve[bench]'")
    modes = [m.strip() for m in args.transformers_modes.split(",") if m.strip()]
    if args.vs == "transformers" and (not modes or any(m not in TRANSFORMERS_MODES for m in modes)):
        raise ConfigError(f"--transformers-modes is a comma list of {', '.join(TRANSFORMERS_MODES)}")
    if args.request_rate is not None and args.request_rate <= 0:
        raise ConfigError(f"--request-rate must be > 0 requests/s, got {args.request_rate}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1 streaming clients, got {args.concurrency}")
    if args.llama_server_context is not None and args.llama_server_context < 1:
        raise ConfigError(f"--llama-server-context must be >= 1 token, got {args.llama_server_context}")
    if args.passes < 1:
        raise ConfigError(f"--passes must be >= 1, got {args.passes}")
    http = args.concurrency is not None or args.vs == "llama-server"
    if http and args.vs in ("transformers", "llama-cpp", "grammar", "no-tool-holds"):
        raise ConfigError(f"--concurrency runs servers over HTTP; --vs {args.vs} runs in process: use "
                          "--vs llama-server or --vs none with --concurrency")
    if http and args.request_rate is not None:
        raise ConfigError("--request-rate spaces in-process submissions; over HTTP the clients send "
                          "back to back: drop --request-rate or --concurrency")
    if not http and args.passes != 1:
        raise ConfigError("--passes needs the HTTP bench: add --concurrency N (or --vs llama-server)")
    if http and args.redis_url:
        raise ConfigError("the HTTP bench starts its own server; drop --redis-url")
    return modes, http


def _machine(threads: int | None) -> dict:
    from kvserve.kernels import cpu_info

    return {"cpu": cpu_info().get("model name"), "num_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "threads": threads, "load_avg_before": list(os.getloadavg())}


def run_bench(args: argparse.Namespace, progress_console=None) -> dict:
    from kvserve.engine_args import engine_kwargs
    from kvserve.model.gguf_loader import resolve_model_path

    kwargs = engine_kwargs(args)
    EngineConfig(model=args.model, **kwargs)  # flag mistakes surface here, before any process starts
    modes, http = _check(args)
    workload = load_workload(args.workload, args.limit, args.max_tokens, args.seed, args.model)
    beside_kvserve = args.vs in ("none", "no-tool-holds", "ngram")
    if workload.loops is not None and (http or args.request_rate is not None or not beside_kvserve):
        raise ConfigError(f"the {workload.name} workload has closed loops (each follow-up sent after the answer it "
                          "continues): it runs in process, alone or with --vs no-tool-holds, at the trace's own "
                          "times (no --request-rate, --concurrency or a peer other than kvserve)")
    model_path = resolve_model_path(args.model)
    report = {"schema_version": 1, "workload": {**workload.describe(), "request_rate": args.request_rate},
              "machine": _machine(args.threads), "engine_args": {"model": model_path, **kwargs},
              "engines": {}, "ratios": {}, "greedy_agreement": {}}
    w = report["workload"]
    single_stream = w["num_requests"] == 1 or (http and (args.concurrency or 1) == 1)
    # a GGUF's tensor sizes are the bytes a token reads; a safetensors folder's depend on the dtype it loads in
    wall = single_stream and os.path.isfile(model_path)  # decode against the memory wall
    if wall:
        from kvserve.tools.bench.memory_wall import read_bandwidth_gbs

        probe_before = read_bandwidth_gbs(args.threads)
    if http:
        concurrency = args.concurrency or 1
        report["http"] = {"concurrency": concurrency, "passes": args.passes, "endpoint": "/v1/completions",
                          "streaming": True}
        _run_over_http(report, args, workload, model_path, kwargs, concurrency, progress_console)
    else:
        _run_in_process(report, args, workload, model_path, kwargs, modes, progress_console)
    report["machine"]["load_avg_after"] = list(os.getloadavg())
    if wall:
        from kvserve.tools.bench.memory_wall import memory_wall

        context = (w["prompt_tokens"] + w["max_tokens"] // 2) // w["num_requests"]
        report["memory_wall"] = memory_wall(model_path, kwargs, context, args.threads, report["engines"],
                                            earlier_probes=(probe_before,))
    if "agent" in report:
        from kvserve.tools.bench.report import agent_summary

        report["agent_summary"] = agent_summary(report)
    return report


def _run_in_process(report: dict, args, workload, model_path: str, kwargs: dict, modes: list[str],
                    console) -> None:
    from kvserve.tools.bench.process import run_engine
    from kvserve.tools.bench.spec import RunSpec
    from kvserve.tools.bench.progress import ProgressBars

    arrivals = [i / args.request_rate if args.request_rate else 0.0 for i in range(len(workload.token_ids))]
    engines = ["kvserve"] + {"transformers": [TRANSFORMERS_MODES[m] for m in modes], "llama-cpp": ["llama-cpp"],
                             "grammar": [GRAMMAR_PEER], "ngram": [NGRAM_PEER], "no-tool-holds": [NO_HOLDS_PEER],
                             "none": []}[args.vs]
    outputs = {}
    with ProgressBars(console) as bar:
        for name in engines:
            spec = RunSpec(name, model_path, workload.token_ids, workload.max_tokens, arrivals,
                           peer_kwargs(name, kwargs), args.threads,
                           BENCH_SCHEMA if name == GRAMMAR_PEER else None, workload.loops)
            raw = run_engine(spec, bar(name, sum(workload.max_tokens)))
            if raw.get("grammar"):
                report["grammar"] = raw["grammar"]
            if raw.get("kernels"):  # kvserve's instruction set and the tuning this host chose
                report["kernels"] = raw["kernels"]
            if "agent" in raw:
                report.setdefault("agent", {})[name] = raw["agent"]
            raw["prompt_tokens"] = raw.get("prompt_tokens_sent", report["workload"]["prompt_tokens"])
            outputs[name] = [r["output_token_ids"] for r in raw["requests"]]
            report["engines"][name] = summarize(raw)
    ours = report["engines"]["kvserve"]
    for name in engines[1:]:
        report["ratios"][name] = ratios(ours, report["engines"][name])
        report["greedy_agreement"][name] = agreement(outputs["kvserve"], outputs[name])


def _run_over_http(report: dict, args, workload, model_path: str, kwargs: dict, concurrency: int,
                   console) -> None:
    from kvserve.tools.bench.http_mode import kvserve_label_for, run_http, same_slots_kwargs
    from kvserve.tools.bench.progress import ProgressBars
    from kvserve.tools.bench.servers import llama_server_path

    binary = llama_server_path(args.llama_server)
    if args.vs == "llama-server" and not binary.is_file():
        raise ConfigError(f"--vs llama-server needs the llama-server binary, not found at {binary}; "
                          "give --llama-server PATH")
    if args.vs == "llama-server":  # both servers sized for `concurrency` sequences
        kwargs = same_slots_kwargs(kwargs, concurrency)
        report["engine_args"]["max_num_seqs"] = kwargs["max_num_seqs"]
    servers = ["kvserve"] + {"llama-server": ["llama-server"], "ngram": [NGRAM_PEER]}.get(args.vs, [])
    peers, capacity = [], None
    with ProgressBars(console) as bar:
        for server in servers:
            update = bar(server, sum(workload.max_tokens) * args.passes)
            runs = run_http(server, model_path, workload.token_ids, workload.max_tokens, concurrency, args.passes,
                            peer_kwargs(server, kwargs), args.threads, binary, update, args.llama_server_context,
                            capacity)
            for label, raw in runs.items():
                capacity = capacity or raw.get("kv_capacity_tokens")
                raw["prompt_tokens"] = report["workload"]["prompt_tokens"]
                report["engines"][label] = summarize(raw)
                if server != "kvserve":
                    peers.append(label)
                if server == "llama-server":
                    report["http"].setdefault("llama_server", {k: raw[k] for k in ("context_tokens", "parallel")})
    for label in peers:
        report["ratios"][label] = ratios(report["engines"][kvserve_label_for(label)], report["engines"][label])


def main_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvserve.tools.bench.report import agent_problems, plot, render

    report = run_bench(args, Console(stderr=True))
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report, Console())
        if args.plot:
            print(f"plot written to {args.plot}")
    return 1 if agent_problems(report) else 0  # a closed-loop run that failed a request or leaked a page
