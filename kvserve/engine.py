"""LLMEngine: one step at a time, schedule -> execute -> update, over the model runner.

    step.run_step(scheduler, runner)  schedule, execute, update, the page moves a tier wants (step.py:
                                      the same step the simulator runs over a virtual clock)
    event_publisher.publish(...)      the step's KV events on the wire
    outputs.output(request)           RequestOutputs (n samples grouped, stop strings, text)

The engine builds the tiers (host memory, Redis) and hands them to the cache layer, which decides
every page move; the scheduler never sees a tier.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Any

import torch

from kvserve.cache.disk_tier import DiskTier, TierAuthSealer
from kvserve.cache.events import KVEventBuffer
from kvserve.cache.hashing import namespace as cache_namespace, page_hashes
from kvserve.cache.leases import Retention
from kvserve.cache.manager import KVCacheManager
from kvserve.cache.offload import Offloader
from kvserve.cache.pins import DAY_S, PinLedger, PinResult, ledger_for
from kvserve.cache.redis_tier import RedisTier
from kvserve.cache.tier_auth import default_auth
from kvserve.cache_report import CacheReporter
from kvserve.cache.tiers import HostTier
from kvserve.engine_stats import EngineStats
from kvserve.cache_plan import plan_cache
from kvserve.config import MODEL_DTYPE_TO_KV, EngineConfig, PrefixCachePolicy, parse_bytes, resolve_kv_dtype
from kvserve.kv_events import attach_tiers, publisher_for
from kvserve.model.draft_model import DraftModel, load_draft_model
from kvserve.model.gguf_loader import load_gguf, resolve_model_path
from kvserve.model.gpu_memory import GpuMemoryBudget, measure_budget
from kvserve.model.runner import ModelRunner, build_model, calibrate_fp8_scale, profile_step
from kvserve.model.tokenizer import ChatTemplateOptions, read_chat_template
from kvserve.output import OutputProcessor
from kvserve.request import (CacheLease, LeaseInfo, Request, RequestOutput, RequestStatus, TokenConstraint,
                             ToolCallKV)
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler
from kvserve.speculative.policy import SpecDecodeStats
from kvserve.startup_checks import check_machine
from kvserve.step import run_step
from kvserve.structured import compiler_for
from kvserve.structured.compiler import CompiledGrammar
from kvserve.token_bans import bad_words_token_ids
from kvserve import tool_call_kv

Prompt = str | dict[str, Any] | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        check_machine(config)  # before the load: a device or memory the machine lacks fails at once
        self.loaded = load_gguf(resolve_model_path(config.model))
        # --chat-template replaces the model's own (the loaded model is shared in the process: not there)
        self.chat_template = (read_chat_template(config.chat_template) if config.chat_template is not None
                              else self.loaded.chat_template)
        self.tokenizer = self.loaded.tokenizer
        spec = config.speculative_config
        self.draft = load_draft_model(spec.model, self.loaded, config.max_model_len or
                                      self.loaded.config.max_position_embeddings) \
            if spec is not None and spec.method == "draft_model" else None
        self.gpu_budget = self._gpu_budget()  # None on the CPU or with --kv-cache-memory
        self.cache_config, self.max_model_len = plan_cache(
            config, self.loaded.config, self.draft.config if self.draft else None,
            (self.gpu_budget.kv_cache_bytes, self.gpu_budget.describe()) if self.gpu_budget else None)
        kv_dtype = self.cache_config.kv_dtype
        self.fp8_scale = 1.0
        if config.calculate_kv_scales and kv_dtype.name.startswith("fp8"):
            self.fp8_scale = calibrate_fp8_scale(self.loaded, kv_dtype.name, config.page_size)
        drafter = DraftModel(self.draft, self.cache_config.num_pages, config.page_size, kv_dtype, config.device,
                             config.dtype, config.threads) if self.draft else None  # (its own pages)
        self.runner = ModelRunner(self.loaded, self.cache_config.num_pages, config.page_size, kv_dtype,
                                  device=config.device, dtype=config.dtype, fp8_scale=self.fp8_scale,
                                  num_window_slots=self.cache_config.num_window_slots, threads=config.threads,
                                  drafter=drafter, decode_graphs_batch=0 if config.enforce_eager else config.max_num_seqs,
                                  max_model_len=self.max_model_len)
        self.host_tier = HostTier(parse_bytes(config.swap_space), self.runner.page_bytes)
        self.tier_auth = default_auth()  # --kv-tier-secret-file: MACs on what tiers hold (stored responses too)
        self.redis_tier = self._redis_tier() if config.redis_url else None
        self.disk_tier = self._disk_tier() if config.kv_disk_path else None
        self.pins = self._pin_ledger()  # prompt_cache_retention 24h; None without a disk or Redis tier
        self.events, self.event_publisher = None, None
        if config.kv_events_endpoint:
            self.events = KVEventBuffer(config.page_size)
            self.event_publisher = publisher_for(config)
            attach_tiers(self.events, self.host_tier, self.disk_tier)
        offload = Offloader.for_pool(
            config.page_size, self.host_tier, shared=self.redis_tier, disk=self.disk_tier,
            prefix_caching=self.cache_config.prefix_cache is not PrefixCachePolicy.OFF,
            windowed=bool(self.cache_config.num_window_slots), publish_sync=config.role == "prefill")
        self.manager = KVCacheManager.from_config(self.cache_config, offload, self.events)
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, preemption_mode=config.preemption_mode,
                                   speculative_config=config.speculative_config)
        self.num_steps = self.num_step_tokens = 0  # steps that computed tokens, and those tokens (metrics)
        self.outputs = OutputProcessor(self.tokenizer)
        self.reporter = CacheReporter(config.page_size, self.runner.page_bytes / config.page_size, kv_dtype.name)
        self._ids = itertools.count()

    def _gpu_budget(self) -> GpuMemoryBudget | None:
        """On CUDA without --kv-cache-memory: the weights go to the card first, then one step of
        max_num_batched_tokens rows is profiled, and the pool gets the rest of the utilization share."""
        config = self.config
        device = torch.device(config.device)
        if device.type != "cuda" or config.kv_cache_memory is not None:
            return None
        build_model(self.loaded, config.dtype, str(device), config.max_model_len)  # cached: the runner's
        num_tokens = min(config.max_num_batched_tokens,
                         config.max_model_len or self.loaded.config.max_position_embeddings)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, config.dtype)
        return measure_budget(config.gpu_memory_utilization, device, lambda: profile_step(
            self.loaded, config.dtype, str(device), kv_dtype, config.page_size, num_tokens, config.max_num_seqs))

    def _page_layout(self) -> str:
        """What makes two instances' pages interchangeable: KV dtype and the weight mode that
        computed them (int4, int8, native and bfloat16 all store bf16 K/V, with different numbers)."""
        kv_dtype = self.cache_config.kv_dtype.name
        if kv_dtype != MODEL_DTYPE_TO_KV[self.config.dtype] or self.config.dtype in ("int4", "int8", "native"):
            kv_dtype += "+" + self.config.dtype
        return kv_dtype

    def _redis_tier(self) -> RedisTier:
        """Keyed by model file, page layout and page size."""
        return RedisTier(self.config.redis_url, fingerprint=self.loaded.fingerprint,
                         kv_dtype=self._page_layout(), page_size=self.config.page_size,
                         page_bytes=self.runner.page_bytes)

    def _disk_tier(self) -> DiskTier:
        layout = f"{self.loaded.fingerprint}:{self._page_layout()}:{self.config.page_size}"
        auth = default_auth()  # the tier secret (--kv-tier-secret-file): pages on disk carry its MAC
        return DiskTier(self.config.kv_disk_path, parse_bytes(self.config.kv_disk_bytes),
                        self.runner.page_bytes, layout=layout,
                        sealer=TierAuthSealer(auth) if auth.enabled else None)

    def _pin_ledger(self) -> PinLedger | None:
        if self.disk_tier is None and self.redis_tier is None:
            return None
        disk, config = self.disk_tier, self.config
        ledger = ledger_for(self.runner.page_bytes, disk.capacity_pages if disk else None,
                            disk.root if disk else None,
                            *(parse_bytes(b) if b is not None else None
                              for b in (config.kv_pin_bytes, config.kv_pin_tenant_bytes)))
        for tier in (disk, self.redis_tier):
            if tier is not None:
                tier.pins = ledger
        return ledger

    def pin_prefix(self, token_ids: list[int], tenant: str, cache_salt: str | None,
                   ttl_s: float = DAY_S) -> PinResult | None:
        """prompt_cache_retention 24h: pin the full pages of `token_ids` (in the namespace a request of
        `tenant` with `cache_salt` gets) in the disk and Redis tiers for `ttl_s`. None: no such tier.
        Thread-safe (ledger and tiers lock themselves); blocking (file and Redis writes)."""
        if self.pins is None:
            return None
        hashes = page_hashes(token_ids, self.config.page_size, cache_namespace(tenant, cache_salt))
        result = self.pins.pin(tenant, hashes, ttl_s)
        if result.pinned and self.redis_tier is not None:
            self.redis_tier.expire(hashes, ttl_s)
        return result

    def close(self) -> None:
        """Write what the Redis and disk tiers still have queued, close their connections and the
        KV event sockets."""
        if self.redis_tier is not None:
            self.redis_tier.close()
        if self.disk_tier is not None:
            self.disk_tier.close()
        if self.event_publisher is not None:
            self.event_publisher.close()

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.loaded.encode(prompt)  # (with BOS where the model wants one)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("a prompt is a string, a list of token ids, or {'prompt_token_ids': [...]}")

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    options: ChatTemplateOptions = ChatTemplateOptions()) -> str:
        """The conversation as the model's chat template renders it (BOS written as text), with
        the tool definitions where the template puts them, as `options` asks."""
        return self.loaded.render_chat(messages, options, tools=tools, template=self.chat_template)

    def grammar_compiler(self):
        """The structured-outputs compiler of this model's tokenizer (built on first use, ~0.5 s for
        SmolLM2's vocabulary, then shared by every engine over the same model in the process)."""
        return compiler_for(self.tokenizer, self.loaded.config.vocab_size,
                            tuple(dict.fromkeys(t for t in (self.loaded.eos_token_id, *self.loaded.eos_token_ids)
                                                if t is not None)))

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, tenant: str = "",
                    leases: list[CacheLease] | None = None, kv_explain: bool = False,
                    tool_call: ToolCallKV | None = None, grammar: TokenConstraint | None = None,
                    compiled_grammar: CompiledGrammar | None = None) -> str:
        """Validate and queue one request. Bad input raises ValueError (a GrammarError naming the
        field for a constraint that cannot compile); nothing is queued then. `tool_call`: hold its KV
        when it finishes (if --tool-call-kv-ttl is on), release earlier holds. `grammar`: a state to
        continue from (beam search) instead of a fresh one from params.structured_outputs;
        `compiled_grammar`: params.structured_outputs already compiled (the server does it off this
        thread, structured/workers.py)."""
        params = params or SamplingParams()
        params.validate()
        if grammar is not None and params.n > 1:
            raise ValueError("a grammar state to continue from serves one sample (n=1)")
        compiled = compiled_grammar
        if params.structured_outputs is not None and grammar is None and compiled is None:
            compiled = self.grammar_compiler().compile(params.structured_outputs, tenant)
        if self.config.role == "prefill":  # compute the prompt and its first token, publish, done
            params = replace(params, max_tokens=1)
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} is over --max-num-seqs {self.config.max_num_seqs}")
        text, token_ids = self.tokenize(prompt)
        self.check_prompt(token_ids, params)
        bad_words = bad_words_token_ids(params.bad_words or [],
                                        lambda word: self.tokenizer.encode(word, add_special_tokens=False).ids)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests or self.outputs.is_known(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = [
            Request(request_id=request_id if i == 0 else f"{request_id}#{i}", prompt_token_ids=token_ids,
                    sampling_params=replace(params, seed=None if params.seed is None else params.seed + i),
                    eos_token_id=self.loaded.eos_token_id, eos_token_ids=self.loaded.eos_token_ids,
                    tenant=tenant, cache_salt=params.cache_salt, bad_words_token_ids=bad_words,
                    grammar=compiled.new_state() if compiled is not None else grammar)
            for i in range(params.n)]
        request = samples[0]
        request.fork_children = samples[1:]
        request.retention = Retention.of(list(leases or []), len(token_ids), tenant,
                                         self.config.min_cacheable_tokens, self.config.lease_ttl_scale)
        request.kv_explain = kv_explain
        if tool_call is not None:
            request.tool_call = tool_call
            request.hold_ttl_s = self.config.tool_call_kv_ttl * self.config.lease_ttl_scale if tool_call.hold else 0.0
        self.outputs.add(request_id, text, samples)
        self.scheduler.add(request)
        return request_id

    def check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias or {}):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(t >= vocab for t in getattr(params, name) or []):
                raise ValueError(f"{name} must be token ids in [0, {vocab})")
        needed = len(token_ids) + params.max_tokens
        if needed > self.max_model_len:
            raise ValueError(
                f"this request needs {needed} tokens ({len(token_ids)} prompt + {params.max_tokens} "
                f"max_tokens), over max_model_len {self.max_model_len}; shorten the prompt or lower "
                f"max_tokens")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples when n > 1); its pages go back to the pool."""
        members = self.outputs.samples(request_id)
        aborted = [self.scheduler.abort(r.request_id) for r in members or []]
        request = self.scheduler.abort(request_id) if members is None else members[0]
        if request is None or (members is not None and not any(aborted)):
            return None
        return self.outputs.output(request)

    # -- stepping ------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One step.run_step over the model runner, then what only a served engine does: the cache
        report, the KV events on the wire, stop strings (they need text) and the outputs."""
        step = run_step(self.scheduler, self.runner, time.monotonic)
        self.num_steps += bool(step.out.seqs)
        self.num_step_tokens += sum(len(seq.token_ids) for seq in step.out.seqs)
        if not step.out.seqs:
            # (a request that preempted itself, with leases holding the pool, is admitted next step:
            # admission breaks leases once nothing runs)
            if self.scheduler.has_unfinished() and not self.scheduler.running and not step.out.preempted:
                raise RuntimeError("no request could be scheduled although the pool is empty")
            return []
        now = time.monotonic()
        for request in step.changed:
            if request.num_output_tokens == 1:
                self.reporter.first_token(request)
            if request.status.is_finished:
                self.reporter.finished(request)
        self.reporter.step(self.manager.usage(), now)
        if self.event_publisher is not None:
            self.event_publisher.publish(self.events.drain())
        for request in step.changed:
            if request.sampling_params.stop and not request.status.is_finished:
                if self.outputs.hits_stop_string(request):
                    self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED, now)
        outputs: dict[str, RequestOutput] = {}
        for request in step.changed:
            tool_call_kv.after_step(self.manager, request)  # holds while a tool runs
            output = self.outputs.output(request)
            outputs.setdefault(output.request_id, output)
        return list(outputs.values())

    @property
    def num_used_pages(self) -> int:
        """KV pages that requests hold (what a drain waits to see at 0)."""
        return self.manager.num_used_pages

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page of the pool and the host tier (the disk tier keeps its pages);
        KV events say AllBlocksCleared at once. False (nothing done) while requests hold pages."""
        if not self.manager.reset_prefix_cache():
            return False
        self.host_tier.offloaded.clear()  # (AllBlocksCleared covers them: no removal events)
        if self.event_publisher is not None:
            self.event_publisher.publish(self.events.drain())
        return True

    def decode(self, token_ids: list[int]) -> str:
        return self.outputs.decode(token_ids)

    def cache_report(self, tenant: str | None = None) -> dict[str, Any]:
        """The whole report, or (`tenant`: an API key's namespace) that tenant's part only."""
        return self.reporter.report(self.stats(), self.manager.page_states(), tenant)

    # -- leases by id (named caches) -----------------------------------------------------------
    def lease_info(self, tenant: str, lease_id: str) -> LeaseInfo | None:
        lease = self.manager.leases.leases.get(lease_id)
        if lease is None or lease.owner != tenant:
            return None
        return LeaseInfo(lease.lease_id, lease.num_tokens,
                         time.time() + lease.expires_at - self.manager.clock())

    def extend_lease(self, tenant: str, lease_id: str, ttl_s: float) -> LeaseInfo | None:
        if self.lease_info(tenant, lease_id) is None:
            return None
        self.manager.leases.extend(lease_id, ttl_s * self.config.lease_ttl_scale, self.manager.clock())
        return self.lease_info(tenant, lease_id)

    def release_lease(self, tenant: str, lease_id: str) -> bool:
        return self.lease_info(tenant, lease_id) is not None and self.manager.leases.release(lease_id)

    def release_tenant_leases(self, tenant: str) -> int:
        """Release the prompt leases and tool-call holds of `tenant`'s requests (not its named caches)."""
        return self.manager.leases.release_tenant(tenant)

    def expire_leases(self) -> int:
        """Release the leases whose TTL ran out (each step does; an idle server's loop calls it)."""
        return self.manager.expire_leases()

    def stats(self) -> EngineStats:
        """What the engine counts, read without changing anything (engine_stats.EngineStats)."""
        cache = self.manager.stats()
        window_bytes = cache.window.num_pages_used * self.runner.window_page_bytes if cache.window else 0
        return EngineStats(
            cache, self.scheduler.counts(), self.manager.history.num_thrash,
            {t: v.prompt_tokens for t, v in self.reporter.tenants.items()},
            {t: v.cached_tokens for t, v in self.reporter.tenants.items()},
            self.config.page_size, self.cache_config.kv_dtype.name, self.fp8_scale, self.runner.kv_cache_bytes(),
            cache.num_pages_used * self.runner.page_bytes + window_bytes, self.max_model_len,
            (self.cache_config.num_pages - 1) * self.config.page_size, self._spec_stats(),
            num_steps=self.num_steps, num_step_tokens=self.num_step_tokens)

    def _spec_stats(self) -> SpecDecodeStats:
        """A copy of the speculative decoding counters (zeros with speculation off)."""
        spec = self.scheduler.spec
        return SpecDecodeStats() if spec is None else replace(spec.stats, accepted_per_pos=list(
            spec.stats.accepted_per_pos))
