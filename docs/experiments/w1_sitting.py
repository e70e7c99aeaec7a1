"""Issue 24's single-stream figures in one sitting: `kvserve bench --workload w1 --limit 1 --max-tokens
128 --vs llama-cpp` for each model, the models alternated, several rounds; prints each run's prefill and
decode ratios (llama.cpp's time over kvserve's: above 1, kvserve is faster) with the load average around
it, then each model's median. The CPU kind and the kernels' instruction set head the table.

    .venv/bin/python docs/experiments/w1_sitting.py --rounds 3
    .venv/bin/python docs/experiments/w1_sitting.py --models bundled   # SmolLM2 only

Environment is passed through: KVSERVE_KERNELS_ISA=avx2 (with an AVX2 llama-cpp-python wheel on
PYTHONPATH) is how an AVX-512 host stands in for Zen 3, the proxy named in docs/performance.md."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

BENCH = ["-m", "kvserve.cli", "bench", "--workload", "w1", "--limit", "1", "--max-tokens", "128",
         "--vs", "llama-cpp", "--json"]


def cpu_kind() -> str:
    flags = open("/proc/cpuinfo").read()
    name = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    return f"{name}, {'AVX-512' if ' avx512f ' in flags else 'AVX2 only'}"


def one_run(model: str, extra: list[str]) -> dict:
    args = BENCH + ([] if model == "bundled" else ["--model", model]) + extra
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if done.returncode:  # the bench's own message (the peers' start-up chatter is dropped otherwise)
        sys.exit(f"{model}: kvserve bench failed ({done.returncode}):\n{done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    ours, peer = report["engines"]["kvserve"], report["engines"]["llama-cpp"]
    load = report["machine"]
    return {"prefill": peer["ttft_p50_s"] / ours["ttft_p50_s"], "decode": peer["tpot_s"] / ours["tpot_s"],
            "ttft": (ours["ttft_p50_s"], peer["ttft_p50_s"]), "tpot": (ours["tpot_s"], peer["tpot_s"]),
            "load": (load["load_avg_before"][0], load["load_avg_after"][0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="bundled,gemma-3-270m", help="comma list; bundled: the default model")
    parser.add_argument("--bench-args", default="", help="more `kvserve bench` arguments, e.g. '--max-model-len 4096' "
                        "for the synthetic 8B (its 128k context does not fit the default KV pool)")
    args = parser.parse_args()
    models = args.models.split(",")
    print(f"{cpu_kind()}; kernels: {os.environ.get('KVSERVE_KERNELS_ISA', 'chosen at start-up (the tuning)')}")
    runs: dict[str, list[dict]] = {m: [] for m in models}
    for round_ in range(args.rounds):
        for model in models:
            r = one_run(model, args.bench_args.split())
            runs[model].append(r)
            print(f"{model:14s} round {round_ + 1}: prefill x{r['prefill']:.2f} (TTFT {r['ttft'][0]:.2f} s vs "
                  f"{r['ttft'][1]:.2f} s), decode x{r['decode']:.2f} (TPOT {r['tpot'][0] * 1e3:.2f} vs "
                  f"{r['tpot'][1] * 1e3:.2f} ms), load {r['load'][0]:.2f} -> {r['load'][1]:.2f}", flush=True)
    for model, rs in runs.items():
        print(f"{model:14s} median of {len(rs)}: prefill x{statistics.median(r['prefill'] for r in rs):.2f}, "
              f"decode x{statistics.median(r['decode'] for r in rs):.2f}")


if __name__ == "__main__":
    main()
