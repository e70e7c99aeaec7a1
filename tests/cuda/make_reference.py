"""Writes cpu_reference.json: kvserve's greedy tokens on the CPU in float32 (equal to transformers',
tests/test_engine.py) for the GPU check's prompts; gpu_check.py compares the CUDA path with them.

    KVSERVE_WORKLOADS=../shared/workloads .venv/bin/python -m tests.cuda.make_reference
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.model.gguf_loader import bundled_model_path
from tests.cuda.prompts import NEW_TOKENS, check_prompts


def main() -> None:
    path = str(bundled_model_path())
    prompts = check_prompts(path)
    llm = LLM(model=path, dtype="float32", kv_cache_memory="1GiB")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    ref = {"model": Path(path).name, "dtype": "float32", "device": "cpu", "host": platform.processor() or "x86_64",
           "new_tokens": NEW_TOKENS, "prompts": prompts, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    (Path(__file__).parent / "cpu_reference.json").write_text(json.dumps(ref) + "\n")


if __name__ == "__main__":
    main()
