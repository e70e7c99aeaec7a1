"""Whole decoders on the Triton attention path, run by Triton's interpreter on the CPU (compiled on a
CUDA device when there is one): greedy tokens
equal transformers' (float32) for tiny Llama 3, Qwen2 and Gemma 3 (sliding window 8) models, with
chunked prefill starting mid-page and the sequences decoded side by side."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.kernels import cuda as gpu
from kvserve.batch import ScheduledSeq, SchedulerOutput
from kvserve.config import KV_DTYPES
from kvserve.model.gguf_loader import load_gguf
from kvserve.model.runner import ModelRunner
from tests.model.tiny_models import VOCAB, make_hf_model, write_gguf

if not gpu.available():
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4
CHUNK = 7  # prefill tokens per step: chunks start mid-page
NEW_TOKENS = 5


def greedy(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Prefill each prompt in CHUNK-token steps (all prompts side by side), then decode them together."""
    free = list(range(1, runner.num_pages))
    random.Random(0).shuffle(free)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    tables: list[list[int]] = [[] for _ in prompts]
    while any(len(t) - len(p) < NEW_TOKENS for t, p in zip(tokens, prompts)):
        scheduled = []
        for i, t in enumerate(tokens):
            n = min(CHUNK, len(t) - computed[i])
            while len(tables[i]) * PAGE < computed[i] + n:
                tables[i].append(free.pop())
            scheduled.append(ScheduledSeq("r", t[computed[i]:computed[i] + n], computed[i], list(tables[i]),
                                          need_sample=computed[i] + n == len(t)))
        for i, (s, sampled) in enumerate(zip(scheduled, runner.execute(SchedulerOutput(scheduled)).sampled)):
            computed[i] += len(s.token_ids)
            if sampled is not None:
                tokens[i].append(sampled.token_id)
    return [t[len(p):len(p) + NEW_TOKENS] for t, p in zip(tokens, prompts)]


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "gemma3"])
def test_triton_path_greedy_equals_transformers(tmp_path, kind):
    model = make_hf_model(kind)
    loaded = load_gguf(str(write_gguf(model, kind, tmp_path / f"{kind}.gguf")))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 19)]
    runner = ModelRunner(loaded, 24, PAGE, KV_DTYPES["fp32"], device=DEVICE, dtype="float32",
                         attention="triton")
    assert runner.triton_attention
    got = greedy(runner, prompts)
    for prompt, tokens in zip(prompts, got):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=[], pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()
