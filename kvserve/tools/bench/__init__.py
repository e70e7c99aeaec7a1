"""`kvserve bench`: one workload through kvserve and through a peer in the same run, the figures side
by side with their ratios (kvserve / peer) and, in process, the greedy agreement of the outputs.

    workload.py   w1 file, a generated mix, a trace -> token ids + max_tokens per request (tokenized once)
    in process, one spawned process per engine (process.py):
      kvserve_run.py         requests added to LLMEngine as they arrive (all at t=0 unless --request-rate)
      transformers_peer.py   sequential generate(), same GGUF, float32, greedy, EOS ignored; or with the
                             shared prefix's KV computed once and deep-copied per request
      llama_cpp_peer.py      sequential Llama.generate (llama-cpp-python), reusing the previous prefix
    over HTTP (--concurrency N, --vs llama-server, --passes P):
      servers.py     `kvserve serve` and llama.cpp's `llama-server --parallel N` on free loopback ports
      http_client.py N concurrent streaming clients on /v1/completions (http_mode.py runs the passes)
    figures.py  per-request results -> figures, ratios, agreement;  report.py  table and plot
    cli.py      flags, run_bench, main_bench

Every engine gets the same ids and generates exactly max_tokens (EOS ignored, never masked), so
tokens/s compare like with like. TTFT counts from a request's submission: a sequential peer's later
requests wait behind earlier ones, as behind one server. Model loading and a short warm-up are outside
the timed part.
"""

from kvserve.tools.bench.cli import PEERS, add_bench_arguments, main_bench, run_bench
from kvserve.tools.bench.figures import ENGINE_KEYS, RATIO_KEYS, agreement, percentile, ratios, summarize
from kvserve.tools.bench.report import plot, render
from kvserve.tools.bench.workload import Workload, load_workload, shared_prefix_len, workloads_dir

__all__ = ["ENGINE_KEYS", "PEERS", "RATIO_KEYS", "Workload", "add_bench_arguments", "agreement", "load_workload",
           "main_bench", "percentile", "plot", "ratios", "render", "run_bench", "shared_prefix_len", "summarize",
           "workloads_dir"]
