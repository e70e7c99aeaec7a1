"""kvserve in process: the workload's requests added to LLMEngine as they arrive (all at t=0 unless
--request-rate), step() until all finish. With a JSON schema (--vs grammar) every request is
constrained by it, and the grammar engine's start-up (vocabulary preprocessing) is timed. A closed-loop
workload (the agent trace) runs through agent_run.py instead, after the same load and warm-up."""

from __future__ import annotations

import time

from kvserve.config import EngineConfig
from kvserve.tools.bench.spec import WARMUP_IDS, Reporter, RunSpec, wait_until


def kernels_of(engine) -> dict | None:
    """The native kernels' instruction set and the tuning this host chose (None: the torch path)."""
    from kvserve import kernels

    tuning = engine.runner.kernel_tuning
    library = kernels.library()
    return None if tuning is None or library is None else {"isa": library.isa, **tuning.as_dict()}


def run_kvserve(spec: RunSpec, report: Reporter) -> dict:
    from kvserve.engine import LLMEngine
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured import StructuredOutputsParams

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=spec.model_path, **spec.engine_kwargs))
    load_s = time.perf_counter() - start
    constraint, grammar = None, None
    if spec.json_schema is not None:
        compiler = engine.grammar_compiler()  # this process's first: the preprocessing is timed
        constraint = StructuredOutputsParams(json=spec.json_schema, strict=True)
        compile_start = time.perf_counter()
        compiler.compile(constraint)
        grammar = {"engine": "llguidance", "startup_s": compiler.startup_s,
                   "compile_s": time.perf_counter() - compile_start}
    report.phase("warm-up")
    engine.add_request({"prompt_token_ids": WARMUP_IDS}, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.manager.reset_prefix_cache()
    before, generated = engine.stats(), engine.scheduler.stats.generation_tokens
    report.phase("running")
    if spec.loops is not None:
        from kvserve.tools.bench.agent_run import run_loops

        raw = run_loops(engine, spec, report)
        after = engine.stats()
        queries = after.cache.prefix_cache_queries - before.cache.prefix_cache_queries
        hits = after.cache.prefix_cache_hits - before.cache.prefix_cache_hits
        return {**raw, "load_s": load_s, "grammar": None, "kernels": kernels_of(engine), "kv_bytes": after.kv_cache_bytes,
                "kv_bytes_used_peak": raw.pop("peak_pages") * engine.runner.page_bytes,
                "kv_capacity_tokens": engine.cache_config.num_pages * engine.cache_config.page_size,
                "prefix_hit_rate": hits / queries if queries else 0.0}
    pending = list(zip(spec.arrivals, spec.token_ids, spec.max_tokens))[::-1]  # arrivals ascend: pop() next
    ids, done, peak_pages = [], {}, 0
    t0 = time.monotonic()
    while pending or len(done) < len(ids):
        if pending and not engine.has_unfinished():
            wait_until(t0 + pending[-1][0])
        while pending and time.monotonic() >= t0 + pending[-1][0]:  # submit what has arrived
            _, prompt, max_tokens = pending.pop()
            ids.append(engine.add_request({"prompt_token_ids": prompt},
                                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                         structured_outputs=constraint)))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        peak_pages = max(peak_pages, engine.manager.num_used_pages)
        report.tokens(engine.scheduler.stats.generation_tokens - generated)
    wall = time.monotonic() - t0
    after = engine.stats()
    queries = after.cache.prefix_cache_queries - before.cache.prefix_cache_queries
    requests = [{"output_token_ids": list(o.outputs[0].token_ids), "ttft_s": o.metrics.ttft_s,
                 "e2e_s": o.metrics.e2e_s, "cached_tokens": o.num_cached_tokens} for o in (done[i] for i in ids)]
    return {"wall_s": wall, "load_s": load_s, "grammar": grammar, "kernels": kernels_of(engine), "requests": requests,
            "kv_bytes": after.kv_cache_bytes,
            "kv_bytes_used_peak": peak_pages * engine.runner.page_bytes,
            "kv_capacity_tokens": engine.cache_config.num_pages * engine.cache_config.page_size,
            "prefix_hit_rate": (after.cache.prefix_cache_hits - before.cache.prefix_cache_hits) / queries if queries else 0.0}

