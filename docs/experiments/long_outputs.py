"""8 greedy streams of 2,000 tokens in process: wall time and TPOT (docs/performance.md, "A running output's
text, token by token"). Run it on two commits alternately (PYTHONPATH=<worktree>) to compare them."""

from __future__ import annotations

import json
import statistics
import time

from kvserve import LLM, SamplingParams


def main() -> None:
    llm = LLM(max_model_len=4096)
    llm.generate("Hi", SamplingParams(max_tokens=4))  # warm
    params = [SamplingParams(max_tokens=2000, ignore_eos=True) for _ in range(8)]
    start = time.perf_counter()
    outs = llm.generate(["Write a very long story."] * 8, params)
    wall = time.perf_counter() - start
    tpots = [(o.metrics.finish_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1) for o in outs]
    print(json.dumps({"wall_s": wall, "tpot_ms": 1e3 * statistics.mean(tpots)}))


if __name__ == "__main__":
    main()
