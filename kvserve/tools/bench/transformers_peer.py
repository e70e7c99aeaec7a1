"""transformers as a peer: sequential generate() on the same GGUF in float32, greedy, EOS ignored;
in prompt-cache mode the shared prefix's KV is computed once and copy.deepcopy'd into each request
(transformers' documented reuse)."""

from __future__ import annotations

import time
from pathlib import Path

from kvserve.tools.bench.spec import WARMUP_IDS, Reporter, RunSpec, wait_until
from kvserve.tools.bench.workload import shared_prefix_len

TRANSFORMERS_MODES = {"generate": "transformers", "prompt-cache": "transformers+prompt-cache"}


def run_transformers(spec: RunSpec, report: Reporter) -> dict:
    import copy

    import warnings

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.generation import utils as generation_utils
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """generate() puts the prompt first, then each new token: time the first of those."""

        def __init__(self, on_token) -> None:
            self.puts, self.first, self.on_token = 0, None, on_token

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.monotonic()
            if self.puts >= 2:
                self.on_token()

        def end(self) -> None:
            pass

    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values -> cache renames
    transformers.logging.set_verbosity_error()
    path = Path(spec.model_path)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    cache_arg = "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
    prompt_cache = spec.engine == TRANSFORMERS_MODES["prompt-cache"]
    # at least one token of every prompt must be computed: it gives the first logits
    prefix_len = min(shared_prefix_len(spec.token_ids), min(map(len, spec.token_ids)) - 1) if prompt_cache else 0

    def generate(ids: list[int], max_tokens: int, streamer=None, cache=None) -> list[int]:
        x = torch.tensor([ids])
        kwargs = {} if cache is None else {cache_arg: cache}
        # eos_token_id=[]: run to max_new_tokens with EOS left in the argmax (None falls back to the model's)
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_tokens,
                             eos_token_id=[], pad_token_id=0, streamer=streamer, **kwargs)
        new = out[0, len(ids):].tolist()
        assert len(new) == max_tokens, f"generate stopped after {len(new)} of {max_tokens} tokens"
        return new

    def warm_up() -> None:
        with torch.inference_mode():
            generate(WARMUP_IDS, 4)

    on_token = report.warm_up_then_count(warm_up)
    requests = []
    t0 = time.monotonic()
    with torch.inference_mode():
        prefix = None
        if prefix_len:
            prefix = DynamicCache(config=model.config)
            # logits_to_keep=1: the docs' call would also project all prefix rows onto the vocabulary
            result = model(torch.tensor([spec.token_ids[0][:prefix_len]]), use_cache=True, logits_to_keep=1,
                           **{cache_arg: prefix})
            prefix = result.past_key_values if getattr(result, "past_key_values", None) is not None else prefix
        for ids, max_tokens, arrival in zip(spec.token_ids, spec.max_tokens, spec.arrivals):
            wait_until(t0 + arrival)
            streamer = FirstToken(on_token)
            new = generate(ids, max_tokens, streamer, None if prefix is None else copy.deepcopy(prefix))
            requests.append({"output_token_ids": new, "ttft_s": streamer.first - t0 - arrival,
                             "e2e_s": time.monotonic() - t0 - arrival, "cached_tokens": prefix_len})
    wall = time.monotonic() - t0
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # K and V, float32
    longest = max(len(p) + m for p, m in zip(spec.token_ids, spec.max_tokens))
    kv = (longest + prefix_len) * per_token  # one request's DynamicCache, plus the kept prefix
    return {"wall_s": wall, "load_s": load_s, "requests": requests, "kv_bytes": kv, "kv_bytes_used_peak": kv,
            "prefix_hit_rate": prefix_len * len(requests) / sum(map(len, spec.token_ids))}

