"""8 greedy streams of 2,000 tokens in process: wall time and TPOT (docs/performance.md, "A running output's text,
token by token"). Run it on two commits alternately (PYTHONPATH=<worktree>) to compare them."""

import time, json
from kvserve import LLM, SamplingParams
llm = LLM(max_model_len=4096)
p = [SamplingParams(max_tokens=2000, ignore_eos=True) for _ in range(8)]
llm.generate("Hi", SamplingParams(max_tokens=4))
t = time.perf_counter()
outs = llm.generate(["Write a very long story."] * 8, p)
wall = time.perf_counter() - t
import statistics
tpots = [(o.metrics.finish_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1) for o in outs]
print(json.dumps({"wall_s": wall, "tpot_ms": 1e3 * statistics.mean(tpots)}))
