"""Times decode steps one by one in process (issue 39's step spread): a synthetic prompt, then each
engine.step() of one greedy sequence, printing min / median / p90 / max and the load average.

    .venv/bin/python docs/experiments/decode_steps.py [MODEL] [STEPS] [PROMPT_TOKENS] [MAX_MODEL_LEN]

MODEL "" is the bundled model; MAX_MODEL_LEN (default: the model's own) for a model whose whole context does
not fit the default KV pool, e.g. 4096 for synthetic:llama-3.1-8b-q4_k_m. Alternate with another tree
(PYTHONPATH=/other/tree) to compare two versions under the same load."""

import os
import sys
import time

from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else ""
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 64
prompt_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 1500
max_model_len = int(sys.argv[4]) if len(sys.argv) > 4 else None
engine = LLM(model=model or None, max_model_len=max_model_len).engine
prompt = [100 + (i * 7) % 5000 for i in range(prompt_tokens)]
engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
start = time.perf_counter()
engine.step()
prefill_s = time.perf_counter() - start
times, done = [], False
while not done:
    start = time.perf_counter()
    outputs = engine.step()
    times.append(time.perf_counter() - start)
    done = any(o.finished for o in outputs)
times = sorted(t * 1000 for t in times[2:])  # (the first steps after prefill warm the caches)
at = lambda q: times[int(q * (len(times) - 1))]  # noqa: E731
print(f"{model or 'bundled'} prefill {prefill_s * 1000:.0f} ms; decode steps {len(times)}: min {times[0]:.2f} "
      f"median {at(.5):.2f} p90 {at(.9):.2f} max {times[-1]:.2f} ms; load {os.getloadavg()[0]:.2f}")
