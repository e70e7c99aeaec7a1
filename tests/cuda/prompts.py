"""The GPU check's prompts, the same token ids on the CPU (make_reference.py) and on the GPU
(gpu_check.py): three short texts and W1's first two requests (a 1.5k-token shared system prompt;
W1 is read from $KVSERVE_WORKLOADS, as `kvserve bench` reads it)."""

from __future__ import annotations

NEW_TOKENS = 32
SHORT = ["The capital of France is", "Write one sentence about the sea.",
         "List three prime numbers and explain why each is prime:"]


def check_prompts(model_path: str) -> list[list[int]]:
    from kvserve.model.gguf_loader import load_gguf
    from kvserve.tools.bench.workload import load_workload

    tokenizer = load_gguf(model_path).tokenizer
    ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in SHORT]
    return ids + load_workload("w1", limit=2, model=model_path).token_ids
