"""The GPU check that tests/cuda/run.sh runs on a CUDA machine: the CUDA path's correctness on the
bundled model, its sizing, then W1 throughput against transformers on the same card; one JSON.

    1. float32 greedy tokens equal the CPU's (cpu_reference.json, made by make_reference.py)
    2. the default GPU mode (bf16, Triton attention, batch-invariant matmul, decode graphs): the same
       tokens and logprob bits alone, beside batch neighbours, on a prefix hit, and after preemption
    3. fp8 KV (e4m3, e5m2, scales from --calculate-kv-scales): greedy agreement with bf16 KV
    4. --gpu-memory-utilization 0.9: the pool against torch.cuda.mem_get_info, and the start-up error
       for a max_model_len that cannot fit
    5. W1 at 1, 16, 64, 256 concurrent requests: kvserve against transformers' batched generate()
       (bf16, SDPA) on the same card: TPOT at 1, output tokens/s at each

    python -m tests.cuda.gpu_check --model PATH --out check.json [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
import traceback
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cuda as gpu
from kvserve.config import ConfigError
from kvserve.model.runner import build_model
from tests.cuda.prompts import NEW_TOKENS, check_prompts

W1_TOKENS = 64  # W1's max_tokens


DEVICE = "cuda"  # --device cpu: a dry run of this script's logic on a machine without a GPU


def free_engines() -> None:
    build_model.cache_clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(list(o.outputs[0].token_ids), logprobs_of(o)) for o in outs]


def logprobs_of(output) -> list[dict[int, float]]:
    return list(output.outputs[0].logprobs or [])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check_float32(model: str, reference: dict) -> dict:
    llm = LLM(model=model, device=DEVICE, dtype="float32", kv_cache_memory="4GiB", max_num_seqs=8)
    got = greedy(llm, reference["prompts"])
    del llm
    free_engines()
    rows = [{"prompt_tokens": len(p), "equal": g[0] == want, "first_divergence": first_divergence(g[0], want)}
            for p, g, want in zip(reference["prompts"], got, reference["tokens"])]
    return {"all_equal": all(r["equal"] for r in rows), "prompts": rows}


def check_invariance(model: str, prompts: list[list[int]]) -> dict:
    """Default mode: tokens and logprobs (as bits) of each prompt alone, with neighbours, on a
    prefix hit, and with preemption forced by a pool of ~2.5 sequences."""
    llm = LLM(model=model, device=DEVICE, kv_cache_memory="4GiB", max_num_seqs=16)
    alone = []
    for p in prompts:
        llm.engine.reset_prefix_cache()
        alone.append(greedy(llm, [p])[0])
    llm.engine.reset_prefix_cache()
    batched = greedy(llm, prompts)  # all side by side
    hit_before = llm.engine.stats().cache.prefix_cache_hits
    again = greedy(llm, prompts[::-1])[::-1]  # every prompt now a prefix hit, reversed neighbours
    hits = llm.engine.stats().cache.prefix_cache_hits - hit_before
    page_bytes = llm.engine.runner.page_bytes
    longest = max(map(len, prompts)) + NEW_TOKENS
    del llm
    free_engines()
    # room for every request's prompt (and the null page) but not for their answers: decode preempts
    requests = prompts * 2
    pool = (sum(-(-(len(p) + 1) // 16) for p in requests) + 1) * page_bytes
    small = LLM(model=model, device=DEVICE, kv_cache_memory=pool, max_num_seqs=16, max_model_len=longest,
                prefix_cache="off")
    preempted = greedy(small, requests)[: len(prompts)]
    num_preemptions = small.engine.scheduler.stats.num_preemptions
    del small
    free_engines()
    modes = {"batch_neighbours": batched, "prefix_hit": again, "preemption": preempted}
    return {"prefix_hits": hits, "num_preemptions": num_preemptions,
            **{name: {"tokens_equal": all(a[0] == b[0] for a, b in zip(alone, got)),
                      "logprob_bits_equal": all(a[1] == b[1] for a, b in zip(alone, got))}
               for name, got in modes.items()}}


def check_fp8(model: str, prompts: list[list[int]]) -> dict:
    out = {}
    llm = LLM(model=model, device=DEVICE, kv_cache_memory="4GiB", max_num_seqs=8)
    base = greedy(llm, prompts)
    del llm
    free_engines()
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        llm = LLM(model=model, device=DEVICE, kv_cache_memory="4GiB", max_num_seqs=8, kv_cache_dtype=kv,
                  calculate_kv_scales=True)
        got = greedy(llm, prompts)
        del llm
        free_engines()
        firsts = [first_divergence(a[0], b[0]) for a, b in zip(base, got)]
        agree = [NEW_TOKENS if f is None else f for f in firsts]
        out[kv] = {"greedy_prefix_agreement": sum(agree) / (NEW_TOKENS * len(prompts)),
                   "prompts_fully_equal": sum(f is None for f in firsts), "num_prompts": len(prompts)}
    return out


def check_sizing(model: str) -> dict:
    from kvserve.engine import LLMEngine
    from kvserve.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=model, device=DEVICE, gpu_memory_utilization=0.9, max_num_seqs=256))
    budget = engine.gpu_budget
    torch.cuda.synchronize()
    free_after, total = torch.cuda.mem_get_info()
    pool = engine.runner.kv_cache_bytes()
    free_after_load = budget.total_bytes - budget.in_use_bytes
    reserve = (1 - budget.utilization) * budget.total_bytes
    result = {"line": budget.describe(), "total_bytes": total, "in_use_after_load_bytes": budget.in_use_bytes,
              "activation_peak_bytes": budget.activation_peak_bytes, "pool_bytes": pool,
              "pool_tokens": (engine.cache_config.num_pages - 1) * engine.cache_config.page_size,
              "free_after_load_bytes": free_after_load,
              "pool_vs_free_after_load_less_reserve": pool / (free_after_load - reserve),
              "free_after_pool_and_graphs_bytes": free_after, "reserve_bytes": int(reserve)}
    bytes_per_token = engine.runner.page_bytes / engine.cache_config.page_size
    max_len = engine.loaded.config.max_position_embeddings
    del engine
    free_engines()
    # a utilization that leaves the pool half of what one max_model_len sequence needs
    util = (budget.in_use_bytes + budget.activation_peak_bytes + 0.5 * max_len * bytes_per_token) / total
    try:
        LLMEngine(EngineConfig(model=model, device=DEVICE, gpu_memory_utilization=util, max_num_seqs=8))
        result["too_long_error"] = None
    except ConfigError as exc:
        result["too_long_error"] = str(exc)
    free_engines()
    return result


def bench_kvserve(model: str, w1: list[list[int]], concurrencies: list[int], enforce_eager: bool = False) -> dict:
    llm = LLM(model=model, device=DEVICE, max_num_seqs=max(concurrencies), max_num_batched_tokens=8192,
              enforce_eager=enforce_eager)
    engine = llm.engine
    greedy(llm, [w1[0][:32]], 4)  # warm-up
    out = {}
    for n in concurrencies:
        engine.reset_prefix_cache()
        prompts = [w1[i % len(w1)] for i in range(n)]
        params = SamplingParams(max_tokens=W1_TOKENS, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
        first, done, tokens = {}, {}, {}
        while engine.has_unfinished():
            for o in engine.step():
                now = time.perf_counter()
                n_out = len(o.outputs[0].token_ids)
                if n_out and o.request_id not in first:
                    first[o.request_id] = now
                if o.finished:
                    done[o.request_id], tokens[o.request_id] = now, n_out
        wall = time.perf_counter() - t0
        tpots = [(done[r] - first[r]) / (tokens[r] - 1) for r in done if tokens[r] > 1 and r in first]
        out[str(n)] = {"wall_s": wall, "output_tokens": sum(tokens.values()),
                       "output_tokens_per_s": sum(tokens.values()) / wall,
                       "ttft_median_s": statistics.median(first[r] - t0 for r in first),
                       "tpot_median_ms": 1000 * statistics.median(tpots)}
        assert len(ids) == len(done)
    del llm, engine
    free_engines()
    return out


def bench_transformers(model: str, w1: list[list[int]], concurrencies: list[int]) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    path = Path(model)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16,
                                              attn_implementation="sdpa").to(DEVICE).eval()

    def run(prompts: list[list[int]], new: int) -> float:
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), do_sample=False, max_new_tokens=new,
                              min_new_tokens=new, eos_token_id=[], pad_token_id=0)
        sync()
        assert out.shape[1] == width + new
        return time.perf_counter() - t0

    run([w1[0][:32]], 4)  # warm-up
    out = {}
    for n in concurrencies:
        prompts = [w1[i % len(w1)] for i in range(n)]
        wall = run(prompts, W1_TOKENS)
        row = {"wall_s": wall, "output_tokens": n * W1_TOKENS, "output_tokens_per_s": n * W1_TOKENS / wall}
        if n == 1:
            prefill = run(prompts, 1)
            row["tpot_median_ms"] = 1000 * (wall - prefill) / (W1_TOKENS - 1)
            row["ttft_median_s"] = prefill
        out[str(n)] = row
    del hf
    free_engines()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", default=str(Path(__file__).parent / "cpu_reference.json"))
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--only", default="float32,invariance,fp8,sizing,bench")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--limit", type=int, default=None, help="check only the first N prompts (dry runs)")
    parser.add_argument("--enforce-eager", action="store_true", help="kvserve's bench without decode graphs")
    parser.add_argument("--no-peer", action="store_true", help="kvserve's bench only")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    reference = json.loads(Path(args.reference).read_text())
    reference["prompts"], reference["tokens"] = reference["prompts"][:args.limit], reference["tokens"][:args.limit]
    prompts = reference["prompts"]
    report = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
              "torch": torch.__version__, "host": platform.node(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": Path(args.model).name}
    import triton

    report["triton"] = triton.__version__
    report["matmul"] = "invariant" if gpu.invariant_matmul() else "cublas"
    report["enforce_eager"] = args.enforce_eager
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    steps = {"float32": lambda: check_float32(args.model, reference),
             "invariance": lambda: check_invariance(args.model, prompts),
             "fp8": lambda: check_fp8(args.model, prompts),
             "sizing": lambda: check_sizing(args.model),
             "bench": lambda: None}
    for name in args.only.split(","):
        start = time.perf_counter()
        try:
            if name == "bench":
                from kvserve.tools.bench.workload import load_workload

                w1 = load_workload("w1", model=args.model).token_ids
                report["bench_kvserve"] = bench_kvserve(args.model, w1, concurrencies, args.enforce_eager)
                if not args.no_peer:
                    report["bench_transformers"] = bench_transformers(args.model, w1, concurrencies)
            else:
                report[name] = steps[name]()
        except Exception:  # one failed part must not lose the others' figures
            report[name + "_error"] = traceback.format_exc()
            free_engines()
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(name, json.dumps(report.get(name, report.get(name + "_error")), default=str)[:2000], flush=True)
    if "bench_kvserve" in report and "bench_transformers" in report:
        for n, row in report["bench_kvserve"].items():
            peer = report["bench_transformers"].get(n)
            if peer:
                row["vs_transformers_tokens_per_s"] = row["output_tokens_per_s"] / peer["output_tokens_per_s"]
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print("bench", json.dumps({"kvserve": report["bench_kvserve"], "transformers": report["bench_transformers"]}))


if __name__ == "__main__":
    main()
