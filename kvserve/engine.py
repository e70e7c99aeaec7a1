"""The engine: LLMEngine ties scheduler, KV cache manager and model runner together one step at a
time; LLM is the synchronous batch API of DESIGN.md §4.

One step: scheduler.schedule() -> SchedulerOutput -> runner.execute() -> sampled tokens ->
scheduler.update() (counters, commits to the prefix cache, stop rules, freeing) -> RequestOutputs.
Cached pages the step evicts are read first and kept in the host tier (offload, `swap_space`
bytes shared with swap); an admitted request whose local hit stops short gets the following pages
from the host tier, then from Redis (`redis_url`), written before the compute. With Redis, the pages
committed in the step are read right after it and handed to the tier's background writer.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Any

from kvserve.cache.manager import KVCacheManager
from kvserve.cache.redis_tier import RedisTier
from kvserve.cache.tiers import HostTier, Tier, TierChain
from kvserve.config import (CacheConfig, ConfigError, EngineConfig, PrefixCachePolicy, capacity_error_message,
                            kv_bytes_per_page, parse_bytes, pool_tokens_for, resolve_kv_dtype)
from kvserve.model.gguf_loader import LoadedModel, apply_chat_template, load_gguf, resolve_model_path
from kvserve.model.runner import ModelRunner, calibrate_fp8_scale
from kvserve.request import (CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus,
                             SamplingParams)
from kvserve.scheduler import Scheduler

Prompt = str | dict[str, Any] | list[int]


def plan_cache(config: EngineConfig, loaded: LoadedModel) -> tuple[CacheConfig, int]:
    """Page count from the memory budget, and the start-up capacity check. Returns (cache config,
    max_model_len)."""
    model = loaded.config
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, config.dtype)
    page_bytes = kv_bytes_per_page(model.num_layers, model.num_kv_heads, model.head_dim,
                                   config.page_size, kv_dtype)
    memory = parse_bytes(config.kv_cache_memory)
    num_pages = memory // page_bytes  # page 0, the null page, is inside the budget
    pool_tokens = max(pool_tokens_for(memory, page_bytes, config.page_size), 0)
    max_model_len = config.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ConfigError(f"--max-model-len {max_model_len} is over the model's context "
                          f"{model.max_position_embeddings}; lower --max-model-len")
    if max_model_len > pool_tokens:
        raise ConfigError(capacity_error_message(max_model_len, pool_tokens, memory,
                                                 page_bytes / config.page_size))
    cache = CacheConfig(page_size=config.page_size, num_pages=num_pages, kv_dtype=kv_dtype,
                        prefix_cache=PrefixCachePolicy(config.prefix_cache))
    return cache, max_model_len


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.loaded = load_gguf(resolve_model_path(config.model))
        self.tokenizer = self.loaded.tokenizer
        self.cache_config, self.max_model_len = plan_cache(config, self.loaded)
        self.manager = KVCacheManager(
            self.cache_config.num_pages, config.page_size, self.cache_config.prefix_cache,
            partial_page_hits=not self.cache_config.kv_dtype.scale_bytes_per_page_head)
        self.fp8_scale = 1.0
        if config.calculate_kv_scales and self.cache_config.kv_dtype.name.startswith("fp8"):
            self.fp8_scale = calibrate_fp8_scale(self.loaded, self.cache_config.kv_dtype.name, config.page_size)
        self.runner = ModelRunner(self.loaded, self.cache_config.num_pages, config.page_size,
                                  self.cache_config.kv_dtype, device=config.device, dtype=config.dtype,
                                  fp8_scale=self.fp8_scale)
        self.host_tier = HostTier(parse_bytes(config.swap_space), self.runner.page_bytes)
        self.redis_tier = self._redis_tier() if config.redis_url else None
        self._committed: list[tuple[bytes, int]] = []  # (page hash, page id) committed this step
        if self.redis_tier is not None:
            self.manager.on_commit = self._committed.extend
        self._evicted: list[tuple[bytes, int]] = []  # (page hash, page id) evicted this step
        tiers: list[Tier] = []
        if self.host_tier.capacity_pages and self.cache_config.prefix_cache is not PrefixCachePolicy.OFF:
            self.manager.on_evict = lambda page_hash, page_id: self._evicted.append((page_hash, page_id))
            tiers.append(self.host_tier)
        if self.redis_tier is not None:
            tiers.append(self.redis_tier)
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, preemption_mode=config.preemption_mode,
                                   host_tier=self.host_tier,
                                   remote=TierChain(config.page_size, tiers) if tiers else None)
        self._ids = itertools.count()
        self._prompts: dict[str, str | None] = {}
        self._stop_text: dict[str, str] = {}  # request id -> output text cut at its stop string
        self._groups: dict[str, list[Request]] = {}  # request id -> its n samples (n > 1), in order
        self._group_of: dict[str, str] = {}  # sample id -> request id

    def _redis_tier(self) -> RedisTier:
        """Keyed by what makes two instances' pages interchangeable: model file, KV dtype (and the
        compute dtype when it differs: it changes the numbers stored), page size."""
        kv_dtype = self.cache_config.kv_dtype.name
        if kv_dtype != resolve_kv_dtype("auto", self.config.dtype).name:
            kv_dtype += "+" + self.config.dtype
        return RedisTier(self.config.redis_url, fingerprint=self.loaded.fingerprint,
                         kv_dtype=kv_dtype, page_size=self.config.page_size,
                         page_bytes=self.runner.page_bytes)

    def close(self) -> None:
        """Write what the Redis tier still has queued and close its connections."""
        if self.redis_tier is not None:
            self.redis_tier.close()

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("a prompt is a string, a list of token ids, or {'prompt_token_ids': [...]}")

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        if not self.loaded.chat_template:
            raise ValueError("this model has no chat template")
        return apply_chat_template(self.loaded.chat_template, messages, add_generation_prompt=True)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, namespace: str = "") -> str:
        """Validate and queue one request. Bad input raises ValueError; nothing is queued then."""
        params = params or SamplingParams()
        params.validate()
        if self.config.role == "prefill":  # compute the prompt and its first token, publish, done
            params = replace(params, max_tokens=1)
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} is over --max-num-seqs {self.config.max_num_seqs}")
        text, token_ids = self.tokenize(prompt)
        self.check_prompt(token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests or request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        salt = params.cache_salt or ""
        samples = [
            Request(request_id=request_id if i == 0 else f"{request_id}#{i}", prompt_token_ids=token_ids,
                    sampling_params=replace(params, seed=None if params.seed is None else params.seed + i),
                    eos_token_id=self.loaded.eos_token_id,
                    namespace=f"{namespace}\x00{salt}" if namespace else salt)
            for i in range(params.n)]
        request = samples[0]
        request.fork_children = samples[1:]
        if params.n > 1:
            self._groups[request_id] = samples
            self._group_of.update((s.request_id, request_id) for s in samples)
        self._prompts[request_id] = text
        self.scheduler.add(request)
        return request_id

    def check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        needed = len(token_ids) + params.max_tokens
        if needed > self.max_model_len:
            raise ValueError(
                f"this request needs {needed} tokens ({len(token_ids)} prompt + {params.max_tokens} "
                f"max_tokens), over max_model_len {self.max_model_len}; shorten the prompt or lower "
                f"max_tokens")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples when n > 1); its pages go back to the pool."""
        members = self._groups.get(request_id)
        aborted = [self.scheduler.abort(r.request_id) for r in members or []]
        request = self.scheduler.abort(request_id) if members is None else members[0]
        if request is None or (members is not None and not any(aborted)):
            return None
        return self._output(request)

    # -- stepping ------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        self._committed.clear()  # a failed step's commits name pages that may be reused now
        self._evicted.clear()
        out = self.scheduler.schedule()
        if not out.seqs:
            if self.scheduler.has_unfinished() and not self.scheduler.running:
                raise RuntimeError("no request could be scheduled although the pool is empty")
            return []
        if self._evicted:  # before anything below overwrites the evicted pages
            self._offload_evicted()
        for request_id, pages in out.swap_out:
            self.host_tier.fill_swap(request_id, self.runner.read_pages(pages))
        for request_id, pages in out.swap_in:
            self.runner.write_pages(pages, self.host_tier.take_swap(request_id))
        if out.remote_loads:
            self.runner.write_page_bytes(out.remote_loads)
        sampled = self.runner.execute(out)
        now = time.monotonic()
        changed = self.scheduler.update(out, sampled, now)
        if self.redis_tier is not None:
            self._publish_committed()
        for request in changed:
            if request.sampling_params.stop and not request.status.is_finished:
                self._check_stop_strings(request, now)
        outputs: dict[str, RequestOutput] = {}
        for request in changed:
            output = self._output(request)
            outputs.setdefault(output.request_id, output)
        return list(outputs.values())

    def _offload_evicted(self) -> None:
        """Keep the pages this step's schedule evicted in the host tier, by page hash."""
        evicted = dict(self._evicted)
        self._evicted.clear()
        for page_hash, payload in zip(evicted, self.runner.read_page_bytes(list(evicted.values()))):
            self.host_tier.put(page_hash, payload.copy())  # a row of its own: the tier counts pages

    def _publish_committed(self) -> None:
        """Offer the pages committed in this step that Redis does not hold yet, read now while they
        hold this step's K/V (a finished request's pages are freed but not reused before the next
        schedule). A prefill instance writes them before its reply: its decode instance reads them
        next; others queue them for the background writer and never wait."""
        committed = dict(self._committed)  # by hash: one page per content
        self._committed.clear()
        tier = self.redis_tier
        new = [(h, page) for h, page in committed.items() if not tier.is_known(h)]
        if not new or not tier.available():
            return
        items = list(zip([h for h, _ in new], self.runner.read_page_bytes([p for _, p in new])))
        if self.config.role == "prefill":
            tier.put_many(items)
        else:
            tier.offer(items)

    def _check_stop_strings(self, request: Request, now: float) -> None:
        text = self.decode(request.output_token_ids)
        cuts = [text.find(s) for s in request.sampling_params.stop or [] if s and s in text]
        if cuts:
            self._stop_text[request.request_id] = text[:min(cuts)]
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED, now)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _output(self, request: Request) -> RequestOutput:
        """The RequestOutput of the user's request this sample belongs to (all n samples)."""
        group_id = self._group_of.get(request.request_id)
        samples = self._groups[group_id] if group_id else [request]
        first = samples[0]
        finished = all(s.status.is_finished for s in samples)
        completions = [self._completion(i, s, finished) for i, s in enumerate(samples)]
        rid = first.request_id
        prompt = self._prompts.pop(rid, None) if finished else self._prompts.get(rid)
        if finished and group_id:
            del self._groups[group_id]
            for s in samples:
                self._group_of.pop(s.request_id, None)
        return RequestOutput(
            request_id=rid, prompt=prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=completions, finished=finished, num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(first.arrival_time,
                                   min((s.first_token_time for s in samples if s.first_token_time),
                                       default=None),
                                   max((s.finish_time or 0.0 for s in samples), default=None)
                                   if finished else None))

    def _completion(self, index: int, request: Request, group_finished: bool) -> CompletionOutput:
        done = request.status.is_finished
        text = (self._stop_text.pop(request.request_id, None) if group_finished
                else self._stop_text.get(request.request_id))
        if text is None:
            text = self.decode(request.output_token_ids)
        return CompletionOutput(
            index=index, token_ids=list(request.output_token_ids), text=text,
            finish_reason=request.status.value if done else None,
            logprobs=list(request.logprobs) if request.sampling_params.logprobs is not None else None)

    def stats(self) -> dict[str, Any]:
        stats = self.manager.stats()
        sched = self.scheduler.stats
        stats.update(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            num_requests_swapped=self.scheduler.num_swapped,
            cpu_cache_usage_perc=self.host_tier.usage(),
            num_swapped_out_pages=self.host_tier.stats.swap_outs,
            num_swapped_in_pages=self.host_tier.stats.swap_ins,
            num_offloaded_pages=self.host_tier.stats.offloads,
            cpu_prefix_cache_hits=self.host_tier.stats.offload_hits * self.config.page_size,
            num_preemptions=sched.num_preemptions,
            prompt_tokens=sched.prompt_tokens,
            prompt_tokens_cached=sched.cached_prompt_tokens,
            generation_tokens=sched.generation_tokens,
            page_size=self.config.page_size,
            kv_cache_dtype=self.cache_config.kv_dtype.name,
            kv_fp8_scale=self.fp8_scale,
            kv_cache_bytes=self.runner.kv_cache_bytes(),
            max_model_len=self.max_model_len,
            pool_tokens=(self.cache_config.num_pages - 1) * self.config.page_size,
        )
        if self.redis_tier is not None:
            stats.update(self.redis_tier.engine_stats())
        return stats
