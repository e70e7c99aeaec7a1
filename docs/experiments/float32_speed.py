"""Times the exact path (`--dtype float32`) on the bundled model in process: a 1,500-token prefill, 64 decode
tokens after a 20-token prompt, and 8 prompts x 32 tokens batched; prints one JSON line.

    .venv/bin/python docs/experiments/float32_speed.py

Alternate with another tree (PYTHONPATH=/other/tree) to compare two versions under the same load."""

import json
import time

import kvserve
from kvserve import LLM, SamplingParams

llm = LLM(dtype="float32", prefix_cache="off")
ids = [(i * 7919) % 40000 + 100 for i in range(1500)]  # token ids spread over the vocabulary


def generate(prompts, tokens: int) -> None:
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))


def timed(prompts, tokens: int) -> float:
    start = time.perf_counter()
    generate(prompts, tokens)
    return time.perf_counter() - start


generate({"prompt_token_ids": ids[:20]}, 4)  # first calls: buffers, the kernels' first use
print(json.dumps({"tree": kvserve.__file__,
                  "prefill_1500_s": timed({"prompt_token_ids": ids}, 1),
                  "decode_64_s": timed({"prompt_token_ids": ids[:20]}, 65),
                  "batch_8x32_s": timed([{"prompt_token_ids": ids[i:i + 20]} for i in range(8)], 33)}))
