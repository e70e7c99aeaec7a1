"""`kvserve bench`: one workload through kvserve and through a peer in the same run, the figures side
by side with their ratios (kvserve / peer) and the greedy agreement of the outputs.

    workload (w1 file, a generated mix, a trace) -> token ids + max_tokens per request (tokenized once)
      -> one spawned process per engine (its own peak RSS, no shared thread pools or caches):
           kvserve                    requests added to LLMEngine as they arrive (all at t=0 unless
                                      --request-rate), step() until all finish
           transformers               sequential generate(), same GGUF, float32, greedy, EOS ignored
           transformers+prompt-cache  the same, with the shared prefix's KV computed once and
                                      copy.deepcopy'd into each request (transformers' documented reuse)
           llama-cpp                  sequential Llama.generate, which reuses the previous prompt's prefix
      -> per request: output ids, TTFT and end-to-end time from submission, cached prompt tokens
      -> figures, ratios, agreement -> a table, --json, --plot PNG

Every engine gets the same ids and generates exactly max_tokens (EOS ignored, never masked), so
tokens/s compare like with like and greedy outputs can be compared token by token. TTFT counts from a
request's submission: a sequential peer's later requests wait behind earlier ones, as behind one server
(and with all requests at t=0, kvserve's cached requests wait behind the cold one that computes the
shared prefix; --request-rate spaces them). Model loading and a short warm-up are outside the timed part.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_mod
import resource
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config import ConfigError, EngineConfig
from kvserve.tools.traces import GENERATORS, encode_prompts, generate_trace, load_trace

DEFAULT_MAX_TOKENS = 64
DEFAULT_NUM_REQUESTS = 32  # generated mixes
WARMUP_IDS = list(range(1000, 1064))
PEERS = ("transformers", "llama-cpp", "none")
TRANSFORMERS_MODES = {"generate": "transformers", "prompt-cache": "transformers+prompt-cache"}
ENGINE_KEYS = (  # every engine's figures carry exactly these keys (null where not measurable)
    "num_requests", "prompt_tokens", "output_tokens", "wall_s", "output_tokens_per_s", "total_tokens_per_s",
    "ttft_p50_s", "ttft_p95_s", "ttft_mean_s", "tpot_s", "prefix_hit_rate", "cached_prompt_tokens",
    "num_cached_requests", "num_cold_requests", "ttft_cached_p50_s", "ttft_cached_p95_s", "ttft_cold_p50_s",
    "ttft_cold_p95_s", "ttft_cached_over_cold_p95", "peak_rss_bytes", "kv_bytes", "kv_bytes_used_peak",
    "load_s", "threads", "ttft_s")
RATIO_KEYS = ("wall_s", "output_tokens_per_s", "total_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "tpot_s",
              "prefix_hit_rate", "peak_rss_bytes", "kv_bytes", "kv_bytes_used_peak")


@dataclass(slots=True)
class Workload:
    name: str
    source: str
    request_ids: list[str]
    token_ids: list[list[int]]
    max_tokens: list[int]

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "num_requests": len(self.token_ids),
                "prompt_tokens": sum(map(len, self.token_ids)), "max_tokens": sum(self.max_tokens),
                "shared_prefix_tokens": shared_prefix_len(self.token_ids)}


@dataclass(slots=True)
class RunSpec:
    """What one engine process runs (pickled to a spawned process)."""

    engine: str
    model_path: str
    token_ids: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]  # seconds after t0 at which each request is submitted
    engine_kwargs: dict = field(default_factory=dict)
    threads: int | None = None


def shared_prefix_len(token_ids: list[list[int]]) -> int:
    first, n = token_ids[0], min(map(len, token_ids))
    for ids in token_ids[1:]:
        n = next((i for i in range(n) if ids[i] != first[i]), n)
    return n


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def workloads_dir() -> Path:
    default = Path(__file__).resolve().parents[3] / "shared" / "workloads"  # ../shared from the repo
    return Path(os.environ.get("KVSERVE_WORKLOADS", default))


def load_workload(name: str, limit: int | None = None, max_tokens: int | None = None, seed: int = 0,
                  model: str | None = None) -> Workload:
    """w1 -> ../shared/workloads/w1.jsonl (else the generated w1 mix); a mix name; or a trace file."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {max_tokens}")
    w1_file = workloads_dir() / "w1.jsonl"
    if name == "w1" and w1_file.is_file():
        trace, source = load_trace(w1_file), str(w1_file)
    elif name in GENERATORS and not Path(name).exists():
        trace, source = generate_trace(name, limit or DEFAULT_NUM_REQUESTS, seed), f"generated:{name}:{seed}"
    elif Path(name).is_file():
        trace, source = load_trace(name), str(Path(name))
    else:
        raise ConfigError(f"unknown workload {name!r}; give a trace file or one of {', '.join(GENERATORS)}")
    trace = trace[:limit] if limit else trace
    from kvserve.model.gguf_loader import resolve_model_path  # a text trace needs the model's tokenizer

    token_ids = encode_prompts(trace, resolve_model_path(model) if any(r.prompt_token_ids is None for r in trace)
                               else "none")
    caps = [max_tokens or r.max_tokens or DEFAULT_MAX_TOKENS for r in trace]
    return Workload(Path(name).stem if Path(name).is_file() else name, source, [r.id for r in trace], token_ids, caps)


