"""Times an engine's start-up and its first and second W1-length prefill (a 64-token warm-up first, as the
bench does), with the page faults each prefill took: what a start-up leaves for the first request to pay.

    .venv/bin/python docs/experiments/first_prefill.py [MODEL]

MODEL "" is the bundled model. Alternate with another tree (PYTHONPATH=/other/tree) to compare two versions
under the same load."""

import os
import resource
import sys
import time

from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None
start = time.perf_counter()
engine = LLM(model=model, prefix_cache="off").engine
start_s = time.perf_counter() - start


def prefill(num_tokens: int, stride: int) -> tuple[float, int]:
    engine.add_request([100 + (i * stride) % 5000 for i in range(num_tokens)],
                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    begin = time.perf_counter()
    while not any(o.finished for o in engine.step()):
        pass
    return time.perf_counter() - begin, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


prefill(64, 3)
first, first_faults = prefill(1547, 7)
second, second_faults = prefill(1547, 11)
print(f"{model or 'bundled'} start {start_s:.2f} s; first W1 prefill {first * 1000:.0f} ms ({first_faults} faults), "
      f"second {second * 1000:.0f} ms ({second_faults}); load {os.getloadavg()[0]:.2f}")
