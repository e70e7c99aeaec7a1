"""Decode time per output token with the samplers clients send by default, against greedy: the bundled model in
process, one stream, 128 tokens at a time, each setting in turn, `--rounds` times (docs/performance.md,
"Sampled decoding"). Run it on two commits alternately (PYTHONPATH=<worktree>) to compare them."""

from __future__ import annotations

import argparse
import json
import time

from kvserve import LLM, SamplingParams

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 1 (OpenAI's default)": {"temperature": 1.0},
    "temperature 1, seeded": {"temperature": 1.0, "seed": 3},
    "Ollama's defaults (0.8, top_k 40, top_p 0.9)": {"temperature": 0.8, "top_k": 40, "top_p": 0.9},
    "top_p 0.9 alone": {"temperature": 1.0, "top_p": 0.9},
}
PROMPT = "Write a long story about a cat who learns to fly."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1, help="streams decoding together")
    args = parser.parse_args()
    llm = LLM(max_model_len=2048)
    llm.generate(PROMPT, SamplingParams(max_tokens=8))  # warm
    for _ in range(args.rounds):
        for name, fields in SETTINGS.items():
            params = [SamplingParams(max_tokens=128, ignore_eos=True, **fields) for _ in range(args.batch)]
            start = time.perf_counter()
            outs = llm.generate([PROMPT] * args.batch, params)
            wall = time.perf_counter() - start
            tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
                    for o in outs]
            print(json.dumps({"setting": name, "batch": args.batch, "tpot_ms": 1e3 * sum(tpot) / len(tpot),
                              "wall_s": wall}))


if __name__ == "__main__":
    main()
