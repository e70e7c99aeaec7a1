"""Peak resident memory of kvserve holding a model, beyond its KV pool, against the file's size (issue 39,
must-show 5): load, then a prompt and 8 tokens.

    .venv/bin/python docs/experiments/load_rss.py synthetic:llama-3.1-8b-q4_k_m 1GiB 256"""

import os
import sys

from kvserve.llm import LLM
from kvserve.model.gguf_loader import resolve_model_path
from kvserve.sampling_params import SamplingParams
from kvserve.units import parse_bytes


def status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


model, pool = sys.argv[1], sys.argv[2]
size = os.path.getsize(resolve_model_path(model))
llm = LLM(model=model, kv_cache_memory=pool, max_model_len=4096)
after_load = status("VmRSS")
prompt = [100 + (i * 7) % 5000 for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 256)]
llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
peak = status("VmHWM")
mib = 2**20
print(f"file {size / mib:.0f} MiB; pool {parse_bytes(pool) / mib:.0f} MiB; RSS after load {after_load / mib:.0f} MiB, "
      f"peak {peak / mib:.0f} MiB; peak beyond the pool / file = {(peak - parse_bytes(pool)) / size:.3f}")