# -- the engine processes ----------------------------------------------------------------------------
class _Reporter:
    """Progress from an engine process to the parent: a phase name, output tokens done (throttled)."""

    def __init__(self, queue) -> None:
        self.queue, self.last = queue, 0.0

    def phase(self, name: str) -> None:
        self.queue.put(("phase", name))

    def tokens(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last > 0.1:
            self.last = now
            self.queue.put(("tokens", done))


def _wait_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _worker(spec: RunSpec, queue) -> None:
    os.environ["TQDM_DISABLE"] = "1"  # transformers' GGUF loader draws its own bar
    if spec.threads:
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    try:
        import torch

        threads = spec.threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        run = {"kvserve": _run_kvserve, "llama-cpp": _run_llama_cpp}.get(spec.engine, _run_transformers)
        result = run(spec, _Reporter(queue))
        result.update(threads=threads, peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        queue.put(("result", result))
    except (ConfigError, ValueError) as err:
        queue.put(("config_error", str(err)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put(("error", traceback.format_exc()))


def _run_kvserve(spec: RunSpec, report: _Reporter) -> dict:
    from kvserve.engine import LLMEngine
    from kvserve.request import SamplingParams

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=spec.model_path, **spec.engine_kwargs))
    load_s = time.perf_counter() - start
    report.phase("warm-up")
    engine.add_request({"prompt_token_ids": WARMUP_IDS}, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.manager.reset_prefix_cache()
    before, generated = engine.stats(), engine.scheduler.stats.generation_tokens
    report.phase("running")
    pending = list(zip(spec.arrivals, spec.token_ids, spec.max_tokens))[::-1]  # arrivals ascend: pop() next
    ids, done, peak_pages = [], {}, 0
    t0 = time.monotonic()
    while pending or len(done) < len(ids):
        if pending and not engine.has_unfinished():
            _wait_until(t0 + pending[-1][0])
        while pending and time.monotonic() >= t0 + pending[-1][0]:  # submit what has arrived
            _, prompt, max_tokens = pending.pop()
            ids.append(engine.add_request({"prompt_token_ids": prompt},
                                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        peak_pages = max(peak_pages, engine.manager.num_used_pages)
        report.tokens(engine.scheduler.stats.generation_tokens - generated)
    wall = time.monotonic() - t0
    after = engine.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    requests = [{"output_token_ids": list(o.outputs[0].token_ids), "ttft_s": o.metrics.ttft_s,
                 "e2e_s": o.metrics.e2e_s, "cached_tokens": o.num_cached_tokens} for o in (done[i] for i in ids)]
    return {"wall_s": wall, "load_s": load_s, "requests": requests, "kv_bytes": after["kv_cache_bytes"],
            "kv_bytes_used_peak": peak_pages * engine.runner.page_bytes,
            "prefix_hit_rate": (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries if queries else 0.0}


def _run_transformers(spec: RunSpec, report: _Reporter) -> dict:
    import copy

    import warnings

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.generation import utils as generation_utils
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """generate() puts the prompt first, then each new token: time the first of those."""

        def __init__(self, on_token) -> None:
            self.puts, self.first, self.on_token = 0, None, on_token

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.monotonic()
            if self.puts >= 2:
                self.on_token()

        def end(self) -> None:
            pass

    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values -> cache renames
    transformers.logging.set_verbosity_error()
    path = Path(spec.model_path)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    cache_arg = "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
    prompt_cache = spec.engine == TRANSFORMERS_MODES["prompt-cache"]
    # at least one token of every prompt must be computed: it gives the first logits
    prefix_len = min(shared_prefix_len(spec.token_ids), min(map(len, spec.token_ids)) - 1) if prompt_cache else 0

    def generate(ids: list[int], max_tokens: int, streamer=None, cache=None) -> list[int]:
        x = torch.tensor([ids])
        kwargs = {} if cache is None else {cache_arg: cache}
        # eos_token_id=[]: run to max_new_tokens with EOS left in the argmax (None falls back to the model's)
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_tokens,
                             eos_token_id=[], pad_token_id=0, streamer=streamer, **kwargs)
        new = out[0, len(ids):].tolist()
        assert len(new) == max_tokens, f"generate stopped after {len(new)} of {max_tokens} tokens"
        return new

    report.phase("warm-up")
    with torch.inference_mode():
        generate(WARMUP_IDS, 4)
    report.phase("running")
    requests, done = [], 0

    def on_token() -> None:
        nonlocal done
        done += 1
        report.tokens(done)

    t0 = time.monotonic()
    with torch.inference_mode():
        prefix = None
        if prefix_len:
            prefix = DynamicCache(config=model.config)
            # logits_to_keep=1: the docs' call would also project all prefix rows onto the vocabulary
            result = model(torch.tensor([spec.token_ids[0][:prefix_len]]), use_cache=True, logits_to_keep=1,
                           **{cache_arg: prefix})
            prefix = result.past_key_values if getattr(result, "past_key_values", None) is not None else prefix
        for ids, max_tokens, arrival in zip(spec.token_ids, spec.max_tokens, spec.arrivals):
            _wait_until(t0 + arrival)
            streamer = FirstToken(on_token)
            new = generate(ids, max_tokens, streamer, None if prefix is None else copy.deepcopy(prefix))
            requests.append({"output_token_ids": new, "ttft_s": streamer.first - t0 - arrival,
                             "e2e_s": time.monotonic() - t0 - arrival, "cached_tokens": prefix_len})
    wall = time.monotonic() - t0
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # K and V, float32
    longest = max(len(p) + m for p, m in zip(spec.token_ids, spec.max_tokens))
    kv = (longest + prefix_len) * per_token  # one request's DynamicCache, plus the kept prefix
    return {"wall_s": wall, "load_s": load_s, "requests": requests, "kv_bytes": kv, "kv_bytes_used_peak": kv,
            "prefix_hit_rate": prefix_len * len(requests) / sum(map(len, spec.token_ids))}


def _run_llama_cpp(spec: RunSpec, report: _Reporter) -> dict:
    from llama_cpp import Llama

    longest = max(len(p) + m for p, m in zip(spec.token_ids, spec.max_tokens))
    start = time.perf_counter()
    threads = spec.threads or len(os.sched_getaffinity(0))
    llm = Llama(model_path=spec.model_path, n_ctx=longest + 16, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    load_s = time.perf_counter() - start

    def generate(ids: list[int], max_tokens: int, on_token=None) -> tuple[list[int], float | None]:
        out, first = [], None  # Llama.generate reuses the longest prefix shared with what it last ran
        for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            first = first or time.monotonic()
            out.append(token)
            if on_token:
                on_token()
            if len(out) == max_tokens:
                break
        return out, first

    report.phase("warm-up")
    generate(WARMUP_IDS, 4)
    report.phase("running")
    requests, done = [], 0

    def on_token() -> None:
        nonlocal done
        done += 1
        report.tokens(done)

    t0 = time.monotonic()
    for ids, max_tokens, arrival in zip(spec.token_ids, spec.max_tokens, spec.arrivals):
        _wait_until(t0 + arrival)
        cached = min(_common_prefix(list(llm.input_ids[: llm.n_tokens]), ids), len(ids) - 1)
        new, first = generate(ids, max_tokens, on_token)
        requests.append({"output_token_ids": new, "ttft_s": first - t0 - arrival,
                         "e2e_s": time.monotonic() - t0 - arrival, "cached_tokens": max(cached, 0)})
    wall = time.monotonic() - t0
    meta = llm.metadata
    arch = meta.get("general.architecture", "llama")
    try:
        layers, kv_heads = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.attention.head_count_kv"])
        head_dim = int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"])
        kv = llm.n_ctx() * 2 * layers * kv_heads * head_dim * 2  # f16 K and V
    except (KeyError, ValueError):
        kv = None
    return {"wall_s": wall, "load_s": load_s, "requests": requests, "kv_bytes": kv, "kv_bytes_used_peak": kv,
            "prefix_hit_rate": sum(r["cached_tokens"] for r in requests) / sum(map(len, spec.token_ids))}


def run_engine(spec: RunSpec, progress=None) -> dict:
    """Run one engine in a spawned process; progress(phase, tokens_done) is called as it reports."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_worker, args=(spec, queue), daemon=True)
    process.start()
    try:
        while True:
            try:
                kind, value = queue.get(timeout=0.5)
            except queue_mod.Empty:
                if not process.is_alive():
                    raise RuntimeError(f"{spec.engine} process exited with status {process.exitcode}") from None
                continue
            if kind in ("phase", "tokens") and progress:
                progress(value if kind == "phase" else None, value if kind == "tokens" else None)
            elif kind == "result":
                return value
            elif kind == "config_error":
                raise ConfigError(value if spec.engine == "kvserve" else f"{spec.engine}: {value}")
            elif kind == "error":
                raise RuntimeError(f"{spec.engine} failed:\n{value}")
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()


# -- figures -------------------------------------------------------------------------------------------
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


def summarize(raw: dict) -> dict:
    reqs = raw["requests"]
    ttft = [r["ttft_s"] for r in reqs]
    cached = [r["ttft_s"] for r in reqs if r["cached_tokens"] > 0]
    cold = [r["ttft_s"] for r in reqs if r["cached_tokens"] == 0]
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (len(r["output_token_ids"]) - 1)
            for r in reqs if len(r["output_token_ids"]) > 1]
    prompt = raw["prompt_tokens"]
    output = sum(len(r["output_token_ids"]) for r in reqs)
    wall = raw["wall_s"]
    fig = {"num_requests": len(reqs), "prompt_tokens": prompt, "output_tokens": output, "wall_s": wall,
           "output_tokens_per_s": _div(output, wall), "total_tokens_per_s": _div(prompt + output, wall),
           "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
           "ttft_mean_s": sum(ttft) / len(ttft), "tpot_s": sum(tpot) / len(tpot) if tpot else None,
           "prefix_hit_rate": raw.get("prefix_hit_rate"), "cached_prompt_tokens": sum(r["cached_tokens"] for r in reqs),
           "num_cached_requests": len(cached), "num_cold_requests": len(cold),
           "ttft_cached_p50_s": percentile(cached, 50), "ttft_cached_p95_s": percentile(cached, 95),
           "ttft_cold_p50_s": percentile(cold, 50), "ttft_cold_p95_s": percentile(cold, 95),
           "ttft_cached_over_cold_p95": _div(percentile(cached, 95), percentile(cold, 95)),
           "peak_rss_bytes": raw.get("peak_rss_bytes"), "kv_bytes": raw.get("kv_bytes"),
           "kv_bytes_used_peak": raw.get("kv_bytes_used_peak"), "load_s": raw.get("load_s"),
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
    common = [_common_prefix(a, b) / max(len(a), 1) for a, b in zip(ours, peer)]
    return {"num_requests": len(ours), "identical_requests": same, "fraction": same / len(ours),
            "mean_common_prefix_frac": sum(common) / len(common)}


def _machine(threads: int | None) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    return {"cpu": cpu, "num_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "threads": threads, "load_avg_before": list(os.getloadavg())}


def run_bench(args: argparse.Namespace, progress_console=None) -> dict:
    from kvserve.engine_args import engine_kwargs
    from kvserve.model.gguf_loader import resolve_model_path

    kwargs = engine_kwargs(args)
    EngineConfig(model=args.model, **kwargs)  # flag mistakes surface here, before any process starts
    if args.vs == "llama-cpp":
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise ConfigError("--vs llama-cpp needs llama-cpp-python, which is not installed "
                              "(pip install llama-cpp-python), or use --vs transformers")
    modes = [m.strip() for m in args.transformers_modes.split(",") if m.strip()]
    if args.vs == "transformers" and (not modes or any(m not in TRANSFORMERS_MODES for m in modes)):
        raise ConfigError(f"--transformers-modes is a comma list of {', '.join(TRANSFORMERS_MODES)}")
    if args.request_rate is not None and args.request_rate <= 0:
        raise ConfigError(f"--request-rate must be > 0 requests/s, got {args.request_rate}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    workload = load_workload(args.workload, args.limit, args.max_tokens, args.seed, args.model)
    model_path = resolve_model_path(args.model)
    arrivals = [i / args.request_rate if args.request_rate else 0.0 for i in range(len(workload.token_ids))]
    engines = ["kvserve"] + {"transformers": [TRANSFORMERS_MODES[m] for m in modes], "llama-cpp": ["llama-cpp"],
                             "none": []}[args.vs]
    report = {"schema_version": 1, "workload": {**workload.describe(), "request_rate": args.request_rate},
              "machine": _machine(args.threads), "engine_args": {"model": model_path, **kwargs},
              "engines": {}, "ratios": {}, "greedy_agreement": {}}
    outputs = {}
    with _progress(progress_console) as bar:
        for name in engines:
            spec = RunSpec(name, model_path, workload.token_ids, workload.max_tokens, arrivals, kwargs, args.threads)
            raw = run_engine(spec, bar(name, sum(workload.max_tokens)))
            raw["prompt_tokens"] = report["workload"]["prompt_tokens"]
            outputs[name] = [r["output_token_ids"] for r in raw["requests"]]
            report["engines"][name] = summarize(raw)
    report["machine"]["load_avg_after"] = list(os.getloadavg())
    ours = report["engines"]["kvserve"]
    for name in engines[1:]:
        report["ratios"][name] = ratios(ours, report["engines"][name])
        report["greedy_agreement"][name] = agreement(outputs["kvserve"], outputs[name])
    return report


class _progress:
    """A rich progress bar (one task per engine) on stderr, so --json's stdout stays clean."""

    def __init__(self, console) -> None:
        self.console, self.bar = console, None

    def __enter__(self):
        if self.console is None:
            return lambda name, total: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("tokens"), TimeElapsedColumn(), console=self.console, transient=True)
        self.bar.start()

        def task(name: str, total: int):
            tid = self.bar.add_task(f"{name}: starting", total=total)

            def update(phase: str | None, done: int | None) -> None:
                if phase:
                    self.bar.update(tid, description=f"{name}: {phase}")
                if done is not None:
                    self.bar.update(tid, completed=done)
            return update
        return task

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()


# -- output --------------------------------------------------------------------------------------------
ROWS = (("wall time", "wall_s", "{:.2f} s"), ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
        ("total tokens/s", "total_tokens_per_s", "{:.1f}"), ("TTFT p50", "ttft_p50_s", "{:.3f} s"),
        ("TTFT p95", "ttft_p95_s", "{:.3f} s"), ("time per output token", "tpot_s", "{:.4f} s"),
        ("prefix hit rate", "prefix_hit_rate", "{:.1%}"), ("TTFT p95 cached", "ttft_cached_p95_s", "{:.3f} s"),
        ("TTFT p95 cold", "ttft_cold_p95_s", "{:.3f} s"), ("peak RSS", "peak_rss_bytes", "mib"),
        ("KV bytes (allocated)", "kv_bytes", "mib"), ("KV bytes (peak used)", "kv_bytes_used_peak", "mib"))


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
        table.add_column(f"kvserve / {name}", justify="right")
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
    ours = report["engines"]["kvserve"]
    console.print(f"kvserve TTFT p95 cached / cold: {_fmt(ours['ttft_cached_over_cold_p95'], '{:.2f}x')} "
                  f"({ours['num_cached_requests']} cached, {ours['num_cold_requests']} cold requests)")
    console.print(f"machine: {m['cpu']}, {m['threads'] or m['usable_cpus']} threads; load average "
                  f"{m['load_avg_before'][0]:.2f} before, {m['load_avg_after'][0]:.2f} after (1 min)")


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


# -- CLI -----------------------------------------------------------------------------------------------
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
                        help="the peer run in the same bench (default none: kvserve alone)")
    parser.add_argument("--transformers-modes", default="generate,prompt-cache",
                        help="comma list: generate (plain sequential), prompt-cache (shared prefix computed once, "
                             "deep-copied per request); default both")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="submit request i at i / RATE seconds (default: all at t=0); TTFT counts from "
                             "each request's own submission")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per engine (default: usable cores)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="draw the bars and TTFT distributions")
    add_engine_arguments(parser)


def main_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    report = run_bench(args, Console(stderr=True))
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report, Console())
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0

