"""Each in-process engine (kvserve, transformers, llama-cpp-python) runs in a spawned process of its
own (its own peak RSS, no shared thread pools or caches) and reports progress and its result through
a queue."""

from __future__ import annotations

import os
import queue as queue_mod
import resource
import traceback

from kvserve.config import ConfigError
from kvserve.tools.bench.spec import Reporter, RunSpec


def _runner(engine: str):
    if engine.startswith("kvserve"):  # kvserve, kvserve+json-schema
        from kvserve.tools.bench.kvserve_run import run_kvserve
        return run_kvserve
    if engine == "llama-cpp":
        from kvserve.tools.bench.llama_cpp_peer import run_llama_cpp
        return run_llama_cpp
    from kvserve.tools.bench.transformers_peer import run_transformers
    return run_transformers


def _worker(spec: RunSpec, queue) -> None:
    if not spec.engine.startswith("kvserve"):  # a peer runs with its OpenMP runtime's own defaults
        from kvserve import peer_environment

        environment = peer_environment()
        os.environ.clear()
        os.environ.update(environment)
    os.environ["TQDM_DISABLE"] = "1"  # transformers' GGUF loader draws its own bar
    if spec.threads:
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    try:
        import torch

        threads = spec.threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        run = _runner(spec.engine)
        result = run(spec, Reporter(queue))
        result.update(threads=threads, peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        queue.put(("result", result))
    except (ConfigError, ValueError) as err:
        queue.put(("config_error", str(err)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put(("error", traceback.format_exc()))



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

